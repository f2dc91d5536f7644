"""vmap, scan and sharded_init: metadata kept right through transforms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))
RULES = [("layers", None), ("embed", "data"), ("mlp", "model")]


def init_layer(key):
    return {
        "w": st.LogicallyPartitioned(jax.random.normal(key, (4, 8)), ("embed", "mlp")),
        "b": st.LogicallyPartitioned(jnp.zeros(8), ("mlp",)),
    }


def stacked(n=3):
    return st.vmap(init_layer, partition_name="layers")(jax.random.split(jax.random.key(0), n))


def test_vmap_stacked_init_names_the_new_axis():
    layers = stacked()
    assert layers["w"].names == ("layers", "embed", "mlp") and layers["w"].value.shape == (3, 4, 8)
    assert layers["b"].names == ("layers", "mlp")
    assert st.to_spec(layers, RULES, mesh=AUTO) == {
        "w": P(None, "data", "model"),
        "b": P(None, "model"),
    }


def test_vmap_inputs_lose_the_mapped_axis_and_outputs_gain_it():
    seen = {}

    def apply(layer, x):
        seen["names"] = layer["w"].names
        return {"y": st.LogicallyPartitioned(x @ st.unbox(layer)["w"], ("mlp",))}

    out = st.vmap(apply, in_axes=(0, None), partition_name="layers")(stacked(), jnp.ones(4))
    assert seen["names"] == ("embed", "mlp")
    assert out["y"].names == ("layers", "mlp") and out["y"].value.shape == (3, 8)


def test_vmap_in_and_out_axes_other_than_zero():
    swapped = {"w": st.Partitioned(jnp.zeros((4, 3)), ("model", "layers"))}
    seen = {}

    def f(t):
        seen["names"] = t["w"].names
        return t

    out = st.vmap(f, in_axes=({"w": 1},), out_axes=-1, partition_name="layers")(swapped)
    assert seen["names"] == ("model",)
    assert out["w"].names == ("model", "layers") and out["w"].value.shape == (4, 3)
    out = st.vmap(f, in_axes=1, out_axes=0, partition_name="layers")(swapped)
    assert out["w"].names == ("layers", "model") and out["w"].value.shape == (3, 4)


def test_vmap_partition_name_none_replicates_and_strips_any_name():
    out = st.vmap(init_layer)(jax.random.split(jax.random.key(0), 2))
    assert out["w"].names == (None, "embed", "mlp")
    seen = {}
    st.vmap(lambda t: seen.setdefault("n", t["w"].names) and t)(stacked())
    assert seen["n"] == ("embed", "mlp")


def test_vmap_partition_name_must_match_the_mapped_axis():
    with pytest.raises(ValueError) as info:
        st.vmap(lambda t: t, partition_name="blocks")(stacked())
    message = str(info.value)
    assert "vmap:" in message and "args" in message and "'layers', not 'blocks'" in message


def test_vmap_refuses_boxes_whose_names_lack_the_mapped_axis():
    stale = jax.vmap(init_layer)(jax.random.split(jax.random.key(0), 2))  # plain jax.vmap
    assert stale["w"].names == ("embed", "mlp")  # a plain vmap keeps working, names stale
    with pytest.raises(ValueError, match="do not include the mapped axis"):
        st.vmap(lambda t: t)(stale)
    with pytest.raises(ValueError, match=r"st\.vmap"):
        st.to_spec(stale, RULES, mesh=AUTO)


def test_vmap_keyword_arguments_and_jax_options():
    out = st.vmap(lambda *, t: t, partition_name="layers", axis_name="i")(t=stacked())
    assert out["w"].names == ("layers", "embed", "mlp")


def test_scan_hands_per_layer_boxes_and_stacks_outputs():
    layers = stacked()
    seen = []

    def block(x, layer):
        seen.append(layer["w"].names)
        p = st.unbox(layer)
        y = jnp.tanh(x @ p["w"][:, :4])
        return y, {"act": st.LogicallyPartitioned(y, ("embed",))}

    x, ys = st.scan(block, jnp.ones(4), layers, partition_name="layers")
    assert seen == [("embed", "mlp")]
    assert ys["act"].names == ("layers", "embed") and ys["act"].value.shape == (3, 4)
    ref = jnp.ones(4)
    for i in range(3):
        ref = jnp.tanh(ref @ layers["w"].value[i][:, :4])
    # atol: an output near 0 (0.049 here) is a sum of terms near 1 that cancel, so its
    # last bits relative to itself vary with the CPU's float order.
    np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-6)


def test_scan_checks_the_scanned_name_and_supports_reverse():
    with pytest.raises(ValueError, match="'layers', not 'blocks'"):
        st.scan(lambda c, x: (c, x), 0.0, stacked(), partition_name="blocks")
    layers = {"v": st.Partitioned(jnp.arange(3.0), ("layers",))}
    # A carry that remembers the order: 10*c + v is 12.0 backwards, 210.0 forwards.
    forwards, _ = st.scan(lambda c, x: (10 * c + st.unbox(x)["v"], None), 0.0, layers)
    backwards, ys = st.scan(
        lambda c, x: (10 * c + st.unbox(x)["v"], x),
        0.0,
        layers,
        partition_name="layers",
        reverse=True,
    )
    assert float(forwards) == 12.0 and float(backwards) == 210.0
    assert ys["v"].names == ("layers",) and ys["v"].value.tolist() == [0.0, 1.0, 2.0]


def test_scan_with_length_and_no_xs():
    carry, ys = st.scan(
        lambda c, _: (c + 1, st.Partitioned(c, ())), 0, length=4, partition_name="steps"
    )
    assert int(carry) == 4 and ys.names == ("steps",) and ys.value.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_sharded_init_builds_params_in_their_shardings(mesh):
    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w": st.LogicallyPartitioned(jax.random.normal(k1, (256, 512)), ("embed", "mlp")),
            "v": st.Partitioned(jax.random.normal(k2, (512, 256)), (("data", "model"), None)),
        }

    rules = [("embed", "data"), ("mlp", "model")]
    params = st.sharded_init(init, mesh, rules)(jax.random.key(0))
    assert params["w"].value.sharding.spec == P("data", "model")
    for shard in params["w"].value.addressable_shards:
        assert shard.data.shape == (128, 128)
    for shard in params["v"].value.addressable_shards:
        assert shard.data.shape == (64, 256)
    np.testing.assert_allclose(
        st.unbox(params)["w"], st.unbox(init(jax.random.key(0)))["w"], rtol=1e-6
    )

    stats = st.sharded_init(init, mesh, rules).lower(jax.random.key(0)).compile().memory_analysis()
    global_bytes = 2 * 256 * 512 * 4
    largest = 256 * 512 * 4
    assert stats.output_size_in_bytes <= 1.1 * global_bytes / 8
    # At its peak a device holds less than one full array: no unsharded copy.
    peak = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    assert peak < largest


def test_sharded_init_with_static_arguments():
    def init(key, rows, *, cols):
        return {"w": st.Partitioned(jnp.zeros((rows, cols)), ("data", "model"))}

    init_fn = st.sharded_init(init, AUTO, static_argnums=1, static_argnames="cols")
    params = init_fn(jax.random.key(0), 4, cols=8)
    assert params["w"].value.shape == (4, 8) and params["w"].value.sharding.spec == P(
        "data", "model"
    )
    assert init_fn.__name__ == "init"


def test_sharded_init_reports_bad_names_with_their_path():
    init = functools.partial(
        lambda key: {"w": st.Partitioned(jnp.zeros((4, 8)), ("data", "tensor"))}
    )
    with pytest.raises(ValueError, match=r"tree\['w'\].*'tensor'"):
        st.sharded_init(init, AUTO)(jax.random.key(0))


# --- accumulate (0.6) ------------------------------------------------------------------


def _mlp_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _mlp(batch=64, width=16, hidden=256):
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (width, hidden)) / width**0.5,
        "w2": jax.random.normal(keys[1], (hidden, 4)) / hidden**0.5,
    }
    data = {
        "x": jax.random.normal(keys[2], (batch, width)),
        "y": jax.random.normal(keys[3], (batch, 4)),
    }
    return params, data


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("count", [1, 2, 8])
def test_accumulate_equals_the_whole_batchs_value_and_gradients(kind, count):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    params, data = _mlp()
    seen = []

    def value_and_grad(p, micro):
        seen.append(jax.typeof(micro["x"]))
        return jax.value_and_grad(_mlp_loss)(p, micro)

    with jax.set_mesh(mesh):
        data = jax.device_put(data, NamedSharding(mesh, P("data")))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        whole = jax.jit(jax.value_and_grad(_mlp_loss))(params, data)
        parts = jax.jit(st.accumulate(value_and_grad, count))(params, data)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(parts), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (micro,) = set(seen)  # traced once per shape
    assert micro.shape == (64 // count, 16)
    if kind == AxisType.Explicit:  # the rows keep the batch's sharding
        assert micro.sharding.spec == P("data", None)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_accumulate_sums_gradients_laid_out_as_sharded_params_are(kind):
    """0.8: the sum starts from zeros laid out as the outputs are; 0.7's were
    replicated, which a scan refuses on Explicit axes for a gradient sharded as its
    param is."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind,) * 2)
    params, data = _mlp()
    with jax.set_mesh(mesh):
        data = jax.device_put(data, NamedSharding(mesh, P("data")))
        params["w1"] = jax.device_put(params["w1"], NamedSharding(mesh, P(None, "fsdp")))
        whole = jax.jit(jax.value_and_grad(_mlp_loss))(params, data)
        parts = jax.jit(st.accumulate(jax.value_and_grad(_mlp_loss), 4))(params, data)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(parts), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if kind == AxisType.Explicit:
        assert parts[1]["w1"].sharding.spec == P(None, "fsdp")


