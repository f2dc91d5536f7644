"""Async copies on the chip's DMA engines (new in 0.8): libtpu's ``slice-start`` and
``copy-start`` read as a `Copy` beside the compute, its done where the compute waits,
against the closed form: what it moves through HBM over the bandwidth x the memory
share, hidden by the compute between its start and done.

The modules are hand-written in the shape libtpu prints them (no libtpu needed); no
public function reads HLO text, so these tests call the reader and the walk.
"""

import json

import pytest

import spmdtree as st

# Private: the reader, its records, the walk and the per-instruction model have no
# public names
from spmdtree._src.step.hlo.schedule import Copy, Done, Kernel, Loop, Schedule, read_schedule
from spmdtree._src.step.time.measured import instruction_seconds
from spmdtree._src.step.time.predict import fixed_seconds, kernel_seconds, predict
from spmdtree._src.step.time.timeline import trace_events

CHIP = st.hardware("tpu-v5e")
COSTS, PEAK = CHIP.costs(), CHIP.flops_per_second
#: A slice of 2 of 8 rows of a bf16[8,2048,1024] in HBM, into the chip's own memory.
SLICE = 2 * 2048 * 1024 * 2

#: A slice started before a matmul of n x n and done after it, then a copy of the
#: matmul's result into the chip's own memory done at once; `space` the memory the
#: copy goes to. A copy-start's result is (destination, source, context), as XLA
#: writes it.
MODULE = """HloModule m, is_scheduled=true

%wrapped (a: bf16[8,2048,1024]) -> bf16[2,2048,1024] {{
  %a = bf16[8,2048,1024]{{2,1,0:T(8,128)(2,1)}} parameter(0)
  ROOT %slice.1 = bf16[2,2048,1024]{{2,1,0:T(8,128)(2,1)S(1)}} slice(%a), slice={{[0:2], [0:2048], [0:1024]}}
}}

ENTRY %main (p: bf16[8,2048,1024], x: bf16[{n},{n}]) -> (bf16[2,2048,1024], bf16[{n},{n}]) {{
  %p = bf16[8,2048,1024]{{2,1,0:T(8,128)(2,1)}} parameter(0)
  %x = bf16[{n},{n}]{{1,0:T(8,128)(2,1)}} parameter(1)
  %slice-start = ((bf16[8,2048,1024]{{2,1,0:T(8,128)(2,1)}}), bf16[2,2048,1024]{{2,1,0:T(8,128)(2,1)S(1)}}, s32[]{{:S(2)}}) async-start(%p), calls=%wrapped
  %d = bf16[{n},{n}]{{1,0:T(8,128)(2,1)}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %slice-done = bf16[2,2048,1024]{{2,1,0:T(8,128)(2,1)S(1)}} async-done(%slice-start)
  %copy-start = (bf16[{n},{n}]{{1,0:T(8,128)(2,1){space}}}, bf16[{n},{n}]{{1,0:T(8,128)(2,1)}}, u32[]{{:S(2)}}) copy-start(%d)
  %copy-done = bf16[{n},{n}]{{1,0:T(8,128)(2,1){space}}} copy-done(%copy-start)
  ROOT %t = (bf16[2,2048,1024]{{2,1,0:T(8,128)(2,1)S(1)}}, bf16[{n},{n}]{{1,0:T(8,128)(2,1){space}}}) tuple(%slice-done, %copy-done)
}}
"""


def schedule(n=1024, space="S(1)"):
    return read_schedule(MODULE.format(n=n, space=space), platform="tpu")


def moved(size):
    """A copy's time by the documented model: its HBM bytes over the sustained bandwidth."""
    return size / (CHIP.hbm_bytes_per_second * CHIP.memory_efficiency)


def test_a_slice_and_a_copy_run_asynchronously_are_copies_each_done_waits_for():
    events = schedule().events
    assert [type(e).__name__ for e in events] == ["Copy", "Kernel", "Done", "Copy", "Done"]
    sliced, dot, first, copied, second = events
    # named as the done a profile times the compute's wait under; what moves through
    # HBM: the slice read there (its destination on the chip), the matmul's result
    # read there likewise
    assert (sliced.kernel.name, sliced.kernel.bytes, sliced.kernel.opcode) == (
        "slice-done",
        SLICE,
        "slice",
    )
    assert (copied.kernel.name, copied.kernel.bytes) == ("copy-done", 1024 * 1024 * 2)
    assert (first.ident, second.ident) == (sliced.ident, copied.ident)
    assert dot.name == "d"
    assert [c.kernel.name for c in Schedule(events, "tpu").copies()] == ["slice-done", "copy-done"]


def test_a_copy_that_writes_hbm_moves_its_bytes_both_ways_and_the_hosts_costs_nothing():
    (_, _, _, copied, _) = schedule(space="").events
    assert copied.kernel.bytes == 2 * 1024 * 1024 * 2  # read in HBM, written in HBM
    # the host's memory (S(5)): its link is not timed, as in 0.7
    host = [e for e in schedule(space="S(5)").events if isinstance(e, (Copy, Done))]
    assert [e.kernel.name for e in host if isinstance(e, Copy)] == ["slice-done"]
    assert len(host) == 2


