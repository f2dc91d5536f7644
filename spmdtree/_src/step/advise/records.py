"""Advice's records: `Candidate`, `AdviceRow`, `Advice` (its `Verdict` in kinds.py) and its ranked
table (new in 0.6: beside the records, apart from the search that fills them; 0.5
rendered the table in text.py): the budget and what takes from it, where the rows
were screened, then a row per candidate with its reason and flags."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from spmdtree._src.errors import Mistake, public
from spmdtree._src.rules import AnyMesh, Rules
from spmdtree._src.step.compile import TOOLCHAINS, Toolchain, target_for
from spmdtree._src.step.hw import Hardware
from spmdtree._src.step.kinds import Backend, Verdict
from spmdtree._src.step.pictures import Point, advice_picture, saved
from spmdtree._src.step.preflight import StepPlan
from spmdtree._src.step.time import Measurement, StepTime, ranked_seconds, time_json
from spmdtree._src.text import JSON_VERSION, flags_summary, mesh_json, seconds_text, size_text

#: The verdicts' strings, best first (0.4's name for `Verdict`'s order).
VERDICTS = tuple(v.value for v in Verdict)

#: The verdicts of a row that fits, or may: the ones a confirmation can change.
HOPEFUL = (Verdict.FITS, Verdict.TIGHT, Verdict.MAY_FIT)

#: A step whose peak is within this share of the budget is "tight", not "fits":
#: the budget is a device's whole memory by default, and an allocator loses
#: some to fragmentation (docs/planning.md, "Choosing a layout").
TIGHT_MARGIN = 0.05


class Candidate(NamedTuple):
    """One layout to try: a mesh, its rules, a global batch, and the job's other
    choices.

    Attributes:
        mesh: an `AbstractMesh` (a `Mesh` stands for its ``abstract_mesh``).
        rules: the rules for the step's logical names.
        batch: the global batch (sequences).
        length: the sequence length, where there is one (for tokens per second).
        label: what the table calls it (default: the mesh's axis sizes).
        options: named, hashable choices that ``make_step(candidate)`` reads
            (``{"remat": "full", "microbatches": 4}``); the table shows them
            after the layout, and advise ranks across them by the predicted
            time per sequence (new in 0.6).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "tensor"))
        >>> st.Candidate(mesh, [("batch", "data")], batch=64, length=1024).length
        1024
        >>> st.Candidate(mesh, None, 64, options={"remat": "full"}).options["remat"]
        'full'
    """

    mesh: AnyMesh
    rules: Rules | None
    batch: int
    length: int | None = None
    label: str = ""
    options: Mapping[str, Hashable] | None = None


def label_of(candidate: Candidate) -> str:
    """The candidate's label, or its mesh's axis sizes: ``data 2 x fsdp 4``; then its
    options, ``remat full, microbatches 4``."""
    layout = candidate.label or " x ".join(f"{a} {n}" for a, n in candidate.mesh.shape.items())
    chosen = ", ".join(f"{name} {value}" for name, value in (candidate.options or {}).items())
    return f"{layout}, {chosen}" if chosen else layout


class AdviceRow(NamedTuple):
    """One candidate's outcome in an `Advice`.

    Attributes:
        candidate: the `Candidate`.
        verdict: one of ``"fits"``, ``"tight"`` (fits, but within the margin
            of the budget), ``"may fit"``, ``"over budget"``, ``"batch
            unsharded"`` (its batch axes do not divide its batch, or since 0.8
            its microbatch: not a real layout) or ``"does not compile"``.
        reason: one sentence, never a flag: the peak against the budget and
            what bounds the step, why it was not compiled, or JAX's or
            spmdtree's message.
        step: the `StepPlan`, or None (not compiled).
        time: the `StepTime`, or None.
        tokens_per_second: batch x length / the time the row ranks by (the
            predicted step time, the bound where there is none; 0.5: always
            the bound), where the length is known and the step compiled.
        flags: what needs a look apart from the verdict: the step's flags (an
            array replicated on every device, a dimension left unsharded), or
            the plan's where it was not compiled (new in 0.4).
        measured: the `Measurement` of the step run on its devices, where
            ``advise(..., measure=k)`` ran it (new in 0.7; its tokens per second
            are then at the measured time); else None.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
        >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "does not compile", "a typo", None, None, None)
        >>> row.verdict, row.flags
        ('does not compile', ())
    """

    candidate: Candidate
    verdict: Verdict
    reason: str
    step: StepPlan | None
    time: StepTime | None
    tokens_per_second: float | None
    flags: tuple[str, ...] = ()
    measured: Measurement | None = None

    @public
    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The real mesh of this row's layout, to run the advised step on (new in 0.4).

        Its axis names, sizes and axis types are the candidate's (`layouts`
        gives Auto axes; ``jax.make_mesh(sizes, names)`` alone would give
        Explicit ones on recent jax, on which the advised step may not run).

        Args:
            devices: the devices in mesh order (row-major), at least as many as
                the layout has (the first that many are used); None: the
                process's devices in ``jax.make_mesh``'s order (on GPUs and TPUs,
                by their physical topology), the order `StepPlan.time` assumes.
                A candidate given as a `Mesh` is returned as it is.

        Returns:
            The `jax.sharding.Mesh`.

        Raises:
            ValueError: for fewer devices than the layout has, or a device given
                twice (new in 0.6).

        Example:
            >>> import jax, spmdtree as st
            >>> (mesh,) = st.layouts(1, ("data", "tensor"))  # Auto axes
            >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "fits", "", None, None, None)
            >>> real = row.make_mesh()
            >>> type(real).__name__, real.axis_names, real.axis_sizes, real.axis_types == mesh.axis_types
            ('Mesh', ('data', 'tensor'), (1, 1), True)
        """
        mesh = self.candidate.mesh
        if isinstance(mesh, Mesh) and devices is None:
            return mesh
        sizes, names, types = mesh.axis_sizes, mesh.axis_names, mesh.axis_types
        needed = math.prod(sizes)
        given = list(jax.devices() if devices is None else devices)
        if len(given) < needed:
            where = "this process has" if devices is None else "devices holds"
            raise Mistake(
                ValueError,
                f"the layout {label_of(self.candidate)} needs {needed} devices; {where} "
                f"{len(given)}. Call it where the job runs (jax.devices() sees every host's "
                "devices), or pass as many devices.",
            )
        if devices is None:
            return jax.make_mesh(sizes, names, axis_types=types)
        twice = _device_twice(given[:needed])
        if twice is not None:
            raise Mistake(
                ValueError,
                f"devices holds {twice!r} more than once among the {needed} the layout "
                f"{label_of(self.candidate)} takes; a mesh places each device once. Pass "
                "distinct devices (jax.devices()).",
            )
        return Mesh(
            np.asarray(given[:needed], dtype=object).reshape(sizes), names, axis_types=types
        )


