"""Metadata boxes: an array together with the names of its dimensions.

A box is a pytree node with exactly one child, its ``value``; the metadata
(names, mesh, rules) is static aux data. ``jax.jit``, ``jax.grad``,
``jax.tree.map`` and optax therefore carry boxes through untouched, and equal
metadata never causes a retrace.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import operator
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

import jax
import numpy as np
from jax import tree_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdtree.errors import LeafError, fmt, raise_one
from spmdtree.rules import (
    AnyMesh,
    Names,
    Resolution,
    Rules,
    RulesLike,
    check_mesh,
    mesh_shape_of,
    named_sharding,
    normalize_names,
    normalize_rules,
    resolve,
    rules_or_context,
)

__all__ = [
    "PARTITION_NAME",
    "AxisMetadata",
    "LogicallyPartitioned",
    "Partitioned",
    "with_logical_partitioning",
    "with_partitioning",
]

#: The key of the axis name in the ``params`` dict of `AxisMetadata.add_axis`
#: and `AxisMetadata.remove_axis`, as in flax.linen.
PARTITION_NAME = "partition_name"

B = TypeVar("B", bound="AxisMetadata")
PB = TypeVar("PB", bound="Partitioned")

_UNBOX_FIRST = (
    "{cls} is a metadata box, not an array: {what}. Call st.unbox(tree) (or "
    "box.unbox()) to get the arrays, and st.replace_boxed(tree, new_values) to "
    "put results back into the boxes."
)


def _not_an_array(what: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(_UNBOX_FIRST.format(cls=type(self).__name__, what=what))

    refuse.__name__ = f"refuse_{what.split()[0]}"
    return refuse


#: The functions of jax's arrays that read `__jax_array__` to compare.
_JAX_COMPARISONS = frozenset({"_operator_eq", "_operator_ne"})


class _BoxType(abc.ABCMeta):
    """ABCMeta with `type`'s own C-level isinstance and issubclass checks.

    ABCMeta's checks run Python code on every call to support virtual
    subclasses (``register``), which boxes do not use; tree walks test every
    node, so this keeps `isinstance(x, AxisMetadata)` as cheap as for a plain
    class. Abstract methods are still enforced.
    """

    __instancecheck__ = type.__instancecheck__
    __subclasscheck__ = type.__subclasscheck__


class AxisMetadata(metaclass=_BoxType):
    """Abstract base for metadata boxes: a value plus metadata about its axes.

    Subclass it for your own metadata and register the subclass as a pytree
    node whose only child is the value (e.g. with
    ``jax.tree_util.register_dataclass``); every spmdtree function then treats
    it like the built-in boxes. `add_axis` and `remove_axis` must be inverses.

    A box is neither an array nor a sequence: converting it to an array, taking
    its length, iterating over it and arithmetic raise a `TypeError` that says
    to unbox first. Subclass it for real: virtual subclasses (``register``)
    are not boxes.

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
        # the lookup gives jnp.sum(box), lax.add(box, 1) ... our message. jax's
        # `array == box` looks it up too, and `==` must never raise, so there it
        # is absent and the box's own __eq__ answers.
        if sys._getframe(1).f_code.co_name in _JAX_COMPARISONS:
            raise AttributeError("__jax_array__")
        raise TypeError(
            _UNBOX_FIRST.format(cls=type(self).__name__, what="jax functions act on arrays")
        )

    __array__ = _not_an_array("converting it to an array")
    # numpy operators then defer to the box's own (refusing) operators and __eq__.
    __array_ufunc__ = None
    __len__ = _not_an_array("len() of a box is not defined")
    __iter__ = _not_an_array("iterating over a box is not defined")
    __getitem__ = _not_an_array("indexing a box is not defined")


# Arithmetic on a box is a mistake (it would be on the array inside): each
# operator raises the same TypeError, where Python's would not say what to do.
_OPERATORS = (
    *("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"),
    *("radd", "rsub", "rmul", "rtruediv", "rfloordiv", "rmod", "rpow", "rmatmul"),
    *("and", "or", "xor", "lshift", "rshift", "rand", "ror", "rxor"),
    *("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge"),
    *("float", "int", "complex", "index"),
)
for _op in _OPERATORS:
    setattr(AxisMetadata, f"__{_op}__", _not_an_array(f"__{_op}__ would act on the array inside"))
