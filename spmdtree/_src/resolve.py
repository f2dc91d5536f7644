"""Resolution: names and rules become a mesh spec, with the record of how.

`resolve` is the one place where names become a mesh spec. It records what
happened to each dimension (`Dim`): the rule that served it, the rules passed
over and why; `strict`, `describe` and the plan's reasons read that record.
The mesh helpers and flax's public `logical_to_mesh*` functions live here too.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeGuard

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdtree._src.errors import (
    Mistake,
    at,
    called,
    fmt,
    public,
    raise_collected,
    user_level,
)
from spmdtree._src.rules import (
    UNCONSTRAINED,
    AnyMesh,
    AxisName,
    MeshShape,
    NameTuple,
    PyTree,
    Rules,
    RuleTuple,
    fit_rank,
    normalize_names,
    rules_or_context,
    saw,
)

# --- meshes ------------------------------------------------------------------


def check_mesh(mesh: object, *, optional: bool = False) -> None:
    """Raises a Mistake unless `mesh` is a Mesh or AbstractMesh (or None, if optional)."""
    if mesh is None and optional:
        return
    if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
        raise Mistake(
            TypeError,
            f"mesh is {fmt(mesh)}; expected a jax.sharding.Mesh, e.g. "
            "jax.make_mesh((2, 4), ('data', 'model')).",
        )
    if mesh.empty:
        raise Mistake(
            ValueError,
            f"mesh {mesh} has no axes; build one with jax.make_mesh((2, 4), ('data', 'model')).",
        )


def mesh_shape_of(mesh: AnyMesh) -> MeshShape:
    """The ``((axis, size), ...)`` of a mesh."""
    return tuple(mesh.shape.items())


#: The memory kinds a layout may name, as JAX's devices name their memories.
MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
#: Those of the host: an array there is offloaded, out of the device's memory.
HOST_KINDS = ("pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one array lives on a mesh: the record a resolution yields and
    `named_sharding` reads, so that a field of it reaches every sharding built.

    Attributes:
        spec: the mesh `PartitionSpec` (UNCONSTRAINED entries kept).
        memory_kind: the memory of each device the shards sit in: None (the
            device's default, as JAX's), or one of `MEMORY_KINDS`; a host kind
            offloads the array to the host's memory.
    """

    spec: PartitionSpec = dataclasses.field(default_factory=PartitionSpec)
    memory_kind: str | None = None

    def __post_init__(self) -> None:
        kind = self.memory_kind
        if kind is not None and not isinstance(kind, str):
            raise Mistake(
                TypeError,
                f"has memory_kind {fmt(kind)}; expected None or a string, one of "
                f"{_quoted(MEMORY_KINDS)} ('pinned_host' offloads it to the host).",
            )
        if kind is not None and kind not in MEMORY_KINDS:
            raise Mistake(
                ValueError,
                f"has memory_kind {kind!r}; expected None (the device's default) or one "
                f"of {_quoted(MEMORY_KINDS)}. Pass memory_kind='pinned_host' to offload "
                "it to the host.",
            )

    @property
    def on_host(self) -> bool:
        """Whether the array sits in the host's memory (offloaded)."""
        return self.memory_kind in HOST_KINDS

    def with_spec(self, spec: PartitionSpec) -> Layout:
        """The same layout with another spec."""
        return dataclasses.replace(self, spec=spec)


def layout_of(sharding: NamedSharding) -> Layout:
    """The layout a `NamedSharding` gives its array."""
    return Layout(sharding.spec, sharding.memory_kind)


def named_sharding(mesh: AnyMesh, layout: Layout, *, constraint: bool = False) -> NamedSharding:
    """A `NamedSharding` of a `Layout`, the one place spmdtree builds one;
    UNCONSTRAINED entries become None, since `jax.jit` and `jax.device_put`
    accept them only in constraints (`constraint`: for
    `jax.lax.with_sharding_constraint`, kept)."""
    spec = layout.spec
    if not constraint and any(entry is UNCONSTRAINED for entry in spec):
        spec = PartitionSpec(*(None if e is UNCONSTRAINED else e for e in spec))
    return NamedSharding(mesh, spec, memory_kind=layout.memory_kind)


# --- resolution ----------------------------------------------------------------

#: Why a rule (or a box's own mesh axes) was passed over for a dimension.
USED, INDIVISIBLE = "used", "indivisible"
#: Why a whole array is replicated although boxed.
PLACEHOLDER, FEWER_DIMENSIONS, AMBIGUOUS = "placeholder", "fewer dimensions", "ambiguous"


