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
from .context_parallel import gather_cp, prefill_cp
from .head_transform import ModelHeadTransform
from .moe import register_expert_groups
from .norm_rms import ModelRMSNorm as Norm
from .parallel import gather_rows, own_rows_whole, spans_requests, sum_own_rows
from .rotary import ModelRotaryEmbedding as RotaryEmbedding
from .rotary import layer_rope_bases, with_rope_theta

EMBED_SCALE = False             # the embedding times sqrt(hidden_size), in the model's dtype (gemma's normaliser)
FINAL_SOFTCAP = False           # logits soft-capped by config.final_logit_softcapping where it is set
LM_HEAD_BIAS = False            # the output head has a bias (gptj, codegen, phi), or the config key that sets it (use_bias)
EMBED_MULTIPLIER = False        # the embedding times config.embedding_multiplier (granite)
EMBED_MULTIPLIER_KEY = "embedding_multiplier"   # the config key of that multiplier (minicpm3: scale_emb)
LOGITS_SCALING = None           # the config key scaling the logits: logits_scaling (granite, hyperclovax), logit_scale (cohere)
LOGITS_DIVIDED = False          # the logits divided by it (granite), else multiplied (cohere, hyperclovax)
ROPE_BY_LAYER_TYPE = False      # a rotary table per layer type (gemma3's local and global bases)
ROPE_TYPED_LAYERS = False       # only some layer types have rope settings (lfm3's attention types, not its conv)
ROPE_BY_LAYER_THETA = None      # the config key of each layer's rope base (granite_swa: layer_rope_theta): a table per base
MLA = False                     # multi-head latent attention: its rope dims, latent caches and absorb weights
MOE = False                     # sparse-MoE layers: their experts over moe_tp_group and moe_ep_group
MTP = False                     # an MTP draft model beside this one (code/mtp.py): next_n > 0 returns every hidden state
ABSOLUTE_POSITIONS = False      # positions added to the embedding (gpt2's learned wpe): the position slot's table, no rotary
EMBED_NORM = False              # the embedding normalised before the first layer (bloom's word_embeddings_layernorm)
EMBED_NORM_AFTER_POSITIONS = False  # that norm of the embedding plus its absolute positions (trocr's)
EMBED_FINAL_NORM = False        # the embedding normalised by the final norm (weightless) before the first layer (nanochat)
ALIBI = False                   # ALiBi positions: the attention adds each head's bias (position_alibi.py), no table here
NO_POSITIONS = False            # attention without positions on every layer (nemotron_h's NoPE): no table, nothing added
CONTEXT_PARALLEL = False        # prefill context parallel (parallel_config.cp_size): context_parallel.py's segments
LINEAR_ATTENTION = False        # linear-attention layers beside attention ones: their state caches (Mamba entries)
LINEAR_ATTN_NAME = "linear_attn"  # the layers' name of it (kimi_linear's Kimi Delta Attention: self_attn)
HEADS_PER_LAYER = None          # the config key of each layer's query heads (laguna): each count splits at attn_tp_size
HEAD_DIM_PER_LAYER = False      # head_dim set per layer (gemma4's per_layer_config): each layer type's table at its width
KV_HEADS_BY_LAYER_TYPE = ()     # (layer kind, multiple of num_key_value_heads) pairs (mimo_v2_flash's sliding layers: 2)
KV_HEADS_PER_LAYER = False      # key/value heads set per layer (gemma4's per_layer_config): each layer's count splits
ONE_MIXER = False               # one mixer per layer (parts/code/block_one_mixer.py): the layer's caches, none for an MLP
LAYER_CACHES = False            # each layer lists its caches (falcon_h1's parallel hybrid layer: KV cache and Mamba states)
NO_ATTENTION = False            # no attention layer at all (mamba2's Mamba2 layers alone): no heads to split
NEVER_TIED = False              # lm_head never tied to the embedding, whatever the config says (nemotron_h)
HEAD_TRANSFORM = False          # dense, activation and norm before lm_head (modernbert-decoder's prediction head)
QUERY_POSITION_SCALE = False    # the attention scales its queries by position (llama-4): it takes the positions too
QUERY_TEMPERATURE = False       # so does llama4's attention temperature
QUERY_SSMAX = False             # and beam's NoPE query scale (its tables per layer type: the positions beside them)
# transformers' renames of the checkpoint's tensor names for this architecture (pattern, replacement), in order
CHECKPOINT_RENAMES = ()
# stored names of Conv1D weights (gpt2's [in, out]): transposed to the parallel linears' [out, in] at load
TRANSPOSED_WEIGHTS = ()
# (parameter, checkpoint module, shard id): checkpoint tensors stacked into one parallel linear
STACKED_PARAMS = ()
# parameters of module.quantization's W8A8 methods a checkpoint may omit: smoothing factors, all ones until a
# smoothed checkpoint sets them
QUANT_DEFAULTS = ("smooth_scales", "smooth_scale_1", "smooth_scale_2")
NORM_EPS = "rms_norm_eps"   # the config key of the norms' epsilon
FIXED_NORM_EPS = 1e-5       # their epsilon where no config key holds it (NORM_EPS None: opt's LayerNorms)
FINAL_NORM = True           # a norm after the last layer (a post-LN model's last layer ends in its own: openai-gpt)

