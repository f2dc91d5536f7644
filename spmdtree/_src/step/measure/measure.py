"""A step run on the devices present and its prediction set beside it (new in 0.7):
`measure`, preflight's stages, then the compiled step run and profiled.

The step is compiled once for the mesh of this process's devices (its
`StepPlan` is the measurement's), its `jax.ShapeDtypeStruct` leaves filled,
then run as a training loop runs it: warm-up steps, then timed ones, each
dispatched while the one before runs and its donated arguments fed from the
outputs that match them (where one has none, each step alone, its donated
arguments filled anew before it, outside its time), then a few more under
`jax.profiler`, whose trace is joined by name to the compiled schedule
(`measured.compare`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from spmdtree._src.errors import Mistake, public
from spmdtree._src.rules import AnyMesh, PyTree, Rules, logical_axis_rules
from spmdtree._src.step.compile import Arguments, Here, called, check_compiler_options, flat_step
from spmdtree._src.step.hw import Hardware, timed_on
from spmdtree._src.step.kinds import Backend
from spmdtree._src.step.preflight import Keywords, plan_arguments, step_plan, trace_for
from spmdtree._src.step.time import Measurement, compare, read_profile

#: Steps run under the profiler, after the timed ones (at most `steps` of them).
PROFILED = 3
#: What XLA CPU needs to write its instructions into a profile.
_CPU_EVENTS = {"xla_cpu_enable_xprof_traceme": True}
#: The default fill's scale: small normal floats, as an initialiser draws them.
SCALE = 0.02

Fill = Callable[[jax.Array, jax.ShapeDtypeStruct], Any]


@public
def measure(
    fn: Callable[..., Any],
    *args: Any,
    mesh: AnyMesh,
    rules: Rules | None = None,
    params: PyTree = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    out_shardings: PyTree = None,
    compiler_options: Mapping[str, Any] | None = None,
    hardware: Hardware | str | os.PathLike[str] | None = None,
    steps: int = 10,
    warmup: int = 3,
    fill: Fill | None = None,
    profile_dir: str | os.PathLike[str] | None = None,
) -> Measurement:
    """Runs a step on this process's devices and sets its prediction beside what it
    took, per step and per instruction (new in 0.7).

    The step is planned, traced and compiled as `preflight` does it for a
    `Mesh` (the same arguments, the same refusals), once; the compiled step is
    then run: `warmup` steps, then `steps` timed ones, then up to three more
    under `jax.profiler`, whose trace is joined by instruction name to the
    compiled schedule (`StepPlan.compare`). The steps run as a training loop
    runs them: each dispatched while the one before runs, its donated
    arguments the outputs that match them (shape, dtype, sharding), each
    step's time from the end of the one before to its own (wall clock); where
    a donated argument has no such output, each step runs alone, the argument
    filled anew before it, outside its time. `jax.ShapeDtypeStruct` leaves are
    filled (`fill`); arrays and scalars given are used as given.

    Args:
        fn: the step, e.g. ``train_step(params, state, batch)``.
        *args: its arguments, as `preflight` takes them.
        mesh: a `Mesh` of this process's devices (plan other devices with
            ``preflight(..., target=)``).
        rules: as for `preflight`.
        params: as for `preflight`.
        donate_argnums: as for `preflight`.
        static_argnums: as for `preflight`.
        out_shardings: as for `preflight`.
        compiler_options: the job's XLA options, as for `preflight`.
        hardware: what to time the prediction on: a `Hardware`, a preset's name
            or the path of a `Hardware.to_json` file (``"chip.json"``, new in 0.8);
            None: the preset of the devices' kind (``TPU v5 lite``: ``tpu-v5e``).
        steps: timed steps (>= 1).
        warmup: untimed steps before them (>= 0).
        fill: ``fill(key, leaf) -> array`` for each `jax.ShapeDtypeStruct`
            leaf; None: normal floats of scale 0.02, zero integers.
        profile_dir: the folder to keep the profile in (its
            ``perfetto_trace.json.gz`` opens in Perfetto, and
            `StepPlan.compare` reads it again); None: a temporary one.

    Returns:
        The `Measurement`: ``seconds`` (the median step), ``predicted_seconds``,
        ``ratio``, ``ops`` (per instruction), ``joined_share``, ``flags``.

    Raises:
        ValueError: for an `AbstractMesh` or a mesh of devices this process
            does not have, a step that does not fit on them (the compiler's
            figure, and what to try), no `hardware` where no preset matches the
            devices, or anything `preflight` refuses.
        TypeError: for `hardware` that is no `Hardware`, or counts that are no ints.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> x = st.Partitioned(jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32), ("data", None))
        >>> cpu = st.Hardware("cpu", 2**34, 1e11, {"ici": (1e10, 0.0)})
        >>> m = st.measure(lambda x: jnp.sum(jnp.tanh(x.value)), x, mesh=mesh, hardware=cpu, steps=3)
        >>> len(m.times), m.seconds > 0, m.predicted_seconds > 0, 0 < m.joined_share <= 1
        (3, True, True, True)
    """
    here = check_here(mesh)
    _check_counts(steps, warmup)
    if hardware is not None:  # a hardware of the wrong kind, said before anything compiles
        timed_on(hardware, "")
    keywords = Keywords(params, donate_argnums, static_argnums, out_shardings)
    planned = plan_arguments(args, mesh, rules, keywords)
    compiler = Here(here, check_compiler_options(compiler_options))
    traced = trace_for(fn, planned, mesh, rules, keywords, (compiler,))
    added = _CPU_EVENTS if compiler.toolchain.backend is Backend.CPU else {}
    analysis, compiled = _fitting(lambda: compiler.executable(traced, added), compiler)
    step = step_plan(traced, analysis, compiler)
    chosen = timed_on(hardware, step.target)
    runs = _Runs(compiled, planned, here, fill, _jitted(fn, planned, here, rules))
    times = _fitting(lambda: runs.timed(warmup, steps), compiler)
    with contextlib.ExitStack() as stack:
        folder = profile_dir or stack.enter_context(tempfile.TemporaryDirectory())
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            runs.timed(0, min(steps, PROFILED))
        profile = read_profile(folder, module=_module_name(compiled))
    return compare(step, profile, chosen, times)


def check_here(mesh: object) -> Mesh:
    """`mesh`, refused unless it is a `Mesh` of this process's devices."""
    if isinstance(mesh, AbstractMesh):
        raise Mistake(
            ValueError,
            f"mesh is an AbstractMesh {dict(mesh.shape)}, whose devices cannot run a step; "
            "measure runs on a jax.sharding.Mesh of this process's devices "
            "(st.layouts(jax.local_devices(), axes) gives them). Plan devices you don't "
            "have with st.preflight(..., target=...).",
        )
    if not isinstance(mesh, Mesh):
        raise Mistake(
            TypeError,
            f"mesh is {mesh!r}; expected a jax.sharding.Mesh of this process's devices "
            "(jax.make_mesh(...)).",
        )
    here = set(jax.local_devices(backend=mesh.devices.flat[0].platform))
    missing = [d for d in mesh.devices.flat if d not in here]
    if missing:
        raise Mistake(
            ValueError,
            f"mesh holds {missing[0]}, which this process does not have; measure runs on "
            "this process's own devices (jax.local_devices()). Plan others with "
            "st.preflight(..., target=...).",
        )
    return mesh


