"""MoE blocks that computed more than the sparse-MoE part wrote: axk1's block RMS-norms its output (post_mlp_layernorm
after the routed and shared experts' sum; agent/recipe/native/parts/moe_output_norm.py, code
parts/code/moe_output_norm.py); minimax_m3's experts, shared experts and dense MLPs run gpt_oss's clamped swiglu over
gate / up halves (parts/moe.py's CLAMPED_SWIGLU, parts/mlp_clamped.py; code parts/code/swiglu_clamped.py,
mlp_clamped.py) and its block scales the routed experts' output after them. Each type's file, derived on its config
(its checkpoint's shape where one is recorded, else transformers' defaults), is held to transformers per step; a file
with the part's arithmetic broken fails the same check. By default the smallest case: axk1 in float32 on two layers
(a dense and a sparse one) and one fault (its output norm dropped); minimax_m3, every dtype, family setting and
the other faults are slow."""

from __future__ import annotations

import pytest

from part_selfcheck import selfcheck_with_faults

# type: (moe part, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "axk1": ("sparse_moe_output_norm", [("return self.post_mlp_layernorm(out)", "return out")]),
    "minimax_m3_vl_text": ("sparse_moe", [("up = up.clamp(min=-limit, max=limit)", "up = up"),
                                          ("weights = weights * self.routed_scaling_factor", "weights = weights")]),
}
DEFAULT_FAULT = ("axk1", 0)
# the default case's smallest config of each type: two layers, a few experts (the routing's kind kept: grouped top-k)
SMALLEST = {"axk1": {"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"], "n_routed_experts": 8,
                     "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2},
            "minimax_m3_vl_text": {"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"],
                                   "layer_types": ["full_attention"] * 2, "num_local_experts": 8,
                                   "num_experts_per_tok": 2}}


def _config(model_type: str) -> dict:
    from transformers import AutoConfig

    from agent.testing.checkpoint_shapes import checkpoint_config

    shaped = checkpoint_config(model_type)
    return shaped[0] if shaped is not None else AutoConfig.for_model(model_type).to_dict()


def _derived(smallest: bool) -> dict:
    from agent.recipe.native.compose import derive

    found = {}
    for model_type in TYPES:
        config = {**_config(model_type), **(SMALLEST.get(model_type, {}) if smallest else {})}
        found[model_type] = (config, derive(config))
    return found


@pytest.fixture(scope="module")
def smallest():
    return _derived(True)


def test_the_moe_parts_are_read_from_the_architecture(smallest):
    for model_type, (part, _) in TYPES.items():
        assert smallest[model_type][1].parts["moe"] == part, (model_type, smallest[model_type][1].parts)
    assert smallest["axk1"][1].options["OUTPUT_NORM"] == "post_mlp_layernorm"
    minimax = smallest["minimax_m3_vl_text"][1]
    assert minimax.parts["mlp"] == "clamped_gated_mlp" and minimax.options["MLP_WIDTH_KEY"] == "dense_intermediate_size"
    assert minimax.options["CLAMPED_SWIGLU"] is True and minimax.options["ROUTED_SCALING"] is True


def test_a_norm_of_the_routed_experts_alone_is_refused():
    """A block whose norm takes the routed experts' output before the shared experts join it is not the block the
    part writes (it norms the sum): refused naming the norm, as is a block with no norm (none found)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.axk1 import modeling_axk1

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts import moe
    from agent.recipe.native.parts.moe_output_norm import output_norm

    config = moe._probe_config(AutoConfig.for_model("axk1"))
    torch.manual_seed(0)
    block = modeling_axk1.AXK1MoE(config).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    known = {"gate", "experts", "shared_experts", "shared_experts_gate"}
    assert output_norm(block, moe.PROBE_HIDDEN, config, known) == "post_mlp_layernorm"

    def routed_normed(hidden_states):
        shape = hidden_states.shape
        _, weights, indices = block.gate(hidden_states)
        routed = block.experts(hidden_states.view(-1, shape[-1]), indices, weights).view(*shape)
        return block.post_mlp_layernorm(routed) + block.shared_experts(hidden_states)

    block.forward = routed_normed
    with pytest.raises(NotNative, match="does not norm the block's whole output"):
        output_norm(block, moe.PROBE_HIDDEN, config, known)
    assert output_norm(block, moe.PROBE_HIDDEN, config, known | {"post_mlp_layernorm"}) == ""


def test_minimax_m3s_clamped_swiglu_and_scale_are_read_not_assumed():
    """The block's routed-experts scale is read off its output (the routed_scaling_factor after the experts, not on
    the weights; a block that drops it is not scaled); shared experts of another formula beside clamped experts are
    refused, as is a dense MLP whose clamp is not the config's."""
    import torch
    from transformers import AutoConfig
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts import moe

    config = moe._probe_config(AutoConfig.for_model("minimax_m3_vl_text", num_local_experts=8, num_experts_per_tok=2))
    torch.manual_seed(0)
    block = modeling.MiniMaxM3VLSparseMoeBlock(config).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape))
    assert moe._scaled_after_experts(block, config, "shared_experts")
    block.routed_scaling_factor = 1.0
    assert not moe._scaled_after_experts(block, config, "shared_experts")
    moe._check_clamped_shared(block, "shared_experts", config, moe.PROBE_HIDDEN)
    shared = block.shared_experts
    shared.forward = lambda x: shared.down_proj(torch.nn.functional.silu(shared.gate_up_proj(x).chunk(2, -1)[0])
                                                * shared.gate_up_proj(x).chunk(2, -1)[1])
    with pytest.raises(NotNative, match="compute no down"):
        moe._check_clamped_shared(block, "shared_experts", config, moe.PROBE_HIDDEN)
    shared.swiglu_limit = 3.0
    with pytest.raises(NotNative, match="swiglu_limit"):
        moe._check_clamped_shared(block, "shared_experts", config, moe.PROBE_HIDDEN)


def test_the_files_match_transformers_and_a_fault_fails(smallest, tmp_path):
    """The smallest case by default: axk1's file (the output-normed block) in float32 on its smallest config, and its
    norm dropped; minimax_m3's file and every other fault are slow."""
    model_type, index = DEFAULT_FAULT
    rows = selfcheck_with_faults({model_type: smallest[model_type]}, {model_type: [TYPES[model_type][1][index]]},
                                 "MoeForCausalLM", tmp_path, keep=lambda label: label == "the checkpoint's config")
    assert [ok for *_, ok, _ in rows] == [True, False]
    assert "differ from transformers" in rows[-1][3]["reason"]


@pytest.mark.slow
def test_every_dtype_and_family_setting_and_fault(tmp_path):
    """bfloat16 and the family settings (the MoE layout flipped, norm_topk_prob, no shared experts, grouped routing)
    for each type, and each fault. minimax_m3's bfloat16 job passes by a routing tie (one token's experts within
    bfloat16's rounding: test_selfcheck_routing_ties.py). Default-suite coverage of the same path:
    test_the_files_match_transformers_and_a_fault_fails."""
    derived = _derived(False)
    for model_type in TYPES:
        selfcheck_with_faults({model_type: derived[model_type]}, {model_type: TYPES[model_type][1]}, "MoeForCausalLM",
                              tmp_path, keep=lambda label: not label.startswith("rope"))
