"""Stacked layers with st.vmap + st.scan, logical names and a jitted train step.

`st.vmap(init_layer, partition_name="layers")` builds the layers stacked, their
boxes named ("layers", ...); `st.scan` runs them, handing each step the boxes of
one layer without the "layers" axis. Rules map the logical names onto a 2x4 mesh
(data x model) and the params are built sharded with `st.sharded_init`.

Run: python examples/scan_layers.py [--layers 4] [--width 64] [--steps 20]
"""

import argparse
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

RULES = [("layers", None), ("batch", "data"), ("mlp", "model"), ("embed", "data")]


def init_layer(key: jax.Array, width: int) -> dict:
    k1, k2 = jax.random.split(key)
    dense = jax.nn.initializers.lecun_normal()
    return {
        "up": st.LogicallyPartitioned(dense(k1, (width, 2 * width)), ("embed", "mlp")),
        "down": st.LogicallyPartitioned(dense(k2, (2 * width, width)), ("mlp", "embed")),
    }


def init(key: jax.Array, layers: int, width: int) -> dict:
    keys = jax.random.split(key, layers)
    return {
        "layers": st.vmap(functools.partial(init_layer, width=width), partition_name="layers")(keys)
    }


def block(x: jax.Array, layer: dict) -> tuple[jax.Array, None]:
    p = st.unbox(layer)  # one layer: names ("embed", "mlp"), no "layers" axis
    h = jax.nn.gelu(x @ p["up"])
    h = st.with_logical_constraint(h, ("batch", "mlp"))
    return x + h @ p["down"], None


def loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    out, _ = st.scan(block, x, params["layers"], partition_name="layers")
    return jnp.mean((out - y) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    count = len(jax.devices())
    model = 4 if count % 4 == 0 else 2 if count % 2 == 0 else 1  # 8 -> 2x4, 6 -> 3x2, 1 -> 1x1
    mesh = jax.make_mesh(
        (count // model, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    print(f"mesh: {dict(mesh.shape)} on {count} {jax.devices()[0].platform} device(s)")
    if args.batch % (count // model):  # whole rows per data-parallel device
        args.batch += count // model - args.batch % (count // model)
    tx = optax.adam(1e-2)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        init_fn = functools.partial(init, layers=args.layers, width=args.width)
        params = st.sharded_init(init_fn, mesh)(jax.random.key(0))
        print("stacked up-projection:", params["layers"]["up"])
        print("its spec:", st.to_spec(params, mesh=mesh)["layers"]["up"])

        param_shardings = st.to_sharding(params, mesh)
        state_shardings = st.optimizer_sharding(tx, params, mesh)
        state = jax.jit(tx.init, out_shardings=state_shardings)(params)
        data = NamedSharding(mesh, P("data", None))

        @functools.partial(
            jax.jit,
            in_shardings=(param_shardings, state_shardings, data, data),
            out_shardings=(param_shardings, state_shardings, None),
        )
        def step(params, state, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        kx, kw = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, (args.batch, args.width))
        target = jnp.tanh(x @ jax.random.normal(kw, (args.width, args.width)) / args.width**0.5)
        x, target = jax.device_put(x, data), jax.device_put(target, data)
        losses = []
        for i in range(args.steps):
            params, state, value = step(params, state, x, target)
            losses.append(float(value))
            if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
                print(f"step {i:3d}  loss {losses[-1]:.4f}")
    assert params["layers"]["up"].names == ("layers", "embed", "mlp")
    assert losses[-1] < losses[0], "the loss did not go down"
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
