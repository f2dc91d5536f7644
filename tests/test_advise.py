"""layouts, Candidate, advise, Advice: candidates planned, compiled once each, ranked."""

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import pickle
import random
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import spmdtree as st

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


def label(candidate):
    """What the table calls a candidate without a label: its mesh's axis sizes."""
    return candidate.label or " x ".join(f"{a} {n}" for a, n in candidate.mesh.shape.items())


def recording(make_step):
    """`make_step`, and the candidates it was called with."""
    calls = []

    def recorded(candidate):
        calls.append(candidate)
        return make_step(candidate)

    return recorded, calls


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


def test_layouts_over_devices_are_meshes_of_those_devices():
    """Given the devices (new in 0.8), the same shapes as their count gives, each a real
    Mesh over exactly those devices, of the axis types asked."""
    devices = jax.devices()[:4]
    meshes = st.layouts(devices, ("data", "tensor"), axis_types=AxisType.Explicit)
    assert [tuple(m.shape.values()) for m in meshes] == [
        tuple(m.shape.values()) for m in st.layouts(4, ("data", "tensor"))
    ]
    for mesh in meshes:
        assert isinstance(mesh, jax.sharding.Mesh)
        assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
        assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    # an array of them (a Mesh's devices) and a numpy count are taken as well
    assert [m.devices.size for m in st.layouts(np.array(devices), ("data",))] == [4]
    assert len(st.layouts(np.int64(4), ("data", "tensor"))) == len(meshes)
    with pytest.raises(ValueError, match=r"^layouts: devices is empty; expected jax devices"):
        st.layouts([])
    with pytest.raises(ValueError, match=r"^layouts: devices lists .* more than once; give each"):
        st.layouts([devices[0], devices[0]], ("data",))
    with pytest.raises(TypeError, match=r"^layouts: devices is \['cpu:0'\]; expected how many"):
        st.layouts(["cpu:0"])
    with pytest.raises(TypeError, match=r"^layouts: devices is 8.0; expected how many"):
        st.layouts(8.0)


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
        assert label(row.candidate) in shown and row.verdict in shown
    assert "bound, a roofline" in shown and "4 compiles" in shown


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
    # at the time it ranks by: the prediction (0.5: the bound's)
    assert advice.rows[0].time.predicted_seconds is not None
    assert advice.rows[0].tokens_per_second == pytest.approx(
        8 * 16 / advice.rows[0].time.predicted_seconds
    )
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("advise: 2 candidates on 8 devices, at most 2 compiles")
    assert len(lines) == 3 and all(line.startswith("advise [") for line in lines[1:])


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


def test_a_failing_make_step_is_a_row():
    mesh = st.layouts(2, ("data",))[0]

    def make_step(candidate):
        raise RuntimeError("no such model")

    advice = st.advise(make_step, [st.Candidate(mesh, RULES, 2)], hardware=HW, progress=False)
    assert advice.rows[0].reason == "make_step raised RuntimeError: no such model"
    assert advice.best is None and advice.compiles == 0


def test_static_argnums_out_of_range_is_the_candidates_row():
    mesh = st.layouts(2, ("data",))[0]

    def make_step(candidate):
        step, args, kwargs = mlp_step(candidate)
        return step, args, {**kwargs, "static_argnums": 2}  # two arguments: 0 and 1

    advice = st.advise(make_step, [st.Candidate(mesh, RULES, 2)], hardware=HW, progress=False)
    (row,) = advice.rows
    assert row.verdict == "does not compile" and advice.compiles == 0
    assert "static_argnums holds 2" in row.reason and "2 arguments" in row.reason


def _mesh(*sizes):
    return next(m for m in st.layouts(8, ("data", "tensor")) if tuple(m.shape.values()) == sizes)


def _peak(candidate):
    fn, args, kwargs = mlp_step(candidate)
    return st.preflight(fn, *args, mesh=candidate.mesh, rules=candidate.rules, **kwargs).peak_bytes


def test_every_verdict_in_its_place():
    tensor8, data8 = _mesh(1, 8), _mesh(8, 1)
    fits, tight, over = (st.Candidate(tensor8, RULES, b, label=f"batch {b}") for b in (8, 64, 512))
    budget = math.ceil(_peak(tight) / 0.99)  # the batch of 64 at 99% of its budget
    assert _peak(fits) <= 0.95 * budget < budget < _peak(over)  # the test's own premise
    arrays = st.Candidate(data8, RULES, 8, label="weights whole")  # 16 MiB of weights
    unsharded = st.Candidate(data8, RULES, 12, label="12 on data 8")
    typo = st.Candidate(tensor8, [("batch", "dtaa"), *RULES[1:]], 8, label="typo")
    given = [typo, unsharded, arrays, over, tight, fits]
    advice = st.advise(mlp_step, given, hardware=HW, budget_bytes=budget, progress=False)
    assert [row.candidate.label for row in advice.rows] == [c.label for c in reversed(given)]
    assert [row.verdict for row in advice.rows] == [
        "fits",
        "tight",
        "over budget",  # compiled: its peak
        "over budget",  # not compiled: its arrays alone
        "batch unsharded",
        "does not compile",
    ]
    assert advice.best.candidate == fits  # a tight row is not the best
    assert "within 5% of it" in advice.rows[1].reason
    assert advice.rows[2].step is not None and advice.rows[3].step is None
    assert advice.compiles == 3  # neither rejected candidate compiles


def on_mesh_axes(candidate):
    """`mlp_step` with its batch on mesh axes directly, not a logical name."""
    fn, (params, x), kwargs = mlp_step(candidate)
    return fn, (params, st.Partitioned(x.value, ("data", None))), kwargs


