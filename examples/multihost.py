"""Train on a mesh that spans processes: JAX's multi-controller runtime, with spmdtree.

Every process runs this same program. It joins the others with
`jax.distributed.initialize`, builds one (data, model) mesh over all their
devices — the "data" axis across processes — builds the params sharded across
them (`st.sharded_init`), feeds each process only its part of the batch, and
trains a few optax steps. Each process holds only its own shards; the loss and
the params are the same as in one process with all the devices.

Run locally, as several processes on this machine (127.0.0.1):

    python examples/multihost.py                    # the default: --processes 2
    python examples/multihost.py --processes 2      # 2 processes x 4 CPU devices
    python examples/multihost.py --processes 1      # the same on 1 process x 8 devices

On real hosts, start one process per host with the same coordinator (the
address of process 0) and its own process id:

    python examples/multihost.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
    python examples/multihost.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

STEPS = 3
RULES = [("batch", "data"), ("embed", "data"), ("mlp", "model")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, devices: int, out: str | None, timeout: float) -> int:
    """Starts `processes` local workers and waits for them, with a deadline."""
    address = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices // processes}",
    }
    workers = []
    for i in range(processes):
        command = [sys.executable, __file__, "--coordinator", address, "--bind", address]
        command += ["--num-processes", str(processes), "--process-id", str(i)]
        command += ["--out", out] if out and i == 0 else []
        workers.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + timeout
    try:
        for worker in workers:
            worker.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"launcher: a process did not finish within {timeout:.0f} s; stopping all")
        return 124
    finally:
        for worker in workers:  # a peer that failed leaves the others waiting: stop them
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    codes = [worker.returncode for worker in workers]
    if any(codes):
        print(f"launcher: exit codes {codes}")
        return 1
    return 0


def work(args: argparse.Namespace) -> None:
    """One process: join the others, build the mesh, init sharded, train, check."""
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            coordinator_bind_address=args.bind,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import spmdtree as st

    # One row of devices per process: the "data" axis spans the processes.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(
        np.array(devices).reshape(2, -1), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    me = jax.process_index()

    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w1": st.LogicallyPartitioned(jax.random.normal(k1, (16, 64)) / 4, ("embed", "mlp")),
            "w2": st.LogicallyPartitioned(jax.random.normal(k2, (64, 16)) / 8, ("mlp", "embed")),
        }

    def loss_fn(params, x):
        p = st.unbox(params)
        h = st.with_logical_constraint(jax.nn.relu(x @ p["w1"]), ("batch", "mlp"), RULES, mesh)
        return jnp.mean((h @ p["w2"] - jnp.roll(x, 1, axis=-1)) ** 2)

    tx = optax.adam(1e-2)
    params = st.sharded_init(init, mesh, RULES)(jax.random.key(0))
    # st.shard places a host copy (the same on every process) the same way: the same
    # values (to float32 rounding: another program computes them) in the same shards.
    placed = st.shard(jax.jit(init)(jax.random.key(0)), mesh, RULES)
    assert all(
        np.allclose(a.addressable_data(0), b.addressable_data(0), rtol=1e-6, atol=1e-7)
        for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params), strict=True)
    )
    param_shardings = st.to_sharding(params, mesh, RULES)
    state_shardings = st.optimizer_sharding(tx, params, mesh, RULES)
    state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data", None))

    def train_step(params, state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    step = jax.jit(
        train_step,
        in_shardings=(param_shardings, state_shardings, batch_sharding),
        out_shardings=(param_shardings, state_shardings, replicated),
    )

    losses = []
    for i in range(STEPS):
        batch = np.asarray(jax.random.normal(jax.random.key(100 + i), (8, 16)))
        # Each process gives only its own rows; no process ever holds the whole batch.
        rows = batch.shape[0] // jax.process_count()
        local = batch[me * rows : (me + 1) * rows]
        x = jax.make_array_from_process_local_data(batch_sharding, local, batch.shape)
        params, state, loss = step(params, state, x)
        losses.append(float(loss.addressable_data(0)))

    w1 = params["w1"].value
    held = {tuple(s.index[0].indices(16)) for s in w1.addressable_shards}
    assert all(d.process_index == me for d in w1.sharding.addressable_devices)
    assert len(w1.addressable_shards) == len(jax.local_devices())
    print(f"process {me}/{jax.process_count()}: losses {[round(v, 5) for v in losses]}")
    print(f"process {me}: w1 {w1.shape} sharded {w1.sharding.spec}, holds rows {sorted(held)}")
    print(st.describe(params, mesh, RULES, rich=False).splitlines()[-1])
    gathered = multihost_utils.process_allgather(st.unbox(params), tiled=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "params": jax.tree.map(np.ndarray.tolist, gathered)}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, help="launch this many local processes")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices in all, locally")
    parser.add_argument("--timeout", type=float, default=120.0, help="launcher deadline, seconds")
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--bind", help="address the coordinator binds (default: jax's)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--out", help="process 0 writes losses and gathered params here (JSON)")
    args = parser.parse_args()
    if args.processes is None and args.coordinator is None:
        print("no --coordinator given: launching 2 local processes (--processes 2)")
        args.processes = 2
    if args.processes is not None:
        sys.exit(launch(args.processes, args.devices, args.out, args.timeout))
    work(args)


if __name__ == "__main__":
    main()
