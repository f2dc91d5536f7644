"""Real rule sets, as their projects wrote them, resolve as those projects resolve them.

MaxText: base.yml's 76 rules and its custom rule files, the logical names its
layers give params and activations, and the shardings MaxText itself recorded,
against flax's `logical_to_mesh_axes` (what MaxText calls). EasyLM: its LLaMA
`get_partition_rules` applied literally, `st.box(state, st.match(rules))`, on
its whole train state, against EasyLM's own `match_partition_rules`. The data
and where it came from: tests/real_rule_sets.py. Nothing here compiles.

spmdtree is shape-aware (a dimension its axes do not divide falls through to
the next rule); every mesh here divides what flax gives, which the tests
check first, so "equal to flax" is the whole claim. A real rule set is never
refused and never warned about.
"""

import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import real_rule_sets as R
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st


def abstract_mesh(axes, sizes):
    """An AbstractMesh over `axes`, sizes 1 except those given (Auto axes, as MaxText's)."""
    shape = tuple(sizes.get(axis, 1) for axis in axes)
    return jax.sharding.AbstractMesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def real_mesh(axes, sizes):
    """A Mesh of this process's 8 CPU devices over `axes`."""
    shape = tuple(sizes.get(axis, 1) for axis in axes)
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def entries(spec, ndim):
    """A spec's entries padded to `ndim`, each as a tuple of mesh axes (as JAX reads it)."""
    padded = [*spec, *[None] * (ndim - len(spec))]
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in padded)


def divides(spec, shape, mesh):
    return all(
        size % math.prod(mesh.shape[a] for a in axes) == 0
        for size, axes in zip(shape, entries(spec, len(shape)), strict=True)
    )


def unsharded_warnings(caught):
    return [w for w in caught if type(w.message).__name__ == "UnshardedWarning"]


