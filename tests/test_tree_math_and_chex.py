"""tree-math and chex work over boxed trees."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tree_math as tm

import spmdtree as st


def tree(scale=1.0):
    return {
        "w": st.Partitioned(scale * jnp.arange(6.0).reshape(2, 3), ("data", "model")),
        "b": st.LogicallyPartitioned(scale * jnp.ones(3), ("mlp",)),
    }


def test_tree_math_vector_over_boxed_trees():
    a, b = tm.Vector(tree()), tm.Vector(tree(2.0))
    total = (a + b).tree
    assert type(total["w"]) is st.Partitioned and total["w"].names == ("data", "model")
    np.testing.assert_allclose(total["w"].value, 3 * jnp.arange(6.0).reshape(2, 3))
    scaled = (0.5 * b).tree
    np.testing.assert_allclose(scaled["b"].value, jnp.ones(3))
    assert float(a @ b) == pytest.approx(2 * (sum(i * i for i in range(6)) + 3))


def test_tree_math_inside_jit():
    @jax.jit
    def axpy(x, y):
        return (2.0 * tm.Vector(x) + tm.Vector(y)).tree

    out = axpy(tree(), tree())
    assert out["b"].names == ("mlp",)
    np.testing.assert_allclose(out["b"].value, 3 * jnp.ones(3))


def test_chex_tree_asserts_over_boxed_trees():
    chex.assert_trees_all_close(tree(), tree(1.0 + 1e-7))
    chex.assert_trees_all_equal_shapes(tree(), tree(2.0))
    chex.assert_trees_all_equal_structs(tree(), tree(2.0))
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(tree(), tree(2.0))
    renamed = {**tree(), "w": tree()["w"].replace(names=("model", "data"))}
    with pytest.raises(AssertionError):
        chex.assert_trees_all_equal_structs(tree(), renamed)  # metadata is structure
