"""Held against the devices (0.7): st.measure on this machine's CPU devices, the join of
a profile to the compiled schedule (StepPlan.compare) on a profile a TPU v5e recorded,
st.calibrate, Hardware as JSON, and advise(measure=k)."""

import dataclasses
import gzip
import json
import pathlib
import statistics

import chip_step
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from test_targets import has_compiler

import spmdtree as st

# Private: the per-kernel model has no public name
from spmdtree._src.step.hw import grid_share

DATA = pathlib.Path(__file__).parent / "data"
#: A CPU's own figures are no preset's: a hardware to time the prediction on.
CPU = st.Hardware("cpu", 2**34, 1e11, {"ici": (1e10, 0.0)})


def mlp_step():
    """A two-layer step with a gradient, its weights donated and fed back."""
    w = st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), (None, "model"))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))

    def step(w, x):
        loss, grad = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x.value @ w.value)))(w)
        return st.replace_boxed(w, w.value - 0.1 * grad.value), loss

    return step, (w, x)


def mesh(types=AxisType.Auto):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(types, types))


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_measure_runs_the_step_and_sets_the_prediction_beside_it(types):
    step, args = mlp_step()
    m = st.measure(step, *args, mesh=mesh(types), hardware=CPU, donate_argnums=0, steps=4)
    assert len(m.times) == 4 and min(m.times) == m.min_seconds > 0
    assert m.seconds == statistics.median(m.times)
    assert m.predicted_seconds == m.plan.time(CPU).predicted_seconds
    assert m.ratio == m.predicted_seconds / m.seconds
    # every instruction of the schedule is an OpTime; XLA CPU's events join them by name
    names = {k.name for k in m.plan.schedule.kernels()}
    assert names <= {op.name for op in m.ops}
    assert 0.5 < m.joined_share <= 1.0
    assert sum(op.measured_seconds for op in m.ops) > 0
    assert abs(sum(op.predicted_seconds for op in m.ops) - m.predicted_seconds) < 1e-9
    assert m.misses(2) == tuple(sorted(m.ops, key=lambda op: -abs(op.miss_seconds))[:2])


def test_measure_fills_shape_dtype_structs_and_runs_with_the_values_given():
    seen = []

    def step(x, lr, y):
        jax.debug.callback(
            lambda *v: seen.append(tuple(map(float, v))), jnp.sum(x.value), lr, jnp.sum(y)
        )
        return jnp.sum(x.value) * lr + jnp.sum(y)

    x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
    ones = lambda key, leaf: jnp.ones(leaf.shape, leaf.dtype)  # noqa: E731
    st.measure(
        step, x, 0.5, jnp.arange(8.0), mesh=mesh(), hardware=CPU, steps=1, warmup=0, fill=ones
    )
    # the filled leaf, the scalar and the array as given: every run (the profiled ones too)
    assert seen and set(seen) == {(32.0, 0.5, 28.0)}
    wrong = lambda key, leaf: jnp.ones((3,), jnp.int32)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"measure: fill returned int32\[3\] for leaf 0 .* a float32\[8, 4\]"
    ):
        st.measure(step, x, 0.5, jnp.arange(8.0), mesh=mesh(), hardware=CPU, steps=1, fill=wrong)