#: An eviction: a value the chip holds in its own memory copied out to HBM.
EVICTION = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %copy-start = (bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%x)
  ROOT %copy-done = bf16[1024,1024]{1,0:T(8,128)(2,1)} copy-done(%copy-start)
}
"""


def test_an_eviction_moves_its_bytes_once_written_to_hbm():
    copied, done = read_schedule(EVICTION, platform="tpu").events
    assert (copied.kernel.name, copied.kernel.bytes) == ("copy-done", 1024 * 1024 * 2)
    assert done.ident == copied.ident


@pytest.mark.parametrize("n", [8192, 512], ids=["hidden", "exposed"])
def test_the_compute_waits_for_a_copy_only_where_what_runs_between_does_not_cover_it(n):
    events = schedule(n).events
    dot = events[1]
    between = kernel_seconds(dot, COSTS, PEAK) + fixed_seconds(dot, COSTS)
    waited = max(0.0, moved(SLICE) - between)
    exposed = moved(n * n * 2)  # the copy of the result, done at once
    said = predict(Schedule(events, "tpu"), COSTS, PEAK, lambda row: 0.0)
    assert (waited == 0.0) == (n == 8192)
    assert said.copy_waits.get("slice-done", 0.0) == pytest.approx(waited)
    assert said.copy_waits["copy-done"] == pytest.approx(exposed)
    # the waits are memory time; the copies run no kernel on the compute stream
    assert said.memory_seconds == pytest.approx(waited + exposed)
    assert said.seconds == pytest.approx(between + waited + exposed)
    assert said.kernels == 1


def test_copies_run_one_at_a_time_on_the_dma_engines():
    # two slices started together, then done together: the second waits for the first
    slices = Kernel("memory", 0, SLICE, name="slice-done.1")
    events = (Copy(0, slices), Copy(1, slices._replace(name="slice-done.2")), Done(0), Done(1))
    said = predict(Schedule(events, "tpu"), COSTS, PEAK, lambda row: 0.0)
    assert said.copy_waits["slice-done.1"] == pytest.approx(moved(SLICE))
    assert said.copy_waits["slice-done.2"] == pytest.approx(moved(SLICE))
    assert said.seconds == pytest.approx(2 * moved(SLICE))


def test_each_copys_time_per_instruction_is_the_walks_wait_for_it_times_its_loops_trips():
    body = schedule(512).events
    looped = Schedule((Loop(5, body),), "tpu")
    ops = {op.name: op for op in instruction_seconds(looped, CHIP, lambda row: 0.0)}
    dot = body[1]
    between = kernel_seconds(dot, COSTS, PEAK) + fixed_seconds(dot, COSTS)
    assert ops["slice-done"].calls == 5
    assert ops["slice-done"].predicted_seconds == pytest.approx(5 * (moved(SLICE) - between))
    assert ops["copy-done"].predicted_seconds == pytest.approx(5 * moved(512 * 512 * 2))
    assert (ops["slice-done"].kind, ops["slice-done"].bytes) == ("memory", SLICE)
    # the instructions sum to the walk's step
    whole = predict(looped, COSTS, PEAK, lambda row: 0.0).seconds
    assert sum(op.predicted_seconds for op in ops.values()) == pytest.approx(whole)


def test_a_copy_reached_twice_is_timed_once_per_step():
    # the same computation reached from two places: one name, its waits counted once
    sliced = Kernel("memory", 0, SLICE, name="slice-done")
    events = (Copy(0, sliced), Done(0), Copy(1, sliced), Done(1))
    schedule_ = Schedule(events, "tpu")
    (op,) = instruction_seconds(schedule_, CHIP, lambda row: 0.0)
    whole = predict(schedule_, COSTS, PEAK, lambda row: 0.0).seconds
    assert (op.calls, op.predicted_seconds) == (2, pytest.approx(whole))
    assert whole == pytest.approx(2 * moved(SLICE))


def test_a_schedule_with_copies_goes_to_json_and_back():
    looped = Schedule((Loop(5, schedule().events),), "tpu")
    assert Schedule.from_dict(json.loads(json.dumps(looped.to_dict()))) == looped


def test_the_trace_shows_copies_on_their_own_track():
    said = predict(schedule(512), COSTS, PEAK, lambda row: 0.0, spans=True)
    copies = [s for s in said.spans if s.stream == "copies"]
    assert [s.name for s in copies] == ["slice-done", "copy-done"]
    waits = [s.name for s in said.spans if s.stream == "compute" and s.name.startswith("waits")]
    assert waits == ["waits for slice-done", "waits for copy-done"]
    trace = trace_events(said.spans, "a step")
    named = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    threads = {e["args"]["name"]: e["tid"] for e in named}
    assert threads["copies"] in {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
