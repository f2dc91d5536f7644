"""Predicted beside measured on a TPU chip (docs/planning.md, "Held against the chip").

Training steps of a Llama-style decoder (benchmarks/validate.py's `Model`: fp32 master
weights, bf16 compute, adamw, RoPE, SwiGLU, scanned layers), two sizes, attention by
XLA's kernels over the whole scores, in query-key blocks, and by splash attention
(causal), remat full, minimal and torchtitan's named policy, 2,048 and 8,192 tokens,
and one step near the chip's memory. On a chip, each row is run by `st.measure`
(warm-up, timed steps, a profile joined per instruction) and predicted on the
preset's figures and on the chip's own, measured by `st.calibrate` first (never
from these steps). The results are written as JSON (`--out`).

Without a chip it says so and exits 0; `--recorded FILE` then predicts each recorded
row again by the deviceless target compile (libtpu without the chip, the
`spmdtree[tpu]` extra) on the recorded calibration, and sets it beside the
recorded measurements: the docs' table.

Run on the chip:   python benchmarks/measured.py --calibrate --out DIR
Here, afterwards:  python benchmarks/measured.py --recorded DIR/measured.json
Goal (with the calibrated chip): mean |predicted/measured - 1| <= 10%, each <= 20%;
exit 1 where it is missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from validate import RULES, Model

import spmdtree as st

#: The goal, with the calibrated chip.
MEAN_GOAL, EACH_GOAL = 0.10, 0.20

#: About 0.27B and 0.4B params (fp32 master weights, untied embeddings).
SMALL = Model(32000, 1024, 8, 8, 8, 128, 4096, 2048, 512, "llama", "full")
LARGE = Model(32000, 1280, 12, 10, 10, 128, 5120, 2048, 512, "llama", "full")


@dataclasses.dataclass(frozen=True)
class Row:
    """One step: its model (kernel, remat and length set) and global batch."""

    name: str
    model: Model
    batch: int

    def arguments(self, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> dict[str, Any]:
        """The step and its arguments, as st.measure and st.preflight take them."""
        params = self.model.params()
        state = jax.eval_shape(optax.adamw(1e-4).init, params)
        tokens = st.LogicallyPartitioned(
            jax.ShapeDtypeStruct((self.batch, self.model.length + 1), jnp.int32),
            ("batch", "length"),
        )
        return dict(
            fn=self.model.train_step,
            args=(params, state, tokens),
            mesh=mesh,
            rules=RULES,
            params=params,
            donate_argnums=(0, 1),
        )


def _row(name: str, model: Model, batch: int, **changes: Any) -> Row:
    return Row(name, dataclasses.replace(model, **changes), batch)


ROWS = (
    _row("S xla 2k full b8", SMALL, 8, kernel="xla"),
    _row("S blocked 2k minimal b8", SMALL, 8, kernel="blocked", remat="minimal"),
    _row("S splash 2k full b8", SMALL, 8, kernel="splash"),
    _row("S splash 2k op b16", SMALL, 16, kernel="splash", remat="op"),
    _row("S splash 8k full b2", SMALL, 2, kernel="splash", length=8192),
    _row("S blocked 8k full b2", SMALL, 2, kernel="blocked", length=8192, block=1024),
    _row("L splash 2k full b8", LARGE, 8, kernel="splash"),
    _row("L splash 2k minimal b4", LARGE, 4, kernel="splash", remat="minimal"),
    _row("L blocked 2k op b4", LARGE, 4, kernel="blocked", remat="op"),
    _row("L xla 2k full b4", LARGE, 4, kernel="xla"),
    _row("L blocked 8k op b2", LARGE, 2, kernel="blocked", remat="op", length=8192, block=1024),
    _row("L splash 2k full b28 (near memory)", LARGE, 28, kernel="splash"),
)


def one_chip() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,))


def measured(
    row: Row, hardware: list[st.Hardware], out: pathlib.Path | None = None
) -> dict[str, Any]:
    """`row` run on the chip: its times, the prediction on each of `chips`, the join;
    the whole Measurement (every instruction) as `out`/`row name`.json."""
    a = row.arguments(one_chip())
    start = time.perf_counter()
    m = st.measure(a.pop("fn"), *a.pop("args"), **a, hardware=hardware[-1], steps=5, warmup=2)
    predicted = {}
    for each in hardware:
        predicted[each.name] = m.plan.time(each).predicted_seconds
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{row.name.split(' (')[0].replace(' ', '-')}.json").write_text(m.to_json())
    return {
        "row": row.name,
        "times": list(m.times),
        "seconds": m.seconds,
        "predicted": predicted,
        "joined_share": m.joined_share,
        "peak_bytes": m.plan.peak_bytes,
        "compiler_peak_bytes": m.plan.compiler_peak_bytes,
        "misses": [dataclasses.asdict(op) for op in m.misses(5)],
        "flags": list(m.flags),
        "wall_seconds": time.perf_counter() - start,
    }


def predicted_here(row: Row, hardware: list[st.Hardware]) -> dict[str, float | None]:
    """`row` compiled by libtpu without the chip, predicted on each of `chips`."""
    mesh = jax.sharding.AbstractMesh((1,), ("fsdp",), axis_types=(AxisType.Auto,))
    a = row.arguments(mesh)
    plan = st.preflight(a.pop("fn"), *a.pop("args"), **a, target="tpu-v5e")
    return {each.name: plan.time(each).predicted_seconds for each in hardware}


def table(results: list[dict[str, Any]], hardware: list[st.Hardware]) -> tuple[str, list[float]]:
    """The rows' measured and predicted times; the errors on the last chip."""
    head = f"{'step':<36}{'measured':>10}" + "".join(f"{c.name:>26}" for c in hardware)
    lines, errors = [head], []
    for r in results:
        cells = ""
        for each in hardware:
            p = r["predicted"][each.name]
            cells += f"{p * 1e3:>14.1f} ms {p / r['seconds']:>6.2f}x"
        errors.append(abs(r["predicted"][hardware[-1].name] / r["seconds"] - 1))
        lines.append(f"{r['row']:<36}{r['seconds'] * 1e3:>7.1f} ms{cells}")
    for each in hardware:
        errs = [abs(r["predicted"][each.name] / r["seconds"] - 1) for r in results]
        lines.append(
            f"{each.name}: mean |ratio - 1| {statistics.mean(errs):.1%}, largest {max(errs):.1%}"
        )
    return "\n".join(lines), errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="a folder for measured.json and chip.json")
    parser.add_argument("--calibrate", action="store_true", help="st.calibrate() the chip first")
    parser.add_argument("--hardware", help="a calibrated chip's JSON (Hardware.to_json)")
    parser.add_argument("--rows", help="the rows to run, by their numbers (0-based): 0,3,5")
    parser.add_argument(
        "--recorded", type=pathlib.Path, nargs="+", help="predict a chip's results here"
    )
    args = parser.parse_args()
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else list(ROWS)
    preset = st.hardware("tpu-v5e")
    if args.recorded:
        return again(args.recorded, rows, preset)
    if jax.devices()[0].platform != "tpu":
        print(
            "no TPU here: benchmarks/measured.py measures on a chip (--recorded FILE "
            "predicts a chip's results here)"
        )
        return 0
    own = preset
    if args.hardware:
        own = st.Hardware.from_json(args.hardware)
    elif args.calibrate:
        start = time.perf_counter()
        own = st.calibrate()
        print(f"st.calibrate() in {time.perf_counter() - start:.1f} s")
    print(own.to_json())
    results = []
    for row in rows:
        try:
            results.append(measured(row, [preset, own], args.out))
        except Exception as e:  # a row that fails is said, and the others still run
            print(f"{row.name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        print(json.dumps(results[-1]), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            record = {
                "versions": versions(),
                "hardware": json.loads(own.to_json()),
                "rows": results,
            }
            (args.out / "measured.json").write_text(json.dumps(record, indent=1))
    print(table(results, [preset, own])[0])
    return 0


