"""advise on flax's own Gemma (flax.nnx), as flax's examples/gemma writes and shards it
(issue 49): tests/thirdparty/flax_gemma, verbatim, in a small config.

The model annotates its params with mesh axes (its `ShardingConfig.fsdp_tp_sharding`
over ``fsdp`` and ``tensor``, as its train.py builds it) and its activations with
``out_sharding=``, and its recipe splits the batch over ``fsdp`` alone
(`configs/default.py`: ``data_sharding = ('fsdp',)``). A search that adds a ``data``
axis finds layouts whose devices repeat each other's work: advise says so, naming the
axis and the specs to change (the model names mesh axes, not logical names), ranks
them after the layout that splits the work, and shows tokens/s at the predicted time.
The step is written as the recipe's `jax_train_step` writes it: the padding mask, the
positions and causal mask from it, the model rebuilt by `nnx.merge`, cross-entropy
from one-hot targets and `log_softmax`; SGD in place of the recipe's adamw.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import spmdtree as st

HERE = pathlib.Path(__file__).resolve().parent / "thirdparty" / "flax_gemma"
#: The example's own modules import each other by their bare names.
MODULES = (
    "transformer",
    "transformer_cfg",
    "modules",
    "layers",
    "positional_embeddings",
    "sow_lib",
    "helpers",
    "params",
)
AXES = ("data", "fsdp", "tensor")
BATCH, LENGTH = 16, 64


@contextlib.contextmanager
def _bare_names():
    """The example's folder on sys.path while it imports, its bare module names taken
    back out of sys.modules after (so no other test's ``layers`` or ``params`` is it)."""
    kept = {name: sys.modules.pop(name) for name in MODULES if name in sys.modules}
    sys.path.insert(0, str(HERE))
    try:
        yield
    finally:
        sys.path.remove(str(HERE))
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(kept)


@functools.cache
def example():
    """The example's `transformer` and `transformer_cfg` modules, imported when a test
    first asks (a flax that breaks them fails these tests, not the suite's collection)."""
    with _bare_names():
        import transformer
        import transformer_cfg
    return transformer, transformer_cfg


def config():
    """Gemma 3 1B's config (its sliding and global attention, QK norm, tied logits),
    small, sharded as the example's train.py shards it."""
    _, cfg = example()
    return cfg.TransformerConfig.gemma3_1b(
        num_layers=2,
        num_embed=512,
        embed_dim=128,
        hidden_dim=512,
        num_heads=4,
        head_dim=32,
        num_kv_heads=1,
        sliding_window_size=32,
        attention_types=cfg.make_attention_layers_types(cfg.GEMMA3_ATTENTION_PATTERN, 2),
        shd_config=cfg.ShardingConfig.fsdp_tp_sharding(
            fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor"
        ),
    )


@functools.cache
def abstract_model():
    """The model's graph, its params as spmdtree boxes and its other state, nothing
    allocated (docs/flax.md, "flax.nnx")."""
    gemma, _ = example()
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: gemma.Transformer(config(), rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, st.from_flax(params), rest


def loss(params, inputs, targets):
    gemma, _ = example()
    graphdef, _, rest = abstract_model()
    input_mask = inputs > 0
    positions = gemma.build_positions_from_mask(input_mask)
    attention_mask = gemma.make_causal_attn_mask(input_mask)
    module = nnx.merge(graphdef, params, rest)
    logits, _ = module(inputs, positions=positions, cache=None, attention_mask=attention_mask)
    labels = jax.nn.one_hot(targets, logits.shape[-1])
    return -jnp.sum(labels * nnx.log_softmax(logits.astype(jnp.float32)), axis=-1).mean()


def train_step(params, tokens):
    params, tokens = st.unbox(params), tokens.value
    value, grads = jax.value_and_grad(loss)(params, tokens[:, :-1], tokens[:, 1:])
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value


def make_step(candidate):
    """The step, its params, and the batch over fsdp alone (the recipe's data_sharding)."""
    tokens = st.Partitioned(
        jax.ShapeDtypeStruct((candidate.batch, LENGTH + 1), jnp.int32), ("fsdp", None)
    )
    return train_step, (abstract_model()[1], tokens), {}


def model_flops_per_device(devices):
    """The oracle: the model's matmuls per token (q; k and v of its one kv head; the
    scores and their product with v over the whole length, the sliding window being a
    mask; the output; the gated MLP's three; the tied logits), forward and twice
    backward, over the batch's tokens split over `devices`."""
    c = config()
    layer = 2 * c.embed_dim * c.num_heads * c.head_dim * 2  # q and the output
    layer += 2 * c.embed_dim * 2 * c.num_kv_heads * c.head_dim  # k and v
    layer += 2 * 2 * LENGTH * c.num_heads * c.head_dim  # scores, and their product with v
    layer += 3 * 2 * c.embed_dim * c.hidden_dim  # gate, up, down
    forward = c.num_layers * layer + 2 * c.embed_dim * c.num_embed
    return 3 * forward * BATCH * LENGTH // devices


@pytest.fixture(scope="module")
def advice():
    layouts = st.layouts(8, AXES, sizes={"tensor": 1}, axis_types=AxisType.Explicit)
    candidates = [st.Candidate(mesh, None, BATCH, length=LENGTH) for mesh in layouts]
    return st.advise(
        make_step, candidates, hardware=st.hardware("h100"), progress=False, screen="cpu"
    )


def test_flax_gemma_advised_says_data_repeats_the_work_and_ranks_it_after(advice):
    data = [dict(row.candidate.mesh.shape)["data"] for row in advice.rows]
    assert sorted(data) == [1, 2, 4, 8] and data[0] == 1, data
    splits, *repeats = advice.rows
    assert splits.verdict == "fits"
    assert splits.step.flops == pytest.approx(model_flops_per_device(8), rel=0.01)
    assert not [f for f in splits.flags if "repeat each other's work" in f]
    for row in repeats:
        copies = dict(row.candidate.mesh.shape)["data"]
        assert row.step.flops >= 1.5 * splits.step.flops
        (said,) = [f for f in row.flags if "repeat each other's work" in f]
        assert said.startswith(f"devices repeat each other's work along data ({copies}):")
        # the model names mesh axes: the fix is in its specs and out_sharding=, not a rule
        assert "out_sharding=" in said and "its rule" not in said
    # among themselves, the repeating rows rank by their predicted time per sequence
    times = [row.time.predicted_seconds for row in repeats]
    assert times == sorted(times)
    assert "repeat each other's work along data" in str(advice)


def test_flax_gemma_rows_show_tokens_per_second_at_the_predicted_time(advice):
    for row in advice.rows:
        assert row.tokens_per_second == pytest.approx(BATCH * LENGTH / row.time.predicted_seconds)


def test_flax_gemma_on_auto_axes_is_told_to_use_explicit_axes():
    mesh = AbstractMesh((1, 8, 1), AXES, axis_types=(AxisType.Auto,) * 3)
    fn, args, kwargs = make_step(st.Candidate(mesh, None, BATCH, length=LENGTH))
    with pytest.raises(ValueError) as caught:
        st.preflight(fn, *args, mesh=mesh, **kwargs)
    said = str(caught.value)
    assert said.startswith("preflight: the step does not trace with its arguments")
    # preflight's own fix, after jax's message
    assert "by out_sharding=, which needs Explicit mesh axes" in said
    assert "st.layouts(devices, names, axis_types=AxisType.Explicit)" in said
