"""Checkpoints with orbax: nothing lost, mismatches named, flax checkpoints restore.

The example (examples/checkpoint.py) restores across topologies; see
tests/test_examples.py. These tests cover what can go wrong around it.
"""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
OTHER = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

# Saves a train state whose every value equals its step, asynchronously, at
# every step, and says when each save has started; it is killed mid-save.
TRAINER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, orbax.checkpoint as ocp, spmdtree as st
    from jax.sharding import AxisType
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    state = st.shard(
        {f"w{i}": st.Partitioned(jnp.zeros((1024, 1024)), ("data", "model")) for i in range(8)},
        mesh,
    )
    options = ocp.CheckpointManagerOptions(max_to_keep=None)
    mngr = ocp.CheckpointManager(sys.argv[1], options=options)
    for step in range(1, 60):
        state = jax.tree.map(lambda x: x + 1, state)  # every value is the step
        mngr.save(step, args=ocp.args.StandardSave(state))
        print(f"saving {step}", flush=True)
    mngr.wait_until_finished()
    print("done", flush=True)
    """
)


def run_until(script: pathlib.Path, directory: pathlib.Path, line: str) -> list[str]:
    """Runs the trainer and SIGKILLs it as soon as it prints `line` (deadline 180 s)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    seen = []
    try:
        for out in proc.stdout:  # bounded: the trainer stops after 59 steps
            seen.append(out.strip())
            if seen[-1] == line:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=30)
    assert seen and seen[-1] == line, seen
    return seen


def test_a_kill_during_an_async_save_loses_only_that_save(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    directory = tmp_path / "ckpt"
    run_until(script, directory, "saving 3")  # step 3's save was under way

    template = {
        f"w{i}": st.Partitioned(jnp.zeros((1024, 1024)), ("data", "model")) for i in range(8)
    }
    target = st.to_abstract(template, MESH)
    with ocp.CheckpointManager(directory) as mngr:
        steps = list(mngr.all_steps())
        latest = mngr.latest_step()
        assert latest is not None and steps == list(range(1, latest + 1)), steps
        assert latest in (2, 3)  # saves run one at a time: 2 was complete, 3 maybe
        restored = mngr.restore(latest, args=ocp.args.StandardRestore(target))
    for box in restored.values():  # a complete step, never a partial one
        assert type(box) is st.Partitioned and box.value.sharding.spec == P("data", "model")
        np.testing.assert_array_equal(np.asarray(box.value), float(latest))
    partial = [p.name for p in directory.iterdir() if not p.name.isdigit()]
    assert all("tmp" in name for name in partial), partial  # left unfinished, never listed
    if partial:  # the kill landed mid-save (as it does here): that step is not offered
        assert partial == ["3.orbax-checkpoint-tmp"] and latest == 2


def saved(tmp_path, state):
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    return mngr


def state():
    w = jnp.arange(128.0).reshape(8, 16)
    return {"params": {"w": st.LogicallyPartitioned(w, ("embed", "mlp"))}}


RULES = [("embed", "data"), ("mlp", "model")]


def test_an_unboxed_target_for_a_boxed_checkpoint_is_named_and_fixed_by_boxing(tmp_path):
    mngr = saved(tmp_path, st.shard(state(), MESH, RULES))
    target = st.to_abstract(jax.eval_shape(state), OTHER, RULES)
    with pytest.raises(ValueError) as info:  # orbax's error, naming each path
        mngr.restore(1, args=ocp.args.StandardRestore(st.unbox(target)))
    message = str(info.value)
    assert "params.w" in message and "<class 'jax.ShapeDtypeStruct'>" in message
    assert "<class 'dict'>" in message  # on disk, a box is {'value': array}
    restored = mngr.restore(1, args=ocp.args.StandardRestore(target))  # the boxed target
    assert restored["params"]["w"].value.sharding.spec == P("data", "model")


def test_a_boxed_target_for_an_unboxed_checkpoint_is_named_and_fixed_by_unboxing(tmp_path):
    mngr = saved(tmp_path, st.unbox(st.shard(state(), MESH, RULES)))
    target = st.to_abstract(jax.eval_shape(state), OTHER, RULES)
    with pytest.raises(ValueError) as info:
        mngr.restore(1, args=ocp.args.StandardRestore(target))
    message = str(info.value)
    assert "params.w" in message and "Source: <class 'dict'>" in message
    # The fix the README shows: restore the arrays, then put them into the boxes.
    arrays = mngr.restore(1, args=ocp.args.StandardRestore(st.unbox(target)))
    restored = st.replace_boxed(target, arrays)
    assert type(restored["params"]["w"]) is st.LogicallyPartitioned
    np.testing.assert_array_equal(restored["params"]["w"].value, state()["params"]["w"].value)
    assert restored["params"]["w"].value.sharding.spec == P("data", "model")
    assert restored["params"]["w"].value.sharding.mesh.shape == OTHER.shape


def test_a_target_of_another_model_is_named(tmp_path):
    mngr = saved(tmp_path, st.shard(state(), MESH, RULES))
    other = {"params": {"v": st.LogicallyPartitioned(jnp.zeros((8, 16)), ("embed", "mlp"))}}
    with pytest.raises(ValueError) as info:
        mngr.restore(1, args=ocp.args.StandardRestore(st.to_abstract(other, MESH, RULES)))
    message = str(info.value)
    assert "params.v" in message and "params.w" in message and "MISSING" in message


def test_a_checkpoint_saved_from_flax_boxes_restores_into_spmdtree_boxes_and_back(tmp_path):
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp"))
            return x @ self.param("kernel", init, (8, 16))

    variables = Dense().init(jax.random.key(0), jnp.ones((2, 8)))
    flax_state = jax.tree.map(
        lambda x: jax.device_put(x, jax.sharding.NamedSharding(MESH, P("data", "model"))),
        variables,
    )
    mngr = saved(tmp_path, flax_state)
    kernel = variables["params"]["kernel"]
    ours = {"params": {"kernel": st.LogicallyPartitioned(kernel.value, kernel.names)}}
    target = st.to_abstract(jax.eval_shape(lambda: ours), OTHER, RULES)
    restored = mngr.restore(1, args=ocp.args.StandardRestore(target))
    box = restored["params"]["kernel"]
    assert type(box) is st.LogicallyPartitioned and box.names == ("embed", "mlp")
    np.testing.assert_array_equal(box.value, kernel.value)
    assert (
        box.value.sharding.spec == P("data", "model")
        and box.value.sharding.mesh.shape == OTHER.shape
    )
    # And a checkpoint saved from spmdtree boxes restores into flax's.
    mngr.save(2, args=ocp.args.StandardSave(restored))
    mngr.wait_until_finished()
    back = mngr.restore(2, args=ocp.args.StandardRestore(jax.eval_shape(lambda: variables)))
    assert type(back["params"]["kernel"]) is nn.LogicallyPartitioned
    np.testing.assert_array_equal(back["params"]["kernel"].value, kernel.value)
