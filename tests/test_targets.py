"""preflight(target=...): the accelerators' own compilers, without the accelerators.

Each preset's compile of a decoder step (scanned, rematerialised layers, bf16
compute) on 64 chips is checked against a raw `jax.jit` compile of the same
program for the same topology in this process, and its FLOPs against an
independent count of the jaxpr's dots. These tests need `spmdtree[cuda]` and
`spmdtree[tpu]` (CI installs both); without them they are skipped, and the
tests of what is checked before any compile (placements, a missing compiler)
still run.
"""

import dataclasses
import functools
import importlib.util
import itertools
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jaxprs import jaxpr_flops

import spmdtree as st

# Private: the chips' toolchains have no public name
from spmdtree._src.step.compile.backends import BY_CHIP

VOCAB, EMBED, HEADS, HEAD_DIM, MLP, LAYERS, LENGTH = 512, 128, 4, 32, 512, 2, 64
AUTO = (AxisType.Auto,) * 2
RULES = [
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    *[(name, None) for name in ("vocab", "layers", "heads", "head_dim", "mlp", "length")],
]
#: 64 chips per preset, as (data, fsdp) that `jax.make_mesh` lays on its topology:
#: 8 GPU nodes of 8; a v5p 4x4x4 slice; a v5e / v6e 8x8 slice.
SHAPES = {
    "h100": (8, 8),
    "h200": (8, 8),
    "b200": (8, 8),
    "tpu-v5p": (16, 4),
    "tpu-v5e": (8, 8),
    "tpu-v6e": (8, 8),
}
PLATFORM = {name: "tpu" if name.startswith("tpu") else "cuda" for name in SHAPES}


def has_module(module):
    """Whether `module` is installed; False where its parent package is missing too."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def has_compiler(platform):
    return has_module("libtpu" if platform == "tpu" else "jax_plugins.xla_cuda12")


def needs(preset):
    platform = PLATFORM[preset]
    extra = "tpu" if platform == "tpu" else "cuda"
    return pytest.param(
        preset,
        id=preset,
        marks=pytest.mark.skipif(
            not has_compiler(platform), reason=f"needs pip install 'spmdtree[{extra}]'"
        ),
    )


def boxed(shape, names):
    return st.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)


def params():
    def stacked(*shape_names):
        shape = tuple(n for n, _ in shape_names)
        return boxed((LAYERS, *shape), ("layers", *(name for _, name in shape_names)))

    e, h, d, m = (EMBED, "embed"), (HEADS, "heads"), (HEAD_DIM, "head_dim"), (MLP, "mlp")
    return {
        "embed": boxed((VOCAB, EMBED), ("vocab", "embed")),
        "layers": {
            "q": stacked(e, h, d),
            "k": stacked(e, h, d),
            "v": stacked(e, h, d),
            "o": stacked(h, d, e),
            "w_in": stacked(e, m),
            "w_out": stacked(m, e),
        },
        "out": boxed((EMBED, VOCAB), ("embed", "vocab")),
    }


def block(x, p):
    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), st.unbox(p))
    q = jnp.einsum("ble,ehd->blhd", x, p["q"])
    k = jnp.einsum("ble,ehd->blhd", x, p["k"])
    v = jnp.einsum("ble,ehd->blhd", x, p["v"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + jnp.einsum("blhd,hde->ble", attended, p["o"])
    return x + jax.nn.gelu(x @ p["w_in"]) @ p["w_out"], None


def make_step(remat):
    layer = jax.checkpoint(block) if remat else block

    def loss(params, tokens):
        p = st.unbox(params)
        x = jnp.take(p["embed"], tokens[:, :-1], axis=0).astype(jnp.bfloat16)
        x, _ = st.scan(layer, x, params["layers"], partition_name="layers")
        logits = (x @ p["out"].astype(jnp.bfloat16)).astype(jnp.float32)
        chosen = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - chosen[..., 0])

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens.value)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, params, grads)

    return step


def tokens(batch):
    return st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((batch, LENGTH + 1), jnp.int32), ("batch", "length")
    )


def abstract(shape):
    return AbstractMesh(shape, ("data", "fsdp"), axis_types=AUTO)


@functools.cache
def targeted(preset, remat=True, shape=None):
    """preflight of the step for the preset's compiler, on 64 chips."""
    return st.preflight(
        make_step(remat),
        params(),
        tokens(256),
        mesh=abstract(shape or SHAPES[preset]),
        rules=RULES,
        donate_argnums=0,
        target=preset,
    )