logger = logging.getLogger(__name__)


class ModelModel(nn.Module):
    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.config = config
        self.comm_manager = comm_manager
        parallel = infer_config.parallel_config
        self.embed_tp_size = parallel.embed_tp_size
        self.embed_tp_rank = comm_manager.get_rank("embed_tp_group") if self.embed_tp_size > 1 else 0
        # embed_tp_group holding other attention data-parallel groups' ranks gathers their tokens first
        self.embed_gather = spans_requests(self.embed_tp_size, parallel.attn_tp_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   getattr(config, "pad_token_id", None), torch.get_default_dtype(),
                                                   tp_size=self.embed_tp_size, tp_rank=self.embed_tp_rank)
        self.layers = nn.ModuleList([
            DecoderLayer(config, infer_config, comm_manager, layer_idx, prefix=f"model.layers.{layer_idx}")
            for layer_idx in range(config.num_hidden_layers)])
        if FINAL_NORM:
            self.norm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)
        if EMBED_NORM:
            self.embed_norm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)
        if MTP:
            self.next_n = getattr(infer_config.model_config, "next_n", 0)
        if ABSOLUTE_POSITIONS:
            # the position slot's class is a table of position rows here, added to the embedding
            self.embed_positions = RotaryEmbedding(config)
        elif not ALIBI and not NO_POSITIONS and ROPE_BY_LAYER_TYPE and HEAD_DIM_PER_LAYER:
            # rope per layer type, each at its layers' head_dim (gemma4: sliding 256, full 512; no global head_dim)
            self.rotary_emb = nn.ModuleDict({kind: RotaryEmbedding(config, config.per_layer_config[kind].head_dim, kind)
                                             for kind in sorted(set(config.layer_types))})
        elif not ALIBI and not NO_POSITIONS:
            if MLA:
                head_dim = config.qk_rope_head_dim          # MLA: the rope dims of the query and the shared key
            else:
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if ROPE_BY_LAYER_TYPE and ROPE_TYPED_LAYERS:
                # rope per layer type that has rope settings (lfm3: its conv layers none)
                self.rotary_emb = nn.ModuleDict({kind: RotaryEmbedding(config, head_dim, kind)
                                                 for kind in sorted(set(config.layer_types))
                                                 if isinstance(config.rope_parameters.get(kind), dict)})
            elif ROPE_BY_LAYER_TYPE:
                # rope per layer type (local and global bases)
                self.rotary_emb = nn.ModuleDict({kind: RotaryEmbedding(config, head_dim, kind)
                                                 for kind in sorted(set(config.layer_types))})
            elif ROPE_BY_LAYER_THETA:
                # one table per rope base the layers use (a base of 0: the layer has no rotary)
                self.rotary_emb = nn.ModuleList([RotaryEmbedding(with_rope_theta(config, theta), head_dim)
                                                 for theta in layer_rope_bases(config, ROPE_BY_LAYER_THETA)])
            else:
                self.rotary_emb = RotaryEmbedding(config, head_dim)

    def forward(self, input_ids, position_ids, forward_metadata: ForwardMetaData):
        position_ids = position_ids.view(-1).long()
        if CONTEXT_PARALLEL and prefill_cp(forward_metadata):
            # the executor hands every CP rank the whole padded batch: this rank computes its own segments
            local = forward_metadata.cp_metadata.local_indices.to(position_ids.device)
            input_ids, position_ids = input_ids.view(-1).index_select(0, local), position_ids.index_select(0, local)
        hidden_states = self.embed(input_ids.view(-1), forward_metadata.is_prefill)
        if EMBED_SCALE:
            # the architecture's normaliser, in the model's dtype
            hidden_states = hidden_states * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden_states.dtype)
        if EMBED_MULTIPLIER:
            hidden_states = hidden_states * getattr(self.config, EMBED_MULTIPLIER_KEY)
        if EMBED_NORM and not EMBED_NORM_AFTER_POSITIONS:
            hidden_states = self.embed_norm(hidden_states)
        if EMBED_FINAL_NORM:
            hidden_states = self.norm(hidden_states)
        if ABSOLUTE_POSITIONS:
            hidden_states = hidden_states + self.embed_positions(position_ids).to(hidden_states.dtype)
            if EMBED_NORM_AFTER_POSITIONS:
                hidden_states = self.embed_norm(hidden_states)
            cos_sin = None
        elif ALIBI or NO_POSITIONS:
            cos_sin = None
        elif ROPE_BY_LAYER_TYPE:
            cos_sin = {kind: rotary(hidden_states, position_ids) for kind, rotary in self.rotary_emb.items()}
        elif ROPE_BY_LAYER_THETA:
            cos_sin = [rotary(hidden_states, position_ids) for rotary in self.rotary_emb]
        else:
            cos_sin = self.rotary_emb(hidden_states, position_ids)
        if QUERY_POSITION_SCALE or QUERY_TEMPERATURE:
            cos_sin = (*cos_sin, position_ids)
        if QUERY_SSMAX:
            cos_sin = {**cos_sin, "positions": position_ids}
        residual = None
        for layer in self.layers:
            residual, hidden_states = layer(hidden_states, cos_sin, residual, forward_metadata)
        if FINAL_NORM:
            hidden_states, _ = self.norm(hidden_states, residual)
        if CONTEXT_PARALLEL and prefill_cp(forward_metadata):
            # every rank's segments in the batch's token order, the padding dropped: each request's last token
            cp = forward_metadata.cp_metadata
            hidden_states = gather_cp(hidden_states, cp, self.comm_manager.get_group("cp_group")).index_select(
                0, cp.global_valid_indices.to(hidden_states.device))
        if MTP and self.next_n:
            return hidden_states            # every token's: the MTP model drafts from them
        if forward_metadata.is_prefill:
            # each sequence's last token of the packed prefill
            hidden_states = hidden_states.index_select(0, forward_metadata.actual_seq_lengths_cu_q.long() - 1)
        return hidden_states.view(hidden_states.shape[0], 1, hidden_states.shape[-1])

    def embed(self, input_ids, is_prefill):
        """The input embedding; split by vocabulary over embed_tp_group (embed_tp_size > 1), as upstream's qwen3_moe
        and deepseek_r1 split it: each rank looks up the ids of its shard (the others' rows zero) and the ranks'
        rows are summed."""
        if self.embed_tp_size == 1:
            return self.embed_tokens(input_ids)
        group = self.comm_manager.get_group("embed_tp_group")
        if self.embed_gather:
            input_ids, rows = gather_rows(input_ids, group, self.embed_tp_size, is_prefill)
        shard = self.embed_tokens.input_size_per_partition
        local = input_ids - self.embed_tp_rank * shard
        inside = (local >= 0) & (local < shard)
        embedded = self.embed_tokens(local * inside) * inside.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        if self.embed_gather:
            return sum_own_rows(embedded, group, self.embed_tp_size, rows)
        dist.all_reduce(embedded, group=group)
        return embedded


