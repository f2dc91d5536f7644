"""Reading the compiled step: replica groups in every form, mesh axes, the reduce-scatter
pattern, wire bytes, flops by trip counts, and the bound on the CPU peak's overstatement.

The HLO reader has no public entry of its own (`preflight` is its face), so the
literal-snippet tests read it from `spmdtree._src.step.hlo`; everything else goes
through `st.preflight` on real compiles.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import spmdtree as st
from spmdtree._src.step import hlo


def abstract_mesh(shape, names):
    return jax.sharding.AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def rows(step):
    """{(kind, axes): (count, bytes, group)} of a StepPlan's collectives."""
    return {(c.kind, c.axes): (c.count, c.bytes, c.group) for c in step.collectives}


# --- replica groups, from literal HLO --------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "groups"),
    [
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups={}", [list(range(8))]),
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        # iota [2,2,2] transposed (0,2,1): ids ordered a, c, b; groups of 2 along b
        ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}",
            [[0, 1, 4, 5], [2, 3, 6, 7]],
        ),
        # the printed mesh [4,1,2] over ids laid out as iota [2,4] transposed: axis_0 runs
        # along the second axis of the user's (2, 4) mesh
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
            [[0, 1, 2, 3], [4, 5, 6, 7]],
        ),
        (
            "replica_groups=mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'a'}",
            [[3, 2], [1, 0]],
        ),
        # a sub-axis: 'x':(1)2 is the major half of an axis of 8 ([8] -> [1,2,4])
        ("replica_groups=mesh['x'=8] {'x':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ],
)
def test_replica_groups_in_every_form(attrs, groups):
    assert hlo.replica_groups(attrs + ", use_global_device_ids=true", 8) == groups


@pytest.mark.parametrize(
    ("groups", "axes", "group", "whole"),
    [
        ([[0, 1, 2, 3], [4, 5, 6, 7]], ("fsdp",), 4, True),
        ([[0, 4], [1, 5], [2, 6], [3, 7]], ("data",), 2, True),
        ([list(range(8))], ("data", "fsdp"), 8, True),
        ([[0, 1], [2, 3], [4, 5], [6, 7]], ("fsdp",), 2, False),  # half of fsdp
        ([[0, 5], [1, 4], [2, 7], [3, 6]], ("data", "fsdp"), 2, False),
    ],
)
def test_groups_name_the_mesh_axes_they_vary_along(groups, axes, group, whole):
    assert hlo.group_axes(groups, (("data", 2), ("fsdp", 4))) == (axes, group, whole)


def test_groups_of_part_of_an_axis_keep_it_and_are_flagged():
    text = SLICED.replace("%OFFSET", "%z").replace("{{0,1,2,3}}", "{{0,1},{2,3}}")
    read = hlo.read_step(text, (("x", 4),), cpu=True)
    assert read.collectives == [("all-reduce", 1, 64 * 16 * 4, ("x",), 2)]
    assert read.flags == [
        "all-reduce over groups of 2 devices that are not whole mesh axes (part of x)"
    ]


def test_a_permute_names_the_axes_its_pairs_cross():
    shape = (("data", 2), ("fsdp", 4))
    assert hlo.permute_axes("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", shape) == ("fsdp",)
    assert hlo.permute_axes("source_target_pairs={{0,4},{4,0}}", shape) == ("data",)
    assert hlo.permute_axes("source_target_pairs={{0,5}}", shape) == ("data", "fsdp")


SLICED = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused (p0: f32[64,16], p1: u32[]) -> f32[16,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = u32[] parameter(1)
  %c = s32[] convert(%p1)
  %k = s32[] constant(16)
  %off = s32[] multiply(%c, %k)
  %z = s32[] constant(0)
  ROOT %ds = f32[16,16]{1,0} dynamic-slice(%p0, %OFFSET, %z), dynamic_slice_sizes={16,16}
}

