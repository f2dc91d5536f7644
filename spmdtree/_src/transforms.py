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
import jax.numpy as jnp

from spmdtree._src.errors import Mistake, at, public
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


def split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """`x`'s leading (batch) dimension as `count` microbatches of rows strided over
    it: microbatch i holds rows i, i + count, ..., so every device's contiguous
    shard of the batch holds its share of each microbatch, and the batch's sharding
    stays on the rows (a reshape to ``(count, rows)`` would put it on the
    microbatch index, each microbatch on a few devices: the SPMD pitfall)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def check_count(value: object, what: str, meaning: str) -> int:
    """`value`, an int >= 1 (`what`, which is `meaning`), or the Mistake that says it
    is not; a traced one is told it must be static (new in 0.8)."""
    if not isinstance(value, int) or isinstance(value, bool):
        static = (
            "; a Python int, as the program's shapes depend on it: pass it static (jax.jit's "
            "static_argnums)"
            if hasattr(value, "shape")
            else ""
        )
        raise Mistake(TypeError, f"{what} is {value!r}; expected an int >= 1 ({meaning}{static}).")
    if value < 1:
        raise Mistake(ValueError, f"{what} is {value}; expected an int >= 1.")
    return value


def check_microbatches(tree: PyTree, count: int, argument: str, passed: str) -> None:
    """Raises a Mistake unless every leaf of `tree` has a leading (batch) dimension
    that `count` microbatches divide; the wrong leaves are named by their paths
    under `argument`, and what is not per example is to be passed `passed`."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    scalars = [at(argument, path) for path, leaf in leaves if not jnp.ndim(leaf)]
    if scalars:
        raise Mistake(
            ValueError,
            f"{', '.join(scalars)} {'is a scalar' if len(scalars) == 1 else 'are scalars'}: "
            f"every leaf of the {argument} needs the batch as its leading dimension to be "
            f"split into microbatches. Pass what is not per example {passed} (a closure).",
        )
    wrong = [
        f"{at(argument, path)} (shape {tuple(jnp.shape(leaf))})"
        for path, leaf in leaves
        if jnp.shape(leaf)[0] % count
    ]
    if wrong:
        raise Mistake(
            ValueError,
            f"{count} microbatches do not divide the leading (batch) dimension "
            f"of {', '.join(wrong)}. Give a batch the count divides, or another count.",
        )


def join_microbatches(x: jax.Array) -> jax.Array:
    """The batch that `split_microbatches` split into ``x.shape[0]`` microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def accumulate(fn: Callable[[Any, Any], Any], microbatches: int) -> Callable[[Any, Any], Any]:
    """Gradient accumulation as a combinator: ``fn(params, batch)`` run on
    `microbatches` slices of the batch in turn (a `jax.lax.scan`), its outputs
    averaged (new in 0.6).

    `fn` is what `jax.value_and_grad` returns (or any function of ``(params,
    batch)`` whose outputs are floating-point pytrees: an integer output, a
    count in an aux, is averaged into a float): for a loss that is a mean
    over the batch, the result equals ``fn(params, batch)`` to float tolerance,
    with the activations of one microbatch alive at a time: a lower peak (what
    preflight measures) for more, smaller kernels and a loop (what the
    prediction times). Each microbatch keeps the batch's sharding on its batch
    dimension (the microbatch index is never sharded), so every device works on
    every microbatch. jit-, grad- and optax-friendly: a pure function.

    Args:
        fn: ``(params, batch) -> outputs``; `batch` a pytree whose every leaf has
            the batch as its leading dimension.
        microbatches: how many microbatches (an int >= 1; 1 is `fn` itself).

    Returns:
        ``(params, batch) -> outputs``, the microbatches' outputs averaged.

    Raises:
        TypeError: for a `microbatches` that is no int.
        ValueError: for `microbatches` < 1, or (when called) a batch leaf whose
            leading dimension the count does not divide, each named by its path.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
        >>> w, batch = jnp.ones((3, 1)), {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.ones((8, 1))}
        >>> whole = jax.value_and_grad(loss)(w, batch)
        >>> parts = jax.jit(st.accumulate(jax.value_and_grad(loss), 4))(w, batch)
        >>> bool(jnp.allclose(whole[0], parts[0])), bool(jnp.allclose(whole[1], parts[1]))
        (True, True)
        >>> st.accumulate(jax.value_and_grad(loss), 3)(w, batch)
        Traceback (most recent call last):
        ...
        ValueError: accumulate: 3 microbatches do not divide the leading (batch) dimension of batch['x'] (shape (8, 3)), batch['y'] (shape (8, 1)). Give a batch the count divides, or another count.
    """
    try:
        check_count(microbatches, "microbatches", "the microbatches each batch is split into")
    except Mistake as mistake:
        raise mistake.error("accumulate") from None

    def accumulated(params: Any, batch: Any) -> Any:
        if microbatches == 1:
            return fn(params, batch)
        check_microbatches(batch, microbatches, "batch", "with the params")
        split = jax.tree.map(lambda x: split_microbatches(x, microbatches), batch)
        one = jax.tree.map(lambda x: x[0], split)
        # zeros laid out as the outputs are (on Explicit axes their sharding is their type)
        zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, params, one))

        def add(total: Any, micro: Any) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, total, fn(params, micro)), None

        total, _ = jax.lax.scan(add, zero, split)
        return jax.tree.map(lambda t: t / microbatches, total)

    return functools.wraps(fn)(public(accumulated, "accumulate"))
