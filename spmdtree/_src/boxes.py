"""Metadata boxes: an array together with the names of its dimensions.

A box is a pytree node with exactly one child, its ``value``; the metadata
(`Meta`: names, mesh, rules) is static aux data. ``jax.jit``, ``jax.grad``,
``jax.tree.map`` and optax therefore carry boxes through untouched, and equal
metadata never causes a retrace.

What a box resolves to is said here too (`BoxResolver`: the one dispatch over
boxes and the subtrees they hold, through `resolve.resolve_leaf`), so that a
box's own `get_sharding` is ``to_sharding`` of the box with nothing above it;
the tree pass in `specs` extends the same dispatch.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, NoReturn, TypeAlias, TypeVar, cast

import jax
import numpy as np
from jax.sharding import PartitionSpec

from spmdtree._src import registry
from spmdtree._src.errors import Mistake, at, fmt, public
from spmdtree._src.resolve import (
    REPLICATED,
    Layout,
    Resolution,
    check_call,
    check_mesh,
    mesh_shape_of,
    named_sharding,
    resolve_leaf,
)
from spmdtree._src.rules import (
    AnyMesh,
    AxisName,
    Names,
    NameTuple,
    PyTree,
    Rules,
    RuleTuple,
    fit_rank,
    normalize_kept,
    normalize_names,
    normalize_rules,
    rules_or_context,
)
from spmdtree._src.text import short_value

#: The key of the axis name in the ``params`` dict of `AxisMetadata.add_axis`
#: and `AxisMetadata.remove_axis`, as in flax.linen.
PARTITION_NAME = "partition_name"

B = TypeVar("B", bound="AxisMetadata")
PB = TypeVar("PB", bound="Partitioned")


class Meta(NamedTuple):
    """A box's metadata, its static aux data: read by name everywhere. Its
    fields are the box constructors' keyword arguments; those of a `Layout`
    reach every sharding through `layout`."""

    names: NameTuple
    mesh: AnyMesh | None = None
    rules: RuleTuple | None = None
    memory_kind: str | None = None

    @property
    def layout(self) -> Layout:
        """The box's own layout, but the spec, which resolving its names gives.

        Raises:
            Mistake: for a field the layout refuses.
        """
        return Layout(memory_kind=self.memory_kind)


def refuse(box: object, what: str) -> NoReturn:
    """The one "unbox first" error, for everything that treats a box as an array."""
    raise TypeError(
        f"{type(box).__name__} is a metadata box, not an array: {what}. Call "
        "st.unbox(tree) (or box.unbox()) to get the arrays, and st.replace_boxed(tree, "
        "new_values) to put results back into the boxes."
    )


def _refusing(what: str) -> Callable[..., NoReturn]:
    def method(self: object, *args: object, **kwargs: object) -> NoReturn:
        refuse(self, what)

    return method


#: The functions of jax's arrays that read `__jax_array__` to compare.
_JAX_COMPARISONS = frozenset({"_operator_eq", "_operator_ne"})


class AxisMetadata(metaclass=registry.BoxType):
    """Abstract base for metadata boxes: a value plus metadata about its axes.

    Subclass it for your own metadata and register the subclass as a pytree
    node whose only child is the value (e.g. with
    ``jax.tree_util.register_dataclass``); every spmdtree function then treats
    it like the built-in boxes. `add_axis` and `remove_axis` must be inverses.

    A box is neither an array nor a sequence: converting it to an array,
    passing it to a jax function, taking its length, iterating over it and
    arithmetic raise a `TypeError` that says to unbox first. Subclass it for
    real: virtual subclasses (``register``) are not boxes.

    Example:
        >>> import dataclasses, jax, spmdtree as st
        >>> @jax.tree_util.register_dataclass
        ... @dataclasses.dataclass(frozen=True)
        ... class Tagged(st.AxisMetadata):
        ...     value: object
        ...     tag: str = dataclasses.field(metadata=dict(static=True))
        ...     def unbox(self): return self.value
        ...     def replace_boxed(self, value): return dataclasses.replace(self, value=value)
        ...     def add_axis(self, index, params): return self
        ...     def remove_axis(self, index, params): return self
        >>> st.unbox({"w": Tagged(1.0, tag="frozen")})
        {'w': 1.0}
    """

    __slots__ = ()

    @abc.abstractmethod
    def unbox(self) -> Any:
        """Returns the boxed value (one level: a nested box stays boxed)."""

    @abc.abstractmethod
    def replace_boxed(self: B, value: Any) -> B:
        """Returns a box with the same metadata around `value`."""

    @abc.abstractmethod
    def add_axis(self: B, index: int, params: Mapping[str, Any]) -> B:
        """Returns the box with a new axis at `index`, named ``params[PARTITION_NAME]``."""

    @abc.abstractmethod
    def remove_axis(self: B, index: int, params: Mapping[str, Any]) -> B:
        """Returns the box without the axis at `index`, the inverse of `add_axis`."""

    def __bool__(self) -> bool:
        return True  # a box is always truthy; without this, bool() would call __len__

    @property
    def __jax_array__(self) -> NoReturn:
        # jax functions look this up on arguments they do not know: refusing at
        # the lookup gives jnp.sum(box) ... our message. jax's `array == box`
        # looks it up too, and `==` must never raise, so there it is absent and
        # the box's own __eq__ answers.
        if sys._getframe(1).f_code.co_name in _JAX_COMPARISONS:
            raise AttributeError("__jax_array__")
        refuse(self, "jax functions act on arrays")

    __array__ = _refusing("converting it to an array")
    # numpy operators then defer to the box's own (refusing) operators and __eq__.
    __array_ufunc__ = None
    __len__ = _refusing("len() of a box is not defined")
    __iter__ = _refusing("iterating over a box is not defined")
    __getitem__ = _refusing("indexing a box is not defined")


# Arithmetic on a box is a mistake (it would be on the array inside): each
# operator raises the same TypeError, where Python's would not say what to do.
for _op in (
    *("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"),
    *("radd", "rsub", "rmul", "rtruediv", "rfloordiv", "rmod", "rpow", "rmatmul"),
    *("and", "or", "xor", "lshift", "rshift", "rand", "ror", "rxor"),
    *("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge"),
    *("float", "int", "complex", "index"),
):
    setattr(AxisMetadata, f"__{_op}__", _refusing(f"__{_op}__ would act on the array inside"))
del _op


#: ``IS_BOX(x)``: whether `x` is a box, as a C-level call (for ``is_leaf=``).
IS_BOX = AxisMetadata.__instancecheck__

#: Other libraries' boxes, which no spmdtree function reads as plain containers.
FLAX_LINEN, FLAX_NNX = "flax.linen", "flax.nnx"
_FOREIGN: dict[type, str | None] = {}


def foreign_kind(x: object) -> str | None:
    """FLAX_LINEN for a flax.linen box (a subclass of flax's AxisMetadata),
    FLAX_NNX for a flax.nnx Variable, None for anything else. flax is not
    imported: its classes are recognised by module and name (once per type)."""
    kind = _FOREIGN.get(type(x), "")
    if kind == "":
        kind = _FOREIGN[type(x)] = next(
            (
                FLAX_LINEN if c.__name__ == "AxisMetadata" else FLAX_NNX
                for c in type(x).__mro__
                if (c.__module__, c.__name__) in _FOREIGN_BASES
            ),
            None,
        )
    return kind


_FOREIGN_BASES = {
    ("flax.core.meta", "AxisMetadata"),
    ("flax.nnx.variablelib", "Variable"),
    ("flax.nnx.variablelib", "VariableState"),
}


def _box_or_foreign(x: object) -> bool:
    return IS_BOX(x) or foreign_kind(x) is not None


def leaf_test() -> Callable[[object], bool]:
    """``is_leaf`` for every tree walk: boxes are leaves, and so, once flax is
    loaded, are flax's boxes and nnx Variables, so that every function meets
    them (and refuses them, `refuse_foreign`) rather than reading their values
    as if unboxed. Without flax loaded, the C-level `IS_BOX`."""
    return _box_or_foreign if "flax" in sys.modules else IS_BOX


def refuse_foreign(x: PyTree) -> PyTree:
    """`x`, unless it is another library's box: then a Mistake pointing at `from_flax`."""
    kind = foreign_kind(x)
    if kind is None:
        return x
    what = "Variable" if kind == FLAX_NNX else "box"
    raise Mistake(
        TypeError,
        f"is a {kind} {what}, {type(x).__name__}, which spmdtree does not read as its "
        "own (its names would be ignored and its value taken as unboxed). Convert the "
        "tree first: st.from_flax(tree).",
    )


def dtype_of(value: object) -> np.dtype[Any]:
    """The dtype of an array-like, or the one jax gives a Python number."""
    dtype = getattr(value, "dtype", None)
    return jax.typeof(value).dtype if dtype is None else dtype


def shape_of(value: object) -> tuple[int, ...] | None:
    """The shape of an array-like or Python number; None for anything else."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(shape)
    if isinstance(value, (bool, int, float, complex)):
        return ()
    return None


def is_array(value: object) -> bool:
    """Whether `value` is one array-like leaf (array, ShapeDtypeStruct, number)."""
    return shape_of(value) is not None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def checked_names(value: object, names: object) -> NameTuple:
    """`names` normalised, checked to name each dimension of `value` once.

    Read as JAX reads a `PartitionSpec`: a shorter one is padded with None,
    and names that are all None fit any rank (stored padded to the rank).

    Raises:
        Mistake: if an entry is of the wrong kind or the rank differs.
    """
    spec = isinstance(names, PartitionSpec)
    names = normalize_names(names)
    shape = shape_of(value)
    if shape is None or len(shape) == len(names):
        return names
    fitted = fit_rank(names, len(shape), spec=spec)
    if fitted is None:
        raise Mistake(
            ValueError,
            f"has names {names} for a value of shape {shape}: {_count(len(names), 'name')} "
            f"for {_count(len(shape), 'dimension')}. Give one name per dimension (None "
            "for a replicated one), or a PartitionSpec, whose missing trailing entries "
            "leave dimensions unsharded.",
        )
    return fitted


def _same_value(a: object, b: object) -> bool:
    """Identity for arrays, equality for anything else; never raises."""
    if a is b:
        return True
    if is_array(a) or is_array(b):
        return False
    try:
        equal = a == b
    except Exception:  # an element comparison raised: not equal
        return False
    return equal if type(equal) is bool else False


def validated(
    value: object,
    names: object,
    *,
    mesh: AnyMesh | None = None,
    rules: Rules | None = None,
    **layout: Any,
) -> Meta:
    """The metadata of a box of `value`, checked and normalised: the one validation
    every way of building a box goes through (the constructors, `make_box`);
    `layout`: the `Meta` fields of its `Layout`, checked by the layout itself.

    Raises:
        Mistake: for a mesh of the wrong kind, names of the wrong kind or rank,
            malformed rules, a layout field of the wrong kind or value.
    """
    check_mesh(mesh, optional=True)
    meta = Meta(
        names=checked_names(value, names),
        mesh=mesh,
        rules=None if rules is None else normalize_rules(rules),
        **layout,
    )
    meta.layout  # noqa: B018 -- built to be checked
    return meta


def make_box(cls: type[PB], value: Any, names: object, **fields: Any) -> PB:
    """A validated box of type `cls` (for builders that are not its constructor);
    `fields` are the other `Meta` fields, by name.

    Raises:
        Mistake: as `validated`.
    """
    return registry.rebuild(cls, value, validated(value, names, **fields))


def the_box(mistake: Mistake) -> Mistake:
    """A leaf's mistake said of a box on its own, outside any tree."""
    return Mistake(mistake.kind, f"the box {mistake.message}")


class Partitioned(AxisMetadata):
    """A value whose dimensions are named by mesh axes.

    Args:
        value: an array, a `jax.ShapeDtypeStruct`, or any pytree.
        names: one entry per dimension of `value`: a mesh axis name, ``None``
            (replicated), a tuple of mesh axis names, or
            ``PartitionSpec.UNCONSTRAINED``. Lists are stored as tuples.
        mesh: the mesh these names refer to, if fixed.
        memory_kind: the memory the value's shards sit in: None (the device's
            default), ``"device"``, or a host's, ``"pinned_host"`` or
            ``"unpinned_host"``, to offload it (new in 0.5). Its shardings
            carry it, and `plan` counts its bytes as the host's.

    Raises:
        TypeError: if an entry of `names` or `memory_kind` is of the wrong kind.
        ValueError: if `value` has a shape whose rank differs from ``len(names)``,
            or `memory_kind` is not one of the kinds above.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> box = st.Partitioned(jnp.zeros((256, 512)), ["data", "model"])
        >>> box
        Partitioned(f32[256,512], names=('data', 'model'))
        >>> box.get_partition_spec()
        P('data', 'model')
        >>> st.Partitioned(jnp.zeros(8), ("data",), memory_kind="pinned_host").memory_kind
        'pinned_host'
    """

    __slots__ = ("_tree",)
    #: Whether the names are logical names (resolved through rules).
    logical: ClassVar[bool] = False
    _tree: tuple[tuple[Any], Meta]

    @public
    def __init__(
        self,
        value: Any,
        names: Names,
        mesh: AnyMesh | None = None,
        *,
        memory_kind: str | None = None,
    ) -> None:
        self._init(value, names, mesh=mesh, memory_kind=memory_kind)

    def _init(self, value: Any, names: Names, **fields: Any) -> None:
        try:
            self._tree = ((value,), validated(value, names, **fields))
        except Mistake as mistake:
            raise the_box(mistake) from None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        registry.register(cls)

    value = registry.read_only("value", lambda self: self._tree[0][0], "The boxed value.")
    names = registry.read_only(
        "names", lambda self: self._tree[1].names, "The names of the value's dimensions."
    )
    mesh = registry.read_only(
        "mesh", lambda self: self._tree[1].mesh, "The mesh the names refer to, or None."
    )
    memory_kind = registry.read_only(
        "memory_kind",
        lambda self: self._tree[1].memory_kind,
        "The memory the value's shards sit in (a host's: offloaded), or None (new in 0.5).",
    )
    __reduce__ = registry.reduce

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not type(self):
            return False  # not NotImplemented: an array's __eq__ would try to convert the box
        (a,), meta_a = self._tree
        (b,), meta_b = other._tree
        return bool(meta_a == meta_b) and _same_value(a, b)

    def __hash__(self) -> int:
        return hash((type(self), self._tree[1]))

    def __repr__(self) -> str:
        (value,), meta = self._tree
        extra = "".join(
            f", {field}={item!r}"
            for field, item in zip(meta._fields[1:], meta[1:], strict=True)
            if item is not None
        )
        return f"{type(self).__name__}({short_value(value)}, names={meta.names!r}{extra})"

    def unbox(self) -> Any:
        """Returns the boxed value.

        Example:
            >>> import spmdtree as st
            >>> st.Partitioned(1.0, ()).unbox()
            1.0
        """
        return self._tree[0][0]

    def replace_boxed(self: PB, value: Any) -> PB:
        """Returns a box with the same metadata around `value` (not validated).

        Example:
            >>> import jax.numpy as jnp, spmdtree as st
            >>> st.Partitioned(jnp.zeros(4), ("data",)).replace_boxed(jnp.ones(4))
            Partitioned(f32[4], names=('data',))
        """
        return registry.rebuild(type(self), value, self._tree[1])

    def replace(self: PB, **changes: Any) -> PB:
        """Returns a new box with some of its constructor's arguments changed.

        Unlike `replace_boxed`, the new box is validated like a constructed one.

        Example:
            >>> import jax.numpy as jnp, spmdtree as st
            >>> st.Partitioned(jnp.zeros((2, 4)), ("data", None)).replace(names=(None, "model"))
            Partitioned(f32[2,4], names=(None, 'model'))
        """
        (value,), meta = self._tree
        current = {"value": value, **meta._asdict()}
        fields = [name for name in inspect.signature(type(self)).parameters if name in current]
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.replace: unknown field(s) {sorted(unknown)}; "
                f"the fields are {fields}."
            )
        return type(self)(**{**{name: current[name] for name in fields}, **changes})

    @public
    def add_axis(self: PB, index: int, params: Mapping[str, Any]) -> PB:
        """Returns the box with a new axis named ``params[PARTITION_NAME]`` at `index`.

        `index` counts in the result, so ``-1`` appends. Only the names change.

        Raises:
            ValueError: if `index` is out of range.
            TypeError: if `params` has no `PARTITION_NAME`.

        Example:
            >>> import spmdtree as st
            >>> box = st.Partitioned(1.0, ())
            >>> box.add_axis(0, {st.PARTITION_NAME: "layers"}).names
            ('layers',)
        """
        try:
            return self.with_names(insert_name(self.names, index, partition_name(params)))
        except Mistake as mistake:
            raise the_box(mistake) from None

    @public
    def remove_axis(self: PB, index: int, params: Mapping[str, Any]) -> PB:
        """Returns the box without the axis at `index`, which must be named ``params[PARTITION_NAME]``.

        `index` counts in the input; this is the inverse of `add_axis`.

        Raises:
            ValueError: if `index` is out of range or names another axis.

        Example:
            >>> import jax.numpy as jnp, spmdtree as st
            >>> box = st.Partitioned(jnp.zeros((3, 4)), ("layers", "model"))
            >>> box.remove_axis(0, {st.PARTITION_NAME: "layers"}).names
            ('model',)
        """
        try:
            return self.with_names(delete_name(self.names, index, partition_name(params)))
        except Mistake as mistake:
            raise the_box(mistake) from None

    def with_names(self: PB, names: NameTuple) -> PB:
        """The same box with other (already normalised) names; not validated."""
        (value,), meta = self._tree
        return registry.rebuild(type(self), value, meta._replace(names=names))

    def get_partition_spec(self) -> PartitionSpec:
        """Returns ``PartitionSpec(*names)``, the names as written (not resolved).

        Example:
            >>> import spmdtree as st
            >>> st.LogicallyPartitioned(1.0, ()).get_partition_spec()
            P()
        """
        return PartitionSpec(*self.names)

    @public
    def get_sharding(self, mesh: AnyMesh) -> PyTree:
        """Returns the resolved, shape-aware `NamedSharding` of the value on `mesh`.

        Exactly ``st.to_sharding(box, mesh)`` (changed in 0.3: the same checks
        and warnings): logical names go through the box's rules, else the
        rules context; a box holding a subtree gives the same box over a tree
        of shardings.

        Raises:
            ValueError: if the names cannot be right for the value on `mesh`.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
            >>> st.Partitioned(jnp.zeros((6, 8)), ("data", "model")).get_sharding(mesh).spec
            P('data', 'model')
        """
        check_mesh(mesh)
        rules = rules_or_context(None)
        try:
            found = BoxResolver(rules, mesh).one(self, None, (0, None))
        except Mistake as mistake:
            raise the_box(mistake) from None
        check_leaves((self, [self], [found]), rules, "", warn=True)
        return finished(lambda value, res: named_sharding(mesh, res.layout), False, self, found)


