"""From boxes to `PartitionSpec`s, `NamedSharding`s and abstract arrays.

`get_partition_spec` reports names as written (flax.linen's semantics). The
other functions resolve them, through one pass (`resolve_tree`) that gives a
`Resolution` per array leaf; each public function is one map over it. With a
mesh the result is shape-aware: a spec never names a mesh axis that is not
there, uses an axis twice, or shards a dimension the axes do not divide.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdtree._src.boxes import (
    PASS,
    At,
    AxisMetadata,
    BoxResolver,
    Found,
    Meta,
    Nested,
    Partitioned,
    check_leaves,
    dtype_of,
    finished,
    holds_array,
    is_array,
    leaf_test,
    refuse_foreign,
    shape_of,
)
from spmdtree._src.errors import Mistake, public
from spmdtree._src.resolve import (
    AMBIGUOUS,
    FEWER_DIMENSIONS,
    REPLICATED,
    USED,
    Kept,
    Resolution,
    axes_of,
    check_mesh,
    layout_of,
    mesh_shape_of,
    named_sharding,
)
from spmdtree._src.rules import (
    AnyMesh,
    MeshShape,
    NameTuple,
    PyTree,
    Rules,
    RuleTuple,
    rules_or_context,
)
from spmdtree._src.trees import KeyPath, each_leaf, is_boxed, map_leaves


def context_mesh() -> AnyMesh | None:
    """The mesh set with `jax.set_mesh` (abstract inside jit), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def context_axis(axis: str, kind: str, runs: str) -> int:
    """The size of the mesh axis `axis` of the mesh in context, which the caller `runs`
    along as its `kind` axis (``"stage"``: the pipeline's; ``"context"``: a sequence's;
    new in 0.8); a `Mistake` where no mesh is in context or it has no such axis."""
    mesh = context_mesh()
    if mesh is None:
        raise Mistake(
            ValueError,
            f"no mesh is in context; {runs} along the mesh axis {axis!r} of the mesh set with "
            "jax.set_mesh. Call it under `with jax.set_mesh(mesh):` (a `with mesh:` block "
            "sets none).",
        )
    if axis not in mesh.axis_names:
        raise Mistake(
            ValueError,
            f"the mesh in context has axes {dict(mesh.shape)}, no {kind} axis {axis!r}. Build "
            f"the mesh with an axis {axis!r} (jax.make_mesh), or pass the {kind} axis's name "
            "as axis=.",
        )
    return int(mesh.shape[axis])


@dataclasses.dataclass(frozen=True)
class Walk:
    """A tree's leaves (boxes as leaves) with what each resolved to: a
    `Resolution` for an array, `Nested` for a box holding a subtree, `PASS`
    for a box holding no array, None for anything else."""

    tree: PyTree
    leaves: list[Any]
    treedef: jax.tree_util.PyTreeDef
    resolutions: list[Found]
    mesh: AnyMesh | None

    def map(self, finish: Callable[[Any, Resolution], Any], *, keep_boxes: bool) -> PyTree:
        """The tree with every array replaced by ``finish(value, resolution)``,
        leaf by leaf as `boxes.finished` says (`keep_boxes`: boxes kept around
        their results). Mistakes `finish` raises are collected with their key
        paths.
        """
        one = functools.partial(finished, finish, keep_boxes)
        return self.treedef.unflatten(each_leaf(one, self.tree, self.leaves, self.resolutions))

    def replace(self, fn: Callable[[Resolution], Any]) -> PyTree:
        """`map` for a result that depends on the resolution only (specs,
        shardings): ``fn`` runs once per distinct resolution, and boxes holding
        an array are replaced."""
        unique = set(self.resolutions)
        if any(res is PASS or type(res) is Nested for res in unique):
            return self.map(lambda value, res: fn(res), keep_boxes=False)
        done: dict[Found, Any] = {r: fn(cast(Resolution, r)) for r in unique if r is not None}
        done[None] = None
        return self.treedef.unflatten([done[res] for res in self.resolutions])


@public
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


