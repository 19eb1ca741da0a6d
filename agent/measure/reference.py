"""transformers' reference for a recipe's run, and cann-recipes-infer's own recipes run on tiny random
weights (under the npu stand-in off an NPU, on an NPU as they are).

* `tiny_checkpoint(model_type, out)`: agent.testing.tiny_checkpoint's builder (random weights in the HF
  shapes, a byte-level BPE tokenizer) plus a ChatML chat template, which upstream's scheduler applies
  to every prompt.
* `tiny_yaml(src, dst, model_path, ...)`: a copy of a recipe YAML pointed at the tiny checkpoint,
  with the lengths cut (both YAML schemas: framework four-section and legacy).
* `framework_command(checkout, model, yaml_name)`: upstream's own entry point,
  `bash executor/scripts/infer.sh --model M --yaml F`.
* `rank_logs(...)`, `outputs(log)`: where its ranks wrote their logs and what they generated.
* `reference_generation(checkpoint, prompt, ...)`: transformers' own model on the same checkpoint and
  prompt, greedy, as upstream's scheduler tokenizes it: the parity oracle.
* `greedy_parity(checkpoint, prompt, upstream_text, ...)`: is `upstream_text` transformers' greedy
  continuation? Exactly, or up to bf16 ties (see there).
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.processes import owned_temp
from engine.safe_load import load_json, load_yaml
from engine.safe_write import UserTree, tree_of


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

OUTPUT_RE = re.compile(r"Request (\d+): outputs: (.*)$")


def tiny_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoTokenizer

    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    out = Path(build_tiny_checkpoint(model_type, out_dir, seed=seed, **overrides))
    _hub_style_config(out / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = CHATML_TEMPLATE
    UserTree(out, "the checkpoint folder").fill_with(out, lambda tmp: tokenizer.save_pretrained(tmp),
                                                     owned_temp("fill"))
    return Path(out)


# Fields transformers 5 saves under its canonical name (the class's attribute_map) that the hub's
# config.json files, and the config classes upstream vendors, name otherwise: Qwen3-235B-A22B's
# config.json states "num_experts" (upstream's models/qwen3_moe/models/configuration_qwen3_moe.py reads
# `num_experts`, default 128); transformers 5.x's Qwen3MoeConfig writes "num_local_experts".
HUB_NAMES = {"qwen3_moe": {"num_experts": "num_local_experts"}}


def _hub_style_config(path: Path) -> None:
    """transformers 5 saves rope settings only under "rope_parameters"; the hub's config.json files (and
    the config classes upstream vendors, which read `rope_theta` and default to their model's value)
    have them at the top level: write both, as a published checkpoint does. The same for the fields
    of HUB_NAMES (both names, one value)."""
    import json

    config = load_json(path)
    rope = config.get("rope_parameters") or {}
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            # the hub's files name the scaling "type" (DeepSeek-V3, Kimi-K2), newer ones "rope_type": both
            config.setdefault("rope_scaling", {**rope, "type": rope["rope_type"]})
    for alias, canonical in HUB_NAMES.get(config.get("model_type"), {}).items():
        if canonical in config and alias not in config:
            config[alias] = config[canonical]
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if "head_dim" not in config and isinstance(heads, int) and isinstance(hidden, int) and heads:
        # the hub's config.json states it (Qwen3-MoE); transformers' class may derive it (hidden / heads)
        config["head_dim"] = hidden // heads
    tree_of(path, "the checkpoint folder").write_text(path, json.dumps(config, indent=2) + "\n")


def tiny_yaml(src: str | Path, dst: str | Path, model_path: str | Path, *, max_new_tokens: int = 16,
              input_len: int = 128, exe_mode: str | None = None, parallel: dict | None = None) -> Path:
    """A copy of recipe YAML `src` at `dst` run on `model_path`, with short lengths; `parallel`
    replaces keys of parallel_config (framework) or the top level (legacy: world_size)."""
    import yaml

    data = load_yaml(Path(src)) or {}
    framework = isinstance(data.get("model_config"), dict) and "model_name" in data["model_config"]
    if framework:
        data["model_config"]["model_path"] = str(model_path)
        if exe_mode:
            data["model_config"]["exe_mode"] = exe_mode
        data.setdefault("data_config", {})["input_truncated_len"] = input_len
        data.setdefault("scheduler_config", {})["max_new_tokens"] = max_new_tokens
        data.setdefault("parallel_config", {}).update(parallel or {})
    else:
        data["model_path"] = str(model_path)
        if exe_mode:
            data["exe_mode"] = exe_mode
        data.setdefault("data_config", {}).update(input_max_len=input_len, max_new_tokens=max_new_tokens)
        data.update(parallel or {})
    dst = Path(dst)
    tree_of(dst).write_text(dst, yaml.safe_dump(data, sort_keys=False))
    return dst


def framework_command(checkout: str | Path, model: str, yaml_name: str) -> list[str]:
    return ["bash", str(Path(checkout) / "executor" / "scripts" / "infer.sh"), "--model", model, "--yaml", yaml_name]


def rank_logs(checkout: str | Path, model: str, yaml_name: str) -> list[Path]:
    """The log_N.log files function.sh wrote for this model and YAML (newest date folder)."""
    import yaml

    folder = Path(checkout) / "models" / model
    cfg = load_yaml((folder / "config" / yaml_name)) or {}
    name = (cfg.get("model_config") or {}).get("model_name", cfg.get("model_name"))
    case = f"{name}_{Path(yaml_name).stem}"
    runs = sorted((folder / "res").glob(f"*/{case}"))
    if not runs:
        return []
    return sorted(runs[-1].glob("log_*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))


def outputs(log: str | Path) -> dict[int, str]:
    found = {}
    # Generated text may hold \r, \x0b, \x1c..: only \n ends a log line.
    with open(log, encoding="utf-8", errors="replace", newline="") as f:
        text = f.read()
    for line in text.split("\n"):
        m = OUTPUT_RE.search(line)
        if m:
            found[int(m.group(1))] = m.group(2)
    return found


def reference_generation(checkpoint: str | Path, prompt: str, max_new_tokens: int, input_len: int,
                         dtype: str = "bfloat16") -> dict:
    """transformers' own model, greedy, on the prompt as upstream's scheduler tokenizes it (chat template,
    truncation to input_truncated_len): {"input_ids", "output_ids", "text"}."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from agent.recipe.text_decoder import transformers_auto_class

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=input_len).input_ids
    model = transformers_auto_class(checkpoint).from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    generation = GenerationConfig.from_pretrained(checkpoint)
    generation.do_sample = False
    generation.max_new_tokens = max_new_tokens
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)
    new = out[0, ids.shape[1]:].tolist()
    return {"input_ids": ids[0].tolist(), "output_ids": new,
            "text": tokenizer.decode(torch.tensor(new), skip_special_tokens=True)}


