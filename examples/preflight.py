"""Will a Llama-3 8B training step fit on 256 or 2,048 chips? Ask the compiler, on a laptop.

`st.plan` counts the arrays a sharding places: params, grads, optimizer
state. A training step needs more (activations, the compiler's temporaries),
and only the compiler knows how much. `st.preflight` compiles the whole step
for a `jax.sharding.AbstractMesh` on as many fake CPU devices (in a
subprocess when this process has fewer), without allocating anything, and
reads the compiled step's memory and collectives.

The step: a compact Llama-style decoder written with spmdtree (Llama-3 8B
shapes from examples/llama.py, bf16, grouped-query attention, a gated MLP,
each layer under `jax.checkpoint`, no rotary embedding), cross-entropy and
adamw. For two layouts (FSDP + tensor parallelism; hybrid sharded data
parallelism + tensor) on 256 and 2,048 chips it prints the per-chip peak at one sequence per batch-parallel
chip, the collective traffic per step, and the largest per-chip batch that
fits an 80 GiB budget, found by bisection. The CPU compile estimates an
accelerator's peak (measured from above, +1% to +16%, see docs/planning.md).

Run: python examples/preflight.py [--budget-gib 80] [--length 4096] [--chips 256 2048]
"""

import argparse
import collections
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType

import spmdtree as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import llama  # abstract Llama-3 param trees

# Enough CPU devices for the largest mesh, set before JAX starts its CPU backend:
# every preflight then compiles in this process (else each would start a
# subprocess with that many devices, which also works, a little slower).
jax.config.update("jax_num_cpu_devices", 2048)

GIB = 2**30
AXES = ("data", "fsdp", "tensor")
TENSOR = llama.TENSOR_RULES
#: One rule set, two layouts over (data, fsdp, tensor): FSDP over all but the
#: tensor axis, or hybrid (HSDP: FSDP within groups of chips, data parallel
#: across them). The batch is split over data x fsdp.
RULES = [
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    *TENSOR,
    *[(name, None) for name in ("length", "norm", "layers", "kv", "kv_head_dim")],
]
MESHES = {
    "fsdp+tensor": {256: (1, 32, 8), 2048: (1, 256, 8)},
    "hsdp+tensor": {256: (8, 4, 8), 2048: (8, 32, 8)},
}


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (normed * scale).astype(x.dtype)


def layer(x, p):
    """One decoder layer on x: (batch, length, embed)."""
    p = st.unbox(p)
    h = rms_norm(x, p["attention_norm"])
    q = jnp.einsum("ble,ehd->blhd", h, p["query"])
    k = jnp.einsum("ble,ehd->blhd", h, p["key"])
    v = jnp.einsum("ble,ehd->blhd", h, p["value"])
    q = st.with_logical_constraint(q, ("batch", "length", "q_heads", "kv"))
    groups = q.shape[2] // k.shape[2]  # grouped-query attention: kv heads shared
    q = q.reshape(*q.shape[:2], k.shape[2], groups, q.shape[-1])
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32), axis=-1)
    attended = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(x.dtype), v)
    attended = attended.reshape(*attended.shape[:2], -1, attended.shape[-1])
    x = x + jnp.einsum("blhd,hde->ble", attended, p["out"])
    x = st.with_logical_constraint(x, ("batch", "length", "embed"))
    h = rms_norm(x, p["mlp_norm"])
    gated = jax.nn.silu(h @ p["wi_0"]) * (h @ p["wi_1"])
    gated = st.with_logical_constraint(gated, ("batch", "length", "mlp"))
    return st.with_logical_constraint(x + gated @ p["wo"], ("batch", "length", "embed")), None


#: What each layer keeps for the backward pass, by MaxText's names for its
#: `remat_policy`: "full" keeps nothing (the layer is recomputed), "minimal" keeps
#: the matmuls' outputs that have no batch dimensions in their contraction.
REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def make_loss_fn(remat="full"):
    """The next-token loss, each layer under `jax.checkpoint` with `REMAT[remat]`."""
    remat_layer = jax.checkpoint(layer, prevent_cse=False, policy=REMAT[remat])

    def loss_fn(params, tokens):
        table = st.with_logical_constraint(st.unbox(params["embed"]), ("vocab", None))
        x = jnp.take(table, tokens[:, :-1], axis=0)
        x = st.with_logical_constraint(x, ("batch", "length", "embed"))
        x, _ = st.scan(remat_layer, x, params["layers"], partition_name="layers")
        x = rms_norm(x, st.unbox(params["final_norm"]))
        logits = (x @ st.unbox(params["output"])).astype(jnp.float32)
        logits = st.with_logical_constraint(logits, ("batch", "length", "vocab"))
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

    return loss_fn


