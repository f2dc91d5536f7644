"""The forms a compiler writes a collective in, other than the op an accelerator runs.

The CPU compiler writes a reduce-scatter as an all-reduce of which each
device slices its part (by its partition id), reduces bf16 values in f32,
and so holds whole reductions an accelerator does not (`held`,
`overstated_bytes`). libtpu writes a reduce-scatter as an all-reduce-scatter
fusion (`fused_scatter`) and some all-gathers as all-reduces of zero-filled
buffers (`Written`). `Flow` follows a module's values to find them: what
depends on the partition id, and where every use of a value ends.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, cast

from spmdtree._src.step.hlo.instructions import Array, Instr, Module, Op, config_field
from spmdtree._src.step.hlo.opcodes import DONES, ELEMENTWISE, MOVES, PASS, SYNC
from spmdtree._src.step.kinds import CollectiveKind, bits

#: The forms a compiler writes a collective in, other than the op its kind names
#: (``""``): see `Collective.written_as`.
Written = Literal["", "all-reduce-scatter", "zero-filled all-reduce"]


class Flow:
    """A module's values followed through its computations: whether one depends on
    the partition id (`depends`), and the partition-offset slices its uses end in
    (`slices`)."""

    def __init__(self, mod: Module) -> None:
        self.mod = mod
        self._depends: dict[tuple[str, str, int | None], bool] = {}

    def depends(self, comp: str, name: str, index: int | None = None) -> bool:
        """Whether value `name` (its tuple element `index`) depends on the partition id."""
        key = (comp, name, index)
        if key not in self._depends:
            self._depends[key] = False  # a loop's state refers back to itself
            self._depends[key] = self._depends_on(comp, name, index)
        return self._depends[key]

    def _depends_on(self, comp: str, name: str, index: int | None) -> bool:
        ins = self.mod.by_name[comp].get(name)
        if ins is None or ins.op == Op.kConstant:
            return False
        if ins.op in (Op.kPartitionId, Op.kReplicaId):
            return True
        if ins.op == Op.kParameter:
            number = ins.number
            return any(
                self.depends(caller, call.operands[0 if role != "calls" else number], index)
                for caller, call, role in self.mod.callers.get(comp, [])
                if role in ("calls", "body", "condition") and len(call.operands) > number
            )
        if ins.op == Op.kGetTupleElement:
            return self.depends(comp, ins.operands[0], ins.index)
        if ins.op == Op.kTuple and index is not None and index < len(ins.operands):
            return self.depends(comp, ins.operands[index])
        if ins.op == Op.kWhile:
            return self.depends(comp, ins.operands[0], index)
        return any(self.depends(comp, operand) for operand in ins.operands)

    def slices(
        self, comp: str, name: str, index: int | None, seen: set[tuple[str, str, int | None]]
    ) -> list[Array] | None:
        """The result arrays of the partition-offset ``dynamic-slice``s that every use
        of value `name` (its tuple element `index`) ends in, or None if some use
        does not.

        Uses are followed through fusion parameters, ``bitcast``, ``copy``,
        ``reshape``, ``transpose``, elementwise ops, ``get-tuple-element``, tuples
        and a loop's state.
        """
        if (comp, name, index) in seen:
            return []
        seen.add((comp, name, index))
        found: list[Array] = []
        for user, j in self.mod.users[comp].get(name, []):
            got = self._use(comp, user, j, index, seen)
            if got is None:
                return None
            found += got
        ins = self.mod.by_name[comp].get(name)
        if ins is not None and ins.root:
            got = self._escape(comp, index, seen)
            if got is None:
                return None
            found += got
        return found

    def _use(
        self, comp: str, user: Instr, j: int, index: int | None, seen: set[Any]
    ) -> list[Array] | None:
        """`slices` of one use: `user` takes the value as its operand `j`."""
        if user.op in PASS or (user.op in ELEMENTWISE and index is None):
            return self.slices(comp, user.name, index, seen)
        if user.op == Op.kGetTupleElement:
            if index is not None and user.index != index:
                return []  # another element of the tuple
            return self.slices(comp, user.name, None, seen)
        if user.op == Op.kTuple and index is None:
            return self.slices(comp, user.name, j, seen)
        callees = dict(user.callees)
        if user.op == Op.kWhile:  # into the body and condition, and out as the loop's result
            inside = [
                (c, self.mod.param(c, 0)) for r, c in callees.items() if r in ("body", "condition")
            ]
            parts = [self.slices(c, p, index, seen) for c, p in inside if p is not None]
            parts.append(self.slices(comp, user.name, index, seen))
            return None if any(p is None for p in parts) else [b for p in parts for b in p or []]
        if user.op in (Op.kFusion, Op.kCall):
            callee = callees.get("calls") or callees.get("to_apply")
            param = self.mod.param(callee, j) if callee else None
            return (
                None if callee is None or param is None else self.slices(callee, param, index, seen)
            )
        sliced = user.op == Op.kDynamicSlice and j == 0 and index is None
        if sliced and any(self.depends(comp, o) for o in user.operands[1:]):
            return list(user.arrays[:1])
        return None

    def _escape(self, comp: str, index: int | None, seen: set[Any]) -> list[Array] | None:
        """`slices` of a value that is `comp`'s result: where its callers take it."""
        found: list[Array] = []
        for caller, call, role in self.mod.callers.get(comp, []):
            if role == "calls":
                got = self.slices(caller, call.name, index, seen)
            elif role == "body":  # the next iteration's state, and the loop's result
                param = self.mod.param(comp, 0)
                again = self.slices(comp, param, index, seen) if param else []
                after = self.slices(caller, call.name, index, seen)
                got = None if again is None or after is None else again + after
            else:
                return None
            if got is None:
                return None
            found += got
        return found if self.mod.callers.get(comp) else None  # the entry's result: an output


