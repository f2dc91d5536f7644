"""Logical axis rules: normalisation, the rules context and name resolution.

A rule maps a logical name (``"embed"``) to mesh axes (``"fsdp"``, a tuple of
axes, ``None`` for replicated, or ``PartitionSpec.UNCONSTRAINED``). Names and
rules are normalised to tuples where they are given, so equal metadata is equal
(and hashes equal) however it was written, and a jitted function never
retraces because a list became a tuple.

This module works on names, shapes and meshes only; the tree functions in
`spmdtree.specs` and `spmdtree.constraints` call `resolve` once per leaf.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import enum
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdtree.errors import LeafError, at, fmt, raise_collected

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED

#: One entry of a names tuple: a name, ``None``, a tuple of mesh axes, or
#: ``PartitionSpec.UNCONSTRAINED``.
AxisName: TypeAlias = Any
#: The names of an array's dimensions, one entry per dimension.
Names: TypeAlias = tuple[AxisName, ...]
#: Normalised rules: ``((logical_name, mesh_axes), ...)``.
Rules: TypeAlias = tuple[tuple[str, Any], ...]
#: Rules as a user may give them: pairs in a list or tuple, or a mapping.
RulesLike: TypeAlias = Sequence[Sequence[Any]] | Mapping[str, Any]
#: A mesh or an abstract mesh: anything with axis names and sizes.
AnyMesh: TypeAlias = Mesh | jax.sharding.AbstractMesh

__all__ = [
    "RulesFallback",
    "get_logical_axis_rules",
    "logical_axis_rules",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "set_logical_axis_rules",
]

_NAME_HELP = (
    "Each entry names one dimension: a str, None (replicated), a tuple of str "
    "(one dimension over several mesh axes) or PartitionSpec.UNCONSTRAINED."
)


# --- normalisation ---------------------------------------------------------


def _axis_tuple(entry: Sequence[Any]) -> tuple[str, ...] | None:
    """`entry` as a tuple of str, or None if it holds anything else."""
    entry = tuple(entry)
    return entry if all(isinstance(axis, str) for axis in entry) else None


def normalize_names(names: Any, what: str = "names") -> Names:
    """`names` as a tuple whose entries are str, None, tuples of str or UNCONSTRAINED.

    Raises:
        LeafError: (TypeError) for anything else, naming the bad entry.
    """
    if type(names) is tuple and all(n is None or type(n) is str for n in names):
        return names  # the common case, already normal
    if isinstance(names, str) or not isinstance(names, (tuple, list, PartitionSpec)):
        raise LeafError(
            TypeError,
            f"has {what} {fmt(names)}; expected a tuple with one entry per "
            f"dimension, e.g. ('data', None). {_NAME_HELP}",
        )
    out: list[Any] = []
    for i, entry in enumerate(names):
        if entry is None or entry is UNCONSTRAINED or isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, (tuple, list)) and _axis_tuple(entry) is not None:
            out.append(tuple(entry))
        else:
            raise LeafError(
                TypeError,
                f"has {what} {fmt(tuple(names))} whose entry {i} is {fmt(entry)}. " + _NAME_HELP,
            )
    return tuple(out)


def _normalize_mesh_axes(logical: str, mesh_axes: Any, index: int) -> Any:
    if mesh_axes is None or mesh_axes is UNCONSTRAINED or isinstance(mesh_axes, str):
        return mesh_axes
    if isinstance(mesh_axes, (tuple, list)) and _axis_tuple(mesh_axes) is not None:
        if len(set(mesh_axes)) != len(mesh_axes):
            raise LeafError(
                ValueError,
                f"rule {index} maps {logical!r} to {tuple(mesh_axes)!r}, which names a "
                "mesh axis twice; a mesh axis can shard a dimension once. Name each "
                "axis once.",
            )
        return tuple(mesh_axes)
    raise LeafError(
        TypeError,
        f"rule {index} maps {logical!r} to {fmt(mesh_axes)}; a rule maps a logical "
        "name to a mesh axis name, a tuple of mesh axis names, None (replicated) or "
        f"PartitionSpec.UNCONSTRAINED. Write it as ({logical!r}, 'data') or "
        f"({logical!r}, ('fsdp', 'tensor')).",
    )


@functools.lru_cache(maxsize=256)
def _normalize_rules_cached(rules: Rules) -> Rules:
    return _normalize_rules(rules)


def normalize_rules(rules: Any, function: str = "rules") -> Rules:
    """`rules` as a tuple of ``(str, mesh_axes)`` pairs, mesh axes normalised.

    A mapping is taken in its order; lists become tuples.

    Raises:
        TypeError: from `function`, naming the first malformed rule and how to
            write it; ValueError for a rule that names a mesh axis twice.
    """
    try:
        if type(rules) is tuple:
            try:
                return _normalize_rules_cached(rules)
            except TypeError:  # unhashable entries: normalise without the cache
                pass
        return _normalize_rules(rules)
    except LeafError as e:
        raise e.kind(f"{function}: {e.detail}") from None


def _normalize_rules(rules: Any) -> Rules:
    if isinstance(rules, (Mesh, jax.sharding.AbstractMesh)):
        raise LeafError(
            TypeError,
            f"rules are a mesh, {fmt(rules)}, given where rules go. Pass the mesh "
            "as mesh= (and rules, if any, as rules=), e.g. "
            "st.to_spec(tree, rules, mesh=mesh).",
        )
    if isinstance(rules, Mapping):
        rules = tuple(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, (tuple, list)):
        raise LeafError(
            TypeError,
            f"rules are {fmt(rules)}; expected a sequence of (logical_name, mesh_axes) "
            "pairs or a mapping. Write e.g. [('batch', 'data'), ('embed', 'fsdp')].",
        )
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, (str, bytes)) or not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise LeafError(
                TypeError,
                f"rule {i} is {fmt(rule)}; each rule is a pair (logical_name, "
                "mesh_axes), e.g. ('embed', 'fsdp').",
            )
        logical, mesh_axes = rule
        if not isinstance(logical, str):
            raise LeafError(
                TypeError,
                f"rule {i} is {fmt(tuple(rule))}, whose logical name {fmt(logical)} is "
                "not a str. Logical names are str, e.g. ('embed', 'fsdp').",
            )
        out.append((logical, _normalize_mesh_axes(logical, mesh_axes, i)))
    return tuple(out)


# --- the rules context -------------------------------------------------------

# A ContextVar, not a thread-local: nested contexts restore on exit, and threads
# and asyncio tasks each see only the rules set in their own context.
_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("spmdtree_rules", default=())


@contextlib.contextmanager
def logical_axis_rules(rules: RulesLike) -> Iterator[Rules]:
    """Sets the logical axis rules for the body of a ``with`` statement.

    The previous rules come back on exit, also when the body raises. Rules are
    read when a function is traced: a jitted function does not retrace when the
    context changes later, so pass ``rules=`` explicitly where that matters.

    Args:
        rules: ``(logical_name, mesh_axes)`` pairs, or a mapping.

    Yields:
        The normalised rules.

    Raises:
        TypeError: if a rule is malformed.

    Example:
        >>> import spmdtree as st
        >>> with st.logical_axis_rules([("batch", "data")]):
        ...     st.get_logical_axis_rules()
        (('batch', 'data'),)
        >>> st.get_logical_axis_rules()
        ()
    """
    normal = normalize_rules(rules, "logical_axis_rules")
    token = _RULES.set(normal)
    try:
        yield normal
    finally:
        _RULES.reset(token)


def set_logical_axis_rules(rules: RulesLike) -> None:
    """Sets the logical axis rules of the current context until changed again.

    Prefer `logical_axis_rules` (scoped) or passing ``rules=`` to each function.
    A new thread starts with no rules; an asyncio task starts with a copy of the
    rules of the code that created it.

    Args:
        rules: ``(logical_name, mesh_axes)`` pairs, or a mapping; ``()`` clears.

    Raises:
        TypeError: if a rule is malformed.

    Example:
        >>> import spmdtree as st
        >>> st.set_logical_axis_rules({"embed": "fsdp"})
        >>> st.get_logical_axis_rules()
        (('embed', 'fsdp'),)
        >>> st.set_logical_axis_rules(())
    """
    _RULES.set(normalize_rules(rules, "set_logical_axis_rules"))


def get_logical_axis_rules() -> Rules:
    """Returns the logical axis rules of the current context (``()`` if unset).

    Example:
        >>> import spmdtree as st
        >>> st.get_logical_axis_rules()
        ()
    """
    return _RULES.get()


def rules_or_context(rules: Any, function: str = "rules") -> Rules:
    """`rules` normalised, or the context's rules when `rules` is None."""
    return _RULES.get() if rules is None else normalize_rules(rules, function)


