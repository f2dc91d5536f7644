"""Each preset's chip: every fact spmdtree knows of it, written once (new in 0.5).

Three tables are built from `CHIPS`, so that a figure changes in one place: the
roofline's `Hardware` presets (`hardware.PRESETS`), the targets' compiler
descriptions (`targets.TARGETS`, `targets.TPU_DEVICES`) and the per-kernel
model's figures (`predict.COSTS`). docs/planning.md ("Hardware and time", "The
compilers' targets", "Predicted step time") lists each figure's source, and
tests/test_presets.py checks each figure against that table and the source.

This module is data only: it imports nothing of spmdtree's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

GB = 10**9
GIB = 2**30

#: A GPU node's links: NVLink within a node of 8, InfiniBand across; latencies rough.
_GPU_LINKS = {"ici": (450e9, 2e-6), "dcn": (50e9, 5e-6)}


@dataclasses.dataclass(frozen=True)
class Sheet:
    """One preset's chip: its memory, peak, links and memory bandwidth, the
    per-kernel model's figures, and what its compiler is told (an NVIDIA GPU's
    target description, or the TPU generation libtpu names).

    Attributes:
        name: the preset (``"h100"``, ``"tpu-v5p"``).
        platform: ``"cuda"`` (XLA GPU) or ``"tpu"`` (libtpu).
        memory_bytes: memory per device.
        flops_per_second: the dense bf16 peak per device.
        hbm_bytes_per_second: the memory bandwidth (data sheet).
        links: ``"ici"``/``"dcn"`` to (bytes per second per device, latency per hop).
        devices_per_node: a GPU node's devices (None: a TPU slice is one node).
        matmul_efficiency: the largest share of the peak a matmul reaches.
        tile: a matmul tile's side (cuBLAS's 128; the MXU's 128, or 256 on v6e).
        description, capability, sms, clock_ghz, l2_bytes: a GPU's, as XLA's GPU
            target description reads them (its name, compute capability, SMs,
            boost clock and L2 cache).
        generation, device_kind, tensor_cores, dimensions, slice_limit: a TPU's:
            its generation as libtpu names it, libtpu's ``device_kind`` and
            TensorCores per device, its slices' torus dimensions, and the most
            chips a slice holds (None: no limit spmdtree checks).
        wraparound, cubes: the side a TPU slice's torus axis needs for its
            wraparound links (16 on v5e and v6e: a whole axis of the pod; 4 on
            v5p), and whether they come from optical switches that join whole
            cubes only (v5p: every axis a multiple of 4, or no axis wraps;
            new in 0.5).
    """

    name: str
    platform: str
    memory_bytes: int
    flops_per_second: float
    hbm_bytes_per_second: int
    links: Mapping[str, tuple[float, float]] = dataclasses.field(hash=False)
    devices_per_node: int | None
    matmul_efficiency: float
    tile: int
    description: str = ""
    capability: tuple[int, int] = (0, 0)
    sms: int = 0
    clock_ghz: float = 0.0
    l2_bytes: int = 0
    generation: str = ""
    device_kind: str = ""
    tensor_cores: int = 0
    dimensions: int = 0
    slice_limit: int | None = None
    wraparound: int = 0
    cubes: bool = False


def _gpu(name: str, **facts: Any) -> Sheet:
    """An NVIDIA GPU in nodes of 8 (NVLink within, InfiniBand across, unless given)."""
    return Sheet(
        **{"links": _GPU_LINKS, **facts},
        name=name,
        platform="cuda",
        devices_per_node=8,
        tile=128,
    )


def _tpu(name: str, **facts: Any) -> Sheet:
    """A TPU generation, its preset named ``tpu-`` and libtpu's name for it."""
    return Sheet(
        **facts,
        name=name,
        platform="tpu",
        devices_per_node=None,
        matmul_efficiency=1.0,
        generation=name.removeprefix("tpu-"),
    )


