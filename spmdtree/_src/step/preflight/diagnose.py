"""What a step's figures mean, said in words: pure functions over its records.

Nothing here compiles. `unexplained_traffic` compares the collectives a
compiled step runs with what the layout of its arguments explains (0.4,
measured: flax's lm1b with FSDP rules and no activation constraints, XLA
sharded the activations over the FSDP axis and all-reduced them there, 98
all-reduces of 16 GiB); `nothing_fits` says, when no candidate fits, how far
the closest is and what might bring it under; `split_work` and
`repeating_axes` find a layout whose devices repeat each other's work (new in
0.6). `preflight` and `advise` put their sentences beside the figures.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Hashable, Sequence

from spmdtree._src.plan import Plan, PlanRow
from spmdtree._src.resolve import axes_of
from spmdtree._src.step.hlo import Collective
from spmdtree._src.step.kinds import CollectiveKind
from spmdtree._src.text import LeftUnsharded, flops_text, size_text

#: How many times what the layout explains the collectives may move before it is said.
TRAFFIC_RATIO = 4.0
#: Below this excess (bytes per device per step) nothing is said: toy steps.
TRAFFIC_FLOOR = 1 << 20


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Collectives far above what the arguments' layout explains (new in 0.5).

    What `StepPlan.unexplained_traffic` gives where a step's collectives move
    more than 4 times what the layout of its arguments explains (and 1 MiB
    beyond it): most often, with no activation constraints, XLA split the
    activations over the weights' axes and all-reduces them there (0.4,
    measured on flax's lm1b with FSDP rules: 98 all-reduces of 16 GiB).

    Attributes:
        measured_bytes: the collectives' result bytes per device per step.
        explained_bytes: what the layout explains, at most (`explained_bytes`).
        largest: the collective that moves the most.
        activations: whether `largest` reduces or exchanges over mesh axes
            that shard the arguments: activations split over them.
        sentence: the finding, and what to do.

    Example:
        >>> import dataclasses, jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((4,), ("fsdp",))
        >>> w = st.Partitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), ("fsdp", None))
        >>> step = st.preflight(lambda w: jnp.sum(w.value), w, mesh=mesh)
        >>> step.unexplained_traffic is None
        True
        >>> # as if the compiler had all-reduced 48 MiB of activations over fsdp
        >>> reduced = st.Collective("all-reduce", 3, 48 << 20, axes=("fsdp",), group=4)
        >>> found = dataclasses.replace(step, collectives=(reduced,)).unexplained_traffic
        >>> found.explained_bytes == 2 * 256 * 256 * 4 + 256 * 256  # gathered twice, reduce-scattered
        True
        >>> print(found.sentence)
        The collectives move 48.0 MiB per device per step, 85x what the layout of the arguments explains (576.0 KiB at most: each sharded array gathered twice and its gradient reduce-scattered, each replicated one's gradient all-reduced); the most, 3 all-reduces of 48.0 MiB over ('fsdp',). XLA likely split the activations over ('fsdp',), as the weights are, and reduces them there: constrain the activations with `st.with_logical_constraint` (each layer's input and output, their batch over the data axes), so the weights are gathered instead.
    """

    measured_bytes: int
    explained_bytes: int
    largest: Collective
    activations: bool
    sentence: str


@dataclasses.dataclass(frozen=True)
class Closest:
    """A candidate's figures, for `nothing_fits`.

    Attributes:
        label: how a table names it (``"data 8 x fsdp 8, batch 256"``).
        peak_bytes: its peak per device.
        temp_bytes: the compiler's temporaries in that peak (activations
            among them), which scale with the batch.
        devices: the devices it was compiled for.
        batch: its global batch, or None if not known.
        remat: whether the step rematerialises its layers (None: not known).
    """

    label: str
    peak_bytes: int
    temp_bytes: int
    devices: int
    batch: int | None = None
    remat: bool | None = None


def _spec_axes(row: PlanRow) -> set[str]:
    return {axis for entry in row.spec for axis in axes_of(entry)}


