"""plan: exact figures (checked against JAX's own), reasons, flags, fits and diff."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

U = P.UNCONSTRAINED
AUTO = (AxisType.Auto,)
MESHES = {
    "2x4": jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO * 2),
    "4x2": jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO * 2),
    "8x1": jax.make_mesh((8, 1), ("data", "model"), axis_types=AUTO * 2),
    "2x2x2": jax.make_mesh((2, 2, 2), ("data", "model", "extra"), axis_types=AUTO * 3),
}
RULES = [("batch", "data"), ("embed", "data"), ("mlp", "model"), ("vocab", "model")]
TX = optax.adafactor(1e-3, min_dim_size_to_factor=4)


def params():
    return {
        "emb": st.LogicallyPartitioned(
            jnp.ones((12, 8)), ("vocab", "embed")
        ),  # 12 % 8: indivisible
        "w": st.LogicallyPartitioned(jnp.ones((8, 16)), ("embed", "mlp")),
        "p": st.Partitioned(jnp.ones((6, 8), jnp.bfloat16), (None, "model")),
        "u": st.Partitioned(jnp.ones((4, 8)), (U, "model")),
        "raw": jnp.ones((3, 5), jnp.int32),
        "scalar": jnp.zeros(()),
    }


def train_state():
    p = params()
    return {"params": p, "opt": TX.init(p)}


def per_device_bytes(tree):
    """What each device holds, summed over the arrays, from JAX's placed shards."""
    held: dict[int, int] = {}
    for array in jax.tree.leaves(st.unbox(tree)):
        for shard in array.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_device_bytes_equal_what_jax_places(mesh):
    state = train_state()
    p = st.plan(state, mesh, RULES, params=state["params"])
    placed = st.shard(state, mesh, RULES, params=state["params"])
    held = per_device_bytes(placed)
    assert p.device_bytes == max(held.values())
    assert p.total_bytes == sum(x.nbytes for x in jax.tree.leaves(st.unbox(state)))
    shards = [a.addressable_shards[0].data for a in jax.tree.leaves(st.unbox(placed))]
    assert [r.shard_shape for r in p.rows] == [s.shape for s in shards]
    assert [r.device_bytes for r in p.rows] == [s.nbytes for s in shards]
    assert [r.spec for r in p.rows] == [  # the plan's specs are to_sharding's
        s.spec if r.names is None or U not in r.spec else r.spec
        for r, s in zip(
            p.rows,
            jax.tree.leaves(
                st.to_sharding(state, mesh, RULES, params=state["params"]),
                is_leaf=lambda x: isinstance(x, NamedSharding),
            ),
            strict=True,
        )
    ]


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_device_bytes_equal_a_compiled_steps_argument_bytes(mesh):
    state = train_state()
    p = st.plan(state, mesh, RULES, params=state["params"])
    abstract = st.to_abstract(jax.eval_shape(lambda: state), mesh, RULES, params=state["params"])
    compiled = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t)).lower(abstract).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == p.device_bytes


def test_a_plan_on_an_abstract_mesh_equals_the_plan_on_a_concrete_one():
    state = jax.eval_shape(train_state)
    for mesh in MESHES.values():
        abstract = jax.sharding.AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.axis_names))
        concrete = st.plan(state, mesh, RULES, params=state["params"])
        planned = st.plan(state, abstract, RULES, params=state["params"])
        assert dataclasses.replace(planned, mesh=None) == dataclasses.replace(concrete, mesh=None)
        assert str(planned) == str(concrete)


def test_rows_are_in_tree_order_with_paths_names_and_dtypes():
    p = st.plan(jax.eval_shape(params), MESHES["2x4"], RULES)
    assert [r.path for r in p.rows] == ["emb", "p", "raw", "scalar", "u", "w"]
    rows = {r.path: r for r in p.rows}
    assert rows["p"].dtype == np.dtype("bfloat16") and rows["p"].names == (None, "model")
    assert rows["raw"].names is None and rows["raw"].spec == P()
    assert rows["emb"].spec == P("model", "data") and rows["emb"].shard_shape == (3, 4)
    assert rows["u"].spec == P(U, "model") and rows["u"].shard_shape == (4, 2)
    assert p.replicated_bytes == 3 * 5 * 4 + 4  # raw and scalar
    assert p.mesh is MESHES["2x4"]


