"""Where a step compiles: one small protocol, `Compiler`, with three implementations,
as jax hides its backends behind `Lowered` and `Compiled`.

`Here` (this process: a mesh of its own devices, or enough CPU devices for an
`AbstractMesh`), `CpuChild` (a fresh process given as many fake CPU devices: the
fast estimate), and `TargetChild`, where an accelerator's own compiler runs
without the accelerator (a `backends.Placement` of its devices). Each has its
`Toolchain`, which holds every fact of its compiler; `compiler_for` picks one. A
child gets the step through `jax.export` and answers an `Analysis` as JSON.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast, overload

import jax
import numpy as np
from jax.sharding import AbstractDevice, Mesh

from spmdtree._src.errors import Mistake, public
from spmdtree._src.resolve import check_mesh
from spmdtree._src.rules import AnyMesh
from spmdtree._src.step.compile.analysis import Analysis, analyse
from spmdtree._src.step.compile.backends import (
    TOOLCHAINS,
    XLA_CPU,
    Placement,
    Target,
    Toolchain,
    place,
    target_for,
)
from spmdtree._src.step.compile.tracing import Lowered, Site, Traced
from spmdtree._src.step.hw import PRESETS, Hardware, check_devices_per_node, hardware_of
from spmdtree._src.step.kinds import Backend

#: How long a compile subprocess may take before it is stopped.
CHILD_SECONDS = 3600


class Compiler(Site, Protocol):
    """Where a step compiles: `Here`, a `CpuChild` or a `TargetChild`.

    Attributes:
        here: the mesh of this process's devices the step is lowered for; None
            where it is exported to a child.
        toolchain: the `Toolchain` that compiles it (every fact of that compiler).
        platform: its toolchain's platform, as jax's export names it.
        devices_per_node: a target's devices per GPU node or TPU slice; None
            elsewhere.
    """

    @property
    def devices_per_node(self) -> int | None: ...

    @property
    def toolchain(self) -> Toolchain: ...

    def check(self) -> None:
        """Raises `CompilerMissing` where the compiler is not installed."""

    def compile(self, traced: Traced) -> Analysis:
        """The step compiled, its `seconds` the compile's alone (the trace's are
        `traced.seconds`)."""
        ...

    def left_out(self, analysis: Analysis) -> tuple[str, ...]:
        """What its compile leaves out of the step's figures, in sentences."""
        ...

    def __str__(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Here:
    """This process's compiler, for a mesh of its own devices (real ones, or the
    CPU devices an `AbstractMesh` is laid on)."""

    here: Mesh
    compiler_options: tuple[tuple[str, Any], ...] = ()

    @property
    def toolchain(self) -> Toolchain:
        """The devices' own compiler's toolchain, by their platform."""
        return TOOLCHAINS[Backend.of(str(self.here.devices.flat[0].platform))]

    @property
    def platform(self) -> str:
        """The toolchain's platform: ``"cpu"``, ``"cuda"``, ``"tpu"``."""
        return self.toolchain.platform

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

    def resident(self, mesh: AnyMesh) -> None:
        """None: the step is lowered for `here` already."""
        return None

    def left_out(self, analysis: Analysis) -> tuple[str, ...]:
        """compiler_options the CPU estimate did not take; nothing else: the devices
        are here, and their compiler sizes what they run."""
        return _unapplied(self.toolchain, self.compiler_options)

    def compile(self, traced: Traced) -> Analysis:
        """Compiles the step lowered for `here`."""
        return self.executable(traced)[0]

    def executable(
        self, traced: Traced, added: Mapping[str, Any] | None = None
    ) -> tuple[Analysis, jax.stages.Compiled]:
        """Compiles the step lowered for `here`, with `added` options beside the
        toolchain's and the job's (what a run adds: XLA CPU's profiler events),
        and keeps the executable to run (new in 0.7: `st.measure`)."""
        start = time.perf_counter()
        stage = cast(Lowered, traced.stage)  # `here` set: trace lowered it
        given = {**_compile_options(self.toolchain, False, self.compiler_options), **(added or {})}
        compiled = _compiled(stage, given, self)
        found = analyse(compiled, self.here, self.toolchain)
        return dataclasses.replace(found, seconds=time.perf_counter() - start), compiled

    def __str__(self) -> str:
        if self.toolchain.backend.estimates:
            return str(CpuChild(self.here.size))
        first = self.here.devices.flat[0]
        return f"{self.here.size} x {first.device_kind}, their own compiler"


class _Child(abc.ABC):
    """A compile in a fresh process, of the step exported for it."""

    here: None = None
    compiler_options: tuple[tuple[str, Any], ...]

    @property
    def device(self) -> AbstractDevice | None:
        """The device the step is traced for (see `TargetChild.device`): none, the
        CPU's."""
        return None

    @property
    @abc.abstractmethod
    def toolchain(self) -> Toolchain:
        """The child's compiler's toolchain."""

    @property
    def platform(self) -> str:
        """The toolchain's platform, as the step is exported for it."""
        return self.toolchain.platform

    @property
    @abc.abstractmethod
    def slice_size(self) -> int:
        """The devices one slice (node) holds, as the HLO reader takes it."""

    @abc.abstractmethod
    def mesh_for(self, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh:
        """The mesh the child compiles on (in the child)."""

    def resident(self, mesh: AnyMesh) -> Mesh | None:
        """None: its devices are in the child only."""
        return None

    def left_out(self, analysis: Analysis) -> tuple[str, ...]:
        """What its toolchain's compile without a device leaves out, and the
        compiler_options the CPU estimate did not take."""
        return (
            *self.toolchain.left_out(analysis.schedule),
            *_unapplied(self.toolchain, self.compiler_options),
        )

    def compile(self, traced: Traced) -> Analysis:
        """Compiles the exported step in a child; a step lowered on the target's
        devices resident here (`resident`), here."""
        if isinstance(traced.stage, Lowered):
            return self._here(traced.stage)
        return compile_child(traced.stage.payload, self)

    def _here(self, stage: Lowered) -> Analysis:
        """The step lowered on the resident devices, compiled in this process."""
        start = time.perf_counter()
        compiled = _compiled(
            stage, _compile_options(self.toolchain, True, self.compiler_options), self
        )
        found = analyse(compiled, cast(Mesh, stage.mesh), self.toolchain, self.slice_size)
        return dataclasses.replace(found, seconds=time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class CpuChild(_Child):
    """A fresh process given `devices` fake CPU devices: the fast estimate."""

    devices: int
    compiler_options: tuple[tuple[str, Any], ...] = ()

    @property
    def toolchain(self) -> Toolchain:
        """`XLA_CPU`, on fake devices."""
        return XLA_CPU

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
    compiler_options: tuple[tuple[str, Any], ...] = ()

    @property
    def toolchain(self) -> Toolchain:
        """The target's: `XLA_GPU` or `LIBTPU`."""
        return self.placement.target.toolchain

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
        return cast(AbstractDevice, self.toolchain.device(self.placement.target.chip))

    def check(self) -> None:
        """Raises `CompilerMissing`, naming the pip command, where the target's
        compiler is not installed or not at this jax's version."""
        self.toolchain.check(self.placement.target.name)

    def mesh_for(self, sizes: Sequence[int], names: Sequence[str], types: Sequence[Any]) -> Mesh:
        """The mesh over the target's devices (`Placement.mesh`)."""
        return self.placement.mesh(sizes, names, types)

    def resident(self, mesh: AnyMesh) -> Mesh | None:
        """The target's devices in this process, laid out like `mesh`, where its
        toolchain lowers here (XLA GPU: a topology of descriptions, no device)."""
        if not self.toolchain.lowers_here:
            return None
        return self.mesh_for(
            tuple(mesh.shape.values()), tuple(mesh.axis_names), tuple(mesh.axis_types)
        )

    def __str__(self) -> str:
        return str(self.placement)


def _compile_options(
    toolchain: Toolchain, deviceless: bool, compiler_options: tuple[tuple[str, Any], ...]
) -> dict[str, Any]:
    """The options a compile takes: the toolchain's own, and over them the job's
    `compiler_options` (0.6), which are its accelerator's compiler's: the CPU
    estimate, not that compiler, compiles without them."""
    own = toolchain.own_options(deviceless)
    return own if toolchain.backend.estimates else {**own, **dict(compiler_options)}


def _unapplied(
    toolchain: Toolchain, compiler_options: tuple[tuple[str, Any], ...]
) -> tuple[str, ...]:
    """The sentence for compiler_options the CPU estimate did not take."""
    if not compiler_options or not toolchain.backend.estimates:
        return ()
    names = ", ".join(name for name, _ in compiler_options)
    return (
        f"compiler_options ({names}) not applied: they are the job's compiler's, and the "
        "CPU estimate is not it; pass target= to compile with them",
    )


def check_compiler_options(compiler_options: object) -> tuple[tuple[str, Any], ...]:
    """`compiler_options` as sorted (name, value) pairs: a mapping of XLA option
    names (``"xla_gpu_enable_latency_hiding_scheduler"``, no ``--``) to a bool,
    int, float or str, as `jax.stages.Lowered.compile` takes them.

    Raises:
        Mistake: naming the first entry that is not so.
    """
    if compiler_options is None:
        return ()
    if not isinstance(compiler_options, Mapping):
        raise Mistake(
            TypeError,
            f"compiler_options is {compiler_options!r}; expected a mapping of XLA option names to "
            "values, e.g. {'xla_gpu_enable_latency_hiding_scheduler': True}.",
        )
    for name, value in compiler_options.items():
        if not isinstance(name, str) or name.startswith("-"):
            raise Mistake(
                TypeError,
                f"compiler_options has a key {name!r}; expected an XLA option's name as a "
                "str, without the leading '--' of XLA_FLAGS (e.g. 'xla_gpu_enable_"
                "latency_hiding_scheduler').",
            )
        if not isinstance(value, (bool, int, float, str)):
            raise Mistake(
                TypeError,
                f"compiler_options[{name!r}] is {value!r}; expected a bool, int, float or str.",
            )
    return tuple(sorted(compiler_options.items()))


def _compiled(stage: Lowered, given: dict[str, Any], compiler: object) -> Any:
    """A step lowered here, compiled; the compiler's refusal said whole, in our words:
    a primitive with no lowering for its platform (cuDNN's attention on the CPU
    estimate) named, with what compiles it."""
    try:
        return stage.lowered.compile(given)
    except Exception as e:  # the compiler's own refusal: said, its cause chained
        said = str(e)
        lines = [line for line in said.splitlines() if "not found for platform" in line]
        if lines:
            raise Mistake(
                ValueError,
                f"compiling for {compiler} failed: {lines[0].strip()}. A primitive without "
                "a lowering for this platform (cuDNN's attention: "
                "jax.nn.dot_product_attention(implementation='cudnn')) compiles only for "
                "its own: pass a GPU target= (XLA GPU compiles it without a device), or "
                "write it with implementation='xla'.",
            ) from e
        raise Mistake(
            ValueError, f"compiling for {compiler} failed: {type(e).__name__}: {said[:2000]}"
        ) from e


@overload
def compiler_for(
    mesh: AnyMesh,
    target: Hardware | str,
    devices_per_node: int | None,
    toolchain: Toolchain | None = None,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> TargetChild: ...


@overload
def compiler_for(mesh: AnyMesh, target: None, devices_per_node: None) -> Here | CpuChild: ...


@overload
def compiler_for(
    mesh: AnyMesh,
    target: Hardware | str | None,
    devices_per_node: int | None,
    toolchain: Toolchain | None = None,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> Compiler: ...


def compiler_for(
    mesh: AnyMesh,
    target: Hardware | str | None,
    devices_per_node: int | None,
    toolchain: Toolchain | None = None,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> Compiler:
    """Where a step on `mesh` compiles: for `target`'s devices as nodes or slices of
    `devices_per_node` (None: the hardware's), its compiler checked to be
    installed; else here, on a `Mesh`'s own devices or this process's CPU devices
    laid out like an `AbstractMesh`; else in a CPU child. Checked before anything
    compiles. `toolchain` replaces the target's own (a test's fake compiler);
    `compiler_options` are the job's (`check_compiler_options`)."""
    devices = math.prod(mesh.shape.values())
    if target is not None:
        if devices_per_node is not None:  # GPUs per node, or chips per TPU slice
            check_devices_per_node(
                devices_per_node, "devices_per_node", "the hardware's: 8 GPUs a node, one TPU slice"
            )
        chosen, per_node = target_of(target, toolchain)
        placement = place(
            chosen, devices, per_node if devices_per_node is None else devices_per_node
        )
        found = TargetChild(placement, compiler_options)
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
        return Here(mesh, compiler_options)
    here = cpu_mesh(tuple(mesh.shape.values()), tuple(mesh.axis_names), tuple(mesh.axis_types))
    return CpuChild(devices, compiler_options) if here is None else Here(here, compiler_options)


def target_of(
    target: Hardware | str, toolchain: Toolchain | None = None
) -> tuple[Target, int | None]:
    """The compiler target of a `Hardware` (the one it carries) or a preset's name,
    and its devices per node."""
    hardware = hardware_of(target, "target")  # a preset's name or a file's too (new in 0.8)
    found = target_for(hardware, toolchain)
    if found is None:
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
        code = f"from spmdtree._src.step.compile.compilers import child; child({answer!r})"
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
            found = Analysis.from_dict(said)
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
            compiled = jitted.lower(*args).compile(
                _compile_options(compiler.toolchain, True, compiler.compiler_options)
            )
    except Exception as e:  # the compiler's own refusal: said to the parent, whole
        with open(answer, "w") as f:
            json.dump({"error": _failure(e, compiler), "message": f"{type(e).__name__}: {e}"}, f)
        return
    found = analyse(compiled, mesh, compiler.toolchain, compiler.slice_size)
    with open(answer, "w") as f:
        json.dump(found.to_dict(), f)


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


# --- the target's mesh, for a compile of one's own (0.6) ----------------------------------


@public
def target_mesh(
    mesh: AnyMesh, target: Hardware | str, *, devices_per_node: int | None = None
) -> Mesh:
    """`mesh`'s axes laid over `target`'s devices as ``preflight(..., target=)`` lays
    them: a `jax.sharding.Mesh` of the target's devices, described to its compiler
    without the hardware (XLA GPU's topology, libtpu's slice), so that a step can be
    lowered and compiled raw on it, to check a figure (new in 0.6).

    Compile with `target_compiler_options` to compile as preflight does: XLA GPU's
    defaults differ (docs/planning.md, "Checking a figure yourself").

    Args:
        mesh: an `AbstractMesh` (or `Mesh`): its axis sizes, names and types.
        target: a preset's name (``"h100"``) or a `Hardware` with a `chip`.
        devices_per_node: GPUs per node or chips per TPU slice (the hardware's).

    Returns:
        The `jax.sharding.Mesh` over the target's devices.

    Raises:
        ValueError: where the target's compiler is not installed (naming the pip
            command), or the mesh does not fill its nodes or slices.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((8,), ("data",))
        >>> try:
        ...     real = st.target_mesh(mesh, "h100")
        ... except ValueError as e:  # without spmdtree[cuda]
        ...     real = None
        >>> real is None or (real.axis_names, real.devices.size) == (("data",), 8)
        True
    """
    check_mesh(mesh)
    compiler = compiler_for(mesh, target, devices_per_node)
    return compiler.mesh_for(
        tuple(mesh.shape.values()), tuple(mesh.axis_names), tuple(mesh.axis_types)
    )


@public
def target_compiler_options(target: Hardware | str) -> dict[str, Any]:
    """The compile options ``preflight(..., target=)`` gives `target`'s compiler
    without the hardware, for a raw compile on `target_mesh` that equals its
    figures (new in 0.6): on XLA GPU, cuBLAS's GEMMs rather than Triton's
    (``xla_gpu_enable_triton_gemm``: deviceless, XLA cannot autotune Triton's
    tiles, and its untuned ones hold larger temporaries).

    Example:
        >>> import spmdtree as st
        >>> st.target_compiler_options("h100")
        {'xla_gpu_enable_triton_gemm': False}
    """
    chosen, _ = target_of(target, None)
    return chosen.toolchain.own_options(deviceless=True)
