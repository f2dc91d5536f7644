"""A hardware by its name or its file wherever one is taken, and a step that knows
the chip it was compiled for (new in 0.8)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from test_targets import has_compiler

import spmdtree as st

LIBTPU = pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
MESH = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,))


def step(w, x):
    return jnp.sum(jnp.tanh(x.value @ w.value))


def arguments():
    w = st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), (None, None))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
    return w, x


@pytest.fixture
def chip_file(tmp_path):
    """A calibrated chip's file: the v5e preset with a figure of its own."""
    chip = dataclasses.replace(st.hardware("tpu-v5e"), name="my v5e", matmul_efficiency=0.5)
    path = tmp_path / "chip.json"
    path.write_text(chip.to_json())
    return path, chip


def same_time(a, b):
    return (a.predicted_seconds, a.bound_seconds, a.flags) == (
        b.predicted_seconds,
        b.bound_seconds,
        b.flags,
    )


def test_time_takes_a_presets_name_or_a_files_path(chip_file):
    path, chip = chip_file
    plan = st.preflight(step, *arguments(), mesh=MESH)
    assert same_time(plan.time("h100"), plan.time(st.hardware("h100")))
    assert same_time(plan.time(path), plan.time(chip))
    assert same_time(plan.time(str(path)), plan.time(chip))


def test_a_step_compiled_for_no_target_asks_for_one():
    plan = st.preflight(step, *arguments(), mesh=MESH)
    assert plan.target_hardware is None
    with pytest.raises(ValueError, match=r"^time: this step was compiled for no target"):
        plan.time()
    with pytest.raises(ValueError, match=r"^fits: .*needs budget_bytes="):
        plan.fits()


@LIBTPU
def test_a_step_compiled_for_a_target_keeps_its_chip():
    plan = st.preflight(step, *arguments(), mesh=MESH, target="tpu-v5e")
    v5e = st.hardware("tpu-v5e")
    assert plan.target_hardware == v5e
    assert same_time(plan.time(), plan.time(v5e))
    assert same_time(plan.time("tpu-v5e"), plan.time(v5e))
    assert plan.fits() == plan.fits(v5e.memory_bytes)
    assert plan.fits()  # a few KiB on a 16 GiB chip


@LIBTPU
def test_a_target_given_as_a_file_compiles_for_its_chip(chip_file):
    path, chip = chip_file
    plan = st.preflight(step, *arguments(), mesh=MESH, target=str(path))
    assert plan.target_hardware == chip
    assert "libtpu" in plan.target
    assert same_time(plan.time(), plan.time(chip))
    # the file's own figure times it, not the preset's of that chip
    assert plan.time().predicted_seconds != plan.time("tpu-v5e").predicted_seconds


def test_measure_takes_a_presets_name():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    m = st.measure(step, *arguments(), mesh=mesh, hardware="h100", steps=2, warmup=1)
    assert m.plan.time("h100").predicted_seconds == m.predicted_seconds


@pytest.mark.parametrize(
    "given, kind, said",
    [
        ("h900", ValueError, r"hardware is 'h900', which is no preset; pass a preset's name \('a100'"),
        ("nowhere/chip.json", ValueError, r"hardware 'nowhere/chip.json': cannot read"),
        (3, TypeError, r"hardware is 3; expected a st.Hardware, a preset's name"),
    ],
    ids=["unknown-name", "missing-file", "not-a-name"],
)  # fmt: skip
def test_a_hardware_that_cannot_be_found_is_said(given, kind, said):
    plan = st.preflight(step, *arguments(), mesh=MESH)
    with pytest.raises(kind, match=rf"^time: {said}"):
        plan.time(given)


def test_a_file_of_another_schema_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema": "spmdtree.StepPlan/1"}))
    plan = st.preflight(step, *arguments(), mesh=MESH)
    with pytest.raises(ValueError, match=rf"^time: hardware '{path}': the JSON's schema"):
        plan.time(path)
    with pytest.raises(ValueError, match=r"^preflight: target '.*plan.json': the JSON's schema"):
        st.preflight(step, *arguments(), mesh=MESH, target=str(path))
    with pytest.raises(ValueError, match=r"^preflight: target is 'h900', which is no preset"):
        st.preflight(step, *arguments(), mesh=MESH, target="h900")


@LIBTPU
def test_compare_times_a_target_steps_prediction_on_its_own_chip(chip_file):
    # as time() does: the file's figures, not the preset of the chip's kind
    path, chip = chip_file
    plan = st.preflight(step, *arguments(), mesh=MESH, target=str(path))
    (kernel, *_) = [k.name for k in plan.schedule.kernels() if k.flops]
    ops = [{"ph": "X", "pid": 1, "tid": 1, "name": kernel, "ts": 0, "dur": 4,
            "args": {"hlo_op": kernel, "hlo_module": "jit_step", "run_id": "1"}}]  # fmt: skip
    profile = {"traceEvents": ops}
    assert plan.compare(profile).hardware == chip
    assert plan.compare(profile, hardware="tpu-v5e").hardware == st.hardware("tpu-v5e")
