"""The command line (new in 0.6): ``spmdtree advise``, ``spmdtree preflight`` and (new
in 0.7) ``spmdtree measure`` over a user's ``make_step(candidate) -> (fn, args,
kwargs)``, the function `advise` takes, and ``spmdtree calibrate``; for a CI job or a cluster's scheduler: the table on stdout, JSON, a trace
and a plot to files, and a user's mistake as one line on stderr with exit
status 2.

``MODULE:FUNCTION`` names the function: ``MODULE`` a dotted module importable
from the working directory (``mypkg.steps``) or a path to a ``.py`` file
(``examples/advise.py``, imported with its folder on the path, as ``python``
runs a script); the rules are ``MODULE:RULES`` unless ``--rules`` names others.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
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
from spmdtree._src.rules import normalize_rules
from spmdtree._src.step.advise import Candidate, advise, candidates, layouts, step_call
from spmdtree._src.step.hw import Hardware, hardware_of
from spmdtree._src.step.measure import calibrate, measure
from spmdtree._src.step.preflight import Keywords, preflight
from spmdtree._src.text import seconds_text

PROGRAM = "spmdtree"
#: Exit statuses: the run's; advise's where no candidate fits (the table printed);
#: a user's mistake (argparse's own for bad usage).
OK, NOTHING_FITS, MISTAKE = 0, 1, 2
#: The formats --plot writes (matplotlib's, by the file's suffix).
PLOT_SUFFIXES = (
    ".png",
    ".svg",
    ".svgz",
    ".pdf",
    ".eps",
    ".ps",
    ".jpg",
    ".jpeg",
    ".tif",
    ".tiff",
    ".webp",
)

_EPILOG = """\
MAKE_STEP is MODULE:FUNCTION, FUNCTION(candidate) -> (fn, args, kwargs) as st.advise
takes it: candidate.mesh, .rules, .batch, .length and .options say what to build
(args may be jax.ShapeDtypeStructs; kwargs preflight's keywords, e.g. donate_argnums).
MODULE is a dotted module importable from here or a path to a .py file; the rules
are MODULE:RULES unless --rules names others (--rules none: the step's boxes name
mesh axes). Exit status: 0; 1 where advise finds no candidate that fits; 2 for a
mistake (one line on stderr). Docs: the README's "Documentation" (docs/planning.md,
"What users look at").
"""


class _Parser(argparse.ArgumentParser):
    """argparse, its errors one line on stderr (exit 2) that says where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(MISTAKE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line on `argv` (``sys.argv[1:]`` by default) and returns
    its exit status: 0; 1 where advise finds no candidate that fits; 2 for a
    user's mistake (one line on stderr; bad usage and ``--help`` exit through
    argparse's ``SystemExit``, with 2 and 0).

    Example:
        >>> main(["preflight", "no_such_module:make_step", "--mesh", "data=2", "--batch", "8"])
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)  # bad usage: argparse's one line, SystemExit(2)
    try:
        return int(args.run(args))
    except Exception as e:  # the boundary: every error is one line, or the whole trace
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
    _measure_parser(commands)
    _calibrate_parser(commands)
    return parser


def _common(sub: argparse.ArgumentParser) -> None:
    """The arguments both subcommands take."""
    sub.add_argument("make_step", metavar="MODULE:MAKE_STEP", help="the step builder")
    sub.add_argument(
        "--length", type=_positive, help="tokens per sequence (candidate.length; advise's tokens/s)"
    )
    sub.add_argument(
        "--rules",
        metavar="MODULE:NAME",
        help="the logical-axis rules (default MODULE:RULES; none: the boxes name mesh axes)",
    )
    sub.add_argument(
        "--json", metavar="PATH", help="write the result as JSON (- for stdout; docs/api.md)"
    )
    sub.add_argument(
        "--traceback", action="store_true", help="on an error, print the whole traceback"
    )


