"""with_logical_constraint, constrain and shard on Auto, Explicit and Manual axes."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

U = P.UNCONSTRAINED
AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))
MIXED = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
RULES = [("batch", "data"), ("embed", "model"), ("mlp", "model")]


def primitives(fn, *args):
    return [eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns]


def constrained(x, spec=("batch", "embed"), **kwargs):
    return st.with_logical_constraint(2 * x, spec, RULES, **kwargs)


def test_auto_mesh_inside_jit_with_mesh_argument():
    out = jax.jit(partial(constrained, mesh=AUTO))(jnp.ones((4, 8)))
    assert out.sharding.spec == P("data", "model")
    assert "sharding_constraint" in primitives(partial(constrained, mesh=AUTO), jnp.ones((4, 8)))


def test_auto_mesh_inside_jit_with_set_mesh():
    with jax.set_mesh(AUTO):
        out = jax.jit(constrained)(jnp.ones((4, 8)))
    assert out.sharding.spec == P("data", "model")


def test_explicit_mesh_inside_jit_reshards_under_set_mesh():
    with jax.set_mesh(EXPLICIT):
        out = jax.jit(constrained)(jnp.ones((4, 8)))
        assert "reshard" in primitives(constrained, jnp.ones((4, 8)))
    assert out.sharding.spec == P("data", "model")


def test_explicit_mesh_inside_jit_without_set_mesh_says_so():
    with pytest.raises(ValueError) as info:
        jax.jit(partial(constrained, mesh=EXPLICIT))(jnp.ones((4, 8)))
    message = str(info.value)
    assert message.startswith("with_logical_constraint:") and "jax.set_mesh" in message


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT, MIXED], ids=["auto", "explicit", "mixed"])
def test_outside_jit_places_the_array(mesh):
    out = st.with_logical_constraint(jnp.ones((4, 8)), ("batch", "embed"), RULES, mesh=mesh)
    assert out.sharding.spec == P("data", "model") and out.sharding.mesh == mesh


def test_mixed_mesh_inside_jit_reshards_then_constrains():
    with jax.set_mesh(MIXED):
        out = jax.jit(constrained)(jnp.ones((4, 8)))
        kinds = primitives(constrained, jnp.ones((4, 8)))
    assert out.sharding.spec == P("data", "model")
    assert "reshard" in kinds and "sharding_constraint" in kinds


def test_manual_axes_inside_shard_map_are_dropped():
    @partial(jax.shard_map, mesh=AUTO, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
    def body(x):
        return st.with_logical_constraint(x * 2, ("batch", "embed"), RULES)

    out = jax.jit(body)(jnp.ones((4, 8)))
    assert out.sharding.spec == P("data", "model")  # 'model' from the constraint
    np.testing.assert_array_equal(out, 2.0)


def test_all_manual_axes_inside_shard_map_leave_nothing_to_constrain():
    @partial(jax.shard_map, mesh=AUTO, in_specs=P("data", "model"), out_specs=P("data", "model"))
    def body(x):
        return st.with_logical_constraint(x + 1, ("batch", "embed"), RULES)

    out = jax.jit(body)(jnp.ones((4, 8)))
    assert out.sharding.spec == P("data", "model")


def test_no_rules_or_no_mesh_returns_x_unchanged():
    x = jnp.ones((4, 8))
    assert st.with_logical_constraint(x, ("batch", "embed")) is x  # no rules
    assert st.with_logical_constraint(x, ("batch", "embed"), RULES) is x  # no mesh
    assert st.with_logical_constraint(x, None, RULES, mesh=AUTO) is x


def test_indivisible_dimension_follows_the_fallback_never_a_jax_error():
    x = jnp.ones((3, 8))  # 'data' (2) does not divide 3
    out = st.with_logical_constraint(x, ("batch", "embed"), RULES, mesh=AUTO)
    assert out.sharding.spec == P(None, "model")
    with pytest.raises(ValueError, match="no rule maps 'batch'"):
        st.with_logical_constraint(
            x, ("batch", "embed"), RULES, mesh=AUTO, fallback=st.RulesFallback.RAISE_ERROR
        )


def test_raise_error_fallback_names_the_unmatched_logical_axis_and_path():
    with pytest.raises(ValueError) as info:
        jax.jit(
            lambda t: st.with_logical_constraint(
                t,
                {"h": ("batch", "heads")},
                RULES,
                mesh=AUTO,
                fallback=st.RulesFallback.RAISE_ERROR,
            )
        )({"h": jnp.ones((4, 8))})
    message = str(info.value)
    assert "'heads'" in message and "x['h']" in message


def test_no_constraint_fallback_leaves_the_array_alone():
    fn = partial(
        st.with_logical_constraint,
        logical_axis_resources=("batch", "heads"),
        rules=RULES,
        mesh=AUTO,
        fallback=st.RulesFallback.NO_CONSTRAINT,
    )
    assert primitives(fn, jnp.ones((4, 8))) == []
    assert primitives(
        partial(fn, fallback=st.RulesFallback.AXIS_IS_UNSHARDED), jnp.ones((4, 8))
    ) == ["sharding_constraint"]


def test_tree_of_specs_with_none_leaving_a_subtree_alone():
    x = {"a": jnp.ones((4, 8)), "b": [jnp.ones((4, 8)), jnp.ones(8)], "c": jnp.ones(2)}
    specs = {"a": ("batch", "embed"), "b": [P("batch", "embed"), ("mlp",)], "c": None}
    out = st.with_logical_constraint(x, specs, RULES, mesh=AUTO)
    assert out["a"].sharding.spec == P("data", "model")
    assert out["b"][1].sharding.spec == P("model")
    assert out["c"] is x["c"]


def test_one_spec_for_a_subtree_applies_to_each_array():
    x = {"a": jnp.ones((4, 8)), "b": jnp.ones((2, 4))}
    out = st.with_logical_constraint(x, ("batch", "embed"), RULES, mesh=AUTO)
    assert out["a"].sharding.spec == P("data", "model") and out["b"].sharding.spec == P(
        "data", "model"
    )


def test_specs_that_are_not_a_prefix_or_not_specs():
    with pytest.raises(ValueError, match="prefix of x"):
        st.with_logical_constraint({"a": jnp.ones(2)}, {"b": ("batch",)}, RULES, mesh=AUTO)
    with pytest.raises(TypeError, match=r"logical_axis_resources\['a'\]"):
        st.with_logical_constraint({"a": jnp.ones(2)}, {"a": 3}, RULES, mesh=AUTO)
    with pytest.raises(TypeError, match="RulesFallback"):
        st.with_logical_constraint(jnp.ones(2), ("batch",), RULES, mesh=AUTO, fallback="raise")


def test_unconstrained_is_kept_on_auto_axes():
    fn = partial(
        st.with_logical_constraint, logical_axis_resources=(U, "embed"), rules=RULES, mesh=AUTO
    )
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((4, 8)))
    assert "UNCONSTRAINED" in str(jaxpr)
    with jax.set_mesh(EXPLICIT):
        out = jax.jit(
            partial(st.with_logical_constraint, logical_axis_resources=(U, "embed"), rules=RULES)
        )(jnp.ones((4, 8)))
    assert out.sharding.spec == P(None, "model")


def test_boxes_in_x_are_kept():
    x = {"w": st.LogicallyPartitioned(jnp.ones((4, 8)), ("batch", "embed"))}
    out = st.with_logical_constraint(x, {"w": ("batch", "embed")}, RULES, mesh=AUTO)
    assert type(out["w"]) is st.LogicallyPartitioned
    assert out["w"].value.sharding.spec == P("data", "model")


def test_rules_are_read_when_traced():
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return st.with_logical_constraint(x, ("batch", "embed"), mesh=AUTO)

    with st.logical_axis_rules([("batch", "data")]):
        first = f(jnp.ones((4, 8)))
    with st.logical_axis_rules([("embed", "model")]):
        second = f(jnp.ones((4, 8)))  # cached: the new rules are not seen
    assert len(traces) == 1
    assert first.sharding.spec == second.sharding.spec == P("data")


# --- constrain and shard ------------------------------------------------------------


def params():
    return {
        "w": st.LogicallyPartitioned(jnp.ones((4, 8)), ("batch", "embed")),
        "p": st.Partitioned(jnp.ones((4, 8)), (None, "model")),
        "raw": jnp.ones((4, 8)),
    }


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_constrain_constrains_boxed_values_and_keeps_boxes(mesh):
    with jax.set_mesh(mesh):
        out = jax.jit(lambda p: st.constrain(jax.tree.map(lambda x: x * 2, p), rules=RULES))(
            params()
        )
        kinds = primitives(lambda p: st.constrain(p, rules=RULES), params())
    assert type(out["w"]) is st.LogicallyPartitioned
    assert out["w"].value.sharding.spec == P("data", "model")
    assert out["p"].value.sharding.spec == P(None, "model")
    assert len(kinds) == 2  # the unboxed leaf is left alone


def test_constrain_without_a_mesh_is_the_identity():
    tree = params()
    out = st.constrain(tree, rules=RULES)
    assert all(a is b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True))


def test_constrain_uses_a_box_own_mesh():
    box = st.Partitioned(jnp.ones((4, 8)), ("data", "model"), mesh=AUTO)
    out = jax.jit(st.constrain)({"w": box})
    assert out["w"].value.sharding.spec == P("data", "model")


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_shard_places_values_and_keeps_boxes(mesh):
    out = st.shard(params(), mesh, RULES)
    assert type(out["w"]) is st.LogicallyPartitioned
    assert out["w"].value.sharding == NamedSharding(mesh, P("data", "model"))
    assert out["raw"].sharding.spec == P()


def test_shard_refuses_abstract_values():
    with pytest.raises(TypeError, match=r"tree\['w'\].*ShapeDtypeStruct"):
        st.shard(jax.eval_shape(params), AUTO, RULES)


@pytest.mark.parametrize(
    "fn, keys",
    [
        (lambda t: st.constrain(t, AUTO, RULES), ("w", "p")),
        (
            lambda t: st.with_logical_constraint(
                t, {"w": ("batch", "embed"), "p": None, "raw": None}, RULES, AUTO
            ),
            ("w",),
        ),
    ],
    ids=["constrain", "with_logical_constraint"],
)
def test_jit_of_constraints_equals_eager(fn, keys):
    eager, jitted = fn(params()), jax.jit(fn)(params())
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)
    for key in keys:  # the constrained leaves are laid out alike
        a, b = eager[key].value, jitted[key].value
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), key


# --- a target that names no Explicit axis reshards too (0.3) ---------------------------


def sharded(mesh, spec=None):
    return jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, spec or P("data", "model")))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: st.with_logical_constraint(x, (None, None), RULES),
        lambda x: st.with_logical_constraint(x, ("kv", "heads"), RULES),  # names no rule maps
        lambda x: (
            st.constrain(
                st.LogicallyPartitioned(x, ("batch", "embed")),
                rules=[("batch", None), ("embed", None)],
            ).value
        ),
    ],
    ids=["none", "unmapped-names", "constrain-with-rules-to-nothing"],
)
def test_an_unsharded_target_on_explicit_axes_leaves_the_array_unsharded(fn):
    seen = []

    def f(x):
        out = fn(2 * x)
        seen.append((jax.typeof(x).sharding.spec, jax.typeof(out).sharding.spec))
        return out

    with jax.set_mesh(EXPLICIT):
        out = jax.jit(f)(sharded(EXPLICIT))
    assert seen == [(P("data", "model"), P(None, None))]  # the traced types: no axis left
    assert out.sharding.spec == P(None, None) and out.sharding.is_fully_replicated
    np.testing.assert_array_equal(out, 2.0)


def test_an_unsharded_target_reshards_a_captured_constant():
    constant = sharded(EXPLICIT)  # concrete, closed over inside jit
    seen = []

    def f(y):
        out = st.with_logical_constraint(constant, (None, None), RULES)
        boxed = st.constrain({"w": st.Partitioned(constant, (None, None))})["w"].value
        seen.append((jax.typeof(out).sharding.spec, jax.typeof(boxed).sharding.spec))
        return out + y, boxed

    with jax.set_mesh(EXPLICIT):
        out, boxed = jax.jit(f)(jnp.zeros((4, 8)))
    assert seen == [(P(None, None), P(None, None))]
    assert out.sharding.is_fully_replicated and boxed.sharding.is_fully_replicated


def test_unconstrained_keeps_the_current_explicit_entry():
    with jax.set_mesh(EXPLICIT):
        out = jax.jit(lambda x: st.with_logical_constraint(x, (U, None), RULES))(sharded(EXPLICIT))
        kept = jax.jit(lambda x: st.with_logical_constraint(x, (U, "embed"), RULES))(
            sharded(EXPLICIT, P("data", None))
        )
    assert out.sharding.spec == P("data", None)
    assert kept.sharding.spec == P("data", "model")


def test_mixed_mesh_unshards_the_explicit_axis_and_constrains_the_auto_one():
    with jax.set_mesh(MIXED):
        fn = partial(
            st.with_logical_constraint, logical_axis_resources=(None, "embed"), rules=RULES
        )
        out = jax.jit(fn)(sharded(MIXED, P("data", None)))
        kinds = primitives(fn, sharded(MIXED, P("data", None)))
    assert out.sharding.spec == P(None, "model")
    assert "reshard" in kinds and "sharding_constraint" in kinds


def test_without_set_mesh_only_a_needed_reshard_is_an_error():
    fn = jax.jit(partial(constrained, spec=(None, None), mesh=EXPLICIT))
    out = fn(jnp.ones((4, 8)))  # already unsharded: nothing to reshard, nothing to refuse
    assert out.sharding.is_fully_replicated
    with pytest.raises(ValueError, match=r"^with_logical_constraint: .*jax\.set_mesh"):
        fn(sharded(EXPLICIT))


def test_constrain_refuses_rules_beside_other_rules_of_a_box():
    own = [("embed", "model")]
    tree = {"w": st.LogicallyPartitioned(jnp.ones((4, 8)), (None, "embed"), rules=own)}
    with pytest.raises(ValueError) as info:
        st.constrain(tree, EXPLICIT, [("embed", None)])
    message = str(info.value)
    assert message.startswith("constrain: the box at tree['w'] has rules of its own")
    assert "ambiguous" in message and "box.replace(rules=None)" in message
    same = st.constrain(tree, EXPLICIT, own)  # the same rules: nothing is ambiguous
    assert same["w"].value.sharding.spec == P(None, "model")
    assert st.constrain(tree, EXPLICIT)["w"].value.sharding.spec == P(None, "model")
