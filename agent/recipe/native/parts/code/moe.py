"""The sparse-MoE block as upstream's fastest models run experts (models/qwen3_moe, deepseek_r1, gpt_oss):
gating, npu_moe_init_routing_v2, grouped matmuls over experts stacked once, npu_moe_finalize_routing; expert
parallel as upstream derives it (moe_ep_size = world_size // moe_tp_size): each EP rank holds its experts, the
prefill's tokens move by all-to-all double routing, the decode's by npu_moe_distribute_dispatch_v2 / combine_v2."""

import types

import torch
import torch.distributed as dist
import torch_npu
from torch import nn

from executor.utils import calc_moe_hccl_buffer_size
from executor.utils.forward_metadata import get_forward_metadata
from module.fuse_moe_gmm import FusedMoEGMM
from module.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear

from .parallel import gather_rows, spans_requests, sum_own_rows
from .experts_geglu import ModelGegluExperts
from .swiglu_clamped import ModelClampedExperts, clamped_swiglu, swiglu_alpha

# which layers' MLP is this block: "all", or the config key transformers decides it by
MOE_LAYERS = "all"
EXPERTS_KEY = "num_experts"         # the config key of the routed expert count
TOPK_KEY = "num_experts_per_tok"    # the config key of the experts each token is routed to (aria: moe_topk)
TOPK_PER_LAYER = False              # that key a list, one entry per layer (hunyuan_v1_moe's moe_topk)
WIDTH_KEY = "moe_intermediate_size"  # the config key of one expert's intermediate width
ROUTER = "gate"                     # the router's name in the checkpoint
ROUTER_STORED = ""                  # the checkpoint's router path where it is nested deeper (hunyuan_v1_moe: "gate.wg")
ROUTER_BIAS = False
ROUTER_FP32 = False                 # router weight and its input in fp32 (deepseek_v3)
SCORING = "softmax"                 # "softmax" | "sigmoid" | "sparsemixer" (phimoe's, config.router_jitter_noise)
RENORMALIZE = True                  # top-k weights divided by their sum: a literal, or the config key that says
SELECTION_BIAS = False              # e_score_correction_bias added to the scores for choosing experts only
SELECT_ON_LOGITS = False            # pick by the router's logits, not its scores (kolibri1: plus that bias; llama4)
# where the checkpoint stores the selection bias, relative to the block, where not on the router: "" (the router's
# e_score_correction_bias), "e_score_correction_bias" (hy_v3: the block's), "gate.moe_statics.e_score_correction_bias"
# (ernie4_5_moe: [1, E] under the router's moe_statics)
SELECTION_BIAS_NAME = ""
GROUPS = False                      # grouped top-k (config.n_group groups, config.topk_group kept)
GROUP_SELECT = "top2_sum"           # a group's score: "max" | "top2_sum" (the sum of its best two)
ROUTED_SCALING = False              # weights times config.routed_scaling_factor
# the weights multiply each chosen expert's input, not its output (llama4's Llama4TextMoe): plain torch
INPUT_SCALED = False
SCALING_KEY = "routed_scaling_factor"   # the config key of that factor (hy_v3: router_scaling_factor)
EXPERTS = "gmm"                     # "gmm" (halves, no bias: FusedMoEGMM) | "biased_interleaved" (gpt_oss)
SWIGLU_ALPHA = 1.702                # the clamped swiglu's alpha where the config has none (transformers' constant)
# the "gmm" experts' and the shared experts' halves through gpt_oss's clamped swiglu (minimax_m3): plain torch
CLAMPED_SWIGLU = False
GEGLU = False                       # the "gmm" experts' gelu-tanh(gate) * up (gemma4): npu_geglu between the matmuls
# the experts take the block's input through this norm of the block's, the router the input itself (gemma4: the
# layer's pre_feedforward_layernorm_2, the router on the residual stream); "": both take the input as it is
EXPERTS_NORM = ""
FUSED_LAYOUT = "E,2I,H"             # transformers' fused gate_up parameter: "E,2I,H" or "E,H,2I"
CKPT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")   # the checkpoint's per-expert (gate, up, down) names
SHARED = None                       # shared experts: None | "plain" | "gated" (a sigmoid gate on their output)
SHARED_NAME = "shared_experts"
# the shared experts' width: "per_expert" (moe_intermediate_size x n_shared_experts) or the config key holding it
SHARED_WIDTH = "per_expert"
SHARED_UNIT_KEY = "moe_intermediate_size"   # "per_expert": the config key of one shared expert's width
SHARED_COUNT_KEY = "n_shared_experts"        # and of their count
# "per_expert": the config key of the width transformers gives them where their count is 0 (hy_v3's
# intermediate_size: its shared MLP's `width or config.intermediate_size`); None: none are built then
SHARED_ZERO_WIDTH = None
SHARED_BIAS = False                 # the shared experts' biases: a literal, or the config key that sets them (mlp_bias)

