"""One card's memory for the out-of-memory estimate (agent.measure.memory.card_memory): accelerate's
get_max_memory where it answers, asked in a child process; the environment record's figures (torch,
npu-smi, /proc/meminfo) where it does not, with the reason recorded. Real accelerate here (its CPU
answer), the real torch-npu wheel without CANN (a broken install), npu-smi's real table layouts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.measure import memory
from agent.measure.memory import ACCELERATE_SOURCE, ask_accelerate, card_memory
from engine.backends.cpu import mem_total_bytes
from engine.backends.npu import detect_npu, parse_npu_smi
from engine.environment import probe_torch_npu
from locations import DATA

NPU_SMI_DATA = DATA / "npu_smi"
GIB = 2**30


@pytest.fixture(autouse=True)
def fresh_answer(monkeypatch):
    monkeypatch.setattr(memory, "_accelerate_answer", None)


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available() and probe_torch_npu()["status"] != "ok"


def test_accelerate_answers_for_the_cpu_here():
    if not _cpu_only():
        pytest.skip("an accelerator is usable here; this test describes a CPU-only machine")
    answer = ask_accelerate()
    assert "error" not in answer, answer
    assert answer["kind"] is None
    assert set(answer["memory"]) == {"cpu"}              # no card: accelerate answers the host only
    assert 0 < answer["memory"]["cpu"] <= mem_total_bytes()
    card = card_memory({"device": "cpu", "device_memory_bytes": mem_total_bytes()})
    assert card["source"] == f"{ACCELERATE_SOURCE} (available host memory)"
    assert card["fallback_reason"] is None
    assert 0 < card["bytes"] <= mem_total_bytes()


@pytest.mark.parametrize("sample, chip_mib", [
    ("910b3_x2.txt", 65536), ("910b4_x8_atlas800i_a2.txt", 32768), ("910b_x4_older_layout.txt", 32768),
    ("a3_ascend910_x8_2chips.txt", 65536), ("310p3_duo_x2_4chips.txt", 43693), ("error_device_busy.txt", None),
])
def test_npu_smi_gives_the_smallest_chip_memory(sample, chip_mib):
    """The last "used / total" pair of a chip row (HBM; DDR on a 310P), smallest over the chips."""
    info = parse_npu_smi((NPU_SMI_DATA / sample).read_text())
    assert info["chip_memory_bytes"] == (chip_mib * 2**20 if chip_mib else None)


ACCELERATE_NPU = {"kind": "npu", "memory": {"0": 60 * GIB, "1": 58 * GIB, "cpu": 900 * GIB}}


@pytest.mark.parametrize("env, answer, want_bytes, want_source, reason", [
    # accelerate answers for the device: the tightest card's free memory
    ({"device": "npu", "device_memory_bytes": 64 * GIB}, ACCELERATE_NPU, 58 * GIB,
     f"{ACCELERATE_SOURCE} (free memory, smallest of 2 npu card(s))", None),
    ({"device": "cuda"}, {"kind": "cuda", "memory": {"0": 140 * GIB, "cpu": 1}}, 140 * GIB,
     f"{ACCELERATE_SOURCE} (free memory, smallest of 1 cuda card(s))", None),
    # its cards are another kind's: torch's figure for the card in the record
    ({"device": "cuda", "device_memory_bytes": 80 * GIB}, ACCELERATE_NPU, 80 * GIB,
     "torch.cuda.get_device_properties", "saw no cuda card"),
    # torch_npu did not import: torch's figure is absent too, npu-smi's chip memory is used
    ({"device": "npu", "device_memory_bytes": None, "npu_chip_memory_bytes": 64 * GIB},
     {"kind": None, "memory": {"cpu": 1}, "torch_npu": "ImportError: libhccl.so: cannot open shared object file"},
     64 * GIB, "npu-smi info", "import torch_npu: ImportError: libhccl.so"),
    # accelerate itself failed
    ({"device": "cpu", "device_memory_bytes": 24 * GIB}, {"error": "ModuleNotFoundError: No module named 'accelerate'"},
     24 * GIB, "/proc/meminfo MemTotal", "failed: ModuleNotFoundError"),
    # nothing answers
    ({"device": "npu"}, {"error": "no answer within 120 s"}, None, None, "no answer within 120 s"),
])
def test_card_memory_prefers_accelerate_and_says_why_not(env, answer, want_bytes, want_source, reason):
    card = card_memory(env, ask=lambda: answer)
    assert (card["bytes"], card["source"]) == (want_bytes, want_source)
    if reason is None:
        assert card["fallback_reason"] is None
    else:
        assert reason in card["fallback_reason"]


def _fake_npu_smi(bin_dir: Path, sample: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "npu-smi"
    exe.write_text(f'#!/bin/sh\n[ "$1" = info ] || exit 2\ncat "{sample}"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_a_broken_torch_npu_falls_back_to_npu_smi_with_the_reason(tmp_path, monkeypatch, tiny_checkpoints):
    """The real torch-npu wheel without CANN on the query's path: accelerate sees no NPU, the reason
    is torch_npu's own import error, and the estimate uses npu-smi's chip memory."""
    from npu_wheel import torch_npu_wheel

    import yaml

    from agent.recipe.recipe import Recipe

    if probe_torch_npu()["status"] == "ok" or Path("/usr/local/Ascend").exists():
        pytest.skip("this machine has a working torch_npu or Ascend software")
    wheel, why = torch_npu_wheel()
    if wheel is None:
        pytest.skip(why)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(wheel), os.environ.get("PYTHONPATH")])))
    _fake_npu_smi(tmp_path / "bin", NPU_SMI_DATA / "910b3_x2.txt")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    npu = detect_npu()

    recipe = tmp_path / "recipe"
    (recipe / "config").mkdir(parents=True)
    settings = {"model_name": "r", "model_path": str(tiny_checkpoints("llama")), "model_config": {"dtype": "float32"},
                "data_config": {"batch_size": 1, "input_max_len": 32, "max_new_tokens": 8}}
    (recipe / "config" / "r_1card_eager.yaml").write_text(yaml.safe_dump(settings))
    env = {"device": "npu", "device_memory_bytes": None, "npu_chip_memory_bytes": npu["chip_memory_bytes"]}
    estimate = memory.estimate_for_recipe(Recipe.at(recipe), env)

    assert estimate["device_bytes"] == 65536 * 2**20
    assert estimate["device_memory_source"] == "npu-smi info"
    assert estimate["device_memory_fallback"].startswith(f"{ACCELERATE_SOURCE} saw no npu card (import torch_npu: ")
    assert "libhccl.so" in estimate["device_memory_fallback"]
    assert estimate["cards_needed"] == 1