@pytest.mark.parametrize("make_step", [mlp_step, on_mesh_axes], ids=["logical", "mesh-axes"])
def test_a_batch_its_axes_do_not_divide_is_no_layout(make_step):
    data8 = _mesh(8, 1)
    unsharded, sharded = st.Candidate(data8, RULES, 12), st.Candidate(data8, RULES, 16)
    advice = st.advise(make_step, [unsharded, sharded], hardware=HW, progress=False)
    best, row = advice.rows
    assert best.candidate == sharded and best.verdict == "fits"
    assert row.verdict == "batch unsharded" and row.step is None
    assert row.reason.startswith(
        "batch 12 is not divided by its batch axes data (8): every device would compute the "
        "whole batch"
    )
    assert any("left unsharded" in flag for flag in row.flags)  # the plan's own flag, apart


def test_candidates_over_different_device_counts_are_refused_before_any_step():
    make_step, calls = recording(mlp_step)
    candidates = [
        st.Candidate(_mesh(2, 4), RULES, 8),
        st.Candidate(st.layouts(4, ("data", "tensor"))[0], RULES, 8),
    ]
    with pytest.raises(ValueError, match=r"^advise: .*device counts: 8 \(1 candidate.*4 \(1 cand"):
        st.advise(make_step, candidates, hardware=HW, progress=False)
    assert calls == []


@pytest.mark.parametrize(
    "options, kind, said",
    [
        (
            {"budget_bytes": 1.5e9},
            TypeError,
            r"budget_bytes is 1500000000.0 .*Pass int\(1500000000.0\)",
        ),
        ({"budget_bytes": 0}, ValueError, "budget_bytes is 0"),
        ({"jobs": 0}, ValueError, "jobs is 0"),
        ({"devices_per_node": 0}, ValueError, "devices_per_node is 0"),
    ],
    ids=["float-budget", "zero-budget", "jobs", "devices-per-node"],
)
def test_bad_options_are_refused_before_any_step(options, kind, said):
    make_step, calls = recording(mlp_step)
    with pytest.raises(kind, match="^advise: " + said):
        st.advise(make_step, [st.Candidate(_mesh(2, 4), RULES, 8)], hardware=HW, **options)
    assert calls == []


@pytest.mark.parametrize(
    "hardware, kind, fix",
    [
        ("h900", ValueError, r"which is no preset; pass a preset's name \('a100'"),
        (None, TypeError, r"expected a st.Hardware, a preset's name \('a100'"),
    ],
    ids=["no-preset-of-that-name", "none"],
)
def test_hardware_that_is_not_a_hardware_says_how_to_make_one(hardware, kind, fix):
    # 0.8: a preset's name or a Hardware JSON's path is taken as the hardware
    make_step, calls = recording(mlp_step)
    with pytest.raises(kind, match=rf"^advise: hardware is {hardware!r}.*{fix}"):
        st.advise(make_step, [st.Candidate(_mesh(2, 4), RULES, 8)], hardware=hardware)
    assert calls == []


@pytest.mark.parametrize(
    "returned",
    [lambda fn, args, kwargs: (fn, args), lambda fn, args, kwargs: (fn, kwargs, args)],
    ids=["two-values", "swapped"],
)
def test_a_make_step_of_the_wrong_shape_says_what_it_must_return(returned):
    def make_step(candidate):
        return returned(*mlp_step(candidate))

    with pytest.raises(
        TypeError, match=r"^advise: make_step returned .*it must return \(fn, args, kwargs\)"
    ):
        st.advise(make_step, [st.Candidate(_mesh(2, 4), RULES, 8)], hardware=HW, progress=False)


def test_equal_throughput_ranks_the_smaller_peak_first():
    def make_step(candidate):
        fn, (params, x), kwargs = mlp_step(candidate)
        if candidate.label != "more memory":
            return fn, (params, x), kwargs
        # the same dots and collectives, and a replicated 4 MiB more to hold
        extra = jax.ShapeDtypeStruct((2**20,), jnp.float32)
        return (lambda params, x, extra: (fn(params, x), extra + 1)), (params, x, extra), kwargs

    mesh = _mesh(1, 8)
    more, less = (st.Candidate(mesh, RULES, 8, label=t) for t in ("more memory", "less memory"))
    advice = st.advise(make_step, [more, less], hardware=HW, progress=False)
    first, second = advice.rows
    assert first.time.bound_seconds == second.time.bound_seconds  # the premise: a tie
    assert first.step.peak_bytes < second.step.peak_bytes
    assert first.candidate == less


def test_across_batches_the_bound_per_sequence_ranks():
    mesh = _mesh(8, 1)  # data parallel: the gradients' all-reduce costs the same at any batch
    small, large = (st.Candidate(mesh, RULES, b) for b in (8, 32))
    advice = st.advise(mlp_step, [small, large], hardware=HW, progress=False)
    first, second = advice.rows
    assert first.candidate == large and first.time.bound_seconds >= second.time.bound_seconds
    assert first.time.bound_seconds / 32 < second.time.bound_seconds / 8


def test_the_reason_of_a_row_that_fits_is_its_peak_and_its_flags_are_apart():
    advice = st.advise(
        mlp_step, [st.Candidate(_mesh(1, 8), RULES, 512)], hardware=HW, progress=False
    )
    (row,) = advice.rows
    assert row.verdict == "fits"
    assert re.fullmatch(
        r"peak \d+\.\d MiB of 1\.0 GiB budget; bound by (compute|collectives, most over \w+)",
        row.reason,
    )
    replicated = [flag for flag in row.flags if "replicated on every device" in flag]
    # x: 512 x 512 f32, whole; its path as the caller passed it (0.4 lost "args")
    assert replicated == ["args[1]: 1.0 MiB replicated on every device"]
    assert "! 1 array replicated on every device, 1.0 MiB: args[1]" in str(advice)


