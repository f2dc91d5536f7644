"""`describe`: the plan of a tree, as the table a person reads.

Nothing here resolves or computes a figure: `plan` does, and `text` renders.
"""

from __future__ import annotations

from spmdtree._src.errors import Mistake, public
from spmdtree._src.plan import make_plan
from spmdtree._src.rules import AnyMesh, PyTree, Rules
from spmdtree._src.text import plan_table


@public
def describe(
    tree: PyTree,
    mesh: AnyMesh | None = None,
    rules: Rules | None = None,
    *,
    params: PyTree = None,
    budget: int | None = None,
    large: int = 1 << 20,
    width: int = 80,
    rich: bool = False,
) -> str:
    """The sharding plan of a tree, as a table: one row per array leaf, then totals.

    Each array gets a row: its key path (``/``-joined, as `match` sees it),
    dtype and shape and, with a mesh, the shape and bytes of the shard each
    device holds; beneath it, for a boxed array, its names (logical or mesh
    axes) and the mesh spec they resolve to. The totals give the global
    bytes, the bytes held by the most loaded device and the bytes replicated
    on every device (and, on a mesh that spans processes, what this process
    holds). Notes flag leaves replicated by a fallback (fewer
    dimensions than names), dimensions left unsharded (their mesh axes do not
    divide them) and large fully replicated arrays. Works on abstract trees
    (from `jax.eval_shape`), so a plan is checked before anything is
    allocated, and on optimizer states.

    Args:
        tree: a tree with boxes, of arrays or `jax.ShapeDtypeStruct`s.
        mesh: the mesh; without one only names and specs are shown.
        rules: rules for logical boxes without their own.
        params: the boxed params `tree` was derived from, for reduced states
            (as for `to_spec`).
        budget: bytes per device; adds a line saying whether the arrays fit,
            and by how much. It counts the arrays of `tree` only, not a
            step's activations and temporaries: `preflight` compiles the step
            and counts those.
        large: the size in bytes from which a replicated array is flagged.
        width: the width to fit, in characters (long paths are shortened
            from the front).
        rich: render with `rich` (installed separately); the plain text by
            default, the same whatever else is installed.

    Returns:
        The table, as a string to print.

    Raises:
        ValueError: for names that cannot be right for their value on `mesh`.

    Example:
        >>> import jax, jax.numpy as jnp, spmdtree as st
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> params = {"w": st.LogicallyPartitioned(jnp.zeros((6, 8)), ("embed", "mlp"))}
        >>> print(st.describe(params, mesh, [("embed", "data"), ("mlp", "model")], rich=False))
        path  array     shard  bytes/dev
          names -> mesh spec
        w     f32[6,8]  [3,2]       24 B
          embed,mlp -> data,model
        total       192 B in 1 array
        per device  24 B on the most loaded device (12.5% of the total)
        replicated  0 B on every device
    """
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise Mistake(TypeError, f"budget is {budget!r}; expected an int of bytes per device.")
    planned = make_plan(tree, mesh, rules, params=params, large=large)
    return plan_table(planned, width=width, rich=rich, budget=budget)
