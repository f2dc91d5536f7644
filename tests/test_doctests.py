"""Every example in a docstring runs, as a doctest, in the test command: the public
names' and every module's."""

import doctest
import importlib
import pkgutil

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


MODULES = sorted(
    m.name for m in pkgutil.walk_packages(spmdtree.__path__, "spmdtree.") if not m.ispkg
)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_example_runs(name):
    # the private rooms' examples too (new in 0.6: only the public ones ran, and one
    # had gone stale): each is the quickest check of the idea it illustrates
    failures, _ = doctest.testmod(
        importlib.import_module(name), optionflags=FLAGS, verbose=False, report=True
    )
    assert failures == 0, f"{failures} doctest(s) failed in {name}"
