"""agent/migrate/convert.py: published quantized checkpoints converted to bf16, tensor by tensor held to the
formats' own dequantizations — transformers' FineGrainedFP8 and Mxfp4 loaders (a whole model loaded with
dequantize=True), DeepSeek-V3's weight_dequant as upstream's deepseek_r1 converter carries it (partial
128-blocks), compressed-tensors' decompressors, AutoAWQ's dequantize_gemm and GPTQ's torch dequantization as
published — and against the bf16 original they were quantized from; streamed one tensor (a large one in
pieces) at a time, shard after shard; a failure leaves nothing behind."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantized_checkpoints as forms
from agent.migrate import convert
from agent.migrate.convert import convert_checkpoint
from agent.recipe.fs_guard import user_tree
from locations import REPO_ROOT

UPSTREAM_DEEPSEEK = REPO_ROOT.parent / "shared/upstream/cann-recipes-infer/models/deepseek_r1/utils/convert_model.py"


def _convert(src: Path, dest: Path, dtype: str = "bfloat16") -> tuple[dict, dict]:
    record = convert_checkpoint(src, dest, user_tree(dest.parent, create=True), dtype, log=lambda line: None)
    tensors = {}
    for file in sorted(dest.glob("*.safetensors")):
        tensors.update(load_file(file))
    return record, tensors


def _source(src: Path) -> dict:
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    src, originals = forms.deepseek_v3_fp8(root / "src", shards=3)
    record, converted = _convert(src, root / "bf16")
    return src, originals, record, converted, root / "bf16"


def _deepseek_reference():
    """DeepSeek-V3's weight_dequant (blocks of 128, the last of a dimension partial), as upstream's deepseek_r1
    converter carries it: its file imported as it is."""
    if not UPSTREAM_DEEPSEEK.is_file():
        pytest.skip("no upstream snapshot (../shared is absent)")
    spec = importlib.util.spec_from_file_location("upstream_deepseek_convert", UPSTREAM_DEEPSEEK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.weight_dequant


def test_deepseek_fp8_converts_exactly_as_deepseeks_own_dequant_and_keeps_the_rest(deepseek):
    src, originals, record, converted, dest = deepseek
    weight_dequant = _deepseek_reference()
    source = _source(src)
    torch.set_default_dtype(torch.bfloat16)     # weight_dequant returns the default dtype (its converter sets bf16)
    try:
        for name, value in source.items():
            if name.endswith("_scale_inv"):
                assert name not in converted
            elif value.dtype == torch.float8_e4m3fn:
                expected = weight_dequant(value, source[name + "_scale_inv"])
                assert converted[name].dtype == torch.bfloat16 and torch.equal(converted[name], expected), name
                # and near the bf16 value it was quantized from: e4m3 keeps 3 mantissa bits
                assert (converted[name].float() - originals[name].float()).abs().max() <= \
                    originals[name].float().abs().max() / 8, name
            else:
                assert converted[name].dtype == value.dtype and torch.equal(converted[name], value), name
    finally:
        torch.set_default_dtype(torch.float32)
    assert "model.layers.2.eh_proj.weight" in converted and "model.layers.2.shared_head.head.weight" in converted
    config = json.loads((dest / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert config["auto_map"] == forms.DEEPSEEK_V3["auto_map"]      # the repo's files travel with it
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "modeling_deepseek.py"} <= \
        {p.name for p in dest.iterdir()}
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(converted) and len(set(index["weight_map"].values())) == 3
    assert record["tensors"] == {"quantized": 49, "kept": 24, "dropped": 0}
    assert record["command"] == f"migrator convert {src} {dest}"


def test_transformers_fp8_dequant_agrees_where_blocks_divide_and_misplaces_partial_blocks(deepseek):
    """transformers' Fp8Dequantize derives the block from the shapes (rows // scale rows): the same values
    where a dimension is whole blocks; on a partial block (192 rows, 2 scale rows) it uses blocks of 96 rows,
    not DeepSeek's 128 — so the DeepSeek form is held to DeepSeek's own dequant above."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src, _, _, converted, _ = deepseek
    source = _source(src)
    whole = partial = 0
    for name, value in source.items():
        if value.dtype != torch.float8_e4m3fn:
            continue
        ours = Fp8Dequantize(None)._dequantize_one(value, source[name + "_scale_inv"], torch.bfloat16)
        if value.shape[0] % 128 == 0 and value.shape[1] % 128 == 0:
            assert torch.equal(converted[name], ours), name
            whole += 1
        else:
            assert not torch.equal(converted[name], ours), name
            partial += 1
    assert whole and partial


