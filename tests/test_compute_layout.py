"""The param layout and the compute layout on Explicit axes: a GPT-2-like step.

Params are stored by PARAM rules (FSDP: "embed" on "fsdp"; tensor parallelism
over heads, MLP and vocab) and brought into their compute layout inside the
step with `st.constrain(..., rules=COMPUTE)`, layer by layer inside `st.scan`.
On Explicit axes the step fails without that (JAX's own sharding error at
``x + wpe``) and trains with it, as on Auto axes; gradients come back in the
param layout, and preflight finds the all-gathers inside the layer loop.
"""

import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

AXES = ("data", "fsdp", "tensor")
PARAM = [
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
]
COMPUTE = [("embed", None) if name == "embed" else (name, axes) for name, axes in PARAM]
SMALL = {"vocab": 64, "length": 8, "embed": 32, "heads": 4, "mlp": 64, "layers": 2}


def dense(key, shape, names):
    return st.LogicallyPartitioned(jax.random.normal(key, shape) / math.sqrt(shape[0]), names)


def init(key, vocab, length, embed, heads, mlp, layers):
    def layer(key):
        k = jax.random.split(key, 4)
        return {
            "qkv": dense(k[0], (embed, 3, heads, embed // heads), ("embed", None, "heads", None)),
            "out": dense(k[1], (heads, embed // heads, embed), ("heads", None, "embed")),
            "fc": dense(k[2], (embed, mlp), ("embed", "mlp")),
            "proj": dense(k[3], (mlp, embed), ("mlp", "embed")),
        }

    k = jax.random.split(key, 3)
    return {
        "wte": dense(k[0], (vocab, embed), ("vocab", "embed")),
        "wpe": dense(k[1], (length, embed), (None, "embed")),
        "h": st.vmap(layer, partition_name="layers")(jax.random.split(k[2], layers)),
    }


def out_sharding(shape):
    """A (batch, length, embed) result's spec on Explicit axes; None on Auto ones."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in mesh.axis_types:
        return None
    return st.logical_to_mesh_axes(("batch", None, "embed"), COMPUTE, shape=shape, mesh=mesh)


def block(x, layer, compute):
    p = st.unbox(st.constrain(layer, rules=COMPUTE) if compute else layer)
    q, k, v = jnp.einsum("ble,ethd->tblhd", x, p["qkv"])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    scores = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]), -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
    x = x + jnp.einsum("blhd,hde->ble", a, p["out"], out_sharding=out_sharding(x.shape))
    h = jax.nn.gelu(jnp.einsum("ble,em->blm", x, p["fc"]))
    return x + jnp.einsum("blm,me->ble", h, p["proj"], out_sharding=out_sharding(x.shape)), None


def loss_fn(params, tokens, compute=True):
    tables = {k: params[k] for k in ("wte", "wpe")}
    tables = st.unbox(st.constrain(tables, rules=COMPUTE) if compute else tables)
    wte = tables["wte"]
    inputs = jax.nn.one_hot(tokens[:, :-1], wte.shape[0])
    x = jnp.einsum(
        "blv,ve->ble", inputs, wte, out_sharding=out_sharding((*inputs.shape[:2], wte.shape[1]))
    )
    x = x + tables["wpe"][None, : x.shape[1]]  # JAX refuses this without the compute layout
    layer = jax.checkpoint(partial(block, compute=compute))  # gathered again for the gradient
    x, _ = st.scan(layer, x, params["h"], partition_name="layers")
    log_probs = jax.nn.log_softmax(jnp.einsum("ble,ve->blv", x, wte) / math.sqrt(x.shape[-1]))
    return -jnp.mean(jnp.sum(log_probs * jax.nn.one_hot(tokens[:, 1:], wte.shape[0]), -1))


def step(params, tokens, compute=True):
    loss, grads = jax.value_and_grad(partial(loss_fn, compute=compute))(params, tokens)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), grads, loss


def mesh_of(kind):
    return jax.make_mesh((2, 2, 2), AXES, axis_types=(kind,) * 3)


def tokens_on(mesh):
    return NamedSharding(mesh, P(("data", "fsdp")))


@functools.cache
def initial():
    return jax.jit(partial(init, **SMALL))(jax.random.key(0))


def train(mesh, steps):
    """(losses, last params, last grads) of `steps` steps on a fixed batch."""
    params = st.shard(initial(), mesh, PARAM)  # the same initial params on either mesh
    tokens = jax.random.randint(jax.random.key(1), (8, SMALL["length"] + 1), 0, 64)
    tokens = jax.device_put(tokens, tokens_on(mesh))
    with jax.set_mesh(mesh):
        run = jax.jit(step)
        losses = []
        for _ in range(steps):
            params, grads, loss = run(params, tokens)
            losses.append(float(loss))
    return losses, params, grads


def test_explicit_axes_refuse_the_step_without_the_compute_layout():
    mesh = mesh_of(AxisType.Explicit)
    params = st.to_abstract(jax.eval_shape(partial(init, **SMALL), jax.random.key(0)), mesh, PARAM)
    tokens = jax.ShapeDtypeStruct((8, SMALL["length"] + 1), jnp.int32, sharding=tokens_on(mesh))
    with jax.set_mesh(mesh), pytest.raises(Exception, match="illegally sharded") as info:
        jax.eval_shape(partial(step, compute=False), params, tokens)
    assert type(info.value).__name__ == "ShardingTypeError"
    assert "add operation" in str(info.value)


def test_the_compute_layout_trains_on_explicit_axes_as_on_auto_ones():
    explicit, params, grads = train(mesh_of(AxisType.Explicit), 5)
    auto, _, _ = train(mesh_of(AxisType.Auto), 5)
    np.testing.assert_allclose(explicit, auto, rtol=1e-4)
    assert explicit[-1] < explicit[0]
    stored = st.to_sharding(params, mesh_of(AxisType.Explicit), PARAM)
    for tree in (params, grads):  # both in the param layout: FSDP shards, not gathered
        for want, x in zip(jax.tree.leaves(stored), jax.tree.leaves(st.unbox(tree)), strict=True):
            assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding.spec, want.spec)
            assert jax.typeof(x).sharding.spec == want.spec  # the type says so too
    assert "fsdp" in str(grads["h"]["fc"].value.sharding.spec)


def layer_bytes(sizes):
    """One layer's weights, gathered over fsdp (still split over tensor), on one device."""
    e, m = sizes["embed"], sizes["mlp"]
    return (3 * e * e + e * e + 2 * e * m) * 4 // 2


def preflight(layers):
    """The step's plan on an Explicit AbstractMesh, for weights that outweigh activations."""
    sizes = {**SMALL, "embed": 128, "mlp": 512, "layers": layers}
    mesh = jax.sharding.AbstractMesh((2, 2, 2), AXES, axis_types=(AxisType.Explicit,) * 3)
    params = jax.eval_shape(partial(init, **sizes), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, sizes["length"] + 1), jnp.int32, sharding=tokens_on(mesh))
    return st.preflight(step, params, tokens, mesh=mesh, rules=PARAM), layer_bytes(sizes)


def test_preflight_finds_the_all_gathers_inside_the_layer_loop():
    (two, per_layer), (four, _) = preflight(2), preflight(4)
    gathers = [{c.kind: c for c in plan.collectives}["all-gather"] for plan in (two, four)]
    # Two more layers: each of their 4 weights gathered in the forward pass and again
    # for the gradient (the layer is checkpointed), each time one layer's worth.
    assert gathers[1].count - gathers[0].count >= 2 * 4 * 2
    assert gathers[1].bytes - gathers[0].bytes >= 2 * 2 * per_layer
    # ... and not held for the backward pass: two more layers cost less than one
    # layer's gathered weights in temporaries.
    assert four.temp_bytes - two.temp_bytes < per_layer
