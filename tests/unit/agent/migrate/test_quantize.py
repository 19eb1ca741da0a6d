"""`--quantize w8a8`'s writer (agent.migrate.quantize): a float checkpoint written as compressed-tensors W8A8
int8, one shard at a time. Checked against the readers: transformers' compressed-tensors quantizer loads
it (and gives the original's logits within int8's error), compressed-tensors' own writer makes the same
tensors and arguments from the same model, upstream's loader's scheme test takes its config; what stays
float is byte for byte the source's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.errors import InputError
from agent.migrate import quantize


def _bf16_sharded_qwen3(tmp_path: Path, shards: int = 2) -> Path:
    """A tiny random Qwen3 in bf16, split into `shards` safetensors files with an index (as published)."""
    from safetensors.torch import load_file, save_file

    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    out = Path(build_tiny_checkpoint("qwen3", tmp_path / "bf16", seed=3))
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(out / "model.safetensors").items()}
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, out / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    source = _bf16_sharded_qwen3(root)
    result = quantize.quantize_w8a8(source, root / "w8a8")
    return source, Path(result.checkpoint), result


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_transformers_loads_the_checkpoint_and_tracks_the_float_model(written):
    from transformers import AutoModelForCausalLM

    source, checkpoint, _ = written
    ids = torch.tensor([[5, 17, 40, 41, 99, 3, 8]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(ids).logits
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        got = model(ids).logits
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    assert getattr(model.model.layers[0].self_attn.q_proj, "quantization_scheme", None) is not None
    assert getattr(model.lm_head, "quantization_scheme", None) is None         # ignored: stays float
    relative = float((got - want).norm() / want.norm())
    assert relative < 0.05, relative
    assert not torch.equal(got, want)          # it is the quantized model that ran, not the float one


def test_tensors_and_config_are_what_compressed_tensors_writes(written):
    """compressed-tensors' own ModelCompressor on the same float model (its W8A8 preset): the same tensor
    names and dtypes, the same quantization arguments; our int8 values within one step of its."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    source, checkpoint, result = written
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **INT8_W8A8)}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            w = module.weight.data
            scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                         module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    theirs = {k: v for k, v in model.state_dict().items() if not k.endswith("zero_point")}
    ours = _tensors(checkpoint)
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    key = "model.layers.1.mlp.down_proj.weight"
    assert ours[key].dtype == torch.int8 and ours[key.replace("weight", "weight_scale")].dtype == torch.bfloat16
    # their scale is max/127.5 with the range [-128, 127], ours upstream's max/127 with [-127, 127]
    assert (ours[key].int() - theirs[key].int()).abs().max() <= 1
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    theirs_config = compressor.quantization_config.model_dump()
    for part in ("weights", "input_activations"):
        ours_args = QuantizationArgs.model_validate(config["config_groups"]["group_0"][part])
        their_args = QuantizationArgs.model_validate(theirs_config["config_groups"]["group_0"][part])
        for field in ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size"):
            assert getattr(ours_args, field) == getattr(their_args, field), (part, field)
    assert config["format"] == theirs_config["format"] == "int-quantized"
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    assert result.kept_float == ["lm_head"] and result.quantized_layers == 14


def test_upstreams_loader_takes_the_config_as_its_w8a8_int8_scheme(written):
    """cann-recipes-infer's module/quantization/compressed_tensors/compressed_tensors.py
    (`_quantization_scheme_map_from_config`, `is_dynamic_token_w8a8_int8`, `_get_quant_mode`), read from
    the snapshot: our config is the scheme it runs with CompressedTensorsW8A8Int8LinearMethod."""
    import ast

    from compressed_tensors.quantization import QuantizationArgs

    from locations import REPO_ROOT

    source = (REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer" / "module" / "quantization" /
              "compressed_tensors" / "compressed_tensors.py")
    if not source.is_file():
        pytest.skip("no upstream snapshot")
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CompressedTensorsConfig")
    wanted = {"is_dynamic_token_w8a8_int8"}
    namespace = {"QuantizationStrategy": __import__("compressed_tensors.quantization", fromlist=["x"]).QuantizationStrategy,
                 "BaseModel": object}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            exec(compile(ast.Module([node], []), str(source), "exec"), namespace)
    is_w8a8 = namespace["is_dynamic_token_w8a8_int8"]
    _, checkpoint, _ = written
    group = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    weights = QuantizationArgs.model_validate(group["weights"])
    acts = QuantizationArgs.model_validate(group["input_activations"])
    assert is_w8a8(None, weights, acts)
    assert not is_w8a8(None, weights, QuantizationArgs.model_validate({**group["input_activations"], "strategy": "tensor"}))
    assert quantize.is_w8a8(json.loads((checkpoint / "config.json").read_text()))


