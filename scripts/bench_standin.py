"""Wall time of a stand-in run against the same model in our own recipe, side by side, one run.

    python scripts/bench_standin.py [--quick] [--new-tokens N] [--repeats R] [--checkout PATH] [--json out.json]

One Qwen3 checkpoint in the HF shapes (random weights; default hidden 512, 8 layers, 8 heads of 64:
about 28M parameters; --quick: the 2-layer test model), run two ways on this host's cpu, bf16:

  (a) our own recipe for it (standalone target: the migrator's engine, no torch_npu), `bash infer.sh`
  (b) upstream cann-recipes-infer's qwen recipe, `executor/scripts/infer.sh --model qwen --yaml F`,
      under `migrator standin --device cpu`: the NPU path of upstream's engine on reference kernels

Both generate --new-tokens tokens greedily from the default prompt after their own warm-up. Per
system: the wall time of the whole command (start-up, load, warm-up, generation) and the prefill /
mean decode forward times from its own log, read the standard way (agent.measure.baseline.collect). The
runs interleave, the order alternating each repeat; the median over the repeats and the ratio
(b) / (a) are reported. CPU figures are ratios of one host: neither is an NPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from engine.safe_load import loads_json  # noqa: E402 - the repository on sys.path first

FULL_DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=64)
NAME = "bench_qwen3"
RENDER = """
import json, sys
from agent.workflow.run import run_migration
summary = run_migration({"target": sys.argv[1], "output_dir": sys.argv[2], "name": sys.argv[3], "device": "cpu",
                         "dtype": "bfloat16", "max_new_tokens": int(sys.argv[4])}, stop_after="render")
print(json.dumps({"recipe_dir": summary["recipe_dir"]}))
"""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 2-layer test model, one repeat")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, help="interleaved repeats, median reported (default 3; quick: 1)")
    parser.add_argument("--checkout", default=str(REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"),
                        help="a cann-recipes-infer checkout (copied, never written)")
    parser.add_argument("--workdir", help="where everything goes (default: a temp dir, removed)")
    parser.add_argument("--json", help="write the numbers to this file")
    return parser.parse_args(argv)


def render_our_recipe(checkpoint: Path, out: Path, new_tokens: int) -> Path:
    proc = subprocess.run([sys.executable, "-c", RENDER, str(checkpoint), str(out), NAME, str(new_tokens)],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"rendering our recipe failed:\n{proc.stderr[-3000:]}")
    return Path(loads_json(proc.stdout.strip().splitlines()[-1])["recipe_dir"])


def timed(command: list[str], cwd: Path, env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def logged(log_dir: Path, yaml_path: Path) -> tuple[float, float]:
    from agent.measure.baseline import collect

    baseline, _ = collect(str(log_dir), str(yaml_path))
    return baseline["performance"]["prefill_ms"], baseline["performance"]["decode_avg_ms"]


def newest(pattern_root: Path, pattern: str) -> Path:
    found = sorted(pattern_root.glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit(f"no log under {pattern_root} matching {pattern}")
    return found[-1]


def main(argv=None) -> int:
    args = parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    checkout_src = Path(args.checkout)
    if not (checkout_src / "executor" / "scripts" / "infer.sh").is_file():
        sys.exit(f"{checkout_src}: not a cann-recipes-infer checkout (no executor/scripts/infer.sh)")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-standin-"))
    work.mkdir(parents=True, exist_ok=True)
    from agent.measure import reference as upstream

    dims = {} if args.quick else FULL_DIMS
    checkpoint = upstream.tiny_checkpoint("qwen3", work / "checkpoint", **dims)
    ours = render_our_recipe(checkpoint, work / "recipes", args.new_tokens)
    checkout = work / "cann-recipes-infer"
    if not checkout.exists():
        shutil.copytree(checkout_src, checkout)
        for path in [checkout, *checkout.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    yaml_name = "bench_qwen3_1tp.yaml"
    upstream_yaml = upstream.tiny_yaml(checkout / "models" / "qwen" / "config" / "qwen3_8b_1tp.yaml",
                                       checkout / "models" / "qwen" / "config" / yaml_name, checkpoint,
                                       max_new_tokens=args.new_tokens, input_len=128, exe_mode="eager")
    our_yaml = next((ours / "config").glob("*.yaml"))
    systems = {
        "ours": (["bash", str(ours / "infer.sh")], ours, lambda: newest(ours / "res", "*/*")),
        "standin": ([sys.executable, "-m", "agent.cli", "standin", "--",
                     *upstream.framework_command(checkout, "qwen", yaml_name)], work,
                    lambda: upstream.rank_logs(checkout, "qwen", yaml_name)[0].parent),
    }
    results = {name: {"wall_s": [], "prefill_ms": [], "decode_ms": []} for name in systems}
    # `python3` in both launch scripts is this interpreter (the one with torch, the engine, the stand-in)
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    for repeat in range(repeats):
        order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
        for name in order:
            command, cwd, log_dir = systems[name]
            wall = timed(command, cwd, env)
            prefill, decode = logged(log_dir(), upstream_yaml if name == "standin" else our_yaml)
            results[name]["wall_s"].append(wall)
            results[name]["prefill_ms"].append(prefill)
            results[name]["decode_ms"].append(decode)
            print(f"[bench] repeat {repeat + 1}/{repeats} {name}: wall {wall:.1f} s, prefill {prefill} ms, "
                  f"decode {decode} ms/token", file=sys.stderr)
    median = {name: {key: round(statistics.median(values), 2) for key, values in r.items()}
              for name, r in results.items()}
    ratio = {key: round(median["standin"][key] / median["ours"][key], 2) for key in ("wall_s", "prefill_ms", "decode_ms")}
    report = {"model": "qwen3", "dims": dims or "tiny (2 layers)", "new_tokens": args.new_tokens, "repeats": repeats,
              "ours": median["ours"], "standin": median["standin"], "standin_over_ours": ratio,
              "note": "host cpu, bf16; the stand-in run is upstream's NPU code path on reference kernels"}
    print(f"{'':10} {'wall s':>8} {'prefill ms':>11} {'decode ms':>10}")
    for name in ("ours", "standin"):
        m = median[name]
        print(f"{name:10} {m['wall_s']:>8} {m['prefill_ms']:>11} {m['decode_ms']:>10}")
    print(f"{'ratio':10} {ratio['wall_s']:>8} {ratio['prefill_ms']:>11} {ratio['decode_ms']:>10}  (stand-in / ours)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
