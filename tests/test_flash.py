"""Flash-attention kernels as the job runs them (0.6): their FLOPs at the share of
the peak published for their chip and direction; jax's own Pallas kernels, which
keep no cost estimate, counted from their shapes; splash attention for libtpu,
over the blocks its mask keeps, and jax's Pallas TPU flash attention over the
causal triangle (0.7: read from the traced step)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_targets import has_compiler

import spmdtree as st

# Private: the schedule's records, the reader and the model have no public names
from spmdtree._src.step.hlo.opcodes import Kept
from spmdtree._src.step.hlo.reading import reading_of
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
    assert tpu.left_out[:2] == ("flash_forward_efficiency", "flash_backward_efficiency")
    assert defaults_said(tpu, Schedule((Kernel("matmul", 10**12, 10**6),), "tpu")) == []
    (said,) = defaults_said(tpu, flash_schedule("splash_mha_fwd_residuals"))
    assert "leaves out flash_forward_efficiency, flash_backward_efficiency:" in said
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
    attention = pytest.importorskip(
        "jax.experimental.pallas.ops.gpu.attention", reason="jax 0.12.1 dropped it"
    )

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


def splash(make_mask):
    """Splash attention over `H` heads of one mask, as a job builds it."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([make_mask(sm) for _ in range(H)])
    return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1), mask


