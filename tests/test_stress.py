"""Stress and leaks: the rules context under many threads and tasks, no retrace,
pickling, and abstract boxes working wherever boxes of arrays do."""

import asyncio
import copy
import pickle
import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
GLOBAL = [("global", "data")]


class Boom(Exception):
    pass


def nested_checks(me: int, depth: int, pause) -> None:
    """Nested contexts, some raising, each checked to see only its own rules."""
    outer = st.get_logical_axis_rules()
    rules = [(f"who{me}", f"depth{depth}")]
    try:
        with st.logical_axis_rules(rules):
            assert st.get_logical_axis_rules() == ((f"who{me}", f"depth{depth}"),)
            pause()
            assert st.logical_to_mesh_axes((f"who{me}",)) == P(f"depth{depth}")
            if depth < 3:
                nested_checks(me, depth + 1, pause)
            if depth == 2:
                raise Boom
    except Boom:
        pass
    assert st.get_logical_axis_rules() == outer


def test_sixteen_threads_see_only_their_own_rules():
    st.set_logical_axis_rules(GLOBAL)
    barrier = threading.Barrier(16)
    errors = []

    def worker(me: int) -> None:
        rng = random.Random(me)
        try:
            assert st.get_logical_axis_rules() == ()  # a new thread starts empty
            barrier.wait(timeout=30)
            for _ in range(20):
                nested_checks(me, 0, lambda: threading.Event().wait(rng.random() / 2000))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert st.get_logical_axis_rules() == tuple(map(tuple, GLOBAL))


def test_a_hundred_interleaved_asyncio_tasks_see_only_their_own_rules():
    order = []

    async def task(me: int) -> None:
        async def pause_async():
            await asyncio.sleep(0)

        for depth in range(3):
            with st.logical_axis_rules([(f"task{me}", f"depth{depth}")]):
                order.append(me)
                await pause_async()  # every task runs between these two checks
                assert st.get_logical_axis_rules() == ((f"task{me}", f"depth{depth}"),)
                try:
                    with st.logical_axis_rules([(f"task{me}", "inner")]):
                        await pause_async()
                        assert st.logical_to_mesh_axes((f"task{me}",)) == P("inner")
                        raise Boom
                except Boom:
                    pass
                assert st.get_logical_axis_rules() == ((f"task{me}", f"depth{depth}"),)

    async def main():
        st.set_logical_axis_rules(GLOBAL)  # the tasks start from a copy of this context
        await asyncio.gather(*(task(i) for i in range(100)))
        return st.get_logical_axis_rules()

    after = asyncio.run(main())
    assert after == tuple(map(tuple, GLOBAL))
    assert order[:100] == list(range(100))  # they really interleaved
    assert st.get_logical_axis_rules() == ()  # asyncio.run ran in a copied context


def test_equal_metadata_rebuilt_each_call_traces_once():
    traces = []

    @jax.jit
    def step(params, grads):
        traces.append(1)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    for i in range(100):
        as_lists = i % 2 == 0
        names = ["embed", ["mlp", "heads"]] if as_lists else ("embed", ("mlp", "heads"))
        rules = (
            [["embed", "data"], ["mlp", ["model"]]]
            if as_lists
            else (("embed", "data"), ("mlp", ("model",)))
        )
        params = {"w": st.LogicallyPartitioned(jnp.ones((2, 4)), names, rules=rules)}
        grads = {"w": st.LogicallyPartitioned(jnp.ones((2, 4)), names, rules=rules)}
        params = step(params, grads)
    assert len(traces) == 1


@pytest.mark.parametrize(
    "box",
    [
        st.Partitioned(np.arange(8.0).reshape(2, 4), ("data", ("model",)), mesh=MESH),
        st.LogicallyPartitioned(np.arange(4.0), ["embed"], rules={"embed": "data"}),
        st.LogicallyPartitioned(jax.ShapeDtypeStruct((4,), jnp.float32), (P.UNCONSTRAINED,)),
    ],
    ids=["partitioned-with-mesh", "logical-with-rules", "abstract-unconstrained"],
)
def test_pickle_and_deepcopy_round_trip(box):
    for copied in (pickle.loads(pickle.dumps(box)), copy.deepcopy(box)):
        assert type(copied) is type(box)
        assert jax.tree.structure(copied) == jax.tree.structure(box)  # metadata intact
        assert copied.names == box.names and copied.mesh == box.mesh
        if isinstance(box.value, np.ndarray):
            np.testing.assert_array_equal(copied.value, box.value)
        else:
            assert copied.value == box.value


def abstract_and_concrete():
    def init(key):
        return {
            "w": st.LogicallyPartitioned(jax.random.normal(key, (8, 16)), ("embed", "mlp")),
            "b": st.Partitioned(jnp.zeros(16), ("model",)),
        }

    return init, jax.eval_shape(init, jax.random.key(0)), init(jax.random.key(0))


RULES = [("embed", "data"), ("mlp", "model")]


@pytest.mark.parametrize(
    "use",
    [
        st.get_partition_spec,
        lambda t: st.to_spec(t, RULES, mesh=MESH),
        lambda t: st.to_sharding(t, MESH, RULES),
        lambda t: st.get_sharding(t, MESH),
        lambda t: jax.tree.map(
            lambda x: (x.shape, x.sharding.spec), st.unbox(st.to_abstract(t, MESH, RULES))
        ),
        lambda t: st.describe(t, MESH, RULES, rich=False),
        lambda t: st.optimizer_sharding(optax.adam(1e-3), t, MESH, RULES),
        lambda t: st.validate_rules(RULES, MESH, t),
        lambda t: jax.tree.map(lambda x: x.shape, st.unbox(st.add_axis(t, 0, "layers"))),
    ],
    ids=[
        "get_partition_spec",
        "to_spec",
        "to_sharding",
        "get_sharding",
        "to_abstract",
        "describe",
        "optimizer_sharding",
        "validate_rules",
        "add_axis",
    ],
)
def test_a_box_of_shape_dtype_struct_works_like_a_box_of_array(use):
    _, abstract, concrete = abstract_and_concrete()
    with st.logical_axis_rules(RULES):
        assert use(abstract) == use(concrete)


def test_sharded_init_and_shard_agree_on_abstract_plans():
    init, abstract, concrete = abstract_and_concrete()
    built = st.sharded_init(init, MESH, RULES)(jax.random.key(0))
    placed = st.shard(concrete, MESH, RULES)
    plan = st.to_sharding(abstract, MESH, RULES)
    for got, want in ((built, plan), (placed, plan)):
        assert jax.tree.map(lambda x: x.sharding, st.unbox(got)) == want