ENTRY %main (a: f32[64,16]) -> f32[16,16] {
  %a = f32[64,16]{1,0} parameter(0)
  %pid = u32[] partition-id()
  %ar = f32[64,16]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %b = f32[64,16]{1,0} bitcast(%ar)
  ROOT %f = f32[16,16]{1,0} fusion(%b, %pid), kind=kLoop, calls=%fused
}
"""


def test_an_all_reduce_sliced_by_partition_is_a_reduce_scatter_on_cpu():
    text = SLICED.replace("%OFFSET", "%off")
    read = hlo.read_step(text, (("x", 4),), cpu=True)
    assert read.collectives == [("reduce-scatter", 1, 16 * 16 * 4, ("x",), 4)]
    assert read.held_bytes == 64 * 16 * 4
    assert any("reduce-scatter" in flag for flag in read.flags)
    # compiled for an accelerator, the ops are counted as they are
    real = hlo.read_step(text, (("x", 4),), cpu=False)
    assert real.collectives == [("all-reduce", 1, 64 * 16 * 4, ("x",), 4)]
    assert real.held_bytes == 0


def test_a_slice_at_a_fixed_offset_keeps_the_all_reduce():
    read = hlo.read_step(SLICED.replace("%OFFSET", "%z"), (("x", 4),), cpu=True)
    assert read.collectives == [("all-reduce", 1, 64 * 16 * 4, ("x",), 4)]
    assert read.held_bytes == 0


MIXED = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[64,16], n: f32[16]) -> (bf16[16,16], f32[16]) {
  %a = f32[64,16]{1,0} parameter(0)
  %n = f32[16]{0} parameter(1)
  %pid = u32[] partition-id()
  %k = u32[] constant(16)
  %off = u32[] multiply(%pid, %k)
  %z = u32[] constant(0)
  %ar = (f32[64,16]{1,0}, f32[16]{0}) all-reduce(%a, %n), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %g = f32[64,16]{1,0} get-tuple-element(%ar), index=0
  %norm = f32[16]{0} get-tuple-element(%ar), index=1
  %half = bf16[64,16]{1,0} convert(%g)
  %sq = bf16[64,16]{1,0} multiply(%half, %half)
  %ds = bf16[16,16]{1,0} dynamic-slice(%sq, %off, %z), dynamic_slice_sizes={16,16}
  ROOT %out = (bf16[16,16]{1,0}, f32[16]{0}) tuple(%ds, %norm)
}
"""


def test_a_tuple_all_reduce_splits_into_its_sliced_and_its_whole_elements():
    # element 0 reaches a partition-offset slice through a convert and an elementwise
    # op (the CPU pipeline reduces bf16 in f32); element 1 is an output, used whole
    read = hlo.read_step(MIXED, (("x", 4),), cpu=True)
    assert read.collectives == [
        ("all-reduce", 1, 16 * 4, ("x",), 4),
        ("reduce-scatter", 1, 16 * 16 * 2, ("x",), 4),
    ]
    assert read.held_bytes == 64 * 16 * 4  # the sliced element's whole size only


WIDENED = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%widen (p: bf16[64,16]) -> f32[1,64,16] {
  %p = bf16[64,16]{1,0} parameter(0)
  %w = f32[64,16]{1,0} convert(%p)
  ROOT %b = f32[1,64,16]{2,1,0} bitcast(%w)
}

