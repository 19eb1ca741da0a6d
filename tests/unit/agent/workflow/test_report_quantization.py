"""--quantize in the records: migration_report.json's `quantization` (schema-checked when read back), the
summary's lines, and the README's 量化 section beside the verdict (agent.recipe.readme.write_quantization)."""

from __future__ import annotations

from pathlib import Path

from agent.recipe import readme
from agent.recipe.recipe import checked_report
from agent.workflow.report import quantization_lines

COST = {"steps": 3, "agree": [True, False, True], "first_disagreement": 1, "top1_agreement": 0.6667,
        "nll": {"original": 2.0, "quantized": 2.25, "delta": 0.25}}
QUANT = {"scheme": "w8a8", "source": "/ckpt/bf16", "checkpoint": "/out/m/res/.migrator/checkpoints/bf16-w8a8",
         "format": "compressed-tensors int-quantized W8A8", "quantized_layers": 14, "kept_float": ["lm_head"],
         "command": "python -m agent.migrate.quantize /ckpt/bf16 /out/m/res/.migrator/checkpoints/bf16-w8a8",
         "cost": COST}

README = """# M模型在NPU上推理

## 概述

text

## 性能基线

verdict here

| 量化模式 | Global Batch Size | Seq Length (in/out) | 卡数 | TPOT (ms) | 吞吐 (tokens/s) |
|------------|-------------------|---------------------------|-------|-----------|------------------------|
| BF16 | 1 | ≤480/32 | 0 | 1.00 | 1.0 |

## 附录

kept
"""


def test_the_readme_gets_its_quantization_section_before_the_verdict_once(tmp_path: Path):
    recipe = tmp_path / "m"
    recipe.mkdir()
    (recipe / "README.md").write_text(README)
    quant = {**QUANT, "cost_line": "top-1 agreement 2/3 steps"}
    assert readme.write_quantization(recipe, quant)
    text = (recipe / "README.md").read_text()
    assert text.index("\n## 量化\n") < text.index("\n## 性能基线\n") < text.index("\n## 附录\n")
    section = text[text.index("\n## 量化\n"):text.index("\n## 性能基线\n")]
    assert QUANT["checkpoint"] in section and QUANT["command"] in section and "top-1 agreement 2/3 steps" in section
    assert "| W8A8 | 1 |" in text and "| BF16 |" not in text and text.endswith("kept\n")
    assert not readme.write_quantization(recipe, quant)              # the same input: the same README
    assert (recipe / "README.md").read_text() == text
    readme.write_quantization(recipe, {**quant, "cost_line": "not measured (x)"})
    again = (recipe / "README.md").read_text()
    assert again.count("\n## 量化\n") == 1 and "not measured (x)" in again


def test_a_readme_without_the_verdict_section_is_left_as_the_user_wrote_it(tmp_path: Path):
    recipe = tmp_path / "m"
    recipe.mkdir()
    (recipe / "README.md").write_text("# mine\n\nno sections\n")
    assert not readme.write_quantization(recipe, QUANT)
    assert (recipe / "README.md").read_text() == "# mine\n\nno sections\n"


def test_summary_lines_and_the_schema_of_a_report_read_back():
    lines = quantization_lines({"quantization": QUANT})
    assert lines[0].startswith("- quantized (w8a8): `/out/m/res/.migrator/checkpoints/bf16-w8a8`")
    assert "redo: `python -m agent.migrate.quantize" in lines[0]
    assert lines[1] == ("- cost of quantizing against the float original: top-1 agreement 2/3 steps (first differs at "
                        "step 1) on the default prompt; prompt NLL 2.0 -> 2.25 (+0.2500); float32, transformers on CPU")
    assert quantization_lines({}) == []
    assert checked_report({"quantization": QUANT})["quantization"] == QUANT
    for bad in ({**QUANT, "checkpoint": 3}, {**QUANT, "cost": [1]}, {**QUANT, "kept_float": "lm_head"}, "w8a8"):
        assert "quantization" not in checked_report({"quantization": bad})


CONVERSION = {"format": "block-FP8 (quant_method fp8, weight_block_size 128x128)", "route": "convert",
              "why": "no fp8 matmul on Atlas A2/A3: dequantized to bf16 at migration", "source": "/ckpt/fp8",
              "path": "/out/m/.migrator/checkpoints/bfloat16", "dtype": "bfloat16",
              "command": "migrator convert /ckpt/fp8 /out/m/.migrator/checkpoints/bfloat16", "upstream_converter": None,
              "tensors": {"quantized": 14, "kept": 15, "dropped": 0}, "seconds": 1.5, "bytes_written": 1000,
              "largest_source_shard_bytes": 3 * 2**20, "peak_rss_bytes": 200 * 2**20, "rss_before_bytes": 190 * 2**20}


def test_a_conversion_in_the_summary_and_the_schema_of_a_report_read_back():
    """A converted checkpoint (agent.migrate.convert's record): the summary's line says what, why, where and the
    redo command; read back from an untrusted report, a field of the wrong shape drops the record (the summary
    does arithmetic on its numbers)."""
    from agent.workflow.report import conversion_line, human_summary

    line = conversion_line(CONVERSION)
    assert line == ("block-FP8 (quant_method fp8, weight_block_size 128x128) converted to bfloat16 (no fp8 matmul on "
                    "Atlas A2/A3: dequantized to bf16 at migration) in 1.5 s, peak memory +10 MiB (largest source "
                    "shard 3 MiB): /out/m/.migrator/checkpoints/bfloat16; redo with "
                    "`migrator convert /ckpt/fp8 /out/m/.migrator/checkpoints/bfloat16`")
    assert f"- weights: {line}" in human_summary({"conversion": CONVERSION})
    assert checked_report({"conversion": CONVERSION})["conversion"] == CONVERSION
    for bad in ({**CONVERSION, "peak_rss_bytes": "200"}, {**CONVERSION, "path": ["/x"]},
                {**CONVERSION, "tensors": {"quantized": "14"}}, {**CONVERSION, "seconds": True}, "fp8"):
        assert "conversion" not in checked_report({"conversion": bad})
