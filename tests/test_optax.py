"""Optax state sharding: every optimizer's boxed state shards and trains like unboxed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))
RULES = [("embed", "data"), ("mlp", "model")]
NAMES = {
    st.Partitioned: {"w": ("data", "model"), "b": ("model",), "g": ("data",)},
    st.LogicallyPartitioned: {"w": ("embed", "mlp"), "b": ("mlp",), "g": ("embed",)},
}


def raw_params():
    key = jax.random.key(0)
    return {
        "w": jax.random.normal(key, (8, 16)) / 4,
        "b": jnp.linspace(-1.0, 1.0, 16),
        "g": jnp.ones(8),
    }


def is_matrix(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw-mask": lambda: optax.adamw(1e-2, mask=is_matrix),
    "lion": lambda: optax.lion(1e-3),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "sm3": lambda: optax.sm3(1e-2),
    "chain-clip-adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "masked-fn": lambda: optax.masked(optax.adam(1e-2), is_matrix),
    "masked-tree": lambda: optax.masked(optax.adam(1e-2), {"w": True, "b": False, "g": True}),
    "multi-transform-fn": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "s": optax.sgd(0.1)},
        lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "s", p),
    ),
    "multi-transform-tree": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "s": optax.sgd(0.1)}, {"w": "a", "b": "s", "g": "a"}
    ),
    "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "multi-steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "lookahead": lambda: optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5),
    "schedule-free-adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "ema": lambda: optax.ema(0.9),
}


#: Optimizers whose state has reduced leaves (fewer dimensions than names).
REDUCED = {"adafactor", "sm3"}


def boxed(cls):
    params = raw_params()
    return {k: cls(v, NAMES[cls][k]) for k, v in params.items()}


def loss(params, x, out_sharding):
    p = st.unbox(params)
    h = jnp.matmul(x * p["g"], p["w"], out_sharding=out_sharding) + p["b"]
    return jnp.mean(jnp.tanh(h) ** 2)


def make_step(tx, lookahead, out_sharding):
    def step(params, state, x):
        fast = params.fast if lookahead else params
        grads = jax.grad(loss)(fast, x, out_sharding)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def wrap(params, lookahead):
    return optax.LookaheadParams.init_synced(params) if lookahead else params


def reference(name, x):
    """Two steps of the same optimizer on unboxed params on one device."""
    tx, lookahead = OPTIMIZERS[name](), name == "lookahead"
    params = wrap(raw_params(), lookahead)
    state = tx.init(params)
    step = jax.jit(make_step(tx, lookahead, None))
    for _ in range(2):
        params, state = step(params, state, x)
    return params


def flat(shardings):
    return jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def shardings_of(tree):
    return [leaf.sharding for leaf in jax.tree.leaves(tree)]


def batch(mesh):
    return jax.device_put(jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), NamedSharding(mesh, P()))


def train_twice(tx, params, param_shardings, state_shardings, mesh, lookahead=False):
    """Places params, inits the state sharded, runs two jitted steps (under set_mesh)."""
    out_sharding = P(None, "model") if mesh is EXPLICIT else None  # Explicit: say it
    params = jax.device_put(params, param_shardings)
    state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    step = jax.jit(
        make_step(tx, lookahead, out_sharding),
        in_shardings=(param_shardings, state_shardings, None),
        out_shardings=(param_shardings, state_shardings),
    )
    x = batch(mesh)
    new_params, new_state = step(*step(params, state, x), x)
    return (params, state), (new_params, new_state)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "cls", [st.Partitioned, st.LogicallyPartitioned], ids=["mesh-names", "logical"]
)
@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_optimizer_state_shards_and_trains(name, cls, mesh):
    tx, lookahead = OPTIMIZERS[name](), name == "lookahead"
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        params = wrap(boxed(cls), lookahead)
        param_shardings = st.to_sharding(jax.eval_shape(lambda: params), mesh)
        state = jax.eval_shape(tx.init, params)
        if name in REDUCED:  # fewer dimensions than names: resolved against the params
            with pytest.raises(ValueError, match=r"st\.optimizer_sharding"):
                st.to_sharding(state, mesh)
        state_shardings = st.to_sharding(state, mesh, params=params)
        # One train state, one set of shardings: every way of asking agrees.
        assert st.optimizer_sharding(tx, params, mesh) == state_shardings
        abstract = st.to_abstract(state, mesh, params=params)
        assert [x.sharding for x in jax.tree.leaves(abstract)] == flat(state_shardings)
        (params, state), (new_params, new_state) = train_twice(
            tx, params, param_shardings, state_shardings, mesh, lookahead
        )
    for leaf, want in zip(jax.tree.leaves(new_state), flat(state_shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)

    fast_in = params.fast if lookahead else params
    fast_out = new_params.fast if lookahead else new_params
    for key in ("w", "b", "g"):
        assert type(fast_out[key]) is cls and fast_out[key].names == fast_in[key].names
    assert fast_out["w"].value.sharding.spec == P("data", "model")
    for before, after in zip(
        shardings_of((params, state)), shardings_of((new_params, new_state)), strict=True
    ):
        assert before == after
    expected = reference(name, np.asarray(batch(mesh)))
    for got, want in zip(
        jax.tree.leaves(st.unbox(new_params)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


# --- optimizer_sharding: reduced states keep the dimensions they kept ----------------


@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"adafactor", "sm3", "lookahead"}))
def test_optimizer_sharding_equals_to_sharding_when_nothing_is_reduced(name):
    tx, params = OPTIMIZERS[name](), boxed(st.LogicallyPartitioned)
    expected = st.to_sharding(jax.eval_shape(tx.init, params), EXPLICIT, RULES)
    assert st.optimizer_sharding(tx, params, EXPLICIT, RULES) == expected


def test_optimizer_sharding_names_adafactor_statistics():
    params = {
        "w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model")),
        "square": st.Partitioned(jnp.zeros((16, 16)), ("data", "model")),
        "scale": st.Partitioned(jnp.zeros(()), ()),  # a size-1 placeholder state
    }
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    factored = st.optimizer_sharding(tx, params, AUTO)[0]
    assert factored.v_row["w"].spec == P("data") and factored.v_col["w"].spec == P("model")
    assert factored.v_row["square"].spec == P()  # row or column? ambiguous: replicated
    assert factored.v_row["scale"].spec == P()
    with pytest.raises(ValueError, match=r"tree\[0\]\.v_row\['w'\].*params="):
        st.to_sharding(jax.eval_shape(tx.init, params), AUTO)


def test_optimizer_sharding_names_sm3_accumulators_by_position():
    params = {"square": st.LogicallyPartitioned(jnp.zeros((16, 16)), ("embed", "mlp"))}
    mu = st.optimizer_sharding(optax.sm3(1e-2), params, AUTO, RULES)[0].mu["square"]
    assert type(mu) is st.LogicallyPartitioned and mu.names == ("embed", "mlp")
    assert [s.spec for s in mu.value] == [P("data"), P("model")]


def test_optimizer_sharding_matches_params_by_the_longest_path_suffix():
    params = {
        "enc": {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))},
        "dec": {"w": st.Partitioned(jnp.zeros((8, 16)), ("model", "data"))},
    }
    state = st.optimizer_sharding(optax.adafactor(1e-2, min_dim_size_to_factor=4), params, AUTO)[0]
    assert state.v_row["enc"]["w"].spec == P("data") and state.v_row["dec"]["w"].spec == P("model")


def test_optimizer_sharding_replicates_a_tie_between_params_of_different_shapes():
    # A v_row of (8,) at ['v_row']['w'] could be enc's rows (8 of (8, 16)) or dec's
    # columns (8 of (16, 8)): the paths tie on the suffix ('w',), so replicated.
    params = {
        "enc": {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))},
        "dec": {"w": st.Partitioned(jnp.zeros((16, 8)), ("data", "model"))},
    }
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    state = jax.eval_shape(tx.init, params)
    moved = {"v_row": {"w": state[0].v_row["enc"]["w"]}}  # only the suffix ('w',) is shared
    shardings = st.optimizer_sharding(
        optax.GradientTransformation(lambda p: moved, None), params, AUTO
    )
    assert shardings["v_row"]["w"].spec == P()
    # Unambiguous: a unique longest suffix picks the param.
    assert st.optimizer_sharding(tx, params, AUTO)[0].v_row["enc"]["w"].spec == P("data")
    assert st.optimizer_sharding(tx, params, AUTO)[0].v_row["dec"]["w"].spec == P("model")


@pytest.mark.parametrize("name", ["adafactor", "sm3"])
@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_optimizer_sharding_is_valid_for_init_and_step(name, mesh):
    tx = OPTIMIZERS[name]()
    with jax.set_mesh(mesh):
        params = boxed(st.Partitioned)
        param_shardings = st.to_sharding(params, mesh)
        state_shardings = st.optimizer_sharding(tx, params, mesh)
        (_, state), (new_params, new_state) = train_twice(
            tx, params, param_shardings, state_shardings, mesh
        )
    assert shardings_of(new_state) == shardings_of(state)
    if name == "adafactor":
        assert new_state[0].v_row["w"].value.sharding.spec == P("data")
    expected = reference(name, np.asarray(batch(mesh)))
    for got, want in zip(
        jax.tree.leaves(st.unbox(new_params)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape, param_shape, position, expected",
    [
        ((8,), (8, 16), None, (0,)),
        ((16,), (8, 16), None, (1,)),
        ((16,), (16, 16), None, None),
        ((16,), (16, 16), 1, (1,)),
        ((1,), (16,), None, None),
        ((4, 16), (4, 8, 16), None, (0, 2)),
        ((), (8, 16), None, ()),
    ],
    ids=["rows", "cols", "square-ambiguous", "sm3-position", "placeholder", "3d", "scalar"],
)
def test_kept_dimensions(shape, param_shape, position, expected):
    assert st.kept_dimensions(shape, param_shape, position) == expected
