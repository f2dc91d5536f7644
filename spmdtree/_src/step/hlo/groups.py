"""Replica groups: the device groups a collective runs over, and the mesh axes they span.

A compiled module prints a collective's groups in one of four forms (listed
``{{0,1},{2,3}}``, an iota tile assignment ``[2,4]<=[8]T(1,0)``, a mesh
``mesh['a'=2,'b'=4] {'b'}``, with its device ids or not) and a
collective-permute's ``source_target_pairs``; jaxlib's instruction has no
accessor for either, so `parse_groups` and `parse_pairs` read the printed
value, without regular expressions. The partition ids in them are positions
in the mesh's row-major device order, which is how `group_axes` and
`permute_axes` name the axes they vary along.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: A collective's device groups (partition ids); ``()`` is one group of all devices.
Groups = tuple[tuple[int, ...], ...]


def _ints(text: str) -> list[int]:
    """The integers of a printed list ``1,2, 3`` (its other characters ignored)."""
    return [int(part) for part in text.split(",") if part.strip().isdigit()]


def _bracketed(text: str, start: int, opening: str, closing: str) -> tuple[str, int]:
    """The text between the bracket at `start` and the one closing it, and where that
    closing bracket ends."""
    depth = 0
    for i in range(start, len(text)):
        depth += {opening: 1, closing: -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    return text[start + 1 :], len(text)


def iota(text: str) -> np.ndarray:
    """An iota tile assignment ``[4,2]<=[2,2,2]T(0,2,1)`` as its ids, laid out as its
    first dimensions (``<=[...]``, the ids' reshape, and ``T(...)``, its transpose,
    optional).

    Example:
        >>> iota("[2,4]<=[4,2]T(1,0)").tolist()
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    dims, end = _bracketed(text, text.index("["), "[", "]")
    shape = _ints(dims)
    rest = text[end:].strip()
    inner = shape
    if rest.startswith("<="):
        reshape, end = _bracketed(rest, rest.index("["), "[", "]")
        inner, rest = _ints(reshape), rest[end:].strip()
    ids = np.arange(math.prod(inner)).reshape(inner)
    if rest.startswith("T("):
        ids = ids.transpose(_ints(_bracketed(rest, 1, "(", ")")[0]))
    return ids.reshape(shape)


def listed(text: str) -> list[list[int]]:
    """The lists of a printed list of lists ``{{0,1},{2,3}}`` (``{}``: none).

    Example:
        >>> listed("{{0,4},{1,5}}")
        [[0, 4], [1, 5]]
    """
    inner = text.strip()
    if not (inner.startswith("{") and inner.endswith("}")):
        return []
    parts = inner[1:-1].replace("{", "").split("}")
    return [_ints(part) for part in parts if part.strip(", ")]


def _quoted(text: str) -> str:
    """An axis name as the mesh form prints it: ``'data'`` -> ``data``."""
    return text.strip().strip("'")