class Passed(NamedTuple):
    """Mesh axes passed over for a dimension: those of rule `rule` (None: the
    names themselves), of total size `size`, because `reason` (USED: an axis
    already shards dimension `by`; INDIVISIBLE: `size` does not divide it)."""

    rule: int | None
    axes: Any
    size: int
    reason: str
    by: int | None = None


class Dim(NamedTuple):
    """What one dimension got: its name as written, its size (None if unknown),
    the mesh axes it ended with, the rule that gave them (logical names), and
    the candidates passed over."""

    name: AxisName
    size: int | None
    axes: Any
    rule: int | None = None
    passed: tuple[Passed, ...] = ()

    @property
    def indivisible(self) -> bool:
        """Left unsharded although some candidate's mesh axes would shard it but
        for its size."""
        return (
            self.axes is None
            and self.rule is None
            and any(p.reason == INDIVISIBLE for p in self.passed)
        )


class Kept(NamedTuple):
    """A reduced state resolved through its param: the param's names and shape,
    and which of its dimensions the state kept (None: ambiguous)."""

    names: NameTuple
    shape: tuple[int, ...]
    dims: tuple[int, ...] | None


# eq=False: resolutions are shared between equal leaves and compared by identity;
# kw_only: the one way to build one names every field.
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Resolution:
    """The layout of one array, and the record of how it was reached.

    Attributes:
        layout: the `Layout`: the mesh spec, and the box's memory kind.
        names: the names resolved (None for an array in no box).
        logical: whether they are logical names.
        dims: per dimension, what it got and why (empty if the rank differs).
        fallback: why the whole array is replicated although boxed
            (PLACEHOLDER, FEWER_DIMENSIONS, AMBIGUOUS), or None.
        problem: a mistake to raise (all but the plan raise it), or None.
        kept: for a reduced state resolved through `params=`, where from.
        unmentioned: logical names that no rule mentions (left unsharded,
            as flax leaves them; flagged by the plan, an error when strict).
    """

    layout: Layout = Layout()
    names: NameTuple | None = None
    logical: bool = False
    dims: tuple[Dim, ...] = ()
    fallback: str | None = None
    problem: str | None = None
    kept: Kept | None = None
    unmentioned: tuple[str, ...] = ()

    @property
    def spec(self) -> PartitionSpec:
        """The mesh `PartitionSpec` (UNCONSTRAINED entries kept)."""
        return self.layout.spec

    @property
    def unmatched(self) -> tuple[str, ...]:
        """Logical names that no applicable rule mapped."""
        return tuple(
            d.name for d in self.dims if self.logical and type(d.name) is str and d.rule is None
        )

    @property
    def indivisible(self) -> tuple[int, ...]:
        """Dimensions left unsharded because the candidates' mesh axes do not divide them."""
        return tuple(i for i, d in enumerate(self.dims) if d.indivisible)

    @property
    def unsharded(self) -> tuple[int, ...]:
        """The dimensions asked to shard that end unsharded: the one test of both
        `UnshardedWarning` and ``strict=True``. Mesh axes of total size > 1 asked
        to shard them and do not divide them, and no later candidate served
        them; not a size-1 dimension (nothing to shard), a placeholder (no
        dimensions), or a reduced state resolved through params (its param's
        own dimension is the one to fix)."""
        if self.kept is not None or self.problem is not None:
            return ()
        return tuple(i for i in self.indivisible if self.dims[i].size != 1)

    def strict_problem(self) -> str | None:
        """Why ``strict=True`` refuses this resolution, or None."""
        if self.fallback == AMBIGUOUS:
            return (
                f"has names {self.names}, and which dimensions of its param it kept is "
                "ambiguous, so it would be replicated. Pass strict=False to replicate it."
            )
        if self.problem is None and self.unmentioned:
            return (
                f"has logical names {self.names}, and no rule mentions "
                f"{_quoted(self.unmentioned)}, so it would be left unsharded. Add "
                f"({self.unmentioned[0]!r}, None) to the rules to say it is replicated, or "
                "a rule that shards it, or pass strict=False."
            )
        if self.problem is not None or not self.unsharded:
            return self.problem
        first = self.unsharded[0]
        dim = self.dims[first]
        candidates = [p for p in dim.passed if p.reason == INDIVISIBLE]
        if candidates[0].rule is None:
            tried = f"mesh axes {candidates[0].axes!r} of total size {candidates[0].size}"
        else:
            listed = ", ".join(f"{p.axes!r}: size {p.size}" for p in candidates)
            tried = f"the mesh axes of every rule for it ({listed})"
        return (
            f"has names {self.names} and shape {tuple(d.size for d in self.dims)}: dimension "
            f"{first} ({dim.name!r}) has size {dim.size}, which {tried} do "
            "not divide, so it would be left unsharded. Pick a size the mesh axes divide, "
            "add a rule whose axes do, or pass strict=False to leave it unsharded."
        )


