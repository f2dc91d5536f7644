"""equinox: modules whose weights are boxes work through spmdtree, eqx's filtered
transforms and optax; a layer is called on ``st.unbox(module)``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
RULES = [("embed", "data"), ("mlp", "model")]
NAMES = st.match(
    [
        (r"up/weight$", ("mlp", "embed")),  # eqx.nn.Linear's weight is (out, in)
        (r"up/bias$", ("mlp",)),
        (r"down/weight$", ("embed", "mlp")),
    ]
)


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def init(key):
    k1, k2 = jax.random.split(key)
    model = MLP(eqx.nn.Linear(16, 64, key=k1), eqx.nn.Linear(64, 16, key=k2))
    return st.box(model, NAMES, logical=True)


def loss(model, x):
    return jnp.mean(jax.vmap(st.unbox(model))(x) ** 2)


def test_sharded_init_and_to_sharding_of_a_boxed_module():
    model = st.sharded_init(init, MESH, RULES)(jax.random.key(0))
    assert isinstance(model, MLP) and type(model.up.weight) is st.LogicallyPartitioned
    assert model.up.weight.value.sharding.spec == P("model", "data")
    shardings = st.to_sharding(model, MESH, RULES)
    assert shardings.down.weight.spec == P("data", "model") and shardings.down.bias.spec == P()
    eager = init(jax.random.key(0))
    x = jnp.ones((4, 16))
    np.testing.assert_allclose(
        jax.vmap(st.unbox(model))(x), jax.vmap(st.unbox(eager))(x), rtol=1e-5, atol=1e-6
    )


def test_filter_jit_filter_grad_and_optax_keep_boxes_and_shardings():
    model = st.sharded_init(init, MESH, RULES)(jax.random.key(0))
    tx = optax.adam(1e-2)
    state = tx.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (8, 16))

    @eqx.filter_jit
    def step(model, state, x):
        value, grads = eqx.filter_value_and_grad(loss)(model, x)
        updates, state = tx.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value

    first = step(model, state, x)[2]
    for _ in range(3):
        model, state, value = step(model, state, x)
    assert float(value) < float(first)
    assert type(model.up.weight) is st.LogicallyPartitioned and model.up.weight.names == (
        "mlp",
        "embed",
    )
    assert model.up.weight.value.sharding.spec == P("model", "data")
    grads = eqx.filter_grad(loss)(model, x)
    assert type(grads.down.weight) is st.LogicallyPartitioned


def test_partition_and_combine_and_describe():
    model = init(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    assert eqx.combine(params, static).up.weight.names == ("mlp", "embed")
    text = st.describe(model, MESH, RULES)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()}
    assert rows["up/weight"] == ["f32[64,16]", "[16,8]", "512", "B"]
    assert "  mlp,embed -> model,data" in text.splitlines()
