"""Names functions for `box`: how to name the arrays of a tree nobody annotated.

`match` names them by key-path patterns; `fsdp` by the tactic big_vision and
PyTorch's FSDP use. Both return a ``(path, leaf) -> names | None`` function,
and ``match(..., default=fsdp(mesh))`` chains them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

from jax import tree_util

from spmdtree._src.boxes import shape_of
from spmdtree._src.errors import Mistake, fmt, public, user_level
from spmdtree._src.resolve import check_mesh
from spmdtree._src.rules import AnyMesh, Names, normalize_kept
from spmdtree._src.trees import KeyPath, NamesFn


class UnmatchedWarning(UserWarning):
    """A `match` pattern matched no leaf of the tree `box` named with it (new in 0.5).

    Emitted once per `box` call, naming each such pattern, how many arrays
    there were and a few of their key paths as the patterns see them (keys
    joined with ``/``): a regex that matches nothing is most often a typo, or
    a rule written for another library's names, and leaves what it meant to
    name unsharded. ``match(..., strict=True)`` raises instead;
    ``warnings.simplefilter("error", st.UnmatchedWarning)`` makes it an error
    everywhere.

    Example:
        >>> import warnings, jax.numpy as jnp, spmdtree as st
        >>> names = st.match([(r"kernel$", ("embed", "mlp")), (r"heads$", ("embed", "heads"))])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     boxed = st.box({"attn": {"kernel": jnp.zeros((4, 8))}}, names, logical=True)
        >>> caught[0].category.__name__
        'UnmatchedWarning'
        >>> print(caught[0].message)
        st.match pattern 1 ('heads$') matches none of the key paths of the 1 array boxed ('attn/kernel'), so it names nothing. Fix the regex against these paths (keys joined with '/'), or drop the pattern.
    """


_PATHS_SHOWN = 3
_MOST_SHOWN = 5


def _joined(path: KeyPath) -> str:
    """A key path as the patterns see it: ``params/dense/kernel``."""
    return tree_util.keystr(tuple(path), simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class _Match:
    """The names function `match` returns; `box` calls `check_tree` after naming
    every leaf, with their key paths."""

    compiled: tuple[tuple[re.Pattern[str], Names | None], ...]
    strict: bool
    default: NamesFn | None

    def __call__(self, path: KeyPath, leaf: Any, /) -> Names | None:
        text = _joined(path)
        for regex, names in self.compiled:
            if regex.search(text):
                return names
        if self.default is not None:
            return self.default(path, leaf)
        if self.strict:
            raise Mistake(
                ValueError,
                f"(path {text!r}) matches none of the patterns "
                f"{[regex.pattern for regex, _ in self.compiled]}. Add a pattern for it, "
                f"e.g. ({re.escape(text) + '$'!r}, None) to leave it unboxed, or pass "
                "strict=False.",
            )
        return None

    def check_tree(self, paths: Sequence[KeyPath]) -> None:
        """Says which patterns match none of `paths` (the arrays of one `box`
        call): a warning, or under `strict` a mistake; then the default's own."""
        texts = [_joined(path) for path in paths]
        missed = [
            f"{i} ({regex.pattern!r})"
            for i, (regex, _) in enumerate(self.compiled)
            if not any(regex.search(text) for text in texts)
        ]
        if texts and missed:
            shown = ", ".join(map(repr, texts[:_PATHS_SHOWN]))
            more = f" and {len(missed) - _MOST_SHOWN} more" if len(missed) > _MOST_SHOWN else ""
            sentence = (
                f"st.match {'pattern' if len(missed) == 1 else 'patterns'} "
                f"{', '.join(missed[:_MOST_SHOWN])}{more} "
                f"{'matches' if len(missed) == 1 else 'match'} none of the key paths of the "
                f"{len(texts)} {'array' if len(texts) == 1 else 'arrays'} boxed ({shown}"
                f"{', ...' if len(texts) > _PATHS_SHOWN else ''}), so "
                f"{'it names' if len(missed) == 1 else 'they name'} nothing. Fix the regex "
                "against these paths (keys joined with '/'), or drop the pattern."
            )
            if self.strict:
                raise Mistake(ValueError, sentence)
            warnings.warn(sentence, UnmatchedWarning, stacklevel=user_level())
        check_default = getattr(self.default, "check_tree", None)
        if check_default is not None:
            rest = [p for p, t in zip(paths, texts, strict=True) if not self._named(t)]
            check_default(rest)

    def _named(self, text: str) -> bool:
        return any(regex.search(text) for regex, _ in self.compiled)


