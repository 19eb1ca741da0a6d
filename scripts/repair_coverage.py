#!/usr/bin/env python3
"""How much of the field corpus the repair catalogue handles.

    python scripts/repair_coverage.py                 # in-process: every corpus log vs the catalogue
    python scripts/repair_coverage.py --inject        # also every fault injection (real `migrator run`)
    python scripts/repair_coverage.py --write-readme  # regenerate tests/field_faults/README.md
    python scripts/repair_coverage.py --inject --only npu-oom infer-sh-crlf   # some modes only

In-process, each entry's log runs against the whole catalogue on a minimal recipe holding the
report's recipe code (as tests/unit/agent/repair/test_field_corpus.py does); an entry counts as
repaired when the first rule that takes it edits the recipe, reported when a report-only rule (or the out-of-memory
path) names it, exit4 for NPU kernels, unknown otherwise. --inject runs every injection of
tests/support/field_injections.py (each corpus entry in our recipe layout, many also in the upstream
cann-recipes-infer layout; real faults, or replayed where this host cannot have them) with
`migrator run REL --json` and `migrator rollback REL`, --jobs at a time, and prints each run's
outcome, the rule of each round, rollback, and the totals. With --write-readme too, the README gets
the measured outcome of each injection.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from engine.safe_load import load_yaml, loads_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))     # the suite's field injections and mini recipe

CORPUS_FILE = ROOT / "tests" / "field_faults" / "corpus.yaml"
README = ROOT / "tests" / "field_faults" / "README.md"


def load_corpus() -> list[dict]:
    import yaml

    return load_yaml(CORPUS_FILE)


def classify(entry: dict, root: Path) -> tuple[str, str | None]:
    """(repaired | reported | exit4 | unknown, rule) for one corpus entry, in-process."""
    from agent.repair.failure import Failure
    from agent.repair.diagnose import first_matching_rule
    from agent.repair.rules.rule import RepairContext
    from mini_recipe import mini_recipe

    recipe = mini_recipe(root, entry)
    matched = first_matching_rule(Failure.from_output(recipe, entry["log"]))
    if matched is None:
        return ("exit4" if entry["outcome"] == "exit4" else "unknown"), None
    rule, facts = matched
    before = {p: p.read_bytes() for p in recipe.rglob("*") if p.is_file()}
    rule.fix(Failure.from_output(recipe, entry["log"]), loads_json(json.dumps(facts, default=str)), RepairContext())
    changed = before != {p: p.read_bytes() for p in recipe.rglob("*") if p.is_file()}
    return ("repaired" if changed else "reported"), rule.name


def run_injections(jobs: int = 2, only: list[str] | None = None) -> list[dict]:
    """Every injection of tests/support/field_injections.py, run for real (~10-60 s each)."""
    from concurrent.futures import ThreadPoolExecutor

    from npu_wheel import torch_npu_wheel
    from field_injections import build_working_recipe, cases, run_injection

    todo = [(i, layout) for i, layout in cases() if not only or i.id in only or i.test_id(layout) in only]
    wheel, why_not = torch_npu_wheel()
    with tempfile.TemporaryDirectory(prefix="repair_coverage_") as tmp:
        source = build_working_recipe(Path(tmp))

        def one(case):
            injection, layout = case
            if injection.needs_torch_npu and wheel is None:
                return {"test_id": injection.test_id(layout), "id": injection.id, "kind": injection.kind,
                        "layout": layout, "expected": injection.expected(layout), "outcome": "skipped",
                        "rules": [], "expected_rules": injection.rules(layout), "rounds": 0, "rollback": "-",
                        "rollback_ok": True, "ok": True, "seconds": 0, "why": why_not}
            result = run_injection(injection, layout, Path(tmp) / injection.test_id(layout), source)
            return {k: v for k, v in result.items() if k in (
                "test_id", "id", "kind", "layout", "expected", "expected_rules", "outcome", "rules", "rounds",
                "rollback", "rollback_ok", "ok", "seconds", "returncode")}

        results = []
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for r in pool.map(one, todo):
                results.append(r)
                rules = " -> ".join(str(x) for x in r["rules"]) or "-"
                print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['test_id']:<58} {r['outcome']:<9} rule={rules} "
                      f"rounds={r['rounds']} rollback={r['rollback']} {r['seconds']}s", flush=True)
    return results


def injection_totals(results: list[dict]) -> list[str]:
    """The totals table (markdown) of an --inject run: by layout and kind, then all."""
    outcomes = ("repaired", "reported", "oom", "exit4", "unknown")
    rows = ["| injections | runs | repaired | reported | out of memory | exit 4 | unknown | other | skipped | "
            "rounds used (sum; max) | rollback ok | as expected |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = [(f"{layout}, {kind}", [r for r in results if r["layout"] == layout and r["kind"] == kind])
              for layout in ("ours", "upstream") for kind in ("real", "replayed")]
    groups.append(("all", results))
    for label, group in groups:
        if not group:
            continue
        c = Counter(r["outcome"] for r in group)
        other = sum(v for k, v in c.items() if k not in (*outcomes, "skipped"))
        rounds = [r["rounds"] for r in group]
        rows.append(f"| {label} | {len(group)} | " + " | ".join(str(c[k]) for k in outcomes) +
                    f" | {other} | {c['skipped']} | {sum(rounds)}; {max(rounds)} | "
                    f"{sum(r['rollback_ok'] for r in group)}/{len(group)} | {sum(r['ok'] for r in group)}/{len(group)} |")
    return rows


def write_readme(corpus: list[dict], results: list[dict] | None = None) -> None:
    from field_injections import BY_ID

    measured = {r["test_id"]: r for r in results or []}
    rows = ["# Field failure corpus", "",
            "Failures recipe runs hit in the field, mined from public issue threads with the `search` tool.",
            "Machine-readable twin: `corpus.yaml` (same ids; the log excerpts are copied from the threads).",
            "`tests/unit/agent/repair/test_field_corpus.py` runs every log against the whole catalogue (which rule",
            "fires first);",
            "`scripts/repair_coverage.py` measures it. Generated by `scripts/repair_coverage.py --write-readme`.",
            "",
            "Every entry also has a fault injection (`tests/support/field_injections.py`, run by",
            "`tests/e2e/test_field_fault_injections.py::test_injected_field_fault[TEST_ID]` and",
            "`repair_coverage.py --inject`):",
            "the fault put into a working recipe (`ours`: this tool's layout; `upstream`: the cann-recipes-infer",
            "layout of `tests/support/checkout_fixture.py`), `migrator run REL` and `migrator rollback REL` for real.",
            "`real-...`: the fault itself fails on this host; `replayed-...`: a failure this CPU host cannot",
            "have (NPU, CANN, HCCL, accelerator memory) is replayed by recipe code that writes the report's log",
            "lines where it happened and exits. Tests marked (fast) run in `make test`, the others with `-m ''`.",
            "",
            "| id | failure | source thread | how it shows in a log | handled by | injection test |",
            "|---|---|---|---|---|---|"]
    for e in corpus:
        errors = [ln.strip() for ln in e["log"].splitlines() if re.match(r"^\W*[\w.]*(Error|Exception)\b:?", ln.strip())]
        line = errors[-1] if errors else next((ln.strip() for ln in e["log"].splitlines()
                     if any(k in ln for k in ("Error", "error", "rror:", "failed", "EADDRINUSE", "must be", "\\r",
                                              "EH9999", "denied", "out of memory", "Invalid")) and ln.strip()),
                    e["log"].strip().splitlines()[0].strip())
        shown = line.replace("|", "\\|").replace("`", "'")
        if len(shown) > 160:
            shown = shown[:157] + "..."
        if e["outcome"] == "exit4":
            handled = f"exit 4: NPU kernel ({e.get('why', '')})"
        elif e["outcome"] == "unknown":
            handled = f"none: unknown failure ({e.get('why', '')})"
        elif e.get("oom"):
            handled = "report-only: out-of-memory path of `diagnose`"
        elif e["outcome"] == "reported":
            handled = f"`{e['expected_rule']}` (report-only: {e.get('why', '')})"
        else:
            handled = f"`{e['expected_rule']}` (repaired)"
        source = e["source"] if e["source"].startswith("http") else f"_{e['source']}_"
        injection = BY_ID[e["id"]]
        tests = []
        for layout in ("ours", "upstream") if injection.upstream else ("ours",):
            test_id = injection.test_id(layout)
            fast = injection.fast if layout == "ours" else injection.fast_upstream
            cell = f"`{test_id}`" + (" (fast)" if fast else "")
            if test_id in measured:
                r = measured[test_id]
                cell += f": {r['outcome']}, {' -> '.join(str(x) for x in r['rules']) or 'no rule'}"
            if layout == "upstream" and injection.why:
                cell += f" ({injection.why})"
            if layout == "ours" and injection.replayed_why:
                cell += f" (replayed: {injection.replayed_why})"
            tests.append(cell)
        rows.append(f"| {e['id']} | {e['failure']} | {source} | `{shown}` | {handled} | {'<br>'.join(tests)} |")
    sourced = sum(1 for e in corpus if not e.get("local"))
    rows += ["", f"{sourced} modes with a public source, {len(corpus) - sourced} reproduced locally (marked in "
             "italics): their message is what this torch prints; no thread with that exact text came back "
             "from the search tool.", ""]
    if results:
        rows += ["Measured by `scripts/repair_coverage.py --inject --write-readme`:", "", *injection_totals(results), ""]
    README.write_text("\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inject", action="store_true", help="also run every fault injection for real")
    parser.add_argument("--only", nargs="+", metavar="ID", help="with --inject: these corpus ids / test ids only")
    parser.add_argument("--jobs", type=int, default=2, help="with --inject: runs at a time (default 2)")
    parser.add_argument("--write-readme", action="store_true", help="regenerate tests/field_faults/README.md")
    args = parser.parse_args(argv)
    corpus = load_corpus()
    counts: Counter = Counter()
    mismatches = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in corpus:
            outcome, rule = classify(entry, Path(tmp))
            counts[outcome] += 1
            if outcome != entry["outcome"] or (rule != entry["expected_rule"] and not entry.get("oom")
                                                  and entry["outcome"] != "exit4"):
                mismatches.append(f"{entry['id']}: expected {entry['outcome']}/{entry['expected_rule']}, "
                                  f"got {outcome}/{rule}")
    by_cat = Counter(e["category"] for e in corpus)
    print(f"field corpus: {len(corpus)} modes ({sum(1 for e in corpus if not e.get('local'))} with a public source)")
    print("| outcome (in-process, first rule) | modes |\n|---|---|")
    for key in ("repaired", "reported", "exit4", "unknown"):
        print(f"| {key} | {counts[key]} |")
    print("categories: " + ", ".join(f"{k} {v}" for k, v in sorted(by_cat.items())))
    results = None
    if args.inject:
        results = run_injections(args.jobs, args.only)
        print("\n".join(injection_totals(results)))
        mismatches += [f"inject {r['test_id']}: {r['outcome']} {r['rules']} rollback {r['rollback']} (expected "
                       f"{r['expected']} {r['expected_rules']})" for r in results if not r["ok"]]
        skipped = [r for r in results if r["outcome"] == "skipped"]
        if skipped:
            print(f"skipped {len(skipped)}: {skipped[0]['why']}")
    if args.write_readme:
        write_readme(corpus, results if results and not args.only else None)
        print(f"wrote {README.relative_to(ROOT)}")
    for line in mismatches:
        print("MISMATCH", line)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
