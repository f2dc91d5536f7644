"""Which layout, remat policy and microbatch count for Llama-3 8B on 256 H100s? Rank every one by the predicted time of its compiled step.

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
layer), cross-entropy and adamw. A job chooses more than a layout, so the
candidates (`st.candidates`) are every layout of 256 chips as (data, fsdp,
tensor) with data <= 8 and tensor <= 8, at a global batch of 1,024 4,096-token
sequences, times two options the step reads from `candidate.options`: the
remat policy (MaxText's names: "full" recomputes each layer, "minimal" keeps
its matmuls' outputs) and the microbatches its gradients are accumulated over
(`st.accumulate`: 1 or 4). Rows rank by the predicted seconds per sequence; the
bound stays a column. Both are models, not measurements (docs/planning.md,
"Validation", says how far the prediction was from published runs).

Run: python examples/advise.py [--quick]   (--quick: a small model on 16 chips)
The same search from the command line, on the small decoder:
     spmdtree advise examples/advise.py:quick_step --devices 16 --batch 32 --length 128 \
         --option remat=full,minimal --option microbatches=1,4 --hardware h100
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
    "full": dict(
        size="8B", chips=256, batches=(1024,), length=4096, sizes={"tensor": (1, 8), "data": (1, 8)}
    ),
    "quick": dict(
        size="tiny", chips=16, batches=(32,), length=128, sizes={"tensor": 8, "data": (1, 2)}
    ),
}
#: The options every layout is tried with: what `make_step` reads.
OPTIONS = dict(remat=("full", "minimal"), microbatches=(1, 4))


def make_step(size, length):
    """`make_step(candidate) -> (fn, args, kwargs)` for advise: the train step at
    the candidate's global batch, with its remat policy and microbatches."""

    def build(candidate):
        params = llama.params(size)
        state = jax.eval_shape(optax.adamw(1e-4).init, params)
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((candidate.batch, length + 1), jnp.int32), ("batch", "length")
        )
        kwargs = {"params": params, "donate_argnums": (0, 1)}
        step = example.make_train_step(**(candidate.options or {}))
        return step, (params, state, tokens), kwargs

    return build


#: The rules, for the command line (``spmdtree advise examples/advise.py:quick_step``
#: reads a module's RULES).
RULES = example.RULES


def quick_step(candidate):
    """`make_step(candidate)` of the small decoder, for the command line: its
    sequences `candidate.length` long (128 where not given), its remat policy and
    microbatches the candidate's options."""
    return make_step("tiny", candidate.length or 128)(candidate)


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


def what_options_changed(advice):
    """One line per choice of options: how many layouts fit with it, its lowest
    peak and its fastest fitting layout."""
    lines = []
    for options in dict.fromkeys(_chosen(row) for row in advice.rows):
        rows = [row for row in advice.rows if _chosen(row) == options]
        fit = [row for row in rows if row.verdict in ("fits", "tight")]
        peaks = [row.step.peak_bytes for row in rows if row.step is not None]
        chosen = ", ".join(f"{name} {value}" for name, value in options) or "no options"
        line = f"  {chosen}: {len(fit)} of {len(rows)} fit"
        if peaks:
            line += f", peaks {size(min(peaks))} to {size(max(peaks))}"
        if fit:
            best = max(fit, key=lambda row: row.tokens_per_second)
            line += (
                f", fastest {_label(best.candidate)} at {ms(best.time.predicted_seconds)} "
                f"({best.tokens_per_second:,.0f} tokens/s)"
            )
        lines.append(line)
    return lines


def _chosen(row):
    return tuple((row.candidate.options or {}).items())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model on 16 chips")
    parser.add_argument("--plot", metavar="PATH", help="save the advice's picture (Advice.plot)")
    parser.add_argument(
        "--step-plot", metavar="PATH", help="save the best step's time as a picture (StepPlan.plot)"
    )
    parser.add_argument(
        "--trace", metavar="PATH", help="save the best step's predicted schedule (StepPlan.trace)"
    )
    parser.add_argument("--json", metavar="PATH", help="save the advice as JSON (Advice.to_json)")
    args = parser.parse_args()
    setup = SETUPS["quick" if args.quick else "full"]
    start = time.perf_counter()
    meshes = st.layouts(setup["chips"], example.AXES, sizes=setup["sizes"])
    candidates = st.candidates(
        meshes, example.RULES, setup["batches"], length=setup["length"], **OPTIONS
    )
    h100 = st.hardware("h100")
    print(
        f"Llama-3 {setup['size']} train step, {setup['chips']} H100s as nodes of "
        f"{h100.devices_per_node}, {len(meshes)} layouts x remat {' or '.join(OPTIONS['remat'])}"
        f" x {' or '.join(map(str, OPTIONS['microbatches']))} microbatches, a global batch of "
        f"{setup['batches'][0]:,} {setup['length']}-token sequences\n"
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
        f"{', '.join(f'{name} {value}' for name, value in _chosen(best))}, "
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
    print("what the options changed:")
    print("\n".join(what_options_changed(advice)))
    print(
        f"to run it: advice.best.make_mesh() gives the jax.sharding.Mesh ({_label(best.candidate)}, "
        f"axis types {best.candidate.mesh.axis_types[0].name}) on the job's {setup['chips']} devices"
    )
    print(f"\nadvised in {time.perf_counter() - start:.0f} s, {advice.compiles} compiles")
    save(advice, h100, args)


def save(advice, hardware, args):
    """What users look at: the advice's picture and JSON, the best step's time as a
    picture and its predicted schedule as a trace (open it in ui.perfetto.dev)."""
    if args.plot:
        advice.plot(args.plot)
    if args.json:
        pathlib.Path(args.json).write_text(advice.to_json())
    best = advice.best
    if best is not None and args.step_plot:
        best.step.plot(hardware, args.step_plot)
    if best is not None and args.trace:
        best.step.trace(hardware, args.trace)
    written = [path for path in (args.plot, args.json, args.step_plot, args.trace) if path]
    if written:
        print("wrote " + ", ".join(written))


def ms(seconds):
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def size(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _label(candidate):
    return " x ".join(f"{axis} {size}" for axis, size in candidate.mesh.shape.items())


if __name__ == "__main__":
    main()
