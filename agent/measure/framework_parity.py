"""Parity of a framework recipe's run: what upstream's executor generated against transformers.

The executor logs each request's text (`Request i: outputs: TEXT`, one log per rank). For each, the
prompt it ran is rebuilt as upstream's offline entry point chooses it (data_config.dataset "default":
dataset/default_prompt.json of the checkout or of data_config.dataset_path, repeated to the batch,
each data-parallel rank its slice) and tokenized as its scheduler does (chat template, truncated to
input_truncated_len); transformers' own model on the same checkpoint generates greedily in the run's
dtype (bfloat16: upstream's loader builds every model in it) and in float32. The run is at parity
when every request's text is one of the two. A ModelRunner recipe of ours (the legacy target, `--legacy`)
the same way, its prompts chosen by upstream's own generate_prompt and tokenized as its runner does.

Runs in a subprocess (`python -m agent.measure.framework_parity --yaml Y --logs DIR --checkout C`,
one JSON object on stdout), so that the recipe's modules never enter the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from engine.safe_load import load_json, load_yaml, loads_json


def request_prompts(settings: dict, checkout: Path) -> list[str]:
    """The prompt of each request of the batch, in global order."""
    data = settings.get("data_config") or {}
    if data.get("dataset", "default") != "default":
        raise ValueError(f"data_config.dataset {data.get('dataset')!r}: only the default prompt set is checked")
    folder = Path(data.get("dataset_path") or checkout / "dataset")
    text = load_json((folder / "default_prompt.json"))["text"]
    prompts = text if isinstance(text, list) else [text]
    batch = int((settings.get("scheduler_config") or {}).get("batch_size") or 1)
    return (prompts * (batch // len(prompts) + 1))[:batch]


def rank_prompts(settings: dict, prompts: list[str], rank: int) -> list[str]:
    parallel = settings.get("parallel_config") or {}
    world_size = int(parallel.get("world_size") or 1)
    dp = world_size // int(parallel.get("attn_tp_size") or 1)
    if dp <= 1:
        return prompts
    per_rank = len(prompts) // dp
    dp_rank = rank // int(parallel.get("attn_tp_size") or 1)
    return prompts[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def check(yaml_path: Path, log_dir: Path, checkout: Path) -> dict:
    from npu_standin.upstream import outputs, reference_generation

    settings = load_yaml(yaml_path) or {}
    model_path = settings["model_config"]["model_path"]
    new_tokens = int(settings["scheduler_config"]["max_new_tokens"])
    input_len = int(settings["data_config"]["input_truncated_len"])
    prompts = request_prompts(settings, checkout)
    logs = sorted(log_dir.glob("log_*.log"), key=lambda p: int(p.stem.removeprefix("log_") or 0))
    requests = []
    seen_prompts: dict[tuple[str, str], dict] = {}
    for log in logs:
        rank = int(log.stem.removeprefix("log_"))
        mine = rank_prompts(settings, prompts, rank)
        for index, text in sorted(outputs(log).items()):
            prompt = mine[index] if index < len(mine) else mine[-1]
            refs = {}
            for dtype in ("bfloat16", "float32"):
                key = (prompt, dtype)
                if key not in seen_prompts:
                    seen_prompts[key] = reference_generation(model_path, prompt, new_tokens, input_len, dtype)
                refs[dtype] = seen_prompts[key]
            requests.append({"rank": rank, "request": index, "prompt_tokens": len(refs["bfloat16"]["input_ids"]),
                             "equal_bfloat16": text == refs["bfloat16"]["text"], "equal_float32": text == refs["float32"]["text"]})
    return verdict(requests, logs, log_dir, model_path, "bfloat16", "greedy text of every request vs transformers "
                   "{version}'s generate ({dtype}, the run's dtype, and float32) on the same checkpoint and prompt")


def legacy_prompts(settings: dict, checkout: Path, rank: int, world_size: int) -> list[str]:
    """A ModelRunner recipe's prompts at `rank`, chosen by upstream's own `generate_prompt` (read from
    the checkout's executor/utils/data_utils.py, which needs no NPU) as its infer.py calls it: after
    update_common_vars set batch_size_per_rank."""
    import importlib.util
    import os as _os

    spec = importlib.util.spec_from_file_location("_upstream_data_utils", checkout / "executor" / "utils" / "data_utils.py")
    data_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(data_utils)
    settings = {key: dict(value) if isinstance(value, dict) else value for key, value in settings.items()}
    parallel = settings.setdefault("parallel_config", {})
    data = settings.setdefault("data_config", {})
    data["batch_size_per_rank"] = int(data.get("batch_size") or 1) // max(1, world_size // int(parallel.get("attn_tp_size") or 1))
    saved = {k: _os.environ.get(k) for k in ("RANK_ID", "WORLD_SIZE")}
    _os.environ.update(RANK_ID=str(rank), WORLD_SIZE=str(world_size))
    try:
        prompts, _ = data_utils.generate_prompt(settings)
    finally:
        for key, value in saved.items():
            _os.environ.pop(key) if value is None else _os.environ.__setitem__(key, value)
    return prompts


def plain_generation(model_path: str, prompt: str, new_tokens: int, input_len: int, dtype: str) -> dict:
    """transformers' greedy generation of `prompt` alone, tokenized as a ModelRunner recipe's runner
    does (no chat template, truncated to input_max_len)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer(prompt, return_tensors="pt", truncation=True, max_length=input_len).input_ids
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
    return {"input_ids": ids[0].tolist(), "text": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}


def check_legacy(yaml_path: Path, log_dir: Path, checkout: Path) -> dict:
    """The same verdict for a ModelRunner recipe of ours (the legacy target): each request's text of
    each rank log against transformers on the prompt upstream's generate_prompt gave that rank."""
    from npu_standin.upstream import outputs

    settings = load_yaml(yaml_path) or {}
    data = settings.get("data_config") or {}
    model_path, world_size = settings["model_path"], int(settings.get("world_size") or 1)
    new_tokens, input_len = int(data["max_new_tokens"]), int(data["input_max_len"])
    dtype = (settings.get("model_config") or {}).get("dtype") or "bfloat16"
    logs = sorted(log_dir.glob("log_*.log"), key=lambda p: int(p.stem.removeprefix("log_") or 0))
    requests, seen = [], {}
    for log in logs:
        rank = int(log.stem.removeprefix("log_"))
        mine = legacy_prompts(settings, checkout, rank, world_size)
        for index, text in sorted(outputs(log).items()):
            prompt = mine[index] if index < len(mine) else mine[-1]
            refs = {}
            for kind in dict.fromkeys((dtype, "float32")):
                if (prompt, kind) not in seen:
                    seen[(prompt, kind)] = plain_generation(model_path, prompt, new_tokens, input_len, kind)
                refs[kind] = seen[(prompt, kind)]
            requests.append({"rank": rank, "request": index, "prompt_tokens": len(refs[dtype]["input_ids"]),
                             f"equal_{dtype}": text == refs[dtype]["text"], "equal_float32": text == refs["float32"]["text"]})
    return verdict(requests, logs, log_dir, model_path, dtype, "greedy text of every request vs transformers {version}'s "
                   "generate of its prompt alone ({dtype}, the run's dtype, and float32), as the runner tokenizes it")


def verdict(requests: list[dict], logs: list[Path], log_dir: Path, model_path: str, dtype: str, method: str) -> dict:
    import transformers

    from agent.measure.parity import checkpoint_nll

    if not requests:
        return {"ok": False, "checked": False, "reason": f"no `Request i: outputs:` line in {log_dir}/log_*.log"}
    ok = all(r[f"equal_{dtype}"] or r["equal_float32"] for r in requests)
    count = lambda key: f"{sum(r[key] for r in requests)}/{len(requests)}"   # noqa: E731
    return {**checkpoint_nll(Path(model_path)), "ok": ok, "checked": True,
            "method": method.format(version=transformers.__version__, dtype=dtype),
            "greedy_tokens_equal": ok, "requests": requests, "ranks": len(logs),
            f"equal_{dtype}": count(f"equal_{dtype}"), "equal_float32": count("equal_float32")}


def framework_parity(yaml_path: Path, log_dir: Path, checkout: Path, timeout: int = 900,
                     python: str | None = None, legacy: bool = False) -> dict:
    """The check in `python` (default: this interpreter): the one with the recipe's transformers, the
    release the reference must be. This project's packages reach it on PYTHONPATH; its own
    site-packages supply torch and transformers."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([python or sys.executable, "-m", "agent.measure.framework_parity", "--yaml", str(yaml_path),
                           "--logs", str(log_dir), "--checkout", str(checkout), *(["--legacy"] if legacy else [])],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "checked": False, "reason": f"parity check could not run: {err}"}
    return loads_json(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.measure.framework_parity")
    parser.add_argument("--yaml", required=True, type=Path)
    parser.add_argument("--logs", required=True, type=Path)
    parser.add_argument("--checkout", required=True, type=Path)
    parser.add_argument("--legacy", action="store_true", help="a ModelRunner recipe (the legacy target)")
    args = parser.parse_args(argv)
    print(json.dumps((check_legacy if args.legacy else check)(args.yaml, args.logs, args.checkout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
