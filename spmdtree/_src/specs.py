"""From boxes to `PartitionSpec`s, `NamedSharding`s and abstract arrays.

`get_partition_spec` reports names as written (flax.linen's semantics). The
other functions resolve them: logical names through rules, and with a mesh,
shape-aware, so that a spec never names a mesh axis that is not there, uses an
axis twice, or shards a dimension the axes do not divide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from spmdtree.boxes import (
    IS_BOX,
    AxisMetadata,
    Partitioned,
    check_same_mesh,
    dtype_of,
    is_array,
    shape_of,
)
from spmdtree.errors import LeafError
from spmdtree.rules import (
    AnyMesh,
    Resolution,
    Rules,
    RulesLike,
    check_mesh,
    mesh_axes_of,
    named_sharding,
    rules_or_context,
)
from spmdtree.trees import is_boxed, map_leaves

__all__ = [
    "get_partition_spec",
    "get_sharding",
    "to_abstract",
    "to_sharding",
    "to_spec",
    "validate_rules",
]

REPLICATED = Resolution(PartitionSpec())

#: ``finish(value, resolution, mesh)``: what one array leaf becomes.
Finish = Callable[[Any, Resolution, Any], Any]


def holds_array(value: Any) -> bool:
    """Whether any leaf of `value` is an array (so it has a sharding)."""
    return any(is_array(leaf) for leaf in jax.tree.leaves(value))


def context_mesh() -> AnyMesh | None:
    """The mesh set with `jax.set_mesh` (abstract inside jit), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


class Call:
    """What one call resolves with: its name, rules, mesh and strictness.

    Mesh precedence: the call's ``mesh=``; else a box's own mesh (all boxes of
    a call must agree); else the mesh set with `jax.set_mesh`.

    A call resolves each distinct (box kind, metadata, shape, mesh) once, and
    with ``shared`` finishes each once: layers repeat, so a tree of thousands
    of leaves costs little more than its flattening (benchmarks/run.py, B2).
    """

    def __init__(
        self,
        function: str,
        rules: RulesLike | None,
        mesh: AnyMesh | None,
        strict: bool = False,
        *,
        lenient: bool = False,
    ) -> None:
        check_mesh(function, mesh, optional=True)
        self.function = function
        self.rules: Rules = rules_or_context(rules, function)
        self.mesh = mesh
        self.strict = strict
        self.lenient = lenient
        self.fallback_mesh = context_mesh() if mesh is None else None
        self._box_mesh: AnyMesh | None = None
        self._boxed_only = False
        self._resolved: dict[Any, Resolution] = {}

    def mesh_for(self, box: Partitioned) -> AnyMesh | None:
        """The mesh `box` resolves on, checking its own mesh against the call's."""
        own = box.mesh
        if self.mesh is not None or own is None:
            check_same_mesh(own, self.mesh)
            return self.mesh if self.mesh is not None else self.fallback_mesh
        if self._box_mesh is None:
            self._box_mesh = own
        check_same_mesh(own, self._box_mesh)
        return own

    def default_mesh(self) -> AnyMesh | None:
        return self.mesh if self.mesh is not None else self.fallback_mesh

    def map(
        self,
        tree: Any,
        finish: Finish,
        *,
        replace_boxes: bool,
        boxed_only: bool = False,
        shared: bool = False,
    ) -> Any:
        """Maps every array leaf of `tree` to ``finish(value, resolution, mesh)``.

        With `replace_boxes` a box holding an array becomes the result (as for
        specs and shardings); otherwise the box is kept around it. A box holding
        a subtree is kept, its arrays resolved with its names; a box holding no
        array comes back unchanged. Leaves that are not arrays become None with
        `replace_boxes`, and are kept otherwise. With `boxed_only`, arrays in no
        box are kept as they are. With `shared` (for a `finish` that ignores the
        value, and `replace_boxes`), boxes of equal metadata and shape share one
        result, computed once.
        """
        self._boxed_only = boxed_only
        if shared and replace_boxes:
            memo: dict[Any, Any] = {}

            def leaf(x: Any) -> Any:
                if isinstance(x, Partitioned):
                    (value,), meta = x._tree
                    key = (type(x), meta, shape_of(value))
                    if key[2] is not None:
                        found = memo.get(key)
                        if found is None:
                            found = memo[key] = self._leaf(x, finish, True, None)
                        return found
                return self._leaf(x, finish, True, None)

            return map_leaves(self.function, leaf, tree)
        return map_leaves(self.function, lambda x: self._leaf(x, finish, replace_boxes, None), tree)

    def _leaf(self, x: Any, finish: Finish, replace: bool, outer: Partitioned | None) -> Any:
        if isinstance(x, AxisMetadata):
            value = x.unbox()
            named: Partitioned | None
            named = x if isinstance(x, Partitioned) else outer
            mesh = self.mesh_for(named) if named is not None else self.default_mesh()
            shape = shape_of(value)
            if shape is not None:
                out = finish(value, self._resolution(named, shape, mesh), mesh)
                return out if replace else x.replace_boxed(out)
            if not holds_array(value):
                return x
            inner = jax.tree.map(
                lambda leaf: self._leaf(leaf, finish, replace, named), value, is_leaf=IS_BOX
            )
            return x.replace_boxed(inner)
        shape = shape_of(x)
        if shape is not None:
            if outer is None and self._boxed_only:
                return x
            mesh = self.mesh_for(outer) if outer is not None else self.default_mesh()
            return finish(x, self._resolution(outer, shape, mesh), mesh)
        return None if replace else x

    def _resolution(
        self, named: Partitioned | None, shape: tuple[int, ...], mesh: Any
    ) -> Resolution:
        if named is None:
            return REPLICATED
        key = (type(named), named._tree[1], shape, id(mesh))
        found = self._resolved.get(key)
        if found is None:
            found = self._resolved[key] = named.resolution(shape, self.rules, mesh, self.strict)
        if found.problem is not None and not self.lenient:
            raise LeafError(ValueError, found.problem)
        return found


