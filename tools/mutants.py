"""Mutation check: does the test suite notice a planted bug?

For each mutant below, this copies the repository's tracked files to a
temporary directory, plants one bug in the copy of the package (a text
replacement that must apply exactly once), confirms that the copy is what
``import spmdtree`` loads there, and runs the test suite (``pytest -x``) on it.
A mutant is *killed* if a test fails, and *survives* if the suite passes.
Every mutant changes a result a user would see; a survivor is a hole in the net.

Run: python tools/mutants.py [names...] [--tests FILE...]   (about a minute per mutant)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: name -> [(file under spmdtree/, old text, new text), ...]
MUTANTS: dict[str, list[tuple[str, str, str]]] = {
    "own-rules-ignored": [
        ("_src/boxes.py", "own = rules if meta.rules is None else meta.rules", "own = rules"),
    ],
    "scan-drops-kwargs": [
        ("_src/transforms.py", "length=length, **kwargs)", "length=length)"),
    ],
    "params-tie-resolved": [
        (
            "_src/specs.py",
            "return next(iter(shapes)) if len(shapes) == 1 else AMBIGUOUS",
            "return next(iter(shapes))",
        ),
    ],
    "no-divisibility-check-logical": [
        ("_src/rules.py", "elif dim.size is not None and dim.size % size:", "elif False:"),
    ],
    "no-divisibility-check-mesh-names": [
        ("_src/rules.py", "if length is not None and length % size:", "if False:"),
    ],
    "rule-typo-skipped": [
        (
            "_src/rules.py",
            "        if missing:\n",
            "        if missing:\n            continue\n        if missing:\n",
        ),
    ],
    "fewer-dims-replicated": [
        ("_src/rules.py", "if len(shape) < len(names) and not placeholder:", "if False:"),
    ],
    "raise-error-needs-a-mesh": [
        (
            "_src/constraints.py",
            "if res.unmatched and fallback is RulesFallback.RAISE_ERROR:",
            "if res.unmatched and fallback is RulesFallback.RAISE_ERROR and live is not None:",
        ),
    ],
    "unbox-one-level": [
        (
            "_src/trees.py",
            "map_leaves(lambda x: _unboxed(x.unbox()) if is_boxed(x) else x, tree)",
            "map_leaves(lambda x: x.unbox() if is_boxed(x) else x, tree)",
        ),
    ],
    "remove-axis-any-name": [
        ("_src/boxes.py", "if check and names[index] != name:", "if False:"),
    ],
    "add-axis-negative-index": [
        (
            "_src/boxes.py",
            "    index %= size\n    return (*names[:index], name, *names[index:])",
            "    return (*names[:index], name, *names[index:])",
        ),
    ],
    "explicit-axes-not-resharded": [
        ("_src/constraints.py", "x = jax.sharding.reshard(", "x = (lambda x, spec: x)("),
    ],
    "unconstrained-kept-in-shardings": [
        ("_src/rules.py", "if any(entry is UNCONSTRAINED for entry in spec):", "if False:"),
    ],
    "used-axis-not-checked": [
        ("_src/rules.py", "        if clash:\n", "        if False:\n"),
    ],
    "box-mesh-not-checked": [
        (
            "_src/boxes.py",
            "if meta.mesh is not None and mesh is not None and not same_mesh(meta.mesh, mesh):",
            "if False:",
        ),
    ],
    "kept-dimensions-position-ignored": [
        ("_src/specs.py", "        position is not None\n", "        False\n"),
    ],
    "vmap-outputs-keep-names": [
        ("_src/transforms.py", 'return _per_prefix(add, out_axes, out, "outputs")', "return out"),
    ],
    "plan-device-bytes-unsharded": [
        (
            "_src/plan.py",
            "dim // math.prod(sizes.get(a, 1) for a in axes_of(None if e is UNCONSTRAINED else e))",
            "dim",
        ),
    ],
    "validate-rules-never-used-missing": [
        ("_src/specs.py", "            if name not in used:", "            if False:"),
    ],
    "captured-constant-placed": [
        (
            "_src/constraints.py",
            "if trace_state_clean():",
            "if not isinstance(x, jax.core.Tracer):",
        ),
    ],
    "custom-hooks-ignored": [
        ("_src/trees.py", "if hook is Partitioned.add_axis:", "if add:"),
    ],
    "params-ignored": [
        (
            "_src/specs.py",
            "if found.fallback == FEWER_DIMENSIONS and index is not None:",
            "if False:",
        ),
    ],
    "to-abstract-ignores-params": [
        (
            "_src/specs.py",
            "resolve_tree(tree, rules, mesh=mesh, params=params).map(",
            "resolve_tree(tree, rules, mesh=mesh).map(",
        ),
    ],
    "flax-boxes-read-as-containers": [
        (
            "_src/boxes.py",
            'return _box_or_foreign if "flax" in sys.modules else IS_BOX',
            "return IS_BOX",
        ),
    ],
    "diff-ignores-what-devices-held": [
        (
            "_src/plan.py",
            "return (whole - np.where(held, overlap, 0)) * new.dtype.itemsize",
            "return whole * new.dtype.itemsize",
        ),
    ],
    "fsdp-smallest-dimension": [
        (
            "_src/interop.py",
            "chosen = max(fits, key=lambda d: (shape[d], -d))",
            "chosen = min(fits, key=lambda d: (shape[d], -d))",
        ),
    ],
    "match-default-ignored": [
        (
            "_src/trees.py",
            "        if default is not None:\n            return default(path, leaf)\n",
            "",
        ),
    ],
    "strict-ignored": [
        (
            "_src/specs.py",
            "problem = found.strict_problem() if strict else found.problem",
            "problem = found.problem",
        ),
    ],
}


def copy_repository(into: pathlib.Path) -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / name).read_bytes())


def plant(into: pathlib.Path, edits: list[tuple[str, str, str]]) -> None:
    for file, old, new in edits:
        path = into / "spmdtree" / file
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"mutant does not apply: {file} has {old!r} {count} times")
        path.write_text(text.replace(old, new))


def run(name: str, edits: list[tuple[str, str, str]], tests: list[str]) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = pathlib.Path(tmp)
        copy_repository(copy)
        plant(copy, edits)
        env = {**os.environ, "PYTHONPATH": str(copy)}
        where = subprocess.run(
            [sys.executable, "-c", "import spmdtree; print(spmdtree.__file__)"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not where.startswith(str(copy)):
            raise SystemExit(f"the copy is not what gets imported: {where}")
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        seconds = time.perf_counter() - start
        failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.MULTILINE)
        if done.returncode == 0:
            return "SURVIVED", "", seconds
        return "killed", failed[0] if failed else done.stdout.strip().splitlines()[-1], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--tests", nargs="*", default=[], help="test files (default: all)")
    args = parser.parse_args()
    names = args.names or list(MUTANTS)
    survivors = []
    for name in names:
        verdict, by, seconds = run(name, MUTANTS[name], args.tests)
        print(f"{name:<36} {verdict:<9} {seconds:6.0f} s  {by}", flush=True)
        if verdict == "SURVIVED":
            survivors.append(name)
    print(f"{len(names) - len(survivors)} of {len(names)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
