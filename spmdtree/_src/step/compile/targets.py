"""Where a step compiles, and what the compile says: the third of preflight's stages.

One small protocol, `Compiler`, with three implementations, as jax hides its
backends behind `Lowered` and `Compiled`: `Here` (this process: a mesh of its
own devices, or enough CPU devices for an `AbstractMesh`), `CpuChild` (a fresh
process given as many fake CPU devices: the fast estimate), and `TargetChild`,
where an accelerator's own compiler runs without the accelerator: XLA's GPU
compiler (``jax-cuda12-plugin`` with a chip's description, no device needed)
or the TPU compiler in ``libtpu`` (a slice's topology, as MaxText's
``train_compile.py`` does). Each owns its mesh, its options, its install check
and its words; `compiler_for` picks one. A child gets the step through
`jax.export` and answers an `Analysis` as JSON.
The chips' descriptions are their data sheets' figures (docs/planning.md,
"Compiling for the target", lists each with its source).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, cast, overload

import jax
import numpy as np
from jax.sharding import AbstractDevice, Mesh

from spmdtree._src.errors import Mistake
from spmdtree._src.resolve import HOST_KINDS
from spmdtree._src.rules import AnyMesh
from spmdtree._src.step.compile.trace import Exported, Lowered, Site, Traced
from spmdtree._src.step.hlo.forms import overstated_bytes
from spmdtree._src.step.hlo.reading import Reading, reading_of
from spmdtree._src.step.hlo.schedule import Schedule, read_schedule
from spmdtree._src.step.hw.chips import GpuChip, TpuChip, slice_dims
from spmdtree._src.step.hw.hardware import PRESETS, Hardware, check_devices_per_node
from spmdtree._src.step.kinds import Backend

#: How long a compile subprocess may take before it is stopped.
CHILD_SECONDS = 3600


@dataclasses.dataclass(frozen=True)
class Chip:
    """An NVIDIA GPU's facts, as XLA's GPU target description reads them: a
    `Hardware`'s SMs (`cores`), memory and bandwidth with its `GpuChip`.

    Sources: NVIDIA's data sheets (SMs, memory, bandwidth, clock, L2) and the
    CUDA programming guide's per-compute-capability limits (shared memory,
    registers, threads); docs/planning.md lists each figure's source.
    """

    description: str
    capability: tuple[int, int]
    sms: int
    memory_bytes: int
    bandwidth: int  # bytes per second
    clock_ghz: float
    l2_bytes: int
    shared_per_sm: int = 233_472  # 228 KiB per SM (compute capability 9.0 and 10.0)
    shared_per_block_optin: int = 232_448  # 227 KiB
    registers_per_sm: int = 65_536
    fpus_per_sm: int = 128

    def target_config(self) -> str:
        """The chip as XLA's ``GpuTargetConfigProto``, in protobuf text format."""
        major, minor = self.capability
        return (
            "gpu_device_info {\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
            "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n"
            "  shared_memory_per_block: 49152\n"
            f"  shared_memory_per_core: {self.shared_per_sm}\n"
            "  threads_per_core_limit: 2048\n"
            f"  core_count: {self.sms}\n  fpus_per_core: {self.fpus_per_sm}\n"
            "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n"
            "  block_dim_limit_z: 65535\n"
            f"  memory_bandwidth: {self.bandwidth}\n  l2_cache_size: {self.l2_bytes}\n"
            f"  clock_rate_ghz: {self.clock_ghz}\n  device_memory_size: {self.memory_bytes}\n"
            f"  shared_memory_per_block_optin: {self.shared_per_block_optin}\n"
            f"  registers_per_core_limit: {self.registers_per_sm}\n"
            f"  registers_per_block_limit: {self.registers_per_sm}\n"
            "}\n"
            'platform_name: "CUDA"\n'
            "dnn_version_info { major: 9 minor: 8 }\n"
            f'device_description_str: "{self.description}"\n'
        )


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator's compiler: XLA GPU for a `Chip`, or libtpu for a `TpuChip`.

    Attributes:
        name: the hardware it belongs to (``"h100"``, ``"tpu-v5p"``).
        platform: ``"cuda"`` or ``"tpu"``.
        chip: the GPU's `Chip`, or the TPU's `TpuChip`.
    """

    name: str
    platform: str
    chip: Chip | TpuChip

    @property
    def compiler(self) -> str:
        """``"XLA GPU"`` or ``"libtpu"``."""
        return "XLA GPU" if self.platform == "cuda" else "libtpu"

    @property
    def extra(self) -> str:
        """The pip extra that installs the compiler: ``"cuda"`` or ``"tpu"``."""
        return "cuda" if self.platform == "cuda" else "tpu"

    @property
    def dimensions(self) -> int:
        """A TPU slice's topology dimensions (3 for v5p, 2 for v5e/v6e; 0 on a GPU)."""
        return self.chip.dimensions if isinstance(self.chip, TpuChip) else 0

    @property
    def slice_limit(self) -> int | None:
        """The most chips one TPU slice holds (None: no limit here, or a GPU)."""
        return self.chip.slice_limit if isinstance(self.chip, TpuChip) else None


