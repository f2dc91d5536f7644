"""What users look at (SPEC "What users look at (0.6)"): a step's predicted schedule
as a Chrome trace, pictures of a step and of advice, and both as versioned JSON."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from test_targets import needs, targeted

import spmdtree as st

# Private: the pictures' own functions, drawn from plain figures
from spmdtree._src.step.pictures import draw as pictures

H100 = st.hardware("h100")
LAYERS = 8
AXES = ("data", "fsdp")
RULES = [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", None), ("layers", None)]


def layer(x, w):
    w = st.unbox(w)
    return jnp.tanh(x @ w["up"]) @ w["down"], None


def loss(params, x):
    y, _ = st.scan(layer, x.value, params["layers"], partition_name="layers")
    return jnp.mean(y**2)


def step(params, x):
    return jax.grad(loss)(params, x)


def boxed(shape, names):
    return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)


def arguments(batch=64):
    params = {
        "layers": {
            "up": boxed((LAYERS, 256, 512), ("layers", "embed", "mlp")),
            "down": boxed((LAYERS, 512, 256), ("layers", "mlp", "embed")),
        }
    }
    return params, boxed((batch, 256), ("batch", "embed"))


@pytest.fixture(scope="module")
def scanned():
    """A step of 8 scanned layers with FSDP's all-gathers in its loop (the CPU estimate)."""
    mesh = AbstractMesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
    return st.preflight(step, *arguments(), mesh=mesh, rules=RULES)


def spans(trace, track=None):
    tids = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    return [
        e
        for e in trace["traceEvents"]
        if e["ph"] == "X" and (track is None or tids[e["tid"]] == track)
    ]


def nanoseconds(microseconds):
    """A trace's time as Perfetto's JSON importer reads it (llround of ts x 1000)."""
    return round(microseconds * 1000)


def overlapping(events):
    """The spans of one track that start inside another and end after it."""
    opened, found = [], []
    for event in sorted(events, key=lambda e: (nanoseconds(e["ts"]), -nanoseconds(e["dur"]))):
        start = nanoseconds(event["ts"])
        end = start + nanoseconds(event["dur"])
        while opened and opened[-1] <= start:
            opened.pop()
        if opened and end > opened[-1]:
            found.append(event["name"])
        else:
            opened.append(end)
    return found


def test_overlapping_finds_a_span_that_overlaps_by_a_nanosecond():
    first = {"name": "a", "ts": 1.0, "dur": 1.001}
    assert overlapping([first, {"name": "b", "ts": 2.0, "dur": 1.0}]) == ["b"]
    assert overlapping([first, {"name": "b", "ts": 2.001, "dur": 1.0}]) == []
    assert overlapping([first, {"name": "b", "ts": 1.5, "dur": 0.5}]) == []  # held by a


def check_trace(plan, hardware, tmp_path):
    """The trace's laws, against the prediction `time` gives by another path."""
    path = tmp_path / "step.json"
    trace = plan.trace(hardware, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))  # valid JSON, written
    timed = plan.time(hardware)
    predicted = timed.predicted_seconds
    compute, comm = spans(trace, "compute"), spans(trace, "collectives")
    assert compute and comm
    end = max(e["ts"] + e["dur"] for e in spans(trace))
    assert end / 1e6 == pytest.approx(predicted, rel=0.01)
    # the compute stream runs one thing at a time, with no gap: its spans add up to the
    # step (on the trace's grid of whole nanoseconds)
    ordered = sorted(compute, key=lambda e: e["ts"])
    for before, after in itertools.pairwise(ordered):
        assert nanoseconds(after["ts"]) == nanoseconds(before["ts"]) + nanoseconds(before["dur"])
    assert sum(e["dur"] for e in compute) / 1e6 == pytest.approx(predicted, rel=1e-6, abs=1e-9)
    # no track has a span that overlaps another without holding it, as Perfetto reads
    # times (whole nanoseconds): it drops such a span ("slice_drop_overlapping_complete_event")
    for track in ("compute", "collectives", "copies"):
        assert not overlapping(spans(trace, track)), track
    # each collective says its kind, bytes and axes, from the step's own rows
    kinds = {row.kind for row in plan.collectives}
    axes = set(plan.mesh.axis_names)
    for event in comm:
        if event["cat"] == "loop":
            continue
        assert event["args"]["collective"].split(" ")[0] in kinds
        assert set(event["args"]["axes"]) <= axes and event["args"]["bytes"] > 0
    for event in compute:
        assert event["name"] and event["args"]["class"] == event["cat"]
        waits = event["name"].startswith("waits for ")  # for a copy: memory time, no kernel
        if event["cat"] in ("matmul", "memory", "attention") and not waits:
            assert {"flops", "bytes"} <= set(event["args"])
    return trace, timed