registry.register(Partitioned)


class LogicallyPartitioned(Partitioned):
    """A value whose dimensions are named by logical names, mapped to mesh axes by rules.

    The rules come from, in order: the box's own `rules`, the ``rules=``
    argument of the function resolving it, the rules context.

    Args:
        value: an array, a `jax.ShapeDtypeStruct`, or any pytree.
        names: one logical name per dimension (entries as for `Partitioned`).
        mesh: the mesh the rules map onto, if fixed.
        rules: rules for this box only, as ``(logical_name, mesh_axes)`` pairs.
        memory_kind: the memory the value's shards sit in, as for
            `Partitioned` (new in 0.5).

    Raises:
        TypeError: if a name, rule or `memory_kind` is of the wrong kind.
        ValueError: if `value` has a shape whose rank differs from ``len(names)``,
            or `memory_kind` is not a memory kind.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> box = st.LogicallyPartitioned(jnp.zeros((8, 16)), ["embed", "mlp"])
        >>> box
        LogicallyPartitioned(f32[8,16], names=('embed', 'mlp'))
        >>> st.to_spec(box, [("embed", "fsdp"), ("mlp", "tensor")])
        P('fsdp', 'tensor')
    """

    __slots__ = ()
    logical = True

    @public
    def __init__(
        self,
        value: Any,
        names: Names,
        mesh: AnyMesh | None = None,
        rules: Rules | None = None,
        *,
        memory_kind: str | None = None,
    ) -> None:
        self._init(value, names, mesh=mesh, rules=rules, memory_kind=memory_kind)

    rules = registry.read_only(
        "rules", lambda self: self._tree[1].rules, "The box's own rules (normalised), or None."
    )


