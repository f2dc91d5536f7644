"""A two-layer MLP sharded on a (data, model) mesh of the devices there are, with no module system.

The params are initialised with `st.with_partitioning`; `jax.eval_shape` gives
their boxes without allocating anything, `st.get_partition_spec` and
`st.to_sharding` turn the boxes into specs and shardings, and `jax.jit` builds
the params directly in those shardings and applies the MLP. The sharded result
is checked against the same computation on one device.

Run: python examples/seed_mlp.py [--batch 16] [--hidden 64]
"""

import argparse
import functools
import os

# 8 CPU devices, before JAX starts its backend (a no-op on a machine that has them).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

lecun = jax.nn.initializers.lecun_normal()


def init(key: jax.Array, features: int, hidden: int) -> dict:
    """Boxed params: kernels named by the mesh axes they are sharded over."""
    k1, k2 = jax.random.split(key)
    return {
        "hidden": {
            "kernel": st.with_partitioning(lecun, ("data", "model"))(k1, (features, hidden)),
            "bias": st.with_partitioning(jax.nn.initializers.zeros, ("model",))(k1, (hidden,)),
        },
        "out": {
            "kernel": st.with_partitioning(lecun, ("model", "data"))(k2, (hidden, features)),
            "bias": st.with_partitioning(jax.nn.initializers.zeros, (None,))(k2, (features,)),
        },
    }


def apply(params: dict, x: jax.Array) -> jax.Array:
    p = st.unbox(params)
    h = jax.nn.relu(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    count = len(jax.devices())
    model = 4 if count % 4 == 0 else 2 if count % 2 == 0 else 1  # 8 -> 2x4, 6 -> 3x2, 1 -> 1x1
    mesh = jax.make_mesh(
        (count // model, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    print(f"mesh: {dict(mesh.shape)} on {count} {jax.devices()[0].platform} device(s)")
    if args.batch % (count // model):  # whole rows per data-parallel device
        args.batch += count // model - args.batch % (count // model)
    key, x_key = jax.random.split(jax.random.key(0))

    init_fn = functools.partial(init, features=args.features, hidden=args.hidden)
    abstract = jax.eval_shape(init_fn, key)
    print("partition specs:", st.get_partition_spec(abstract))
    shardings = st.to_sharding(abstract, mesh)

    params = jax.jit(init_fn, out_shardings=shardings)(key)
    kernel = params["hidden"]["kernel"].value
    print(
        "hidden kernel:",
        kernel.shape,
        "sharded",
        kernel.sharding.spec,
        "one shard",
        kernel.addressable_shards[0].data.shape,
    )

    x_sharding = NamedSharding(mesh, P("data", None))
    x = jax.device_put(jax.random.normal(x_key, (args.batch, args.features)), x_sharding)
    y = jax.jit(apply, in_shardings=(shardings, x_sharding), out_shardings=x_sharding)(params, x)

    expected = apply(init_fn(key), np.asarray(x))
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)
    print("output:", y.shape, "sharded", y.sharding.spec, "- matches the unsharded result")


if __name__ == "__main__":
    main()
