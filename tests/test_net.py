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

# Private: the schedule's records and the model each net test holds to an oracle
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

    # Private: the wave model, a helper with no public name
    from spmdtree._src.step.time.predict import wave_efficiency

    costs = st.hardware("h100").costs()
    want = placed_tiles(gemms, m, n, costs.cores, costs.tile)
    assert wave_efficiency(gemms, m, n, costs) == pytest.approx(want, rel=1e-12)


# --- 2. a collective XLA marks synchronous is waited for where it starts -----------------

ADD = """%add (lhs: f32[], rhs: f32[]) -> f32[] {
  %lhs = f32[] parameter(0)
  %rhs = f32[] parameter(1)
  ROOT %sum = f32[] add(%lhs, %rhs)
}
"""

#: Each async collective as XLA writes its start and done, over 8 devices as 2 x 4.
STARTS = {
    "all-reduce": (
        "%s = f32[256,64] all-reduce-start(%b), replica_groups=[2,4]<=[8], to_apply=%add{config}",
        "%r = f32[256,64] all-reduce-done(%s)",
    ),
    "all-gather": (
        "%s = (f32[256,64], f32[1024,64]) all-gather-start(%b), replica_groups=[2,4]<=[8], "
        "dimensions={{0}}{config}",
        "%r = f32[1024,64] all-gather-done(%s)",
    ),
    "collective-permute": (
        "%s = (f32[256,64], f32[256,64]) collective-permute-start(%b), "
        "source_target_pairs={{{{0,1}},{{1,0}}}}{config}",
        "%r = f32[256,64] collective-permute-done(%s)",
    ),
}
#: How XLA GPU says a collective is synchronous, or says nothing.
SYNC_CONFIGS = {
    "is_sync": ', backend_config={{"collective_backend_config":{{"is_sync":true}}}}',
    "not is_sync": ', backend_config={{"collective_backend_config":{{"is_sync":false}}}}',
    "no config": "",
}


def overlapped(kind, config, dots):
    """An async `kind` started, `dots` 64 x 64 matmuls, then its done."""
    start, done = STARTS[kind]
    start = start.format(config=SYNC_CONFIGS[config].format())
    chain = ["%d0 = f32[64,64] copy(%a)"] + [
        f"%d{i + 1} = f32[64,64] dot(%d{i}, %a), lhs_contracting_dims={{1}}, "
        "rhs_contracting_dims={0}"
        for i in range(dots)
    ]
    result = done.split(" = ")[1].split(" ")[0]
    body = "\n  ".join([start, *chain, done])
    reducer = ADD if kind == "all-reduce" else ""  # no computation that nothing calls
    return f"""HloModule m, is_scheduled=true
{reducer}
ENTRY %main (a: f32[64,64], b: f32[256,64]) -> (f32[64,64], {result}) {{
  %a = f32[64,64] parameter(0)
  %b = f32[256,64] parameter(1)
  {body}
  ROOT %t = (f32[64,64], {result}) tuple(%d{dots}, %r)
}}
"""


@examples(120)
@given(
    hs.sampled_from(sorted(STARTS)),
    hs.sampled_from(sorted(SYNC_CONFIGS)),
    hs.integers(0, 4),
    hs.sampled_from([1e-7, 3e-6, 1e-5, 1e-3]),
)
def test_a_collective_marked_is_sync_is_waited_for_where_it_starts(kind, config, dots, seconds):
    # Private: the schedule's records and the walk have no public names
    from spmdtree._src.step.hlo.schedule import Start
    from spmdtree._src.step.hw.hardware import Costs
    from spmdtree._src.step.time.predict import predict

    schedule = read_schedule(
        overlapped(kind, config, dots), (("data", 2), ("fsdp", 4)), platform="cuda"
    )
    (start,) = [e for e in schedule.events if isinstance(e, Start)]
    sync = config == "is_sync"
    assert start.sync is sync
    latency = 2e-6
    costs = Costs(1e12, 0.5, 0.8, 4, (8, 8), 1e-6, latency)
    said = predict(schedule, costs, 1e14, lambda row: seconds)
    compute = said.matmul_seconds + said.memory_seconds + said.launch_seconds
    comm = seconds + latency
    # by hand: synchronous, the compute waits for all of it where it starts; async, the
    # kernels between its start and its done (here every one) hide what they cover
    exposed = comm if sync else max(0.0, comm - compute)
    assert said.exposed_comm_seconds == pytest.approx(exposed, rel=1e-9, abs=1e-15)
    assert said.seconds == pytest.approx(compute + exposed, rel=1e-9)


# --- 4. which torus axes a TPU group spans, on slices of unequal axes ---------------------


