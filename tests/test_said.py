"""Said, not silent: a step that raises keeps its exception; what preflight and
advise would otherwise leave unsaid (rules that match nothing, collectives the
params' layout does not explain, nothing that fits)."""

import time
import traceback

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import spmdtree as st


def abstract_mesh(shape, names, kind=AxisType.Auto):
    return jax.sharding.AbstractMesh(shape, names, axis_types=(kind,) * len(names))


def _step_with_a_typo(params):
    return params["w"] * 2  # the tree holds "v": a KeyError of the user's own


@pytest.mark.parametrize("devices", [2, 64], ids=["lowered-here", "exported"])
def test_a_step_that_raises_keeps_the_users_exception_and_frame(devices):
    mesh = abstract_mesh((devices,), ("data",))
    with pytest.raises(ValueError) as info:
        st.preflight(_step_with_a_typo, {"v": jax.ShapeDtypeStruct((4,), jnp.float32)}, mesh=mesh)
    error = info.value
    assert str(error) == (
        "preflight: the step does not trace with its arguments (args[0]: f32[4]): KeyError: 'w'"
    )
    assert type(error.__cause__) is KeyError and error.__cause__.args == ("w",)
    frames = traceback.extract_tb(error.__cause__.__traceback__)
    assert _step_with_a_typo.__name__ in [frame.name for frame in frames]
    assert (
        frames[-1].line
        == 'return params["w"] * 2  # the tree holds "v": a KeyError of the user\'s own'
    )


def test_jax_own_sharding_error_is_the_cause_and_named():
    # Explicit axes: a batch split over "data" meets a weight whose output dimension
    # is split over "data" too, so the product would use the axis twice.
    mesh = abstract_mesh((2,), ("data",), AxisType.Explicit)
    w = st.Partitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), (None, "data"))
    x = st.Partitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), ("data", None))
    with pytest.raises(ValueError) as info:
        st.preflight(lambda w, x: x.value @ w.value, w, x, mesh=mesh)
    cause = info.value.__cause__
    assert type(cause).__name__ == "ShardingTypeError"
    assert str(info.value).endswith(f"args[1]: f32[4,8]): ShardingTypeError: {cause}")


def test_a_mistake_of_spmdtree_own_is_still_raised_alone():
    # a user mistake found by spmdtree (not an exception of the step) chains to nothing
    with pytest.raises(ValueError) as info:
        st.preflight(jnp.sin, jnp.zeros(4), mesh=abstract_mesh((2,), ("data",)), static_argnums=3)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_compile_seconds_count_the_trace_once():
    # The step sleeps while it is traced, so the trace takes at least that long: a
    # trace counted twice would put compile_seconds above the whole call's wall time.
    tracing = 0.3

    def slow_to_trace(x):
        time.sleep(tracing)
        return jnp.sin(x) * 2

    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    start = time.perf_counter()
    step = st.preflight(slow_to_trace, x, mesh=abstract_mesh((2,), ("data",)))
    wall = time.perf_counter() - start
    assert tracing <= step.compile_seconds <= wall
