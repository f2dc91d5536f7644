"""Tree combinators: box, match, unbox, replace_boxed, map_boxes, add_axis, remove_axis."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hst
from jax.sharding import PartitionSpec as P

import spmdtree as st


def params():
    return {
        "dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)},
        "scale": jnp.ones(()),
    }


def test_box_with_a_names_tree():
    boxed = st.box(
        params(), {"dense": {"kernel": ("data", "model"), "bias": P("model")}, "scale": None}
    )
    assert boxed["dense"]["kernel"].names == ("data", "model")
    assert boxed["dense"]["bias"].names == ("model",)
    assert not st.is_boxed(boxed["scale"])
    assert type(boxed["dense"]["kernel"]) is st.Partitioned


def test_box_logical_with_mesh_and_rules():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    names = {"dense": {"kernel": ("embed", "mlp"), "bias": None}, "scale": None}
    boxed = st.box(params(), names, logical=True, mesh=mesh, rules=[("mlp", "model")])
    kernel = boxed["dense"]["kernel"]
    assert type(kernel) is st.LogicallyPartitioned
    assert kernel.mesh is mesh and kernel.rules == (("mlp", "model"),)


def test_box_rules_need_logical():
    with pytest.raises(ValueError, match="logical=True"):
        st.box(params(), lambda path, leaf: None, rules=[("a", "b")])


def test_box_with_a_function_of_the_path():
    seen = []

    def names(path, leaf):
        seen.append(jax.tree_util.keystr(path))
        return ("model",) if leaf.ndim == 1 else None

    boxed = st.box(params(), names)
    assert boxed["dense"]["bias"].names == ("model",)
    assert not st.is_boxed(boxed["dense"]["kernel"])
    assert sorted(seen) == ["['dense']['bias']", "['dense']['kernel']", "['scale']"]


def test_box_names_tree_of_the_wrong_structure():
    with pytest.raises(ValueError, match="must follow the structure of `tree`"):
        st.box(params(), {"dense": ("data", "model"), "scale": None})


def test_box_collects_every_wrong_leaf():
    names = {"dense": {"kernel": ("data",), "bias": ("a", "b")}, "scale": None}
    with pytest.raises(ValueError) as info:
        st.box(params(), names)
    message = str(info.value)
    assert "box: 2 leaves are wrong" in message
    assert "tree['dense']['kernel']" in message and "tree['dense']['bias']" in message


def test_box_refuses_non_arrays_and_boxes():
    with pytest.raises(TypeError, match=r"the leaf at tree\['s'\] is 'text', not an array"):
        st.box({"s": "text"}, {"s": ("a",)})
    boxed = st.box(params(), {"dense": {"kernel": ("a", "b"), "bias": None}, "scale": None})
    with pytest.raises(ValueError, match="already boxed"):
        st.box(boxed, {"dense": {"kernel": ("a", "b"), "bias": None}, "scale": None})


def test_match_first_pattern_wins_and_unmatched_stay_unboxed():
    rule = st.match(
        [(r"dense/kernel$", ("embed", "mlp")), (r"kernel", ("x", "y")), (r"bias$", None)]
    )
    boxed = st.box(params(), rule, logical=True)
    assert boxed["dense"]["kernel"].names == ("embed", "mlp")
    assert not st.is_boxed(boxed["dense"]["bias"])
    assert not st.is_boxed(boxed["scale"])


def test_match_strict_lists_unmatched_paths():
    rule = st.match([(r"kernel$", ("embed", "mlp"))], strict=True)
    with pytest.raises(ValueError) as info:
        st.box(params(), rule)
    message = str(info.value)
    assert "'dense/bias'" in message and "'scale'" in message
    assert "strict=False" in message


def test_match_invalid_regex_and_names():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        st.match([("kernel(", ("a",))])
    with pytest.raises(TypeError, match="pattern 0"):
        st.match([("kernel", ("a", 1))])
    with pytest.raises(TypeError, match="pair"):
        st.match(["kernel"])


def test_match_paths_of_namedtuples_and_lists():
    class State(NamedTuple):
        mu: dict
        count: jax.Array

    tree = State(mu={"layers": [jnp.zeros(4), jnp.zeros(4)]}, count=jnp.zeros(()))
    boxed = st.box(tree, st.match([(r"^mu/layers/1$", ("x",))]))
    assert st.is_boxed(boxed.mu["layers"][1]) and not st.is_boxed(boxed.mu["layers"][0])


def test_unbox_strips_nested_boxes():
    inner = st.Partitioned(jnp.ones(4), ("data",))
    tree = {"a": st.Partitioned({"b": inner, "c": 1.0}, ("x",)), "d": 2.0}
    assert st.unbox(tree) == {"a": {"b": inner.value, "c": 1.0}, "d": 2.0}


def test_unbox_never_constrains():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {"w": st.Partitioned(jnp.ones((2, 4)), ("data", "model"))}
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(st.unbox)(tree)
    assert not jaxpr.eqns  # no sharding_constraint, no reshard: nothing at all


def test_replace_boxed_round_trip_and_errors():
    tree = st.box(params(), {"dense": {"kernel": ("a", "b"), "bias": ("b",)}, "scale": None})
    assert st.replace_boxed(tree, st.unbox(tree)) == tree
    doubled = st.replace_boxed(tree, jax.tree.map(lambda x: 2 * x, st.unbox(tree)))
    assert doubled["dense"]["kernel"].names == ("a", "b")
    np.testing.assert_array_equal(doubled["dense"]["kernel"].value, 2.0)
    with pytest.raises(ValueError, match="replace_boxed: `values` must have the structure"):
        st.replace_boxed(tree, {"dense": 1.0, "scale": 1.0})


def test_map_boxes_sees_outermost_boxes_only():
    inner = st.Partitioned(jnp.ones(4), ("data",))
    tree = {"a": st.LogicallyPartitioned([inner], ("x",)), "b": inner, "c": 1.0}
    seen = []
    st.map_boxes(lambda b: seen.append(type(b).__name__) or b, tree)
    assert sorted(seen) == ["LogicallyPartitioned", "Partitioned"]


@pytest.mark.parametrize(
    "index, expected",
    [
        (0, ("layers", "a", "b")),
        (1, ("a", "layers", "b")),
        (2, ("a", "b", "layers")),
        (-1, ("a", "b", "layers")),
        (-3, ("layers", "a", "b")),
    ],
    ids=["front", "middle", "end", "minus-one-appends", "minus-three"],
)
def test_add_axis_index_counts_in_the_result(index, expected):
    tree = {"w": st.Partitioned(jnp.zeros((2, 4)), ("a", "b"))}
    added = st.add_axis(tree, index, "layers")
    assert added["w"].names == expected
    assert st.remove_axis(added, index, "layers") == tree


@pytest.mark.parametrize(
    "name", ["layers", None, {st.PARTITION_NAME: "layers"}], ids=["str", "none", "flax-params"]
)
def test_add_axis_name_forms(name):
    tree = {"w": st.Partitioned(jnp.zeros(2), ("a",))}
    expected = "layers" if name is not None else None
    assert st.add_axis(tree, 0, name)["w"].names == (expected, "a")


def test_add_and_remove_axis_out_of_range():
    tree = {"w": st.Partitioned(jnp.zeros((2, 4)), ("a", "b"))}
    with pytest.raises(ValueError, match=r"tree\['w'\].*positions -3 to 2, not 3"):
        st.add_axis(tree, 3, "layers")
    with pytest.raises(ValueError, match=r"tree\['w'\].*no axis 2 to remove"):
        st.remove_axis(tree, 2, "a")


def test_remove_axis_of_the_wrong_name_names_path_and_both_names():
    tree = {"blocks": {"w": st.Partitioned(jnp.zeros((2, 4)), ("embed", "mlp"))}}
    with pytest.raises(ValueError) as info:
        st.remove_axis(tree, 0, "layers")
    message = str(info.value)
    assert message.startswith("remove_axis: the box at tree['blocks']['w']")
    assert "'embed', not 'layers'" in message


def test_add_axis_on_a_user_box_calls_its_method():
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Tagged(st.AxisMetadata):
        value: object
        axes: tuple = dataclasses.field(metadata=dict(static=True))

        def unbox(self):
            return self.value

        def replace_boxed(self, value):
            return dataclasses.replace(self, value=value)

        def add_axis(self, index, params):
            return dataclasses.replace(self, axes=(*self.axes, params[st.PARTITION_NAME]))

        def remove_axis(self, index, params):
            return dataclasses.replace(self, axes=self.axes[:-1])

    tree = {"t": Tagged(jnp.zeros(2), ()), "p": st.Partitioned(jnp.zeros(2), ("a",))}
    added = st.add_axis(tree, 0, "layers")
    assert added["t"].axes == ("layers",) and added["p"].names == ("layers", "a")
    assert st.unbox(added)["t"] is tree["t"].value
    assert st.remove_axis(added, 0, "layers")["t"].axes == ()


BOXED = {
    "dense": {
        "kernel": st.Partitioned(jnp.arange(8.0).reshape(2, 4), ("data", "model")),
        "bias": st.LogicallyPartitioned(jnp.ones(4), ("mlp",)),
    },
    "step": jnp.zeros((), jnp.int32),
}


@pytest.mark.parametrize(
    "fn",
    [
        st.unbox,
        lambda t: st.replace_boxed(t, jax.tree.map(lambda x: x + 1, st.unbox(t))),
        lambda t: st.map_boxes(lambda b: b.replace_boxed(b.value * 2), t),
        lambda t: st.add_axis(t, -1, "extra"),
        lambda t: st.remove_axis(st.add_axis(t, 0, "layers"), 0, "layers"),
        lambda t: st.box(st.unbox(t), st.match([("kernel", ("data", "model"))])),
    ],
    ids=["unbox", "replace_boxed", "map_boxes", "add_axis", "remove_axis", "box-match"],
)
def test_jit_of_each_combinator_equals_the_combinator(fn):
    eager, jitted = fn(BOXED), jax.jit(fn)(BOXED)
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)


# --- laws -----------------------------------------------------------------------

axis_names = hst.sampled_from(["data", "model", "embed", "mlp", None])
shapes = hst.lists(hst.integers(1, 3), min_size=0, max_size=3).map(tuple)


@given(shape=shapes, data=hst.data())
def test_unbox_of_box_is_the_tree(shape, data):
    names = tuple(data.draw(axis_names) for _ in shape)
    tree = {"x": np.zeros(shape), "y": [np.ones(shape)]}
    boxed = st.box(tree, {"x": names, "y": [names]}, logical=data.draw(hst.booleans()))
    unboxed = st.unbox(boxed)
    assert jax.tree.structure(unboxed) == jax.tree.structure(tree)
    assert all(a is b for a, b in zip(jax.tree.leaves(unboxed), jax.tree.leaves(tree), strict=True))


@given(shape=shapes, data=hst.data())
def test_remove_axis_inverts_add_axis(shape, data):
    names = tuple(data.draw(axis_names) for _ in shape)
    tree = {"w": st.Partitioned(np.zeros(shape), names)}
    index = data.draw(hst.integers(-(len(shape) + 1), len(shape)))
    name = data.draw(axis_names)
    added = st.add_axis(tree, index, name)
    assert len(added["w"].names) == len(names) + 1
    assert added["w"].names[index] == name
    assert st.remove_axis(added, index, name) == tree


@given(shape=shapes, data=hst.data())
def test_replace_boxed_of_unbox_restores_the_tree(shape, data):
    names = tuple(data.draw(axis_names) for _ in shape)
    tree = {"a": st.LogicallyPartitioned(np.zeros(shape), names), "b": [np.ones(2), None]}
    assert st.replace_boxed(tree, st.unbox(tree)) == tree
