"""A predicted step time: the compiled module's schedule, each event timed by a model.

A roofline bound (`StepTime.bound_seconds`) assumes peak FLOPs and perfect
overlap, and most layouts tie at it. The compiled module says more: its
`Schedule` (`schedule.read_schedule`, the one walk of the module: each kernel
with its FLOPs, bytes and matmul shape, each collective's start and done
where the scheduler put them, loops and branches). `predict` walks it on three
clocks: the compute stream runs kernels in order;
the collective stream runs collectives one at a time (XLA GPU's default); the
DMA engines run async copies one at a time (libtpu's slices and copies between
HBM and the chip's own memory, each at its bytes over the bandwidth; new in
0.8); a done waits for its collective or copy, so only the part of one that the
compute between its start and done does not cover is exposed.

The per-kernel model (`hardware.Costs`; every figure's source is listed with it):

- a flash-attention kernel (cuDNN's fused attention; jax's Pallas kernels, their
  FLOPs from their shapes) at its FLOPs over the peak times the share published
  for that chip and direction (`Costs.flash_forward_efficiency`, ``_backward_``;
  new in 0.6);
- a matmul (dot, convolution, cuBLAS/cuDNN call) at its FLOPs over the peak
  times the chip's largest achievable share (published "maximum achievable
  matmul FLOPS" measurements) times its tile and wave quantization: an
  output of ``m x n`` (per batch) cut into 128 x 128 tiles runs in
  ``ceil(tiles / SMs)`` waves, and a small or skinny GEMM leaves most of
  the last wave idle (NVIDIA, "Matrix Multiplication Background User's
  Guide", tile and wave quantization); on a TPU the tile is the MXU's;
- every kernel's bytes (operands read + result written, a slice of an
  operand counted as the slice, an in-place update as the update, a buffer
  a fusion carries in place and a fused collective's bytes as nothing) over the
  HBM bandwidth times an efficiency; a kernel takes the larger of its
  compute and memory times plus 5% of the smaller (XLA GPU's own
  performance model overlaps them so: ``kMemoryComputeParallelism = 0.95``);
- a launch overhead per GPU kernel (XLA GPU's ``kKernelLaunchOverhead``,
  1 us) and a latency per collective (its ``kNcclKernelLaunchOverhead``,
  5 us) on top of the alpha-beta time the caller gives (`bound`'s
  `collective_seconds`: per link level, the slowest level's bytes over its
  bandwidth plus its per-hop latency).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from spmdtree._src.step.hlo import (
    Collective,
    Copy,
    Done,
    Event,
    Kernel,
    Loop,
    Schedule,
    Start,
)
from spmdtree._src.step.hw import Costs, grid_share
from spmdtree._src.step.kinds import KernelClass

#: A collective's mesh axes.
Axes = tuple[str, ...]
#: The classes a step's time is split into; `Prediction` has one field each.
CLASSES = tuple(KernelClass)


# --- the per-kernel model ---------------------------------------------------------------


#: How far memory and compute overlap within a kernel (XLA GPU's
#: kMemoryComputeParallelism): time = compute + memory - 0.95 min(compute, memory).
_PARALLELISM = 0.95


def wave_efficiency(batch: int, m: int, n: int, costs: Costs) -> float:
    """The share of the cores' tile slots a matmul's output fills: ``batch x m x n``
    over ``ceil(tiles / cores) x cores`` tiles of `costs.tile` (tile and wave
    quantization).

    Example:
        >>> h100 = Costs(3.35e12, 0.9, 794.5 / 989, 132, (128, 128), 1e-6, 5e-6)
        >>> wave_efficiency(1, 128 * 132, 128, h100)  # one full wave of 132 tiles
        1.0
        >>> wave_efficiency(1, 128 * 133, 128, h100) == 133 / 264  # a second, nearly empty
        True
        >>> wave_efficiency(1, 64, 64, h100) == 64 * 64 / (132 * 128 * 128)
        True
    """
    tm, tn = costs.tile
    tiles = batch * -(-m // tm) * -(-n // tn)
    waves = -(-tiles // costs.cores)
    return batch * m * n / (waves * costs.cores * tm * tn)


def kernel_seconds(kernel: Kernel, costs: Costs, peak: float) -> float:
    """One kernel's time, its launch left out: the larger of its compute (FLOPs over
    the peak x the matmul share x its wave efficiency; a flash-attention kernel's
    over the peak x its published share for its direction, new in 0.6) and its
    memory (bytes over the sustained bandwidth; an unfused update's over the
    bandwidth x `Costs.update_efficiency`, new in 0.7; one that only reads HBM,
    over the bandwidth x `Costs.read_efficiency`, new in 0.8; a grouped matmul's
    FLOPs over the peak x `Costs.grouped_efficiency`, and what its gathers and
    scatters move over the bandwidth x `Costs.indexed_efficiency`, new in 0.8; a
    matmul's share read by
    its shape from `Costs.matmul_grid` where the chip has one, new in 0.8, times
    `Costs.fused_update_efficiency` where an optimizer's update is fused into it, new
    in 0.8; what a kernel with no matmul reads and writes in a TPU's own memory over
    `Costs.on_chip_bytes_per_second` where the chip has that figure, the slower of
    that and its HBM traffic, rows it moves by index without going to HBM among
    them, new in 0.8: a matmul's share is measured with its operands where libtpu
    keeps them, and its matrix unit reads them there as it multiplies), plus 5% of
    the smaller.

    Example:
        >>> h100 = Costs(3.35e12, 0.9, 794.5 / 989, 132, (128, 128), 1e-6, 5e-6)
        >>> copy = Kernel("memory", 0, 2 * 2**30)
        >>> kernel_seconds(copy, h100, 989e12) == 2 * 2**30 / (3.35e12 * 0.9)
        True
        >>> update = copy._replace(unfused_update=True)
        >>> kernel_seconds(update, h100, 989e12) == 2 * 2**30 / (3.35e12 * h100.update_efficiency)
        True
    """
    share = costs.update_efficiency if kernel.unfused_update else costs.memory_efficiency
    if kernel.reads_only and not kernel.unfused_update and costs.read_efficiency > 0:
        share = costs.read_efficiency  # streams its reads, writes next to none
    bandwidth = costs.hbm_bytes_per_second
    on_chip = costs.on_chip_bytes_per_second
    indexed = 0 if kernel.rows_on_chip and on_chip else kernel.indexed  # moved there
    memory = max(kernel.bytes - kernel.indexed, 0) / (bandwidth * share)
    memory += indexed / (bandwidth * costs.indexed_efficiency)
    if on_chip:  # what it moves on the chip, beside its HBM traffic: a matmul, its rows
        there = kernel.indexed if kernel.rows_on_chip else 0
        memory = max(memory, (there if kernel.flops else kernel.on_chip) / on_chip)
    compute = 0.0
    if kernel.flops:
        share = costs.matmul_efficiency * costs.speed(kernel.dtype)
        if kernel.grouped:  # its groups' FLOPs, at the chip's measured share
            share = costs.speed(kernel.dtype) * costs.grouped_efficiency
        elif kernel.flash:  # its blocks at the kernel's published share, each way
            share = costs.speed(kernel.dtype) * (
                costs.flash_backward_efficiency
                if kernel.flash == "backward"
                else costs.flash_forward_efficiency
            )
        elif kernel.m and kernel.n and costs.matmul_grid:  # its shape's measured share
            rows = (kernel.batch or 1) * kernel.m
            share = costs.speed(kernel.dtype) * grid_share(
                costs.matmul_grid, rows, kernel.k or 1, kernel.n, costs.tile[1]
            )
        elif kernel.m and kernel.n:
            share *= wave_efficiency(kernel.batch or 1, kernel.m, kernel.n, costs)
        if kernel.fused_update:  # an optimizer's update in its kernel
            share *= costs.fused_update_efficiency
        compute = kernel.flops / (peak * share)
    return max(compute, memory) + (1 - _PARALLELISM) * min(compute, memory)


def fixed_seconds(kernel: Kernel, costs: Costs) -> float:
    """What a kernel costs beyond its work: its launch, and the wait for the memory's
    first access for each way it goes to HBM, reading and writing
    (`Kernel.hbm_waits`; new in 0.8).

    Example:
        >>> tpu = Costs(819e9, 0.8, 0.96, 1, (128, 128), 5e-8, 0.0, access_seconds=3e-7)
        >>> fixed_seconds(Kernel("memory", 0, 4096, hbm_waits=1), tpu) == 5e-8 + 3e-7
        True
        >>> fixed_seconds(Kernel("memory", 0, 4096, hbm_waits=2), tpu) == 5e-8 + 6e-7  # reads, writes
        True
        >>> fixed_seconds(Kernel("memory", 0, 0), tpu)  # its arrays on the chip
        5e-08
    """
    return costs.launch_seconds + costs.access_seconds * kernel.hbm_waits


# --- the walk ---------------------------------------------------------------------------


class Span(NamedTuple):
    """One stretch of a walked schedule on one stream (new in 0.6): a kernel, a
    collective, an async copy, the compute waiting for one of them, or a loop's
    iterations after the walked ones, summarised.

    Attributes:
        stream: ``"compute"``, ``"collectives"`` or ``"copies"`` (the DMA engines'
            async copies; new in 0.8).
        name: the instruction's name in the compiled module (``fusion.12``,
            ``all-gather-start.3``); ``waits for ...`` for the compute waiting;
            ``... iterations 4-32`` for a loop's summarised iterations.
        start: seconds from the step's start.
        seconds: how long.
        kind: a `KernelClass` (``matmul``, ``attention``, ``memory``,
            ``collectives``, or ``loop`` for summarised iterations).
        args: what the compiled module says of it: FLOPs, bytes, a collective's
            kind, axes and group, a summary's iterations.
    """

    stream: str
    name: str
    start: float
    seconds: float
    kind: str
    args: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A step's predicted time on one device, split by class.

    Attributes:
        matmul_seconds: matmul and convolution kernels.
        attention_seconds: fused attention kernels (cuDNN's), and the kernels
            of a name scope naming attention (``jax.named_scope("attention")``:
            a blocked attention's matmuls and softmax).
        memory_seconds: every other kernel (memory-bound fusions, copies,
            reductions), and the compute stream waiting for an async copy (`Copy`:
            where the compute between its start and done does not cover it; new in
            0.8).
        exposed_comm_seconds: the compute stream waiting for collectives
            (synchronous ones whole; an async one where the compute between
            its start and done does not cover it).
        launch_seconds: the kernels' fixed costs: launches, and the waits for the
            memory's first access (`fixed_seconds`; new in 0.8).
        comm_seconds: every collective's time, hidden or not.
        kernels: how many kernels run per step.
        exposed_by_axes: `exposed_comm_seconds` by the mesh axes of the
            collectives waited for (new in 0.6).
        spans: what ran when on each stream, where the walk recorded them (`Span`;
            the first `_Walk.WALKED` iterations of a loop whole, the rest one
            span per stream); () otherwise (new in 0.6).
        bubble_seconds: of the step, the time a pipeline's loops spend in the
            iterations each device runs on padding (`Loop.idle` of its trips,
            at the loop's own time: what the compiled program runs); 0 without
            a pipeline (new in 0.8).
        copy_waits: the compute stream's wait for each async copy, by its done's
            name (`Copy`), per step; those it never waits for left out (new in 0.8).
    """

    matmul_seconds: float
    attention_seconds: float
    memory_seconds: float
    exposed_comm_seconds: float
    launch_seconds: float
    comm_seconds: float
    kernels: int
    exposed_by_axes: Mapping[Axes, float] = dataclasses.field(default_factory=dict)
    spans: tuple[Span, ...] = dataclasses.field(default=(), repr=False, compare=False)
    bubble_seconds: float = 0.0
    copy_waits: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """The step: the sum of its classes."""
        return sum(self.by_class.values())

    @property
    def by_class(self) -> dict[str, float]:
        """The seconds per class (`CLASSES`)."""
        return {
            KernelClass.MATMUL: self.matmul_seconds,
            KernelClass.ATTENTION: self.attention_seconds,
            KernelClass.MEMORY: self.memory_seconds,
            KernelClass.COLLECTIVES: self.exposed_comm_seconds,
            KernelClass.LAUNCH: self.launch_seconds,
        }


