"""How often a ``while`` runs: the compiler's trip count, or one read from the loop.

XLA CPU and GPU write ``known_trip_count`` in a loop's backend config; the TPU
compiler leaves the loop as it is, so its count is read from the condition
(one element of the loop state compared with a constant), that element's
start (a constant in the initial tuple) and the body's step (a constant
added), each scalar followed through copies, converts and fusions.
"""

from __future__ import annotations

from typing import NamedTuple

from spmdtree._src.step.hlo.instructions import Instr, Module, Op, config_field


class Const(NamedTuple):
    """A loop scalar that is the constant `value`."""

    value: int


class Index(NamedTuple):
    """A loop scalar that is element `element` of the loop state."""

    element: int


class Step(NamedTuple):
    """A loop scalar that is element `element` of the loop state plus `by`."""

    element: int
    by: int


Value = Const | Index | Step

_FLIPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}
#: Ops a scalar is followed through to its operand.
_THROUGH = frozenset({Op.kCopy, Op.kBitcast, Op.kConvert, Op.kReshape})


def _constant(literal: str) -> int | None:
    """A scalar integer constant's printed value (``-3``), or None."""
    text = literal.strip()
    digits = text[1:] if text.startswith("-") else text
    return int(text) if digits.isascii() and digits.isdigit() else None


def _value(mod: Module, comp: str, name: str, outer: tuple[tuple[str, Instr], ...]) -> Value | None:
    """What a scalar in a loop's condition or body is, in terms of the loop state:
    through copies, converts and fusions (whose parameters are their operands)."""
    ins = mod.by_name.get(comp, {}).get(name)
    if ins is None:
        return None
    if ins.op == Op.kConstant:
        found = _constant(ins.literal)
        return Const(found) if found is not None else None
    if ins.op in _THROUGH and ins.operands:
        return _value(mod, comp, ins.operands[0], outer)
    if ins.op == Op.kFusion:
        inner = mod.root(dict(ins.callees).get("calls", ""))
        callee = dict(ins.callees).get("calls", "")
        return _value(mod, callee, inner.name, (*outer, (comp, ins))) if inner else None
    if ins.op == Op.kParameter and outer:
        (caller, call), number = outer[-1], ins.number
        if number < len(call.operands):
            return _value(mod, caller, call.operands[number], outer[:-1])
        return None
    if ins.op == Op.kGetTupleElement and not outer:
        source = mod.by_name[comp].get(ins.operands[0])
        return Index(ins.index) if source and source.op == Op.kParameter else None
    if ins.op in (Op.kAdd, Op.kSubtract) and len(ins.operands) == 2:
        a, b = (_value(mod, comp, o, outer) for o in ins.operands)
        sign = 1 if ins.op == Op.kAdd else -1
        if isinstance(a, Index) and isinstance(b, Const):
            return Step(a.element, sign * b.value)
        if isinstance(b, Index) and isinstance(a, Const) and sign == 1:
            return Step(b.element, a.value)
    return None


def _condition(mod: Module, cond: str) -> tuple[int, str, int] | None:
    """A loop condition ``state[k] < n`` (or <=, >, >=, !=) as (k, direction, n)."""
    root, comp = mod.root(cond), cond
    outer: tuple[tuple[str, Instr], ...] = ()
    while root is not None and root.op == Op.kFusion:
        callee = dict(root.callees).get("calls", "")
        outer, comp, root = (*outer, (comp, root)), callee, mod.root(callee)
    direction = root.direction if root and root.op == Op.kCompare else ""
    if root is None or not direction or len(root.operands) != 2:
        return None
    a, b = (_value(mod, comp, o, outer) for o in root.operands)
    if isinstance(a, Index) and isinstance(b, Const):
        return a.element, direction, b.value
    if isinstance(b, Index) and isinstance(a, Const):
        return b.element, _FLIPPED[direction], a.value
    return None


#: A condition ``i <direction> n`` at the counter's start.
_HOLDS = {
    "LT": lambda i, n: i < n,
    "LE": lambda i, n: i <= n,
    "GT": lambda i, n: i > n,
    "GE": lambda i, n: i >= n,
    "NE": lambda i, n: i != n,
    "EQ": lambda i, n: i == n,
}


def _trips(start: int, step: int, direction: str, limit: int) -> int | None:
    """How many times ``i = start; while i <direction> limit: i += step`` runs, in
    closed form: 0 where the condition fails at the start (whatever the step), None
    where it never stops (the counter moves away from the limit, or steps over it
    under ``!=``).

    Example:
        >>> _trips(0, 1, "LT", 4), _trips(10, -1, "LT", 4), _trips(3, 1, "EQ", 3)
        (4, 0, 1)
        >>> _trips(0, -1, "LT", 4) is None, _trips(0, 2, "NE", 5) is None
        (True, True)
    """
    if not _HOLDS[direction](start, limit):
        return 0
    if step == 0:
        return None
    if direction == "EQ":  # one step away from the limit, it fails
        return 1
    if direction == "NE":
        steps, left = divmod(limit - start, step)
        return steps if not left and steps > 0 else None
    upward = direction in ("LT", "LE")
    if upward != (step > 0):  # moving away from the limit: it never stops
        return None
    inclusive = direction in ("LE", "GE")
    distance, by = (limit - start, step) if upward else (start - limit, -step)
    return distance // by + 1 if inclusive else -(-distance // by)


def trip_count(mod: Module, comp: str, ins: Instr) -> int | None:
    """A ``while``'s trip count: the compiler's own (``known_trip_count``, as XLA CPU
    and GPU write it), else read from the loop as the TPU compiler leaves it: a
    condition comparing one element of the state with a constant, that element's
    start a constant in the loop's initial tuple, and the body adding a constant."""
    known = config_field(ins.config, "known_trip_count")
    trips = known.get("n") if isinstance(known, dict) else None
    if isinstance(trips, str) and trips.isdigit():
        return int(trips)
    callees = dict(ins.callees)
    test = _condition(mod, callees.get("condition", ""))
    init = mod.by_name[comp].get(ins.operands[0]) if ins.operands else None
    body = mod.root(callees.get("body", ""))
    if test is None or init is None or init.op != Op.kTuple or body is None:
        return None
    index, direction, limit = test
    if body.op != Op.kTuple or index >= len(body.operands) or index >= len(init.operands):
        return None
    start = _value(mod, comp, init.operands[index], ())
    step = _value(mod, callees["body"], body.operands[index], ())
    if not isinstance(start, Const) or not isinstance(step, Step) or step.element != index:
        return None
    return _trips(start.value, step.by, direction, limit)
