"""Logical axis rules: normalisation, the context, and the priority algorithm."""

import asyncio
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

U = P.UNCONSTRAINED
AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# --- normalisation ------------------------------------------------------------------


def test_rules_are_normalised_to_tuples_and_mappings_keep_order():
    with st.logical_axis_rules([["batch", ["data", "fsdp"]], ("embed", None)]) as normal:
        assert normal == (("batch", ("data", "fsdp")), ("embed", None))
        assert st.get_logical_axis_rules() == normal
    with st.logical_axis_rules({"b": "x", "a": "y"}):
        assert st.get_logical_axis_rules() == (("b", "x"), ("a", "y"))


@pytest.mark.parametrize(
    "rules, kind, fragment",
    [
        ("batch", TypeError, "expected a sequence of"),
        ([("batch", ("data", "data"))], ValueError, "names a mesh axis twice"),
        ([("batch",)], TypeError, "rule 0 is ('batch',)"),
        ([("batch", "data", "x")], TypeError, "each rule is a pair"),
        ([("batch", "data"), "embed"], TypeError, "rule 1 is 'embed'"),
        ([(1, "data")], TypeError, "logical name 1 is not a str"),
        ([("batch", {"a": "b"})], TypeError, "maps 'batch' to {'a': 'b'}"),
        ([("batch", 3)], TypeError, "maps 'batch' to 3"),
        ([("batch", ("data", 2))], TypeError, "maps 'batch' to ('data', 2)"),
        (42, TypeError, "rules are 42"),
    ],
    ids=[
        "str",
        "axis-twice",
        "one-element",
        "three-elements",
        "bare-str-rule",
        "int-name",
        "dict-value",
        "int-value",
        "tuple-with-int",
        "int",
    ],
)
def test_malformed_rules_are_errors_naming_the_function_and_entry(rules, kind, fragment):
    def enter_context(r):
        with st.logical_axis_rules(r):
            pass

    gives = {
        "logical_axis_rules": enter_context,
        "set_logical_axis_rules": st.set_logical_axis_rules,
        "to_spec": lambda r: st.to_spec({}, r),
        "LogicallyPartitioned": lambda r: st.LogicallyPartitioned(1.0, (), rules=r),
    }
    for function, give in gives.items():
        with pytest.raises(kind) as info:
            give(rules)
        message = str(info.value)
        assert message.startswith(f"{function}: ") and fragment in message
    assert st.get_logical_axis_rules() == ()


def test_box_rules_are_normalised_so_equal_rules_are_equal_metadata():
    a = st.LogicallyPartitioned(jnp.zeros(2), ["x"], rules=[["x", ["a", "b"]]])
    b = st.LogicallyPartitioned(jnp.zeros(2), ("x",), rules=(("x", ("a", "b")),))
    assert jax.tree.structure(a) == jax.tree.structure(b)


def test_equal_rules_as_lists_or_tuples_trace_once():
    traces = []

    @jax.jit
    def step(p):
        traces.append(1)
        return jax.tree.map(lambda x: x + 1, p)

    for rules in ([["embed", "model"]], (("embed", "model"),), [("embed", "model")]):
        for names in (["embed"], ("embed",)):
            step({"w": st.LogicallyPartitioned(jnp.zeros(4), names, rules=rules)})
    assert len(traces) == 1


# --- the context --------------------------------------------------------------------


def test_nested_contexts_restore_on_exit_and_on_exceptions():
    with st.logical_axis_rules([("a", "x")]):
        with pytest.raises(RuntimeError), st.logical_axis_rules([("a", "y")]):
            assert st.get_logical_axis_rules() == (("a", "y"),)
            raise RuntimeError("boom")
        assert st.get_logical_axis_rules() == (("a", "x"),)
        with st.logical_axis_rules([("b", "z")]):
            assert st.to_spec(st.LogicallyPartitioned(1.0, ()), None) == P()
            assert st.logical_to_mesh_axes(("b",)) == P("z")
        assert st.logical_to_mesh_axes(("b",)) == P(None)
    assert st.get_logical_axis_rules() == ()


