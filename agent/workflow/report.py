"""migration_report.json and a short human summary in the recipe."""

from __future__ import annotations

import json
import time
from pathlib import Path

from agent.errors import InputError
from agent.recipe.fs_guard import user_tree
from agent.recipe.backup import atomic_write
from agent.recipe.recipe import REPORT, report_path
from agent.records import Report
from agent.measure.verify import CODE_CHECK
from agent.workflow.state import MigrationState, standin_run
from engine.safe_load import load_json
from npu_standin import honest

REPORT_KEYS = ("scenario", "classify_reason", "status", "message", "model_name", "model_source",
               "model_dir", "architecture", "family", "vendored", "rendered", "env", "runs", "rounds",
               "memory", "baseline_path", "verification", "standin", "transformers",
               "native_model", "quantization", "conversion")


ORIGIN_KEYS = ("model_name", "model_source", "model_dir", "architecture", "family", "vendored", "rendered",
               "native_model", "quantization", "conversion")


def write_report(state: MigrationState) -> Path | None:
    if not state.get("recipe_dir"):
        return None
    recipe_dir = Path(state["recipe_dir"])
    recipe_tree = user_tree(recipe_dir, create=True)
    path = report_path(recipe_dir)
    in_checkout = path.parent != recipe_dir     # upstream's tree: our report beside our state, README untouched
    recipe_tree.mkdir(path.parent)

    for file in (path, path.parent / "migration_summary.md", recipe_dir / "README.md"):
        _refuse_link(file)
    report: Report = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    report.update({k: state.get(k) for k in REPORT_KEYS if state.get(k) is not None})
    if standin_run(state):      # the report names a --standin run's plan, its notes included (npu_standin.honest)
        report["upstream_standin"] = state["run_plan"]
    # A later B/C run knows less about the recipe's origin than the migration did: keep it.
    from agent.recipe.recipe import REPORT_MAX_BYTES, checked_report

    try:
        previous = checked_report(load_json(path, max_bytes=REPORT_MAX_BYTES))   # untrusted: schema-checked
    except (OSError, ValueError):
        previous = {}
    for key in ORIGIN_KEYS:
        if key not in report and key in previous:
            report[key] = previous[key]
    _standin_from_baseline(report)      # a stand-in baseline makes the report say so (npu_standin.honest)
    _write(path, json.dumps(report, indent=2, ensure_ascii=False, default=str) + "\n", recipe_dir)
    _write(path.parent / "migration_summary.md", human_summary(report, recipe_dir.name), recipe_dir)
    if report.get("baseline_path") and Path(report["baseline_path"]).is_file() and not in_checkout \
            and not report.get("upstream_standin"):
        # Only a run that wrote a baseline has a status worth putting in the user's README (not a
        # stand-in run of upstream's recipe: its files stay as upstream wrote them).
        update_readme(recipe_dir, report)
    if report.get("quantization") and report.get("vendored") and not report.get("upstream_standin"):
        from agent.recipe import readme

        from agent.measure.quant_cost import line

        quant = {**report["quantization"], "cost_line": line(report["quantization"].get("cost") or {"error": "not measured"})}
        readme.write_quantization(recipe_dir, quant)        # a framework / legacy README's 量化
    return path


def _standin_from_baseline(report: dict) -> None:
    """A baseline made under the npu stand-in makes the report say so too (device, reference kernels)."""
    try:
        baseline = load_json(Path(report["baseline_path"])) if report.get("baseline_path") else {}
    except (OSError, ValueError):
        baseline = {}
    honest.mark_report(report, baseline)


