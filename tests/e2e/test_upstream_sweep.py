"""scripts/upstream_standin_sweep.py: one row per model folder of a cann-recipes-infer checkout under the
stand-in. The default suite runs it on two quick folders of a snapshot copy (one that is not a recipe,
one that imports a compiled custom op); the full sweep is a documented script run (see the note)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from locations import REPO_ROOT
from upstream_checkout import copy_snapshot

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import upstream_standin_sweep as sweep  # noqa: E402


@pytest.mark.parametrize("rc,stderr,summary,want", [
    (0, "", {}, "baseline+parity"),
    (1, "", {"message": "parity check failed: the recipe diverges from transformers at decoder layer 1"},
     "located mismatch"),
    (1, "", {"message": "failed: x — a torch.distributed call ran without an initialised process group"}, "exit 1"),
    (4, "migrator: error: needs an Ascend NPU: torch_npu.npu_foo has no reference kernel", {}, "exit 4"),
    (None, "[migrator] classify ...", {}, "timeout"),
])
def test_outcome_of_a_run(rc, stderr, summary, want):
    assert sweep.outcome(rc, stderr, summary) == want


def test_the_answer_line_is_the_error_line_not_a_progress_bar():
    err = ("[migrator] classify ...\nmigrator: error: needs an Ascend NPU: X has no reference kernel\n"
           "Writing model shards: 100%|##########| 1/1 [00:00<00:00, 41.52it/s]\n")
    assert sweep._last_line(err) == "migrator: error: needs an Ascend NPU: X has no reference kernel"


def test_sweep_gives_each_folder_its_row_and_leaves_the_checkout_alone(tmp_path):
    checkout = copy_snapshot(tmp_path / "cann-recipes-infer")
    (checkout / "models" / "readme_only").mkdir()
    (checkout / "models" / "readme_only" / "README.md").write_text("# weights and code elsewhere\n")
    shutil.copytree(checkout / "models" / "qwen", checkout / "models" / "qwen_ascendc")
    modeling = checkout / "models" / "qwen_ascendc" / "models" / "modeling_qwen.py"
    modeling.write_text(modeling.read_text().replace("import torch\n", "import torch\nimport custom_ops\n", 1))
    before = sorted(p.relative_to(checkout).as_posix() for p in checkout.rglob("*"))
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "upstream_standin_sweep.py"), str(checkout),
                           "--models", "readme_only", "qwen_ascendc", "--timeout", "300", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["readme_only"]["outcome"] == "exit 2" and "no config/*.yaml" in rows["readme_only"]["line"]
    assert rows["qwen_ascendc"]["outcome"] == "exit 4"
    assert "import custom_ops (AscendC) at models/qwen_ascendc/models/modeling_qwen.py:" in rows["qwen_ascendc"]["line"]
    table = proc.stdout.splitlines()
    assert table[0] == "| model | ranks | outcome | s | answer |" and len(table) == 4
    assert sorted(p.relative_to(checkout).as_posix() for p in checkout.rglob("*")) == before   # ran on a copy