def _check_counts(steps: object, warmup: object) -> None:
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise Mistake(TypeError, f"{name} is {value!r}; expected an int >= {least}.")
        if value < least:
            raise Mistake(ValueError, f"{name} is {value}; expected an int >= {least}.")


def _fitting(thunk: Callable[[], Any], compiler: Here) -> Any:
    """`thunk()`, with the devices running out of memory said with the compiler's
    figure and what to try, not as a traceback."""
    try:
        return thunk()
    except (Mistake, jax.errors.JaxRuntimeError) as e:
        said = e.message if isinstance(e, Mistake) else str(e)
        if "RESOURCE_EXHAUSTED" not in said:
            raise
        figure = next(
            (line.strip() for line in said.splitlines() if "RESOURCE_EXHAUSTED" in line), said
        )
        raise Mistake(
            ValueError,
            f"the step does not fit on {compiler}: {figure[:600]}. Lower the batch, "
            "rematerialise its layers (jax.checkpoint), or shard it over more devices; "
            "st.preflight(...).what_would_fit(budget) says by how much.",
        ) from None


def _module_name(compiled: Any) -> str:
    """The compiled module's name, as a profile names its steps (``jit_step``): the
    module's own where jaxlib gives it (as `analysis.analyse` reads it), else its
    text's first line (printed at some cost)."""
    executable = compiled.runtime_executable()
    if executable is not None:
        return str(executable.hlo_modules()[0].name)
    first = compiled.as_text().split("\n", 1)[0]
    return first.removeprefix("HloModule ").split(",", 1)[0].strip()


