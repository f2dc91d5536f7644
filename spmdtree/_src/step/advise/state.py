"""The search's state (0.7: cut from advise.py): what each candidate has come to, as
immutable records (`Rejected`, `Screened`, `Confirmed`, `Unconfirmed`) in an
immutable `State`, the row each record makes, and what the state as a whole says.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, cast

from spmdtree._src.errors import Mistake
from spmdtree._src.pipeline import STAGE
from spmdtree._src.plan import Plan
from spmdtree._src.step.advise.judging import (
    batch_first,
    rank,
    row_repeated,
    rows_split,
    ruled_out,
    verdict_of,
)
from spmdtree._src.step.advise.records import (
    HOPEFUL,
    AdviceRow,
    Candidate,
    label_of,
)
from spmdtree._src.step.compile import (
    Analysis,
    Arguments,
    CpuChild,
    TargetChild,
    Traced,
)
from spmdtree._src.step.hw import Hardware
from spmdtree._src.step.kinds import Verdict
from spmdtree._src.step.preflight import (
    Closest,
    Keywords,
    StepPlan,
    nothing_fits,
)
from spmdtree._src.step.time import StepTime, ranked_seconds
from spmdtree._src.text import (
    Located,
    argument_path,
    seconds_text,
)

#: A compile subprocess's analysis, to come.
ChildCompile = concurrent.futures.Future[Analysis]


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """A candidate's step, planned: what tracing it (again, for a target) takes."""

    fn: Callable[..., Any]
    planned: Arguments
    keywords: Keywords


@dataclasses.dataclass(frozen=True)
class Search:
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


@dataclasses.dataclass(frozen=True)
class Pending:
    """A candidate traced and exported, waiting for its compile subprocess
    (`confirming`: again, for the target, after a screened compile)."""

    index: int
    traced: Traced
    compiler: CpuChild | TargetChild
    step: PlannedStep
    confirming: bool = False


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A candidate decided without figures: its plan rules it out, or its
    make_step, trace or compile failed (or the target's compiler found it too
    big for a chip); `arrays_bytes`, where its arrays alone were over the budget,
    their bytes per device."""

    row: AdviceRow
    arrays_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Screened:
    """A candidate compiled where it was screened, judged on those figures; its
    `step`, to trace it again for the target."""

    row: AdviceRow
    step: PlannedStep


@dataclasses.dataclass(frozen=True)
class Confirmed:
    """A screened candidate compiled again for the target, judged on its figures."""

    row: AdviceRow


@dataclasses.dataclass(frozen=True)
class Unconfirmed:
    """A screened candidate whose trace or compile for the target failed: its
    screened row kept, flagged with why."""

    row: AdviceRow
    step: PlannedStep


Record = Rejected | Screened | Confirmed | Unconfirmed


@dataclasses.dataclass(frozen=True)
class State:
    """The search so far: each decided candidate's record by its index, and the
    compiles run. Never changed: each step of the search returns a new one."""

    records: Mapping[int, Record] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    compiles: int = 0

    def add(self, index: int, record: Record, compiles: int = 0) -> State:
        """This state with `index` decided as `record`, and `compiles` more run."""
        records = types.MappingProxyType({**self.records, index: record})
        return State(records, self.compiles + compiles)

    def counted(self, compiles: int) -> State:
        """This state with `compiles` more run."""
        return State(self.records, self.compiles + compiles)

    @property
    def rows(self) -> dict[int, AdviceRow]:
        return {i: record.row for i, record in self.records.items()}

    def order(self) -> list[int]:
        """The candidates' indices, best row first (`rank`), a layout whose devices
        repeat each other's work after those that split it (`split_work`)."""
        split = rows_split(self.rows.values())
        return sorted(self.records, key=lambda i: rank(self.records[i].row, i, split))

    def ranked(self) -> tuple[AdviceRow, ...]:
        return tuple(self.records[i].row for i in self.order())

    def screened(self, index: int) -> bool:
        """Whether a row's figures are the CPU estimate's."""
        step = self.records[index].row.step
        return step is not None and step.backend.estimates


def recorded(search: Search, state: State, index: int, record: Record, compiles: int = 0) -> State:
    """`state` with `record`; a decided row (not a flag added to one) reported."""
    after = state.add(index, record, compiles)
    if search.report is not None and not isinstance(record, Unconfirmed):
        search.report(record.row, len(after.records), index in state.records)
    return after


