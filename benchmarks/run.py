"""Ratio benchmarks: spmdtree against the raw-tree limit, side by side in one process.

Every figure is a ratio of two timings taken in alternating rounds (best of N
after a warm-up, timeit-style: the garbage collector is off while timing), so
machine noise hits both sides alike. Each line prints the
figure's name, the measured ratio, its goal and ok/MISSED; the exit status is
non-zero if a goal is missed. ``--quick`` runs small sizes to check that the
benchmarks still run, and never fails on a goal (CI is too noisy for timings).

Run: python benchmarks/run.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import subprocess
import sys
import timeit
from collections import Counter
from collections.abc import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdtree as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import advise as advised  # the Llama-3 8B step advise ranks (examples/advise.py)
import llama  # abstract Llama-3 trees
import train  # the main example's model and step

IS_BOX = st.AxisMetadata.__instancecheck__  # the C-level box test spmdtree walks with

RULES = [
    ("layers", None),
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", "data"),
    ("mlp", "model"),
    ("heads", "model"),
]


class Bench:
    """Collects figures and prints one line each."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.missed: list[str] = []

    def timed(self, fn: Callable[[], object], number: int) -> float:
        # timeit's convention: the garbage collector is off while timing.
        return timeit.Timer(fn).timeit(number) / number

    def best(self, fns: list[Callable[[], object]], number: int, rounds: int) -> list[float]:
        """Each function's best time, from `rounds` rounds that take turns."""
        for fn in fns:
            fn()  # warm-up: compile, fill caches
        bests = [math.inf] * len(fns)
        for _ in range(1 if self.quick else rounds):  # quick: checks that it runs
            for i, fn in enumerate(fns):
                bests[i] = min(bests[i], self.timed(fn, number))
        return bests

    def ratio(
        self, base: Callable[[], object], ours: Callable[[], object], number: int, rounds: int
    ) -> tuple[float, float, float]:
        """(ours / base, base seconds, ours seconds), best of `rounds` alternating rounds."""
        best_base, best_ours = self.best([base, ours], number, rounds)
        return best_ours / best_base, best_base, best_ours

    def figure(
        self, name: str, value: float, goal: str = "", ok: bool | None = None, unit: str = "x"
    ) -> None:
        if ok is not None and self.quick:
            ok, verdict = None, "(quick: not judged)"
        else:
            verdict = "" if ok is None else ("ok" if ok else "MISSED")
        if ok is False:
            self.missed.append(name)
        print(f"{name:<50} {value:8.2f}{unit:<2} {goal:<16} {verdict}".rstrip())

    def at_most(self, name: str, value: float, goal: float) -> None:
        self.figure(name, value, f"goal <= {goal:g}", value <= goal)


def layered(n_layers: int, boxed: str | None) -> dict:
    """n_layers x (kernel, bias): raw, or boxed with mesh-axis or logical names."""
    tree = {}
    for i in range(n_layers):
        kernel, bias = jnp.zeros((8, 16)), jnp.zeros(16)
        if boxed == "logical":
            kernel = st.LogicallyPartitioned(kernel, ("embed", "mlp"))
            bias = st.LogicallyPartitioned(bias, ("mlp",))
        elif boxed == "mesh":
            kernel = st.Partitioned(kernel, ("data", "model"))
            bias = st.Partitioned(bias, ("model",))
        tree[f"layer_{i:05d}"] = {"kernel": kernel, "bias": bias}
    return tree


