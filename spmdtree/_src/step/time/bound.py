"""Time: a roofline over what a compiled step computes and moves, and the predicted
step time beside it.

A step cannot run faster than its FLOPs at the chip's peak, nor than its
collectives at the links' bandwidth. `step_time` turns a step's FLOPs and
`Collective` rows into a `StepTime` on a `Hardware`: a lower bound on the step
(perfect overlap, peak FLOPs), not a prediction; with the compiled schedule, the
prediction too (`predict.predict`, each collective timed by `collective_seconds`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.step.hlo import Kernel, Schedule
from spmdtree._src.step.hw import (
    LINKS,
    Frozen,
    Hardware,
    TpuChip,
    check_devices_per_node,
    positive,
    slice_dims,
    torus_links,
    wrapped,
)
from spmdtree._src.step.kinds import CollectiveKind, LinkKind, bits
from spmdtree._src.step.time.predict import Span, predict


class Row(Protocol):
    """What timing reads of a collective row (`Collective` has these)."""

    @property
    def kind(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def axes(self) -> tuple[str, ...]: ...
    @property
    def group(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A roofline bound on one step, its compute and its collectives, in seconds;
    and, where the compiled schedule was walked, a predicted time (new in 0.5).

    `bound_seconds` is not a prediction: it assumes peak FLOPs and collectives
    that overlap compute perfectly, each at its links' full bandwidth.
    `predicted_seconds` walks the compiled module's schedule, each kernel timed
    by a model and an async collective overlapping only the compute scheduled
    between its start and its done (docs/planning.md, "Predicted step time").

    Attributes:
        compute_seconds: the step's FLOPs per device at the peak.
        comm_by_axes: collective seconds per mesh-axes tuple.
        flops_per_second: the peak the FLOPs were timed at (the hardware's;
            `StepPlan.time` sets it), which `mfu` needs for model FLOPs; None
            if unknown (new in 0.4).
        predicted_seconds: the predicted step time; None where no schedule was
            walked (new in 0.5).
        exposed_comm_seconds: the part of it spent waiting for collectives;
            None likewise (new in 0.5).
        predicted_by_class: the predicted time split by class: ``matmul``,
            ``attention``, ``memory`` (memory-bound kernels), ``collectives``
            (exposed) and ``launch`` (kernels' fixed costs: launches, waits for HBM), summing to
            `predicted_seconds`; a read-only dict, or None likewise (new in 0.5).
        flags: what the prediction rests on beyond the compiled schedule: the
            model's defaults it took for figures the hardware leaves out, loops
            of unknown trip count timed once (new in 0.6).
        exposed_by_axes: `exposed_comm_seconds` split by the mesh axes of the
            collectives the compute waited for (each collective with its
            latency); a read-only dict, or None where no schedule was walked
            (new in 0.6).
        bubble_seconds: of `predicted_seconds`, what a pipeline's iterations on
            padding take (`st.pipeline`: ``stages - 1`` of each of its loops'
            iterations, at the loop's predicted time); 0 without a pipeline,
            None where no schedule was walked (new in 0.8).

    Raises:
        ValueError: for a `flops_per_second` <= 0, or a prediction < 0.
        TypeError: for a `comm_by_axes`, `predicted_by_class` or
            `exposed_by_axes` that is not a mapping.

    Example:
        >>> import spmdtree as st
        >>> t = st.StepTime(compute_seconds=0.5, comm_by_axes={("fsdp",): 0.25, ("tensor",): 0.5})
        >>> t.comm_seconds, t.bound_seconds, t.serial_seconds, t.predicted_seconds
        (0.75, 0.75, 1.25, None)
        >>> t.mfu(1.0)  # a real step of 1 s used half the peak
        0.5
    """

    compute_seconds: float
    comm_by_axes: Mapping[tuple[str, ...], float] = dataclasses.field(hash=False)
    flops_per_second: float | None = None
    predicted_seconds: float | None = None
    exposed_comm_seconds: float | None = None
    predicted_by_class: Mapping[str, float] | None = dataclasses.field(default=None, hash=False)
    flags: tuple[str, ...] = ()
    exposed_by_axes: Mapping[tuple[str, ...], float] | None = dataclasses.field(
        default=None, hash=False
    )
    bubble_seconds: float | None = None

    @functools.partial(public, name="StepTime")
    def __post_init__(self) -> None:
        self._freeze(
            "comm_by_axes", "mesh-axes tuples to seconds, e.g. {('fsdp',): 0.25}", optional=False
        )
        if self.flops_per_second is not None:
            positive(self.flops_per_second, "flops_per_second")
        for what in ("predicted_seconds", "exposed_comm_seconds", "bubble_seconds"):
            value = getattr(self, what)
            if value is not None and value != 0:
                positive(value, what)
        self._freeze(
            "predicted_by_class", "class names to seconds, e.g. {'matmul': 0.5, 'memory': 0.1}"
        )
        self._freeze("exposed_by_axes", "mesh-axes tuples to seconds, e.g. {('fsdp',): 0.01}")

    def _freeze(self, what: str, mapping: str, optional: bool = True) -> None:
        """Field `what`, a mapping of `mapping` (or None where `optional`), kept
        read-only; another value is the TypeError that says so."""
        value = getattr(self, what)
        if value is None and optional:
            return
        if not isinstance(value, Mapping):
            raise Mistake(TypeError, f"{what} is {value!r}; expected a mapping of {mapping}.")
        object.__setattr__(self, what, Frozen(value))

    @property
    def comm_seconds(self) -> float:
        """The collectives' seconds, summed."""
        return sum(self.comm_by_axes.values())

    @property
    def bound_seconds(self) -> float:
        """max(compute, collectives): perfect overlap, a lower bound on the step."""
        return max(self.compute_seconds, self.comm_seconds)

    @property
    def serial_seconds(self) -> float:
        """compute + collectives: no overlap at all."""
        return self.compute_seconds + self.comm_seconds

    @property
    def bubble_share(self) -> float | None:
        """The share of the predicted step a pipeline's bubble takes (0 without a
        pipeline), or None where there is no prediction (new in 0.8).

        Example:
            >>> import spmdtree as st
            >>> st.StepTime(0.5, {}, predicted_seconds=2.0, bubble_seconds=0.5).bubble_share
            0.25
        """
        if self.predicted_seconds is None or self.bubble_seconds is None:
            return None
        return self.bubble_seconds / self.predicted_seconds if self.predicted_seconds else 0.0

    @public
    def mfu(self, step_seconds: float, model_flops: float | None = None) -> float:
        """The share of the peak a real step of `step_seconds` used.

        Without `model_flops`, hardware FLOPs: compute_seconds / step_seconds,
        every FLOP the compiled step runs (a rematerialised forward pass
        counts). With `model_flops`, the model's FLOPs per device per step
        (e.g. 6 x params x tokens / devices for a dense decoder's training
        step), as published MFU counts them: model_flops / flops_per_second /
        step_seconds (`model_flops` new in 0.4).

        Args:
            step_seconds: how long a real step took.
            model_flops: the model's FLOPs per device per step, or None.

        Returns:
            The share of the peak, 0 to 1 for a real step.

        Raises:
            ValueError: for a time or a `model_flops` <= 0, or `model_flops`
                given to a StepTime without `flops_per_second`.

        Example:
            >>> import spmdtree as st
            >>> t = st.StepTime(compute_seconds=0.4, comm_by_axes={}, flops_per_second=1e15)
            >>> t.mfu(1.0)  # the compiled step's 4e14 FLOPs, recompute included
            0.4
            >>> t.mfu(1.0, model_flops=3e14)  # the model's own FLOPs
            0.3
        """
        positive(step_seconds, "step_seconds")
        if model_flops is None:
            return self.compute_seconds / step_seconds
        positive(model_flops, "model_flops")
        if self.flops_per_second is None:
            raise Mistake(
                ValueError,
                f"model_flops is {model_flops!r}, but this StepTime has no flops_per_second "
                "to turn FLOPs into seconds. Take the StepTime from StepPlan.time(hardware), "
                "which sets it, or build it with flops_per_second=.",
            )
        return model_flops / self.flops_per_second / step_seconds


