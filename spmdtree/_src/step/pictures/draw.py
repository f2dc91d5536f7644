"""Draws the pictures of a step and of advice with matplotlib (the optional extra
``plot``; new in 0.6), from plain figures: what text.py is to tables, this is to
plots. matplotlib's object-oriented API only: no pyplot, so no global figure
state and no change to the user's backend."""

from __future__ import annotations

import importlib
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from spmdtree._src.errors import Mistake
from spmdtree._src.step.kinds import KernelClass, Verdict
from spmdtree._src.text import seconds_text, size_text

#: A colour per kernel class and per verdict (matplotlib's tab10, colour-blind safe);
#: keyed by the enums (0.7), which equal their strings.
CLASS_COLOURS = {
    KernelClass.MATMUL: "tab:blue",
    KernelClass.ATTENTION: "tab:purple",
    KernelClass.MEMORY: "tab:green",
    KernelClass.COLLECTIVES: "tab:red",
    KernelClass.LAUNCH: "tab:gray",
}
VERDICT_STYLE = {  # colour, marker: the verdicts a compiled row can have
    Verdict.FITS: ("tab:green", "o"),
    Verdict.TIGHT: ("tab:olive", "D"),
    Verdict.MAY_FIT: ("tab:orange", "s"),
    Verdict.OVER_BUDGET: ("tab:red", "x"),
}


class Point(NamedTuple):
    """One compiled row of advice: its time per sequence, peak, verdict and label."""

    seconds: float
    peak_bytes: int
    verdict: Verdict
    label: str


def figure(width: float, height: float) -> Any:
    """A new `matplotlib.figure.Figure`, or the ImportError that says which extra
    to install."""
    try:
        matplotlib_figure = importlib.import_module("matplotlib.figure")
    except ImportError as e:
        raise Mistake(
            ImportError,
            "plotting needs matplotlib, which spmdtree does not install by default: "
            "pip install 'spmdtree[plot]' (or matplotlib>=3.8).",
        ) from e
    return matplotlib_figure.Figure(figsize=(width, height), layout="constrained")


def saved(fig: Any, path: str | os.PathLike[str] | None) -> Any:
    """`fig`, written to `path` first where one is given (its format by its suffix)."""
    if path is not None:
        fig.savefig(pathlib.Path(path), dpi=150)
    return fig


