"""The ``spmdtree`` command (new in 0.7: its entry point; the command line itself is
`spmdtree._src.cli`).

Importing jax where an accelerator's plugin is installed writes its start-up log
to stderr (the CUDA plugin's "Could not find cuda drivers", six lines) before any
of spmdtree's code runs. ``spmdtree advise`` and ``spmdtree preflight`` need no
accelerator in their own process (they compile on CPU devices, or in a child
process for the target), so for them jax is told to start its CPU backend alone,
and the import's log is kept out: a mistake is one line on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

#: The subcommands whose own process needs no accelerator.
CPU_ONLY = ("advise", "preflight")


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


def main() -> int:
    """Runs ``spmdtree`` with `sys.argv`."""
    argv = sys.argv[1:]
    quiet = bool(argv) and argv[0] in CPU_ONLY
    if quiet:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with _quiet_stderr() if quiet else contextlib.nullcontext():
        from spmdtree._src import cli
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
