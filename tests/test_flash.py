"""Flash-attention kernels as the job runs them (0.6): their FLOPs at the share of
the peak published for their chip and direction; jax's own Pallas kernels, which
keep no cost estimate, counted from their shapes; splash attention for libtpu."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_targets import has_compiler

import spmdtree as st
from spmdtree._src.step.hlo.schedule import Kernel, Schedule
from spmdtree._src.step.hw.chips import CHIPS
from spmdtree._src.step.time import predict
from spmdtree._src.step.time.bound import step_time

GPUS = [name for name, chip in CHIPS.items() if isinstance(chip["chip"], st.GpuChip)]
FORWARD = ["__cudnn$fmhaSoftmax", "mha_forward", "splash_mha_fwd_residuals"]
BACKWARD = ["__cudnn$fmhaSoftmaxBackward", "mha_backward", "splash_mha_dkv_no_residuals"]


def compute_bound(call, flops=10**13):
    """A kernel whose bytes take a microsecond: its time is its FLOPs' alone."""
    return Kernel("attention", flops, 10**6, dtype="bf16", call=call)


@pytest.mark.parametrize("name", GPUS)
@pytest.mark.parametrize("call", FORWARD + BACKWARD)
def test_a_flash_kernel_runs_at_its_chips_published_share_for_its_direction(name, call):
    figures = CHIPS[name]
    direction = "backward" if call in BACKWARD else "forward"
    share = figures[f"flash_{direction}_efficiency"]
    kernel = compute_bound(call)
    hw = st.hardware(name)
    seconds = predict.kernel_seconds(kernel, hw.costs(), hw.flops_per_second)
    compute = kernel.flops / (figures["flops_per_second"] * share)
    memory = kernel.bytes / (figures["hbm_bytes_per_second"] * figures["memory_efficiency"])
    assert seconds == pytest.approx(compute + 0.05 * memory)
    # not the matmul share, and no wave quantization of a shape it does not have
    assert share != figures["matmul_efficiency"]


def test_a_users_own_flash_share_is_what_times_it():
    hw = st.hardware("h100")
    kernel = compute_bound("__cudnn$fmhaSoftmax")
    base = predict.kernel_seconds(kernel, hw.costs(), hw.flops_per_second)
    halved = dataclasses.replace(hw, flash_forward_efficiency=hw.flash_forward_efficiency / 2)
    slower = predict.kernel_seconds(kernel, halved.costs(), hw.flops_per_second)
    memory = kernel.bytes / (hw.hbm_bytes_per_second * hw.memory_efficiency) * 0.05
    assert slower - memory == pytest.approx(2 * (base - memory))
    with pytest.raises(ValueError, match=r"flash_backward_efficiency is 1.5; expected a share"):
        dataclasses.replace(hw, flash_backward_efficiency=1.5)


def flash_schedule(*calls):
    return Schedule(tuple(compute_bound(call) for call in calls), "tpu")


def defaults_said(hw, schedule):
    time = step_time([], 1e12, {"data": 8}, hw, schedule=schedule)
    return [flag for flag in time.flags if "leaves out" in flag]


def test_a_flash_share_left_out_is_said_only_where_the_step_runs_a_flash_kernel():
    tpu = st.hardware("tpu-v5e")  # no share is published for a TPU
    assert tpu.left_out == ("flash_forward_efficiency", "flash_backward_efficiency")
    assert defaults_said(tpu, Schedule((Kernel("matmul", 10**12, 10**6),), "tpu")) == []
    (said,) = defaults_said(tpu, flash_schedule("splash_mha_fwd_residuals"))
    assert "flash_forward_efficiency, flash_backward_efficiency" in said
    # a GPU preset gives both: nothing said
    assert defaults_said(st.hardware("h100"), flash_schedule("__cudnn$fmhaSoftmax")) == []


# --- jax's own Pallas kernels, compiled ---------------------------------------------

B, T, H, D = 8, 1024, 8, 128  # 8 sequences of 1,024 over 8 devices, 8 heads of 128