def _mesh_groups(text: str) -> list[list[int]]:
    """The groups of ``mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_1'}``."""
    axes, end = _bracketed(text, text.index("["), "[", "]")
    names = [_quoted(part.partition("=")[0]) for part in axes.split(",")]
    sizes = [int(part.partition("=")[2]) for part in axes.split(",")]
    rest = text[end:]
    flat = np.arange(math.prod(sizes))
    at = rest.find("device_ids=(")
    if at >= 0:
        ids, end = _bracketed(rest, at + len("device_ids="), "(", ")")
        rest = rest[end:]
        if "[" in ids:
            flat = iota(ids).reshape(-1)
        elif ids.strip():
            flat = np.array(_ints(ids))
    refs = rest[rest.index("{") + 1 : rest.rindex("}")] if "{" in rest else ""
    wanted: dict[str, list[tuple[int, int]] | None] = {}
    for ref in (r for r in refs.split(",") if r.strip()):
        name, _, sub = ref.partition(":")
        if sub:  # a sub-axis 'x':(pre)size
            major, _, length = sub.strip().lstrip("(").partition(")")
            wanted.setdefault(_quoted(name), []).append((int(major), int(length)))  # type: ignore[union-attr]
        else:
            wanted[_quoted(name)] = None
    dims: list[int] = []
    grouped: list[int] = []
    for name, size in zip(names, sizes, strict=True):
        if name not in wanted:
            dims.append(size)
            continue
        parts = wanted[name] or [(1, size)]
        prefix = 1
        for pre, part in sorted(parts):  # a sub-axis 'a':(pre)size: pre is the major part
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped.append(len(dims))
            dims.append(part)
            prefix *= part
        if prefix != size:
            dims.append(size // prefix)
    rest_dims = [i for i in range(len(dims)) if i not in grouped]
    size = math.prod(dims[i] for i in grouped)
    return [
        list(map(int, g))
        for g in flat.reshape(dims).transpose(rest_dims + grouped).reshape(-1, size)
    ]


def parse_groups(text: str) -> Groups:
    """A collective's device groups (partition ids) from the value its replica groups
    print, in any of its four forms; ``()`` where it lists none (``{}``): one
    group of all devices.

    Example:
        The same groups (along the first axis of a (2, 4) mesh) in each form:

        >>> parse_groups("{{0,4},{1,5},{2,6},{3,7}}")
        ((0, 4), (1, 5), (2, 6), (3, 7))
        >>> parse_groups("[4,2]<=[2,4]T(1,0)")
        ((0, 4), (1, 5), (2, 6), (3, 7))
        >>> parse_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}")
        ((0, 4), (1, 5), (2, 6), (3, 7))
        >>> parse_groups("mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'a'}")
        ((3, 2), (1, 0))
        >>> parse_groups("mesh['x'=8] {'x':(1)2}")  # a sub-axis
        ((0, 4), (1, 5), (2, 6), (3, 7))
    """
    text = text.strip()
    if text.startswith("mesh["):
        found = _mesh_groups(text)
    elif text.startswith("["):
        found = [list(map(int, g)) for g in iota(text)]
    else:
        found = listed(text)
    return tuple(tuple(g) for g in found)


def parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """A collective-permute's ``source_target_pairs`` value ``{{0,1},{1,0}}``.

    Example:
        >>> parse_pairs("{{0,1},{1,2}}")
        ((0, 1), (1, 2))
    """
    return tuple((pair[0], pair[1]) for pair in listed(text) if len(pair) == 2)


def group_axes(
    groups: Sequence[Sequence[int]], shape: Sequence[tuple[str, int]]
) -> tuple[tuple[str, ...], int, bool]:
    """The mesh axes whose coordinates vary within the groups (in mesh order), the
    group size, and whether each group is made of whole axes."""
    sizes = [size for _, size in shape]
    group = max((len(g) for g in groups), default=1)
    if any(i >= math.prod(sizes) or i < 0 for g in groups for i in g):
        return (), group, False
    varying: set[int] = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=int), sizes)).reshape(len(sizes), -1)
        varying |= {d for d in range(len(sizes)) if len(set(coords[d].tolist())) > 1}
    axes = tuple(shape[d][0] for d in sorted(varying))
    whole = all(len(g) == math.prod(sizes[d] for d in varying) for g in groups)
    return axes, group, whole


def permute_axes(
    pairs: Sequence[tuple[int, int]], shape: Sequence[tuple[str, int]]
) -> tuple[str, ...]:
    """The mesh axes along which a collective-permute's sources and targets differ."""
    sizes = [size for _, size in shape]
    varying: set[int] = set()
    for source, target in pairs:
        if max(source, target) >= math.prod(sizes):
            continue
        a = np.unravel_index(source, sizes)
        b = np.unravel_index(target, sizes)
        varying |= {d for d in range(len(sizes)) if a[d] != b[d]}
    return tuple(shape[d][0] for d in sorted(varying))


def collective_axes(
    kind: str,
    groups: Groups,
    pairs: Sequence[tuple[int, int]],
    shape: Sequence[tuple[str, int]],
) -> tuple[tuple[str, ...], int, bool]:
    """A collective's mesh axes, group size, and whether its groups are whole axes:
    a collective-permute's from its pairs (a group of 2), any other's from its
    groups (none: all the devices)."""
    if kind == "collective-permute":
        return permute_axes(pairs, shape), 2, True
    devices = math.prod(size for _, size in shape) if shape else 1
    found = groups or (tuple(range(devices)),)
    return group_axes(found, shape) if shape else ((), len(found[0]), True)
