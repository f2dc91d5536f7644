"""One figure, one value; and every ratio says what it divides.

The pages are README.md, every docs/*.md and CHANGELOG.md. Of the
CHANGELOG only the newest version's section is read (from its first "## "
heading to the next): an older version's section records what that version
measured and said (0.7's "1.111x and 1.074x" beside 0.6's "1.037x and
1.071x", 0.7's blocked steps at 0.99-1.06x), and is history, not a figure to
keep in step with today's pages.

FIGURES names each figure quoted on two pages or more, with the patterns
that find it by its context wherever a page quotes it. A pattern's spaces
match any run of whitespace, line breaks included, as a page wraps its
lines. Where one page rounds a figure another gives in full (1.57x in the
README, 1.573 in docs/planning.md's table), every quote is read at the
rounded digits. Two ranges are read off docs/planning.md's measured blocks,
which quote no range: the decoders' and the corpus's ratios on the
calibrated v5e, the least and the largest of each block's calibrated column.

A figure on one page only is not in FIGURES: the check that each is found
on two pages is what keeps a reworded page from passing by finding nothing.

Pure text: no jax import, no benchmark run.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

# "predicted / measured time" (below 1 is optimistic) or "predicted /
# published throughput" (above 1 is optimistic), however a page wraps it.
LABEL = re.compile(r"predicted\s*/\s*(measured|published)")


class Figure(NamedTuple):
    """A figure, whether it is a ratio that must be labelled, and where pages quote it.

    finds: (pattern, read) pairs; read takes a match to the value quoted.
    """

    name: str
    ratio: bool
    finds: list[tuple[str, Callable[[re.Match], str]]]


def pages():
    """{name: text} of every page, the CHANGELOG cut to its newest section."""
    found = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted((ROOT / "docs").glob("*.md")):
        found[f"docs/{path.name}"] = path.read_text()
    sections = re.split(r"(?m)^(?=## )", (ROOT / "CHANGELOG.md").read_text())
    # The lines before the newest section stay as blank lines, so that a line
    # number in a message is the file's own.
    found["CHANGELOG.md"] = "\n" * sections[0].count("\n") + sections[1]
    return found


def group(n=1, digits=None):
    """A reader: the match's group n, as written or rounded to `digits` decimals."""

    def read(match):
        value = match.group(n)
        return value if digits is None else f"{float(value):.{digits}f}"

    return read


def calibrated_range(rows, ratio):
    """A reader: the least and the largest ratio of a block's rows, as "0.87-1.07"."""

    def read(match):
        ratios = [float(ratio(row)) for row in rows(match.group(1))]
        return f"{min(ratios):.2f}-{max(ratios):.2f}"

    return read


# benchmarks/measured.py's block: each row ends with its ratio on the
# calibrated chip ("311.1 ms   0.92x").
DECODER_ROWS = calibrated_range(
    lambda block: [line for line in block.splitlines() if line.strip()],
    lambda row: re.search(r"(\d+\.\d+)x\s*$", row).group(1),
)
# benchmarks/corpus.py's table: the fourth cell is the ratio on the
# calibrated chip.
CORPUS_ROWS = calibrated_range(
    lambda block: block.splitlines(),
    lambda row: row.split("|")[4].strip(),
)

RANGE = r"(\d\.\d+-\d\.\d+)"
MAXTEXT_PAIR = (
    r"(\d\.\d+)x and (\d\.\d+)x MaxText's TPU throughput \(16B on a v5e-256, 128B on a v5p-256\)"
)
TORCHTITAN_PAIR = r"the prediction is (\d\.\d+)x and (\d\.\d+)x torchtitan's published"

