"""The plain MLP down(act(up(x))), no gate: up column-parallel, down row-parallel."""

import torch
import torch.distributed as dist
from torch import nn
from transformers.activations import ACT2FN

from module.linear import ColumnParallelLinear, RowParallelLinear

ACT = "hidden_act"      # the config key naming the activation
MLP_BIAS = False        # the projections' biases: a literal, or the config key that sets them
MLP_WIDTH = "intermediate_size"     # the config key of the width (opt: ffn_dim; gpt2: n_inner)
WIDTH_DEFAULT_4X = False    # a width of None is 4 x hidden_size (gpt2's n_inner)
WIDTH_FIXED_4X = False      # the width is 4 x hidden_size, no config key holds it (openai-gpt, mpt)
ACT_PARAMS = False      # the activation has learned parameters, loaded from the checkpoint (apertus' xIELU)
ACT_FIXED = None        # the ACT2FN entry of an activation the architecture hard-codes (mpt: "gelu"), no config key
# (config value, ACT2FN name) where the architecture names an activation its own way (openai-gpt's "gelu": gelu_new)
ACT_NAMES = ()


class ModelPlainMLP(nn.Module):
    """down(act(up(x))) in plain torch between module.linear's parallel linears: no gate, so npu_swiglu does not
    apply; the partial sums of the row-parallel down projection join over attn_tp_group."""

    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.comm_manager = comm_manager
        tp_rank = comm_manager.get_rank("attn_tp_group") if self.attn_tp_size > 1 else 0
        quant_config = getattr(config, "quant_config", None)
        self.up_proj = ColumnParallelLinear(
            input_size=config.hidden_size, output_size=4 * config.hidden_size if WIDTH_FIXED_4X else (getattr(config, MLP_WIDTH) or 4 * config.hidden_size) if WIDTH_DEFAULT_4X else getattr(config, MLP_WIDTH), bias=MLP_BIAS,
            tp_size=self.attn_tp_size, tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(
            input_size=4 * config.hidden_size if WIDTH_FIXED_4X else (getattr(config, MLP_WIDTH) or 4 * config.hidden_size) if WIDTH_DEFAULT_4X else getattr(config, MLP_WIDTH), output_size=config.hidden_size, bias=MLP_BIAS,
            tp_size=self.attn_tp_size, tp_rank=tp_rank, input_is_parallel=True, quant_config=quant_config,
            prefix=f"{prefix}.down_proj")
        self.act_fn = ACT2FN[ACT_FIXED] if ACT_FIXED else ACT2FN[getattr(config, ACT)]
        for value, name in ACT_NAMES:
            if getattr(config, ACT) == value:
                self.act_fn = ACT2FN[name]
        if ACT_PARAMS:
            # in the model's dtype (transformers builds xIELU's in bfloat16), before the checkpoint's load into them
            self.act_fn = self.act_fn.to(torch.get_default_dtype())

    def forward(self, hidden_states):
        out = self.down_proj(self.act_fn(self.up_proj(hidden_states)))
        if self.attn_tp_size > 1:
            dist.all_reduce(out, group=self.comm_manager.get_group("attn_tp_group"))
        return out
