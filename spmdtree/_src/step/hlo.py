"""Reading a compiled step: what it moves, as an accelerator runs it, and what it computes.

The compiled module is read through jaxlib's HLO module API: its
computations, their instructions (opcodes, operands, users) and, where the
API has no field, an instruction's own text (its type, replica groups,
windows, backend config). From them: one `Collective` row per kind and set
of mesh axes, with the bytes each device sends by the ring algorithm; the
FLOPs of every dot, convolution and matmul library call; how often each
computation runs (a loop's trip count, the costlier branch of a
conditional); and, for the CPU compiler's program, where it differs from an
accelerator's (reductions it writes as an all-reduce that each device
slices; values it widens from bf16 to f32).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Literal, NamedTuple, cast

import numpy as np

#: The collectives counted, in the order rows are listed.
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

#: The forms a compiler writes a collective in, other than the op its kind names
#: (``""``): see `Collective.written_as`.
Written = Literal["", "all-reduce-scatter", "zero-filled all-reduce"]
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


def hlo_api() -> ModuleType:
    """jaxlib's HLO module API (`jaxlib._hlo` from jax 0.10 to 0.12 at least): the
    module, computation and instruction classes, the opcode enum, the text parser."""
    import jaxlib._hlo as api  # type: ignore[import-not-found,unused-ignore]

    return api


def parse_module(text: str) -> Any:
    """The HLO module that `text` prints (``HloModule ...``), through jaxlib's parser."""
    return hlo_api().hlo_module_from_text(text)


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: its name, opcode (jaxlib's enum name, ``kDot``), result
    type, operands by name, the text of its operands and of its attributes, whether
    it is its computation's root, and the computations it calls with their roles."""

    name: str
    op: str
    type: str
    operands: tuple[str, ...]
    args: str
    attrs: str
    root: bool
    callees: tuple[tuple[str, str], ...]


# jaxlib's HloInstruction gives name, opcode, operands, users and to_string only (see
# `hlo_api`): every field below is read from that text, each pattern saying which.
# no result shape and no attribute list: where the opcode's operand list begins
_TYPE_OP = re.compile(r"([\w\-]+)\(")
# no called_computations: the computations an instruction names, with their roles
_CALLEE = re.compile(
    r"\b(body|condition|to_apply|calls|select|scatter|comparator|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
# no branch_computations: a conditional's (and a custom call's) lists of callees
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
# no shape: the element types and dimensions of a result type's arrays
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
# no tuple_index: the element a get-tuple-element picks
_INDEX = re.compile(r"\bindex=(\d+)")
# no replica_groups (nor device_groups, nor their tile assignment), so each printed
# form is read: an iota tile assignment ``[2,4]<=[8]T(1,0)`` (in the groups, in device_ids)
_IOTA = r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?"
# no replica_groups: the iota form
_GROUPS_IOTA = re.compile(r"\b(?:replica_groups|device_groups)=" + _IOTA)
# no replica_groups: the listed form ``{{0,1},{2,3}}``
_GROUPS_LIST = re.compile(r"\b(?:replica_groups|device_groups)=\{((?:\{[\d,\s]*\}[,\s]*)*)\}")
# no replica_groups: the mesh form ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}``
_GROUPS_MESH = re.compile(
    r"\b(?:replica_groups|device_groups)=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?|[\d,\s]*)\))?"
    r"\s*\{([^}]*)\}"
)
# no source_target_pairs: a collective-permute's pairs
_PAIRS = re.compile(r"\bsource_target_pairs=\{((?:\{\d+,\d+\}[,\s]*)*)\}")
# no replica_groups: the mesh form's axes and sizes ``'a'=2``
_AXIS = re.compile(r"'([^']*)'=(\d+)")
#: A multi-slice TPU job's transfer across slices: a host-transfer ``send`` for the
#: megascale runtime, which says what collective it is part of (jaxlib's instruction
#: has no frontend_attributes: read from its text).
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}
# no replica_groups: the mesh form's axes grouped, sub-axes ``'x':(1)2`` too
_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")


def _closing(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _split(text: str) -> tuple[str, str, str]:
    """An instruction's text ``%n = TYPE op(ARGS), ATTRS`` as (TYPE, ARGS, ATTRS)."""
    rest = text[text.index(" = ") + 3 :]
    if rest.startswith("("):  # a tuple type
        end = _closing(rest, 0)
        type_, rest = rest[:end], rest[end:].lstrip()
    else:
        type_, _, rest = rest.partition(" ")
    op = _TYPE_OP.match(rest)
    if op is None:
        return type_, "", rest
    end = _closing(rest, op.end() - 1)
    return type_, rest[op.end() : end - 1], rest[end:].lstrip(", ")


def _callees(attrs: str) -> list[tuple[str, str]]:
    """The computations an instruction's attributes name, each with its role (``body``,
    ``condition``, ``to_apply``, ``calls``, ``branch``, ...)."""
    found = _CALLEE.findall(attrs)
    for group in _CALLEES.findall(attrs):
        found += [("branch", c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
    return found


#: Where an instruction's backend config begins in its text (its opening brace last).
_CONFIG = "backend_config={"


def backend_config(attrs: str) -> dict[str, Any]:
    """An instruction's ``backend_config={...}``, the JSON object its attributes end
    in, as a dict: {} where it has none or it is not JSON (jaxlib's instruction
    gives it only in its text).

    Example:
        >>> backend_config('to_apply=%add, backend_config={"known_trip_count":{"n":"6"}}')
        {'known_trip_count': {'n': '6'}}
        >>> backend_config("to_apply=%add")
        {}
    """
    start = attrs.find(_CONFIG)
    if start < 0:
        return {}
    try:
        found, _ = json.JSONDecoder().raw_decode(attrs, start + len(_CONFIG) - 1)
    except json.JSONDecodeError:
        return {}
    return found if isinstance(found, dict) else {}


def config_field(config: Any, key: str) -> Any:
    """The first value under `key` in a backend config, nested objects and lists
    searched depth first in the order they print; None where no object has it.

    Example:
        >>> config_field({"gemm": {"dims": {"lhs": ["1"]}}}, "lhs")
        ['1']
    """
    if isinstance(config, dict):
        if key in config:
            return config[key]
        config = list(config.values())
    if isinstance(config, list):
        for value in config:
            found = config_field(value, key)
            if found is not None:
                return found
    return None


def _post_order(instructions: Sequence[Any]) -> list[Any]:
    """Instructions with each after its operands (the API lists them in no such order)."""
    done: dict[str, Any] = {}
    for first in instructions:
        todo = [(first, False)]
        while todo:
            ins, ready = todo.pop()
            if ins.name in done:
                continue
            if ready:
                done[ins.name] = ins
                continue
            todo.append((ins, True))
            todo += [(o, False) for o in reversed(ins.operands()) if o.name not in done]
    return list(done.values())


def _root(order: list[Any]) -> str | None:
    """The name of a computation's root: the API has no field for it, and a compiled
    computation has no dead code, so it is the instruction nobody uses (a
    non-parameter first; the last scheduled where several are)."""
    unused = [i for i in order if not i.users()]
    chosen = [i for i in unused if i.opcode.name != "kParameter"] or unused
    return chosen[-1].name if chosen else None


class Module:
    """A compiled module's computations (each in its scheduled order), their
    instructions, who uses each value, and who calls each computation."""

    def __init__(self, module: Any) -> None:
        schedule = module.schedule()
        self.comps: dict[str, list[Instr]] = {}
        home: dict[str, str] = {}
        for comp in module.computations():
            for ins in comp.instructions():
                home[ins.name] = comp.name
        for comp in module.computations():
            self.comps[comp.name] = self._read(comp, schedule, home)
        self.by_name = {c: {i.name: i for i in body} for c, body in self.comps.items()}
        self.users: dict[str, dict[str, list[tuple[Instr, int]]]] = {c: {} for c in self.comps}
        self.callers: dict[str, list[tuple[str, Instr, str]]] = {c: [] for c in self.comps}
        for comp, body in self.comps.items():
            for ins in body:
                for j, operand in enumerate(ins.operands):
                    self.users[comp].setdefault(operand, []).append((ins, j))
                for role, callee in ins.callees:
                    self.callers.setdefault(callee, []).append((comp, ins, role))
        uncalled = [c for c in self.comps if not self.callers.get(c)]
        self.entry: str | None = max(uncalled, key=self._reach, default=None)
        self._depends: dict[tuple[str, str, int | None], bool] = {}

    @staticmethod
    def _read(comp: Any, schedule: Any, home: dict[str, str]) -> list[Instr]:
        try:
            order = list(schedule.sequence(comp))
        except (AttributeError, IndexError):  # no schedule, or a fused computation
            order = _post_order(comp.instructions())
        root = _root(order)
        body = []
        for ins in order:
            type_, args, attrs = _split(ins.to_string())
            callees = _callees(attrs)
            if ins.opcode.name == "kAsyncStart":
                wrapped = home.get(ins.async_wrapped_root().name)
                callees += [("async", wrapped)] if wrapped else []
            body.append(
                Instr(
                    ins.name,
                    ins.opcode.name,
                    type_,
                    tuple(o.name for o in ins.operands()),
                    args,
                    attrs,
                    ins.name == root,
                    tuple(callees),
                )
            )
        return body

    def _reach(self, comp: str) -> int:
        """How many computations `comp` calls, directly or not (the entry calls most)."""
        seen, todo = {comp}, [comp]
        while todo:
            for ins in self.comps.get(todo.pop(), []):
                fresh = {c for _, c in ins.callees} - seen
                seen |= fresh
                todo += fresh
        return len(seen)

    def param(self, comp: str, number: int) -> str | None:
        """The name of parameter `number` of computation `comp`."""
        for ins in self.comps.get(comp, []):
            if ins.op == "kParameter" and ins.args.strip() == str(number):
                return ins.name
        return None

    def root(self, comp: str) -> Instr | None:
        """Computation `comp`'s root instruction."""
        return next((i for i in self.comps.get(comp, []) if i.root), None)

    def depends(self, comp: str, name: str, index: int | None = None) -> bool:
        """Whether value `name` (its tuple element `index`) depends on the partition id."""
        key = (comp, name, index)
        if key not in self._depends:
            self._depends[key] = False  # a loop's state refers back to itself
            self._depends[key] = self._depends_on(comp, name, index)
        return self._depends[key]

    def _depends_on(self, comp: str, name: str, index: int | None) -> bool:
        ins = self.by_name[comp].get(name)
        if ins is None or ins.op == "kConstant":
            return False
        if ins.op in ("kPartitionId", "kReplicaId"):
            return True
        if ins.op == "kParameter":
            number = int(ins.args.strip() or 0)
            return any(
                self.depends(caller, call.operands[0 if role != "calls" else number], index)
                for caller, call, role in self.callers.get(comp, [])
                if role in ("calls", "body", "condition") and len(call.operands) > number
            )
        if ins.op == "kGetTupleElement":
            return self.depends(comp, ins.operands[0], _element(ins))
        if ins.op == "kTuple" and index is not None and index < len(ins.operands):
            return self.depends(comp, ins.operands[index])
        if ins.op == "kWhile":
            return self.depends(comp, ins.operands[0], index)
        return any(self.depends(comp, operand) for operand in ins.operands)

    def slices(
        self, comp: str, name: str, index: int | None, seen: set[tuple[str, str, int | None]]
    ) -> list[str] | None:
        """The result types of the partition-offset ``dynamic-slice``s that every use
        of value `name` (its tuple element `index`) ends in, or None if some use
        does not.

        Uses are followed through fusion parameters, ``bitcast``, ``copy``,
        ``reshape``, ``transpose``, elementwise ops, ``get-tuple-element``, tuples
        and a loop's state.
        """
        if (comp, name, index) in seen:
            return []
        seen.add((comp, name, index))
        found: list[str] = []
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
    ) -> list[str] | None:
        """`slices` of one use: `user` takes the value as its operand `j`."""
        if user.op in _PASS or (user.op in _ELEMENTWISE and index is None):
            return self.slices(comp, user.name, index, seen)
        if user.op == "kGetTupleElement":
            picked = _element(user)
            if index is not None and picked != index:
                return []  # another element of the tuple
            return self.slices(comp, user.name, None, seen)
        if user.op == "kTuple" and index is None:
            return self.slices(comp, user.name, j, seen)
        callees = dict(user.callees)
        if user.op == "kWhile":  # into the body and condition, and out as the loop's result
            inside = [
                (c, self.param(c, 0)) for r, c in callees.items() if r in ("body", "condition")
            ]
            parts = [self.slices(c, p, index, seen) for c, p in inside if p is not None]
            parts.append(self.slices(comp, user.name, index, seen))
            return None if any(p is None for p in parts) else [b for p in parts for b in p or []]
        if user.op in ("kFusion", "kCall"):
            callee = callees.get("calls") or callees.get("to_apply")
            param = self.param(callee, j) if callee else None
            return (
                None if callee is None or param is None else self.slices(callee, param, index, seen)
            )
        sliced = user.op == "kDynamicSlice" and j == 0 and index is None
        if sliced and any(self.depends(comp, o) for o in user.operands[1:]):
            return [user.type]
        return None

    def _escape(self, comp: str, index: int | None, seen: set[Any]) -> list[str] | None:
        """`slices` of a value that is `comp`'s result: where its callers take it."""
        found: list[str] = []
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


#: Ops a value passes through unchanged in content (what is followed to its uses).
_PASS = frozenset({"kBitcast", "kCopy", "kReshape", "kTranspose"})
#: Ops whose result holds their operand's content: `_PASS`, and an async copy's two
#: halves (libtpu moves values between memory spaces so).
_MOVES = _PASS | {"kCopyStart", "kCopyDone"}
#: Elementwise ops: a slice of their result needs only the same slice of their
#: operands, so a reduction's result that flows through them to slices is needed
#: only as slices (``convert`` among them: the CPU pipeline reduces bf16 in f32).
_ELEMENTWISE = frozenset(
    [
        "kAbs",
        "kAdd",
        "kAnd",
        "kAtan2",
        "kCbrt",
        "kCeil",
        "kClamp",
        "kCompare",
        "kConvert",
        "kCos",
        "kDivide",
        "kExp",
        "kExpm1",
        "kFloor",
        "kIsFinite",
        "kLog",
        "kLog1p",
        "kLogistic",
        "kMaximum",
        "kMinimum",
        "kMultiply",
        "kNegate",
        "kNot",
        "kOr",
        "kPower",
        "kRemainder",
        "kRoundNearestAfz",
        "kRoundNearestEven",
        "kRsqrt",
        "kSelect",
        "kSign",
        "kSin",
        "kSqrt",
        "kSubtract",
        "kTan",
        "kTanh",
        "kXor",
    ]
)
#: The collectives, by opcode: the op itself (inside an async wrapper too), or the
#: ``-done`` half of an async pair, whose result is the collective's.
_KIND = {
    "kAllGather": "all-gather",
    "kAllReduce": "all-reduce",
    "kReduceScatter": "reduce-scatter",
    "kAllToAll": "all-to-all",
    "kCollectivePermute": "collective-permute",
    "kAllGatherDone": "all-gather",
    "kAllReduceDone": "all-reduce",
    "kCollectivePermuteDone": "collective-permute",
}


def _element(ins: Instr) -> int:
    """The tuple index a ``get-tuple-element`` picks."""
    found = _INDEX.search(ins.attrs)
    return int(found.group(1)) if found else 0


# --- replica groups and mesh axes ----------------------------------------------------


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
        iota = re.fullmatch(_IOTA, ids.strip())  # the device ids' iota form (no accessor)
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
    its replica groups print in; no groups (or ``{}``) is one group of all devices.

    Example:
        The same groups (along the first axis of a (2, 4) mesh) in each form:

        >>> replica_groups("replica_groups={{0,4},{1,5},{2,6},{3,7}}", 8)
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        >>> replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8)
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        >>> replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 8)
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        >>> replica_groups("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'a'}", 4)
        [[3, 2], [1, 0]]
        >>> replica_groups("replica_groups=mesh['x'=8] {'x':(1)2}", 8)  # a sub-axis
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
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
            for g in re.findall(r"\{([^}]*)\}", listed.group(1))  # each listed group
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
    pairs = re.findall(r"\{(\d+),(\d+)\}", listed.group(0)) if listed else []  # each pair
    varying: set[int] = set()
    for source, target in pairs:
        if max(int(source), int(target)) >= math.prod(sizes):
            continue
        a = np.unravel_index(int(source), sizes)
        b = np.unravel_index(int(target), sizes)
        varying |= {d for d in range(len(sizes)) if a[d] != b[d]}
    return tuple(shape[d][0] for d in sorted(varying))


def _axes(
    kind: str, ins: Instr, shape: Sequence[tuple[str, int]]
) -> tuple[tuple[str, ...], int, bool]:
    """A collective's mesh axes, group size, and whether its groups are whole axes."""
    if kind == "collective-permute":
        return permute_axes(ins.attrs, shape), 2, True
    devices = math.prod(size for _, size in shape) if shape else 1
    groups = replica_groups(ins.attrs, devices)
    return group_axes(groups, shape) if shape else ((), len(groups[0]), True)


# --- types -----------------------------------------------------------------------------


def _arrays(type_: str) -> list[tuple[str, list[int]]]:
    """The arrays of a type (a tuple's elements in order): ``(f32[8,2], s8[4])``."""
    return [
        (dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _ARRAY.findall(type_)
    ]


def _dims(type_: str) -> list[int]:
    """The dimensions of an array type (a tuple's first element): ``f32[8,256]{1,0}``."""
    found = _arrays(type_)
    return found[0][1] if found else []


def _bits(dtype: str) -> int:
    """The bits of an HLO element type: ``bf16`` 16, ``pred`` 8."""
    found = re.search(r"\d+", dtype)  # the type's name: no shape, so no element type, here
    return 8 if dtype == "pred" or found is None else int(found.group())


def _type_bytes(text: str) -> int:
    """The bytes of an HLO result type (a tuple's elements summed): ``f32[8,256]{1,0}``."""
    return sum(math.prod(dims) * max(_bits(dtype) // 8, 1) for dtype, dims in _arrays(text))


def _array_bytes(dtype: str, dims: Sequence[int]) -> int:
    """The bytes of one array: ``bf16``, [8, 256] -> 4096."""
    return math.prod(dims) * max(_bits(dtype) // 8, 1)


# --- flops -----------------------------------------------------------------------------

# no convolution_dimension_numbers: a convolution's dimension labels
_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
# no window: a convolution's window
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
# no custom_call_target: the library function a custom call calls
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def _integers(values: Any) -> list[int] | None:
    """A backend config's list of integers (printed as strings: ``["1","2"]``) as
    ints, or None where it is not one."""
    if not isinstance(values, list) or not all(str(v).isdigit() for v in values):
        return None
    return [int(v) for v in values]


def _numbers(text: str) -> list[int]:
    """The integers in `text`: ``["1","2"]`` -> [1, 2]."""
    return [int(d) for d in re.findall(r"\d+", text)]  # a printed list (no accessor gives it)


def _window(attrs: str, rank: int) -> dict[str, list[int]]:
    """A convolution's window: size, stride, pad (low, high), dilations per spatial
    dimension (defaults where absent)."""
    fields = dict.fromkeys(("size", "stride", "lhs_dilate", "rhs_dilate"), [1] * rank)
    fields["pad_lo"] = fields["pad_hi"] = [0] * rank
    found = _WINDOW.search(attrs)
    for part in found.group(1).split() if found else []:
        key, _, value = part.partition("=")
        if key == "pad":
            pads = [p.split("_") for p in value.split("x")]
            fields["pad_lo"] = [int(lo) for lo, _ in pads]
            fields["pad_hi"] = [int(hi) for _, hi in pads]
        elif key in fields:
            fields[key] = [int(v) for v in value.split("x")]
    return fields


def _taps(out: int, size: int, stride: int, pad: int, lhs: int, rhs: int, n: int) -> int:
    """Over the `out` output positions of one spatial dimension, how many kernel taps
    land on a real input element (not padding, not a hole of the input's dilation):
    a batch dimension a TPU writes as a window (``size=4 stride=3 lhs_dilate=4``)
    has one per position.

    Example:
        >>> _taps(out=4, size=4, stride=3, pad=0, lhs=4, rhs=1, n=4)  # 4 heads
        4
        >>> _taps(out=3, size=3, stride=1, pad=1, lhs=1, rhs=1, n=3)  # "SAME", 3 wide
        7
    """
    start = np.arange(out)[:, None] * stride - pad + np.arange(size)[None, :] * rhs
    real = (start >= 0) & (start <= (n - 1) * lhs) & (start % lhs == 0)
    return int(real.sum())


def _conv_flops(out_type: str, lhs_type: str, rhs_type: str, attrs: str) -> int:
    """2 x output batch x output features x input features per group x the taps
    that touch real input, summed over the output's positions."""
    labels = _LABELS.search(attrs)
    if labels is None:
        return 0
    lhs_l, rhs_l, out_l = labels.groups()
    out, lhs, rhs = _dims(out_type), _dims(lhs_type), _dims(rhs_type)
    if not (len(out) == len(out_l) and len(lhs) == len(lhs_l) and len(rhs) == len(rhs_l)):
        return 0
    spatial = sorted(c for c in out_l if c.isdigit())
    win = _window(attrs, len(spatial))
    taps = 1
    for s, c in enumerate(spatial):
        taps *= _taps(
            out[out_l.index(c)],
            win["size"][s],
            win["stride"][s],
            win["pad_lo"][s],
            win["lhs_dilate"][s],
            win["rhs_dilate"][s],
            lhs[lhs_l.index(c)],
        )
    return 2 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def _dot_flops(result: str, lhs: str, contracting: Sequence[int]) -> int:
    shape = _dims(lhs)
    if any(d >= len(shape) for d in contracting):
        return 0
    return 2 * math.prod(_dims(result)) * math.prod(shape[d] for d in contracting)


def _custom_flops(mod: Module, comp: str, ins: Instr) -> int:
    """The FLOPs of a library call: a cuBLAS matmul (its dims in its backend config),
    a cuDNN convolution (its window; the backward ones laid out by which operand is
    the forward's output) or cuDNN fused attention."""
    target = _TARGET.search(ins.attrs)
    name = target.group(1) if target else ""
    types = [mod.by_name[comp][o].type if o in mod.by_name[comp] else "" for o in ins.operands]
    result = "{}[{}]".format(*_ARRAY.findall(ins.type)[0]) if _ARRAY.search(ins.type) else ""
    config = backend_config(ins.attrs)
    if "gemm" in name.lower() or "matmul" in name.lower():
        dims = _integers(config_field(config, "lhs_contracting_dimensions"))
        return _dot_flops(result, types[0], dims) if dims is not None and types else 0
    if name.startswith("__cudnn$conv") and len(types) >= 2:
        if "BackwardInput" in name:
            return _conv_flops(types[0], result, types[1], ins.attrs)
        if "BackwardFilter" in name:
            return _conv_flops(types[1], types[0], result, ins.attrs)
        return _conv_flops(result, types[0], types[1], ins.attrs)
    if name.startswith("__cudnn$fmha") and len(types) >= 3:
        shape = config_field(config, "intermediate_tensor_shape")
        scores = _integers(shape.get("dimensions") if isinstance(shape, dict) else None)
        return _attention_flops(name, scores, types[0], types[2]) if scores is not None else 0
    return 0


def _attention_flops(name: str, scores: Sequence[int], query: str, value: str) -> int:
    """cuDNN fused attention: scores (heads x queries x keys, each a dot of the head
    width) and their product with the values; its backward recomputes the scores and
    takes the four gradients' dots.

    Example:
        >>> scores, q = [1, 4, 512, 512], "bf16[1,512,4,64]"  # its intermediate tensor's
        >>> _attention_flops("__cudnn$fmhaSoftmax", scores, q, q) == 2 * 2 * 4 * 512 * 512 * 64
        True
        >>> _attention_flops("__cudnn$fmhaSoftmaxBackward", scores, q, q) // (4 * 512 * 512 * 64)
        10
    """
    if not _dims(query) or not _dims(value):
        return 0
    size = math.prod(scores)
    qk, v = _dims(query)[-1], _dims(value)[-1]
    if "Backward" in name:
        return 2 * size * (3 * qk + 2 * v)
    return 2 * size * (qk + v)


def _flops(mod: Module, comp: str, ins: Instr) -> int:
    """2 x result elements x contracted size of a dot, a convolution or a library call."""
    types = {o: mod.by_name[comp][o].type for o in ins.operands if o in mod.by_name[comp]}
    if ins.op == "kDot" and ins.operands:
        # no dot_dimension_numbers: the contracting dimensions from the text
        found = re.search(r"\blhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        contracting = _numbers(found.group(1)) if found else []
        return _dot_flops(ins.type, types.get(ins.operands[0], ""), contracting)
    if ins.op == "kConvolution" and len(ins.operands) >= 2:
        lhs, rhs = (types.get(o, "") for o in ins.operands[:2])
        return _conv_flops(ins.type, lhs, rhs, ins.attrs)
    if ins.op == "kCustomCall":
        return _custom_flops(mod, comp, ins)
    return 0


# --- loop trip counts ----------------------------------------------------------------

# no comparison_direction: a compare's direction
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_FLIPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}
#: A loop value resolved: ("const", n), ("index", k) (element k of the loop state),
#: ("step", k, n) (element k plus n).
Value = tuple[Any, ...]


def _value(mod: Module, comp: str, name: str, outer: tuple[tuple[str, Instr], ...]) -> Value | None:
    """What a scalar in a loop's condition or body is, in terms of the loop state:
    through copies, converts and fusions (whose parameters are their operands)."""
    ins = mod.by_name.get(comp, {}).get(name)
    if ins is None:
        return None
    if ins.op == "kConstant":
        found = re.fullmatch(r"\s*(-?\d+)\s*", ins.args)  # no literal: the printed value
        return ("const", int(found.group(1))) if found else None
    if ins.op in ("kCopy", "kBitcast", "kConvert", "kReshape") and ins.operands:
        return _value(mod, comp, ins.operands[0], outer)
    if ins.op == "kFusion":
        inner = mod.root(dict(ins.callees).get("calls", ""))
        callee = dict(ins.callees).get("calls", "")
        return _value(mod, callee, inner.name, (*outer, (comp, ins))) if inner else None
    if ins.op == "kParameter" and outer:
        (caller, call), number = outer[-1], int(ins.args.strip() or 0)
        if number < len(call.operands):
            return _value(mod, caller, call.operands[number], outer[:-1])
        return None
    if ins.op == "kGetTupleElement" and not outer:
        source = mod.by_name[comp].get(ins.operands[0])
        return ("index", _element(ins)) if source and source.op == "kParameter" else None
    if ins.op in ("kAdd", "kSubtract") and len(ins.operands) == 2:
        a, b = (_value(mod, comp, o, outer) for o in ins.operands)
        sign = 1 if ins.op == "kAdd" else -1
        if a and b and a[0] == "index" and b[0] == "const":
            return ("step", a[1], sign * b[1])
        if a and b and b[0] == "index" and a[0] == "const" and sign == 1:
            return ("step", b[1], a[1])
    return None


def _condition(mod: Module, cond: str) -> tuple[int, str, int] | None:
    """A loop condition ``state[k] < n`` (or <=, >, >=, !=) as (k, direction, n)."""
    root, comp = mod.root(cond), cond
    outer: tuple[tuple[str, Instr], ...] = ()
    while root is not None and root.op == "kFusion":
        callee = dict(root.callees).get("calls", "")
        outer, comp, root = (*outer, (comp, root)), callee, mod.root(callee)
    direction = _DIRECTION.search(root.attrs) if root and root.op == "kCompare" else None
    if root is None or direction is None or len(root.operands) != 2:
        return None
    a, b = (_value(mod, comp, o, outer) for o in root.operands)
    if a and b and a[0] == "index" and b[0] == "const":
        return a[1], direction.group(1), b[1]
    if a and b and b[0] == "index" and a[0] == "const":
        return b[1], _FLIPPED[direction.group(1)], a[1]
    return None


def _trips(start: int, step: int, direction: str, limit: int) -> int | None:
    """How many times ``i = start; while i <direction> limit: i += step`` runs."""
    if step == 0:
        return None
    if direction in ("LT", "LE", "NE") and step > 0:
        end = limit + (1 if direction == "LE" else 0)
    elif direction in ("GT", "GE", "NE") and step < 0:
        end = limit - (1 if direction == "GE" else 0)
    else:
        return None
    count = -(-(end - start) // step)
    if direction == "NE" and (limit - start) % step:
        return None
    return max(count, 0)


def trip_count(mod: Module, comp: str, ins: Instr) -> int | None:
    """A ``while``'s trip count: the compiler's own (``known_trip_count``, as XLA CPU
    and GPU write it), else read from the loop as the TPU compiler leaves it: a
    condition comparing one element of the state with a constant, that element's
    start a constant in the loop's initial tuple, and the body adding a constant."""
    known = config_field(backend_config(ins.attrs), "known_trip_count")
    trips = known.get("n") if isinstance(known, dict) else None
    if isinstance(trips, str) and trips.isdigit():
        return int(trips)
    callees = dict(ins.callees)
    test = _condition(mod, callees.get("condition", ""))
    init = mod.by_name[comp].get(ins.operands[0]) if ins.operands else None
    body = mod.root(callees.get("body", ""))
    if test is None or init is None or init.op != "kTuple" or body is None:
        return None
    index, direction, limit = test
    if body.op != "kTuple" or index >= len(body.operands) or index >= len(init.operands):
        return None
    start = _value(mod, comp, init.operands[index], ())
    step = _value(mod, callees["body"], body.operands[index], ())
    if start is None or step is None or start[0] != "const" or step[:2] != ("step", index):
        return None
    return _trips(start[1], step[2], direction, limit)


# --- the CPU compiler's forms ---------------------------------------------------------


def _widened_bits(mod: Module, comp: str, name: str) -> int | None:
    """The bits of the narrower float that value `name` was converted from (behind
    bitcasts, copies and reshapes, inside a fusion too), or None if it was not."""
    ins = mod.by_name.get(comp, {}).get(name)
    while ins is not None:
        if ins.op in _PASS and ins.operands:
            ins = mod.by_name[comp].get(ins.operands[0])
        elif ins.op == "kFusion":
            comp = dict(ins.callees).get("calls", "")
            ins = mod.root(comp)
        elif ins.op == "kConvert" and ins.operands:
            source = mod.by_name[comp].get(ins.operands[0])
            narrow, wide = _arrays(source.type) if source else [], _arrays(ins.type)
            if narrow and wide and narrow[0][0].startswith(("f", "bf")):
                bits = _bits(narrow[0][0])
                return bits if bits < _bits(wide[0][0]) else None
            return None
        else:
            return None
    return None


def _narrowed_bits(mod: Module, comp: str, name: str, index: int | None = None) -> int | None:
    """The bits of the narrower float that every use of value `name` (its tuple
    element `index`) converts it to (behind bitcasts, copies, reshapes and
    fusion parameters), or None if some use does not: the CPU pipeline computes a
    bf16 dot's partial sums in f32 and reduces them before converting back."""
    found: set[int] = set()
    for user, j in mod.users.get(comp, {}).get(name, []):
        if user.op == "kGetTupleElement":
            if index is not None and _element(user) != index:
                continue
            bits = _narrowed_bits(mod, comp, user.name)
        elif user.op in _PASS:
            bits = _narrowed_bits(mod, comp, user.name, index)
        elif user.op == "kFusion" and index is None:
            callee = dict(user.callees).get("calls", "")
            param = mod.param(callee, j)
            bits = _narrowed_bits(mod, callee, param) if param else None
        elif user.op == "kConvert" and index is None:
            narrow, wide = _arrays(user.type), _arrays(mod.by_name[comp][name].type)
            ok = narrow and wide and narrow[0][0].startswith(("f", "bf"))
            bits = _bits(narrow[0][0]) if ok and _bits(narrow[0][0]) < _bits(wide[0][0]) else None
        else:
            return None
        if bits is None:
            return None
        found.add(bits)
    return found.pop() if len(found) == 1 else None


@dataclasses.dataclass(frozen=True)
class Part:
    """One element of a collective's result, as counted: its kind (an all-reduce read
    as a reduce-scatter), its bytes, what the CPU form changed, and the form it was
    written in (`Collective.written_as`)."""

    kind: str
    bytes: int
    held: int = 0  # the whole size of an all-reduce read as a reduce-scatter
    widened: bool = False
    written_as: Written = ""


def _parts(
    mod: Module, comp: str, ins: Instr, start: Instr, kind: str, group: int, cpu: bool
) -> list[Part]:
    """The elements of collective `ins`'s result (a tuple's each; the whole for an
    async ``-done``, whose operands are its `start`'s), at the program's width on
    CPU, an all-reduce's elements whose every use takes one device's slice read as
    a reduce-scatter, and its elements that are gathers of zero-filled buffers
    marked as written so."""
    arrays = _arrays(ins.type)
    tuple_ = ins.type.startswith("(")
    if not cpu or not arrays or ins.op.endswith("Done"):
        if kind != "all-reduce" or not arrays:
            return [Part(kind, _type_bytes(ins.type))]
        return [
            Part(kind, _array_bytes(dtype, dims), written_as=_written(mod, comp, start, i, group))
            for i, (dtype, dims) in enumerate(arrays if tuple_ else arrays[:1])
        ]
    parts = []
    for index, (dtype, dims) in enumerate(arrays if tuple_ else arrays[:1]):
        size = _array_bytes(dtype, dims)
        operand = ins.operands[index] if index < len(ins.operands) else ""
        narrow = _widened_bits(mod, comp, operand)
        if narrow is None and kind == "all-reduce":
            narrow = _narrowed_bits(mod, comp, ins.name, index if tuple_ else None)
        width = _bits(dtype)
        if kind == "all-reduce":
            got = mod.slices(comp, ins.name, index if tuple_ else None, set())
            cut = max(got, key=lambda t: math.prod(_dims(t)), default="") if got else ""
            if cut and math.prod(_dims(cut)) * group == math.prod(dims):
                shard, cut_bits = _type_bytes(cut), _bits(_arrays(cut)[0][0])
                # the slice at the program's width (newer CPU pipelines slice after
                # converting back; older ones before)
                shard = shard * narrow // cut_bits if narrow and narrow < cut_bits else shard
                parts.append(Part("reduce-scatter", shard, held=size, widened=bool(narrow)))
                continue
        written = _written(mod, comp, start, index, group) if kind == "all-reduce" else ""
        bytes_ = size * narrow // width if narrow else size
        parts.append(Part(kind, bytes_, widened=bool(narrow), written_as=written))
    return parts


def _written(mod: Module, comp: str, start: Instr, index: int, group: int) -> Written:
    """The form element `index` of all-reduce `start` was written in: a gather of
    zero-filled buffers, or the op itself."""
    operand = start.operands[index] if index < len(start.operands) else ""
    return "zero-filled all-reduce" if _zero_filled(mod, comp, operand, group) else ""


def _origin(
    mod: Module, comp: str, name: str, outer: tuple[tuple[str, Instr], ...] = ()
) -> tuple[str, Instr, tuple[tuple[str, Instr], ...]] | None:
    """Where value `name` comes from, behind bitcasts, copies (to another memory space
    too), reshapes and transposes, into a fusion's root and out of a fusion's
    parameter to the fusion's operand: its computation, its instruction and the
    fusions entered on the way (innermost last)."""
    while (ins := mod.by_name.get(comp, {}).get(name)) is not None:
        callee = dict(ins.callees).get("calls", "")
        inner = mod.root(callee) if ins.op == "kFusion" else None
        if ins.op in _MOVES and ins.operands:
            name = ins.operands[0]
        elif inner is not None:
            outer, comp, name = (*outer, (comp, ins)), callee, inner.name
        elif ins.op == "kParameter" and outer:
            (caller, call), number = outer[-1], int(ins.args.strip() or 0)
            if number >= len(call.operands):
                return None
            outer, comp, name = outer[:-1], caller, call.operands[number]
        else:
            return comp, ins, outer
    return None


def _zero_filled(mod: Module, comp: str, name: str, group: int) -> bool:
    """Whether value `name` is one device's shard written, at an offset that depends
    on its partition id, into a buffer of zeros `group` times the shard's size: an
    all-reduce of it over the group is an all-gather (as libtpu writes some)."""
    found = _origin(mod, comp, name)
    if found is None or found[1].op != "kDynamicUpdateSlice" or len(found[1].operands) < 3:
        return False
    where, update, outer = found
    zeros = _origin(mod, where, update.operands[0], outer)
    if zeros is None or zeros[1].op != "kBroadcast" or not zeros[1].operands:
        return False
    fill = _origin(mod, zeros[0], zeros[1].operands[0], zeros[2])
    if fill is None or fill[1].op != "kConstant" or not _is_zero(fill[1].args):
        return False
    shard = mod.by_name[where].get(update.operands[1])
    whole = math.prod(_dims(update.type))
    return (
        shard is not None
        and math.prod(_dims(shard.type)) * group == whole
        and any(mod.depends(where, o) for o in update.operands[2:])
    )


def _is_zero(literal: str) -> bool:
    """Whether a scalar constant's literal (``0``, ``-0``, ``0.0``) is zero."""
    try:
        return float(literal) == 0
    except ValueError:
        return False


def _fused_scatter(mod: Module, ins: Instr) -> tuple[Instr, list[tuple[str, str]]] | None:
    """Where `ins` is libtpu's all-reduce-scatter (a ``kind=kCustom`` fusion whose
    computation all-reduces its operands, a tuple of them or one, and keeps one
    device's ``dynamic-slice`` of each result as its own), the all-reduce and each
    element's (shard, whole) types; None where it is not one."""
    # jaxlib's instruction has no fusion kind: its text says it
    if ins.op != "kFusion" or "kind=kCustom" not in ins.attrs:
        return None
    callee = dict(ins.callees).get("calls", "")
    reduces = [i for i in mod.comps.get(callee, []) if i.op == "kAllReduce"]
    root = mod.root(callee)
    if len(reduces) != 1 or root is None:
        return None
    outs = root.operands if root.op == "kTuple" else (root.name,)
    pairs = [_slice_of(mod, callee, out, reduces[0]) for out in outs]
    if not pairs or None in pairs:
        return None
    return reduces[0], cast(list[tuple[str, str]], pairs)


def _slice_of(mod: Module, comp: str, name: str, reduce: Instr) -> tuple[str, str] | None:
    """Where value `name` is a ``dynamic-slice`` of all-reduce `reduce`'s result (or of
    an element of it), the slice's type and the type sliced."""
    found = _origin(mod, comp, name)
    if found is None or found[1].op != "kDynamicSlice" or not found[1].operands:
        return None
    sliced = _origin(mod, found[0], found[1].operands[0], found[2])
    if sliced is None:
        return None
    element = sliced[1]
    if element.op == "kGetTupleElement" and element.operands[:1] == (reduce.name,):
        return found[1].type, element.type
    return (found[1].type, reduce.type) if element is reduce else None


# --- the reading -----------------------------------------------------------------------

#: A row: its kind, mesh axes, group size and the form it was written in.
Key = tuple[str, tuple[str, ...], int, Written]


@dataclasses.dataclass(frozen=True)
class Tally:
    """What one run of a computation does, its callees included: flops, collective
    rows ``(kind, axes, group, written_as) -> (count, bytes)``, the kinds inside loops of unknown
    trip count, rows over groups that are not whole axes, the all-reduces read as
    reduce-scatters (by computation and name, with their whole size) and the
    collectives counted at a narrower width."""

    flops: int = 0
    rows: Mapping[Key, tuple[int, int]] = dataclasses.field(default_factory=dict)
    unknown: frozenset[str] = frozenset()
    partial: frozenset[Key] = frozenset()
    scattered: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    widened: frozenset[tuple[str, str]] = frozenset()

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
        )

    def times(self, n: int) -> Tally:
        rows = {key: (count * n, size * n) for key, (count, size) in self.rows.items()}
        return dataclasses.replace(self, flops=self.flops * n, rows=rows)

    def __bool__(self) -> bool:
        return bool(self.flops or self.rows or self.unknown or self.scattered)

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
        found = _fused_scatter(self.mod, ins)
        if found is None:
            return None
        inner, pairs = found
        axes, group, whole = _axes("all-reduce", inner, self.shape)
        if any(math.prod(_dims(s)) * group != math.prod(_dims(w)) for s, w in pairs):
            return None
        key: Key = ("reduce-scatter", axes, group, "all-reduce-scatter")
        rows = {key: (1, _type_bytes(ins.type))}
        return Tally(rows=rows, partial=frozenset() if whole else frozenset([key]))

    def _own(self, comp: str, ins: Instr) -> Tally:
        """The flops and collectives of `ins` itself."""
        flops = _flops(self.mod, comp, ins)
        kind = _KIND.get(ins.op)
        if ins.op == "kSend" and _MEGASCALE.search(ins.attrs):
            return self._across_slices(ins)
        if kind is None:
            return Tally(flops=flops) if flops else Tally()
        start = self.mod.by_name[comp].get(ins.operands[0], ins) if ins.op.endswith("Done") else ins
        axes, group, whole = _axes(kind, start, self.shape)
        rows: dict[Key, tuple[int, int]] = {}
        scattered: dict[tuple[str, str], int] = {}
        widened: set[tuple[str, str]] = set()
        for part in _parts(self.mod, comp, ins, start, kind, group, self.cpu):
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
        return Tally(flops, rows, frozenset(), partial, scattered, frozenset(widened))

    def _across_slices(self, ins: Instr) -> Tally:
        """A transfer across TPU slices (a megascale ``send``): the collective it is
        part of, over the devices at the same place in each slice, its bytes the
        array sent."""
        found = _MEGASCALE.search(ins.attrs)
        kind = _MEGASCALE_KINDS.get(found.group(1) if found else "", "collective-permute")
        devices = math.prod(size for _, size in self.shape) if self.shape else 1
        per = self.slice_size or devices
        groups = [list(range(p, devices, per)) for p in range(per)]
        axes, group, whole = group_axes(groups, self.shape) if self.shape else ((), 1, True)
        arrays = _arrays(ins.type)
        size = (
            _type_bytes("{}[{}]".format(arrays[0][0], ",".join(map(str, arrays[0][1]))))
            if arrays
            else 0
        )
        key: Key = (kind, axes, group, "")
        return Tally(rows={key: (1, size)}, partial=frozenset() if whole else frozenset([key]))

    def _calls(self, comp: str, ins: Instr) -> Tally:
        """What the computations `ins` calls do, as often as it runs them."""
        if ins.op == "kConditional":
            branches = [self.tally(c) for _, c in ins.callees]
            return max(branches, key=lambda t: t.cost, default=Tally())
        total = Tally()
        loop = ins.op == "kWhile"
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
    compiled module (jaxlib's ``HloModule``, or its HLO text).

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
    mod = Module(parse_module(module) if isinstance(module, str) else module)
    if mod.entry is None:
        return Reading()
    total = Reader(mod, shape, platform == "cpu", slice_size).tally(mod.entry)
    held = _held(mod, dict(total.scattered), mod.entry) if total.scattered else 0
    order = sorted(total.rows, key=lambda k: (KINDS.index(k[0]), *k[1:]))
    found = tuple(Collective(k, *total.rows[(k, a, g, w)], a, g, w) for k, a, g, w in order)
    flags = _flags(total.unknown, total.partial, len(total.scattered), len(total.widened))
    return Reading(found, tuple(flags), total.flops, held)


def overstated_bytes(held_bytes: int, temp_bytes: int) -> int:
    """How much a CPU compile's peak may overstate an accelerator's: the whole
    reductions held at once, plus 64 bytes for the partition-id scalars their
    slices are offset by, at most the temporaries; 0 where none are held."""
    return min(held_bytes + 64, temp_bytes) if held_bytes else 0


def _held(mod: Module, scattered: dict[tuple[str, str], int], comp: str) -> int:
    """The most bytes of `scattered` all-reduce results live at once in `comp`, in its
    scheduled order (a loop body by its own largest set, once)."""
    body = mod.comps.get(comp, [])
    position = {ins.name: i for i, ins in enumerate(body)}
    spans = []
    for i, ins in enumerate(body):
        if (comp, ins.name) in scattered:
            spans.append((i, _last_use(mod, comp, ins, position), scattered[(comp, ins.name)]))
    most = 0
    for p, ins in enumerate(body):
        live = sum(size for start, end, size in spans if start <= p <= end)
        inner = [_held(mod, scattered, c) for r, c in ins.callees if r in ("body", "calls")]
        most = max(most, live + max(inner, default=0))
    return most


def _last_use(mod: Module, comp: str, ins: Instr, position: dict[str, int]) -> int:
    """The position of the last use of `ins`'s value, or of what passes it on."""
    last, todo, done = position[ins.name], [ins.name], set()
    while todo:
        name = todo.pop()
        done.add(name)
        if mod.by_name[comp][name].root:
            last = len(position) - 1
        for user, _ in mod.users[comp].get(name, []):
            last = max(last, position.get(user.name, last))
            if user.op in _PASS | {"kGetTupleElement", "kTuple"} and user.name not in done:
                todo.append(user.name)
    return last


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
