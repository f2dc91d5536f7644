"""Attention over a sequence sharded on a mesh axis (new in 0.8): `context_attention`
runs it, and `balanced_order` orders the tokens so that causal attention's work is
even over the shards.

Context parallelism splits every sequence's length over a mesh axis
(``"context"``): each device holds a contiguous shard of the tokens. A query needs
every key, so `context_attention` all-gathers K and V along that axis (MaxText's
default context-parallel strategy, ``context_parallel_strategy="all_gather"``) and
each device runs its own queries against all of them; the backward pass sums each
device's dK and dV over the axis (a reduce-scatter, or an all-reduce where the
compiler lays out the mesh's other axes). Causal attention is uneven over
contiguous shards: the last shard's queries see every key, the first's only their
own. `balanced_order` permutes the tokens so that each shard holds one early chunk
and one late one (MaxText's dual-chunk swap); the positions passed with them keep
causality as the unpermuted sequence had it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from spmdtree._src.errors import Mistake, public
from spmdtree._src.resolve import axes_of
from spmdtree._src.rules import AxisName
from spmdtree._src.specs import context_axis
from spmdtree._src.transforms import check_count

#: The context mesh axis's name, unless told otherwise.
CONTEXT = "context"
#: How each shard computes its attention: XLA's (anywhere), cuDNN's fused kernel (on a
#: GPU), the splash attention Pallas kernel (on a TPU).
Implementation = Literal["xla", "cudnn", "splash"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("xla", "cudnn", "splash")
#: The queries (and keys) of one block of the splash kernel: a shard's queries come in
#: whole blocks.
SPLASH_BLOCK = 128


@public
def balanced_order(length: int, shards: int) -> np.ndarray:
    """The order of a sequence's tokens that balances causal attention over `shards`
    contiguous shards: MaxText's dual-chunk swap (new in 0.8).

    The sequence is cut into ``2 x shards`` chunks of equal length, and shard ``i``
    holds chunk ``i`` followed by chunk ``2 x shards - 1 - i``: one early chunk and
    its mirror, so every shard's queries see about as many keys. The order is
    MaxText's ``max_utils.reorder_sequence`` (AI-Hypercomputer/maxtext,
    ``src/maxtext/utils/max_utils.py``: "[0, 1, 2, 3, 4, 5, 6, 7] -> [0, 1, 6, 7, 2,
    3, 4, 5]" for two shards), the ``DualChunkSwap`` of Transformer Engine's
    ``reorder_causal_load_balancing``.

    ``tokens[:, order]`` is the balanced sequence, and ``order`` is each of its
    tokens' position: pass it as `context_attention`'s ``positions``, and the result
    is the unpermuted attention's, permuted alike. ``np.argsort(order)`` undoes it.

    Args:
        length: the sequence's length, a multiple of ``2 x shards``.
        shards: the context axis's devices.

    Returns:
        A numpy int array ``[length]``, a permutation of ``range(length)``.

    Raises:
        TypeError: for a `length` or `shards` that is not an int.
        ValueError: for `shards` or `length` < 1, or a `length` that ``2 x shards``
            does not divide.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> st.balanced_order(8, 2)
        array([0, 1, 6, 7, 2, 3, 4, 5])
        >>> order = st.balanced_order(16, 4)
        >>> order.reshape(4, 4)  # what each of 4 shards holds
        array([[ 0,  1, 14, 15],
               [ 2,  3, 12, 13],
               [ 4,  5, 10, 11],
               [ 6,  7,  8,  9]])
        >>> mesh = jax.make_mesh((2, 4), ("data", "context"))
        >>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
        >>> with jax.set_mesh(mesh):
        ...     out = jax.jit(st.context_attention)(q[:, order], k[:, order], v[:, order], positions=order)
        >>> unsplit = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        >>> bool(jnp.allclose(out, unsplit[:, order], atol=1e-5))
        True
        >>> st.balanced_order(12, 4)
        Traceback (most recent call last):
        ...
        ValueError: balanced_order: length is 12, which the 8 chunks of 4 shards (2 x shards) do not divide. Pad the sequence to a multiple of 8 (16).
    """
    check_count(length, "length", "the sequence's length")
    check_count(shards, "shards", "the context axis's devices")
    chunks = 2 * shards
    if length % chunks:
        raise Mistake(
            ValueError,
            f"length is {length}, which the {chunks} chunks of {shards} shard"
            f"{'s' * (shards > 1)} (2 x shards) do not divide. Pad the sequence to a "
            f"multiple of {chunks} ({-(-length // chunks) * chunks}).",
        )
    chunk = np.arange(length).reshape(chunks, length // chunks)
    return np.stack([chunk[:shards], chunk[::-1][:shards]], axis=1).reshape(length)


@public
def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: str = CONTEXT,
    causal: bool = True,
    positions: jax.Array | np.ndarray | None = None,
    implementation: Implementation | None = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention(q, k, v, is_causal=causal)`` over a sequence whose
    length is sharded on the mesh axis `axis` (new in 0.8).

    The arrays are ``[batch, length, heads, head_dim]``; K and V may have fewer heads,
    which divide q's (grouped-query attention). K and V are all-gathered along `axis`
    (MaxText's default context-parallel strategy) and each device runs its own
    queries, a contiguous shard of the length, against every key. The mesh is the
    one in context (`jax.set_mesh`), as `pipeline` takes it. Every other axis stays
    as the arrays have it (a batch on ``"data"``, heads on ``"tensor"``): nothing
    but K and V along `axis` is gathered.

    Where the mesh's other axes are Explicit (`jax.make_mesh`'s default) or of size
    1, the shards run manual over every axis, laid out as q's type says (K and V
    resharded alike), and the backward pass sums dK and dV over `axis` by a
    reduce-scatter. Where they are Auto, the arrays' layout is the compiler's: K
    and V are constrained whole along the length, the shards run manual over `axis`
    alone, and dK and dV are summed by an all-reduce (a shard_map manual over
    `axis` alone with the gather inside it gathers the batch over the other axes
    too, jax 0.10.2). A kernel (cuDNN's, splash) runs manual over every axis, since
    neither cuDNN's partitioner nor Mosaic splits one over a shard_map's auto axes:
    on Auto axes, whose arrays' types do not say how they are split, it splits the
    batch over them (a data split's layout), which they must divide.

    The result equals the unsharded attention's to float tolerance, its gradients
    too; it has q's shape and dtype, its length sharded on `axis`. Pure: composes
    with `jax.jit` and `jax.grad`.

    Args:
        q: queries ``[batch, length, heads, head_dim]``.
        k: keys ``[batch, length, kv_heads, head_dim]``, `kv_heads` dividing `heads`.
        v: values, shaped as `k`.
        axis: the context mesh axis, which divides the length.
        causal: whether a query attends only the keys at its position or before.
        positions: each token's position ``[length]`` (ints), for tokens permuted
            (`balanced_order`): the query at position p attends the keys at
            positions <= p. None: a token's position is its index. Non-causal
            attention does not read it.
        implementation: how each shard computes its attention: None or ``"xla"``
            (XLA's, anywhere), ``"cudnn"`` (cuDNN's fused kernel, on a GPU: float16
            or bfloat16; the causal mask goes to it as a bias, since its own is
            aligned at the first query) or ``"splash"`` (the splash attention Pallas
            kernel, on a TPU: each shard's queries a multiple of 128, and positions
            None or a permutation of the tokens known when tracing, such as
            `balanced_order`'s: each shard puts the gathered K and V back in
            order, and the kernel's mask, built whole and split along the queries
            as MaxText builds it, skips the blocks no query attends). A kernel
            on Auto axes splits the batch over them.

    Returns:
        The attention ``[batch, length, heads, head_dim]``, sharded along its length
        on `axis`.

    Raises:
        TypeError: for an `axis` that is not a string, or positions that are not
            integers.
        ValueError: for arrays that are not 4-D or whose shapes or dtypes disagree,
            K and V heads that do not divide q's, no mesh in context or one without
            `axis`, a length that `axis` does not divide, positions not of shape
            ``[length]``, an unknown `implementation`, and what its kernel cannot
            do (see `implementation`).

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "context"))
        >>> q = jax.random.normal(jax.random.key(0), (2, 16, 8, 4))
        >>> k, v = (jax.random.normal(jax.random.key(i), (2, 16, 2, 4)) for i in (1, 2))
        >>> with jax.set_mesh(mesh):
        ...     out = jax.jit(st.context_attention)(q, k, v)
        >>> out.sharding.spec
        P(None, 'context', None, None)
        >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
        True
        >>> with jax.set_mesh(mesh):
        ...     st.context_attention(q[:, :15], k[:, :15], v[:, :15])
        Traceback (most recent call last):
        ...
        ValueError: context_attention: q's length is 15, which the context axis 'context' (4 devices) does not divide. Pad the sequence to a multiple of 4 (16).
    """
    if not isinstance(axis, str):
        raise Mistake(
            TypeError,
            f"axis is {axis!r}; expected the context mesh axis's name, a str. Pass the "
            "name the mesh gives it (axis='context').",
        )
    kind = _implementation(implementation)
    _check_arrays(q, k, v, kind)
    shards = context_axis(axis, "context", "the sequence is sharded")
    length = q.shape[1]
    if length % shards:
        raise Mistake(
            ValueError,
            f"q's length is {length}, which the context axis {axis!r} ({shards} devices) "
            f"does not divide. Pad the sequence to a multiple of {shards} "
            f"({-(-length // shards) * shards}).",
        )
    order = _positions(positions, length)
    return _attention(q, k, v, order, axis=axis, causal=bool(causal), kind=kind)


