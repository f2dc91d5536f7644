"""Every number against an independent oracle: JAX itself.

Random trees (dtypes from bool to f32, size-1 and indivisible dimensions,
mesh-axis and logical boxes, UNCONSTRAINED, mesh-axis tuples) on random meshes
(real ones with permuted device orders, abstract ones) are planned, and every
`PlanRow` field and every `Plan`/`PlanDiff` total is recomputed from JAX's own
answers: `NamedSharding.shard_shape`, `devices_indices_map`, and the shards of
arrays placed with `jax.device_put`. Constraints are checked against
`jax.lax.with_sharding_constraint`/`jax.sharding.reshard` with specs written
from `logical_to_mesh_axes`; every metadata field is followed through every
path that builds or rebuilds a box.
"""

import math
import pickle

import flax.linen as nn
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
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_, jnp.int32]
LOGICAL = ["batch", "embed", "mlp", "heads"]


@hst.composite
def meshes(draw):
    shape, names = draw(
        hst.sampled_from(
            [
                ((2, 4), ("a", "b")),
                ((4, 2), ("a", "b")),
                ((2, 2, 2), ("a", "b", "c")),
                ((8,), ("a",)),
            ]
        )
    )
    if draw(hst.booleans()):
        return jax.sharding.AbstractMesh(shape, names)
    order = draw(hst.permutations(range(8)))
    devices = np.array(jax.devices())[list(order)].reshape(shape)
    kind = draw(hst.sampled_from([AxisType.Auto, AxisType.Explicit]))
    return jax.sharding.Mesh(devices, names, axis_types=(kind,) * len(names))


def _axes(mesh):
    return list(mesh.axis_names)


@hst.composite
def boxes(draw, mesh):
    """A box whose names are valid on `mesh` (its resolution may still fall back)."""
    shape = tuple(draw(hst.lists(hst.sampled_from([1, 2, 3, 4, 6, 8]), min_size=0, max_size=3)))
    dtype = draw(hst.sampled_from(DTYPES))
    value = jax.ShapeDtypeStruct(shape, dtype)
    free = draw(hst.permutations(_axes(mesh)))
    if draw(hst.booleans()):  # mesh-axis names: each axis at most once
        names, pool = [], list(free)
        for _ in shape:
            pick = draw(hst.sampled_from(["one", "tuple", "none", "unconstrained"]))
            if pick == "one" and pool:
                names.append(pool.pop())
            elif pick == "tuple" and len(pool) >= 2:
                names.append((pool.pop(), pool.pop()))
            else:
                names.append(U if pick == "unconstrained" else None)
        return st.Partitioned(value, tuple(names))
    names = draw(hst.permutations(LOGICAL))[: len(shape)]
    return st.LogicallyPartitioned(value, tuple(names))


@hst.composite
def rule_sets(draw, mesh):
    axes = _axes(mesh)
    target = hst.one_of(
        hst.sampled_from(axes),
        hst.permutations(axes).map(lambda p: tuple(p[:2])),
        hst.none(),
    )
    rules = draw(hst.lists(hst.tuples(hst.sampled_from(LOGICAL), target), max_size=6))
    mentioned = {name for name, _ in rules}
    return rules + [(name, None) for name in LOGICAL if name not in mentioned]


@hst.composite
def cases(draw):
    mesh = draw(meshes())
    tree = {f"x{i}": draw(boxes(mesh)) for i in range(draw(hst.integers(1, 4)))}
    if draw(hst.booleans()):
        tree["plain"] = jax.ShapeDtypeStruct((4, 2), draw(hst.sampled_from(DTYPES)))
    return mesh, tree, draw(rule_sets(mesh))


