"""The whole step, on hardware you don't have: `preflight` asks the compiler.

A `Plan` counts the arrays the shardings place. A training step needs more:
activations and the compiler's temporaries are most of its memory. The
compiler knows them, and it needs no accelerator to say: a step whose
shardings live on a `jax.sharding.AbstractMesh` compiles on as many fake CPU
devices, in this process when its CPU backend has enough of them, else in a
fresh subprocess that gets the traced step through `jax.export` (the user's
code is not imported there). The compiled step's memory analysis and its HLO
(collectives, with the trip counts of loops) become a `StepPlan`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from spmdtree._src.boxes import dtype_of, shape_of
from spmdtree._src.errors import Mistake, public
from spmdtree._src.plan import Plan, planned_walk
from spmdtree._src.resolve import (
    Resolution,
    check_mesh,
    named_sharding,
)
from spmdtree._src.rules import (
    AnyMesh,
    PyTree,
    Rules,
    logical_axis_rules,
)
from spmdtree._src.step.hardware import Hardware, StepTime, step_time
from spmdtree._src.step.hlo import Collective, overstated_bytes, read_step
from spmdtree._src.text import short_value, size_text, step_table

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a compiled step needs on one device, and what it moves.

    The memory figures come from the compiler's own analysis of the step as
    compiled for `mesh`: on a real `Mesh`, the real compiler's numbers; on an
    `AbstractMesh` (compiled on CPU devices laid out like it), an estimate of
    an accelerator's (see `preflight`).

    Attributes:
        argument_bytes: the arguments' bytes on one device.
        output_bytes: the outputs' bytes on one device.
        alias_bytes: bytes of outputs that reuse a donated argument's buffer.
        temp_bytes: the compiler's temporaries (activations among them).
        code_bytes: the generated code (0 on CPU).
        collectives: one `Collective` per kind and set of mesh axes that the
            step runs, as an accelerator runs it (on CPU, an all-reduce of which
            each device only takes its slice is the reduce-scatter it stands for).
        inputs: the `Plan` of the arguments.
        backend: where it was compiled: ``"cpu"`` for fake devices, else the
            platform of the mesh's devices.
        mesh: the mesh planned for, as given.
        compile_seconds: how long lowering and compiling took.
        flags: sentences: the inputs' plan flags first (a dimension left
            unsharded), then what the figures do not cover (a loop whose trip
            count the compiler does not know counts once; reductions read as
            reduce-scatters), then the warnings raised while tracing.
        flops: floating-point operations per device per step: every dot and
            convolution, times its loops' trip counts; elementwise work left
            out (new in 0.3).
        overstated_bytes: a bound on how much of the peak a CPU compile
            overstates by holding whole reductions an accelerator holds as
            shards (new in 0.3; 0 where there are none, and on accelerators).

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
        >>> x = st.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
        >>> step = st.preflight(lambda x: jnp.sum(x.value * 2), x, mesh=mesh)
        >>> step.argument_bytes, step.output_bytes  # half of 128 B each, and a scalar
        (64, 4)
        >>> step.peak_bytes == step.argument_bytes + step.output_bytes + step.temp_bytes
        True
        >>> [c.kind for c in step.collectives]
        ['all-reduce']
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    collectives: tuple[Collective, ...]
    inputs: Plan
    backend: str
    mesh: AnyMesh
    compile_seconds: float
    flags: tuple[str, ...] = ()
    flops: int = 0
    overstated_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries: the step's peak on one device."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @public
    def fits(self, budget_bytes: int) -> bool:
        """Whether the step's peak on one device fits in `budget_bytes`.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
            >>> step = st.preflight(jnp.sin, jax.ShapeDtypeStruct((256,), jnp.float32), mesh=mesh)
            >>> step.fits(step.peak_bytes), step.fits(step.peak_bytes - 1)
            (True, False)
        """
        if not isinstance(budget_bytes, (int, np.integer)) or isinstance(budget_bytes, bool):
            raise Mistake(TypeError, f"budget_bytes is {budget_bytes!r}; expected an int of bytes.")
        return self.peak_bytes <= budget_bytes

    @public
    def time(self, hardware: Hardware, *, devices_per_node: int | None = None) -> StepTime:
        """A roofline bound on this step on `hardware`: its FLOPs at the peak, its
        collectives at the links' bandwidth (new in 0.3).

        Devices sit on nodes by their position in the mesh's row-major device
        order (position // devices_per_node); a group that spans nodes is
        timed as hierarchical algorithms run it (docs/planning.md, "Hardware
        and time"). Not a prediction: perfect overlap, peak FLOPs.

        Args:
            hardware: a `Hardware` (e.g. ``st.hardware("h100")``).
            devices_per_node: overrides the hardware's (the slice size of a
                multi-slice TPU job; 1 puts every device on its own node).

        Returns:
            The `StepTime`.

        Raises:
            ValueError: for `devices_per_node` < 1, or a collective that needs
                a link kind the hardware does not have.

        Example:
            >>> import jax, jax.numpy as jnp, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
            >>> w = st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), (None, None))
            >>> x = st.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("data", None))
            >>> step = st.preflight(lambda w, x: jnp.sum(x.value @ w.value), w, x, mesh=mesh)
            >>> t = step.time(st.hardware("h100"))
            >>> t.compute_seconds == step.flops / 989e12
            True
            >>> t.bound_seconds == max(t.compute_seconds, t.comm_seconds)
            True
        """
        return step_time(self.collectives, self.flops, self.mesh.shape, hardware, devices_per_node)

    def __str__(self) -> str:
        return step_table(self)


@public
def preflight(
    fn: Callable[..., Any],
    *args: Any,
    mesh: AnyMesh,
    rules: Rules | None = None,
    params: PyTree = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    out_shardings: PyTree = None,
) -> StepPlan:
    """Compiles a step for `mesh` without running it: its memory and traffic per device.

    The arguments are trees as `fn` takes them: boxes over arrays or
    `jax.ShapeDtypeStruct`s, whose shardings are exactly those of
    ``to_sharding(arg, mesh, rules, params=params)``, and plain leaves (a
    `NamedSharding` they carry is kept; without one they are replicated).
    Nothing is allocated. The step is traced as it runs: under the mesh
    (`jax.set_mesh`) and, if `rules` are given, under those rules
    (`logical_axis_rules`), so its `with_logical_constraint` calls resolve
    through them. A `Mesh` compiles for its own devices (on an
    accelerator, with the real compiler). A `jax.sharding.AbstractMesh`
    compiles on as many CPU devices laid out like it: in this process when
    its CPU backend has enough devices, else in a fresh subprocess given that
    many, which receives the traced step through `jax.export` (a 2,048-chip
    mesh works from a process with one device).

    Accuracy: on a real `Mesh` the figures are the compiler's own, and
    arguments + outputs - aliased + temporaries equalled a real H200's peak
    within 1.2 KB in five configurations. The CPU compile of the same step
    is an estimate of an accelerator's, so far always from above: +0.7% to
    +4.3% of the H200's peak with jax 0.11.2, +2.2% to +16.4% with jax 0.10.2.

    Args:
        fn: the step, e.g. ``train_step(params, state, batch)``.
        *args: its arguments.
        mesh: a `Mesh` or `jax.sharding.AbstractMesh`.
        rules: rules for logical boxes without their own, and the rules in
            effect while the step is traced; None: the rules context.
        params: the boxed params the arguments' optimizer states were derived
            from (as for `to_sharding`).
        donate_argnums: arguments whose buffers the outputs may reuse, as for
            `jax.jit`.
        static_argnums: arguments passed through as Python values, as for
            `jax.jit`.
        out_shardings: a `PartitionSpec` or `NamedSharding` (its spec is
            used) per output, or a tree of them that is a prefix of the
            outputs; None lets the compiler choose.

    Returns:
        The `StepPlan`.

    Raises:
        ValueError: for boxes that cannot resolve (as `to_sharding` says), a
            step that does not trace (with JAX's message), or a subprocess
            that ran out of memory.
        TypeError: for a mesh or argument numbers of the wrong kind.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
        >>> w = st.Partitioned(jax.ShapeDtypeStruct((64, 64), jnp.float32), (None, None))
        >>> batch = st.LogicallyPartitioned(jax.ShapeDtypeStruct((32, 64), jnp.float32), ("batch", None))
        >>> def step(w, x):
        ...     grad = jax.grad(lambda w: jnp.mean((x.value @ w.value) ** 2))(w)
        ...     return st.replace_boxed(w, w.value - 0.1 * grad.value)
        >>> plan = st.preflight(step, w, batch, mesh=mesh, rules=[("batch", "data")], donate_argnums=0)
        >>> plan.alias_bytes == 64 * 64 * 4  # the new weights reuse the donated buffer
        True
        >>> plan.collectives[0].kind, plan.collectives[0].bytes  # the gradient's all-reduce
        ('all-reduce', 16384)
    """
    check_mesh(mesh)
    static, donated = _positions(static_argnums, donate_argnums, len(args))
    dynamic = tuple(None if i in static else arg for i, arg in enumerate(args))
    inputs, walk = planned_walk(
        dynamic, mesh, rules, params=params, large=1 << 20, lenient=False, argument="args"
    )
    target = _compile_mesh(mesh)
    flat, treedef, flat_donated = _abstract_args(walk, target or mesh, donated)

    def call(*leaves: Any) -> Any:
        full = treedef.unflatten(leaves)
        return fn(*(args[i] if i in static else full[i] for i in range(len(args))))

    def step(*leaves: Any) -> list[Any]:
        return jax.tree.leaves(call(*leaves))

    signature = _signature(args, static)
    # The step is traced as it runs: under the mesh and, if given, the rules; what
    # it warns of while tracing becomes flags.
    with _tracing(rules) as warned:
        out = None
        if out_shardings is not None:
            outputs = _outputs(call, flat, mesh, target, signature)
            out = _out_shardings(out_shardings, outputs, target or mesh)
        jitted = jax.jit(step, donate_argnums=flat_donated, out_shardings=out)
        if target is None:
            found = _in_subprocess(jitted, flat, flat_donated, mesh, signature)
        else:
            found = _compile(jitted, flat, target, signature)
    return _step_plan(found, inputs, mesh, warned)


def _positions(
    static_argnums: int | Sequence[int], donate_argnums: int | Sequence[int], count: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The static and the donated argument positions, checked."""
    static = argnums(static_argnums, count, "static_argnums")
    donated = argnums(donate_argnums, count, "donate_argnums")
    if set(static) & set(donated):
        raise Mistake(
            ValueError,
            f"argument {sorted(set(static) & set(donated))[0]} is both static and donated; "
            "a static argument has no buffer to donate. Drop it from one of them.",
        )
    return static, donated


def _abstract_args(
    walk: Any, mesh: AnyMesh, donated: tuple[int, ...]
) -> tuple[list[Any], Any, tuple[int, ...]]:
    """The arguments as placed `ShapeDtypeStruct` leaves on `mesh`, their tree, and the
    donated leaves' positions."""

    def abstract(value: ArrayLike, res: Resolution) -> jax.ShapeDtypeStruct:
        sharding = named_sharding(mesh, res.spec)
        return jax.ShapeDtypeStruct(shape_of(value), dtype_of(value), sharding=sharding)

    abstract_args = walk.map(abstract, keep_boxes=True)
    for i, arg in enumerate(abstract_args):
        odd = [x for x in jax.tree.leaves(arg) if not isinstance(x, jax.ShapeDtypeStruct)]
        if odd:
            raise Mistake(
                TypeError,
                f"args[{i}] holds {short_value(odd[0])}, which is not an array; pass it "
                f"as a static argument (static_argnums={i}) or leave it out of the "
                "arguments.",
            )
    flat, treedef = jax.tree.flatten(abstract_args)
    counts = [len(jax.tree.leaves(arg)) for arg in abstract_args]
    starts = np.cumsum([0, *counts])
    flat_donated = tuple(j for i in donated for j in range(starts[i], starts[i + 1]))
    return flat, cast(Any, treedef), flat_donated


@contextlib.contextmanager
def _tracing(rules: Rules | None) -> Iterator[list[str]]:
    """Under `rules` (if given), recording every warning raised as a sentence."""
    warned: list[str] = []
    with contextlib.ExitStack() as stack:
        if rules is not None:
            stack.enter_context(logical_axis_rules(rules))
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        yield warned
        warned += [f"{w.category.__name__} while tracing: {w.message}" for w in caught]


def _step_plan(found: dict[str, Any], inputs: Plan, mesh: AnyMesh, warned: list[str]) -> StepPlan:
    """The `StepPlan` of an analysis; its flags: the inputs' first, then the step's."""
    flags = [f"{row.path}: {flag}" for row in inputs.rows for flag in row.flags]
    flags += [*found["flags"], *warned]
    return StepPlan(
        argument_bytes=found["argument"],
        output_bytes=found["output"],
        alias_bytes=found["alias"],
        temp_bytes=found["temp"],
        code_bytes=found["code"],
        collectives=tuple(
            Collective(kind, n, size, tuple(axes), group)
            for kind, n, size, axes, group in found["collectives"]
        ),
        inputs=inputs,
        backend=found["backend"],
        mesh=mesh,
        compile_seconds=found["seconds"],
        flags=tuple(dict.fromkeys(flags)),
        flops=found["flops"],
        overstated_bytes=found["overstated"],
    )


def argnums(value: object, count: int, what: str) -> tuple[int, ...]:
    """`value` (an int or ints, negatives from the end, as `jax.jit` takes them) as
    non-negative argument positions."""
    numbers = (value,) if isinstance(value, int) else value
    if isinstance(numbers, (str, bytes)) or not isinstance(numbers, Sequence):
        raise Mistake(TypeError, f"{what} is {value!r}; expected an int or a sequence of ints.")
    out = []
    for n in numbers:
        if not isinstance(n, int) or isinstance(n, bool):
            raise Mistake(TypeError, f"{what} holds {n!r}; expected ints.")
        if not -count <= n < count:
            raise Mistake(
                ValueError,
                f"{what} holds {n}, but the step was given {count} arguments "
                f"(positions {-count} to {count - 1}).",
            )
        out.append(n % count)
    return tuple(sorted(set(out)))


def _compile_mesh(mesh: AnyMesh) -> Mesh | None:
    """The mesh to compile on in this process: `mesh` itself if it has devices, else
    this process's CPU devices laid out like it, or None if there are too few."""
    if isinstance(mesh, Mesh):
        return mesh
    sizes = tuple(mesh.shape.values())
    cpus = jax.devices("cpu")
    if len(cpus) < math.prod(sizes):
        return None
    devices = np.array(cpus[: math.prod(sizes)]).reshape(sizes)
    return Mesh(devices, tuple(mesh.axis_names), axis_types=tuple(mesh.axis_types))


def _outputs(
    call: Callable[..., Any], flat: list[Any], mesh: AnyMesh, target: Mesh | None, signature: str
) -> Any:
    """The step's outputs as a tree of `ShapeDtypeStruct`s (traced under the mesh)."""
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    context = (
        jax.set_mesh(target) if target is not None else jax.sharding.use_abstract_mesh(abstract)
    )
    with context:
        return _traced(lambda: jax.eval_shape(call, *flat), signature)


def _out_shardings(prefix: PyTree, outputs: Any, mesh: AnyMesh) -> list[NamedSharding | None]:
    """`prefix` (specs or shardings, a prefix of the `outputs` tree) as one sharding per
    output leaf, on `mesh`."""
    is_spec = lambda x: x is None or isinstance(x, (PartitionSpec, NamedSharding))  # noqa: E731
    specs, spec_def = jax.tree.flatten(prefix, is_leaf=is_spec)
    try:
        subtrees = cast(Any, spec_def).flatten_up_to(outputs)
    except (ValueError, TypeError) as e:
        shapes = jax.tree.map(short_value, outputs)
        raise Mistake(
            ValueError,
            f"out_shardings is {short_value(prefix)}, which is not a prefix of the step's "
            f"outputs {shapes} ({e}). Give a PartitionSpec per output, in a tree shaped "
            "like the outputs (or one for all).",
        ) from None
    out: list[NamedSharding | None] = []
    for spec, subtree in zip(specs, subtrees, strict=True):
        if not is_spec(spec):
            raise Mistake(
                TypeError,
                f"out_shardings holds {short_value(spec)}; expected a PartitionSpec, a "
                "NamedSharding or None per output.",
            )
        spec = spec.spec if isinstance(spec, NamedSharding) else spec
        for leaf in jax.tree.leaves(subtree):
            if spec is not None and len(spec) > len(leaf.shape):
                raise Mistake(
                    ValueError,
                    f"out_shardings gives {spec} to an output of {short_value(leaf)}, which "
                    f"has {len(leaf.shape)} dimensions. Give it a spec of at most that many.",
                )
        out += [None if spec is None else named_sharding(mesh, spec)] * len(
            jax.tree.leaves(subtree)
        )
    return out


def _signature(args: tuple[Any, ...], static: tuple[int, ...]) -> str:
    """``args[0]: 12 arrays, args[1]: f32[8,1024]``: what the step was given."""
    said = []
    for i, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        what = (
            "static"
            if i in static
            else short_value(leaves[0])
            if len(leaves) == 1
            else f"{len(leaves)} arrays"
        )
        said.append(f"args[{i}]: {what}")
    return ", ".join(said)


def _traced(thunk: Callable[[], T], signature: str) -> T:
    """``thunk()``, with a failure to trace said as preflight's, with JAX's message."""
    try:
        return thunk()
    except Mistake:
        raise
    except Exception as e:
        raise Mistake(
            TypeError if isinstance(e, TypeError) else ValueError,
            f"the step does not trace with its arguments ({signature}): {type(e).__name__}: {e}",
        ) from None


def _compile(
    jitted: jax.stages.Wrapped, flat: list[Any], mesh: Mesh, signature: str
) -> dict[str, Any]:
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = _traced(lambda: jitted.lower(*flat), signature)
    compiled = lowered.compile(cpu_options(mesh))
    found = analyse(compiled, mesh)
    found["seconds"] = time.perf_counter() - start
    found["backend"] = mesh.devices.flat[0].platform
    return found


class Exported(BaseException):
    """Raised out of `preflight` by `_in_subprocess` when `DEFER` asks for the
    payload instead of the compile (advise runs the children itself). A
    BaseException, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, payload: bytes, devices: int, caught: list[Any], seconds: float) -> None:
        super().__init__("exported")
        self.payload, self.devices, self.caught, self.seconds = payload, devices, caught, seconds


@dataclasses.dataclass
class Deferral:
    """How `_in_subprocess` runs under `DEFER`: without `found`, export the step and
    raise `Exported`; with it (what the child said), return it, re-raising the
    warnings that tracing gave."""

    found: dict[str, Any] | None = None
    caught: list[Any] = dataclasses.field(default_factory=list)


#: None: `_in_subprocess` runs its child; a `Deferral`: see there.
DEFER: contextvars.ContextVar[Deferral | None] = contextvars.ContextVar("defer", default=None)


def _in_subprocess(
    jitted: jax.stages.Wrapped,
    flat: list[Any],
    donated: tuple[int, ...],
    mesh: AnyMesh,
    signature: str,
) -> dict[str, Any]:
    """Compiled in a fresh process with as many CPU devices as `mesh` has."""
    start = time.perf_counter()
    deferral = DEFER.get()
    if deferral is not None and deferral.found is not None:
        for caught in deferral.caught:
            warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno)
        return dict(deferral.found)
    devices = math.prod(mesh.shape.values())
    if deferral is None:
        found = _run_child(_export(jitted, flat, donated, mesh, signature), devices)
        found["seconds"] = time.perf_counter() - start
        return found
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = _export(jitted, flat, donated, mesh, signature)
    raise Exported(payload, devices, caught, time.perf_counter() - start)


def _export(
    jitted: jax.stages.Wrapped,
    flat: list[Any],
    donated: tuple[int, ...],
    mesh: AnyMesh,
    signature: str,
) -> bytes:
    """The payload a compile subprocess reads: the traced step, serialized by
    `jax.export`, with the mesh's shape and axis types."""
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    with jax.sharding.use_abstract_mesh(abstract):
        exported = _traced(lambda: jax.export.export(jitted, platforms=["cpu"])(*flat), signature)
    payload = {
        "module": exported.serialize(),
        "shape": tuple(mesh.shape.items()),
        "types": tuple(mesh.axis_types),
        "donated": donated,
    }
    return pickle.dumps(payload)


#: How long a compile subprocess may take before it is stopped.
CHILD_SECONDS = 3600


def _run_child(payload: bytes, devices: int) -> dict[str, Any]:
    package_root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices}".strip(),
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    }
    code = "from spmdtree._src.step.preflight import child; child()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            input=payload,
            capture_output=True,
            env=env,
            timeout=CHILD_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise Mistake(
            ValueError,
            f"compiling for {devices} CPU devices in a subprocess took over "
            f"{CHILD_SECONDS} s and was stopped.",
        ) from None
    if done.returncode == 0:
        return dict(json.loads(done.stdout))
    said = done.stderr.decode(errors="replace").strip().splitlines()
    memory = done.returncode < 0 or any(
        word in done.stderr
        for word in (
            b"MemoryError",
            b"RESOURCE_EXHAUSTED",
            b"bad_alloc",
            b"Cannot allocate memory",
            b"failed to map segment",  # no address space left to load a library
        )
    )
    if memory:
        raise Mistake(
            ValueError,
            f"compiling for {devices} CPU devices in a subprocess ran out of memory "
            f"(exit {done.returncode}); this machine cannot host a mesh of that size. "
            "Plan on a smaller mesh, or on a machine with more memory.",
        )
    raise Mistake(
        ValueError,
        f"compiling for {devices} CPU devices in a subprocess failed: " + " / ".join(said[-3:]),
    )


