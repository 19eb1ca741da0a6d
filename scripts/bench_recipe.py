"""Benchmark a migrated recipe against transformers, on the same weights and device.

    python scripts/bench_recipe.py [--quick] [--new-tokens N] [--repeats R] [--json out.json]

Builds a llama checkpoint (about 28M parameters; --quick: the 2-layer test model), renders a
recipe for it with the migrator's own graph, then measures side by side, in one process:

  (a) the recipe's decode time per token, exe_mode eager
  (b) the same recipe, exe_mode graph (compiled decode step, static cache)
  (c) transformers `generate()` (greedy, min_new_tokens = max_new_tokens)
  (d) the migrator's overhead: detect_env -> classify -> acquire -> vendor -> render in a fresh
      process (run_migration stopped after render), i.e. the time from start to a rendered recipe,
      no model run

Per-token time is measured the same way for (a)-(c): the wall time T(n) of a whole generation of
n tokens and T(1) of a prefill-only one, per_token = (T(n) - T(1)) / (n - 1). Each system is warmed
up first (graph mode compiles there); the runs are interleaved, the order rotating each repeat,
and the median over the repeats is reported. The recipe's own logged decode times (the numbers
its baseline reports) are shown alongside. Achieved bandwidth is the weight bytes over the per-token
time; it is held against this host's memory-read rate measured in the same run (a sum over a buffer
far larger than the caches, same torch threads), i.e. the floor a batch-1 decode step cannot beat.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from engine import environment  # noqa: E402
from engine.logging_utils import res_path  # noqa: E402
from engine.safe_load import loads_json  # noqa: E402

torch = environment.import_torch()

# hidden 512, 8 layers, MLP 1536, 8 heads of 64: 27.7M parameters with the 384-token tokenizer.
FULL_DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=8, head_dim=64)
NAME = "bench"
TARGETS = {"eager_vs_transformers": 1.05, "transformers_vs_graph": 1.3}

# Runs in a fresh interpreter: the migrator's graph up to a rendered recipe; each node's time is
# on its progress line ("[migrator] NODE done in Ss").
RENDER = """
import json, sys, time
t0 = time.perf_counter()
from agent.workflow.run import run_migration
state = {"target": sys.argv[1], "output_dir": sys.argv[2], "name": sys.argv[3], "device": sys.argv[4],
         "max_new_tokens": int(sys.argv[5])}
summary = run_migration(state, stop_after="render")
print(json.dumps({"in_process_s": round(time.perf_counter() - t0, 3), "recipe_dir": summary["recipe_dir"]}))
"""
STEP_RE = re.compile(r"^\[migrator\] (\w+) done in ([\d.]+)s", re.M)


def render(ckpt: Path, out_dir: Path, device: str, new_tokens: int) -> dict:
    """(d): the migrator from a fresh process to a rendered recipe; wall time includes start-up."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RENDER, str(ckpt), str(out_dir), NAME, device, str(new_tokens)],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"rendering the recipe failed:\n{proc.stderr[-3000:]}")
    result = loads_json(proc.stdout.strip().splitlines()[-1])
    result["steps_s"] = {m.group(1): float(m.group(2)) for m in STEP_RE.finditer(proc.stderr)}
    result["wall_s"] = round(wall, 3)
    return result


def load_runner(recipe: Path, exe_mode: str, device: str, new_tokens: int):
    """The recipe's Runner, built as its infer.py builds it, with exe_mode set."""
    from engine.config import load_runner_settings

    if str(recipe) not in sys.path:
        sys.path.insert(0, str(recipe))
    model_setting = importlib.import_module("models.model_setting")
    settings = load_runner_settings(next((recipe / "config").glob("*.yaml")))
    settings.update(exe_mode=exe_mode, device=device)
    settings["data_config"]["max_new_tokens"] = new_tokens
    model_setting.check_vars(settings)
    model_setting.update_vars(settings)
    from agent.recipe.recipe import runner_files

    module = importlib.import_module(runner_files(recipe)[0].stem)
    runner = next(obj for key, obj in vars(module).items() if key.endswith("Runner") and key != "ModelRunner")
    runner = runner(settings)
    runner.init_model()
    # transformers' min_new_tokens keeps EOS from ending a run early; the recipe has no such
    # option, so it gets no EOS ids: both always generate exactly n tokens.
    runner.eos_ids = runner.eos_ids[:0]
    # One line per forward goes to log_0.log (part of the recipe's cost); not to the terminal.
    for handler in list(runner.logger.handlers):
        if getattr(handler, "stream", None) in (sys.stdout, sys.stderr):
            runner.logger.removeHandler(handler)
    return runner


