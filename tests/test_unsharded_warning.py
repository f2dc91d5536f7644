"""st.UnshardedWarning: a dimension asked to shard that ends unsharded is said at the
call, once per call, at the user's line; never for what is unsharded by design."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
RULES = [("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor")]


def _indivisible():
    """One box whose first dimension (1001) 'tensor' (4) does not divide."""
    return {"w": st.Partitioned(jnp.zeros((1001, 64)), ("tensor", "fsdp"))}


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, st.UnshardedWarning)]


CALLS = {
    "to_spec": lambda tree: st.to_spec(tree, mesh=MESH),
    "to_sharding": lambda tree: st.to_sharding(tree, MESH),
    "to_abstract": lambda tree: st.to_abstract(tree, MESH),
    "shard": lambda tree: st.shard(tree, MESH),
    "constrain-outside-jit": lambda tree: st.constrain(tree, MESH),
    "get_sharding": lambda tree: tree["w"].get_sharding(MESH),
    "sharded_init": lambda tree: st.sharded_init(lambda: tree, MESH)(),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_each_tree_function_warns_once_per_call_naming_the_dimension(call):
    _, caught = _caught(lambda: CALLS[call](_indivisible()))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("1 dimension asked to be sharded left unsharded")
    where = "the box" if call == "get_sharding" else "tree['w']"
    assert f"{where} dimension 0 ('tensor', size 1001) over 'tensor' (size 4)" in message
    assert "(name, None)" in message and "a None entry" in message
    assert caught[0].filename == __file__  # the user's line, not spmdtree's


def test_the_sharding_is_unchanged_by_the_warning():
    (spec, _), caught = _caught(lambda: (st.to_spec(_indivisible(), mesh=MESH), None))
    assert spec == {"w": P(None, "fsdp")} and len(caught) == 1


def test_one_warning_counts_every_dimension_and_names_the_first_five():
    tree = {f"w{i}": st.Partitioned(jnp.zeros((3, 5)), ("fsdp", "tensor")) for i in range(4)}
    _, caught = _caught(lambda: st.to_sharding(tree, MESH))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("8 dimensions asked to be sharded left unsharded")
    assert message.count(" dimension ") == 5 and "; and 3 more." in message
    assert "tree['w0'] dimension 0 ('fsdp', size 3) over 'fsdp' (size 2)" in message


def test_optimizer_sharding_warns_for_a_param_shaped_state_once():
    params = {"w": st.LogicallyPartitioned(jnp.zeros((1001, 64)), ("vocab", "embed"))}
    _, caught = _caught(lambda: st.optimizer_sharding(optax.adam(1e-3), params, MESH, RULES))
    assert len(caught) == 1
    assert "2 dimensions" in str(caught[0].message)  # mu and nu, one call


@pytest.mark.parametrize("mesh", [MESH, EXPLICIT], ids=["auto", "explicit"])
def test_a_constraint_inside_jit_warns_at_trace_time(mesh):
    def f(x):
        return st.with_logical_constraint(x, ("vocab", "embed"), RULES)

    jitted = jax.jit(f)
    with jax.set_mesh(mesh):
        out, caught = _caught(lambda: jitted(jnp.ones((6, 8))))
        _, again = _caught(lambda: jitted(jnp.ones((6, 8))))  # cached: not traced again
    assert len(caught) == 1 and again == []
    assert "x dimension 0 ('vocab', size 6) over 'tensor' (size 4)" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert out.sharding.spec in (P(None, "fsdp"), P(None, "fsdp", None))


def test_constrain_inside_jit_warns_at_trace_time():
    with jax.set_mesh(MESH):
        _, caught = _caught(lambda: jax.jit(lambda t: st.constrain(t))(_indivisible()))
    assert len(caught) == 1


def test_a_later_rule_that_fits_is_no_warning():
    rules = [("vocab", "tensor"), ("vocab", "fsdp"), ("embed", None)]
    tree = {"w": st.LogicallyPartitioned(jnp.zeros((6, 8)), ("vocab", "embed"))}
    spec, caught = _caught(lambda: st.to_spec(tree, rules, mesh=MESH))
    assert spec == {"w": P("fsdp", None)} and caught == []


@pytest.mark.parametrize(
    "case",
    [
        "size-1-dimension",
        "placeholder",
        "yields-to-an-axis-taken",
        "replicated-on-purpose-by-rule",
        "none-entry",
        "reduced-state-through-params",
        "a-rule-of-size-1-axes",
    ],
)
def test_what_is_unsharded_by_design_does_not_warn(case):
    lp = st.LogicallyPartitioned
    if case == "size-1-dimension":
        tree, rules = {"w": st.Partitioned(jnp.zeros((1, 8)), ("fsdp", "tensor"))}, None
    elif case == "placeholder":
        box = st.Partitioned(jnp.zeros((2, 4)), ("fsdp", "tensor"))
        tree, rules = {"w": box.replace_boxed(jnp.zeros((1,)))}, None  # as optax builds it
    elif case == "yields-to-an-axis-taken":  # MaxText: heads -> tensor before kv -> tensor
        tree = {"w": lp(jnp.zeros((8, 8)), ("heads", "kv"))}
        rules = [("heads", "tensor"), ("kv", "tensor")]
    elif case == "replicated-on-purpose-by-rule":
        tree = {"w": lp(jnp.zeros((6, 8)), ("vocab", "embed"))}
        rules = [("vocab", "tensor"), ("vocab", None), ("embed", "fsdp")]
    elif case == "none-entry":
        tree, rules = {"w": st.Partitioned(jnp.zeros((1001, 64)), (None, "fsdp"))}, None
    elif case == "reduced-state-through-params":
        params = {"w": lp(jnp.zeros((1001, 8)), ("vocab", "embed"))}
        state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=4).init, params)
        rules = RULES
        assert state[0].v_col["w"].value.shape == (1001,)  # kept 'vocab', which 4 does not divide
        _, caught = _caught(lambda: st.to_sharding(state, MESH, rules, params=params))
        assert caught == []
        return
    else:
        mesh = jax.sharding.AbstractMesh((8, 1), ("fsdp", "tensor"))
        tree = {
            "w": st.Partitioned(jax.ShapeDtypeStruct((1001, 64), "float32"), ("tensor", "fsdp"))
        }
        _, caught = _caught(lambda: st.to_spec(tree, mesh=mesh))
        assert caught == []
        return
    _, caught = _caught(lambda: st.to_sharding(tree, MESH, rules))
    assert caught == []


def test_plan_and_describe_flag_it_instead_of_warning():
    (planned, text), caught = _caught(
        lambda: (st.plan(_indivisible(), MESH), st.describe(_indivisible(), MESH))
    )
    assert caught == []
    assert "dimension 0 (tensor, size 1001) left unsharded: its mesh axes do not divide it" in (
        planned.rows[0].flags
    )
    assert "left unsharded" in text
    (flag,) = planned.rows[0].flags
    assert (flag.dimension, flag.name, flag.size, flag.axes) == (0, "tensor", 1001, ("tensor",))


@pytest.mark.parametrize("call", ["to_spec", "to_sharding", "to_abstract", "shard"])
def test_strict_raises_instead(call):
    fn = getattr(st, call)
    args = (_indivisible(),) if call == "to_spec" else (_indivisible(), MESH)
    kwargs = {"mesh": MESH} if call == "to_spec" else {}
    with pytest.raises(ValueError, match=rf"^{call}: the box at tree\['w'\] .* size 1001"):
        fn(*args, strict=True, **kwargs)


def test_optimizer_sharding_strict_raises_instead():
    params = {"w": st.LogicallyPartitioned(jnp.zeros((1001, 64)), ("vocab", "embed"))}
    with pytest.raises(
        ValueError, match=r"(?s)^optimizer_sharding: 2 leaves are wrong.*mu.*size 1001"
    ):
        st.optimizer_sharding(optax.adam(1e-3), params, MESH, RULES, strict=True)


def test_a_warnings_filter_makes_it_an_error_where_no_strict_is_taken():
    with warnings.catch_warnings():
        warnings.simplefilter("error", st.UnshardedWarning)
        with pytest.raises(st.UnshardedWarning):
            st.constrain(_indivisible(), MESH)


def test_python_shows_a_repeated_warning_once_per_call_site():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            st.to_spec(_indivisible(), mesh=MESH)
    assert len([w for w in caught if issubclass(w.category, st.UnshardedWarning)]) == 1


def _agreement_case(case):
    """(call with strict=, whether the warning is expected) for one case."""
    lp = st.LogicallyPartitioned
    on_mesh = {  # case: (tree, rules, warned)
        "indivisible": (_indivisible(), None, True),
        "indivisible-by-every-rule": (
            {"w": lp(jnp.zeros((6, 8)), ("vocab", "embed"))},
            [("vocab", "tensor"), ("vocab", ("fsdp", "tensor")), ("embed", "fsdp")],
            True,
        ),
        "indivisible-then-yields": (  # 'tensor' does not divide 6; 'fsdp' is embed's
            {"w": lp(jnp.zeros((6, 8)), ("vocab", "embed"))},
            [("embed", "fsdp"), ("vocab", "tensor"), ("vocab", "fsdp")],
            True,
        ),
        "size-1-dimension": (
            {"w": st.Partitioned(jnp.zeros((1, 8)), ("fsdp", "tensor"))},
            None,
            False,
        ),
        "size-1-dimension-by-rule": (
            {"w": lp(jnp.zeros((1, 8)), ("vocab", "embed"))},
            RULES,
            False,
        ),
        "placeholder": (
            {
                "w": st.Partitioned(jnp.zeros((2, 4)), ("fsdp", "tensor")).replace_boxed(
                    jnp.zeros((1,))
                )
            },
            None,
            False,
        ),
        "yields-to-an-axis-taken": (
            {"w": lp(jnp.zeros((8, 8)), ("heads", "kv"))},
            [("heads", "tensor"), ("kv", "tensor")],
            False,
        ),
        "a-later-rule-fits": (
            {"w": lp(jnp.zeros((6, 8)), ("vocab", "embed"))},
            [("vocab", "tensor"), ("vocab", "fsdp"), ("embed", None)],
            False,
        ),
        "replicated-by-a-name-none-rule": (
            {"w": lp(jnp.zeros((6, 8)), ("vocab", "embed"))},
            [("vocab", "tensor"), ("vocab", None), ("embed", "fsdp")],
            False,
        ),
        "none-entry": ({"w": st.Partitioned(jnp.zeros((1001, 64)), (None, "fsdp"))}, None, False),
    }
    if case == "reduced-state-through-params":  # its param's own dimension is the one to fix
        params = {"w": lp(jnp.zeros((1001, 8)), ("vocab", "embed"))}
        state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=4).init, params)
        return lambda strict: st.to_sharding(
            state, MESH, RULES, params=params, strict=strict
        ), False
    if case == "axes-of-size-1":
        mesh = jax.sharding.AbstractMesh((8, 1), ("fsdp", "tensor"))
        tree = {
            "w": st.Partitioned(jax.ShapeDtypeStruct((1001, 64), "float32"), ("tensor", "fsdp"))
        }
        return lambda strict: st.to_spec(tree, mesh=mesh, strict=strict), False
    tree, rules, warned = on_mesh[case]
    return lambda strict: st.to_sharding(tree, MESH, rules, strict=strict), warned


AGREEMENT = [
    "indivisible",
    "indivisible-by-every-rule",
    "indivisible-then-yields",
    "size-1-dimension",
    "size-1-dimension-by-rule",
    "placeholder",
    "yields-to-an-axis-taken",
    "a-later-rule-fits",
    "replicated-by-a-name-none-rule",
    "none-entry",
    "reduced-state-through-params",
    "axes-of-size-1",
]


@pytest.mark.parametrize("case", AGREEMENT)
def test_strict_raises_exactly_where_the_warning_is_issued(case):
    call, expected = _agreement_case(case)
    _, caught = _caught(lambda: call(False))
    assert bool(caught) is expected
    if expected:
        with pytest.raises(ValueError, match="so it would be left unsharded"):
            call(True)
    else:
        call(True)
