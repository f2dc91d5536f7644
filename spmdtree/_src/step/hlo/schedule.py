"""The one walk of a compiled module: its schedule, every figure the reading and the
prediction take (new in 0.6; 0.5 walked the module twice, and the walks disagreed).

XLA GPU and libtpu print a compiled module in the order the device runs it
(``is_scheduled=true``), an async collective's start and done where the
scheduler put them. `read_schedule` walks it once, from the entry down, each
computation once, into a `Schedule`, hardware-free and small (it crosses a
process boundary as JSON): one `Kernel` per device kernel, with its FLOPs,
bytes and matmul shape; a `Copy` and a `Done` per async copy (new in 0.8); a
`Start` and a `Done` per collective, its `Collective`
row read as an accelerator runs it (`forms`: the CPU's sliced reductions and
widened values, libtpu's all-reduce-scatter fusion and zero-filled gathers, a
multi-slice job's megascale transfers, a collective fused into a kernel); a
`Loop` per ``while`` with its trip count; a `Branches` per conditional. The
reading (`reading.reading_of`: collectives, FLOPs, flags) is a fold of it, and the
prediction (`predict.predict`) a walk of it on its streams' clocks, so the two cannot
disagree on what a step runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from spmdtree._src.pipeline import Scope
from spmdtree._src.step.hlo.forms import (
    Flow,
    Part,
    Written,
    async_link,
    fused_scatter,
    held,
    parts,
)
from spmdtree._src.step.hlo.groups import collective_axes, group_axes
from spmdtree._src.step.hlo.instructions import (
    HBM,
    HOST,
    ON_CHIP,
    Array,
    Instr,
    Module,
    Op,
    config_field,
)
from spmdtree._src.step.hlo.loops import trip_count
from spmdtree._src.step.hlo.opcodes import (
    DONES,
    GROUPED,
    STARTS,
    SYNC,
    UNESTIMABLE,
    Kept,
    dot_groups,
    estimated_cycles,
    flash_of,
    is_kernel_call,
    kernel_estimate,
    kernel_name,
    reduced,
)
from spmdtree._src.step.hlo.opcodes import (
    flops as op_flops,
)
from spmdtree._src.step.kinds import Backend, CollectiveKind, KernelClass
from spmdtree._src.text import Flag, size_text

#: The collectives counted, in the order rows are listed.
KINDS = tuple(CollectiveKind)

#: What a row's label says of each form.
_WRITTEN: dict[str, str] = {
    "all-reduce-scatter": "written as libtpu's all-reduce-scatter fusion",
    "zero-filled all-reduce": "an all-gather written as an all-reduce of zero-filled buffers",
}


class Collective(NamedTuple):
    """One kind of collective over one set of mesh axes in a compiled step, per executed step.

    Attributes:
        kind: ``all-gather``, ``all-reduce``, ``reduce-scatter``,
            ``all-to-all`` or ``collective-permute``.
        count: how many run per step (an op in a loop counts once per
            iteration where the trip count is known).
        bytes: the size of their results on one device, summed over `count`.
        axes: the mesh axes whose coordinates vary within a device group (in
            mesh order); for a collective-permute, the axes along which source
            and target differ.
        group: how many devices take part in each group (2 for a
            collective-permute).
        written_as: the form the compiler wrote these in, where it is not the
            op `kind` names (new in 0.5; rows differ by it): ``""``, the op
            itself; ``"all-reduce-scatter"``, libtpu's fusion of an all-reduce
            with each device's slice of its result (a ``kind=kCustom`` fusion
            of a computation named ``all-reduce-scatter``), counted as the
            reduce-scatter of its operand to that shard (not as the whole
            all-reduce inside); ``"zero-filled all-reduce"``, an all-gather
            written as an all-reduce of buffers of zeros each device has written
            its shard into, counted as the all-reduce it runs.

    Example:
        >>> import spmdtree as st
        >>> row = st.Collective("all-gather", 1, 4096, axes=("fsdp",), group=8)
        >>> row.wire_bytes  # each device sends 7/8 of the gathered result
        3584
        >>> st.Collective("all-reduce", 2, 4096).bytes
        4096
        >>> st.Collective("reduce-scatter", 1, 512, ("fsdp",), 8, "all-reduce-scatter").label
        "reduce-scatter (written as libtpu's all-reduce-scatter fusion)"
    """

    kind: CollectiveKind
    count: int  # type: ignore[assignment]  # the field shadows tuple.count, as named
    bytes: int
    axes: tuple[str, ...] = ()
    group: int = 1
    written_as: Written = ""

    @property
    def label(self) -> str:
        """The kind, with the form it was written in where that is not the op itself.

        Example:
            >>> import spmdtree as st
            >>> st.Collective("all-reduce", 1, 4096, ("fsdp",), 8, "zero-filled all-reduce").label
            'all-reduce (an all-gather written as an all-reduce of zero-filled buffers)'
            >>> st.Collective("all-reduce", 1, 4096).label
            'all-reduce'
        """
        form = _WRITTEN.get(self.written_as)
        return f"{self.kind} ({form})" if form else self.kind

    @property
    def wire_bytes(self) -> int:
        """What each device sends per step by the ring algorithm.

        all-gather ``(g-1)/g x result``, reduce-scatter ``(g-1) x result``,
        all-reduce ``2(g-1)/g x size``, all-to-all ``(g-1)/g x size``,
        collective-permute its size (g the group).

        Example:
            >>> import spmdtree as st
            >>> st.Collective("all-reduce", 1, 1024, axes=("data",), group=4).wire_bytes
            1536
            >>> st.Collective("reduce-scatter", 1, 1024, axes=("data",), group=4).wire_bytes
            3072
        """
        return CollectiveKind(self.kind).ring_bytes(self.bytes, self.group)


class Kernel(NamedTuple):
    """One device kernel: its class (``matmul``, ``attention`` or ``memory``), the
    FLOPs of its dots, the bytes it reads and writes, and its largest matmul's
    shape (batch, m, n, k; zeros where it has none) and operands' element type
    (``bf16``, ``f32``; ``f32/highest`` at the highest precision); `opaque`, a
    hand-written kernel's name where its call keeps no cost estimate (new in 0.6);
    `call`, a library kernel's custom-call target (``__cudnn$fmhaSoftmax``: cuDNN's
    fused attention) or a hand-written kernel's name (``mha_forward``; new in 0.6);
    `name`, the instruction's name in the compiled module (``fusion.12``; new in 0.6);
    `estimated_cycles`, libtpu's own estimate of its cycles (its backend config's),
    0 where the compiler gives none, `opcodes.UNESTIMABLE` (2^63 - 1, libtpu's own
    mark) where libtpu says it cannot estimate it (new in 0.7); `opcode`, `shape` and
    `op_name`, its instruction's opcode as HLO prints it (``fusion``), its result
    with its layout (``f32[8,1024]{1,0}``) and the op_name of its metadata, where jax's
    trace named it (new in 0.7: what a measurement names a miss by); `unfused_update`,
    True for a dynamic-update-slice the compiler runs as a kernel of its own at an
    offset known only when it runs, into a dimension its layout's tiles cover (a
    TPU's blocked attention writing each block's output): it moves its update at
    `Hardware.update_efficiency` of the bandwidth, read and written wherever it is
    held (new in 0.7); `grouped`, True for a grouped matmul (`jax.lax.ragged_dot`
    and its transposes: an expert layer's), its FLOPs those of the groups it
    multiplies (`opcodes.groups_of`), timed at `Hardware.grouped_efficiency` of the
    peak (new in 0.8); `indexed`, the bytes a kernel's gathers and scatters of rows by
    index move (an expert layer's dispatch and combine; `moved_by_index`), wherever
    the compiler keeps them, counted among its bytes and moved at
    `Hardware.indexed_efficiency` of the bandwidth, the rest at the memory share
    (new in 0.8); `hbm_waits`, how often it waits for the memory's first access,
    `Hardware.access_seconds`: once where it reads a value its layout leaves in HBM,
    not in the chip's own memory (``S(1)``), once more where it writes one (new in
    0.8: on a TPU v5e a tiny kernel that only reads HBM ran 0.35 us, one that reads
    and writes it 0.59 us); `fused_update`, True for a matmul's kernel that writes
    two or more arrays of its product's size: an optimizer's update fused into a
    weight's gradient (libtpu fuses adamw's so), timed at
    `Hardware.fused_update_efficiency` of its shape's rate (new in 0.8); `on_chip`,
    the bytes it reads and writes in the chip's own memory (``S(1)``, counted as
    `bytes` counts HBM's), moved at `Hardware.on_chip_bytes_per_second` where the
    chip has that figure (new in 0.8: 0.7 priced a kernel whose arrays all sat there
    at nothing; on a TPU v5e such copies of 64 MB ran 30 us; a kernel's rows moved
    by index there, `rows_on_chip`, among them; a kernel with a matmul reads them
    as it multiplies, in its measured share, and moves only such rows at that
    rate); `reads_only`, True for a kernel that reads HBM, writes there at most
    1/`READS_ONLY` of that (a reduction's result) and moves no rows by index,
    whose bytes stream at `Hardware.read_efficiency` of the bandwidth (new in
    0.8: on a TPU v5e such kernels, reductions and matmuls reading their
    operands, ran at 0.85-0.92 of it, copies and broadcasts at 0.80)."""

    kind: KernelClass
    flops: int
    bytes: int
    batch: int = 0
    m: int = 0
    n: int = 0
    k: int = 0
    dtype: str = ""
    opaque: str = ""
    call: str = ""
    name: str = ""
    estimated_cycles: int = 0
    opcode: str = ""
    shape: str = ""
    op_name: str = ""
    unfused_update: bool = False
    grouped: bool = False
    indexed: int = 0
    hbm_waits: int = 0
    fused_update: bool = False
    on_chip: int = 0
    reads_only: bool = False

    @property
    def rows_on_chip(self) -> bool:
        """Whether it gathers or scatters rows by index in the chip's own memory: it
        reads and writes nothing in HBM (`hbm_waits` 0: a constant is the kernel's
        own), so its rows, counted in `on_chip` too, move there, at that memory's
        rate where the chip has it, not at `Hardware.indexed_efficiency` of HBM's
        (new in 0.8: a v5e's gathers there ran at 2.3 TB/s).

        Example:
            >>> Kernel("memory", 0, 4096, indexed=4096, on_chip=8192).rows_on_chip
            True
            >>> Kernel("memory", 0, 4096, indexed=4096, hbm_waits=1).rows_on_chip
            False
        """
        return bool(self.indexed and self.on_chip and not self.hbm_waits)

    @property
    def unestimable(self) -> bool:
        """Whether libtpu marks it as a kernel it cannot estimate (new in 0.7).

        Example:
            >>> Kernel("memory", 0, 1 << 20, estimated_cycles=2**63 - 1).unestimable
            True
        """
        return self.estimated_cycles == UNESTIMABLE

    @property
    def flash(self) -> str:
        """``forward`` or ``backward`` for a flash-attention kernel (cuDNN's fused
        attention, one of jax's own Pallas kernels: `opcodes.FLASH`), else ``""``.

        Example:
            >>> Kernel("attention", 1, 1, call="__cudnn$fmhaSoftmaxBackward").flash
            'backward'
            >>> Kernel("attention", 1, 1, call="mha_forward").flash, Kernel("matmul", 1, 1).flash
            ('forward', '')
        """
        if self.call.startswith("__cudnn$fmha"):
            return "backward" if "Backward" in self.call else "forward"
        flash = flash_of(self.call) if self.call else None
        return "" if flash is None else "backward" if flash.backward else "forward"


class Start(NamedTuple):
    """A collective begins: `ident` pairs it with its `Done`; `sync` where it runs
    on the compute stream (a synchronous collective, or one XLA marked
    ``is_sync``); `partial` where its groups are not whole mesh axes (new in 0.6);
    `name`, the instruction's name in the compiled module (new in 0.6)."""

    ident: int
    row: Collective
    sync: bool
    partial: bool = False
    name: str = ""


class Done(NamedTuple):
    """The compute stream waits here for collective (or `Copy`) `ident` to finish."""

    ident: int


class Copy(NamedTuple):
    """An asynchronous copy the chip's DMA engines run beside the compute (new in 0.8):
    libtpu's ``slice-start`` (a slice of an array) and ``copy-start`` (an array moved
    between HBM and the chip's own memory, ``S(1)``). `ident` pairs it with its
    `Done`, where the compute waits for it; `kernel` is what it moves: its bytes
    those read from or written to HBM, its name the done's, which a device's profile
    times the compute's wait under. 0.7 timed each on the compute stream, as a kernel
    nothing hides: a TPU v5e's profile shows the waits at about none."""

    ident: int
    kernel: Kernel


class Loop(NamedTuple):
    """A ``while``: its body (condition included) runs `trips` times; `known` is
    False where the compiler does not say how often (timed and counted once);
    `name`, the instruction's name in the compiled module (new in 0.6); `idle`,
    for the loop of a pipeline's iterations (`st.pipeline`'s, its name scope on
    the ``while``, its trips that scope's iterations), how many of them each
    device runs on padding: the bubble, ``stages - 1`` (new in 0.8; 0 for any
    other loop)."""

    trips: int
    body: tuple[Event, ...]
    known: bool = True
    name: str = ""
    idle: int = 0


class Branches(NamedTuple):
    """A conditional: one of its branches runs (timed as the slowest)."""

    branches: tuple[tuple[Event, ...], ...]


Event = Kernel | Start | Done | Copy | Loop | Branches
E = TypeVar("E", Kernel, Loop, Start, Copy)


#: A reduction over a dimension that is not its array's minor-most is flagged from
#: this size of the array (1 GiB; new in 0.7).
LARGE_REDUCTION = 2**30


class Doubt(Flag):
    """A kernel whose time the model may miss by far (new in 0.7): libtpu marks it
    unestimable, or it reduces a dimension that is not the minor-most of an array
    of 1 GiB or more. Measured on a TPU v5e, the softmax of
    ``jax.nn.dot_product_attention(implementation="xla")`` at 8,192 tokens ran two
    such reductions per layer over ``f32[2,8,8192,8192]{2,3,1,0}``, 438 ms each
    against ~5 ms of bytes: the only two kernels libtpu marked unestimable.

    Attributes:
        name: the kernel's instruction in the compiled module (``fusion.4``).
        shape: the array it reduces, or else its result, with its layout
            (``f32[2,8,8192,8192]{2,3,1,0}``).
        op_name: where the step wrote it (its metadata's ``op_name``).
        cycles: libtpu's estimate (`Kernel.estimated_cycles`: 0 for none,
            `opcodes.UNESTIMABLE` where it cannot estimate it).
        reduced: the dimensions it reduces that are not the minor-most (none
            where it reduces none so).
        minor: the reduced array's minor-most dimension.
        bytes: the reduced array's bytes.

    Example:
        >>> doubt = Doubt("fusion.4", "f32[2,8192,128]{2,1,0}", "jit(f)/sub", 2**63 - 1, (1,), 2, 8 << 20)
        >>> print(doubt)
        fusion.4 reduces f32[2,8192,128]{2,1,0} (8.0 MiB, jit(f)/sub) over dimension 1, not its minor dimension 2, and libtpu cannot estimate it (its estimated_cycles is 2^63 - 1): on a TPU v5e such a reduction (a softmax over f32[2,8,8192,8192]{2,3,1,0}) ran 438 ms against ~5 ms for its bytes, so its predicted time may be far too low. Where it is attention's softmax, use a flash-attention kernel (jax.nn.dot_product_attention(implementation="cudnn") on GPU; splash attention or jax's Pallas flash attention on TPU); else reduce along the minor dimension
        >>> doubt.cycles == 2**63 - 1, doubt.reduced
        (True, (1,))
    """

    fields = ("name", "shape", "op_name", "cycles", "reduced", "minor", "bytes")
    name: str
    shape: str
    op_name: str
    cycles: int
    reduced: tuple[int, ...]
    minor: int
    bytes: int

    def __new__(
        cls,
        name: str,
        shape: str,
        op_name: str,
        cycles: int,
        reduced: tuple[int, ...] = (),
        minor: int = 0,
        bytes: int = 0,
    ) -> Doubt:
        doubt = super().__new__(cls, _doubted(name, shape, op_name, cycles, reduced, minor, bytes))
        doubt.name, doubt.shape, doubt.op_name, doubt.cycles = name, shape, op_name, cycles
        doubt.reduced, doubt.minor, doubt.bytes = tuple(reduced), minor, bytes
        return doubt


def _doubted(
    name: str, shape: str, op_name: str, cycles: int, dims: tuple[int, ...], minor: int, size: int
) -> str:
    """A `Doubt`'s sentence: the kernel, what it does that the model may miss, what
    libtpu said of it, and the fix."""
    origin = f", {op_name}" if op_name else ""
    said = (
        "libtpu cannot estimate it (its estimated_cycles is 2^63 - 1)"
        if cycles == UNESTIMABLE
        else f"libtpu estimates it at {cycles:,} cycles"
        if cycles
        else ""
    )
    if not dims:
        return (
            f"{name} ({shape}{origin}): {said}, so its predicted time, from its FLOPs and "
            "bytes, may be far too low (on a TPU v5e, the kernels libtpu so marked ran 88 "
            "times their bytes' time); measure the step on the chip (st.measure)"
        )
    plural = "s" if len(dims) > 1 else ""
    return (
        f"{name} reduces {shape} ({size_text(size)}{origin}) over dimension{plural} "
        f"{', '.join(map(str, dims))}, not its minor dimension {minor}"
        f"{', and ' + said if said else ''}: on a TPU v5e such a reduction (a softmax over "
        "f32[2,8,8192,8192]{2,3,1,0}) ran 438 ms against ~5 ms for its bytes, so its "
        "predicted time may be far too low. Where it is attention's softmax, use a "
        'flash-attention kernel (jax.nn.dot_product_attention(implementation="cudnn") on '
        "GPU; splash attention or jax's Pallas flash attention on TPU); else reduce along "
        "the minor dimension"
    )


def flag_json(flag: str) -> Any:
    """A flag as a JSON value: a sentence as itself, a `Doubt` as its fields (new in
    0.7: read back typed, not parsed from its sentence)."""
    if isinstance(flag, Doubt):
        return {"doubt": [getattr(flag, name) for name in Doubt.fields]}
    return str(flag)


def flag_from(data: Any) -> str:
    """The flag `flag_json` gave.

    Example:
        >>> doubt = Doubt("fusion.9", "f32[8]{0}", "", 2**63 - 1)
        >>> type(flag_from(flag_json(doubt))).__name__, flag_from(flag_json(doubt)) == doubt
        ('Doubt', True)
    """
    if isinstance(data, dict):
        name, shape, op_name, cycles, dims, minor, size = data["doubt"]
        return Doubt(name, shape, op_name, cycles, tuple(dims), minor, size)
    return str(data)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A compiled step's events in the order its device runs them (`read_schedule`).

    Attributes:
        events: the entry computation's `Kernel`, `Start`, `Done`, `Copy` (new in
            0.8), `Loop` and `Branches` records, in schedule order.
        platform: the compiler's platform (``"cuda"``, ``"tpu"``, ``"cpu"``).
        flags: what the schedule does not cover (a loop of unknown trip count,
            timed once), and the kernels whose time the model may miss by far
            (`Doubt`s; new in 0.7).
        held_bytes: on the CPU, the whole sizes of the all-reduces read as
            reduce-scatters that are live at once (0 elsewhere).
        scattered: on the CPU, how many all-reduces are read as reduce-scatters.
        widened: on the CPU, how many collectives of values it widened (bf16 in
            f32) are counted at the program's width.
    """

    events: tuple[Event, ...]
    platform: str
    flags: tuple[str, ...] = ()
    held_bytes: int = 0
    scattered: int = 0
    widened: int = 0

    def kernels(self) -> Iterator[Kernel]:
        """Every `Kernel` it runs, in loops and in every branch too, once each as
        written (not times its trips)."""
        return _every(self.events, Kernel)

    def collectives(self) -> tuple[Collective, ...]:
        """Each collective it runs, once each as written, at one run's size (new in
        0.8: `StepPlan.collectives` sums them by kind and axes).

        Example:
            >>> gather = Collective("all-gather", 1, 64, ("fsdp",), 4)
            >>> Schedule((Loop(3, (Start(0, gather, True), Done(0))),), "tpu").collectives()
            (Collective(kind='all-gather', count=1, bytes=64, axes=('fsdp',), group=4, written_as=''),)
        """
        return tuple(start.row for start in _every(self.events, Start))

    def copies(self) -> tuple[Copy, ...]:
        """Each async copy it runs (`Copy`), once each as written (new in 0.8).

        Example:
            >>> moved = Kernel("memory", 0, 4096, name="slice-done.1")
            >>> [c.kernel.name for c in Schedule((Loop(3, (Copy(0, moved), Done(0))),), "tpu").copies()]
            ['slice-done.1']
        """
        return tuple(_every(self.events, Copy))

    def compiler_cycles(self) -> int:
        """libtpu's own estimate of the step, in cycles: each kernel's
        `Kernel.estimated_cycles` times how often it runs (a loop's trips, a
        conditional's costlier branch once), those it cannot estimate left out
        (`Doubt` flags them); 0 where the compiler gives none (new in 0.7).

        Example:
            >>> events = (Kernel("matmul", 1, 1, estimated_cycles=100), Loop(4, (Kernel("memory", 0, 1, estimated_cycles=25),)))
            >>> Schedule(events, "tpu").compiler_cycles()
            200
        """
        return _cycles(self.events)

    def pipelines(self) -> tuple[Loop, ...]:
        """The loops of a pipeline's iterations (`Loop.idle` > 0), in schedule order:
        the forward's, then the backward's (new in 0.8).

        Example:
            >>> stage = Loop(2, (Kernel("matmul", 1, 1),))
            >>> forward = Loop(11, (stage,), name="while.3", idle=3)
            >>> [loop.name for loop in Schedule((forward, Kernel("memory", 0, 1)), "tpu").pipelines()]
            ['while.3']
        """
        return tuple(loop for loop in _every(self.events, Loop) if loop.idle)

    def stage_axes(self) -> tuple[str, ...]:
        """The mesh axes a pipeline passes its activations along: those of the
        collective-permutes of its loops' own iterations, not of loops inside them
        (new in 0.8; () without a pipeline).

        Example:
            >>> shift = Start(0, Collective("collective-permute", 1, 64, ("stage",), 2), True)
            >>> Schedule((Loop(11, (shift, Done(0)), idle=3),), "tpu").stage_axes()
            ('stage',)
        """
        axes = dict.fromkeys(
            axis
            for loop in self.pipelines()
            for start in loop.body
            if isinstance(start, Start)
            if start.row.kind == CollectiveKind.COLLECTIVE_PERMUTE
            for axis in start.row.axes
        )
        return tuple(axes)

    def to_dict(self) -> dict[str, Any]:
        """The schedule as plain JSON values (each event a tagged list)."""
        return {
            "events": [_event_json(e) for e in self.events],
            "platform": self.platform,
            "flags": [flag_json(flag) for flag in self.flags],
            "cpu": [self.held_bytes, self.scattered, self.widened],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """The schedule `to_dict` gave."""
        events = tuple(_event_from(e) for e in data["events"])
        flags = tuple(flag_from(flag) for flag in data["flags"])
        return cls(events, data["platform"], flags, *data["cpu"])

    def masked(self, masks: Mapping[str, Kept]) -> Schedule:
        """This schedule with each flash kernel's FLOPs counted over the blocks its
        mask keeps, as `masks` (by kernel name: what the traced step says) gives
        them; a kernel without one as it was (new in 0.7).

        Example:
            >>> events = (Loop(4, (Kernel("attention", 6400, 64, call="splash_mha_fwd_residuals"),)),)
            >>> masked = Schedule(events, "tpu").masked({"splash_mha_fwd_residuals": Kept(36, 64)})
            >>> masked.events[0].body[0].flops
            3600
        """
        return dataclasses.replace(self, events=_masked(self.events, masks))


def _masked(events: tuple[Event, ...], masks: Mapping[str, Kept]) -> tuple[Event, ...]:
    """`events` with each flash kernel's FLOPs over the blocks its mask keeps."""
    found: list[Event] = []
    for event in events:
        if isinstance(event, Kernel) and event.call in masks and flash_of(event.call):
            event = event._replace(flops=masks[event.call].scaled(event.flops))
        elif isinstance(event, Loop):
            event = event._replace(body=_masked(event.body, masks))
        elif isinstance(event, Branches):
            event = Branches(tuple(_masked(branch, masks) for branch in event.branches))
        found.append(event)
    return tuple(found)


def _every(events: Iterable[Event], kind: type[E]) -> Iterator[E]:
    """Every event of `kind` in `events`, in loops (a loop's own too) and in every
    branch, once each as written."""
    for event in events:
        if isinstance(event, kind):
            yield event
        if isinstance(event, Loop):
            yield from _every(event.body, kind)
        elif isinstance(event, Branches):
            for branch in event.branches:
                yield from _every(branch, kind)


def _cycles(events: Iterable[Event]) -> int:
    """The estimated cycles of `events`, per run (`Schedule.compiler_cycles`)."""
    total = 0
    for event in events:
        if isinstance(event, Kernel) and not event.unestimable:
            total += event.estimated_cycles
        elif isinstance(event, Loop):
            total += event.trips * _cycles(event.body)
        elif isinstance(event, Branches):
            total += max((_cycles(branch) for branch in event.branches), default=0)
    return total


def _event_json(event: Event) -> list[Any]:
    if isinstance(event, Kernel):
        return ["kernel", *event]
    if isinstance(event, Start):
        return ["start", event.ident, list(event.row), event.sync, event.partial, event.name]
    if isinstance(event, Done):
        return ["done", event.ident]
    if isinstance(event, Copy):
        return ["copy", event.ident, _event_json(event.kernel)]
    if isinstance(event, Loop):
        body = [_event_json(e) for e in event.body]
        return ["loop", event.trips, body, event.known, event.name, event.idle]
    return ["branches", [[_event_json(e) for e in branch] for branch in event.branches]]


def _kernel_from(fields: Sequence[Any]) -> Kernel:
    return Kernel(KernelClass(fields[0]), *fields[1:])


def _event_from(data: Sequence[Any]) -> Event:
    tag, rest = data[0], data[1:]
    if tag == "kernel":
        return _kernel_from(rest)
    if tag == "start":
        kind, count, size, axes, group, written = rest[1]
        row = Collective(CollectiveKind(kind), count, size, tuple(axes), group, written)
        return Start(rest[0], row, rest[2], rest[3], rest[4])
    if tag == "done":
        return Done(rest[0])
    if tag == "copy":
        return Copy(rest[0], _kernel_from(rest[1][1:]))
    if tag == "loop":
        return Loop(rest[0], tuple(_event_from(e) for e in rest[1]), *rest[2:])
    return Branches(tuple(tuple(_event_from(e) for e in branch) for branch in rest[0]))


#: A multi-slice TPU job's transfer across slices: a host-transfer ``send`` for the
#: megascale runtime, whose frontend attribute says what collective it is part of.
_MEGASCALE = "_xla_megascale_transfer_type"
_MEGASCALE_KINDS = {
    "ALL_REDUCE": CollectiveKind.ALL_REDUCE,
    "ALL_GATHER": CollectiveKind.ALL_GATHER,
    "REDUCE_SCATTER": CollectiveKind.REDUCE_SCATTER,
    "ALL_TO_ALL": CollectiveKind.ALL_TO_ALL,
}


#: Custom calls that do no work: they run no kernel and move nothing (new in 0.8: 0.7
#: timed their results as memory traffic, where a device's profile shows none). XLA's
#: ``AllocateBuffer`` only allocates a buffer (a scratch buffer, jax's empty arrays);
#: libtpu's ``ConcatBitcast`` reads as one array the slices its async copies wrote
#: side by side (on a TPU v5e, 531 of them in seven steps, each timed at 0).
NO_WORK = frozenset({"AllocateBuffer", "ConcatBitcast"})
#: Ops that run no kernel: bookkeeping the runtime resolves (a bitcast is a view).
_FREE = frozenset(
    {
        Op.kParameter,
        Op.kConstant,
        Op.kGetTupleElement,
        Op.kTuple,
        Op.kBitcast,
        Op.kAfterAll,
        Op.kAddDependency,
        Op.kOptimizationBarrier,
        Op.kPartitionId,
        Op.kReplicaId,
        # kDomain, where jaxlib still has it (0.12.1's HloOpcode dropped it)
        *[getattr(Op, name) for name in ("kDomain",) if hasattr(Op, name)],
        Op.kGetDimensionSize,
        Op.kAsyncUpdate,
        Op.kSend,
        Op.kSendDone,
        Op.kRecv,
        Op.kRecvDone,
    }
)
#: What the compute stream waits at: an async pair's done, a wrapped async op's too.
_DONES = DONES | {Op.kAsyncDone, Op.kCopyDone}
#: Ops that read only part of their first operand: a slice's bytes, not the whole.
_SLICING = frozenset({Op.kDynamicSlice, Op.kSlice, Op.kGather})
#: Ops that only move data, which the DMA engines run where the compiler makes them
#: asynchronous (a `Copy`).
_MOVING = frozenset({Op.kSlice, Op.kDynamicSlice, Op.kCopy})


class _Walker:
    """Turns a module's scheduled computations into events, each computation once."""

    def __init__(
        self,
        mod: Module,
        shape: Sequence[tuple[str, int]],
        backend: Backend,
        slice_size: int | None,
    ) -> None:
        self.mod, self.shape, self.slice_size = mod, tuple(shape), slice_size
        self.cpu = backend.estimates
        self.scalar_unit = backend is Backend.TPU  # runs scalar ops inline: no kernel
        self.flow = Flow(mod)
        self.idents: dict[tuple[str, str], tuple[int, ...]] = {}
        self.started = 0  # collectives and copies given an ident so far
        self.unknown = False
        self.read: dict[str, tuple[Event, ...]] = {}
        self.scattered: dict[tuple[str, str], int] = {}
        self.widened: set[tuple[str, str]] = set()
        self.chains: dict[str, tuple[int, ...]] = {}  # libtpu's async fusions, started
        self.doubts: list[Doubt] = []

    def events(self, comp: str) -> tuple[Event, ...]:
        if comp not in self.read:
            self.read[comp] = tuple(
                e for ins in self.mod.comps.get(comp, []) for e in self.of(comp, ins)
            )
        return self.read[comp]

    def of(self, comp: str, ins: Instr) -> list[Event]:
        """The events of one scheduled instruction."""
        callees = dict(ins.callees)
        if ins.op == Op.kSend and _MEGASCALE in ins.frontend:
            return self._starts(comp, ins, [self._across_slices(ins)], sync=False)
        if ins.op == Op.kSendDone:
            return self._dones(comp, ins)
        if ins.op in _FREE or (ins.op == Op.kCustomCall and ins.target in NO_WORK):
            return []
        if ins.op == Op.kWhile:
            trips = trip_count(self.mod, comp, ins)
            self.unknown |= trips is None
            body = self.events(callees.get("condition", "")) + self.events(callees.get("body", ""))
            scope = Scope.loop(ins.op_name)  # a pipeline's own loop, not one inside it
            idle = scope.idle if scope is not None and trips == scope.iterations else 0
            return [Loop(1 if trips is None else trips, body, trips is not None, ins.name, idle)]
        if ins.op == Op.kConditional:
            return [Branches(tuple(self.events(c) for _, c in ins.callees))]
        if ins.op == Op.kCall:
            return list(self.events(callees.get("to_apply", "")))
        if ins.op in _DONES:
            return self._dones(comp, ins)
        if ins.op == Op.kCopyStart:  # one to or from the host's memory: free, as in 0.7
            return self._copy(comp, ins, ins) or []
        if ins.op in STARTS or ins.op == Op.kAsyncStart or ins.op in SYNC:
            return self._collective(comp, ins)
        if self.scalar_unit and self._scalar(comp, ins):
            return []
        fused = self._fused(comp, ins)
        if fused is not None:  # libtpu's all-reduce-scatter: the collective it runs
            return self._starts(comp, ins, [fused], sync=True)
        chained = self._chained(comp, ins)
        if chained is not None:
            return chained
        inside = self._inside(ins)
        kernel: list[Event] = [self._kernel(comp, ins)]
        return kernel + (self._starts(comp, ins, inside, sync=True) if inside else [])

    def _chained(self, comp: str, ins: Instr) -> list[Event] | None:
        """libtpu's async collective fusion (``xla_tpu_enable_async_collective_fusion``):
        one collective run in steps by a chain of fusions, its `chain_id` theirs.
        The fusion whose root is ``AsyncCollectiveStart`` starts it (its rows, once,
        async); those that continue it are the compute they fuse with it; the one
        whose root is ``AsyncCollectiveDone`` is where the compute waits for it.
        None where `ins` is no link of a chain."""
        link = async_link(self.mod, ins)
        if link is None:
            return None
        role, chain, inner = link
        kernel: list[Event] = [self._kernel(comp, ins)] if self._computes(ins) else []
        if role == "start":  # any compute fused with the start runs beside the collective
            rows = self._rows(inner[0], inner[1], inner[1], SYNC[inner[1].op])
            started = self._starts(comp, ins, rows, sync=False)
            self.chains[chain] = tuple(e.ident for e in started if isinstance(e, Start))
            return started + kernel
        if role == "done":  # compute fused with the done uses the collective's result
            return [Done(i) for i in self.chains.pop(chain, ())] + kernel
        return [self._kernel(comp, ins)]

    def _computes(self, ins: Instr) -> bool:
        """Whether a fusion does more than a chain's done: any op of its own."""
        callee = dict(ins.callees).get("calls", "")
        skip = {Op.kParameter, Op.kCustomCall, Op.kTuple, Op.kGetTupleElement, Op.kBitcast}
        return any(i.op not in skip and i.op not in SYNC for i in self.mod.comps.get(callee, []))

    def _dones(self, comp: str, ins: Instr) -> list[Event]:
        """Where the compute stream waits for the collectives (or the copy) its
        operand started."""
        found = self.idents.get((comp, ins.operands[0]), ()) if ins.operands else ()
        return [Done(ident) for ident in found]

    def _starts(
        self,
        comp: str,
        ins: Instr,
        rows: Sequence[tuple[Collective, bool]],
        sync: bool,
        waits: bool | None = None,
    ) -> list[Event]:
        """A `Start` per row, paired with the instruction whose done waits for them;
        where the compute waits at once (`waits`: a synchronous op), its `Done`s too."""
        first, self.started = self.started, self.started + len(rows)
        starts = [
            Start(first + i, row, sync, partial, ins.name) for i, (row, partial) in enumerate(rows)
        ]
        self.idents[(comp, ins.name)] = tuple(start.ident for start in starts)
        if sync if waits is None else waits:
            return [*starts, *(Done(start.ident) for start in starts)]
        return list(starts)

    def _collective(self, comp: str, ins: Instr) -> list[Event]:
        """A collective's `Start`s (and, synchronous, their `Done`s); an async wrapper
        of anything else is what it wraps: a fusion's collectives, or its kernel."""
        inner, kind, where = ins, STARTS.get(ins.op) or SYNC.get(ins.op), comp
        if ins.op == Op.kAsyncStart:
            wrapped = dict(ins.callees).get("async", "")
            root = self.mod.root(wrapped)
            kind = SYNC.get(root.op) if root is not None else None
            if root is None:
                return [self._kernel(comp, ins)]
            if kind is None:
                fused = self._fused(wrapped, root)
                rows = [fused] if fused is not None else self._inside(root)
                copied = self._copy(comp, ins, root) if not rows and root.op in _MOVING else None
                if copied:  # the DMA engines', beside the compute
                    return copied
                if not rows:  # an op run asynchronously: timed once, as its done
                    done = self._done_of(comp, ins).name
                    return [self._kernel(wrapped, root)._replace(name=done)]
                return self._starts(comp, ins, rows, sync=False)
            inner, where = root, wrapped
        if kind is None:
            return []
        result = self._result(comp, ins, inner)
        rows = self._rows(where, result, inner, kind)
        sync = ins.op in SYNC or config_field(ins.config, "is_sync") is True
        return self._starts(comp, ins, rows, sync, waits=ins.op in SYNC)

    def _copy(self, comp: str, start: Instr, moving: Instr) -> list[Event] | None:
        """An async slice or copy `start` (`moving`, the op it runs) as the `Copy` its
        done waits for: what it moves through HBM, the slice read where its source is
        there and written where its destination is (new in 0.8); None where it
        crosses to the host's memory, whose link the model does not time."""
        given = self._operands(comp, start)
        done = self._done_of(comp, start)
        source = given[0].arrays[0] if given and given[0].arrays else None
        target = done.arrays[0] if done is not start and done.arrays else None  # its result
        if source is None or target is None or HOST in (source.space, target.space):
            return None
        moved = (0 if source.space == ON_CHIP else target.tiled_bytes) + target.hbm_bytes
        ident, self.started = self.started, self.started + 1
        self.idents[(comp, start.name)] = (ident,)
        kernel = Kernel(
            KernelClass.MEMORY,
            0,
            moved,
            name=done.name,
            opcode=_printed_opcode(moving.op),
            shape=done.printed,
            op_name=moving.op_name,
        )
        return [Copy(ident, kernel)]

    def _done_of(self, comp: str, start: Instr) -> Instr:
        """An async start's done, whose name a device's profile times an op run
        asynchronously under (a libtpu ``slice-start`` takes about none of it); the
        start itself where it has none (new in 0.8: 0.7 named it after the op it
        wraps, which no profile event has)."""
        users = self.mod.users[comp].get(start.name, [])
        return next((user for user, _ in users if user.op in _DONES), start)

    def _rows(
        self, comp: str, result: Instr, start: Instr, kind: CollectiveKind
    ) -> list[tuple[Collective, bool]]:
        """The rows a collective counts as (`forms.parts`: a tuple's elements, the CPU's
        forms), one per kind and form, each once, with whether its groups are whole."""
        axes, group, whole = collective_axes(kind, start.groups, start.pairs, self.shape)
        found: dict[tuple[CollectiveKind, Written], int] = {}
        for part in parts(self.flow, comp, result, start, kind, group, self.cpu):
            self._note(comp, result, part)
            key = (part.kind, part.written_as)
            found[key] = found.get(key, 0) + part.bytes
        return [
            (Collective(k, 1, size, axes, group, written), not whole)
            for (k, written), size in found.items()
        ]

    def _note(self, comp: str, ins: Instr, part: Part) -> None:
        """Keeps what the CPU's forms say: reductions held whole, values widened."""
        if part.held:
            self.scattered[(comp, ins.name)] = self.scattered.get((comp, ins.name), 0) + part.held
        if part.widened:
            self.widened.add((comp, ins.name))

    def _fused(self, comp: str, ins: Instr) -> tuple[Collective, bool] | None:
        """libtpu's all-reduce-scatter fusion `ins` as the reduce-scatter it is (one op,
        a tuple of them too), its bytes its result (the shards), or None if `ins` is not
        one (or a shard times the group is not the whole reduced)."""
        found = fused_scatter(self.mod, ins)
        if found is None:
            return None
        inner, pairs = found
        axes, group, whole = collective_axes(
            CollectiveKind.ALL_REDUCE, inner.groups, inner.pairs, self.shape
        )
        if any(math.prod(s) * group != math.prod(w) for s, w in pairs):
            return None
        row = Collective(
            CollectiveKind.REDUCE_SCATTER, 1, ins.bytes, axes, group, "all-reduce-scatter"
        )
        return row, not whole

    def _inside(self, ins: Instr) -> list[tuple[Collective, bool]]:
        """The collectives a fusion runs inside its kernel (libtpu's collective
        fusions), each as its rows."""
        if ins.op != Op.kFusion:
            return []
        found, todo = [], [dict(ins.callees).get("calls", "")]
        while todo:
            comp = todo.pop()
            for each in self.mod.comps.get(comp, []):
                kind = SYNC.get(each.op)
                if kind is not None:
                    found += self._rows(comp, each, each, kind)
                todo += [c for r, c in each.callees if r == "calls"]
        return found

    def _across_slices(self, ins: Instr) -> tuple[Collective, bool]:
        """A transfer across TPU slices (a megascale ``send``): the collective it is
        part of, over the devices at the same place in each slice, its bytes the
        array sent."""
        kind = _MEGASCALE_KINDS.get(
            ins.frontend.get(_MEGASCALE, ""), CollectiveKind.COLLECTIVE_PERMUTE
        )
        devices = math.prod(size for _, size in self.shape) if self.shape else 1
        per = self.slice_size or devices
        groups = [list(range(p, devices, per)) for p in range(per)]
        axes, group, whole = group_axes(groups, self.shape) if self.shape else ((), 1, True)
        size = ins.arrays[0].bytes if ins.arrays else 0
        return Collective(kind, 1, size, axes, group), not whole

    def _result(self, comp: str, ins: Instr, inner: Instr) -> Instr:
        """What gives a collective's result: itself (synchronous, or an async
        wrapper's collective), or its done."""
        if ins.op in SYNC or inner is not ins:
            return inner
        done = [u for u, _ in self.mod.users[comp].get(ins.name, []) if u.op in _DONES]
        return done[0] if done else ins

    def _kernel(self, comp: str, ins: Instr) -> Kernel:
        """A kernel: its class, FLOPs, bytes and largest matmul's shape."""
        flops, largest, shape, dtype, named = 0, 0, (0, 0, 0, 0), "", False
        inside = self._inside_kernel(comp, ins)
        grouped = is_kernel_call(ins) and any(g in ins.op_name for g in GROUPED)  # libtpu's
        for where, dot in _dots(ins, inside):
            f = op_flops(self.mod, where, dot)
            if f > largest:
                largest, shape = f, _gemm_shape(self.mod, where, dot, f)
                dtype = _operand_dtype(self.mod, where, dot)
            flops += f
            named |= _attention_named(dot)
            grouped |= dot.op != Op.kCustomCall and dot_groups(self.mod, where, dot) > 1
        name = kernel_name(ins) if is_kernel_call(ins) else ""
        fused = ins.target.startswith("__cudnn$fmha") or flash_of(name) is not None
        if fused or named or self._attention(ins):
            kind = KernelClass.ATTENTION
        else:
            kind = KernelClass.MATMUL if flops else KernelClass.MEMORY
        opaque = name if name and not flops and flash_of(name) is None else ""
        opaque = "" if opaque in BOOKKEEPING else opaque
        if flash_of(name) is not None:  # its blocks run at the kernel's own rate
            shape, dtype = (0, 0, 0, 0), self._flash_dtype(comp, ins)
        call = ins.target if ins.target.startswith("__cudnn$") else name
        cycles = estimated_cycles(ins)
        self._doubt(ins, inside, cycles)
        moved, waits = moved_by_index(self.mod, inside), self._hbm_waits(comp, ins)
        read, written = self._traffic(comp, ins, _hbm_held)
        kernel = Kernel(
            kind,
            flops,
            max(read + written, moved),
            *shape,
            dtype if flops else "",
            opaque,
            call,
            ins.name,
            cycles,
            _printed_opcode(ins.op),
            ins.printed,
            ins.op_name,
            self._unfused_update(comp, ins) is not None,
            grouped and bool(flops),
            moved,
            waits,
            bool(flops) and _fused_update(self._operands(comp, ins), ins, shape),
            sum(self._traffic(comp, ins, _on_chip_held)),
            bool(read) and not moved and written * READS_ONLY <= read,
        )
        if kernel.rows_on_chip:  # its rows move there too, however the arrays count
            return kernel._replace(on_chip=max(kernel.on_chip, moved))
        return kernel

    def _operands(self, comp: str, ins: Instr) -> list[Instr]:
        """The instructions of `comp` that `ins` takes as operands (those it names)."""
        held = self.mod.by_name[comp]
        return [held[o] for o in ins.operands if o in held]

    def _hbm_waits(self, comp: str, ins: Instr) -> int:
        """How often kernel `ins` waits for HBM (`Kernel.hbm_waits`): once where it
        reads a value its layout leaves there, once where it writes one; a constant
        operand is the instruction's own."""
        given = [g for g in self._operands(comp, ins) if g.op != Op.kConstant]
        read = any(_in_hbm(a) for g in given for a in g.arrays)
        return int(read) + int(any(_in_hbm(a) for a in ins.arrays))

    def _scalar(self, comp: str, ins: Instr) -> bool:
        """Whether `ins` is one op (no fusion, library call or collective) that reads
        and writes only scalars: a TPU's scalar unit runs it inline, which no profile
        shows as a kernel (new in 0.8: 0.7 timed each at a kernel's launch)."""
        if ins.op in (Op.kFusion, Op.kCustomCall) or ins.op in SYNC or ins.callees:
            return False
        arrays = [a for g in self._operands(comp, ins) for a in g.arrays] + list(ins.arrays)
        return bool(arrays) and not any(a.dims for a in arrays)

    def _doubt(self, ins: Instr, inside: list[tuple[str, Instr]], cycles: int) -> None:
        """Keeps a `Doubt` of kernel `ins` where libtpu cannot estimate it (`cycles`),
        or where it reduces a non-minor dimension of an array of `LARGE_REDUCTION`
        bytes or more (its largest such reduction said either way); `inside`, the
        instructions it runs."""
        found = self._reduction(inside)
        large = found is not None and found[1].arrays[0].bytes >= LARGE_REDUCTION
        if cycles != UNESTIMABLE and not large:
            return
        if found is None:
            self.doubts.append(Doubt(ins.name, ins.printed, ins.op_name, cycles))
            return
        reduction, operand = found
        self.doubts.append(
            Doubt(
                ins.name,
                operand.printed,
                reduction.op_name or ins.op_name,
                cycles,
                reduced(reduction),
                operand.minor or 0,
                operand.arrays[0].bytes,
            )
        )

    def _reduction(self, inside: list[tuple[str, Instr]]) -> tuple[Instr, Instr] | None:
        """The largest reduction among the instructions a kernel runs (`inside`) over
        dimensions without its operand's minor-most, with that operand; None where
        it runs none."""
        found: list[tuple[Instr, Instr]] = []
        for where, each in inside:
            operand = self.mod.by_name[where].get(each.operands[0]) if each.operands else None
            dims = reduced(each)
            if operand is None or not operand.arrays or operand.minor is None or not dims:
                continue
            if operand.minor not in dims:
                found.append((each, operand))
        return max(found, key=lambda pair: pair[1].arrays[0].bytes, default=None)

    def _unfused_update(self, comp: str, ins: Instr) -> Array | None:
        """The update of a dynamic-update-slice kernel `ins` (`Kernel.unfused_update`)
        that writes it at an offset not a constant into one of the two dimensions
        its tiled layout makes minor; None for any other instruction.

        On a TPU v5e, such an update of f32[8,8,512,128] into f32[8,8,2048,128] ran
        at about a quarter of the bandwidth (179 us for its 33.5 MB read and written)
        where a fused one, or one at a constant offset, ran at the memory's rate
        (benchmarks/chip-2026-12-06/update.json); one whose buffer libtpu kept in
        the chip's own memory (``S(1)``) ran as slowly as the others in a blocked
        attention's step, so it is one whichever memory holds it."""
        if ins.op != Op.kDynamicUpdateSlice or len(ins.operands) < 3 or not ins.arrays:
            return None
        scope = self.mod.by_name[comp]
        update = scope.get(ins.operands[1])
        result = ins.arrays[0]
        if update is None or not update.arrays or not result.tiled:
            return None
        for dim in ins.layout[:2]:
            index = scope.get(ins.operands[2 + dim]) if 2 + dim < len(ins.operands) else None
            smaller = update.arrays[0].dims[dim] < result.dims[dim]
            if smaller and index is not None and index.op != Op.kConstant:
                return update.arrays[0]
        return None

    def _flash_dtype(self, comp: str, ins: Instr) -> str:
        """A flash kernel's queries' element type: its first floating-point operand's."""
        for name in ins.operands:
            given = self.mod.by_name[comp].get(name)
            if given is not None and given.arrays and given.arrays[0].dtype[:1] in "bf":
                return given.arrays[0].dtype
        return ""

    def _attention(self, ins: Instr) -> bool:
        """Whether an instruction, or one it fuses, is named in an attention scope."""
        if _attention_named(ins):
            return True
        inner = self.mod.comps.get(dict(ins.callees).get("calls", ""), [])
        return ins.op == Op.kFusion and any(_attention_named(i) for i in inner)

    def _inside_kernel(self, comp: str, ins: Instr) -> list[tuple[str, Instr]]:
        """The instructions a kernel runs, each with its computation: itself, or
        those of the fusion it calls (nested fusions' too)."""
        if ins.op != Op.kFusion:
            return [(comp, ins)]
        found, todo = [], [dict(ins.callees).get("calls", "")]
        while todo:
            inner = todo.pop()
            for each in self.mod.comps.get(inner, []):
                found.append((inner, each))
                todo += [c for r, c in each.callees if r == "calls"]
        return found

    def _traffic(self, comp: str, ins: Instr, counted: Counted) -> tuple[int, int]:
        """What a kernel reads and what it writes in one memory (`counted`:
        `_hbm_held` or, new in 0.8, `_on_chip_held`): its operands (a sliced one as
        its slice, an updated one in place as nothing) and its result (an in-place
        update as the update; a library call's workspace left out); a hand-written
        kernel's HBM bytes as its cost estimate gives them, where it has one, all
        counted as written (its own split is not given)."""
        if ins.op == Op.kFusion:
            return _fusion_traffic(self.mod, comp, ins, counted)
        estimate = kernel_estimate(ins)
        if estimate is not None and estimate[1]:  # a hand-written kernel's own figure
            return 0, estimate[1] if counted is _hbm_held else 0
        given = self._operands(comp, ins)
        if ins.op in _SLICING:  # the slice read and written, counted as HBM's
            return (ins.tiled_bytes,) * 2 if counted is _hbm_held else (0, 0)
        unfused = self._unfused_update(comp, ins)
        if unfused is not None:  # its update read and written, on the chip or not
            return (unfused.tiled_bytes,) * 2 if counted is _hbm_held else (0, 0)
        if ins.op == Op.kDynamicUpdateSlice and len(given) > 1:  # the update read, then
            update = given[1]  # written in place
            return _held(update, counted), _update_written(ins, update, counted)
        if ins.op == Op.kScatter:  # its indices and updates read, its rows written in place
            held = self.mod.by_name[comp]
            rest = ins.operands[_tables(ins) :]
            read = sum(_held(held[o], counted) for o in rest if o in held)
            return read, _rows_written(self.mod, comp, ins, counted)
        return sum(_held(g, counted) for g in given), _result_bytes(ins, counted)


def _fused_update(given: Sequence[Instr], ins: Instr, shape: tuple[int, int, int, int]) -> bool:
    """Whether matmul kernel `ins`, its largest product of `shape` (batch, m, n, k),
    reads (`given`: its operands) and writes two or more arrays each of that
    product's size: an optimizer's state updated with it (`Kernel.fused_update`; a
    forward kernel that writes its product twice, before and after an activation,
    reads none such)."""
    batch, m, n, _ = shape
    size = (batch or 1) * m * n
    read = sum(g.arrays[0].elements == size for g in given if g.arrays)
    written = sum(a.elements == size for a in ins.arrays)
    return ins.op == Op.kFusion and read >= 2 and written >= 2


def _in_hbm(array: Array) -> bool:
    """Whether a value's layout leaves it in HBM, the memory space a layout that
    names none is in (new in 0.8: a scalar there too, which a TPU v5e's kernel
    waited for as for an array)."""
    return array.space == HBM


def _printed_opcode(op: Op) -> str:
    """An opcode as HLO prints it: ``kDynamicUpdateSlice`` as ``dynamic-update-slice``.

    Example:
        >>> _printed_opcode(Op.kDynamicUpdateSlice), _printed_opcode(Op.kFusion)
        ('dynamic-update-slice', 'fusion')
    """
    camel = op.name.removeprefix("k")
    return "".join(f"-{c.lower()}" if c.isupper() else c for c in camel).lstrip("-")


#: libtpu's own kernels that compute no FLOPs by design: a ragged dot's group offsets
#: (new in 0.8), not a hand-written kernel whose cost estimate is missing.
BOOKKEEPING = frozenset({"ragged-dot-metadata"})


def moved_by_index(mod: Module, inside: list[tuple[str, Instr]]) -> int:
    """The bytes a kernel's gathers and scatters move (new in 0.8): a gather reads the
    rows it picks and writes them (twice its result), a scatter reads each update and
    writes the row it lands on, reading that row first where it combines (an add:
    three times its updates; a set: twice), wherever the compiler keeps them (a
    TPU's on-chip memory too: 0.7 priced a TPU's expert dispatch and combine at 0 when
    their rows sat there). 0 for a kernel that does neither.

    The rows are counted at their own bytes, not as a layout's tiles hold them: a
    fusion's updates are values it computes, whose layout inside it no memory holds
    (libtpu lays a combine's updates out as ``f32[4,1023,2,1024]{2,3,1,0:T(2,128)}``,
    2 of 128 lanes minor-most: its tiles 64 times its rows; the scatter ran at its
    rows' time on a v5e)."""
    moved = 0
    for where, each in inside:
        if each.op == Op.kGather:
            moved += 2 * each.bytes
        elif each.op == Op.kScatter and len(each.operands) >= 3:
            moved += (3 if _combines(mod, each) else 2) * _updates(mod, where, each)
    return moved


def _tables(scatter: Instr) -> int:
    """How many tables a scatter takes: its operands are its tables, its indices,
    then as many updates."""
    return (len(scatter.operands) - 1) // 2


def _updates(mod: Module, comp: str, scatter: Instr) -> int:
    """The bytes of a scatter's updates, at their own size (`moved_by_index`)."""
    given = [mod.by_name[comp].get(u) for u in scatter.operands[_tables(scatter) + 1 :]]
    return sum(u.bytes for u in given if u is not None)


def _combines(mod: Module, scatter: Instr) -> bool:
    """Whether a scatter combines each update with the row it lands on (its
    computation reads both: an add), rather than setting it (returns the update)."""
    combiner = dict(scatter.callees).get("to_apply", "")
    root = mod.root(combiner)
    return root is None or root.op != Op.kParameter


def _dots(ins: Instr, inside: list[tuple[str, Instr]]) -> list[tuple[str, Instr]]:
    """Of the instructions kernel `ins` runs (`inside`), those with FLOPs: itself, or
    the dots, convolutions and library calls of the fusion it calls."""
    computes = (Op.kDot, Op.kConvolution, Op.kCustomCall)
    return [(where, each) for where, each in inside if ins.op != Op.kFusion or each.op in computes]


#: Which of an array's bytes one memory holds: HBM's (`Array.hbm_bytes`), or the
#: chip's own memory's (`Array.on_chip_bytes`, ``S(1)``; new in 0.8).
Counted = Callable[[Array], int]


def _hbm_held(array: Array) -> int:
    """Its bytes in HBM (`Array.hbm_bytes`)."""
    return array.hbm_bytes


def _on_chip_held(array: Array) -> int:
    """Its bytes in the chip's own memory (`Array.on_chip_bytes`)."""
    return array.on_chip_bytes


def _held(ins: Instr, counted: Counted) -> int:
    """The bytes of an instruction's result that the memory `counted` holds."""
    return sum(counted(array) for array in ins.arrays)


def _result_bytes(ins: Instr, counted: Counted) -> int:
    """The bytes an instruction's result writes into the memory `counted` (HBM's,
    the chip's own); a library call's workspace (a cuBLAS call's second result, 32
    MiB of s8 on jax 0.12) left out (a hand-written kernel's results are all its
    own)."""
    result = ins.arrays
    if ins.op == Op.kCustomCall and ins.is_tuple and result and not is_kernel_call(ins):
        result = result[:1]
    return sum(counted(array) for array in result)


def _operand_dtype(mod: Module, comp: str, ins: Instr) -> str:
    """A matmul's first operand's element type, ``/highest`` added at the highest
    precision."""
    given = mod.by_name[comp].get(ins.operands[0]) if ins.operands else None
    arrays = given.arrays if given is not None else ()
    dtype = arrays[0].dtype if arrays else ""
    return dtype + "/highest" if _highest(ins) else dtype


def _highest(ins: Instr) -> bool:
    """Whether a matmul runs an operand at the highest precision (a dot's attribute,
    or a library call's precision config)."""
    listed = config_field(ins.config, "operand_precision")
    configured = listed if isinstance(listed, list) else []
    return any(str(p).lower() == "highest" for p in (*ins.precision, *configured))


def _attention_named(ins: Instr) -> bool:
    """Whether an instruction's name scope says attention (``attention``, ``attn``),
    or a hand-written kernel's name does (``flash_attention``, ``flash_mha_bwd_dq``)."""
    name = ins.op_name.lower()
    if is_kernel_call(ins):
        name += " " + ins.name.lower()
    return any(word in name for word in ("attention", "attn", "mha"))


def _gemm_shape(mod: Module, comp: str, ins: Instr, flops: int) -> tuple[int, int, int, int]:
    """A matmul's (batch, m, n, k): from a dot's dimension numbers or a cuBLAS call's
    backend config; a convolution's as its output positions x features (the output
    dimension its ``dim_labels`` call ``f``: libtpu writes every dot so, its
    features not always last) x the rest."""
    types = [mod.by_name[comp][o] for o in ins.operands[:2] if o in mod.by_name[comp]]
    numbers = _dimension_numbers(ins)
    if numbers is None or len(types) < 2:
        out = ins.dims
        out_labels = ins.labels[2] if ins.labels is not None else ""
        if len(out_labels) == len(out) and "f" in out_labels:
            n = out[out_labels.index("f")]
        else:
            n = out[-1] if out else 1
        m = max(math.prod(out) // max(n, 1), 1)
        return 1, m, n, max(flops // (2 * m * n), 1)
    lhs, rhs = types[0].dims, types[1].dims
    (lb, lc), (rb, rc) = numbers
    if any(d >= len(lhs) for d in lb + lc) or any(d >= len(rhs) for d in rb + rc):
        return 0, 0, 0, 0
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lb + lc)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rb + rc)
    return batch, m, n, k


def _dimension_numbers(ins: Instr) -> tuple[tuple[list[int], list[int]], ...] | None:
    """((lhs batch, lhs contracting), (rhs batch, rhs contracting)) of a dot or a
    cuBLAS call; None for anything else."""
    if ins.op == Op.kDot:
        dot = ins.dot
        lhs = (list(dot.lhs_batch), list(dot.lhs_contracting))
        return lhs, (list(dot.rhs_batch), list(dot.rhs_contracting))
    config = ins.config.get("gemm_backend_config", {})
    dims = config.get("dot_dimension_numbers")
    if ins.op != Op.kCustomCall or not dims:
        return None
    return tuple(
        (
            [int(d) for d in dims.get(f"{side}_batch_dimensions", [])],
            [int(d) for d in dims.get(f"{side}_contracting_dimensions", [])],
        )
        for side in ("lhs", "rhs")
    )


def _fusion_traffic(mod: Module, comp: str, ins: Instr, counted: Counted) -> tuple[int, int]:
    """What a fusion reads and writes in the memory `counted`: each operand there as
    its fused parameter is read (`_read`), twice where it reads it again after a
    reduction broadcast back (`_read_again`), and its result as written (`_written`)."""
    callee = dict(ins.callees).get("calls", "")
    again = _read_again(mod, callee)
    read = 0
    for j, operand in enumerate(ins.operands):
        given = mod.by_name[comp].get(operand)
        whole = _held(given, counted) if given is not None else 0  # held elsewhere: none
        param = mod.param(callee, j)
        read += whole if param is None else _read(mod, callee, param, whole)
        read += whole if param in again else 0
    root = mod.root(callee)
    if root is not None:
        return read, _written(mod, callee, root, counted)
    return read, ins.tiled_bytes if counted is _hbm_held else 0


def _read_again(mod: Module, comp: str) -> set[str]:
    """The parameters fused computation `comp` reads twice: once for a reduce-window
    whose window spans a whole dimension (a reduction broadcast back: libtpu writes a
    softmax's maximum over a non-minor dimension so), and again for the ops that use
    the window's result beside them, which cannot start before the whole window is
    read (new in 0.8: on a TPU v5e a softmax's fusion of f32[8,8,2048,2048] so ran
    in the time of three passes over it, where one read and one write were counted)."""
    body = mod.comps.get(comp, [])
    windows = [i for i in body if i.op == Op.kReduceWindow and _spans(mod, comp, i)]
    if not windows:
        return set()
    sources: dict[str, frozenset[str]] = {}  # the parameters each value is computed from
    for ins in body:
        own = frozenset([ins.name]) if ins.op == Op.kParameter else frozenset()
        sources[ins.name] = own.union(*(sources.get(o, frozenset()) for o in ins.operands))
    again: set[str] = set()
    for window in windows:
        after = {window.name}
        for ins in body:
            if any(o in after for o in ins.operands):
                after.add(ins.name)
                beside = (sources.get(o, frozenset()) for o in ins.operands if o not in after)
                again.update(*(params & sources[window.name] for params in beside))
    return again


def _spans(mod: Module, comp: str, window: Instr) -> bool:
    """Whether a reduce-window's window covers the whole of one of its operand's
    dimensions."""
    operand = mod.by_name[comp].get(window.operands[0]) if window.operands else None
    sizes = window.window.get("size", ())
    if operand is None or len(sizes) != len(operand.dims):
        return False
    return any(size > 1 and size >= dim for size, dim in zip(sizes, operand.dims, strict=True))


def _read(mod: Module, comp: str, name: str, whole: int) -> int:
    """The bytes of value `name` that its users read: the slices of it that slicing
    users take; nothing where it is the buffer an in-place update writes into, the
    operand of a collective fused into the kernel (libtpu's async collective
    fusions: the collective's traffic, timed on the links) or passed straight to the
    result (a buffer the fusion carries in place); what a nested fusion reads of
    it, and no more of an elementwise one than the slices its result is read as;
    else the whole. Bitcasts are followed; a value that is its computation's result
    (a nested fusion that only bitcasts its operand: libtpu wraps a matmul's
    operands so) is read whole, as far as its own users read it (new in 0.8: 0.7
    counted none of it, and a v5e's matmul of bf16[32768,4096] by bf16[4096,32] read
    nothing of its 268 MB)."""
    root = mod.root(comp)
    total = whole if root is not None and root.name == name else 0
    for user, j in mod.users[comp].get(name, []):
        if user.op == Op.kBitcast:
            total += _read(mod, comp, user.name, whole)
        elif user.op in _SLICING and j == 0:
            total += user.tiled_bytes
        elif _untouched(mod, comp, user, j):
            continue
        elif user.op == Op.kFusion:
            total += _nested_read(mod, comp, user, j, whole)
        else:
            return whole
    return min(total, whole)


def _untouched(mod: Module, comp: str, user: Instr, j: int) -> bool:
    """Whether a fusion's kernel leaves alone the value `user` takes as operand `j`:
    the buffer an in-place update writes into, the table a scatter the fusion returns
    updates in place, a fused collective's operand, a buffer passed straight to the
    result (carried in place)."""
    if user.op == Op.kDynamicUpdateSlice and j == 0:
        return True
    if user.op == Op.kScatter and j < _tables(user):  # one of its tables
        return _in_place(mod, comp, user) and _at_root(mod, comp, user)
    if user.op in SYNC:
        return True
    return user.op == Op.kTuple and user.root


def _nested_read(mod: Module, comp: str, user: Instr, j: int, whole: int) -> int:
    """What fusion `user`, nested in a fusion, reads of its operand `j` (of `whole`
    bytes): what its own computation reads of that parameter, and, where its result
    has as many elements as the operand (a copy, a layout change, an elementwise
    map), no more than the share of its result that its users read."""
    callee = dict(user.callees).get("calls", "")
    param = mod.param(callee, j)
    inner = whole if param is None else _read(mod, callee, param, whole)
    operand = mod.by_name[comp].get(user.operands[j])
    if operand is None or not user.tiled_bytes or _elements(user) != _elements(operand):
        return inner
    demanded = _read(mod, comp, user.name, user.tiled_bytes)
    return min(inner, whole * demanded // user.tiled_bytes)


def _elements(ins: Instr) -> int:
    """The elements of an instruction's result (a tuple's summed)."""
    return sum(a.elements for a in ins.arrays)


#: A kernel that writes to HBM at most 1/READS_ONLY of what it reads there (a
#: reduction's result, a scalar) reads only (`Kernel.reads_only`; new in 0.8).
READS_ONLY = 100


def _written(mod: Module, comp: str, root: Instr, counted: Counted) -> int:
    """The bytes a fusion's result writes into the memory `counted`: a tuple's
    elements each; an in-place update as its update; nothing for a parameter passed
    through (a buffer carried in place) or a fused collective's result (written by
    the collective, timed on the links); a bitcast of anything else into the memory
    its own layout names (new in 0.8: libtpu bitcasts a slice in HBM into ``S(1)``,
    and a scanned ViT's layer was priced at twice its HBM traffic)."""
    if root.op == Op.kTuple:
        parts = [mod.by_name[comp][o] for o in root.operands if o in mod.by_name[comp]]
        return sum(_written(mod, comp, part, counted) for part in parts)
    if root.op == Op.kParameter or root.op in SYNC:
        return 0
    if root.op == Op.kBitcast:
        inner = _below_bitcasts(mod, comp, root)
        if _carried(mod, comp, inner):  # written as what it bitcasts, where the root says
            return _written(mod, comp, inner, counted) if _held(root, counted) else 0
        return _result_bytes(root, counted)  # in the bitcast's memory, not its operand's
    if root.op == Op.kDynamicUpdateSlice and len(root.operands) > 1:
        update = mod.by_name[comp].get(root.operands[1])
        return _update_written(root, update, counted) if update is not None else 0
    if root.op == Op.kScatter and _in_place(mod, comp, root):
        return _rows_written(mod, comp, root, counted)
    return _result_bytes(root, counted)


def _below_bitcasts(mod: Module, comp: str, ins: Instr) -> Instr:
    """The first value under `ins` (itself included) that is not a bitcast."""
    held = mod.by_name[comp]
    while ins.op == Op.kBitcast and ins.operands and ins.operands[0] in held:
        ins = held[ins.operands[0]]
    return ins


def _carried(mod: Module, comp: str, ins: Instr) -> bool:
    """Whether a fusion's result, where it is `ins`, is written as `_written` says of
    `ins` itself, not as an array of its own: a buffer carried through, a fused
    collective's result, an in-place update or scatter, a tuple of them."""
    if ins.op in (Op.kParameter, Op.kDynamicUpdateSlice, Op.kTuple) or ins.op in SYNC:
        return True
    return ins.op == Op.kScatter and _in_place(mod, comp, ins)


def _in_place(mod: Module, comp: str, scatter: Instr) -> bool:
    """Whether a scatter writes into the buffers it was given (its tables are its
    computation's parameters, bitcast or not: a fused kernel's operands), not into
    tables it computes (a fused broadcast of zeros, which it writes whole first)."""
    found = [mod.by_name[comp].get(t) for t in scatter.operands[: _tables(scatter)]]
    return all(t is not None and _below_bitcasts(mod, comp, t).op == Op.kParameter for t in found)


def _at_root(mod: Module, comp: str, ins: Instr) -> bool:
    """Whether `ins` is what its computation returns: its root, or an element or a
    bitcast of it, and used by nothing else."""
    if ins.root:
        return True
    users = mod.users[comp].get(ins.name, [])
    return bool(users) and all(
        (user.op == Op.kTuple and user.root)
        or (user.op == Op.kBitcast and _at_root(mod, comp, user))
        for user, _ in users
    )


def _rows_written(mod: Module, comp: str, scatter: Instr, counted: Counted) -> int:
    """The bytes a scatter into its tables in place moves there, where the memory
    `counted` holds them (new in 0.8): the rows its updates land on, read first
    where it combines (`_combines`: an add), at their own bytes as `moved_by_index`
    counts them (on a TPU v5e flax.nnx Gemma's embedding gradient, 2,048 rows added
    into bf16[262144,1152], ran in 0.3 ms, where 0.7 counted the table read and
    written whole, 1.85 ms)."""
    if not scatter.arrays or not counted(scatter.arrays[0]):
        return 0
    return (2 if _combines(mod, scatter) else 1) * _updates(mod, comp, scatter)


def _update_written(update_slice: Instr, update: Instr, counted: Counted) -> int:
    """The bytes an in-place update writes into the memory `counted`: its update's,
    where that memory holds the buffer it writes into (its result's memory space),
    wherever the update was read from."""
    there = bool(update_slice.arrays) and counted(update_slice.arrays[0]) > 0
    # nothing into a buffer held elsewhere: a fused library call (jax 0.12's dynamic-slice fusion)
    return update.tiled_bytes if there else 0


def read_schedule(
    module: Any,
    shape: Sequence[tuple[str, int]] = (),
    *,
    platform: str,
    slice_size: int | None = None,
) -> Schedule:
    """The `Schedule` of a compiled module (jaxlib's ``HloModule``, its text, or an
    `instructions.Module`): its entry computation's events in the order the device
    runs them. `shape` is the mesh's ``(axis, size)`` pairs (the partition ids are
    positions in its row-major device order), which name each collective's axes;
    `platform` the compiler's (``"cpu"``, ``"cuda"``, ``"tpu"``); `slice_size` a
    multi-slice TPU job's chips per slice.

    A computation is walked once however often it runs: a ``while`` body is a
    `Loop` of its trip count (where the compiler does not say it, read from the
    loop as libtpu leaves it, else 1 and flagged); a conditional's branches a
    `Branches`. An async pair is one collective, its result the done's. On
    ``"cpu"``, an all-reduce whose every use takes one device's slice of it (by
    its partition id), and whose slice times its group is the whole, is the
    reduce-scatter an accelerator runs, and a collective of values the CPU widened
    (bf16 in f32) is at their own width. A multi-slice TPU job's transfers across
    slices (the megascale runtime's ``send``s) are the collectives they are part
    of, over the devices at the same place in each slice. libtpu's forms are what
    they move, each row saying the form (`Collective.written_as`): its
    all-reduce-scatter fusion as a reduce-scatter of its operand to the shard; an
    all-gather written as an all-reduce of zero-filled buffers as that all-reduce.

    Example:
        An all-gather started before a matmul and done after it:

        >>> text = '''HloModule m, is_scheduled=true
        ... ENTRY %main (a: bf16[1024,1024], b: bf16[128,1024]) -> (bf16[1024,1024], bf16[1024,1024]) {
        ...   %a = bf16[1024,1024] parameter(0)
        ...   %b = bf16[128,1024] parameter(1)
        ...   %ags = (bf16[128,1024], bf16[1024,1024]) all-gather-start(%b), replica_groups=[1,8]<=[8], dimensions={0}
        ...   %d = bf16[1024,1024] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ...   %agd = bf16[1024,1024] all-gather-done(%ags)
        ...   ROOT %t = (bf16[1024,1024], bf16[1024,1024]) tuple(%d, %agd)
        ... }'''
        >>> schedule = read_schedule(text, (("data", 8),), platform="cuda")
        >>> [type(e).__name__ for e in schedule.events]
        ['Start', 'Kernel', 'Done']
        >>> schedule.events[0].row
        Collective(kind='all-gather', count=1, bytes=2097152, axes=('data',), group=8, written_as='')
        >>> schedule.events[1]
        Kernel(kind='matmul', flops=2147483648, bytes=6291456, batch=1, m=1024, n=1024, k=1024, dtype='bf16', opaque='', call='', name='d', estimated_cycles=0, opcode='dot', shape='bf16[1024,1024]{1,0}', op_name='', unfused_update=False, grouped=False, indexed=0, hbm_waits=2, fused_update=False, on_chip=0, reads_only=False)
        >>> Schedule.from_dict(schedule.to_dict()) == schedule
        True
    """
    mod = Module.of(module)
    if mod.entry is None:
        return Schedule((), platform)
    walker = _Walker(mod, shape, Backend.of(platform), slice_size)
    events = walker.events(mod.entry)
    flags = (
        *(
            ("a loop whose trip count the compiler does not know: timed once",)
            if walker.unknown
            else ()
        ),
        *walker.doubts,
    )
    most = held(mod, walker.scattered, mod.entry) if walker.scattered else 0
    return Schedule(events, platform, flags, most, len(walker.scattered), len(walker.widened))
