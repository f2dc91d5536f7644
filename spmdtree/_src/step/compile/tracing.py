"""Tracing a step: its arguments planned and placed, then lowered here or exported.

The first two of preflight's stages, each a frozen record: `Arguments` (the
plan of the arguments and their abstract, placed leaves) and `Traced` (the
step at one of two typed stages: `Lowered` for a mesh of this process's
devices, or `Exported` by `jax.export` for a compile subprocess, with the
warnings tracing raised, and what its jaxpr says of its flash-attention
kernels' masks, which the compiled module does not: `kernel_masks`).
`advise` calls them itself: it plans every candidate once, and rejects one
whose arrays alone exceed the budget before tracing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import pickle
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import AbstractDevice, AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from spmdtree._src.boxes import dtype_of, shape_of
from spmdtree._src.errors import Mistake
from spmdtree._src.plan import Plan, planned_walk
from spmdtree._src.resolve import Layout, Resolution, layout_of, named_sharding
from spmdtree._src.rules import (
    AnyMesh,
    PyTree,
    Rules,
    logical_axis_rules,
    names_seen,
    rules_or_context,
)
from spmdtree._src.specs import RuleProblem, rule_problems
from spmdtree._src.step.hlo import Flash, Kept, flash_of, innermost
from spmdtree._src.text import short_value

T = TypeVar("T")


class Site(Protocol):
    """What tracing asks of where a step compiles (`compilers.Compiler` is one):
    the mesh of this process's devices to lower for, or None to export for the
    `platform`'s compiler."""

    @property
    def here(self) -> Mesh | None: ...

    @property
    def platform(self) -> str: ...

    @property
    def device(self) -> AbstractDevice | None: ...

    def resident(self, mesh: AnyMesh) -> Mesh | None:
        """Its devices in this process, laid out like `mesh`, for a step whose
        primitives need devices to lower (cuDNN's attention and its
        `custom_partitioning`); None where it has none here (new in 0.6)."""
        ...


@dataclasses.dataclass(frozen=True)
class Arguments:
    """A step's arguments, planned: their `Plan`, and how to lay them out as
    placed `jax.ShapeDtypeStruct` leaves on a mesh."""

    args: tuple[Any, ...]
    plan: Plan
    walk: Any = dataclasses.field(repr=False, compare=False)
    static: tuple[int, ...]
    donated: tuple[int, ...]

    def leaves(self, mesh: AnyMesh) -> tuple[list[Any], Any, tuple[int, ...]]:
        """The arguments as placed leaves on `mesh`, their tree, and the donated
        leaves' positions."""
        return _abstract_args(self.walk, mesh, self.donated)

    @property
    def signature(self) -> str:
        """``args[0]: 12 arrays, args[1]: f32[8,1024]``: what the step was given."""
        said = []
        for i, arg in enumerate(self.args):
            leaves = jax.tree.leaves(arg)
            what = (
                "static"
                if i in self.static
                else short_value(leaves[0])
                if len(leaves) == 1
                else f"{len(leaves)} arrays"
            )
            said.append(f"args[{i}]: {what}")
        return ", ".join(said)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A step lowered for a mesh of this process's devices, to compile here: the
    compiler's own mesh, or (`mesh`) a target's devices resident here (0.6)."""

    lowered: jax.stages.Lowered = dataclasses.field(repr=False, compare=False)
    mesh: Mesh | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Exported:
    """A step exported for a compile subprocess: the `jax.export` module, the
    mesh's shape and axis types and the donated leaves, pickled (`payload`)."""

    payload: bytes = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class Traced:
    """A step traced for a mesh: `Lowered` here, or `Exported` for a child.

    Attributes:
        arguments: the planned `Arguments`.
        mesh: the mesh planned for, as given.
        stage: the step `Lowered` for this process's devices, or `Exported`.
        warned: the warnings raised while tracing, as sentences.
        seconds: how long tracing took.
        rule_problems: what `validate_rules` finds wrong with single rules of
            the rules traced under, on `mesh`, over the arguments, a name the
            step's constraints met while tracing counting as used.
        masks: how many blocks the masks of the step's flash-attention kernels
            keep, by kernel name (`kernel_masks`; new in 0.7).
    """

    arguments: Arguments
    mesh: AnyMesh
    stage: Lowered | Exported
    warned: tuple[str, ...]
    seconds: float
    rule_problems: tuple[RuleProblem, ...] = ()
    masks: Mapping[str, Kept] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def devices(self) -> int:
        """How many devices the step is compiled for."""
        return math.prod(self.mesh.shape.values())

    @property
    def digest(self) -> str | None:
        """The exported step's SHA-256, equal for equal steps (what a child would be
        given twice); a step lowered on a target's devices resident here, its
        module's (0.6); None where it was lowered for the compiler's own mesh."""
        if isinstance(self.stage, Exported):
            return hashlib.sha256(self.stage.payload).hexdigest()
        if self.stage.mesh is not None:
            return hashlib.sha256(self.stage.lowered.as_text().encode()).hexdigest()
        return None