# --- resolution ----------------------------------------------------------------


class _Unassigned:
    """A logical dimension that no rule has mapped yet."""

    def __repr__(self) -> str:
        return "UNASSIGNED"


UNASSIGNED: Any = _Unassigned()


def mesh_axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axis names an entry of a spec uses."""
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return entry
    return ()


def check_duplicate_names(names: Names) -> None:
    """Raises a LeafError if a logical name names two dimensions."""
    seen: set[str] = set()
    for name in names:
        if isinstance(name, str):
            if name in seen:
                raise LeafError(
                    ValueError,
                    f"has logical names {names} with {name!r} given twice; each "
                    "logical name may name one dimension. Give the dimensions "
                    "distinct names, e.g. ('embed', 'embed_out').",
                )
            seen.add(name)


def assign(names: Names, rules: Rules, fits: Any = None, check: Any = None) -> list[Any]:
    """The priority algorithm: which mesh axes each logical dimension gets.

    Rules are tried in order. A rule gives its mesh axes to its dimension only if
    the dimension is still unassigned and none of the mesh axes is used yet (a
    tuple is all-or-nothing); a rule to None claims the dimension replicated.
    `fits(position, mesh_axes)`, if given, can veto a rule for this array (a
    size that does not divide); a vetoed rule is skipped as if absent, so a
    later rule for the same name may apply. `check(index, position,
    mesh_axes)`, if given, sees every rule that reaches a dimension (and may
    raise: a mesh axis not in the mesh).
    Entries that are not str pass through; unmatched names stay UNASSIGNED.
    """
    check_duplicate_names(names)
    result: list[Any] = [UNASSIGNED if isinstance(n, str) else n for n in names]
    used = {axis for entry in result for axis in mesh_axes_of(entry)}
    position = {name: i for i, name in enumerate(names) if isinstance(name, str)}
    for index, (logical, mesh_axes) in enumerate(rules):
        pos = position.get(logical)
        if pos is None or result[pos] is not UNASSIGNED:
            continue
        axes = mesh_axes_of(mesh_axes)
        if check is not None:
            check(index, pos, mesh_axes)
        if used.intersection(axes) or (fits is not None and not fits(pos, mesh_axes)):
            continue
        result[pos] = mesh_axes
        used.update(axes)
    return result


# eq=False: a Resolution is hashed and compared by identity, which is cheap, and
# resolutions are shared (cached), so identity is what callers' memos need.
@dataclasses.dataclass(frozen=True, eq=False)
class Resolution:
    """The mesh spec of one array, and how it was reached.

    Attributes:
        spec: the mesh `PartitionSpec` (UNCONSTRAINED entries kept).
        unmatched: logical names that no applicable rule mapped.
        indivisible: dimensions left unsharded because their mesh axes do not
            divide them.
        rank_fallback: the value has fewer dimensions than names (or only
            size-1 ones), so it is replicated.
        problem: why that replication is a mistake (fewer dimensions than
            names, not all of size 1), for callers that raise it.
        names: the names it was resolved from (None for an unboxed array).
        logical: whether those names are logical names.
    """

    spec: PartitionSpec
    unmatched: tuple[str, ...] = ()
    indivisible: tuple[int, ...] = ()
    rank_fallback: bool = False
    problem: str | None = None
    names: Names | None = None
    logical: bool = False


def _mesh_help(mesh_shape: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{name!r} (size {size})" for name, size in mesh_shape)


def _not_in_mesh(axis: str, mesh_shape: tuple[tuple[str, int], ...]) -> str:
    """`axis` is not in the mesh: the mesh's axes, and the closest one if any is close."""
    close = difflib.get_close_matches(axis, [name for name, _ in mesh_shape], n=1, cutoff=0.5)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"mesh axis {axis!r}, which is not in the mesh; its axes are "
        f"{_mesh_help(mesh_shape)}.{guess}"
    )


