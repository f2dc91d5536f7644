"""advise on models written elsewhere, with the target's own compiler (issue 36).

Two models nobody here wrote (tests/thirdparty): flax's lm1b TransformerLM,
verbatim, through `st.from_flax` (its params carry logical names, its
activations no constraints), and a nanoGPT-style equinox GPT, unannotated,
boxed by patterns over its abstract params (`eqx.filter_eval_shape` +
`eqx.partition`, then `st.box`). Both unroll their layers in bf16, so the CPU
estimate of their peak runs well above an accelerator's. Each test sets the
budget between the two for one layout, measured here (the XLA GPU peak from a
raw `jax.jit(...).lower().compile()` for 8 H100s in this process), and checks
that advise calls that layout "fits" on the target's figures, never "over
budget" or "may fit" on the CPU estimate's. They need `spmdtree[cuda]`
(`spmdtree[tpu]` for the libtpu one); without it they are skipped. Small
configs: two layers, width 128, 8 devices.
"""

import functools
import importlib.util
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.experimental import topologies
from jax.sharding import AbstractMesh, AxisType
from test_targets import GPU_DESCRIPTIONS
from thirdparty import eqx_gpt
from thirdparty.flax_lm1b import models as lm1b

import spmdtree as st


def has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


pytestmark = [
    pytest.mark.target,
    pytest.mark.skipif(
        not has("jax_plugins.xla_cuda12"), reason="needs pip install 'spmdtree[cuda]'"
    ),
]
needs_tpu = pytest.mark.skipif(not has("libtpu"), reason="needs pip install 'spmdtree[tpu]'")

AXES = ("data", "fsdp", "tensor")
LENGTH, BATCH, VOCAB, WIDTH, LAYERS = 256, 64, 512, 128, 2
TX = optax.adamw(1e-3)


def auto(shape):
    return AbstractMesh(shape, AXES[: len(shape)], axis_types=(AxisType.Auto,) * len(shape))


def h100_mesh(shape):
    """8 H100s (one node) without a GPU, laid out as `shape`."""
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=GPU_DESCRIPTIONS["h100"], topology="1x1x8"
    )
    names = AXES[: len(shape)]
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=topology.devices
    )


def raw_peak(fn, args, mesh, rules, params):
    """The peak of a raw `jax.jit` compile of `fn` for `mesh`'s devices, as a user
    would compile it (the option preflight gives XLA GPU without a device)."""
    with st.logical_axis_rules(rules or ()), jax.set_mesh(mesh):
        abstract = [st.to_abstract(a, mesh, params=params) for a in args]
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*abstract)
        memory = compiled.compile({"xla_gpu_enable_triton_gemm": False}).memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def cross_entropy(logits, tokens):
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# --- flax's lm1b TransformerLM, through st.from_flax ----------------------------------

LM1B = lm1b.TransformerConfig(
    vocab_size=VOCAB,
    output_vocab_size=VOCAB,
    emb_dim=WIDTH,
    num_heads=4,
    num_layers=LAYERS,
    qkv_dim=WIDTH,
    mlp_dim=4 * WIDTH,
    max_len=LENGTH,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    deterministic=True,
    dtype=jnp.bfloat16,
)
LM1B_MODEL = lm1b.TransformerLM(LM1B)
#: lm1b's own logical names (embed, mlp, kv, vocab), as a user would map them.
LM1B_RULES = [
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("kv", "tensor"),
    ("vocab", "tensor"),
]


@functools.cache
def lm1b_params():
    variables = jax.eval_shape(
        lambda: LM1B_MODEL.init(jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32))
    )
    with warnings.catch_warnings():  # flax names attention kernels short: said, and read as flax
        warnings.simplefilter("ignore", UserWarning)
        return st.from_flax(variables["params"])


def lm1b_step(params, state, tokens):
    tokens = st.unbox(tokens)
    loss = lambda p: cross_entropy(LM1B_MODEL.apply({"params": st.unbox(p)}, tokens), tokens)  # noqa: E731
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = TX.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value


def lm1b_args(batch):
    params = lm1b_params()
    tokens = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((batch, LENGTH), jnp.int32), ("batch", None)
    )
    return params, jax.eval_shape(TX.init, params), tokens


def lm1b_make_step(candidate):
    args = lm1b_args(candidate.batch)
    return lm1b_step, args, {"params": args[0], "donate_argnums": (0, 1)}


def test_lm1b_the_cpu_estimate_never_rejects_a_layout_xla_gpu_fits():
    chosen = (2, 4, 1)
    args = lm1b_args(BATCH)
    estimate = st.preflight(
        lm1b_step,
        *args,
        mesh=auto(chosen),
        rules=LM1B_RULES,
        params=args[0],
        donate_argnums=(0, 1),
    )
    gpu = raw_peak(lm1b_step, args, h100_mesh(chosen), LM1B_RULES, args[0])
    assert estimate.backend == "cpu" and estimate.peak_bytes > 1.2 * gpu, (
        "the unrolled bf16 model's CPU estimate runs high",
        estimate.peak_bytes,
        gpu,
    )
    budget = (estimate.peak_bytes + gpu) // 2  # over on the estimate, under on the target
    # screened on the CPU estimate: a row over the budget there is asked of XLA GPU
    advice = st.advise(
        lm1b_make_step,
        [st.Candidate(auto(chosen), LM1B_RULES, BATCH, length=LENGTH)],
        hardware=st.hardware("h100"),
        budget_bytes=budget,
        progress=False,
        screen="cpu",
    )
    (row,) = advice.rows
    assert row.verdict == "fits", str(advice)  # not "may fit" or "over budget"
    assert row.step.backend == "gpu" and "XLA GPU compiler" in row.step.target
    assert row.step.peak_bytes == gpu  # the target's figure, to the byte
    assert row.step.peak_bytes < budget < estimate.peak_bytes
    (line,) = [line for line in str(advice).splitlines() if "data 2 x fsdp 4 x tensor 1" in line]
    assert line.split()[-2:] == ["GPU", "fits"]  # its figures are from XLA GPU
    assert advice.compiles == 2  # the CPU screen, then the target's compile
    assert "the rows over the budget on it compiled for the target" in advice.note