@public
def match(
    patterns: Sequence[tuple[str, Names | None]],
    *,
    strict: bool = False,
    default: NamesFn | None = None,
) -> NamesFn:
    """A names function for `box` from ``[(regex, names), ...]`` over key paths.

    Each leaf's key path is joined with ``/`` (``params/dense/kernel``) and
    matched with `re.search` against the patterns in order; the first match
    gives the names (None: leave the leaf unboxed). A leaf no pattern matches
    gets ``default(path, leaf)`` — a tactic such as `fsdp` — else stays
    unboxed (``strict=True``: an error). For params that come from elsewhere:
    a checkpoint, another library, a model nobody annotated.

    A pattern that matches none of the arrays `box` names is said (new in
    0.5): an `UnmatchedWarning` naming it, the number of arrays and a few of
    their paths, or under ``strict=True`` an error.

    Args:
        patterns: ``(regex, names)`` pairs, tried in order.
        strict: raise for a leaf that no pattern matches (and no `default`
            names), and for a pattern that matches no leaf, instead of leaving
            the leaf unboxed and warning of the pattern.
        default: a names function for the leaves no pattern matches.

    Returns:
        A function ``(key_path, leaf) -> names | None`` to pass to `box`.

    Raises:
        ValueError: at once if a regex is invalid; from `box`, with
            ``strict=True``, listing the paths no pattern matches, or naming
            the patterns that match no path.
        TypeError: at once if names are of the wrong kind.

    Warns:
        UnmatchedWarning: from `box`, for patterns that match no path (without
            ``strict=True``).

    Example:
        >>> import jax.numpy as jnp, spmdtree as st
        >>> params = {"dense": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)}}
        >>> rule = st.match([(r"kernel$", ("embed", "mlp")), (r"bias$", ("mlp",))])
        >>> st.box(params, rule, logical=True)["dense"]["kernel"]
        LogicallyPartitioned(f32[4,8], names=('embed', 'mlp'))
        >>> rule = st.match([(r"bias$", None)], default=lambda path, leaf: ("embed", None))
        >>> st.box(params, rule, logical=True)["dense"]["kernel"].names
        ('embed', None)
        >>> rule = st.match([(r"kernel$", ("embed", "mlp")), (r"bias$", None), (r"^w$", None)], strict=True)
        >>> st.box(params, rule)
        Traceback (most recent call last):
        ...
        ValueError: box: st.match pattern 2 ('^w$') matches none of the key paths of the 2 arrays boxed ('dense/bias', 'dense/kernel'), so it names nothing. Fix the regex against these paths (keys joined with '/'), or drop the pattern.
    """
    if default is not None and not callable(default):
        raise Mistake(
            TypeError,
            f"default is {fmt(default)}; expected a names function (path, leaf) -> names, "
            "e.g. st.fsdp(mesh).",
        )
    compiled = []
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, (tuple, list)) or len(pattern) != 2:
            raise Mistake(
                TypeError,
                f"pattern {i} is {fmt(pattern)}; each pattern is a pair (regex, names), "
                "e.g. (r'kernel$', ('embed', 'mlp')).",
            )
        regex, names = pattern
        try:
            compiled.append((re.compile(regex), None if names is None else normalize_kept(names)))
        except re.error as e:
            raise Mistake(
                ValueError,
                f"pattern {i}, {regex!r}, is not a valid regular expression: {e}. Escape "
                "special characters with re.escape if you meant them literally.",
            ) from None
        except Mistake as mistake:
            raise Mistake(mistake.kind, f"pattern {i} ({regex!r}) {mistake.message}") from None
    return _Match(tuple(compiled), strict, default)


@public
def fsdp(mesh: AnyMesh, axis: str = "fsdp", *, min_size: int = 2**14) -> NamesFn:
    """A names function for `box`: FSDP, the tactic of big_vision and PyTorch's FSDP.

    An array with at least `min_size` elements gets `axis` on its largest
    dimension that the axis's size divides; among equally large ones, the
    first (outermost), as PyTorch's FSDP shards dimension 0. Smaller arrays,
    and arrays no dimension of which the axis divides, stay unboxed, so
    replicated. The chosen dimension is named by the mesh-axis tuple
    ``(axis,)``, which both box kinds take as written: `fsdp` also serves as
    the ``default`` of `match` patterns that give logical names.

    Args:
        mesh: the mesh (or abstract mesh) whose `axis` shards the arrays.
        axis: the mesh axis to shard over.
        min_size: the fewest elements an array needs to be sharded.

    Returns:
        A function ``(key_path, leaf) -> names | None`` for `box`.

    Raises:
        ValueError: at once, if `axis` is not an axis of `mesh`.

    Example:
        >>> import jax, spmdtree as st
        >>> mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
        >>> tree = {"w": jax.ShapeDtypeStruct((768, 3072), "float32"),
        ...         "b": jax.ShapeDtypeStruct((3072,), "float32")}
        >>> boxed = st.box(tree, st.fsdp(mesh))
        >>> boxed["w"].names, st.is_boxed(boxed["b"])  # b is too small to shard
        ((None, ('fsdp',)), False)
    """
    check_mesh(mesh)
    if axis not in mesh.axis_names:
        raise Mistake(
            ValueError,
            f"axis {axis!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}. Pass one of them as axis=.",
        )
    size = dict(mesh.shape)[axis]

    def names_for(path: KeyPath, leaf: Any) -> Names | None:
        shape = shape_of(leaf) or ()
        if math.prod(shape) < min_size:
            return None
        fits = [d for d in range(len(shape)) if shape[d] % size == 0]
        if not fits:
            return None
        chosen = max(fits, key=lambda d: (shape[d], -d))  # the largest; the first of ties
        return tuple((axis,) if d == chosen else None for d in range(len(shape)))

    return names_for