loss_fn = make_loss_fn()


def make_train_step(remat="full", microbatches=1):
    """The adamw train step, its layers under `remat`, its gradients accumulated
    over `microbatches` slices of the batch (`st.accumulate`)."""
    grad_fn = st.accumulate(jax.value_and_grad(make_loss_fn(remat)), microbatches)

    def train_step(params, state, tokens):
        tx = optax.adamw(1e-4)
        loss, grads = grad_fn(params, tokens.value)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return train_step


train_step = make_train_step()


def preflight(layout, chips, per_chip, length):
    """The StepPlan of one step at `per_chip` sequences per batch-parallel chip."""
    shape = MESHES[layout][chips]
    mesh = jax.sharding.AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * 3)
    params = llama.params("8B")
    state = jax.eval_shape(optax.adamw(1e-4).init, params)
    tokens = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((per_chip * shape[0] * shape[1], length + 1), jnp.int32),
        ("batch", "length"),
    )
    return st.preflight(
        train_step,
        params,
        state,
        tokens,
        mesh=mesh,
        rules=RULES,
        params=params,
        donate_argnums=(0, 1),
    )


def largest_batch(layout, chips, length, budget, first):
    """The largest per-chip batch whose step fits `budget` (0 if one sequence does
    not). Peaks grow about linearly with the batch: two compiles predict the
    answer, and bisection between brackets that compiles confirmed finds it."""
    peaks = {1: first.peak_bytes}

    def fits(batch):
        if batch not in peaks:
            peaks[batch] = preflight(layout, chips, batch, length).peak_bytes
        return peaks[batch] <= budget

    if not fits(1):
        return 0
    if not fits(2):
        return 1
    guess = 1 + int((budget - peaks[1]) // max(peaks[2] - peaks[1], 1))
    lo, hi = (guess, guess + 1) if fits(guess) else (1, guess)
    while fits(hi):  # the prediction fell short: widen
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=80.0, help="memory per chip")
    parser.add_argument("--length", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--chips", type=int, nargs="+", default=[256, 2048], choices=[256, 2048])
    parser.add_argument("--no-search", action="store_true", help="skip the batch search")
    args = parser.parse_args()
    budget = int(args.budget_gib * GIB)
    start = time.perf_counter()
    print(
        f"Llama-3 8B train step, bf16, adamw, length {args.length}, against "
        f"{args.budget_gib:g} GiB per chip"
    )
    print("(per chip; compiled for fake CPU devices: an estimate; nothing allocated)\n")
    print(
        f"{'chips':>5}  {'layout':<12}{'mesh':<9}{'arrays':>8}{'peak':>9}"
        f"{'gather':>9}{'reduce':>9}{'sent':>9}  {'batch/chip':>10}"
    )
    for chips in args.chips:
        for layout, shapes in MESHES.items():
            step = preflight(layout, chips, 1, args.length)
            moved = collections.Counter()
            for row in step.collectives:  # one row per kind and mesh axes
                moved[row.kind] += row.bytes
            reduced = moved["all-reduce"] + moved["reduce-scatter"]
            best = (
                "-" if args.no_search else largest_batch(layout, chips, args.length, budget, step)
            )
            print(
                f"{chips:>5}  {layout:<12}{'x'.join(map(str, shapes[chips])):<9}"
                f"{step.inputs.device_bytes / GIB:>7.2f}G{step.peak_bytes / GIB:>8.2f}G"
                f"{moved['all-gather'] / GIB:>8.2f}G{reduced / GIB:>8.2f}G"
                f"{sum(row.wire_bytes for row in step.collectives) / GIB:>8.2f}G  {best:>10}"
            )
    print(
        "\narrays: params + adamw state on a chip (what st.plan counts); peak: the whole "
        "step at one\nsequence per chip; gather, reduce: the results of all-gathers and of "
        "all-reduces + reduce-scatters\nper step (a reduce-scatter's is its shard); sent: "
        "what a chip sends per step by the ring\nalgorithm (Collective.wire_bytes); "
        "batch/chip: the most sequences per batch-parallel chip that fit\n(bisection)."
    )
    print(f"\nThe step on {args.chips[0]} chips, fsdp+tensor, one sequence per chip:")
    print(preflight("fsdp+tensor", args.chips[0], 1, args.length))
    print(f"\npreflighted in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
