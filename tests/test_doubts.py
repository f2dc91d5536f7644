"""The compiler's doubts said (0.7): a kernel libtpu marks unestimable
(``estimated_cycles`` 2^63 - 1), and a reduction over a non-minor dimension of an
array of 1 GiB or more on any backend, each flagged with its instruction, its shape
and layout, its op name and the fix, in `StepPlan.flags` and `StepTime.flags`;
libtpu's own estimate of each kernel kept beside the model's, and of the step
(`compiler_seconds`) at the chip's clock.

Measured on a TPU v5e: the softmax of ``jax.nn.dot_product_attention(
implementation="xla")`` at 8,192 tokens ran two reductions per layer over
``f32[2,8,8192,8192]`` across its minor dimension, 438 ms each against ~5 ms of
bytes, the only two kernels libtpu marked unestimable. A softmax over the
next-to-minor dimension of ``f32[2,8192,128]`` (8 MiB) is one libtpu marks so too.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from test_targets import has_compiler

import spmdtree as st

# Private: the records and the reader have no public names; a flag is read as its
# record.
from spmdtree._src.step.hlo.opcodes import UNESTIMABLE
from spmdtree._src.step.hlo.reading import Reading, reading_of
from spmdtree._src.step.hlo.schedule import Doubt, Schedule, read_schedule

GIB = 2**30
ONE = AbstractMesh((1,), ("data",))
LIBTPU = pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")


def doubts(flags):
    return [flag for flag in flags if isinstance(flag, Doubt)]


def softmax_across(shape):
    """A softmax over the next-to-minor dimension, compiled by libtpu for one v5e."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    return st.preflight(lambda x: jax.nn.softmax(x, axis=-2), x, mesh=ONE, target="tpu-v5e")


@LIBTPU
def test_a_kernel_libtpu_cannot_estimate_is_flagged_with_its_instruction_and_shape():
    plan = softmax_across((2, 8192, 128))
    (doubt,) = doubts(plan.flags)
    unestimable = [k for k in plan.schedule.kernels() if k.unestimable]
    assert [k.name for k in unestimable] == [doubt.name]
    assert doubt.shape == "f32[2,8192,128]{2,1,0}" and doubt.cycles == UNESTIMABLE
    assert (doubt.reduced, doubt.minor, doubt.bytes) == ((1,), 2, 8 * 2**20)
    assert doubt.op_name.startswith("jit(") and doubt.op_name in doubt
    assert doubt.startswith(f"{doubt.name} reduces f32[2,8192,128]{{2,1,0}} (8.0 MiB, ")
    assert "libtpu cannot estimate it (its estimated_cycles is 2^63 - 1)" in doubt
    assert "splash attention or jax's Pallas flash attention on TPU" in doubt
    assert doubt.endswith("else reduce along the minor dimension")
    # said where the prediction is read too (and a record still, though a child
    # process compiled it)
    assert doubt in plan.time(st.hardware("tpu-v5e")).flags
    # the others keep libtpu's estimate, which times the step at the chip's 1.5 GHz
    (other,) = [k for k in plan.schedule.kernels() if not k.unestimable]
    assert 0 < other.estimated_cycles < UNESTIMABLE
    assert plan.compiler_seconds == other.estimated_cycles / 1.5e9


@LIBTPU
def test_the_softmax_measured_on_a_v5e_is_flagged_as_both():
    # 4 GiB reduced across its minor dimension, and unestimable: the two fusions of
    # the measured step's softmax (its max, and its sum)
    plan = softmax_across((2, 8, 8192, 8192))
    found = doubts(plan.flags)
    assert len(found) == 2 == len([k for k in plan.schedule.kernels() if k.unestimable])
    for doubt in found:
        assert doubt.shape == "f32[2,8,8192,8192]{3,2,1,0}" and doubt.bytes == 4 * GIB
        assert (doubt.reduced, doubt.minor, doubt.cycles) == ((2,), 3, UNESTIMABLE)
        assert "(4.0 GiB, jit(" in doubt and "ran 438 ms against ~5 ms" in doubt


@pytest.mark.parametrize(
    "shape, axis, flagged",
    [
        ((16384, 16384), 0, True),  # 1 GiB across its minor dimension
        ((16383, 16384), 0, False),  # a row under 1 GiB
        ((16384, 16384), 1, False),  # along its minor dimension
    ],
    ids=["1-gib-across", "under-1-gib", "along-the-minor"],
)
def test_a_large_reduction_across_the_minor_dimension_is_flagged_on_any_backend(
    shape, axis, flagged
):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    plan = st.preflight(lambda x: jnp.sum(x, axis=axis), x, mesh=ONE)  # the CPU's compile
    found = doubts(plan.flags)
    assert len(found) == flagged
    if flagged:
        (doubt,) = found
        assert (doubt.shape, doubt.reduced, doubt.minor) == ("f32[16384,16384]{1,0}", (0,), 1)
        assert doubt.bytes == GIB and doubt.cycles == 0 and "libtpu" not in doubt.split(":")[0]
        assert doubt.startswith(f"{doubt.name} reduces f32[16384,16384]{{1,0}} (1.0 GiB, jit(")


