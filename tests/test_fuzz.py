"""Fuzzing: random trees, names, rules and meshes give exactly the right sharding or the right error.

Every result is checked against an independent reference written from the
SPEC's words (`reference_spec`): the priority algorithm with the mesh veto
(an axis not in the mesh is an error, an indivisible dimension falls through
to the next rule), rank checks and strictness. `to_sharding` must return the
reference's spec for every leaf, and shardings that `jax.device_put` accepts;
where the reference says a leaf is wrong, the call must raise a
ValueError/TypeError whose message is spmdtree's (it starts with the
function's name). The same for `with_logical_constraint` inside `jax.jit`.
Never another exception type, and never an error from inside JAX.

The strategies lean towards meshes and shapes that do shard (sizes 2, 4 and 8
on meshes of 2, 4 and 8 devices), so that a sharded dimension is common.
"""

import math
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

U = P.UNCONSTRAINED
MESH_SHAPES = [
    ((2, 4), ("a", "b")),
    ((4, 2), ("b", "a")),
    ((2, 2, 2), ("a", "b", "c")),
    ((2, 4), ("a", "b")),
    ((8,), ("a",)),  # a mesh without "b": rules naming it are wrong here
]
AXES = ["a", "b", "c", "z"]  # "z" is in no mesh; "c" only in the 3-D one
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
        hst.sampled_from(names_pool),
        hst.sampled_from(names_pool),
        hst.none(),
        hst.lists(hst.sampled_from(AXES), min_size=0, max_size=2).map(tuple),  # may repeat an axis
        hst.just(U),
    )


mesh_axes = hst.one_of(
    hst.sampled_from(["a", "b"]),
    hst.sampled_from(AXES),
    hst.none(),
    hst.lists(hst.sampled_from(AXES), min_size=1, max_size=2).map(tuple),  # may repeat one
    hst.just(U),
)
well_formed = hst.lists(hst.tuples(hst.sampled_from(LOGICAL), mesh_axes), max_size=6)
malformed = hst.lists(
    hst.tuples(hst.sampled_from(LOGICAL), hst.integers(0, 3)), min_size=1, max_size=2
)
# Every logical name mapped to an axis every mesh has: these rules shard.
covering = hst.permutations(LOGICAL).flatmap(
    lambda order: hst.tuples(
        *(hst.tuples(hst.just(n), hst.sampled_from(["a", "b", ("b", "a"), "b"])) for n in order)
    ).map(list)
)
rule_sets = hst.one_of(covering, well_formed, covering, hst.none(), malformed)
# Mostly sizes the mesh axes divide, sometimes ones they do not.
sizes_drawn = hst.sampled_from([2, 4, 8, 8, 1, 3, 6])
shapes = hst.one_of(
    hst.lists(sizes_drawn, min_size=1, max_size=3), hst.lists(sizes_drawn, max_size=3)
).map(tuple)


@hst.composite
def arrays(draw):
    shape = draw(shapes)
    kind = draw(hst.sampled_from(["numpy", "jax", "abstract", "abstract", "abstract", "python"]))
    if kind == "python":
        return 1.5
    if kind == "abstract":
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return jnp.asarray(value) if kind == "jax" else value


def unchecked(cls, value, names, **meta):
    """A box of `value` under `names` of any length: built for a value of the
    names' rank, then given `value` (replace_boxed does not validate)."""
    return cls(jax.ShapeDtypeStruct((1,) * len(names), jnp.float32), names, **meta).replace_boxed(
        value
    )