def _refuse_link(path: Path) -> None:
    """Never write through a symlink (it may point out of the recipe) or over a folder."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise InputError(f"{path} is a symlink or not a regular file; the migrator does not write through it: "
                         "replace it with a regular file or remove it")


def _write(path: Path, text: str, recipe_dir: Path) -> None:
    """Replace the file of the recipe `recipe_dir` (temporary file + rename, mode kept): a link placed
    there meanwhile is replaced, not followed."""
    _refuse_link(path)
    atomic_write(path, text.encode("utf-8"), path.stat().st_mode if path.exists() else None, root=recipe_dir)


README_BEGIN = "<!-- migration-summary:begin -->"
README_END = "<!-- migration-summary:end -->"


def update_readme(recipe_dir: Path, report: Report) -> None:
    """Keep a short, measurement-free summary in the recipe's README (same input, same README);
    the numbers are in baseline/ and migration_summary.md. Text outside the markers is kept."""
    readme = recipe_dir / "README.md"
    _refuse_link(readme)
    if not readme.is_file():
        return
    parity = (report.get("verification") or {}).get("parity") or {}
    lines = [README_BEGIN, "## Migration status", "",
             f"- scenario {report.get('scenario')}: {report.get('classify_reason', '')}",
             f"- status: **{report.get('status', 'unknown')}**"]
    if report.get("message"):
        lines.append(f"- {report['message']}")
    if parity.get("checked"):
        lines.append(f"- precision against transformers: {parity_line(parity)}")
    lines += quantization_lines(report)
    for rnd in report.get("rounds") or []:
        lines.append(f"- repair round {rnd['round']}: {rnd['diagnosis'].get('rule') or 'no rule'}"
                     f" ({'patched' if rnd.get('applied') else 'no patch'})")
    baseline = Path(report["baseline_path"]) if report.get("baseline_path") else None
    try:
        shown = baseline.relative_to(readme.parent).as_posix() if baseline else "baseline/"
    except ValueError:
        shown = baseline.name
    lines += [f"- details: `migration_report.json`, `migration_summary.md`, `{shown}`", README_END]
    text = readme.read_text()
    block = "\n".join(lines) + "\n"
    if README_BEGIN in text and README_END in text:
        head, _, rest = text.partition(README_BEGIN)
        text = head + block + rest.partition(README_END)[2].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    _write(readme, text, recipe_dir)


def human_summary(report: Report, folder_name: str | None = None) -> str:
    title = report.get("model_name") or folder_name or Path(report.get("recipe_dir") or "recipe").name
    lines = [f"# Migration summary: {title}", ""]
    lines.append(f"- scenario: {report.get('scenario')} ({report.get('classify_reason', '')})")
    lines.append(f"- status: **{report.get('status', 'unknown')}** {report.get('message', '')}".rstrip())
    if report.get("architecture"):
        lines.append(f"- architecture: {report['architecture']} (family {report.get('family')})")
    env = report.get("env") or {}
    lines.append(f"- device: {env.get('device')} (torch {env.get('pytorch_version')}, "
                 f"torch_npu: {env.get('torch_npu_status')})")
    lines += honest.summary_lines(report)
    if report.get("conversion"):
        lines.append(f"- weights: {conversion_line(report['conversion'])}")
    if (report.get("vendored") or {}).get("auto_map_note"):
        lines.append(f"- code: {report['vendored']['auto_map_note']}")
    if (report.get("vendored") or {}).get("text_decoder_note"):
        lines.append(f"- served: {report['vendored']['text_decoder_note']}")
    for run in report.get("runs") or []:
        if run.get("peak_rss_bytes"):
            lines.append(f"- run {run.get('label')}: {'ok' if run.get('ok') else 'failed'} in {run.get('seconds')} s, "
                         f"peak RSS {run['peak_rss_bytes'] / 2**20:.0f} MiB over {run.get('processes')} process(es)")
    for rnd in report.get("rounds") or []:
        lines.append(f"- repair round {rnd['round']}: {rnd['diagnosis'].get('diagnosis')}"
                     f" -> {'patched' if rnd.get('applied') else 'no patch'}")
    if report.get("baseline_path"):
        try:
            perf = load_json(Path(report["baseline_path"]))["performance"]
            lines.append(f"- baseline: prefill {perf['prefill_ms']} ms, decode {perf['decode_avg_ms']} ms/token")
        except (OSError, KeyError, ValueError):
            lines.append(f"- baseline: {report['baseline_path']}")
    parity = (report.get("verification") or {}).get("parity")
    if parity:
        lines.append(f"- precision against transformers: {parity_line(parity)}")
        if parity.get("code"):
            lines.append(f"- {CODE_CHECK}: {code_line(parity['code'])}")
        if parity.get("empty_output"):
            lines.append(f"- output: empty — {parity['empty_output']}")
    output_check = (report.get("verification") or {}).get("output_check") or {}
    if output_check:
        verdict = {True: "ok", False: "FAILED", None: "not checked"}[output_check.get("ok")]
        why = output_check.get("skipped") or "; ".join(output_check.get("reasons") or [])
        lines.append(f"- output text check: {verdict}" + (f" ({why})" if why else ""))
    lines += quantization_lines(report)
    return "\n".join(lines) + "\n"


def code_line(code: dict) -> str:
    """The code check's verdict: its numbers, or why it gave none."""
    verdict = {True: "ok", False: "FAILED", None: "not checked"}[code.get("ok")]
    if not code.get("checked"):
        return f"{verdict}: {code.get('reason')}"
    return (f"{verdict} (max |dlogits| {code.get('max_abs_logits_diff')}, tolerance {code.get('tolerance')}; "
            f"greedy tokens equal: {code.get('greedy_tokens_equal')})" +
            (f"; {code['reason']}" if code.get("ok") is False and code.get("reason") else ""))


