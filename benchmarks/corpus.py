"""Training steps of seven families, measured on a TPU v5e chip and predicted (new in 0.8).

Each family is a whole training step (the loss, its gradients, optax's adamw update;
the new params, optimizer state and loss returned), sized so one v5e holds it with
room and runs it in tens of milliseconds:

- ``decoder``: benchmarks/measured.py's first row (a 0.27B Llama-style decoder,
  attention by XLA's kernels, remat full, 8 x 2,048 tokens);
- ``vit``: a ViT-B/16 in plain JAX (224 px, width 768, 12 layers of 12 heads, MLP
  3,072, 1,000 classes), bf16 compute over fp32 params, 32 images;
- ``cnn``: a ResNet-18-style CNN in plain JAX (NHWC, `jax.lax.conv_general_dilated`,
  batch norm): a 64-channel stage at 56 px (narrow) up to 256 and 512 channels at
  14 and 7 px (wide), bf16, 256 images of 224 px;
- ``moe``: examples/moe.py's step at benchmarks/chip.py's ``MOE_SIZES`` (4 layers of
  width 1,024, 8 experts of 4,096, top-2, 4 x 1,024 tokens), the experts on one chip;
- ``gemma``: flax's own flax.nnx Gemma 3 1B (tests/thirdparty/flax_gemma), 6 of its
  26 layers, its 262,144-token vocabulary, bf16 compute, 2 x 1,024 tokens;
- ``eqx-gpt``: the nanoGPT-style equinox GPT of tests/thirdparty/eqx_gpt.py (12
  layers of width 768, 1,024 tokens, unrolled and vmapped as written), 8 sequences;
- ``int8``: an AQT-style int8 MLP stack (4 residual blocks of width 4,096, hidden
  8,192, 8,192 tokens): activations and weights quantized per channel to int8,
  multiplied by `jax.lax.dot_general(..., preferred_element_type=jnp.int32)` and
  scaled back; the gradient straight through, the input's in int8 too (as AQT
  does), the weights' in bf16.

On a chip each step is run by `st.measure` (2 warm-up steps, 5 timed, a profile
joined per instruction), predicted on the calibrated chip (``--hardware``, a
`Hardware.to_json`; else the preset) and on the preset ``tpu-v5e``, the preset's
prediction joined per instruction to the same profile (`StepPlan.compare`). It writes
``corpus.json`` (the versions, each family's times, ratios and op_errors) and each
family's `Measurement` as ``<family>.json`` into ``--out``. Without a chip it says so
and exits 0; ``--deviceless`` compiles each step for a v5e by libtpu without the
chip (the ``spmdtree[tpu]`` extra) and prints its peak memory and predicted time;
``--recorded DIR/corpus.json [...]`` prints a chip's run (its parts, where it ran in
several commands, ``--only``) as the docs' table.

Run on the chip:   python benchmarks/corpus.py --out DIR [--hardware chip.json] [--only vit,cnn]
Here:              python benchmarks/corpus.py --deviceless
Afterwards:        python benchmarks/corpus.py --recorded DIR/corpus.json [DIR2/corpus.json]
Goal (on the calibrated chip): each step's |predicted/measured - 1| <= 10%, their
mean <= 5%, each op_error <= 10%; --recorded exits 1 where it is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import pathlib
import statistics
import sys
import tempfile
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType

import spmdtree as st

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: The goal, on the calibrated chip: each ratio, their mean, each op_error.
EACH_GOAL, MEAN_GOAL, OP_GOAL = 0.10, 0.05, 0.10
#: A step compiled without the chip fits with room under this peak.
ROOM = 14 * 2**30
PRESET = "tpu-v5e"
f32, bf16 = jnp.float32, jnp.bfloat16

AnyMesh = jax.sharding.Mesh | AbstractMesh


@dataclasses.dataclass(frozen=True)
class Step:
    """A step as `st.measure` and `st.preflight` take it: ``fn(*args, **kwargs)``,
    the keywords holding its mesh (and rules, params, donate_argnums, ...)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of steps: its name, its size in words, and ``build(here=, tiny=)``:
    the `Step` on a mesh of the first device (``here``) or an abstract one, at its
    chip size or a tiny one (the tests' CPU)."""

    name: str
    what: str
    build: Callable[..., Step]


def one_chip(names: Sequence[str], *, here: bool, explicit: bool = False) -> AnyMesh:
    """A mesh of one device, each axis of size 1: the first device's, or abstract."""
    shape = (1,) * len(names)
    kinds = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    if here:
        return jax.make_mesh(shape, tuple(names), axis_types=kinds, devices=jax.devices()[:1])
    return AbstractMesh(shape, tuple(names), axis_types=kinds)


def adamw_step(loss: Callable[..., jax.Array], tx: optax.GradientTransformation) -> Any:
    """``step(params, state, *batch) -> (params, state, loss)``: `loss`'s gradients
    and `tx`'s update."""

    def step(params: Any, state: Any, *batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def plain(fn: Callable[..., jax.Array], params: Any, *batch: Any, here: bool) -> Step:
    """A plain-JAX family's step on a one-device ``data`` mesh: its params boxed
    whole (for preflight's memory by params and state), unboxed for `fn`; params
    and adamw state donated."""
    params = st.box(params, lambda _, leaf: (None,) * len(leaf.shape))
    tx = optax.adamw(1e-4)
    state = jax.eval_shape(tx.init, params)
    mesh = one_chip(("data",), here=here)
    kwargs = dict(mesh=mesh, params=params, donate_argnums=(0, 1))

    def loss(params: Any, *batch: Any) -> jax.Array:
        return fn(st.unbox(params), *batch)

    return Step(adamw_step(loss, tx), (params, state, *batch), kwargs)


def tokens(batch: int, length: int, vocab: int, low: int = 0) -> np.ndarray:
    """Token ids drawn evenly from [low, vocab), fixed: the default fill's zeros
    would route every MoE token alike and mask every Gemma position."""
    return np.random.default_rng(0).integers(low, vocab, (batch, length), dtype=np.int32)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(f32), labels).mean()


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x.astype(f32), -1, keepdims=True)
    var = jnp.var(x.astype(f32), -1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias
    return y.astype(x.dtype)


# --- decoder: benchmarks/measured.py's first row ------------------------------------


def decoder(*, here: bool = True, tiny: bool = False) -> Step:
    import measured

    row = measured.ROWS[0]
    if tiny:
        model = dataclasses.replace(
            row.model,
            vocab=256,
            embed=64,
            layers=2,
            heads=2,
            kv_heads=2,
            head_dim=32,
            mlp=128,
            length=64,
            block=32,
        )
        row = measured.Row(row.name, model, 2)
    mesh = measured.one_chip() if here else one_chip(("fsdp",), here=False)
    a = row.arguments(mesh)
    return Step(a.pop("fn"), a.pop("args"), a)


# --- vit: a ViT-B/16 in plain JAX ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ViT:
    image: int = 224
    patch: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp: int = 3072
    classes: int = 1000
    batch: int = 32

    def params(self) -> dict[str, Any]:
        d, n, h, k = self.width, self.layers, self.heads, self.width // self.heads
        length = (self.image // self.patch) ** 2 + 1

        def w(*shape: int) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, f32)

        return {
            "patch": w(self.patch * self.patch * 3, d),
            "patch_bias": w(d),
            "cls": w(1, 1, d),
            "position": w(length, d),
            "layers": {
                "norm1": w(n, d),
                "norm1_bias": w(n, d),
                "qkv": w(n, d, 3, h, k),
                "qkv_bias": w(n, 3, h, k),
                "out": w(n, h, k, d),
                "out_bias": w(n, d),
                "norm2": w(n, d),
                "norm2_bias": w(n, d),
                "mlp_in": w(n, d, self.mlp),
                "mlp_in_bias": w(n, self.mlp),
                "mlp_out": w(n, self.mlp, d),
                "mlp_out_bias": w(n, d),
            },
            "norm": w(d),
            "norm_bias": w(d),
            "head": w(d, self.classes),
            "head_bias": w(self.classes),
        }

    def loss(self, params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        p = jax.tree.map(lambda x: x.astype(bf16), params)
        b, s, c = images.shape[0], self.image // self.patch, self.patch
        patches = images.astype(bf16).reshape(b, s, c, s, c, 3).transpose(0, 1, 3, 2, 4, 5)
        x = patches.reshape(b, s * s, c * c * 3) @ p["patch"] + p["patch_bias"]
        x = jnp.concatenate([jnp.broadcast_to(p["cls"], (b, 1, self.width)), x], axis=1)
        x = x + p["position"]

        def layer(x: jax.Array, q: dict[str, jax.Array]) -> tuple[jax.Array, None]:
            h = layer_norm(x, q["norm1"], q["norm1_bias"])
            qkv = jnp.einsum("bld,dthk->tblhk", h, q["qkv"]) + q["qkv_bias"][:, None, None]
            scores = jnp.einsum("bqhk,bshk->bhqs", qkv[0], qkv[1]) / math.sqrt(qkv.shape[-1])
            weights = jax.nn.softmax(scores.astype(f32), axis=-1).astype(bf16)
            heads = jnp.einsum("bhqs,bshk->bqhk", weights, qkv[2])
            x = x + jnp.einsum("bqhk,hkd->bqd", heads, q["out"]) + q["out_bias"]
            h = layer_norm(x, q["norm2"], q["norm2_bias"])
            h = jax.nn.gelu(h @ q["mlp_in"] + q["mlp_in_bias"])
            return x + h @ q["mlp_out"] + q["mlp_out_bias"], None

        x, _ = jax.lax.scan(layer, x, p["layers"])
        x = layer_norm(x[:, 0], p["norm"], p["norm_bias"])
        return cross_entropy(x @ p["head"] + p["head_bias"], labels)


def vit(*, here: bool = True, tiny: bool = False) -> Step:
    cfg = ViT(64, 16, 64, 2, 2, 128, 10, 2) if tiny else ViT()
    images = jax.ShapeDtypeStruct((cfg.batch, cfg.image, cfg.image, 3), bf16)
    labels = tokens(cfg.batch, 1, cfg.classes)[:, 0]
    return plain(cfg.loss, cfg.params(), images, labels, here=here)


# --- cnn: a ResNet-18-style CNN in plain JAX ------------------------------------------


@dataclasses.dataclass(frozen=True)
class CNN:
    image: int = 224
    stem: int = 64
    #: Each stage's channels, blocks and first stride: narrow at 56 px, wide at 14 and 7.
    stages: tuple[tuple[int, int, int], ...] = ((64, 2, 1), (128, 2, 2), (256, 2, 2), (512, 2, 2))
    classes: int = 1000
    batch: int = 256

    def blocks(self) -> Iterator[tuple[str, int, int, int]]:
        """Each residual block's name, its input and output channels, its stride."""
        cin = self.stem
        for i, (c, n, stride) in enumerate(self.stages):
            for j in range(n):
                yield f"stage{i}_{j}", cin, c, stride if j == 0 else 1
                cin = c

    def params(self) -> dict[str, Any]:
        def conv(k: int, cin: int, cout: int) -> dict[str, jax.ShapeDtypeStruct]:
            return {
                "w": jax.ShapeDtypeStruct((k, k, cin, cout), f32),
                "scale": jax.ShapeDtypeStruct((cout,), f32),
                "bias": jax.ShapeDtypeStruct((cout,), f32),
            }

        tree: dict[str, Any] = {"stem": conv(7, 3, self.stem)}
        for name, cin, cout, stride in self.blocks():
            tree[name] = {"conv1": conv(3, cin, cout), "conv2": conv(3, cout, cout)}
            if stride != 1 or cin != cout:
                tree[name]["shortcut"] = conv(1, cin, cout)
        last = self.stages[-1][0]
        tree["head"] = {
            "w": jax.ShapeDtypeStruct((last, self.classes), f32),
            "b": jax.ShapeDtypeStruct((self.classes,), f32),
        }
        return tree

    def loss(self, params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        def conv_bn(x: jax.Array, p: dict[str, jax.Array], stride: int = 1) -> jax.Array:
            """A convolution then batch norm over the batch's statistics."""
            y = jax.lax.conv_general_dilated(
                x,
                p["w"].astype(bf16),
                (stride, stride),
                "SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            )
            mean = jnp.mean(y.astype(f32), (0, 1, 2))
            var = jnp.var(y.astype(f32), (0, 1, 2))
            y = (y - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
            return y.astype(bf16)

        x = jax.nn.relu(conv_bn(images.astype(bf16), params["stem"], 2))
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        for name, _, _, stride in self.blocks():
            p = params[name]
            y = jax.nn.relu(conv_bn(x, p["conv1"], stride))
            y = conv_bn(y, p["conv2"])
            shortcut = conv_bn(x, p["shortcut"], stride) if "shortcut" in p else x
            x = jax.nn.relu(y + shortcut)
        pooled = jnp.mean(x.astype(f32), (1, 2))
        return cross_entropy(pooled @ params["head"]["w"] + params["head"]["b"], labels)


def cnn(*, here: bool = True, tiny: bool = False) -> Step:
    cfg = CNN(32, 8, ((8, 1, 1), (16, 1, 2)), 10, 2) if tiny else CNN()
    images = jax.ShapeDtypeStruct((cfg.batch, cfg.image, cfg.image, 3), bf16)
    labels = tokens(cfg.batch, 1, cfg.classes)[:, 0]
    return plain(cfg.loss, cfg.params(), images, labels, here=here)


# --- moe: examples/moe.py's step at chip.py's MOE_SIZES ------------------------------


def moe(*, here: bool = True, tiny: bool = False) -> Step:
    from chip import MOE_SIZES

    sys.path.insert(0, str(HERE.parent / "examples"))
    import moe as example

    cfg = example.Config(batch=2) if tiny else example.Config(**MOE_SIZES)
    mesh = one_chip(("expert", "data"), here=here, explicit=True)
    rules = example.make_rules()
    params = jax.eval_shape(functools.partial(example.init, cfg=cfg), jax.random.key(0))
    tx = optax.adamw(1e-4)
    state = jax.eval_shape(tx.init, params)
    batch = st.LogicallyPartitioned(tokens(cfg.batch, cfg.length, cfg.vocab), ("batch", "length"))

    def step(params: Any, state: Any, batch: Any) -> Any:
        """The example's step, its batch placed as make_batch places it (by the rules)."""
        return example.train_step(params, state, st.unbox(batch), cfg=cfg, tx=tx)

    kwargs = dict(mesh=mesh, rules=rules, params=params, donate_argnums=(0, 1))
    return Step(step, (params, state, batch), kwargs)


# --- gemma: flax's flax.nnx Gemma 3 1B, as tests/test_flax_gemma.py builds it -----------

#: The example's own modules, which import each other by their bare names.
GEMMA_MODULES = (
    "transformer",
    "transformer_cfg",
    "modules",
    "layers",
    "positional_embeddings",
    "sow_lib",
    "helpers",
    "params",
)


@contextlib.contextmanager
def _gemma_names() -> Iterator[None]:
    """The example's folder on sys.path while it imports, its bare module names taken
    back out of sys.modules after; orbax (which it imports only to load checkpoints)
    an empty module where it is not installed."""
    folder = str(HERE.parent / "tests" / "thirdparty" / "flax_gemma")
    kept = {name: sys.modules.pop(name) for name in GEMMA_MODULES if name in sys.modules}
    try:
        import orbax.checkpoint
    except ImportError:
        orbax = types.ModuleType("orbax")
        orbax.checkpoint = types.ModuleType("orbax.checkpoint")  # type: ignore[attr-defined]
        sys.modules.update({"orbax": orbax, "orbax.checkpoint": orbax.checkpoint})
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        for name in GEMMA_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(kept)


def gemma(*, here: bool = True, tiny: bool = False) -> Step:
    from flax import nnx

    with _gemma_names():
        import transformer
        import transformer_cfg as cfgs

    layers = 1 if tiny else 6
    small = dict(num_embed=512, embed_dim=128, hidden_dim=512, num_heads=4, head_dim=32)
    config = cfgs.TransformerConfig.gemma3_1b(
        num_layers=layers,
        attention_types=cfgs.make_attention_layers_types(cfgs.GEMMA3_ATTENTION_PATTERN, layers),
        dtype=bf16,
        shd_config=cfgs.ShardingConfig.fsdp_tp_sharding(
            fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor"
        ),
        **(dict(small, sliding_window_size=32) if tiny else {}),
    )
    batch, length = (2, 64) if tiny else (2, 1024)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: transformer.Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    params = st.from_flax(params)

    def loss(params: Any, tokens: Any) -> jax.Array:
        """The recipe's loss: the padding mask, positions and causal mask from it, the
        model rebuilt by `nnx.merge`, cross-entropy from one-hot targets."""
        inputs, targets = tokens.value[:, :-1], tokens.value[:, 1:]
        input_mask = inputs > 0
        positions = transformer.build_positions_from_mask(input_mask)
        attention_mask = transformer.make_causal_attn_mask(input_mask)
        module = nnx.merge(graphdef, st.unbox(params), rest)
        logits, _ = module(inputs, positions=positions, cache=None, attention_mask=attention_mask)
        labels = jax.nn.one_hot(targets, logits.shape[-1])
        return -jnp.sum(labels * nnx.log_softmax(logits.astype(f32)), axis=-1).mean()

    tx = optax.adamw(1e-4)
    state = jax.eval_shape(tx.init, params)
    ids = st.Partitioned(tokens(batch, length + 1, config.num_embed, low=1), ("fsdp", None))
    mesh = one_chip(("fsdp", "tensor"), here=here, explicit=True)
    kwargs = dict(mesh=mesh, params=params, donate_argnums=(0, 1))
    return Step(adamw_step(loss, tx), (params, state, ids), kwargs)


# --- eqx-gpt: tests/thirdparty/eqx_gpt.py's GPT -------------------------------------


def eqx_gpt(*, here: bool = True, tiny: bool = False) -> Step:
    import equinox as eqx

    sys.path.insert(0, str(HERE.parent / "tests"))
    from thirdparty import eqx_gpt as gpt

    if tiny:
        config = gpt.GPTConfig(block_size=64, vocab_size=256, n_layer=1, n_head=2, n_embd=64)
        batch = 2
    else:
        config, batch = gpt.GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768), 8
    model = eqx.filter_eval_shape(gpt.GPT, config, jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def loss(params: Any, ids: jax.Array) -> jax.Array:
        """tests/test_real_models.py's: the model in bf16, its own loss_fn."""
        model = eqx.combine(params, static)
        cast = jax.tree.map(lambda w: w.astype(bf16) if eqx.is_array(w) else w, model)
        return gpt.loss_fn(cast, ids[:, :-1], ids[:, 1:])

    ids = tokens(batch, config.block_size + 1, config.vocab_size)
    return plain(loss, params, ids, here=here)


# --- int8: an AQT-style int8 MLP stack ------------------------------------------------


def quantized(a: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """`a` as int8 and its fp32 scales, symmetric, one scale per slice along `axis`."""
    scale = jnp.max(jnp.abs(a.astype(f32)), axis=axis, keepdims=True) / 127
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.round(a / scale).astype(jnp.int8), scale


def int8_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] in int8: a per row, b per column, int32 sums, fp32 out."""
    qa, sa = quantized(a, 1)
    qb, sb = quantized(b, 0)
    dims = (((1,), (0,)), ((), ()))
    sums = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.int32)
    return sums.astype(f32) * sa * sb


@jax.custom_vjp
def aqt_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in int8, its gradient straight through the rounding."""
    return int8_matmul(x, w).astype(x.dtype)


def _aqt_forward(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return aqt_dot(x, w), (x, w)


def _aqt_backward(saved: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, ...]:
    x, w = saved
    dx = int8_matmul(g, w.T).astype(x.dtype)  # the input's gradient in int8, as AQT's
    dw = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dx, dw.astype(w.dtype)


aqt_dot.defvjp(_aqt_forward, _aqt_backward)


@dataclasses.dataclass(frozen=True)
class Int8:
    width: int = 4096
    hidden: int = 8192
    layers: int = 4
    tokens: int = 8192

    def params(self) -> dict[str, Any]:
        n, d, h = self.layers, self.width, self.hidden
        return {
            "norm": jax.ShapeDtypeStruct((n, d), f32),
            "w_in": jax.ShapeDtypeStruct((n, d, h), f32),
            "w_out": jax.ShapeDtypeStruct((n, h, d), f32),
        }

    def loss(self, params: Any, x: jax.Array, target: jax.Array) -> jax.Array:
        def block(x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
            h = x.astype(f32) * jax.lax.rsqrt(
                jnp.mean(jnp.square(x.astype(f32)), -1, keepdims=True) + 1e-6
            )
            h = (h * p["norm"]).astype(bf16)
            h = jax.nn.gelu(aqt_dot(h, p["w_in"].astype(bf16)))
            return x + aqt_dot(h, p["w_out"].astype(bf16)), None

        y, _ = jax.lax.scan(block, x, params)
        return jnp.mean(jnp.square(y.astype(f32) - target.astype(f32)))


def int8(*, here: bool = True, tiny: bool = False) -> Step:
    cfg = Int8(64, 128, 2, 32) if tiny else Int8()
    x = jax.ShapeDtypeStruct((cfg.tokens, cfg.width), bf16)
    return plain(cfg.loss, cfg.params(), x, x, here=here)


FAMILIES = (
    Family("decoder", "measured.py's first row: 0.27B Llama, XLA attention, 8 x 2k", decoder),
    Family("vit", "ViT-B/16, 224 px, 32 images, bf16", vit),
    Family("cnn", "ResNet-18-style, 64 to 512 channels, 256 x 224 px, bf16", cnn),
    Family("moe", "examples/moe.py at chip.py's MOE_SIZES: 8 experts, top-2", moe),
    Family("gemma", "flax.nnx Gemma 3 1B, 6 layers, 262k vocab, 2 x 1k", gemma),
    Family("eqx-gpt", "equinox GPT-2 small, 12 x 768, 8 x 1k", eqx_gpt),
    Family("int8", "AQT-style int8 MLP, 4 blocks of 4096 -> 8192, 8k tokens", int8),
)


# --- on the chip ----------------------------------------------------------------------


def judged(m: st.Measurement) -> dict[str, float]:
    """A measurement's prediction, ratio and op_error."""
    return {"predicted": m.predicted_seconds, "ratio": m.ratio, "op_error": m.op_error}


def on_chip(
    family: Family,
    hardware: st.Hardware,
    preset: st.Hardware,
    out: pathlib.Path | None = None,
    *,
    tiny: bool = False,
) -> dict[str, Any]:
    """`family`'s step run on the first device: its times, predicted on `hardware`
    and on `preset`, each joined per instruction to the same profile; its
    `Measurement` (on `hardware`) as `out`/<name>.json."""
    start = time.perf_counter()
    step = family.build(here=True, tiny=tiny)
    with tempfile.TemporaryDirectory() as folder:
        m = st.measure(
            step.fn,
            *step.args,
            **step.kwargs,
            hardware=hardware,
            steps=5,
            warmup=2,
            profile_dir=folder,
        )
        plan = typing.cast(st.StepPlan, m.plan)
        on_preset = dataclasses.replace(plan.compare(folder, hardware=preset), times=m.times)
    if out:
        (out / f"{family.name}.json").write_text(m.to_json())
    return {
        "family": family.name,
        "what": family.what,
        "times": list(m.times),
        "seconds": m.seconds,
        "calibrated": judged(m),
        "preset": judged(on_preset),
        "joined_share": m.joined_share,
        "peak_bytes": plan.peak_bytes,
        "compile_seconds": plan.compile_seconds,
        "misses": [
            {k: getattr(op, k) for k in ("name", "kind", "predicted_seconds", "measured_seconds")}
            for op in m.misses(5)
        ],
        "flags": list(m.flags),
        "wall_seconds": time.perf_counter() - start,
    }


def run(
    families: Sequence[Family],
    hardware: st.Hardware,
    preset: st.Hardware,
    out: pathlib.Path | None = None,
    *,
    tiny: bool = False,
) -> dict[str, Any]:
    """Each family measured in turn (a failure recorded, the others still run),
    ``corpus.json`` rewritten in `out` after each."""
    record: dict[str, Any] = {
        "versions": versions(),
        "hardware": json.loads(hardware.to_json()),
        "preset": preset.name,
        "families": [],
    }
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for family in families:
        try:
            result = on_chip(family, hardware, preset, out, tiny=tiny)
        except ModuleNotFoundError as e:  # flax or equinox not installed: skipped
            result = {"family": family.name, "what": family.what, "skipped": str(e)}
        except Exception as e:  # a family that fails is said, and the others still run
            said = f"{type(e).__name__}: {str(e)[:2000]}"
            result = {"family": family.name, "what": family.what, "error": said}
        record["families"].append(result)
        print(json.dumps(result)[:3000], flush=True)
        if out:
            (out / "corpus.json").write_text(json.dumps(record, indent=1))
        gc.collect()
        jax.clear_caches()
    return record


def table(record: dict[str, Any]) -> str:
    """A recorded run as a markdown table: each family's measured step, its
    prediction, ratio and op_error on the calibrated chip and on the preset; then
    the summary lines."""
    chip = record["hardware"]["name"]
    lines = [
        f"Measured {record['versions']}.",
        "",
        f"| family | measured | {chip} | ratio | op_error | {record['preset']} | ratio | op_error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in record["families"]:
        if "seconds" not in r:
            said = r.get("skipped") or r.get("error", "")
            lines.append(
                f"| {r['family']} | {'skipped' if 'skipped' in r else 'failed'}: "
                f"{said.splitlines()[0][:80] if said else ''} |  |  |  |  |  |  |"
            )
            continue
        cells = [f"{r['seconds'] * 1e3:.1f} ms"]
        for on in ("calibrated", "preset"):
            p = r[on]
            cells += [f"{p['predicted'] * 1e3:.1f} ms", f"{p['ratio']:.2f}", f"{p['op_error']:.0%}"]
        lines.append(f"| {r['family']} | " + " | ".join(cells) + " |")
    lines += ["", *summary(record)]
    return "\n".join(lines)


def merged(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Runs of the same chip in several parts (``--only``) as one: the first's
    versions and hardware, every part's families in order."""
    first = records[0]
    return {**first, "families": [r for each in records for r in each["families"]]}


def summary(record: dict[str, Any]) -> list[str]:
    """Per hardware: mean and largest |ratio - 1|, largest op_error."""
    done = [r for r in record["families"] if "seconds" in r]
    if not done:
        return ["no family measured"]
    lines = []
    for on, name in (("calibrated", record["hardware"]["name"]), ("preset", record["preset"])):
        errors = [abs(r[on]["ratio"] - 1) for r in done]
        ops = [r[on]["op_error"] for r in done]
        lines.append(
            f"{on} ({name}): mean |ratio - 1| {statistics.mean(errors):.1%}, largest "
            f"{max(errors):.1%}; largest op_error {max(ops):.1%} ({len(done)} "
            f"famil{'y' if len(done) == 1 else 'ies'})"
        )
    return lines


def missed(record: dict[str, Any]) -> list[str]:
    """The goals the calibrated chip missed, in words (none: met)."""
    done = [r for r in record["families"] if "seconds" in r]
    errors = {r["family"]: abs(r["calibrated"]["ratio"] - 1) for r in done}
    said = [
        f"{k}: |ratio - 1| {v:.1%} > {EACH_GOAL:.0%}" for k, v in errors.items() if v > EACH_GOAL
    ]
    if errors and statistics.mean(errors.values()) > MEAN_GOAL:
        said.append(f"mean |ratio - 1| {statistics.mean(errors.values()):.1%} > {MEAN_GOAL:.0%}")
    said += [
        f"{r['family']}: op_error {r['calibrated']['op_error']:.1%} > {OP_GOAL:.0%}"
        for r in done
        if r["calibrated"]["op_error"] > OP_GOAL
    ]
    return said


# --- without the chip -------------------------------------------------------------------


def deviceless(families: Sequence[Family], hardware: st.Hardware, preset: st.Hardware) -> int:
    """Each family compiled by libtpu for a v5e without the chip: its peak memory
    against `ROOM`, its predicted time on each hardware. 1 where one does not fit."""
    names = [preset.name] + ([hardware.name] if hardware is not preset else [])
    print(f"| family | peak | fits | {' | '.join(names)} | compile |")
    print("| --- | ---: | --- |" + " ---: |" * len(names) + " ---: |")
    over = 0
    for family in families:
        try:
            step = family.build(here=False)
            plan = st.preflight(step.fn, *step.args, **step.kwargs, target=PRESET)
        except ModuleNotFoundError as e:
            print(f"| {family.name} | skipped: {e} |", flush=True)
            continue
        except Exception as e:  # said, and the others still compile
            print(f"| {family.name} | failed: {type(e).__name__}: {str(e)[:1500]} |", flush=True)
            over += 1
            continue
        fits = plan.peak_bytes < ROOM
        over += not fits
        times = [plan.time(h).predicted_seconds or 0.0 for h in (preset, hardware)[: len(names)]]
        print(
            f"| {family.name} | {plan.peak_bytes / 2**30:.2f} GiB | {'yes' if fits else 'NO'} | "
            + " | ".join(f"{t * 1e3:.1f} ms" for t in times)
            + f" | {plan.compile_seconds:.0f} s |",
            flush=True,
        )
        jax.clear_caches()
    return int(bool(over))


def versions() -> str:
    from importlib import metadata

    try:
        libtpu = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        libtpu = "none"
    return (
        f"{time.strftime('%Y-%m-%d')} on {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"libtpu {libtpu}"
    )


def chosen(only: str | None) -> list[Family]:
    """The families `only` names (comma-separated), all where None."""
    if not only:
        return list(FAMILIES)
    by_name = {f.name: f for f in FAMILIES}
    unknown = [n for n in only.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"--only: no family {unknown}; the families are {list(by_name)}")
    return [by_name[n] for n in only.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, help="a folder for corpus.json and each family's"
    )
    parser.add_argument("--hardware", help="the calibrated chip's JSON (Hardware.to_json)")
    parser.add_argument("--only", help="the families to run, by name: vit,cnn")
    parser.add_argument("--deviceless", action="store_true", help="compile for a v5e here")
    parser.add_argument(
        "--recorded", type=pathlib.Path, nargs="+", help="a chip's corpus.json files, as a table"
    )
    args = parser.parse_args(argv)
    if args.recorded:
        record = merged([json.loads(path.read_text()) for path in args.recorded])
        print(table(record))
        said = missed(record)
        for line in said:
            print(f"goal missed: {line}")
        return int(bool(said))
    families = chosen(args.only)
    preset = st.hardware(PRESET)
    hardware = st.Hardware.from_json(args.hardware) if args.hardware else preset
    if args.deviceless:
        return deviceless(families, hardware, preset)
    if jax.devices()[0].platform != "tpu":
        print(
            "no TPU here: benchmarks/corpus.py measures on a chip (--deviceless compiles "
            "each step for one here; --recorded FILE prints a chip's run)"
        )
        return 0
    print(f"calibrated: {hardware.to_json()}", flush=True)
    record = run(families, hardware, preset, args.out)
    print(table(record))
    for line in missed(record):
        print(f"goal missed: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
