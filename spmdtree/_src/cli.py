"""The command line (new in 0.6): ``spmdtree advise`` and ``spmdtree preflight`` over
a user's ``make_step(candidate) -> (fn, args, kwargs)``, the function `advise`
takes, for a CI job or a cluster's scheduler: the table on stdout, JSON, a trace
and a plot to files, and a user's mistake as one line on stderr with exit
status 2.

``MODULE:FUNCTION`` names the function: ``MODULE`` a dotted module importable
from the working directory (``mypkg.steps``) or a path to a ``.py`` file
(``examples/advise.py``, imported with its folder on the path, as ``python``
runs a script); the rules are ``MODULE:RULES`` unless ``--rules`` names others.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import pathlib
import sys
import traceback
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import jax
from jax.sharding import AxisType

from spmdtree._src.errors import Mistake
from spmdtree._src.step.advise.advise import advise, candidates, layouts, step_call
from spmdtree._src.step.advise.records import Candidate
from spmdtree._src.step.compile.preflight import Keywords, preflight
from spmdtree._src.step.hw.hardware import hardware
from spmdtree._src.text import seconds_text

PROGRAM = "spmdtree"
#: Exit statuses: the run's, and a user's mistake (argparse's own for bad usage).
OK, MISTAKE = 0, 2

_EPILOG = """\
MAKE_STEP is MODULE:FUNCTION, FUNCTION(candidate) -> (fn, args, kwargs) as st.advise
takes it: candidate.mesh, .rules, .batch, .length and .options say what to build
(args may be jax.ShapeDtypeStructs; kwargs preflight's keywords, e.g. donate_argnums).
MODULE is a dotted module importable from here or a path to a .py file; the rules
are MODULE:RULES unless --rules names others. Docs: docs/planning.md, "The command line".
"""


class _Parser(argparse.ArgumentParser):
    """argparse, its errors one line on stderr (exit 2) that says where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(MISTAKE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line on `argv` (``sys.argv[1:]`` by default) and returns
    its exit status: 0, or 2 for a user's mistake (one line on stderr).

    Example:
        >>> main(["preflight", "no_such_module:make_step", "--mesh", "data=2", "--batch", "8"])
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (Mistake, TypeError, ValueError, ImportError, AttributeError, OSError) as e:
        if args.traceback:
            traceback.print_exc()
        text = e.message if isinstance(e, Mistake) else str(e) or type(e).__name__
        line = " ".join(text.split()).removeprefix(f"{args.command}: ")
        hint = "" if args.traceback else " (--traceback for the whole trace)"
        print(f"{PROGRAM} {args.command}: {line}{hint}", file=sys.stderr)
        return MISTAKE


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROGRAM,
        description="Will my JAX training step fit, on which layout, how fast: without the "
        "hardware. Each subcommand compiles your step for a mesh of devices it does not "
        "need (the CPU's estimate, or the target's own compiler), and predicts its time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _advise_parser(commands)
    _preflight_parser(commands)
    return parser


def _common(sub: argparse.ArgumentParser) -> None:
    """The arguments both subcommands take."""
    sub.add_argument("make_step", metavar="MODULE:MAKE_STEP", help="the step builder")
    sub.add_argument(
        "--length", type=int, help="tokens per sequence (for tokens/s, and candidate.length)"
    )
    sub.add_argument(
        "--rules", metavar="MODULE:NAME", help="the logical-axis rules (default MODULE:RULES)"
    )
    sub.add_argument("--json", metavar="PATH", help="write the result as JSON (docs/api.md)")
    sub.add_argument(
        "--traceback", action="store_true", help="on an error, print the whole traceback"
    )


def _advise_parser(commands: Any) -> None:
    sub = commands.add_parser(
        "advise",
        help="rank every layout of N devices (x batches x options) by predicted time",
        description="Rank every layout of N devices (as the mesh axes --axes) at each "
        "--batch and each combination of --option values: compile each step, judge its "
        "peak against the budget, predict its time on --hardware, and print the table.",
        epilog="example: spmdtree advise mymodule:make_step --devices 8 --axes data,fsdp "
        "--batch 64 --length 128 --hardware h100 --json out.json",
    )
    sub.set_defaults(run=_advise)
    _common(sub)
    sub.add_argument("--devices", type=int, required=True, help="how many devices")
    sub.add_argument(
        "--axes", default="data,fsdp,tensor", help="mesh axis names (default data,fsdp,tensor)"
    )
    sub.add_argument(
        "--batch", type=int, action="append", required=True, help="a global batch (repeatable)"
    )
    sub.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="an option make_step reads from candidate.options, and its values (repeatable)",
    )
    sub.add_argument(
        "--hardware", required=True, help="the chip to time on: h100, h200, b200, tpu-v5p, ..."
    )
    sub.add_argument(
        "--confirm", type=int, default=0, help="rows to confirm with the target's compiler"
    )
    sub.add_argument("--budget-gib", type=float, help="memory per device (default: the chip's)")
    sub.add_argument(
        "--screen", choices=("auto", "cpu", "target"), default="auto", help="what compiles"
    )
    sub.add_argument("--plot", metavar="PATH", help="write the advice's picture (PNG, SVG, PDF)")


def _preflight_parser(commands: Any) -> None:
    sub = commands.add_parser(
        "preflight",
        help="compile one step for a mesh and say its memory, collectives and time",
        description="Compile one step for a mesh of devices this machine does not have, "
        "and print its memory per device, collectives and, with --hardware or --target, "
        "its predicted time.",
        epilog="example: spmdtree preflight mymodule:make_step --mesh data=2,fsdp=4 "
        "--batch 64 --target h100 --trace step.json",
    )
    sub.set_defaults(run=_preflight)
    _common(sub)
    sub.add_argument("--mesh", required=True, metavar="AXIS=N,...", help="e.g. data=8,fsdp=8")
    sub.add_argument("--batch", type=int, required=True, help="the global batch")
    sub.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=V",
        help="an option make_step reads from candidate.options (repeatable)",
    )
    sub.add_argument("--target", help="compile with this chip's own compiler (h100, tpu-v5p, ...)")
    sub.add_argument("--hardware", help="the chip to time on (default: the target)")
    sub.add_argument(
        "--trace", metavar="PATH", help="write the predicted schedule (Perfetto, chrome://tracing)"
    )
    sub.add_argument("--plot", metavar="PATH", help="write the step's time as a picture")


