"""Judging and ranking (0.7: cut from advise.py): a candidate rejected before it
compiles, a compiled one's verdict against the budget, the rows ranked by one key,
and a layout whose devices repeat each other's work.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping

import numpy as np

from spmdtree._src.errors import Mistake
from spmdtree._src.plan import Plan
from spmdtree._src.step.advise.records import (
    HOPEFUL,
    TIGHT_MARGIN,
    AdviceRow,
    Candidate,
    label_of,
)
from spmdtree._src.step.compile import (
    TargetChild,
)
from spmdtree._src.step.hw import Hardware
from spmdtree._src.step.kinds import Verdict
from spmdtree._src.step.preflight import (
    StepPlan,
    repeated,
    split_work,
)
from spmdtree._src.step.time import ranked_seconds
from spmdtree._src.text import (
    LeftUnsharded,
    Located,
    argument_path,
    entries_text,
    size_text,
)

#: How many times the CPU estimate's peak was measured above the accelerator's
#: on models that unroll their layers (0.4, flax's lm1b and an equinox GPT):
#: why its "over budget" is never final where the target can be asked.
CPU_OVER = "1.5-4.5x"


def batch_first(candidate: Candidate, flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags with the batch's own (a dimension of the batch's size left
    unsharded) first: the one that makes a layout no layout."""

    def is_batch(flag: str) -> bool:
        return _batch_flag(candidate, flag.flag if isinstance(flag, Located) else flag)

    return tuple(sorted(flags, key=lambda flag: not is_batch(flag)))


def _batch_flag(candidate: Candidate, flag: str) -> bool:
    """Whether a plan flag is the batch's own: a dimension of the candidate's batch
    size left unsharded."""
    return isinstance(flag, LeftUnsharded) and flag.size == candidate.batch


def ruled_out(candidate: Candidate, planned: Plan, budget: int) -> tuple[Verdict, str] | None:
    """The verdict and reason of a candidate its plan rules out, or None."""
    unsharded = _unsharded_batch(candidate, planned) or _unsharded_microbatch(candidate, planned)
    if unsharded is not None:
        return Verdict.BATCH_UNSHARDED, f"{unsharded}; not compiled"
    if planned.device_bytes > budget:
        arrays, said = size_text(planned.device_bytes), size_text(budget)
        return Verdict.OVER_BUDGET, f"arrays alone {arrays} > {said}, not compiled"
    return None


def verdict_of(step: StepPlan, budget: int, asks: TargetChild | None) -> tuple[Verdict, str]:
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


def rows_split(rows: Iterable[AdviceRow]) -> dict[Hashable, int]:
    """Per work (`_work`), the fewest FLOPs per device of the compiled rows
    (`split_work`)."""
    return split_work([(_work(r.candidate), r.step.flops) for r in rows if r.step is not None])


def row_repeated(row: AdviceRow, split: Mapping[Hashable, int]) -> str | None:
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
    repeats = int(row_repeated(row, split or {}) is not None)
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


def _unsharded_microbatch(candidate: Candidate, planned: Plan) -> str | None:
    """Why the candidate's microbatches are no layout (new in 0.8): a microbatch (the
    batch over the option ``microbatches``, a pipeline's or an accumulation's, which
    split the leading dimension) that the batch's mesh axes do not divide, read from
    the arguments whose leading dimension is of the batch's size; None where none is."""
    count = (candidate.options or {}).get("microbatches")
    if not isinstance(count, int) or count <= 1 or candidate.batch % count:
        return None
    rows = candidate.batch // count
    for row in planned.rows:
        if not row.shape or row.shape[0] != candidate.batch:
            continue
        shards = candidate.batch // row.shard_shape[0]  # the devices its batch is split over
        if rows % shards:
            return (
                f"a microbatch of {rows} ({candidate.batch} over {count} microbatches) is not "
                f"divided by its batch axes {entries_text((row.spec[0],), 1)} ({shards}): "
                f"their devices would compute it whole (the array at "
                f"{argument_path(row.path)}, dimension 0)"
            )
    return None


def budget_per_device(budget_bytes: object, hardware: Hardware) -> int:
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