def same_mesh(a: AnyMesh, b: AnyMesh) -> bool:
    """Whether two meshes are the same mesh (an abstract one: the same shape)."""
    return a is b or a == b or getattr(a, "abstract_mesh", a) == getattr(b, "abstract_mesh", b)


def check_box_mesh(meta: Meta, mesh: AnyMesh | None) -> None:
    """Raises a Mistake if a box's own mesh is not the mesh of the call."""
    if meta.mesh is not None and mesh is not None and not same_mesh(meta.mesh, mesh):
        raise Mistake(
            ValueError,
            f"has its own mesh {meta.mesh}, which is not the mesh of this call, {mesh}. "
            "Pass the box's mesh, or drop it from the box with box.replace(mesh=None).",
        )


# --- what a box resolves to ----------------------------------------------------


class _Pass:
    """What a box holding no array resolves to: it passes through unchanged."""


PASS = _Pass()


@dataclasses.dataclass(frozen=True, eq=False)
class Nested:
    """The resolutions inside a box that holds a subtree (SM3's per-dimension vectors)."""

    leaves: list[Any]
    treedef: jax.tree_util.PyTreeDef
    resolutions: list[Found]


#: What one leaf of a tree resolves to: a `Resolution` for an array, `Nested`
#: for a box holding a subtree, `PASS` for a box holding no array, None for
#: anything else.
Found: TypeAlias = Resolution | Nested | _Pass | None

