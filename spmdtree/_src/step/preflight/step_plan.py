"""A step's record: `StepPlan`, what preflight says of a step (its memory per device,
collectives, FLOPs, inputs, flags), what it means (`time`, `fits`,
`what_would_fit`, `unexplained_traffic`) and its table (new in 0.6: beside the
record; 0.5 rendered it in text.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
from typing import Any

import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.plan import Plan
from spmdtree._src.rules import AnyMesh
from spmdtree._src.specs import RuleProblem
from spmdtree._src.step.compile import TOOLCHAINS, Memory
from spmdtree._src.step.hlo import Collective, Schedule
from spmdtree._src.step.hw import Hardware, hardware_of, timed_on
from spmdtree._src.step.kinds import Backend
from spmdtree._src.step.pictures import saved, time_picture
from spmdtree._src.step.preflight.diagnose import (
    Closest,
    Traffic,
    nothing_fits,
    unexplained_traffic,
)
from spmdtree._src.step.time import (
    Measurement,
    StepTime,
    compare,
    read_profile,
    step_spans,
    step_time,
    time_json,
    trace_events,
)
from spmdtree._src.text import (
    JSON_VERSION,
    axis_types_text,
    flops_text,
    mesh_json,
    seconds_text,
    size_text,
)


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
            GPU), else 0 (on the CPU estimate its own is the CPU program's). On
            TPU it is what fitting is judged by (`judged_bytes`; 0.7: libtpu
            checks memory as it compiles); elsewhere `peak_bytes` (arguments +
            outputs - aliased + temporaries): on a real H200 it equalled the
            device's peak to 1.2 KB; the compilers' own figures lie below it on
            some steps, and are shown beside it (new in 0.5).
        compiler_seconds: the compiler's own time estimate where it gives one,
            else 0.0; shown beside the prediction as a cross-check (new in 0.5).
            0.7: libtpu's kernels' estimated cycles (their backend configs'
            ``estimated_cycles``), each times its calls, at the chip's clock
            (`TpuChip.clock_ghz`), its unestimable kernels left out (flagged);
            0.6 read ``cost_analysis()["optimal_seconds"]``, which counts a
            loop's body once and -1 s per custom call it cannot cost, and so
            read 0.0 or below on most steps.
        read_seconds: of `compile_seconds`, how long reading the compiled module
            took: its instructions, the one walk of its schedule and the
            reading folded from it (new in 0.6).
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
    read_seconds: float = 0.0
    target_hardware: Hardware | None = dataclasses.field(default=None, repr=False, compare=False)

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
    def judged_bytes(self) -> int:
        """What `fits` and `advise` judge against a budget (new in 0.7): where the
        compiler checks memory as it compiles (libtpu, deviceless too: a step it
        compiles fits its device), its own peak (`compiler_peak_bytes`); elsewhere
        `peak_bytes`, arguments + outputs - aliased + temporaries. Measured on a
        TPU v5e (15.75 GiB): a step of summed peak 16.5 GiB compiled and ran, its
        libtpu peak 13.5 GiB.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
            >>> step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh)
            >>> step.judged_bytes == step.peak_bytes  # the CPU estimate: the summed peak
            True
        """
        if TOOLCHAINS[self.backend].checks_memory and self.compiler_peak_bytes:
            return self.compiler_peak_bytes
        return self.peak_bytes

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
            closest = Closest("", self.judged_bytes, self.temp_bytes, devices, batch, remat)
            return nothing_fits([closest], budget_bytes)
        return None

    @public
    def fits(self, budget_bytes: int | None = None) -> bool:
        """Whether the step's peak on one device fits in `budget_bytes`: on TPU
        libtpu's own peak, which libtpu checks as it compiles (0.7: the summed
        `peak_bytes`, which the chip does not use), elsewhere `peak_bytes`
        (`judged_bytes`). None: the memory of the chip it was compiled for
        (`target_hardware`; new in 0.8).

        Raises:
            ValueError: for no budget on a step compiled for no target.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
            >>> step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh)
            >>> step.fits(step.peak_bytes), step.fits(step.peak_bytes - 1)
            (True, False)
        """
        if budget_bytes is None:
            budget_bytes = self._target("fits", "budget_bytes").memory_bytes
        if not isinstance(budget_bytes, (int, np.integer)) or isinstance(budget_bytes, bool):
            raise Mistake(TypeError, f"budget_bytes is {budget_bytes!r}; expected an int of bytes.")
        return self.judged_bytes <= budget_bytes

    def _target(self, what: str, argument: str) -> Hardware:
        """The chip this step was compiled for, which `what` takes in place of its
        `argument`; refused for a step compiled for none (new in 0.8)."""
        if self.target_hardware is None:
            raise Mistake(
                ValueError,
                f"this step was compiled for no target ({self.target}), so {what} needs "
                f"{argument}=: pass it, or preflight with target= (a preset's name, a "
                "chip.json that Hardware.to_json() wrote, or a st.Hardware).",
            )
        return self.target_hardware

    @public
    def time(
        self,
        hardware: Hardware | str | os.PathLike[str] | None = None,
        *,
        devices_per_node: int | None = None,
    ) -> StepTime:
        """This step's time on `hardware`: a roofline bound (its FLOPs at the peak,
        its collectives at the links' bandwidth, perfect overlap; new in 0.3) and,
        from the compiled schedule, the predicted time (each kernel timed by the
        model, its streams walked; new in 0.5), which advise ranks by.

        Devices sit on nodes by their position in the mesh's row-major device
        order (position // devices_per_node); a group that spans nodes is
        timed as hierarchical algorithms run it (docs/planning.md, "Hardware
        and time").

        Args:
            hardware: a `Hardware` (e.g. ``st.hardware("h100")``), a preset's name
                or the path of a file `Hardware.to_json` wrote (new in 0.8); None:
                the chip the step was compiled for (`target_hardware`, new in 0.8).
            devices_per_node: overrides the hardware's (the slice size of a
                multi-slice TPU job; 1 puts every device on its own node); None:
                as the step was compiled for a target, else the hardware's.

        Returns:
            The `StepTime`.

        Raises:
            ValueError: for `devices_per_node` < 1, a collective that needs a link
                kind the hardware does not have, a name no preset has or a file
                that is no Hardware JSON, or no hardware for a step compiled for
                no target.

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
        chosen = self._target("time", "hardware") if hardware is None else hardware_of(hardware)
        per_node = self.devices_per_node if devices_per_node is None else devices_per_node
        return step_time(
            self.collectives, self.flops, self.mesh.shape, chosen, per_node, self.schedule
        )

    @public
    def to_json(self, hardware: Hardware | None = None) -> str:
        """The step as JSON text: `to_dict`'s values, ``json.dumps``'d (0.7: 0.6's
        ``to_json`` returned the dict, which is `to_dict` now).

        Example:
            >>> import json, jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
            >>> json.loads(st.preflight(lambda x: jnp.sum(x.value * 2), x, mesh=mesh).to_json())["schema"]
            'spmdtree.StepPlan/1'
        """
        return json.dumps(self.to_dict(hardware), allow_nan=False)

    @public
    def to_dict(self, hardware: Hardware | None = None) -> dict[str, Any]:
        """The step as JSON values (``json.dumps`` takes them), in the versioned
        schema ``"spmdtree.StepPlan/1"`` (new in 0.6 as ``to_json``; 0.7: named
        ``to_dict``, and `to_json` gives its text; docs/api.md, "JSON", lists
        every field): its mesh, target, memory per device, FLOPs, collectives,
        inputs, flags and rule problems; with `hardware`, its ``time`` there too
        (`time_json`'s fields: the bound, the prediction, by class and axes).

        Args:
            hardware: a `Hardware` to time it on, or None for no ``time``.

        Returns:
            A dict of JSON values.

        Raises:
            TypeError: for `hardware` that is no `Hardware`.

        Example:
            >>> import json, jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
            >>> data = st.preflight(lambda x: jnp.sum(x.value * 2), x, mesh=mesh).to_dict()
            >>> data["schema"], data["mesh"]["axes"], data["memory"]["argument_bytes"]
            ('spmdtree.StepPlan/1', {'data': 2}, 64)
            >>> [c["kind"] for c in json.loads(json.dumps(data))["collectives"]]
            ['all-reduce']
        """
        data: dict[str, Any] = {
            "schema": f"spmdtree.StepPlan/{JSON_VERSION}",
            "mesh": mesh_json(self.mesh),
            "target": self.target,
            "backend": str(self.backend),
            "devices_per_node": self.devices_per_node,
            "compile_seconds": self.compile_seconds,
            "memory": {
                field: getattr(self, field)
                for field in (
                    "argument_bytes",
                    "output_bytes",
                    "alias_bytes",
                    "temp_bytes",
                    "code_bytes",
                    "peak_bytes",
                    "compiler_peak_bytes",
                    "overstated_bytes",
                    "host_argument_bytes",
                    "host_output_bytes",
                    "host_alias_bytes",
                    "host_temp_bytes",
                    "host_peak_bytes",
                )
            },
            "flops": self.flops,
            "compiler_seconds": self.compiler_seconds,
            "collectives": [
                {
                    "kind": str(row.kind),
                    "count": row.count,
                    "bytes": row.bytes,
                    "wire_bytes": row.wire_bytes,
                    "axes": list(row.axes),
                    "group": row.group,
                    "written_as": row.written_as,
                }
                for row in self.collectives
            ],
            "inputs": {
                "arrays": len(self.inputs.rows),
                "device_bytes": self.inputs.device_bytes,
                "total_bytes": self.inputs.total_bytes,
            },
            "flags": list(self.flags),
            "rule_problems": list(dict.fromkeys(p.sentence for p in self.rule_problems)),
        }
        if hardware is not None:
            data["time"] = {"hardware": hardware.name, **time_json(self.time(hardware))}
        return data

    @public
    def trace(
        self,
        hardware: Hardware,
        path: str | os.PathLike[str] | None = None,
        *,
        devices_per_node: int | None = None,
    ) -> dict[str, Any]:
        """The predicted schedule on `hardware` as a trace: Chrome trace-event JSON,
        what Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's trace
        viewer open, as they open `jax.profiler`'s traces (new in 0.6).

        A track per stream that ran something: ``compute`` (each kernel, named as
        the compiled module names it, with its class, FLOPs and bytes; the compute
        waiting for a collective or a copy, ``waits for ...``), ``collectives``
        (each collective with its kind, bytes, mesh axes and group) and, on a
        TPU, ``copies`` (each async copy the DMA engines run; new in 0.8). A loop's first three iterations
        are laid out whole and the rest as one span per track, its args saying
        how many (what `time` walks). Times are on a grid of whole nanoseconds;
        the last event ends at `StepTime.predicted_seconds` to the nanosecond: a
        picture of the prediction, not a profile.

        Args:
            hardware: a `Hardware` (e.g. ``st.hardware("h100")``).
            path: where to write the JSON too (open it in Perfetto); None: not
                written.
            devices_per_node: as for `time`.

        Returns:
            The trace, a dict of JSON values: ``traceEvents``, and ``otherData``
            with the step's predicted seconds, hardware and target.

        Raises:
            TypeError: for `hardware` that is no `Hardware`.
            ValueError: for a step without a compiled schedule.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
            >>> step = st.preflight(lambda x: jnp.sum(x.value @ x.value.T), x, mesh=mesh)
            >>> trace = step.trace(st.hardware("h100"))
            >>> tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
            >>> sorted(tracks)  # a TPU's async copies have a track of their own (new in 0.8)
            ['collectives', 'compute']
            >>> end = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X")
            >>> abs(end / 1e6 - step.time(st.hardware("h100")).predicted_seconds) < 1e-9  # the grid: 1 ns
            True
        """
        if self.schedule is None:
            raise Mistake(
                ValueError,
                "this StepPlan carries no compiled schedule to lay out (one rebuilt from its "
                "fields alone); preflight the step again for its trace.",
            ).error("StepPlan.trace")
        per_node = self.devices_per_node if devices_per_node is None else devices_per_node
        timed, spans = step_spans(
            self.collectives, self.flops, self.mesh.shape, hardware, per_node, self.schedule
        )
        other = {
            "spmdtree": "predicted step (StepPlan.trace)",
            "hardware": hardware.name,
            "compiled for": self.target or str(self.backend),
            "predicted_seconds": timed.predicted_seconds,
            "by class": dict(timed.predicted_by_class or {}),
            "flags": list(timed.flags),
        }
        title = f"predicted step on {hardware.name} ({self.target or self.backend})"
        trace = trace_events(spans, title, other)
        if path is not None:
            pathlib.Path(path).write_text(json.dumps(trace))
        return trace

    @functools.partial(public, name="StepPlan.compare")
    def compare(
        self,
        profile: str | os.PathLike[str] | dict[str, Any],
        *,
        hardware: Hardware | str | os.PathLike[str] | None = None,
        module: str | None = None,
    ) -> Measurement:
        """This step's prediction held against a profile taken elsewhere, without
        running anything (new in 0.7): each instruction of the compiled schedule
        joined by name to the time the profile gives it, and the step's time read
        from the profile's own steps.

        The profile is the trace ``jax.profiler.trace(dir,
        create_perfetto_trace=True)`` wrote while this step ran: on an
        accelerator its first device's ``XLA Ops`` and ``XLA Modules`` tracks;
        on CPU devices, XLA CPU's own events (compiled with
        ``xla_cpu_enable_xprof_traceme``). For the names to join, the profiled
        program must be the one this plan compiled: the same step, mesh and
        compiler (a deviceless ``target=`` compile names its instructions as the
        chip's own does).

        Args:
            profile: the trace (``.json`` or ``.json.gz``), the folder the
                profiler wrote (its newest Perfetto trace), or the parsed JSON.
            hardware: what to time the prediction on (a `Hardware`, a preset's
                name or a Hardware JSON's path); None: the chip the step was
                compiled for (`target_hardware`, new in 0.8), else the preset of
                its target's or its devices' kind.
            module: the compiled module's name in the profile (``jit_step``);
                None: the module whose steps took the most device time.

        Returns:
            The `Measurement`.

        Raises:
            ValueError: for a profile that is no trace or holds no device's
                instructions or no step of the module, a step without a compiled
                schedule, or no `hardware` where none can be told.
            TypeError: for `hardware` that is no `Hardware`.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
            >>> step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh)
            >>> (kernel,) = [k.name for k in step.schedule.kernels()]
            >>> ops = [{"ph": "X", "pid": 1, "tid": 1, "name": kernel, "ts": 0, "dur": 4,
            ...         "args": {"hlo_op": kernel, "hlo_module": "jit_sin", "run_id": "1"}}]
            >>> m = step.compare({"traceEvents": ops}, hardware=st.hardware("h100"))
            >>> m.joined_share, m.seconds, [op.measured_seconds for op in m.ops]
            (1.0, 4e-06, [4e-06])
        """
        given = hardware if hardware is not None else self.target_hardware
        chosen = timed_on(given, self.target)  # said before the profile is read
        return compare(self, read_profile(profile, module), chosen)

    @public
    def plot(
        self,
        hardware: Hardware,
        path: str | os.PathLike[str] | None = None,
        *,
        devices_per_node: int | None = None,
    ) -> Any:
        """A picture of the step's time on `hardware` (new in 0.6; needs matplotlib:
        ``pip install 'spmdtree[plot]'``): above, the predicted step as one bar
        split by class (matmul, attention, memory, the compute waiting for
        collectives, launches) beside the roofline bound's compute and
        collectives; below, per set of mesh axes, its collectives at the links'
        bandwidth and how long the compute waits for them (`StepTime.exposed_by_axes`).

        Args:
            hardware: a `Hardware` (e.g. ``st.hardware("h100")``).
            path: where to save it (its format by its suffix); None: not saved.
            devices_per_node: as for `time`.

        Returns:
            The `matplotlib.figure.Figure`.

        Raises:
            TypeError: for `hardware` that is no `Hardware`.
            ImportError: where matplotlib is not installed.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
            >>> step = st.preflight(lambda x: jnp.sum(x.value @ x.value.T), x, mesh=mesh)
            >>> fig = step.plot(st.hardware("h100"))
            >>> [label.get_text() for label in fig.axes[0].get_yticklabels()]
            ['predicted', 'bound']
        """
        timed = self.time(hardware, devices_per_node=devices_per_node)
        by_class = dict(timed.predicted_by_class or {"matmul": timed.compute_seconds})
        bound = {"compute": timed.compute_seconds, "collectives": timed.comm_seconds}
        exposed = timed.exposed_by_axes or {}
        by_axes = {
            "+".join(axes) or "-": (timed.comm_by_axes.get(axes, 0.0), exposed.get(axes, 0.0))
            for axes in dict.fromkeys([*timed.comm_by_axes, *exposed])
        }
        title = f"predicted step on {hardware.name} ({self.target or self.backend})"
        return saved(time_picture(by_class, bound, by_axes, title), path)

    def __str__(self) -> str:
        return _table(self)


def _table(step: StepPlan) -> str:
    """The table of a `StepPlan`: memory per device, compute, collectives, the inputs."""
    axes = ", ".join(f"{name} {size}" for name, size in step.mesh.shape.items())
    devices = math.prod(step.mesh.shape.values())
    compiled = step.target or step.backend
    lines = [
        f"step on {devices} device{'' if devices == 1 else 's'} ({axes}; axis types "
        f"{axis_types_text(step.mesh)}), compiled for {compiled} "
        f"in {step.compile_seconds:.1f} s",
        "memory per device",
        *_memory_lines(step),
    ]
    if step.compiler_peak_bytes:
        judged = (
            "what fits and advise judge: it checks memory as it compiles"
            if step.judged_bytes == step.compiler_peak_bytes
            else "the peak above is what advise judges"
        )
        lines.append(
            f"  {'its peak':<12}{size_text(step.compiler_peak_bytes):>11}  the compiler's own "
            f"figure (peak_memory_in_bytes); {judged}"
        )
    if step.host_peak_bytes:  # offloaded arrays (new in 0.5)
        lines.append(
            f"  {'on the host':<12}{size_text(step.host_peak_bytes):>11}  offloaded arguments, "
            "outputs and temporaries, not in the peak"
        )
    if step.backend.estimates:  # no range claimed: measured, neither side bounds it
        lines.append(f"{'':<25}an estimate: pass target= for an accelerator's own")
    if step.overstated_bytes:
        lines.append(
            f"{'':<25}{size_text(step.overstated_bytes)} of it whole reductions an "
            "accelerator holds as shards"
        )
    lines.append(f"compute  {flops_text(step.flops)} per device (dots and convolutions)")
    if step.compiler_seconds:
        lines.append(
            f"time     {seconds_text(step.compiler_seconds)}: the compiler's own estimate (libtpu's kernels' estimated cycles at the chip's clock)"
        )
    lines.append("collectives per step" + ("" if step.collectives else ": none"))
    for row in step.collectives:
        over = f"over {'+'.join(row.axes)} ({row.group})" if row.axes else f"group {row.group}"
        lines.append(
            f"  {row.kind:<19}{row.count:>6} x  {size_text(row.bytes):>11} in all, "
            f"{size_text(row.wire_bytes):>11} sent per device, {over}"
        )
        if row.label != row.kind:  # written in another form: libtpu's
            lines.append(f"{'':<21}{row.label[len(row.kind) + 1 :]}")
    lines += _pipeline_lines(step)
    noun = "array" if len(step.inputs.rows) == 1 else "arrays"
    lines.append(
        f"inputs  {len(step.inputs.rows)} {noun}, {size_text(step.inputs.device_bytes)} on "
        "the most loaded device (st.plan counts these only)"
    )
    lines += [f"! {flag}" for flag in step.flags]
    lines += [f"! {problem}" for problem in dict.fromkeys(p.sentence for p in step.rule_problems)]
    return "\n".join(lines)


def _pipeline_lines(step: StepPlan) -> list[str]:
    """A pipelined step's loops (new in 0.8): their iterations, the bubble among them,
    and the axes its stages pass activations along."""
    loops = step.schedule.pipelines() if step.schedule is not None else ()
    if not loops or step.schedule is None:
        return []
    shapes = dict.fromkeys((loop.trips, loop.idle) for loop in loops)
    said = "; ".join(
        f"{trips} iterations, {idle} of them on padding (the bubble: {idle / trips:.0%})"
        for trips, idle in shapes
    )
    plural = "s" if len(loops) > 1 else ""
    axes = "+".join(step.schedule.stage_axes()) or "no axis"
    return [f"pipeline  {len(loops)} loop{plural} over {axes}: {said}"]


def _memory_lines(step: StepPlan) -> list[str]:
    """The table's memory per device: arguments, outputs, aliased, temporaries, peak."""
    memory = [
        ("arguments", step.argument_bytes, ""),
        ("outputs", step.output_bytes, ""),
        ("aliased", -step.alias_bytes, "outputs in donated buffers"),
        ("temporaries", step.temp_bytes, "activations and scratch"),
        ("peak", step.peak_bytes, "arguments + outputs - aliased + temporaries"),
    ]
    lines = []
    for label, amount, note in memory:
        text = size_text(abs(amount))
        text = f"-{text}" if amount < 0 else text
        lines.append(f"  {label:<12}{text:>11}" + (f"  {note}" if note else ""))
    return lines