REPLICATED = Resolution()


def axes_of(entry: AxisName) -> tuple[str, ...]:
    """The mesh axis names an entry of a spec uses."""
    if isinstance(entry, str):
        return (entry,)
    return entry if isinstance(entry, tuple) else ()


def _not_in_mesh(axis: str, mesh_shape: MeshShape) -> str:
    """`axis` is not in the mesh: the mesh's axes, and the closest one if any is close."""
    axes = ", ".join(f"{name!r} (size {size})" for name, size in mesh_shape)
    close = difflib.get_close_matches(axis, [name for name, _ in mesh_shape], n=1, cutoff=0.5)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return f"mesh axis {axis!r}, which is not in the mesh; its axes are {axes}.{guess}"


def fewer_dimensions(names: NameTuple, shape: tuple[int, ...]) -> str:
    """Why a value with fewer dimensions than names cannot be resolved alone, and the fixes."""
    return (
        f"has {len(names)} names {names} for a value of shape {shape}, which has "
        "fewer dimensions. Either it is a param stacked over layers seen inside a "
        "plain jax.lax.scan or jax.vmap, whose names still include the stacked "
        "axis: use st.scan or st.vmap, or st.remove_axis(tree, 0, 'layers'); or it "
        "is a reduced optimizer state (adafactor, SM3): pass the params it came "
        "from with params=, or use st.optimizer_sharding."
    )


def resolve(
    names: NameTuple,
    shape: tuple[int, ...] | None,
    *,
    logical: bool,
    rules: RuleTuple,
    mesh_shape: MeshShape | None,
    layout: Layout = Layout(),
) -> Resolution:
    """How `names` resolve for an array of `shape` on a mesh of `mesh_shape`.

    Logical names go through `rules` by flax's priority algorithm; mesh axis
    names are taken as written. Without a mesh nothing about the mesh or the
    shape is checked; without a shape nothing about the shape is. The
    resolution's layout is `layout` (a box's: its memory kind) with the spec.

    Raises:
        Mistake: for names that cannot be right for this array on this mesh.
    """
    if shape is not None and len(shape) != len(names):
        fitted = fit_rank(names, len(shape), spec=False)  # all None: any rank, as JAX reads it
        if fitted is None or all(size == 1 for size in shape):
            return _rank_differs(names, shape, logical, layout)
        names = fitted
    sizes = None if mesh_shape is None else dict(mesh_shape)
    dims = [Dim(name, None if shape is None else shape[i], name) for i, name in enumerate(names)]
    unmentioned: tuple[str, ...] = ()
    if logical:
        _check_duplicates(names)
        _apply_rules(dims, rules, sizes, mesh_shape)
        if mesh_shape is not None:  # mesh-axis tuples among logical names are checked alike
            _check_mesh_axes(names, dims, sizes, mesh_shape, only=tuple)
        unmentioned = unmentioned_names(names, rules)
    else:
        _check_mesh_axes(names, dims, sizes, mesh_shape, only=object)
    spec = PartitionSpec(*(d.axes for d in dims))
    return Resolution(
        layout=layout.with_spec(spec),
        names=names,
        logical=logical,
        dims=tuple(dims),
        unmentioned=unmentioned,
    )


def unmentioned_names(names: NameTuple, rules: RuleTuple) -> tuple[str, ...]:
    """The logical names among `names` that no rule mentions."""
    mentioned = {name for name, _ in rules}
    return tuple(name for name in names if type(name) is str and name not in mentioned)


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names)


def flax_rules() -> RuleTuple:
    """The rules in flax's own logical-axis-rules context (``nn.logical_axis_rules``),
    read without importing flax: () unless flax is loaded and they are set."""
    spmd = sys.modules.get("flax.core.spmd")
    found = None if spmd is None else spmd.get_logical_axis_rules()
    return tuple((name, target) for name, target in found or ())


