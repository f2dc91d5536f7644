"""What a TPU's kernels read and wait for (new in 0.8): a reduction broadcast back
reads its operand a second time; the scalar unit runs scalar ops with no kernel; a
scalar in HBM is waited for as an array is, a constant is not; a kernel waits for
HBM once each way it goes there; it moves what the chip's own memory holds at that
memory's measured rate, and slices written side by side are read as one for nothing.

The modules are hand-written in the shape libtpu prints them (no libtpu needed); no
public function reads HLO text, so these tests call the reader.
"""

import dataclasses
import json

import pytest

import spmdtree as st

# Private: the reader, its records and the per-kernel model have no public names
from spmdtree._src.step.hlo.schedule import Kernel, read_schedule
from spmdtree._src.step.time.bound import step_time
from spmdtree._src.step.time.predict import fixed_seconds, kernel_seconds

#: A softmax over dimension 3 of f32[8,8,256,256] laid out {2,3,1,0} (dimension 2
#: minor), as libtpu fuses it: the maximum as a reduce-window whose window is `size`
#: wide over dimension 3 (padded to span it), subtracted, exponentiated and summed.
SOFTMAX = """HloModule m, is_scheduled=true

%max (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}}

%add (c: f32[], d: f32[]) -> f32[] {{
  %c = f32[] parameter(0)
  %d = f32[] parameter(1)
  ROOT %s = f32[] add(%c, %d)
}}

%fused (p: f32[8,8,256,256]) -> (f32[8,8,256], f32[8,8,256,256]) {{
  %p = f32[8,8,256,256]{{2,3,1,0:T(8,128)}} parameter(0)
  %low = f32[] constant(-inf)
  %window = f32[8,8,256,256]{{2,3,1,0:T(8,128)}} reduce-window(%p, %low), window={{size=1x1x1x{size} pad=0_0x0_0x0_0x{pad}_{pad}}}, to_apply=%max
  %sub = f32[8,8,256,256]{{2,3,1,0:T(8,128)}} subtract(%p, %window)
  %exp = f32[8,8,256,256]{{2,3,1,0:T(8,128)}} exponential(%sub)
  %zero = f32[] constant(0)
  %sum = f32[8,8,256]{{2,1,0:T(8,128)S(1)}} reduce(%exp, %zero), dimensions={{3}}, to_apply=%add
  ROOT %t = (f32[8,8,256]{{2,1,0:T(8,128)S(1)}}, f32[8,8,256,256]{{2,3,1,0:T(8,128)}}) tuple(%sum, %exp)
}}

ENTRY %main (x: f32[8,8,256,256]) -> (f32[8,8,256], f32[8,8,256,256]) {{
  %x = f32[8,8,256,256]{{2,3,1,0:T(8,128)}} parameter(0)
  ROOT %softmax = (f32[8,8,256]{{2,1,0:T(8,128)S(1)}}, f32[8,8,256,256]{{2,3,1,0:T(8,128)}}) fusion(%x), kind=kOutput, calls=%fused
}}
"""
WHOLE = 8 * 8 * 256 * 256 * 4


@pytest.mark.parametrize(
    "size, pad, reads", [(511, 255, 2), (3, 1, 1)], ids=["spanning", "a-pooling-window"]
)
def test_a_reduction_broadcast_back_reads_its_operand_again_for_the_ops_that_use_it(
    size, pad, reads
):
    # the window spans dimension 3: the subtract cannot start before the whole of it
    # is read (a TPU v5e ran such a fusion in the time of three passes, not two); a
    # pooling window of 3 is read as it goes
    (kernel,) = read_schedule(SOFTMAX.format(size=size, pad=pad), platform="tpu").events
    assert kernel.bytes == reads * WHOLE + WHOLE  # the exp written; the sum on the chip


