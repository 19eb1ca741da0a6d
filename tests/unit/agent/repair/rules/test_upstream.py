"""Upstream's own common issues (model-infer-migrator references/common_issues.md) as rules
(agent/repair/rules/upstream.py): each rule taking the phenomenon the document names on a recipe that
has the pattern, then fixing it so the rule no longer matches. Each fix's codemod and its CodemodTest:
tests/unit/agent/codemods/commands/."""

from __future__ import annotations

import subprocess

import pytest

from agent.repair.diagnose import first_matching_rule
from agent.repair.failure import Failure
from agent.repair.rules.rule import RepairContext


ATTENTION = '''import torch


class QwenAttention(torch.nn.Module):
    def forward(self, hidden_states, forward_metadata):
        atten_mask = forward_metadata.attention_mask
        return hidden_states
'''
MODEL = '''import torch


class QwenMoeForCausalLM(torch.nn.Module):
    def __init__(self, config, infer_config):
        super().__init__()
        bs = infer_config.scheduler_config.batch_size
        self.row_idx_decode = torch.zeros(bs, 8)
'''
# The phenomena as common_issues.md quotes them (NPU kernels: replayed here).
LOGS = {
    "decode_keeps_prefill_attention_mask": "RuntimeError: aclnnFusedInferAttentionScoreV3 failed: batchSize[2048] "
                                           "of atten_mask != batchSize[1] of query\n",
    "process_weights_after_loading_missing": "RuntimeError: aclnnGroupedMatmul failed: Dim 1 mismatch (2816 vs 1408)\n",
    "per_rank_buffers_sized_by_global_batch": "RuntimeError: aclnnMoeInitRouting: row_idx shape mismatch\n",
}


@pytest.fixture
def repo(tmp_path):
    """A cann-recipes-infer-shaped tree with a framework model folder and a sibling model."""
    root = tmp_path / "cann-recipes-infer"
    (root / "executor" / "scripts").mkdir(parents=True)
    (root / "executor" / "scripts" / "infer.sh").write_text("#!/bin/bash\n")
    (root / "models" / "gpt_oss" / "models").mkdir(parents=True)
    recipe = root / "models" / "qwen"
    (recipe / "models").mkdir(parents=True)
    (recipe / "config").mkdir()
    (recipe / "config" / "qwen.yaml").write_text("model_config:\n  model_name: qwen\n")
    (recipe / "models" / "modeling_qwen.py").write_text(ATTENTION + "\n\n" + MODEL)
    return recipe


@pytest.mark.parametrize("rule", sorted(LOGS))
def test_common_issue_rule_takes_its_phenomenon_and_fixes_it(repo, rule):
    failure = Failure.from_output(repo, LOGS[rule])
    matched, facts = first_matching_rule(failure)
    assert matched.name == rule, matched.name
    before = (repo / "models" / "modeling_qwen.py").read_text()
    matched.fix(failure, facts, RepairContext())
    after = (repo / "models" / "modeling_qwen.py").read_text()
    assert after != before
    compile(after, "modeling_qwen.py", "exec")
    again = first_matching_rule(Failure.from_output(repo, LOGS[rule]))
    assert again is None or again[0].name != rule                      # fixed: not proposed again


def test_sibling_model_not_found_puts_the_repository_root_on_pythonpath(repo):
    """Issue 3: infer.sh written without the export; the fix adds it before the Python line, and the
    script then finds models.gpt_oss from any working directory."""
    root = repo.parent.parent
    (root / "models" / "gpt_oss" / "models" / "modeling_gpt_oss.py").write_text("NAME = 'gpt_oss'\n")
    infer_sh = repo / "infer.sh"
    infer_sh.write_text('#!/bin/bash\nSCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)\n'
                        'cd "$SCRIPT_PATH"\npython3 -c "import models.gpt_oss.models.modeling_gpt_oss as m; print(m.NAME)"\n')
    run = subprocess.run(["bash", str(infer_sh)], capture_output=True, text=True, cwd=root.parent)
    assert run.returncode != 0 and "No module named 'models.gpt_oss'" in run.stderr
    failure = Failure.from_output(repo, run.stderr)
    matched, facts = first_matching_rule(failure)
    assert matched.name == "infer_sh_without_repository_root", matched.name
    matched.fix(failure, facts, RepairContext())
    assert 'export PYTHONPATH="${SCRIPT_PATH}/../..:${PYTHONPATH}"\n' in infer_sh.read_text()
    run = subprocess.run(["bash", str(infer_sh)], capture_output=True, text=True, cwd=root.parent)
    assert run.returncode == 0 and run.stdout.strip() == "gpt_oss", run.stderr
    # Issue 1 first: with a shadowing models/__init__.py the rule that removes it takes the failure.
    (repo / "models" / "__init__.py").write_text("")
    assert first_matching_rule(Failure.from_output(repo, "ModuleNotFoundError: No module named 'models.gpt_oss'\n"))[0] \
        .name == "models_init_shadows_package"
