"""Train a decoder whose MLPs are mixtures of experts, split over the devices (new in 0.8).

The attention is examples/train.py's; each layer's MLP is `experts` MLPs
stacked, `[experts, embed, mlp]` named ("expert", "embed", "mlp"), and the
rules map "expert" onto the mesh's "expert" axis: each device holds its share
of the experts and never gathers the others. A router sends each token to its
top_k experts (2), a weighted sum of their outputs (Mixtral's gates: a softmax
over the chosen logits). Each expert takes at most
ceil(capacity_factor x tokens x top_k / experts) tokens of a sequence, first
choices first; a choice past that is dropped (GShard; MaxText's "dropping"
MoE) and adds nothing, and a load-balancing loss keeps the router even.

In the step the tokens are split over ("data", "expert") jointly, for the
dispatch only: each device routes its own sequences, writes every choice into
its expert's slots, and `jax.lax.all_to_all` over "expert" (in `jax.shard_map`)
sends the slots to the experts' owners; each runs its experts by grouped
matmuls (`jax.lax.ragged_dot`, the slots sorted by expert, one group per
expert), and the reverse all-to-all brings the outputs home to be summed. The
same model with the experts unsharded (every device runs all of them on its
own tokens, nothing exchanged) has the same loss. The mesh is (expert 4,
data 2) on 8 CPU devices, Explicit axes; the plan of the compiled step
(`st.preflight`) shows the all-to-alls over expert, and the loss falls.

Outside the experts the batch is split over "data" alone: the devices along
"expert" each run the attention of the same sequences, and gather the MoE's
output back over "expert" (the plan's all-gathers, of activations only). Rules
that map "batch" to ("data", "expert") split the attention too, and the
dispatch then needs no reslicing and no gather.

Run: python examples/moe.py [--steps 30] [--experts 8] [--top-k 2] [--capacity-factor 1.25]
"""

import argparse
import dataclasses
import functools
import math
import os
import sys
from typing import NamedTuple

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # the decoder's pieces: rms_norm, dense, the task's batches, adamw


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's sizes and its routing, checked when made (small: a CPU demo)."""

    vocab: int = 32
    length: int = 16
    width: int = 32
    layers: int = 2
    heads: int = 4
    experts: int = 8
    mlp: int = 64
    top_k: int = 2
    capacity_factor: float = 1.25
    balance_weight: float = 0.01
    batch: int = 16

    def __post_init__(self):
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"Config: `top_k` is {self.top_k}, but each token picks top_k distinct experts "
                f"of the {self.experts}. Pass a top_k from 1 to {self.experts}, or more experts."
            )
        if not self.capacity_factor > 0:
            raise ValueError(
                f"Config: `capacity_factor` is {self.capacity_factor}, but it must be above 0: "
                "each expert takes ceil(capacity_factor x tokens x top_k / experts) tokens of "
                "a sequence. Pass a positive factor: 1.25 drops a few tokens, "
                f"experts / top_k = {self.experts / self.top_k:g} drops none."
            )

    def capacity(self, tokens):
        """How many of a sequence's `tokens` tokens each expert takes."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


def make_rules():
    """The experts on the mesh axis "expert", the batch on "data", the rest whole."""
    return [
        ("batch", "data"),
        ("expert", "expert"),
        *[(name, None) for name in ("vocab", "heads", "mlp", "embed", "layers", "length", "kv")],
    ]


def mesh_axes(name, rules=None):
    """The mesh axes a logical name resolves to (the rules in context by default)."""
    axes = st.logical_to_mesh_axes((name,), rules)[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def check_experts(where, cfg, mesh, rules=None):
    """Raises a ValueError unless the experts divide over their mesh axes."""
    axes = mesh_axes("expert", rules)
    devices = math.prod(mesh.shape[a] for a in axes)
    if cfg.experts % devices:
        raise ValueError(
            f"{where}: {cfg.experts} experts do not divide over the mesh axes {axes} of "
            f"{devices} devices, each of which holds an equal share of them. Pass a multiple "
            f"of {devices} experts, or a mesh whose {axes} axes divide {cfg.experts}."
        )


def init_layer(key, cfg):
    """One layer: train.py's attention and norms, a router and the stacked experts."""
    k_attention, k_router, k_in, k_out = jax.random.split(key, 4)
    attention = train.init_layer(k_attention, cfg.width, cfg.heads, cfg.mlp)
    return {
        **{name: box for name, box in attention.items() if not name.startswith("mlp")},
        # The router is whole on every device: each routes its own tokens to all experts.
        "router": train.dense(k_router, (cfg.width, cfg.experts), ("embed", None)),
        "mlp_in": expert_dense(k_in, (cfg.experts, cfg.width, cfg.mlp), ("expert", "embed", "mlp")),
        "mlp_out": expert_dense(
            k_out, (cfg.experts, cfg.mlp, cfg.width), ("expert", "mlp", "embed")
        ),
    }


