"""Reading libtpu's own forms of collectives from HLO text written by hand, in the
shape libtpu prints them (no libtpu needed): its all-reduce-scatter fusion (an
all-reduce of which each device keeps its shard) as a reduce-scatter, and an
all-gather it writes as an all-reduce of zero-filled buffers as the all-reduce it
runs, each row saying the form. The real compiles are in test_hlo_targets.py.

No public function reads HLO text (preflight compiles a step), so these tests
call the reader itself.
"""

import pytest

import spmdtree as st

# Private: the reader and its records have no public names
from spmdtree._src.step.hlo.reading import read_step
from spmdtree._src.step.hlo.schedule import Done, Kernel, Start, read_schedule

#: A mesh of data 2 x fsdp 4: partition p is data p // 4, fsdp p % 4.
SHAPE = (("data", 2), ("fsdp", 4))
ROWS, COLS, FSDP = 1024, 256, 4
WHOLE = ROWS * COLS * 4  # an f32[1024,256] gradient, or a gathered weight
SHARD = WHOLE // FSDP

#: A step in libtpu's forms: a kCustom fusion of a computation named
#: all-reduce-scatter that all-reduces its operand over fsdp and keeps the device's
#: dynamic-slice of it (a gradient's reduction); and a gather: the device's shard of a
#: weight written into zeros at its offset (in a loop fusion, then copied to another
#: memory space), then all-reduced. Each part can be changed to a neighbouring form.
MODULE = """HloModule m

%add (p: f32[], q: f32[]) -> f32[] {{
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %r = f32[] add(%p, %q)
}}

%all-reduce-scatter (input: f32[1024,256]) -> {out} {{
  %input = f32[1024,256] parameter(0)
  %sum = f32[1024,256] all-reduce(%input), channel_id=1, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
  %table = u32[8] constant({{0, 1, 2, 3, 0, 1, 2, 3}})
  %pid = u32[] partition-id()
  %at = u32[1] dynamic-slice(%table, %pid), dynamic_slice_sizes={{1}}
  %shard = u32[] bitcast(%at)
  %rows = u32[] constant({rows})
  %offset = u32[] multiply(%shard, %rows)
  %zero = u32[] constant(0)
  %mine = f32[{rows},256] dynamic-slice(%sum, %offset, %zero), dynamic_slice_sizes={{{rows},256}}
  ROOT %kept = {out} {root}
}}

%fill (zeros: f32[1024,256], shard: f32[256,256], offset: u32[]) -> f32[1024,256] {{
  %zeros = f32[1024,256] parameter(0)
  %shard = f32[256,256] parameter(1)
  %offset = u32[] parameter(2)
  %zero = u32[] constant(0)
  ROOT %placed = f32[1024,256] dynamic-update-slice(%zeros, %shard, %offset, %zero)
}}

ENTRY %main (g: f32[1024,256], w: f32[256,256]) -> ({out}, f32[1024,256]) {{
  %g = f32[1024,256] parameter(0)
  %w = f32[256,256] parameter(1)
  %scattered = {out} fusion(%g), kind={kind}, calls=%all-reduce-scatter
  %naught = f32[] constant({fill})
  %zeros = f32[1024,256] broadcast(%naught), dimensions={{}}
  %table = u32[8] constant({{0, 1, 2, 3, 0, 1, 2, 3}})
  %pid = u32[] {device}
  %at = u32[1] dynamic-slice(%table, %pid), dynamic_slice_sizes={{1}}
  %shard = u32[] bitcast(%at)
  %rows = u32[] constant(256)
  %offset = u32[] multiply(%shard, %rows)
  %filled = f32[1024,256] fusion(%zeros, %w, %offset), kind=kLoop, calls=%fill
  %moved = (f32[1024,256], f32[1024,256], u32[]) copy-start(%filled)
  %copied = f32[1024,256] copy-done(%moved)
  %gathered = f32[1024,256] all-reduce(%copied), channel_id=2, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
  ROOT %out = ({out}, f32[1024,256]) tuple(%scattered, %gathered)
}}
"""
LIBTPU = {
    "out": "f32[256,256]",
    "rows": 256,
    "root": "copy(%mine)",
    "kind": "kCustom",
    "fill": 0,
    "device": "partition-id()",
}


def read(**changes):
    """{(kind, written_as): bytes} of the module with `changes` to libtpu's form."""
    text = MODULE.format(**{**LIBTPU, **changes})
    found = read_step(text, SHAPE, platform="tpu").collectives
    assert all(c.count == 1 and c.axes == ("fsdp",) and c.group == FSDP for c in found)
    return {(c.kind, c.written_as): c.bytes for c in found}


def test_an_all_reduce_scatter_fusion_is_a_reduce_scatter_and_a_zero_filled_gather_is_named():
    found = read_step(MODULE.format(**LIBTPU), SHAPE, platform="tpu").collectives
    scatter = st.Collective("reduce-scatter", 1, SHARD, ("fsdp",), FSDP, "all-reduce-scatter")
    gather = st.Collective("all-reduce", 1, WHOLE, ("fsdp",), FSDP, "zero-filled all-reduce")
    assert found == (gather, scatter)
    # the scaling book's volumes: a reduce-scatter of B bytes over N devices sends
    # B (N-1)/N per device (half what the all-reduce 0.4 counted sends); an all-reduce
    # 2 B (N-1)/N
    assert scatter.wire_bytes == WHOLE * (FSDP - 1) // FSDP
    assert gather.wire_bytes == 2 * WHOLE * (FSDP - 1) // FSDP
    assert scatter.label == "reduce-scatter (written as libtpu's all-reduce-scatter fusion)"
    assert gather.label.startswith("all-reduce (an all-gather written as")