def time_json(timed: StepTime) -> dict[str, Any]:
    """A `StepTime` as JSON values, for `StepPlan.to_dict` and `Advice.to_dict`
    (new in 0.6): mesh-axes tuples joined by ``+`` (``""`` for none)."""

    def axes(by: Mapping[tuple[str, ...], float] | None) -> dict[str, float] | None:
        return None if by is None else {"+".join(k): v for k, v in by.items()}

    return {
        "compute_seconds": timed.compute_seconds,
        "comm_seconds": timed.comm_seconds,
        "bound_seconds": timed.bound_seconds,
        "comm_by_axes": axes(timed.comm_by_axes),
        "predicted_seconds": timed.predicted_seconds,
        "exposed_comm_seconds": timed.exposed_comm_seconds,
        "predicted_by_class": None
        if timed.predicted_by_class is None
        else dict(timed.predicted_by_class),
        "exposed_by_axes": axes(timed.exposed_by_axes),
        "bubble_seconds": timed.bubble_seconds,
        "flops_per_second": timed.flops_per_second,
        "flags": list(timed.flags),
    }


def ranked_seconds(timed: StepTime) -> float:
    """What advice ranks a row by: the predicted step time where there is one (the
    compiled schedule walked, on any hardware since 0.6), else the bound."""
    return timed.bound_seconds if timed.predicted_seconds is None else timed.predicted_seconds


