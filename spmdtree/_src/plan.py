"""The sharding plan as data: what each array gets, why, and what it costs.

`plan` computes; `text` renders (`describe`, `str`). Nothing is allocated: a plan
works on `jax.eval_shape` output and on a `jax.sharding.AbstractMesh`, so a
2,048-chip job is planned on a laptop. Its figures are exact: a device holds
exactly `device_bytes` of an array under these shardings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from spmdtree._src.boxes import AxisMetadata, Found, Nested, dtype_of, leaf_test, shape_of
from spmdtree._src.errors import Mistake, public
from spmdtree._src.resolve import (
    AMBIGUOUS,
    FEWER_DIMENSIONS,
    HOST_KINDS,
    INDIVISIBLE,
    PLACEHOLDER,
    Dim,
    Resolution,
    axes_of,
)
from spmdtree._src.rules import (
    UNCONSTRAINED,
    AnyMesh,
    NameTuple,
    PyTree,
    Rules,
)
from spmdtree._src.specs import Walk, resolve_tree
from spmdtree._src.text import (
    Ambiguous,
    Fallback,
    LargeReplicated,
    LeftUnsharded,
    Unmentioned,
    diff_table,
    entries_text,
    plan_table,
    shape_text,
)
from spmdtree._src.trees import KeyPath

_VALUE = jax.tree_util.GetAttrKey("value")


class PlanRow(NamedTuple):
    """One array of the plan.

    Attributes:
        path: the '/'-joined key path (``layers/mlp_in``), as `describe` prints it.
        shape: the array's shape.
        dtype: its dtype.
        names: its box's names, or None for an array in no box.
        spec: the mesh `PartitionSpec` it resolves to.
        shard_shape: the shape of the shard each device holds.
        bytes: its size.
        device_bytes: what one device holds of it, in the memory of its
            `memory_kind` (the host's, for an offloaded array).
        flags: sentences for what needs a look: replicated by a fallback, a
            dimension left unsharded, a large array replicated.
        why: one sentence per dimension: which rule gave it which mesh axes,
            or why each candidate was passed over, or that nothing names it.
        memory_kind: the memory its shards sit in: its box's `memory_kind`,
            a placed array's own, or None for the device's default (new in 0.5).
        logical: whether `names` are logical names, resolved through rules
            (False for mesh-axis names and arrays in no box; new in 0.6).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
        >>> w = st.Partitioned(jax.ShapeDtypeStruct((6, 8), "float32"), ("data", "model"))
        >>> row = st.plan({"w": w}, mesh).rows[0]
        >>> row.path, row.spec, row.shard_shape, row.device_bytes
        ('w', P('data', 'model'), (3, 2), 24)
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    names: NameTuple | None
    spec: PartitionSpec
    shard_shape: tuple[int, ...]
    bytes: int
    device_bytes: int
    flags: tuple[str, ...]
    why: tuple[str, ...]
    memory_kind: str | None = None
    logical: bool = False

    @property
    def on_host(self) -> bool:
        """Whether its shards sit in the host's memory (offloaded), not the device's."""
        return self.memory_kind in HOST_KINDS


class DiffRow(NamedTuple):
    """One array whose layout differs between two plans (or that only one has).

    Attributes:
        path: its key path.
        spec_before: its spec in the first plan (None if only in the second).
        spec_after: its spec in the second plan (None if only in the first).
        device_bytes_before: what a device held of it.
        device_bytes_after: what a device holds of it.
        received_bytes: the most any one device must receive of it: the part
            of its new shard it did not already hold.

    Example:
        >>> import jax, spmdtree as st
        >>> w = {"w": st.Partitioned(jax.ShapeDtypeStruct((8,), "float32"), ("x",))}
        >>> before = st.plan(w, jax.sharding.AbstractMesh((2,), ("x",)))
        >>> after = st.plan(w, jax.sharding.AbstractMesh((4,), ("x",)))
        >>> before.diff(after).rows[0]  # device 1 held [4:8), needs [2:4)
        DiffRow(path='w', spec_before=P('x',), spec_after=P('x',), device_bytes_before=16, device_bytes_after=8, received_bytes=8)
    """

    path: str
    spec_before: PartitionSpec | None
    spec_after: PartitionSpec | None
    device_bytes_before: int
    device_bytes_after: int
    received_bytes: int


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What changes from one plan to another: the cost of a reshard or of a
    restore onto another topology.

    Attributes:
        rows: the arrays whose spec, mesh or device bytes differ.
        device_bytes_before: the most loaded device's bytes in the first plan.
        device_bytes_after: the same in the second.
        received_bytes: what the busiest device must receive in all.

    Example:
        >>> import jax, spmdtree as st
        >>> w = {"w": st.Partitioned(jax.ShapeDtypeStruct((1024,), "float32"), ("x",))}
        >>> before = st.plan(w, jax.sharding.AbstractMesh((2,), ("x",)))
        >>> after = st.plan(w, jax.sharding.AbstractMesh((4,), ("x",)))
        >>> print(before.diff(after))
        path  spec before -> after  bytes/dev before -> after  received
        w     (x) -> (x)            2.0 KiB -> 1.0 KiB          1.0 KiB
        1 array changes its layout
        per device  2.0 KiB -> 1.0 KiB on the most loaded device
        received    1.0 KiB by the busiest device
    """

    rows: tuple[DiffRow, ...]
    device_bytes_before: int
    device_bytes_after: int
    received_bytes: int

    def __str__(self) -> str:
        return diff_table(self)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sharding plan of a tree: one row per array, and the totals.

    Attributes:
        rows: one `PlanRow` per array leaf, in tree order.
        mesh: the mesh (or abstract mesh) planned for, or None.
        total_bytes: the bytes of all arrays.
        device_bytes: what the most loaded device holds in its own memory
            (every device holds an equal part of an array under a
            `NamedSharding`, so this is the sum of the rows' device bytes but
            the offloaded ones; it is what JAX allocates on the device).
        replicated_bytes: the bytes of arrays every device holds whole.
        host_bytes: what the host memory of each device holds of the arrays
            offloaded to it (a host `memory_kind`), apart from `device_bytes`
            (new in 0.5).

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((4,), ("fsdp",))
        >>> tree = {"w": st.Partitioned(jax.ShapeDtypeStruct((8, 8), "float32"), ("fsdp", None))}
        >>> p = st.plan(tree, mesh)
        >>> p.total_bytes, p.device_bytes, p.replicated_bytes
        (256, 64, 0)
    """

    rows: tuple[PlanRow, ...]
    mesh: AnyMesh | None
    total_bytes: int
    device_bytes: int
    replicated_bytes: int
    host_bytes: int = 0

    @public
    def fits(self, budget_bytes: int) -> bool:
        """Whether the most loaded device's bytes of these arrays fit in `budget_bytes`.

        It counts the planned arrays in the device's memory only (params +
        state, say; not those offloaded to the host), not what a step needs besides: activations and the compiler's temporaries are
        most of a training step's memory. `preflight` compiles the step and
        counts those.

        Example:
            >>> import jax, spmdtree as st
            >>> mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
            >>> w = st.Partitioned(jax.ShapeDtypeStruct((1024, 1024), "float32"), ("fsdp", None))
            >>> st.plan({"w": w}, mesh).fits(2**20 // 2)  # 512 KiB per device
            True
        """
        if not isinstance(budget_bytes, (int, np.integer)) or isinstance(budget_bytes, bool):
            raise Mistake(TypeError, f"budget_bytes is {budget_bytes!r}; expected an int of bytes.")
        return self.device_bytes <= budget_bytes

    @public
    def diff(self, other: Plan) -> PlanDiff:
        """What changes from this plan to `other`, matched by path.

        A device's shard is an index range per dimension; a device receives
        the part of its new shard that its old shard does not cover (all of it
        if it was not in the old mesh). Devices are matched by id on a
        concrete mesh and by position (row-major) on an abstract one.

        Example:
            >>> import jax, spmdtree as st
            >>> tree = {"w": st.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), "float32"), ("a", "b"))}
            >>> mesh = jax.sharding.AbstractMesh((4, 2), ("x", "y"))
            >>> before = st.plan(tree, mesh, [("a", "x"), ("b", "y")])
            >>> after = st.plan(tree, mesh, [("a", "y"), ("b", "x")])
            >>> d = before.diff(after)
            >>> d.rows[0].spec_after, d.rows[0].device_bytes_after
            (P('y', 'x'), 32)
            >>> d.received_bytes  # the busiest device held none of its new shard
            32
        """
        if not isinstance(other, Plan):
            raise Mistake(TypeError, f"other is {type(other).__name__}; expected a st.Plan.")
        return _diff(self, other)

    def __str__(self) -> str:
        return plan_table(self)


@public
def plan(
    tree: PyTree,
    mesh: AnyMesh | None = None,
    rules: Rules | None = None,
    *,
    params: PyTree = None,
    large: int = 1 << 20,
) -> Plan:
    """The sharding plan of a tree, as data, computed without allocating anything.

    Each array leaf gets a `PlanRow`: its key path, shape, dtype, names, the
    mesh spec they resolve to, the shard each device holds and its bytes,
    flags for what needs a look, and why each dimension got its mesh axes.
    Works on arrays and on `jax.eval_shape` output, on a `Mesh` and on a
    `jax.sharding.AbstractMesh` alike. Resolution is `to_sharding`'s, but a
    leaf that would be a rank error (fewer dimensions than names, and no
    `params` to resolve it) is flagged and replicated instead of raising.

    Args:
        tree: a tree with boxes, of arrays or `jax.ShapeDtypeStruct`s.
        mesh: the mesh or abstract mesh; without one only names and specs.
        rules: rules for logical boxes without their own.
        params: the boxed params `tree` was derived from, for reduced states.
        large: the size in bytes from which a replicated array is flagged.

    Returns:
        The `Plan`; ``str(plan)`` is the `describe` table.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((256, 8), ("fsdp", "tensor"))
        >>> w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((50257, 768), "bfloat16"), ("vocab", "embed"))
        >>> p = st.plan({"w": w}, mesh, [("vocab", "tensor"), ("embed", "fsdp")])
        >>> p.rows[0].shard_shape, p.device_bytes
        ((50257, 3), 301542)
        >>> print(p.rows[0].why[0])
        dimension 0 (vocab, size 50257): unsharded: rule 0 ('vocab', 'tensor') passed over, as 8 does not divide 50257
    """
    return make_plan(tree, mesh, rules, params=params, large=large)


def make_plan(
    tree: PyTree, mesh: AnyMesh | None, rules: Rules | None, *, params: PyTree, large: int
) -> Plan:
    """`plan`, for the public functions that render one."""
    return planned_walk(tree, mesh, rules, params=params, large=large, lenient=True)[0]


def planned_walk(
    tree: PyTree,
    mesh: AnyMesh | None,
    rules: Rules | None,
    *,
    params: PyTree,
    large: int,
    lenient: bool,
    argument: str = "tree",
) -> tuple[Plan, Walk]:
    """The plan of `tree` and the resolution pass it was read from (unboxed
    arrays laid out by their own `NamedSharding`s). Not `lenient`: a leaf
    that would be a rank error raises, as in `to_sharding`."""
    found, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf_test())
    flat = ([leaf for _, leaf in found], treedef)
    walk = resolve_tree(
        tree,
        rules,
        mesh=mesh,
        params=params,
        lenient=lenient,
        placed=True,
        warn=False,  # the plan's flags say it (preflight's too)
        flat=flat,
        argument=argument,
    )
    sizes = {} if walk.mesh is None else dict(walk.mesh.shape)
    templates: dict[Any, tuple[Any, ...]] = {}  # a row but its path, per resolution,
    # shape and dtype: shared by the leaves of repeated layers
    rows: list[PlanRow] = []

    def add(path: KeyPath, leaf: Any, res: Found) -> None:
        if type(res) is Nested:  # a box holding a subtree: a row per array inside
            inner = jax.tree_util.tree_flatten_with_path(leaf.unbox(), is_leaf=leaf_test())[0]
            for (where, x), r in zip(inner, res.resolutions, strict=True):
                add((*path, _VALUE, *where), x, r)
        elif type(res) is Resolution:
            value = leaf.unbox() if isinstance(leaf, AxisMetadata) else leaf
            shape, dtype = shape_of(value) or (), np.dtype(dtype_of(value))
            key = (res, shape, dtype)
            found = templates.get(key)
            if found is None:
                found = templates[key] = _template(res, shape, dtype, sizes, large)
            rows.append(PlanRow(_path_text(path), *found))

    for (path, _), leaf, res in zip(found, walk.leaves, walk.resolutions, strict=True):
        add(path, leaf, res)
    replicated = sum(r.bytes for r in rows if walk.mesh is not None and r.shard_shape == r.shape)
    total, host = sum(r.bytes for r in rows), sum(r.device_bytes for r in rows if r.on_host)
    device = sum(r.device_bytes for r in rows) - host
    return Plan(tuple(rows), walk.mesh, total, device, replicated, host), walk


