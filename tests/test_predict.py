"""The predicted step time: each mechanism of the schedule walk against a closed form.

The closed forms are the documented model, computed here from its published
figures (docs/planning.md, "Predicted step time"): a kernel takes the larger of
its FLOPs over the H100's bf16 peak x its MAMF share x its wave efficiency and
its bytes over 90% of the HBM bandwidth, plus 5% of the smaller, plus a 1 us
launch; a collective its ring bytes over the NVLink bandwidth plus the preset's
per-hop latency x (group - 1) plus 5 us. The steps are compiled by XLA GPU for
8 H100s without a device (skipped without ``spmdtree[cuda]``); where a compile
cannot show a case, a small scheduled HLO text does.
"""

import dataclasses
import doctest
import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

# Private: the toolchain, the reader and the model's parts have no public names
from spmdtree._src.step.compile.backends import XLA_GPU, target_for
from spmdtree._src.step.hlo import reading as hlo
from spmdtree._src.step.hlo import schedule as schedule_
from spmdtree._src.step.time import predict
from spmdtree._src.step.time.bound import step_time

PEAK = 989e12  # H100 SXM dense bf16 (data sheet)
MAMF = 794.5 / 989  # maximum achievable matmul FLOPS, H100 SXM (ml-engineering's table)
HBM = 3.35e12 * 0.9  # the data sheet's HBM3 bandwidth, 90% sustained
SMS, TILE = 132, 128
LAUNCH, NCCL = 1e-6, 5e-6  # XLA GPU's kKernelLaunchOverhead, kNcclKernelLaunchOverhead
NVLINK, HOP = 450e9, 2e-6  # the h100 preset's ici link
SHAPE = (("data", 8),)


def kernel(flops, size, batch=1, m=0, n=0, peak=PEAK):
    """A kernel's time by the documented model, its launch included."""
    memory = size / HBM
    compute = 0.0
    if flops:
        tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
        waves = math.ceil(tiles / SMS)
        compute = flops / (peak * MAMF * batch * m * n / (waves * SMS * TILE * TILE))
    return max(compute, memory) + 0.05 * min(compute, memory) + LAUNCH


def gemm(m, n, k, width=2, peak=PEAK):
    """An (m, k) x (k, n) matmul of `width`-byte elements."""
    return kernel(2 * m * n * k, width * (m * k + k * n + m * n), 1, m, n, peak)


def ring(kind, size, group=8):
    """A collective of `size` result bytes over `group` devices of one node."""
    sent = {"all-gather": size, "all-reduce": 2 * size}[kind] * (group - 1) / group
    return sent / NVLINK + HOP * (group - 1) + NCCL


def has_cuda():
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


needs_cuda = pytest.mark.skipif(not has_cuda(), reason="needs pip install 'spmdtree[cuda]'")


@functools.cache
def h100s(n):
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda",
        target_config=target_for(st.hardware("h100")).chip.target_config(),
        topology=f"1x1x{n}",
    ).devices


def compiled(fn, *specs):
    """The module text XLA GPU schedules for `fn` on 8 H100s, its arguments given as
    (shape, dtype, spec) on a data axis, compiled as preflight compiles a target."""
    mesh = jax.make_mesh((8,), ("data",), devices=h100s(8), axis_types=(AxisType.Auto,))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in specs]
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile(XLA_GPU.own_options(deviceless=True)).as_text()


def predicted(text):
    """The module's schedule and its prediction on the h100 preset (one node of 8)."""
    schedule = schedule_.read_schedule(text, SHAPE, platform="cuda")
    hw = st.hardware("h100")
    reading = hlo.read_step(text, SHAPE, platform="cuda")
    timed = step_time(reading.collectives, reading.flops, dict(SHAPE), hw, 8, schedule=schedule)
    return schedule, timed


def kinds(schedule):
    return [type(e).__name__ for e in schedule.events]