def explained_bytes(inputs: Plan) -> int:
    """The most collective result bytes per device per step the layout of
    `inputs` explains for a training step: each array sharded over axes of
    size > 1 gathered whole twice (forward, and backward under remat) and its
    gradient reduce-scattered to its shard; each array replicated over an
    axis of size > 1 all-reduced at its shard's size (a data-parallel
    gradient). An upper bound: every input counts, optimizer state and batch
    included, as if each were a parameter.
    """
    sizes = dict(inputs.mesh.shape) if inputs.mesh is not None else {}
    total = 0
    for row in inputs.rows:
        used = _spec_axes(row)
        if any(sizes.get(axis, 1) > 1 for axis in used):
            total += 2 * row.bytes + row.device_bytes
        if any(size > 1 for axis, size in sizes.items() if axis not in used):
            total += row.device_bytes
    return total


def unexplained_traffic(
    collectives: Sequence[Collective],
    inputs: Plan,
    *,
    ratio: float = TRAFFIC_RATIO,
    floor: int = TRAFFIC_FLOOR,
) -> Traffic | None:
    """The collectives of a step (`StepPlan.collectives`) against what the layout
    of its arguments (`StepPlan.inputs`) explains: a `Traffic` where they move
    more than `ratio` times that, and more than `floor` bytes beyond it; else
    None."""
    measured = sum(c.bytes for c in collectives)
    explained = explained_bytes(inputs)
    if not collectives or measured <= ratio * explained or measured - explained <= floor:
        return None
    largest = max(collectives, key=lambda c: c.bytes)
    sharding = set().union(*(_spec_axes(row) for row in inputs.rows))
    activations = (largest.kind == "all-reduce" or CollectiveKind(largest.kind).exchanges) and set(
        largest.axes
    ) <= sharding
    times = f"{measured / explained:.0f}x what" if explained else "far more than"
    said = (
        f"The collectives move {size_text(measured)} per device per step, {times} the "
        f"layout of the arguments explains ({size_text(explained)} at most: each sharded "
        "array gathered twice and its gradient reduce-scattered, each replicated one's "
        f"gradient all-reduced); the most, {largest.count} {largest.kind}"
        f"{'' if largest.count == 1 else 's'} of "
        f"{size_text(largest.bytes)} over {largest.axes}. "
    )
    why = (
        f"XLA likely split the activations over {largest.axes}, as the weights are, and "
        "reduces them there: constrain the activations with `st.with_logical_constraint` "
        "(each layer's input and output, their batch over the data axes), so the weights "
        "are gathered instead."
        if activations
        else "Something other than the arguments' layout moves them (activations resharded "
        "between layers, or a tensor-parallel layout's own all-reduces); where the step "
        "constrains no activations, constrain them with `st.with_logical_constraint`."
    )
    return Traffic(measured, explained, largest, activations, said + why)


def nothing_fits(
    candidates: Sequence[Closest], budget_bytes: int, *, searched: bool = False
) -> str:
    """What to say when no candidate fits in `budget_bytes`: the smallest peak,
    by how much it is over, and what might bring it under: rematerialising
    (where the step does not and its temporaries are most of its peak), more
    devices, a smaller batch (temporaries scale with it; the rest does not).
    `searched`: the candidates are a search's (advise's), so it opens "Nothing
    fits" however many compiled."""
    closest = min(candidates, key=lambda c: c.peak_bytes)
    over = closest.peak_bytes - budget_bytes
    if over <= 0:
        raise ValueError(f"{closest.label or 'the step'} fits in {budget_bytes} bytes.")
    label = f" ({closest.label})" if closest.label else ""
    peak = size_text(closest.peak_bytes)
    said = (
        (
            f"The step's peak, {peak}{label}, is"
            if len(candidates) == 1 and not searched
            else f"Nothing fits: the smallest peak, {peak}{label}, is"
        )
        + f" {size_text(over)} ({over / budget_bytes:.0%}) over the budget of {size_text(budget_bytes)}."
    )
    tries = [t for t in (_remat(closest), _devices(closest, budget_bytes)) if t]
    tries.append(_batch(closest, budget_bytes))
    return " ".join([said, *tries])


