"""Each preset's chip: every fact spmdtree knows of it, written once (new in 0.5).

`CHIPS` is the one table of the presets: each row the keyword arguments of a
`Hardware` (the roofline's figures, the per-kernel model's, and what its
compiler is told: a `GpuChip` or a `TpuChip`). A `Hardware` carries them
whole from there on (0.6): the compiler's target and the model's costs are
read off the hardware itself, never looked up by its name. docs/planning.md
("Hardware and time", "The compilers' targets", "Predicted step time") lists
each figure's source, and tests/test_presets.py checks each figure against
that table and the source. The torus below (`slice_dims`, `torus_links`) is a
`TpuChip`'s.

This module is data only: it imports nothing of spmdtree's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

GB = 10**9
GIB = 2**30
MIB = 2**20

#: A GPU node's links: NVLink within a node of 8, InfiniBand across; latencies rough.
_GPU_LINKS = {"ici": (450e9, 2e-6), "dcn": (50e9, 5e-6)}


@dataclasses.dataclass(frozen=True)
class GpuChip:
    """What XLA's GPU compiler is told of an NVIDIA GPU beyond a `Hardware`'s figures
    (new in 0.6): its device description, compute capability, boost clock, L2 and
    per-SM limits. Its SMs are the hardware's `cores`, its memory and bandwidth the
    hardware's.

    Attributes:
        description: the device's name as CUDA reports it (``"NVIDIA H100 80GB HBM3"``).
        capability: its compute capability, ``(major, minor)``.
        clock_ghz: its boost clock.
        l2_bytes: its L2 cache.
        shared_per_sm, shared_per_block_optin: shared memory per SM and the most a
            block may opt in to (the CUDA programming guide's limits per compute
            capability: 228 KiB and 227 KiB on 9.0 and 10.0, 164 KiB and 163 KiB on
            8.0).
        fpus_per_sm: FP32 units per SM (128 on 9.0 and 10.0, 64 on 8.0).

    Example:
        >>> import spmdtree as st
        >>> st.GpuChip("NVIDIA A100-SXM4-80GB", (8, 0), 1.41, 40 * 2**20).capability
        (8, 0)
    """

    description: str
    capability: tuple[int, int]
    clock_ghz: float
    l2_bytes: int
    shared_per_sm: int = 233_472
    shared_per_block_optin: int = 232_448
    fpus_per_sm: int = 128


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """A TPU generation as libtpu names it, and its slices' torus (new in 0.6).

    Attributes:
        generation: libtpu's name for it (``"v5p"``).
        device_kind: libtpu's ``device_kind`` (``"TPU v5"``).
        tensor_cores: TensorCores per device as libtpu's topology gives them.
        dimensions: its slices' torus dimensions (2 or 3).
        wraparound: the side a torus axis needs for its wraparound links (16 on
            v5e and v6e: a whole axis of the pod; 4 on v5p); 0: none wraps.
        cubes: whether the wraparounds come from optical switches that join whole
            cubes only (v5p: every axis a multiple of 4, or no axis wraps).
        slice_limit: the most chips one slice holds (None: no limit checked).
        clock_ghz: its clock, at which libtpu's estimates of a kernel's cycles
            are seconds (0.0: not known; new in 0.7).

    Example:
        >>> import spmdtree as st
        >>> st.TpuChip("v5e", "TPU v5 lite", 1, 2, wraparound=16, slice_limit=256).dimensions
        2
    """

    generation: str
    device_kind: str
    tensor_cores: int
    dimensions: int
    wraparound: int = 0
    cubes: bool = False
    slice_limit: int | None = None
    clock_ghz: float = 0.0


def _gpu(**facts: Any) -> dict[str, Any]:
    """An NVIDIA GPU's figures in nodes of 8 (NVLink within, InfiniBand across, unless
    given): cuBLAS's 128 x 128 tile over its SMs, XLA GPU's launch overheads, memory
    kernels at 0.9 of the bandwidth (an in-place update too: no GPU layout is tiled,
    so none is an unfused TPU update), f32 matmuls as TF32 at half the bf16 rate,
    8-bit ones at twice it (each data sheet's; `CHIPS` cites them); no wait for the
    memory's first access beyond the launch (none is published)."""
    return {
        "links": _GPU_LINKS,
        "devices_per_node": 8,
        "tile": 128,
        "memory_efficiency": 0.9,
        "update_efficiency": 0.9,
        "launch_seconds": 1e-6,
        "access_seconds": 0.0,
        "collective_latency_seconds": 5e-6,
        "f32_speed": 0.5,
        "eight_bit_speed": 2.0,
        **facts,
    }


def _tpu(**facts: Any) -> dict[str, Any]:
    """A TPU generation's figures: one slice unless told, its MXU's tile stream (one
    core, no launch), no public matmul share (1.0), f32 in one bf16 pass (six at the
    highest precision), int8 at twice the bf16 rate (each data sheet's; `CHIPS` cites
    them); no wait for the memory's first access (none is published: `st.calibrate`
    measures it)."""
    return {
        "devices_per_node": None,
        "matmul_efficiency": 1.0,
        "cores": 1,
        "memory_efficiency": 0.9,
        "launch_seconds": 0.0,
        "access_seconds": 0.0,
        "collective_latency_seconds": 0.0,
        "f32_speed": 1.0,
        "f32_highest_speed": 1 / 6,
        "eight_bit_speed": 2.0,
        **facts,
    }


#: The chips, by preset name: every figure of each, as the keyword arguments of its
#: `Hardware` (hardware.py builds the presets from this table and nothing else).
#: GPUs: SMs, HBM bandwidth and boost clock from NVIDIA's data sheets (H100 SXM5 80 GB:
#: 132 SMs, 3.35 TB/s; H200 SXM 141 GB: 4.8 TB/s; B200: 148 SMs, 8 TB/s, each of DGX
#: B200's 64; A100 SXM4 80 GB: 108 SMs, 2,039 GB/s, 1.41 GHz, 40 MB L2, 312 TFLOP/s bf16,
#: 156 TF32 and 19.5 FP32, NVLink 3 at 600 GB/s both ways and DGX A100's eight 200 Gb/s
#: HDR InfiniBand ports, 25 GB/s per GPU), L2 and clock from CUDA's device query; memory
#: in bytes as CUDA's device query reports it (H100: 81,106 MiB; A100: 81,158 MiB, XLA's own a100_sxm_80 spec too) or
#: nvidia-smi's total (H200 143,771 MiB, B200 183,359 MiB): a data sheet's "80 GB" read
#: as 80 GiB is more than an H100 has. The bf16 dense peaks: 989 TFLOP/s (H100, H200),
#: 2.25 PFLOP/s (B200), 312 TFLOP/s (A100). The largest matmul share from Stas Bekman's
#: MAMF table (ml-engineering, compute/accelerator: H100 SXM 794.5 of 989 TFLOPS bf16,
#: "H200 is the same", B200 1,745 of 2,250, A100 SXM 271.2 of 312). f32 matmuls: the
#: H100 data sheet's TF32 494.7 and FP32 67 of 989.4 TFLOPS (the A100's 156 and 19.5 of
#: 312). TPUs: memory as the data sheet's GB read as GiB, peaks, HBM bandwidth (v5e 819
#: GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s) and ICI/DCN from Google Cloud's
#: system-architecture pages; the pods: v5e and v6e 256 chips in a 2D torus, v5p a 3D
#: torus; libtpu's device kinds and TensorCores measured with libtpu 0.0.50.1 (v5p's two
#: are one megacore); the clocks, the bf16 peak over the MXUs' FLOPs per cycle (a
#: 128 x 128 MXU's 128 x 128 multiply-adds, 2 FLOPs each; the scaling book: "about 5e13
#: bf16 FLOPs/s per MXU at 1.5GHz on TPU v5e", 4 MXUs a TensorCore, Trillium's 256 x
#: 256): v5e 197e12 / (4 x 128 x 128 x 2) = 1.5 GHz, v5p 459e12 / (2 TensorCores x 4 x
#: 128 x 128 x 2) = 1.75 GHz, v6e 918e12 / (4 x 256 x 256 x 2) = 1.75 GHz (libtpu
#: 0.0.42.1's estimated cycles of a bf16 4096^3 matmul say 126,898, 252,216 and 455,675
#: FLOPs a cycle: at most 4, 8 and 4 such MXUs' 131,072, 262,144 and 524,288; Google's
#: v6e page, which says 2 MXUs, would make it 3.5 GHz); v5e's memory is what libtpu
#: allows on the chip (``bytes_limit`` 16,909,336,064 B, about 15.75 GiB, measured on a v5e with
#: jax 0.10.2 and libtpu 0.0.42.1: the data sheet's 16 GB read as 16 GiB is more than it
#: allows); wraparound links from the scaling book's "How to Think About
#: TPUs": an axis of 16 on v5e and v6e, whole 4x4x4 cubes on v5p ("a 2x2x4 won't have
#: any wraparounds"). Flash attention's shares of the peak (head width 128, bf16), the
#: kernel a GPU job runs: cuDNN's on H100 from the FlashAttention-3 paper (Shah et al.
#: 2024, Fig. 5d: causal forward 529 TFLOP/s at 8k; Fig. 6b: backward 518, the causal
#: backward not published), H200 the same (the same SMs and clocks: the kernel is
#: compute-bound); cuDNN 9.19's on B200 at 16k from the FlashAttention-4 paper (Zadouri
#: et al. 2026, Figs. 4 and 6, causal: forward 1,509, backward 1,293 of 2,250); on A100,
#: FlashAttention-2's own (Dao 2023, section 1: "up to 73% ... forward ... up to 63% ...
#: backward"); none published for a TPU (the default, 0.5, is said). A TPU's unfused
#: in-place update at a run-time offset into a tiled dimension (`Kernel.unfused_update`):
#: v5e's share measured by st.calibrate's update benchmark on a v5e (2026-12-06, jax
#: 0.10.2, libtpu 0.0.42.1); v5p's and v6e's are not measured (the default is said).
#: 8-bit matmuls over bf16 (new in 0.8), each data sheet's dense figures: A100 int8
#: 624 TOPS of 312 (it has no fp8), H100 SXM and H200 fp8 1,979 TFLOPS of 989, B200 fp8
#: 4.5 PFLOPS of 2.25, TPU v5e int8 394 TOPS of 197, v5p 918 of 459, v6e 1,836 of 918
#: (Google Cloud's system-architecture pages): 2 on each; st.calibrate measured a v5e's
#: int8 4,096^3 at 383 TOPS, 2.0 of its bf16 (2026-12-07).
#: docs/planning.md lists each figure with its source.
CHIPS: dict[str, Mapping[str, Any]] = {
    "a100": _gpu(
        memory_bytes=85_100_068_864,
        flops_per_second=312e12,
        hbm_bytes_per_second=2_039 * GB,
        matmul_efficiency=271.2 / 312,
        cores=108,
        f32_highest_speed=19.5 / 312,
        links={"ici": (300e9, 2e-6), "dcn": (25e9, 5e-6)},
        flash_forward_efficiency=0.73,
        flash_backward_efficiency=0.63,
        chip=GpuChip(
            "NVIDIA A100-SXM4-80GB",
            (8, 0),
            1.41,
            40 * MIB,
            shared_per_sm=167_936,
            shared_per_block_optin=166_912,
            fpus_per_sm=64,
        ),
    ),
    "h100": _gpu(
        memory_bytes=85_045_477_376,
        flops_per_second=989e12,
        hbm_bytes_per_second=3_350 * GB,
        matmul_efficiency=794.5 / 989,
        cores=132,
        f32_highest_speed=67 / 989,
        flash_forward_efficiency=529 / 989,
        flash_backward_efficiency=518 / 989,
        chip=GpuChip("NVIDIA H100 80GB HBM3", (9, 0), 1.98, 50 * MIB),
    ),
    "h200": _gpu(
        memory_bytes=150_754_820_096,
        flops_per_second=989e12,
        hbm_bytes_per_second=4_800 * GB,
        matmul_efficiency=794.5 / 989,
        cores=132,
        f32_highest_speed=67 / 989,
        flash_forward_efficiency=529 / 989,
        flash_backward_efficiency=518 / 989,
        chip=GpuChip("NVIDIA H200", (9, 0), 1.98, 50 * MIB),
    ),
    "b200": _gpu(
        memory_bytes=192_265_846_784,
        flops_per_second=2.25e15,
        hbm_bytes_per_second=8_000 * GB,
        matmul_efficiency=1745 / 2250,
        cores=148,
        f32_highest_speed=67 / 989,
        links={"ici": (900e9, 2e-6), "dcn": (50e9, 5e-6)},
        flash_forward_efficiency=1509 / 2250,
        flash_backward_efficiency=1293 / 2250,
        chip=GpuChip("NVIDIA B200", (10, 0), 1.965, 126 * MIB),
    ),
    "tpu-v5e": _tpu(
        memory_bytes=16_909_336_064,
        flops_per_second=1.97e14,
        hbm_bytes_per_second=819 * GB,
        links={"ici": (9e10, 1e-6), "dcn": (3.125e9, 1e-5)},
        tile=128,
        update_efficiency=0.23,
        chip=TpuChip("v5e", "TPU v5 lite", 1, 2, wraparound=16, slice_limit=256, clock_ghz=1.5),
    ),
    "tpu-v5p": _tpu(
        memory_bytes=95 * GIB,
        flops_per_second=4.59e14,
        hbm_bytes_per_second=2_765 * GB,
        links={"ici": (1.8e11, 1e-6), "dcn": (6.25e9, 1e-5)},
        tile=128,
        chip=TpuChip("v5p", "TPU v5", 2, 3, wraparound=4, cubes=True, clock_ghz=1.75),
    ),
    "tpu-v6e": _tpu(
        memory_bytes=32 * GIB,
        flops_per_second=9.18e14,
        hbm_bytes_per_second=1_640 * GB,
        links={"ici": (1.8e11, 1e-6), "dcn": (12.5e9, 1e-5)},
        tile=256,
        chip=TpuChip("v6e", "TPU v6 lite", 1, 2, wraparound=16, slice_limit=256, clock_ghz=1.75),
    ),
}


def tpu_clock_ghz(device_kind: str) -> float:
    """The clock of the TPU whose devices report this kind (libtpu's ``device_kind``),
    as its chip in `CHIPS` gives it; 0.0 for a kind none is (new in 0.7: what a
    compile knows of its chip is its devices).

    Example:
        >>> tpu_clock_ghz("TPU v5 lite"), tpu_clock_ghz("NVIDIA H100 80GB HBM3")
        (1.5, 0.0)
    """
    chips = [row["chip"] for row in CHIPS.values() if isinstance(row["chip"], TpuChip)]
    return next((chip.clock_ghz for chip in chips if chip.device_kind == device_kind), 0.0)


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
