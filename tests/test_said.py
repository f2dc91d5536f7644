"""Said, not silent: a step that raises keeps its exception; what preflight and
advise would otherwise leave unsaid (rules that match nothing, collectives the
params' layout does not explain, nothing that fits)."""

import dataclasses
import math
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


@pytest.mark.parametrize("where", ["abstract", "devices"])
def test_compile_seconds_count_the_trace_once(where):
    # The step sleeps while it is traced, so the trace takes at least that long: a
    # trace counted twice would put compile_seconds above the whole call's wall time.
    # An AbstractMesh compiles in a child, a Mesh of this process's devices here.
    tracing = 0.3
    mesh = abstract_mesh((2,), ("data",))
    if where == "devices":
        mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])

    def slow_to_trace(x):
        time.sleep(tracing)
        return jnp.sin(x) * 2

    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    start = time.perf_counter()
    step = st.preflight(slow_to_trace, x, mesh=mesh)
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


def test_a_rule_that_matches_nothing_is_in_the_step_table_and_the_advise_table():
    mesh = abstract_mesh((2, 2), ("data", "tensor"))
    w, x = _lm_args()
    (problem,) = st.preflight(_lm_step, w, x, mesh=mesh, rules=LM_RULES).rule_problems
    shown = str(st.preflight(_lm_step, w, x, mesh=mesh, rules=LM_RULES))
    assert f"! {problem.sentence}" in shown.splitlines()
    advice = st.advise(
        lambda c: (_lm_step, _lm_args(), {}),
        [st.Candidate(mesh, LM_RULES, batch=8)],
        hardware=st.hardware("h100"),
        progress=False,
    )
    assert problem.sentence in advice.note
    assert " ".join(str(advice).split()).count(problem.sentence) == 1  # wrapped, once


def test_rules_all_used_say_nothing():
    mesh = abstract_mesh((2,), ("data",))
    w, x = _lm_args()
    rules = [("batch", "data"), ("embed", None), ("kv", None)]
    assert st.preflight(_lm_step, w, x, mesh=mesh, rules=rules).rule_problems == ()


# --- collectives the layout does not explain ---------------------------------

