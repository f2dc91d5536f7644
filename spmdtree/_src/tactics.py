"""Names functions for `box`: how to name the arrays of a tree nobody annotated.

`match` names them by key-path patterns; `fsdp` by the tactic big_vision and
PyTorch's FSDP use. Both return a ``(path, leaf) -> names | None`` function,
and ``match(..., default=fsdp(mesh))`` chains them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from jax import tree_util

from spmdtree._src.boxes import shape_of
from spmdtree._src.errors import Mistake, fmt, public
from spmdtree._src.resolve import check_mesh
from spmdtree._src.rules import AnyMesh, Names, normalize_kept
from spmdtree._src.trees import KeyPath, NamesFn


@public
def match(
    patterns: Sequence[tuple[str, Names | None]],
    *,
    strict: bool = False,
    default: NamesFn | None = None,
) -> NamesFn:
    """A names function for `box` from ``[(regex, names), ...]`` over key paths.

    Each leaf's key path is joined with ``/`` (``params/dense/kernel``) and
    matched with `re.search` against the patterns in order; the first match
    gives the names (None: leave the leaf unboxed). A leaf no pattern matches
    gets ``default(path, leaf)`` — a tactic such as `fsdp` — else stays
    unboxed (``strict=True``: an error). For params that come from elsewhere:
    a checkpoint, another library, a model nobody annotated.

    Args:
        patterns: ``(regex, names)`` pairs, tried in order.
        strict: raise for a leaf that no pattern matches (and no `default`
            names), instead of leaving it unboxed.
        default: a names function for the leaves no pattern matches.

    Returns:
        A function ``(key_path, leaf) -> names | None`` to pass to `box`.

    Raises:
        ValueError: at once if a regex is invalid; from `box`, with
            ``strict=True``, listing the paths no pattern matches.
        TypeError: at once if names are of the wrong kind.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> params = {"dense": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)}}
        >>> rule = st.match([(r"kernel$", ("embed", "mlp")), (r"bias$", ("mlp",))])
        >>> st.box(params, rule, logical=True)["dense"]["kernel"]
        LogicallyPartitioned(f32[4,8], names=('embed', 'mlp'))
        >>> rule = st.match([(r"bias$", None)], default=lambda path, leaf: ("embed", None))
        >>> st.box(params, rule, logical=True)["dense"]["kernel"].names
        ('embed', None)
    """
    if default is not None and not callable(default):
        raise Mistake(
            TypeError,
            f"default is {fmt(default)}; expected a names function (path, leaf) -> names, "
            "e.g. st.fsdp(mesh).",
        )
    compiled = []
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, (tuple, list)) or len(pattern) != 2:
            raise Mistake(
                TypeError,
                f"pattern {i} is {fmt(pattern)}; each pattern is a pair (regex, names), "
                "e.g. (r'kernel$', ('embed', 'mlp')).",
            )
        regex, names = pattern
        try:
            compiled.append((re.compile(regex), None if names is None else normalize_kept(names)))
        except re.error as e:
            raise Mistake(
                ValueError,
                f"pattern {i}, {regex!r}, is not a valid regular expression: {e}. Escape "
                "special characters with re.escape if you meant them literally.",
            ) from None
        except Mistake as mistake:
            raise Mistake(mistake.kind, f"pattern {i} ({regex!r}) {mistake.message}") from None
    shown = [regex.pattern for regex, _ in compiled]

    def names_for(path: KeyPath, leaf: Any) -> Names | None:
        text = tree_util.keystr(tuple(path), simple=True, separator="/")
        for regex, names in compiled:
            if regex.search(text):
                return names
        if default is not None:
            return default(path, leaf)
        if strict:
            raise Mistake(
                ValueError,
                f"(path {text!r}) matches none of the patterns {shown}. Add a "
                f"pattern for it, e.g. ({re.escape(text) + '$'!r}, None) to leave "
                "it unboxed, or pass strict=False.",
            )
        return None

    return names_for


@public
def fsdp(mesh: AnyMesh, axis: str = "fsdp", *, min_size: int = 2**14) -> NamesFn:
    """A names function for `box`: FSDP, the tactic of big_vision and PyTorch's FSDP.

    An array with at least `min_size` elements gets `axis` on its largest
    dimension that the axis's size divides; among equally large ones, the
    first (outermost), as PyTorch's FSDP shards dimension 0. Smaller arrays,
    and arrays no dimension of which the axis divides, stay unboxed, so
    replicated. The chosen dimension is named by the mesh-axis tuple
    ``(axis,)``, which both box kinds take as written: `fsdp` also serves as
    the ``default`` of `match` patterns that give logical names.

    Args:
        mesh: the mesh (or abstract mesh) whose `axis` shards the arrays.
        axis: the mesh axis to shard over.
        min_size: the fewest elements an array needs to be sharded.

    Returns:
        A function ``(key_path, leaf) -> names | None`` for `box`.

    Raises:
        ValueError: at once, if `axis` is not an axis of `mesh`.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
        >>> tree = {"w": jax.ShapeDtypeStruct((768, 3072), "float32"),
        ...         "b": jax.ShapeDtypeStruct((3072,), "float32")}
        >>> boxed = st.box(tree, st.fsdp(mesh))
        >>> boxed["w"].names, st.is_boxed(boxed["b"])  # b is too small to shard
        ((None, ('fsdp',)), False)
    """
    check_mesh(mesh)
    if axis not in mesh.axis_names:
        raise Mistake(
            ValueError,
            f"axis {axis!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}. Pass one of them as axis=.",
        )
    size = dict(mesh.shape)[axis]

    def names_for(path: KeyPath, leaf: Any) -> Names | None:
        shape = shape_of(leaf) or ()
        if math.prod(shape) < min_size:
            return None
        fits = [d for d in range(len(shape)) if shape[d] % size == 0]
        if not fits:
            return None
        chosen = max(fits, key=lambda d: (shape[d], -d))  # the largest; the first of ties
        return tuple((axis,) if d == chosen else None for d in range(len(shape)))

    return names_for