#: A loop's step as libtpu schedules it: a counter's scalar ops, a row's flag
#: reduced into a scalar in HBM, and a select that reads it; `space` the flag's.
SCALARS = """HloModule m, is_scheduled=true

%and (p: pred[], q: pred[]) -> pred[] {{
  %p = pred[] parameter(0)
  %q = pred[] parameter(1)
  ROOT %r = pred[] and(%p, %q)
}}

%flag (a: s32[2]) -> pred[] {{
  %a = s32[2]{{0:T(128)S(1)}} parameter(0)
  %zero = s32[] constant(0)
  %zeros = s32[2]{{0:T(128)}} broadcast(%zero), dimensions={{}}
  %ge = pred[2]{{0:T(512)}} compare(%a, %zeros), direction=GE
  %true = pred[] constant(true)
  ROOT %all = pred[]{{:T(512){space}}} reduce(%ge, %true), dimensions={{0}}, to_apply=%and
}}

%pick (f: pred[], x: bf16[1,768], y: bf16[1,768]) -> bf16[1,768] {{
  %f = pred[]{{:T(512){space}}} parameter(0)
  %x = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} parameter(1)
  %y = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} parameter(2)
  %b = pred[1,768]{{1,0:T(2,128)(4,1)}} broadcast(%f), dimensions={{}}
  ROOT %s = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} select(%b, %x, %y)
}}

ENTRY %main (i: s32[], a: s32[2], x: bf16[1,768], y: bf16[1,768]) -> (s32[], bf16[1,768]) {{
  %i = s32[]{{:T(128)S(6)}} parameter(0)
  %a = s32[2]{{0:T(128)S(1)}} parameter(1)
  %x = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} parameter(2)
  %y = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} parameter(3)
  %one = s32[]{{:T(128)}} constant(1)
  %next = s32[]{{:T(128)}} add(%i, %one)
  %flag = pred[]{{:T(512){space}}} fusion(%a), kind=kLoop, calls=%flag
  %picked = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} fusion(%flag, %x, %y), kind=kLoop, calls=%pick
  %index = s32[]{{:T(128)S(1)}} bitcast(%a)
  %row = bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}} dynamic-slice(%picked, %one, %one), dynamic_slice_sizes={{1,768}}
  ROOT %out = (s32[]{{:T(128)}}, bf16[1,768]{{1,0:T(2,128)(2,1)S(1)}}) tuple(%next, %row)
}}
"""


@pytest.mark.parametrize("space, waits", [("", 1), ("S(1)", 0)], ids=["hbm", "on-chip"])
def test_the_scalar_unit_runs_scalar_ops_and_a_scalar_in_hbm_is_waited_for(space, waits):
    events = read_schedule(SCALARS.format(space=space), platform="tpu").events
    kernels = {k.name: k for k in events if isinstance(k, Kernel)}
    # the counter's add reads and writes scalars only: the scalar unit's, no kernel
    assert sorted(kernels) == ["flag", "picked", "row"]
    # the flag is written where it is, and the select reads it there: a scalar in
    # HBM waits as an array does
    assert (kernels["flag"].hbm_waits, kernels["picked"].hbm_waits) == (waits, waits)
    # a constant index is the instruction's own, not a read of HBM
    assert kernels["row"].hbm_waits == 0


def test_a_gpu_runs_a_kernel_for_a_scalar_op():
    events = read_schedule(SCALARS.format(space=""), platform="cuda").events
    assert "next" in {k.name for k in events if isinstance(k, Kernel)}


#: A tiny kernel that reads a row of a table and writes it, each `read` / `written`
#: in HBM ("") or in the chip's own memory ("S(1)").
ROW = """HloModule m, is_scheduled=true

ENTRY %main (t: f32[8192,128], i: s32[]) -> f32[8,128] {{
  %t = f32[8192,128]{{1,0:T(8,128){read}}} parameter(0)
  %i = s32[]{{:T(128)S(6)}} parameter(1)
  %z = s32[] constant(0)
  ROOT %row = f32[8,128]{{1,0:T(8,128){written}}} dynamic-slice(%t, %i, %z), dynamic_slice_sizes={{8,128}}
}}
"""


