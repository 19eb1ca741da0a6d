"""The multi-token-prediction draft model (the checkpoint's model.layers.{num_hidden_layers}.*) as upstream's
models/deepseek_r1 writes it (DeepseekV3ModelMTPLayer, DeepseekV3ModelMTP): model_config.next_n > 0 runs it."""

import torch
import torch.distributed as dist
from torch import nn

from executor.core.kv_cache.cache_info import LayerCacheInfo, ModelCacheInfo
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

from .block import ModelDecoderLayer as DecoderLayer
from .causal_lm import ModelForCausalLM, verified_rows
from .norm_rms import ModelRMSNorm as Norm
from .rotary import ModelRotaryEmbedding as RotaryEmbedding

MLA = False                     # multi-head latent attention: its rope dims, latent caches and absorb weights
QUERY_POSITION_SCALE = False    # the attention scales its queries by position (llama-4): it takes the positions too
QUERY_TEMPERATURE = False       # so does llama4's attention temperature
# the MTP layer's own tensors (checkpoint name after model.layers.{N}. -> this model's parameter); its
# embed_tokens and shared_head.head are the main model's, shared by the executor (share_weights_from_main_model)
MTP_OWN_TENSORS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                   "shared_head.norm.weight": "shared_head_norm.weight"}
MTP_SHARED_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")


class ModelMTPLayers(nn.Module):
    """The MTP decoder layers, keyed by their checkpoint index (num_hidden_layers + i); no embedding of its own."""

    def __init__(self, config, infer_config, comm_manager):
        super().__init__()
        self.embed_tokens = None        # the main model's (share_weights_from_main_model)
        start = config.num_hidden_layers
        self.layers = nn.ModuleDict({
            str(start + i): DecoderLayer(config, infer_config, comm_manager, start + i, prefix=f"model.layers.{start + i}")
            for i in range(config.num_nextn_predict_layers)})
        if MLA:
            head_dim = config.qk_rope_head_dim
        else:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim)


class ModelModelMTP(nn.Module):
    """The draft: the next token's embedding (enorm) and the main model's hidden state of this one (hnorm) joined
    by eh_proj, the MTP decoder layer with a cache of its own, shared_head.norm, the main model's lm_head. Returns
    (logits, hidden states), as the main model does when next_n > 0; the executor verifies its drafts."""
    is_mtp = True

    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        if config.num_nextn_predict_layers != 1:
            raise ValueError(f"num_nextn_predict_layers {config.num_nextn_predict_layers}: this file drafts with one MTP "
                             "layer (upstream's deepseek_r1 shares enorm / hnorm / eh_proj across them); set next_n to 0")
        self.config = config
        self.infer_config = infer_config
        self.comm_manager = comm_manager
        self.lmhead_tp_size = infer_config.parallel_config.lmhead_tp_size
        self.lm_head = None             # the main model's (share_weights_from_main_model)
        self.model = ModelMTPLayers(config, infer_config, comm_manager)
        self.enorm = Norm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = Norm(config.hidden_size, eps=config.rms_norm_eps)
        # float, as upstream's deepseek_r1 builds it (a quantized checkpoint keeps eh_proj unquantized)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, bias=False, quant_config=None,
                                        prefix="eh_proj")
        self.shared_head_norm = Norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, position_ids=None, forward_metadata: ForwardMetaData = None, prev_hidden_states=None,
                **kwargs):
        position_ids = position_ids.view(-1).long()
        hidden_states = self.enorm(self.model.embed_tokens(input_ids.view(-1)))
        previous = self.hnorm(prev_hidden_states.view(-1, self.config.hidden_size))
        hidden_states = self.eh_proj(torch.cat([hidden_states, previous], dim=-1))
        cos_sin = self.model.rotary_emb(hidden_states, position_ids)
        if QUERY_POSITION_SCALE or QUERY_TEMPERATURE:
            cos_sin = (*cos_sin, position_ids)
        residual = None
        for layer in self.model.layers.values():
            residual, hidden_states = layer(hidden_states, cos_sin, residual, forward_metadata)
        hidden_states, _ = self.shared_head_norm(hidden_states, residual)
        logits = self.lm_head(verified_rows(hidden_states, forward_metadata))
        if self.lmhead_tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.lmhead_tp_size)]
            dist.all_gather(parts, logits, group=self.comm_manager.get_group("lmhead_tp_group"))
            logits = torch.cat(parts, dim=-1)
        return logits.float(), hidden_states

    def get_cache_info(self) -> ModelCacheInfo:
        infos = [LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
                 for i, layer in enumerate(self.model.layers.values())]
        return ModelCacheInfo(num_layers=len(infos), layer_infos=infos, **({"is_mla_backend": True} if MLA else {}))

    def load_weights(self, weights):
        """The MTP layer's tensors (model.layers.{num_hidden_layers}.*) only: its own enorm / hnorm / eh_proj /
        shared_head.norm by name, its decoder layer as the main model loads one; a parameter no tensor loads is an
        error naming it (a checkpoint without an MTP layer: set next_n to 0)."""
        prefix = f"model.layers.{self.config.num_hidden_layers}."

        def mtp_tensors():
            for name, tensor in weights:
                if not name.startswith(prefix):
                    continue
                rest = name[len(prefix):]
                if rest in MTP_SHARED_TENSORS:
                    continue
                yield MTP_OWN_TENSORS.get(rest, name), tensor

        return ModelForCausalLM.load_weights(self, mtp_tensors())

    def process_weights_after_loading(self):
        model_config = self.infer_config.model_config
        if MLA:
            for layer in self.model.layers.values():
                layer.self_attn.split_kv_b_weight()
            is_nz = getattr(model_config, "enable_weight_nz", False)
        else:
            is_nz = getattr(model_config, "enable_weight_nz", False) and model_config.exe_mode != "npugraph_ex"
        for module in self.modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module, is_nz=is_nz)

