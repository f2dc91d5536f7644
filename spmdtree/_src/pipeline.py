"""Pipeline stages (new in 0.8): `stages` restages stacked layers for a pipeline, and
`pipeline` runs them as one, in one SPMD program.

A pipeline splits the layers into stages, each stage's layers on its own devices
along a mesh axis, and streams microbatches through them: while stage s runs
microbatch k, stage s + 1 runs microbatch k - 1. As MaxText's and praxis's
pipelines do (and the smallest one, `spmd_pipeline` in jax's shard_map notebook),
it is one program over the whole mesh: every stage at once, a leading dimension
on the stage axis (`jax.vmap` with that axis as its SPMD axis; every other axis
as the mesh has it), every stage running every iteration and handing its output
to the next by a ``ppermute`` (a ``collective-permute`` in the compiled
program); the last stage's output goes round the ring to the first. Before a
stage's first microbatch arrives and after its last leaves, it runs on what it
holds and the result is dropped: the bubble, real work in the compiled program,
``stages - 1`` of its ``microbatches x repeats + stages - 1`` iterations. With
``repeats`` > 1 the pipeline is circular: each stage holds ``repeats`` groups of
layers, and each microbatch goes round the ring that often.

The iterations run under the name scope `Scope` says, which the compiled
program's metadata keeps: preflight reads the pipeline's loops and their bubble
from it.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax._src.core import trace_state_clean  # how JAX itself tells that it is tracing
from jax.sharding import AxisType, PartitionSpec

from spmdtree._src.boxes import LogicallyPartitioned, Partitioned
from spmdtree._src.errors import Mistake, at, public, raise_collected, user_level
from spmdtree._src.resolve import axes_of
from spmdtree._src.rules import PyTree
from spmdtree._src.specs import context_axis
from spmdtree._src.transforms import (
    check_count,
    check_microbatches,
    join_microbatches,
    split_microbatches,
)
from spmdtree._src.trees import change_axes, is_boxed

#: A remat policy, as `jax.checkpoint` takes it.
Policy = Callable[..., bool]
#: The stage mesh axis's name, and the stage dimension's, unless told otherwise.
STAGE = "stage"


class Scope(NamedTuple):
    """What a pipeline's name scope says of it: its stages, microbatches and
    repeats, and so its iterations and the bubble among them.

    Example:
        >>> scope = Scope(4, 8, 2)
        >>> str(scope), scope.iterations, scope.idle
        ('st.pipeline(stages=4,microbatches=8,repeats=2)', 19, 3)
        >>> Scope.read("jit(step)/transpose(jvp(st.pipeline(stages=4,microbatches=8,repeats=2)))/while")
        Scope(stages=4, microbatches=8, repeats=2)
    """

    stages: int
    microbatches: int
    repeats: int

    @property
    def iterations(self) -> int:
        """How often every stage runs: once per microbatch and repeat, and the bubble."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def idle(self) -> int:
        """The iterations each stage runs on padding (the bubble)."""
        return self.stages - 1

    def __str__(self) -> str:
        return f"st.pipeline(stages={self.stages},microbatches={self.microbatches},repeats={self.repeats})"

    @classmethod
    def read(cls, op_name: str) -> Scope | None:
        """The pipeline scope an instruction's ``op_name`` names, or None."""
        found = _SCOPE.search(op_name)
        return None if found is None else cls(*map(int, found.groups()))

    @classmethod
    def loop(cls, op_name: str) -> Scope | None:
        """The pipeline whose own loop of iterations a ``while``'s ``op_name`` names
        (the scope, the transforms jax wrapped round it, then the loop: ``...
        jvp(st.pipeline(...))/while``), or None: a loop inside it (a stage's scan
        of its layers) is not its loop.

        Example:
            >>> Scope.loop("jit(f)/transpose(jvp(st.pipeline(stages=2,microbatches=4,repeats=1)))/while")
            Scope(stages=2, microbatches=4, repeats=1)
            >>> Scope.loop("jit(f)/jvp(st.pipeline(stages=2,microbatches=4,repeats=1))/while/body/closed_call/vmap()/while") is None
            True
        """
        found = _LOOP.search(op_name)
        return None if found is None else cls(*map(int, found.groups()))