del _op


#: ``IS_BOX(x)``: whether `x` is a box, as a C-level call (for ``is_leaf=``).
IS_BOX = AxisMetadata.__instancecheck__


def short_dtype(dtype: Any) -> str:
    """jax's short dtype names: ``f32``, ``bf16``, ``i8``, ``u32``, ``c64``, ``bool``."""
    name = getattr(dtype, "name", str(dtype))
    short = name.replace("float", "f").replace("uint", "u").replace("int", "i")
    return short.replace("complex", "c")


def dtype_of(value: Any) -> Any:
    """The dtype of an array-like, or the one jax gives a Python number."""
    dtype = getattr(value, "dtype", None)
    return jax.typeof(value).dtype if dtype is None else dtype


def _short_value(value: Any) -> str:
    """``f32[256,512]`` for an array-like, the repr for anything else."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return fmt(value)
    return f"{short_dtype(dtype)}[{','.join(str(d) for d in shape)}]"


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of an array-like or Python number; None for anything else."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(shape)
    if isinstance(value, (bool, int, float, complex)):
        return ()
    return None


def is_array(value: Any) -> bool:
    """Whether `value` is one array-like leaf (array, ShapeDtypeStruct, number)."""
    return shape_of(value) is not None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def checked_names(value: Any, names: Any) -> Names:
    """`names` normalised, checked to name each dimension of `value` once.

    Raises:
        LeafError: if an entry is of the wrong kind or the rank differs.
    """
    names = normalize_names(names)
    shape = shape_of(value)
    if shape is not None and len(shape) != len(names):
        raise LeafError(
            ValueError,
            f"has names {names} for a value of shape {shape}: {_count(len(names), 'name')} "
            f"for {_count(len(shape), 'dimension')}. Give one name per dimension (None "
            "for a replicated one).",
        )
    return names


def _same_value(a: Any, b: Any) -> bool:
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


def rebuild(cls: type[PB], tree: tuple[Any, Any]) -> PB:
    """A box of type `cls` from its ``((value,), meta)``, without validation."""
    box = object.__new__(cls)
    box._tree = tree
    return box


@dataclasses.dataclass(frozen=True)
class _MeshRecipe:
    """A mesh as device ids, axis names and types: what a pickled box keeps of it."""

    device_ids: tuple[int, ...]
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_types: tuple[Any, ...]

    @classmethod
    def of(cls, mesh: Mesh) -> _MeshRecipe:
        ids = tuple(device.id for device in mesh.devices.flat)
        return cls(ids, mesh.devices.shape, tuple(mesh.axis_names), tuple(mesh.axis_types))

    def build(self) -> Mesh:
        by_id = {device.id: device for device in jax.devices()}
        missing = [i for i in self.device_ids if i not in by_id]
        if missing:
            raise ValueError(
                f"unpickling a box: its mesh has devices {missing[:5]}, which this process "
                "does not have. Unpickle it where the mesh's devices exist, or drop the "
                "mesh before pickling with box.replace(mesh=None)."
            )
        devices = np.array([by_id[i] for i in self.device_ids]).reshape(self.shape)
        return Mesh(devices, self.axis_names, axis_types=self.axis_types)


def _unpickle(cls: type[PB], value: Any, meta: tuple[Any, ...]) -> PB:
    if isinstance(meta[1], _MeshRecipe):
        meta = (meta[0], meta[1].build(), *meta[2:])
    return rebuild(cls, ((value,), meta))


def _read_only(name: str, get: Callable[[Any], Any], doc: str) -> Any:
    """A property that refuses assignment and deletion with a message saying what to do.

    Boxes are immutable through these properties rather than a ``__setattr__``
    override, which would slow down every unflatten (a plain slot store is the
    fastest way to build a box).
    """

    def refuse_set(self: Any, value: Any) -> NoReturn:
        raise AttributeError(
            f"{type(self).__name__} is immutable: cannot set {name!r}. Use "
            f"box.replace({name}=...) or box.replace_boxed(value) for a new box."
        )

    def refuse_delete(self: Any) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot delete {name!r}.")

    return property(get, refuse_set, refuse_delete, doc)


class Partitioned(AxisMetadata):
    """A value whose dimensions are named by mesh axes.

    Args:
        value: an array, a `jax.ShapeDtypeStruct`, or any pytree.
        names: one entry per dimension of `value`: a mesh axis name, ``None``
            (replicated), a tuple of mesh axis names, or
            ``PartitionSpec.UNCONSTRAINED``. Lists are stored as tuples.
        mesh: the mesh these names refer to, if fixed.

    Raises:
        TypeError: if an entry of `names` is of the wrong kind.
        ValueError: if `value` has a shape whose rank differs from ``len(names)``.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> box = st.Partitioned(jnp.zeros((256, 512)), ["data", "model"])
        >>> box
        Partitioned(f32[256,512], names=('data', 'model'))
        >>> box.get_partition_spec()
        P('data', 'model')
    """

    # The box stores exactly what flattening returns, ((value,), meta), so that
    # jax flattens it with a C-level attribute read (see `_register`).
    __slots__ = ("_tree",)
    _logical = False
    _fields: tuple[str, ...] = ("names", "mesh")
    _tree: tuple[tuple[Any], tuple[Any, ...]]

    def __init__(self, value: Any, names: Any, mesh: AnyMesh | None = None) -> None:
        self._init(value, names, (mesh,))

    def _init(self, value: Any, names: Any, rest: tuple[Any, ...]) -> None:
        check_mesh(type(self).__name__, rest[0], optional=True)
        try:
            self._tree = ((value,), (checked_names(value, names), *rest))
        except LeafError as e:
            raise raise_one(type(self).__name__, "the box", e) from None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

    value = _read_only("value", lambda self: self._tree[0][0], "The boxed value.")
    names = _read_only(
        "names", lambda self: self._tree[1][0], "The names of the value's dimensions (tuples)."
    )
    mesh = _read_only(
        "mesh", lambda self: self._tree[1][1], "The mesh the names refer to, or None."
    )

    def __reduce__(self) -> tuple[Any, ...]:
        (value,), meta = self._tree
        if isinstance(meta[1], Mesh):  # devices do not pickle; their ids do
            meta = (meta[0], _MeshRecipe.of(meta[1]), *meta[2:])
        return (_unpickle, (type(self), value, meta))

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
        (value,), (names, *rest) = self._tree
        extra = "".join(
            f", {field}={item!r}"
            for field, item in zip(self._fields[1:], rest, strict=True)
            if item is not None
        )
        return f"{type(self).__name__}({_short_value(value)}, names={names!r}{extra})"

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
        return rebuild(type(self), ((value,), self._tree[1]))

    def replace(self: PB, **changes: Any) -> PB:
        """Returns a new box with some of ``value``, ``names``, ``mesh`` (``rules``) changed.

        Unlike `replace_boxed`, the new box is validated like a constructed one.

        Example:
            >>> import jax.numpy as jnp, spmdtree as st
            >>> st.Partitioned(jnp.zeros((2, 4)), ("data", None)).replace(names=(None, "model"))
            Partitioned(f32[2,4], names=(None, 'model'))
        """
        (value,), meta = self._tree
        fields = dict(zip(("value", *self._fields), (value, *meta), strict=True))
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.replace: unknown field(s) {sorted(unknown)}; "
                f"the fields are {list(fields)}."
            )
        return type(self)(**{**fields, **changes})

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
        except LeafError as e:
            raise raise_one("add_axis", "the box", e) from None

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
        except LeafError as e:
            raise raise_one("remove_axis", "the box", e) from None

    def with_names(self: PB, names: Names) -> PB:
        """The same box with other (already normalised) names; not validated."""
        (value,), (_, *rest) = self._tree
        return rebuild(type(self), ((value,), (names, *rest)))

    def get_partition_spec(self) -> PartitionSpec:
        """Returns ``PartitionSpec(*names)``, the names as written (not resolved).

        Example:
            >>> import spmdtree as st
            >>> st.LogicallyPartitioned(1.0, ()).get_partition_spec()
            P()
        """
        return PartitionSpec(*self.names)

    def resolution(
        self,
        shape: tuple[int, ...] | None,
        rules: Rules,
        mesh: AnyMesh | None,
        strict: bool = False,
    ) -> Resolution:
        """How this box's names resolve for an array of `shape` on `mesh`.

        `shape` is the boxed value's, or that of an array inside a boxed
        subtree; `rules` serve logical names when the box has none of its own.

        Raises:
            LeafError: if the names cannot be right for this shape on this mesh.
        """
        mesh_shape = None if mesh is None else mesh_shape_of(mesh)
        return resolve(self.names, shape, self._logical, self.own_rules(rules), mesh_shape, strict)

    def own_rules(self, rules: Rules) -> Rules:
        """The rules this box resolves with: its own if it has them, else `rules`."""
        return rules

    def get_sharding(self, mesh: Mesh) -> NamedSharding:
        """Returns the resolved, shape-aware `NamedSharding` of the value on `mesh`.

        The same as ``st.to_sharding(box, mesh)``: logical names go through the
        box's rules, else the rules context.

        Raises:
            ValueError: if the names cannot be right for the value on `mesh`.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
            >>> st.Partitioned(jnp.zeros((6, 8)), ("data", "model")).get_sharding(mesh).spec
            P('data', 'model')
        """
        check_mesh("get_sharding", mesh)
        try:
            check_same_mesh(self.mesh, mesh)
            resolution = self.resolution(shape_of(self.value), rules_or_context(None), mesh)
            if resolution.problem is not None:
                raise LeafError(ValueError, resolution.problem)
            return named_sharding(mesh, resolution.spec)
        except LeafError as e:
            raise raise_one("get_sharding", "the box", e) from None


_VALUE_KEY = tree_util.GetAttrKey("value")


def _register(cls: type[Partitioned]) -> None:
    """Registers a box class as a pytree node with one child, ``value``.

    Flattening is a C-level attribute read of the stored ``((value,), meta)``
    and unflattening stores that one slot, skipping ``__init__``'s validation:
    this keeps boxes within a small factor of a raw tree's flatten/unflatten
    (see benchmarks/run.py).
    """
    new = object.__new__

    def unflatten(meta: tuple[Any, ...], children: Any) -> Partitioned:
        box = new(cls)
        box._tree = (children, meta)
        return box

    def flatten_with_keys(box: Partitioned) -> tuple[Any, Any]:
        (value,), meta = box._tree
        return ((_VALUE_KEY, value),), meta

    tree_util.register_pytree_with_keys(
        cls, flatten_with_keys, unflatten, flatten_func=operator.attrgetter("_tree")
    )


_register(Partitioned)


def check_same_mesh(own: AnyMesh | None, mesh: AnyMesh | None) -> None:
    """Raises a LeafError if a box's own mesh is not the mesh of the call."""
    if own is None or mesh is None or own is mesh:
        return
    if own == mesh or getattr(own, "abstract_mesh", own) == getattr(mesh, "abstract_mesh", mesh):
        return
    raise LeafError(
        ValueError,
        f"has its own mesh {own}, which is not the mesh of this call, {mesh}. "
        "Pass the box's mesh, or drop it from the box with box.replace(mesh=None).",
    )