def _split_arguments(sub: Any) -> None:
    """advise's options and counts for the splits at scale: a pipeline's options, the
    layers the stages divide, the experts the expert axis divides (new in 0.8)."""
    sub.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="an option make_step reads from candidate.options, and its values (repeatable; "
        "a pipeline's: microbatches=8,16 and repeats=1,2)",
    )
    sub.add_argument(
        "--layers",
        type=_positive,
        help="the model's layers: with a stage axis in --axes, the stages (x repeats) of each "
        "layout must divide them",
    )
    sub.add_argument(
        "--experts",
        type=_positive,
        help="the experts of each expert layer: with an expert axis in --axes, each layout's "
        "must divide them (a context axis must divide --length)",
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
    sub.add_argument("--devices", type=_positive, required=True, help="how many devices")
    sub.add_argument(
        "--axes", default="data,fsdp,tensor", help="mesh axis names (default data,fsdp,tensor)"
    )
    sub.add_argument(
        "--batch",
        type=_positive,
        action="append",
        required=True,
        help="a global batch (repeatable)",
    )
    _split_arguments(sub)
    sub.add_argument(
        "--hardware",
        required=True,
        help="the chip to time on: a preset (h100, h200, b200, tpu-v5p, ...) or a JSON file "
        "(spmdtree calibrate --json)",
    )
    sub.add_argument(
        "--confirm", type=_count, default=0, help="rows to confirm with the target's compiler"
    )
    sub.add_argument(
        "--budget-gib", type=_gib, help="memory per device in GiB (default: the chip's)"
    )
    sub.add_argument(
        "--screen",
        choices=("auto", "cpu", "target"),
        default="auto",
        help="where the first pass compiles: the target where it screens cheaply (auto), the "
        "CPU estimate, or the target; a row over budget on the estimate is asked of the "
        "target's compiler where it is installed",
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
    sub.add_argument("--batch", type=_positive, required=True, help="the global batch")
    sub.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=V",
        help="an option make_step reads from candidate.options (repeatable)",
    )
    sub.add_argument(
        "--target",
        help="compile with this chip's own compiler (h100, tpu-v5p, ..., or a JSON file)",
    )
    sub.add_argument(
        "--hardware", help="the chip to time on, a preset or a JSON file (default: the target)"
    )
    sub.add_argument(
        "--trace", metavar="PATH", help="write the predicted schedule (Perfetto, chrome://tracing)"
    )
    sub.add_argument("--plot", metavar="PATH", help="write the step's time as a picture")


def _measure_parser(commands: Any) -> None:
    sub = commands.add_parser(
        "measure",
        help="run one step on this machine's devices and set its prediction beside it",
        description="Compile one step for a mesh of this machine's devices, run it (warm-up, "
        "then timed steps, then a profile), and print its measured time beside the predicted "
        "one, per step and per instruction (new in 0.7).",
        epilog="example: spmdtree measure mymodule:make_step --mesh data=1 --batch 8 "
        "--hardware chip.json --json measured.json",
    )
    sub.set_defaults(run=_measure)
    _common(sub)
    sub.add_argument("--mesh", required=True, metavar="AXIS=N,...", help="e.g. data=8 (N devices)")
    sub.add_argument("--batch", type=_positive, required=True, help="the global batch")
    sub.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=V",
        help="an option make_step reads from candidate.options (repeatable)",
    )
    sub.add_argument(
        "--hardware", help="the chip to predict on, a preset or a JSON file (default: the devices')"
    )
    sub.add_argument("--steps", type=_positive, default=10, help="timed steps (default 10)")
    sub.add_argument("--warmup", type=_count, default=3, help="steps before them (default 3)")
    sub.add_argument(
        "--trace", metavar="PATH", help="write the predicted and measured step (Perfetto)"
    )


