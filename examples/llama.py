"""Abstract Llama-3 param trees (8B, 70B, 405B) from the published shapes, with
MaxText-style logical names: nothing is allocated, so any size builds on a laptop.

Used by examples/plan_llama.py and benchmarks/run.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import spmdtree as st

#: The published shapes: vocab, model width, layers, query heads, kv heads,
#: head dim, MLP width.
SIZES = {
    "8B": dict(vocab=128256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336),
    "70B": dict(vocab=128256, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672),
    "405B": dict(
        vocab=128256, embed=16384, layers=126, heads=128, kv_heads=8, head_dim=128, mlp=53248
    ),
}


#: Rules that shard these names over a "tensor" mesh axis (tensor parallelism).
TENSOR_RULES = [
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
]


def _array(shape: tuple[int, ...], names: tuple[str, ...]) -> st.LogicallyPartitioned:
    return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.bfloat16), names)


def layer(size: str) -> dict[str, st.LogicallyPartitioned]:
    """One decoder layer: 9 arrays (2 norms, q/k/v/o attention, gated MLP)."""
    s = SIZES[size]
    e, h, kv, d, m = s["embed"], s["heads"], s["kv_heads"], s["head_dim"], s["mlp"]
    return {
        "attention_norm": _array((e,), ("norm",)),
        "query": _array((e, h, d), ("embed", "q_heads", "kv")),
        "key": _array((e, kv, d), ("embed", "kv_heads", "kv_head_dim")),
        "value": _array((e, kv, d), ("embed", "kv_heads", "kv_head_dim")),
        "out": _array((h, d, e), ("heads", "kv", "embed")),
        "mlp_norm": _array((e,), ("norm",)),
        "wi_0": _array((e, m), ("embed", "mlp")),
        "wi_1": _array((e, m), ("embed", "mlp")),
        "wo": _array((m, e), ("mlp", "embed")),
    }


def params(size: str, *, stacked: bool = True) -> dict:
    """The abstract boxed params of Llama-3 `size`: layers stacked on a leading
    'layers' axis (as a scanned model holds them), or one subtree per layer."""
    s = SIZES[size]
    if stacked:
        layers = jax.tree.map(
            lambda box: _array((s["layers"], *box.value.shape), ("layers", *box.names)),
            layer(size),
            is_leaf=st.is_boxed,
        )
    else:
        layers = {f"layer_{i:03d}": layer(size) for i in range(s["layers"])}
    return {
        "embed": _array((s["vocab"], s["embed"]), ("vocab", "embed")),
        "layers": layers,
        "final_norm": _array((s["embed"],), ("norm",)),
        "output": _array((s["embed"], s["vocab"]), ("embed", "vocab")),
    }
