"""Everyday mistakes that used to pass silently: each is now an error or a visible fallback.

Every test here reproduces a symptom seen with spmdtree 0.1.0 (a silently
replicated sharding, a misleading error, or a crash inside JAX).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))
TYPO = [("batch", "data"), ("embed", "data"), ("mlp", "modle")]


def layer(key=0):
    w = jax.random.normal(jax.random.key(key), (8, 16))
    return {"w": st.LogicallyPartitioned(w, ("embed", "mlp"))}


def stacked(n=3):
    return st.vmap(lambda k: layer(0), partition_name="layers")(jnp.arange(n))


# --- 1. a typo in a rule's mesh axis ---------------------------------------------------

TYPO_CALLS = {
    "to_sharding": lambda: st.to_sharding(layer(), AUTO, TYPO),
    "to_spec": lambda: st.to_spec(layer(), TYPO, mesh=AUTO),
    "to_abstract": lambda: st.to_abstract(layer(), AUTO, TYPO),
    "shard": lambda: st.shard(layer(), AUTO, TYPO),
    "sharded_init": lambda: st.sharded_init(lambda k: layer(), AUTO, TYPO)(jax.random.key(0)),
    "with_logical_constraint": lambda: st.with_logical_constraint(
        jnp.ones((4, 16)), ("batch", "mlp"), TYPO, AUTO
    ),
    "logical_to_mesh_sharding": lambda: st.logical_to_mesh_sharding(("batch", "mlp"), AUTO, TYPO),
    "describe": lambda: st.describe(layer(), AUTO, TYPO),
    "optimizer_sharding": lambda: st.optimizer_sharding(optax.adam(1e-3), layer(), AUTO, TYPO),
}


@pytest.mark.parametrize("function", list(TYPO_CALLS))
def test_a_typo_in_a_rule_is_an_error_that_names_the_rule(function):
    with pytest.raises(ValueError) as info:
        TYPO_CALLS[function]()
    message = str(info.value)
    assert message.startswith(f"{function}: "), message
    for fragment in ("rule 2", "('mlp', 'modle')", "'data' (size 2), 'model' (size 4)"):
        assert fragment in message, message
    assert "Did you mean 'model'?" in message


def test_a_typo_inside_jit_is_an_error_too():
    @jax.jit
    def f(x):
        return st.with_logical_constraint(x, ("batch", "mlp"), TYPO)

    with jax.set_mesh(AUTO), pytest.raises(ValueError, match="Did you mean 'model'"):
        f(jnp.ones((4, 16)))


def test_a_partitioned_name_not_in_the_mesh_suggests_the_closest_axis():
    box = {"w": st.Partitioned(jnp.zeros((4, 8)), ("data", "modle"))}
    with pytest.raises(ValueError, match=r"tree\['w'\].*Did you mean 'model'\?"):
        st.to_sharding(box, AUTO)


def test_a_rule_not_reached_is_not_checked():
    # 'embed' is served by rule 0 before rule 1 (a typo) is considered.
    rules = [("embed", "data"), ("embed", "dtaa"), ("mlp", "model")]
    assert st.to_spec(layer(), rules, mesh=AUTO) == {"w": P("data", "model")}


def test_a_rule_set_shared_across_meshes_gives_each_mesh_all_its_axes():
    rules = [("embed", "fsdp"), ("mlp", "tensor")]
    big = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    small = jax.make_mesh((8, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    assert st.to_spec(layer(), rules, mesh=big) == {"w": P("fsdp", "tensor")}
    assert st.to_spec(layer(), rules, mesh=small) == {"w": P("fsdp", "tensor")}
    assert st.to_sharding(layer(), small, rules)["w"].shard_shape((8, 16)) == (1, 16)


# --- 2. stale names inside a plain jax.lax.scan --------------------------------------


def test_stale_names_inside_a_plain_scan_are_an_error_not_replication():
    def body(h, one_layer):
        one_layer = st.constrain(one_layer, rules=[("embed", "data"), ("mlp", "model")])
        return jnp.tanh(h @ st.unbox(one_layer)["w"][:, :8]), None

    step = jax.jit(lambda p, x: jax.lax.scan(body, x, p)[0])
    with jax.set_mesh(AUTO), pytest.raises(ValueError) as info:
        step(stacked(), jnp.ones((2, 8)))
    message = str(info.value)
    assert message.startswith("constrain: the box at tree['w']"), message
    for fix in ("st.scan", "st.vmap", "st.remove_axis", "params=", "st.optimizer_sharding"):
        assert fix in message


def test_st_scan_is_the_fix_for_the_plain_scan():
    def body(h, one_layer):
        one_layer = st.constrain(one_layer, rules=[("embed", "data"), ("mlp", "model")])
        return jnp.tanh(h @ st.unbox(one_layer)["w"][:, :8]), None

    step = jax.jit(lambda p, x: st.scan(body, x, p, partition_name="layers")[0])
    with jax.set_mesh(AUTO):
        out = step(stacked(), jnp.ones((2, 8)))
    assert out.shape == (2, 8)


def test_reduced_optimizer_state_without_params_is_the_same_error():
    params = {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))}
    state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=4).init, params)
    with pytest.raises(ValueError) as info:
        st.to_sharding(state, AUTO)
    message = str(info.value)
    assert "tree[0].v_row['w']" in message and "params=" in message
    assert "st.optimizer_sharding" in message


def test_size_one_placeholders_are_still_replicated():
    params = {"scale": st.Partitioned(jnp.zeros(()), ())}
    state = jax.eval_shape(optax.adafactor(1e-3).init, params)
    assert state[0].v_row["scale"].value.shape == (1,)  # one dim more than names
    assert st.to_sharding(state, AUTO)[0].v_row["scale"].spec == P()
    full = {"b": st.Partitioned(jax.ShapeDtypeStruct((2, 8), jnp.float32), ("data", "model"))}
    squeezed = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,), x.dtype), full)
    assert st.to_spec(squeezed, mesh=AUTO) == {"b": P()}  # one dim fewer, size 1


def test_describe_flags_the_rank_mismatch_instead_of_raising():
    one = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], stacked()))
    text = st.describe(one, AUTO, [("embed", "data"), ("mlp", "model")], rich=False)
    assert "! w: replicated by a fallback: shape [8,16] under names (layers,embed,mlp)" in text


# --- 3. RAISE_ERROR without a mesh -----------------------------------------------------


def test_raise_error_fallback_raises_without_a_mesh():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="no rule maps 'heads'"):
        st.with_logical_constraint(
            x, ("batch", "heads"), [("batch", "data")], fallback=st.RulesFallback.RAISE_ERROR
        )
    with pytest.raises(ValueError, match="no rule maps 'batch'"):
        st.with_logical_constraint(x, ("batch",), fallback=st.RulesFallback.RAISE_ERROR)
    covered = st.with_logical_constraint(
        x, ("batch", None), [("batch", "data")], fallback=st.RulesFallback.RAISE_ERROR
    )
    assert covered is x  # nothing to constrain on: x unchanged


def test_without_a_mesh_a_spec_longer_than_the_array_is_still_an_error():
    with pytest.raises(ValueError, match="names 2 dimensions"):
        st.with_logical_constraint(jnp.ones(4), ("batch", "embed"), [("batch", "data")])


# --- 4. a captured constant inside jit ------------------------------------------------


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_a_captured_constant_is_constrained_like_a_traced_value(mesh):
    constant = jnp.arange(32.0).reshape(4, 8)
    rules = [("batch", "data"), ("embed", "model")]

    def f(x):
        return st.with_logical_constraint(constant, ("batch", "embed"), rules) + x

    with jax.set_mesh(mesh):
        out = jax.jit(f)(jnp.zeros((4, 8)))
        kinds = [eqn.primitive.name for eqn in jax.make_jaxpr(f)(jnp.zeros((4, 8))).eqns]
    np.testing.assert_array_equal(out, constant)
    assert {"sharding_constraint", "reshard"} & set(kinds)


def test_unrelated_errors_are_not_relabelled_as_prefix_errors():
    with pytest.raises(ValueError) as info:
        jax.jit(
            lambda x: st.with_logical_constraint(
                x, ("batch",), [("batch", "data")], jax.make_mesh((2, 4), ("data", "model"))
            )
        )(jnp.zeros(4))
    assert "prefix" not in str(info.value) and "jax.set_mesh" in str(info.value)
    with pytest.raises(ValueError, match="prefix of x"):
        st.with_logical_constraint({"a": jnp.ones(2)}, {"b": ("batch",)}, [("b", "data")], AUTO)


# --- 5 and 6. custom boxes' add_axis/remove_axis hooks --------------------------------

LOG = []


class Logged(st.Partitioned):
    """A Partitioned whose hooks record the value shape they see."""

    __slots__ = ()

    def add_axis(self, index, params):
        LOG.append(("add", tuple(self.value.shape), params[st.PARTITION_NAME]))
        return super().add_axis(index, params)

    def remove_axis(self, index, params):
        LOG.append(("remove", tuple(self.value.shape), params[st.PARTITION_NAME]))
        return super().remove_axis(index, params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Averaged(st.AxisMetadata):
    """A box that keeps the mean of its value over a stacked axis in add_axis,
    and checks in remove_axis that it sees the same, stacked level."""

    value: object
    ndim: int = dataclasses.field(metadata=dict(static=True))
    mean: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def unbox(self):
        return self.value

    def replace_boxed(self, value):
        return dataclasses.replace(self, value=value)

    def add_axis(self, index, params):
        means = tuple(np.asarray(self.value).mean(axis=index).round(3).ravel().tolist())
        return dataclasses.replace(self, ndim=self.ndim + 1, mean=means)

    def remove_axis(self, index, params):
        assert np.ndim(self.value) == self.ndim, (np.ndim(self.value), self.ndim)
        return dataclasses.replace(self, ndim=self.ndim - 1)


def test_tree_add_and_remove_axis_call_the_boxes_own_hooks():
    LOG.clear()
    tree = {"w": Logged(jnp.zeros((2, 4)), ("a", "b"))}
    added = st.add_axis(tree, 0, "layers")
    st.remove_axis(added, 0, "layers")
    assert LOG == [("add", (2, 4), "layers"), ("remove", (2, 4), "layers")]
    assert type(added["w"]) is Logged and added["w"].names == ("layers", "a", "b")


def test_vmap_calls_both_hooks_on_the_stacked_level():
    LOG.clear()
    stack = {"w": Logged(jnp.zeros((3, 4)), ("layers", "model"))}
    out = st.vmap(lambda t: jax.tree.map(lambda x: x + 1, t), partition_name="layers")(stack)
    assert LOG == [("remove", (3, 4), "layers"), ("add", (3, 4), "layers")]
    assert type(out["w"]) is Logged and out["w"].names == ("layers", "model")


def test_vmap_without_a_partition_name_passes_the_name_it_removes():
    LOG.clear()
    stack = {"w": Logged(jnp.zeros((3, 4)), ("layers", "model"))}
    st.vmap(lambda t: t)(stack)
    assert LOG[0] == ("remove", (3, 4), "layers")


def test_scan_calls_both_hooks_on_the_stacked_level():
    LOG.clear()
    stack = {"w": Logged(jnp.ones((3, 4)), ("layers", "model"))}
    _, ys = st.scan(lambda c, t: (c, t), 0.0, stack, partition_name="layers")
    assert LOG == [("remove", (3, 4), "layers"), ("add", (3, 4), "layers")]
    assert ys["w"].names == ("layers", "model")


def test_a_custom_box_that_averages_in_add_axis_works_through_vmap():
    stack = {"m": Averaged(jnp.arange(6.0).reshape(3, 2), ndim=2)}
    out = st.vmap(lambda t: jax.tree.map(lambda x: x * 2, t), partition_name="layers")(stack)
    assert out["m"].ndim == 2 and out["m"].mean == (4.0, 6.0)


# --- 7. Explicit meshes: shape-aware logical_to_mesh_axes ----------------------------


def test_logical_to_mesh_axes_is_shape_aware_with_shape_and_mesh():
    rules = [("batch", "data"), ("mlp", "model"), ("mlp", "data")]
    assert st.logical_to_mesh_axes(("batch", "mlp"), rules) == P("data", "model")
    assert st.logical_to_mesh_axes(("batch", "mlp"), rules, shape=(8, 6), mesh=AUTO) == P(
        "data", None
    )
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert st.logical_to_mesh_axes(("batch", "mlp"), rules, shape=(3, 8), mesh=abstract) == P(
        None, "model"
    )
    with pytest.raises(TypeError, match="shape= and mesh= together"):
        st.logical_to_mesh_axes(("batch",), rules, shape=(8,))
    with pytest.raises(ValueError, match="Did you mean 'model'"):
        st.logical_to_mesh_axes(("mlp",), TYPO, shape=(8,), mesh=AUTO)


def test_a_matmul_on_the_default_explicit_mesh_with_out_sharding_by_logical_names():
    rules = [("batch", "data"), ("embed", None), ("mlp", "model")]
    w = st.shard(
        {"w": st.LogicallyPartitioned(jnp.ones((16, 64)), ("embed", "mlp"))}, EXPLICIT, rules
    )
    x = jax.device_put(jnp.ones((8, 16)), jax.sharding.NamedSharding(EXPLICIT, P("data")))

    @jax.jit
    def f(p, x):
        out = st.logical_to_mesh_axes(("batch", "mlp"), rules, shape=(8, 64), mesh=EXPLICIT)
        return jnp.matmul(x, st.unbox(p)["w"], out_sharding=out)

    with jax.set_mesh(EXPLICIT):
        y = f(w, x)
    assert y.sharding.spec == P("data", "model")
    np.testing.assert_allclose(y, 16.0)


# --- jnp functions on boxes ---------------------------------------------------------


@pytest.mark.parametrize(
    "use",
    [jnp.sum, jnp.tanh, lambda b: jnp.matmul(jnp.ones(4), b), lambda b: jnp.where(True, b, 0)],
    ids=["sum", "tanh", "matmul", "where"],
)
def test_jnp_functions_on_a_box_say_to_unbox(use):
    with pytest.raises(TypeError, match=r"Partitioned is a metadata box.*st\.unbox"):
        use(st.Partitioned(jnp.ones(4), ("data",)))


def test_comparing_an_array_with_a_box_still_never_raises():
    box = st.Partitioned(jnp.ones(4), ("data",))
    assert (jnp.ones(4) == box) is False and (jnp.ones(4) != box) is True


# --- a value committed to another mesh than the one in effect -------------------------

OTHER = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def test_an_array_on_another_mesh_is_named_with_both_meshes():
    rules = [("batch", "data")]
    on_auto = jax.device_put(jnp.ones((4, 8)), jax.sharding.NamedSharding(AUTO, P("data")))
    for call in (
        lambda: st.with_logical_constraint(on_auto, ("batch", None), rules, OTHER),
        lambda: jax.jit(
            lambda x: st.with_logical_constraint(on_auto, ("batch", None), rules, OTHER) + x
        )(jnp.zeros((4, 8))),
        lambda: st.constrain({"w": st.Partitioned(on_auto, ("data", None))}, OTHER),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "laid out on the mesh Mesh('data': 2, 'model': 4" in message
        assert "not on the mesh in effect, Mesh('data': 4, 'model': 2" in message
    # On its own mesh, or not yet committed to any: constrained as usual.
    assert st.with_logical_constraint(on_auto, ("batch", None), rules, AUTO).sharding.spec == P(
        "data", None
    )
    placed = st.with_logical_constraint(jnp.ones((4, 8)), ("batch", None), rules, OTHER)
    assert placed.sharding.mesh == OTHER


# --- names that no rule mentions (new in 0.2) -----------------------------------------

AUTO_MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _heads_tree():
    return {
        "w": st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((8, 16), jnp.float32), ("embed", "heads")
        ),
        "b": st.LogicallyPartitioned(jax.ShapeDtypeStruct((16,), jnp.float32), ("heads",)),
    }


def test_a_name_no_rule_mentions_is_unsharded_flagged_and_listed_once():
    rules = [("embed", "data")]
    planned = st.plan(_heads_tree(), AUTO_MESH, rules)
    rows = {row.path: row for row in planned.rows}
    assert rows["w"].spec == P("data", None)
    assert "no rule mentions 'heads': left unsharded" in rows["w"].flags
    assert "no rule mentions 'heads': left unsharded" in rows["b"].flags
    assert rows["w"].why[1] == "dimension 1 (heads, size 16): no rule mentions it, so unsharded"
    text = st.describe(_heads_tree(), AUTO_MESH, rules)
    listed = [line for line in text.splitlines() if "names no rule mentions" in line]
    assert listed == [
        "! names no rule mentions, left unsharded: 'heads'. Add (name, None) to the rules"
    ]
    assert st.to_spec(_heads_tree(), rules, mesh=AUTO_MESH)["w"] == P("data", None)
    with pytest.raises(
        ValueError, match=r"(?s)to_sharding: 2 leaves are wrong:.*no rule mentions 'heads'"
    ):
        st.to_sharding(_heads_tree(), AUTO_MESH, rules, strict=True)


def test_a_rule_to_none_says_replicated_on_purpose_and_silences_all_of_it():
    rules = [("embed", "data"), ("heads", None)]
    planned = st.plan(_heads_tree(), AUTO_MESH, rules)
    assert all(not row.flags for row in planned.rows)
    assert "no rule mentions" not in st.describe(_heads_tree(), AUTO_MESH, rules)
    shardings = st.to_sharding(_heads_tree(), AUTO_MESH, rules, strict=True)
    assert shardings["w"].spec == P("data", None)
    assert st.validate_rules(rules, AUTO_MESH, _heads_tree()) == []


def test_logical_to_mesh_axes_keeps_flax_meaning_for_a_name_no_rule_mentions():
    rules = [("batch", "data"), ("heads", "model")]
    assert st.logical_to_mesh_axes(("batch", "length", "heads"), rules) == P("data", None, "model")
    assert st.logical_to_mesh_axes(("batch", "length"), ()) == P(None, None)
    assert st.logical_to_mesh(("data", "model"), rules) == P(None, None)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_constraints_in_jit_refuse_what_cannot_mean_replicated(kind):
    mesh = AUTO_MESH if kind == "auto" else jax.make_mesh((2, 4), ("data", "model"))
    x = jnp.ones((4, 8))

    def run(spec, rules):
        with jax.set_mesh(mesh):
            return jax.jit(lambda x: st.with_logical_constraint(x, spec, rules))(x)

    with pytest.raises(ValueError, match="no rules are in effect"):
        run(("batch", None), None)
    with pytest.raises(ValueError, match="'model', which no rule mentions, is a mesh axis"):
        run(("batch", "model"), [("batch", "data")])
    with pytest.raises(ValueError, match="Did you mean 'embed'"):
        run(("batch", "embde"), [("batch", "data"), ("embed", "model")])
    out = run(("batch", "length"), [("batch", "data"), ("embed", "model")])  # flax: unsharded
    assert out.sharding.spec in (P("data"), P("data", None))
    # Without a mesh, single-device code runs as is, rules or not.
    assert st.with_logical_constraint(x, ("batch", None)) is x


def test_validate_rules_reports_rules_never_reached():
    tree = {"w": _heads_tree()["w"]}
    rules = [("embed", "data"), ("heads", "data"), ("embed", "model"), ("heads", "model")]
    problems = st.validate_rules(rules, AUTO_MESH, tree)
    assert problems == [
        "rule 1 ('heads', 'data') is never reached: wherever 'heads' appears, its mesh "
        "axes already shard 'embed'. Reorder the rules, or drop it.",
        "rule 2 ('embed', 'model') is never reached: wherever 'embed' appears, rule 0 "
        "takes its dimension. Reorder the rules, or drop it.",
    ]


# --- rank mismatches in which only some dimensions have size 1 ----------------------------
# A value whose every dimension has size 1 is a placeholder (replicated); one with a
# size-1 dimension among others is not (e.g. a param stacked over a single layer, seen
# with stale names inside a plain jax.vmap or jax.lax.scan).


@pytest.mark.parametrize(
    "shape, names",
    [
        ((1, 64), ("layers", "embed", "mlp")),  # fewer dims, the first of size 1
        ((64, 1), ("layers", "embed", "mlp")),  # fewer dims, the last of size 1
        ((1, 1, 8), ("layers", "embed", "mlp", "heads")),
        ((1, 64, 256), ("embed", "mlp")),  # more dims: stacked over one layer, unnamed
        ((64, 1, 1), ("embed",)),
    ],
    ids=str,
)
def test_a_rank_mismatch_with_some_size_1_dimensions_is_no_placeholder(shape, names):
    box = st.LogicallyPartitioned(jnp.zeros((2,) * len(names)), names)
    stale = {"w": box.replace_boxed(jnp.zeros(shape))}  # as jax rebuilds it, unvalidated
    rules = [("layers", None), ("embed", "data"), ("mlp", "model"), ("heads", None)]
    with pytest.raises(ValueError, match=r"tree\['w'\].*(fewer|more) dimensions"):
        st.to_sharding(stale, AUTO, rules)
    if len(shape) < len(names):
        (row,) = st.plan(stale, AUTO, rules).rows
        assert row.flags and row.flags[0].startswith("replicated by a fallback")
        assert "placeholder" not in " ".join(row.why)


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1), (1, 1, 1, 1)])
def test_a_value_of_only_size_1_dimensions_is_still_a_placeholder(shape):
    box = st.Partitioned(jnp.zeros((2, 4)), ("data", "model")).replace_boxed(jnp.zeros(shape))
    assert st.to_sharding({"w": box}, AUTO)["w"].spec == P()
    assert "size-1 placeholder" in st.plan({"w": box}, AUTO).rows[0].why[0]


def test_stale_names_after_a_plain_vmap_over_a_single_layer_are_an_error():
    stacked = {"w": st.LogicallyPartitioned(jnp.ones((1, 8, 4)), ("layers", "embed", "mlp"))}
    rules = [("embed", "data"), ("mlp", "model")]

    def layer(p):
        return st.to_sharding(p, AUTO, rules)  # p's value is (8, 4), its names 3

    with pytest.raises(ValueError, match=r"st\.scan or st\.vmap"):
        jax.vmap(layer)(stacked)


# --- boxes whose value holds boxes ------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Around(st.AxisMetadata):
    """A user's own box around a subtree that holds spmdtree boxes."""

    value: object

    def unbox(self):
        return self.value

    def replace_boxed(self, value):
        return dataclasses.replace(self, value=value)

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self