@needs_cuda
@pytest.mark.parametrize("width", [4096, 1024], ids=["hidden", "partly-hidden"])
def test_an_async_collective_overlaps_the_compute_between_its_start_and_done(width):
    def step(w, y):
        return y @ y, jax.lax.with_sharding_constraint(w, P())

    text = compiled(step, ((8192, 1024), jnp.float32, P("data")), ((width,) * 2, jnp.bfloat16, P()))
    schedule, timed = predicted(text)
    assert kinds(schedule) == ["Start", "Kernel", "Done"]  # the matmul between them
    between = gemm(width, width, width)
    gathered = ring("all-gather", 8192 * 1024 * 4)
    assert timed.exposed_comm_seconds == pytest.approx(max(0.0, gathered - between), abs=1e-12)
    assert timed.predicted_seconds == pytest.approx(max(between, gathered))
    assert (timed.exposed_comm_seconds == 0) == (width == 4096)


@needs_cuda
def test_a_collective_with_nothing_scheduled_between_is_exposed_whole():
    text = compiled(lambda x: jnp.sum(x, axis=0), ((8, 2**20), jnp.float32, P("data")))
    schedule, timed = predicted(text)
    assert kinds(schedule) == ["Kernel", "Start", "Done"]  # a copy, then the all-reduce
    reduced = ring("all-reduce", 2**20 * 4)
    assert timed.exposed_comm_seconds == pytest.approx(reduced)
    assert timed.predicted_seconds == pytest.approx(kernel(0, 2 * 2**22) + reduced)


@needs_cuda
@pytest.mark.parametrize("layers", [2, 7])
def test_a_loop_runs_its_body_its_trip_count_times(layers):
    def step(x, w):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0]

    specs = ((8 * 4096, 1024), jnp.bfloat16, P("data")), ((layers, 1024, 1024), jnp.bfloat16, P())
    schedule, timed = predicted(compiled(step, *specs))
    (loop,) = [e for e in schedule.events if isinstance(e, schedule_.Loop)]
    assert loop.trips == layers
    one = gemm(4096, 1024, 1024) - LAUNCH
    assert timed.predicted_by_class["matmul"] == pytest.approx(layers * one)
    assert sum(timed.predicted_by_class.values()) == pytest.approx(timed.predicted_seconds)


@needs_cuda
def test_a_memory_bound_fusion_is_timed_by_its_bytes():
    text = compiled(lambda x: jnp.exp(x) * 2 + 1, ((8 * 2**20,), jnp.float32, P("data")))
    schedule, timed = predicted(text)
    (kernel,) = schedule.events
    # read + write, both in HBM (no memory space of its own on a CPU)
    expected = schedule_.Kernel("memory", 0, 2 * 2**20 * 4, name=kernel.name, hbm_waits=2)
    assert kernel._replace(opcode="", shape="", op_name="") == expected
    assert kernel.opcode == "fusion" and kernel.shape == "f32[1048576]{0}"
    assert kernel.name.startswith(("fusion", "loop_")), kernel.name  # as the module names it
    assert timed.predicted_seconds == pytest.approx(2 * 2**22 / HBM + LAUNCH)
    assert timed.predicted_by_class["launch"] == pytest.approx(LAUNCH)


@needs_cuda
@pytest.mark.parametrize("m, n", [(256, 128), (128 * 132, 4096)], ids=["small", "large"])
def test_a_small_gemm_runs_below_peak_and_a_large_one_near_its_mamf(m, n):
    text = compiled(
        lambda a, b: a @ b, ((m, 4096), jnp.bfloat16, P()), ((4096, n), jnp.bfloat16, P())
    )
    _, timed = predicted(text)
    seconds = timed.predicted_by_class["matmul"]
    assert seconds == pytest.approx(gemm(m, n, 4096) - LAUNCH)
    share = 2 * m * n * 4096 / seconds / PEAK
    if m == 256:  # 2 tiles of 128 x 128 on 132 SMs
        assert share < 0.05
    else:  # 32 full waves of tiles
        assert share == pytest.approx(MAMF, rel=0.02)


