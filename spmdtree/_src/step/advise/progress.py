"""What advise says while it searches (0.7: cut from advise.py): the line it starts
with, one line per row as it is judged, and a failure's message.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from spmdtree._src.step.advise.records import (
    AdviceRow,
    Candidate,
    label_of,
)
from spmdtree._src.step.compile import (
    TargetChild,
)
from spmdtree._src.step.time import ranked_seconds
from spmdtree._src.text import (
    seconds_text,
)


def printer(total: int) -> Callable[[AdviceRow, int, bool], None]:
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


def start_line(
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
