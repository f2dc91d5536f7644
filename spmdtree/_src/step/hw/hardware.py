"""Hardware and time: a roofline over what a compiled step computes and moves.

A step cannot run faster than its FLOPs at the chip's peak, nor than its
collectives at the links' bandwidth. `Hardware` holds those figures (the
presets list their public sources in docs/planning.md); `step_time` turns a
step's FLOPs and `Collective` rows into a `StepTime`: a lower bound on the
step (perfect overlap, peak FLOPs), not a prediction. Both records are frozen
and pickle; their mappings are `Frozen`, read-only dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.step.hlo.schedule import Schedule
from spmdtree._src.step.hw.chips import CHIPS, GpuChip, TpuChip, slice_dims, torus_links, wrapped
from spmdtree._src.step.kinds import CollectiveKind, LinkKind
from spmdtree._src.step.time.predict import Costs, predict

#: The link kinds, fastest first: within a node or slice, then across.
LINKS = tuple(LinkKind)

GIB = 2**30

K = TypeVar("K")
V = TypeVar("V")


class Frozen(Mapping[K, V]):
    """A read-only dict: compares equal to a dict of the same items, shows as
    one, and pickles (`types.MappingProxyType` refuses to).

    Example:
        >>> import pickle
        >>> links = Frozen({"ici": (4e11, 0.0)})
        >>> links, links == {"ici": (4e11, 0.0)}, pickle.loads(pickle.dumps(links)) == links
        ({'ici': (400000000000.0, 0.0)}, True, True)
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[K, V]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Frozen, (self._items,))


