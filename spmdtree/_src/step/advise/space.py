"""The space of candidates (0.7: cut from advise.py): the layouts a device count allows
(`layouts`), and the candidates over meshes, rules, batches and options (`candidates`),
checked as advise takes them.
"""

from __future__ import annotations

import itertools
import math
import numbers
import sys
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import cast, overload

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from spmdtree._src.errors import Mistake, fmt, public
from spmdtree._src.pipeline import STAGE
from spmdtree._src.rules import AnyMesh, Rules
from spmdtree._src.sequences import CONTEXT
from spmdtree._src.step.advise.records import (
    Candidate,
    label_of,
)
from spmdtree._src.step.preflight import EXPERT


def _sizes_allowed(
    axes: Sequence[str], sizes: Mapping[str, int | tuple[int, int]] | None
) -> dict[str, tuple[int, int]]:
    """Each axis's inclusive bounds, checked."""
    allowed = {axis: (1, sys.maxsize) for axis in axes}
    for axis, size in (sizes or {}).items():
        if axis not in allowed:
            raise Mistake(
                ValueError,
                f"sizes names {axis!r}, which is not one of the axes {tuple(axes)}.",
            )
        bounds = (size, size) if isinstance(size, int) else tuple(size)
        ok = len(bounds) == 2 and all(isinstance(b, int) and b >= 1 for b in bounds)
        if not ok or bounds[0] > bounds[1]:
            raise Mistake(
                ValueError,
                f"sizes[{axis!r}] is {size!r}; expected an int >= 1 or (lo, hi) with "
                "1 <= lo <= hi (inclusive).",
            )
        allowed[axis] = (bounds[0], bounds[1])
    return allowed


