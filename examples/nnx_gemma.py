"""A Gemma-like flax.nnx decoder, sharded as flax's own Gemma example shards it, through
spmdtree: its params converted with `st.from_flax`, its step preflighted and its layouts
advised over Explicit mesh axes (docs/flax.md, "flax.nnx: a Gemma-like model").

The model annotates its params with mesh axes (`nnx.with_partitioning` over ``fsdp``
and ``tensor``) and its activations with `out_sharding=` (which needs Explicit axes),
and splits its batch over ``fsdp`` alone, as flax's examples/gemma does: on a layout
with ``data`` > 1 every data group computes the same examples, and advise says so.

Run: python examples/nnx_gemma.py [--devices 8] [--batch 16]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

VOCAB, WIDTH, HEADS, HEAD, MLP, LAYERS, LENGTH = 512, 128, 4, 32, 512, 2, 64


def param(shape: tuple[int, ...], axes: tuple[str | None, ...], rngs: nnx.Rngs) -> nnx.Param:
    """A param whose Variable carries its mesh axes, as flax's Gemma writes them."""
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), axes)
    return nnx.Param(init(rngs.params(), shape))


class Block(nnx.Module):
    """Attention and a gated MLP, each output sharded by `out_sharding=`."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.Param(jnp.ones(WIDTH))
        self.qkv = param((3, WIDTH, HEADS, HEAD), (None, "fsdp", "tensor", None), rngs)
        self.out = param((HEADS, HEAD, WIDTH), ("tensor", None, "fsdp"), rngs)
        self.up = param((2, WIDTH, MLP), (None, "fsdp", "tensor"), rngs)
        self.down = param((MLP, WIDTH), ("tensor", "fsdp"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        heads = P("fsdp", None, "tensor", None)
        h = x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * self.norm[...]
        q, k, v = (jnp.einsum("bte,ehd->bthd", h, w, out_sharding=heads) for w in self.qkv)
        scores = jnp.einsum("bthd,bshd->bhts", q, k, out_sharding=P("fsdp", "tensor", None, None))
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores / HEAD**0.5, -1e9), axis=-1)
        attended = jnp.einsum("bhts,bshd->bthd", weights, v, out_sharding=heads)
        x = x + jnp.einsum("bthd,hde->bte", attended, self.out, out_sharding=P("fsdp"))
        gate, up = (
            jnp.einsum("bte,em->btm", h, w, out_sharding=P("fsdp", None, "tensor")) for w in self.up
        )
        return x + jnp.einsum(
            "btm,me->bte", jax.nn.gelu(gate) * up, self.down, out_sharding=P("fsdp")
        )


class Model(nnx.Module):
    """Embedding, blocks, and logits from the embedding (tied, as Gemma's)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = param((VOCAB, WIDTH), ("tensor", "fsdp"), rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed[...].at[tokens].get(out_sharding=P("fsdp"))
        for block in self.blocks:
            x = block(x)
        return jnp.einsum("bte,ve->btv", x, self.embed[...], out_sharding=P("fsdp", None, "tensor"))


def abstract_params() -> tuple[nnx.GraphDef, dict]:
    """The model's graph and its params as spmdtree boxes, nothing allocated: no eager
    sharding (there is no mesh yet), `nnx.eval_shape`, `nnx.split`, `st.from_flax`."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, st.from_flax(state)


GRAPHDEF, PARAMS = abstract_params()


def loss(params: nnx.State, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy; the model rebuilt from the arrays by `nnx.merge`."""
    logits = nnx.merge(GRAPHDEF, params)(tokens[:, :-1]).astype(jnp.float32)
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB, dtype=logits.dtype)
    labels = jax.sharding.reshard(labels, P("fsdp", None, "tensor"))
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def train_step(params: nnx.State, tokens: st.Partitioned) -> tuple[nnx.State, jax.Array]:
    """One SGD step on the unboxed params and batch."""
    value, grads = jax.value_and_grad(loss)(st.unbox(params), tokens.value)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, st.unbox(params), grads), value


def make_step(candidate: st.Candidate):
    """advise's make_step: the step, its params and a batch split over fsdp alone."""
    tokens = st.Partitioned(
        jax.ShapeDtypeStruct((candidate.batch, LENGTH + 1), jnp.int32), ("fsdp", None)
    )
    return train_step, (PARAMS, tokens), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    layouts = st.layouts(
        args.devices,
        ("data", "fsdp", "tensor"),
        sizes={"tensor": (1, 2), "data": (1, 2)},
        axis_types=AxisType.Explicit,
    )
    candidates = [st.Candidate(m, None, args.batch, length=LENGTH) for m in layouts]
    # screen="cpu": the CPU estimate, so the docs print the same with or without XLA GPU
    advice = st.advise(
        make_step, candidates, hardware=st.hardware("h100"), progress=False, screen="cpu"
    )
    print(advice)


if __name__ == "__main__":
    main()