def _device_twice(devices: Sequence[Any]) -> Any:
    """The first device given twice (by its id, jax's own key for a device), or None."""
    seen: set[object] = set()
    for device in devices:
        key = getattr(device, "id", id(device))
        if key in seen:
            return device
        seen.add(key)
    return None


@dataclasses.dataclass(frozen=True)
class Advice:
    """Candidates ranked by verdict (`VERDICTS`' order: fits, tight, may fit,
    over budget (compiled, then not), batch unsharded, does not compile); within
    the first three, a row whose devices repeat each other's work after those
    that split it (new in 0.6), then by the predicted time per sequence of the
    batch (the bound where there is none), equal ones (to 6 significant figures)
    by the smaller peak, then by the serial time (compute + collectives); rows
    over budget by their peak (the least over first; new in 0.6).

    Attributes:
        rows: one `AdviceRow` per candidate, ranked.
        compiles: how many compiles ran (rejected and repeated steps run none).
        hardware: the `Hardware` they were timed on.
        budget_bytes: the memory budget per device.
        margin: a step whose peak is within this share of the budget is
            ``"tight"`` (new in 0.4).
        note: what `confirm` did: which rows the target's compiler confirmed, or
            why none were (its compiler is not installed) (new in 0.4).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
        >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "does not compile", "a typo", None, None, None)
        >>> advice = st.Advice((row,), 0, st.hardware("h100"), 2**30)
        >>> advice.best is None, advice.compiles, advice.margin
        (True, 0, 0.05)
    """

    rows: tuple[AdviceRow, ...]
    compiles: int
    hardware: Hardware
    budget_bytes: int
    margin: float = TIGHT_MARGIN
    note: str = ""

    @property
    def best(self) -> AdviceRow | None:
        """The first row that fits (a tight row is not one), else None."""
        return next((row for row in self.rows if row.verdict == Verdict.FITS), None)

    @property
    def platform(self) -> str:
        """The hardware's platform as `jax.devices()` names it (``"gpu"``,
        ``"tpu"``), or ``""`` for hardware spmdtree knows no compiler of (new in 0.5)."""
        target = target_for(self.hardware)
        return "" if target is None else target.toolchain.backend

    @public
    def to_json(self) -> str:
        """The advice as JSON text: `to_dict`'s values, ``json.dumps``'d (0.7: 0.6's
        ``to_json`` returned the dict, which is `to_dict` now).

        Example:
            >>> import json, jax, spmdtree as st
            >>> row = st.AdviceRow(st.Candidate(jax.sharding.AbstractMesh((1,), ("data",)), None, 8),
            ...                    "does not compile", "a typo", None, None, None)
            >>> json.loads(st.Advice((row,), 0, st.hardware("h100"), 2**30).to_json())["schema"]
            'spmdtree.Advice/1'
        """
        return json.dumps(self.to_dict(), allow_nan=False)

    @public
    def to_dict(self) -> dict[str, Any]:
        """The advice as JSON values (``json.dumps`` takes them), in the versioned
        schema ``"spmdtree.Advice/1"`` (new in 0.6 as ``to_json``; 0.7: named
        ``to_dict``, and `to_json` gives its text; docs/api.md, "JSON", lists
        every field): the hardware, budget and note, ``best`` (the best row's
        index, or None), and one entry per row in rank order: its label, mesh,
        batch, length, options, verdict, reason, flags, tokens per second, its
        time (`StepPlan.to_dict`'s ``time``) and its step (`StepPlan.to_dict`,
        or None where it was not compiled).

        Returns:
            A dict of JSON values.

        Example:
            >>> import jax, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
            >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "does not compile", "a typo", None, None, None)
            >>> data = st.Advice((row,), 0, st.hardware("h100"), 2**30).to_dict()
            >>> data["schema"], data["best"], data["rows"][0]["verdict"], data["rows"][0]["step"]
            ('spmdtree.Advice/1', None, 'does not compile', None)
        """
        best = self.best
        return {
            "schema": f"spmdtree.Advice/{JSON_VERSION}",
            "hardware": self.hardware.name,
            "devices": _devices(self),
            "budget_bytes": self.budget_bytes,
            "margin": self.margin,
            "compiles": self.compiles,
            "note": self.note,
            "best": next((i for i, row in enumerate(self.rows) if row is best), None),
            "rows": [_row_json(row) for row in self.rows],
        }

    @public
    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """A picture of the advice: one point per compiled row, its peak per device
        against its predicted time per sequence (what rows rank by), shaped and
        coloured by verdict; the budget a dashed line; the best ringed and
        labelled (new in 0.6; needs matplotlib: ``pip install 'spmdtree[plot]'``).

        Rows that did not compile, or were rejected by their arrays alone, have
        neither figure and are not drawn (a line under the axes counts them); a
        budget far above every point is said in words, not drawn. Memory and
        time trade off along a front: the points low and to the left.

        Args:
            path: where to save it (its format by its suffix: ``.png``,
                ``.svg``, ``.pdf``); None: not saved.

        Returns:
            The `matplotlib.figure.Figure` (a notebook shows it).

        Raises:
            ImportError: where matplotlib is not installed.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
            >>> step = st.preflight(lambda x: jnp.sum(x.value @ x.value.T), x, mesh=mesh)
            >>> row = st.AdviceRow(st.Candidate(mesh, None, 64), "fits", "fits", step,
            ...                    step.time(st.hardware("h100")), None)
            >>> fig = st.Advice((row,), 1, st.hardware("h100"), 2**30).plot()
            >>> fig.axes[0].get_xlabel()
            'predicted time per sequence (us)'
        """
        points = {
            id(row): _point(row, row.step, row.time)
            for row in self.rows
            if row.step is not None and row.time is not None
        }
        best = self.best
        title = (
            f"{len(self.rows)} candidates on {_devices(self)} x {self.hardware.name}: "
            "peak against predicted time"
        )
        fig = advice_picture(
            list(points.values()),
            None if best is None else points.get(id(best)),
            self.budget_bytes,
            title,
            left_out=len(self.rows) - len(points),
        )
        return saved(fig, path)

    def __str__(self) -> str:
        return _table(self)


