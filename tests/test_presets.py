"""Every hardware preset's figure equals docs/planning.md's table, and each of the
table's figures the public source it cites; the chips' compiler descriptions
(their own table) agree with their sources and with the presets.

The sources' figures are written here as each source states them, with its
address, so that a preset that drifts from the table, or a table that drifts
from its source, fails. A table shows a figure rounded: it equals its source at
the precision shown.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from test_targets import has_compiler

import spmdtree as st

# Private: the chips' descriptions (what XLA's GPU compiler and libtpu are given)
# have no public name: read where preflight builds them from a Hardware; a TPU's clock by
# its devices' kind, where a compile reads it.
from spmdtree._src.step.compile.backends import target_for
from spmdtree._src.step.hw.chips import tpu_clock_ghz

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "planning.md"
GIB, MIB = 2**30, 2**20


def table(header):
    """The rows of the markdown table in docs/planning.md whose header row starts
    with `header`, as {first cell without backticks: [cells]}."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    found = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        found[cells[0].strip("`")] = cells[1:]
    return found


PRESET_TABLE = table("| preset | memory | bf16 dense peak |")
CHIP_TABLE = table("| preset | chip | compute capability |")
UNITS = {
    "B": 1,
    "GiB": GIB,
    "MiB": MIB,
    "TFLOP/s": 1e12,
    "PFLOP/s": 1e15,
    "GB/s": 1e9,
    "TB/s": 1e12,
    "µs": 1e-6,
    "GHz": 1.0,
}


def figure(text):
    """The first "number unit" of a cell as (value, digits after the point)."""
    found = re.match(r"([\d,]+(?:\.(\d+))?)\s*(\S+)?", text.strip())
    assert found, text
    number, decimals, unit = found.groups()
    return float(number.replace(",", "")) * UNITS.get(unit or "B", 1), len(decimals or "")


def shown(cell, source, unit):
    """Whether `source` (in `unit`s) rounds to the figure the cell shows."""
    value, decimals = figure(cell)
    return round(source / UNITS[unit], decimals) == pytest.approx(value / UNITS[unit])


def preset_of(cells):
    """A preset's figures as the table gives them: memory, peak, the two links and
    the devices per node (None: one slice)."""
    memory, peak, ici, dcn, per_node = cells
    links = {}
    for kind, cell in (("ici", ici), ("dcn", dcn)):
        bandwidth, latency = cell.split(",")
        links[kind] = (figure(bandwidth)[0], figure(latency)[0])
    return (
        int(figure(memory)[0]),
        figure(peak)[0],
        links,
        None if per_node == "one slice" else int(per_node),
    )


def test_the_table_lists_every_preset_and_no_other():
    with pytest.raises(ValueError) as raised:
        st.hardware("no such chip")
    listed = re.findall(r"'([\w-]+)'", str(raised.value).split("the presets are")[1])
    assert listed == list(PRESET_TABLE)


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_every_preset_figure_is_the_docs_table(name):
    memory, peak, links, per_node = preset_of(PRESET_TABLE[name])
    hw = st.hardware(name)
    assert hw.name == name and hw.memory_bytes == memory
    assert hw.flops_per_second == pytest.approx(peak, rel=1e-12)
    assert set(hw.links) == set(links)
    for kind, (bandwidth, latency) in links.items():
        assert hw.links[kind] == pytest.approx((bandwidth, latency), rel=1e-12)
    assert hw.devices_per_node == per_node


#: What each source states, in its own units. The presets' latencies are rough
#: orders of magnitude (the docs say so) and have no source to match.
NVLINK4, NVLINK5 = (
    900,
    1800,
)  # GB/s per GPU, both ways (nvidia.com/en-us/data-center/h100/, /dgx-b200/)
CONNECTX7 = 400 / 8  # GB/s: one 400 Gb/s NIC per GPU (DGX H100, DGX B200)
NVLINK3 = 600  # GB/s per GPU, both ways (12 links; nvidia.com/en-us/data-center/a100/)
HDR = 200 / 8  # GB/s: one 200 Gb/s HDR InfiniBand port per GPU (DGX A100)
SOURCES = {
    "a100": {
        # CUDA's deviceQuery on an A100-SXM4-80GB: "Total amount of global memory:
        # 81158 MBytes (85100068864 bytes)"; XLA's a100_sxm_80.txtpb: device_memory_size:
        # 85100068864
        "memory": (85100068864, "B"),
        # https://www.nvidia.com/en-us/data-center/a100/: "BFLOAT16 Tensor Core 312
        # TFLOPS | 624 TFLOPS*" (* with sparsity)
        "peak": (312, "TFLOP/s"),
        "ici": (NVLINK3 / 2, "GB/s"),
        "dcn": (HDR, "GB/s"),
        "per node": 8,  # DGX A100: 8 GPUs
    },
    "h100": {
        # CUDA's deviceQuery on an H100 80GB HBM3: "Total amount of global memory:
        # 81106 MBytes (85045477376 bytes)"
        "memory": (85045477376, "B"),
        # the H100 white paper, H100 SXM5: "Peak BF16 Tensor TFLOPS 989.4 (1978.9 with
        # sparsity)"; https://www.nvidia.com/en-us/data-center/h100/: "1,979 teraFLOPS*"
        "peak": (989.4, "TFLOP/s"),
        "ici": (NVLINK4 / 2, "GB/s"),
        "dcn": (CONNECTX7, "GB/s"),
        "per node": 8,  # DGX H100: 8 GPUs
    },
    "h200": {
        # nvidia-smi on an H200: 143,771 MiB
        # (https://thundergolfer.com/blog/nvidia-gpu-memory-capacity)
        "memory": (143771 * MIB, "B"),
        # https://www.nvidia.com/en-us/data-center/h200/: "BFLOAT16 Tensor Core 1,979
        # TFLOPS*" (* with sparsity): the same GH100 as the H100's 1978.9
        "peak": (1978.9 / 2, "TFLOP/s"),
        "ici": (NVLINK4 / 2, "GB/s"),
        "dcn": (CONNECTX7, "GB/s"),
        "per node": 8,  # HGX H200: 8 GPUs
    },
    "b200": {
        # nvidia-smi on a B200: "183359MiB"
        "memory": (183359 * MIB, "B"),
        # HGX B200 (nvidia.com/en-us/data-center/hgx/): FP16/BF16 Tensor Core 4.5
        # PFLOPS per GPU with sparsity, 2.25 dense
        "peak": (4.5 / 2, "PFLOP/s"),
        "ici": (NVLINK5 / 2, "GB/s"),
        "dcn": (CONNECTX7, "GB/s"),
        "per node": 8,  # DGX B200: 8 GPUs
    },
    "tpu-v5e": {
        # https://cloud.google.com/tpu/docs/v5e: "Peak compute per chip (bf16) 197
        # TFLOPs", "HBM2 capacity and bandwidth 16 GB, 819 GBps"; the memory is what
        # libtpu allows (0.7): jax.devices()[0].memory_stats()["bytes_limit"] on a v5e,
        # 16909336064 with jax 0.10.2 and libtpu 0.0.42.1 (the 16 GB read as 16 GiB was
        # more than it allows)
        "memory": (16909336064, "B"),
        "peak": (197, "TFLOP/s"),
        # https://jax-ml.github.io/scaling-book/tpus/: ICI BW/link (bidi) 9e10 bytes/s,
        # DCN "3.125e9 for TPU v5e"
        "ici": (9e10 / 1e9, "GB/s"),
        "dcn": (3.125e9 / 1e9, "GB/s"),
        "per node": None,
    },
    "tpu-v5p": {
        # https://cloud.google.com/tpu/docs/v5p: "Peak compute per chip (bf16) 459
        # TFLOPs", "HBM2e capacity and bandwidth 95GB, 2765 GBps"
        "memory": (95, "GiB"),
        "peak": (459, "TFLOP/s"),
        # the scaling book: ICI BW/link (bidi) 1.8e11; DCN "6.25e9 bytes / second per TPU"
        "ici": (1.8e11 / 1e9, "GB/s"),
        "dcn": (6.25e9 / 1e9, "GB/s"),
        "per node": None,
    },
    "tpu-v6e": {
        # https://cloud.google.com/tpu/docs/v6e: "Peak compute per chip (bf16) 918
        # TFLOPs", "HBM capacity per chip 32 GB"
        "memory": (32, "GiB"),
        "peak": (918, "TFLOP/s"),
        # the scaling book: ICI BW/link (bidi) 1.8e11; DCN "12.5e9 for TPU v6e"
        "ici": (1.8e11 / 1e9, "GB/s"),
        "dcn": (12.5e9 / 1e9, "GB/s"),
        "per node": None,
    },
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_tables_figures_are_their_sources(name):
    memory, peak, ici, dcn, per_node = PRESET_TABLE[name]
    source = SOURCES[name]
    value, unit = source["memory"]
    if unit == "GiB":  # a TPU data sheet's GB, read as GiB
        assert figure(memory)[0] == value * GIB
    else:  # a device's bytes, exact
        assert int(figure(memory)[0]) == value
    assert shown(peak, source["peak"][0] * UNITS[source["peak"][1]], source["peak"][1])
    for cell, key in ((ici, "ici"), (dcn, "dcn")):
        bandwidth = cell.split(",")[0]
        assert shown(bandwidth, source[key][0] * 1e9, "GB/s"), (name, key)
    assert (None if per_node == "one slice" else int(per_node)) == source["per node"]


def test_the_docs_cite_every_source_address_this_file_checks_against():
    cited = set(re.findall(r"https://[\w./-]+", DOCS.read_text()))
    here = set(re.findall(r"https://[\w./-]+", pathlib.Path(__file__).read_text()))
    assert here <= cited, here - cited


# --- the chips' descriptions: the compiler's targets -------------------------------------

#: What NVIDIA's sources state of each GPU: SMs, HBM bandwidth (TB/s), boost clock
#: (GHz), L2 (MiB), compute capability.
CHIP_SOURCES = {
    # XLA's a100_sxm_80.txtpb (openxla/xla, xla/backends/gpu/target_config/specs):
    # core_count: 108, memory_bandwidth: 2039040000000, clock_rate_ghz: 1.41,
    # l2_cache_size: 41943040, cuda_compute_capability { major: 8 }; the data sheet's
    # "2,039GB/s"
    "a100": (108, 2.039, 1.41, 40, (8, 0)),
    # NVIDIA H100 data sheet (SXM5): 132 SMs, 3.35 TB/s; CUDA's deviceQuery: "(132)
    # Multiprocessors", "GPU Max Clock rate: 1980 MHz (1.98 GHz)", "L2 Cache Size:
    # 52428800 bytes", "CUDA Capability Major/Minor version number: 9.0"
    "h100": (132, 3.35, 1.98, 52428800 / MIB, (9, 0)),
    # https://www.nvidia.com/en-us/data-center/h200/: 4.8 TB/s; the same GH100 as the H100's
    "h200": (132, 4.8, 1.98, 50, (9, 0)),
    # DGX B200 (nvidia.com/en-us/data-center/dgx-b200/): 64 TB/s for 8 GPUs, 8 each;
    # a published device query: "Processor(s)...: 148", "Clock..........: 1965"
    "b200": (148, 8, 1.965, 126, (10, 0)),
}


@pytest.mark.parametrize("name", list(CHIP_TABLE))
def test_each_chips_description_is_the_docs_table_and_its_sources(name):
    _, capability, sms, memory, bandwidth, clock, l2 = CHIP_TABLE[name]
    chip = target_for(st.hardware(name)).chip
    assert chip.capability == tuple(int(v) for v in capability.split("."))
    assert chip.sms == int(sms)
    assert chip.memory_bytes == int(figure(memory)[0])
    assert chip.bandwidth == pytest.approx(figure(bandwidth)[0], rel=1e-12)
    assert chip.clock_ghz == figure(clock)[0]
    assert chip.l2_bytes == figure(l2)[0]
    # the memory's MiB, shown beside its bytes
    assert f"({round(chip.memory_bytes / MIB):,} MiB)" in memory
    source_sms, source_bandwidth, source_clock, source_l2, source_capability = CHIP_SOURCES[name]
    assert (chip.sms, chip.capability) == (source_sms, source_capability)
    assert chip.bandwidth == pytest.approx(source_bandwidth * 1e12, rel=1e-12)
    assert chip.clock_ghz == source_clock
    assert chip.l2_bytes == source_l2 * MIB


@pytest.mark.parametrize("name", [n for n in PRESET_TABLE if not n.startswith("tpu")])
def test_a_gpu_presets_memory_is_what_its_compiler_is_told(name):
    # one figure for one chip: the roofline's budget and XLA GPU's device memory
    chip = target_for(st.hardware(name)).chip
    assert st.hardware(name).memory_bytes == chip.memory_bytes
    assert SOURCES[name]["memory"][0] == chip.memory_bytes


#: Google's pages: the v5e and v6e pods are 256 chips in a 2D torus, v5p's a 3D
#: torus of 8,960 chips (https://cloud.google.com/tpu/docs/v5e, /v6e, /v5p).
TPU_SOURCES = {"tpu-v5e": (2, 256), "tpu-v6e": (2, 256), "tpu-v5p": (3, 8960)}


@pytest.mark.parametrize("name", list(TPU_SOURCES))
def test_a_tpu_targets_slice_is_its_generations_torus(name):
    target = target_for(st.hardware(name))
    dimensions, pod = TPU_SOURCES[name]
    assert target.platform == "tpu" and target.chip.generation == name.removeprefix("tpu-")
    assert target.dimensions == dimensions
    # a slice is at most a pod (spmdtree checks the 2D pods; a v5p job may be a whole pod)
    assert target.slice_limit in (pod, None) and (target.slice_limit is None) is (pod > 256)
    assert st.hardware(name).devices_per_node is None  # one slice, unless told


def test_every_preset_has_a_target_and_the_same_name():
    targets = {name: target_for(st.hardware(name)) for name in PRESET_TABLE}
    assert all(targets[name] is not None and targets[name].name == name for name in targets)
    assert {n for n, t in targets.items() if t.platform == "cuda"} == set(CHIP_TABLE)


# --- the prediction's cost model: every figure its table's and its source's -------------

# The per-kernel model's figures are the presets' own fields (0.6), as the prediction
# reads them (`Hardware.costs`).
COSTS = {name: st.hardware(name).costs() for name in PRESET_TABLE}

COST_TABLE = table("| preset | HBM bandwidth | matmul cores |")

#: What the sources state. HBM: NVIDIA's data sheets (H100 SXM 3.35 TB/s, H200 4.8
#: TB/s, B200 8 TB/s each of DGX B200's 64 TB/s) and Google's system-architecture pages
#: (v5e 819 GB/s, v5p 2,765 GB/s, v6e 1,640 GB/s); the largest matmul share, ml-engineering's
#: MAMF table (https://github.com/stas00/ml-engineering/tree/master/compute/accelerator:
#: H100 SXM 794.5 of 989 TFLOPS bf16, "H200 is the same", B200 1,745 of 2,250); SMs as the
#: chips' own table; the tile, cuBLAS's 128 x 128 and the MXU's (128; 256 on v6e); XLA GPU's
#: kKernelLaunchOverhead 1 us and kNcclKernelLaunchOverhead 5 us
#: (https://github.com/openxla/xla/blob/main/xla/service/gpu/model/gpu_performance_model_base.h);
#: the H100 data sheet's TF32 494.7 and FP32 67 of 989.4 TFLOPS.
COST_SOURCES = {
    # ml-engineering's MAMF table: "NVIDIA A100 SXM | 271.2 | 312 | 86.9%"
    "a100": (2.039e12, 108, 128, 271.2 / 312, 1e-6, 5e-6),
    "h100": (3.35e12, 132, 128, 794.5 / 989, 1e-6, 5e-6),
    "h200": (4.8e12, 132, 128, 794.5 / 989, 1e-6, 5e-6),
    "b200": (8e12, 148, 128, 1745 / 2250, 1e-6, 5e-6),
    "tpu-v5e": (819e9, 1, 128, 1.0, 0.0, 0.0),
    "tpu-v5p": (2765e9, 1, 128, 1.0, 0.0, 0.0),
    "tpu-v6e": (1640e9, 1, 256, 1.0, 0.0, 0.0),
}


#: The A100 data sheet (nvidia.com/en-us/data-center/a100/): "Tensor Float 32 (TF32) 156
#: TFLOPS", "FP32 19.5 TFLOPS", of its 312 bf16.
F32_SOURCES = {"a100": (156 / 312, 19.5 / 312)}


def ratio(cell):
    """A cell's "a of b" as a / b (a plain number as itself)."""
    numbers = [float(v) for v in re.findall(r"[\d.]+", cell)]
    return numbers[0] / numbers[1] if " of " in cell else numbers[0]


def test_the_cost_table_lists_every_preset_and_no_other():
    assert set(COST_TABLE) == set(PRESET_TABLE) == set(COSTS) == set(COST_SOURCES)


@pytest.mark.parametrize("name", list(COST_SOURCES))
def test_every_cost_model_figure_is_the_docs_table_and_its_source(name):
    costs = COSTS[name]
    hbm, cores, tile, share, f32, launch, latency = COST_TABLE[name]
    # the table
    assert costs.hbm_bytes_per_second == figure(hbm)[0]
    assert costs.cores == int(cores)
    assert costs.tile == tuple(int(v) for v in tile.split(" x "))
    assert costs.matmul_efficiency == pytest.approx(ratio(share), rel=1e-12)
    default, highest = f32.split(", ")
    assert costs.f32_speed == float(default)
    assert costs.f32_highest_speed == pytest.approx(ratio(highest), rel=1e-12)
    assert costs.launch_seconds == pytest.approx(figure(launch)[0], rel=1e-12)
    assert costs.collective_latency_seconds == pytest.approx(figure(latency)[0], rel=1e-12)
    assert costs.memory_efficiency == 0.9  # the docs' stated assumption
    # the sources
    source_hbm, source_cores, source_tile, source_share, source_launch, source_latency = (
        COST_SOURCES[name]
    )
    assert costs.hbm_bytes_per_second == source_hbm
    assert (costs.cores, costs.tile) == (source_cores, (source_tile, source_tile))
    assert costs.matmul_efficiency == pytest.approx(source_share, rel=1e-12)
    assert (costs.launch_seconds, costs.collective_latency_seconds) == (
        source_launch,
        source_latency,
    )
    if name in CHIP_TABLE:  # a GPU: its SMs and bandwidth are its chip description's too
        chip = target_for(st.hardware(name)).chip
        assert (costs.cores, costs.hbm_bytes_per_second) == (chip.sms, chip.bandwidth)
        # the data sheets: the H100's TF32 494.7 and FP32 67 of 989.4 TFLOPS, the
        # A100's 156 and 19.5 of 312
        tf32, fp32 = F32_SOURCES.get(name, (494.7 / 989.4, 67 / 989))
        assert costs.f32_speed == pytest.approx(tf32, rel=1e-3)
        assert costs.f32_highest_speed == pytest.approx(fp32, rel=1e-12)


# --- one source: every table is built from the chips' one table -------------------------

# Private: the chips' one table, which the presets are built from
from spmdtree._src.step.hw.chips import CHIPS  # noqa: E402


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_every_table_says_what_the_chips_table_says(name):
    # A figure is written once, in chips.CHIPS: the preset is built from it alone, and
    # the compiler's target and the model's costs are read off the preset (0.4: the
    # H100's memory was 80 GiB in one table and 81,106 MiB in another; 0.6: nothing is
    # looked up by the hardware's name).
    figures, hardware = CHIPS[name], st.hardware(name)
    target, costs = target_for(hardware), hardware.costs()
    assert set(CHIPS) == set(PRESET_TABLE)
    # and says where each figure came from (0.7: the table)
    assert hardware == st.Hardware(name, **figures, provenance=hardware.provenance)
    assert set(hardware.provenance) == set(figures)
    # every figure given, but a flash kernel's share on a TPU (none is published), an
    # unfused update's on a TPU but the v5e (0.7: measured on a v5e only), and a grouped
    # matmul's, rows moved by index's, a matmul with a fused update's and the chip's own
    # memory's rate on every chip (0.8: none published)
    gpu = isinstance(figures["chip"], st.GpuChip)
    flash = ("flash_forward_efficiency", "flash_backward_efficiency")
    update = () if name == "tpu-v5e" else ("update_efficiency",)
    grouped = (
        "grouped_efficiency",
        "indexed_efficiency",
        "fused_update_efficiency",
        "on_chip_bytes_per_second",
        "read_efficiency",
    )
    assert hardware.left_out == (grouped if gpu else flash + update + grouped)
    assert costs.hbm_bytes_per_second == figures["hbm_bytes_per_second"]
    assert costs.matmul_efficiency == figures["matmul_efficiency"]
    assert costs.tile == (figures["tile"], figures["tile"])
    assert costs.cores == figures["cores"]
    if isinstance(figures["chip"], st.GpuChip):
        chip = target.chip
        assert target.platform == "cuda"
        assert (chip.memory_bytes, chip.bandwidth, chip.sms) == (
            figures["memory_bytes"],
            figures["hbm_bytes_per_second"],
            figures["cores"],
        )
        assert f'device_description_str: "{figures["chip"].description}"' in chip.target_config()
    else:
        assert target.platform == "tpu" and target.chip is figures["chip"]
        assert target.chip.generation == name.removeprefix("tpu-")
        assert costs.cores == 1


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_a_preset_under_another_name_is_the_same_chip(name):
    import dataclasses

    mine = dataclasses.replace(st.hardware(name), name="mine")
    assert mine.costs() == st.hardware(name).costs()
    assert target_for(mine).chip == target_for(st.hardware(name)).chip


FLASH_TABLE = table("| preset | flash forward | flash backward |")
#: What the sources state (docs/planning.md's table names each): FlashAttention-2's
#: "up to 73% ... forward ... up to 63% ... backward" on A100; cuDNN's causal forward
#: 529 and backward 518 TFLOP/s on H100 (FlashAttention-3, Figs. 5d and 6b), the H200
#: the same; cuDNN 9.19's 1,509 and 1,293 of 2,250 on B200 (FlashAttention-4, Figs. 4
#: and 6); none for a TPU (the default).
FLASH_SOURCES = {
    "a100": (0.73, 0.63),
    "h100": (529 / 989, 518 / 989),
    "h200": (529 / 989, 518 / 989),
    "b200": (1509 / 2250, 1293 / 2250),
    "tpu-v5e": (None, None),
    "tpu-v5p": (None, None),
    "tpu-v6e": (None, None),
}


@pytest.mark.parametrize("name", list(FLASH_SOURCES))
def test_every_flash_share_is_the_docs_table_and_its_source(name):
    assert set(FLASH_TABLE) == set(FLASH_SOURCES) == set(PRESET_TABLE)
    hardware, costs = st.hardware(name), COSTS[name]
    forward, backward, _ = FLASH_TABLE[name]
    given = (hardware.flash_forward_efficiency, hardware.flash_backward_efficiency)
    assert given == FLASH_SOURCES[name]
    used = (costs.flash_forward_efficiency, costs.flash_backward_efficiency)
    if given[0] is None:  # the default, as the table says
        assert used == (0.5, 0.5) and "(default)" in forward and "(default)" in backward
    else:
        assert used == given
    assert used[0] == pytest.approx(ratio(forward), rel=1e-12)
    assert used[1] == pytest.approx(ratio(backward), rel=1e-12)


# --- a TPU's clock: libtpu's estimated cycles as seconds (0.7) ---------------------------

#: The bf16 FLOPs a TPU's MXUs run a cycle: a 128 x 128 MXU's multiply-adds (256 x 256
#: on v6e), 2 FLOPs each, times its MXUs (the scaling book, "How to Think About TPUs":
#: "about 5e13 bf16 FLOPs/s per MXU at 1.5GHz on TPU v5e", 4 MXUs a TensorCore; v5p's
#: two TensorCores one megacore).
MXU_FLOPS = {
    "tpu-v5e": 4 * 128 * 128 * 2,
    "tpu-v5p": 2 * 4 * 128 * 128 * 2,
    "tpu-v6e": 4 * 256 * 256 * 2,
}


@pytest.mark.parametrize("name", list(MXU_FLOPS))
def test_a_tpus_clock_is_its_peak_over_its_mxus_flops_a_cycle(name):
    hardware = st.hardware(name)
    clock = hardware.flops_per_second / MXU_FLOPS[name] / 1e9
    assert hardware.chip.clock_ghz == pytest.approx(clock, abs=0.005)  # 1.5, 1.75, 1.75
    assert tpu_clock_ghz(hardware.chip.device_kind) == hardware.chip.clock_ghz
    assert tpu_clock_ghz(CHIPS["h100"]["chip"].description) == 0.0


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
@pytest.mark.parametrize("name", list(MXU_FLOPS))
def test_libtpus_cycles_of_a_large_matmul_run_at_most_the_mxus_flops_a_cycle(name):
    # what libtpu models of the chip agrees with the MXUs counted above: a bf16 4096^3
    # matmul's estimated cycles give 0.97, 0.96 and 0.87 of their FLOPs a cycle (two
    # MXUs on v6e, as one Google page says, could not run 455,675 a cycle)
    from jax.sharding import AbstractMesh

    a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    step = st.preflight(lambda x: x @ x, a, mesh=AbstractMesh((1,), ("data",)), target=name)
    (kernel,) = step.schedule.kernels()
    flops_a_cycle = 2 * 4096**3 / kernel.estimated_cycles
    assert 0.8 * MXU_FLOPS[name] < flops_a_cycle <= MXU_FLOPS[name]
    assert step.compiler_seconds == kernel.estimated_cycles / (
        st.hardware(name).chip.clock_ghz * 1e9
    )