def sharded(tree, mesh, rules):
    """`st.to_sharding`, with every warning it gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = st.to_sharding(tree, mesh, rules)
    return out, unsharded_warnings(caught)


def boxes(leaves):
    """{path: LogicallyPartitioned over a ShapeDtypeStruct} for (path, shape, names) leaves."""
    return {
        "/".join(path): st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.bfloat16), names)
        for path, shape, names in leaves
    }


# --- MaxText: what it recorded ----------------------------------------------------------

RECORDED = {
    directory: (model, name, sizes, specs)
    for model, directory, name, sizes, specs in R.MAXTEXT_RECORDED
}


def test_the_data_is_maxtexts_own():
    assert len(R.MAXTEXT_RULES) == 76 and len(R.MAXTEXT_MESH_AXES) == 12
    assert len(R.MAXTEXT_RULE_SETS) == 7 and len(RECORDED) == 11
    for model, name, _, specs in RECORDED.values():  # flax reproduces every recorded spec
        rules = R.MAXTEXT_RULE_SETS[name][1]
        for (path, _, names), spec in zip(R.MAXTEXT_RECORDED_PARAMS[model], specs, strict=True):
            assert nn.logical_to_mesh_axes(names, rules) == P(*spec), path


def dump_id(directory):
    model, name, sizes, _ = RECORDED[directory]
    return f"{model} {directory.split('/')[1]} {name} " + "x".join(
        f"{a}{n}" for a, n in sizes.items()
    )


@pytest.mark.parametrize("directory", list(RECORDED), ids=dump_id)
def test_params_shard_as_maxtext_recorded(directory):
    model, name, sizes, specs = RECORDED[directory]
    axes, rules = R.MAXTEXT_RULE_SETS[name]
    mesh = abstract_mesh(axes, sizes)
    leaves = R.MAXTEXT_RECORDED_PARAMS[model]
    out, warned = sharded(boxes(leaves), mesh, rules)
    for (path, shape, _), spec in zip(leaves, specs, strict=True):
        assert divides(P(*spec), shape, mesh), path  # MaxText ran it: its specs divide
        assert out["/".join(path)].spec == P(*spec), path
    assert warned == []


# --- MaxText: its models' params and activations, on meshes of its axes ---------------

MESHES = {
    "8 cpu devices, fsdp 4 x tensor 2": {"fsdp": 4, "tensor": 2},
    "256, data 2 x fsdp 16 x tensor 8": {"data": 2, "fsdp": 16, "tensor": 8},
    "256, fsdp 8 x expert 8 x tensor 4": {"fsdp": 8, "expert": 8, "tensor": 4},
    "256, stage 4 x fsdp 8 x context 2 x tensor 2 x tensor_sequence 2": {
        "stage": 4,
        "fsdp": 8,
        "context": 2,
        "tensor": 2,
        "tensor_sequence": 2,
    },
    "2048, data 8 x fsdp 32 x tensor 8": {"data": 8, "fsdp": 32, "tensor": 8},
}


def mesh_named(label):
    make = real_mesh if label.startswith("8 cpu") else abstract_mesh
    return make(R.MAXTEXT_MESH_AXES, MESHES[label])


def model_leaves(templates, config):
    return [
        (path, tuple(config[size] for size in shape), names) for path, names, shape in templates
    ]


def model_activations(templates, config):
    return [(names, tuple(config[size] for size in shape)) for names, shape in templates]


@pytest.mark.parametrize("label", list(MESHES))
@pytest.mark.parametrize("model", list(R.MAXTEXT_MODELS))
def test_model_params_shard_as_flax(model, label):
    config, mesh = R.MAXTEXT_MODELS[model], mesh_named(label)
    leaves = model_leaves(R.MAXTEXT_MODEL_PARTS[model][0], config)
    out, warned = sharded(boxes(leaves), mesh, R.MAXTEXT_RULES)  # params: one call
    for path, shape, names in leaves:
        theirs = nn.logical_to_mesh_axes(names, R.MAXTEXT_RULES)
        assert divides(theirs, shape, mesh), (path, theirs)
        assert out["/".join(path)].spec == theirs, path
    assert warned == []


@pytest.mark.parametrize("label", list(MESHES))
@pytest.mark.parametrize("model", list(R.MAXTEXT_MODELS))
def test_model_activations_shard_as_flax(model, label):
    config, mesh = R.MAXTEXT_MODELS[model], mesh_named(label)
    for names, shape in model_activations(R.MAXTEXT_MODEL_PARTS[model][1], config):
        theirs = nn.logical_to_mesh_axes(names, R.MAXTEXT_RULES)
        assert divides(theirs, shape, mesh), (names, theirs)
        value = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        with warnings.catch_warnings(record=True) as caught:  # one activation per call,
            warnings.simplefilter("always")  # as a layer constrains it
            box = st.to_sharding(st.LogicallyPartitioned(value, names), mesh, R.MAXTEXT_RULES)
            spec = st.logical_to_mesh_axes(names, R.MAXTEXT_RULES, shape=shape, mesh=mesh)
        assert box.spec == theirs and spec == theirs, names
        assert unsharded_warnings(caught) == []


@pytest.mark.parametrize("model", list(R.MAXTEXT_MODELS))
def test_activation_constraints_inside_jit_are_flaxs(model):
    """with_logical_constraint, traced on the real mesh: the constraint JAX records."""
    config, mesh = R.MAXTEXT_MODELS[model], mesh_named("8 cpu devices, fsdp 4 x tensor 2")
    small = {**config, "batch": 8, "length": 16, "capacity": 4}  # traced, never run
    for names, shape in model_activations(R.MAXTEXT_MODEL_PARTS[model][1], small):
        assert divides(nn.logical_to_mesh_axes(names, R.MAXTEXT_RULES), shape, mesh), names
        jaxpr = jax.make_jaxpr(
            lambda x, names=names: st.with_logical_constraint(x, names, R.MAXTEXT_RULES, mesh)
        )(jax.ShapeDtypeStruct(shape, jnp.bfloat16))
        [constraint] = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
        theirs = nn.logical_to_mesh_sharding(P(*names), mesh, R.MAXTEXT_RULES)
        assert constraint.params["sharding"].is_equivalent_to(theirs, len(shape)), names


# --- EasyLM: its rules, literally, on its whole train state ----------------------------


def easylm_path(path):
    """EasyLM/jax_utils.py's tree_path_to_string(path, sep='/')."""
    keys = []
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            keys.append(str(key.idx))
        elif isinstance(key, jax.tree_util.DictKey):
            keys.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            keys.append(str(key.name))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            keys.append(str(key.key))
        else:
            keys.append(str(key))
    return "/".join(keys)


