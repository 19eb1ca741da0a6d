"""A quantized checkpoint's one line (agent/migrate/quantization.py, through agent.migrate.vendor.check_servable):
the quantization its config states, and upstream's converter where one reads it — run here, as printed, on tiny
checkpoints in the publishers' real formats (tests/support/quantized_checkpoints.py), its output accepted."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from agent.errors import UnsupportedModelError
from agent.migrate import quantization
from agent.migrate.checkpoint_check import check_checkpoint
from locations import REPO_ROOT
from quantized_checkpoints import block_fp8, mxfp4_gpt_oss

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

# (quantization_config, config.json's other keys, what the line names, the converter script or None)
LINES = [
    (DEEPSEEK_FP8, {"num_hidden_layers": 61, "num_nextn_predict_layers": 1},
     "block-FP8 (quant_method fp8, weight_block_size 128x128)", "models/deepseek_r1/utils/convert_model.py"),
    (DEEPSEEK_FP8, {"num_hidden_layers": 61, "num_nextn_predict_layers": 0},          # Kimi-K2's
     "block-FP8 (quant_method fp8, weight_block_size 128x128)", "models/deepseek_r1/utils/convert_model.py"),
    ({"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"}, {},
     "MXFP4 (quant_method mxfp4)", "models/gpt_oss/converter/convert.py"),
    # not in the list: a block-FP8 checkpoint of another layout (Qwen3-8B-FP8: no num_nextn_predict_layers,
    # which convert_model.py reads), per-tensor FP8, each compressed-tensors scheme, AWQ, GPTQ, bitsandbytes,
    # a method nobody named, one whose name is no plain word
    (DEEPSEEK_FP8, {"num_hidden_layers": 36}, "block-FP8 (quant_method fp8, weight_block_size 128x128)", None),
    ({"quant_method": "fp8", "activation_scheme": "static"}, {}, "FP8 (quant_method fp8, per tensor or channel)", None),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}}, {},
     "compressed-tensors (int8 W8A8, format int-quantized)", None),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "group_size": 128}, "input_activations": None}}}, {},
     "compressed-tensors (int4 W4A16, format pack-quantized)", None),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float"}}}}, {},
     "compressed-tensors (fp8 W8A8, format float-quantized)", None),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, {},
     "AWQ (quant_method awq, int4 weights, group size 128)", None),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, {}, "GPTQ (quant_method gptq, int4 weights, group size 128)",
     None),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, {}, "bitsandbytes (4-bit nf4)",
     None),
    ({"quant_method": "hqq"}, {}, "quant_method hqq", None),
    ({"quant_method": "x`; rm -rf ~"}, {}, "a quant_method this line does not show", None),
]


@pytest.mark.parametrize("quant,other,named,script", LINES, ids=[f"{i}-{row[2][:20]}" for i, row in enumerate(LINES)])
def test_the_line_names_the_quantization_and_upstreams_converter_where_one_reads_it(quant, other, named, script):
    from agent.migrate.vendor import check_servable

    config = {"architectures": ["XForCausalLM"], "model_type": "x", "quantization_config": quant, **other}
    with pytest.raises(UnsupportedModelError) as caught:
        check_servable(config, Path("/data/ckpt"))
    message = str(caught.value)
    assert caught.value.exit_code == 3 and "\n" not in message
    assert message.startswith(f"XForCausalLM: weights are quantized: {named}, which the migrator does not serve yet")
    assert "use the original unquantized model" not in message and "rm -rf" not in message
    if script:
        assert f"from the checkout's root: `python3 {script} " in message and "then migrate /data/ckpt-bf16" in message
    else:
        assert "no converter of cann-recipes-infer reads" in message and "`" not in message


def _converter_line(checkpoint: Path) -> str:
    with pytest.raises(UnsupportedModelError) as caught:
        check_checkpoint(checkpoint)
    return str(caught.value)


def _run_as_printed(message: str, cwd: Path) -> subprocess.CompletedProcess:
    """The backticked command, run by a shell from the checkout's root, python3 the test's interpreter."""
    command = re.search(r"`(python3 [^`]+)`", message).group(1)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agent.measure import reference as upstream

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    root = tmp_path_factory.mktemp("quantized")
    return {t: upstream.tiny_checkpoint(t, root / t) for t in ("deepseek_v3", "gpt_oss", "qwen3")} | {"root": root}


@pytest.mark.parametrize("model_type,make", [("deepseek_v3", block_fp8), ("gpt_oss", mxfp4_gpt_oss)])
def test_the_printed_converter_command_writes_a_checkpoint_the_migrator_accepts(tiny, model_type, make):
    quantized = make(tiny[model_type], tiny["root"] / f"{model_type}-quantized")
    message = _converter_line(quantized)
    out = Path(shlex.split(re.search(r"`(python3 [^`]+)`", message).group(1))[-1])
    assert f"then migrate {out};" in message and out.parent == quantized.parent
    proc = _run_as_printed(message, SNAPSHOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = check_checkpoint(out)                  # accepted: no quantization_config, weights of the config's shapes
    assert "quantization_config" not in config
    original, converted = load_file(str(tiny[model_type] / "model.safetensors")), {}
    for shard in sorted(out.glob("*.safetensors")):
        converted.update(load_file(str(shard)))
    assert set(converted) == set(original)
    for name, weight in original.items():           # within the format's rounding of the weights it was made from
        got = converted[name].float()
        assert got.shape == weight.shape, name
        assert (got - weight).norm() <= 0.2 * weight.norm() + 1e-6, name


def test_a_block_fp8_checkpoint_the_converter_cannot_read_names_none(tiny):
    """Qwen3-8B-FP8's layout (no num_nextn_predict_layers): the line names no converter — and upstream's
    convert_model.py, run on it anyway, fails (it reads that key)."""
    quantized = block_fp8(tiny["qwen3"], tiny["root"] / "qwen3-fp8")
    config = json.loads((quantized / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (quantized / "config.json").write_text(json.dumps(config))
    message = _converter_line(quantized)
    assert "no converter of cann-recipes-infer reads" in message and "`" not in message
    forced = _run_as_printed(f"`python3 models/deepseek_r1/utils/convert_model.py --input_fp8_hf_path {quantized} "
                             f"--output_hf_path {quantized}-bf16`", SNAPSHOT)
    assert forced.returncode != 0 and "num_nextn_predict_layers" in forced.stderr


def test_the_converter_paths_are_upstreams():
    """The scripts the lines name exist in the snapshot with the arguments the lines pass."""
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    for config, quant in (({"num_hidden_layers": 2, "num_nextn_predict_layers": 0}, DEEPSEEK_FP8),
                          ({}, {"quant_method": "mxfp4"})):
        script, *args = shlex.split(quantization.converter(config, quant, "/in"))[1:]
        source = (SNAPSHOT / script).read_text()
        for flag in args[0::2]:
            assert f'"{flag}"' in source, (script, flag)