def test_a_measurement_reads_as_a_table_a_trace_and_json(tmp_path):
    step, args = mlp_step()
    m = st.measure(step, *args, mesh=mesh(), hardware=CPU, donate_argnums=0, steps=2)
    text = str(m)
    assert text.startswith("measured on cpu:0 (8 devices): 2 steps, median")
    assert f"{m.ratio:.2f} of measured" in text
    trace = m.trace(tmp_path / "m.json")
    tracks = {
        e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert set(tracks) == {"compute", "collectives", "measured"}  # no copies on a CPU
    measured = [
        e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tracks["measured"]
    ]
    assert measured
    assert {e["name"] for e in measured} <= {op.name for op in m.ops} | {"all-reduce"}
    assert json.loads((tmp_path / "m.json").read_text()) == trace
    data = json.loads(m.to_json())
    assert data == m.to_dict() | {"ops": data["ops"]}
    assert data["schema"] == "spmdtree.Measurement/1" and data["times"] == list(m.times)
    assert [op["name"] for op in data["ops"]] == [op.name for op in m.ops]
    # misses summed per instruction, so that those that cancel count (new in 0.8)
    missed = sum(abs(op.predicted_seconds - op.measured_seconds) for op in m.ops)
    assert data["op_error"] == m.op_error == pytest.approx(missed / m.seconds)
    assert f"sums to {m.op_error:.0%} of the step" in text


def test_the_op_error_counts_misses_that_cancel_in_the_ratio():
    ops = (
        st.OpTime("a", "memory", 1, predicted_seconds=3e-3, measured_seconds=1e-3),
        st.OpTime("b", "matmul", 1, predicted_seconds=1e-3, measured_seconds=3e-3),
    )
    m = st.Measurement(None, None, (4e-3,), 4e-3, ops, 1.0, 4e-3, "cpu:0")
    assert m.ratio == 1.0 and m.op_error == pytest.approx(1.0)
    right = st.Measurement(None, None, (4e-3,), 4e-3, ops[:1] * 0, 1.0, 4e-3, "cpu:0")
    assert right.op_error == 0.0


def test_the_share_the_join_could_not_place_is_flagged():
    step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh())
    (kernel,) = [k.name for k in step.schedule.kernels()]

    def event(name, ts, dur):
        args = {"hlo_op": name, "hlo_module": "jit_sin", "run_id": "1", "device_ordinal": "0"}
        return {"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur, "args": args}

    profile = {"traceEvents": [event(kernel, 0, 6), event("mystery.1", 6, 2)]}
    m = step.compare(profile, hardware=CPU)
    assert m.joined_share == 0.75 and m.seconds == 8e-6
    (flag,) = [f for f in m.flags if "joined no instruction" in f]
    assert flag.startswith("25.0% of the measured device time") and "mystery.1 (2 us)" in flag
    alone = step.compare({"traceEvents": [event(kernel, 0, 6)]}, hardware=CPU)
    assert alone.joined_share == 1.0 and not [f for f in alone.flags if "joined no" in f]


def test_a_loops_own_time_is_its_bodys_less():
    ops = [
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 2, "args": {"name": "XLA Ops"}},
    ]
    for start in (0, 100):  # two steps of one module, and another module's between
        ops += [
            {"ph": "X", "pid": 3, "tid": 1, "name": "jit_step(3)", "ts": start, "dur": 50},
            {"ph": "X", "pid": 3, "tid": 2, "name": "while.1", "ts": start + 1, "dur": 40},
            {"ph": "X", "pid": 3, "tid": 2, "name": "fusion.2", "ts": start + 2, "dur": 30},
        ]
    ops += [{"ph": "X", "pid": 3, "tid": 1, "name": "jit_fill(9)", "ts": 60, "dur": 5}]
    # an op twice over the same span is two ops, each its own time, not one inside the other
    ops += [{"ph": "X", "pid": 3, "tid": 2, "name": "copy.4", "ts": 140, "dur": 4}] * 2
    step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh())
    m = step.compare({"traceEvents": ops}, hardware=CPU, module="jit_step")
    assert m.times == (50e-6, 50e-6) and m.device == "/device:TPU:0"
    assert m.joined_share == 0.0  # neither is the sin step's instruction
    # Private: the profile's reader, the ops' own times, has no public name
    from spmdtree._src.step.time.profile import read_profile

    profile = read_profile({"traceEvents": ops}, "jit_step")
    assert profile.ops == {"while.1": 10e-6, "fusion.2": 30e-6, "copy.4": 4e-6}  # per step


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
def test_a_profile_the_chip_recorded_joins_the_deviceless_compile_of_its_step():
    """tests/data: benchmarks/chip.py's fixture run on a TPU v5e (its profile and
    measured times), joined to libtpu's compile of the same step without the chip."""
    recorded = json.loads((DATA / "fixture.json").read_text())
    plan = st.preflight(
        chip_step.step,
        chip_step.params(),
        chip_step.tokens(),
        mesh=chip_step.mesh(abstract=True),
        donate_argnums=0,
        target="tpu-v5e",
    )
    m = plan.compare(DATA / "fixture_trace.json.gz")
    assert m.hardware == st.hardware("tpu-v5e") and m.device == "/device:TPU:0"
    assert m.joined_share >= 0.9
    assert abs(m.seconds / recorded["seconds"] - 1) <= 0.03
    assert len(m.ops) == len({op.name for op in m.ops}) > 100
    # libtpu's own estimate of each kernel beside the model's, where it gives one
    assert sum(op.estimated_seconds for op in m.ops) == pytest.approx(plan.compiler_seconds)
    # on TPU, fitting is judged by libtpu's own peak, which it checks as it compiles
    assert plan.judged_bytes == plan.compiler_peak_bytes < plan.peak_bytes
    between = (plan.compiler_peak_bytes + plan.peak_bytes) // 2
    assert plan.fits(between) and not plan.fits(plan.compiler_peak_bytes - 1)


