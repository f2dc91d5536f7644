"""What a TPU chip's run records for the tests and the docs (new in 0.7).

- ``fixture``: tests/chip_step.py's step run by `st.measure` on the chip, its
  profile kept (``fixture_trace.json.gz``) with the measured times
  (``fixture.json``): tests/test_measure.py joins it to the deviceless compile of
  the same step, without a chip (tests/data).
- ``calibrate``: `st.calibrate()` on the chip, timed (``chip.json``, the
  calibrated `Hardware`).
- ``advise``: `st.advise(..., measure=2)` over three remat policies (full, minimal,
  torchtitan's named one) of benchmarks/measured.py's small decoder step on the
  chip: the two best predicted that fit, run and ranked by measured time.
- ``update``: an in-place update of a block of 512 positions into a buffer's
  second-minor dimension, f32 and bf16, at an offset given when it runs, at a
  constant one, in a loop, and along the leading dimension, each by `st.measure`
  (``update.json``): which of them libtpu leaves unfused, and how fast each runs
  (`Hardware.update_efficiency`).

- ``moe``: examples/moe.py's step at a size one chip holds (the experts unsharded),
  by `st.measure` on the chip's own figures (``chip.json``, where ``calibrate`` ran
  first) and the preset, with its grouped matmuls and its gathers and scatters
  measured against their predicted time (``moe.json``; new in 0.8).

- ``recipe``: docs/planning.md's "One chip and a laptop", its VM half as the page
  writes it (new in 0.8): ``spmdtree calibrate --json chip.json`` in DIR, timed (its
  figures, and each benchmark's time), then the page's Python
  blocks for the VM, run in DIR.

Run on the chip: python benchmarks/chip.py --out DIR [fixture calibrate advise update moe recipe]
Without a chip it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax

import spmdtree as st

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))


def fixture(out: pathlib.Path) -> None:
    """The recorded step: measured, its profile kept beside its times."""
    import chip_step

    with tempfile.TemporaryDirectory() as folder:
        m = st.measure(
            chip_step.step,
            chip_step.params(),
            chip_step.tokens(),
            mesh=chip_step.mesh(False),
            donate_argnums=0,
            steps=10,
            profile_dir=folder,
        )
        trace = sorted(pathlib.Path(folder).rglob("perfetto_trace.json.gz"))[-1]
        shutil.copy(trace, out / "fixture_trace.json.gz")
    print(m)
    record = {"versions": versions(), "times": list(m.times), "seconds": m.seconds}
    (out / "fixture.json").write_text(json.dumps(record, indent=1))
    described(out / "fixture_trace.json.gz")


def described(path: pathlib.Path) -> None:
    """What the trace holds: its processes, threads and most frequent events."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e.get("pid"), e.get("tid"))] = e["args"].get("name")
    print("tracks:", json.dumps({f"{k[0]}/{k[1]}": v for k, v in names.items()})[:3000])
    counts = collections.Counter((e.get("pid"), e.get("tid"), e.get("name")) for e in events)
    for (pid, tid, name), n in counts.most_common(25):
        print(f"  {names.get((pid, tid)) or names.get((pid, None))} : {name!r} x{n}")
    ops = [e for e in events if names.get((e.get("pid"), e.get("tid"))) == "XLA Ops"]
    print("an op event:", json.dumps(ops[:2])[:1500])


def calibrate(out: pathlib.Path) -> None:
    start = time.perf_counter()
    calibrated = st.calibrate()
    print(f"st.calibrate() in {time.perf_counter() - start:.1f} s")
    print(calibrated.to_json())
    (out / "chip.json").write_text(calibrated.to_json())


def advise(out: pathlib.Path) -> None:
    """Three remat policies of a decoder step on the chip, the two best measured."""
    import measured

    hardware = one_chip_hardware(out)
    row = measured.ROWS[0]  # the small decoder, attention by XLA's kernels

    def make_step(candidate: st.Candidate) -> tuple[Any, ...]:
        remat = dict(candidate.options)["remat"]
        model = measured.dataclasses.replace(row.model, remat=remat)
        a = measured.Row(row.name, model, candidate.batch).arguments(candidate.mesh)
        fn, args = a.pop("fn"), a.pop("args")
        a.pop("mesh")
        a.pop("rules")
        return fn, args, a

    mesh = measured.one_chip()
    candidates = st.candidates([mesh], measured.RULES, [4], remat=("full", "minimal", "op"))
    start = time.perf_counter()
    advice = st.advise(make_step, candidates, hardware=hardware, measure=2)
    print(f"advise(measure=2) in {time.perf_counter() - start:.1f} s")
    print(advice)
    (out / "advice.json").write_text(advice.to_json())


