"""Broken recipes handed to `migrator run` (scenario B): the failure is diagnosed in one line, never a
traceback from the migrator itself, and the user's broken file is not lost."""

from __future__ import annotations

import pytest

from migrator_cli import repair_run

BROKEN_YAML = {
    "list_valued": (b"- a\n- b\n", "top level must be a mapping"),
    "invalid": (b"model_name: [\n", "not valid YAML at line 2"),
}


# A YAML no repair can fix (bytes that are not UTF-8, an alias bomb, duplicate keys) is refused in
# pre-flight instead (exit 2, tests/e2e/test_bad_input.py's recipe_yaml_* rows).
@pytest.mark.parametrize("kind", sorted(BROKEN_YAML))
def test_broken_recipe_yaml_is_diagnosed_not_crashed(working_recipe, kind):
    raw, says = BROKEN_YAML[kind]
    yaml_file = next((working_recipe / "config").glob("*.yaml"))
    yaml_file.write_bytes(raw)
    proc, summary, report = repair_run(working_recipe, "--max-rounds", "1")
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert summary["status"] == "failed" and says in summary["message"], summary
    assert report["rounds"][0]["diagnosis"]["error"].startswith("engine.launch: error:")
    assert yaml_file.read_bytes() == raw or (working_recipe / ".migrator" / "backup").is_dir()