FIGURES = [
    Figure(
        "MaxText 16B on a v5e-256, predicted / published TFLOP/s per chip",
        True,
        [
            (r"16B on a v5e-256 at (\d\.\d+)x", group()),
            (r"MaxText 16B, v5e-256, FSDP [\d,]+ [\d,]+ (\d\.\d+)", group()),
            (r"\| MaxText 16B, v5e-256, FSDP [^|\n]*\|[^|\n]*\|[^|\n]*\| (\d\.\d+) \|", group()),
            (MAXTEXT_PAIR, group(1)),
        ],
    ),
    Figure(
        "MaxText 128B on a v5p-256, predicted / published TFLOP/s per chip",
        True,
        [
            (r"128B on a v5p-256 at (\d\.\d+)x", group()),
            (r"v5p-256 \(FSDP 16 x TP 8\) at (\d\.\d+)x", group()),
            (r"MaxText 128B, v5p-256, FSDP 16 x TP 8 [\d,]+ [\d,]+ (\d\.\d+)", group()),
            (
                r"\| MaxText 128B, v5p-256, FSDP 16 x TP 8 [^|\n]*\|[^|\n]*\|[^|\n]*\| (\d\.\d+) \|",
                group(),
            ),
            (MAXTEXT_PAIR, group(2)),
        ],
    ),
    Figure(
        "torchtitan Llama 3.1 8B on 8 H100s (FSDP), predicted / published tokens/s",
        True,
        [
            (r"(\d\.\d+)x \(FSDP over 8\)", group(digits=2)),
            (r"torchtitan Llama 3\.1 8B, 8 x H100, FSDP [\d,]+ [\d,]+ (\d\.\d+)", group(digits=2)),
            (
                r"\| torchtitan, Llama 3\.1 8B, 8 x H100, FSDP, torch\.compile \|[^|\n]*\|[^|\n]*\| (\d\.\d+) \|",
                group(digits=2),
            ),
            (TORCHTITAN_PAIR, group(1, digits=2)),
        ],
    ),
    Figure(
        "torchtitan Llama 3 8B on 64 H100s (FSDP 8 x TP 8), predicted / published tokens/s",
        True,
        [
            (r"(\d\.\d+)x \(FSDP 8 x TP 8\)", group(digits=2)),
            (
                r"torchtitan Llama 3 8B, 64 x H100, FSDP 8 x TP 8 [\d,]+ [\d,]+ (\d\.\d+)",
                group(digits=2),
            ),
            (
                r"\| torchtitan, Llama 3 8B, 64 x H100, FSDP 8 x TP 8 \|[^|\n]*\|[^|\n]*\| (\d\.\d+) \|",
                group(digits=2),
            ),
            (TORCHTITAN_PAIR, group(2, digits=2)),
        ],
    ),
    Figure(
        "torchtitan's H100 runs, the range of predicted / published tokens/s",
        True,
        [
            (rf"Llama 3 8B runs on H100s at {RANGE}x", group()),
            (rf"{RANGE}x torchtitan's GPU throughput", group()),
        ],
    ),
    Figure(
        "the decoders on the calibrated v5e, the range of predicted / measured time",
        True,
        [
            (rf"tokens\) were predicted at {RANGE}", group()),
            (rf"{RANGE}x on the calibrated chip", group()),
            (
                r"step measured tpu-v5e tpu-v5e, calibrated\n((?:[^\n]*\n)*?)tpu-v5e: mean",
                DECODER_ROWS,
            ),
        ],
    ),
    Figure(
        "the corpus of families on the calibrated v5e, the range of predicted / measured time",
        True,
        [
            (rf"lands at {RANGE}", group()),
            (rf"a corpus of other families {RANGE}x", group()),
            (
                r"\| family \| measured \| tpu-v5e, calibrated \| ratio \|[^\n]*\n\|[^\n]*\n((?:\|[^\n]*\n)+)",
                CORPUS_ROWS,
            ),
        ],
    ),
    Figure(
        "the decoders on the calibrated v5e, mean |predicted / measured - 1|",
        False,
        [
            (r"(\d+\.\d+)% off on average", group()),
            (r"tpu-v5e, calibrated: mean \|ratio - 1\| (\d+\.\d+)%", group()),
            (r"is met: a mean of (\d+\.\d+)%", group()),
        ],
    ),
    Figure(
        "the published runs' goal",
        False,
        [
            (r"outside the (\d+)% goal", group()),
            (r"within the \+-(\d+)% goal", group()),
        ],
    ),
    Figure(
        "a MoE combine's scatter counted as tiles: priced, and measured",
        False,
        [
            (r"priced at (\d+ ms) and ran in (\d+ us)", lambda m: f"{m.group(1)}, {m.group(2)}"),
            (r"priced a (\d+ us) scatter at (\d+ ms)", lambda m: f"{m.group(2)}, {m.group(1)}"),
        ],
    ),
    Figure(
        "the tpu-v5e preset's memory",
        False,
        [
            (r"what libtpu allows on the chip, (\d+\.\d+ GiB)", group()),
            (r"\| `tpu-v5e` \| [\d,]+ B \((\d+\.\d+ GiB)\)", group()),
            (r"ran on the (\d+\.\d+ GiB) chip", group()),
        ],
    ),
    Figure(
        "a TPU v5e kernel's fixed cost, as calibrate measured it",
        False,
        [
            (r"0\.\d+ us on a TPU v5e", lambda m: m.group(0).split()[0]),
            (r"\| `launch_seconds` \| (\S+) us \|", group()),
            (r"each ran (\S+) us beyond its work", group()),
        ],
    ),
    Figure(
        "the wait for HBM's first access on a TPU v5e, as calibrate measured it",
        False,
        [
            (r"a TPU v5e's (\d\.\d+) us", group()),
            (r"\| `access_seconds` \| (\S+) us \|", group()),
            (r"each took (\S+) us beyond its work and launch", group()),
        ],
    ),
    Figure(
        "how long st.calibrate takes",
        False,
        [
            (r"own figures in about a\s+(minute)\.", group()),
            (r"### A chip calibrated in a (minute)", group()),
            (r"Calibrate \(about a (minute)\)", group()),
        ],
    ),
    Figure(
        "calibrate's grid's row counts and their range",
        False,
        [
            (
                r"measures it \((\d+) row\s+counts, (64 to \d{1,3}(?:,\d{3})*)",
                lambda m: f"{m.group(1)}, {m.group(2)}",
            ),
            (
                r"The grid is every m of \(64, 128, 512, 2,048, 8,192\)",
                lambda m: "5, 64 to 8,192",
            ),
        ],
    ),
    Figure(
        "a deviceless XLA GPU compile's peak against a real H200's",
        False,
        [
            (r"within (\d+)% of a real H200's peak", group()),
            (r"within (\d+)% in all five", group()),
        ],
    ),
]


