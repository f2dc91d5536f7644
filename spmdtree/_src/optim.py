"""Shardings for an optimizer's state, better than replicating reduced states.

`to_sharding(jax.eval_shape(tx.init, params), mesh)` already works for every
optax optimizer: state leaves shaped like their param get its sharding, and a
reduced leaf (adafactor's factored moments, SM3's per-dimension accumulators),
whose box has more names than its value has dimensions, is replicated.
`optimizer_sharding` keeps more: it looks up the param each reduced leaf came
from and gives the leaf the names of the dimensions it kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
from jax import tree_util
from jax.sharding import Mesh

from spmdtree._src.boxes import IS_BOX, Partitioned, is_array, shape_of
from spmdtree._src.errors import Mistake, public
from spmdtree._src.registry import rebuild
from spmdtree._src.rules import Names, RulesLike, check_mesh
from spmdtree._src.specs import resolve_tree, shardings
from spmdtree._src.trees import is_boxed


def kept_dimensions(
    shape: Sequence[int], param_shape: Sequence[int], position: int | None = None
) -> tuple[int, ...] | None:
    """Which dimensions of a param of `param_shape` a reduced state of `shape` kept.

    The rule: if the state is the `position`-th of a sequence holding one 1-D
    array per dimension of the param (SM3's accumulators) and its size is that
    dimension's, it kept that dimension. Otherwise it kept the dimensions, in
    order, whose sizes are its sizes — if exactly one choice of dimensions
    fits. With no fit or several (a square matrix's row and column
    statistics), the answer is None: the state is replicated.

    Args:
        shape: the reduced state's shape.
        param_shape: its param's shape.
        position: its index in a per-dimension sequence, if it is in one.

    Returns:
        The kept dimensions of the param, or None if they are ambiguous.

    Example:
        >>> import spmdtree as st
        >>> st.kept_dimensions((8,), (8, 16))  # adafactor's row statistics
        (0,)
        >>> st.kept_dimensions((16,), (16, 16)) is None  # row or column?
        True
        >>> st.kept_dimensions((16,), (16, 16), position=1)  # SM3's second vector
        (1,)
    """
    shape, param_shape = tuple(shape), tuple(param_shape)
    if (
        position is not None
        and len(shape) == 1
        and position < len(param_shape)
        and param_shape[position] == shape[0]
    ):
        return (position,)
    fits = [
        dims
        for dims in itertools.combinations(range(len(param_shape)), len(shape))
        if all(param_shape[d] == size for d, size in zip(dims, shape, strict=True))
    ]
    return fits[0] if len(fits) == 1 else None


def _suffix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


_AMBIGUOUS: Any = object()


def _param_for(path: Sequence[Any], params: list[tuple[Any, Partitioned]]) -> Any:
    """The param box whose key path shares the longest suffix with `path`: None if
    there is none, `_AMBIGUOUS` if several of different names or shapes tie."""
    best, candidates = 0, []
    for param_path, box in params:
        n = _suffix_length(path, param_path)
        if n > best:
            best, candidates = n, [box]
        elif n == best and n > 0:
            candidates.append(box)
    if not candidates:
        return None
    first = candidates[0]
    same = all(
        b.names == first.names and shape_of(b.value) == shape_of(first.value) for b in candidates
    )
    return first if same else _AMBIGUOUS


def _named_as_kept(box: Partitioned, param: Partitioned) -> Partitioned:
    """`box` with each reduced array named by the param dimensions it kept."""
    param_shape = shape_of(param.value)
    names = box.names
    if param_shape is None or len(param_shape) != len(names):
        return box

    def kept_names(shape: tuple[int, ...], position: int | None) -> Names:
        dims = kept_dimensions(shape, param_shape, position)
        # Ambiguous (a square matrix's row or column?): replicated.
        return (None,) * len(shape) if dims is None else tuple(names[d] for d in dims)

    value = box.value
    if is_array(value):
        shape = shape_of(value)
        if shape == param_shape:
            return box
        if kept_dimensions(shape, param_shape) is None:  # type: ignore[arg-type]
            return _replicated(box)
        return box.with_names(kept_names(shape, None))  # type: ignore[arg-type]
    per_dimension = (
        isinstance(value, (list, tuple))
        and len(value) == len(names)
        and all(is_array(v) and len(shape_of(v)) == 1 for v in value)  # type: ignore[arg-type]
    )

    def inner(path: Any, leaf: Any) -> Any:
        if not is_array(leaf) or is_boxed(leaf):
            return leaf
        position = path[0].idx if per_dimension else None
        kept = kept_names(shape_of(leaf), position)  # type: ignore[arg-type]
        return rebuild(type(box), leaf, box._tree[1]._replace(names=kept))

    return box.replace_boxed(tree_util.tree_map_with_path(inner, value, is_leaf=IS_BOX))


def _replicated(box: Partitioned) -> Any:
    """`box` resolved as replicated: unboxed if it holds an array, else each
    reduced array inside named None per dimension (the box stays: it is structure)."""
    if is_array(box.value):
        return box.value

    def inner(leaf: Any) -> Any:
        if not is_array(leaf) or is_boxed(leaf):
            return leaf
        names = (None,) * len(shape_of(leaf))  # type: ignore[arg-type]
        return rebuild(type(box), leaf, box._tree[1]._replace(names=names))

    return box.replace_boxed(jax.tree.map(inner, box.value, is_leaf=IS_BOX))


@public
def optimizer_sharding(tx: Any, params: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """Shardings for the state of optimizer `tx` on `params`, reduced states included.

    Like ``to_sharding(jax.eval_shape(tx.init, params), mesh, rules)``, except
    that a reduced state leaf — one with fewer dimensions than its box has
    names, such as adafactor's row and column statistics or SM3's
    per-dimension accumulators — keeps the sharding of the param dimensions it
    kept (see `kept_dimensions` for the rule), instead of being replicated.
    Each state leaf is matched to its param by the longest common suffix of
    their key paths. Nothing is allocated.

    Args:
        tx: an optax ``GradientTransformation`` (anything with ``init``).
        params: the boxed params (arrays or `jax.ShapeDtypeStruct`s).
        mesh: the device mesh.
        rules: rules for logical boxes without their own.

    Returns:
        A tree of `NamedSharding`s for ``tx.init(params)``: valid
        ``out_shardings`` for ``jax.jit(tx.init)`` and for a train step.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, jax.numpy as jnp, optax, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))}
        >>> tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
        >>> state = st.optimizer_sharding(tx, params, mesh)
        >>> state[0].v_row["w"].spec, state[0].v_col["w"].spec
        (P('data',), P('model',))
    """
    check_mesh(mesh)
    boxes = [
        (path, leaf)
        for path, leaf in tree_util.tree_flatten_with_path(params, is_leaf=IS_BOX)[0]
        if isinstance(leaf, Partitioned)
    ]
    if not boxes:
        raise Mistake(
            ValueError,
            "params hold no boxes, so every state leaf would be replicated. Pass the "
            "boxed params (as built, before st.unbox), or box them with st.box.",
        )
    state = jax.eval_shape(tx.init, params)

    def rename(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, Partitioned):
            return leaf
        param = _param_for(path, boxes)
        if param is _AMBIGUOUS:
            return _replicated(leaf)
        return leaf if param is None else _named_as_kept(leaf, param)

    renamed = tree_util.tree_map_with_path(rename, state, is_leaf=IS_BOX)
    return shardings(resolve_tree(renamed, rules, mesh=mesh), mesh)
