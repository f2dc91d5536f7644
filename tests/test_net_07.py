"""Two kinds of bug in 0.6's code that passed the whole suite (0.7), each held to an
oracle of its own, as tests/test_net.py holds 0.6's six:

- the job's `compiler_options` must win over spmdtree's own where both set the same
  flag (0.6's only target test passed a flag spmdtree does not set);
- the repeated-work diagnosis names as the cause only an axis of the layout's own
  that leaves something undivided and is one the work repeats along.
"""

import itertools
import math
import re

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as hs
from test_step_properties import examples

import spmdtree as st

# Private: how a compile's options are put together, and the diagnosis's sentence,
# have no public names: each is held to its oracle here.
from spmdtree._src.step.compile.backends import LIBTPU, XLA_CPU, XLA_GPU
from spmdtree._src.step.compile.compilers import _compile_options, check_compiler_options
from spmdtree._src.step.preflight.diagnose import repeated

TOOLCHAINS = (XLA_CPU, XLA_GPU, LIBTPU)


def flags_of(toolchain):
    """Option names a job may set: the toolchain's own first, then others."""
    return [name for name, _ in toolchain.deviceless_options] + ["xla_dump_to", "xla_one_of_ours"]


@examples(200)
@given(hs.sampled_from(TOOLCHAINS), hs.booleans(), hs.data())
def test_the_jobs_compiler_options_win_over_spmdtrees_own(toolchain, deviceless, data):
    names = flags_of(toolchain)
    job = data.draw(
        hs.dictionaries(hs.sampled_from(names), hs.one_of(hs.booleans(), hs.integers(0, 9)))
    )
    got = _compile_options(toolchain, deviceless, check_compiler_options(job))
    # the oracle: spmdtree's own (without a device: every one; with one, none but the
    # CPU estimate's), then each of the job's over them; the CPU estimate takes none
    # of the job's, which are its accelerator's compiler's
    expected = (
        dict(toolchain.deviceless_options) if deviceless or toolchain.backend.estimates else {}
    )
    if not toolchain.backend.estimates:
        for name, value in job.items():
            expected[name] = value
    assert got == expected
    for name, value in job.items():
        if not toolchain.backend.estimates:
            assert got[name] == value  # a flag both set: the job's


def test_a_flag_spmdtree_sets_is_the_jobs_where_the_job_sets_it():
    ((flag, ours),) = XLA_GPU.deviceless_options  # spmdtree turns Triton's GEMMs off for XLA GPU
    assert _compile_options(XLA_GPU, True, check_compiler_options({flag: not ours})) == {
        flag: not ours
    }


# --- the repeated-work diagnosis ---------------------------------------------------------

AXES = ("data", "fsdp", "tensor", "seq")


def layout(sizes, heads, batch):
    """A layout's arguments: the batch split over `data` by a rule, and `heads` split
    over `tensor` by a rule (left unsharded where tensor does not divide it)."""
    rules = [("batch", "data"), ("heads", "tensor")]
    tree = {
        "tokens": st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((batch, 16), "float32"), ("batch", None)
        ),
        "w": st.LogicallyPartitioned(jax.ShapeDtypeStruct((heads, 64), "float32"), ("heads", None)),
    }
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
    return st.plan(tree, mesh, rules=rules)


def oracle_axes(sizes, used, undivided, factor):
    """The axes the work repeats along, found by trying every set: of size > 1, not
    splitting an argument unless they leave something undivided; nearest `factor`,
    fewest on ties."""
    spare = [a for a, n in sizes.items() if n > 1 and (a not in used or a in undivided)]
    sets = [s for k in range(1, len(spare) + 1) for s in itertools.combinations(spare, k)]
    if not sets:
        return ()
    return min(sets, key=lambda s: (abs(math.log(math.prod(sizes[a] for a in s) / factor)), len(s)))


@examples(300)
@given(
    hs.lists(hs.sampled_from([1, 2, 4, 8, 16]), min_size=4, max_size=4),
    hs.sampled_from([4, 8, 12, 16, 32]),
    hs.sampled_from([2.0, 4.0, 8.0, 16.0]),
)
def test_a_repeat_is_blamed_on_an_undivided_axis_only_where_the_work_repeats_along_it(
    shape, heads, factor
):
    sizes = dict(zip(AXES, shape, strict=True))
    batch = 64 * sizes["data"]
    inputs = layout(sizes, heads, batch)
    least = 10**12
    said = repeated(sizes, inputs, int(factor * least), least, batch)
    used = {a for row in inputs.rows for e in row.spec for a in st_axes(e)}
    undivided = {"tensor"} if sizes["tensor"] > 1 and heads % sizes["tensor"] else set()
    axes = oracle_axes(sizes, used, undivided, factor)
    if not axes:
        assert said is None
        return
    named = re.match(r"devices repeat each other's work along (.*?)[:,]", said).group(1)
    assert named == " x ".join(f"{a} ({sizes[a]})" for a in axes)
    blamed = "does not divide what it is to split" in said
    # the undivided cause is said only where an axis the work repeats along is it
    assert blamed == bool(undivided & set(axes))
    if blamed:
        assert f"(heads, size {heads})" in said


def st_axes(entry):
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@pytest.mark.parametrize(
    "sizes, heads, blamed",
    [
        ({"data": 2, "fsdp": 1, "tensor": 16, "seq": 1}, 8, True),  # along tensor: its cause
        ({"data": 2, "fsdp": 1, "tensor": 16, "seq": 2}, 8, True),
        ({"data": 2, "fsdp": 1, "tensor": 4, "seq": 2}, 6, False),  # along seq, not tensor
    ],
    ids=["tensor-alone", "tensor-beside-seq", "seq-repeats-tensor-undivided"],
)
def test_known_cases_of_the_undivided_cause(sizes, heads, blamed):
    batch = 64 * sizes["data"]
    factor = 16.0 if blamed else 2.0
    said = repeated(sizes, layout(sizes, heads, batch), int(factor * 10**12), 10**12, batch)
    assert said is not None
    assert ("does not divide what it is to split" in said) is blamed