def topology_mesh(preset):
    """The preset's 64 devices without an accelerator, as a user lays them out."""
    from jax.experimental import topologies

    if PLATFORM[preset] == "cuda":
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=GPU_DESCRIPTIONS[preset], topology="1x8x8"
        )
    else:
        name = {"tpu-v5p": "v5p:4x4x4", "tpu-v5e": "v5e:8x8", "tpu-v6e": "v6e:8x8"}[preset]
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name)
    return jax.make_mesh(
        SHAPES[preset], ("data", "fsdp"), axis_types=AUTO, devices=topology.devices
    )


def _gpu(description, major, minor, sms, memory, bandwidth, clock, l2):
    # The figures are the data sheets' (docs/planning.md), written out here on their
    # own so the raw compile does not borrow preflight's description.
    return (
        f"gpu_device_info {{ cuda_compute_capability {{ major: {major} minor: {minor} }} "
        "threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
        f"shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {sms} "
        "fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 "
        f"block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: {l2} "
        f"clock_rate_ghz: {clock} device_memory_size: {memory} "
        "shared_memory_per_block_optin: 232448 registers_per_core_limit: 65536 "
        'registers_per_block_limit: 65536 } platform_name: "CUDA" '
        f'dnn_version_info {{ major: 9 minor: 8 }} device_description_str: "{description}"'
    )


GPU_DESCRIPTIONS = {
    "h100": _gpu("NVIDIA H100 80GB HBM3", 9, 0, 132, 85045477376, 3350 * 10**9, 1.98, 50 * 2**20),
    "h200": _gpu("NVIDIA H200", 9, 0, 132, 150754820096, 4800 * 10**9, 1.98, 50 * 2**20),
    "b200": _gpu("NVIDIA B200", 10, 0, 148, 192265846784, 8000 * 10**9, 1.965, 126 * 2**20),
}


@functools.cache
def raw(preset):
    """A raw `jax.jit` compile of the same step for the preset's topology, here."""
    mesh = topology_mesh(preset)
    # the compile option preflight gives XLA GPU without a device (GEMMs to cuBLAS)
    options = {"xla_gpu_enable_triton_gemm": False} if PLATFORM[preset] == "cuda" else {}
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        args = (st.to_abstract(params(), mesh), st.to_abstract(tokens(256), mesh))
        compiled = jax.jit(make_step(True), donate_argnums=0).lower(*args).compile(options)
    return mesh, compiled


def peak_of(compiled):
    """A raw compile's peak as preflight adds it: arguments + outputs - aliased +
    temporaries, from the compiler's own memory analysis."""
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


KINDS = r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"


def kinds_in(text):
    """The collective kinds an HLO text runs, async halves and wrapped ones included;
    libtpu's all-reduce-scatter fusions (an all-reduce of which each device keeps its
    shard) as reduce-scatters, not as the all-reduces inside."""
    fused = re.findall(r"kind=kCustom, calls=%?all-reduce-scatter", text)
    text = re.sub(r"\n%?all-reduce-scatter[\w.]* \(.*?\n\}", "", text, flags=re.S)
    direct = re.findall(r"\s" + KINDS + r"(?:-start)?\(", text)
    wrapped = re.findall(r"async-start\(.*?calls=%?" + KINDS, text)
    return set(direct) | set(wrapped) | ({"reduce-scatter"} if fused else set())


#: The whole preset grid (tools/mutants.py sets it), else a sample: one preset of each
#: compiler (the others' figures are checked against their sources in test_presets).
FULL = os.environ.get("SPMDTREE_FULL_GRID") == "1"
SAMPLE = ("h100", "tpu-v5p")


@pytest.mark.parametrize("preset", [needs(p) for p in SHAPES if FULL or p in SAMPLE])
def test_a_target_compile_is_the_raw_compile_of_the_same_program(preset):
    ours = targeted(preset)
    mesh, compiled = raw(preset)
    assert ours.peak_bytes == pytest.approx(peak_of(compiled), rel=0.01)
    assert {c.kind for c in ours.collectives} == kinds_in(compiled.as_text())
    # the same raw compile read by preflight itself (a Mesh of the topology's devices)
    with st.logical_axis_rules(RULES):
        here = st.preflight(make_step(True), params(), tokens(256), mesh=mesh, donate_argnums=0)
    gathered = lambda step: sum(c.bytes for c in step.collectives if c.kind == "all-gather")  # noqa: E731
    assert gathered(ours) == pytest.approx(gathered(here), rel=0.05)
    assert gathered(ours) > 0
    assert ours.backend == {"cuda": "gpu", "tpu": "tpu"}[PLATFORM[preset]]
    assert ours.overstated_bytes == 0
    assert not any("CPU compiler" in flag or "estimate" in flag for flag in ours.flags)
    assert f"64 x {preset}" in ours.target and "compiler" in ours.target
    assert ours.target in str(ours)