def get_partition_spec(tree: Any) -> Any:
    """Returns each box's names as written, as a `PartitionSpec` (flax.linen's semantics).

    Logical names are not resolved (see `to_spec` for that). An unboxed leaf
    with a shape becomes ``PartitionSpec()``; None and optax's placeholders
    (``MaskedNode``, ``EmptyState``) pass through, and a box holding no array
    comes back unchanged, so the result stays a valid prefix of `tree` for
    `jax.jit`.

    Args:
        tree: a tree with boxes.

    Returns:
        A tree of `PartitionSpec`s, a prefix of `tree`.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> params = {"w": st.LogicallyPartitioned(jnp.zeros((4, 8)), ("embed", "mlp")),
        ...           "step": jnp.zeros(())}
        >>> st.get_partition_spec(params)
        {'step': P(), 'w': P('embed', 'mlp')}
    """

    def one(x: Any) -> Any:
        if is_boxed(x):
            value = x.unbox()
            if not holds_array(value):
                return x
            if isinstance(x, Partitioned):
                return x.get_partition_spec()
            return x.replace_boxed(get_partition_spec(value))
        return PartitionSpec() if is_array(x) else None

    return jax.tree.map(one, tree, is_leaf=IS_BOX)


def to_spec(
    tree: Any,
    rules: RulesLike | None = None,
    *,
    mesh: AnyMesh | None = None,
    strict: bool = False,
) -> Any:
    """Returns the mesh `PartitionSpec` each box stands for.

    Logical names resolve through rules: the box's own, else `rules`, else the
    rules context. With a mesh (``mesh=``, else the boxes' own, else the one
    set with `jax.set_mesh`) the result is shape-aware:

    * a mesh axis not in the mesh is a ValueError for a `Partitioned` box; for
      a logical box, that rule is skipped for the next one (``strict=True``:
      an error);
    * a dimension its mesh axes do not divide tries the next rule for its
      logical name, else stays unsharded (``strict=True``: an error);
    * a value with more dimensions than names is an error (use `add_axis` or
      `spmdtree.vmap`); one with fewer (a reduced optimizer state) is
      replicated (``strict=True``: an error).

    ``UNCONSTRAINED`` entries stay in the spec.

    Args:
        tree: a tree with boxes.
        rules: rules for logical boxes without their own.
        mesh: the mesh to resolve on.
        strict: raise where the result would fall back.

    Returns:
        A tree of `PartitionSpec`s, a prefix of `tree`; unboxed arrays get
        ``PartitionSpec()``.

    Raises:
        ValueError: for names that cannot be right for their value, listing
            each key path.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> rules = [("vocab", "model"), ("vocab", "data"), ("embed", "model")]
        >>> params = {"emb": st.LogicallyPartitioned(jnp.zeros((6, 8)), ("vocab", "embed"))}
        >>> st.to_spec(params, rules, mesh=mesh)  # 4 does not divide 6: 'data' it is
        {'emb': P('data', 'model')}
    """
    call = Call("to_spec", rules, mesh, strict)
    return call.map(tree, lambda value, res, mesh: res.spec, replace_boxes=True, shared=True)


