"""Rules about the recipe's files and layout: packages, PYTHONPATH, missing or corrupt files."""

from __future__ import annotations

import re

from agent.repair import Failure, RepairContext, Rule


def _match_models_init(failure: Failure) -> dict | None:
    init = failure.recipe_dir / "models" / "__init__.py"
    if init.is_file() and re.search(r"models/__init__\.py|No module named 'models[.']|'models' is not a package",
                                    failure.output):
        return {"file": "models/__init__.py"}
    return None


def _fix_models_init(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    # The recipe's models/ is a namespace package: an __init__.py copied from elsewhere
    # (often importing modules this recipe does not have) shadows it. Backed up, then removed.
    (failure.recipe_dir / facts["file"]).unlink()
    return "removed models/__init__.py (models/ is a namespace package in a recipe)"


RULES: list[Rule] = [
    Rule("models_init_shadows_package",
         "a models/__init__.py shadows the recipe's models package",
         _match_models_init, _fix_models_init, kind="remove"),
]
