"""Reading the step as the GPU's and the TPU's own compilers write it, without either
accelerator: `st.preflight` on a `Mesh` over XLA GPU's or libtpu's topology devices.

FLOPs equal the jaxpr's dot count (per device), plain and rematerialised; a TPU
scan's collectives count per layer; async pairs count once, at their results'
bytes; a conditional counts its costlier branch. Skipped where the compiler is
not installed (`jax-cuda12-plugin` / `libtpu`).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from jaxprs import jaxpr_flops

import spmdtree as st

# neither compiler needs its device: no driver to check, no metadata server to ask
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# libtpu locks /tmp/libtpu_lockfile for one process at a time unless told otherwise
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

#: An H100 SXM as XLA's GPU target description reads it (for these tests only).
H100 = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 85045477376
  shared_memory_per_block_optin: 232448 registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def _gpu_devices():
    pytest.importorskip("jax_plugins.xla_cuda12")
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x8")
    return topology.devices


def _tpu_devices():
    pytest.importorskip("libtpu")
    return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2").devices


@pytest.fixture(params=["gpu", "tpu"], scope="module")
def devices(request):
    return _gpu_devices() if request.param == "gpu" else _tpu_devices()


def mesh_of(devices, shape, names):
    return Mesh(np.array(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def rows(step):
    return {(c.kind, c.axes): (c.count, c.bytes, c.group) for c in step.collectives}


def _decoder(remat, vocab=512, d=128, layers=2, length=128, batch=8, heads=4):
    """A small bf16 decoder's training step (f32 weights, data parallel over 8)."""
    shapes = {"embed": (vocab, d), "unembed": (d, vocab)}
    for i in range(layers):
        shapes |= {f"{i}/{n}": (d, d) for n in "qkvo"}
        shapes |= {f"{i}/up": (d, 4 * d), f"{i}/down": (4 * d, d)}

    def block(p, h, i):
        b, s, _ = h.shape
        w = {k: v.astype(jnp.bfloat16) for k, v in p.items() if k.startswith(f"{i}/")}
        q, k, v = (
            jnp.einsum("bsd,de->bse", h, w[f"{i}/{n}"]).reshape(b, s, heads, d // heads)
            for n in "qkv"
        )
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att.astype(jnp.bfloat16), v).reshape(b, s, d)
        h = h + o @ w[f"{i}/o"]
        return h + jax.nn.relu(h @ w[f"{i}/up"]) @ w[f"{i}/down"]

    def loss(p, tokens):
        h = jnp.take(p["embed"], tokens, axis=0).astype(jnp.bfloat16)
        for i in range(layers):
            layer = (
                (lambda p, h, i=i: block(p, h, i))
                if not remat
                else jax.checkpoint(lambda p, h, i=i: block(p, h, i))
            )
            h = layer(p, h)
        logits = (h @ p["unembed"].astype(jnp.bfloat16)).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens.value)
        return jax.tree.map(lambda v, g: v - 0.1 * g, params, grads)

    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    tokens = st.Partitioned(jax.ShapeDtypeStruct((batch, length), jnp.int32), ("data", None))
    return step, params, tokens


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_flops_are_the_jaxprs_dots(devices, remat):
    step, params, tokens = _decoder(remat)
    plan = st.preflight(step, params, tokens, mesh=mesh_of(devices, (8,), ("data",)))
    asked = jaxpr_flops(jax.make_jaxpr(step)(params, tokens).jaxpr) / 8
    assert abs(plan.flops / asked - 1) < 0.01
    assert plan.backend == devices[0].platform


def test_a_scanned_layer_counts_per_layer(devices):
    layers, n = 6, 256
    mesh = mesh_of(devices, (8,), ("fsdp",))
    w = st.Partitioned(jax.ShapeDtypeStruct((layers, n, n), jnp.bfloat16), (None, "fsdp", None))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, n), jnp.bfloat16), ("fsdp", None))

    def step(w, x):
        def loss(w):
            h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x.value, w)
            return jnp.mean(h.astype(jnp.float32) ** 2)

        return st.replace_boxed(w, w.value - 0.1 * jax.grad(loss)(w.value))

    plan = st.preflight(step, w, x, mesh=mesh, donate_argnums=0)
    assert not any("trip count" in flag for flag in plan.flags)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    # each layer's weights are gathered in the forward and again in the backward
    assert sum(c.count for c in gathers) == 2 * layers
    assert sum(c.bytes for c in gathers) == 2 * layers * n * n * 2
    assert plan.flops == 3 * layers * 2 * 8 * n * n


