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

# Private: the command line's parser, run in process (its console script is public)
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


def cuda_installed():
    from test_targets import has_compiler

    return has_compiler("cuda")


#: jax's own start-up lines on stderr where an accelerator's plugin is installed (absl).
JAX_LOG = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} )")


#: Modules with a user's mistake in them, beside mystep.
BROKEN = {
    "raising.py": "import mystep\nRULES = mystep.RULES\n\ndef make_step(candidate):\n"
    "    raise RuntimeError('a broken builder')\n",
    "badimport.py": "RULES = []\n1 / 0\n",
    "norules.py": "from mystep import make_step\n",
}


def run(tmp_path, *args):
    (tmp_path / "mystep.py").write_text(MODULE)
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
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
        (["preflight", "raising:make_step", "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "8"],
         "make_step raised RuntimeError: a broken builder"),
        (["preflight", "badimport:make_step", "--mesh", "data=8", "--batch", "8"],
         "importing badimport raised ZeroDivisionError"),
        (["preflight", "norules:make_step", "--mesh", "data=8", "--batch", "8"],
         "module 'norules' has no RULES"),
        (["preflight", "mystep:make_step", "--mesh", "data=2,fsdp=4", "--batch", "8"],
         "the rules name mesh axis 'tensor' (for 'mlp'), not in --mesh data=2,fsdp=4"),
        (["advise", "mystep:make_step", "--devices", "8", "--axes", "data,fsdp", "--batch", "8",
          "--hardware", "h100"], "not in --axes data,fsdp: add it to --axes"),
        ([*ADVISE, "--batch", "8", "--hardware", "h100", "--option", "width=1",
          "--option", "width=2"], "--option width is given twice"),
        (["preflight", "mystep:make_step", "--mesh", "data=8", "--batch", "0"], "--batch"),
        (["preflight", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "8",
          "--hardware", "h100", "--plot", "step.xyz"], "no format matplotlib writes"),
        (["preflight", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "8",
          "--json", "nowhere/step.json"], "no folder nowhere"),
        (["preflight", "mystep:make_stpe", "--mesh", "data=8", "--batch", "8"],
         "did you mean 'make_step'?"),
        ([*ADVISE, "--batch", "8", "--hardware", "h100", "--budget-gib", "inf"],
         "inf is not a finite number of GiB > 0"),
        ([*ADVISE, "--batch", "8", "--hardware", "h100", "--option", "width=1,"],
         "has an empty value"),
    ],
    ids=["unknown-function", "unknown-module", "no-function", "bad-mesh", "unknown-hardware",
         "bad-option", "missing-argument", "trace-without-hardware", "make-step-raises",
         "import-raises", "no-rules", "mesh-lacks-an-axis", "axes-lack-an-axis",
         "option-twice", "batch-zero", "plot-format", "no-folder", "misspelt-function",
         "budget-not-finite", "empty-option-value"],
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


def test_advise_where_nothing_fits_prints_the_table_and_exits_1(tmp_path):
    done, said = run(tmp_path, *ADVISE, "--batch", "64", "--hardware", "h100", "--screen", "cpu",
                     "--budget-gib", "0.000001")  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "over budget" in done.stdout
    assert said[-1] == "spmdtree advise: no candidate fits (the table says why)"
    assert all(line.startswith("advise") for line in said[:-1])  # its progress, then that


