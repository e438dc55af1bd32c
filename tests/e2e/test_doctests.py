"""The runnable examples in docstrings stay runnable."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "flexfa.ir.printer",
    "flexfa.ir.simplify",
    "flexfa.ir.evaluate",
    "flexfa.ir.autodiff",
    "flexfa.frontend.trace",
    "flexfa.frontend.bound",
    "flexfa.reference",
    "flexfa.mods",
    "flexfa.masks",
    "flexfa.merge",
    "flexfa.paged",
    "flexfa.codegen.cute.plan",
    "flexfa.codegen.cute.sparse",
    "flexfa.codegen.triton.scatter",
    "flexfa.blockmask.block_mask",
    "flexfa.backends.fa4",
    "flexfa.torch_options",
    "flexfa.runtime.persist",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    assert result.attempted > 0
