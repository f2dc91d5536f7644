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

Two kinds of Python block run elsewhere (new in 0.8): one whose first line says
"on the TPU VM" needs the chip, and benchmarks/chip.py's ``recipe`` runs it there
(its output recorded after a ``measured:`` marker); one whose first line says
"needs spmdtree[tpu]" compiles with libtpu, and runs where libtpu is installed (a
target test), with the blocks it continues.
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
from test_targets import has_compiler

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


sys.path.insert(0, str(ROOT / "benchmarks"))
import chip  # noqa: E402  benchmarks/chip.py: it runs the blocks on the chip

#: What a block's first line says where it runs elsewhere: on the chip, or with libtpu.
ON_THE_CHIP, NEEDS_LIBTPU = chip.ON_THE_CHIP, chip.NEEDS_LIBTPU
#: The files a page's blocks that compile with libtpu read, as the chip recorded them.
RECORDED = {"planning.md": {"chip.json": ROOT / "benchmarks/chip-2026-12-07/recipe/chip.json"}}


def _runs_here(code, libtpu):
    first = code.splitlines()[0]
    return ON_THE_CHIP not in first and (libtpu or NEEDS_LIBTPU not in first)


def run_page(page, capsys, libtpu, only=None):
    """Runs `page`'s blocks that run here, in order (`only`: those indices alone, and
    the blocks they continue), each output shown checked."""
    namespace: dict = {}
    blocks = scripts(page)
    codes = [code for code, _ in blocks]
    for i, (code, expected) in enumerate(blocks):
        if not code.startswith("# continues"):
            namespace = {}
        elif i == 0:
            pytest.fail(f"{_id(page)}: its first block cannot continue another")
        needed = only is None or any(j >= i and _chain(codes, i, j) for j in only)
        if not _runs_here(code, libtpu) or not needed:
            compile(code, str(page), "exec")  # run elsewhere: its syntax checked here
            continue
        exec(compile(code, str(page), "exec"), namespace)
        got = capsys.readouterr().out
        if expected is not None:
            assert _same(expected, got), f"{_id(page)} block {i} printed:\n{got}\nnot:\n{expected}"


def _chain(codes, i, j):
    """Whether block `j` of a page's `codes` continues block `i` (through the ones
    between)."""
    return all(code.startswith("# continues") for code in codes[i + 1 : j + 1])


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_runs_and_shows_what_it_prints(page, capsys):
    run_page(page, capsys, libtpu=False)


LIBTPU_BLOCKS = {
    page: [i for i, (code, _) in enumerate(scripts(page)) if NEEDS_LIBTPU in code.splitlines()[0]]
    for page in PAGES
}


@pytest.mark.skipif(not has_compiler("tpu"), reason="needs pip install 'spmdtree[tpu]'")
@pytest.mark.parametrize("page", [p for p in PAGES if LIBTPU_BLOCKS[p]], ids=_id)
def test_blocks_that_compile_with_libtpu_run_and_show_what_they_print(
    page, capsys, tmp_path, monkeypatch
):
    """Where the blocks read a file the chip wrote (the VM's chip.json), they read the
    one it recorded, copied into a folder of their own."""
    for name, recorded in RECORDED.get(page.name, {}).items():
        (tmp_path / name).write_bytes(recorded.read_bytes())
    monkeypatch.chdir(tmp_path)
    run_page(page, capsys, libtpu=True, only=LIBTPU_BLOCKS[page])


def test_the_chips_blocks_are_the_ones_benchmarks_chip_runs():
    """Every block "on the TPU VM", on every page, is one benchmarks/chip.py's
    ``recipe`` runs on the chip (the page's recipe: its shared definitions and those
    blocks); no block is marked both for the chip and for a laptop's libtpu."""
    ran = chip.recipe_blocks()
    on_chip = []
    for page in PAGES:
        for code, _ in scripts(page):
            first = code.splitlines()[0]
            assert not (ON_THE_CHIP in first and NEEDS_LIBTPU in first), first
            on_chip += [code] if ON_THE_CHIP in first else []
    assert on_chip and all(code in ran for code in on_chip)
    codes = [code for code, _ in scripts(ROOT / "docs" / "planning.md")]
    assert all(code in codes and NEEDS_LIBTPU not in code.splitlines()[0] for code in ran)


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