@needs_cuda
@pytest.mark.parametrize(
    "precision, peak",
    [(None, 494.7e12), (jax.lax.Precision.HIGHEST, 67e12)],
    ids=["tf32", "fp32"],
)
def test_an_f32_matmul_runs_at_its_precisions_rate(precision, peak):
    # the H100 data sheet: TF32 494.7 TFLOPS dense (XLA GPU's default for f32), FP32 67
    def step(a, b):
        return jnp.matmul(a, b, precision=precision)

    m, n, k = 128 * 132, 4096, 4096
    text = compiled(step, ((m, k), jnp.float32, P()), ((k, n), jnp.float32, P()))
    _, timed = predicted(text)
    expected = gemm(m, n, k, width=4, peak=peak * PEAK / 989.4e12) - LAUNCH
    assert timed.predicted_by_class["matmul"] == pytest.approx(expected, rel=1e-3)


@needs_cuda
def test_the_kernels_of_an_attention_scope_are_attention():
    def step(q, k):
        with jax.named_scope("attention"):
            return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)

    spec = ((8 * 4, 1024, 128), jnp.bfloat16, P("data"))
    schedule, timed = predicted(compiled(step, spec, spec))
    assert {e.kind for e in schedule.events if isinstance(e, schedule_.Kernel)} == {"attention"}
    assert timed.predicted_by_class["matmul"] == timed.predicted_by_class["memory"] == 0
    assert timed.predicted_by_class["attention"] > 0


# --- small scheduled texts, where a compile cannot show the case -----------------------

ROW = "replica_groups=[1,8]<=[8], dimensions={0}"


def text(*lines, params="a: bf16[1024,1024], b: bf16[128,1024]"):
    body = "\n".join(f"  {line}" for line in lines)
    return (
        "HloModule m, is_scheduled=true\n"
        f"ENTRY %main ({params}) -> bf16[1024,1024] {{\n"
        "  %a = bf16[1024,1024] parameter(0)\n  %b = bf16[128,1024] parameter(1)\n"
        f"{body}\n}}"
    )


def test_collectives_run_one_at_a_time_on_their_own_stream():
    # two all-gathers started together, a matmul between: the second waits for the first
    two = text(
        f"%start.0 = (bf16[128,1024], bf16[1024,1024]) all-gather-start(%b), {ROW}",
        f"%start.1 = (bf16[128,1024], bf16[1024,1024]) all-gather-start(%b), {ROW}",
        "%d = bf16[1024,1024] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "%gathered.0 = bf16[1024,1024] all-gather-done(%start.0)",
        "%gathered.1 = bf16[1024,1024] all-gather-done(%start.1)",
        "ROOT %r = bf16[1024,1024] add(%gathered.0, %gathered.1)",
    )
    _, timed = predicted(two)
    gathered, between = ring("all-gather", 2**21), gemm(1024, 1024, 1024)
    add = kernel(0, 3 * 2**21)
    assert timed.exposed_comm_seconds == pytest.approx(max(0.0, 2 * gathered - between))
    assert timed.predicted_seconds == pytest.approx(max(2 * gathered, between) + add)


def test_a_synchronous_collective_adds_its_time_in_order():
    sync = text(
        "%d = bf16[1024,1024] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        f"ROOT %g = bf16[1024,1024] all-gather(%b), {ROW}",
    )
    _, timed = predicted(sync)
    gathered = ring("all-gather", 2**21)
    assert timed.predicted_seconds == pytest.approx(gemm(1024, 1024, 1024) + gathered)
    assert timed.exposed_comm_seconds == pytest.approx(gathered)