def check_mentioned(
    names: NameTuple, rules: RuleTuple, mesh_shape: MeshShape | None, *, box: bool = True
) -> None:
    """Logical names that cannot mean "replicated": none read without any rules
    in effect, and none that no rule mentions but that is an axis of the mesh.
    `box`: the names are a box's, which could have carried rules of its own.

    Raises:
        Mistake: naming the fix (and, if flax's own rules context holds rules,
            that spmdtree does not read it).
    """
    if not rules and any(type(name) is str for name in names):
        found = flax_rules()
        flax = (
            f" flax's rules context (nn.logical_axis_rules) holds {found!r}, but spmdtree "
            "does not read it: pass rules=nn.get_logical_axis_rules(), or use "
            "st.logical_axis_rules with the same rules."
            if found
            else ""
        )
        raise Mistake(
            ValueError,
            f"has logical names {names}, but no rules are in effect (no rules=, "
            f"{'none on the box, ' if box else ''}none set with st.logical_axis_rules), so "
            "nothing says how they map "
            "to mesh axes. Pass rules=[(name, mesh_axes), ...] or call it inside "
            f"`with st.logical_axis_rules(rules):`.{flax}",
        )
    axes = dict(mesh_shape or ())
    for name in unmentioned_names(names, rules):
        if name in axes:
            raise Mistake(
                ValueError,
                f"has logical names {names}, and {name!r}, which no rule mentions, is a "
                "mesh axis of this mesh: logical names go through rules. For mesh axis "
                f"names use st.Partitioned, or add the rule ({name!r}, {name!r}).",
            )


def resolve_leaf(
    names: NameTuple,
    shape: tuple[int, ...] | None,
    *,
    logical: bool,
    rules: RuleTuple,
    own: RuleTuple | None = None,
    mesh_shape: MeshShape | None,
    checked: bool = True,
    box: bool = True,
    layout: Layout = Layout(),
) -> Resolution:
    """How one leaf resolves: the one per-leaf step every entry point takes (the
    tree pass, constraints, a box's own sharding). Logical names go through the
    box's `own` rules, else `rules`, and are first checked (`check_mentioned`)
    unless not `checked` (a constraint without a mesh: single-device code);
    `layout` is the box's own, which the spec completes.

    Raises:
        Mistake: for names that cannot be right for this array on this mesh.
    """
    rules = rules if own is None else own
    if logical:
        saw(names)
    if logical and checked:
        check_mentioned(names, rules, mesh_shape, box=box)
    return resolve(names, shape, logical=logical, rules=rules, mesh_shape=mesh_shape, layout=layout)


class UnshardedWarning(UserWarning):
    """A dimension asked to be sharded is left unsharded: its mesh axes do not divide it.

    Emitted once per call (by `to_spec`, `to_sharding`, `to_abstract`, `shard`,
    `sharded_init`, `optimizer_sharding`, `constrain` and, at trace time,
    `with_logical_constraint`), naming how many dimensions and the first five.
    A ``(name, None)`` rule or a None entry says "replicated on purpose" and
    silences it; ``strict=True`` raises instead, where a function takes it;
    ``warnings.simplefilter("error", st.UnshardedWarning)`` makes it an error
    everywhere.

    Example:
        >>> import warnings, jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     spec = st.to_spec({"w": st.Partitioned(jnp.zeros(5), ("data",))}, mesh=mesh)
        >>> spec, caught[0].category.__name__
        ({'w': P(None,)}, 'UnshardedWarning')
    """


def warn_unsharded(found: Sequence[tuple[str, Resolution]]) -> None:
    """One `UnshardedWarning` for the leaves of a call (key path, resolution)
    with dimensions to warn of, at the user's line."""
    lines = [
        f"{where} dimension {i} ({res.dims[i].name!r}, size {res.dims[i].size}) over "
        + ", ".join(f"{p.axes!r} (size {p.size})" for p in res.dims[i].passed if p.size > 1)
        for where, res in found
        for i in res.unsharded
    ]
    if not lines:
        return
    more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
    warnings.warn(
        f"{len(lines)} {'dimension' if len(lines) == 1 else 'dimensions'} asked to be "
        f"sharded left unsharded, as their mesh axes do not divide them: "
        f"{'; '.join(lines[:5])}{more}. Pick sizes the axes divide, or a rule whose axes "
        "do; to say replicated on purpose, add (name, None) to the rules or give a None "
        "entry, which silences this.",
        UnshardedWarning,
        stacklevel=user_level(),
    )


