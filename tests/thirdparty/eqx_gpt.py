# A nanoGPT-style GPT in equinox, written the way an equinox user ports
# Andrej Karpathy's nanoGPT (https://github.com/karpathy/nanoGPT, model.py, MIT
# license): one eqx.Module per block, the blocks in a Python list, a Python loop
# over them (no scan), vmapped over the batch, and no sharding annotations.
# Not part of spmdtree: it stands for a model written elsewhere, which is why
# it is left outside ruff and mypy like the vendored files beside it.

import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True


class CausalSelfAttention(eqx.Module):
    c_attn: eqx.nn.Linear
    c_proj: eqx.nn.Linear
    n_head: int = eqx.field(static=True)

    def __init__(self, config, key):
        k1, k2 = jax.random.split(key)
        self.c_attn = eqx.nn.Linear(config.n_embd, 3 * config.n_embd, use_bias=config.bias, key=k1)
        self.c_proj = eqx.nn.Linear(config.n_embd, config.n_embd, use_bias=config.bias, key=k2)
        self.n_head = config.n_head

    def __call__(self, x):
        T, C = x.shape
        qkv = jax.vmap(self.c_attn)(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        # (T, C) -> (n_head, T, head_size)
        q = q.reshape(T, self.n_head, C // self.n_head).transpose(1, 0, 2)
        k = k.reshape(T, self.n_head, C // self.n_head).transpose(1, 0, 2)
        v = v.reshape(T, self.n_head, C // self.n_head).transpose(1, 0, 2)
        att = (q @ k.transpose(0, 2, 1)) * (1.0 / math.sqrt(k.shape[-1]))
        mask = jnp.tril(jnp.ones((T, T), dtype=bool))
        att = jnp.where(mask[None, :, :], att, -jnp.inf)
        att = jax.nn.softmax(att, axis=-1)
        y = att @ v
        y = y.transpose(1, 0, 2).reshape(T, C)
        return jax.vmap(self.c_proj)(y)


class MLP(eqx.Module):
    c_fc: eqx.nn.Linear
    c_proj: eqx.nn.Linear

    def __init__(self, config, key):
        k1, k2 = jax.random.split(key)
        self.c_fc = eqx.nn.Linear(config.n_embd, 4 * config.n_embd, use_bias=config.bias, key=k1)
        self.c_proj = eqx.nn.Linear(4 * config.n_embd, config.n_embd, use_bias=config.bias, key=k2)

    def __call__(self, x):
        x = jax.vmap(self.c_fc)(x)
        x = jax.nn.gelu(x)
        return jax.vmap(self.c_proj)(x)


class Block(eqx.Module):
    ln_1: eqx.nn.LayerNorm
    attn: CausalSelfAttention
    ln_2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, config, key):
        k1, k2 = jax.random.split(key)
        self.ln_1 = eqx.nn.LayerNorm(config.n_embd, use_bias=config.bias)
        self.attn = CausalSelfAttention(config, k1)
        self.ln_2 = eqx.nn.LayerNorm(config.n_embd, use_bias=config.bias)
        self.mlp = MLP(config, k2)

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.ln_1)(x))
        x = x + self.mlp(jax.vmap(self.ln_2)(x))
        return x


class GPT(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    h: list
    ln_f: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear

    def __init__(self, config, key):
        keys = jax.random.split(key, config.n_layer + 3)
        self.wte = eqx.nn.Embedding(config.vocab_size, config.n_embd, key=keys[0])
        self.wpe = eqx.nn.Embedding(config.block_size, config.n_embd, key=keys[1])
        self.h = [Block(config, k) for k in keys[3:]]
        self.ln_f = eqx.nn.LayerNorm(config.n_embd, use_bias=config.bias)
        self.lm_head = eqx.nn.Linear(config.n_embd, config.vocab_size, use_bias=False, key=keys[2])

    def __call__(self, idx):
        (T,) = idx.shape
        tok_emb = jax.vmap(self.wte)(idx)
        pos_emb = jax.vmap(self.wpe)(jnp.arange(T))
        x = tok_emb + pos_emb
        for block in self.h:
            x = block(x)
        x = jax.vmap(self.ln_f)(x)
        return jax.vmap(self.lm_head)(x)


def loss_fn(model, idx, targets):
    logits = jax.vmap(model)(idx)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