@pytest.mark.parametrize("preset", [needs("h100"), needs("tpu-v5p")])
def test_a_users_own_compile_on_target_mesh_is_preflights(preset):
    # what a user checking a figure does (0.6): the public mesh and options, a raw compile
    mesh = st.target_mesh(abstract(SHAPES[preset]), preset)
    theirs = topology_mesh(preset)  # written out apart from preflight's
    assert mesh.axis_names == theirs.axis_names and mesh.devices.shape == theirs.devices.shape
    assert mesh.devices.flat[0].device_kind == theirs.devices.flat[0].device_kind
    options = st.target_compiler_options(preset)
    assert options == ({"xla_gpu_enable_triton_gemm": False} if preset == "h100" else {})
    with st.logical_axis_rules(RULES), jax.set_mesh(mesh):
        args = (st.to_abstract(params(), mesh), st.to_abstract(tokens(256), mesh))
        compiled = jax.jit(make_step(True), donate_argnums=0).lower(*args).compile(options)
    assert targeted(preset).peak_bytes == pytest.approx(peak_of(compiled), rel=0.01)


def test_target_mesh_mistakes_are_said():
    mesh = abstract(SHAPES["h100"])
    with pytest.raises(
        TypeError, match=r"^target_mesh: target is 3; expected a st.Hardware, a preset's name"
    ):
        st.target_mesh(mesh, 3)
    with pytest.raises(TypeError, match=r"^target_mesh: "):
        st.target_mesh("not a mesh", "h100")
    with pytest.raises(ValueError, match=r"^target_compiler_options: "):
        st.target_compiler_options("h900")


@pytest.mark.parametrize("preset", [needs("h100"), needs("tpu-v5p")])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_target_flops_are_the_programs(preset, remat):
    # data parallel: every dot is split evenly over the 64 chips by its batch (under
    # FSDP the compiler may choose to compute some of them redundantly, measured
    # here: 1.47x the even share on 8 x 8, on CPU and GPU alike)
    step = targeted(preset, remat, (64, 1))
    with st.logical_axis_rules(RULES):
        args = (params(), tokens(256))
        jaxpr = jax.make_jaxpr(make_step(remat))(*args)
    assert step.flops == pytest.approx(jaxpr_flops(jaxpr.jaxpr) / 64, rel=0.01)
    assert not any("trip count" in flag for flag in step.flags)


@functools.cache
def on_four_nodes(preset):
    """The step on 16 devices as 4 GPU nodes or 4 TPU slices of 4 (target a Hardware)."""
    return st.preflight(
        make_step(False),
        params(),
        tokens(64),
        mesh=abstract((4, 4)),
        rules=RULES,
        donate_argnums=0,
        target=st.hardware(preset),
        devices_per_node=4,
    )


@pytest.mark.parametrize("preset", [needs("tpu-v5p"), needs("h100")])
def test_many_slices_or_nodes(preset):
    step = on_four_nodes(preset)
    kind = "slices" if preset.startswith("tpu") else "nodes"
    assert f"16 x {preset}, 4 {kind} of 4" in step.target
    assert step.peak_bytes > 0 and step.flops > 0


def without(monkeypatch, *chips):
    """The compilers of these kinds of chip replaced by fakes that are not installed
    (a toolchain is data: its install check looks for a module no one has)."""
    for chip in chips:
        fake = dataclasses.replace(BY_CHIP[chip], module="spmdtree_tests_no_such_compiler")
        monkeypatch.setitem(BY_CHIP, chip, fake)


def test_a_missing_compiler_names_the_pip_command(monkeypatch):
    without(monkeypatch, st.GpuChip, st.TpuChip)
    for preset, extra in (("h100", "cuda"), ("tpu-v5p", "tpu")):
        with pytest.raises(ValueError, match=rf"^preflight: .*pip install 'spmdtree\[{extra}\]'"):
            st.preflight(
                jnp.sin,
                jax.ShapeDtypeStruct((8,), jnp.float32),
                mesh=abstract((8, 1)),
                target=preset,
            )


@pytest.mark.parametrize(
    ("target", "shape", "per_node", "said"),
    [
        ("h100", (3, 4), None, r"12 GPUs does not fill nodes of 8"),
        ("tpu-v5p", (3, 4), None, r"12 tpu-v5p chips cannot be laid on TPU slices of 12"),
        ("tpu-v5e", (32, 16), None, r"at most 256 chips.*devices_per_node="),
        ("tpu-v5p", (4, 4), 3, r"slices of 3 chips"),
    ],
    ids=["gpu-nodes", "tpu-power-of-two", "tpu-slice-limit", "tpu-slice-size"],
)
def test_placements_are_checked_before_anything_compiles(target, shape, per_node, said):
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"^preflight: .*" + said):
        st.preflight(jnp.sin, x, mesh=abstract(shape), target=target, devices_per_node=per_node)