# --- the CPU compiler's forms ---------------------------------------------------------


def _widened_bits(mod: Module, comp: str, name: str) -> int | None:
    """The bits of the narrower float that value `name` was converted from (behind
    bitcasts, copies and reshapes, inside a fusion too), or None if it was not."""
    ins = mod.by_name.get(comp, {}).get(name)
    while ins is not None:
        if ins.op in PASS and ins.operands:
            ins = mod.by_name[comp].get(ins.operands[0])
        elif ins.op == Op.kFusion:
            comp = dict(ins.callees).get("calls", "")
            ins = mod.root(comp)
        elif ins.op == Op.kConvert and ins.operands:
            source = mod.by_name[comp].get(ins.operands[0])
            narrow, wide = source.arrays if source else (), ins.arrays
            if narrow and wide and narrow[0].dtype.startswith(("f", "bf")):
                found = bits(narrow[0].dtype)
                return found if found < bits(wide[0].dtype) else None
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
        if user.op == Op.kGetTupleElement:
            if index is not None and user.index != index:
                continue
            got = _narrowed_bits(mod, comp, user.name)
        elif user.op in PASS:
            got = _narrowed_bits(mod, comp, user.name, index)
        elif user.op == Op.kFusion and index is None:
            callee = dict(user.callees).get("calls", "")
            param = mod.param(callee, j)
            got = _narrowed_bits(mod, callee, param) if param else None
        elif user.op == Op.kConvert and index is None:
            narrow, wide = user.arrays, mod.by_name[comp][name].arrays
            ok = narrow and wide and narrow[0].dtype.startswith(("f", "bf"))
            narrower = ok and bits(narrow[0].dtype) < bits(wide[0].dtype)
            got = bits(narrow[0].dtype) if narrower else None
        else:
            return None
        if got is None:
            return None
        found.add(got)
    return found.pop() if len(found) == 1 else None


@dataclasses.dataclass(frozen=True)
class Part:
    """One element of a collective's result, as counted: its kind (an all-reduce read
    as a reduce-scatter), its bytes, what the CPU form changed, and the form it was
    written in (`Collective.written_as`)."""

    kind: CollectiveKind
    bytes: int
    held: int = 0  # the whole size of an all-reduce read as a reduce-scatter
    widened: bool = False
    written_as: Written = ""