MOE_CHUNK_MAX_LEN = 65536           # upstream's deepseek_r1 default of custom_params.moe_chunk_max_len
# npu_moe_gating_top_k's fused kernel on Atlas A2 / A3: 256 experts (torch_npu's page; upstream's deepseek_r1
# _forward_gate also takes 384), a selection bias, 8 groups of which 4 are kept, k <= 32
GATING_TOP_K_EXPERTS = (256, 384)
GATING_TOP_K_GROUPS = (8, 4)
GATING_TOP_K_MAX_K = 32


def is_moe_layer(config, layer_idx):
    """Whether decoder layer `layer_idx` runs the sparse-MoE block (else the dense MLP), by the config key
    transformers reads."""
    if MOE_LAYERS in ("first_k_dense_replace", "num_dense_layers"):
        return layer_idx >= getattr(config, MOE_LAYERS)
    if MOE_LAYERS == "mlp_layer_types":
        return config.mlp_layer_types[layer_idx] == "sparse"
    if MOE_LAYERS == "moe_layer_interval":
        # ernie4_5_moe: every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index
        return ((layer_idx + 1) % config.moe_layer_interval == 0
                and config.moe_layer_start_index <= layer_idx <= config.moe_layer_end_index)
    if MOE_LAYERS == "decoder_sparse_step":
        return layer_idx not in (config.mlp_only_layers or []) and (layer_idx + 1) % config.decoder_sparse_step == 0
    if MOE_LAYERS == "expert_layer_period":
        # jamba: every expert_layer_period-th layer from expert_layer_offset
        return layer_idx % config.expert_layer_period == config.expert_layer_offset
    return True


def experts_quant_config(quant_config, prefix):
    """The grouped matmul's quant_config: None where the checkpoint keeps its experts float (its `ignore` names
    `prefix`, by upstream's own rule: module.quantization.compressed_tensors.utils.check_equal_or_regex_match).
    Upstream's CompressedTensorsConfig.get_quant_method gives an ignored layer UnquantizedLinearMethod, whose
    weights are a linear's, not FusedMoEGMM's (vLLM's PR 28878 fixed the same for its FusedMoE)."""
    ignore = getattr(quant_config, "ignore", None)
    if ignore:
        from module.quantization.compressed_tensors.utils import check_equal_or_regex_match

        if check_equal_or_regex_match(prefix, ignore):
            return None
    return quant_config


def shared_experts_width(config):
    """The shared experts' intermediate width (0: this checkpoint has none)."""
    if SHARED_WIDTH == "per_expert" and SHARED_ZERO_WIDTH is not None:
        return getattr(config, SHARED_UNIT_KEY) * (getattr(config, SHARED_COUNT_KEY) or 0) \
            or getattr(config, SHARED_ZERO_WIDTH)
    if SHARED_WIDTH == "per_expert":
        return getattr(config, SHARED_UNIT_KEY) * (getattr(config, SHARED_COUNT_KEY) or 0)
    return getattr(config, SHARED_WIDTH) or 0


