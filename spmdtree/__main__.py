"""``python -m spmdtree``: the command line (`spmdtree._src.cli`; new in 0.6)."""

from spmdtree._src.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