def expert_dense(key, shape, names):
    """Stacked experts' weights [experts, in, out], each scaled by its own fan-in."""
    return st.LogicallyPartitioned(jax.random.normal(key, shape) / math.sqrt(shape[1]), names)


def init(key, cfg):
    """The boxed params: embeddings, the layers stacked by `st.vmap`, the last norm."""
    k_embed, k_position, k_layers = jax.random.split(key, 3)
    layers = st.vmap(functools.partial(init_layer, cfg=cfg), partition_name="layers")
    return {
        "embed": train.dense(
            k_embed, (cfg.vocab, cfg.width), ("vocab", "embed"), scale=math.sqrt(cfg.vocab)
        ),
        "position": train.dense(k_position, (cfg.length, cfg.width), ("length", "embed"), 0.1),
        "layers": layers(jax.random.split(k_layers, cfg.layers)),
        "norm": st.LogicallyPartitioned(jnp.ones(cfg.width), ("embed",)),
    }


def init_params(key, cfg, mesh, rules):
    """The params built directly in the shardings the rules give them on `mesh`."""
    check_experts("init_params", cfg, mesh, rules)
    return st.sharded_init(functools.partial(init, cfg=cfg), mesh, rules)(key)


def make_batch(key, cfg, mesh, rules):
    """A batch of the task's sequences (train.py's), laid out as the rules place
    ("batch", "length") on `mesh`."""
    tokens = next(train.batches(key, cfg.batch, cfg.length, cfg.vocab))
    spec = st.logical_to_mesh_axes(("batch", "length"), rules, shape=tokens.shape, mesh=mesh)
    return jax.device_put(tokens, NamedSharding(mesh, spec))


class Routing(NamedTuple):
    """Where a group's tokens go: each [groups, tokens, top_k] but `balance`, [groups]."""

    experts: jax.Array  # the chosen experts, best first
    gates: jax.Array  # their weights in the sum, a softmax over the chosen logits
    slots: jax.Array  # each choice's slot among its expert's, past the end where dropped
    kept: jax.Array  # whether the choice found room under the expert's capacity
    balance: jax.Array  # the load-balancing loss: 1 where the router is even


def route(x, router, cfg):
    """Routes groups of tokens x [groups, tokens, embed] to their top_k experts, each
    expert taking `cfg.capacity(tokens)` of each group: group g's slots in an expert's
    buffer are those from g x capacity on."""
    groups, tokens, _ = x.shape
    capacity = cfg.capacity(tokens)
    logits = x @ router
    best, experts = jax.lax.top_k(logits, cfg.top_k)
    chosen = jax.nn.one_hot(experts, cfg.experts, dtype=jnp.int32)  # [g, t, k, E]
    # Every token's first choice queues before any second choice (GShard's priority).
    queue = chosen.transpose(0, 2, 1, 3).reshape(groups, cfg.top_k * tokens, cfg.experts)
    ahead = jnp.cumsum(queue, axis=1).reshape(groups, cfg.top_k, tokens, cfg.experts)
    position = jnp.sum((ahead.transpose(0, 2, 1, 3) - 1) * chosen, axis=-1)
    kept = position < capacity
    start = jnp.arange(groups)[:, None, None] * capacity
    slots = jnp.where(kept, start + position, groups * capacity)
    share = jnp.mean(chosen, axis=(1, 2))  # of the choices, per expert
    balance = cfg.experts * jnp.sum(share * jnp.mean(jax.nn.softmax(logits), axis=1), -1)
    return Routing(experts, jax.nn.softmax(best), slots, kept, balance)


def run_experts(tokens, filled, w_in, w_out):
    """Each expert's MLP on its slots, tokens [experts, slots, embed], by two grouped
    matmuls: the filled slots sorted by expert, one group per expert (empty ones last)."""
    experts, slots, width = tokens.shape
    owner = jnp.where(filled, jnp.arange(experts)[:, None], experts).reshape(-1)
    order = jnp.argsort(owner, stable=True)
    sizes = jnp.sum(filled, axis=1, dtype=jnp.int32)
    rows = tokens.reshape(-1, width)[order]
    hidden = jax.nn.gelu(jax.lax.ragged_dot(rows, w_in, sizes))
    out = jax.lax.ragged_dot(hidden, w_out, sizes)  # rows past the groups: zeros
    return jnp.zeros_like(out).at[order].set(out).reshape(experts, slots, width)


