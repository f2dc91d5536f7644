"""Which layout for Llama-3 8B on 256 H100s? Rank every one by the predicted time of its compiled step.

`st.advise` takes candidate layouts (a mesh, rules, a global batch) and a
function that builds the step for each. It plans each candidate's arrays first
(one whose params and optimizer state alone exceed the budget is not
compiled), preflights the rest in parallel subprocesses, each distinct step
once (on XLA GPU where it is installed, else on the CPU estimate), and times
each compiled step on the hardware with `StepPlan.time`: the predicted step
time, a walk of the compiled schedule (each kernel timed by a model, each
async collective hidden only by the compute scheduled beside it), beside the
roofline bound (its FLOPs at the chip's peak, its collectives at the links'
bandwidth: NVLink within a node of 8, InfiniBand across, hierarchically).

The step is examples/preflight.py's: a Llama-3 8B decoder (bf16, remat per
layer), cross-entropy and adamw. The candidates: every layout of 256 chips as
(data, fsdp, tensor) with tensor <= 8, at two global batches of 4,096-token
sequences. Rows rank by the predicted seconds per sequence; the bound stays a
column. Both are models, not measurements (docs/planning.md, "Validation",
says how far the prediction was from published runs).

Run: python examples/advise.py [--quick]   (--quick: a small model on 16 chips)
"""

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

import spmdtree as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
devices_before = jax.config.jax_num_cpu_devices
import llama  # noqa: E402  abstract Llama-3 param trees
import preflight as example  # noqa: E402  the 8B train step and its rules

# examples/preflight.py gives this process 2,048 CPU devices to compile in; here
# every compile goes to a subprocess, several at once, so keep the default.
jax.config.update("jax_num_cpu_devices", devices_before)

#: A small decoder for --quick: the same code path, seconds per compile.
llama.SIZES.setdefault(
    "tiny", dict(vocab=512, embed=128, layers=2, heads=8, kv_heads=8, head_dim=16, mlp=256)
)
SETUPS = {
    "full": dict(size="8B", chips=256, batches=(256, 512), length=4096, sizes={"tensor": (1, 8)}),
    "quick": dict(
        size="tiny", chips=16, batches=(16, 32), length=128, sizes={"tensor": 8, "data": (1, 2)}
    ),
}


def make_step(size, length):
    """`make_step(candidate) -> (fn, args, kwargs)` for advise: the train step at
    the candidate's global batch."""

    def build(candidate):
        params = llama.params(size)
        state = jax.eval_shape(optax.adamw(1e-4).init, params)
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((candidate.batch, length + 1), jnp.int32), ("batch", "length")
        )
        kwargs = {"params": params, "donate_argnums": (0, 1)}
        return example.train_step, (params, state, tokens), kwargs

    return build


def why_others_lost(advice):
    """One line per way a candidate lost to the best."""
    best = advice.best
    lines = []
    slower = [row for row in advice.rows if row.verdict == "fits" and row is not best]
    if slower:
        ratios = [best.tokens_per_second / row.tokens_per_second for row in slower]
        comm = sum(row.time.comm_seconds > row.time.compute_seconds for row in slower)
        ties = sum(abs(ratio - 1) < 1e-9 for ratio in ratios)
        lines.append(
            f"  {len(slower)} fit but are slower: the best's tokens/s is {min(ratios):.2f}x to "
            f"{max(ratios):.2f}x theirs ({comm} bound by collectives, {len(slower) - comm} by "
            "compute)"
        )
        if ties:
            lines.append(
                f"  {ties} of them tie at the compute bound, with more collectives to overlap"
            )
    tight = [row for row in advice.rows if row.verdict == "tight"]
    if tight:
        lines.append(
            f"  {len(tight)} fit within {advice.margin:.0%} of the budget (tight): too close to "
            "count on"
        )
    over = [row for row in advice.rows if row.verdict in ("may fit", "over budget")]
    if over:
        planned = sum(row.step is None for row in over)
        lines.append(
            f"  {len(over)} over the budget: {planned} by their arrays alone (not compiled), "
            f"{len(over) - planned} by the compiled step's peak"
        )
    unsharded = [row for row in advice.rows if row.verdict == "batch unsharded"]
    if unsharded:
        lines.append(
            f"  {len(unsharded)} are no layout: their batch axes do not divide their batch"
        )
    failed = [row for row in advice.rows if row.verdict == "does not compile"]
    if failed:
        lines.append(f"  {len(failed)} do not compile: {failed[0].reason}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model on 16 chips")
    args = parser.parse_args()
    setup = SETUPS["quick" if args.quick else "full"]
    start = time.perf_counter()
    meshes = st.layouts(setup["chips"], example.AXES, sizes=setup["sizes"])
    candidates = [
        st.Candidate(mesh, example.RULES, batch, length=setup["length"])
        for batch in setup["batches"]
        for mesh in meshes
    ]
    h100 = st.hardware("h100")
    print(
        f"Llama-3 {setup['size']} train step, {setup['chips']} H100s as nodes of "
        f"{h100.devices_per_node}, {len(meshes)} layouts x {len(setup['batches'])} global "
        f"batches of {setup['length']}-token sequences\n"
    )
    advice = st.advise(make_step(setup["size"], setup["length"]), candidates, hardware=h100)
    print(advice)
    best = advice.best
    if best is None:
        print("\nno candidate fits")
        return
    t = best.time
    print(
        f"\nbest: {best.candidate.label or _label(best.candidate)}, "
        f"global batch {best.candidate.batch}: bound {ms(t.bound_seconds)} per step "
        f"(compute {ms(t.compute_seconds)}, collectives {ms(t.comm_seconds)}), "
        f"{best.tokens_per_second:,.0f} tokens/s at the predicted time"
    )
    print(
        "collectives by mesh axes: "
        + ", ".join(
            f"{'+'.join(axes) or '-'} {ms(seconds)}" for axes, seconds in t.comm_by_axes.items()
        )
    )
    print("why the others lost:")
    print("\n".join(why_others_lost(advice)))
    print(
        f"to run it: advice.best.make_mesh() gives the jax.sharding.Mesh ({_label(best.candidate)}, "
        f"axis types {best.candidate.mesh.axis_types[0].name}) on the job's {setup['chips']} devices"
    )
    print(f"\nadvised in {time.perf_counter() - start:.0f} s, {advice.compiles} compiles")


def ms(seconds):
    return f"{seconds * 1e3:.3g} ms"


def _label(candidate):
    return " x ".join(f"{axis} {size}" for axis, size in candidate.mesh.shape.items())


if __name__ == "__main__":
    main()
