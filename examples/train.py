"""Train a small decoder-only transformer LM, sharded over the devices this machine has.

The model is plain jax functions over a dict of boxed params. Every weight is
named by logical axes ("embed", "heads", "mlp", ...) and rules map those names
onto a (data, fsdp, tensor) mesh built from the devices there are: the
accelerators if any, else 8 CPU devices (2x2x2), or as many as
XLA_FLAGS=--xla_force_host_platform_device_count=N gives (1 works too). Data
and FSDP parallelism over the batch, FSDP-sharded weights, tensor-parallel
heads and MLP. The params are
built directly in their shardings (`st.sharded_init`), the plan is printed
(`st.describe`) before training, AdamW's state gets its shardings from the
params (`st.optimizer_sharding`), and activations are constrained by logical
names inside the jitted step (`st.with_logical_constraint`).

The mesh axes are what `jax.make_mesh` gives (Explicit on current JAX), or
those of --axis-types. On Explicit axes a weight stored FSDP-sharded cannot be
used as it is beside activations whose batch is on the same axis, so the step
brings each weight into its compute layout first (`st.constrain` with
compute_rules(): the FSDP all-gather, layer by layer inside the scan) and says
where a matmul that sums over a sharded dimension puts its result
(`out_sharding`); the gradients flow back to the params' layout. The same step
runs on Auto axes, where those are hints to the compiler.

The task is generated: each sequence starts with two random tokens and goes on
by t[i] = (t[i-1] + t[i-2]) mod vocab, so the loss can fall far below
log(vocab) only by attending to the two previous tokens.

Run: python examples/train.py [--steps 300] [--width 64] [--layers 2] [--batch 32]
     python examples/train.py --axis-types auto  # the same model on Auto mesh axes
     python examples/train.py --platform cpu     # 8 CPU devices, even beside a GPU
"""

import argparse
import functools
import math
import os
import sys
import time

if "--platform" in sys.argv and sys.argv[sys.argv.index("--platform") + 1 :][:1] == ["cpu"]:
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts: the CPU demo
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding

import spmdtree as st

# Rules are tried in order: a name takes the first rule whose mesh axes are free.
RULES = [
    ("batch", ("data", "fsdp")),  # data + FSDP parallelism over the batch
    ("vocab", "tensor"),
    ("heads", "tensor"),  # tensor parallelism over heads and the MLP
    ("mlp", "tensor"),
    ("embed", "fsdp"),  # FSDP: weights sharded over their embed dimension
    ("layers", None),
    ("length", None),
    ("kv", None),
]


def compute_rules():
    """The rules in effect (RULES here) with "embed" unsharded: inside the step each
    weight is used whole along it, gathered from its FSDP shards; tensor parallelism
    stays. Activations resolve alike through RULES, as their "batch" takes "fsdp" first."""
    return [(name, None if name == "embed" else axes) for name, axes in st.get_logical_axis_rules()]


def dense(key, shape, names, scale=1.0):
    std = scale / math.sqrt(shape[0])
    return st.LogicallyPartitioned(std * jax.random.normal(key, shape), names)


def init_layer(key, width, heads, mlp):
    k = jax.random.split(key, 6)
    head_dim = width // heads
    return {
        "norm1": st.LogicallyPartitioned(jnp.ones(width), ("embed",)),
        "query": dense(k[0], (width, heads, head_dim), ("embed", "heads", "kv")),
        "key": dense(k[1], (width, heads, head_dim), ("embed", "heads", "kv")),
        "value": dense(k[2], (width, heads, head_dim), ("embed", "heads", "kv")),
        "out": dense(k[3], (heads, head_dim, width), ("heads", "kv", "embed")),
        "norm2": st.LogicallyPartitioned(jnp.ones(width), ("embed",)),
        "mlp_in": dense(k[4], (width, mlp), ("embed", "mlp")),
        "mlp_out": dense(k[5], (mlp, width), ("mlp", "embed")),
    }


