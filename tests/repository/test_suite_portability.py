"""The suite runs anywhere: what needs a download skips, offline, with the reason and the way to provide it."""

from __future__ import annotations

import sys

import pytest

import transformers_tests


def test_mixins_skip_offline_with_the_reason(tmp_path, monkeypatch):
    """No cached sdist and no reachable index (PIP_NO_INDEX): the mixin module is skipped, saying what is missing
    and how to provide it; DEEPSEEK_V41_REQUIRE_MIXINS=1 turns the skip into an error."""
    monkeypatch.setattr(transformers_tests, "CACHE", tmp_path / "empty-cache")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("DEEPSEEK_V41_REQUIRE_MIXINS", raising=False)
    monkeypatch.delitem(sys.modules, transformers_tests.PACKAGE, raising=False)  # loaded by other test modules
    with pytest.raises(pytest.skip.Exception, match=r"source distribution, which is not cached in .*empty-cache.* "
                                                    r"could not be fetched .*put transformers-5\.24\.0\.tar\.gz into"):
        transformers_tests.load_transformers_tests("test_processing_common")
    monkeypatch.setenv("DEEPSEEK_V41_REQUIRE_MIXINS", "1")
    with pytest.raises(RuntimeError, match="could not be fetched"):
        transformers_tests.load_transformers_tests("test_processing_common")
    assert transformers_tests.PACKAGE not in sys.modules