@pytest.mark.parametrize(
    ("target", "error"),
    [("mine", ValueError), (3, TypeError), (["h100"], TypeError)],
    ids=["unknown-name", "not-a-target", "unhashable"],
)
def test_a_target_spmdtree_does_not_know(target, error):
    with pytest.raises(error, match=r"^preflight: target is"):
        st.preflight(
            jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), mesh=abstract((8, 1)), target=target
        )


def advise_step(candidate):
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, 256), jnp.bfloat16), ("batch", None)
    )
    w = st.LogicallyPartitioned(jax.ShapeDtypeStruct((256, 256), jnp.float32), ("embed", "mlp"))

    def step(x, w):
        grad = jax.grad(lambda w: jnp.sum((x.value @ w.value.astype(jnp.bfloat16)) ** 2))(w)
        return st.replace_boxed(w, w.value - grad.value)

    return step, (x, w), {"donate_argnums": 1}


ADVISE_RULES = [("batch", "data"), ("embed", "fsdp"), ("mlp", None)]


def candidates():
    return [
        st.Candidate(mesh, ADVISE_RULES, batch=64)
        for mesh in st.layouts(8, ("data", "fsdp"), sizes={"fsdp": (1, 4)})
    ]


@functools.cache
def confirmed_advice(preset, budget=None):
    """advise on the CPU estimate, then `confirm=2` on the target: one search shared."""
    return st.advise(
        advise_step,
        candidates(),
        hardware=st.hardware(preset),
        budget_bytes=budget,
        progress=False,
        confirm=2,
        screen="cpu",
    )


def _ranked_by_one_key(advice):
    """Every hopeful row in order of its bound per sequence, then its peak,
    whichever compiler's figures it has (the test's own ordering of the rows)."""
    hopeful = [r for r in advice.rows if r.verdict in ("fits", "tight", "may fit")]
    keys = [
        (r.verdict != "fits", r.verdict == "may fit", r.time.bound_seconds / r.candidate.batch)
        for r in hopeful
    ]
    return all(
        a[:2] < b[:2] or (a[:2] == b[:2] and a[2] <= b[2] * (1 + 1e-6))
        for a, b in itertools.pairwise(keys)
    )


@pytest.mark.parametrize("preset", [needs("h100")])
def test_advise_confirms_screened_rows_with_the_target_compiler(preset):
    advice = confirmed_advice(preset)
    backends = [row.step.backend for row in advice.rows]
    assert backends.count("gpu") == 2 and backends.count("cpu") == len(backends) - 2
    assert advice.note.startswith(
        "screened on the CPU estimate as asked (screen='cpu'); the rows over the budget on it "
        "compiled for the target; 2 of 2 confirmed"
    )
    assert "2 of 2 confirmed: compiled for 8 x h100, 1 node of 8, XLA GPU compiler" in advice.note
    shown = str(advice)
    assert shown.count("XLA GPU") >= 3  # the note, and two rows
    # one key for every row: a confirmed row is never first for being confirmed
    assert _ranked_by_one_key(advice)


@pytest.mark.parametrize("preset", [needs("h100")])
def test_advise_screens_on_xla_gpu_where_it_is_installed(preset):
    advice = st.advise(advise_step, candidates(), hardware=st.hardware(preset), progress=False)
    assert {row.step.backend for row in advice.rows} == {"gpu"}
    assert (
        advice.note
        == "screened on the target: compiled for 8 x h100, 1 node of 8, XLA GPU compiler"
    )
    # the same figures as preflight on the target gives for the best row
    best = advice.best
    fn, args, kwargs = advise_step(best.candidate)
    direct = st.preflight(
        fn, *args, mesh=best.candidate.mesh, rules=best.candidate.rules, target=preset, **kwargs
    )
    assert best.step.peak_bytes == direct.peak_bytes and best.step.flops == direct.flops
    assert _ranked_by_one_key(advice)


def test_advise_with_confirm_and_no_compiler_is_an_error_at_the_call(monkeypatch):
    without(monkeypatch, st.GpuChip)
    called = []

    def make_step(candidate):
        called.append(candidate)
        return advise_step(candidate)

    for kwargs in ({"confirm": 2}, {"screen": "target"}):
        with pytest.raises(ValueError, match=r"^advise: .*pip install 'spmdtree\[cuda\]'"):
            st.advise(
                make_step, candidates(), hardware=st.hardware("h100"), progress=False, **kwargs
            )
    assert called == []  # before any work
    # without confirm: the CPU estimate, and the note says how to screen on the target, once
    advice = st.advise(advise_step, candidates(), hardware=st.hardware("h100"), progress=False)
    assert {row.step.backend for row in advice.rows} == {"cpu"}
    assert "pip install 'spmdtree[cuda]'" in advice.note
    assert str(advice).count("spmdtree[cuda]") == 1