ENTRY %main (a: bf16[64,16]) -> f32[1,64,16] {
  %a = bf16[64,16]{1,0} parameter(0)
  %f = f32[1,64,16]{2,1,0} fusion(%a), kind=kLoop, calls=%widen
  ROOT %ar = f32[1,64,16]{2,1,0} all-reduce(%f), channel_id=1, replica_groups={}, to_apply=%add
}
"""


def test_a_bf16_reduction_the_cpu_widens_counts_at_bf16():
    read = hlo.read_step(WIDENED, (("x", 4),), cpu=True)
    assert read.collectives == [("all-reduce", 1, 64 * 16 * 2, ("x",), 4)]
    assert any("bf16 in f32" in flag for flag in read.flags)
    assert hlo.read_step(WIDENED, (("x", 4),)).collectives[0][2] == 64 * 16 * 4  # as it is


def test_the_overstatement_is_what_is_held_plus_the_offsets_capped_at_the_temporaries():
    assert hlo.overstated_bytes(0, 1000) == 0
    assert hlo.overstated_bytes(4096, 1 << 20) == 4096 + 64
    assert hlo.overstated_bytes(4096, 1000) == 1000


@pytest.mark.parametrize(
    ("kind", "wire"),
    [
        ("all-gather", 4096 * 7 // 8),
        ("reduce-scatter", 4096 * 7),
        ("all-reduce", 2 * 4096 * 7 // 8),
        ("all-to-all", 4096 * 7 // 8),
        ("collective-permute", 4096),
    ],
)
def test_wire_bytes_are_the_ring_formula_of_each_kind(kind, wire):
    assert st.Collective(kind, 1, 4096, ("x",), 8).wire_bytes == wire
    assert st.Collective(kind, 1, 4096).count == 1  # axes and group have defaults


# --- real compiles ------------------------------------------------------------------


def _sgd(w, x):
    grad = jax.grad(lambda w: jnp.mean((x.value @ w.value) ** 2))(w)
    return st.replace_boxed(w, w.value - 0.1 * grad.value)


def _fsdp_step(mesh, n=1024, w_axes=("fsdp", None), x_axes=("fsdp", None)):
    w = st.Partitioned(jax.ShapeDtypeStruct((n, n), jnp.float32), w_axes)
    x = st.Partitioned(jax.ShapeDtypeStruct((64, n), jnp.float32), x_axes)
    return st.preflight(_sgd, w, x, mesh=mesh, donate_argnums=0)


def test_the_fsdp_gradient_is_a_reduce_scatter_of_the_shard():
    step = _fsdp_step(abstract_mesh((8,), ("fsdp",)))
    assert rows(step) == {
        ("all-gather", ("fsdp",)): (1, 4 << 20, 8),
        ("reduce-scatter", ("fsdp",)): (1, 512 << 10, 8),  # the shard, not the 4 MiB gradient
    }
    assert step.collectives[1].wire_bytes == 7 * (512 << 10)
    assert any("reduce-scatter" in flag for flag in step.flags)
    assert step.overstated_bytes == (4 << 20) + 64
    assert "peak may be overstated by up to 4.0 MiB" in str(step)


def test_a_data_parallel_gradient_stays_an_all_reduce():
    step = _fsdp_step(
        abstract_mesh((8,), ("data",)), n=256, w_axes=(None, None), x_axes=("data", None)
    )
    assert rows(step) == {("all-reduce", ("data",)): (1, 256 * 256 * 4, 8)}
    assert step.overstated_bytes == 0
    assert "overstated" not in str(step)


def test_axes_on_2d_and_3d_meshes():
    two = _fsdp_step(
        abstract_mesh((2, 4), ("data", "fsdp")), n=256, x_axes=(("data", "fsdp"), None)
    )
    assert rows(two) == {
        ("all-gather", ("fsdp",)): (1, 256 * 256 * 4, 4),
        ("all-reduce", ("data",)): (1, 256 * 64 * 4, 2),  # the shard, over the other axis
        ("reduce-scatter", ("fsdp",)): (1, 256 * 64 * 4, 4),
    }
    three = _fsdp_step(
        abstract_mesh((2, 2, 2), ("a", "b", "c")),
        n=256,
        w_axes=(("a", "c"), None),
        x_axes=(("a", "b", "c"), None),
    )
    assert rows(three) == {
        ("all-gather", ("a", "c")): (1, 256 * 256 * 4, 4),
        ("all-reduce", ("b",)): (1, 256 * 64 * 4, 2),
        ("reduce-scatter", ("a", "c")): (1, 256 * 64 * 4, 4),
    }


def test_a_permuted_device_order_keeps_the_axes():
    devices = np.array(jax.devices())
    plain = Mesh(devices.reshape(2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    order = [3, 1, 7, 5, 0, 2, 6, 4]
    permuted = Mesh(devices[order].reshape(2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    x_axes = (("data", "fsdp"), None)
    a = _fsdp_step(plain, n=256, x_axes=x_axes)
    b = _fsdp_step(permuted, n=256, x_axes=x_axes)
    assert rows(a) == rows(b)
    assert ("reduce-scatter", ("fsdp",)) in rows(b) and ("all-reduce", ("data",)) in rows(b)


def _scanned_fsdp(layers, n=256):
    mesh = abstract_mesh((8,), ("fsdp",))
    w = st.Partitioned(jax.ShapeDtypeStruct((layers, n, n), jnp.float32), (None, "fsdp", None))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, n), jnp.float32), ("fsdp", None))

    def step(w, x):
        def loss(w):
            h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x.value, w)
            return jnp.mean(h**2)

        return st.replace_boxed(w, w.value - 0.1 * jax.grad(loss)(w.value))

    return st.preflight(step, w, x, mesh=mesh, donate_argnums=0)


def test_inside_a_scanned_loop_each_layer_reduce_scatters_its_shard():
    step = _scanned_fsdp(6)
    count, size, group = rows(step)[("reduce-scatter", ("fsdp",))]
    assert (count, size, group) == (6, 6 * 256 * 256 * 4 // 8, 8)
    assert ("all-reduce", ("fsdp",)) not in rows(step)
    assert 0 < step.overstated_bytes <= step.temp_bytes


def test_the_bound_covers_the_explicit_reduce_scatter_form():
    mesh = abstract_mesh((8,), ("fsdp",))
    w = st.Partitioned(jax.ShapeDtypeStruct((1024, 1024), jnp.float32), ("fsdp", None))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 1024), jnp.float32), ("fsdp", None))

    def explicit(w, x):
        def local(ws, xs):
            full = jax.lax.all_gather(ws, "fsdp", axis=0, tiled=True)
            g = jax.grad(lambda w: jnp.mean((xs @ w) ** 2))(full)
            return ws - 0.1 * jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)

        specs = P("fsdp", None)
        out = jax.shard_map(local, in_specs=(specs, specs), out_specs=specs)(w.value, x.value)
        return st.replace_boxed(w, out)

    cpu = st.preflight(_sgd, w, x, mesh=mesh, donate_argnums=0)
    written = st.preflight(explicit, w, x, mesh=mesh, donate_argnums=0)
    assert rows(written)[("reduce-scatter", ("fsdp",))] == rows(cpu)[("reduce-scatter", ("fsdp",))]
    assert written.overstated_bytes == 0
    assert cpu.temp_bytes > written.temp_bytes  # the CPU form holds the whole gradient
    assert cpu.temp_bytes - cpu.overstated_bytes <= written.temp_bytes


def test_permutes_and_all_to_alls_name_their_axes():
    mesh = abstract_mesh((2, 4), ("data", "x"))
    specs = P("x", None)

    def shift(a):
        pairs = [(i, (i + 1) % 4) for i in range(4)]
        return jax.shard_map(
            lambda a: jax.lax.ppermute(a, "x", pairs), in_specs=specs, out_specs=specs
        )(a)

    def swap(a):
        return jax.shard_map(
            lambda a: jax.lax.all_to_all(a, "x", 0, 1, tiled=True),
            in_specs=specs,
            out_specs=P(None, "x"),
        )(a)

    a = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    permuted = st.preflight(shift, a, mesh=mesh)
    assert rows(permuted) == {("collective-permute", ("x",)): (1, 16 * 64 * 4, 2)}
    swapped = st.preflight(swap, a, mesh=mesh)
    # its result is a tuple of the pieces, summed: the device's whole (16, 64) block
    assert rows(swapped) == {("all-to-all", ("x",)): (1, 16 * 64 * 4, 4)}


# --- flops --------------------------------------------------------------------------


def test_one_matmul_is_2mnk_over_the_devices():
    mesh = abstract_mesh((8,), ("data",))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
    w = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    step = st.preflight(lambda x, w: x.value @ w, x, w, mesh=mesh)
    assert step.flops == 2 * 64 * 256 * 128 // 8


def test_a_scanned_loop_counts_by_its_trip_count():
    mesh = abstract_mesh((8,), ("data",))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 128), jnp.float32), ("data", None))

    def run(layers):
        w = jax.ShapeDtypeStruct((layers, 128, 128), jnp.float32)
        forward = lambda x, w: jax.lax.scan(lambda h, wi: (h @ wi, None), x.value, w)[0]  # noqa: E731
        return st.preflight(forward, x, w, mesh=mesh).flops

    assert run(6) == 6 * 2 * 64 * 128 * 128 // 8
    assert run(3) == 3 * 2 * 64 * 128 * 128 // 8


def _decoder():
    """A small dense decoder's training step, data parallel: (its flops per device,
    6 x matmul weights x tokens / devices)."""
    vocab, d, layers, batch, length = 512, 128, 2, 16, 8
    mesh = abstract_mesh((8,), ("data",))
    shapes = {"embed": (vocab, d), "unembed": (d, vocab)}
    for i in range(layers):
        shapes |= {f"{i}/{n}": (d, d) for n in ("q", "k", "v", "o")}
        shapes |= {f"{i}/up": (d, 4 * d), f"{i}/down": (4 * d, d)}
    params = {
        k: st.Partitioned(jax.ShapeDtypeStruct(s, jnp.float32), (None, None))
        for k, s in shapes.items()
    }
    tokens = st.Partitioned(jax.ShapeDtypeStruct((batch, length), jnp.int32), ("data", None))

    def loss(p, tokens):
        h = jnp.take(p["embed"], tokens, axis=0)  # a lookup, no matmul
        for i in range(layers):
            q, k, v = (h @ p[f"{i}/{n}"] for n in "qkv")
            att = jax.nn.softmax(q @ k.transpose(0, 2, 1) / math.sqrt(d), axis=-1)
            h = h + (att @ v) @ p[f"{i}/o"]
            h = h + jax.nn.relu(h @ p[f"{i}/up"]) @ p[f"{i}/down"]
        logits = h @ p["unembed"]
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def step(params, tokens):
        values = jax.tree.map(
            lambda b: b.value, params, is_leaf=lambda b: isinstance(b, st.Partitioned)
        )
        grads = jax.grad(loss)(values, tokens.value)
        return jax.tree.map(lambda v, g: v - 0.1 * g, values, grads)

    plan = st.preflight(step, params, tokens, mesh=mesh)
    matmul_weights = sum(math.prod(s) for k, s in shapes.items() if k != "embed")
    return plan.flops, 6 * matmul_weights * batch * length / 8


def test_a_dense_decoder_is_about_6_n_tokens():
    flops, expected = _decoder()
    assert abs(flops / expected - 1) < 0.1


GPU = """\
HloModule m, is_scheduled=true, num_partitions=1

