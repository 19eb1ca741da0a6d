"""A quantized checkpoint's route and one line (agent/migrate/quantization.py, through
agent.migrate.vendor.check_servable): compressed-tensors W8A8 int8 served, what the NPU cannot compute
converted, the rest refused with the quantization its config states and upstream's converter where one reads
it. Upstream's converters are run here, as the line or the conversion record prints them, on tiny checkpoints
in the publishers' real formats (tests/support/quantized_checkpoints.py), and the migrator accepts their output."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent.errors import UnsupportedModelError
from agent.migrate import quantization
from agent.migrate.checkpoint_check import check_checkpoint
from agent.quantization_formats import is_w8a8
from locations import REPO_ROOT
from quantized_checkpoints import block_fp8, mxfp4_gpt_oss

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
DEEPSEEK_SCRIPT = "models/deepseek_r1/utils/convert_model.py"
GPT_OSS_SCRIPT = "models/gpt_oss/converter/convert.py"


def _ct(fmt="int-quantized", **groups):
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups}


W8A8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
W8A8_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}

# (quantization_config, config.json's other keys, what the line names, route, upstream's converter script or None)
ROUTES = [
    (DEEPSEEK_FP8, {"num_hidden_layers": 61, "num_nextn_predict_layers": 1},
     "block-FP8 (quant_method fp8, weight_block_size 128x128)", "convert", DEEPSEEK_SCRIPT),
    (DEEPSEEK_FP8, {"num_hidden_layers": 61, "num_nextn_predict_layers": 0},          # Kimi-K2's
     "block-FP8 (quant_method fp8, weight_block_size 128x128)", "convert", DEEPSEEK_SCRIPT),
    ({"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"}, {},
     "MXFP4 (quant_method mxfp4)", "convert", GPT_OSS_SCRIPT),
    # Qwen3-8B-FP8's layout: no num_nextn_predict_layers, which convert_model.py reads
    (DEEPSEEK_FP8, {"num_hidden_layers": 36}, "block-FP8 (quant_method fp8, weight_block_size 128x128)", "convert", None),
    ({"quant_method": "fp8", "activation_scheme": "static"}, {}, "FP8 (quant_method fp8, per tensor or channel)",
     "convert", None),
    # an fp8 the migrator does not dequantize, which upstream's converter reads: refused, naming it
    (dict(DEEPSEEK_FP8, fmt="e5m2"), {"num_hidden_layers": 61, "num_nextn_predict_layers": 1},
     "block-FP8 (quant_method fp8, fmt e5m2, weight_block_size 128x128)", "refused", DEEPSEEK_SCRIPT),
    # compressed-tensors: upstream's W8A8 int8 served; every other scheme it reads converted; the rest refused
    (_ct(group_0={"weights": W8A8_WEIGHTS, "input_activations": W8A8_ACTS}), {},
     "compressed-tensors (int8 W8A8 dynamic per token, format int-quantized)", "native", None),
    (_ct(group_0={"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}), {},
     "compressed-tensors (int8 W8A8, format int-quantized)", "convert", None),
    (_ct(group_0={"weights": W8A8_WEIGHTS, "input_activations": dict(W8A8_ACTS, dynamic=False, strategy="tensor")}), {},
     "compressed-tensors (int8 W8A8 static per tensor, format int-quantized)", "convert", None),
    (_ct("pack-quantized", group_0={"weights": {"num_bits": 4, "type": "int", "group_size": 128},
                                    "input_activations": None}), {},
     "compressed-tensors (int4 W4A16, format pack-quantized)", "convert", None),
    (_ct("float-quantized", group_0={"weights": {"num_bits": 8, "type": "float"},
                                     "input_activations": {"num_bits": 8, "type": "float"}}), {},
     "compressed-tensors (fp8 W8A8, format float-quantized)", "convert", None),
    (_ct("pack-quantized", group_0={"weights": {"num_bits": 4, "type": "int"}, "input_activations": W8A8_ACTS}), {},
     "compressed-tensors (int4 W4A8 dynamic per token, format pack-quantized)", "refused", None),
    (_ct("dense", group_0={"weights": W8A8_WEIGHTS, "input_activations": W8A8_ACTS}), {},
     "compressed-tensors (int8 W8A8 dynamic per token, format dense)", "refused", None),
    (_ct(group_0={"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
         group_1={"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}), {},
     "compressed-tensors (int4 W4A16, int8 W8A16, format int-quantized)", "refused", None),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, {},
     "AWQ (quant_method awq, int4 weights, group size 128)", "convert", None),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, {},
     "AWQ (quant_method awq, version exllama, int4 weights, group size 128)", "refused", None),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, {}, "GPTQ (quant_method gptq, int4 weights, group size 128)",
     "convert", None),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, {}, "GPTQ (quant_method gptq, int3 weights, group size 128)",
     "refused", None),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, {}, "bitsandbytes (4-bit nf4)",
     "refused", None),
    ({"quant_method": "hqq"}, {}, "quant_method hqq", "refused", None),
    # the config is untrusted: what no plain word is never reaches the line
    ({"quant_method": "x`; rm -rf ~"}, {}, "a quant_method this line does not show", "refused", None),
    (_ct("x`; rm -rf ~", group_0={"weights": W8A8_WEIGHTS, "input_activations": W8A8_ACTS}), {},
     "compressed-tensors (int8 W8A8 dynamic per token)", "refused", None),
]


@pytest.mark.parametrize("quant,other,named,route,script", ROUTES,
                         ids=[f"{i}-{row[3]}-{row[2][:24]}" for i, row in enumerate(ROUTES)])
def test_each_quantization_has_one_route_and_a_refusal_names_it_and_upstreams_converter(quant, other, named, route,
                                                                                        script):
    from agent.migrate.vendor import check_servable

    config = {"architectures": ["XForCausalLM"], "model_type": "x", "quantization_config": quant, **other}
    scheme = quantization.scheme_of(config)
    assert (scheme.label, scheme.route) == (named, route)
    assert is_w8a8(config) is (route == "native")
    command = quantization.converter(config, quant, "/data/ckpt")
    assert (command.split()[1] if command else None) == script
    if route != "refused":
        check_servable(config, Path("/data/ckpt"))          # served or converted: no refusal
        assert quantization.refusal(config) is None
        return
    with pytest.raises(UnsupportedModelError) as caught:
        check_servable(config, Path("/data/ckpt"))
    message = str(caught.value)
    assert caught.value.exit_code == 3 and "\n" not in message
    assert message.startswith(f"XForCausalLM: weights are quantized: {named}, which the migrator neither serves nor "
                              f"converts ({scheme.why})")
    assert "use the original unquantized model" not in message and "rm -rf" not in message
    if script:
        assert f"from the checkout's root: `python3 {script} " in message and "then migrate /data/ckpt-bf16" in message
    else:
        assert "no converter of cann-recipes-infer reads it" in message and "`" not in message


def _refusal_line(checkpoint: Path) -> str:
    with pytest.raises(UnsupportedModelError) as caught:
        check_checkpoint(checkpoint)
    return str(caught.value)


def _run_as_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed command, run by a shell from the checkout's root, python3 the test's interpreter."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path})


def _tensors(folder: Path) -> dict:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agent.measure import reference as upstream

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    root = tmp_path_factory.mktemp("quantized")
    return {t: upstream.tiny_checkpoint(t, root / t) for t in ("deepseek_v3", "gpt_oss", "qwen3")} | {"root": root}


@pytest.mark.parametrize("model_type,make", [("deepseek_v3", block_fp8), ("gpt_oss", mxfp4_gpt_oss)])
def test_upstreams_converter_the_conversion_names_writes_what_the_migrators_conversion_writes(tiny, model_type, make):
    """DeepSeek-V3's block-FP8 and gpt-oss's MXFP4 are converted at migration; the record (and the recipe README)
    name upstream's own converter of the same checkpoint — run as printed, it writes a checkpoint the migrator
    accepts, the same tensors as the migrator's conversion, each within the format's rounding of the original."""
    from agent.migrate.convert import convert_checkpoint
    from agent.recipe.fs_guard import user_tree

    root = tiny["root"]
    quantized = make(tiny[model_type], root / f"{model_type}-quantized")
    ours = root / f"{model_type}-ours"
    record = convert_checkpoint(quantized, ours, user_tree(root), log=lambda line: None)
    command = record["upstream_converter"]
    out = Path(shlex.split(command)[-1])
    assert out == Path(f"{quantized}-bf16")
    proc = _run_as_printed(command, SNAPSHOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = check_checkpoint(out)                  # accepted: no quantization_config, weights of the config's shapes
    assert "quantization_config" not in config
    original, theirs, mine = load_file(str(tiny[model_type] / "model.safetensors")), _tensors(out), _tensors(ours)
    assert set(theirs) == set(original) == set(mine)
    for name, weight in original.items():
        assert theirs[name].shape == mine[name].shape == weight.shape, name
        assert torch.allclose(theirs[name].float(), mine[name].float(), rtol=1e-2, atol=1e-6), name
        assert (mine[name].float() - weight).norm() <= 0.2 * weight.norm() + 1e-6, name


def test_a_block_fp8_checkpoint_upstreams_converter_cannot_read_is_converted_and_names_none(tiny):
    """Qwen3-8B-FP8's layout (no num_nextn_predict_layers): converted by the migrator; no converter of upstream is
    named — and upstream's convert_model.py, run on it anyway, fails (it reads that key)."""
    from agent.migrate.convert import convert_checkpoint
    from agent.recipe.fs_guard import user_tree

    quantized = block_fp8(tiny["qwen3"], tiny["root"] / "qwen3-fp8")
    config = json.loads((quantized / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (quantized / "config.json").write_text(json.dumps(config))
    assert check_checkpoint(quantized)["quantization_config"]["quant_method"] == "fp8"
    record = convert_checkpoint(quantized, tiny["root"] / "qwen3-ours", user_tree(tiny["root"]), log=lambda line: None)
    assert record["upstream_converter"] is None and record["tensors"]["quantized"] > 0
    forced = _run_as_printed(f"python3 {DEEPSEEK_SCRIPT} --input_fp8_hf_path {quantized} "
                             f"--output_hf_path {quantized}-bf16", SNAPSHOT)
    assert forced.returncode != 0 and "num_nextn_predict_layers" in forced.stderr


def test_a_refused_fp8_checkpoint_names_upstreams_converter_and_the_command_works_as_printed(tiny):
    """Block-FP8 in e5m2 (the migrator dequantizes e4m3 only): the input step refuses it in one line naming
    upstream's converter, which reads it; the printed command, run from the checkout's root, writes a bf16
    checkpoint the migrator accepts (the line's `then migrate ...`)."""
    quantized = block_fp8(tiny["deepseek_v3"], tiny["root"] / "deepseek-e5m2")
    tensors = load_file(str(quantized / "model.safetensors"))
    save_file({n: t.float().to(torch.float8_e5m2) if t.dtype == torch.float8_e4m3fn else t for n, t in tensors.items()},
              str(quantized / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (quantized / "config.json").write_text(json.dumps(config))
    message = _refusal_line(quantized)
    assert "fmt e5m2" in message and "neither serves nor converts" in message
    command = re.search(r"`(python3 [^`]+)`", message).group(1)
    out = Path(shlex.split(command)[-1])
    assert message.endswith(f"then migrate {out}") and out.parent == quantized.parent
    proc = _run_as_printed(command, SNAPSHOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "quantization_config" not in check_checkpoint(out)


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