class MoeLayout:
    """This rank's place in the experts' layout, as upstream's ParallelConfig derives it: the experts' widths split
    over moe_tp_group (moe_tp_size consecutive ranks), the experts themselves over moe_ep_group (moe_ep_size =
    world_size // moe_tp_size ranks, one of each moe_tp_group: group_stride world_size // moe_ep_size, as
    upstream's qwen3_moe registers it), EP rank r holding experts [r * E / moe_ep_size, (r + 1) * E / moe_ep_size).
    `gather`: moe_tp_group holds ranks of other attention data-parallel groups (other requests), so the block
    gathers their tokens first (parallel.py) rather than summing different tokens' partials."""

    def __init__(self, infer_config, comm_manager, num_experts):
        parallel = infer_config.parallel_config
        self.tp_size = parallel.moe_tp_size
        self.ep_size = parallel.world_size // self.tp_size
        self.tp_rank = comm_manager.get_rank("moe_tp_group") if self.tp_size > 1 else 0
        self.ep_rank = comm_manager.get_rank("moe_ep_group") if self.ep_size > 1 else 0
        if num_experts % self.ep_size:
            world = parallel.world_size
            fit = next(m for m in range(1, world + 1) if world % m == 0 and num_experts % (world // m) == 0)
            raise ValueError(f"{num_experts} routed experts do not split over moe_ep_size {self.ep_size} (upstream "
                             f"derives world_size {world} // moe_tp_size {self.tp_size}); set moe_tp_size to {fit} "
                             f"(moe_ep_size {world // fit})")
        self.local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.local_experts
        self.gather = spans_requests(self.tp_size, parallel.attn_tp_size)


def register_expert_groups(comm_manager, config, infer_config):
    """moe_tp_group (moe_tp_size consecutive ranks), and for expert parallel moe_ep_group and its MC2 communicator
    moe_ep_group_mc2 (one rank of each moe_tp_group: stride world_size // moe_ep_size; the MC2 group on a
    communicator of its own, its HCCL buffer sized for dispatch / combine), as upstream's qwen3_moe registers them."""
    parallel = infer_config.parallel_config
    world, tp_size = parallel.world_size, parallel.moe_tp_size
    ep_size = world // tp_size
    if tp_size > 1:
        comm_manager.register_group(name="moe_tp_group", group_num=world // tp_size, group_size=tp_size)
    if ep_size > 1:
        comm_manager.register_group(name="moe_ep_group", group_num=world // ep_size, group_size=ep_size,
                                    group_stride=world // ep_size, return_name=True)
        # the decode's tokens entering the block on one rank: the batch, every moe-tp rank's where it gathers them
        tokens = infer_config.scheduler_config.batch_size_per_dp_rank
        if spans_requests(tp_size, parallel.attn_tp_size):
            tokens *= tp_size
        if TOPK_PER_LAYER:
            # the experts per token per layer: the buffers sized for the most of any layer
            sizes = types.SimpleNamespace(num_experts=getattr(config, EXPERTS_KEY), hidden_size=config.hidden_size,
                                          num_experts_per_tok=max(getattr(config, TOPK_KEY)))
        else:
            sizes = types.SimpleNamespace(num_experts=getattr(config, EXPERTS_KEY), hidden_size=config.hidden_size,
                                          num_experts_per_tok=getattr(config, TOPK_KEY))
        comm_manager.register_group(name="moe_ep_group_mc2", group_num=world // ep_size, group_size=ep_size,
                                    group_stride=world // ep_size, return_name=True, allow_physical_reuse=False,
                                    hccl_buffer_size=calc_moe_hccl_buffer_size(
                                        infer_config, sizes, is_full_mesh_v2=True, max_local_moe_tokens=tokens),
                                    group_type=None)


def mc2_kwargs(comm_manager, layout, num_experts):
    """The MC2 kernels' group and layout arguments (upstream's set_mc2_kwargs): the EP domain is moe_ep_group's
    MC2 communicator; the kernels' own TP domain is unused (one rank: the op-plugin pages support no other), the
    experts' moe-tp split is summed over moe_tp_group after combine."""
    group = comm_manager.get_group_name("moe_ep_group_mc2")
    return {"group_ep": group, "ep_world_size": layout.ep_size, "ep_rank_id": layout.ep_rank,
            "moe_expert_num": num_experts, "group_tp": group, "tp_world_size": 1, "tp_rank_id": 0,
            "expert_shard_type": 0, "shared_expert_num": 0, "shared_expert_rank_num": 0, "global_bs": 0}


def sparsemixer(logits, jitter_eps):
    """phimoe's sparsemixer at inference: (weights [T, 2] fp32, expert ids [T, 2]). Each of two rounds takes the best
    expert left, weighted by the softmax over the experts within a relative 2 x jitter_eps of it; the first round's
    expert is out of the second. Plain torch: no NPU gating op masks by a relative threshold."""
    left, weights, expert_ids = logits, [], []
    for _ in range(2):
        best, chosen = left.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter_eps
        weights.append(left.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, chosen))
        expert_ids.append(chosen)
        left = left.scatter(-1, chosen, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(expert_ids, dim=-1)


def scale_routed_rows(expanded_x, weights, expanded_row_idx):
    """Each routed row (a token for one of its experts) times that pair's router weight, in the rows' dtype, as
    llama4 scales its experts' inputs: expanded_row_idx[t * K + k] is the row of token t's k-th expert. Plain torch:
    npu_moe_init_routing_v2's scale is a quantisation's, one per token."""
    row_weights = weights.new_empty(expanded_x.shape[0])
    row_weights.index_copy_(0, expanded_row_idx.long(), weights.reshape(-1))
    return expanded_x * row_weights.to(expanded_x.dtype)[:, None]


def _check_moe_split(what, width, tp_size):
    if width % tp_size:
        raise ValueError(f"{what} {width} does not divide by moe_tp_size {tp_size}: choose a size that divides it")


class ModelExperts(nn.Module):
    """Stacked experts with per-expert biases and gpt_oss's interleaved gate/up, clamped swiglu (limit,
    alpha, up + 1) in plain torch: npu_swiglu has no clamp. Weights [E, H, 2I / tp] as the checkpoint
    stores them (no transpose); the down bias only on moe-tp rank 0 (the all-reduce adds the ranks)."""

    def __init__(self, config, num_experts, hidden_size, width, tp_size, tp_rank, params_dtype, first_expert=0):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # this EP rank's experts [first_expert, first_expert + num_experts) of the checkpoint's
        self.first_expert, self.num_experts = first_expert, num_experts
        self.width = width // tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * self.width, dtype=params_dtype),
                                         requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * self.width, dtype=torch.float32),
                                              requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, self.width, hidden_size, dtype=params_dtype),
                                      requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                           requires_grad=False)
        self.limit = config.swiglu_limit
        self.alpha = getattr(config, "swiglu_alpha", SWIGLU_ALPHA)

    def forward(self, x, expert_tokens, group_list_type=1):
        gate_up = torch_npu.npu_grouped_matmul([x], [self.gate_up_proj], bias=[self.gate_up_proj_bias],
                                               group_list=expert_tokens, group_type=0,
                                               group_list_type=group_list_type, split_item=3)[0]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return torch_npu.npu_grouped_matmul([(up + 1) * glu], [self.down_proj], bias=[self.down_proj_bias],
                                            group_list=expert_tokens, group_type=0,
                                            group_list_type=group_list_type, split_item=3)[0]

    def load_fused(self, name, weight):
        """The checkpoint's fused tensors: this EP rank's experts, this moe-tp rank's slice of the intermediate axis."""
        weight = weight[self.first_expert:self.first_expert + self.num_experts]
        start, end = self.tp_rank * self.width, (self.tp_rank + 1) * self.width
        if name == "gate_up_proj":
            self.gate_up_proj.data.copy_(weight[:, :, 2 * start:2 * end])
        elif name == "gate_up_proj_bias":
            self.gate_up_proj_bias.data.copy_(weight[:, 2 * start:2 * end])
        elif name == "down_proj":
            self.down_proj.data.copy_(weight[:, start:end, :])
        elif name == "down_proj_bias":
            self.down_proj_bias.data.copy_(weight if self.tp_rank == 0 else torch.zeros_like(weight))
        else:
            raise KeyError(f"experts.{name}")


class ModelSharedExperts(nn.Module):
    """The shared experts: gate/up merged, npu_swiglu, down; split over moe_tp like the routed experts
    (their partial sums join the routed output before the moe-tp all-reduce)."""

    def __init__(self, config, width, tp_size, tp_rank, prefix=""):
        super().__init__()
        quant_config = getattr(config, "quant_config", None)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2, bias=SHARED_BIAS, tp_size=tp_size,
                                                       tp_rank=tp_rank, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=SHARED_BIAS, tp_size=tp_size, tp_rank=tp_rank,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        if CLAMPED_SWIGLU:
            self.limit, self.alpha = config.swiglu_limit, swiglu_alpha(config)

    def forward(self, x):
        if CLAMPED_SWIGLU:
            return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit, self.alpha))
        return self.down_proj(torch_npu.npu_swiglu(self.gate_up_proj(x)))