def test_the_table_says_what_the_budget_is():
    default = small_batch_advice()
    assert "budget 1.0 GiB per device: the test's whole memory" in str(default)
    assert "within 5%" in str(default)
    # hardware spmdtree knows no platform of: nothing said of GPU preallocation
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in str(default)
    given = st.advise(
        mlp_step,
        [st.Candidate(_mesh(1, 8), RULES, 8)],
        hardware=HW,
        budget_bytes=2**29,
        progress=False,
    )
    assert "budget 512.0 MiB per device, as given (the test has 1.0 GiB)" in str(given)


@pytest.mark.parametrize(
    ("preset", "said", "unsaid"),
    [
        ("h100", "XLA_PYTHON_CLIENT_MEM_FRACTION", "runtime"),
        ("tpu-v5p", "on TPU, the runtime keeps some of it", "XLA_PYTHON_CLIENT_MEM_FRACTION"),
    ],
)
def test_the_budget_line_fits_the_platform(preset, said, unsaid):
    row = st.AdviceRow(
        st.Candidate(_mesh(1, 8), RULES, 8), "does not compile", "x", None, None, None
    )
    hardware = st.hardware(preset)
    advice = st.Advice((row,), 0, hardware, hardware.memory_bytes)
    line = str(advice).splitlines()[1]
    gib = f"{hardware.memory_bytes / 2**30:.1f} GiB"
    assert line.startswith(f"budget {gib} per device: the {preset}'s whole memory")
    assert said in str(advice) and unsaid not in str(advice)


def test_progress_says_what_comes_then_each_candidate_whole(capsys):
    typo = st.Candidate(_mesh(2, 4), [("batch", "dtaa"), *RULES[1:]], 8, label="typo")
    candidates = [st.Candidate(_mesh(2, 4), RULES, 8), typo]
    advice = st.advise(mlp_step, candidates, hardware=HW, jobs=1)
    first, *lines = capsys.readouterr().err.splitlines()
    assert first == (
        "advise: 2 candidates on 8 devices, at most 2 compiles (each distinct step once), "
        "1 job at once; screened on the CPU estimate"
    )
    assert len(lines) == 2
    assert re.search(r"; about \d+ s left$|; under 1 s left$", lines[0])
    assert re.search(r"; done in (\d+ s|under 1 s)$", lines[1])
    for row in advice.rows:  # each reason whole, however long
        assert any(row.reason in line for line in lines)
    assert len(typo_reason := advice.rows[-1].reason) > 120, typo_reason


def test_the_winner_as_a_real_mesh_runs_preflight():
    candidate = st.Candidate(_mesh(2, 4), RULES, 8)
    advice = st.advise(mlp_step, [candidate], hardware=HW, progress=False)
    mesh = advice.best.make_mesh()
    assert isinstance(mesh, jax.sharding.Mesh)
    assert (mesh.axis_names, mesh.axis_sizes) == (("data", "tensor"), (2, 4))
    assert mesh.axis_types == (AxisType.Auto,) * 2  # layouts' own, not jax.make_mesh's default
    fn, args, kwargs = mlp_step(candidate)
    step = st.preflight(fn, *args, mesh=mesh, rules=RULES, **kwargs)
    assert step.peak_bytes == advice.best.step.peak_bytes
    assert step.collectives == advice.best.step.collectives


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_make_mesh_keeps_the_candidates_axis_types(kind):
    abstract = st.layouts(8, ("data", "tensor"), sizes={"data": 2}, axis_types=kind)[0]
    row = st.AdviceRow(st.Candidate(abstract, RULES, 8), "fits", "", None, None, None)
    mesh = row.make_mesh()
    assert (mesh.axis_names, mesh.axis_sizes, mesh.axis_types) == (
        abstract.axis_names,
        abstract.axis_sizes,
        (kind, kind),
    )


def test_make_mesh_refuses_a_device_given_twice():
    row = small_batch_advice().best
    with pytest.raises(ValueError, match=r"^make_mesh: devices holds .* more than once"):
        row.make_mesh([jax.devices()[0]] * 8)


def test_compiled_rows_over_budget_rank_by_how_far_over():
    # labels in the reverse order of the peaks: 0.5 ranked these by the label's text
    mesh = {dict(m.shape)["tensor"]: m for m in st.layouts(8, ("data", "tensor"))}[8]
    labels = {1024: "a most", 512: "b some", 256: "c least"}
    candidates = [st.Candidate(mesh, RULES, batch=b, length=16, label=labels[b]) for b in labels]
    roomy = st.advise(mlp_step, candidates, hardware=HW, budget_bytes=2**30, progress=False)
    peaks = {row.candidate.label: row.step.peak_bytes for row in roomy.rows}
    budget = min(peaks.values()) - 1  # every step compiles (arrays under it) and is over
    advice = st.advise(mlp_step, candidates, hardware=HW, budget_bytes=budget, progress=False)
    assert all(row.verdict == "over budget" and row.step is not None for row in advice.rows)
    assert [row.candidate.label for row in advice.rows] == sorted(peaks, key=peaks.get)
    assert [row.candidate.label for row in advice.rows] == ["c least", "b some", "a most"]