_KEY_FIELD = {
    jax.tree_util.DictKey: "key",
    jax.tree_util.GetAttrKey: "name",
    jax.tree_util.SequenceKey: "idx",
    jax.tree_util.FlattenedIndexKey: "key",
}


def _path_text(path: KeyPath) -> str:
    """``keystr(path, simple=True, separator="/")``, in a quarter of the time."""
    parts = [
        str(getattr(key, _KEY_FIELD[type(key)])) if type(key) in _KEY_FIELD else str(key)
        for key in path
    ]
    return "/".join(parts) or "(root)"


def _template(
    res: Resolution, shape: tuple[int, ...], dtype: np.dtype, sizes: dict[str, int], large: int
) -> tuple[Any, ...]:
    """A `PlanRow`'s fields after its path."""
    spec = tuple(res.spec) + (None,) * (len(shape) - len(tuple(res.spec)))
    shard = tuple(
        dim // math.prod(sizes.get(a, 1) for a in axes_of(None if e is UNCONSTRAINED else e))
        for dim, e in zip(shape, spec, strict=True)
    )
    total = math.prod(shape) * dtype.itemsize
    device = math.prod(shard) * dtype.itemsize
    names = res.kept.names if res.kept is not None else res.names
    flags = list(_fallback_flags(res, shape, names))
    flags += [
        LeftUnsharded(i, d.name, d.size, tuple(p.axes for p in d.passed if p.reason == INDIVISIBLE))
        for i, d in enumerate(res.dims)
        if d.indivisible
    ]
    flags += [Unmentioned(name) for name in res.unmentioned]
    # one device holds everything: nothing is said of replication there (0.7)
    if math.prod(sizes.values()) > 1 and shard == shape and total >= large and math.prod(shape) > 1:
        flags.append(LargeReplicated(total))
    why = _why(res, shape)
    return (
        shape,
        dtype,
        names,
        res.spec,
        shard,
        total,
        device,
        tuple(flags),
        why,
        res.layout.memory_kind,
        res.logical,
    )


