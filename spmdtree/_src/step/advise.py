"""Choosing a layout: `advise` preflights candidate layouts and ranks them by a roofline.

Each candidate (a mesh, rules, a batch) is first planned: one whose arrays
alone exceed the budget is rejected without compiling. The rest are traced
here, one after the other, and compiled in parallel subprocesses on
preflight's own export path (each distinct step once), then timed with
`StepPlan.time`. A candidate that fails is a row with its message.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jax.sharding import AbstractMesh, AxisType, Mesh

from spmdtree._src.errors import Mistake, public
from spmdtree._src.rules import AnyMesh, Rules
from spmdtree._src.step.hardware import Hardware, StepTime
from spmdtree._src.step.preflight import StepPlan, Where, step_plan, target_of, where
from spmdtree._src.step.targets import Analysis, check_compiler, compile_child, compile_here, place
from spmdtree._src.step.trace import Arguments, Traced, arguments, trace
from spmdtree._src.text import advice_table, size_text

#: A compile subprocess's analysis, to come.
_Child = concurrent.futures.Future[Analysis]

#: The verdicts, best first.
VERDICTS = ("fits", "may fit", "over budget", "does not compile")

#: The memory one compile subprocess takes (measured: ~0.7 GB at 2,048 devices,
#: about flat in the device count), to bound how many run at once.
CHILD_BYTES = 700 * 2**20


class Candidate(NamedTuple):
    """One layout to try: a mesh, its rules, a global batch.

    Attributes:
        mesh: an `AbstractMesh` (a `Mesh` stands for its ``abstract_mesh``).
        rules: the rules for the step's logical names.
        batch: the global batch (sequences).
        length: the sequence length, where there is one (for tokens per second).
        label: what the table calls it (default: the mesh's axis sizes).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "tensor"))
        >>> st.Candidate(mesh, [("batch", "data")], batch=64, length=1024).length
        1024
    """

    mesh: AnyMesh
    rules: Rules | None
    batch: int
    length: int | None = None
    label: str = ""


class AdviceRow(NamedTuple):
    """One candidate's outcome in an `Advice`.

    Attributes:
        candidate: the `Candidate`.
        verdict: ``"fits"``, ``"may fit"``, ``"over budget"`` or ``"does not compile"``.
        reason: one sentence: the peak against the budget, the step's first
            flag, or JAX's or spmdtree's message.
        step: the `StepPlan`, or None (not compiled).
        time: the `StepTime`, or None.
        tokens_per_second: batch x length / bound seconds, where the length is
            known and the step compiled.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
        >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "does not compile", "a typo", None, None, None)
        >>> row.verdict
        'does not compile'
    """

    candidate: Candidate
    verdict: str
    reason: str
    step: StepPlan | None
    time: StepTime | None
    tokens_per_second: float | None


@dataclasses.dataclass(frozen=True)
class Advice:
    """Candidates ranked: those that fit by their bound per sequence of the batch
    (by the bound itself where the batches are equal; equal bounds by the serial
    time, compute + collectives), then those that may fit,
    then those over budget (compiled, then not), then those that do not compile.

    Attributes:
        rows: one `AdviceRow` per candidate, ranked.
        compiles: how many compiles ran (rejected and repeated steps run none).
        hardware: the `Hardware` they were timed on.
        budget_bytes: the memory budget per device.
        note: what `confirm` did: which rows the target's compiler confirmed, or
            why none were (its compiler is not installed) (new in 0.4).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
        >>> row = st.AdviceRow(st.Candidate(mesh, None, 8), "does not compile", "a typo", None, None, None)
        >>> advice = st.Advice((row,), 0, st.hardware("h100"), 2**30)
        >>> advice.best is None, advice.compiles
        (True, 0)
    """

    rows: tuple[AdviceRow, ...]
    compiles: int
    hardware: Hardware
    budget_bytes: int
    note: str = ""

    @property
    def best(self) -> AdviceRow | None:
        """The first row that fits, else None."""
        return next((row for row in self.rows if row.verdict == "fits"), None)

    def __str__(self) -> str:
        return advice_table(self)


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


@public
def layouts(
    devices: int,
    axes: Sequence[str] = ("data", "fsdp", "tensor"),
    *,
    sizes: Mapping[str, int | tuple[int, int]] | None = None,
    axis_types: AxisType | Sequence[AxisType] | None = None,
) -> list[AbstractMesh]:
    """Every way to lay `devices` out as a product over `axes`, as abstract meshes.

    In lexicographic order of the axis sizes (the first axis smallest first).

    Args:
        devices: how many devices.
        axes: the mesh axis names, in mesh order.
        sizes: per axis an int (fixed) or ``(lo, hi)`` (inclusive bounds), e.g.
            ``{"tensor": (1, 8)}``.
        axis_types: one `AxisType` for every axis, or one per axis; None: Auto on
            every axis, whatever the jax version's default.

    Returns:
        The meshes.

    Raises:
        ValueError: for devices < 1, repeated axes, a size naming no axis,
            bad bounds, or bounds that no factorization meets.

    Example:
        >>> import spmdtree as st
        >>> [tuple(m.shape.values()) for m in st.layouts(8, ("data", "tensor"), sizes={"tensor": (2, 4)})]
        [(2, 4), (4, 2)]
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise Mistake(ValueError, f"devices is {devices!r}; expected an int >= 1.")
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
        for shape in _factorizations(devices, len(axes))
        if all(lo <= n <= hi for n, (lo, hi) in zip(shape, allowed.values(), strict=True))
    ]
    if not shapes:
        raise Mistake(
            ValueError,
            f"no way to write {devices} devices as a product over {axes} meets the sizes "
            f"{dict(sizes or {})}. Widen the bounds.",
        )
    return [AbstractMesh(shape, axes, axis_types=types) for shape in shapes]


