"""The plain MLP part (agent/recipe/native/parts/mlp_plain.py, its code parts/code/mlp_plain.py): a non-gated
MLP down(act(up(x))) with or without biases — arcee's (ReLU²), otherwise a llama — is written natively: read from
the architecture, the file held to transformers in float32 and bfloat16 and with its mlp_bias toggled, and a
file whose MLP drops the activation fails the same check."""

from __future__ import annotations

import pytest

from part_selfcheck import selfcheck_with_faults

CTX = {"model_name": "arcee", "framework_class": "ArceeForCausalLM", "display_name": "arcee", "model_class": "X"}
FAULT = ("self.down_proj(self.act_fn(self.up_proj(hidden_states)))", "self.down_proj(self.up_proj(hidden_states))")


@pytest.fixture(scope="module")
def arcee():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("arcee").to_dict()
    return config, derive(config)


def test_a_plain_mlp_is_read_from_the_architecture(arcee):
    from agent.recipe.native.decide import render_native
    from agent.recipe.native.parts.part import Expr

    _, composition = arcee
    assert composition.parts["mlp"] == "plain_mlp"
    assert {k: composition.options[k] for k in ("ACT", "MLP_BIAS")} == {"ACT": "hidden_act", "MLP_BIAS": Expr("config.mlp_bias")}
    assert any("no gate" in item for item in composition.unfused)
    text = render_native(CTX, composition)
    assert "class ArceePlainMLP(nn.Module):" in text and "gate_up_proj" not in text and "torch_npu.npu_swiglu" not in text
    assert text.count(FAULT[0]) == 1


def test_a_gated_mlp_keeps_its_part():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    assert derive(AutoConfig.for_model("llama").to_dict()).parts["mlp"] == "gated_mlp"


def test_the_plain_mlp_file_matches_transformers_and_a_fault_fails(arcee, tmp_path):
    rows = selfcheck_with_faults({"arcee": arcee}, {"arcee": [FAULT]}, CTX["framework_class"], tmp_path,
                                 keep=lambda label: "rope" not in label)
    assert "bias mlp_bias" in [label for _, label, ok, _ in rows if ok]
    assert "differ from transformers" in rows[-1][3]["reason"]