class LogicallyPartitioned(Partitioned):
    """A value whose dimensions are named by logical names, mapped to mesh axes by rules.

    The rules come from, in order: the box's own `rules`, the ``rules=``
    argument of the function resolving it, the rules context.

    Args:
        value: an array, a `jax.ShapeDtypeStruct`, or any pytree.
        names: one logical name per dimension (entries as for `Partitioned`).
        mesh: the mesh the rules map onto, if fixed.
        rules: rules for this box only, as ``(logical_name, mesh_axes)`` pairs.

    Raises:
        TypeError: if a name or rule is of the wrong kind.
        ValueError: if `value` has a shape whose rank differs from ``len(names)``.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> box = st.LogicallyPartitioned(jnp.zeros((8, 16)), ["embed", "mlp"])
        >>> box
        LogicallyPartitioned(f32[8,16], names=('embed', 'mlp'))
        >>> st.to_spec(box, [("embed", "fsdp"), ("mlp", "tensor")])
        P('fsdp', 'tensor')
    """

    __slots__ = ()
    _logical = True
    _fields = ("names", "mesh", "rules")

    def __init__(
        self,
        value: Any,
        names: Any,
        mesh: AnyMesh | None = None,
        rules: RulesLike | None = None,
    ) -> None:
        own = None if rules is None else normalize_rules(rules, type(self).__name__)
        self._init(value, names, (mesh, own))

    rules = _read_only(
        "rules", lambda self: self._tree[1][2], "The box's own rules (normalised), or None."
    )

    def own_rules(self, rules: Rules) -> Rules:
        own = self._tree[1][2]
        return rules if own is None else own