def quotes(texts):
    """{figure name: [(page, line, value)]}: every quote of every figure."""
    found = {figure.name: [] for figure in FIGURES}
    for figure in FIGURES:
        for pattern, read in figure.finds:
            for page, text in texts.items():
                for match in re.finditer(pattern.replace(" ", r"\s+"), text):
                    line = text.count("\n", 0, match.start()) + 1
                    found[figure.name].append((page, line, read(match)))
    return found


def disagreements(texts):
    """A sentence for each figure found on fewer than two pages or with two values."""
    problems = []
    for name, found in quotes(texts).items():
        where = ", ".join(f"{page}:{line} has {value}" for page, line, value in found)
        if len({page for page, _, _ in found}) < 2:
            problems.append(f"{name!r} is found on fewer than two pages ({where or 'none'})")
        elif len({value for _, _, value in found}) > 1:
            problems.append(f"{name!r} has more than one value: {where}")
    return problems


def test_every_figure_has_one_value_on_every_page():
    """Each figure in FIGURES is on two pages or more, with the same value on each."""
    problems = disagreements(pages())
    assert not problems, "\n".join(problems)


def test_a_figure_changed_on_one_page_is_caught():
    """The check can fail: one page's MaxText v5e figure changed is said, with each page and its value."""
    texts = pages()
    texts["README.md"] = texts["README.md"].replace(
        "16B on a v5e-256 at 1.111x", "16B on a v5e-256 at 1.121x"
    )
    problems = disagreements(texts)
    assert len(problems) == 1
    assert "MaxText 16B on a v5e-256" in problems[0]
    assert "README.md:" in problems[0] and "has 1.121" in problems[0]
    assert "docs/planning.md:" in problems[0] and "has 1.111" in problems[0]


def blocks(text):
    """The page's paragraphs and tables: runs of non-blank lines, each a list of (line number, line).

    Fenced code is left out: it is a program's output, checked against the
    program, and its columns are named by the program.
    """
    found, block, fenced = [], [], False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        if fenced or not line.strip():
            if block:
                found.append(block)
            block = []
            continue
        block.append((number, line))
    if block:
        found.append(block)
    return found


PUBLISHED_RUN = re.compile(r"MaxText|torchtitan|Mixtral")
TIMES = re.compile(r"\b\d+\.\d+x")
# The words after "N.NNx" that say what it divides: "1.25x ours", "1.9x a
# bare compile", "1.57x torchtitan's published rates".
OWN_DENOMINATOR = re.compile(r"\s*(ours|a |an |the |its |their |libtpu|MaxText's|torchtitan's)")


def unlabelled(texts):
    """Each line that quotes a ratio with no label in its paragraph, or in its table row and header.

    The lines checked: each line where a quote of a ratio in FIGURES
    starts, and each line with an "N.NNx" in a paragraph (a table: a row)
    that names MaxText, torchtitan or Mixtral, but for an "N.NNx" that
    names what it divides ("1.25x ours").
    """
    ratios = {figure.name for figure in FIGURES if figure.ratio}
    starts = {
        (page, line)
        for name, found in quotes(texts).items()
        if name in ratios
        for page, line, _ in found
    }
    problems = []
    for page, text in texts.items():
        for block in blocks(text):
            table = block[0][1].lstrip().startswith("|")
            paragraph = "\n".join(line for _, line in block)
            for number, line in block:
                run = PUBLISHED_RUN.search(line if table else paragraph) and any(
                    not OWN_DENOMINATOR.match(line, times.end()) for times in TIMES.finditer(line)
                )
                if (page, number) not in starts and not run:
                    continue
                scope = f"{block[0][1]}\n{line}" if table else paragraph
                if not LABEL.search(scope):
                    problems.append(f"{page}:{number}: {line.strip()[:120]}")
    return problems


def test_every_ratio_says_what_it_divides():
    """Each ratio figure quoted, and each "N.NNx" of a published run, says predicted / measured or published."""
    problems = unlabelled(pages())
    assert not problems, (
        "ratios with no 'predicted / measured' or 'predicted / published':\n" + "\n".join(problems)
    )


def test_a_label_removed_is_caught():
    """The check can fail: with the labels taken out of README.md and docs/api.md, their ratios are said."""
    texts = pages()
    for page in ("README.md", "docs/api.md"):
        texts[page] = re.sub(
            r"\(predicted\s*/\s*(measured time|published throughput)\)", "", texts[page]
        )
    problems = unlabelled(texts)
    assert any(problem.startswith("README.md:") for problem in problems)
    assert any(problem.startswith("docs/api.md:") for problem in problems)
