"""The whole step, on hardware you don't have: `preflight` asks the compiler.

A `Plan` counts the arrays the shardings place. A training step needs more:
activations and the compiler's temporaries are most of its memory. The
compiler knows them, and it needs no accelerator to say. Preflight is four
stages, each a frozen record: the arguments planned (`trace.arguments`), the
step traced and lowered here or exported (`trace.trace`), compiled by the
`Compiler` that `targets.compiler_for` picks (here, a CPU child or the
target's own compiler in a child), the compile's `Analysis`, and then the
`StepPlan` (`step_plan`). `advise` runs the same stages (`plan_arguments`,
`trace_for`, a compiler's `compile`, `step_plan`: 0.6), so it refuses what
preflight refuses, in the same words.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.plan import Plan
from spmdtree._src.resolve import check_mesh
from spmdtree._src.rules import AnyMesh, PyTree, Rules
from spmdtree._src.specs import RuleProblem
from spmdtree._src.step.advise.diagnose import Closest, Traffic, nothing_fits, unexplained_traffic
from spmdtree._src.step.compile.targets import Analysis, Compiler, Memory, compiler_for
from spmdtree._src.step.compile.trace import Arguments, Traced, arguments, trace
from spmdtree._src.step.hlo.schedule import Collective, Schedule
from spmdtree._src.step.hw.hardware import Hardware, StepTime, step_time
from spmdtree._src.step.kinds import Backend
from spmdtree._src.text import Located, argument_path, step_table


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a compiled step needs on one device, and what it moves.

    The memory figures come from the compiler's own analysis of the step as
    compiled for `mesh`: for a `target`, or on a real `Mesh` of accelerators,
    that accelerator's compiler's own numbers; on an `AbstractMesh` without a
    target (compiled on CPU devices laid out like it), an estimate of an
    accelerator's (see `preflight`).

    Attributes:
        memory: the compiler's `Memory` record of the step per device (new in
            0.5: 0.4's fields are read from it, as the properties
            `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`,
            `code_bytes`, `compiler_peak_bytes` and the ``host_*`` ones).
        argument_bytes: the arguments' bytes on one device.
        output_bytes: the outputs' bytes on one device.
        alias_bytes: bytes of outputs that reuse a donated argument's buffer.
        temp_bytes: the compiler's temporaries (activations among them).
        code_bytes: the generated code (0 on CPU).
        collectives: one `Collective` per kind and set of mesh axes that the
            step runs, as an accelerator runs it (on CPU, an all-reduce of which
            each device only takes its slice is the reduce-scatter it stands for).
        inputs: the `Plan` of the arguments.
        backend: the platform whose compiler compiled it, as `jax.devices()`
            names it: ``"cpu"`` for fake devices, ``"gpu"`` (XLA GPU) or
            ``"tpu"`` (libtpu) for a target or a `Mesh` of those devices; a
            `Backend`, equal to those strings (new in 0.5).
        mesh: the mesh planned for, as given (a plan of a `Mesh` holds its
            devices, which do not pickle; one of an `AbstractMesh` pickles).
        compile_seconds: how long tracing, lowering and compiling took, each counted
            once (0.4 counted the trace twice on a compile in this process).
        flags: sentences: the inputs' plan flags first (a dimension left
            unsharded), then what the figures do not cover (a loop whose trip
            count the compiler does not know counts once; reductions read as
            reduce-scatters), then the warnings raised while tracing.
        flops: floating-point operations per device per step: every dot and
            convolution, times its loops' trip counts; elementwise work left
            out (new in 0.3); a Pallas kernel's as its cost estimate gives them
            (a flag names the kernels without one; new in 0.5).
        overstated_bytes: on a CPU compile, how much of its peak is whole
            reductions an accelerator holds as reduce-scattered shards (new in
            0.3; 0 where there are none, and on accelerators). Part of why the
            estimate differs from an accelerator's peak, not a bound on the
            difference (0.4: measured, an accelerator's peak can lie lower
            still; compile for the target).
        target: what it was compiled for, in words: ``"64 x h100, 8 nodes of
            8, XLA GPU compiler"``, ``"8 CPU devices (the XLA CPU compiler's
            estimate)"`` (new in 0.4).
        devices_per_node: a target's devices per GPU node or TPU slice, as it
            was compiled; `time` lays devices out so by default (new in 0.4;
            None for no target).
        rule_problems: what is wrong with single rules of those the step was
            traced under, as `validate_rules` says it over the arguments on
            `mesh`, one `RuleProblem` each: a rule naming an axis the mesh
            lacks, one never reached, and one that matches nothing: no box of
            the arguments has its logical name and no `with_logical_constraint`
            in the step names it (a name only activations have counts as used;
            the constraints of a function JAX had already traced in this
            process with the same shapes, and so did not trace again, are not
            seen). New in 0.5.
        schedule: the compiled module's schedule, what `time` walks for
            `StepTime.predicted_seconds` (new in 0.5).
        compiler_peak_bytes: the compiler's own peak per device where it gives
            one (``memory_analysis().peak_memory_in_bytes``: libtpu and XLA
            GPU), else 0 (on the CPU estimate its own is the CPU program's). `peak_bytes` (arguments + outputs - aliased
            + temporaries) is what advise judges by: on a real H200 it equalled
            the device's peak to 1.2 KB; the compilers' own figures lie below
            it on some steps, and are shown beside it (new in 0.5).
        compiler_seconds: the compiler's own time estimate where it gives one
            (libtpu's ``cost_analysis()["optimal_seconds"]``), else 0.0; shown
            beside the prediction as a cross-check (new in 0.5). A negative
            figure is no figure either: libtpu gave -3.0 s for a step of jax's
            Pallas flash-attention kernels, whose backward carries no cost
            estimate.
        host_argument_bytes: the arguments offloaded to the host's memory (a
            host `memory_kind`), per device, not in `argument_bytes` (new in
            0.5). libtpu says them; the CPU (one memory) and XLA GPU count them
            as the device's, so there they are the inputs' plan's `host_bytes`,
            moved out of `argument_bytes`.
        host_output_bytes: the outputs placed in the host's memory, per device,
            not in `output_bytes`: the compiler's ``host_output_size_in_bytes``
            (on the CPU, those its output shardings put there; new in 0.5).
        host_alias_bytes: host outputs in donated host buffers (new in 0.5).
        host_temp_bytes: the compiler's temporaries in host memory (new in 0.5).

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
        >>> x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
        >>> step = st.preflight(lambda x: jnp.sum(x.value * 2), x, mesh=mesh)
        >>> step.argument_bytes, step.output_bytes  # half of 128 B each, and a scalar
        (64, 4)
        >>> step.peak_bytes == step.argument_bytes + step.output_bytes + step.temp_bytes
        True
        >>> [c.kind for c in step.collectives]
        ['all-reduce']
    """

    memory: Memory
    collectives: tuple[Collective, ...]
    inputs: Plan
    backend: Backend
    mesh: AnyMesh
    compile_seconds: float
    flags: tuple[str, ...] = ()
    flops: int = 0
    overstated_bytes: int = 0
    target: str = ""
    devices_per_node: int | None = None
    rule_problems: tuple[RuleProblem, ...] = ()
    schedule: Schedule | None = dataclasses.field(default=None, repr=False, compare=False)
    compiler_seconds: float = 0.0

    @property
    def argument_bytes(self) -> int:
        """The arguments' bytes on one device (`memory`'s)."""
        return self.memory.argument_bytes

    @property
    def output_bytes(self) -> int:
        """The outputs' bytes on one device (`memory`'s)."""
        return self.memory.output_bytes

    @property
    def alias_bytes(self) -> int:
        """Bytes of outputs that reuse a donated argument's buffer (`memory`'s)."""
        return self.memory.alias_bytes

    @property
    def temp_bytes(self) -> int:
        """The compiler's temporaries, activations among them (`memory`'s)."""
        return self.memory.temp_bytes

    @property
    def code_bytes(self) -> int:
        """The generated code, 0 on CPU (`memory`'s)."""
        return self.memory.code_bytes

    @property
    def compiler_peak_bytes(self) -> int:
        """The compiler's own peak, where it gives one (`memory`'s; new in 0.5)."""
        return self.memory.compiler_peak_bytes

    @property
    def host_argument_bytes(self) -> int:
        """The arguments offloaded to the host, per device (`memory`'s; new in 0.5)."""
        return self.memory.host_argument_bytes

    @property
    def host_output_bytes(self) -> int:
        """The outputs placed in the host's memory, per device (new in 0.5)."""
        return self.memory.host_output_bytes

    @property
    def host_alias_bytes(self) -> int:
        """Host outputs in donated host buffers (new in 0.5)."""
        return self.memory.host_alias_bytes

    @property
    def host_temp_bytes(self) -> int:
        """The compiler's temporaries in host memory (new in 0.5)."""
        return self.memory.host_temp_bytes

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries: the step's peak on one device."""
        return self.memory.peak_bytes

    @property
    def host_peak_bytes(self) -> int:
        """The same in the host's memory, per device: what the step offloads (new in 0.5).

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None), memory_kind="pinned_host")
            >>> step = st.preflight(lambda x: jax.device_put(x.value, jax.memory.Space.Device) * 2, x, mesh=mesh)
            >>> step.host_argument_bytes, step.argument_bytes, step.host_peak_bytes
            (64, 0, 64)
        """
        return self.memory.host_peak_bytes

    @property
    def unexplained_traffic(self) -> Traffic | None:
        """The step's collectives, where they move far more than the layout of its
        arguments explains: a `Traffic` saying so and what to do; else None (new
        in 0.5).

        The layout explains, at most, each sharded argument gathered whole twice
        and its gradient reduce-scattered, and each replicated one's gradient
        all-reduced; more than 4 times that (and 1 MiB beyond it) is said.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
            >>> st.preflight(lambda x: jnp.sum(x.value), x, mesh=mesh).unexplained_traffic is None
            True
        """
        return unexplained_traffic(self.collectives, self.inputs)

    @public
    def what_would_fit(
        self, budget_bytes: int, *, batch: int | None = None, remat: bool | None = None
    ) -> str | None:
        """What might bring the step under `budget_bytes`, in words; None where it
        fits (new in 0.5).

        How far over its peak is, then what might bring it under: rematerialising
        its layers (said where `remat` is not True and the temporaries are most
        of the peak), more devices with everything sharded over them, and the largest
        batch whose temporaries (which scale with it; the rest does not) fit.

        Args:
            budget_bytes: the memory per device.
            batch: the step's global batch, to say a smaller one; None: as a share.
            remat: whether the step rematerialises its layers; None: not known.

        Returns:
            The sentences, or None if the peak fits.

        Raises:
            TypeError: for a budget that is not an int, or a batch that is not one.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((256, 1024), jnp.float32), ("data", None))
            >>> step = st.preflight(lambda x: jnp.sum(jnp.tanh(x.value) ** 2), x, mesh=mesh)
            >>> step.what_would_fit(step.peak_bytes) is None
            True
            >>> "A batch of at most" in step.what_would_fit(step.peak_bytes - 1, batch=256)
            True
        """
        if not self.fits(budget_bytes):
            if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool)):
                raise Mistake(TypeError, f"batch is {batch!r}; expected an int (or None).")
            devices = math.prod(self.mesh.shape.values())
            closest = Closest("", self.peak_bytes, self.temp_bytes, devices, batch, remat)
            return nothing_fits([closest], budget_bytes)
        return None

    @public
    def fits(self, budget_bytes: int) -> bool:
        """Whether the step's peak on one device fits in `budget_bytes`.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
            >>> step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh)
            >>> step.fits(step.peak_bytes), step.fits(step.peak_bytes - 1)
            (True, False)
        """
        if not isinstance(budget_bytes, (int, np.integer)) or isinstance(budget_bytes, bool):
            raise Mistake(TypeError, f"budget_bytes is {budget_bytes!r}; expected an int of bytes.")
        return self.peak_bytes <= budget_bytes

    @public
    def time(self, hardware: Hardware, *, devices_per_node: int | None = None) -> StepTime:
        """A roofline bound on this step on `hardware`: its FLOPs at the peak, its
        collectives at the links' bandwidth (new in 0.3).

        Devices sit on nodes by their position in the mesh's row-major device
        order (position // devices_per_node); a group that spans nodes is
        timed as hierarchical algorithms run it (docs/planning.md, "Hardware
        and time"). Not a prediction: perfect overlap, peak FLOPs.

        Args:
            hardware: a `Hardware` (e.g. ``st.hardware("h100")``).
            devices_per_node: overrides the hardware's (the slice size of a
                multi-slice TPU job; 1 puts every device on its own node); None:
                as the step was compiled for a target, else the hardware's.

        Returns:
            The `StepTime`.

        Raises:
            ValueError: for `devices_per_node` < 1, or a collective that needs
                a link kind the hardware does not have.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> w = st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), (None, None))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
            >>> step = st.preflight(lambda w, x: jnp.sum(x.value @ w.value), w, x, mesh=mesh)
            >>> t = step.time(st.hardware("h100"))
            >>> t.compute_seconds == step.flops / 989e12
            True
            >>> t.bound_seconds == max(t.compute_seconds, t.comm_seconds)
            True
        """
        per_node = self.devices_per_node if devices_per_node is None else devices_per_node
        return step_time(
            self.collectives, self.flops, self.mesh.shape, hardware, per_node, self.schedule
        )

    def __str__(self) -> str:
        return step_table(self)


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
    target: Hardware | str | None = None,
    devices_per_node: int | None = None,
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
    layers are rematerialised in bf16.

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
            libtpu) or a `Hardware` with a `chip` (0.6: its own, not looked up
            by its name). Needs ``pip install 'spmdtree[cuda]'`` or
            ``'spmdtree[tpu]'``. None: the mesh's own devices, or the CPU estimate
            for an `AbstractMesh`.
        devices_per_node: with `target`, GPUs per node (the hardware's: 8) or
            chips per TPU slice (the hardware's: one slice for the whole mesh).

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
    compiler = compiler_for(mesh, target, devices_per_node)
    traced = trace_for(fn, planned, mesh, rules, keywords, (compiler,))
    return step_plan(traced, compiler.compile(traced), compiler)


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
    (`trace.arguments`)."""
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
        _check_memory_kinds(planned.plan, compiler)
    return trace(
        fn, planned, mesh, rules, out_shardings=keywords.out_shardings, compiler=compilers[0]
    )


def _check_memory_kinds(inputs: Plan, compiler: Compiler) -> None:
    """Refuses, before it compiles, what a target's compiler refuses of the
    arguments' memory kinds: libtpu does not compile an argument in
    ``"unpinned_host"`` memory (measured: an internal error, a shape mismatch
    between memory spaces); XLA GPU takes both host kinds.

    Raises:
        Mistake: naming the first such argument.
    """
    if compiler.platform != "tpu":
        return
    found = [row.path for row in inputs.rows if row.memory_kind == "unpinned_host"]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise Mistake(
            ValueError,
            f"{argument_path(found[0])}{more} has memory_kind 'unpinned_host', which libtpu "
            "does not compile for an argument. Offload it to the host with "
            "memory_kind='pinned_host'.",
        )


def step_plan(traced: Traced, analysis: Analysis, compiler: Compiler) -> StepPlan:
    """The last stage: the `StepPlan` of an analysis; its flags: the inputs' first,
    then the step's, then the warnings tracing raised."""
    inputs = traced.arguments.plan
    flags: list[str] = [
        Located(argument_path(row.path), flag) for row in inputs.rows for flag in row.flags
    ]
    flags += [*analysis.reading.flags, *traced.warned]
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
    )
