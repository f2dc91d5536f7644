"""From boxes to `PartitionSpec`s, `NamedSharding`s and abstract arrays.

`get_partition_spec` reports names as written (flax.linen's semantics). The
other functions resolve them, through one pass (`resolve_tree`) that gives a
`Resolution` per array leaf; each public function is one map over it. With a
mesh the result is shape-aware: a spec never names a mesh axis that is not
there, uses an axis twice, or shards a dimension the axes do not divide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from spmdtree._src.boxes import (
    IS_BOX,
    AxisMetadata,
    Meta,
    Partitioned,
    box_resolution,
    check_box_mesh,
    dtype_of,
    is_array,
    shape_of,
)
from spmdtree._src.errors import Mistake, public
from spmdtree._src.rules import (
    REPLICATED,
    AnyMesh,
    Resolution,
    RulesLike,
    axes_of,
    check_mesh,
    mesh_shape_of,
    named_sharding,
    rules_or_context,
)
from spmdtree._src.trees import each_leaf, is_boxed

#: What a box holding no array resolves to: it passes through unchanged.
PASS: Any = object()


def holds_array(value: Any) -> bool:
    """Whether any leaf of `value` is an array (so it has a sharding)."""
    return any(is_array(leaf) for leaf in jax.tree.leaves(value))


def context_mesh() -> AnyMesh | None:
    """The mesh set with `jax.set_mesh` (abstract inside jit), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


@dataclasses.dataclass(frozen=True, eq=False)
class Nested:
    """The resolutions inside a box that holds a subtree (SM3's per-dimension vectors)."""

    leaves: list[Any]
    treedef: Any
    resolutions: list[Any]


@dataclasses.dataclass(frozen=True)
class Walk:
    """A tree's leaves (boxes as leaves) with what each resolved to: a
    `Resolution` for an array, `Nested` for a box holding a subtree, `PASS`
    for a box holding no array, None for anything else."""

    tree: Any
    leaves: list[Any]
    treedef: Any
    resolutions: list[Any]
    mesh: AnyMesh | None

    def map(self, finish: Callable[[Any, Resolution], Any], *, keep_boxes: bool) -> Any:
        """The tree with every array replaced by ``finish(value, resolution)``.

        A box holding an array becomes the result (`keep_boxes` False: specs,
        shardings) or holds it (`keep_boxes` True). A box holding a subtree is
        kept around its results; one holding no array comes back unchanged.
        Leaves that are not arrays become None, or stay with `keep_boxes`.
        Mistakes `finish` raises are collected with their key paths.
        """

        def one(leaf: Any, res: Any) -> Any:
            if type(res) is Resolution:
                if not isinstance(leaf, AxisMetadata):
                    return finish(leaf, res)
                out = finish(
                    leaf._tree[0][0] if isinstance(leaf, Partitioned) else leaf.unbox(), res
                )
                return leaf.replace_boxed(out) if keep_boxes else out
            if res is None:
                return leaf if keep_boxes else None
            if res is PASS:
                return leaf
            inner = [one(x, r) for x, r in zip(res.leaves, res.resolutions, strict=True)]
            return leaf.replace_boxed(res.treedef.unflatten(inner))

        return self.treedef.unflatten(each_leaf(one, self.tree, self.leaves, self.resolutions))

    def replace(self, fn: Callable[[Resolution], Any]) -> Any:
        """`map` for a result that depends on the resolution only (specs,
        shardings): ``fn`` runs once per distinct resolution, and boxes holding
        an array are replaced."""
        unique = set(self.resolutions)
        if any(res is PASS or type(res) is Nested for res in unique):
            return self.map(lambda value, res: fn(res), keep_boxes=False)
        done = {res: fn(res) for res in unique if res is not None}
        done[None] = None
        return self.treedef.unflatten([done[res] for res in self.resolutions])


def _boxes_mesh(leaves: list[Any]) -> AnyMesh | None:
    """The first mesh a box of `leaves` carries, or None."""
    for leaf in leaves:
        if isinstance(leaf, Partitioned) and leaf._tree[1].mesh is not None:
            return leaf._tree[1].mesh
    return None