def _remat(closest: Closest) -> str:
    share = closest.temp_bytes / closest.peak_bytes
    if closest.remat or share < 0.5:
        return ""
    unknown = ", if the step does not already," if closest.remat is None else ""
    return (
        f"Its temporaries (activations among them) are {size_text(closest.temp_bytes)}, "
        f"{share:.0%} of the peak: rematerialising the layers (`jax.checkpoint`){unknown} "
        "could bring it under."
    )


def _devices(closest: Closest, budget_bytes: int) -> str:
    # at the same global batch, a layout sharding everything over twice the
    # devices holds half of each array and half of each activation
    factor = 2 ** math.ceil(math.log2(closest.peak_bytes / budget_bytes))
    return (
        f"Spread over {factor}x the devices ({factor * closest.devices}), with the arrays "
        "and the batch sharded over them, its peak would be about 1/"
        f"{factor}: under."
    )


def _batch(closest: Closest, budget_bytes: int) -> str:
    fixed = closest.peak_bytes - closest.temp_bytes
    if fixed >= budget_bytes:
        return (
            f"A smaller batch cannot bring it under: its arrays alone ({size_text(fixed)}) "
            "are over the budget."
        )
    fraction = (budget_bytes - fixed) / closest.temp_bytes
    if closest.batch is None:
        return f"A batch of at most {fraction:.0%} of this one could bring it under."
    largest = math.floor(closest.batch * fraction)
    if largest < 1:
        return "No batch brings it under: one sequence's temporaries alone are over."
    return f"A batch of at most {largest} (from {closest.batch}) could bring it under."


# --- work repeated along an axis --------------------------------------------------------

#: A layout whose devices do this many times the least FLOPs per device any layout of
#: the same batch does repeats work: a 2-way copy does 2x (new in 0.6).
REPEATS = 1.5


def split_work(rows: Sequence[tuple[Hashable, int]]) -> dict[Hashable, int]:
    """Per work (a batch, or what fixes a step's work: its batch, length and
    options), the fewest FLOPs per device of any compiled layout, from ``(work,
    flops per device)`` pairs: the work split over all the devices.

    Example:
        >>> split_work([(8, 400), (8, 200), (16, 800), (8, 0)])
        {8: 200, 16: 800}
    """
    least: dict[Hashable, int] = {}
    for work, flops in rows:
        if flops > 0:
            least[work] = min(least.get(work, flops), flops)
    return least


def repeating_axes(sizes: dict[str, int], used: set[str], factor: float) -> tuple[str, ...]:
    """The mesh axes along which devices repeat each other's work `factor` times:
    among the axes of size > 1 that shard none of the step's arguments (`used`
    holds those that do: the batch's, the weights'), those whose sizes multiply
    nearest to `factor` (fewest axes on ties).

    Example:
        >>> repeating_axes({"data": 2, "fsdp": 32}, {"fsdp"}, 2.0)
        ('data',)
        >>> repeating_axes({"data": 4, "seq": 2, "tensor": 8, "fsdp": 2}, {"fsdp", "tensor"}, 8.0)
        ('data', 'seq')
    """
    spare = [axis for axis, size in sizes.items() if size > 1 and axis not in used]
    subsets = [
        subset
        for count in range(1, len(spare) + 1)
        for subset in itertools.combinations(spare, count)
    ]
    if not subsets:
        return ()

    def distance(subset: tuple[str, ...]) -> tuple[float, int]:
        product = math.prod(sizes[a] for a in subset)
        return abs(math.log(product / factor)), len(subset)

    return min(subsets, key=distance)