@pytest.mark.parametrize("confirm", [-1, 1.5, True], ids=["negative", "float", "bool"])
def test_advise_checks_confirm_before_any_work(confirm):
    called = []
    with pytest.raises(ValueError, match=r"^advise: confirm is"):
        st.advise(
            lambda c: called.append(c),
            candidates(),
            hardware=st.hardware("h100"),
            confirm=confirm,
        )
    assert called == []


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_the_cpu_estimate_counts_what_the_program_computes(remat):
    # no target: the CPU compile keeps the remat barriers, so the recomputed forward
    # is counted as an accelerator runs it (0.3 read 5% less: CSE folded it away)
    step = st.preflight(
        make_step(remat), params(), tokens(64), mesh=abstract((8, 1)), rules=RULES, donate_argnums=0
    )
    with st.logical_axis_rules(RULES):
        jaxpr = jax.make_jaxpr(make_step(remat))(params(), tokens(64))
    assert step.backend == "cpu"
    assert step.flops == pytest.approx(jaxpr_flops(jaxpr.jaxpr) / 8, rel=0.01)


@pytest.mark.parametrize(
    ("target", "per_node", "said"),
    [
        (None, 4, r"devices_per_node is 4, but no target= was given"),
        ("h100", 0, r"devices_per_node is 0; expected an int >= 1"),
        ("h100", 2.0, r"devices_per_node is 2.0; expected an int >= 1"),
    ],
    ids=["without-target", "zero", "float"],
)
def test_devices_per_node_is_checked_at_the_call(target, per_node, said):
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"^preflight: " + said):
        st.preflight(jnp.sin, x, mesh=abstract((4, 2)), target=target, devices_per_node=per_node)


@pytest.mark.parametrize("preset", [needs("tpu-v5e")])
def test_a_step_too_big_for_the_chip_is_said_so(preset):
    # 6 GiB replicated twice, and the result: more than the 15.75 GiB libtpu allows a v5e
    big = jax.ShapeDtypeStruct((3 * 2**29,), jnp.float32)
    with pytest.raises(ValueError, match=r"^preflight: the step does not fit in the memory of one"):
        st.preflight(lambda a, b: a * 2 + b, big, big, mesh=abstract((4, 1)), target=preset)


@pytest.mark.parametrize("preset", [needs("tpu-v5p")])
def test_a_multi_slice_step_is_timed_as_it_was_compiled(preset):
    step = on_four_nodes(preset)
    assert step.devices_per_node == 4
    # the gradients' reduction across the slices (the megascale runtime's transfers)
    assert any(c.axes == ("data",) and c.group == 4 for c in step.collectives)
    hardware = st.hardware(preset)  # one slice, unless told otherwise
    assert step.time(hardware) == step.time(hardware, devices_per_node=4)
    assert step.time(hardware) != step.time(hardware, devices_per_node=16)


def test_a_compiler_at_another_version_names_the_pip_command(monkeypatch):
    from importlib import metadata

    if not has_compiler("tpu"):
        pytest.skip("needs pip install 'spmdtree[tpu]'")
    version = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "0.0.1" if name == "libtpu" else version(name)
    )
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(
        ValueError, match=r"^preflight: .* 0\.0\.1 is installed: pip install 'spmdtree\[tpu\]'"
    ):
        st.preflight(jnp.sin, x, mesh=abstract((8, 1)), target="tpu-v5p")


@pytest.mark.parametrize("preset", [needs("h100")])
def test_advise_says_when_the_confirmed_rows_do_not_fit_on_the_target(preset):
    # measured: the CPU estimate's peaks are 0.2-0.8 MB here, XLA GPU's about 4.3 MB
    # (its cuBLAS workspace): a 2 MB budget fits every estimate and no target compile
    advice = confirmed_advice(preset, 2_000_000)
    confirmed = [row for row in advice.rows if row.step.backend == "gpu"]
    assert len(confirmed) == 2 and all(row.verdict == "over budget" for row in confirmed)
    assert "2 of them do not fit there (the CPU estimate was low)" in advice.note
    # nothing confirmed fits, so every screened row that fits could still win: said
    first = next(i for i, row in enumerate(advice.rows, 1) if row.step.backend == "cpu")
    assert f"from row {first} on, the order is the CPU estimate's, unconfirmed" in advice.note