def check_call(
    resolutions: Sequence[object],
    rules: RuleTuple,
    where: Callable[[int], str],
    *,
    noun: str,
    warn: bool,
) -> None:
    """The checks that take a whole call (the resolutions of its leaves, one per
    leaf; other items ignored): likely typos are raised, every wrong leaf
    named (``the {noun} at {where(i)}``) and collected; dimensions left
    unsharded are warned of once, if `warn`. `where` is called only for
    leaves to name.

    Raises:
        Mistake: for the leaves whose names hold a likely typo (`typos`).
    """
    found = typos(resolutions, rules)
    if found:
        raise_collected(
            [
                (called(noun, where(i)), Mistake(ValueError, found[res]))
                for i, res in enumerate(resolutions)
                if type(res) is Resolution and res in found
            ]
        )
    if warn and any(type(r) is Resolution and r.unsharded for r in set(resolutions)):
        warn_unsharded(
            [
                (where(i) or f"the {noun}", res)
                for i, res in enumerate(resolutions)
                if type(res) is Resolution and res.unsharded
            ]
        )


def one_edit(a: str, b: str) -> bool:
    """Whether `a` and `b` are one Damerau edit apart: one letter inserted,
    deleted or changed, or two neighbours swapped."""
    if len(a) != len(b):
        short, long = sorted((a, b), key=len)
        return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))
    differ = [i for i in range(len(a)) if a[i] != b[i]]
    if len(differ) != 2:
        return len(differ) == 1
    i, j = differ
    return j == i + 1 and a[i] == b[j] and a[j] == b[i]


#: Names shorter than this are never guessed at: short names (`'mlp'`, `'kv'`)
#: are one edit from too many others to say which was meant.
GUESSED_FROM = 4


def _typo_of(name: str, rules: RuleTuple) -> int | None:
    """The first rule whose logical name is one edit from `name` (both long enough)."""
    if len(name) < GUESSED_FROM:
        return None
    for index, (ruled, _) in enumerate(rules):
        if len(ruled) >= GUESSED_FROM and one_edit(name, ruled):
            return index
    return None


def typos(resolutions: Sequence[object], rules: RuleTuple) -> dict[Resolution, str]:
    """The resolutions of one call (one per leaf) that use a logical name no rule
    mentions while it is one edit from a name some rule mentions, each with the
    sentence that says so and which spelling is the likely typo: the one that
    nothing else in the call uses. Items that are not resolutions are ignored."""
    found: dict[Resolution, str] = {}
    uses: dict[str, int] | None = None
    for res in dict.fromkeys(r for r in resolutions if type(r) is Resolution):
        for name in res.unmentioned:
            index = _typo_of(name, rules)
            if index is None:
                continue
            if uses is None:  # counted once, and only where a typo is likely
                uses = _uses(resolutions)
            found[res] = _typo_sentence(name, index, rules[index][0], uses, res.names or ())
            break
    return found


def _uses(resolutions: Sequence[object]) -> dict[str, int]:
    """How many leaves of a call use each logical name."""
    uses: dict[str, int] = {}
    for res in resolutions:
        if type(res) is Resolution and res.logical:
            for name in set(res.names or ()):
                if type(name) is str:
                    uses[name] = uses.get(name, 0) + 1
    return uses


def _typo_sentence(
    name: str, index: int, ruled: str, uses: dict[str, int], names: NameTuple
) -> str:
    """The typo message of a leaf with `names`, which use `name`, one edit from
    `ruled` (rule `index`'s name); `uses` counts the call's leaves per name."""
    said = f"uses logical name {name!r}, which no rule mentions, one edit from {ruled!r}"
    own = (
        f"If {name!r} is a name of its own, add a rule for it: ({name!r}, None) to "
        "replicate it, or one that shards it."
    )
    if uses.get(ruled):
        others = uses[ruled] - (ruled in names)  # the leaf itself may use the rule's name too
        return (
            f"{said} of rule {index}, which {_others(others)} in this call. "
            f"Did you mean {ruled!r}? {own}"
        )
    if uses.get(name, 0) > 1:
        return (
            f"{said}, the name of rule {index}, which nothing in this call uses, while "
            f"{_leaves(uses[name])} {name!r}: the rule's name looks like the typo. Did "
            f"you mean to name rule {index} {name!r}? {own}"
        )
    return (
        f"{said}, the name of rule {index}, which nothing else in this call uses. "
        f"Did you mean {ruled!r}, or is the rule's name the typo? Fix one of them. {own}"
    )


