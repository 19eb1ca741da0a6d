"""The tiny remote-code checkpoint (tests/support/remote_fixture.py) loads through auto_map and honours the
engine's cache/mask contract: DynamicCache as `past_key_values=`, a growing 2D attention mask and
explicit position_ids, with results identical to transformers' own greedy `generate()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote_fixture import AUTO_MAP, MODULE_FILES, build_remote_code_checkpoint

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory) -> Path:
    return build_remote_code_checkpoint(tmp_path_factory.mktemp("remote") / "tinycustom", seed=0)


@pytest.fixture(scope="module")
def loaded(remote_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        remote_checkpoint, trust_remote_code=True, output_loading_info=True
    )
    tokenizer = AutoTokenizer.from_pretrained(remote_checkpoint, trust_remote_code=True)
    return model.eval(), tokenizer, info


def _manual_greedy(model, input_ids, attention_mask, steps):
    """The engine's loop: DynamicCache passed as past_key_values=, 2D mask grown by one column per
    step, explicit position_ids (prefill: cumsum(mask) - 1 clamped; decode: last + 1)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    mask = attention_mask.clone()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    ids = input_ids
    out = []
    with torch.no_grad():
        for _ in range(steps):
            result = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            nxt = result.logits[:, -1, :].argmax(-1, keepdim=True)
            out.append(nxt)
            ids = nxt
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
            positions = positions[:, -1:] + 1
    return torch.cat(out, dim=-1)


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_checkpoint_layout(remote_checkpoint):
    cfg = json.loads((remote_checkpoint / "config.json").read_text())
    assert cfg["model_type"] == "tinycustom"
    assert cfg["architectures"] == ["TinyCustomForCausalLM"]
    assert cfg["auto_map"] == AUTO_MAP
    assert cfg["dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["max_position_embeddings"]) == (64, 2, 4, 2, 512)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    for name in MODULE_FILES:
        assert (remote_checkpoint / name).is_file(), name
    assert not (remote_checkpoint / "__pycache__").exists()
    gen = json.loads((remote_checkpoint / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (2, 0)
    assert (remote_checkpoint / "model.safetensors").is_file()
    modeling = (remote_checkpoint / "modeling_tinycustom.py").read_text()
    assert "from .configuration_tinycustom import TinyCustomConfig" in modeling
    assert "from .tinycustom_layers import TinyRMSNorm, rotate_half" in modeling


def test_loads_through_auto_map(loaded, remote_checkpoint):
    from safetensors.torch import load_file

    model, tokenizer, info = loaded
    assert type(model).__name__ == "TinyCustomForCausalLM"
    assert type(model).__module__.startswith("transformers_modules")  # the vendored remote code
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.vocab_size == len(tokenizer)
    saved = load_file(str(remote_checkpoint / "model.safetensors"))
    state = model.state_dict()
    assert set(saved) == set(state)
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    ids = tokenizer("Attention is all you need", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(input_ids=ids)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # labels give a loss (the codemods remove this path; it must work before they do)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_generate_matches_engine_contract(loaded):
    model, tokenizer, _ = loaded
    enc = tokenizer("The output is computed as a weighted sum", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = generated[0, enc.input_ids.shape[1]:].tolist()
    manual = _manual_greedy(model, enc.input_ids, enc.attention_mask, steps=8)[0].tolist()
    eos = model.config.eos_token_id
    assert _until_eos(new, eos) == _until_eos(manual, eos)
    assert len(_until_eos(manual, eos)) > 1


def test_left_padded_batch_matches_single_rows(loaded):
    model, tokenizer, _ = loaded
    prompts = ["Multi-head attention allows the model to jointly attend", "We call"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()  # really left-padded
    batched = _manual_greedy(model, batch.input_ids, batch.attention_mask, steps=4)
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=4, do_sample=False)
    for row, prompt in enumerate(prompts):
        single = tokenizer(prompt, return_tensors="pt")
        alone = _manual_greedy(model, single.input_ids, single.attention_mask, steps=4)[0]
        assert batched[row].tolist() == alone.tolist()
        eos = model.config.eos_token_id
        gen_row = generated[row, batch.input_ids.shape[1]:].tolist()
        assert _until_eos(gen_row, eos) == _until_eos(alone.tolist(), eos)