def _calibrate_parser(commands: Any) -> None:
    sub = commands.add_parser(
        "calibrate",
        help="measure this machine's chip: its model figures, as JSON for --hardware",
        description="Run microbenchmarks on this machine's first device and print the "
        "calibrated hardware, each measured figure with its provenance (new in 0.7).",
        epilog="example: spmdtree calibrate --json chip.json; then spmdtree advise ... "
        "--hardware chip.json",
    )
    sub.set_defaults(run=_calibrate)
    sub.add_argument("--json", metavar="PATH", help="write the hardware's JSON (- for stdout)")
    sub.add_argument(
        "--seconds",
        type=_positive,
        default=60,
        help="how long the timed runs may take, compiles apart (default 60; ~51 s in all "
        "on a TPU v5e)",
    )
    sub.add_argument("--preset", help="the preset whose peak, memory and links are kept")
    sub.add_argument(
        "--flash-blocks",
        type=_positive,
        metavar="N",
        help="splash attention's blocks (all eight) the flash figures are measured at: "
        "the ones your step runs (a TPU's; default 512)",
    )
    sub.add_argument(
        "--traceback", action="store_true", help="on an error, print the whole traceback"
    )


def _chip(text: str) -> Hardware:
    """--hardware and --target: a preset's name, or a JSON file `Hardware.to_json` wrote."""
    return hardware_of(text, "the hardware")


def _measure(args: argparse.Namespace) -> int:
    chip = None if args.hardware is None else _chip(args.hardware)
    _check_paths(args.json, None, args.trace)
    shape = _mesh_shape(args.mesh)
    make_step, rules = _loaded(args.make_step, args.rules)
    _check_axes(rules, tuple(shape), f"--mesh {args.mesh}", "add it to --mesh, size 1 where unused")
    mesh = jax.make_mesh(
        tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape)
    )
    fn, step_args, given = _step(make_step, mesh, rules, args)
    m = measure(
        fn, *step_args, mesh=mesh, rules=rules, hardware=chip, steps=args.steps,
        warmup=args.warmup, **given,
    )  # fmt: skip
    print(m, file=sys.stderr if args.json == "-" else sys.stdout)
    _write_json(args.json, m.to_dict())
    if args.trace:
        m.trace(args.trace)
    return OK


def _calibrate(args: argparse.Namespace) -> int:
    if args.json not in (None, "-"):
        _check_paths(args.json, None)
    blocks = None if args.flash_blocks is None else int(args.flash_blocks)
    calibrated = calibrate(seconds=float(args.seconds), preset=args.preset, flash_blocks=blocks)
    said = sys.stderr if args.json == "-" else sys.stdout
    for name, why in calibrated.provenance.items():
        if why.startswith(("measured", "not measured")):
            print(f"{name:<26} {getattr(calibrated, name)!s:<21} {why}", file=said)
    if args.json == "-":
        print(calibrated.to_json())
    elif args.json:
        pathlib.Path(args.json).write_text(calibrated.to_json())
    return OK