def resolve_tree(
    tree: Any,
    rules: RulesLike | None,
    *,
    mesh: AnyMesh | None,
    strict: bool = False,
    lenient: bool = False,
) -> Walk:
    """The one resolution pass: a `Resolution` for every array leaf of `tree`.

    The mesh is chosen first: `mesh`; else the boxes' own (the first found;
    every other box's must be the same); else the one set with `jax.set_mesh`.
    Logical boxes resolve through their own rules, else `rules`, else the
    context. Each distinct (box kind, metadata, shape) resolves once: layers
    repeat, so a tree of thousands of leaves costs little more than its
    flattening (benchmarks/run.py, B2). A resolution's `problem` is raised
    unless `lenient` (the plan reports it instead); with `strict`, so is any
    dimension left unsharded.

    Raises:
        Mistake: naming the key path of every wrong leaf.
    """
    check_mesh(mesh, optional=True)
    normal = rules_or_context(rules)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=IS_BOX)
    if mesh is None:
        mesh = _boxes_mesh(leaves)
    if mesh is None:
        mesh = context_mesh()
    mesh_shape = None if mesh is None else mesh_shape_of(mesh)
    memo: dict[Any, Resolution] = {}

    def of_box(kind: type[Partitioned], meta: Meta, shape: tuple[int, ...]) -> Resolution:
        key = (kind, meta, shape)
        found = memo.get(key)
        if found is None:
            found = memo[key] = box_resolution(
                kind, meta, shape, rules=normal, mesh_shape=mesh_shape
            )
        problem = found.strict_problem() if strict else found.problem
        if problem is not None and not lenient:
            raise Mistake(ValueError, problem)
        return found

    def one(leaf: Any, named: tuple[type[Partitioned], Meta] | None) -> Any:
        if isinstance(leaf, Partitioned):
            (value,), meta = leaf._tree
            if meta.mesh is not None:
                check_box_mesh(meta, mesh)
            shape = shape_of(value)
            if shape is None:
                return nested(value, (type(leaf), meta))
            return of_box(type(leaf), meta, shape)
        if isinstance(leaf, AxisMetadata):
            value = leaf.unbox()
            return REPLICATED if is_array(value) else nested(value, named)
        shape = shape_of(leaf)
        if shape is None:
            return None
        return REPLICATED if named is None else of_box(*named, shape)

    def nested(value: Any, named: tuple[type[Partitioned], Meta] | None) -> Any:
        if not holds_array(value):
            return PASS
        inner, inner_def = jax.tree.flatten(value, is_leaf=IS_BOX)
        return Nested(inner, inner_def, [one(x, named) for x in inner])

    def fast(leaf: Any) -> Any:
        # The common case (a box of an array whose metadata and shape were seen)
        # without function calls: layers repeat, so most leaves take this path.
        if isinstance(leaf, Partitioned):
            (value,), meta = leaf._tree
            found = memo.get((type(leaf), meta, getattr(value, "shape", None)))
            if found is not None and meta.mesh is None and found.problem is None and not strict:
                return found
        return one(leaf, None)

    resolutions = each_leaf(fast, tree, leaves)
    return Walk(tree, leaves, treedef, resolutions, mesh)


def shardings(walk: Walk, mesh: AnyMesh) -> Any:
    """A `NamedSharding` per array of `walk`, one object per distinct resolution."""
    return walk.replace(lambda res: named_sharding(mesh, res.spec))


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


@public
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

    * a mesh axis not in the mesh is a ValueError, in a `Partitioned` box's
      names as in a rule that a logical box reaches (a typo is never skipped);
    * a dimension its mesh axes do not divide tries the next rule for its
      logical name, else stays unsharded (``strict=True``: an error);
    * a value with more dimensions than names is an error (use `add_axis` or
      `spmdtree.vmap`), and so is one with fewer (stale names inside a plain
      `jax.lax.scan`, or a reduced optimizer state: see `optimizer_sharding`),
      unless every dimension has size 1 (a placeholder: replicated).

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
    return resolve_tree(tree, rules, mesh=mesh, strict=strict).replace(lambda res: res.spec)


@public
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
    check_mesh(mesh)
    return shardings(resolve_tree(tree, rules, mesh=mesh, strict=strict), mesh)


@public
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
    check_mesh(mesh)
    return shardings(resolve_tree(tree, None, mesh=mesh), mesh)


@public
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
    check_mesh(mesh)

    def abstract(value: Any, res: Resolution) -> jax.ShapeDtypeStruct:
        sharding = named_sharding(mesh, res.spec)
        return jax.ShapeDtypeStruct(shape_of(value), dtype_of(value), sharding=sharding)

    return resolve_tree(tree, rules, mesh=mesh).map(abstract, keep_boxes=True)


@public
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
    normal = rules_or_context(rules)
    check_mesh(mesh, optional=True)
    problems = []
    if mesh is not None:
        axes = tuple(mesh.axis_names)
        for i, (name, mesh_axes) in enumerate(normal):
            for axis in axes_of(mesh_axes):
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
        if isinstance(leaf, Partitioned) and leaf.logical and leaf._tree[1].rules is None:
            for name in leaf.names:
                if isinstance(name, str):
                    found.setdefault(name, "tree" + jax.tree_util.keystr(path))
    return found
