"""Error helpers: key-path formatting and errors collected over many leaves.

Leaf-level code does not know where in a tree it is working, so it raises a
`LeafError` holding only what is wrong with the leaf. The tree-level function
that called it knows the key path: it collects every `LeafError` of the call
and raises one `ValueError` or `TypeError` that names each path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jax import tree_util

__all__ = ["LeafError", "at", "collected", "fmt", "raise_collected", "raise_one"]

_MOST_SHOWN = 5


class LeafError(Exception):
    """What is wrong with one leaf, before its key path is known.

    `detail` is a sentence fragment that follows the leaf's subject, e.g.
    ``"has 3 dimensions but 2 names ..."`` after ``"the box at params['w']"``.
    """

    def __init__(self, kind: type[Exception], detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def fmt(value: Any) -> str:
    """Renders a received value for a message: short, and never the array data."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def at(argument: str, path: Sequence[Any]) -> str:
    """The key path of a leaf as the user would index it: ``params['w']``."""
    return argument + tree_util.keystr(tuple(path))


def collected(function: str, problems: Sequence[tuple[str, LeafError]]) -> Exception:
    """One exception for all `problems`, each a (subject, error) pair.

    The subject is what the detail is about, e.g. ``"the box at params['w']"``.
    At most five problems are shown, then a count of the rest.
    """
    kinds = {error.kind for _, error in problems}
    kind = kinds.pop() if len(kinds) == 1 else ValueError
    if len(problems) == 1:
        subject, error = problems[0]
        return kind(f"{function}: {subject} {error.detail}")
    lines = [f"{function}: {len(problems)} leaves are wrong:"]
    lines += [f"  {subject} {error.detail}" for subject, error in problems[:_MOST_SHOWN]]
    if len(problems) > _MOST_SHOWN:
        lines.append(f"  ... and {len(problems) - _MOST_SHOWN} more.")
    return kind("\n".join(lines))


def raise_collected(function: str, problems: Iterable[tuple[str, LeafError]]) -> None:
    """Raises `collected(...)` if there are any problems."""
    problems = list(problems)
    if problems:
        raise collected(function, problems)


def raise_one(function: str, subject: str, error: LeafError) -> Exception:
    """The exception for a single leaf's problem, for `raise ... from None`."""
    return collected(function, [(subject, error)])