def _row_json(row: AdviceRow) -> dict[str, Any]:
    """One row of `Advice.to_dict`."""
    c = row.candidate
    return {
        "label": label_of(c),
        "mesh": mesh_json(c.mesh),
        "batch": c.batch,
        "length": c.length,
        "options": {name: _plain(value) for name, value in (c.options or {}).items()},
        "verdict": str(row.verdict),
        "reason": row.reason,
        "flags": list(row.flags),
        "tokens_per_second": row.tokens_per_second,
        "time": None if row.time is None else time_json(row.time),
        "step": None if row.step is None else row.step.to_dict(),
        "measured": None if row.measured is None else _measured_json(row.measured),
    }


def _measured_json(m: Measurement) -> dict[str, Any]:
    """A measured row's figures (new in 0.7): the step's times beside the prediction."""
    figures = ("seconds", "min_seconds", "predicted_seconds", "ratio", "joined_share")
    return {"times": list(m.times), **{name: getattr(m, name) for name in figures}}


def _plain(value: Hashable) -> Any:
    """An option's value as strict JSON takes it: a numpy scalar as its Python value,
    a JSON scalar as itself (a float that is not finite as its text), else its repr."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _point(row: AdviceRow, step: StepPlan, timed: StepTime) -> Point:
    """A compiled, timed row (its `step` and `timed`) as a point of the advice's picture."""
    seconds = ranked_seconds(timed) / row.candidate.batch
    return Point(seconds, step.peak_bytes, row.verdict, label_of(row.candidate))


