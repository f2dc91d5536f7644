"""The chip present, measured (new in 0.7): `calibrate` runs microbenchmarks on one
device and gives a `Hardware` whose per-kernel model figures are its own.

Each figure comes from a kernel of its own kind, run by `measure` and timed by
the device's own profile (so no dispatch is counted): bf16 matmuls of a few shapes (`matmul_efficiency`, the
largest share of the peak they reach), a large elementwise pass
(`memory_efficiency`, its bytes over the data sheet's bandwidth), f32 matmuls
at the default and the highest precision (`f32_speed`, `f32_highest_speed`,
their rate over the bf16 one), an in-place update at a run-time offset into a
tiled dimension that the compiler leaves unfused (`update_efficiency`: its
update's bytes read and written over the data sheet's bandwidth; a TPU's
only), a grouped matmul (`jax.lax.ragged_dot` and its weights' gradient, their
groups' FLOPs over their time: `grouped_efficiency`, new in 0.8), a gather of
rows by index and a scatter-add of them back (what they move over their time:
`indexed_efficiency`, new in 0.8), and the chip's flash-attention kernel
(splash attention on a TPU, cuDNN's on a GPU), forward and backward, causal,
run by `measure` (`flash_forward_efficiency`, `flash_backward_efficiency`:
their FLOPs as the model counts them over their time). Never a step's: the
figures belong to the chip. The rest (memory, links, the chip) is the matching
preset's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
from collections.abc import Callable
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdtree._src.errors import Mistake, public
from spmdtree._src.step.compile import TOOLCHAINS
from spmdtree._src.step.hlo import Kernel
from spmdtree._src.step.hw import PRESETS, Hardware, hardware, preset_in
from spmdtree._src.step.kinds import Backend, KernelClass
from spmdtree._src.step.measure.measure import measure

#: bf16 matmul shapes (m, k, n) timed for the largest share: square ones of an
#: accelerator's usual sizes, and a wide one; a CPU's are small (a test's).
MATMULS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "accelerator": ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 8192, 16384)),
    "cpu": ((256, 256, 256), (512, 512, 512)),
}
#: The elementwise pass's elements (f32): 1 GiB on an accelerator.
ELEMENTS = {"accelerator": 2**28, "cpu": 2**22}
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
#: Attention's (batch, heads, length, head width) for the flash kernel.
ATTENTION = (2, 8, 4096, 128)
#: Splash attention's blocks, every one of its eight: MaxText's default (its base.yml's
#: sa_block_*); the kernel's own default (128) runs at about a tenth of the share.
SPLASH_BLOCK = 512


@public
def calibrate(
    device: jax.Device | None = None,
    *,
    seconds: float = 60.0,
    preset: Hardware | str | None = None,
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
    TPU, cuDNN's on a GPU; none on a CPU, whose figures stay left out). Memory,
    links and the chip are the preset's. Save it with `Hardware.to_json` and time
    a pod's steps on it from any machine (``--hardware chip.json``).

    Args:
        device: the device to measure; None: the first of jax's default backend.
        seconds: about how long to spend; each benchmark's repeats shrink to fit
            (at least one timed run each).
        preset: the preset whose peak, memory, links and chip are kept (a name
            or a `Hardware`); None: the one of the device's kind.

    Returns:
        The calibrated `Hardware`, named ``"<preset>, calibrated"``.

    Raises:
        ValueError: for a device no preset matches (pass `preset`), or
            `seconds` <= 0.
        TypeError: for a device or preset of the wrong kind.

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
    kind = "cpu" if toolchain.backend.estimates else "accelerator"
    bench = _Bench(device, base, max(2, min(10, int(seconds / 8))))
    figures: dict[str, float] = {}
    bf16 = max(bench.matmul(shape, jnp.bfloat16) for shape in MATMULS[kind])
    figures["matmul_efficiency"] = bf16 / base.flops_per_second
    shape = MATMULS[kind][0]
    figures["f32_speed"] = bench.matmul(shape, jnp.float32) / bf16
    figures["f32_highest_speed"] = bench.matmul(shape, jnp.float32, "highest") / bf16
    bandwidth = base.costs().hbm_bytes_per_second  # the preset's, or its default's
    figures["memory_efficiency"] = bench.memory(ELEMENTS[kind]) / bandwidth
    update = bench.update(*UPDATE[kind])
    if update is not None:
        figures["update_efficiency"] = update / bandwidth
    grouped = bench.grouped(*GROUPED[kind])
    if grouped is not None:
        figures["grouped_efficiency"] = grouped / base.flops_per_second
    indexed = bench.indexed(*INDEXED[kind])
    if indexed is not None:
        figures["indexed_efficiency"] = indexed / bandwidth
    flash = _flash_shares(bench, toolchain.flash)
    figures.update(flash or {})
    said = _provenance(device, toolchain.package)
    measured: dict[str, Any] = {name: min(value, 1.0) for name, value in figures.items()}
    provenance = dict(base.provenance)
    for name, value in figures.items():
        over = f" ({value:.3g} of the preset's figure, above it: kept at 1)" if value > 1 else ""
        provenance[name] = said + over
    if flash is None:
        for name in ("flash_forward_efficiency", "flash_backward_efficiency"):
            provenance[name] = (
                f"not measured: no flash-attention kernel timed on {device.device_kind}"
            )
    for name, found, what in (
        ("grouped_efficiency", grouped, "grouped matmul"),
        ("indexed_efficiency", indexed, "gather or scatter"),
    ):
        if found is None:
            provenance[name] = f"not measured: {device.device_kind}'s compiler ran no {what}"
    if update is None:
        provenance["update_efficiency"] = (
            f"not measured: {device.device_kind}'s compiler left no update unfused (its "
            "layouts are not tiled), so no kernel reads it; the preset's figure kept"
        )
    return dataclasses.replace(
        base, name=f"{base.name}, calibrated", provenance=provenance, **measured
    )


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

    def rate(self, fn: Callable[..., Any], kind: str, *specs: Any) -> float:
        """The FLOPs (matmuls) or bytes (memory kernels) per second the kernels of
        `kind` in `fn` run at."""
        m = measure(fn, *specs, mesh=self.mesh, hardware=self.base, steps=self.steps, warmup=2)
        ops = [op for op in m.ops if op.kind == kind]
        work = sum((op.flops if kind != "memory" else op.bytes) * op.calls for op in ops)
        spent = sum(op.measured_seconds for op in ops) or m.min_seconds
        return work / spent

    def matmul(
        self, shape: tuple[int, int, int], dtype: Any, precision: str | None = None
    ) -> float:
        """FLOP/s of an (m, k) x (k, n) matmul of `dtype`."""
        m, k, n = shape
        fn = functools.partial(jnp.matmul, precision=precision)
        x, w = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)
        return self.rate(fn, "matmul", x, w)

    def update(self, buffer: tuple[int, ...], block: tuple[int, ...]) -> float | None:
        """Bytes per second an unfused in-place update moves (`Kernel.unfused_update`:
        its update read and written), `block` into f32 `buffer` at an offset along
        the second-minor dimension given when it runs; None where the compiler
        runs no such kernel (a CPU's, a GPU's: no tiled layout)."""
        f32 = jnp.float32
        m = measure(
            lambda x, u, at: jax.lax.dynamic_update_slice_in_dim(x, u, at, axis=len(buffer) - 2),
            jax.ShapeDtypeStruct(buffer, f32),
            jax.ShapeDtypeStruct(block, f32),
            jnp.asarray(buffer[-2] // 4, jnp.int32),
            mesh=self.mesh,
            hardware=self.base,
            steps=self.steps,
            warmup=2,
            donate_argnums=0,
        )
        schedule = m.plan.schedule
        unfused = {k.name for k in schedule.kernels() if k.unfused_update} if schedule else set()
        ops = [op for op in m.ops if op.name in unfused and op.measured_seconds]
        if not ops:
            return None
        return sum(op.bytes * op.calls for op in ops) / sum(op.measured_seconds for op in ops)

    def grouped(self, rows: int, width: int, hidden: int, groups: int) -> float | None:
        """FLOP/s of the grouped matmuls (`Kernel.grouped`, their groups' FLOPs) of a
        `jax.lax.ragged_dot` of `rows` bf16 rows of `width` in `groups` even groups by
        (groups, width, hidden) weights, and its weights' gradient; None where the
        compiler runs none."""

        def both(x: jax.Array, w: jax.Array) -> jax.Array:
            sizes = jnp.full((groups,), rows // groups, jnp.int32)
            square = lambda w: jnp.sum(jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32) ** 2)  # noqa: E731
            return jax.grad(square)(w)

        bf16 = jnp.bfloat16
        x = jax.ShapeDtypeStruct((rows, width), bf16)
        w = jax.ShapeDtypeStruct((groups, width, hidden), bf16)
        return self.kernels_rate(both, (x, w), lambda k: k.flops if k.grouped else 0)

    def indexed(self, rows: int, width: int) -> float | None:
        """Bytes per second of the rows a gather of `rows` bf16 rows of `width` by a
        permutation and a scatter-add of them back move, as the model counts them
        (`Kernel.indexed`); None where the compiler runs no such kernel."""

        def both(x: jax.Array, order: jax.Array) -> jax.Array:
            return jnp.zeros_like(x).at[order].add(x[order] * 2)

        x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
        order = jax.ShapeDtypeStruct((rows,), jnp.int32)
        return self.kernels_rate(both, (x, order), lambda k: k.indexed)

    def kernels_rate(
        self, fn: Callable[..., Any], specs: tuple[Any, ...], work: Callable[[Kernel], int]
    ) -> float | None:
        """The work per second (`work` of each kernel: its FLOPs, its bytes) of the
        kernels of `fn`'s schedule that do some, over their time in the device's
        profile (the step's fastest where the profile gave none); None where no
        kernel does any (new in 0.8)."""
        m = measure(fn, *specs, mesh=self.mesh, hardware=self.base, steps=self.steps, warmup=2)
        schedule = m.plan.schedule
        done = {k.name: work(k) for k in schedule.kernels() if work(k)} if schedule else {}
        ops = [op for op in m.ops if op.name in done]
        if not ops:
            return None
        spent = sum(op.measured_seconds for op in ops) or m.min_seconds
        return sum(done[op.name] * op.calls for op in ops) / spent

    def memory(self, elements: int) -> float:
        """Bytes per second of an elementwise pass over an f32 array (read and
        written whole)."""
        return self.rate(
            lambda x: x * 0.5 + 1.0, "memory", jax.ShapeDtypeStruct((elements,), jnp.float32)
        )


def _flash_shares(bench: _Bench, flash: str) -> dict[str, float] | None:
    """The flash kernel's shares of the peak, forward and backward, causal: each
    direction's FLOPs as the model counts them over their time in the device's
    profile; None where the device has no flash kernel, or the profile timed none."""
    attention = _attention(flash)
    if attention is None:
        return None
    spec = jax.ShapeDtypeStruct(ATTENTION, jnp.bfloat16)

    def both(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    m = measure(both, spec, spec, spec, mesh=bench.mesh, hardware=bench.base, steps=bench.steps)
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


def _attention(flash: str) -> Callable[..., jax.Array] | None:
    """The `flash` kernel's causal attention over (batch, heads, length, width)."""
    if flash == "splash":
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as kernel,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask as masks,
        )

        _, heads, length, _ = ATTENTION
        mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
        blocks = kernel.BlockSizes(*(SPLASH_BLOCK,) * 8)  # MaxText's: 512 each way
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
