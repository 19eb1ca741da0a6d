"""The cost of quantizing: a quantized checkpoint against the float original it was made from, both run
by transformers on CPU (transformers loading the quantized checkpoint itself: for `--quantize w8a8`, its
compressed-tensors quantizer, int8 weights dequantized and activations quantized per token as written).

On the default prompt (engine.data.DEFAULT_PROMPT, SPEC §3; tokenized as plain text), the original's
greedy continuation of `steps` tokens is the sequence both models are teacher-forced on, in float32 (the
cost of the quantization alone, no bf16 rounding on either side). Per step — the prefill (the prompt's
last position) and each decode step — whether the quantized model's top-1 token is the original's
(top-1 agreement), and the NLL each model gives the original's token there; over the prompt itself, each
model's mean next-token NLL (how well it still predicts text). The recipe's own verdict is held to
transformers running the quantized weights (agent.measure.precision); this is the number beside it.

`python -m agent.measure.quant_cost ORIGINAL QUANTIZED` prints the JSON (a subprocess keeps transformers'
models out of the migrator's memory: `measure` runs it so).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from engine.data import DEFAULT_PROMPT

STEPS = 16


def quantization_cost(original: str | Path, quantized: str | Path, *, prompt: str = DEFAULT_PROMPT,
                      steps: int = STEPS) -> dict:
    """{"top1_agreement", "steps", "agree", "first_disagreement", "per_step_nll", "nll", ...} (module docs)."""
    import torch
    from transformers import AutoTokenizer

    from agent.recipe.text_decoder import transformers_auto_class

    tokenizer = AutoTokenizer.from_pretrained(original, local_files_only=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] < 2:
        raise ValueError("the prompt tokenizes to fewer than two tokens")
    reference = transformers_auto_class(original).from_pretrained(original, dtype=torch.float32,
                                                                  local_files_only=True).eval()
    with torch.no_grad():
        generated = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=steps, min_new_tokens=steps,
                                       pad_token_id=tokenizer.pad_token_id or 0)
        sequence = generated[:, : ids.shape[1] + steps]
        ref_logits = reference(sequence).logits[0].float()
    del reference
    # .to: transformers 5.0 leaves the float experts a W8A8 checkpoint keeps (its `ignore`) in the file's dtype
    model = transformers_auto_class(quantized).from_pretrained(quantized, dtype=torch.float32,
                                                               local_files_only=True).eval().to(torch.float32)
    with torch.no_grad():
        q_logits = model(sequence).logits[0].float()
    del model
    prompt_len = ids.shape[1]
    positions = range(prompt_len - 1, sequence.shape[1] - 1)        # prefill, then each decode step
    ref_logp, q_logp = ref_logits.log_softmax(-1), q_logits.log_softmax(-1)
    agree, per_step = [], []
    for step, pos in enumerate(positions):
        token = int(sequence[0, pos + 1])
        agree.append(int(q_logits[pos].argmax()) == int(ref_logits[pos].argmax()))
        per_step.append({"step": step, "token": token, "original": round(-float(ref_logp[pos, token]), 4),
                         "quantized": round(-float(q_logp[pos, token]), 4)})
    targets = sequence[0, 1:prompt_len]
    nll_ref = -float(ref_logp[: prompt_len - 1].gather(1, targets[:, None]).mean())
    nll_q = -float(q_logp[: prompt_len - 1].gather(1, targets[:, None]).mean())
    kl = float((ref_logp.exp() * (ref_logp - q_logp)).sum(-1)[list(positions)].mean())
    first = next((i for i, ok in enumerate(agree) if not ok), None)
    return {"prompt": "default", "prompt_tokens": prompt_len, "steps": len(agree),
            "top1_agreement": round(sum(agree) / len(agree), 4), "agree": agree, "first_disagreement": first,
            "per_step_nll": per_step,
            "nll": {"original": round(nll_ref, 4), "quantized": round(nll_q, 4), "delta": round(nll_q - nll_ref, 4),
                    "uniform": round(math.log(ref_logits.shape[-1]), 4)},
            "mean_step_nll": {"original": round(sum(s["original"] for s in per_step) / len(per_step), 4),
                              "quantized": round(sum(s["quantized"] for s in per_step) / len(per_step), 4)},
            "mean_kl": round(kl, 6), "dtype": "float32", "reference": "transformers on CPU, both checkpoints"}


def line(cost: dict) -> str:
    """One line for a README or a summary."""
    if cost.get("error"):
        return f"not measured ({cost['error']})"
    nll, agree = cost.get("nll"), cost.get("agree")
    if not isinstance(nll, dict) or not isinstance(agree, list) or not all(
            isinstance(nll.get(k), (int, float)) for k in ("original", "quantized", "delta")):
        return "not measured"
    agreed = sum(1 for a in agree if a is True)
    first = cost.get("first_disagreement")
    where = "every step" if first is None else f"first differs at step {first}"
    return (f"top-1 agreement {agreed}/{len(agree)} steps ({where}) on the default prompt; prompt NLL "
            f"{nll['original']} -> {nll['quantized']} ({nll['delta']:+.4f}); float32, transformers on CPU")


def measure(original: str | Path, quantized: str | Path, *, python: str | None = None,
            timeout: int | None = None) -> dict:
    """quantization_cost in a subprocess (its models' memory freed with it); {"error": ...} where it failed."""
    from engine import defaults

    timeout = timeout or defaults.TIMEOUT_S
    cmd = [python or sys.executable, "-m", "agent.measure.quant_cost", str(original), str(quantized)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        from agent.child_failure import child_failure

        return {"error": child_failure(proc.stderr, proc.returncode, stdout=proc.stdout,
                                       no_answer="it printed no measurement")}
    from engine.safe_load import loads_json

    return loads_json(lines[-1], "quant_cost output")


def of_written(written: dict) -> dict:
    """The cost of a checkpoint agent.migrate.quantize wrote (`written`: its report record, with `source`
    and `checkpoint`), where this host can hold both models in float32; else why not and the command that
    measures it where they fit."""
    original, quantized = Path(written["source"]), Path(written["checkpoint"])
    need = 2 * 4 * int(written.get("bytes_before") or 0) // max(_bytes_per_value(original), 1)
    free = _available_bytes()
    if free is not None and need > free:
        return {"error": f"the two float32 models need about {need / 2**30:.1f} GiB, this host has "
                         f"{free / 2**30:.1f} GiB available; run `python -m agent.measure.quant_cost "
                         f"{original} {quantized}` where they fit"}
    return measure(original, quantized)


def _bytes_per_value(model_dir: Path) -> int:
    from engine.safe_load import load_json

    try:
        config = load_json(model_dir / "config.json")
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in dtype else 2


def _available_bytes() -> int | None:
    try:
        for row in Path("/proc/meminfo").read_text().splitlines():
            if row.startswith("MemAvailable:"):
                return int(row.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m agent.measure.quant_cost ORIGINAL QUANTIZED", file=sys.stderr)
        return 2
    print(json.dumps(quantization_cost(args[0], args[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