def explicit_mesh():
    return jax.sharding.AbstractMesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def gradients(attention, layout):
    """The attention's gradients, each device running the kernel on its sequences
    (a Pallas kernel runs per device: under shard_map, as a job writes it)."""

    def loss(q, k, v):
        out = jax.shard_map(
            attention, in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=False
        )(q, k, v)
        return jnp.sum(out.astype(jnp.float32))

    def step(q, k, v):
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    mesh = explicit_mesh()
    spec = jax.ShapeDtypeStruct(layout, jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    return step, (spec, spec, spec), mesh


def scores(per_device_batch):
    """2 x batch x heads x queries x keys x head width: one dot over every pair."""
    return 2 * per_device_batch * H * T * T * D


@pytest.mark.skipif(not has_compiler("cuda"), reason="needs XLA GPU (spmdtree[cuda])")
@pytest.mark.parametrize("causal", [False, True])
def test_jax_pallas_gpu_attention_counts_its_flops_from_its_shapes(causal):
    from jax.experimental.pallas.ops.gpu import attention

    mha = functools.partial(attention.mha, segment_ids=None, causal=causal)
    step, args, mesh = gradients(mha, (B, T, H, D))
    plan = st.preflight(step, *args, mesh=mesh, target="h100")
    # forward: the scores and their product with V; backward (jax's kernel): the
    # scores, dV, dP and dK over the key blocks, then the scores, dP and dQ again
    assert plan.flops == (2 + 7) * scores(B // 8) // (2 if causal else 1)
    by_call = {k.call: k for k in plan.schedule.kernels() if k.call}
    assert by_call["mha_forward"].flash == "forward"
    assert by_call["mha_backward"].flash == "backward"
    assert by_call["mha_preprocess_backward"].flops == 0  # dO x O's rows: no dots
    assert not [f for f in plan.flags if "no cost estimate" in f or "workspace" in f]
    time = plan.time(st.hardware("h100"))
    assert time.predicted_by_class["attention"] > 0


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
def test_splash_attention_preflights_for_libtpu_forward_and_backward_counted():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(H)])
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
    step, args, mesh = gradients(jax.vmap(kernel), (B, H, T, D))
    plan = st.preflight(step, *args, mesh=mesh, target="tpu-v5e")
    calls = sorted(k.call for k in plan.schedule.kernels() if k.flash)
    assert [c.split("_")[2] for c in calls] == ["dkv", "dq", "fwd"]
    # forward 2 dots, dQ's kernel 3, dK and dV's 4, each over every block: the
    # module does not print the mask, and the flag says so
    assert plan.flops == (2 + 3 + 4) * scores(B // 8)
    (dense,) = [f for f in plan.flags if "as if its mask kept every block" in f]
    assert "splash_mha_fwd" in dense
    assert not [f for f in plan.flags if "no cost estimate" in f]


def test_a_pallas_kernel_on_a_sharded_array_is_told_to_run_per_device():
    from jax.experimental.pallas.ops.gpu import attention

    mesh = explicit_mesh()
    spec = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"can only be sliced along unsharded axes") as info:
        st.preflight(
            functools.partial(attention.mha, segment_ids=None), spec, spec, spec, mesh=mesh
        )
    assert str(info.value).endswith(
        "(a Pallas kernel runs per device: call it under jax.shard_map, as a job does)"
    )


@pytest.mark.parametrize(
    "op_name, name",
    [
        ("jit(step)/jvp(jit(mha))/mha_forward/pallas_call", "mha_forward"),
        ("jit(f)/transpose(jvp(mha_backward))/pallas_call", "mha_backward"),
        ("jit(train_step)/pallas_call", "pallas_call"),  # no name=: the caller's scope
        ("jit(f)/while/body/pallas_call", "pallas_call"),
        ("jit(f)/jit(mha_forward_of_mine)/pallas_call", "pallas_call"),
    ],
)
def test_a_triton_kernel_is_named_by_its_own_scope_only_where_jax_gave_it_one(op_name, name):
    from spmdtree._src.step.hlo.instructions import Instr, Op
    from spmdtree._src.step.hlo.opcodes import kernel_name

    call = Instr("pallas_call.7", Op.kCustomCall, (), False, (), False, (),
                 target="__gpu$xla.gpu.triton", op_name=op_name)  # fmt: skip
    assert kernel_name(call) == name