def test_make_mesh_lays_given_devices_out_in_their_order():
    row = small_batch_advice().best
    devices = jax.devices()[::-1]
    mesh = row.make_mesh(devices)
    assert list(mesh.devices.flat) == devices
    assert mesh.axis_types == row.candidate.mesh.axis_types
    with pytest.raises(
        ValueError, match=r"^make_mesh: the layout data 1 x tensor 8 needs 8 devices"
    ):
        row.make_mesh(devices[:4])


def test_a_row_and_its_step_pickle():
    for row in small_batch_advice().rows:
        assert pickle.loads(pickle.dumps(row.step)) == row.step
        if row.time is None:  # a row without a StepTime or Hardware in it
            assert pickle.loads(pickle.dumps(row)) == row


def test_advice_pickles_and_compares_equal():
    advice = small_batch_advice()
    again = pickle.loads(pickle.dumps(advice))
    assert again == advice and again.rows[0].time == advice.rows[0].time
    assert str(again) == str(advice)


@pytest.mark.parametrize(
    ("candidate", "error"),
    [("data 8", TypeError), (None, TypeError), ("batch 0", ValueError)],
    ids=["a-string", "none", "batch-0"],
)
def test_advise_names_a_candidate_that_is_not_one(candidate, error):
    mesh = st.layouts(8, ("data", "tensor"))[0]
    if candidate == "batch 0":
        candidate = st.Candidate(mesh, RULES, batch=0)
    called = []
    with pytest.raises(error, match=r"^advise: candidates holds"):
        st.advise(called.append, [candidate], hardware=HW, progress=False)
    assert called == []


def many_biases_step(candidate):
    """A step with 12 replicated 1 MiB biases beside its sharded weight, and a warning
    raised by make_step itself (as from_flax's padding warning is, per candidate)."""
    warnings.warn(f"padded for {label(candidate)}", UserWarning, stacklevel=1)
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((WIDE, MLP), jnp.float32), ("embed", "mlp"))
    biases = [
        st.LogicallyPartitioned(jax.ShapeDtypeStruct((2**18,), jnp.float32), (None,))
        for _ in range(12)
    ]
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, WIDE), jnp.float32), ("batch", "embed")
    )

    def step(w, biases, x):
        return jnp.sum(x.value @ w.value) + sum(jnp.sum(b.value) for b in biases)

    return step, (w, biases, x), {}


def test_many_flags_are_one_line_of_the_table_and_all_on_the_row():
    candidates = [st.Candidate(m, RULES, batch=12) for m in st.layouts(8, ("data", "tensor"))]
    with pytest.warns(UserWarning, match="padded for"):
        advice = st.advise(many_biases_step, candidates, hardware=HW, progress=False)
    shown = str(advice).splitlines()
    for row in advice.rows:
        replicated = [f for f in row.flags if f.endswith("1.0 MiB replicated on every device")]
        assert len(replicated) == 12 and all(f.startswith("args[1]/") for f in replicated)
    # one table line a row for all its replicated arrays, with their count and total
    summary = [line for line in shown if "replicated on every device" in line]
    assert len(summary) == len(advice.rows)
    for row in advice.rows:
        whole = row.candidate.mesh.shape["tensor"] == 1  # the weight replicated too: 8 MiB more
        said = "13 arrays replicated on every device, 20.0 MiB: args[0], args[1]/0, args[1]/1, ..."
        said = (
            said
            if whole
            else "12 arrays replicated on every device, 12.0 MiB: args[1]/0, args[1]/1, args[1]/2, ..."
        )
        assert f"     ! {said}" in shown
    body = shown[next(i for i, line in enumerate(shown) if line.startswith("#  layout")) + 1 : -1]
    assert len(body) <= 5 * len(advice.rows)  # a few lines a row, not one per flag
    assert sum(len(row.flags) for row in advice.rows) > 12 * len(advice.rows)
    batch = next(row for row in advice.rows if row.verdict == "batch unsharded")
    # the batch's own flag first: batch 12 over data 8
    assert batch.flags[0].startswith("args[2]: dimension 0 (batch, size 12) left unsharded")


