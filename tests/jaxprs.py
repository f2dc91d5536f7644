"""An independent count of what a program asks for: the dots of its jaxpr."""

import math


def jaxpr_flops(jaxpr):
    """2 x result elements x contracted size of every dot_general in a jaxpr, its
    sub-jaxprs included (a scan's body times its length, a cond's costlier branch)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += (
                2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracting)
            )
            continue
        inner = [_jaxpr(v) for v in _flat(eqn.params.values())]
        counts = [jaxpr_flops(j) for j in inner if j is not None]
        if eqn.primitive.name == "cond":
            total += max(counts, default=0)
        else:
            total += eqn.params.get("length", 1) * sum(counts)
    return total


def _flat(values):
    for v in values:
        yield from (_flat(v) if isinstance(v, (tuple, list)) else [v])


def _jaxpr(value):
    inner = getattr(value, "jaxpr", value)
    return inner if hasattr(inner, "eqns") else None