def _step(
    make_step: Any, mesh: Any, rules: Any, args: argparse.Namespace
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """`make_step`'s step for the one candidate the arguments describe: its function,
    arguments and preflight's other keywords."""
    options = _options(args.option, many=False)
    candidate = Candidate(mesh, rules, args.batch, length=args.length, options=options or None)
    try:
        returned = make_step(candidate)
    except Exception as e:
        raise Mistake(ValueError, f"make_step raised {type(e).__name__}: {e}") from e
    fn, step_args, keywords = step_call(returned)
    return fn, step_args, {name: getattr(keywords, name) for name in Keywords.names()}


def _advise(args: argparse.Namespace) -> int:
    chip = _chip(args.hardware)  # said before anything compiles
    _check_paths(args.json, args.plot)
    axes = tuple(name.strip() for name in args.axes.split(",") if name.strip())
    make_step, rules = _loaded(args.make_step, args.rules)
    _check_axes(rules, axes, f"--axes {','.join(axes)}", "add it to --axes")
    options = _options(args.option, many=True)
    found = candidates(
        layouts(args.devices, axes),
        rules,
        args.batch,
        length=args.length,
        layers=args.layers,
        experts=args.experts,
        **options,
    )
    budget = None if args.budget_gib is None else int(args.budget_gib * 2**30)
    advice = advise(
        make_step,
        found,
        hardware=chip,
        budget_bytes=budget,
        confirm=args.confirm,
        screen=args.screen,
    )
    print(advice, file=sys.stderr if args.json == "-" else sys.stdout)
    _write_json(args.json, advice.to_dict())
    if args.plot:
        advice.plot(args.plot)
    if advice.best is None:
        print(f"{PROGRAM} advise: no candidate fits (the table says why)", file=sys.stderr)
        return NOTHING_FITS
    return OK


def _preflight(args: argparse.Namespace) -> int:
    chip = args.hardware or args.target
    timed = None if chip is None else _chip(chip)  # said before anything compiles
    target = None if args.target is None else _chip(args.target)
    for path, what in ((args.trace, "trace"), (args.plot, "plot")):
        if path and chip is None:
            raise Mistake(
                ValueError, f"--{what} needs a chip to time on: give --hardware or --target."
            )
    _check_paths(args.json, args.plot, args.trace)
    shape = _mesh_shape(args.mesh)
    make_step, rules = _loaded(args.make_step, args.rules)
    _check_axes(rules, tuple(shape), f"--mesh {args.mesh}", "add it to --mesh, size 1 where unused")
    mesh = jax.sharding.AbstractMesh(
        tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape)
    )
    fn, step_args, given = _step(make_step, mesh, rules, args)
    step = preflight(fn, *step_args, mesh=mesh, rules=rules, target=target, **given)
    said = sys.stderr if args.json == "-" else sys.stdout  # stdout is the JSON's
    print(step, file=said)
    if timed is not None:
        t = step.time(timed)
        print(
            f"time on {timed.name}: predicted {seconds_text(t.predicted_seconds)}, bound "
            f"{seconds_text(t.bound_seconds)} (compute {seconds_text(t.compute_seconds)}, "
            f"collectives {seconds_text(t.comm_seconds)})",
            file=said,
        )
    _write_json(args.json, step.to_dict(timed))
    for path, what in ((args.trace, "trace"), (args.plot, "plot")):
        if path and timed is not None:
            getattr(step, what)(timed, path)
    return OK


def _whole(least: int) -> Any:
    """An argparse type: a whole number >= `least` (named so in argparse's messages)."""

    def whole(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text} is not a whole number >= {least}")
        return value

    whole.__name__ = "whole number"
    return whole


_positive, _count = _whole(1), _whole(0)