def repeated_sentence(
    axes: tuple[str, ...],
    sizes: dict[str, int],
    flops: int,
    least: int,
    devices: int,
    *,
    rule: str | None,
) -> str:
    """What a layout whose devices repeat each other's work is told.

    The fix it names follows how the batch is named (new in 0.6): by the logical
    name `rule`, the rule that would shard it over `axes` too; by mesh axes (None:
    a model that writes its own specs, as flax's Gemma does), the specs and
    ``out_sharding=`` that name the batch's axes.

    Example:
        >>> sizes = {"data": 2, "fsdp": 32}
        >>> print(repeated_sentence(("data",), sizes, 2 * 10**12, 10**12, 64, rule="batch"))
        devices repeat each other's work along data (2): 2.0 TFLOP per device, 2.0x the 1.0 TFLOP of a layout that splits the same batch over all 64 devices; shard the batch over data too (its rule: ('batch', ('data', ...))), or give data's devices to the axes that split it
        >>> print(repeated_sentence(("data",), sizes, 2 * 10**12, 10**12, 64, rule=None))
        devices repeat each other's work along data (2): 2.0 TFLOP per device, 2.0x the 1.0 TFLOP of a layout that splits the same batch over all 64 devices; shard the batch over data too (name ('data', ...) in the batch's spec and wherever an out_sharding= or a sharding constraint names the batch's axes), or give data's devices to the axes that split it
    """
    named = " x ".join(f"{a} ({sizes[a]})" for a in axes)
    which = "+".join(axes)
    listed = ", ".join(repr(a) for a in axes)
    how = (
        f"name ({listed}, ...) in the batch's spec and wherever an out_sharding= or a "
        "sharding constraint names the batch's axes"
        if rule is None
        else f"its rule: ({rule!r}, ({listed}, ...))"
    )
    return (
        f"devices repeat each other's work along {named}: {flops_text(flops)} per device, "
        f"{flops / least:.1f}x the {flops_text(least)} of a layout that splits the same batch "
        f"over all {devices} devices; shard the batch over {which} too ({how}), or give "
        f"{which}'s devices to the axes that split it"
    )


def batch_rule(inputs: Plan, batch: int) -> str | None:
    """The logical name of the batch's dimension, whose rule shards it: the leading
    name of an argument named logically whose leading dimension is `batch`; None
    where the batch is named by mesh axes (or not named).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"))
        >>> x = jax.ShapeDtypeStruct((64, 8), "float32")
        >>> tree = {"w": st.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), "float32"),
        ...                                      ("embed", None)),
        ...         "tokens": st.Partitioned(x, ("fsdp", None))}
        >>> print(batch_rule(st.plan(tree, mesh, rules=[("embed", "fsdp")]), 64))
        None
        >>> tree["tokens"] = st.LogicallyPartitioned(x, ("rows", None))
        >>> batch_rule(st.plan(tree, mesh, rules=[("rows", "fsdp"), ("embed", "fsdp")]), 64)
        'rows'
    """
    for row in inputs.rows:
        if row.logical and row.shape[:1] == (batch,) and row.names:
            leading = row.names[0]
            if isinstance(leading, str):
                return leading
    return None


def undivided_sentence(
    axes: tuple[str, ...],
    sizes: dict[str, int],
    left: Sequence[LeftUnsharded],
    flops: int,
    least: int,
    devices: int,
) -> str:
    """What a layout is told whose devices repeat work along `axes` because those
    axes do not divide dimensions they were to split (`left`, its arguments'
    flags: 8 heads over a tensor axis of 16), so each device computes them whole
    (new in 0.6).

    Example:
        >>> from spmdtree._src.text import LeftUnsharded
        >>> left = [LeftUnsharded(1, "heads", 8, (("tensor",),))]
        >>> print(undivided_sentence(("tensor",), {"tensor": 16}, left, 7 * 10**9, 10**9, 16))
        devices repeat each other's work along tensor (16), which does not divide what it is to split (heads, size 8), so each of its devices computes that whole: 7.0 GFLOP per device, 7.0x the 1.0 GFLOP of a layout that splits the same batch over all 16 devices; give tensor a size that divides it, or its devices to the axes that split the batch
    """
    named = " x ".join(f"{a} ({sizes[a]})" for a in axes)
    which = "+".join(axes)
    dims = list(dict.fromkeys((str(f.name), f.size) for f in left))
    what = ", ".join(f"{name}, size {size}" for name, size in dims[:3])
    if len(dims) > 3:
        what += f", and {len(dims) - 3} more"
    return (
        f"devices repeat each other's work along {named}, which does not divide what it "
        f"is to split ({what}), so each of its devices computes that whole: "
        f"{flops_text(flops)} per device, {flops / least:.1f}x the {flops_text(least)} of a "
        f"layout that splits the same batch over all {devices} devices; give {which} a size "
        "that divides it, or its devices to the axes that split the batch"
    )


