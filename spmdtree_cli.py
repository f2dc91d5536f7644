"""The ``spmdtree`` command (new in 0.7: its entry point; the command line itself is
`spmdtree._src.cli`).

Importing jax where an accelerator's plugin is installed writes its start-up log
to stderr (the CUDA plugin's "Could not find cuda drivers", six lines) before any
of spmdtree's code runs. For ``spmdtree advise`` and ``spmdtree preflight`` that
log is kept out of the import, so that a mistake is one line on stderr; and where
they name no GPU (their own process then needs no accelerator: they compile on CPU
devices, or libtpu in a child), jax is told to start its CPU backend alone, which
keeps the plugin's log out of the rest of the run too. A GPU target keeps its
backend: a step with cuDNN's attention is lowered on its topology in this process.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator

#: The subcommands that compile for a target, needing an accelerator here only for a GPU.
COMPILING = ("advise", "preflight")
#: The chips named on the command line that need their backend here: the GPU presets.
GPUS = ("a100", "h100", "h200", "b200")


def _cpu_only(argv: list[str]) -> bool:
    """Whether the command needs no accelerator in its own process: it compiles, and
    names no GPU (a chip's JSON file may be one)."""
    named = [
        value for flag, value in itertools.pairwise(argv) if flag in ("--target", "--hardware")
    ]
    return argv[0] in COMPILING and not any(n in GPUS or n.endswith(".json") for n in named)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The process's stderr (the file descriptor, where C++ logs) sent nowhere."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def started_quietly(argv: list[str]) -> Iterator[None]:
    """jax started for the command `argv` (its arguments, the subcommand first): where
    it compiles, with the plugins' start-up log kept out, and on its CPU backend alone
    where it names no GPU; else as it is. The ``spmdtree`` script starts so, and
    ``python -m spmdtree`` too (new in 0.8: the package's import, which starts jax
    before the module runs, asks for it).

    Example:
        >>> with started_quietly(["--help"]):  # not a compiling command: as it is
        ...     pass
    """
    quiet = bool(argv) and argv[0] in COMPILING
    if quiet and _cpu_only(argv):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with _quiet_stderr() if quiet else contextlib.nullcontext():
        yield


def main() -> int:
    """Runs ``spmdtree`` with `sys.argv`."""
    argv = sys.argv[1:]
    with started_quietly(argv):
        from spmdtree._src import cli
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
