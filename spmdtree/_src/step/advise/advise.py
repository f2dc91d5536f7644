"""Choosing a layout: `advise` preflights candidate layouts and ranks them by a roofline.

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
import dataclasses
import itertools
import math
import numbers
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from spmdtree._src.errors import Mistake, public
from spmdtree._src.plan import Plan
from spmdtree._src.rules import AnyMesh, Rules
from spmdtree._src.step.advise.diagnose import (
    Closest,
    nothing_fits,
    repeated,
    split_work,
)
from spmdtree._src.step.advise.records import (
    CPU_OVER,
    HOPEFUL,
    TIGHT_MARGIN,
    Advice,
    AdviceRow,
    Candidate,
    Verdict,
    label_of,
)
from spmdtree._src.step.compile.analysis import Analysis
from spmdtree._src.step.compile.compilers import (
    CpuChild,
    DoesNotFit,
    TargetChild,
    check_options,
    compile_child,
    compiler_for,
)
from spmdtree._src.step.compile.preflight import Keywords, plan_arguments, step_plan, trace_for
from spmdtree._src.step.compile.step_plan import StepPlan
from spmdtree._src.step.compile.trace import Arguments, Exported, Traced
from spmdtree._src.step.hw.hardware import PRESETS, Hardware, check_devices_per_node
from spmdtree._src.step.measure.measure import check_here
from spmdtree._src.step.measure.measure import measure as run_step
from spmdtree._src.step.time.bound import StepTime, ranked_seconds
from spmdtree._src.text import (
    LeftUnsharded,
    Located,
    argument_path,
    entries_text,
    seconds_text,
    size_text,
)

#: A compile subprocess's analysis, to come.
_Child = concurrent.futures.Future[Analysis]


#: The memory one compile subprocess takes (measured: ~0.7 GB at 2,048 devices,
#: about flat in the device count), to bound how many run at once.
CHILD_BYTES = 700 * 2**20


def _sizes_allowed(
    axes: Sequence[str], sizes: Mapping[str, int | tuple[int, int]] | None
) -> dict[str, tuple[int, int]]:
    """Each axis's inclusive bounds, checked."""
    allowed = {axis: (1, sys.maxsize) for axis in axes}
    for axis, size in (sizes or {}).items():
        if axis not in allowed:
            raise Mistake(
                ValueError,
                f"sizes names {axis!r}, which is not one of the axes {tuple(axes)}.",
            )
        bounds = (size, size) if isinstance(size, int) else tuple(size)
        ok = len(bounds) == 2 and all(isinstance(b, int) and b >= 1 for b in bounds)
        if not ok or bounds[0] > bounds[1]:
            raise Mistake(
                ValueError,
                f"sizes[{axis!r}] is {size!r}; expected an int >= 1 or (lo, hi) with "
                "1 <= lo <= hi (inclusive).",
            )
        allowed[axis] = (bounds[0], bounds[1])
    return allowed


