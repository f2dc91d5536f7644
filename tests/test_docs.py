"""The README and every docs page: their code runs, and every output they show is checked.

A page runs top to bottom as a script. Each Python block starts afresh unless
its first line says it continues (``# continues ...``), so no block silently
depends on another. A ```text block right after a Python block is what that
block prints (compared doctest-style: ``...`` stands for any text, runs of
whitespace are equal); one after ``<!-- output: python examples/X.py ... -->``
is what that command prints, checked by running it (``spmdtree ...`` over an
example too, as ``python -m spmdtree``). A block after
``<!-- measured: ... -->`` is a record of timings from one run of that command
(timings vary, so it is not compared); the command must exist. No other text
block may stand unchecked.
"""

import doctest
import enum
import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import spmdtree

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(?:<!-- (?P<marker>output|measured): (?P<command>.*?) -->\s*\n)?"
    r"```(?P<lang>\w+)\n(?P<body>.*?)```",
    re.S,
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _blocks(page):
    return list(BLOCK.finditer(page.read_text()))


def scripts(page):
    """[(code, expected output or None)] for each Python block of `page`."""
    found, text = _blocks(page), page.read_text()
    out = []
    for block, after in zip(found, [*found[1:], None][: len(found)], strict=True):
        if block["lang"] != "python":
            continue
        follows = (
            after is not None
            and after["lang"] == "text"
            and after["command"] is None
            and not text[block.end() : after.start()].strip()
        )
        out.append((block["body"], after["body"] if follows else None))
    return out


def _same(expected, got):
    return doctest.OutputChecker().check_output(expected, got, FLAGS)


def _id(page):
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_runs_and_shows_what_it_prints(page, capsys):
    namespace: dict = {}
    for i, (code, expected) in enumerate(scripts(page)):
        if not code.startswith("# continues"):
            namespace = {}
        elif i == 0:
            pytest.fail(f"{_id(page)}: its first block cannot continue another")
        exec(compile(code, str(page), "exec"), namespace)
        got = capsys.readouterr().out
        if expected is not None:
            assert _same(expected, got), f"{_id(page)} block {i} printed:\n{got}\nnot:\n{expected}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_output_shown_is_checked(page):
    found, text = _blocks(page), page.read_text()
    for before, block in zip([None, *found][: len(found)], found, strict=True):
        if block["lang"] != "text" or block["command"] is not None:
            continue
        after_python = (
            before is not None
            and before["lang"] == "python"
            and not text[before.end() : block.start()].strip()
        )
        assert after_python, f"{_id(page)}: an unchecked text block:\n{block['body'][:200]}"


COMMANDS = [
    (page, block["command"], block["body"])
    for page in PAGES
    for block in _blocks(page)
    if block["marker"] == "output"
]


def test_measured_figures_name_a_command_that_exists():
    for page in PAGES:
        for block in _blocks(page):
            if block["marker"] == "measured":
                script = shlex.split(block["command"])[1]
                assert (ROOT / script).exists(), f"{_id(page)}: {block['command']}"


@pytest.mark.parametrize(
    "page, command, expected", COMMANDS, ids=[f"{_id(p)}: {c}" for p, c, _ in COMMANDS]
)
def test_example_output_shown_is_what_it_prints(page, command, expected):
    argv = shlex.split(command)
    ran = argv[0] == "python" and argv[1].startswith("examples/")
    cli = argv[0] == "spmdtree" and any(a.startswith("examples/") for a in argv)
    assert ran or cli, command  # an example, or the command line over one (new in 0.6)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = [sys.executable, *argv[1:]] if ran else [sys.executable, "-m", "spmdtree", *argv[1:]]
    done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _same(expected, done.stdout), f"{command} printed:\n{done.stdout}\nnot:\n{expected}"


def test_links_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{_id(page)} links to {target}"


def test_the_readme_is_a_front_door():
    text = PAGES[0].read_text()
    assert len(text) <= 20_000
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"the README does not link {page.name}"


def _default(value):
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)


def signature(name):
    """``name(params)`` as the API reference writes it: defaults, no annotations."""
    params = []
    for p in inspect.signature(getattr(spmdtree, name)).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={_default(p.default)}"
        params.append(f"{prefix}{p.name}{default}")
    kinds = [p.kind for p in inspect.signature(getattr(spmdtree, name)).parameters.values()]
    if inspect.Parameter.KEYWORD_ONLY in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds:
        params.insert(kinds.index(inspect.Parameter.KEYWORD_ONLY), "*")
    return f"{name}({', '.join(params)})"


def test_the_api_reference_lists_every_public_name_with_its_signature():
    reference = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in spmdtree.__all__ if f"`{name}" not in reference]
    assert missing == []
    for name in spmdtree.__all__:
        obj = getattr(spmdtree, name)
        if inspect.isfunction(obj) or name in ("Partitioned", "LogicallyPartitioned"):
            assert f"`{signature(name)}`" in reference, signature(name)
