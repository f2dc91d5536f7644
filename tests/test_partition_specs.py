"""PartitionSpecs read as JAX reads them (new in 0.3): a shorter spec leaves the last
dimensions unsharded, all-None names fit any rank; a tuple with a name in it keeps
one name per dimension (which is what catches stale names)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("cls", [st.Partitioned, st.LogicallyPartitioned])
def test_a_short_partition_spec_is_padded_and_stored_padded(cls):
    box = cls(jnp.zeros((4, 8, 2)), P("data"))
    assert box.names == ("data", None, None)
    assert box.get_partition_spec() == P("data", None, None)


@pytest.mark.parametrize(
    "names", [P(), P(None), (None,), [None, None], (), [None]], ids=lambda n: repr(n)
)
@pytest.mark.parametrize("shape", [(), (3,), (4, 8), (2, 3, 5)])
def test_all_none_names_fit_any_rank(names, shape):
    box = st.Partitioned(jnp.zeros(shape), names)
    assert box.names == (None,) * len(shape)
    assert st.to_sharding({"x": box}, MESH)["x"].spec == P(*(None,) * len(shape))


@pytest.mark.parametrize("names", [("data",), ["data"], ("data", None, None)])
def test_a_tuple_or_list_with_a_name_keeps_one_name_per_dimension(names):
    with pytest.raises(ValueError, match="Give one name per dimension"):
        st.Partitioned(jnp.zeros((4, 8)), names)


def test_a_partition_spec_longer_than_the_rank_is_refused():
    with pytest.raises(ValueError, match=r"3 names for 2 dimensions"):
        st.Partitioned(jnp.zeros((4, 8)), P("data", None, "model"))


def test_box_and_match_read_partition_specs_as_jax_does():
    tree = {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8), "step": jnp.zeros((), jnp.int32)}
    boxed = st.box(tree, st.match([("w", P("data")), ("step", P()), (".*", P(None))]))
    assert boxed["w"].names == ("data", None)
    assert boxed["b"].names == (None,)
    assert boxed["step"].names == ()
    by_tree = st.box(tree, {"w": P(None, "model"), "b": P("model"), "step": P()})
    assert st.to_spec(by_tree, mesh=MESH) == {"w": P(None, "model"), "b": P("model"), "step": P()}
    with pytest.raises(ValueError, match=r"box: the leaf at tree\['b'\]"):
        st.box(tree, {"w": P("data"), "b": ("data", None), "step": P()})


def test_with_partitioning_pads_a_short_spec_against_the_value_it_returns():
    init = st.with_partitioning(lambda key, shape: jnp.zeros(shape), P("data"))
    assert init(None, (4, 8)).names == ("data", None)
    assert init(None, (4,)).names == ("data",)
    logical = st.with_logical_partitioning(lambda: jnp.zeros((2, 3)), P(None))
    assert logical().names == (None, None)


def test_a_box_holding_a_subtree_reads_all_none_names_against_each_leaf():
    inner = {"a": jnp.zeros((4, 8)), "b": jnp.zeros(()), "c": jnp.zeros(3)}
    box = st.Partitioned(inner, P(None))
    out = st.to_sharding({"x": box}, MESH)["x"]
    assert {k: s.spec for k, s in out.value.items()} == {"a": P(None, None), "b": P(), "c": P(None)}


# EasyLM's LLaMA rules (EasyLM/models/llama/llama_model.py, LLaMAConfig.get_partition_rules),
# applied literally to a whole TrainState: its catch-all gives PS(None) to every leaf it
# reaches, of whatever rank, and PS() to scalars.
EASYLM_RULES = [
    ("transformer/wte/embedding", P("mp", "fsdp")),
    ("attention/(wq|wk|wv)/kernel", P("fsdp", "mp")),
    ("attention/wo/kernel", P("mp", "fsdp")),
    ("feed_forward/w1/kernel", P("fsdp", "mp")),
    ("feed_forward/w2/kernel", P("mp", "fsdp")),
    ("feed_forward/w3/kernel", P("fsdp", "mp")),
    ("attention_norm/kernel", P(None)),
    ("ffn_norm/kernel", P(None)),
    ("transformer/ln_f/kernel", P(None)),
    ("lm_head/kernel", P("fsdp", "mp")),
    (".*", P(None)),
]


def _easylm_train_state():
    layer = {
        "attention": {n: {"kernel": jnp.zeros((16, 16))} for n in ("wq", "wk", "wv", "wo")},
        "feed_forward": {
            "w1": {"kernel": jnp.zeros((16, 32))},
            "w2": {"kernel": jnp.zeros((32, 16))},
            "w3": {"kernel": jnp.zeros((16, 32))},
        },
        "attention_norm": {"kernel": jnp.zeros(16)},
        "ffn_norm": {"kernel": jnp.zeros(16)},
    }
    params = {
        "transformer": {
            "wte": {"embedding": jnp.zeros((64, 16))},
            "h": {"0": layer, "1": layer},
            "ln_f": {"kernel": jnp.zeros(16)},
        },
        "lm_head": {"kernel": jnp.zeros((16, 64))},
    }
    opt_state = optax.adamw(1e-3).init(params)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}


def _easylm_spec(path, leaf):
    """EasyLM's own match_partition_rules: scalars replicated, else the first rule
    whose regex re.search-es the '/'-joined path."""
    if len(leaf.shape) == 0 or leaf.size == 1:
        return P()
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return next(spec for rule, spec in EASYLM_RULES if re.search(rule, name))


def test_easylm_rules_apply_literally_to_its_whole_train_state():
    mesh = jax.make_mesh((1, 4, 2), ("dp", "fsdp", "mp"), axis_types=(AxisType.Auto,) * 3)
    state = _easylm_train_state()
    boxed = st.box(state, st.match(EASYLM_RULES))
    got = st.to_sharding(boxed, mesh)
    want = jax.tree_util.tree_map_with_path(_easylm_spec, state)
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, P))
    assert len(flat_got) == len(flat_want) > 40
    for (path, sharding), (_, spec) in zip(flat_got, flat_want, strict=True):
        padded = tuple(spec) + (None,) * (len(sharding.spec) - len(spec))
        assert tuple(sharding.spec) + (None,) * (len(padded) - len(sharding.spec)) == padded, path
    placed = st.shard(boxed, mesh)
    assert placed["params"]["lm_head"]["kernel"].value.sharding.spec == P("fsdp", "mp")


def test_lists_are_names_in_with_logical_constraint_for_one_array():
    rules = [("batch", "data"), ("embed", "model")]
    with jax.set_mesh(MESH):
        out = jax.jit(lambda x: st.with_logical_constraint(x, ["batch", "embed"], rules))(
            jnp.ones((4, 8))
        )
    assert out.sharding.spec == P("data", "model")
    tree = [jnp.ones((4, 8)), jnp.ones((4,))]
    got = st.with_logical_constraint(tree, [("batch", "embed"), ("batch",)], rules, MESH)
    assert [x.sharding.spec for x in got] == [P("data", "model"), P("data")]
