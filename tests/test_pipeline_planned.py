"""A pipelined step planned and searched (0.8): preflight reads a pipeline's loops and
their bubble from the compiled program, the prediction counts the bubble as the program
runs it, advise shows and weighs it, and the search leaves out what no pipeline can run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from test_targets import has_compiler

import spmdtree as st

# Private: the schedule's records and the walk have no public names; hand-written
# schedules are walked by them.
from spmdtree._src.pipeline import Scope
from spmdtree._src.step.hlo.schedule import Collective, Done, Kernel, Loop, Schedule, Start
from spmdtree._src.step.hw import Costs
from spmdtree._src.step.time.predict import predict

LIBTPU = pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
#: A chip that runs 1 byte per second and no FLOPs: a kernel's time is its bytes.
COSTS = Costs(1.0, 1.0, 1.0, 1, (1, 1), 0.0, 0.0)


def walked(events, trips_of_comm=0.0):
    return predict(Schedule(tuple(events), "tpu"), COSTS, 1e30, lambda row: trips_of_comm)


# --- the walk counts the bubble as the program runs it --------------------------------


def test_a_pipeline_loops_bubble_is_its_idle_iterations_share_of_its_time():
    stage = Loop(2, (Kernel("memory", 0, 5),))  # each stage's layers: 10 s an iteration
    loop = Loop(11, (stage, Kernel("memory", 0, 2)), idle=3)
    said = walked([Kernel("memory", 0, 7), loop])
    assert said.seconds == pytest.approx(7 + 11 * 12)
    assert said.bubble_seconds == pytest.approx(3 * 12)


def test_a_loop_inside_a_pipelines_loop_is_its_stages_not_another_pipeline():
    """Two stages of 3 layers, 2 microbatches: the stage's scan of its layers runs 3
    times, as many as the pipeline's iterations, and is no pipeline's loop."""
    mesh = AbstractMesh((2, 4), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    candidate = st.Candidate(mesh, RULES, 16, options={"microbatches": 2})
    fn, (_, x), _ = make_step(candidate)
    staged = st.stages(layer_boxes(layers=6), 2)
    step = st.preflight(fn, staged, x, mesh=mesh, rules=RULES)
    assert [(loop.trips, loop.idle) for loop in step.schedule.pipelines()] == [(3, 1)] * 2
    assert "pipeline  2 loops over stage: 3 iterations, 1 of them on padding" in str(step)


def test_a_pipeline_inside_an_accumulation_loop_is_counted_each_time_it_runs():
    piped = Loop(7, (Kernel("memory", 0, 1),), idle=3)
    assert walked([Loop(5, (piped,))]).bubble_seconds == pytest.approx(5 * 3)
    assert walked([Loop(5, (Kernel("memory", 0, 1),))]).bubble_seconds == 0


def test_the_bubble_counts_the_collectives_its_iterations_wait_for():
    shift = Collective("collective-permute", 1, 8, ("stage",), 2)
    loop = Loop(4, (Start(0, shift, True), Done(0), Kernel("memory", 0, 1)), idle=1)
    said = walked([loop], trips_of_comm=3.0)
    assert said.seconds == pytest.approx(4 * 4) and said.bubble_seconds == pytest.approx(4)


def test_a_schedule_keeps_its_pipelines_through_json_and_names_their_stage_axes():
    shift = Start(0, Collective("collective-permute", 1, 64, ("stage",), 2), True)
    gather = Start(1, Collective("all-gather", 1, 64, ("fsdp",), 4), True)
    loop = Loop(11, (shift, Done(0), gather, Done(1)), name="while.3", idle=3)
    schedule = Schedule((loop, Loop(4, ())), "tpu")
    again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert again == schedule and again.pipelines() == (loop,)
    assert again.stage_axes() == ("stage",)
    assert Schedule((Loop(4, (gather, Done(1))),), "tpu").stage_axes() == ()


def test_the_scope_says_its_iterations_and_bubble_and_is_read_back():
    scope = Scope(stages=4, microbatches=8, repeats=2)
    assert (scope.iterations, scope.idle) == (19, 3)
    assert Scope.read(f"jit(step)/transpose(jvp({scope}))/while") == scope
    assert Scope.read("jit(step)/while") is None


def test_step_time_says_the_bubbles_share_of_the_predicted_step():
    timed = st.StepTime(0.5, {}, predicted_seconds=2.0, bubble_seconds=0.5)
    assert timed.bubble_share == 0.25
    assert st.StepTime(0.5, {}).bubble_share is None
    assert st.StepTime(0.5, {}, predicted_seconds=2.0, bubble_seconds=0.0).bubble_share == 0.0
    with pytest.raises(ValueError, match="bubble_seconds"):
        st.StepTime(0.5, {}, predicted_seconds=2.0, bubble_seconds=-1.0)


# --- a pipelined step, compiled ---------------------------------------------------------

WIDTH, LAYERS = 64, 8
RULES = [("batch", "data"), ("stage", "stage"), ("layers", None), ("embed", None), ("mlp", None)]


def layer_boxes(layers=LAYERS, width=WIDTH, dtype=jnp.float32):
    def box(shape, names):
        return st.LogicallyPartitioned(jax.ShapeDtypeStruct((layers, *shape), dtype), names)

    return {
        "up": box((width, 4 * width), ("layers", "embed", "mlp")),
        "down": box((4 * width, width), ("layers", "mlp", "embed")),
    }


def block(x, layer):
    p = st.unbox(layer)
    return x + jax.nn.relu(x @ p["up"]) @ p["down"], None


def make_step(candidate):
    """A stack of MLP blocks' gradient: pipelined over the mesh's stages where it has
    more than one (the candidate's microbatches and repeats), else scanned."""
    options = candidate.options or {}
    stages, width = dict(candidate.mesh.shape).get("stage", 1), options.get("width", WIDTH)
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, width), jnp.float32), ("batch", "embed")
    )
    if stages == 1:
        layers = layer_boxes(width=width)

        def run(p, x):
            return st.scan(block, x, p)[0]
    else:
        layers = st.stages(layer_boxes(width=width), stages, repeats=options.get("repeats", 1))

        def run(p, x):
            return st.pipeline(block, x, p, microbatches=options["microbatches"])[0]

    def step(p, x):
        return jax.grad(lambda p: jnp.mean(run(p, x.value) ** 2))(p)

    return step, (layers, x), {}