def test_threads_never_see_each_others_rules():
    barrier = threading.Barrier(4)
    seen, errors = {}, []

    def worker(i):
        try:
            assert st.get_logical_axis_rules() == ()  # a new thread starts empty
            with st.logical_axis_rules([("batch", f"axis{i}")]):
                barrier.wait()  # all four are inside their contexts at once
                seen[i] = st.logical_to_mesh_axes(("batch",))
                barrier.wait()
            assert st.get_logical_axis_rules() == ()
        except Exception as e:  # surfaced below
            errors.append(e)

    with st.logical_axis_rules([("batch", "main")]):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert st.get_logical_axis_rules() == (("batch", "main"),)
    assert errors == []
    assert seen == {i: P(f"axis{i}") for i in range(4)}


def test_asyncio_tasks_never_see_each_others_rules():
    async def task(i, log):
        with st.logical_axis_rules([("batch", f"axis{i}")]):
            for _ in range(3):
                await asyncio.sleep(0)  # let the other tasks run inside their contexts
                log.append((i, st.logical_to_mesh_axes(("batch",))))
        return st.get_logical_axis_rules()

    async def main():
        log = []
        after = await asyncio.gather(*(task(i, log) for i in range(5)))
        return log, after

    log, after = asyncio.run(main())
    assert [i for i, _ in log[:5]] == [0, 1, 2, 3, 4]  # the tasks really interleaved
    assert all(spec == P(f"axis{i}") for i, spec in log)
    assert after == [()] * 5


# --- the priority algorithm ----------------------------------------------------------


