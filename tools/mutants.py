"""Mutation check: does the test suite notice a planted bug?

For each mutant below, this copies the repository's tracked files to a
temporary directory, plants one bug in the copy of the package (a text
replacement that must apply exactly once), confirms that the copy is what
``import spmdtree`` loads there, and runs the test suite (``pytest -x -n 0``: in order, in one process) on it,
the tests nearest the floors it plants in first (`NEAREST`).
A mutant is *killed* if a test fails, and *survives* if the suite passes.
Every mutant changes a result a user would see; a survivor is a hole in the net.

Run: python tools/mutants.py [names...] [--tests FILE...] [--jobs 2] [--step]

``--step`` runs the step wing's mutants against the step wing's tests only. The
property tests' target grids run whole here (``SPMDTREE_FULL_GRID=1``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
        ("_src/resolve.py", "elif dim.size is not None and dim.size % size:", "elif False:"),
    ],
    "no-divisibility-check-mesh-names": [
        ("_src/resolve.py", "if length is not None and length % size:", "if False:"),
    ],
    "rule-typo-skipped": [
        (
            "_src/resolve.py",
            "        if missing:\n",
            "        if missing:\n            continue\n        if missing:\n",
        ),
    ],
    "fewer-dims-replicated": [
        ("_src/resolve.py", "if len(shape) < len(names) and not placeholder:", "if False:"),
    ],
    "raise-error-needs-a-mesh": [
        (
            "_src/constraints.py",
            "if res.unmatched and self.fallback is RulesFallback.RAISE_ERROR:",
            "if res.unmatched and self.fallback is RulesFallback.RAISE_ERROR and self.live is not None:",
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
    "used-axis-not-checked": [
        ("_src/resolve.py", "        if clash:\n", "        if False:\n"),
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
        ("_src/specs.py", "        if name not in used\n", "        if False\n"),
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
            "if found.fallback == FEWER_DIMENSIONS and self.index is not None:",
            "if False:",
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
            "_src/tactics.py",
            "chosen = max(fits, key=lambda d: (shape[d], -d))",
            "chosen = min(fits, key=lambda d: (shape[d], -d))",
        ),
    ],
    "match-default-ignored": [
        (
            "_src/tactics.py",
            "        if self.default is not None:\n            return self.default(path, leaf)\n",
            "",
        ),
    ],
    "strict-ignored": [
        (
            "_src/specs.py",
            "problem = found.strict_problem() if self.strict else found.problem",
            "problem = found.problem",
        ),
    ],
    # New in 0.2: names no rule mentions, flax's short names, preflight.
    "no-rules-not-an-error": [
        (
            "_src/resolve.py",
            "if not rules and any(type(name) is str for name in names):",
            "if False:",
        ),
    ],
    "mesh-axis-logical-name-allowed": [
        ("_src/resolve.py", "        if name in axes:\n", "        if False:\n"),
    ],
    "typo-check-skipped": [
        ("_src/resolve.py", "            if index is None:\n", "            if True:\n"),
    ],
    "unmentioned-not-flagged": [
        (
            "_src/plan.py",
            "flags += [Unmentioned(name) for name in res.unmentioned]",
            "flags += []",
        ),
    ],
    "one-edit-any-letter-more": [
        (
            "_src/resolve.py",
            "return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))",
            "return len(long) - len(short) == 1",
        ),
    ],
    "one-edit-any-two-letters-differ": [
        ("_src/resolve.py", "return j == i + 1 and a[i] == b[j] and a[j] == b[i]", "return True"),
    ],
    "one-edit-no-swaps": [
        ("_src/resolve.py", "return j == i + 1 and a[i] == b[j] and a[j] == b[i]", "return False"),
    ],
    "short-names-guessed": [
        ("_src/resolve.py", "GUESSED_FROM = 4", "GUESSED_FROM = 3"),
    ],
    "typo-blames-the-rule-always": [
        ("_src/resolve.py", "    if uses.get(ruled):\n", "    if False:\n"),
    ],
    "unsharded-warning-never": [
        ("_src/resolve.py", "    if not lines:\n        return\n", "    return\n"),
    ],
    "unsharded-warning-from-plan": [
        (
            "_src/plan.py",
            "        warn=False,  # the plan's flags say it (preflight's too)\n",
            "        warn=True,\n",
        ),
    ],
    "unsharded-warning-at-spmdtrees-line": [
        ("_src/resolve.py", "stacklevel=user_level(),", "stacklevel=1,"),
    ],
    "tuples-padded-like-partition-specs": [
        ("_src/rules.py", "    if spec and len(names) < rank:", "    if len(names) < rank:"),
    ],
    "all-none-names-need-the-rank": [
        (
            "_src/rules.py",
            "    if all(name is None for name in names):\n        return",
            "    if False:\n        return",
        ),
    ],
    "some-size-1-dimensions-a-placeholder": [
        (
            "_src/resolve.py",
            "placeholder = all(size == 1 for size in shape)",
            "placeholder = any(size == 1 for size in shape)",
        ),
    ],
    "sharded-init-negative-argnums-wrap": [
        (
            "_src/transforms.py",
            "        nums = {i % len(args) for i in static_nums}",
            "        nums = set(static_nums)",
        ),
    ],
    "describe-splits-the-flag-sentence": [
        (
            "_src/text.py",
            "{flag.name for row in rows for flag in row.flags if isinstance(flag, Unmentioned)}",
            '{flag.split("\'")[1] for row in rows for flag in row.flags if isinstance(flag, Unmentioned)}',
        ),
    ],
    "strict-ignores-unmentioned": [
        ("_src/resolve.py", "if self.problem is None and self.unmentioned:", "if False:"),
    ],
    "flax-short-names-not-padded": [
        ("_src/interop.py", "if shape is not None and len(shape) > len(names):", "if False:"),
    ],
    "never-reached-not-reported": [
        (
            "_src/specs.py",
            "problems += [problem.sentence for problem in _never_reached(tree, normal, mesh)]",
            "problems += []",
        ),
    ],
    "peak-ignores-aliasing": [
        (
            "_src/step/compile/analysis.py",
            "+ self.output_bytes - self.alias_bytes +",
            "+ self.output_bytes +",
        ),
    ],
    "placed-leaf-replicated": [
        (
            "_src/specs.py",
            "return placed_resolution(leaf, self.mesh_shape) if self.placed else REPLICATED",
            "return REPLICATED",
        ),
    ],
    # 0.3: the ring volumes (kinds.py's CollectiveKind, since 0.6).
    "wire-bytes-all-reduce-one-way": [
        (
            "_src/step/kinds.py",
            "return self.passes * (group - 1) * self.moved(size, group) // group",
            "return (group - 1) * self.moved(size, group) // group",
        )
    ],
    "wire-bytes-reduce-scatter-as-gather": [
        (
            "_src/step/kinds.py",
            "return self.passes * (group - 1) * self.moved(size, group) // group",
            "return self.passes * (group - 1) * size // group",
        )
    ],
    "wire-bytes-gather-whole-result": [
        (
            "_src/step/kinds.py",
            "if self is CollectiveKind.COLLECTIVE_PERMUTE:\n            return size",
            "if self in (CollectiveKind.COLLECTIVE_PERMUTE, CollectiveKind.ALL_GATHER):\n            return size",
        )
    ],
    "slice-offset-partition-unchecked": [
        (
            "_src/step/hlo/forms.py",
            "if sliced and any(self.depends(comp, o) for o in user.operands[1:]):",
            "if sliced:",
        ),
    ],
    "mesh-groups-along-the-other-axes": [
        (
            "_src/step/hlo/groups.py",
            ".transpose(rest_dims + grouped)",
            ".transpose(grouped + rest_dims)",
        ),
    ],
    "elementwise-uses-not-followed": [
        (
            "_src/step/hlo/forms.py",
            "if user.op in PASS or (user.op in ELEMENTWISE and index is None):",
            "if user.op in PASS:",
        ),
    ],
    "step-drops-the-inputs-flags": [
        (
            "_src/step/preflight/preflight.py",
            "Located(argument_path(row.path), flag) for row in inputs.rows for flag in row.flags",
            "Located(argument_path(row.path), flag) for row in () for flag in row.flags",
        ),
    ],
    "overstated-uncapped": [
        (
            "_src/step/hlo/forms.py",
            "return min(held_bytes + 64, temp_bytes) if held_bytes else 0",
            "return held_bytes + 64 if held_bytes else 0",
        ),
    ],
    # Categories: arithmetic off by a factor, a memo key missing a field, a comparison
    # flipped at the boundary, an order changed, a metadata field dropped by one path.
    "plan-device-bytes-off-by-a-factor": [
        (
            "_src/plan.py",
            "device = math.prod(shard) * dtype.itemsize",
            "device = math.prod(shard) * 2",
        ),
    ],
    "plan-memo-key-without-dtype": [
        ("_src/plan.py", "key = (res, shape, dtype)", "key = (res, shape)"),
    ],
    "resolution-memo-key-without-kind": [
        ("_src/specs.py", "key = (kind, meta, shape)\n", "key = (meta, shape)\n"),
    ],
    "fits-boundary-flipped": [
        (
            "_src/plan.py",
            "return self.device_bytes <= budget_bytes",
            "return self.device_bytes < budget_bytes",
        ),
    ],
    "describe-budget-boundary-flipped": [
        ("_src/text.py", "if spare >= 0", "if spare > 0"),
    ],
    "replicated-bytes-by-spec": [
        (
            "_src/plan.py",
            "if walk.mesh is not None and r.shard_shape == r.shape)",
            "if walk.mesh is not None and not any(r.spec))",
        ),
    ],
    "diff-same-shape-meshes-equal": [
        (
            "_src/plan.py",
            "same_mesh = before.mesh == after.mesh",
            "same_mesh = before.mesh.shape == after.mesh.shape",
        ),
    ],
    "constraint-axis-tuple-sorted": [
        (
            "_src/constraints.py",
            "kept = tuple(axis for axis in entry if axis in axes)",
            "kept = tuple(sorted(axis for axis in entry if axis in axes))",
        ),
    ],
    "from-flax-drops-mesh": [
        (
            "_src/interop.py",
            "return Partitioned(value, _flax_names(value, x.names, path, padded), mesh=x.mesh)",
            "return Partitioned(value, _flax_names(value, x.names, path, padded))",
        ),
    ],
    # 0.3: a constraint on Explicit axes means what it says on Auto ones.
    "explicit-unsharded-target-skipped": [
        (
            "_src/constraints.py",
            "    if now != wanted:\n",
            "    if any(_only(e, explicit) for e in spec if e is not UNCONSTRAINED):\n",
        ),
    ],
    "explicit-unconstrained-unshards": [
        (
            "_src/constraints.py",
            "current if e is UNCONSTRAINED else single(_only(e, explicit))",
            "None if e is UNCONSTRAINED else single(_only(e, explicit))",
        ),
    ],
    "constrain-other-rules-of-a-box-allowed": [
        ("_src/constraints.py", "if own is not None and own != rules:", "if False:"),
    ],
    "pickle-drops-the-mesh": [
        (
            "_src/registry.py",
            "meta = meta._replace(mesh=MeshRecipe.of(meta.mesh))",
            "meta = meta._replace(mesh=None)",
        ),
    ],
    # The roofline (time/bound.py) and the ranking (advise/judging.py).
    "hierarchy-divides-by-nothing": [("_src/step/time/bound.py", "        faster *= g[k]\n", "\n")],
    "reduce-scatter-volume-is-its-result": [
        (
            "_src/step/time/bound.py",
            "factor, volume = float(kind.passes), kind.moved(row.bytes, row.group)",
            "factor, volume = float(kind.passes), row.bytes",
        )
    ],
    "all-reduce-factor-one": [
        (
            "_src/step/time/bound.py",
            "factor, volume = float(kind.passes), kind.moved(row.bytes, row.group)",
            "factor, volume = 1.0, kind.moved(row.bytes, row.group)",
        )
    ],
    "all-to-all-divided-like-a-ring": [
        (
            "_src/step/time/bound.py",
            "return {k: (g[k] - 1) / g[k] * row.bytes for k in LINKS}",
            'return {k: (g[k] - 1) / g[k] * row.bytes / (g["ici"] if k == "dcn" else 1) for k in LINKS}',
        ),
    ],
    "latency-once-per-row": [
        (
            "_src/step/time/bound.py",
            "row.count * latency * (g[kind] - 1)",
            "latency * (g[kind] - 1)",
        ),
    ],
    "nodes-round-robin": [
        (
            "_src/step/time/bound.py",
            "nodes = np.sort(groups // devices_per_node",
            "nodes = np.sort(groups % devices_per_node",
        ),
    ],
    "whole-ring-on-the-slow-link": [
        (
            "_src/step/time/bound.py",
            "g_dcn = float(min(span, row.group))",
            "g_dcn = float(row.group if span > 1 else 1)",
        ),
    ],
    "bound-is-serial": [
        (
            "_src/step/time/bound.py",
            "return max(self.compute_seconds, self.comm_seconds)",
            "return self.compute_seconds + self.comm_seconds",
        ),
    ],
    "devices-per-node-override-ignored": [
        (
            "_src/step/time/bound.py",
            "per_node = hardware.devices_per_node if devices_per_node is None else devices_per_node",
            "per_node = hardware.devices_per_node",
        ),
    ],
    "ranking-per-step-across-batches": [
        ("_src/step/advise/judging.py", "per = row.candidate.batch", "per = 1"),
    ],
    "microbatch-index-sharded": [
        (
            "_src/transforms.py",
            "    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)",
            "    return x.reshape(count, x.shape[0] // count, *x.shape[1:])",
        ),
    ],
    "microbatches-summed": [
        (
            "_src/transforms.py",
            "        return jax.tree.map(lambda t: t / microbatches, total)",
            "        return total",
        ),
    ],
    "ties-in-candidate-order": [
        ("_src/step/advise/judging.py", "serial = row.time.serial_seconds / per", "serial = 0.0"),
    ],
    "repeated-steps-compiled-again": [
        ("_src/step/advise/advise.py", "if key not in children:", "if True:")
    ],
    # 0.8: pipeline stages, planned and searched
    "pipeline-ring-backwards": [
        (
            "_src/pipeline.py",
            "    ring = [(s, (s + 1) % count) for s in range(count)]",
            "    ring = [(s, (s - 1) % count) for s in range(count)]",
        )
    ],
    "pipeline-every-stage-on-one-repeat": [
        (
            "_src/pipeline.py",
            "repeat = jnp.clip((i - stage) // m, 0, scope.repeats - 1)",
            "repeat = jnp.clip(i // m + 0 * stage, 0, scope.repeats - 1)",
        )
    ],
    "pipeline-ring-written-a-slot-ahead": [
        (
            "_src/pipeline.py",
            "lambda r, p: jax.lax.dynamic_update_index_in_dim(r, p, slot, 1)",
            "lambda r, p: jax.lax.dynamic_update_index_in_dim(r, p, (slot + 1) % delay, 1)",
        )
    ],
    "pipeline-first-outputs-kept": [
        (
            "_src/pipeline.py",
            "jnp.sum(y[iterations - m :], axis=1, dtype=y.dtype)",
            "jnp.sum(y[:m], axis=1, dtype=y.dtype)",
        )
    ],
    "pipeline-one-repeat-taken-per-iteration": [
        ("_src/pipeline.py", "        if repeats == 1:", "        if False:")
    ],
    "pipeline-remat-saves-the-repeats-weights": [
        (
            "_src/pipeline.py",
            "return prim.name not in MOVES and bool(policy(prim, *args, **params))",
            "return bool(policy(prim, *args, **params))",
        )
    ],
    "stages-layers-reversed": [
        (
            "_src/pipeline.py",
            "    reshaped = jax.tree.map(lambda v: _reshaped(v, (*split, *v.shape[1:])), layers)",
            "    reshaped = jax.tree.map(lambda v: _reshaped(v if isinstance(v, jax.ShapeDtypeStruct) else v[::-1], (*split, *v.shape[1:])), layers)",
        )
    ],
    "accumulate-replicated-zeros": [
        (
            "_src/transforms.py",
            "zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, params, one))",
            "zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, params, one))",
        )
    ],
    "pipeline-scope-unread": [
        ("_src/pipeline.py", "        found = _LOOP.search(op_name)", "        found = None")
    ],
    "bubble-the-whole-loop": [
        (
            "_src/step/time/predict.py",
            "clock.bubble += (clock.compute - began) * loop.idle / loop.trips",
            "clock.bubble += clock.compute - began",
        )
    ],
    "stages-said-the-wrong-way": [
        ("_src/step/advise/state.py", "    if mine > theirs:", "    if mine < theirs:")
    ],
    "candidates-keep-what-no-pipeline-runs": [
        (
            "_src/step/advise/space.py",
            "    kept = [c for c in every if _unrunnable(c, layers) is None]",
            "    kept = every",
        )
    ],
    "rules-said-of-any-step": [
        (
            "_src/step/advise/state.py",
            "p for p in each[0] if all(p in other for other in each[1:])",
            "p for e in each for p in e",
        )
    ],
}

#: Test files in the order a mutant's run takes them: quick, broad ones first, so
#: that ``pytest -x`` stops early; the rest (the slow end-to-end ones) last.
FIRST = [
    "tests/test_doctests.py",
    "tests/test_mistakes.py",
    "tests/test_never_silent.py",
    "tests/test_unsharded_warning.py",
    "tests/test_partition_specs.py",
    "tests/test_boxes.py",
    "tests/test_rules.py",
    "tests/test_specs.py",
    "tests/test_plan.py",
    "tests/test_report.py",
    "tests/test_oracles.py",
    "tests/test_trees.py",
    "tests/test_tactics.py",
    "tests/test_said.py",
    "tests/test_hlo.py",
    "tests/test_preflight.py",
    "tests/test_hardware.py",
    "tests/test_advise.py",
    "tests/test_constraints.py",
    "tests/test_transforms.py",
    "tests/test_pipeline.py",
    "tests/test_fuzz.py",
    "tests/test_flax.py",
    "tests/test_optax.py",
]


def ordered_tests() -> list[str]:
    """Every test file, `FIRST` first."""
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    return [t for t in FIRST if t in found] + [t for t in found if t not in FIRST]


#: How long one mutant's suite may run before it is stopped and reported.
TIMEOUT = 1200


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


#: 0.4: the mutants whose code moved (step/trace.py, step/targets.py, the HLO reader
#: on jaxlib's module API), and the new ones.
MUTANTS.update(
    {
        "own-rules-ignored": [("_src/boxes.py", "own=meta.rules,", "own=None,")],
        "unconstrained-kept-in-shardings": [
            (
                "_src/resolve.py",
                "if not constraint and any(entry is UNCONSTRAINED for entry in spec):",
                "if False:",
            )
        ],
        "to-abstract-ignores-params": [
            (
                "_src/specs.py",
                "    walk = resolve_tree(tree, rules, mesh=mesh, params=params, strict=strict)\n    return walk.map(abstract, keep_boxes=True)",
                "    walk = resolve_tree(tree, rules, mesh=mesh, strict=strict)\n    return walk.map(abstract, keep_boxes=True)",
            )
        ],
        "unsharded-warning-for-size-1": [
            (
                "_src/resolve.py",
                "return tuple(i for i in self.indivisible if self.dims[i].size != 1)",
                "return tuple(self.indivisible)",
            )
        ],
        "unsharded-warning-for-reduced-states": [
            (
                "_src/resolve.py",
                "        if self.kept is not None or self.problem is not None:\n            return ()",
                "        if self.problem is not None:\n            return ()",
            )
        ],
        "get-sharding-skips-the-call-checks": [
            (
                "_src/boxes.py",
                '        check_leaves((self, [self], [found]), rules, "", warn=True)',
                "        pass",
            )
        ],
        "constraint-without-rules-unchecked": [
            (
                "_src/constraints.py",
                "checked=self.in_effect is not None,  # without a mesh",
                "checked=False,  # without a mesh",
            )
        ],
        "loop-trip-count-ignored": [
            ("_src/step/hlo/reading.py", "return inner.times(event.trips)", "return inner")
        ],
        "preflight-drops-donation": [
            (
                "_src/step/compile/tracing.py",
                "jax.jit(step, donate_argnums=flat_donated,",
                "jax.jit(step,",
            )
        ],
        "tuple-result-first-element-only": [
            (
                "_src/step/hlo/instructions.py",
                "return sum(a.bytes for a in self.arrays)",
                "return sum(a.bytes for a in self.arrays[:1])",
            )
        ],
        "argnums-negative-taken-as-positive": [
            ("_src/step/compile/tracing.py", "out.append(n % count)", "out.append(abs(n))")
        ],
        "reduce-scatter-not-recognised": [
            (
                "_src/step/hlo/forms.py",
                "        if kind is CollectiveKind.ALL_REDUCE:\n            got = flow.slices(",
                "        if False:\n            got = flow.slices(",
            )
        ],
        "reduce-scatter-on-an-accelerator-too": [
            (
                "_src/step/hlo/forms.py",
                "if not cpu or not arrays or ins.op in DONES:",
                "if not arrays or ins.op in DONES:",
            )
        ],
        "reduce-scatter-tuple-all-or-nothing": [
            (
                "_src/step/hlo/forms.py",
                "found.append(\n                    Part(CollectiveKind.REDUCE_SCATTER, shard, held=size, widened=bool(narrow))\n                )\n                continue",
                "return [Part(CollectiveKind.REDUCE_SCATTER, shard, held=size, widened=bool(narrow))]",
            )
        ],
        "widened-reduction-counted-wide": [
            (
                "_src/step/hlo/forms.py",
                "bytes_ = size * narrow // width if narrow else size",
                "bytes_ = size",
            )
        ],
        "step-drops-what-tracing-warned": [
            (
                "_src/step/preflight/preflight.py",
                "flags += [*analysis.reading.flags, *compiler.left_out(analysis), *traced.warned]",
                "flags += [*analysis.reading.flags, *compiler.left_out(analysis)]",
            )
        ],
        "out-shardings-rank-unchecked": [
            (
                "_src/step/compile/tracing.py",
                "if layout is not None and len(layout.spec) > len(leaf.shape):",
                "if False:",
            )
        ],
        "flops-trip-count-ignored": [
            (
                "_src/step/hlo/reading.py",
                "return dataclasses.replace(self, flops=self.flops * n, rows=rows)",
                "return dataclasses.replace(self, rows=rows)",
            )
        ],
        "ranking-ignores-the-bound": [
            (
                "_src/step/advise/judging.py",
                "    return (order, repeats, bound, row.step.peak_bytes, serial, *_tie(row, index))",
                "    return (order, repeats, 0.0, 0, 0.0, *_tie(row, index))",
            )
        ],
        "over-budget-not-split-by-compiled": [
            (
                "_src/step/advise/judging.py",
                "order = 2 * verdict + (row.verdict == Verdict.OVER_BUDGET and row.step is None)",
                "order = 2 * verdict",
            )
        ],
        "may-fit-ignores-the-overstatement": [
            (
                "_src/step/advise/judging.py",
                "    if step.peak_bytes - step.overstated_bytes <= budget:",
                "    if step.peak_bytes <= budget:",
            )
        ],
        "arrays-over-budget-compiled": [
            (
                "_src/step/advise/judging.py",
                "    if planned.device_bytes > budget:",
                "    if False:",
            )
        ],
        "slice-times-group-unchecked": [
            (
                "_src/step/hlo/forms.py",
                "if cut and cut.elements * group == math.prod(dims):",
                "if cut:",
            )
        ],
        "cond-both-branches": [
            (
                "_src/step/hlo/reading.py",
                "(tally(branch) for branch in event.branches), key=lambda t: t.cost, default=Tally()",
                "[sum((tally(branch) for branch in event.branches), Tally())], key=lambda t: t.cost",
            )
        ],
        "tpu-trip-count-unread": [
            (
                "_src/step/hlo/loops.py",
                "return _trips(start.value, step.by, direction, limit)",
                "return None",
            )
        ],
        "async-start-counted-too": [
            (
                # an async all-gather's traffic counted for its start and again for
                # its done
                "_src/step/hlo/schedule.py",
                "        rows = self._rows(where, result, inner, kind)\n",
                "        rows = self._rows(where, result, inner, kind)\n"
                "        rows = rows * (2 if ins.op == Op.kAllGatherStart else 1)\n",
            )
        ],
        "flash-at-the-matmul-share": [
            (
                "_src/step/time/predict.py",
                "        if kernel.flash:  # its blocks at the kernel's published share, each way",
                "        if False:",
            )
        ],
        "flash-directions-swapped": [
            (
                "_src/step/time/predict.py",
                '                if kernel.flash == "backward"',
                '                if kernel.flash == "forward"',
            )
        ],
        "pallas-causal-unread": [
            (
                "_src/step/hlo/opcodes.py",
                '    causal = flash.mask == "module" and _WHILE.search(ins.config.get("mlir", "")) is not None',
                "    causal = False",
            )
        ],
        "triton-kernel-named-pallas-call": [
            (
                "_src/step/hlo/opcodes.py",
                '    if flash_of(name) is None and len(scopes) > 1 and scopes[-1] == "pallas_call":',
                "    if False:",
            )
        ],
        "mlir-config-dropped": [
            (
                "_src/step/hlo/instructions.py",
                '        return {"mlir": printed} if printed.startswith("{") else {}',
                "        return {}",
            )
        ],
        "flash-backward-dots-as-forward": [
            (
                "_src/step/hlo/opcodes.py",
                '    "mha_backward": Flash(7, True, "module", 1),',
                '    "mha_backward": Flash(2, True, "module", 1),',
            )
        ],
        "splash-dense-unsaid": [
            (
                "_src/step/hlo/reading.py",
                '        dense = [event.call] if flash is not None and flash.mask != "module" else []',
                "        dense = []",
            )
        ],
        "flash-defaults-always-said": [
            (
                "_src/step/time/bound.py",
                "        if what not in _KERNEL_FIELDS or any(map(_KERNEL_FIELDS[what], kernels))",
                "        if True",
            )
        ],
        "async-fusion-start-sync": [
            (
                "_src/step/hlo/schedule.py",
                "            started = self._starts(comp, ins, rows, sync=False)",
                "            started = self._starts(comp, ins, rows, sync=True)",
            )
        ],
        "async-fusion-carriers-start-again": [
            (
                "_src/step/hlo/forms.py",
                '.get(target, "continue")',
                '.get(target, "start")',
            )
        ],
        "repeats-ranked-with-the-rest": [
            (
                "_src/step/advise/judging.py",
                "    repeats = int(row_repeated(row, split or {}) is not None)",
                "    repeats = 0",
            )
        ],
        "repeats-along-an-axis-that-splits": [
            (
                "_src/step/preflight/diagnose.py",
                "    if not axes:  # every axis splits something: FLOPs counted apart, not work repeated",
                "    if False:",
            )
        ],
        "repeats-not-along-an-undivided-axis": [
            (
                "_src/step/preflight/diagnose.py",
                "    axes = repeating_axes(sizes, used - undivided, flops / least)",
                "    axes = repeating_axes(sizes, used, flops / least)",
            )
        ],
        "batch-rule-from-any-argument": [
            (
                "_src/step/preflight/diagnose.py",
                "        if row.logical and row.shape[:1] == (batch,) and row.names:",
                "        if row.logical and row.names:",
            )
        ],
        "repeats-at-any-excess": [
            (
                "_src/step/preflight/diagnose.py",
                "    if least <= 0 or flops < REPEATS * least:",
                "    if least <= 0 or flops <= least:",
            )
        ],
        "tokens-at-the-bound": [
            (
                "_src/step/advise/state.py",
                "        tokens = candidate.batch * candidate.length / ranked_seconds(timed)",
                "        tokens = candidate.batch * candidate.length / timed.bound_seconds",
            )
        ],
        "over-budget-by-label": [
            (
                "_src/step/advise/judging.py",
                "        return (order, 0, 0.0, row.step.peak_bytes, 0.0, *_tie(row, index))",
                "        return (order, 0, 0.0, 0, 0.0, *_tie(row, index))",
            )
        ],
        "traffic-flag-kept-beside-the-repeat": [
            (
                "_src/step/advise/state.py",
                "        flags = tuple(f for f in row.flags if traffic is None or f != traffic.sentence)",
                "        flags = row.flags",
            )
        ],
        "progress-at-every-rows-pace": [
            (
                "_src/step/advise/progress.py",
                "        left = _duration(elapsed / compiled * (total - done))",
                "        left = _duration(elapsed / done * (total - done))",
            )
        ],
        "nothing-fits-silent-uncompiled": [
            (
                "_src/step/advise/state.py",
                "    if not compiled:\n        closest = [",
                "    if False:\n        closest = [",
            )
        ],
        "options-left-out-of-the-label": [
            (
                "_src/step/advise/records.py",
                '    return f"{layout}, {chosen}" if chosen else layout',
                "    return layout",
            )
        ],
        "executor-ignored": [
            (
                "_src/step/advise/advise.py",
                "    if search.executor is None or not isinstance(stage, Exported):",
                "    if True:",
            )
        ],
        "batch-window-as-kernel": [
            (
                "_src/step/hlo/opcodes.py",
                "real = (start >= 0) & (start <= (n - 1) * lhs) & (start % lhs == 0)",
                "real = start == start",
            )
        ],
        "cross-slice-transfers-unread": [
            (
                "_src/step/hlo/schedule.py",
                "        if ins.op == Op.kSend and _MEGASCALE in ins.frontend:",
                "        if False:",
            )
        ],
        "cpu-remat-barriers-dropped": [
            (
                "_src/step/compile/backends.py",
                '        ("xla_disable_hlo_passes", "cse_barrier_expander"),\n',
                "",
            )
        ],
        "gpu-target-triton-gemms": [
            (
                "_src/step/compile/backends.py",
                '    deviceless_options=(("xla_gpu_enable_triton_gemm", False),),',
                "    deviceless_options=(),",
            )
        ],
        "device-memory-said-as-a-compile-error": [
            (
                "_src/step/compile/compilers.py",
                '    if said["error"] == "device memory":',
                "    if False:",
            )
        ],
    }
)

#: 0.5: said, not silent.
MUTANTS.update(
    {
        "compile-seconds-count-the-trace-twice": [
            (
                "_src/step/compile/compilers.py",
                "        found = analyse(compiled, self.here, self.toolchain)\n        return dataclasses.replace(found, seconds=time.perf_counter() - start)",
                "        found = analyse(compiled, self.here, self.toolchain)\n        return dataclasses.replace(\n            found, seconds=traced.seconds + time.perf_counter() - start\n        )",
            )
        ],
        "step-error-not-chained": [
            (
                "_src/errors.py",
                "raise mistake.error(called) from mistake.__cause__",
                "raise mistake.error(called) from None",
            )
        ],
        "match-pattern-matching-nothing-unsaid": [
            ("_src/tactics.py", "        if texts and missed:", "        if False:")
        ],
        "rules-only-activations-use-said-unused": [
            (
                "_src/specs.py",
                "used = set(_logical_names_in(arguments)) | set(constrained)",
                "used = set(_logical_names_in(arguments))",
            )
        ],
        "traffic-said-at-any-ratio": [
            (
                "_src/step/preflight/diagnose.py",
                "measured <= ratio * explained or",
                "measured <= explained or",
            )
        ],
        "what-would-fit-batch-ignores-the-arrays": [
            (
                "_src/step/preflight/diagnose.py",
                "fraction = (budget_bytes - fixed) / closest.temp_bytes",
                "fraction = budget_bytes / closest.peak_bytes",
            )
        ],
    }
)


#: 0.5: the layout: a box's memory kind dropped on the way to its sharding, its
#: plan or its preflight, or a wrong one let through.
MUTANTS.update(
    {
        "memory-kind-dropped-by-the-sharding": [
            (
                "_src/resolve.py",
                "return NamedSharding(mesh, spec, memory_kind=layout.memory_kind)",
                "return NamedSharding(mesh, spec)",
            )
        ],
        "memory-kind-dropped-by-the-box": [
            (
                "_src/boxes.py",
                "return Layout(memory_kind=self.memory_kind)",
                "return Layout()",
            )
        ],
        "memory-kind-unchecked": [
            ("_src/resolve.py", "if kind is not None and kind not in MEMORY_KINDS:", "if False:")
        ],
        "host-bytes-counted-as-the-device": [
            (
                "_src/plan.py",
                "device = sum(r.device_bytes for r in rows) - host",
                "device = sum(r.device_bytes for r in rows)",
            )
        ],
        "offloaded-arguments-left-on-the-device": [
            (
                "_src/step/preflight/preflight.py",
                "memory = memory.with_host_arguments(inputs.host_bytes)",
                "memory = memory",
            )
        ],
        "offloaded-outputs-left-on-the-device": [
            (
                "_src/step/compile/analysis.py",
                "return (device, host) if host or not offloaded else (device - offloaded, offloaded)",
                "return (device, host)",
            )
        ],
    }
)


#: 0.5: the step wing's neighbours, each of a kind tests/test_step_properties.py and
#: tests/test_presets.py catch: an off-by-one in a loop's trip count, an axis order
#: swapped, devices per node miscounted, a volume's factor wrong, a ranking or a
#: confirmation that depends on the candidates' order. They quote formulas, not
#: prose, so that they keep applying while the code around them moves.
MUTANTS.update(
    {
        "trip-count-le-one-short": [
            (
                "_src/step/hlo/loops.py",
                '    inclusive = direction in ("LE", "GE")',
                '    inclusive = direction in ("GE",)',
            )
        ],
        "trip-count-ge-one-short": [
            (
                "_src/step/hlo/loops.py",
                '    inclusive = direction in ("LE", "GE")',
                '    inclusive = direction in ("LE",)',
            )
        ],
        "trip-count-floor-division": [
            (
                "_src/step/hlo/loops.py",
                "    return distance // by + 1 if inclusive else -(-distance // by)",
                "    return distance // by + 1 if inclusive else distance // by",
            )
        ],
        "trip-count-of-a-loop-that-never-ends": [
            (
                "_src/step/hlo/loops.py",
                "        return steps if not left and steps > 0 else None",
                "        return steps if steps > 0 else None",
            )
        ],
        "group-axes-reversed": [
            (
                "_src/step/hlo/groups.py",
                "axes = tuple(shape[d][0] for d in sorted(varying))",
                "axes = tuple(shape[d][0] for d in sorted(varying, reverse=True))",
            )
        ],
        "all-gather-volume-doubled": [
            (
                "_src/step/time/bound.py",
                "factor, volume = float(kind.passes), kind.moved(row.bytes, row.group)",
                "factor, volume = float(kind.passes) * (2 if kind is CollectiveKind.ALL_GATHER else 1), kind.moved(row.bytes, row.group)",
            )
        ],
        "link-groups-swapped": [
            (
                "_src/step/time/bound.py",
                'g = {"ici": row.group / g_dcn, "dcn": g_dcn}',
                'g = {"ici": g_dcn, "dcn": row.group / g_dcn}',
            )
        ],
        "node-groups-along-the-other-axes": [
            (
                "_src/step/time/bound.py",
                "positions.transpose(rest + list(varying))",
                "positions.transpose(list(varying) + rest)",
            )
        ],
        "node-axes-mirrored": [
            (
                "_src/step/time/bound.py",
                "varying = [names.index(a) for a in row.axes if a in names]",
                "varying = [len(names) - 1 - names.index(a) for a in row.axes if a in names]",
            )
        ],
        "one-node-is-eight-devices": [
            (
                "_src/step/time/bound.py",
                "devices_per_node or math.prod(shape.values())",
                "devices_per_node or 8",
            )
        ],
        "permute-on-the-fastest-link": [
            (
                "_src/step/time/bound.py",
                "slowest = [k for k in LINKS if g[k] > 1][-1:] or [LinkKind.ICI]",
                "slowest = [k for k in LINKS if g[k] > 1][:1] or [LinkKind.ICI]",
            )
        ],
        "devices-per-node-is-the-node-count": [
            (
                "_src/step/compile/compilers.py",
                '"""The placement\'s GPUs per node, or chips per TPU slice."""\n'
                "        return self.placement.per_node",
                '"""The placement\'s GPUs per node, or chips per TPU slice."""\n'
                "        return self.placement.nodes",
            )
        ],
        "outputs-counted-as-arguments": [
            (
                "_src/step/compile/analysis.py",
                "output_bytes=outputs,",
                "output_bytes=int(memory.argument_size_in_bytes),",
            )
        ],
        "gpu-node-not-capped-by-the-mesh": [
            (
                "_src/step/compile/backends.py",
                "node = min(per_node or 8, devices)",
                "node = per_node or 8",
            )
        ],
        "tpu-slice-any-even-size": [
            (
                "_src/step/compile/backends.py",
                "return n >= 1 and n & (n - 1) == 0",
                "return n == 1 or n % 2 == 0",
            )
        ],
        "tpu-slice-limit-unchecked": [
            (
                "_src/step/compile/backends.py",
                "if limit is not None and size > limit:",
                "if False:",
            )
        ],
        "node-count-is-the-node-size": [
            (
                "_src/step/compile/backends.py",
                "return self.devices // self.per_node",
                "return self.per_node",
            )
        ],
        "torus-one-axis": [
            (
                "_src/step/time/bound.py",
                'bandwidth *= _torus_links(hardware, g["ici"], per_node)',
                "bandwidth *= 1",
            )
        ],
        "fused-collective-read": [
            (
                "_src/step/hlo/schedule.py",
                "    if user.op in SYNC:\n        return True\n",
                "",
            )
        ],
        "carried-buffer-read": [
            (
                "_src/step/hlo/schedule.py",
                "return user.op == Op.kTuple and user.root",
                "return False",
            )
        ],
        "carried-buffer-written": [
            (
                "_src/step/hlo/schedule.py",
                "    if root.op == Op.kParameter or root.op in SYNC:\n        return 0\n",
                "",
            )
        ],
        "nested-fusion-read-whole": [
            (
                "_src/step/hlo/schedule.py",
                "        elif user.op == Op.kFusion:\n"
                "            total += _nested_read(mod, comp, user, j, whole)\n",
                "",
            )
        ],
        "nested-copy-read-whole": [
            (
                "_src/step/hlo/schedule.py",
                "    return min(inner, whole * demanded // user.tiled_bytes)",
                "    return inner",
            )
        ],
        "torus-wraps-everywhere": [
            (
                "_src/step/hw/chips.py",
                "whole = [side > 0 and d % side == 0 for d in dims]",
                "whole = [True for d in dims]",
            )
        ],
        "torus-cubes-per-axis": [
            (
                "_src/step/hw/chips.py",
                "return [all(whole)] * len(dims) if cubes else whole",
                "return whole",
            )
        ],
        "torus-line-is-a-ring": [
            (
                "_src/step/hw/chips.py",
                "sum(1.0 if wraps[i] else 0.5 for i in axes)",
                "sum(1.0 for i in axes)",
            )
        ],
        "torus-counts-every-axis": [
            (
                "_src/step/hw/chips.py",
                "        if held >= group:\n            break\n",
                "",
            )
        ],
        "kernel-estimate-ignored": [
            (
                "_src/step/hlo/opcodes.py",
                "        return estimate[0] if estimate is not None else _flash_flops(mod, comp, ins)",
                "        return _flash_flops(mod, comp, ins)",
            )
        ],
        "kernel-bytes-not-the-estimates": [
            (
                "_src/step/hlo/schedule.py",
                "if estimate is not None and estimate[1]:",
                "if False:",
            )
        ],
        "opaque-kernel-unsaid": [
            (
                "_src/step/hlo/schedule.py",
                '        opaque = name if name and not flops and flash_of(name) is None else ""',
                '        opaque = ""',
            )
        ],
        "tpu-slice-grows-the-first-of-ties": [
            (
                "_src/step/hw/chips.py",
                "dims[max(i for i, d in enumerate(dims) if d == smallest)] *= 2",
                "dims[min(i for i, d in enumerate(dims) if d == smallest)] *= 2",
            )
        ],
        "confirmed-in-candidate-order": [
            (
                "_src/step/advise/state.py",
                "        return sorted(self.records, key=lambda i: rank(self.records[i].row, i, split))",
                "        return sorted(self.records)",
            )
        ],
        "ranked-by-position": [
            (
                "_src/step/advise/judging.py",
                '    bound = float(f"{ranked_seconds(row.time) / per:.6g}")',
                "    bound = float(index)",
            )
        ],
        "tight-margin-ignored": [
            (
                "_src/step/advise/judging.py",
                "    if step.judged_bytes <= budget * (1 - TIGHT_MARGIN):",
                "    if step.judged_bytes <= budget:",
            )
        ],
        "collectives-not-one-at-a-time": [
            (
                "_src/step/time/predict.py",
                "            start = max(clock.compute, clock.links)",
                "            start = clock.compute",
            )
        ],
        "loop-repeats-one-iteration-too-few": [
            (
                "_src/step/time/predict.py",
                "            clock.advance(before, loop.trips - self.WALKED, name)",
                "            clock.advance(before, loop.trips - self.WALKED - 1, name)",
            )
        ],
        "kernel-ignores-the-smaller-of-compute-and-memory": [
            (
                "_src/step/time/predict.py",
                "return max(compute, memory) + (1 - _PARALLELISM) * min(compute, memory)",
                "return max(compute, memory)",
            )
        ],
        "conditional-timed-as-its-fastest-branch": [
            (
                "_src/step/time/predict.py",
                "clock = max(ends, key=lambda c: c.compute, default=clock)",
                "clock = min(ends, key=lambda c: c.compute, default=clock)",
            )
        ],
        "waves-not-rounded-up": [
            (
                "_src/step/time/predict.py",
                "waves = -(-tiles // costs.cores)",
                "waves = tiles / costs.cores",
            )
        ],
        "libtpu-refuses-nothing": [
            ("_src/step/compile/backends.py", 'refuses=("unpinned_host",),', "refuses=(),")
        ],
        "libtpu-screens-unasked": [
            ("_src/step/compile/backends.py", "    screens_cheaply=False,\n", "")
        ],
        "row-labelled-by-another-toolchain": [
            (
                "_src/step/advise/records.py",
                "TOOLCHAINS[step.backend].label",
                "TOOLCHAINS[Backend.CPU].label",
            )
        ],
        "budget-note-of-another-toolchain": [
            (
                "_src/step/advise/records.py",
                "TOOLCHAINS[Backend(advice.platform)].taken",
                "TOOLCHAINS[Backend.TPU].taken",
            )
        ],
        "a-wait-not-counted-as-exposed": [
            (
                "_src/step/time/predict.py",
                "self.spent[KernelClass.COLLECTIVES] += until - self.compute",
                "self.spent[KernelClass.MEMORY] += until - self.compute",
            )
        ],
        "loop-kernels-counted-once": [
            (
                "_src/step/time/predict.py",
                "self.kernels += times * (self.kernels - before.kernels)",
                "self.kernels += 0",
            )
        ],
        "explained-gathered-once": [
            (
                "_src/step/preflight/diagnose.py",
                "total += 2 * row.bytes + row.device_bytes",
                "total += row.bytes + row.device_bytes",
            )
        ],
        "explained-replicated-gradients-free": [
            (
                "_src/step/preflight/diagnose.py",
                "if any(size > 1 for axis, size in sizes.items() if axis not in used):",
                "if False:",
            )
        ],
        "devices-rounded-down": [
            (
                "_src/step/preflight/diagnose.py",
                "factor = 2 ** math.ceil(math.log2(closest.peak_bytes / budget_bytes))",
                "factor = 2 ** math.floor(math.log2(closest.peak_bytes / budget_bytes))",
            )
        ],
        "remat-said-at-any-share": [
            (
                "_src/step/preflight/diagnose.py",
                "if closest.remat or share < 0.5:",
                "if closest.remat:",
            )
        ],
        "activations-any-axes": [
            (
                "_src/step/preflight/diagnose.py",
                "and set(largest.axes) <= sharding",
                "and bool(largest.axes)",
            )
        ],
        "cost-model-bandwidth-of-another-chip": [
            (
                "_src/step/hw/chips.py",
                "hbm_bytes_per_second=4_800 * GB,",
                "hbm_bytes_per_second=3_350 * GB,",
            )
        ],
        "cost-model-cores-of-one-chip": [("_src/step/hw/chips.py", "cores=148,", "cores=132,")],
        "preset-memory-a-gib-more": [
            (
                "_src/step/hw/chips.py",
                "memory_bytes=85_045_477_376,",
                "memory_bytes=85_045_477_376 + 2**30,",
            )
        ],
    }
)

