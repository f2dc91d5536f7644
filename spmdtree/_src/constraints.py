"""Sharding constraints and placement: `with_logical_constraint`, `constrain`, `shard`.

Inside `jax.jit` a constraint tells the compiler how an intermediate value is
laid out. JAX has two mechanisms, by the type of the mesh axes involved:
`jax.lax.with_sharding_constraint` for Auto axes and `jax.sharding.reshard`
for Explicit axes (which `jax.make_mesh` makes by default); Manual axes (inside
`jax.shard_map`) cannot be constrained and are dropped from the spec. Outside
jit a constraint places the array, as `jax.device_put` does.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import numpy as np
from jax._src.core import trace_state_clean  # how JAX itself tells that it is tracing
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from spmdtree._src.boxes import (
    LogicallyPartitioned,
    foreign_kind,
    refuse_foreign,
    same_mesh,
    shape_of,
)
from spmdtree._src.errors import Mistake, at, fmt, public, raise_collected
from spmdtree._src.resolve import (
    Layout,
    Resolution,
    RulesFallback,
    check_call,
    check_mesh,
    mesh_shape_of,
    named_sharding,
    resolve_leaf,
    walk_specs,
)
from spmdtree._src.rules import (
    UNCONSTRAINED,
    AnyMesh,
    AxisName,
    NameTuple,
    PyTree,
    Rules,
    RuleTuple,
    normalize_rules,
    rules_or_context,
)
from spmdtree._src.specs import context_mesh, resolve_tree
from spmdtree._src.trees import KeyPath, each_leaf


def _only(entry: AxisName, axes: set[str]) -> AxisName:
    """The part of a spec entry that uses `axes` (None if nothing is left)."""
    if isinstance(entry, str):
        return entry if entry in axes else None
    if isinstance(entry, tuple):
        kept = tuple(axis for axis in entry if axis in axes)
        return kept if kept else None
    return entry  # None or UNCONSTRAINED


def _concrete(mesh: AnyMesh) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    concrete = jax.sharding.get_mesh()
    if concrete.empty:
        raise Mistake(
            ValueError,
            f"is to be placed on the abstract mesh {mesh}, which has no devices. "
            "Pass a concrete mesh with mesh=, or call under jax.set_mesh(mesh).",
        )
    return concrete


def place(value: ArrayLike, sharding: NamedSharding) -> jax.Array:
    """`value` placed on `sharding`, also when the mesh spans processes.

    A host value (the same on every process, as from the same seed) goes onto
    devices this process cannot address through `jax.make_array_from_callback`:
    each process fills only its own shards.
    """
    if sharding.is_fully_addressable or (
        isinstance(value, jax.Array) and not value.is_fully_addressable
    ):
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _check_committed(x: object, mesh: AnyMesh) -> None:
    """A concrete array laid out on another mesh is a mistake, not a move to make."""
    own = getattr(getattr(x, "sharding", None), "mesh", None)
    if own is None or isinstance(x, jax.core.Tracer):
        return
    if not same_mesh(getattr(own, "abstract_mesh", own), getattr(mesh, "abstract_mesh", mesh)):
        raise Mistake(
            ValueError,
            f"is laid out on the mesh {own}, not on the mesh in effect, {mesh}. Put it "
            "on that mesh first (st.shard or jax.device_put), or constrain it with "
            "mesh= its own mesh.",
        )


def _explicit_entries(x: ArrayLike, spec: PartitionSpec, explicit: set[str]) -> tuple[Any, Any]:
    """(now, wanted): `x`'s spec entries over the Explicit axes (its type says), and
    those `spec` asks for, an UNCONSTRAINED entry keeping the current one. An entry
    of one axis is that axis, and the specs are padded to the array's rank."""

    def single(entry: AxisName) -> AxisName:
        return entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry

    typed = jax.typeof(x)
    rank = len(typed.shape)
    spec_now = tuple(getattr(typed.sharding, "spec", None) or ())
    now = tuple(single(_only(e, explicit)) for e in spec_now + (None,) * (rank - len(spec_now)))
    padded = tuple(spec) + (None,) * (rank - len(spec))
    wanted = tuple(
        current if e is UNCONSTRAINED else single(_only(e, explicit))
        for e, current in zip(padded, now, strict=True)
    )
    return now, wanted


