"""describe: the plan's content (paths, shapes, bytes, flags), plain and with rich."""

import pickle
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"))
RULES = [("vocab", "model"), ("vocab", "data"), ("embed", "model")]


def plan():
    return jax.eval_shape(
        lambda: {
            "emb": st.LogicallyPartitioned(jnp.zeros((6, 8)), ("vocab", "embed")),
            "w": st.Partitioned(jnp.zeros((4, 6)), ("data", "model")),
            "big": jnp.zeros((512, 512)),
            "step": jnp.zeros((), jnp.int32),
        }
    )


def test_rows_totals_and_flags_with_a_mesh():
    text = st.describe(plan(), MESH, RULES, rich=False)
    assert text.splitlines() == [
        "path  array         shard      bytes/dev",
        "  names -> mesh spec",
        "big   f32[512,512]  [512,512]    1.0 MiB",
        "emb   f32[6,8]      [3,2]           24 B",
        "  vocab,embed -> data,model",
        "step  i32[]         []               4 B",
        "w     f32[4,6]      [2,6]           48 B",
        "  data,model -> data,-",
        "total       1.0 MiB in 4 arrays",
        "per device  1.0 MiB on the most loaded device (100.0% of the total)",
        "replicated  1.0 MiB on every device",
        "! big: 1.0 MiB replicated on every device",
        "! w: dimension 1 (model, size 6) left unsharded: its mesh axes do not divide it",
    ]


def test_byte_counts_are_exact():
    # Each row's shard and bytes are what JAX places on a device for that array.
    placed = st.shard(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), plan()), MESH, RULES)
    rows = {line.split()[0]: line.split() for line in st.describe(plan(), MESH, RULES).splitlines()}
    for path, array in st.unbox(placed).items():
        shard = array.addressable_shards[0].data
        assert rows[path][2] == "[" + ",".join(map(str, shard.shape)) + "]", path
        if shard.nbytes < 1024:
            assert rows[path][3:] == [str(shard.nbytes), "B"], path
    assert rows["emb"][2:] == ["[3,2]", "24", "B"] and rows["w"][2:] == ["[2,6]", "48", "B"]
    assert rows["big"][2:] == ["[512,512]", "1.0", "MiB"] and rows["step"][2:] == ["[]", "4", "B"]


def test_without_a_mesh_only_names_and_specs():
    text = st.describe(plan(), rules=RULES, rich=False)
    lines = text.splitlines()
    assert lines[0] == "path  array"
    assert "  vocab,embed -> model,model" not in text  # a name is never mapped twice
    assert "  vocab,embed -> model,-" in lines  # without a mesh: no shape-aware fallback
    assert lines[-1] == "total       1.0 MiB in 4 arrays"
    assert "per device" not in text


def test_reduced_optimizer_states_are_flagged_as_fallbacks():
    params = {"w": st.Partitioned(jax.ShapeDtypeStruct((8, 16), jnp.float32), ("data", "model"))}
    state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=4).init, params)
    text = st.describe(state, MESH, rich=False)
    assert "0/v_row/w  f32[8]" in text
    assert "! 0/v_row/w: replicated by a fallback: shape [8] under names (data,model)" in text
    assert "(reduced optimizer states: pass params= to keep them sharded)" in text
    kept = st.describe(state, MESH, params=params, rich=False)
    assert "0/v_row/w  f32[8]   [4]" in kept and "replicated by a fallback" not in kept


def test_long_paths_fit_80_columns_and_keep_their_end():
    deep = {
        "encoder": {"block_with_a_long_name": {"attention_query_projection_kernel": plan()["emb"]}}
    }
    text = st.describe(deep, MESH, RULES, rich=False)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" in text and "attention_query_projection_kernel" in text


def test_rich_rendering_has_the_same_content():
    text = st.describe(plan(), MESH, RULES, rich=True)
    assert all(len(line) <= 80 for line in text.splitlines())
    for expected in (
        "emb",
        "f32[6,8]",
        "[3,2]",
        "24 B",
        "vocab,embed -> data,model",
        "1.0 MiB in 4 arrays",
    ):
        assert expected in text


def test_rich_is_used_only_if_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich now fails
    text = st.describe(plan(), MESH, RULES)
    assert text == st.describe(plan(), MESH, RULES, rich=False)


def test_the_text_is_the_same_whatever_is_installed():
    import rich  # noqa: F401  installed with the tests: describe must not pick it up

    assert st.describe(plan(), MESH, RULES) == st.describe(plan(), MESH, RULES, rich=False)
    assert st.describe(plan(), MESH, RULES) != st.describe(plan(), MESH, RULES, rich=True)


def test_describe_reports_bad_names_with_their_path():
    bad = {"w": st.Partitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), ("data", "tensor"))}
    with pytest.raises(ValueError, match=r"describe: the box at tree\['w'\]"):
        st.describe(bad, MESH)


def test_describe_on_concrete_arrays_and_a_subtree_box():
    tree = {"v": st.Partitioned([jnp.ones(4), jnp.ones(8)], ("data", "model"))}
    text = st.describe(tree, MESH, rich=False)
    assert "v/value/0" in text and "v/value/1" in text


@pytest.mark.parametrize("name", ["it's", 'say "hi"', 'o\'neil "x"'])
def test_describe_reads_a_name_holding_quotes_whole(name):
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 16), "float32"), ("embed", name))
    text = st.describe({"w": w}, mesh, [("embed", "data")])
    assert f"! names no rule mentions, left unsharded: {name!r}." in text.replace("\n  ", " ")
    (row,) = st.plan({"w": w}, mesh, [("embed", "data")]).rows
    (flag,) = row.flags
    assert flag == f"no rule mentions {name!r}: left unsharded" and flag.name == name
    again = pickle.loads(pickle.dumps(flag))
    assert (type(again), again, again.name) == (type(flag), flag, name)