def b1_pytree(bench: Bench, n_layers: int) -> None:
    raw, boxed = layered(n_layers, None), layered(n_layers, "mesh")
    raw_leaves, raw_def = jax.tree.flatten(raw)
    box_leaves, box_def = jax.tree.flatten(boxed)
    number, rounds = 5, 80
    flat, raw_flat, box_flat = bench.ratio(
        lambda: jax.tree.flatten(raw), lambda: jax.tree.flatten(boxed), number, rounds
    )
    unflat, raw_unflat, box_unflat = bench.ratio(
        lambda: jax.tree.unflatten(raw_def, raw_leaves),
        lambda: jax.tree.unflatten(box_def, box_leaves),
        number,
        rounds,
    )
    same, _, _ = bench.ratio(
        lambda: jax.tree.map(lambda x: x, raw),
        lambda: jax.tree.map(lambda x: x, boxed),
        number,
        rounds,
    )
    leaves = 2 * n_layers
    bench.figure(f"B1 flatten ({leaves} leaves)", flat, "reported")
    bench.figure(f"B1 unflatten ({leaves} leaves)", unflat, "reported")
    # A round trip costs a flatten plus an unflatten: the sum of the two best
    # times is a steadier estimate than timing the pair (same work, less noise).
    trip = (box_flat + box_unflat) / (raw_flat + raw_unflat)
    bench.at_most(f"B1 flatten + unflatten ({leaves} leaves)", trip, 2.0)
    bench.at_most(f"B1 jax.tree.map identity ({leaves} leaves)", same, 2.0)


