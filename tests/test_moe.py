"""examples/moe.py: the expert-sharded MoE equals the unsharded one, dispatches by
all-to-all without gathering the experts, drops what is over capacity, says what
is wrong with bad sizes, and its main runs."""

import functools
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdtree as st

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load():
    spec = importlib.util.spec_from_file_location("moe_example", EXAMPLES / "moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


moe = _load()
CFG = moe.Config()
RULES = moe.make_rules()


@pytest.fixture(scope="module")
def setup():
    """The example's mesh (expert 4, data 2), params and a batch."""
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    # An rbg key: the params' init compiles in about half the time of threefry's.
    params = moe.init_params(jax.random.key(0, impl="rbg"), CFG, mesh, RULES)
    batch = moe.make_batch(jax.random.key(1), CFG, mesh, RULES)
    return mesh, params, batch


@pytest.fixture(scope="module")
def steps(setup):
    """Each path's train step with adamw, compiled; and the params it starts from."""
    mesh, params, batch = setup
    tx = moe.train.adamw(1e-2)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        compiled = {
            sharded: jax.jit(
                functools.partial(moe.train_step, cfg=CFG, tx=tx, sharded_experts=sharded)
            )
            .lower(params, state, batch)
            .compile()
            for sharded in (True, False)
        }
    return compiled, state


def test_sharded_loss_gradients_and_training_equal_the_unsharded(setup, steps):
    mesh, params, batch = setup
    compiled, state = steps
    losses, moments = {}, {}
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        for sharded, step in compiled.items():
            p, s, losses[sharded] = params, state, []
            for i in range(4):
                p, s, loss = step(p, s, batch)
                losses[sharded].append(float(loss))
                if i == 0:  # adam's first moment after one step: (1 - b1) x the gradient
                    moments[sharded] = st.unbox(optax.tree_utils.tree_get(s, "mu"))
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)  # [0]: the loss
    leaves = jax.tree.leaves_with_path(moments[True])
    for (path, g), g_ref in zip(leaves, jax.tree.leaves(moments[False]), strict=True):
        np.testing.assert_allclose(
            g, g_ref, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path)
        )
    assert jnp.any(moments[True]["layers"]["mlp_in"] != 0)  # the experts learn
    assert losses[True][-1] < losses[True][0]


