"""The chip present, measured (new in 0.7): `calibrate` runs microbenchmarks on one
device and gives a `Hardware` whose per-kernel model figures are its own.

Each figure comes from a kernel of its own kind, run by `measure` and timed by
the device's own profile (so no dispatch is counted): bf16 matmuls over a grid of
shapes, small and narrow ones among them (`matmul_grid`, each one's share of the
peak, new in 0.8; `matmul_efficiency`, the largest), a large elementwise pass
(`memory_efficiency`, its bytes over the data sheet's bandwidth), a sum over the
rows of as large an array (`read_efficiency`, the same for a kernel that only
reads, new in 0.8), f32 matmuls
at the default and the highest precision and 8-bit ones (int8; fp8 on a GPU) of
one shape (`f32_speed`, `f32_highest_speed`, `eight_bit_speed`: their rate over the
bf16 one at that shape), an in-place update at a run-time offset into a
tiled dimension that the compiler leaves unfused (`update_efficiency`: its
update's bytes read and written over the data sheet's bandwidth; a TPU's
only), a grouped matmul (`jax.lax.ragged_dot` and its weights' gradient, their
groups' FLOPs over their time: `grouped_efficiency`, new in 0.8), a gather of
rows by index and a scatter-add of them back (what they move over their time:
`indexed_efficiency`, new in 0.8), a weight's gradient with adamw's update fused
into its kernel (`fused_update_efficiency`: the share of its shape's rate the
matmul keeps, new in 0.8), a loop of tiny kernels (`launch_seconds`: what
each costs beyond its work, new in 0.8), a loop of tiny kernels each reading rows of
a table in HBM (`access_seconds`: what such a kernel waits for the memory's first
access beyond that, new in 0.8; a TPU's only, the one device that keeps arrays in a
memory of its own; the grid's shares are read net of both), a chain of transposes
and elementwise passes on an array a TPU keeps in that memory
(`on_chip_bytes_per_second`: what its copies into another layout move there over
their time, new in 0.8), and
the chip's flash-attention kernel (splash attention on a TPU, at the blocks a user
gives, new in 0.8; cuDNN's on a GPU), forward and backward, causal, run by
`measure` (`flash_forward_efficiency`, `flash_backward_efficiency`: their FLOPs as
the model counts them over their time). Never a step's: the figures belong to the
chip. The rest (memory, links and collectives, the chip) is the matching preset's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.step.compile import TOOLCHAINS
from spmdtree._src.step.hlo import Kernel
from spmdtree._src.step.hw import PRESETS, Costs, Hardware, hardware, preset_in
from spmdtree._src.step.kinds import Backend, KernelClass
from spmdtree._src.step.measure.measure import SCALE, measure
from spmdtree._src.step.time import Measurement, fixed_seconds, kernel_seconds

#: The grid of bf16 matmul shapes (m, k) x (k, n) timed for their shares (new in 0.8):
#: every m of the first by every k and n of the second, small and narrow ones among
#: them (a CNN's 64 and 128 channels, an attention head's 64, a decode step's 64 and
#: 128 rows: narrower than a TPU's 128-wide matrix unit, new in 0.8); a CPU's small (a
#: test's).
GRID: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "accelerator": ((64, 128, 512, 2048, 8192), (64, 128, 256, 512, 1024, 4096)),
    "cpu": ((64, 256), (64, 128)),
}
#: The most bytes of operands and results (at 4 bytes an element) one program of
#: matmuls holds: the grid's run side by side in as few as hold them (new in 0.8).
PROGRAM_BYTES = 4 * 2**30
#: The shape at which f32's and 8-bit matmuls are set beside bf16's.
REFERENCE = {"accelerator": (4096, 4096, 4096), "cpu": (256, 256, 256)}
#: The elementwise pass's elements (f32): 1 GiB on an accelerator; the sum's too.
ELEMENTS = {"accelerator": 2**28, "cpu": 2**22}
#: The sum's row: the elements it writes (new in 0.8).
READ_ROW = 1024
#: The unfused update's buffer and update (f32): a blocked attention's output of
#: (batch, heads, length, head width) written a block of 512 positions at a time; a
#: CPU's small (its layouts are not tiled: no such kernel, and nothing to measure).
UPDATE = {
    "accelerator": ((8, 8, 2048, 128), (8, 8, 512, 128)),
    "cpu": ((1, 1, 256, 128), (1, 1, 64, 128)),
}
#: The grouped matmul's rows, width, hidden width and groups (even ones): an expert
#: layer's 16,384 routed tokens over 8 experts on an accelerator (new in 0.8).
GROUPED = {"accelerator": (16384, 1024, 4096, 8), "cpu": (512, 128, 256, 4)}
#: The rows (bf16) gathered by index and scattered back (added), and their width: an
#: expert layer's dispatch and combine of 16,384 routed tokens (new in 0.8).
INDEXED = {"accelerator": (16384, 1024), "cpu": (1024, 128)}
#: The weight's (m, n) and the tokens (k) of a weight gradient with adamw's update
#: fused into its kernel, (k, m) x (k, n) in bf16: compute-bound on an accelerator, so
#: that its time is the matrix unit's (new in 0.8).
FUSED_UPDATE = {"accelerator": (4096, 8192, 4096), "cpu": (128, 256, 128)}
#: The loop of tiny kernels timed for each kernel's fixed cost (new in 0.8): its
#: iterations, and the rows of the (rows, 128) f32 array each one updates.
LAUNCH = {"accelerator": (1024, 8), "cpu": (256, 8)}
#: The loop of tiny kernels that each read rows of a table in HBM, timed for the wait
#: for the memory's first access on a TPU (new in 0.8): its iterations, and the table's
#: rows of 128 f32 (1 GiB, beyond a TPU's own memory, so that it stays in HBM), 8 read
#: by each iteration at an offset known only when it runs.
ACCESS = (1024, 2**21)
#: The f32 array a chain of transposes and elementwise passes runs on, which libtpu
#: keeps in the chip's own memory (``S(1)``) between them (16 MiB), timed for
#: `Hardware.on_chip_bytes_per_second` on a TPU (new in 0.8); and the chain's passes.
ON_CHIP = ((2048, 2048), 8)
#: The normal floats (of measure's scale, `measure.SCALE`) drawn once on the host and
#: tiled to each benchmark's operands on the device (new in 0.8): measure's own fill
#: compiles a random-number program for each shape, which libtpu took 4 to 15 s for
#: each of the benchmarks' on a TPU v5e.
BLOCK = 2**16
#: Attention's (batch, heads, length, head width) for the flash kernel.
ATTENTION = (2, 8, 4096, 128)
#: Splash attention's blocks where calibrate is given none, every one of its eight:
#: MaxText's default (its base.yml's sa_block_*); the kernel's own default (128) ran
#: at about a tenth of the share on a TPU v5e.
SPLASH_BLOCK = 512
#: Splash attention's blocks (`BlockSizes`' fields), forward and backward.
SPLASH_FIELDS = (
    "block_q",
    "block_kv",
    "block_kv_compute",
    "block_q_dkv",
    "block_kv_dkv",
    "block_kv_dkv_compute",
    "block_q_dq",
    "block_kv_dq",
)
#: What a splash block must be a multiple of: a TPU's 128 lanes.
LANES = 128


@public
def calibrate(
    device: jax.Device | None = None,
    *,
    seconds: float = 60.0,
    preset: Hardware | str | None = None,
    flash_blocks: int | Mapping[str, int] | Any | None = None,  # Any: splash's BlockSizes
) -> Hardware:
    """Measures the chip present: a `Hardware` whose per-kernel model figures are
    its own, each with its provenance (new in 0.7).

    Microbenchmarks on `device`, never a step's time: the largest share of the
    bf16 peak a matmul reaches over a few shapes, the share of the memory
    bandwidth a large elementwise pass sustains, f32 matmuls' rates at the
    default and the highest precision, the share of the bandwidth an in-place
    update moves at where the compiler leaves it unfused at an offset known only
    when it runs (a TPU's, `Kernel.unfused_update`; new in 0.7; elsewhere the
    preset's, said as not measured), and the flash-attention kernel's shares
    forward and backward with causal FLOPs as the model counts them (splash on a
    TPU, at `flash_blocks`; cuDNN's on a GPU; none on a CPU, whose figures stay
    left out), what each kernel costs beyond its work (`launch_seconds`, from
    a loop of tiny kernels; new in 0.8), and what a kernel that reads or writes an
    array in HBM waits for its first access (`access_seconds`, from a loop of tiny
    kernels reading a table there; a TPU's only; new in 0.8). Memory, links and
    collectives, and the chip are the preset's: a calibration on one chip measures
    no link. Save it with `Hardware.to_json` and time a pod's steps on it from any
    machine (``hardware="chip.json"``, ``--hardware chip.json``).

    Args:
        device: the device to measure; None: the first of jax's default backend.
        seconds: how long the benchmarks' timed runs may take; each one's
            repeats shrink to fit (at least two timed runs each). Their compiles and
            profiles come on top: on a TPU v5e the default took 51 s in all.
        preset: the preset whose peak, memory, links and chip are kept (a name
            or a `Hardware`); None: the one of the device's kind.
        flash_blocks: splash attention's blocks to measure the flash shares at,
            the ones your step runs (new in 0.8): one size for all eight, a
            mapping of `BlockSizes`' fields (``block_q``, ``block_kv``, ...; the
            rest 512, a compute block left out its parent's), or splash's own
            `BlockSizes`; every block set, each a multiple of 128 that divides the
            benchmark's 4,096 positions, a key block a multiple of its compute
            block. None: 512 each, MaxText's.
            The flash fields' provenance says the blocks. A TPU's only: cuDNN's
            kernel has no blocks.

    Returns:
        The calibrated `Hardware`, named ``"<preset>, calibrated"``.

    Raises:
        ValueError: for a device no preset matches (pass `preset`),
            `seconds` <= 0, or flash blocks the kernel refuses (or given for a
            device whose flash kernel is not splash).
        TypeError: for a device, preset or flash blocks of the wrong kind.

    Example:
        >>> import spmdtree as st
        >>> calibrated = st.calibrate(seconds=2.0, preset="h100")  # a CPU's figures, an H100's peak
        >>> calibrated.name, 0 < calibrated.matmul_efficiency <= 1, calibrated.provenance["matmul_efficiency"][:8]
        ('h100, calibrated', True, 'measured')
    """
    device = _device(device)
    base = _preset(preset, device)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
        raise Mistake(ValueError, f"seconds is {seconds!r}; expected a number > 0.")
    toolchain = TOOLCHAINS[Backend.of(device.platform)]
    splash = toolchain.flash == "splash"
    if flash_blocks is not None and not splash:
        kernel = "cuDNN's flash attention, which has no blocks" if toolchain.flash else "none"
        raise Mistake(
            ValueError,
            f"flash_blocks is {flash_blocks!r}, but they are splash attention's blocks (a "
            f"TPU's kernel) and {device.device_kind}'s flash kernel is {kernel}; leave "
            "flash_blocks out.",
        )
    blocks = splash_blocks(flash_blocks) if splash else None
    bench = _Bench(device, base, max(2, min(10, int(seconds / 8))))
    figures = _figures(bench, toolchain, blocks)
    said = _provenance(device, toolchain.package)
    provenance = dict(base.provenance)
    measured: dict[str, Any] = {}
    for name, value in figures.items():
        over = isinstance(value, float) and value > 1 and name in SHARES
        measured[name] = 1.0 if over else value
        kept = f" ({value:.3g} of the preset's figure, above it: kept at 1)" if over else ""
        flash = (
            f", splash blocks {_said_blocks(blocks)}"
            if name.startswith("flash_") and splash
            else ""
        )
        provenance[name] = said + flash + kept
    for name, why in NOT_MEASURED.items():
        if name not in figures:
            provenance[name] = "not measured: " + why.format(device=device.device_kind)
    return dataclasses.replace(
        base, name=f"{base.name}, calibrated", provenance=provenance, **measured
    )


#: The figures that are shares of a preset's figure: one above 1 is kept at 1.
SHARES = frozenset(
    {
        "matmul_efficiency",
        "memory_efficiency",
        "read_efficiency",
        "f32_speed",
        "f32_highest_speed",
        "update_efficiency",
        "grouped_efficiency",
        "indexed_efficiency",
        "flash_forward_efficiency",
        "flash_backward_efficiency",
        "fused_update_efficiency",
    }
)
#: Why a figure went unmeasured, where the device ran no kernel of its kind.
NOT_MEASURED = {
    "launch_seconds": "{device}'s profile timed no kernel of the loop",
    "access_seconds": (
        "{device} keeps no array in a memory of its own apart from HBM (a TPU's S(1)), so "
        "no kernel is told apart by reading HBM; or its profile timed no kernel of the "
        "loop that reads it"
    ),
    "matmul_grid": "{device}'s profile timed not every matmul of the grid",
    "on_chip_bytes_per_second": (
        "{device} keeps no array in a memory of its own apart from HBM (a TPU's S(1)), or "
        "its compiler kept none of the chain's there"
    ),
    "flash_forward_efficiency": "no flash-attention kernel timed on {device}",
    "flash_backward_efficiency": "no flash-attention kernel timed on {device}",
    "grouped_efficiency": "{device}'s compiler ran no grouped matmul",
    "indexed_efficiency": "{device}'s compiler ran no gather or scatter",
    "fused_update_efficiency": "{device}'s compiler fused no optimizer's update into a matmul",
    "update_efficiency": (
        "{device}'s compiler left no update unfused (its layouts are not tiled), so no "
        "kernel reads it; the preset's figure kept"
    ),
}


def _figures(bench: _Bench, toolchain: Any, blocks: Any) -> dict[str, Any]:
    """Every figure the benchmarks on `bench`'s device measured, by field name: shares
    as measured (above 1 where the chip beat its preset), the grid's points (net of
    each kernel's fixed cost), the flash kernel's at splash's `blocks`."""
    kind = "cpu" if toolchain.backend.estimates else "accelerator"
    peak = bench.base.flops_per_second
    launch = bench.launch(*LAUNCH[kind])
    # only a TPU keeps arrays in a memory of its own (S(1)), so only there is a kernel
    # that goes to HBM told apart from one that does not (Kernel.hbm_waits)
    access = bench.access(*ACCESS, launch or 0.0) if toolchain.backend is Backend.TPU else None
    reference = _reference_shapes(REFERENCE[kind], toolchain.backend)
    shapes = [*reference.values(), *_grid_shapes(*GRID[kind])]
    fixed = dataclasses.replace(
        bench.base.costs(), launch_seconds=launch or 0.0, access_seconds=access or 0.0
    )
    measured = _rates(bench, shapes, fixed)
    missing = [name for name, shape in reference.items() if shape not in measured]
    if missing:
        raise Mistake(
            ValueError,
            f"the device's profile timed no kernel of the {', '.join(missing)} matmul "
            f"{REFERENCE[kind]}; run calibrate again, or pass seconds= larger.",
        )
    rates = {name: measured[shape] for name, shape in reference.items()}
    grid = _grid(measured, *GRID[kind])
    bf16 = rates.pop("bf16")
    figures: dict[str, Any] = {"matmul_efficiency": max(bf16, *(p[3] for p in grid or ())) / peak}
    figures.update({name: rate / bf16 for name, rate in rates.items()})
    if grid is not None:
        figures["matmul_grid"] = tuple((m, k, n, min(r / peak, 1.0)) for m, k, n, r in grid)
    bandwidth = bench.base.costs().hbm_bytes_per_second  # the preset's, or its default's
    figures["memory_efficiency"] = bench.memory(ELEMENTS[kind]) / bandwidth
    figures["read_efficiency"] = bench.read(ELEMENTS[kind]) / bandwidth
    grouped, indexed = bench.experts(GROUPED[kind], INDEXED[kind])
    shares = {
        "update_efficiency": (bench.update(*UPDATE[kind]), bandwidth),
        "grouped_efficiency": (grouped, peak),
        "indexed_efficiency": (indexed, bandwidth),
    }
    figures.update({name: rate / per for name, (rate, per) in shares.items() if rate is not None})
    timed = dataclasses.replace(  # the fused update's matmul read at its shape's share
        fixed,
        memory_efficiency=figures["memory_efficiency"],
        matmul_grid=figures.get("matmul_grid", ()),
        matmul_efficiency=min(figures["matmul_efficiency"], 1.0),  # SHARES keeps it so
    )
    fused = bench.fused_update(FUSED_UPDATE[kind], timed)
    figures.update({} if fused is None else {"fused_update_efficiency": fused})
    on_chip = bench.on_chip(*ON_CHIP) if toolchain.backend is Backend.TPU else None
    figures.update({} if on_chip is None else {"on_chip_bytes_per_second": on_chip})
    figures.update(_flash_shares(bench, toolchain.flash, blocks) or {})
    beyond = {"launch_seconds": launch, "access_seconds": access}
    figures.update({name: value for name, value in beyond.items() if value is not None})
    return figures


def _device(device: object) -> jax.Device:
    if device is None:
        return jax.devices()[0]
    if not isinstance(device, jax.Device):
        raise Mistake(
            TypeError, f"device is {device!r}; expected a jax.Device (jax.devices()[0]) or None."
        )
    return device


def _preset(preset: object, device: jax.Device) -> Hardware:
    """The preset whose figures are kept: given, or the device's kind's."""
    if isinstance(preset, Hardware):
        return preset
    if isinstance(preset, str):
        return hardware(preset)
    if preset is not None:
        raise Mistake(
            TypeError, f"preset is {preset!r}; expected a preset's name, a st.Hardware or None."
        )
    found = preset_in(f"{device.device_kind}")
    if found is None:
        raise Mistake(
            ValueError,
            f"no preset matches the device {device.device_kind!r}; pass preset= (one of "
            f"{', '.join(map(repr, PRESETS))}, or a st.Hardware) for its peak, memory and links.",
        )
    return found


def _provenance(device: jax.Device, package: str | None) -> str:
    """``measured 2026-12-06 on TPU v5 lite, jax 0.10.2, libtpu 0.0.42.1``: the
    device's compiler's `package` and its version beside jax's."""
    versions = [f"jax {jax.__version__}"]
    with contextlib.suppress(metadata.PackageNotFoundError):
        versions += [f"{package} {metadata.version(package)}"] if package else []
    today = datetime.date.today().isoformat()
    return f"measured {today} on {device.device_kind}, {', '.join(versions)} (st.calibrate)"


class _Bench:
    """One kind of kernel at a time on one device, run by `measure` (its instructions'
    time read from the device's profile, the step's wall clock where the profile
    gave none), `steps` timed steps each."""

    def __init__(self, device: jax.Device, base: Hardware, steps: int) -> None:
        self.mesh = jax.sharding.Mesh(np.array([device]), ("data",))
        self.base, self.steps = base, steps
        drawn = np.random.default_rng(0).standard_normal(BLOCK, np.float32) * SCALE
        self.block = jax.device_put(drawn, device)

    def run(self, fn: Callable[..., Any], *specs: Any, **keywords: Any) -> Measurement:
        """`fn` on `specs` run by `measure` on this device: 2 steps of warm-up, then
        `steps` timed, each operand filled from `BLOCK` normal floats (`keywords` are
        measure's others, or replace these)."""
        settled = dict(
            mesh=self.mesh, hardware=self.base, steps=self.steps, warmup=2, fill=self.fill
        )
        return measure(fn, *specs, **{**settled, **keywords})

    def fill(self, key: jax.Array, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        """One operand (measure's `fill`): this bench's normal floats tiled to its
        shape, zeros where it holds integers (as measure's own fill)."""
        return _tiler(leaf.shape, leaf.dtype, leaf.sharding)(self.block)

    def rate(self, fn: Callable[..., Any], kind: str, *specs: Any) -> float:
        """The FLOPs (matmuls) or bytes (memory kernels) per second the kernels of
        `kind` in `fn` run at."""
        m = self.run(fn, *specs)
        ops = [op for op in m.ops if op.kind == kind]
        work = sum((op.flops if kind != "memory" else op.bytes) * op.calls for op in ops)
        spent = sum(op.measured_seconds for op in ops) or m.min_seconds
        return work / spent

    def matmuls(self, shapes: Sequence[Matmul], fixed: Costs) -> dict[Matmul, float]:
        """FLOP/s of each matmul of `shapes`, run side by side in one program, each on
        operands of its own (none shares one, which the compiler would merge), its
        time net of what each call costs beyond its work on `fixed`'s figures
        (`fixed_seconds`: the launch, the wait for HBM); the ones the device's
        profile timed (new in 0.8). Each product is reduced to its rows' largest, which a TPU's
        compiler does in the matmul's own kernel (as it does a softmax's): what it
        writes is one value a row, so its time is the matrix unit's, not that of
        writing its result, which the model times by the bytes a kernel moves."""

        def each(*pairs: tuple[jax.Array, jax.Array]) -> list[jax.Array]:
            out = []
            for i, ((x, w), shape) in enumerate(zip(pairs, shapes, strict=True)):
                with jax.named_scope(f"{SCOPE}{i}"):  # its kernel's op_name says which
                    out.append(jnp.max(_product(x, w, shape), axis=-1))
            return out

        specs = [
            (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype))
            for m, k, n, dtype, _ in shapes
        ]
        m = self.run(each, *specs)
        kernels = _kernels(m)
        found: dict[Matmul, float] = {}
        for op in m.ops:
            kernel = kernels.get(op.name)
            i = _scope_of(kernel.op_name) if kernel is not None and op.flops else None
            if i is None or kernel is None:
                continue
            worked = op.measured_seconds - fixed_seconds(kernel, fixed) * op.calls
            worked = worked if worked > 0 else op.measured_seconds  # a fixed cost no less
            if worked > 0:
                found[shapes[i]] = op.flops * op.calls / worked
        return found

    def launch(self, iterations: int, rows: int) -> float | None:
        """Seconds each kernel costs beyond its work (new in 0.8): the kernels of a
        loop of `iterations` tiny updates of a (`rows`, 128) f32 array, each call's
        measured time less the model's time for its work, the median of them;
        None where the profile timed none of them."""

        def loop(x: jax.Array, w: jax.Array) -> jax.Array:
            step = lambda i, x: jnp.tanh(x @ w) * 0.5 + i.astype(x.dtype)  # noqa: E731
            return jax.lax.fori_loop(0, iterations, step, x)

        f32 = jnp.float32
        m = self.run(
            loop,
            jax.ShapeDtypeStruct((rows, LANES), f32),
            jax.ShapeDtypeStruct((LANES, LANES), f32),
        )
        return self._beyond_work(m, iterations, lambda kernel: 1)

    def access(self, iterations: int, rows: int, launch: float) -> float | None:
        """Seconds a kernel waits for the memory's first access each way it goes to HBM
        (`Kernel.hbm_waits`), beyond its work and its `launch` (new in 0.8): the
        kernels of a loop of `iterations` tiny sums, each of 8 rows of a (`rows`,
        128) f32 table in HBM at an offset known only when it runs, each call's
        measured time less the model's for its work and the launch, over its ways,
        the median of them; None where the profile timed none of them."""

        def loop(table: jax.Array, total: jax.Array) -> jax.Array:
            def add(i: jax.Array, total: jax.Array) -> jax.Array:
                at = i * 7919 % (rows - 8)  # a prime's multiples: never the rows before
                return total + jax.lax.dynamic_slice_in_dim(table, at, 8, 0)

            return jax.lax.fori_loop(0, iterations, add, total)

        f32 = jnp.float32
        m = self.run(
            loop, jax.ShapeDtypeStruct((rows, LANES), f32), jax.ShapeDtypeStruct((8, LANES), f32)
        )
        return self._beyond_work(m, iterations, lambda kernel: kernel.hbm_waits, launch)

    def _beyond_work(
        self, m: Measurement, iterations: int, ways: Callable[[Kernel], int], known: float = 0.0
    ) -> float | None:
        """The median, over the kernels of `m` that pay a fixed cost (`ways`: how often
        each pays it; those that pay none left out) and ran once each of a loop's
        `iterations` and took time, of each call's measured time less the model's
        for its work and the `known` fixed costs, over its ways; None where there
        are none."""
        kernels = _kernels(m)
        costs, peak = self.base.costs(), self.base.flops_per_second
        each = [
            (op.measured_seconds / op.calls - kernel_seconds(kernels[op.name], costs, peak) - known)
            / ways(kernels[op.name])
            for op in m.ops
            if op.name in kernels
            and ways(kernels[op.name])
            and op.calls == iterations
            and op.measured_seconds
        ]
        return max(0.0, float(np.median(each))) if each else None

    def update(self, buffer: tuple[int, ...], block: tuple[int, ...]) -> float | None:
        """Bytes per second an unfused in-place update moves (`Kernel.unfused_update`:
        its update read and written), `block` into f32 `buffer` at an offset along
        the second-minor dimension given when it runs; None where the compiler
        runs no such kernel (a CPU's, a GPU's: no tiled layout)."""

        def update(x: jax.Array, u: jax.Array, at: jax.Array) -> tuple[jax.Array, jax.Array]:
            """The update, and its offset's next (an output that is not fed back, so
            that the steps run as a training loop's, the buffer donated to the next)."""
            return jax.lax.dynamic_update_slice_in_dim(x, u, at, axis=len(buffer) - 2), at + 1

        f32 = jnp.float32
        m = self.run(
            update,
            jax.ShapeDtypeStruct(buffer, f32),
            jax.ShapeDtypeStruct(block, f32),
            jnp.asarray(buffer[-2] // 4, jnp.int32),
            donate_argnums=0,
        )
        unfused = {name for name, k in _kernels(m).items() if k.unfused_update}
        ops = [op for op in m.ops if op.name in unfused and op.measured_seconds]
        if not ops:
            return None
        return sum(op.bytes * op.calls for op in ops) / sum(op.measured_seconds for op in ops)

    def experts(
        self, grouped: tuple[int, int, int, int], indexed: tuple[int, int]
    ) -> tuple[float | None, float | None]:
        """An expert layer's kernels, side by side in one program (new in 0.8): FLOP/s
        of the grouped matmuls (`Kernel.grouped`, their groups' FLOPs) of a
        `jax.lax.ragged_dot` of `rows` bf16 rows of `width` in `groups` even groups by
        (groups, width, hidden) weights and of its weights' gradient (`grouped`:
        rows, width, hidden, groups); bytes per second of the rows a gather by a
        permutation and a scatter-add of them back move through HBM, as the model
        counts them (`Kernel.indexed`, those of a kernel that moves its rows in the
        chip's own memory left out: `Kernel.rows_on_chip`; `indexed`: rows,
        width). Each None where the compiler runs no such kernel."""
        rows, width, hidden, groups = grouped

        def both(x: jax.Array, w: jax.Array, y: jax.Array, order: jax.Array) -> Any:
            sizes = jnp.full((groups,), rows // groups, jnp.int32)
            square = lambda w: jnp.sum(jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32) ** 2)  # noqa: E731
            return jax.grad(square)(w), jnp.zeros_like(y).at[order].add(y[order] * 2)

        bf16 = jnp.bfloat16
        specs = (
            jax.ShapeDtypeStruct((rows, width), bf16),
            jax.ShapeDtypeStruct((groups, width, hidden), bf16),
            jax.ShapeDtypeStruct(indexed, bf16),
            jax.ShapeDtypeStruct(indexed[:1], jnp.int32),
        )
        m = self.run(both, *specs)
        return _work_rate(m, lambda k: k.flops if k.grouped else 0), _work_rate(
            m, lambda k: 0 if k.rows_on_chip else k.indexed
        )

    def fused_update(self, shape: tuple[int, int, int], costs: Costs) -> float | None:
        """The share of its shape's rate a matmul keeps with an optimizer's update
        fused into its kernel (`Kernel.fused_update`; new in 0.8): adamw's moments and
        step on an (m, n) f32 weight in place, its gradient the (k, m) x (k, n) bf16
        product over the tokens `k`, as libtpu fuses them into one kernel; the share
        at which the model (on `costs`: the chip's grid, memory share and fixed
        costs) times that kernel's calls as measured, the median of them; None where
        the compiler fuses no update into a matmul."""
        m, k, n = shape

        def step(w: jax.Array, mu: jax.Array, nu: jax.Array, x: jax.Array, dy: jax.Array) -> Any:
            g = jnp.einsum("km,kn->mn", x, dy, preferred_element_type=jnp.float32)
            mu, nu = 0.9 * mu + 0.1 * g, 0.999 * nu + 0.001 * g * g
            return w - 1e-3 * mu / (jnp.sqrt(nu) + 1e-8), mu, nu

        f32, bf16 = jnp.float32, jnp.bfloat16
        weights = [jax.ShapeDtypeStruct((m, n), f32)] * 3
        tokens = [jax.ShapeDtypeStruct((k, m), bf16), jax.ShapeDtypeStruct((k, n), bf16)]
        measured = self.run(step, *weights, *tokens, donate_argnums=(0, 1, 2))
        kernels, peak = _kernels(measured), self.base.flops_per_second
        timed = [
            _share_timed(kernels[op.name], op.measured_seconds / op.calls, costs, peak)
            for op in measured.ops
            if op.name in kernels and kernels[op.name].fused_update and op.measured_seconds
        ]
        shares = [share for share in timed if share is not None]
        return float(np.median(shares)) if shares else None

    def on_chip(self, shape: tuple[int, int], passes: int) -> float | None:
        """Bytes per second a kernel moves in the chip's own memory (`Kernel.on_chip`;
        new in 0.8): a chain of `passes` over an f32 array of `shape`, transposes and
        elementwise maps alternately, each kept a kernel of its own (an optimization
        barrier between them), which libtpu keeps in its own memory (``S(1)``); what
        its copies into another layout that read and write only there move, over
        their time; None where the compiler kept none there.

        The copies are what a step's kernels on that memory mostly are (a v5e's
        copies, reshapes and reductions there ran at 1.5 to 2.6 TB/s, its copies
        here at 2.1); an elementwise pass there ran at 11 TB/s (f32), which the
        model, timing every kernel's bytes there at the one rate, over-times, by
        microseconds a pass."""

        m = self.run(
            functools.partial(_chain, passes=passes), jax.ShapeDtypeStruct(shape, jnp.float32)
        )
        return _work_rate(m, _on_chip_copy)

    def memory(self, elements: int) -> float:
        """Bytes per second of an elementwise pass over an f32 array (read and
        written whole)."""
        return self.rate(
            lambda x: x * 0.5 + 1.0, "memory", jax.ShapeDtypeStruct((elements,), jnp.float32)
        )

    def read(self, elements: int) -> float:
        """Bytes per second of a sum over the rows of an f32 array (read whole, one
        row of `READ_ROW` written: `Kernel.reads_only`; new in 0.8)."""
        rows = jax.ShapeDtypeStruct((elements // READ_ROW, READ_ROW), jnp.float32)
        return self.rate(functools.partial(jnp.sum, axis=0), "memory", rows)


def _chain(x: jax.Array, passes: int) -> jax.Array:
    """`passes` over `x`, transposes and elementwise maps alternately, an optimization
    barrier before each (a kernel of its own)."""
    for i in range(passes):
        x = jax.lax.optimization_barrier(x)
        x = x * 1.001 + 0.5 if i % 2 else x.T
    return x


def _on_chip_copy(kernel: Kernel) -> int:
    """What `kernel` moves in the chip's own memory, where it is a copy (into another
    layout) that reads and writes nothing in HBM; else 0."""
    there = kernel.opcode == "copy" and not kernel.bytes and not kernel.hbm_waits
    return kernel.on_chip if there else 0


def _share_timed(kernel: Kernel, seconds: float, costs: Costs, peak: float) -> float | None:
    """The `Costs.fused_update_efficiency` at which the model times `kernel` (a matmul
    with an update fused into it) at `seconds`, its fixed costs included: found by
    halving, the model's time falling as the share rises; 1 where it is no slower than
    at its shape's share; None where even a thousandth of it is faster than that."""

    def timed(share: float) -> float:
        at = dataclasses.replace(costs, fused_update_efficiency=share)
        return kernel_seconds(kernel, at, peak) + fixed_seconds(kernel, at)

    low, high = 1e-3, 1.0
    if timed(high) >= seconds:
        return high
    if timed(low) < seconds:
        return None
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if timed(middle) < seconds else (middle, high)
    return high


@functools.cache
def _tiler(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Callable[[jax.Array], jax.Array]:
    """A block of floats tiled to `shape` (`dtype`, on `sharding`), zeros for an
    integer `dtype`: one small program for each kind of operand, compiled once."""
    size = math.prod(shape)

    def tiled(block: jax.Array) -> jax.Array:
        if not jnp.issubdtype(dtype, jnp.floating):
            return jnp.zeros(shape, dtype)
        whole = jnp.tile(block, -(-size // block.size))[:size]
        return whole.reshape(shape).astype(dtype)

    return jax.jit(tiled, out_shardings=sharding)


def _kernels(m: Measurement) -> dict[str, Kernel]:
    """The kernels of a measured step's schedule by name (none where it has none)."""
    schedule = m.plan.schedule
    return {k.name: k for k in schedule.kernels()} if schedule else {}


def _work_rate(m: Measurement, work: Callable[[Kernel], int]) -> float | None:
    """The work per second (`work` of each kernel: its FLOPs, its bytes) of the
    kernels of a measured schedule that do some, over their time in the device's
    profile (the step's fastest where the profile gave none); None where no kernel
    does any (new in 0.8)."""
    done = {name: work(k) for name, k in _kernels(m).items() if work(k)}
    ops = [op for op in m.ops if op.name in done]
    if not ops:
        return None
    spent = sum(op.measured_seconds for op in ops) or m.min_seconds
    return sum(done[op.name] * op.calls for op in ops) / spent


#: One matmul of a calibration: (m, k, n), its operands' element type and precision.
Matmul = tuple[int, int, int, Any, "str | None"]


def _product(x: jax.Array, w: jax.Array, shape: Matmul) -> jax.Array:
    """`x` @ `w` at `shape`'s precision, integers accumulated in int32."""
    integer = jnp.issubdtype(x.dtype, jnp.integer)
    return jax.lax.dot(
        x, w, precision=shape[4], preferred_element_type=jnp.int32 if integer else None
    )


#: The named scope of each matmul of a calibration program, its index after it.
SCOPE = "spmdtree_calibrate_"


def _scope_of(op_name: str) -> int | None:
    """The index of the calibration matmul a kernel's op_name names, if any.

    Example:
        >>> _scope_of("jit(each)/spmdtree_calibrate_12/dot_general"), _scope_of("jit(f)/dot")
        (12, None)
    """
    _, found, rest = op_name.partition(SCOPE)
    index = rest.split("/")[0]
    return int(index) if found and index.isdigit() else None


def _grid(
    rates: dict[Matmul, float], rows: Sequence[int], sizes: Sequence[int]
) -> tuple[tuple[int, int, int, float], ...] | None:
    """The FLOP/s `rates` holds of bf16 matmuls of every (m, k, n) of `rows` x `sizes` x
    `sizes`; None where the profile timed not every one (new in 0.8)."""
    shapes = _grid_shapes(rows, sizes)
    if any(shape not in rates for shape in shapes):
        return None
    return tuple((m, k, n, rates[m, k, n, dtype, p]) for m, k, n, dtype, p in shapes)


def _grid_shapes(rows: Sequence[int], sizes: Sequence[int]) -> list[Matmul]:
    """The grid's bf16 matmuls: every m of `rows` by every k and n of `sizes`."""
    return [(m, k, n, jnp.bfloat16, None) for m in rows for k in sizes for n in sizes]


def _reference_shapes(shape: tuple[int, int, int], backend: Backend) -> dict[str, Matmul]:
    """Matmuls of `shape` in bf16 (``"bf16"``), in f32 at the default and the highest
    precision and in 8 bits (int8; fp8 on a GPU), by the figure each gives."""
    eight = jnp.float8_e4m3fn if backend == Backend.GPU else jnp.int8
    kinds = {
        "bf16": (jnp.bfloat16, None),
        "f32_speed": (jnp.float32, None),
        "f32_highest_speed": (jnp.float32, "highest"),
        "eight_bit_speed": (eight, None),
    }
    return {name: (*shape, dtype, precision) for name, (dtype, precision) in kinds.items()}


def _rates(bench: _Bench, shapes: Sequence[Matmul], fixed: Costs) -> dict[Matmul, float]:
    """The FLOP/s of each of `shapes` the profile timed (net of what each call costs
    beyond its work on `fixed`'s figures), run in as few programs as hold their
    operands and results in `PROGRAM_BYTES` each (smallest first)."""
    found: dict[Matmul, float] = {}
    chunk: list[Matmul] = []
    held = 0
    for shape in sorted(shapes, key=lambda s: s[0] * (s[1] + s[2])):
        m, k, n, dtype, _ = shape
        size = (m * k + k * n) * jnp.dtype(dtype).itemsize + m * n * 4
        if chunk and held + size > PROGRAM_BYTES:
            found.update(bench.matmuls(chunk, fixed))
            chunk, held = [], 0
        chunk.append(shape)
        held += size
    found.update(bench.matmuls(chunk, fixed) if chunk else {})
    return found


def _flash_shares(bench: _Bench, flash: str, blocks: Any) -> dict[str, float] | None:
    """The flash kernel's shares of the peak, forward and backward, causal (splash's at
    `blocks`): each direction's FLOPs as the model counts them over their time in the
    device's profile; None where the device has no flash kernel, or the profile timed
    none."""
    attention = _attention(flash, blocks)
    if attention is None:
        return None
    spec = jax.ShapeDtypeStruct(ATTENTION, jnp.bfloat16)

    def both(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    m = bench.run(both, spec, spec, spec, warmup=3)
    shares = {}
    for direction in ("forward", "backward"):
        ops = [op for op in m.ops if _direction(op.call) == direction]
        flops = sum(op.flops * op.calls for op in ops)
        spent = sum(op.measured_seconds for op in ops)
        if not flops or not spent:
            return None
        shares[f"flash_{direction}_efficiency"] = flops / spent / bench.base.flops_per_second
    return shares


def _direction(call: str) -> str:
    return Kernel(KernelClass.ATTENTION, 0, 0, call=call).flash if call else ""


def _attention(flash: str, blocks: Any = None) -> Callable[..., jax.Array] | None:
    """The `flash` kernel's causal attention over (batch, heads, length, width), splash's
    at `blocks` (its `BlockSizes`; None: `SPLASH_BLOCK` each)."""
    if flash == "splash":
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as kernel,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask as masks,
        )

        _, heads, length, _ = ATTENTION
        mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
        blocks = blocks or splash_blocks(None)
        splash = kernel.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1)
        return jax.vmap(splash)
    if flash == "cudnn":

        def cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            swap = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (batch, length, heads, width)
            out = jax.nn.dot_product_attention(
                swap(q), swap(k), swap(v), is_causal=True, implementation="cudnn"
            )
            return swap(out)

        return cudnn
    return None


def splash_blocks(given: object) -> Any:
    """Splash attention's `BlockSizes` for calibrate's ``flash_blocks`` (new in 0.8):
    one size for all eight blocks, a mapping of some of `SPLASH_FIELDS` (the rest
    `SPLASH_BLOCK`; a ``*_compute`` block left out is its parent's), or a
    `BlockSizes` as given; checked against what the benchmark runs: every block set
    (it runs the backward too; the dq ones may be left out of a fused backward),
    each a multiple of 128 that divides its attention's length, and a key block a
    multiple of the block it is computed in.

    Example:
        >>> splash_blocks(256).block_q, splash_blocks({"block_q": 1024}).block_kv
        (256, 512)
        >>> splash_blocks({"block_kv": 256}).block_kv_compute
        256
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )

    fused = False
    if isinstance(given, kernel.BlockSizes):
        sizes = {name: getattr(given, name) for name in SPLASH_FIELDS}
        fused = given.use_fused_bwd_kernel
    elif given is None or (isinstance(given, int) and not isinstance(given, bool)):
        sizes = dict.fromkeys(SPLASH_FIELDS, SPLASH_BLOCK if given is None else given)
    elif isinstance(given, Mapping):
        unknown = [name for name in given if name not in SPLASH_FIELDS]
        if unknown:
            raise Mistake(
                ValueError,
                f"flash_blocks names {unknown[0]!r}; expected splash's blocks: "
                f"{', '.join(SPLASH_FIELDS)}.",
            )
        sizes = {**dict.fromkeys(SPLASH_FIELDS, SPLASH_BLOCK), **given}
        for compute, parent in _COMPUTED_IN:
            sizes[compute] = given.get(compute, sizes[parent])
    else:
        raise Mistake(
            TypeError,
            f"flash_blocks is {given!r}; expected one block size (512), a mapping of "
            "splash's BlockSizes fields ({'block_q': 512, ...}), a BlockSizes or None.",
        )
    _check_blocks(sizes, fused)
    return given if isinstance(given, kernel.BlockSizes) else kernel.BlockSizes(**sizes)


#: Splash's key blocks and the blocks each is computed in.
_COMPUTED_IN = (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv"))


def _check_blocks(sizes: Mapping[str, object], fused: bool) -> None:
    """Refuses blocks the benchmark's splash kernel cannot run (`splash_blocks`)."""
    length = ATTENTION[2]
    divisors = [b for b in range(LANES, length + 1, LANES) if length % b == 0]
    for name, size in sizes.items():
        if size is None and fused and name in ("block_q_dq", "block_kv_dq"):
            continue  # a fused backward has no dq kernel
        whole = isinstance(size, int) and not isinstance(size, bool) and size > 0
        if not (whole and size % LANES == 0 and length % size == 0):  # type: ignore[operator]
            raise Mistake(
                ValueError,
                f"flash_blocks sets {name} to {size!r}; expected a multiple of {LANES} that "
                f"divides the benchmark's {length} positions "
                f"({', '.join(map(str, divisors[:-1]))} or {divisors[-1]}): calibrate runs "
                "splash forward and backward, so every block is set.",
            )
    for compute, parent in _COMPUTED_IN:
        if sizes[parent] % sizes[compute]:  # type: ignore[operator]
            raise Mistake(
                ValueError,
                f"flash_blocks sets {parent} to {sizes[parent]} and {compute} to "
                f"{sizes[compute]}; expected {parent} a multiple of {compute} (splash "
                "computes each key block in parts of that size).",
            )


def _said_blocks(blocks: Any) -> str:
    """Splash's `blocks` in a provenance: ``of 512`` where all are, else each set one.

    Example:
        >>> _said_blocks(splash_blocks(512)), _said_blocks(splash_blocks({"block_q": 1024}))[:26]
        ('of 512', 'block_q 1024, block_kv 512')
    """
    sizes = {name: getattr(blocks, name) for name in SPLASH_FIELDS}
    if len(set(sizes.values())) == 1:
        return f"of {sizes['block_q']}"
    return ", ".join(f"{name} {size}" for name, size in sizes.items() if size is not None)