#: The chips, by preset name.
#: GPUs: SMs, HBM bandwidth and boost clock from NVIDIA's data sheets (H100 SXM5 80 GB:
#: 132 SMs, 3.35 TB/s; H200 SXM 141 GB: 4.8 TB/s; B200: 148 SMs, 8 TB/s, each of DGX
#: B200's 64), L2 and clock from CUDA's device query; memory in bytes as CUDA's device
#: query reports it (H100: 81,106 MiB) or nvidia-smi's total (H200 143,771 MiB, B200
#: 183,359 MiB): a data sheet's "80 GB" read as 80 GiB is more than an H100 has. The
#: bf16 dense peaks: 989 TFLOP/s (H100, H200), 2.25 PFLOP/s (B200). The largest
#: matmul share from Stas Bekman's MAMF table (ml-engineering, compute/accelerator:
#: H100 SXM 794.5 of 989 TFLOPS bf16, "H200 is the same", B200 1,745 of 2,250).
#: TPUs: memory as the data sheet's GB read as GiB, peaks, HBM bandwidth (v5e 819
#: GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s) and ICI/DCN from Google Cloud's
#: system-architecture pages; no public achievable matmul share (1.0); the pods: v5e
#: and v6e 256 chips in a 2D torus, v5p a 3D torus; libtpu's device kinds and
#: TensorCores measured with libtpu 0.0.50.1 (v5p's two are one megacore); wraparound
#: links from the scaling book's "How to Think About TPUs": an axis of 16 on v5e and
#: v6e, whole 4x4x4 cubes on v5p ("a 2x2x4 won't have any wraparounds").
CHIPS = {
    "h100": _gpu(
        "h100",
        memory_bytes=85_045_477_376,
        flops_per_second=989e12,
        hbm_bytes_per_second=3_350 * GB,
        matmul_efficiency=794.5 / 989,
        description="NVIDIA H100 80GB HBM3",
        capability=(9, 0),
        sms=132,
        clock_ghz=1.98,
        l2_bytes=50 * 2**20,
    ),
    "h200": _gpu(
        "h200",
        memory_bytes=150_754_820_096,
        flops_per_second=989e12,
        hbm_bytes_per_second=4_800 * GB,
        matmul_efficiency=794.5 / 989,
        description="NVIDIA H200",
        capability=(9, 0),
        sms=132,
        clock_ghz=1.98,
        l2_bytes=50 * 2**20,
    ),
    "b200": _gpu(
        "b200",
        memory_bytes=192_265_846_784,
        flops_per_second=2.25e15,
        hbm_bytes_per_second=8_000 * GB,
        matmul_efficiency=1745 / 2250,
        description="NVIDIA B200",
        capability=(10, 0),
        sms=148,
        clock_ghz=1.965,
        l2_bytes=126 * 2**20,
        links={"ici": (900e9, 2e-6), "dcn": (50e9, 5e-6)},
    ),
    "tpu-v5e": _tpu(
        "tpu-v5e",
        memory_bytes=16 * GIB,
        flops_per_second=1.97e14,
        hbm_bytes_per_second=819 * GB,
        links={"ici": (9e10, 1e-6), "dcn": (3.125e9, 1e-5)},
        tile=128,
        device_kind="TPU v5 lite",
        tensor_cores=1,
        dimensions=2,
        slice_limit=256,
        wraparound=16,
    ),
    "tpu-v5p": _tpu(
        "tpu-v5p",
        memory_bytes=95 * GIB,
        flops_per_second=4.59e14,
        hbm_bytes_per_second=2_765 * GB,
        links={"ici": (1.8e11, 1e-6), "dcn": (6.25e9, 1e-5)},
        tile=128,
        device_kind="TPU v5",
        tensor_cores=2,
        dimensions=3,
        wraparound=4,
        cubes=True,
    ),
    "tpu-v6e": _tpu(
        "tpu-v6e",
        memory_bytes=32 * GIB,
        flops_per_second=9.18e14,
        hbm_bytes_per_second=1_640 * GB,
        links={"ici": (1.8e11, 1e-6), "dcn": (12.5e9, 1e-5)},
        tile=256,
        device_kind="TPU v6 lite",
        tensor_cores=1,
        dimensions=2,
        slice_limit=256,
        wraparound=16,
    ),
}


