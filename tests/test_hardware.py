"""Hardware, its presets, and StepPlan.time: the roofline, checked by hand."""

import dataclasses
import functools
import math

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


def test_a_group_over_two_nodes_is_timed_hierarchically():
    # fsdp 8 on nodes of 4: each group is 4 devices on each of 2 nodes.
    shape = {"fsdp": 8}
    v = 8000

    def seconds(kind, size):
        return timed([st.Collective(kind, 1, size, axes=("fsdp",), group=8)], shape).comm_seconds

    hops = 3 * ICI[1] + 1 * DCN[1]
    gather = 3 / 4 * v / ICI[0] + 1 / 2 * v / 4 / DCN[0] + hops
    assert seconds("all-gather", v) == pytest.approx(gather)
    # a reduce-scatter's volume is its input: result x group
    scatter = 3 / 4 * (v * 8) / ICI[0] + 1 / 2 * (v * 8) / 4 / DCN[0] + hops
    assert seconds("reduce-scatter", v) == pytest.approx(scatter)
    reduce = 2 * 3 / 4 * v / ICI[0] + 2 * 1 / 2 * v / 4 / DCN[0] + hops
    assert seconds("all-reduce", v) == pytest.approx(reduce)
    # an all-to-all's data must cross: not divided by the faster kind's group
    to_all = 3 / 4 * v / ICI[0] + 1 / 2 * v / DCN[0] + hops
    assert seconds("all-to-all", v) == pytest.approx(to_all)
    # the whole ring on the slow link would be several times slower
    whole_ring = st.Collective("all-gather", 1, v, axes=("fsdp",), group=8).wire_bytes / DCN[0]
    assert whole_ring > 3 * (gather - hops)


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
    assert both.comm_seconds == pytest.approx(7 / 8 * 8000 / 1e9 + 3 / 4 * 8000 / 8 / 1e6)
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
    for name in ("h100", "h200", "b200", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        hw = st.hardware(name)
        assert hw.name == name and set(hw.links) == {"ici", "dcn"}
        assert hw.links["ici"][0] > hw.links["dcn"][0]
        assert hw.devices_per_node == (None if name.startswith("tpu") else 8)
    assert st.hardware("h200").memory_bytes > st.hardware("h100").memory_bytes
    assert st.hardware("b200").flops_per_second > st.hardware("h100").flops_per_second


@pytest.mark.parametrize(
    "build, said",
    [
        (lambda: st.hardware("a100"), "'h100', 'h200', 'b200', 'tpu-v5e', 'tpu-v5p', 'tpu-v6e'"),
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
    ],
    ids=[
        "preset",
        "memory",
        "flops",
        "bandwidth",
        "latency",
        "kind",
        "per-node",
        "time-per-node",
        "mfu",
    ],
)
def test_mistakes_name_the_figure(build, said):
    with pytest.raises(ValueError, match=said):
        build()


def test_hardware_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HW.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        HW.links["ici"] = (1.0, 0.0)  # type: ignore[index]
    assert math.isclose(HW.links["ici"][0], 1e9)