def again(paths: list[pathlib.Path], rows: list[Row], preset: st.Hardware) -> int:
    """The recorded rows predicted here by the deviceless compile: the docs' table."""
    records = [json.loads(path.read_text()) for path in paths]
    record = records[0]
    calibrated = st.Hardware.from_json(json.dumps(record["hardware"]))
    by_name = {row.name: row for row in rows}
    results = []
    for r in [r for each in records for r in each["rows"]]:
        if r["row"] in by_name:  # predicted again: by this code, as the chip ran it
            results.append(
                {**r, "predicted": predicted_here(by_name[r["row"]], [preset, calibrated])}
            )
    print(
        f"measured {record['versions']}; predicted here by deviceless libtpu, jax {jax.__version__}"
    )
    text, errors = table(results, [preset, calibrated])
    print(text)
    if statistics.mean(errors) > MEAN_GOAL or max(errors) > EACH_GOAL:
        print(f"goal missed: mean <= {MEAN_GOAL:.0%}, each <= {EACH_GOAL:.0%}")
        return 1
    return 0


def versions() -> str:
    from importlib import metadata

    return (
        f"{time.strftime('%Y-%m-%d')} on {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"libtpu {metadata.version('libtpu')}"
    )


if __name__ == "__main__":
    sys.exit(main())