#: A leaf's position: its index among the tree's leaves, and its index in a
#: per-dimension sequence (SM3's accumulators), if it is in one.
At: TypeAlias = tuple[int, int | None]


def holds_array(value: PyTree) -> bool:
    """Whether any leaf of `value` is an array (so it has a sharding)."""
    return any(is_array(leaf) for leaf in jax.tree.leaves(value))


class BoxResolver:
    """What each leaf resolves to, box by box: the one dispatch over boxes, the
    arrays and subtrees they hold, and the other leaves. A box's own
    `get_sharding` uses it as is; the tree pass (`specs.Resolver`) extends it
    with a memo, ``params=``, `strict`, `lenient` and placed arrays."""

    def __init__(self, rules: RuleTuple, mesh: AnyMesh | None) -> None:
        self.rules, self.mesh = rules, mesh
        self.mesh_shape = None if mesh is None else mesh_shape_of(mesh)

    def one(self, leaf: Any, named: tuple[type[Partitioned], Meta] | None, at: At) -> Found:
        """What a leaf resolves to (see `Found`); `named` is the box around it, if any."""
        if isinstance(leaf, Partitioned):
            (value,), meta = leaf._tree
            if meta.mesh is not None:
                check_box_mesh(meta, self.mesh)
            shape = shape_of(value)
            if shape is None:
                return self.nested(value, (type(leaf), meta), at[0])
            return self.of_box(type(leaf), meta, shape, at)
        if isinstance(leaf, AxisMetadata):
            value = leaf.unbox()
            return REPLICATED if is_array(value) else self.nested(value, named, at[0])
        if foreign_kind(leaf) is not None:
            refuse_foreign(leaf)
        shape = shape_of(leaf)
        if shape is None:
            return None
        if named is not None:
            return self.of_box(*named, shape, at)
        return self.unboxed(leaf)

    def nested(
        self, value: PyTree, named: tuple[type[Partitioned], Meta] | None, i: int
    ) -> Nested | _Pass:
        """A box holding a subtree: PASS if it holds no array, else `Nested`."""
        if not holds_array(value):
            return PASS
        inner, inner_def = jax.tree.flatten(value, is_leaf=leaf_test())
        # One 1-D array per dimension of the param (SM3): each knows its dimension.
        per_dimension = named is not None and isinstance(value, (list, tuple))
        per_dimension = per_dimension and len(inner) == len(named[1].names)  # type: ignore[index]
        return Nested(
            inner,
            inner_def,
            [self.one(x, named, (i, j if per_dimension else None)) for j, x in enumerate(inner)],
        )

    def of_box(
        self, kind: type[Partitioned], meta: Meta, shape: tuple[int, ...], at: At
    ) -> Resolution:
        """The resolution of an array of `shape` in a box of `kind` and `meta`; its
        problem raised."""
        found = self.resolved(kind, meta, shape)
        if found.problem is not None:
            raise Mistake(ValueError, found.problem)
        return found

    def resolved(self, kind: type[Partitioned], meta: Meta, shape: tuple[int, ...]) -> Resolution:
        """`resolve_leaf` of an array of `shape` in a box of `kind` and `meta`."""
        return resolve_leaf(
            meta.names,
            shape,
            logical=kind.logical,
            rules=self.rules,
            own=meta.rules,
            mesh_shape=self.mesh_shape,
            layout=meta.layout,
        )

    def unboxed(self, leaf: Any) -> Resolution:
        """The resolution of an array in no box: replicated."""
        return REPLICATED