def test_a_warning_raised_for_every_candidate_is_shown_once():
    candidates = [st.Candidate(m, RULES, batch=16) for m in st.layouts(8, ("data", "tensor"))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st.advise(many_biases_step, candidates, hardware=HW, progress=False)
    padded = [w for w in caught if "padded for" in str(w.message)]
    assert len(padded) == 1
    assert str(padded[0].message) == (
        f"padded for {label(candidates[0])} (and {len(candidates) - 1} more like it in this "
        "advise call)"
    )
    assert padded[0].filename == __file__  # the user's line, as raised


def test_verdicts_are_typed_and_rank_in_their_order():
    advice = small_batch_advice()
    assert all(isinstance(row.verdict, st.Verdict) for row in advice.rows)
    order = [list(st.Verdict).index(row.verdict) for row in advice.rows]
    assert order == sorted(order)
    assert st.Verdict("may fit") is st.Verdict.MAY_FIT and str(st.Verdict.FITS) == "fits"
    assert pickle.loads(pickle.dumps(advice)).rows == advice.rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_order_of_the_candidates_changes_the_ranking(seed):
    candidates = [
        st.Candidate(m, RULES, batch=b) for b in (8, 16) for m in st.layouts(8, ("data", "tensor"))
    ]
    shuffled = list(candidates)
    random.Random(seed).shuffle(shuffled)
    first = st.advise(mlp_step, candidates, hardware=HW, progress=False)
    again = st.advise(mlp_step, shuffled, hardware=HW, progress=False)
    key = [(label(r.candidate), r.candidate.batch, r.verdict) for r in first.rows]
    assert key == [(label(r.candidate), r.candidate.batch, r.verdict) for r in again.rows]


def test_on_a_preset_rows_rank_by_the_predicted_time_per_sequence():
    candidates = [
        st.Candidate(m, RULES, batch=b) for b in (8, 32) for m in st.layouts(8, ("data", "tensor"))
    ]
    advice = st.advise(
        mlp_step, candidates, hardware=st.hardware("h100"), progress=False, screen="cpu"
    )
    fits = [row for row in advice.rows if row.verdict == "fits"]
    assert fits and all(row.time.predicted_seconds is not None for row in fits)
    per = [row.time.predicted_seconds / row.candidate.batch for row in fits]
    assert all(a <= b * (1 + 1e-5) for a, b in itertools.pairwise(per))
    # the bound stays a column, and is a bound: never above the prediction
    assert all(row.time.bound_seconds <= row.time.predicted_seconds for row in fits)
    assert any(
        line.startswith("#  layout") and "predicted" in line for line in str(advice).splitlines()
    )


def test_when_nothing_fits_the_note_says_what_would():
    candidates = [st.Candidate(m, RULES, batch=64) for m in st.layouts(8, ("data", "tensor"))]
    roomy = st.advise(mlp_step, candidates, hardware=HW, progress=False)
    smallest = min(row.step.peak_bytes for row in roomy.rows if row.step is not None)
    budget = smallest - 1  # the layouts whose arrays fit compile, and none fits
    advice = st.advise(mlp_step, candidates, hardware=HW, budget_bytes=budget, progress=False)
    assert advice.best is None
    best = min((r for r in advice.rows if r.step is not None), key=lambda r: r.step.peak_bytes)
    assert f"Nothing fits: the smallest peak, {best.step.peak_bytes / 2**20:.1f} MiB" in advice.note
    assert f"({label(best.candidate)}, batch 64)" in advice.note
    assert "a smaller batch" in advice.note.lower() or "batch of at most" in advice.note
    assert roomy.best is not None and "Nothing fits" not in roomy.note


def test_a_rule_that_matches_nothing_is_said_once_per_call():
    rules = [*RULES, ("heads", "tensor")]
    candidates = [st.Candidate(m, rules, batch=8) for m in st.layouts(8, ("data", "tensor"))]
    advice = st.advise(mlp_step, candidates, hardware=HW, progress=False)
    said = "rule 3 ('heads', 'tensor') is never used"
    assert said in advice.note and " ".join(str(advice).split()).count(said) == 1
    assert said not in small_batch_advice().note  # the rules in use: nothing said


def test_when_every_candidate_is_rejected_before_compiling_the_note_says_what_would_fit():
    mesh = st.layouts(8, ("data", "tensor"))
    candidates = [st.Candidate(m, RULES, batch=8, length=16) for m in mesh]
    arrays = 2 * WIDE * MLP * 4 // 8  # the weights over tensor 8, the least any layout holds
    budget = arrays // 2
    advice = st.advise(mlp_step, candidates, hardware=HW, budget_bytes=budget, progress=False)
    assert advice.compiles == 0 and all(row.step is None for row in advice.rows)
    assert all(row.reason.startswith("arrays alone") for row in advice.rows)
    said = advice.note[advice.note.index("Nothing fits") :]
    # the weights over tensor 8 and the batch's inputs: just over twice the budget
    assert re.match(
        r"Nothing fits: the smallest peak, 2\.0 MiB \(data 1 x tensor 8, batch 8: its arrays "
        r"alone, not compiled\), is 1\.0 MiB \(10\d%\) over the budget of 1\.0 MiB\.",
        said,
    )
    assert "Spread over 4x the devices (32)" in said
    assert said.endswith(
        "A smaller batch cannot bring it under: its arrays alone (2.0 MiB) are over the budget."
    )
    assert said in " ".join(str(advice).split())


@pytest.mark.parametrize("reverse", [False, True])
def test_a_compiled_row_over_budget_ranks_before_one_rejected_without_a_compile(reverse):
    # budget 12 MiB: tensor 8 fits; tensor 4 compiles over it; tensor 1's arrays
    # alone (16 MiB) are over it, so it is not compiled; its label sorts first
    mesh = {dict(m.shape)["tensor"]: m for m in st.layouts(8, ("data", "tensor"))}
    names = {8: "c sharded", 4: "b half", 1: "a replicated"}
    candidates = [st.Candidate(mesh[t], RULES, batch=8, length=16, label=names[t]) for t in names]
    budget = 3 * WIDE * MLP * 4 // 2
    advice = st.advise(
        mlp_step,
        candidates[::-1] if reverse else candidates,
        hardware=HW,
        budget_bytes=budget,
        progress=False,
    )
    got = [(row.candidate.label, row.verdict, row.step is None) for row in advice.rows]
    assert got == [
        ("c sharded", "fits", False),
        ("b half", "over budget", False),
        ("a replicated", "over budget", True),
    ]


# --- work repeated along an axis (0.6) ----------------------------------------------

FSDP_ONLY = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", None)]  # 'data' splits nothing


def test_a_layout_whose_devices_repeat_each_others_work_is_said_so_and_ranks_after():
    # the batch split over fsdp only: with data > 1, each data group computes the same
    # examples (flax's Gemma, which shards its batch over fsdp alone, on data x fsdp)
    candidates = [
        st.Candidate(m, FSDP_ONLY, batch=64, length=16) for m in st.layouts(8, ("data", "fsdp"))
    ]
    advice = st.advise(mlp_step, candidates, hardware=HW, progress=False)

    def data(row):
        return dict(row.candidate.mesh.shape)["data"]

    # the oracle: the MLP's five matmuls of 64 x WIDE x MLP (two forward; backward,
    # both weights' gradients and the hidden layer's, not the input's), 2 FLOPs a
    # multiply-add, split over all 8 devices
    split = 5 * 2 * 64 * WIDE * MLP // 8
    assert min(row.step.flops for row in advice.rows) == pytest.approx(split, rel=0.05)
    assert {data(r) for r in advice.rows if r.step.flops < 1.5 * split} == {1}
    for row in advice.rows:
        said = [f for f in row.flags if "repeat each other's work" in f]
        if row.step.flops < 1.5 * split:
            assert said == []
            continue
        (flag,) = said
        copies = data(row)
        assert flag.startswith(f"devices repeat each other's work along data ({copies}):")
        assert f"{row.step.flops / min(r.step.flops for r in advice.rows):.1f}x the" in flag
    # XLA splits none of the work along data where nothing is sharded over it
    whole = [row for row in advice.rows if data(row) == 8]
    assert whole[0].step.flops == pytest.approx(8 * split, rel=0.05)
    # every layout that splits the work ranks before every one that repeats it, whatever
    # their times
    repeats = [data(row) > 1 for row in advice.rows if row.verdict == "fits"]
    assert repeats == sorted(repeats) and repeats[0] is False and repeats[-1] is True
    assert "repeat each other's work along data" in str(advice)


HEADS = 1020  # divided by 2 and 4, not by 8


def two_branch_step(candidate):
    """An MLP beside a second branch whose hidden units ("heads") a tensor axis of 8
    does not divide (a model's 8 heads over a tensor axis of 16, in small)."""
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, WIDE), jnp.float32), ("batch", "embed")
    )

    def weight(shape, names):
        return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)

    params = {
        "w1": weight((WIDE, MLP), ("embed", "mlp")),
        "w2": weight((MLP, WIDE), ("mlp", "embed")),
        "w3": weight((WIDE, HEADS), ("embed", "heads")),
        "w4": weight((HEADS, WIDE), ("heads", "embed")),
    }

    def step(params, x):
        def loss(p):
            out = jax.nn.relu(x @ p["w1"]) @ p["w2"] + jax.nn.relu(x @ p["w3"]) @ p["w4"]
            return jnp.mean(out**2)

        params, x = st.unbox(params), x.value
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step, (params, x), {}