# --- an unrolled, unannotated equinox GPT, boxed by patterns ----------------------------

GPT = eqx_gpt.GPTConfig(block_size=LENGTH, vocab_size=VOCAB, n_layer=LAYERS, n_head=4, n_embd=WIDTH)


def is_shape(leaf):
    return isinstance(leaf, jax.ShapeDtypeStruct)


@functools.cache
def gpt_abstract():
    """The GPT's shapes, nothing allocated: its arrays apart from the rest."""
    model = eqx.filter_eval_shape(eqx_gpt.GPT, GPT, jax.random.key(0))
    return eqx.partition(model, is_shape)


def gpt_step(params, state, tokens):
    _, static = gpt_abstract()
    tokens = st.unbox(tokens)

    def loss(p):
        model = eqx.combine(st.unbox(p), static)
        return eqx_gpt.loss_fn(
            jax.tree.map(lambda w: w.astype(jnp.bfloat16) if eqx.is_array(w) else w, model),
            tokens[:, :-1],
            tokens[:, 1:],
        )

    value, grads = jax.value_and_grad(loss)(params)
    updates, state = TX.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value


def gpt_args(mesh, batch):
    """Boxed by patterns: norms replicated, FSDP on every other large weight."""
    params, _ = gpt_abstract()
    names = st.match([(r"/?ln_(1|2|f)/", None)], default=st.fsdp(mesh, min_size=2**12))
    params = st.box(params, names)
    tokens = st.Partitioned(
        jax.ShapeDtypeStruct((batch, LENGTH + 1), jnp.int32), (("data", "fsdp"), None)
    )
    return params, jax.eval_shape(TX.init, params), tokens


def gpt_make_step(candidate):
    args = gpt_args(candidate.mesh, candidate.batch)
    return gpt_step, args, {"params": args[0], "donate_argnums": (0, 1)}


@functools.cache
def gpt_estimate(shape):
    """The CPU estimate of the GPT's step on `shape`, and its arguments."""
    args = gpt_args(auto(shape), BATCH)
    step = st.preflight(gpt_step, *args, mesh=auto(shape), params=args[0], donate_argnums=(0, 1))
    assert step.backend == "cpu"
    return step


def test_equinox_gpt_screened_on_xla_gpu_fits_where_the_estimate_is_over():
    chosen = (4, 2)
    args = gpt_args(auto(chosen), BATCH)
    assert st.unbox(args[0]).h[0].attn.c_attn.weight.shape == (3 * WIDTH, WIDTH)
    assert args[0].h[1].mlp.c_fc.weight.names == (("fsdp",), None)  # FSDP by pattern
    assert not st.is_boxed(args[0].h[0].ln_1.weight)
    # a budget the CPU estimate is over (by 25%: "may fit" at best on it alone)
    budget = gpt_estimate(chosen).peak_bytes * 4 // 5
    candidates = [
        st.Candidate(auto(shape), None, BATCH, length=LENGTH) for shape in (chosen, (1, 8))
    ]
    # the default screen on GPU hardware with XLA GPU installed: the target's compiler
    advice = st.advise(
        gpt_make_step,
        candidates,
        hardware=st.hardware("h100"),
        budget_bytes=budget,
        progress=False,
        confirm=2,
    )
    assert advice.compiles == len(candidates)  # one compile each, all on the target
    assert all(r.step is not None and r.step.backend == "gpu" for r in advice.rows), str(advice)
    (row,) = [r for r in advice.rows if tuple(r.candidate.mesh.axis_sizes) == chosen]
    assert row.verdict == "fits" and row.step.peak_bytes < budget, str(advice)
    assert advice.note.startswith("screened on the target: compiled for 8 x h100")
    # confirm= finds nothing left to compile again, and says why
    assert "nothing to confirm: every compiled row is already the target's own" in advice.note


@needs_tpu
def test_equinox_gpt_on_tpu_v5p_a_row_over_on_the_estimate_is_asked_of_libtpu():
    chosen = (4, 2)
    estimate = gpt_estimate(chosen)
    budget = estimate.peak_bytes * 4 // 5
    advice = st.advise(
        gpt_make_step,
        [st.Candidate(auto(chosen), None, BATCH, length=LENGTH)],
        hardware=st.hardware("tpu-v5p"),
        budget_bytes=budget,
        progress=False,
    )
    (row,) = advice.rows
    # TPU screens on the CPU estimate (libtpu is far dearer per compile), and asks
    # libtpu before it calls a row over
    assert advice.note.startswith("screened on the CPU estimate (libtpu"), advice.note
    assert row.verdict == "fits" and row.step.backend == "tpu", str(advice)
    assert "libtpu" in row.step.target and row.step.peak_bytes < budget
    assert row.step.compiler_peak_bytes > 0  # libtpu's own peak, beside the summed one
    assert advice.compiles == 2  # the estimate, then libtpu