def child() -> None:
    """The compile subprocess: reads the payload on stdin, prints the analysis as JSON."""
    payload = pickle.loads(sys.stdin.buffer.read())
    sizes = tuple(size for _, size in payload["shape"])
    jax.config.update("jax_num_cpu_devices", math.prod(sizes))
    exported = jax.export.deserialize(bytearray(payload["module"]))
    devices = np.array(jax.devices("cpu")[: math.prod(sizes)]).reshape(sizes)
    names = tuple(name for name, _ in payload["shape"])
    mesh = Mesh(devices, names, axis_types=payload["types"])
    shardings = exported.in_shardings_jax(mesh)
    args = [
        jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
        for aval, sharding in zip(exported.in_avals, shardings, strict=True)
    ]
    jitted = jax.jit(exported.call, in_shardings=shardings, donate_argnums=payload["donated"])
    with jax.set_mesh(mesh):
        compiled = jitted.lower(*args).compile(cpu_options(mesh))
    found = analyse(compiled, mesh)
    found["backend"] = "cpu"
    json.dump(found, sys.stdout)


def cpu_options(mesh: Mesh) -> dict[str, Any]:
    """Compiler options for fake CPU devices: no costly machine-code optimisation,
    which halves the compile time and changes no buffer (only how fast the
    code would run); none for a real accelerator."""
    if mesh.devices.flat[0].platform != "cpu":
        return {}
    return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def analyse(compiled: jax.stages.Compiled, mesh: Mesh) -> dict[str, Any]:
    """A compiled step's memory per device, its collectives and flops per step.

    On CPU devices, an all-reduce whose every use takes one device's slice is
    counted as the reduce-scatter an accelerator runs, and the whole results
    such all-reduces keep live bound how much the peak may overstate.

    Raises:
        Mistake: if the backend reports no memory analysis or no HLO text.
    """
    memory, text = compiled.memory_analysis(), compiled.as_text()
    if memory is None or text is None:
        raise Mistake(
            ValueError,
            "the backend this step compiled for reports no memory analysis (or no HLO "
            "text) for it, which preflight reads. Preflight on an AbstractMesh, which "
            "compiles for CPU devices.",
        )
    executable = compiled.runtime_executable()
    module = executable.hlo_modules()[0] if executable is not None else text
    read = read_step(module, tuple(mesh.shape.items()), platform=mesh.devices.flat[0].platform)
    temp = int(memory.temp_size_in_bytes)
    overstated = overstated_bytes(read.held_bytes, temp)
    flags = [*read.flags] + (
        [
            f"peak may be overstated by up to {size_text(overstated)}: the CPU compile holds "
            "whole reductions an accelerator holds as reduce-scattered shards"
        ]
        if overstated
        else []
    )
    return {
        "argument": int(memory.argument_size_in_bytes),
        "output": int(memory.output_size_in_bytes),
        "alias": int(memory.alias_size_in_bytes),
        "temp": temp,
        "code": int(memory.generated_code_size_in_bytes),
        "collectives": read.collectives,
        "flags": flags,
        "flops": read.flops,
        "overstated": overstated,
    }
