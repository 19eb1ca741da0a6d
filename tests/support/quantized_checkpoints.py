"""Tiny checkpoints in the forms their publishers upload (real config keys and tensor names, shrunk sizes),
quantized here from random bf16 weights by each format's published definition, deterministic, in seconds:

* `deepseek_v3_fp8`: DeepSeek-V3 / R1 (and Kimi-K2's layout): MLA + MoE, block-FP8 e4m3 with fp32
  `weight_scale_inv` per 128x128 block (DeepSeek-V3's `inference/kernel.py` weight_quant: scale = amax / 448
  per block, the last block of a dimension partial — the tiny dims keep partial blocks), one MTP layer at
  index num_hidden_layers (`embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head`), an `auto_map` block;
* `qwen3_fp8`: Qwen3-8B-FP8 (dims multiples of 128, as published);
* `gpt_oss_mxfp4`: gpt-oss, experts in MXFP4 (OCP Microscaling v1.0: blocks of 32, shared e8m0 exponent
  floor(log2(amax)) - 2, e2m1 elements rounded to nearest, two per byte low nibble first), the rest bf16;
* `qwen3_w8a8`: compressed-tensors int8 W8A8 (per-channel symmetric weights, dynamic per-token
  activations), written by the `compressed-tensors` library's own IntQuantizationCompressor;
* `llama_awq`: AutoAWQ GEMM int4 (group-wise asymmetric, AutoAWQ's nibble order [0, 2, 4, 6, 1, 3, 5, 7]).

Each builder returns (checkpoint dir, {tensor name: the bf16/fp16 value it was quantized from}) for tests
that compare a conversion with the original.

`block_fp8(source, out)` and `mxfp4_gpt_oss(source, out)` quantize an existing tiny checkpoint (one
`model.safetensors`, e.g. agent.measure.reference.tiny_checkpoint's deepseek_v3 / gpt_oss) by the same
rules, in the layout upstream's own converters read (tests of the converter commands the migrator names).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from agent.testing.tiny_checkpoint import build_tokenizer

FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- the formats' quantizers ------------------------------------------------------------------------
def fp8_block_quantize(weight: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv [ceil(M/bm), ceil(N/bn)]): weight ~= e4m3 x scale_inv per block."""
    rows, cols = weight.shape
    bm, bn = block
    grid_rows, grid_cols = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(grid_rows * bm, grid_cols * bn)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid_rows, bm, grid_cols, bn)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(grid_rows * bm, grid_cols * bn)
    return q[:rows, :cols].contiguous(), scale


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) per OCP MX (e2m1, e8m0)."""
    if weight.dim() > 2 and weight.numel() > 2**24:      # published sizes: an expert at a time
        parts = [mxfp4_quantize(w) for w in weight]
        return torch.stack([b for b, _ in parts]), torch.stack([s for _, s in parts])
    *lead, k = weight.shape
    w = weight.float().reshape(*lead, k // 32, 32)
    amax = w.abs().amax(-1).clamp(min=2.0 ** -120)
    exponent = torch.floor(torch.log2(amax)) - 2          # e2m1's largest exponent is 2 (6 = 1.5 x 2^2)
    scaled = w / torch.exp2(exponent).unsqueeze(-1)
    magnitude = scaled.abs().clamp(max=6.0)
    index = (magnitude.unsqueeze(-1) - E2M1).abs().argmin(-1)   # nearest e2m1 magnitude (ties: the smaller)
    nibble = index | ((scaled < 0) & (index > 0)).to(torch.long) << 3
    nibble = nibble.to(torch.uint8)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def awq_quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (qweight int32 [in, out/8], qzeros int32 [in/group, out/8], scales fp16 [in/group, out])."""
    w = weight.t().float()                                   # AWQ works on [in, out]
    rows, cols = w.shape
    g = w.reshape(rows // group, group, cols)
    wmax, wmin = g.amax(1), g.amin(1)
    scales = ((wmax - wmin).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-wmin / scales.float()).clamp(0, 15).to(torch.int32)
    q = torch.clamp(torch.round(g / scales.float().unsqueeze(1)) + zeros.unsqueeze(1), 0, 15).to(torch.int32)
    q = q.reshape(rows, cols)

    def pack(values):
        packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for col in range(values.shape[1] // 8):
            for i, src in enumerate(AWQ_ORDER):
                packed[:, col] |= values[:, col * 8 + src] << (4 * i)
        return packed

    return pack(q), pack(zeros), scales


# ---- writing ------------------------------------------------------------------------------------
def save_shards(out: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """safetensors in `shards` files of about equal bytes, with the index transformers writes."""
    from safetensors.torch import save_file

    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    per, current, index, weight_map, files = total / shards, {}, 0, {}, []
    size = 0
    for name in names:
        current[name] = tensors[name].contiguous()
        size += tensors[name].numel() * tensors[name].element_size()
        if size >= per * (index + 1) and index < shards - 1:
            files.append(current)
            current, index = {}, index + 1
    files.append(current)
    for i, part in enumerate(files, 1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))


def _write_config(out: Path, config: dict) -> None:
    """config.json and generation_config.json; the tokenizer gets a chat template, as published ones have
    (upstream's executor applies one to every prompt)."""
    from agent.measure.reference import CHATML_TEMPLATE

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config.setdefault("chat_template", CHATML_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")


def _randn(gen, *shape, scale=0.05):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


# ---- DeepSeek-V3 ------------------------------------------------------------------------------------
DEEPSEEK_V3 = {     # the published config.json's keys, dims shrunk (partial 128-blocks kept: 192 = 1.5 blocks)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 1, "eos_token_id": 2, "ep_size": 1, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 256, "initializer_range": 0.02, "intermediate_size": 384,
    "kv_lora_rank": 128, "max_position_embeddings": 512, "model_type": "deepseek_v3", "moe_intermediate_size": 192,
    "moe_layer_freq": 1, "n_group": 2, "n_routed_experts": 4, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 2, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 192, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 64,
}


def deepseek_v3_names(c: dict) -> dict[str, tuple[list[int], bool]]:
    """name -> (shape, quantized) of the published DeepSeek-V3 checkpoint for config `c` (MTP layers last)."""
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    names: dict[str, tuple[list[int], bool]] = {"model.embed_tokens.weight": ([vocab, h], False)}

    def layer(i: int) -> None:
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": ([h], False), p + "post_attention_layernorm.weight": ([h], False),
            p + "self_attn.q_a_proj.weight": ([c["q_lora_rank"], h], True),
            p + "self_attn.q_a_layernorm.weight": ([c["q_lora_rank"]], False),
            p + "self_attn.q_b_proj.weight": ([heads * (nope + rope), c["q_lora_rank"]], True),
            p + "self_attn.kv_a_proj_with_mqa.weight": ([c["kv_lora_rank"] + rope, h], True),
            p + "self_attn.kv_a_layernorm.weight": ([c["kv_lora_rank"]], False),
            p + "self_attn.kv_b_proj.weight": ([heads * (nope + v), c["kv_lora_rank"]], True),
            p + "self_attn.o_proj.weight": ([h, heads * v], True)})
        if i < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            names.update({p + "mlp.gate_proj.weight": ([inter, h], True), p + "mlp.up_proj.weight": ([inter, h], True),
                          p + "mlp.down_proj.weight": ([h, inter], True)})
            return
        inter, experts = c["moe_intermediate_size"], c["n_routed_experts"]
        names.update({p + "mlp.gate.weight": ([experts, h], False),
                      p + "mlp.gate.e_score_correction_bias": ([experts], False)})
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            names.update({q + "gate_proj.weight": ([inter, h], True), q + "up_proj.weight": ([inter, h], True),
                          q + "down_proj.weight": ([h, inter], True)})
        shared = inter * c["n_shared_experts"]
        q = p + "mlp.shared_experts."
        names.update({q + "gate_proj.weight": ([shared, h], True), q + "up_proj.weight": ([shared, h], True),
                      q + "down_proj.weight": ([h, shared], True)})

    for i in range(c["num_hidden_layers"]):
        layer(i)
    names.update({"model.norm.weight": ([h], False), "lm_head.weight": ([vocab, h], False)})
    for i in range(c["num_hidden_layers"], c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        names.update({p + "embed_tokens.weight": ([vocab, h], False), p + "enorm.weight": ([h], False),
                      p + "hnorm.weight": ([h], False), p + "eh_proj.weight": ([h, 2 * h], True),
                      p + "shared_head.norm.weight": ([h], False), p + "shared_head.head.weight": ([vocab, h], False)})
        layer(i)
    return names


REMOTE_CODE_MARKER = "REMOTE_CODE_RAN"


def write_remote_code(out: Path, config_module: str, config_class: str, model_module: str, model_class: str) -> None:
    """The repo's own modeling / configuration files an auto_map names: each, if ever imported, writes a
    marker file beside itself (so a test sees remote code that ran)."""
    # an absolute path: transformers imports a copy of the repo's code from its modules cache
    marker = f"import pathlib\npathlib.Path({str(out / REMOTE_CODE_MARKER)!r}).write_text(__name__)\n"
    (out / f"{config_module}.py").write_text(
        marker + "from transformers import PretrainedConfig\n\n\n"
        f"class {config_class}(PretrainedConfig):\n    model_type = 'deepseek_v3'\n")
    (out / f"{model_module}.py").write_text(
        marker + "import torch\nfrom transformers import PreTrainedModel\n\n\n"
        f"class {model_class}(PreTrainedModel):\n    pass\n")


def deepseek_v3_fp8(out: str | Path, seed: int = 0, shards: int = 1, **overrides) -> tuple[Path, dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config = dict(DEEPSEEK_V3, vocab_size=len(tokenizer), **overrides)
    gen = torch.Generator().manual_seed(seed)
    tensors, originals = {}, {}
    for name, (shape, quantized) in deepseek_v3_names(config).items():
        if name.endswith(("layernorm.weight", "norm.weight", "enorm.weight", "hnorm.weight")):
            value = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros(shape, dtype=torch.float32)
            continue
        else:
            value = _randn(gen, *shape, scale=0.2 if "embed" in name or "head" in name else 0.05)
        originals[name] = value
        if quantized:
            tensors[name], tensors[name + "_scale_inv"] = fp8_block_quantize(value)
        else:
            tensors[name] = value
    save_shards(out, tensors, shards)
    _write_config(out, config)
    write_remote_code(out, "configuration_deepseek", "DeepseekV3Config", "modeling_deepseek", "DeepseekV3ForCausalLM")
    return out, originals


# ---- transformers-built dense / MoE forms --------------------------------------------------------------
def _bf16_model(model_type: str, out: Path, seed: int, **dims):
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(out)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, tie_word_embeddings=False, **dims)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    config_dict = json.loads(config.to_json_string())
    config_dict["architectures"] = [type(model).__name__]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, config_dict


LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight")


def qwen3_fp8(out: str | Path, seed: int = 0, shards: int = 1, **dims) -> tuple[Path, dict]:
    """Qwen3-8B-FP8's form: every decoder linear e4m3 in 128x128 blocks + weight_scale_inv, the rest bf16."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state, config = _bf16_model("qwen3", out, seed, **{**dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, max_position_embeddings=512), **dims})
    tensors = {}
    for name, value in state.items():
        if name.endswith(LINEAR_SUFFIXES):
            tensors[name], tensors[name + "_scale_inv"] = fp8_block_quantize(value)
        else:
            tensors[name] = value
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    save_shards(out, tensors, shards)
    _write_config(out, config)
    return out, state


def gpt_oss_mxfp4(out: str | Path, seed: int = 0, shards: int = 1, **dims) -> tuple[Path, dict]:
    """gpt-oss's form: experts' gate_up_proj / down_proj as `_blocks` + `_scales` (MXFP4, transposed to
    [experts, out, in/32, 16] as published), biases, attention, router and embeddings bf16."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state, config = _bf16_model("gpt_oss", out, seed, **{**dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"]), **dims})
    tensors = {}
    for name, value in state.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(value.transpose(1, 2))
        else:
            tensors[name] = value
    config["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"],
                                     "quant_method": "mxfp4"}
    save_shards(out, tensors, shards)
    _write_config(out, config)
    return out, state


