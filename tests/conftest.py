"""Test set-up: 8 CPU devices for JAX, and reproducible hypothesis runs.

This runs before any test module imports JAX, so the flag takes effect.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Where the accelerators' compilers are installed (spmdtree[cuda], spmdtree[tpu]),
# the target tests compile with them here too, without a device.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)

# CI replays exactly: derandomized, no example database, bounded examples.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _no_leftover_rules():
    """Each test starts and ends with no rules in the context."""
    import spmdtree as st

    assert st.get_logical_axis_rules() == (), "a previous test leaked rules"
    yield
    st.set_logical_axis_rules(())


@pytest.fixture(scope="session")
def cpu_calibration():
    """`st.calibrate` on this process's CPU, a v5e's peak kept: run once per worker
    (each run compiles its grid, about 20 s) for the tests that read it."""
    import spmdtree as st

    return st.calibrate(seconds=2.0, preset="tpu-v5e")


#: Files whose tests compile with XLA GPU or libtpu where they are installed: every
#: test in them is a target test, so that ``pytest -m target`` runs them all.
TARGET_FILES = frozenset(
    {
        "test_targets.py",
        "test_hlo_targets.py",
        "test_hlo_libtpu.py",
        "test_predict.py",
        "test_cudnn.py",
    }
)


def pytest_collection_modifyitems(config, items):
    """Marks `target` every test of `TARGET_FILES` and every test skipped without
    ``spmdtree[cuda]`` or ``spmdtree[tpu]`` (its skip reason names the extra)."""
    for item in items:
        reasons = [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")]
        if item.path.name in TARGET_FILES or any("spmdtree[" in r for r in reasons):
            item.add_marker(pytest.mark.target)