class RecipeSystem:
    def __init__(self, label, runner, prompts):
        self.label, self.runner, self.prompts = label, runner, prompts
        self.log = res_path(runner.model_name) / f"log_{runner.rank}.log"    # where the engine's logger writes

    def generate(self, n: int) -> list[int]:
        self.runner.max_new_tokens = n
        self.runner.model_generate(self.prompts)
        return self.runner.last_generate_ids[0].tolist()

    def logged_decode_ms(self, n: int) -> float:
        """Mean logged decode time of the last n-token generation, first step excluded (as the baseline)."""
        times = re.findall(r"inference time cost of (prefill|decode) is ([\d.]+) ms", self.log.read_text())
        decodes = [float(ms) for stage, ms in times[-n:] if stage == "decode"][1:]
        return statistics.mean(decodes) if decodes else float("nan")


class TransformersSystem:
    label = "transformers generate()"

    def __init__(self, ckpt: Path, device, dtype, prompts):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, local_files_only=True)
        self.model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
        self.tokenizer.padding_side = "left"
        self.device, self.prompts = device, prompts

    def generate(self, n: int) -> list[int]:
        inputs = self.tokenizer(self.prompts, return_tensors="pt", padding=True).to(self.device)
        with torch.inference_mode():
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=self.tokenizer.pad_token_id)
        environment.synchronize(self.device)
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        self.tokenizer.batch_decode(out, skip_special_tokens=True)
        return ids


def measured_read_bandwidth_gbps(device, mib: int = 512, repeats: int = 5) -> float:
    """The memory-read limit of this host/device as measured here (same torch threads as the decode):
    best time of a sum over a buffer far larger than any cache. A decode step of batch 1 reads every
    weight once, so weight bytes / this rate is the per-token floor the GB/s column is held against."""
    buf = torch.ones(mib << 18, dtype=torch.float32, device=device)   # mib MiB of fp32
    buf.sum()
    environment.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        environment.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return buf.numel() * buf.element_size() / best / 1e9


