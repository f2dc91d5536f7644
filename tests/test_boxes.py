"""Boxes: construction, immutability, pytree behaviour, equality, repr, guards."""

import copy
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdtree as st


def test_names_lists_become_tuples_nested_too():
    box = st.Partitioned(jnp.zeros((2, 4)), ["data", ["fsdp", "tensor"]])
    assert box.names == ("data", ("fsdp", "tensor"))
    assert type(box.names[1]) is tuple


def test_partition_spec_accepted_as_names():
    box = st.Partitioned(jnp.zeros((2, 4)), P("data", None))
    assert box.names == ("data", None)


def test_unconstrained_entry_is_kept():
    box = st.Partitioned(jnp.zeros((2, 4)), (P.UNCONSTRAINED, "model"))
    assert box.names[0] is P.UNCONSTRAINED


@pytest.mark.parametrize(
    "names, bad",
    [(("data", 3), "3"), (("data", ["x", 1]), "['x', 1]"), (("data", {"a": 1}), "{'a': 1}")],
    ids=["int", "tuple-with-int", "dict"],
)
def test_wrong_kind_of_entry_is_a_type_error_naming_it(names, bad):
    with pytest.raises(TypeError, match="entry 1 is") as info:
        st.Partitioned(jnp.zeros((2, 4)), names)
    assert bad in str(info.value)


def test_bare_string_names_are_refused():
    with pytest.raises(TypeError, match=r"expected a tuple with one entry per dimension"):
        st.Partitioned(jnp.zeros(4), "data")


@pytest.mark.parametrize(
    "value",
    [jnp.zeros((2, 4)), np.zeros((2, 4)), jax.ShapeDtypeStruct((2, 4), jnp.float32)],
    ids=["jax", "numpy", "abstract"],
)
def test_rank_is_validated_at_construction(value):
    with pytest.raises(ValueError, match=r"3 names for 2 dimensions"):
        st.Partitioned(value, ("a", "b", "c"))
    with pytest.raises(ValueError, match=r"1 name for 2 dimensions"):
        st.LogicallyPartitioned(value, ("a",))


def test_unflatten_does_not_validate():
    box = st.Partitioned(jnp.zeros((2, 4)), ("data", "model"))
    treedef = jax.tree.structure(box)
    rebuilt = jax.tree.unflatten(treedef, [jnp.zeros(3)])  # rank 1 under 2 names
    assert rebuilt.names == ("data", "model")
    assert rebuilt.value.shape == (3,)


def test_values_without_shape_are_not_rank_checked():
    box = st.Partitioned(object, ("data",))
    assert box.value is object


def test_boxes_are_immutable():
    box = st.Partitioned(jnp.zeros(4), ("data",))
    with pytest.raises(AttributeError, match="immutable"):
        box.names = ("model",)
    with pytest.raises(AttributeError, match="immutable"):
        box.value = jnp.ones(4)
    with pytest.raises(AttributeError, match="immutable"):
        del box.names
    assert box.names == ("data",)


def test_key_path_of_the_value_and_flatten_agree():
    tree = {"w": st.LogicallyPartitioned(jnp.zeros(4), ("embed",))}
    with_path, treedef_p = jax.tree_util.tree_flatten_with_path(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    assert jax.tree_util.keystr(with_path[0][0]) == "['w'].value"
    assert [leaf for _, leaf in with_path] == leaves
    assert treedef_p == treedef


def test_one_child_and_static_metadata():
    box = st.LogicallyPartitioned(jnp.zeros(4), ["embed"], rules=[["embed", ["a", "b"]]])
    leaves, treedef = jax.tree.flatten(box)
    assert len(leaves) == 1
    same = st.LogicallyPartitioned(jnp.ones(4), ("embed",), rules=(("embed", ("a", "b")),))
    assert jax.tree.structure(same) == treedef


def test_equality_never_raises_and_compares_metadata_and_identity():
    x = jnp.zeros((2, 4))
    a = st.Partitioned(x, ("data", "model"))
    assert a == st.Partitioned(x, ["data", "model"])
    assert a != st.Partitioned(jnp.zeros((2, 4)), ("data", "model"))  # another array
    assert a != st.Partitioned(x, ("model", "data"))
    assert a != st.LogicallyPartitioned(x, ("data", "model"))
    assert a != x and x != a
    assert (a == np.zeros((2, 4))) is False and (np.zeros((2, 4)) == a) is False
    assert st.Partitioned([x], ("a", "b")) != st.Partitioned([jnp.zeros((2, 4))], ("a", "b"))
    assert st.Partitioned(1.0, ()) == st.Partitioned(1.0, ())


def test_equal_boxes_hash_equal():
    x = jnp.zeros(4)
    assert hash(st.Partitioned(x, ["data"])) == hash(st.Partitioned(x, ("data",)))


def test_repr_shows_dtype_shape_and_names_not_data():
    box = st.Partitioned(jnp.zeros((256, 512)), ("data", "model"))
    assert repr(box) == "Partitioned(f32[256,512], names=('data', 'model'))"
    box = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((8,), jnp.bfloat16), ("embed",), rules=[("embed", "x")]
    )
    assert repr(box) == "LogicallyPartitioned(bf16[8], names=('embed',), rules=(('embed', 'x'),))"


