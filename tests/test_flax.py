"""flax: its boxes are refused everywhere (pointing at from_flax), and from_flax
converts linen params and nnx state into spmdtree's boxes, matching flax's own specs."""

import importlib.util
import pathlib
import subprocess
import sys

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
RULES = [("batch", "data"), ("embed", "data"), ("mlp", "model"), ("layers", None)]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
            (8, 16),
        )
        back = self.param(
            "back",
            nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
            (16, 8),
        )
        return jnp.tanh(x @ kernel) @ back, None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="plain")(x)  # no partitioning: plain arrays
        stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = stack(name="layers")(x, None)
        return x


def variables():
    return Model().init(jax.random.key(0), jnp.ones((4, 8)))


def test_from_flax_converts_boxes_of_the_same_kind_with_their_names():
    converted = st.from_flax(variables())
    kernel = converted["params"]["layers"]["kernel"]
    assert type(kernel) is st.LogicallyPartitioned
    assert kernel.names == ("layers", "embed", "mlp") and kernel.value.shape == (3, 8, 16)
    assert not st.is_boxed(converted["params"]["plain"]["kernel"])
    mesh_names = {"w": nn.Partitioned(jnp.ones((2, 4)), ("data", None), mesh=MESH)}
    assert st.from_flax(mesh_names) == {
        "w": st.Partitioned(mesh_names["w"].value, ("data", None), MESH)
    }
    own_rules = {"w": nn.LogicallyPartitioned(jnp.ones(4), ("embed",), rules=(("embed", "model"),))}
    assert st.from_flax(own_rules)["w"].rules == (("embed", "model"),)


def test_converted_specs_equal_flax_logical_to_mesh():
    v = variables()
    theirs = nn.logical_to_mesh(nn.get_partition_spec(v), RULES)
    ours = st.to_spec(st.from_flax(v), RULES)
    assert ours == theirs


def test_apply_on_unboxed_converted_params_equals_flax():
    v, x = variables(), jax.random.normal(jax.random.key(1), (4, 8))
    np.testing.assert_array_equal(Model().apply(st.unbox(st.from_flax(v)), x), Model().apply(v, x))