class ModelSparseMoeBlock(nn.Module):
    """Routed experts: the gating, npu_moe_init_routing_v2, npu_grouped_matmul over experts stacked once in
    process_weights_after_loading, npu_moe_finalize_routing, a moe-tp all-reduce. forward: hidden_states
    [T, H] -> [T, H]. Parameter names follow the checkpoint's block; load_weights takes names relative to it."""

    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.comm_manager = comm_manager
        self.hidden_size = config.hidden_size
        self.num_experts = getattr(config, EXPERTS_KEY)
        if TOPK_PER_LAYER:
            # the layer's own entry; the layer's index is its prefix's ("model.layers.<i>.mlp")
            self.top_k = getattr(config, TOPK_KEY)[int(prefix.split(".")[-2])]
        else:
            self.top_k = getattr(config, TOPK_KEY)
        width = self.expert_width = getattr(config, WIDTH_KEY)
        layout = self.layout = MoeLayout(infer_config, comm_manager, self.num_experts)
        self.moe_tp_size, self.moe_ep_size, tp_rank = layout.tp_size, layout.ep_size, layout.tp_rank
        _check_moe_split(WIDTH_KEY, width, self.moe_tp_size)
        self.renormalize = RENORMALIZE
        if ROUTED_SCALING:
            self.routed_scaling_factor = getattr(config, SCALING_KEY)
        if SCORING == "sparsemixer":
            self.jitter_eps = config.router_jitter_noise
        if GROUPS:
            self.n_group, self.topk_group = config.n_group, config.topk_group
        # quant_config reaches the router and the grouped matmul as upstream's MoE models pass it (a checkpoint's
        # ignore list keeps its router in float)
        quant_config = getattr(config, "quant_config", None)
        router = ReplicatedLinear(self.hidden_size, self.num_experts, bias=ROUTER_BIAS,
                                  params_dtype=torch.float32 if ROUTER_FP32 else None, quant_config=quant_config,
                                  prefix=f"{prefix}.{ROUTER}")
        if SELECTION_BIAS:
            # added to the scores for choosing experts only, never to the weights
            router.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32),
                                                          requires_grad=False)
        setattr(self, ROUTER, router)
        if EXPERTS == "gmm":
            # this EP rank's experts alone (FusedMoEGMM's own EP filter covers moe_tp_size 1 only)
            self.experts = (ModelClampedExperts if CLAMPED_SWIGLU else ModelGegluExperts if GEGLU else FusedMoEGMM)(num_experts=layout.local_experts, hidden_size=self.hidden_size,
                                       intermediate_size=width, bias=False, tp_size=self.moe_tp_size, tp_rank=tp_rank,
                                       params_dtype=torch.get_default_dtype(),
                                       quant_config=experts_quant_config(quant_config, f"{prefix}.experts"),
                                       prefix=f"{prefix}.experts")
            if CLAMPED_SWIGLU:
                self.experts.limit = config.swiglu_limit
                self.experts.alpha = swiglu_alpha(config)
            # (param_name, checkpoint name, expert_id, shard_id): the checkpoint's per-expert tensors
            self.expert_params_mapping = FusedMoEGMM.make_expert_params_mapping(
                ckpt_gate_proj_name=CKPT_EXPERT_NAMES[0], ckpt_down_proj_name=CKPT_EXPERT_NAMES[2],
                ckpt_up_proj_name=CKPT_EXPERT_NAMES[1], num_experts=self.num_experts)
        else:
            self.experts = ModelExperts(config, layout.local_experts, self.hidden_size, width, self.moe_tp_size, tp_rank,
                                        torch.get_default_dtype(), first_expert=layout.first_expert)
        if SHARED is not None:
            # shared experts where the checkpoint's config gives them a width
            self.shared_width = shared_experts_width(config)
            if self.shared_width:
                _check_moe_split("the shared experts' width", self.shared_width, self.moe_tp_size)
                setattr(self, SHARED_NAME, ModelSharedExperts(
                    config, self.shared_width, self.moe_tp_size, tp_rank, prefix=f"{prefix}.{SHARED_NAME}"))
                if SHARED == "gated":
                    setattr(self, SHARED_NAME + "_gate", ReplicatedLinear(
                        self.hidden_size, 1, bias=False, quant_config=quant_config,
                        prefix=f"{prefix}.{SHARED_NAME}_gate"))
        self.enable_weight_nz = getattr(infer_config.model_config, "enable_weight_nz", False)
        if self.moe_ep_size > 1:
            if INPUT_SCALED and self.top_k != 1:
                raise ValueError(f"moe_ep_size {self.moe_ep_size} with {self.top_k} experts per token whose inputs "
                                 "the router scales: the decode's dispatch scales one per token; set moe_tp_size to "
                                 f"{infer_config.parallel_config.world_size} (moe_ep_size 1)")
            self.mc2_kwargs = mc2_kwargs(comm_manager, layout, self.num_experts)
        # custom_params.moe_chunk_max_len (upstream's deepseek_r1, default 65536): a long prefill routed and run
        # through the experts this many tokens at a time, bounding the routing's and the experts' buffers
        custom_params = getattr(infer_config.model_config, "custom_params", None) or {}
        self.moe_chunk_max_len = custom_params.get("moe_chunk_max_len", MOE_CHUNK_MAX_LEN)
        if not isinstance(self.moe_chunk_max_len, int) or self.moe_chunk_max_len <= 0:
            raise ValueError(f"custom_params.moe_chunk_max_len {self.moe_chunk_max_len!r}: set a positive number of "
                             f"tokens (upstream's default {MOE_CHUNK_MAX_LEN})")
        # chunks are cut on each rank alone: only where every rank of the block's collectives holds the same tokens
        # (no attention data parallel) do all of them cut the same number
        parallel = infer_config.parallel_config
        self.chunk_tokens = parallel.attn_tp_size == parallel.world_size

    def gating(self, hidden_states):
        """(top-k weights [T, K] in fp32, expert ids [T, K] int32) as transformers' router computes them."""
        logits = getattr(self, ROUTER)(hidden_states.float() if ROUTER_FP32 else hidden_states)
        if SCORING == "sparsemixer":
            weights, expert_ids = sparsemixer(logits.float(), self.jitter_eps)
            return weights, expert_ids.to(torch.int32)
        if SCORING == "softmax" and not GROUPS and not SELECTION_BIAS:
            weights, expert_ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=self.top_k)
            weights = weights.float()
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if ROUTED_SCALING:
                weights = weights * self.routed_scaling_factor
            return weights, expert_ids.to(torch.int32)
        if SCORING == "sigmoid" and self.renormalize and SELECTION_BIAS and GROUPS:
            if (self.num_experts in GATING_TOP_K_EXPERTS and (self.n_group, self.topk_group) == GATING_TOP_K_GROUPS
                    and self.top_k <= GATING_TOP_K_MAX_K):
                weights, expert_ids, _ = torch_npu.npu_moe_gating_top_k(
                    logits, k=self.top_k, bias=getattr(self, ROUTER).e_score_correction_bias.float(),
                    k_group=self.topk_group, group_count=self.n_group,
                    group_select_mode=1 if GROUP_SELECT == "top2_sum" else 0,  # 0: group max, 1: sum of its top 2
                    renorm=0, norm_type=1,  # sigmoid, then top-k
                    routed_scaling_factor=self.routed_scaling_factor if ROUTED_SCALING else 1.0, eps=1e-20)
                return weights.float(), expert_ids.to(torch.int32)
        # plain torch where the fused gating does not take this routing
        scores = logits.float().sigmoid() if SCORING == "sigmoid" else logits.float().softmax(dim=-1)
        if SELECTION_BIAS and SELECT_ON_LOGITS:
            # the bias added to the router's logits, the weights still its scores (kolibri1)
            choice = logits.float() + getattr(self, ROUTER).e_score_correction_bias.float()
        elif SELECTION_BIAS:
            choice = scores + getattr(self, ROUTER).e_score_correction_bias.float()
        elif SELECT_ON_LOGITS:
            # the top-k of the logits, as llama4's router: their sigmoids round to a tie at 1 where they are large
            choice = logits.float()
        else:
            choice = scores
        if GROUPS:
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            if GROUP_SELECT == "max":
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(choice.shape[0], -1)
        expert_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if SCORING == "sigmoid" else 0.0))
        if ROUTED_SCALING:
            weights = weights * self.routed_scaling_factor
        return weights, expert_ids.to(torch.int32)

    def forward(self, hidden_states):
        if self.chunk_tokens and hidden_states.shape[0] > self.moe_chunk_max_len:
            # a prompt longer than moe_chunk_max_len: chunk by chunk (each chunk's tokens route independently)
            return torch.cat([self.forward(chunk) for chunk in hidden_states.split(self.moe_chunk_max_len)])
        is_prefill = get_forward_metadata().is_prefill
        if self.layout.gather:
            # moe_tp_group holds other requests' ranks: every rank's tokens through the experts, each its own back
            group = self.comm_manager.get_group("moe_tp_group")
            hidden_states, rows = gather_rows(hidden_states, group, self.moe_tp_size, is_prefill)
            return sum_own_rows(self.experts_forward(hidden_states, is_prefill), group, self.moe_tp_size, rows)
        out = self.experts_forward(hidden_states, is_prefill)
        if self.moe_tp_size > 1:
            dist.all_reduce(out, group=self.comm_manager.get_group("moe_tp_group"))
        return out

    def experts_forward(self, hidden_states, is_prefill):
        """The routed experts' weighted sum and the shared experts' output, this moe-tp rank's partial of it."""
        tokens = hidden_states.shape[0]
        weights, expert_ids = self.gating(hidden_states)
        if EXPERTS_NORM:
            hidden_states = getattr(self, EXPERTS_NORM)(hidden_states)
        if SHARED is not None:
            shared = None
            if self.shared_width:
                shared = getattr(self, SHARED_NAME)(hidden_states)
                if SHARED == "gated":
                    shared = torch.sigmoid(getattr(self, SHARED_NAME + "_gate")(hidden_states)) * shared
        if self.moe_ep_size > 1:
            exchange = self.double_routing if is_prefill else self.dispatch_combine
            return exchange(hidden_states, weights, expert_ids, shared if SHARED is not None else None)
        expanded_x, expanded_row_idx, tokens_per_expert, _ = torch_npu.npu_moe_init_routing_v2(
            hidden_states, expert_ids, active_num=tokens * self.top_k, expert_num=self.num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True,  # 1: tokens per expert (counts)
            active_expert_range=[0, self.num_experts], quant_mode=-1)
        if INPUT_SCALED:
            expanded_x = scale_routed_rows(expanded_x, weights, expanded_row_idx)
            weights = torch.ones_like(weights)
        expert_out = self.experts(expanded_x, tokens_per_expert, group_list_type=1)
        out = torch_npu.npu_moe_finalize_routing(
            expert_out, skip1=shared if SHARED is not None else None, skip2=None, bias=None, scales=weights.to(expert_out.dtype),
            expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=None,
            drop_pad_mode=2)  # 2: init_routing_v2's row order (token * K + k)
        return out

    def double_routing(self, hidden_states, weights, expert_ids, shared):
        """Prefill over moe_ep_group, as upstream's qwen3_moe and deepseek_r1 (moe_infer_double_routing): tokens
        sorted by expert, the per-expert counts exchanged, each rank's tokens sent to their experts' ranks
        (all_to_all_single), regrouped by local expert (npu_moe_re_routing), the grouped matmuls, and back the
        same way; the counts are read on the host (the split sizes), as upstream does at prefill."""
        group = self.comm_manager.get_group("moe_ep_group")
        expanded_x, expanded_row_idx, tokens_per_expert, _ = torch_npu.npu_moe_init_routing_v2(
            hidden_states, expert_ids, active_num=expert_ids.numel(), expert_num=self.num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True,  # 1: tokens per expert (counts)
            active_expert_range=[0, self.num_experts], quant_mode=-1)
        if INPUT_SCALED:
            expanded_x = scale_routed_rows(expanded_x, weights, expanded_row_idx)
            weights = torch.ones_like(weights)
        # (experts,) -> (EP ranks x their local experts): what each rank sends this rank's experts
        received_per_expert = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(received_per_expert, tokens_per_expert, group=group)
        splits = torch.stack([received_per_expert, tokens_per_expert]).view(2, self.moe_ep_size, -1).sum(2)
        received_splits, sent_splits = splits.cpu().tolist()
        received = expanded_x.new_empty((sum(received_splits), expanded_x.shape[1]))
        dist.all_to_all_single(received, expanded_x, received_splits, sent_splits, group=group)
        by_expert, _, unsort, tokens_per_local_expert = torch_npu.npu_moe_re_routing(
            received, received_per_expert.view(self.moe_ep_size, -1))
        expert_out = self.experts(by_expert, tokens_per_local_expert, group_list_type=1)
        expert_out = expert_out.index_select(0, unsort.float().argsort().int())
        returned = expert_out.new_empty(expanded_x.shape)
        dist.all_to_all_single(returned, expert_out, sent_splits, received_splits, group=group)
        return torch_npu.npu_moe_finalize_routing(
            returned, skip1=shared, skip2=None, bias=None, scales=weights.to(returned.dtype),
            expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=None, drop_pad_mode=2)

    def dispatch_combine(self, hidden_states, weights, expert_ids, shared):
        """Decode over the MC2 group, as upstream's qwen3_moe (moe_infer_dispatch_combine): each token to the
        ranks of its top-k experts (npu_moe_distribute_dispatch_v2), the grouped matmuls on what this rank's
        experts received, and back, summed with the routing weights (npu_moe_distribute_combine_v2); nothing
        is read back to the host (a compiled decode)."""
        if INPUT_SCALED:
            # one expert per token (the block's __init__ holds it): its input scaled before dispatch
            hidden_states = hidden_states * weights.to(hidden_states.dtype)
            weights = torch.ones_like(weights)
        expand_x, _, assist_info, expert_tokens, ep_recv_counts, tp_recv_counts = \
            torch_npu.npu_moe_distribute_dispatch_v2(x=hidden_states, expert_ids=expert_ids, **self.mc2_kwargs,
                                                     x_active_mask=None, scales=None, quant_mode=0,
                                                     comm_alg="fullmesh_v2")[:6]
        expert_out = self.experts(expand_x, expert_tokens, group_list_type=1)
        out = torch_npu.npu_moe_distribute_combine_v2(
            expand_x=expert_out, expert_ids=expert_ids, assist_info_for_combine=assist_info,
            ep_send_counts=ep_recv_counts, expert_scales=weights.to(torch.float32), tp_send_counts=tp_recv_counts,
            **self.mc2_kwargs, x_active_mask=None, comm_quant_mode=0)
        if shared is not None:
            out = out + shared
        return out

    def load_weights(self, weights):
        """Checkpoint tensors named relative to this block (the router's "<name>.weight", "experts.0.<gate>.weight",
        ...); returns the parameter names loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if name.endswith(".weight_zero_point") and not weight.any():
                continue          # a symmetric W8A8 scheme's zero points, all 0 (compressed-tensors writes them)
            if name.startswith("experts."):
                if EXPERTS == "gmm":
                    for target, expert_id, shard_id, tensor in self._expert_tensors(name, weight):
                        param = params[target]
                        param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id)
                        loaded.add(target)
                else:
                    self.experts.load_fused(name.split(".", 1)[1], weight)
                    loaded.add(name)
                continue
            if ROUTER_STORED and name.startswith(ROUTER_STORED + "."):
                name = ROUTER + name[len(ROUTER_STORED):]        # the router nested in the checkpoint (gate.wg)
            if SELECTION_BIAS_NAME and name == SELECTION_BIAS_NAME:
                # the selection bias stored beside the router (hy_v3) or as [1, E] under it (ernie4_5_moe)
                name, weight = f"{ROUTER}.e_score_correction_bias", weight.reshape(-1)
            if SHARED is not None and name.startswith(SHARED_NAME):
                if not self.shared_width:
                    continue          # this checkpoint's config gives its shared experts no width: none are built
                for shard_id, ckpt_name in enumerate(("gate_proj", "up_proj")):
                    if name.startswith(SHARED_NAME + ".") and f".{ckpt_name}." in name:
                        target = name.replace(ckpt_name, "gate_up_proj")
                        params[target].weight_loader(params[target], weight, shard_id)
                        loaded.add(target)
                        break
                else:
                    param = params[name]
                    getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, weight)
                    loaded.add(name)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"{name}: no parameter of the sparse-MoE block takes it (a dense layer's tensor? the "
                                 "checkpoint's weights and its config.json's MoE layout disagree)")
            getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, weight)
            loaded.add(name)
        return loaded

    def _expert_tensors(self, name, weight):
        """(parameter, expert id, shard id, tensor) for a routed-expert tensor of this EP rank's experts (their
        ids local to it; another rank's: none): the checkpoint's per-expert names ("experts.0.<gate>.weight"), or
        transformers' fused 3-D ones ("experts.gate_up_proj", "experts.down_proj") as a checkpoint saved without
        its conversion holds them."""
        first, count = self.layout.first_expert, self.layout.local_experts
        for param_name, ckpt_name, expert_id, shard_id in self.expert_params_mapping:
            if name.startswith(ckpt_name):
                if not first <= expert_id < first + count:
                    return []
                # FusedMoEGMM's loader narrows whatever it is given: a weight of another width is refused here
                # (a W8A8 weight_scale is [out, 1])
                if name.endswith(".weight") and weight.shape[1 if shard_id == "w2" else 0] != self.expert_width:
                    raise ValueError(f"{name} {tuple(weight.shape)}: an expert of width {self.expert_width} "
                                     f"({WIDTH_KEY}) was expected; the checkpoint and its config disagree")
                return [(name.replace(ckpt_name, param_name), expert_id - first, shard_id, weight)]
        if name == "experts.gate_up_proj":
            if FUSED_LAYOUT == "E,H,2I":
                weight = weight.transpose(1, 2)
            gate, up = weight.chunk(2, dim=1)
            return [("experts.w13_weight", e, shard, w[first + e]) for e in range(count)
                    for shard, w in (("w1", gate), ("w3", up))]
        if name == "experts.down_proj":
            if FUSED_LAYOUT == "E,H,2I":
                weight = weight.transpose(1, 2)
            return [("experts.w2_weight", e, "w2", weight[first + e]) for e in range(count)]
        raise KeyError(f"{name}: no routed-expert parameter takes it")

    def process_weights_after_loading(self):
        """Linear weights transposed to [in, out], routed experts stacked as [E, in, out] for
        npu_grouped_matmul (NZ where the recipe enables it, never for fp32 weights), once."""
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            weight = getattr(module, "weight", getattr(module, "w13_weight", None))
            nz = self.enable_weight_nz and weight is not None and weight.dtype != torch.float32
            method.process_weights_after_loading(module, is_nz=nz)
