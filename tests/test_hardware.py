"""Hardware, its presets, and StepPlan.time: the roofline, checked by hand."""

import dataclasses
import functools
import math
import pickle

import jax
import jax.numpy as jnp
import pytest

import spmdtree as st

ICI, DCN = (1e9, 1e-6), (1e8, 1e-5)
HW = st.Hardware("test", 1000, 1e12, {"ici": ICI, "dcn": DCN}, devices_per_node=4)


@functools.cache
def _step():
    """One small compiled step, whose rows and mesh the tests replace."""
    mesh = jax.sharding.AbstractMesh((2,), ("data",))
    x = st.Partitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("data", None))
    return st.preflight(lambda x: jnp.sum(x.value), x, mesh=mesh)


def timed(rows, shape, flops=0, hw=HW, **kwargs):
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    step = dataclasses.replace(_step(), collectives=tuple(rows), flops=flops, mesh=mesh)
    return step.time(hw, **kwargs)


def test_each_field_by_hand():
    # 8 devices as data 2 x fsdp 4: nodes of 4, so fsdp stays on a node and data crosses.
    gather = st.Collective("all-gather", 2, 4000, axes=("fsdp",), group=4)
    scatter = st.Collective("reduce-scatter", 3, 600, axes=("data",), group=2)
    t = timed([gather, scatter], {"data": 2, "fsdp": 4}, flops=5e11)
    on_ici = 3 / 4 * 4000 / ICI[0] + 2 * ICI[1] * 3
    on_dcn = 1 * 600 / DCN[0] + 3 * DCN[1] * 1
    assert t.compute_seconds == pytest.approx(0.5)
    assert t.comm_by_axes[("fsdp",)] == pytest.approx(on_ici)
    assert t.comm_by_axes[("data",)] == pytest.approx(on_dcn)
    assert t.comm_seconds == pytest.approx(on_ici + on_dcn)
    assert t.bound_seconds == pytest.approx(max(0.5, on_ici + on_dcn))
    assert t.serial_seconds == pytest.approx(0.5 + on_ici + on_dcn)
    assert t.mfu(2.0) == pytest.approx(0.25)


def test_one_link_kind_is_wire_bytes_over_bandwidth_plus_latency_per_hop():
    shape = {"data": 2, "fsdp": 4}
    rows = [
        st.Collective("all-gather", 2, 4096, axes=("fsdp",), group=4),
        st.Collective("all-reduce", 1, 4096, axes=("fsdp",), group=4),
        st.Collective("reduce-scatter", 1, 1024, axes=("fsdp",), group=4),
        st.Collective("all-to-all", 1, 4096, axes=("fsdp",), group=4),
        st.Collective("collective-permute", 5, 512, axes=("fsdp",), group=2),
    ]
    for row in rows:
        t = timed([row], shape)
        hops = row.count * ICI[1] * (row.group - 1)
        assert t.comm_seconds == pytest.approx(row.wire_bytes / ICI[0] + hops), row.kind


def test_a_group_over_two_nodes_takes_the_slower_levels_time():
    # fsdp 8 on nodes of 4: each group is 4 devices on each of 2 nodes. Each kind
    # carries its hierarchical share; the collective takes the slower kind's time.
    shape = {"fsdp": 8}
    v = 8000

    def seconds(kind, size):
        return timed([st.Collective(kind, 1, size, axes=("fsdp",), group=8)], shape).comm_seconds

    def slower(on_ici, on_dcn):  # bytes per device on each kind
        return max(on_ici / ICI[0] + 3 * ICI[1], on_dcn / DCN[0] + 1 * DCN[1])

    gather = slower(3 / 4 * v, 1 / 2 * v / 4)  # 6.0e-6 + 3e-6 on ici, 1.0e-5 + 1e-5 on dcn
    assert seconds("all-gather", v) == pytest.approx(gather)
    assert gather == pytest.approx(1 / 2 * v / 4 / DCN[0] + DCN[1])  # here dcn is the slower
    # a reduce-scatter's volume is its input: result x group
    assert seconds("reduce-scatter", v) == pytest.approx(slower(3 / 4 * v * 8, 1 / 2 * v * 8 / 4))
    reduce = slower(2 * 3 / 4 * v, 2 * 1 / 2 * v / 4)
    assert seconds("all-reduce", v) == pytest.approx(reduce)
    # an all-to-all's data must cross: not divided by the faster kind's group
    assert seconds("all-to-all", v) == pytest.approx(slower(3 / 4 * v, 1 / 2 * v))
    # the whole ring on the slow link would be several times slower
    whole_ring = st.Collective("all-gather", 1, v, axes=("fsdp",), group=8).wire_bytes / DCN[0]
    assert whole_ring > 3 * (gather - DCN[1])


