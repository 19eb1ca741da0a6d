"""The causal LM: embedding, decoder layers, final norm and rotary tables; the head; the checkpoint loader and
the parallel rules, as upstream's models/qwen writes them."""

import logging
import re
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from executor.core.kv_cache.cache_info import LayerCacheInfo, ModelCacheInfo
from executor.model_loader.weight_utils import default_weight_loader
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from .block import ModelDecoderLayer as DecoderLayer
from .norm_rms import ModelRMSNorm as Norm
from .rotary import ModelRotaryEmbedding as RotaryEmbedding

EMBED_SCALE = False             # the embedding times sqrt(hidden_size), in the model's dtype (gemma's normaliser)
FINAL_SOFTCAP = False           # logits soft-capped by config.final_logit_softcapping where it is set
ROPE_BY_LAYER_TYPE = False      # a rotary table per layer type (gemma3's local and global bases)
MLA = False                     # multi-head latent attention: its rope dims, latent caches and absorb weights
MOE = False                     # sparse-MoE layers: their experts split over moe_tp_group
MTP = False                     # an MTP draft model beside this one (code/mtp.py): next_n > 0 returns every hidden state
# transformers' renames of the checkpoint's tensor names for this architecture (pattern, replacement), in order
CHECKPOINT_RENAMES = ()
# (parameter, checkpoint module, shard id): checkpoint tensors stacked into one parallel linear
STACKED_PARAMS = ()

logger = logging.getLogger(__name__)