def target_for(hardware: Hardware) -> Target | None:
    """The compiler target a `Hardware` carries (its `chip`), or None where it has
    none: XLA GPU's description of a GPU from the hardware's own figures, libtpu's
    generation of a TPU. Never looked up by the hardware's name (0.6)."""
    chip = hardware.chip
    if isinstance(chip, TpuChip):
        return Target(hardware.name, "tpu", chip)
    if not isinstance(chip, GpuChip):
        return None
    missing = [f for f in ("cores", "hbm_bytes_per_second") if getattr(hardware, f) is None]
    if missing:
        raise Mistake(
            ValueError,
            f"hardware {hardware.name!r} has a GpuChip but no {' or '.join(missing)}: XLA "
            "GPU's target description needs its SMs (cores=) and its memory bandwidth "
            "(hbm_bytes_per_second=).",
        )
    described = Chip(
        chip.description,
        chip.capability,
        int(cast(int, hardware.cores)),
        hardware.memory_bytes,
        int(cast(float, hardware.hbm_bytes_per_second)),
        chip.clock_ghz,
        chip.l2_bytes,
        chip.shared_per_sm,
        chip.shared_per_block_optin,
        fpus_per_sm=chip.fpus_per_sm,
    )
    return Target(hardware.name, "cuda", described)


def abstract_device(target: Target) -> AbstractDevice:
    """`target`'s device as jax's `AbstractDevice`: a GPU's kind is its description
    (XLA names a device by it), with its SMs for cores."""
    if isinstance(target.chip, Chip):
        return AbstractDevice(target.chip.description, target.chip.sms, "gpu")
    return AbstractDevice(target.chip.device_kind, target.chip.tensor_cores, "tpu")


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a target's devices are laid out for a mesh: GPUs as nodes, TPU chips as
    slices of one topology.

    Attributes:
        target: the `Target`.
        devices: how many devices.
        per_node: devices per GPU node, or chips per TPU slice.
    """

    target: Target
    devices: int
    per_node: int

    @property
    def nodes(self) -> int:
        """How many GPU nodes or TPU slices."""
        return self.devices // self.per_node

    @property
    def topology(self) -> str:
        """What the compiler is given: ``1x8x8`` (GPU), ``v5p:4x4x4`` (one TPU slice)."""
        if self.target.platform == "cuda":
            return f"1x{self.nodes}x{self.per_node}"
        return f"{cast(TpuChip, self.target.chip).generation}:{'x'.join(map(str, self.dims))}"

    @property
    def dims(self) -> list[int]:
        """A TPU slice's topology dimensions."""
        return slice_dims(self.per_node, self.target.dimensions)

    def __str__(self) -> str:
        kind = "node" if self.target.platform == "cuda" else "slice"
        parts = f"{self.nodes} {kind}{'' if self.nodes == 1 else 's'} of {self.per_node}"
        if self.target.platform == "tpu" and self.nodes == 1:
            parts = f"one slice, {'x'.join(map(str, self.dims))}"
        return f"{self.devices} x {self.target.name}, {parts}, {self.target.compiler} compiler"


def place(target: Target, devices: int, per_node: int | None) -> Placement:
    """The placement of `devices` on `target` (nodes or slices of `per_node`; None:
    the GPU's 8 per node, one TPU slice), checked before anything compiles."""
    if target.platform == "cuda":
        node = min(per_node or 8, devices)
        if devices % node:
            raise Mistake(
                ValueError,
                f"a mesh of {devices} GPUs does not fill nodes of {node}: give a mesh "
                f"whose size is a multiple of {node}, or devices_per_node= that divides it.",
            )
        return Placement(target, devices, node)
    size = per_node or devices
    if devices % size or not _power_of_two(size):
        raise Mistake(
            ValueError,
            f"a mesh of {devices} {target.name} chips cannot be laid on TPU slices of "
            f"{size} chips: a slice holds a power of two of chips, and the mesh must "
            "fill whole slices. Give a mesh of such a size, or devices_per_node= (the "
            "slice size) that divides it.",
        )
    if target.slice_limit is not None and size > target.slice_limit:
        raise Mistake(
            ValueError,
            f"one {target.name} slice holds at most {target.slice_limit} chips, and the "
            f"mesh has {devices}. Pass devices_per_node= (the slice size, e.g. "
            f"{target.slice_limit}) to compile it as a multi-slice job.",
        )
    return Placement(target, devices, size)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


