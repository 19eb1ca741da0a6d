"""Checkpoint-shaped configs: a model type's config as one of its published checkpoints shapes it — the keys of
that checkpoint's config.json that choose code paths (layer kinds and sliding windows, rope type and scaling,
partial rotary, the MoE layout and routing, biases, q/k norms, multipliers, tied embeddings, head counts and
widths the kernels constrain), on top of transformers' defaults for the rest. Widths and layer counts need not
be small: the native generator's probe and self-check shrink them (agent.recipe.native.parts.probe).

transformers' default config of a type is often no checkpoint anyone publishes (qwen2's window switches, gemma3's
rope per layer type, deepseek_v2's routing, dots1's dense-first layers): scripts/native_coverage.py measures on
these shapes. Keys are written as the checkpoint's config.json has them (legacy `rope_scaling` / `rope_theta`
included): transformers reads them as it reads that file.
"""

from __future__ import annotations

# model_type -> (the checkpoint whose config.json the keys come from, its structural keys)
SHAPES: dict[str, tuple[str, dict]] = {
    "llama": ("meta-llama/Llama-3.1-8B-Instruct", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}),
    "mistral": ("mistralai/Mistral-7B-Instruct-v0.3", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None}),
    "ministral": ("mistralai/Ministral-8B-Instruct-2410", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "max_position_embeddings": 32768, "rope_theta": 100000000.0, "sliding_window": 32768}),
    "qwen2": ("Qwen/Qwen2.5-7B-Instruct", {
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584, "num_hidden_layers": 28,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28}),
    "qwen3": ("Qwen/Qwen3-8B", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "num_hidden_layers": 36, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
        "attention_bias": False}),
    "qwen2_moe": ("Qwen/Qwen1.5-MoE-A2.7B", {
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": [], "use_sliding_window": False,
        "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen/Qwen3-30B-A3B", {
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 2048, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "mlp_only_layers": [], "rope_theta": 1000000.0, "use_sliding_window": False,
        "tie_word_embeddings": False}),
    "bamba": ("ibm-ai-platform/Bamba-9B", {
        "num_hidden_layers": 32, "attn_layer_indices": [9, 18, 27]}),
    "nemotron_h": ("nvidia/Nemotron-H-8B-Base-8K", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64,
        "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False, "use_bias": False, "use_conv_bias": True, "mamba_proj_bias": False,
        "time_step_min": 0.001, "time_step_limit": [0.0, float("inf")], "tie_word_embeddings": False}),
    "qwen3_next": ("Qwen/Qwen3-Next-80B-A3B-Instruct", {
        "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_size": 2048, "head_dim": 256,
        "num_hidden_layers": 48, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "mlp_only_layers": [], "partial_rotary_factor": 0.25, "rope_theta": 10000000,
        "max_position_embeddings": 262144, "attention_bias": False, "tie_word_embeddings": False}),
    "mixtral": ("mistralai/Mixtral-8x7B-Instruct-v0.1", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False}),
    "gemma": ("google/gemma-7b", {
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 3072, "head_dim": 256,
        "hidden_act": "gelu", "hidden_activation": None, "tie_word_embeddings": True}),
    "gemma2": ("google/gemma-2-9b-it", {
        "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 3584, "head_dim": 256,
        "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3_text": ("google/gemma-3-4b-it (text_config)", {
        "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 2560, "head_dim": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    # the keys upstream's models/gemma_4 (agentic/progress.md, its configuration_gemma4.py) records for the checkpoint
    # it serves; no per-layer input embeddings (hidden_size_per_layer_input 0): upstream's port has none
    "gemma4_text": ("google/gemma-4-26B-A4B-it (text_config)", {
        "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2,
        "attention_k_eq_v": True, "sliding_window": 1024, "final_logit_softcapping": 30.0,
        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
        "hidden_size_per_layer_input": 0, "max_position_embeddings": 262144, "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1000000.0}}}),
    "phi3": ("microsoft/Phi-3.5-mini-instruct", {
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 3072, "sliding_window": 262144,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48}}),
    "deepseek_v2": ("deepseek-ai/DeepSeek-V2-Lite-Chat", {
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}}),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", {
        "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}),
    "dots1": ("rednote-hilab/dots.llm1.inst", {
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096, "head_dim": 128,
        "n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "rope_theta": 10000000.0, "sliding_window": None, "tie_word_embeddings": False}),
    "glm4_moe": ("zai-org/GLM-4.5-Air", {
        "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False, "n_routed_experts": 128,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "glm": ("THUDM/glm-4-9b-chat-hf", {
        "num_attention_heads": 32, "num_key_value_heads": 2, "hidden_size": 4096, "head_dim": 128,
        "partial_rotary_factor": 0.5, "attention_bias": True, "tie_word_embeddings": False}),
    "glm4": ("THUDM/GLM-4-9B-0414", {
        "num_attention_heads": 32, "num_key_value_heads": 2, "hidden_size": 4096, "head_dim": 128,
        "partial_rotary_factor": 0.5, "attention_bias": True, "tie_word_embeddings": False}),
    "gpt_oss": ("openai/gpt-oss-20b", {
        "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 2880, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "num_hidden_layers": 24,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096}, "rope_theta": 150000}),
    "olmo2": ("allenai/OLMo-2-1124-7B", {
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096, "rope_theta": 500000,
        "tie_word_embeddings": False}),
    "olmo": ("allenai/OLMo-1B-hf", {
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048, "clip_qkv": None,
        "tie_word_embeddings": True}),
    "olmoe": ("allenai/OLMoE-1B-7B-0924", {
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None, "tie_word_embeddings": False}),
    "starcoder2": ("bigcode/starcoder2-7b", {
        "num_attention_heads": 36, "num_key_value_heads": 4, "hidden_size": 4608, "sliding_window": 4096,
        "use_bias": True, "norm_epsilon": 1e-5, "rope_theta": 1000000, "hidden_act": "gelu_pytorch_tanh"}),
    "stablelm": ("stabilityai/stablelm-2-1_6b", {
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 2048, "partial_rotary_factor": 0.25,
        "use_qkv_bias": True, "qk_layernorm": False, "use_parallel_residual": False, "tie_word_embeddings": False}),
    "phi": ("microsoft/phi-2", {
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 2560, "partial_rotary_factor": 0.4,
        "hidden_act": "gelu_new", "qk_layernorm": False, "tie_word_embeddings": False}),
    "cohere": ("CohereForAI/c4ai-command-r-v01", {
        "num_attention_heads": 64, "num_key_value_heads": 64, "hidden_size": 8192, "use_qk_norm": False,
        "logit_scale": 0.0625, "rope_theta": 8000000.0, "tie_word_embeddings": True}),
    "cohere2": ("CohereForAI/c4ai-command-r7b-12-2024", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096,
        "sliding_window_pattern": 4, "logit_scale": 0.25, "rope_theta": 50000.0, "tie_word_embeddings": True}),
    "granite": ("ibm-granite/granite-3.1-8b-instruct", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "attention_multiplier": 0.0078125,
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 16.0, "rope_theta": 10000000.0,
        "tie_word_embeddings": True}),
    "granitemoe": ("ibm-granite/granite-3.1-3b-a800m-instruct", {
        "num_attention_heads": 24, "num_key_value_heads": 8, "hidden_size": 1536, "num_local_experts": 40,
        "num_experts_per_tok": 8, "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 6.0, "tie_word_embeddings": True}),
    "granitemoehybrid": ("ibm-granite/granite-4.0-h-tiny", {
        "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 1536, "num_hidden_layers": 40,
        "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"]
                        + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4),
        "intermediate_size": 512, "shared_intermediate_size": 1024, "num_local_experts": 64,
        "num_experts_per_tok": 6, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 256, "position_embedding_type": "nope",
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "max_position_embeddings": 131072,
        "tie_word_embeddings": True}),
    # the values of the 7B row of transformers' FalconH1Config docs (44 layers, 3072 wide, 12 / 2 heads, 24 Mamba heads
    # of 128, state 256) and the multipliers its config.json carries (as a GPTQ port's test of it records them)
    "falcon_h1": ("tiiuae/Falcon-H1-7B-Instruct", {
        "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 44, "num_attention_heads": 12,
        "num_key_value_heads": 2, "head_dim": 128, "mamba_d_conv": 4, "mamba_n_heads": 24, "mamba_d_head": 128,
        "mamba_d_state": 256, "mamba_d_ssm": 3072, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_chunk_size": 256,
        "mamba_norm_before_gate": False, "mamba_rms_norm": True, "mamba_proj_bias": False, "mamba_conv_bias": True,
        "rms_norm_eps": 1e-5, "rope_theta": 1e11, "attention_bias": False,
        "mlp_bias": False, "projectors_bias": False, "tie_word_embeddings": False,
        "embedding_multiplier": 5.656854249492381, "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.10416666666666667, "key_multiplier": 0.030690398488999456,
        "ssm_in_multiplier": 0.4166666666666667, "ssm_out_multiplier": 0.11785113019775793,
        "lm_head_multiplier": 0.013020833333333334,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.1767766952966369, 0.5, 0.3535533905932738],
        "mlp_multipliers": [0.2946278254943948, 0.032552083333333336]}),
    "exaone4": ("LGAI-EXAONE/EXAONE-4.0-32B", {
        "num_attention_heads": 40, "num_key_value_heads": 8, "hidden_size": 5120, "head_dim": 128,
        "sliding_window": 4096, "sliding_window_pattern": 4, "num_hidden_layers": 64, "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, "max_position_embeddings": 131072,
        "tie_word_embeddings": False}),
    "smollm3": ("HuggingFaceTB/SmolLM3-3B", {
        "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_size": 2048, "num_hidden_layers": 36,
        "no_rope_layer_interval": 4, "use_sliding_window": False, "rope_theta": 5000000.0,
        "tie_word_embeddings": True}),
    "helium": ("kyutai/helium-1-preview-2b", {
        "num_attention_heads": 20, "num_key_value_heads": 20, "hidden_size": 2560, "head_dim": 128,
        "tie_word_embeddings": False}),
    "internlm3": ("internlm/internlm3-8b-instruct", {
        "num_attention_heads": 32, "num_key_value_heads": 2, "hidden_size": 4096, "head_dim": 128,
        "qkv_bias": False, "bias": False, "rope_theta": 50000000,
        "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}, "tie_word_embeddings": False}),
    "ernie4_5": ("baidu/ERNIE-4.5-0.3B-PT", {
        "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_size": 1024, "head_dim": 128,
        "use_bias": False, "rope_theta": 500000, "tie_word_embeddings": True}),
    "seed_oss": ("ByteDance-Seed/Seed-OSS-36B-Instruct", {
        "num_attention_heads": 80, "num_key_value_heads": 8, "hidden_size": 5120, "head_dim": 128,
        "attention_bias": True, "attention_out_bias": False, "mlp_bias": False, "rope_theta": 10000000.0,
        "tie_word_embeddings": False}),
    "nemotron": ("nvidia/Minitron-8B-Base", {
        "num_attention_heads": 48, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "partial_rotary_factor": 0.5, "hidden_act": "relu2", "tie_word_embeddings": False}),
    "hunyuan_v1_dense": ("tencent/Hunyuan-7B-Instruct", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1000.0}, "tie_word_embeddings": True}),
    # its config.json as mirrored in github.com/tianyu1412/Hunyuan-A13B (models/config.json, written for the
    # remote-code class): head_dim is its attention_head_dim; the per-layer lists as published
    "hunyuan_v1_moe": ("tencent/Hunyuan-A13B-Instruct", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
        "num_hidden_layers": 32, "intermediate_size": 3072, "num_experts": 64, "moe_topk": [8] * 32,
        "moe_intermediate_size": [3072] * 32, "num_shared_expert": [1] * 32, "use_mixed_mlp_moe": True,
        "use_qk_norm": True, "rope_theta": 10000.0, "max_position_embeddings": 32768, "vocab_size": 128167,
        "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1000.0}, "tie_word_embeddings": True}),
    # short-convolution layers with attention at 2, 5, 8, 10, 12, 14 (its full_attn_idxs); the MLP's width
    # block-adjusted from block_ff_dim
    "lfm2": ("LiquidAI/LFM2-1.2B", {
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2048, "num_hidden_layers": 16,
        "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256, "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-05, "rope_theta": 1000000.0,
        "max_position_embeddings": 128000, "tie_embedding": True, "block_dim": 2048, "conv_dim": 2048,
        "block_use_swiglu": True, "full_attn_idxs": [2, 5, 8, 10, 12, 14]}),
}


def checkpoint_config(model_type: str) -> tuple[dict, str] | None:
    """(config dict as transformers reads the checkpoint's config.json, the checkpoint it is shaped on), or None
    for a type without a recorded shape. Raises what transformers raises for a shape it refuses."""
    from transformers import AutoConfig

    if model_type not in SHAPES:
        return None
    source, keys = SHAPES[model_type]
    return AutoConfig.for_model(model_type, **keys).to_dict(), source