def test_measure_refuses_what_it_cannot_run():
    step, args = mlp_step()
    abstract = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    with pytest.raises(
        ValueError, match=r"measure: mesh is an AbstractMesh .*preflight\(\.\.\., target"
    ):
        st.measure(step, *args, mesh=abstract, hardware=CPU)
    with pytest.raises(TypeError, match=r"measure: mesh is 'data'; expected a jax.sharding.Mesh"):
        st.measure(step, *args, mesh="data", hardware=CPU)
    with pytest.raises(ValueError, match=r"measure: steps is 0; expected an int >= 1"):
        st.measure(step, *args, mesh=mesh(), hardware=CPU, steps=0)
    # 0.8: a preset's name or a file's path is taken (tests/test_hardware_names.py)
    with pytest.raises(TypeError, match=r"measure: hardware is 3; expected a st.Hardware, a"):
        st.measure(step, *args, mesh=mesh(), hardware=3)
    with pytest.raises(ValueError, match=r"measure: hardware is 'h900', which is no preset"):
        st.measure(step, *args, mesh=mesh(), hardware="h900")
    with pytest.raises(
        ValueError, match=r"measure: no preset matches what the step was compiled for .*hardware="
    ):
        st.measure(step, *args, mesh=mesh())


def test_compare_refuses_a_profile_that_is_no_trace(tmp_path):
    plan = st.preflight(jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), mesh=mesh())
    with pytest.raises(ValueError, match=r"StepPlan.compare: .* is no trace: expected Chrome"):
        plan.compare({"events": []}, hardware=CPU)
    bad = tmp_path / "x.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 0}]}'))
    with pytest.raises(ValueError, match=r"holds no device's instructions"):
        plan.compare(bad, hardware=CPU)
    (tmp_path / "notes.json").write_text("not json")
    with pytest.raises(ValueError, match=r"'.*notes.json' is no trace: it is not JSON"):
        plan.compare(tmp_path / "notes.json", hardware=CPU)
    no_time = {"traceEvents": [{"ph": "X", "name": "a", "args": {"hlo_op": "a"}}]}
    with pytest.raises(ValueError, match=r"the profile is no trace"):
        plan.compare(no_time, hardware=CPU)
    with pytest.raises(ValueError, match=r"holds no perfetto_trace.json.gz"):
        plan.compare(tmp_path, hardware=CPU)
    with pytest.raises(ValueError, match=r"no preset matches what the step was compiled for"):
        plan.compare(bad)


@pytest.mark.parametrize("name", ["a100", "h100", "tpu-v5e", "tpu-v5p"])
def test_hardware_round_trips_through_json(name, tmp_path):
    hardware = st.hardware(name)
    assert st.Hardware.from_json(hardware.to_json()) == hardware
    (tmp_path / "chip.json").write_text(hardware.to_json())
    assert st.Hardware.from_json(tmp_path / "chip.json") == hardware
    assert st.Hardware.from_json(str(tmp_path / "chip.json")).provenance == hardware.provenance
    mine = st.Hardware("mine", 2**30, 1e12, {"ici": (1e9, 0.0)}, provenance={"cores": "a guess"})
    assert st.Hardware.from_json(mine.to_json()) == mine


