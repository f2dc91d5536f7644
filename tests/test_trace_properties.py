"""Tracing a step over grids: what it hands the compiler against oracles this file
computes itself.

Over mesh shapes and axis orders (axes of size 1 among them), logical rules in
any order, batch sizes and donation: each argument's shard shape from the mesh's
axis sizes (a dimension divided by the product of the axes its rule names),
the arguments' bytes the raw compile's `memory_analysis()` counts as the sum of
those shards, and the donated ones aliased exactly.
"""

import functools
import math

import jax
import jax.numpy as jnp
from hypothesis import given
from hypothesis import strategies as hs
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_step_properties import examples

import spmdtree as st

AXES = ("data", "fsdp", "tensor")
WIDTH, HIDDEN = 64, 128  # divisible by every product of drawn axis sizes


@hs.composite
def cases(draw):
    """A mesh (1 to 3 axes of 1, 2 or 4 devices, at most 8, in any order), the
    rules giving batch, embed and mlp one axis each or none, a batch a multiple of
    the data axes, and whether the weights are donated."""
    names = tuple(draw(hs.permutations(AXES))[: draw(hs.integers(1, 3))])
    shape = tuple(draw(hs.sampled_from([1, 2, 4])) for _ in names)
    if math.prod(shape) > 8:
        shape = (2,) * len(names)
    rules = tuple(
        (logical, draw(hs.sampled_from([None, *names])))
        for logical in draw(hs.permutations(["batch", "embed", "mlp"]))
    )
    batch = 8 * draw(hs.integers(1, 4))
    return names, shape, rules, batch, draw(hs.booleans())


def step(params, x):
    h = jnp.tanh(x.value @ params["w1"].value)
    return jax.tree.map(lambda p: p * jnp.mean(h), params)


def arguments(batch):
    def box(shape, names):
        return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)

    params = {"w1": box((WIDTH, HIDDEN), ("embed", "mlp")), "w2": box((HIDDEN,), ("mlp",))}
    return params, box((batch, WIDTH), ("batch", "embed"))


def axes_by_rules(names, rules):
    """Each of a leaf's names' mesh axis by the rules in their order: an axis two of
    its names map to serves the name whose rule comes first; None: unsharded."""
    given_, used = {}, set()
    for name, axis in rules:
        if name in names and name not in given_ and axis is not None and axis not in used:
            given_[name] = axis
            used.add(axis)
    return [given_.get(name) for name in names]


def shard(shape, names, rules, sizes):
    """A leaf's shard shape by its rules, from the mesh's axis sizes alone."""
    axes = axes_by_rules(names, rules)
    return tuple(n if a is None else n // sizes[a] for n, a in zip(shape, axes, strict=True))


@functools.cache
def planned(names, shape, rules, batch, donate):
    mesh = jax.sharding.AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    params, x = arguments(batch)
    kwargs = {"donate_argnums": 0} if donate else {}
    return st.preflight(step, params, x, mesh=mesh, rules=list(rules), **kwargs)


@examples(20)
@given(cases())
def test_each_argument_is_traced_as_its_shard_from_the_mesh_sizes(case):
    names, shape, rules, batch, _ = case
    plan = planned(*case)
    sizes = dict(zip(names, shape, strict=True))
    leaves = {
        "args[0]/w1": ((WIDTH, HIDDEN), ("embed", "mlp")),
        "args[0]/w2": ((HIDDEN,), ("mlp",)),
        "args[1]": ((batch, WIDTH), ("batch", "embed")),
    }
    assert len(plan.inputs.rows) == 3
    got = sorted(row.shard_shape for row in plan.inputs.rows)
    assert got == sorted(shard(s, n, rules, sizes) for s, n in leaves.values())
    bytes_ = sum(4 * math.prod(shard(s, n, rules, sizes)) for s, n in leaves.values())
    assert plan.argument_bytes == bytes_


@examples(12)
@given(cases())
def test_the_traced_step_compiles_as_the_raw_program_of_the_same_shardings(case):
    names, shape, rules, batch, donate = case
    plan = planned(*case)
    sizes = dict(zip(names, shape, strict=True))
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))

    def raw(shape_, leaf_names):
        return jax.ShapeDtypeStruct(
            shape_, jnp.float32, sharding=NamedSharding(mesh, P(*axes_by_rules(leaf_names, rules)))
        )

    params = {"w1": raw((WIDTH, HIDDEN), ("embed", "mlp")), "w2": raw((HIDDEN,), ("mlp",))}
    x = raw((batch, WIDTH), ("batch", "embed"))

    def bare(params, x):
        h = jnp.tanh(x @ params["w1"])
        return jax.tree.map(lambda p: p * jnp.mean(h), params)

    jitted = jax.jit(bare, donate_argnums=0 if donate else ())
    compiled = jitted.lower(params, x).compile().memory_analysis()
    assert plan.argument_bytes == compiled.argument_size_in_bytes
    assert plan.output_bytes == compiled.output_size_in_bytes
    assert plan.alias_bytes == compiled.alias_size_in_bytes
    shard_w = math.prod(shard((WIDTH, HIDDEN), ("embed", "mlp"), rules, sizes))
    shard_b = math.prod(shard((HIDDEN,), ("mlp",), rules, sizes))
    assert plan.alias_bytes == (4 * (shard_w + shard_b) if donate else 0)
