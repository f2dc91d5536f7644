"""The reading and the prediction are one walk of a compiled module (new in 0.6).

0.5 walked a module twice, and the walks disagreed: on libtpu's
all-reduce-scatter fusion the reading had a reduce-scatter, the schedule a
"memory" kernel with no collective time; a megascale send was a cross-slice
collective to one and free to the other. Now the reading is a fold of the
schedule, and here, over a grid of module forms, the collectives the reading
reports are exactly the ones the prediction times: with links slowed to a
crawl, the prediction's collective time is every reported row's time, and its
FLOPs the reading's.
"""

import functools

import pytest
from test_hlo_libtpu import LIBTPU, MODULE, SHAPE

# Private: the one walk, its readers and the model have no public names
from spmdtree._src.step.hlo.reading import read_step, reading_of
from spmdtree._src.step.hlo.schedule import read_schedule
from spmdtree._src.step.hw.hardware import Costs
from spmdtree._src.step.time.predict import predict

#: A model with no compute cost and a collective latency of its own: the links decide.
FREE = Costs(1e30, 1.0, 1.0, 1, (1, 1), 0.0, 1e-3)

ADD = """%add (p: f32[], q: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %r = f32[] add(%p, %q)
}
"""


def loop(trips, compare, constant_first, body_op):
    """A loop as libtpu leaves it (no known_trip_count): `trips` iterations of a dot
    and `body_op` over fsdp, its condition written with `compare` and either order."""
    bound, index = ("%n", "%j") if constant_first else ("%j", "%n")
    direction = {"LT": "GT", "LE": "GE"}[compare] if constant_first else compare
    limit = trips if compare == "LT" else trips - 1
    return f"""HloModule m
{ADD}
%body (s: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {{
  %s = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[64,64] get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[64,64] dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  {body_op}
  ROOT %t = (s32[], f32[64,64]) tuple(%next, %z)
}}
%cond (c: (s32[], f32[64,64])) -> pred[] {{
  %c = (s32[], f32[64,64]) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant({limit})
  ROOT %lt = pred[] compare({bound}, {index}), direction={direction}
}}
ENTRY %main (a: f32[64,64]) -> f32[64,64] {{
  %a = f32[64,64] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,64]) tuple(%zero, %a)
  %loop = (s32[], f32[64,64]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64] get-tuple-element(%loop), index=1
}}
"""


SYNC_REDUCE = "%z = f32[64,64] all-reduce(%y), replica_groups=[2,4]<=[8], to_apply=%add"
ASYNC_REDUCE = (
    "%zs = f32[64,64] all-reduce-start(%y), replica_groups=[2,4]<=[8], to_apply=%add\n"
    "  %z = f32[64,64] all-reduce-done(%zs)"
)
ASYNC_GATHER = (
    "%gs = (f32[16,64], f32[64,64]) all-gather-start(%y2), replica_groups=[2,4]<=[8], "
    "dimensions={0}\n  %z = f32[64,64] all-gather-done(%gs)"
)

CONDITIONAL = f"""HloModule m
{ADD}
%heavy (h: f32[64,64]) -> f32[64,64] {{
  %h = f32[64,64] parameter(0)
  %d = f32[64,64] dot(%h, %h), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %r = f32[64,64] all-reduce(%d), replica_groups=[2,4]<=[8], to_apply=%add
}}
%light (l: f32[64,64]) -> f32[64,64] {{
  ROOT %l = f32[64,64] parameter(0)
}}
ENTRY %main (a: f32[64,64], p: pred[]) -> f32[64,64] {{
  %a = f32[64,64] parameter(0)
  %p = pred[] parameter(1)
  ROOT %c = f32[64,64] conditional(%p, %a, %a), true_computation=%heavy, false_computation=%light
}}
"""

MEGASCALE = """HloModule m
ENTRY %main (a: f32[4096]) -> f32[4096] {
  %a = f32[4096] parameter(0)
  %tok = token[] after-all()
  %send = (f32[4096], u32[], token[]) send(%a, %tok), channel_id=5, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %done = token[] send-done(%send), channel_id=5
  ROOT %b = f32[4096] negate(%a)
}
"""


def modules():
    """(id, module text, platform, slice size) over the forms the walk reads."""
    for trips in (1, 3, 6):
        for compare in ("LT", "LE"):
            for first in (False, True):
                for name, op in (("sync", SYNC_REDUCE), ("async", ASYNC_REDUCE)):
                    text = loop(trips, compare, first, op)
                    yield (
                        f"loop-{trips}-{compare}-{'n-i' if first else 'i-n'}-{name}",
                        text,
                        "tpu",
                        None,
                    )
    gather = loop(4, "LT", False, ASYNC_GATHER).replace(
        "  %y = f32[64,64]",
        "  %y2 = f32[16,64] slice(%x), slice={[0:16], [0:64]}\n  %y = f32[64,64]",
    )
    yield "loop-async-gather", gather, "cuda", None
    yield "conditional", CONDITIONAL, "tpu", None
    for kind in ("kCustom", "kLoop"):
        for fill in (0, 1):
            text = MODULE.format(**{**LIBTPU, "kind": kind, "fill": fill})
            yield f"libtpu-{kind}-fill{fill}", text, "tpu", None
    yield "megascale", MEGASCALE, "tpu", 4