@pytest.mark.parametrize(
    "read, written, waits", [("", "", 2), ("", "S(1)", 1), ("S(1)", "", 1), ("S(1)", "S(1)", 0)]
)
def test_a_kernel_waits_for_hbm_once_each_way_it_goes_there(read, written, waits):
    # on a TPU v5e, tiny kernels that only read HBM ran 0.35 us a call (the median
    # of 58 across six training steps), those that read and write it 0.59 us (186)
    (row,) = read_schedule(ROW.format(read=read, written=written), platform="tpu").events
    assert row.hbm_waits == waits
    chip = dataclasses.replace(st.hardware("tpu-v5e"), launch_seconds=5e-8, access_seconds=3e-7)
    assert fixed_seconds(row, chip.costs()) == pytest.approx(5e-8 + waits * 3e-7)


#: A scalar loss's fusion on a TPU: scalars in and out, but an array's work inside
#: (an iota summed) and, in `SUMMED`, a collective of the result.
SCALAR_FUSION = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%loss (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %i = f32[4096,4096]{1,0:T(8,128)} iota(), iota_dimension=1
  %zero = f32[] constant(0)
  %sum = f32[] reduce(%i, %zero), dimensions={0,1}, to_apply=%add
  ROOT %l = f32[] multiply(%sum, %x)
}

ENTRY %main (x: f32[]) -> f32[] {
  %x = f32[]{:T(128)S(6)} parameter(0)
  %summed = f32[]{:T(128)S(6)} fusion(%x), kind=kLoop, calls=%loss
  ROOT %r = f32[]{:T(128)S(6)} all-reduce(%summed), replica_groups={{0,1}}, to_apply=%add
}
"""


def test_a_fusion_of_scalars_runs_its_kernel_and_a_scalar_collective_is_timed():
    # only a single op of scalars is the scalar unit's: a fusion that reads and writes
    # scalars may hold an array's work, and a collective of a scalar runs on the links
    events = read_schedule(SCALAR_FUSION, (("data", 2),), platform="tpu").events
    assert [type(e).__name__ for e in events] == ["Kernel", "Start", "Done"]
    assert events[0].name == "summed"


#: A transpose of an f32 array and an elementwise pass over it, as libtpu schedules a
#: chain of them: `source` and `moved` in HBM ("") or the chip's own memory ("S(1)"),
#: and the slices two async copies wrote side by side read as one array
#: (``ConcatBitcast``).
CHAIN = """HloModule m, is_scheduled=true

%scaled (p: f32[1024,1024]) -> f32[1024,1024] {{
  %p = f32[1024,1024]{{0,1:T(8,128){moved}}} parameter(0)
  %c = f32[] constant(2)
  %b = f32[1024,1024]{{0,1:T(8,128)}} broadcast(%c), dimensions={{}}
  ROOT %m = f32[1024,1024]{{0,1:T(8,128)S(1)}} multiply(%p, %b)
}}