class ModelModel(nn.Module):
    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   getattr(config, "pad_token_id", None), torch.get_default_dtype(),
                                                   tp_size=1, tp_rank=0)
        self.layers = nn.ModuleList([
            DecoderLayer(config, infer_config, comm_manager, layer_idx, prefix=f"model.layers.{layer_idx}")
            for layer_idx in range(config.num_hidden_layers)])
        self.norm = Norm(config.hidden_size, eps=config.rms_norm_eps)
        if MTP:
            self.next_n = getattr(infer_config.model_config, "next_n", 0)
        if MLA:
            head_dim = config.qk_rope_head_dim          # MLA: the rope dims of the query and the shared key
        else:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if ROPE_BY_LAYER_TYPE:
            # rope per layer type (local and global bases)
            self.rotary_emb = nn.ModuleDict({kind: RotaryEmbedding(config, head_dim, kind)
                                             for kind in sorted(set(config.layer_types))})
        else:
            self.rotary_emb = RotaryEmbedding(config, head_dim)

    def forward(self, input_ids, position_ids, forward_metadata: ForwardMetaData):
        position_ids = position_ids.view(-1).long()
        hidden_states = self.embed_tokens(input_ids.view(-1))
        if EMBED_SCALE:
            # the architecture's normaliser, in the model's dtype
            hidden_states = hidden_states * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden_states.dtype)
        if ROPE_BY_LAYER_TYPE:
            cos_sin = {kind: rotary(hidden_states, position_ids) for kind, rotary in self.rotary_emb.items()}
        else:
            cos_sin = self.rotary_emb(hidden_states, position_ids)
        residual = None
        for layer in self.layers:
            residual, hidden_states = layer(hidden_states, cos_sin, residual, forward_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        if MTP and self.next_n:
            return hidden_states            # every token's: the MTP model drafts from them
        if forward_metadata.is_prefill:
            # each sequence's last token of the packed prefill
            hidden_states = hidden_states.index_select(0, forward_metadata.actual_seq_lengths_cu_q.long() - 1)
        return hidden_states.view(hidden_states.shape[0], 1, hidden_states.shape[-1])


class ModelForCausalLM(nn.Module):
    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.config = config
        self.infer_config = infer_config
        self.comm_manager = comm_manager
        parallel = infer_config.parallel_config
        self.world_size, self.attn_tp_size, self.lmhead_tp_size = parallel.world_size, parallel.attn_tp_size, parallel.lmhead_tp_size
        check_parallel(config, parallel)
        comm_manager.register_group(name="attn_tp_group", group_num=self.world_size // self.attn_tp_size,
                                    group_size=self.attn_tp_size)
        comm_manager.register_group(name="lmhead_tp_group", group_num=self.world_size // self.lmhead_tp_size,
                                    group_size=self.lmhead_tp_size)
        if MOE and parallel.moe_tp_size > 1:      # the routed and shared experts' intermediate axis
            comm_manager.register_group(name="moe_tp_group", group_num=self.world_size // parallel.moe_tp_size,
                                        group_size=parallel.moe_tp_size)
        self.model = ModelModel(config, infer_config, comm_manager, prefix)
        if self.attn_tp_size > 1:
            split = [p for m in self.model.modules() if isinstance(m, (QKVParallelLinear, MergedColumnParallelLinear,
                                                                        RowParallelLinear)) for p in m.parameters(recurse=False)]
            logger.info("tensor parallel rank %d of %d: %d parameters split by module.linear over attn_tp_group",
                        comm_manager.get_rank("attn_tp_group"), self.attn_tp_size, len(split))
        self.lm_head = ColumnParallelLinear(
            input_size=config.hidden_size, output_size=config.vocab_size, bias=False, tp_size=self.lmhead_tp_size,
            tp_rank=comm_manager.get_rank("lmhead_tp_group") if self.lmhead_tp_size > 1 else 0)

    def forward(self, input_ids, position_ids=None, forward_metadata: ForwardMetaData = None, **kwargs):
        hidden_states = self.model(input_ids, position_ids, forward_metadata)
        if MTP and self.model.next_n:
            prev_hidden_states = hidden_states
            hidden_states = verified_rows(hidden_states, forward_metadata)
        logits = self.lm_head(hidden_states)
        if self.lmhead_tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.lmhead_tp_size)]
            dist.all_gather(parts, logits, group=self.comm_manager.get_group("lmhead_tp_group"))
            logits = torch.cat(parts, dim=-1)
        logits = logits.float()
        if FINAL_SOFTCAP and self.config.final_logit_softcapping:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if MTP and self.model.next_n:
            return logits, prev_hidden_states      # the executor's MTP worker drafts from the hidden states
        return logits

    def get_cache_info(self) -> ModelCacheInfo:
        infos = [LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
                 for i, layer in enumerate(self.model.layers)]
        return ModelCacheInfo(num_layers=len(infos), layer_infos=infos, **({"is_mla_backend": True} if MLA else {}))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        """The checkpoint's tensors by name, after transformers' renames of this architecture; q/k/v and gate/up
        into their stacked parallel linears; a tied lm_head from the input embedding. A tensor this model does
        not build (an MTP layer past num_hidden_layers, a vision tower) is skipped and logged; a parameter no
        tensor loads is an error that names it: never a silently random weight."""
        params = dict(self.named_parameters())
        if MOE:
            # a module with a loader of its own (the sparse-MoE block) takes its tensors, named relative to it
            own_loaders = {f"{name}.": module for name, module in self.named_modules()
                           if name and hasattr(module, "load_weights")}
        tied = getattr(self.config, "tie_word_embeddings", False)
        loaded, skipped = set(), []
        for name, tensor in weights:
            for pattern, replacement in CHECKPOINT_RENAMES:
                name = re.sub(pattern, replacement, name, count=1)
            if MOE:
                owner = module_prefix(name, own_loaders)
                if owner is not None:
                    loaded |= {owner + n for n in own_loaders[owner].load_weights([(name[len(owner):], tensor)])}
                    continue
            parts, shard = name.split("."), None
            for param_name, weight_name, shard_id in STACKED_PARAMS:
                if weight_name in parts[:-1]:
                    parts[parts.index(weight_name)] = param_name
                    shard = shard_id
                    break
            target = ".".join(parts)
            param = params.get(target)
            if param is None:
                skipped.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is not None:
                loader(param, tensor, shard)
            else:
                loader(param, tensor)
            loaded.add(target)
            if tied and target == "model.embed_tokens.weight":
                # tied: the output embedding is the input one
                lm_head = params["lm_head.weight"]
                getattr(lm_head, "weight_loader", default_weight_loader)(lm_head, tensor)
                loaded.add("lm_head.weight")
        if skipped:
            logger.info("checkpoint tensors this model does not build, skipped: %s",
                        ", ".join(sorted({".".join(n.split(".")[:3]) + ".*" for n in skipped})))
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s) of this model "
                             f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): its weights and "
                             "config.json do not describe the same model")
        return loaded

    def process_weights_after_loading(self):
        if MLA:
            for layer in self.model.layers:
                layer.self_attn.split_kv_b_weight()          # the absorb weights, before the linears are transposed
            # deepseek_r1's rule: NZ weights whenever the YAML asks (npu_mla_prolog_v3 reads its weights in FRACTAL_NZ)
            is_nz = getattr(self.infer_config.model_config, "enable_weight_nz", False)
        else:
            is_nz = (getattr(self.infer_config.model_config, "enable_weight_nz", False)
                     and self.infer_config.model_config.exe_mode != "npugraph_ex")
        for module in self.modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module, is_nz=is_nz)