@hst.composite
def leaves(draw):
    value = draw(arrays())
    choice = draw(
        hst.sampled_from(
            [
                "plain",
                "partitioned",
                "partitioned",
                "logical",
                "logical",
                "logical-own-rules",
                "none",
            ]
        )
    )
    if choice == "plain":
        return value
    if choice == "none":
        return None
    ndim = len(np.shape(value))
    count = max(0, ndim + draw(hst.sampled_from([0, 0, 0, 0, 0, 0, -1, 1])))  # sometimes wrong
    pool = AXES if choice == "partitioned" else LOGICAL
    if draw(hst.booleans()):  # distinct names, as real boxes mostly have
        distinct = draw(hst.permutations(["a", "b", None] if choice == "partitioned" else pool))
        names = tuple(distinct[:count]) + (None,) * max(0, count - len(distinct))
    else:
        names = tuple(draw(axis_entries(pool)) for _ in range(count))
    if choice == "partitioned":
        return unchecked(st.Partitioned, value, names)
    rules = draw(rule_sets) if choice == "logical-own-rules" else None
    try:
        return unchecked(st.LogicallyPartitioned, value, names, rules=rules)
    except (TypeError, ValueError):  # malformed own rules are refused when built
        return unchecked(st.LogicallyPartitioned, value, names)


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


# --- the reference ------------------------------------------------------------------


class Wrong(Exception):
    """The reference's verdict: this input is a mistake of the given kind."""

    def __init__(self, kind):
        super().__init__(kind.__name__)
        self.kind = kind


def axes_of(entry):
    if isinstance(entry, str):
        return (entry,)
    return entry if isinstance(entry, tuple) else ()


def reference_rules(rules):
    """Rules as the SPEC says they must be given, or Wrong."""
    if rules is None:
        return ()
    out = []
    for logical, target in rules:
        if not (target is None or target is U or isinstance(target, (str, tuple))):
            raise Wrong(TypeError)
        if isinstance(target, tuple) and len(set(target)) != len(target):
            raise Wrong(ValueError)
        out.append((logical, target))
    return out


def axis_sizes(sizes, axes):
    return math.prod(sizes.get(a, 1) for a in axes)


def check_literal(entries, shape, sizes, strict):
    """Mesh-axis entries: known axes, each used once; an indivisible one left unsharded."""
    used = [a for entry in entries for a in axes_of(entry)]
    if any(a not in sizes for a in used) or len(used) != len(set(used)):
        raise Wrong(ValueError)
    out = []
    for dim, entry in zip(shape, entries, strict=True):
        if dim % axis_sizes(sizes, axes_of(entry)):
            if strict and dim != 1:  # strict refuses what UnshardedWarning warns of (0.4)
                raise Wrong(ValueError)
            entry = None
        out.append(entry)
    return out


def reference_spec(names, shape, logical, rules, sizes, strict):
    """The spec of one array: names -> mesh axes by the SPEC's words, or Wrong."""
    return reference(names, shape, logical, rules, sizes, strict)[0]


def reference(names, shape, logical, rules, sizes, strict):
    """(spec, logical names no rule mapped) of one array, or Wrong.

    `sizes` None: no mesh, so nothing about the mesh or the shape is checked.
    """
    if sizes is None:
        strs = [n for n in names if isinstance(n, str)]
        if len(strs) != len(set(strs)):
            raise Wrong(ValueError)
        return reference(names, (1,) * len(names), logical, rules, {}, False)
    if logical and sizes:
        mentioned_checks(names, rules, sizes, strict)
    if len(shape) != len(names):
        if all(d == 1 for d in shape):
            return (), ()  # a size-1 placeholder: replicated
        if not all(n is None for n in names):
            raise Wrong(ValueError)
        names = (None,) * len(shape)  # all None: replicated at any rank, as JAX reads it (0.3)
    if not logical:
        return tuple(check_literal(names, shape, sizes, strict)), ()
    strs = [n for n in names if isinstance(n, str)]
    if len(strs) != len(set(strs)):
        raise Wrong(ValueError)
    chosen, passed = {}, set()
    taken = {a for n in names if isinstance(n, tuple) for a in n}
    for logical_name, target in rules:
        if logical_name not in strs or logical_name in chosen:
            continue
        wanted = axes_of(target)
        if sizes and any(a not in sizes for a in wanted):
            raise Wrong(ValueError)  # a typo (or an axis of another mesh) is never skipped
        dim = shape[names.index(logical_name)]
        if set(wanted) & taken:
            continue
        if dim % axis_sizes(sizes, wanted):
            if dim != 1:  # a size-1 dimension is not warned of, nor refused (0.4)
                passed.add(logical_name)
            continue
        chosen[logical_name] = target
        taken |= set(wanted)
    if strict and passed - set(chosen):
        raise Wrong(ValueError)
    literal = [n if isinstance(n, tuple) else None for n in names]
    if sizes:
        literal = check_literal(literal, shape, sizes, strict)
    spec = tuple(
        lit if isinstance(n, tuple) else chosen.get(n) if isinstance(n, str) else n
        for n, lit in zip(names, literal, strict=True)
    )
    return spec, tuple(n for n in strs if n not in chosen)


