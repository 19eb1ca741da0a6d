"""Parity of a framework recipe's run: what upstream's executor generated against transformers.

The executor logs each request's text (`Request i: outputs: TEXT`, one log per rank). For each, the
prompt it ran is rebuilt as upstream's offline entry point chooses it (data_config.dataset "default":
dataset/default_prompt.json of the checkout or of data_config.dataset_path, repeated to the batch,
each data-parallel rank its slice) and tokenized as its scheduler does (chat template, truncated to
input_truncated_len); transformers' own model on the same checkpoint generates greedily in the run's
dtype (bfloat16: upstream's loader builds every model in it) and in float32. The run is at parity
when every request's text is one of the two.

Runs in a subprocess (`python -m agent.measure.framework_parity --yaml Y --logs DIR --checkout C`,
one JSON object on stdout), so that the recipe's modules never enter the caller.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml


def request_prompts(settings: dict, checkout: Path) -> list[str]:
    """The prompt of each request of the batch, in global order."""
    data = settings.get("data_config") or {}
    if data.get("dataset", "default") != "default":
        raise ValueError(f"data_config.dataset {data.get('dataset')!r}: only the default prompt set is checked")
    folder = Path(data.get("dataset_path") or checkout / "dataset")
    text = json.loads((folder / "default_prompt.json").read_text())["text"]
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

    settings = yaml.safe_load(yaml_path.read_text()) or {}
    model_path = settings["model_config"]["model_path"]
    new_tokens = int(settings["scheduler_config"]["max_new_tokens"])
    input_len = int(settings["data_config"]["input_truncated_len"])
    prompts = request_prompts(settings, checkout)
    logs = sorted(log_dir.glob("log_*.log"), key=lambda p: int(p.stem.removeprefix("log_") or 0))
    requests, equal_bf16, equal_fp32 = [], 0, 0
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
            same16, same32 = text == refs["bfloat16"]["text"], text == refs["float32"]["text"]
            equal_bf16 += same16
            equal_fp32 += same32
            requests.append({"rank": rank, "request": index, "prompt_tokens": len(refs["bfloat16"]["input_ids"]),
                             "equal_bfloat16": same16, "equal_float32": same32})
    if not requests:
        return {"ok": False, "checked": False, "reason": f"no `Request i: outputs:` line in {log_dir}/log_*.log"}
    ok = all(r["equal_bfloat16"] or r["equal_float32"] for r in requests)
    from agent.measure.parity import checkpoint_nll

    return {**checkpoint_nll(Path(model_path)), "ok": ok, "checked": True, "method": "greedy text of every request vs transformers' generate "
            "(bfloat16, the run's dtype, and float32) on the same checkpoint and prompt",
            "greedy_tokens_equal": ok, "requests": requests, "ranks": len(logs),
            "equal_bfloat16": f"{equal_bf16}/{len(requests)}", "equal_float32": f"{equal_fp32}/{len(requests)}"}


def framework_parity(yaml_path: Path, log_dir: Path, checkout: Path, timeout: int = 900) -> dict:
    proc = subprocess.run([sys.executable, "-m", "agent.measure.framework_parity", "--yaml", str(yaml_path),
                           "--logs", str(log_dir), "--checkout", str(checkout)],
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "checked": False, "reason": f"parity check could not run: {err}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.measure.framework_parity")
    parser.add_argument("--yaml", required=True, type=Path)
    parser.add_argument("--logs", required=True, type=Path)
    parser.add_argument("--checkout", required=True, type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(check(args.yaml, args.logs, args.checkout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