def arguments(
    args: tuple[Any, ...],
    mesh: AnyMesh,
    rules: Rules | None,
    *,
    params: PyTree,
    donate_argnums: int | Sequence[int],
    static_argnums: int | Sequence[int],
) -> Arguments:
    """The first stage: the arguments planned on `mesh`, their positions checked."""
    static, donated = _positions(static_argnums, donate_argnums, len(args))
    dynamic = tuple(None if i in static else arg for i, arg in enumerate(args))
    plan, walk = planned_walk(
        dynamic, mesh, rules, params=params, large=1 << 20, lenient=False, argument="args"
    )
    return Arguments(tuple(args), plan, walk, static, donated)


def trace(
    fn: Callable[..., Any],
    planned: Arguments,
    mesh: AnyMesh,
    rules: Rules | None,
    *,
    out_shardings: PyTree = None,
    compiler: Site,
) -> Traced:
    """The second stage: `fn` traced as it runs (under the mesh and, if given, the
    rules), lowered for the `compiler`'s mesh here, or else exported for its platform."""
    start = time.perf_counter()
    try:
        staged = _stage(fn, planned, mesh, rules, out_shardings, compiler)
    except Mistake as first:
        # A step whose primitives need devices to lower (cuDNN's attention) cannot be
        # exported from an abstract mesh: it is lowered on the target's devices here,
        # where its compiler has them (XLA GPU's topology), as the job lowers it.
        if _needs_devices(fn, planned, mesh, rules):
            resident = compiler.resident(mesh)
            if resident is None:
                raise Mistake(
                    ValueError,
                    f"the step holds primitives that need devices to lower (cuDNN's fused "
                    f"attention: jax.nn.dot_product_attention(implementation='cudnn')), which "
                    f"{compiler} cannot compile. Pass a GPU target= (XLA GPU compiles it "
                    "without a device), or write it with implementation='xla'.",
                ) from first
            staged = _stage(fn, planned, resident, rules, out_shardings, compiler, resident)
            return _done(planned, mesh, rules, staged, start)
        # Traced first on the mesh as given, which a `shard_map` over it must match;
        # again for the target's device only where that fails (jax 0.12: a Pallas
        # kernel's lowering asks the context mesh which chip it is for). Where both
        # fail, the first error, and the step's own exception under it, stand.
        if compiler.device is None:
            raise
        for_device = _for_device(mesh, compiler.device)
        try:
            staged = _stage(fn, planned, for_device, rules, out_shardings, compiler)
        except Mistake:
            raise first from first.__cause__
    return _done(planned, mesh, rules, staged, start)


@dataclasses.dataclass(frozen=True)
class _Staged:
    """What `_stage` gives: the stage, the warnings tracing raised, the logical names
    the step's constraints met, and its flash kernels' masks."""

    stage: Lowered | Exported
    warned: list[str]
    constrained: set[str]
    masks: dict[str, Kept]


def _done(
    planned: Arguments, mesh: AnyMesh, rules: Rules | None, staged: _Staged, start: float
) -> Traced:
    """The `Traced` of a stage, timed from `start`, with the rules' problems."""
    seconds = time.perf_counter() - start
    args, static = planned.args, planned.static
    dynamic = tuple(None if i in static else arg for i, arg in enumerate(args))
    problems = rule_problems(rules_or_context(rules), mesh, dynamic, staged.constrained)
    warned = tuple(staged.warned)
    return Traced(planned, mesh, staged.stage, warned, seconds, problems, staged.masks)


