"""Boxes: construction, immutability, pytree behaviour, equality, repr, guards."""

import copy
import pickle

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