def partition_name(params: Any) -> Any:
    """The axis name from flax's ``{PARTITION_NAME: name}``, or a plain name."""
    if isinstance(params, Mapping):
        if PARTITION_NAME not in params:
            raise LeafError(
                TypeError,
                f"got params {fmt(dict(params))} without the key {PARTITION_NAME!r}; "
                f"pass {{st.PARTITION_NAME: 'layers'}}, or the name itself.",
            )
        params = params[PARTITION_NAME]
    return normalize_names((params,), "axis name")[0]


def insert_name(names: Names, index: int, name: Any) -> Names:
    """`names` with `name` inserted so that it ends at position `index`."""
    size = len(names) + 1
    if not -size <= index < size:
        raise LeafError(
            ValueError,
            f"has names {names}, so a new axis can go at positions {-size} to "
            f"{size - 1}, not {index}. Pass an index in range (-1 appends).",
        )
    index %= size
    return (*names[:index], name, *names[index:])


def delete_name(names: Names, index: int, name: Any, *, check: bool = True) -> Names:
    """`names` without the entry at `index`, which must be `name` (if `check`)."""
    size = len(names)
    if not -size <= index < size:
        raise LeafError(
            ValueError,
            f"has names {names}, so there is no axis {index} to remove. Pass the "
            "same index that add_axis was given.",
        )
    if check and names[index] != name:
        raise LeafError(
            ValueError,
            f"has names {names}, so position {index} is {names[index]!r}, not "
            f"{name!r}. Pass the same index and name that add_axis was given.",
        )
    index %= size
    return names[:index] + names[index + 1 :]