def _gib(text: str) -> float:
    """An argparse type: a finite number of GiB > 0."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of GiB > 0")
    return value


_gib.__name__ = "number of GiB"


def _check_paths(json_path: str | None, plot: str | None, trace: str | None = None) -> None:
    """The files asked for can be written: their folders exist, a plot's format is
    one matplotlib writes."""
    for flag, path in (("--json", json_path), ("--plot", plot), ("--trace", trace)):
        if path is None or (path == "-" and flag == "--json"):
            continue
        folder = pathlib.Path(path).parent
        if not folder.is_dir():
            raise Mistake(ValueError, f"{flag} {path}: no folder {folder} to write it in.")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise Mistake(
            ImportError,
            "--plot needs matplotlib, which spmdtree does not install by default: "
            "pip install 'spmdtree[plot]'.",
        )
    if plot is not None and pathlib.Path(plot).suffix.lower() not in PLOT_SUFFIXES:
        raise Mistake(
            ValueError,
            f"--plot {plot}: its suffix says no format matplotlib writes; use one of "
            f"{', '.join(PLOT_SUFFIXES)}.",
        )


def _check_axes(rules: Any, axes: tuple[str, ...], given: str, fix: str) -> None:
    """Every mesh axis the rules name is one of `axes`, or the one line that says
    which is not and how to add it."""
    if rules is None:
        return
    named: dict[str, str] = {}
    for logical, target in normalize_rules(rules):
        for axis in (
            (target,) if isinstance(target, str) else target if isinstance(target, tuple) else ()
        ):
            if isinstance(axis, str):
                named.setdefault(axis, logical)
    missing = [axis for axis in named if axis not in axes]
    if missing:
        which = ", ".join(f"{axis!r} (for {named[axis]!r})" for axis in missing)
        raise Mistake(
            ValueError,
            f"the rules name mesh axis {which}, not in {given}: {fix}, or leave it out of "
            "the rules.",
        )


def _options(texts: Sequence[str], many: bool) -> dict[str, Any]:
    """The ``--option`` flags as candidate.options, each name once."""
    options: dict[str, Any] = {}
    for text in texts:
        name, values = _option(text, many)
        if name in options:
            form = "NAME=V1,V2" if many else "NAME=V"
            raise Mistake(ValueError, f"--option {name} is given twice; give it once, as {form}.")
        options[name] = values
    return options


def _loaded(target: str, rules_at: str | None) -> tuple[Any, Any]:
    """The function `target` names, and the rules (`rules_at`, else its module's RULES;
    ``none`` for none)."""
    module, function = _named(target, "MODULE:MAKE_STEP")
    make_step = _attribute(module, function, target)
    if not callable(make_step):
        raise Mistake(TypeError, f"{target} is a {type(make_step).__name__}, not a function.")
    if rules_at is not None and rules_at.lower() == "none":
        return make_step, None
    if rules_at is not None:
        where, name = _named(rules_at, "MODULE:NAME")
        return make_step, _attribute(where, name, rules_at)
    if not hasattr(module, "RULES"):
        raise Mistake(
            ValueError,
            f"module {module.__name__!r} has no RULES: define RULES (logical name -> mesh "
            "axes pairs) in it, name them with --rules MODULE:NAME, or give --rules none "
            "where the step's boxes name mesh axes.",
        )
    return make_step, module.RULES


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
        if str(path.parent) not in sys.path:  # its siblings import, as `python file.py`
            sys.path.insert(0, str(path.parent))
        for loaded in list(sys.modules.values()):  # loaded once, whoever names it again
            if getattr(loaded, "__file__", None) == str(path):
                return loaded
        # its own name where that is free, else a private one: never over a module
        # already loaded (a user's copy.py is not the standard library's copy)
        stem = path.stem if path.stem not in sys.modules else f"_spmdtree_user_{path.stem}"
        spec = importlib.util.spec_from_file_location(stem, path)
        if spec is None or spec.loader is None:
            raise Mistake(ImportError, f"{name} cannot be imported as a module.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[stem] = module
        _imported(name, lambda: spec.loader.exec_module(module))
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
        raise Mistake(ImportError, f"importing {name} raised {type(e).__name__}: {e}") from e
    except Exception as e:
        raise Mistake(ImportError, f"importing {name} raised {type(e).__name__}: {e}") from e


def _imported(name: str, load: Any) -> None:
    """Runs a module's code, its own error said as one line."""
    try:
        load()
    except Exception as e:
        raise Mistake(ImportError, f"importing {name} raised {type(e).__name__}: {e}") from e


def _attribute(module: Any, name: str, text: str) -> Any:
    if not hasattr(module, name):
        own = sorted(
            n
            for n, value in vars(module).items()
            if not n.startswith("_")
            and not inspect.ismodule(value)
            and getattr(value, "__module__", module.__name__) == module.__name__
        )
        close = difflib.get_close_matches(name, own, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise Mistake(
            AttributeError,
            f"module {module.__name__!r} has no {name!r} ({text}); {hint}it defines "
            f"{', '.join(own[:12]) or 'no public names'}.",
        )
    return getattr(module, name)


def _option(text: str, many: bool) -> tuple[str, Any]:
    """``NAME=V1,V2`` as the name and its values (a tuple where `many`, else one)."""
    name, sep, values = text.partition("=")
    if not sep or not name.strip() or not values.strip():
        form = "NAME=V1,V2" if many else "NAME=V"
        raise Mistake(ValueError, f"--option {text!r} is not {form} (e.g. remat=full,minimal).")
    if any(not v.strip() for v in values.split(",")):
        raise Mistake(ValueError, f"--option {text!r} has an empty value; give each value once.")
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
    """The JSON to `path`, or to stdout for ``-`` (strict JSON: no NaN or Infinity)."""
    if path == "-":
        print(json.dumps(data, indent=1, allow_nan=False))
    elif path:
        pathlib.Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