def test_a_loop_of_unknown_trip_count_is_timed_once_and_flagged():
    loop = """HloModule m, is_scheduled=true
%body (s: (s32[], f32[1048576])) -> (s32[], f32[1048576]) {
  %s = (s32[], f32[1048576]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[1048576] get-tuple-element(%s), index=1
  %y = f32[1048576] exponential(%x)
  ROOT %t = (s32[], f32[1048576]) tuple(%i, %y)
}
%cond (c: (s32[], f32[1048576])) -> pred[] {
  %c = (s32[], f32[1048576]) parameter(0)
  ROOT %p = pred[] constant(true)
}
ENTRY %main (a: f32[1048576]) -> f32[1048576] {
  %a = f32[1048576] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1048576]) tuple(%zero, %a)
  %loop = (s32[], f32[1048576]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1048576] get-tuple-element(%loop), index=1
}"""
    schedule, timed = predicted(loop)
    assert schedule.flags and "trip count" in schedule.flags[0]
    assert timed.predicted_seconds == pytest.approx(kernel(0, 2 * 2**22))


def test_a_fusion_reads_a_slice_of_its_operand_and_updates_in_place():
    stacked = """HloModule m, is_scheduled=true
%take (p: f32[8,1024,1024], i: s32[]) -> f32[1,1024,1024] {
  %p = f32[8,1024,1024] parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %s = f32[1,1024,1024] dynamic-slice(%p, %i, %z, %z), dynamic_slice_sizes={1,1024,1024}
}
%put (p: f32[8,1024,1024], u: f32[1,1024,1024], i: s32[]) -> f32[8,1024,1024] {
  %p = f32[8,1024,1024] parameter(0)
  %u = f32[1,1024,1024] parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[8,1024,1024] dynamic-update-slice(%p, %u, %i, %z, %z)
}
ENTRY %main (a: f32[8,1024,1024], i: s32[]) -> f32[8,1024,1024] {
  %a = f32[8,1024,1024] parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,1024,1024] fusion(%a, %i), kind=kLoop, calls=%take
  %t = f32[1,1024,1024] dynamic-slice(%a, %i, %z, %z), dynamic_slice_sizes={1,1024,1024}
  %e = f32[1,1024,1024] add(%s, %t)
  ROOT %d = f32[8,1024,1024] fusion(%a, %e, %i), kind=kLoop, calls=%put
}"""
    schedule, timed = predicted(stacked)
    layer = 2**22  # one f32[1,1024,1024] slice
    sizes = [e.bytes for e in schedule.events]
    assert sizes == [2 * layer + 4, 2 * layer, 3 * layer, 2 * layer + 4]
    assert timed.predicted_seconds == pytest.approx(sum(kernel(0, size) for size in sizes))


