"""`migrator baseline DIR...`: every recipe in turn, past failures, summary as Markdown and CSV."""

from __future__ import annotations

import csv
import shutil

from migrator_cli import run_cli


def test_baseline_over_several_recipes_writes_the_table(working_recipe, tmp_path):
    good_b = tmp_path / "other"
    shutil.copytree(working_recipe, good_b)
    broken = tmp_path / "broken"
    shutil.copytree(working_recipe, broken)
    (broken / "infer.py").write_text("raise SystemExit('boom')\n")
    not_a_recipe = tmp_path / "notes"
    not_a_recipe.mkdir()
    proc = run_cli("baseline", str(working_recipe), str(broken), str(good_b), str(not_a_recipe),
                   "--summary", str(tmp_path / "summary"))
    assert proc.returncode == 1, proc.stderr[-2000:]          # one recipe failed
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["recipe"] for r in rows] == [str(p) for p in (working_recipe, broken, good_b, not_a_recipe)]
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "skipped"]
    for row in (rows[0], rows[2]):
        assert float(row["prefill_ms"]) > 0 and float(row["decode_avg_ms"]) > 0 and row["device"] == "cpu"
    assert (working_recipe / "baseline" / "baseline_metadata.json").is_file()
    assert (broken / "infer.py").read_text() == "raise SystemExit('boom')\n"   # report only, no repair
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[0] == "| model | status | prefill_ms | decode_avg_ms | device |" and len(md) == 6
