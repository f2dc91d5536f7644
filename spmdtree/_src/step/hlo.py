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
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

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


class Instr(NamedTuple):
    """One HLO instruction: ``%name = type op(operands), attrs``."""

    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    args: str  # the text between the parentheses
    attrs: str  # the text after them
    root: bool


class Reading(NamedTuple):
    """What a compiled step's HLO says, per device per step."""

    collectives: list[tuple[str, int, int, tuple[str, ...], int]]
    flags: list[str]
    flops: int
    #: whole sizes of the all-reduces counted as reduce-scatters that are live at once
    held_bytes: int


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_LHS = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"([\w\-]+)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLEE = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_INDEX = re.compile(r"\bindex=(\d+)")
_IOTA = r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?"
_GROUPS_IOTA = re.compile(r"\b(?:replica_groups|device_groups)=" + _IOTA)
_GROUPS_LIST = re.compile(r"\b(?:replica_groups|device_groups)=\{((?:\{[\d,\s]*\}[,\s]*)*)\}")
_GROUPS_MESH = re.compile(
    r"\b(?:replica_groups|device_groups)=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?|[\d,\s]*)\))?"
    r"\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"\bsource_target_pairs=\{((?:\{\d+,\d+\}[,\s]*)*)\}")
_AXIS = re.compile(r"'([^']*)'=(\d+)")
_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")
#: Ops a value passes through unchanged in content (what is followed to its uses).
_PASS = frozenset({"bitcast", "copy", "reshape", "transpose"})
#: Elementwise ops: a slice of their result needs only the same slice of their
#: operands, so a reduction's result that flows through them to slices is needed
#: only as slices (``convert`` among them: the CPU pipeline reduces bf16 in f32).
_ELEMENTWISE = frozenset(
    [
        "abs",
        "add",
        "and",
        "atan2",
        "cbrt",
        "ceil",
        "clamp",
        "compare",
        "convert",
        "cosine",
        "divide",
        "exponential",
        "exponential-minus-one",
        "floor",
        "is-finite",
        "log",
        "log-plus-one",
        "logistic",
        "maximum",
        "minimum",
        "multiply",
        "negate",
        "not",
        "or",
        "power",
        "remainder",
        "round-nearest-afz",
        "round-nearest-even",
        "rsqrt",
        "select",
        "sign",
        "sine",
        "sqrt",
        "subtract",
        "tan",
        "tanh",
        "xor",
    ]
)


def _closing(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _instr(line: str) -> Instr | None:
    """The instruction on one line of a computation, or None for anything else."""
    lhs = _LHS.match(line)
    if lhs is None:
        return None
    rest = line[lhs.end() :]
    if rest.startswith("("):  # a tuple type
        end = _closing(rest, 0)
        type_, rest = rest[:end], rest[end:].lstrip()
    else:
        type_, _, rest = rest.partition(" ")
    op = _OPCODE.match(rest)
    if op is None:
        return None
    end = _closing(rest, op.end() - 1)
    args = rest[op.end() : end - 1]
    names = tuple(_NAME.findall(args))
    return Instr(lhs.group(2), type_, op.group(1), names, args, rest[end:], bool(lhs.group(1)))


class Module:
    """A compiled module's computations, their instructions, who calls whom."""

    def __init__(self, hlo: str) -> None:
        self.comps: dict[str, list[Instr]] = {}
        self.order: list[str] = []  # callees before their callers, as printed
        self.entry: str | None = None
        current: list[Instr] | None = None
        for line in hlo.splitlines():
            if line[:1] not in (" ", "\t", ""):
                header = _HEADER.match(line)
                current = None
                if header:
                    self.order.append(header.group(1))
                    current = self.comps.setdefault(header.group(1), [])
                    self.entry = header.group(1) if line.startswith("ENTRY") else self.entry
            elif current is not None and (ins := _instr(line)) is not None:
                current.append(ins)
        self.by_name = {c: {i.name: i for i in body} for c, body in self.comps.items()}
        self.users: dict[str, dict[str, list[tuple[Instr, int]]]] = {c: {} for c in self.comps}
        self.callers: dict[str, list[tuple[str, Instr, str]]] = {c: [] for c in self.comps}
        for comp, body in self.comps.items():
            for ins in body:
                for j, operand in enumerate(ins.operands):
                    self.users[comp].setdefault(operand, []).append((ins, j))
                for role, callee in _callees(ins.attrs):
                    self.callers.setdefault(callee, []).append((comp, ins, role))
        self._depends: dict[tuple[str, str, int | None], bool] = {}

    def param(self, comp: str, number: int) -> str | None:
        """The name of parameter `number` of computation `comp`."""
        for ins in self.comps.get(comp, []):
            if ins.op == "parameter" and ins.args.strip() == str(number):
                return ins.name
        return None

    def runs(self) -> tuple[dict[str, int], set[str]]:
        """How often each computation runs per step, and those inside a loop of
        unknown trip count (which count once per step)."""
        runs = dict.fromkeys(self.order, 0)
        if self.entry is not None:
            runs[self.entry] = 1
        unknown: set[str] = set()
        for name in reversed(self.order):  # callers come after their callees in the text
            for ins in self.comps[name]:
                trips = _TRIPS.search(ins.attrs)
                for role, callee in _callees(ins.attrs):
                    loop = role == "body"
                    if (loop and not trips) or name in unknown:
                        unknown.add(callee)
                    if callee in runs:
                        times = int(trips.group(1)) if loop and trips else 1
                        runs[callee] += runs[name] * times
        return runs, unknown

    def depends(self, comp: str, name: str, index: int | None = None) -> bool:
        """Whether value `name` (its tuple element `index`) depends on the partition id."""
        key = (comp, name, index)
        if key not in self._depends:
            self._depends[key] = False  # a loop's state refers back to itself
            self._depends[key] = self._depends_on(comp, name, index)
        return self._depends[key]

    def _depends_on(self, comp: str, name: str, index: int | None) -> bool:
        ins = self.by_name[comp].get(name)
        if ins is None or ins.op == "constant":
            return False
        if ins.op in ("partition-id", "replica-id"):
            return True
        if ins.op == "parameter":
            number = int(ins.args.strip() or 0)
            return any(
                self.depends(caller, call.operands[0 if role != "calls" else number], index)
                for caller, call, role in self.callers.get(comp, [])
                if role in ("calls", "body", "condition") and len(call.operands) > number
            )
        if ins.op == "get-tuple-element":
            return self.depends(comp, ins.operands[0], _element(ins))
        if ins.op == "tuple" and index is not None and index < len(ins.operands):
            return self.depends(comp, ins.operands[index])
        if ins.op == "while":
            return self.depends(comp, ins.operands[0], index)
        return any(self.depends(comp, operand) for operand in ins.operands)

    def slices(
        self, comp: str, name: str, index: int | None, seen: set[tuple[str, str, int | None]]
    ) -> list[int] | None:
        """The result bytes of the partition-offset ``dynamic-slice``s that every use of
        value `name` (its tuple element `index`) ends in, or None if some use does not.

        Uses are followed through fusion parameters, ``bitcast``, ``copy``,
        ``reshape``, ``transpose``, elementwise ops, ``get-tuple-element``, tuples
        and a loop's state.
        """
        if (comp, name, index) in seen:
            return []
        seen.add((comp, name, index))
        found: list[int] = []
        for user, j in self.users[comp].get(name, []):
            got = self._use(comp, user, j, index, seen)
            if got is None:
                return None
            found += got
        ins = self.by_name[comp].get(name)
        if ins is not None and ins.root:
            got = self._escape(comp, index, seen)
            if got is None:
                return None
            found += got
        return found

    def _use(
        self, comp: str, user: Instr, j: int, index: int | None, seen: set[Any]
    ) -> list[int] | None:
        """`slices` of one use: `user` takes the value as its operand `j`."""
        if user.op in _PASS or (user.op in _ELEMENTWISE and index is None):
            return self.slices(comp, user.name, index, seen)
        if user.op == "get-tuple-element":
            picked = _element(user)
            if index is not None and picked != index:
                return []  # another element of the tuple
            return self.slices(comp, user.name, None, seen)
        if user.op == "tuple" and index is None:
            return self.slices(comp, user.name, j, seen)
        callees = dict(_callees(user.attrs))
        if user.op == "while":  # into the body and condition, and out as the loop's result
            inside = [
                (c, self.param(c, 0)) for r, c in callees.items() if r in ("body", "condition")
            ]
            parts = [self.slices(c, p, index, seen) for c, p in inside if p is not None]
            parts.append(self.slices(comp, user.name, index, seen))
            return None if any(p is None for p in parts) else [b for p in parts for b in p or []]
        if user.op in ("fusion", "call"):
            callee = callees.get("calls") or callees.get("to_apply")
            param = self.param(callee, j) if callee else None
            return (
                None if callee is None or param is None else self.slices(callee, param, index, seen)
            )
        sliced = user.op == "dynamic-slice" and j == 0 and index is None
        if sliced and any(self.depends(comp, o) for o in user.operands[1:]):
            return [_type_bytes(user.type)]
        return None

    def _escape(self, comp: str, index: int | None, seen: set[Any]) -> list[int] | None:
        """`slices` of a value that is `comp`'s result: where its callers take it."""
        found: list[int] = []
        for caller, call, role in self.callers.get(comp, []):
            if role == "calls":
                got = self.slices(caller, call.name, index, seen)
            elif role == "body":  # the next iteration's state, and the loop's result
                param = self.param(comp, 0)
                again = self.slices(comp, param, index, seen) if param else []
                after = self.slices(caller, call.name, index, seen)
                got = None if again is None or after is None else again + after
            else:
                return None
            if got is None:
                return None
            found += got
        return found if self.callers.get(comp) else None  # the entry's result: an output


def _element(ins: Instr) -> int:
    """The tuple index a ``get-tuple-element`` picks."""
    found = _INDEX.search(ins.attrs)
    return int(found.group(1)) if found else 0


def _iota(dims: str, reshape: str | None, perm: str | None) -> np.ndarray:
    """An iota tile assignment: ``[4,2]<=[2,2,2]T(0,2,1)`` as its ids, laid out as `dims`."""
    shape = [int(d) for d in dims.split(",")]
    inner = [int(d) for d in reshape.split(",")] if reshape else shape
    ids = np.arange(math.prod(inner)).reshape(inner)
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape(shape)


def _mesh_groups(axes: str, ids: str | None, refs: str) -> list[list[int]]:
    """The groups of ``mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_1'}``."""
    names = [name for name, _ in _AXIS.findall(axes)]
    sizes = [int(size) for _, size in _AXIS.findall(axes)]
    if ids and "[" in ids:
        iota = re.fullmatch(_IOTA, ids.strip())
        flat = _iota(*iota.groups()).reshape(-1) if iota else np.arange(math.prod(sizes))
    elif ids and ids.strip():
        flat = np.array([int(i) for i in ids.split(",")])
    else:
        flat = np.arange(math.prod(sizes))
    wanted: dict[str, list[tuple[int, int]] | None] = {}
    for name, pre, size in _REF.findall(refs):
        if pre:
            wanted.setdefault(name, []).append((int(pre), int(size)))  # type: ignore[union-attr]
        else:
            wanted[name] = None
    dims: list[int] = []
    grouped: list[int] = []
    for name, size in zip(names, sizes, strict=True):
        if name not in wanted:
            dims.append(size)
            continue
        parts = wanted[name] or [(1, size)]
        prefix = 1
        for pre, part in sorted(parts):  # a sub-axis 'a':(pre)size: pre is the major part
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped.append(len(dims))
            dims.append(part)
            prefix *= part
        if prefix != size:
            dims.append(size // prefix)
    rest = [i for i in range(len(dims)) if i not in grouped]
    size = math.prod(dims[i] for i in grouped)
    return [
        list(map(int, g)) for g in flat.reshape(dims).transpose(rest + grouped).reshape(-1, size)
    ]


def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups (partition ids) of a collective, from any of the four forms
    its replica groups print in; no groups (or ``{}``) is one group of all devices."""
    mesh = _GROUPS_MESH.search(attrs)
    if mesh:
        return _mesh_groups(*mesh.groups())
    iota = _GROUPS_IOTA.search(attrs)
    if iota:
        return [list(map(int, g)) for g in _iota(*iota.groups())]
    listed = _GROUPS_LIST.search(attrs)
    if listed and listed.group(1).strip():
        return [
            [int(i) for i in g.split(",") if i.strip()]
            for g in re.findall(r"\{([^}]*)\}", listed.group(1))
        ]
    return [list(range(devices))]


def group_axes(
    groups: Sequence[Sequence[int]], shape: Sequence[tuple[str, int]]
) -> tuple[tuple[str, ...], int, bool]:
    """The mesh axes whose coordinates vary within the groups (in mesh order), the
    group size, and whether each group is made of whole axes."""
    sizes = [size for _, size in shape]
    group = max((len(g) for g in groups), default=1)
    if any(i >= math.prod(sizes) or i < 0 for g in groups for i in g):
        return (), group, False
    varying: set[int] = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=int), sizes)).reshape(len(sizes), -1)
        varying |= {d for d in range(len(sizes)) if len(set(coords[d].tolist())) > 1}
    axes = tuple(shape[d][0] for d in sorted(varying))
    whole = all(len(g) == math.prod(sizes[d] for d in varying) for g in groups)
    return axes, group, whole


def permute_axes(attrs: str, shape: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """The mesh axes along which a collective-permute's sources and targets differ."""
    sizes = [size for _, size in shape]
    listed = _PAIRS.search(attrs)
    pairs = re.findall(r"\{(\d+),(\d+)\}", listed.group(0)) if listed else []
    varying: set[int] = set()
    for source, target in pairs:
        if max(int(source), int(target)) >= math.prod(sizes):
            continue
        a = np.unravel_index(int(source), sizes)
        b = np.unravel_index(int(target), sizes)
        varying |= {d for d in range(len(sizes)) if a[d] != b[d]}
    return tuple(shape[d][0] for d in sorted(varying))


def _dims(type_: str) -> list[int]:
    """The dimensions of an array type, ``f32[8,256]{1,0}`` -> [8, 256]."""
    found = _ARRAY.search(type_)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


#: A GPU compile's matmuls are library calls, which say their contracting dims.
_GEMM = re.compile(r'custom_call_target="[^"]*(?:gemm|matmul)', re.IGNORECASE)
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _instr_flops(comp: dict[str, Instr], ins: Instr) -> int:
    """2 x result elements x contracted size, for a ``dot``, a matmul library call
    (``custom-call``; a tuple's first element is its result) or a ``convolution``."""
    result = math.prod(_dims(ins.type))
    if ins.op in ("dot", "custom-call"):
        lhs = comp.get(ins.operands[0]) if ins.operands else None
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        if ins.op == "custom-call":
            found = _GEMM_DIMS.search(ins.attrs) if _GEMM.search(ins.attrs) else None
        if lhs is None or found is None:
            return 0
        shape = _dims(lhs.type)
        dims = [int(d.strip('" ')) for d in found.group(1).split(",") if d.strip('" ')]
        return 2 * result * math.prod(shape[d] for d in dims)
    kernel = comp.get(ins.operands[1]) if len(ins.operands) > 1 else None
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    if kernel is None or labels is None or "o" not in labels.group(1):
        return 0
    shape = _dims(kernel.type)
    return 2 * result * math.prod(shape) // max(shape[labels.group(1).index("o")], 1)


def _held(mod: Module, scattered: dict[tuple[str, str], int], comp: str) -> int:
    """The most bytes of `scattered` all-reduce results live at once in `comp`, in its
    scheduled order (a loop body by its own largest set, once)."""
    body = mod.comps.get(comp, [])
    position = {ins.name: i for i, ins in enumerate(body)}
    spans = []
    for i, ins in enumerate(body):
        if (comp, ins.name) not in scattered:
            continue
        last, todo, done = i, [ins.name], set()
        while todo:  # the last use of it, or of what passes it on
            name = todo.pop()
            done.add(name)
            if mod.by_name[comp][name].root:
                last = len(body) - 1
            for user, _ in mod.users[comp].get(name, []):
                last = max(last, position[user.name])
                if user.op in _PASS | {"get-tuple-element", "tuple"} and user.name not in done:
                    todo.append(user.name)
        spans.append((i, last, scattered[(comp, ins.name)]))
    most = 0
    for p, ins in enumerate(body):
        live = sum(size for start, end, size in spans if start <= p <= end)
        inner = [_held(mod, scattered, c) for r, c in _callees(ins.attrs) if r in ("body", "calls")]
        most = max(most, live + max(inner, default=0))
    return most


def read_step(hlo: str, shape: Sequence[tuple[str, int]] = (), *, cpu: bool = False) -> Reading:
    """Collectives, flops and the whole gradients held, per executed step, from a
    compiled module's HLO text.

    A computation runs as often as its callers run it: a ``while`` body once
    per iteration where the compiler recorded the trip count, else once (and
    flagged). Async pairs count once, by their ``-done`` half, whose result
    is the collective's. `shape` is the mesh's ``(axis, size)`` pairs (the
    partition ids are positions in its row-major device order). With `cpu`,
    an all-reduce whose every use takes one device's slice of it (by its
    partition id) is counted as the reduce-scatter an accelerator runs.
    """
    mod = Module(hlo)
    runs, unknown = mod.runs()
    devices = math.prod(size for _, size in shape) if shape else 0
    rows: dict[tuple[str, tuple[str, ...], int], list[int]] = {}
    flagged: set[str] = set()
    partial: set[tuple[str, tuple[str, ...], int]] = set()
    scattered: dict[tuple[str, str], int] = {}
    flops = widened = 0
    for name in mod.order:
        for ins in mod.comps[name] if runs[name] else []:
            if ins.op in ("dot", "convolution", "custom-call"):
                flops += runs[name] * _instr_flops(mod.by_name[name], ins)
            kind, size, start = _collective(mod, name, ins)
            if kind is None:
                continue
            parts = [(kind, size)]
            if kind == "all-reduce" and cpu:  # the CPU compiler's form of a reduce-scatter
                cut, held, kept, wide = _scatter(mod, name, ins)
                if cut:
                    scattered[(name, ins.name)] = held
                widened += 1 if wide else 0
                parts = [(k, b) for k, b in (("reduce-scatter", cut), (kind, kept)) if b]
            axes, group, whole = _axes(kind, start, shape, devices)
            for kind, size in parts:
                row = rows.setdefault((kind, axes, group), [0, 0])
                row[0] += runs[name]
                row[1] += runs[name] * size
                flagged |= {kind} if name in unknown else set()
                partial |= set() if whole else {(kind, axes, group)}
    held = _held(mod, scattered, mod.entry) if scattered and mod.entry else 0
    order = sorted(rows, key=lambda k: KINDS.index(k[0]))
    found = [
        (kind, n, size, axes, group)
        for (kind, axes, group), (n, size) in ((k, rows[k]) for k in order)
    ]
    return Reading(found, _flags(flagged, partial, len(scattered), widened), flops, held)


def overstated_bytes(held_bytes: int, temp_bytes: int) -> int:
    """How much a CPU compile's peak may overstate an accelerator's: the whole
    reductions held at once, plus 64 bytes for the partition-id scalars their
    slices are offset by, at most the temporaries; 0 where none are held."""
    return min(held_bytes + 64, temp_bytes) if held_bytes else 0


def _axes(
    kind: str, ins: Instr, shape: Sequence[tuple[str, int]], devices: int
) -> tuple[tuple[str, ...], int, bool]:
    """A collective's mesh axes, group size, and whether its groups are whole axes."""
    if kind == "collective-permute":
        return permute_axes(ins.attrs, shape), 2, True
    groups = replica_groups(ins.attrs, devices or 1)
    return group_axes(groups, shape) if shape else ((), len(groups[0]), True)


def _collective(mod: Module, comp: str, ins: Instr) -> tuple[str | None, int, Instr]:
    """The kind of collective `ins` is (None if none), its result bytes, and the
    instruction that carries its groups (an async ``-done``'s ``-start``)."""
    if ins.op in KINDS:
        return ins.op, _type_bytes(ins.type), ins
    if ins.op.endswith("-done") and ins.op[: -len("-done")] in KINDS and ins.operands:
        start = mod.by_name[comp].get(ins.operands[0], ins)
        return ins.op[: -len("-done")], _type_bytes(ins.type), start
    return None, 0, ins


def _scatter(mod: Module, comp: str, ins: Instr) -> tuple[int, int, int, int]:
    """Of all-reduce `ins`'s result (each element of a tuple): the slice bytes of the
    elements whose every use takes one device's slice, their whole bytes, the bytes
    of the other elements (used whole: a real all-reduce), and how many elements
    are reduced wider than their values (bf16 reduced in f32: counted at bf16)."""
    arrays = _ARRAY.findall(ins.type)
    cut = held = kept = widened = 0
    for index in range(len(arrays)) if ins.type.startswith("(") else [None]:
        got = mod.slices(comp, ins.name, index, set())
        size = _type_bytes(ins.type if index is None else "{}[{}]".format(*arrays[index]))
        operand = ins.operands[index or 0] if len(ins.operands) > (index or 0) else ""
        narrow = _widened_bits(mod, comp, operand)
        if got:
            cut, held = cut + max(got), held + size
        else:
            wide = _bits(arrays[index or 0][0]) if arrays else 0
            kept += size * narrow // wide if narrow and wide else size
            widened += 1 if narrow else 0
    return cut, held, kept, widened


def _bits(dtype: str) -> int:
    """The bits of an HLO element type: ``bf16`` 16, ``pred`` 8."""
    found = re.search(r"\d+", dtype)
    return 8 if dtype == "pred" or found is None else int(found.group())


def _widened_bits(mod: Module, comp: str, name: str) -> int | None:
    """The bits of the narrower float that value `name` was converted from (behind
    bitcasts, copies and reshapes, inside a fusion too), or None if it was not."""
    ins = mod.by_name.get(comp, {}).get(name)
    while ins is not None:
        if ins.op in _PASS and ins.operands:
            ins = mod.by_name[comp].get(ins.operands[0])
        elif ins.op == "fusion":
            comp = dict(_callees(ins.attrs)).get("calls", "")
            ins = next((i for i in mod.comps.get(comp, []) if i.root), None)
        elif ins.op == "convert" and ins.operands:
            source = mod.by_name[comp].get(ins.operands[0])
            found = _ARRAY.search(source.type) if source else None
            wide = _ARRAY.search(ins.type)
            if found and wide and found.group(1).startswith(("f", "bf")):
                narrow = _bits(found.group(1))
                return narrow if narrow < _bits(wide.group(1)) else None
            return None
        else:
            return None
    return None


def _flags(
    unknown: set[str],
    partial: set[tuple[str, tuple[str, ...], int]],
    scattered: int,
    widened: int,
) -> list[str]:
    flags = [
        f"{kind} inside a loop whose trip count the compiler does not know: counted once per step"
        for kind in KINDS
        if kind in unknown
    ]
    for kind, axes, group in sorted(partial):
        flags.append(
            f"{kind} over groups of {group} devices that are not whole mesh axes "
            f"(part of {', '.join(axes) or 'no axis'})"
        )
    if scattered:
        flags.append(
            f"{scattered} all-reduce{'s' if scattered > 1 else ''} whose every use takes one "
            "device's slice (the CPU compiler's form of a reduce-scatter) counted as the "
            "reduce-scatter an accelerator runs"
        )
    if widened:
        flags.append(
            f"{widened} all-reduce{'s' if widened > 1 else ''} of values the CPU compiler "
            "reduces in a wider float than they hold (bf16 in f32) counted at their own width"
        )
    return flags


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
