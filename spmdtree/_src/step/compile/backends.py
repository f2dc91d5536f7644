"""The compilers a step compiles with: one `Toolchain` each, holding every fact of it
(new in 0.6; 0.5 spread them over eight files as platform string tests).

`XLA_CPU` is the fast estimate on fake CPU devices, `XLA_GPU` XLA's GPU compiler
(``jax-cuda12-plugin`` with a chip's description, no device needed), `LIBTPU` the
TPU compiler in ``libtpu`` (a slice's topology, as MaxText's ``train_compile.py``
does). Each says its names, its pip extra and install check, its compile options,
how a target's devices are laid out on it (`Placement`) and the mesh it compiles
on, what it refuses of an argument's memory kind, what a screen on it costs, and
its column label and budget note. A `Target` is a `Hardware`'s chip with its
toolchain (`target_for`). Nothing outside this room asks which platform it is.

A toolchain is data: a test's fake is ``dataclasses.replace(XLA_GPU, module=...)``
naming a module that is not installed, passed where a toolchain is taken
(`target_for`, `compilers.compiler_for`) or set as its chip's (`BY_CHIP`). The chips' descriptions are their data
sheets' figures (docs/planning.md, "Compiling for the target", lists each with
its source).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
from jax.sharding import AbstractDevice, Mesh

from spmdtree._src.errors import Mistake
from spmdtree._src.plan import Plan
from spmdtree._src.step.hlo import Schedule
from spmdtree._src.step.hw import GpuChip, Hardware, TpuChip, slice_dims
from spmdtree._src.step.kinds import Backend
from spmdtree._src.text import argument_path


class CompilerMissing(Mistake):
    """A target's compiler is not installed (advise says so once, and goes on)."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """One compiler and every fact spmdtree knows of it.

    Attributes:
        backend: the `Backend` its figures are reported as (``cpu``, ``gpu``, ``tpu``).
        platform: what jax's export and topologies call it (``cpu``, ``cuda``, ``tpu``).
        name: its name in sentences (``XLA GPU``).
        label: its name in an advice table's ``from`` column.
        extra: the pip extra that installs it (``"cuda"``: ``spmdtree[cuda]``); None:
            jax's own.
        module: the module whose presence says it is installed; None: always is.
        package: the distribution whose version is checked against jax's.
        deviceless_options: its compile options without a device, as (name, value)
            pairs (spmdtree's own; the job's are `compiler_options`).
        taken: what takes a device's memory from a job on it (the budget note).
        screens_cheaply: whether a screen on it costs about what the CPU
            estimate's does (XLA GPU: measured 1.1-1.3x a CPU compile; libtpu
            7-10x), so that advise screens on it unasked.
        refuses: the memory kinds it does not compile an argument in.
        node: what its devices are grouped in (``node``, ``slice``).
        lowers_here: whether a step whose primitives need devices to lower
            (cuDNN's attention) is lowered and compiled on its devices in this
            process (XLA GPU: its topology is a description; new in 0.6).
        checks_memory: whether it refuses, as it compiles, a step that does not fit
            in its device's memory (libtpu, deviceless too: "RESOURCE_EXHAUSTED ...
            exceeds available HBM"), so that a step it compiled fits and its own
            peak is what fitting is judged by (new in 0.7).
        flash: the flash-attention kernel a job on its chips runs, which
            `st.calibrate` times (``"splash"``: jax's Pallas splash attention;
            ``"cudnn"``: cuDNN's fused attention; ``""``: none; new in 0.7).
    """

    backend: Backend
    platform: str
    name: str
    label: str
    extra: str | None = None
    module: str | None = None
    package: str | None = None
    deviceless_options: tuple[tuple[str, Any], ...] = ()
    taken: str = "an allocator loses some to fragmentation"
    screens_cheaply: bool = True
    refuses: tuple[str, ...] = ()
    node: str = "node"
    lowers_here: bool = False
    checks_memory: bool = False
    flash: str = ""

    @property
    def reports_peak(self) -> bool:
        """Whether its own peak (``peak_memory_in_bytes``) is an accelerator's: not the
        CPU estimate's, which is the CPU program's."""
        return not self.backend.estimates

    def own_options(self, deviceless: bool) -> dict[str, Any]:
        """Its compile options: without a device (a target, or fake CPU devices) its
        own; a `Mesh` of real accelerators compiles as the job will, with none."""
        return dict(self.deviceless_options) if deviceless or self.backend.estimates else {}

    def check(self, target: str) -> None:
        """Raises `CompilerMissing`, naming the pip command, if it is not installed
        for compiling for `target`, or not at the version this jax needs."""
        if self.module is None:
            return
        try:
            found = importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:
            found = False
        fix = f"pip install 'spmdtree[{self.extra}]' (it runs without the accelerator)"
        if not found:
            raise CompilerMissing(
                ValueError,
                f"compiling for {target} needs the {self.name} compiler, which is not "
                f"installed: {fix}. Without target=, preflight gives the CPU estimate.",
            )
        have, wanted = self.versions()
        if have is not None and wanted is not None and not have.startswith(wanted):
            raise CompilerMissing(
                ValueError,
                f"compiling for {target} needs the {self.name} compiler at version "
                f"{wanted}* for jax {jax.__version__}, and {have} is installed: {fix}.",
            )

    def versions(self) -> tuple[str | None, str | None]:
        """The installed compiler's version, and the one this jax needs (None:
        unknown): the installed package's at jax's own version."""
        have = _installed(self.package)
        return have, (jax.__version__ if have is not None else None)

    def refuse(self, inputs: Plan) -> None:
        """Refuses, before it compiles, what it refuses of the arguments' memory kinds
        (libtpu does not compile an argument in ``"unpinned_host"`` memory, measured:
        an internal error, a shape mismatch between memory spaces).

        Raises:
            Mistake: naming the first such argument.
        """
        for kind in self.refuses:
            found = [row.path for row in inputs.rows if row.memory_kind == kind]
            if found:
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                raise Mistake(
                    ValueError,
                    f"{argument_path(found[0])}{more} has memory_kind {kind!r}, which "
                    f"{self.name} does not compile for an argument. Offload it to the "
                    "host with memory_kind='pinned_host'.",
                )

    def left_out(self, schedule: Schedule | None) -> tuple[str, ...]:
        """What a compile without a device leaves out of a step's figures, in
        sentences (new in 0.6): none by default."""
        return ()

    # --- a target's devices: laid out, described, meshed --------------------------------

    def place(self, target: Target, devices: int, per_node: int | None) -> Placement:
        """The placement of `devices` on `target`, checked before anything compiles."""
        raise Mistake(ValueError, f"{self.name} compiles for no target's devices.")

    def topology(self, placement: Placement) -> str:
        """What the compiler is given as the devices' topology."""
        return f"1x{placement.nodes}x{placement.per_node}"

    def describe(self, placement: Placement) -> str:
        """How the placement's devices sit, in words (``2 nodes of 8``)."""
        many = "" if placement.nodes == 1 else "s"
        return f"{placement.nodes} {self.node}{many} of {placement.per_node}"

    def device(self, chip: Any) -> AbstractDevice | None:
        """The chip as jax's `AbstractDevice`, where a kernel written for one asks it."""
        return None

    def mesh(
        self, placement: Placement, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]
    ) -> Mesh:
        """The mesh over the target's devices, laid as a real job lays it."""
        raise Mistake(ValueError, f"{self.name} compiles for no target's devices.")