def finished(
    finish: Callable[[Any, Resolution], Any], keep_boxes: bool, leaf: Any, res: Found
) -> Any:
    """`leaf` with every array replaced by ``finish(value, resolution)``.

    A box holding an array becomes the result (`keep_boxes` False: specs,
    shardings) or holds it (`keep_boxes` True). A box holding a subtree is
    kept around its results; one holding no array comes back unchanged.
    Leaves that are not arrays become None, or stay with `keep_boxes`.
    """
    if type(res) is Resolution:
        if not isinstance(leaf, AxisMetadata):
            return finish(leaf, res)
        out = finish(leaf._tree[0][0] if isinstance(leaf, Partitioned) else leaf.unbox(), res)
        return leaf.replace_boxed(out) if keep_boxes else out
    if res is None:
        return leaf if keep_boxes else None
    if res is PASS:
        return leaf
    nested = cast(Nested, res)
    inner = [
        finished(finish, keep_boxes, x, r)
        for x, r in zip(nested.leaves, nested.resolutions, strict=True)
    ]
    return leaf.replace_boxed(nested.treedef.unflatten(inner))


def check_leaves(
    walk: tuple[PyTree, list[Any], list[Found]], rules: RuleTuple, argument: str, *, warn: bool
) -> None:
    """`check_call` over the resolutions of a tree's leaves (`walk`: the tree, its
    leaves and their resolutions), those inside boxes holding a subtree
    included; the tree's key paths are read only for a leaf to name.

    Raises:
        Mistake: as `check_call`.
    """
    tree, leaves, resolutions = walk
    flat: list[object] = list(resolutions)
    inner: dict[int, tuple[int, str]] = {}  # flat position -> (leaf, path inside it)
    nests = any(type(res) is Nested for res in set(resolutions))
    for i, res in enumerate(resolutions if nests else ()):
        if type(res) is Nested:
            for suffix, found in _inside(leaves[i], res):
                inner[len(flat)] = (i, suffix)
                flat.append(found)
    paths: list[str] = []

    def where(k: int) -> str:
        if not paths:
            found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf_test())[0]
            paths.extend(at(argument, path) for path, _ in found)
        leaf, suffix = inner.get(k, (k, ""))
        return paths[leaf] + suffix

    check_call(flat, rules, where, noun="box", warn=warn)