def b2_to_sharding(bench: Bench, mesh: jax.sharding.Mesh, sizes: list[int]) -> None:
    fixed = P("data", "model")
    own_per_leaf = []
    for n_leaves in sizes:
        raw, boxed = layered(n_leaves // 2, None), layered(n_leaves // 2, "logical")
        base = functools.partial(jax.tree.map, lambda x: NamedSharding(mesh, fixed), raw)
        ours = functools.partial(st.to_sharding, boxed, mesh, RULES)
        # jax's own walk of the same tree: flatten (boxes as leaves) and unflatten.
        walk = lambda tree=boxed: jax.tree.unflatten(  # noqa: E731
            *reversed(jax.tree.flatten(tree, is_leaf=IS_BOX))
        )
        base_s, walk_s, ours_s = bench.best([base, walk, ours], max(1, 50000 // n_leaves), 15)
        own_per_leaf.append((ours_s - walk_s) / n_leaves)
        if n_leaves == 4000:
            bench.at_most("B2 to_sharding, 4000 logical leaves, 6 rules", ours_s / base_s, 1.5)
        per_leaf = ours_s / n_leaves * 1e6
        bench.figure(
            f"B2 to_sharding per leaf at {n_leaves} leaves", per_leaf, "reported", unit="us"
        )
        bench.figure(
            "B2   of which jax's tree walk", walk_s / n_leaves * 1e6, "reported", unit="us"
        )
    # jax's walk of a tree grows per leaf (it sorts dict keys, and memory gets
    # slower as the tree grows); spmdtree's own work per leaf must not.
    growth = own_per_leaf[-1] / own_per_leaf[0]
    bench.at_most(f"B2 spmdtree's own cost per leaf, {sizes[-1]} / {sizes[0]}", growth, 1.5)


def b3_dispatch(bench: Bench, mesh: jax.sharding.Mesh) -> None:
    raw = {f"leaf_{i:03d}": jnp.full((4,), float(i)) for i in range(200)}
    boxed = {k: st.Partitioned(v, ("model",)) for k, v in raw.items()}
    identity = jax.jit(lambda t: t)
    value, _, _ = bench.ratio(lambda: identity(raw), lambda: identity(boxed), 100, 30)
    bench.at_most("B3 jit dispatch, 200-leaf tree in and out", value, 1.3)

    params = st.shard(layered(8, "logical"), mesh, RULES)
    raw_params = st.unbox(params)
    tx = optax.adam(1e-3)
    x = jnp.ones((4, 8))

    def loss(p, x):
        p = st.unbox(p)
        return sum(jnp.sum((x @ layer["kernel"] + layer["bias"]) ** 2) for layer in p.values())

    def step(p, s, x):
        grads = jax.grad(loss)(p, x)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    jitted = jax.jit(step)
    box_state, raw_state = tx.init(params), tx.init(raw_params)

    def run(p, s):
        out = jitted(p, s, x)
        jax.block_until_ready(out)

    value, _, _ = bench.ratio(
        lambda: run(raw_params, raw_state), lambda: run(params, box_state), 20, 15
    )
    bench.at_most("B3 jitted adam step, boxed params + state", value, 1.3)


def _shardings(text: str) -> Counter:
    """The multiset of sharding annotations in compiled HLO, op names stripped."""
    return Counter(re.findall(r"sharding=(\{[^}]*\})", text))


def b4_compiled(bench: Bench, mesh: jax.sharding.Mesh, size: int) -> None:
    key = jax.random.key(0)
    shapes = {
        "w1": ((size, 4 * size), ("embed", "mlp")),
        "w2": ((4 * size, size), ("mlp", "embed")),
    }
    boxed = {
        name: st.LogicallyPartitioned(jax.random.normal(key, shape) / size, names)
        for name, (shape, names) in shapes.items()
    }
    by_hand = {"w1": P("data", "model"), "w2": P("model", "data")}
    x = jax.random.normal(key, (4 * size, size))
    x_sharding = NamedSharding(mesh, P("data", None))

    def ours(p, x):
        p = st.unbox(p)
        h = st.with_logical_constraint(jnp.tanh(x @ p["w1"]), ("batch", "mlp"), RULES, mesh)
        return st.with_logical_constraint(h @ p["w2"], ("batch", "embed"), RULES, mesh)

    def theirs(p, x):
        h = jax.lax.with_sharding_constraint(
            jnp.tanh(x @ p["w1"]), NamedSharding(mesh, P("data", "model"))
        )
        return jax.lax.with_sharding_constraint(h @ p["w2"], NamedSharding(mesh, P("data", None)))

    ours_shardings = st.to_sharding(boxed, mesh, RULES)
    theirs_shardings = {k: NamedSharding(mesh, spec) for k, spec in by_hand.items()}
    ours_jit = jax.jit(ours, in_shardings=(ours_shardings, x_sharding), out_shardings=x_sharding)
    theirs_jit = jax.jit(
        theirs, in_shardings=(theirs_shardings, x_sharding), out_shardings=x_sharding
    )
    ours_params = jax.device_put(boxed, ours_shardings)
    theirs_params = jax.device_put(st.unbox(boxed), theirs_shardings)
    x = jax.device_put(x, x_sharding)

    ours_text = ours_jit.lower(ours_params, x).compile().as_text()
    theirs_text = theirs_jit.lower(theirs_params, x).compile().as_text()
    same = _shardings(ours_text) == _shardings(theirs_text) and bool(_shardings(ours_text))
    bench.figure(
        "B4 compiled HLO sharding annotations equal", float(same), "goal 1 (equal)", same, unit=""
    )
    np.testing.assert_allclose(ours_jit(ours_params, x), theirs_jit(theirs_params, x), rtol=1e-5)

    value, _, _ = bench.ratio(
        lambda: theirs_jit(theirs_params, x).block_until_ready(),
        lambda: ours_jit(ours_params, x).block_until_ready(),
        5,
        11,
    )
    bench.figure(
        "B4 run time, spmdtree step / hand-written", value, "goal 0.9-1.1", 0.9 <= value <= 1.1
    )


def b5_sharded_init(bench: Bench, mesh: jax.sharding.Mesh, size: int) -> None:
    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "embed": st.LogicallyPartitioned(
                jax.random.normal(k1, (size, size)), ("vocab", "embed")
            ),
            "mlp": st.LogicallyPartitioned(
                jax.random.normal(k2, (size, 2 * size)), ("embed", "mlp")
            ),
            "bias": st.LogicallyPartitioned(jax.random.normal(k3, (8 * size,)), ("flat",)),
        }

    rules = [("vocab", "model"), ("embed", "data"), ("mlp", "model"), ("flat", ("data", "model"))]
    key = jax.random.key(0)

    def peak(fn: Callable) -> tuple[int, int]:
        stats = st.sharded_init(fn, mesh, rules).lower(key).compile().memory_analysis()
        held = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        return stats.output_size_in_bytes, held

    arrays = st.unbox(jax.eval_shape(init, key))
    full = {name: math.prod(a.shape) * a.dtype.itemsize for name, a in arrays.items()}
    output, _ = peak(init)
    bench.at_most(
        "B5 sharded_init output bytes / (global / 8)", output / (sum(full.values()) / 8), 1.1
    )
    # Each array alone: a device's peak memory stays below one full copy of it.
    worst = max(peak(lambda k, n=name: init(k)[n])[1] / full[name] for name in full)
    bench.at_most("B5 peak device bytes / full array, worst array", worst, 1.0)


def b6_optimizer_sharding(bench: Bench, mesh: jax.sharding.Mesh, sizes: list[int]) -> None:
    """optimizer_sharding matches state leaves to params by key-path suffix in linear time."""
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)  # every kernel's statistics reduced
    per_leaf = []
    for n_leaves in sizes:
        params = jax.eval_shape(lambda n=n_leaves: layered(n // 2, "logical"))
        seconds = bench.best([lambda p=params: st.optimizer_sharding(tx, p, mesh, RULES)], 1, 5)
        per_leaf.append(seconds[0] / n_leaves)
        bench.figure(
            f"B6 optimizer_sharding per param at {n_leaves} params",
            per_leaf[-1] * 1e6,
            "reported",
            unit="us",
        )
    bench.at_most(
        f"B6 optimizer_sharding per param, {sizes[-1]} / {sizes[0]}",
        per_leaf[-1] / per_leaf[0],
        1.5,
    )
    params = llama.params("405B", stacked=False)  # 1,137 arrays, one subtree per layer
    abstract_mesh = jax.sharding.AbstractMesh((256, 8), ("fsdp", "tensor"))
    rules = [("embed", "fsdp"), ("mlp", "tensor"), ("q_heads", "tensor"), ("heads", "tensor")]
    adamw = optax.adamw(1e-4)
    state = jax.eval_shape(adamw.init, params)
    plain, matched = bench.best(
        [
            lambda: st.to_sharding(state, abstract_mesh, rules),
            lambda: st.to_sharding(state, abstract_mesh, rules, params=params),
        ],
        1,
        5 if bench.quick else 15,
    )
    bench.at_most("B6 405B adamw state: to_sharding params= / without", matched / plain, 2.0)
    whole, traced = bench.best(
        [
            lambda: st.optimizer_sharding(adamw, params, abstract_mesh, rules),
            lambda: st.to_sharding(jax.eval_shape(adamw.init, params), abstract_mesh, rules),
        ],
        1,
        3 if bench.quick else 7,
    )
    bench.at_most(
        "B6 405B adamw: optimizer_sharding / (eval_shape + to_sharding)", whole / traced, 2.0
    )
    bench.figure("B6 405B adamw: optimizer_sharding", whole * 1e3, "reported", unit="ms")


def b7_b8_plan(bench: Bench, mesh: jax.sharding.Mesh, sizes: list[int]) -> None:
    """A plan costs little more than to_sharding: rows share what layers repeat."""
    params = llama.params("405B", stacked=False)  # 126 layers x 9 arrays, + 3
    tree = {"params": params, "opt_state": jax.eval_shape(optax.adamw(1e-4).init, params)}
    chips = jax.sharding.AbstractMesh((256, 8), ("fsdp", "tensor"))  # 2,048 chips
    rules = [("embed", "fsdp"), ("mlp", "tensor"), ("q_heads", "tensor"), ("heads", "tensor")]
    shardings, planned = bench.best(
        [
            lambda: st.to_sharding(tree, chips, rules, params=params),
            lambda: st.plan(tree, chips, rules, params=params),
        ],
        1,
        5 if bench.quick else 15,
    )
    leaves = len(jax.tree.leaves(tree))
    bench.at_most(f"B7 plan / to_sharding, 405B + adamw ({leaves} leaves)", planned / shardings, 10)
    bench.figure("B7 plan of 405B + adamw on 2048 chips", planned * 1e3, "reported", unit="ms")
    per_leaf = []
    for n_leaves in sizes:
        tree = jax.eval_shape(lambda n=n_leaves: layered(n // 2, "logical"))
        seconds = bench.best([lambda t=tree: st.plan(t, mesh, RULES)], 1, 3 if bench.quick else 7)
        per_leaf.append(seconds[0] / n_leaves)
        bench.figure(
            f"B8 plan per leaf at {n_leaves} leaves", per_leaf[-1] * 1e6, "reported", unit="us"
        )
    bench.at_most(f"B8 plan per leaf, {sizes[-1]} / {sizes[0]}", per_leaf[-1] / per_leaf[0], 1.5)


def b9_preflight(bench: Bench) -> None:
    """preflight of the main example's step for 2,048 chips, from this 8-device process
    (a subprocess compiles it), against a bare compile of the same step here."""
    init = functools.partial(train.init, vocab=32, length=16, width=64, layers=2, heads=4, mlp=256)
    tx = train.adamw(1e-2)
    step = train.make_train_step(tx)
    tokens = jax.ShapeDtypeStruct((1024, 17), jnp.int32)
    auto = (AxisType.Auto,) * 3  # as the example's mesh
    axes = ("data", "fsdp", "tensor")
    chips = jax.sharding.AbstractMesh(train.mesh_shape(2048), axes, axis_types=auto)
    here = jax.make_mesh(train.mesh_shape(8), axes, axis_types=auto)
    with st.logical_axis_rules(train.RULES):
        params = jax.eval_shape(init, jax.random.key(0))
        state = jax.eval_shape(tx.init, params)
        batch = st.LogicallyPartitioned(tokens, ("batch", "length"))

        def preflight() -> object:
            return st.preflight(
                lambda p, s, t: step(p, s, t.value),
                params,
                state,
                batch,
                mesh=chips,
                params=params,
                donate_argnums=(0, 1),
            )

        def bare() -> object:
            with jax.set_mesh(here):
                args = (
                    st.to_abstract(params, here),
                    st.to_abstract(state, here, params=params),
                    st.to_abstract(batch, here),
                )
                jitted = jax.jit(lambda p, s, t: step(p, s, t.value), donate_argnums=(0, 1))
                return jitted.lower(*args).compile()

        base, ours = bench.best([bare, preflight], 1, 2 if bench.quick else 3)
    bench.at_most("B9 preflight on 2048 chips / bare compile on 8", ours / base, 3.0)
    bench.figure("B9 preflight of the main step on 2048 chips", ours, "reported", unit="s")


#: The options preflight compiles for fake CPU devices with (docs/planning.md): no
#: costly machine-code optimisation, which changes no buffer; remat barriers kept.
CPU_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_disable_hlo_passes": "cse_barrier_expander",
}

#: The Llama-3 step of examples/advise.py: (model size, chips, length) per mode.
ADVISED = {False: ("8B", 256, 4096), True: ("tiny", 16, 128)}


def _llama_args(size: str, batch: int, length: int) -> tuple[tuple, dict]:
    """The 8B (or tiny) train step's arguments at a global batch, as advise's make_step."""
    candidate = st.Candidate(jax.sharding.AbstractMesh((1,), ("data",)), None, batch, length)
    _, args, kwargs = advised.make_step(size, length)(candidate)
    return args, kwargs


def bare_compile(size: str, shape: tuple[int, ...], batch: int, length: int) -> float:
    """Seconds of one bare `jax.jit(...).lower(...).compile()` of the Llama-3 train step
    on CPU devices laid out as `shape`, timed inside a fresh process that has them
    (with the compiler options preflight uses for fake devices)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={math.prod(shape)}",
    }
    command = [sys.executable, __file__, "--bare", size, ",".join(map(str, shape)), str(batch)]
    done = subprocess.run(
        [*command, str(length)], capture_output=True, text=True, env=env, check=True
    )
    return float(done.stdout.split()[-1])


def _lowered(size: str, batch: int, length: int, mesh: Mesh) -> jax.stages.Lowered:
    """The Llama-3 train step lowered for `mesh` as a raw `jax.jit` would lower it:
    the example's rules, donated params and state (what B10's bare compile and B12
    time)."""
    (params, state, tokens), _ = _llama_args(size, batch, length)
    with st.logical_axis_rules(advised.example.RULES), jax.set_mesh(mesh):
        args = (
            st.to_abstract(params, mesh),
            st.to_abstract(state, mesh, params=params),
            st.to_abstract(tokens, mesh),
        )
        return jax.jit(advised.example.train_step, donate_argnums=(0, 1)).lower(*args)


def _bare(size: str, shape_text: str, batch: int, length: int) -> None:
    """The child of `bare_compile`: prints its compile's seconds."""
    shape = tuple(int(n) for n in shape_text.split(","))
    mesh = jax.make_mesh(shape, advised.example.AXES, axis_types=(AxisType.Auto,) * len(shape))
    lowered = _lowered(size, batch, length, mesh)
    start = timeit.default_timer()
    lowered.compile(CPU_OPTIONS)
    print(timeit.default_timer() - start)


def b9_fsdp(bench: Bench) -> None:
    """preflight of the Llama-3 step, pure FSDP on 2,048 chips, against one bare compile
    of the same step on 8 devices here (another process, as preflight's child)."""
    size, _, length = ADVISED[bench.quick]
    chips = jax.sharding.AbstractMesh(
        (1, 2048, 1), advised.example.AXES, axis_types=(AxisType.Auto,) * 3
    )
    args, kwargs = _llama_args(size, 2048, length)
    start = timeit.default_timer()
    st.preflight(
        advised.example.train_step, *args, mesh=chips, rules=advised.example.RULES, **kwargs
    )
    ours = timeit.default_timer() - start
    base = bare_compile(size, (1, 8, 1), 2048, length)
    bench.at_most(f"B9 preflight, {size} pure FSDP on 2048 / bare compile on 8", ours / base, 3.0)
    bench.figure(
        f"B9 preflight of the {size} step, pure FSDP on 2048 chips", ours, "reported", unit="s"
    )


#: B10's small decoder (scanned, remat per layer, bf16): 58M params.
llama.SIZES.setdefault(
    "small", dict(vocab=32000, embed=512, layers=8, heads=8, kv_heads=8, head_dim=64, mlp=1408)
)

#: B10's search on a small decoder: (size, chips, length, layout bounds, global batches)
#: per mode. Full: 15 layouts x 4 batches = 60 candidates on 64 chips.
SEARCHED = {
    False: ("small", 64, 1024, {"data": (1, 16), "tensor": (1, 4)}, (64, 128, 256, 512)),
    True: ("tiny", 16, 128, {"tensor": 8, "data": (1, 2)}, (16,)),
}


def b10_advise(bench: Bench) -> None:
    """advise over a small decoder's layouts x batches on 64 chips: screened on the
    target where it is cheap (XLA GPU for H100s: every row on its figures, so confirm=3
    has nothing left to do), and on the CPU estimate with the best 3 confirmed by libtpu
    (TPU v5p; not in quick mode); then `b10_estimate`."""
    size, devices, length, sizes, batches = SEARCHED[bench.quick]
    meshes = st.layouts(devices, advised.example.AXES, sizes=sizes)
    candidates = [
        st.Candidate(mesh, advised.example.RULES, batch, length=length)
        for batch in batches
        for mesh in meshes
    ]
    n = len(candidates)
    for target in ("h100",) if bench.quick else ("h100", "tpu-v5p"):  # quick: XLA GPU's only
        start = timeit.default_timer()
        try:
            advice = st.advise(
                advised.make_step(size, length),
                candidates,
                hardware=st.hardware(target),
                progress=False,
                confirm=3,
            )
        except ValueError as e:  # the target's compiler is not installed: said, not timed
            print(f"B10 {target}: skipped ({str(e).split(': ', 1)[1][:80]}...)")
            continue
        seconds = timeit.default_timer() - start
        assert all(row.step is not None for row in advice.rows), str(advice)
        on_target = sum(row.step is not None and row.step.backend != "cpu" for row in advice.rows)
        first = "screened on XLA GPU" if target == "h100" else "CPU screen"
        name = f"B10 advise, {n} x {size} on {devices} {target}, {first}, confirm=3"
        bench.figure(name, seconds, "goal <= 300 s", seconds <= 300, unit="s")
        per_minute = 60 * n / seconds
        bench.figure(f"B10   candidates per minute ({target})", per_minute, "reported", unit="")
        bench.figure(
            f"B10   rows on the target's figures ({target})", on_target, "reported", unit=""
        )
    b10_estimate(bench)


def _estimated_layouts(bench: Bench) -> tuple[str, int, int, list]:
    """The Llama-3 step's size, chips and length, and the layouts B10 and B13 search."""
    size, devices, length = ADVISED[bench.quick]
    sizes = {"tensor": 8, "data": (1, 2)} if bench.quick else {"tensor": (4, 8), "data": (1, 4)}
    return size, devices, length, st.layouts(devices, advised.example.AXES, sizes=sizes)


def _estimate(size: str, length: int, candidates: list, **kwargs: object) -> st.Advice:
    """advise over `candidates` of the Llama-3 step on the CPU estimate, for H100s."""
    return st.advise(
        advised.make_step(size, length),
        candidates,
        hardware=st.hardware("h100"),
        progress=False,
        screen="cpu",
        **kwargs,
    )


def b10_estimate(bench: Bench) -> None:
    """advise over layouts x the options of examples/advise.py (2 remat policies x
    2 microbatch counts; quick: the remat policies) of the Llama-3 step on 256 chips
    on the CPU estimate, against one bare compile of the same step (its first
    candidate's layout, with the step's defaults)."""
    size, devices, length, meshes = _estimated_layouts(bench)
    options = dict(advised.OPTIONS)
    if bench.quick:
        options.pop("microbatches")
    batch = devices
    candidates = st.candidates(meshes, advised.example.RULES, batch, length=length, **options)
    start = timeit.default_timer()
    # the CPU estimate, as the bare compile it is measured against
    advice = _estimate(size, length, candidates)
    seconds = timeit.default_timer() - start
    assert all(row.step is not None for row in advice.rows), str(advice)
    base = bare_compile(size, tuple(meshes[0].shape.values()), batch, length)
    n = len(candidates)
    name = f"B10 advise, {n} candidates (with options) of the {size} step on {devices} chips, CPU"
    bench.figure(name, seconds, "goal <= 120 s", seconds <= 120, unit="s")
    bench.figure(f"B10   seconds per candidate ({size})", seconds / n, "reported", unit="s")
    bench.figure(
        f"B10 advise per candidate / one bare compile ({size})", seconds / n / base, "reported"
    )
    bench.figure(
        f"B10 one bare compile of the {size} step on {devices} chips", base, "reported", unit="s"
    )


def b11_targets(bench: Bench) -> None:
    """preflight(target=...) of the Llama-3 step on 256 chips, by XLA GPU for H100s and
    libtpu for a TPU v5p slice, against the CPU preflight of the same step."""
    size, _, length = ADVISED[bench.quick]
    chips = 16 if bench.quick else 256
    shape = (1, chips // 8, 8)
    mesh = jax.sharding.AbstractMesh(shape, advised.example.AXES, axis_types=(AxisType.Auto,) * 3)
    args, kwargs = _llama_args(size, chips, length)

    def preflight(target: str | None) -> float:
        start = timeit.default_timer()
        st.preflight(
            advised.example.train_step,
            *args,
            mesh=mesh,
            rules=advised.example.RULES,
            target=target,
            **kwargs,
        )
        return timeit.default_timer() - start

    base = preflight(None)
    for target in ("h100", "tpu-v5p"):
        try:
            seconds = preflight(target)
        except ValueError as e:  # the compiler is not installed: said, not timed
            print(f"B11 {target}: skipped ({str(e).split(': ', 1)[1][:80]}...)")
            continue
        name = f"B11 preflight(target={target!r}) / CPU preflight, {size} on {chips}"
        if target == "h100":
            bench.at_most(name, seconds / base, 2.0)
        else:  # libtpu compiles several times slower than the CPU compiler
            bench.figure(name, seconds / base, "reported")
        bench.figure(
            f"B11 preflight(target={target!r}), {size} on {chips}", seconds, "reported", unit="s"
        )


def b12_predict(bench: Bench) -> None:
    """What predicting a step's time adds to its target compile, through the public API
    alone: preflight(target="h100") of the Llama-3 step on 256 H100s (the B11 step)
    says how long its compile took and, of that, how long reading the compiled
    module took (`StepPlan.read_seconds`: its instructions, the one walk, the
    reading); `StepPlan.time` is the prediction over that walk. The denominator is
    the rest of that preflight (0.5 timed a bare compile in a child of its own, with
    private names): the trace, the export and the child's compile, what a user
    waits for."""
    size, chips, length = ADVISED[bench.quick]
    shape = (1, chips // 8, 8)
    mesh = jax.sharding.AbstractMesh(shape, advised.example.AXES, axis_types=(AxisType.Auto,) * 3)
    args, kwargs = _llama_args(size, chips, length)
    try:
        plan = st.preflight(
            advised.example.train_step,
            *args,
            mesh=mesh,
            rules=advised.example.RULES,
            target="h100",
            **kwargs,
        )
    except ValueError as e:  # no XLA GPU compiler: said, not timed; anything else raised
        if "pip install" not in str(e):
            raise
        print(f"B12 predict: skipped ({str(e)[:100]}...)")
        return
    start = timeit.default_timer()
    plan.time(st.hardware("h100"))
    predict_s = timeit.default_timer() - start
    compile_s = plan.compile_seconds - plan.read_seconds
    name = f"B12 predicting / compiling, {size} on {chips} H100s"
    bench.at_most(name, (plan.read_seconds + predict_s) / compile_s, 0.10)
    bench.figure("B12   of which reading the module", plan.read_seconds / compile_s, "reported")
    bench.figure("B12   of which the prediction", predict_s / compile_s, "reported")
    bench.figure(f"B12 the target compile, {size} on {chips}", compile_s, "reported", unit="s")


def b13_dask(bench: Bench) -> None:
    """advise's compiles per minute through a 2-worker Dask `LocalCluster` on 127.0.0.1
    against its own local pool of 2 on the same cores (the CPU estimate of the
    Llama-3 step on more chips than this process has: every compile a child's)."""
    try:
        import distributed
    except ImportError:
        print("B13 skipped: pip install 'spmdtree[dask]'")
        return
    size, devices, length, meshes = _estimated_layouts(bench)
    candidates = [st.Candidate(m, advised.example.RULES, devices, length=length) for m in meshes]

    def per_minute(executor: object) -> float:
        start = timeit.default_timer()
        advice = _estimate(size, length, candidates, jobs=2, executor=executor)
        assert all(row.step is not None for row in advice.rows), str(advice)
        return advice.compiles / (timeit.default_timer() - start) * 60

    local = per_minute(None)
    with (
        distributed.LocalCluster(
            host="127.0.0.1", n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster, timeout=120) as client,
    ):
        remote = per_minute(client.get_executor())
    n = len(candidates)
    bench.figure(
        f"B13 compiles per minute, local pool of 2 ({n} of {size})", local, "reported", unit=""
    )
    bench.figure(
        "B13 on a 2-worker Dask LocalCluster / the local pool",
        remote / local,
        "goal >= 0.9",
        remote / local >= 0.9,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; never fails on a goal")
    parser.add_argument("--only", nargs="+", metavar="FIGURE", help="run only these (b9_fsdp, ...)")
    parser.add_argument("--bare", nargs=4, help=argparse.SUPPRESS)  # bare_compile's child
    args = parser.parse_args()
    if args.bare:
        _bare(args.bare[0], args.bare[1], int(args.bare[2]), int(args.bare[3]))
        return 0
    bench = Bench(args.quick)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    print(f"{'figure':<50} {'ratio':>9}   {'goal':<16} verdict")
    if args.only:
        for name in args.only:
            globals()[name](bench)
        return 1 if bench.missed and not args.quick else 0
    b1_pytree(bench, 200 if args.quick else 2000)
    b2_to_sharding(bench, mesh, [400, 4000] if args.quick else [1000, 4000, 10000, 100000])
    b3_dispatch(bench, mesh)
    b4_compiled(bench, mesh, 64 if args.quick else 512)
    b5_sharded_init(bench, mesh, 256 if args.quick else 2048)
    b6_optimizer_sharding(bench, mesh, [200, 2000] if args.quick else [1000, 10000])
    b7_b8_plan(bench, mesh, [400, 4000] if args.quick else [1000, 100000])
    b9_preflight(bench)
    b9_fsdp(bench)
    b10_advise(bench)
    b11_targets(bench)
    b12_predict(bench)
    b13_dask(bench)
    if bench.missed and not args.quick:
        print(f"missed: {', '.join(bench.missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