# The six kinds of bug 0.6's net is for (tests/test_net.py), each in two forms or more.
MUTANTS.update(
    {
        # 1. a loop's trip count from a condition written either way round
        "loop-constant-first-not-flipped": [
            (
                "_src/step/hlo/loops.py",
                "        return b.element, _FLIPPED[direction], a.value",
                "        return b.element, direction, a.value",
            )
        ],
        "loop-inclusive-bound-read-exclusive": [
            (
                "_src/step/hlo/loops.py",
                "    return distance // by + 1 if inclusive else -(-distance // by)",
                "    return -(-distance // by)",
            )
        ],
        "loop-false-at-start-still-counted": [
            (
                "_src/step/hlo/loops.py",
                "    if not _HOLDS[direction](start, limit):\n        return 0",
                "    if False:\n        return 0",
            )
        ],
        # 2. a collective the compiler marks synchronous walked as overlapping compute
        "is-sync-ignored": [
            (
                "_src/step/hlo/schedule.py",
                'sync = ins.op in SYNC or config_field(ins.config, "is_sync") is True',
                "sync = ins.op in SYNC",
            )
        ],
        "is-sync-read-as-text": [
            (
                "_src/step/hlo/schedule.py",
                'sync = ins.op in SYNC or config_field(ins.config, "is_sync") is True',
                'sync = ins.op in SYNC or config_field(ins.config, "is_sync") == "true"',
            )
        ],
        # 3. a batched matmul's batch dimensions counted into its rows
        "batched-dot-batch-into-rows": [
            (
                "_src/step/hlo/schedule.py",
                "    return batch, m, n, k",
                "    return 1, batch * m, n, k",
            )
        ],
        "batched-dot-rows-keep-the-batch": [
            (
                "_src/step/hlo/schedule.py",
                "    m = math.prod(s for d, s in enumerate(lhs) if d not in lb + lc)",
                "    m = math.prod(s for d, s in enumerate(lhs) if d not in lc)",
            )
        ],
        "waves-ignore-the-batch": [
            (
                "_src/step/time/predict.py",
                "    tiles = batch * -(-m // tm) * -(-n // tn)",
                "    tiles = -(-m // tm) * -(-n // tn)",
            )
        ],
        # 4. which torus axes a TPU group spans on a slice of unequal axes
        "torus-shortest-axes-first": [
            ("_src/step/hw/chips.py", "key=lambda i: -dims[i]", "key=lambda i: dims[i]")
        ],
        "torus-first-axis-wraps-for-all": [
            (
                "_src/step/hw/chips.py",
                "    return sum(1.0 if wraps[i] else 0.5 for i in axes) if axes else 1.0",
                "    return sum(1.0 if wraps[0] else 0.5 for i in axes) if axes else 1.0",
            )
        ],
        # 5. the batch check reading a non-batch dimension left unsharded as the batch
        "any-unsharded-dimension-is-the-batch": [
            (
                "_src/step/advise/judging.py",
                "    return isinstance(flag, LeftUnsharded) and flag.size == candidate.batch",
                "    return isinstance(flag, LeftUnsharded)",
            )
        ],
        "the-batch-is-the-leading-dimension": [
            (
                "_src/step/advise/judging.py",
                "    return isinstance(flag, LeftUnsharded) and flag.size == candidate.batch",
                "    return isinstance(flag, LeftUnsharded) and flag.dimension == 0",
            )
        ],
        # 6. confirm's stopping rule: past the point no screened row can beat the best
        "confirm-past-the-best": [
            (
                "_src/step/advise/advise.py",
                "    above = order.index(confirmed[0]) if confirmed else len(order)",
                "    above = len(order)",
            )
        ],
        "confirm-anchored-on-the-last-fitting-row": [
            (
                "_src/step/advise/advise.py",
                "    above = order.index(confirmed[0]) if confirmed else len(order)",
                "    above = order.index(confirmed[-1]) if confirmed else len(order)",
            )
        ],
    }
)

