"""falcon_h1's parallel hybrid layer (agent/recipe/native/parts/block_parallel_hybrid.py): a Mamba2 mixer and the
attention side by side on one norm's output, each branch times its config multiplier, then the MLP behind its own
norm; with it the Mamba2 mixer's ssm multipliers and switchable gated norm (parts/linear_attention_mamba2.py), the
keys' multiplier as the softmax scale (parts/attention_key_scale.py), the MLP's (gate, down) multipliers
(parts/mlp.py) and lm_head_multiplier (parts/scalar_multipliers.py).

The default case reads the block's probe on transformers' own FalconH1DecoderLayer: it holds the layer with the
config's multipliers, and refuses the formula with a multiplier dropped or the mixer's branch dropped. The slow case
derives and renders a small falcon_h1 and holds the file to transformers per step (float32, bfloat16, the gated norm
off) while each planted fault fails."""

from __future__ import annotations

import pytest

from part_selfcheck import SNAPSHOT, ctx, write_with_faults

# a small falcon_h1 whose multipliers are all off 1 (at 1 a dropped multiplier cannot be seen)
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128,
         "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_rms_norm": True, "mamba_norm_before_gate": False,
         "vocab_size": 256, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "key_multiplier": 0.7,
         "attention_in_multiplier": 1.5, "attention_out_multiplier": 0.6, "ssm_in_multiplier": 0.8,
         "ssm_out_multiplier": 0.4, "ssm_multipliers": [0.9, 1.2, 0.7, 1.4, 0.6], "mlp_multipliers": [1.3, 0.5]}
MULTIPLIERS = {"attention_in_multiplier": 1.5, "attention_out_multiplier": 0.6, "ssm_out_multiplier": 0.4}

# each planted fault in the rendered file: (text, replacement); the self-check must catch each
FAULTS = {
    "mixer_branch": ("self.post_attention_layernorm(mixed + attended, residual)",
                     "self.post_attention_layernorm(attended, residual)"),
    "mixer_out": ("self.linear_attn(hidden_states, forward_metadata) * self.mixer_out",
                  "self.linear_attn(hidden_states, forward_metadata)"),
    "attention_in": ("self.self_attn(hidden_states * self.attention_in, cos_sin",
                     "self.self_attn(hidden_states, cos_sin"),
    "key": ("self.scaling = self.scaling * config.key_multiplier", "self.scaling = self.scaling"),
    "ssm_parts": ("mixed = mixed * self.mixed_multipliers.to(mixed.dtype)", "mixed = mixed"),
    "mlp_down": ("out = out * self.down_multiplier", "out = out"),
}


def _layer():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent.recipe.native.parts.layout import read_layout

    torch.manual_seed(0)
    config = AutoConfig.for_model("falcon_h1", **SMALL)
    model = AutoModelForCausalLM.from_config(config).eval()
    read_layout(model, SMALL["hidden_size"])        # the layer's children under the skeleton's names
    return model.model.layers[0]


def test_the_block_probe_holds_falcon_h1s_layer_and_refuses_a_dropped_multiplier_or_branch():
    """hybrid_residual holds transformers' FalconH1DecoderLayer to h + s_out mix(n(h)) + a_out attn(a_in n(h)), then
    h + mlp(n2(h)), with the config's multipliers; the same formula with a multiplier at 1 (dropped), the attention's
    input and output multipliers swapped, or the mixer's branch dropped (its multiplier 0) does not hold."""
    from agent.recipe.native.parts.block_parallel_hybrid import hybrid_residual, is_parallel_hybrid

    layer = _layer()
    assert is_parallel_hybrid(layer)
    assert hybrid_residual(layer, SMALL["hidden_size"], MULTIPLIERS)
    for key in MULTIPLIERS:
        assert not hybrid_residual(layer, SMALL["hidden_size"], {**MULTIPLIERS, key: 1.0}), key
    swapped = {**MULTIPLIERS, "attention_in_multiplier": 0.6, "attention_out_multiplier": 1.5}
    assert not hybrid_residual(layer, SMALL["hidden_size"], swapped)
    assert not hybrid_residual(layer, SMALL["hidden_size"], {**MULTIPLIERS, "ssm_out_multiplier": 0.0})


@pytest.mark.slow
def test_falcon_h1s_file_matches_transformers_and_each_dropped_multiplier_fails(tmp_path):
    """The small falcon_h1 derived (the parallel hybrid block, the Mamba2 mixer with its multipliers and gated norm
    switch, the keys' multiplier, the MLP's multipliers, lm_head_multiplier) and rendered: float32, bfloat16 and the
    gated norm off within the self-check's tolerance; the mixer's branch dropped, its output multiplier dropped, the
    attention's input multiplier dropped, the keys' multiplier dropped, the ssm multipliers of x / B / C dropped and
    the MLP's down multiplier dropped each fail.
    Default case covering the block's path: test_the_block_probe_holds_falcon_h1s_layer_and_refuses_a_dropped_multiplier_or_branch."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config = AutoConfig.for_model("falcon_h1", **SMALL).to_dict()
    composition = derive(config)
    assert composition.parts["block"] == "parallel_hybrid" and composition.parts["linear_attention"] == "mamba2"
    options = composition.options
    assert options["LAYER_CACHES"] and options["MAMBA_MULTIPLIERS"] and options["MAMBA_NORM_KEY"] == "mamba_rms_norm"
    assert options["KEY_SCALE"] == "key_multiplier" and options["MLP_MULTIPLIERS"] == "mlp_multipliers"
    assert options["LOGITS_SCALING"] == "lm_head_multiplier" and not options.get("LINEAR_ATTENTION")
    text = render_native(ctx("falcon_h1", "NativeForCausalLM"), composition)
    good, bad = write_with_faults(text, FAULTS, list(FAULTS), tmp_path)

    def job(cfg, path, dtype="float32"):
        return {"config": cfg, "file": str(path), "class_name": "NativeForCausalLM", "dtype": dtype}

    no_norm = {**config, "mamba_rms_norm": False}
    results = selfcheck([job(config, good), job(config, good, "bfloat16"), job(no_norm, good)]
                        + [job(config, path) for path in bad], SNAPSHOT)
    assert all(r["ok"] for r in results[:3]), results[:3]
    assert results[0]["max_rel"] < 1e-4, results[0]
    failed = results[3:]
    assert not any(r["ok"] for r in failed), list(zip(FAULTS, failed))
