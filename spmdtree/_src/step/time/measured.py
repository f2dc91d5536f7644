"""A prediction held against a measurement (new in 0.7): `Measurement`, the step's
measured time beside its predicted one and, per instruction of the compiled
schedule, the model's time beside the profile's, joined by name.

`compare` builds it from a step's record and a `profile.Profile`; `st.measure`
runs the step and gives its own times; `StepPlan.compare` joins a profile taken
elsewhere. The records are frozen; `__str__` is a table, `trace` Perfetto JSON
with the predicted and the measured step side by side, `to_dict` the versioned
JSON values and `to_json` their text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from spmdtree._src.errors import Mistake
from spmdtree._src.rules import AnyMesh
from spmdtree._src.step.hlo import (
    Branches,
    Collective,
    Copy,
    Event,
    Kernel,
    Loop,
    Schedule,
    Start,
)
from spmdtree._src.step.hw import Hardware
from spmdtree._src.step.time.bound import StepTime, collective_seconds, step_spans
from spmdtree._src.step.time.predict import Span, fixed_seconds, kernel_seconds, predict
from spmdtree._src.step.time.profile import Profile
from spmdtree._src.step.time.timeline import STREAMS as TIMELINE_STREAMS
from spmdtree._src.step.time.timeline import trace_events
from spmdtree._src.text import JSON_VERSION, mesh_json, seconds_text

#: A measured step whose unjoined device time is above this share is flagged.
UNJOINED = 0.01


class Planned(Protocol):
    """What a `Measurement` reads of the step's record (a `StepPlan`)."""

    @property
    def schedule(self) -> Schedule | None: ...
    @property
    def collectives(self) -> tuple[Collective, ...]: ...
    @property
    def flops(self) -> int: ...
    @property
    def mesh(self) -> AnyMesh: ...
    @property
    def devices_per_node(self) -> int | None: ...
    @property
    def target(self) -> str: ...
    @property
    def flags(self) -> tuple[str, ...]: ...

    def time(self, hardware: Hardware, *, devices_per_node: int | None = None) -> StepTime: ...


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One instruction of a compiled step's schedule, predicted and measured (new in
    0.7).

    Attributes:
        name: its name in the compiled module (``fusion.12``), what the profile
            names it too.
        kind: its class: ``matmul``, ``attention``, ``memory`` or
            ``collectives``.
        calls: how often it runs per step (its loops' trip counts multiplied).
        predicted_seconds: the model's time for it per step, all its calls.
        measured_seconds: the profile's self time for it per step (a
            collective: its start's and its done's), 0.0 where the profile
            holds none.
        flops: its FLOPs per call (0 for a collective).
        bytes: the bytes it reads and writes per call (a collective: its result's).
        call: a library or hand-written kernel's name, where it runs one.
        opcode: its opcode as HLO prints it (``fusion``; a collective's kind).
        shape: its result with its layout (``f32[8,8,2048,2048]{2,3,1,0}``).
        op_name: where in the step it came from, as jax's trace named it.
        estimated_seconds: the compiler's own estimate of it per step, all its
            calls: libtpu's estimated cycles at the chip's clock; 0.0 where the
            compiler gives none; ``inf`` where libtpu marks it unestimable.

    Example:
        >>> import spmdtree as st
        >>> op = st.OpTime("fusion.3", "memory", 2, 1e-3, 3e-3, bytes=2**20)
        >>> op.miss_seconds  # measured less predicted: the model is fast here
        0.002
    """

    name: str
    kind: str
    calls: int
    predicted_seconds: float
    measured_seconds: float
    flops: int = 0
    bytes: int = 0
    call: str = ""
    estimated_seconds: float = 0.0
    opcode: str = ""
    shape: str = ""
    op_name: str = ""

    @property
    def miss_seconds(self) -> float:
        """Measured less predicted, per step: > 0 where the model is fast."""
        return self.measured_seconds - self.predicted_seconds


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A step's measured time beside its prediction, per step and per instruction
    (new in 0.7; `st.measure`, `StepPlan.compare`).

    Attributes:
        plan: the step's `StepPlan`, compiled once for the devices it ran on.
        hardware: the `Hardware` the prediction is timed on.
        times: each measured step's seconds, in the order run (wall clock, as
            `st.measure` runs them; the profile's own steps for
            `StepPlan.compare`).
        predicted_seconds: the prediction on `hardware` (`StepTime.predicted_seconds`).
        ops: one `OpTime` per instruction of the compiled schedule, in
            schedule order.
        joined_share: the share of the profile's device time (its instructions'
            self time within the step) joined by name to the schedule.
        profiled_seconds: the profile's own median step, on the device.
        device: the device the profile was read on (``/device:TPU:0``).
        flags: the step's (its `StepPlan`'s and its prediction's), then what
            the join could not cover.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> x = st.Partitioned(jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32), ("data", None))
        >>> cpu = st.Hardware("cpu", 2**34, 1e11, {"ici": (1e10, 0.0)})
        >>> m = st.measure(lambda x: jnp.sum(x.value**2), x, mesh=mesh, hardware=cpu, steps=3)
        >>> m.ratio == m.predicted_seconds / m.seconds, str(m).splitlines()[0][:22]
        (True, 'measured on cpu:0 (8 d')
        >>> m.to_dict()["schema"], sorted(m.trace()["otherData"])[:2]
        ('spmdtree.Measurement/1', ['hardware', 'joined_share'])
    """

    plan: Planned
    hardware: Hardware
    times: tuple[float, ...]
    predicted_seconds: float
    ops: tuple[OpTime, ...]
    joined_share: float
    profiled_seconds: float
    device: str
    flags: tuple[str, ...] = ()
    first: tuple[Span, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def seconds(self) -> float:
        """The median measured step."""
        return float(np.median(self.times))

    @property
    def min_seconds(self) -> float:
        """The fastest measured step."""
        return min(self.times)

    @property
    def ratio(self) -> float:
        """Predicted over measured (the median): below 1, the model is fast."""
        return self.predicted_seconds / self.seconds

    @property
    def op_error(self) -> float:
        """The sum over instructions of |predicted - measured|, over the measured step
        (the median): misses that cancel in `ratio` count twice here (new in 0.8).

        Example:
            >>> import spmdtree as st
            >>> ops = (st.OpTime("a", "memory", 1, 2e-3, 1e-3), st.OpTime("b", "matmul", 1, 1e-3, 2e-3))
            >>> m = st.Measurement(None, None, (3e-3,), 3e-3, ops, 1.0, 3e-3, "cpu:0")
            >>> m.ratio, round(m.op_error, 6)  # the step right, each instruction not
            (1.0, 0.666667)
        """
        missed = sum(abs(op.predicted_seconds - op.measured_seconds) for op in self.ops)
        return missed / self.seconds

    def misses(self, k: int = 10) -> tuple[OpTime, ...]:
        """The `k` instructions whose predicted and measured times differ most per
        step, largest first.

        Example:
            >>> import spmdtree as st
            >>> ops = (st.OpTime("a", "memory", 1, 1e-3, 1e-3), st.OpTime("b", "matmul", 2, 1e-3, 5e-3))
            >>> m = st.Measurement(None, None, (6e-3,), 2e-3, ops, 1.0, 6e-3, "cpu:0")
            >>> [op.name for op in m.misses(1)], m.ratio
            (['b'], 0.3333333333333333)
        """
        return tuple(sorted(self.ops, key=lambda op: -abs(op.miss_seconds))[:k])

    def to_dict(self) -> dict[str, Any]:
        """The measurement as JSON values, in the versioned schema
        ``"spmdtree.Measurement/1"``: the times, the prediction, the join and each
        instruction's figures."""
        return {
            "schema": f"spmdtree.Measurement/{JSON_VERSION}",
            "mesh": mesh_json(self.plan.mesh),
            "target": self.plan.target,
            "device": self.device,
            "hardware": self.hardware.name,
            "times": list(self.times),
            "seconds": self.seconds,
            "min_seconds": self.min_seconds,
            "predicted_seconds": self.predicted_seconds,
            "ratio": self.ratio,
            "op_error": self.op_error,
            "profiled_seconds": self.profiled_seconds,
            "joined_share": self.joined_share,
            "ops": [_op_json(op) for op in self.ops],
            "flags": list(self.flags),
        }

    def to_json(self) -> str:
        """`to_dict`'s JSON text."""
        return json.dumps(self.to_dict())

    def trace(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The predicted step and the first profiled one as a trace: Chrome
        trace-event JSON that Perfetto opens: the prediction's tracks, as
        `StepPlan.trace` lays them out (``compute``, ``collectives``, ``copies``:
        each that ran something), and ``measured`` (each instruction as the device
        ran it, from the step's start). Written to `path` too, where given."""
        title = f"predicted and measured step on {self.device}"
        other = {
            "spmdtree": "predicted beside measured (Measurement.trace)",
            "hardware": self.hardware.name,
            "predicted_seconds": self.predicted_seconds,
            "measured_seconds": self.seconds,
            "joined_share": self.joined_share,
        }
        trace = trace_events(self.first, title, other, streams=STREAMS)
        if path is not None:
            pathlib.Path(path).write_text(json.dumps(trace))
        return trace

    def __str__(self) -> str:
        return _table(self)


#: A measurement's trace tracks: the prediction's streams, then the device's.
STREAMS = {**TIMELINE_STREAMS, "measured": max(TIMELINE_STREAMS.values()) + 1}


def compare(
    plan: Planned,
    profile: Profile,
    hardware: Hardware,
    times: Sequence[float] | None = None,
) -> Measurement:
    """`plan`'s prediction on `hardware` held against `profile`: each instruction
    joined by name; the step's `times` (None: the profile's own steps)."""
    if plan.schedule is None:
        raise Mistake(
            ValueError,
            "this StepPlan carries no compiled schedule to join (one rebuilt from its "
            "fields alone); preflight the step again.",
        )
    per_node = plan.devices_per_node
    timed, spans = step_spans(
        plan.collectives, plan.flops, plan.mesh.shape, hardware, per_node, plan.schedule
    )

    def comm(row: Collective) -> float:
        return collective_seconds(row, plan.mesh.shape, hardware, per_node)

    predicted = list(instruction_seconds(plan.schedule, hardware, comm))
    ops = tuple(_joined(op, profile) for op in predicted)
    joined = sum(op.measured_seconds for op in ops)
    share = joined / profile.op_seconds if profile.op_seconds else 0.0
    measured = tuple(
        Span("measured", e.name, e.start, e.seconds, "measured", {}) for e in profile.first
    )
    return Measurement(
        plan=plan,
        hardware=hardware,
        times=tuple(times) if times else profile.steps,
        predicted_seconds=float(timed.predicted_seconds or 0.0),
        ops=ops,
        joined_share=share,
        profiled_seconds=float(np.median(profile.steps)),
        device=profile.device,
        flags=tuple(dict.fromkeys([*plan.flags, *timed.flags, *_unjoined(ops, profile, share)])),
        first=(*spans, *measured),
    )


def instruction_seconds(
    schedule: Schedule, hardware: Hardware, comm: Callable[[Collective], float]
) -> Iterator[OpTime]:
    """Each instruction of `schedule` with the model's time for it per step (its
    calls: its loops' trip counts multiplied; a conditional's branches each as if
    it ran; an async copy, the walk's wait for it at its done, what a profile times
    it by: the walk's slowest branch's), its measured time not yet read."""
    costs, peak = hardware.costs(), hardware.flops_per_second
    clock = getattr(hardware.chip, "clock_ghz", 0.0) * 1e9
    totals: dict[str, OpTime] = {}
    waits = dict(predict(schedule, costs, peak, comm).copy_waits) if schedule.copies() else {}

    def walk(events: Sequence[Event], times: int) -> None:
        for event in events:
            if isinstance(event, Kernel):
                seconds = kernel_seconds(event, costs, peak) + fixed_seconds(event, costs)
                add(event.name or event.call, event.kind, times, seconds, event)
            elif isinstance(event, Start):
                seconds = comm(event.row) + costs.collective_latency_seconds
                add(
                    event.name,
                    "collectives",
                    times,
                    seconds,
                    None,
                    event.row.bytes,
                    str(event.row.kind),
                )
            elif isinstance(event, Copy):  # its waits per step, once, over its calls
                name = event.kernel.name
                each = waits.pop(name, 0.0) / times if times else 0.0
                add(name, event.kernel.kind, times, each, event.kernel)
            elif isinstance(event, Loop):
                walk(event.body, times * event.trips)
            elif isinstance(event, Branches):  # each as if it ran
                for branch in event.branches:
                    walk(branch, times)

    def add(
        name: str,
        kind: str,
        times: int,
        seconds: float,
        k: Kernel | None,
        size: int = 0,
        collective: str = "",
    ) -> None:
        if name:
            op = _one_op(name, kind, k, size, collective, _estimated(k, clock))
            totals[name] = _more(totals.get(name), op, times, seconds)

    walk(schedule.events, 1)
    return iter(totals.values())


def _one_op(
    name: str, kind: str, k: Kernel | None, size: int, collective: str, estimated: float
) -> OpTime:
    """An instruction's `OpTime` of no call yet: what its kernel `k` (or, a
    collective's, its `size` and kind) says of it; `estimated`, the compiler's
    estimate of one call."""
    return OpTime(
        name,
        str(kind),
        0,
        0.0,
        0.0,
        flops=k.flops if k else 0,
        bytes=k.bytes if k else size,
        call=k.call if k else "",
        estimated_seconds=estimated,
        opcode=k.opcode if k else collective,
        shape=k.shape if k else "",
        op_name=k.op_name if k else "",
    )


def _more(was: OpTime | None, op: OpTime, times: int, seconds: float) -> OpTime:
    """`was` (None: `op`, the instruction's first sight) with `times` more calls of
    `seconds` each, the compiler's estimate of one call (`op`'s) that many times."""
    calls, spent, own = (
        (was.calls, was.predicted_seconds, was.estimated_seconds) if was else (0, 0.0, 0.0)
    )
    return dataclasses.replace(
        was or op,
        calls=calls + times,
        predicted_seconds=spent + times * seconds,
        estimated_seconds=own + times * op.estimated_seconds,
    )


def _ratio(ratio: float) -> str:
    """A ratio for a table's column: two decimals, the far-off ones bounded."""
    return f"{ratio:.2f}" if 0.01 <= ratio < 100 else "<0.01" if ratio < 0.01 else ">100"


def _op_json(op: OpTime) -> dict[str, Any]:
    """An `OpTime` as strict JSON values (an unestimable kernel's estimate as its word)."""
    data = dataclasses.asdict(op)
    if math.isinf(op.estimated_seconds):
        data["estimated_seconds"] = "unestimable"
    return data


def _estimated(kernel: Kernel | None, clock: float) -> float:
    """One call's time as the compiler estimates it: libtpu's cycles at the chip's
    clock; ``inf`` where it cannot estimate; 0.0 where it gives nothing."""
    if kernel is None or not kernel.estimated_cycles or not clock:
        return 0.0
    return math.inf if kernel.unestimable else kernel.estimated_cycles / clock


def _profiled(op: OpTime) -> tuple[str, ...]:
    """The names a profile gives `op`'s time under: its own, and an async
    collective's done beside its start."""
    if op.kind == "collectives" and "-start" in op.name:
        return op.name, op.name.replace("-start", "-done")
    return (op.name,)


def _joined(op: OpTime, profile: Profile) -> OpTime:
    """`op` with its measured time, under every name the profile gives it."""
    seconds = sum(profile.ops.get(name, 0.0) for name in _profiled(op))
    return dataclasses.replace(op, measured_seconds=seconds)


def _unjoined(ops: Sequence[OpTime], profile: Profile, share: float) -> Iterator[str]:
    """The sentence for the device time the join could not place, where it matters."""
    if 1 - share <= UNJOINED:
        return
    names = {name for op in ops for name in _profiled(op)}
    left = sorted(
        ((seconds, name) for name, seconds in profile.ops.items() if name not in names),
        reverse=True,
    )
    listed = ", ".join(f"{name} ({seconds_text(seconds)})" for seconds, name in left[:5])
    yield (
        f"{1 - share:.1%} of the measured device time joined no instruction of the schedule "
        f"by name ({listed or 'none named'}): the per-instruction figures leave it out; the "
        "step's times hold it"
    )


def _table(m: Measurement, most: int = 10) -> str:
    """A measurement's table: the step, then the largest misses per instruction, with
    the compiler's own estimate of each where it gives one."""
    devices = math.prod(m.plan.mesh.shape.values())
    own = any(op.estimated_seconds for op in m.ops)
    lines = [
        f"measured on {m.device} ({devices} device{'' if devices == 1 else 's'}): "
        f"{len(m.times)} steps, median {seconds_text(m.seconds)} (fastest "
        f"{seconds_text(m.min_seconds)}); profiled {seconds_text(m.profiled_seconds)}",
        f"predicted on {m.hardware.name}: {seconds_text(m.predicted_seconds)}, "
        f"{m.ratio:.2f} of measured; per instruction, |predicted - measured| sums to "
        f"{m.op_error:.0%} of the step",
        f"joined {m.joined_share:.1%} of the device time to {len(m.ops)} instructions",
        "the largest misses, per step:",
        f"  {'instruction':<28}{'class':<13}{'calls':>7}{'predicted':>12}{'measured':>12}"
        f"{'ratio':>7}" + (f"{'compiler':>12}" if own else ""),
    ]
    for op in m.misses(most):
        ratio = (
            "-" if not op.measured_seconds else _ratio(op.predicted_seconds / op.measured_seconds)
        )
        estimate = "cannot" if math.isinf(op.estimated_seconds) else op.estimated_seconds or None
        lines.append(
            f"  {op.name[:27]:<28}{op.kind:<13}{op.calls:>7}"
            f"{seconds_text(op.predicted_seconds):>12}{seconds_text(op.measured_seconds):>12}"
            f"{ratio:>7}"
            + (
                f"{estimate if isinstance(estimate, str) else seconds_text(estimate):>12}"
                if own
                else ""
            )
        )
        where = "  ".join(part for part in (op.opcode, op.shape, op.op_name) if part)
        if where:  # its HLO, and where in the step it came from
            lines.append(f"    {where[:110]}")
    if own:
        lines.append("  compiler: its own estimate (libtpu's cycles at the chip's clock)")
    lines += [f"! {flag}" for flag in m.flags]
    return "\n".join(lines)