def _implementation(implementation: object) -> Implementation:
    """The implementation asked for, None being XLA's."""
    if implementation is None:
        return "xla"
    if implementation not in IMPLEMENTATIONS:
        raise Mistake(
            ValueError,
            f"implementation is {implementation!r}; expected None or 'xla' (XLA's, "
            "anywhere), 'cudnn' (cuDNN's fused kernel, on a GPU) or 'splash' (the splash "
            "attention kernel, on a TPU).",
        )
    return implementation


def _check_arrays(q: jax.Array, k: jax.Array, v: jax.Array, kind: Implementation) -> None:
    """Q, K and V as attention over one sequence takes them."""
    shapes = {name: tuple(jnp.shape(x)) for name, x in (("q", q), ("k", k), ("v", v))}
    flat = [f"{name} {shape}" for name, shape in shapes.items() if len(shape) != 4]
    if flat:
        raise Mistake(
            ValueError,
            f"{', '.join(flat)} {'is' if len(flat) == 1 else 'are'} not 4-D; expected "
            "[batch, length, heads, head_dim] arrays.",
        )
    said = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
    (batch, length, heads, width), kv = shapes["q"], shapes["k"]
    if kv != shapes["v"] or (kv[0], kv[1], kv[3]) != (batch, length, width):
        raise Mistake(
            ValueError,
            f"the shapes disagree: {said}. Give k and v one shape, with q's batch, "
            "length and head_dim (the keys and values of q's own sequence).",
        )
    if heads % kv[2]:
        raise Mistake(
            ValueError,
            f"k and v have {kv[2]} heads, which do not divide q's {heads}; grouped-query "
            f"attention shares each K/V head among the same number of q's. Give k and v "
            f"a number of heads that divides {heads}.",
        )
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) > 1:
        raise Mistake(
            ValueError,
            f"the dtypes disagree: q {q.dtype}, k {k.dtype}, v {v.dtype}. Cast them to one dtype.",
        )
    if kind == "cudnn" and jnp.dtype(q.dtype) not in (jnp.float16, jnp.bfloat16):
        raise Mistake(
            ValueError,
            f"implementation 'cudnn' takes float16 or bfloat16 arrays (cuDNN's fused "
            f"attention), not {q.dtype}. Cast them, or use implementation='xla'.",
        )


