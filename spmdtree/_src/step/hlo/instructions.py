"""A compiled module's instructions, each parsed once into a typed record.

jaxlib's HLO module API gives a module's computations and schedule, and each
instruction's name, opcode (its `Op` enum), operands, users and the computation
an async start wraps (jax 0.12 adds its shape). Every other field is in the
instruction's printed text only: `Instr` reads it once, when `Module` is
built, into typed fields (the result's arrays, the callees with their roles,
replica groups, the backend config through `json.loads`, dimension numbers,
windows, metadata), so that nothing after reads text. Two regular
expressions remain, each saying which field jaxlib's API cannot give.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import jaxlib._hlo as _api  # type: ignore[import-not-found,unused-ignore]

from spmdtree._src.step.hlo.groups import Groups, parse_groups, parse_pairs
from spmdtree._src.step.kinds import bits

#: jaxlib's opcode enum (``Op.kDot``, ``Op.kAllReduce``): how every instruction's
#: opcode is held and compared.
Op: TypeAlias = _api.HloOpcode


def parse_module(text: str) -> Any:
    """The HLO module that `text` prints (``HloModule ...``), through jaxlib's parser
    (`jaxlib._hlo`, from jax 0.10 to 0.12 at least)."""
    return _api.hlo_module_from_text(text)


# jax 0.10's instruction has no shape: the element types and dimensions of a result
# type's arrays are read from the printed type ``(f32[8,2]{1,0}, s8[4]{0})``
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
# and the first array's layout, minor to major, before any tiling: ``{2,3,1,0:T(8,128)}``
_LAYOUT = re.compile(r"\]\{([\d,]*)[:}]")
# and each array's layout whole, in braces after it: its memory space ``S(n)`` and its
# first tile ``T(8,128)``: ``{3,2,1,0:T(8,128)(2,1)S(1)}``
_BRACES = re.compile(r"\{([^}]*)\}")
_SPACE = re.compile(r"S\((\d+)\)")
_TILE = re.compile(r":T\(([\d,]+)\)")
# jaxlib's instruction has no attribute accessors: its printed attribute list is cut
# at the commas outside brackets and strings, found by jumping between these marks
_MARK = re.compile(r'[{}()\[\],"\\]')


class Array(NamedTuple):
    """One array of a result: its element type (``bf16``) and dimensions, the
    memory space its layout puts it in (``S(1)``: libtpu's alternate memory, the
    chip's own VMEM; 0, the default, HBM; new in 0.7), and the elements its
    layout's tiles hold (0: as many as it has; new in 0.7: a TPU lays an array out
    in tiles of ``(8, 128)``, so a minor dimension of 64 takes 128)."""

    dtype: str
    dims: tuple[int, ...]
    space: int = 0
    tiled: int = 0

    @property
    def elements(self) -> int:
        """How many elements it holds.

        Example:
            >>> Array("bf16", (8, 2)).elements, Array("f32", ()).elements
            (16, 1)
        """
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        """Its bytes (a sub-byte type's elements a byte each)."""
        return self.elements * max(bits(self.dtype) // 8, 1)

    @property
    def tiled_bytes(self) -> int:
        """Its bytes as its layout's tiles hold them, padding included: what moves
        where it is read or written whole (new in 0.7).

        Example:
            >>> arrays("bf16[4,2048,64]{2,1,0:T(8,128)(2,1)}")[0].tiled_bytes  # 64 of 128
            2097152
            >>> Array("bf16", (4, 2048, 64)).tiled_bytes  # no tiling printed
            1048576
        """
        return max(self.tiled, self.elements) * max(bits(self.dtype) // 8, 1)

    @property
    def hbm_bytes(self) -> int:
        """Its bytes where reading or writing it moves them through HBM, as its tiles
        hold them: none in the chip's own memory (`ON_CHIP`; new in 0.7)."""
        return 0 if self.space == ON_CHIP else self.tiled_bytes

    @property
    def on_chip_bytes(self) -> int:
        """Its bytes where it lives in the chip's own memory (`ON_CHIP`), as its tiles
        hold them; none in HBM or the host's (new in 0.8).

        Example:
            >>> [a.on_chip_bytes for a in arrays("(f32[256]{0:S(1)}, f32[256]{0})")]
            [1024, 0]
        """
        return self.tiled_bytes if self.space == ON_CHIP else 0


#: The memory space libtpu's memory-space assignment prints as ``S(1)``: the
#: alternate memory on the chip (a TPU's VMEM), whose reads and writes are no HBM
#: traffic. Measured on a TPU v5e: a blocked attention's fusion of 117 MB, 96 MB of
#: them in ``S(1)``, ran in 34 us, where 117 MB of HBM take 179 us (new in 0.7).
ON_CHIP = 1
#: The default memory space, a layout that names none: HBM (new in 0.8).
HBM = 0
#: The memory space XLA gives the host's memory (``S(5)``; new in 0.8).
HOST = 5


def arrays(type_: str) -> tuple[Array, ...]:
    """The arrays of a printed type (a tuple's elements in order), each with its
    memory space where its layout names one (``S(1)``) and the elements its tiles
    hold where it names a tiling (``T(8,128)``).

    Example:
        >>> arrays("(f32[8,2]{1,0}, s8[4]{0:T(128)S(1)})")
        (Array(dtype='f32', dims=(8, 2), space=0, tiled=0), Array(dtype='s8', dims=(4,), space=1, tiled=128))
    """
    found = []
    for match in _ARRAY.finditer(type_):
        dims = tuple(int(d) for d in match.group(2).split(",") if d)
        braces = _BRACES.match(type_, match.end())
        layout = braces.group(1) if braces else ""
        space = _SPACE.search(layout)
        found.append(
            Array(match.group(1), dims, int(space.group(1)) if space else 0, _tiled(dims, layout))
        )
    return tuple(found)


def _tiled(dims: tuple[int, ...], layout: str) -> int:
    """The elements an array of `dims` takes in the tiles of its printed `layout`
    (``3,2,1,0:T(8,128)(2,1)``: its minor dimensions padded to whole multiples of
    the first tile's sides, the last side the minor-most); 0 where it names no
    tiling.

    Example:
        >>> _tiled((4, 10, 64), "2,1,0:T(8,128)")  # 4 x 16 x 128
        8192
        >>> _tiled((1280,), "0:T(1024)(128)(2,1)"), _tiled((4, 64), "1,0")
        (2048, 0)
    """
    tile = _TILE.search(layout)
    if tile is None or not dims:
        return 0
    sides = [int(side) for side in tile.group(1).split(",")][::-1]  # minor-most first
    order = [int(d) for d in layout.split(":")[0].split(",") if d] or range(len(dims))[::-1]
    padded = list(dims)
    for side, dim in zip(sides, order, strict=False):
        padded[dim] = -(-dims[dim] // side) * side
    return math.prod(padded)


def layout(type_: str) -> tuple[int, ...]:
    """A printed type's first array's layout, its dimensions from minor to major
    (``()`` where none is printed; new in 0.7).

    Example:
        >>> layout("f32[2,8,8192,8192]{2,3,1,0:T(8,128)}"), layout("(f32[8], s8[4]{0})")
        ((2, 3, 1, 0), ())
    """
    first = _ARRAY.search(type_)
    found = _LAYOUT.match(type_, first.end() - 1) if first else None
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


class DotDims(NamedTuple):
    """A dot's dimension numbers (empty where an instruction has none)."""

    lhs_batch: tuple[int, ...] = ()
    lhs_contracting: tuple[int, ...] = ()
    rhs_batch: tuple[int, ...] = ()
    rhs_contracting: tuple[int, ...] = ()


#: The attributes that name one computation, by role.
_ROLES = (
    "body",
    "condition",
    "to_apply",
    "calls",
    "select",
    "scatter",
    "comparator",
    "true_computation",
    "false_computation",
)
#: The attributes that list computations (a conditional's branches, a custom call's).
_LISTS = ("branch_computations", "called_computations")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction, its printed fields parsed once.

    Attributes:
        name: its name (``%`` left out).
        op: its opcode, jaxlib's enum (`Op`).
        arrays: its result's arrays (a tuple's elements in order).
        is_tuple: whether its result is a tuple.
        operands: its operands' names.
        root: whether it is its computation's root.
        callees: the computations it calls, each with its role (``body``,
            ``condition``, ``to_apply``, ``calls``, ``branch``, ``async``, ...).
        literal: what its parentheses hold where it has no operands: a
            parameter's number, a constant's value.
        index: the element a ``get-tuple-element`` picks (0 elsewhere).
        groups: its replica groups (``()``: all the devices in one).
        pairs: a collective-permute's source and target pairs.
        config: its backend config, the JSON object (empty where it has none; an
            MLIR dictionary's text under ``"mlir"``).
        target: a custom call's target (``__cublas$gemm``).
        direction: a compare's direction (``LT``).
        fusion: a fusion's kind (``kLoop``, ``kCustom``).
        dot: a dot's dimension numbers.
        labels: a convolution's dimension labels (lhs, rhs, output), or None.
        window: a convolution's window fields as printed (``size``, ``stride``,
            ``pad_lo``, ``pad_hi``, ``lhs_dilate``, ``rhs_dilate``).
        precision: its operands' precisions (``highest``).
        op_name: the name its metadata gives (jax's name scope and primitive).
        frontend: its frontend attributes.
        layout: its result's (a tuple's first array's) layout, its dimensions
            from minor to major; ``()`` where none is printed (new in 0.7).
        dimensions: the dimensions it names (a reduce's reduced ones; new in 0.7).
    """

    name: str
    op: Op
    arrays: tuple[Array, ...]
    is_tuple: bool
    operands: tuple[str, ...]
    root: bool
    callees: tuple[tuple[str, str], ...]
    literal: str = ""
    index: int = 0
    groups: Groups = ()
    pairs: tuple[tuple[int, int], ...] = ()
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    target: str = ""
    direction: str = ""
    fusion: str = ""
    dot: DotDims = dataclasses.field(default_factory=DotDims)
    labels: tuple[str, str, str] | None = None
    window: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict, hash=False)
    precision: tuple[str, ...] = ()
    op_name: str = ""
    frontend: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    layout: tuple[int, ...] = ()
    dimensions: tuple[int, ...] = ()

    @property
    def dims(self) -> tuple[int, ...]:
        """Its result's dimensions (a tuple's first element's; ``()`` where none)."""
        return self.arrays[0].dims if self.arrays else ()

    @property
    def bytes(self) -> int:
        """Its result's bytes (a tuple's elements summed)."""
        return sum(a.bytes for a in self.arrays)

    @property
    def tiled_bytes(self) -> int:
        """Its result's bytes as their layouts' tiles hold them (`Array.tiled_bytes`:
        what moves where it is read or written; new in 0.7)."""
        return sum(a.tiled_bytes for a in self.arrays)

    @property
    def hbm_bytes(self) -> int:
        """Its result's bytes that live in HBM, as their tiles hold them
        (`Array.hbm_bytes`; new in 0.7)."""
        return sum(a.hbm_bytes for a in self.arrays)

    @property
    def number(self) -> int:
        """A parameter's number."""
        return int(self.literal or 0)

    @property
    def minor(self) -> int | None:
        """Its result's minor-most dimension: its layout's first, the last where no
        layout is printed (the default); None for a scalar (new in 0.7)."""
        if self.layout:
            return self.layout[0]
        return len(self.dims) - 1 if self.dims else None

    @property
    def printed(self) -> str:
        """Its result's (first) array as HLO prints it, with its layout and without
        its tiling: ``f32[2,8,8192,8192]{2,3,1,0}`` (new in 0.7).

        Example:
            >>> ins = Instr("x", Op.kParameter, (Array("f32", (8, 2)),), False, (), False, (),
            ...     layout=(0, 1))
            >>> ins.printed, dataclasses.replace(ins, layout=()).printed
            ('f32[8,2]{0,1}', 'f32[8,2]')
        """
        if not self.arrays:
            return ""
        array = self.arrays[0]
        shape = f"{array.dtype}[{','.join(map(str, array.dims))}]"
        return shape + ("{" + ",".join(map(str, self.layout)) + "}" if self.layout else "")


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


# --- the printed instruction -----------------------------------------------------------


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
    opening = rest.find("(")
    if opening < 0:
        return type_, "", rest
    end = _closing(rest, opening)
    return type_, rest[opening + 1 : end - 1], rest[end:].lstrip(", ")


def fields(text: str) -> dict[str, str]:
    """A printed list of ``key=value`` fields (commas between them, outside brackets
    and strings) as a dict of the values' text.

    Example:
        >>> fields('index=0, metadata={op_name="a, b" source_line=3}, dimensions={0,1}')
        {'index': '0', 'metadata': '{op_name="a, b" source_line=3}', 'dimensions': '{0,1}'}
    """
    found: dict[str, str] = {}
    depth, start, quoted, escaped = 0, 0, False, -1
    for mark in _MARK.finditer(text):
        i = mark.start()
        c = text[i]
        if i == escaped:
            continue
        if quoted:
            if c == "\\":
                escaped = i + 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
        elif c == "," and depth == 0:
            _put(found, text[start:i])
            start = i + 1
    _put(found, text[start:])
    return found


def _put(found: dict[str, str], part: str) -> None:
    key, equals, value = part.strip().partition("=")
    if equals and key not in found:
        found[key] = value.strip()


def _unquoted(text: str) -> str:
    """A printed string's content: ``"__cublas$gemm"`` -> ``__cublas$gemm``."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _string(text: str, key: str) -> str:
    """The string a metadata's ``key="..."`` holds (its escapes kept): "" where none.

    Example:
        >>> _string('{op_name="jit(f)/dot" source_line=3}', "op_name")
        'jit(f)/dot'
    """
    start = text.find(f'{key}="')
    if start < 0:
        return ""
    start += len(key) + 2
    end = start
    while end < len(text) and text[end] != '"':
        end += 2 if text[end] == "\\" else 1
    return text[start:end]


def _braced(text: str) -> str:
    """A printed value's content between its braces: ``{1,0}`` -> ``1,0``."""
    text = text.strip()
    return text[1:-1] if text.startswith("{") and text.endswith("}") else text


def _integers(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in _braced(text).split(",") if d.strip().isdigit())


def _callees(attrs: Mapping[str, str]) -> list[tuple[str, str]]:
    """The computations an instruction's attributes name, each with its role (``body``,
    ``condition``, ``to_apply``, ``calls``, ``branch``, ...)."""
    found = [(key, value.lstrip("%")) for key, value in attrs.items() if key in _ROLES]
    for key in _LISTS:
        listed = _braced(attrs.get(key, ""))
        found += [("branch", c.strip().lstrip("%")) for c in listed.split(",") if c.strip()]
    return found


def _config(attrs: Mapping[str, str]) -> dict[str, Any]:
    """The backend config, a JSON object: {} where there is none; one printed as an
    MLIR attribute dictionary (a Triton call's, its kernel's IR inside) kept whole as
    its text under ``"mlir"`` (new in 0.6)."""
    printed = attrs.get("backend_config", "{}")
    try:
        found = json.loads(printed)
    except ValueError:
        return {"mlir": printed} if printed.startswith("{") else {}
    return found if isinstance(found, dict) else {}


def _groups(attrs: Mapping[str, str]) -> Groups:
    printed = attrs.get("replica_groups", attrs.get("device_groups", ""))
    if printed.startswith("mesh[") and "device_ids" in attrs:
        # the mesh form's device ids print after a comma: cut off as their own attribute
        printed += ", device_ids=" + attrs["device_ids"]
    return parse_groups(printed) if printed else ()


def _window(attrs: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """A convolution's window fields as printed: ``{size=3x3 pad=1_1x1_1}``."""
    found: dict[str, tuple[int, ...]] = {}
    for part in _braced(attrs.get("window", "")).split():
        key, _, value = part.partition("=")
        if key == "pad":
            pads = [p.split("_") for p in value.split("x")]
            found["pad_lo"] = tuple(int(lo) for lo, _ in pads)
            found["pad_hi"] = tuple(int(hi) for _, hi in pads)
        elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
            found[key] = tuple(int(v) for v in value.split("x"))
    return found


def _labels(attrs: Mapping[str, str]) -> tuple[str, str, str] | None:
    """A convolution's ``dim_labels=b01f_01io->b01f`` as (lhs, rhs, output)."""
    inputs, arrow, out = attrs.get("dim_labels", "").partition("->")
    lhs, underscore, rhs = inputs.partition("_")
    return (lhs, rhs, out) if arrow and underscore else None


def _fields(attrs: Mapping[str, str]) -> dict[str, Any]:
    """The record's fields that an instruction's attributes give, each read only where
    its attribute is printed (most instructions print few)."""
    found: dict[str, Any] = {}
    if attrs.get("index", "").isdigit():
        found["index"] = int(attrs["index"])
    if "replica_groups" in attrs or "device_groups" in attrs:
        found["groups"] = _groups(attrs)
    if "source_target_pairs" in attrs:
        found["pairs"] = parse_pairs(attrs["source_target_pairs"])
    if "backend_config" in attrs:
        found["config"] = _config(attrs)
    if "custom_call_target" in attrs:
        found["target"] = _unquoted(attrs["custom_call_target"])
    if "direction" in attrs:
        found["direction"] = attrs["direction"]
    if "kind" in attrs:
        found["fusion"] = attrs["kind"]
    dims = [f"{side}_{role}_dims" for side in ("lhs", "rhs") for role in ("batch", "contracting")]
    if any(key in attrs for key in dims):
        found["dot"] = DotDims(*(_integers(attrs.get(key, "")) for key in dims))
    if "dim_labels" in attrs:
        found["labels"] = _labels(attrs)
    if "window" in attrs:
        found["window"] = _window(attrs)
    if "operand_precision" in attrs:
        found["precision"] = tuple(
            p.strip() for p in _braced(attrs["operand_precision"]).split(",")
        )
    if "dimensions" in attrs:
        found["dimensions"] = _integers(attrs["dimensions"])
    if "metadata" in attrs:
        found["op_name"] = _string(attrs["metadata"], "op_name")
    if "frontend_attributes" in attrs:
        printed = fields(_braced(attrs["frontend_attributes"]))
        found["frontend"] = {key: _unquoted(value) for key, value in printed.items()}
    return found


def instruction(ins: Any, root: bool, extra: Sequence[tuple[str, str]] = ()) -> Instr:
    """The record of jaxlib's instruction `ins`, its text parsed once; `extra` callees
    added (an async start's wrapped computation)."""
    type_, args, printed = _split(ins.to_string())
    attrs = fields(printed)
    operands = tuple(o.name for o in ins.operands())
    return Instr(
        name=ins.name,
        op=ins.opcode,
        arrays=arrays(type_),
        is_tuple=type_.startswith("("),
        operands=operands,
        root=root,
        callees=(*_callees(attrs), *extra),
        literal="" if operands else args.strip(),
        layout=layout(type_),
        **_fields(attrs),
    )


# --- the module ------------------------------------------------------------------------


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
    chosen = [i for i in unused if i.opcode != Op.kParameter] or unused
    return chosen[-1].name if chosen else None


class Module:
    """A compiled module's computations (each in its scheduled order), their
    instructions, who uses each value, and who calls each computation."""

    @classmethod
    def of(cls, module: Any) -> Module:
        """`module` (jaxlib's ``HloModule``, its HLO text, or a `Module`) as a `Module`,
        read once: a `Module` is returned as it is, for its readers to share."""
        if isinstance(module, Module):
            return module
        return cls(parse_module(module) if isinstance(module, str) else module)

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

    @staticmethod
    def _read(comp: Any, schedule: Any, home: dict[str, str]) -> list[Instr]:
        try:
            order = list(schedule.sequence(comp))
        except (AttributeError, IndexError):  # no schedule, or a fused computation
            order = _post_order(comp.instructions())
        root = _root(order)
        body = []
        for ins in order:
            extra: list[tuple[str, str]] = []
            if ins.opcode == Op.kAsyncStart:
                wrapped = home.get(ins.async_wrapped_root().name)
                extra += [("async", wrapped)] if wrapped else []
            body.append(instruction(ins, ins.name == root, extra))
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
            if ins.op == Op.kParameter and ins.literal == str(number):
                return ins.name
        return None

    def root(self, comp: str) -> Instr | None:
        """Computation `comp`'s root instruction."""
        return next((i for i in self.comps.get(comp, []) if i.root), None)