def test_hardware_json_names_what_is_missing_or_unknown(tmp_path):
    data = json.loads(st.hardware("h100").to_json())
    with pytest.raises(ValueError, match=r"Hardware.from_json: the JSON has a field 'clock'"):
        st.Hardware.from_json(json.dumps({**data, "clock": 1.98}))
    del data["tile"]
    with pytest.raises(ValueError, match=r"Hardware.from_json: the JSON has no field 'tile';"):
        st.Hardware.from_json(json.dumps(data))
    with pytest.raises(
        ValueError, match=r"the JSON's schema is None; expected 'spmdtree.Hardware/1'"
    ):
        st.Hardware.from_json("{}")
    with pytest.raises(ValueError, match=r"cannot read .*nowhere.json"):
        st.Hardware.from_json(tmp_path / "nowhere.json")
    with pytest.raises(TypeError, match=r"source is 3; expected JSON text or a path"):
        st.Hardware.from_json(3)
    with pytest.raises(ValueError, match=r"provenance has 'speed'"):
        st.Hardware("x", 1, 1.0, {"ici": (1.0, 0.0)}, provenance={"speed": "fast"})


def test_a_calibrated_chip_predicts_what_its_figures_give(cpu_calibration):
    calibrated = cpu_calibration
    assert calibrated.name == "tpu-v5e, calibrated"
    figures = ("matmul_efficiency", "memory_efficiency", "read_efficiency", "f32_speed")
    for figure in (*figures, "f32_highest_speed"):
        assert 0 < getattr(calibrated, figure) <= 1
        assert calibrated.provenance[figure].startswith("measured 20")
        assert f"jax {jax.__version__}" in calibrated.provenance[figure]
    assert (
        calibrated.provenance["flops_per_second"]
        == st.hardware("tpu-v5e").provenance["flops_per_second"]
    )
    assert calibrated.flash_forward_efficiency is None  # no flash kernel on a CPU: left out, said
    assert calibrated.provenance["flash_forward_efficiency"].startswith("not measured")
    # no update left unfused where no layout is tiled: the preset's share, said as such
    assert calibrated.update_efficiency == st.hardware("tpu-v5e").update_efficiency
    assert calibrated.provenance["update_efficiency"].startswith("not measured: cpu's compiler")
    assert st.Hardware.from_json(calibrated.to_json()) == calibrated
    # a matmul's time is what the measured figures give it: its FLOPs at the share
    # measured for its shape (0.8: read from the grid; at f32's rate, the CPU compile
    # widens bf16) beside its bytes at the measured bandwidth, overlapped as the model
    # overlaps them
    x = jax.ShapeDtypeStruct((1024, 2048), jnp.float32)
    w = jax.ShapeDtypeStruct((2048, 4096), jnp.float32)
    plan = st.preflight(jnp.matmul, x, w, mesh=jax.sharding.AbstractMesh((1,), ("data",)))
    (dot,) = [k for k in plan.schedule.kernels() if k.flops]
    share = grid_share(calibrated.matmul_grid, 1024, 2048, 4096, calibrated.tile)
    compute = dot.flops / (calibrated.flops_per_second * share * calibrated.f32_speed)
    memory = dot.bytes / (calibrated.hbm_bytes_per_second * calibrated.memory_efficiency)
    expected = max(compute, memory) + 0.05 * min(compute, memory)
    assert plan.time(calibrated).predicted_by_class["matmul"] == pytest.approx(expected, rel=1e-9)
    halved = tuple((m, k, n, share / 2) for m, k, n, share in calibrated.matmul_grid)
    slower = dataclasses.replace(calibrated, matmul_grid=halved)
    assert (
        plan.time(slower).predicted_by_class["matmul"]
        > plan.time(calibrated).predicted_by_class["matmul"]
    )