def easylm_match_partition_rules(rules, tree):
    """EasyLM/jax_utils.py's match_partition_rules: first re.search wins; scalars PS()."""

    def spec(path, leaf):
        if len(leaf.shape) == 0 or np.prod(leaf.shape) == 1:
            return P()
        for rule, ps in rules:
            if re.search(rule, easylm_path(path)) is not None:
                return ps
        raise ValueError(f"Partition rule not found for param: {easylm_path(path)}")

    return jax.tree_util.tree_map_with_path(spec, tree)


def easylm_params(config):
    """A LLaMA's params as EasyLM's flax modules name them, as ShapeDtypeStructs."""
    tree: dict = {}
    blocks = [
        (("transformer", "h", str(i), *path), shape)
        for i in range(config["num_hidden_layers"])
        for path, shape in R.EASYLM_BLOCK_PARAMS
    ]
    for path, shape in [*R.EASYLM_OUTER_PARAMS, *blocks]:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.ShapeDtypeStruct(tuple(config[s] for s in shape), jnp.float32)
    return {"params": tree}


def easylm_state():
    """EasyLM's llama_train.py train state: TrainState over clip + adamw on a schedule."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000, 3e-5)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=0.1, b1=0.9, b2=0.95, mask=None, mu_dtype=jnp.float32),
    )
    return jax.eval_shape(
        lambda p: train_state.TrainState.create(params=p, tx=tx, apply_fn=None),
        easylm_params(R.EASYLM_CONFIG),
    )


EASYLM_MESHES = {
    "8 cpu devices, 2x2x2": (2, 2, 2),
    "256, 1x32x8": (1, 32, 8),
    "2048, 8x32x8": (8, 32, 8),
}


@pytest.mark.parametrize("label", list(EASYLM_MESHES))
def test_easylm_rules_literally_on_its_train_state(label):
    shape = EASYLM_MESHES[label]
    auto = (AxisType.Auto,) * 3
    mesh = (
        jax.make_mesh(shape, R.EASYLM_MESH_AXES, axis_types=auto)
        if label.startswith("8 cpu")
        else jax.sharding.AbstractMesh(shape, R.EASYLM_MESH_AXES, axis_types=auto)
    )
    state = easylm_state()
    theirs = easylm_match_partition_rules(R.EASYLM_RULES, state)
    boxed = st.box(state, st.match(R.EASYLM_RULES))  # the rules as EasyLM wrote them
    out, warned = sharded(boxed, mesh, None)
    leaves = jax.tree.leaves(state)
    ours = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, NamedSharding))
    theirs = jax.tree.leaves(theirs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(ours) == len(theirs) > 40  # params, mu, nu, step, counts
    for leaf, mine, spec in zip(leaves, ours, theirs, strict=True):
        assert entries(mine.spec, leaf.ndim) == entries(spec, leaf.ndim), (leaf, spec)
        assert mine.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)
    assert warned == []


def test_easylms_catch_all_reads_as_jax_reads_it():
    """('.*', PS(None)) on a 2-D leaf EasyLM's other rules miss: replicated, as JAX has it."""
    mesh = jax.make_mesh((2, 2, 2), R.EASYLM_MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    tree = {"lora": {"a": jax.ShapeDtypeStruct((128, 8), jnp.float32)}, "scale": jnp.float32(1)}
    boxed = st.box(tree, st.match(R.EASYLM_RULES))
    assert boxed["lora"]["a"].names == (None, None)  # stored padded to the rank
    out = st.to_sharding(boxed, mesh)
    assert out["lora"]["a"].is_equivalent_to(NamedSharding(mesh, P(None)), 2)
    assert out["scale"].is_equivalent_to(NamedSharding(mesh, P()), 0)