def _size(sizes: dict[str, int], entry: Any) -> int:
    return math.prod(sizes[axis] for axis in mesh_axes_of(entry))


def _rank_problem(names: Names, shape: tuple[int, ...]) -> Resolution | None:
    if len(shape) > len(names) and any(size != 1 for size in shape):
        raise LeafError(
            ValueError,
            f"has {len(names)} names {names} for a value of shape {shape}: the "
            "value has more dimensions than names, as after stacking it or a "
            "plain jax.vmap. Name the new axis: st.add_axis(tree, 0, 'layers'), "
            "or build it with st.vmap(..., partition_name='layers').",
        )
    if len(shape) != len(names) and any(size != 1 for size in shape):
        # Replicated only where the caller accepts it (describe flags it).
        problem = fewer_dimensions(names, shape)
        return Resolution(PartitionSpec(), rank_fallback=True, problem=problem)
    if len(shape) != len(names):
        # Only dimensions of size 1 (a placeholder such as adafactor's for a
        # scalar param): replicating it is always right.
        return Resolution(PartitionSpec(), rank_fallback=True)
    return None


def fewer_dimensions(names: Names, shape: tuple[int, ...]) -> str:
    """Why a value with fewer dimensions than names cannot be resolved alone, and the fixes."""
    return (
        f"has {len(names)} names {names} for a value of shape {shape}, which has "
        "fewer dimensions. Either it is a param stacked over layers seen inside a "
        "plain jax.lax.scan or jax.vmap, whose names still include the stacked "
        "axis: use st.scan or st.vmap, or st.remove_axis(tree, 0, 'layers'); or it "
        "is a reduced optimizer state (adafactor, SM3): pass the params it came "
        "from with params=, or use st.optimizer_sharding."
    )


