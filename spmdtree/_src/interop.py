"""flax interop: `from_flax` converts flax.linen's boxes and flax.nnx Variables.

spmdtree never reads another library's boxes as plain containers (every
function refuses them: see `boxes.refuse_foreign`); `from_flax` converts them,
reading their names as flax itself reads them.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from spmdtree._src.boxes import (
    FLAX_LINEN,
    LogicallyPartitioned,
    Partitioned,
    checked_names,
    foreign_kind,
    leaf_test,
    shape_of,
)
from spmdtree._src.errors import Mistake, public
from spmdtree._src.resolve import (
    flax_rules,
)
from spmdtree._src.rules import (
    NameTuple,
    PyTree,
    normalize_names,
)
from spmdtree._src.trees import KeyPath, each_leaf


def _convert(x: Any, path: KeyPath, padded: list[str]) -> object:
    kind = foreign_kind(x)
    if kind is None:
        return x
    if kind == FLAX_LINEN:
        classes = {c.__name__ for c in type(x).__mro__ if c.__module__.startswith("flax.")}
        value = _from_flax(x.value, padded) if hasattr(x, "value") else None
        if "LogicallyPartitioned" in classes:
            names = _flax_names(value, x.names, path, padded)
            return LogicallyPartitioned(value, names, mesh=x.mesh, rules=x.rules)
        if "Partitioned" in classes:
            return Partitioned(value, _flax_names(value, x.names, path, padded), mesh=x.mesh)
        raise Mistake(
            TypeError,
            f"is a flax box of type {type(x).__name__}, which carries no sharding names "
            "(only flax's Partitioned and LogicallyPartitioned do). Unbox it with flax's "
            "nn.meta.unbox first.",
        )
    value = x.get_value() if hasattr(x, "get_value") else x.value
    meta = x.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
        return _from_flax(value, padded)  # a Variable with no sharding: just its value
    names = _flax_names(value, names, path, padded)
    rules = meta.get("sharding_rules") or None
    if rules is not None or flax_rules():  # read as flax reads them: logical
        return LogicallyPartitioned(value, names, mesh=meta.get("mesh"), rules=rules)
    return Partitioned(value, names, mesh=meta.get("mesh"))


def _flax_names(value: object, names: object, path: KeyPath, padded: list[str]) -> NameTuple:
    """A flax box's names as flax reads them: missing trailing names are None.

    flax.linen's DenseGeneral (and the attention layers built on it) initialise
    a kernel on a flattened shape and keep its names, so a 3-D kernel can carry
    two; flax, and JAX, read the rest as unsharded. Such a box's key path is
    added to `padded`.

    Raises:
        Mistake: for names of the wrong kind, or more names than dimensions.
    """
    names = normalize_names(tuple(names) if isinstance(names, list) else names)
    shape = shape_of(value)
    if shape is not None and len(shape) > len(names):
        padded.append(jax.tree_util.keystr(tuple(path)))
        names += (None,) * (len(shape) - len(names))
    return checked_names(value, names)


def _from_flax(tree: PyTree, padded: list[str]) -> PyTree:
    found, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf_test())
    converted = each_leaf(
        lambda path, leaf: _convert(leaf, path, padded),
        tree,
        [path for path, _ in found],
        [leaf for _, leaf in found],
    )
    return jax.tree.unflatten(treedef, converted)


@public
def from_flax(tree: PyTree) -> PyTree:
    """The same tree with every flax box replaced by spmdtree's box of the same kind.

    flax.linen's `Partitioned` becomes `Partitioned` and its
    `LogicallyPartitioned` becomes `LogicallyPartitioned`, names, mesh and
    rules kept, nested boxes too. flax.nnx state converts too: a Variable with
    sharding names (``out_sharding`` metadata, as `nnx.with_partitioning`
    sets) becomes a box of its value, read as flax itself reads them — logical
    names (`LogicallyPartitioned`, with the Variable's ``sharding_rules`` as
    its own rules) if the Variable has rules or flax's logical-axis-rules
    context is set, mesh axis names (`Partitioned`) otherwise; a Variable
    without names becomes its value. Other leaves are untouched, and flax is
    never imported here: a tree holding flax objects means flax is loaded.

    Args:
        tree: a pytree holding flax boxes (``model.init`` output) or flax.nnx
            state (``nnx.state(model)``).

    Returns:
        The tree with spmdtree boxes; ``model.apply(st.unbox(converted), x)``
        works as with flax's own, and ``nnx.update(model, st.unbox(converted))``
        puts nnx values back.

    Raises:
        TypeError: for a flax box that carries no sharding names.
        ValueError: for names that do not fit their value.

    Example:
        >>> import jax, flax.linen as nn, spmdtree as st
        >>> init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
        >>> variables = {"params": {"w": init(jax.random.key(0), (4, 8))}}
        >>> st.from_flax(variables)
        {'params': {'w': LogicallyPartitioned(f32[4,8], names=('embed', 'mlp'))}}
    """
    padded: list[str] = []
    converted = _from_flax(tree, padded)
    if padded:
        first = ", ".join(padded[:3]) + (f" and {len(padded) - 3} more" if len(padded) > 3 else "")
        warnings.warn(
            f"from_flax: {len(padded)} flax box{'es' if len(padded) > 1 else ''} had fewer "
            "names than dimensions (flax.linen's DenseGeneral and attention layers name "
            "the flattened kernel) and got trailing None names, as flax reads them, so "
            "the shardings equal flax's; a name may sit on another dimension than its "
            f"author meant. First: {first}.",
            UserWarning,
            stacklevel=3,
        )
    return converted
