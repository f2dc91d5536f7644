"""The command line (SPEC "What users look at (0.6)"): ``spmdtree advise`` and
``spmdtree preflight``, run as a user runs them, in a subprocess."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from spmdtree._src import cli

#: A user's module, as a user writes one: make_step(candidate) and RULES.
MODULE = textwrap.dedent(
    '''
    """A two-layer MLP's gradient step, for the command line."""
    import jax
    import jax.numpy as jnp
    import spmdtree as st

    RULES = [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")]


    def loss(params, x):
        return jnp.mean((jax.nn.relu(x @ params["w1"]) @ params["w2"]) ** 2)


    def make_step(candidate):
        width = 256 * (candidate.options or {}).get("width", 1)
        box = lambda shape, names: st.LogicallyPartitioned(
            jax.ShapeDtypeStruct(shape, jnp.float32), names)
        params = {"w1": box((128, width), ("embed", "mlp")), "w2": box((width, 128), ("mlp", "embed"))}
        x = box((candidate.batch, 128), ("batch", "embed"))
        return (lambda p, x: jax.grad(loss)(st.unbox(p), x.value)), (params, x), {}
    '''
)

#: jax's own start-up lines on stderr where an accelerator's plugin is installed (absl).
JAX_LOG = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} )")


def run(tmp_path, *args):
    (tmp_path / "mystep.py").write_text(MODULE)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-m", "spmdtree", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    said = [line for line in done.stderr.splitlines() if not JAX_LOG.match(line)]
    return done, said


ADVISE = ["advise", "mystep:make_step", "--devices", "8", "--axes", "data,fsdp,tensor"]


def test_advise_prints_the_table_and_writes_json_and_a_plot(tmp_path):
    done, _ = run(
        tmp_path,
        *ADVISE,
        "--batch", "64", "--length", "128", "--hardware", "h100", "--screen", "cpu",
        "--option", "width=1,2", "--json", "out.json", "--plot", "out.png",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "candidates on 8 x h100" in done.stdout and "verdict" in done.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["schema"] == "spmdtree.Advice/1" and data["hardware"] == "h100"
    assert {row["options"]["width"] for row in data["rows"]} == {1, 2}
    assert len(data["rows"]) == 2 * 10  # 10 layouts of 8 over three axes, x 2 widths
    for row in data["rows"]:  # the table names every row the JSON has
        assert row["label"] in done.stdout
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_preflight_prints_the_step_and_writes_its_trace_and_json(tmp_path):
    done, _ = run(
        tmp_path,
        "preflight", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "64",
        "--hardware", "h100", "--json", "step.json", "--trace", "trace.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "memory per device" in done.stdout and "time on h100: predicted" in done.stdout
    step = json.loads((tmp_path / "step.json").read_text())
    assert step["schema"] == "spmdtree.StepPlan/1"
    assert step["mesh"]["axes"] == {"data": 2, "fsdp": 2, "tensor": 2}
    trace = json.loads((tmp_path / "trace.json").read_text())
    end = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X")
    assert end / 1e6 == pytest.approx(step["time"]["predicted_seconds"], rel=0.01)


@pytest.mark.parametrize(
    "args, says",
    [
        (["preflight", "mystep:nosuch", "--mesh", "data=2", "--batch", "8"], "has no 'nosuch'"),
        (["preflight", "nosuch:make_step", "--mesh", "data=2", "--batch", "8"], "no module 'nosuch'"),
        (["preflight", "mystep", "--mesh", "data=2", "--batch", "8"], "is not MODULE:MAKE_STEP"),
        (["preflight", "mystep:make_step", "--mesh", "data", "--batch", "8"], "is not AXIS=N"),
        ([*ADVISE, "--batch", "8", "--hardware", "h999"], "no preset"),
        ([*ADVISE, "--batch", "8", "--hardware", "h100", "--option", "width"], "is not NAME=V1,V2"),
        (["advise", "mystep:make_step", "--batch", "8", "--hardware", "h100"], "--devices"),
        (["preflight", "mystep:make_step", "--mesh", "data=8", "--batch", "8", "--trace", "t.json"],
         "needs a chip to time on"),
    ],
    ids=["unknown-function", "unknown-module", "no-function", "bad-mesh", "unknown-hardware",
         "bad-option", "missing-argument", "trace-without-hardware"],
)  # fmt: skip
def test_a_users_mistake_is_one_line_on_stderr_and_exit_2(tmp_path, args, says):
    done, said = run(tmp_path, *args)
    assert done.returncode == 2
    assert len(said) == 1, said
    assert said[0].startswith("spmdtree") and says in said[0]


def test_a_py_file_is_a_module_too(tmp_path):
    done, said = run(
        tmp_path, "preflight", str(tmp_path / "mystep.py") + ":make_step", "--mesh",
        "data=2,fsdp=2,tensor=2", "--batch", "8",
    )  # fmt: skip
    assert done.returncode == 0, said
    assert "step on 8 devices" in done.stdout


def test_help_says_how_to_name_the_step():
    done = subprocess.run(
        [sys.executable, "-m", "spmdtree", "advise", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    for said in ("MODULE:MAKE_STEP", "--devices", "--option NAME=V1,V2", "example: spmdtree"):
        assert said in done.stdout


def test_the_console_script_is_installed():
    script = pathlib.Path(sys.executable).parent / "spmdtree"
    assert script.exists(), "pip install -e . installs the spmdtree command"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "preflight" in done.stdout


@pytest.mark.parametrize(
    "text, value",
    [("4", 4), ("0.5", 0.5), ("true", True), ("None", None), ("full", "full"), ("nan", "nan")],
)
def test_option_values_are_read_as_json_scalars(text, value):
    assert cli._value(text) == value and type(cli._value(text)) is type(value)