MUTANTS.update(
    {
        # 0.7's net (tests/test_net_07.py): the job's compiler_options under spmdtree's own
        "compiler-options-lose-to-ours": [
            (
                "_src/step/compile/compilers.py",
                "    return own if toolchain.backend.estimates else {**own, **dict(compiler_options)}",
                "    return own if toolchain.backend.estimates else {**dict(compiler_options), **own}",
            )
        ],
        # an undivided axis blamed where the work repeats along another
        "undivided-blamed-off-the-repeating-axes": [
            (
                "_src/step/preflight/diagnose.py",
                "    if undivided & set(axes):",
                "    if undivided:",
            )
        ],
        # 0.7: a TPU's layouts as they run (tests/test_tpu_layouts.py)
        "tiles-ignored": [
            (
                "_src/step/hlo/instructions.py",
                "        return max(self.tiled, self.elements) * max(bits(self.dtype) // 8, 1)",
                "        return self.elements * max(bits(self.dtype) // 8, 1)",
            )
        ],
        "tile-sides-swapped": [
            (
                "_src/step/hlo/instructions.py",
                '    sides = [int(side) for side in tile.group(1).split(",")][::-1]',
                '    sides = [int(side) for side in tile.group(1).split(",")]',
            )
        ],
        "unfused-update-at-the-memory-rate": [
            (
                "_src/step/time/predict.py",
                "    share = costs.update_efficiency if kernel.unfused_update else costs.memory_efficiency",
                "    share = costs.memory_efficiency",
            )
        ],
        "update-at-a-constant-offset-unfused-too": [
            (
                "_src/step/hlo/schedule.py",
                "            if smaller and index is not None and index.op != Op.kConstant:",
                "            if smaller and index is not None:",
            )
        ],
        "update-efficiency-default-always-said": [
            (
                "_src/step/time/bound.py",
                '    "update_efficiency": lambda kernel: kernel.unfused_update,',
                '    "update_efficiency": lambda kernel: True,',
            )
        ],
    }
)