@dataclasses.dataclass
class _Clock:
    """Where the three streams stand, and what each class took so far."""

    compute: float = 0.0  # the compute stream's time
    links: float = 0.0  # when the collective stream is next free
    copies: float = 0.0  # when the DMA engines are next free
    spent: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    comm: float = 0.0
    kernels: int = 0
    # what the compute may wait for: when it ends, its name, a collective's axes
    # (None: a copy's)
    pending: dict[int, tuple[float, str, Axes | None]] = dataclasses.field(default_factory=dict)
    waited: dict[Axes, float] = dataclasses.field(default_factory=dict)  # exposed, per axes
    copied: dict[str, float] = dataclasses.field(default_factory=dict)  # waits, per copy
    spans: list[Span] | None = None  # where the walk records what ran when
    bubble: float = 0.0  # a pipeline's idle iterations, of the compute stream's time

    def copy(self, spans: bool = True) -> _Clock:
        """A clock that goes on from here (with the spans so far, where recorded)."""
        kept = list(self.spans) if spans and self.spans is not None else None
        return dataclasses.replace(
            self,
            spent=dict(self.spent),
            pending=dict(self.pending),
            waited=dict(self.waited),
            copied=dict(self.copied),
            spans=kept,
        )

    def record(
        self, stream: str, name: str, start: float, seconds: float, kind: str, **args: Any
    ) -> None:
        if self.spans is not None:
            self.spans.append(Span(stream, name, start, seconds, kind, args))

    def wait(self, until: float, name: str, axes: Axes | None) -> None:
        """The compute stream waits for collective `name` over `axes` (None: for
        async copy `name`), finishing at `until`."""
        if until <= self.compute:
            return
        waited, kind = until - self.compute, KernelClass.COLLECTIVES
        if axes is None:
            self.copied[name] = self.copied.get(name, 0.0) + waited
            kind = KernelClass.MEMORY
        else:
            self.waited[axes] = self.waited.get(axes, 0.0) + waited
        self.record("compute", f"waits for {name}", self.compute, waited, kind)
        self.spent[kind] += waited
        self.compute = until

    def advance(self, before: _Clock, times: int, name: str) -> None:
        """Repeats `times` more the change since `before` (a loop's steady iteration),
        each stream's repeats one span, `name`."""
        for stream, was, now in (
            ("compute", before.compute, self.compute),
            ("collectives", before.links, self.links),
            ("copies", before.copies, self.copies),
        ):
            if now > was:
                self.record(
                    stream,
                    name,
                    now,
                    times * (now - was),
                    "loop",
                    iterations=times,
                    summarised="each iteration timed as the last one walked before it",
                )
        self.compute += times * (self.compute - before.compute)
        self.links += times * (self.links - before.links)
        self.copies += times * (self.copies - before.copies)
        for kind in CLASSES:
            self.spent[kind] += times * (self.spent[kind] - before.spent[kind])
        self.comm += times * (self.comm - before.comm)
        self.bubble += times * (self.bubble - before.bubble)
        for axes, seconds in list(self.waited.items()):
            self.waited[axes] += times * (seconds - before.waited.get(axes, 0.0))
        for name, seconds in list(self.copied.items()):
            self.copied[name] += times * (seconds - before.copied.get(name, 0.0))
        self.kernels += times * (self.kernels - before.kernels)