def init(key, vocab, length, width, layers, heads, mlp):
    k_embed, k_pos, k_layers = jax.random.split(key, 3)
    keys = jax.random.split(k_layers, layers)
    layer_init = functools.partial(init_layer, width=width, heads=heads, mlp=mlp)
    return {
        "embed": dense(k_embed, (vocab, width), ("vocab", "embed"), scale=math.sqrt(vocab)),
        "position": dense(k_pos, (length, width), ("length", "embed"), scale=0.1),
        "layers": st.vmap(layer_init, partition_name="layers")(keys),
        "norm": st.LogicallyPartitioned(jnp.ones(width), ("embed",)),
    }


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def out_sharding(names, shape):
    """Where a matmul that sums over a sharded dimension puts its result, by logical
    names: Explicit axes need it said; on Auto ones (None) the compiler chooses."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in mesh.axis_types:
        return None
    return st.logical_to_mesh_axes(names, shape=shape, mesh=mesh)


def block(x, layer):
    """One decoder layer on activations x: (batch, length, embed). For a large model,
    scan `jax.checkpoint(block)`: each layer then gathers its weights again for the
    gradient, and no layer's gathered weights wait for the backward pass."""
    p = st.unbox(st.constrain(layer, rules=compute_rules()))  # this layer's all-gather
    embedded = out_sharding(("batch", "length", "embed"), x.shape)
    h = rms_norm(x, p["norm1"])
    q = jnp.einsum("ble,ehd->blhd", h, p["query"])
    k = jnp.einsum("ble,ehd->blhd", h, p["key"])
    v = jnp.einsum("ble,ehd->blhd", h, p["value"])
    q = st.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    x = x + jnp.einsum("blhd,hde->ble", attended, p["out"], out_sharding=embedded)
    x = st.with_logical_constraint(x, ("batch", "length", "embed"))
    h = jax.nn.gelu(rms_norm(x, p["norm2"]) @ p["mlp_in"])
    h = st.with_logical_constraint(h, ("batch", "length", "mlp"))
    x = x + jnp.matmul(h, p["mlp_out"], out_sharding=embedded)
    return st.with_logical_constraint(x, ("batch", "length", "embed")), None


def scan_layers(x, layers):
    """The layers in turn: a scan over their stacked weights."""
    return st.scan(block, x, layers, partition_name="layers")[0]


def forward(params, tokens, run_layers=scan_layers):
    tables = st.unbox(
        st.constrain({k: params[k] for k in ("embed", "position")}, rules=compute_rules())
    )
    embed = tables["embed"]
    # A one-hot matmul rather than a gather: it shards cleanly over vocab and embed.
    x = jnp.matmul(
        jax.nn.one_hot(tokens, embed.shape[0]),
        embed,
        out_sharding=out_sharding(("batch", "length", "embed"), (*tokens.shape, embed.shape[1])),
    )
    x = x + tables["position"][: tokens.shape[1]]
    x = st.with_logical_constraint(x, ("batch", "length", "embed"))
    x = run_layers(x, params["layers"])
    x = rms_norm(x, st.unbox(st.constrain(params["norm"], rules=compute_rules())))
    logits = x @ embed.T / math.sqrt(embed.shape[1])
    return st.with_logical_constraint(logits, ("batch", "length", "vocab"))


def loss_fn(params, tokens, run_layers=scan_layers):
    logits = forward(params, tokens[:, :-1], run_layers)
    targets = tokens[:, 1:]
    log_probs = jax.nn.log_softmax(logits)
    # A one-hot sum rather than a gather: log_probs are sharded over vocab.
    nll = -jnp.sum(log_probs * jax.nn.one_hot(targets, log_probs.shape[-1]), axis=-1)
    return jnp.mean(nll[:, 1:])  # the first target follows one random token only


def make_train_step(tx):
    """The step: loss and gradients, then the optimizer's update (not jitted)."""

    def train_step(params, state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return train_step


def adamw(lr):
    """AdamW with weight decay on matrices only."""
    return optax.adamw(lr, weight_decay=0.01, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))


