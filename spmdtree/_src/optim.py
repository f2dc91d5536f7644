"""Shardings for an optimizer's state: a thin face over ``to_sharding(..., params=)``.

optax's ``tx.init(boxed_params)`` keeps boxes, so every state leaf shaped like
its param resolves like it. A reduced leaf (adafactor's factored moments, SM3's
per-dimension accumulators) has fewer dimensions than its box has names; it
resolves through the param it came from (`params=`), keeping the sharding of
the dimensions it kept. One resolution path serves `optimizer_sharding`,
`to_sharding` and `to_abstract`, so a restored state matches the train step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
from jax.sharding import Mesh

from spmdtree._src.errors import public
from spmdtree._src.resolve import (
    check_mesh,
)
from spmdtree._src.rules import (
    PyTree,
    Rules,
)
from spmdtree._src.specs import ParamIndex, resolve_tree, shardings


class Optimizer(Protocol):
    """Anything with ``init(params) -> state``, such as an optax ``GradientTransformation``."""

    @property
    def init(self) -> Callable[[PyTree], PyTree]: ...


@public
def optimizer_sharding(
    tx: Optimizer,
    params: PyTree,
    mesh: Mesh,
    rules: Rules | None = None,
    *,
    strict: bool = False,
) -> PyTree:
    """Shardings for the state of optimizer `tx` on `params`, reduced states included.

    Exactly ``to_sharding(jax.eval_shape(tx.init, params), mesh, rules,
    params=params)``: a state leaf shaped like its param gets its sharding,
    and a reduced one — fewer dimensions than its box has names, such as
    adafactor's row and column statistics or SM3's per-dimension accumulators
    — keeps the sharding of the param dimensions it kept (see
    `kept_dimensions` for the rule; ambiguous means replicated). Each state
    leaf is matched to its param by the longest common suffix of their key
    paths, in time linear in the number of leaves. Nothing is allocated.

    Args:
        tx: an optax ``GradientTransformation`` (anything with ``init``).
        params: the boxed params (arrays or `jax.ShapeDtypeStruct`s).
        mesh: the device mesh.
        rules: rules for logical boxes without their own.
        strict: raise where a spec would fall back, as for `to_spec` (new in
            0.3).

    Returns:
        A tree of `NamedSharding`s for ``tx.init(params)``: valid
        ``out_shardings`` for ``jax.jit(tx.init)`` and for a train step.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`,
            or if `params` holds no boxes.

    Example:
        >>> import jax, jax.numpy as jnp, optax, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))}
        >>> tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
        >>> state = st.optimizer_sharding(tx, params, mesh)
        >>> state[0].v_row["w"].spec, state[0].v_col["w"].spec
        (P('data',), P('model',))
    """
    check_mesh(mesh)
    index = ParamIndex(params)  # params without boxes: said before tracing tx.init
    state = jax.eval_shape(tx.init, params)
    walk = resolve_tree(state, rules, mesh=mesh, params=index, strict=strict)
    return shardings(walk, mesh)