@pytest.mark.parametrize(
    "names, rules, expected",
    [
        (
            ("batch", "length", "heads", "features"),
            [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")],
            P("X", None, "Y", None),
        ),
        (
            ("batch", "embed"),
            [("batch", ("data", "fsdp")), ("embed", "fsdp")],
            P(("data", "fsdp"), None),
        ),
        (
            ("batch", "embed"),
            [("embed", "fsdp"), ("batch", ("data", "fsdp")), ("batch", "data")],
            P("data", "fsdp"),
        ),
        (
            ("batch", "embed"),
            [("batch", None), ("batch", "data"), ("embed", "data")],
            P(None, "data"),
        ),
        (("batch", "embed"), [("batch", U), ("embed", "data")], P(U, "data")),
        (("batch", "embed"), [("vocab", "data")], P(None, None)),
        (("batch", "embed"), [], P(None, None)),
        ((None, U, "embed"), [("embed", "data")], P(None, U, "data")),
        ((("data",), "embed"), [("embed", "data"), ("embed", "model")], P(("data",), "model")),
        ((), [("embed", "data")], P()),
        (("a", "b"), [("a", "x"), ("b", "x"), ("b", "y")], P("x", "y")),
    ],
    ids=[
        "flax-doc",
        "tuple-axes",
        "tuple-partial-overlap",
        "rule-to-none-claims",
        "rule-to-unconstrained",
        "unknown-name",
        "empty-rules",
        "none-and-unconstrained-pass",
        "literal-tuple-entry",
        "scalar",
        "first-free-rule-wins",
    ],
)
def test_logical_to_mesh_axes_edge_cases(names, rules, expected):
    assert st.logical_to_mesh_axes(names, rules) == expected
    assert nn.logical_to_mesh_axes(names, rules) == expected  # and flax agrees


def test_logical_to_mesh_axes_none_and_duplicates():
    assert st.logical_to_mesh_axes(None, [("a", "x")]) is None
    with pytest.raises(ValueError, match="'a' given twice"):
        st.logical_to_mesh_axes(("a", "a"), [("a", "x")])


def reference(names, rules):
    """The SPEC's words, written out independently of the library's code."""
    strs = [n for n in names if isinstance(n, str)]
    if len(strs) != len(set(strs)):
        raise ValueError("duplicate")
    chosen = {}
    taken = {a for n in names if isinstance(n, tuple) for a in n}
    for logical, axes in rules:
        if logical not in strs or logical in chosen:
            continue
        wanted = (
            {axes} if isinstance(axes, str) else set(axes) if isinstance(axes, tuple) else set()
        )
        if wanted & taken:
            continue
        chosen[logical] = axes
        taken |= wanted
    return P(*(chosen.get(n) if isinstance(n, str) else n for n in names))


LOGICAL = ["batch", "length", "embed", "mlp", "heads", "vocab"]
AXES = ["x", "y", "z", "w"]
mesh_axes = hst.one_of(
    hst.sampled_from(AXES),
    hst.lists(hst.sampled_from(AXES), min_size=1, max_size=3, unique=True).map(tuple),
    hst.just(None),
    hst.just(U),
)
name_entries = hst.one_of(
    hst.sampled_from(LOGICAL),
    hst.just(None),
    hst.just(U),
    hst.lists(hst.sampled_from(AXES), min_size=1, max_size=2, unique=True).map(tuple),
)


@settings(max_examples=3000)
@given(
    names=hst.lists(name_entries, max_size=5).map(tuple),
    rules=hst.lists(hst.tuples(hst.sampled_from(LOGICAL), mesh_axes), max_size=8),
)
def test_logical_to_mesh_axes_equals_flax_and_a_reference(names, rules):
    try:
        expected = nn.logical_to_mesh_axes(names, rules)
    except ValueError:
        with pytest.raises(ValueError):
            st.logical_to_mesh_axes(names, rules)
        with pytest.raises(ValueError):
            reference(names, rules)
        return
    assert st.logical_to_mesh_axes(names, rules) == expected
    assert reference(names, rules) == expected


def test_logical_to_mesh_over_partition_specs_and_tuples():
    rules = [("batch", "data"), ("embed", "model")]
    tree = {"a": ("batch", "embed"), "b": P("embed", None), "c": None, "d": [("batch",)]}
    assert st.logical_to_mesh(tree, rules) == {
        "a": P("data", "model"),
        "b": P("model", None),
        "c": None,
        "d": [P("data")],
    }
    # flax takes only PartitionSpec leaves (a tuple is a node to it); there they agree.
    specs = {"a": P("batch", "embed"), "b": P("embed", None), "c": None}
    assert nn.logical_to_mesh(specs, rules) == st.logical_to_mesh(specs, rules)


def test_logical_to_mesh_errors_name_the_path():
    with pytest.raises(TypeError, match=r"tree\['a'\].*expected a logical spec"):
        st.logical_to_mesh({"a": 3}, [("batch", "data")])
    with pytest.raises(ValueError, match=r"tree\['b'\].*'x' given twice"):
        st.logical_to_mesh({"b": ("x", "x")}, [("x", "data")])


def test_logical_to_mesh_sharding_refuses_rules_for_axes_not_in_the_mesh():
    rules = [("embed", "fsdp"), ("embed", "model"), ("batch", "data")]
    with pytest.raises(ValueError, match=r"rule 0 \('embed', 'fsdp'\)"):
        st.logical_to_mesh_sharding({"x": ("batch", "embed")}, AUTO, rules)
    # Shared across meshes, the rules get every axis (size 1 where unused).
    mesh = jax.make_mesh((2, 4, 1), ("data", "model", "fsdp"), axis_types=(AxisType.Auto,) * 3)
    out = st.logical_to_mesh_sharding({"x": ("batch", "embed"), "y": P(U)}, mesh, rules)
    assert out["x"].spec == P("data", "fsdp") and out["x"].mesh is mesh
    assert out["y"].spec == P(None)
    with pytest.raises(TypeError, match=r"jax\.sharding\.Mesh"):
        st.logical_to_mesh_sharding({"x": ("batch",)}, "mesh", rules)


# --- validate_rules ---------------------------------------------------------------------


def test_validate_rules_is_empty_when_all_is_well():
    tree = {"w": st.LogicallyPartitioned(jnp.zeros((4, 8)), ("embed", "mlp"))}
    assert st.validate_rules([("embed", "data"), ("mlp", "model")], AUTO, tree) == []
    assert st.validate_rules([("embed", "data")]) == []


def test_validate_rules_reports_each_kind_of_problem():
    tree = {
        "w": st.LogicallyPartitioned(jnp.zeros((4, 8)), ("embed", "heads")),
        "own": st.LogicallyPartitioned(jnp.zeros(4), ("private",), rules=[("private", "x")]),
        "p": st.Partitioned(jnp.zeros(4), ("data",)),
    }
    problems = st.validate_rules([("embed", ("data", "tensor")), ("vocab", "model")], AUTO, tree)
    assert len(problems) == 3
    assert "'tensor', which is not in the mesh" in problems[0]
    assert "'heads' (at tree['w']) is not covered" in problems[1]
    assert "rule 1 ('vocab', 'model') is never used" in problems[2]


def test_validate_rules_uses_the_context_and_checks_rules():
    with st.logical_axis_rules([("embed", "fsdp")]):
        assert len(st.validate_rules(None, AUTO)) == 1
    with pytest.raises(TypeError, match="rule 0"):
        st.validate_rules([("embed", 1)])