def test_qwen3_fp8_equals_transformers_loading_it_with_dequantize(tmp_path):
    """A whole model: transformers' FineGrainedFP8 loader with dequantize=True on the published form gives
    exactly the converted checkpoint's tensors (0 ulp: both compute fp32 products rounded once to bf16)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    src, originals = forms.qwen3_fp8(tmp_path / "src")
    _, converted = _convert(src, tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(converted) == set(originals)
    for name, value in converted.items():
        assert torch.equal(state[name], value), name


def test_gpt_oss_mxfp4_equals_transformers_and_is_exact(tmp_path):
    """MXFP4 -> bf16 is exact (e2m1 x 2^k is a bf16 value): equal to transformers' Mxfp4 loader with
    dequantize=True, tensor by tensor, and to convert_moe_packed_tensors on each pair."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, originals = forms.gpt_oss_mxfp4(tmp_path / "src")
    _, converted = _convert(src, tmp_path / "bf16")
    source = _source(src)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(converted) == set(originals)
    for name, value in converted.items():
        assert torch.equal(state[name], value), name
        if name + "_blocks" in source:
            assert torch.equal(value, convert_moe_packed_tensors(source[name + "_blocks"], source[name + "_scales"]))
            # the original's shape, within e2m1's rounding (half a step: a quarter of the block's top value)
            assert value.shape == originals[name].shape
            assert (value.float() - originals[name].float()).abs().max() <= originals[name].float().abs().max() / 4
        else:
            assert torch.equal(value, source[name])


def awq_reference_dequant(qweight, qzeros, scales, group_size):
    """AutoAWQ's awq/utils/packing_utils.py (unpack_awq, reverse_awq_order, dequantize_gemm), as published."""
    bits = 4
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse_order_tensor = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    izeros, iweights = izeros[:, reverse_order_tensor], iweights[:, reverse_order_tensor]
    iweight = torch.bitwise_and(iweights, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweight - izeros) * scales


def test_awq_equals_autoawqs_dequant(tmp_path):
    """0 ulp in fp16 (AutoAWQ computes (q - z) x s in fp16; ours rounds the fp32 product to the scales'
    dtype once, the same value), then to bf16; near the original within half a quantization step."""
    src, originals = forms.llama_awq(tmp_path / "src")
    _, converted = _convert(src, tmp_path / "bf16")
    _, as_fp16 = _convert(src, tmp_path / "fp16", "float16")
    source = _source(src)
    for name, value in converted.items():
        module = name[: -len(".weight")]
        if module + ".qweight" not in source:
            assert torch.equal(value, source[name])
            continue
        reference = awq_reference_dequant(source[module + ".qweight"], source[module + ".qzeros"],
                                          source[module + ".scales"], 32).t()
        assert torch.equal(as_fp16[name], reference), name
        assert torch.equal(value, reference.to(torch.bfloat16)), name
        step = source[module + ".scales"].float().repeat_interleave(32, dim=0).t()
        assert ((as_fp16[name].float() - originals[name].float()).abs() <= step / 2 + 1e-3).all(), name