def _installed(package: str | None) -> str | None:
    from importlib import metadata

    if package is None:
        return None
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class _XlaGpu(Toolchain):
    """XLA's GPU compiler, given a chip's description: GPUs in nodes."""

    def place(self, target: Target, devices: int, per_node: int | None) -> Placement:
        """Nodes of `per_node` GPUs (None: 8), the mesh filling them."""
        node = min(per_node or 8, devices)
        if devices % node:
            raise Mistake(
                ValueError,
                f"a mesh of {devices} GPUs does not fill nodes of {node}: give a mesh "
                f"whose size is a multiple of {node}, or devices_per_node= that divides it.",
            )
        return Placement(target, devices, node)

    def left_out(self, schedule: Schedule | None) -> tuple[str, ...]:
        """cuDNN's workspace: without a device, XLA sizes it as 0 (it picks cuDNN's
        execution plan, and its scratch, only with a stream executor)."""
        kernels = schedule.kernels() if schedule else ()
        calls = sorted({k.call for k in kernels if k.call.startswith("__cudnn$")})
        if not calls:
            return ()
        return (
            f"cuDNN's workspace is not in the peak: compiled without a GPU, XLA sizes it as 0 "
            f"for {', '.join(calls)} (a real GPU's is usually tens of MiB at most)",
        )

    def device(self, chip: Any) -> AbstractDevice:
        """A GPU's kind is its description (XLA names a device by it), its SMs cores."""
        return AbstractDevice(chip.description, chip.sms, "gpu")

    def mesh(
        self, placement: Placement, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]
    ) -> Mesh:
        """`jax.make_mesh` over a GPU cluster described to XLA (`GpuTarget.target_config`)."""
        from jax.experimental import topologies

        chip = cast(GpuTarget, placement.target.chip)
        describe = functools.partial(
            topologies.get_topology_desc,
            platform=self.platform,
            target_config=chip.target_config(),
            topology=self.topology(placement),
        )
        try:
            topology = describe()
        except NotImplementedError:  # jax's plugin refused to start without CUDA
            if self.module is None:
                raise
            _start_plugin(self.module)
            topology = describe()
        return _one_slice(topology.devices, sizes, names, types)