def parts(
    flow: Flow, comp: str, ins: Instr, start: Instr, kind: CollectiveKind, group: int, cpu: bool
) -> list[Part]:
    """The elements of collective `ins`'s result (a tuple's each; the whole for an
    async ``-done``, whose operands are its `start`'s), at the program's width on
    CPU, an all-reduce's elements whose every use takes one device's slice read as
    a reduce-scatter, and its elements that are gathers of zero-filled buffers
    marked as written so."""
    mod = flow.mod
    arrays = ins.arrays
    tuple_ = ins.is_tuple
    if not cpu or not arrays or ins.op in DONES:
        if kind is not CollectiveKind.ALL_REDUCE or not arrays:
            return [Part(kind, ins.bytes)]
        return [
            Part(kind, array.bytes, written_as=_written(flow, comp, start, i, group))
            for i, array in enumerate(arrays if tuple_ else arrays[:1])
        ]
    found = []
    for index, array in enumerate(arrays if tuple_ else arrays[:1]):
        size, dims = array.bytes, array.dims
        operand = ins.operands[index] if index < len(ins.operands) else ""
        narrow = _widened_bits(mod, comp, operand)
        if narrow is None and kind is CollectiveKind.ALL_REDUCE:
            narrow = _narrowed_bits(mod, comp, ins.name, index if tuple_ else None)
        width = bits(array.dtype)
        if kind is CollectiveKind.ALL_REDUCE:
            got = flow.slices(comp, ins.name, index if tuple_ else None, set())
            cut = max(got, key=lambda a: a.elements, default=None) if got else None
            if cut and cut.elements * group == math.prod(dims):
                shard, cut_bits = cut.bytes, bits(cut.dtype)
                # the slice at the program's width (newer CPU pipelines slice after
                # converting back; older ones before)
                shard = shard * narrow // cut_bits if narrow and narrow < cut_bits else shard
                found.append(
                    Part(CollectiveKind.REDUCE_SCATTER, shard, held=size, widened=bool(narrow))
                )
                continue
        written = (
            _written(flow, comp, start, index, group) if kind is CollectiveKind.ALL_REDUCE else ""
        )
        bytes_ = size * narrow // width if narrow else size
        found.append(Part(kind, bytes_, widened=bool(narrow), written_as=written))
    return found


def overstated_bytes(held_bytes: int, temp_bytes: int) -> int:
    """How much a CPU compile's peak may overstate an accelerator's: the whole
    reductions held at once, plus 64 bytes for the partition-id scalars their
    slices are offset by, at most the temporaries; 0 where none are held."""
    return min(held_bytes + 64, temp_bytes) if held_bytes else 0


def held(mod: Module, scattered: dict[tuple[str, str], int], comp: str) -> int:
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
        inner = [held(mod, scattered, c) for r, c in ins.callees if r in ("body", "calls")]
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
            if user.op in PASS | {Op.kGetTupleElement, Op.kTuple} and user.name not in done:
                todo.append(user.name)
    return last


# --- libtpu's forms ---------------------------------------------------------------------


def _written(flow: Flow, comp: str, start: Instr, index: int, group: int) -> Written:
    """The form element `index` of all-reduce `start` was written in: a gather of
    zero-filled buffers, or the op itself."""
    operand = start.operands[index] if index < len(start.operands) else ""
    return "zero-filled all-reduce" if _zero_filled(flow, comp, operand, group) else ""


def _origin(
    mod: Module, comp: str, name: str, outer: tuple[tuple[str, Instr], ...] = ()
) -> tuple[str, Instr, tuple[tuple[str, Instr], ...]] | None:
    """Where value `name` comes from, behind bitcasts, copies (to another memory space
    too), reshapes and transposes, into a fusion's root and out of a fusion's
    parameter to the fusion's operand: its computation, its instruction and the
    fusions entered on the way (innermost last)."""
    while (ins := mod.by_name.get(comp, {}).get(name)) is not None:
        callee = dict(ins.callees).get("calls", "")
        inner = mod.root(callee) if ins.op == Op.kFusion else None
        if ins.op in MOVES and ins.operands:
            name = ins.operands[0]
        elif inner is not None:
            outer, comp, name = (*outer, (comp, ins)), callee, inner.name
        elif ins.op == Op.kParameter and outer:
            (caller, call), number = outer[-1], ins.number
            if number >= len(call.operands):
                return None
            outer, comp, name = outer[:-1], caller, call.operands[number]
        else:
            return comp, ins, outer
    return None