@pytest.mark.parametrize("preset", [needs("h100")])
def test_advise_says_when_nothing_is_left_to_confirm(preset):
    advice = st.advise(
        advise_step,
        candidates(),
        hardware=st.hardware(preset),
        budget_bytes=1,
        progress=False,
        confirm=2,
        screen="cpu",
    )
    assert advice.best is None and advice.compiles == 0
    assert "nothing to confirm: no row fits on the CPU estimate" in advice.note


def unrolled_bf16_step(candidate):
    """Four unrolled bf16 layers at a large batch: the CPU compiler widens their saved
    activations to f32 (measured: peak 27.8 MB on the CPU estimate, 4.2 MB on libtpu
    for a v5e at data 2 x fsdp 2, batch 4096)."""
    w = [boxed((512, 512), ("embed", "mlp")) for _ in range(4)]
    x = st.LogicallyPartitioned(
        jax.ShapeDtypeStruct((candidate.batch, 512), jnp.bfloat16), ("batch", None)
    )

    def step(w, x):
        def loss(w):
            h = x.value
            for layer in w:
                h = jnp.tanh(h @ layer.value.astype(jnp.bfloat16))
            return jnp.mean(h.astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(w)
        return [st.replace_boxed(a, a.value - 0.1 * g.value) for a, g in zip(w, grads, strict=True)]

    return step, (w, x), {"donate_argnums": 0}


UNROLLED = [st.Candidate(m, ADVISE_RULES, 4096) for m in st.layouts(4, ("data", "fsdp"))]


@pytest.mark.parametrize("preset", [needs("tpu-v5e")])
def test_a_row_over_budget_on_the_cpu_estimate_is_asked_of_libtpu(preset):
    # below every CPU estimate's peak (24-34 MB), above libtpu's own peak of one row (15
    # MB), what fitting on TPU is judged by (0.7: libtpu checks memory as it compiles)
    budget = 20_000_000
    advice = st.advise(
        unrolled_bf16_step,
        UNROLLED,
        hardware=st.hardware(preset),
        budget_bytes=budget,
        progress=False,
    )
    assert advice.note.startswith(
        "screened on the CPU estimate (libtpu costs far more per compile); the rows over the "
        "budget on it compiled for the target"
    )
    asked = [row for row in advice.rows if row.step.backend == "tpu"]
    assert asked, "no row was over the budget on the CPU estimate"
    for row in asked:  # its verdict is libtpu's, and equals preflight's on the target
        fn, args, kwargs = unrolled_bf16_step(row.candidate)
        direct = st.preflight(
            fn, *args, mesh=row.candidate.mesh, rules=ADVISE_RULES, target=preset, **kwargs
        )
        assert row.step.peak_bytes == direct.peak_bytes
        assert row.step.judged_bytes == direct.judged_bytes == direct.compiler_peak_bytes
        peak = direct.judged_bytes
        expected = "fits" if peak <= 0.95 * budget else "tight" if peak <= budget else "over budget"
        assert row.verdict == expected
    assert any(row.verdict == "fits" for row in asked)  # the estimate alone said over


def test_without_the_target_a_row_over_budget_on_the_estimate_says_so(monkeypatch):
    without(monkeypatch, st.TpuChip)
    advice = st.advise(
        unrolled_bf16_step,
        UNROLLED[:1],
        hardware=st.hardware("tpu-v5e"),
        budget_bytes=10_000_000,
        progress=False,
    )
    (row,) = advice.rows
    assert row.step.backend == "cpu" and row.verdict == "over budget"
    assert "on the CPU estimate, which ran 1.5-4.5x an accelerator's" in row.reason
    assert row.reason.endswith("install its compiler")
    assert "pip install 'spmdtree[tpu]'" in advice.note


@pytest.mark.parametrize("preset", [needs("tpu-v5p"), needs("h100")])
def test_the_compilers_own_figures_are_reported_beside_ours(preset):
    step = targeted(preset)
    _, compiled = raw(preset)
    memory = compiled.memory_analysis()
    if PLATFORM[preset] == "tpu":  # libtpu's own peak and time, as a raw compile gives them
        assert step.compiler_peak_bytes == memory.peak_memory_in_bytes > 0
        # 0.7: its kernels' estimated cycles, each times its calls, at the chip's clock
        # (optimal_seconds counts a loop's body once and -1 s per uncosted custom call)
        clock = st.hardware(preset).chip.clock_ghz * 1e9
        assert step.compiler_seconds == step.schedule.compiler_cycles() / clock > 0
        shown = str(step)
        assert "its peak" in shown and "libtpu's kernels' estimated cycles" in shown
    else:  # XLA GPU without a device: its own peak, and no time estimate
        assert step.compiler_peak_bytes == memory.peak_memory_in_bytes > 0
        assert step.compiler_seconds == 0.0 and "optimal_seconds" not in str(step)
    # on CPU neither: its memory analysis has no peak of its own
    cpu = st.preflight(jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), mesh=abstract((8, 1)))
    assert cpu.compiler_peak_bytes == 0 and "its peak" not in str(cpu)