def test_why_says_which_rule_gave_each_dimension_or_why_not():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    rules = [("vocab", "model"), ("vocab", "data"), ("embed", "data"), ("mlp", "data")]
    tree = {
        "emb": st.LogicallyPartitioned(jax.ShapeDtypeStruct((6, 8), "float32"), ("vocab", "embed")),
        "h": st.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 4), "float32"), ("heads", "mlp")),
        "p": st.Partitioned(jax.ShapeDtypeStruct((4, 6), "float32"), ("data", "model")),
        "raw": jax.ShapeDtypeStruct((2,), "float32"),
    }
    why = {r.path: r.why for r in st.plan(tree, mesh, rules).rows}
    assert why["emb"] == (
        "dimension 0 (vocab, size 6): rule 1 ('vocab', 'data') gives it 'data'; "
        "rule 0 ('vocab', 'model') passed over, as 4 does not divide 6",
        "dimension 1 (embed, size 8): unsharded: rule 2 ('embed', 'data') passed over, as "
        "its mesh axes already shard dimension 0",
    )
    assert why["h"] == (
        "dimension 0 (heads, size 8): no rule mentions it, so unsharded",
        "dimension 1 (mlp, size 4): rule 3 ('mlp', 'data') gives it 'data'",
    )
    assert why["p"] == (
        "dimension 0 (data, size 4): mesh axes 'data' as named",
        "dimension 1 (model, size 6): unsharded: 'model' passed over, as 4 does not divide 6",
    )
    assert why["raw"] == ("dimension 0 (size 2): in no box, so replicated",)


def test_why_of_reduced_states_says_which_param_dimension_they_kept():
    p = params()
    state = jax.eval_shape(TX.init, p)
    rows = {r.path: r for r in st.plan(state, MESHES["2x4"], RULES, params=p).rows}
    assert rows["0/v_row/w"].names == ("embed", "mlp") and rows["0/v_row/w"].spec == P("data")
    assert rows["0/v_row/w"].why == (
        "dimension 0 (embed, size 8): kept dimension 0 of its param; rule 1 ('embed', 'data') "
        "gives it 'data'",
    )
    alone = {r.path: r for r in st.plan(state, MESHES["2x4"], RULES).rows}
    assert alone["0/v_row/w"].flags == (
        "replicated by a fallback: shape [8] under names (embed,mlp)",
    )
    assert "no param to match it (params=)" in alone["0/v_row/w"].why[0]


def test_flags():
    mesh = MESHES["2x4"]
    tree = jax.eval_shape(
        lambda: {
            "big": jnp.zeros((512, 512)),
            "odd": st.Partitioned(jnp.zeros((4, 6)), ("data", "model")),
            "square": st.LogicallyPartitioned(jnp.zeros((16, 16)), ("embed", "mlp")),
        }
    )
    state = jax.eval_shape(TX.init, tree)
    rows = {r.path: r for r in st.plan({"p": tree, "s": state}, mesh, RULES, params=tree).rows}
    assert rows["p/big"].flags == ("1.0 MiB replicated on every device",)
    assert rows["p/odd"].flags == (
        "dimension 1 (model, size 6) left unsharded: its mesh axes do not divide it",
    )
    assert rows["s/0/v_row/square"].flags == (
        "replicated: which dimensions of its param it kept is ambiguous (shape [16] under "
        "names (embed,mlp))",
    )
    assert rows["p/square"].flags == ()


def test_fits_and_the_budget_line():
    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    tree = {"w": st.Partitioned(jax.ShapeDtypeStruct((1024, 256), "float32"), ("data", None))}
    p = st.plan(tree, mesh)
    assert p.device_bytes == 128 * 1024 and p.fits(128 * 1024) and not p.fits(128 * 1024 - 1)
    text = st.describe(tree, mesh, budget=2**20)
    assert "budget      1.0 MiB per device: fits, 896.0 KiB to spare" in text.splitlines()
    text = st.describe(tree, mesh, budget=1000)
    assert "budget      1000 B per device: does not fit: 127.0 KiB over" in text.splitlines()
    with pytest.raises(TypeError, match=r"fits: budget_bytes is '1 GiB'; expected an int"):
        p.fits("1 GiB")
    with pytest.raises(TypeError, match=r"describe: budget is 1.5"):
        st.describe(tree, mesh, budget=1.5)


def test_str_of_a_plan_is_the_describe_table():
    tree = jax.eval_shape(params)
    assert str(st.plan(tree, MESHES["4x2"], RULES)) == st.describe(tree, MESHES["4x2"], RULES)