def _start_plugin(module: str) -> None:
    """Registers XLA GPU's plugin in this process where jax's start-up refused it for
    want of CUDA's libraries (no GPU here): a topology needs none of them, so the
    plugin starts with its version checks skipped, as the compile children start it;
    the process's environment is left as it was."""
    plugin = importlib.import_module(module)
    was = os.environ.get(_SKIP_CHECKS)
    os.environ[_SKIP_CHECKS] = "1"
    try:
        plugin.initialize()
    finally:
        if was is None:
            del os.environ[_SKIP_CHECKS]
        else:
            os.environ[_SKIP_CHECKS] = was
    # what jax gives each plugin it starts itself: custom_partitioning's partitioner
    # (cuDNN's attention partitions through it) among them
    from jax._src import xla_bridge

    factory = xla_bridge._backend_factories.get("cuda")
    if factory is not None and factory.c_api is not None:
        with xla_bridge._plugin_callback_lock:
            for callback in xla_bridge._plugin_callbacks:
                callback(c_api=factory.c_api)


#: What jax's CUDA plugin reads to start without checking CUDA's libraries.
_SKIP_CHECKS = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


@dataclasses.dataclass(frozen=True)
class _Libtpu(Toolchain):
    """The TPU compiler in libtpu, given a slice's topology: chips in slices."""

    def versions(self) -> tuple[str | None, str | None]:
        """The installed libtpu's version, and the one jax's tpu extra pins."""
        from importlib import metadata

        have = _installed(self.package)
        if have is None:
            return None, None
        pins = [r for r in metadata.requires("jax") or [] if r.startswith("libtpu") and "tpu" in r]
        found = re.search(r"==\s*([\d.]+?)(?:\.\*)?\s*(?:;|$)", pins[0]) if pins else None
        return have, found.group(1) if found else None

    def place(self, target: Target, devices: int, per_node: int | None) -> Placement:
        """Slices of `per_node` chips (None: one slice), a power of two each, within
        the generation's largest slice."""
        size = per_node or devices
        if devices % size or not _power_of_two(size):
            raise Mistake(
                ValueError,
                f"a mesh of {devices} {target.name} chips cannot be laid on TPU slices of "
                f"{size} chips: a slice holds a power of two of chips, and the mesh must "
                "fill whole slices. Give a mesh of such a size, or devices_per_node= (the "
                "slice size) that divides it.",
            )
        limit = target.slice_limit
        if limit is not None and size > limit:
            raise Mistake(
                ValueError,
                f"one {target.name} slice holds at most {limit} chips, and the "
                f"mesh has {devices}. Pass devices_per_node= (the slice size, e.g. "
                f"{limit}) to compile it as a multi-slice job.",
            )
        return Placement(target, devices, size)

    def topology(self, placement: Placement) -> str:
        """The generation and one slice's shape: ``v5p:4x4x4``."""
        chip = cast(TpuChip, placement.target.chip)
        return f"{chip.generation}:{'x'.join(map(str, placement.dims))}"

    def describe(self, placement: Placement) -> str:
        """``one slice, 4x4x4``, or ``4 slices of 64``."""
        if placement.nodes == 1:
            return f"one slice, {'x'.join(map(str, placement.dims))}"
        return super().describe(placement)

    def device(self, chip: Any) -> AbstractDevice:
        """A TPU chip by its device kind, its TensorCores cores."""
        return AbstractDevice(chip.device_kind, chip.tensor_cores, "tpu")

    def mesh(
        self, placement: Placement, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]
    ) -> Mesh:
        """`jax.make_mesh` on one slice; across slices, the hybrid form."""
        from jax.experimental import mesh_utils, topologies

        dims = placement.dims
        described: dict[str, Any] = {}
        if placement.per_node < 4:
            described["chips_per_host_bounds"] = [*dims, 1][:3]
        if placement.nodes > 1:
            described["num_slices"] = placement.nodes
        topology = topologies.get_topology_desc(
            platform=self.platform, topology_name=self.topology(placement), **described
        )
        if placement.nodes == 1:
            return _one_slice(topology.devices, sizes, names, types)
        dcn = _across_slices(sizes, placement.nodes)
        ici = [size // d for size, d in zip(sizes, dcn, strict=True)]
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, topology.devices, allow_split_physical_axes=True
        )
        return Mesh(grid, tuple(names), axis_types=tuple(types))