class ParamIndex:
    """The boxed params a tree was derived from, indexed by (names, key-path suffix).

    Building it and each lookup cost time linear in a key path's length, so
    matching a whole tree is linear in its number of leaves.
    """

    def __init__(self, params: PyTree) -> None:
        self.params = params
        self.shapes: dict[tuple[NameTuple, tuple[Any, ...]], set[tuple[int, ...]]] = {}
        leaves = jax.tree.leaves(params, is_leaf=leaf_test())
        if not any(isinstance(x, Partitioned) for x in each_leaf(refuse_foreign, params, leaves)):
            raise Mistake(
                ValueError,
                "the params hold no boxes, so no state leaf can be matched to its param. "
                "Pass the boxed params (as built, before st.unbox), or box them with "
                "st.box.",
            )

    def _build(self) -> None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.params, is_leaf=leaf_test())[0]:
            shape = shape_of(leaf.value) if isinstance(leaf, Partitioned) else None
            if shape is None:
                continue
            for k in range(1, len(path) + 1):
                self.shapes.setdefault((leaf.names, tuple(path[-k:])), set()).add(shape)

    def shape_for(self, path: KeyPath, names: NameTuple) -> tuple[int, ...] | str | None:
        """The shape of the param with `names` whose key path shares the longest
        suffix with `path`: None if there is none, AMBIGUOUS if params of
        different shapes tie. The index is built at the first lookup: a state
        with no reduced leaf never needs it."""
        if not self.shapes:
            self._build()
        for k in range(len(path), 0, -1):
            shapes = self.shapes.get((names, path[-k:]))
            if shapes:
                return next(iter(shapes)) if len(shapes) == 1 else AMBIGUOUS
        return None


def _unmatched(names: NameTuple, shape: tuple[int, ...]) -> str:
    return (
        f"has {len(names)} names {names} for a value of shape {shape}, which has fewer "
        "dimensions, and no box in params= has these names at a key path that this "
        "one ends with. Pass the params this tree was derived from (the tree given "
        "to tx.init)."
    )


def _boxes_mesh(leaves: list[Any]) -> AnyMesh | None:
    """The first mesh a box of `leaves` carries, or None."""
    for leaf in leaves:
        if isinstance(leaf, Partitioned) and leaf._tree[1].mesh is not None:
            return leaf._tree[1].mesh
    return None


def resolve_tree(
    tree: PyTree,
    rules: Rules | None,
    *,
    mesh: AnyMesh | None,
    params: PyTree = None,
    strict: bool = False,
    lenient: bool = False,
    placed: bool = False,
    warn: bool = True,
    flat: tuple[list[Any], Any] | None = None,
    argument: str = "tree",
) -> Walk:
    """The one resolution pass: a `Resolution` for every array leaf of `tree`.

    The mesh is chosen first: `mesh`; else the boxes' own (the first found;
    every other box's must be the same); else the one set with `jax.set_mesh`.
    Logical boxes resolve through their own rules, else `rules`, else the
    context. Each distinct (box kind, metadata, shape) resolves once: layers
    repeat, so a tree of thousands of leaves costs little more than its
    flattening (benchmarks/run.py, B2). A resolution's `problem` is raised
    unless `lenient` (the plan reports it instead); with `strict`, so is any
    dimension left unsharded. With `params`, a box with fewer dimensions than
    names resolves through the param it came from (`ParamIndex`) and keeps the
    mesh axes of the dimensions it kept (`kept_dimensions`). With `placed`, an
    array in no box that carries a `NamedSharding` (a placed array, a
    `jax.ShapeDtypeStruct` with a sharding) keeps its spec instead of being
    replicated. Dimensions asked to shard that end unsharded make one
    `UnshardedWarning`, unless `lenient` or not `warn` (the plan flags them).
    `flat` is ``(leaves, treedef)`` of `tree` (boxes as leaves), for a caller
    that has flattened it already; `argument` names `tree` in messages.

    Raises:
        Mistake: naming the key path of every wrong leaf.
    """
    check_mesh(mesh, optional=True)
    normal = rules_or_context(rules)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=leaf_test()) if flat is None else flat
    if mesh is None:
        mesh = _boxes_mesh(leaves)
    if mesh is None:
        mesh = context_mesh()
    index = params if params is None or isinstance(params, ParamIndex) else ParamIndex(params)
    resolver = Resolver(tree, normal, mesh, index, strict=strict, lenient=lenient, placed=placed)
    resolutions = each_leaf(resolver.fast(), tree, leaves, range(len(leaves)), argument=argument)
    check_leaves((tree, leaves, resolutions), normal, argument, warn=warn and not lenient)
    return Walk(tree, leaves, treedef, resolutions, mesh)