def test_a_fusion_carrying_a_fused_gather_and_nested_slices_reads_only_its_blocks():
    # libtpu's async collective fusions, as in MaxText's blocked attention: the
    # block's scores fused with the next layer's FSDP all-gather, whose shard and
    # gathered buffer the fusion carries through (aliased, in place), and the
    # query block, the mask block taken by nested fusions (one slicing inside, one
    # an elementwise layout copy its slice is taken of). The kernel reads the two
    # blocks and writes the scores; the gather's bytes are the collective's.
    fused = """HloModule m, is_scheduled=true
%take (p: f32[4,1024,1024], i: s32[]) -> f32[1,1024,1024] {
  %p = f32[4,1024,1024] parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %s = f32[1,1024,1024] dynamic-slice(%p, %i, %z, %z), dynamic_slice_sizes={1,1024,1024}
}
%relayout (m: f32[4,1024,1024]) -> f32[4,1024,1024] {
  %m = f32[4,1024,1024] parameter(0)
  ROOT %c = f32[4,1024,1024] copy(%m)
}
%scores (q: f32[4,1024,1024], m: f32[4,1024,1024], i: s32[], w: bf16[64,1024], g: bf16[512,1024]) -> (f32[1,1024,1024], bf16[64,1024], bf16[512,1024], bf16[512,1024]) {
  %q = f32[4,1024,1024] parameter(0)
  %m = f32[4,1024,1024] parameter(1)
  %i = s32[] parameter(2)
  %w = bf16[64,1024] parameter(3)
  %g = bf16[512,1024] parameter(4)
  %z = s32[] constant(0)
  %qb = f32[1,1024,1024] fusion(%q, %i), kind=kLoop, calls=%take
  %mc = f32[4,1024,1024] fusion(%m), kind=kLoop, calls=%relayout
  %mb = f32[1,1024,1024] dynamic-slice(%mc, %i, %z, %z), dynamic_slice_sizes={1,1024,1024}
  %e = f32[1,1024,1024] add(%qb, %mb)
  %ag = bf16[512,1024] all-gather(%w), replica_groups={}, dimensions={0}
  ROOT %t = (f32[1,1024,1024], bf16[64,1024], bf16[512,1024], bf16[512,1024]) tuple(%e, %w, %g, %ag)
}
ENTRY %main (q: f32[4,1024,1024], m: f32[4,1024,1024], i: s32[], w: bf16[64,1024], g: bf16[512,1024]) -> (f32[1,1024,1024], bf16[64,1024], bf16[512,1024], bf16[512,1024]) {
  %q = f32[4,1024,1024] parameter(0)
  %m = f32[4,1024,1024] parameter(1)
  %i = s32[] parameter(2)
  %w = bf16[64,1024] parameter(3)
  %g = bf16[512,1024] parameter(4)
  ROOT %f = (f32[1,1024,1024], bf16[64,1024], bf16[512,1024], bf16[512,1024]) fusion(%q, %m, %i, %w, %g), kind=kOutput, calls=%scores, output_to_operand_aliasing={{1}: (3, {}), {2}: (4, {}), {3}: (4, {})}
}"""
    schedule = schedule_.read_schedule(fused, (), platform="tpu")
    block = 2**22  # one f32[1,1024,1024] block
    (kernel,) = [e for e in schedule.events if isinstance(e, schedule_.Kernel)]
    assert kernel.bytes == 3 * block + 4  # query and mask blocks, the scores, the index
    # Read whole, as 0.5 first did, the fusion would count 4 + 4 + 1 blocks of the
    # inputs and both carried buffers twice: over three times these bytes.
    carried = 2 * (64 * 1024 * 2 + 2 * 512 * 1024 * 2)
    assert 3 * kernel.bytes < 8 * block + block + carried


def test_a_convolution_tiles_its_output_features_where_its_dim_labels_put_them():
    # libtpu writes a dot as a convolution; here its output features (f, 4096) come
    # first and a position dimension of 8 last: tiled by features x positions, the
    # 128 x 128 MXU is full; read by its last dimension as features, 8 of 128.
    conv = "%c = bf16[4096,1024,8] convolution(%x, %w), window={size=1}, dim_labels=0bf_io0->fb0"
    module = (
        "HloModule m, is_scheduled=true\n"
        "ENTRY %main (x: bf16[8,1024,1024], w: bf16[1024,4096,1]) -> bf16[4096,1024,8] {\n"
        "  %x = bf16[8,1024,1024] parameter(0)\n  %w = bf16[1024,4096,1] parameter(1)\n"
        f"  ROOT {conv}\n}}"
    )
    tpu = st.hardware("tpu-v5e").costs()
    (event,) = schedule_.read_schedule(module, (), platform="tpu").events
    assert isinstance(event, schedule_.Kernel) and event.kind == "matmul"
    assert event.flops == 2 * (1024 * 8) * 4096 * 1024
    assert (event.m, event.n) == (1024 * 8, 4096)
    assert predict.wave_efficiency(event.batch, event.m, event.n, tpu) == 1.0


