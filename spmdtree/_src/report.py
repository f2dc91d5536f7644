"""Rendering plans: `describe`, and the tables of `str(plan)` and `str(diff)`.

Nothing here resolves or computes a figure: `plan` does, and this prints it.
"""

from __future__ import annotations

import io
import textwrap
from typing import Any

import jax
from jax.sharding import Mesh

from spmdtree._src.boxes import short_dtype
from spmdtree._src.errors import Mistake, public
from spmdtree._src.plan import (
    FALLBACK,
    UNMENTIONED,
    Plan,
    PlanDiff,
    PlanRow,
    entries_text,
    make_plan,
    shape_text,
    size_text,
)
from spmdtree._src.rules import AnyMesh, RulesLike


def _names_line(row: PlanRow) -> str | None:
    """``names -> mesh spec`` for a boxed array, None for an unboxed one."""
    if row.names is None:
        return None
    return f"{entries_text(row.names, len(row.names))} -> {entries_text(row.spec, len(row.shape))}"


def _layout(
    rows: tuple[PlanRow, ...], mesh: AnyMesh | None, width: int
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


def _plain(rows: tuple[PlanRow, ...], mesh: AnyMesh | None, width: int) -> list[str]:
    """Per array a line (path, array, shard, bytes), then its names -> mesh spec."""
    header, widths, body = _layout(rows, mesh, width)
    lines = [_line(header, widths), "  names -> mesh spec"]
    for cells, names in body:
        lines.append(_line(cells, widths))
        if names is not None:
            lines += textwrap.wrap(names, width, initial_indent="  ", subsequent_indent="    ")
    return lines


def _rich(rows: tuple[PlanRow, ...], mesh: AnyMesh | None, width: int) -> list[str]:
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


def _local_devices(mesh: AnyMesh) -> int | None:
    """How many of the mesh's devices this process holds, when several share it."""
    if jax.process_count() == 1 or not isinstance(mesh, Mesh):
        return None
    return sum(device.process_index == jax.process_index() for device in mesh.devices.flat)


def plan_table(
    planned: Plan, *, width: int = 80, rich: bool = False, budget: int | None = None
) -> str:
    """The `describe` table of a plan."""
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
    if any(flag.startswith(FALLBACK) for row in rows for flag in row.flags):
        lines.append("  (reduced optimizer states: pass params= to keep them sharded)")
    unmentioned = sorted(
        {flag.split("'")[1] for row in rows for flag in row.flags if flag.startswith(UNMENTIONED)}
    )
    if unmentioned:
        note = (
            f"! names no rule mentions, left unsharded: {', '.join(map(repr, unmentioned))}. "
            "Add (name, None) to the rules to say it is replicated, or a rule that shards it."
        )
        lines += textwrap.wrap(note, width, subsequent_indent="  ")
    return "\n".join(lines)


def diff_table(diff: PlanDiff, *, width: int = 80) -> str:
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


@public
def describe(
    tree: Any,
    mesh: AnyMesh | None = None,
    rules: RulesLike | None = None,
    *,
    params: Any = None,
    budget: int | None = None,
    large: int = 1 << 20,
    width: int = 80,
    rich: bool = False,
) -> str:
    """The sharding plan of a tree, as a table: one row per array leaf, then totals.

    Each array gets a row: its key path (``/``-joined, as `match` sees it),
    dtype and shape and, with a mesh, the shape and bytes of the shard each
    device holds; beneath it, for a boxed array, its names (logical or mesh
    axes) and the mesh spec they resolve to. The totals give the global
    bytes, the bytes held by the most loaded device and the bytes replicated
    on every device (and, on a mesh that spans processes, what this process
    holds). Notes flag leaves replicated by a fallback (fewer
    dimensions than names), dimensions left unsharded (their mesh axes do not
    divide them) and large fully replicated arrays. Works on abstract trees
    (from `jax.eval_shape`), so a plan is checked before anything is
    allocated, and on optimizer states.

    Args:
        tree: a tree with boxes, of arrays or `jax.ShapeDtypeStruct`s.
        mesh: the mesh; without one only names and specs are shown.
        rules: rules for logical boxes without their own.
        params: the boxed params `tree` was derived from, for reduced states
            (as for `to_spec`).
        budget: bytes per device; adds a line saying whether the arrays fit,
            and by how much. It counts the arrays of `tree` only, not a
            step's activations and temporaries: `preflight` compiles the step
            and counts those.
        large: the size in bytes from which a replicated array is flagged.
        width: the width to fit, in characters (long paths are shortened
            from the front).
        rich: render with `rich` (installed separately); the plain text by
            default, the same whatever else is installed.

    Returns:
        The table, as a string to print.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.LogicallyPartitioned(jnp.zeros((6, 8)), ("embed", "mlp"))}
        >>> print(st.describe(params, mesh, [("embed", "data"), ("mlp", "model")], rich=False))
        path  array     shard  bytes/dev
          names -> mesh spec
        w     f32[6,8]  [3,2]       24 B
          embed,mlp -> data,model
        total       192 B in 1 array
        per device  24 B on the most loaded device (12.5% of the total)
        replicated  0 B on every device
    """
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise Mistake(TypeError, f"budget is {budget!r}; expected an int of bytes per device.")
    planned = make_plan(tree, mesh, rules, params=params, large=large)
    return plan_table(planned, width=width, rich=rich, budget=budget)
