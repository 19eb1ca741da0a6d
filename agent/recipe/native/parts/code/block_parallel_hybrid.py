"""The parallel hybrid decoder layer (falcon_h1's): one norm, a Mamba2 mixer and the softmax attention side by side on
its output — the attention's input, its output and the mixer's output each times its config multiplier — their sum
joining the residual; then the MLP behind its own norm. Each layer holds both caches: the attention's paged KV cache
and the mixer's conv and ssm states."""

from .layer import FIXED_NORM_EPS, NORM_EPS, ModelDecoderLayerBase
from .linear_attention_mamba2 import ModelMamba2Mixer as LinearAttention
from .norm_rms import ModelRMSNorm as Norm

# the config keys of the branches' multipliers (falcon_h1's); None: 1
ATTENTION_IN_MULTIPLIER = "attention_in_multiplier"
ATTENTION_OUT_MULTIPLIER = "attention_out_multiplier"
MIXER_OUT_MULTIPLIER = "ssm_out_multiplier"


def branch_multiplier(config, key):
    return 1.0 if key is None or getattr(config, key, None) is None else float(getattr(config, key))


class ModelParallelHybridDecoderLayer(ModelDecoderLayerBase):
    """Returns (residual, mlp(norm2(h))) as models/qwen's layer does: the next norm adds them (npu_add_rms_norm)."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        self.linear_attn = LinearAttention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.linear_attn")
        eps = getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS
        self.input_layernorm = Norm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = Norm(config.hidden_size, eps=eps)
        self.attention_in = branch_multiplier(config, ATTENTION_IN_MULTIPLIER)
        self.attention_out = branch_multiplier(config, ATTENTION_OUT_MULTIPLIER)
        self.mixer_out = branch_multiplier(config, MIXER_OUT_MULTIPLIER)

    @property
    def cache_entries(self):
        """Both caches of the layer: the attention's KV cache, then the Mamba2 mixer's states."""
        return list(self.self_attn.cache_entries) + list(self.linear_attn.cache_entries)

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        mixed = self.linear_attn(hidden_states, forward_metadata) * self.mixer_out
        attended = self.self_attn(hidden_states * self.attention_in, cos_sin, forward_metadata) * self.attention_out
        hidden_states, residual = self.post_attention_layernorm(mixed + attended, residual)
        return residual, self.mlp(hidden_states)