def concrete(mesh):
    """`mesh` itself, or for an abstract mesh the CPU devices in row-major order
    (the devices a plan of an abstract mesh stands for, by position)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    devices = np.array(jax.devices()[: math.prod(mesh.axis_sizes)]).reshape(mesh.axis_sizes)
    return jax.sharding.Mesh(devices, mesh.axis_names)


def _nosharding(spec):
    return P(*(None if e is U else e for e in spec))


def per_device(sharding, shape, itemsize):
    """{device id: bytes it holds of an array}, from JAX's own index map."""
    out = {}
    for device, index in sharding.devices_indices_map(shape).items():
        sizes = [len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)]
        out[device.id] = math.prod(sizes) * itemsize
    return out


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=st.is_boxed)


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_every_plan_figure_equals_jax_own(case):
    mesh, tree, rules = case
    planned = st.plan(tree, mesh, rules)
    real = concrete(mesh)
    specs = st.to_spec(tree, rules, mesh=mesh)
    totals: dict[int, int] = {}
    replicated = 0
    assert [row.path for row in planned.rows] == sorted(tree)
    for row, leaf in zip(planned.rows, _leaves(tree), strict=True):
        value = leaf.value if st.is_boxed(leaf) else leaf
        itemsize = np.dtype(value.dtype).itemsize
        sharding = NamedSharding(real, _nosharding(specs[row.path]))
        assert row.shape == value.shape and row.dtype == np.dtype(value.dtype)
        assert row.names == (leaf.names if st.is_boxed(leaf) else None)
        assert row.spec == specs[row.path]
        assert row.shard_shape == sharding.shard_shape(value.shape)
        assert row.bytes == math.prod(value.shape) * itemsize
        assert row.device_bytes == math.prod(row.shard_shape) * itemsize
        assert len(row.why) == len(value.shape)
        for device, held in per_device(sharding, value.shape, itemsize).items():
            totals[device] = totals.get(device, 0) + held
        if sharding.is_fully_replicated:
            replicated += row.bytes
    assert planned.total_bytes == sum(row.bytes for row in planned.rows)
    assert planned.device_bytes == max(totals.values())
    assert planned.replicated_bytes == replicated
    assert planned.mesh == mesh
    budget = planned.device_bytes
    assert planned.fits(budget) and planned.fits(budget + 1) and not planned.fits(budget - 1)
    described = {
        b: st.describe(tree, mesh, rules, budget=b).split("budget")[1].splitlines()[0]
        for b in (budget - 1, budget, budget + 1)
    }
    assert "fits, 0 B to spare" in described[budget]
    assert "fits, 1 B to spare" in described[budget + 1]
    assert "does not fit: 1 B over" in described[budget - 1]