def gptq_quantize(weight: torch.Tensor, bits: int, group: int, perm: torch.Tensor):
    """GPTQ's published layout (AutoGPTQ's pack, checkpoint_format gptq): asymmetric per group of input rows
    in act order `perm`, qweight packed along the input dim, qzeros (zero - 1) along the output dim."""
    w = weight.t().float()                                           # [in, out]
    rows, cols = w.shape
    g_idx = torch.empty(rows, dtype=torch.int32)
    g_idx[perm] = (torch.arange(rows) // group).to(torch.int32)      # act order: groups follow the permutation
    groups = rows // group
    scales, zeros = torch.empty(groups, cols), torch.empty(groups, cols, dtype=torch.int32)
    q = torch.empty(rows, cols, dtype=torch.int32)
    top = 2 ** bits - 1
    for g in range(groups):
        members = (g_idx == g).nonzero().flatten()
        block = w[members]
        s = ((block.amax(0) - block.amin(0)).clamp(min=1e-5) / top).half().float()
        z = torch.round(-block.amin(0) / s).clamp(0, top).to(torch.int32)
        scales[g], zeros[g] = s, z
        q[members] = torch.clamp(torch.round(block / s) + z, 0, top).to(torch.int32)
    per = 32 // bits
    qweight = torch.zeros(rows // per, cols, dtype=torch.int32)
    for i in range(per):
        qweight |= q[i::per] << (bits * i)
    z = zeros - 1
    qzeros = torch.zeros(groups, cols // per, dtype=torch.int32)
    for i in range(per):
        qzeros |= (z[:, i::per] & top) << (bits * i)
    reference = ((q - zeros[g_idx.long()]).float() * scales[g_idx.long()]).half()   # s x (q - z), [in, out]
    return qweight, qzeros, scales.half(), g_idx, reference.t().contiguous()


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False)])
def test_gptq_equals_the_published_dequant(bits, act_order):
    gen = torch.Generator().manual_seed(bits)
    weight = torch.randn(64, 128, generator=gen) * 0.05
    perm = torch.randperm(128, generator=gen) if act_order else torch.arange(128)
    qweight, qzeros, scales, g_idx, reference = gptq_quantize(weight, bits, 32, perm)
    out = convert.dequant_gptq(qweight, qzeros, scales, g_idx, bits, 32, True, torch.float16)
    assert torch.equal(out, reference)
    # qzeros read as gptq_v2 (no +1): every weight moves by one step — the format is told by checkpoint_format
    v2 = convert.dequant_gptq(qweight, qzeros, scales, g_idx, bits, 32, False, torch.float16)
    assert not torch.equal(v2, reference)