#: Fake CPU devices: no costly machine-code optimisation, which halves the compile
#: time and changes no buffer, and the remat barriers kept (rematerialised work
#: counted as an accelerator runs it): the pass that drops them, after which CSE
#: folds the recomputed forward into the first one, is disabled, so the CPU
#: program recomputes as an accelerator's does (FLOPs equal the jaxpr's).
XLA_CPU = Toolchain(
    Backend.CPU,
    "cpu",
    "XLA CPU",
    "cpu est.",
    deviceless_options=(
        ("xla_backend_optimization_level", 0),
        ("xla_llvm_disable_expensive_passes", True),
        ("xla_disable_hlo_passes", "cse_barrier_expander"),
    ),
)

#: XLA GPU without a device: GEMMs to cuBLAS, as the device's autotuner mostly picks
#: (deviceless, XLA cannot autotune; with Triton GEMMs its peaks came 10-27% under a
#: real H200's with rematerialisation, with cuBLAS within 4%).
XLA_GPU = _XlaGpu(
    Backend.GPU,
    "cuda",
    "XLA GPU",
    "XLA GPU",
    extra="cuda",
    module="jax_plugins.xla_cuda12",
    package="jax-cuda12-plugin",
    deviceless_options=(("xla_gpu_enable_triton_gemm", False),),
    taken="on GPU, JAX preallocates 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION says "
    "otherwise, and fragmentation takes some",
    lowers_here=True,
    flash="cudnn",
)

#: libtpu: a screen on it costs 7-10x a CPU compile, so advise screens on the CPU
#: estimate unasked; it does not compile an argument in unpinned host memory.
LIBTPU = _Libtpu(
    Backend.TPU,
    "tpu",
    "libtpu",
    "libtpu",
    extra="tpu",
    module="libtpu",
    package="libtpu",
    taken="on TPU, the runtime keeps some of it for itself, and fragmentation takes some",
    screens_cheaply=False,
    refuses=("unpinned_host",),
    node="slice",
    checks_memory=True,
    flash="splash",
)

#: Each backend's toolchain: what a step's `Backend` was compiled by (a real `Mesh`'s
#: devices too).
TOOLCHAINS: Mapping[Backend, Toolchain] = {
    Backend.CPU: XLA_CPU,
    Backend.GPU: XLA_GPU,
    Backend.TPU: LIBTPU,
}

