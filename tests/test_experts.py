"""Experts, planned (new in 0.8): a grouped matmul counted at its groups' FLOPs and
timed at the chip's share, the ragged all-to-all read over its axis, and expert
weights gathered instead of tokens moved, said.

The libtpu tests compile without a TPU (spmdtree[tpu]); the rest run on the CPU.
"""

import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from test_targets import has_compiler

import spmdtree as st

# Private: the per-kernel model and the flag's rule have no public names
from spmdtree._src.step.hlo.schedule import Kernel, read_schedule
from spmdtree._src.step.hw import Costs
from spmdtree._src.step.preflight.diagnose import experts_gathered
from spmdtree._src.step.time.predict import kernel_seconds

LIBTPU = pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
AUTO = AxisType.Auto

#: An expert layer: experts, width, hidden width, tokens (even groups), top-k.
EXPERTS, WIDTH, HIDDEN, TOKENS, TOP = 8, 256, 512, 2048, 2


def grouped_step(w, x, sizes):
    """A ragged dot's forward and its weights' gradient."""
    square = lambda w: jnp.sum(jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.grad(square)(w)


def grouped_args(dtype=jnp.float32):
    return (
        jax.ShapeDtypeStruct((EXPERTS, WIDTH, HIDDEN), dtype),
        jax.ShapeDtypeStruct((TOKENS, WIDTH), dtype),
        jax.ShapeDtypeStruct((EXPERTS,), jnp.int32),
    )


@pytest.mark.parametrize(
    "target", [None, pytest.param("tpu-v5e", marks=LIBTPU)], ids=["cpu", "libtpu"]
)
def test_a_grouped_matmul_counts_the_flops_of_its_groups_never_dense_over_every_expert(target):
    # 0.7 counted the weights' gradient (jax writes it dense over a new group dimension,
    # each operand masked to its group's rows) at every expert's FLOPs: 8x its work
    mesh = AbstractMesh((1,), ("data",), axis_types=(AUTO,))
    extra = {"target": target} if target else {}
    step = st.preflight(grouped_step, *grouped_args(), mesh=mesh, **extra)
    one_pass = 2 * TOKENS * WIDTH * HIDDEN  # every token through its one expert
    grouped = [k for k in step.schedule.kernels() if k.grouped]
    if target:  # libtpu's own ragged-dot kernel forward, the weights' gradient grouped
        assert step.flops == 2 * one_pass
        assert sum(k.flops for k in grouped) == 2 * one_pass
    else:  # XLA CPU runs the forward dense over every group (one operand masked)
        assert step.flops == EXPERTS * one_pass + one_pass
        assert sum(k.flops for k in grouped) == one_pass


def test_ordinary_masked_matmuls_are_no_grouped_ones():
    # a causal sum by a lower-triangular matmul (a masked scalar broadcast), and a
    # masked broadcast on one side alone: each counted dense, as it runs
    mesh = AbstractMesh((1,), ("data",), axis_types=(AUTO,))
    s, b, d = 128, 4, 64

    def tril(x):
        return jnp.sum(jnp.einsum("st,btd->bsd", jnp.tril(jnp.ones((s, s))), x) ** 2)

    def padded(mask, w):
        rows = jnp.arange(s * d, dtype=jnp.float32).reshape(s, d)
        x = jnp.where(mask[..., None], jnp.broadcast_to(rows[None], (b, s, d)), 0.0)
        return jnp.sum(x @ w)

    causal = st.preflight(jax.grad(tril), jax.ShapeDtypeStruct((b, s, d), "float32"), mesh=mesh)
    assert causal.flops == 2 * 2 * b * s * s * d  # the forward and its transpose
    one_side = st.preflight(
        jax.grad(padded, 1),
        jax.ShapeDtypeStruct((b, s), "bool"),
        jax.ShapeDtypeStruct((d, d), "float32"),
        mesh=mesh,
    )
    assert one_side.flops == 2 * b * s * d * d
    for step in (causal, one_side):
        assert not any(k.grouped for k in step.schedule.kernels())


def test_a_dense_batched_matmul_is_no_grouped_one():
    mesh = AbstractMesh((1,), ("data",), axis_types=(AUTO,))
    w = jax.ShapeDtypeStruct((EXPERTS, WIDTH, HIDDEN), jnp.float32)
    x = jax.ShapeDtypeStruct((EXPERTS, TOKENS // EXPERTS, WIDTH), jnp.float32)
    step = st.preflight(lambda w, x: jnp.einsum("etd,edf->etf", x, w), w, x, mesh=mesh)
    assert step.flops == 2 * TOKENS * WIDTH * HIDDEN
    assert not any(k.grouped for k in step.schedule.kernels())


def test_a_grouped_kernel_runs_at_the_chips_grouped_share():
    costs = Costs(1.0, 1.0, 0.8, 1, (1, 1), 0.0, 0.0, grouped_efficiency=0.25)
    dense = Kernel("matmul", 1000, 0)
    grouped = dense._replace(grouped=True)
    assert kernel_seconds(dense, costs, 1.0) == pytest.approx(1000 / 0.8)
    assert kernel_seconds(grouped, costs, 1.0) == pytest.approx(1000 / 0.25)


@pytest.mark.parametrize(
    "target", [None, pytest.param("tpu-v5e", marks=LIBTPU)], ids=["cpu", "libtpu"]
)
def test_a_gather_and_a_scatter_are_timed_by_what_they_move(target):
    # 0.7 priced a TPU's expert dispatch and combine at 0 (their rows kept on the chip)
    rows, width = 4096, 256
    mesh = AbstractMesh((1,), ("data",), axis_types=(AUTO,))
    extra = {"target": target} if target else {}

    def dispatch_and_combine(x, order):
        return jnp.zeros_like(x).at[order].add(x[order] * 2)

    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    order = jax.ShapeDtypeStruct((rows,), jnp.int32)
    step = st.preflight(dispatch_and_combine, x, order, mesh=mesh, **extra)
    indexed = [k for k in step.schedule.kernels() if k.indexed]
    block = rows * width * 4
    # the gather reads and writes its rows, the scatter-add reads its updates and the
    # rows they land on and writes them
    assert sum(k.indexed for k in indexed) == 2 * block + 3 * block
    assert all(k.bytes >= k.indexed for k in indexed)
    # what they move by index at the indexed share, the rest at the memory share
    costs = Costs(1.0, 1.0, 1.0, 1, (1, 1), 0.0, 0.0, indexed_efficiency=0.1)
    for k in indexed:
        assert kernel_seconds(k, costs, 1.0) == pytest.approx(
            (k.bytes - k.indexed) + k.indexed / 0.1
        )


def test_a_scatter_that_sets_moves_its_rows_twice_one_that_adds_three_times():
    mesh = AbstractMesh((1,), ("data",), axis_types=(AUTO,))
    rows = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    order = jax.ShapeDtypeStruct((1024,), jnp.int32)

    def moved(step):
        plan = st.preflight(step, rows, rows, order, mesh=mesh)
        return sum(k.indexed for k in plan.schedule.kernels())

    block = 1024 * 128 * 4
    assert moved(lambda x, u, i: x.at[i].set(u)) == 2 * block
    assert moved(lambda x, u, i: x.at[i].add(u)) == 3 * block


def test_rows_moved_by_index_on_a_chip_that_leaves_out_their_share_run_at_its_memory_share():
    v5e = st.hardware("tpu-v5e")
    assert v5e.indexed_efficiency is None
    assert v5e.costs().indexed_efficiency == v5e.costs().memory_efficiency


def test_a_prediction_with_a_grouped_kernel_says_the_share_it_took_by_default():
    mesh = AbstractMesh((1,), ("data",), axis_types=(AUTO,))
    step = st.preflight(grouped_step, *grouped_args(), mesh=mesh)
    v5e = st.hardware("tpu-v5e")
    assert "grouped_efficiency" in v5e.left_out
    said = step.time(v5e).flags
    assert any("grouped_efficiency" in flag for flag in said), said
    slower = step.time(dataclasses.replace(v5e, grouped_efficiency=0.1)).predicted_seconds
    assert slower > step.time(dataclasses.replace(v5e, grouped_efficiency=0.9)).predicted_seconds
    # a step with no grouped kernel is not told of it
    dense = st.preflight(lambda a: a @ a, jax.ShapeDtypeStruct((256, 256), "float32"), mesh=mesh)
    assert not any("grouped_efficiency" in flag for flag in dense.time(v5e).flags)


def test_calibrate_measures_the_grouped_and_indexed_shares_and_a_file_before_reads_back(
    cpu_calibration,
):
    calibrated = cpu_calibration
    for name in ("grouped_efficiency", "indexed_efficiency"):
        assert 0 < getattr(calibrated, name) <= 1
        assert calibrated.provenance[name].startswith("measured")
    # a Hardware JSON written by 0.7 has neither: it reads back with them left out
    data = json.loads(st.hardware("tpu-v5e").to_json())
    del data["grouped_efficiency"], data["indexed_efficiency"]
    assert st.Hardware.from_json(json.dumps(data)) == st.hardware("tpu-v5e")
    chip = pathlib.Path(__file__).parents[1] / "benchmarks" / "chip-2026-12-06" / "chip.json"
    left = st.Hardware.from_json(chip).left_out
    assert "grouped_efficiency" in left and "indexed_efficiency" in left


@LIBTPU
def test_a_ragged_all_to_all_is_read_over_its_axis_at_its_buffers_size():
    mesh = AbstractMesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO))
    rows, width = 16, 128

    def local(a):
        start = jnp.arange(4, dtype=jnp.int32) * (rows // 4)
        size = jnp.full((4,), rows // 4, jnp.int32)
        out = jnp.zeros_like(a)
        return jax.lax.ragged_all_to_all(a, out, start, size, start, size, axis_name="expert")

    def step(a):
        return jax.shard_map(local, in_specs=P("expert", None), out_specs=P("expert", None))(a)

    x = jax.ShapeDtypeStruct((4 * rows, width), jnp.float32)
    plan = st.preflight(step, x, mesh=mesh, target="tpu-v5e")
    (row,) = plan.collectives
    assert (row.kind, row.axes, row.group, row.count) == ("ragged-all-to-all", ("expert",), 4, 1)
    assert row.bytes == rows * width * 4  # its output buffer, one device's
    assert row.wire_bytes == pytest.approx(3 / 4 * row.bytes)


# --- expert weights gathered instead of tokens moved -----------------------------------

RULES = [("expert", "expert"), ("embed", None), ("mlp", None)]


def moe_params(dtype=jnp.bfloat16):
    box = lambda shape, names: st.LogicallyPartitioned(  # noqa: E731
        jax.ShapeDtypeStruct(shape, dtype), names
    )
    return {
        "router": box((WIDTH, EXPERTS), ("embed", None)),
        "wi": box((EXPERTS, WIDTH, HIDDEN), ("expert", "embed", "mlp")),
        "wo": box((EXPERTS, HIDDEN, WIDTH), ("expert", "mlp", "embed")),
    }


def routed(params, x):
    """A mixture of experts the compiler partitions alone: tokens sorted by their
    top-k experts, `jax.lax.ragged_dot` over them, and combined back."""
    tokens = x.reshape(-1, WIDTH)
    top, chosen = jax.lax.top_k(
        jax.nn.softmax((tokens @ params["router"]).astype(jnp.float32)), TOP
    )
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat)
    sorted_tokens = jnp.repeat(tokens, TOP, axis=0)[order]
    sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    hidden = jax.nn.relu(jax.lax.ragged_dot(sorted_tokens, params["wi"], sizes))
    out = jax.lax.ragged_dot(hidden, params["wo"], sizes)
    back = jnp.zeros_like(out).at[order].set(out).reshape(-1, TOP, WIDTH)
    return (back * top[..., None].astype(back.dtype)).sum(1).reshape(x.shape)


def routed_step(params, x):
    params, x = st.unbox(params), st.unbox(x)
    loss = lambda p: jnp.mean(routed(p, x).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.grad(loss)(params)


def tokens_batch():
    return st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((16, TOKENS // 16, WIDTH), jnp.bfloat16), ("batch", None, "embed")
    )


@LIBTPU
@pytest.mark.parametrize("batch", [("data", "expert"), "data"], ids=["batch-on-expert", "data"])
def test_expert_weights_the_compiler_gathers_over_the_expert_axis_are_said(batch):
    mesh = AbstractMesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO))
    rules = [("batch", batch), *RULES]
    step = st.preflight(
        routed_step, moe_params(), tokens_batch(), mesh=mesh, rules=rules, target="tpu-v5e"
    )
    gathers = [c for c in step.collectives if c.kind == "all-gather" and "expert" in c.axes]
    assert gathers, step.collectives
    (said,) = [f for f in step.flags if "all-gathers the expert weights" in f]
    assert "over 'expert'" in said and "args[0]/wi" in said and "args[0]/wo" in said
    if batch == "data":  # nothing else is on the axis: the grouped matmul gathers them
        assert "shard_map" in said and "'batch'" not in said
    else:  # the usual cause, named with its rule
        assert "'batch' is also mapped onto 'expert'" in said


def test_the_flag_is_said_of_gathers_that_move_a_layers_expert_weight_and_no_fewer():
    mesh = AbstractMesh((2, 4), ("data", "expert"))
    rules = [("batch", ("data", "expert")), *RULES]
    inputs = st.plan({"params": moe_params(), "x": tokens_batch()}, mesh, rules=rules)
    whole = EXPERTS * WIDTH * HIDDEN * 2  # one expert weight, bf16, gathered whole
    gathered = st.Collective("all-gather", 1, whole, axes=("expert",), group=4)
    scattered = st.Collective("reduce-scatter", 1, whole // 4, axes=("expert",), group=4)
    said = experts_gathered([gathered, gathered, scattered], inputs)
    assert said is not None and "2 all-gathers of 2.0 MiB each" in said
    assert "and 1 reduce-scatter," in said and "params/wi" in said
    twice = experts_gathered([gathered, scattered._replace(count=2)], inputs)
    assert "and 2 reduce-scatters," in twice
    assert "'batch' is also mapped onto 'expert'" in said
    # gathers of another size than an expert weight's (activations, the routing's
    # indices), however many, are not
    for other in (whole // 2, whole * 2):
        assert experts_gathered([gathered._replace(bytes=other)] * 8, inputs) is None
    # nor gathers over another axis
    assert experts_gathered([gathered._replace(axes=("data",))], inputs) is None
    # but a weight gathered over its expert axis and another together is one
    both = gathered._replace(bytes=2 * whole, axes=("data", "expert"), group=8)
    assert experts_gathered([both], inputs) is not None
    # nor where the experts are not split (the expert axis of size 1)
    alone = st.plan({"params": moe_params()}, AbstractMesh((8, 1), ("data", "expert")), rules=rules)
    assert experts_gathered([gathered], alone) is None


# --- searched ---------------------------------------------------------------------------


def test_candidates_leave_out_expert_axes_that_do_not_divide_the_experts():
    meshes = st.layouts(8, ("expert", "data"))
    kept = st.candidates(meshes, None, 32, experts=2)
    assert sorted(dict(c.mesh.shape)["expert"] for c in kept) == [1, 2]
    assert len(st.candidates(meshes, None, 32)) == len(meshes)  # not checked without it
    with pytest.raises(ValueError, match=r"the expert axis 8 does not divide 3 experts"):
        st.candidates(st.layouts(8, ("expert",)), None, 32, experts=3)
    with pytest.raises(ValueError, match=r"experts is 0; expected an int >= 1"):
        st.candidates(meshes, None, 32, experts=0)


def test_candidates_leave_out_context_axes_that_do_not_divide_the_length():
    meshes = st.layouts(8, ("context", "data"))
    kept = st.candidates(meshes, None, 8, length=12)
    assert sorted(dict(c.mesh.shape)["context"] for c in kept) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"the context axis 8 does not divide the length 12"):
        st.candidates(st.layouts(8, ("context",)), None, 8, length=12)


# --- examples/moe.py, compiled for a TPU -----------------------------------------------


def moe_example():
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
    import moe

    return moe


@LIBTPU
def test_the_moe_examples_step_moves_tokens_by_all_to_all_and_is_not_flagged():
    moe = moe_example()
    cfg = moe.Config(experts=8, width=128, mlp=256, batch=16, length=64)
    params = jax.eval_shape(functools.partial(moe.init, cfg=cfg), jax.random.key(0))
    tokens = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((cfg.batch, cfg.length + 1), jnp.int32), ("batch", "length")
    )

    def step(params, tokens):
        loss = functools.partial(moe.loss_fn, cfg=cfg, sharded_experts=True)
        return jax.grad(loss)(params, st.unbox(tokens))

    mesh = AbstractMesh((4, 2), ("expert", "data"), axis_types=(AxisType.Explicit,) * 2)
    plan = st.preflight(step, params, tokens, mesh=mesh, rules=moe.make_rules(), target="tpu-v5e")
    kinds = {(str(c.kind), c.axes) for c in plan.collectives}
    assert ("all-to-all", ("expert",)) in kinds, kinds
    assert not any("all-gathers the expert weights" in flag for flag in plan.flags), plan.flags
    # the experts' weights stay split: no all-gather over expert moves a layer's experts
    whole = cfg.experts * cfg.width * cfg.mlp * 4
    gathered = [c for c in plan.collectives if c.kind == "all-gather" and "expert" in c.axes]
    assert all(c.bytes / c.count < whole for c in gathered), gathered
    grouped = [k for k in plan.schedule.kernels() if k.grouped]
    assert grouped  # the experts' matmuls, at their groups' FLOPs


def test_advise_ranks_examples_moe_over_expert_and_data_axes():
    # the search over an expert layer's layouts: expert axes the experts divide, each
    # row compiled, its all-to-alls over expert where the experts are split
    moe = moe_example()
    # (no activation of the sizes of an expert weight: those would be taken for one)
    cfg = moe.Config(experts=4, width=32, mlp=96, batch=16, length=16, layers=1)
    params = jax.eval_shape(functools.partial(moe.init, cfg=cfg), jax.random.key(0))

    def make_step(candidate):
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((candidate.batch, cfg.length + 1), jnp.int32),
            ("batch", "length"),
        )

        def step(params, tokens):
            loss = functools.partial(moe.loss_fn, cfg=cfg, sharded_experts=True)
            return jax.grad(loss)(params, st.unbox(tokens))

        return step, (params, tokens), {}

    meshes = st.layouts(8, ("expert", "data"), axis_types=AxisType.Explicit)
    found = st.candidates(meshes, moe.make_rules(), 16, experts=cfg.experts)
    assert sorted(dict(c.mesh.shape)["expert"] for c in found) == [1, 2, 4]  # not 8
    advice = st.advise(make_step, found, hardware=st.hardware("h100"), progress=False)
    assert len(advice.rows) == 3 and all(row.verdict == "fits" for row in advice.rows)
    for row in advice.rows:
        split = dict(row.candidate.mesh.shape)["expert"]
        moved = {c.kind for c in row.step.collectives if "expert" in c.axes}
        assert ("all-to-all" in moved) == (split > 1), (split, moved)
        said = [f for f in row.flags if "all-gathers the expert weights" in f]
        assert not said, (split, said, row.step.collectives)


#: A combine as libtpu fuses it (a v5e's MoE step): its updates transposed inside the
#: fusion into a layout whose minor-most dimension holds 2 of 128 lanes.
COMBINE = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

%combine (p0: f32[10240,1024], p1: s32[8184], p2: f32[8184,1024]) -> f32[10240,1024] {
  %p0 = f32[10240,1024]{1,0:T(8,128)} parameter(0)
  %p1 = s32[8184]{0:T(1024)} parameter(1)
  %i = s32[4,1023,2]{2,1,0:T(8,128)} reshape(%p1)
  %p2 = f32[8184,1024]{1,0:T(8,128)} parameter(2)
  %r = f32[4,1023,2,1024]{3,2,1,0:T(2,128)} reshape(%p2)
  %u = f32[4,1023,2,1024]{2,3,1,0:T(8,128)} transpose(%r), dimensions={0,1,2,3}
  ROOT %s = f32[10240,1024]{1,0:T(8,128)} scatter(%p0, %i, %u), update_window_dims={3}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=3, to_apply=%add
}

ENTRY %main (b: f32[10240,1024], i: s32[8184], u: f32[8184,1024]) -> f32[10240,1024] {
  %b = f32[10240,1024]{1,0:T(8,128)} parameter(0)
  %i = s32[8184]{0:T(1024)} parameter(1)
  %u = f32[8184,1024]{1,0:T(8,128)} parameter(2)
  ROOT %f = f32[10240,1024]{1,0:T(8,128)} fusion(%b, %i, %u), kind=kCustom, calls=%combine
}
"""


def test_a_scatters_rows_are_counted_at_their_own_bytes_not_its_updates_tiles():
    # the updates' tiles in that layout are 64 times their rows: 0.8.0 counted them so
    # and priced the combine at 14 ms, where a v5e ran it in 232 us
    (kernel,) = read_schedule(COMBINE, platform="tpu").events
    assert kernel.indexed == 3 * 8184 * 1024 * 4


def test_rows_moved_by_index_on_the_chip_move_at_its_own_memorys_rate():
    # a combine whose arrays libtpu keeps in the chip's own memory (S(1)) moves its rows
    # there, at that memory's rate where the chip has it (new in 0.8: a v5e's gathers
    # there ran at 2.3 TB/s, its copies there at 2.1, where 0.57 of HBM's 819 GB/s was
    # counted)
    module = COMBINE.replace("{1,0:T(8,128)}", "{1,0:T(8,128)S(1)}").replace(
        "{0:T(1024)}", "{0:T(1024)S(1)}"
    )
    (kernel,) = read_schedule(module, platform="tpu").events
    rows = 3 * 8184 * 1024 * 4
    assert kernel.rows_on_chip and kernel.hbm_waits == 0
    assert (kernel.indexed, kernel.bytes) == (rows, rows)
    # the larger of its rows and what it reads and writes there: the indices (a tile of
    # 1,024), the updates, and the rows they land on, read and written; the buffer it
    # adds into is updated in place, neither read nor written whole (new in 0.8)
    read = 8192 * 4 + 8184 * 1024 * 4
    assert kernel.on_chip == max(rows, read + 2 * 8184 * 1024 * 4)
    v5e = st.hardware("tpu-v5e")
    costs = dataclasses.replace(v5e.costs(), indexed_efficiency=0.5)
    # the chip's own memory left out (every preset): its rows at the indexed share of
    # HBM's bandwidth, as for any kernel
    at_hbm = rows / (costs.hbm_bytes_per_second * 0.5)
    assert kernel_seconds(kernel, costs, v5e.flops_per_second) == pytest.approx(at_hbm)
    # measured: what it moves there at that memory's rate, nothing at HBM's
    chip = dataclasses.replace(costs, on_chip_bytes_per_second=2e12)
    seconds = kernel_seconds(kernel, chip, v5e.flops_per_second)
    assert seconds == pytest.approx(kernel.on_chip / 2e12)
    # in HBM, as before: at the indexed share of its bandwidth, whatever that rate
    (kernel,) = read_schedule(COMBINE, platform="tpu").events
    assert (kernel.indexed, kernel.on_chip, kernel.rows_on_chip) == (rows, 0, False)
    assert kernel_seconds(kernel, chip, v5e.flops_per_second) == pytest.approx(
        kernel_seconds(kernel, costs, v5e.flops_per_second)
    )
