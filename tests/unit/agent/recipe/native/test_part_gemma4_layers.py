"""gemma4's layers: head width per layer, the value norm and the layer scalar
(agent/recipe/native/parts/attention_head_dim.py, value_norm in parts/attention.py, layer_scalar in
parts/block.py; the fused attention's HEAD_DIM_PER_LAYER and V_NORM in parts/code/attention_fused.py, the rotary
tables per layer type at each type's width in parts/code/causal_lm.py, LAYER_SCALAR in parts/code/block.py).
gemma4's heterogeneous config sets head_dim per layer (its full-attention layers at global_head_dim 512 beside the
sliding layers' 256); the probe reads each layer's, checks each layer's q/k projections and q/k norms at its own
width, and the softmax scale's rule per layer; its v_norm is read numerically as a weightless RMSNorm per head; its
layer_scalar (a checkpoint buffer, 1 in a random model) is read set to 2 as multiplying the layer's whole output.

Default: the facts on gemma4's defaults with the per-layer input embeddings off (the model slot's blocker before
these), a v_norm that is not weightless refused, a layer scalar that does not scale the output refused. Slow: that
config's file held to transformers in float32, bfloat16 and every family setting, and its faults (every layer
built at the first layer's head_dim, the value norm dropped, every rotary table at the sliding layers' width) must
fail. The layer scalar has no fault here: it is 1 in transformers' random model, so the self-check cannot see it
dropped (its reading is test_the_layer_scalar_multiplies_the_whole_output)."""

from __future__ import annotations

import pytest

# gemma4's defaults without the per-layer input embeddings (hidden_size_per_layer_input: no part writes them yet)
NO_PLE = {"hidden_size_per_layer_input": 0}
FAULTS = [("self.head_dim = config.per_layer_config[layer_idx].head_dim",
           "self.head_dim = config.per_layer_config[0].head_dim"),
          ("value = (value * torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + self.v_norm_eps)).to(key.dtype)",
           "value = value.to(key.dtype)"),
          ("NativeRotaryEmbedding(config, config.per_layer_config[kind].head_dim,",
           "NativeRotaryEmbedding(config, config.per_layer_config[0].head_dim,")]


@pytest.fixture(scope="module")
def gemma4_probe():
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    try:
        config = AutoConfig.for_model("gemma4_text", **NO_PLE).to_dict()
    except (ValueError, KeyError):
        pytest.skip("this transformers has no gemma4_text")
    return Probe(config)


def test_each_layer_is_read_at_its_own_head_width(gemma4_probe):
    from agent.recipe.native.parts.attention import dense_attention

    probe = gemma4_probe
    kinds = probe.config.layer_types
    assert probe.layer_head_dims == [512 if kind == "full_attention" else 256 for kind in kinds]
    assert {256, 512} == set(probe.layer_head_dims)
    facts = dense_attention(probe)
    # the q/k norms per head at each layer's width; scaling 1.0 (the q/k norms stand in for the softmax scale)
    assert facts["HEAD_DIM_PER_LAYER"] is True and facts["V_NORM"] is True
    assert facts["QK_NORM"] is True and facts["UNSCALED"] is True and facts["LAYER_TYPE_WINDOWS"] is True


def test_key_heads_per_layer_still_fall_back_named_by_the_checkpoints_values():
    """gemma4-26B's full layers have 2 key/value heads beside the sliding layers' 8 (attention_k_eq_v with
    num_global_key_value_heads): both shrink to 2 in the probe, so the refusal is read on the checkpoint's own
    config, naming what no part writes (not head_dim, which is written)."""
    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative
    from agent.testing.checkpoint_shapes import checkpoint_config

    config, _ = checkpoint_config("gemma4_text")
    with pytest.raises(NotNative) as caught:
        derive(config)
    assert caught.value.kind == "attention"
    assert "sets num_key_value_heads 8/2 per layer" in caught.value.reason
    assert "head_dim" not in caught.value.reason


def test_a_value_norm_with_a_weight_or_another_formula_is_refused():
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention import value_norm

    config = type("Config", (), {"rms_norm_eps": 1e-6})()
    assert value_norm(None, 8, config) is False

    class Weightless(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    class MeanCentred(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:])

    assert value_norm(Weightless(), 8, config) is True
    with pytest.raises(NotNative, match="not an RMSNorm without a weight"):
        value_norm(MeanCentred(), 8, config)
    with pytest.raises(NotNative, match="has a weight"):
        value_norm(torch.nn.RMSNorm(8), 8, config)


def test_the_layer_scalar_multiplies_the_whole_output(gemma4_probe, monkeypatch):
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.block import block_roles, layer_scalar

    probe = gemma4_probe
    roles = block_roles(probe)
    assert layer_scalar(probe, roles) == {"LAYER_SCALAR": True}
    layer = probe.layers[0]
    forward = layer.forward
    # a layer whose scalar leaves its output as it was: refused, not written as scaled
    monkeypatch.setattr(layer, "forward", lambda *args, **kwargs: forward(*args, **kwargs) / layer.layer_scalar)
    with pytest.raises(NotNative, match="does not multiply its output"):
        layer_scalar(probe, roles)
    assert float(layer.layer_scalar) == 1.0         # the probe's model left as it was


@pytest.mark.slow
def test_the_file_matches_transformers_and_the_faults_fail(tmp_path):
    """Slow: the stand-in self-check of every setting and three faults is over the default suite's budget.
    Default-suite coverage of the same path: the readings that write it (the tests above); the per-step self-check
    of gemma4's files is scripts/native_coverage.py."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from part_selfcheck import selfcheck_with_faults

    config = AutoConfig.for_model("gemma4_text", **NO_PLE).to_dict()
    composition = derive(config)
    assert composition.options["HEAD_DIM_PER_LAYER"] and composition.options["V_NORM"]
    assert composition.options["LAYER_SCALAR"]
    selfcheck_with_faults({"gemma4_text": (config, composition)}, {"gemma4_text": FAULTS}, "NativeForCausalLM",
                          tmp_path, keep=lambda label: True)
