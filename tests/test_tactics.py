"""Tactics for unannotated trees: fsdp, and match(..., default=)."""

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
