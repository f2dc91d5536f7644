"""Tree combinators: put boxes on a tree, take them off, change their axes.

Every function returns a new tree; nothing mutates its input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeGuard, cast

import jax
from jax import tree_util

from spmdtree._src.boxes import (
    PARTITION_NAME,
    AxisMetadata,
    LogicallyPartitioned,
    Partitioned,
    delete_name,
    foreign_kind,
    insert_name,
    is_array,
    leaf_test,
    make_box,
    partition_name,
    refuse_foreign,
    shape_of,
)
from spmdtree._src.errors import Mistake, at, called, fmt, public, raise_collected
from spmdtree._src.resolve import (
    check_mesh,
)
from spmdtree._src.rules import (
    AnyMesh,
    AxisName,
    Names,
    PyTree,
    Rules,
    normalize_rules,
)

#: A leaf's key path, as `jax.tree_util.tree_flatten_with_path` gives it.
KeyPath: TypeAlias = tuple[Any, ...]


class NamesFn(Protocol):
    """The type of a names function: ``(key_path, leaf) -> names | None``.

    What `box` takes in place of a tree of names, and what `match` and `fsdp`
    return: it chooses the names of each array leaf from its key path (as
    `jax.tree_util.tree_flatten_with_path` gives it) and the leaf, or None to
    leave the leaf unboxed. Any function of two positional arguments is one.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> def by_rank(path: tuple, leaf: jnp.ndarray) -> st.Names | None:
        ...     return ("embed", "mlp") if leaf.ndim == 2 else None
        >>> names_for: st.NamesFn = by_rank
        >>> boxed = st.box({"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}, names_for, logical=True)
        >>> boxed["w"].names, st.is_boxed(boxed["b"])
        (('embed', 'mlp'), False)
    """

    def __call__(self, path: KeyPath, leaf: Any, /) -> Names | None: ...


def is_boxed(x: object) -> TypeGuard[AxisMetadata]:
    """Whether `x` is a metadata box (an `AxisMetadata`).

    Example:
        >>> import spmdtree as st
        >>> st.is_boxed(st.Partitioned(1.0, ())), st.is_boxed(1.0)
        (True, False)
    """
    return isinstance(x, AxisMetadata)


def subject(tree_leaf: object, path: KeyPath, argument: str = "tree") -> str:
    """How a message names a leaf: ``the box at tree['w']``."""
    kind = "box" if is_boxed(tree_leaf) or foreign_kind(tree_leaf) else "leaf"
    return called(kind, at(argument, path))


def each_leaf(
    fn: Callable[..., Any], tree: PyTree, *columns: Sequence[Any], argument: str = "tree"
) -> list[Any]:
    """``[fn(*row) for row in zip(*columns)]``, one row per leaf of `tree` (boxes as leaves).

    Every Mistake `fn` raises is collected with the key path of its leaf in
    `tree` (under the name `argument`) and raised once. Paths are computed
    only when something failed.
    """
    try:
        return [fn(*row) for row in zip(*columns, strict=True)]
    except Mistake:
        pass  # once more, leaf by leaf, to name every wrong one
    failed = []
    for i, row in enumerate(zip(*columns, strict=True)):
        try:
            fn(*row)
        except Mistake as mistake:
            failed.append((i, mistake))
    found = tree_util.tree_flatten_with_path(tree, is_leaf=leaf_test())[0]
    raise_collected([(subject(found[i][1], found[i][0], argument), m) for i, m in failed])
    raise AssertionError("unreachable: a Mistake was raised above")


def map_leaves(
    fn: Callable[[Any], Any], tree: PyTree, *, argument: str = "tree", foreign: bool = False
) -> PyTree:
    """Maps `fn` over the leaves of `tree`, boxes taken as leaves, collecting
    mistakes as `each_leaf` does. Another library's box is refused, unless
    `foreign` (then `fn` gets it)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=leaf_test())
    one = fn if foreign else lambda x: fn(refuse_foreign(x))
    return jax.tree.unflatten(treedef, each_leaf(one, tree, leaves, argument=argument))


@public
def unbox(tree: PyTree) -> PyTree:
    """Strips every box from a tree, nested boxes too.

    Pure: unlike flax.linen's, it never applies a sharding constraint (use
    `constrain` for that).

    Args:
        tree: any pytree, boxes anywhere.

    Returns:
        The same tree with each box replaced by its value.

    Example:
        >>> import spmdtree as st
        >>> st.unbox({"w": st.Partitioned(1.0, ()), "b": 2.0})
        {'b': 2.0, 'w': 1.0}
    """
    return _unboxed(tree)


def _unboxed(tree: PyTree) -> PyTree:
    return map_leaves(lambda x: _unboxed(x.unbox()) if is_boxed(x) else x, tree)


@public
def replace_boxed(tree: PyTree, values: PyTree) -> PyTree:
    """Puts new values into the boxes of a tree.

    ``replace_boxed(tree, unbox(tree)) == tree``; the usual use is to box the
    result of a computation on ``unbox(tree)`` the way `tree` was boxed.

    Args:
        tree: a tree with boxes.
        values: a tree with the structure of ``unbox(tree)``.

    Returns:
        `tree` with each box holding the corresponding part of `values`.

    Raises:
        ValueError: if `values` does not have the structure of ``unbox(tree)``.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> params = {"w": st.Partitioned(jnp.ones(4), ("data",))}
        >>> st.replace_boxed(params, jax.tree.map(lambda x: 2 * x, st.unbox(params)))
        {'w': Partitioned(f32[4], names=('data',))}
    """

    return _replaced(tree, values)


def _replaced(tree: PyTree, values: PyTree) -> PyTree:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=leaf_test())
    try:
        parts = cast(Any, treedef).flatten_up_to(values)
    except (ValueError, TypeError) as e:
        raise Mistake(
            ValueError,
            "`values` must have the structure of st.unbox(tree), but they differ: "
            f"{e}. Build `values` from st.unbox(tree).",
        ) from None

    def put(node: Any, value: Any) -> Any:
        if is_boxed(node):
            return node.replace_boxed(_replaced(node.unbox(), value))
        refuse_foreign(node)
        return value

    return jax.tree.unflatten(treedef, each_leaf(put, tree, leaves, parts))