def test_async_collectives_count_once_at_their_results(devices):
    mesh = mesh_of(devices, (2, 4), ("a", "b"))
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)

    def local(x):
        gathered = jax.lax.all_gather(x, "a", axis=0, tiled=True)
        moved = jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)])
        swapped = jax.lax.all_to_all(x, "b", 0, 1, tiled=True)
        return gathered, moved, swapped

    def step(x):
        out = (P(None, "b"), P("a", "b"), P("a", "b"))
        return jax.shard_map(local, in_specs=P("a", "b"), out_specs=out, check_vma=False)(x)

    block = 32 * 32 * 2
    assert rows(st.preflight(step, x, mesh=mesh)) == {
        ("all-gather", ("a",)): (1, 2 * block, 2),
        ("collective-permute", ("b",)): (1, block, 2),
        ("all-to-all", ("b",)): (1, block, 4),
    }


def test_gathers_the_compiler_combines_count_every_element(devices):
    mesh = mesh_of(devices, (8,), ("fsdp",))
    w1, w2 = (
        st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), ("fsdp", None))
        for _ in range(2)
    )
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.bfloat16), ("fsdp", None))
    plan = st.preflight(lambda w1, w2, x: x.value @ w1.value @ w2.value, w1, w2, x, mesh=mesh)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    assert sum(c.bytes for c in gathers) == 2 * 256 * 256 * 2


def test_an_accelerators_own_sliced_reductions_are_counted_as_written(devices):
    # libtpu writes this psum_scatter as an all-reduce and a slice: what it runs
    mesh = mesh_of(devices, (8,), ("x",))

    def step(a):
        def local(a):
            return jax.lax.psum_scatter(a, "x", scatter_dimension=0, tiled=True)

        return jax.shard_map(local, in_specs=P("x"), out_specs=P("x"), check_vma=False)(a)

    plan = st.preflight(step, jax.ShapeDtypeStruct((8 * 64, 16), jnp.float32), mesh=mesh)
    assert plan.overstated_bytes == 0
    assert not any("CPU" in flag for flag in plan.flags)
    # XLA GPU: an async reduce-scatter of the (8, 16) result; libtpu: the (64, 16) whole
    scattered = {("reduce-scatter", ("x",)): (1, 8 * 16 * 4, 8)}
    assert rows(plan) in (scattered, {("all-reduce", ("x",)): (1, 64 * 16 * 4, 8)})


def test_a_cond_counts_its_costlier_branch_once(devices):
    mesh = mesh_of(devices, (8,), ("data",))
    x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)

    def step(x, w, p):
        return jax.lax.cond(p > 0, lambda: jnp.sum(x.value @ w @ w), lambda: jnp.sum(x.value @ w))

    plan = st.preflight(step, x, w, jax.ShapeDtypeStruct((), jnp.int32), mesh=mesh)
    assert plan.flops == 2 * (2 * 64 * 256 * 256) // 8
    assert [(c.kind, c.count) for c in plan.collectives] == [("all-reduce", 1)]