def _check_mesh_axes(
    entries: Names, mesh_shape: tuple[tuple[str, int], ...] | None, names: Names
) -> None:
    """Every mesh axis of `entries` is in the mesh (if known) and used once.

    `names` are the box's names, as the message shows them.
    """
    seen: set[str] = set()
    for entry in entries:
        for axis in mesh_axes_of(entry):
            if mesh_shape is not None and axis not in dict(mesh_shape):
                raise LeafError(
                    ValueError,
                    f"has names {names} with {_not_in_mesh(axis, mesh_shape)} Use "
                    "one of them, or LogicallyPartitioned with rules for names that "
                    "are not mesh axes.",
                )
            if axis in seen:
                raise LeafError(
                    ValueError,
                    f"has names {names}, which use mesh axis {axis!r} twice; a mesh "
                    "axis can shard only one dimension. Replace one use with None.",
                )
            seen.add(axis)


@functools.lru_cache(maxsize=65536)
def resolve(
    names: Names,
    shape: tuple[int, ...] | None,
    logical: bool,
    rules: Rules,
    mesh_shape: tuple[tuple[str, int], ...] | None,
    strict: bool = False,
) -> Resolution:
    """The mesh spec for an array with `names`, `shape` on a mesh of `mesh_shape`.

    `logical` says whether `names` are logical names (resolved through `rules`)
    or mesh axis names. Without a mesh (`mesh_shape` None) nothing about the
    mesh is checked; without a shape nothing about the shape is.
    Cached: the same (names, shape, rules, mesh) is resolved once.

    Raises:
        LeafError: for names that cannot be right for this array on this mesh.
    """
    found = _resolve(names, shape, logical, rules, mesh_shape, strict)
    return dataclasses.replace(found, names=names, logical=logical)