def _tried(flag: LeftUnsharded) -> set[str]:
    """The mesh axes a dimension left unsharded was tried on, that do not divide it."""
    return {axis for tried in flag.axes for axis in axes_of(tried)}


def repeated(sizes: dict[str, int], inputs: Plan, flops: int, least: int, batch: int) -> str | None:
    """The sentence for a layout of `sizes`, its arguments laid out as `inputs`
    around a batch of `batch`, whose devices do `flops` per device where that
    work split over all of them is `least`; None where they do not repeat each
    other's work: FLOPs under `REPEATS` times the least, or no axis to repeat it
    along. The axes it can repeat along are those of size > 1 that shard none of
    the arguments (a batch never split over them) and those that leave some
    dimension of the arguments unsharded, not dividing it (new in 0.6: 8 heads
    over a tensor axis of 16). A layout whose every axis splits everything can
    still count fewer FLOPs where XLA rewrites a matmul of one row as a
    reduction: no repeat."""
    if least <= 0 or flops < REPEATS * least:
        return None
    left = [f for row in inputs.rows for f in row.flags if isinstance(f, LeftUnsharded)]
    undivided = set().union(*map(_tried, left))
    used = {axis for row in inputs.rows for entry in row.spec for axis in axes_of(entry)}
    axes = repeating_axes(sizes, used - undivided, flops / least)
    if not axes:  # every axis splits something: FLOPs counted apart, not work repeated
        return None
    devices = math.prod(sizes.values())
    if undivided & set(axes):
        cause = [f for f in left if _tried(f) & set(axes)]
        return undivided_sentence(axes, sizes, cause, flops, least, devices)
    return repeated_sentence(axes, sizes, flops, least, devices, rule=batch_rule(inputs, batch))


#: The logical name of an expert layer's stacked experts (examples/moe.py's; MaxText's
#: is "exp"), whose mesh axis is the expert axis (new in 0.8).
EXPERT = "expert"


def _expert_rows(inputs: Plan) -> dict[str, list[PlanRow]]:
    """The arguments named logically with an `EXPERT` dimension, by the mesh axis (of
    size > 1) that dimension is split over."""
    sizes = dict(inputs.mesh.shape) if inputs.mesh is not None else {}
    found: dict[str, list[PlanRow]] = {}
    for row in inputs.rows:
        named = zip(row.names or (), row.spec, strict=False) if row.logical else ()
        for axis in {a for name, entry in named if name == EXPERT for a in axes_of(entry)}:
            if sizes.get(axis, 1) > 1:
                found.setdefault(axis, []).append(row)
    return found


def _a_weight(gather: Collective, rows: Sequence[PlanRow]) -> bool:
    """Whether an all-gather has the size of one of `rows` gathered whole over its
    group: all its layers at once, or one layer of its leading stacked dimension
    (where the experts are not it). At the row's own width: a weight cast narrower
    before its gather (f32 params gathered in bf16) is not recognised, since an
    activation of that size would be taken for it too."""
    for row in rows:
        layers = row.shape[0] if row.names and row.names[0] != EXPERT and row.shape else 1
        whole = row.device_bytes * gather.group
        if any(gather.bytes * stacked == whole for stacked in {1, max(layers, 1)}):
            return True
    return False