def test_the_trace_of_a_scanned_step_lays_out_its_loop_and_ends_at_the_prediction(
    scanned, tmp_path
):
    trace, timed = check_trace(scanned, H100, tmp_path)
    summaries = [e for e in spans(trace) if e["cat"] == "loop"]
    assert summaries, "the layers' loop past its walked iterations is one span per track"
    walked = st._src.step.time.predict._Walk.WALKED
    for event in summaries:
        assert event["args"]["iterations"] == LAYERS - walked
        assert event["name"].endswith(f"iterations {walked + 1}-{LAYERS}")
    compute = spans(trace, "compute")
    waits = [e for e in compute if e["name"].startswith("waits for ")]
    looped = [e for e in summaries if e["tid"] == compute[0]["tid"]]
    waited = sum(e["dur"] for e in waits) / 1e6
    summarised = sum(e["dur"] for e in looped) / 1e6
    # each span's length is on the trace's grid: within a nanosecond of the walk's
    assert waited <= timed.exposed_comm_seconds + len(waits) * 1e-9
    assert waited + summarised >= timed.exposed_comm_seconds - (len(waits) + len(looped)) * 1e-9


@pytest.mark.parametrize("preset", [needs("h100"), needs("tpu-v5p")])
def test_the_trace_of_a_target_compile_names_the_modules_kernels(preset, tmp_path):
    plan = targeted(preset)
    trace, _ = check_trace(plan, st.hardware(preset), tmp_path)
    names = {e["name"] for e in spans(trace, "compute")}
    assert any(
        name.startswith(
            ("fusion", "loop_", "input_", "custom-call", "cublas", "gemm", "convolution", "dot")
        )
        for name in names
    ), sorted(names)[:10]


def test_exposed_collectives_by_axes_add_up_to_the_exposed_time(scanned):
    timed = scanned.time(H100)
    assert timed.exposed_by_axes is not None
    assert sum(timed.exposed_by_axes.values()) == pytest.approx(timed.exposed_comm_seconds)
    assert set(timed.exposed_by_axes) <= set(timed.comm_by_axes)


def test_a_step_time_of_exposed_axes_that_are_no_mapping_is_a_type_error():
    with pytest.raises(TypeError, match=r"StepTime: exposed_by_axes is \[1\]; expected a mapping"):
        st.StepTime(0.1, {}, exposed_by_axes=[1])


def test_a_step_plan_without_a_schedule_has_no_trace_and_says_why(scanned):
    bare = dataclasses.replace(scanned, schedule=None)
    with pytest.raises(ValueError, match=r"StepPlan\.trace: this StepPlan carries no compiled"):
        bare.trace(H100)
    with pytest.raises(TypeError, match=r"expected a st\.Hardware"):
        scanned.trace("h100")


def test_a_step_plan_as_json_round_trips_and_says_its_figures(scanned):
    data = json.loads(scanned.to_json(H100))
    assert data["schema"] == "spmdtree.StepPlan/1"
    assert data["mesh"] == {"axes": {"data": 2, "fsdp": 4}, "axis_types": ["Auto", "Auto"]}
    assert data["memory"]["peak_bytes"] == scanned.peak_bytes
    assert data["flops"] == scanned.flops
    assert [(c["kind"], c["bytes"], c["axes"]) for c in data["collectives"]] == [
        (row.kind, row.bytes, list(row.axes)) for row in scanned.collectives
    ]
    timed = scanned.time(H100)
    assert data["time"]["hardware"] == "h100"
    assert data["time"]["predicted_seconds"] == timed.predicted_seconds
    assert data["time"]["comm_by_axes"] == {"+".join(k): v for k, v in timed.comm_by_axes.items()}
    assert "time" not in scanned.to_dict()


@pytest.fixture(scope="module")
def advice():
    """Advice over four layouts x two batches, one over a small budget."""

    def make_step(candidate):
        return step, arguments(candidate.batch), {}

    meshes = st.layouts(8, AXES)
    found = st.candidates(meshes, RULES, (32, 64), length=16, options=("a",))
    return st.advise(
        make_step, found, hardware=H100, progress=False, screen="cpu", budget_bytes=5 * 2**20
    )


def test_advice_as_json_is_its_rows_in_rank_order(advice):
    data = json.loads(advice.to_json())
    assert data["schema"] == "spmdtree.Advice/1"
    assert data["budget_bytes"] == advice.budget_bytes and data["devices"] == 8
    assert len(data["rows"]) == len(advice.rows)
    for entry, row in zip(data["rows"], advice.rows, strict=True):
        assert entry["verdict"] == row.verdict and entry["batch"] == row.candidate.batch
        assert entry["options"] == {"options": "a"}
        assert entry["label"].endswith("options a")
        if row.step is not None:
            assert entry["step"]["memory"]["peak_bytes"] == row.step.peak_bytes
    best = advice.best
    assert data["best"] == (None if best is None else advice.rows.index(best))