def _boxes_in_boxes():
    inner = {
        "w": st.Partitioned(jnp.zeros((2, 4)), ("data", "model")),
        "b": st.LogicallyPartitioned(jnp.zeros(4), ("mlp",), rules=[("mlp", "model")]),
    }
    return {"around": _Around(inner), "ours": st.Partitioned({"x": inner["w"]}, ("data", None))}


def test_replace_boxed_fills_every_box_of_a_box_that_holds_boxes():
    tree = _boxes_in_boxes()
    new = st.replace_boxed(tree, jax.tree.map(lambda x: x + 1, st.unbox(tree)))
    assert jax.tree.structure(new, is_leaf=lambda x: x is None) == jax.tree.structure(tree)
    assert all(float(x.min()) == 1.0 for x in jax.tree.leaves(st.unbox(new)))
    assert new["around"].value["w"].names == ("data", "model")
    assert new["ours"].value["x"].value.shape == (2, 4)
    back = st.replace_boxed(tree, st.unbox(tree))
    assert jax.tree.leaves(st.unbox(back)) == jax.tree.leaves(st.unbox(tree))
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_boxes_inside_a_users_box_resolve_by_their_own_names():
    shardings = st.to_sharding(_boxes_in_boxes(), AUTO)
    assert shardings["around"].value["w"].spec == P("data", "model")
    assert shardings["around"].value["b"].spec == P("model")