ENTRY %main (x: f32[1024,1024], a: f32[512,1024], b: f32[512,1024]) -> f32[1024,1024] {{
  %x = f32[1024,1024]{{1,0:T(8,128){source}}} parameter(0)
  %a = f32[512,1024]{{1,0:T(8,128)S(1)}} parameter(1)
  %b = f32[512,1024]{{1,0:T(8,128)S(1)}} parameter(2)
  %joined = f32[1024,1024]{{1,0:T(8,128)S(1)}} custom-call(%a, %b), custom_call_target="ConcatBitcast"
  %moved = f32[1024,1024]{{0,1:T(8,128){moved}}} copy(%x)
  ROOT %scaled = f32[1024,1024]{{0,1:T(8,128)S(1)}} fusion(%moved), kind=kLoop, calls=%scaled
}}
"""
ARRAY = 1024 * 1024 * 4


@pytest.mark.parametrize(
    "source, moved, hbm, on_chip",
    [("", "", 2 * ARRAY, 0), ("", "S(1)", ARRAY, ARRAY), ("S(1)", "S(1)", 0, 2 * ARRAY)],
    ids=["hbm", "into-the-chip", "on-the-chip"],
)
def test_a_kernel_moves_what_the_chip_holds_at_its_own_rate(source, moved, hbm, on_chip):
    events = read_schedule(CHAIN.format(source=source, moved=moved), platform="tpu").events
    # the slices read as one array run no kernel: their copies wrote them side by side
    copy, scaled = events
    # each kernel's bytes split by the memory that holds them, counted alike
    assert (copy.bytes, copy.on_chip) == (hbm, on_chip)
    assert scaled.on_chip == ARRAY + (ARRAY if moved else 0)
    v5e = st.hardware("tpu-v5e")
    costs = v5e.costs()
    hbm_time = hbm / (costs.hbm_bytes_per_second * costs.memory_efficiency)
    # left out (the presets': none is published), the chip's own memory is free, as in 0.7
    assert kernel_seconds(copy, costs, v5e.flops_per_second) == pytest.approx(hbm_time)
    # measured, it moves at its rate, beside HBM's traffic: the slower is the kernel's
    rate = 2e12
    chip = dataclasses.replace(costs, on_chip_bytes_per_second=rate)
    timed = kernel_seconds(copy, chip, v5e.flops_per_second)
    assert timed == pytest.approx(max(hbm_time, on_chip / rate))
    read = scaled.bytes / (costs.hbm_bytes_per_second * costs.memory_efficiency)
    assert kernel_seconds(scaled, chip, v5e.flops_per_second) == pytest.approx(
        max(read, scaled.on_chip / rate)
    )


def test_a_prediction_says_it_left_the_chips_own_memory_free():
    schedule = read_schedule(CHAIN.format(source="S(1)", moved="S(1)"), platform="tpu")
    preset = step_time([], 0, {}, st.hardware("tpu-v5e"), schedule=schedule)
    assert any("on_chip_bytes_per_second" in flag for flag in preset.flags)
    measured = dataclasses.replace(st.hardware("tpu-v5e"), on_chip_bytes_per_second=2e12)
    timed = step_time([], 0, {}, measured, schedule=schedule)
    assert not any("on_chip_bytes_per_second" in flag for flag in timed.flags)
    # the copy's and the pass's reads and writes, all on the chip
    assert timed.predicted_seconds == pytest.approx(4 * ARRAY / 2e12)


def test_on_chip_bytes_per_second_goes_to_json_and_back_and_a_file_without_it_reads():
    chip = dataclasses.replace(st.hardware("tpu-v5e"), on_chip_bytes_per_second=2e12)
    assert st.Hardware.from_json(chip.to_json()).on_chip_bytes_per_second == 2e12
    older = json.loads(chip.to_json())
    del older["on_chip_bytes_per_second"]
    read = st.Hardware.from_json(json.dumps(older))
    assert read.on_chip_bytes_per_second is None
    assert read.costs().on_chip_bytes_per_second == 0.0  # free, as in 0.7
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="on_chip_bytes_per_second"):
            dataclasses.replace(chip, on_chip_bytes_per_second=bad)


#: A layer's slice of a stacked f32[2,1024,1024] held on the chip, written in place
#: into a stack in HBM and, as a bitcast, into the chip's own memory: a fusion as
#: libtpu builds a scanned ViT's (its bitcasts' layouts say ``S(1)``, their sliced
#: operands' do not).
SLICED = """HloModule m, is_scheduled=true

