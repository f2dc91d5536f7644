"""The predicted step time over grids: the walk, each kernel and the compiled loops
against oracles this file computes itself.

- the walk (`predict`) over drawn schedules (kernels, async collectives hidden
  or not, synchronous ones, async copies (new in 0.8), loops of any trip count,
  nested, conditionals): against a plain simulation of the documented model's
  streams here, which
  unrolls every loop (spmdtree walks three iterations and repeats the last
  one's change);
- the tile and wave quantization (`wave_efficiency`) over matmul shapes and
  chips: against placing each tile on a core, wave by wave, and counting the
  slots it fills;
- a compiled step's loops, written as a fori loop or a while loop counting up
  or down (`<`, `<=`, `!=`, `>`), over mesh sizes: its predicted matmul time
  against the loop's simulated trip count times the documented model's time
  for one (M, K) x (K, K) matmul at 2MK^2 FLOPs.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as hs
from test_step_properties import COMPARE, K, M, examples, loop_plan, loops, simulated_trips

import spmdtree as st

# Private: the schedule's records and the model, held to an unrolled simulation
from spmdtree._src.step.hlo.schedule import Branches, Copy, Done, Kernel, Loop, Schedule, Start
from spmdtree._src.step.hw.hardware import Costs
from spmdtree._src.step.time import predict

#: A small chip for the drawn schedules: 4 cores of 8 x 8 tiles, 1 TB/s at half
#: efficiency, 80% of a 100 TFLOP/s peak, 1 us a kernel, 2 us a collective, 3 us more a
#: kernel that reads or writes HBM.
CHIP = Costs(1e12, 0.5, 0.8, 4, (8, 8), 1e-6, 2e-6, access_seconds=3e-6)
PEAK = 1e14
LINK = 1e10  # the drawn collectives' bytes per second


def comm(row):
    return row.bytes / LINK


# --- the oracle: the documented model, simulated step by step ----------------------------


def tile_slots(batch, m, n, cores, tile):
    """The share of the cores' slots a batch x m x n output fills, by placing its
    tiles on the cores wave by wave."""
    tm, tn = tile
    filled = [
        min(tm, m - i) * min(tn, n - j)
        for _ in range(batch)
        for i in range(0, m, tm)
        for j in range(0, n, tn)
    ]
    waves = [filled[w : w + cores] for w in range(0, len(filled), cores)]
    return sum(filled) / (len(waves) * cores * tm * tn)


def kernel_time(kernel, costs=CHIP, peak=PEAK):
    """The documented per-kernel model: the larger of compute and memory, plus 5%
    of the smaller (launch apart)."""
    memory = kernel.bytes / (costs.hbm_bytes_per_second * costs.memory_efficiency)
    compute = 0.0
    if kernel.flops:
        wave = tile_slots(kernel.batch, kernel.m, kernel.n, costs.cores, costs.tile)
        compute = kernel.flops / (peak * costs.matmul_efficiency * wave)
    return max(compute, memory) + 0.05 * min(compute, memory)


@dataclasses.dataclass
class Streams:
    compute: float = 0.0
    links: float = 0.0
    copies: float = 0.0  # when the DMA engines are next free
    copied: float = 0.0  # the compute's waits for copies
    exposed: float = 0.0
    comm: float = 0.0
    kernels: int = 0
    by_kind: dict = dataclasses.field(default_factory=dict)
    pending: dict = dataclasses.field(default_factory=dict)


def simulate(events, s):
    """Runs `events` on three streams: kernels in order on the compute stream; one
    collective at a time on the link stream, from when it starts or the link is
    free; one async copy at a time on the DMA engines, at its bytes over the
    bandwidth at the memory share (new in 0.8); a done (or a synchronous start)
    waits for its collective or copy, a copy's wait memory time. Every loop
    iteration is run; a conditional takes its slowest branch."""
    for e in events:
        if isinstance(e, Kernel):
            t = kernel_time(e)
            s.by_kind[e.kind] = s.by_kind.get(e.kind, 0.0) + t
            fixed = CHIP.launch_seconds + CHIP.access_seconds * e.hbm_waits
            s.by_kind["launch"] = s.by_kind.get("launch", 0.0) + fixed
            s.compute += t + fixed
            s.kernels += 1
        elif isinstance(e, Start):
            took = comm(e.row) + CHIP.collective_latency_seconds
            s.links = max(s.compute, s.links) + took
            s.comm += took
            if e.sync:
                wait(s, ("collective", s.links))
            else:
                s.pending[e.ident] = ("collective", s.links)
        elif isinstance(e, Copy):
            s.copies = max(s.compute, s.copies) + kernel_time(e.kernel)
            s.pending[e.ident] = ("copy", s.copies)
        elif isinstance(e, Done):
            if e.ident in s.pending:
                wait(s, s.pending.pop(e.ident))
        elif isinstance(e, Loop):
            for _ in range(e.trips):
                s = simulate(e.body, s)
        else:
            ends = [simulate(branch, copy.deepcopy(s)) for branch in e.branches]
            s = max(ends, key=lambda end: end.compute)
    return s


def wait(s, waited_for):
    what, until = waited_for
    if until > s.compute:
        if what == "copy":
            s.copied += until - s.compute
            s.by_kind["memory"] = s.by_kind.get("memory", 0.0) + until - s.compute
        else:
            s.exposed += until - s.compute
        s.compute = until


# --- drawn schedules --------------------------------------------------------------------


@hs.composite
def kernels(draw):
    kind = draw(hs.sampled_from(["matmul", "attention", "memory"]))
    size = draw(hs.integers(0, 10**8))
    waits = draw(hs.integers(0, 2))  # reads HBM, writes it, both
    if kind == "memory":
        return Kernel(kind, 0, size, hbm_waits=waits)
    batch, m, n = draw(hs.integers(1, 3)), draw(hs.integers(1, 40)), draw(hs.integers(1, 40))
    flops = draw(hs.integers(1, 10**11))
    return Kernel(kind, flops, size, batch, m, n, 8, "bf16", hbm_waits=waits)


@hs.composite
def schedules(draw, depth=0, idents=None):
    """Events as a scheduled module holds them: an async collective's start and done
    in one computation, anything (loops too) between them."""
    idents = idents if idents is not None else iter(range(10**6))
    events = []
    for _ in range(draw(hs.integers(1, 4 if depth else 6))):
        choices = ["kernel", "async", "sync", "copy", "loop", "branches"]
        choice = draw(hs.sampled_from(choices))
        if choice == "kernel" or (depth >= 2 and choice in ("loop", "branches", "async", "copy")):
            events.append(draw(kernels()))
            continue
        if choice == "copy":  # an async slice or copy, started, then done after anything
            ident = next(idents)
            moved = Kernel("memory", 0, draw(hs.integers(0, 10**8)), name=f"copy-done.{ident}")
            events.append(Copy(ident, moved))
            events.extend(draw(schedules(depth + 1, idents)))
            events.append(Done(ident))
            continue
        if choice in ("async", "sync"):
            size, count = draw(hs.integers(1, 10**8)), draw(hs.integers(1, 3))
            row = st.Collective("all-reduce", count, size, ("data",), 8)
            ident = next(idents)
            events.append(Start(ident, row, choice == "sync"))
            if choice == "async":
                events.extend(draw(schedules(depth + 1, idents)))
                events.append(Done(ident))
        elif choice == "loop":
            trips = draw(hs.integers(0, 12))
            events.append(Loop(trips, tuple(draw(schedules(depth + 1, idents)))))
        else:
            branches = draw(hs.lists(schedules(depth + 1, idents), min_size=1, max_size=3))
            events.append(Branches(tuple(tuple(b) for b in branches)))
    return events


@examples(60)
@given(schedules())
def test_the_walk_is_the_streams_simulation_with_every_iteration_run(events):
    got = predict.predict(Schedule(tuple(events), "cuda"), CHIP, PEAK, comm)
    want = simulate(events, Streams())
    close = dict(rel=1e-9, abs=1e-15)
    assert got.seconds == pytest.approx(want.compute, **close)
    assert got.exposed_comm_seconds == pytest.approx(want.exposed, **close)
    assert got.comm_seconds == pytest.approx(want.comm, **close)
    assert sum(got.copy_waits.values()) == pytest.approx(want.copied, **close)
    assert got.kernels == want.kernels
    for kind in ("matmul", "attention", "memory", "launch"):
        assert got.by_class[kind] == pytest.approx(want.by_kind.get(kind, 0.0), **close)


@examples(40)
@given(
    hs.integers(1, 4),
    hs.integers(1, 700),
    hs.integers(1, 700),
    hs.sampled_from(["h100", "b200", "tpu-v5e", "tpu-v6e"]),
)
def test_a_matmuls_wave_efficiency_is_the_share_of_tile_slots_it_fills(batch, m, n, chip):
    costs = st.hardware(chip).costs()
    want = tile_slots(batch, m, n, costs.cores, costs.tile)
    assert predict.wave_efficiency(batch, m, n, costs) == pytest.approx(want, rel=1e-12)
    assert 0 < want <= 1


@examples(20)
@given(hs.sampled_from(["matmul", "attention"]), hs.integers(1, 10**12), hs.integers(0, 10**9))
def test_a_kernel_takes_the_slower_of_compute_and_memory_and_a_twentieth_of_the_other(
    kind, flops, size
):
    kernel = Kernel(kind, flops, size, 2, 300, 70, 64, "bf16")
    got = predict.kernel_seconds(kernel, CHIP, PEAK)
    assert got == pytest.approx(kernel_time(kernel), rel=1e-12)


# --- compiled loops: the prediction runs the body its trip count times --------------------


def matmul_seconds(rows):
    """One (rows, K) x (K, K) f32 matmul on an H100 by the documented model: 2 rows
    K^2 FLOPs at TF32 (half the bf16 peak) x MAMF x the share of 132 SMs' 128 x
    128 tile slots its output fills (one tile: rows, K <= 128), plus 5% of its
    operands' and result's bytes over 90% of the HBM3's 3.35 TB/s."""
    wave = rows * K / (132 * 128 * 128)
    compute = 2 * rows * K * K / (989e12 * (794.5 / 989) * 0.5 * wave)
    memory = 4 * (rows * K + K * K + rows * K) / (3.35e12 * 0.9)
    return compute + 0.05 * memory