@public
def map_boxes(fn: Callable[[AxisMetadata], Any], tree: PyTree) -> PyTree:
    """Applies `fn` to every outermost box of a tree, leaving other leaves alone.

    Args:
        fn: a function from a box to anything (usually another box).
        tree: a tree with boxes.

    Returns:
        The tree with each box replaced by ``fn(box)``.

    Example:
        >>> import spmdtree as st
        >>> tree = {"w": st.Partitioned(1.0, ()), "b": 2.0}
        >>> st.map_boxes(lambda b: b.replace_boxed(0.0), tree)
        {'b': 2.0, 'w': Partitioned(0.0, names=())}
    """
    return map_leaves(lambda x: fn(x) if is_boxed(x) else x, tree)


@public
def box(
    tree: PyTree,
    names: PyTree | NamesFn,
    *,
    logical: bool = False,
    mesh: AnyMesh | None = None,
    rules: Rules | None = None,
) -> PyTree:
    """Boxes the array leaves of a tree.

    Args:
        tree: a pytree of arrays (or `jax.ShapeDtypeStruct`s). `tree` sets the
            structure: existing boxes count as leaves.
        names: either a tree with the structure of `tree` holding, at each
            leaf, a names tuple, a `PartitionSpec`, or None (leave the leaf
            unboxed); or a function ``(key_path, leaf) -> names | None`` such as
            `match` builds.
        logical: box in `LogicallyPartitioned` (logical names) instead of
            `Partitioned` (mesh axis names).
        mesh: the mesh to store in each box, if fixed.
        rules: rules to store in each box (only with ``logical=True``).

    Returns:
        The tree with the named array leaves boxed.

    Raises:
        ValueError: if `names` does not follow the structure of `tree`, or
            names do not fit their leaves; TypeError for names of the wrong
            kind or names for a leaf that is not an array. Every wrong leaf is
            listed in one error.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> params = {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}
        >>> st.box(params, {"w": ("embed", "mlp"), "b": None}, logical=True)
        {'b': Array([0., 0., 0., 0., 0., 0., 0., 0.], dtype=float32), 'w': LogicallyPartitioned(f32[4,8], names=('embed', 'mlp'))}
    """
    check_mesh(mesh, optional=True)
    if rules is not None and not logical:
        raise Mistake(
            ValueError,
            "rules= was given with logical=False; rules map logical names to mesh "
            "axes. Pass logical=True, or drop rules=.",
        )
    cls = LogicallyPartitioned if logical else Partitioned
    fields = {"mesh": mesh, "rules": None if rules is None else normalize_rules(rules)}
    paths_leaves, treedef = tree_util.tree_flatten_with_path(tree, is_leaf=leaf_test())
    if callable(names):
        chosen = _names_from_function(names, paths_leaves)
    else:
        chosen = _names_from_tree(treedef, names)
    out, problems = [], []
    for (path, leaf), leaf_names in zip(paths_leaves, chosen, strict=True):
        try:
            refuse_foreign(leaf)
            out.append(leaf if leaf_names is None else _box_one(cls, leaf, leaf_names, fields))
        except Mistake as mistake:
            problems.append((subject(leaf, path), mistake))
    raise_collected(problems)
    return jax.tree.unflatten(treedef, out)


def _box_one(
    cls: type[Partitioned], leaf: object, names: Names, fields: dict[str, Any]
) -> Partitioned:
    if is_boxed(leaf):
        raise Mistake(
            ValueError,
            f"is already boxed as {leaf!r}; give it None in `names`, or "
            "st.unbox the tree first to box it anew.",
        )
    if not is_array(leaf):
        raise Mistake(
            TypeError,
            f"is {fmt(leaf)}, not an array, so it cannot be boxed; give it None in `names`.",
        )
    return make_box(cls, leaf, names, **fields)