def test_placed_arrays_hold_what_the_plan_says():
    devices = np.array(jax.devices())[[3, 1, 0, 2, 7, 5, 4, 6]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    rules = [("embed", ("b", "a")), ("mlp", None)]
    tree = {
        "w": st.LogicallyPartitioned(jnp.ones((8, 6), jnp.bfloat16), ("embed", "mlp")),
        "m": st.Partitioned(jnp.ones((2, 4), jnp.int8), ("a", "b")),
        "u": st.Partitioned(jnp.ones((4, 3)), (U, None)),
    }
    planned = st.plan(tree, mesh, rules)
    placed = st.shard(tree, mesh, rules)
    for row in planned.rows:
        array = placed[row.path].value
        assert {shard.data.nbytes for shard in array.addressable_shards} == {row.device_bytes}
        assert array.addressable_shards[0].data.shape == row.shard_shape
    held: dict[int, int] = {}
    for box in placed.values():
        for shard in box.value.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    assert planned.device_bytes == max(held.values())


@hst.composite
def diff_cases(draw):
    mesh_a, tree, rules_a = draw(cases())
    same_shape = draw(hst.booleans())
    if same_shape and isinstance(mesh_a, jax.sharding.Mesh):  # same shape, other devices
        order = draw(hst.permutations(range(8)))
        devices = np.array(jax.devices())[list(order)].reshape(mesh_a.axis_sizes)
        mesh_b = jax.sharding.Mesh(devices, mesh_a.axis_names)
    else:
        mesh_b = draw(meshes().filter(lambda m: set(m.axis_names) >= set(mesh_a.axis_names)))
    return mesh_a, mesh_b, tree, rules_a, draw(rule_sets(mesh_b))


def _device_keys(mesh):
    if isinstance(mesh, jax.sharding.Mesh):
        return {d.id: d.id for d in mesh.devices.flat}
    return {i: i for i in range(math.prod(mesh.axis_sizes))}


def received(old_mesh, old_spec, new_mesh, new_spec, shape, itemsize):
    """{new device: bytes of its new shard it did not hold}, from index maps."""
    new = NamedSharding(concrete(new_mesh), _nosharding(new_spec)).devices_indices_map(shape)
    old = (
        {}
        if old_spec is None
        else dict(
            NamedSharding(concrete(old_mesh), _nosharding(old_spec)).devices_indices_map(shape)
        )
    )
    old_by_key = {d.id: index for d, index in old.items()}
    out = {}
    for device, index in new.items():
        want = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
        had = old_by_key.get(device.id)
        overlap = 0
        if had is not None:
            have = [range(*s.indices(n)) for s, n in zip(had, shape, strict=True)]
            overlap = math.prod(
                max(0, min(w.stop, h.stop) - max(w.start, h.start))
                for w, h in zip(want, have, strict=True)
            )
        out[device.id] = (math.prod(len(w) for w in want) - overlap) * itemsize
    return out


@settings(max_examples=40, deadline=None)
@given(case=diff_cases())
def test_every_diff_figure_equals_jax_own(case):
    mesh_a, mesh_b, tree, rules_a, rules_b = case
    before, after = st.plan(tree, mesh_a, rules_a), st.plan(tree, mesh_b, rules_b)
    diff = before.diff(after)
    totals: dict[int, int] = {}
    rows = {row.path: row for row in diff.rows}
    for old, new in zip(before.rows, after.rows, strict=True):
        got = received(mesh_a, old.spec, mesh_b, new.spec, new.shape, new.dtype.itemsize)
        same = old.spec == new.spec and mesh_a == mesh_b and old.device_bytes == new.device_bytes
        if same:
            assert new.path not in rows and not any(got.values())
            continue
        assert rows[new.path].received_bytes == max(got.values())
        assert rows[new.path].device_bytes_before == old.device_bytes
        assert rows[new.path].device_bytes_after == new.device_bytes
        for device, count in got.items():
            totals[device] = totals.get(device, 0) + count
    assert diff.received_bytes == max(totals.values(), default=0)
    assert diff.device_bytes_before == before.device_bytes
    assert diff.device_bytes_after == after.device_bytes


# --- constraints: by logical names = by hand ------------------------------------------


@hst.composite
def constraint_cases(draw):
    kind = draw(hst.sampled_from([AxisType.Auto, AxisType.Explicit]))
    order = draw(hst.permutations(range(8)))
    shape, names = draw(hst.sampled_from([((2, 4), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]))
    devices = np.array(jax.devices())[list(order)].reshape(shape)
    mesh = jax.sharding.Mesh(devices, names, axis_types=(kind,) * len(names))
    array_shape = tuple(draw(hst.lists(hst.sampled_from([2, 4, 8, 3]), min_size=1, max_size=3)))
    logical = tuple(draw(hst.permutations(LOGICAL))[: len(array_shape)])
    return mesh, array_shape, logical, draw(rule_sets(mesh))


@settings(max_examples=40, deadline=None)
@given(case=constraint_cases())
def test_constraints_equal_the_hand_written_ones(case):
    mesh, shape, logical, rules = case
    spec = st.logical_to_mesh_axes(logical, rules, shape=shape, mesh=mesh)
    x = jnp.zeros(shape)

    def ours(x):
        return st.with_logical_constraint(x, logical, rules)

    def by_hand(x):
        if mesh.axis_types[0] == AxisType.Explicit:
            return jax.sharding.reshard(x, spec)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    with jax.set_mesh(mesh):
        got = jax.jit(ours)(x).sharding
        want = jax.jit(by_hand)(x).sharding
        boxed = jax.jit(lambda b: st.constrain(b, rules=rules))(
            st.LogicallyPartitioned(x, logical)
        ).value.sharding
    assert got.is_equivalent_to(want, len(shape)), (got, want)
    assert boxed.is_equivalent_to(want, len(shape)), (boxed, want)


# --- metadata through every path ---------------------------------------------------

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
RULES = (("embed", "data"), ("mlp", "model"))


class Tagged(st.LogicallyPartitioned):
    """A user's own box class: every path must keep the class too."""


def _logical(value):
    return st.LogicallyPartitioned(value, ("embed", "mlp"), mesh=MESH, rules=RULES)


def _through_vmap(box):
    stacked = st.vmap(lambda v: box.replace_boxed(v), partition_name="layers")(
        jnp.stack([box.value] * 3)
    )
    return st.remove_axis(stacked, 0, "layers")


def _through_scan(box):
    _, ys = st.scan(lambda c, x: (c, box.replace_boxed(x)), 0, jnp.stack([box.value] * 2))
    return st.remove_axis(ys, 0, None)


def _through_flax(box):
    flax_box = nn.LogicallyPartitioned(box.value, box.names, mesh=box.mesh, rules=box.rules)
    return st.from_flax(flax_box)


PATHS = {
    "constructor": lambda b: type(b)(b.value, b.names, mesh=b.mesh, rules=b.rules),
    "replace": lambda b: b.replace(),
    "replace_boxed": lambda b: b.replace_boxed(b.value + 1),
    "tree replace_boxed": lambda b: st.replace_boxed({"w": b}, {"w": b.value})["w"],
    "box": lambda b: st.box(
        {"w": b.value}, {"w": b.names}, logical=True, mesh=b.mesh, rules=b.rules
    )["w"],
    "add then remove axis": lambda b: st.remove_axis(st.add_axis(b, 0, "layers"), 0, "layers"),
    "vmap": _through_vmap,
    "scan": _through_scan,
    "pickle": lambda b: pickle.loads(pickle.dumps(b)),
    "jax.tree.map": lambda b: jax.tree.map(lambda v: v * 2, b),
    "jit in and out": lambda b: jax.jit(lambda t: t)(b),
    "grad": lambda b: jax.grad(lambda t: jnp.sum(t.value))(b),
    "shard": lambda b: st.shard({"w": b}, MESH)["w"],
    "with_logical_partitioning": lambda b: st.with_logical_partitioning(
        lambda: b.value, b.names, mesh=b.mesh, rules=b.rules
    )(),
    "from_flax": _through_flax,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_metadata_field_survives_every_path(path):
    box = _logical(jnp.ones((2, 4)))
    out = PATHS[path](box)
    assert type(out) is type(box)
    for field in ("names", "mesh", "rules"):
        assert getattr(out, field) == getattr(box, field), field


@pytest.mark.parametrize(
    "path", [p for p in PATHS if p not in ("from_flax", "box", "with_logical_partitioning")]
)
def test_a_users_own_box_class_survives_every_path(path):
    box = Tagged(jnp.ones((2, 4)), ("embed", "mlp"), mesh=MESH, rules=RULES)
    out = PATHS[path](box)
    assert type(out) is Tagged
    assert (out.names, out.mesh, out.rules) == (box.names, box.mesh, box.rules)


def test_with_partitioning_keeps_the_mesh():
    box = st.with_partitioning(lambda: jnp.ones((2, 4)), ("data", "model"), mesh=MESH)()
    assert (type(box), box.names, box.mesh) == (st.Partitioned, ("data", "model"), MESH)
    flax_box = nn.Partitioned(jnp.ones((2, 4)), ("data", "model"), mesh=MESH)
    assert st.from_flax(flax_box).mesh == MESH


# --- JAX's own argument conventions -----------------------------------------------------


@pytest.mark.parametrize(
    "in_axes, out_axes",
    [(0, 0), (-1, -1), (1, 0), (-2, 1), ((0, None), 0)],
    ids=["0-0", "neg-neg", "1-0", "neg2-1", "tuple-with-none"],
)
def test_vmap_takes_the_axes_jax_vmap_takes(in_axes, out_axes):
    x = jnp.arange(24.0).reshape(2, 3, 4)
    mapped = (in_axes[0] if isinstance(in_axes, tuple) else in_axes) % 3
    names = ["a", "b", "c"]
    names[mapped] = "m"  # the mapped axis carries the partition name
    boxed = st.Partitioned(x, tuple(names))
    args = (boxed, 2.0) if isinstance(in_axes, tuple) else (boxed,)
    plain_args = (x, 2.0) if isinstance(in_axes, tuple) else (x,)
    f = lambda b, *rest: b.replace_boxed(b.value * (rest[0] if rest else 1.0))  # noqa: E731
    g = lambda v, *rest: v * (rest[0] if rest else 1.0)  # noqa: E731
    ours = st.vmap(f, in_axes=in_axes, out_axes=out_axes, partition_name="m")(*args)
    theirs = jax.vmap(g, in_axes=in_axes, out_axes=out_axes)(*plain_args)
    np.testing.assert_array_equal(ours.value, theirs)
    kept = [n for n in names if n != "m"]
    kept.insert(out_axes % 3, "m")
    assert ours.names == tuple(kept)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("target", [("b", "a"), ("a", "b")], ids=["b-then-a", "a-then-b"])
def test_a_tuple_of_mesh_axes_keeps_its_order_in_constraints(kind, target):
    # The order of a tuple is the order of the devices along the dimension.
    devices = np.array(jax.devices())[[5, 2, 7, 0, 1, 6, 3, 4]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("a", "b"), axis_types=(kind, kind))
    rules = [("embed", target), ("mlp", None)]
    test_constraints_equal_the_hand_written_ones.hypothesis.inner_test(
        (mesh, (8, 3), ("embed", "mlp"), rules)
    )


# --- constraints of a sharded array: by logical names = jax.sharding.reshard by hand ----

E, A = AxisType.Explicit, AxisType.Auto
BY_HAND = [  # (axis types, placed on, logical target, rules, reshard spec, constraint spec)
    ((E, E), P("a", "b"), (None, None), [("batch", "a")], P(None, None), None),
    ((E, E), P("a", "b"), ("batch", "embed"), [("batch", None), ("embed", None)], P(), None),
    ((E, E), P("a", "b"), ("batch", None), [("batch", "a")], P("a", None), None),
    ((E, E), P(None, "b"), (None, "embed"), [("embed", "a")], P(None, "a"), None),
    ((E, E), P("a", None), ("batch", "embed"), [("batch", ("b", "a"))], P(("b", "a"), None), None),
    ((E, E), P("a", "b"), (U, None), [("batch", "b")], P("a", None), None),
    ((E, A), P("a", None), (None, "embed"), [("embed", "b")], P(None, None), P(None, "b")),
    (
        (E, A),
        P("a", None),
        ("batch", "embed"),
        [("batch", "a"), ("embed", "b")],
        None,
        P(None, "b"),
    ),
    ((A, E), P(None, "b"), ("batch", None), [("batch", "a")], P(None, None), P("a", None)),
    ((A, A), P("a", "b"), (None, None), [("batch", "a")], None, P(None, None)),
]


@pytest.mark.parametrize(
    "types, placed, target, rules, reshard, constraint",
    BY_HAND,
    ids=[f"{''.join(t.name[0] for t in c[0])}-{c[1]}-to-{c[2]}" for c in BY_HAND],
)
@pytest.mark.parametrize("captured", [False, True], ids=["traced", "captured-constant"])
def test_constraints_of_a_sharded_array_equal_reshard_by_hand(
    types, placed, target, rules, reshard, constraint, captured
):
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=types)
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, placed))
    typed = []

    def jitted(fn):
        def traced(x, zero):
            out = fn(x if not captured else outer) + zero
            typed.append(jax.typeof(out).sharding.spec)
            return out

        outer = x
        return jax.jit(traced)(x, jnp.zeros((), jnp.float32))

    def by_hand(x):
        if reshard is not None:
            x = jax.sharding.reshard(x, reshard)
        return x if constraint is None else jax.lax.with_sharding_constraint(x, constraint)

    with jax.set_mesh(mesh):
        want = jitted(by_hand)
        got = jitted(lambda x: st.with_logical_constraint(x, target, rules))
        boxed = jitted(
            lambda x: st.constrain(st.LogicallyPartitioned(x, target), rules=rules).value
        )
    assert typed[1] == typed[2] == typed[0], typed  # the traced types: JAX's own
    for out in (got, boxed):
        assert out.sharding.is_equivalent_to(want.sharding, 2), (out.sharding, want.sharding)
        np.testing.assert_array_equal(out, x)