def moe_local(x, router, w_in, w_out, *, cfg, expert_axes):
    """The MoE MLP on one device's sequences x [groups, tokens, embed] with its experts
    (all of them where `expert_axes` is empty); the output, balance and dropped share."""
    routing = route(x, router, cfg)
    groups, tokens, width = x.shape
    slots = groups * cfg.capacity(tokens)
    at = (routing.experts, routing.slots)  # a dropped choice's slot is past the end
    copies = jnp.broadcast_to(x[:, :, None], (*routing.kept.shape, width))
    buffer = jnp.zeros((cfg.experts, slots, width), x.dtype).at[at].set(copies, mode="drop")
    filled = jnp.zeros((cfg.experts, slots), jnp.int32).at[at].set(1, mode="drop")
    if expert_axes:  # the slots to their experts' owners: [experts / n, n x slots, ...]
        buffer, filled = (
            jax.lax.all_to_all(a, expert_axes, 0, 1, tiled=True) for a in (buffer, filled)
        )
    out = run_experts(buffer, filled > 0, w_in, w_out)
    if expert_axes:  # and back: [experts, slots, embed]
        out = jax.lax.all_to_all(out, expert_axes, 1, 0, tiled=True)
    outputs = out.at[at].get(mode="fill", fill_value=0)  # [g, t, k, embed]
    y = jnp.einsum("gtkd,gtk->gtd", outputs, jnp.where(routing.kept, routing.gates, 0))
    return y, routing.balance, 1 - jnp.mean(routing.kept, axis=(1, 2))


def moe(x, layer, cfg, *, sharded_experts):
    """The MoE MLP on x [batch, length, embed], a layer's router and experts (unboxed),
    under the mesh and rules in context: its output, and per sequence the balance
    loss and the share of choices dropped.

    Sharded: the tokens split over the batch's mesh axes and the experts' jointly,
    the experts over theirs, and all-to-alls between. Unsharded: the experts
    gathered whole on every device, which runs them all on its batch shard."""
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = mesh_axes("batch")
    expert_axes = mesh_axes("expert") if sharded_experts else ()
    if sharded_experts:
        check_experts("moe", cfg, mesh)
    token_axes = (*batch_axes, *(a for a in expert_axes if a not in batch_axes))
    devices = math.prod(mesh.shape[a] for a in token_axes)
    if x.shape[0] % devices:
        raise ValueError(
            f"moe: the batch of {x.shape[0]} sequences does not divide over the {devices} "
            f"devices of the mesh axes {token_axes}, over which the tokens are dispatched. "
            f"Pass a batch that is a multiple of {devices}."
        )
    tokens, weights = P(token_axes or None), P(expert_axes or None)
    local = jax.shard_map(
        functools.partial(moe_local, cfg=cfg, expert_axes=expert_axes),
        in_specs=(tokens, P(), weights, weights),
        out_specs=(tokens, tokens, tokens),
    )
    w_in, w_out = (jax.reshard(layer[k], weights) for k in ("mlp_in", "mlp_out"))
    y, balance, dropped = local(
        jax.reshard(x, tokens), jax.reshard(layer["router"], P()), w_in, w_out
    )
    return jax.reshard(y, jax.typeof(x).sharding.spec), balance, dropped