def _stage(
    fn: Callable[..., Any],
    planned: Arguments,
    traced_for: AnyMesh,
    rules: Rules | None,
    out_shardings: PyTree,
    compiler: Site,
    resident: Mesh | None = None,
) -> _Staged:
    """`fn` lowered here (for the compiler's mesh, or the `resident` devices of a
    target), or exported, traced on `traced_for`; with the warnings raised, the
    logical names its constraints met, and its flash kernels' masks (its jaxpr
    read once, before it is lowered or exported: `jax.export` reuses the trace)."""
    here = resident or compiler.here
    flat, treedef, flat_donated = planned.leaves(here or traced_for)
    call = called(fn, planned, treedef)
    step = flat_step(call)
    signature = planned.signature
    with _tracing(rules) as (warned, constrained), _under(traced_for, here):
        out = None
        if out_shardings is not None:
            outputs = _traced(lambda: jax.eval_shape(call, *flat), signature)
            out = _out_shardings(out_shardings, outputs, here or traced_for)
        jitted = jax.jit(step, donate_argnums=flat_donated, out_shardings=out)
        traced = _traced(lambda: jitted.trace(*flat), signature)
        stage: Lowered | Exported
        if here is not None:
            stage = Lowered(_traced(traced.lower, signature), resident)
        else:
            export = jax.export.export(jitted, platforms=[compiler.platform], disabled_checks=ANY)
            exported = _traced(lambda: export(*flat), signature)
            stage = Exported(_payload(exported, traced_for, flat_donated))
    return _Staged(stage, warned, constrained, kernel_masks(traced.jaxpr))


#: The export's safety checks turned off: custom calls with no compatibility
#: guarantee across jax versions (a Pallas Triton kernel's, cuDNN's attention)
#: serialize too. The payload is read at once by a child running this same jax,
#: where no such guarantee is needed. (jax's export reads the target "ALL" as every
#: custom call.)
ANY = [jax.export.DisabledSafetyCheck.custom_call("ALL")]