def verified_rows(hidden_states, forward_metadata):
    """The rows the lm head scores, [batch, tokens, hidden]: each prefill's last token; at decode every token (one,
    or the next_n + 1 an MTP step verifies)."""
    batch = forward_metadata.actual_seq_lengths_cu_q.shape[0]
    if forward_metadata.is_prefill:
        hidden_states = hidden_states.index_select(0, forward_metadata.actual_seq_lengths_cu_q.long() - 1)
    return hidden_states.view(batch, -1, hidden_states.shape[-1])


def module_prefix(name, prefixes):
    """The longest of `prefixes` ("model.layers.3.mlp.") that `name` starts with, or None."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end]) + "."
        if prefix in prefixes:
            return prefix
    return None


def check_parallel(config, parallel):
    """Heads and widths split evenly at parallel_config's tensor-parallel sizes, and the MoE layout is one this
    file runs; otherwise one line saying what to set."""
    heads = config.num_attention_heads
    checks = [("num_attention_heads", heads, parallel.attn_tp_size),
              ("vocab_size", config.vocab_size, parallel.lmhead_tp_size)]
    if getattr(config, "intermediate_size", None):      # the dense MLP's (a model of MoE layers only may have none)
        checks.append(("intermediate_size", config.intermediate_size, parallel.attn_tp_size))
    if not MLA:      # MLA: one latent key / value head, every rank holds it whole; the query heads split
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if kv_heads >= parallel.attn_tp_size:
            checks.append(("num_key_value_heads", kv_heads, parallel.attn_tp_size))
        elif parallel.attn_tp_size % kv_heads:
            checks.append(("num_key_value_heads (replicated)", parallel.attn_tp_size, kv_heads))
    for what, value, size in checks:
        if value % size:
            raise ValueError(f"{what} {value} does not divide by tensor-parallel size {size}: choose a size that divides it")
    if parallel.attn_tp_size % parallel.lmhead_tp_size:
        raise ValueError(f"lmhead_tp_size {parallel.lmhead_tp_size} with attn_tp_size {parallel.attn_tp_size}: the lm "
                         "head's all-gather would join logits of different requests (attention data parallel); set "
                         f"lmhead_tp_size to attn_tp_size ({parallel.attn_tp_size})")
    if MOE and parallel.world_size // parallel.attn_tp_size > 1 and parallel.moe_tp_size > 1:
        raise ValueError(f"attn_tp_size {parallel.attn_tp_size} of world_size {parallel.world_size} (attention data "
                         f"parallel over {parallel.world_size // parallel.attn_tp_size}) with moe_tp_size "
                         f"{parallel.moe_tp_size}: attention data parallel beside MoE tensor parallel is not written "
                         f"for this model; set attn_tp_size to {parallel.world_size}")