#: The toolchain that compiles for each kind of chip a `Hardware` carries: its target.
BY_CHIP: dict[type, Toolchain] = {GpuChip: XLA_GPU, TpuChip: LIBTPU}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """An NVIDIA GPU as XLA's GPU target description reads it: a `Hardware`'s SMs
    (`cores`), memory and bandwidth with its `GpuChip` (0.7: 0.6 called it `Chip`,
    a second meaning of the word; CONTRIBUTING's words).

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
    """An accelerator's compiler: a `Toolchain` with the chip it compiles for.

    Attributes:
        name: the hardware it belongs to (``"h100"``, ``"tpu-v5p"``).
        toolchain: `XLA_GPU` for a `GpuTarget`, `LIBTPU` for a `TpuChip`.
        chip: the chip as its compiler is told: a GPU's `GpuTarget`, a TPU's `TpuChip`.
    """

    name: str
    toolchain: Toolchain
    chip: GpuTarget | TpuChip

    @property
    def platform(self) -> str:
        """The toolchain's platform: ``"cuda"`` or ``"tpu"``."""
        return self.toolchain.platform

    @property
    def compiler(self) -> str:
        """The toolchain's name: ``"XLA GPU"`` or ``"libtpu"``."""
        return self.toolchain.name

    @property
    def dimensions(self) -> int:
        """A TPU slice's topology dimensions (3 for v5p, 2 for v5e/v6e; 0 on a GPU)."""
        return self.chip.dimensions if isinstance(self.chip, TpuChip) else 0

    @property
    def slice_limit(self) -> int | None:
        """The most chips one TPU slice holds (None: no limit here, or a GPU)."""
        return self.chip.slice_limit if isinstance(self.chip, TpuChip) else None


def target_for(hardware: Hardware, toolchain: Toolchain | None = None) -> Target | None:
    """The compiler target a `Hardware` carries (its `chip`), or None where it has
    none: XLA GPU's description of a GPU from the hardware's own figures, libtpu's
    generation of a TPU; compiled by the chip's toolchain (`BY_CHIP`), or by
    `toolchain` where given (a test's fake). Never looked up by the hardware's name
    (0.6)."""
    chip = hardware.chip
    if chip is None:
        return None
    toolchain = toolchain or next(t for kind, t in BY_CHIP.items() if isinstance(chip, kind))
    if isinstance(chip, TpuChip):
        return Target(hardware.name, toolchain, chip)
    missing = [f for f in ("cores", "hbm_bytes_per_second") if getattr(hardware, f) is None]
    if missing:
        raise Mistake(
            ValueError,
            f"hardware {hardware.name!r} has a GpuChip but no {' or '.join(missing)}: XLA "
            "GPU's target description needs its SMs (cores=) and its memory bandwidth "
            "(hbm_bytes_per_second=).",
        )
    described = GpuTarget(
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
    return Target(hardware.name, toolchain, described)


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
        return self.target.toolchain.topology(self)

    @property
    def dims(self) -> list[int]:
        """A TPU slice's topology dimensions."""
        return slice_dims(self.per_node, self.target.dimensions)

    def mesh(self, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh:
        """The mesh over these devices, laid as a real job lays it: `jax.make_mesh` on
        one slice or a GPU cluster, the hybrid form across TPU slices. Devices sit on
        nodes (slices) by row-major position // per_node, as `StepPlan.time` reads."""
        return self.target.toolchain.mesh(self, sizes, names, types)

    def __str__(self) -> str:
        toolchain = self.target.toolchain
        return (
            f"{self.devices} x {self.target.name}, {toolchain.describe(self)}, "
            f"{toolchain.name} compiler"
        )


def place(target: Target, devices: int, per_node: int | None) -> Placement:
    """The placement of `devices` on `target` (nodes or slices of `per_node`; None:
    the GPU's 8 per node, one TPU slice), checked before anything compiles."""
    return target.toolchain.place(target, devices, per_node)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


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
