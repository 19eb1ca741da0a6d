"""The generated Mamba1 mixer (agent/recipe/native/parts/code/linear_attention_mamba1.py) against transformers' own
mixer (JambaMambaMixer, MambaMixer, FalconMambaMixer) on a tiny config, as the executor drives it:
`python tests/support/mamba1_layer_check.py JSON` under the npu stand-in, a cann-recipes-infer checkout on sys.path.
JSON: a list of jobs {"family" (jamba, mamba, falcon_mamba), "dtype", "fault"}; the code's options set as the Mamba1
part sets them for the family. A packed prefill of prompts of unequal length (one shorter than the conv's history),
then decode steps, each request's conv and ssm state in its block of the Mamba cache; every block is NaN before the
prefill and block 0, no request's, is NaN before each step. Each step's outputs are held to transformers' mixer run
on the whole sequence so far (no cache). Prints one line: CHECK [{"ok", "max_rel", "step"} per job].

Faults (a planted error in the mixer's arithmetic or its state handling): "conv_state" (decode forgets the conv
history), "ssm_state" (decode starts from a zero ssm state), "skip" (the D x skip dropped), "dt_norm" (dt, B and C
left un-normed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import gdn_layer_check  # the drivers beside this file
import mamba2_layer_check

LENGTHS = (9, 5, 2)
DECODE_STEPS = 3
CODE_DIR = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code"
SIBLING = "from .linear_attention_mamba2 import mamba_conv1d_packed, mamba_conv1d_update\n"
FAULTS = {
    "conv_state": ("self.conv_state.index_select(0, blocks), weight",
                   "torch.zeros_like(self.conv_state.index_select(0, blocks)), weight"),
    "ssm_state": ("state = self.ssm_state.index_select(0, blocks).float()",
                  "state = torch.zeros_like(self.ssm_state.index_select(0, blocks)).float()"),
    "skip": (" + D * x[t]", ""),
    "dt_norm": ("dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)", "pass"),
}


def family_options(family):
    """The code's options for a family, as agent.recipe.native.parts.linear_attention_mamba1 reads them."""
    from agent.recipe.native.parts.linear_attention_mamba1 import KEYS

    keys = KEYS["mamba" if family == "falcon_mamba" else family]
    norm = {"jamba": ("weighted", "rms_norm_eps"), "mamba": (None, "rms_norm_eps"),
            "falcon_mamba": ("weightless", "mixer_rms_eps")}[family]
    return {**keys, "MAMBA1_DT_BC_NORM": norm[0], "MAMBA1_DT_BC_NORM_EPS": norm[1]}


def _config(family):
    from transformers import AutoConfig

    if family == "jamba":
        return AutoConfig.for_model("jamba", hidden_size=32, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                    mamba_dt_rank=6, num_hidden_layers=1, vocab_size=64, use_mamba_kernels=False)
    return AutoConfig.for_model(family, hidden_size=32, state_size=8, conv_kernel=4, intermediate_size=64,
                                time_step_rank=6, num_hidden_layers=1, vocab_size=64)


def _reference_layer(config):
    import torch
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    from transformers.models.mamba.modeling_mamba import MambaMixer

    torch.manual_seed(0)
    mixer = {"jamba": JambaMambaMixer, "mamba": MambaMixer, "falcon_mamba": FalconMambaMixer}[config.model_type]
    # the blocks build their mixer without its own init (falcon_mamba's inits norms it does not hold)
    extra = {} if config.model_type == "jamba" else {"initialize_mixer_weights": False}
    layer = mixer(config, 0, **extra).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.rand(param.shape, generator=generator).log())
            elif name in ("dt_proj.bias", "D") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return layer


def _load(fault, options):
    module = gdn_layer_check.load_code(CODE_DIR / "linear_attention_mamba1.py", "mamba1_under_check",
                                       [FAULTS[fault]] if fault else (), siblings=[mamba2_layer_check.CODE])
    module.__dict__.update(options)
    return module


def check(job):
    import torch

    family = job.get("family", "jamba")
    dtype = getattr(torch, job.get("dtype", "float32"))
    config = _config(family)
    reference = _reference_layer(config)
    rounded = _reference_layer(config).to(dtype)
    module = _load(job.get("fault"), family_options(family))
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1),
                                   model_config=SimpleNamespace(exe_mode="eager"))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelMamba1Mixer(config, infer_config, None, 0, prefix="model.layers.0.mamba").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(layer.named_parameters())
    for name, tensor in reference.state_dict().items():
        param = params.pop(name)
        getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, tensor.to(param.dtype))
    assert not params, sorted(params)
    return gdn_layer_check.drive(layer, reference, rounded, config.hidden_size, dtype, LENGTHS, DECODE_STEPS,
                                 fill=float("nan"))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)        # tiny tensors: thread start-up on a shared host costs more than the arithmetic
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
