"""The codemod cache returns what the codemods return, and misses when anything they depend on changes."""

from __future__ import annotations

from agent.migrate import codemod_cache
from agent.migrate.vendor import CODEMOD_FILES, apply_codemods

SOURCE = "from .configuration_x import XConfig\nimport torch\n\nclass XModel(torch.nn.Module):\n    pass\n"


def test_cache_hit_equals_fresh_result_and_skips_the_work(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def vendored(source, siblings, runs_model=True):
        def compute():
            calls.append(1)
            return apply_codemods(source, "pkg", siblings, runs_model)
        return codemod_cache.cached(compute, [source, "pkg", repr(sorted(siblings.items())), str(runs_model)],
                                    CODEMOD_FILES)

    siblings = {"pkg.configuration_x": "models.configuration_x"}
    first, second = vendored(SOURCE, siblings), vendored(SOURCE, siblings)
    assert first == second == apply_codemods(SOURCE, "pkg", siblings)
    assert "models.configuration_x" in first[0]
    assert len(calls) == 1
    # Another source, another sibling map, another codemod list: a miss each.
    vendored(SOURCE + "\n", siblings)
    vendored(SOURCE, {})
    vendored(SOURCE, siblings, runs_model=False)
    assert len(calls) == 4
    # The codemods' own code is part of the key.
    changed = tmp_path / "command.py"
    changed.write_text("# another version of a command\n")
    codemod_cache.cached(lambda: calls.append(1) or first, [SOURCE], [*CODEMOD_FILES, changed])
    codemod_cache.cached(lambda: calls.append(1) or first, [SOURCE], CODEMOD_FILES)
    assert len(calls) == 6


def test_corrupt_entry_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = codemod_cache.cached(lambda: apply_codemods(SOURCE, "pkg", {}), [SOURCE], CODEMOD_FILES)
    for entry in codemod_cache.cache_dir().glob("*.json"):
        entry.write_text('{"code": 5}')
    assert codemod_cache.cached(lambda: apply_codemods(SOURCE, "pkg", {}), [SOURCE], CODEMOD_FILES) == result