def test_a_pipelined_steps_table_says_its_loops_and_bubble():
    mesh = AbstractMesh((4, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    candidate = st.Candidate(mesh, RULES, 32, options={"microbatches": 8})
    fn, args, _ = make_step(candidate)
    step = st.preflight(fn, *args, mesh=mesh, rules=RULES)
    assert (
        "pipeline  2 loops over stage: 11 iterations, 3 of them on padding (the bubble: 27%)"
        in str(step)
    )
    timed = step.time(st.hardware("h100"))
    loops = sum(1 for _ in step.schedule.pipelines())
    assert loops == 2 and 0 < timed.bubble_share < 3 / 11
    assert step.to_dict(st.hardware("h100"))["time"]["bubble_seconds"] == timed.bubble_seconds
    flat = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    fn, args, _ = make_step(candidate._replace(mesh=flat))
    plain = st.preflight(fn, *args, mesh=flat, rules=RULES)
    assert "pipeline" not in str(plain) and plain.time(st.hardware("h100")).bubble_seconds == 0


def test_advise_ranks_pipelined_rows_beside_the_others_and_says_what_their_bubble_costs():
    plain, *staged = st.layouts(8, ("data", "stage"), sizes={"stage": (1, 4)})[::-1]
    found = [st.Candidate(plain, RULES, 32)]
    found += st.candidates(staged, RULES, 32, layers=LAYERS, microbatches=(4, 8))
    assert {dict(c.mesh.shape)["stage"] for c in found} == {1, 2, 4}
    advice = st.advise(make_step, found, hardware=st.hardware("h100"), progress=False)
    (header,) = [line for line in str(advice).splitlines() if line.startswith("#  layout")]
    assert header.split()[8] == "bubble"  # after predicted
    piped = [r for r in advice.rows if dict(r.candidate.mesh.shape)["stage"] > 1]
    plain = [r for r in advice.rows if dict(r.candidate.mesh.shape)["stage"] == 1]
    assert piped and plain
    for row in piped:
        (said,) = [f for f in row.flags if f.startswith("stages: its bubble takes")]
        assert f"({row.time.bubble_share:.0%} of the predicted step)" in said
        assert "stage traffic" in said and "over stage" in said
        best_plain = plain[0]
        mine = row.time.predicted_seconds / row.candidate.batch
        theirs = best_plain.time.predicted_seconds / best_plain.candidate.batch
        verdict = "costs more than the stages save" if mine > theirs else "save more than"
        assert verdict in said
    for row in plain:
        assert not any(f.startswith("stages:") for f in row.flags)
        assert row.time.bubble_seconds == 0
    # the pipelined steps use the stage rule, the others do not: nothing is said of it
    assert "('stage', 'stage')" not in advice.note
    json.dumps(advice.to_dict())


def test_where_only_pipelined_layouts_fit_the_bubble_is_the_price_of_their_memory():
    """Wide layers and a small batch: the weights and their gradients are the peak, and
    four stages hold a quarter of them."""
    meshes = [m for m in st.layouts(4, ("data", "stage")) if dict(m.shape)["data"] == 1]
    found = st.candidates(meshes, RULES, 4, layers=LAYERS, microbatches=(4,), width=(512,))
    flat = AbstractMesh((4,), ("data",), axis_types=(AxisType.Auto,))
    plain = st.Candidate(flat, RULES, 4, options={"width": 512})
    fn, args, _ = make_step(found[0])
    budget = 3 * st.preflight(fn, *args, mesh=found[0].mesh, rules=RULES).judged_bytes // 2
    advice = st.advise(
        make_step,
        [*found, plain],
        hardware=st.hardware("h100"),
        budget_bytes=budget,
        progress=False,
    )
    rows = {dict(r.candidate.mesh.shape).get("stage", 1): r for r in advice.rows}
    assert rows[1].verdict == "over budget"
    assert any("no layout without stages fits" in f for f in rows[4].flags)


# --- the search's constraints ---------------------------------------------------------------


def test_a_microbatch_its_batch_axes_do_not_divide_is_no_layout():
    mesh = AbstractMesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    found = st.candidates([mesh], RULES, 16, layers=LAYERS, microbatches=(8, 16))
    advice = st.advise(make_step, found, hardware=st.hardware("h100"), progress=False)
    rows = {row.candidate.options["microbatches"]: row for row in advice.rows}
    assert rows[8].verdict == "fits" and rows[16].verdict == "batch unsharded"
    assert rows[16].step is None and rows[16].reason == (
        "a microbatch of 1 (16 over 16 microbatches) is not divided by its batch axes data "
        "(2): their devices would compute it whole (the array at args[1], dimension 0); not "
        "compiled"
    )


def test_candidates_leave_out_stages_that_do_not_divide_the_layers_and_bad_microbatches():
    meshes = st.layouts(8, ("data", "stage"))
    found = st.candidates(meshes, None, 16, layers=12, microbatches=(2, 4, 32), repeats=(1, 2))
    kept = {
        (dict(c.mesh.shape)["stage"], c.options["microbatches"], c.options["repeats"])
        for c in found
    }
    assert kept == {
        (2, 2, 1), (2, 4, 1), (2, 2, 2), (2, 4, 2),  # 2 x 2 repeats divide 12
        (4, 4, 1),  # 4 x 2 do not; 2 microbatches are no multiple of 4
        (1, 2, 1), (1, 4, 1),  # repeats without stages are the same step as one
    }  # fmt: skip  # 32 microbatches divide no batch of 16; 8 stages do not divide 12


def test_where_no_layout_without_stages_was_tried_none_is_said_not_to_fit():
    mesh = AbstractMesh((4, 2), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    found = st.candidates([mesh], RULES, 16, layers=LAYERS, microbatches=(2, 8))
    advice = st.advise(make_step, found, hardware=st.hardware("h100"), progress=False)
    rows = {row.candidate.options["microbatches"]: row for row in advice.rows}
    assert rows[8].verdict == "batch unsharded"  # a microbatch of 2 over data 4
    (said,) = [f for f in rows[2].flags if f.startswith("stages:")]
    assert "no layout without stages" not in said and said.endswith("over stage")


def test_candidates_say_why_when_nothing_can_run():
    with pytest.raises(
        ValueError,
        match=r"^candidates: no combination can run: 3 microbatches are not a multiple of 2 stages",
    ):
        st.candidates([AbstractMesh((2,), ("stage",))], None, 12, microbatches=(3,))
    with pytest.raises(ValueError, match=r"4 stages x 1 repeats do not divide 6 layers"):
        st.candidates([AbstractMesh((4,), ("stage",))], None, 8, layers=6)
    with pytest.raises(ValueError, match=r"^candidates: layers is 0; expected an int >= 1"):
        st.candidates(st.layouts(2), None, 8, layers=0)
    with pytest.raises(TypeError, match=r"^candidates: layers is True; expected an int >= 1"):
        st.candidates(st.layouts(2), None, 8, layers=True)
    with pytest.raises(ValueError, match=r"no combination can run: microbatches 0: there must"):
        st.candidates(st.layouts(2), None, 8, microbatches=(0,))
    odd = st.candidates([AbstractMesh((2,), ("stage",))], None, 12, microbatches=(np.int64(3), 2))
    assert [c.options["microbatches"] for c in odd] == [2]  # numpy's ints are counts too
    assert (
        len(st.candidates(st.layouts(8, ("data", "fsdp")), None, 8, layers=7)) == 4
    )  # no stage axis


# --- the bubble follows the formula, on the chip's own compiler ---------------------------


@LIBTPU
def test_a_pipelined_decoders_predicted_time_on_a_tpu_follows_the_bubble_formula():
    """Four stages at 4, 8 and 16 microbatches of one batch, compiled by libtpu without
    the chip: the time without the bubble, predicted x m / (m + 3), holds within 10%,
    and each step's bubble is its loops' 3 of m + 3 iterations."""
    mesh = AbstractMesh((4,), ("stage",), axis_types=(AxisType.Explicit,))
    layers = st.stages(layer_boxes(8, 2048, jnp.bfloat16), 4)
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((64, 1024, 2048), jnp.bfloat16), ("batch", None, "embed")
    )
    rules = [("batch", None), *RULES[1:]]
    v5e, unbubbled = st.hardware("tpu-v5e"), {}
    for m in (4, 8, 16):

        def step(p, x, m=m):
            def loss(p):
                out = st.pipeline(block, x.value, p, microbatches=m)[0]
                return jnp.mean(out.astype(jnp.float32) ** 2)

            return jax.grad(loss)(p)

        plan = st.preflight(step, layers, x, mesh=mesh, rules=rules, target="tpu-v5e")
        timed = plan.time(v5e)
        unbubbled[m] = timed.predicted_seconds * m / (m + 3)
        assert [(loop.trips, loop.idle) for loop in plan.schedule.pipelines()] == [(m + 3, 3)] * 2
        assert 0.8 * 3 / (m + 3) < timed.bubble_share < 3 / (m + 3)
    assert max(unbubbled.values()) / min(unbubbled.values()) < 1.10