def test_a_layout_whose_axis_does_not_divide_what_it_splits_repeats_that_work_and_says_so():
    # tensor 8 splits the MLP but not the 1020 "heads": every device computes that branch
    # whole (flax's wmt, 8 heads over tensor 16, found it); tensor shards arguments, so
    # it is no axis the batch was never split over, yet the work repeats along it
    rules = [("batch", "data"), ("embed", None), ("mlp", "tensor"), ("heads", "tensor")]
    candidates = [
        st.Candidate(m, rules, batch=64, length=16) for m in st.layouts(8, ("data", "tensor"))
    ]
    advice = st.advise(two_branch_step, candidates, hardware=HW, progress=False)

    def tensor(row):
        return dict(row.candidate.mesh.shape)["tensor"]

    # the oracle: five matmuls per branch (as the MLP's), the MLP split over all 8
    # devices, the heads' branch split over data alone where tensor is 8
    mlp, heads = 5 * 2 * 64 * WIDE * MLP, 5 * 2 * 64 * WIDE * HEADS
    split = (mlp + heads) / 8
    repeats = [row for row in advice.rows if tensor(row) == 8]
    splits = [row for row in advice.rows if tensor(row) < 8]
    for row in splits:
        assert row.step.flops == pytest.approx(split, rel=0.05)
        assert not [f for f in row.flags if "repeat each other's work" in f]
    (row,) = repeats
    assert row.step.flops == pytest.approx(mlp / 8 + heads, rel=0.05)
    (said,) = [f for f in row.flags if "repeat each other's work" in f]
    assert said.startswith(
        "devices repeat each other's work along tensor (8), which does not divide what it "
        f"is to split (heads, size {HEADS})"
    )
    assert said.endswith(
        "give tensor a size that divides it, or its devices to the axes that split the batch"
    )
    fits = [row for row in advice.rows if row.verdict == "fits"]
    assert fits[-1] is row  # after every layout that splits the work


def test_the_traffic_flag_of_a_layout_that_repeats_work_says_the_repeat_is_its_cause():
    # The traffic flag's usual advice (constrain the activations) misdirects where the
    # traffic comes from an axis that splits nothing: the repeat's flag says so instead.
    # Private: the search's own ranking helpers, which have no public name
    from spmdtree._src.step.advise import state

    meshes = [m for m in st.layouts(8, ("data", "fsdp")) if dict(m.shape)["data"] <= 2]
    candidates = [st.Candidate(m, FSDP_ONLY, batch=64, length=16) for m in meshes]
    splits, repeats = st.advise(mlp_step, candidates, hardware=HW, progress=False).rows
    # as if XLA all-reduced 1 GiB of activations over the data axis, ten times a step
    reduced = st.Collective("all-reduce", 10, 1 << 30, axes=("data",), group=2)
    step = dataclasses.replace(repeats.step, collectives=(*repeats.step.collectives, reduced))
    traffic = step.unexplained_traffic
    assert traffic is not None and "st.with_logical_constraint" in traffic.sentence
    plain = tuple(f for f in repeats.flags if "repeat each other's work" not in f)
    flagged = repeats._replace(step=step, flags=(*plain, traffic.sentence))
    records = {0: state.Confirmed(splits), 1: state.Confirmed(flagged)}
    said = state.said_repeats(state.State(types.MappingProxyType(records), 2))
    flags = said.records[1].row.flags
    assert traffic.sentence not in flags
    assert flags[0].startswith("devices repeat each other's work along data (2):")
    assert flags[0].endswith(
        "; the collectives beyond what the layout explains come from it too, not from "
        "unconstrained activations"
    )
    assert said.records[0].row.flags == splits.flags  # the one that splits: untouched


