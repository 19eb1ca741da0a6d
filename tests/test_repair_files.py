"""Fault injection: recipe files and layout (agent/repair_rules/files.py)."""

from __future__ import annotations

from conftest import assert_repaired, repair_run


def test_models_init_shadowing_the_package_is_removed(working_recipe):
    # In practice: an __init__.py copied from another recipe, importing modules this one lacks.
    init = working_recipe / "models" / "__init__.py"
    init.write_text("from .modeling_deepseek import DeepseekV3ForCausalLM  # copied from another recipe\n")
    injected = {"models/__init__.py": init.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "models_init_shadows_package", injected)
    assert not init.exists()