class _Walk:
    """Walks a schedule's events on a `_Clock`."""

    #: Iterations of a loop walked one by one; the rest repeat the last one's change.
    WALKED = 3

    def __init__(self, costs: Costs, peak: float, comm: Callable[[Collective], float]) -> None:
        self.costs, self.peak, self.comm = costs, peak, comm

    def run(self, events: Sequence[Event], clock: _Clock) -> _Clock:
        for event in events:
            clock = self.step(event, clock)
        return clock

    def step(self, event: Event, clock: _Clock) -> _Clock:
        if isinstance(event, Kernel):
            seconds = kernel_seconds(event, self.costs, self.peak)
            fixed = fixed_seconds(event, self.costs)
            if clock.spans is not None:  # recorded: its args built only then (a hot path)
                clock.record(
                    "compute",
                    event.name or event.call or event.kind,
                    clock.compute,
                    seconds + fixed,
                    event.kind,
                    flops=event.flops,
                    bytes=event.bytes,
                    **({"call": event.call} if event.call else {}),
                )
            clock.spent[event.kind] += seconds
            clock.spent[KernelClass.LAUNCH] += fixed
            clock.compute += seconds + fixed
            clock.kernels += 1
        elif isinstance(event, Start):
            seconds = self.comm(event.row) + self.costs.collective_latency_seconds
            start = max(clock.compute, clock.links)
            name = event.name or event.row.kind
            if clock.spans is not None:
                clock.record(
                    "collectives",
                    name,
                    start,
                    seconds,
                    KernelClass.COLLECTIVES,
                    collective=event.row.label,
                    bytes=event.row.bytes,
                    axes=list(event.row.axes),
                    group=event.row.group,
                    sync=event.sync,
                )
            clock.links = start + seconds
            clock.comm += seconds
            if event.sync:
                clock.wait(clock.links, name, event.row.axes)
            else:
                clock.pending[event.ident] = (clock.links, name, event.row.axes)
        elif isinstance(event, Copy):
            self.copy(event, clock)
        elif isinstance(event, Done):
            if event.ident in clock.pending:
                clock.wait(*clock.pending.pop(event.ident))
        elif isinstance(event, Loop):
            clock = self.loop(event, clock)
        else:
            ends = [self.run(branch, clock.copy()) for branch in event.branches]
            clock = max(ends, key=lambda c: c.compute, default=clock)
        return clock

    def copy(self, copy: Copy, clock: _Clock) -> None:
        """An async copy: on the DMA engines, one at a time, from where the compute
        starts it; its done waits for it (new in 0.8)."""
        seconds = kernel_seconds(copy.kernel, self.costs, self.peak)
        start = max(clock.compute, clock.copies)
        clock.copies = start + seconds
        clock.pending[copy.ident] = (clock.copies, copy.kernel.name, None)
        clock.record(
            "copies", copy.kernel.name, start, seconds, KernelClass.MEMORY, bytes=copy.kernel.bytes
        )

    def loop(self, loop: Loop, clock: _Clock) -> _Clock:
        """A loop: its first `WALKED` iterations walked, the rest repeating the last
        one's change; a pipeline's bubble, its idle iterations' share of its time."""
        began, before = clock.compute, clock
        for _ in range(min(loop.trips, self.WALKED)):
            before = clock.copy(spans=False)
            clock = self.run(loop.body, clock)
        if loop.trips > self.WALKED:
            name = f"{loop.name or 'loop'}: iterations {self.WALKED + 1}-{loop.trips}"
            clock.advance(before, loop.trips - self.WALKED, name)
        if loop.idle:
            clock.bubble += (clock.compute - began) * loop.idle / loop.trips
        return clock