def experts_gathered(
    ops: Sequence[Collective], inputs: Plan, *, path: Callable[[str], str] = str
) -> str | None:
    """Where the compiler all-gathers the expert weights over their expert axis
    instead of moving the tokens to them by all-to-all, the sentence that says so:
    the collectives, the weights and the rule to change (new in 0.8); else None.

    Each device then runs every expert on its own tokens: the expert axis acts as
    FSDP's, and its all-gathers (and the gradients' reduce-scatters) grow with the
    experts. The usual cause is the batch also mapped onto that axis (MaxText's
    Mixtral regression, maxtext PR 4179); a grouped matmul (`jax.lax.ragged_dot`)
    the compiler partitions alone gathers its weights however the batch is mapped.
    Said where an all-gather over the axis has the size of an expert weight gathered
    whole over its group (one layer's, or all layers', at its own width): the
    collectives name no arrays, so an activation of just that size would be taken
    for one, and a weight cast narrower before its gather is missed. `ops`: each
    collective once, at one run's size (`Schedule.collectives`); `path` writes a
    row's path as the caller knows it (a step's: ``args[0]/wi``).
    """
    for axis, rows in _expert_rows(inputs).items():
        gathers = [c for c in _over(ops, "all-gather", axis) if _a_weight(c, rows)]
        if gathers:
            scatters = [
                c
                for c in _over(ops, "reduce-scatter", axis)
                if _a_weight(c._replace(bytes=c.bytes * c.group), rows)
            ]
            paths = [path(r.path) for r in rows]
            return _gathered_sentence(axis, gathers, scatters, paths, inputs)
    return None


def _over(collectives: Sequence[Collective], kind: str, axis: str) -> list[Collective]:
    return [c for c in collectives if c.kind == kind and axis in c.axes]


def _gathered_sentence(
    axis: str,
    gathers: Sequence[Collective],
    scatters: Sequence[Collective],
    paths: Sequence[str],
    inputs: Plan,
) -> str:
    """`experts_gathered`'s sentence."""
    count = sum(c.count for c in gathers)
    weights = ", ".join(dict.fromkeys(paths))
    said = (
        f"the compiler all-gathers the expert weights over {axis!r} instead of moving the "
        f"tokens to them by all-to-all: {count} all-gather{'' if count == 1 else 's'} of "
        f"{_sizes(gathers)}"
    )
    if scatters:
        scattered = sum(c.count for c in scatters)
        said += f" and {scattered} reduce-scatter{'' if scattered == 1 else 's'}"
    said += f", for {weights}; each device runs every expert. "
    others = _also_on(inputs, axis)
    if others:
        return said + (
            f"{', '.join(map(repr, others))} {'is' if len(others) == 1 else 'are'} also "
            f"mapped onto {axis!r}: change that rule to leave {axis!r} to the experts "
            "(the batch over the data axes alone), or dispatch the tokens by all-to-all "
            f"under shard_map over {axis!r} (examples/moe.py)"
        )
    return said + (
        "a grouped matmul (jax.lax.ragged_dot) that the compiler partitions itself "
        "gathers its weights: dispatch the tokens to their experts by all-to-all under "
        f"shard_map over {axis!r} (examples/moe.py)"
    )


def _sizes(ops: Sequence[Collective]) -> str:
    """``4.0 MiB each``, or ``2.0 MiB to 4.0 MiB`` where they differ."""
    low, high = min(c.bytes for c in ops), max(c.bytes for c in ops)
    return f"{size_text(low)} each" if low == high else f"{size_text(low)} to {size_text(high)}"


def _also_on(inputs: Plan, axis: str) -> list[str]:
    """The logical names besides `EXPERT` whose rule maps them onto `axis`."""
    names: dict[str, None] = {}
    for row in inputs.rows:
        if not row.logical or not row.names:
            continue
        for name, entry in zip(row.names, row.spec, strict=False):
            if isinstance(name, str) and name != EXPERT and axis in axes_of(entry):
                names[name] = None
    return list(names)
