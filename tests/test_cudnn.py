"""A GPU step with cuDNN's fused attention preflights as the job runs it (0.6): the
kernel in the compiled module, the batch sharded as given, its FLOPs the causal
kernel's, its peak what a raw compile on the target's devices says."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_targets import has_compiler, has_module, peak_of

import spmdtree as st

# Private: the GPU toolchain and its target have no public names
from spmdtree._src.step.compile.backends import XLA_GPU, target_for

B, T, H, D = 16, 1024, 8, 128  # 16 sequences of 1,024 over 8 GPUs, 8 heads of 128

pytestmark = pytest.mark.skipif(not has_compiler("cuda"), reason="needs XLA GPU (spmdtree[cuda])")


def has_cudnn():
    return has_module("nvidia.cudnn")


def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jnp.sum(out.astype(jnp.float32))


def step(q, k, v):
    """The attention's gradients: its forward and backward kernels."""
    return jax.grad(loss, argnums=(0, 1, 2))(q.value, k.value, v.value)


def sequences(kind=AxisType.Explicit):
    mesh = jax.sharding.AbstractMesh((8,), ("data",), axis_types=(kind,))
    box = st.Partitioned(
        jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16), ("data", None, None, None)
    )
    return mesh, (box, box, box)


def raw_peak():
    """The same step compiled by XLA GPU on an 8-GPU topology mesh in this process,
    as a job with cuDNN's kernel lowers it: arguments + outputs - aliased + temps."""
    from jax.experimental import topologies

    config = target_for(st.hardware("h100")).chip.target_config()
    devices = topologies.get_topology_desc(
        platform="cuda", target_config=config, topology="1x1x8"
    ).devices
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,), devices=devices)
    spec = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        lowered = grads.lower(spec, spec, spec)
    return peak_of(lowered.compile(XLA_GPU.own_options(deviceless=True)))


@pytest.mark.skipif(not has_cudnn(), reason="needs cuDNN's library (spmdtree[cuda])")
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_cudnn_attention_preflights_for_a_gpu_with_its_kernel(kind):
    mesh, args = sequences(kind)
    plan = st.preflight(step, *args, mesh=mesh, target="h100")
    kernels = [k for k in plan.schedule.kernels() if k.kind == "attention"]
    assert len(kernels) == 2  # cuDNN's forward and backward, no gather: batch-sharded
    assert plan.collectives == ()
    assert plan.peak_bytes == pytest.approx(raw_peak(), rel=0.02)
    # the causal kernel's FLOPs: two matmuls forward, five backward (the scores
    # recomputed, dV, dP, dQ, dK), each 2 x b x h x t x t x d per device, halved
    one = 2 * (B // 8) * H * T * T * D // 2
    assert plan.flops == 7 * one
    # the version jax asked of cuDNN was answered: its kernels, not a fallback
    calls = {k.call for k in plan.schedule.kernels()} - {""}
    assert calls == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    # what a compile without a GPU leaves out is said
    (said,) = [f for f in plan.flags if "cuDNN's workspace" in f]
    assert "__cudnn$fmhaSoftmaxBackward" in said


def test_the_cpu_estimate_says_it_cannot_compile_cudnn_attention():
    if not has_cudnn():
        pytest.skip("without cuDNN's library the step does not trace at all (next test)")
    mesh, args = sequences()
    with pytest.raises(
        ValueError,
        match=r"^preflight: .*(need devices to lower|not found for platform cpu).*GPU target=",
    ):
        st.preflight(step, *args, mesh=mesh)


@pytest.mark.skipif(has_cudnn(), reason="cuDNN's library is installed")
def test_without_cudnns_library_the_package_to_add_is_named():
    mesh, args = sequences()
    with pytest.raises(ValueError, match=r"nvidia-cudnn-cu12"):
        st.preflight(step, *args, mesh=mesh, target="h100")


def attention_step(candidate):
    """advise's make_step: the attention's gradients on the candidate's batch."""
    box = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, T, H, D), jnp.bfloat16),
        ("batch", None, "heads", None),
    )
    return step, (box, box, box), {}


@pytest.mark.skipif(not has_cudnn(), reason="needs cuDNN's library (spmdtree[cuda])")
def test_advise_ranks_cudnn_attention_steps_each_compiled_as_its_own():
    mesh = jax.sharding.AbstractMesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rules = [("batch", "data"), ("heads", None)]
    asked = [st.Candidate(mesh, rules, batch=b) for b in (8, 16)]
    advice = st.advise(attention_step, asked, hardware=st.hardware("h100"), progress=False)
    peaks = {row.candidate.batch: row.step.peak_bytes for row in advice.rows}
    for batch, peak in peaks.items():  # each its own compile, as preflight gives it
        direct = st.preflight(
            step,
            *attention_step(st.Candidate(mesh, rules, batch))[1],
            mesh=mesh,
            rules=rules,
            target="h100",
        )
        assert peak == direct.peak_bytes
    assert peaks[16] > peaks[8]
    assert all(row.step.backend == "gpu" for row in advice.rows)


SCRIPT = """
import jax, jax.numpy as jnp
import spmdtree as st
jax.devices()  # jax starts its backends: without CUDA's libraries, its GPU plugin refuses
mesh = jax.sharding.AbstractMesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
spec = jax.ShapeDtypeStruct(({B}, {T}, {H}, {D}), jnp.bfloat16,
    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jnp.sum(out.astype(jnp.float32))
plan = st.preflight(jax.grad(loss, argnums=(0, 1, 2)), spec, spec, spec, mesh=mesh, target="h100")
print(plan.peak_bytes, sorted({{k.call for k in plan.schedule.kernels()}} - {{""}}))
"""


@pytest.mark.skipif(not has_cudnn(), reason="needs cuDNN's library (spmdtree[cuda])")
@pytest.mark.parametrize("platforms", ["", "cpu"])
def test_a_process_whose_jax_refused_its_gpu_plugin_still_preflights(tmp_path, platforms):
    # A user's script on a machine without a GPU: jax's CUDA plugin refuses to start
    # ("Unable to load CUDA"), or is never started (JAX_PLATFORMS=cpu), and the step
    # is lowered on XLA GPU's topology anyway.
    skipped = ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "JAX_PLATFORMS")
    env = {k: v for k, v in os.environ.items() if k not in skipped}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(B=B, T=T, H=H, D=D))
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if not platforms:
        assert "Unable to load CUDA" in done.stderr  # jax did refuse it
    peak, calls = done.stdout.split(" ", 1)
    assert (
        int(peak)
        == st.preflight(step, *sequences()[1], mesh=sequences()[0], target="h100").peak_bytes
    )
    assert calls.strip() == "['__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward']"
    assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in done.stdout