def predict(
    schedule: Schedule,
    costs: Costs,
    peak_flops: float,
    collective_seconds: Callable[[Collective], float],
    spans: bool = False,
) -> Prediction:
    """The predicted time of one step of `schedule` on a chip of these `costs` and
    peak, each collective row timed by `collective_seconds` (the links' alpha-beta
    time; `Costs.collective_latency_seconds` is added to it); with `spans`, what
    ran when on each stream too (`Prediction.spans`, new in 0.6).

    Example:
        A kernel of 1 ms, an async collective of 2 ms started before it and done
        after it, then one of 2 ms with nothing between its start and done: the
        first is hidden but for 1 ms, the second exposed whole.

        >>> costs = Costs(1e12, 1.0, 1.0, 1, (1, 1), 0.0, 0.0)
        >>> row = Collective("all-reduce", 1, 2**20, ("data",), 8)
        >>> events = (Start(0, row, False), Kernel("memory", 0, 10**9), Done(0),
        ...           Start(1, row, False), Done(1))
        >>> p = predict(Schedule(events, "cuda"), costs, 1e15, lambda row: 2e-3)
        >>> round(p.seconds * 1e3, 6), round(p.exposed_comm_seconds * 1e3, 6), p.comm_seconds
        (4.0, 3.0, 0.004)
    """
    start = _Clock(spans=[] if spans else None)
    end = _Walk(costs, peak_flops, collective_seconds).run(schedule.events, start)
    return Prediction(
        matmul_seconds=end.spent[KernelClass.MATMUL],
        attention_seconds=end.spent[KernelClass.ATTENTION],
        memory_seconds=end.spent[KernelClass.MEMORY],
        exposed_comm_seconds=end.spent[KernelClass.COLLECTIVES],
        launch_seconds=end.spent[KernelClass.LAUNCH],
        comm_seconds=end.comm,
        kernels=end.kernels,
        exposed_by_axes={axes: s for axes, s in end.waited.items() if s > 0},
        spans=tuple(end.spans or ()),
        bubble_seconds=end.bubble,
        copy_waits={name: s for name, s in end.copied.items() if s > 0},
    )
