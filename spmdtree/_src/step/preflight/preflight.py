"""The whole step, on hardware you don't have: `preflight` asks the compiler.

A `Plan` counts the arrays the shardings place. A training step needs more:
activations and the compiler's temporaries are most of its memory. The
compiler knows them, and it needs no accelerator to say. Preflight is four
stages, each a frozen record: the arguments planned (`tracing.arguments`), the
step traced and lowered here or exported (`tracing.trace`), compiled by the
`Compiler` that `compilers.compiler_for` picks (here, a CPU child or the
target's own compiler in a child), the compile's `Analysis`, and then the
`StepPlan` (`step_plan`). `advise` runs the same stages (`plan_arguments`,
`trace_for`, a compiler's `compile`, `step_plan`: 0.6), so it refuses what
preflight refuses, in the same words.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spmdtree._src.errors import public
from spmdtree._src.resolve import check_mesh
from spmdtree._src.rules import AnyMesh, PyTree, Rules
from spmdtree._src.step.compile import (
    Analysis,
    Arguments,
    Compiler,
    Traced,
    arguments,
    check_compiler_options,
    compiler_for,
    trace,
)
from spmdtree._src.step.hw import Hardware, hardware_of
from spmdtree._src.step.preflight.diagnose import experts_gathered
from spmdtree._src.step.preflight.step_plan import StepPlan
from spmdtree._src.text import Located, argument_path


@public
def preflight(
    fn: Callable[..., Any],
    *args: Any,
    mesh: AnyMesh,
    rules: Rules | None = None,
    params: PyTree = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    out_shardings: PyTree = None,
    target: Hardware | str | os.PathLike[str] | None = None,
    devices_per_node: int | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> StepPlan:
    """Compiles a step for `mesh` without running it: its memory and traffic per device.

    The arguments are trees as `fn` takes them: boxes over arrays or
    `jax.ShapeDtypeStruct`s, whose shardings are exactly those of
    ``to_sharding(arg, mesh, rules, params=params)``, and plain leaves (a
    `NamedSharding` they carry is kept; without one they are replicated).
    Nothing is allocated. The step is traced as it runs: under the mesh
    (`jax.set_mesh`) and, if `rules` are given, under those rules
    (`logical_axis_rules`), so its `with_logical_constraint` calls resolve
    through them. Where it compiles:

    - with `target` (new in 0.4), by that accelerator's own compiler, without
      the accelerator, in a subprocess (this process's backends stay as they
      are): XLA's GPU compiler for `mesh.size` GPUs as nodes of
      `devices_per_node`, or libtpu for a TPU slice (several slices where
      `devices_per_node`, the slice size, is smaller than the mesh), the mesh
      laid on them as `jax.make_mesh` lays a real job;
    - else a `Mesh` compiles for its own devices (on an accelerator, with the
      real compiler);
    - else a `jax.sharding.AbstractMesh` compiles on as many CPU devices laid
      out like it: the fast estimate, in this process when its CPU backend has
      enough devices, else in a fresh subprocess given that many, which
      receives the traced step through `jax.export` (a 2,048-chip mesh works
      from a process with one device).

    Accuracy: the real compiler's figures (a target, or a real `Mesh`):
    arguments + outputs - aliased + temporaries equalled a real H200's peak
    within 1.2 KB in five configurations, and a deviceless GPU compile came
    within 4% of it (docs/planning.md, "Compiling for the target"). The CPU
    compile of the same step is an estimate: +0.7% to +4.3% of the H200's peak
    with jax 0.11.2, +2.2% to +16.4% with jax 0.10.2, and more on steps whose
    layers are rematerialised in bf16; with jax 0.12.1, -7.4% on the 0.87B
    step (its CPU compiler now holds less than the H200 did).

    Args:
        fn: the step, e.g. ``train_step(params, state, batch)``.
        *args: its arguments.
        mesh: a `Mesh` or `jax.sharding.AbstractMesh`.
        rules: rules for logical boxes without their own, and the rules in
            effect while the step is traced; None: the rules context.
        params: the boxed params the arguments' optimizer states were derived
            from (as for `to_sharding`).
        donate_argnums: arguments whose buffers the outputs may reuse, as for
            `jax.jit`.
        static_argnums: arguments passed through as Python values, as for
            `jax.jit`.
        out_shardings: a `PartitionSpec` or `NamedSharding` (its spec and,
            new in 0.5, its memory kind are used) per output, or a tree of
            them that is a prefix of the outputs; None lets the compiler choose.
        target: compile with an accelerator's own compiler, without the
            accelerator (new in 0.4): a preset's name (``"a100"``, ``"h100"``,
            ``"h200"``, ``"b200"``: XLA GPU; ``"tpu-v5e"``, ``"tpu-v5p"``, ``"tpu-v6e"``:
            libtpu), a `Hardware` with a `chip` (0.6: its own, not looked up
            by its name), or the path of a file `Hardware.to_json` wrote (a
            calibrated chip's; new in 0.8). The `StepPlan` keeps it
            (`target_hardware`): ``time()`` and ``fits()`` need no argument. Needs ``pip install 'spmdtree[cuda]'`` or
            ``'spmdtree[tpu]'``. None: the mesh's own devices, or the CPU estimate
            for an `AbstractMesh`.
        devices_per_node: with `target`, GPUs per node (the hardware's: 8) or
            chips per TPU slice (the hardware's: one slice for the whole mesh).
        compiler_options: the job's own XLA options, by name without the
            ``--`` of ``XLA_FLAGS`` (``{"xla_gpu_enable_latency_hiding_scheduler":
            True}``), merged over spmdtree's for its accelerator's compiler: the
            target's, or a `Mesh`'s devices' (new in 0.6). The CPU estimate is no
            job's compiler and compiles without them (a flag says so). A job's
            ``XLA_FLAGS`` reach a compile only as such options: pass the ones that
            shape its program (combine thresholds, the scheduler).

    Returns:
        The `StepPlan`.

    Raises:
        ValueError: for boxes that cannot resolve (as `to_sharding` says), a
            step that does not trace (with JAX's message), a subprocess that
            ran out of memory, a target whose compiler is not installed (with
            the pip command), a mesh that does not fill a target's nodes or
            slices, or an argument in ``"unpinned_host"`` memory for a TPU
            target (libtpu does not compile it; new in 0.5).
        TypeError: for a mesh or argument numbers of the wrong kind.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
        >>> w = st.Partitioned(jax.ShapeDtypeStruct((64, 64), jnp.float32), (None, None))
        >>> batch = st.LogicallyPartitioned(jax.ShapeDtypeStruct((32, 64), jnp.float32), ("batch", None))
        >>> def step(w, x):
        ...     grad = jax.grad(lambda w: jnp.mean((x.value @ w.value) ** 2))(w)
        ...     return st.replace_boxed(w, w.value - 0.1 * grad.value)
        >>> plan = st.preflight(step, w, batch, mesh=mesh, rules=[("batch", "data")], donate_argnums=0)
        >>> plan.alias_bytes == 64 * 64 * 4  # the new weights reuse the donated buffer
        True
        >>> plan.collectives[0].kind, plan.collectives[0].bytes  # the gradient's all-reduce
        ('all-reduce', 16384)
    """

    keywords = Keywords(params, donate_argnums, static_argnums, out_shardings)
    planned = plan_arguments(args, mesh, rules, keywords)
    chip = hardware_of(target, "target") if target is not None else None
    compiler = compiler_for(
        mesh, chip, devices_per_node, compiler_options=check_compiler_options(compiler_options)
    )
    traced = trace_for(fn, planned, mesh, rules, keywords, (compiler,))
    plan = step_plan(traced, compiler.compile(traced), compiler)
    return dataclasses.replace(plan, target_hardware=chip)  # time() and fits() on it


# --- the stages preflight and advise share ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Keywords:
    """preflight's keywords beyond the mesh, the rules and where it compiles: what a
    step is planned and traced with (advise's `make_step` returns them as its
    kwargs; the field names are the keywords it may pass)."""

    params: PyTree = None
    donate_argnums: int | Sequence[int] = ()
    static_argnums: int | Sequence[int] = ()
    out_shardings: PyTree = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The keywords, in order."""
        return tuple(field.name for field in dataclasses.fields(cls))


def plan_arguments(
    args: tuple[Any, ...], mesh: AnyMesh, rules: Rules | None, keywords: Keywords
) -> Arguments:
    """The first stage: the mesh checked and the arguments planned on it
    (`tracing.arguments`)."""
    check_mesh(mesh)
    return arguments(
        args,
        mesh,
        rules,
        params=keywords.params,
        donate_argnums=keywords.donate_argnums,
        static_argnums=keywords.static_argnums,
    )


def trace_for(
    fn: Callable[..., Any],
    planned: Arguments,
    mesh: AnyMesh,
    rules: Rules | None,
    keywords: Keywords,
    compilers: Sequence[Compiler],
) -> Traced:
    """The second stage: the planned arguments checked against every compiler the
    step will meet (the one that compiles it first, and the target's that confirms
    it), then the step traced for the first."""
    for compiler in compilers:
        compiler.toolchain.refuse(planned.plan)
    return trace(
        fn, planned, mesh, rules, out_shardings=keywords.out_shardings, compiler=compilers[0]
    )


def step_plan(traced: Traced, analysis: Analysis, compiler: Compiler) -> StepPlan:
    """The last stage: the `StepPlan` of an analysis, its flash-attention kernels
    counted over the blocks their masks keep (what the trace says: new in 0.7); its
    flags: the inputs' first, then the step's, then the warnings tracing raised, then
    expert weights gathered instead of tokens moved (new in 0.8)."""
    analysis = analysis.masked(traced.masks)
    inputs = traced.arguments.plan
    flags: list[str] = [
        Located(argument_path(row.path), flag) for row in inputs.rows for flag in row.flags
    ]
    flags += [*analysis.reading.flags, *compiler.left_out(analysis), *traced.warned]
    ops = analysis.schedule.collectives() if analysis.schedule is not None else ()
    gathered = experts_gathered(ops, inputs, path=argument_path)
    flags += [gathered] if gathered is not None else []
    memory = analysis.memory
    if not memory.host_argument_bytes:  # the CPU (one memory) and XLA GPU count them
        memory = memory.with_host_arguments(inputs.host_bytes)  # as the device's
    return StepPlan(
        memory=memory,
        collectives=analysis.reading.collectives,
        inputs=inputs,
        backend=analysis.backend,
        mesh=traced.mesh,
        compile_seconds=traced.seconds + analysis.seconds,
        flags=tuple(dict.fromkeys(flags)),
        flops=analysis.reading.flops,
        overstated_bytes=analysis.overstated_bytes,
        target=str(compiler),
        devices_per_node=compiler.devices_per_node,
        rule_problems=traced.rule_problems,
        schedule=analysis.schedule,
        compiler_seconds=analysis.compiler_seconds,
        read_seconds=analysis.read_seconds,
    )
