"""The common issues of upstream's own migrator skill (cann-recipes-infer
.agents/skills/model-infer-migrator/references/common_issues.md), as rules.

1. a models/<name>/models/__init__.py shadows the repository's `models` namespace: the
   `models_init_shadows_package` rule (agent.repair_rules.files) removes it;
2. the decode step keeps the prefill causal mask (`forward_metadata.attention_mask`):
   aclnnFusedInferAttentionScoreV3 rejects `batchSize[2048] of atten_mask != batchSize[1] of query`;
3. infer.sh does not put the repository root on PYTHONPATH, so a sibling model (`models.gpt_oss`)
   imported by executor/core/support_models.py is not found;
4. a MoE / quantized model class without `process_weights_after_loading`: the framework skips the
   weight repacking and aclnnGroupedMatmul reports `Dim 1 mismatch`;
5. per-rank MoE buffers sized by the global `scheduler_config.batch_size` instead of
   `batch_size_per_dp_rank`: aclnnMoeInitRouting reports `row_idx shape mismatch` (graph mode).

Each fix is a codemod (agent.codemods.repair) or a one-line infer.sh edit, applied only where the
recipe has the pattern the issue names.
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.codemods.repair import (AddProcessWeightsAfterLoadingCommand, DecodeAttentionMaskCommand,
                                   PerRankBatchSizeCommand, codemod, rewrite_file)
from agent.failure import Failure
from agent.repair_rules.code import recipe_py_files
from agent.repair_rules.rule import RepairContext, Rule

_OUT = ("error", "output", "log")


def _files_a_codemod_changes(failure: Failure, commands, needle: str) -> list[str]:
    return [str(p.relative_to(failure.recipe_dir)) for p in recipe_py_files(failure.recipe_dir)
            if needle in p.read_text(errors="replace") and rewrite_file(p, commands, dry_run=True)]


def _codemod_fix(commands, what: str):
    def fix(failure: Failure, facts: dict, ctx: RepairContext) -> str:
        for rel in facts["files"]:
            rewrite_file(failure.recipe_dir / rel, commands)
        return f"{what} in {', '.join(facts['files'])}"
    return fix


# ---- 2. decode keeps the prefill attention mask ------------------------------------------------
_DECODE_MASK = re.compile(r"batchSize\[\d+\] of atten_mask != batchSize\[\d+\] of query")


def _decode_mask_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_a_codemod_changes(failure, (DecodeAttentionMaskCommand,), "attention_mask")
    return {"files": files} if files else None


# ---- 3. the repository root is not on PYTHONPATH ---------------------------------------------------
# a sibling model (models.gpt_oss, imported by executor/core/support_models.py), or the shared executor itself
_SIBLING_MISSING = re.compile(r"No module named '(?P<sibling>models\.\w+|executor|module)'")
_REPO_ON_PATH = re.compile(r"^\s*(?:export\s+)?PYTHONPATH=.*(?:/\.\./\.\.|recipes_path|REPO_ROOT)", re.M)


def _repo_root_facts(failure: Failure, found: re.Match) -> dict | None:
    from agent.foreign import find_repo_root

    recipe = failure.recipe_dir.resolve()
    root = find_repo_root(recipe)
    infer_sh = recipe / "infer.sh"
    sibling = found.group("sibling")
    if root is None or recipe.parent != root / "models" or not infer_sh.is_file():
        return None
    if (recipe / "models" / "__init__.py").exists() or not (root / sibling.replace(".", "/")).is_dir():
        return None     # issue 1 (the shadowing __init__.py) first; a sibling that does not exist is not this
    text = infer_sh.read_text(errors="replace")
    if _REPO_ON_PATH.search(text):
        return None
    return {"sibling": sibling, "script_path": "SCRIPT_PATH=" in text}


def _fix_repo_root(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    from agent.repair_rules._util import read_source, write_source
    from agent.repair_rules.files import _python_line

    infer_sh = failure.recipe_dir / "infer.sh"
    original = infer_sh.read_bytes()
    lines = read_source(infer_sh).splitlines(keepends=True)
    line = ('export PYTHONPATH="${SCRIPT_PATH}/../..:${PYTHONPATH}"\n' if facts["script_path"] else
            'export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"\n')
    at = _python_line(lines)
    at = len(lines) if at is None else at
    # after the set_env / function.sh lines, as the issue says: right before the line that runs Python
    lines.insert(at, line)
    write_source(infer_sh, "".join(lines), original)
    return f"infer.sh exports the repository root on PYTHONPATH ({facts['sibling']} is in the repository)"


# ---- 4. no process_weights_after_loading ---------------------------------------------------------
_GROUPED_MATMUL = re.compile(r"aclnnGroupedMatmul\S*.*Dim 1 mismatch|GroupedMatmul.*[Dd]im 1 mismatch")
_MODEL_CLASS = re.compile(r"^class (\w+ForCausalLM)\b", re.M)


def _process_weights_facts(failure: Failure, found: re.Match) -> dict | None:
    for path in recipe_py_files(failure.recipe_dir):
        text = path.read_text(errors="replace")
        for name in _MODEL_CLASS.findall(text):
            command = codemod(AddProcessWeightsAfterLoadingCommand, class_name=name)
            if rewrite_file(path, (command,), dry_run=True):
                return {"file": str(path.relative_to(failure.recipe_dir)), "class": name}
    return None


def _fix_process_weights(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    rewrite_file(failure.recipe_dir / facts["file"],
                 (codemod(AddProcessWeightsAfterLoadingCommand, class_name=facts["class"]),))
    return (f"{facts['class']} ({facts['file']}) has process_weights_after_loading: the framework now repacks "
            "MoE / quantized weights after loading")


# ---- 5. global batch size for per-rank buffers ---------------------------------------------------
_ROW_IDX = re.compile(r"aclnnMoeInitRouting\S*.*row_idx shape mismatch|MoeInitRouting.*row_idx.*mismatch")


def _per_rank_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_a_codemod_changes(failure, (PerRankBatchSizeCommand,), "scheduler_config")
    return {"files": files} if files else None


RULES: list[Rule] = [
    Rule("decode_keeps_prefill_attention_mask", _DECODE_MASK,
         "the decode step passes the prefill causal mask to the attention kernel (upstream common issue 2)",
         _codemod_fix((DecodeAttentionMaskCommand,), "the attention mask is forward_metadata.attention_mask at "
                                                     "prefill only (None at decode)"),
         facts=_decode_mask_facts, where=_OUT, kind="codemod"),
    Rule("infer_sh_without_repository_root", _SIBLING_MISSING,
         "infer.sh does not put the repository root on PYTHONPATH, so sibling models are not found "
         "(upstream common issue 3)",
         _fix_repo_root, facts=_repo_root_facts, where=_OUT, kind="infer.sh"),
    Rule("process_weights_after_loading_missing", _GROUPED_MATMUL,
         "the model class lacks process_weights_after_loading, so MoE / quantized weights are not repacked "
         "(upstream common issue 4)",
         _fix_process_weights, facts=_process_weights_facts, where=_OUT, kind="codemod"),
    Rule("per_rank_buffers_sized_by_global_batch", _ROW_IDX,
         "per-rank MoE buffers are sized by the global batch_size, not batch_size_per_dp_rank "
         "(upstream common issue 5)",
         _codemod_fix((PerRankBatchSizeCommand,), "per-rank buffers use scheduler_config.batch_size_per_dp_rank"),
         facts=_per_rank_facts, where=_OUT, kind="codemod"),
]

RULE_NAMES = {rule.name for rule in RULES}
__all__ = ["RULES", "RULE_NAMES", "Path"]
