"""Reading a compiled step: what it moves, as an accelerator runs it, and what it computes.

The reading that sums the rooms below it over a compiled module: its
instructions parsed once (`instructions`), each opcode's rule (`opcodes`:
the collective it is, the FLOPs of a dot, a convolution, a library call),
replica groups named as mesh axes (`groups`), how often each computation
runs (`loops`: a loop's trip count; a conditional's costlier branch here),
and the compilers' own forms (`forms`: the CPU's sliced reductions and
widened values, libtpu's fusions). From them, one `Collective` row per kind
and set of mesh axes, with the bytes each device sends by the ring
algorithm, and the step's FLOPs, per executed step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from spmdtree._src.step.hlo.forms import Written
from spmdtree._src.step.hlo.opcodes import Kept, flash_of
from spmdtree._src.step.hlo.schedule import (
    KINDS,
    Branches,
    Collective,
    Doubt,
    Event,
    Kernel,
    Loop,
    Schedule,
    Start,
    flag_from,
    flag_json,
    read_schedule,
)
from spmdtree._src.step.kinds import CollectiveKind


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a compiled step's HLO says, per device per step.

    Attributes:
        collectives: one `Collective` per kind and set of mesh axes.
        flags: sentences on what the figures do not cover, or read differently
            from the HLO as written; the kernels whose time the model may miss by
            far (`schedule.Doubt`s, new in 0.7).
        flops: 2 x result elements x contracted size of every dot,
            convolution and matmul library call, times how often it runs.
        held_bytes: whole sizes of the all-reduces read as reduce-scatters
            that are live at once (CPU only; 0 elsewhere).
    """

    collectives: tuple[Collective, ...] = ()
    flags: tuple[str, ...] = ()
    flops: int = 0
    held_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The reading as plain JSON values (what crosses a process boundary)."""
        return {
            "collectives": [list(row) for row in self.collectives],
            "flags": [flag_json(flag) for flag in self.flags],
            "flops": self.flops,
            "held_bytes": self.held_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Reading:
        """The reading `to_dict` gave."""
        return cls(
            collectives=tuple(
                Collective(
                    CollectiveKind(kind), n, size, tuple(axes), group, cast(Written, written)
                )
                for kind, n, size, axes, group, written in data["collectives"]
            ),
            flags=tuple(flag_from(flag) for flag in data["flags"]),
            flops=int(data["flops"]),
            held_bytes=int(data["held_bytes"]),
        )


# --- the reading: a fold of the schedule ----------------------------------------------

#: A row: its kind, mesh axes, group size and the form it was written in.
Key = tuple[CollectiveKind, tuple[str, ...], int, Written]


@dataclasses.dataclass(frozen=True)
class Tally:
    """What some events do, per run: flops, collective rows ``(kind, axes, group,
    written_as) -> (count, bytes)``, the kinds inside loops of unknown trip count,
    rows over groups that are not whole axes, the hand-written kernels with no
    cost estimate, and the flash kernels whose masks the traced step says (by
    name)."""

    flops: int = 0
    rows: Mapping[Key, tuple[int, int]] = dataclasses.field(default_factory=dict)
    unknown: frozenset[str] = frozenset()
    partial: frozenset[Key] = frozenset()
    opaque: frozenset[str] = frozenset()
    dense: frozenset[str] = frozenset()

    def __add__(self, other: Tally) -> Tally:
        rows = dict(self.rows)
        for key, (n, size) in other.rows.items():
            was = rows.get(key, (0, 0))
            rows[key] = (was[0] + n, was[1] + size)
        return Tally(
            self.flops + other.flops,
            rows,
            self.unknown | other.unknown,
            self.partial | other.partial,
            self.opaque | other.opaque,
            self.dense | other.dense,
        )

    def times(self, n: int) -> Tally:
        rows = {key: (count * n, size * n) for key, (count, size) in self.rows.items()}
        return dataclasses.replace(self, flops=self.flops * n, rows=rows)

    @property
    def cost(self) -> tuple[int, int]:
        """What a branch costs, to choose the costlier: its flops, then its bytes."""
        return self.flops, sum(size for _, size in self.rows.values())


def tally(events: Sequence[Event]) -> Tally:
    """What `events` run, summed: a loop's body times its trips (once where they are
    unknown, its kinds noted), a conditional's costlier branch."""
    total = Tally()
    for event in events:
        total = total + _tally(event)
    return total


