"""Time and memory of a whole `migrator run` on a real model shape, against the recipe alone.

    python scripts/bench_pipeline.py --preset qwen3-0.6b [--preset qwen3-1.7b] [--json out.json]

For each preset (published config.json numbers, kept below as data) it builds a checkpoint with
random weights in the preset's dtype and a small BPE tokenizer, then runs side by side on this host:

  (a) `migrator run CKPT --device cpu` under /usr/bin/time -v: seconds per workflow stage (from the
      progress lines) and the peak resident memory of the largest process (the migrator itself, the
      trial run of infer.sh, the parity check);
  (b) the rendered recipe's own `bash infer.sh` under /usr/bin/time -v: its peak memory.

It prints the ratio peak(a) / peak(b) and the stage times. The precision check's oracle is
transformers' model in float32 (agent.measure.precision), a copy of the weights the recipe never holds,
so the goal is against a budget: peak(a) <= 1.1 x (peak(b) + the float32 weight bytes), `budget_ratio`. Random weights, never downloaded ones (SPEC §5). `--layers N` cuts a preset to N
layers (a smoke run; the test suite uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from engine.safe_load import load_json

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# Published shapes (config.json of each model on the hub), enough to rebuild the architecture.
PRESETS = {
    "qwen3-0.6b": {  # dense, GQA, tied embeddings
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True, "dtype": "bfloat16"},
    "qwen3-1.7b": {  # dense, GQA, tied embeddings
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True, "dtype": "bfloat16"},
    "qwen3-30b-a3b": {  # MoE: 128 experts, 8 active (61 GB in bf16: for a GPU/NPU host)
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "norm_topk_prob": True, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": False, "dtype": "bfloat16"},
    "deepseek-v2-lite": {  # MLA + MoE (31 GB in bf16)
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "vocab_size": 102400, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False, "dtype": "bfloat16"},
}

STAGE_RE = re.compile(r"^\[migrator\] (\w+) done in ([\d.]+)s", re.M)
MAXRSS_RE = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def build_checkpoint(preset: str, out: Path, layers: int | None = None) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import build_tokenizer

    spec = dict(PRESETS[preset])
    model_type, dtype = spec.pop("model_type"), spec.pop("dtype")
    spec.pop("architectures")
    if layers:
        spec["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=320)
    config = AutoConfig.for_model(model_type, **spec, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    write_text_only(model, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    del model
    return out


def write_text_only(model, tokenizer) -> None:
    """Random weights over the preset's vocabulary pick ids the small tokenizer does not have (or its
    special tokens), whose text is empty, and an empty output never passes the precision check. The
    output rows of those ids are zeroed, so every greedy token is one of the tokenizer's ordinary ones
    (its random logits beat 0); the shapes, and so the memory the bench measures, stay the preset's."""
    import torch

    vocab = model.get_output_embeddings().weight.shape[0]
    drop = torch.ones(vocab, dtype=torch.bool)
    drop[:len(tokenizer)] = False
    drop[[i for i in tokenizer.all_special_ids if i < vocab]] = True
    with torch.no_grad():
        model.get_output_embeddings().weight[drop] = 0       # tied: the input rows of those ids too