@pytest.mark.parametrize("preset", [needs("h100"), needs("tpu-v5e")])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_a_step_with_a_shard_map_over_its_mesh_compiles_for_the_target(preset, kind):
    # The step's shard_map names the mesh preflight was given, which the mesh in
    # context while tracing must equal: traced for the target's device first, 0.5
    # refused it ("The context mesh ... should match the mesh passed to shard_map").
    mesh = AbstractMesh((2, 2), ("data", "fsdp"), axis_types=(kind, kind))
    spec = jax.P(("data", "fsdp"))

    def step(x):
        local = jax.shard_map(
            lambda x: jax.lax.psum(jnp.sum(x @ x.T), ("data", "fsdp")),
            mesh=mesh,
            in_specs=spec,
            out_specs=jax.P(),
        )
        return local(x)

    x = st.Partitioned(jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), (("data", "fsdp"), None))
    planned = st.preflight(lambda x: step(x.value), x, mesh=mesh, target=preset)
    assert planned.argument_bytes == 256 * 128 * 2 // 4
    assert planned.flops == 2 * 64 * 64 * 128  # each device's (64 x 128) @ (128 x 64)
    assert [c.kind for c in planned.collectives] == ["all-reduce"]


@pytest.mark.parametrize("preset", [needs("h100")])
def test_a_step_with_a_pallas_kernel_compiles_for_the_target(preset):
    # A Triton kernel's custom call has no compatibility guarantee across jax
    # versions, which jax.export refuses to serialize unless told: the target's
    # child runs this same jax, so preflight says it is fine (0.4: a ValueError).
    from jax.experimental import topologies

    attention = pytest.importorskip(
        "jax.experimental.pallas.ops.gpu.attention", reason="jax 0.12.1 dropped it"
    )

    def flash(q, k, v):
        return attention.mha(q, k, v, None, causal=True)

    shape = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    ours = st.preflight(
        flash, shape, shape, shape, mesh=AbstractMesh((1,), ("data",)), target=preset
    )
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=GPU_DESCRIPTIONS[preset], topology="1x1x1"
    )
    mesh = jax.make_mesh((1,), ("data",), axis_types=AUTO[:1], devices=topology.devices)
    placed = jax.ShapeDtypeStruct(
        shape.shape, shape.dtype, sharding=jax.NamedSharding(mesh, jax.P())
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(flash).lower(placed, placed, placed).compile()
    assert "__gpu$xla.gpu.triton" in compiled.as_text()
    # Triton's call keeps no cost estimate; this kernel is jax's own attention, so its
    # FLOPs come from its shapes (0.6; 0.5 counted none, with a flag): two dots of the
    # head width over every query-key pair, halved under the causal mask
    assert ours.flops == 2 * 2 * (1 * 512 * 2 * 64) * 512 // 2
    assert not [str(f) for f in ours.flags if "hand-written kernel" in str(f)], ours.flags
    memory = compiled.memory_analysis()
    assert ours.argument_bytes == memory.argument_size_in_bytes == 3 * 512 * 2 * 64 * 2
    assert ours.peak_bytes == (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def _doubled(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _pallas_step(cost_estimate):
    """A Pallas kernel (Mosaic on TPU) over a (1024, 1024) f32 array."""
    from jax.experimental import pallas as pl

    def step(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        call = pl.pallas_call(
            _doubled, out_shape=shape, cost_estimate=cost_estimate, name="doubled"
        )
        return call(x)

    return step


@pytest.mark.parametrize("preset", [needs("tpu-v5e")])
def test_a_pallas_kernels_cost_estimate_times_it_and_none_is_said(preset):
    # A hand-written kernel holds no dots the module shows: its author's cost
    # estimate is all there is. With one, the step's FLOPs and the predicted time
    # are the estimate's (FLOPs at v5e's peak, bytes at 90% of its 819 GB/s, the
    # larger plus 5% of the smaller); without one, the kernel is timed by its
    # operand and result bytes, and a flag says its FLOPs are left out.
    from jax.experimental import pallas as pl

    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    mesh = AbstractMesh((1,), ("data",), axis_types=(AxisType.Auto,))
    hw = st.hardware(preset)
    flops, size = 10**12, 10**9
    estimate = pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=size)
    given = st.preflight(_pallas_step(estimate), x, mesh=mesh, target=preset)
    assert given.flops == flops
    compute, memory = flops / 197e12, size / (819e9 * 0.9)
    t = given.time(hw)
    assert t.predicted_by_class["matmul"] == pytest.approx(compute + 0.05 * memory, rel=1e-3)
    assert not [f for f in given.flags if "cost estimate" in str(f)]

    bare = st.preflight(_pallas_step(None), x, mesh=mesh, target=preset)
    assert bare.flops == 0
    (flag,) = [str(f) for f in bare.flags if "cost estimate" in str(f)]
    assert flag.startswith("1 hand-written kernel with no cost estimate (")
    assert "(doubled)" in flag, flag  # the kernel's name, as pallas_call gave it
    t = bare.time(hw)
    assert t.predicted_by_class["matmul"] == 0
    assert t.predicted_by_class["memory"] >= 2 * 1024 * 1024 * 4 / (819e9 * 0.9)


# --- the job's compiler options (0.6) -----------------------------------------------------


def fsdp_args():
    """test_one_walk's FSDP step, on 8 devices of Auto axes."""
    from test_one_walk import fsdp_step

    step, params, x = fsdp_step()
    mesh = AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    rules = [("embed", "fsdp"), ("batch", "fsdp"), ("mlp", None)]
    return step, (params, x), {"mesh": mesh, "rules": rules, "donate_argnums": 0}


def sync_starts(plan):
    return [e.sync for e in plan.schedule.events if type(e).__name__ == "Start"]


@pytest.mark.skipif(not has_compiler("cuda"), reason="needs pip install 'spmdtree[cuda]'")
def test_compiler_options_reach_the_target_compile():
    step, args, kwargs = fsdp_args()
    own = st.preflight(step, *args, target="h100", **kwargs)
    sync = {"xla_gpu_disable_async_collectives": "ALLREDUCE"}  # a flag the schedule shows
    theirs = st.preflight(step, *args, target="h100", compiler_options=sync, **kwargs)
    assert own.schedule != theirs.schedule
    assert not all(sync_starts(own)) and all(sync_starts(theirs))
    with pytest.raises(ValueError, match=r"^preflight: .*No such compile option: 'xla_gpu_nope'"):
        st.preflight(step, *args, target="h100", compiler_options={"xla_gpu_nope": 1}, **kwargs)
    # advise's compiles for the target take them too
    candidate = st.Candidate(kwargs["mesh"], kwargs["rules"], batch=256)
    advice = st.advise(
        lambda c: (step, args, {"donate_argnums": 0}),
        [candidate],
        hardware=st.hardware("h100"),
        progress=False,
        screen="target",
        compiler_options=sync,
    )
    assert advice.rows[0].step.schedule == theirs.schedule


def test_the_cpu_estimate_compiles_without_the_jobs_options_and_says_so():
    step, args, kwargs = fsdp_args()
    options = {"xla_gpu_disable_async_collectives": "ALLREDUCE"}
    plan = st.preflight(step, *args, compiler_options=options, **kwargs)
    (said,) = [f for f in plan.flags if f.startswith("compiler_options")]
    assert "xla_gpu_disable_async_collectives" in said and "pass target=" in said
    plain = st.preflight(step, *args, **kwargs)
    assert plan.peak_bytes == plain.peak_bytes and plain.flags == tuple(
        f for f in plan.flags if f != said
    )


@pytest.mark.parametrize(
    "options, said",
    [
        ([("xla_a", 1)], r"compiler_options is \[\('xla_a', 1\)\]; expected a mapping"),
        ({"--xla_a": 1}, r"compiler_options has a key '--xla_a'; .*without the leading '--'"),
        ({"xla_a": [1]}, r"compiler_options\['xla_a'\] is \[1\]; expected a bool, int"),
    ],
)
def test_compiler_options_of_the_wrong_kind_are_refused(options, said):
    step, args, kwargs = fsdp_args()
    with pytest.raises(TypeError, match="^preflight: " + said):
        st.preflight(step, *args, compiler_options=options, **kwargs)


@pytest.mark.skipif(not has_compiler("cuda"), reason="needs pip install 'spmdtree[cuda]'")
def test_screened_on_the_target_the_first_line_promises_no_confirmation(capsys):
    step, args, kwargs = fsdp_args()
    candidate = st.Candidate(kwargs["mesh"], kwargs["rules"], batch=256)
    advice = st.advise(
        lambda c: (step, args, {"donate_argnums": 0}),
        [candidate],
        hardware=st.hardware("h100"),
        screen="target",
        confirm=2,
    )
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("advise: 1 candidate on 8 devices, at most 1 compile (each distinct ")
    assert "for the target" not in first and "screened on 8 x h100" in first
    assert advice.compiles == 1
