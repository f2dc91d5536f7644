"""A user's typed code: mypy (strict, in CI) checks it against the public types.

Every line outside the `TYPE_CHECKING` block must type-check as written, with
no annotation a user would not write; every line inside it is a mistake that
mypy must catch (`warn_unused_ignores` makes an uncaught one an error).
`tests/test_types.py` also runs this file, so the accepted lines work.
"""

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import spmdtree as st

rules = [("batch", "data"), ("embed", None), ("mlp", ("data",))]
mapping = {"batch": "data", "embed": None, "mlp": ["data"]}
mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
abstract = jax.sharding.AbstractMesh((2,), ("data",))

listed = ["data", None]
params = {
    "w": st.LogicallyPartitioned(jnp.zeros((8, 4)), ("embed", "mlp")),
    "b": st.Partitioned(jnp.zeros((2, 4)), listed),
    "s": st.Partitioned(jnp.zeros((2, 4)), P("data", P.UNCONSTRAINED)),
}
specs = [st.to_spec(params, rules, mesh=mesh), st.to_spec(params, mapping, mesh=abstract)]
shardings = st.to_sharding(params, mesh, rules)
planned: st.Plan = st.plan(params, abstract, mapping)
offloaded = st.Partitioned(jnp.zeros((2, 4)), listed, memory_kind="pinned_host")
kind: str | None = offloaded.memory_kind
host_bytes: int = st.plan({"o": offloaded}, abstract).host_bytes


def by_rank(path: tuple[object, ...], leaf: jax.Array) -> st.Names | None:
    return ("embed", None) if leaf.ndim == 2 else None


boxed = [
    st.box({"x": jnp.zeros((4, 4))}, fn, logical=True) for fn in (by_rank, st.fsdp(mesh, "data"))
]
with st.logical_axis_rules(rules):
    activations = st.with_logical_constraint(jnp.zeros((4, 8)), ("batch", "embed"), mesh=mesh)

# What users look at (new in 0.6): a step's JSON, trace and time by mesh axes.
step = st.preflight(lambda x: jnp.sum(x * 2), jnp.zeros((8, 4)), mesh=abstract)
step_json: dict[str, object] = step.to_dict(st.hardware("h100"))
step_text: str = step.to_json(st.hardware("h100"))
step_trace: dict[str, object] = step.trace(st.hardware("h100"))
waited = step.time(st.hardware("h100")).exposed_by_axes
advice_json: dict[str, object] = st.Advice((), 0, st.hardware("h100"), 2**30).to_dict()
advice_text: str = st.Advice((), 0, st.hardware("h100"), 2**30).to_json()

# Held against the chip (new in 0.7): a measurement, a chip as JSON.
chip: st.Hardware = st.Hardware.from_json(st.hardware("tpu-v5e").to_json())
chip_text: str = chip.to_json()
if TYPE_CHECKING:  # they run a step: typed here, run in tests/test_measure.py
    measured: st.Measurement = st.measure(jnp.sin, jnp.zeros(4), mesh=jax.make_mesh((1,), ("d",)))
    worst: tuple[st.OpTime, ...] = measured.misses(3)
    seconds: float = measured.seconds + measured.ratio
    compared: st.Measurement = step.compare("profile.json.gz", hardware=chip)
    calibrated: st.Hardware = st.calibrate(seconds=30.0, preset="tpu-v5e")
    text_of: str = measured.to_json()
    st.measure(jnp.sin, jnp.zeros(4), mesh=abstract, steps="10")  # type: ignore[arg-type]
    st.calibrate(seconds="60")  # type: ignore[arg-type]

if TYPE_CHECKING:
    step.trace("h100")  # type: ignore[arg-type]
    step.to_dict(hardware="h100")  # type: ignore[arg-type]
    st.to_spec(params, 5)  # type: ignore[arg-type]
    st.to_spec(params, rules, mesh="mesh")  # type: ignore[arg-type]
    st.Partitioned(jnp.zeros(4), 5)  # type: ignore[arg-type]
    st.Partitioned(jnp.zeros(4), [1])  # type: ignore[list-item]
    st.Partitioned(jnp.zeros(4), ("data",), None, "pinned_host")  # type: ignore[call-arg]
    st.Partitioned(jnp.zeros(4), ("data",), memory_kind=3)  # type: ignore[arg-type]
    st.plan(params, abstract, [("batch", 1)])  # type: ignore[list-item]
    st.box(params, by_rank, mesh=(2, 4))  # type: ignore[arg-type]
