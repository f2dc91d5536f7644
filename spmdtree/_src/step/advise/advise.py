"""Choosing a layout: `advise` preflights candidate layouts and ranks them by their
predicted step time.

Each candidate (a mesh, rules, a batch) is first planned: one whose arrays
alone exceed the budget, or whose batch its batch axes do not divide, is
rejected without compiling. The rest are traced here, one after the other,
and compiled in parallel subprocesses on preflight's own export path (each
distinct step once), then timed with `StepPlan.time`. A candidate that fails
is a row with its message.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

from jax.sharding import Mesh

from spmdtree._src.errors import Mistake, public
from spmdtree._src.rules import AnyMesh
from spmdtree._src.step.advise.judging import budget_per_device, verdict_of
from spmdtree._src.step.advise.progress import printer, start_line
from spmdtree._src.step.advise.records import (
    HOPEFUL,
    Advice,
    AdviceRow,
    Candidate,
)
from spmdtree._src.step.advise.space import checked_candidates, count_or_none
from spmdtree._src.step.advise.state import (
    ChildCompile,
    Confirmed,
    Pending,
    PlannedStep,
    Record,
    Rejected,
    Screened,
    Search,
    State,
    Unconfirmed,
    error_text,
    failed,
    flagged,
    judged,
    make_row,
    nothing_fits_said,
    recorded,
    rejection,
    rules_said,
    said_repeats,
    said_stages,
)
from spmdtree._src.step.compile import (
    DoesNotFit,
    Exported,
    TargetChild,
    check_compiler_options,
    compile_child,
    compiler_for,
)
from spmdtree._src.step.hw import Hardware, check_devices_per_node, hardware_of
from spmdtree._src.step.kinds import Verdict
from spmdtree._src.step.measure import check_here
from spmdtree._src.step.measure import measure as run_step
from spmdtree._src.step.preflight import (
    Keywords,
    StepPlan,
    plan_arguments,
    step_plan,
    trace_for,
)

#: The memory one compile subprocess takes (measured: ~0.7 GB at 2,048 devices,
#: about flat in the device count), to bound how many run at once.
CHILD_BYTES = 700 * 2**20


def default_jobs() -> int:
    """The CPU count, fewer where memory is short (a compile takes ~0.7 GB)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            free = next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")
            )
    except (OSError, StopIteration):
        free = sys.maxsize
    return max(1, min(cpus or 1, free // CHILD_BYTES))


def _first_pass(
    search: Search, index: int, make_step: Callable[[Candidate], Any], screen: TargetChild | None
) -> Pending | Record:
    """Plans the candidate, and traces and exports its step for `screen` (None: the
    CPU estimate; or compiles it here, on a mesh this process has the devices
    for): a pending compile, or the candidate's record."""
    candidate = search.candidates[index]
    try:
        returned = make_step(candidate)
    except Exception as e:
        return failed(search, index, f"make_step raised {error_text(e)}")
    fn, args, keywords = step_call(returned)
    mesh = _abstract(candidate)
    try:
        planned = plan_arguments(args, mesh, candidate.rules, keywords)
        rejected = rejection(search, index, planned.plan)
        if rejected is not None:
            return rejected
        step = PlannedStep(fn, planned, keywords)
        at = screen if screen is not None else compiler_for(mesh, None, None)
        meets = (at,) if search.asks is None else (at, search.asks)
        traced = trace_for(fn, planned, mesh, candidate.rules, keywords, meets)
        if at.here is None:  # exported: its child compiles it in the pool
            return Pending(index, traced, at, step)
        compiled = step_plan(traced, at.compile(traced), at)
    except Exception as e:
        return failed(search, index, error_text(e))
    return Screened(judged(search, index, compiled), step)


def step_call(returned: object) -> tuple[Callable[..., Any], tuple[Any, ...], Keywords]:
    """`make_step`'s return, checked: ``(fn, args, kwargs)``, kwargs preflight's own
    keywords but the mesh and rules (`Keywords`)."""
    shape = (
        "(fn, args, kwargs): the step, a tuple of its arguments and a dict of preflight's "
        "other keywords (such as donate_argnums), e.g. `return step, (params, batch), {}`"
    )
    if not isinstance(returned, (tuple, list)) or len(returned) != 3:
        got = (
            f"{len(returned)} values"
            if isinstance(returned, (tuple, list))
            else f"a {type(returned).__name__}"
        )
        raise Mistake(TypeError, f"make_step returned {got}; it must return {shape}.")
    fn, args, kwargs = returned
    if not callable(fn) or not isinstance(args, (tuple, list)) or not isinstance(kwargs, Mapping):
        got = ", ".join(type(value).__name__ for value in returned)
        raise Mistake(TypeError, f"make_step returned ({got}); it must return {shape}.")
    odd = sorted(set(kwargs) - set(Keywords.names()))
    if odd:
        said = "advise passes each candidate's mesh and rules itself. Leave them out."
        if not {"mesh", "rules"} & set(odd):
            said = f"preflight takes only {', '.join(Keywords.names())} there."
        raise Mistake(ValueError, f"make_step returned kwargs with {odd}; {said}")
    return fn, tuple(args), Keywords(**kwargs)


def _abstract(candidate: Candidate) -> AnyMesh:
    """The mesh a candidate is preflighted on: a `Mesh` stands for its abstract mesh."""
    mesh = candidate.mesh
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh


def _second_pass(search: Search, state: State, pending: Pending, child: ChildCompile) -> Record:
    """A pending candidate's record from its subprocess's analysis; a confirming
    compile that fails keeps the screened row, flagged."""
    index = pending.index
    try:
        step = step_plan(pending.traced, child.result(), pending.compiler)
    except DoesNotFit as mistake:  # the target's compiler: too big for one chip
        row = make_row(search, index, Verdict.OVER_BUDGET, str(mistake.error("preflight")))
        return Confirmed(row) if pending.confirming else Rejected(row)
    except Exception as e:
        if not pending.confirming:
            return failed(search, index, error_text(e))
        flag = f"not confirmed by {pending.compiler}: {error_text(e)}"
        return Unconfirmed(flagged(state.records[index].row, flag), pending.step)
    row = judged(search, index, step)
    return Confirmed(row) if pending.confirming else Screened(row, pending.step)


def _run(
    search: Search,
    state: State,
    firsts: Iterable[tuple[int, Pending | Record]],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> State:
    """Starts each pending candidate's compile as it comes (once per distinct step,
    through its compiler's `compile`) and records every candidate whose compile
    is done between them, so the rows are reported as candidates finish."""
    children: dict[tuple[str | None, Any], ChildCompile] = {}
    waiting: dict[ChildCompile, list[Pending]] = {}

    def finish(state: State, done: Iterable[ChildCompile]) -> State:
        for child in done:
            for pending in waiting.pop(child):
                record = _second_pass(search, state, pending, child)
                state = recorded(search, state, pending.index, record)
        return state

    for index, first in firsts:
        if isinstance(first, Pending):
            key = (first.traced.digest, first.compiler)
            if key not in children:
                children[key] = _submit(search, pool, first)
                waiting[children[key]] = []
                state = state.counted(1)
            waiting[children[key]].append(first)
        else:  # decided here: a step compiled in this process counts
            state = recorded(search, state, index, first, int(isinstance(first, Screened)))
        state = finish(state, [child for child in waiting if child.done()])
    return finish(state, concurrent.futures.as_completed(list(waiting)))


def _submit(
    search: Search, pool: concurrent.futures.ThreadPoolExecutor, pending: Pending
) -> ChildCompile:
    """A pending step's compile started: a compile in a fresh process of the step
    exported for it by the caller's executor where there is one (a Dask cluster's
    workers: the payload and the compiler pickle), else here; a step lowered in
    this process (cuDNN's attention on XLA GPU's topology) always here."""
    stage = pending.traced.stage
    if search.executor is None or not isinstance(stage, Exported):
        return pool.submit(pending.compiler.compile, pending.traced)
    return search.executor.submit(compile_child, stage.payload, pending.compiler)


def _confirmed(search: Search, state: State, index: int, child: TargetChild) -> Pending | Record:
    """The candidate's step traced again, exported for the target's compiler (its
    screened row kept, flagged, where it does not trace so)."""
    record = state.records[index]
    step = cast(Screened, record).step
    try:
        candidate = search.candidates[index]
        traced = trace_for(
            step.fn, step.planned, _abstract(candidate), candidate.rules, step.keywords, (child,)
        )
    except Exception as e:
        return Unconfirmed(flagged(record.row, f"not confirmed by {child}: {error_text(e)}"), step)
    return Pending(index, traced, child, step, confirming=True)


def _ask(
    search: Search,
    state: State,
    indices: Sequence[int],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> State:
    """Compiles the rows at `indices` again for the target and judges them on its
    figures (a row that does not trace or compile so keeps its screened figures,
    flagged)."""
    if search.asks is None or not indices:
        return state
    asks = search.asks
    return _run(search, state, [(i, _confirmed(search, state, i, asks)) for i in indices], pool)


def _over_on_the_estimate(search: Search, state: State) -> list[int]:
    """The screened rows over the budget on the CPU estimate alone: the target's
    compiler decides them where it can be asked."""
    if search.asks is None:
        return []
    over = (Verdict.MAY_FIT, Verdict.OVER_BUDGET)
    rows = state.rows
    return [i for i in state.order() if state.screened(i) and rows[i].verdict in over]


def _contenders(state: State, tried: set[int]) -> list[int]:
    """The screened rows that fit (or may) on the CPU estimate and rank above the
    best row the target's figures fit: the ones that could still beat it."""
    order, rows = state.order(), state.rows
    confirmed = [
        i
        for i in order
        if not state.screened(i)
        and rows[i].step is not None
        and rows[i].verdict in (Verdict.FITS, Verdict.TIGHT)
    ]
    above = order.index(confirmed[0]) if confirmed else len(order)
    return [
        i
        for i in order[:above]
        if state.screened(i) and rows[i].verdict in HOPEFUL and i not in tried
    ]


def _confirm(
    search: Search,
    state: State,
    confirm: int,
    pool: concurrent.futures.ThreadPoolExecutor,
    jobs: int,
) -> tuple[State, str]:
    """Compiles screened rows for the target, best first, while one could still beat
    the best the target fits, up to `confirm` of them; the state after, and what
    the note says of it."""
    if not confirm or search.asks is None:
        return state, ""
    tried: set[int] = set()
    while len(tried) < confirm:
        batch = _contenders(state, tried)[: min(confirm - len(tried), jobs)]
        if not batch:
            break
        tried.update(batch)
        state = _ask(search, state, batch, pool)
    if not tried:
        return state, f"nothing to confirm: {_why_none_confirmed(state)} (target: {search.asks})"
    rows = state.rows
    done = [i for i in tried if not state.screened(i)]
    fit = sum(1 for i in done if rows[i].verdict in (Verdict.FITS, Verdict.TIGHT))
    said = f"{len(done)} of {len(tried)} confirmed: compiled for {search.asks}"
    if len(done) > fit:  # the estimate was low for these: the user must see it first
        said += f"; {len(done) - fit} of them do not fit there (the CPU estimate was low)"
    left = _contenders(state, tried)
    if left:
        first = state.order().index(left[0]) + 1
        said += (
            f"; from row {first} on, the order is the CPU estimate's, unconfirmed: "
            f"{len(left)} row{'' if len(left) == 1 else 's'} there could still beat the "
            "best confirmed one (raise confirm= to compile more)"
        )
    else:
        said += "; no row on the CPU estimate could beat the best confirmed one"
    return state, said


def _why_none_confirmed(state: State) -> str:
    """Why `confirm` found no row to compile for the target, in words."""
    rows = state.rows
    screened = [i for i in rows if state.screened(i)]
    if not screened and any(row.step is not None for row in rows.values()):
        return "every compiled row is already the target's own compile"
    if any(rows[i].verdict in HOPEFUL for i in screened):
        return "no row on the CPU estimate could beat the best the target fits"
    return "no row fits on the CPU estimate"


def _where_asked(
    hardware: Hardware,
    candidates: list[Candidate],
    devices_per_node: int | None,
    needed: bool,
    compiler_options: tuple[tuple[str, Any], ...],
) -> tuple[TargetChild | None, str]:
    """Where the hardware's target compiles the candidates' devices, or None and why
    not (its compiler is not installed, or spmdtree knows none for the hardware);
    where it is `needed` (``confirm`` > 0, ``screen="target"``), it raises instead,
    naming the pip command, before any work."""
    mesh = candidates[0].mesh
    if needed:
        return compiler_for(mesh, hardware, devices_per_node, compiler_options=compiler_options), ""
    if hardware.chip is None:
        return None, (
            f"the {hardware.name} has no chip= (a st.GpuChip or st.TpuChip), so spmdtree "
            "knows no compiler for it"
        )
    try:
        return compiler_for(mesh, hardware, devices_per_node, compiler_options=compiler_options), ""
    except Mistake as mistake:
        return None, mistake.message


#: Where each screen compiles: the target's compiler where it costs about what the
#: CPU's does (XLA GPU: measured 1.1-1.3x a CPU compile), the CPU estimate where
#: the target's costs far more (libtpu: 7-10x).
Screen = Literal["auto", "cpu", "target"]


def _screen(asks: TargetChild | None, screen: Screen) -> TargetChild | None:
    """Where the first pass compiles (None: the CPU estimate)."""
    if screen == "cpu" or asks is None:
        return None
    if screen == "target" or asks.toolchain.screens_cheaply:
        return asks
    return None


def _screen_note(
    asks: TargetChild | None, screened: TargetChild | None, why: str, screen: Screen
) -> str:
    """What the note says of the first pass: where it compiled, and why there."""
    if screened is not None:
        return f"screened on the target: compiled for {screened}"
    if asks is None:
        return f"screened on the CPU estimate, the target's compiler not asked: {why}"
    compiler = asks.placement.target.compiler
    why = (
        "as asked (screen='cpu')" if screen == "cpu" else f"({compiler} costs far more per compile)"
    )
    return (
        f"screened on the CPU estimate {why}; the rows over the budget on it compiled for "
        "the target"
    )


@contextlib.contextmanager
def _warned_once() -> Iterator[None]:
    """Each warning of the call once: those raised per candidate (the same line of
    the user's make_step, or of spmdtree, for each layout) are shown once, with
    how many candidates raised them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    seen: dict[tuple[Any, str, int], list[warnings.WarningMessage]] = {}
    for w in caught:
        seen.setdefault((w.category, w.filename, w.lineno), []).append(w)
    for same in seen.values():
        first = same[0]
        more = f" (and {len(same) - 1} more like it in this advise call)" if len(same) > 1 else ""
        warnings.warn_explicit(
            f"{first.message}{more}", first.category, first.filename, first.lineno
        )


@public
def advise(
    make_step: Callable[[Candidate], tuple[Callable[..., Any], Sequence[Any], Mapping[str, Any]]],
    candidates: Iterable[Candidate],
    *,
    hardware: Hardware | str | os.PathLike[str],
    devices_per_node: int | None = None,
    budget_bytes: int | None = None,
    jobs: int | None = None,
    progress: bool = True,
    confirm: int = 0,
    screen: Screen = "auto",
    compiler_options: Mapping[str, Any] | None = None,
    executor: concurrent.futures.Executor | None = None,
    measure: int = 0,
) -> Advice:
    """Preflights every candidate layout and ranks them by each step's predicted time.

    It answers: which layout of my step fits, and which is fastest, on hardware
    I don't have. Each candidate is planned first: one whose batch its batch
    axes do not divide (every device would compute the whole batch: verdict
    ``"batch unsharded"``), or whose arrays alone exceed the budget, is not
    compiled. The batch axes are read from the plan's record, whatever the
    batch's names: a dimension of the arguments of the candidate's batch
    size that its mesh axes (a rule's, or a box's own) do not divide, left
    unsharded; a name such as "batch" need not be resolved, and a batch on
    mesh axes directly is caught alike; so is a microbatch (the option
    ``microbatches``: the batch over it) those axes do not divide (new in
    0.8). The others are traced here, one after
    the other, and compiled in parallel subprocesses (at most `jobs` at once;
    each distinct step once), then timed with `StepPlan.time`.

    Where they compile (new in 0.5): on GPU hardware with XLA GPU installed,
    on the target's own compiler (it costs about what a CPU compile does);
    else on the CPU estimate, which runs high on models that unroll their
    layers (1.5-4.5x an accelerator's peak, measured), so where the target's
    compiler is installed (libtpu, far dearer per compile) a row over the
    budget on the estimate is compiled for the target before it is called
    over. Every row ranks by one key, whichever compiler its figures are
    from (`rank`). A warning raised for each candidate (the same line of
    `make_step` each time) is shown once. A candidate whose `make_step` or step
    fails is a row with the message, never an exception; a `make_step` that
    does not return ``(fn, args, kwargs)`` at all is the caller's mistake,
    raised. A first line on
    stderr says what the search will do, then one line per candidate as it
    finishes, with the time left.

    The budget is a device's whole memory unless `budget_bytes` says less; a
    step within `TIGHT_MARGIN` (5%) of it is ``"tight"``, not ``"fits"``. On
    GPU, JAX preallocates 75% of the memory unless
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise, and an allocator loses
    some to fragmentation: pass ``budget_bytes`` for what the job will have.

    Rows rank by the predicted time (the compiled schedule walked with each
    kernel timed by the model, `StepTime.predicted_seconds`); the bound beside
    it is a roofline (peak FLOPs, perfect overlap), which published runs
    reach 40-70% of (docs/planning.md).

    Args:
        make_step: ``make_step(candidate) -> (fn, args, kwargs)``, what
            ``preflight(fn, *args, mesh=candidate.mesh, rules=candidate.rules,
            **kwargs)`` takes (kwargs without mesh or rules).
        candidates: the `Candidate` layouts, all over one device count.
        hardware: the `Hardware` to time on (``st.hardware("h100")``), a preset's name
            or the path of a file `Hardware.to_json` wrote (new in 0.8).
        devices_per_node: overrides the hardware's.
        budget_bytes: memory per device, an int > 0; None: the hardware's.
        jobs: how many compiles run at once; None: the CPU count, fewer where
            memory is short (a compile takes ~0.7 GB).
        progress: print the progress lines to stderr.
        confirm: compile up to `confirm` rows screened on the CPU estimate
            again with the hardware's own compiler (`preflight`'s
            ``target=``), best first, while one of them could still beat the
            best row the target fits (new in 0.4; 0.5: one ranking for all
            rows, and `Advice.note` says from which row the order is the
            estimate's). Needs the target's compiler: missing, it is an error
            at the call.
        screen: where every candidate compiles first (new in 0.5): ``"auto"``
            (the target's compiler on GPU hardware where it is installed, else
            the CPU estimate), ``"cpu"`` or ``"target"``.
        compiler_options: the job's own XLA options, as for `preflight`: every
            compile for the target takes them (new in 0.6); the CPU estimate's
            rows compile without them, and say so in their flags.
        executor: a `concurrent.futures.Executor` that runs the compiles (new
            in 0.6): Dask's, ``distributed.Client(address).get_executor()``,
            spreads them over a cluster's workers (each needs spmdtree and the
            target's compiler installed; docs/planning.md, "A search on more
            than one machine"). The steps are traced here; each compile is a
            fresh process on a worker, fed the exported step; a worker's
            failure is the row's. None: local processes, `jobs` at a time. A
            step that must lower here (cuDNN's attention) compiles here.
        measure: run up to `measure` of the best-predicted rows that fit on
            their devices (`st.measure`; new in 0.7): each candidate's mesh must
            be a `Mesh` of this process's devices. The rows run rank first, by
            their measured time per sequence, measured beside predicted (their
            `AdviceRow.measured`; their step and time become those of the
            devices' own compile, which the run measured); a row that fails to
            run says why in its flags.

    Returns:
        The `Advice`, ranked.

    Raises:
        TypeError: for a `budget_bytes` that is not an int (such as 1.5e9), or
            a `make_step` that does not return ``(fn, args, kwargs)``.
        ValueError: for no candidates, candidates over different device
            counts, a `budget_bytes` <= 0, bad `jobs`, `devices_per_node` or
            `screen`, ``confirm`` > 0 or ``screen="target"`` where the target's
            compiler is not installed (naming the pip command), ``measure`` > 0
            with a candidate whose mesh is no `Mesh` of this process's devices
            (all before any `make_step` runs), or kwargs that name the mesh or
            rules.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> def make_step(c):
        ...     x = st.LogicallyPartitioned(jax.ShapeDtypeStruct((c.batch, 512), jnp.float32), ("batch", None))
        ...     w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((512, 512), jnp.float32), (None, "mlp"))
        ...     return (lambda x, w: jnp.sum(jnp.tanh(x.value @ w.value)), (x, w), {})
        >>> rules = [("batch", "data"), ("mlp", "tensor")]
        >>> candidates = [st.Candidate(m, rules, batch=64) for m in st.layouts(4, ("data", "tensor"))]
        >>> advice = st.advise(make_step, candidates, hardware=st.hardware("h100"), progress=False)
        >>> len(advice.rows), advice.compiles, advice.best is not None
        (3, 3, True)
    """
    candidates = checked_candidates(candidates)
    hardware = hardware_of(hardware)  # a preset's name or a file's too (new in 0.8)
    _check_arguments(jobs, devices_per_node, confirm, screen)
    _check_measure(measure, candidates)
    budget = budget_per_device(budget_bytes, hardware)
    workers = jobs or default_jobs()
    needed = confirm > 0 or screen == "target"
    asks, why = _where_asked(
        hardware, candidates, devices_per_node, needed, check_compiler_options(compiler_options)
    )
    first = _screen(asks, screen)
    report = printer(len(candidates)) if progress else None
    _check_executor(executor)
    search = Search(hardware, devices_per_node, budget, tuple(candidates), asks, report, executor)
    if progress:
        print(
            start_line(candidates, workers, confirm, first, asks is not None),
            file=sys.stderr,
            flush=True,
        )
    with _warned_once(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        firsts = ((i, _first_pass(search, i, make_step, first)) for i in range(len(candidates)))
        state = _run(search, State(), firsts, pool)
        state = _ask(search, state, _over_on_the_estimate(search, state), pool)
        state, confirmed = _confirm(search, state, confirm, pool, workers)
    state = said_stages(said_repeats(state))
    rows = _measured(state.ranked(), measure, make_step, search, compiler_options)
    said = [_screen_note(asks, first, why, screen), confirmed]
    said += [rules_said(state), nothing_fits_said(state, budget)]
    note = "; ".join(part for part in said if part)
    return Advice(rows, state.compiles, hardware, budget, note=note)


def _check_arguments(
    jobs: object, devices_per_node: object, confirm: object, screen: object
) -> None:
    """Refuses advise's arguments of the wrong kind or value, before any step runs."""
    if not count_or_none(jobs):
        raise Mistake(ValueError, f"jobs is {jobs!r}; expected an int >= 1 (or None).")
    if devices_per_node is not None:
        check_devices_per_node(devices_per_node, "devices_per_node", "the hardware's")
    if not isinstance(confirm, int) or isinstance(confirm, bool) or confirm < 0:
        raise Mistake(
            ValueError,
            f"confirm is {confirm!r}; expected an int >= 0: how many of the best rows to "
            "compile again for the hardware's target (0: none).",
        )
    if screen not in ("auto", "cpu", "target"):
        raise Mistake(
            ValueError,
            f"screen is {screen!r}; expected 'auto' (the target's compiler where it is about "
            "as cheap as the CPU's: XLA GPU), 'cpu' (the CPU estimate) or 'target'.",
        )


def _check_executor(executor: object) -> None:
    """Refuses an executor that is no `concurrent.futures.Executor`."""
    if executor is not None and not isinstance(executor, concurrent.futures.Executor):
        raise Mistake(
            TypeError,
            f"executor is {executor!r}; expected a concurrent.futures.Executor (Dask's: "
            "distributed.Client(address).get_executor()), or None for local processes.",
        )


def _check_measure(measure: object, candidates: Sequence[Candidate]) -> None:
    """Refuses a `measure` that is no count, or candidates whose devices are not here."""
    if not isinstance(measure, int) or isinstance(measure, bool) or measure < 0:
        raise Mistake(
            ValueError if isinstance(measure, int) and not isinstance(measure, bool) else TypeError,
            f"measure is {measure!r}; expected an int >= 0: how many of the best rows that "
            "fit to run on their devices (0: none).",
        )
    for i, candidate in enumerate(candidates if measure else ()):
        try:
            check_here(candidate.mesh)
        except Mistake as e:
            raise Mistake(
                ValueError,
                f"measure={measure} runs rows on their devices, but candidate {i}'s {e.message}",
            ) from None


def _measured(
    rows: tuple[AdviceRow, ...],
    k: int,
    make_step: Callable[[Candidate], Any],
    search: Search,
    compiler_options: Mapping[str, Any] | None,
) -> tuple[AdviceRow, ...]:
    """The ranked rows with the `k` best that fit run on their devices: those first,
    by their measured time per sequence, then the rest as ranked."""
    chosen = [
        i for i, r in enumerate(rows) if r.verdict in (Verdict.FITS, Verdict.TIGHT) and r.step
    ][:k]
    ran = {i: _ran(rows[i], make_step, search, compiler_options) for i in chosen}
    timed = {
        i: row.measured.seconds / row.candidate.batch for i, row in ran.items() if row.measured
    }
    first = sorted(timed, key=lambda i: timed[i])
    rest = [ran.get(i, row) for i, row in enumerate(rows) if i not in timed]
    return (*(ran[i] for i in first), *rest)


def _ran(
    row: AdviceRow,
    make_step: Callable[[Candidate], Any],
    search: Search,
    compiler_options: Mapping[str, Any] | None,
) -> AdviceRow:
    """`row` with its step run on its devices, or a flag saying why it could not be."""
    c = row.candidate
    try:
        fn, args, kw = step_call(make_step(c))
        keywords = {name: getattr(kw, name) for name in Keywords.names()}
        m = run_step(
            fn,
            *args,
            mesh=c.mesh,
            rules=c.rules,
            **keywords,
            compiler_options=compiler_options,
            hardware=search.hardware,
        )
    except Exception as e:  # the row's, as a compile's failure is
        return flagged(row, f"not measured: {error_text(e)}")
    tokens = c.batch * c.length / m.seconds if c.length else None
    # the step as the devices' own compiler compiled it, which the run measured: its
    # figures, its verdict
    step = cast(StepPlan, m.plan)
    verdict, reason = verdict_of(step, search.budget, None)
    return row._replace(
        measured=m,
        tokens_per_second=tokens,
        step=step,
        time=step.time(search.hardware),
        verdict=verdict,
        reason=f"{reason}; measured on its devices",
    )