def test_a_sharded_train_step_on_converted_params_matches_flax():
    v, x = variables(), jax.random.normal(jax.random.key(1), (4, 8))
    tx = optax.adam(1e-2)

    def step(params, state, unbox=lambda p: p):  # flax unboxes its own boxes in apply
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(Model().apply(unbox(p), x) ** 2))(
            params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    # flax's way: its own shardings from its specs and the rules.
    with nn.logical_axis_rules(RULES):
        theirs_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(v), MESH, RULES)
    theirs = jax.device_put(v, theirs_sharding)
    out_theirs = jax.jit(step)(theirs, tx.init(theirs))
    # ours: converted, sharded, the state's shardings through params=.
    ours = st.shard(st.from_flax(v), MESH, RULES)
    assert ours["params"]["layers"]["kernel"].value.sharding.spec == P(None, "data", "model")
    state = jax.jit(tx.init, out_shardings=st.optimizer_sharding(tx, ours, MESH, RULES))(ours)
    out_ours = jax.jit(lambda p, s: step(p, s, st.unbox))(ours, state)
    assert float(out_ours[2]) == pytest.approx(float(out_theirs[2]), rel=1e-6)
    for a, b in zip(
        jax.tree.leaves(st.unbox(out_ours[0])),
        jax.tree.leaves(nn.unbox(out_theirs[0])),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


REFUSERS = {
    "to_spec": lambda t: st.to_spec(t, RULES),
    "to_sharding": lambda t: st.to_sharding(t, MESH, RULES),
    "to_abstract": lambda t: st.to_abstract(t, MESH, RULES),
    "shard": lambda t: st.shard(t, MESH, RULES),
    "constrain": lambda t: st.constrain(t, MESH, RULES),
    "describe": lambda t: st.describe(t, MESH, RULES),
    "plan": lambda t: st.plan(t, MESH, RULES),
    "optimizer_sharding": lambda t: st.optimizer_sharding(optax.adam(1e-3), t, MESH, RULES),
    "unbox": st.unbox,
    "get_partition_spec": st.get_partition_spec,
    "replace_boxed": lambda t: st.replace_boxed(t, t),
    "map_boxes": lambda t: st.map_boxes(lambda b: b, t),
    "add_axis": lambda t: st.add_axis(t, 0, "layers"),
    "box": lambda t: st.box(t, lambda path, leaf: None),
    "validate_rules": lambda t: st.validate_rules(RULES, MESH, t),
    "with_logical_constraint": lambda t: st.with_logical_constraint(t, P(), RULES, MESH),
    "sharded_init": lambda t: st.sharded_init(lambda: t, MESH, RULES)(),
}


@pytest.mark.parametrize("function", list(REFUSERS))
def test_flax_boxes_are_refused_naming_the_path_and_from_flax(function):
    with pytest.raises(TypeError) as info:
        REFUSERS[function](variables())
    message = str(info.value)
    assert message.startswith(f"{function}: "), message
    assert "['params']['layers']['kernel']" in message and "flax.linen box" in message
    assert "st.from_flax(tree)" in message


def test_from_flax_leaves_flax_unimported():
    script = (
        "import sys, jax, spmdtree as st\n"
        "print(st.from_flax({'a': jax.numpy.ones(2)})['a'].shape, 'flax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(2,) False"


# --- flax.nnx ----------------------------------------------------------------------


class NnxModel(nnx.Module):
    def __init__(self, rngs, sharding_rules=None):
        meta = {} if sharding_rules is None else {"sharding_rules": sharding_rules}
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"), **meta)
        self.lin = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
        self.scale = nnx.Param(jnp.ones(16))


def nnx_model(**kwargs):
    with nnx.use_eager_sharding(False):
        return NnxModel(nnx.Rngs(0), **kwargs)


def test_nnx_state_with_mesh_axis_names_converts_like_flax_reads_it():
    model = nnx_model()
    state = nnx.state(model)
    converted = st.from_flax(state)
    kernel = converted["lin"]["kernel"]
    assert type(kernel) is st.Partitioned and kernel.names == ("embed", "mlp")
    assert not st.is_boxed(converted["scale"]) and converted["scale"].shape == (16,)
    theirs = jax.tree.map(
        lambda v: v.get_value(),
        nnx.get_partition_spec(state),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    assert st.to_spec(converted) == theirs


def test_nnx_state_with_rules_converts_to_logical_boxes():
    model = nnx_model(sharding_rules=(("embed", "data"), ("mlp", "model")))
    converted = st.from_flax(nnx.state(model))
    kernel = converted["lin"]["kernel"]
    assert type(kernel) is st.LogicallyPartitioned and kernel.rules == (
        ("embed", "data"),
        ("mlp", "model"),
    )
    assert st.to_sharding(converted, MESH)["lin"]["kernel"].spec == P("data", "model")
    with nn.logical_axis_rules([("embed", "data"), ("mlp", "model")]):  # flax's context: logical
        plain = st.from_flax(nnx.state(nnx_model()))
    assert (
        type(plain["lin"]["kernel"]) is st.LogicallyPartitioned
        and plain["lin"]["kernel"].rules is None
    )


def test_nnx_values_go_back_into_the_model_sharded():
    model = nnx_model()
    mesh = jax.make_mesh((2, 4), ("embed", "mlp"), axis_types=(AxisType.Auto,) * 2)
    sharded = st.shard(st.from_flax(nnx.state(model)), mesh)
    nnx.update(model, st.unbox(sharded))
    assert model.lin.kernel.get_value().sharding == NamedSharding(mesh, P("embed", "mlp"))


def test_nnx_state_is_refused_unconverted():
    with pytest.raises(TypeError) as info:
        st.to_sharding(nnx.state(nnx_model()), MESH)
    message = str(info.value)
    assert "tree['lin']['kernel']" in message and "flax.nnx nnx Variable" not in message
    assert "flax.nnx Variable, Param" in message and "st.from_flax" in message


# --- flax's short names: DenseGeneral and attention name a flattened kernel -----------

SHORT_RULES = [("batch", "data"), ("embed", "data"), ("kv", "model")]


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.DenseGeneral(
            (4, 2),
            kernel_init=nn.with_logical_partitioning(init, ("embed", "kv")),
            use_bias=False,
            name="proj",
        )(x).reshape(*x.shape[:-1], 8)
        return nn.MultiHeadDotProductAttention(
            num_heads=4,
            qkv_features=8,
            kernel_init=nn.with_logical_partitioning(init, ("embed", "kv")),
            out_kernel_init=nn.with_logical_partitioning(init, ("kv", "embed")),
            use_bias=False,
        )(x)


def attention_variables():
    return Attention().init(jax.random.key(0), jnp.ones((2, 4, 8)))


def test_from_flax_pads_short_names_as_flax_reads_them_and_warns_once():
    v = attention_variables()
    assert v["params"]["proj"]["kernel"].value.shape == (8, 4, 2)
    assert v["params"]["proj"]["kernel"].names == ("embed", "kv")
    with pytest.warns(UserWarning) as caught:
        converted = st.from_flax(v)
    assert len(caught) == 1
    said = str(caught[0].message)
    assert said.startswith("from_flax: 5 flax boxes had fewer names than dimensions")
    assert "['params']['MultiHeadDotProductAttention_0']['key']['kernel']" in said
    assert said.endswith(" and 2 more.")  # the first three paths, then a count
    assert converted["params"]["proj"]["kernel"].names == ("embed", "kv", None)
    out = converted["params"]["MultiHeadDotProductAttention_0"]["out"]["kernel"]
    assert out.names == ("kv", "embed", None) and out.value.shape == (4, 2, 8)


def test_short_named_flax_models_shard_and_train_as_flax_does():
    v, x = attention_variables(), jax.random.normal(jax.random.key(1), (2, 4, 8))
    with pytest.warns(UserWarning, match="fewer names than dimensions"):
        converted = st.from_flax(v)
    ours = st.to_sharding(converted, MESH, SHORT_RULES)
    theirs = nn.logical_to_mesh_sharding(nn.get_partition_spec(v), MESH, SHORT_RULES)
    flat_ours = jax.tree.leaves(ours)
    flat_theirs = jax.tree.leaves(theirs)
    assert len(flat_ours) == len(flat_theirs) == 5
    for a, b in zip(flat_ours, flat_theirs, strict=True):
        assert a.is_equivalent_to(b, 3), (a.spec, b.spec)
    tx = optax.sgd(1e-2)

    def step(params, unbox):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(Attention().apply(unbox(p), x) ** 2))(
            params
        )
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates), loss

    out_theirs = jax.jit(lambda p: step(p, lambda q: q))(jax.device_put(v, theirs))
    out_ours = jax.jit(lambda p: step(p, st.unbox))(st.shard(converted, MESH, SHORT_RULES))
    assert float(out_ours[1]) == pytest.approx(float(out_theirs[1]), rel=1e-6)
    for a, b in zip(
        jax.tree.leaves(st.unbox(out_ours[0])),
        jax.tree.leaves(nn.unbox(out_theirs[0])),
        strict=True,
    ):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_from_flax_errors_name_the_key_path():
    bad = {"params": {"w": nn.Partitioned(jnp.ones(4), ("data", "model"))}}
    with pytest.raises(ValueError, match=r"^from_flax: the box at tree\['params'\]\['w'\] has"):
        st.from_flax(bad)
    odd = {"params": {"w": nn.Partitioned(jnp.ones(4), ("data", 3))}}
    with pytest.raises(TypeError, match=r"^from_flax: the box at tree\['params'\]\['w'\] has"):
        st.from_flax(odd)


# --- a Gemma-like flax.nnx model through advise (0.6) ---------------------------------------


def nnx_gemma():
    """examples/nnx_gemma.py, imported as a module."""
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "nnx_gemma.py"
    spec = importlib.util.spec_from_file_location("nnx_gemma", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_gemma_like_nnx_model_that_splits_its_batch_over_fsdp_alone_is_told_data_repeats_work():
    g = nnx_gemma()
    layouts = st.layouts(
        8, ("data", "fsdp", "tensor"), sizes={"tensor": 1}, axis_types=AxisType.Explicit
    )
    wanted = [m for m in layouts if dict(m.shape)["data"] in (1, 2)]
    candidates = [st.Candidate(m, None, 16, length=g.LENGTH) for m in wanted]
    advice = st.advise(
        g.make_step, candidates, hardware=st.hardware("h100"), progress=False, screen="cpu"
    )
    # the oracle: the model's matmuls per token (q, k, v, out, the gated MLP, the scores
    # and their product with V over the whole length, the tied logits), forward and
    # twice backward, over 16 x 64 tokens split over 8 devices
    layer = 2 * g.WIDTH * g.HEADS * g.HEAD * 4 + 2 * g.WIDTH * g.MLP * 3
    layer += 2 * 2 * g.LENGTH * g.HEADS * g.HEAD
    split = 3 * (g.LAYERS * layer + 2 * g.WIDTH * g.VOCAB) * 16 * g.LENGTH // 8
    data = [dict(row.candidate.mesh.shape)["data"] for row in advice.rows]
    assert data == [1, 2]  # the layout that splits the work first, whatever its time
    splits, repeats = advice.rows
    assert splits.step.flops == pytest.approx(split, rel=0.01)
    assert repeats.step.flops == pytest.approx(2 * split, rel=0.01)
    (said,) = [f for f in repeats.flags if "repeat each other's work" in f]
    assert said.startswith("devices repeat each other's work along data (2):")
    assert not [f for f in splits.flags if "repeat each other's work" in f]
    for row in advice.rows:  # tokens per second at the time the rows rank by
        assert row.tokens_per_second == pytest.approx(16 * g.LENGTH / row.time.predicted_seconds)
