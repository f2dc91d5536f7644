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


# --- rules that match nothing ------------------------------------------------

# flax names its attention kernels ('embed', 'kv'): a ('heads', 'tensor') rule
# matches nothing; 'batch' names only activations, constrained inside the step.
LM_RULES = [("batch", "data"), ("embed", None), ("heads", "tensor"), ("kv", None)]


def _lm_step(w, x):
    h = st.with_logical_constraint(x @ w.value, ("batch", "kv"))
    return jnp.sum(h**2)


def _lm_args():
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((16, 32), jnp.float32), ("embed", "kv"))
    return w, jax.ShapeDtypeStruct((8, 16), jnp.float32)


def test_preflight_says_which_rules_match_nothing_and_counts_activations_as_used():
    mesh = abstract_mesh((2, 2), ("data", "tensor"))
    w, x = _lm_args()
    step = st.preflight(_lm_step, w, x, mesh=mesh, rules=LM_RULES)
    # the oracle: validate_rules over the boxes alone, less the names the step constrains
    unused = [i for i, (name, _) in enumerate(LM_RULES) if name not in {"embed", "kv", "batch"}]
    assert [(p.rule, p.name) for p in step.rule_problems] == [(i, LM_RULES[i][0]) for i in unused]
    assert step.rule_problems == (
        st.RuleProblem(
            2,
            "heads",
            "rule 2 ('heads', 'tensor') is never used: no box in the step's arguments has the "
            "logical name 'heads', and no with_logical_constraint in the step names it. Check "
            "the name against the boxes' names (st.plan shows them), or drop the rule.",
        ),
    )
    # validate_rules, which sees no activations, calls 'batch' unused too
    said = st.validate_rules(LM_RULES, mesh, w)
    assert [s for s in said if "is never used" in s] == [
        "rule 0 ('batch', 'data') is never used: no box in the tree has the logical name 'batch'.",
        "rule 2 ('heads', 'tensor') is never used: no box in the tree has the logical name "
        "'heads'.",
    ]


def test_preflight_rule_problems_are_validate_rules_own_on_the_mesh():
    # a rule naming an axis the mesh lacks, and one never reached: the same sentences
    rules = [
        ("embed", "data"),
        ("heads", "fsdp"),
        ("embed", "tensor"),
        ("batch", None),
        ("kv", None),
    ]
    mesh = abstract_mesh((2, 2), ("data", "tensor"))
    w, x = _lm_args()
    step = st.preflight(_lm_step, w, x, mesh=mesh, rules=rules)
    said = st.validate_rules(rules, mesh, w)
    assert len(said) == 4  # rule 1's axis, 'batch' and 'heads' unused, rule 2 never reached
    absent, reached = said[0], said[3]
    assert absent.startswith("rule 1 ('heads', 'fsdp') names mesh axis 'fsdp'")
    assert reached.startswith("rule 2 ('embed', 'tensor') is never reached")
    assert [p.sentence for p in step.rule_problems if "never used" not in p.sentence] == [
        absent,
        reached,
    ]
    assert [(p.rule, p.name) for p in step.rule_problems] == [
        (1, "heads"),
        (1, "heads"),
        (2, "embed"),
    ]


def test_rules_all_used_say_nothing():
    mesh = abstract_mesh((2,), ("data",))
    w, x = _lm_args()
    rules = [("batch", "data"), ("embed", None), ("kv", None)]
    assert st.preflight(_lm_step, w, x, mesh=mesh, rules=rules).rule_problems == ()
