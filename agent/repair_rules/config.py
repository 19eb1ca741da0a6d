"""Rules about the recipe YAML: paths, keys, types, dtypes, lengths, devices."""

from __future__ import annotations

import re

from agent.repair import Failure, RepairContext, Rule
from agent.repair_rules._util import edit_yaml_line, load_yaml

_DTYPE_UNSUPPORTED = re.compile(
    r"not implemented for '(BFloat16|Half)'|does not support (bfloat16|float16)|"
    r"(BFloat16|Half) is not supported", re.I)


def _match_dtype(failure: Failure) -> dict | None:
    if not _DTYPE_UNSUPPORTED.search(failure.output):
        return None
    dtype = (load_yaml(failure.recipe_dir).get("model_config") or {}).get("dtype")
    return {"dtype": dtype} if dtype in ("bfloat16", "float16") else None


def _fix_dtype(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    return edit_yaml_line(failure.recipe_dir, "model_config", "dtype", "float32")


RULES: list[Rule] = [
    Rule("dtype_unsupported_on_device", "the configured dtype cannot run on this device",
         _match_dtype, _fix_dtype, kind="yaml"),
]