def _tally(event: Event) -> Tally:
    if isinstance(event, Kernel):
        flash = flash_of(event.call) if event.flops else None
        dense = [event.call] if flash is not None and flash.mask != "module" else []
        opaque = [event.opaque] if event.opaque else []
        return Tally(flops=event.flops, opaque=frozenset(opaque), dense=frozenset(dense))
    if isinstance(event, Start):
        row = event.row
        key: Key = (row.kind, row.axes, row.group, row.written_as)
        return Tally(
            rows={key: (row.count, row.bytes)}, partial=frozenset([key] if event.partial else [])
        )
    if isinstance(event, Loop):
        inner = tally(event.body)
        if not event.known:
            return dataclasses.replace(inner, unknown=inner.unknown | {k for k, *_ in inner.rows})
        return inner.times(event.trips)
    if isinstance(event, Branches):
        return max(
            (tally(branch) for branch in event.branches), key=lambda t: t.cost, default=Tally()
        )
    return Tally()


def reading_of(schedule: Schedule, masks: Mapping[str, Kept] | None = None) -> Reading:
    """The `Reading` of a compiled step: a fold of its `Schedule` (the one walk of its
    module), so that the reading and the prediction see the same step (new in 0.6).
    `masks`: what the traced step says of its flash kernels' masks, by kernel name
    (`Schedule.masked` counts their FLOPs so); a kernel whose mask it does not read
    is flagged as counted over every block, with why (new in 0.7).

    Example:
        >>> from spmdtree._src.step.hlo.schedule import Done, Kernel, Loop
        >>> row = Collective("all-reduce", 1, 1024, ("fsdp",), 4)
        >>> events = (Loop(6, (Kernel("matmul", 8192, 2048), Start(0, row, True), Done(0))),)
        >>> read = reading_of(Schedule(events, "tpu"))
        >>> read.flops, read.collectives
        (49152, (Collective(kind='all-reduce', count=6, bytes=6144, axes=('fsdp',), group=4, written_as=''),))
    """
    total = tally(schedule.events)
    order = sorted(total.rows, key=lambda k: (KINDS.index(k[0]), *k[1:]))
    found = tuple(Collective(k, *total.rows[(k, a, g, w)], a, g, w) for k, a, g, w in order)
    flags = [
        *_flags(total.unknown, total.partial, schedule.scattered, schedule.widened),
        *_opaque(total.opaque),
        *_dense(total.dense, masks),
        *(flag for flag in schedule.flags if isinstance(flag, Doubt)),
    ]
    return Reading(found, tuple(flags), total.flops, schedule.held_bytes)


def read_step(
    module: Any,
    shape: Sequence[tuple[str, int]] = (),
    *,
    platform: str,
    slice_size: int | None = None,
) -> Reading:
    """Collectives, flops and the whole gradients held, per executed step, from a
    compiled module (jaxlib's ``HloModule``, its HLO text, or an
    `instructions.Module`, which `read_schedule` can then share).

    A computation runs as often as its callers run it: a ``while`` body once
    per iteration where the trip count is known or read from the loop, else
    once (and flagged); a conditional's costlier branch once. An async pair
    counts once, as its result. `shape` is the mesh's ``(axis, size)`` pairs
    (the partition ids are positions in its row-major device order).
    `platform` is the compiler's (``"cpu"``, ``"cuda"``/``"gpu"``, ``"tpu"``);
    on ``"cpu"``, an all-reduce whose every use takes one device's slice of
    it (by its partition id), and whose slice times its group is the whole,
    is counted as the reduce-scatter an accelerator runs, and a collective of
    values the CPU widened (bf16 in f32) at their own width. On a multi-slice
    TPU job (`slice_size` chips a slice), the transfers across slices (the
    megascale runtime's ``send``s) count as the collectives they are part of,
    over the devices at the same place in each slice. libtpu's forms count as
    what they move, each row saying the form (`Collective.written_as`): its
    all-reduce-scatter fusion (an all-reduce of which each device keeps its
    shard) as a reduce-scatter of its operand to that shard; an all-gather it
    writes as an all-reduce of zero-filled buffers as the all-reduce it runs.

    Example:
        A loop as libtpu leaves it (no ``known_trip_count``): six iterations of a
        (16, 16) matmul and an all-reduce over groups of 4 (the mesh's fsdp axis).

        >>> text = '''HloModule m
        ... %add (p: f32[], q: f32[]) -> f32[] {
        ...   %p = f32[] parameter(0)
        ...   %q = f32[] parameter(1)
        ...   ROOT %r = f32[] add(%p, %q)
        ... }
        ... %body (s: (s32[], f32[16,16])) -> (s32[], f32[16,16]) {
        ...   %s = (s32[], f32[16,16]) parameter(0)
        ...   %i = s32[] get-tuple-element(%s), index=0
        ...   %x = f32[16,16] get-tuple-element(%s), index=1
        ...   %one = s32[] constant(1)
        ...   %next = s32[] add(%i, %one)
        ...   %y = f32[16,16] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ...   %sum = f32[16,16] all-reduce(%y), replica_groups=[2,4]<=[8], to_apply=%add
        ...   ROOT %t = (s32[], f32[16,16]) tuple(%next, %sum)
        ... }
        ... %cond (c: (s32[], f32[16,16])) -> pred[] {
        ...   %c = (s32[], f32[16,16]) parameter(0)
        ...   %j = s32[] get-tuple-element(%c), index=0
        ...   %six = s32[] constant(6)
        ...   ROOT %lt = pred[] compare(%j, %six), direction=LT
        ... }
        ... ENTRY %main (a: f32[16,16]) -> f32[16,16] {
        ...   %a = f32[16,16] parameter(0)
        ...   %zero = s32[] constant(0)
        ...   %init = (s32[], f32[16,16]) tuple(%zero, %a)
        ...   %loop = (s32[], f32[16,16]) while(%init), condition=%cond, body=%body
        ...   ROOT %out = f32[16,16] get-tuple-element(%loop), index=1
        ... }'''
        >>> read = read_step(text, (("data", 2), ("fsdp", 4)), platform="tpu")
        >>> read.flops == 6 * 2 * 16 * 16 * 16
        True
        >>> read.collectives
        (Collective(kind='all-reduce', count=6, bytes=6144, axes=('fsdp',), group=4, written_as=''),)
        >>> Reading.from_dict(read.to_dict()) == read
        True
    """
    schedule = read_schedule(module, shape, platform=platform, slice_size=slice_size)
    return reading_of(schedule)