def test_a_fast_link_slower_than_the_slow_links_share_sets_the_time():
    # the same 2 x 4 group on an ici link 10x slower than its dcn: now ici sets the time
    slow_ici = st.Hardware("x", 1000, 1e12, {"ici": (1e7, 0.0), "dcn": (1e8, 0.0)}, 4)
    row = st.Collective("all-gather", 1, 8000, axes=("fsdp",), group=8)
    t = timed([row], {"fsdp": 8}, hw=slow_ici)
    on_ici, on_dcn = 3 / 4 * 8000 / 1e7, 1 / 2 * 8000 / 4 / 1e8  # 6e-4 s, 1e-5 s
    assert t.comm_seconds == pytest.approx(on_ici) and on_ici > on_dcn


def test_a_two_node_all_gather_on_h100s_is_the_books_max_not_the_sum():
    # The scaling book's 2-node all-gather (GPU chapter): max(B 7/8 / 450e9 within
    # the node, B 1/2 / (8 x 50e9) across). 16 devices as fsdp 16, nodes of 8.
    h100 = st.hardware("h100")
    b = 64 * 2**20  # the result, on each device
    row = st.Collective("all-gather", 1, b, axes=("fsdp",), group=16)
    t = timed([row], {"fsdp": 16}, hw=h100)
    on_ici = 7 / 8 * b / 450e9 + 7 * 2e-6  # 130.5 us + 7 hops of 2 us = 144.5 us
    on_dcn = 1 / 2 * b / 8 / 50e9 + 1 * 5e-6  # 83.9 us + 1 hop of 5 us = 88.9 us
    assert t.comm_seconds == pytest.approx(max(on_ici, on_dcn))
    assert t.comm_seconds == pytest.approx(144.5e-6, rel=1e-3)
    assert t.comm_seconds < on_ici + on_dcn  # 0.3's sum: 233 us


def test_tensor_8_across_nodes_is_slower_than_within_a_node():
    # 16 H100s as nodes of 8. (data 2, tensor 8): tensor's 8 devices share a node.
    # (tensor 8, data 2): tensor's stride is 2, so each group has 4 on each of 2 nodes.
    h100, v = st.hardware("h100"), 32 * 2**20
    row = st.Collective("all-gather", 1, v, axes=("tensor",), group=8)
    within = timed([row], {"data": 2, "tensor": 8}, hw=h100).comm_seconds
    across = timed([row], {"tensor": 8, "data": 2}, hw=h100).comm_seconds
    assert within == pytest.approx(7 / 8 * v / 450e9 + 7 * 2e-6)  # 65.2 us + 14 us
    on_ici = 3 / 4 * v / 450e9 + 3 * 2e-6  # 55.9 us + 6 us
    on_dcn = 1 / 2 * v / 4 / 50e9 + 1 * 5e-6  # 83.9 us + 5 us
    assert across == pytest.approx(on_dcn) and on_dcn > on_ici
    assert across > 1.1 * within