def with_partitioning(
    fn: Callable[..., Any], names: Any, mesh: AnyMesh | None = None
) -> Callable[..., Partitioned]:
    """Wraps an initialiser so that it returns its value in a `Partitioned` box.

    Args:
        fn: the initialiser, e.g. ``jax.nn.initializers.lecun_normal()``.
        names: mesh axis names, one per dimension of what `fn` returns.
        mesh: the mesh, if fixed.

    Returns:
        A function with `fn`'s signature returning ``Partitioned(fn(...), names, mesh)``.

    Raises:
        TypeError: at once, if an entry of `names` is of the wrong kind.

    Example:
        >>> import jax, spmdtree as st
        >>> init = st.with_partitioning(jax.nn.initializers.lecun_normal(), (None, "model"))
        >>> init(jax.random.key(0), (4, 8))
        Partitioned(f32[4,8], names=(None, 'model'))
    """
    names = _checked_names("with_partitioning", names)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Partitioned:
        return Partitioned(fn(*args, **kwargs), names, mesh=mesh)

    return wrapper


def with_logical_partitioning(
    fn: Callable[..., Any],
    names: Any,
    mesh: AnyMesh | None = None,
    rules: RulesLike | None = None,
) -> Callable[..., LogicallyPartitioned]:
    """Wraps an initialiser so that it returns its value in a `LogicallyPartitioned` box.

    Args:
        fn: the initialiser.
        names: logical names, one per dimension of what `fn` returns.
        mesh: the mesh, if fixed.
        rules: rules for these boxes only; usually left to the caller.

    Returns:
        A function with `fn`'s signature returning a `LogicallyPartitioned`.

    Raises:
        TypeError: at once, if a name or rule is of the wrong kind.

    Example:
        >>> import jax, spmdtree as st
        >>> init = st.with_logical_partitioning(jax.nn.initializers.zeros, ("mlp",))
        >>> init(jax.random.key(0), (8,))
        LogicallyPartitioned(f32[8], names=('mlp',))
    """
    names = _checked_names("with_logical_partitioning", names)
    rules = None if rules is None else normalize_rules(rules, "with_logical_partitioning")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> LogicallyPartitioned:
        return LogicallyPartitioned(fn(*args, **kwargs), names, mesh=mesh, rules=rules)

    return wrapper


def _checked_names(function: str, names: Any) -> Names:
    try:
        return normalize_names(names)
    except LeafError as e:
        raise raise_one(function, "the initialiser", e) from None