def _factorizations(devices: int, count: int) -> Iterable[tuple[int, ...]]:
    """Every way to write `devices` as a product of `count` ints, in lexicographic order."""
    if count == 1:
        yield (devices,)
        return
    for first in range(1, devices + 1):
        if devices % first == 0:
            for rest in _factorizations(devices // first, count - 1):
                yield (first, *rest)


@public
def layouts(
    devices: int,
    axes: Sequence[str] = ("data", "fsdp", "tensor"),
    *,
    sizes: Mapping[str, int | tuple[int, int]] | None = None,
    axis_types: AxisType | Sequence[AxisType] | None = None,
) -> list[AbstractMesh]:
    """Every way to lay `devices` out as a product over `axes`, as abstract meshes.

    In lexicographic order of the axis sizes (the first axis smallest first).

    Args:
        devices: how many devices.
        axes: the mesh axis names, in mesh order.
        sizes: per axis an int (fixed) or ``(lo, hi)`` (inclusive bounds), e.g.
            ``{"tensor": (1, 8)}``.
        axis_types: one `AxisType` for every axis, or one per axis; None: Auto on
            every axis, whatever the jax version's default.

    Returns:
        The meshes.

    Raises:
        ValueError: for devices < 1, repeated axes, a size naming no axis,
            bad bounds, or bounds that no factorization meets.

    Example:
        >>> import spmdtree as st
        >>> [tuple(m.shape.values()) for m in st.layouts(8, ("data", "tensor"), sizes={"tensor": (2, 4)})]
        [(2, 4), (4, 2)]
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise Mistake(ValueError, f"devices is {devices!r}; expected an int >= 1.")
    axes = tuple(axes)
    if not axes or len(set(axes)) != len(axes) or not all(isinstance(a, str) for a in axes):
        raise Mistake(ValueError, f"axes is {axes!r}; expected distinct axis names.")
    allowed = _sizes_allowed(axes, sizes)
    types = (AxisType.Auto,) * len(axes) if axis_types is None else axis_types
    types = (types,) * len(axes) if isinstance(types, AxisType) else tuple(types)
    if len(types) != len(axes):
        raise Mistake(ValueError, f"axis_types is {axis_types!r}; expected one per axis {axes}.")
    shapes = [
        shape
        for shape in _factorizations(devices, len(axes))
        if all(lo <= n <= hi for n, (lo, hi) in zip(shape, allowed.values(), strict=True))
    ]
    if not shapes:
        raise Mistake(
            ValueError,
            f"no way to write {devices} devices as a product over {axes} meets the sizes "
            f"{dict(sizes or {})}. Widen the bounds.",
        )
    return [AbstractMesh(shape, axes, axis_types=types) for shape in shapes]


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


@dataclasses.dataclass(frozen=True)
class _Step:
    """A candidate's step, planned: what tracing it (again, for a target) takes."""

    fn: Callable[..., Any]
    planned: Arguments
    keywords: Keywords


@dataclasses.dataclass(frozen=True)
class _Search:
    """What every row is judged by, fixed for the call: the hardware, the budget,
    the candidates, where the target's compiler can be asked (`asks`; None: it
    cannot: no compiler installed, or the hardware has none spmdtree knows), and
    `report`, called with each row as it is decided and how many are (the
    progress lines; None: silent)."""

    hardware: Hardware
    devices_per_node: int | None
    budget: int
    candidates: tuple[Candidate, ...]
    asks: TargetChild | None = None
    report: Callable[[AdviceRow, int, bool], None] | None = None
    executor: concurrent.futures.Executor | None = None


# --- a candidate's records: each stage's outcome, immutable -----------------------------


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A candidate traced and exported, waiting for its compile subprocess
    (`confirming`: again, for the target, after a screened compile)."""

    index: int
    traced: Traced
    compiler: CpuChild | TargetChild
    step: _Step
    confirming: bool = False


@dataclasses.dataclass(frozen=True)
class _Rejected:
    """A candidate decided without figures: its plan rules it out, or its
    make_step, trace or compile failed (or the target's compiler found it too
    big for a chip); `arrays_bytes`, where its arrays alone were over the budget,
    their bytes per device."""

    row: AdviceRow
    arrays_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A candidate compiled where it was screened, judged on those figures; its
    `step`, to trace it again for the target."""

    row: AdviceRow
    step: _Step


@dataclasses.dataclass(frozen=True)
class _Confirmed:
    """A screened candidate compiled again for the target, judged on its figures."""

    row: AdviceRow


@dataclasses.dataclass(frozen=True)
class _Unconfirmed:
    """A screened candidate whose trace or compile for the target failed: its
    screened row kept, flagged with why."""

    row: AdviceRow
    step: _Step


_Record = _Rejected | _Compiled | _Confirmed | _Unconfirmed


@dataclasses.dataclass(frozen=True)
class _State:
    """The search so far: each decided candidate's record by its index, and the
    compiles run. Never changed: each step of the search returns a new one."""

    records: Mapping[int, _Record] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    compiles: int = 0

    def add(self, index: int, record: _Record, compiles: int = 0) -> _State:
        """This state with `index` decided as `record`, and `compiles` more run."""
        records = types.MappingProxyType({**self.records, index: record})
        return _State(records, self.compiles + compiles)

    def counted(self, compiles: int) -> _State:
        """This state with `compiles` more run."""
        return _State(self.records, self.compiles + compiles)

    @property
    def rows(self) -> dict[int, AdviceRow]:
        return {i: record.row for i, record in self.records.items()}

    def order(self) -> list[int]:
        """The candidates' indices, best row first (`rank`), a layout whose devices
        repeat each other's work after those that split it (`split_work`)."""
        split = _split(self.rows.values())
        return sorted(self.records, key=lambda i: rank(self.records[i].row, i, split))

    def ranked(self) -> tuple[AdviceRow, ...]:
        return tuple(self.records[i].row for i in self.order())

    def screened(self, index: int) -> bool:
        """Whether a row's figures are the CPU estimate's."""
        step = self.records[index].row.step
        return step is not None and step.backend.estimates


def _recorded(
    search: _Search, state: _State, index: int, record: _Record, compiles: int = 0
) -> _State:
    """`state` with `record`; a decided row (not a flag added to one) reported."""
    after = state.add(index, record, compiles)
    if search.report is not None and not isinstance(record, _Unconfirmed):
        search.report(record.row, len(after.records), index in state.records)
    return after


def _row(
    search: _Search,
    index: int,
    verdict: Verdict,
    reason: str,
    step: StepPlan | None = None,
    flags: tuple[str, ...] = (),
) -> AdviceRow:
    """A candidate's row: its verdict and reason, its step timed on the hardware."""
    candidate = search.candidates[index]
    timed = None
    if step is not None:
        try:
            timed = step.time(search.hardware, devices_per_node=search.devices_per_node)
        except ValueError as e:  # the hardware lacks a link kind: said, not lost
            reason = f"{reason}; not timed: {e}"
    if timed is not None and verdict in (Verdict.FITS, Verdict.TIGHT):
        reason += "; " + _bound_by(timed)
    tokens = None
    if timed is not None and candidate.length is not None and ranked_seconds(timed) > 0:
        tokens = candidate.batch * candidate.length / ranked_seconds(timed)
    flags = _batch_first(candidate, flags)
    return AdviceRow(candidate, verdict, reason, step, timed, tokens, flags)


def _flagged(row: AdviceRow, flag: str) -> AdviceRow:
    """A row as it stands, with one flag more."""
    return row._replace(flags=(*row.flags, flag))


def _rejection(search: _Search, index: int, planned: Plan) -> _Rejected | None:
    """A candidate its plan rules out before any compile: its batch axes do not
    divide its batch, or its arrays alone exceed the budget; else None."""
    rejected = _rejected(search.candidates[index], planned, search.budget)
    if rejected is None:
        return None
    flags = tuple(
        Located(argument_path(row.path), flag) for row in planned.rows for flag in row.flags
    )
    over = planned.device_bytes if rejected[0] == Verdict.OVER_BUDGET else None
    return _Rejected(_row(search, index, *rejected, flags=flags), over)


def _judged(search: _Search, index: int, step: StepPlan) -> AdviceRow:
    """The row of a compiled step: its verdict from its peak against the budget; its
    flags, and the collectives its layout does not explain where they are far
    above it."""
    traffic = step.unexplained_traffic
    flags = step.flags if traffic is None else (*step.flags, traffic.sentence)
    return _row(search, index, *_verdict(step, search.budget, search.asks), step, flags)


def _failed(search: _Search, index: int, reason: str) -> _Rejected:
    return _Rejected(_row(search, index, Verdict.DOES_NOT_COMPILE, reason))


def _batch_first(candidate: Candidate, flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags with the batch's own (a dimension of the batch's size left
    unsharded) first: the one that makes a layout no layout."""

    def is_batch(flag: str) -> bool:
        return _batch_flag(candidate, flag.flag if isinstance(flag, Located) else flag)

    return tuple(sorted(flags, key=lambda flag: not is_batch(flag)))


def _batch_flag(candidate: Candidate, flag: str) -> bool:
    """Whether a plan flag is the batch's own: a dimension of the candidate's batch
    size left unsharded."""
    return isinstance(flag, LeftUnsharded) and flag.size == candidate.batch


def _rejected(candidate: Candidate, planned: Plan, budget: int) -> tuple[Verdict, str] | None:
    """The verdict and reason of a candidate its plan rules out, or None."""
    unsharded = _unsharded_batch(candidate, planned)
    if unsharded is not None:
        return Verdict.BATCH_UNSHARDED, f"{unsharded}; not compiled"
    if planned.device_bytes > budget:
        arrays, said = size_text(planned.device_bytes), size_text(budget)
        return Verdict.OVER_BUDGET, f"arrays alone {arrays} > {said}, not compiled"
    return None


def _verdict(step: StepPlan, budget: int, asks: TargetChild | None) -> tuple[Verdict, str]:
    """A compiled step's verdict and its reason: its peak against the budget. Over
    it on the CPU estimate, where the target cannot be asked, the row says the
    estimate runs high."""
    peak, said = size_text(step.judged_bytes), size_text(budget)
    if step.judged_bytes != step.peak_bytes:  # the compiler's own, which it checks
        peak = f"{peak} (the compiler's own; {size_text(step.peak_bytes)} summed)"
    if step.judged_bytes <= budget * (1 - TIGHT_MARGIN):
        return Verdict.FITS, f"peak {peak} of {said} budget"
    if step.judged_bytes <= budget:
        return Verdict.TIGHT, f"peak {peak} of {said} budget, within {TIGHT_MARGIN:.0%} of it"
    if not step.backend.estimates:
        return Verdict.OVER_BUDGET, f"peak {peak} > {said} budget"
    high = (
        f"the CPU estimate, which ran {CPU_OVER} an accelerator's on models that unroll their "
        "layers (docs/planning.md)"
    )
    ask = "asked of the target's compiler next" if asks is not None else "install its compiler"
    if step.peak_bytes - step.overstated_bytes <= budget:
        over = size_text(step.overstated_bytes)
        return Verdict.MAY_FIT, (
            f"peak {peak} > {said} budget on {high}, {over} of it whole reductions an "
            f"accelerator holds as shards: {ask}"
        )
    return Verdict.OVER_BUDGET, f"peak {peak} > {said} budget on {high}: {ask}"


def _work(candidate: Candidate) -> Hashable:
    """What fixes a candidate's work: its batch, length and options (its layout only
    splits it)."""
    return (candidate.batch, candidate.length, tuple(sorted((candidate.options or {}).items())))


def _split(rows: Iterable[AdviceRow]) -> dict[Hashable, int]:
    """Per work (`_work`), the fewest FLOPs per device of the compiled rows
    (`split_work`)."""
    return split_work([(_work(r.candidate), r.step.flops) for r in rows if r.step is not None])


def _repeated(row: AdviceRow, split: Mapping[Hashable, int]) -> str | None:
    """What a compiled row whose devices repeat each other's work is told, or None
    (`diagnose.repeated`)."""
    if row.step is None:
        return None
    least = split.get(_work(row.candidate), 0)
    sizes = dict(row.candidate.mesh.shape)
    return repeated(sizes, row.step.inputs, row.step.flops, least, row.candidate.batch)


def rank(
    row: AdviceRow, index: int, split: Mapping[Hashable, int] | None = None
) -> tuple[int, int, float, int, float, str, int, int]:
    """A row's place, the one key for every row, whichever compiler's figures it
    has: its verdict (`Verdict`'s order; compiled over budget before rejected),
    then, for those that fit, may fit or are tight, the predicted time per
    sequence (`StepTime.predicted_seconds`; the bound where there is none) (6
    significant figures: equal throughput is equal), the smaller peak, the serial
    time; a compiled row over budget by its peak (the least over first; new in
    0.6: 0.5 went by the label's text); and last its position in the input. A
    row whose devices repeat each other's work (its FLOPs per device against the
    fewest of its batch's rows, `split`) ranks after every row of its verdict
    that splits the work (new in 0.6) (new in 0.5: 0.4 put the target's
    figures first, so a confirmed row that was slowest stayed first). Exact ties
    go by the layout's label and batch, so no order of the candidates changes
    which rows win; only rows equal in all of it keep the input's order."""
    verdict = list(Verdict).index(Verdict(row.verdict))
    order = 2 * verdict + (row.verdict == Verdict.OVER_BUDGET and row.step is None)
    if row.verdict == Verdict.OVER_BUDGET and row.step is not None:  # the least over first
        return (order, 0, 0.0, row.step.peak_bytes, 0.0, *_tie(row, index))
    if row.verdict not in HOPEFUL or row.step is None:
        return (order, 0, 0.0, 0, 0.0, *_tie(row, index))
    repeats = int(_repeated(row, split or {}) is not None)
    if row.time is None:  # compiled but not timed: after the timed ones
        return (order, repeats, math.inf, row.step.peak_bytes, math.inf, *_tie(row, index))
    # per sequence: at one batch, the bound's order; across batches, the step
    # time alone would always favour the smaller batch
    per = row.candidate.batch
    bound = float(f"{ranked_seconds(row.time) / per:.6g}")
    serial = row.time.serial_seconds / per
    return (order, repeats, bound, row.step.peak_bytes, serial, *_tie(row, index))


def _tie(row: AdviceRow, index: int) -> tuple[str, int, int]:
    return (label_of(row.candidate), row.candidate.batch, index)


def _unsharded_batch(candidate: Candidate, planned: Plan) -> str | None:
    """Why the candidate's batch is no layout: a dimension of its arguments of the
    candidate's batch size that its mesh axes do not divide, left unsharded (the
    plan's own record, `LeftUnsharded`, so it holds whatever the batch's names
    are, logical or mesh axes); None where there is none."""
    sizes = dict(candidate.mesh.shape)
    for row in planned.rows:
        for flag in row.flags:
            if isinstance(flag, LeftUnsharded) and _batch_flag(candidate, flag):
                tried = " or ".join(
                    f"{entries_text((axes,), 1)} "
                    f"({math.prod(sizes.get(a, 1) for a in ((axes,) if isinstance(axes, str) else axes))})"
                    for axes in flag.axes
                )
                return (
                    f"batch {candidate.batch} is not divided by its batch axes {tried}: every "
                    f"device would compute the whole batch (the array at {argument_path(row.path)}, dimension "
                    f"{flag.dimension})"
                )
    return None


def _printer(total: int) -> Callable[[AdviceRow, int, bool], None]:
    """What reports each row decided: its progress line on stderr, timed from now;
    a row decided again (compiled for the target after the estimate) said so."""
    started = time.perf_counter()
    compiled = [0]

    def report(row: AdviceRow, done: int, again: bool) -> None:
        compiled[0] += row.step is not None
        elapsed = time.perf_counter() - started
        line = _progress_line(row, done, total, elapsed, compiled[0])
        if again:  # 0.5 printed another "[n/n] ... done" for each
            line = f"advise [for the target] {line.split('] ', 1)[1].rsplit('; ', 1)[0]}"
        print(line, file=sys.stderr, flush=True)

    return report


def _progress_line(row: AdviceRow, done: int, total: int, elapsed: float, compiled: int) -> str:
    """``advise [3/12] data 2 x tensor 4, batch 8: fits, predicted 1.2 ms (peak ...); about 40 s left``.

    The time left is the rows left at the pace of the compiles so far, as if each
    compiled (new in 0.6: 0.5 took the pace of every row, and a few quick
    failures promised a long search would end in seconds).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
        >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "does not compile", "a typo", None, None, None)
        >>> _progress_line(row, 4, 28, 2.0, 0).split("; ")[-1]  # four quick failures
        'time left not known until a step compiles'
        >>> _progress_line(row, 5, 28, 62.0, 1).split("; ")[-1]  # then a compile of a minute
        'about 23 min 46 s left'
    """
    if done == total:
        left = f"done in {_duration(elapsed)}"
    elif compiled == 0:
        left = "time left not known until a step compiles"
    else:
        left = _duration(elapsed / compiled * (total - done))
        left = f"{'' if left.startswith('under') else 'about '}{left} left"
    bound = "" if row.time is None else f", predicted {seconds_text(ranked_seconds(row.time))}"
    return (
        f"advise [{done}/{total}] {label_of(row.candidate)}, batch {row.candidate.batch}: "
        f"{row.verdict}{bound} ({row.reason}); {left}"
    )


def _duration(seconds: float) -> str:
    """``under 1 s``, ``12 s``, ``3 min 20 s``, ``1 h 5 min``."""
    whole = round(seconds)
    if whole < 1:
        return "under 1 s"
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def _start_line(
    candidates: list[Candidate], jobs: int, confirm: int, first: TargetChild | None, asks: bool
) -> str:
    """The first progress line: what the search will do."""
    n = len(candidates)
    devices = math.prod(candidates[0].mesh.shape.values())
    # screened on the target itself, there is nothing to confirm
    again = f", then up to {confirm} for the target" if confirm and first is None else ""
    most = n + (confirm if again else 0)
    on = "the CPU estimate" if first is None else str(first)
    over = (
        f"; then up to {n} more for the target's compiler, for the rows over the budget on it"
        if first is None and asks
        else ""
    )
    return (
        f"advise: {n} candidate{'' if n == 1 else 's'} on {devices} devices, at most {most} "
        f"compile{'' if most == 1 else 's'} (each distinct step once{again}), {jobs} "
        f"job{'' if jobs == 1 else 's'} at once; screened on {on}{over}"
    )


def _bound_by(timed: StepTime) -> str:
    """``bound by compute`` or ``bound by collectives, most over fsdp``."""
    if timed.compute_seconds >= timed.comm_seconds:
        return "bound by compute"
    axes = max(timed.comm_by_axes, key=lambda a: timed.comm_by_axes[a])
    return f"bound by collectives, most over {'+'.join(axes) or 'no axis'}"


def _message(error: BaseException) -> str:
    """What a row says of an error: spmdtree's message as preflight would raise it,
    else the error's own."""
    if isinstance(error, Mistake):
        return str(error.error("preflight"))
    if isinstance(error, (ValueError, TypeError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _first_pass(
    search: _Search, index: int, make_step: Callable[[Candidate], Any], screen: TargetChild | None
) -> _Pending | _Record:
    """Plans the candidate, and traces and exports its step for `screen` (None: the
    CPU estimate; or compiles it here, on a mesh this process has the devices
    for): a pending compile, or the candidate's record."""
    candidate = search.candidates[index]
    try:
        returned = make_step(candidate)
    except Exception as e:
        return _failed(search, index, f"make_step raised {_message(e)}")
    fn, args, keywords = step_call(returned)
    mesh = _abstract(candidate)
    try:
        planned = plan_arguments(args, mesh, candidate.rules, keywords)
        rejected = _rejection(search, index, planned.plan)
        if rejected is not None:
            return rejected
        step = _Step(fn, planned, keywords)
        at = screen if screen is not None else compiler_for(mesh, None, None)
        meets = (at,) if search.asks is None else (at, search.asks)
        traced = trace_for(fn, planned, mesh, candidate.rules, keywords, meets)
        if at.here is None:  # exported: its child compiles it in the pool
            return _Pending(index, traced, at, step)
        compiled = step_plan(traced, at.compile(traced), at)
    except Exception as e:
        return _failed(search, index, _message(e))
    return _Compiled(_judged(search, index, compiled), step)


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


def _second_pass(search: _Search, state: _State, pending: _Pending, child: _Child) -> _Record:
    """A pending candidate's record from its subprocess's analysis; a confirming
    compile that fails keeps the screened row, flagged."""
    index = pending.index
    try:
        step = step_plan(pending.traced, child.result(), pending.compiler)
    except DoesNotFit as mistake:  # the target's compiler: too big for one chip
        row = _row(search, index, Verdict.OVER_BUDGET, str(mistake.error("preflight")))
        return _Confirmed(row) if pending.confirming else _Rejected(row)
    except Exception as e:
        if not pending.confirming:
            return _failed(search, index, _message(e))
        flag = f"not confirmed by {pending.compiler}: {_message(e)}"
        return _Unconfirmed(_flagged(state.records[index].row, flag), pending.step)
    row = _judged(search, index, step)
    return _Confirmed(row) if pending.confirming else _Compiled(row, pending.step)


def _run(
    search: _Search,
    state: _State,
    firsts: Iterable[tuple[int, _Pending | _Record]],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> _State:
    """Starts each pending candidate's compile as it comes (once per distinct step,
    through its compiler's `compile`) and records every candidate whose compile
    is done between them, so the rows are reported as candidates finish."""
    children: dict[tuple[str | None, Any], _Child] = {}
    waiting: dict[_Child, list[_Pending]] = {}

    def finish(state: _State, done: Iterable[_Child]) -> _State:
        for child in done:
            for pending in waiting.pop(child):
                record = _second_pass(search, state, pending, child)
                state = _recorded(search, state, pending.index, record)
        return state

    for index, first in firsts:
        if isinstance(first, _Pending):
            key = (first.traced.digest, first.compiler)
            if key not in children:
                children[key] = _submit(search, pool, first)
                waiting[children[key]] = []
                state = state.counted(1)
            waiting[children[key]].append(first)
        else:  # decided here: a step compiled in this process counts
            state = _recorded(search, state, index, first, int(isinstance(first, _Compiled)))
        state = finish(state, [child for child in waiting if child.done()])
    return finish(state, concurrent.futures.as_completed(list(waiting)))


def _submit(
    search: _Search, pool: concurrent.futures.ThreadPoolExecutor, pending: _Pending
) -> _Child:
    """A pending step's compile started: a compile in a fresh process of the step
    exported for it by the caller's executor where there is one (a Dask cluster's
    workers: the payload and the compiler pickle), else here; a step lowered in
    this process (cuDNN's attention on XLA GPU's topology) always here."""
    stage = pending.traced.stage
    if search.executor is None or not isinstance(stage, Exported):
        return pool.submit(pending.compiler.compile, pending.traced)
    return search.executor.submit(compile_child, stage.payload, pending.compiler)


def _confirmed(
    search: _Search, state: _State, index: int, target: TargetChild
) -> _Pending | _Record:
    """The candidate's step traced again, exported for the target's compiler (its
    screened row kept, flagged, where it does not trace so)."""
    record = state.records[index]
    step = cast(_Compiled, record).step
    try:
        candidate = search.candidates[index]
        traced = trace_for(
            step.fn, step.planned, _abstract(candidate), candidate.rules, step.keywords, (target,)
        )
    except Exception as e:
        return _Unconfirmed(_flagged(record.row, f"not confirmed by {target}: {_message(e)}"), step)
    return _Pending(index, traced, target, step, confirming=True)


def _ask(
    search: _Search,
    state: _State,
    indices: Sequence[int],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> _State:
    """Compiles the rows at `indices` again for the target and judges them on its
    figures (a row that does not trace or compile so keeps its screened figures,
    flagged)."""
    if search.asks is None or not indices:
        return state
    asks = search.asks
    return _run(search, state, [(i, _confirmed(search, state, i, asks)) for i in indices], pool)


def _over_on_the_estimate(search: _Search, state: _State) -> list[int]:
    """The screened rows over the budget on the CPU estimate alone: the target's
    compiler decides them where it can be asked."""
    if search.asks is None:
        return []
    over = (Verdict.MAY_FIT, Verdict.OVER_BUDGET)
    rows = state.rows
    return [i for i in state.order() if state.screened(i) and rows[i].verdict in over]


def _contenders(state: _State, tried: set[int]) -> list[int]:
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
    search: _Search,
    state: _State,
    confirm: int,
    pool: concurrent.futures.ThreadPoolExecutor,
    jobs: int,
) -> tuple[_State, str]:
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


def _why_none_confirmed(state: _State) -> str:
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
    options: tuple[tuple[str, Any], ...],
) -> tuple[TargetChild | None, str]:
    """Where the hardware's target compiles the candidates' devices, or None and why
    not (its compiler is not installed, or spmdtree knows none for the hardware);
    where it is `needed` (``confirm`` > 0, ``screen="target"``), it raises instead,
    naming the pip command, before any work."""
    mesh = candidates[0].mesh
    if needed:
        return compiler_for(mesh, hardware, devices_per_node, options=options), ""
    if hardware.chip is None:
        return None, (
            f"the {hardware.name} has no chip= (a st.GpuChip or st.TpuChip), so spmdtree "
            "knows no compiler for it"
        )
    try:
        return compiler_for(mesh, hardware, devices_per_node, options=options), ""
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
    hardware: Hardware,
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
    """Preflights every candidate layout and ranks them by a roofline of each step.

    It answers: which layout of my step fits, and which is fastest, on hardware
    I don't have. Each candidate is planned first: one whose batch its batch
    axes do not divide (every device would compute the whole batch: verdict
    ``"batch unsharded"``), or whose arrays alone exceed the budget, is not
    compiled. The batch axes are read from the plan's record, whatever the
    batch's names: a dimension of the arguments of the candidate's batch
    size that its mesh axes (a rule's, or a box's own) do not divide, left
    unsharded; a name such as "batch" need not be resolved, and a batch on
    mesh axes directly is caught alike. The others are traced here, one after
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

    The times are roofline bounds (peak FLOPs, perfect overlap), not
    predictions: they rank layouts; published runs reach 40-70% of such
    bounds (docs/planning.md).

    Args:
        make_step: ``make_step(candidate) -> (fn, args, kwargs)``, what
            ``preflight(fn, *args, mesh=candidate.mesh, rules=candidate.rules,
            **kwargs)`` takes (kwargs without mesh or rules).
        candidates: the `Candidate` layouts, all over one device count.
        hardware: the `Hardware` to time on (``st.hardware("h100")``).
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
    candidates = _checked(candidates)
    if not isinstance(hardware, Hardware):
        fix = (
            f"Pass st.hardware({hardware!r}), the preset of that name"
            if isinstance(hardware, str) and hardware in PRESETS
            else "such as st.hardware('h100'), or a st.Hardware of your own"
        )
        raise Mistake(TypeError, f"hardware is {hardware!r}; expected a st.Hardware. {fix}.")
    if not _count_or_none(jobs):
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
    _check_measure(measure, candidates)
    budget = _budget(budget_bytes, hardware)
    workers = jobs or default_jobs()
    needed = confirm > 0 or screen == "target"
    asks, why = _where_asked(
        hardware, candidates, devices_per_node, needed, check_options(compiler_options)
    )
    first = _screen(asks, screen)
    report = _printer(len(candidates)) if progress else None
    if executor is not None and not isinstance(executor, concurrent.futures.Executor):
        raise Mistake(
            TypeError,
            f"executor is {executor!r}; expected a concurrent.futures.Executor (Dask's: "
            "distributed.Client(address).get_executor()), or None for local processes.",
        )
    search = _Search(hardware, devices_per_node, budget, tuple(candidates), asks, report, executor)
    if progress:
        print(
            _start_line(candidates, workers, confirm, first, asks is not None),
            file=sys.stderr,
            flush=True,
        )
    with _warned_once(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        firsts = ((i, _first_pass(search, i, make_step, first)) for i in range(len(candidates)))
        state = _run(search, _State(), firsts, pool)
        state = _ask(search, state, _over_on_the_estimate(search, state), pool)
        state, confirmed = _confirm(search, state, confirm, pool, workers)
    state = _said_repeats(state)
    rows = _measured(state.ranked(), measure, make_step, search, compiler_options)
    said = [_screen_note(asks, first, why, screen), confirmed]
    said += [_rules_said(state), _nothing_fits(state, budget)]
    note = "; ".join(part for part in said if part)
    return Advice(rows, state.compiles, hardware, budget, note=note)


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
    search: _Search,
    options: Mapping[str, Any] | None,
) -> tuple[AdviceRow, ...]:
    """The ranked rows with the `k` best that fit run on their devices: those first,
    by their measured time per sequence, then the rest as ranked."""
    chosen = [
        i for i, r in enumerate(rows) if r.verdict in (Verdict.FITS, Verdict.TIGHT) and r.step
    ][:k]
    ran = {i: _ran(rows[i], make_step, search, options) for i in chosen}
    timed = {
        i: row.measured.seconds / row.candidate.batch for i, row in ran.items() if row.measured
    }
    first = sorted(timed, key=lambda i: timed[i])
    rest = [ran.get(i, row) for i, row in enumerate(rows) if i not in timed]
    return (*(ran[i] for i in first), *rest)


def _ran(
    row: AdviceRow,
    make_step: Callable[[Candidate], Any],
    search: _Search,
    options: Mapping[str, Any] | None,
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
            compiler_options=options,
            hardware=search.hardware,
        )
    except Exception as e:  # the row's, as a compile's failure is
        return _flagged(row, f"not measured: {_message(e)}")
    tokens = c.batch * c.length / m.seconds if c.length else None
    # the step as the devices' own compiler compiled it, which the run measured: its
    # figures, its verdict
    step = cast(StepPlan, m.plan)
    verdict, reason = _verdict(step, search.budget, None)
    return row._replace(
        measured=m,
        tokens_per_second=tokens,
        step=step,
        time=step.time(search.hardware),
        verdict=verdict,
        reason=f"{reason}; measured on its devices",
    )


def _said_repeats(state: _State) -> _State:
    """Each compiled row whose devices repeat each other's work, flagged so (the
    axis named), its traffic flag, where it has one, saying that is its cause."""
    split = _split(state.rows.values())
    records = dict(state.records)
    for index, record in state.records.items():
        row = record.row
        said = _repeated(row, split)
        if said is None or row.step is None:
            continue
        traffic = row.step.unexplained_traffic
        flags = tuple(f for f in row.flags if traffic is None or f != traffic.sentence)
        if traffic is not None and len(flags) < len(row.flags):
            said += (
                "; the collectives beyond what the layout explains come from it too, not "
                "from unconstrained activations"
            )
        records[index] = dataclasses.replace(record, row=row._replace(flags=(said, *flags)))
    return _State(types.MappingProxyType(records), state.compiles)


def _rules_said(state: _State) -> str:
    """The rules' problems (as `validate_rules` says them) of the compiled steps,
    each once."""
    problems = dict.fromkeys(
        problem.sentence
        for row in state.rows.values()
        if row.step is not None
        for problem in row.step.rule_problems
    )
    return " ".join(problems)


def _nothing_fits(state: _State, budget: int) -> str:
    """Where no compiled row fits, what would: the smallest peak, and whether
    remat, more devices or a smaller batch could bring it under; where none
    compiled, every one's arrays alone over the budget, the smallest arrays (new
    in 0.6: 0.5 said nothing)."""
    compiled = [row for row in state.rows.values() if row.step is not None]
    if any(row.verdict in (Verdict.FITS, Verdict.TIGHT) for row in compiled):
        return ""
    closest = [
        Closest(
            f"{label_of(row.candidate)}, batch {row.candidate.batch}",
            row.step.judged_bytes,
            row.step.temp_bytes,
            math.prod(row.candidate.mesh.shape.values()),
            row.candidate.batch,
        )
        for row in compiled
        if row.step is not None and row.step.judged_bytes > budget
    ]
    if not compiled:
        closest = [
            Closest(
                f"{label_of(r.row.candidate)}, batch {r.row.candidate.batch}: its arrays "
                "alone, not compiled",
                r.arrays_bytes,
                0,
                math.prod(r.row.candidate.mesh.shape.values()),
                r.row.candidate.batch,
            )
            for r in state.records.values()
            if isinstance(r, _Rejected) and r.arrays_bytes is not None
        ]
    return nothing_fits(closest, budget, searched=True) if closest else ""


def _count_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _checked(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The candidates, each a `Candidate` with a mesh and a batch >= 1, all over one
    device count (a ranking compares layouts of one job)."""
    candidates = list(candidates)
    if not candidates:
        raise Mistake(ValueError, "candidates is empty; give at least one st.Candidate.")
    for c in candidates:
        if (
            not isinstance(c, Candidate)
            or not isinstance(c.mesh, (AbstractMesh, Mesh))
            or not isinstance(c.batch, int)
            or c.batch < 1
        ):
            raise Mistake(
                TypeError if not isinstance(c, Candidate) else ValueError,
                f"candidates holds {c!r}; expected st.Candidate(mesh, rules, batch) with a "
                "jax.sharding.AbstractMesh (or Mesh) and a batch >= 1.",
            )
        _check_options(c)
    counts: dict[int, list[Candidate]] = {}
    for c in candidates:
        counts.setdefault(math.prod(c.mesh.shape.values()), []).append(c)
    if len(counts) > 1:
        said = ", ".join(
            f"{n} ({len(cs)} candidate{'' if len(cs) == 1 else 's'}, such as {label_of(cs[0])!r})"
            for n, cs in counts.items()
        )
        raise Mistake(
            ValueError,
            f"candidates lay out different device counts: {said}. A ranking compares the "
            "layouts of one job: pass candidates of one device count (st.layouts(n) gives "
            "them), and call advise once per count.",
        )
    return candidates


def _check_options(candidate: Candidate) -> None:
    """A candidate's options: a mapping of names to hashable values, or None."""
    options = candidate.options
    if options is None:
        return
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise Mistake(
            TypeError,
            f"the options of candidate {label_of(candidate._replace(options=None))!r} are "
            f"{options!r}; expected a mapping of names to values ({{'remat': 'full'}}).",
        )
    for name, value in options.items():
        if not _hashable(value):
            raise Mistake(
                TypeError,
                f"option {name!r} of candidate {label_of(candidate._replace(options=None))!r} "
                f"is {value!r}, which is not hashable; give a value that is (a string, a "
                "number, a tuple).",
            )


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


@public
def candidates(
    meshes: Sequence[AnyMesh],
    rules: Rules | None,
    batches: int | Sequence[int],
    *,
    length: int | None = None,
    **options: Sequence[Hashable],
) -> list[Candidate]:
    """Every combination of `meshes`, `batches` and each option's values, as
    `Candidate`s, in a fixed order (meshes, then batches, then the options in the
    order given; new in 0.6).

    Args:
        meshes: the layouts (`layouts` gives them).
        rules: the rules for every candidate.
        batches: a global batch, or several.
        length: the sequence length (for tokens per second).
        **options: each option's values, e.g. ``remat=("full", "minimal"),
            microbatches=(1, 4)``; ``make_step(candidate)`` reads
            ``candidate.options``.

    Returns:
        The candidates, ``len(meshes) x len(batches) x`` each option's count.

    Raises:
        TypeError: for an option given one value rather than a sequence of them.

    Example:
        >>> import spmdtree as st
        >>> found = st.candidates(st.layouts(8, ("data", "fsdp"))[:2], None, 64, remat=("full", "none"))
        >>> [(dict(c.mesh.shape)["data"], c.batch, c.options) for c in found]
        [(1, 64, {'remat': 'full'}), (1, 64, {'remat': 'none'}), (2, 64, {'remat': 'full'}), (2, 64, {'remat': 'none'})]
    """
    for name, values in options.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise Mistake(
                TypeError if not isinstance(values, Sequence) or values else ValueError,
                f"option {name} is {values!r}; expected a sequence of one or more of its "
                f"values, e.g. {name}=({values!r},)."
                if values
                else f"option {name} has no values; give one or more, or leave it out.",
            )
    sizes = (
        (int(batches),)
        if isinstance(batches, numbers.Integral)
        else tuple(cast(Sequence[int], batches))
    )
    names = tuple(options)
    return [
        Candidate(mesh, rules, batch, length, options=dict(zip(names, chosen, strict=True)) or None)
        for mesh in meshes
        for batch in sizes
        for chosen in itertools.product(*options.values())
    ]


def _budget(budget_bytes: object, hardware: Hardware) -> int:
    """The budget per device: `budget_bytes` checked, or the hardware's whole memory."""
    if budget_bytes is None:
        return hardware.memory_bytes
    if not isinstance(budget_bytes, (int, np.integer)) or isinstance(budget_bytes, bool):
        fix = (
            f" Pass int({budget_bytes!r})."
            if isinstance(budget_bytes, float) and budget_bytes.is_integer()
            else ""
        )
        raise Mistake(
            TypeError,
            f"budget_bytes is {budget_bytes!r} (a {type(budget_bytes).__name__}); expected an "
            f"int of bytes per device, or None for the hardware's memory.{fix}",
        )
    if budget_bytes <= 0:
        raise Mistake(
            ValueError, f"budget_bytes is {budget_bytes}; expected bytes per device, > 0."
        )
    return int(budget_bytes)
