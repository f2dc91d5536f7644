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
from spmdtree._src.text import seconds_text, size_text

#: A colour per kernel class and per verdict (matplotlib's tab10, colour-blind safe).
CLASS_COLOURS = {
    "matmul": "tab:blue",
    "attention": "tab:purple",
    "memory": "tab:green",
    "collectives": "tab:red",
    "launch": "tab:gray",
}
VERDICT_STYLE = {  # colour, marker
    "fits": ("tab:green", "o"),
    "tight": ("tab:olive", "D"),
    "may fit": ("tab:orange", "s"),
    "over budget": ("tab:red", "x"),
}


class Point(NamedTuple):
    """One compiled row of advice: its time per sequence, peak, verdict and label."""

    seconds: float
    peak_bytes: int
    verdict: str
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


def advice_picture(
    points: Sequence[Point], best: Point | None, budget_bytes: int, title: str
) -> Any:
    """Peak per device against the time per sequence, one point per compiled row,
    coloured and shaped by verdict; the budget as a line; the best ringed and
    labelled."""
    fig = figure(8.0, 5.0)
    ax = fig.add_subplot()
    gib = 2**30
    for verdict, (colour, marker) in VERDICT_STYLE.items():
        mine = [p for p in points if p.verdict == verdict]
        if mine:
            ax.scatter(
                [p.seconds * 1e3 for p in mine],
                [p.peak_bytes / gib for p in mine],
                c=colour,
                marker=marker,
                label=f"{verdict} ({len(mine)})",
                alpha=0.8,
            )
    ax.axhline(budget_bytes / gib, color="black", linestyle="--", linewidth=1)
    ax.annotate(
        f"budget {size_text(budget_bytes)}",
        (0, budget_bytes / gib),
        xycoords=("axes fraction", "data"),
        xytext=(4, 4),
        textcoords="offset points",
        fontsize=8,
    )
    if best is not None:
        x, y = best.seconds * 1e3, best.peak_bytes / gib
        ax.scatter([x], [y], s=260, facecolors="none", edgecolors="black", linewidths=1.5)
        ax.annotate(
            f"best: {best.label}\n{seconds_text(best.seconds)} per sequence, {size_text(best.peak_bytes)}",
            (x, y),
            xytext=(12, -24),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "-", "linewidth": 0.8},
        )
    ax.set_xlabel("predicted time per sequence (ms)")
    ax.set_ylabel("peak per device (GiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=8, loc="best")
    return fig


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
    left = 0.0
    for kind, seconds in by_class.items():
        label = "exposed collectives" if kind == "collectives" else kind
        top.barh(
            ["predicted"],
            [seconds * 1e3],
            left=left * 1e3,
            color=CLASS_COLOURS.get(kind),
            label=label,
        )
        left += seconds
    top.barh(
        ["bound"], [bound["compute"] * 1e3], color="tab:blue", alpha=0.4, label="bound: compute"
    )
    top.barh(
        ["bound"],
        [bound["collectives"] * 1e3],
        color="tab:red",
        alpha=0.4,
        label="bound: collectives",
    )
    top.annotate(
        f"{seconds_text(left)}",
        (left * 1e3, 0),
        xytext=(3, 0),
        textcoords="offset points",
        va="center",
        fontsize=8,
    )
    top.set_xlim(0, 1.1 * max(left, bound["compute"], bound["collectives"]) * 1e3)
    top.set_xlabel("time per step (ms)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    names = list(by_axes)
    rows = range(len(names))
    height = 0.4
    sent = [by_axes[n][0] * 1e3 for n in names]
    waited = [by_axes[n][1] * 1e3 for n in names]
    bottom.barh(
        [r - height / 2 for r in rows],
        sent,
        height,
        color="tab:orange",
        label="at the links' bandwidth (bound)",
    )
    bottom.barh(
        [r + height / 2 for r in rows],
        waited,
        height,
        color="tab:red",
        label="the compute waits (predicted, with latencies)",
    )
    bottom.set_yticks(list(rows), names)
    bottom.invert_yaxis()
    bottom.set_xlabel("collectives per step, by mesh axes (ms)")
    bottom.legend(fontsize=7, loc="lower right")
    return fig
