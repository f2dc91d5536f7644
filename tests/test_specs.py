"""Specs and shardings: get_partition_spec, to_spec, to_sharding, get_sharding, to_abstract."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as hst
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))
AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
MESHES = pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])


def model():
    return {
        "dense": {
            "kernel": st.Partitioned(jnp.ones((4, 8)), ("data", "model")),
            "bias": st.Partitioned(jnp.zeros(8), ("model",)),
        },
        "norm": st.LogicallyPartitioned(jnp.ones(8), ("embed",)),
        "step": jnp.zeros((), jnp.int32),
    }


def test_get_partition_spec_is_names_as_written():
    specs = st.get_partition_spec(model())
    assert specs == {
        "dense": {"kernel": P("data", "model"), "bias": P("model")},
        "norm": P("embed"),  # logical names are not resolved
        "step": P(),
    }


def test_get_partition_spec_equals_flax_on_flax_shaped_trees():
    ours = {"w": st.Partitioned(jnp.ones((4, 8)), ("data", None)), "b": jnp.ones(3), "n": None}
    theirs = {"w": nn.Partitioned(jnp.ones((4, 8)), ("data", None)), "b": jnp.ones(3), "n": None}
    assert st.get_partition_spec(ours) == nn.get_partition_spec(theirs)


@pytest.mark.parametrize(
    "fn",
    [
        st.get_partition_spec,
        st.to_spec,
        lambda t: st.to_spec(t, mesh=AUTO),
        lambda t: st.to_sharding(t, AUTO),
        lambda t: st.to_abstract(t, EXPLICIT),
    ],
    ids=["get_partition_spec", "to_spec", "to_spec-mesh", "to_sharding", "to_abstract"],
)
def test_placeholders_pass_through(fn):
    masked = st.Partitioned(optax.MaskedNode(), ("data", "model"))
    tree = {"none": None, "masked": optax.MaskedNode(), "empty": optax.EmptyState(), "box": masked}
    out = fn(tree)
    assert out == tree  # a box holding no array comes back unchanged, still boxed


def test_to_spec_resolves_logical_boxes_with_rules_precedence():
    tree = {
        "own": st.LogicallyPartitioned(jnp.ones(8), ("embed",), rules=[("embed", "own")]),
        "call": st.LogicallyPartitioned(jnp.ones(8), ("embed",)),
    }
    with st.logical_axis_rules([("embed", "context")]):
        assert st.to_spec(tree, [("embed", "argument")]) == {"own": P("own"), "call": P("argument")}
        assert st.to_spec(tree) == {"own": P("own"), "call": P("context")}


OWN = {
    "w": st.LogicallyPartitioned(
        jnp.ones((4, 8)), ("a", "b"), rules=[("a", "data"), ("b", "model")]
    )
}


@pytest.mark.parametrize(
    "spec_of",
    [
        lambda t: st.to_spec(t, mesh=AUTO)["w"],
        lambda t: st.to_sharding(t, AUTO)["w"].spec,
        lambda t: st.get_sharding(t, AUTO)["w"].spec,
        lambda t: st.to_abstract(t, AUTO)["w"].value.sharding.spec,
        lambda t: st.shard(t, AUTO)["w"].value.sharding.spec,
        lambda t: jax.jit(lambda p: st.constrain(p, AUTO))(t)["w"].value.sharding.spec,
        lambda t: t["w"].get_sharding(AUTO).spec,
        lambda t: P(*st.describe(t, AUTO, rich=False).splitlines()[3].split("-> ")[1].split(",")),
    ],
    ids=[
        "to_spec",
        "to_sharding",
        "get_sharding",
        "to_abstract",
        "shard",
        "constrain",
        "box.get_sharding",
        "describe",
    ],
)
def test_a_box_own_rules_win_in_every_function(spec_of):
    with st.logical_axis_rules([("a", "model"), ("b", None)]):  # context rules lose
        assert spec_of(OWN) == P("data", "model")
    assert spec_of(OWN) == P("data", "model")


def test_to_spec_without_mesh_keeps_names():
    assert st.to_spec(model(), [("embed", "model")])["dense"]["kernel"] == P("data", "model")


def test_to_spec_unknown_mesh_axis_lists_the_mesh_axes():
    tree = {"w": st.Partitioned(jnp.ones((4, 8)), ("data", "tensor"))}
    with pytest.raises(ValueError) as info:
        st.to_spec(tree, mesh=AUTO)
    message = str(info.value)
    assert "tree['w']" in message and "'tensor'" in message
    assert "'data' (size 2), 'model' (size 4)" in message


def test_to_spec_mesh_axis_used_twice():
    tree = {"w": st.Partitioned(jnp.ones((4, 8)), ("data", ("model", "data")))}
    with pytest.raises(ValueError, match=r"tree\['w'\].*mesh axis 'data' twice"):
        st.to_spec(tree)


def test_to_spec_indivisible_dimension_is_left_unsharded_or_strict_error():
    tree = {"w": st.Partitioned(jnp.ones((4, 6)), ("data", "model"))}  # 4 does not divide 6
    assert st.to_spec(tree, mesh=AUTO) == {"w": P("data", None)}
    with pytest.raises(ValueError) as info:
        st.to_spec(tree, mesh=AUTO, strict=True)
    message = str(info.value)
    assert "tree['w']" in message and "dimension 1" in message and "size 6" in message


def test_to_spec_logical_falls_through_to_the_next_rule_that_divides():
    rules = [("vocab", "model"), ("vocab", "data"), ("embed", "model")]
    tree = {"emb": st.LogicallyPartitioned(jnp.ones((6, 8)), ("vocab", "embed"))}
    assert st.to_spec(tree, rules, mesh=AUTO) == {"emb": P("data", "model")}
    assert st.to_spec(tree, rules, mesh=AUTO, strict=True) == {"emb": P("data", "model")}


def test_to_spec_logical_rule_for_another_mesh_is_an_error():
    rules = [("embed", "fsdp"), ("embed", "data")]
    tree = {"w": st.LogicallyPartitioned(jnp.ones((4,)), ("embed",))}
    for strict in (False, True):
        with pytest.raises(ValueError, match="'fsdp', which is not in the mesh"):
            st.to_spec(tree, rules, mesh=AUTO, strict=strict)
    assert st.to_spec(tree, rules[1:], mesh=AUTO) == {"w": P("data")}


def test_to_spec_more_dims_than_names_suggests_add_axis():
    box = st.Partitioned(jnp.ones(4), ("model",))
    stacked = jax.vmap(lambda _: box)(jnp.arange(3))  # a plain vmap: names are stale
    with pytest.raises(ValueError) as info:
        st.to_spec({"w": stacked}, mesh=AUTO)
    message = str(info.value)
    assert "tree['w']" in message and "add_axis" in message and "st.vmap" in message


def test_to_spec_fewer_dims_than_names_is_an_error_naming_both_causes():
    reduced = jax.tree.map(
        lambda x: x.sum(0), {"w": st.Partitioned(jnp.ones((4, 8)), ("data", "model"))}
    )
    for strict in (False, True):
        with pytest.raises(ValueError, match=r"tree\['w'\].*fewer dimensions") as info:
            st.to_spec(reduced, mesh=AUTO, strict=strict)
        assert "st.scan" in str(info.value) and "params=" in str(info.value)


def test_to_spec_keeps_unconstrained_and_to_sharding_drops_it():
    tree = {"w": st.Partitioned(jnp.ones((4, 8)), (P.UNCONSTRAINED, "model"))}
    assert st.to_spec(tree, mesh=AUTO) == {"w": P(P.UNCONSTRAINED, "model")}
    for mesh in (AUTO, EXPLICIT):
        assert st.to_sharding(tree, mesh)["w"].spec == P(None, "model")


def test_to_spec_uses_the_mesh_set_with_set_mesh():
    tree = {"w": st.Partitioned(jnp.ones((4, 6)), ("data", "model"))}
    assert st.to_spec(tree) == {"w": P("data", "model")}
    with jax.set_mesh(EXPLICIT):
        assert st.to_spec(tree) == {"w": P("data", None)}


def test_box_mesh_must_match_the_call_mesh():
    other = jax.make_mesh((4, 2), ("data", "model"))
    tree = {"w": st.Partitioned(jnp.ones((4, 8)), ("data", "model"), mesh=other)}
    with pytest.raises(ValueError, match=r"tree\['w'\].*own mesh"):
        st.to_sharding(tree, AUTO)
    same = {"w": st.Partitioned(jnp.ones((4, 8)), ("data", "model"), mesh=AUTO)}
    assert st.to_sharding(same, AUTO)["w"].spec == P("data", "model")


def test_boxes_with_different_meshes_in_one_call():
    other = jax.make_mesh((4, 2), ("data", "model"))
    tree = {
        "a": st.Partitioned(jnp.ones((4, 8)), ("data", "model"), mesh=AUTO),
        "b": st.Partitioned(jnp.ones((4, 8)), ("data", "model"), mesh=other),
    }
    with pytest.raises(ValueError, match=r"tree\['b'\].*own mesh"):
        st.to_spec(tree)
    # A box's own mesh is used when the call has none: 4 divides 8 on AUTO's 'model'.
    assert st.to_spec({"a": tree["a"]}) == {"a": P("data", "model")}


def test_a_box_holding_a_subtree_keeps_the_box():
    vectors = st.Partitioned([jnp.ones((2, 4)), jnp.ones((4, 6))], ("data", "model"))
    specs = st.to_spec({"v": vectors}, mesh=AUTO)
    assert type(specs["v"]) is st.Partitioned
    assert specs["v"].value == [P("data", "model"), P("data", None)]
    shardings = st.to_sharding({"v": vectors}, AUTO)
    assert jax.tree.structure(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)) == (
        jax.tree.structure({"v": st.Partitioned([0, 0], ("data", "model"))})
    )


def test_unboxed_arrays_are_replicated_and_non_arrays_are_none():
    assert st.to_spec({"a": jnp.ones(3), "s": "text", "f": 1.0}) == {"a": P(), "s": None, "f": P()}


@MESHES
def test_to_sharding_is_valid_for_jit_and_device_put(mesh):
    tree = model()
    abstract = jax.eval_shape(lambda: tree)
    shardings = st.to_sharding(abstract, mesh, [("embed", "model")])
    placed = jax.device_put(tree, shardings)
    step = jax.jit(
        lambda t: jax.tree.map(lambda x: x + 1, t),
        in_shardings=(shardings,),
        out_shardings=shardings,
    )
    out = step(placed)
    assert out["dense"]["kernel"].value.sharding.spec == P("data", "model")
    assert out["norm"].value.sharding.spec == P("model")
    assert out["step"].sharding.spec == P()
    assert type(out["norm"]) is st.LogicallyPartitioned


def test_get_sharding_is_to_sharding_with_context_rules():
    with st.logical_axis_rules([("embed", "model")]):
        assert st.get_sharding(model(), AUTO) == st.to_sharding(model(), AUTO)
        assert st.get_sharding(model(), AUTO)["norm"].spec == P("model")


@MESHES
def test_to_abstract_is_a_sharded_restore_target(mesh):
    abstract = st.to_abstract(model(), mesh, [("embed", "model")])
    kernel = abstract["dense"]["kernel"]
    assert type(kernel) is st.Partitioned and isinstance(kernel.value, jax.ShapeDtypeStruct)
    assert kernel.value.sharding.spec == P("data", "model") and kernel.value.shape == (4, 8)
    lowered = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t)).lower(abstract)
    assert lowered.compile() is not None


def test_to_abstract_of_an_abstract_tree():
    abstract = jax.eval_shape(model)
    out = st.to_abstract(abstract, AUTO, [("embed", "model")])
    assert out["norm"].value.sharding.spec == P("model")


def test_jit_of_to_spec_equals_to_spec():
    rules = [("embed", "model")]
    eager = st.to_spec(model(), rules, mesh=AUTO)
    seen = {}

    @jax.jit
    def f(t):
        seen["specs"] = st.to_spec(t, rules, mesh=AUTO)
        return t

    f(model())
    assert seen["specs"] == eager


# --- invariants over random names, shapes and meshes ---------------------------------

MESH_SHAPES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((2, 2, 2), ("x", "y", "z"))]


@hst.composite
def mesh_and_names(draw):
    sizes, axes = draw(hst.sampled_from(MESH_SHAPES))
    entry = hst.one_of(
        hst.none(),
        hst.sampled_from(axes),
        hst.lists(hst.sampled_from(axes), min_size=1, max_size=2, unique=True).map(tuple),
    )
    ndim = draw(hst.integers(0, 3))
    names = tuple(draw(entry) for _ in range(ndim))
    shape = tuple(draw(hst.sampled_from([1, 2, 3, 4, 6, 8])) for _ in range(ndim))
    return jax.make_mesh(sizes, axes, axis_types=(AxisType.Auto,) * len(axes)), names, shape


@given(mesh_and_names())
def test_every_spec_fits_its_array(case):
    mesh, names, shape = case
    tree = {"w": st.Partitioned(np.zeros(shape, np.float32), names)}
    axes_used = [
        a for entry in names for a in ((entry,) if isinstance(entry, str) else entry or ())
    ]
    if len(axes_used) != len(set(axes_used)):
        with pytest.raises(ValueError, match="twice"):
            st.to_spec(tree, mesh=mesh)
        return
    spec = st.to_spec(tree, mesh=mesh)["w"]
    assert len(spec) <= len(shape)
    flat = [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())]
    assert len(flat) == len(set(flat))
    for dim, entry in zip(shape, spec, strict=False):
        parts = (entry,) if isinstance(entry, str) else entry or ()
        assert dim % math.prod(mesh.shape[a] for a in parts) == 0
    placed = jax.device_put(tree, st.to_sharding(tree, mesh))
    assert placed["w"].value.sharding.spec == spec


# --- params=: reduced states resolved through the params they came from ----------------

ADAFACTOR = optax.adafactor(1e-3, min_dim_size_to_factor=4)


def boxed_params():
    return {
        "enc": {"w": st.LogicallyPartitioned(jnp.zeros((8, 16)), ("embed", "mlp"))},
        "dec": {"w": st.LogicallyPartitioned(jnp.zeros((16, 8)), ("mlp", "embed"))},
        "square": st.LogicallyPartitioned(jnp.zeros((16, 16)), ("embed", "mlp")),
    }


def test_params_resolve_reduced_states_to_the_dimensions_they_kept():
    rules = [("embed", "data"), ("mlp", "model")]
    params = boxed_params()
    state = jax.eval_shape(ADAFACTOR.init, params)[0]
    specs = st.to_spec(state, rules, mesh=AUTO, params=params)
    # v_row keeps the rows, v_col the columns, each with its names' mesh axes.
    assert specs.v_row["enc"]["w"] == P("data") and specs.v_col["enc"]["w"] == P("model")
    # adafactor reduces (16, 8) to rows of 8 (its 'embed') and columns of 16 ('mlp').
    assert specs.v_row["dec"]["w"] == P("data") and specs.v_col["dec"]["w"] == P("model")
    assert specs.v_row["square"] == P()  # rows or columns? ambiguous: replicated
    with pytest.raises(ValueError, match=r"tree\.v_row\['square'\].*ambiguous"):
        st.to_spec(state, rules, mesh=AUTO, params=params, strict=True)


def test_params_work_on_a_tree_holding_params_and_state():
    rules = [("embed", "data"), ("mlp", "model")]
    params = boxed_params()
    train_state = {"params": params, "opt": jax.eval_shape(ADAFACTOR.init, params)}
    shardings = st.to_sharding(train_state, AUTO, rules, params=params)
    assert shardings["params"]["enc"]["w"].spec == P("data", "model")
    assert shardings["opt"][0].v_row["enc"]["w"].spec == P("data")
    abstract = st.to_abstract(train_state, AUTO, rules, params=params)
    assert (
        abstract["opt"][0].v_col["dec"]["w"].value.sharding == shardings["opt"][0].v_col["dec"]["w"]
    )


def test_params_of_another_model_are_an_error_naming_the_leaf():
    rules = [("embed", "data"), ("mlp", "model")]
    state = jax.eval_shape(ADAFACTOR.init, boxed_params())
    other = {"w": st.LogicallyPartitioned(jnp.zeros((8, 16)), ("vocab", "embed"))}
    with pytest.raises(ValueError) as info:
        st.to_sharding(state, AUTO, rules, params=other)
    message = str(info.value)
    assert message.startswith("to_sharding: ") and "tree[0].v_row['enc']['w']" in message
    assert "no box in params= has these names" in message


def test_params_without_boxes_are_an_error():
    state = jax.eval_shape(ADAFACTOR.init, boxed_params())
    with pytest.raises(ValueError, match=r"to_spec: the params hold no boxes.*st\.unbox"):
        st.to_spec(state, mesh=AUTO, params=st.unbox(boxed_params()))


def test_params_match_by_the_longest_key_path_suffix_with_the_same_names():
    # Both params end in 'w' with the same names but different shapes; the state
    # leaf's path ('dec', 'w') picks dec. A leaf under 'w' alone would tie.
    params = {
        "enc": {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))},
        "dec": {"w": st.Partitioned(jnp.zeros((16, 8)), ("data", "model"))},
    }
    row = jax.ShapeDtypeStruct((8,), jnp.float32)
    reduced = jax.tree.map(lambda _: row, params["dec"]["w"])  # names kept, one dim
    assert st.to_spec({"dec": {"w": reduced}}, mesh=AUTO, params=params) == {
        "dec": {"w": P("model")}
    }
    assert st.to_spec({"w": reduced}, mesh=AUTO, params=params) == {"w": P()}  # a tie


def test_mesh_axis_and_logical_boxes_with_the_same_names_resolve_apart():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {
        "by_mesh_axes": st.Partitioned(jnp.zeros((4, 8)), ("data", None)),
        "by_logical_names": st.LogicallyPartitioned(jnp.zeros((4, 8)), ("data", None)),
    }
    specs = st.to_spec(tree, [("data", "model")], mesh=mesh)
    assert specs == {"by_mesh_axes": P("data", None), "by_logical_names": P("model", None)}