@examples(15)
@given(
    loops(ops=tuple(COMPARE)),
    hs.sampled_from(["counter-first", "counter-last"]),
    hs.sampled_from([2, 4, 8]),
)
def test_a_compiled_loops_matmuls_are_timed_its_simulated_trip_count_times(loop, form, devices):
    trips = simulated_trips(*loop)
    plan = loop_plan("cpu", *loop, form, devices)
    t = plan.time(st.hardware("h100"))
    # each device multiplies its own M rows; their few KiB add 5% of a negligible HBM time
    one = matmul_seconds(M)
    assert t.predicted_by_class["matmul"] == pytest.approx(trips * one, rel=1e-6, abs=1e-15)
    collective = t.predicted_by_class["collectives"]
    assert (collective > 0) == (trips > 0)  # the CPU's psum is synchronous: exposed


@examples(6)
@given(hs.integers(0, 9), hs.sampled_from([2, 4, 8]))
def test_a_fori_loop_over_a_sharded_batch_is_timed_per_device(length, devices):
    mesh = jax.sharding.AbstractMesh(
        (devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    rows = 256

    def step(w, x):
        return jax.lax.fori_loop(0, length, lambda i, x: jnp.tanh(x @ w), x)

    w = st.Partitioned(jax.ShapeDtypeStruct((K, K), jnp.float32), (None, None))
    x = st.Partitioned(jax.ShapeDtypeStruct((rows, K), jnp.float32), ("data", None))
    plan = st.preflight(lambda w, x: step(w.value, x.value), w, x, mesh=mesh)
    t = plan.time(st.hardware("h100"))
    per = rows // devices  # at most 128: one tile
    assert plan.flops == length * 2 * per * K * K
    want = length * matmul_seconds(per)
    assert t.predicted_by_class["matmul"] == pytest.approx(want, rel=1e-6, abs=1e-15)