class CompilerMissing(Mistake):
    """A target's compiler is not installed (advise says so once, and goes on)."""


def check_compiler(target: Target) -> None:
    """Raises, naming the pip command, if `target`'s compiler is not installed, or is
    not at the version this jax needs."""
    module = "jax_plugins.xla_cuda12" if target.platform == "cuda" else "libtpu"
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    fix = f"pip install 'spmdtree[{target.extra}]' (it runs without the accelerator)"
    if not found:
        raise CompilerMissing(
            ValueError,
            f"compiling for {target.name} needs the {target.compiler} compiler, which is not "
            f"installed: {fix}. Without target=, preflight gives the CPU estimate.",
        )
    have, wanted = _versions(target)
    if have is not None and wanted is not None and not have.startswith(wanted):
        raise CompilerMissing(
            ValueError,
            f"compiling for {target.name} needs the {target.compiler} compiler at version "
            f"{wanted}* for jax {jax.__version__}, and {have} is installed: {fix}.",
        )


def _versions(target: Target) -> tuple[str | None, str | None]:
    """The installed compiler's version, and the one this jax needs (None: unknown):
    jax-cuda12-plugin at jax's own version, libtpu at the version jax's tpu extra pins."""
    from importlib import metadata

    name = "jax-cuda12-plugin" if target.platform == "cuda" else "libtpu"
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None, None
    if target.platform == "cuda":
        return have, jax.__version__
    pins = [r for r in metadata.requires("jax") or [] if r.startswith("libtpu") and "tpu" in r]
    found = re.search(r"==\s*([\d.]+?)(?:\.\*)?\s*(?:;|$)", pins[0]) if pins else None
    return have, found.group(1) if found else None


@dataclasses.dataclass(frozen=True)
class Memory:
    """What a compiled step holds on one device, as its compiler says
    (``compiled.memory_analysis()``), in bytes; `StepPlan.memory` (new in 0.5).

    Attributes:
        argument_bytes: the arguments' bytes on the device.
        output_bytes: the outputs'.
        alias_bytes: outputs that reuse a donated argument's buffer.
        temp_bytes: the compiler's temporaries (activations among them).
        code_bytes: the generated code (0 on CPU).
        compiler_peak_bytes: the compiler's own peak where it gives one
            (``peak_memory_in_bytes``: libtpu and XLA GPU), else 0.
        host_argument_bytes, host_output_bytes, host_alias_bytes,
            host_temp_bytes: the same in the host's memory (arrays offloaded
            with a host `memory_kind`), apart from the device's.

    Example:
        >>> import spmdtree as st
        >>> memory = st.Memory(1024, 512, 256, 4096, 0)
        >>> memory.peak_bytes  # arguments + outputs - aliased + temporaries
        5376
        >>> offloaded = memory.with_host_arguments(512)  # half the arguments on the host
        >>> offloaded.argument_bytes, offloaded.host_argument_bytes, offloaded.host_peak_bytes
        (512, 512, 512)
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    compiler_peak_bytes: int = 0
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries: the step's peak on one device."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def host_peak_bytes(self) -> int:
        """The same in the host's memory, per device: what the step offloads."""
        return (
            self.host_argument_bytes
            + self.host_output_bytes
            - self.host_alias_bytes
            + self.host_temp_bytes
        )

    def with_host_arguments(self, moved: int) -> Memory:
        """`moved` bytes of the arguments counted in the host's memory, not the
        device's: what the CPU (one memory) and XLA GPU count as the device's."""
        return dataclasses.replace(
            self,
            argument_bytes=self.argument_bytes - moved,
            host_argument_bytes=self.host_argument_bytes + moved,
        )


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What a compile says of a step, per device: its `Memory` (the compiler's
    own peak where it gives one, and the host memory it holds where arrays are
    offloaded), what its HLO says (`reading`), its schedule, and the compiler's
    own time estimate where it gives one (`compiler_seconds`: libtpu; 0
    elsewhere). Crosses a process boundary as JSON (`to_json`, `from_json`)."""

    memory: Memory
    reading: Reading
    overstated_bytes: int
    backend: Backend
    seconds: float = 0.0
    schedule: Schedule | None = None
    compiler_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The analysis as plain JSON values."""
        schedule = self.schedule.to_json() if self.schedule else None
        return {**dataclasses.asdict(self), "reading": self.reading.to_json(), "schedule": schedule}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Analysis:
        """The analysis `to_json` gave."""
        schedule = Schedule.from_json(data["schedule"]) if data.get("schedule") else None
        backend = Backend(data["backend"])
        reading = Reading.from_json(data["reading"])
        memory = Memory(**data["memory"])
        return cls(
            **{
                **data,
                "memory": memory,
                "reading": reading,
                "schedule": schedule,
                "backend": backend,
            }
        )