def _zero_filled(flow: Flow, comp: str, name: str, group: int) -> bool:
    """Whether value `name` is one device's shard written, at an offset that depends
    on its partition id, into a buffer of zeros `group` times the shard's size: an
    all-reduce of it over the group is an all-gather (as libtpu writes some)."""
    mod = flow.mod
    found = _origin(mod, comp, name)
    if found is None or found[1].op != Op.kDynamicUpdateSlice or len(found[1].operands) < 3:
        return False
    where, update, outer = found
    zeros = _origin(mod, where, update.operands[0], outer)
    if zeros is None or zeros[1].op != Op.kBroadcast or not zeros[1].operands:
        return False
    fill = _origin(mod, zeros[0], zeros[1].operands[0], zeros[2])
    if fill is None or fill[1].op != Op.kConstant or not _is_zero(fill[1].literal):
        return False
    shard = mod.by_name[where].get(update.operands[1])
    whole = math.prod(update.dims)
    return (
        shard is not None
        and math.prod(shard.dims) * group == whole
        and any(flow.depends(where, o) for o in update.operands[2:])
    )


def _is_zero(literal: str) -> bool:
    """Whether a scalar constant's literal (``0``, ``-0``, ``0.0``) is zero."""
    try:
        return float(literal) == 0
    except ValueError:
        return False


def fused_scatter(
    mod: Module, ins: Instr
) -> tuple[Instr, list[tuple[tuple[int, ...], tuple[int, ...]]]] | None:
    """Where `ins` is libtpu's all-reduce-scatter (a ``kind=kCustom`` fusion whose
    computation all-reduces its operands, a tuple of them or one, and keeps one
    device's ``dynamic-slice`` of each result as its own), the all-reduce and each
    element's (shard, whole) dimensions; None where it is not one."""
    if ins.op != Op.kFusion or ins.fusion != "kCustom":
        return None
    callee = dict(ins.callees).get("calls", "")
    reduces = [i for i in mod.comps.get(callee, []) if i.op == Op.kAllReduce]
    root = mod.root(callee)
    if len(reduces) != 1 or root is None:
        return None
    outs = root.operands if root.op == Op.kTuple else (root.name,)
    pairs = [_slice_of(mod, callee, out, reduces[0]) for out in outs]
    if not pairs or None in pairs:
        return None
    return reduces[0], cast(list[tuple[tuple[int, ...], tuple[int, ...]]], pairs)


def _slice_of(
    mod: Module, comp: str, name: str, reduce: Instr
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where value `name` is a ``dynamic-slice`` of all-reduce `reduce`'s result (or of
    an element of it), the slice's dimensions and those of what it slices."""
    found = _origin(mod, comp, name)
    if found is None or found[1].op != Op.kDynamicSlice or not found[1].operands:
        return None
    sliced = _origin(mod, found[0], found[1].operands[0], found[2])
    if sliced is None:
        return None
    element = sliced[1]
    if element.op == Op.kGetTupleElement and element.operands[:1] == (reduce.name,):
        return found[1].dims, element.dims
    return (found[1].dims, reduce.dims) if element is reduce else None


def async_link(mod: Module, ins: Instr) -> tuple[str, str, tuple[str, Instr]] | None:
    """Where fusion `ins` is a link of libtpu's async collective fusion (a fusion
    holding a collective whose backend config has ``async_collective_fusion_config``):
    its role (``"start"``: its root is an ``AsyncCollectiveStart`` custom call;
    ``"done"``: an ``AsyncCollectiveDone`` one; else ``"continue"``), its chain (the
    collective's ``chain_id``), and the collective with its computation; None where
    it is not one (new in 0.6)."""
    if ins.op != Op.kFusion:
        return None
    callee = dict(ins.callees).get("calls", "")
    inner = [
        i
        for i in mod.comps.get(callee, [])
        if i.op in SYNC and config_field(i.config, "async_collective_fusion_config") is not None
    ]
    if len(inner) != 1 or not inner[0].frontend.get("chain_id"):
        return None  # no chain to pair its start and done by: read as it stands
    root = mod.root(callee)
    target = root.target if root is not None and root.op == Op.kCustomCall else ""
    role = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}.get(target, "continue")
    return role, inner[0].frontend.get("chain_id", ""), (callee, inner[0])
