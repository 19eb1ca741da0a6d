"""Time and peak memory of converting published quantized checkpoints (agent.migrate.convert), at the published
models' layer shapes (config numbers from their config.json; fewer layers and experts, random weights):

    python scripts/bench_convert.py [--forms deepseek_v3 qwen3_fp8 gpt_oss llama_awq] [--shard-mb 512]
                                    [--out DIR] [--json FILE] [--markdown FILE]

Each form is built by tests/support/quantized_checkpoints.py, split into shards of about --shard-mb, then
converted in a child process (`migrator convert`'s function) that reports the seconds and the growth of its
resident memory over the conversion (psutil, sampled every 20 ms); the table puts that growth beside the
largest source shard, the bound the converter keeps under (it holds one tensor, a large one in pieces).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

# published shapes, fewer layers / experts (the shapes that make a shard's tensors)
FORMS = {
    # DeepSeek-V3 / R1 (and Kimi-K2's layers): hidden 7168, q_lora 1536, kv_lora 512, MoE inter 2048, dense 18432
    "deepseek_v3": ("deepseek_v3_fp8", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                            q_lora_rank=1536, kv_lora_rank=512, num_attention_heads=16,
                                            num_key_value_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                            v_head_dim=128, n_routed_experts=8, n_group=4, topk_group=2,
                                            num_experts_per_tok=8, num_hidden_layers=2)),
    # Qwen3-8B-FP8: hidden 4096, intermediate 12288, 32 heads of 128, 8 KV heads
    "qwen3_fp8": ("qwen3_fp8", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, num_hidden_layers=4)),
    # gpt-oss-20b: hidden 2880, intermediate 2880, 32 experts, 64 heads of 64, 8 KV heads
    "gpt_oss": ("gpt_oss_mxfp4", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                      num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_hidden_layers=2,
                                      sliding_window=128, layer_types=["sliding_attention", "full_attention"])),
}

CHILD = r"""
import json, sys
from pathlib import Path
sys.path[:0] = [ROOT]
from agent.migrate.convert import convert_checkpoint
from agent.recipe.fs_guard import user_tree
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
record = convert_checkpoint(src, dest, user_tree(dest.parent, create=True), log=lambda line: None)
print("RECORD " + json.dumps(record))
"""


def build(form: str, out: Path, shard_mb: int) -> Path:
    import quantized_checkpoints as forms

    builder, dims = FORMS[form]
    build_fn = getattr(forms, builder)
    out.mkdir(parents=True, exist_ok=True)
    src, _ = build_fn(out / "src", shards=1, **dims)
    tensors = {}
    from safetensors.torch import load_file

    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    forms.save_shards(src, tensors, max(1, round(total / (shard_mb * 2**20))))
    return src


def convert_in_child(src: Path, dest: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("ROOT", repr(str(ROOT))), str(src), str(dest)],
                          capture_output=True, text=True, check=True)
    from engine.safe_load import loads_json

    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RECORD "))
    return loads_json(line[len("RECORD "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--shard-mb", type=int, default=512)
    parser.add_argument("--out", help="keep the checkpoints here (default: a temporary folder, removed)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-convert-"))
    rows = []
    try:
        for form in args.forms:
            src = build(form, root / form, args.shard_mb)
            shards = sorted(src.glob("*.safetensors"))
            record = convert_in_child(src, root / form / "bf16")
            grown = record["peak_rss_bytes"] - record["rss_before_bytes"]
            row = {"form": form, "format": record["format"], "shards": len(shards),
                   "source_bytes": sum(p.stat().st_size for p in shards),
                   "largest_shard_bytes": record["largest_source_shard_bytes"], "converted_bytes": record["bytes_written"],
                   "seconds": record["seconds"], "peak_rss_growth_bytes": grown,
                   "growth_over_largest_shard": round(grown / record["largest_source_shard_bytes"], 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(root / form / "bf16")
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    table = ["| form | format | shards | source MB | largest shard MB | converted MB | seconds | peak RSS growth MB | growth / largest shard |",
             "|---|---|---|---|---|---|---|---|---|"]
    mb = 2**20
    for r in rows:
        table.append(f"| {r['form']} | {r['format']} | {r['shards']} | {r['source_bytes'] / mb:.0f} | "
                     f"{r['largest_shard_bytes'] / mb:.0f} | {r['converted_bytes'] / mb:.0f} | {r['seconds']:.1f} | "
                     f"{r['peak_rss_growth_bytes'] / mb:.0f} | {r['growth_over_largest_shard']} |")
    print("\n".join(table))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