def apply_spec(x: ArrayLike, spec: PartitionSpec, mesh: AnyMesh) -> ArrayLike:
    """Constrains (inside a trace) or places (outside) one array on `spec` over `mesh`.

    On Explicit axes an array is resharded whenever its sharding there differs
    from the target's, also to a target that names no Explicit axis (it ends
    unsharded); an UNCONSTRAINED entry keeps the array's own.

    Raises:
        Mistake: for a reshard onto Explicit axes inside jit without
            `jax.set_mesh`, and for an array committed to another mesh.
    """
    _check_committed(x, mesh)
    if trace_state_clean():  # not tracing: a captured constant inside jit is constrained
        return place(x, named_sharding(_concrete(mesh), Layout(spec)))
    ctx = context_mesh()
    if ctx is not None and tuple(ctx.axis_names) != tuple(mesh.axis_names):
        ctx = None  # another mesh is set; constrain with mesh= itself
    typed = ctx or mesh
    types = dict(zip(typed.axis_names, typed.axis_types, strict=True))
    explicit = {axis for axis, kind in types.items() if kind == AxisType.Explicit}
    auto = {axis for axis, kind in types.items() if kind == AxisType.Auto}
    now, wanted = _explicit_entries(x, spec, explicit) if explicit else ((), ())
    if now != wanted:
        if ctx is None:
            raise Mistake(
                ValueError,
                f"is to be resharded onto Explicit mesh axes {sorted(explicit)} inside "
                "jax.jit, which JAX allows only with the mesh in context. Call the "
                "jitted function under `with jax.set_mesh(mesh):`, or build the mesh "
                "with axis_types=(jax.sharding.AxisType.Auto, ...).",
            )
        x = jax.sharding.reshard(x, PartitionSpec(*wanted))
    if auto:
        auto_spec = PartitionSpec(*(_only(entry, auto) for entry in spec))
        # UNCONSTRAINED stays: a constraint, unlike a sharding, may leave it free.
        target = (
            auto_spec
            if ctx is not None
            else named_sharding(mesh, Layout(auto_spec), constraint=True)
        )
        x = jax.lax.with_sharding_constraint(x, target)
    return x


@public
def with_logical_constraint(
    x: PyTree,
    logical_axis_resources: PyTree,
    rules: Rules | None = None,
    mesh: AnyMesh | None = None,
    fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
) -> PyTree:
    """Constrains arrays to the shardings their logical names resolve to.

    Inside `jax.jit` this is a sharding constraint (Auto axes) or a reshard
    (Explicit axes); Manual axes (inside `jax.shard_map`) are dropped. Outside
    jit it places the arrays. Resolution is shape-aware like `to_spec`: a rule
    whose mesh axes do not divide a dimension is skipped, and a dimension no
    rule fits follows `fallback` (never a JAX error).

    Rules and the mesh from the context are read when a function is traced: a
    jitted function does not retrace when the context changes later.

    Args:
        x: an array or a tree of arrays (boxes are kept, their values constrained).
        logical_axis_resources: a logical spec (a tuple of logical names or a
            `PartitionSpec`; for a single array, a list too) for `x`, or a tree
            of them that is a prefix of `x` (where a list is a list of specs,
            as JAX reads it); None leaves that subtree alone.
        rules: the rules; defaults to the rules context.
        mesh: the mesh; defaults to the one set with `jax.set_mesh`.
        fallback: what to do with a logical name no rule maps.

    Returns:
        `x`, constrained; unchanged when there is no mesh, as single-device
        code needs (the names are still resolved, so
        ``RulesFallback.RAISE_ERROR`` raises for a name no rule covers).
        A name that no rule mentions leaves its dimension unsharded, as in
        flax; add ``(name, None)`` to the rules to say so.

    Raises:
        ValueError: with ``RulesFallback.RAISE_ERROR``, naming the unmatched
            logical name (also without a mesh); with a mesh in effect but no
            rules at all; for a name that no rule mentions but that is a mesh
            axis, or that is close to a rule name the specs never use (a
            typo); for Explicit axes inside jit without `jax.set_mesh`; for a
            rule naming an axis not in the mesh.
        TypeError: if a spec is not a logical spec.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> rules = [("batch", "data"), ("embed", "model")]
        >>> @jax.jit
        ... def f(x):
        ...     return st.with_logical_constraint(2 * x, ("batch", "embed"), rules)
        >>> with jax.set_mesh(mesh):
        ...     f(jnp.ones((4, 8))).sharding.spec
        P('data', 'model')
    """
    check_mesh(mesh, optional=True)
    if not isinstance(fallback, RulesFallback):
        raise Mistake(
            TypeError,
            f"fallback is {fallback!r}; expected a st.RulesFallback, e.g. "
            "st.RulesFallback.RAISE_ERROR.",
        )
    if logical_axis_resources is None:
        return x
    if isinstance(logical_axis_resources, list) and shape_of(x) is not None:
        logical_axis_resources = tuple(logical_axis_resources)  # one array: a list is its names
    specs, treedef, problems = walk_specs(
        logical_axis_resources, "logical_axis_resources", none=True
    )
    try:
        subtrees = cast(Any, treedef).flatten_up_to(x)
    except (ValueError, TypeError) as e:
        raise Mistake(
            ValueError,
            "logical_axis_resources must be a spec or a tree of specs that is a "
            f"prefix of x, but it is not: {e}",
        ) from None
    constraint = _Constraint(rules_or_context(rules), mesh, fallback)
    out = [
        subtree
        if names is None
        else jax.tree_util.tree_map_with_path(
            lambda inner, value, path=path, names=names: constraint.array(
                (*path, *inner), names, value
            ),
            subtree,
            is_leaf=lambda v: foreign_kind(v) is not None,  # our boxes: their values
        )
        for (path, names), subtree in zip(specs, subtrees, strict=True)
    ]
    raise_collected(problems + constraint.problems)
    constraint.check()
    return x if constraint.live is None else jax.tree.unflatten(treedef, out)