def _positions(positions: object, length: int) -> jax.Array | np.ndarray | None:
    """The tokens' positions as int32 (numpy where they are known when tracing), or
    None."""
    if positions is None:
        return None
    shape, dtype = getattr(positions, "shape", None), getattr(positions, "dtype", None)
    if shape is None or dtype is None:
        positions = np.asarray(positions)
        shape, dtype = positions.shape, positions.dtype
    if tuple(shape) != (length,):
        raise Mistake(
            ValueError,
            f"positions has shape {tuple(shape)}; expected ({length},): one position per "
            "token, as q's length dimension (dimension 1) holds them.",
        )
    if not jnp.issubdtype(dtype, jnp.integer):
        raise Mistake(
            TypeError,
            f"positions has dtype {dtype}; expected integers, each token's position. Pass "
            "integer positions, such as st.balanced_order's.",
        )
    if isinstance(positions, np.ndarray):
        return positions.astype(np.int32)
    return jnp.asarray(positions, jnp.int32)


def _spec(x: jax.Array) -> tuple[AxisName, ...]:
    """The entries of `x`'s sharding its type says, one per dimension."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (jnp.ndim(x) - len(spec))


def _kept(entry: AxisName, keep: Callable[[str], bool]) -> AxisName:
    """A spec's entry with only the axes `keep` keeps."""
    kept = tuple(a for a in axes_of(entry) if keep(a))
    return kept[0] if len(kept) == 1 else (kept or None)