def float32_bytes(ckpt: Path) -> int:
    """The checkpoint's weights in float32: what the precision check's oracle holds."""
    from math import prod

    from safetensors import safe_open

    total = 0
    for path in ckpt.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total * 4


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, int | None, float]:
    """Run under /usr/bin/time -v: (process, peak RSS in bytes of its largest process, seconds)."""
    start = time.perf_counter()
    time_bin = shutil.which("time") or "/usr/bin/time"
    prefix = [time_bin, "-v"] if Path(time_bin).exists() else []
    proc = subprocess.run(prefix + cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    match = MAXRSS_RE.search(proc.stderr)
    return proc, (int(match.group(1)) * 1024 if match else None), seconds


def bench(preset: str, work: Path, layers: int | None, new_tokens: int) -> dict:
    ckpt = work / f"{preset}-ckpt"
    start = time.perf_counter()
    build_checkpoint(preset, ckpt, layers)
    build_s = time.perf_counter() - start
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = work / "recipes"
    name = re.sub(r"[^a-z0-9]+", "_", preset)
    migrate, migrate_peak, migrate_s = timed(
        [sys.executable, "-m", "agent.cli", "run", str(ckpt), "--name", name, "--output-dir", str(out),
         "--device", "cpu", "--max-new-tokens", str(new_tokens), "--json"], REPO_ROOT, env)
    if migrate.returncode != 0:
        raise SystemExit(f"migrator run failed for {preset}:\n{migrate.stderr[-3000:]}")
    stages = {m.group(1): float(m.group(2)) for m in STAGE_RE.finditer(migrate.stderr)}
    recipe = out / name
    infer, infer_peak, infer_s = timed(["bash", str(recipe / "infer.sh")], work,
                                       {**env, "PYTHON": sys.executable, "RES_PATH": str(work / "res")})
    if infer.returncode != 0:
        raise SystemExit(f"bash infer.sh failed for {preset}:\n{infer.stderr[-3000:]}")
    baseline = load_json((recipe / "baseline" / "baseline_metadata.json"))
    parity = baseline["verification"]["parity"]
    return {
        "preset": preset, "layers": layers or PRESETS[preset]["num_hidden_layers"], "weights_bytes": weights,
        "build_s": round(build_s, 1), "migrate_s": round(migrate_s, 1), "stages_s": stages,
        "migrate_peak_bytes": migrate_peak, "infer_sh_peak_bytes": infer_peak, "infer_sh_s": round(infer_s, 1),
        "peak_ratio": round(migrate_peak / infer_peak, 3) if migrate_peak and infer_peak else None,
        "float32_weights_bytes": float32_bytes(ckpt),
        "budget_ratio": round(migrate_peak / (infer_peak + float32_bytes(ckpt)), 3)
        if migrate_peak and infer_peak else None,
        "parity_code": {k: parity["code"].get(k) for k in ("ok", "max_abs_logits_diff", "greedy_tokens_equal")},
        "parity_steps": {k: parity.get(k) for k in ("ok", "dtype", "steps_checked", "max_abs_logits_diff", "closest")},
        "decode_avg_ms": baseline["performance"]["decode_avg_ms"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable (default: qwen3-0.6b)")
    parser.add_argument("--layers", type=int, help="cut each preset to this many layers (smoke run)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temp folder)")
    args = parser.parse_args(argv)
    presets = args.preset or ["qwen3-0.6b"]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        root = args.keep or Path(tmp)
        for preset in presets:
            print(f"[bench_pipeline] {preset}: building random weights ...", file=sys.stderr, flush=True)
            work = root / preset
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            results.append(bench(preset, work, args.layers, args.new_tokens))
            shutil.rmtree(work / f"{preset}-ckpt", ignore_errors=True)
    stages = sorted({s for r in results for s in r["stages_s"]}, key=list(results[0]["stages_s"]).index
                    if results else None)
    print("| preset | weights | migrate s | " + " | ".join(stages) + " | peak migrate | peak infer.sh | ratio | budget ratio |")
    print("|---" * (len(stages) + 7) + "|")
    for r in results:
        cells = [f"{r['stages_s'].get(s, 0):.1f}" for s in stages]
        print(f"| {r['preset']} ({r['layers']} layers) | {r['weights_bytes'] / 2**30:.2f} GiB | {r['migrate_s']} | "
              + " | ".join(cells) + f" | {(r['migrate_peak_bytes'] or 0) / 2**30:.2f} GiB | "
              f"{(r['infer_sh_peak_bytes'] or 0) / 2**30:.2f} GiB | {r['peak_ratio']} | {r['budget_ratio']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
