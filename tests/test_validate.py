"""benchmarks/validate.py's blocked attention computes causal grouped-query attention,
and its MaxText runs' flash kernels run as their recipes ran them: the validation's
figures are a prediction of those steps, so the steps must be right."""

import dataclasses
import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from test_targets import has_compiler

import spmdtree as st

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "validate.py"
_SPEC = importlib.util.spec_from_file_location("validate_benchmark", _PATH)
validate = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = validate  # its dataclasses look their module up
_SPEC.loader.exec_module(validate)


def reference(q, k, v):
    """Causal grouped-query attention, the whole score matrix at once."""
    n, d = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / math.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize(
    ("length", "group", "block"),
    [(64, 3, 16), (32, 1, 8), (16, 2, 16)],
    ids=["grouped", "one head per kv head", "one block pair"],
)
def test_blocked_attention_and_its_gradients_are_causal_attention(length, group, block):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, length, 2, group, 8))
    k, v = (jax.random.normal(key, (2, length, 2, 8)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * cotangent)

    def blocked(q, k, v):
        return validate.blocked_attention(q, k, v, block)

    np.testing.assert_allclose(blocked(q, k, v), reference(q, k, v), atol=1e-5)
    got = jax.grad(loss(blocked), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), (0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"d{name}")


def test_a_masked_out_key_changes_nothing_before_it():
    """Causality: the outputs at positions before a changed key and value do not move."""
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, 32, 1, 2, 8))
    k, v = (jax.random.normal(key, (1, 32, 1, 8)) for key in keys[1:])
    before = validate.blocked_attention(q, k, v, 8)
    after = validate.blocked_attention(q, k.at[:, 20].add(5.0), v.at[:, 20].add(5.0), 8)
    np.testing.assert_array_equal(before[:, :20], after[:, :20])
    assert not np.allclose(before[:, 20:], after[:, 20:])


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
def test_maxtexts_flash_kernels_run_as_their_recipes_ran_them():
    """The MaxText runs' attention is jax's Pallas TPU flash attention as each recipe
    ran it: 2023-10's not causal (every block pair), 2023-12's causal (at 1,024
    tokens in blocks of 512, three of the four pairs), its dQ in blocks of 1,024
    queries, which no causal block skips."""
    import optax

    flops = {}
    for recipe in validate.FLASH_RECIPES:
        model = dataclasses.replace(validate.TINY_MAXTEXT, length=1024, flash=recipe)
        params = model.params()
        state = jax.eval_shape(optax.adamw(1e-4).init, params)
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((8, model.length + 1), jnp.int32), ("batch", "length")
        )
        mesh = jax.sharding.AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
        plan = st.preflight(
            model.train_step, params, state, tokens, mesh=mesh, rules=validate.RULES,
            target="tpu-v5e", donate_argnums=(0, 1),
        )  # fmt: skip
        kernels = [k for k in plan.schedule.kernels() if k.flash]
        assert {k.flash for k in kernels} == {"forward", "backward"}
        flops[recipe] = {k.call.split("_block")[0]: k.flops for k in kernels}
    whole, causal = flops["maxtext-2023-10"], flops["maxtext-2023-12"]
    assert set(whole) == set(causal) == {"flash_attention", "flash_mha_bwd_dq", "flash_mha_bwd_dkv"}
    for kernel in ("flash_attention", "flash_mha_bwd_dkv"):  # the matmuls' 3 of 4, and
        assert causal[kernel] == pytest.approx(0.75 * whole[kernel], rel=0.01)  # the rest
    assert causal["flash_mha_bwd_dq"] == whole["flash_mha_bwd_dq"]


def test_the_mixtral_steps_experts_are_their_top_k_mixture():
    # MaxText's dropping path (new in 0.8): with room for every token, each token's
    # output is its top-2 experts' SwiGLU outputs weighted by the top-2's softmax
    model = dataclasses.replace(validate.TINY_LLAMA, experts=4, capacity_factor=2.0)
    keys = jax.random.split(jax.random.key(0), 5)
    e, m, n = 16, 32, model.experts
    p = {
        "gate": jax.random.normal(keys[0], (e, n)),
        "wi_0": jax.random.normal(keys[1], (n, e, m)) / 4,
        "wi_1": jax.random.normal(keys[2], (n, e, m)) / 4,
        "wo": jax.random.normal(keys[3], (n, m, e)) / 4,
    }
    h = jax.random.normal(keys[4], (2, 8, e))
    top, chosen = jax.lax.top_k(h @ p["gate"], 2)
    weights = jax.nn.softmax(top, axis=-1)
    experts = [(jax.nn.silu(h @ p["wi_0"][i]) * (h @ p["wi_1"][i])) @ p["wo"][i] for i in range(n)]
    want = sum(
        jnp.where(chosen[..., j, None] == i, weights[..., j, None] * experts[i], 0.0)
        for i in range(n)
        for j in range(2)
    )
    np.testing.assert_allclose(model.mixture(h, p), want, rtol=1e-5, atol=1e-5)
    # with no room, every token is dropped and the mixture adds nothing
    none = dataclasses.replace(model, capacity_factor=0.01)
    np.testing.assert_array_equal(none.mixture(h, p), jnp.zeros_like(h))
