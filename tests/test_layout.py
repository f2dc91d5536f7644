"""A box's memory kind (new in 0.5): carried to its sharding, plan and preflight.

A box's `memory_kind` is a field of the `Layout` its names resolve to, so the
one place a `NamedSharding` is built carries it; the plan counts the bytes of
arrays offloaded to the host apart from the device's, and preflight reads the
host bytes from the compiler's memory stats. The host offload of an optax
adamw state is planned, and preflighted on the CPU estimate and by XLA GPU and
libtpu: both take "pinned_host" without a device; XLA GPU takes "unpinned_host"
too, and libtpu refuses it for an argument (with an internal error, so preflight
refuses it first).
"""

import pickle

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec
from test_targets import has_compiler

import spmdtree as st

HOST = "pinned_host"
N = 256  # the side of the square param: 8 devices hold a 32 x 256 f32 shard each


def mesh_of(kind):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_memory_kind_reaches_every_sharding(axis_type):
    mesh = mesh_of(axis_type)
    tree = {
        "w": st.Partitioned(jnp.zeros((4, 8)), ("data", "model"), memory_kind=HOST),
        "v": st.LogicallyPartitioned(jnp.zeros((8,)), ("mlp",), memory_kind="unpinned_host"),
        "b": st.Partitioned(jnp.zeros((8,)), ("model",)),
    }
    rules = [("mlp", "model")]
    shardings = st.to_sharding(tree, mesh, rules)
    assert shardings["w"] == NamedSharding(mesh, PartitionSpec("data", "model"), memory_kind=HOST)
    assert shardings["v"].memory_kind == "unpinned_host"
    assert shardings["v"].spec == PartitionSpec("model")
    assert shardings["b"] == NamedSharding(mesh, PartitionSpec("model"))  # the device's default
    assert st.to_abstract(tree, mesh, rules)["w"].value.sharding.memory_kind == HOST
    assert tree["w"].get_sharding(mesh).memory_kind == HOST
    placed = st.shard(tree, mesh, rules)
    assert placed["w"].value.sharding.memory_kind == HOST
    assert placed["b"].value.sharding.memory_kind == "device"


def test_the_box_keeps_its_memory_kind_through_every_path():
    box = st.Partitioned(jnp.zeros((2, 4)), ("data", None), memory_kind=HOST)
    assert box.memory_kind == HOST
    assert repr(box) == "Partitioned(f32[2,4], names=('data', None), memory_kind='pinned_host')"
    same = st.Partitioned(box.value, ("data", None), memory_kind=HOST)
    other = st.Partitioned(box.value, ("data", None))
    assert box == same and hash(box) == hash(same)
    assert box != other and other.memory_kind is None
    assert pickle.loads(pickle.dumps(box)).memory_kind == HOST
    assert jax.tree.map(lambda x: x + 1, box).memory_kind == HOST  # pytree aux data
    assert box.replace_boxed(jnp.ones((2, 4))).memory_kind == HOST
    assert box.replace(names=(None, "model")).memory_kind == HOST
    assert box.replace(memory_kind=None) == other
    stacked = box.add_axis(0, {st.PARTITION_NAME: "layers"})  # flax's AxisMetadata protocol
    assert stacked.memory_kind == HOST
    assert stacked.remove_axis(0, {st.PARTITION_NAME: "layers"}).memory_kind == HOST
    logical = st.LogicallyPartitioned(jnp.zeros(4), ("mlp",), rules=[("mlp", "data")])
    assert logical.replace(memory_kind=HOST).memory_kind == HOST
    init = st.with_logical_partitioning(jax.nn.initializers.zeros, ("mlp",), memory_kind=HOST)
    assert init(jax.random.key(0), (4,)).memory_kind == HOST
    init = st.with_partitioning(jax.nn.initializers.zeros, ("data",), memory_kind=HOST)
    assert init(jax.random.key(0), (4,)).memory_kind == HOST


