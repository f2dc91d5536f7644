"""Attention over a sharded sequence (0.8): `st.context_attention` equals
`jax.nn.dot_product_attention` on the unsharded arrays (values and gradients), on
Explicit and Auto axes, its tokens permuted by `st.balanced_order` too; it gathers K and
V along the context axis alone; its bad inputs are each an error that names the numbers
and the fix; the splash kernel runs in Pallas's interpreter, and the TPU and GPU kernels
compile for their targets without the chips."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hs
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_targets import has_compiler, has_module

import spmdtree as st

# Private: the attention with the splash kernel in Pallas's interpreter, as a CPU runs it
from spmdtree._src.sequences import _attention

B, L, H, KV, D = 4, 32, 8, 2, 8  # grouped-query: 8 q heads share 2 K/V heads
KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
LAYOUTS = {"context8": {"context": 8}, "data2-context4": {"data": 2, "context": 4}}
CASES = [(kind, layout) for kind in KINDS for layout in LAYOUTS]


def make_mesh(layout="data2-context4", kind="explicit", devices=None):
    axes = LAYOUTS[layout] if isinstance(layout, str) else layout
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        axis_types=(KINDS[kind],) * len(axes),
        devices=devices,
    )


def arrays(kv_heads=KV, length=L, heads=H, width=D, batch=B):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, length, heads, width), np.float32)
    k, v = (rng.standard_normal((batch, length, kv_heads, width), np.float32) for _ in "kv")
    return q, k, v


def placed(mesh, *xs):
    """The arrays on `mesh` as a context-parallel job holds them: the batch on
    ``data`` where the mesh has it, the length on ``context``."""
    spec = P("data" if "data" in mesh.axis_names else None, "context")
    return [jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]


def sum_of_squares(attention):
    return lambda q, k, v: jnp.sum(attention(q, k, v) ** 2)


def unsplit(causal=True):
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal)


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


# --- equal to the unsharded attention -------------------------------------------------


@functools.cache
def computed(kind, layout):
    """What the equality tests compare, in one program per mesh (one compile): the
    causal and full attention and the causal one's gradients, of the tokens in order
    and in `balanced_order` with their positions, and with positions that change
    nothing (traced ones in order; any for full attention)."""
    mesh = make_mesh(layout, kind)
    order = st.balanced_order(L, mesh.shape["context"])

    def everything(q, k, v, permuted, in_order):
        balanced = functools.partial(st.context_attention, positions=order)
        return {
            "causal": st.context_attention(q, k, v),
            "full": st.context_attention(q, k, v, causal=False),
            "gradients": jax.grad(sum_of_squares(st.context_attention), (0, 1, 2))(q, k, v),
            "balanced": balanced(*permuted),
            "balanced gradients": jax.grad(sum_of_squares(balanced), (0, 1, 2))(*permuted),
            "traced positions": st.context_attention(q, k, v, positions=in_order),
            "full, positions": st.context_attention(q, k, v, causal=False, positions=order),
        }

    q, k, v = arrays()
    with jax.set_mesh(mesh):
        permuted = placed(mesh, q[:, order], k[:, order], v[:, order])
        return jax.jit(everything)(*placed(mesh, q, k, v), permuted, jnp.arange(L)), order


@functools.cache
def expected(causal=True):
    """The unsharded attention and its gradients."""
    attention = unsplit(causal)
    grads = jax.grad(sum_of_squares(attention), (0, 1, 2))
    return jax.jit(lambda *xs: (attention(*xs), grads(*xs)))(*arrays())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_it_equals_dot_product_attention_and_stays_on_the_context_axis(kind, layout, causal):
    out = computed(kind, layout)[0]["causal" if causal else "full"]
    close(out, expected(causal)[0])
    assert out.shape == (B, L, H, D) and out.dtype == jnp.float32
    spec = (*tuple(out.sharding.spec), None, None)
    assert spec[:2] == (("data" if "data" in layout else None), "context")


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_its_gradients_equal_those_of_dot_product_attention(kind, layout):
    close(computed(kind, layout)[0]["gradients"], expected()[1])


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_tokens_in_balanced_order_with_their_positions_give_the_attention_permuted(kind, layout):
    got, order = computed(kind, layout)
    out, grads = expected()
    close(got["balanced"], out[:, order])
    close(got["balanced gradients"], [g[:, order] for g in grads])


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_positions_that_change_nothing_change_nothing(kind, layout):
    got = computed(kind, layout)[0]
    close(got["traced positions"], got["causal"])  # in order: a token's index
    close(got["full, positions"], got["full"])  # full attention reads no position


def test_every_grouping_of_heads_equals_dot_product_attention():
    mesh = make_mesh()
    groupings = {name: arrays(kv_heads) for name, kv_heads in [("mha", 8), ("mqa", 1)]}
    with jax.set_mesh(mesh):
        got = jax.jit(lambda xs: {name: st.context_attention(*x) for name, x in xs.items()})(
            {name: placed(mesh, *xs) for name, xs in groupings.items()}
        )
    for name, xs in groupings.items():  # gqa: the tests above
        close(got[name], unsplit()(*xs))


@pytest.mark.parametrize("kind", KINDS)
def test_jit_of_it_equals_it_run_eagerly(kind):
    mesh = make_mesh("data2-context4", kind)
    q, k, v = placed(mesh, *arrays())
    with jax.set_mesh(mesh):
        close(computed(kind, "data2-context4")[0]["causal"], st.context_attention(q, k, v))


def test_arrays_held_otherwise_on_explicit_axes_come_back_on_the_context_axis():
    mesh = make_mesh()
    whole = [jax.device_put(x, NamedSharding(mesh, P())) for x in arrays()]
    with jax.set_mesh(mesh):
        out = jax.jit(st.context_attention)(*whole)
    close(out, expected()[0])
    assert out.sharding.spec == P(None, "context", None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_heads_on_a_tensor_axis_stay_there(kind):
    mesh = make_mesh({"data": 2, "context": 2, "tensor": 2}, kind)
    # 2 K/V heads split over the tensor axis as q's 8 are; 1, each q head's own copy
    groupings = {kv_heads: arrays(kv_heads) for kv_heads in (2, 1)}
    heads, kv = (
        NamedSharding(mesh, P("data", "context", "tensor")),
        NamedSharding(mesh, P("data", "context")),
    )
    with jax.set_mesh(mesh):
        got = jax.jit(lambda xs: {n: st.context_attention(*x) for n, x in xs.items()})(
            {
                n: [jax.device_put(q, heads), *(jax.device_put(x, kv) for x in (k, v))]
                for n, (q, k, v) in groupings.items()
            }
        )
    for n, xs in groupings.items():
        close(got[n], unsplit()(*xs))
        assert tuple(got[n].sharding.spec)[:3] == ("data", "context", "tensor")


# --- what it compiles to ----------------------------------------------------------------


def gathered(kind, gradients):
    """The collectives of the attention (or its gradients) on (data 2, context 4)."""
    mesh = AbstractMesh((2, 4), ("data", "context"), axis_types=(KINDS[kind],) * 2)
    names = ("data", "context", None, None)
    q = st.Partitioned(jax.ShapeDtypeStruct((B, L, H, D), jnp.float32), names)
    kv = st.Partitioned(jax.ShapeDtypeStruct((B, L, KV, D), jnp.float32), names)

    def step(q, k, v):
        if gradients:
            return jax.grad(sum_of_squares(st.context_attention), argnums=(0, 1, 2))(
                q.value, k.value, v.value
            )
        return st.context_attention(q.value, k.value, v.value)

    plan = st.preflight(step, q, kv, kv, mesh=mesh)
    return {(str(row.kind), row.axes): row for row in plan.collectives}


@pytest.mark.parametrize("kind", KINDS)
def test_it_all_gathers_k_and_v_over_the_context_axis_and_nothing_over_data(kind):
    shard = (B // 2) * (L // 4) * KV * D * 4  # one device's K (or V), float32
    rows = gathered(kind, gradients=False)
    assert list(rows) == [("all-gather", ("context",))]
    assert rows[("all-gather", ("context",))].bytes == 2 * 4 * shard  # K and V, whole
    # the backward pass sums dK and dV over the context axis alone: a reduce-scatter
    # where the shards run manual over every axis; an all-reduce on Auto axes
    backward = {"explicit": "reduce-scatter", "auto": "all-reduce"}[kind]
    assert set(gathered(kind, gradients=True)) == {
        ("all-gather", ("context",)),
        (backward, ("context",)),
    }


# --- st.balanced_order ------------------------------------------------------------------


def test_balanced_order_is_maxtexts_dual_chunk_swap():
    # MaxText's reorder_sequence: [0, 1, 2, 3, 4, 5, 6, 7] -> [0, 1, 6, 7, 2, 3, 4, 5]
    assert st.balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    # its reorder_causal_load_balanced: GPU0 [0, 1, 14, 15], GPU1 [4, 5, 10, 11] of 16
    # tokens over 4 GPUs in 8 chunks of 2 (its own example cuts 16 into chunks of 2)
    assert st.balanced_order(16, 4).reshape(4, 4).tolist() == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert st.balanced_order(6, 1).tolist() == list(range(6))


@given(shards=hs.integers(1, 8), chunk=hs.integers(1, 4))
def test_balanced_order_is_a_permutation_that_evens_the_causal_work(shards, chunk):
    length = 2 * shards * chunk
    order = st.balanced_order(length, shards)
    assert sorted(order.tolist()) == list(range(length))
    # each shard's queries attend position + 1 keys: the same sum on every shard
    work = (order + 1).reshape(shards, -1).sum(axis=1)
    assert (work == work[0]).all()


@pytest.mark.parametrize(
    ("args", "kind", "said"),
    [
        (
            (12, 4),
            ValueError,
            r"length is 12, which the 8 chunks of 4 shards .* multiple of 8 \(16\)",
        ),
        ((8, 0), ValueError, r"shards is 0; expected an int >= 1"),
        ((8, 2.0), TypeError, r"shards is 2.0; expected an int >= 1"),
        ((0, 2), ValueError, r"length is 0; expected an int >= 1"),
    ],
    ids=["indivisible", "no-shards", "float-shards", "empty"],
)
def test_bad_balanced_orders_are_said(args, kind, said):
    with pytest.raises(kind, match=f"^balanced_order: {said}"):
        st.balanced_order(*args)


# --- bad inputs -------------------------------------------------------------------------


def attention(*xs, mesh=None, **kwargs):
    with jax.set_mesh(mesh or make_mesh()):
        return st.context_attention(*xs, **kwargs)


def test_a_length_the_context_axis_does_not_divide_is_said_with_both_numbers():
    with pytest.raises(
        ValueError,
        match=r"^context_attention: q's length is 30, which the context axis 'context' "
        r"\(4 devices\) does not divide. Pad the sequence to a multiple of 4 \(32\)",
    ):
        attention(*arrays(length=30))


@pytest.mark.parametrize(
    ("positions", "kind", "said"),
    [
        (np.arange(31), ValueError, r"positions has shape \(31,\); expected \(32,\)"),
        (np.arange(32)[None], ValueError, r"positions has shape \(1, 32\); expected \(32,\)"),
        (np.arange(32.0), TypeError, r"positions has dtype float64; expected integers"),
    ],
    ids=["short", "2-d", "floats"],
)
def test_bad_positions_are_said(positions, kind, said):
    with pytest.raises(kind, match=f"^context_attention: {said}"):
        attention(*arrays(), positions=positions)


def test_no_mesh_or_a_mesh_without_the_axis_is_said():
    with pytest.raises(ValueError, match=r"no mesh is in context.*jax.set_mesh"):
        st.context_attention(*arrays())
    with pytest.raises(
        ValueError, match=r"the mesh in context has axes \{'data': 8\}, no context axis 'context'"
    ):
        attention(*arrays(), mesh=make_mesh({"data": 8}))
    with pytest.raises(TypeError, match=r"axis is 3; expected the context mesh axis's name"):
        attention(*arrays(), axis=3)


@pytest.mark.parametrize(
    ("shapes", "said"),
    [
        (((B, L, H, D), (B, L, 3, D), (B, L, 3, D)), r"k and v have 3 heads, which do not divide q's 8"),
        (((B, L, H, D), (B, L // 2, KV, D), (B, L // 2, KV, D)), r"the shapes disagree: q \(4, 32, 8, 8\), k \(4, 16, 2, 8\)"),
        (((B, L, H, D), (B, L, KV, D), (B, L, 1, D)), r"the shapes disagree: .* v \(4, 32, 1, 8\)"),
        (((B, L, H, D), (B, L, KV, 4), (B, L, KV, 4)), r"the shapes disagree: .*head_dim"),
        (((L, H, D), (B, L, KV, D), (B, L, KV, D)), r"q \(32, 8, 8\) is not 4-D"),
    ],
    ids=["heads", "length", "v", "head-dim", "3-d"],
)  # fmt: skip
def test_arrays_that_disagree_are_said(shapes, said):
    xs = [jnp.ones(shape) for shape in shapes]
    with pytest.raises(ValueError, match=f"^context_attention: {said}"):
        attention(*xs)


def test_mixed_dtypes_and_unknown_implementations_are_said():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"the dtypes disagree: q float32, k bfloat16"):
        attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match=r"implementation is 'flash'; expected None or 'xla'"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(
        ValueError, match=r"'cudnn' takes float16 or bfloat16 arrays .* not float32"
    ):
        attention(q, k, v, implementation="cudnn")


def test_what_the_splash_kernel_cannot_do_is_said():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"blocks of 128, and each shard holds 8"):
        attention(q, k, v, implementation="splash")
    long = arrays(length=512, batch=2, heads=2, kv_heads=1)
    with (
        pytest.raises(ValueError, match=r"positions known when tracing"),
        jax.set_mesh(make_mesh()),
    ):
        jax.jit(
            lambda q, k, v, p: st.context_attention(q, k, v, positions=p, implementation="splash")
        )(*long, jnp.arange(512))
    with pytest.raises(ValueError, match=r"positions that permute range\(512\)"):
        attention(*long, positions=np.zeros(512, int), implementation="splash")
    odd = arrays(length=512, batch=3, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match=r"on the Auto axes \{'data': 2\} it splits the batch"):
        attention(*odd, mesh=make_mesh(kind="auto"), implementation="splash")


# --- the kernels ------------------------------------------------------------------------


def test_the_splash_kernel_interpreted_equals_dot_product_attention():
    mesh = make_mesh({"data": 2, "context": 2}, devices=jax.devices()[:4])
    length, order = 256, st.balanced_order(256, 2)
    q, k, v = arrays(kv_heads=1, length=length, heads=2, width=16, batch=2)
    splash = functools.partial(_attention, axis="context", kind="splash", interpret=True)
    causal = functools.partial(splash, causal=True, positions=None)
    balanced = functools.partial(splash, causal=True, positions=order)
    full = functools.partial(splash, causal=False, positions=None)

    def everything(xs, permuted):
        return {
            "causal": causal(*xs),
            "gradients": jax.grad(sum_of_squares(causal), (0, 1, 2))(*xs),
            "balanced": balanced(*permuted),
            "balanced gradients": jax.grad(sum_of_squares(balanced), (0, 1, 2))(*permuted),
            "full": full(*xs),
        }

    with jax.set_mesh(mesh):
        permuted = placed(mesh, q[:, order], k[:, order], v[:, order])
        got = jax.jit(everything)(placed(mesh, q, k, v), permuted)
    out = unsplit()(q, k, v)
    grads = jax.grad(sum_of_squares(unsplit()), (0, 1, 2))(q, k, v)
    close(got["causal"], out)
    close(got["balanced"], out[:, order])
    close(got["full"], unsplit(False)(q, k, v))
    for got_grads, want in [
        (got["gradients"], grads),
        (got["balanced gradients"], [g[:, order] for g in grads]),
    ]:
        for x, y in zip(got_grads, want, strict=True):  # the kernel's own sums: 1e-4
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    assert got["balanced"].sharding.spec == P("data", "context", None, None)


def kernel_step(implementation, order, kind="explicit"):
    """The attention's gradients, bf16, on (data 2, context 4) axes of `kind`."""
    mesh = AbstractMesh((2, 4), ("data", "context"), axis_types=(KINDS[kind],) * 2)
    names = ("data", "context", None, None)
    q = st.Partitioned(jax.ShapeDtypeStruct((8, 1024, 8, 128), jnp.bfloat16), names)
    kv = st.Partitioned(jax.ShapeDtypeStruct((8, 1024, 2, 128), jnp.bfloat16), names)
    attend = functools.partial(st.context_attention, positions=order, implementation=implementation)

    def step(q, k, v):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q.value, k.value, v.value)

    return step, (q, kv, kv), mesh


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
@pytest.mark.parametrize("kind", KINDS)
def test_the_splash_kernel_compiles_for_a_tpu_without_one(kind):
    # on Auto axes, whose arrays' types say nothing, the kernel splits the batch over
    # them (new in 0.8: refused before)
    step, args, mesh = kernel_step("splash", st.balanced_order(1024, 4), kind)
    plan = st.preflight(step, *args, mesh=mesh, target="tpu-v5e")
    calls = {kernel.call for kernel in plan.schedule.kernels() if kernel.flash}
    assert calls == {
        "splash_mha_fwd_residuals",
        "splash_mha_dq_no_residuals",
        "splash_mha_dkv_no_residuals",
    }
    rows = {(str(row.kind), row.axes) for row in plan.collectives}
    assert rows == {("all-gather", ("context",)), ("reduce-scatter", ("context",))}


@pytest.mark.skipif(
    not (has_compiler("cuda") and has_module("nvidia.cudnn")),
    reason="needs XLA GPU and cuDNN (spmdtree[cuda])",
)
@pytest.mark.parametrize("kind", KINDS)
def test_the_cudnn_kernel_compiles_for_a_gpu_without_one(kind):
    step, args, mesh = kernel_step("cudnn", st.balanced_order(1024, 4), kind)
    plan = st.preflight(step, *args, mesh=mesh, target="h100")
    calls = {kernel.call for kernel in plan.schedule.kernels() if kernel.flash}
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= calls
    rows = {(str(row.kind), row.axes) for row in plan.collectives}
    assert rows == {("all-gather", ("context",)), ("reduce-scatter", ("context",))}