def unit(largest: float, units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """The largest of `units` (name, scale; smallest first) that `largest` fills at
    least one of, for an axis's labels: ``("MiB", 2**20)`` for 300 MiB."""
    chosen = units[0]
    for name, scale in units:
        if largest >= scale:
            chosen = (name, scale)
    return chosen


SIZES = (("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30))
TIMES = (("us", 1e-6), ("ms", 1e-3), ("s", 1.0))


def advice_picture(
    points: Sequence[Point], best: Point | None, budget_bytes: int, title: str, left_out: int = 0
) -> Any:
    """Peak per device against the time per sequence, one point per compiled row,
    coloured and shaped by verdict; the budget as a line (said in words where it
    lies far above every point); the best ringed and labelled; the rows not drawn
    (not compiled) counted under the axes."""
    fig = figure(8.0, 5.0)
    ax = fig.add_subplot()
    peaks = [p.peak_bytes for p in points]
    near = bool(peaks) and budget_bytes <= 3 * max(peaks)  # else the points would lie flat
    size, size_scale = unit(max([*peaks, budget_bytes if near or not peaks else 0]), SIZES)
    time, time_scale = unit(max([p.seconds for p in points], default=1e-3), TIMES)
    for verdict, (colour, marker) in VERDICT_STYLE.items():
        mine = [p for p in points if p.verdict == verdict]
        if mine:
            ax.scatter(
                [p.seconds / time_scale for p in mine],
                [p.peak_bytes / size_scale for p in mine],
                c=colour,
                marker=marker,
                label=f"{verdict} ({len(mine)})",
                alpha=0.8,
            )
    _budget_drawn(ax, budget_bytes, size_scale, near or not points)
    if best is not None:
        _best_ringed(ax, best, time_scale, size_scale)
    if not points:
        ax.text(
            0.5,
            0.5,
            "no row compiled: nothing to draw (the table says why)",
            transform=ax.transAxes,
            ha="center",
            fontsize=9,
        )
    ax.set_xlabel(f"predicted time per sequence ({time})")
    ax.set_ylabel(f"peak per device ({size})")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if left_out:
        fig.text(
            0.01,
            0.005,
            f"{left_out} row{'' if left_out == 1 else 's'} not drawn: "
            "not compiled (batch unsharded, arrays alone over budget, or does not compile)",
            fontsize=7,
        )
    if points:
        ax.legend(fontsize=8, loc="best")
    return fig


def _budget_drawn(ax: Any, budget_bytes: int, scale: float, near: bool) -> None:
    """The budget: a dashed line where it lies near the points, else said in words."""
    budget = f"budget {size_text(budget_bytes)}"
    if near:
        ax.axhline(budget_bytes / scale, color="black", linestyle="--", linewidth=1)
        ax.annotate(
            budget,
            (0, budget_bytes / scale),
            xycoords=("axes fraction", "data"),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=8,
        )
        return
    ax.annotate(
        f"{budget}: above every point", (0.01, 0.97), xycoords="axes fraction", va="top", fontsize=8
    )


def _best_ringed(ax: Any, best: Point, time_scale: float, size_scale: float) -> None:
    """The best row ringed and labelled with its time and peak."""
    x, y = best.seconds / time_scale, best.peak_bytes / size_scale
    ax.scatter([x], [y], s=260, facecolors="none", edgecolors="black", linewidths=1.5)
    ax.annotate(
        f"best: {best.label}\n{seconds_text(best.seconds)} per sequence, "
        f"{size_text(best.peak_bytes)}",
        (x, y),
        xytext=(12, 12),
        textcoords="offset points",
        fontsize=8,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8},
        arrowprops={"arrowstyle": "-", "linewidth": 0.8},
    )


def time_picture(
    by_class: Mapping[str, float],
    bound: Mapping[str, float],
    by_axes: Mapping[str, tuple[float, float]],
    title: str,
) -> Any:
    """Above, the predicted step as one bar split by class (the compute waiting
    for collectives among them), beside the roofline bound's compute and
    collectives; below, per set of mesh axes, its collectives at the links'
    bandwidth and how long the compute waits for them (`by_axes`: name ->
    (bound seconds, exposed seconds))."""
    fig = figure(8.0, 5.5)
    top, bottom = fig.subplots(2, 1, height_ratios=(1, 1.3))
    step = sum(by_class.values())
    name, scale = unit(max(step, bound["compute"], bound["collectives"]), TIMES)
    left = 0.0
    for kind, seconds in by_class.items():
        if seconds <= 0:
            continue
        label = "exposed collectives" if kind == KernelClass.COLLECTIVES else kind
        top.barh(
            ["predicted"],
            [seconds / scale],
            left=left / scale,
            color=CLASS_COLOURS.get(KernelClass(kind)),
            label=label,
        )
        left += seconds
    for part, colour in (("compute", "tab:blue"), ("collectives", "tab:red")):
        if bound[part] > 0:
            top.barh(
                ["bound"], [bound[part] / scale], color=colour, alpha=0.4, label=f"bound: {part}"
            )
    top.annotate(
        f"{seconds_text(left)}",
        (left / scale, 0),
        xytext=(3, 0),
        textcoords="offset points",
        va="center",
        fontsize=8,
    )
    top.set_xlim(0, 1.12 * max(left, bound["compute"], bound["collectives"]) / scale)
    top.set_xlabel(f"time per step ({name})")
    top.set_title(title, fontsize=10, pad=28)
    top.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    _collectives_by_axes(bottom, by_axes)
    return fig


def _collectives_by_axes(ax: Any, by_axes: Mapping[str, tuple[float, float]]) -> None:
    """Per set of mesh axes, its collectives at the links' bandwidth beside how long
    the compute waits for them."""
    names = list(by_axes)
    rows = range(len(names))
    height = 0.4
    axis_name, axis_scale = unit(max((max(v) for v in by_axes.values()), default=1e-3), TIMES)
    sent = [by_axes[n][0] / axis_scale for n in names]
    waited = [by_axes[n][1] / axis_scale for n in names]
    ax.barh(
        [r - height / 2 for r in rows],
        sent,
        height,
        color="tab:orange",
        label="at the links' bandwidth (bound)",
    )
    ax.barh(
        [r + height / 2 for r in rows],
        waited,
        height,
        color="tab:red",
        label="the compute waits (predicted, with latencies)",
    )
    ax.set_yticks(list(rows), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"collectives per step, by mesh axes ({axis_name})")
    ax.set_xlim(0, 1.35 * max([*sent, *waited, 1e-9]))
    ax.legend(fontsize=7, loc="lower right")