def default_jobs() -> int:
    """The CPU count, fewer where memory is short (a compile takes ~0.7 GB)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            free = next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")
            )
    except (OSError, StopIteration):
        free = sys.maxsize
    return max(1, min(cpus or 1, free // CHILD_BYTES))


def label_of(candidate: Candidate) -> str:
    """The candidate's label, or its mesh's axis sizes: ``data 2 x fsdp 4``."""
    return candidate.label or " x ".join(f"{a} {n}" for a, n in candidate.mesh.shape.items())


@dataclasses.dataclass(frozen=True)
class _Step:
    """A candidate's step, planned: what tracing it (again, for a target) takes."""

    fn: Callable[..., Any]
    planned: Arguments
    out_shardings: Any


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A candidate traced and exported, waiting for its compile subprocess."""

    index: int
    traced: Traced
    where: Where


@dataclasses.dataclass
class _Search:
    """What the rows are judged by, and the progress lines."""

    hardware: Hardware
    devices_per_node: int | None
    budget: int
    progress: bool
    candidates: list[Candidate]
    rows: dict[int, AdviceRow] = dataclasses.field(default_factory=dict)
    steps: dict[int, _Step] = dataclasses.field(default_factory=dict)
    compiles: int = 0

    def row(self, index: int, verdict: str, reason: str, step: StepPlan | None = None) -> None:
        candidate = self.candidates[index]
        timed = None
        if step is not None:
            try:
                timed = step.time(self.hardware, devices_per_node=self.devices_per_node)
            except ValueError as e:  # the hardware lacks a link kind: said, not lost
                reason = f"{reason}; not timed: {e}"
        if timed is not None and verdict == "fits":
            reason += "; " + _bound_by(timed)
        tokens = None
        if timed is not None and candidate.length is not None and timed.bound_seconds > 0:
            tokens = candidate.batch * candidate.length / timed.bound_seconds
        self.rows[index] = AdviceRow(candidate, verdict, reason, step, timed, tokens)
        if self.progress:
            bound = f", bound {timed.bound_seconds:.3g} s" if timed is not None else ""
            said = reason if len(reason) <= 120 else reason[:119] + "…"
            print(
                f"advise [{len(self.rows)}/{len(self.candidates)}] {label_of(candidate)}, "
                f"batch {candidate.batch}: {verdict}{bound} ({said})",
                file=sys.stderr,
                flush=True,
            )

    def judge(self, index: int, step: StepPlan) -> None:
        """The verdict on a compiled step, from its peak against the budget."""
        peak, budget = size_text(step.peak_bytes), size_text(self.budget)
        if step.fits(self.budget):
            # the arguments' own flags first (a batch left unsharded is what a
            # reader must see), else the peak and what bounds the step
            flags = [f"{row.path}: {flag}" for row in step.inputs.rows for flag in row.flags]
            self.row(index, "fits", flags[0] if flags else f"peak {peak} <= {budget} budget", step)
        elif step.peak_bytes - step.overstated_bytes <= self.budget:
            over = size_text(step.overstated_bytes)
            self.row(
                index, "may fit", f"peak {peak} > {budget} budget, overstated by up to {over}", step
            )
        else:
            self.row(index, "over budget", f"peak {peak} > {budget} budget", step)

    def rank(self, index: int) -> tuple[int, int, float, float, int]:
        """The sort key of a row: its verdict, the target's figures before the CPU
        estimate's, then its bound per sequence."""
        row = self.rows[index]
        rank = VERDICTS.index(row.verdict)
        rank += rank >= 3 or (rank == 2 and row.step is None)  # compiled over budget first
        estimate = int(row.step is not None and row.step.backend == "cpu")
        if rank >= 2 or row.time is None:
            return (rank, estimate, math.inf if rank < 2 else 0.0, 0.0, index)
        # per sequence: at one batch, the bound's order; across batches, the
        # step time alone would always favour the smaller batch. Equal bounds
        # (compute-bound) rank by the serial time: less to overlap.
        per = row.candidate.batch
        return (rank, estimate, row.time.bound_seconds / per, row.time.serial_seconds / per, index)

    def ranked(self) -> tuple[AdviceRow, ...]:
        return tuple(self.rows[i] for i in sorted(self.rows, key=self.rank))


