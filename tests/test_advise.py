"""layouts, Candidate, advise, Advice: candidates planned, compiled once each, ranked."""

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import spmdtree as st
from spmdtree._src.step import advise as advise_module

RULES = [("batch", "data"), ("mlp", "tensor"), ("embed", None)]
WIDE, MLP = 512, 4096  # a wide MLP: its gradients are megabytes, its activations kilobytes
HW = st.Hardware("test", 2**30, 1e14, {"ici": (1e11, 0.0), "dcn": (1e10, 0.0)}, devices_per_node=8)


def mlp_step(candidate):
    """One SGD step of a wide two-layer MLP at the candidate's batch."""
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, WIDE), jnp.float32), ("batch", "embed")
    )
    params = {
        "w1": st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((WIDE, MLP), jnp.float32), ("embed", "mlp")
        ),
        "w2": st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((MLP, WIDE), jnp.float32), ("mlp", "embed")
        ),
    }

    def step(params, x):
        def loss(p):
            h = st.with_logical_constraint(jnp.tanh(x.value @ p["w1"].value), ("batch", "mlp"))
            return jnp.mean((h @ p["w2"].value) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, (params, x), {"donate_argnums": 0}


@functools.cache
def small_batch_advice():
    """Every (data, tensor) layout of 8 devices at a batch of 8 (compiled in this process)."""
    candidates = [st.Candidate(m, RULES, batch=8) for m in st.layouts(8, ("data", "tensor"))]
    typo = st.Candidate(candidates[0].mesh, [("batch", "dtaa"), *RULES[1:]], batch=8, label="typo")
    return st.advise(mlp_step, [*candidates, typo], hardware=HW, progress=False)


def test_layouts_are_every_factorization():
    meshes = st.layouts(12)
    shapes = [tuple(m.shape.values()) for m in meshes]
    every = [s for s in itertools.product(range(1, 13), repeat=3) if math.prod(s) == 12]
    assert shapes == sorted(every)  # every one, in a fixed (lexicographic) order
    assert all(m.axis_names == ("data", "fsdp", "tensor") for m in meshes)
    assert all(t == AxisType.Auto for m in meshes for t in m.axis_types)


def test_layouts_respect_sizes_and_types():
    meshes = st.layouts(64, sizes={"tensor": (2, 8), "data": 2}, axis_types=AxisType.Explicit)
    shapes = [tuple(m.shape.values()) for m in meshes]
    assert shapes == [(2, 4, 8), (2, 8, 4), (2, 16, 2)]
    assert all(t == AxisType.Explicit for m in meshes for t in m.axis_types)
    assert [tuple(m.shape.values()) for m in st.layouts(1, ("a", "b"))] == [(1, 1)]


@pytest.mark.parametrize(
    "call, said",
    [
        (lambda: st.layouts(0), "devices is 0"),
        (lambda: st.layouts(8, ("data", "data")), "distinct"),
        (lambda: st.layouts(8, sizes={"model": 2}), "'model', which is not one of the axes"),
        (lambda: st.layouts(8, sizes={"tensor": (4, 2)}), r"sizes\['tensor'\]"),
        (lambda: st.layouts(8, sizes={"tensor": 3}), "no way to write 8 devices"),
        (lambda: st.layouts(8, ("a", "b"), axis_types=(AxisType.Auto,)), "one per axis"),
    ],
    ids=["devices", "repeated", "unknown-axis", "bounds", "unmet", "types"],
)
def test_layouts_mistakes(call, said):
    with pytest.raises(ValueError, match="^layouts: .*" + said):
        call()


def test_the_known_best_is_ranked_first():
    advice = small_batch_advice()
    # tensor parallelism moves activations (kilobytes); data parallelism all-reduces
    # the gradients (megabytes): every device on "tensor" wins.
    assert tuple(advice.best.candidate.mesh.shape.values()) == (1, 8)
    best, worst = advice.best.time, advice.rows[3].time
    assert tuple(advice.rows[3].candidate.mesh.shape.values()) == (8, 1)
    assert best.comm_seconds * 10 < worst.comm_seconds
    assert advice.compiles == 4  # the typo never compiles


def test_rows_are_ranked_by_bound_and_every_candidate_is_shown():
    advice = small_batch_advice()
    fits = [row.time.bound_seconds for row in advice.rows if row.verdict == "fits"]
    assert len(fits) == 4 and fits == sorted(fits)
    shown = str(advice)
    for row in advice.rows:
        assert advise_module.label_of(row.candidate) in shown and row.verdict in shown
    assert "roofline bound" in shown and "4 compiles" in shown


def test_a_typo_in_the_rules_is_a_row_with_the_message():
    row = small_batch_advice().rows[-1]
    assert row.candidate.label == "typo" and row.verdict == "does not compile"
    assert "'dtaa'" in row.reason and "Did you mean 'data'?" in row.reason
    assert row.step is None and row.time is None and row.tokens_per_second is None


def test_arrays_over_budget_are_not_compiled(capsys):
    mesh = st.layouts(8, ("data", "tensor"))
    replicated = st.Candidate(mesh[-1], RULES, batch=8, length=16)  # tensor 1: weights whole
    sharded = st.Candidate(mesh[0], RULES, batch=8, length=16)  # tensor 8
    budget = 3 * WIDE * MLP * 4 // 2  # 1.5 of the 2 weights whole: only sharded ones fit
    advice = st.advise(mlp_step, [replicated, sharded], hardware=HW, budget_bytes=budget)
    over = advice.rows[-1]
    assert over.candidate == replicated and over.verdict == "over budget" and over.step is None
    assert over.reason.startswith("arrays alone 16.0 MiB > 12.0 MiB")
    assert advice.compiles == 1 and advice.rows[0].verdict == "fits"
    assert advice.rows[0].tokens_per_second == pytest.approx(
        8 * 16 / advice.rows[0].time.bound_seconds
    )
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("advise [") for line in lines)