%fused (p: f32[2,1024,1024], q: f32[4,1024,1024], i: s32[]) -> (f32[4,1024,1024], f32[1024,1024]) {
  %p = f32[2,1024,1024]{2,1,0:T(8,128)S(1)} parameter(0)
  %q = f32[4,1024,1024]{2,1,0:T(8,128)} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %s = f32[1,1024,1024]{2,1,0:T(8,128)} slice(%p), slice={[1:2], [0:1024], [0:1024]}
  %u = f32[4,1024,1024]{2,1,0:T(8,128)} dynamic-update-slice(%q, %s, %i, %z, %z)
  %b = f32[1024,1024]{1,0:T(8,128)S(1)} bitcast(%s)
  ROOT %t = (f32[4,1024,1024]{2,1,0:T(8,128)}, f32[1024,1024]{1,0:T(8,128)S(1)}) tuple(%u, %b)
}

ENTRY %main (x: f32[2,1024,1024], y: f32[4,1024,1024], j: s32[]) -> (f32[4,1024,1024], f32[1024,1024]) {
  %x = f32[2,1024,1024]{2,1,0:T(8,128)S(1)} parameter(0)
  %y = f32[4,1024,1024]{2,1,0:T(8,128)} parameter(1)
  %j = s32[] parameter(2)
  ROOT %f = (f32[4,1024,1024]{2,1,0:T(8,128)}, f32[1024,1024]{1,0:T(8,128)S(1)}) fusion(%x, %y, %j), kind=kLoop, calls=%fused
}
"""


def test_a_bitcast_at_a_fusions_root_writes_into_the_memory_its_own_layout_names():
    (kernel,) = read_schedule(SLICED, platform="tpu").kernels()
    # HBM: the update written in place and its index read, nothing of the stack it goes into
    assert kernel.bytes == ARRAY + 4
    # the chip: the slice read, and its bitcast written (0.7 counted it in HBM)
    assert kernel.on_chip == 2 * ARRAY


#: A matmul of f32[1024,1024] by itself, its operand and result in the chip's own
#: memory (an attention's weighted sum, as libtpu keeps it there).
HELD_MATMUL = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %d = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_matmul_reads_the_chips_own_memory_in_its_measured_share():
    (matmul,) = read_schedule(HELD_MATMUL, platform="tpu").kernels()
    assert (matmul.bytes, matmul.on_chip) == (0, 3 * 1024 * 1024 * 2)
    v5e = st.hardware("tpu-v5e")
    costs = v5e.costs()
    compute = kernel_seconds(matmul, costs, v5e.flops_per_second)
    # a rate for the chip's own memory (its copies') leaves the matmul's time as it was:
    # the matrix unit reads its operands there as it multiplies
    slow = dataclasses.replace(costs, on_chip_bytes_per_second=1e9)
    assert kernel_seconds(matmul, slow, v5e.flops_per_second) == compute
    assert compute == pytest.approx(matmul.flops / (v5e.flops_per_second * costs.matmul_efficiency))
    # so a prediction of it on a preset leaves out no figure it would have used
    schedule = read_schedule(HELD_MATMUL, platform="tpu")
    preset = step_time([], 0, {}, st.hardware("tpu-v5e"), schedule=schedule)
    assert not any("on_chip_bytes_per_second" in flag for flag in preset.flags)
    # but rows it gathers there by index (a grouped matmul's) move at that memory's rate
    rows = 64 * 2**20
    grouped = matmul._replace(grouped=True, indexed=rows, bytes=rows, on_chip=rows)
    assert grouped.rows_on_chip
    assert kernel_seconds(grouped, slow, v5e.flops_per_second) >= rows / 1e9


def test_a_share_left_unset_or_not_a_number_is_the_memory_share():
    (reduce, _) = read_schedule(READS.format(result=""), platform="tpu").kernels()
    costs = st.hardware("tpu-v5e").costs()
    at_memory = kernel_seconds(reduce, costs, 197e12)
    for unset in (0.0, float("nan")):  # Costs built by hand: 0 says "the memory share"
        odd = dataclasses.replace(costs, read_efficiency=unset)
        assert kernel_seconds(reduce, odd, 197e12) == at_memory


#: An embedding's gradient as libtpu fuses it (flax.nnx Gemma's): 2,048 rows of
#: bf16[2048,1152] added by index into a table of 262,144 rows, all in HBM. The
#: fusion's body ends in `{lines}`: the scatter into the table it is given (a
#: parameter, bitcast or not: the buffer it writes in place) or into one it makes (a
#: broadcast of zeros, written whole first), returned as it is, bitcast, or negated.
EMBEDDING_GRAD = """HloModule m, is_scheduled=true