#: The step wing's tests: what `--step` runs the step wing's mutants against.
STEP_TESTS = [
    "tests/test_presets.py",
    "tests/test_predict_properties.py",
    "tests/test_diagnose_properties.py",
    "tests/test_step_properties.py",
    "tests/test_hlo.py",
    "tests/test_hardware.py",
    "tests/test_preflight.py",
    "tests/test_advise.py",
    "tests/test_hlo_targets.py",
    "tests/test_targets.py",
    "tests/test_predict.py",
    "tests/test_hlo_libtpu.py",
    "tests/test_one_walk.py",
    "tests/test_backends.py",
    "tests/test_layout.py",
    "tests/test_said.py",
    "tests/test_flash.py",
    "tests/test_look.py",
    "tests/test_net.py",
    "tests/test_net_07.py",
    "tests/test_tpu_layouts.py",
    "tests/test_pipeline_planned.py",
    # the step wing's docstring examples (a progress line's pace is said in one)
    "tests/test_doctests.py",
]


#: The step wing's tests nearest each floor's code: a mutant's run takes the ones of
#: the floors it plants in first, then the rest in their order. The order changes
#: only how soon a kill is found (``-x`` stops at the first failure), never the
#: verdict: a mutant survives only where every test passes.
NEAREST = {
    "kinds": ["tests/test_hlo.py", "tests/test_preflight.py"],
    "hlo": [
        "tests/test_hlo.py",
        "tests/test_hlo_targets.py",
        "tests/test_hlo_libtpu.py",
        "tests/test_one_walk.py",
        "tests/test_predict.py",
        "tests/test_tpu_layouts.py",
    ],
    "hw": ["tests/test_hardware.py", "tests/test_presets.py"],
    "compile": [
        "tests/test_backends.py",
        "tests/test_targets.py",
        "tests/test_preflight.py",
        "tests/test_layout.py",
        "tests/test_net_07.py",
    ],
    "time": [
        "tests/test_pipeline_planned.py",
        "tests/test_predict.py",
        "tests/test_predict_properties.py",
        "tests/test_flash.py",
        "tests/test_hardware.py",
        "tests/test_one_walk.py",
        "tests/test_tpu_layouts.py",
    ],
    "preflight": [
        "tests/test_preflight.py",
        "tests/test_diagnose_properties.py",
        "tests/test_said.py",
        "tests/test_layout.py",
        "tests/test_net_07.py",
    ],
    "advise": [
        "tests/test_pipeline_planned.py",
        "tests/test_advise.py",
        "tests/test_step_properties.py",
        "tests/test_net.py",
        "tests/test_look.py",
        "tests/test_said.py",
    ],
}