def test_a_plan_is_immutable_and_refuses_what_is_not_a_plan():
    p = st.plan(jax.eval_shape(params), MESHES["2x4"], RULES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.rows = ()
    with pytest.raises(TypeError, match=r"diff: other is dict; expected a st\.Plan"):
        p.diff({})


def test_describe_works_on_an_abstract_mesh():
    mesh = jax.sharding.AbstractMesh((32, 8), ("fsdp", "tensor"))
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((8192, 28672), "bfloat16"), ("embed", "mlp"))
    text = st.describe({"w": w}, mesh, [("embed", "fsdp"), ("mlp", "tensor")])
    assert text.splitlines()[2].split() == ["w", "bf16[8192,28672]", "[256,3584]", "1.8", "MiB"]


# --- diff: exact, against JAX's own device -> index map ------------------------------


def received_by_jax(old: NamedSharding, new: NamedSharding, shape, itemsize):
    """Per device of `new`: elements of its new shard its old shard lacks, from JAX."""
    old_map = old.devices_indices_map(shape)
    out = {}
    for device, index in new.devices_indices_map(shape).items():
        box = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
        had = old_map.get(device)
        if had is None:
            overlap = 0
        else:
            was = [range(*s.indices(n)) for s, n in zip(had, shape, strict=True)]
            overlap = math.prod(
                len(range(max(a.start, b.start), min(a.stop, b.stop)))
                for a, b in zip(box, was, strict=True)
            )
        out[device.id] = (math.prod(len(r) for r in box) - overlap) * itemsize
    return out


REVERSED = jax.sharding.Mesh(
    np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"), axis_types=AUTO * 2
)
HALF = jax.make_mesh((4,), ("data",), axis_types=AUTO, devices=jax.devices()[:4])
DIFF_MESHES = [*MESHES.values(), REVERSED, HALF]
entries = hst.sampled_from([None, "data", "model", ("data", "model"), ("model", "data")])


@settings(max_examples=60)
@given(
    before=hst.sampled_from(DIFF_MESHES),
    after=hst.sampled_from(DIFF_MESHES),
    names=hst.lists(hst.tuples(entries, entries), min_size=2, max_size=2),
)
def test_diff_received_bytes_equal_jax_index_maps(before, after, names):
    def tree_on(mesh, pair):
        valid = tuple(e if set(st_axes(e)) <= set(mesh.axis_names) else None for e in pair)
        if len({a for e in valid for a in st_axes(e)}) < sum(len(st_axes(e)) for e in valid):
            valid = (valid[0], None)
        return {
            "a": st.Partitioned(jax.ShapeDtypeStruct((8, 16), "float32"), valid),
            "b": st.Partitioned(jax.ShapeDtypeStruct((16,), "bfloat16"), (valid[1],)),
        }

    old_tree, new_tree = tree_on(before, names[0]), tree_on(after, names[1])
    d = st.plan(old_tree, before).diff(st.plan(new_tree, after))
    busiest: dict[int, int] = {}
    by_path = {row.path: row for row in d.rows}
    for path in ("a", "b"):
        old_s, new_s = st.to_sharding(old_tree, before)[path], st.to_sharding(new_tree, after)[path]
        value = new_tree[path].value
        got = received_by_jax(old_s, new_s, value.shape, np.dtype(value.dtype).itemsize)
        for device, n in got.items():
            busiest[device] = busiest.get(device, 0) + n
        if path in by_path:
            assert by_path[path].received_bytes == max(got.values())
        else:  # unchanged: nothing to receive
            assert max(got.values()) == 0
    assert d.received_bytes == max(busiest.values())


def st_axes(entry):
    return (entry,) if isinstance(entry, str) else entry or ()


def test_diff_rows_for_arrays_in_one_plan_only():
    mesh = jax.sharding.AbstractMesh((4,), ("x",))
    a = {"w": st.Partitioned(jax.ShapeDtypeStruct((8,), "float32"), ("x",))}
    b = {"v": st.Partitioned(jax.ShapeDtypeStruct((8,), "float32"), ("x",))}
    d = st.plan(a, mesh).diff(st.plan(b, mesh))
    rows = {row.path: row for row in d.rows}
    assert rows["v"].spec_before is None and rows["v"].received_bytes == 8
    assert rows["w"].spec_after is None and rows["w"].received_bytes == 0
    assert st.plan(a, mesh).diff(st.plan(a, mesh)).rows == ()