@pytest.mark.parametrize(
    ("build", "kind", "message"),
    [
        (
            lambda kind: st.Partitioned(jnp.zeros(4), ("data",), memory_kind=kind),
            "hbm",
            r"^Partitioned: the box has memory_kind 'hbm'; expected None \(the device's "
            r"default\) or one of 'device', 'pinned_host', 'unpinned_host'\. Pass "
            r"memory_kind='pinned_host' to offload it to the host\.$",
        ),
        (
            lambda kind: st.LogicallyPartitioned(jnp.zeros(4), ("mlp",), memory_kind=kind),
            3,
            r"^LogicallyPartitioned: the box has memory_kind 3; expected None or a string",
        ),
        (
            lambda kind: st.with_partitioning(jnp.zeros, ("data",), memory_kind=kind),
            "pinned",
            r"^with_partitioning: the initialiser has memory_kind 'pinned'; expected None",
        ),
        (
            lambda kind: st.with_logical_partitioning(jnp.zeros, ("mlp",), memory_kind=kind),
            "host",
            r"^with_logical_partitioning: the initialiser has memory_kind 'host'; expected",
        ),
        (
            lambda kind: st.Partitioned(jnp.zeros(4), ("data",)).replace(memory_kind=kind),
            "Device",
            r"^Partitioned: the box has memory_kind 'Device'; expected None",
        ),
    ],
    ids=["Partitioned", "LogicallyPartitioned", "with_partitioning", "with_logical", "replace"],
)
def test_a_wrong_memory_kind_is_refused_at_once(build, kind, message):
    error = TypeError if not isinstance(kind, str) else ValueError
    with pytest.raises(error, match=message):
        build(kind)


def adamw_offloaded():
    """Boxed params on the devices, and their adamw state offloaded to the host."""
    param = jax.ShapeDtypeStruct((N, N), jnp.float32)
    params = {"w": st.Partitioned(param, (("data", "model"), None))}
    host_params = st.map_boxes(lambda box: box.replace(memory_kind=HOST), params)
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(tx.init, host_params)  # optax keeps the boxes, theirs included
    return tx, params, host_params, state


def test_the_plan_counts_offloaded_bytes_apart_from_the_device():
    tx, params, host_params, state = adamw_offloaded()
    mesh = AbstractMesh((2, 4), ("data", "model"))
    shard = N * N * 4 // 8
    planned = st.plan({"params": params, "opt": state}, mesh)
    by_path = {row.path: row for row in planned.rows}
    assert by_path["opt/0/mu/w"].memory_kind == HOST and by_path["opt/0/mu/w"].on_host
    assert by_path["params/w"].memory_kind is None and not by_path["params/w"].on_host
    assert planned.host_bytes == 2 * shard  # mu and nu
    assert planned.device_bytes == shard + 4  # the param and adamw's step count
    assert planned.fits(shard + 4) and not planned.fits(shard + 3)  # the device's bytes only
    assert st.plan(host_params, mesh).device_bytes == 0
    table = st.describe({"params": params, "opt": state}, mesh)
    assert "  data+model,- -> data+model,- in pinned_host" in table
    assert "host        64.0 KiB per device offloaded to host memory, not in the device's" in table
    assert "host  " not in st.describe(params, mesh)  # nothing offloaded: no line
    # optimizer_sharding of boxes built with a memory kind gives the state theirs
    shardings = st.optimizer_sharding(tx, host_params, mesh_of(AxisType.Explicit))
    assert shardings[0].mu["w"].memory_kind == HOST
    assert shardings[0].count.memory_kind == "device"  # adamw's count is in no box


def test_a_placed_array_in_host_memory_is_planned_as_offloaded():
    mesh = mesh_of(AxisType.Explicit)
    sharding = NamedSharding(mesh, PartitionSpec("data"), memory_kind=HOST)
    planned = st.plan({"x": jax.device_put(jnp.zeros((8, 4)), sharding)}, mesh)
    assert (planned.rows[0].memory_kind, planned.host_bytes, planned.device_bytes) == (HOST, 64, 0)


def offloaded_step(tx):
    """A train step over host-resident adamw state: brought to the device, updated,
    put back (the shape of a host-offloaded optimizer)."""

    def step(params, state):
        state = jax.device_put(st.unbox(state), jax.memory.Space.Device)
        values = st.unbox(params)
        grads = jax.tree.map(jnp.ones_like, values)
        updates, state = tx.update(grads, state, values)
        return optax.apply_updates(values, updates), jax.device_put(state, jax.memory.Space.Host)

    return step


