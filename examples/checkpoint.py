"""Checkpoint a sharded train state with orbax, and restore it onto other topologies.

Trains the main example's language model (examples/train.py) on a 2x4
(fsdp, tensor) mesh, with adamw and with adafactor (whose factored statistics
are reduced states), saving every few steps with an asynchronous
`ocp.CheckpointManager`: training goes on while a save is written. It then
restores the state saved half-way:

  (a) onto the same mesh,
  (b) onto a 4x2 mesh,
  (c) onto a 1-D mesh of 4 devices, with other rules,
  (d) in a fresh process, whose targets come only from `jax.eval_shape`,

and trains on after each restore. The losses equal those of an unbroken run:
exactly on the same mesh, within 1e-5 relative elsewhere. The restore is three
lines: build the target with `st.to_abstract(..., params=)`, call
`mngr.restore`, go on.

Run: python examples/checkpoint.py [--optimizer adamw|adafactor|both] [--steps 12]
                                   [--save-every 3] [--dir DIR]
"""

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import optax
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train  # the main example's model: init, loss_fn, batches

SIZES = dict(vocab=32, length=16, width=32, layers=2, heads=4, mlp=64)
BATCH = 16
#: Rules for meshes with (fsdp, tensor) axes, and for a 1-D fsdp mesh: a rule set
#: names only axes its meshes have.
RULES = [
    ("batch", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("layers", None),
    ("length", None),
    ("kv", None),
]
RULES_1D = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "fsdp"), ("vocab", None)]
#: How far a restore onto another mesh may move the losses: that mesh sums in another
#: order, so float32 results differ in their last bits (a few units in the last place,
#: depending on the CPU and the jax version; 2e-7 relative at most where measured).
TOLERANCE = 1e-5
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(
        1e-2, weight_decay=0.01, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


def devices() -> list:
    """8 devices: the accelerators if there are that many, else CPU devices."""
    for found in (jax.devices(), jax.devices("cpu")):
        if len(found) >= 8:
            return found[:8]
    raise SystemExit(
        "examples/checkpoint.py restores onto meshes of 2x4, 4x2 and 4 devices, so it "
        f"needs 8 devices; this process has {len(jax.devices('cpu'))} CPU devices. Run it "
        "without XLA_FLAGS (it asks for 8 CPU devices) or with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8."
    )


def topology(name: str) -> tuple[jax.sharding.Mesh, list]:
    """A named mesh (Auto axes) and the rules that go with it."""
    auto, found = AxisType.Auto, devices()
    if name == "2x4":
        mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(auto, auto), devices=found)
        return mesh, RULES
    if name == "4x2":
        mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(auto, auto), devices=found)
        return mesh, RULES
    return jax.make_mesh((4,), ("fsdp",), axis_types=(auto,), devices=found[:4]), RULES_1D


def init_fn(key):
    return train.init(key, **SIZES)


def tokens(steps: int) -> list:
    """The same batches for every run: step i trains on tokens(steps)[i - 1]."""
    stream = train.batches(jax.random.key(1), BATCH, SIZES["length"], SIZES["vocab"])
    return list(itertools.islice(stream, steps))


