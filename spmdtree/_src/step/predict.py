"""A predicted step time: the compiled module's schedule, each instruction timed by a model.

A roofline bound (`StepTime.bound_seconds`) assumes peak FLOPs and perfect
overlap, and most layouts tie at it. The compiled module says more: XLA GPU
and libtpu print it in the order the device runs it (``is_scheduled=true``),
and an async collective's start and done sit where the scheduler put them.
`read_schedule` turns that order into a `Schedule`, hardware-free and small
(it crosses a process boundary as JSON): one `Kernel` per device kernel, with
its FLOPs, bytes and matmul shape; a `Start` and a `Done` per collective; a
`Loop` per ``while`` with its trip count; a `Branches` per conditional.
`predict` walks it on two clocks: the compute stream runs kernels in order;
the collective stream runs collectives one at a time (XLA GPU's default); a
done waits for its collective, so only the part of a collective that the
compute between its start and done does not cover is exposed.

The per-kernel model (`Costs`; every figure's source is listed with it):

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
  5 us) on top of the alpha-beta time the caller gives (`hardware`'s
  `collective_seconds`: per link level, the slowest level's bytes over its
  bandwidth plus its per-hop latency).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from spmdtree._src.step import opcodes
from spmdtree._src.step.chips import CHIPS, Sheet
from spmdtree._src.step.groups import collective_axes
from spmdtree._src.step.hlo import Collective
from spmdtree._src.step.instructions import Instr, Module, Op, bits, config_field
from spmdtree._src.step.loops import trip_count
from spmdtree._src.step.opcodes import DONES, STARTS, SYNC, is_kernel_call, kernel_estimate

#: The classes a step's time is split into; `Prediction` has one field each.
CLASSES = ("matmul", "attention", "memory", "collectives", "launch")


class Kernel(NamedTuple):
    """One device kernel: its class (``matmul``, ``attention`` or ``memory``), the
    FLOPs of its dots, the bytes it reads and writes, and its largest matmul's
    shape (batch, m, n, k; zeros where it has none) and operands' element type
    (``bf16``, ``f32``; ``f32/highest`` at the highest precision)."""

    kind: str
    flops: int
    bytes: int
    batch: int = 0
    m: int = 0
    n: int = 0
    k: int = 0
    dtype: str = ""


class Start(NamedTuple):
    """A collective begins: `ident` pairs it with its `Done`; `sync` where it runs
    on the compute stream (a synchronous collective, or one XLA marked
    ``is_sync``)."""

    ident: int
    row: Collective
    sync: bool


class Done(NamedTuple):
    """The compute stream waits here for collective `ident` to finish."""

    ident: int


class Loop(NamedTuple):
    """A ``while``: its body (condition included) runs `trips` times."""

    trips: int
    body: tuple[Event, ...]


class Branches(NamedTuple):
    """A conditional: one of its branches runs (timed as the slowest)."""

    options: tuple[tuple[Event, ...], ...]


Event = Kernel | Start | Done | Loop | Branches


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A compiled step's events in the order its device runs them (`read_schedule`).

    Attributes:
        events: the entry computation's `Kernel`, `Start`, `Done`, `Loop` and
            `Branches` records, in schedule order.
        platform: the compiler's platform (``"cuda"``, ``"tpu"``, ``"cpu"``).
        flags: what the schedule does not cover (a loop of unknown trip count,
            timed once).
    """

    events: tuple[Event, ...]
    platform: str
    flags: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The schedule as plain JSON values (each event a tagged list)."""
        return {
            "events": [_event_json(e) for e in self.events],
            "platform": self.platform,
            "flags": list(self.flags),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Schedule:
        """The schedule `to_json` gave."""
        events = tuple(_event_from(e) for e in data["events"])
        return cls(events, data["platform"], tuple(data["flags"]))


def _event_json(event: Event) -> list[Any]:
    if isinstance(event, Kernel):
        return ["kernel", *event]
    if isinstance(event, Start):
        return ["start", event.ident, list(event.row), event.sync]
    if isinstance(event, Done):
        return ["done", event.ident]
    if isinstance(event, Loop):
        return ["loop", event.trips, [_event_json(e) for e in event.body]]
    return ["branches", [[_event_json(e) for e in option] for option in event.options]]


def _event_from(data: Sequence[Any]) -> Event:
    tag, rest = data[0], data[1:]
    if tag == "kernel":
        return Kernel(*rest)
    if tag == "start":
        kind, count, size, axes, group, written = rest[1]
        row = Collective(kind, count, size, tuple(axes), group, written)
        return Start(rest[0], row, rest[2])
    if tag == "done":
        return Done(rest[0])
    if tag == "loop":
        return Loop(rest[0], tuple(_event_from(e) for e in rest[1]))
    return Branches(tuple(tuple(_event_from(e) for e in option) for option in rest[0]))


# --- the per-kernel model ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the per-kernel model needs of a chip beyond its peak and its links.

    Attributes:
        hbm_bytes_per_second: the memory bandwidth (data sheet).
        memory_efficiency: the share of it a memory-bound kernel sustains.
        matmul_efficiency: the largest share of the peak a matmul reaches (a
            large, well-shaped one).
        cores: the units a matmul's tiles are spread over (SMs; 1 on a TPU,
            whose MXUs work on one tile stream).
        tile: a matmul tile's (m, n) on that chip.
        launch_seconds: the overhead each kernel adds (0 on a TPU: one program).
        collective_latency_seconds: the latency each collective adds beyond
            the links' per-hop latency.
        f32_speed: an f32 matmul's peak over the bf16 one at the default
            precision (a GPU runs it as TF32, half the rate; a TPU in one bf16
            pass); 8-bit matmuls run at twice the bf16 rate.
        f32_highest_speed: likewise at the highest precision (a GPU's FP32
            units; a TPU's six bf16 passes).
    """

    hbm_bytes_per_second: float
    memory_efficiency: float
    matmul_efficiency: float
    cores: int
    tile: tuple[int, int]
    launch_seconds: float
    collective_latency_seconds: float
    f32_speed: float = 1.0
    f32_highest_speed: float = 1 / 6

    def speed(self, dtype: str) -> float:
        """A matmul's peak over the bf16 one for operands of `dtype`."""
        width = bits(dtype.partition("/")[0]) if dtype else 16
        if width <= 8:
            return 2.0
        if width >= 32:
            return self.f32_highest_speed if dtype.endswith("/highest") else self.f32_speed
        return 1.0


