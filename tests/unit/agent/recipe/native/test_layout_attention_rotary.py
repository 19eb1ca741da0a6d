"""moshi's text decoder (MoshiForCausalLM), read by the layout as the skeleton's: a rotary table held by each
attention rather than the base model (its `self_attn.rotary_emb`, read as the base model's; tables that differ between
layers stay with their attentions), the attention then taking the table a probe hands it; its q/k/v/o each a Linear
inside a MoshiLinear wrapper (`q_proj.linear`: read as that Linear, renamed at load); its MLP's gate and up one linear
(`fc1`, the gated MLP's merged gate_up_proj, width ffn_dim / 2); its window in transformers' cache alone (a decode
step windowed, a prefill not); its head never tied (parts/layout.py, parts/mlp.py, parts/attention.py,
parts/head.py). The file against transformers, with faults that must fail: slow case below."""

from __future__ import annotations

import pytest

from part_selfcheck import selfcheck_with_faults


def _moshi(**changes):
    from transformers import AutoConfig, MoshiForCausalLM

    config = AutoConfig.for_model("moshi", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=16, ffn_dim=128, vocab_size=32, **changes)
    return MoshiForCausalLM(config)


def test_each_attentions_one_rotary_is_read_as_the_base_models():
    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _moshi()
    read_layout(model, 64)
    base = model.model
    assert children(base)["rotary_emb"] is base.layers[0].self_attn.rotary_emb
    assert all("rotary_emb" not in children(layer.self_attn) for layer in base.layers)
    assert "rotary_emb" not in dict(base.named_children())      # shown to the probe, not moved in the model


def test_rotaries_that_differ_by_layer_stay_with_their_attentions():
    import torch

    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _moshi()
    with torch.no_grad():
        model.model.layers[1].self_attn.rotary_emb.inv_freq.mul_(2.0)
    read_layout(model, 64)
    assert "rotary_emb" not in children(model.model)
    assert "rotary_emb" in children(model.model.layers[0].self_attn)


def test_an_attention_with_its_own_rotary_takes_the_table_it_is_handed():
    """A probe holds cos / sin fixed and moves the positions (parts/attention_positions.py): the attention's output
    must not move; transformers' own forward (no table handed) runs as built."""
    import torch

    from agent.recipe.native.parts.attention_positions import follows_positions
    from agent.recipe.native.parts.layout import read_layout

    model = _moshi().eval()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        before = model(ids).logits
        read_layout(model, 64)
        after = model(ids).logits
    assert torch.equal(before, after)
    probe = type("P", (), {"hidden": 64, "base": model.model})()
    assert not follows_positions(model.model.layers[0].self_attn, probe)


def test_wrapped_projections_are_read_as_their_linear_and_renamed_at_load():
    import re

    import torch

    from agent.recipe.native.parts.layout import read_layout, wrapped_linear
    from agent.recipe.native.parts.probe import children

    model = _moshi()
    layout = read_layout(model, 64)
    attention = model.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert children(attention)[name] is getattr(attention, name).linear
    name = "model.layers.1.self_attn.o_proj.linear.weight"
    for pattern, replacement in layout.renames:
        name = re.sub(pattern, replacement, name, count=1)
    assert name == "model.layers.1.self_attn.o_proj.weight"

    class Scaled(torch.nn.Module):          # a wrapper that computes more than its linear: not read as it
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return 2 * self.linear(x)

    assert wrapped_linear(Scaled()) is None and wrapped_linear(torch.nn.Linear(8, 8)) is None


def test_a_merged_gate_up_under_other_names_is_read_by_what_it_computes():
    """moshi's fc1 (hidden -> 2 x width, the gate's half first) and fc2 (width -> hidden); the halves swapped, or
    another activation, is not this MLP."""
    import torch

    from agent.recipe.native.parts.mlp import _read_fused_roles

    mlp = _moshi().model.layers[0].mlp
    assert _read_fused_roles(mlp, 64, ("gelu", "silu")) == ({"gate_up_proj": "fc1", "down_proj": "fc2"}, "silu")
    assert _read_fused_roles(mlp, 64, ("gelu",)) is None

    def up_first(x):            # the same linears, the activation on the second half
        up, gate = mlp.fc1(x).chunk(2, dim=-1)
        return mlp.fc2(torch.nn.functional.silu(gate) * up)

    mlp.forward = up_first
    assert _read_fused_roles(mlp, 64, ("silu",)) is None


# type: faults (text of the correct file, its faulty replacement)
TYPES = {"moshi": [
    # the prefill windowed as the decode is (transformers' mask is causal: its cache alone keeps the window)
    ("pre_tokens=2147483647, next_tokens=0", "pre_tokens=self.sliding_window - 1, next_tokens=0"),
    # the wrapped projections' rename dropped: q_proj.linear.weight loads nothing
    ('("^(model\\\\.layers\\\\.\\\\d+\\\\.self_attn\\\\.q_proj)\\\\.linear\\\\.", "\\\\1."),',
     '("^(model\\\\.layers\\\\.\\\\d+\\\\.self_attn\\\\.q_proj)\\\\.linear\\\\.", "dropped."),'),
    # gate and up read in the other order
    ("torch_npu.npu_swiglu(gate_up, dim=-1)",
     "torch_npu.npu_swiglu(torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1), dim=-1)"),
]}


@pytest.mark.slow
def test_moshis_file_matches_transformers_and_faults_fail(tmp_path):
    """Default cases covering its paths: the four above (the layout's reading, the handed table, the merged gate_up);
    the window and tie readings run in every derive of moshi (scripts/native_coverage.py)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("moshi").to_dict()         # no checkpoint shape recorded: its defaults
    derived = {"moshi": (config, derive(config))}
    composition = derived["moshi"][1]
    assert composition.options["WINDOW_DECODE_ONLY"] and composition.options["GATE_UP_WIDTH_KEY"] == "ffn_dim"
    selfcheck_with_faults(derived, TYPES, "MoshiForCausalLM", tmp_path)