def qwen3_w8a8(out: str | Path, seed: int = 0) -> tuple[Path, dict]:
    """compressed-tensors int8 W8A8 (RedHatAI's / AMCT's Qwen3 W8A8 form), written by compressed-tensors'
    IntQuantizationCompressor: int8 weights, per-channel scales, dynamic per-token int8 activations."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state, config = _bf16_model("qwen3", out, seed, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)
    acts = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    tensors = {}
    for name, value in state.items():
        if not name.endswith(LINEAR_SUFFIXES):
            tensors[name] = value
            continue
        prefix = name[: -len(".weight")]
        module = {"weight": value, "weight_scale": (value.float().abs().amax(1, keepdim=True) / 127).to(torch.bfloat16),
                  "weight_zero_point": torch.zeros(value.shape[0], 1, dtype=torch.int8)}
        # compressed-tensors' own compressor, one module's state dict at a time (its API from 0.20)
        tensors.update({f"{prefix}.{key}": t for key, t in IntQuantizationCompressor.compress(module, scheme).items()
                        if t is not None})
    quant = QuantizationConfig(config_groups={"group_0": scheme},
                               format="int-quantized", quantization_status="compressed", ignore=["lm_head"])
    config["quantization_config"] = {**json.loads(quant.model_dump_json()), "quant_method": "compressed-tensors"}
    save_shards(out, tensors)
    _write_config(out, config)
    return out, state


def llama_awq(out: str | Path, seed: int = 0, group: int = 32) -> tuple[Path, dict]:
    """AutoAWQ GEMM int4 (e.g. TheBloke's / Qwen's -AWQ repos): qweight / qzeros / scales per linear, fp16."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state, config = _bf16_model("llama", out, seed, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    tensors, originals = {}, {}
    for name, value in state.items():
        value = value.half()
        originals[name] = value
        if name.endswith(LINEAR_SUFFIXES):
            prefix = name[: -len(".weight")]
            tensors[prefix + ".qweight"], tensors[prefix + ".qzeros"], tensors[prefix + ".scales"] = \
                awq_quantize(value, group)
        else:
            tensors[name] = value
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {"bits": 4, "group_size": group, "modules_to_not_convert": None,
                                     "quant_method": "awq", "version": "gemm", "zero_point": True}
    save_shards(out, tensors)
    _write_config(out, config)
    return out, originals