_SCOPE = re.compile(r"st\.pipeline\(stages=(\d+),microbatches=(\d+),repeats=(\d+)\)")
_LOOP = re.compile(_SCOPE.pattern + r"\)*/while$")


def _leading(tree: PyTree, argument: str, dims: int) -> dict[str, tuple[int, ...]]:
    """Each array leaf's first `dims` sizes, by its path under `argument` (boxes'
    values as their leaves); a leaf of fewer dimensions is a Mistake."""
    found: dict[str, tuple[int, ...]] = {}
    short = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            short.append(f"{at(argument, path)} (a {type(leaf).__name__}, not an array)")
            continue
        if len(shape) < dims:
            short.append(f"{at(argument, path)} (shape {tuple(shape)})")
            continue
        found[at(argument, path)] = tuple(shape[:dims])
    if short:
        raise Mistake(
            ValueError,
            f"{', '.join(short)} {'has' if len(short) == 1 else 'have'} fewer than {dims} "
            f"dimension{'s' if dims > 1 else ''}; every leaf of {argument} is expected an array "
            "stacked, its leading dimension"
            + (" the layers." if dims == 1 else "s (repeats, stages, layers per stage).")
            + (" Build them with st.stages." if dims > 1 else ""),
        )
    if not found:
        raise Mistake(ValueError, f"{argument} holds no arrays; expected stacked layers.")
    return found


def _one_size(sizes: dict[str, tuple[int, ...]], argument: str, what: str) -> tuple[int, ...]:
    """The one leading size every leaf has, or the Mistake that lists how they differ."""
    distinct = dict.fromkeys(sizes.values())
    if len(distinct) > 1:
        shown = "; ".join(
            f"{size if len(size) > 1 else size[0]} at "
            + ", ".join(path for path, s in sizes.items() if s == size)
            for size in list(distinct)[:5]
        )
        raise Mistake(
            ValueError,
            f"the arrays of {argument} disagree on their {what}: {shown}. Stack every "
            f"array of the layers alike (st.vmap), and restage the whole tree at once.",
        )
    return next(iter(distinct))