def _names_from_function(
    fn: NamesFn, paths_leaves: Sequence[tuple[KeyPath, Any]]
) -> list[Names | None]:
    chosen, problems, asked = [], [], []
    for path, leaf in paths_leaves:
        try:
            refuse_foreign(leaf)
            to_name = is_array(leaf) and not is_boxed(leaf)
            chosen.append(fn(path, leaf) if to_name else None)
            asked += [path] if to_name else []
        except Mistake as mistake:
            problems.append((subject(leaf, path), mistake))
    raise_collected(problems)
    check_tree = getattr(fn, "check_tree", None)  # `match`'s: patterns that named no leaf
    if check_tree is not None:
        check_tree(asked)
    return chosen


def _names_from_tree(treedef: jax.tree_util.PyTreeDef, names: PyTree) -> list[Names | None]:
    try:
        return treedef.flatten_up_to(names)
    except (ValueError, TypeError) as e:
        expected = jax.tree.unflatten(treedef, ["*"] * treedef.num_leaves)
        raise Mistake(
            ValueError,
            "`names` must follow the structure of `tree`, with a names tuple, a "
            "PartitionSpec or None at each of its leaves, but it does not: "
            f"{str(e).rstrip('.')}. `tree` has the structure {fmt(expected)} (* marks a "
            "leaf). Or pass a function (path, leaf) -> names, e.g. st.match([...]).",
        ) from None


@public
def add_axis(tree: PyTree, index: int, name: AxisName | Mapping[str, AxisName]) -> PyTree:
    """Adds an axis to the names of every box, as a vmap or scan does to its values.

    Only the metadata changes; use it when values gained an axis, e.g. after
    stacking layers with a plain `jax.vmap`.

    Args:
        tree: a tree with boxes.
        index: where the new axis is in the result (``-1`` appends).
        name: the new axis's name: a str, None (replicated), or flax's params
            dict ``{PARTITION_NAME: name}``.

    Returns:
        The tree with each box's names gaining `name` at `index`.

    Raises:
        ValueError: if `index` is out of range for a box (flax pads with
            None; spmdtree does not guess).

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> layer = {"w": st.Partitioned(jnp.zeros((4, 8)), (None, "model"))}
        >>> st.add_axis(layer, 0, "layers")["w"].names
        ('layers', None, 'model')
    """
    return change_axes(tree, index, name, add=True)


@public
def remove_axis(tree: PyTree, index: int, name: AxisName | Mapping[str, AxisName]) -> PyTree:
    """Removes a named axis from every box: the exact inverse of `add_axis`.

    Args:
        tree: a tree with boxes.
        index: the axis's position in the input names.
        name: the name that must be at `index`: a str, None, or
            ``{PARTITION_NAME: name}``.

    Returns:
        The tree with `name` removed from each box's names.

    Raises:
        ValueError: if a box has another name at `index`, or `index` is out
            of range, naming the key path and both names.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> tree = {"w": st.Partitioned(jnp.zeros((3, 4)), ("layers", "model"))}
        >>> st.remove_axis(tree, 0, "layers")["w"].names
        ('model',)
    """
    return change_axes(tree, index, name, add=False)


def change_axes(
    tree: PyTree,
    index: int,
    name: AxisName | Mapping[str, AxisName],
    *,
    add: bool,
    argument: str = "tree",
    match_name: bool = True,
    unmapped: bool = False,
) -> PyTree:
    """Adds (or removes) the axis `name` at `index` through every box's own hooks.

    Each box's `add_axis`/`remove_axis` is called, so a subclass that overrides
    them is honoured; the built-in boxes take a fast path with the same result.
    With `match_name` False, removal takes whatever name is at `index`. With
    `unmapped`, the boxes' values are about to be mapped over that axis (by a
    vmap or scan), so each box must have one name per dimension of its value.
    Errors name the key path under `argument`.
    """
    if not isinstance(index, int) or isinstance(index, bool):
        raise Mistake(TypeError, f"index is {fmt(index)}; expected an int.")
    try:
        axis = partition_name(name)
    except Mistake as mistake:
        raise Mistake(mistake.kind, f"the axis name {mistake.message}") from None

    def one(x: Any) -> Any:
        if not is_boxed(x):
            return x
        if not isinstance(x, Partitioned):
            own = x.add_axis if add else x.remove_axis
            return own(index, {PARTITION_NAME: axis})
        shape = shape_of(x.value)
        if unmapped and shape is not None and len(shape) != len(x.names):
            raise Mistake(
                ValueError,
                f"has names {x.names} for a value of shape {shape}, so its names do "
                f"not include the mapped axis (axis {index}). Stack boxes with "
                "st.vmap, or name the axis with st.add_axis, before mapping over them.",
            )
        hook = type(x).add_axis if add else type(x).remove_axis
        if hook is Partitioned.add_axis:
            return x.with_names(insert_name(x.names, index, axis))
        if hook is Partitioned.remove_axis:
            return x.with_names(delete_name(x.names, index, axis, check=match_name))
        if not add and not match_name and -len(x.names) <= index < len(x.names):
            return hook(x, index, {PARTITION_NAME: x.names[index]})  # whatever is there
        return hook(x, index, {PARTITION_NAME: axis})

    return map_leaves(one, tree, argument=argument)
