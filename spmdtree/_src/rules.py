"""Names and logical axis rules: normalisation, and the rules context.

A rule maps a logical name (``"embed"``) to mesh axes (``"fsdp"``, a tuple of
axes, ``None`` for replicated, or ``PartitionSpec.UNCONSTRAINED``). Names and
rules are normalised to tuples where they are given, so equal metadata is equal
(and hashes equal) however it was written, and a jitted function never
retraces because a list became a tuple. Resolution, which turns names into a
mesh spec, is `resolve`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import jax
from jax.sharding import Mesh, PartitionSpec

from spmdtree._src.errors import Mistake, fmt, public

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED

if TYPE_CHECKING:
    from jax._src.partition_spec import UnconstrainedSingleton as Unconstrained
else:
    Unconstrained = type(UNCONSTRAINED)

#: The mesh axes of one dimension: a mesh axis, a tuple of them (major first),
#: or ``None`` (replicated).
MeshAxes: TypeAlias = str | tuple[str, ...] | None
#: One entry of a names tuple: what `MeshAxes` can be (a logical name in place
#: of a mesh axis for logical boxes), or ``PartitionSpec.UNCONSTRAINED``.
AxisName: TypeAlias = str | tuple[str, ...] | Unconstrained | None
#: The names of an array's dimensions as a user writes them, one entry per
#: dimension: a tuple (or list, or `PartitionSpec`) of `AxisName`.
Names: TypeAlias = Sequence[AxisName] | PartitionSpec
#: Names normalised: a tuple, tuples of axes as tuples.
NameTuple: TypeAlias = tuple[AxisName, ...]
#: Rules as a user writes them: ``(logical_name, mesh_axes)`` pairs in priority
#: order, or a mapping taken in its order (mesh axes as a list are taken too).
Rules: TypeAlias = (
    Sequence[tuple[str, AxisName | Sequence[str]]] | Mapping[str, AxisName | Sequence[str]]
)
#: Rules normalised: ``((logical_name, mesh_axes), ...)``.
RuleTuple: TypeAlias = tuple[tuple[str, AxisName], ...]
#: A pytree: any nesting of containers and leaves; its type says no more, as
#: in JAX's own signatures.
PyTree: TypeAlias = Any
#: A mesh or an abstract mesh: anything with axis names and sizes.
AnyMesh: TypeAlias = Mesh | jax.sharding.AbstractMesh
#: A mesh's ``((axis, size), ...)``.
MeshShape: TypeAlias = tuple[tuple[str, int], ...]

_NAME_HELP = (
    "Each entry names one dimension: a str, None (replicated), a tuple of str "
    "(one dimension over several mesh axes) or PartitionSpec.UNCONSTRAINED."
)


# --- normalisation ---------------------------------------------------------


def _axis_tuple(entry: object) -> TypeGuard[Sequence[str]]:
    return isinstance(entry, (tuple, list)) and all(isinstance(axis, str) for axis in entry)


def normalize_names(names: object, what: str = "names") -> NameTuple:
    """`names` as a tuple whose entries are str, None, tuples of str or UNCONSTRAINED.

    Raises:
        Mistake: (TypeError) for anything else, naming the bad entry.
    """
    if type(names) is tuple and all(n is None or type(n) is str for n in names):
        return names  # the common case, already normal
    if isinstance(names, str) or not isinstance(names, (tuple, list, PartitionSpec)):
        raise Mistake(
            TypeError,
            f"has {what} {fmt(names)}; expected a tuple with one entry per "
            f"dimension, e.g. ('data', None). {_NAME_HELP}",
        )
    out: list[Any] = []
    for i, entry in enumerate(names):
        if entry is None or entry is UNCONSTRAINED or isinstance(entry, str):
            out.append(entry)
        elif _axis_tuple(entry):
            out.append(tuple(entry))
        else:
            raise Mistake(
                TypeError,
                f"has {what} {fmt(tuple(names))} whose entry {i} is {fmt(entry)}. " + _NAME_HELP,
            )
    return tuple(out)


def normalize_kept(names: object, what: str = "names") -> Names:
    """`normalize_names`, but a PartitionSpec stays one (normalised): names given
    before their value, to be read as JAX reads them once the value is known
    (`fit_rank`)."""
    normal = normalize_names(names, what)
    return PartitionSpec(*normal) if isinstance(names, PartitionSpec) else normal


def fit_rank(names: NameTuple, rank: int, *, spec: bool) -> NameTuple | None:
    """`names` for a value of `rank` dimensions, read as JAX reads a PartitionSpec
    (`spec`: missing trailing entries are None), or None if they do not fit.
    Names that are all None fit any rank; a tuple or list with a name in it
    keeps one name per dimension, which is what catches stale names."""
    if all(name is None for name in names):
        return (None,) * rank
    if spec and len(names) < rank:
        return names + (None,) * (rank - len(names))
    return None


def _normalize_target(logical: str, target: object, index: int) -> AxisName:
    if target is None or target is UNCONSTRAINED or isinstance(target, str):
        return target
    if _axis_tuple(target):
        if len(set(target)) != len(target):
            raise Mistake(
                ValueError,
                f"rule {index} maps {logical!r} to {tuple(target)!r}, which names a "
                "mesh axis twice; a mesh axis can shard a dimension once. Name each "
                "axis once.",
            )
        return tuple(target)
    raise Mistake(
        TypeError,
        f"rule {index} maps {logical!r} to {fmt(target)}; a rule maps a logical "
        "name to a mesh axis name, a tuple of mesh axis names, None (replicated) or "
        f"PartitionSpec.UNCONSTRAINED. Write it as ({logical!r}, 'data') or "
        f"({logical!r}, ('fsdp', 'tensor')).",
    )


def normalize_rules(rules: object) -> RuleTuple:
    """`rules` as a tuple of ``(str, mesh_axes)`` pairs; a mapping is taken in its order.

    Raises:
        Mistake: (TypeError) naming the first malformed rule and how to write
            it; (ValueError) for a rule that names a mesh axis twice.
    """
    if isinstance(rules, (Mesh, jax.sharding.AbstractMesh)):
        raise Mistake(
            TypeError,
            f"rules are a mesh, {fmt(rules)}, given where rules go. Pass the mesh "
            "as mesh= (and rules, if any, as rules=), e.g. "
            "st.to_spec(tree, rules, mesh=mesh).",
        )
    if isinstance(rules, Mapping):
        rules = tuple(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, (tuple, list)):
        raise Mistake(
            TypeError,
            f"rules are {fmt(rules)}; expected a sequence of (logical_name, mesh_axes) "
            "pairs or a mapping. Write e.g. [('batch', 'data'), ('embed', 'fsdp')].",
        )
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, (str, bytes)) or not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise Mistake(
                TypeError,
                f"rule {i} is {fmt(rule)}; each rule is a pair (logical_name, "
                "mesh_axes), e.g. ('embed', 'fsdp').",
            )
        logical, target = rule
        if not isinstance(logical, str):
            raise Mistake(
                TypeError,
                f"rule {i} is {fmt(tuple(rule))}, whose logical name {fmt(logical)} is "
                "not a str. Logical names are str, e.g. ('embed', 'fsdp').",
            )
        out.append((logical, _normalize_target(logical, target, i)))
    return tuple(out)


# --- the rules context -------------------------------------------------------

# A ContextVar, not a thread-local: nested contexts restore on exit, and threads
# and asyncio tasks each see only the rules set in their own context.
_RULES: contextvars.ContextVar[RuleTuple] = contextvars.ContextVar("spmdtree_rules", default=())


@contextlib.contextmanager
def logical_axis_rules(rules: Rules) -> Iterator[RuleTuple]:
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
    try:  # the boundary, by hand: a generator's errors surface on entering `with`
        normal = normalize_rules(rules)
    except Mistake as mistake:
        raise mistake.error("logical_axis_rules") from None
    token = _RULES.set(normal)
    try:
        yield normal
    finally:
        _RULES.reset(token)


@public
def set_logical_axis_rules(rules: Rules) -> None:
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
    _RULES.set(normalize_rules(rules))


def get_logical_axis_rules() -> RuleTuple:
    """Returns the logical axis rules of the current context (``()`` if unset).

    Example:
        >>> import spmdtree as st
        >>> st.get_logical_axis_rules()
        ()
    """
    return _RULES.get()


# The logical names resolved while `names_seen` is open (preflight traces a step
# so, to tell a rule only activations use from one nothing uses): a record for
# the caller, which no resolution reads.
_SEEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "spmdtree_names_seen", default=None
)


@contextlib.contextmanager
def names_seen() -> Iterator[set[str]]:
    """The logical names every resolution in the body meets (a step's
    `with_logical_constraint` calls, as it is traced), filled as they come."""
    seen: set[str] = set()
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def saw(names: NameTuple) -> None:
    """Records `names` (one leaf's logical names) where `names_seen` is open."""
    seen = _SEEN.get()
    if seen is not None:
        seen.update(
            n
            for entry in names
            for n in (entry if isinstance(entry, tuple) else (entry,))
            if isinstance(n, str)
        )


def rules_or_context(rules: Rules | None) -> RuleTuple:
    """`rules` normalised, or the context's rules when `rules` is None."""
    return _RULES.get() if rules is None else normalize_rules(rules)