class ModelForCausalLM(nn.Module):
    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.config = config
        self.infer_config = infer_config
        self.comm_manager = comm_manager
        parallel = infer_config.parallel_config
        self.world_size, self.attn_tp_size, self.lmhead_tp_size = parallel.world_size, parallel.attn_tp_size, parallel.lmhead_tp_size
        check_parallel(config, parallel)
        register_parallel_groups(comm_manager, parallel)
        if CONTEXT_PARALLEL and getattr(parallel, "cp_size", 1) > 1:
            comm_manager.register_group(name="cp_group", group_num=parallel.world_size // parallel.cp_size,
                                        group_size=parallel.cp_size)
        if MOE:
            register_expert_groups(comm_manager, config, infer_config)
        # lmhead_tp_group holding other attention data-parallel groups' ranks gathers their rows first
        self.lmhead_gather = spans_requests(self.lmhead_tp_size, self.attn_tp_size)
        self.model = ModelModel(config, infer_config, comm_manager, prefix)
        if self.attn_tp_size > 1:
            split = [p for m in self.model.modules() if isinstance(m, (QKVParallelLinear, MergedColumnParallelLinear,
                                                                        RowParallelLinear)) for p in m.parameters(recurse=False)]
            logger.info("tensor parallel rank %d of %d: %d parameters split by module.linear over attn_tp_group",
                        comm_manager.get_rank("attn_tp_group"), self.attn_tp_size, len(split))
        self.lm_head = ColumnParallelLinear(
            input_size=config.hidden_size, output_size=config.vocab_size, bias=LM_HEAD_BIAS, tp_size=self.lmhead_tp_size,
            tp_rank=comm_manager.get_rank("lmhead_tp_group") if self.lmhead_tp_size > 1 else 0,
            quant_config=None, prefix="lm_head")      # the output head stays float, as in upstream's models
        if HEAD_TRANSFORM:
            self.head_transform = ModelHeadTransform(config, prefix="head_transform")

    def forward(self, input_ids, position_ids=None, forward_metadata: ForwardMetaData = None, **kwargs):
        hidden_states = self.model(input_ids, position_ids, forward_metadata)
        if MTP and self.model.next_n:
            prev_hidden_states = hidden_states
            hidden_states = verified_rows(hidden_states, forward_metadata)
        if HEAD_TRANSFORM:
            hidden_states = self.head_transform(hidden_states)
        if self.lmhead_gather:
            logits = self.lm_head_across_requests(hidden_states, forward_metadata.is_prefill)
        else:
            logits = self.lm_head(hidden_states)
        if self.lmhead_tp_size > 1 and not self.lmhead_gather:
            parts = [torch.empty_like(logits) for _ in range(self.lmhead_tp_size)]
            dist.all_gather(parts, logits, group=self.comm_manager.get_group("lmhead_tp_group"))
            logits = torch.cat(parts, dim=-1)
        if LOGITS_SCALING is not None and LOGITS_DIVIDED:
            logits = logits / getattr(self.config, LOGITS_SCALING)
        elif LOGITS_SCALING is not None:
            logits = logits * getattr(self.config, LOGITS_SCALING)
        logits = logits.float()
        if FINAL_SOFTCAP and self.config.final_logit_softcapping:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if MTP and self.model.next_n:
            return logits, prev_hidden_states      # the executor's MTP worker drafts from the hidden states
        return logits

    def lm_head_across_requests(self, hidden_states, is_prefill):
        """The logits where lmhead_tp_group spans attention data-parallel groups (other requests): every rank's rows
        through this rank's vocabulary shard, then each rank its own rows with the whole vocabulary."""
        group = self.comm_manager.get_group("lmhead_tp_group")
        gathered, rows = gather_rows(hidden_states, group, self.lmhead_tp_size, is_prefill)
        return own_rows_whole(self.lm_head(gathered), group, self.lmhead_tp_size, rows)

    def get_cache_info(self) -> ModelCacheInfo:
        if ONE_MIXER or LAYER_CACHES:
            # a layer without caches (an MLP layer) is not listed: the executor wants each listed layer's
            infos = [LayerCacheInfo(layer_idx=i, caches=list(layer.cache_entries))
                     for i, layer in enumerate(self.model.layers) if layer.cache_entries]
            return ModelCacheInfo(num_layers=len(infos), layer_infos=infos)
        infos = [LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries if not LINEAR_ATTENTION
                                                         or not layer.is_linear else getattr(layer, LINEAR_ATTN_NAME).cache_entries))
                 for i, layer in enumerate(self.model.layers)]
        return ModelCacheInfo(num_layers=len(infos), layer_infos=infos, **({"is_mla_backend": True} if MLA else {}))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        """The checkpoint's tensors by name, after transformers' renames of this architecture; q/k/v and gate/up
        into their stacked parallel linears; a tied lm_head from the input embedding. A tensor this model does
        not build (an MTP layer past num_hidden_layers, a vision tower) is skipped and logged; a parameter no
        tensor loads is an error that names it: never a silently random weight. A quantized checkpoint's tensors
        (W8A8: int8 weights, their weight_scale) load into the parameters module.quantization built from its
        quantization_config; a float tensor for an int8 parameter (a layer the checkpoint keeps float, which its
        ignore list does not name) is an error."""
        params = dict(self.named_parameters())
        if MOE:
            # a module with a loader of its own (the sparse-MoE block) takes its tensors, named relative to it
            own_loaders = {f"{name}.": module for name, module in self.named_modules()
                           if name and hasattr(module, "load_weights")}
        tied = getattr(self.config, "tie_word_embeddings", False)
        if NEVER_TIED:
            # the architecture ties no weights (its transformers class has none to tie): a tied config keeps its lm_head
            tied = False
        loaded, skipped = set(), []
        for name, tensor in weights:
            for pattern in TRANSPOSED_WEIGHTS:
                if re.search(pattern, name):
                    tensor = tensor.t().contiguous()
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
                if name.endswith(".weight_zero_point") and not tensor.any():
                    continue          # a symmetric scheme's zero points, all 0 (compressed-tensors writes them)
                skipped.append(name)
                continue
            if param.dtype == torch.int8 and tensor.is_floating_point():
                raise ValueError(f"{name} is {tensor.dtype} but the checkpoint's quantization_config makes {target} "
                                 "int8: list the layer in its ignore list, or quantize its weight")
            if param.is_floating_point() and not tensor.is_floating_point():
                raise ValueError(f"{name} is {tensor.dtype} but {target} is {param.dtype}: the checkpoint's "
                                 "quantization_config does not make this layer quantized (its ignore list names it, "
                                 "or the config has none); dequantize the checkpoint, or fix its quantization_config")
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
        missing = sorted(name for name in set(params) - loaded if not name.endswith(QUANT_DEFAULTS))
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s) of this model "
                             f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): its weights and "
                             "config.json do not describe the same model")
        return loaded

    def process_weights_after_loading(self):
        if MLA:
            for layer in self.model.layers:
                if not LINEAR_ATTENTION or not layer.is_linear:      # kimi_linear's KDA layers are no MLA
                    layer.self_attn.split_kv_b_weight()          # the absorb weights, before the linears are transposed
            # deepseek_r1's rule: NZ weights whenever the YAML asks (npu_mla_prolog_v3 reads its weights in FRACTAL_NZ)
            is_nz = getattr(self.infer_config.model_config, "enable_weight_nz", False)
        else:
            is_nz = (getattr(self.infer_config.model_config, "enable_weight_nz", False)
                     and self.infer_config.model_config.exe_mode != "npugraph_ex")
        modules = dict(self.named_modules())
        for name, module in modules.items():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                owner, _, leaf = name.rpartition(".")
                fused = leaf == "down_proj" and getattr(modules.get(owner), "w8a8", False)
                quant_method.process_weights_after_loading(module, is_nz=is_nz,
                                                           scales_dtype=scales_dtype(module, fused))


