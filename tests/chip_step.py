"""The step whose profile on a TPU v5e chip is recorded under tests/data (new in 0.7):
a small decoder's training step of XLA's own kernels (embedding, causal attention
over the whole scores, a ReLU MLP, two layers scanned, a softmax loss, SGD), bf16
compute over f32 weights. tests/test_measure.py compiles it again without the chip
(libtpu's deviceless compile names its instructions as the chip's does) and joins
the recorded profile to it; the chip ran it with `st.measure` (benchmarks/chip.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

import spmdtree as st

VOCAB, WIDTH, LAYERS, HEADS, LENGTH, BATCH = 1024, 512, 2, 4, 512, 32


def params() -> dict[str, st.Partitioned]:
    def boxed(*shape: int) -> st.Partitioned:
        return st.Partitioned(jax.ShapeDtypeStruct(shape, jnp.float32), (None,) * len(shape))

    return {
        "embed": boxed(VOCAB, WIDTH),
        "qkv": boxed(LAYERS, WIDTH, 3 * WIDTH),
        "out": boxed(LAYERS, WIDTH, WIDTH),
        "up": boxed(LAYERS, WIDTH, 4 * WIDTH),
        "down": boxed(LAYERS, 4 * WIDTH, WIDTH),
    }


def tokens() -> st.Partitioned:
    return st.Partitioned(jax.ShapeDtypeStruct((BATCH, LENGTH + 1), jnp.int32), ("data", None))


def layer(x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
    p = {k: v.astype(jnp.bfloat16) for k, v in p.items()}
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(*a.shape[:2], HEADS, WIDTH // HEADS)  # noqa: E731
    attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + attended.reshape(x.shape) @ p["out"]
    return x + jax.nn.relu(x @ p["up"]) @ p["down"], None


def loss(p: dict[str, jax.Array], batch: jax.Array) -> jax.Array:
    x = p["embed"].astype(jnp.bfloat16)[batch[:, :-1]]
    layers = {k: p[k] for k in ("qkv", "out", "up", "down")}
    x, _ = jax.lax.scan(layer, x, layers)
    logits = (x @ p["embed"].astype(jnp.bfloat16).T).astype(jnp.float32)
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], axis=-1)
    return -jnp.mean(chosen)


def step(p: dict[str, st.Partitioned], batch: st.Partitioned) -> tuple[dict, jax.Array]:
    value, grads = jax.value_and_grad(loss)(st.unbox(p), batch.value)
    new = jax.tree.map(lambda w, g: w - 0.01 * g, st.unbox(p), grads)
    return st.replace_boxed(p, new), value


def mesh(abstract: bool) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
    """One chip's mesh: the chip's own, or an abstract one to compile without it."""
    if abstract:
        return jax.sharding.AbstractMesh((1,), ("data",), axis_types=(AxisType.Auto,))
    return jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