def _resharded(x: Any, spec: PartitionSpec) -> Any:
    """`x` laid out on the mesh's Explicit axes as `spec` says (its type names no
    other), resharded where its type says otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    typed = tuple(_kept(entry, explicit.__contains__) for entry in spec)
    typed += (None,) * (jnp.ndim(x) - len(typed))
    return x if _spec(x) == typed else jax.sharding.reshard(x, PartitionSpec(*typed))


class Layout(NamedTuple):
    """How the shards of `context_attention` lie: q, K and V as they go in (resharded
    where need be), their specs, the output's, the axes the shard_map is manual over,
    whether K and V are gathered inside it, and the q heads each shard holds."""

    qkv: tuple[jax.Array, jax.Array, jax.Array]
    specs: tuple[PartitionSpec, PartitionSpec, PartitionSpec]
    out: PartitionSpec
    manual: frozenset[str]
    gather: bool
    heads: int


def _layout(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, kind: Implementation) -> Layout:
    """The shards' layout on the mesh in context. Where every axis but `axis` is
    Explicit or of size 1: manual over every axis, laid out as q's type says, K and V
    as q, gathered inside. Else, on the Auto axes the compiler splits the arrays over
    (a shard_map manual over `axis` alone with the gather inside gathers them too,
    jax 0.10.2): K and V whole along the length, every other dimension left to the
    compiler, and the shards, manual over `axis` alone, run on them with no
    collective. A kernel is never split by the compiler: on such axes it splits the
    batch over them (`_kernel_layout`)."""
    mesh = jax.sharding.get_abstract_mesh()
    spread = {
        name: size
        for name, size, kind_of in zip(
            mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True
        )
        if name != axis and size > 1 and kind_of != AxisType.Explicit
    }
    if spread and kind != "xla":
        return _kernel_layout(q, k, v, axis, spread, kind)
    if spread:
        free = PartitionSpec.UNCONSTRAINED
        whole = PartitionSpec(free, None, free, free)
        k, v = (jax.lax.with_sharding_constraint(x, whole) for x in (k, v))
        specs = (PartitionSpec(None, axis), PartitionSpec(), PartitionSpec())
        return Layout((q, k, v), specs, specs[0], frozenset({axis}), False, q.shape[2])
    spec = _spec(q)
    batch, head = (_kept(entry, lambda a: a != axis) for entry in (spec[0], spec[2]))
    split = math.prod(mesh.shape[a] for a in axes_of(head))
    if k.shape[2] % split:
        # K/V heads too few to split as q's are: each q head's own K/V head, so that
        # every device holds its q heads' keys
        k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    out = PartitionSpec(batch, axis, head, None)
    q, k, v = (_resharded(x, out) for x in (q, k, v))
    return Layout((q, k, v), (out,) * 3, out, frozenset(mesh.axis_names), True, q.shape[2] // split)


def _kernel_layout(
    q: jax.Array, k: jax.Array, v: jax.Array, axis: str, spread: dict[str, int], kind: str
) -> Layout:
    """A kernel's shards on a mesh with Auto axes (`spread`, their sizes) whose
    arrays' types do not say how they are split: the batch over those axes (a data
    split's layout; new in 0.8), q, K and V constrained to it, manual over every
    axis, K and V gathered inside."""
    batch = q.shape[0]
    if batch % math.prod(spread.values()):
        raise Mistake(
            ValueError,
            f"implementation {kind!r} runs its kernel on each device's shard, manual over "
            f"every mesh axis: on the Auto axes {spread} it splits the batch, and they do "
            f"not divide the batch {batch}. Give a batch that {math.prod(spread.values())} "
            "divides, make the mesh's axes Explicit (jax.make_mesh's default) with the "
            "arrays laid out as you want them, or use implementation='xla'.",
        )
    names = tuple(spread)
    out = PartitionSpec(names[0] if len(names) == 1 else names, axis, None, None)
    q, k, v = (jax.lax.with_sharding_constraint(x, out) for x in (q, k, v))
    manual = frozenset(jax.sharding.get_abstract_mesh().axis_names)
    return Layout((q, k, v), (out,) * 3, out, manual, True, q.shape[2])


def _attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array | np.ndarray | None,
    *,
    axis: str,
    causal: bool,
    kind: Implementation,
    interpret: bool = False,
) -> jax.Array:
    """The attention of checked arguments: each shard's queries against the keys
    gathered along `axis`, in a shard_map (`interpret`: the splash kernel in Pallas's
    interpreter, as a CPU runs it)."""
    layout = _layout(q, k, v, axis, kind)
    mesh = jax.sharding.get_abstract_mesh()
    shards, queries = mesh.shape[axis], q.shape[1] // mesh.shape[axis]
    if kind == "splash":  # the kernel, its mask info split along the queries
        order = _splash_order(positions, causal, queries)
        extra = _splash_kernel(layout.heads, q.shape[1], shards, causal, order, interpret)
        split = PartitionSpec(None, axis if causal else None)  # heads, queries
        extra_spec = extra.manual_sharding_spec(NamedSharding(mesh, split))
        extra = jax.tree.map(_resharded, extra, extra_spec)
        runs = None if order is None else _runs(np.argsort(order))
    else:  # the tokens' positions, whole on every shard
        extra = jnp.arange(q.shape[1], dtype=jnp.int32) if positions is None else positions
        extra, extra_spec = _resharded(jnp.asarray(extra), PartitionSpec()), PartitionSpec()

    def shard(q: jax.Array, k: jax.Array, v: jax.Array, extra: Any) -> jax.Array:
        if layout.gather:
            k, v = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        if kind == "splash":
            return _splash_shard(q, k, v, extra, runs)
        mask = None
        if causal:  # whether each of this shard's queries attends each key
            mine = jax.lax.dynamic_slice_in_dim(extra, jax.lax.axis_index(axis) * queries, queries)
            mask = (mine[:, None] >= extra[None, :])[None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=kind)

    return jax.shard_map(
        shard,
        in_specs=(*layout.specs, extra_spec),
        out_specs=layout.out,
        axis_names=set(layout.manual),
        check_vma=kind == "xla",  # a kernel says nothing of the axes its result varies on
    )(*layout.qkv, extra)


def _splash_order(positions: Any, causal: bool, queries: int) -> np.ndarray | None:
    """The tokens' positions as the splash kernel's mask takes them: None (a token's
    position its index), or a permutation known when tracing."""
    if queries % SPLASH_BLOCK:
        raise Mistake(
            ValueError,
            f"implementation 'splash' runs each shard's queries in blocks of "
            f"{SPLASH_BLOCK}, and each shard holds {queries}. Give a length whose shard "
            f"is a multiple of {SPLASH_BLOCK}, or use implementation='xla'.",
        )
    if not causal or positions is None:
        return None
    try:
        order = np.asarray(positions)
    except jax.errors.TracerArrayConversionError:
        raise Mistake(
            ValueError,
            "implementation 'splash' takes positions known when tracing (its mask is "
            "built then), and these are traced. Pass them as a numpy array, such as "
            "st.balanced_order's, or use implementation='xla'.",
        ) from None
    if not np.array_equal(np.sort(order), np.arange(len(order))):
        raise Mistake(
            ValueError,
            f"implementation 'splash' takes positions that permute range({len(order)}), "
            "one position per token (st.balanced_order's); these do not. Use "
            "implementation='xla' for other positions.",
        )
    return order


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """`indices` as runs of consecutive ones, ``(start, stop)`` each: the slices whose
    concatenation takes them (two per shard for `balanced_order`'s)."""
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(indices, breaks)]