#: A user's pipelined step (0.8): stages over the mesh's "stage" axis where it has
#: more than one, the candidate's microbatches.
PIPED = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import spmdtree as st

    RULES = [("batch", "data"), ("stage", "stage"), ("layers", None), ("embed", None)]


    def block(x, layer):
        return jnp.tanh(x @ st.unbox(layer)["w"]), None


    def make_step(candidate):
        stages = dict(candidate.mesh.shape)["stage"]
        w = {"w": st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((2, 64, 64), jnp.float32), ("layers", "embed", None))}
        x = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((candidate.batch, 64), jnp.float32), ("batch", "embed"))
        micro = candidate.options["microbatches"]
        run = lambda p, x: st.pipeline(block, x, p, microbatches=micro)[0]
        step = lambda p, x: jax.grad(lambda p: jnp.mean(run(p, x.value)))(p)
        return step, (st.stages(w, stages), x), {}
    """
)


def test_advise_leaves_out_the_layouts_no_pipeline_runs(tmp_path):
    (tmp_path / "piped.py").write_text(PIPED)
    done, _ = run(
        tmp_path,
        "advise", "piped:make_step", "--devices", "4", "--axes", "data,stage", "--layers", "2",
        "--batch", "8", "--option", "microbatches=2,4", "--hardware", "h100", "--screen", "cpu",
        "--json", "out.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    shapes = sorted((row["mesh"]["axes"]["stage"], row["options"]["microbatches"]) for row in rows)
    assert shapes == [(1, 2), (1, 4), (2, 2), (2, 4)]  # 4 stages do not divide 2 layers
    (header,) = [line for line in done.stdout.splitlines() if line.startswith("#  layout")]
    assert "predicted  bubble" in header
    piped = [row for row in rows if row["mesh"]["axes"]["stage"] == 2]
    assert all(row["time"]["bubble_seconds"] > 0 for row in piped)


def test_json_to_stdout(tmp_path):
    done, _ = run(tmp_path, "preflight", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2",
                  "--batch", "8", "--json", "-")  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # stdout is the JSON alone; the table went to stderr
    assert data["schema"] == "spmdtree.StepPlan/1" and not (tmp_path / "-").exists()
    assert "memory per device" in done.stderr


def test_a_py_file_named_twice_is_imported_once_and_never_over_a_loaded_module(tmp_path):
    # Private: the command line's parser, run in process (its console script is public)
    from spmdtree._src import cli

    (tmp_path / "copy.py").write_text("RULES = []\nLOADS = []\nLOADS.append(1)\n")
    import copy as standard

    first = cli._module(str(tmp_path / "copy.py"))
    again = cli._module(str(tmp_path / "copy.py"))
    assert first is again and first.LOADS == [1]  # its code ran once
    assert sys.modules["copy"] is standard  # the standard library's copy untouched
    assert first.__name__ == "_spmdtree_user_copy"


def test_measure_runs_the_step_here_and_writes_its_json_and_trace(tmp_path):
    import spmdtree as st

    cpu = st.Hardware("cpu", 2**34, 1e11, {"ici": (1e10, 0.0)})
    (tmp_path / "cpu.json").write_text(cpu.to_json())
    done, said = run(
        tmp_path,
        "measure", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "64",
        "--hardware", "cpu.json", "--steps", "2", "--warmup", "1", "--json", "m.json",
        "--trace", "m.trace.json",
    )  # fmt: skip
    assert done.returncode == 0, said
    assert done.stdout.startswith("measured on cpu:0 (8 devices): 2 steps, median")
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["schema"] == "spmdtree.Measurement/1" and data["hardware"] == "cpu"
    assert len(data["times"]) == 2 and data["ops"]
    trace = json.loads((tmp_path / "m.trace.json").read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {
        "compute",
        "collectives",
        "measured",
    }


def test_calibrate_writes_the_chips_json_that_hardware_takes(tmp_path):
    done, said = run(tmp_path, "calibrate", "--seconds", "2", "--preset", "tpu-v5e", "--json", "chip.json")  # fmt: skip
    assert done.returncode == 0, said
    assert "matmul_efficiency" in done.stdout and "measured 20" in done.stdout
    done, said = run(
        tmp_path, "preflight", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2",
        "--batch", "8", "--hardware", "chip.json",
    )  # fmt: skip
    assert done.returncode == 0, said
    assert "time on tpu-v5e, calibrated: predicted" in done.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["calibrate", "--seconds", "2"], "calibrate: no preset matches the device 'cpu'"),
        (["calibrate", "--preset", "tpu-v5e", "--flash-blocks", "512"],
         "calibrate: flash_blocks is 512, but they are splash attention's blocks"),
        ([*ADVISE, "--batch", "8", "--hardware", "nowhere.json"], "cannot read 'nowhere.json'"),
        (["measure", "mystep:make_step", "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "8"],
         "no preset matches what the step was compiled for"),
    ],
    ids=[
        "calibrate-without-preset",
        "calibrate-flash-blocks-on-a-cpu",
        "hardware-file-missing",
        "measure-without-hardware",
    ],
)  # fmt: skip
def test_the_chips_mistakes_are_one_line_too(tmp_path, args, says):
    done, said = run(tmp_path, *args)
    assert done.returncode == 2
    assert len(said) == 1 and says in said[0], said


@pytest.mark.skipif(not cuda_installed(), reason="needs the CUDA plugin (spmdtree[cuda])")
@pytest.mark.parametrize("form", ["script", "module"])
def test_the_command_keeps_the_plugins_start_up_log_out(tmp_path, form):
    """With the CUDA plugin installed and no GPU, importing jax logs six lines; the
    spmdtree command's advise and preflight start jax's CPU backend alone and keep
    them out: a mistake is one line, unfiltered. ``python -m spmdtree`` too (new in
    0.8: the package's import started jax first, and the six lines came out)."""
    script = pathlib.Path(sys.executable).parent / "spmdtree"
    command = [str(script)] if form == "script" else [sys.executable, "-m", "spmdtree"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")
    }
    done = subprocess.run(
        [*command, "preflight", "nosuch:make_step", "--mesh", "data=2", "--batch", "8"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"spmdtree preflight: no module 'nosuch' importable from {tmp_path} (give a dotted "
        "module on the path, or a path to a .py file). (--traceback for the whole trace)"
    ]
