"""Reading the compiled step through `st.preflight` on CPU devices: collectives'
kinds, mesh axes, groups and bytes on random meshes; the ring formulas; the CPU
compiler's forms (reduce-scatters written as sliced all-reduces, values widened
to f32); flops by trip counts and branches; the bound on the peak's overstatement.

The GPU's and the TPU's compilers are tested in test_hlo_targets.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import spmdtree as st


def abstract_mesh(shape, names):
    return jax.sharding.AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def rows(step):
    """{(kind, axes): (count, bytes, group)} of a StepPlan's collectives."""
    return {(c.kind, c.axes): (c.count, c.bytes, c.group) for c in step.collectives}


# --- every kind over random axes of random meshes ---------------------------------------


@hs.composite
def meshes_and_axes(draw):
    """A mesh of at most 8 devices (1 to 3 axes) and a subset of its axes of size > 1."""
    sizes = draw(
        hs.lists(hs.sampled_from([1, 2, 4]), min_size=1, max_size=3).filter(
            lambda s: math.prod(s) <= 8 and max(s) > 1
        )
    )
    names = ("a", "b", "c")[: len(sizes)]
    wide = [n for n, s in zip(names, sizes, strict=True) if s > 1]
    chosen = draw(hs.lists(hs.sampled_from(wide), min_size=1, unique=True))
    axes = tuple(n for n in names if n in chosen)  # in mesh order
    return tuple(sizes), names, axes, draw(hs.sampled_from([jnp.float32, jnp.bfloat16]))


def _each_kind(axes, group):
    """A shard_map step doing psum, all_gather, psum_scatter and ppermute over `axes`."""
    shift = [(i, (i + 1) % group) for i in range(group)]

    def local(x):
        total = jax.lax.psum(x, axes)
        gathered = jax.lax.all_gather(x, axes, axis=0, tiled=True)
        scattered = jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
        moved = jax.lax.ppermute(x, axes, shift)
        return total.sum() + gathered.sum() + scattered.sum() + moved.sum()

    return local


