"""Transforms that keep metadata right: `vmap`, `scan`, and `sharded_init`.

A plain `jax.vmap` over boxes stacks their values but leaves their names as
they were, so the names no longer describe the values. `vmap` and `scan` fix
the names on the way in (a mapped box loses the mapped axis) and on the way out
(a stacked box gains it) — the functional form of flax.linen's
``metadata_params={PARTITION_NAME: ...}``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax

from spmdtree._src.errors import Mistake, public
from spmdtree._src.resolve import (
    check_mesh,
)
from spmdtree._src.rules import (
    PyTree,
    Rules,
)
from spmdtree._src.specs import resolve_tree, shardings
from spmdtree._src.trees import change_axes

#: ``(subtree, axis, where) -> subtree``, applied under each leaf of an axes prefix tree.
PerAxis: TypeAlias = Callable[[PyTree, int | None, str], PyTree]


def _per_prefix(fn: PerAxis, axes: PyTree, tree: PyTree, argument: str) -> PyTree:
    """Applies ``fn(subtree, axis, where)`` under each leaf of the prefix tree `axes`;
    `where` is the subtree's key path under the name `argument`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, axis, sub: fn(sub, axis, argument + jax.tree_util.keystr(path)),
        axes,
        tree,
        is_leaf=lambda a: a is None,
    )


def _without_axis(partition_name: str | None) -> PerAxis:
    """`(tree, axis, where) -> tree` whose boxes lose the axis `axis` about to be
    mapped over (any name, or `partition_name` if given).

    As in flax's lifted transforms, each box's `remove_axis` sees the whole,
    unmapped value, as its `add_axis` sees the stacked result.
    """

    def strip(tree: PyTree, axis: int | None, argument: str) -> PyTree:
        if axis is None:
            return tree
        return change_axes(
            tree,
            axis,
            partition_name,
            add=False,
            argument=argument,
            match_name=partition_name is not None,
            unmapped=True,
        )

    return strip


def _with_axis(partition_name: str | None) -> PerAxis:
    """`(tree, axis, where) -> tree` whose boxes gain the axis `axis`, named `partition_name`."""

    def add(tree: PyTree, axis: int | None, argument: str) -> PyTree:
        if axis is None:
            return tree
        return change_axes(tree, axis, partition_name, add=True, argument=argument)

    return add


def vmap(
    fn: Callable[..., Any],
    *,
    in_axes: int | Sequence[Any] | None = 0,
    out_axes: Any = 0,
    partition_name: str | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """`jax.vmap` that keeps box names right.

    Boxes in mapped inputs lose the mapped axis before `fn` sees them; boxes in
    the outputs gain the new axis, named `partition_name` (None: replicated).
    Stacked-layer init: ``st.vmap(init_layer, partition_name="layers")(keys)``.

    Args:
        fn: the function to map.
        in_axes: as for `jax.vmap` (an int, None, or a prefix tree of the
            positional arguments); keyword arguments are mapped over axis 0.
        out_axes: as for `jax.vmap`; a negative axis counts from the end.
        partition_name: the name of the mapped axis in box names. Given, a
            mapped input's box must have this name at the mapped axis.
        **kwargs: passed to `jax.vmap` (``axis_name``, ``axis_size``, ...).

    Returns:
        The mapped function.

    Raises:
        ValueError: (when called) if a mapped box has another name than
            `partition_name` at the mapped axis, or names that do not include it.

    Example:
        >>> import jax, spmdtree as st
        >>> def init_layer(key):
        ...     return {"w": st.LogicallyPartitioned(jax.random.normal(key, (4, 8)), ("embed", "mlp"))}
        >>> layers = st.vmap(init_layer, partition_name="layers")(jax.random.split(jax.random.key(0), 3))
        >>> layers["w"]
        LogicallyPartitioned(f32[3,4,8], names=('layers', 'embed', 'mlp'))
    """
    strip = _without_axis(partition_name)
    add = _with_axis(partition_name)

    def mapped(*args: Any, **kw: Any) -> Any:
        axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        args = tuple(_per_prefix(strip, tuple(axes), args, "args"))
        kw = strip(kw, 0, "kwargs")
        out = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, **kwargs)(*args, **kw)
        return _per_prefix(add, out_axes, out, "outputs")

    return functools.wraps(fn)(public(mapped, "vmap"))