%f (p0: f32[8,1024], p1: f32[1024,512]) -> f32[8,512] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = f32[1024,512]{1,0} parameter(1)
  ROOT %d = f32[8,512]{1,0} dot(f32[8,1024]{1,0} %p0, f32[1024,512]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,1024], b: f32[1024,512], c: f32[2,64,32]) -> f32[8,512] {
  %a = f32[8,1024]{1,0} parameter(0)
  %b = f32[1024,512]{1,0} parameter(1)
  %c = f32[2,64,32]{2,1,0} parameter(2)
  %g = (f32[8,512]{1,0}, s8[4194304]{0}) custom-call(f32[8,1024]{1,0} %a, f32[1024,512]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %t = f32[8,512]{1,0} fusion(f32[8,1024]{1,0} %a, f32[1024,512]{1,0} %b), kind=kCustom, calls=%f
  %other = f32[2,64,32]{2,1,0} custom-call(f32[2,64,32]{2,1,0} %c), custom_call_target="Sharding"
  ROOT %r = f32[8,512]{1,0} get-tuple-element(%g), index=0
}
"""


def test_a_gpu_compile_counts_its_library_matmuls_and_fused_dots():
    # operands printed with their types, as newer and GPU HLO prints them
    assert hlo.read_step(GPU).flops == 2 * (2 * 8 * 1024 * 512)