class _Constraint:
    """One `with_logical_constraint` call: its rules, mesh and fallback, and what
    it found. Names are resolved (and RAISE_ERROR raises) even where nothing is
    constrained: without rules or without a mesh, arrays come back as they are."""

    def __init__(self, rules: RuleTuple, mesh: AnyMesh | None, fallback: RulesFallback) -> None:
        self.rules, self.fallback = rules, fallback
        self.in_effect = mesh if mesh is not None else context_mesh()
        self.live = self.in_effect if rules else None
        self.mesh_shape = None if self.live is None else mesh_shape_of(self.live)
        self.resolved: list[tuple[Any, Resolution]] = []
        self.problems: list[tuple[str, Mistake]] = []

    def array(self, path: KeyPath, names: NameTuple, value: Any) -> Any:
        """`value` constrained to `names`; a mistake is kept with its key path."""
        try:
            return self._array(path, names, value)
        except Mistake as mistake:
            self.problems.append((f"the array at {at('x', path)}", mistake))
            return value

    def _array(self, path: KeyPath, names: NameTuple, value: Any) -> Any:
        shape = shape_of(refuse_foreign(value))
        if shape is None:
            return value
        if len(names) > len(shape):
            raise Mistake(
                ValueError,
                f"has shape {shape}, but its logical spec {names} names "
                f"{len(names)} dimensions. Give at most one name per dimension "
                "(a shorter spec leaves the last dimensions unsharded).",
            )
        # As in a PartitionSpec, missing trailing names leave dimensions unsharded.
        names += (None,) * (len(shape) - len(names))
        res = resolve_leaf(
            names,
            shape,
            logical=True,
            rules=self.rules,
            mesh_shape=self.mesh_shape,
            checked=self.in_effect is not None,  # without a mesh, single-device code runs as is
            box=False,
        )
        self.resolved.append((path, res))
        if res.unmatched and self.fallback is RulesFallback.RAISE_ERROR:
            raise Mistake(
                ValueError,
                f"has logical names {names}, and no rule maps {res.unmatched[0]!r} "
                f"(of shape {shape})"
                + (" on this mesh" if self.mesh_shape is not None else "")
                + f". Add a rule for {res.unmatched[0]!r}, or use another fallback.",
            )
        if self.live is None or (res.unmatched and self.fallback is RulesFallback.NO_CONSTRAINT):
            return value
        return apply_spec(value, res.spec, self.live)

    def check(self) -> None:
        """The checks of the whole call (`check_call`): typos, the warning."""
        paths = [at("x", path) for path, _ in self.resolved]
        resolved = [res for _, res in self.resolved]
        check_call(resolved, self.rules, paths.__getitem__, noun="array", warn=True)


