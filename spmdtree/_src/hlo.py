"""Reading a compiled step: what it moves, as an accelerator runs it, and what it computes.

The compiled module's HLO text names every collective with its replica
groups (which partitions, i.e. positions in the mesh's row-major device
order, take part together) and every loop with its trip count where the
compiler knows it. From them: one `Collective` row per kind and set of mesh
axes, with the bytes each device sends by the ring algorithm.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

#: The collectives counted, in the order rows are listed.
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


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

    Example:
        >>> import spmdtree as st
        >>> row = st.Collective("all-gather", 1, 4096, axes=("fsdp",), group=8)
        >>> row.wire_bytes  # each device sends 7/8 of the gathered result
        3584
        >>> st.Collective("all-reduce", 2, 4096).bytes
        4096
    """

    kind: str
    count: int  # type: ignore[assignment]  # the field shadows tuple.count, as named
    bytes: int
    axes: tuple[str, ...] = ()
    group: int = 1

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


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-done)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")


def count_collectives(hlo: str) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Collectives per executed step, from a compiled module's HLO text.

    A computation runs as often as its callers run it: a ``while`` body once
    per iteration where the compiler recorded the trip count, else once (and
    flagged). Async pairs count once, by their ``-done`` half, whose result
    is the collective's.
    """
    comps: dict[str, list[str]] = {}
    order: list[str] = []
    current: list[str] | None = None
    entry = None
    for line in hlo.splitlines():
        header = _HEADER.match(line) if line[:1] not in (" ", "\t", "") else None
        if header:
            order.append(header.group(1))
            current = comps.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
        elif current is not None and line.startswith(" "):
            current.append(line)
    runs = dict.fromkeys(order, 0)
    if entry is not None:
        runs[entry] = 1
    unknown: set[str] = set()  # computations inside a loop of unknown length
    for name in reversed(order):  # callers come after their callees in the text
        for line in comps[name]:
            trips = _TRIPS.search(line)
            for role, callee in _callees(line):
                loop = role == "body"
                if (loop and not trips) or name in unknown:
                    unknown.add(callee)
                if callee in runs:
                    runs[callee] += runs[name] * (int(trips.group(1)) if loop and trips else 1)
    counts = {kind: [0, 0] for kind in KINDS}
    flagged: set[str] = set()
    for name in order:
        for line in comps[name]:
            op = _OP.match(line)
            if op is None or not runs[name]:
                continue
            counts[op.group(2)][0] += runs[name]
            counts[op.group(2)][1] += runs[name] * _type_bytes(op.group(1))
            if name in unknown:
                flagged.add(op.group(2))
    rows = [(kind, n, size) for kind, (n, size) in counts.items() if n]
    flags = [
        f"{kind} inside a loop whose trip count the compiler does not know: counted once per step"
        for kind in KINDS
        if kind in flagged
    ]
    return rows, flags


def _callees(line: str) -> list[tuple[str, str]]:
    """The computations an HLO instruction calls, each with its role (``body``,
    ``condition``, ``to_apply``, ``calls``, ``branch``, ...)."""
    found = _CALLEE.findall(line)
    for group in _CALLEES.findall(line):
        found += [("branch", c.strip().lstrip("%")) for c in group.split(",")]
    return found


def _type_bytes(text: str) -> int:
    """The bytes of an HLO result type (a tuple's elements summed): ``f32[8,256]{1,0}``."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())  # type: ignore[union-attr]
        total += math.prod(int(d) for d in dims.split(",") if d) * max(bits // 8, 1)
    return total
