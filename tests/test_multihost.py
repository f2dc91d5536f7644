"""Multi-process training: 2 processes x 4 CPU devices equal 1 process x 8 devices.

Launches examples/multihost.py, which starts its processes on 127.0.0.1 with
jax.distributed (gloo collectives, a free port, a bounded initialization
timeout) under a deadline that kills stragglers. Each worker checks that it
holds only its own shards; here the losses and the gathered params of the
two-process run are compared with a one-process run of the same program.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "multihost.py"


def run(processes: int, out: pathlib.Path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--processes",
            str(processes),
            "--out",
            str(out),
            "--timeout",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    return run(2, tmp / "two.json"), run(1, tmp / "one.json")


def test_each_process_holds_only_its_shards(runs):
    (_, stdout), _ = runs
    assert "process 0: w1 (16, 64) sharded P('data', 'model'), holds rows [(0, 8, 1)]" in stdout
    assert "process 1: w1 (16, 64) sharded P('data', 'model'), holds rows [(8, 16, 1)]" in stdout
    assert "holds 4.0 KiB on its 4 of the mesh's 8 devices (2 processes)" in stdout


def test_two_processes_equal_one_process(runs):
    (two, _), (one, _) = runs
    assert len(two["losses"]) == 3
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    for name in ("w1", "w2"):
        np.testing.assert_allclose(two["params"][name], one["params"][name], rtol=1e-5, atol=1e-6)
