"""benchmarks/validate.py's blocked attention computes causal grouped-query attention:
the validation's figures are a prediction of that step, so the step must be right."""

import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
