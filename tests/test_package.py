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
    "pipeline",
    "sequences",
    "optim",
    "plan",
    "step.kinds",
    "step.pictures.draw",
    "step.hlo.groups",
    "step.hlo.instructions",
    "step.hlo.opcodes",
    "step.hlo.loops",
    "step.hlo.forms",
    "step.hlo.schedule",
    "step.hlo.reading",
    "step.hw.chips",
    "step.hw.grid",
    "step.hw.hardware",
    "step.compile.tracing",
    "step.compile.backends",
    "step.compile.analysis",
    "step.compile.compilers",
    "step.time.predict",
    "step.time.timeline",
    "step.time.bound",
    "step.time.profile",
    "step.time.measured",
    "step.preflight.diagnose",
    "step.preflight.step_plan",
    "step.preflight.preflight",
    "step.measure.measure",
    "step.measure.calibrate",
    "step.advise.records",
    "step.advise.space",
    "step.advise.progress",
    "step.advise.judging",
    "step.advise.state",
    "step.advise.advise",
    "report",
    "cli",
]


#: The step wing's floors (0.7): a folder imports only the faces (`__init__`) of the
#: floors below it, so the folders' import graph has no arrow up and no cycle.
FLOORS = {
    "kinds": 0,
    "pictures": 1,
    "hlo": 1,
    "hw": 1,
    "compile": 2,
    "time": 2,
    "preflight": 3,
    "measure": 4,
    "advise": 5,
}


def test_each_floor_imports_only_the_faces_of_the_floors_below_it():
    import ast

    source = pathlib.Path(spmdtree.__file__).parent / "_src"
    step = source / "step"
    assert sorted(p.stem if p.is_file() else p.name for p in step.iterdir()
                  if p.name != "__init__.py" and p.name != "__pycache__") == sorted(FLOORS)  # fmt: skip
    wrong, used = [], {floor: set() for floor in FLOORS}
    for path in sorted(source.rglob("*.py")):
        parts = path.relative_to(source).parts
        mine = parts[1].removesuffix(".py") if parts[0] == "step" else None
        if path.name == "__init__.py" and mine is not None:
            continue  # a face: checked below
        for node in ast.walk(ast.parse(path.read_text())):  # inside functions too
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if not module.startswith("spmdtree._src.step."):
                continue
            target = module.split(".")[3]
            face = "spmdtree._src.step." + target
            if target == mine:  # a room of its own floor, never through its own face
                if module == face:
                    wrong.append(f"{'/'.join(parts)} imports its own face {module}")
                continue
            if module != face or (mine is not None and FLOORS[target] >= FLOORS[mine]):
                wrong.append(f"{'/'.join(parts)} imports {module}")
            used[target].update(alias.name for alias in node.names)
    assert wrong == []
    # and each face gives what the floors above use, from its own floor's rooms only
    for floor in FLOORS:
        if floor == "kinds":
            continue
        face = ast.parse((step / floor / "__init__.py").read_text())
        given = set()
        for node in face.body:
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").startswith(f"spmdtree._src.step.{floor}."), node.module
                given.update(alias.asname or alias.name for alias in node.names)
        assert given == used[floor], floor


def test_every_module_imports_only_those_before_it_in_the_flow():
    import ast

    source = pathlib.Path(spmdtree.__file__).parent / "_src"
    modules = {
        ".".join(p.relative_to(source).with_suffix("").parts): p
        for p in source.rglob("*.py")
        if p.name != "__init__.py"
    }
    assert sorted(modules) == sorted(FLOW)  # every room has its place in the flow
    # a name taken from a floor's face (0.7) is taken from the room the face has it from
    faces = {}
    for init in source.rglob("__init__.py"):
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                room = node.module.removeprefix("spmdtree._src.")
                faces.update({f"{room.rsplit('.', 1)[0]}.{a.name}": room for a in node.names})
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
                    else [
                        faces.get(f"{imported}.{alias.name}", f"{imported}.{alias.name}")
                        for alias in node.names
                    ]
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


def code_lines(lines, node):
    """A function's lines of code: its own and its nested functions', without its
    docstring, comments or blank lines."""
    import ast

    first = node.body[0]
    docstring = (
        range(first.lineno, first.end_lineno + 1)
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        else range(0)
    )  # fmt: skip
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in docstring and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
    )


def test_the_house_keeps_its_rooms_small():
    """STYLE's small functions (0.7): no function over 60 lines of code, and the search
    itself (advise.py, cut into its jobs) at most 700 lines."""
    import ast

    source = pathlib.Path(spmdtree.__file__).parent
    long = []
    for path in sorted(source.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and code_lines(lines, node) > 60:
                long.append(f"{path.relative_to(source)}:{node.lineno} {node.name}")
    assert long == []
    search = source / "_src" / "step" / "advise" / "advise.py"
    assert len(search.read_text().splitlines()) <= 700


def test_contributings_map_lists_every_room_and_only_rooms_that_exist():
    """CONTRIBUTING's layout map is true (0.7): every module of the package is on it,
    and every path on it is a module (or folder) that exists."""
    root = pathlib.Path(spmdtree.__file__).parent.parent
    text = (root / "CONTRIBUTING.md").read_text()
    block = text[text.index("## Layout") :]
    block = block[block.index("```\n") + 4 :]
    block = block[: block.index("```")]
    listed, folder = set(), ""
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 6):
            continue  # a blank or a description's continuation
        path = line.split()[0]
        if not line.startswith(" "):
            folder = path if path.endswith("/") else folder
            listed.add(path)
        else:
            listed.add(folder + path)
    for path in listed:
        if "*" in path or "<" in path:  # a pattern: its files are each room's tests, docs, ...
            assert list(root.glob(path.replace("<module>", "*"))), path
            continue
        assert (root / path).exists(), path
    modules = {
        str(p.relative_to(root))
        for p in (root / "spmdtree" / "_src").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert modules - listed == set()
