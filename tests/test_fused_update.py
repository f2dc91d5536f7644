"""A matmul with an optimizer's update fused into its kernel (new in 0.8): libtpu fuses
adamw's moments and step into each weight's gradient; such a kernel is marked
(`Kernel.fused_update`) and its matmul timed at `Hardware.fused_update_efficiency` of
its shape's rate, a share `st.calibrate` measures on the chip.

The modules are hand-written in the shape libtpu prints them (no libtpu needed); no
public function reads HLO text, so these tests call the reader and the model.
"""

import dataclasses
import json

import pytest

import spmdtree as st

# Private: the reader, the per-kernel model and calibrate's inversion of it have no
# public names
from spmdtree._src.step.hlo.schedule import read_schedule
from spmdtree._src.step.measure.calibrate import _share_timed
from spmdtree._src.step.time.predict import fixed_seconds, kernel_seconds

#: A weight's gradient (the tokens contracted), and what the fusion reads and writes
#: beside it: `result` written (adamw's step and moments: 3 f32 arrays of the
#: product's size), the moments `mu` and `nu` read.
MODULE = """HloModule m, is_scheduled=true

%fused (x: bf16[8192,1024], dy: bf16[8192,1024], mu: f32[1024,1024], nu: f32[1024,1024]) -> {result} {{
  %x = bf16[8192,1024]{{1,0}} parameter(0)
  %dy = bf16[8192,1024]{{1,0}} parameter(1)
  %mu = f32[1024,1024]{{1,0}} parameter(2)
  %nu = f32[1024,1024]{{1,0}} parameter(3)
  %g = f32[1024,1024]{{1,0}} dot(%x, %dy), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  %a = f32[1024,1024]{{1,0}} add(%g, %mu)
  %b = f32[1024,1024]{{1,0}} multiply(%g, %nu)
  ROOT %out = {result} {root}
}}

ENTRY %main (x: bf16[8192,1024], dy: bf16[8192,1024], mu: f32[1024,1024], nu: f32[1024,1024]) -> {result} {{
  %x = bf16[8192,1024]{{1,0}} parameter(0)
  %dy = bf16[8192,1024]{{1,0}} parameter(1)
  %mu = f32[1024,1024]{{1,0}} parameter(2)
  %nu = f32[1024,1024]{{1,0}} parameter(3)
  ROOT %step = {result} fusion(%x, %dy, %mu, %nu), kind=kOutput, calls=%fused
}}
"""
THREE = ("(f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, f32[1024,1024]{1,0})", "tuple(%g, %a, %b)")
ONE = ("f32[1024,1024]{1,0}", "add(%a, %b)")

#: A forward matmul that writes its product twice, before and after an activation,
#: reading only its operands: no optimizer's state.
FORWARD = """HloModule m, is_scheduled=true

%fused (x: bf16[8192,1024], w: bf16[1024,1024]) -> (f32[8192,1024], f32[8192,1024]) {
  %x = bf16[8192,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0} parameter(1)
  %h = f32[8192,1024]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %t = f32[8192,1024]{1,0} tanh(%h)
  ROOT %out = (f32[8192,1024]{1,0}, f32[8192,1024]{1,0}) tuple(%h, %t)
}

ENTRY %main (x: bf16[8192,1024], w: bf16[1024,1024]) -> (f32[8192,1024], f32[8192,1024]) {
  %x = bf16[8192,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0} parameter(1)
  ROOT %forward = (f32[8192,1024]{1,0}, f32[8192,1024]{1,0}) fusion(%x, %w), kind=kOutput, calls=%fused
}
"""
CHIP = st.hardware("tpu-v5e")


def kernel(result, root):
    (found,) = read_schedule(MODULE.format(result=result, root=root), platform="tpu").events
    return found


@pytest.mark.parametrize("written, fused", [(THREE, True), (ONE, False)], ids=["three", "one"])
def test_a_matmul_that_reads_and_writes_two_or_more_arrays_of_its_products_size_holds_an_update(
    written, fused
):
    assert kernel(*written).fused_update is fused


def test_a_forward_matmul_that_writes_its_product_twice_holds_none():
    (found,) = read_schedule(FORWARD, platform="tpu").events
    assert found.flops and not found.fused_update


def test_a_fused_updates_matmul_runs_at_the_share_the_chip_keeps_for_it():
    found = kernel(*THREE)
    slow = dataclasses.replace(CHIP, fused_update_efficiency=0.5)
    compute = found.flops / CHIP.flops_per_second  # the preset's share: 1
    # compute-bound: the matmul's time doubles at half the share
    assert kernel_seconds(found, CHIP.costs(), CHIP.flops_per_second) == pytest.approx(
        compute + 0.05 * kernel_seconds(found._replace(flops=0), CHIP.costs(), 1.0)
    )
    assert kernel_seconds(found, slow.costs(), CHIP.flops_per_second) == pytest.approx(
        2 * compute + 0.05 * kernel_seconds(found._replace(flops=0), CHIP.costs(), 1.0)
    )
    # the preset leaves it out; a prediction that uses it says so
    assert "fused_update_efficiency" in CHIP.left_out
    assert CHIP.costs().fused_update_efficiency == 1.0


@pytest.mark.parametrize("share", [0.9, 0.62, 0.3])
def test_calibrate_reads_the_share_at_which_the_model_times_the_kernel_as_measured(share):
    found = kernel(*THREE)
    costs = dataclasses.replace(CHIP.costs(), fused_update_efficiency=share)
    peak = CHIP.flops_per_second
    measured = kernel_seconds(found, costs, peak) + fixed_seconds(found, costs)
    assert _share_timed(found, measured, CHIP.costs(), peak) == pytest.approx(share, rel=1e-6)
    # a kernel that ran no slower than its shape's share allows keeps all of it
    assert _share_timed(found, measured / 10, CHIP.costs(), peak) == 1.0
    # one slower than any share explains is none of its doing
    assert _share_timed(found, 1e3, CHIP.costs(), peak) is None


def test_fused_update_efficiency_goes_to_json_and_back_and_a_file_without_it_reads():
    chip = dataclasses.replace(CHIP, fused_update_efficiency=0.62)
    assert st.Hardware.from_json(chip.to_json()).fused_update_efficiency == 0.62
    older = json.loads(chip.to_json())
    del older["fused_update_efficiency"]
    read = st.Hardware.from_json(json.dumps(older))
    assert read.fused_update_efficiency is None and read.costs().fused_update_efficiency == 1.0
    with pytest.raises(ValueError, match="fused_update_efficiency"):
        dataclasses.replace(CHIP, fused_update_efficiency=1.5)