def attention(x, p):
    """train.py's causal self-attention, with its residual."""
    h = train.rms_norm(x, p["norm1"])
    q, k, v = (jnp.einsum("ble,ehd->blhd", h, p[name]) for name in ("query", "key", "value"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return x + jnp.einsum("bhqk,bkhd,hde->bqe", weights, v, p["out"])


def block(x, layer, cfg, sharded_experts):
    """One decoder layer on x [batch, length, embed]; its balance loss and drops."""
    p = st.unbox(layer)
    x = st.with_logical_constraint(attention(x, p), ("batch", "length", "embed"))
    y, balance, dropped = moe(
        train.rms_norm(x, p["norm2"]), p, cfg, sharded_experts=sharded_experts
    )
    return st.with_logical_constraint(x + y, ("batch", "length", "embed")), (balance, dropped)


def evaluate(params, batch, cfg, *, sharded_experts):
    """The loss of a batch of sequences [batch, length], and what went into it: the
    next-token loss, the balance loss and the share of choices dropped (mean of layers)."""
    p = st.unbox(params)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    x = jax.nn.one_hot(tokens, cfg.vocab) @ p["embed"] + p["position"][: tokens.shape[1]]
    x = st.with_logical_constraint(x, ("batch", "length", "embed"))
    layer = functools.partial(block, cfg=cfg, sharded_experts=sharded_experts)
    x, (balance, dropped) = st.scan(layer, x, params["layers"], partition_name="layers")
    logits = train.rms_norm(x, p["norm"]) @ p["embed"].T / math.sqrt(cfg.width)
    nll = -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(targets, cfg.vocab), axis=-1)
    nll = jnp.mean(nll[:, 1:])  # the first target follows one random token only
    loss = nll + cfg.balance_weight * jnp.mean(balance)
    return {"loss": loss, "nll": nll, "balance": jnp.mean(balance), "dropped": jnp.mean(dropped)}


def loss_fn(params, batch, cfg, *, sharded_experts):
    """The loss to train: next-token loss plus the weighted balance loss."""
    return evaluate(params, batch, cfg, sharded_experts=sharded_experts)["loss"]


def train_step(params, state, batch, *, cfg, tx, sharded_experts=True):
    """The step (not jitted): loss and gradients, then the optimizer's update."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg, sharded_experts=sharded_experts)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def main(argv=None):
    """Trains as the command line says; returns the losses it printed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    sizes = ("batch", "length", "width", "layers", "experts", "mlp", "top_k", "capacity_factor")
    try:
        cfg = Config(**{name: getattr(args, name) for name in sizes})
    except ValueError as e:
        parser.error(str(e))

    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"this example needs 8 devices (expert 4 x data 2); it has {len(devices)}")
    mesh = jax.make_mesh((4, 2), ("expert", "data"), devices=devices[:8])
    print(f"mesh: {dict(mesh.shape)} on 8 {devices[0].platform} device(s), Explicit axes")
    rules = make_rules()
    with st.logical_axis_rules(rules), jax.set_mesh(mesh):
        params = init_params(jax.random.key(0), cfg, mesh, rules)
        print("\nThe experts' params, each device holding its share of the experts:")
        plan = st.describe(params, mesh, rich=False).splitlines()
        print("\n".join(f"{row}\n{plan[i + 1]}" for i, row in enumerate(plan) if "/mlp_" in row))
        losses = train_moe(args, cfg, params, mesh, rules)
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")
    return losses


def train_moe(args, cfg, params, mesh, rules):
    """Prints the sharded loss against the unsharded one and the compiled step's
    collectives, then trains; returns the losses it printed."""
    batch = functools.partial(make_batch, cfg=cfg, mesh=mesh, rules=rules)
    tokens = batch(jax.random.key(1))
    said = {}
    for sharded in (True, False):
        said[sharded] = jax.jit(functools.partial(evaluate, cfg=cfg, sharded_experts=sharded))(
            params, tokens
        )
    same = bool(jnp.allclose(said[True]["loss"], said[False]["loss"], rtol=1e-5))
    print(
        f"\nloss before training: experts sharded {said[True]['loss']:.4f}, "
        f"unsharded {said[False]['loss']:.4f} (equal: {same})"
    )
    if not same:
        raise SystemExit("the expert-sharded loss differs from the unsharded one")
    print(
        f"routing: top {cfg.top_k} of {cfg.experts} experts, each taking "
        f"{cfg.capacity(cfg.length - 1)} of a sequence's {cfg.length - 1} tokens; "
        f"{said[True]['dropped']:.1%} of the choices dropped"
    )

    tx = train.adamw(args.lr)
    step = functools.partial(train_step, cfg=cfg, tx=tx, sharded_experts=True)
    state = jax.jit(tx.init, out_shardings=st.optimizer_sharding(tx, params, mesh))(params)
    compiled = st.preflight(step, params, state, tokens, mesh=mesh.abstract_mesh, rules=rules)
    print(
        "\nThe compiled step (st.preflight, the CPU's compile), its collectives (the all-gathers"
        "\nbring the MoE's output back over expert: activations; no expert weight is gathered):"
    )
    print("\n".join(line for line in str(compiled).splitlines() if _shown(line)))

    print(f"\ntraining {args.steps} steps, batch {cfg.batch} x length {cfg.length}")
    train_step_jit = jax.jit(step, donate_argnums=(0, 1))
    losses = []
    for i in range(1, args.steps + 1):
        tokens = batch(jax.random.fold_in(jax.random.key(1), i))
        params, state, loss = train_step_jit(params, state, tokens)
        if i in (1, args.steps) or i % 10 == 0:
            losses.append(float(loss))
            print(f"step {i:4d}  loss {losses[-1]:.3f}")
    return losses


def _shown(line):
    """The lines of the step's table this example is about: its collectives."""
    return line.startswith(("collectives", "  all-", "  collective-permute", "  reduce-scatter"))


if __name__ == "__main__":
    main()
