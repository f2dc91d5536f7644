"""`describe`: the sharding plan of a tree as a table, checked before allocating."""

from __future__ import annotations

import dataclasses
import io
import math
import textwrap
from typing import Any

import jax
import numpy as np
from jax import tree_util

from spmdtree._src.boxes import dtype_of, shape_of, short_dtype
from spmdtree._src.errors import public
from spmdtree._src.rules import (
    AMBIGUOUS,
    FEWER_DIMENSIONS,
    UNCONSTRAINED,
    AnyMesh,
    Names,
    Resolution,
    RulesLike,
    axes_of,
)
from spmdtree._src.specs import resolve_tree


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of the tree and how it resolved (its path comes later)."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    resolution: Resolution
    mesh: AnyMesh | None


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table."""

    path: str
    leaf: Leaf

    @property
    def global_bytes(self) -> int:
        return math.prod(self.leaf.shape) * self.leaf.itemsize

    @property
    def per_device(self) -> tuple[int, ...] | None:
        mesh = self.leaf.mesh
        if mesh is None:
            return None
        sizes = dict(mesh.shape)
        spec = tuple(self.leaf.resolution.spec) + (None,) * len(self.leaf.shape)
        return tuple(
            dim // math.prod(sizes[a] for a in axes_of(entry))
            for dim, entry in zip(self.leaf.shape, spec, strict=False)
        )

    @property
    def device_bytes(self) -> int | None:
        shape = self.per_device
        return None if shape is None else math.prod(shape) * self.leaf.itemsize

    @property
    def replicated(self) -> bool:
        return self.leaf.mesh is not None and self.per_device == self.leaf.shape


def _rows(tree: Any, mesh: AnyMesh | None, rules: RulesLike | None, params: Any) -> list[Row]:
    walk = resolve_tree(tree, rules, mesh=mesh, params=params, lenient=True)

    def finish(value: Any, res: Resolution) -> Leaf:
        dtype = dtype_of(value)
        itemsize = np.dtype(dtype).itemsize
        return Leaf(
            shape_of(value) or (), short_dtype(dtype), itemsize, res, walk.mesh if mesh else None
        )

    planned = walk.map(finish, keep_boxes=False)
    found = tree_util.tree_flatten_with_path(planned, is_leaf=lambda x: isinstance(x, Leaf))[0]
    return [
        Row(tree_util.keystr(path, simple=True, separator="/") or "(root)", leaf)
        for path, leaf in found
        if isinstance(leaf, Leaf)
    ]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _entries(entries: Any, count: int) -> str:
    def one(entry: Any) -> str:
        if entry is None:
            return "-"
        if entry is UNCONSTRAINED:
            return "?"
        return entry if isinstance(entry, str) else "+".join(entry)

    padded = tuple(entries) + (None,) * (count - len(tuple(entries)))
    return ",".join(one(e) for e in padded)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "" if shape is None else "[" + ",".join(map(str, shape)) + "]"


def _notes(row: Row, large: int) -> list[str]:
    res, notes = row.leaf.resolution, []
    names: Names = res.names or ()
    if res.fallback in (FEWER_DIMENSIONS, AMBIGUOUS):
        notes.append(
            f"{row.path}: replicated by a fallback: shape {_shape(row.leaf.shape)} under "
            f"names ({_entries(names, len(names))})"
        )
    for dim in res.indivisible:
        notes.append(
            f"{row.path}: dimension {dim} ({names[dim]}, size {row.leaf.shape[dim]}) left "
            "unsharded: its mesh axes do not divide it"
        )
    if row.replicated and row.global_bytes >= large and math.prod(row.leaf.shape) > 1:
        notes.append(f"{row.path}: {_bytes(row.global_bytes)} replicated on every device")
    return notes


def _array(row: Row) -> str:
    return row.leaf.dtype + _shape(row.leaf.shape)


def _names_line(row: Row) -> str | None:
    """``names -> mesh spec`` for a boxed array, None for an unboxed one."""
    res = row.leaf.resolution
    if res.names is None:
        return None
    count = len(row.leaf.shape)
    return f"{_entries(res.names, len(res.names))} -> {_entries(res.spec, count)}"


def _layout(
    rows: list[Row], mesh: AnyMesh | None, width: int
) -> tuple[list[str], list[int], list[tuple[list[str], str | None]]]:
    """Header, column widths, and per array its cells and names line.

    The path column takes what the other columns leave of `width`; a longer
    path keeps its end (the leaf's own name) behind an ellipsis.
    """
    header = ["path", "array"] + (["shard", "bytes/dev"] if mesh is not None else [])
    cells = [
        [row.path, _array(row)]
        + ([_shape(row.per_device), _bytes(row.device_bytes or 0)] if mesh is not None else [])
        for row in rows
    ]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(header)]
    widths[0] = min(widths[0], max(12, width - sum(widths[1:]) - 2 * (len(widths) - 1)))
    for cell in cells:
        if len(cell[0]) > widths[0]:
            cell[0] = "…" + cell[0][-(widths[0] - 1) :]
    return header, widths, [(c, _names_line(r)) for c, r in zip(cells, rows, strict=True)]


def _plain(rows: list[Row], mesh: AnyMesh | None, width: int) -> list[str]:
    """Per array a line (path, array, shard, bytes), then its names -> mesh spec."""
    header, widths, body = _layout(rows, mesh, width)

    def line(items: list[str]) -> str:
        last = len(widths) - 1
        return "  ".join(
            item.rjust(w) if i == last and i > 1 else item.ljust(w)
            for i, (item, w) in enumerate(zip(items, widths, strict=True))
        ).rstrip()

    lines = [line(header), "  names -> mesh spec"]
    for cells, names in body:
        lines.append(line(cells))
        if names is not None:
            lines += textwrap.wrap(names, width, initial_indent="  ", subsequent_indent="    ")
    return lines


def _rich(rows: list[Row], mesh: AnyMesh | None, width: int) -> list[str]:
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
    devices = getattr(mesh, "devices", None)
    if jax.process_count() == 1 or not isinstance(devices, np.ndarray):
        return None
    return sum(device.process_index == jax.process_index() for device in devices.flat)


@public
def describe(
    tree: Any,
    mesh: AnyMesh | None = None,
    rules: RulesLike | None = None,
    *,
    params: Any = None,
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
    rows = _rows(tree, mesh, rules, params)
    lines = (_rich if rich else _plain)(rows, mesh, width)
    total = sum(r.global_bytes for r in rows)
    noun = "array" if len(rows) == 1 else "arrays"
    lines.append(f"total       {_bytes(total)} in {len(rows)} {noun}")
    if mesh is not None:
        # Every device of a mesh holds an equal part of a NamedSharding, so the
        # most loaded device holds the sum of the per-device parts.
        per_device = sum(r.device_bytes or 0 for r in rows)
        share = f" ({100 * per_device / total:.1f}% of the total)" if total else ""
        replicated = sum(r.global_bytes for r in rows if r.replicated)
        lines.append(f"per device  {_bytes(per_device)} on the most loaded device{share}")
        lines.append(f"replicated  {_bytes(replicated)} on every device")
        local = _local_devices(mesh)
        if local is not None:
            lines.append(
                f"process {jax.process_index()}   holds {_bytes(per_device * local)} on its "
                f"{local} of the mesh's {mesh.devices.size} devices "
                f"({jax.process_count()} processes)"
            )
    for note in (note for row in rows for note in _notes(row, large)):
        lines += textwrap.wrap(note, width, initial_indent="! ", subsequent_indent="  ")
    if any(row.leaf.resolution.fallback == FEWER_DIMENSIONS for row in rows):
        lines.append("  (reduced optimizer states: pass params= to keep them sharded)")
    return "\n".join(lines)
