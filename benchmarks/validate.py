"""The predicted step time against published training runs (docs/planning.md, "Validation").

Each run is a JAX step written as a JAX user of that stack writes it (widths, layers,
heads, vocabulary, sequence, batch, remat, layout; on GPU the attention is cuDNN's flash
kernel, `jax.nn.dot_product_attention(implementation="cudnn")`), compiled by the
target's own compiler without the hardware (`st.preflight(..., target=...)`), and its
predicted time (`StepPlan.time(hardware).predicted_seconds`, a walk of the compiled
schedule) turned into the published unit:

- torchtitan, Llama 3.1 8B on 8 H100s (pytorch/torchtitan, docs/performance.md at
  commit 820504e2^, Table 1): FSDP over 8, local batch 2, sequence 8,192, selective
  activation checkpointing ("op": every second matmul's output and the attention's
  kept), bf16 compute over fp32 params; 5,762 tokens/s per GPU eager, 6,667 with
  torch.compile (the ratio is against the torch.compile figure);
- torchtitan, Llama 3 8B on 64 H100s as FSDP 8 x TP 8 (benchmarks/
  asyncTP_llama3_h100_2025-06_torchtitan.md: bf16, torch.compile, per-op selective
  checkpointing, local batch 12 per data rank, sequence 8,192, vanilla TP): 4,378
  tokens/s per GPU. Both on torchtitan's own H100s (96 GB HBM2e at 2.4 TB/s, 500 W):
  `TORCHTITAN_H100`;
- MaxText 128B on a v5p-256 (128 chips) as FSDP 16 x TP 8 (its v5p README table as
  first published, 2023-12-15 at commit 76bd53b, with the 2023 base.yml:
  global_parameter_scale 128, per-device batch 2, remat minimal, sequence 2,048): 315
  TFLOP/s per chip in MaxText's count of that time;
- MaxText 16B on one TPU v5e-256 (configs/v5e/16b.sh and the v5e README, October-
  December 2023): scale 16, per-device batch 6, sequence 2,048, remat full, FSDP over
  256; 120 TFLOP/s per chip (61.10% MFU), in the same count;
- torchtitan, Llama 3.1 8B on 8 H100s as FSDP x CP (benchmarks/
  llama3_h100_202412_torchtitan.md, Table 2: local batch 1, full activation
  checkpointing, 262,144 tokens a step): 2,540, 1,071 and 548 tokens/s per GPU at
  CP 2, 4 and 8, the sequence over a "context" axis in `st.balanced_order` and
  `st.context_attention(..., implementation="cudnn")` (new in 0.8). Those rows ran
  torchao's Float8 linears; the step here is bf16 (docs/planning.md says why);
- MaxText's Mixtral 8x22B on a v6e-256 as FSDP 64 x EP 4 (`mixtral_8x22b_dropped`,
  tpu-recipes' Mixtral-8x22B-MaxText): per-device batch 8, sequence 4,096, capacity
  factor 1.25, MaxText's dropping MoE path; 1,326.3 tokens/s per chip (new in 0.8).

The TPU runs write their attention in blocks (`blocked_attention`: an online softmax
over key blocks, the masked-out blocks skipped, the backward recomputing each block's
probabilities from the saved log-sum-exp), not with splash attention: splash compiles
for libtpu without the hardware, but its block mask is a constant the compiled module
does not print, so its FLOPs are counted as if it kept every block (twice a causal
kernel's), where the blocked step's are its own.

Run: python benchmarks/validate.py [--quick] [--only torchtitan maxtext cp mixtral]
Exit status 1 if a ratio is outside +-20% (never with --quick: tiny models,
checking that each run compiles, predicts and prints).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, AxisType

import spmdtree as st

#: How far a prediction may be from the published figure.
TOLERANCE = 0.20
#: How far libtpu's own estimate (its kernels' estimated cycles) may be from ours before the
#: docs must explain it.
COMPILER_TOLERANCE = 0.25

BF16 = jnp.bfloat16


# --- blocked (flash-like) causal attention -----------------------------------------------
#
# Inside, each kv head's queries are its group's rows, position-major (batch, kv heads,
# length x group, head dim), as a flash kernel's grouped-query layout holds them: each
# block pair is then one plain batched matmul whose f32 scores XLA never transposes.


def _pairs(blocks: int, diagonal: bool) -> list[tuple[int, int]]:
    """The (query block, key block) pairs a causal mask leaves, query-major: the
    diagonal ones (masked by one triangle) or the ones below it (not masked)."""
    return [(i, j) for i in range(blocks) for j in range(i + 1) if (i == j) == diagonal]


def _scores(qi: jax.Array, kj: jax.Array, group: int, diagonal: bool) -> jax.Array:
    """One block pair's scaled scores, f32: (batch, kv, rows, keys), a diagonal pair's
    causally masked. The two kinds of pair run as two loops, so that the mask is one
    triangle that does not change from pair to pair: JAX's partial evaluation hoists
    whatever a loop body computes from the pair's index alone out of the layers' scan,
    stacked for every pair (64 MiB of mask per pair of the 8B step, read back in
    every layer)."""
    s = jnp.einsum("bhrd,bhkd->bhrk", qi, kj, preferred_element_type=jnp.float32)
    s = s / math.sqrt(qi.shape[-1])
    if not diagonal:
        return s
    rows, keys = s.shape[-2:]
    below = jnp.arange(rows)[:, None] // group >= jnp.arange(keys)[None, :]
    return jnp.where(below, s, -1e30)


def _over_pairs(blocks: int, pair: Callable[..., Any], carry: Any) -> Any:
    """`carry` through ``pair(i, j, diagonal, carry)`` for every pair the causal mask
    leaves: the ones below the diagonal, then the diagonal's."""
    for diagonal in (False, True):
        pairs = _pairs(blocks, diagonal)
        if not pairs:  # one block: none below the diagonal
            continue
        rows, cols = (jnp.array(side, jnp.int32) for side in zip(*pairs, strict=True))

        def step(p, c, rows=rows, cols=cols, diagonal=diagonal):
            return pair(rows[p], cols[p], diagonal, c)

        carry = jax.lax.fori_loop(0, len(pairs), step, carry)
    return carry