class Resolver(BoxResolver):
    """The state of one resolution pass: the call's rules, mesh and params, and a
    memo of resolutions by (box kind, metadata, shape). What each leaf
    resolves to is `BoxResolver`'s dispatch, the one a box's own
    `get_sharding` takes; this adds the memo, `params`, `strict`, `lenient`
    and `placed`."""

    def __init__(
        self,
        tree: PyTree,
        rules: RuleTuple,
        mesh: AnyMesh | None,
        index: ParamIndex | None,
        *,
        strict: bool,
        lenient: bool,
        placed: bool,
    ) -> None:
        super().__init__(rules, mesh)
        self.tree, self.index = tree, index
        self.strict, self.lenient, self.placed = strict, lenient, placed
        self.memo: dict[Any, Resolution] = {}
        self.paths: list[tuple[Any, ...]] = []

    def fast(self) -> Callable[[Any, int], Found]:
        """`one`, with the common case (a box of an array whose metadata and shape
        were seen) taken in one lookup and no further call: layers repeat, so
        most leaves take this path, and it runs once per leaf."""
        lookup, one, strict = self.memo.get, self.one, self.strict

        def leaf_resolution(leaf: Any, i: int) -> Found:
            if not strict and isinstance(leaf, Partitioned):
                (value,), meta = leaf._tree
                found = lookup((type(leaf), meta, getattr(value, "shape", None)))
                if found is not None and meta.mesh is None and found.fallback is None:
                    return found
            return one(leaf, None, (i, None))

        return leaf_resolution

    def unboxed(self, leaf: Any) -> Resolution:
        """An array in no box: replicated, or with `placed` its own layout."""
        return placed_resolution(leaf, self.mesh_shape) if self.placed else REPLICATED

    def of_box(
        self, kind: type[Partitioned], meta: Meta, shape: tuple[int, ...], at: At
    ) -> Resolution:
        """A box's resolution; its problem raised unless lenient."""
        found = self.resolved(kind, meta, shape)
        if found.fallback == FEWER_DIMENSIONS and self.index is not None:
            found = self.through_params(self.index, kind, meta, shape, at)
        problem = found.strict_problem() if self.strict else found.problem
        if problem is not None and not self.lenient:
            raise Mistake(ValueError, problem)
        return found

    def resolved(self, kind: type[Partitioned], meta: Meta, shape: tuple[int, ...]) -> Resolution:
        """`resolve_leaf`, once per distinct (kind, metadata, shape)."""
        key = (kind, meta, shape)
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = super().resolved(kind, meta, shape)
        return found

    def through_params(
        self,
        index: ParamIndex,
        kind: type[Partitioned],
        meta: Meta,
        shape: tuple[int, ...],
        at: At,
    ) -> Resolution:
        """A reduced state's resolution, through the param it came from."""
        if not self.paths:  # the key paths, once, and only for a reduced state
            found_paths = jax.tree_util.tree_flatten_with_path(self.tree, is_leaf=leaf_test())[0]
            self.paths.extend(tuple(path) for path, _ in found_paths)
        param_shape = index.shape_for(self.paths[at[0]], meta.names)
        if param_shape is None:
            problem = _unmatched(meta.names, shape)
            return self.fallback(kind, meta, FEWER_DIMENSIONS, problem=problem)
        if isinstance(param_shape, str):  # AMBIGUOUS
            return self.fallback(kind, meta, AMBIGUOUS)
        key = (kind, meta, shape, param_shape, at[1])
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = self.kept(kind, meta, shape, param_shape, at[1])
        return found

    def kept(
        self,
        kind: type[Partitioned],
        meta: Meta,
        shape: tuple[int, ...],
        param_shape: tuple[int, ...],
        position: int | None,
    ) -> Resolution:
        """The resolution of the names of the param dimensions a state kept."""
        dims = kept_dimensions(shape, param_shape, position)
        kept = Kept(meta.names, param_shape, dims)
        if dims is None:
            return self.fallback(kind, meta, AMBIGUOUS, kept=kept)
        found = self.resolved(kind, meta._replace(names=tuple(meta.names[d] for d in dims)), shape)
        return dataclasses.replace(found, kept=kept)

    @staticmethod
    def fallback(kind: type[Partitioned], meta: Meta, why: str, **record: Any) -> Resolution:
        """A reduced state replicated by a fallback (`why`), in its box's layout."""
        return Resolution(
            layout=meta.layout, names=meta.names, logical=kind.logical, fallback=why, **record
        )