def _inside(box: Any, nested: Nested) -> list[tuple[str, object]]:
    """The resolutions inside a box holding a subtree, each with its path there."""
    found = jax.tree_util.tree_flatten_with_path(box.unbox(), is_leaf=leaf_test())[0]
    out: list[tuple[str, object]] = []
    for (path, leaf), res in zip(found, nested.resolutions, strict=True):
        suffix = ".value" + jax.tree_util.keystr(tuple(path))
        if type(res) is Nested:
            out += [(suffix + more, r) for more, r in _inside(leaf, res)]
        else:
            out.append((suffix, res))
    return out


def partition_name(params: Mapping[str, AxisName] | AxisName) -> AxisName:
    """The axis name from flax's ``{PARTITION_NAME: name}``, or a plain name."""
    if isinstance(params, Mapping):
        if PARTITION_NAME not in params:
            raise Mistake(
                TypeError,
                f"got params {fmt(dict(params))} without the key {PARTITION_NAME!r}; "
                f"pass {{st.PARTITION_NAME: 'layers'}}, or the name itself.",
            )
        params = params[PARTITION_NAME]
    return normalize_names((params,), "axis name")[0]


def insert_name(names: NameTuple, index: int, name: AxisName) -> NameTuple:
    """`names` with `name` inserted so that it ends at position `index`."""
    size = len(names) + 1
    if not -size <= index < size:
        raise Mistake(
            ValueError,
            f"has names {names}, so a new axis can go at positions {-size} to "
            f"{size - 1}, not {index}. Pass an index in range (-1 appends).",
        )
    index %= size
    return (*names[:index], name, *names[index:])