def _gathered_experts(hlo):
    """The all-gathers in a compiled module whose result is a layer's whole experts."""
    experts = {(CFG.experts, CFG.width, CFG.mlp), (CFG.experts, CFG.mlp, CFG.width)}
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(", hlo)
    return [s for s in shapes if tuple(int(n) for n in s.split(","))[-3:] in experts]


def test_the_compiled_step_exchanges_tokens_and_keeps_the_experts_in_place(steps):
    hlo, control = (steps[0][sharded].as_text() for sharded in (True, False))
    # Tokens to their experts and back, forward and backward; the experts stay in place.
    assert len(re.findall(r" all-to-all(?:-start)?\(", hlo)) >= 4
    assert _gathered_experts(hlo) == []
    # The control, the experts unsharded: no all-to-all, and the check sees their gather.
    assert " all-to-all" not in control
    assert len(_gathered_experts(control)) == 2  # mlp_in and mlp_out, in the loop


@pytest.mark.parametrize("factor", [0.25, 4.0], ids=lambda f: f"capacity-factor-{f}")
def test_routing_respects_capacity(factor):
    cfg = moe.Config(capacity_factor=factor)
    groups, tokens = 4, CFG.length - 1
    x = jax.random.normal(jax.random.key(2), (groups, tokens, cfg.width))
    router = jax.random.normal(jax.random.key(3), (cfg.width, cfg.experts))
    routing = jax.jit(moe.route, static_argnums=2)(x, router, cfg)
    capacity = cfg.capacity(tokens)
    assert capacity == int(np.ceil(factor * tokens * cfg.top_k / cfg.experts))
    chosen = np.asarray(jax.nn.one_hot(routing.experts, cfg.experts))  # [g, t, k, E]
    kept = np.asarray(routing.kept)
    wanted, taken = chosen.sum(axis=(1, 2)), (chosen * kept[..., None]).sum(axis=(1, 2))
    np.testing.assert_array_equal(taken, np.minimum(wanted, capacity))  # full before dropping
    for g in range(groups):  # the kept choices own distinct slots of their group's
        mine = (routing.experts[g][kept[g]].tolist(), routing.slots[g][kept[g]].tolist())
        slots = list(zip(*mine, strict=True))
        assert len(set(slots)) == len(slots)
        assert all(g * capacity <= s < (g + 1) * capacity for _, s in slots)
    assert np.all(routing.slots[~kept] == groups * capacity)  # past the end: dropped
    # A second choice finds room only where every first choice of its expert did.
    first_dropped = (chosen[:, :, 0] * ~kept[:, :, 0, None]).sum(axis=1) > 0  # [g, E]
    second_kept = (chosen[:, :, 1] * kept[:, :, 1, None]).sum(axis=1) > 0
    assert not np.any(first_dropped & second_kept)
    assert (factor < cfg.experts / cfg.top_k) == (not kept.all())  # experts / top_k: no drops
    np.testing.assert_allclose(routing.gates.sum(-1), 1, rtol=1e-6)


SPLIT_BATCH = [("batch", ("data", "expert")), *RULES[1:]]  # the attention split by expert too


@pytest.mark.parametrize(
    "sharded, rules",
    [(True, RULES), (False, RULES), (True, SPLIT_BATCH)],
    ids=["experts-sharded", "experts-unsharded", "batch-over-data-and-expert"],
)
def test_dropped_choices_add_nothing(setup, sharded, rules):
    mesh, params, _ = setup
    cfg = moe.Config(capacity_factor=0.25)  # one slot per expert and sequence
    layer = jax.tree.map(lambda w: w[0], st.unbox(params["layers"]))
    x = jax.random.normal(jax.random.key(4), (CFG.batch, CFG.length - 1, CFG.width))
    with st.logical_axis_rules(rules), jax.set_mesh(mesh):
        x_on_mesh = jax.device_put(x, st.logical_to_mesh_axes(("batch",)))
        run = functools.partial(moe.moe, cfg=cfg, sharded_experts=sharded)
        y, _, dropped = jax.jit(run)(x_on_mesh, layer)
    # Each expert on every token, densely, then the kept choices' weighted sum.
    w_in, w_out = (np.asarray(layer[k]) for k in ("mlp_in", "mlp_out"))
    every = jnp.einsum("gtem,emd->gted", jax.nn.gelu(jnp.einsum("gtd,edm->gtem", x, w_in)), w_out)
    routing = jax.jit(moe.route, static_argnums=2)(x, np.asarray(layer["router"]), cfg)
    picked = jnp.take_along_axis(every, routing.experts[..., None], axis=2)  # [g, t, k, d]
    expected = jnp.einsum("gtkd,gtk->gtd", picked, jnp.where(routing.kept, routing.gates, 0))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    none_kept = ~np.asarray(routing.kept).any(axis=-1)
    assert none_kept.sum() >= CFG.batch * (CFG.length - 1 - CFG.experts)  # 8 slots, 15 tokens
    assert np.all(np.asarray(y)[none_kept] == 0)
    np.testing.assert_allclose(dropped, 1 - np.asarray(routing.kept).mean(axis=(1, 2)))


@pytest.mark.parametrize(
    "sizes, said",
    [
        (dict(experts=4, top_k=5), ["`top_k` is 5", "of the 4", "from 1 to 4"]),
        (dict(top_k=0), ["`top_k` is 0", "from 1 to 8"]),
        (dict(capacity_factor=0.0), ["`capacity_factor` is 0.0", "Pass a positive factor"]),
        (dict(capacity_factor=-1.0), ["`capacity_factor` is -1.0", "drops none"]),
    ],
    ids=["top-k-above-experts", "top-k-zero", "capacity-zero", "capacity-negative"],
)
def test_a_bad_config_says_what_and_how_to_fix_it(sizes, said):
    with pytest.raises(ValueError, match=r"^Config: ") as raised:
        moe.Config(**sizes)
    assert all(s in str(raised.value) for s in said), str(raised.value)


def test_experts_the_expert_axis_does_not_divide_are_refused(setup):
    mesh, _, _ = setup
    cfg = moe.Config(experts=6)
    message = "6 experts do not divide over the mesh axes ('expert',) of 4 devices"
    with pytest.raises(ValueError, match=re.escape(f"init_params: {message}")) as raised:
        moe.init_params(jax.random.key(0), cfg, mesh, RULES)
    assert "Pass a multiple of 4 experts" in str(raised.value)
    x = jnp.zeros((CFG.batch, CFG.length - 1, CFG.width))
    refused = pytest.raises(ValueError, match=re.escape(f"moe: {message}"))
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh), refused:
        moe.moe(x, {}, cfg, sharded_experts=True)


def test_a_batch_the_dispatch_cannot_split_is_refused(setup):
    mesh, params, _ = setup
    batch = jnp.zeros((12, CFG.length), jnp.int32)
    loss = functools.partial(moe.loss_fn, cfg=CFG, sharded_experts=True)
    refused = pytest.raises(ValueError, match="moe: the batch of 12 sequences")
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh), refused as raised:
        jax.eval_shape(loss, params, jax.device_put(batch, jax.sharding.PartitionSpec("data")))
    assert "mesh axes ('data', 'expert')" in str(raised.value)
    assert "Pass a batch that is a multiple of 8" in str(raised.value)


def test_main_prints_equal_losses_the_all_to_alls_and_a_falling_loss(capsys):
    losses = moe.main(["--steps", "10", "--layers", "1"])
    printed = capsys.readouterr().out
    assert "mesh: {'expert': 4, 'data': 2} on 8 cpu device(s)" in printed
    assert "-,expert,-,-" in printed  # the experts' params, split over expert
    assert re.search(r"experts sharded ([\d.]+), unsharded \1 \(equal: True\)", printed), printed
    assert re.search(r"  all-to-all .* over expert \(4\)", printed), printed
    assert "step   10  loss" in printed
    assert len(losses) == 2 and losses[-1] < losses[0]


def test_main_refuses_a_bad_config_in_one_line(capsys):
    with pytest.raises(SystemExit) as raised:
        moe.main(["--top-k", "9"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "Config: `top_k` is 9" in error and "Traceback" not in error