def update(out: pathlib.Path) -> None:
    """The unfused update's probe: each form's slowest instructions, measured."""
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    found: dict[str, Any] = {}

    def run(name: str, fn: Any, *args: Any) -> None:
        m = st.measure(
            fn,
            *args,
            mesh=mesh,
            hardware=st.hardware("tpu-v5e"),
            steps=5,
            warmup=2,
            donate_argnums=(0,),
        )
        ops = sorted(m.ops, key=lambda o: -(o.measured_seconds or 0))[:6]
        found[name] = {
            "seconds": m.seconds,
            "predicted": m.predicted_seconds,
            "ops": [
                dict(
                    name=o.name,
                    opcode=o.opcode,
                    calls=o.calls,
                    measured=o.measured_seconds,
                    predicted=o.predicted_seconds,
                    bytes=o.bytes,
                    shape=o.shape,
                )
                for o in ops
            ],
        }
        print(name, json.dumps(found[name])[:900], flush=True)

    def loop(b: Any, u: Any) -> Any:
        def body(j: Any, b: Any) -> Any:
            return lax.dynamic_update_slice_in_dim(b, u * j.astype(u.dtype), j * 512, axis=2)

        return lax.fori_loop(0, 4, body, b)

    for dtype in (jnp.float32, jnp.bfloat16):
        buf = jax.ShapeDtypeStruct((8, 8, 2048, 128), dtype)
        upd = jax.ShapeDtypeStruct((8, 8, 512, 128), dtype)
        i, n = jnp.asarray(512, jnp.int32), jnp.dtype(dtype).name
        run(
            f"{n} runtime offset",
            lambda b, u, i: lax.dynamic_update_slice_in_dim(b, u, i, axis=2),
            buf,
            upd,
            i,
        )
        run(
            f"{n} offset*8",
            lambda b, u, i: lax.dynamic_update_slice_in_dim(b, u, (i // 8) * 8, axis=2),
            buf,
            upd,
            i,
        )
        run(
            f"{n} offset 512 const",
            lambda b, u: lax.dynamic_update_slice_in_dim(b, u, 512, axis=2),
            buf,
            upd,
        )
        run(f"{n} loop j*512", loop, buf, upd)
        run(
            f"{n} leading dim",
            lambda b, u, i: lax.dynamic_update_slice_in_dim(
                b, u.reshape(2, 8, 2048, 128)[:2], i, axis=0
            ),
            buf,
            upd,
            i,
        )
    (out / "update.json").write_text(json.dumps({"versions": versions(), **found}, indent=1))


#: examples/moe.py's model at a size one chip holds (new in 0.8): 4 layers of width
#: 1,024, 8 experts of 4,096 hidden units, top-2, 4 sequences of 1,024 tokens (8 of
#: them need 15.8 GiB of temporaries: one more than a v5e has).
MOE_SIZES = dict(
    vocab=256, length=1024, width=1024, layers=4, heads=8, experts=8, mlp=4096, batch=4
)


def moe(out: pathlib.Path) -> None:
    """examples/moe.py's step on one chip (the experts unsharded: every axis of size
    1), measured beside its prediction on the chip's own figures (chip.json, where
    calibrate ran first) and on the preset; its grouped matmuls' and its gathers' and
    scatters' measured time against their predicted (moe.json)."""
    import functools

    import optax

    sys.path.insert(0, str(HERE.parent / "examples"))
    import moe as example

    cfg = example.Config(**MOE_SIZES)
    mesh = jax.make_mesh((1, 1), ("expert", "data"), devices=jax.devices()[:1])
    rules = example.make_rules()
    params = example.init_params(jax.random.key(0), cfg, mesh, rules)
    tx = optax.adamw(1e-4)
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
    batch = example.make_batch(jax.random.key(1), cfg, mesh, rules)
    step = functools.partial(example.train_step, cfg=cfg, tx=tx)
    hardware = one_chip_hardware(out)
    m = st.measure(
        step,
        params,
        state,
        batch,
        mesh=mesh,
        rules=rules,
        hardware=hardware,
        steps=10,
        donate_argnums=(0, 1),
    )
    print(m)
    preset = m.plan.time(st.hardware("tpu-v5e")).predicted_seconds
    kernels = list(m.plan.schedule.kernels()) if m.plan.schedule else []
    record: dict[str, Any] = {
        "versions": versions(),
        "sizes": {**MOE_SIZES, "top_k": cfg.top_k},
        "hardware": hardware.name,
        "measured": m.seconds,
        "predicted": m.predicted_seconds,
        "predicted_on_the_preset": preset,
    }
    for what in ("grouped", "indexed"):
        names = {k.name for k in kernels if getattr(k, what)}
        ops = [o for o in m.ops if o.name in names]
        record[what] = {
            "measured": sum(o.measured_seconds for o in ops),
            "predicted": sum(o.predicted_seconds for o in ops),
            "flops": sum(o.flops * o.calls for o in ops),
            "bytes": sum(o.bytes * o.calls for o in ops),
            "ops": len(ops),
        }
    print(json.dumps(record, indent=1), flush=True)
    (out / "moe.json").write_text(json.dumps(record, indent=1))
    (out / "moe_measured.json").write_text(m.to_json())  # every instruction's times


#: The recipe's heading in docs/planning.md.
RECIPE = "### One chip and a laptop (new in 0.8)"
#: What a docs block's first line says where it runs on the chip, or compiles with
#: libtpu on a laptop (tests/test_docs.py reads the same).
ON_THE_CHIP, NEEDS_LIBTPU = "on the TPU VM", "needs spmdtree[tpu]"


def recipe_blocks() -> list[str]:
    """The Python blocks of docs/planning.md's recipe that run on the VM, in order: its
    shared definitions and the blocks whose first line says `ON_THE_CHIP` (the
    laptop's, `NEEDS_LIBTPU`, left out)."""
    page = (HERE.parent / "docs" / "planning.md").read_text()
    section = page.split(RECIPE, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return [block for block in blocks if NEEDS_LIBTPU not in block.splitlines()[0]]


#: ``spmdtree calibrate``'s own main, each benchmark's time said on stderr as it ends.
TIMED = """
import importlib, sys, time
calibrate = importlib.import_module("spmdtree._src.step.measure.calibrate")
run = calibrate._Bench.run
def timed(self, fn, *specs, **keywords):
    start = time.perf_counter()
    try:
        return run(self, fn, *specs, **keywords)
    finally:
        name = getattr(fn, "__qualname__", fn)
        print(f"  {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
calibrate._Bench.run = timed
from spmdtree._src.cli import main
sys.exit(main())
"""


def recipe_calibrate(out: pathlib.Path) -> None:
    """The recipe's first command on the VM, timed, in its own process (which holds
    the chip until it ends): ``spmdtree calibrate --json chip.json``, its main run
    with each benchmark's time said as it ends (where the time went)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", TIMED, "calibrate", "--json", "chip.json"]
    start = time.perf_counter()
    if subprocess.run(command, cwd=out).returncode:
        return  # no chip: it said why
    print(f"spmdtree calibrate --json chip.json in {time.perf_counter() - start:.1f} s", flush=True)


def recipe(out: pathlib.Path) -> None:
    """The recipe's Python blocks for the VM, as the page writes them, run in `out`
    (where ``chip.json`` is)."""
    here = os.getcwd()
    os.chdir(out)
    try:
        namespace: dict[str, Any] = {}
        for block in recipe_blocks():
            exec(compile(block, "docs/planning.md", "exec"), namespace)
    finally:
        os.chdir(here)


def one_chip_hardware(out: pathlib.Path) -> st.Hardware:
    """The chip calibrate recorded in `out` (or --hardware's), else the preset."""
    path = out / "chip.json"
    return st.Hardware.from_json(path) if path.exists() else st.hardware("tpu-v5e")


def versions() -> str:
    from importlib import metadata

    return (
        f"{time.strftime('%Y-%m-%d')} on {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"libtpu {metadata.version('libtpu')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("what", nargs="*", default=["fixture", "calibrate", "advise"])
    args = parser.parse_args()
    if "recipe" in args.what:
        recipe_calibrate(args.out)  # before this process takes the chip
    if jax.devices()[0].platform != "tpu":
        print("no TPU here: benchmarks/chip.py records a chip's run")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = {
        "fixture": fixture,
        "calibrate": calibrate,
        "advise": advise,
        "update": update,
        "moe": moe,
        "recipe": recipe,
    }
    for what in args.what:
        jobs[what](args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
