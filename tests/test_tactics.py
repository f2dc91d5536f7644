"""Tactics for unannotated trees: fsdp, and match(..., default=)."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as hst
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.sharding.AbstractMesh((4, 2), ("fsdp", "tensor"))


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((256, 1024), (None, ("fsdp",))),  # the largest dimension
        ((1024, 256), (("fsdp",), None)),
        ((512, 512), (("fsdp",), None)),  # a tie: the first
        ((3, 512, 512), (None, ("fsdp",), None)),
        ((1026, 64), (None, ("fsdp",))),  # 4 does not divide 1026: the next largest
        ((16384,), (("fsdp",),)),  # exactly min_size elements
        ((16383,), None),  # one fewer: unboxed
        ((129, 127), None),  # no dimension divisible: unboxed
        ((), None),
    ],
    ids=[
        "widest",
        "tallest",
        "tie",
        "stacked",
        "next-divisible",
        "min-size",
        "small",
        "odd",
        "scalar",
    ],
)
def test_fsdp_puts_the_axis_on_the_largest_dimension_it_divides(shape, expected):
    assert st.fsdp(MESH)((), sds(*shape)) == expected


def test_fsdp_min_size_and_axis():
    assert st.fsdp(MESH, min_size=10)((), sds(8, 4)) == (("fsdp",), None)
    assert st.fsdp(MESH, "tensor")((), sds(4096, 4098)) == (None, ("tensor",))
    with pytest.raises(ValueError, match=r"fsdp: axis 'data' is not an axis of the mesh"):
        st.fsdp(MESH, "data")


@given(shape=hst.lists(hst.integers(1, 130), min_size=1, max_size=3))
def test_fsdp_chooses_a_dimension_the_axis_divides_and_none_larger(shape):
    names = st.fsdp(MESH, min_size=1)((), sds(*shape))
    divisible = [d for d in range(len(shape)) if shape[d] % 4 == 0]
    if not divisible:
        assert names is None
        return
    chosen = names.index(("fsdp",))
    assert shape[chosen] % 4 == 0 and shape[chosen] == max(shape[d] for d in divisible)
    assert all(shape[d] < shape[chosen] for d in divisible if d < chosen)
    assert names.count(("fsdp",)) == 1 and names.count(None) == len(shape) - 1


def test_match_default_names_what_no_pattern_matches():
    tree = {"attn": {"w": sds(768, 2304), "b": sds(2304)}, "wpe": sds(1024, 768)}
    names = st.match([(r"attn/w$", (None, "tensor")), (r"/b$", None)], default=st.fsdp(MESH))
    boxed = st.box(tree, names)
    assert boxed["attn"]["w"].names == (None, "tensor")
    assert not st.is_boxed(boxed["attn"]["b"])  # a pattern said None: no default
    assert boxed["wpe"].names == (("fsdp",), None)
    assert st.to_spec(boxed, mesh=MESH) == {
        "attn": {"w": P(None, "tensor"), "b": P()},
        "wpe": P("fsdp", None),
    }


def test_fsdp_serves_logical_patterns_too():
    tree = {"emb": sds(1000, 64), "w": sds(64, 256)}
    rules = [("vocab", "tensor"), ("embed", None)]
    names = st.match([(r"emb$", ("vocab", "embed"))], default=st.fsdp(MESH, min_size=1))
    boxed = st.box(tree, names, logical=True)
    assert st.to_spec(boxed, rules, mesh=MESH) == {"emb": P("tensor", None), "w": P(None, "fsdp")}


def test_the_plan_shows_each_choice():
    boxed = st.box({"w": sds(64, 1024), "tiny": sds(8)}, st.fsdp(MESH))
    why = {row.path: row.why for row in st.plan(boxed, MESH).rows}
    assert why["w"][1] == "dimension 1 (fsdp, size 1024): mesh axes ('fsdp',) as named"
    assert why["tiny"] == ("dimension 0 (size 8): in no box, so replicated",)


def test_match_default_must_be_a_names_function():
    with pytest.raises(TypeError, match=r"match: default is 'fsdp'; expected a names function"):
        st.match([], default="fsdp")


# A flax-like tree whose attention kernels are named ('embed', 'kv'), not 'heads'.
GPT = {
    "attn": {"query": {"kernel": sds(64, 64)}, "out": {"kernel": sds(64, 64)}},
    "mlp": {"kernel": sds(64, 256), "bias": sds(256)},
}
GPT_PATHS = ["attn/out/kernel", "attn/query/kernel", "mlp/bias", "mlp/kernel"]  # as box walks
PATTERNS = [(r"mlp/kernel$", ("embed", "mlp")), (r"heads/kernel$", ("embed", "heads"))]


def _matched_by_none(patterns, paths):
    """The oracle: the indices of the patterns `re.search` finds in none of the paths."""
    return [
        i for i, (regex, _) in enumerate(patterns) if not any(re.search(regex, p) for p in paths)
    ]


def test_a_pattern_that_matches_no_leaf_is_warned_of_at_the_users_line():
    assert _matched_by_none(PATTERNS, GPT_PATHS) == [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        boxed = st.box(GPT, st.match(PATTERNS), logical=True)
    [warning] = caught
    assert warning.category is st.UnmatchedWarning and issubclass(warning.category, UserWarning)
    assert warning.filename == __file__
    shown = ", ".join(map(repr, GPT_PATHS[:3]))
    assert str(warning.message) == (
        f"st.match pattern 1 ('heads/kernel$') matches none of the key paths of the 4 arrays "
        f"boxed ({shown}, ...), so it names nothing. Fix the regex against these paths (keys "
        "joined with '/'), or drop the pattern."
    )
    assert boxed["mlp"]["kernel"].names == ("embed", "mlp")  # the rest is named as before


def test_strict_makes_a_pattern_that_matches_no_leaf_an_error():
    patterns = [*PATTERNS, (r"attn/", None), (r"bias$", None), (r"^lm_head", None)]
    assert _matched_by_none(patterns, GPT_PATHS) == [1, 4]
    with pytest.raises(ValueError) as info:
        st.box(GPT, st.match(patterns, strict=True), logical=True)
    message = str(info.value)
    assert message.startswith(
        "box: st.match patterns 1 ('heads/kernel$'), 4 ('^lm_head') match none of the "
        "key paths of the 4 arrays boxed"
    )
    assert "so they name nothing" in message


def test_many_patterns_that_match_nothing_are_counted_past_five():
    patterns = [(f"^nothing{i}$", None) for i in range(7)]
    with pytest.warns(st.UnmatchedWarning) as caught:
        st.box(GPT, st.match(patterns))
    assert str(caught[0].message).startswith(
        "st.match patterns 0 ('^nothing0$'), 1 ('^nothing1$'), 2 ('^nothing2$'), "
        "3 ('^nothing3$'), 4 ('^nothing4$') and 2 more match none of the key paths"
    )


@pytest.mark.parametrize(
    "patterns",
    [
        [(r"kernel$", ("embed", "mlp")), (r"mlp/kernel$", None), (r".", None)],  # shadowed
        [(r"kernel$", ("embed", "mlp"))],  # leaves matched by none are not patterns' fault
    ],
    ids=["shadowed-by-an-earlier-pattern", "unmatched-leaves"],
)
def test_a_pattern_that_matches_some_leaf_is_not_warned_of(patterns):
    assert _matched_by_none(patterns, GPT_PATHS) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", st.UnmatchedWarning)
        st.box(GPT, st.match(patterns), logical=True)


def test_the_default_match_is_checked_on_the_leaves_it_was_left():
    inner = st.match([(r"bias$", None), (r"query/kernel$", ("embed", "kv"))])
    # the outer pattern takes every kernel, so the default's kernel pattern names nothing
    outer = st.match([(r"kernel$", ("embed", "mlp"))], default=inner)
    with pytest.warns(st.UnmatchedWarning, match=r"pattern 1 \('query/kernel\$'\).* 1 array "):
        st.box(GPT, outer, logical=True)
