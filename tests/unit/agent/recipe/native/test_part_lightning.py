"""minimax's lightning attention (agent/recipe/native/parts/linear_attention_lightning.py, its code
parts/code/linear_attention_lightning.py) against transformers' MiniMaxLightningAttention as the executor drives it
(tests/support/lightning_layer_check.py): a packed prefill of prompts of unequal length, one across two of the file's
prefill blocks, then decode steps, each request's recurrent state in its block of the Mamba cache beside a NaN block
no request owns. A decode that forgets the state, a decay not scaled by the layer's depth, an output gate without its
sigmoid, or a prefill that carries the state to the next block undecayed fail. The part's probe reads the layers from
the module (held as self_attn, read as linear_attn) and refuses one whose arithmetic is not the file's."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def run(jobs):
    import gdn_layer_check
    import lightning_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT, lightning_layer_check.__file__)


def test_the_layer_matches_transformers_across_prefill_and_decode_and_faults_fail():
    """float32 and bfloat16 across prefill and decode; a decode from a zero state fails at its first step, a decay
    not scaled by the layer's depth at the prefill (the slow case holds the other faults)."""
    good_fp32, good_bf16, lost, depth = run([{}, {"dtype": "bfloat16"}, {"fault": "state"}, {"fault": "depth"}])
    assert good_fp32["ok"] and good_fp32["max_rel"] < 1e-4, good_fp32
    assert good_bf16["ok"], good_bf16
    assert not lost["ok"] and lost["step"] == "decode step 1", lost
    assert not depth["ok"] and depth["step"] == "prefill", depth


@pytest.mark.slow
def test_every_fault_and_the_first_and_last_layers():
    """Covered by default: test_the_layer_matches_transformers_across_prefill_and_decode_and_faults_fail. The first
    layer (depth scale 1) and the last (about 0: no decay) match; the gate without its sigmoid and the block state
    carried undecayed fail at the prefill, the lost state in bfloat16 at decode."""
    jobs = [{"layer": 0}, {"layer": 2}, {"layer": 2, "dtype": "bfloat16"}, {"fault": "gate"}, {"fault": "block"},
            {"dtype": "bfloat16", "fault": "state"}]
    first, last, last_bf16, gate, block, lost = run(jobs)
    assert first["ok"] and last["ok"] and last_bf16["ok"], (first, last, last_bf16)
    assert [(r["ok"], r["step"]) for r in (gate, block, lost)] == \
        [(False, "prefill"), (False, "prefill"), (False, "decode step 1")], (gate, block, lost)


def _minimax():
    """transformers' default minimax config (agent.testing.checkpoint_shapes records no minimax checkpoint)."""
    from transformers import AutoConfig

    return AutoConfig.for_model("minimax").to_dict()


@pytest.mark.slow
def test_minimax_reads_its_lightning_layers_as_linear_attention_and_a_changed_decay_is_refused():
    """Covered by default (the layer's arithmetic the probe holds): test_the_layer_matches_transformers_across_prefill_
    and_decode_and_faults_fail. The lightning layers (self_attn in transformers' layers) are the linear_attention
    slot's, renamed to linear_attn at load by their own children's names; the norm's epsilon is the architecture's fixed 1e-6. A module whose decay
    is not scaled by the layer's depth is refused in one line naming the layer."""
    import re

    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.linear_attention_lightning import LIGHTNING
    from agent.recipe.native.parts.probe import Probe

    probe = Probe(_minimax())
    match = LIGHTNING.probe(probe, {})
    assert match.options == {"LINEAR_ATTENTION": True, "LINEAR_LAYER_TYPE": "linear_attention",
                             "LIGHTNING_NORM_EPS": 1e-6}
    linear = [i for i, t in enumerate(probe.config.layer_types) if t == "linear_attention"]
    assert linear and all(("linear_attn" in layer._modules) == (i in linear) for i, layer in enumerate(probe.layers))
    (pattern, target), = probe.layout.renames
    assert re.sub(pattern, target, "model.layers.3.self_attn.qkv_proj.weight") == "model.layers.3.linear_attn.qkv_proj.weight"
    assert re.sub(pattern, target, "model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    later = next(i for i in linear if i > 0)
    module = probe.layers[later].linear_attn
    with torch.no_grad():
        module.slope_rate.copy_(module.slope_rate / (1 - later / (probe.config.num_hidden_layers - 1 + 1e-5) + 1e-5))
    # the module's prefill reads its block decays, recomputed from the unscaled slope
    for name, value in zip(("query_decay", "key_decay", "diagonal_decay"), module.decay_factors(module.slope_rate)):
        getattr(module, name).copy_(value)
    with pytest.raises(NotNative) as refused:
        LIGHTNING.probe(probe, {})
    assert refused.value.reason.startswith(f"layer {later}: MiniMaxLightningAttention is not the decayed linear "
                                           "attention"), refused.value.reason
    assert "\n" not in refused.value.reason


# the file's text, a fault written into it (each run on the config itself): the decay not scaled by the layer's
# depth; the attention's branch joining no residual
MINIMAX_FAULTS = {"minimax": [
    ("factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5", "factor = 1.0"),
    ("hidden_states = self.post_attention_layernorm(hidden_states * self.attn_alpha + out * self.attn_beta)",
     "hidden_states = self.post_attention_layernorm(out * self.attn_beta)"),
]}


@pytest.mark.slow
def test_minimax_file_matches_transformers_and_its_faults_fail(tmp_path):
    """Covered by default (the lightning layer's path): test_the_layer_matches_transformers_across_prefill_and_decode_
    and_faults_fail. minimax's file on transformers' default config (no checkpoint shape recorded), rendered and held to
    transformers in float32, bfloat16 and its family settings (the window on: its full-attention layers windowed);
    each fault fails."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from part_selfcheck import selfcheck_with_faults

    config = AutoConfig.for_model("minimax").to_dict()
    composition = derive(config)
    assert (composition.parts["linear_attention"], composition.parts["block"]) == ("lightning", "normed_residual")
    assert composition.options["FULL_LAYERS_WINDOWED"] is True
    selfcheck_with_faults({"minimax": (config, composition)}, MINIMAX_FAULTS, "MiniMaxForCausalLM", tmp_path)


@pytest.mark.slow
def test_a_layer_weighting_its_mlp_by_another_key_is_refused(monkeypatch):
    """No default case covers this refusal (parts/block_normed_residual.py; minimax's derive takes about 20 s, its
    file's check is test_minimax_file_matches_transformers_and_its_faults_fail). The normed-residual layer's factors are held on a config with every factor apart: an MLP weighted by mlp_beta_factor where
    the file reads mlp_alpha_factor is refused in one line (the checkpoint's own factors, all 1, cannot tell)."""
    from transformers.models.minimax import modeling_minimax

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.block_normed_residual import NORMED_RESIDUAL
    from agent.recipe.native.parts.probe import Probe

    built = modeling_minimax.MiniMaxDecoderLayer.__init__

    def swapped(self, config, layer_idx):
        built(self, config, layer_idx)
        self.mlp_alpha_factor = config.mlp_beta_factor

    monkeypatch.setattr(modeling_minimax.MiniMaxDecoderLayer, "__init__", swapped)
    with pytest.raises(NotNative) as refused:
        NORMED_RESIDUAL.probe(Probe(_minimax()), {})
    assert refused.value.kind == "decoder layer" and "is not norm(x) alpha + branch(norm(x)) beta" in \
        refused.value.reason and "\n" not in refused.value.reason, refused.value.reason