def mentioned_checks(names, rules, sizes, strict):
    """Logical names read with no rules at all, or that no rule mentions and are
    mesh axes, are mistakes; under strict, so is any name no rule mentions."""
    strs = [n for n in names if isinstance(n, str)]
    unmentioned = [n for n in strs if n not in {name for name, _ in rules}]
    if strs and not rules:
        raise Wrong(ValueError)
    if any(n in sizes for n in unmentioned) or (strict and unmentioned):
        raise Wrong(ValueError)


def normal(spec, ndim):
    """A spec as comparable tuples: None/()/UNCONSTRAINED -> (), padded to `ndim`."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(() if e is None or e is U else axes_of(e) for e in entries)


def is_ours(error: Exception, *functions: str) -> bool:
    return type(error) in (TypeError, ValueError) and str(error).startswith(
        tuple(f"{f}: " for f in functions)
    )


def expected_shardings(tree, mesh, rules, strict):
    """[(leaf, expected normal spec)] for every array leaf, or Wrong for the call."""
    call_rules = reference_rules(rules)
    sizes = dict(mesh.shape)
    out, wrong = [], []
    for leaf in jax.tree.leaves(tree, is_leaf=st.is_boxed):
        if st.is_boxed(leaf):
            shape = np.shape(leaf.value)
            own = getattr(leaf, "rules", None)
            logical = isinstance(leaf, st.LogicallyPartitioned)
            try:
                spec = reference_spec(
                    leaf.names,
                    shape,
                    logical,
                    own if own is not None else call_rules,
                    sizes,
                    strict,
                )
                out.append((leaf.value, normal(spec, len(shape))))
                SHARDED.append(any(normal(spec, len(shape))))
            except Wrong as w:
                wrong.append(w.kind)
        elif leaf is not None:
            out.append((leaf, normal((), len(np.shape(leaf)))))
    if wrong:
        raise Wrong(wrong[0] if len(set(wrong)) == 1 else ValueError)
    return out


def check_placeable(sharding, subtree) -> None:
    """Every array under a sharding can be put on it (or, abstract, sharded by it)."""
    for leaf in jax.tree.leaves(subtree):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            sharding.shard_shape(leaf.shape)  # raises if the dimensions do not divide
        else:
            placed = jax.device_put(leaf, sharding)
            np.testing.assert_array_equal(np.asarray(placed), np.asarray(leaf))


SHARDED = []  # per boxed leaf fuzzed: whether it has a sharded dimension (see the last test)


@settings(max_examples=200)
@given(tree=trees, mesh=meshes(), rules=rule_sets, strict=hst.booleans())
def test_to_sharding_equals_the_reference_or_is_the_right_error(tree, mesh, rules, strict):
    try:
        expected = expected_shardings(tree, mesh, rules, strict)
    except Wrong as wrong:
        with pytest.raises((TypeError, ValueError)) as info:
            st.to_sharding(tree, mesh, rules, strict=strict)
        assert is_ours(info.value, "to_sharding"), repr(info.value)
        assert type(info.value) is wrong.kind, (repr(info.value), wrong.kind)
        return
    shardings = st.to_sharding(tree, mesh, rules, strict=strict)
    flat = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    assert len(flat) == len(expected)
    for sharding, (value, spec) in zip(flat, expected, strict=True):
        assert normal(sharding.spec, len(np.shape(value))) == spec, (sharding.spec, spec)
        check_placeable(sharding, value)


@hst.composite
def sharding_boxes(draw):
    """One box of full rank whose names every mesh knows: these mostly shard."""
    shape = tuple(draw(hst.lists(sizes_drawn, min_size=1, max_size=3)))
    logical = draw(hst.booleans())
    pool = LOGICAL if logical else ["a", "b", None]
    names = tuple(draw(hst.permutations(pool))[: len(shape)])
    names += (None,) * (len(shape) - len(names))
    cls = st.LogicallyPartitioned if logical else st.Partitioned
    return cls(jax.ShapeDtypeStruct(shape, jnp.float32), names)


@settings(max_examples=150)
@given(box=sharding_boxes(), mesh=meshes(), rules=covering, strict=hst.booleans())
def test_one_sharding_box_equals_the_reference(box, mesh, rules, strict):
    test_to_sharding_equals_the_reference_or_is_the_right_error.hypothesis.inner_test(
        {"w": box}, mesh, rules, strict
    )


@settings(max_examples=80)
@given(
    shape=shapes,
    names=hst.lists(axis_entries(LOGICAL + AXES), max_size=4).map(tuple),
    mesh=meshes(),
    rules=rule_sets,
    fallback=hst.sampled_from(list(st.RulesFallback)),
)
def test_with_logical_constraint_in_jit_equals_the_reference_or_is_the_right_error(
    shape, names, mesh, rules, fallback
):
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    # A PartitionSpec: a plain tuple with tuple entries would be a tree of specs. (A
    # PartitionSpec stores a 1-tuple entry as its str, which is then a logical name.)
    names = tuple(P(*names))

    @jax.jit
    def f(x):
        return st.with_logical_constraint(x * 2, P(*names), rules, mesh, fallback)

    try:
        call_rules = reference_rules(rules)
        if len(names) > len(shape):
            raise Wrong(ValueError)
        padded = names + (None,) * (len(shape) - len(names))
        mentioned_checks(padded, call_rules, dict(mesh.shape), False)  # a mesh is in effect
        sizes = dict(mesh.shape) if call_rules else None  # no rules: nothing constrained
        spec, unmatched = reference(padded, shape, True, call_rules, sizes, False)
        if unmatched and fallback is st.RulesFallback.RAISE_ERROR:
            raise Wrong(ValueError)
    except Wrong as wrong:
        with pytest.raises((TypeError, ValueError)) as info, jax.set_mesh(mesh):
            f(x)
        assert is_ours(info.value, "with_logical_constraint"), repr(info.value)
        assert type(info.value) is wrong.kind, (repr(info.value), wrong.kind)
        return
    with jax.set_mesh(mesh):
        out = f(x)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
    constrained = call_rules and not (unmatched and fallback is st.RulesFallback.NO_CONSTRAINT)
    if constrained and U not in spec:
        assert normal(out.sharding.spec, len(shape)) == normal(spec, len(shape))
        SHARDED.append(any(normal(spec, len(shape))))


@pytest.mark.parametrize("function", ["to_spec", "describe", "plan"])
@settings(max_examples=40)
@given(tree=trees, mesh=meshes(), rules=rule_sets)
def test_other_tree_functions_raise_only_clear_errors(function, tree, mesh, rules):
    try:
        getattr(st, function)(tree, mesh=mesh, rules=rules)
    except Exception as error:
        assert is_ours(error, function), repr(error)


def test_the_fuzzing_above_sharded_often():
    # Guards the strategies: a fuzzer that never shards cannot catch a wrong sharding.
    if len(SHARDED) < 50:
        pytest.skip("run with the fuzz tests above")
    assert sum(SHARDED) / len(SHARDED) > 0.25, (sum(SHARDED), len(SHARDED))
