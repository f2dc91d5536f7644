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
from spmdtree._src.step.hlo.reading import read_step

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