# --- options: what a job chooses beside its mesh (0.6) -----------------------------------


def accumulated_mlp_step(candidate):
    """mlp_step's SGD step, its gradients accumulated over the candidate's microbatches."""
    count = candidate.options["microbatches"]
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, WIDE), jnp.float32), ("batch", "embed")
    )
    params = mlp_step(candidate)[1][0]

    def loss(p, batch):
        h = st.with_logical_constraint(jnp.tanh(batch @ p["w1"]), ("batch", "mlp"))
        return jnp.mean((h @ p["w2"]) ** 2)

    def step(params, x):
        value, grads = st.accumulate(jax.value_and_grad(loss), count)(st.unbox(params), x.value)
        return jax.tree.map(lambda p, g: p - 0.1 * g, st.unbox(params), grads), value

    return step, (params, x), {}


def test_advise_over_options_compiles_each_and_ranks_them_with_the_layouts():
    meshes = [m for m in st.layouts(8, ("data", "tensor")) if dict(m.shape)["tensor"] in (1, 8)]
    found = st.candidates(meshes, RULES, 64, length=16, microbatches=(1, 4))
    assert [(dict(c.mesh.shape)["tensor"], c.options) for c in found] == [
        (8, {"microbatches": 1}),
        (8, {"microbatches": 4}),
        (1, {"microbatches": 1}),
        (1, {"microbatches": 4}),
    ]
    advice = st.advise(accumulated_mlp_step, found, hardware=HW, progress=False)
    assert advice.compiles == 4  # each option's step its own
    shown = str(advice)
    for row in advice.rows:  # each row's options after its layout
        layout = " x ".join(f"{a} {n}" for a, n in row.candidate.mesh.shape.items())
        assert f"{layout}, microbatches {row.candidate.options['microbatches']}" in shown
    # ranked across options by the predicted time per sequence, the fastest that fits best
    fits = [row for row in advice.rows if row.verdict == "fits"]
    times = [row.time.predicted_seconds / row.candidate.batch for row in fits]
    assert times == sorted(times) and advice.best is fits[0]


@pytest.mark.parametrize(
    "call, error, said",
    [
        (
            lambda: st.candidates([_mesh(2, 4)], RULES, 8, remat="full"),
            TypeError,
            r"^candidates: option remat is 'full'; expected a sequence",
        ),
        (
            lambda: st.advise(
                mlp_step,
                [st.Candidate(_mesh(2, 4), RULES, 8, options={"tile": [1, 2]})],
                hardware=HW,
            ),
            TypeError,
            r"^advise: option 'tile' of candidate 'data 2 x tensor 4' is \[1, 2\], which is not hashable",
        ),
        (
            lambda: st.candidates([_mesh(2, 4)], RULES, 8, remat=()),
            ValueError,
            r"^candidates: option remat has no values",
        ),
        (
            lambda: st.advise(
                mlp_step,
                [st.Candidate(_mesh(2, 4), RULES, 8, options={"tile": ([1],)})],
                hardware=HW,
            ),
            TypeError,
            r"which is not hashable",
        ),
    ],
    ids=["one-value", "unhashable", "no-values", "unhashable-inside"],
)
def test_option_mistakes(call, error, said):
    with pytest.raises(error, match=said):
        call()


# --- compiles on an executor of the caller's: Dask's (0.6) -------------------------------


def sixteen_device_candidates():
    """Layouts of 16 devices: more than this process has, so each compiles in a child
    (the work an executor takes)."""
    return [
        st.Candidate(m, RULES, batch=16, length=16) for m in st.layouts(16, ("data", "tensor"))[:3]
    ]


def same_rows(a, b):
    return [(st_label(r), r.verdict, r.step and r.step.peak_bytes) for r in a.rows] == [
        (st_label(r), r.verdict, r.step and r.step.peak_bytes) for r in b.rows
    ]


def st_label(row):
    return " x ".join(f"{a} {n}" for a, n in row.candidate.mesh.shape.items())


def test_advise_on_a_dask_cluster_gives_the_same_rows_verdicts_and_peaks():
    distributed = pytest.importorskip("distributed")
    candidates = sixteen_device_candidates()
    local = st.advise(mlp_step, candidates, hardware=HW, progress=False)
    with (
        distributed.LocalCluster(
            host="127.0.0.1",
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address="127.0.0.1:0",
        ) as cluster,
        distributed.Client(cluster, timeout=60) as client,
    ):
        with distributed.get_task_stream(client) as stream:
            remote = st.advise(
                mlp_step, candidates, hardware=HW, progress=False, executor=client.get_executor()
            )
        # each compile ran as a task on a worker
        ran = [task for task in stream.data if task["key"].startswith("compile_child")]
        assert len(ran) == len(candidates)
    assert remote.compiles == local.compiles == len(candidates)
    assert same_rows(local, remote)