def analyse(
    compiled: jax.stages.Compiled, mesh: Mesh, platform: str, slice_size: int | None = None
) -> Analysis:
    """A compiled step's memory per device, its collectives and FLOPs per step.

    On CPU devices, an all-reduce whose every use takes one device's slice is
    counted as the reduce-scatter an accelerator runs, and the whole results
    such all-reduces keep live are what `overstated_bytes` counts.

    Raises:
        Mistake: if the backend reports no memory analysis or no HLO.
    """
    executable = compiled.runtime_executable()
    # the module itself where jaxlib gives it; its text (printed at some cost) only if not
    module = executable.hlo_modules()[0] if executable is not None else compiled.as_text()
    memory = compiled.memory_analysis()
    if memory is None or module is None:
        raise Mistake(
            ValueError,
            "the backend this step compiled for reports no memory analysis (or no HLO) "
            "for it, which preflight reads. Preflight on an AbstractMesh, which "
            "compiles for CPU devices, or pass target=.",
        )
    # the module walked once: the reading is a fold of its schedule
    schedule = read_schedule(
        module, tuple(mesh.shape.items()), platform=platform, slice_size=slice_size
    )
    read = reading_of(schedule)
    temp = int(memory.temp_size_in_bytes)
    outputs, host_outputs = _apart(
        int(memory.output_size_in_bytes),
        _host(memory, "output"),
        ((out, out.sharding) for out in jax.tree.leaves(compiled.out_info)),
    )
    compiler_peak = getattr(memory, "peak_memory_in_bytes", 0) or 0
    return Analysis(
        memory=Memory(
            argument_bytes=int(memory.argument_size_in_bytes),
            output_bytes=outputs,
            alias_bytes=int(memory.alias_size_in_bytes),
            temp_bytes=temp,
            code_bytes=int(memory.generated_code_size_in_bytes),
            # the CPU's own peak is the CPU program's, no accelerator's: not reported
            compiler_peak_bytes=0 if platform == "cpu" else int(compiler_peak),
            host_argument_bytes=_host(memory, "argument"),
            host_output_bytes=host_outputs,
            host_alias_bytes=_host(memory, "alias"),
            host_temp_bytes=_host(memory, "temp"),
        ),
        reading=read,
        overstated_bytes=overstated_bytes(read.held_bytes, temp) if platform == "cpu" else 0,
        backend=Backend.of(platform),
        schedule=schedule,
        compiler_seconds=_optimal_seconds(compiled),
    )


def _host(memory: Any, kind: str) -> int:
    """One of the compiler's host memory figures (``host_argument_size_in_bytes``...),
    0 where this jaxlib has none."""
    return int(getattr(memory, f"host_{kind}_size_in_bytes", 0) or 0)


def _apart(device: int, host: int, placed: Iterable[tuple[Any, Any]]) -> tuple[int, int]:
    """The (device, host) bytes per device of a step's outputs (each an array and
    its sharding in `placed`): the compiler's figures, but where it reports no
    host bytes while the shardings put outputs in a host memory (the CPU, whose
    one memory holds all), those are moved from the device's figure to the
    host's. (The arguments' are moved by `preflight.step_plan`, from their plan:
    a compile child's input shardings lose their memory kinds.)"""
    offloaded = sum(
        math.prod(sharding.shard_shape(tuple(array.shape))) * np.dtype(array.dtype).itemsize
        for array, sharding in placed
        if getattr(sharding, "memory_kind", None) in HOST_KINDS
    )
    return (device, host) if host or not offloaded else (device - offloaded, offloaded)