def _payload(exported: jax.export.Exported, mesh: AnyMesh, donated: tuple[int, ...]) -> bytes:
    """What a compile subprocess reads: the traced step, serialized by
    `jax.export`, with the mesh's shape and axis types and the donated leaves."""
    return pickle.dumps(
        {
            "module": exported.serialize(),
            "shape": tuple(mesh.shape.items()),
            "types": tuple(mesh.axis_types),
            "donated": donated,
        }
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
        sharding = named_sharding(mesh, res.layout)
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
def _tracing(rules: Rules | None) -> Iterator[tuple[list[str], set[str]]]:
    """Under `rules` (if given), recording every warning raised as a sentence, and
    the logical names the step's constraints meet.

    A function JAX traced before with the same shapes and context (a
    `jax.checkpoint` or `jax.jit` of the user's, reused) is not traced again,
    so the names of its constraints are met only the first time.
    """
    warned: list[str] = []
    with contextlib.ExitStack() as stack:
        if rules is not None:
            stack.enter_context(logical_axis_rules(rules))
        constrained = stack.enter_context(names_seen())
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        yield warned, constrained
        warned += [f"{w.category.__name__} while tracing: {w.message}" for w in caught]


def called(fn: Callable[..., Any], planned: Arguments, treedef: Any) -> Callable[..., Any]:
    """`fn` as a function of the placed leaves: the static arguments passed as given."""
    args, static = planned.args, planned.static

    def call(*leaves: Any) -> Any:
        full = treedef.unflatten(leaves)
        return fn(*(args[i] if i in static else full[i] for i in range(len(args))))

    return call


def flat_step(call: Callable[..., Any]) -> Callable[..., list[Any]]:
    """`call` (`called`'s) with its results flat too: the step as it is jitted, leaves
    in, leaves out."""

    def step(*leaves: Any) -> list[Any]:
        return jax.tree.leaves(call(*leaves))

    return step


def _needs_devices(
    fn: Callable[..., Any], planned: Arguments, mesh: AnyMesh, rules: Rules | None
) -> bool:
    """Whether `fn`, traced on `mesh`, holds a primitive that needs devices to lower
    (jax's own list: cuDNN's attention and scaled matmuls, `custom_partitioning`);
    False where it does not trace at all (its own error stands)."""
    from jax._src import dispatch  # jax's list of such primitives has no public name

    flat, treedef, _ = planned.leaves(mesh)
    call = called(fn, planned, treedef)
    try:
        with _tracing(rules), _under(mesh, None):
            jaxpr = jax.jit(flat_step(call)).trace(*flat).jaxpr.jaxpr
        return bool(dispatch.jaxpr_has_prim_requiring_devices(jaxpr))
    except Exception:  # a step that does not trace: its first error is said
        return False


def _for_device(mesh: AnyMesh, device: AbstractDevice | None) -> AnyMesh:
    """`mesh` as an abstract mesh of `device`s, where the step is traced for a device
    not here (jax 0.12: a Pallas kernel's lowering asks the context mesh which chip it
    is for); `mesh` itself where `device` is None."""
    if device is None:
        return mesh
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    return abstract.update(abstract_device=device)


def _under(mesh: AnyMesh, here: Mesh | None) -> contextlib.AbstractContextManager[Any]:
    """The mesh in context while tracing: `here`, else `mesh`'s abstract mesh."""
    if here is not None:
        return jax.set_mesh(here)
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    return jax.sharding.use_abstract_mesh(abstract)


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
        layout = None if spec is None else Layout(spec) if isinstance(spec, PartitionSpec) else None
        if isinstance(spec, NamedSharding):
            layout = layout_of(spec)  # its memory kind kept
        for leaf in jax.tree.leaves(subtree):
            if layout is not None and len(layout.spec) > len(leaf.shape):
                raise Mistake(
                    ValueError,
                    f"out_shardings gives {layout.spec} to an output of {short_value(leaf)}, "
                    f"which has {len(leaf.shape)} dimensions. Give it a spec of at most that "
                    "many.",
                )
        out += [None if layout is None else named_sharding(mesh, layout)] * len(
            jax.tree.leaves(subtree)
        )
    return out


def _traced(thunk: Callable[[], T], signature: str) -> T:
    """``thunk()``, with a failure to trace said as preflight's: the exception's type
    and message in the sentence, and the exception itself chained as its cause,
    so the traceback still shows the step's own line."""
    try:
        return thunk()
    except Mistake:
        raise
    except Exception as e:
        raise Mistake(
            TypeError if isinstance(e, TypeError) else ValueError,
            f"the step does not trace with its arguments ({signature}): {type(e).__name__}: {e}"
            + "".join(f" ({fix})" for found, fix in _FIXES if found(str(e))),
        ) from e


#: What to do about jax's own messages at trace time, where spmdtree knows (new in 0.6).
_FIXES: tuple[tuple[Callable[[str], bool], str], ...] = (
    # jax asks libcudnn its version while tracing cuDNN's attention: the library comes
    # with the cuda extra (nvidia-cudnn-cu12), and runs without a GPU
    (
        lambda said: "cudnn" in said.lower() and ("not found" in said or "not detected" in said),
        "cuDNN's library: pip install 'spmdtree[cuda]', or nvidia-cudnn-cu12",
    ),
    # a model that shards by out_sharding= (flax.nnx's Gemma) needs Explicit axes
    (
        lambda said: "cannot contain axis names that are of type Auto" in said,
        "the step shards its results by out_sharding=, which needs Explicit mesh axes: build "
        "the mesh with axis_types=jax.sharding.AxisType.Explicit (st.layouts(devices, "
        "names, axis_types=AxisType.Explicit) for advise)",
    ),
    # a Pallas call on an array sharded over Explicit axes (jax's kernels; any kernel)
    (
        lambda said: (
            ("sharded ref" in said and "can only be sliced along unsharded axes" in said)
            or "pallas_call requires all mesh axes to be Manual" in said
        ),
        "a Pallas kernel runs per device: call it under jax.shard_map, as a job does",
    ),
)


# --- what the traced step says of its flash kernels' masks (new in 0.7) ------------------


def kernel_masks(closed: jex.ClosedJaxpr) -> dict[str, Kept]:
    """How many query-key blocks the masks of a traced step's flash-attention
    kernels keep, by the name their compiled calls carry (`opcodes.kernel_name`):
    what the compiled module does not say (new in 0.7).

    Splash attention is built from a mask: its call's second operand is the block
    mask (0 a skipped block, 1 a partial one, 2 a full one, per mask head), a
    constant of the jaxpr however deep (under `shard_map`, `vmap`, `custom_vjp`,
    `jit`, a loop's constants); its kept blocks are the block mask's nonzero ones,
    of every block of its queries and keys (the mask is stored shrunk to the most
    blocks a row keeps). Its backward kernels' calls carry the masks they were
    built with (dK and dV's shrunk along the query blocks), each read the same way. jax's Pallas TPU
    flash attention with ``causal=True`` runs its block pairs under a condition: the
    pairs on or below the diagonal (``below_or_on_diag``: a block runs where its
    bottom-left corner does). A kernel whose mask cannot be read (a mask computed
    in the step; kernels of one name built with different masks, which the module
    does not tell apart) is `Kept` with why.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> kernel_masks(jax.make_jaxpr(jnp.sin)(1.0))
        {}
    """
    calls: list[tuple[str, Kept]] = []
    _walk(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts, strict=True)), "", calls)
    found: dict[str, set[Kept]] = {}
    for name, kept in calls:
        found.setdefault(name, set()).add(kept)
    return {name: _agreed(kept) for name, kept in found.items()}