def _fallback_flags(res: Resolution, shape: tuple[int, ...], names: NameTuple | None) -> list[str]:
    if res.fallback == FEWER_DIMENSIONS:
        return [Fallback(shape, names or ())]
    if res.fallback == AMBIGUOUS:
        return [Ambiguous(shape, names or ())]
    return []


def _why(res: Resolution, shape: tuple[int, ...]) -> tuple[str, ...]:
    """One sentence per dimension, read from the resolution's record."""
    whole = _whole_why(res)
    if whole is not None:  # one reason for the whole array, said of each dimension
        return tuple(f"dimension {i} (size {n}): {whole}" for i, n in enumerate(shape))
    kept = res.kept.dims if res.kept is not None else None
    return tuple(
        f"dimension {i} ({entries_text((d.name,), 1)}, size {d.size}): "
        + ("" if kept is None else f"kept dimension {kept[i]} of its param; ")
        + _dim_why(d, res.logical)
        for i, d in enumerate(res.dims)
    )


def _whole_why(res: Resolution) -> str | None:
    """Why the whole array is laid out as it is, when one reason serves every dimension."""
    if res.names is None:
        if any(entry is not None for entry in res.spec):
            return f"in no box; its own sharding lays it out as {res.spec}"
        return "in no box, so replicated"
    written = entries_text(res.names, len(res.names))
    if res.fallback == PLACEHOLDER:
        return f"a size-1 placeholder under names ({written}), replicated"
    if res.fallback == FEWER_DIMENSIONS:
        return (
            f"fewer dimensions than names ({written}) and no param to match it (params=), "
            "so replicated by a fallback"
        )
    if res.fallback == AMBIGUOUS:
        param = "" if res.kept is None else f" of shape {shape_text(res.kept.shape)}"
        return f"which dimension of its param{param} it kept is ambiguous, so replicated"
    return None