def test_subprocess_compiles_run_each_distinct_step_once(capsys):
    mesh = jax.sharding.AbstractMesh((2, 8), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    same = [st.Candidate(mesh, RULES, batch=16, label=f"copy {i}") for i in range(2)]
    other = st.Candidate(mesh, RULES, batch=32)
    advice = st.advise(mlp_step, [*same, other], hardware=HW, jobs=2, progress=False)
    assert advice.compiles == 2 and [row.verdict for row in advice.rows] == ["fits"] * 3
    assert advice.rows[0].step.backend == "cpu" and advice.rows[0].step.mesh == mesh
    assert capsys.readouterr().err == ""
    # the same figures as preflight's own
    fn, args, kwargs = mlp_step(other)
    alone = st.preflight(fn, *args, mesh=mesh, rules=RULES, **kwargs)
    row = next(r for r in advice.rows if r.candidate == other)
    assert (row.step.peak_bytes, row.step.collectives) == (alone.peak_bytes, alone.collectives)


def test_kwargs_naming_the_mesh_are_refused_at_once():
    mesh = st.layouts(2, ("data",))[0]

    def make_step(candidate):
        fn, args, kwargs = mlp_step(candidate)
        return fn, args, {**kwargs, "mesh": mesh}

    with pytest.raises(ValueError, match=r"advise: make_step returned kwargs with \['mesh'\]"):
        st.advise(make_step, [st.Candidate(mesh, RULES, 2)], hardware=HW, progress=False)


def test_across_batches_the_bound_per_sequence_ranks():
    step = small_batch_advice().best.step
    small, large = (st.Candidate(step.mesh, RULES, batch=b) for b in (8, 32))
    search = advise_module._Search(HW, None, step.peak_bytes, False, [small, large])
    search.judge(0, dataclasses.replace(step, flops=10**14))  # 1 s for 8 sequences
    search.judge(1, dataclasses.replace(step, flops=2 * 10**14))  # 2 s for 32
    assert [row.candidate.batch for row in search.ranked()] == [32, 8]


def test_equal_bounds_rank_by_the_serial_time():
    step = small_batch_advice().best.step
    candidates = [st.Candidate(step.mesh, RULES, batch=8, label=str(i)) for i in range(2)]
    search = advise_module._Search(HW, None, step.peak_bytes, False, candidates)
    compute_bound = dataclasses.replace(step, flops=10**14)  # 1 s, more than its collectives
    fewer = dataclasses.replace(compute_bound, collectives=step.collectives[:0])
    search.judge(0, compute_bound)
    search.judge(1, fewer)
    ranked = search.ranked()
    assert ranked[0].time.bound_seconds == ranked[1].time.bound_seconds
    assert [row.candidate.label for row in ranked] == ["1", "0"]


def test_a_failing_make_step_is_a_row():
    mesh = st.layouts(2, ("data",))[0]

    def make_step(candidate):
        raise RuntimeError("no such model")

    advice = st.advise(make_step, [st.Candidate(mesh, RULES, 2)], hardware=HW, progress=False)
    assert advice.rows[0].reason == "make_step raised RuntimeError: no such model"
    assert advice.best is None and advice.compiles == 0


def test_ranking_puts_fits_then_may_fit_then_over_then_not_compiled():
    step = small_batch_advice().best.step
    mesh = step.mesh
    candidates = [st.Candidate(mesh, RULES, batch=8, label=str(i)) for i in range(6)]
    search = advise_module._Search(HW, None, step.peak_bytes, False, candidates)
    slow = dataclasses.replace(step, flops=10**14)  # one second of compute
    over = dataclasses.replace(step, temp_bytes=step.temp_bytes + 100)
    may = dataclasses.replace(over, overstated_bytes=100)
    search.row(0, "does not compile", "a typo")
    search.row(1, "over budget", "arrays alone")
    search.judge(2, over)
    search.judge(3, slow)
    search.judge(4, may)
    search.judge(5, step)
    ranked = search.ranked()
    assert [row.candidate.label for row in ranked] == ["5", "3", "4", "2", "1", "0"]
    assert [row.verdict for row in ranked] == [
        "fits",
        "fits",
        "may fit",
        "over budget",
        "over budget",
        "does not compile",
    ]
    assert "overstated by up to 100 B" in ranked[2].reason


def test_static_argnums_out_of_range_is_the_candidates_row():
    mesh = st.layouts(2, ("data",))[0]

    def make_step(candidate):
        step, args, kwargs = mlp_step(candidate)
        return step, args, {**kwargs, "static_argnums": 2}  # two arguments: 0 and 1

    advice = st.advise(make_step, [st.Candidate(mesh, RULES, 2)], hardware=HW, progress=False)
    (row,) = advice.rows
    assert row.verdict == "does not compile" and advice.compiles == 0
    assert "static_argnums holds 2" in row.reason and "2 arguments" in row.reason