def _optimal_seconds(compiled: jax.stages.Compiled) -> float:
    """The compiler's own estimate of the step's time: libtpu's cost analysis says
    ``optimal_seconds``; 0.0 where the compiler gives none (XLA GPU without a
    device gives no cost analysis at all; the CPU's has no such key)."""
    try:
        costs = compiled.cost_analysis()
    except Exception:  # a compiler without a cost model raises: no figure
        return 0.0
    if isinstance(costs, (list, tuple)):  # older jax: one dict per module
        costs = costs[0] if costs else None
    seconds = costs.get("optimal_seconds", 0.0) if isinstance(costs, dict) else 0.0
    return max(0.0, float(seconds))


def compile_options(platform: str) -> dict[str, Any]:
    """Compiler options per platform. Fake CPU devices: no costly machine-code
    optimisation, which halves the compile time and changes no buffer, and the
    remat barriers kept (rematerialised work counted as an accelerator runs
    it). XLA GPU
    without a device: GEMMs to cuBLAS, as the device's autotuner mostly picks
    (deviceless, XLA cannot autotune; with Triton GEMMs its peaks came 10-27%
    under a real H200's with rematerialisation, with cuBLAS within 4%)."""
    if platform == "cpu":
        return {
            "xla_backend_optimization_level": 0,
            "xla_llvm_disable_expensive_passes": True,
            # The pass that drops the remat barriers, after which CSE folds the
            # recomputed forward into the first one: without it, the CPU program
            # recomputes as an accelerator's does (FLOPs equal the jaxpr's).
            "xla_disable_hlo_passes": "cse_barrier_expander",
        }
    if platform == "cuda":  # a GPU target, compiled without a device
        return {"xla_gpu_enable_triton_gemm": False}
    return {}  # a Mesh of real devices ("gpu", "tpu") compiles as the job will


