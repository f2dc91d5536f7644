"""Hardware: every figure of a chip that the bound and the prediction use, carried
whole (0.6: nothing is looked up by a hardware's name).

`Hardware` holds the peak, memory, links and node layout, and the per-kernel
model's figures (`Costs`, filled with `DEFAULTS` where left out); the presets
are built from `chips.CHIPS` alone and list their public sources in
docs/planning.md. The records are frozen and pickle; their mappings are
`Frozen`, read-only dicts. The time they give is `time.bound`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.step.hw.chips import CHIPS, GpuChip, TpuChip
from spmdtree._src.step.hw.grid import Point, checked_grid
from spmdtree._src.step.kinds import LinkKind, bits

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


def positive(value: object, what: str) -> None:
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


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the per-kernel model needs of a chip beyond its peak and its links: a
    `Hardware`'s model figures, its defaults filled in (`Hardware.costs`; 0.6: no
    table of them by a preset's name).

    Attributes:
        hbm_bytes_per_second: the memory bandwidth (data sheet).
        memory_efficiency: the share of it a memory-bound kernel sustains.
        matmul_efficiency: the largest share of the peak a matmul reaches (a
            large, well-shaped one).
        cores: the units a matmul's tiles are spread over (SMs; 1 on a TPU,
            whose MXUs work on one tile stream).
        tile: a matmul tile's (m, n) on that chip.
        launch_seconds: the fixed cost each kernel adds beyond its work (a TPU
            preset's 0: one program; `st.calibrate` measures it, new in 0.8).
        access_seconds: what a kernel that reads a value in HBM adds beyond that,
            and again one that writes one (`Kernel.hbm_waits`): the wait for the
            memory's first access (0 where left out; `st.calibrate` measures it,
            new in 0.8).
        collective_latency_seconds: the latency each collective adds beyond
            the links' per-hop latency.
        f32_speed: an f32 matmul's peak over the bf16 one at the default
            precision (a GPU runs it as TF32, half the rate; a TPU in one bf16
            pass); 8-bit matmuls run at twice the bf16 rate.
        f32_highest_speed: likewise at the highest precision (a GPU's FP32
            units; a TPU's six bf16 passes).
        flash_forward_efficiency: the share of the peak a flash-attention
            kernel's forward reaches (cuDNN's, jax's Pallas kernels; new in 0.6).
        flash_backward_efficiency: the same for its backward kernels.
        update_efficiency: the share of the bandwidth an unfused in-place update
            at a run-time offset into a tiled dimension sustains
            (`Kernel.unfused_update`; new in 0.7).
        grouped_efficiency: the share of the peak a grouped matmul reaches
            (`jax.lax.ragged_dot` and its transposes, their FLOPs the groups';
            `Kernel.grouped`; new in 0.8).
        indexed_efficiency: the share of the bandwidth a kernel that gathers or
            scatters rows by index sustains over what it moves (`Kernel.indexed`;
            new in 0.8).
        eight_bit_speed: an 8-bit matmul's rate over the bf16 one (int8 on a TPU,
            fp8 on a GPU; new in 0.8).
        matmul_grid: the shares of the bf16 peak measured by shape, ``(m, k, n,
            share)`` (`grid.grid_share` reads a matmul's; empty: the largest share
            times the wave efficiency; new in 0.8).
        fused_update_efficiency: the share of its shape's rate a matmul keeps with
            an optimizer's update fused into its kernel (`Kernel.fused_update`; new
            in 0.8).
        on_chip_bytes_per_second: the rate a kernel with no matmul moves what it
            reads and writes in the chip's own memory (`Kernel.on_chip`: a TPU's
            ``S(1)``), and a matmul the rows it gathers there by index; 0: free,
            as in 0.7 (new in 0.8).
        read_efficiency: the share of the bandwidth a kernel that only reads HBM
            sustains (`Kernel.reads_only`: a reduction); 0: `memory_efficiency`
            (new in 0.8).
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
    flash_forward_efficiency: float = 0.5
    flash_backward_efficiency: float = 0.5
    update_efficiency: float = 0.23
    grouped_efficiency: float = 0.5
    indexed_efficiency: float = 0.9
    eight_bit_speed: float = 2.0
    matmul_grid: tuple[Point, ...] = ()
    access_seconds: float = 0.0
    fused_update_efficiency: float = 1.0
    on_chip_bytes_per_second: float = 0.0
    read_efficiency: float = 0.0

    def speed(self, dtype: str) -> float:
        """A matmul's peak over the bf16 one for operands of `dtype`."""
        width = bits(dtype.partition("/")[0]) if dtype else 16
        if width <= 8:
            return self.eight_bit_speed
        if width >= 32:
            return self.f32_highest_speed if dtype.endswith("/highest") else self.f32_speed
        return 1.0