def _agreed(found: set[Kept]) -> Kept:
    """What the calls of one name say, where they agree."""
    if len(found) == 1:
        return next(iter(found))
    return Kept(
        why=f"the traced step builds {len(found)} different masks for kernels of this name, "
        "whose calls the compiled module does not tell apart"
    )


#: Calls whose jaxpr's outputs are the equation's, one for one: a constant one returns
#: (the residuals a forward `shard_map` hands its backward) is the equation's.
_THROUGH = frozenset(
    {"jit", "pjit", "shard_map", "custom_vjp_call", "custom_jvp_call", "remat2", "closed_call"}
)


def _walk(
    jaxpr: jex.Jaxpr, known: dict[Any, Any], scope: str, calls: list[tuple[str, Kept]]
) -> list[Any]:
    """Adds to `calls` each flash kernel's call in `jaxpr` and the jaxprs it calls,
    with what its mask keeps; `known`, the constant values of its variables (those
    its calls return added), `scope` its name scope. Returns its outputs' constant
    values (None where not constant)."""
    for eqn in jaxpr.eqns:
        kernel = eqn.primitive.name == "pallas_call"
        callees = [] if kernel else list(_callees(eqn))
        if not kernel and not callees:  # most equations: their scope is not needed
            continue
        inner = "/".join(filter(None, (scope, str(eqn.source_info.name_stack))))
        if kernel:
            # the compiled call is named for its name=, else its innermost scope
            named = eqn.params.get("name") or innermost(inner.split("/")[-1])
            name = re.sub(r"[^\w.-]", "_", named)
            flash = flash_of(name)
            if flash is not None and flash.mask != "module":
                calls.append((name, _kept(eqn, flash, known)))
            continue
        scope = f"{inner}/{eqn.params['name']}" if eqn.primitive.name in ("jit", "pjit") else inner
        for key, sub, consts in callees:
            out = _walk(sub, _bound(eqn, key, sub, consts, known), scope, calls)
            if eqn.primitive.name in _THROUGH and len(out) == len(eqn.outvars):
                pairs = zip(eqn.outvars, out, strict=True)
                known.update((v, value) for v, value in pairs if value is not None)
    return [_constant(atom, known) for atom in jaxpr.outvars]


def _constant(atom: Any, known: dict[Any, Any]) -> Any:
    """The constant value of a jaxpr's variable or literal, None where not known (a
    `shard_map`'s output keeps the value of one device's block)."""
    return atom.val if isinstance(atom, jex.Literal) else known.get(atom)


def _callees(eqn: jex.JaxprEqn) -> Iterator[tuple[str, jex.Jaxpr, Sequence[Any]]]:
    """The jaxprs an equation calls, each by its parameter's name, with its
    constants' values."""
    for key, value in eqn.params.items():
        for each in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(each, jex.ClosedJaxpr):
                yield key, each.jaxpr, each.consts
            elif isinstance(each, jex.Jaxpr):
                yield key, each, ()


def _bound(
    eqn: jex.JaxprEqn, key: str, sub: jex.Jaxpr, consts: Sequence[Any], known: dict[Any, Any]
) -> dict[Any, Any]:
    """The constant values of a called jaxpr's variables: its own constants, and its
    inputs that take a constant of the caller's whole (a loop's carry, a scan's
    slices and a sharded input take none)."""
    bound = dict(zip(sub.constvars, consts, strict=False))
    for var, atom in zip(sub.invars, _passed(eqn, key, len(sub.invars)), strict=True):
        value = _constant(atom, known) if atom is not None else None
        if value is not None and np.shape(value) == tuple(getattr(var.aval, "shape", ())):
            bound[var] = value
    return bound