def _dim_why(d: Dim, logical: bool) -> str:
    passed = "; ".join(
        (f"rule {p.rule} ({d.name!r}, {p.axes!r})" if p.rule is not None else f"{p.axes!r}")
        + " passed over, as "
        + (
            f"{p.size} does not divide {d.size}"
            if p.reason == INDIVISIBLE
            else f"its mesh axes already shard dimension {p.by}"
        )
        for p in d.passed
    )
    if d.rule is not None:
        got = {None: "replicated", UNCONSTRAINED: "to the compiler"}.get(d.axes, repr(d.axes))
        said = f"rule {d.rule} ({d.name!r}, {d.axes!r}) gives it {got}"
        return said + (f"; {passed}" if passed else "")
    if passed:
        return f"unsharded: {passed}"
    if d.name is None:
        return "named None, so replicated"
    if d.name is UNCONSTRAINED:
        return "UNCONSTRAINED, left to the compiler"
    if logical and isinstance(d.name, str):
        return "no rule mentions it, so unsharded"
    return f"mesh axes {d.axes!r} as named"


def _device_boxes(
    mesh: AnyMesh, spec: tuple[Any, ...], shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(starts, stops): each device's index range per dimension, devices in
    the mesh's row-major order."""
    sizes = list(mesh.shape.values())
    names = list(mesh.shape.keys())
    count = math.prod(sizes)
    coords = (
        np.stack(np.unravel_index(np.arange(count), sizes), axis=1)
        if sizes
        else np.zeros((1, 0), int)
    )
    starts, stops = [], []
    for dim, entry in zip(shape, spec, strict=True):
        axes = axes_of(None if entry is UNCONSTRAINED else entry)
        if not axes:
            starts.append(np.zeros(count, np.int64))
            stops.append(np.full(count, dim, np.int64))
            continue
        picked = [coords[:, names.index(a)] for a in axes]
        block = np.ravel_multi_index(picked, [sizes[names.index(a)] for a in axes])
        width = dim // math.prod(sizes[names.index(a)] for a in axes)
        starts.append(block * width)
        stops.append(block * width + width)
    empty = np.zeros((count, 0), np.int64)
    return (np.stack(starts, 1) if starts else empty), (np.stack(stops, 1) if stops else empty)


def _device_keys(mesh: AnyMesh) -> list[Any]:
    """Each device of the mesh in row-major order: its id, or its position if abstract."""
    try:
        devices = mesh.devices
    except (ValueError, AttributeError):  # an AbstractMesh has no devices
        return list(range(math.prod(mesh.shape.values())))
    return [device.id for device in np.asarray(devices).flat]


def _diff(before: Plan, after: Plan) -> PlanDiff:
    if before.mesh is None or after.mesh is None:
        raise Mistake(ValueError, "both plans need a mesh to compare layouts; plan with mesh=.")
    old_keys, new_keys = _device_keys(before.mesh), _device_keys(after.mesh)
    where = {key: i for i, key in enumerate(old_keys)}
    old_of_new = np.array([where.get(key, -1) for key in new_keys])
    received = np.zeros(len(new_keys), np.int64)
    rows = []
    old_rows = {row.path: row for row in before.rows}
    memo: dict[Any, np.ndarray] = {}
    same_mesh = before.mesh == after.mesh
    for row in after.rows:
        old = old_rows.pop(row.path, None)
        changed = old is None or old.spec != row.spec or not same_mesh or old.shape != row.shape
        if not changed and old is not None and old.device_bytes == row.device_bytes:
            continue
        key = (
            row.shape,
            row.dtype,
            row.spec,
            None if old is None else (old.shape, old.dtype, old.spec),
        )
        per_device = memo.get(key)
        if per_device is None:
            per_device = memo[key] = _received(before.mesh, old, after.mesh, row, old_of_new)
        received += per_device
        rows.append(
            DiffRow(
                row.path,
                None if old is None else old.spec,
                row.spec,
                0 if old is None else old.device_bytes,
                row.device_bytes,
                int(per_device.max(initial=0)),
            )
        )
    rows += [DiffRow(r.path, r.spec, None, r.device_bytes, 0, 0) for r in old_rows.values()]
    return PlanDiff(
        tuple(rows), before.device_bytes, after.device_bytes, int(np.max(received, initial=0))
    )


def _received(
    old_mesh: AnyMesh, old: PlanRow | None, new_mesh: AnyMesh, new: PlanRow, old_of_new: np.ndarray
) -> np.ndarray:
    """Bytes each device of the new mesh receives of one array."""
    spec = tuple(new.spec) + (None,) * (len(new.shape) - len(tuple(new.spec)))
    start, stop = _device_boxes(new_mesh, spec, new.shape)
    whole = np.prod(stop - start, axis=1)
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return whole * new.dtype.itemsize
    old_spec = tuple(old.spec) + (None,) * (len(old.shape) - len(tuple(old.spec)))
    old_start, old_stop = _device_boxes(old_mesh, old_spec, old.shape)
    held = old_of_new >= 0
    pick = np.where(held, old_of_new, 0)
    overlap = np.clip(
        np.minimum(stop, old_stop[pick]) - np.maximum(start, old_start[pick]), 0, None
    ).prod(axis=1)
    return (whole - np.where(held, overlap, 0)) * new.dtype.itemsize