def nearest_first(edits: list[tuple[str, str, str]], tests: list[str]) -> list[str]:
    """`tests` with those nearest the floors `edits` plant in first (`NEAREST`)."""
    floors = [
        f.split("/")[2].removesuffix(".py") for f, _, _ in edits if f.startswith("_src/step/")
    ]
    near = [t for floor in floors for t in NEAREST.get(floor, []) if t in tests]
    return list(dict.fromkeys([*near, *tests]))


#: The suite in order, in one process, stopping at the first failure.
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0"]


def run(name: str, edits: list[tuple[str, str, str]], tests: list[str]) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = pathlib.Path(tmp)
        copy_repository(copy)
        plant(copy, edits)
        # the whole target grid of the property tests, not CI's sample
        # the copy first, before what PYTHONPATH holds already (where jax lives on
        # a machine that installs it so)
        paths = [str(copy), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "SPMDTREE_FULL_GRID": "1"}
        where = subprocess.run(
            [sys.executable, "-c", "import spmdtree; print(spmdtree.__file__)"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        if where.returncode:  # the mutant's own text is wrong: a bug in this tool
            raise SystemExit(f"mutant {name} does not import:\n{where.stderr}")
        if not where.stdout.strip().startswith(str(copy)):
            raise SystemExit(f"the copy is not what gets imported: {where.stdout}")
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [*PYTEST, *nearest_first(edits, tests or ordered_tests())],
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired:  # a hang is not a kill: it is reported
            return "TIMEOUT", f"the suite ran over {TIMEOUT} s", time.perf_counter() - start
        seconds = time.perf_counter() - start
        failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.MULTILINE)
        if done.returncode == 0:
            return "SURVIVED", "", seconds
        if done.returncode in (4, 5):  # pytest's usage error or no tests: no verdict
            return "NO TESTS", done.stdout.strip().splitlines()[-1], seconds
        return "killed", failed[0] if failed else done.stdout.strip().splitlines()[-1], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--tests", nargs="*", default=[], help="test files (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run side by side")
    parser.add_argument(
        "--step",
        action="store_true",
        help="the step wing's mutants (in spmdtree/_src/step/), against its tests (STEP_TESTS)",
    )
    args = parser.parse_args()
    step = [
        n for n, edits in MUTANTS.items() if all(f.startswith("_src/step/") for f, _, _ in edits)
    ]
    names = args.names or (step if args.step else list(MUTANTS))
    if args.step and not args.tests:
        args.tests = STEP_TESTS
    survivors = []
    start = time.perf_counter()
    # Each mutant runs in its own copy and process: they can run side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = {pool.submit(run, name, MUTANTS[name], args.tests): name for name in names}
        for future in concurrent.futures.as_completed(runs):
            verdict, by, seconds = future.result()
            print(f"{runs[future]:<36} {verdict:<9} {seconds:6.0f} s  {by}", flush=True)
            if verdict != "killed":
                survivors.append(runs[future])
    print(f"{len(names) - len(survivors)} of {len(names)} mutants killed", end="")
    print(f" in {time.perf_counter() - start:.0f} s ({args.jobs} at a time)")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