def test_a_convolution_counts_its_multiply_adds(devices):
    # cuDNN's forward and filter-gradient calls on GPU, convolutions on TPU
    n, size, k, c_in, c_out = 8, 16, 3, 8, 16
    mesh = mesh_of(devices, (8,), ("data",))
    x = st.Partitioned(
        jax.ShapeDtypeStruct((n, size, size, c_in), jnp.float32), ("data", None, None, None)
    )
    w = jax.ShapeDtypeStruct((k, k, c_in, c_out), jnp.float32)

    def loss(w, x):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(y**2)

    plan = st.preflight(lambda w, x: jax.grad(loss)(w, x.value), w, x, mesh=mesh)
    out = size - k + 1
    multiply_adds = (n // 8) * out * out * c_out * k * k * c_in
    # the forward, and the filter's gradient: exactly, as cuDNN's calls say; libtpu lays
    # the 14 output columns on 16 and computes those too (what its program runs)
    if devices[0].platform == "gpu":
        assert plan.flops == 2 * 2 * multiply_adds
    else:
        assert 2 * 2 * multiply_adds <= plan.flops <= 2 * 2 * multiply_adds * 16 // 14


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_the_cpu_estimate_counts_this_decoders_dots_as_the_accelerators_do(remat):
    # no compiler needed: the CPU estimate keeps the remat barriers, so CSE cannot
    # fold the recomputed projections into the forward (0.3 read 5% fewer here)
    step, params, tokens = _decoder(remat)
    mesh = jax.sharding.AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    plan = st.preflight(step, params, tokens, mesh=mesh)
    asked = jaxpr_flops(jax.make_jaxpr(step)(params, tokens).jaxpr) / 8
    assert plan.backend == "cpu"
    assert abs(plan.flops / asked - 1) < 0.01


def test_libtpus_fsdp_gradient_reductions_count_as_reduce_scatters():
    # libtpu writes each gradient's reduction over fsdp as an all-reduce-scatter
    # fusion (an all-reduce of which each device keeps its shard): a reduce-scatter
    # of the whole gradient, sending B (N-1)/N per device (the scaling book's volume),
    # half what 0.4 counted it as (an all-reduce: 2 B (N-1)/N)
    d, fsdp = 1024, 4
    mesh = mesh_of(_tpu_devices(), (2, fsdp), ("data", "fsdp"))
    w1, w2 = (
        st.Partitioned(jax.ShapeDtypeStruct((d, d), jnp.float32), ("fsdp", None)) for _ in "12"
    )
    x = st.Partitioned(jax.ShapeDtypeStruct((256, d), jnp.float32), (("data", "fsdp"), None))

    def step(w1, w2, x):
        def loss(w1, w2):
            return jnp.mean((jnp.tanh(x.value @ w1.value) @ w2.value) ** 2)

        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return [st.replace_boxed(w, w.value - 0.1 * g.value) for w, g in ((w1, g1), (w2, g2))]

    plan = st.preflight(step, w1, w2, x, mesh=mesh)
    gradient = d * d * 4
    scattered = [c for c in plan.collectives if c.kind == "reduce-scatter"]
    assert [(c.axes, c.group, c.written_as) for c in scattered] == [
        (("fsdp",), fsdp, "all-reduce-scatter")
    ]
    assert scattered[0].count == 2
    assert scattered[0].bytes == 2 * gradient // fsdp  # each device's shard of both
    assert scattered[0].wire_bytes == 2 * gradient * (fsdp - 1) // fsdp
    # no gradient counted again as an all-reduce over fsdp
    assert not [c for c in plan.collectives if c.kind == "all-reduce" and "fsdp" in c.axes]


def test_libtpu_runs_calibrates_sum_as_kernels_that_only_read_hbm():
    # st.calibrate measures read_efficiency (new in 0.8) by a sum over an array's rows:
    # libtpu reads the array from HBM and writes one row, so the kernels it times read only
    _tpu_devices()
    # Private: calibrate's sum has no public name
    from spmdtree._src.step.measure.calibrate import ELEMENTS, READ_ROW

    elements = ELEMENTS["accelerator"]
    plan = st.preflight(
        lambda x: jnp.sum(x, axis=0),
        jax.ShapeDtypeStruct((elements // READ_ROW, READ_ROW), jnp.float32),
        mesh=jax.sharding.AbstractMesh((1,), ("data",)),
        target="tpu-v5e",
    )
    kernels = [k for k in plan.schedule.kernels() if k.bytes]
    assert kernels and all(k.reads_only for k in kernels)
    assert sum(k.bytes for k in kernels) >= elements * 4


def test_libtpu_keeps_calibrates_chain_in_the_chips_own_memory():
    # st.calibrate times the chip's own memory (on_chip_bytes_per_second, new in 0.8)
    # by the copies of its chain into another layout that read and write only there:
    # libtpu must keep some there, and each moves its array's bytes in and out
    _tpu_devices()
    # Private: calibrate's chain and what it times of it have no public names
    from spmdtree._src.step.measure.calibrate import ON_CHIP, _chain, _on_chip_copy

    (rows, cols), passes = ON_CHIP
    x = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    plan = st.preflight(
        lambda x: _chain(x, passes),
        x,
        mesh=jax.sharding.AbstractMesh((1,), ("data",)),
        target="tpu-v5e",
    )
    kernels = list(plan.schedule.kernels())
    kept = [k for k in kernels if _on_chip_copy(k)]
    assert kept
    assert all(k.on_chip == 2 * rows * cols * 4 and k.opcode == "copy" for k in kept)
    # its elementwise passes are kept there too, but not timed for the figure
    assert any(not k.bytes and k.on_chip and not _on_chip_copy(k) for k in kernels)
    # the chain's ends read the argument from HBM and write the result there
    assert any(k.bytes for k in kernels)