@public
def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: PyTree,
    xs: PyTree = None,
    length: int | None = None,
    *,
    partition_name: str | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """`jax.lax.scan` that keeps box names right.

    `f` sees the boxes of `xs` without the scanned (leading) axis; boxes in the
    stacked outputs gain it, named `partition_name`. The usual use: run stacked
    layers, ``st.scan(block, x, params["layers"])``.

    Args:
        f: ``(carry, x) -> (carry, y)``.
        init: the initial carry.
        xs: the stacked inputs (boxes with the scanned axis first in their names).
        length: as for `jax.lax.scan`.
        partition_name: the name of the scanned axis. Given, each box of `xs`
            must have this name first.
        **kwargs: passed to `jax.lax.scan` (``reverse``, ``unroll``, ...).

    Returns:
        ``(carry, ys)``, as `jax.lax.scan`.

    Raises:
        ValueError: if a box of `xs` has another name first than `partition_name`.

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> stacked = {"w": st.Partitioned(jnp.ones((3, 4)), ("layers", "model"))}
        >>> def body(carry, layer):
        ...     assert layer["w"].names == ("model",)  # the scanned axis is gone
        ...     return carry + st.unbox(layer)["w"].sum(), layer
        >>> total, ys = st.scan(body, 0.0, stacked, partition_name="layers")
        >>> float(total), ys["w"].names
        (12.0, ('layers', 'model'))
    """
    xs = _without_axis(partition_name)(xs, 0, "xs")
    carry, ys = jax.lax.scan(f, init, xs, length=length, **kwargs)
    return carry, _with_axis(partition_name)(ys, 0, "ys")


@public
def sharded_init(
    init_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    rules: Rules | None = None,
    **jit_kwargs: Any,
) -> Callable[..., Any]:
    """Builds a boxed tree directly in its shardings: no device holds an unsharded copy.

    The returned function has `init_fn`'s signature. When called, it traces
    `init_fn` abstractly (`jax.eval_shape`), turns the boxes into shardings
    (`to_sharding`), and runs ``jax.jit(init_fn, out_shardings=...)``, so each
    device computes only its own shards. Its ``lower(*args)`` gives the
    lowered computation, e.g. for a memory analysis.

    Args:
        init_fn: a function returning a tree with boxes, e.g. ``init(key)``.
            Arguments that are not arrays (sizes) are best bound with
            `functools.partial` or made static with ``static_argnums``.
        mesh: the device mesh.
        rules: rules for logical boxes without their own.
        **jit_kwargs: passed to `jax.jit` (``static_argnums``, ``donate_argnums``, ...).

    Returns:
        A function with `init_fn`'s signature returning the sharded, boxed tree.

    Raises:
        ValueError: (when called) for names that cannot be right on `mesh`.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> def init(key):
        ...     return {"w": st.Partitioned(jax.random.normal(key, (8, 16)), ("data", "model"))}
        >>> params = st.sharded_init(init, mesh)(jax.random.key(0))
        >>> params["w"].value.addressable_shards[0].data.shape
        (4, 4)
    """
    check_mesh(mesh)
    static_nums = _as_tuple(jit_kwargs.get("static_argnums", ()))
    static_names = _as_tuple(jit_kwargs.get("static_argnames", ()))

    def jitted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        wrong = [i for i in static_nums if not -len(args) <= i < len(args)]
        if wrong:
            raise Mistake(
                ValueError,
                f"static_argnums holds {wrong[0]}, but the initialiser was called with "
                f"{len(args)} positional arguments (positions {-len(args)} to "
                f"{len(args) - 1}). Pass positions of the arguments it is called with.",
            )
        nums = {i % len(args) for i in static_nums}

        def with_static(dynamic_args: list[Any], dynamic_kwargs: dict[str, Any]) -> Any:
            rest = iter(dynamic_args)
            full = [args[i] if i in nums else next(rest) for i in range(len(args))]
            static_kwargs = {k: v for k, v in kwargs.items() if k in static_names}
            return init_fn(*full, **dynamic_kwargs, **static_kwargs)

        abstract = jax.eval_shape(
            with_static,
            [a for i, a in enumerate(args) if i not in nums],
            {k: v for k, v in kwargs.items() if k not in static_names},
        )
        out = shardings(resolve_tree(abstract, rules, mesh=mesh), mesh)
        return jax.jit(init_fn, out_shardings=out, **jit_kwargs)

    def init(*args: Any, **kwargs: Any) -> Any:
        return jitted(args, kwargs)(*args, **kwargs)

    def lower(*args: Any, **kwargs: Any) -> Any:
        return jitted(args, kwargs).lower(*args, **kwargs)

    built = functools.wraps(init_fn)(public(init, "sharded_init"))
    built.lower = public(lower, "sharded_init")  # type: ignore[attr-defined]
    return built


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return (x,) if isinstance(x, (int, str)) else tuple(x)
