"""The codemod cache returns what the codemods return, and misses when anything they depend on changes."""

from __future__ import annotations

from pathlib import Path

import agent.codemods.vendor
from agent.migrate import codemod_cache
from agent.codemods.vendor import CODEMODS, apply_codemods

SOURCE = "from .configuration_x import XConfig\nimport torch\n\nclass XModel(torch.nn.Module):\n    pass\n"


def test_cache_hit_equals_fresh_result_and_skips_the_work(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return apply_codemods(*args, **kwargs)

    files = [Path(agent.codemods.vendor.__file__)]
    siblings = {"pkg.configuration_x": "models.configuration_x"}
    first = codemod_cache.cached(counting, SOURCE, "pkg", siblings, CODEMODS, files)
    second = codemod_cache.cached(counting, SOURCE, "pkg", siblings, CODEMODS, files)
    assert first == second == apply_codemods(SOURCE, package="pkg", sibling_modules=siblings, codemods=CODEMODS)
    assert "models.configuration_x" in first[0]
    assert len(calls) == 1
    # Another source, another sibling map, another codemod list: a miss each.
    codemod_cache.cached(counting, SOURCE + "\n", "pkg", siblings, CODEMODS, files)
    codemod_cache.cached(counting, SOURCE, "pkg", {}, CODEMODS, files)
    codemod_cache.cached(counting, SOURCE, "pkg", siblings, CODEMODS[:1], files)
    assert len(calls) == 4


def test_corrupt_entry_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    files = [Path(agent.codemods.vendor.__file__)]
    result = codemod_cache.cached(apply_codemods, SOURCE, "pkg", {}, CODEMODS, files)
    for entry in codemod_cache.cache_dir().glob("*.json"):
        entry.write_text('{"code": 5}')
    assert codemod_cache.cached(apply_codemods, SOURCE, "pkg", {}, CODEMODS, files) == result