def slice_dims(chips: int, count: int) -> list[int]:
    """A TPU slice's torus dimensions for a power of two of chips, in `count`
    dimensions: ``2x1x1``, ``2x2x1``, ``2x2x2``, ``2x2x4``, ``2x4x4``, ... (the
    smallest dimension doubled, the last of ties first).

    Example:
        >>> slice_dims(256, 2), slice_dims(64, 3), slice_dims(2, 3)
        ([16, 16], [4, 4, 4], [2, 1, 1])
    """
    if chips < 4:
        return [chips] + [1] * (count - 1)
    dims = [2, 2] + [1] * (count - 2)
    while math.prod(dims) < chips:
        smallest = min(dims)
        dims[max(i for i, d in enumerate(dims) if d == smallest)] *= 2
    return dims


def torus_axes(group: int, dims: list[int]) -> int:
    """How many of a torus's axes a collective's group of `group` chips spans: the
    fewest of its `dims`, the longest first, that hold the group (a mesh axis is
    laid along whole torus axes). Each axis spanned adds its links' bandwidth (the
    JAX scaling book, "How to Think About TPUs": an all-gather over several axes
    takes V / (W_ici x axes)).

    Example:
        >>> torus_axes(256, [16, 16]), torus_axes(16, [16, 16]), torus_axes(32, [16, 16])
        (2, 1, 2)
        >>> torus_axes(64, [4, 4, 4]), torus_axes(1, [4, 4, 4])
        (3, 1)
    """
    return max(len(_spanned(group, dims)), 1)


def _spanned(group: int, dims: list[int]) -> list[int]:
    """The indices of the axes of `dims` a group of `group` chips spans, longest first."""
    held, axes = 1, list[int]()
    for i in sorted((i for i, d in enumerate(dims) if d > 1), key=lambda i: -dims[i]):
        if held >= group:
            break
        held, axes = held * dims[i], [*axes, i]
    return axes


def wrapped(dims: list[int], side: int, cubes: bool) -> list[bool]:
    """Which axes of a TPU slice's torus `dims` have wraparound links: each axis a
    multiple of `side` long, or, where the wraparounds join whole `cubes` (v5p's
    optical switches), every axis if all are and none otherwise (the scaling book,
    "How to Think About TPUs": "a 2x2x4 won't have any wraparounds", "a TPU v5e
    8x16 will have a wraparound on the longer axis"; new in 0.5).

    Example:
        >>> wrapped([8, 16], 16, False), wrapped([2, 2, 4], 4, True), wrapped([4, 4, 8], 4, True)
        ([False, True], [False, False, False], [True, True, True])
    """
    whole = [side > 0 and d % side == 0 for d in dims]
    return [all(whole)] * len(dims) if cubes else whole


def torus_links(group: int, dims: list[int], wraps: list[bool]) -> float:
    """How many times one axis's ICI figure (both directions, round its wraparound)
    a group of `group` chips sends at: each axis of `dims` it spans adds 1 where the
    axis wraps round (`wraps`) and 1/2 where it does not, a line sending each byte
    one way along it (the scaling book: a slice "with no wraparounds ... typically
    doubles the time of most communication"). A group along part of a wrapped axis
    is timed as a ring too; how the device order lays it is not read. New in 0.5.

    Example:
        >>> torus_links(256, [16, 16], [True, True]), torus_links(8, [2, 4], [False, False])
        (2.0, 1.0)
        >>> torus_links(2, [2, 4], [False, False]), torus_links(128, [8, 16], [False, True])
        (0.5, 1.5)
    """
    axes = _spanned(group, dims)
    return sum(1.0 if wraps[i] else 0.5 for i in axes) if axes else 1.0