def _resolve(
    names: Names,
    shape: tuple[int, ...] | None,
    logical: bool,
    rules: Rules,
    mesh_shape: tuple[tuple[str, int], ...] | None,
    strict: bool,
) -> Resolution:
    if shape is not None:
        fallback = _rank_problem(names, shape)
        if fallback is not None:
            return fallback
    if not logical:
        entries, indivisible = _fit_mesh_axes(names, names, shape, mesh_shape, strict)
        return Resolution(PartitionSpec(*entries), indivisible=indivisible)
    sizes = dict(mesh_shape) if mesh_shape is not None else None
    tried: set[int] = set()

    def check(index: int, pos: int, mesh_axes: Any) -> None:
        missing = [axis for axis in mesh_axes_of(mesh_axes) if axis not in (sizes or ())]
        if sizes is not None and missing:
            raise LeafError(
                ValueError,
                f"has logical names {names}, and rule {index} ({names[pos]!r}, "
                f"{mesh_axes!r}) for {names[pos]!r} names "
                f"{_not_in_mesh(missing[0], mesh_shape or ())} Fix the rule; a rule "
                "set shared across meshes gives every mesh all its axes (size 1 "
                "where unused).",
            )

    def fits(pos: int, mesh_axes: Any) -> bool:
        if sizes is None:
            return True
        if shape is not None and shape[pos] % _size(sizes, mesh_axes) != 0:
            tried.add(pos)
            return False
        return True

    result = assign(names, rules, fits, check)
    literal_indivisible: tuple[int, ...] = ()
    if mesh_shape is not None:
        # Entries that are already mesh axes (tuples among logical names) pass
        # through the rules; on a mesh they are checked like a Partitioned's.
        # (Without one, the result stays flax's, as logical_to_mesh_axes promises.)
        only_literal = tuple(n if isinstance(n, tuple) else None for n in names)
        literal, literal_indivisible = _fit_mesh_axes(
            names, only_literal, shape, mesh_shape, strict
        )
        result = [
            lit if isinstance(n, tuple) else r
            for n, r, lit in zip(names, result, literal, strict=True)
        ]
    unmatched = tuple(names[i] for i, r in enumerate(result) if r is UNASSIGNED)
    indivisible = tuple(i for i in sorted(tried) if result[i] is UNASSIGNED)
    if strict and indivisible:
        raise _indivisible_error(names, shape, sizes, indivisible[0], rules)
    spec = PartitionSpec(*(None if r is UNASSIGNED else r for r in result))
    return Resolution(spec, unmatched, tuple(sorted(indivisible + literal_indivisible)))


def _fit_mesh_axes(
    names: Names,
    entries: Names,
    shape: tuple[int, ...] | None,
    mesh_shape: tuple[tuple[str, int], ...] | None,
    strict: bool,
) -> tuple[list[Any], tuple[int, ...]]:
    """Mesh-axis `entries` checked against the mesh: known axes, each used once.

    A dimension its axes do not divide becomes None (an error with `strict`).
    Returns the entries and the dimensions left unsharded that way.
    """
    _check_mesh_axes(entries, mesh_shape, names)
    entries_out = list(entries)
    if mesh_shape is None or shape is None:
        return entries_out, ()
    sizes = dict(mesh_shape)
    indivisible = tuple(i for i, entry in enumerate(entries) if shape[i] % _size(sizes, entry) != 0)
    if strict and indivisible:
        raise _indivisible_error(names, shape, sizes, indivisible[0])
    for i in indivisible:
        entries_out[i] = None
    return entries_out, indivisible


def _indivisible_error(
    names: Names, shape: Any, sizes: Any, dim: int, rules: Rules | None = None
) -> LeafError:
    if rules is None:
        tried = f"mesh axes {names[dim]!r} of total size {_size(sizes, names[dim])}"
    else:
        candidates = [axes for name, axes in rules if name == names[dim]]
        tried = (
            "the mesh axes of every rule for it ("
            + ", ".join(f"{axes!r}: size {_size(sizes, axes)}" for axes in candidates)
            + ")"
        )
    return LeafError(
        ValueError,
        f"has names {names} and shape {tuple(shape)}: dimension {dim} "
        f"({names[dim]!r}) has size {shape[dim]}, which {tried} do not divide, "
        "so it would be left unsharded. Pick a size the mesh axes divide, add a "
        "rule whose axes do, or pass strict=False to leave it unsharded.",
    )


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


