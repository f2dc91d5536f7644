"""The package: what importing it loads, its public surface, and its typing marker."""

import pathlib
import subprocess
import sys

import spmdtree


def test_import_loads_only_jax_and_numpy():
    script = (
        "import sys, jax, numpy\n"
        "before = {m.split('.')[0] for m in sys.modules}\n"
        "import spmdtree\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} - before))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['spmdtree']"


def isort_style(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions, each alphabetical (ruff's RUF022)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_public_surface_is_sorted_and_complete():
    assert spmdtree.__all__ == sorted(spmdtree.__all__, key=isort_style)
    public = {name for name in dir(spmdtree) if not name.startswith("_")}
    modules = {
        "boxes",
        "constraints",
        "errors",
        "optim",
        "report",
        "rules",
        "specs",
        "transforms",
        "trees",
    }
    assert public - modules == set(spmdtree.__all__)


def test_the_implementation_is_private():
    package = pathlib.Path(spmdtree.__file__).parent
    modules = sorted(p.name for p in package.iterdir() if p.suffix == ".py" or p.is_dir())
    assert [name for name in modules if not name.startswith("_")] == []
    assert not hasattr(spmdtree, "rules") and not hasattr(spmdtree, "specs")


def test_py_typed_ships():
    assert (pathlib.Path(spmdtree.__file__).parent / "py.typed").exists()
    setup = (pathlib.Path(spmdtree.__file__).parent.parent / "setup.cfg").read_text()
    assert "spmdtree = py.typed" in setup


ROOT = pathlib.Path(spmdtree.__file__).resolve().parent.parent


def test_the_license_setup_cfg_declares_ships():
    setup = (ROOT / "setup.cfg").read_text()
    assert "license = Apache-2.0" in setup and "license_files = LICENSE" in setup
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text
    assert text.count("\n") == 202  # the whole text, as apache.org publishes it


def test_the_changelog_opens_with_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    sections = [line.split()[1] for line in changelog.splitlines() if line.startswith("## ")]
    assert sections[0] == spmdtree.__version__, sections
    assert sections == sorted(sections, key=lambda v: tuple(map(int, v.split("."))), reverse=True)


#: The documented flow (CONTRIBUTING, "Layout"): each module imports only those before it.
FLOW = [
    "errors",
    "text",
    "pictures",
    "registry",
    "rules",
    "resolve",
    "boxes",
    "trees",
    "specs",
    "tactics",
    "interop",
    "constraints",
    "transforms",
    "optim",
    "plan",
    "step.kinds",
    "step.hlo.groups",
    "step.hlo.instructions",
    "step.hlo.opcodes",
    "step.hlo.loops",
    "step.hlo.forms",
    "step.hlo.schedule",
    "step.hlo.reading",
    "step.hw.chips",
    "step.hw.hardware",
    "step.compile.trace",
    "step.compile.backends",
    "step.compile.analysis",
    "step.compile.compilers",
    "step.time.predict",
    "step.time.timeline",
    "step.time.bound",
    "step.time.profile",
    "step.time.measured",
    "step.advise.diagnose",
    "step.compile.step_plan",
    "step.compile.preflight",
    "step.measure.measure",
    "step.measure.calibrate",
    "step.advise.records",
    "step.advise.advise",
    "report",
    "cli",
]


def test_every_module_imports_only_those_before_it_in_the_flow():
    import ast

    source = pathlib.Path(spmdtree.__file__).parent / "_src"
    modules = {
        ".".join(p.relative_to(source).with_suffix("").parts): p
        for p in source.rglob("*.py")
        if p.name != "__init__.py"
    }
    assert sorted(modules) == sorted(FLOW)  # every room has its place in the flow
    late = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):  # inside functions too
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "spmdtree._src."
            ):
                imported = node.module.removeprefix("spmdtree._src.")
                targets = (
                    [imported]
                    if imported in modules
                    else [f"{imported}.{alias.name}" for alias in node.names]
                )
                late += [(name, t) for t in targets if FLOW.index(t) >= FLOW.index(name)]
    assert late == []


def test_a_test_reaches_into_src_only_for_what_has_no_public_name_and_says_so():
    """CONTRIBUTING's rule: tests use the public API; a test of something with no
    public name (a record, a private helper, the schedule's reader) may import it
    from ``spmdtree._src``, under a comment that starts ``# Private:`` and says why
    (above it, or above the block of imports it is in)."""
    import ast

    unsaid = []
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        in_import = {i for n in imports for i in range(n.lineno, (n.end_lineno or n.lineno) + 1)}
        for node in imports:
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "spmdtree._src"
            ):
                continue
            line = node.lineno - 1  # walk up its block of imports and comments
            while line >= 1 and (line in in_import or lines[line - 1].lstrip().startswith("#")):
                if lines[line - 1].lstrip().startswith("# Private:"):
                    break
                line -= 1
            else:
                unsaid.append(f"{path.name}:{node.lineno}")
                continue
            if not lines[line - 1].lstrip().startswith("# Private:"):
                unsaid.append(f"{path.name}:{node.lineno}")
    assert unsaid == []
