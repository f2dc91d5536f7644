"""A net under the prediction and the search (issue "six kinds of bug that pass the
whole suite"): for each kind, a property over a grid against an oracle this file
computes itself, not through spmdtree's own code path.

1. a loop's trip count read from its condition, in every comparison and operand
   order, against running the condition as written;
2. a collective the compiler marks synchronous (``is_sync``) waited for where it
   starts, against a hand-timed schedule;
3. a batched matmul's tiles: its batch dimensions are batches of GEMMs, not rows,
   against placing each tile on the cores;
4. which torus axes a TPU group spans, on slices of unequal axes;
5. the batch check: a layout that leaves a non-batch dimension unsharded still fits;
6. confirm's stopping rule: no more target compiles than settle the order.
"""

import math
import operator

import pytest
from hypothesis import given
from hypothesis import strategies as hs
from test_step_properties import examples

from spmdtree._src.step.hlo.schedule import Kernel, Loop, read_schedule

# --- 1. a loop's trip count, from a condition written either way -----------------------

#: HLO's comparison directions, as the condition computes them.
DIRECTIONS = {
    "LT": operator.lt,
    "LE": operator.le,
    "GT": operator.gt,
    "GE": operator.ge,
    "NE": operator.ne,
    "EQ": operator.eq,
}


def run_condition(start, step, limit, direction, constant_first, most=500):
    """How often the loop runs, by running its condition as written: ``compare(i,
    n)`` or, constant first, ``compare(n, i)``; None where it does not stop."""
    compare = DIRECTIONS[direction]
    holds = (lambda i: compare(limit, i)) if constant_first else (lambda i: compare(i, limit))
    i, trips = start, 0
    while holds(i):
        if trips == most:
            return None
        i, trips = i + step, trips + 1
    return trips


def counted_loop(start, step, limit, direction, constant_first):
    """A loop as libtpu leaves it (no known_trip_count): a counter from `start` by
    `step`, a 64 x 64 matmul a trip, its condition ``compare`` in either order."""
    operands = "%n, %j" if constant_first else "%j, %n"
    add = "add(%i, %by)" if step > 0 else "subtract(%i, %by)"
    return f"""HloModule m, is_scheduled=true
%body (s: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {{
  %s = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[64,64] get-tuple-element(%s), index=1
  %by = s32[] constant({abs(step)})
  %next = s32[] {add}
  %y = f32[64,64] dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (s32[], f32[64,64]) tuple(%next, %y)
}}
%cond (c: (s32[], f32[64,64])) -> pred[] {{
  %c = (s32[], f32[64,64]) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant({limit})
  ROOT %holds = pred[] compare({operands}), direction={direction}
}}
ENTRY %main (a: f32[64,64]) -> f32[64,64] {{
  %a = f32[64,64] parameter(0)
  %start = s32[] constant({start})
  %init = (s32[], f32[64,64]) tuple(%start, %a)
  %loop = (s32[], f32[64,64]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64] get-tuple-element(%loop), index=1
}}
"""


@examples(300)
@given(
    hs.integers(-6, 6),
    hs.sampled_from([-3, -2, -1, 1, 2, 3]),
    hs.integers(-10, 14),
    hs.sampled_from(sorted(DIRECTIONS)),
    hs.booleans(),
)
def test_a_loops_trip_count_is_its_condition_run_as_written(
    start, step, limit, direction, constant_first
):
    text = counted_loop(start, step, limit, direction, constant_first)
    (loop,) = read_schedule(text, (("data", 1),), platform="tpu").events
    assert isinstance(loop, Loop)
    want = run_condition(start, step, limit, direction, constant_first)
    if want is None:  # it never stops: said unknown, timed once
        assert not loop.known and loop.trips == 1
    else:
        assert loop.known and loop.trips == want, (text, loop.trips, want)
    dots = [e for e in loop.body if isinstance(e, Kernel) and e.flops]
    assert len(dots) == 1 and dots[0].flops == 2 * 64**3


# --- 3. a batched matmul: its batch dimensions are GEMMs, not rows ---------------------


def dot_module(batch, m, n, k):
    """One dot of (batch..., m, k) x (batch..., k, n), batch dimensions first."""
    dims = ",".join(str(b) for b in batch)
    lead = f"{dims}," if batch else ""
    numbered = ",".join(str(i) for i in range(len(batch)))
    batch_dims = f"lhs_batch_dims={{{numbered}}}, rhs_batch_dims={{{numbered}}}, " if batch else ""
    r = len(batch)
    return f"""HloModule m, is_scheduled=true
ENTRY %main (a: bf16[{lead}{m},{k}], b: bf16[{lead}{k},{n}]) -> bf16[{lead}{m},{n}] {{
  %a = bf16[{lead}{m},{k}] parameter(0)
  %b = bf16[{lead}{k},{n}] parameter(1)
  ROOT %d = bf16[{lead}{m},{n}] dot(%a, %b), {batch_dims}lhs_contracting_dims={{{r + 1}}}, rhs_contracting_dims={{{r}}}
}}
"""


@examples(150)
@given(
    hs.lists(hs.integers(1, 6), min_size=0, max_size=2),
    hs.integers(1, 600),
    hs.integers(1, 600),
    hs.integers(1, 300),
)
def test_a_batched_matmul_is_batches_of_gemms_of_its_rows_and_columns(batch, m, n, k):
    (kernel,) = read_schedule(dot_module(batch, m, n, k), (("data", 1),), platform="cuda").events
    gemms = math.prod(batch)
    assert kernel.flops == 2 * gemms * m * n * k
    assert (kernel.batch or 1, kernel.m, kernel.n, kernel.k) == (gemms, m, n, k)


def placed_tiles(gemms, m, n, cores, tile):
    """The share of tile slots a batched GEMM fills, by placing each tile: every GEMM's
    output cut into tile x tile blocks, dealt to the cores in waves."""
    tm, tn = tile
    tiles = [(g, r, c) for g in range(gemms) for r in range(0, m, tm) for c in range(0, n, tn)]
    filled = sum(min(tm, m - r) * min(tn, n - c) for _, r, c in tiles)
    waves = -(-len(tiles) // cores)
    return filled / (waves * cores * tm * tn)


@examples(100)
@given(hs.integers(1, 12), hs.integers(1, 500), hs.integers(1, 500))
def test_a_batched_matmuls_waves_are_its_gemms_tiles_placed(gemms, m, n):
    import spmdtree as st
    from spmdtree._src.step.time.predict import wave_efficiency

    costs = st.hardware("h100").costs()
    want = placed_tiles(gemms, m, n, costs.cores, costs.tile)
    assert wave_efficiency(gemms, m, n, costs) == pytest.approx(want, rel=1e-12)