def _bound_by(timed: StepTime) -> str:
    """``bound by compute`` or ``bound by collectives, most over fsdp``."""
    if timed.compute_seconds >= timed.comm_seconds:
        return "bound by compute"
    axes = max(timed.comm_by_axes, key=lambda a: timed.comm_by_axes[a])
    return f"bound by collectives, most over {'+'.join(axes) or 'no axis'}"


def _message(error: BaseException) -> str:
    return (
        str(error)
        if isinstance(error, (ValueError, TypeError))
        else f"{type(error).__name__}: {error}"
    )


#: What make_step's kwargs may hold: preflight's own, but the mesh and rules.
_KWARGS = ("params", "donate_argnums", "static_argnums", "out_shardings")


def _first_pass(
    search: _Search, index: int, make_step: Callable[[Candidate], Any]
) -> _Pending | None:
    """Plans the candidate, and traces and exports its step (or compiles it here, on a
    mesh this process has the devices for): a pending compile, or None (a row)."""
    candidate = search.candidates[index]
    try:
        fn, args, kwargs = make_step(candidate)
        kwargs = dict(kwargs)
    except Exception as e:
        search.row(index, "does not compile", f"make_step raised {_message(e)}")
        return None
    odd = sorted(set(kwargs) - set(_KWARGS))
    if odd:
        said = "advise passes each candidate's mesh and rules itself. Leave them out."
        if not {"mesh", "rules"} & set(odd):
            said = f"preflight takes only {', '.join(_KWARGS)} there."
        raise Mistake(ValueError, f"make_step returned kwargs with {odd}; {said}")
    mesh = _abstract(candidate)
    try:
        planned = arguments(
            tuple(args),
            mesh,
            candidate.rules,
            params=kwargs.get("params"),
            donate_argnums=kwargs.get("donate_argnums", ()),
            static_argnums=kwargs.get("static_argnums", ()),
        )
        arrays = planned.plan.device_bytes
        if arrays > search.budget:
            said = f"arrays alone {size_text(arrays)} > {size_text(search.budget)}, not compiled"
            search.row(index, "over budget", said)
            return None
        search.steps[index] = _Step(fn, planned, kwargs.get("out_shardings"))
        at, here = where(mesh, None, None)
        traced = trace(
            fn, planned, mesh, candidate.rules, out_shardings=kwargs.get("out_shardings"), here=here
        )
        if here is None:
            return _Pending(index, traced, at)
        step = step_plan(traced, compile_here(traced), at)
    except Exception as e:
        search.row(index, "does not compile", _message(e))
        return None
    search.compiles += 1
    search.judge(index, step)
    return None