def _fsdp_rows(per_device, d, f, x, itemsize=2):
    """A matmul's FSDP step by hand: its weight [d, f] gathered over fsdp x for the
    forward pass, its gradient reduce-scattered; 2 matmuls of 2 x batch x d x f."""
    gather = st.Collective("all-gather", 1, d * f * itemsize, axes=("fsdp",), group=x)
    scatter = st.Collective("reduce-scatter", 1, d * f * itemsize // x, axes=("fsdp",), group=x)
    return [gather, scatter], 4 * per_device * d * f


@pytest.mark.parametrize("name, links", [("tpu-v5e", 1.0), ("tpu-v5p", 1.5), ("tpu-v6e", 1.0)])
def test_fsdp_is_compute_bound_above_c_over_w_per_device_and_collective_bound_below(name, links):
    # T_math = 4 b d f / C, T_comm = 2 x (x-1)/x x 2 d f / (W x links) (+ hops):
    # compute-bound when b > (x-1)/x x C / (W x links), the book's rule with its
    # (x-1)/x. FSDP over several torus axes divides the critical batch by their
    # number, and an axis without wraparound links counts half (0.5; 0.4 timed
    # every group on one wrapped axis). 8 chips are a 2 x 4 slice (v5e, v6e: 2
    # axes, neither 16 long, so no wraparound: 2 x 1/2) or a 2 x 2 x 2 one (v5p:
    # 3 axes, not whole cubes: 3 x 1/2). For v5p, x = 8, d = f = 8192:
    # 7/8 x 2550 / 1.5 = 1488, + 2 x 7 x 1 us x C / (4 d f) = 24 for the hops.
    hw = st.hardware(name)
    critical = hw.flops_per_second / (hw.links["ici"][0] * links)
    for per_device, compute_bound in [(1.05 * critical, True), (0.8 * critical, False)]:
        rows, flops = _fsdp_rows(int(per_device), 8192, 8192, 8)
        t = timed(rows, {"fsdp": 8}, flops=flops, hw=hw)
        assert (t.compute_seconds > t.comm_seconds) is compute_bound, (name, per_device)


def test_an_all_gather_on_a_v5e_4x4_is_the_books_worked_example_without_wraparound():
    # The scaling book ("Sharded Matrices", its v5e 4 x 4 question): A[E_Y, F] in
    # bf16, 2048 x 8192, gathered over Y of 4. "TPU v5e only has a wraparound
    # connection when one axis has size 16 ... T = 3 x 8.4e6 / 4.5e10 = 560 us"
    # (one direction's 4.5e10), where a ring would take 34e6 / 9e10 = 377 us.
    v5e, b = st.hardware("tpu-v5e"), 2048 * 8192 * 2
    gather = st.Collective("all-gather", 1, b, axes=("y",), group=4)
    t = timed([gather], {"x": 4, "y": 4}, hw=v5e).comm_seconds
    assert t == pytest.approx(3 * (b / 4) / 4.5e10 + 3 * 1e-6)
    assert t == pytest.approx(563e-6, rel=0.01)
    # The same gather along an axis of a v5e-256 (16 x 16, wrapped): the ring's
    # two directions, and a group of 16 along it.
    ring = st.Collective("all-gather", 1, b, axes=("y",), group=16)
    assert timed([ring], {"x": 16, "y": 16}, hw=v5e).comm_seconds == pytest.approx(
        15 / 16 * b / 9e10 + 15 * 1e-6
    )


@pytest.mark.parametrize(
    "chips, links",
    # v5p: wraparounds only on whole 4 x 4 x 4 cubes ("a 2x2x4 won't have any").
    [(16, 1.5), (32, 1.5), (64, 3.0), (128, 3.0)],
)
def test_fsdp_over_a_whole_v5p_slice_sends_round_its_wraparounds_only_on_whole_cubes(chips, links):
    v5p, b = st.hardware("tpu-v5p"), 2**30
    gather = st.Collective("all-gather", 1, b, axes=("fsdp",), group=chips)
    t = timed([gather], {"fsdp": chips}, hw=v5p).comm_seconds
    assert t == pytest.approx((chips - 1) / chips * b / (1.8e11 * links) + (chips - 1) * 1e-6)


def test_a_group_over_both_axes_of_a_v5e_256_torus_sends_over_both():
    # v5e-256 is a 16 x 16 torus. A mesh axis of 16 lies along one torus axis; the
    # whole 256 (FSDP over the slice) spans both, so its bytes go at twice one
    # axis's bandwidth (the scaling book: V / (W_ici x axes)).
    v5e, b = st.hardware("tpu-v5e"), 64 * 2**20
    whole = st.Collective("all-gather", 1, b, axes=("fsdp",), group=256)
    one = st.Collective("all-gather", 1, b, axes=("data",), group=16)
    across = timed([whole], {"fsdp": 256}, hw=v5e).comm_seconds
    along = timed([one], {"data": 16, "fsdp": 16}, hw=v5e).comm_seconds
    assert across == pytest.approx(255 / 256 * b / (2 * 9e10) + 255 * 1e-6)
    assert along == pytest.approx(15 / 16 * b / 9e10 + 15 * 1e-6)
    # A GPU node is no torus: H100s' 8 NVLink devices at the one figure.
    gather = st.Collective("all-gather", 1, b, axes=("fsdp",), group=8)
    h100 = timed([gather], {"fsdp": 8}, hw=st.hardware("h100"))
    assert h100.comm_seconds == pytest.approx(7 / 8 * b / 450e9 + 7 * 2e-6)


def test_fsdp_step_preflighted_matches_the_rows_by_hand():
    # The rows above are what a compiled FSDP step holds (f32 here: the CPU compile
    # widens a bf16 weight before gathering it), and its FLOPs are the two matmuls'.
    d = f = 1024
    mesh = jax.sharding.AbstractMesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    w = st.Partitioned(jax.ShapeDtypeStruct((d, f), jnp.float32), ("fsdp", None))
    x = st.Partitioned(jax.ShapeDtypeStruct((8 * 256, d), jnp.float32), ("fsdp", None))

    def sgd(w, x):
        grad = jax.grad(lambda w: jnp.mean((x.value @ w.value) ** 2))(w)
        return st.replace_boxed(w, w.value - grad.value)

    step = st.preflight(sgd, w, x, mesh=mesh, donate_argnums=0)
    rows, flops = _fsdp_rows(256, d, f, 8, itemsize=4)
    assert sorted(step.collectives) == sorted(rows)
    assert step.flops == flops


@pytest.mark.parametrize(
    "name, book",
    [("tpu-v5e", 2200), ("tpu-v5p", 2550), ("tpu-v6e", 5100)],
)
def test_tpu_critical_batch_per_chip_is_the_books(name, book):
    # C/W: v5e 1.97e14 / 9e10 = 2189, v5p 4.59e14 / 1.8e11 = 2550, v6e 9.2e14 / 1.8e11
    # = 5111; the book rounds them to 2200 (v5e), 2550 (v5p) and its int8 5100 (v6e bf16).
    hw = st.hardware(name)
    assert hw.flops_per_second / hw.links["ici"][0] == pytest.approx(book, rel=0.03)


def test_a_permute_across_nodes_takes_the_slow_link():
    t = timed(
        [st.Collective("collective-permute", 2, 800, axes=("data",), group=2)],
        {"data": 2, "fsdp": 4},
    )
    assert t.comm_seconds == pytest.approx(800 / DCN[0] + 2 * DCN[1])


def test_devices_per_node_one_puts_every_collective_on_dcn():
    only_dcn = st.Hardware("dcn only", 1000, 1e12, {"dcn": DCN}, devices_per_node=8)
    shape = {"data": 2, "fsdp": 4}
    rows = [
        st.Collective("all-gather", 1, 4096, axes=("fsdp",), group=4),
        st.Collective("all-reduce", 2, 4096, axes=("data", "fsdp"), group=8),
    ]
    with pytest.raises(ValueError, match="no 'ici' link"):
        timed(rows, shape, hw=only_dcn)  # 8 per node: everything is on the missing ici
    t = timed(rows, shape, hw=only_dcn, devices_per_node=1)
    for row in rows:
        expected = row.wire_bytes / DCN[0] + row.count * DCN[1] * (row.group - 1)
        assert t.comm_by_axes[row.axes] == pytest.approx(expected)


def test_nodes_follow_row_major_positions():
    # (fsdp 4, tensor 8) on nodes of 8: tensor rides one node, fsdp spans 4 nodes, both 32
    shape = {"fsdp": 4, "tensor": 8}
    one = st.Hardware("h", 1, 1e12, {"ici": (1e9, 0.0), "dcn": (1e6, 0.0)}, devices_per_node=8)
    tensor = timed([st.Collective("all-gather", 1, 8000, axes=("tensor",), group=8)], shape, hw=one)
    assert tensor.comm_seconds == pytest.approx(7 / 8 * 8000 / 1e9)
    fsdp = timed([st.Collective("all-gather", 1, 8000, axes=("fsdp",), group=4)], shape, hw=one)
    assert fsdp.comm_seconds == pytest.approx(3 / 4 * 8000 / 1e6)
    both = timed(
        [st.Collective("all-gather", 1, 8000, axes=("fsdp", "tensor"), group=32)], shape, hw=one
    )
    # ici 7e-6 s, dcn 7.5e-4 s: the slower
    assert both.comm_seconds == pytest.approx(max(7 / 8 * 8000 / 1e9, 3 / 4 * 8000 / 8 / 1e6))
    alone = timed([st.Collective("all-gather", 1, 8000, axes=("tensor",), group=8)], shape, hw=one)
    assert alone == tensor
    one_node = dataclasses.replace(one, devices_per_node=None)
    assert timed(
        [st.Collective("all-gather", 1, 8000, axes=("fsdp",), group=4)], shape, hw=one_node
    ).comm_seconds == pytest.approx(3 / 4 * 8000 / 1e9)


def test_a_real_step_computes_its_flops_at_the_peak():
    step = _step()
    t = step.time(HW)
    assert t.compute_seconds == step.flops / HW.flops_per_second
    assert set(t.comm_by_axes) == {row.axes for row in step.collectives}


def test_presets():
    for name in ("a100", "h100", "h200", "b200", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        hw = st.hardware(name)
        assert hw.name == name and set(hw.links) == {"ici", "dcn"}
        assert hw.links["ici"][0] > hw.links["dcn"][0]
        assert hw.devices_per_node == (None if name.startswith("tpu") else 8)
    assert st.hardware("h200").memory_bytes > st.hardware("h100").memory_bytes
    assert st.hardware("b200").flops_per_second > st.hardware("h100").flops_per_second
    assert st.hardware("a100").flops_per_second < st.hardware("h100").flops_per_second


def test_a_chip_that_is_no_chip_is_a_type_error():
    with pytest.raises(TypeError, match=r"Hardware: chip is 'h100'; expected a st.GpuChip"):
        st.Hardware("x", 1, 1e12, {"ici": ICI}, chip="h100")


@pytest.mark.parametrize(
    "build, said",
    [
        (
            lambda: st.hardware("mi300x"),
            "'a100', 'h100', 'h200', 'b200', 'tpu-v5e', 'tpu-v5p', 'tpu-v6e'",
        ),
        (
            lambda: st.Hardware("x", 1, 1e12, {"ici": ICI}, matmul_efficiency=1.5),
            "matmul_efficiency is 1.5; expected a share of the peak, 0 to 1",
        ),
        (
            lambda: st.Hardware("x", 1, 1e12, {"ici": ICI}, cores=2.5),
            "cores is 2.5; expected an int",
        ),
        (
            lambda: st.Hardware("x", 1, 1e12, {"ici": ICI}, hbm_bytes_per_second=0),
            "hbm_bytes_per_second is 0",
        ),
        (lambda: st.Hardware("x", 0, 1e12, {"ici": ICI}), "memory_bytes is 0"),
        (lambda: st.Hardware("x", 1, -1.0, {"ici": ICI}), "flops_per_second is -1.0"),
        (lambda: st.Hardware("x", 1, 1e12, {"ici": (0, 1e-6)}), r"links\['ici'\] bandwidth is 0"),
        (lambda: st.Hardware("x", 1, 1e12, {"ici": (1e9, -1.0)}), r"links\['ici'\] latency"),
        (lambda: st.Hardware("x", 1, 1e12, {"nvlink": ICI}), "link kind 'nvlink'"),
        (
            lambda: st.Hardware("x", 1, 1e12, {"ici": ICI}, devices_per_node=0),
            "devices_per_node is 0",
        ),
        (lambda: _step().time(HW, devices_per_node=0), "devices_per_node is 0"),
        (lambda: st.StepTime(1.0, {}).mfu(0.0), "step_seconds is 0.0"),
        (lambda: st.StepTime(1.0, {}, 1e12).mfu(1.0, model_flops=0), "model_flops is 0"),
        (
            lambda: st.StepTime(1.0, {}).mfu(1.0, model_flops=1e12),
            "^mfu: model_flops is 1000000000000.0, but this StepTime has no flops_per_second",
        ),
        (lambda: st.StepTime(1.0, {}, flops_per_second=0.0), "flops_per_second is 0.0"),
    ],
    ids=[
        "preset",
        "share-over-one",
        "cores-fraction",
        "no-bandwidth",
        "memory",
        "flops",
        "bandwidth",
        "latency",
        "kind",
        "per-node",
        "time-per-node",
        "mfu",
        "mfu-model-flops",
        "mfu-without-the-peak",
        "step-time-peak",
    ],
)
def test_mistakes_name_the_figure(build, said):
    with pytest.raises(ValueError, match=said):
        build()


def test_hardware_and_step_time_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HW.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        HW.links["ici"] = (1.0, 0.0)  # type: ignore[index]
    assert math.isclose(HW.links["ici"][0], 1e9)
    with pytest.raises(TypeError):
        timed([], {"data": 2}).comm_by_axes[("data",)] = 1.0  # type: ignore[index]


def test_mfu_counts_hardware_flops_or_the_models():
    # a step of 5e11 FLOPs per device on a 1e12 FLOP/s chip: 0.5 s at the peak
    t = timed([], {"data": 2}, flops=5e11)
    assert t.flops_per_second == HW.flops_per_second
    assert t.mfu(2.0) == pytest.approx(0.5 / 2.0)  # hardware FLOPs, recompute included
    # the model's own 3e11 (no recompute): 3e11 / 1e12 / 2.0 s = 0.15
    assert t.mfu(2.0, model_flops=3e11) == pytest.approx(0.15)
    # a dense decoder's training step: 6 x params x tokens / devices per device
    params, tokens, devices = 1e9, 4096 * 8, 8
    model = 6 * params * tokens / devices  # 2.46e13 FLOPs per device
    assert t.mfu(100.0, model_flops=model) == pytest.approx(model / 1e12 / 100.0)


def test_step_time_built_without_the_peak_still_works():
    t = st.StepTime(compute_seconds=0.5, comm_by_axes={("fsdp",): 0.25})
    assert t.flops_per_second is None and t.mfu(1.0) == 0.5 and t.bound_seconds == 0.5
    with pytest.raises(TypeError, match=r"^StepTime: comm_by_axes is \[0.25\]; expected a mapping"):
        st.StepTime(0.5, [0.25])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        st.hardware("h100"),
        st.hardware("tpu-v5p"),
        HW,
        st.StepTime(0.5, {("fsdp",): 0.25, ("data", "fsdp"): 0.5}, 1e15),
        st.StepTime(0.5, {}),
    ],
    ids=["h100", "tpu-v5p", "custom", "step-time", "step-time-without-peak"],
)
def test_hardware_and_step_time_pickle_and_compare_equal(value):
    again = pickle.loads(pickle.dumps(value))
    assert again == value and type(again) is type(value)
    assert repr(again) == repr(value)
    assert hash(again) == hash(value)


def test_a_timed_step_pickles():
    t = timed([st.Collective("all-gather", 2, 4000, axes=("fsdp",), group=4)], {"fsdp": 4})
    again = pickle.loads(pickle.dumps(t))
    assert again == t and again.comm_by_axes == {("fsdp",): t.comm_seconds}


def test_repr_shows_plain_dicts():
    text = repr(st.hardware("h100"))
    assert "mappingproxy" not in text
    assert "links={'ici': (450000000000.0, 2e-06), 'dcn': (50000000000.0, 5e-06)}" in text
    t = repr(st.StepTime(0.5, {("fsdp",): 0.25}))
    assert "mappingproxy" not in t and "comm_by_axes={('fsdp',): 0.25}" in t