FSDP_RULES = [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", None), ("vocab", None)]
V, D, M, B, S = 512, 256, 1024, 64, 128  # vocabulary, width, hidden, batch, length


def _lm_params():
    f32 = jnp.float32
    return {
        "embed": st.LogicallyPartitioned(jax.ShapeDtypeStruct((V, D), f32), ("vocab", "embed")),
        "w1": st.LogicallyPartitioned(jax.ShapeDtypeStruct((D, M), f32), ("embed", "mlp")),
        "w2": st.LogicallyPartitioned(jax.ShapeDtypeStruct((M, D), f32), ("mlp", "embed")),
    }


def _train_step(constrain):
    """A one-layer LM's SGD step; its activations constrained, or left to XLA."""

    def c(x, names):
        return st.with_logical_constraint(x, names) if constrain else x

    def loss(p, tokens):
        p = st.unbox(p)
        x = c(p["embed"][tokens.value], ("batch", None, "embed"))
        h = c(jax.nn.relu(x @ p["w1"]), ("batch", None, "mlp"))
        y = c(h @ p["w2"] + x, ("batch", None, "embed"))
        return jnp.mean(jax.nn.logsumexp(y @ p["embed"].T, -1))

    def step(p, tokens):
        grads = jax.grad(loss)(p, tokens)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

    return step


_FSDP_STEPS = {}


def _fsdp_step(constrain):
    """The step preflighted on data 2 x fsdp 4 (Auto axes), compiled once per module."""
    if constrain not in _FSDP_STEPS:
        tokens = st.LogicallyPartitioned(jax.ShapeDtypeStruct((B, S), jnp.int32), ("batch", None))
        mesh = abstract_mesh((2, 4), ("data", "fsdp"))
        _FSDP_STEPS[constrain] = st.preflight(
            _train_step(constrain), _lm_params(), tokens, mesh=mesh, rules=FSDP_RULES
        )
    return _FSDP_STEPS[constrain]


def _explained_by_hand():
    """The oracle, from the shapes: each weight (sharded over fsdp, 4 ways, and
    replicated over data) gathered whole twice, its gradient reduce-scattered to
    its shard and that shard all-reduced over data; the tokens, sharded over
    both axes (8 ways), count as if they were a weight too, gathered twice and
    reduce-scattered."""
    weights, tokens = 4 * (V * D + D * M + M * D), 4 * B * S
    return 2 * weights + weights // 4 + weights // 4 + 2 * tokens + tokens // 8


def test_activations_xla_split_over_the_fsdp_axis_are_said():
    step = _fsdp_step(constrain=False)
    found = step.unexplained_traffic
    assert found is not None
    assert found.explained_bytes == _explained_by_hand()
    assert found.measured_bytes == sum(c.bytes for c in step.collectives)
    assert found.measured_bytes > 4 * found.explained_bytes
    assert found.largest == max(step.collectives, key=lambda c: c.bytes)
    assert found.largest.kind == "all-reduce" and found.largest.axes == ("fsdp",)
    assert found.activations
    assert "constrain the activations with `st.with_logical_constraint`" in found.sentence
    assert "over ('fsdp',)" in found.sentence


def test_the_same_step_with_its_activations_constrained_says_nothing():
    step = _fsdp_step(constrain=True)
    assert step.unexplained_traffic is None
    assert sum(c.bytes for c in step.collectives) <= 4 * _explained_by_hand()
    # and the constraints are what changed it: far less moves
    assert (
        4 * sum(c.bytes for c in step.collectives)
        < _fsdp_step(False).unexplained_traffic.measured_bytes
    )


def _moving(step, *collectives):
    """What the step's record would say, had its compile run these collectives."""
    return dataclasses.replace(step, collectives=collectives).unexplained_traffic


def _all_reduce(n, axes=("fsdp",)):
    return st.Collective("all-reduce", 1, n, axes=axes, group=4)


def test_traffic_is_said_only_past_four_times_what_the_layout_explains():
    step = _fsdp_step(constrain=True)
    explained = _explained_by_hand()
    assert _moving(step, _all_reduce(4 * explained)) is None
    assert _moving(step, _all_reduce(4 * explained + 1)).measured_bytes == 4 * explained + 1
    # with nothing explained, an excess of 1 MiB or less is not said: toy steps
    bare = dataclasses.replace(step, inputs=st.plan({}, step.mesh))
    assert _moving(bare, _all_reduce(1 << 20, ("data",))) is None
    assert _moving(bare, _all_reduce((1 << 20) + 1, ("data",))).sentence.startswith(
        "The collectives move 1.0 MiB per device per step, far more than the layout of the "
        "arguments explains (0 B at most: "
    )
    # a gather moves the most: not activations reduced over the weights' axes
    gathered = st.Collective("all-gather", 1, 8 * explained, axes=("data",), group=2)
    other = _moving(step, _all_reduce(explained), gathered)
    assert other.largest == gathered and not other.activations
    assert "Something other than the arguments' layout moves them" in other.sentence


# --- nothing fits --------------------------------------------------------------

GiB = 2**30


def _peaking(arrays, temps):
    """A compiled step's record with these figures: arrays `arrays` bytes, temporaries `temps`."""
    return dataclasses.replace(_fsdp_step(constrain=True), memory=st.Memory(arrays, 0, 0, temps, 0))


def test_a_step_over_budget_says_by_how_much_and_what_would_bring_it_under():
    step = _peaking(10 * GiB, 30 * GiB)
    budget, batch = 32 * GiB, 256
    said = step.what_would_fit(budget, batch=batch, remat=False)
    largest = math.floor(batch * (budget - 10 * GiB) / (30 * GiB))  # temporaries scale with it
    assert said == (
        "The step's peak, 40.0 GiB, is 8.0 GiB (25%) over the budget of 32.0 GiB. "
        "Its temporaries (activations among them) are 30.0 GiB, 75% of the peak: "
        "rematerialising the layers (`jax.checkpoint`) could bring it under. "
        "Spread over 2x the devices (16), with the arrays and the batch sharded over them, its "
        f"peak would be about 1/2: under. A batch of at most {largest} (from 256) could bring "
        "it under."
    )
    assert largest == 187


@pytest.mark.parametrize(
    "arrays, temps, remat, says, does_not_say",
    [
        (10, 30, True, [], ["rematerialising"]),  # it already does
        (10, 30, None, ["(`jax.checkpoint`), if the step does not already, could"], []),
        (30, 4, False, ["A batch of at most 32 (from 64)"], ["rematerialising"]),  # 12% temps
        (40, 30, False, ["A smaller batch cannot bring it under", "(40.0 GiB)"], []),
        (10, 200, False, ["Spread over 8x the devices (64)"], []),
    ],
    ids=["already-remat", "remat-unknown", "arrays-dominate", "arrays-over", "far-over"],
)
def test_what_would_fit_follows_the_figures(arrays, temps, remat, says, does_not_say):
    said = _peaking(arrays * GiB, temps * GiB).what_would_fit(32 * GiB, batch=64, remat=remat)
    for part in says:
        assert part in said
    for part in does_not_say:
        assert part not in said


def test_a_step_that_fits_needs_nothing_and_a_bad_batch_is_said():
    step = _peaking(10 * GiB, 30 * GiB)
    assert step.what_would_fit(40 * GiB) is None
    assert "a batch of at most 73% of this one" in step.what_would_fit(32 * GiB).lower()
    with pytest.raises(TypeError, match=r"^what_would_fit: batch is 2.5; expected an int"):
        step.what_would_fit(32 * GiB, batch=2.5)
    with pytest.raises(TypeError, match=r"^fits: budget_bytes is '32'"):
        step.what_would_fit("32")


# --- jax's own messages, with what to do (0.6) ---------------------------------------


def _sharded_by_out_sharding(x, w):
    """A step that shards its result as flax.nnx's Gemma does: by out_sharding=."""
    return jnp.einsum("bd,df->bf", x, w, out_sharding=jax.sharding.PartitionSpec("data", None))


def test_a_step_sharding_by_out_sharding_on_auto_axes_is_told_to_use_explicit_axes():
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    with pytest.raises(ValueError) as info:
        st.preflight(_sharded_by_out_sharding, x, w, mesh=abstract_mesh((2,), ("data",)))
    said = str(info.value)
    assert "cannot contain axis names that are of type Auto" in said  # jax's own words
    assert said.endswith(
        "(the step shards its results by out_sharding=, which needs Explicit mesh axes: build "
        "the mesh with axis_types=jax.sharding.AxisType.Explicit (st.layouts(devices, names, "
        "axis_types=AxisType.Explicit) for advise))"
    )
    # on Explicit axes the same step traces
    explicit = abstract_mesh((2,), ("data",), kind=AxisType.Explicit)
    assert st.preflight(_sharded_by_out_sharding, x, w, mesh=explicit).flops > 0
