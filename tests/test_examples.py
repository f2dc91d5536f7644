"""Every script in examples/ runs end to end with small sizes (a smoke test)."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# Small sizes per script, so the whole suite stays fast; scripts not listed run with defaults.
SMALL = {
    "seed_mlp.py": ["--batch", "8", "--hidden", "16"],
    "scan_layers.py": ["--layers", "2", "--width", "16", "--steps", "3"],
    "multihost.py": ["--processes", "1"],
    "train.py": ["--steps", "20", "--log-every", "10", "--width", "32", "--mlp", "64"],
    # adafactor runs in full in tests/test_docs.py (docs/checkpoints.md's output)
    "checkpoint.py": ["--steps", "4", "--save-every", "2", "--optimizer", "adamw"],
    "advise.py": ["--quick"],
    "targets.py": ["--quick"],
    "pipeline.py": ["--steps", "10"],
}


# examples/preflight.py runs in full in tests/test_docs.py, which checks the output
# docs/planning.md shows; examples/moe.py's main runs in tests/test_moe.py, which checks
# what it prints.
SCRIPTS = sorted(
    p.name
    for p in EXAMPLES.glob("*.py")
    if "__main__" in p.read_text() and p.name not in ("preflight.py", "moe.py")
)


def run(script, args, devices=8):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize("devices", [1, 6])
@pytest.mark.parametrize("script", ["train.py", "seed_mlp.py", "scan_layers.py"])
def test_examples_run_on_the_devices_there_are(script, devices):
    done = run(script, SMALL[script], devices)
    assert done.returncode == 0, done.stdout + done.stderr
    shape = {1: "1x1x1", 6: "3x1x2"} if script == "train.py" else {1: "1x1", 6: "3x2"}
    sizes = [int(n) for n in shape[devices].split("x")]
    assert done.stdout.startswith("mesh: {") and f"on {devices} cpu device(s)" in done.stdout
    if script == "train.py":  # JAX's default mesh: Explicit axes
        assert f"on {devices} cpu device(s), Explicit axes\n" in done.stdout
    assert list(eval(done.stdout.split("mesh: ")[1].split(" on ")[0]).values()) == sizes


def test_no_example_ends_in_a_traceback_without_arguments():
    done = run("checkpoint.py", [], devices=1)  # it needs 8 devices, and says so
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "needs 8 devices" in done.stderr
    launched = run("multihost.py", [])  # no arguments: two local processes
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "launching 2 local processes" in launched.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    done = run(script, SMALL.get(script, []))
    assert done.returncode == 0, done.stdout + done.stderr
    if script == "checkpoint.py":  # every restore of adamw's state went on alike
        # Same mesh: bit for bit; another mesh: the stated tolerance, whatever the digits.
        assert "adamw: mesh 2x4" in done.stdout and "adafactor" not in done.stdout
        assert done.stdout.count("equal, bit for bit") == 2, done.stdout
        assert done.stdout.count("equal within 1e-5 relative") == 2, done.stdout
        assert done.stdout.count("(d) fresh process") == 1
        assert "every restore went on with the unbroken run's losses" in done.stdout
    if script == "plan_llama.py":  # every model, chip count and rule set; a diff
        assert done.stdout.count(" yes") + done.stdout.count(" no, ") == 24, done.stdout
        assert "405B     256  data*tensor" in done.stdout and "received" in done.stdout
    if script == "preflight.py":  # both layouts on 256 chips, and the step's table
        assert (
            "  256  fsdp+tensor 1x32x8" in done.stdout and "  256  hsdp+tensor 8x4x8" in done.stdout
        )
        assert "peak" in done.stdout and "collectives per step" in done.stdout
    if script == "plan_llama.py":
        assert "arrays fit" in done.stdout and "st.preflight" in done.stdout
    if script == "targets.py":  # the estimate, then each target or how to install it
        assert "8 CPU devices (the XLA CPU compiler's estimate):" in done.stdout, done.stdout
        for target, extra in (("h100", "cuda"), ("tpu-v5p", "tpu")):
            said = (f"8 x {target}", f"pip install 'spmdtree[{extra}]'")
            assert any(s in done.stdout for s in said), done.stdout
    if script == "advise.py":  # the ranked table of every candidate, the best, why the rest lost
        # 2 layouts x 2 remat policies x 2 microbatch counts (0.6: options searched too)
        table = done.stdout.split("8 candidates on 16 x h100")[1].split("times: bound")[0]
        ranked = [line.strip() for line in table.splitlines() if re.match(r"\s*\d+\s+data ", line)]
        assert [line.split()[0] for line in ranked] == [str(n) for n in range(1, 9)], done.stdout
        assert all(line.endswith("fits") for line in ranked)
        assert all(", remat " in line and ", microbatches " in line for line in ranked)
        assert "best: data " in done.stdout and "why the others lost:" in done.stdout
        assert "7 fit but are slower" in done.stdout and "8 compiles" in done.stdout
        changed = done.stdout.split("what the options changed:\n")[1].splitlines()[:4]
        assert sorted(line.split(":")[0].strip() for line in changed) == sorted(
            f"remat {remat}, microbatches {n}" for remat in ("full", "minimal") for n in (1, 4)
        ), done.stdout
        assert "advise: 8 candidates on 16 devices, at most 8 compiles" in done.stderr
        assert done.stderr.count("advise [") == 8  # one progress line per candidate
        assert "advice.best.make_mesh() gives the jax.sharding.Mesh" in done.stdout
    if script == "pipeline.py":  # the loss equals the scan's; what the stages pass; the bubble
        assert "pipelined" in done.stdout and "(equal: True)" in done.stdout, done.stdout
        assert "  collective-permute" in done.stdout and "over stage (2)" in done.stdout
        assert "pipeline  2 loops over stage: 11 iterations, 3 of them on padding" in done.stdout
        assert "-,stage,layers,embed,mlp -> -,stage,-,-,-" in done.stdout  # its stage's layers
        assert "step   10  loss" in done.stdout
    if script == "train.py":  # the plan table, progress lines and the summary
        assert "names -> mesh spec" in done.stdout and "per device" in done.stdout
        assert "step   10  loss" in done.stdout and "steps/s" in done.stdout
        assert "x less than unsharded" in done.stdout
        assert "cpu device(s), Explicit axes" in done.stdout  # the default, jax.make_mesh's


def test_train_example_on_explicit_axes_has_the_losses_of_auto_axes(capsys):
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLES / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    argv = ["--steps", "30", "--log-every", "1"]  # the README's sizes
    explicit = train.main([*argv, "--axis-types", "explicit"])
    auto = train.main([*argv, "--axis-types", "auto"])
    printed = capsys.readouterr().out
    assert "Explicit axes" in printed and "Auto axes" in printed
    assert len(explicit) == len(auto) == 30
    # The two programs may associate sums differently: equal within a tolerance.
    np.testing.assert_allclose(explicit, auto, rtol=1e-4)
    assert explicit[-1] < explicit[0]