def test_unbox_reaches_the_boxes_inside_boxes_and_map_boxes_the_outermost():
    tree = _boxes_in_boxes()
    unboxed = st.unbox(tree)
    assert not any(st.is_boxed(x) for x in jax.tree.leaves(unboxed, is_leaf=st.is_boxed))
    assert [x.shape for x in jax.tree.leaves(unboxed)] == [(4,), (2, 4), (2, 4)]
    seen = []
    st.map_boxes(lambda b: seen.append(type(b).__name__) or b, tree)
    assert seen == ["_Around", "Partitioned"]


# --- jax.jit's negative argnums in sharded_init -----------------------------------------------


def _init(key, scale, n):
    return {"w": st.Partitioned(scale * jax.random.normal(key, (n, 8)), ("data", "model"))}


@pytest.mark.parametrize("static", [-1, (-1,), 2, (2,), (-1, 2)], ids=str)
def test_sharded_init_takes_negative_static_argnums_as_jax_jit_does(static):
    out = st.sharded_init(_init, AUTO, static_argnums=static)(jax.random.key(0), 0.5, 4)
    assert out["w"].value.shape == (4, 8) and out["w"].value.sharding.spec == P("data", "model")


@pytest.mark.parametrize("static", [-2, 1])
def test_sharded_init_with_the_wrong_static_argument_traces_the_shape(static):
    # -2 and 1 name `scale`: `n`, traced, cannot be a shape. jax says so, not a wrong result.
    with pytest.raises(Exception, match=r"(?i)concrete|shape|tracer"):
        st.sharded_init(_init, AUTO, static_argnums=static)(jax.random.key(0), 0.5, 4)


@pytest.mark.parametrize("static", [3, -4])
def test_sharded_init_refuses_static_argnums_out_of_range(static):
    with pytest.raises(ValueError, match=rf"sharded_init: static_argnums holds {static}"):
        st.sharded_init(_init, AUTO, static_argnums=static)(jax.random.key(0), 0.5, 4)
