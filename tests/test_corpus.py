"""benchmarks/corpus.py's training steps build and compile at their tiny sizes, its chip
run measures and records a step (on the CPU here), and a recorded run prints as the
docs' table, its goal judged."""

import importlib.util
import json
import pathlib
import sys

import pytest

import spmdtree as st

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "corpus.py"
_SPEC = importlib.util.spec_from_file_location("corpus_benchmark", _PATH)
corpus = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = corpus  # its dataclasses look their module up
_SPEC.loader.exec_module(corpus)

#: A CPU's own figures are no preset's: a hardware to time the prediction on.
CPU = st.Hardware("cpu", 2**34, 1e11, {"ici": (1e10, 0.0)})


def recorded(*ratios):
    """A recorded run of one family per (calibrated ratio, op_error), one skipped."""
    families = [
        {
            "family": f"f{i}",
            "what": "a step",
            "times": [0.02, 0.02],
            "seconds": 0.02,
            "calibrated": {"predicted": 0.02 * ratio, "ratio": ratio, "op_error": op},
            "preset": {"predicted": 0.01, "ratio": 0.5, "op_error": 0.6},
        }
        for i, (ratio, op) in enumerate(ratios)
    ]
    skipped = {"family": "gemma", "what": "flax", "skipped": "No module named 'flax'"}
    return {
        "versions": "2026-12-07 on TPU v5 lite, jax 0.10.2, libtpu 0.0.42.1",
        "hardware": {"name": "tpu-v5e, calibrated"},
        "preset": "tpu-v5e",
        "families": [*families, skipped],
    }


#: int8's is compiled and run by the measurement's test below.
COMPILED = [f for f in corpus.FAMILIES if f.name != "int8"]


@pytest.mark.parametrize("family", COMPILED, ids=[f.name for f in COMPILED])
def test_each_family_builds_tiny_and_compiles_as_a_training_step(family):
    step = family.build(here=False, tiny=True)
    plan = st.preflight(step.fn, *step.args, **step.kwargs)
    assert plan.flops > 0 and plan.peak_bytes > 0
    # params and adamw state donated, and fed back by the outputs (as st.measure runs it)
    assert step.kwargs["donate_argnums"] == (0, 1)
    assert plan.time(st.hardware("tpu-v5e")).predicted_seconds > 0


def test_run_measures_each_family_and_records_the_failures_beside(tmp_path):
    def broken(**_):
        raise RuntimeError("no such step")

    def absent(**_):
        raise ModuleNotFoundError("No module named 'equinox'")

    families = [
        next(f for f in corpus.FAMILIES if f.name == "int8"),
        corpus.Family("broken", "fails", broken),
        corpus.Family("absent", "needs equinox", absent),
    ]
    preset = st.hardware("tpu-v5e")
    record = corpus.run(families, CPU, preset, tmp_path, tiny=True)
    ran, failed, skipped = record["families"]
    assert ran["seconds"] > 0 and len(ran["times"]) == 5
    assert ran["calibrated"]["ratio"] == pytest.approx(
        ran["calibrated"]["predicted"] / ran["seconds"]
    )
    # the preset's prediction, joined per instruction to the same profile and times
    assert ran["preset"]["ratio"] == pytest.approx(ran["preset"]["predicted"] / ran["seconds"])
    assert ran["preset"]["predicted"] != ran["calibrated"]["predicted"]
    assert ran["preset"]["op_error"] > 0
    assert failed["error"] == "RuntimeError: no such step"
    assert "equinox" in skipped["skipped"]
    assert json.loads((tmp_path / "corpus.json").read_text()) == json.loads(json.dumps(record))
    measurement = json.loads((tmp_path / "int8.json").read_text())
    assert measurement["schema"] == "spmdtree.Measurement/1"
    assert measurement["hardware"] == "cpu"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.json", "int8.json"]


def test_the_table_shows_each_family_on_both_hardwares_and_the_summary():
    text = corpus.table(recorded((1.05, 0.08), (0.9, 0.2)))
    lines = text.splitlines()
    assert lines[0] == "Measured 2026-12-07 on TPU v5 lite, jax 0.10.2, libtpu 0.0.42.1."
    assert lines[2].startswith("| family | measured | tpu-v5e, calibrated | ratio | op_error |")
    assert "| f0 | 20.0 ms | 21.0 ms | 1.05 | 8% | 10.0 ms | 0.50 | 60% |" in lines
    assert any(line.startswith("| gemma | skipped: No module named 'flax'") for line in lines)
    assert lines[-2] == (
        "calibrated (tpu-v5e, calibrated): mean |ratio - 1| 7.5%, largest 10.0%; "
        "largest op_error 20.0% (2 families)"
    )
    assert lines[-1].startswith("preset (tpu-v5e): mean |ratio - 1| 50.0%")


@pytest.mark.parametrize(
    ("ratios", "code", "said"),
    [
        ([(1.04, 0.05), (0.97, 0.1)], 0, []),
        (
            [(1.0, 0.05), (1.0, 0.05), (0.88, 0.3)],
            1,
            ["f2: |ratio - 1| 12.0% > 10%", "f2: op_error 30.0% > 10%"],
        ),
        ([(1.08, 0.05), (0.92, 0.05)], 1, ["mean |ratio - 1| 8.0% > 5%"]),
    ],
    ids=["met", "one step over", "the mean over"],
)
def test_recorded_prints_the_table_and_exits_1_where_the_goal_is_missed(
    tmp_path, capsys, ratios, code, said
):
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(recorded(*ratios)))
    assert corpus.main(["--recorded", str(path)]) == code
    out = capsys.readouterr().out
    assert "| f0 |" in out
    missed = [line for line in out.splitlines() if line.startswith("goal missed: ")]
    assert len(missed) == len(said)
    for line, words in zip(missed, said, strict=True):
        assert words in line


def test_recorded_joins_a_run_made_in_parts(tmp_path, capsys):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    first, second = recorded((1.0, 0.05)), recorded((1.02, 0.05))
    second["families"][0]["family"] = "f9"
    for path, record in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(record))
    assert corpus.main(["--recorded", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "| f0 | 20.0 ms | 20.0 ms | 1.00 |" in out and "| f9 | 20.0 ms | 20.4 ms | 1.02 |" in out
    assert "mean |ratio - 1| 1.0%, largest 2.0%" in out


def test_without_a_tpu_it_says_so_and_exits_0(capsys):
    assert corpus.main([]) == 0
    assert capsys.readouterr().out.startswith("no TPU here: benchmarks/corpus.py measures")


def test_only_names_the_families_and_refuses_an_unknown_one():
    assert [f.name for f in corpus.chosen("cnn,moe")] == ["cnn", "moe"]
    with pytest.raises(SystemExit, match="no family \\['resnet'\\]"):
        corpus.chosen("resnet")
