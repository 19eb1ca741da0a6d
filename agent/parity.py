"""Parity check: the recipe's vendored model vs the original transformers implementation.

Same weights, fp32: max |logits difference| on a prompt, and the recipe Runner's greedy tokens vs
`generate()`'s. Runs in a subprocess from the recipe dir (its `models` package must not leak into
the caller), as `python -m agent.parity --recipe DIR`, printing one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOGITS_TOLERANCE = 1e-4


def run_parity(recipe_dir: Path, tokens: int = 16, timeout: int = 900, trust_remote_code: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(recipe_dir), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "agent.parity", "--recipe", str(recipe_dir), "--tokens", str(tokens)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    proc = subprocess.run(cmd, cwd=recipe_dir, env=env, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "checked": False, "reason": f"parity check could not run: {err}"}
    return json.loads(lines[-1])


def _runner_class(recipe_dir: Path):
    import importlib

    from engine.model_runner import ModelRunner

    name = next(recipe_dir.glob("runner_*.py")).stem
    module = importlib.import_module(name)
    return next(obj for obj in vars(module).values()
                if isinstance(obj, type) and issubclass(obj, ModelRunner) and obj is not ModelRunner)


def check(recipe_dir: Path, tokens: int, prompt: str | None = None, trust_remote_code: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from engine.config import load_runner_settings
    from engine.data import DEFAULT_PROMPT

    yaml_file = sorted((recipe_dir / "config").glob("*.yaml"))[0]
    settings = load_runner_settings(yaml_file)
    remote = "auto_map" in json.loads((Path(settings["model_path"]) / "config.json").read_text())
    if remote and not trust_remote_code:
        # The original implementation is the repo's own code: never run it without the opt-in.
        return {"ok": None, "checked": False,
                "reason": "original implementation is remote code; pass --trust-remote-code to compare"}
    settings["model_config"]["dtype"] = "float32"
    settings["world_size"] = 1          # one process, one prompt: parity is not a parallel run
    data = settings["data_config"]
    # Same room for prompt + generated tokens as the recipe itself had.
    data["input_max_len"] = max(1, min(data["input_max_len"], data["input_max_len"] + data["max_new_tokens"] - tokens))
    data["max_new_tokens"] = tokens
    os.environ["RES_PATH"] = tempfile.mkdtemp(prefix="parity_")
    sys.path.insert(0, str(recipe_dir))
    runner = _runner_class(recipe_dir)(settings)
    runner.init_model()
    prompt = prompt or DEFAULT_PROMPT
    inputs = runner.tokenizer([prompt], return_tensors="pt").to(runner.device)
    with torch.inference_mode():
        ours = runner.model(**inputs).logits.float()
    # From the recipe's own logits, before the reference is touched: whether the weights are
    # untrained must not hinge on transformers running this checkpoint (lfm3 with 2 layers).
    nll = prompt_nll(ours, inputs["input_ids"])
    try:
        reference = AutoModelForCausalLM.from_pretrained(
            settings["model_path"], dtype=torch.float32, local_files_only=True, trust_remote_code=remote,
            # The recipe's config corrections (e.g. tied embeddings) describe the weights, so the
            # reference gets them too; key_mapping is not passed: it renames for the vendored code.
            **settings["model_config"].get("config_overrides", {}),
            attn_implementation=runner.attn_implementation).to(runner.device).eval()
        with torch.inference_mode():
            theirs = reference(**inputs).logits.float()
    except Exception as exc:  # noqa: BLE001 - transformers itself cannot run it: nothing to compare
        return {"ok": None, "checked": False, **nll,
                "reason": f"the reference (transformers) fails on this checkpoint: {type(exc).__name__}: "
                          f"{(str(exc).splitlines() or [''])[0][:200]}"}
    max_abs_diff = (ours - theirs).abs().max().item()

    runner.model_generate([prompt])
    our_tokens = runner.last_generate_ids[0].tolist()
    eos = runner.eos_token_ids()
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=tokens, eos_token_id=eos or None,
                                  pad_token_id=runner.tokenizer.pad_token_id)
    try:
        with torch.inference_mode():
            generated = reference.generate(**inputs, generation_config=gen_config)
    except Exception as exc:  # noqa: BLE001 - as above: transformers' own generate fails here
        return {"ok": None, "checked": False, "max_abs_logits_diff": max_abs_diff, **nll,
                "reason": f"the reference (transformers) fails to generate: {type(exc).__name__}: "
                          f"{(str(exc).splitlines() or [''])[0][:200]}"}
    their_tokens = generated[0, inputs["input_ids"].shape[1]:].tolist()
    tokens_equal = our_tokens == their_tokens
    return {"ok": max_abs_diff <= LOGITS_TOLERANCE and tokens_equal, "checked": True,
            "reference": f"transformers {reference.__class__.__name__}",
            "dtype": "float32", "max_abs_logits_diff": max_abs_diff, "tolerance": LOGITS_TOLERANCE,
            "greedy_tokens": len(our_tokens), "greedy_tokens_equal": tokens_equal,
            "recipe_tokens": our_tokens, "reference_tokens": their_tokens, **nll}


# Random weights predict the prompt no better than chance (or worse: random logits are peaked);
# a trained model is far below the uniform cross-entropy ln(vocab).
UNTRAINED_NLL_FRACTION = 0.8


def prompt_nll(logits, input_ids) -> dict:
    """Mean next-token cross-entropy of the prompt vs the uniform distribution's ln(vocab)."""
    import math

    import torch

    vocab = logits.shape[-1]
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), input_ids[0, 1:]).item()
    uniform = math.log(vocab)
    return {"prompt_nll": round(nll, 4), "uniform_nll": round(uniform, 4),
            "untrained_weights": nll >= UNTRAINED_NLL_FRACTION * uniform}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.parity", description=__doc__)
    parser.add_argument("--recipe", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    result = check(args.recipe.resolve(), args.tokens, trust_remote_code=args.trust_remote_code)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