def greedy_parity(checkpoint: str | Path, prompt: str, upstream_text: str, max_new_tokens: int, input_len: int,
                  max_branches: int = 64) -> dict:
    """Whether `upstream_text` (upstream's bf16 run) is transformers' greedy continuation of `prompt`.

    The oracle is transformers' own model on `checkpoint` in float32 (the model's arithmetic without
    rounding noise), on the prompt as upstream's scheduler tokenizes it:

    * "equal": transformers' greedy `generate` (float32) decodes to exactly `upstream_text`;
    * else "equal_up_to_ties": a greedy path of transformers' model decodes to `upstream_text`, where
      at a step the path may take a token other than the float32 argmax only when the two logits are
      closer than transformers' own bf16 rounding at that step (the largest |bf16 - fp32| logit
      difference of transformers itself on the same prefix): a tie bf16 cannot resolve. Each step is
      teacher-forced on the path's own prefix. "ties" lists those steps with both gaps.

    Returns {"equal", "equal_up_to_ties", "tokens", "ties", "reference_text", "upstream_text",
    "min_margin" (smallest float32 top-2 gap on the path), "branches"}."""
    import torch
    from transformers import AutoTokenizer

    from agent.recipe.text_decoder import transformers_auto_class

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=input_len).input_ids
    exact = transformers_auto_class(checkpoint).from_pretrained(checkpoint, dtype=torch.float32).eval()
    rounded = transformers_auto_class(checkpoint).from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    reference = reference_generation(checkpoint, prompt, max_new_tokens, input_len, "float32")
    eos = set()
    for source in (exact.config, exact.generation_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        eos |= set(value) if isinstance(value, (list, tuple)) else ({value} if value is not None else set())

    def decoded(tokens):
        return tokenizer.decode(torch.tensor(tokens, dtype=torch.long), skip_special_tokens=True)

    def consistent(tokens):
        return upstream_text.startswith(decoded(tokens).rstrip("\ufffd"))

    state = {"branches": 0}

    def search(tokens, ties, margins):
        if len(tokens) == max_new_tokens or (tokens and tokens[-1] in eos):
            return (tokens, ties, margins) if decoded(tokens) == upstream_text else None
        state["branches"] += 1
        if state["branches"] > max_branches:
            return None
        seq = torch.cat([ids, torch.tensor([tokens], dtype=torch.long)], dim=1) if tokens else ids
        with torch.no_grad():
            logits = exact(seq).logits[0, -1].float()
            noise = (rounded(seq).logits[0, -1].float() - logits).abs().max().item()
        top = logits.topk(min(8, logits.numel()))
        best = top.values[0].item()
        margin = (top.values[0] - top.values[1]).item()
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            if best - value > noise and token != top.indices[0].item():
                break
            path = tokens + [token]
            if not consistent(path):
                continue
            tie = [] if token == top.indices[0].item() else [{
                "step": len(tokens), "token": token, "argmax": top.indices[0].item(),
                "fp32_gap": round(best - value, 4), "bf16_noise": round(noise, 4)}]
            found = search(path, ties + tie, margins + [margin])
            if found is not None:
                return found
        return None

    found = search([], [], [])
    result = {"equal": reference["text"] == upstream_text, "equal_up_to_ties": found is not None,
              "reference_text": reference["text"], "upstream_text": upstream_text,
              "branches": state["branches"]}
    if found is not None:
        tokens, ties, margins = found
        result.update(tokens=len(tokens), ties=ties, min_margin=round(min(margins), 4) if margins else None)
    else:
        result.update(tokens=len(reference["output_ids"]), ties=None, min_margin=None)
    return result