def padded_bytes(shape, itemsize) -> int:
    return math.prod(shape) * itemsize


# ---- an existing tiny checkpoint, quantized ----------------------------------------------------------
def _copy_with(source: Path, out: Path, tensors: dict, quantization_config: dict, **config_changes) -> Path:
    """`source` copied to `out` with `tensors` as its weights (one shard and the index the hub's have) and
    `quantization_config` (and `config_changes`) in its config.json."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(source, out)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
         "weight_map": {name: "model.safetensors" for name in tensors}}))
    config = json.loads((out / "config.json").read_text())
    config.update(quantization_config=quantization_config, **config_changes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def block_fp8(source: Path, out: Path, block: int = 128) -> Path:
    """DeepSeek-V3's FP8 form of `source`: every projection weight e4m3 with its `<name>_scale_inv` per block
    (fp8_block_quantize); embeddings, norms, the router and lm_head as they were; num_nextn_predict_layers 0."""
    from safetensors.torch import load_file

    tensors = {}
    for name, weight in load_file(str(source / "model.safetensors")).items():
        if weight.ndim == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            tensors[name], tensors[name + "_scale_inv"] = fp8_block_quantize(weight, (block, block))
        else:
            tensors[name] = weight
    return _copy_with(source, out, tensors, {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [block, block]}, num_nextn_predict_layers=0)


def mxfp4_gpt_oss(source: Path, out: Path) -> Path:
    """gpt-oss's MXFP4 form of `source`: the experts' gate_up_proj / down_proj as *_blocks / *_scales of their
    transposes ([E, out, in/32, 16] and [E, out, in/32], mxfp4_quantize), everything else as it was."""
    from safetensors.torch import load_file

    tensors = {}
    for name, weight in load_file(str(source / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(weight.transpose(1, 2).contiguous())
        else:
            tensors[name] = weight
    return _copy_with(source, out, tensors, {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                        "model.layers.*.mlp.router",
                                                                        "model.embed_tokens", "lm_head"],
                                             "quant_method": "mxfp4"})