def _factorizations(devices: int, count: int) -> Iterable[tuple[int, ...]]:
    """Every way to write `devices` as a product of `count` ints, in lexicographic order."""
    if count == 1:
        yield (devices,)
        return
    for first in range(1, devices + 1):
        if devices % first == 0:
            for rest in _factorizations(devices // first, count - 1):
                yield (first, *rest)


@overload
def layouts(
    devices: int,
    axes: Sequence[str] = ...,
    *,
    sizes: Mapping[str, int | tuple[int, int]] | None = ...,
    axis_types: AxisType | Sequence[AxisType] | None = ...,
) -> list[AbstractMesh]: ...


@overload
def layouts(
    devices: Sequence[jax.Device],
    axes: Sequence[str] = ...,
    *,
    sizes: Mapping[str, int | tuple[int, int]] | None = ...,
    axis_types: AxisType | Sequence[AxisType] | None = ...,
) -> list[Mesh]: ...


@public
def layouts(
    devices: int | Sequence[jax.Device],
    axes: Sequence[str] = ("data", "fsdp", "tensor"),
    *,
    sizes: Mapping[str, int | tuple[int, int]] | None = None,
    axis_types: AxisType | Sequence[AxisType] | None = None,
) -> list[AbstractMesh] | list[Mesh]:
    """Every way to lay `devices` out as a product over `axes`: abstract meshes for a
    count, real ones over the devices given (new in 0.8: what `advise(measure=k)`
    runs its best candidates on).

    In lexicographic order of the axis sizes (the first axis smallest first).

    Args:
        devices: how many devices (abstract meshes, to plan with), or the devices
            themselves, a list, tuple or array of them, e.g. ``jax.local_devices()``
            (`Mesh`es over them to run on, laid out by `jax.make_mesh` where their
            topology takes the shape, else in the order given).
        axes: the mesh axis names, in mesh order.
        sizes: per axis an int (fixed) or ``(lo, hi)`` (inclusive bounds), e.g.
            ``{"tensor": (1, 8)}``.
        axis_types: one `AxisType` for every axis, or one per axis; None: Auto on
            every axis, whatever the jax version's default.

    Returns:
        The meshes.

    Raises:
        ValueError: for devices < 1 (no devices, a device twice, devices of two
            platforms), repeated axes, a size naming no axis, bad bounds, or bounds
            that no factorization meets.
        TypeError: for devices that are neither a count nor jax devices.

    Example:
        >>> import jax, spmdtree as st
        >>> [tuple(m.shape.values()) for m in st.layouts(8, ("data", "tensor"), sizes={"tensor": (2, 4)})]
        [(2, 4), (4, 2)]
        >>> real = st.layouts(jax.devices(), ("data", "tensor"), sizes={"tensor": 1})
        >>> [(type(m).__name__, m.devices.size == jax.device_count()) for m in real]
        [('Mesh', True)]
    """
    given = _devices(devices)
    count = len(given) if given is not None else int(cast(int, devices))
    if count < 1:
        raise Mistake(ValueError, f"devices is {devices!r}; expected an int >= 1 or jax devices.")
    axes = tuple(axes)
    if not axes or len(set(axes)) != len(axes) or not all(isinstance(a, str) for a in axes):
        raise Mistake(ValueError, f"axes is {axes!r}; expected distinct axis names.")
    allowed = _sizes_allowed(axes, sizes)
    types = (AxisType.Auto,) * len(axes) if axis_types is None else axis_types
    types = (types,) * len(axes) if isinstance(types, AxisType) else tuple(types)
    if len(types) != len(axes):
        raise Mistake(ValueError, f"axis_types is {axis_types!r}; expected one per axis {axes}.")
    shapes = [
        shape
        for shape in _factorizations(count, len(axes))
        if all(lo <= n <= hi for n, (lo, hi) in zip(shape, allowed.values(), strict=True))
    ]
    if not shapes:
        raise Mistake(
            ValueError,
            f"no way to write {count} devices as a product over {axes} meets the sizes "
            f"{dict(sizes or {})}. Widen the bounds.",
        )
    if given is None:
        return [AbstractMesh(shape, axes, axis_types=types) for shape in shapes]
    return [_mesh_over(given, shape, axes, types) for shape in shapes]


def _devices(devices: object) -> list[jax.Device] | None:
    """`layouts`' devices as a list where they are jax devices (a list, a tuple, or an
    array of them, a `Mesh`'s ``devices``), each once and of one platform; None for a
    count."""
    if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
        return None
    if isinstance(devices, np.ndarray):
        devices = list(devices.flat)
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        listed = list(devices)
        if not listed:
            raise Mistake(ValueError, "devices is empty; expected jax devices (jax.devices()).")
        if all(isinstance(d, jax.Device) for d in listed):
            _check_distinct(listed)
            return listed
    raise Mistake(
        TypeError,
        f"devices is {fmt(devices)}; expected how many (an int >= 1) or the devices "
        "themselves, a list or tuple of jax devices (jax.local_devices()).",
    )


def _check_distinct(devices: Sequence[jax.Device]) -> None:
    """Refuses devices listed twice, or of more than one platform."""
    seen = {d.id for d in devices}
    if len(seen) != len(devices):
        twice = next(d for d in devices if sum(e.id == d.id for e in devices) > 1)
        raise Mistake(
            ValueError,
            f"devices lists {twice} more than once; give each device once (jax.local_devices()).",
        )
    platforms = sorted({d.platform for d in devices})
    if len(platforms) > 1:
        raise Mistake(
            ValueError,
            f"devices are of the platforms {', '.join(platforms)}; give devices of one "
            "platform (jax.local_devices(backend=...)).",
        )


def _mesh_over(
    devices: Sequence[jax.Device],
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    types: tuple[AxisType, ...],
) -> Mesh:
    """A `Mesh` of `shape` over `devices`: as `jax.make_mesh` lays them out for the
    chips' links where it can, else in the order given."""
    try:
        return jax.make_mesh(shape, axes, types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):  # a shape its topology refuses
        return Mesh(np.array(devices, dtype=object).reshape(shape), axes, axis_types=types)


def count_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def checked_candidates(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The candidates, each a `Candidate` with a mesh and a batch >= 1, all over one
    device count (a ranking compares layouts of one job)."""
    candidates = list(candidates)
    if not candidates:
        raise Mistake(ValueError, "candidates is empty; give at least one st.Candidate.")
    for c in candidates:
        if (
            not isinstance(c, Candidate)
            or not isinstance(c.mesh, (AbstractMesh, Mesh))
            or not isinstance(c.batch, int)
            or c.batch < 1
        ):
            raise Mistake(
                TypeError if not isinstance(c, Candidate) else ValueError,
                f"candidates holds {c!r}; expected st.Candidate(mesh, rules, batch) with a "
                "jax.sharding.AbstractMesh (or Mesh) and a batch >= 1.",
            )
        _check_options(c)
    counts: dict[int, list[Candidate]] = {}
    for c in candidates:
        counts.setdefault(math.prod(c.mesh.shape.values()), []).append(c)
    if len(counts) > 1:
        said = ", ".join(
            f"{n} ({len(cs)} candidate{'' if len(cs) == 1 else 's'}, such as {label_of(cs[0])!r})"
            for n, cs in counts.items()
        )
        raise Mistake(
            ValueError,
            f"candidates lay out different device counts: {said}. A ranking compares the "
            "layouts of one job: pass candidates of one device count (st.layouts(n) gives "
            "them), and call advise once per count.",
        )
    return candidates


def _check_options(candidate: Candidate) -> None:
    """A candidate's options: a mapping of names to hashable values, or None."""
    options = candidate.options
    if options is None:
        return
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise Mistake(
            TypeError,
            f"the options of candidate {label_of(candidate._replace(options=None))!r} are "
            f"{options!r}; expected a mapping of names to values ({{'remat': 'full'}}).",
        )
    for name, value in options.items():
        if not _hashable(value):
            raise Mistake(
                TypeError,
                f"option {name!r} of candidate {label_of(candidate._replace(options=None))!r} "
                f"is {value!r}, which is not hashable; give a value that is (a string, a "
                "number, a tuple).",
            )


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


#: The options `make_step` reads for a pipeline (new in 0.8), which `candidates`
#: checks against the stage axis (`STAGE`), the layers and the batch.
MICROBATCHES, REPEATS = "microbatches", "repeats"


@public
def candidates(
    meshes: Sequence[AnyMesh],
    rules: Rules | None,
    batches: int | Sequence[int],
    *,
    length: int | None = None,
    layers: int | None = None,
    experts: int | None = None,
    **options: Sequence[Hashable],
) -> list[Candidate]:
    """Every combination of `meshes`, `batches` and each option's values, as
    `Candidate`s, in a fixed order (meshes, then batches, then the options in the
    order given; new in 0.6), but those no pipeline can run (new in 0.8).

    A pipeline's stages lie along the mesh axis ``"stage"`` (1 where a mesh has
    none), and ``make_step`` reads its counts from the options ``microbatches``
    and ``repeats`` (`st.pipeline`, `st.stages`). Left out: a combination whose
    microbatches are not a multiple of its stages or do not divide its batch
    (``microbatches`` alone is gradient accumulation's count, which must divide
    the batch too), repeats over 1 without stages (the same step as one repeat),
    and, with `layers`, one whose stages x repeats do not divide the layers.
    (advise then rules out, from each one's plan, microbatches that its batch's
    mesh axes do not divide.) A sequence split lies along the mesh axis
    ``"context"`` (`st.context_attention`), which must divide `length`; experts
    along ``"expert"``, which must divide `experts` (new in 0.8).

    Args:
        meshes: the layouts (`layouts` gives them).
        rules: the rules for every candidate.
        batches: a global batch, or several.
        length: the sequence length (for tokens per second), which each
            candidate's context axis must divide (new in 0.8); None: not
            checked.
        layers: the model's layers, which the stages (x repeats) of each
            candidate must divide (new in 0.8); None: not checked.
        experts: the experts of each expert layer, which each candidate's
            expert axis must divide (new in 0.8); None: not checked.
        **options: each option's values, e.g. ``remat=("full", "minimal"),
            microbatches=(1, 4)``; ``make_step(candidate)`` reads
            ``candidate.options``.

    Returns:
        The candidates, ``len(meshes) x len(batches) x`` each option's count,
        less those left out.

    Raises:
        TypeError: for an option given one value rather than a sequence of them.
        ValueError: for `layers` or `experts` < 1, or where every combination is
            left out (the message says why the first was).

    Example:
        >>> import spmdtree as st
        >>> found = st.candidates(st.layouts(8, ("data", "fsdp"))[:2], None, 64, remat=("full", "none"))
        >>> [(dict(c.mesh.shape)["data"], c.batch, c.options) for c in found]
        [(1, 64, {'remat': 'full'}), (1, 64, {'remat': 'none'}), (2, 64, {'remat': 'full'}), (2, 64, {'remat': 'none'})]
        >>> piped = st.candidates(st.layouts(8, ("data", "stage")), None, 32, layers=12, microbatches=(4, 8))
        >>> [(dict(c.mesh.shape)["stage"], c.options["microbatches"]) for c in piped]
        [(4, 4), (4, 8), (2, 4), (2, 8), (1, 4), (1, 8)]
        >>> split = st.candidates(st.layouts(8, ("expert", "data")), None, 32, experts=4)
        >>> [dict(c.mesh.shape)["expert"] for c in split]
        [1, 2, 4]
    """
    for name, values in options.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise Mistake(
                TypeError if not isinstance(values, Sequence) or values else ValueError,
                f"option {name} is {values!r}; expected a sequence of one or more of its "
                f"values, e.g. {name}=({values!r},)."
                if values
                else f"option {name} has no values; give one or more, or leave it out.",
            )
    sizes = (
        (int(batches),)
        if isinstance(batches, numbers.Integral)
        else tuple(cast(Sequence[int], batches))
    )
    for name, count in (("layers", layers), ("experts", experts)):
        if count is not None and not count_or_none(count):
            raise Mistake(
                ValueError if isinstance(count, int) and not isinstance(count, bool) else TypeError,
                f"{name} is {count!r}; expected an int >= 1 (or None).",
            )
    names = tuple(options)
    every = [
        Candidate(mesh, rules, batch, length, options=dict(zip(names, chosen, strict=True)) or None)
        for mesh in meshes
        for batch in sizes
        for chosen in itertools.product(*options.values())
    ]
    kept = [c for c in every if _unrunnable(c, layers, experts) is None]
    if every and not kept:
        raise Mistake(
            ValueError,
            f"no combination can run: {_unrunnable(every[0], layers, experts)} "
            f"({label_of(every[0])}, batch {every[0].batch}), and every other is left out "
            "likewise. Give microbatches that are a multiple of the stages and divide the "
            "batch, stages x repeats that divide the layers, a context axis that divides "
            "the length and an expert axis that divides the experts.",
        )
    return kept


def _unrunnable(candidate: Candidate, layers: int | None, experts: int | None) -> str | None:
    """Why no pipeline (nor accumulation, nor a sequence or expert split) can run a
    candidate, or None."""
    options = candidate.options or {}
    sizes = dict(candidate.mesh.shape)
    stages, context, split = sizes.get(STAGE, 1), sizes.get(CONTEXT, 1), sizes.get(EXPERT, 1)
    if candidate.length is not None and candidate.length % context:
        return f"the context axis {context} does not divide the length {candidate.length}"
    if experts is not None and experts % split:
        return f"the expert axis {split} does not divide {experts} experts"
    micro, repeats = options.get(MICROBATCHES), options.get(REPEATS, 1)
    plural = "s" * (stages > 1)
    for name, value in ((MICROBATCHES, micro), (REPEATS, repeats)):
        if isinstance(value, numbers.Integral) and value < 1:
            return f"{name} {value}: there must be at least 1"
    if isinstance(micro, numbers.Integral) and micro % stages:
        return f"{micro} microbatches are not a multiple of {stages} stage{plural}"
    if isinstance(micro, numbers.Integral) and candidate.batch % micro:
        return f"{micro} microbatches do not divide the batch {candidate.batch}"
    if not isinstance(repeats, numbers.Integral):
        return None
    if repeats > 1 and stages == 1:
        return f"{repeats} repeats without stages (its mesh has no {STAGE!r} axis over 1)"
    if layers is not None and layers % (stages * repeats):
        return f"{stages} stage{plural} x {repeats} repeats do not divide {layers} layers"
    return None
