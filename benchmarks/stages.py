"""Where stages pay: a Llama-3 70B-class step on two TPU v5p slices, the slow links
between them (DCN) as FSDP, as data or as pipeline stages (docs/planning.md, "Where
stages pay"; new in 0.8).

The step is benchmarks/validate.py's Llama step (a plain-JAX decoder, SwiGLU, RoPE,
grouped-query attention in blocks (XLA's kernels, as validate.py's TPU runs), each layer rematerialised, bf16 compute
over f32 params, AdamW) at Llama 3 70B's shapes (examples/llama.py) and 4,096 tokens,
four sequences per chip: 512 sequences on 2 x v5p-128 (128 chips, two slices of 64).
Each layout is compiled by libtpu for the two slices without the chips
(`st.advise(..., devices_per_node=64)`: the mesh's first axis that is not 1 spans the
slices) and ranked by its predicted step time:

- fsdp 128: FSDP over both slices; every layer's weights gathered across the DCN;
- data 2 x fsdp 64: FSDP within each slice, the gradients all-reduced across the DCN;
- stage 2 x fsdp 64: 40 layers per slice, a pipeline (`st.pipeline`) of 2, 4 or 8
  microbatches (more would leave a microbatch fewer sequences than the 64 devices its
  batch is split over); activations cross the DCN, one microbatch per iteration.

No pipelined training run on TPUs is published: these are predictions, held against
no measurement (a single chip runs no pipeline).

Run: python benchmarks/stages.py [--quick] [--json PATH]
(--quick: a tiny model on two slices of 4 chips, checking that it runs.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType

import spmdtree as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import validate  # the Llama step of the validation runs

#: Llama 3 70B's shapes (examples/llama.py SIZES["70B"]), 4,096 tokens.
LLAMA_70B = validate.Model(128256, 8192, 80, 64, 8, 128, 28672, 4096, 512, "llama", "full")
TINY = validate.Model(512, 256, 4, 8, 8, 32, 512, 256, 64, "llama", "full")

#: FSDP over the fsdp axis, the batch over data and fsdp, the stages on the stage axis.
RULES = [
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("stage", "stage"),
    *[(n, None) for n in ("vocab", "mlp", "q_heads", "kv_heads", "kv", "length", "norm")],
    ("layers", None),
    ("activation_embed", None),
]


def make_step(model: validate.Model):
    """advise's make_step: the model's AdamW step on the candidate's mesh, its layers
    pipelined over the stage axis where it has more than one (the candidate's
    microbatches)."""

    def make(candidate: st.Candidate):
        stages = dict(candidate.mesh.shape)["stage"]
        micro = (candidate.options or {}).get("microbatches", 0)
        piped = dataclasses.replace(model, microbatches=micro if stages > 1 else 0)
        params = piped.staged(stages) if stages > 1 else piped.params()
        state = jax.eval_shape(optax.adamw(1e-4).init, params)
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((candidate.batch, model.length + 1), jnp.int32),
            ("batch", "length"),
        )
        keywords = {"params": params, "donate_argnums": (0, 1)}
        return piped.train_step, (params, state, tokens), keywords

    return make


def candidates(
    model: validate.Model, chips: int, batch: int, microbatches: tuple[int, ...]
) -> list[st.Candidate]:
    """The three uses of the DCN axis, on `chips` in two slices."""
    half = chips // 2

    def mesh(data: int, stage: int, fsdp: int) -> AbstractMesh:
        return AbstractMesh(
            (data, stage, fsdp), ("data", "stage", "fsdp"), axis_types=(AxisType.Auto,) * 3
        )

    plain = [st.Candidate(mesh(1, 1, chips), RULES, batch, model.length)]
    plain.append(st.Candidate(mesh(2, 1, half), RULES, batch, model.length))
    piped = st.candidates(
        [mesh(1, 2, half)], RULES, batch, length=model.length, microbatches=microbatches
    )
    return plain + piped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model on 2 x 4 chips")
    parser.add_argument("--json", help="write the advice's JSON here")
    args = parser.parse_args()
    model, chips = (TINY, 8) if args.quick else (LLAMA_70B, 128)
    found = candidates(
        model, chips, 4 * chips // (4 if args.quick else 1), (2,) if args.quick else (2, 4, 8)
    )
    print(
        f"jax {jax.__version__}; spmdtree {st.__version__}; {model.param_count() / 1e9:.1f}B "
        f"params, {model.layers} layers, {model.length} tokens, batch {found[0].batch}, on 2 slices of "
        f"{chips // 2} v5p chips (libtpu, no chips)\n",
        flush=True,
    )
    advice = st.advise(
        make_step(model),
        found,
        hardware=st.hardware("tpu-v5p"),
        devices_per_node=chips // 2,
        screen="target",
        jobs=2,
    )
    print(advice)
    if args.json:
        with open(args.json, "w") as f:
            f.write(advice.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
