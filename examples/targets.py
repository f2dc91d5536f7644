"""One step, three compilers: the CPU estimate against XLA GPU's and libtpu's own
compiles, none of them on an accelerator.

A 1.2B Llama-style decoder (f32 master weights, bf16 compute, every layer
rematerialised and scanned, adamw; sequence 2048, batch 256) on 64 chips as
data 32 x fsdp 2: preflight without a target (the CPU compiler's estimate),
for 64 H100s (8 nodes of 8, XLA's GPU compiler) and for a TPU v5p-64 slice
(libtpu). Needs ``pip install -e ".[cuda,tpu]"``; a compiler that is missing
is said on its row. ``--quick``: a tiny model on 8 chips, the same code path.

Run: python examples/targets.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator needed, nor started

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType

import spmdtree as st

SIZES = {
    "1.2B": dict(vocab=32000, embed=2048, layers=16, heads=16, head_dim=128, mlp=8192),
    "tiny": dict(vocab=256, embed=64, layers=2, heads=4, head_dim=16, mlp=256),
}
#: (size, sequence length, global batch, (data, fsdp)) per mode.
RUNS = {False: ("1.2B", 2048, 256, (32, 2)), True: ("tiny", 64, 16, (4, 2))}
RULES = [
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    *[(name, None) for name in ("vocab", "layers", "heads", "head_dim", "mlp", "length", "norm")],
]
TARGETS = (None, "h100", "tpu-v5p")


def params(size):
    """The abstract boxed params: f32 master weights, layers stacked for the scan."""
    s = SIZES[size]
    e, h, d, m, n = s["embed"], s["heads"], s["head_dim"], s["mlp"], s["layers"]

    def box(shape, names):
        return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)

    layer = {
        "norm": box((n, e), ("layers", "norm")),
        "qkv": box((n, 3, e, h, d), ("layers", None, "embed", "heads", "head_dim")),
        "out": box((n, h, d, e), ("layers", "heads", "head_dim", "embed")),
        "gate": box((n, e, m), ("layers", "embed", "mlp")),
        "up": box((n, e, m), ("layers", "embed", "mlp")),
        "down": box((n, m, e), ("layers", "mlp", "embed")),
    }
    return {
        "embed": box((s["vocab"], e), ("vocab", "embed")),
        "layers": layer,
        "head": box((e, s["vocab"]), ("embed", "vocab")),
    }


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (normed * scale).astype(x.dtype)


def layer(x, p):
    """One decoder layer in bf16: causal attention, then a gated MLP."""
    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), st.unbox(p))
    h = rms_norm(x, p["norm"])
    q, k, v = jnp.einsum("ble,tehd->tblhd", h, p["qkv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(x.dtype), v)
    x = x + jnp.einsum("blhd,hde->ble", attended, p["out"])
    x = st.with_logical_constraint(x, ("batch", "length", "embed"))
    gated = jax.nn.silu(h @ p["gate"]) * (h @ p["up"])
    return x + gated @ p["down"], None


def loss_fn(params, tokens):
    p = st.unbox(params)
    x = jnp.take(p["embed"], tokens[:, :-1], axis=0).astype(jnp.bfloat16)
    x = st.with_logical_constraint(x, ("batch", "length", "embed"))
    x, _ = st.scan(jax.checkpoint(layer), x, params["layers"], partition_name="layers")
    logits = (x @ p["head"].astype(jnp.bfloat16)).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))


def train_step(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens.value)
    updates, state = optax.adamw(1e-4).update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def preflight(quick, target):
    """The StepPlan of the step, for `target` (None: the CPU estimate)."""
    size, length, batch, shape = RUNS[quick]
    mesh = AbstractMesh(shape, ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    boxed = params(size)
    state = jax.eval_shape(optax.adamw(1e-4).init, boxed)
    tokens = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((batch, length + 1), jnp.int32), ("batch", "length")
    )
    return st.preflight(
        train_step,
        boxed,
        state,
        tokens,
        mesh=mesh,
        rules=RULES,
        params=boxed,
        donate_argnums=(0, 1),
        target=target,
    )


def gib(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def row(step):
    """What a reader compares: peak, the FSDP gathers and reductions, FLOPs."""
    by_kind = {}
    for c in step.collectives:
        count, size = by_kind.get(c.kind, (0, 0))
        by_kind[c.kind] = (count + c.count, size + c.bytes)
    moves = ", ".join(f"{k} {n} x {gib(b)}" for k, (n, b) in by_kind.items())
    return f"peak {gib(step.peak_bytes)}, {step.flops / 1e12:.2f} TFLOP; {moves}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model on 8 chips")
    quick = parser.parse_args().quick
    size, length, batch, shape = RUNS[quick]
    print(f"{size} decoder, batch {batch} x {length}, data {shape[0]} x fsdp {shape[1]}")
    for target in TARGETS:
        try:
            step = preflight(quick, target)
        except ValueError as e:  # a compiler that is not installed says how to get it
            print(f"{target}: {e}")
            continue
        print(f"{step.target}:\n  {row(step)}")
        for flag in step.flags:
            print(f"  ! {flag}")


if __name__ == "__main__":
    main()