#: Why a flash kernel's mask was not read, where no traced step was given.
_UNTRACED = (
    "the compiled module does not print the constants its mask is built from (preflight "
    "reads them from the traced step)"
)


def _dense(names: frozenset[str], masks: Mapping[str, Kept] | None) -> Iterator[str]:
    """The sentences for flash kernels counted as if their masks kept every block:
    those whose masks the traced step does not say (`masks`), one per reason.

    Example:
        >>> masks = {"splash_mha_fwd": Kept(36, 64), "splash_mha_dq": Kept(why="its block mask is computed in the step, not a constant")}
        >>> print(*_dense(frozenset(masks), masks))
        flash attention's FLOPs (splash_mha_dq) are counted from its shapes as if its mask kept every block: its block mask is computed in the step, not a constant; a causal mask keeps about half of them, so the step's FLOPs and its attention's predicted time may be up to twice the kernel's
    """
    why: dict[str, list[str]] = {}
    for name in sorted(names):
        kept = Kept(why=_UNTRACED) if masks is None else masks.get(name)
        if kept is None:
            kept = Kept(why="no call of that name was found in the traced step")
        if not kept.read:
            why.setdefault(kept.why, []).append(name)
    for reason, listed in why.items():
        yield (
            f"flash attention's FLOPs ({', '.join(listed)}) are counted from its shapes as if "
            f"its mask kept every block: {reason}; a causal mask keeps about half of them, so "
            "the step's FLOPs and its attention's predicted time may be up to twice the kernel's"
        )


def _opaque(names: frozenset[str]) -> Iterator[str]:
    """The sentence for hand-written kernels whose cost the module does not hold."""
    if not names:
        return
    listed = sorted(names)
    shown = ", ".join(listed[:2]) + (f" and {len(listed) - 2} more" if len(listed) > 2 else "")
    many = len(listed) > 1
    yield (
        f"{len(listed)} hand-written kernel{'s' if many else ''} with no cost estimate "
        f"({shown}): the module holds none of {'their' if many else 'its'} FLOPs, so the "
        f"step's FLOPs leave {'them' if many else 'it'} out and the predicted time counts "
        f"{'their' if many else 'its'} bytes alone (on TPU, pallas_call's cost_estimate= is read "
        "where given; Triton's calls do not keep it)"
    )


def _flags(
    unknown: frozenset[str], partial: frozenset[Key], scattered: int, widened: int
) -> Iterator[str]:
    """The sentences a reading's figures need: loops of unknown trip count, groups
    that are not whole axes, and the CPU forms read as an accelerator runs them."""
    for kind in KINDS:
        if kind in unknown:
            yield (
                f"{kind} inside a loop whose trip count the compiler does not know: "
                "counted once per step"
            )
    for name, axes, group in sorted({key[:3] for key in partial}):
        yield (
            f"{name} over groups of {group} devices that are not whole mesh axes "
            f"(part of {', '.join(axes) or 'no axis'}): the compiler runs it over part of "
            "the axis, most often to move a value between two layouts; it is timed over "
            "the links those groups span, and needs no change unless it is among the "
            "largest collectives (StepPlan.collectives)"
        )
    if scattered:
        yield (
            f"{scattered} all-reduce{'s' if scattered > 1 else ''} whose every use takes one "
            "device's slice (the CPU compiler's form of a reduce-scatter) counted as the "
            "reduce-scatter an accelerator runs"
        )
    if widened:
        yield (
            f"{widened} collective{'s' if widened > 1 else ''} of values the CPU compiler "
            "widens to a wider float than the program's (bf16 in f32) counted at the "
            "program's width"
        )
