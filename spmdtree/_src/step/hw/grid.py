"""A matmul's share of the peak by its shape (new in 0.8): read from a grid of shapes
`st.calibrate` measured on the chip, each dimension padded to the matrix unit.

On a TPU v5e (2026-12-07, jax 0.10.2, libtpu 0.0.42.1), bf16 matmuls reached 0.97
of the peak at 4,096^3 but 0.69 at 1,024^3, 0.38 at 512^3 and 0.13 at 256^3 (a fixed
cost each kernel pays); one of (32,768 x 4,096) by (4,096 x 32) ran no faster than
by (4,096 x 128): its 32 columns take the 128 lanes of the matrix unit. One share for
every shape (`Hardware.matmul_efficiency`, 0.7's model) cannot say either. Nor can
padding alone say what a dimension narrower than the unit costs: (8,192 x 64) by
(64 x 64) ran at 0.42 of the peak, where a 128-wide tile a quarter used says 0.23,
so the grid measures 64-wide points too and reads such a dimension as measured.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from spmdtree._src.errors import Mistake

#: One measured point: a matmul's rows, contraction and columns (``m``, ``k``, ``n``:
#: (m, k) x (k, n); a convolution's output positions, its window times its input
#: features, its output features), and the share of the bf16 peak it reached.
Point = tuple[int, int, int, float]


def checked_grid(grid: object, field: str = "matmul_grid") -> tuple[Point, ...]:
    """`grid` as a tuple of ``(m, k, n, share)`` points, checked: each dimension a
    whole number >= 1, each share in (0, 1], every combination of the dimensions it
    lists measured once (a full grid, which `grid_share` interpolates over).

    Example:
        >>> checked_grid([(128, 128, 128, 0.1), [256, 128, 128, 0.2]])
        ((128, 128, 128, 0.1), (256, 128, 128, 0.2))
    """
    if not isinstance(grid, Sequence) or isinstance(grid, str) or not grid:
        raise Mistake(
            ValueError,
            f"{field} is {grid!r}; expected a non-empty list of (m, k, n, share) points.",
        )
    points = tuple(_point(each, field) for each in grid)
    axes = _axes(points)
    have = {p[:3] for p in points}
    if len(have) != len(points):
        shapes = [p[:3] for p in points]
        twice = next(shape for shape in shapes if shapes.count(shape) > 1)
        raise Mistake(ValueError, f"{field} measures {twice} twice; give one share for each shape.")
    combinations = math.prod(map(len, axes))
    if len(have) != combinations:
        missing = next(
            (m, k, n) for m in axes[0] for k in axes[1] for n in axes[2] if (m, k, n) not in have
        )
        m, k, n = axes
        raise Mistake(
            ValueError,
            f"{field} is not a full grid: it lists m of {m}, k of {k} and n of {n}, but not "
            f"{missing} among their {combinations} combinations; give one share for every "
            "combination (st.calibrate measures them so).",
        )
    return points


def _point(each: object, field: str) -> Point:
    """One ``(m, k, n, share)`` point, checked."""
    if isinstance(each, Sequence) and not isinstance(each, str) and len(each) == 4:
        m, k, n, share = each
        dims = (m, k, n)
        whole = all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)
        fraction = isinstance(share, (int, float)) and not isinstance(share, bool)
        if whole and fraction and 0 < share <= 1:
            return (int(m), int(k), int(n), float(share))
    raise Mistake(
        ValueError,
        f"{field} has the point {each!r}; expected (m, k, n, share): three whole numbers "
        ">= 1 and a share of the peak in (0, 1].",
    )


def _axes(points: Sequence[Point]) -> tuple[tuple[int, ...], ...]:
    """The grid's sorted values along m, k and n."""
    return tuple(tuple(sorted({int(p[i]) for p in points})) for i in range(3))


def padded(size: int, tile: int) -> int:
    """`size` rounded up to a whole number of `tile`.

    Example:
        >>> padded(64, 128), padded(576, 128), padded(4096, 128)
        (128, 640, 4096)
    """
    return -(-size // tile) * tile


def run_as(size: int, tile: int, least: int) -> int:
    """A matmul's dimension as the chip runs it: padded to whole tiles of the matrix
    unit; one narrower than a tile, to whole multiples of the grid's smallest
    measured size `least` where that is narrower (new in 0.8: a TPU v5e ran
    (8,192 x 64) by (64 x 64) at 0.42 of the peak, where a 128-wide tile a quarter
    used would reach 0.23).

    Example:
        >>> run_as(64, 128, 128), run_as(64, 128, 64), run_as(96, 128, 64), run_as(576, 128, 64)
        (128, 64, 128, 640)
    """
    if size >= tile or least >= tile:
        return padded(size, tile)
    return min(padded(size, least), tile)


def grid_share(grid: Sequence[Point], m: int, k: int, n: int, tile: int) -> float:
    """The share of the bf16 peak a matmul of (m, k) x (k, n) reaches: each dimension
    padded as the chip runs it (`run_as`: to the matrix unit's `tile`; one narrower
    than the tile, to the grid's smallest measured size, new in 0.8), the padded
    shape's share interpolated from `grid` (log-linear in each dimension, the grid's
    edge beyond it), times the share of the padded work that is the matmul's own.

    Example:
        >>> grid = [(m, k, n, 0.4 if 128 in (m, k, n) else 0.9)
        ...         for m in (128, 4096) for k in (128, 4096) for n in (128, 4096)]
        >>> share = lambda m, k, n: round(grid_share(grid, m, k, n, 128), 6)
        >>> share(4096, 4096, 4096), share(8192, 8192, 8192)  # beyond the grid: its edge
        (0.9, 0.9)
        >>> share(4096, 4096, 64)  # half the matrix unit's columns idle
        0.2
        >>> 0.4 < share(4096, 4096, 768) < 0.9  # between 128 and 4,096
        True
        >>> narrow = [(m, k, n, 0.3 if 64 in (m, k, n) else 0.9)
        ...           for m in (64, 4096) for k in (64, 4096) for n in (64, 4096)]
        >>> round(grid_share(narrow, 4096, 4096, 64, 128), 6)  # measured at 64: its own
        0.3
    """
    axes = _axes(grid)
    shape = tuple(run_as(size, tile, axis[0]) for size, axis in zip((m, k, n), axes, strict=True))
    own = m * k * n / math.prod(shape)
    table = {p[:3]: p[3] for p in grid}
    brackets = [_bracket(axis, size) for axis, size in zip(axes, shape, strict=True)]
    log_share = 0.0
    for corner in range(8):
        weight, at = 1.0, []
        for i, (low, high, t) in enumerate(brackets):
            upper = bool(corner >> i & 1)
            weight *= t if upper else 1 - t
            at.append(high if upper else low)
        if weight:
            log_share += weight * math.log(table[at[0], at[1], at[2]])
    return own * math.exp(log_share)


def _bracket(axis: Sequence[int], size: int) -> tuple[int, int, float]:
    """The grid's values either side of `size` along one axis and how far between
    them `size` lies in log scale (0 at the lower; the edge value beyond the grid)."""
    if size <= axis[0]:
        return axis[0], axis[0], 0.0
    if size >= axis[-1]:
        return axis[-1], axis[-1], 0.0
    i = bisect.bisect_right(axis, size)
    low, high = axis[i - 1], axis[i]
    return low, high, math.log(size / low) / math.log(high / low)
