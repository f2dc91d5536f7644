"""What a compile says of a step: its `Memory` per device and its `Analysis`, read
from the compiled executable (the module walked once, `hlo.schedule`), as the
toolchain that compiled it reports them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from spmdtree._src.errors import Mistake
from spmdtree._src.resolve import HOST_KINDS
from spmdtree._src.step.compile.backends import Toolchain
from spmdtree._src.step.hlo import (
    Kept,
    Reading,
    Schedule,
    overstated_bytes,
    read_schedule,
    reading_of,
)
from spmdtree._src.step.hw import tpu_clock_ghz
from spmdtree._src.step.kinds import Backend


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
    own time estimate where it gives one (`compiler_seconds`: libtpu's kernels'
    estimated cycles at its chip's clock, `compiler_time`; 0 elsewhere), and how
    long reading the compiled module took (`read_seconds`). Crosses a process
    boundary as JSON (`to_dict`, `from_dict`)."""

    memory: Memory
    reading: Reading
    overstated_bytes: int
    backend: Backend
    seconds: float = 0.0
    schedule: Schedule | None = None
    compiler_seconds: float = 0.0
    read_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The analysis as plain JSON values."""
        schedule = self.schedule.to_dict() if self.schedule else None
        return {**dataclasses.asdict(self), "reading": self.reading.to_dict(), "schedule": schedule}

    def masked(self, masks: Mapping[str, Kept]) -> Analysis:
        """This analysis with its flash-attention kernels' FLOPs counted over the blocks
        their masks keep, as the traced step says (`masks`, by kernel name; new in
        0.7): the schedule's kernels and the reading's FLOPs, a kernel whose mask was
        not read flagged. A child compiles without the trace: the parent applies it."""
        if self.schedule is None:
            return self
        schedule = self.schedule.masked(masks)
        return dataclasses.replace(self, schedule=schedule, reading=reading_of(schedule, masks))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Analysis:
        """The analysis `to_dict` gave."""
        schedule = Schedule.from_dict(data["schedule"]) if data.get("schedule") else None
        backend = Backend(data["backend"])
        reading = Reading.from_dict(data["reading"])
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
    compiled: jax.stages.Compiled,
    mesh: Mesh,
    toolchain: Toolchain,
    slice_size: int | None = None,
) -> Analysis:
    """A compiled step's memory per device, its collectives and FLOPs per step.

    On CPU devices, an all-reduce whose every use takes one device's slice is
    counted as the reduce-scatter an accelerator runs, and the whole results
    such all-reduces keep live are what `overstated_bytes` counts.

    Raises:
        Mistake: if the backend reports no memory analysis or no HLO.
    """
    start = time.perf_counter()
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
        module, tuple(mesh.shape.items()), platform=toolchain.platform, slice_size=slice_size
    )
    read = reading_of(schedule)
    read_at = time.perf_counter()
    temp = int(memory.temp_size_in_bytes)
    estimates = toolchain.backend.estimates
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
            compiler_peak_bytes=int(compiler_peak) if toolchain.reports_peak else 0,
            host_argument_bytes=_host(memory, "argument"),
            host_output_bytes=host_outputs,
            host_alias_bytes=_host(memory, "alias"),
            host_temp_bytes=_host(memory, "temp"),
        ),
        reading=read,
        overstated_bytes=overstated_bytes(read.held_bytes, temp) if estimates else 0,
        backend=toolchain.backend,
        schedule=schedule,
        compiler_seconds=compiler_time(schedule, mesh),
        read_seconds=read_at - start,
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


def compiler_time(schedule: Schedule, mesh: Mesh) -> float:
    """libtpu's own estimate of a step's time: its kernels' estimated cycles, each
    times how often it runs (`Schedule.compiler_cycles`), at the clock of the chip
    its devices are (`chips.tpu_clock_ghz`); 0.0 where the compiler estimates no
    cycles (XLA GPU, the CPU) or the chip's clock is not known (new in 0.7).

    0.6 read libtpu's ``cost_analysis()["optimal_seconds"]``, which is no step's
    time: a roofline of its operations (a bf16 8192^3 matmul at exactly the peak,
    where its own kernel estimate is 14% longer), a loop's body counted once (a
    scanned model's layers as one), and -1 s for each custom call it does not cost
    (libtpu 0.0.42.1's ``ConcatBitcast``: a step of
    ``jax.nn.dot_product_attention(implementation="xla")`` gave -2.0 s), so
    negative, read as none, on most steps measured on a v5e.
    """
    clock = tpu_clock_ghz(str(mesh.devices.flat[0].device_kind))
    return schedule.compiler_cycles() / (clock * 1e9) if clock else 0.0
