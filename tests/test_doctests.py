"""Every example in a public docstring runs, as a doctest, in the test command."""

import doctest

import pytest

import spmdtree

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("name", ["spmdtree", *spmdtree.__all__])
def test_docstring_examples_run(name):
    obj = spmdtree if name == "spmdtree" else getattr(spmdtree, name)
    finder = doctest.DocTestFinder(recurse=isinstance(obj, type))  # a class: its methods too
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(obj, name, globs={}):
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} doctest(s) failed in {name}"


def test_every_public_name_has_an_example():
    missing = [
        name
        for name in spmdtree.__all__
        if callable(getattr(spmdtree, name))
        and ">>>" not in (getattr(spmdtree, name).__doc__ or "")
    ]
    assert missing == []
