"""Plan Llama-3 training on 256 and 2,048 chips, on a laptop: which rule sets fit?

Builds abstract Llama-3 8B, 70B and 405B param trees from the published shapes
(bf16, layers stacked, MaxText-style logical names; see examples/llama.py),
and for four rule sets — pure FSDP, FSDP + tensor, data x FSDP x tensor, and
data x tensor without FSDP — on
`jax.sharding.AbstractMesh`es of 256 and 2,048 chips, computes the bytes each
chip holds of the params, their grads and adamw's state. Nothing is allocated
and no device is needed: the figures are exact for these shardings. They count
these arrays only: a training step also needs activations and the compiler's
temporaries, often several times more (examples/preflight.py compiles the
whole step with `st.preflight`). It prints which rule sets' arrays fit a
per-chip budget, and what moving from one rule set to another costs.

Run: python examples/plan_llama.py [--budget-gib 96]
"""

import argparse
import pathlib
import sys
import time

import jax
import optax

import spmdtree as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import llama  # abstract Llama-3 param trees

GIB = 2**30
AXES = ("data", "fsdp", "tensor")
#: name -> (rules, {chips: mesh shape over AXES}). Every mesh has all three axes
#: (size 1 where unused), so one rule set serves them all.
TENSOR = llama.TENSOR_RULES
RULE_SETS = {
    "fsdp": ([("embed", "fsdp")], {256: (1, 256, 1), 2048: (1, 2048, 1)}),
    "fsdp+tensor": ([("embed", "fsdp"), *TENSOR], {256: (1, 32, 8), 2048: (1, 256, 8)}),
    "data*fsdp*tensor": ([("embed", "fsdp"), *TENSOR], {256: (8, 4, 8), 2048: (8, 32, 8)}),
    "data*tensor": (TENSOR, {256: (32, 1, 8), 2048: (256, 1, 8)}),  # no FSDP: params replicated
}


def per_chip(size: str, chips: int, name: str) -> tuple[int, int, st.Plan]:
    """(params bytes, adamw state bytes) on the most loaded chip, and the params' plan."""
    rules, shapes = RULE_SETS[name]
    mesh = jax.sharding.AbstractMesh(shapes[chips], AXES)
    params = llama.params(size)
    state = jax.eval_shape(optax.adamw(1e-4).init, params)
    planned = st.plan(params, mesh, rules)
    return planned.device_bytes, st.plan(state, mesh, rules, params=params).device_bytes, planned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=96.0, help="memory per chip")
    args = parser.parse_args()
    budget = int(args.budget_gib * GIB)
    start = time.perf_counter()
    print(f"params + grads + adamw state per chip, bf16, against {args.budget_gib:g} GiB\n")
    print(
        f"{'model':<6}{'chips':>6}  {'rule set':<17}{'mesh':<11}"
        f"{'params':>9}{'grads':>9}{'adamw':>9}{'total':>10}  arrays fit"
    )
    plans = {}
    for size in llama.SIZES:
        for chips in (256, 2048):
            for name, (_, shapes) in RULE_SETS.items():
                params, state, planned = per_chip(size, chips, name)
                plans[size, chips, name] = planned
                total = 2 * params + state  # grads are laid out like the params
                mesh = "x".join(map(str, shapes[chips]))
                print(
                    f"{size:<6}{chips:>6}  {name:<17}{mesh:<11}{params / GIB:>8.2f}G"
                    f"{params / GIB:>8.2f}G{state / GIB:>8.2f}G{total / GIB:>9.2f}G  "
                    + ("yes" if total <= budget else f"no, {(total - budget) / GIB:.1f} GiB over")
                )
    before, after = plans["405B", 256, "fsdp"], plans["405B", 256, "fsdp+tensor"]
    print("\n405B params on 256 chips, moving from fsdp to fsdp+tensor (a reshard):")
    print(before.diff(after))
    why = {row.path: row.why for row in after.rows}["layers/wi_0"]
    print("\nwhy layers/wi_0 is laid out as it is under fsdp+tensor:")
    print("\n".join(f"  {sentence}" for sentence in why))
    print(
        f"\nplanned {len(plans)} layouts in {time.perf_counter() - start:.1f} s, no device memory"
    )
    print(
        "'arrays fit' counts params, grads and optimizer state only, not activations or "
        "the compiler's\ntemporaries: for the whole step, see examples/preflight.py "
        "(st.preflight)."
    )


if __name__ == "__main__":
    main()