def test_calibrate_measures_each_kernels_fixed_cost_and_reads_the_grid_net_of_it(
    cpu_calibration,
):
    """launch_seconds is measured (a loop of tiny kernels, new in 0.8), said so, and each
    kernel of a step pays it; access_seconds (the wait for HBM, new in 0.8) is a TPU's
    only, the one device that keeps arrays apart from HBM: a CPU's is said unmeasured,
    the preset's 0 kept, and a step's kernels that read HBM pay it where it is not 0;
    the grid's shares are read net of both, so a small matmul's share is above what its
    time whole would give."""
    calibrated = cpu_calibration
    assert calibrated.launch_seconds > 0
    assert calibrated.provenance["launch_seconds"].startswith("measured 20")
    assert calibrated.access_seconds == 0.0  # the preset's, kept
    assert calibrated.provenance["access_seconds"].startswith("not measured: cpu")
    # XLA CPU fuses no optimizer's update into a matmul: the share goes unmeasured
    assert calibrated.fused_update_efficiency is None
    assert calibrated.provenance["fused_update_efficiency"].startswith("not measured: cpu")
    # nor does a CPU keep arrays in a memory of its own (new in 0.8: a TPU's S(1) rate)
    assert calibrated.on_chip_bytes_per_second is None
    assert calibrated.provenance["on_chip_bytes_per_second"].startswith("not measured: cpu")
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    plan = st.preflight(jnp.tanh, x, mesh=jax.sharding.AbstractMesh((1,), ("data",)))
    kernels = list(plan.schedule.kernels())
    assert plan.time(calibrated).predicted_by_class["launch"] == pytest.approx(
        len(kernels) * calibrated.launch_seconds
    )
    waited = dataclasses.replace(calibrated, access_seconds=1e-6)
    waits = sum(k.hbm_waits for k in kernels)
    assert waits >= 1
    assert plan.time(waited).predicted_by_class["launch"] == pytest.approx(
        len(kernels) * calibrated.launch_seconds + waits * 1e-6
    )
    free = dataclasses.replace(calibrated, launch_seconds=0.0)
    assert plan.time(free).predicted_seconds < plan.time(calibrated).predicted_seconds


