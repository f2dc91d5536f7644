"""A TPU's layouts as its kernels run them (0.7): an in-place update libtpu leaves
unfused at an offset known only when it runs, into a dimension its layout tiles,
moves its update at `Hardware.update_efficiency` of the bandwidth (measured on a
TPU v5e: 179 us for f32[8,8,512,128] into f32[8,8,2048,128], where a fused update
or one at a constant offset took 51 us); and an array moves as its layout's tiles
hold it (``T(8,128)``: a minor dimension of 64 takes 128 lanes).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from test_targets import has_compiler

import spmdtree as st

# Private: the schedule's reader has no public name; a hand-written module is read
# by it.
from spmdtree._src.step.hlo.schedule import read_schedule

ONE = AbstractMesh((1,), ("data",))
LIBTPU = pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
BUFFER, BLOCK = (8, 8, 2048, 128), (8, 8, 512, 128)
F32 = jnp.float32


def update_at(offset):
    """A block written into the buffer's second-minor dimension at `offset` (None: an
    offset given when it runs), the buffer donated: a blocked attention's output."""
    args = [jax.ShapeDtypeStruct(BUFFER, F32), jax.ShapeDtypeStruct(BLOCK, F32)]
    if offset is None:
        args.append(jax.ShapeDtypeStruct((), jnp.int32))
        fn = lambda x, u, at: jax.lax.dynamic_update_slice_in_dim(x, u, at, axis=2)  # noqa: E731
    else:
        fn = lambda x, u: jax.lax.dynamic_update_slice_in_dim(x, u, offset, axis=2)  # noqa: E731
    return fn, args


def unfused(plan):
    return [k for k in plan.schedule.kernels() if k.unfused_update]


@LIBTPU
def test_an_update_libtpu_leaves_unfused_moves_at_its_own_rate():
    fn, args = update_at(None)
    plan = st.preflight(fn, *args, mesh=ONE, target="tpu-v5e", donate_argnums=0)
    (kernel,) = unfused(plan)
    assert kernel.opcode == "dynamic-update-slice"
    assert kernel.bytes == 2 * 8 * 8 * 512 * 128 * 4  # its update read and written
    v5e = st.hardware("tpu-v5e")
    bandwidth = v5e.hbm_bytes_per_second
    slow = plan.time(v5e).predicted_seconds
    fast = plan.time(dataclasses.replace(v5e, update_efficiency=0.46)).predicted_seconds
    assert slow >= kernel.bytes / (bandwidth * 0.23)
    assert slow - fast == pytest.approx(kernel.bytes / bandwidth * (1 / 0.23 - 1 / 0.46))


@LIBTPU
def test_an_update_at_a_constant_offset_is_a_memory_kernel():
    fn, args = update_at(512)
    plan = st.preflight(fn, *args, mesh=ONE, target="tpu-v5e", donate_argnums=0)
    assert unfused(plan) == []
    v5e = st.hardware("tpu-v5e")
    same = plan.time(dataclasses.replace(v5e, update_efficiency=0.46)).predicted_seconds
    assert plan.time(v5e).predicted_seconds == same


def test_a_cpus_update_is_no_tpus_unfused_one():
    fn, args = update_at(None)
    plan = st.preflight(fn, *args, mesh=ONE, donate_argnums=0)
    assert unfused(plan) == []


@LIBTPU
def test_a_chip_that_leaves_the_share_out_is_told_only_where_a_step_runs_such_an_update():
    v5p = st.hardware("tpu-v5p")
    assert "update_efficiency" in v5p.left_out
    assert "update_efficiency" not in st.hardware("tpu-v5e").left_out
    for offset, told in ((None, True), (512, False)):
        fn, args = update_at(offset)
        plan = st.preflight(fn, *args, mesh=ONE, target="tpu-v5p", donate_argnums=0)
        flags = plan.time(v5p).flags
        assert any("update_efficiency" in flag for flag in flags) is told, flags


#: A kernel over bf16[4096,64] laid out as `layout` (libtpu picks a layout of its
#: own for a step's parameters where it can; a rotary embedding's halves keep 64
#: minor-most, and their fusions ran 1.9x the unpadded bytes' time on a v5e).
MODULE = """HloModule m, is_scheduled=true

%double (x: bf16[4096,64]) -> bf16[4096,64] {{
  %x = bf16[4096,64]{{{layout}}} parameter(0)
  ROOT %y = bf16[4096,64]{{{layout}}} add(%x, %x)
}}

ENTRY %main (a: bf16[4096,64]) -> bf16[4096,64] {{
  %a = bf16[4096,64]{{{layout}}} parameter(0)
  ROOT %f = bf16[4096,64]{{{layout}}} fusion(%a), kind=kLoop, calls=%double
}}
"""


@pytest.mark.parametrize(
    "layout, row",
    [("1,0:T(8,128)(2,1)", 128), ("0,1:T(8,128)(2,1)", 64), ("1,0", 64)],
    ids=["64-minor-tiled", "4096-minor-tiled", "untiled"],
)
def test_a_tpu_array_moves_as_its_tiles_hold_it(layout, row):
    # tiles of (8, 128): a row of 64 minor-most takes 128 lanes; 4096 minor-most, none
    # wasted; no tiling printed (a CPU's, a GPU's): its own bytes
    (kernel,) = read_schedule(MODULE.format(layout=layout), platform="tpu").events
    assert kernel.bytes == 2 * 4096 * row * 2  # read and written
    assert "T(" not in kernel.shape