def _costs(sheet: Sheet) -> Costs:
    """A chip's model figures: a GPU's SMs at cuBLAS's tile, its launch overheads and
    its f32 rates; a TPU's MXU tile stream, one program (no launch)."""
    tile, hbm = (sheet.tile, sheet.tile), float(sheet.hbm_bytes_per_second)
    if sheet.platform != "cuda":
        return Costs(hbm, 0.9, sheet.matmul_efficiency, 1, tile, 0.0, 0.0)
    return Costs(
        hbm_bytes_per_second=hbm,
        memory_efficiency=0.9,
        matmul_efficiency=sheet.matmul_efficiency,
        cores=sheet.sms,
        tile=tile,
        launch_seconds=1e-6,
        collective_latency_seconds=5e-6,
        f32_speed=0.5,
        f32_highest_speed=67 / 989,
    )


#: The model's figures per preset, built from `chips.CHIPS` (docs/planning.md,
#: "Predicted step time", lists each source): HBM bandwidth, SMs and the largest
#: achievable matmul share as the chips' table has them; 1 us a kernel and 5 us a
#: collective, XLA GPU's own kKernelLaunchOverhead and kNcclKernelLaunchOverhead
#: (xla/service/gpu/model/gpu_performance_model_base.h). Memory efficiency 0.9 is an
#: assumption (XLA's model takes the full bandwidth). f32 matmuls: the H100 data
#: sheet's TF32 (494.7 of 989.4 TFLOPS) and FP32 (67).
COSTS = {name: _costs(sheet) for name, sheet in CHIPS.items()}

