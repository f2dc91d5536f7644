"""Every script in examples/ runs end to end with small sizes (a smoke test)."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# Small sizes per script, so the whole suite stays fast; scripts not listed run with defaults.
SMALL = {
    "seed_mlp.py": ["--batch", "8", "--hidden", "16"],
    "scan_layers.py": ["--layers", "2", "--width", "16", "--steps", "3"],
    "multihost.py": ["--processes", "1"],
    "train.py": ["--steps", "20", "--log-every", "10", "--width", "32", "--mlp", "64"],
    "checkpoint.py": ["--steps", "4", "--save-every", "2"],
    "preflight.py": ["--chips", "256", "--no-search", "--length", "1024"],
}


SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if "__main__" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *SMALL.get(script, [])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if script == "checkpoint.py":  # every restore, both optimizers, went on alike
        assert done.stdout.count("equal, bit for bit") >= 4, done.stdout
        assert done.stdout.count("(d) fresh process") == 2
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
    if script == "train.py":  # the plan table, progress lines and the summary
        assert "names -> mesh spec" in done.stdout and "per device" in done.stdout
        assert "step   10  loss" in done.stdout and "steps/s" in done.stdout
        assert "x less than unsharded" in done.stdout