%add (a: bf16[], b: bf16[]) -> bf16[] {{
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %c = bf16[] add(%a, %b)
}}

%fused (p0: bf16[262144,1152], p1: s32[2048,1], p2: bf16[2048,1152]) -> bf16[262144,1152] {{
  %p0 = bf16[262144,1152]{{1,0:T(8,128)(2,1)}} parameter(0)
  %p1 = s32[2048,1]{{1,0:T(8,128)}} parameter(1)
  %p2 = bf16[2048,1152]{{1,0:T(8,128)(2,1)}} parameter(2)
{lines}
}}

ENTRY %main (t: bf16[262144,1152], i: s32[2048,1], u: bf16[2048,1152]) -> bf16[262144,1152] {{
  %t = bf16[262144,1152]{{1,0:T(8,128)(2,1)}} parameter(0)
  %i = s32[2048,1]{{1,0:T(8,128)}} parameter(1)
  %u = bf16[2048,1152]{{1,0:T(8,128)(2,1)}} parameter(2)
  ROOT %f = bf16[262144,1152]{{1,0:T(8,128)(2,1)}} fusion(%t, %i, %u), kind=kCustom, calls=%fused
}}
"""
TABLE_LAYOUT = "bf16[262144,1152]{1,0:T(8,128)(2,1)}"
SCATTER = (
    f"%s = {TABLE_LAYOUT} scatter(TABLE, %p1, %p2), update_window_dims={{1}}, "
    "inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, "
    "to_apply=%add"
)
MADE = {
    "%p0": "",
    "%b0": f"  %b0 = {TABLE_LAYOUT} bitcast(%p0)\n",
    "%zeros": f"  %zero = bf16[] constant(0)\n  %zeros = {TABLE_LAYOUT} broadcast(%zero), dimensions={{}}\n",
}
RETURNED = {
    "as-it-is": "",
    "bitcast": f"\n  ROOT %r = {TABLE_LAYOUT} bitcast(%s)",
    "negated": f"\n  ROOT %r = {TABLE_LAYOUT} negate(%s)",
}
TABLE = 262144 * 1152 * 2
ROWS = 2048 * 1152 * 2
INDICES = 2048 * 128 * 4  # s32[2048,1] in tiles of (8, 128)


def embedding_grad(table: str, returned: str) -> str:
    """EMBEDDING_GRAD's module with its scatter into `table`, `returned` as RETURNED says."""
    scatter = SCATTER.replace("TABLE", table)
    root = "" if RETURNED[returned] else "ROOT "
    lines = f"{MADE[table]}  {root}{scatter}{RETURNED[returned]}"
    return EMBEDDING_GRAD.format(lines=lines)


@pytest.mark.parametrize(
    "table, returned, written",
    [
        ("%p0", "as-it-is", 2 * ROWS),
        ("%b0", "as-it-is", 2 * ROWS),
        ("%p0", "bitcast", 2 * ROWS),
        ("%zeros", "as-it-is", TABLE),
        ("%p0", "negated", 2 * TABLE),
    ],
    ids=["in-place", "into-a-bitcast", "returned-bitcast", "made-inside", "not-returned"],
)
def test_a_scatter_into_the_table_it_was_given_moves_its_rows_not_the_table(
    table, returned, written
):
    (kernel,) = read_schedule(embedding_grad(table, returned), platform="tpu").kernels()
    # its rows: each update read, and the row it lands on read and written (an add)
    assert kernel.indexed == 3 * ROWS
    # HBM: its indices and updates read; where the table is the buffer it was given
    # and it returns it (bitcast or not), the rows it adds into, read and written
    # (0.7 counted the table read and written whole: 1.85 ms on a v5e
    # for a kernel that ran in 0.3); a table it makes, written whole; one it does not
    # return (negated), read whole and its negation written
    assert kernel.bytes == INDICES + ROWS + written
    assert kernel.on_chip == 0