#: How far memory and compute overlap within a kernel (XLA GPU's
#: kMemoryComputeParallelism): time = compute + memory - 0.95 min(compute, memory).
_PARALLELISM = 0.95


def wave_efficiency(batch: int, m: int, n: int, costs: Costs) -> float:
    """The share of the cores' tile slots a matmul's output fills: ``batch x m x n``
    over ``ceil(tiles / cores) x cores`` tiles of `costs.tile` (tile and wave
    quantization).

    Example:
        >>> h100 = COSTS["h100"]
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
    the peak x the matmul share x its wave efficiency) and its memory (bytes
    over the sustained bandwidth), plus 5% of the smaller.

    Example:
        >>> h100 = COSTS["h100"]
        >>> copy = Kernel("memory", 0, 2 * 2**30)
        >>> kernel_seconds(copy, h100, 989e12) == 2 * 2**30 / (3.35e12 * 0.9)
        True
    """
    memory = kernel.bytes / (costs.hbm_bytes_per_second * costs.memory_efficiency)
    compute = 0.0
    if kernel.flops:
        share = costs.matmul_efficiency * costs.speed(kernel.dtype)
        if kernel.m and kernel.n:
            share *= wave_efficiency(kernel.batch or 1, kernel.m, kernel.n, costs)
        compute = kernel.flops / (peak * share)
    return max(compute, memory) + (1 - _PARALLELISM) * min(compute, memory)