def _splash_kernel(
    heads: int, length: int, shards: int, causal: bool, order: np.ndarray | None, interpret: bool
) -> Any:
    """The splash kernel over the whole sequence, its causal mask split along the
    queries into `shards` (MaxText's all-gather context parallelism builds it so).
    Permuted queries attend keys put back in order: the causal mask reads each
    query's position from its ``q_sequence``, as MaxText's ``LoadBalancedCausalMask``
    does. A full mask is one shard's, the same on every shard (jax 0.10.2 fails to
    split one: it has no partial block to pad the shards' mask info with)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernels,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    if not causal:
        mask: Any = masks.FullMask((length // shards, length))
        shards = 1
    else:
        mask = masks.CausalMask((length, length))
    if order is not None:
        mask.q_sequence = order.astype(np.int32)
    return kernels.make_splash_mha(
        masks.MultiHeadMask((mask,) * heads),
        head_shards=1,
        q_seq_shards=shards,
        interpret=interpret,
    )


def _splash_shard(
    q: jax.Array, k: jax.Array, v: jax.Array, kernel: Any, runs: list[tuple[int, int]] | None
) -> jax.Array:
    """One shard's queries against every key, by the splash kernel (heads first, q
    scaled as `jax.nn.dot_product_attention` scales the logits)."""
    if runs is not None:  # the keys in their positions' order, as the mask takes them
        k, v = (jnp.concatenate([x[:, a:b] for a, b in runs], axis=1) for x in (k, v))
    q = q * q.shape[-1] ** -0.5
    out = jax.vmap(kernel)(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)))
    return jnp.swapaxes(out, 1, 2)