def _devices(advice: Advice) -> int:
    rows = advice.rows
    return math.prod(rows[0].candidate.mesh.shape.values()) if rows else 0


def _budget_text(advice: Advice) -> str:
    """What the budget is, and why: the hardware's whole memory, or as given; what
    takes some of it on the platform the rows were compiled for, where known."""
    hardware, budget = advice.hardware, size_text(advice.budget_bytes)
    tight = f'"tight": within {advice.margin:.0%} of it'
    if advice.budget_bytes != hardware.memory_bytes:
        return f"budget {budget} per device, as given (the {hardware.name} has {size_text(hardware.memory_bytes)}); {tight}"
    # what takes some of it: the toolchain's word (JAX's GPU client preallocates, a
    # TPU's runtime keeps some of its HBM), or a general one for hardware it knows not
    taken = TOOLCHAINS[Backend(advice.platform)].taken if advice.platform else Toolchain.taken
    return (
        f"budget {budget} per device: the {hardware.name}'s whole memory ({taken}: pass "
        f"budget_bytes); {tight}"
    )


def _estimates_text(advice: Advice) -> str:
    """What the rows marked ``cpu est.`` are, where there are any."""
    if not any(row.step is not None and row.step.backend.estimates for row in advice.rows):
        return ""
    return (
        "cpu est.: the CPU compiler's estimate of the accelerator's figures (it widens bf16 "
        "to f32, and ran 1.5-4.5x an accelerator's peak on models that unroll their layers); "
        "confirm=k compiles up to k with the accelerator's own compiler"
    )