def placed_resolution(leaf: object, mesh_shape: MeshShape | None) -> Resolution:
    """An unboxed array's own layout: the spec of its `NamedSharding`, else replicated.

    Raises:
        Mistake: if it is laid out on a mesh of another shape than `mesh_shape`.
    """
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return REPLICATED
    own = mesh_shape_of(sharding.mesh)
    if mesh_shape is not None and own != mesh_shape:
        raise Mistake(
            ValueError,
            f"is laid out on a mesh of shape {dict(own)}, not on this one, "
            f"{dict(mesh_shape)}. Give it a sharding on this mesh, or none (replicated).",
        )
    return Resolution(layout=layout_of(sharding))


def shardings(walk: Walk, mesh: AnyMesh) -> PyTree:
    """A `NamedSharding` per array of `walk`, one object per distinct resolution."""
    return walk.replace(lambda res: named_sharding(mesh, res.layout))


@public
def get_partition_spec(tree: PyTree) -> PyTree:
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

    return _written_specs(tree)


def _written_specs(tree: PyTree) -> PyTree:
    def one(x: Any) -> Any:
        if is_boxed(x):
            value = x.unbox()
            if not holds_array(value):
                return x
            if isinstance(x, Partitioned):
                return x.get_partition_spec()
            return x.replace_boxed(_written_specs(value))
        return PartitionSpec() if is_array(x) else None

    return map_leaves(one, tree)


@public
def to_spec(
    tree: PyTree,
    rules: Rules | None = None,
    *,
    mesh: AnyMesh | None = None,
    strict: bool = False,
    params: PyTree = None,
) -> PyTree:
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
      `jax.lax.scan`, or a reduced optimizer state), unless every dimension
      has size 1 (a placeholder: replicated), or `params` resolves it.

    With ``params=``, the boxed params that `tree` (an optimizer state, or a
    dict holding params and state) was derived from, a box with fewer
    dimensions than names is a reduced state: it is matched to its param (the
    longest common key-path suffix among params with the same names) and
    keeps the mesh axes of the dimensions it kept (`kept_dimensions`); where
    that is ambiguous it is replicated (``strict=True``: an error).

    ``UNCONSTRAINED`` entries stay in the spec.

    Args:
        tree: a tree with boxes.
        rules: rules for logical boxes without their own.
        mesh: the mesh to resolve on.
        strict: raise where the result would fall back.
        params: the boxed params `tree` was derived from, for reduced states.

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
    walk = resolve_tree(tree, rules, mesh=mesh, params=params, strict=strict)
    return walk.replace(lambda res: res.spec)


@public
def to_sharding(
    tree: PyTree,
    mesh: Mesh,
    rules: Rules | None = None,
    *,
    strict: bool = False,
    params: PyTree = None,
) -> PyTree:
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
        params: the boxed params `tree` was derived from, for reduced states
            (as for `to_spec`).

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
    return shardings(resolve_tree(tree, rules, mesh=mesh, params=params, strict=strict), mesh)


