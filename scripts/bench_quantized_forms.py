"""Published-form quantized tiny checkpoints through the one command, as a user runs it (issue 43's note table):

    python scripts/bench_quantized_forms.py [--forms deepseek_v3 gpt_oss w8a8 awq] [--json FILE] [--markdown FILE]

Each form (tests/support/quantized_checkpoints.py: the publishers' config keys and tensor names at tiny sizes) is
migrated by `migrator standin -- migrator run CKPT --output-dir CHECKOUT/models` into a fresh copy of the upstream
checkout (../shared/upstream/cann-recipes-infer) and run by upstream's launcher under the npu stand-in. The row:
the route the migration took (converted, to what; or run quantized as published), the framework model (native or
the adapter), the per-step verdict against transformers, the stand-in's quantized kernels, the wall time of the
whole command, and the conversion's own seconds and peak resident-memory growth (its record in the report).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

# form -> (builder in quantized_checkpoints, its keyword arguments, the recipe name)
FORMS = {
    "deepseek_v3": ("deepseek_v3_fp8", {"shards": 3}, "deepseek_v3"),     # block-FP8, MLA + MoE, MTP, auto_map
    "gpt_oss": ("gpt_oss_mxfp4", {}, "gpt_oss_mx"),                       # MXFP4 experts
    "w8a8": ("qwen3_w8a8", {}, "qwen3_w8a8"),                              # compressed-tensors int8 W8A8, dense
    "awq": ("llama_awq", {}, "llama_awq"),                                 # AutoAWQ GEMM int4, dense
}
QUANT_KERNELS = ("npu_quant_matmul", "npu_dynamic_quant", "npu_dequant_swiglu_quant")


def _summary(stdout: str) -> dict:
    from engine.safe_load import loads_json

    if "{" not in stdout:
        return {}
    return loads_json(stdout[stdout.index("{"):stdout.rindex("}") + 1], "the migration's summary")


def migrate(form: str, root: Path) -> dict:
    import quantized_checkpoints as forms
    from agent.child_failure import child_failure
    from engine.safe_load import load_json
    from upstream_checkout import copy_checkout

    builder, kwargs, name = FORMS[form]
    src, _ = getattr(forms, builder)(root / form / "checkpoint", **kwargs)
    checkout = copy_checkout(root / form)
    python = ROOT / ".venv-tf5.0" / "bin" / "python"
    extra = ["--reference-python", str(python)] if python.is_file() else ["--transformers-source", "installed"]
    command = [sys.executable, "-m", "agent.cli", "standin", "--", sys.executable, "-m", "agent.cli", "run", str(src),
               "--output-dir", str(checkout / "models"), "--name", name, "--max-new-tokens", "8", "--max-rounds", "0",
               "--json", *extra]
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=root, timeout=3600)
    seconds = time.monotonic() - started
    summary = _summary(proc.stdout)
    report_file = checkout / "models" / name / "res" / ".migrator" / "migration_report.json"
    report = load_json(report_file) if report_file.is_file() else {}
    conversion = report.get("conversion") or {}
    native = report.get("native_model") or {}
    kernels = (report.get("standin") or {}).get("reference_kernels") or {}
    precision = summary.get("precision") or {}
    if conversion:
        route = f"{conversion.get('format')} converted to {conversion.get('dtype') or 'bfloat16'}"
    elif (report.get("quantization") or {}).get("format") or "quantization_config" in (src / "config.json").read_text():
        route = "run quantized as published (module.quantization)"
    else:
        route = "float"
    return {
        "form": form, "exit": proc.returncode, "status": summary.get("status"), "route": route,
        "framework_model": ("native" if native.get("native") else
                            f"adapter ({native.get('fell_back')})" if native else None),
        "verdict": ("ok" if precision.get("ok") else "FAIL" if precision.get("checked") else "not checked"),
        "decode_steps_checked": precision.get("decode_steps_checked"),
        "quantized_kernels": {k: v for k, v in kernels.items() if k in QUANT_KERNELS},
        "seconds": round(seconds, 1),
        "conversion_seconds": conversion.get("seconds"),
        "conversion_peak_rss_growth_bytes": (conversion["peak_rss_bytes"] - conversion["rss_before_bytes"]
                                             if conversion.get("peak_rss_bytes") else None),
        "error": None if proc.returncode == 0 else child_failure(proc.stderr, proc.returncode, stdout=proc.stdout)[:300],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--keep", help="keep the checkpoints and checkouts here (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-forms-"))
    rows = []
    try:
        for form in args.forms:
            rows.append(migrate(form, root))
            print(json.dumps(rows[-1]), flush=True)
            if not args.keep:
                shutil.rmtree(root / form, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    table = ["| form | route | framework model | verdict | quantized kernels | time s | conversion s | "
             "conversion peak RSS growth MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        growth = r["conversion_peak_rss_growth_bytes"]
        kernels = ", ".join(f"{k} x{v}" for k, v in r["quantized_kernels"].items()) or "-"
        verdict = r["verdict"] + ("" if r["exit"] == 0 else f" (exit {r['exit']}: {r['error']})")
        table.append(f"| {r['form']} | {r['route']} | {r['framework_model']} | {verdict} | {kernels} | "
                     f"{r['seconds']} | {r['conversion_seconds'] if r['conversion_seconds'] is not None else '-'} | "
                     f"{f'{growth / 2**20:.0f}' if growth is not None else '-'} |")
    print("\n".join(table))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text("\n".join(table) + "\n")
    return 0 if all(r["exit"] == 0 and r["verdict"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
