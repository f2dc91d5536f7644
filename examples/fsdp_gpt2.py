"""Shard a param tree nobody annotated: GPT-2 small, with a few patterns and FSDP for the rest.

The params come as they would from a checkpoint or a converted model: a plain
dict of arrays (here abstract, built with `jax.eval_shape` from GPT-2 small's
published shapes: vocab 50257, context 1024, width 768, 12 layers, MLP 3072).
Explicit patterns put the attention and MLP kernels on the tensor axis and
leave biases and norms replicated; every other array gets `st.fsdp`: the FSDP
axis on its largest dimension that the axis divides, if it is large enough.
The plan shows each choice and why, on a 64-chip abstract mesh.

Run: python examples/fsdp_gpt2.py
"""

import jax
import jax.numpy as jnp

import spmdtree as st

VOCAB, CONTEXT, WIDTH, LAYERS, MLP = 50257, 1024, 768, 12, 3072


def gpt2_small() -> dict:
    """The param tree, named as in the released checkpoint: no annotations at all."""

    def layer() -> dict:
        return {
            "ln_1": {"g": jnp.ones(WIDTH), "b": jnp.zeros(WIDTH)},
            "attn": {
                "c_attn": {"w": jnp.zeros((WIDTH, 3 * WIDTH)), "b": jnp.zeros(3 * WIDTH)},
                "c_proj": {"w": jnp.zeros((WIDTH, WIDTH)), "b": jnp.zeros(WIDTH)},
            },
            "ln_2": {"g": jnp.ones(WIDTH), "b": jnp.zeros(WIDTH)},
            "mlp": {
                "c_fc": {"w": jnp.zeros((WIDTH, MLP)), "b": jnp.zeros(MLP)},
                "c_proj": {"w": jnp.zeros((MLP, WIDTH)), "b": jnp.zeros(WIDTH)},
            },
        }

    return {
        "wte": jnp.zeros((VOCAB, WIDTH)),
        "wpe": jnp.zeros((CONTEXT, WIDTH)),
        "h": {str(i): layer() for i in range(LAYERS)},
        "ln_f": {"g": jnp.ones(WIDTH), "b": jnp.zeros(WIDTH)},
    }


def main() -> None:
    mesh = jax.sharding.AbstractMesh((16, 4), ("fsdp", "tensor"))  # 64 chips, none needed
    params = jax.eval_shape(gpt2_small)
    names = st.match(
        [
            (r"wte$", ("tensor", None)),  # 4 does not divide 50257: the plan says so
            (r"(c_attn|c_fc)/w$", (None, "tensor")),  # column parallel
            (r"c_proj/w$", ("tensor", None)),  # row parallel
            (r"(/b|/g)$", None),  # biases and norms: small, replicated
        ],
        default=st.fsdp(mesh),  # everything else (wpe): FSDP
    )
    boxed = st.box(params, names)
    whole = st.plan(boxed, mesh)
    layer_0 = {**boxed, "h": {"0": boxed["h"]["0"]}}  # the other 11 layers are alike
    print(f"GPT-2 small, layer 0 of {LAYERS} shown, on {dict(mesh.shape)}:\n")
    print(st.plan(layer_0, mesh))
    print(
        f"\nthe whole model: {whole.total_bytes / 2**20:.1f} MiB in {len(whole.rows)} arrays, "
        f"{whole.device_bytes / 2**20:.1f} MiB on the most loaded chip"
    )
    print("\nwhy:")
    for row in whole.rows:
        if row.path in ("wte", "wpe", "h/0/mlp/c_fc/w", "h/0/ln_1/g"):
            print(f"  {row.path}:")
            print("\n".join(f"    {sentence}" for sentence in row.why))


if __name__ == "__main__":
    main()