# --- the walk ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A step's predicted time on one device, split by class.

    Attributes:
        matmul_seconds: matmul and convolution kernels.
        attention_seconds: fused attention kernels (cuDNN's), and the kernels
            of a name scope naming attention (``jax.named_scope("attention")``:
            a blocked attention's matmuls and softmax).
        memory_seconds: every other kernel (memory-bound fusions, copies,
            reductions).
        exposed_comm_seconds: the compute stream waiting for collectives
            (synchronous ones whole; an async one where the compute between
            its start and done does not cover it).
        launch_seconds: the kernels' launch overheads.
        comm_seconds: every collective's time, hidden or not.
        kernels: how many kernels run per step.
    """

    matmul_seconds: float
    attention_seconds: float
    memory_seconds: float
    exposed_comm_seconds: float
    launch_seconds: float
    comm_seconds: float
    kernels: int

    @property
    def seconds(self) -> float:
        """The step: the sum of its classes."""
        return sum(self.by_class.values())

    @property
    def by_class(self) -> dict[str, float]:
        """The seconds per class (`CLASSES`)."""
        return {
            "matmul": self.matmul_seconds,
            "attention": self.attention_seconds,
            "memory": self.memory_seconds,
            "collectives": self.exposed_comm_seconds,
            "launch": self.launch_seconds,
        }


@dataclasses.dataclass
class _Clock:
    """Where the two streams stand, and what each class took so far."""

    compute: float = 0.0  # the compute stream's time
    links: float = 0.0  # when the collective stream is next free
    spent: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    comm: float = 0.0
    kernels: int = 0
    pending: dict[int, float] = dataclasses.field(default_factory=dict)

    def copy(self) -> _Clock:
        return dataclasses.replace(self, spent=dict(self.spent), pending=dict(self.pending))

    def wait(self, until: float) -> None:
        """The compute stream waits for a collective finishing at `until`."""
        if until > self.compute:
            self.spent["collectives"] += until - self.compute
            self.compute = until

    def advance(self, before: _Clock, times: int) -> None:
        """Repeats `times` more the change since `before` (a loop's steady iteration)."""
        self.compute += times * (self.compute - before.compute)
        self.links += times * (self.links - before.links)
        for kind in CLASSES:
            self.spent[kind] += times * (self.spent[kind] - before.spent[kind])
        self.comm += times * (self.comm - before.comm)
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
            clock.spent[event.kind] += seconds
            clock.spent["launch"] += self.costs.launch_seconds
            clock.compute += seconds + self.costs.launch_seconds
            clock.kernels += 1
        elif isinstance(event, Start):
            seconds = self.comm(event.row) + self.costs.collective_latency_seconds
            clock.links = max(clock.compute, clock.links) + seconds
            clock.comm += seconds
            if event.sync:
                clock.wait(clock.links)
            else:
                clock.pending[event.ident] = clock.links
        elif isinstance(event, Done):
            if event.ident in clock.pending:
                clock.wait(clock.pending.pop(event.ident))
        elif isinstance(event, Loop):
            before = clock
            for _ in range(min(event.trips, self.WALKED)):
                before = clock.copy()
                clock = self.run(event.body, clock)
            if event.trips > self.WALKED:
                clock.advance(before, event.trips - self.WALKED)
        else:
            ends = [self.run(option, clock.copy()) for option in event.options]
            clock = max(ends, key=lambda c: c.compute, default=clock)
        return clock


def predict(
    schedule: Schedule,
    costs: Costs,
    peak_flops: float,
    collective_seconds: Callable[[Collective], float],
) -> Prediction:
    """The predicted time of one step of `schedule` on a chip of these `costs` and
    peak, each collective row timed by `collective_seconds` (the links' alpha-beta
    time; `Costs.collective_latency_seconds` is added to it).

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
    end = _Walk(costs, peak_flops, collective_seconds).run(schedule.events, _Clock())
    return Prediction(
        matmul_seconds=end.spent["matmul"],
        attention_seconds=end.spent["attention"],
        memory_seconds=end.spent["memory"],
        exposed_comm_seconds=end.spent["collectives"],
        launch_seconds=end.spent["launch"],
        comm_seconds=end.comm,
        kernels=end.kernels,
    )


# --- reading the schedule ---------------------------------------------------------------

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
        Op.kDomain,
        Op.kGetDimensionSize,
        Op.kAsyncUpdate,
        Op.kCopyStart,
        Op.kCopyDone,
        Op.kSend,
        Op.kSendDone,
        Op.kRecv,
        Op.kRecvDone,
    }
)
#: What the compute stream waits at: an async pair's done, a wrapped async op's too.
_DONES = DONES | {Op.kAsyncDone}
#: Ops that read only part of their first operand: a slice's bytes, not the whole.
_SLICING = frozenset({Op.kDynamicSlice, Op.kSlice, Op.kGather})


class _Reader:
    """Turns a module's scheduled computations into events, each computation once."""

    def __init__(self, mod: Module, shape: Sequence[tuple[str, int]]) -> None:
        self.mod, self.shape = mod, tuple(shape)
        self.idents: dict[tuple[str, str], int] = {}
        self.unknown = False
        self.read: dict[str, tuple[Event, ...]] = {}

    def events(self, comp: str) -> tuple[Event, ...]:
        if comp not in self.read:
            self.read[comp] = tuple(
                e for ins in self.mod.comps.get(comp, []) for e in self.of(comp, ins)
            )
        return self.read[comp]

    def of(self, comp: str, ins: Instr) -> list[Event]:
        """The events of one scheduled instruction."""
        callees = dict(ins.callees)
        if ins.op in _FREE:
            return []
        if ins.op == Op.kWhile:
            trips = trip_count(self.mod, comp, ins)
            self.unknown |= trips is None
            body = self.events(callees.get("condition", "")) + self.events(callees.get("body", ""))
            return [Loop(1 if trips is None else trips, body)]
        if ins.op == Op.kConditional:
            return [Branches(tuple(self.events(c) for r, c in ins.callees if r == "branch"))]
        if ins.op == Op.kCall:
            return list(self.events(callees.get("to_apply", "")))
        if ins.op in _DONES:
            found = self.idents.get((comp, ins.operands[0])) if ins.operands else None
            return [] if found is None else [Done(found)]
        if ins.op in STARTS or ins.op == Op.kAsyncStart or ins.op in SYNC:
            return self._collective(comp, ins)
        return [self._kernel(comp, ins)]

    def _collective(self, comp: str, ins: Instr) -> list[Event]:
        """A collective's `Start` (and, synchronous, its `Done`); an async wrapper of
        anything else is the kernel it wraps."""
        inner, kind = ins, STARTS.get(ins.op) or SYNC.get(ins.op)
        if ins.op == Op.kAsyncStart:
            wrapped = dict(ins.callees).get("async", "")
            root = self.mod.root(wrapped)
            kind = SYNC.get(root.op) if root is not None else None
            if root is None or kind is None:
                return [self._kernel(comp, ins)] if root is None else [self._kernel(wrapped, root)]
            inner = root
        assert kind is not None
        axes, group, _ = collective_axes(kind, inner.groups, inner.pairs, self.shape)
        size = self._result(comp, ins, inner).bytes
        ident = len(self.idents)
        self.idents[(comp, ins.name)] = ident
        sync = ins.op in SYNC or config_field(ins.config, "is_sync") is True
        start = Start(ident, Collective(kind, 1, size, axes, group), sync)
        return [start, Done(ident)] if ins.op in SYNC else [start]

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
        for where, dot in self._dots(comp, ins):
            f = opcodes.flops(self.mod, where, dot)
            if f > largest:
                largest, shape = f, _gemm_shape(self.mod, where, dot, f)
                dtype = _operand_dtype(self.mod, where, dot)
            flops += f
            named |= _attention_named(dot)
        fused = ins.target.startswith("__cudnn$fmha")
        if fused or named or self._attention(ins):
            kind = "attention"
        else:
            kind = "matmul" if flops else "memory"
        return Kernel(kind, flops, self._bytes(comp, ins), *shape, dtype if flops else "")

    def _attention(self, ins: Instr) -> bool:
        """Whether an instruction, or one it fuses, is named in an attention scope."""
        if _attention_named(ins):
            return True
        inner = self.mod.comps.get(dict(ins.callees).get("calls", ""), [])
        return ins.op == Op.kFusion and any(_attention_named(i) for i in inner)

    def _dots(self, comp: str, ins: Instr) -> list[tuple[str, Instr]]:
        """The instructions with FLOPs an instruction runs: itself, or inside the
        fusion it calls."""
        if ins.op != Op.kFusion:
            return [(comp, ins)]
        found, todo = [], [dict(ins.callees).get("calls", "")]
        while todo:
            inner = todo.pop()
            for each in self.mod.comps.get(inner, []):
                if each.op in (Op.kDot, Op.kConvolution, Op.kCustomCall):
                    found.append((inner, each))
                todo += [c for r, c in each.callees if r == "calls"]
        return found

    def _bytes(self, comp: str, ins: Instr) -> int:
        """What a kernel reads and writes: its operands (a sliced one as its slice, an
        updated one in place as nothing) and its result (an in-place update as the
        update; a library call's workspace left out); a hand-written kernel's as its
        cost estimate gives them, where it has one."""
        if ins.op == Op.kFusion:
            return _fusion_bytes(self.mod, comp, ins)
        estimate = kernel_estimate(ins)
        if estimate is not None and estimate[1]:  # a hand-written kernel's own figure
            return estimate[1]
        given = [self.mod.by_name[comp][o] for o in ins.operands if o in self.mod.by_name[comp]]
        if ins.op in _SLICING:
            return 2 * ins.bytes
        if ins.op == Op.kDynamicUpdateSlice and len(given) > 1:
            return 2 * given[1].bytes
        return sum(g.bytes for g in given) + _result_bytes(ins)


def _result_bytes(ins: Instr) -> int:
    """The bytes an instruction's result writes; a library call's workspace (a
    cuBLAS call's second result, 32 MiB of s8 on jax 0.12) left out (a hand-written
    kernel's results are all its own)."""
    result = ins.arrays
    if ins.op == Op.kCustomCall and ins.is_tuple and result and not is_kernel_call(ins):
        result = result[:1]
    return sum(array.bytes for array in result)


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


def _fusion_bytes(mod: Module, comp: str, ins: Instr) -> int:
    """A fusion's bytes: each operand as its fused parameter is read (`_read`), and
    its result as written (`_written`)."""
    callee = dict(ins.callees).get("calls", "")
    read = 0
    for j, operand in enumerate(ins.operands):
        given = mod.by_name[comp].get(operand)
        whole = given.bytes if given is not None else 0
        param = mod.param(callee, j)
        read += whole if param is None else _read(mod, callee, param, whole)
    root = mod.root(callee)
    return read + (_written(mod, callee, root) if root is not None else ins.bytes)


def _read(mod: Module, comp: str, name: str, whole: int) -> int:
    """The bytes of value `name` that its users read: the slices of it that slicing
    users take; nothing where it is the buffer an in-place update writes into, the
    operand of a collective fused into the kernel (libtpu's async collective
    fusions: the collective's traffic, timed on the links) or passed straight to the
    result (a buffer the fusion carries in place); what a nested fusion reads of
    it, and no more of an elementwise one than the slices its result is read as;
    else the whole. Bitcasts are followed."""
    total = 0
    for user, j in mod.users[comp].get(name, []):
        if user.op == Op.kBitcast:
            total += _read(mod, comp, user.name, whole)
        elif user.op in _SLICING and j == 0:
            total += user.bytes
        elif _untouched(user, j):
            continue
        elif user.op == Op.kFusion:
            total += _nested_read(mod, comp, user, j, whole)
        else:
            return whole
    return min(total, whole)


def _untouched(user: Instr, j: int) -> bool:
    """Whether a fusion's kernel leaves alone the value `user` takes as operand `j`:
    the buffer an in-place update writes into, a fused collective's operand, a
    buffer passed straight to the result (carried in place)."""
    if user.op == Op.kDynamicUpdateSlice and j == 0:
        return True
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
    if operand is None or not user.bytes or _elements(user) != _elements(operand):
        return inner
    demanded = _read(mod, comp, user.name, user.bytes)
    return min(inner, whole * demanded // user.bytes)


def _elements(ins: Instr) -> int:
    """The elements of an instruction's result (a tuple's summed)."""
    return sum(a.elements for a in ins.arrays)


def _written(mod: Module, comp: str, root: Instr) -> int:
    """The bytes a fusion's result writes: a tuple's elements each; an in-place
    update as its update; nothing for a parameter passed through (a buffer carried
    in place) or a fused collective's result (written by the collective, timed on
    the links)."""
    if root.op == Op.kTuple:
        parts = [mod.by_name[comp][o] for o in root.operands if o in mod.by_name[comp]]
        return sum(_written(mod, comp, part) for part in parts)
    if root.op == Op.kParameter or root.op in SYNC:
        return 0
    if root.op == Op.kBitcast and root.operands and root.operands[0] in mod.by_name[comp]:
        return _written(mod, comp, mod.by_name[comp][root.operands[0]])
    if root.op == Op.kDynamicUpdateSlice and len(root.operands) > 1:
        update = mod.by_name[comp].get(root.operands[1])
        return update.bytes if update is not None else 0
    return _result_bytes(root)  # a fused library call (jax 0.12's dynamic-slice fusion)


def read_schedule(module: Any, shape: Sequence[tuple[str, int]] = (), *, platform: str) -> Schedule:
    """The `Schedule` of a compiled module (jaxlib's ``HloModule``, its text, or an
    `instructions.Module`): its entry computation's events in the order the device runs
    them. `shape` is the mesh's ``(axis, size)`` pairs, which name each
    collective's axes as `hlo.read_step` does.

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
        Kernel(kind='matmul', flops=2147483648, bytes=6291456, batch=1, m=1024, n=1024, k=1024, dtype='bf16')
        >>> Schedule.from_json(schedule.to_json()) == schedule
        True
    """
    mod = Module.of(module)
    if mod.entry is None:
        return Schedule((), platform)
    reader = _Reader(mod, shape)
    events = reader.events(mod.entry)
    flags = (
        ("a loop whose trip count the compiler does not know: timed once",)
        if reader.unknown
        else ()
    )
    return Schedule(events, platform, flags)