#: A module in libtpu's form: a fusion that reduces 1 GiB over dimension 0 (across the
#: minor dimension or along it, as its layout says), with the cycles libtpu estimates
#: for it, and a fusion libtpu estimates at 25 cycles in a loop of 4.
MODULE = """HloModule m, is_scheduled=true

%add (p: f32[], q: f32[]) -> f32[] {{
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %r = f32[] add(%p, %q)
}}

%sum (x: f32[16384,16384]) -> f32[16384] {{
  %x = f32[16384,16384]{{{layout}}} parameter(0)
  %zero = f32[] constant(0)
  ROOT %s = f32[16384]{{0}} reduce(%x, %zero), dimensions={{0}}, to_apply=%add, metadata={{op_name="jit(f)/reduce_sum"}}
}}

%double (y: f32[8]) -> f32[8] {{
  %y = f32[8]{{0}} parameter(0)
  ROOT %z = f32[8]{{0}} add(%y, %y)
}}

%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %s = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[8]{{0}} get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %w = f32[8]{{0}} fusion(%v), kind=kLoop, calls=%double, backend_config={{"window_config":{{"estimated_cycles":"25"}}}}
  ROOT %t = (s32[], f32[8]{{0}}) tuple(%next, %w)
}}

%cond (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}}

ENTRY %main (a: f32[16384,16384], b: f32[8]) -> (f32[16384], (s32[], f32[8])) {{
  %a = f32[16384,16384]{{{layout}}} parameter(0)
  %b = f32[8]{{0}} parameter(1)
  %reduced = f32[16384]{{0}} fusion(%a), kind=kInput, calls=%sum, metadata={{op_name="jit(f)/reduce_sum"}}, backend_config={{"window_config":{{"estimated_cycles":"{cycles}"}}}}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{{0}}) tuple(%zero, %b)
  %loop = (s32[], f32[8]{{0}}) while(%init), condition=%cond, body=%body
  ROOT %out = (f32[16384]{{0}}, (s32[], f32[8]{{0}})) tuple(%reduced, %loop)
}}
"""


@pytest.mark.parametrize(
    "layout, cycles, said",
    [
        ("1,0", 1000, "libtpu estimates it at 1,000 cycles"),  # dimension 0 is major
        ("1,0", UNESTIMABLE, "libtpu cannot estimate it"),
        ("0,1", 1000, None),  # dimension 0 is minor: a reduction along it
        ("0,1", UNESTIMABLE, "f32[16384]{0}, jit(f)/reduce_sum): libtpu cannot estimate it"),
    ],
    ids=["across", "across-unestimable", "along", "along-unestimable"],
)
def test_a_doubt_is_read_from_the_layout_and_the_backend_config(layout, cycles, said):
    schedule = read_schedule(MODULE.format(layout=layout, cycles=cycles), platform="tpu")
    kernels = {k.name: k for k in schedule.kernels()}
    assert kernels["reduced"].estimated_cycles == cycles and kernels["w"].estimated_cycles == 25
    assert kernels["reduced"].unestimable == (cycles == UNESTIMABLE)
    # libtpu's estimate of the step: each kernel's times its calls, what it cannot
    # estimate left out
    assert schedule.compiler_cycles() == (0 if cycles == UNESTIMABLE else cycles) + 4 * 25
    found = doubts(schedule.flags)
    assert len(found) == (said is not None) and all(said in doubt for doubt in found)
    if found and "reduces" in found[0]:
        (doubt,) = found
        assert (doubt.name, doubt.reduced, doubt.minor, doubt.bytes) == ("reduced", (0,), 1, GIB)
    read = reading_of(schedule)
    assert doubts(read.flags) == found
    # each crosses a process boundary as its record, not as a sentence
    again = Schedule.from_dict(schedule.to_dict())
    assert again == schedule and [type(f) for f in again.flags] == [type(f) for f in schedule.flags]
    assert doubts(Reading.from_dict(read.to_dict()).flags) == found


@LIBTPU
def test_libtpus_own_estimate_of_a_step_is_its_kernels_cycles_at_the_chips_clock():
    # 0.6 read cost_analysis()["optimal_seconds"], -2.0 s here (libtpu counts -1 s for
    # each ConcatBitcast of the attention's backward), and so said none
    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    plan = st.preflight(jax.grad(loss, argnums=(0, 1, 2)), q, q, q, mesh=ONE, target="tpu-v5e")
    cycles = plan.schedule.compiler_cycles()
    assert cycles == sum(k.estimated_cycles for k in plan.schedule.kernels()) > 0
    assert plan.compiler_seconds == cycles / 1.5e9
