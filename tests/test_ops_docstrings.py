"""The Example sections of the op docstrings (python/peagle/ops/<op>.py) run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["paged_attention", "prepare_next_token_ids", "verify_chain", "write_kv_cache"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(f"peagle.ops.{name}")
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