@pytest.mark.parametrize(
    "use",
    [
        jnp.asarray,
        np.asarray,
        len,
        list,
        lambda b: b + 1,
        lambda b: 1 + b,
        lambda b: b @ jnp.ones(4),
        lambda b: jnp.ones(4) * b,
        lambda b: -b,
        lambda b: b[0],
    ],
    ids=[
        "jnp.asarray",
        "np.asarray",
        "len",
        "iter",
        "add",
        "radd",
        "matmul",
        "rmul",
        "neg",
        "index",
    ],
)
def test_a_box_is_not_an_array_nor_a_sequence(use):
    box = st.Partitioned(jnp.zeros(4), ("data",))
    with pytest.raises(TypeError, match="unbox"):
        use(box)


def test_a_box_is_truthy():
    assert st.Partitioned(jnp.zeros(0), (None,))


def test_replace_validates_and_replace_boxed_does_not():
    box = st.Partitioned(jnp.zeros((2, 4)), ("data", None))
    assert box.replace(names=[None, "model"]).names == (None, "model")
    with pytest.raises(ValueError, match="1 name for 2 dimensions"):
        box.replace(names=("data",))
    with pytest.raises(TypeError, match="unknown field"):
        box.replace(rules=())
    assert box.replace_boxed(jnp.zeros(3)).value.shape == (3,)


def test_box_methods():
    box = st.LogicallyPartitioned(jnp.zeros((2, 4)), ("embed", "mlp"))
    assert box.unbox() is box.value
    assert box.get_partition_spec() == P("embed", "mlp")
    added = box.add_axis(0, {st.PARTITION_NAME: "layers"})
    assert added.names == ("layers", "embed", "mlp")
    assert added.remove_axis(0, {st.PARTITION_NAME: "layers"}) == box
    with pytest.raises(TypeError, match="partition_name"):
        box.add_axis(0, {})
    with pytest.raises(ValueError, match="position 0 is 'embed', not 'layers'"):
        box.remove_axis(0, {st.PARTITION_NAME: "layers"})


def test_get_sharding_method_resolves_logical_names():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    box = st.LogicallyPartitioned(
        jnp.zeros((4, 6)), ("embed", "mlp"), rules=[("mlp", "model"), ("mlp", "data")]
    )
    # 'model' (4) does not divide 6, so the next rule for 'mlp' applies.
    assert box.get_sharding(mesh).spec == P(None, "data")
    with st.logical_axis_rules([("embed", "model")]):
        plain = st.LogicallyPartitioned(jnp.zeros((4, 6)), ("embed", "mlp"))
        assert plain.get_sharding(mesh).spec == P("model", None)


_MESH = jax.make_mesh((2, 4), ("data", "model"))
_RULES = [("embed", "data"), ("mlp", "model")]
_LP, _P = st.LogicallyPartitioned, st.Partitioned

#: Boxes whose own get_sharding is compared with st.to_sharding of the box.
BOXES = {
    "logical-context-rules": _LP(jnp.zeros((8, 16)), ("embed", "mlp")),
    "logical-own-rules": _LP(jnp.zeros((8, 6)), ("embed", "mlp"), rules=[("mlp", "data")]),
    "mesh-axes": _P(jnp.zeros((8, 16)), ("data", "model")),
    "subtree": _P({"a": jnp.zeros((4, 8)), "b": jnp.zeros((2, 4))}, ("data", "model")),
    "subtree-with-a-box-inside": _P(
        {"a": jnp.zeros((4, 8)), "b": _LP(jnp.zeros(8), ("mlp",))}, ("data", "model")
    ),
    "holding-no-array": _P({"note": None}, ()),
    "warns-indivisible": _P(jnp.zeros((5, 8)), ("data", "model")),
    "warns-logical-indivisible": _LP(jnp.zeros((4, 1001)), ("embed", "mlp")),
    "typo": _LP(jnp.zeros((4, 8)), ("embedd", "mlp")),
    "typo-inside-a-subtree": _P({"w": _LP(jnp.zeros(4), ("embedd",))}, ("data",)),
    "unmentioned-mesh-axis": _LP(jnp.zeros((4, 8)), ("embed", "model")),
    "axis-not-in-mesh": _P(jnp.zeros((4, 8)), ("dta", None)),
    "rank-inside-a-subtree": _P({"a": jnp.zeros((4, 8, 2))}, ("data", "model")),
    "own-mesh-differs": _P(jnp.zeros(4), ("data",), mesh=jax.make_mesh((8,), ("data",))),
}