def _table(advice: Advice, *, width: int = 100) -> str:
    """The ranked table of an `Advice`: what the budget is, then per candidate its
    layout, batch, peak, the roofline's compute, collectives and bound, tokens
    per second, the verdict, the reason under it (whole), and its flags apart
    (``!``), summarised by kind (`flags_summary`; 0.5: a row's many replicated
    arrays are one line)."""
    rows = advice.rows
    devices = _devices(advice)
    measured = any(row.measured is not None for row in rows)
    piped = any(row.time is not None and row.time.bubble_seconds for row in rows)
    header = ["#", "layout", "batch", "peak", "compute", "comm", "bound", "predicted"]
    header += ["bubble"] * piped + ["measured"] * measured + ["tokens/s", "from"]
    header.append("verdict")
    cells = [_cells(rank, row, measured, piped) for rank, row in enumerate(rows, 1)]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    right = set(range(9 + measured + piped)) - {1}

    def line(items: list[str]) -> str:
        return "  ".join(
            item.rjust(w) if i in right else item.ljust(w)
            for i, (item, w) in enumerate(zip(items, widths, strict=True))
        ).rstrip()

    lines = [
        f"{len(rows)} candidates on {devices} x {advice.hardware.name}, "
        f"{advice.compiles} compile{'' if advice.compiles == 1 else 's'}",
        *textwrap.wrap(_budget_text(advice), width, subsequent_indent="  "),
        *textwrap.wrap(advice.note, width, subsequent_indent="  "),
        *textwrap.wrap(_estimates_text(advice), width, subsequent_indent="  "),
        line(header),
    ]
    for items, row in zip(cells, rows, strict=True):
        lines.append(line(items))
        lines += textwrap.wrap(
            row.reason, width, initial_indent="     ", subsequent_indent="       "
        )
        for flag in flags_summary(row.flags):
            lines += textwrap.wrap(
                flag, width, initial_indent="     ! ", subsequent_indent="       "
            )
    estimated = any(row.step is not None and row.step.backend.estimates for row in rows)
    lines.append(_times_text(estimated, measured, piped))
    return "\n".join(lines)


def _cells(rank: int, row: AdviceRow, measured: bool, piped: bool) -> list[str]:
    """One row's cells: its rank, layout, batch, peak, the roofline's parts, the
    predicted time (its bubble's share, and the measured time, where any row has
    them), tokens/s, whose figures, the verdict."""
    c, t, step = row.candidate, row.time, row.step
    share = None if t is None else t.bubble_share
    return [
        str(rank),
        label_of(c),
        str(c.batch),
        "-" if step is None else size_text(step.peak_bytes),
        seconds_text(None if t is None else t.compute_seconds),
        seconds_text(None if t is None else t.comm_seconds),
        seconds_text(None if t is None else t.bound_seconds),
        seconds_text(None if t is None else t.predicted_seconds),
        *["-" if share is None else f"{share:.0%}"] * piped,
        *[seconds_text(row.measured.seconds if row.measured else None)] * measured,
        "-" if row.tokens_per_second is None else f"{row.tokens_per_second:,.0f}",
        "-" if step is None else TOOLCHAINS[step.backend].label,
        row.verdict,
    ]


def _times_text(estimated: bool, measured: bool, piped: bool) -> str:
    """The table's last line: what each time is, and which the rows rank by."""
    return (
        "times: bound, a roofline (peak FLOPs, collectives at full link bandwidth, perfect "
        "overlap); predicted, the compiled schedule walked with each kernel timed by a model"
        + (" (from the CPU program on cpu est. rows)" if estimated else "")
        + ", what rows rank by, per sequence, and tokens/s is at it; a row whose devices "
        "repeat each other's work ranks after those that split it"
        + (
            "; bubble, the share of the predicted time a pipeline's stages run on padding"
            if piped
            else ""
        )
        + (
            "; measured, the step run on its devices (measure=k): those rows rank first, "
            "by it, and their tokens/s is at it"
            if measured
            else ""
        )
    )