def preflighted(target):
    tx, params, _, state = adamw_offloaded()
    mesh = AbstractMesh((2, 4), ("data", "model"))
    return st.preflight(offloaded_step(tx), params, state, mesh=mesh, target=target)


def check_offloaded(step, *, padded=0):
    """The state's shards are host arguments and host outputs, not the device's;
    `padded`: the bytes a compiler's tiling may add (libtpu pads the count)."""
    shard = N * N * 4 // 8
    assert step.inputs.host_bytes == 2 * shard
    assert step.host_argument_bytes == 2 * shard
    assert 2 * shard + 4 <= step.host_output_bytes <= 2 * shard + 4 + padded  # the count too
    assert step.inputs.device_bytes <= step.argument_bytes <= step.inputs.device_bytes + padded
    assert step.argument_bytes < step.inputs.device_bytes + step.inputs.host_bytes


def test_preflight_counts_host_bytes_on_the_cpu_estimate():
    # the CPU compiler has one memory and says no host figures: the arguments and
    # outputs its shardings put in a host memory are moved to the host's
    check_offloaded(preflighted(None))


@pytest.mark.target
@pytest.mark.skipif(not has_compiler("cuda"), reason="needs pip install 'spmdtree[cuda]'")
def test_preflight_counts_host_bytes_with_xla_gpu():
    # XLA GPU says its host outputs, but counts host arguments as the device's
    check_offloaded(preflighted("h100"))


@pytest.mark.target
@pytest.mark.skipif(not has_compiler("tpu"), reason="needs pip install 'spmdtree[tpu]'")
def test_preflight_counts_host_bytes_with_libtpu():
    check_offloaded(preflighted("tpu-v5p"), padded=1024)


def unpinned_argument():
    box = st.Partitioned(jax.ShapeDtypeStruct((64, 32), jnp.float32), ("data", None))
    return box.replace(memory_kind="unpinned_host")


def moved_to_device(x):
    return jax.device_put(
        jax.device_put(x.value, jax.memory.Space.Device) * 2, jax.memory.Space.Host
    )


@pytest.mark.target
@pytest.mark.skipif(not has_compiler("cuda"), reason="needs pip install 'spmdtree[cuda]'")
def test_xla_gpu_takes_unpinned_host_memory():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    step = st.preflight(moved_to_device, unpinned_argument(), mesh=mesh, target="h100")
    assert step.host_argument_bytes == 64 * 32 * 4 // 2 == step.inputs.host_bytes


@pytest.mark.target
@pytest.mark.skipif(not has_compiler("tpu"), reason="needs pip install 'spmdtree[tpu]'")
def test_an_unpinned_argument_is_refused_for_libtpu_before_it_compiles():
    # libtpu's own refusal is an internal error (INTERNAL: a shape mismatch between
    # memory spaces, S(6)): ours comes before the compile, naming the fix
    mesh = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(
        ValueError,
        match=r"^preflight: args\[0\] has memory_kind 'unpinned_host', which libtpu does not "
        r"compile for an argument\. Offload it to the host with memory_kind='pinned_host'\.$",
    ):
        st.preflight(moved_to_device, unpinned_argument(), mesh=mesh, target="tpu-v5p")


@pytest.mark.target
@pytest.mark.skipif(not has_compiler("tpu"), reason="needs pip install 'spmdtree[tpu]'")
@pytest.mark.parametrize("screen", ["auto", "target"])
def test_advise_refuses_an_unpinned_argument_for_libtpu_as_preflight_does(screen):
    # 0.5's advise rebuilt preflight's stages without this check: its libtpu compile
    # failed inside, with libtpu's INTERNAL error, where preflight says what to do.
    mesh = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError) as preflighted:
        st.preflight(moved_to_device, unpinned_argument(), mesh=mesh, target="tpu-v5p")
    said = str(preflighted.value).removeprefix("preflight: ")
    candidate = st.Candidate(mesh, None, batch=64)
    advice = st.advise(
        lambda c: (moved_to_device, (unpinned_argument(),), {}),
        [candidate],
        hardware=st.hardware("tpu-v5p"),
        screen=screen,
        progress=False,
    )
    (row,) = advice.rows
    assert row.verdict == st.Verdict.DOES_NOT_COMPILE and advice.compiles == 0
    assert said in row.reason
    assert "INTERNAL" not in row.reason