def test_a_conditional_is_timed_as_its_slowest_branch():
    branches = """HloModule m, is_scheduled=true
%small (x: f32[1024]) -> f32[1024] {
  %x = f32[1024] parameter(0)
  ROOT %y = f32[1024] exponential(%x)
}
%large (x: f32[1024]) -> f32[1024] {
  %x = f32[1024] parameter(0)
  %b = f32[1024,1024] broadcast(%x), dimensions={1}
  %r = f32[1024,1024] exponential(%b)
  %s = f32[1,1024] slice(%r), slice={[0:1], [0:1024]}
  ROOT %y = f32[1024] bitcast(%s)
}
ENTRY %main (p: s32[], x: f32[1024]) -> f32[1024] {
  %p = s32[] parameter(0)
  %x = f32[1024] parameter(1)
  ROOT %c = f32[1024] conditional(%p, %x, %x), branch_computations={%small, %large}
}"""
    schedule, timed = predicted(branches)
    (chosen,) = schedule.events
    assert isinstance(chosen, schedule_.Branches) and len(chosen.branches) == 2
    large = kernel(0, 2**12 + 2**22) + kernel(0, 2 * 2**22) + kernel(0, 2 * 2**12)
    assert timed.predicted_seconds == pytest.approx(large)


# --- the records ---------------------------------------------------------------------


def test_a_schedule_crosses_a_process_boundary_as_json():
    row = hlo.Collective("all-gather", 1, 2**20, ("data",), 8)
    events = (
        schedule_.Start(0, row, False),
        schedule_.Loop(3, (schedule_.Kernel("matmul", 8, 64, 1, 2, 2, 2), schedule_.Done(0))),
        schedule_.Branches(((schedule_.Kernel("memory", 0, 4),), ())),
    )
    schedule = schedule_.Schedule(events, "cuda", ("a flag",))
    assert schedule_.Schedule.from_dict(schedule.to_dict()) == schedule


def test_a_step_time_without_a_schedule_predicts_nothing():
    row = hlo.Collective("all-reduce", 1, 2**20, ("data",), 8)
    schedule = schedule_.Schedule((schedule_.Start(0, row, True), schedule_.Done(0)), "cuda")
    timed = step_time([row], 0, {"data": 8}, st.hardware("h100"), 8)
    assert timed.predicted_seconds is None and timed.predicted_by_class is None
    timed = step_time([row], 0, {"data": 8}, st.hardware("h100"), 8, schedule=schedule)
    assert timed.predicted_seconds == pytest.approx(ring("all-reduce", 2**20))
    assert timed.bound_seconds == pytest.approx(ring("all-reduce", 2**20) - NCCL)
    assert timed.flags == ()  # a preset leaves nothing to the defaults


def test_a_hardware_of_ones_own_predicts_from_its_own_figures():
    # 0.5 looked the model up by the hardware's name: a user's own got no prediction,
    # and a preset's figures under another name none either.
    row = hlo.Collective("all-reduce", 1, 2**20, ("data",), 8)
    kernel = schedule_.Kernel("matmul", 10**12, 10**9, 1, 4096, 4096, 4096, "bf16")
    schedule = schedule_.Schedule(
        (kernel, schedule_.Start(0, row, True), schedule_.Done(0)), "cuda"
    )
    h100 = st.hardware("h100")
    renamed = dataclasses.replace(h100, name="mine")
    preset = step_time([row], 10**12, {"data": 8}, h100, 8, schedule=schedule)
    same = step_time([row], 10**12, {"data": 8}, renamed, 8, schedule=schedule)
    assert same == preset and same.flags == ()
    # a preset's name on other figures times those figures
    slower = dataclasses.replace(h100, matmul_efficiency=h100.matmul_efficiency / 2)
    halved = step_time([row], 10**12, {"data": 8}, slower, 8, schedule=schedule)
    assert halved.predicted_by_class["matmul"] == pytest.approx(
        2 * preset.predicted_by_class["matmul"], rel=0.05
    )
    # one built from scratch: its defaults, said
    mine = st.Hardware("mine", 2**30, 1e15, {"ici": (1e11, 0.0)})
    timed = step_time([row], 10**12, {"data": 8}, mine, 8, schedule=schedule)
    assert timed.predicted_seconds is not None and timed.predicted_seconds > 0
    (said,) = timed.flags
    assert "hardware 'mine' leaves out hbm_bytes_per_second, memory_efficiency" in said
    assert "takes their defaults" in said
    # the defaults as documented: 0.8 of the peak on one core, no launch overhead
    compute = 10**12 / (1e15 * 0.8 * predict.wave_efficiency(1, 4096, 4096, mine.costs()))
    memory = 10**9 / (1e15 / 300 * 0.9)
    assert timed.predicted_by_class["matmul"] == pytest.approx(
        max(compute, memory) + 0.05 * min(compute, memory), rel=1e-9
    )
    assert timed.predicted_by_class["launch"] == 0.0
    given = dataclasses.replace(mine, hbm_bytes_per_second=2e12)
    assert (
        "hbm_bytes_per_second"
        not in step_time([row], 10**12, {"data": 8}, given, 8, schedule=schedule).flags[0]
    )