@public
def get_sharding(tree: PyTree, mesh: Mesh) -> PyTree:
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
def to_abstract(
    tree: PyTree,
    mesh: Mesh,
    rules: Rules | None = None,
    *,
    params: PyTree = None,
    strict: bool = False,
) -> PyTree:
    """Returns a sharded `jax.ShapeDtypeStruct` per array leaf, boxes kept.

    A restore target for checkpoint libraries (orbax restores onto these
    shardings, on any mesh) and an argument for ``jax.jit(f).lower(...)``:
    nothing is allocated. With ``params=`` the shardings are exactly those of
    `to_sharding` and `optimizer_sharding`, so a restored train state matches
    the train step's ``in_shardings``.

    Args:
        tree: a tree with boxes (of arrays or of `jax.ShapeDtypeStruct`s).
        mesh: the device mesh.
        rules: rules for logical boxes without their own.
        params: the boxed params `tree` was derived from, for reduced states
            (as for `to_spec`).
        strict: raise where the spec would fall back, as for `to_spec` (new
            in 0.3).

    Returns:
        `tree` with every array replaced by ``ShapeDtypeStruct(shape, dtype,
        sharding=...)``.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, jax.numpy as jnp, optax, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))}
        >>> st.to_abstract(params, mesh)["w"].value.sharding.spec
        P('data', 'model')
        >>> tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
        >>> state = jax.eval_shape(tx.init, params)
        >>> target = st.to_abstract({"params": params, "opt": state}, mesh, params=params)
        >>> target["opt"][0].v_row["w"].value.sharding.spec  # the rows kept 'data'
        P('data',)
    """
    check_mesh(mesh)

    def abstract(value: Any, res: Resolution) -> jax.ShapeDtypeStruct:
        sharding = named_sharding(mesh, res.layout)
        return jax.ShapeDtypeStruct(shape_of(value), dtype_of(value), sharding=sharding)

    walk = resolve_tree(tree, rules, mesh=mesh, params=params, strict=strict)
    return walk.map(abstract, keep_boxes=True)


@public
def validate_rules(
    rules: Rules | None, mesh: AnyMesh | None = None, tree: PyTree = None
) -> list[str]:
    """Lists the problems of a rule set, as readable sentences; empty when all is well.

    It reports rules naming mesh axes not in `mesh` (on that mesh they never
    apply), logical names in `tree` that no rule covers (their dimensions stay
    unsharded), rules for logical names that `tree` never uses, and rules
    never reached: wherever their name appears, an earlier rule always takes
    the dimension or the mesh axes first.

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
    problems = [problem.sentence for problem in _absent_axes(normal, mesh)]
    if tree is not None:
        used = _logical_names_in(tree)
        covered = {name for name, _ in normal}
        for name, where in used.items():
            if name not in covered:
                problems.append(
                    f"logical name {name!r} (at {where}) is not covered by any rule; its "
                    "dimensions stay unsharded."
                )
        problems += [problem.sentence for problem in _unused(normal, set(used))]
        problems += [problem.sentence for problem in _never_reached(tree, normal, mesh)]
    return problems


@dataclasses.dataclass(frozen=True)
class RuleProblem:
    """What is wrong with one rule of a rule set, as `validate_rules` says it (new in 0.5).

    `StepPlan.rule_problems` holds those of the rules a step was traced under:
    a rule naming a mesh axis the mesh lacks, a rule whose logical name no box
    of the step's arguments has and no `with_logical_constraint` in the step
    names (a rule that matches nothing: what it was written to shard stays as
    the other rules leave it), and a rule never reached because an earlier
    one always takes the dimension or its mesh axes.

    Attributes:
        rule: the rule's position in the rules.
        name: its logical name.
        sentence: what is wrong, as a sentence.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
        >>> w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), ("embed", "kv"))
        >>> step = st.preflight(lambda w: 2 * w.value, w, mesh=mesh, rules=[("embed", "data"), ("heads", "data")])
        >>> [(problem.rule, problem.name) for problem in step.rule_problems]
        [(1, 'heads')]
        >>> print(step.rule_problems[0].sentence)
        rule 1 ('heads', 'data') is never used: no box in the step's arguments has the logical name 'heads', and no with_logical_constraint in the step names it. Check the name against the boxes' names (st.plan shows them), or drop the rule.
    """

    rule: int
    name: str
    sentence: str


def rule_problems(
    rules: RuleTuple, mesh: AnyMesh, arguments: PyTree, constrained: Collection[str]
) -> tuple[RuleProblem, ...]:
    """`validate_rules`' problems of single rules, for a step traced under `rules`
    with `arguments`, whose constraints named `constrained`: a rule only the
    step's activations use is used."""
    used = set(_logical_names_in(arguments)) | set(constrained)
    return (
        *_absent_axes(rules, mesh),
        *_unused(rules, used, step=True),
        *_never_reached(arguments, rules, mesh),
    )