def mesh_shape(count):
    """(data, fsdp, tensor) sizes for `count` devices: tensor 2 from 4 devices on,
    fsdp 2 where what is left is even, data the rest (1 -> 1x1x1, 6 -> 3x1x2,
    8 -> 2x2x2, 16 -> 4x2x2)."""
    tensor = 2 if count % 2 == 0 and count >= 4 else 1
    fsdp = 2 if (count // tensor) % 2 == 0 else 1
    return count // (tensor * fsdp), fsdp, tensor


def batches(key, batch, length, vocab):
    """Endless batches of sequences t[i] = (t[i-1] + t[i-2]) mod vocab."""
    while True:
        key, sub = jax.random.split(key)
        start = jax.random.randint(sub, (batch, 2), 0, vocab)
        rows = [start[:, 0], start[:, 1]]
        for _ in range(length - 2):
            rows.append((rows[-1] + rows[-2]) % vocab)
        yield jnp.stack(rows, axis=1)


def main(argv=None):
    """Trains as the command line says; returns the losses it printed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--platform", choices=["cpu"], help="cpu: 8 CPU devices, even beside a GPU")
    parser.add_argument(
        "--axis-types",
        choices=["explicit", "auto"],
        help="the mesh axes' type (default: what jax.make_mesh gives, Explicit on current JAX)",
    )
    args = parser.parse_args(argv)

    devices = jax.devices()
    shape = mesh_shape(len(devices))
    kinds = {"explicit": (AxisType.Explicit,) * 3, "auto": (AxisType.Auto,) * 3}
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=kinds.get(args.axis_types))
    print(
        f"mesh: {dict(mesh.shape)} on {len(devices)} {devices[0].platform} device(s), "
        f"{mesh.axis_types[0].name} axes"
    )
    parallel = shape[0] * shape[1]
    if args.batch % parallel:  # every batch-parallel device gets whole sequences
        args.batch += parallel - args.batch % parallel
        print(
            f"batch rounded up to {args.batch}, a multiple of the {parallel} batch-parallel devices"
        )
    init_fn = functools.partial(
        init,
        vocab=args.vocab,
        length=args.length,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        mlp=args.mlp,
    )
    tx = adamw(args.lr)

    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        abstract = jax.eval_shape(init_fn, jax.random.key(0))
        print("\nThe plan, before anything is allocated:")
        print(st.describe(abstract, mesh, rich=False))
        for problem in st.validate_rules(RULES, mesh, abstract):
            print("rules check:", problem)
        print("  (expected: 'batch' names activations, which no param has)")

        params = st.sharded_init(init_fn, mesh)(jax.random.key(0))
        param_shardings = st.to_sharding(params, mesh)
        state_shardings = st.optimizer_sharding(tx, params, mesh)
        state = jax.jit(tx.init, out_shardings=state_shardings)(params)
        data_spec = st.logical_to_mesh_axes(
            ("batch", "length"), shape=(args.batch, args.length), mesh=mesh
        )
        data_sharding = NamedSharding(mesh, data_spec)

        train_step = jax.jit(
            make_train_step(tx),
            in_shardings=(param_shardings, state_shardings, data_sharding),
            out_shardings=(param_shardings, state_shardings, None),
            donate_argnums=(0, 1),
        )

        print(f"\ntraining {args.steps} steps, batch {args.batch} x length {args.length}")
        data = batches(jax.random.key(1), args.batch, args.length, args.vocab)
        losses, start = [], time.perf_counter()
        last, last_step = start, 0
        for step in range(1, args.steps + 1):
            tokens = jax.device_put(next(data), data_sharding)
            params, state, loss = train_step(params, state, tokens)
            if step % args.log_every == 0 or step in (1, args.steps):
                losses.append(float(loss))  # waits for the step to finish
                now = time.perf_counter()
                if step == 1:
                    speed = f"(compiled and ran in {now - start:.1f} s)"
                else:
                    speed = f"{(step - last_step) / (now - last):6.1f} steps/s"
                print(f"step {step:4d}  loss {losses[-1]:.3f}  {speed}")
                last, last_step = now, step

    elapsed = time.perf_counter() - start
    kernel = params["layers"]["mlp_in"].value
    total = sum(x.nbytes for x in jax.tree.leaves(st.unbox(params)))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(st.unbox(params)))
    print(f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f} (log vocab = {math.log(args.vocab):.3f})")
    print(f"{args.steps} steps in {elapsed:.1f} s, compilation included")
    print(f"mlp_in {kernel.shape} is sharded {kernel.sharding.spec}")
    print(
        f"params: {total / 1024:.1f} KiB in all, {per_device / 1024:.1f} KiB on each device "
        f"({total / per_device:.1f}x less than unsharded)"
    )
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")
    return losses


if __name__ == "__main__":
    main()
