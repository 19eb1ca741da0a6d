"""The shipped demo checkpoint (demo/tiny-attention-llama) and the script that trains it."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from engine.data import DEFAULT_PROMPT
from engine.output_check import check_output_text
from locations import REPO_ROOT

DEMO_DIR = REPO_ROOT / "demo" / "tiny-attention-llama"
SCRIPT = REPO_ROOT / "scripts" / "train_demo_model.py"
MAX_BYTES = 10 * 1024 * 1024
NEW_TOKENS = 32


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def demo():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, local_files_only=True, dtype=torch.float32)
    return model.eval(), tokenizer


def test_shipped_folder_is_small_and_complete():
    assert DEMO_DIR.is_dir()
    names = {f.name for f in DEMO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert _folder_bytes(DEMO_DIR) <= MAX_BYTES
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert generation["do_sample"] is False
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert generation["pad_token_id"] == config["pad_token_id"]
    readme = (DEMO_DIR / "README.md").read_text()
    assert "python scripts/train_demo_model.py --output demo/tiny-attention-llama" in readme
    assert "License" in readme and "not a useful model" in readme


def test_greedy_continuation_is_readable(demo):
    import torch

    model, tokenizer = demo
    enc = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    check = check_output_text(text)
    assert check["ok"], (text, check)
    assert len(text.split()) >= 10, text  # long enough for the repeated 3-gram check to apply
    assert text.startswith(" computed as a weighted sum of the values"), text


def test_prompt_is_predicted_well(demo):
    import torch

    from agent.measure.parity import prompt_nll

    model, tokenizer = demo
    enc = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    result = prompt_nll(logits, enc["input_ids"])
    assert not result["untrained_weights"], result
    assert result["prompt_nll"] < 0.5 * math.log(logits.shape[-1]), result
    assert result["uniform_nll"] == pytest.approx(math.log(len(tokenizer)), abs=1e-3)


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_script_smoke_run_recreates_equivalent_checkpoint(tmp_path, capsys):
    import torch

    # In-process (a subprocess would spend most of its time importing torch and transformers);
    # main() switches on deterministic algorithms and one thread: put both back afterwards.
    out = tmp_path / "demo"
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    try:
        assert _load_script().main(["--output", str(out), "--steps", "12", "--log-every", "4"]) == 0
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert "step   12/12  loss" in stdout
    assert "greedy continuation" in stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == len(tokenizer)
    # Same corpus, tokenizer, architecture and initialisation as the shipped checkpoint.
    assert (out / "tokenizer.json").read_text() == (DEMO_DIR / "tokenizer.json").read_text()
    shipped_config = json.loads((DEMO_DIR / "config.json").read_text())
    smoke_config = json.loads((out / "config.json").read_text())
    shipped_config.pop("transformers_version", None)
    smoke_config.pop("transformers_version", None)
    assert smoke_config == shipped_config
    shipped_info = json.loads((DEMO_DIR / "training_info.json").read_text())
    smoke_info = json.loads((out / "training_info.json").read_text())
    assert smoke_info["initial_loss"] == pytest.approx(shipped_info["initial_loss"], abs=1e-3)
    assert smoke_info["parameters"] == shipped_info["parameters"]