def test_float_tensors_are_the_sources_bytes_and_shards_keep_their_names(written):
    source, checkpoint, result = written
    src, out = _tensors(source), _tensors(checkpoint)
    for name, tensor in src.items():
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale" in out:
            continue
        assert torch.equal(out[name], tensor) and out[name].dtype == tensor.dtype, name
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert out[kept].dtype == torch.bfloat16
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in source.glob("*.safetensors"))
    source_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["weight_map"]["model.layers.0.mlp.up_proj.weight_scale"] == source_map["model.layers.0.mlp.up_proj.weight"]
    assert set(index["weight_map"]) == set(out) and result.shards == 2
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (checkpoint / name).read_bytes() == (source / name).read_bytes()
    assert result.bytes_after < result.bytes_before


def test_int8_weights_are_symmetric_per_channel_with_upstreams_scale():
    torch.manual_seed(0)
    w = torch.randn(6, 40).bfloat16()
    w[2] = 0                                          # a row of zeros: q 0 (any scale)
    w[4, 7] = -3 * w[4].abs().max()                   # the row's max is negative: still q = -127 there
    q, scale = quantize.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (6, 1) and scale.dtype == torch.bfloat16
    assert q[2].abs().sum() == 0 and q[4, 7] == -127 and int(q.abs().max()) == 127
    assert q.min() >= -127
    want_scale = (w.float().abs().amax(1, keepdim=True) / 127).bfloat16()
    assert torch.equal(scale[[0, 1, 3, 4, 5]], want_scale[[0, 1, 3, 4, 5]])
    assert ((q.float() * scale.float()) - w.float()).abs().le(scale.float() / 2 + 1e-6).all()
    q32, scale32 = quantize.quantize_weight(w.float())
    assert scale32.dtype == torch.float32


@pytest.mark.parametrize("name, float_kept", [
    ("lm_head", True), ("model.layers.3.mlp.gate", True), ("model.layers.3.mlp.shared_expert_gate", True),
    ("model.layers.0.self_attn.kv_b_proj", True), ("model.layers.0.block_sparse_moe.gate", True),
    ("model.layers.0.mlp.router", True),
    ("model.layers.0.mlp.gate_proj", False), ("model.layers.0.mlp.gate_up_proj", False),
    ("model.layers.0.self_attn.q_a_proj", False), ("model.layers.0.self_attn.o_proj", False),
    ("model.layers.0.mlp.down_proj", False), ("model.layers.0.self_attn.kv_a_proj_with_mqa", False)])
def test_what_upstreams_quantization_keeps_in_float(name, float_kept):
    assert quantize.keeps_float(name) is float_kept


