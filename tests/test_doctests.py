"""Every example in a public docstring runs, as a doctest, in the test command."""

import doctest
import importlib
import pkgutil

import pytest

import spmdtree

MODULES = sorted(info.name for info in pkgutil.iter_modules(spmdtree.__path__, prefix="spmdtree."))


@pytest.mark.parametrize("name", ["spmdtree", *MODULES])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


def test_every_public_name_has_an_example():
    missing = [
        name
        for name in spmdtree.__all__
        if callable(getattr(spmdtree, name))
        and ">>>" not in (getattr(spmdtree, name).__doc__ or "")
    ]
    assert missing == []