def delete_name(names: NameTuple, index: int, name: AxisName, *, check: bool = True) -> NameTuple:
    """`names` without the entry at `index`, which must be `name` (if `check`)."""
    size = len(names)
    if not -size <= index < size:
        raise Mistake(
            ValueError,
            f"has names {names}, so there is no axis {index} to remove. Pass the "
            "same index that add_axis was given.",
        )
    if check and names[index] != name:
        raise Mistake(
            ValueError,
            f"has names {names}, so position {index} is {names[index]!r}, not "
            f"{name!r}. Pass the same index and name that add_axis was given.",
        )
    index %= size
    return names[:index] + names[index + 1 :]


def _initialiser_names(names: object, **layout: Any) -> Names:
    """Checked now, at the wrapper's creation, with the boxes' `layout` fields; a
    PartitionSpec stays one, to be read as JAX reads it against the value the
    initialiser returns."""
    try:
        Meta((), **layout).layout  # noqa: B018 -- built to be checked
        return normalize_kept(names)
    except Mistake as mistake:
        raise Mistake(mistake.kind, f"the initialiser {mistake.message}") from None


@public
def with_partitioning(
    fn: Callable[..., Any],
    names: Names,
    mesh: AnyMesh | None = None,
    *,
    memory_kind: str | None = None,
) -> Callable[..., Partitioned]:
    """Wraps an initialiser so that it returns its value in a `Partitioned` box.

    Args:
        fn: the initialiser, e.g. ``jax.nn.initializers.lecun_normal()``.
        names: mesh axis names, one per dimension of what `fn` returns.
        mesh: the mesh, if fixed.
        memory_kind: the boxes' memory kind, as for `Partitioned`, e.g.
            ``"pinned_host"`` to offload them (new in 0.5).

    Returns:
        A function with `fn`'s signature returning ``Partitioned(fn(...), names, mesh)``.

    Raises:
        TypeError: at once, if an entry of `names` or `memory_kind` is of the
            wrong kind.
        ValueError: at once, if `memory_kind` is not a memory kind.

    Example:
        >>> import jax, spmdtree as st
        >>> init = st.with_partitioning(jax.nn.initializers.lecun_normal(), (None, "model"))
        >>> init(jax.random.key(0), (4, 8))
        Partitioned(f32[4,8], names=(None, 'model'))
        >>> offloaded = st.with_partitioning(jax.nn.initializers.zeros, ("model",), memory_kind="pinned_host")
        >>> offloaded(jax.random.key(0), (8,))
        Partitioned(f32[8], names=('model',), memory_kind='pinned_host')
    """
    names = _initialiser_names(names, memory_kind=memory_kind)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Partitioned:
        return Partitioned(fn(*args, **kwargs), names, mesh=mesh, memory_kind=memory_kind)

    return wrapper


