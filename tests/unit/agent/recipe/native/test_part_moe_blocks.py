"""MoE blocks that computed more than the sparse-MoE part wrote: axk1's block RMS-norms its output (post_mlp_layernorm
after the routed and shared experts' sum; agent/recipe/native/parts/moe_output_norm.py, code
parts/code/moe_output_norm.py). Each type's file, derived on its config (its checkpoint's shape where one is recorded,
else transformers' defaults), is held to transformers per step; a file with the part's arithmetic broken fails the same
check. By default the smallest case: axk1 in float32 and its norm dropped; every dtype and family setting is slow."""

from __future__ import annotations

import pytest

from part_selfcheck import selfcheck_with_faults

# type: (moe part, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "axk1": ("sparse_moe_output_norm", [("return self.post_mlp_layernorm(out)", "return out")]),
}
# the default case's smallest config of each type: two layers, a few experts (the routing's kind kept: grouped top-k)
SMALLEST = {"axk1": {"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"], "n_routed_experts": 8,
                     "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}}


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


def test_the_files_match_transformers_and_a_fault_fails(smallest, tmp_path):
    """The smallest case by default: axk1's file in float32 on its smallest config, and the file without its output
    norm."""
    rows = selfcheck_with_faults({"axk1": smallest["axk1"]}, {"axk1": TYPES["axk1"][1]}, "MoeForCausalLM", tmp_path,
                                 keep=lambda label: label == "the checkpoint's config")
    assert [ok for *_, ok, _ in rows] == [True, False]
    assert "differ from transformers" in rows[-1][3]["reason"]


@pytest.mark.slow
def test_every_dtype_and_family_setting_and_fault(tmp_path):
    """bfloat16 and the family settings (the MoE layout flipped, norm_topk_prob, no shared experts, grouped routing)
    for each type, and each fault. Default-suite coverage of the same path: test_the_files_match_transformers_and_a_fault_fails."""
    selfcheck_with_faults(_derived(False), {t: faults for t, (_, faults) in TYPES.items()}, "MoeForCausalLM", tmp_path)
