"""The decoder layer: attention and MLP (or sparse-MoE block), each behind its norm, as upstream's models/qwen
chains them."""

import math

import torch
from torch import nn

from .layer import FIXED_NORM_EPS, LINEAR_ATTENTION, LINEAR_ATTN_NAME, NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm

SANDWICH = False        # post-attention and pre/post-feedforward norms around attention and MLP (gemma2, gemma3)
RESIDUAL_MULTIPLIER = False  # the attention's and the MLP's outputs times config.residual_multiplier (granite)
RESIDUAL_DEPTH_SCALED = False   # that multiplier is scale_depth / sqrt(num_hidden_layers) (minicpm3)
LAYER_SCALAR = False    # the layer's output, residual included, times its checkpoint's layer_scalar (gemma4)
FIRST_LAYER_UNNORMED = False    # the first layer's attention takes its input unnormed (modernbert-decoder's Identity)
DEPTH_SCALED_RESIDUAL = False   # each branch joins the residual as x sqrt((i - 1) / i) + out / sqrt(i), i the
                                # branch's count from 2 (beam: the attention 2 (layer + 1), the MLP one more)
# the norms' module names (the checkpoint's), by role: the attention's input and output norms, the MLP's input
# and output norms (the output norms only in the sandwich layer)
ATTENTION_NORM = "input_layernorm"
ATTENTION_OUT_NORM = "post_attention_layernorm"
MLP_NORM = "post_attention_layernorm"
MLP_OUT_NORM = "post_feedforward_layernorm"


class ModelUnnormed(nn.Module):
    """A norm's place without a norm, with its interface: called with a residual, the residual joins first and the
    sum comes back twice (the attention's input and the residual)."""

    def forward(self, hidden_states, *args):
        if not args:
            return hidden_states
        if args[0] is not None:
            hidden_states = args[0] + hidden_states
        return hidden_states, hidden_states


class ModelDecoderLayer(ModelDecoderLayerBase):
    """Returns (residual, hidden) as models/qwen's layer does: the next norm adds them (npu_add_rms_norm)."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        if RESIDUAL_MULTIPLIER:
            if RESIDUAL_DEPTH_SCALED:
                self.residual_multiplier = config.scale_depth / config.num_hidden_layers ** 0.5
            else:
                self.residual_multiplier = config.residual_multiplier
        if FIRST_LAYER_UNNORMED and layer_idx == 0:
            setattr(self, ATTENTION_NORM, ModelUnnormed())
        else:
            setattr(self, ATTENTION_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS))
        if SANDWICH:
            setattr(self, ATTENTION_OUT_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS))
        setattr(self, MLP_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS))
        if SANDWICH:
            setattr(self, MLP_OUT_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS))
        if DEPTH_SCALED_RESIDUAL:
            # (output, residual) factors of the attention's and the MLP's sums, as BeamDecoderLayer computes them
            self.residual_scales = [(1.0 / math.sqrt(i), math.sqrt((i - 1) / i))
                                    for i in (2 * (layer_idx + 1), 2 * (layer_idx + 1) + 1)]
        if LAYER_SCALAR:
            # a parameter (not a buffer): load_weights loads it from the checkpoint's model.layers.N.layer_scalar
            self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = getattr(self, ATTENTION_NORM)(hidden_states, past_residual)
        if LINEAR_ATTENTION and self.is_linear:
            hidden_states = getattr(self, LINEAR_ATTN_NAME)(hidden_states, forward_metadata)
        else:
            hidden_states = self.self_attn(hidden_states, cos_sin, forward_metadata)
        if SANDWICH:
            # the attention's and the MLP's outputs are normed before they join the residual
            hidden_states = getattr(self, ATTENTION_OUT_NORM)(hidden_states)
            if RESIDUAL_MULTIPLIER:
                hidden_states = hidden_states * self.residual_multiplier
            if DEPTH_SCALED_RESIDUAL:
                # each scaled in the run dtype; the next norm adds them
                out_scale, residual_scale = self.residual_scales[0]
                hidden_states, residual = hidden_states * out_scale, residual * residual_scale
            hidden_states, residual = getattr(self, MLP_NORM)(hidden_states, residual)
            hidden_states = getattr(self, MLP_OUT_NORM)(self.mlp(hidden_states))
            if RESIDUAL_MULTIPLIER:
                hidden_states = hidden_states * self.residual_multiplier
            if DEPTH_SCALED_RESIDUAL:
                out_scale, residual_scale = self.residual_scales[1]
                hidden_states, residual = hidden_states * out_scale, residual * residual_scale
        else:
            if RESIDUAL_MULTIPLIER:
                hidden_states = hidden_states * self.residual_multiplier
            hidden_states, residual = getattr(self, MLP_NORM)(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
            if RESIDUAL_MULTIPLIER:
                hidden_states = hidden_states * self.residual_multiplier
        if LAYER_SCALAR:
            # (residual + hidden) * s as the next norm adds them: plain torch multiplies
            scalar = self.layer_scalar.to(hidden_states.dtype)
            residual, hidden_states = residual * scalar, hidden_states * scalar
        return residual, hidden_states