def to_sharding(
    tree: Any, mesh: Mesh, rules: RulesLike | None = None, *, strict: bool = False
) -> Any:
    """Returns a `NamedSharding` per array leaf, from the shape-aware `to_spec`.

    The result is a valid ``in_shardings``/``out_shardings`` for `jax.jit` and
    a valid target for `jax.device_put`. ``UNCONSTRAINED`` entries become None
    (a sharding cannot leave a dimension unconstrained); placeholders and None
    pass through.

    Args:
        tree: a tree with boxes, or abstract (from `jax.eval_shape`).
        mesh: the device mesh.
        rules: rules for logical boxes without their own.
        strict: raise where the spec would fall back, as for `to_spec`.

    Returns:
        A tree of `NamedSharding`s, a prefix of `tree`.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.
        TypeError: if `mesh` is not a Mesh.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.Partitioned(jnp.zeros((4, 8)), ("data", "model"))}
        >>> st.to_sharding(params, mesh)["w"].spec
        P('data', 'model')
    """
    return shardings("to_sharding", tree, mesh, rules, strict=strict)


def shardings(
    function: str, tree: Any, mesh: Mesh, rules: RulesLike | None, *, strict: bool = False
) -> Any:
    """`to_sharding` for the public `function` that calls it."""
    check_mesh(function, mesh)
    call = Call(function, rules, mesh, strict)
    return call.map(
        tree,
        lambda value, res, mesh: named_sharding(mesh, res.spec),
        replace_boxes=True,
        shared=True,
    )


def get_sharding(tree: Any, mesh: Mesh) -> Any:
    """The same as ``to_sharding(tree, mesh)``, under flax.linen's name.

    Unlike flax's, it resolves logical boxes (through the rules context) rather
    than failing on them, and is shape-aware.

    Args:
        tree: a tree with boxes.
        mesh: the device mesh.

    Returns:
        A tree of `NamedSharding`s, a prefix of `tree`.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> st.get_sharding({"b": jnp.zeros(8)}, mesh)["b"].spec
        P()
    """
    check_mesh("get_sharding", mesh)
    call = Call("get_sharding", None, mesh)
    return call.map(
        tree,
        lambda value, res, mesh: named_sharding(mesh, res.spec),
        replace_boxes=True,
        shared=True,
    )


def _abstract(value: Any, res: Resolution, mesh: Any) -> jax.ShapeDtypeStruct:
    sharding = named_sharding(mesh, res.spec)
    return jax.ShapeDtypeStruct(shape_of(value), dtype_of(value), sharding=sharding)


