"""What a step's figures mean, over grids: the sentences against oracles this file
computes itself.

- the traffic a layout explains (`StepPlan.unexplained_traffic`) over mesh
  shapes (axes of size 1 among them) and the arguments' specs: against each
  array's bytes and its shard's, computed here from the shapes and the mesh
  (a sharded array gathered twice and its gradient reduce-scattered; a
  replicated one's gradient all-reduced), and said exactly where the
  collectives move more than 4 times that and 1 MiB beyond it;
- what would fit (`StepPlan.what_would_fit`) over peaks, temporaries,
  budgets and batches: the batch it names is the largest whose temporaries
  (scaling with it) fit beside the rest; the devices it names, the smallest
  power of two that divides the peak under the budget; remat said exactly
  where the temporaries are half the peak or more and the step is not known
  to rematerialise.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest
from hypothesis import assume, given
from hypothesis import strategies as hs
from jax.sharding import AxisType
from test_step_properties import examples

import spmdtree as st

NAMES = ("data", "fsdp", "tensor")
ROWS, COLS = 512, 768  # each argument (1.5 MiB): divisible by every drawn axis size


@hs.composite
def layouts(draw):
    """A mesh of up to three axes (sizes 1, 2, 4) and two or three f32 arguments,
    each dimension sharded over one axis or none."""
    names = draw(hs.lists(hs.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    shape = tuple(draw(hs.sampled_from([1, 2, 4])) for _ in names)
    assume(math.prod(shape) <= 8)
    specs = []
    for _ in range(draw(hs.integers(2, 3))):
        first, second = draw(hs.sampled_from([None, *names])), draw(hs.sampled_from([None, *names]))
        specs.append((first, second if second != first else None))
    return tuple(names), shape, tuple(specs)


@functools.cache
def preflighted(names, shape, specs):
    mesh = jax.sharding.AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    args = [st.Partitioned(jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32), s) for s in specs]
    return st.preflight(lambda *xs: sum(jnp.sum(x.value) for x in xs), *args, mesh=mesh)


def explained(names, shape, specs):
    """The bytes the layout explains, from the shapes and the mesh alone."""
    sizes = dict(zip(names, shape, strict=True))
    whole = ROWS * COLS * 4
    total = 0
    for spec in specs:
        used = {axis for axis in spec if axis is not None}
        shard = whole // math.prod(sizes[axis] for axis in used)
        if any(sizes[axis] > 1 for axis in used):
            total += 2 * whole + shard
        if any(sizes[axis] > 1 for axis in names if axis not in used):
            total += shard
    return total


@examples(40)
@given(
    layouts(),
    hs.floats(0, 8),
    hs.integers(0, 2 << 20),
    hs.sampled_from(["all-reduce", "all-gather"]),
    hs.data(),
)
def test_traffic_is_said_where_it_is_four_times_what_the_layout_explains_and_a_mib_beyond(
    layout, times, extra, kind, data
):
    names, shape, specs = layout
    step = preflighted(names, shape, specs)
    want = explained(names, shape, specs)
    measured = int(times * want) + extra  # around both thresholds
    axes = (data.draw(hs.sampled_from(names)),)
    row = st.Collective(kind, 1, measured, axes=axes, group=math.prod(shape))
    found = dataclasses.replace(step, collectives=(row,)).unexplained_traffic
    said = measured > 4 * want and measured - want > 1 << 20
    assert (found is not None) == said
    if found is not None:
        assert found.explained_bytes == want
        assert found.measured_bytes == measured
        # activations: reduced over axes that shard some argument
        sharding = {a for spec in specs for a in spec if a is not None}
        assert found.activations == (kind == "all-reduce" and axes[0] in sharding)


@examples(25)
@given(layouts())
def test_the_traffic_a_layout_explains_adds_up_each_arrays_own_share(layout):
    # one far larger collective: the explained share is then always stated
    names, shape, specs = layout
    step = preflighted(names, shape, specs)
    row = st.Collective("all-to-all", 1, 1 << 30, axes=names[:1], group=2)
    found = dataclasses.replace(step, collectives=(row,)).unexplained_traffic
    assert found is not None and found.explained_bytes == explained(names, shape, specs)


@hs.composite
def overs(draw):
    """A step over its budget: its fixed bytes (arrays) and temporaries, a budget
    below their sum, a batch, and whether it rematerialises."""
    fixed = draw(hs.integers(1 << 20, 1 << 34))
    temp = draw(hs.integers(1 << 20, 1 << 34))
    budget = draw(hs.integers(1 << 20, fixed + temp - 1))
    batch = draw(hs.one_of(hs.none(), hs.integers(1, 4096)))
    remat = draw(hs.sampled_from([None, False, True]))
    return fixed, temp, budget, batch, remat


@functools.cache
def small_step():
    mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,))
    x = st.Partitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("data", None))
    return st.preflight(lambda x: jnp.sum(x.value), x, mesh=mesh)


def number(pattern, text):
    found = re.search(pattern, text)
    return None if found is None else int(found.group(1).replace(",", ""))


@examples(60)
@given(overs())
def test_what_would_fit_names_the_largest_batch_the_fewest_devices_and_remat_where_it_helps(
    case,
):
    fixed, temp, budget, batch, remat = case
    base = small_step()
    step = dataclasses.replace(base, memory=st.Memory(fixed, 0, 0, temp, 0))
    assert step.peak_bytes == fixed + temp
    said = step.what_would_fit(budget, batch=batch, remat=remat)
    assert said is not None
    # the devices: the smallest power of two k with peak / k <= budget
    k = 1
    while (fixed + temp) / k > budget:
        k *= 2
    assert number(r"Spread over (\d+)x the devices", said) == k
    # remat: where not known to remat and the temporaries are half the peak or more
    assert ("rematerialising" in said) == (remat is not True and temp / (fixed + temp) >= 0.5)
    # the batch: the largest b with fixed + temp * b / batch <= budget
    if fixed >= budget:
        assert "A smaller batch cannot bring it under" in said
    elif batch is not None:
        largest = max(b for b in range(batch + 1) if fixed + temp * b / batch <= budget)
        if largest == 0:
            assert "No batch brings it under" in said
        else:
            assert number(r"A batch of at most ([\d,]+) \(from", said) == largest
    assert step.what_would_fit(fixed + temp, batch=batch, remat=remat) is None


def test_a_batch_of_one_over_the_budget_is_said_to_fit_no_batch():
    step = dataclasses.replace(small_step(), memory=st.Memory(100, 0, 0, 1000, 0))
    said = step.what_would_fit(1000, batch=1)
    assert "No batch brings it under" in said
    with pytest.raises(TypeError, match="batch"):
        step.what_would_fit(1000, batch="8")


@pytest.mark.parametrize("kind", ["all-reduce", "all-to-all", "all-gather"])
@pytest.mark.parametrize("axis", ["data", "fsdp"])
def test_only_a_reduction_over_the_arguments_own_axes_is_read_as_split_activations(kind, axis):
    # the arguments shard over fsdp only; data replicates them
    specs = (("fsdp", None), (None, "fsdp"))
    step = preflighted(("data", "fsdp"), (2, 4), specs)
    row = st.Collective(kind, 1, 1 << 30, axes=(axis,), group=2 if axis == "data" else 4)
    found = dataclasses.replace(step, collectives=(row,)).unexplained_traffic
    assert found.activations == (kind in ("all-reduce", "all-to-all") and axis == "fsdp")
    assert ("XLA likely split the activations" in found.sentence) == found.activations