def quantization_lines(report: Report) -> list[str]:
    """--quantize: the checkpoint written (path, format, the command that redoes it) and the cost of quantizing."""
    quant = report.get("quantization")
    if not quant:
        return []
    from agent.measure.quant_cost import line

    lines = [f"- quantized ({quant.get('scheme')}): `{quant.get('checkpoint')}`, {quant.get('format')}, "
             f"{quant.get('quantized_layers')} linear layers int8, float kept: {', '.join(quant.get('kept_float') or [])}"
             f"; from `{quant.get('source')}`, redo: `{quant.get('command')}`"]
    if quant.get("cost"):
        lines.append(f"- cost of quantizing against the float original: {line(quant['cost'])}")
    return lines


def conversion_line(conversion: dict) -> str:
    """What was converted, where to, and the command that redoes it (the report, the summary, the README)."""
    peak = conversion.get("peak_rss_bytes", 0) - conversion.get("rss_before_bytes", 0)
    return (f"{conversion.get('format')} converted to {conversion.get('dtype')} ({conversion.get('why')}) in "
            f"{conversion.get('seconds')} s, peak memory +{peak / 2**20:.0f} MiB (largest source shard "
            f"{conversion.get('largest_source_shard_bytes', 0) / 2**20:.0f} MiB): {conversion.get('path')}; redo with "
            f"`{conversion.get('command')}`")


def parity_line(parity: dict) -> str:
    """Which check ran, its verdict, and how close the closest step came to its tolerance."""
    verdict = {True: "ok", False: "FAILED", None: "not checked"}[parity.get("ok")]
    method = parity.get("method") or "parity"
    if not parity.get("checked"):
        return f"{verdict} ({method}: {parity.get('reason')})"
    closest = parity.get("closest") or {}
    where = ""
    if closest:
        step = "the prefill" if closest.get("phase") == "prefill" else f"decode step {closest.get('step')}"
        where = (f"; closest: {step} of request {closest.get('request')} on rank {closest.get('rank')}, "
                 f"|dlogits| {closest.get('max_abs_logits_diff')} = {closest.get('ratio')} x its tolerance "
                 f"{closest.get('tolerance')}")
    counted = (f"{parity.get('steps_checked')} steps ({parity.get('decode_steps_checked')} decode) of "
               f"{parity.get('requests')} request(s) on {parity.get('ranks')} rank(s), {parity.get('dtype')}"
               if parity.get("steps_checked") is not None else
               f"max |dlogits| {parity.get('max_abs_logits_diff')}, greedy tokens equal: {parity.get('greedy_tokens_equal')}")
    ties = (f"; {parity['routing_ties_taken']} MoE routing tie(s) resolved as the recipe's kernels resolved them"
            if parity.get("routing_ties_taken") else "")
    failed = f"; {parity.get('reason')}" if parity.get("ok") is False and parity.get("reason") else ""
    weights = f"; reference: {parity['reference_weights']}" if parity.get("reference_weights") else ""
    return f"{verdict} ({method}: {counted}{where}{ties}{weights}{failed})"