@pytest.mark.parametrize("scheme", ["w4a16-group", "w8a16-channel", "fp8-channel"])
def test_compressed_tensors_dequant_equals_its_decompressors(scheme):
    """pack-quantized int4 by groups, int8 per channel, fp8 per channel: the converter's dequant against the
    compressed-tensors library's own decompress_weight (0 ulp in the scale's dtype)."""
    from compressed_tensors.compressors import (FloatQuantizationCompressor, IntQuantizationCompressor,
                                                PackedQuantizationCompressor)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(48, 128, generator=gen) * 0.05).to(torch.bfloat16)
    if scheme == "w4a16-group":
        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
        scale = (weight.float().reshape(48, 4, 32).abs().amax(-1) / 7).to(torch.bfloat16)
        compressor, bits, packed = PackedQuantizationCompressor(), 4, True
    elif scheme == "w8a16-channel":
        args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
        scale = (weight.float().abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
        compressor, bits, packed = IntQuantizationCompressor(), 8, False
    else:
        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
        scale = (weight.float().abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
        compressor, bits, packed = FloatQuantizationCompressor(), 8, False
    zero = torch.zeros(scale.shape, dtype=torch.int8)
    # the library's per-module state dict API (compressed-tensors 0.20): compress, then decompress its output
    scheme_args = QuantizationScheme(targets=["Linear"], weights=args)
    compressed = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme_args)
    expected = compressor.decompress(dict(compressed), scheme_args)["weight"]
    parts = {"weight": compressed.get("weight_packed", compressed.get("weight")), "scale": scale,
             "zero": compressed.get("weight_zero_point", zero)}
    if packed:
        parts["shape"] = compressed["weight_shape"]
    ours = convert.dequant_compressed_tensors(parts, bits, packed, torch.bfloat16, args.group_size)
    assert torch.equal(ours, expected.to(torch.bfloat16))


def test_streaming_reads_one_shard_at_a_time_and_holds_pieces_not_shards(tmp_path, monkeypatch):
    """A 3-shard checkpoint: each output shard is made from its own source shard's data (only a scale whose
    weight ended a shard is read from the next), no read larger than a piece, and the process's memory grows
    by less than the largest shard while it converts (psutil, sampled every 20 ms)."""
    monkeypatch.setattr(convert, "CHUNK_BYTES", 256 * 1024)
    src, _ = forms.deepseek_v3_fp8(tmp_path / "src", shards=3, hidden_size=1024, intermediate_size=2048,
                                   moe_intermediate_size=512, q_lora_rank=384)
    shard_bytes = {p.name: p.stat().st_size for p in src.glob("*.safetensors")}
    seen: list[tuple[str, int, str]] = []
    raw = convert.ShardReader.raw

    def recording(self, name, start=0, stop=None):
        data = raw(self, name, start, stop)
        seen.append((self.path.name, len(data), name))
        return data

    monkeypatch.setattr(convert.ShardReader, "raw", recording)
    opened: list[str] = []
    real_open = user_tree(tmp_path).__class__.open

    def open_shard(self, path, mode="w", **kwargs):
        if str(path).endswith(".safetensors"):
            opened.append((Path(path).name, len(seen)))
        return real_open(self, path, mode, **kwargs)

    monkeypatch.setattr(user_tree(tmp_path).__class__, "open", open_shard)
    record, converted = _convert(src, tmp_path / "bf16")
    assert len(opened) == 3 and len(converted) == 73
    bounds = [start for _, start in opened] + [len(seen)]
    for (file, _), begin, end in zip(opened, bounds, bounds[1:]):
        assert {f for f, _, name in seen[begin:end] if not name.endswith("_scale_inv")} == {file}, file
    crossing = [name for (file, _), begin, end in zip(opened, bounds, bounds[1:])
                for f, _, name in seen[begin:end] if f != file]
    assert crossing and all(name.endswith("_scale_inv") for name in crossing)   # the builder split a pair
    assert max(n for _, n, _ in seen) <= convert.CHUNK_BYTES
    assert record["largest_read_bytes"] <= convert.CHUNK_BYTES
    grown = record["peak_rss_bytes"] - record["rss_before_bytes"]
    assert grown < max(shard_bytes.values()), (grown, shard_bytes)


def test_a_failed_conversion_leaves_no_folder_and_no_staging(tmp_path, monkeypatch):
    src, _ = forms.gpt_oss_mxfp4(tmp_path / "src")

    def broken(*args, **kwargs):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(convert, "dequant_mxfp4", broken)
    with pytest.raises(RuntimeError):
        _convert(src, tmp_path / "out" / "bf16")
    assert list((tmp_path / "out").iterdir()) == []


def test_the_cli_converts_and_refuses_what_it_must(tmp_path):
    from migrator_cli import run_cli

    src, _ = forms.gpt_oss_mxfp4(tmp_path / "src")
    proc = run_cli("convert", str(src), str(tmp_path / "bf16"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "mxfp4" in proc.stdout and "4 tensors dequantized, 33 kept" in proc.stdout
    assert (tmp_path / "bf16" / "model.safetensors").is_file()
    again = run_cli("convert", str(src), str(tmp_path / "bf16"), cwd=tmp_path)
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    inside = run_cli("convert", str(src), str(src / "out"), cwd=tmp_path)
    assert inside.returncode == 2 and "inside the checkpoint" in inside.stderr
    # compressed-tensors W8A8 int8: a migration serves it as published; by hand it converts (q x scale, per channel)
    w8a8, originals = forms.qwen3_w8a8(tmp_path / "w8a8")
    native = run_cli("convert", str(w8a8), str(tmp_path / "w8a8-bf16"), cwd=tmp_path)
    assert native.returncode == 0 and "14 tensors dequantized" in native.stdout, native.stderr
    published, converted = _source(w8a8), _source(tmp_path / "w8a8-bf16")
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(converted[f"{name}.weight"],
                       (published[f"{name}.weight"].float() * published[f"{name}.weight_scale"].float()).to(torch.bfloat16))
    step = originals[f"{name}.weight"].float().abs().amax(1, keepdim=True) / 127
    assert ((converted[f"{name}.weight"].float() - originals[f"{name}.weight"].float()).abs() <= step * 0.51 + 1e-3).all()
    # a format the migrator does not read: the refusal's one line, exit 3, nothing written
    unread = Path(shutil.copytree(w8a8, tmp_path / "bnb"))
    config = json.loads((unread / "config.json").read_text())
    (unread / "config.json").write_text(json.dumps(dict(config, quantization_config={
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})))
    refused = run_cli("convert", str(unread), str(tmp_path / "bnb-bf16"), cwd=tmp_path)
    assert refused.returncode == 3 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "bitsandbytes (4-bit nf4), which the migrator neither serves nor converts" in refused.stderr
    assert not (tmp_path / "bnb-bf16").exists()


def test_a_migrations_conversion_goes_to_the_recipe_state_and_a_failure_takes_back_only_what_it_made(tmp_path,
                                                                                                      monkeypatch):
    src, _ = forms.gpt_oss_mxfp4(tmp_path / "src")
    models = tmp_path / "models"
    models.mkdir()
    dest, record = convert.for_recipe(src, models / "gpt_oss")
    assert dest == models / "gpt_oss" / ".migrator" / "checkpoints" / "bfloat16" and record["path"] == str(dest)
    assert (dest / "model.safetensors").is_file()
    plain, _ = forms.qwen3_w8a8(tmp_path / "w8a8")
    assert convert.for_recipe(plain, models / "w8a8") == (plain, None)        # not converted: run as published

    def broken(*args, **kwargs):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(convert, "dequant_mxfp4", broken)
    with pytest.raises(RuntimeError):
        convert.for_recipe(src, models / "new")
    assert not (models / "new").exists()                 # made by the migration: removed
    (models / "empty").mkdir()
    with pytest.raises(RuntimeError):
        convert.for_recipe(src, models / "empty")
    assert (models / "empty").is_dir() and not any((models / "empty").iterdir())   # the user's folder: kept


def test_converting_by_hand_needs_no_consent_to_remote_code_and_runs_none(tmp_path):
    """Kimi-K2's form (model_type kimi_k2, which transformers lacks, so its code is the repo's): `migrator
    convert` reads the format only — no --trust-remote-code needed, nothing of the repo imported."""
    from migrator_cli import run_cli

    src, _ = forms.deepseek_v3_fp8(tmp_path / "Kimi-K2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, model_type="kimi_k2")))
    proc = run_cli("convert", str(src), str(tmp_path / "bf16"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["model_type"] == "kimi_k2"
    assert not (src / forms.REMOTE_CODE_MARKER).exists()
    run = run_cli("run", str(src), "--output-dir", str(tmp_path / "models"), cwd=tmp_path)
    assert run.returncode == 3 and "--trust-remote-code" in run.stderr       # migrating it is another matter


def test_without_consent_the_checkpoint_a_recipe_runs_names_no_repo_code(tmp_path):
    """Upstream's executor loads config, tokenizer and generation config with trust_remote_code=True: a checkpoint
    whose auto_map transformers serves would run the repo's code in the recipe's run (found by the DeepSeek-V3
    e2e run: configuration_deepseek.py imported from the converted checkpoint). Without --trust-remote-code the
    recipe runs a checkpoint without auto_map: the conversion writes none, a checkpoint that is not converted gets
    a view (links to its files, its JSON rewritten); with consent the repo's code stays named."""
    src, _ = forms.deepseek_v3_fp8(tmp_path / "DeepSeek-V3")
    (tmp_path / "models").mkdir()
    dest, record = convert.for_recipe(src, tmp_path / "models" / "a")
    assert "auto_map" not in json.loads((dest / "config.json").read_text())
    assert record["command"].endswith("--without-remote-code")
    trusted, _ = convert.for_recipe(src, tmp_path / "models" / "b", trust_remote_code=True)
    assert json.loads((trusted / "config.json").read_text())["auto_map"] == forms.DEEPSEEK_V3["auto_map"]
    # a bf16 checkpoint that names code transformers implements: a view for the run, the source untouched
    view, none = convert.for_recipe(trusted, tmp_path / "models" / "c")
    assert none is None and view == tmp_path / "models" / "c" / ".migrator" / "checkpoints" / "without-auto-map"
    assert "auto_map" not in json.loads((view / "config.json").read_text()) and not (view / "config.json").is_symlink()
    assert (view / "model.safetensors").is_symlink() and (view / "model.safetensors").resolve() == \
        (trusted / "model.safetensors").resolve()
    assert "auto_map" in json.loads((trusted / "config.json").read_text())
    assert convert.for_recipe(trusted, tmp_path / "models" / "d", trust_remote_code=True) == (trusted, None)
    assert not (src / forms.REMOTE_CODE_MARKER).exists()
