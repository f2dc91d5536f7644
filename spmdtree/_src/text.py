"""The one place that formats: sizes, shapes, dtypes, names, and the tables.

Plans are data (computed in `plan`); the tables that `str(plan)`, `str(diff)`
and `describe` print are rendered here, from their fields, so no module that
computes ever imports one that prints. The step's and the advice's tables live
beside their records (0.6: `step.preflight.step_plan`, `step.advise.records`).
"""

from __future__ import annotations

import io
import textwrap
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from spmdtree._src.errors import fmt

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def short_dtype(dtype: object) -> str:
    """jax's short dtype names: ``f32``, ``bf16``, ``i8``, ``u32``, ``c64``, ``bool``."""
    name = getattr(dtype, "name", str(dtype))
    short = name.replace("float", "f").replace("uint", "u").replace("int", "i")
    return short.replace("complex", "c")


def short_value(value: object) -> str:
    """``f32[256,512]`` for an array-like, the repr for anything else."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return fmt(value)
    return f"{short_dtype(dtype)}[{','.join(str(d) for d in shape)}]"


def size_text(n: int) -> str:
    """Bytes as people read them: ``24 B``, ``1.0 KiB``, ``2.5 GiB``."""
    amount = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def entries_text(entries: Any, count: int) -> str:
    """Names or a spec as ``embed,mlp`` (None ``-``, UNCONSTRAINED ``?``), padded to `count`."""

    def one(entry: Any) -> str:
        if entry is None:
            return "-"
        if entry is UNCONSTRAINED:
            return "?"
        return entry if isinstance(entry, str) else "+".join(entry)

    padded = tuple(entries) + (None,) * (count - len(tuple(entries)))
    return ",".join(one(e) for e in padded)


class Flag(str):
    """A plan flag: the sentence a reader sees (it compares as that string), and a
    record of what it says, read by field (`fields`), never parsed back from
    the sentence, so a name holding a quote reads whole."""

    fields: tuple[str, ...] = ()

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.fields)


class Unmentioned(Flag):
    """A logical name that no rule mentions, left unsharded."""

    fields = ("name",)
    name: str

    def __new__(cls, name: str) -> Unmentioned:
        flag = super().__new__(cls, f"no rule mentions {name!r}: left unsharded")
        flag.name = name
        return flag


class LeftUnsharded(Flag):
    """A dimension left unsharded because its mesh axes do not divide it (`axes`:
    those tried, of each candidate)."""

    fields = ("dimension", "name", "size", "axes")
    dimension: int
    name: Any
    size: int | None
    axes: tuple[Any, ...]

    def __new__(
        cls, dimension: int, name: Any, size: int | None, axes: tuple[Any, ...] = ()
    ) -> LeftUnsharded:
        flag = super().__new__(
            cls,
            f"dimension {dimension} ({entries_text((name,), 1)}, size {size}) left unsharded: "
            "its mesh axes do not divide it",
        )
        flag.dimension, flag.name, flag.size, flag.axes = dimension, name, size, axes
        return flag


class Fallback(Flag):
    """A reduced state (fewer dimensions than names) that no param resolved: replicated."""

    fields = ("shape", "names")
    shape: tuple[int, ...]
    names: tuple[Any, ...]

    def __new__(cls, shape: tuple[int, ...], names: tuple[Any, ...]) -> Fallback:
        flag = super().__new__(cls, f"replicated by a fallback: {_written(shape, names)}")
        flag.shape, flag.names = shape, names
        return flag


class Ambiguous(Flag):
    """A reduced state whose kept dimensions are ambiguous: replicated."""

    fields = ("shape", "names")
    shape: tuple[int, ...]
    names: tuple[Any, ...]

    def __new__(cls, shape: tuple[int, ...], names: tuple[Any, ...]) -> Ambiguous:
        flag = super().__new__(
            cls,
            "replicated: which dimensions of its param it kept is ambiguous "
            f"({_written(shape, names)})",
        )
        flag.shape, flag.names = shape, names
        return flag


class LargeReplicated(Flag):
    """A large array that every device holds whole."""

    fields = ("bytes",)
    bytes: int

    def __new__(cls, bytes: int) -> LargeReplicated:
        flag = super().__new__(cls, f"{size_text(bytes)} replicated on every device")
        flag.bytes = bytes
        return flag


class Located(Flag):
    """A plan flag and where it is: the array's path as the caller passed it
    (``args[0]/w``), so a table can count flags by kind and name their arrays
    (new in 0.5)."""

    fields = ("path", "flag")
    path: str
    flag: str

    def __new__(cls, path: str, flag: str) -> Located:
        located = super().__new__(cls, f"{path}: {flag}")
        located.path, located.flag = path, flag
        return located


def argument_path(path: str) -> str:
    """A plan row's path over a step's arguments as the caller wrote them: ``0/w``
    is ``args[0]/w``."""
    first, _, rest = path.partition("/")
    return f"args[{first}]" + (f"/{rest}" if rest else "")


#: How a summary line names a group of plan flags, by their kind.
_GROUPS: tuple[tuple[type[Flag], str, str], ...] = (
    (LeftUnsharded, "dimension", "left unsharded, not divided by their mesh axes"),
    (Unmentioned, "array", "with a name no rule mentions, left unsharded"),
    (LargeReplicated, "array", "replicated on every device"),
    (Fallback, "reduced state", "replicated by a fallback"),
    (Ambiguous, "reduced state", "replicated (which dimensions they kept is ambiguous)"),
)


def flags_summary(flags: tuple[str, ...], most: int = 3) -> list[str]:
    """A few lines for many flags: the located plan flags counted by kind, with
    their bytes where they have them and the first `most` paths; every other
    flag (the compiled step's) as it is, the first `most` of them (new in 0.5).

    Example:
        >>> flags = tuple(Located(f"args[0]/b{i}", LargeReplicated(2**20)) for i in range(5))
        >>> flags_summary(flags + ("a loop of unknown trip count",))
        ['5 arrays replicated on every device, 5.0 MiB: args[0]/b0, args[0]/b1, args[0]/b2, ...', 'a loop of unknown trip count']
    """
    lines = []
    for kind, noun, said in _GROUPS:
        group = [f for f in flags if isinstance(f, Located) and isinstance(f.flag, kind)]
        if not group:
            continue
        paths = ", ".join(dict.fromkeys(f.path for f in group[:most]))
        more = ", ..." if len(group) > most else ""
        total = sum(f.flag.bytes for f in group if isinstance(f.flag, LargeReplicated))
        amount = f", {size_text(total)}" if total else ""
        plural = "" if len(group) == 1 else "s"
        lines.append(f"{len(group)} {noun}{plural} {said}{amount}: {paths}{more}")
    grouped = tuple(kind for kind, _, _ in _GROUPS)
    rest = [f for f in flags if not (isinstance(f, Located) and isinstance(f.flag, grouped))]
    lines += rest[:most]
    if len(rest) > most:
        lines.append(f"... and {len(rest) - most} more (AdviceRow.flags holds them all)")
    return lines


def _written(shape: tuple[int, ...], names: tuple[Any, ...]) -> str:
    return f"shape {shape_text(shape)} under names ({entries_text(names, len(names))})"


def _names_line(row: Any) -> str | None:
    """``names -> mesh spec`` for a boxed array, None for an unboxed one."""
    if row.names is None:
        return None
    host = f" in {row.memory_kind}" if row.on_host else ""  # offloaded (new in 0.5)
    return f"{entries_text(row.names, len(row.names))} -> {entries_text(row.spec, len(row.shape))}{host}"


def _layout(
    rows: tuple[Any, ...], mesh: Any, width: int
) -> tuple[list[str], list[int], list[tuple[list[str], str | None]]]:
    """Header, column widths, and per array its cells and names line.

    The path column takes what the other columns leave of `width`; a longer
    path keeps its end (the leaf's own name) behind an ellipsis.
    """
    header = ["path", "array"] + (["shard", "bytes/dev"] if mesh is not None else [])
    cells = [
        [row.path, short_dtype(row.dtype) + shape_text(row.shape)]
        + ([shape_text(row.shard_shape), size_text(row.device_bytes)] if mesh is not None else [])
        for row in rows
    ]
    widths = _fit(header, cells, width)
    return header, widths, [(c, _names_line(r)) for c, r in zip(cells, rows, strict=True)]


def _fit(header: list[str], cells: list[list[str]], width: int) -> list[int]:
    """Column widths for `cells` within `width`: the first column (a path) takes
    what the others leave, and a longer path keeps its end (the leaf's own
    name) behind an ellipsis."""
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(header)]
    widths[0] = min(widths[0], max(12, width - sum(widths[1:]) - 2 * (len(widths) - 1)))
    for cell in cells:
        if len(cell[0]) > widths[0]:
            cell[0] = "…" + cell[0][-(widths[0] - 1) :]
    return widths


def _line(items: list[str], widths: list[int]) -> str:
    """One line of a table; the last of three or more columns (bytes) right-aligned."""
    last = len(widths) - 1
    return "  ".join(
        item.rjust(w) if i == last and i > 1 else item.ljust(w)
        for i, (item, w) in enumerate(zip(items, widths, strict=True))
    ).rstrip()


def _plain(rows: tuple[Any, ...], mesh: Any, width: int) -> list[str]:
    """Per array a line (path, array, shard, bytes), then its names -> mesh spec."""
    header, widths, body = _layout(rows, mesh, width)
    lines = [_line(header, widths), "  names -> mesh spec"]
    for cells, names in body:
        lines.append(_line(cells, widths))
        if names is not None:
            lines += textwrap.wrap(names, width, initial_indent="  ", subsequent_indent="    ")
    return lines


def _rich(rows: tuple[Any, ...], mesh: Any, width: int) -> list[str]:
    """The table drawn by rich: one row per array, long cells folded (no colour codes)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    header, _, body = _layout(rows, mesh, min(width, 56))  # paths shortened to leave room
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column(header[0], no_wrap=True)
    table.add_column(header[1], no_wrap=True)
    table.add_column("names -> mesh spec", overflow="fold")
    for name in header[2:]:
        table.add_column(name, no_wrap=True, justify="right" if name == "bytes/dev" else "left")
    for cells, names in body:
        table.add_row(cells[0], cells[1], names or "", *cells[2:])
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, highlight=False).print(table)
    return [line.rstrip() for line in out.getvalue().rstrip("\n").split("\n")]


def _local_devices(mesh: Any) -> int | None:
    """How many of the mesh's devices this process holds, when several share it."""
    if jax.process_count() == 1 or not isinstance(mesh, Mesh):
        return None
    return sum(device.process_index == jax.process_index() for device in mesh.devices.flat)


def plan_table(
    planned: Any, *, width: int = 80, rich: bool = False, budget: int | None = None
) -> str:
    """The `describe` table of a `Plan`."""
    rows, mesh = planned.rows, planned.mesh
    lines = (_rich if rich else _plain)(rows, mesh, width)
    total = planned.total_bytes
    noun = "array" if len(rows) == 1 else "arrays"
    lines.append(f"total       {size_text(total)} in {len(rows)} {noun}")
    if mesh is not None:
        per_device = planned.device_bytes
        share = f" ({100 * per_device / total:.1f}% of the total)" if total else ""
        lines.append(f"per device  {size_text(per_device)} on the most loaded device{share}")
        lines.append(f"replicated  {size_text(planned.replicated_bytes)} on every device")
        if planned.host_bytes:
            lines.append(
                f"host        {size_text(planned.host_bytes)} per device offloaded to host "
                "memory, not in the device's"
            )
        local = _local_devices(mesh)
        if local is not None:
            lines.append(
                f"process {jax.process_index()}   holds {size_text(per_device * local)} on "
                f"its {local} of the mesh's {mesh.devices.size} devices "
                f"({jax.process_count()} processes)"
            )
    if budget is not None:
        spare = budget - planned.device_bytes
        verdict = (
            f"fits, {size_text(spare)} to spare"
            if spare >= 0
            else f"does not fit: {size_text(-spare)} over"
        )
        lines.append(f"budget      {size_text(budget)} per device: {verdict}")
        lines.append("  (params + state only; see st.preflight for the step)")
    for row in rows:
        for flag in row.flags:
            note = f"{row.path}: {flag}"
            lines += textwrap.wrap(note, width, initial_indent="! ", subsequent_indent="  ")
    if any(isinstance(flag, Fallback) for row in rows for flag in row.flags):
        lines.append("  (reduced optimizer states: pass params= to keep them sharded)")
    unmentioned = sorted(
        {flag.name for row in rows for flag in row.flags if isinstance(flag, Unmentioned)}
    )
    if unmentioned:
        note = (
            f"! names no rule mentions, left unsharded: {', '.join(map(repr, unmentioned))}. "
            "Add (name, None) to the rules to say it is replicated, or a rule that shards it."
        )
        lines += textwrap.wrap(note, width, subsequent_indent="  ")
    return "\n".join(lines)


def diff_table(diff: Any, *, width: int = 80) -> str:
    """The table of a plan diff: each changed array, then the totals."""
    header = ["path", "spec before -> after", "bytes/dev before -> after", "received"]
    cells = [
        [
            row.path,
            f"{_spec_text(row.spec_before)} -> {_spec_text(row.spec_after)}",
            f"{size_text(row.device_bytes_before)} -> {size_text(row.device_bytes_after)}",
            size_text(row.received_bytes),
        ]
        for row in diff.rows
    ]
    widths = _fit(header, cells, width)
    lines = [_line(items, widths) for items in [header, *cells]]
    changes = "array changes its" if len(diff.rows) == 1 else "arrays change their"
    lines.append(f"{len(diff.rows)} {changes} layout")
    lines.append(
        f"per device  {size_text(diff.device_bytes_before)} -> "
        f"{size_text(diff.device_bytes_after)} on the most loaded device"
    )
    lines.append(f"received    {size_text(diff.received_bytes)} by the busiest device")
    return "\n".join(lines)


def _spec_text(spec: Any) -> str:
    return "(none)" if spec is None else "(" + entries_text(spec, len(spec)) + ")"


def flops_text(n: int) -> str:
    """Floating-point operations as people read them: ``512 FLOP``, ``33.6 GFLOP``."""
    amount = float(n)
    for unit in ("", "k", "M", "G", "T", "P", "E"):
        if amount < 1000 or unit == "E":
            return f"{n} FLOP" if not unit else f"{amount:.1f} {unit}FLOP"
        amount /= 1000
    raise AssertionError("unreachable")


def axis_types_text(mesh: Any) -> str:
    """``Auto`` where every axis is Auto, else each axis's: ``data Explicit, fsdp Auto``."""
    types = [getattr(t, "name", str(t)) for t in getattr(mesh, "axis_types", ())]
    if len(set(types)) == 1:
        return types[0]
    return ", ".join(f"{name} {kind}" for name, kind in zip(mesh.axis_names, types, strict=True))


#: The version of the JSON that `StepPlan.to_json` and `Advice.to_json` write (its
#: ``"schema"`` field, ``"spmdtree.StepPlan/1"``): raised when a field changes
#: meaning or goes; a new field does not raise it (new in 0.6; docs/api.md, "JSON").
JSON_VERSION = 1


def mesh_json(mesh: Any) -> dict[str, Any]:
    """A mesh's axis sizes and types as JSON values."""
    return {
        "axes": {name: int(size) for name, size in mesh.shape.items()},
        "axis_types": [t.name for t in mesh.axis_types],
    }


def seconds_text(seconds: float | None) -> str:
    """``1.23 s``, ``45.6 ms``, ``789 us``; ``-`` for none."""
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError("unreachable")
