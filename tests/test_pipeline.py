"""Pipeline stages (0.8): `st.stages` restages stacked layers, `st.pipeline` runs them as a
pipeline in one SPMD program and equals `st.scan` (loss and gradients), with its bad
inputs each a ValueError that names the numbers and the fix."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import spmdtree as st

WIDTH, LAYERS, BATCH = 16, 8, 16
RULES = [("batch", "data"), ("stage", "stage"), ("layers", None), ("embed", None), ("mlp", None)]
KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def mesh(kind="explicit", stages=4, data=2):
    return jax.make_mesh((stages, data), ("stage", "data"), axis_types=(KINDS[kind],) * 2)


def init_layer(key):
    k1, k2 = jax.random.split(key)
    return {
        "up": st.LogicallyPartitioned(
            jax.random.normal(k1, (WIDTH, 2 * WIDTH)) / WIDTH**0.5, ("embed", "mlp")
        ),
        "down": st.LogicallyPartitioned(
            jax.random.normal(k2, (2 * WIDTH, WIDTH)) / WIDTH**0.5, ("mlp", "embed")
        ),
        "scale": st.LogicallyPartitioned(jnp.ones(WIDTH), ("embed",)),
    }


def layers(count=LAYERS):
    keys = jax.random.split(jax.random.key(0), count)
    return st.vmap(init_layer, partition_name="layers")(keys)


def block(x, layer):
    p = st.unbox(layer)
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["scale"]
    h = st.with_logical_constraint(jax.nn.gelu(h @ p["up"]), ("batch", "mlp"))
    return x + h @ p["down"], None


def batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    return x, jnp.tanh(x[:, ::-1])


def scanned_loss(params, x, y):
    out, _ = st.scan(block, x, params)
    return jnp.mean((out - y) ** 2)


def piped_loss(params, x, y, microbatches=4, remat=False):
    x = st.with_logical_constraint(x, ("batch", "embed"))  # the carry as the layers leave it
    out, _ = st.pipeline(block, x, params, microbatches=microbatches, remat=remat)
    return jnp.mean((out - y) ** 2)


def unstaged(tree):
    """Staged values back to ``[L, ...]``, for comparing with the scanned ones."""
    return jax.tree.map(lambda v: np.asarray(v).reshape(-1, *v.shape[3:]), st.unbox(tree))


def close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# --- st.stages ------------------------------------------------------------------------


@pytest.mark.parametrize("stages, repeats", [(1, 1), (2, 1), (4, 1), (2, 2), (2, 4), (8, 1)])
def test_stages_is_a_c_order_reshape_layer_by_layer(stages, repeats):
    tree = layers()
    staged = st.stages(tree, stages, repeats=repeats)
    per = LAYERS // (stages * repeats)
    assert staged["up"].value.shape == (repeats, stages, per, WIDTH, 2 * WIDTH)
    assert staged["up"].names == (None, "stage", "layers", "embed", "mlp")
    for r in range(repeats):
        for s in range(stages):
            for j in range(per):
                layer = (r * stages + s) * per + j
                np.testing.assert_array_equal(
                    staged["down"].value[r, s, j], tree["down"].value[layer]
                )


def test_stages_names_the_stage_dimension_and_keeps_abstract_arrays_abstract():
    abstract = jax.eval_shape(layers)
    staged = st.stages(abstract, 4, name="pipe")
    assert isinstance(staged["scale"].value, jax.ShapeDtypeStruct)
    assert staged["scale"].value.shape == (1, 4, 2, WIDTH)
    assert staged["scale"].names == (None, "pipe", "layers", "embed")
    rules = [("pipe", "stage"), *RULES]
    assert st.to_spec(staged, rules, mesh=AbstractMesh((4, 2), ("stage", "data")))["up"] == (
        jax.sharding.PartitionSpec(None, "stage", None, None, None)
    )


def test_a_plain_array_of_the_layers_is_restaged_without_names():
    staged = st.stages({"w": jnp.arange(8.0)}, 2, repeats=2)
    np.testing.assert_array_equal(staged["w"], jnp.arange(8.0).reshape(2, 2, 2))


def test_layers_that_the_stages_and_repeats_do_not_divide_are_a_value_error():
    with pytest.raises(ValueError) as e:
        st.stages(layers(6), 4)
    message = str(e.value)
    assert message.startswith("stages: layers holds 6 layers, which 4 stages x 1 repeat do")
    assert "1, 2, 3 or 6" in message
    with pytest.raises(ValueError, match=r"8 layers, which 2 stages x 3 repeats do not divide"):
        st.stages(layers(), 2, repeats=3)


def test_layers_that_disagree_on_their_count_are_a_value_error_naming_each():
    tree = {"a": jnp.zeros((8, 2)), "b": jnp.zeros((6, 2))}
    with pytest.raises(ValueError, match=r"disagree on their layers.*8 at layers\['a'\].*6 at"):
        st.stages(tree, 2)
    with pytest.raises(ValueError, match=r"layers\['s'\] \(shape \(\)\) has fewer than 1"):
        st.stages({"s": jnp.zeros(())}, 1)


def test_layers_restaged_already_are_a_value_error():
    with pytest.raises(
        ValueError,
        match=r"^stages: 3 leaves are wrong:\n  the box at layers\['down'\] is restaged already",
    ):
        st.stages(st.stages(layers(), 4), 1)
    with pytest.raises(
        ValueError, match=r"holds 1 layer, which 2 stages x 1 repeat do not .*: 1\.$"
    ):
        st.stages({"w": jnp.zeros((1, 3))}, 2)


@pytest.mark.parametrize(
    "kwargs, kind, said",
    [
        ({"stages": 0}, ValueError, "stages is 0; expected an int >= 1"),
        ({"stages": 2.0}, TypeError, "stages is 2.0; expected an int >= 1"),
        ({"stages": 2, "repeats": 0}, ValueError, "repeats is 0"),
        ({"stages": 2, "name": 3}, TypeError, "name is 3; expected a str"),
    ],
)
def test_bad_counts_and_names_are_said(kwargs, kind, said):
    with pytest.raises(kind, match=f"^stages: {said}"):
        st.stages(layers(), **kwargs)


# --- st.pipeline equals st.scan -------------------------------------------------------


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("repeats", [1, 2], ids=["gpipe", "circular"])
def test_the_pipeline_equals_the_scan_loss_and_gradients_under_jit(kind, repeats):
    params, (x, y) = layers(), batch()
    want_loss, want_grads = jax.value_and_grad(scanned_loss)(params, x, y)
    staged = st.stages(params, 4, repeats=repeats)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh(kind)):
        staged = st.shard(staged, mesh(kind))
        loss, grads = jax.jit(jax.value_and_grad(piped_loss))(staged, x, y)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert grads["up"].names == (None, "stage", "layers", "embed", "mlp")
    close(unstaged(grads), st.unbox(want_grads))


@pytest.mark.parametrize(
    "stages, repeats, microbatches", [(2, 1, 2), (2, 2, 4), (4, 2, 8), (8, 1, 8)]
)
def test_the_pipeline_equals_the_scan_for_other_counts(stages, repeats, microbatches):
    params, (x, y) = layers(), batch()
    layout = jax.make_mesh(
        (stages, 8 // stages), ("stage", "data"), axis_types=(AxisType.Auto,) * 2
    )
    staged = st.stages(params, stages, repeats=repeats)
    with st.logical_axis_rules(RULES), jax.set_mesh(layout):
        loss = jax.jit(functools.partial(piped_loss, microbatches=microbatches))(staged, x, y)
    assert float(loss) == pytest.approx(float(scanned_loss(params, x, y)), rel=1e-5)


def test_jit_of_the_pipeline_equals_the_pipeline_run_eagerly():
    params, (x, _) = layers(), batch()
    staged = st.stages(params, 4)
    run = lambda s, x: st.pipeline(block, x, s, microbatches=4)[0]  # noqa: E731
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh("auto")):
        np.testing.assert_allclose(jax.jit(run)(staged, x), run(staged, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "remat",
    [True, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable],
    ids=["true", "nothing-saveable", "dots-saveable"],
)
def test_a_remat_policy_per_iteration_leaves_the_gradients_as_they_are(remat):
    params, (x, y) = layers(), batch()
    want = jax.grad(scanned_loss)(params, x, y)
    staged = st.stages(params, 4, repeats=2)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh()):
        grads = jax.jit(jax.grad(functools.partial(piped_loss, remat=remat)))(staged, x, y)
    close(unstaged(grads), st.unbox(want))


def test_a_layer_wrapped_in_jax_checkpoint_pipelines_too():
    params, (x, y) = layers(), batch()
    staged = st.stages(params, 4)

    def loss(p, x, y):
        x = st.with_logical_constraint(x, ("batch", "embed"))
        out, _ = st.pipeline(jax.checkpoint(block), x, p, microbatches=8)
        return jnp.mean((out - y) ** 2)

    with st.logical_axis_rules(RULES), jax.set_mesh(mesh()):
        grads = jax.jit(jax.grad(loss))(staged, x, y)
    close(unstaged(grads), st.unbox(jax.grad(scanned_loss)(params, x, y)))


def test_adamw_steps_on_the_pipeline_follow_those_on_the_scan():
    params, (x, y) = layers(), batch()
    tx = optax.adamw(1e-2)

    def train(loss, p):
        state, losses = tx.init(p), []
        for _ in range(3):
            value, grads = jax.jit(jax.value_and_grad(loss))(p, x, y)
            updates, state = tx.update(grads, state, p)
            p, _ = optax.apply_updates(p, updates), losses.append(float(value))
        return p, losses

    want, want_losses = train(scanned_loss, params)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh()):
        staged = st.shard(st.stages(params, 4, repeats=2), mesh())
        got, losses = train(piped_loss, staged)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    assert losses[-1] < losses[0]
    close(unstaged(got), st.unbox(want), tol=1e-4)


def test_the_pipeline_composes_with_accumulate():
    params, (x, y) = layers(), batch()
    staged = st.stages(params, 4)
    value_and_grad = jax.value_and_grad(lambda p, b: piped_loss(p, b["x"], b["y"]))
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh()):
        loss, grads = jax.jit(st.accumulate(value_and_grad, 2))(staged, {"x": x, "y": y})
    assert float(loss) == pytest.approx(float(scanned_loss(params, x, y)), rel=1e-5)
    close(unstaged(grads), st.unbox(jax.grad(scanned_loss)(params, x, y)))


def test_a_carry_of_several_arrays_and_closed_over_values_pipeline():
    params, (x, _) = layers(), batch()
    shift = jnp.linspace(-1, 1, WIDTH)  # closed over, as positions or a mask are

    def two(carry, layer):
        h, total = carry
        h, _ = block(h + shift, layer)
        return (h, total + jnp.mean(h, axis=-1)), None

    init = (x, jnp.zeros(BATCH))
    want, _ = st.scan(two, init, params)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh("auto")):
        got, none = jax.jit(lambda s: st.pipeline(two, init, s, microbatches=4))(
            st.stages(params, 4, repeats=2)
        )
    assert none is None
    close(got, want)


# --- what it compiles to ----------------------------------------------------------------


def test_its_step_shifts_activations_by_collective_permute_and_each_device_holds_its_stage():
    params = jax.eval_shape(layers)
    staged = st.stages(params, 4)
    x = st.LogicallyPartitioned(jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32), ("batch", None))
    layout = AbstractMesh((4, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)

    def step(p, x):
        return jax.grad(lambda p: jnp.mean(st.pipeline(block, x.value, p, microbatches=8)[0]))(p)

    plan = st.preflight(step, staged, x, mesh=layout, rules=RULES)
    rows = {(row.kind, row.axes): row for row in plan.collectives}
    shifts = rows[("collective-permute", ("stage",))]
    iterations = 8 + 4 - 1  # microbatches x repeats + stages - 1, forward and backward
    assert shifts.count == 2 * iterations and shifts.group == 2
    assert shifts.bytes == 2 * iterations * (BATCH // 8 // 2) * WIDTH * 4  # a microbatch's shard
    layer_bytes = sum(4 * np.prod(v.shape) for v in jax.tree.leaves(st.unbox(params)))
    held = sum(row.device_bytes for row in plan.inputs.rows if row.path.split("/")[0] == "0")
    assert held == layer_bytes // 4  # 1/stages of the layers on each device
    loops = plan.schedule.pipelines()
    assert [(loop.trips, loop.idle) for loop in loops] == [(iterations, 3)] * 2


@pytest.mark.parametrize(
    "repeats, remat",
    [(1, False), (2, True), (2, jax.checkpoint_policies.everything_saveable)],
    ids=["gpipe", "circular-remat", "circular-everything-saveable"],
)
def test_the_backward_pass_holds_the_stages_weights_once_not_once_per_iteration(repeats, remat):
    """Wide layers, a small batch: a copy of a stage's weights per iteration would be
    most of the temporaries; the weights of a repeat are taken again instead."""
    wide = {
        "w": st.Partitioned(jax.ShapeDtypeStruct((8, 512, 512), jnp.float32), (None, None, None))
    }
    staged = st.stages(wide, 4, repeats=repeats)
    x = jax.ShapeDtypeStruct((8, 512), jnp.float32)
    layout = AbstractMesh((4,), ("stage",), axis_types=(AxisType.Auto,))

    def step(p, x):
        def loss(p):
            f = lambda h, q: (jnp.tanh(h @ st.unbox(q)["w"]), None)  # noqa: E731
            return jnp.mean(st.pipeline(f, x, p, microbatches=4, remat=remat)[0])

        return jax.grad(loss)(p)

    plan = st.preflight(step, staged, x, mesh=layout, rules=[("stage", "stage")])
    per_repeat = 8 // (4 * repeats) * 512 * 512 * 4  # one repeat of one stage's weights
    iterations = 4 * repeats + 3
    assert plan.temp_bytes < per_repeat * iterations / 2


# --- bad inputs -------------------------------------------------------------------------


def run(staged, x=None, microbatches=4, layout=None, f=block, axis="stage"):
    x = batch()[0] if x is None else x
    with st.logical_axis_rules(RULES), jax.set_mesh(layout or mesh()):
        return st.pipeline(f, x, staged, microbatches=microbatches, axis=axis)


@pytest.mark.parametrize(
    "microbatches, said",
    [
        (6, r"microbatches is 6, not a multiple of the 4 stages\. Give a multiple of 4"),
        (32, r"32 microbatches do not divide the leading \(batch\) dimension of init \(shape"),
        (0, r"microbatches is 0; expected an int >= 1"),
    ],
)
def test_microbatches_that_are_no_multiple_of_the_stages_or_do_not_divide_the_batch(
    microbatches, said
):
    with pytest.raises(ValueError, match=f"^pipeline: {said}"):
        run(st.stages(layers(), 4), microbatches=microbatches)


def test_a_microbatch_its_batch_axes_do_not_divide_is_a_value_error_on_explicit_axes():
    x = jax.device_put(batch()[0], jax.sharding.NamedSharding(mesh(), P("data")))
    with pytest.raises(ValueError) as e:
        run(st.stages(layers(), 4), x=x, microbatches=16)
    assert str(e.value) == (
        "pipeline: a microbatch of init holds 1 rows (16 over 16 microbatches), which its "
        "batch's mesh axes data (2 devices) do not divide. Give 4 or 8 microbatches, or a "
        "larger batch."
    )


def test_staged_layers_not_on_the_stage_axis_are_warned_of_on_explicit_axes():
    staged = st.stages(layers(), 4)  # placed nowhere: every device holds every stage
    x = jax.device_put(batch()[0], jax.sharding.NamedSharding(mesh(), P("data")))
    with pytest.warns(UserWarning, match=r"every device holds every stage's layers"):
        run(staged, x=x)
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh()):
        placed = st.shard(staged, mesh())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(placed, x=x)


def test_a_traced_microbatch_count_is_told_to_be_static():
    staged, x = st.stages(layers(), 4), batch()[0]
    said = r"microbatches is .*; expected an int >= 1 \(the microbatches .*; a Python int"
    with (
        st.logical_axis_rules(RULES),
        jax.set_mesh(mesh("auto")),
        pytest.raises(TypeError, match=said),
    ):
        jax.jit(lambda m: st.pipeline(block, x, staged, microbatches=m))(4)


def test_a_microbatch_no_count_fits_says_to_give_a_larger_batch():
    layout = jax.make_mesh((2, 4), ("stage", "data"))
    x = jax.device_put(jnp.ones((4, WIDTH)), jax.sharding.NamedSharding(layout, P("data")))
    with pytest.raises(ValueError, match=r"do not divide\. No count of them that is a multiple"):
        run(st.stages(layers(), 2), x=x, microbatches=2, layout=layout)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_batch_split_over_the_stage_axis_too_pipelines(kind):
    """Outside the pipeline the batch may be split over every axis, the stage axis
    among them; inside, each stage holds the carry whole along it."""
    params, (x, y) = layers(), batch()
    rules = [("batch", ("data", "stage")), *RULES[1:]]
    with st.logical_axis_rules(rules), jax.set_mesh(mesh(kind)):
        staged = st.shard(st.stages(params, 4), mesh(kind))
        x = st.shard(st.LogicallyPartitioned(x, ("batch", None)), mesh(kind)).value

        def loss(p, x):
            return jnp.mean((st.pipeline(block, x, p, microbatches=4)[0] - y) ** 2)

        got = jax.jit(loss)(staged, x)
    assert float(got) == pytest.approx(float(scanned_loss(params, batch()[0], y)), rel=1e-5)


def test_nested_boxes_and_leaves_that_are_no_arrays_are_said_so():
    nested = {"w": st.Partitioned(st.Partitioned(jnp.zeros((4, 2)), (None, None)), ())}
    with pytest.raises(ValueError, match=r"the box at layers\['w'\] holds a Partitioned, not an"):
        st.stages(nested, 2)
    with pytest.raises(ValueError, match=r"layers\['n'\] \(a str, not an array\) has fewer"):
        st.stages({"w": jnp.zeros((4, 2)), "n": "name"}, 2)


def test_a_mesh_without_the_stage_axis_or_of_another_size_is_a_value_error():
    staged = st.stages(layers(), 4)
    other = jax.make_mesh((2, 4), ("data", "tensor"))
    with pytest.raises(ValueError, match=r"^pipeline: the mesh in context has axes \{'data': 2,"):
        run(staged, layout=other)
    with pytest.raises(
        ValueError, match=r"stage axis 'stage' has 2 devices, but the staged layers have 4 stages"
    ):
        run(staged, layout=mesh(stages=2, data=4))
    with pytest.raises(ValueError, match=r"^pipeline: no mesh is in context"):
        st.pipeline(block, batch()[0], staged, microbatches=4)


def test_a_per_layer_output_or_a_changed_carry_is_a_value_error():
    staged = st.stages(layers(), 4)
    with pytest.raises(ValueError, match=r"^pipeline: f returned a per-layer output"):
        run(staged, f=lambda x, p: (block(x, p)[0], x))
    with pytest.raises(ValueError, match=r"^pipeline: f returned a carry of float32\[4,32\]"):
        run(staged, f=lambda x, p: (jnp.concatenate([x, x], -1), None))


def test_layers_passed_without_restaging_are_a_value_error_that_says_to_restage_them():
    with pytest.raises(ValueError) as e:
        run(layers())
    assert "pipeline: staged['down'] (names ('layers', 'mlp', 'embed'))" in str(e.value)
    assert str(e.value).endswith("Restage the stacked layers first: st.stages(layers, 4).")


def test_a_carry_of_bools_and_small_ints_comes_back_as_it_went_in():
    params, (x, _) = layers(), batch()
    init = (x, jnp.ones(BATCH, bool), jnp.arange(BATCH, dtype=jnp.int8))
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh("auto")):
        got, _ = jax.jit(
            lambda s, c: st.pipeline(
                lambda c, p: ((block(c[0], p)[0], *c[1:]), None), c, s, microbatches=4
            )
        )(st.stages(params, 4), init)
    assert [a.dtype for a in got] == [jnp.float32, jnp.bool_, jnp.int8]
    np.testing.assert_array_equal(got[2], init[2])


def test_f_that_returns_the_carry_alone_is_told_what_it_returned():
    with pytest.raises(
        ValueError,
        match=r"^pipeline: f returned float32\[4@data,16\]; expected \(carry, None\)",
    ):
        run(st.stages(layers(), 4), f=lambda x, p: block(x, p)[0])


def test_staged_arrays_that_disagree_on_the_stages_are_a_value_error():
    staged = st.stages(layers(), 4)
    staged["extra"] = jnp.zeros((1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"^pipeline: the arrays of staged disagree on their"):
        run(staged)
    with pytest.raises(ValueError, match=r"staged\['w'\] \(shape \(8, 3\)\) has fewer than 3"):
        run({"w": jnp.zeros((8, 3))})


def test_mesh_axis_boxes_whose_stage_dimension_is_another_axis_are_a_value_error():
    staged = {"w": st.Partitioned(jnp.zeros((1, 4, 2, 3)), (None, "data", None, None))}
    with pytest.raises(ValueError, match=r"other.*than the stage mesh axis 'stage'"):
        run(staged)