def scales_dtype(module, fused_mlp_down):
    """A W8A8 linear's scale dtypes after loading, as models/qwen sets them: weight_scale float32 (npu_quant_matmul's
    per-channel scale beside the per-token one); smooth_scales float32 for the down projection of a fused W8A8 MLP
    (npu_dequant_swiglu_quant's quant_scale), else the run dtype npu_dynamic_quant takes; {} for a layer without."""
    if not hasattr(module, "weight_scale") or not hasattr(module, "smooth_scales"):
        return {}
    return {"scale_dtype": torch.float32, **({"smooth_scale_dtype": torch.float32} if fused_mlp_down else {})}


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


def register_parallel_groups(comm_manager, parallel):
    """The attention, embedding and lm-head tensor-parallel groups, consecutive ranks each, as upstream's
    qwen3_moe registers them (init_parallel_comm_group)."""
    world = parallel.world_size
    for name, size in (("attn_tp_group", parallel.attn_tp_size), ("embed_tp_group", parallel.embed_tp_size),
                       ("lmhead_tp_group", parallel.lmhead_tp_size)):
        comm_manager.register_group(name=name, group_num=world // size, group_size=size)


def check_parallel(config, parallel):
    """Heads and widths split evenly at parallel_config's tensor-parallel sizes (module.linear's layers divide
    them); otherwise one line saying what to set. Every layout of sizes that divide world_size runs: a group that
    holds other attention data-parallel groups' ranks gathers their rows (parallel.py)."""
    if not CONTEXT_PARALLEL and getattr(parallel, "cp_size", 1) > 1:
        # the executor would hand every rank the whole padded prefill and its own segments (cp_metadata), which
        # this model's attention does not read: wrong text, silently
        raise ValueError(f"cp_size {parallel.cp_size}: this model's attention does not attend the executor's prefill "
                         "context-parallel segments; set parallel_config.cp_size to 1")
    if NO_ATTENTION:
        # no attention heads (a state-space model): the vocabulary's splits alone (the Mamba2 layers refuse attn_tp_size
        # above 1 themselves)
        for size in (parallel.lmhead_tp_size, getattr(parallel, "embed_tp_size", 1)):
            if config.vocab_size % size:
                raise ValueError(f"vocab_size {config.vocab_size} does not divide by tensor-parallel size {size}: "
                                 "choose a size that divides it")
        return
    heads = config.num_attention_heads
    checks = [("num_attention_heads", heads, parallel.attn_tp_size),
              ("vocab_size", config.vocab_size, parallel.lmhead_tp_size),
              ("vocab_size", config.vocab_size, getattr(parallel, "embed_tp_size", 1))]
    if HEADS_PER_LAYER:
        # each layer built with its own query heads (the global count builds none)
        checks = [(f"{HEADS_PER_LAYER}[{index}]", count, parallel.attn_tp_size)
                  for index, count in enumerate(getattr(config, HEADS_PER_LAYER))] + checks[1:]
    if getattr(config, "intermediate_size", None):      # the dense MLP's (a model of MoE layers only may have none)
        checks.append(("intermediate_size", config.intermediate_size, parallel.attn_tp_size))
    if not MLA and KV_HEADS_PER_LAYER:
        # each layer built with its own (the heterogeneous config refuses a global read of them): each count splits
        for index in range(config.num_hidden_layers):
            what = f"per_layer_config[{index}].num_key_value_heads"
            count = config.per_layer_config[index].num_key_value_heads
            if count >= parallel.attn_tp_size:
                checks.append((what, count, parallel.attn_tp_size))
            elif parallel.attn_tp_size % count:
                checks.append((f"{what} (replicated)", parallel.attn_tp_size, count))
    elif not MLA:      # MLA: one latent key / value head, every rank holds it whole; the query heads split
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if kv_heads >= parallel.attn_tp_size:
            checks.append(("num_key_value_heads", kv_heads, parallel.attn_tp_size))
        elif parallel.attn_tp_size % kv_heads:
            checks.append(("num_key_value_heads (replicated)", parallel.attn_tp_size, kv_heads))
        if KV_HEADS_BY_LAYER_TYPE:
            # a kind's layers built with a multiple of them (the attention's rule): each such count splits too
            for kind, multiple in KV_HEADS_BY_LAYER_TYPE:
                what, count = f"{multiple} x num_key_value_heads ({kind} layers)", multiple * kv_heads
                if kind in config.layer_types and count >= parallel.attn_tp_size:
                    checks.append((what, count, parallel.attn_tp_size))
                elif kind in config.layer_types and parallel.attn_tp_size % count:
                    checks.append((f"{what} (replicated)", parallel.attn_tp_size, count))
    for what, value, size in checks:
        if value % size:
            raise ValueError(f"{what} {value} does not divide by tensor-parallel size {size}: choose a size that divides it")