@settings(max_examples=12)
@given(meshes_and_axes())
def test_each_kind_names_its_axes_group_and_result_bytes(case):
    sizes, names, axes, dtype = case
    group = math.prod(s for n, s in zip(names, sizes, strict=True) if n in axes)
    mesh = abstract_mesh(sizes, names)
    rows_per_device = 16 * group
    x = jax.ShapeDtypeStruct((rows_per_device * math.prod(sizes), 8), dtype)
    spec = P(names, None)
    local = _each_kind(axes, group)

    def step(x):
        parts = jax.shard_map(local, in_specs=spec, out_specs=P(), check_vma=False)(x)
        return parts

    plan = st.preflight(step, x, mesh=mesh)
    width = jnp.dtype(dtype).itemsize
    block = rows_per_device * 8 * width  # one device's block, at the program's width
    found = rows(plan)
    assert found[("all-gather", axes)] == (1, block * group, group)
    assert found[("reduce-scatter", axes)] == (1, block // group, group)
    assert found[("collective-permute", axes)] == (1, block, 2)
    count, size, _ = found[("all-reduce", axes)]
    assert (count, size) == (1, block)


@pytest.mark.parametrize("kind", ["all-gather", "reduce-scatter", "all-to-all"])
@given(size=hs.integers(1, 1 << 40), group=hs.integers(1, 4096))
def test_ring_formulas_send_nothing_alone_and_grow_with_the_group(kind, size, group):
    row = st.Collective(kind, 1, size, ("x",), group)
    bigger = st.Collective(kind, 1, size, ("x",), group + 1)
    assert st.Collective(kind, 1, size, ("x",), 1).wire_bytes == 0
    assert 0 <= row.wire_bytes <= bigger.wire_bytes
    factor = (group - 1) if kind == "reduce-scatter" else (group - 1) / group
    assert abs(row.wire_bytes - factor * size) < 1


@given(shard=hs.integers(1, 1 << 30), group=hs.integers(1, 4096))
def test_an_all_reduce_sends_what_a_reduce_scatter_and_an_all_gather_send(shard, group):
    whole = shard * group
    reduce = st.Collective("all-reduce", 1, whole, ("x",), group).wire_bytes
    scatter = st.Collective("reduce-scatter", 1, shard, ("x",), group).wire_bytes
    gather = st.Collective("all-gather", 1, whole, ("x",), group).wire_bytes
    assert reduce == scatter + gather
    assert st.Collective("collective-permute", 3, whole, ("x",), 2).wire_bytes == whole


def test_all_to_alls_name_their_axes():
    mesh = abstract_mesh((2, 4), ("data", "x"))

    def swap(a):
        return jax.shard_map(
            lambda a: jax.lax.all_to_all(a, "x", 0, 1, tiled=True),
            in_specs=P("x", None),
            out_specs=P(None, "x"),
        )(a)

    swapped = st.preflight(swap, jax.ShapeDtypeStruct((64, 64), jnp.float32), mesh=mesh)
    # its result is a tuple of the pieces, summed: the device's whole (16, 64) block
    assert rows(swapped) == {("all-to-all", ("x",)): (1, 16 * 64 * 4, 4)}


def test_groups_of_part_of_an_axis_keep_it_and_are_flagged():
    mesh = abstract_mesh((8,), ("x",))
    pairs = [[0, 1], [2, 3], [4, 5], [6, 7]]

    def step(a):
        def local(a):
            return jax.lax.psum(a, "x", axis_index_groups=pairs)

        return jax.shard_map(local, in_specs=P("x"), out_specs=P("x"), check_vma=False)(a)

    try:
        plan = st.preflight(step, jax.ShapeDtypeStruct((64,), jnp.float32), mesh=mesh)
    except ValueError as e:  # jax versions that refuse axis_index_groups in shard_map
        pytest.skip(f"axis_index_groups unsupported here: {e}")
    assert rows(plan) == {("all-reduce", ("x",)): (1, 8 * 4, 2)}
    (said,) = [f for f in plan.flags if "not whole mesh axes" in f]
    assert said.startswith(
        "all-reduce over groups of 2 devices that are not whole mesh axes (part of x): "
    )
    assert "needs no change unless it is among the largest collectives" in said  # guidance


# --- the CPU compiler's forms ------------------------------------------------------------


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
    # said as what it is, with no range the estimate cannot keep (0.4)
    assert "4.0 MiB of it whole reductions an accelerator holds as shards" in str(step)
    assert "an estimate" in str(step) and "overstated by up to" not in str(step)


def test_a_data_parallel_gradient_stays_an_all_reduce():
    step = _fsdp_step(
        abstract_mesh((8,), ("data",)), n=256, w_axes=(None, None), x_axes=("data", None)
    )
    assert rows(step) == {("all-reduce", ("data",)): (1, 256 * 256 * 4, 8)}
    assert step.overstated_bytes == 0
    assert "overstated" not in str(step)


def _reduce_then_slice(by):
    """Each device reduces a whole (64, 16) over all 8 devices, then keeps the slice of
    it that its coordinates along `by` pick: what a sliced reduction looks like on CPU."""
    mesh = abstract_mesh((2, 4), ("data", "fsdp"))
    parts = math.prod(dict(data=2, fsdp=4)[a] for a in by)

    def local(x):
        whole = jax.lax.psum(x, ("data", "fsdp"))
        index = jax.lax.axis_index(by)
        return jax.lax.dynamic_slice_in_dim(whole, index * (64 // parts), 64 // parts)

    def step(x):
        spec = P(("data", "fsdp"), None)
        return jax.shard_map(local, in_specs=spec, out_specs=spec, check_vma=False)(x)

    x = jax.ShapeDtypeStruct((8 * 64, 16), jnp.float32)
    return st.preflight(step, x, mesh=mesh)


def test_a_reduction_sliced_over_its_whole_group_is_a_reduce_scatter():
    plan = _reduce_then_slice(("data", "fsdp"))
    assert rows(plan) == {("reduce-scatter", ("data", "fsdp")): (1, 8 * 16 * 4, 8)}
    assert plan.overstated_bytes == 64 * 16 * 4 + 64


def test_a_reduction_sliced_by_fewer_devices_than_it_spans_stays_an_all_reduce():
    # reduced over 8 devices, a quarter kept: a reduce-scatter of that quarter over 8
    # devices would reduce only half of what was reduced
    plan = _reduce_then_slice(("fsdp",))
    assert rows(plan) == {("all-reduce", ("data", "fsdp")): (1, 64 * 16 * 4, 8)}
    assert plan.overstated_bytes == 0


def test_a_combined_reduction_splits_into_its_sliced_and_its_whole_elements():
    # the CPU reduces both gradients in one all-reduce: the weight's is sliced (FSDP),
    # the bias's is used whole
    mesh = abstract_mesh((8,), ("fsdp",))
    w = st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), ("fsdp", None))
    b = st.Partitioned(jax.ShapeDtypeStruct((256,), jnp.float32), (None,))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("fsdp", None))

    def step(w, b, x):
        loss = lambda w, b: jnp.mean((x.value @ w + b) ** 2)  # noqa: E731
        gw, gb = jax.grad(loss, argnums=(0, 1))(w.value, b.value)
        return st.replace_boxed(w, w.value - 0.1 * gw), st.replace_boxed(b, b.value - 0.1 * gb)

    plan = st.preflight(step, w, b, x, mesh=mesh, donate_argnums=(0, 1))
    assert rows(plan) == {
        ("all-gather", ("fsdp",)): (1, 256 * 256 * 4, 8),
        ("all-reduce", ("fsdp",)): (1, 256 * 4, 8),
        ("reduce-scatter", ("fsdp",)): (1, 256 * 256 * 4 // 8, 8),
    }
    assert plan.overstated_bytes == 256 * 256 * 4 + 64  # the sliced element only


def test_bf16_values_the_cpu_widens_count_at_bf16():
    mesh = abstract_mesh((8,), ("fsdp",))
    n = 512
    w = st.Partitioned(jax.ShapeDtypeStruct((n, n), jnp.float32), ("fsdp", None))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, n), jnp.bfloat16), ("fsdp", None))

    def step(w, x):
        def loss(w):
            return jnp.mean((x.value @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

        return st.replace_boxed(w, w.value - 0.1 * jax.grad(loss)(w.value))

    plan = st.preflight(step, w, x, mesh=mesh, donate_argnums=0)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    assert sum(c.bytes for c in gathers) == n * n * 2 * sum(c.count for c in gathers)
    assert any("program's width" in flag for flag in plan.flags)


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


# --- flops ------------------------------------------------------------------------------


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


def test_a_cond_counts_its_costlier_branch_once():
    mesh = abstract_mesh((8,), ("data",))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    p = jax.ShapeDtypeStruct((), jnp.int32)

    def step(x, w, p):
        two = lambda: jnp.sum(x.value @ w @ w)  # noqa: E731
        one = lambda: jnp.sum(x.value @ w)  # noqa: E731
        return jax.lax.cond(p > 0, two, one)

    plan = st.preflight(step, x, w, p, mesh=mesh)
    assert plan.flops == 2 * (2 * 64 * 256 * 256) // 8
    assert [(c.kind, c.count) for c in plan.collectives] == [("all-reduce", 1)]


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


# --- the CPU estimate's volumes against the closed forms, in f32 and bf16 -------------

CF_D, CF_B, CF_L = 256, 64, 2  # width, batch, layers (two D x D weights a layer)
CLOSED_FORM_RULES = {
    "fsdp": [("batch", "d"), ("embed", "d"), ("mlp", None), ("layers", None)],
    "megatron": [("batch", None), ("embed", None), ("mlp", "d"), ("layers", None)],
    "data-parallel": [("batch", "d"), ("embed", None), ("mlp", None), ("layers", None)],
}


def closed_form_step(layout, dtype):
    def box(names):
        return st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((CF_L, CF_D, CF_D), dtype), ("layers", *names)
        )

    params = {"w1": box(("embed", "mlp")), "w2": box(("mlp", "embed"))}
    x = st.LogicallyPartitioned(jax.ShapeDtypeStruct((CF_B, CF_D), dtype), ("batch", None))

    def step(p, x):
        def loss(p):
            def layer(h, w):
                return jnp.tanh(h @ w["w1"]) @ w["w2"], None

            h, _ = jax.lax.scan(layer, x.value, st.unbox(p))
            return jnp.mean(h.astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(p)
        return jax.tree.map(lambda w, g: w - g, p, grads)

    mesh = abstract_mesh((8,), ("d",))
    rules = CLOSED_FORM_RULES[layout]
    return st.preflight(step, params, x, mesh=mesh, rules=rules, donate_argnums=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", list(CLOSED_FORM_RULES))
def test_the_cpu_estimates_volumes_are_the_closed_forms(layout, dtype):
    w = jnp.dtype(dtype).itemsize  # the program's width: bf16 counts at 2 bytes
    weight, weights = CF_D * CF_D * w, 2 * CF_L  # one D x D weight; four in all
    by_kind = {}
    for c in closed_form_step(layout, dtype).collectives:
        assert c.axes == ("d",) and c.group == 8
        count, size = by_kind.get(c.kind, (0, 0))
        by_kind[c.kind] = (count + c.count, size + c.bytes)
    if layout == "fsdp":
        # each weight gathered whole (forward, and again for the backward where the
        # compiler does not keep it); each gradient reduce-scattered to its 1/8 shard
        gathers, gathered = by_kind.pop("all-gather")
        assert gathers in (weights, 2 * weights) and gathered == gathers * weight
        assert by_kind.pop("reduce-scatter")[1] == weights * weight // 8
    elif layout == "megatron":
        # one all-reduce of the (batch, D) activations per layer forward, one backward
        assert by_kind.pop("all-reduce") == (2 * CF_L, 2 * CF_L * CF_B * CF_D * w)
    else:
        # the whole gradient all-reduced, however the compiler combines it
        assert by_kind.pop("all-reduce")[1] == weights * weight
    assert by_kind == {}  # and nothing else moves


def test_a_custom_call_that_only_allocates_a_buffer_runs_no_kernel():
    # XLA's AllocateBuffer (new in 0.8: 0.7 timed its result as memory traffic)
    # Private: the schedule's reader and its records have no public names
    from spmdtree._src.step.hlo.schedule import Kernel, read_schedule

    text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %buffer = f32[1024,1024]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %sum = f32[1024,1024]{1,0} add(%p, %buffer)
}
"""
    kernels = [e for e in read_schedule(text, platform="tpu").events if isinstance(e, Kernel)]
    assert [k.name for k in kernels] == ["sum"]


def test_an_op_run_asynchronously_is_timed_once_under_its_dones_name():
    # a device's profile times an async op's start at about 0 and its done with the
    # op's time (new in 0.8: 0.7 named the kernel after the op it wraps, which no
    # profile event has); a slice or copy is the DMA engines' (tests/test_copies.py)
    # Private: the schedule's reader and its records have no public names
    from spmdtree._src.step.hlo.schedule import Kernel, read_schedule

    text = """HloModule m, is_scheduled=true

%wrapped (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  ROOT %exp.7 = f32[1024,1024]{1,0} exponential(%a)
}

ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %exp-start = ((f32[1024,1024]{1,0}), f32[1024,1024]{1,0}, s32[]) async-start(%p), calls=%wrapped
  ROOT %exp-done = f32[1024,1024]{1,0} async-done(%exp-start)
}
"""
    kernels = [e for e in read_schedule(text, platform="tpu").events if isinstance(e, Kernel)]
    assert [(k.name, k.bytes) for k in kernels] == [("exp-done", 2 * 1024 * 1024 * 4)]