def timed(system, n: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = system.generate(n)
    return time.perf_counter() - start, ids


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: the 2-layer test model, 8 tokens, 1 repeat, dynamo's eager backend")
    parser.add_argument("--new-tokens", type=int, help="tokens per generation (default 64; quick: 8)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats, median reported (default 5; quick: 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--compile-backend",
                        help="torch.compile backend for graph mode (default: the engine's; quick: eager)")
    parser.add_argument("--preset", help="instead of the 27.7M llama: a published shape from "
                        "scripts/bench_pipeline.py's PRESETS (random weights in its dtype), e.g. qwen3-1.7b")
    parser.add_argument("--layers", type=int, help="--preset cut to this many layers (a smoke run)")
    parser.add_argument("--workdir", help="where the checkpoint, recipe and logs go (default: a temp dir)")
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args(argv)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.compile_backend = args.compile_backend or ("eager" if args.quick else None)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint
    from engine.data import load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_recipe_")).resolve()
    if args.preset:
        from scripts.bench_pipeline import build_checkpoint

        ckpt = build_checkpoint(args.preset, work / "checkpoint", args.layers)
    else:
        ckpt = build_tiny_checkpoint("llama", work / "checkpoint", **({} if args.quick else FULL_DIMS))
    os.environ["RES_PATH"] = str(work / "res")
    n = args.new_tokens

    # (d) the migrator's overhead; its recipe is the one measured below.
    migrator = render(ckpt, work / "recipes", args.device, n)
    recipe = Path(migrator["recipe_dir"])

    prompts = load_prompts("default", 1)
    eager = RecipeSystem("recipe eager", load_runner(recipe, "eager", args.device, n), prompts)
    if args.compile_backend:
        # e.g. dynamo's "eager" backend: traces and guards like the real thing, generates no code.
        compile_ = torch.compile
        torch.compile = functools.partial(compile_, backend=args.compile_backend)
    graph = RecipeSystem("recipe graph", load_runner(recipe, "graph", args.device, n), prompts)
    if args.compile_backend:
        torch.compile = compile_
    hf = TransformersSystem(ckpt, eager.runner.device, eager.runner.dtype, prompts)
    params = sum(p.numel() for p in hf.model.parameters())
    systems = [eager, graph, hf]

    # Warm-up: the graph runner compiles its decode step here, as infer.py's warm-up run does.
    warm = {}
    for system in systems:
        start = time.perf_counter()
        if isinstance(system, RecipeSystem):
            system.runner.max_new_tokens = n
            system.runner.model_generate(prompts, warm_up=True)
            system.runner.model_generate(prompts, warm_up=True)  # one more: a graph-mode recompile would show
        else:
            system.generate(n)
            system.generate(n)
        warm[system.label] = round(time.perf_counter() - start, 3)

    per_token = {s.label: [] for s in systems}
    logged = {s.label: [] for s in systems if isinstance(s, RecipeSystem)}
    tokens = {}
    for rep in range(args.repeats):
        for system in systems[rep % 3:] + systems[:rep % 3]:
            t_n, ids = timed(system, n)
            if isinstance(system, RecipeSystem):
                logged[system.label].append(system.logged_decode_ms(n))
            t_1, _ = timed(system, 1)
            per_token[system.label].append((t_n - t_1) / (n - 1) * 1000)
            tokens[system.label] = ids
    median = {label: statistics.median(v) for label, v in per_token.items()}
    # Each decode step reads every weight once: weight bytes / per-token time (batch 1).
    weight_bytes = eager.runner.model_bytes
    gbps = {label: weight_bytes / (ms / 1000) / 1e9 for label, ms in median.items()}
    logged_median = {label: statistics.median(v) for label, v in logged.items()}
    limit_gbps = measured_read_bandwidth_gbps(eager.runner.device, mib=64 if args.quick else 512)
    floor_ms = weight_bytes / limit_gbps / 1e6

    ratios = {
        "eager_vs_transformers": median[eager.label] / median[hf.label],
        "transformers_vs_graph": median[hf.label] / median[graph.label],
    }
    match = {
        "graph_equals_eager": tokens[graph.label] == tokens[eager.label],
        "eager_equals_transformers": tokens[eager.label] == tokens[hf.label],
    }

    shape = (f"preset {args.preset}" + (f" cut to {args.layers} layers" if args.layers else "") if args.preset
             else "quick test dims" if args.quick else ", ".join(f"{k}={v}" for k, v in FULL_DIMS.items()))
    print(f"model: {args.preset or 'llama'}, {params / 1e6:.1f}M parameters ({shape}), "
          f"{eager.runner.dtype}, device {eager.runner.device}, torch threads {torch.get_num_threads()}")
    print(f"prompt {eager.runner.tokenizer(prompts, return_tensors='pt')['input_ids'].shape[1]} tokens, "
          f"{n} new tokens, {args.repeats} interleaved repeats (median), "
          f"graph backend: {args.compile_backend or 'engine default'}")
    print()
    print(f"weights {weight_bytes / 1e6:.1f} MB read per decode step; measured memory-read limit "
          f"{limit_gbps:.2f} GB/s here -> floor {floor_ms:.3f} ms/token")
    print(f"{'system':<26}{'per-token ms':>14}{'GB/s':>9}{'x floor':>9}{'logged decode ms':>18}{'warm-up s':>11}"
          f"   all repeats (ms)")
    for system in systems:
        label = system.label
        shown = f"{logged_median[label]:.3f}" if label in logged_median else "-"
        runs = " ".join(f"{v:.2f}" for v in per_token[label])
        print(f"{label:<26}{median[label]:>14.3f}{gbps[label]:>9.2f}{median[label] / floor_ms:>9.2f}{shown:>18}"
              f"{warm[label]:>11.2f}   {runs}")
    print()
    for key, target in TARGETS.items():
        op = "<=" if key == "eager_vs_transformers" else ">="
        met = ratios[key] <= target if op == "<=" else ratios[key] >= target
        what = ("eager / transformers per-token time" if key == "eager_vs_transformers"
                else "transformers / graph speedup")
        print(f"ratio {what}: {ratios[key]:.3f} (target {op} {target}: {'met' if met else 'NOT met'})")
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in migrator["steps_s"].items())
    print(f"migrator overhead to a rendered recipe: {migrator['wall_s']:.2f} s wall in a fresh process "
          f"({steps})")
    print(f"greedy tokens: graph == eager: {match['graph_equals_eager']}, "
          f"eager == transformers: {match['eager_equals_transformers']}")

    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": {"type": args.preset or "llama", "parameters": params, "layers": args.layers,
                      "dims": None if args.quick or args.preset else FULL_DIMS,
                      "dtype": str(eager.runner.dtype), "device": str(eager.runner.device)},
            "settings": {"new_tokens": n, "repeats": args.repeats, "threads": torch.get_num_threads(),
                         "compile_backend": args.compile_backend, "quick": args.quick},
            "per_token_ms": median, "per_token_ms_all": per_token,
            "weight_bytes": weight_bytes, "achieved_bandwidth_gbps": gbps, "logged_decode_ms": logged_median,
            "measured_read_limit_gbps": limit_gbps, "floor_ms": floor_ms,
            "times_floor": {label: ms / floor_ms for label, ms in median.items()},
            "warm_up_s": warm, "ratios": ratios, "targets": TARGETS, "tokens_match": match,
            "migrator_overhead": migrator, "workdir": str(work),
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
