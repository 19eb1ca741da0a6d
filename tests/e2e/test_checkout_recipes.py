"""A repository laid out like cann-recipes-infer (tests/support/checkout_fixture.py, a CPU stand-in executor),
driven through the CLI as a user would, with relative paths from the repository root.

Real parts: the CLI in a subprocess, bash, the stand-in's launch (per-rank `python ... | tee &`
then `wait`), transformers on a tiny llama. Faked: only the NPU, which this host does not have,
so the NPU-only recipes end in exit 4 for real."""

from __future__ import annotations

import json

import pytest

from migrator_cli import run_cli
from checkout_fixture import tree_bytes, write_repo

KERNELS = "3 torch_npu kernels (npu_rms_norm, npu_rotary_mul, torch.ops.npu.npu_fused_infer_attention_score) at 3 call sites"
NEEDS_NPU = {
    "npu_legacy": f"needs an Ascend NPU: {KERNELS}; first call: npu_rms_norm at models/modeling_npu_legacy.py:15; "
                  "run on an NPU host",
    "npu_fw": f"needs an Ascend NPU: {KERNELS}; first call: npu_rms_norm at models/modeling_npu_fw.py:15; "
              "run on an NPU host",
}


@pytest.fixture
def repo(tmp_path, tiny_checkpoints):
    root = tmp_path / "cann-recipes-infer"
    write_repo(root, tiny_checkpoints("llama"))
    return root


@pytest.mark.parametrize("command", ["run", pytest.param("classify", marks=pytest.mark.slow),
                                     pytest.param("baseline", marks=pytest.mark.slow)])   # one answer, three commands
def test_npu_only_recipes_end_in_exit_4_byte_identical_on_a_host_without_npu(repo, tmp_path, command):
    before = tree_bytes(repo)
    # (baseline's summary table is the user's requested output: written outside the repository here)
    extra = ["--summary", str(tmp_path / "summary")] if command == "baseline" else []
    for name, message in NEEDS_NPU.items():
        proc = run_cli(command, "models/" + name, *extra, cwd=repo, timeout=300)
        assert proc.returncode == 4, (command, name, proc.stdout, proc.stderr)
        assert "needs an Ascend NPU" in proc.stderr and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    # and with an absolute path from another working directory
    proc = run_cli(command, str(repo / "models" / "npu_fw"), *extra, cwd=tmp_path, timeout=300)
    assert proc.returncode == 4 and NEEDS_NPU["npu_fw"] in proc.stderr
    assert tree_bytes(repo) == before                       # every byte and mode unchanged
    assert not list(repo.rglob(".migrator"))                 # nothing written, not even run records


def test_a_checkpoint_holding_an_infer_sh_is_never_run(repo, tiny_checkpoints, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt_with_script"
    shutil.copytree(tiny_checkpoints("llama"), ckpt)
    (ckpt / "infer.sh").write_text(f"touch {tmp_path / 'it_ran'}\n")
    before = tree_bytes(ckpt)
    proc = run_cli("classify", "ckpt_with_script", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("A: "), proc.stdout + proc.stderr
    assert not (tmp_path / "it_ran").exists()
    assert tree_bytes(ckpt) == before


@pytest.mark.slow
def test_legacy_and_framework_recipes_are_classified_and_baselined(repo):
    # classify: the legacy recipe through its own infer.sh, the framework one through
    # executor/scripts/infer.sh --model fw_llama --yaml ...; from inside the folder with "."
    proc = run_cli("classify", "models/legacy_llama", cwd=repo, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("C: infer.sh present and it runs"), proc.stdout + proc.stderr
    proc = run_cli("classify", ".", cwd=repo / "models" / "fw_llama", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("C: framework recipe run by executor/scripts/infer.sh --model fw_llama "
                                  "--yaml fw_llama_rank_1_eager.yaml and it runs"), proc.stdout
    readme = (repo / "models" / "legacy_llama" / "README.md").read_bytes()

    proc = run_cli("baseline", "models/legacy_llama", "models/fw_llama", "models/npu_fw",
                   "--summary", "res_summary/baselines", cwd=repo, timeout=900)
    # two baselines written; the NPU-only recipe is reported, so the batch ends in exit 4
    assert proc.returncode == 4, proc.stdout + proc.stderr[-3000:]
    assert "| legacy_llama | ok |" in proc.stdout and "| fw_llama | ok |" in proc.stdout
    assert "| npu_fw | needs_npu |" in proc.stdout
    for name, mode in (("legacy_llama", "eager"), ("fw_llama", "eager")):
        data = json.loads((repo / "models" / name / "baseline" / "baseline_metadata.json").read_text())
        assert data["performance"]["prefill_ms"] > 0 and data["performance"]["decode_avg_ms"] > 0
        assert data["performance"]["output_text"]
        assert data["model_config"]["model_name"] == name
        assert data["environment"]["exe_mode"] == mode and data["environment"]["device"] == "cpu"
        assert data["verification"]["all_ranks_success"] is True
        assert data["verification"]["parity"]["checked"] is False           # not this tool's engine
    assert (repo / "models" / "legacy_llama" / "README.md").read_bytes().startswith(readme)


@pytest.mark.slow
def test_a_framework_recipe_whose_python_crashes_is_b_with_the_real_error(repo):
    # upstream's launch ends with `wait`: infer.sh exits 0 although Python crashed
    yaml_path = repo / "models" / "fw_llama" / "config" / "fw_llama_rank_1_eager.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("model_path: \"", "model_path: \"/nonexistent"))
    proc = run_cli("classify", "models/fw_llama", cwd=repo, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("B: framework recipe"), proc.stdout + proc.stderr
    line = proc.stdout.strip()
    assert "BaselineError" not in line and "warm-up" not in line
    # the innermost frame in the repository (the stand-in's entry), not in transformers' internals
    assert f"{repo / 'executor' / 'offline' / 'infer.py'}:" in line, line
    assert "site-packages" not in line