def scaling_book_links(group, dims, wraps):
    """How many times one axis's ICI figure a group of `group` chips sends at, by the
    scaling book's rule, found by trying every set of axes: a mesh axis is laid along
    whole torus axes, the fewest that hold the group, and of those the longest; each
    adds its links (1 wrapped round, 1/2 a line)."""
    import itertools

    axes = [i for i, d in enumerate(dims) if d > 1]
    for count in range(1, len(axes) + 1):
        holding = [
            chosen
            for chosen in itertools.combinations(axes, count)
            if math.prod(dims[i] for i in chosen) >= group
        ]
        if holding:
            longest = max(holding, key=lambda c: sorted((dims[i] for i in c), reverse=True))
            return sum(1.0 if wraps[i] else 0.5 for i in longest)
    return 1.0


SIDES = [1, 2, 4, 8, 16, 32]
SLICES = [(a, b) for a in SIDES for b in SIDES if a != b and a * b >= 4] + [
    (a, b, c) for a in SIDES[:5] for b in SIDES[:5] for c in SIDES[:5] if len({a, b, c}) > 1
]


@examples(400)
@given(hs.sampled_from(SLICES), hs.integers(1, 15), hs.sampled_from([4, 16]))
def test_a_group_spans_the_fewest_longest_torus_axes_of_an_unequal_slice(dims, power, side):
    # Private: the torus's links, a helper with no public name
    from spmdtree._src.step.hw.chips import torus_links

    dims = list(dims)
    group = 2**power
    if group > math.prod(dims):
        group = math.prod(dims)
    wraps = [d % side == 0 for d in dims]  # an axis wraps round where it is whole rings
    assert torus_links(group, dims, wraps) == scaling_book_links(group, dims, wraps)


@pytest.mark.parametrize(
    "preset, chips, group, links",
    [
        ("tpu-v5e", 128, 16, 1.0),  # 8 x 16: one wrapped axis of 16, not the 8 and half of 16
        ("tpu-v5e", 128, 8, 1.0),  # the 16-long axis holds 8 too: wrapped
        ("tpu-v5e", 32, 8, 0.5),  # 4 x 8: the 8, a line (v5e wraps axes of 16)
        ("tpu-v5p", 128, 8, 1.0),  # 4 x 4 x 8 of whole cubes: the 8, wrapped
        ("tpu-v5p", 32, 8, 1.0),  # 2 x 4 x 4: no whole cubes, no wraparound; 8 spans two 4s
    ],
)
def test_a_groups_links_on_a_preset_slice_are_the_axes_it_spans(preset, chips, group, links):
    # Private: the torus helpers have no public names
    from spmdtree._src.step.hw.chips import slice_dims, torus_links, wrapped

    chip = __import__("spmdtree").hardware(preset).chip
    dims = slice_dims(chips, chip.dimensions)
    assert torus_links(group, dims, wrapped(dims, chip.wraparound, chip.cubes)) == links


# --- 5. the batch check: a non-batch dimension left unsharded is still a layout ----------

BATCH_RULES = [("batch", "data"), ("embed", "fsdp")]


def scaled_step(params, x):
    """A norm's scale times the batch: the scale's `embed` over fsdp, the batch over data."""
    return (x.value * params["scale"].value).sum()


@pytest.fixture(scope="module")
def batch_advice():
    """advise over every (data, fsdp) layout of 8 devices at batches 8 and 6, with a
    norm scale of 5 (only fsdp 1 divides it) and of 16 (every fsdp does)."""
    import jax
    import jax.numpy as jnp

    import spmdtree as st

    def make_step(candidate):
        size = candidate.options["scale"]
        box = lambda shape, names: st.LogicallyPartitioned(  # noqa: E731
            jax.ShapeDtypeStruct(shape, jnp.float32), names
        )
        params = {"scale": box((size,), ("embed",))}
        return scaled_step, (params, box((candidate.batch, size), ("batch", "embed"))), {}

    found = st.candidates(st.layouts(8, ("data", "fsdp")), BATCH_RULES, (8, 6), scale=(5, 16))
    return st.advise(make_step, found, hardware=st.hardware("h100"), progress=False, screen="cpu")


def test_a_layout_that_leaves_only_a_non_batch_dimension_unsharded_still_fits(batch_advice):
    seen = set()
    for row in batch_advice.rows:
        mesh = dict(row.candidate.mesh.shape)
        batch, scale = row.candidate.batch, row.candidate.options["scale"]
        split = batch % mesh["data"] == 0  # the test's own arithmetic: the batch over data
        scale_split = scale % mesh["fsdp"] == 0
        seen.add((split, scale_split))
        if split:
            assert row.verdict == "fits", (row.candidate, row.verdict, row.reason)
            assert (row.step is not None) and not any(
                "not divided by its batch axes" in f for f in row.flags
            )
        else:
            assert row.verdict == "batch unsharded", (row.candidate, row.verdict)
            assert f"batch {batch} is not divided by its batch axes" in row.reason
    assert seen == {(True, True), (True, False), (False, True), (False, False)}  # the grid's four