class Compiler(Site, Protocol):
    """Where a step compiles: `Here`, a `CpuChild` or a `TargetChild`.

    Attributes:
        here: the mesh of this process's devices the step is lowered for; None
            where it is exported to a child.
        platform: the compiler's platform: ``"cpu"``, ``"cuda"``, ``"tpu"``, or a
            real `Mesh`'s devices' (``"gpu"``, ``"tpu"``).
        devices_per_node: a target's devices per GPU node or TPU slice; None
            elsewhere.
    """

    @property
    def devices_per_node(self) -> int | None: ...

    def check(self) -> None:
        """Raises `CompilerMissing` where the compiler is not installed."""

    def compile(self, traced: Traced) -> Analysis:
        """The step compiled, its `seconds` the compile's alone (the trace's are
        `traced.seconds`)."""
        ...

    def __str__(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Here:
    """This process's compiler, for a mesh of its own devices (real ones, or the
    CPU devices an `AbstractMesh` is laid on)."""

    here: Mesh

    @property
    def platform(self) -> str:
        """The devices' platform as jax names it: ``"cpu"``, ``"gpu"``, ``"tpu"``."""
        return str(self.here.devices.flat[0].platform)

    @property
    def devices_per_node(self) -> None:
        """None: the devices are the mesh's own."""
        return None

    @property
    def device(self) -> None:
        """None: the step is traced for the devices here."""
        return None

    def check(self) -> None:
        """Nothing to check: the devices' compiler is this process's."""

    def compile(self, traced: Traced) -> Analysis:
        """Compiles the step lowered for `here`."""
        start = time.perf_counter()
        stage = cast(Lowered, traced.stage)  # `here` set: trace lowered it
        compiled = stage.lowered.compile(compile_options(self.platform))
        found = analyse(compiled, self.here, self.platform)
        return dataclasses.replace(found, seconds=time.perf_counter() - start)

    def __str__(self) -> str:
        if self.platform == "cpu":
            return str(CpuChild(self.here.size))
        first = self.here.devices.flat[0]
        return f"{self.here.size} x {first.device_kind}, their own compiler"


class _Child(abc.ABC):
    """A compile in a fresh process, of the step exported for it."""

    here: None = None

    @property
    def device(self) -> AbstractDevice | None:
        """The device the step is traced for (see `TargetChild.device`): none, the
        CPU's."""
        return None

    @property
    @abc.abstractmethod
    def platform(self) -> str:
        """The child's compiler's platform."""

    @property
    @abc.abstractmethod
    def slice_size(self) -> int:
        """The devices one slice (node) holds, as the HLO reader takes it."""

    @abc.abstractmethod
    def mesh_for(self, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh:
        """The mesh the child compiles on (in the child)."""

    def compile(self, traced: Traced) -> Analysis:
        """Compiles the exported step in a child."""
        return compile_child(cast(Exported, traced.stage).payload, self)


@dataclasses.dataclass(frozen=True)
class CpuChild(_Child):
    """A fresh process given `devices` fake CPU devices: the fast estimate."""

    devices: int

    @property
    def platform(self) -> str:
        """``"cpu"``."""
        return "cpu"

    @property
    def devices_per_node(self) -> None:
        """None: fake devices sit on no node."""
        return None

    @property
    def slice_size(self) -> int:
        """All the devices."""
        return self.devices

    def check(self) -> None:
        """Nothing to check: the CPU compiler is jax's own."""

    def mesh_for(self, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh:
        """The child's CPU devices, as many as the mesh has, laid out like it."""
        jax.config.update("jax_num_cpu_devices", math.prod(sizes))
        return cast(Mesh, cpu_mesh(sizes, names, types))

    def __str__(self) -> str:
        return f"{self.devices} CPU devices (the XLA CPU compiler's estimate)"


@dataclasses.dataclass(frozen=True)
class TargetChild(_Child):
    """A fresh process where a target's own compiler compiles for its `placement`."""

    placement: Placement

    @property
    def platform(self) -> str:
        """The target's: ``"cuda"`` or ``"tpu"``."""
        return self.placement.target.platform

    @property
    def devices_per_node(self) -> int:
        """The placement's GPUs per node, or chips per TPU slice."""
        return self.placement.per_node

    @property
    def slice_size(self) -> int:
        """The placement's devices per node or slice."""
        return self.placement.per_node

    @property
    def device(self) -> AbstractDevice:
        """The target's device as jax's `AbstractDevice`: what a kernel written for
        one chip (a Pallas kernel's lowering) asks of the device it is traced for,
        where no such device is here."""
        return abstract_device(self.placement.target)

    def check(self) -> None:
        """Raises `CompilerMissing`, naming the pip command, where the target's
        compiler is not installed or not at this jax's version."""
        check_compiler(self.placement.target)

    def mesh_for(self, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh:
        """The mesh over the target's devices (`target_mesh`)."""
        return target_mesh(self.placement, sizes, names, types)

    def __str__(self) -> str:
        return str(self.placement)


@overload
def compiler_for(
    mesh: AnyMesh, target: Hardware | str, devices_per_node: int | None
) -> TargetChild: ...


@overload
def compiler_for(mesh: AnyMesh, target: None, devices_per_node: None) -> Here | CpuChild: ...


@overload
def compiler_for(
    mesh: AnyMesh, target: Hardware | str | None, devices_per_node: int | None
) -> Compiler: ...


def compiler_for(
    mesh: AnyMesh, target: Hardware | str | None, devices_per_node: int | None
) -> Compiler:
    """Where a step on `mesh` compiles: for `target`'s devices as nodes or slices of
    `devices_per_node` (None: the hardware's), its compiler checked to be
    installed; else here, on a `Mesh`'s own devices or this process's CPU devices
    laid out like an `AbstractMesh`; else in a CPU child. Checked before anything
    compiles."""
    devices = math.prod(mesh.shape.values())
    if target is not None:
        if devices_per_node is not None:  # GPUs per node, or chips per TPU slice
            check_devices_per_node(
                devices_per_node, "devices_per_node", "the hardware's: 8 GPUs a node, one TPU slice"
            )
        chosen, per_node = target_of(target)
        placement = place(
            chosen, devices, per_node if devices_per_node is None else devices_per_node
        )
        found = TargetChild(placement)
        found.check()
        return found
    if devices_per_node is not None:
        raise Mistake(
            ValueError,
            f"devices_per_node is {devices_per_node!r}, but no target= was given: it lays a "
            "target's devices out as nodes or slices. Pass target=, or give devices_per_node "
            "to StepPlan.time instead.",
        )
    if isinstance(mesh, Mesh):
        return Here(mesh)
    here = cpu_mesh(tuple(mesh.shape.values()), tuple(mesh.axis_names), tuple(mesh.axis_types))
    return CpuChild(devices) if here is None else Here(here)


def target_of(target: Hardware | str) -> tuple[Target, int | None]:
    """The compiler target of a `Hardware` (the one it carries) or a preset's name,
    and its devices per node."""
    if not isinstance(target, (Hardware, str)):
        raise Mistake(
            TypeError,
            f"target is {target!r}; expected a preset's name ({', '.join(map(repr, PRESETS))}) "
            "or a st.Hardware with a chip.",
        )
    hardware = target if isinstance(target, Hardware) else PRESETS.get(target)
    found = target_for(hardware) if hardware is not None else None
    if found is None or hardware is None:
        raise Mistake(
            ValueError,
            f"target is {target!r}, whose compiler spmdtree does not know; the targets are "
            f"the presets {', '.join(map(repr, PRESETS))} (st.hardware(name)), or a "
            "st.Hardware with chip= (a st.GpuChip or a st.TpuChip) that says what its "
            "compiler is told.",
        )
    return found, hardware.devices_per_node


def cpu_mesh(sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh | None:
    """This process's CPU devices laid out as a mesh of `sizes`, or None if there are
    too few."""
    cpus = jax.devices("cpu")
    if len(cpus) < math.prod(sizes):
        return None
    devices = np.array(cpus[: math.prod(sizes)]).reshape(tuple(sizes))
    return Mesh(devices, tuple(names), axis_types=tuple(types))


def compile_child(payload: bytes, compiler: _Child) -> Analysis:
    """Compiles an exported step in a fresh process: on that many fake CPU devices,
    or by the target's compiler for its topology."""
    start = time.perf_counter()
    package_root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    )
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
        "TPU_SKIP_MDS_QUERY": "1",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # parallel compiles, and a parent holding it
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    request = pickle.dumps((payload, compiler))
    with tempfile.TemporaryDirectory() as folder:
        answer = os.path.join(folder, "analysis.json")
        code = f"from spmdtree._src.step.compile.targets import child; child({answer!r})"
        try:
            done = subprocess.run(
                [sys.executable, "-c", code],
                input=request,
                capture_output=True,
                env=env,
                timeout=CHILD_SECONDS,
            )
        except subprocess.TimeoutExpired:
            raise Mistake(
                ValueError,
                f"compiling for {compiler} in a subprocess took over {CHILD_SECONDS} s and "
                "was stopped.",
            ) from None
        if done.returncode == 0 and os.path.exists(answer):
            with open(answer) as f:
                said = json.load(f)
            if "error" in said:
                raise _refused(said, compiler)
            found = Analysis.from_json(said)
            return dataclasses.replace(found, seconds=time.perf_counter() - start)
    raise _child_failed(done, compiler)


class DoesNotFit(Mistake):
    """The target's compiler refused the step for want of device memory: the step
    does not fit (advise: over budget)."""


def _refused(said: dict[str, str], compiler: _Child) -> Mistake:
    """The mistake a compiler's refusal is said as, its message whole."""
    message = said["message"].strip()
    if said["error"] == "host memory":
        return _host_memory(compiler, "")
    if said["error"] == "device memory":
        return DoesNotFit(
            ValueError,
            f"the step does not fit in the memory of one device: compiling for {compiler}, "
            f"the compiler ran out of device memory ({message}). Shard it over more "
            "devices (FSDP, tensor), rematerialise its layers, or take a smaller batch.",
        )
    return Mistake(ValueError, f"compiling for {compiler} failed: {message}")


#: What a child's stderr says when it ran out of memory.
_MEMORY_WORDS = (
    b"MemoryError",
    b"bad_alloc",
    b"Cannot allocate memory",
    b"cannot allocate memory",  # glibc, when a thread's local storage cannot be had
    b"failed to map segment",  # no address space left to load a library
)


def _child_failed(done: subprocess.CompletedProcess[bytes], compiler: _Child) -> Mistake:
    """The mistake a failed compile subprocess is said as."""
    said = [
        line
        for line in done.stderr.decode(errors="replace").strip().splitlines()
        if line.strip() and not line.startswith(("W0", "I0", "WARNING: All log"))
    ]
    if any(word in done.stderr for word in _MEMORY_WORDS):
        return _host_memory(compiler, f" (exit {done.returncode})")
    if done.returncode < 0:  # a signal: the OOM killer's, or an abort when allocation fails
        return _host_memory(compiler, f" or was killed (signal {-done.returncode})")
    return Mistake(
        ValueError,
        f"compiling for {compiler} in a subprocess failed: " + " / ".join(said[-3:]),
    )


def _host_memory(compiler: _Child, how: str) -> Mistake:
    return Mistake(
        ValueError,
        f"compiling for {compiler} in a subprocess ran out of memory{how}; this machine "
        "cannot host a mesh of that size. Plan on a smaller mesh, or on a machine with "
        "more memory.",
    )


def child(answer: str) -> None:
    """The compile subprocess: reads the request on stdin, writes the `Analysis` as
    JSON to `answer`."""
    payload, compiler = pickle.loads(sys.stdin.buffer.read())
    step = pickle.loads(payload)
    sizes = tuple(size for _, size in step["shape"])
    names = tuple(name for name, _ in step["shape"])
    mesh = compiler.mesh_for(sizes, names, step["types"])
    exported = jax.export.deserialize(bytearray(step["module"]))
    shardings = exported.in_shardings_jax(mesh)
    args = [
        jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
        for aval, sharding in zip(exported.in_avals, shardings, strict=True)
    ]
    jitted = jax.jit(exported.call, in_shardings=shardings, donate_argnums=step["donated"])
    try:
        with jax.set_mesh(mesh):
            compiled = jitted.lower(*args).compile(compile_options(compiler.platform))
    except Exception as e:  # the compiler's own refusal: said to the parent, whole
        with open(answer, "w") as f:
            json.dump({"error": _failure(e, compiler), "message": f"{type(e).__name__}: {e}"}, f)
        return
    found = analyse(compiled, mesh, compiler.platform, compiler.slice_size)
    with open(answer, "w") as f:
        json.dump(found.to_json(), f)


def _failure(error: Exception, compiler: _Child) -> str:
    """What a compile's exception means: ``"host memory"`` (this machine's: an
    allocation, or a library that found no address space to load in), ``"device
    memory"`` (a target's compiler found the step too big for a chip) or
    ``"compile"``."""
    said = str(error).encode(errors="replace")
    if isinstance(error, MemoryError) or any(word in said for word in _MEMORY_WORDS):
        return "host memory"
    if "RESOURCE_EXHAUSTED" in str(error):
        return "device memory" if isinstance(compiler, TargetChild) else "host memory"
    return "compile"


def target_mesh(
    placement: Placement, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]
) -> Mesh:
    """The mesh over the target's devices, laid as a real job lays it: `jax.make_mesh`
    on one slice or a GPU cluster, the hybrid form across TPU slices. Devices sit
    on nodes (slices) by row-major position // per_node, as `StepPlan.time` reads."""
    from jax.experimental import mesh_utils, topologies

    target = placement.target
    if target.platform == "cuda":
        chip = cast(Chip, target.chip)  # a GPU target holds a Chip
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=chip.target_config(), topology=placement.topology
        )
        return _one_slice(topology.devices, sizes, names, types)
    dims = placement.dims
    options: dict[str, Any] = {}
    if placement.per_node < 4:
        options["chips_per_host_bounds"] = [*dims, 1][:3]
    if placement.nodes > 1:
        options["num_slices"] = placement.nodes
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=placement.topology, **options
    )
    if placement.nodes == 1:
        return _one_slice(topology.devices, sizes, names, types)
    dcn = _across_slices(sizes, placement.nodes)
    ici = [size // d for size, d in zip(sizes, dcn, strict=True)]
    grid = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, topology.devices, allow_split_physical_axes=True
    )
    return Mesh(grid, tuple(names), axis_types=tuple(types))


def _one_slice(
    devices: Sequence[Any], sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]
) -> Mesh:
    """`jax.make_mesh` over `devices`; where it finds no assignment of the logical
    axes to the physical ones, the same with physical axes split."""
    from jax.experimental import mesh_utils

    try:
        return jax.make_mesh(tuple(sizes), tuple(names), axis_types=tuple(types), devices=devices)
    except (NotImplementedError, ValueError):
        grid = mesh_utils.create_device_mesh(tuple(sizes), devices, allow_split_physical_axes=True)
        return Mesh(grid, tuple(names), axis_types=tuple(types))


def _across_slices(sizes: Sequence[int], slices: int) -> list[int]:
    """How many slices each mesh axis spans, node-spanning axes first, so that a
    device's slice is its row-major position // the slice size."""
    dcn, left = [], slices
    for size in sizes:
        span = size if left % size == 0 else left if size % left == 0 else 0
        if span == 0:
            raise Mistake(
                ValueError,
                f"a mesh of shape {tuple(sizes)} cannot be laid across {slices} slices with "
                "its leading axes spanning them. Make the leading axes' sizes fill the "
                "slices (e.g. data across slices).",
            )
        dcn.append(span)
        left //= span
    return dcn