def test_checkpoints_it_cannot_convert_are_refused_in_one_line(written, tmp_path):
    source, checkpoint, _ = written
    cases = {}
    cases["already"] = checkpoint
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((source / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, binary / "pytorch_model.bin")
    cases["bin"] = binary
    remote = tmp_path / "remote"
    remote.mkdir()
    for p in source.iterdir():
        (remote / p.name).write_bytes(p.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    cases["remote"] = remote
    moe = tmp_path / "moe"
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    build_tiny_checkpoint("qwen3_moe", moe, seed=1)
    if not quantize.loader_keeps_float_experts():       # the installed transformers cannot load its float experts
        cases["moe"] = moe
    import quantized_checkpoints as forms

    cases["fp8"], _ = forms.qwen3_fp8(tmp_path / "fp8")      # a format migrations convert: the line says how
    expected = {"already": "is already quantized (compressed-tensors)", "bin": "not *.safetensors",
                "remote": "repository's own code",
                "moe": "qwen3_moe's MoE experts stay float in the W8A8 checkpoint, and transformers ",
                "fp8": f"is already quantized (block-FP8 (quant_method fp8, weight_block_size 128x128)); convert it "
                       f"to bf16 first (`migrator convert {tmp_path / 'fp8'} DEST`), then migrate DEST with --quantize w8a8"}
    for case, folder in cases.items():
        with pytest.raises(InputError) as info:
            quantize.plan(folder)
        assert expected[case] in str(info.value) and "\n" not in str(info.value), (case, str(info.value))
        assert str(info.value).startswith("--quantize w8a8:")


def _with(group: dict, **top) -> dict:
    config = quantize.quantization_config(["lm_head"])
    config["config_groups"]["group_0"].update(group)
    config.update(top)
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "quantization_config": config}


W8A8 = quantize.quantization_config([])["config_groups"]["group_0"]


@pytest.mark.parametrize("config, route", [
    (_with({}), "native"),
    (_with({"weights": {**W8A8["weights"], "strategy": "tensor"}}), "native"),
    (_with({"weights": {**W8A8["weights"], "num_bits": 4}}), "refused"),                # W4A8
    (_with({"weights": {**W8A8["weights"], "num_bits": 4}, "input_activations": None}), "convert"),   # W4A16
    (_with({"input_activations": None}), "convert"),                                    # weight-only
    (_with({"input_activations": {**W8A8["input_activations"], "dynamic": False}}), "convert"),   # static activations
    (_with({"input_activations": {**W8A8["input_activations"], "strategy": "tensor"}}), "convert"),
    (_with({"weights": {**W8A8["weights"], "type": "float"}}), "refused"),              # fp8 weights, int8 activations
    (_with({}, format="dense"), "convert"),             # not upstream's (it reads the top format); the group's is read
    (_with({"format": "dense"}, format="dense"), "refused"),                           # no quantized weights stored
    (_with({}, quant_method="awq"), "convert"),
    ({"model_type": "llama", "compression_config": _with({})["quantization_config"]}, "native"),
])
def test_the_servability_check_serves_exactly_upstreams_w8a8_int8(config, route):
    """compressed-tensors W8A8 int8 (what upstream's module/quantization runs on the NPU) is served as published;
    its neighbours are converted at migration where the migrator reads them, else refused with the method named
    (exit 3) — one decision, agent.migrate.quantization's."""
    from agent.errors import UnsupportedModelError
    from agent.migrate import quantization
    from agent.migrate.vendor import check_servable

    assert quantize.is_w8a8(config) is (route == "native")
    assert quantization.scheme_of(config).route == route
    if route != "refused":
        check_servable(config)
    else:
        with pytest.raises(UnsupportedModelError, match="weights are quantized"):
            check_servable(config)


def test_the_command_line_redoes_it_and_never_writes_over_a_folder_it_did_not_write(written, tmp_path, capsys):
    source, checkpoint, _ = written
    again = tmp_path / "again"
    assert quantize.main([str(source), str(again)]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(again)
    first = {p.name: p.read_bytes() for p in again.iterdir()}
    assert quantize.main([str(source), str(again)]) == 0                 # a W8A8 checkpoint written before: redone
    assert {p.name: p.read_bytes() for p in again.iterdir()} == first
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert quantize.main([str(source), str(other)]) == 2
    assert "is not an empty folder or a W8A8 checkpoint" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep" and len(list(other.iterdir())) == 1
    assert quantize.main([str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("model_type, overrides, float_kept, quantized", [
    ("qwen3_moe", {}, ["lm_head", "model.layers.0.mlp.experts", "model.layers.0.mlp.gate",
                       "model.layers.1.mlp.experts", "model.layers.1.mlp.gate"],
     ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"]),
    # MLA + MoE: a dense first layer, shared experts quantized, kv_b_proj float
    ("deepseek_v3", {}, ["lm_head", "model.layers.0.self_attn.kv_b_proj", "model.layers.1.mlp.experts",
                         "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj"],
     ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj",
      "model.layers.1.self_attn.q_b_proj"]),
    # MLA, every layer dense: no experts module, nothing a loader could drop
    ("deepseek_v3", {"first_k_dense_replace": 2}, ["lm_head", "model.layers.0.self_attn.kv_b_proj",
                                                   "model.layers.1.self_attn.kv_b_proj"],
     ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa"])])
def test_moe_keeps_the_routed_experts_and_routers_float_by_the_module_upstream_builds(
        tmp_path, model_type, overrides, float_kept, quantized):
    """MoE checkpoints: the routed experts (transformers 5's stacked experts module, FusedMoEGMM's prefix) and the
    routers (no nn.Linear in transformers 5) are the config's `ignore`; attention, dense MLPs and shared experts
    are int8. Where the installed transformers' loader drops float experts a migration is refused in one line
    (plan's default); the writer alone writes them. The per-step runs: test_native_quantized.py (slow)."""
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    folder = build_tiny_checkpoint(model_type, tmp_path / model_type, seed=1, **overrides)
    layout = quantize.plan(Path(folder), checkable=False)
    assert sorted(layout.kept_float) == float_kept
    assert set(quantized) <= set(layout.quantized) and not any(".experts" in n for n in layout.quantized)
    has_experts = any(n.endswith(".experts") for n in float_kept)
    if has_experts and not quantize.loader_keeps_float_experts():
        with pytest.raises(InputError, match="drops float experts"):
            quantize.plan(Path(folder))
    else:
        assert quantize.plan(Path(folder)).kept_float == layout.kept_float


@pytest.mark.slow
def test_the_loader_check_says_what_transformers_loading_the_moe_checkpoint_does(tmp_path):
    """loader_keeps_float_experts (which runs transformers' op on one tensor) against transformers loading a
    written MoE checkpoint whole: it loads, with the experts the source's, exactly where the check says so (the
    default test_moe_keeps_the_routed_experts_and_routers_float_by_the_module_upstream_builds covers the refusal)."""
    from transformers import AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    source = Path(build_tiny_checkpoint("qwen3_moe", tmp_path / "bf16", seed=1))
    quantize.quantize_w8a8(source, tmp_path / "w8a8")
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "w8a8", dtype=torch.float32)
    except RuntimeError as exc:
        assert "conversion" in str(exc), exc
        loads = False
    else:
        float_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        for got, want in zip(model.model.layers, float_model.model.layers):
            assert torch.equal(got.mlp.experts.down_proj.float(), want.mlp.experts.down_proj)
            assert torch.equal(got.mlp.experts.gate_up_proj.float(), want.mlp.experts.gate_up_proj)
        loads = True
    assert loads is quantize.loader_keeps_float_experts()