def _advise(args: argparse.Namespace) -> int:
    make_step, rules = _loaded(args.make_step, args.rules)
    axes = tuple(name.strip() for name in args.axes.split(",") if name.strip())
    options = dict(_option(text, many=True) for text in args.option)
    found = candidates(
        layouts(args.devices, axes), rules, args.batch, length=args.length, **options
    )
    budget = None if args.budget_gib is None else int(args.budget_gib * 2**30)
    advice = advise(
        make_step,
        found,
        hardware=hardware(args.hardware),
        budget_bytes=budget,
        confirm=args.confirm,
        screen=args.screen,
    )
    print(advice)
    _write_json(args.json, advice.to_json())
    if args.plot:
        advice.plot(args.plot)
    return OK


def _preflight(args: argparse.Namespace) -> int:
    chip = args.hardware or args.target
    for path, what in ((args.trace, "trace"), (args.plot, "plot")):
        if path and chip is None:  # said before the compile, not after it
            raise Mistake(
                ValueError, f"--{what} needs a chip to time on: give --hardware or --target."
            )
    make_step, rules = _loaded(args.make_step, args.rules)
    shape = _mesh_shape(args.mesh)
    mesh = jax.sharding.AbstractMesh(
        tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape)
    )
    options = dict(_option(text, many=False) for text in args.option)
    candidate = Candidate(mesh, rules, args.batch, length=args.length, options=options or None)
    fn, step_args, keywords = step_call(make_step(candidate))
    given = {name: getattr(keywords, name) for name in Keywords.names()}
    step = preflight(fn, *step_args, mesh=mesh, rules=rules, target=args.target, **given)
    print(step)
    timed = None if chip is None else hardware(chip)
    if timed is not None:
        t = step.time(timed)
        print(
            f"time on {timed.name}: predicted {seconds_text(t.predicted_seconds)}, bound "
            f"{seconds_text(t.bound_seconds)} (compute {seconds_text(t.compute_seconds)}, "
            f"collectives {seconds_text(t.comm_seconds)})"
        )
    _write_json(args.json, step.to_json(timed))
    for path, what in ((args.trace, "trace"), (args.plot, "plot")):
        if path and timed is not None:
            getattr(step, what)(timed, path)
    return OK