class _Runs:
    """The compiled step and its arguments, placed and filled, to run; `jitted`, the
    same step through `jax.jit` itself, where calling the compiled one fails."""

    def __init__(
        self,
        compiled: Any,
        planned: Arguments,
        mesh: Mesh,
        fill: Fill | None,
        jitted: Callable[..., Any],
    ) -> None:
        leaves, _, donated = planned.leaves(mesh)
        self.compiled, self.leaves, self.donated = compiled, leaves, donated
        self.jitted: Callable[..., Any] | None = jitted
        self.given = _given(planned, len(leaves))
        self.fill = fill
        self.values = self._filled(range(len(leaves)), jax.random.key(0))
        self.ran = 0  # steps run so far: each refill's own key
        self.spent = False
        self.feeds = self.feed()

    def call(self) -> Any:
        """One step on the current arguments (dispatched, not waited for).

        jax 0.10.2's call of a step compiled ahead of time can ask for constants of
        its jaxpr as arguments it was not given (splash attention's masks under
        some remat policies on a TPU v5e: "Computation compiled for 43 inputs but
        called with 38"), where `jax.jit` runs the same step: then `jitted` runs
        it, from there on (the same program, compiled again by jit's own path)."""
        try:
            return self.compiled(*self.values)
        except TypeError as e:
            if self.jitted is None or "compiled for" not in str(e):
                raise
            self.compiled, self.jitted = self.jitted, None
            return self.compiled(*self.values)

    def _filled(self, which: Sequence[int], key: jax.Array) -> list[Any]:
        """The arguments at `which`: the user's arrays placed, the rest filled."""
        keys = jax.random.split(key, max(len(self.leaves), 1))
        out = []
        for i in which:
            leaf, given = self.leaves[i], self.given[i]
            if given is not None:
                out.append(jax.device_put(jnp.array(given, leaf.dtype, copy=True), leaf.sharding))
            elif self.fill is not None:
                out.append(
                    jax.device_put(_checked_fill(self.fill(keys[i], leaf), leaf, i), leaf.sharding)
                )
            else:
                out.append(_drawn(keys[i], leaf))
        return out

    def timed(self, warmup: int, steps: int) -> tuple[float, ...]:
        """Runs `warmup` then `steps` steps; the seconds each of the latter took.

        As a training loop runs them where it can: each step dispatched while the
        one before runs, its donated arguments the outputs that match them
        (shape, dtype and sharding, in order), each step's time from the one
        before's end to its own. Else one at a time, each donated argument
        filled anew before its step, outside its time."""
        feed = self.feeds
        if feed is None:
            return self._one_at_a_time(warmup, steps)
        jax.block_until_ready(self.values)
        ends, pending = [time.perf_counter()], []
        for _ in range(warmup + steps):
            out = self.call()
            for j, k in feed.items():
                self.values[j] = out[k]
            pending.append([x for k, x in enumerate(out) if k not in feed.values()])
            if len(pending) > 1:  # the step before ends while this one is queued
                jax.block_until_ready(pending.pop(0))
                ends.append(time.perf_counter())
        jax.block_until_ready(pending.pop())
        ends.append(time.perf_counter())
        times = [b - a for a, b in itertools.pairwise(ends)]
        self.ran += len(times)
        return tuple(times[warmup:])

    def feed(self) -> dict[int, int] | None:
        """Each donated argument's position -> the output that feeds it in the next
        step; None where one has none, or no output is left to wait on."""
        outs = jax.tree.leaves(self.compiled.out_info)
        feed: dict[int, int] = {}
        for j in self.donated:
            leaf = self.leaves[j]
            k = next(
                (
                    k
                    for k, o in enumerate(outs)
                    if k not in feed.values()
                    and (o.shape, o.dtype) == (leaf.shape, leaf.dtype)
                    and o.sharding.is_equivalent_to(leaf.sharding, len(leaf.shape))
                ),
                None,
            )
            if k is None:
                return None
            feed[j] = k
        return feed if len(feed) < len(outs) else None

    def _one_at_a_time(self, warmup: int, steps: int) -> tuple[float, ...]:
        """Each step run to completion alone, its donated arguments filled first."""
        times = []
        for i in range(warmup + steps):
            if self.spent:  # the step before consumed its donated arguments
                fresh = self._filled(self.donated, jax.random.key(self.ran))
                for j, value in zip(self.donated, fresh, strict=True):
                    self.values[j] = value
            jax.block_until_ready(self.values)
            start = time.perf_counter()
            out = self.call()
            jax.block_until_ready(out)
            took = time.perf_counter() - start
            self.ran += 1
            self.spent = bool(self.donated)
            if i >= warmup:
                times.append(took)
            del out
        return tuple(times)


