"""Train the decoder of examples/train.py with its layers in pipeline stages (new in 0.8).

The layers, stacked as `st.vmap` builds them, are restaged by `st.stages` into
[repeats, stages, layers per stage, ...], the stage dimension named "stage",
which the rules map onto the mesh's "stage" axis: each device holds only its
own stage's layers. `st.pipeline` runs them as `st.scan` would, as a pipeline
in one SPMD program: the batch split into microbatches that stream through the
stages, each stage passing its output to the next by a collective-permute.
The mesh is (stage 4, data 2) on 8 CPU devices; the loss of the pipelined
step equals the unpipelined one on the same weights, and the compiled step's
plan says what passes between the stages and how much of its loops is bubble.

Run: python examples/pipeline.py [--steps 40] [--repeats 1] [--microbatches 8]
"""

import argparse
import functools
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

import spmdtree as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # the decoder: its params, layers, loss and optimizer

# The stage dimension on the stage axis; the batch over data; the rest whole.
RULES = [
    ("batch", "data"),
    ("stage", "stage"),
    *[(name, None) for name in ("vocab", "heads", "mlp", "embed", "layers", "length", "kv")],
]


def staged_init(key, stages, repeats, **sizes):
    """train.init's params with the layers restaged for the pipeline."""
    params = train.init(key, **sizes)
    return {**params, "layers": st.stages(params["layers"], stages, repeats=repeats)}


def piped(microbatches):
    """train.forward's layers, run as a pipeline (the mesh in context)."""

    def run_layers(x, staged):
        return st.pipeline(train.block, x, staged, microbatches=microbatches)[0]

    return run_layers


def main(argv=None):
    """Trains as the command line says; returns the losses it printed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args(argv)

    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"this example needs 8 devices (stage 4 x data 2); it has {len(devices)}")
    mesh = jax.make_mesh((4, 2), ("stage", "data"), devices=devices[:8])
    print(f"mesh: {dict(mesh.shape)} on 8 {devices[0].platform} device(s), Explicit axes")
    per = args.layers // (4 * args.repeats)
    print(
        f"{args.layers} layers in 4 stages x {args.repeats} repeat(s): stage s holds layers "
        f"(r x 4 + s) x {per} + j of repeat r"
    )
    sizes = dict(vocab=32, length=args.length, width=args.width, layers=args.layers, heads=4)
    sizes["mlp"] = 4 * args.width
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        losses, same = train_pipelined(args, mesh, sizes)
    if not same:
        raise SystemExit("the pipelined loss differs from the scanned one")
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")
    return losses


def train_pipelined(args, mesh, sizes):
    """Prints the plan, the loss against the unpipelined one and the compiled step's
    pipeline, then trains; returns the losses it printed and whether the two agreed."""
    init_fn = functools.partial(staged_init, stages=4, repeats=args.repeats, **sizes)
    print("\nThe plan of the params (the layers' stage dimension on the stage axis):")
    print(st.describe(jax.eval_shape(init_fn, jax.random.key(0)), mesh, rich=False))
    params = st.sharded_init(init_fn, mesh)(jax.random.key(0))
    shape = (args.batch, args.length)
    data = NamedSharding(mesh, st.logical_to_mesh_axes(("batch", "length"), shape=shape, mesh=mesh))
    batches = train.batches(jax.random.key(1), args.batch, args.length, 32)
    tokens = jax.device_put(next(batches), data)
    loss_fn = functools.partial(train.loss_fn, run_layers=piped(args.microbatches))
    same = same_loss(params, tokens, loss_fn, mesh, sizes)

    tx = train.adamw(1e-2)
    step = functools.partial(_step, tx=tx, loss_fn=loss_fn)
    state = jax.jit(tx.init, out_shardings=st.optimizer_sharding(tx, params, mesh))(params)
    compiled = st.preflight(step, params, state, tokens, mesh=mesh.abstract_mesh, rules=RULES)
    print("\nThe compiled step (st.preflight, the CPU's compile), its collectives and pipeline:")
    print("\n".join(line for line in str(compiled).splitlines() if _shown(line)))

    print(f"\ntraining {args.steps} steps, batch {args.batch}, {args.microbatches} microbatches")
    train_step = jax.jit(step, donate_argnums=(0, 1))
    losses = []
    for i in range(1, args.steps + 1):
        params, state, loss = train_step(params, state, jax.device_put(next(batches), data))
        if i in (1, args.steps) or i % 10 == 0:
            losses.append(float(loss))
            print(f"step {i:4d}  loss {losses[-1]:.3f}")
    return losses, same


def same_loss(params, tokens, loss_fn, mesh, sizes):
    """Whether the pipelined loss equals train.py's, on the same weights from the same
    key with the layers stacked as train.py runs them; printed."""
    stacked = st.sharded_init(functools.partial(train.init, **sizes), mesh)(jax.random.key(0))
    scanned = jax.jit(train.loss_fn)(stacked, tokens)
    pipelined = jax.jit(loss_fn)(params, tokens)
    same = bool(jnp.allclose(scanned, pipelined, rtol=1e-5))
    print(
        f"\nloss before training: scanned {scanned:.4f}, pipelined {pipelined:.4f} (equal: {same})"
    )
    return same


def _step(params, state, tokens, tx, loss_fn):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def _shown(line):
    """The lines of the step's table this example is about: its collectives and loops."""
    return line.startswith(("collectives", "  collective-permute", "  all-", "pipeline"))


if __name__ == "__main__":
    main()