#: An update at an offset given when it runs, its buffer in HBM or in the chip's own
#: memory (`S(1)`, where libtpu keeps some): measured on a v5e, a blocked
#: attention's unfused update with its buffer in S(1) ran as slowly as the others.
UPDATE = """HloModule m, is_scheduled=true

ENTRY %main (b: f32[64,2048,128], u: f32[64,512,128], i: s32[]) -> f32[64,2048,128] {{
  %b = f32[64,2048,128]{{2,1,0:T(8,128){space}}} parameter(0)
  %u = f32[64,512,128]{{2,1,0:T(8,128)}} parameter(1)
  %i = s32[] {index}
  %z = s32[] constant(0)
  ROOT %d = f32[64,2048,128]{{2,1,0:T(8,128){space}}} dynamic-update-slice(%b, %u, %z, %i, %z)
}}
"""


@pytest.mark.parametrize("space", ["", "S(1)"], ids=["in-hbm", "on-chip"])
def test_an_unfused_update_moves_its_update_wherever_its_buffer_is(space):
    text = UPDATE.format(space=space, index="parameter(2)")
    (kernel,) = read_schedule(text, platform="tpu").events
    assert kernel.unfused_update
    assert kernel.bytes == 2 * 64 * 512 * 128 * 4


def test_an_update_at_a_constant_offset_is_no_unfused_one_even_left_alone():
    # libtpu fuses these (the test above compiles one); written as a kernel of its
    # own, it still writes its update at the memory's rate, in place
    text = UPDATE.format(space="", index="constant(512)")
    (kernel,) = read_schedule(text, platform="tpu").events
    assert not kernel.unfused_update
    assert kernel.bytes == 2 * 64 * 512 * 128 * 4  # the update read, then written


#: A fusion whose result is a pair, one element in HBM and one in S(1), over a
#: minor dimension of 64 (each row 128 lanes).
PAIR = """HloModule m, is_scheduled=true

%both (x: bf16[4096,64]) -> (bf16[4096,64], bf16[4096,64]) {
  %x = bf16[4096,64]{1,0:T(8,128)(2,1)} parameter(0)
  %y = bf16[4096,64]{1,0:T(8,128)(2,1)} add(%x, %x)
  %z = bf16[4096,64]{1,0:T(8,128)(2,1)S(1)} multiply(%x, %x)
  ROOT %t = (bf16[4096,64]{1,0:T(8,128)(2,1)}, bf16[4096,64]{1,0:T(8,128)(2,1)S(1)}) tuple(%y, %z)
}

ENTRY %main (a: bf16[4096,64]) -> (bf16[4096,64], bf16[4096,64]) {
  %a = bf16[4096,64]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %f = (bf16[4096,64]{1,0:T(8,128)(2,1)}, bf16[4096,64]{1,0:T(8,128)(2,1)S(1)}) fusion(%a), kind=kLoop, calls=%both
}
"""


def test_a_tuples_elements_move_as_their_tiles_and_memory_say():
    # read whole (128 lanes a row), one element written to HBM, the other kept on chip
    (kernel,) = read_schedule(PAIR, platform="tpu").events
    assert kernel.bytes == 2 * (4096 * 128 * 2)


#: An all-gather over 8 devices of an array whose minor dimension is 64, tiled or not.
GATHER = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[512,64]) -> bf16[4096,64] {{
  %a = bf16[512,64]{{{layout}}} parameter(0)
  ROOT %g = bf16[4096,64]{{{layout}}} all-gather(%a), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}
}}
"""


def test_a_collective_sends_its_own_bytes_not_its_tiles():
    # the links move the array's elements: a layout's padding is no traffic on them
    rows = [
        [
            e.row
            for e in read_schedule(
                GATHER.format(layout=layout), (("data", 8),), platform="tpu"
            ).events
            if hasattr(e, "row")
        ]
        for layout in ("1,0:T(8,128)(2,1)", "1,0")
    ]
    assert rows[0] == rows[1] and rows[0][0].bytes in (512 * 64 * 2, 4096 * 64 * 2)


#: A matmul as libtpu writes it: a convolution fusion whose operands each pass
#: through a nested fusion that only bitcasts them (its result its parameter).
WRAPPED = """HloModule m, is_scheduled=true

%wrap (p: bf16[32768,4096]) -> bf16[32768,4096] {
  %p = bf16[32768,4096]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %b = bf16[32768,4096]{1,0:T(8,128)(2,1)} bitcast(%p)
}

%matmul (a: bf16[32768,4096], w: bf16[4096,256]) -> bf16[32768,256] {
  %a = bf16[32768,4096]{1,0:T(8,128)(2,1)} parameter(0)
  %f = bf16[32768,4096]{1,0:T(8,128)(2,1)} fusion(%a), kind=kLoop, calls=%wrap
  %w = bf16[4096,256]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %c = bf16[32768,256]{1,0:T(8,128)(2,1)} convolution(%f, %w), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[32768,4096], y: bf16[4096,256]) -> bf16[32768,256] {
  %x = bf16[32768,4096]{1,0:T(8,128)(2,1)} parameter(0)
  %y = bf16[4096,256]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %m = bf16[32768,256]{1,0:T(8,128)(2,1)} fusion(%x, %y), kind=kOutput, calls=%matmul
}
"""


def test_an_operand_a_nested_fusion_only_bitcasts_is_read_whole():
    # 0.7 read none of it: a v5e's matmul of bf16[32768,4096] by a narrow weight was
    # priced at 175 us and took 410 us, the time of its 268 MB read
    (kernel,) = read_schedule(WRAPPED, platform="tpu").events
    a, w, out = 32768 * 4096 * 2, 4096 * 256 * 2, 32768 * 256 * 2
    assert kernel.bytes == a + w + out