CASES = list(modules())


def crawl(row):
    """A link so slow that a collective's bytes are all its time (and its count)."""
    return row.bytes * 1e-3 + row.count * 1e-2


@pytest.mark.parametrize(
    "text, platform, slice_size", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_collective_the_reading_reports_is_timed_in_the_prediction(
    text, platform, slice_size
):
    schedule = read_schedule(text, SHAPE, platform=platform, slice_size=slice_size)
    reading = read_step(text, SHAPE, platform=platform, slice_size=slice_size)
    assert reading == reading_of(schedule)
    assert reading.collectives, "every case runs a collective"
    timed = functools.cache(crawl)
    said = predict(schedule, FREE, 1e30, timed)
    want = sum(
        crawl(row) + row.count * FREE.collective_latency_seconds for row in reading.collectives
    )
    assert said.comm_seconds == pytest.approx(want, rel=1e-9)
    # with every other cost nil, the step is its collectives, each exposed or hidden
    assert said.seconds >= said.exposed_comm_seconds > 0


def test_libtpus_all_reduce_scatter_fusion_is_timed_as_its_reduce_scatter():
    # 0.5's schedule timed it as a "memory" kernel with no collective time
    text = MODULE.format(**LIBTPU)
    schedule = read_schedule(text, SHAPE, platform="tpu")
    rows = [e.row for e in schedule.events if type(e).__name__ == "Start"]
    assert [(r.kind, r.written_as) for r in rows] == [
        ("reduce-scatter", "all-reduce-scatter"),
        ("all-reduce", "zero-filled all-reduce"),
    ]


def test_a_megascale_send_is_a_collective_across_slices_to_both():
    # 0.5's reading counted it across slices, its schedule as free
    schedule = read_schedule(MEGASCALE, SHAPE, platform="tpu", slice_size=4)
    (row,) = reading_of(schedule).collectives
    assert (row.kind, row.axes, row.group, row.bytes) == ("all-reduce", ("data",), 2, 4096 * 4)
    said = predict(schedule, FREE, 1e30, crawl)
    assert said.comm_seconds == pytest.approx(crawl(row) + FREE.collective_latency_seconds)


# --- compiled steps: every collective a step reports is timed ---------------------------


def fsdp_step():
    """One SGD step of a two-layer MLP, its weights and batch sharded over fsdp."""
    import jax
    import jax.numpy as jnp

    import spmdtree as st

    def box(shape, names):
        return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.bfloat16), names)

    params = {"w1": box((1024, 4096), ("embed", "mlp")), "w2": box((4096, 1024), ("mlp", "embed"))}
    x = box((256, 1024), ("batch", "embed"))

    def step(params, x):
        def loss(p):
            h = jnp.tanh(x.value @ p["w1"].value)
            return jnp.mean((h @ p["w2"].value).astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, params, x


@pytest.mark.target
@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
def test_with_links_slowed_to_a_crawl_every_reported_collective_is_timed(target):
    import dataclasses

    import jax
    from test_targets import has_compiler

    import spmdtree as st

    hardware = st.hardware(target)
    if not has_compiler("cuda" if target == "h100" else "tpu"):
        pytest.skip(f"needs the compiler of {target}")
    step, params, x = fsdp_step()
    # Auto: the compiler places the contraction over fsdp (Explicit axes ask the step to)
    mesh = jax.sharding.AbstractMesh((64,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    rules = [("embed", "fsdp"), ("batch", "fsdp"), ("mlp", None)]
    plan = st.preflight(step, params, x, mesh=mesh, rules=rules, target=target, donate_argnums=0)
    kinds = {row.kind for row in plan.collectives}
    assert kinds & {"all-gather", "reduce-scatter", "all-reduce"}, plan.collectives
    crawling = dataclasses.replace(hardware, links={"ici": (1e3, 0.0), "dcn": (1e3, 0.0)})
    timed = plan.time(crawling)
    count = sum(row.count for row in plan.collectives)
    latency = hardware.costs().collective_latency_seconds
    # the collectives dwarf everything else: the step is all of them, one after another
    assert timed.predicted_seconds == pytest.approx(timed.comm_seconds + count * latency, rel=1e-3)