def _abstract(candidate: Candidate) -> AnyMesh:
    """The mesh a candidate is preflighted on: a `Mesh` stands for its abstract mesh."""
    mesh = candidate.mesh
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh


def _second_pass(search: _Search, pending: _Pending, child: _Child) -> None:
    """The StepPlan of a pending candidate from its subprocess's analysis."""
    try:
        step = step_plan(pending.traced, child.result(), pending.where)
    except Mistake as mistake:
        search.row(pending.index, "does not compile", str(mistake.error("preflight")))
        return
    search.judge(pending.index, step)


def _run(
    search: _Search,
    pendings: Iterable[_Pending | None],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """Starts each pending candidate's compile as it comes (once per distinct step)
    and finishes every candidate whose compile is done between them, so the
    progress lines come as candidates finish."""
    children: dict[tuple[str, Any], _Child] = {}
    waiting: dict[_Child, list[_Pending]] = {}

    def finish(done: Iterable[_Child]) -> None:
        for child in done:
            while waiting[child]:
                _second_pass(search, waiting[child].pop(0), child)

    for pending in pendings:
        if pending is not None:
            placement = pending.where.placement
            if placement is None:
                raise Mistake(ValueError, "a pending compile has no placement.")
            key = (hashlib.sha256(pending.traced.payload).hexdigest(), placement)
            if key not in children:
                children[key] = pool.submit(compile_child, pending.traced.payload, placement)
                waiting[children[key]] = []
                search.compiles += 1
            waiting[children[key]].append(pending)
        finish([child for child in waiting if child.done()])
    finish(concurrent.futures.as_completed(waiting))


def _confirmed(search: _Search, index: int, target: Where) -> _Pending | None:
    """The candidate's step traced again, exported for the target's compiler."""
    candidate, step = search.candidates[index], search.steps[index]
    try:
        traced = trace(
            step.fn,
            step.planned,
            _abstract(candidate),
            candidate.rules,
            out_shardings=step.out_shardings,
            here=None,
            platform=target.platform,
        )
    except Exception as e:
        search.row(index, "does not compile", f"for {target}: {_message(e)}")
        return None
    return _Pending(index, traced, target)


def _confirm(search: _Search, confirm: int, pool: concurrent.futures.ThreadPoolExecutor) -> str:
    """Compiles the best `confirm` screened rows for the hardware's target and judges
    them again on its figures; what the header says of it."""
    if not confirm:
        return ""
    try:
        chosen, per_node = target_of(search.hardware)
        check_compiler(chosen)
    except Mistake as mistake:
        return f"not confirmed: {mistake.error('advise')}"
    per_node = per_node if search.devices_per_node is None else search.devices_per_node
    best = [
        i
        for i in sorted(search.rows, key=search.rank)
        if search.rows[i].step is not None and search.rows[i].verdict in VERDICTS[:2]
    ][:confirm]
    pendings = []
    for index in best:
        try:
            devices = math.prod(search.candidates[index].mesh.shape.values())
            at = Where(place(chosen, devices, per_node))
        except Mistake as mistake:
            search.row(index, "does not compile", str(mistake.error("advise")))
            continue
        pendings.append(_confirmed(search, index, at))
    _run(search, pendings, pool)
    return f"the best {len(best)} confirmed by the {chosen.compiler} compiler for {chosen.name}"


@public
def advise(
    make_step: Callable[[Candidate], tuple[Callable[..., Any], Sequence[Any], Mapping[str, Any]]],
    candidates: Iterable[Candidate],
    *,
    hardware: Hardware,
    devices_per_node: int | None = None,
    budget_bytes: int | None = None,
    jobs: int | None = None,
    progress: bool = True,
    confirm: int = 0,
) -> Advice:
    """Preflights every candidate layout and ranks them by a roofline of each step.

    Each candidate is planned first: one whose arrays alone exceed the budget
    is not compiled. The others are traced here, one after the other, and
    compiled in parallel subprocesses (at most `jobs` at once; each distinct
    step once), then timed with `StepPlan.time`. A candidate whose
    `make_step` or step fails is a row with the message, never an exception.
    One line per candidate goes to stderr as it finishes.

    The times are roofline bounds (peak FLOPs, perfect overlap), not
    predictions: they rank layouts; published runs reach 40-70% of such
    bounds (docs/planning.md).

    Args:
        make_step: ``make_step(candidate) -> (fn, args, kwargs)``, what
            ``preflight(fn, *args, mesh=candidate.mesh, rules=candidate.rules,
            **kwargs)`` takes (kwargs without mesh or rules).
        candidates: the `Candidate` layouts.
        hardware: the `Hardware` to time on (``st.hardware("h100")``).
        devices_per_node: overrides the hardware's.
        budget_bytes: memory per device; None: the hardware's.
        jobs: how many compiles run at once; None: the CPU count, fewer where
            memory is short (a compile takes ~0.7 GB).
        progress: print one line per candidate to stderr.
        confirm: compile the best `confirm` rows that fit (or may) again with the
            hardware's own compiler (`preflight`'s ``target=``) and rank them on
            its figures, ahead of the CPU estimates (new in 0.4). A missing
            compiler is said once, in `Advice.note`.

    Returns:
        The `Advice`, ranked.

    Raises:
        ValueError: for no candidates, bad `jobs`, or kwargs that name the
            mesh or rules.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> def make_step(c):
        ...     x = st.LogicallyPartitioned(jax.ShapeDtypeStruct((c.batch, 512), jnp.float32), ("batch", None))
        ...     w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((512, 512), jnp.float32), (None, "mlp"))
        ...     return (lambda x, w: jnp.sum(jnp.tanh(x.value @ w.value)), (x, w), {})
        >>> rules = [("batch", "data"), ("mlp", "tensor")]
        >>> candidates = [st.Candidate(m, rules, batch=64) for m in st.layouts(4, ("data", "tensor"))]
        >>> advice = st.advise(make_step, candidates, hardware=st.hardware("h100"), progress=False)
        >>> len(advice.rows), advice.compiles, advice.best is not None
        (3, 3, True)
    """
    candidates = list(candidates)
    if not candidates:
        raise Mistake(ValueError, "candidates is empty; give at least one st.Candidate.")
    if not isinstance(hardware, Hardware):
        raise Mistake(TypeError, f"hardware is {hardware!r}; expected a st.Hardware.")
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise Mistake(ValueError, f"jobs is {jobs!r}; expected an int >= 1 (or None).")
    if not isinstance(confirm, int) or isinstance(confirm, bool) or confirm < 0:
        raise Mistake(
            ValueError,
            f"confirm is {confirm!r}; expected an int >= 0: how many of the best rows to "
            "compile again for the hardware's target (0: none).",
        )
    for c in candidates:
        if not isinstance(c, Candidate) or not isinstance(c.batch, int) or c.batch < 1:
            raise Mistake(
                ValueError,
                f"candidates holds {c!r}; expected st.Candidate(mesh, rules, batch) with a "
                "batch >= 1.",
            )
    budget = hardware.memory_bytes if budget_bytes is None else budget_bytes
    search = _Search(hardware, devices_per_node, budget, progress, candidates)
    with concurrent.futures.ThreadPoolExecutor(jobs or default_jobs()) as pool:
        _run(search, (_first_pass(search, i, make_step) for i in range(len(candidates))), pool)
        note = _confirm(search, confirm, pool)
    return Advice(search.ranked(), search.compiles, hardware, budget, note)