#: A sum over the rows of f32[2048,1024] (`{result}`: written to HBM, or kept on
#: the chip), and a copy of it: what st.calibrate's read_efficiency times, and its
#: memory pass.
READS = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}}

ENTRY %main (x: f32[2048,1024]) -> (f32[1024], f32[2048,1024]) {{
  %x = f32[2048,1024]{{1,0:T(8,128)}} parameter(0)
  %zero = f32[] constant(0)
  %sum = f32[1024]{{0:T(1024){result}}} reduce(%x, %zero), dimensions={{0}}, to_apply=%add
  %copy = f32[2048,1024]{{0,1:T(8,128)}} copy(%x)
  ROOT %t = (f32[1024]{{0:T(1024){result}}}, f32[2048,1024]{{0,1:T(8,128)}}) tuple(%sum, %copy)
}}
"""
WHOLE_READ = 2048 * 1024 * 4


@pytest.mark.parametrize("result", ["", "S(1)"], ids=["row-to-hbm", "row-on-chip"])
def test_a_kernel_that_only_reads_hbm_streams_at_the_read_share(result):
    reduce, copy = read_schedule(READS.format(result=result), platform="tpu").kernels()
    # the sum writes a row (at most 1/100 of what it reads): it only reads; the copy writes
    assert reduce.reads_only and not copy.reads_only
    assert reduce.bytes == WHOLE_READ + 4 + (4096 if not result else 0)  # its constant
    v5e = st.hardware("tpu-v5e")
    costs = v5e.costs()
    # left out (every preset's: none is published), at the memory kernels' share, as in 0.7
    assert costs.read_efficiency == costs.memory_efficiency
    at_memory = reduce.bytes / (costs.hbm_bytes_per_second * costs.memory_efficiency)
    assert kernel_seconds(reduce, costs, v5e.flops_per_second) == pytest.approx(at_memory)
    # measured, its reads stream at their own share; the copy keeps the memory share
    chip = dataclasses.replace(costs, read_efficiency=0.9, memory_efficiency=0.8)
    read = reduce.bytes / (costs.hbm_bytes_per_second * 0.9)
    assert kernel_seconds(reduce, chip, v5e.flops_per_second) == pytest.approx(read)
    moved = copy.bytes / (costs.hbm_bytes_per_second * 0.8)
    assert kernel_seconds(copy, chip, v5e.flops_per_second) == pytest.approx(moved)


def test_read_efficiency_is_said_where_left_out_and_goes_to_json_and_back():
    schedule = read_schedule(READS.format(result=""), platform="tpu")
    preset = step_time([], 0, {}, st.hardware("tpu-v5e"), schedule=schedule)
    assert any("read_efficiency" in flag for flag in preset.flags)
    chip = dataclasses.replace(st.hardware("tpu-v5e"), read_efficiency=0.95)
    timed = step_time([], 0, {}, chip, schedule=schedule)
    assert not any("read_efficiency" in flag for flag in timed.flags)
    assert timed.predicted_seconds < preset.predicted_seconds  # 0.95 of HBM, over the preset's
    assert st.Hardware.from_json(chip.to_json()).read_efficiency == 0.95
    older = json.loads(chip.to_json())
    del older["read_efficiency"]
    assert st.Hardware.from_json(json.dumps(older)).costs().read_efficiency == (
        chip.costs().memory_efficiency
    )
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="read_efficiency"):
            dataclasses.replace(chip, read_efficiency=bad)