def _passed(eqn: jex.JaxprEqn, key: str, count: int) -> list[Any]:
    """What a called jaxpr's inputs take of the equation's operands (None where not
    one operand's value whole): a conditional's branches all but its index; a
    loop's and a scan's their constants; any other call every operand in order."""
    operands: list[Any] = list(eqn.invars)
    if eqn.primitive.name == "cond":
        operands = operands[1:]
    elif eqn.primitive.name == "while":
        cond, body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        operands = operands[:cond] if key == "cond_jaxpr" else operands[cond : cond + body]
    elif eqn.primitive.name == "scan":  # jax 0.12 names no num_consts: none are passed
        operands = operands[: eqn.params.get("num_consts", 0)]
    elif len(operands) != count:
        operands = []
    return (operands + [None] * count)[:count]


def _kept(eqn: jex.JaxprEqn, flash: Flash, known: dict[Any, Any]) -> Kept:
    """What one flash kernel's call keeps of its blocks; why not, where its
    parameters are not as this jax's kernels write them."""
    try:
        if flash.mask == "blocks":
            return _block_mask(eqn, flash, known)
        return _causal(eqn, flash)
    except (AttributeError, IndexError, KeyError, TypeError, ZeroDivisionError):
        return Kept(why=f"its call's parameters are not as jax {jax.__version__} writes them")


def _grid(eqn: jex.JaxprEqn, flash: Flash) -> tuple[tuple[int, int], tuple[int, int]]:
    """A flash kernel's query and key blocks along the sequence: (how many, how
    long) each, from the blocks its call gives its queries and keys (its first two
    operands after the block mask's)."""
    found = []
    for mapping in eqn.params["grid_mapping"].block_mappings[:2]:
        size = mapping.block_shape[flash.keys].block_size
        found.append((mapping.array_aval.shape[flash.keys] // size, size))
    return found[0], found[1]


def _block_mask(eqn: jex.JaxprEqn, flash: Flash, known: dict[Any, Any]) -> Kept:
    """Splash attention's kept blocks: its block mask's nonzero ones, of every block
    of its queries and keys, per mask head."""
    atom = eqn.invars[1]
    value = _constant(atom, known)
    if value is None or np.shape(value) != tuple(getattr(atom.aval, "shape", ())):
        return Kept(why="its block mask is computed in the step, not a constant of it")
    mask = np.asarray(value)
    (queries, _), (keys, _) = _grid(eqn, flash)
    if mask.ndim != 3 or not np.isin(mask, (0, 1, 2)).all():
        return Kept(why="its call's second operand is not a block mask")
    if mask.shape[1] > queries or mask.shape[2] > keys:
        return Kept(why="its block mask has more blocks than its queries and keys")
    return Kept(int(np.count_nonzero(mask)), mask.shape[0] * queries * keys)


def _causal(eqn: jex.JaxprEqn, flash: Flash) -> Kept:
    """jax's Pallas TPU flash attention's kept block pairs: those on or below the
    diagonal where its kernel runs its dots under a condition (``causal=True``),
    else all."""
    (queries, q_size), (keys, k_size) = _grid(eqn, flash)
    if not _conditional(eqn.params["jaxpr"]):
        return Kept(queries * keys, queries * keys)
    rows, cols = np.arange(queries)[:, None], np.arange(keys)[None, :]
    kept = (rows + 1) * q_size - 1 > cols * k_size  # the kernel's below_or_on_diag
    return Kept(int(kept.sum()), queries * keys)


def _conditional(kernel: jex.Jaxpr) -> bool:
    """Whether a kernel runs its dots only under a condition (`pl.when`)."""
    return any(
        eqn.primitive.name == "cond"
        and any(_dots(branch.jaxpr) for branch in eqn.params["branches"])
        for eqn in kernel.eqns
    )


def _dots(jaxpr: jex.Jaxpr) -> bool:
    """Whether a jaxpr, or one it calls, runs a dot."""
    return any(
        eqn.primitive.name == "dot_general" or any(_dots(sub) for _, sub, _ in _callees(eqn))
        for eqn in jaxpr.eqns
    )