def png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_advice_plot_draws_a_point_per_compiled_row_and_marks_the_best(advice, tmp_path):
    path = tmp_path / "advice.png"
    fig = advice.plot(path)
    assert png(path)
    ax = fig.axes[0]
    drawn = sum(len(c.get_offsets()) for c in ax.collections)
    compiled = sum(row.step is not None and row.time is not None for row in advice.rows)
    best = advice.best
    assert drawn == compiled + (best is not None)  # every row once, the best ringed too
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("budget ") for t in texts)
    if best is not None:
        assert any(st._src.step.advise.records.label_of(best.candidate) in t for t in texts)
    verdicts = {row.verdict for row in advice.rows if row.step is not None}
    assert {t.get_text().split(" (")[0] for t in ax.get_legend().get_texts()} == verdicts
    peaks = [row.step.peak_bytes for row in advice.rows if row.step is not None]
    unit = {"(KiB)": 2**10, "(MiB)": 2**20, "(GiB)": 2**30}[ax.get_ylabel().split()[-1]]
    drawn_peaks = sorted(y for c in ax.collections for _, y in c.get_offsets())
    assert max(drawn_peaks) * unit == pytest.approx(max(peaks))  # in the unit the axis says


def test_step_plot_splits_the_prediction_by_class_and_the_collectives_by_axes(scanned, tmp_path):
    path = tmp_path / "step.png"
    fig = scanned.plot(H100, path)
    assert png(path)
    top, bottom = fig.axes
    timed = scanned.time(H100)
    unit = {"(s)": 1.0, "(ms)": 1e-3, "(us)": 1e-6}[top.get_xlabel().split()[-1]]
    bars = [p for p in top.patches if -0.5 < p.get_y() < 0.5 and p.get_width() > 0]
    assert sum(p.get_width() for p in bars) * unit == pytest.approx(timed.predicted_seconds)
    classes = {t.get_text() for t in top.get_legend().get_texts()}
    said = {
        "exposed collectives" if k == "collectives" else k
        for k, v in timed.predicted_by_class.items()
        if v > 0
    }
    assert said <= classes  # every class the step spends time in, and no empty one
    assert not {"attention"} & classes or timed.predicted_by_class["attention"] > 0
    labels = [t.get_text() for t in bottom.get_yticklabels()]
    assert labels == ["+".join(axes) for axes in timed.comm_by_axes]


def test_plotting_without_matplotlib_says_which_extra_to_install(advice, monkeypatch):
    real = pictures.importlib.import_module

    def missing(name, *args):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(pictures.importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"plot: plotting needs matplotlib.*spmdtree\[plot\]"):
        advice.plot()


def test_advice_where_nothing_compiled_says_so_on_its_picture(tmp_path):
    def make_step(candidate):
        raise RuntimeError("a broken builder")

    found = st.candidates(st.layouts(8, AXES)[:2], RULES, 64)
    advice = st.advise(make_step, found, hardware=H100, progress=False, screen="cpu")
    fig = advice.plot(tmp_path / "none.png")
    texts = [t.get_text() for t in fig.axes[0].texts] + [t.get_text() for t in fig.texts]
    assert any("nothing to draw" in t for t in texts)
    assert any(t.startswith("2 rows not drawn") for t in texts)


def test_the_trace_of_a_step_with_a_conditional_lays_out_the_branch_it_times(tmp_path):
    def branchy(params, x):
        p = st.unbox(params)["layers"]
        y = x.value @ p["up"][0]
        heavy = lambda y: jnp.tanh(y @ p["down"][0] @ p["up"][1]) @ p["down"][1]  # noqa: E731
        light = lambda y: y @ p["down"][0]  # noqa: E731
        return jnp.sum(jax.lax.cond(jnp.sum(y) > 0, heavy, light, y))

    mesh = AbstractMesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
    plan = st.preflight(branchy, *arguments(), mesh=mesh, rules=RULES)
    trace, _ = check_trace(plan, H100, tmp_path)
    dots = [e for e in spans(trace, "compute") if e["args"].get("flops")]
    # the slower branch is the one timed: its three matmuls after the first, not one
    assert len(dots) >= 4, [e["name"] for e in dots]


def test_options_that_are_numpy_scalars_or_not_finite_are_strict_json():
    import numpy as np

    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    options = {"n": np.int64(3), "on": np.True_, "lr": float("inf"), "f": len}
    row = st.AdviceRow(st.Candidate(mesh, None, 8, options=options), "does not compile",
                       "a typo", None, None, None)  # fmt: skip
    data = st.Advice((row,), 0, H100, 2**30).to_dict()
    said = json.loads(json.dumps(data, allow_nan=False))["rows"][0]["options"]
    assert said == {"n": 3, "on": True, "lr": "inf", "f": repr(len)}
