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
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

from spmdtree._src.step.forms import Flow, Written, fused_scatter, held, parts
from spmdtree._src.step.groups import collective_axes, group_axes
from spmdtree._src.step.instructions import Instr, Module, Op
from spmdtree._src.step.loops import trip_count
from spmdtree._src.step.opcodes import DONES, KIND, flops, is_kernel_call, kernel_estimate

#: The collectives counted, in the order rows are listed.
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

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

    kind: str
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
        g = self.group
        if self.kind == "collective-permute":
            return self.bytes
        if self.kind == "reduce-scatter":
            return (g - 1) * self.bytes
        if self.kind == "all-reduce":
            return 2 * (g - 1) * self.bytes // g
        return (g - 1) * self.bytes // g


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a compiled step's HLO says, per device per step.

    Attributes:
        collectives: one `Collective` per kind and set of mesh axes.
        flags: sentences on what the figures do not cover, or read differently
            from the HLO as written.
        flops: 2 x result elements x contracted size of every dot,
            convolution and matmul library call, times how often it runs.
        held_bytes: whole sizes of the all-reduces read as reduce-scatters
            that are live at once (CPU only; 0 elsewhere).
    """

    collectives: tuple[Collective, ...] = ()
    flags: tuple[str, ...] = ()
    flops: int = 0
    held_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The reading as plain JSON values (what crosses a process boundary)."""
        return {
            "collectives": [list(row) for row in self.collectives],
            "flags": list(self.flags),
            "flops": self.flops,
            "held_bytes": self.held_bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Reading:
        """The reading `to_json` gave."""
        return cls(
            collectives=tuple(
                Collective(kind, n, size, tuple(axes), group, cast(Written, written))
                for kind, n, size, axes, group, written in data["collectives"]
            ),
            flags=tuple(data["flags"]),
            flops=int(data["flops"]),
            held_bytes=int(data["held_bytes"]),
        )


#: A multi-slice TPU job's transfer across slices: a host-transfer ``send`` for the
#: megascale runtime, whose frontend attribute says what collective it is part of.
_MEGASCALE = "_xla_megascale_transfer_type"
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}


# --- the reading -----------------------------------------------------------------------

#: A row: its kind, mesh axes, group size and the form it was written in.
Key = tuple[str, tuple[str, ...], int, Written]


@dataclasses.dataclass(frozen=True)
class Tally:
    """What one run of a computation does, its callees included: flops, collective
    rows ``(kind, axes, group, written_as) -> (count, bytes)``, the kinds inside loops of unknown
    trip count, rows over groups that are not whole axes, the all-reduces read as
    reduce-scatters (by computation and name, with their whole size), the
    collectives counted at a narrower width and the hand-written kernels with no
    cost estimate (by name, its number left out)."""

    flops: int = 0
    rows: Mapping[Key, tuple[int, int]] = dataclasses.field(default_factory=dict)
    unknown: frozenset[str] = frozenset()
    partial: frozenset[Key] = frozenset()
    scattered: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    widened: frozenset[tuple[str, str]] = frozenset()
    opaque: frozenset[str] = frozenset()

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
            {**self.scattered, **other.scattered},
            self.widened | other.widened,
            self.opaque | other.opaque,
        )

    def times(self, n: int) -> Tally:
        rows = {key: (count * n, size * n) for key, (count, size) in self.rows.items()}
        return dataclasses.replace(self, flops=self.flops * n, rows=rows)

    def __bool__(self) -> bool:
        return bool(self.flops or self.rows or self.unknown or self.scattered or self.opaque)

    @property
    def cost(self) -> tuple[int, int]:
        """What a branch costs, to choose the costlier: its flops, then its bytes."""
        return self.flops, sum(size for _, size in self.rows.values())