def _reshaped(value: Any, shape: tuple[int, ...]) -> Any:
    """`value` reshaped, an abstract one (`jax.ShapeDtypeStruct`) too."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, value.dtype)
    return jnp.reshape(value, shape)


@public
def stages(layers: PyTree, stages: int, *, repeats: int = 1, name: str = STAGE) -> PyTree:
    """Restages stacked layers ``[L, ...]`` for `pipeline`:
    ``[repeats, stages, L // (repeats * stages), ...]`` (new in 0.8).

    A C-order reshape, so layer ``l = (r * stages + s) * per_stage + j`` is
    repeat r, stage s, position j: stage s holds layers ``s * per_stage`` to
    ``(s + 1) * per_stage - 1`` of each pass round the ring. A box gains two
    names: ``None`` for the repeats and `name` for the stages, which the rules
    map onto the stage mesh axis (``("stage", "stage")``), so that each device
    holds its own stage's layers; a box of mesh-axis names names the mesh
    axis itself. Arrays abstract (`jax.ShapeDtypeStruct`) or not.

    Args:
        layers: stacked layers, every array with the layers as its leading
            dimension (as ``st.vmap(init_layer, partition_name="layers")``
            builds them).
        stages: how many pipeline stages (the stage mesh axis's size).
        repeats: how often each microbatch goes round the stages (1: GPipe;
            more: a circular pipeline, each stage holding `repeats` groups of
            layers).
        name: the name of the stage dimension in the boxes' names.

    Returns:
        The same tree, each array ``[repeats, stages, L // (repeats * stages),
        ...]``, each box named ``(None, name, <its names>)``.

    Raises:
        TypeError: for `stages` or `repeats` that is not an int, or a `name`
            that is not a string.
        ValueError: for `stages` or `repeats` < 1, layers that ``stages x
            repeats`` do not divide, or arrays that disagree on the layers.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> layers = {"w": st.LogicallyPartitioned(jnp.arange(8.0 * 3).reshape(8, 3), ("layers", "embed"))}
        >>> staged = st.stages(layers, 2, repeats=2)
        >>> staged["w"]
        LogicallyPartitioned(f32[2,2,2,3], names=(None, 'stage', 'layers', 'embed'))
        >>> float(staged["w"].value[1, 0, 1, 0]) == float(layers["w"].value[(1 * 2 + 0) * 2 + 1, 0])
        True
        >>> st.stages(layers, 3)
        Traceback (most recent call last):
        ...
        ValueError: stages: layers holds 8 layers, which 3 stages x 1 repeat do not divide. Choose stages and repeats whose product divides 8: 1, 2, 4 or 8.
    """
    check_count(stages, "stages", "how many pipeline stages")
    check_count(repeats, "repeats", "how often a microbatch goes round the stages")
    if not isinstance(name, str):
        raise Mistake(TypeError, f"name is {name!r}; expected a str, the stage dimension's name.")
    _not_staged(layers, name)
    (count,) = _one_size(_leading(layers, "layers", 1), "layers", "layers (leading dimension)")
    if count % (stages * repeats):
        divisors = [str(d) for d in range(1, count + 1) if count % d == 0]
        said = " or ".join([", ".join(divisors[:-1]), divisors[-1]] if divisors[1:] else divisors)
        raise Mistake(
            ValueError,
            f"layers holds {count} layer{'s' * (count > 1)}, which {stages} stage"
            f"{'s' * (stages > 1)} x {repeats} repeat{'s' * (repeats > 1)} do not divide. "
            f"Choose stages and repeats whose product divides {count}: {said}.",
        )
    split = (repeats, stages, count // (repeats * stages))
    reshaped = jax.tree.map(lambda v: _reshaped(v, (*split, *v.shape[1:])), layers)
    named = change_axes(reshaped, 0, name, add=True, argument="layers")
    return change_axes(named, 0, None, add=True, argument="layers")


def _restaged(box: object, name: object) -> bool:
    """Whether a box is one `stages` restaged: names ``(None, <name>, ...)``."""
    if not isinstance(box, Partitioned):
        return False
    names = tuple(box.names)
    return len(names) > 1 and names[0] is None and names[1] == name


def _not_staged(layers: PyTree, name: str) -> None:
    """Refuses layers some of whose boxes `stages` already restaged, or that hold a
    box or a tree rather than an array (a box in a box: only the outer would be
    renamed)."""
    problems = []
    for path, box in jax.tree_util.tree_leaves_with_path(layers, is_leaf=is_boxed):
        if _restaged(box, name):
            problems.append(
                (
                    f"the box at {at('layers', path)}",
                    Mistake(
                        ValueError,
                        f"is restaged already (names {box.names}). Restage the stacked layers "
                        "themselves, once.",
                    ),
                )
            )
        elif is_boxed(box) and not hasattr(box.unbox(), "shape"):
            problems.append(
                (
                    f"the box at {at('layers', path)}",
                    Mistake(
                        ValueError,
                        f"holds a {type(box.unbox()).__name__}, not an array: st.stages renames "
                        "the boxes of arrays. Box the arrays themselves (st.unbox the outer "
                        "box first).",
                    ),
                )
            )
    raise_collected(problems)


def _unstaged(staged: PyTree, count: int) -> None:
    """Refuses boxes `stages` did not restage: names whose first is not None (the
    repeats' dimension is unnamed), most often stacked layers passed as they are."""
    unstaged = [
        f"{at('staged', path)} (names {box.names})"
        for path, box in jax.tree_util.tree_leaves_with_path(staged, is_leaf=is_boxed)
        if isinstance(box, Partitioned) and box.names and box.names[0] is not None
    ]
    if unstaged:
        raise Mistake(
            ValueError,
            f"{', '.join(unstaged[:5])} {'is' if len(unstaged) == 1 else 'are'} not restaged "
            "for a pipeline: st.stages names a box (None, <stage>, <layers>, ...). Restage the "
            f"stacked layers first: st.stages(layers, {count}).",
        )


def _per_layer(staged: PyTree) -> PyTree:
    """`staged` with its boxes' names those of one layer (the repeats, stage and
    layer dimensions dropped), their values as they are: what `pipeline` indexes."""
    for first in (True, False, False):
        staged = change_axes(
            staged, 0, None, add=False, argument="staged", match_name=False, unmapped=first
        )
    return staged


def _check_stage_names(staged: PyTree, axis: str) -> None:
    """A box of mesh-axis names must name the stage dimension `axis`: else each
    device would hold every stage's layers."""
    wrong = [
        f"{at('staged', path)} (names {box.names})"
        for path, box in jax.tree_util.tree_leaves_with_path(staged, is_leaf=is_boxed)
        if isinstance(box, Partitioned)
        and not isinstance(box, LogicallyPartitioned)
        and len(box.names) > 1
        and box.names[1] != axis
    ]
    if wrong:
        raise Mistake(
            ValueError,
            f"{', '.join(wrong)} {'names' if len(wrong) == 1 else 'name'} the stage dimension "
            f"(dimension 1) otherwise than the stage mesh axis {axis!r}, so every device "
            f"would hold every stage's layers. Restage with st.stages(..., name={axis!r}).",
        )


def _check_stages(stages: int, size: int, axis: str) -> None:
    """The staged layers' stages are the stage axis's devices."""
    if stages != size:
        raise Mistake(
            ValueError,
            f"the mesh's stage axis {axis!r} has {size} devices, but the staged layers have "
            f"{stages} stages (their dimension 1). Restage them with st.stages(layers, "
            f"{size}), or lay the mesh out with {stages} on {axis!r}.",
        )


def _check_microbatch_shards(init: PyTree, microbatches: int, stages: int, axis: str) -> None:
    """On Explicit axes, every microbatch split as the batch is inside the pipeline
    (its axes but the stage axis): its rows a multiple of the devices the batch's
    dimension is sharded over (else they would hold it whole, or the split would not
    type). On Auto axes the types do not say: advise rules such a candidate out
    from its plan."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in mesh.axis_types:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(init):
        spec = tuple(jax.typeof(leaf).sharding.spec)
        axes = tuple(a for a in axes_of(spec[0] if spec else None) if a != axis)
        shards = math.prod(mesh.shape[a] for a in axes)
        batch = jnp.shape(leaf)[0]
        if (batch // microbatches) % shards:
            fit = [m for m in range(stages, batch + 1, stages) if batch % m == 0]
            fit = [m for m in fit if (batch // m) % shards == 0]
            fix = (
                f"Give {' or '.join(map(str, fit[-2:]))} microbatches, or a larger batch."
                if fit
                else "No count of them that is a multiple of the stages fits this batch: give "
                "a larger batch."
            )
            raise Mistake(
                ValueError,
                f"a microbatch of {at('init', path)} holds {batch // microbatches} rows "
                f"({batch} over {microbatches} microbatches), which its batch's mesh axes "
                f"{'+'.join(axes)} ({shards} devices) do not divide. {fix}",
            )


def _checked_layer(f: Callable[[Any, Any], tuple[Any, Any]]) -> Callable[[Any, Any], Any]:
    """`f` for one layer, its result checked: the carry as it came in (structure,
    shapes, dtypes) and no per-layer output."""

    def layer(carry: Any, params: Any) -> tuple[Any, None]:
        out = f(carry, params)
        if not isinstance(out, tuple) or len(out) != 2:
            raise Mistake(
                ValueError,
                f"f returned {_kinds(out)}; expected (carry, None), as a scan's body "
                "returns its carry and per-layer output.",
            )
        new, per_layer = out
        if per_layer is not None:
            raise Mistake(
                ValueError,
                f"f returned a per-layer output ({jax.tree.structure(per_layer)}); a pipeline "
                "passes only the carry from stage to stage, so f must return (carry, None). "
                "Carry what a layer adds up per example in the carry (an auxiliary loss of "
                "shape [batch], its leading dimension the batch's), and reduce it after the "
                "pipeline.",
            )
        given, got = (_kinds(t) for t in (carry, new))
        if given != got:
            raise Mistake(
                ValueError,
                f"f returned a carry of {got}, given one of {given} (one microbatch's); a "
                "layer must return its carry as it came in: its structure, shapes, dtypes "
                "and, on Explicit axes, shardings (constrain the carry before the pipeline "
                "to the sharding f gives it: st.with_logical_constraint).",
            )
        return new, None

    return layer


def _kinds(tree: Any) -> Any:
    """A tree's arrays as their types show them (``float32[4@data,16]``), for a message."""
    return jax.tree.map(lambda x: str(jax.typeof(x)) if hasattr(x, "shape") else repr(x), tree)


@public
def pipeline(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: PyTree,
    staged: PyTree,
    *,
    microbatches: int,
    axis: str = STAGE,
    remat: bool | Policy = False,
) -> tuple[Any, None]:
    """``st.scan(f, init, layers)`` run as a pipeline over the mesh axis `axis`, in
    one SPMD program (new in 0.8).

    `staged` is the layers as `stages` restaged them (``[repeats, stages,
    per_stage, ...]``). `init`'s leading (batch) dimension is split into
    `microbatches` (rows strided, as `accumulate` splits them, so the batch's
    sharding stays on its rows), which stream through the stages: each stage
    runs its layers (a scan of `f`) on one microbatch per iteration, every stage
    at once (`jax.vmap` with `axis` as its SPMD axis), and passes the result to
    the next stage by a ``ppermute`` along `axis` (a ``collective-permute``); the
    last stage's goes round the ring to the first, for the next repeat (kept
    ``microbatches - stages`` iterations where that is more than 0) or into the
    output. Each device holds its own stage's layers (shard the stage dimension
    on `axis`: the rule ``("stage", "stage")``; other layouts are resharded to
    it). The mesh is the one in context (`jax.set_mesh`), as constraints take
    it; every axis but `axis` stays as it is, so `f`'s constraints over the
    data, fsdp and tensor axes hold inside, on Explicit axes and Auto ones.

    What the stages hand each other is one microbatch per iteration; the carry
    goes in and comes out as the mesh holds it outside, so the output is summed
    over the stage axis once (an all-reduce of the carry; its gradient another).
    The compiled program reduces a replicated weight's gradient over the data
    axes in every iteration, as it does a scanned layer's in every layer (and an
    FSDP weight is gathered in every iteration): traffic the prediction counts.

    ``microbatches x repeats + stages - 1`` iterations run; in ``stages - 1``
    of them each stage runs on padding (the bubble, ``(stages - 1) /
    (microbatches x repeats + stages - 1)`` of the pipeline's time), which
    preflight counts as the compiled program runs it. The result equals
    ``st.scan(f, init, layers)``'s to float tolerance, its gradients too.
    Pure: composes with `jax.jit`, `jax.grad`, `jax.checkpoint`, optax and
    `accumulate`.

    Args:
        f: ``(carry, layer) -> (carry, None)`` for one layer, as `scan` takes
            it: `layer` holds boxes with one layer's names. It sees one
            microbatch: what it needs per example travels in the carry.
        init: the carry: activations (and whatever else is per example),
            every leaf with the batch as its leading dimension.
        staged: the layers, restaged by `stages`.
        microbatches: how many microbatches the batch is split into: a multiple
            of the stages that divides the batch (MaxText's advice is twice the
            stages or more).
        axis: the stage mesh axis.
        remat: rematerialise each iteration's stage in the backward pass (as
            MaxText's ``set_remat_policy_on_pipeline_iterations``): True saves
            only each iteration's input, a policy
            (``jax.checkpoint_policies.*``) saves what it names (never a
            repeat's weights, which it takes again); False (default) adds
            nothing to what `f` does itself (its own `jax.checkpoint` governs).
            Without it a circular pipeline's backward pass holds the weights of
            the repeat each iteration ran, once per iteration: give `remat`
            where repeats > 1 (one repeat's weights are held once).

    Returns:
        ``(carry, None)``: the carry after every layer, as `scan` returns it.

    Raises:
        TypeError: for a `microbatches` that is not an int.
        ValueError: for microbatches that are not a multiple of the stages or
            do not divide the batch (on Explicit axes: whose rows the batch's
            mesh axes do not divide); no mesh in context, a mesh without `axis`,
            or one whose `axis` differs in size from the staged layers' stages;
            boxes `stages` did not restage, staged arrays that disagree on the
            repeats or the stages, or a box of mesh-axis names whose stage
            dimension is not `axis`; and (while tracing) an `f` whose per-layer
            output is not None, or whose carry changes.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((4, 2), ("stage", "data"))
        >>> layers = {"w": st.Partitioned(jax.random.normal(jax.random.key(0), (8, 16, 16)) / 4, (None, None, None))}
        >>> def layer(x, p):
        ...     return jnp.tanh(x @ st.unbox(p)["w"]), None
        >>> x = jnp.ones((16, 16))
        >>> staged = st.stages(layers, 4, repeats=2, name="stage")
        >>> with jax.set_mesh(mesh):
        ...     piped, _ = jax.jit(lambda x, s: st.pipeline(layer, x, s, microbatches=4))(x, staged)
        >>> scanned, _ = st.scan(layer, x, layers)
        >>> bool(jnp.allclose(piped, scanned, atol=1e-6))
        True
    """
    microbatches = check_count(
        microbatches, "microbatches", "the microbatches the batch is split into"
    )
    if remat is not False and remat is not True and not callable(remat):
        raise Mistake(
            TypeError,
            f"remat is {remat!r}; expected True, False or a remat policy "
            "(jax.checkpoint_policies.*).",
        )
    if not isinstance(axis, str):
        raise Mistake(TypeError, f"axis is {axis!r}; expected the stage mesh axis's name.")
    size = context_axis(axis, "stage", "the pipeline runs its stages")
    _unstaged(staged, size)
    repeats, count = _one_size(
        _leading(staged, "staged", 3),
        "staged",
        "repeats, stages and layers per stage (dimensions 0 to 2)",
    )[:2]
    _check_stages(count, size, axis)
    _check_stage_names(staged, axis)
    if microbatches % count:
        raise Mistake(
            ValueError,
            f"microbatches is {microbatches}, not a multiple of the {count} stages. Give a "
            f"multiple of {count} (MaxText advises {2 * count} or more: the bubble is "
            f"{count - 1} iterations of microbatches x repeats + {count - 1}).",
        )
    check_microbatches(init, microbatches, "init", "to f")
    _check_microbatch_shards(init, microbatches, count, axis)
    scope = Scope(count, microbatches, repeats)
    piped: Callable[..., Any] = functools.partial(
        _piped, _checked_layer(f), scope=scope, axis=axis, remat=remat
    )
    if trace_state_clean():  # called eagerly: its constraints need a trace to live in
        piped = jax.jit(piped)
    with jax.named_scope(str(scope)):
        return piped(init, _per_layer(staged)), None


def _on_stages(x: jax.Array, axis: str, dim: int = 0) -> jax.Array:
    """`x`, its dimension `dim` one entry per stage, laid out on the stage axis: on
    Explicit axes its type says so (resharded where it does not: a slice of what
    each device holds); on Auto ones a constraint does, the other dimensions left
    to the compiler."""
    if AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types:
        spec = list(jax.typeof(x).sharding.spec) + [None] * jnp.ndim(x)
        if spec[dim] == axis:
            return x
        x = _off_stages(x, axis)
        spec = list(jax.typeof(x).sharding.spec) + [None] * jnp.ndim(x)
        if dim:  # a staged weight: every device was handed every stage's layers
            warnings.warn(
                f"pipeline: a staged array of shape {tuple(jnp.shape(x))} comes with its "
                f"stage dimension (dimension 1) on {spec[dim]!r}, not on the stage axis "
                f"{axis!r}: every device holds every stage's layers, and the pipeline "
                "takes its own stage's from them. Shard the stage dimension on the stage "
                "axis (the rule ('stage', 'stage')).",
                stacklevel=user_level(),
            )
        spec[dim] = axis
        return jax.sharding.reshard(x, PartitionSpec(*spec[: jnp.ndim(x)]))
    free: list[Any] = [PartitionSpec.UNCONSTRAINED] * jnp.ndim(x)
    free[dim] = axis
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*free))


def _copies(x: jax.Array, count: int, axis: str) -> jax.Array:
    """`x` as `count` copies along a new leading dimension on the stage axis, one per
    stage: each device holds its own, as it held `x` (no transfer; the gradient
    sums them, an all-reduce over the stage axis)."""
    explicit = AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
    if not explicit:
        return _on_stages(jnp.broadcast_to(x[None], (count, *jnp.shape(x))), axis)
    spec = PartitionSpec(axis, *tuple(jax.typeof(x).sharding.spec))
    dims = tuple(range(1, jnp.ndim(x) + 1))
    return jax.lax.broadcast_in_dim(x, (count, *jnp.shape(x)), dims, out_sharding=spec)


def _off_stages(x: jax.Array, axis: str) -> jax.Array:
    """`x` on Explicit axes with `axis` taken out of its sharding (a reshard where its
    type names it: the devices along it gather their parts; a batch split over the
    stage axis too is whole on each stage); on Auto axes (its type names none) `x`."""
    spec = tuple(jax.typeof(x).sharding.spec)
    if axis not in {a for entry in spec for a in axes_of(entry)}:
        return x
    kept = [tuple(a for a in axes_of(entry) if a != axis) for entry in spec]
    return jax.sharding.reshard(
        x, PartitionSpec(*(k[0] if len(k) == 1 else k or None for k in kept))
    )


def _shift(axis: str, count: int, y: jax.Array) -> jax.Array:
    """Each stage's `y` to the next stage along `axis`, the last's to the first: a
    ``ppermute`` (a collective-permute). Manual over the stage axis and the
    Explicit axes `y`'s type names (partial-manual over the stage axis alone would
    all-gather those at its boundary, jax 0.10.2); on Auto axes the compiler
    keeps the rest as it is."""
    spec = list(jax.typeof(y).sharding.spec) + [None] * jnp.ndim(y)
    spec = [axis, *spec[1 : jnp.ndim(y)]]
    manual = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    ring = [(s, (s + 1) % count) for s in range(count)]
    return jax.shard_map(
        lambda a: jax.lax.ppermute(a, axis, ring),
        in_specs=PartitionSpec(*spec),
        out_specs=PartitionSpec(*spec),
        axis_names=manual,
    )(y)


#: The primitives that only move, reshape or cast an array: what a rematerialised
#: stage never saves for its backward pass, but recomputes. A circular pipeline's
#: weights of one repeat (and of one layer, cast) are such: saved, every iteration
#: would keep its own copy of them; recomputed, they are taken again from the
#: stage's weights, which every iteration shares. Cheap to recompute.
MOVES = frozenset(
    {
        "dynamic_slice",
        "gather",
        "slice",
        "squeeze",
        "reshape",
        "broadcast_in_dim",
        "convert_element_type",
        "transpose",
        "copy",
        "copy_p",
        "name",
    }
)


def _saves(policy: Policy) -> Policy:
    """`policy`, but never what only moves an array."""

    def saves(prim: Any, *args: Any, **params: Any) -> bool:
        return prim.name not in MOVES and bool(policy(prim, *args, **params))

    return saves


def _stage_fn(
    layer: Callable[[Any, Any], Any], repeats: int, remat: bool | Policy
) -> Callable[..., Any]:
    """One stage's layers of repeat `r` run on its input: ``(weights, r, x) -> x``.

    With one repeat its weights are the same in every iteration, and the backward
    pass holds them once. A circular pipeline takes repeat `r`'s in each iteration,
    and unrematerialised each iteration keeps its copy of them: `remat` (True, or a
    policy) recomputes the stage, and them, instead. Without `remat` nothing is
    checkpointed here, so that `f`'s own `jax.checkpoint` governs what its layers
    keep (a policy around the stage would override it)."""

    def stage(weights: Any, r: jax.Array, x: Any) -> Any:
        if repeats == 1:
            group = jax.tree.map(lambda w: w[0], weights)  # the same in every iteration
        else:
            group = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, r, 0, False), weights)
        return jax.lax.scan(layer, x, group)[0]

    if remat is False:
        return stage
    policy = remat if callable(remat) else jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(stage, policy=_saves(policy), prevent_cse=False)