def _checked_fill(value: Any, leaf: jax.ShapeDtypeStruct, i: int) -> Any:
    """`fill`'s value for leaf `i`, refused unless it has the leaf's shape and dtype."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape != leaf.shape or dtype != leaf.dtype:
        got = f"{dtype}{list(shape)}" if shape is not None else type(value).__name__
        raise Mistake(
            ValueError,
            f"fill returned {got} for leaf {i} of the arguments, a "
            f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}; return an array of the "
            "leaf's shape and dtype (fill(key, leaf) gets the leaf: use leaf.shape and "
            "leaf.dtype).",
        )
    return value


def _jitted(
    fn: Callable[..., Any], planned: Arguments, mesh: Mesh, rules: Rules | None
) -> Callable[..., Any]:
    """The step as `jax.jit` runs it, over the placed leaves, under the mesh and the
    rules it was traced under: the same module (``jit_step``) as preflight's."""
    _, treedef, donated = planned.leaves(mesh)
    jitted = jax.jit(flat_step(called(fn, planned, treedef)), donate_argnums=donated)

    def run(*leaves: Any) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.set_mesh(mesh))
            if rules is not None:
                stack.enter_context(logical_axis_rules(rules))
            return jitted(*leaves)

    return run


def _given(planned: Arguments, count: int) -> list[Any]:
    """Each leaf's value where the caller gave one (an array, a Python or numpy
    scalar), None where a `jax.ShapeDtypeStruct` is to be filled, in the placed
    leaves' order."""
    dynamic = tuple(None if i in planned.static else arg for i, arg in enumerate(planned.args))
    leaves = jax.tree.leaves(dynamic)
    if len(leaves) != count:
        raise Mistake(
            ValueError,
            f"the arguments hold {len(leaves)} leaves where the step was planned with "
            f"{count}; pass each argument as a tree of arrays or jax.ShapeDtypeStructs "
            "(boxes over them), as preflight takes them.",
        )
    return [None if isinstance(x, jax.ShapeDtypeStruct) else x for x in leaves]


def _drawn(key: jax.Array, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    """A leaf of the default fill, made on its devices."""
    return _maker(leaf.shape, leaf.dtype, leaf.sharding)(key)


@functools.cache
def _maker(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Callable[[jax.Array], jax.Array]:
    """The default fill of one kind of leaf, compiled once: normal floats of scale
    `SCALE`, zeros else."""

    def make(key: jax.Array) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.floating):
            return (SCALE * jax.random.normal(key, shape)).astype(dtype)
        return jnp.zeros(shape, dtype)

    return jax.jit(make, out_shardings=sharding)