class Reader:
    """Tallies a module's computations, each once, from its entry down."""

    def __init__(
        self, mod: Module, shape: Sequence[tuple[str, int]], cpu: bool, slice_size: int | None
    ) -> None:
        self.mod, self.shape, self.cpu, self.slice_size = mod, tuple(shape), cpu, slice_size
        self.flow = Flow(mod)
        self.tally = functools.cache(self._tally)

    def _tally(self, comp: str) -> Tally:
        total = Tally()
        for ins in self.mod.comps.get(comp, []):
            scatter = self._fused_scatter(ins)
            for part in (scatter,) if scatter else (self._own(comp, ins), self._calls(comp, ins)):
                total = total + part if part else total
        return total

    def _fused_scatter(self, ins: Instr) -> Tally | None:
        """libtpu's all-reduce-scatter fusion `ins` as the reduce-scatter it is (one op,
        a tuple of them too), its bytes its result (the shards), or None if `ins` is not
        one (or a shard times the group is not the whole reduced)."""
        found = fused_scatter(self.mod, ins)
        if found is None:
            return None
        inner, pairs = found
        axes, group, whole = self._axes("all-reduce", inner)
        if any(math.prod(s) * group != math.prod(w) for s, w in pairs):
            return None
        key: Key = ("reduce-scatter", axes, group, "all-reduce-scatter")
        rows = {key: (1, ins.bytes)}
        return Tally(rows=rows, partial=frozenset() if whole else frozenset([key]))

    def _own(self, comp: str, ins: Instr) -> Tally:
        """The flops and collectives of `ins` itself."""
        computed = flops(self.mod, comp, ins)
        kind = KIND.get(ins.op)
        if ins.op == Op.kSend and _MEGASCALE in ins.frontend:
            return self._across_slices(ins)
        if is_kernel_call(ins) and kernel_estimate(ins) is None:
            return Tally(opaque=frozenset([ins.name.rsplit(".", 1)[0]]))
        if kind is None:
            return Tally(flops=computed) if computed else Tally()
        start = self.mod.by_name[comp].get(ins.operands[0], ins) if ins.op in DONES else ins
        axes, group, whole = self._axes(kind, start)
        rows: dict[Key, tuple[int, int]] = {}
        scattered: dict[tuple[str, str], int] = {}
        widened: set[tuple[str, str]] = set()
        for part in parts(self.flow, comp, ins, start, kind, group, self.cpu):
            key: Key = (part.kind, axes, group, part.written_as)
            was = rows.get(key, (0, 0))
            rows[key] = (was[0] + 1, was[1] + part.bytes)
            if part.held:
                scattered[(comp, ins.name)] = scattered.get((comp, ins.name), 0) + part.held
            if part.widened:
                widened.add((comp, ins.name))
        partial = frozenset() if whole else frozenset(rows)
        # a tuple-shaped collective is one op per kind it is read as
        rows = {key: (1, size) for key, (_, size) in rows.items()}
        return Tally(computed, rows, frozenset(), partial, scattered, frozenset(widened))

    def _axes(self, kind: str, ins: Instr) -> tuple[tuple[str, ...], int, bool]:
        """A collective's mesh axes, group size, and whether its groups are whole axes."""
        return collective_axes(kind, ins.groups, ins.pairs, self.shape)

    def _across_slices(self, ins: Instr) -> Tally:
        """A transfer across TPU slices (a megascale ``send``): the collective it is
        part of, over the devices at the same place in each slice, its bytes the
        array sent."""
        kind = _MEGASCALE_KINDS.get(ins.frontend.get(_MEGASCALE, ""), "collective-permute")
        devices = math.prod(size for _, size in self.shape) if self.shape else 1
        per = self.slice_size or devices
        groups = [list(range(p, devices, per)) for p in range(per)]
        axes, group, whole = group_axes(groups, self.shape) if self.shape else ((), 1, True)
        size = ins.arrays[0].bytes if ins.arrays else 0
        key: Key = (kind, axes, group, "")
        return Tally(rows={key: (1, size)}, partial=frozenset() if whole else frozenset([key]))

    def _calls(self, comp: str, ins: Instr) -> Tally:
        """What the computations `ins` calls do, as often as it runs them."""
        if ins.op == Op.kConditional:
            branches = [self.tally(c) for _, c in ins.callees]
            return max(branches, key=lambda t: t.cost, default=Tally())
        total = Tally()
        loop = ins.op == Op.kWhile
        trips = trip_count(self.mod, comp, ins) if loop else 1
        for role, callee in ins.callees:
            if role == "condition":
                continue
            inner = self.tally(callee)
            if trips is None:  # a loop of unknown trip count: once, flagged
                kinds = frozenset(kind for kind, *_ in inner.rows)
                inner = dataclasses.replace(inner, unknown=inner.unknown | kinds)
            total = total + inner.times(trips or 1)
        return total


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
        >>> Reading.from_json(read.to_json()) == read
        True
    """
    mod = Module.of(module)
    if mod.entry is None:
        return Reading()
    total = Reader(mod, shape, platform == "cpu", slice_size).tally(mod.entry)
    most = held(mod, dict(total.scattered), mod.entry) if total.scattered else 0
    order = sorted(total.rows, key=lambda k: (KINDS.index(k[0]), *k[1:]))
    found = tuple(Collective(k, *total.rows[(k, a, g, w)], a, g, w) for k, a, g, w in order)
    flags = [
        *_flags(total.unknown, total.partial, len(total.scattered), len(total.widened)),
        *_opaque(total.opaque),
    ]
    return Reading(found, tuple(flags), total.flops, most)


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
    for kind, axes, group in sorted({key[:3] for key in partial}):
        yield (
            f"{kind} over groups of {group} devices that are not whole mesh axes "
            f"(part of {', '.join(axes) or 'no axis'})"
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