#: What a `Hardware` that leaves out a figure of the per-kernel model is predicted
#: with (new in 0.6; a prediction built on any of them says so in its flags): memory
#: kernels at 1 byte per 300 FLOPs of the peak at 0.9 of it (an H100's 989 TFLOP/s over
#: 3.35 TB/s is 295 FLOPs a byte, a TPU v5e's 240), matmuls at 0.8 of the peak (an
#: H100's and a B200's largest measured shares are 0.80 and 0.78) on one core (no wave
#: quantization) in tiles of 128, f32 matmuls at the bf16 rate (1/6 at the highest
#: precision: six bf16 passes), flash-attention kernels at half the peak each way (the
#: published shares cited in chips.py run from 0.52 to 0.73; none is published for a
#: TPU), unfused updates at a run-time offset into a tiled dimension at 0.23 of the
#: bandwidth (st.calibrate's update benchmark on a TPU v5e, 2026-12-06: the only chip
#: measured; new in 0.7), grouped matmuls at half the peak, as an unmeasured flash
#: kernel, rows gathered and scattered by index at the memory kernels' share (the
#: hardware's own where it gives one; new in 0.8), 8-bit matmuls at twice the bf16
#: rate (every preset's data sheet says so; new in 0.8), a matmul with an optimizer's
#: update fused into it at its shape's rate (none is published; new in 0.8), what a
#: kernel moves in the chip's own memory (a TPU's ``S(1)``) at no cost (none is
#: published; new in 0.8), a kernel that only reads HBM at the memory kernels' share
#: (the hardware's own where it gives one; new in 0.8), no launch overhead, no wait
#: for the memory's first access (none is published; new in 0.8) and no latency per
#: collective beyond the links' own.
DEFAULTS: Mapping[str, float] = {
    "flops_per_byte": 300.0,
    "memory_efficiency": 0.9,
    "matmul_efficiency": 0.8,
    "cores": 1,
    "tile": 128,
    "f32_speed": 1.0,
    "f32_highest_speed": 1 / 6,
    "flash_forward_efficiency": 0.5,
    "flash_backward_efficiency": 0.5,
    "update_efficiency": 0.23,
    "grouped_efficiency": 0.5,
    "indexed_efficiency": 0.9,
    "eight_bit_speed": 2.0,
    "fused_update_efficiency": 1.0,
    "on_chip_bytes_per_second": 0.0,
    "read_efficiency": 0.9,
    "launch_seconds": 0.0,
    "access_seconds": 0.0,
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
    "flash_forward_efficiency",
    "flash_backward_efficiency",
    "update_efficiency",
    "grouped_efficiency",
    "indexed_efficiency",
    "eight_bit_speed",
    "fused_update_efficiency",
    "on_chip_bytes_per_second",
    "read_efficiency",
    "launch_seconds",
    "access_seconds",
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
    one says so in `StepTime.flags`. The presets (`hardware`) give every figure
    but a TPU's flash-attention shares, which no source publishes, and the
    unfused-update share of a TPU other than the v5e.

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
        flash_forward_efficiency: the share of the peak a flash-attention
            kernel's forward reaches (cuDNN's fused attention, jax's Pallas
            attention kernels: their FLOPs over it; new in 0.6; default 0.5).
        flash_backward_efficiency: the same for its backward kernels (0.5).
        update_efficiency: the share of the bandwidth a TPU's unfused in-place
            update sustains where its offset, known only when it runs, falls in
            a dimension the layout tiles (a blocked attention writing each
            block's output; `st.calibrate` measures it; new in 0.7; 0.23).
        grouped_efficiency: the share of the peak a grouped matmul reaches
            (`jax.lax.ragged_dot` and its transposes, an expert layer's, their
            FLOPs those of the groups they multiply; `st.calibrate` measures it;
            new in 0.8; 0.5, as an unmeasured flash kernel's).
        indexed_efficiency: the share of the bandwidth a kernel that gathers or
            scatters rows by index sustains over what it moves (an expert layer's
            dispatch and combine; `st.calibrate` measures it; new in 0.8; left out,
            the memory kernels' share, `memory_efficiency`).
        eight_bit_speed: an 8-bit matmul's rate over the bf16 one: int8 on a TPU,
            fp8 (or int8) on a GPU (`st.calibrate` measures it; every preset's
            data sheet says 2; new in 0.8; 2.0, and a step that runs one on a
            chip that leaves it out is told so).
        fused_update_efficiency: the share of its shape's rate a matmul keeps where
            the compiler fuses an optimizer's update into its kernel (libtpu fuses
            adamw's into each weight's gradient: `Kernel.fused_update`;
            `st.calibrate` measures it; none is published; new in 0.8; 1.0).
        on_chip_bytes_per_second: the rate at which a kernel moves what it reads
            and writes in the chip's own memory (a TPU's ``S(1)``, where libtpu
            keeps arrays between kernels: `Kernel.on_chip`), beside its HBM
            traffic, the slower of the two its memory time; a kernel with a matmul
            reads its operands there as it multiplies, in its measured share, and
            only rows it gathers there by index move at this rate (`st.calibrate`
            measures it on a TPU: the copies into another layout of a chain of
            passes on an array libtpu keeps there; none is published; new in 0.8;
            left out, such bytes are free, as in 0.7, and rows a kernel gathers or
            scatters there move at `indexed_efficiency` of HBM's bandwidth).
        read_efficiency: the share of the bandwidth a kernel sustains that reads
            HBM and writes next to nothing there (`Kernel.reads_only`: a
            reduction, a matmul whose result stays on the chip; `st.calibrate`
            measures it: a sum over a large array; none is published; new in 0.8;
            left out, the memory kernels' share, `memory_efficiency`).
        matmul_grid: the share of the bf16 peak matmuls reach by shape, as
            ``(m, k, n, share)`` points of a full grid ((m, k) x (k, n); a
            convolution's output positions, window x input features, output
            features): `st.calibrate` measures it. A matmul's share is then read
            by its shape, each dimension padded to `tile` (one narrower, where
            the grid measured that narrow, read as measured), log-linear between
            the grid's points; None: `matmul_efficiency` for every shape, times the
            wave efficiency (new in 0.8).
        launch_seconds: the fixed cost each kernel adds beyond its work (XLA
            GPU's 1 us; 0; `st.calibrate` measures it, new in 0.8).
        access_seconds: what a kernel that reads a value in HBM (not in the
            chip's own memory, a TPU's ``S(1)``) adds beyond its launch, whatever
            its size, and again one that writes one (`Kernel.hbm_waits`): the wait
            for the memory's first access, most of a tiny kernel's time (a TPU's
            scalar loops: an index read, a row updated) and next to none of a
            large one's (`st.calibrate` measures it on a TPU; no data sheet gives
            it; 0; new in 0.8).
        collective_latency_seconds: what each collective adds beyond the links'
            per-hop latency (XLA GPU's 5 us; 0).
        chip: what its compiler is told, for ``preflight(..., target=)``: a
            `GpuChip` (XLA GPU's target description) or a `TpuChip` (libtpu's
            generation and its slices' torus, which the links' time reads too);
            None: no compiler target, and links timed as one ring.
        provenance: where figures came from, by field name (``"matmul_efficiency":
            "measured 2026-12-06 on TPU v5 lite, jax 0.10.2, libtpu 0.0.42.1"``,
            or a preset's source); a read-only dict, empty for none said (new
            in 0.7: `st.calibrate` fills it, and the presets name their table).

    Raises:
        ValueError: for a figure <= 0 (a latency < 0), a link kind other than
            ``"ici"``/``"dcn"``, `devices_per_node` < 1, or a provenance for
            a field `Hardware` does not have.
        TypeError: for a `chip` that is no `GpuChip` or `TpuChip`.

    Example:
        >>> import dataclasses, spmdtree as st
        >>> gpu = st.Hardware("mine", 80 * 2**30, 1e15, {"ici": (400e9, 2e-6), "dcn": (50e9, 5e-6)}, 8)
        >>> gpu.links["dcn"], gpu.hbm_bytes_per_second
        ((50000000000.0, 5e-06), None)
        >>> gpu.left_out[:2]
        ('hbm_bytes_per_second', 'memory_efficiency')
        >>> dataclasses.replace(st.hardware("h100"), name="mine").left_out  # a preset's figures
        ('grouped_efficiency', 'indexed_efficiency', 'fused_update_efficiency', 'on_chip_bytes_per_second', 'read_efficiency')
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
    flash_forward_efficiency: float | None = None
    flash_backward_efficiency: float | None = None
    update_efficiency: float | None = None
    grouped_efficiency: float | None = None
    indexed_efficiency: float | None = None
    eight_bit_speed: float | None = None
    fused_update_efficiency: float | None = None
    on_chip_bytes_per_second: float | None = None
    read_efficiency: float | None = None
    matmul_grid: tuple[Point, ...] | None = None
    launch_seconds: float | None = None
    access_seconds: float | None = None
    collective_latency_seconds: float | None = None
    chip: GpuChip | TpuChip | None = None
    provenance: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)

    @functools.partial(public, name="Hardware")
    def __post_init__(self) -> None:
        positive(self.memory_bytes, "memory_bytes")
        positive(self.flops_per_second, "flops_per_second")
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
            positive(figures[0], f"links[{kind!r}] bandwidth")
            if figures[1] != 0:
                positive(figures[1], f"links[{kind!r}] latency")
            links[LinkKind(kind)] = (float(figures[0]), float(figures[1]))
        if self.devices_per_node is not None:
            check_devices_per_node(self.devices_per_node, "devices_per_node")
        self._check_model()
        if self.matmul_grid is not None:
            object.__setattr__(self, "matmul_grid", checked_grid(self.matmul_grid))
        if self.chip is not None and not isinstance(self.chip, (GpuChip, TpuChip)):
            raise Mistake(
                TypeError,
                f"chip is {self.chip!r}; expected a st.GpuChip, a st.TpuChip or None.",
            )
        object.__setattr__(self, "links", Frozen(links))
        object.__setattr__(self, "provenance", Frozen(_checked_provenance(self.provenance)))

    def _check_model(self) -> None:
        """The model's figures: each > 0 (latencies >= 0), the shares at most 1
        where a share is meant, cores and tile whole numbers."""
        for what in MODEL_FIELDS:
            value = getattr(self, what)
            if value is None or (what.endswith("_seconds") and value == 0):
                continue
            positive(value, what)
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
            >>> st.hardware("h100").left_out  # no grouped matmul's share is published
            ('grouped_efficiency', 'indexed_efficiency', 'fused_update_efficiency', 'on_chip_bytes_per_second', 'read_efficiency')
            >>> st.hardware("tpu-v5e").left_out[:2]  # nor a TPU flash kernel's
            ('flash_forward_efficiency', 'flash_backward_efficiency')
        """
        return tuple(what for what in MODEL_FIELDS if getattr(self, what) is None)

    def costs(self) -> Costs:
        """The per-kernel model's figures (`Costs`), each left-out one at its
        default (rows moved by index, left out, at the memory kernels' share)."""
        figure = {
            what: DEFAULTS[what] if getattr(self, what) is None else getattr(self, what)
            for what in MODEL_FIELDS[1:]
        }
        for share in ("indexed_efficiency", "read_efficiency"):  # the memory kernels'
            if getattr(self, share) is None:
                figure[share] = figure["memory_efficiency"]
        hbm = self.hbm_bytes_per_second or self.flops_per_second / DEFAULTS["flops_per_byte"]
        tile = int(figure.pop("tile"))
        return Costs(
            hbm_bytes_per_second=float(hbm),
            cores=int(figure.pop("cores")),
            tile=(tile, tile),
            matmul_grid=self.matmul_grid or (),
            **figure,
        )

    def to_json(self) -> str:
        """This hardware as JSON text, in the versioned schema ``"spmdtree.Hardware/1"``:
        every field by name, links as ``[bytes_per_second, latency_seconds]``, the
        chip as its fields and its ``kind`` (``"gpu"``, ``"tpu"``), the provenance
        (new in 0.7). `Hardware.from_json` reads it back equal.

        Example:
            >>> import json, spmdtree as st
            >>> data = json.loads(st.hardware("tpu-v5e").to_json())
            >>> data["schema"], data["chip"]["kind"], data["links"]["ici"]
            ('spmdtree.Hardware/1', 'tpu', [90000000000.0, 1e-06])
        """
        data: dict[str, Any] = {"schema": HARDWARE_SCHEMA}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "links":
                value = {str(kind): list(figures) for kind, figures in value.items()}
            elif field.name == "chip" and value is not None:
                kind = "gpu" if isinstance(value, GpuChip) else "tpu"
                value = {"kind": kind, **dataclasses.asdict(value)}
            elif field.name == "provenance":
                value = dict(value)
            data[field.name] = value
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Hardware:
        """A `Hardware` from `Hardware.to_json`'s text, or a path to a file of it
        (new in 0.7: ``st.calibrate().to_json()`` saved on one machine times steps
        on another; the command line's ``--hardware chip.json``).

        Args:
            source: the JSON text (starting with ``{``), or a file's path.

        Returns:
            The `Hardware`, equal to the one written.

        Raises:
            ValueError: for a file that cannot be read, text that is not JSON of
                the schema, a field missing or not known (named), or a figure
                `Hardware` refuses.
            TypeError: for a source that is neither text nor a path.

        Example:
            >>> import spmdtree as st
            >>> h100 = st.hardware("h100")
            >>> st.Hardware.from_json(h100.to_json()) == h100
            True
            >>> st.Hardware.from_json('{"schema": "spmdtree.Hardware/1", "name": "x"}')
            Traceback (most recent call last):
            ...
            ValueError: Hardware.from_json: the JSON has no field 'memory_bytes' (nor 'flops_per_second', 'links' and 15 more); write it with Hardware.to_json(), which gives every field.
        """
        return _from_json(source)


#: The schema `Hardware.to_json` writes (new in 0.7).
HARDWARE_SCHEMA = "spmdtree.Hardware/1"
#: The fields added to that schema since 0.7: a file written before them leaves them
#: out, and reads back with each left out (at its default).
ADDED = (
    "grouped_efficiency",
    "indexed_efficiency",
    "eight_bit_speed",
    "matmul_grid",
    "access_seconds",
    "fused_update_efficiency",
    "on_chip_bytes_per_second",
    "read_efficiency",
)


def _checked_provenance(provenance: object) -> dict[str, str]:
    """`provenance` as a dict of field names to sentences, checked."""
    if not isinstance(provenance, Mapping):
        raise Mistake(
            TypeError,
            f"provenance is {provenance!r}; expected a mapping of field names to where each "
            "figure came from.",
        )
    names = {field.name for field in dataclasses.fields(Hardware)}
    for field, said in provenance.items():
        if field not in names or not isinstance(said, str):
            raise Mistake(
                ValueError,
                f"provenance has {field!r}: {said!r}; expected a field of Hardware "
                f"({', '.join(sorted(names - {'provenance'}))}) and a sentence.",
            )
    return dict(provenance)


def _read_json(source: object) -> Hardware:
    """`Hardware.from_json`, below its boundary: a `Mistake` where it refuses."""
    data = _json_of(source)
    if not isinstance(data, dict) or data.get("schema") != HARDWARE_SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise Mistake(
            ValueError,
            f"the JSON's schema is {schema!r}; expected {HARDWARE_SCHEMA!r}, what "
            "Hardware.to_json() writes.",
        )
    fields = [f.name for f in dataclasses.fields(Hardware)]
    unknown = sorted(set(data) - {"schema", *fields})
    if unknown:
        raise Mistake(
            ValueError,
            f"the JSON has a field {unknown[0]!r}, which Hardware does not know; its fields "
            f"are {', '.join(map(repr, fields))}.",
        )
    missing = [name for name in fields if name not in data and name not in ADDED]
    if missing:
        more = f" (nor {', '.join(map(repr, missing[1:3]))}" if missing[1:] else ""
        more += f" and {len(missing) - 3} more)" if missing[3:] else ")" if more else ""
        raise Mistake(
            ValueError,
            f"the JSON has no field {missing[0]!r}{more}; write it with Hardware.to_json(), "
            "which gives every field.",
        )
    figures: dict[str, Any] = {name: data.get(name) for name in fields}
    figures["links"] = {kind: tuple(pair) for kind, pair in dict(data["links"]).items()}
    figures["chip"] = _chip_of(data["chip"])
    return Hardware(**figures)


_from_json = functools.partial(public, name="Hardware.from_json")(_read_json)


def _json_of(source: object) -> Any:
    """The JSON value of `source`: text starting with ``{``, else a file's path."""
    if not isinstance(source, (str, os.PathLike)):
        raise Mistake(
            TypeError, f"source is {source!r}; expected JSON text or a path to a JSON file."
        )
    text = source if isinstance(source, str) and source.lstrip().startswith("{") else None
    if text is None:
        try:
            text = pathlib.Path(source).read_text()
        except OSError as e:
            raise Mistake(
                ValueError,
                f"cannot read {os.fspath(source)!r} ({e.strerror}); pass a JSON file "
                "that Hardware.to_json() wrote, or its text.",
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Mistake(ValueError, f"the text is not JSON ({e}).") from None


def _chip_of(data: object) -> GpuChip | TpuChip | None:
    """A chip from its JSON fields (``kind`` says which)."""
    if data is None:
        return None
    kinds: dict[str, type[GpuChip] | type[TpuChip]] = {"gpu": GpuChip, "tpu": TpuChip}
    if not isinstance(data, dict) or data.get("kind") not in kinds:
        raise Mistake(
            ValueError,
            f"the JSON's chip is {data!r}; expected null or an object of a GpuChip's or a "
            'TpuChip\'s fields with "kind": "gpu" or "tpu".',
        )
    cls = kinds[data["kind"]]
    names = [f.name for f in dataclasses.fields(cls)]
    facts = {k: v for k, v in data.items() if k != "kind"}
    unknown = sorted(set(facts) - set(names))
    if unknown:
        raise Mistake(
            ValueError,
            f"the JSON's chip has a field {unknown[0]!r}, which {cls.__name__} does not "
            f"know; its fields are {', '.join(map(repr, names))}.",
        )
    if "capability" in facts:
        facts["capability"] = tuple(facts["capability"])
    try:
        return cls(**facts)
    except TypeError as e:
        raise Mistake(ValueError, f"the JSON's chip is incomplete: {e}.") from None


#: The presets, built from `chips.CHIPS` alone (every figure's source is listed there
#: and in docs/planning.md, "Hardware and time"). A GPU's memory is what the device
#: reports, the bytes its compiler target is given too; a TPU's is its data sheet's GB
#: read as GiB, but the v5e's, what libtpu allows on the chip (its `bytes_limit`, 15.75
#: GiB, measured; new in 0.7). Latencies are rough.
PRESETS = {
    name: Hardware(
        name,
        **figures,
        provenance={
            field: f"the {name} preset (chips.CHIPS; docs/planning.md lists its source)"
            for field in figures
        },
    )
    for name, figures in CHIPS.items()
}


def preset_in(text: str) -> Hardware | None:
    """The preset a step's description names (``"1 x TPU v5 lite, their own
    compiler"``, ``"64 x h100, ..."``): by its name, or its chip's device kind or
    description as the devices report it, the longest that appears; None if none does.

    Example:
        >>> preset_in("1 x TPU v5 lite, their own compiler").name, preset_in("8 CPU devices")
        ('tpu-v5e', None)
    """
    names = {name: name for name in PRESETS}
    for name, preset in PRESETS.items():
        chip = preset.chip
        said = chip.device_kind if isinstance(chip, TpuChip) else getattr(chip, "description", "")
        names[said] = names.get(said, name)
    found = sorted((said for said in names if said and said in text), key=len)
    return PRESETS[names[found[-1]]] if found else None


def hardware_of(value: object, name: str = "hardware") -> Hardware:
    """`value` as a `Hardware` (new in 0.8): a `Hardware` itself, a preset's name, or
    the path of a file `Hardware.to_json` wrote (an ``os.PathLike``, or a str that
    ends in ``.json`` or names a folder); `name` is the argument's, for the message.

    Example:
        >>> import spmdtree as st
        >>> hardware_of("tpu-v5e") == st.hardware("tpu-v5e")
        True
    """
    if isinstance(value, Hardware):
        return value
    named = isinstance(value, str) and (value.endswith(".json") or os.sep in value)
    if isinstance(value, (str, os.PathLike)) and (named or not isinstance(value, str)):
        try:
            return _read_json(value)
        except Mistake as e:
            raise Mistake(e.kind, f"{name} {str(value)!r}: {e.message}") from None
    presets = ", ".join(map(repr, PRESETS))
    if isinstance(value, str):
        if value in PRESETS:
            return PRESETS[value]
        raise Mistake(
            ValueError,
            f"{name} is {value!r}, which is no preset; pass a preset's name ({presets}), the "
            "path of a file Hardware.to_json() wrote (chip.json), or a st.Hardware.",
        )
    raise Mistake(
        TypeError,
        f"{name} is {value!r}; expected a st.Hardware, a preset's name ({presets}) or the "
        "path of a file Hardware.to_json() wrote.",
    )


def timed_on(hardware: object, compiled_for: str) -> Hardware:
    """The hardware a step's prediction is timed on (new in 0.7): `hardware` where
    given (a `Hardware`, a preset's name or a file's path: `hardware_of`; new in
    0.8), else the preset that `compiled_for` (a step's description) names;
    refused where none can be told."""
    chosen = hardware_of(hardware) if hardware is not None else preset_in(compiled_for)
    if chosen is None:
        raise Mistake(
            ValueError,
            f"no preset matches what the step was compiled for ({compiled_for}); pass "
            "hardware= (a preset, st.calibrate()'s for the chip present, or your own "
            "st.Hardware).",
        )
    return chosen


@public
def hardware(name: str) -> Hardware:
    """A preset `Hardware`: ``"a100"``, ``"h100"``, ``"h200"``, ``"b200"``,
    ``"tpu-v5e"``, ``"tpu-v5p"`` or ``"tpu-v6e"`` (``"a100"`` new in 0.6).

    The figures are the vendors' data sheets and the JAX team's scaling book
    (docs/planning.md lists each with its source); latencies are rough. A preset
    gives every figure of the model (`Hardware.left_out` is empty) but a TPU's
    flash-attention shares (none is published; a step that runs a flash kernel is
    told its default) and, but on the v5e, a TPU's unfused update's share (new in
    0.7: measured on a v5e only; told likewise), and its `chip` is what its
    compiler is told.

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