def _leaves(n: int) -> str:
    return "1 leaf uses" if n == 1 else f"{n} leaves use"


def _others(n: int) -> str:
    """How many other leaves use a name: "no other leaf uses", "1 other leaf uses", ..."""
    return {0: "no other leaf uses", 1: "1 other leaf uses"}.get(n, f"{n} other leaves use")


def _rank_differs(
    names: NameTuple, shape: tuple[int, ...], logical: bool, layout: Layout
) -> Resolution:
    placeholder = all(size == 1 for size in shape)  # adafactor's (1,) for a scalar param
    if len(shape) > len(names) and not placeholder:
        raise Mistake(
            ValueError,
            f"has {len(names)} names {names} for a value of shape {shape}: the "
            "value has more dimensions than names, as after stacking it or a "
            "plain jax.vmap. Name the new axis: st.add_axis(tree, 0, 'layers'), "
            "or build it with st.vmap(..., partition_name='layers').",
        )
    replicated = layout.with_spec(PartitionSpec())
    if len(shape) < len(names) and not placeholder:
        problem = fewer_dimensions(names, shape)
        return Resolution(
            layout=replicated,
            names=names,
            logical=logical,
            fallback=FEWER_DIMENSIONS,
            problem=problem,
        )
    return Resolution(layout=replicated, names=names, logical=logical, fallback=PLACEHOLDER)


def _check_duplicates(names: NameTuple) -> None:
    strs = [name for name in names if isinstance(name, str)]
    for name in strs:
        if strs.count(name) > 1:
            raise Mistake(
                ValueError,
                f"has logical names {names} with {name!r} given twice; each logical "
                "name may name one dimension. Give the dimensions distinct names, "
                "e.g. ('embed', 'embed_out').",
            )


def _apply_rules(
    dims: list[Dim], rules: RuleTuple, sizes: dict[str, int] | None, mesh_shape: MeshShape | None
) -> None:
    """Flax's priority algorithm, with a mesh veto, recorded in `dims`.

    Rules are tried in order. A rule gives its mesh axes to its dimension only
    if the dimension is still unassigned and none of the axes is used yet (a
    tuple is all-or-nothing); a rule to None claims the dimension replicated.
    With a mesh, a rule naming an axis not in it is a mistake, and a rule whose
    axes do not divide the dimension is passed over for the next one.
    """
    names = [d.name for d in dims]
    open_ = {name: i for i, name in enumerate(names) if isinstance(name, str)}
    for i in open_.values():
        dims[i] = dims[i]._replace(axes=None)
    used = {axis: i for i, d in enumerate(dims) for axis in axes_of(d.axes)}
    for index, (name, target) in enumerate(rules):
        pos = open_.get(name)
        if pos is None:
            continue
        axes, dim = axes_of(target), dims[pos]
        missing = [axis for axis in axes if sizes is not None and axis not in sizes]
        if missing:
            raise Mistake(
                ValueError,
                f"has logical names {tuple(names)}, and rule {index} ({name!r}, {target!r}) "
                f"for {name!r} names {_not_in_mesh(missing[0], mesh_shape or ())} Fix the "
                "rule; a rule set shared across meshes gives every mesh all its axes "
                "(size 1 where unused).",
            )
        size = math.prod(sizes[axis] for axis in axes) if sizes is not None else 1
        clash = [axis for axis in axes if axis in used]
        if clash:
            passed = Passed(index, target, size, USED, used[clash[0]])
        elif dim.size is not None and dim.size % size:
            passed = Passed(index, target, size, INDIVISIBLE)
        else:
            dims[pos] = dim._replace(axes=target, rule=index)
            used.update(dict.fromkeys(axes, pos))
            del open_[name]
            continue
        dims[pos] = dim._replace(passed=(*dim.passed, passed))