@public
def with_logical_partitioning(
    fn: Callable[..., Any],
    names: Names,
    mesh: AnyMesh | None = None,
    rules: Rules | None = None,
    *,
    memory_kind: str | None = None,
) -> Callable[..., LogicallyPartitioned]:
    """Wraps an initialiser so that it returns its value in a `LogicallyPartitioned` box.

    Args:
        fn: the initialiser.
        names: logical names, one per dimension of what `fn` returns.
        mesh: the mesh, if fixed.
        rules: rules for these boxes only; usually left to the caller.
        memory_kind: the boxes' memory kind, as for `Partitioned` (new in 0.5).

    Returns:
        A function with `fn`'s signature returning a `LogicallyPartitioned`.

    Raises:
        TypeError: at once, if a name, rule or `memory_kind` is of the wrong kind.
        ValueError: at once, if `memory_kind` is not a memory kind.

    Example:
        >>> import jax, spmdtree as st
        >>> init = st.with_logical_partitioning(jax.nn.initializers.zeros, ("mlp",))
        >>> init(jax.random.key(0), (8,))
        LogicallyPartitioned(f32[8], names=('mlp',))
        >>> init = st.with_logical_partitioning(jax.nn.initializers.zeros, ("mlp",), memory_kind="pinned_host")
        >>> init(jax.random.key(0), (8,)).memory_kind
        'pinned_host'
    """
    names = _initialiser_names(names, memory_kind=memory_kind)
    rules = None if rules is None else normalize_rules(rules)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> LogicallyPartitioned:
        return LogicallyPartitioned(
            fn(*args, **kwargs), names, mesh=mesh, rules=rules, memory_kind=memory_kind
        )

    return wrapper
