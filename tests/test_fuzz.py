"""Fuzzing: random trees, names, rules and meshes never give a wrong sharding.

`to_sharding` either returns shardings that `jax.device_put` accepts for every
leaf, with no mesh axis used twice in a spec, or raises a ValueError/TypeError
whose message is spmdtree's (it starts with the function's name). The same for
`with_logical_constraint` inside `jax.jit`. Never another exception type, and
never an error from inside JAX.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st
from spmdtree.boxes import rebuild

U = P.UNCONSTRAINED
MESH_SHAPES = [
    ((8,), ("a",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("b", "a")),
    ((2, 2, 2), ("a", "b", "c")),
]
AXES = ["a", "b", "c", "z"]  # "z" is in no mesh
LOGICAL = ["batch", "embed", "mlp"]


class Pair(NamedTuple):
    first: object
    second: object


@hst.composite
def meshes(draw):
    shape, names = draw(hst.sampled_from(MESH_SHAPES))
    kind = draw(hst.sampled_from([AxisType.Auto, AxisType.Explicit]))
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def axis_entries(names_pool):
    return hst.one_of(
        hst.none(),
        hst.sampled_from(names_pool),
        hst.lists(hst.sampled_from(AXES), min_size=0, max_size=2).map(tuple),  # may repeat an axis
        hst.just(U),
    )


mesh_axes = hst.one_of(
    hst.none(),
    hst.sampled_from(AXES),
    hst.lists(hst.sampled_from(AXES), min_size=1, max_size=2).map(tuple),  # may repeat one
    hst.just(U),
)
well_formed = hst.lists(hst.tuples(hst.sampled_from(LOGICAL), mesh_axes), max_size=6)
malformed = hst.lists(
    hst.tuples(hst.sampled_from(LOGICAL), hst.integers(0, 3)), min_size=1, max_size=2
)
rule_sets = hst.one_of(hst.none(), well_formed, well_formed, well_formed, malformed)
shapes = hst.lists(hst.sampled_from([1, 2, 3, 4, 6, 8]), max_size=3).map(tuple)


@hst.composite
def arrays(draw):
    shape = draw(shapes)
    kind = draw(hst.sampled_from(["numpy", "jax", "abstract", "python"]))
    if kind == "python":
        return 1.5
    if kind == "abstract":
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return jnp.asarray(value) if kind == "jax" else value


@hst.composite
def leaves(draw):
    value = draw(arrays())
    choice = draw(
        hst.sampled_from(["plain", "partitioned", "logical", "logical-own-rules", "none"])
    )
    if choice == "plain":
        return value
    if choice == "none":
        return None
    ndim = len(np.shape(value))
    count = max(0, ndim + draw(hst.sampled_from([0, 0, 0, -1, 1])))  # sometimes the wrong rank
    pool = AXES if choice == "partitioned" else LOGICAL
    names = tuple(draw(axis_entries(pool)) for _ in range(count))
    if choice == "partitioned":
        return rebuild(st.Partitioned, ((value,), (names, None)))
    rules = draw(rule_sets) if choice == "logical-own-rules" else None
    try:
        own = None if rules is None else st.rules.normalize_rules(rules)
    except (TypeError, ValueError):
        own = None
    return rebuild(st.LogicallyPartitioned, ((value,), (names, None, own)))


trees = hst.recursive(
    leaves(),
    lambda children: hst.one_of(
        hst.dictionaries(hst.sampled_from(["w", "b", "layers", "x"]), children, max_size=3),
        hst.lists(children, max_size=3),
        hst.lists(children, max_size=3).map(tuple),
        hst.tuples(children, children).map(lambda t: Pair(*t)),
    ),
    max_leaves=6,
)


def is_ours(error: Exception, *functions: str) -> bool:
    return type(error) in (TypeError, ValueError) and str(error).startswith(
        tuple(f"{f}: " for f in functions)
    )


def mesh_axes_used(spec) -> list[str]:
    return [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())]


def check_placeable(sharding, subtree) -> None:
    """Every array under a sharding can be put on it (or, abstract, sharded by it)."""
    assert len(mesh_axes_used(sharding.spec)) == len(set(mesh_axes_used(sharding.spec)))
    for leaf in jax.tree.leaves(subtree):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            sharding.shard_shape(leaf.shape)  # raises if the dimensions do not divide
        else:
            placed = jax.device_put(leaf, sharding)
            np.testing.assert_array_equal(np.asarray(placed), np.asarray(leaf))


@settings(max_examples=150)
@given(tree=trees, mesh=meshes(), rules=rule_sets, strict=hst.booleans())
def test_to_sharding_is_placeable_or_a_clear_error(tree, mesh, rules, strict):
    try:
        shardings = st.to_sharding(tree, mesh, rules, strict=strict)
    except Exception as error:  # the property is about which errors escape
        assert is_ours(error, "to_sharding"), repr(error)
        return
    jax.tree.map(
        lambda s, sub: None if s is None else check_placeable(s, sub),
        shardings,
        tree,
        is_leaf=lambda s: s is None or isinstance(s, NamedSharding),
    )


@settings(max_examples=40)
@given(
    shape=shapes,
    names=hst.lists(axis_entries(LOGICAL + AXES), max_size=4).map(tuple),
    mesh=meshes(),
    rules=rule_sets,
    fallback=hst.sampled_from(list(st.RulesFallback)),
)
def test_with_logical_constraint_in_jit_is_right_or_a_clear_error(
    shape, names, mesh, rules, fallback
):
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)

    @jax.jit
    def f(x):
        return st.with_logical_constraint(x * 2, names, rules, mesh, fallback)

    try:
        with jax.set_mesh(mesh):
            out = f(x)
    except Exception as error:
        assert is_ours(error, "with_logical_constraint"), repr(error)
        return
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
    spec = getattr(out.sharding, "spec", P())
    assert len(mesh_axes_used(spec)) == len(set(mesh_axes_used(spec)))


@pytest.mark.parametrize("function", ["to_spec", "describe"])
@settings(max_examples=40)
@given(tree=trees, mesh=meshes(), rules=rule_sets)
def test_other_tree_functions_raise_only_clear_errors(function, tree, mesh, rules):
    try:
        getattr(st, function)(tree, mesh=mesh, rules=rules)
    except Exception as error:
        assert is_ours(error, function), repr(error)
