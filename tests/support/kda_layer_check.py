"""The generated Kimi Delta Attention layer (agent/recipe/native/parts/code/linear_attention_kda.py) against
transformers' (KimiLinearDeltaAttention, BailingHybridDeltaAttention) on a tiny config, as the executor drives it
(gdn_layer_check.drive: a packed prefill of prompts of unequal length, then decode steps, each request's conv and
recurrent state in its block of the Mamba cache beside a NaN block): `python tests/support/kda_layer_check.py JSON`
under the npu stand-in, a cann-recipes-infer checkout on sys.path. JSON: a list of jobs {"model_type", "dtype",
"fault", "config"} ("config": keys over the tiny config's, bailing_hybrid's kda_safe_gate). Prints one line: CHECK
[{"ok", "max_rel", "step"} per job].

Faults: "per_head_decay" (the decay taken per head, the mean of its channels', as the Gated DeltaNet's), "recurrent_state"
(decode starts from a zero state), "conv_state" (decode forgets the conv history)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gdn_layer_check  # noqa: E402 - its driver, beside this file

CODE = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code" / "linear_attention_kda.py"
# the part's options per type (agent.recipe.native.parts.linear_attention_kda): forget and output gates' projections,
# the bounded forget gate's config keys
OPTIONS = {"kimi_linear": {"KDA_FORGET_GATE": "low_rank", "KDA_OUTPUT_GATE": "low_rank"},
           "bailing_hybrid": {"KDA_FORGET_GATE": "full", "KDA_OUTPUT_GATE": "full",
                              "KDA_SAFE_GATE_KEY": "kda_safe_gate", "KDA_LOWER_BOUND_KEY": "kda_lower_bound"}}
FAULTS = {
    "per_head_decay": ("current = current * g[t].exp().unsqueeze(-1)",
                       "current = current * g[t].mean(-1, keepdim=True).exp().unsqueeze(-1)"),
    "recurrent_state": ("if is_prefill else self.recurrent_state.index_select(0, blocks))", "if True else None)"),
    "conv_state": ("self.conv_state.index_select(0, blocks)", "torch.zeros_like(self.conv_state.index_select(0, blocks))"),
}


def _config(model_type, extra):
    from transformers import AutoConfig

    sizes = {"kimi_linear": dict(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4),
             "bailing_hybrid": dict(num_attention_heads=4, head_dim=16, short_conv_kernel_size=4)}[model_type]
    return AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, vocab_size=64,
                                layer_types=["linear_attention", "full_attention"], **sizes, **(extra or {}))


def _reference_layer(model_type, config):
    import torch

    if model_type == "kimi_linear":
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention as Layer
    else:
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridDeltaAttention as Layer
    torch.manual_seed(0)
    layer = Layer(config, 0).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator).log())
            elif name.endswith(("dt_bias", "o_norm.weight")):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return layer


def _load(fault):
    return gdn_layer_check.load_code(CODE, "kda_under_check", [FAULTS[fault]] if fault else ())


def check(job):
    import torch

    dtype = getattr(torch, job.get("dtype", "float32"))
    model_type = job["model_type"]
    config = _config(model_type, job.get("config"))
    reference = _reference_layer(model_type, config)
    rounded = _reference_layer(model_type, config).to(dtype)
    module = _load(job.get("fault"))
    for name, value in {**OPTIONS[model_type], "CONV_SHARDS": True}.items():
        setattr(module, name, value)
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1),
                                   model_config=SimpleNamespace(exe_mode="eager"))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelKimiDeltaAttention(config, infer_config, None, 0, prefix="model.layers.0.self_attn").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params, loaded = dict(layer.named_parameters()), set()
    for name, tensor in reference.state_dict().items():
        param = params[name]
        if name == "conv1d.weight":       # stored apart (q_conv1d, k_conv1d, v_conv1d), loaded by shard
            for shard, rows in zip("qkv", tensor.chunk(3)):
                param.weight_loader(param, rows.to(param.dtype), shard)
        else:
            param.data.copy_(tensor.to(param.dtype))
        loaded.add(name)
    assert not set(params) - loaded, sorted(set(params) - loaded)
    return gdn_layer_check.drive(layer, reference, rounded, config.hidden_size, dtype)


if __name__ == "__main__":
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