def _outcome(fn):
    """A call's result or error, and its warnings (with where they point), with
    the function's name and the root's name ("tree", or none for a box on its
    own) taken out of the messages."""

    def said(text):
        text = text.replace("the box at tree ", "the box ").replace(
            "tree dimension", "the box dimension"
        )
        return text.replace("tree.value", ".value")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ("ok", fn())
        except (TypeError, ValueError) as e:
            result = (type(e).__name__, said(str(e).split(": ", 1)[1]))
    return result, [(w.category, said(str(w.message)), w.filename) for w in caught]


@pytest.mark.parametrize("box", list(BOXES.values()), ids=list(BOXES))
def test_get_sharding_of_a_box_is_to_sharding_of_the_box(box):
    with st.logical_axis_rules(_RULES):
        got = _outcome(lambda: box.get_sharding(_MESH))
        want = _outcome(lambda: st.to_sharding(box, _MESH))
    assert got == want


def test_the_compared_boxes_give_results_warnings_and_each_kind_of_error():
    with st.logical_axis_rules(_RULES):
        outcomes = {
            name: _outcome(lambda box=box: box.get_sharding(_MESH)) for name, box in BOXES.items()
        }
    results = {name: result[0] for name, (result, _) in outcomes.items()}
    assert results["subtree"] == "ok" and isinstance(outcomes["subtree"][0][1], st.Partitioned)
    assert outcomes["holding-no-array"][0][1] is BOXES["holding-no-array"]
    for name in ("warns-indivisible", "warns-logical-indivisible"):
        ((category, message, filename),) = outcomes[name][1]
        assert category is st.UnshardedWarning and filename == __file__
        assert message.startswith("1 dimension") and "the box dimension" in message
    said = {name: result[1] for name, (result, _) in outcomes.items() if result[0] != "ok"}
    assert said["typo"].startswith("the box uses logical name 'embedd'")
    assert "the box at .value['w'] uses logical name 'embedd'" in said["typo-inside-a-subtree"]
    assert said["unmentioned-mesh-axis"].startswith("the box has logical names")
    assert "Did you mean 'data'?" in said["axis-not-in-mesh"]
    assert said["rank-inside-a-subtree"].startswith("the box has 2 names")
    assert said["own-mesh-differs"].startswith("the box has its own mesh")


def test_pickle_and_deepcopy_keep_metadata():
    box = st.LogicallyPartitioned(np.arange(4.0), ["embed"], rules=[("embed", "x")])
    for copied in (pickle.loads(pickle.dumps(box)), copy.deepcopy(box)):
        assert type(copied) is st.LogicallyPartitioned
        assert copied.names == box.names and copied.rules == box.rules
        np.testing.assert_array_equal(copied.value, box.value)


def test_with_partitioning_wraps_initialisers():
    init = st.with_partitioning(jax.nn.initializers.ones, ["data", None])
    box = init(jax.random.key(0), (2, 3))
    assert type(box) is st.Partitioned and box.names == ("data", None)
    assert init.__name__ == jax.nn.initializers.ones.__name__
    with pytest.raises(TypeError, match="with_partitioning"):
        st.with_partitioning(jax.nn.initializers.ones, ("data", 1))


def test_with_logical_partitioning_wraps_initialisers():
    init = st.with_logical_partitioning(jax.nn.initializers.zeros, ("mlp",), rules={"mlp": "x"})
    box = init(jax.random.key(0), (8,))
    assert type(box) is st.LogicallyPartitioned
    assert box.names == ("mlp",) and box.rules == (("mlp", "x"),)


def test_subclasses_of_partitioned_are_registered():
    class Frozen(st.Partitioned):
        __slots__ = ()

    box = Frozen(jnp.zeros(4), ("data",))
    out = jax.tree.map(lambda x: x + 1, box)
    assert type(out) is Frozen and out.names == ("data",)
    assert float(out.value[0]) == 1.0


def test_boxes_pass_through_jit_and_grad():
    params = {"w": st.Partitioned(jnp.ones((2, 4)), ("data", "model"))}

    @jax.jit
    def step(p):
        grads = jax.grad(lambda q: jnp.sum(st.unbox(q)["w"] ** 2))(p)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

    out = step(params)
    assert type(out["w"]) is st.Partitioned and out["w"].names == ("data", "model")
    np.testing.assert_allclose(out["w"].value, 0.8)


def test_mesh_must_be_a_mesh():
    with pytest.raises(TypeError, match=r"jax\.sharding\.Mesh"):
        st.Partitioned(jnp.zeros(4), ("data",), mesh="mesh")