def test_step_time_refuses_a_prediction_that_is_no_time():
    with pytest.raises(ValueError, match=r"StepTime: predicted_seconds is -1\.0"):
        st.StepTime(1.0, {}, predicted_seconds=-1.0)
    with pytest.raises(TypeError, match="StepTime: predicted_by_class is 3"):
        st.StepTime(1.0, {}, predicted_seconds=1.0, predicted_by_class=3)


@pytest.mark.parametrize("preset", ["h100", "h200", "b200"])
def test_a_gpu_cost_model_has_its_chips_bandwidth_and_sms(preset):
    chip, costs = target_for(st.hardware(preset)).chip, st.hardware(preset).costs()
    assert (costs.hbm_bytes_per_second, costs.cores) == (chip.bandwidth, chip.sms)


def test_the_examples_in_the_module_run():
    failures, tried = doctest.testmod(predict, optionflags=doctest.ELLIPSIS)
    assert tried > 0 and failures == 0


def test_a_tpus_on_chip_memory_is_no_hbm_traffic():
    """libtpu places values in its alternate memory (``S(1)``, the chip's VMEM): a
    fusion reads and writes them without HBM. Measured on a TPU v5e (0.7): a blocked
    attention fusion of 117 MB, 96 MB of them in S(1), ran in 34 us, where 117 MB of
    HBM take 179 us. An in-place update into an HBM buffer still writes its update."""

    def module(space):
        layout = "{1,0:T(8,128)S(1)}" if space else "{1,0}"
        return f"""HloModule m, is_scheduled=true
%add (x: f32[1024,1024], y: f32[1024,1024]) -> f32[1024,1024] {{
  %x = f32[1024,1024]{layout} parameter(0)
  %y = f32[1024,1024]{{1,0}} parameter(1)
  ROOT %s = f32[1024,1024]{layout} add(%x, %y)
}}
ENTRY %main (a: f32[1024,1024], b: f32[1024,1024], u: f32[8,1024], i: s32[]) -> (f32[1024,1024], f32[1024,1024]) {{
  %a = f32[1024,1024]{layout} parameter(0)
  %b = f32[1024,1024]{{1,0}} parameter(1)
  %u = f32[8,1024]{layout} parameter(2)
  %i = s32[] parameter(3)
  %f = f32[1024,1024]{layout} fusion(%a, %b), kind=kLoop, calls=%add
  %d = f32[1024,1024]{{1,0}} dynamic-update-slice(%b, %u, %i, %i)
  ROOT %t = (f32[1024,1024]{layout}, f32[1024,1024]{{1,0}}) tuple(%f, %d)
}}"""

    whole, update = 2**22, 8 * 1024 * 4
    kernels = [e for e in schedule_.read_schedule(module(0), (), platform="tpu").events]
    assert [k.bytes for k in kernels] == [3 * whole, 2 * update]
    on_chip = [e for e in schedule_.read_schedule(module(1), (), platform="tpu").events]
    # only the HBM operand is read; the update, read from S(1), still written to HBM
    assert [k.bytes for k in on_chip] == [whole, update]