def test_calibrate_takes_splash_blocks_and_refuses_ones_the_kernel_cannot_run():
    """flash_blocks (new in 0.8): one size, a mapping (a compute block left out is its
    parent's) or splash's own BlockSizes; blocks the benchmark's splash cannot run are
    refused before anything runs, each naming the block and what to give."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

    # Private: the blocks' reading has no public name of its own
    from spmdtree._src.errors import Mistake
    from spmdtree._src.step.measure.calibrate import splash_blocks

    blocks = splash_attention_kernel.BlockSizes
    assert splash_blocks(None) == blocks(*(512,) * 8)
    assert splash_blocks(1024).block_kv_dq == 1024
    given = blocks(*(256,) * 8)
    assert splash_blocks(given) is given
    mixed = splash_blocks({"block_q": 2048, "block_kv_dq": 256, "block_kv": 256})
    assert (mixed.block_q, mixed.block_kv, mixed.block_kv_compute, mixed.block_kv_dq) == (
        2048, 256, 256, 256,
    )  # fmt: skip
    fused = blocks(*(512,) * 6, use_fused_bwd_kernel=True)  # no dq blocks: none needed
    assert splash_blocks(fused) is fused
    cases = [
        (100, ValueError, r"calibrate: flash_blocks sets block_q to 100; expected a multiple of 128 that divides the benchmark's 4096 positions \(128, 256, 512, 1024, 2048 or 4096\)"),
        (8192, ValueError, r"flash_blocks sets block_q to 8192"),
        ({"block_kv": 384}, ValueError, r"flash_blocks sets block_kv to 384"),
        ({"block_q": None}, ValueError, r"flash_blocks sets block_q to None; .* every block is set"),
        ({"block_kv": 256, "block_kv_compute": 512}, ValueError, r"flash_blocks sets block_kv to 256 and block_kv_compute to 512; expected block_kv a multiple of block_kv_compute"),
        (blocks(block_q=256, block_kv=1024), ValueError, r"flash_blocks sets block_q_dkv to None"),
        ({"block_x": 512}, ValueError, r"flash_blocks names 'block_x'; expected splash's blocks: block_q, block_kv"),
        ("512", TypeError, r"calibrate: flash_blocks is '512'; expected one block size \(512\)"),
        (True, TypeError, r"flash_blocks is True"),
    ]  # fmt: skip
    for given, error, says in cases:
        with pytest.raises(Mistake) as raised:
            splash_blocks(given)
        with pytest.raises(error, match=says):
            raise raised.value.error("calibrate")
    # a device whose flash kernel is not splash: the blocks are refused first, not dropped
    for given in (256, 100):
        with pytest.raises(
            ValueError,
            match=rf"calibrate: flash_blocks is {given}, but they are splash attention's "
            r"blocks \(a TPU's kernel\) and cpu's flash kernel is none; leave flash_blocks out",
        ):
            st.calibrate(seconds=1.0, preset="tpu-v5e", flash_blocks=given)


def test_calibrate_refuses_a_device_no_preset_matches():
    with pytest.raises(
        ValueError, match=r"calibrate: no preset matches the device 'cpu'; pass preset="
    ):
        st.calibrate()
    with pytest.raises(ValueError, match=r"calibrate: seconds is 0; expected a number > 0"):
        st.calibrate(seconds=0, preset="h100")
    with pytest.raises(TypeError, match=r"calibrate: device is 'cpu'; expected a jax.Device"):
        st.calibrate("cpu", preset="h100")


def make_step(candidate):
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, 512), jnp.float32), ("batch", None)
    )
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((512, 512), jnp.float32), (None, "mlp"))
    return (lambda x, w: jnp.sum(jnp.tanh(x.value @ w.value)), (x, w), {})


def test_advise_measures_the_best_rows_and_ranks_them_by_what_they_took():
    rules = [("batch", "data"), ("mlp", "tensor")]
    meshes = st.layouts(jax.devices(), ("data", "tensor"))  # real meshes, new in 0.8
    candidates = [st.Candidate(m, rules, batch=64, length=16) for m in meshes]
    advice = st.advise(make_step, candidates, hardware=CPU, progress=False, measure=2)
    measured = [row for row in advice.rows if row.measured is not None]
    assert len(measured) == 2 and advice.rows[:2] == tuple(measured)
    assert measured[0].measured.seconds <= measured[1].measured.seconds
    unmeasured = st.advise(make_step, candidates, hardware=CPU, progress=False)
    assert {label(r) for r in measured} == {label(r) for r in unmeasured.rows[:2]}
    for row in measured:
        assert row.tokens_per_second == 64 * 16 / row.measured.seconds
        assert row.measured.predicted_seconds == row.time.predicted_seconds
    (header,) = [line for line in str(advice).splitlines() if line.startswith("#  layout")]
    assert header.split()[7:10] == ["predicted", "measured", "tokens/s"]
    data = advice.to_dict()["rows"]
    assert data[0]["measured"]["seconds"] == measured[0].measured.seconds
    assert data[2]["measured"] is None


def label(row):
    return tuple(row.candidate.mesh.shape.items())


def test_advise_refuses_to_measure_rows_whose_devices_are_not_here():
    candidates = [st.Candidate(m, [("batch", "data")], batch=64) for m in st.layouts(8, ("data",))]
    called = []
    with pytest.raises(
        ValueError,
        match=r"advise: measure=1 runs rows on their devices, but candidate 0's mesh is an AbstractMesh",
    ):
        st.advise(lambda c: called.append(c), candidates, hardware=CPU, measure=1)
    assert called == []
    with pytest.raises(ValueError, match=r"advise: measure is -1; expected an int >= 0"):
        st.advise(make_step, candidates, hardware=CPU, measure=-1)


def test_a_compiled_step_jax_cannot_call_runs_through_jax_jit(monkeypatch):
    """jax 0.10.2 on a TPU v5e: a splash step compiled ahead of time asked for its
    masks' constants as arguments ("Computation compiled for 43 inputs but called
    with 38") where jax.jit ran the same step; measure then runs it through jit."""
    refused = []

    def refuse(self, *args, **kwargs):
        refused.append(len(args))
        raise TypeError(
            f"Computation compiled for {len(args) + 5} inputs but called with {len(args)}"
        )

    monkeypatch.setattr(jax.stages.Compiled, "__call__", refuse)
    step, args = mlp_step()
    m = st.measure(step, *args, mesh=mesh(), hardware=CPU, donate_argnums=0, steps=3)
    assert refused == [2] and len(m.times) == 3 and m.joined_share > 0.5
    assert {k.name for k in m.plan.schedule.kernels()} <= {op.name for op in m.ops}


def test_a_plan_on_one_device_says_nothing_of_replication():
    """A one-chip VM's step holds every array whole: that is no flag (0.6 listed every
    param as replicated on every device)."""
    w = st.Partitioned(jax.ShapeDtypeStruct((1024, 1024), jnp.float32), (None, None))
    one = jax.sharding.AbstractMesh((1,), ("data",))
    assert st.plan(w, one).rows[0].flags == ()
    step = st.preflight(lambda w: jnp.sin(w.value), w, mesh=one)
    assert not [f for f in step.flags if "replicated" in f]
    two = jax.sharding.AbstractMesh((2,), ("data",))
    assert st.plan(w, two).rows[0].flags == ("4.0 MiB replicated on every device",)