def _take(x: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """Block `index` of `size` along axis 2 (rows or keys)."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, 2)


def _put(x: jax.Array, update: jax.Array, index: jax.Array) -> jax.Array:
    """`x` with block `index` along axis 2 replaced by `update` (its size the block's)."""
    return jax.lax.dynamic_update_slice_in_dim(x, update, index * update.shape[2], 2)


def _attention_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, block: int, group: int
) -> tuple[jax.Array, jax.Array]:
    """The output (batch, kv, rows, head dim) and the scores' log-sum-exp (batch, kv, rows)."""
    b, h, n, d = q.shape
    size = block * group  # a query block's rows

    def pair(i, j, diagonal, carry):
        m, total, acc = carry
        s = _scores(_take(q, i, size), _take(k, j, block), group, diagonal)
        m_old, total_old = _take(m, i, size), _take(total, i, size)
        m_new = jnp.maximum(m_old, s.max(-1))
        probs = jnp.exp(s - m_new[..., None])
        fix = jnp.exp(m_old - m_new)
        total_new = total_old * fix + probs.sum(-1)
        pv = jnp.einsum(
            "bhrk,bhkd->bhrd",
            probs.astype(v.dtype),
            _take(v, j, block),
            preferred_element_type=jnp.float32,
        )
        acc_i = _take(acc, i, size) * fix[..., None] + pv
        return _put(m, m_new, i), _put(total, total_new, i), _put(acc, acc_i, i)

    m = jnp.full((b, h, n), -1e30, jnp.float32)
    total = jnp.zeros((b, h, n), jnp.float32)
    acc = jnp.zeros((b, h, n, d), jnp.float32)
    m, total, acc = _over_pairs(k.shape[2] // block, pair, (m, total, acc))
    return (acc / total[..., None]).astype(q.dtype), m + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(q: jax.Array, k: jax.Array, v: jax.Array, block: int, group: int) -> jax.Array:
    return _attention_forward(q, k, v, block, group)[0]


def _grouped_fwd(q, k, v, block, group):
    out, lse = _attention_forward(q, k, v, block, group)
    # Named as torchtitan's selective checkpointing saves a flash kernel's outputs
    # (the attention and its log-sum-exp): the backward does not rerun the forward.
    out, lse = checkpoint_name(out, "saved"), checkpoint_name(lse, "saved")
    return out, (q, k, v, out, lse)


def _grouped_bwd(block, group, residuals, grad):
    q, k, v, out, lse = residuals
    delta = jnp.einsum("bhrd,bhrd->bhr", grad, out, preferred_element_type=jnp.float32)
    size = block * group  # a query block's rows

    def pair(i, j, diagonal, carry):
        dq, dk, dv = carry
        qi, gi, kj, vj = (
            _take(q, i, size),
            _take(grad, i, size),
            _take(k, j, block),
            _take(v, j, block),
        )
        s = _scores(qi, kj, group, diagonal)
        probs = jnp.exp(s - _take(lse, i, size)[..., None])
        dv_j = jnp.einsum("bhrk,bhrd->bhkd", probs.astype(v.dtype), gi)
        dp = jnp.einsum("bhrd,bhkd->bhrk", gi, vj, preferred_element_type=jnp.float32)
        ds = probs * (dp - _take(delta, i, size)[..., None]) / math.sqrt(q.shape[-1])
        ds = ds.astype(q.dtype)
        dq_i = jnp.einsum("bhrk,bhkd->bhrd", ds, kj, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bhrk,bhrd->bhkd", ds, qi, preferred_element_type=jnp.float32)
        return (
            _put(dq, _take(dq, i, size) + dq_i, i),
            _put(dk, _take(dk, j, block) + dk_j, j),
            _put(dv, _take(dv, j, block) + dv_j, j),
        )

    zeros = (jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    dq, dk, dv = _over_pairs(k.shape[2] // block, pair, tuple(zeros))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Causal grouped-query attention in blocks of `block` positions, as a flash kernel
    computes it: q (batch, length, kv heads, group, head dim), k and v (batch,
    length, kv heads, head dim). Only the pairs of blocks the causal mask keeps
    are computed; the backward recomputes each pair's probabilities from the
    saved log-sum-exp (FlashAttention-2's algorithm, in XLA's kernels)."""
    b, n, h, g, d = q.shape
    rows = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, h, n * g, d)
    keys, values = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))
    out = _grouped(rows, keys, values, block, g)
    return jnp.transpose(out.reshape(b, h, n, g, d), (0, 2, 1, 3, 4))


# --- the steps ---------------------------------------------------------------------------


def _boxed(
    shape: tuple[int, ...], names: tuple[str, ...], dtype: Any = jnp.float32
) -> st.LogicallyPartitioned:
    """A master weight: fp32 where the run keeps fp32 params and computes in bf16 (the
    dense runs), bf16 where it keeps bf16 weights (MaxText's weight_dtype)."""
    return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, dtype), names)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (normed * scale).astype(x.dtype)


def rotary(x: jax.Array, positions: Any = None) -> jax.Array:
    """Rotary position embedding over (batch, length, ..., head dim), theta 500,000, at
    each token's position (its index, or `positions` for tokens reordered)."""
    d, n = x.shape[-1], x.shape[1]
    freq = 1.0 / (500_000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    at = jnp.arange(n) if positions is None else jnp.asarray(positions)
    angle = at.astype(jnp.float32)[:, None] * freq
    shape = (1, n) + (1,) * (x.ndim - 3) + (d // 2,)
    cos, sin = jnp.cos(angle).reshape(shape), jnp.sin(angle).reshape(shape)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def constrain(x: jax.Array, *names: str) -> jax.Array:
    return st.with_logical_constraint(x, names)


def sharded_splash(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Splash attention as MaxText runs it on a mesh (new in 0.8): each device on its own
    sequences under shard_map (a hand-written kernel the compiler cannot split), over
    (batch, heads, length, head dim), its query blocks `block` long (the recipe's
    sa_block_q*), the rest MaxText's 512."""
    spec = st.logical_to_mesh_axes(("batch", "q_heads", "length", "kv"))
    heads, length = q.shape[1], q.shape[2]

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.vmap(_splash(heads, length, block))(q, k, v)

    mapped = jax.shard_map(local, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    return mapped(q, k, v)


def _splash(heads: int, length: int, q_block: int = 512) -> Callable[..., jax.Array]:
    """Splash attention's causal kernel for `heads` heads of `length` (0.7), built anew
    for each step traced: on the chip, a kernel kept from an earlier step's trace
    made the next step's compile ask for more inputs than it was given ("compiled
    for 43 inputs but called with 38"). Its query blocks `q_block` long (a recipe's
    sa_block_q*; new in 0.8), the rest MaxText's sa_block_* defaults, 512."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(heads)])
    queries, rest = min(q_block, length), min(512, length)
    blocks = sk.BlockSizes(
        block_q=queries,
        block_kv_compute=rest,
        block_kv=rest,
        block_q_dkv=queries,
        block_kv_dkv=rest,
        block_kv_dkv_compute=rest,
        block_q_dq=queries,
        block_kv_dq=rest,
    )
    return sk.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1)


#: jax's Pallas TPU flash attention as MaxText ran it (`wrap_flash_attention`, under
#: shard_map over batch and heads: MaxText/layers.py at 9bc243c9, MaxText/layers/
#: attentions.py at 76bd53b), by the commit its
#: published figure was measured at: 9bc243c9 (2023-10, the v5e figures): causal=False
#: (the kernel took no mask then), blocks of 512, one sequence a block; 76bd53b
#: (2023-12, the v5p figures): causal=True, dQ in blocks of 1,024 queries x 256 keys,
#: two sequences a block.
FLASH_RECIPES: dict[str, dict[str, Any]] = {
    "maxtext-2023-10": dict(causal=False, q=512, k=512, b=1, dq_q=512, dq_k=512),
    "maxtext-2023-12": dict(causal=True, q=512, k=512, b=2, dq_q=1024, dq_k=256),
}


def pallas_flash(q: jax.Array, k: jax.Array, v: jax.Array, recipe: str) -> jax.Array:
    """jax's Pallas TPU flash attention over (batch, heads, length, head dim) as
    `recipe` (`FLASH_RECIPES`) ran it, each device on its own sequences and heads."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    r = FLASH_RECIPES[recipe]
    spec = st.logical_to_mesh_axes(("batch", "q_heads", "length", "kv"))

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        length = q.shape[2]  # the blocks as MaxText sized them, by this device's share
        blocks = fa.BlockSizes(
            block_q=min(r["q"], length),
            block_k_major=min(r["k"], length),
            block_k=min(r["k"], length),
            block_b=min(r["b"], q.shape[0]),
            block_q_major_dkv=min(r["q"], length),
            block_k_major_dkv=min(r["k"], length),
            block_q_dkv=min(r["q"], length),
            block_k_dkv=min(r["k"], length),
            block_q_dq=min(r["dq_q"], length),
            block_k_dq=min(r["dq_k"], length),
            block_k_major_dq=min(r["k"], length),
        )
        return fa.flash_attention(q, k, v, causal=r["causal"], block_sizes=blocks)

    mapped = jax.shard_map(local, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    return mapped(q, k, v)


#: What MaxText's "custom" remat of the Mixtral 8x22B recipe offloads to the host: the
#: layer's input and the attention's projections (decoder_layer_input, query_proj,
#: key_proj, value_proj, out_proj: "offload"); the rest is recomputed.
OFFLOADED = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")


def _op_policy(prim: Any, *_: Any, **params: Any) -> bool:
    """torchtitan's "op" checkpointing: the values named "saved", and cuDNN's attention
    forward whole (its output and softmax statistics: torchtitan's list saves the flash
    kernel's outputs, its log-sum-exp among them)."""
    if prim.name == "name":
        return params.get("name") == "saved"
    return prim.name.startswith("dot_product_attention_fwd")


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder's shapes and how its step is written."""

    vocab: int
    embed: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    length: int
    block: int  # the attention's block
    style: str  # "llama" (sequential block, SwiGLU, RoPE, untied) or "maxtext-2023"
    remat: str  # "op" (torchtitan's selective checkpointing), "minimal" or "full"
    #: "cudnn": jax.nn.dot_product_attention(implementation="cudnn"), what a GPU job
    #: runs; "blocked": `blocked_attention`, XLA's kernels (0.5's step); "xla":
    #: jax.nn.dot_product_attention(implementation="xla"), the whole scores; "splash":
    #: splash attention with a causal mask in blocks of 512, as MaxText runs it on TPU (0.7);
    #: "pallas": jax's Pallas TPU flash attention as `flash` (a `FLASH_RECIPES` key) ran it
    kernel: str = "blocked"
    flash: str = "maxtext-2023-12"
    #: the layers as a pipeline of this many microbatches over the mesh's "stage" axis
    #: (`st.pipeline`; their boxes restaged by `staged`); 0: scanned (new in 0.8)
    microbatches: int = 0
    #: each MLP a mixture of this many experts (SwiGLU each), MaxText's dropping path:
    #: top-k routing, each sequence's tokens over capacity dropped, dispatched and
    #: combined by GShard's einsums under MaxText's constraints; 0: a dense MLP (new in
    #: 0.8)
    experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    #: the master weights' dtype (MaxText's weight_dtype; new in 0.8)
    weights: Any = jnp.float32
    #: splash's query blocks (the recipe's sa_block_q*), kernel "splash-mesh" (new in 0.8)
    splash_block: int = 512
    #: the sequence split over the mesh's "context" axis this many ways, its tokens in
    #: `st.balanced_order`, attention by `st.context_attention` (kernel
    #: "cudnn-context"); 1: not split (new in 0.8)
    context: int = 1

    def params(self) -> dict[str, Any]:
        e, h, kv, d, m, n = (
            self.embed,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.mlp,
            self.layers,
        )
        box = functools.partial(_boxed, dtype=self.weights)
        layer = {
            "attention_norm": box((n, e), ("layers", "norm")),
            "query": box((n, e, h, d), ("layers", "embed", "q_heads", "kv")),
            "key": box((n, e, kv, d), ("layers", "embed", "kv_heads", "kv")),
            "value": box((n, e, kv, d), ("layers", "embed", "kv_heads", "kv")),
            "out": box((n, h, d, e), ("layers", "q_heads", "kv", "embed")),
            "wi_0": box((n, e, m), ("layers", "embed", "mlp")),
            "wo": box((n, m, e), ("layers", "mlp", "embed")),
        }
        tree = {
            "embed": box((self.vocab, e), ("vocab", "embed")),
            "final_norm": box((e,), ("norm",)),
        }
        if self.style == "llama":
            layer["mlp_norm"] = box((n, e), ("layers", "norm"))
            layer["wi_1"] = box((n, e, m), ("layers", "embed", "mlp"))
            tree["output"] = box((e, self.vocab), ("embed", "vocab"))
        if self.experts:  # MaxText's kernel axes: the experts on "exp", embed not on it
            x = self.experts
            layer["gate"] = box((n, e, x), ("layers", "embed", None))
            for name in ("wi_0", "wi_1"):
                layer[name] = box((n, x, e, m), ("layers", "exp", "embed_no_exp", "mlp"))
            layer["wo"] = box((n, x, m, e), ("layers", "exp", "mlp", "embed_no_exp"))
        return {**tree, "layers": layer}

    def mixture(self, h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        """A mixture of SwiGLU experts over the normed input `h` (batch, length, embed)
        by MaxText's dropping path (`dense_matmul`, tpu-recipes-v0.1.2): top-k routing
        with the top-k's softmax as weights, each sequence's tokens past an expert's
        capacity dropped, dispatched and combined by GShard's einsums, the dispatched
        tokens constrained to the experts' axis ("BSM,BSEC -> EBCM")."""
        b, s, _ = h.shape
        count, k = self.experts, self.top_k
        top, chosen = jax.lax.top_k(h @ p["gate"], k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(h.dtype)
        mask = jax.nn.one_hot(chosen, count, dtype=jnp.int32)  # b s k e
        filled = jnp.cumsum(mask.reshape(b, s * k, count), axis=1).reshape(mask.shape)
        capacity = int(max(math.ceil(s * k / count) * self.capacity_factor, self.capacity_factor))
        slot = jnp.where((mask > 0) & (filled <= capacity), filled - 1, -1)
        combine = jnp.einsum(
            "bsk,bskec->bsec", weights, jax.nn.one_hot(slot, capacity, dtype=h.dtype)
        )
        combine = constrain(combine, "batch", "length", None, None)
        dispatch = (combine > 0).astype(h.dtype)
        tokens = jnp.einsum("bsm,bsec->ebcm", h, dispatch)
        tokens = constrain(tokens, "activation_exp", "batch_no_exp", None, "activation_embed")
        gate = jnp.einsum("ebcm,emh->ebch", tokens, p["wi_0"])
        hidden = jax.nn.silu(gate) * jnp.einsum("ebcm,emh->ebch", tokens, p["wi_1"])
        hidden = constrain(hidden, "activation_exp", "batch_no_exp", None, "mlp")
        out = jnp.einsum("ebch,ehm->ebcm", hidden, p["wo"])
        out = constrain(out, "activation_exp", "batch_no_exp", None, "activation_embed")
        return jnp.einsum("ebcm,bsec->bsm", out, combine)

    def positions(self) -> Any:
        """The tokens' positions: `st.balanced_order`'s where the sequence is split."""
        return st.balanced_order(self.length, self.context) if self.context > 1 else None

    def attention(self, h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        """Self-attention of the normed input `h`; torchtitan's "op" checkpointing saves
        the outputs of the 1st, 3rd, ... matmuls (query, value) and the attention's."""
        save = checkpoint_name
        q = save(jnp.einsum("ble,ehd->blhd", h, p["query"]), "saved")
        k = jnp.einsum("ble,ehd->blhd", h, p["key"])
        v = save(jnp.einsum("ble,ehd->blhd", h, p["value"]), "saved")
        if self.style == "llama":
            q, k = rotary(q, self.positions()), rotary(k, self.positions())
        q = constrain(q, "batch", "length", "q_heads", "kv")
        if self.kernel == "cudnn-context":  # each shard's queries against K, V gathered
            with jax.named_scope("attention"):
                attended = st.context_attention(
                    q, k, v, implementation="cudnn", positions=self.positions()
                )
            return jnp.einsum("blhd,hde->ble", save(attended, "saved"), p["out"])
        if self.kernel == "cudnn":  # grouped queries as cuDNN takes them: (b, l, heads, d)
            with jax.named_scope("attention"):
                attended = jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="cudnn"
                )
            return jnp.einsum("blhd,hde->ble", save(attended, "saved"), p["out"])
        if self.kernel == "splash-mesh":  # MaxText's offloaded projections, named
            q, k, v = (
                checkpoint_name(a, n) for a, n in zip((q, k, v), OFFLOADED[1:4], strict=True)
            )
            heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
            groups = self.heads // self.kv_heads
            k, v = (jnp.repeat(a, groups, axis=2) for a in (k, v))
            scaled = q / math.sqrt(self.head_dim)
            with jax.named_scope("attention"):
                attended = sharded_splash(*map(heads_first, (scaled, k, v)), self.splash_block)
            out = jnp.einsum("bhld,hde->ble", attended, p["out"])
            return checkpoint_name(out, OFFLOADED[4])
        if self.kernel in ("xla", "splash", "pallas"):
            with jax.named_scope("attention"):
                attended = save(self.whole_attention(q, k, v), "saved")
            return jnp.einsum("blhd,hde->ble", attended, p["out"])
        groups = self.heads // self.kv_heads
        q = q.reshape(*q.shape[:2], self.kv_heads, groups, self.head_dim)
        with jax.named_scope("attention"):
            attended = save(blocked_attention(q, k, v, self.block), "saved")
        attended = attended.reshape(*attended.shape[:2], self.heads, self.head_dim)
        return jnp.einsum("blhd,hde->ble", attended, p["out"])

    def whole_attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Causal attention over (batch, length, heads, head dim) by XLA's kernels over
        the whole scores, by splash attention (each kv head repeated over its
        queries' group; the kernel takes heads x length x head dim per sequence), or
        by jax's Pallas TPU flash attention as MaxText ran it (`pallas_flash`: not
        causal in its 2023-10 recipe)."""
        if self.kernel == "xla":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        groups = self.heads // self.kv_heads
        k, v = (jnp.repeat(a, groups, axis=2) for a in (k, v))
        heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
        q, k, v = map(heads_first, (q / math.sqrt(self.head_dim), k, v))
        if self.kernel == "pallas":
            return heads_first(pallas_flash(q, k, v, self.flash))
        return heads_first(jax.vmap(_splash(self.heads, self.length))(q, k, v))

    def layer(self, x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        p = jax.tree.map(lambda a: a.astype(BF16), st.unbox(p))
        save = checkpoint_name
        if self.style == "llama":  # x + attn(norm x); then + SwiGLU(norm x)
            x = x + self.attention(rms_norm(x, p["attention_norm"]), p)
            x = constrain(x, "batch", "length", "activation_embed")
            h = rms_norm(x, p["mlp_norm"])
            if self.experts:
                x = x + self.mixture(h, p)
                return constrain(x, "batch", "length", "activation_embed"), None
            gate = save(h @ p["wi_0"], "saved")  # w1: the 5th matmul, saved
            gated = jax.nn.silu(gate) * (h @ p["wi_1"])  # w3: the 6th, recomputed
            gated = constrain(gated, "batch", "length", "mlp")
            x = x + save(gated @ p["wo"], "saved")  # w2: the 7th, saved
        else:  # MaxText's 2023 default block: attention and a ReLU MLP in parallel
            h = rms_norm(x, p["attention_norm"])
            hidden = constrain(jax.nn.relu(h @ p["wi_0"]), "batch", "length", "mlp")
            x = x + self.attention(h, p) + hidden @ p["wo"]
        return constrain(x, "batch", "length", "activation_embed"), None

    def loss(self, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        table = constrain(st.unbox(params["embed"]).astype(BF16), "vocab", None)
        x = jnp.take(table, tokens[:, :-1], axis=0)
        x = constrain(x, "batch", "length", "activation_embed")
        if self.remat == "op":
            body = jax.checkpoint(self.layer, policy=_op_policy, prevent_cse=False)
        elif self.remat == "offload":  # MaxText's "custom": these to the host, the rest again
            policy = jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=list(OFFLOADED),
                offload_src="device",
                offload_dst="pinned_host",
            )
            named = lambda x, p: self.layer(checkpoint_name(x, OFFLOADED[0]), p)  # noqa: E731
            body = jax.checkpoint(named, policy=policy, prevent_cse=False)
        elif self.remat == "minimal":  # MaxText's of 2023: the weights' matmuls kept
            policy = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
            body = jax.checkpoint(self.layer, policy=policy, prevent_cse=False)
        else:
            body = jax.checkpoint(self.layer, prevent_cse=False)
        if self.microbatches:
            x, _ = st.pipeline(body, x, params["layers"], microbatches=self.microbatches)
        else:
            x, _ = st.scan(body, x, params["layers"], partition_name="layers")
        x = rms_norm(x, st.unbox(params["final_norm"]).astype(BF16))
        head = table.T if self.style != "llama" else st.unbox(params["output"]).astype(BF16)
        logits = constrain((x @ head).astype(jnp.float32), "batch", "length", "vocab")
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

    def train_step(self, params: Any, state: Any, tokens: Any) -> tuple[Any, Any, jax.Array]:
        tx = optax.adamw(1e-4)
        loss, grads = jax.value_and_grad(self.loss)(params, tokens.value)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def staged(self, stages: int) -> dict[str, Any]:
        """`params`, the layers restaged into `stages` pipeline stages (new in 0.8)."""
        params = self.params()
        return {**params, "layers": st.stages(params["layers"], stages)}

    def param_count(self) -> int:
        return sum(
            math.prod(box.value.shape)
            for box in jax.tree.leaves(self.params(), is_leaf=st.is_boxed)
        )


#: FSDP over every chip: params, grads and adam state sharded, the batch split.
RULES = [
    ("batch", "fsdp"),
    ("embed", "fsdp"),
    *[(n, None) for n in ("vocab", "mlp", "q_heads", "kv_heads", "kv", "length", "norm", "layers")],
    ("activation_embed", None),
]


@dataclasses.dataclass(frozen=True)
class Run:
    """A published run: its model, chips and per-device batch, and its figure."""

    name: str
    model: Model
    target: str | st.Hardware  # a preset's name, or the run's own chip
    chips: int
    per_device_batch: float  # the global batch over the chips
    published: float
    unit: str
    convert: Callable[[Run, float], float]  # predicted seconds -> the published unit
    others: tuple[tuple[str, float], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    tensor: int = 1  # tensor parallelism: the mesh is fsdp x tensor
    rules: tuple[tuple[str, Any], ...] = ()
    #: a second axis in place of tensor's (new in 0.8): ("expert", 4) for fsdp x expert
    split: tuple[str, int] | None = None

    def preflight(self) -> st.StepPlan:
        params = self.model.params()
        state = jax.eval_shape(optax.adamw(1e-4).init, params)
        batch = round(self.per_device_batch * self.chips)
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((batch, self.model.length + 1), jnp.int32), ("batch", "length")
        )
        name, size = self.split or ("tensor", self.tensor)
        mesh = AbstractMesh(
            (self.chips // size, size), ("fsdp", name), axis_types=(AxisType.Auto,) * 2
        )
        for key, value in self.env:
            os.environ[key] = value
        return st.preflight(
            self.model.train_step,
            params,
            state,
            tokens,
            mesh=mesh,
            rules=list(self.rules or RULES),
            params=params,
            donate_argnums=(0, 1),
            target=self.target,
        )


#: torchtitan's H100s, as its benchmarks say ("Hardware": Grand Teton hosts of 8 H100s
#: on NVLink, "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "400 Gb/s per GPU",
#: "the default 500W power limit"): the h100 preset (the 700 W SXM part) with that
#: memory and bandwidth. No source gives its matmul share at 500 W: the preset's is
#: kept, and the docs say so.
TORCHTITAN_H100 = dataclasses.replace(
    st.hardware("h100"),
    name="h100 96GB HBM2e",
    memory_bytes=96 * 10**9,
    hbm_bytes_per_second=2.4e12,
)

#: Megatron's tensor parallelism over `tensor` (torchtitan's and MaxText's): heads and
#: the MLP's hidden units split (column-wise in, row-wise out), the vocabulary too
#: (the output projection and a loss over split logits); the residual stream between
#: the blocks split over it too (MaxText's base.yml: `activation_embed` on `tensor`;
#: torchtitan splits it by sequence: the same bytes); FSDP over the rest.
TP_RULES = (
    ("batch", "fsdp"),
    ("embed", "fsdp"),
    ("activation_embed", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    *[(n, None) for n in ("kv", "length", "norm", "layers")],
)


#: torchtitan's FSDP x CP (benchmarks/llama3_h100_202412_torchtitan.md, Table 2): the
#: sequence split over "context", the params sharded over every rank (FSDP over the
#: data and context ranks together), one sequence per data rank.
CP_RULES = (
    ("batch", "fsdp"),
    ("length", "context"),
    ("embed", ("fsdp", "context")),
    *[(n, None) for n in ("vocab", "mlp", "q_heads", "kv_heads", "kv", "norm", "layers")],
    ("activation_embed", None),
)

#: MaxText's rules for an expert layer (base.yml at tpu-recipes-v0.1.2) on fsdp x
#: expert: the batch over both (the expert axis is FSDP's outside the expert layers), the
#: experts' weights on "expert" and their width on fsdp alone, the dispatched tokens on
#: "expert" and their sequences on fsdp alone (activation_exp, activation_batch_no_exp).
MOE_RULES = (
    ("batch", ("fsdp", "expert")),
    ("embed", ("fsdp", "expert")),
    ("exp", "expert"),
    ("embed_no_exp", "fsdp"),
    ("activation_exp", "expert"),
    ("batch_no_exp", "fsdp"),
    *[(n, None) for n in ("vocab", "mlp", "q_heads", "kv_heads", "kv", "length", "norm")],
    *[(n, None) for n in ("layers", "activation_embed")],
)


def tokens_per_second(run: Run, seconds: float) -> float:
    """Tokens per second per GPU: the batch's tokens over the step, over the GPUs."""
    return run.per_device_batch * run.model.length / seconds


def maxtext_2023_tflops(run: Run, seconds: float) -> float:
    """TFLOP/s per chip in MaxText's count of October 2023 (maxtext_utils.py,
    `calculate_training_tflops`): 6 x params x tokens per device, plus
    12 x heads x layers x head dim x length^2 x batch per device for attention
    (not halved for the causal mask)."""
    m = run.model
    weights = 6 * m.param_count() * m.length * run.per_device_batch
    attention = 12 * m.heads * m.layers * m.head_dim * m.length**2 * run.per_device_batch
    return (weights + attention) / seconds / 1e12


#: MaxText's LIBTPU_INIT_ARGS in configs/v5e/16b.sh: compiled the same way, the
#: walked schedule is the job's.
MAXTEXT_LIBTPU_ARGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
)

#: Llama 3.1 8B (examples/llama.py SIZES["8B"]) and MaxText's 2023 base.yml at
#: global_parameter_scale 16 (base emb 2560 x 2, heads 8 x 4 of dim 256, MLP
#: 8192 x 4, layers 16 x 2, vocab 32,768, ReLU, tied embedding).
LLAMA_8B = Model(128256, 4096, 32, 32, 8, 128, 14336, 8192, 1024, "llama", "op")
MAXTEXT_16B = dataclasses.replace(
    Model(32768, 5120, 32, 32, 32, 256, 32768, 2048, 512, "maxtext-2023", "full", "pallas"),
    flash="maxtext-2023-10",
)
#: global_parameter_scale 128 over the same base.yml: width 2,560 x 4, heads 8 x 8 of
#: 256, MLP 8,192 x 8, layers 16 x 4 (MaxText's get_individual_scales of that time).
MAXTEXT_128B = Model(
    32768, 10240, 64, 64, 64, 256, 65536, 2048, 512, "maxtext-2023", "minimal", "pallas"
)
#: Mixtral 8x22B (MaxText's configs/models/mixtral-8x22b.yml): width 6,144, 48 heads and
#: 8 kv heads of 128, experts' MLP 16,384 (SwiGLU), 56 layers, vocabulary 32,768, 8
#: experts, top-2; as mixtral_8x22b_dropped runs it (benchmarks/
#: maxtext_trillium_model_configs.py): capacity factor 1.25, bf16 weights, splash
#: attention in query blocks of 2,048, the "custom" remat offloading the layer's input
#: and the attention's projections, sequence 4,096.
MIXTRAL_8X22B = Model(
    32768,
    6144,
    56,
    48,
    8,
    128,
    16384,
    4096,
    512,
    "llama",
    "offload",
    "splash-mesh",
    experts=8,
    weights=BF16,
    splash_block=2048,
)
#: The recipe's LIBTPU_INIT_ARGS (benchmarks/xla_flags_library.py): MoE's VMEM limit,
#: the collectives fused into compute, the data-parallel overlap.
MIXTRAL_LIBTPU_ARGS = "--xla_tpu_scoped_vmem_limit_kib=81920 " + MAXTEXT_LIBTPU_ARGS
TINY_LLAMA = Model(512, 256, 2, 8, 8, 32, 512, 256, 64, "llama", "op")
TINY_MAXTEXT = Model(512, 256, 2, 4, 4, 128, 1024, 256, 64, "maxtext-2023", "full", "pallas")


def runs(quick: bool) -> list[Run]:
    """The published runs; `quick`: tiny models of the same code, on 8 chips."""
    found = [
        Run(
            "torchtitan Llama 3.1 8B, 8 x H100, FSDP",
            dataclasses.replace(TINY_LLAMA if quick else LLAMA_8B, kernel="cudnn"),
            TORCHTITAN_H100,
            8,
            2,
            6667.0,
            "tokens/s/GPU",
            tokens_per_second,
            others=(("eager", 5762.0),),
        ),
        Run(
            "torchtitan Llama 3 8B, 64 x H100, FSDP 8 x TP 8",
            dataclasses.replace(TINY_LLAMA if quick else LLAMA_8B, kernel="cudnn"),
            TORCHTITAN_H100,
            64,
            12 * 8 / 64,  # a local batch of 12 per data rank, 8 ranks
            4378.0,
            "tokens/s/GPU",
            tokens_per_second,
            tensor=8,
            rules=TP_RULES,
        ),
        Run(
            "MaxText 128B, v5p-256, FSDP 16 x TP 8",
            TINY_MAXTEXT if quick else MAXTEXT_128B,
            "tpu-v5p",
            8 if quick else 128,  # v5p-256 counts TensorCores: 128 chips of two
            2,
            315.0,
            "TFLOP/s/chip",
            maxtext_2023_tflops,
            tensor=8 if not quick else 2,
            rules=TP_RULES,
        ),
        Run(
            "MaxText 16B, v5e-256, FSDP",
            dataclasses.replace(TINY_MAXTEXT, flash=MAXTEXT_16B.flash) if quick else MAXTEXT_16B,
            "tpu-v5e",
            8 if quick else 256,
            6,
            120.0,
            "TFLOP/s/chip",
            maxtext_2023_tflops,
            env=(("LIBTPU_INIT_ARGS", MAXTEXT_LIBTPU_ARGS),),
        ),
    ]
    for fsdp, length, published in ((4, 65536, 2540.0), (2, 131072, 1071.0), (1, 262144, 548.0)):
        context = 8 // fsdp
        model = TINY_LLAMA if quick else LLAMA_8B
        found.append(
            Run(
                f"torchtitan Llama 3.1 8B, 8 x H100, FSDP {fsdp} x CP {context}",
                dataclasses.replace(
                    model,
                    length=1024 if quick else length,
                    kernel="cudnn-context",
                    remat="full",
                    context=context,
                ),
                TORCHTITAN_H100,
                8,
                fsdp / 8,  # one sequence per data rank
                published,
                "tokens/s/GPU",
                tokens_per_second,
                rules=CP_RULES,
                split=("context", context),
            )
        )
    tiny_moe = dataclasses.replace(
        TINY_LLAMA, remat="offload", kernel="splash-mesh", experts=4, weights=BF16
    )
    found.append(
        Run(
            "MaxText Mixtral 8x22B, v6e-256, FSDP 64 x EP 4",
            tiny_moe if quick else MIXTRAL_8X22B,
            "tpu-v6e",
            8 if quick else 256,
            8,
            1326.3,
            "tokens/s/chip",
            tokens_per_second,
            env=(("LIBTPU_INIT_ARGS", MIXTRAL_LIBTPU_ARGS),),
            rules=MOE_RULES,
            split=("expert", 2 if quick else 4),
        )
    )
    if quick:
        found = [dataclasses.replace(run, name=f"{run.name.split(',')[0]}, tiny") for run in found]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models: checks that it runs")
    parser.add_argument("--only", nargs="+", choices=["torchtitan", "maxtext", "mixtral", "cp"])
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}; predicted with spmdtree {st.__version__}; "
        f"{'tiny models (--quick): ratios not checked' if args.quick else 'published shapes'}\n"
    )
    header = f"{'run':<42} {'published':>12} {'predicted':>10} {'ratio':>6}  unit"
    rows, missed, errors = [header], [], []
    for run in runs(args.quick):
        if args.only and not any(word in run.name.lower() for word in args.only):
            continue
        start = time.perf_counter()
        try:
            step = run.preflight()
        except ValueError as e:  # the target's compiler is not installed: said, not timed
            if "pip install" not in str(e):
                raise
            print(f"{run.name}: skipped ({str(e)[:160]})")
            continue
        compiled = time.perf_counter() - start
        hardware = run.target if isinstance(run.target, st.Hardware) else st.hardware(run.target)
        t = step.time(hardware)
        assert t.predicted_seconds is not None and t.predicted_by_class is not None
        predicted = run.convert(run, t.predicted_seconds)
        ratio = predicted / run.published
        rows.append(
            f"{run.name:<42} {run.published:>12,.0f} {predicted:>10,.0f} {ratio:>6.3f}  {run.unit}"
        )
        for label, figure in run.others:
            rows.append(
                f"{'  against ' + label:<42} {figure:>12,.0f} {predicted:>10,.0f} "
                f"{predicted / figure:>6.3f}  {run.unit}"
            )
        errors.append(abs(ratio - 1))
        if abs(ratio - 1) > TOLERANCE:
            missed.append(run.name)
        by_class = ", ".join(f"{k} {v:.3f} s" for k, v in t.predicted_by_class.items())
        print(f"{run.name}: compiled by {step.backend} in {compiled:.0f} s")
        print(
            f"  step: predicted {t.predicted_seconds:.3f} s ({by_class}); bound "
            f"{t.bound_seconds:.3f} s (compute {t.compute_seconds:.3f} s, collectives "
            f"{t.comm_seconds:.3f} s, {t.comm_seconds - (t.exposed_comm_seconds or 0):.3f} s "
            f"of them hidden); peak {step.peak_bytes / 2**30:.1f} GiB"
        )
        print(
            f"  hardware FLOPs per device {step.flops / 1e12:.1f} T; "
            f"{hardware.name}: {hardware.flops_per_second / 1e12:.0f} TFLOP/s peak"
        )
        if step.compiler_seconds:
            own = step.compiler_seconds / t.predicted_seconds
            print(
                f"  libtpu's own estimate {step.compiler_seconds:.3f} s: "
                f"{own:.3f} x ours"
                + ("" if abs(own - 1) <= COMPILER_TOLERANCE else " (outside 25%: docs explain)")
            )
    print()
    print("\n".join(rows))
    if errors and not args.quick:
        print(f"mean absolute error {sum(errors) / len(errors):.1%} over {len(errors)} runs")
    if missed and not args.quick:
        print(f"outside +-{TOLERANCE:.0%}: {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