def _absent_axes(rules: RuleTuple, mesh: AnyMesh | None) -> list[RuleProblem]:
    """Rules naming a mesh axis that `mesh` lacks: on it they never apply."""
    if mesh is None:
        return []
    axes = tuple(mesh.axis_names)
    return [
        RuleProblem(
            i,
            name,
            f"rule {i} {(name, mesh_axes)!r} names mesh axis {missing[0]!r}, which is "
            f"not in the mesh (axes {', '.join(map(repr, axes))}); on this mesh "
            "it never applies.",
        )
        for i, (name, mesh_axes) in enumerate(rules)
        if (missing := [axis for axis in axes_of(mesh_axes) if axis not in axes])
    ]


def _unused(rules: RuleTuple, used: set[str], *, step: bool = False) -> list[RuleProblem]:
    """Rules for logical names that nothing `used` has: they match nothing."""
    where = "the step's arguments" if step else "the tree"
    also = (
        ", and no with_logical_constraint in the step names it. Check the name against "
        "the boxes' names (st.plan shows them), or drop the rule"
        if step
        else ""
    )
    return [
        RuleProblem(
            i,
            name,
            f"rule {i} {(name, mesh_axes)!r} is never used: no box in {where} has "
            f"the logical name {name!r}{also}.",
        )
        for i, (name, mesh_axes) in enumerate(rules)
        if name not in used
    ]


def _never_reached(tree: PyTree, rules: RuleTuple, mesh: AnyMesh | None) -> list[RuleProblem]:
    """Rules for names the tree uses that never serve a dimension, because an
    earlier rule always takes the dimension or the mesh axes first."""
    try:
        walk = resolve_tree(tree, rules, mesh=mesh, lenient=True)
    except Mistake:  # names that cannot resolve: the problems above say why
        return []
    why: dict[int, set[str]] = {}  # rule -> why it was not taken, where tried
    served: set[int] = set()
    for res in set(walk.resolutions):
        if type(res) is not Resolution or not res.logical or res.kept is not None:
            continue
        for d in res.dims:
            if d.rule is not None:
                served.add(d.rule)
            for i, (name, _) in enumerate(rules):
                if name == d.name and d.rule is not None and i > d.rule:
                    why.setdefault(i, set()).add(f"rule {d.rule} takes its dimension")
            for p in d.passed:
                if p.reason == USED and p.rule is not None:
                    taken = f"its mesh axes already shard {res.dims[p.by or 0].name!r}"
                    why.setdefault(p.rule, set()).add(taken)
                elif p.rule is not None:
                    served.add(p.rule)  # tried, and only the size stood in its way
    return [
        RuleProblem(
            i,
            rules[i][0],
            f"rule {i} {rules[i]!r} is never reached: wherever {rules[i][0]!r} appears, "
            + " or ".join(sorted(why[i]))
            + ". Reorder the rules, or drop it.",
        )
        for i in sorted(why)
        if i not in served
    ]


def _logical_names_in(tree: PyTree) -> dict[str, str]:
    """Each logical name used by a box without its own rules -> where first seen."""
    found: dict[str, str] = {}
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf_test())[0]
    each_leaf(refuse_foreign, tree, [leaf for _, leaf in paths])
    for path, leaf in paths:
        while isinstance(leaf, AxisMetadata) and not isinstance(leaf, Partitioned):
            leaf = leaf.unbox()
        if isinstance(leaf, Partitioned) and leaf.logical and leaf._tree[1].rules is None:
            for name in leaf.names:
                if isinstance(name, str):
                    found.setdefault(name, "tree" + jax.tree_util.keystr(path))
    return found