@pytest.mark.parametrize(
    "changes",
    [
        {"out": "f32[1024,256]", "root": "copy(%sum)"},  # keeps the whole, not the shard
        {"kind": "kLoop"},  # not libtpu's collective fusion
        {"out": "f32[128,256]", "rows": 128},  # a shard of 1/8 over groups of 4
    ],
    ids=["keeps-the-whole", "loop-fusion", "shard-not-the-groups"],
)
def test_a_fusion_that_is_not_a_reduce_scatter_counts_the_all_reduce_inside(changes):
    assert read(**changes) == {
        ("all-reduce", ""): WHOLE,
        ("all-reduce", "zero-filled all-reduce"): WHOLE,
    }


@pytest.mark.parametrize(
    "changes",
    [{"fill": 1}, {"device": "constant(1)"}],
    ids=["ones-not-zeros", "same-offset-on-every-device"],
)
def test_an_all_reduce_of_buffers_not_zero_filled_per_device_is_a_plain_one(changes):
    assert read(**changes) == {
        ("reduce-scatter", "all-reduce-scatter"): SHARD,
        ("all-reduce", ""): WHOLE,
    }


# --- libtpu's async collective fusion: one collective run in steps (0.6) -----------------

#: An all-gather of a weight's shard over fsdp, as libtpu runs it with its async
#: collective fusion (seen in MaxText's steps with libtpu 0.0.42): a fusion whose root
#: is an AsyncCollectiveStart custom call starts it; fusions of the layer's compute carry
#: it on (the same all-gather inside, the same chain_id); a fusion whose root is an
#: AsyncCollectiveDone custom call ends it. Written out as libtpu prints it.
CHAIN = """HloModule m

%start (s: f32[256,256]) -> (f32[256,256], f32[1024,256], u32[]) {{
  %s = f32[256,256] parameter(0)
  %ag = f32[1024,256] all-gather(%s), channel_id=7, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true, frontend_attributes={{chain_id="0"}}, backend_config={{"async_collective_fusion_config":{{"flag_start":"-1","flag_end":"-1"}}}}
  ROOT %cc = (f32[256,256], f32[1024,256], u32[]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}}

%carry (x: f32[512,1024], y: f32[1024,512], s: f32[256,256], g: f32[1024,256]) -> (f32[512,512], f32[1024,256]) {{
  %x = f32[512,1024] parameter(0)
  %y = f32[1024,512] parameter(1)
  %s = f32[256,256] parameter(2)
  %g = f32[1024,256] parameter(3)
  %d = f32[512,512] dot(%x, %y), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ag = f32[1024,256] all-gather(%s), channel_id=7, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true, frontend_attributes={{chain_id="0"}}, backend_config={{"async_collective_fusion_config":{{"flag_start":"2","flag_end":"8"}}}}
  ROOT %t = (f32[512,512], f32[1024,256]) tuple(%d, %ag)
}}

%done (s: f32[256,256], g: f32[1024,256]) -> f32[1024,256] {{
  %s = f32[256,256] parameter(0)
  %g = f32[1024,256] parameter(1)
  %ag = f32[1024,256] all-gather(%s), channel_id=7, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true, frontend_attributes={{chain_id="0"}}, backend_config={{"async_collective_fusion_config":{{"flag_start":"2","flag_end":"8"}}}}
  ROOT %cc = f32[1024,256] custom-call(%s, %g, %ag), custom_call_target="AsyncCollectiveDone"
}}

ENTRY %main (w: f32[256,256], x: f32[512,1024], y: f32[1024,512]) -> (f32[512,512], f32[1024,256]) {{
  %w = f32[256,256] parameter(0)
  %x = f32[512,1024] parameter(1)
  %y = f32[1024,512] parameter(2)
  %started = (f32[256,256], f32[1024,256], u32[]) fusion(%w), kind=kCustom, calls=%start
  %buffer = f32[1024,256] get-tuple-element(%started), index=1
{carries}
  %gathered = f32[1024,256] fusion(%w, %buffer{last}), kind=kCustom, calls=%done
  ROOT %out = (f32[512,512], f32[1024,256]) tuple(%c0_d, %gathered)
}}
"""


def chain(steps):
    """The module with `steps` compute fusions carrying the all-gather."""
    carries = []
    for i in range(steps):
        carries += [
            f"  %c{i} = (f32[512,512], f32[1024,256]) fusion(%x, %y, %w, %buffer), kind=kCustom, calls=%carry",
            f"  %c{i}_d = f32[512,512] get-tuple-element(%c{i}), index=0",
        ]
    return CHAIN.format(carries="\n".join(carries), last="")


@pytest.mark.parametrize("steps", [1, 3])
def test_an_async_collective_fusion_is_one_all_gather_overlapping_the_compute_it_is_carried_by(
    steps,
):
    text = chain(steps)
    # counted once however many fusions carry it (0.5 and early 0.6: once per fusion)
    gathered = st.Collective("all-gather", 1, WHOLE, ("fsdp",), FSDP)
    assert read_step(text, SHAPE, platform="tpu").collectives == (gathered,)
    events = read_schedule(text, SHAPE, platform="tpu").events
    starts = [e for e in events if isinstance(e, Start)]
    assert [(s.row, s.sync) for s in starts] == [(gathered, False)]  # async: overlapped
    kernels = [e for e in events if isinstance(e, Kernel)]
    assert len(kernels) == steps and all(k.kind == "matmul" for k in kernels)
    assert sum(k.flops for k in kernels) == steps * 2 * 512 * 512 * 1024  # the carried dots
    # the compute waits for it where its done fusion is: after the carrying fusions
    (done,) = [i for i, e in enumerate(events) if isinstance(e, Done)]
    assert events[done].ident == starts[0].ident and done == len(events) - 1