def _check_mesh_axes(
    names: NameTuple,
    dims: list[Dim],
    sizes: dict[str, int] | None,
    mesh_shape: MeshShape | None,
    *,
    only: type,
) -> None:
    """Mesh-axis entries (of type `only`) checked: each axis in the mesh (if
    known) and used once; a dimension its axes do not divide is left unsharded."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not isinstance(name, only):
            continue
        for axis in axes_of(name):
            if sizes is not None and axis not in sizes:
                raise Mistake(
                    ValueError,
                    f"has names {names} with {_not_in_mesh(axis, mesh_shape or ())} Use one "
                    "of them, or LogicallyPartitioned with rules for names that are not "
                    "mesh axes.",
                )
            if axis in seen:
                raise Mistake(
                    ValueError,
                    f"has names {names}, which use mesh axis {axis!r} twice; a mesh axis "
                    "can shard only one dimension. Replace one use with None.",
                )
            seen.add(axis)
        size = math.prod(sizes[axis] for axis in axes_of(name)) if sizes is not None else 1
        length = dims[i].size
        if length is not None and length % size:
            dims[i] = dims[i]._replace(axes=None, passed=(Passed(None, name, size, INDIVISIBLE),))


# --- logical specs -----------------------------------------------------------------


class RulesFallback(enum.Enum):
    """What `with_logical_constraint` does with a logical name no rule maps.

    Attributes:
        AXIS_IS_UNSHARDED: leave that dimension unsharded (the default).
        RAISE_ERROR: raise a ValueError naming the unmatched logical name.
        NO_CONSTRAINT: leave the whole array unconstrained.

    Example:
        >>> import spmdtree as st
        >>> st.RulesFallback("raise_error")
        <RulesFallback.RAISE_ERROR: 'raise_error'>
    """

    AXIS_IS_UNSHARDED = "axis_is_unsharded"
    RAISE_ERROR = "raise_error"
    NO_CONSTRAINT = "no_constraint"


@public
def logical_to_mesh_axes(
    array_dim_names: Sequence[AxisName] | PartitionSpec | None,
    rules: Rules | None = None,
    *,
    shape: Sequence[int] | None = None,
    mesh: AnyMesh | None = None,
) -> PartitionSpec | None:
    """Maps logical dimension names to a mesh `PartitionSpec` through rules.

    Rules are tried in order of priority. A rule ``(name, mesh_axes)`` gives its
    mesh axes to the dimension called ``name`` if that dimension is still
    unassigned and none of the mesh axes is used yet (a tuple of axes is
    all-or-nothing); a rule to ``None`` claims its dimension as replicated.
    Names that no rule maps end unsharded; ``None`` and ``UNCONSTRAINED`` entries
    pass through. For every input flax.linen accepts the result equals its.

    With `shape` and `mesh` (both or neither) it is shape-aware like `to_spec`:
    the spec for an activation of that shape, e.g. for ``out_sharding=`` of a
    matmul on Explicit mesh axes.

    Args:
        array_dim_names: one logical name per dimension, or None.
        rules: the rules; defaults to the rules context.
        shape: the shape of the array the names describe.
        mesh: the mesh (or abstract mesh) the spec is for.

    Returns:
        The mesh `PartitionSpec`, or None if `array_dim_names` is None.

    Raises:
        ValueError: if a logical name is given twice; with a mesh, if a rule
            the names reach names an axis not in the mesh, or the names do not
            fit `shape`.
        TypeError: if a name or rule is malformed, or only one of `shape`
            and `mesh` is given.

    Example:
        >>> import jax, spmdtree as st
        >>> rules = [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")]
        >>> st.logical_to_mesh_axes(("batch", "length", "heads", "features"), rules)
        P('X', None, 'Y', None)
        >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
        >>> rules = [("batch", "data"), ("mlp", "model")]
        >>> st.logical_to_mesh_axes(("batch", "mlp"), rules, shape=(8, 6), mesh=mesh)
        P('data', None)
    """
    if array_dim_names is None:
        return None
    if (shape is None) != (mesh is None):
        raise Mistake(
            TypeError,
            "give shape= and mesh= together (a shape-aware spec) or neither (flax's "
            f"spec); got only {'shape' if mesh is None else 'mesh'}=.",
        )
    check_mesh(mesh, optional=True)
    normal = rules_or_context(rules)
    try:
        names = normalize_names(array_dim_names, "logical names")
        if shape is not None and len(tuple(shape)) != len(names):
            raise Mistake(
                ValueError,
                f"{names} names {len(names)} dimensions, but shape= is {tuple(shape)}. "
                "Give one name per dimension (None for a replicated one).",
            )
        mesh_shape = None if mesh is None else mesh_shape_of(mesh)
        sized = None if shape is None else tuple(shape)
        return resolve(names, sized, logical=True, rules=normal, mesh_shape=mesh_shape).spec
    except Mistake as mistake:
        raise Mistake(mistake.kind, f"the spec {mistake.message}") from None


def is_logical_spec(x: object) -> TypeGuard[PartitionSpec | NameTuple]:
    """Whether `x` is a logical spec: a PartitionSpec or a flat tuple of names."""
    return isinstance(x, PartitionSpec) or (
        type(x) is tuple and all(e is None or e is UNCONSTRAINED or isinstance(e, str) for e in x)
    )


def spec_names(spec: object, *, none: bool = False) -> NameTuple:
    """A logical spec's names, normalised.

    Raises:
        Mistake: (TypeError) for anything but a logical spec (or None, if `none`).
    """
    if not is_logical_spec(spec):
        raise Mistake(
            TypeError,
            f"is {fmt(spec)}; expected a logical spec: a PartitionSpec or a tuple of "
            "logical names such as ('batch', 'embed')" + (", or None." if none else "."),
        )
    return normalize_names(tuple(spec), "logical names")


def walk_specs(
    tree: PyTree, argument: str, *, none: bool = False
) -> tuple[list[tuple[Any, NameTuple | None]], Any, list[tuple[str, Mistake]]]:
    """The one walk over a tree of logical specs: each spec's key path and names
    (None for a None spec, where `none` lets a None stand for "leave it alone",
    and for a wrong one), the tree's structure, and the mistakes, each said of
    its key path under the name `argument`."""
    is_spec = (lambda s: s is None or is_logical_spec(s)) if none else is_logical_spec
    found, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    specs: list[tuple[Any, NameTuple | None]] = []
    problems: list[tuple[str, Mistake]] = []
    for path, spec in found:
        names = None
        try:
            names = None if spec is None else spec_names(spec, none=none)
        except Mistake as mistake:
            problems.append((f"the spec at {at(argument, path)}", mistake))
        specs.append((path, names))
    return specs, treedef, problems


def _map_specs(tree: PyTree, rules: Rules | None, mesh: AnyMesh | None) -> PyTree:
    """Each logical spec of `tree` resolved (on `mesh`, if given)."""
    normal = rules_or_context(rules)
    mesh_shape = None if mesh is None else mesh_shape_of(mesh)
    specs, treedef, problems = walk_specs(tree, "tree")
    out = []
    for path, names in specs:
        try:
            found = resolve(names or (), None, logical=True, rules=normal, mesh_shape=mesh_shape)
            out.append(found.spec if mesh is None else named_sharding(mesh, found.layout))
        except Mistake as mistake:
            problems.append((f"the spec at {at('tree', path)}", mistake))
    raise_collected(problems)
    return jax.tree.unflatten(treedef, out)


@public
def logical_to_mesh(tree: PyTree, rules: Rules | None = None) -> PyTree:
    """Applies `logical_to_mesh_axes` to every logical spec in a tree.

    Args:
        tree: a tree whose leaves are logical specs: `PartitionSpec`s or tuples
            of names such as ``("batch", "embed")``; None entries stay None.
        rules: the rules; defaults to the rules context.

    Returns:
        The same tree with a mesh `PartitionSpec` per spec.

    Raises:
        ValueError: if a spec gives a logical name twice.
        TypeError: if a leaf is not a logical spec.

    Example:
        >>> import spmdtree as st
        >>> st.logical_to_mesh({"x": ("batch", "embed")}, [("batch", "data")])
        {'x': P('data', None)}
    """
    return _map_specs(tree, rules, None)


@public
def logical_to_mesh_sharding(tree: PyTree, mesh: Mesh, rules: Rules | None = None) -> PyTree:
    """Maps a tree of logical specs to `NamedSharding`s on `mesh`.

    A rule that a spec reaches and that names an axis not in `mesh` is an
    error; a rule set shared across meshes gives every mesh all its axes
    (size 1 where unused).

    Args:
        tree: a tree of logical specs, as for `logical_to_mesh`.
        mesh: the device mesh.
        rules: the rules; defaults to the rules context.

    Returns:
        The same tree with a `NamedSharding` per spec.

    Raises:
        ValueError: if a spec gives a logical name twice, or reaches a rule
            naming an axis not in `mesh`.
        TypeError: if a leaf is not a logical spec or `mesh` is not a Mesh.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> s = st.logical_to_mesh_sharding({"x": ("batch", None)}, mesh, [("batch", "data")])
        >>> s["x"].spec
        P('data', None)
    """
    check_mesh(mesh)
    return _map_specs(tree, rules, mesh)