def _loaded(target: str, rules_at: str | None) -> tuple[Any, Any]:
    """The function `target` names, and the rules (`rules_at`, else its module's RULES)."""
    module, function = _named(target, "MODULE:MAKE_STEP")
    make_step = _attribute(module, function, target)
    if not callable(make_step):
        raise Mistake(TypeError, f"{target} is a {type(make_step).__name__}, not a function.")
    if rules_at is None:
        rules = getattr(module, "RULES", None)
    else:
        where, name = _named(rules_at, "MODULE:NAME")
        rules = _attribute(where, name, rules_at)
    return make_step, rules


def _named(text: str, form: str) -> tuple[Any, str]:
    """``MODULE:NAME`` as the imported module and the name."""
    module, sep, name = text.rpartition(":")
    if not sep or not module or not name:
        raise Mistake(ValueError, f"{text!r} is not {form} (e.g. mymodule:make_step).")
    return _module(module), name


def _module(name: str) -> Any:
    """A dotted module importable from the working directory, or a ``.py`` file."""
    if name.endswith(".py") or os.sep in name:
        path = pathlib.Path(name).resolve()
        if not path.is_file():
            raise Mistake(ValueError, f"no file {name} (MODULE is a dotted module or a .py file).")
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise Mistake(ImportError, f"{name} cannot be imported as a module.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` would
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            raise Mistake(
                ImportError,
                f"no module {name!r} importable from {os.getcwd()} (give a dotted module on "
                "the path, or a path to a .py file).",
            ) from e
        raise


def _attribute(module: Any, name: str, text: str) -> Any:
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise Mistake(
            AttributeError,
            f"module {module.__name__!r} has no {name!r} ({text}); it has "
            f"{', '.join(public) or 'no public names'}.",
        )
    return getattr(module, name)


def _option(text: str, many: bool) -> tuple[str, Any]:
    """``NAME=V1,V2`` as the name and its values (a tuple where `many`, else one)."""
    name, sep, values = text.partition("=")
    if not sep or not name.strip() or not values.strip():
        form = "NAME=V1,V2" if many else "NAME=V"
        raise Mistake(ValueError, f"--option {text!r} is not {form} (e.g. remat=full,minimal).")
    parsed = tuple(_value(v.strip()) for v in values.split(","))
    if not many and len(parsed) > 1:
        raise Mistake(
            ValueError,
            f"--option {text!r} gives {len(parsed)} values; preflight builds one step: give "
            "one (advise tries several).",
        )
    return name.strip(), parsed if many else parsed[0]


def _value(text: str) -> Hashable:
    """An option's value: an int, a float, true/false/none, else the text."""
    special = {"true": True, "false": False, "none": None}
    if text.lower() in special:
        return special[text.lower()]
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        return number if not isinstance(number, float) or math.isfinite(number) else text
    return text


def _mesh_shape(text: str) -> dict[str, int]:
    """``data=8,fsdp=8`` as {"data": 8, "fsdp": 8}."""
    shape: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise Mistake(
                ValueError, f"--mesh {text!r} is not AXIS=N,... with N >= 1 (e.g. data=8,fsdp=8)."
            )
        if name.strip() in shape:
            raise Mistake(ValueError, f"--mesh {text!r} names axis {name.strip()!r} twice.")
        shape[name.strip()] = int(size)
    return shape


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")
