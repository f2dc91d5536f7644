"""The machinery that makes boxes cheap pytree nodes that pickle.

A box stores exactly what flattening returns, ``((value,), meta)``, in one
slot, so jax flattens it with a C-level attribute read and unflattens it with
one slot store, skipping validation; this keeps boxes within a small factor of
a raw tree (benchmarks/run.py, B1). Boxes are immutable through read-only
properties rather than a ``__setattr__`` override, which would slow down every
unflatten. A concrete mesh in the metadata pickles as device ids.
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import jax
import numpy as np
from jax import tree_util
from jax.sharding import Mesh

B = TypeVar("B")

_VALUE_KEY = tree_util.GetAttrKey("value")


class BoxType(abc.ABCMeta):
    """ABCMeta with `type`'s own C-level isinstance and issubclass checks.

    ABCMeta's checks run Python code on every call to support virtual
    subclasses (``register``), which boxes do not use; tree walks test every
    node, so this keeps ``isinstance(x, AxisMetadata)`` as cheap as for a plain
    class. Abstract methods are still enforced.
    """

    __instancecheck__ = type.__instancecheck__
    __subclasscheck__ = type.__subclasscheck__


def register(cls: type) -> None:
    """Registers a box class as a pytree node whose one child is ``value``."""
    new = object.__new__

    def unflatten(meta: Any, children: Any) -> Any:
        box: Any = new(cls)
        box._tree = (children, meta)
        return box

    def flatten_with_keys(box: Any) -> tuple[Any, Any]:
        (value,), meta = box._tree
        return ((_VALUE_KEY, value),), meta

    tree_util.register_pytree_with_keys(
        cls, flatten_with_keys, unflatten, flatten_func=operator.attrgetter("_tree")
    )


def rebuild(cls: type[B], value: Any, meta: Any) -> B:
    """A box of type `cls` holding `value` under `meta`, without validation."""
    box = object.__new__(cls)
    box._tree = ((value,), meta)  # type: ignore[attr-defined]
    return box


def read_only(name: str, get: Callable[[Any], Any], doc: str) -> Any:
    """A property that refuses assignment and deletion, saying what to do instead."""

    def refuse_set(self: Any, value: Any) -> NoReturn:
        raise AttributeError(
            f"{type(self).__name__} is immutable: cannot set {name!r}. Use "
            f"box.replace({name}=...) or box.replace_boxed(value) for a new box."
        )

    def refuse_delete(self: Any) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot delete {name!r}.")

    return property(get, refuse_set, refuse_delete, doc)


@dataclasses.dataclass(frozen=True)
class MeshRecipe:
    """A mesh as device ids, axis names and types: what a pickled box keeps of it."""

    device_ids: tuple[int, ...]
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_types: tuple[Any, ...]

    @classmethod
    def of(cls, mesh: Mesh) -> MeshRecipe:
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


def reduce(box: Any) -> tuple[Any, ...]:
    """``__reduce__`` for a box: devices do not pickle, their ids do."""
    (value,), meta = box._tree
    if isinstance(meta.mesh, Mesh):
        meta = meta._replace(mesh=MeshRecipe.of(meta.mesh))
    return (_unpickle, (type(box), value, meta))


def _unpickle(cls: type[B], value: Any, meta: Any) -> B:
    if isinstance(meta.mesh, MeshRecipe):
        meta = meta._replace(mesh=meta.mesh.build())
    return rebuild(cls, value, meta)