class Row(Protocol):
    """What timing reads of a collective row (`Collective` has these)."""

    @property
    def kind(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def axes(self) -> tuple[str, ...]: ...
    @property
    def group(self) -> int: ...


def _positive(value: object, what: str) -> None:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:  # type: ignore[arg-type]
        raise Mistake(ValueError, f"{what} is {value!r}; expected a number > 0.")


def check_devices_per_node(
    devices_per_node: object, what: str, none: str = "every device on one node"
) -> None:
    """Refuses a `devices_per_node` that is no int >= 1; `none` is what None means."""
    if (
        not isinstance(devices_per_node, (int, np.integer))
        or isinstance(devices_per_node, bool)
        or devices_per_node < 1
    ):
        raise Mistake(
            ValueError,
            f"{what} is {devices_per_node!r}; expected an int >= 1 (or None: {none}).",
        )


#: What a `Hardware` that leaves out a figure of the per-kernel model is predicted
#: with (new in 0.6; a prediction built on any of them says so in its flags): memory
#: kernels at 1 byte per 300 FLOPs of the peak at 0.9 of it (an H100's 989 TFLOP/s over
#: 3.35 TB/s is 295 FLOPs a byte, a TPU v5e's 240), matmuls at 0.8 of the peak (an
#: H100's and a B200's largest measured shares are 0.80 and 0.78) on one core (no wave
#: quantization) in tiles of 128, f32 matmuls at the bf16 rate (1/6 at the highest
#: precision: six bf16 passes), no launch overhead and no latency per collective beyond
#: the links' own.
DEFAULTS: Mapping[str, float] = {
    "flops_per_byte": 300.0,
    "memory_efficiency": 0.9,
    "matmul_efficiency": 0.8,
    "cores": 1,
    "tile": 128,
    "f32_speed": 1.0,
    "f32_highest_speed": 1 / 6,
    "launch_seconds": 0.0,
    "collective_latency_seconds": 0.0,
}

#: The per-kernel model's fields of a `Hardware`, each None where left out.
MODEL_FIELDS = (
    "hbm_bytes_per_second",
    "memory_efficiency",
    "matmul_efficiency",
    "cores",
    "tile",
    "f32_speed",
    "f32_highest_speed",
    "launch_seconds",
    "collective_latency_seconds",
)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and its links: every figure the roofline bound and the
    predicted step time use, carried whole (0.6: nothing is looked up by `name`).

    The first five fields are the roofline's (0.3); the rest, keyword-only and new
    in 0.6, are the per-kernel model's (docs/planning.md, "Predicted step time")
    and what the accelerator's compiler is told. A field of the model left out
    (None) takes its documented default (`DEFAULTS`), and a prediction built on
    one says so in `StepTime.flags`. The presets (`hardware`) give every figure.

    Attributes:
        name: what tables call it.
        memory_bytes: memory per device.
        flops_per_second: the dense bf16 peak per device.
        links: the link kinds ``"ici"`` (within a node or slice: NVLink, TPU
            ICI) and ``"dcn"`` (across: InfiniBand, data-centre network), each
            mapped to ``(bytes_per_second, latency_seconds)``: the bandwidth a
            ring collective gets per device on that link, and the latency per
            hop (0 to leave latency out); kept as a read-only dict.
        devices_per_node: how many consecutive devices (in the mesh's
            row-major order) share the fast link; None: every device does (one
            node, or one TPU slice).
        hbm_bytes_per_second: the memory bandwidth (default: the peak / 300).
        memory_efficiency: the share of it a memory-bound kernel sustains (0.9).
        matmul_efficiency: the largest share of the peak a matmul reaches (0.8).
        cores: the units a matmul's tiles are spread over: a GPU's SMs, 1 on a
            TPU (default 1: no wave quantization).
        tile: a matmul tile's side (cuBLAS's 128, the MXU's 128 or 256; 128).
        f32_speed: an f32 matmul's rate over the bf16 one at the default
            precision (a GPU's TF32: 0.5; default 1.0).
        f32_highest_speed: the same at the highest precision (1/6).
        launch_seconds: the overhead each kernel adds (XLA GPU's 1 us; 0).
        collective_latency_seconds: what each collective adds beyond the links'
            per-hop latency (XLA GPU's 5 us; 0).
        chip: what its compiler is told, for ``preflight(..., target=)``: a
            `GpuChip` (XLA GPU's target description) or a `TpuChip` (libtpu's
            generation and its slices' torus, which the links' time reads too);
            None: no compiler target, and links timed as one ring.

    Raises:
        ValueError: for a figure <= 0 (a latency < 0), a link kind other than
            ``"ici"``/``"dcn"``, or `devices_per_node` < 1.
        TypeError: for a `chip` that is no `GpuChip` or `TpuChip`.

    Example:
        >>> import dataclasses, spmdtree as st
        >>> gpu = st.Hardware("mine", 80 * 2**30, 1e15, {"ici": (400e9, 2e-6), "dcn": (50e9, 5e-6)}, 8)
        >>> gpu.links["dcn"], gpu.hbm_bytes_per_second
        ((50000000000.0, 5e-06), None)
        >>> gpu.left_out[:2]
        ('hbm_bytes_per_second', 'memory_efficiency')
        >>> dataclasses.replace(st.hardware("h100"), name="mine").left_out  # a preset's figures
        ()
        >>> st.Hardware("bad", 1, 1e15, {"nvlink": (1e9, 0.0)})
        Traceback (most recent call last):
        ...
        ValueError: Hardware: links has a link kind 'nvlink'; the kinds are 'ici' (within a node or slice) and 'dcn' (across).
    """

    name: str
    memory_bytes: int
    flops_per_second: float
    links: Mapping[str, tuple[float, float]] = dataclasses.field(hash=False)
    devices_per_node: int | None = None
    _: dataclasses.KW_ONLY
    hbm_bytes_per_second: float | None = None
    memory_efficiency: float | None = None
    matmul_efficiency: float | None = None
    cores: int | None = None
    tile: int | None = None
    f32_speed: float | None = None
    f32_highest_speed: float | None = None
    launch_seconds: float | None = None
    collective_latency_seconds: float | None = None
    chip: GpuChip | TpuChip | None = None

    @functools.partial(public, name="Hardware")
    def __post_init__(self) -> None:
        _positive(self.memory_bytes, "memory_bytes")
        _positive(self.flops_per_second, "flops_per_second")
        if not isinstance(self.links, Mapping) or not self.links:
            raise Mistake(
                ValueError,
                f"links is {self.links!r}; expected a mapping of 'ici' and/or 'dcn' to "
                "(bytes_per_second, latency_seconds).",
            )
        links = {}
        for kind, figures in self.links.items():
            if kind not in LINKS:
                raise Mistake(
                    ValueError,
                    f"links has a link kind {kind!r}; the kinds are 'ici' (within a node or "
                    "slice) and 'dcn' (across).",
                )
            if not isinstance(figures, Sequence) or len(figures) != 2:
                raise Mistake(
                    ValueError,
                    f"links[{kind!r}] is {figures!r}; expected (bytes_per_second, "
                    "latency_seconds).",
                )
            _positive(figures[0], f"links[{kind!r}] bandwidth")
            if figures[1] != 0:
                _positive(figures[1], f"links[{kind!r}] latency")
            links[LinkKind(kind)] = (float(figures[0]), float(figures[1]))
        if self.devices_per_node is not None:
            check_devices_per_node(self.devices_per_node, "devices_per_node")
        self._check_model()
        if self.chip is not None and not isinstance(self.chip, (GpuChip, TpuChip)):
            raise Mistake(
                TypeError,
                f"chip is {self.chip!r}; expected a st.GpuChip, a st.TpuChip or None.",
            )
        object.__setattr__(self, "links", Frozen(links))

    def _check_model(self) -> None:
        """The model's figures: each > 0 (latencies >= 0), the shares at most 1
        where a share is meant, cores and tile whole numbers."""
        for what in MODEL_FIELDS:
            value = getattr(self, what)
            if value is None or (what.endswith("_seconds") and value == 0):
                continue
            _positive(value, what)
            if what in ("cores", "tile") and (
                not isinstance(value, (int, np.integer)) or isinstance(value, bool)
            ):
                raise Mistake(ValueError, f"{what} is {value!r}; expected an int >= 1.")
            if what.endswith("_efficiency") and value > 1:
                raise Mistake(
                    ValueError, f"{what} is {value!r}; expected a share of the peak, 0 to 1."
                )

    @property
    def left_out(self) -> tuple[str, ...]:
        """The per-kernel model's fields this hardware leaves to their defaults
        (`DEFAULTS`), in field order (new in 0.6).

        Example:
            >>> import spmdtree as st
            >>> st.hardware("tpu-v5e").left_out
            ()
        """
        return tuple(what for what in MODEL_FIELDS if getattr(self, what) is None)

    def costs(self) -> Costs:
        """The per-kernel model's figures (`predict.Costs`), each left-out one at its
        default."""
        figure = {
            what: DEFAULTS[what] if getattr(self, what) is None else getattr(self, what)
            for what in MODEL_FIELDS[1:]
        }
        hbm = self.hbm_bytes_per_second or self.flops_per_second / DEFAULTS["flops_per_byte"]
        tile = int(figure.pop("tile"))
        return Costs(
            hbm_bytes_per_second=float(hbm),
            cores=int(figure.pop("cores")),
            tile=(tile, tile),
            **figure,
        )


#: The presets, built from `chips.CHIPS` alone (every figure's source is listed there
#: and in docs/planning.md, "Hardware and time"). A GPU's memory is what the device
#: reports, the bytes its compiler target is given too; a TPU's is its data sheet's GB
#: read as GiB. Latencies are rough.
PRESETS = {name: Hardware(name, **figures) for name, figures in CHIPS.items()}


@public
def hardware(name: str) -> Hardware:
    """A preset `Hardware`: ``"a100"``, ``"h100"``, ``"h200"``, ``"b200"``,
    ``"tpu-v5e"``, ``"tpu-v5p"`` or ``"tpu-v6e"`` (``"a100"`` new in 0.6).

    The figures are the vendors' data sheets and the JAX team's scaling book
    (docs/planning.md lists each with its source); latencies are rough. A preset
    gives every figure of the model (`Hardware.left_out` is empty), and its
    `chip` is what its compiler is told.

    Args:
        name: the preset's name.

    Returns:
        The `Hardware`.

    Raises:
        ValueError: for a name that is no preset (the message lists them).

    Example:
        >>> import spmdtree as st
        >>> h100 = st.hardware("h100")
        >>> h100.flops_per_second, h100.devices_per_node, h100.links["ici"][0], h100.cores
        (989000000000000.0, 8, 450000000000.0, 132)
    """
    if name not in PRESETS:
        raise Mistake(
            ValueError,
            f"there is no preset {name!r}; the presets are {', '.join(map(repr, PRESETS))}. "
            "Build your own with st.Hardware(name, memory_bytes, flops_per_second, links).",
        )
    return PRESETS[name]


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A roofline bound on one step, its compute and its collectives, in seconds;
    and, where the compiled schedule was walked, a predicted time (new in 0.5).

    `bound_seconds` is not a prediction: it assumes peak FLOPs and collectives
    that overlap compute perfectly, each at its links' full bandwidth.
    `predicted_seconds` walks the compiled module's schedule, each kernel timed
    by a model and an async collective overlapping only the compute scheduled
    between its start and its done (docs/planning.md, "Predicted step time").

    Attributes:
        compute_seconds: the step's FLOPs per device at the peak.
        comm_by_axes: collective seconds per mesh-axes tuple.
        flops_per_second: the peak the FLOPs were timed at (the hardware's;
            `StepPlan.time` sets it), which `mfu` needs for model FLOPs; None
            if unknown (new in 0.4).
        predicted_seconds: the predicted step time; None where no schedule was
            walked (new in 0.5).
        exposed_comm_seconds: the part of it spent waiting for collectives;
            None likewise (new in 0.5).
        predicted_by_class: the predicted time split by class: ``matmul``,
            ``attention``, ``memory`` (memory-bound kernels), ``collectives``
            (exposed) and ``launch`` (kernel launches), summing to
            `predicted_seconds`; a read-only dict, or None likewise (new in 0.5).
        flags: what the prediction rests on beyond the compiled schedule: the
            model's defaults it took for figures the hardware leaves out, loops
            of unknown trip count timed once (new in 0.6).

    Raises:
        ValueError: for a `flops_per_second` <= 0, or a prediction < 0.
        TypeError: for a `comm_by_axes` or `predicted_by_class` that is not a
            mapping.

    Example:
        >>> import spmdtree as st
        >>> t = st.StepTime(compute_seconds=0.5, comm_by_axes={("fsdp",): 0.25, ("tensor",): 0.5})
        >>> t.comm_seconds, t.bound_seconds, t.serial_seconds, t.predicted_seconds
        (0.75, 0.75, 1.25, None)
        >>> t.mfu(1.0)  # a real step of 1 s used half the peak
        0.5
    """

    compute_seconds: float
    comm_by_axes: Mapping[tuple[str, ...], float] = dataclasses.field(hash=False)
    flops_per_second: float | None = None
    predicted_seconds: float | None = None
    exposed_comm_seconds: float | None = None
    predicted_by_class: Mapping[str, float] | None = dataclasses.field(default=None, hash=False)
    flags: tuple[str, ...] = ()

    @functools.partial(public, name="StepTime")
    def __post_init__(self) -> None:
        if not isinstance(self.comm_by_axes, Mapping):
            raise Mistake(
                TypeError,
                f"comm_by_axes is {self.comm_by_axes!r}; expected a mapping of mesh-axes "
                "tuples to seconds, e.g. {('fsdp',): 0.25}.",
            )
        if self.flops_per_second is not None:
            _positive(self.flops_per_second, "flops_per_second")
        object.__setattr__(self, "comm_by_axes", Frozen(self.comm_by_axes))
        for what in ("predicted_seconds", "exposed_comm_seconds"):
            value = getattr(self, what)
            if value is not None and value != 0:
                _positive(value, what)
        if self.predicted_by_class is not None:
            if not isinstance(self.predicted_by_class, Mapping):
                raise Mistake(
                    TypeError,
                    f"predicted_by_class is {self.predicted_by_class!r}; expected a mapping "
                    "of class names to seconds, e.g. {'matmul': 0.5, 'memory': 0.1}.",
                )
            object.__setattr__(self, "predicted_by_class", Frozen(self.predicted_by_class))

    @property
    def comm_seconds(self) -> float:
        """The collectives' seconds, summed."""
        return sum(self.comm_by_axes.values())

    @property
    def bound_seconds(self) -> float:
        """max(compute, collectives): perfect overlap, a lower bound on the step."""
        return max(self.compute_seconds, self.comm_seconds)

    @property
    def serial_seconds(self) -> float:
        """compute + collectives: no overlap at all."""
        return self.compute_seconds + self.comm_seconds

    @public
    def mfu(self, step_seconds: float, model_flops: float | None = None) -> float:
        """The share of the peak a real step of `step_seconds` used.

        Without `model_flops`, hardware FLOPs: compute_seconds / step_seconds,
        every FLOP the compiled step runs (a rematerialised forward pass
        counts). With `model_flops`, the model's FLOPs per device per step
        (e.g. 6 x params x tokens / devices for a dense decoder's training
        step), as published MFU counts them: model_flops / flops_per_second /
        step_seconds (`model_flops` new in 0.4).

        Args:
            step_seconds: how long a real step took.
            model_flops: the model's FLOPs per device per step, or None.

        Returns:
            The share of the peak, 0 to 1 for a real step.

        Raises:
            ValueError: for a time or a `model_flops` <= 0, or `model_flops`
                given to a StepTime without `flops_per_second`.

        Example:
            >>> import spmdtree as st
            >>> t = st.StepTime(compute_seconds=0.4, comm_by_axes={}, flops_per_second=1e15)
            >>> t.mfu(1.0)  # the compiled step's 4e14 FLOPs, recompute included
            0.4
            >>> t.mfu(1.0, model_flops=3e14)  # the model's own FLOPs
            0.3
        """
        _positive(step_seconds, "step_seconds")
        if model_flops is None:
            return self.compute_seconds / step_seconds
        _positive(model_flops, "model_flops")
        if self.flops_per_second is None:
            raise Mistake(
                ValueError,
                f"model_flops is {model_flops!r}, but this StepTime has no flops_per_second "
                "to turn FLOPs into seconds. Take the StepTime from StepPlan.time(hardware), "
                "which sets it, or build it with flops_per_second=.",
            )
        return model_flops / self.flops_per_second / step_seconds


def nodes_spanned(shape: Sequence[int], varying: Sequence[int], devices_per_node: int) -> int:
    """The most distinct nodes one device group touches: groups vary over the mesh
    positions `varying` (the others fixed); devices sit on nodes by their
    row-major position // `devices_per_node`."""
    if not varying:
        return 1
    positions = np.arange(math.prod(shape)).reshape(tuple(shape))
    rest = [i for i in range(len(shape)) if i not in varying]
    groups = positions.transpose(rest + list(varying)).reshape(
        -1, math.prod(shape[i] for i in varying)
    )
    nodes = np.sort(groups // devices_per_node, axis=1)
    return int(1 + (np.diff(nodes, axis=1) != 0).sum(axis=1).max())


def _bytes_per_kind(row: Row, g: Mapping[str, float]) -> dict[str, float]:
    """The bytes each device sends across each link kind by the hierarchical
    algorithm: `g` holds the group's size on each kind, fastest first."""
    kind = CollectiveKind(row.kind)
    if kind is CollectiveKind.COLLECTIVE_PERMUTE:  # its size, on the slowest link it crosses
        slowest = [k for k in LINKS if g[k] > 1][-1:] or [LinkKind.ICI]
        return {slowest[0]: float(row.bytes)}
    if kind is CollectiveKind.ALL_TO_ALL:  # that data must cross every kind, not divided
        return {k: (g[k] - 1) / g[k] * row.bytes for k in LINKS}
    factor, volume = float(kind.passes), kind.moved(row.bytes, row.group)
    out: dict[str, float] = {}
    faster = 1.0
    for k in LINKS:
        out[k] = factor * (g[k] - 1) / g[k] * volume / faster
        faster *= g[k]
    return out


def collective_seconds(
    row: Row, shape: Mapping[str, int], hw: Hardware, devices_per_node: int | None
) -> float:
    """One row's seconds on `hw`: the slowest of the link kinds it crosses, each
    its bytes / bandwidth + latency x (group on that kind - 1) per op.

    The slowest, not the sum: NCCL splits a collective into chunks and
    pipelines them, so the NVLink stage of one chunk runs while another
    crosses the network, and the slower stage sets the pace (a multi-slice
    TPU collective is timed the same way). The JAX scaling book ("How to
    Think About GPUs", cross-node collectives) times a 2-node all-gather of B
    bytes so: max(B (8-1)/8 / 450e9 within the node, B (2-1)/2 / 400e9 of
    node egress across), 130 us for 64 MiB on H100s (a sum would say 214 us).

    On a TPU preset the ICI figure is one torus axis's (both directions, round
    its wraparound): a group that spans several axes of its slice's torus (a
    v5e-256's 256 chips span both of its 16 x 16) sends over each, so its
    bandwidth is that many times the figure (the scaling book's V / (W_ici x
    axes)), and an axis without wraparound links (a v5e axis shorter than 16, a
    v5p slice that is not whole 4x4x4 cubes) is a line that adds half the
    figure (`chips.torus_links`; new in 0.5).
    """
    if row.group <= 1:
        return 0.0
    names = list(shape)
    varying = [names.index(a) for a in row.axes if a in names]
    per_node = devices_per_node or math.prod(shape.values())
    span = nodes_spanned(list(shape.values()), varying, per_node)
    g_dcn = float(min(span, row.group))
    g = {"ici": row.group / g_dcn, "dcn": g_dcn}
    seconds = 0.0
    for kind, sent in _bytes_per_kind(row, g).items():
        if g[kind] <= 1:
            continue
        if kind not in hw.links:
            raise Mistake(
                ValueError,
                f"a {row.kind} over {row.axes} crosses {int(g[kind])} "
                f"{'nodes' if kind == 'dcn' else 'devices of a node'}, but hardware "
                f"{hw.name!r} has no {kind!r} link. Add one to its links.",
            )
        bandwidth, latency = hw.links[kind]
        if kind == "ici":
            bandwidth *= _torus_links(hw, g["ici"], per_node)
        seconds = max(seconds, sent / bandwidth + row.count * latency * (g[kind] - 1))
    return seconds


def _torus_links(hw: Hardware, group: float, slice_chips: int) -> float:
    """How many times its ICI figure an ICI group of `group` chips sends at on a slice
    of `slice_chips` of a TPU's torus (`chips.torus_links`); 1 on anything else (a GPU
    node, a hardware with no `TpuChip`)."""
    chip = hw.chip
    if not isinstance(chip, TpuChip) or not chip.dimensions:
        return 1.0
    dims = slice_dims(slice_chips, chip.dimensions)
    return torus_links(round(group), dims, wrapped(dims, chip.wraparound, chip.cubes))


def step_time(
    collectives: Iterable[Row],
    flops: float,
    shape: Mapping[str, int],
    hw: Hardware,
    devices_per_node: int | None = None,
    schedule: Schedule | None = None,
) -> StepTime:
    """The `StepTime` of a step with these FLOPs per device and collectives on a
    mesh of this shape (axis name -> size), on `hw`; with the compiled module's
    `schedule` (`predict.read_schedule`), its predicted time too, timed by the
    hardware's own figures (new in 0.5; 0.6: any `Hardware`, its defaults said)."""
    if not isinstance(hw, Hardware):
        raise Mistake(
            TypeError, f"hardware is {hw!r}; expected a st.Hardware (st.hardware('h100'))."
        )
    if devices_per_node is not None:
        check_devices_per_node(devices_per_node, "devices_per_node")
    per_node = hw.devices_per_node if devices_per_node is None else devices_per_node
    by_axes: dict[tuple[str, ...], float] = {}
    for row in collectives:
        seconds = collective_seconds(row, shape, hw, per_node)
        by_axes[tuple(row.axes)] = by_axes.get(tuple(row.axes), 0.0) + seconds
    bound = StepTime(flops / hw.flops_per_second, by_axes, hw.flops_per_second)
    if schedule is None:
        return bound
    timed = functools.cache(lambda row: collective_seconds(row, shape, hw, per_node))
    said = predict(schedule, hw.costs(), hw.flops_per_second, timed)
    return dataclasses.replace(
        bound,
        predicted_seconds=said.seconds,
        exposed_comm_seconds=said.exposed_comm_seconds,
        predicted_by_class=said.by_class,
        flags=(*_defaults_said(hw), *schedule.flags),
    )


def _defaults_said(hw: Hardware) -> Iterator[str]:
    """The sentence for a prediction built on the model's defaults."""
    if hw.left_out:
        yield (
            f"hardware {hw.name!r} leaves out {', '.join(hw.left_out)}: the prediction "
            "takes their defaults (st.Hardware's docstring lists them); give the chip's "
            "own figures for a prediction of it"
        )