def _no_other_rules(rules: RuleTuple, leaf: object) -> None:
    """A box whose own rules are not `rules=`: which layout is meant is ambiguous."""
    own = leaf.rules if isinstance(leaf, LogicallyPartitioned) else None
    if own is not None and own != rules:
        raise Mistake(
            ValueError,
            f"has rules of its own, {fmt(own)}, and rules= gives others, {fmt(rules)}, "
            "so which layout is meant is ambiguous. Drop the box's rules "
            "(box.replace(rules=None)) to constrain it by rules=, or leave rules= out "
            "to constrain it by its own.",
        )


@public
def constrain(tree: PyTree, mesh: AnyMesh | None = None, rules: Rules | None = None) -> PyTree:
    """Constrains every boxed value to its sharding, boxes kept (inside jit).

    Use it on boxed params inside a jitted step to pin their layout; unboxed
    leaves are left alone. Outside jit it places the boxed values.

    Args:
        tree: a tree with boxes.
        mesh: the mesh; defaults to the boxes' own, else the one set with
            `jax.set_mesh`. With none, `tree` is returned unchanged.
        rules: rules for logical boxes without their own, e.g. compute rules
            for params stored by others (a layer's FSDP all-gather).

    Returns:
        `tree` with each boxed value constrained.

    Raises:
        ValueError: for names that cannot be right for their value on the
            mesh, and for a box with rules of its own other than `rules`.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.Partitioned(jnp.ones((4, 8)), ("data", "model"))}
        >>> with jax.set_mesh(mesh):
        ...     out = jax.jit(lambda p: st.constrain(p))(params)
        >>> out["w"].value.sharding.spec
        P('data', 'model')
    """

    walk = resolve_tree(tree, rules, mesh=mesh)
    if rules is not None:
        each_leaf(functools.partial(_no_other_rules, normalize_rules(rules)), tree, walk.leaves)
    if walk.mesh is None:
        return tree
    live = walk.mesh

    def finish(value: ArrayLike, res: Resolution) -> ArrayLike:
        return value if res.names is None else apply_spec(value, res.spec, live)

    return walk.map(finish, keep_boxes=True)


@public
def shard(
    tree: PyTree,
    mesh: Mesh,
    rules: Rules | None = None,
    *,
    params: PyTree = None,
    strict: bool = False,
) -> PyTree:
    """Places every value on its sharding, boxes kept (outside jit).

    Unboxed arrays are replicated. On a mesh that spans processes, each
    process passes the same host value and fills only the shards it holds. For
    trees too large for one device, build them sharded in the first place with
    `sharded_init`.

    Args:
        tree: a tree with boxes of arrays.
        mesh: the device mesh.
        rules: rules for logical boxes without their own.
        params: the boxed params `tree` was derived from, for reduced states
            (as for `to_spec`).
        strict: raise where the spec would fall back, as for `to_spec` (new
            in 0.3).

    Returns:
        `tree` with every array placed on its `NamedSharding`.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.
        TypeError: for a leaf that is abstract (a `jax.ShapeDtypeStruct`).

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = st.shard({"w": st.Partitioned(jnp.ones((4, 8)), ("data", "model"))}, mesh)
        >>> params["w"].value.sharding.spec
        P('data', 'model')
    """
    check_mesh(mesh)

    def finish(value: ArrayLike, res: Resolution) -> jax.Array:
        if isinstance(value, jax.ShapeDtypeStruct):
            raise Mistake(
                TypeError,
                "is a jax.ShapeDtypeStruct, which has no data to place; use "
                "st.to_abstract for abstract trees, or st.sharded_init to build it.",
            )
        return place(value, named_sharding(mesh, res.layout))

    walk = resolve_tree(tree, rules, mesh=mesh, params=params, strict=strict)
    return walk.map(finish, keep_boxes=True)