class _Failing(concurrent.futures.ThreadPoolExecutor):
    """An executor whose second task's worker is lost."""

    def __init__(self):
        super().__init__(max_workers=2)
        self.given = 0

    def submit(self, fn, *args, **kwargs):
        self.given += 1
        if self.given == 2:

            def lost(*_, **__):
                raise RuntimeError("worker lost: the scheduler gave up on it")

            return super().submit(lost)
        return super().submit(fn, *args, **kwargs)


def test_a_workers_failure_is_that_rows_and_the_rest_are_the_same():
    candidates = sixteen_device_candidates()
    local = st.advise(mlp_step, candidates, hardware=HW, progress=False)
    remote = st.advise(mlp_step, candidates, hardware=HW, progress=False, executor=_Failing())
    failed = [r for r in remote.rows if r.verdict == "does not compile"]
    assert len(failed) == 1 and "worker lost: the scheduler gave up on it" in failed[0].reason
    kept = [r for r in remote.rows if r.verdict != "does not compile"]
    assert [(st_label(r), r.step.peak_bytes) for r in kept] == [
        (st_label(r), r.step.peak_bytes) for r in local.rows if st_label(r) != st_label(failed[0])
    ]


def test_an_executor_that_is_none_is_refused():
    with pytest.raises(
        TypeError, match=r"^advise: executor is 4; expected a concurrent.futures.Executor"
    ):
        st.advise(mlp_step, sixteen_device_candidates(), hardware=HW, executor=4)


@pytest.mark.parametrize(
    "times, said", [(1.0, False), (1.2, False), (1.49, False), (1.5, True), (2.0, True)]
)
def test_a_layout_is_said_to_repeat_work_from_half_again_the_least(times, said):
    # a little more than the least (XLA splitting some work itself, a reduction's adds)
    # is no repeat; a 2-way copy is 2x. The oracle: the threshold the docs state.
    # Private: the repeated-work diagnosis, a helper with no public name
    from spmdtree._src.step.preflight.diagnose import repeated

    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"))
    inputs = st.plan(
        {"x": st.Partitioned(jax.ShapeDtypeStruct((64, 8), jnp.float32), ("fsdp", None))}, mesh
    )
    found = repeated({"data": 2, "fsdp": 4}, inputs, int(times * 10**9), 10**9, 64)
    assert (found is not None) == said
    if said:
        assert found.startswith("devices repeat each other's work along data (2):")


@pytest.mark.parametrize("naming", ["logical", "mesh", "mixed", "logical, as a mesh axis"])
def test_a_repeating_layout_is_told_the_rule_or_the_specs_as_its_batch_is_named(naming):
    # the batch named logically is sharded by its own rule; named by mesh axes (a model
    # that writes its own specs and out_sharding=, as flax's Gemma does), by its specs,
    # whatever its params are named (logical params beside a mesh-axis batch: flax linen
    # through from_flax); a logical name spelt as a mesh axis is still a rule's
    # Private: the repeated-work diagnosis, a helper with no public name
    from spmdtree._src.step.preflight.diagnose import repeated

    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"))
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32)
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("embed", None))
    rules = [("rows", "fsdp"), ("embed", "fsdp")]
    batch, rule = {
        "logical": (st.LogicallyPartitioned(x, ("rows", None)), "rows"),
        "mesh": (st.Partitioned(x, ("fsdp", None)), None),
        "mixed": (st.Partitioned(x, ("fsdp", None)), None),
        "logical, as a mesh axis": (st.LogicallyPartitioned(x, ("fsdp", None)), "fsdp"),
    }[naming]
    tree = {"x": batch} if naming in ("logical", "mesh") else {"w": w, "x": batch}
    if naming == "logical, as a mesh axis":
        rules = [("fsdp", "fsdp"), ("embed", "fsdp")]
    inputs = st.plan(tree, mesh, rules=rules)
    found = repeated({"data": 2, "fsdp": 4}, inputs, 2 * 10**9, 10**9, 64)
    assert found.startswith("devices repeat each other's work along data (2):")
    if rule is None:
        assert "its rule" not in found and "out_sharding=" in found
    else:
        assert f"its rule: ({rule!r}, ('data', ...))" in found and "out_sharding=" not in found
    assert found.endswith("or give data's devices to the axes that split it")


def test_a_mistake_crosses_an_executors_process_boundary_as_itself():
    # a compile's refusal (the target's compiler: too big for a chip) raised on a worker
    # comes back as the same mistake, so its row says "over budget", not a broken pickle
    # Private: the mistake a worker raises, whose class has no public name
    from spmdtree._src.errors import Mistake
    from spmdtree._src.step.compile.compilers import DoesNotFit

    for mistake in (Mistake(ValueError, "a message"), DoesNotFit(ValueError, "too big")):
        back = pickle.loads(pickle.dumps(mistake))
        assert type(back) is type(mistake) and back.kind is ValueError
        assert back.message == mistake.message and str(back) == str(mistake)


def test_repeats_compare_the_same_work_only():
    # two lengths (or two options) at one batch are two works: each row's FLOPs are held
    # against the least of its own work, never the other's
    # Private: the search's own ranking helpers, which have no public name
    from spmdtree._src.step.advise import judging

    mesh = st.layouts(8, ("data", "tensor"))[0]
    found = [
        st.Candidate(mesh, RULES, 64, length=16),
        st.Candidate(mesh, RULES, 64, length=32),
        st.Candidate(mesh, RULES, 64, length=32, options={"remat": "full"}),
    ]
    advice = st.advise(mlp_step, found, hardware=HW, progress=False)
    split = judging.rows_split(advice.rows)
    assert len(split) == 3
    assert all(split[judging._work(r.candidate)] == r.step.flops for r in advice.rows)