def _piped(
    layer: Callable[[Any, Any], Any],
    init: Any,
    weights: Any,
    *,
    scope: Scope,
    axis: str,
    remat: bool | Policy,
) -> Any:
    """The pipeline: every stage at once, their leading dimension on the stage axis
    (vmapped with it as their SPMD axis), a scan over its iterations.

    The microbatches go in as the scan's per-iteration inputs and the last stage's
    outputs come out as its per-iteration outputs (each iteration reads and writes
    one microbatch, in its forward and its backward alike). In a circular pipeline
    a microbatch the last stage finishes reaches the first stage, round the ring,
    ``microbatches - stages`` iterations before its next repeat: the first stage
    keeps it that long in a ring of as many slots, read and written at one slot
    per iteration (none where the microbatches are the stages)."""
    count, m, iterations = scope.stages, scope.microbatches, scope.iterations
    stage = _on_stages(jnp.arange(count), axis)
    delay = m - count if scope.repeats > 1 else 0

    def first(x: jax.Array) -> jax.Array:  # True on the first stage, shaped for `x`
        return jnp.reshape(stage == 0, (count,) + (1,) * (jnp.ndim(x) - 1))

    def streamed(x: jax.Array) -> jax.Array:  # [iterations, stages, micro, ...]
        micro = split_microbatches(_off_stages(x, axis), m)  # whole along the stage axis
        # after the last, zeros: the first stage takes what comes round the ring then
        padded = jnp.pad(micro, [(0, iterations - m)] + [(0, 0)] * (jnp.ndim(micro) - 1))
        return jnp.swapaxes(_copies(padded, count, axis), 0, 1)

    weights = jax.tree.map(lambda w: _on_stages(w, axis, 1), weights)
    stage_fn = _stage_fn(layer, scope.repeats, remat)
    run = jax.vmap(stage_fn, in_axes=(1, 0, 0), spmd_axis_name=axis)
    shift = functools.partial(_shift, axis, count)

    def iteration(carry: tuple[Any, Any], step: tuple[jax.Array, Any]) -> tuple[Any, Any]:
        passed, ring = carry  # what each stage was handed; the first stage's ring
        i, fresh = step
        again = passed  # a microbatch's next repeat: what just came round, or
        if delay:  # what came round `delay` iterations ago (now kept in its place)
            slot = i % delay
            again = jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, slot, 1, False), ring)
            ring = jax.tree.map(
                lambda r, p: jax.lax.dynamic_update_index_in_dim(r, p, slot, 1), ring, passed
            )
        x = jax.tree.map(
            lambda a, b, c: jnp.where(first(a), jnp.where(i < m, a, b), c), fresh, again, passed
        )
        repeat = jnp.clip((i - stage) // m, 0, scope.repeats - 1)
        passed = jax.tree.map(shift, run(weights, repeat, x))
        return (passed, ring), jax.tree.map(
            lambda p: jnp.where(first(p), p, jnp.zeros_like(p)), passed
        )

    inputs = jax.tree.map(streamed, init)
    start = jax.tree.map(lambda x: x[0], inputs)  # what a stage runs before its first
    ring = jax.tree.map(lambda x: jnp.stack([x] * delay, axis=1), start) if delay else ()
    _, outputs = jax.lax.scan(iteration, (start, ring), (jnp.arange(iterations), inputs))
    # the last repeat's outputs, on the first stage (zeros elsewhere): their sum over
    # the stages is them on every stage (an all-reduce)
    return jax.tree.map(
        lambda y: join_microbatches(jnp.sum(y[iterations - m :], axis=1, dtype=y.dtype)), outputs
    )