class Trainer:
    """One optimizer on one topology: the jitted step and the state's shardings."""

    def __init__(self, tx, name: str) -> None:
        self.tx, self.name = tx, name
        self.mesh, self.rules = topology(name)
        with st.logical_axis_rules(self.rules):
            abstract = jax.eval_shape(init_fn, jax.random.key(0))
            self.params_sharding = st.to_sharding(abstract, self.mesh)
            self.opt_sharding = st.optimizer_sharding(tx, abstract, self.mesh)
        self.data = NamedSharding(self.mesh, P("fsdp"))

        def step(params, opt_state, batch):
            with st.logical_axis_rules(self.rules):  # read while tracing
                loss, grads = jax.value_and_grad(train.loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        shardings = (self.params_sharding, self.opt_sharding)
        self.step = jax.jit(
            step, in_shardings=(*shardings, self.data), out_shardings=(*shardings, None)
        )

    def fresh(self) -> dict:
        """A new train state, built directly in its shardings."""
        params = st.sharded_init(init_fn, self.mesh, self.rules)(jax.random.key(0))
        return {
            "params": params,
            "opt_state": jax.jit(self.tx.init, out_shardings=self.opt_sharding)(params),
        }

    def restore(self, mngr: ocp.CheckpointManager, step: int, abstract: dict) -> dict:
        """The three lines: target, restore, go on."""
        target = st.to_abstract(abstract, self.mesh, self.rules, params=abstract["params"])
        return mngr.restore(step, args=ocp.args.StandardRestore(target))

    def train(self, state: dict, batches: list, first: int, last: int, mngr=None) -> list[float]:
        """Steps `first`..`last`, saving after every step the manager wants."""
        losses = []
        with jax.set_mesh(self.mesh):
            for step in range(first, last + 1):
                batch = jax.device_put(batches[step - 1], self.data)
                params, opt_state, loss = self.step(state["params"], state["opt_state"], batch)
                state = {"params": params, "opt_state": opt_state}
                losses.append(float(loss))
                if mngr is not None:  # asynchronous: training goes on while it writes
                    mngr.save(step, args=ocp.args.StandardSave(state))
        return losses


def abstract_state(tx) -> dict:
    """The train state's structure, shapes and boxes, from jax.eval_shape alone."""
    params = jax.eval_shape(init_fn, jax.random.key(0))
    return {"params": params, "opt_state": jax.eval_shape(tx.init, params)}


def compare(label: str, got: list[float], want: list[float], exact: bool) -> float:
    """Checks `got` against the unbroken run: bit for bit, or within TOLERANCE relative."""
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    print(f"  {label:<34} losses {' '.join(f'{x:.6f}' for x in got)}")
    if exact and got != want:
        raise SystemExit(f"{label}: losses differ from the unbroken run: {got} != {want}")
    if worst > TOLERANCE:
        raise SystemExit(f"{label}: losses differ by {worst:.2e} relative (> 1e-5)")
    # The tolerance checked, never the digits measured: those vary with the CPU and jax.
    print(f"  {'':<34} {'equal, bit for bit' if exact else 'equal within 1e-5 relative'}")
    return worst


def run(name: str, steps: int, save_every: int, directory: pathlib.Path) -> None:
    tx = OPTIMIZERS[name]()
    batches = tokens(steps)
    home = Trainer(tx, "2x4")
    print(f"\n{name}: mesh 2x4 (fsdp, tensor), {steps} steps")
    unbroken = home.train(home.fresh(), batches, 1, steps)
    print(f"  {'unbroken run':<34} losses {' '.join(f'{x:.6f}' for x in unbroken)}")

    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=3)
    with ocp.CheckpointManager(directory / name, options=options) as mngr:
        half = steps // 2
        home.train(home.fresh(), batches, 1, half, mngr)
        mngr.wait_until_finished()
        saved = mngr.latest_step()
        print(f"  saved steps {list(mngr.all_steps())} while training; restoring step {saved}")
        for label, where, exact in [
            ("(a) same mesh 2x4", "2x4", True),
            ("(b) mesh 4x2", "4x2", False),
            ("(c) 1-D mesh of 4, other rules", "4", False),
        ]:
            trainer = home if where == "2x4" else Trainer(tx, where)
            state = trainer.restore(mngr, saved, abstract_state(tx))
            got = trainer.train(state, batches, saved + 1, steps)
            compare(label, got, unbroken[saved:], exact)

    fresh = subprocess.run(
        [
            sys.executable,
            __file__,
            "--resume",
            str(directory / name),
            "--optimizer",
            name,
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if fresh.returncode != 0:
        raise SystemExit(fresh.stdout + fresh.stderr)
    got = json.loads(fresh.stdout.strip().splitlines()[-1])
    compare("(d) fresh process, eval_shape only", got, unbroken[saved:], True)


def resume(directory: str, name: str, steps: int) -> None:
    """A fresh process: nothing but the checkpoint and jax.eval_shape."""
    tx = OPTIMIZERS[name]()
    trainer = Trainer(tx, "2x4")
    with ocp.CheckpointManager(directory) as mngr:
        saved = mngr.latest_step()
        state = trainer.restore(mngr, saved, abstract_state(tx))
    print(json.dumps(trainer.train(state, tokens(steps), saved + 1, steps)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=[*OPTIMIZERS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--dir", help="where to keep checkpoints (default: a temporary directory)")
    parser.add_argument("--resume", help=argparse.SUPPRESS)  # the fresh process of (d)
    args = parser.parse_args()
    if args.resume:
        return resume(args.resume, args.optimizer, args.steps)
    names = list(OPTIMIZERS) if args.optimizer == "both" else [args.optimizer]
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(args.dir or tmp)
        for name in names:
            run(name, args.steps, args.save_every, directory)
    print("\nevery restore went on with the unbroken run's losses")


if __name__ == "__main__":
    main()