def to_abstract(tree: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
    """Returns a sharded `jax.ShapeDtypeStruct` per array leaf, boxes kept.

    A restore target for checkpoint libraries and an argument for
    ``jax.jit(f).lower(...)``: nothing is allocated.

    Args:
        tree: a tree with boxes (of arrays or of `jax.ShapeDtypeStruct`s).
        mesh: the device mesh.
        rules: rules for logical boxes without their own.

    Returns:
        `tree` with every array replaced by ``ShapeDtypeStruct(shape, dtype,
        sharding=...)``.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.Partitioned(jnp.zeros((4, 8)), ("data", "model"))}
        >>> st.to_abstract(params, mesh)["w"].value.sharding.spec
        P('data', 'model')
    """
    check_mesh("to_abstract", mesh)
    return Call("to_abstract", rules, mesh).map(tree, _abstract, replace_boxes=False)


def validate_rules(
    rules: RulesLike | None, mesh: AnyMesh | None = None, tree: Any = None
) -> list[str]:
    """Lists the problems of a rule set, as readable sentences; empty when all is well.

    It reports rules naming mesh axes not in `mesh` (on that mesh they never
    apply), logical names in `tree` that no rule covers (their dimensions stay
    unsharded), and rules for logical names that `tree` never uses.

    Args:
        rules: the rules to check; None means the rules context.
        mesh: the mesh they are meant for, if any.
        tree: a tree with logical boxes, if any.

    Returns:
        One string per problem.

    Raises:
        TypeError: if a rule is malformed.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> tree = {"w": st.LogicallyPartitioned(jnp.zeros((4, 8)), ("embed", "heads"))}
        >>> for problem in st.validate_rules([("embed", "fsdp"), ("vocab", "model")], mesh, tree):
        ...     print(problem)
        rule 0 ('embed', 'fsdp') names mesh axis 'fsdp', which is not in the mesh (axes 'data', 'model'); on this mesh it never applies.
        logical name 'heads' (at tree['w']) is not covered by any rule; its dimensions stay unsharded.
        rule 1 ('vocab', 'model') is never used: no box in the tree has the logical name 'vocab'.
    """
    normal = rules_or_context(rules, "validate_rules")
    check_mesh("validate_rules", mesh, optional=True)
    problems = []
    if mesh is not None:
        axes = tuple(mesh.axis_names)
        for i, (name, mesh_axes) in enumerate(normal):
            for axis in mesh_axes_of(mesh_axes):
                if axis not in axes:
                    problems.append(
                        f"rule {i} {(name, mesh_axes)!r} names mesh axis {axis!r}, which is "
                        f"not in the mesh (axes {', '.join(map(repr, axes))}); on this mesh "
                        "it never applies."
                    )
                    break
    if tree is not None:
        used = _logical_names_in(tree)
        covered = {name for name, _ in normal}
        for name, where in used.items():
            if name not in covered:
                problems.append(
                    f"logical name {name!r} (at {where}) is not covered by any rule; its "
                    "dimensions stay unsharded."
                )
        for i, (name, mesh_axes) in enumerate(normal):
            if name not in used:
                problems.append(
                    f"rule {i} {(name, mesh_axes)!r} is never used: no box in the tree has "
                    f"the logical name {name!r}."
                )
    return problems


def _logical_names_in(tree: Any) -> dict[str, str]:
    """Each logical name used by a box without its own rules -> where first seen."""
    found: dict[str, str] = {}
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=IS_BOX)[0]
    for path, leaf in paths:
        while isinstance(leaf, AxisMetadata) and not isinstance(leaf, Partitioned):
            leaf = leaf.unbox()
        if isinstance(leaf, Partitioned) and leaf._logical and getattr(leaf, "rules", None) is None:
            for name in leaf.names:
                if isinstance(name, str):
                    found.setdefault(name, "tree" + jax.tree_util.keystr(path))
    return found