# --- 6. confirm: no more target compiles than settle the order -------------------------

ORDER = ["fits", "tight", "may fit", "over budget", "batch unsharded", "does not compile"]


def place(key, figures):
    """A row's place by `figures` (verdict, seconds per step, peak, serial seconds),
    advise's documented order: verdict, then time per sequence (6 figures), the peak,
    the serial time, the label and batch (`key`)."""
    verdict, seconds, peak, serial = figures
    label, per = key
    hopeful = verdict in ORDER[:3]
    return (
        ORDER.index(verdict),
        float(f"{seconds / per:.6g}") if hopeful else 0.0,
        peak if hopeful or verdict == "over budget" else 0,
        serial / per if hopeful else 0.0,
        label,
        per,
    )


def figures(row):
    t = row.time
    seconds = t.bound_seconds if t.predicted_seconds is None else t.predicted_seconds
    return (str(row.verdict), seconds, row.step.peak_bytes, t.serial_seconds)


def fewest_confirmations(screened, confirmed, most):
    """The rows confirm must compile, by simulating its rule on the two runs' figures:
    best first by the figures known so far, while a screened row that fits (or may)
    ranks above the best row the target's figures fit, up to `most`."""
    keys = list(screened)
    tried = []
    while len(tried) < most:
        known = {k: confirmed[k] if k in tried else screened[k] for k in keys}
        order = sorted(keys, key=lambda k: place(k, known[k]))
        anchors = [k for k in order if k in tried and known[k][0] in ("fits", "tight")]
        above = order[: order.index(anchors[0])] if anchors else order
        contenders = [k for k in above if k not in tried and known[k][0] in ORDER[:3]]
        if not contenders:
            break
        tried.append(contenders[0])
    return tried


def keyed(advice, target_only=False):
    """The rows by (label, batch); only those the target compiled, where asked."""
    # Private: a row's label helper has no public name
    from spmdtree._src.step.advise.records import label_of

    return {
        (label_of(r.candidate), r.candidate.batch): r
        for r in advice.rows
        if not target_only or (r.step is not None and r.step.backend == "gpu")
    }


def confirm_step(candidate):
    import test_look

    return test_look.step, test_look.arguments(candidate.batch), {}


def judged(step, budget):
    """A target compile's figures, its verdict by the test's own arithmetic: over the
    budget, within 5% of it (tight), or fits."""
    import spmdtree as st

    t = step.time(st.hardware("h100"))
    peak = step.peak_bytes
    verdict = "over budget" if peak > budget else "tight" if peak > 0.95 * budget else "fits"
    return (verdict, t.predicted_seconds, peak, t.serial_seconds)


@pytest.fixture(scope="module")
def confirm_search():
    """Every (data, fsdp) layout of 8 devices at a batch of 64: screened on the CPU
    estimate (advise, confirm=0), and each compiled for 8 H100s by preflight itself."""
    import test_look

    import spmdtree as st

    found = st.candidates(st.layouts(8, ("data", "fsdp")), test_look.RULES, 64)
    kwargs = dict(hardware=st.hardware("h100"), progress=False, screen="cpu", jobs=1)
    screened = keyed(st.advise(confirm_step, found, confirm=0, **kwargs))
    targeted = {
        key: st.preflight(
            *confirm_step(row.candidate)[:1],
            *confirm_step(row.candidate)[1],
            mesh=row.candidate.mesh,
            rules=row.candidate.rules,
            target="h100",
        )
        for key, row in screened.items()
    }
    return found, kwargs, screened, targeted


@pytest.mark.skipif(
    not __import__("test_targets").has_compiler("cuda"), reason="needs pip install 'spmdtree[cuda]'"
)
@pytest.mark.parametrize("budget", [None, 22_000_000], ids=["roomy", "target-over"])
@pytest.mark.parametrize("most", [1, 2, 16])
def test_confirm_compiles_no_more_than_settle_the_order(confirm_search, most, budget):
    import spmdtree as st

    found, kwargs, screened, targeted = confirm_search
    limit = budget or st.hardware("h100").memory_bytes
    cpu = {k: figures(r) for k, r in screened.items()}
    if budget:  # the CPU figures judged against this budget too
        cpu = {k: judged(r.step, budget)[:1] + cpu[k][1:] for k, r in screened.items()}
    want = fewest_confirmations(cpu, {k: judged(s, limit) for k, s in targeted.items()}, most)
    advice = st.advise(confirm_step, found, confirm=most, budget_bytes=budget, **kwargs)
    assert set(keyed(advice, True)) == set(want), (most, want)
    assert advice.compiles == len(found) + len(want)
    if budget and most > 1:  # the target puts the CPU's best over: more than one to settle
        assert len(want) > 1