def test_accumulate_lowers_the_peak_of_a_step_that_holds_activations():
    params, data = _mlp(batch=512, hidden=4096)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, data))
    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    peaks = {}
    for count in (1, 4):
        step = st.accumulate(jax.value_and_grad(_mlp_loss), count)
        batch = st.Partitioned(abstract[1]["x"], ("data", None))
        labels = st.Partitioned(abstract[1]["y"], ("data", None))
        peaks[count] = st.preflight(
            lambda p, x, y, step=step: step(p, {"x": x.value, "y": y.value}),
            abstract[0],
            batch,
            labels,
            mesh=mesh,
        ).temp_bytes
    # the hidden activations (512 x 4096 f32 over 8 devices: 1 MiB) held a quarter at a time
    assert peaks[4] < peaks[1] - (512 * 4096 * 4 // 8) // 2


@pytest.mark.parametrize(
    "count, error, said",
    [
        (
            3,
            ValueError,
            r"^accumulate: 3 microbatches do not divide .* of batch\['x'\] \(shape \(64, 16\)\), batch\['y'\] \(shape \(64, 4\)\)\.",
        ),
        (0, ValueError, r"^accumulate: microbatches is 0; expected an int >= 1\."),
        ("2", TypeError, r"^accumulate: microbatches is '2'; expected an int >= 1"),
    ],
    ids=["not-divided", "zero", "a-string"],
)
def test_accumulate_mistakes(count, error, said):
    params, data = _mlp()
    with pytest.raises(error, match=said):
        st.accumulate(jax.value_and_grad(_mlp_loss), count)(params, data)


def test_accumulate_says_a_scalar_in_the_batch_cannot_be_split():
    params, data = _mlp()
    data = {**data, "scale": jnp.float32(2.0)}

    def loss(p, b):
        return _mlp_loss(p, b) * b["scale"]

    assert st.accumulate(jax.value_and_grad(loss), 1)(params, data)[0] > 0  # one: fn itself
    with pytest.raises(ValueError, match=r"^accumulate: batch\['scale'\] is a scalar: every leaf"):
        st.accumulate(jax.value_and_grad(loss), 2)(params, data)