def kept_blocks(mask, block):
    """The oracle, from the mask itself: its query-key blocks of `block` x `block`
    with any element kept, over its heads."""
    dense = np.asarray(mask[:, :, :])
    heads, queries, keys = dense.shape
    blocks = dense.reshape(heads, queries // block, block, keys // block, block)
    return int(blocks.any(axis=(2, 4)).sum())


MASKS = {
    "causal": lambda sm: sm.CausalMask((T, T)),
    "full": lambda sm: sm.FullMask((T, T)),
    # a window of 256 keys: each row of blocks keeps 3 at most, stored shrunk to them
    "local": lambda sm: sm.LocalMask((T, T), (256, 0), 0),
}


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
@pytest.mark.parametrize("masked", list(MASKS))
def test_splash_attention_is_counted_over_the_blocks_its_mask_keeps(masked):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    kernel, mask = splash(MASKS[masked])
    step, args, mesh = gradients(jax.vmap(kernel), (B, H, T, D))
    plan = st.preflight(step, *args, mesh=mesh, target="tpu-v5e")
    block = sk.BlockSizes.get_default().block_q  # 128: every kernel's blocks, both ways
    kept = kept_blocks(mask, block)
    per_block = 2 * (B // 8) * block * block * D  # one dot over one block pair of a head
    # forward 2 dots, dQ's kernel 3, dK and dV's 4, each over the blocks the mask keeps
    by_call = {k.call.split("_")[2]: k.flops for k in plan.schedule.kernels() if k.flash}
    assert by_call == {
        "fwd": 2 * kept * per_block,
        "dq": 3 * kept * per_block,
        "dkv": 4 * kept * per_block,
    }
    assert plan.flops == (2 + 3 + 4) * kept * per_block
    assert not [f for f in plan.flags if "as if its mask kept every block" in f]
    assert not [f for f in plan.flags if "no cost estimate" in f]
    if masked == "causal":  # the triangle and the diagonal's blocks whole: about half
        assert kept == H * (8 * 9 // 2) and plan.flops == (2 + 3 + 4) * scores(B // 8) * 36 // 64
    if masked == "full":  # every block: the dense count, as 0.6 counted every mask
        assert plan.flops == (2 + 3 + 4) * scores(B // 8)
    if masked == "local":
        assert kept == H * (1 + 2 + 6 * 3)


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
def test_kernels_of_one_name_built_with_different_masks_are_said_counted_over_every_block():
    causal, _ = splash(MASKS["causal"])
    full, _ = splash(MASKS["full"])

    def both(q, k, v):  # a causal layer and a full one: the same kernels, two masks
        return jax.vmap(causal)(q, k, v) + jax.vmap(full)(q, k, v)

    step, args, mesh = gradients(both, (B, H, T, D))
    plan = st.preflight(step, *args, mesh=mesh, target="tpu-v5e")
    assert plan.flops == 2 * (2 + 3 + 4) * scores(B // 8)
    (dense,) = [f for f in plan.flags if "as if its mask kept every block" in f]
    assert "the traced step builds 2 different masks" in dense
    assert all(name in dense for name in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"))


def test_a_mask_the_step_is_given_is_not_read_and_the_reason_is_kept():
    # the kernel passed in whole: its block mask an input of the jaxpr, no constant
    # Private: the masks read from a traced step, a helper with no public name
    from spmdtree._src.step.compile.tracing import kernel_masks

    kernel, _ = splash(MASKS["causal"])
    x = jax.ShapeDtypeStruct((H, T, D), jnp.bfloat16)
    given = kernel_masks(jax.make_jaxpr(lambda kern, q: kern(q, q, q))(kernel, x))
    closed = kernel_masks(jax.make_jaxpr(lambda q: kernel(q, q, q))(x))
    assert given == {
        "splash_mha_fwd_no_residuals": Kept(
            why="its block mask is computed in the step, not a constant of it"
        )
    }
    # one mask for every head (head_shards=1): 36 of its 8 x 8 blocks
    assert closed == {"splash_mha_fwd_no_residuals": Kept(36, 64)}


def test_a_flash_kernel_whose_mask_is_not_read_is_counted_whole_and_said_with_why():
    kernel = Kernel("attention", 6400, 64, call="splash_mha_fwd_residuals")
    schedule = Schedule((kernel,), "tpu")
    unread = {
        "splash_mha_fwd_residuals": Kept(
            why="its block mask is computed in the step, not a constant of it"
        )
    }
    for masks, why in [
        (None, "the compiled module does not print the constants"),
        ({}, "no call of that name was found in the traced step"),
        (unread, "its block mask is computed in the step"),
    ]:
        read = reading_of(schedule.masked(masks or {}), masks)
        (dense,) = [f for f in read.flags if "as if its mask kept every block" in f]
        assert why in dense and read.flops == 6400
    read = reading_of(
        schedule.masked({"splash_mha_fwd_residuals": Kept(36, 64)}),
        {"splash_mha_fwd_residuals": Kept(36, 64)},
    )
    assert read.flops == 3600 and read.flags == ()


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
@pytest.mark.parametrize("causal", [False, True])
def test_jax_pallas_tpu_flash_attention_counts_the_causal_triangle(causal):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    attention = functools.partial(fa.flash_attention, causal=causal)
    step, args, mesh = gradients(attention, (B, H, T, D))
    plan = st.preflight(step, *args, mesh=mesh, target="tpu-v5e")
    rows = T // fa.BlockSizes.get_default(B // 8, H, T, T, D).block_q  # 8 blocks of 128
    # causal: the triangle, the blocks on the diagonal whole (a block runs where its
    # bottom-left corner is on or below the diagonal); else every block
    kept, blocks = (rows * (rows + 1) // 2 if causal else rows * rows), rows * rows
    by_call = {
        re.match(r"flash_(attention|mha_bwd_dkv|mha_bwd_dq)", k.call)[1]: k
        for k in plan.schedule.kernels()
        if k.flash
    }
    assert {call: k.flash for call, k in by_call.items()} == {
        "attention": "forward",
        "mha_bwd_dkv": "backward",
        "mha_bwd_dq": "backward",
    }
    # the backward keeps no cost estimate: dK and dV's kernel 4 dots, dQ's 3 (0.6: none)
    assert by_call["mha_bwd_dkv"].flops == 4 * scores(B // 8) * kept // blocks
    assert by_call["mha_bwd_dq"].flops == 3 * scores(B // 8) * kept // blocks
    # the forward's own estimate (the scores, their product with V, the softmax's
    # elementwise FLOPs: over every block) counted over the kept blocks
    assert by_call["attention"].flops == pytest.approx(2 * scores(B // 8) * kept / blocks, rel=0.02)
    assert not [f for f in plan.flags if "no cost estimate" in f or "every block" in f]


def doubled(x):
    """A Pallas kernel of one's own: each block of 8 rows times two."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    block = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        kernel, out_shape=shape, grid=(x.shape[0] // 8,), in_specs=[block], out_specs=block
    )(x)


def test_a_pallas_kernel_on_a_sharded_array_is_told_to_run_per_device():
    mesh = explicit_mesh()
    sharded = NamedSharding(mesh, P("data"))
    with pytest.raises(ValueError, match=r"pallas_call requires all mesh axes to be Manual") as own:
        st.preflight(
            doubled, jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sharded), mesh=mesh
        )
    fix = "(a Pallas kernel runs per device: call it under jax.shard_map, as a job does)"
    assert str(own.value).endswith(fix)
    try:  # jax's own GPU kernel, where this jax still has it (0.12.1 dropped the module)
        from jax.experimental.pallas.ops.gpu import attention
    except ImportError:
        return
    spec = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=sharded)
    with pytest.raises(ValueError, match=r"can only be sliced along unsharded axes") as info:
        st.preflight(
            functools.partial(attention.mha, segment_ids=None), spec, spec, spec, mesh=mesh
        )
    assert str(info.value).endswith(fix)


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
    # Private: an instruction record and the kernel-name helper have no public names
    from spmdtree._src.step.hlo.instructions import Instr, Op
    from spmdtree._src.step.hlo.opcodes import kernel_name

    call = Instr("pallas_call.7", Op.kCustomCall, (), False, (), False, (),
                 target="__gpu$xla.gpu.triton", op_name=op_name)  # fmt: skip
    assert kernel_name(call) == name


@pytest.mark.parametrize(
    "called, op_name, name",
    [
        # jax's Pallas TPU flash attention's forward is named for where it is called
        (
            "jvp_jit_flash_attention__.1",
            "jit(loss)/jvp(jit(flash_attention))/pallas_call",
            "flash_attention",
        ),
        ("flash_attention.1", "jit(step)/shard_map/flash_attention/pallas_call", "flash_attention"),
        (
            "splash_mha_fwd_residuals.3",
            "jit(f)/splash_mha_fwd_residuals/pallas_call",
            "splash_mha_fwd_residuals",
        ),
        ("my_kernel.2", "jit(f)/jvp(jit(flash_attention_of_mine))/pallas_call", "my_kernel"),
    ],
)
def test_a_mosaic_kernel_is_named_by_its_call_or_else_by_a_flash_kernels_scope(
    called, op_name, name
):
    # Private: an instruction record and the kernel-name helper have no public names
    from spmdtree._src.step.hlo.instructions import Instr, Op
    from spmdtree._src.step.hlo.opcodes import kernel_name

    call = Instr(
        called, Op.kCustomCall, (), False, (), False, (), target="tpu_custom_call", op_name=op_name
    )
    assert kernel_name(call) == name