def logical_to_mesh_axes(
    array_dim_names: Sequence[AxisName] | PartitionSpec | None,
    rules: RulesLike | None = None,
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
        raise TypeError(
            "logical_to_mesh_axes: give shape= and mesh= together (a shape-aware "
            "spec) or neither (flax's spec); got only "
            f"{'shape' if mesh is None else 'mesh'}=."
        )
    check_mesh("logical_to_mesh_axes", mesh, optional=True)
    try:
        names = normalize_names(array_dim_names, "logical names")
        normal = rules_or_context(rules, "logical_to_mesh_axes")
        if shape is not None and len(tuple(shape)) != len(names):
            raise LeafError(
                ValueError,
                f"{names} names {len(names)} dimensions, but shape= is "
                f"{tuple(shape)}. Give one name per dimension (None for a "
                "replicated one).",
            )
        mesh_shape = None if mesh is None else mesh_shape_of(mesh)
        found = resolve(names, None if shape is None else tuple(shape), True, normal, mesh_shape)
        return found.spec
    except LeafError as e:
        raise e.kind(f"logical_to_mesh_axes: the spec {e.detail}") from None


def is_logical_spec(x: Any) -> bool:
    """Whether `x` is a logical spec: a PartitionSpec or a flat tuple of names."""
    return isinstance(x, PartitionSpec) or (
        type(x) is tuple and all(e is None or e is UNCONSTRAINED or isinstance(e, str) for e in x)
    )


def _map_specs(function: str, fn: Any, tree: Any) -> Any:
    paths_specs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_logical_spec)
    out, problems = [], []
    for path, spec in paths_specs:
        try:
            if not is_logical_spec(spec):
                raise LeafError(
                    TypeError,
                    f"is {fmt(spec)}; expected a logical spec: a PartitionSpec or "
                    "a tuple of logical names such as ('batch', 'embed').",
                )
            out.append(fn(normalize_names(tuple(spec), "logical names")))
        except LeafError as e:
            problems.append((f"the spec at {at('tree', path)}", e))
    raise_collected(function, problems)
    return jax.tree.unflatten(treedef, out)


def logical_to_mesh(tree: Any, rules: RulesLike | None = None) -> Any:
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
    normal = rules_or_context(rules, "logical_to_mesh")
    return _map_specs(
        "logical_to_mesh", lambda names: resolve(names, None, True, normal, None).spec, tree
    )


def mesh_shape_of(mesh: AnyMesh) -> tuple[tuple[str, int], ...]:
    """The ``((axis, size), ...)`` of a mesh, hashable for caches."""
    return tuple(mesh.shape.items())


@functools.lru_cache(maxsize=4096)
def named_sharding(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """A `NamedSharding`, made once per (mesh, spec).

    UNCONSTRAINED entries become None: `jax.jit` and `jax.device_put` do not
    accept them in a sharding (only constraints do).
    """
    if any(entry is UNCONSTRAINED for entry in spec):
        spec = PartitionSpec(*(None if e is UNCONSTRAINED else e for e in spec))
    return NamedSharding(mesh, spec)


def logical_to_mesh_sharding(tree: Any, mesh: Mesh, rules: RulesLike | None = None) -> Any:
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
    check_mesh("logical_to_mesh_sharding", mesh)
    normal, mesh_shape = rules_or_context(rules, "logical_to_mesh_sharding"), mesh_shape_of(mesh)
    return _map_specs(
        "logical_to_mesh_sharding",
        lambda names: named_sharding(mesh, resolve(names, None, True, normal, mesh_shape).spec),
        tree,
    )


def check_mesh(function: str, mesh: Any, *, optional: bool = False) -> None:
    """Raises a TypeError unless `mesh` is a Mesh (or None, if optional)."""
    if mesh is None and optional:
        return
    if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(
            f"{function}: mesh is {fmt(mesh)}; expected a jax.sharding.Mesh, e.g. "
            "jax.make_mesh((2, 4), ('data', 'model'))."
        )
    if mesh.empty:
        raise ValueError(
            f"{function}: mesh {mesh} has no axes; build one with "
            "jax.make_mesh((2, 4), ('data', 'model'))."
        )
