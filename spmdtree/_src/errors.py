"""User mistakes: found anywhere below the public boundary, named there once.

Code below the boundary raises a `Mistake` holding only what is wrong. A tree
walk that meets one at a leaf adds the leaf's key path, collects every wrong
leaf and raises once (`raise_collected`). The public function, decorated with
`public`, turns the mistake into a plain ``TypeError``/``ValueError`` that
starts with its own name.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TypeVar

from jax import tree_util

F = TypeVar("F", bound=Callable[..., Any])

_MOST_SHOWN = 5


class Mistake(Exception):
    """A user mistake: the exception `kind` to raise and what to say.

    Said of a leaf, `message` is a predicate of the leaf ("has names ... .
    Give one name per dimension."), which the walk puts after the leaf's
    subject ("the box at tree['w']").
    """

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles whole (new in 0.6): a compile's mistake crosses an executor's
        process boundary (a Dask worker's) as itself, not as a broken pickle."""
        return (type(self), (self.kind, self.message), self.__dict__)

    def error(self, function: str) -> Exception:
        """The exception a user sees from `function`."""
        return self.kind(f"{function}: {self.message}")


def public(fn: F, name: str | None = None) -> F:
    """Marks a public function: a `Mistake` below it becomes a ``TypeError`` or
    ``ValueError`` whose message starts with `name` (the function's own, or
    its class's for ``__init__``). A mistake raised from another exception (a
    user's step that raised, say) stays chained to it: that exception is the
    error's ``__cause__``, with its own frames; any other is raised alone."""

    @functools.wraps(fn)
    def boundary(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Mistake as mistake:
            called = name or (type(args[0]).__name__ if fn.__name__ == "__init__" else fn.__name__)
            raise mistake.error(called) from mistake.__cause__

    return boundary  # type: ignore[return-value]


def fmt(value: object) -> str:
    """Renders a received value for a message: short, and never the array data."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def at(argument: str, path: Sequence[Any]) -> str:
    """The key path of a leaf as the user would index it: ``params['w']``."""
    return argument + tree_util.keystr(tuple(path))


def called(noun: str, where: str) -> str:
    """How a message names a leaf at key path `where`: ``the box at tree['w']``, or
    ``the box`` for a box on its own (`where` empty)."""
    return f"the {noun} at {where}" if where else f"the {noun}"


def raise_collected(problems: Sequence[tuple[str, Mistake]]) -> None:
    """Raises one `Mistake` for all `problems`, each a (subject, mistake) pair.

    At most five are shown, then a count of the rest.
    """
    if not problems:
        return
    kinds = {mistake.kind for _, mistake in problems}
    kind = kinds.pop() if len(kinds) == 1 else ValueError
    lines = [f"{subject} {mistake.message}" for subject, mistake in problems[:_MOST_SHOWN]]
    if len(problems) == 1:
        raise Mistake(kind, lines[0])
    if len(problems) > _MOST_SHOWN:
        lines.append(f"... and {len(problems) - _MOST_SHOWN} more.")
    raise Mistake(kind, f"{len(problems)} leaves are wrong:\n  " + "\n  ".join(lines))


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_level() -> int:
    """The `stacklevel` for a `warnings.warn` in the function that calls this one:
    it points at the first frame outside spmdtree, the user's line."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