def make_row(
    search: Search,
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
    flags = batch_first(candidate, flags)
    return AdviceRow(candidate, verdict, reason, step, timed, tokens, flags)


def flagged(row: AdviceRow, flag: str) -> AdviceRow:
    """A row as it stands, with one flag more."""
    return row._replace(flags=(*row.flags, flag))


def rejection(search: Search, index: int, planned: Plan) -> Rejected | None:
    """A candidate its plan rules out before any compile: its batch axes do not
    divide its batch, or its arrays alone exceed the budget; else None."""
    rejected = ruled_out(search.candidates[index], planned, search.budget)
    if rejected is None:
        return None
    flags = tuple(
        Located(argument_path(row.path), flag) for row in planned.rows for flag in row.flags
    )
    over = planned.device_bytes if rejected[0] == Verdict.OVER_BUDGET else None
    return Rejected(make_row(search, index, *rejected, flags=flags), over)


def judged(search: Search, index: int, step: StepPlan) -> AdviceRow:
    """The row of a compiled step: its verdict from its peak against the budget; its
    flags, and the collectives its layout does not explain where they are far
    above it."""
    traffic = step.unexplained_traffic
    flags = step.flags if traffic is None else (*step.flags, traffic.sentence)
    return make_row(search, index, *verdict_of(step, search.budget, search.asks), step, flags)


def failed(search: Search, index: int, reason: str) -> Rejected:
    return Rejected(make_row(search, index, Verdict.DOES_NOT_COMPILE, reason))


def said_repeats(state: State) -> State:
    """Each compiled row whose devices repeat each other's work, flagged so (the
    axis named), its traffic flag, where it has one, saying that is its cause."""
    split = rows_split(state.rows.values())
    records = dict(state.records)
    for index, record in state.records.items():
        row = record.row
        said = row_repeated(row, split)
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
    return State(types.MappingProxyType(records), state.compiles)


def said_stages(state: State) -> State:
    """Each pipelined row that fits or may (new in 0.8) flagged with what its bubble
    costs, its stage traffic, and whether the stages pay: against the best row
    without stages, by the predicted time per sequence, or, where no such row fits,
    the memory the stages save."""
    rows = state.rows
    hopeful = [i for i in state.order() if _hopeful(rows[i])]
    plain = [i for i in hopeful if _without_stages(rows[i])]
    unpiped = any(_without_stages(row) for row in rows.values())
    records = dict(state.records)
    for index in hopeful:
        row = rows[index]
        if not _without_stages(row):
            said = _stages_said(row, rows[plain[0]] if plain else None, unpiped)
            records[index] = dataclasses.replace(records[index], row=flagged(row, said))
    return State(types.MappingProxyType(records), state.compiles)


def _hopeful(row: AdviceRow) -> bool:
    """Whether a row fits or may, with a prediction."""
    return (
        row.verdict in HOPEFUL and row.time is not None and row.time.predicted_seconds is not None
    )


def _without_stages(row: AdviceRow) -> bool:
    """Whether a row is a layout without stages: compiled, no pipeline in its
    schedule; not compiled, no stage axis of more than one device."""
    if row.step is None:
        return dict(row.candidate.mesh.shape).get(STAGE, 1) == 1
    return not (row.step.schedule is not None and row.step.schedule.pipelines())


def _stages_said(row: AdviceRow, plain: AdviceRow | None, unpiped: bool) -> str:
    """What a pipelined row's bubble costs, against `plain`, the best row without
    one (None where none fits or may; `unpiped`, whether any was tried)."""
    timed = cast(StepTime, row.time)
    axes = row.step.schedule.stage_axes() if row.step and row.step.schedule else ()
    traffic = sum(timed.comm_by_axes.get((axis,), 0.0) for axis in axes)
    said = (
        f"stages: its bubble takes {seconds_text(timed.bubble_seconds)} "
        f"({timed.bubble_share:.0%} of the predicted step), its stage traffic "
        f"{seconds_text(traffic)} over {'+'.join(axes) or 'no axis'}"
    )
    if plain is None:
        return said + (
            "; no layout without stages fits: the bubble is what the memory they save costs"
            if unpiped
            else ""
        )
    other = cast(StepTime, plain.time)
    mine, theirs = (
        ranked_seconds(t) / r.candidate.batch for t, r in ((timed, row), (other, plain))
    )
    waits = (
        f"(collectives exposed {seconds_text(timed.exposed_comm_seconds)} here, "
        f"{seconds_text(other.exposed_comm_seconds)} there)"
    )
    if mine > theirs:
        return (
            f"{said}; the bubble costs more than the stages save: {label_of(plain.candidate)}, "
            f"without stages, takes {seconds_text(theirs)} a sequence against "
            f"{seconds_text(mine)} here {waits}"
        )
    return (
        f"{said}; the stages save more than their bubble costs: {seconds_text(mine)} a "
        f"sequence against {seconds_text(theirs)} for {label_of(plain.candidate)}, the best "
        f"layout without them {waits}"
    )


def rules_said(state: State) -> str:
    """The rules' problems (as `validate_rules` says them) that every compiled step
    has, each once (new in 0.8: 0.7 said any step's, so that a rule the pipelined
    steps use and the others do not was said to be never used; a step's own stay in
    its `StepPlan.rule_problems`)."""
    steps = [row.step for row in state.rows.values() if row.step is not None]
    each = [dict.fromkeys(problem.sentence for problem in step.rule_problems) for step in steps]
    return " ".join(p for p in each[0] if all(p in other for other in each[1:])) if each else ""


def nothing_fits_said(state: State, budget: int) -> str:
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
            if isinstance(r, Rejected) and r.arrays_bytes is not None
        ]
    return nothing_fits(closest, budget, searched=True) if closest else ""


def _bound_by(timed: StepTime) -> str:
    """``bound by compute`` or ``bound by collectives, most over fsdp``."""
    if timed.compute_seconds >= timed.comm_seconds:
        return "bound by compute"
    axes = max(timed.comm_by_axes, key=lambda a: timed.comm_by_axes[a])
    return f"bound by collectives, most over {'+'.join(axes) or 'no axis'}"


def error_text(error: BaseException) -> str:
    """What a row says of an error: spmdtree's message as preflight would raise it,
    else the error's own."""
    if isinstance(error, Mistake):
        return str(error.error("preflight"))
    if isinstance(error, (ValueError, TypeError)):
        return str(error)
    return f"{type(error).__name__}: {error}"