def nodes_spanned(shape: Sequence[int], varying: Sequence[int], devices_per_node: int) -> int:
    """The most distinct nodes one device group touches: groups vary over the mesh
    positions `varying` (the others fixed); devices sit on nodes by their
    row-major position // `devices_per_node`."""
    if not varying:
        return 1
    positions = np.arange(math.prod(shape)).reshape(tuple(shape))
    rest = [i for i in range(len(shape)) if i not in varying]
    groups = positions.transpose(rest + list(varying)).reshape(
        -1, math.prod(shape[i] for i in varying)
    )
    nodes = np.sort(groups // devices_per_node, axis=1)
    return int(1 + (np.diff(nodes, axis=1) != 0).sum(axis=1).max())


def _bytes_per_kind(row: Row, g: Mapping[str, float]) -> dict[str, float]:
    """The bytes each device sends across each link kind by the hierarchical
    algorithm: `g` holds the group's size on each kind, fastest first."""
    kind = CollectiveKind(row.kind)
    if kind is CollectiveKind.COLLECTIVE_PERMUTE:  # its size, on the slowest link it crosses
        slowest = [k for k in LINKS if g[k] > 1][-1:] or [LinkKind.ICI]
        return {slowest[0]: float(row.bytes)}
    if kind.exchanges:  # that data must cross every kind, not divided
        return {k: (g[k] - 1) / g[k] * row.bytes for k in LINKS}
    factor, volume = float(kind.passes), kind.moved(row.bytes, row.group)
    out: dict[str, float] = {}
    faster = 1.0
    for k in LINKS:
        out[k] = factor * (g[k] - 1) / g[k] * volume / faster
        faster *= g[k]
    return out


def collective_seconds(
    row: Row, shape: Mapping[str, int], hardware: Hardware, devices_per_node: int | None
) -> float:
    """One row's seconds on `hardware`: the slowest of the link kinds it crosses, each
    its bytes / bandwidth + latency x (group on that kind - 1) per op.

    The slowest, not the sum: NCCL splits a collective into chunks and
    pipelines them, so the NVLink stage of one chunk runs while another
    crosses the network, and the slower stage sets the pace (a multi-slice
    TPU collective is timed the same way). The JAX scaling book ("How to
    Think About GPUs", cross-node collectives) times a 2-node all-gather of B
    bytes so: max(B (8-1)/8 / 450e9 within the node, B (2-1)/2 / 400e9 of
    node egress across), 130 us for 64 MiB on H100s (a sum would say 214 us).

    On a TPU preset the ICI figure is one torus axis's (both directions, round
    its wraparound): a group that spans several axes of its slice's torus (a
    v5e-256's 256 chips span both of its 16 x 16) sends over each, so its
    bandwidth is that many times the figure (the scaling book's V / (W_ici x
    axes)), and an axis without wraparound links (a v5e axis shorter than 16, a
    v5p slice that is not whole 4x4x4 cubes) is a line that adds half the
    figure (`chips.torus_links`; new in 0.5).
    """
    if row.group <= 1:
        return 0.0
    names = list(shape)
    varying = [names.index(a) for a in row.axes if a in names]
    per_node = devices_per_node or math.prod(shape.values())
    span = nodes_spanned(list(shape.values()), varying, per_node)
    g_dcn = float(min(span, row.group))
    g = {"ici": row.group / g_dcn, "dcn": g_dcn}
    seconds = 0.0
    for kind, sent in _bytes_per_kind(row, g).items():
        if g[kind] <= 1:
            continue
        if kind not in hardware.links:
            raise Mistake(
                ValueError,
                f"a {row.kind} over {row.axes} crosses {int(g[kind])} "
                f"{'nodes' if kind == 'dcn' else 'devices of a node'}, but hardware "
                f"{hardware.name!r} has no {kind!r} link. Add one to its links.",
            )
        bandwidth, latency = hardware.links[kind]
        if kind == "ici":
            bandwidth *= _torus_links(hardware, g["ici"], per_node)
        seconds = max(seconds, sent / bandwidth + row.count * latency * (g[kind] - 1))
    return seconds


def _torus_links(hardware: Hardware, group: float, slice_chips: int) -> float:
    """How many times its ICI figure an ICI group of `group` chips sends at on a slice
    of `slice_chips` of a TPU's torus (`chips.torus_links`); 1 on anything else (a GPU
    node, a hardware with no `TpuChip`)."""
    chip = hardware.chip
    if not isinstance(chip, TpuChip) or not chip.dimensions:
        return 1.0
    dims = slice_dims(slice_chips, chip.dimensions)
    return torus_links(round(group), dims, wrapped(dims, chip.wraparound, chip.cubes))


def step_time(
    collectives: Iterable[Row],
    flops: float,
    shape: Mapping[str, int],
    hardware: Hardware,
    devices_per_node: int | None = None,
    schedule: Schedule | None = None,
) -> StepTime:
    """The `StepTime` of a step with these FLOPs per device and collectives on a
    mesh of this shape (axis name -> size), on `hardware`; with the compiled module's
    `schedule` (`schedule.read_schedule`), its predicted time too, timed by the
    hardware's own figures (new in 0.5; 0.6: any `Hardware`, its defaults said)."""
    return step_spans(collectives, flops, shape, hardware, devices_per_node, schedule, False)[0]


def step_spans(
    collectives: Iterable[Row],
    flops: float,
    shape: Mapping[str, int],
    hardware: Hardware,
    devices_per_node: int | None,
    schedule: Schedule | None,
    spans: bool = True,
) -> tuple[StepTime, tuple[Span, ...]]:
    """`step_time`, and with `spans` what ran when on each stream of the walk
    (`predict.Span`; none without a schedule; new in 0.6)."""
    if not isinstance(hardware, Hardware):
        raise Mistake(
            TypeError, f"hardware is {hardware!r}; expected a st.Hardware (st.hardware('h100'))."
        )
    if devices_per_node is not None:
        check_devices_per_node(devices_per_node, "devices_per_node")
    per_node = hardware.devices_per_node if devices_per_node is None else devices_per_node
    by_axes: dict[tuple[str, ...], float] = {}
    for row in collectives:
        seconds = collective_seconds(row, shape, hardware, per_node)
        by_axes[tuple(row.axes)] = by_axes.get(tuple(row.axes), 0.0) + seconds
    bound = StepTime(flops / hardware.flops_per_second, by_axes, hardware.flops_per_second)
    if schedule is None:
        return bound, ()
    timed = functools.cache(lambda row: collective_seconds(row, shape, hardware, per_node))
    said = predict(schedule, hardware.costs(), hardware.flops_per_second, timed, spans)
    predicted = dataclasses.replace(
        bound,
        predicted_seconds=said.seconds,
        exposed_comm_seconds=said.exposed_comm_seconds,
        predicted_by_class=said.by_class,
        exposed_by_axes=said.exposed_by_axes,
        bubble_seconds=said.bubble_seconds,
        flags=(*_defaults_said(hardware, schedule), *schedule.flags),
    )
    return predicted, said.spans


#: The model's fields only some kernels' times read, each with what tells such a kernel.
_KERNEL_FIELDS: Mapping[str, Callable[[Kernel], bool]] = {
    "flash_forward_efficiency": lambda kernel: bool(kernel.flash),
    "flash_backward_efficiency": lambda kernel: bool(kernel.flash),
    "update_efficiency": lambda kernel: kernel.unfused_update,
    "grouped_efficiency": lambda kernel: kernel.grouped,
    "indexed_efficiency": lambda kernel: bool(kernel.indexed),
    "eight_bit_speed": lambda kernel: bool(kernel.flops) and _eight_bit(kernel.dtype),
    "access_seconds": lambda kernel: bool(kernel.hbm_waits),
    "fused_update_efficiency": lambda kernel: kernel.fused_update,
    "on_chip_bytes_per_second": lambda kernel: (
        bool(kernel.on_chip) and (not kernel.flops or kernel.rows_on_chip)
    ),
    "read_efficiency": lambda kernel: kernel.reads_only,
}


def _eight_bit(dtype: str) -> bool:
    """Whether a matmul's operands are 8-bit (int8, fp8; new in 0.8)."""
    return bool(dtype) and bits(dtype.partition("/")[0]) <= 8


def _defaults_said(hardware: Hardware, schedule: Schedule) -> Iterator[str]:
    """The sentence for a prediction built on the model's defaults: those it used
    (a flash kernel's shares only where the step runs one, an unfused update's
    share likewise)."""
    kernels = list(schedule.kernels())
    used = [
        what
        for what in hardware.left_out
        if what not in _KERNEL_FIELDS or any(map(_KERNEL_FIELDS[what], kernels))
    ]
    if used:
        yield (
            f"hardware {hardware.name!r} leaves out {', '.join(used)}: the prediction "
            "takes their defaults (st.Hardware's docstring lists them); give the chip's "
            "own figures for a prediction of it"
        )
