"""The decoder layer's norms by their role in its forward (agent/recipe/native/parts/norm_roles.py; the block parts
parts/block.py and parts/scalar_multipliers.py write them under the architecture's own names, code
parts/code/block.py): glm4 (sandwich: post_self_attn_layernorm the attention's output norm, post_attention_layernorm
the MLP's input norm), vaultgemma (pre-norm under gemma's names), hyperclovax (sandwich under post_norm1 / post_norm2
with its residual multiplier after the output norms, the logits multiplied by logits_scaling), helium (the probe's
shrunk config keeps hidden_size the heads' width where the architecture's code ties them: its o_proj), hunyuan_v1_dense
(per-head q / k norms named query_layernorm / key_layernorm, on the rotated queries and keys; its rope base stretched
by a fixed NTK alpha), apertus (pre-norm
under attention_layernorm / feedforward_layernorm; the plain MLP's xIELU with its learned parameters loaded). Each file is
held to transformers in float32 and bfloat16 and on the family settings but the rope types; a file that takes a norm
by its usual name rather than its role, drops a multiplier or a q / k norm, fails the same check."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
ROPE = 'query, key = torch_npu.npu_apply_rotary_pos_emb(query.contiguous(), key.contiguous(), cos, sin, layout="TND")'
HUNYUAN_NORMS = "query, key = self.query_layernorm(query), self.key_layernorm(key)"
# type: (block part, norms by role, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "glm4": ("sandwich", {"ATTENTION_NORM": "input_layernorm", "ATTENTION_OUT_NORM": "post_self_attn_layernorm",
                          "MLP_NORM": "post_attention_layernorm", "MLP_OUT_NORM": "post_mlp_layernorm"}, [
        ("hidden_states = self.post_self_attn_layernorm(hidden_states)", "hidden_states = hidden_states"),
        ("hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)",
         "hidden_states, residual = self.post_self_attn_layernorm(hidden_states, residual)")]),
    "vaultgemma": ("pre_norm", {"ATTENTION_NORM": "input_layernorm", "MLP_NORM": "pre_feedforward_layernorm"}, [
        ("hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)",
         "hidden_states, residual = self.input_layernorm(hidden_states, residual)")]),
    "hyperclovax": ("sandwich_residual_multiplier", {"ATTENTION_OUT_NORM": "post_norm1", "MLP_OUT_NORM": "post_norm2",
                                                     "MLP_NORM": "post_attention_layernorm"}, [
        ("hidden_states = self.post_norm2(self.mlp(hidden_states))\n"
         "        hidden_states = hidden_states * self.residual_multiplier",
         "hidden_states = self.post_norm2(self.mlp(hidden_states))"),
        ("logits = logits * self.config.logits_scaling", "logits = logits / self.config.logits_scaling")]),
    "hunyuan_v1_dense": ("pre_norm", {"Q_NORM": "query_layernorm", "K_NORM": "key_layernorm",
                                      "QK_NORM_AFTER_ROPE": True, "NTK_ALPHA": True}, [
        # the norms before the rotary (qwen3's order)
        (ROPE + "\n        " + HUNYUAN_NORMS, HUNYUAN_NORMS + "\n        " + ROPE),
        # the rope base not stretched by the NTK alpha
        ('params["rope_theta"] = float(params["rope_theta"]) * float(params["alpha"]) ** (head_dim / (head_dim - 2))',
         'params["rope_theta"] = float(params["rope_theta"])')]),
    "apertus": ("pre_norm", {"ATTENTION_NORM": "attention_layernorm", "MLP_NORM": "feedforward_layernorm",
                             "ACT_PARAMS": True}, [
        ("self.act_fn = self.act_fn.to(torch.get_default_dtype())", "self.act_fn = nn.SiLU()")]),
    "helium": ("pre_norm", {"ATTENTION_NORM": "input_layernorm", "MLP_NORM": "post_attention_layernorm"}, []),
}


def ctx(model_type: str) -> dict:
    return {"model_name": model_type, "framework_class": "NrForCausalLM", "display_name": model_type, "model_class": "X"}


def type_config(model_type: str) -> dict:
    from transformers import AutoConfig

    from agent.testing.checkpoint_shapes import checkpoint_config

    shaped = checkpoint_config(model_type)
    return shaped[0] if shaped else AutoConfig.for_model(model_type).to_dict()


@pytest.fixture(scope="module")
def derived():
    from agent.recipe.native.compose import derive

    return {model_type: (type_config(model_type), derive(type_config(model_type))) for model_type in TYPES}


def _layer(names: dict, sandwich: bool):
    """A decoder layer whose norms carry `names` (role -> attribute), in the sandwich or pre-norm layout."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states, None

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), nn.Identity()
            for name in names.values():
                setattr(self, name, nn.RMSNorm(8))

        def forward(self, hidden_states, **kwargs):
            norm = {role: getattr(self, name) for role, name in names.items()}
            h = hidden_states + (norm["attention_out"] if sandwich else nn.Identity())(
                self.self_attn(norm["attention_in"](hidden_states), **kwargs)[0])
            out = self.mlp(norm["mlp_in"](h))
            return h + (norm["mlp_out"](out) if sandwich else out)

    return Layer().eval().to(torch.float32)


@pytest.mark.parametrize("names, sandwich", [
    # names that say the opposite of the role: read by role, not by name
    ({"attention_in": "post_attention_layernorm", "mlp_in": "input_layernorm"}, False),
    ({"attention_in": "ln_a", "attention_out": "ln_b", "mlp_in": "ln_c", "mlp_out": "ln_d"}, True),
    ({"attention_in": "input_layernorm", "attention_out": "pre_feedforward_layernorm",
      "mlp_in": "post_feedforward_layernorm", "mlp_out": "post_attention_layernorm"}, True),
])
def test_norms_are_read_by_their_role_in_the_forward(names, sandwich):
    from agent.recipe.native.parts.norm_roles import probe_roles

    assert probe_roles(_layer(names, sandwich), 8) == names


def test_a_layer_that_cannot_be_run_so_reads_no_roles():
    import torch
    from torch import nn

    from agent.recipe.native.parts.norm_roles import probe_roles

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp, self.norm = nn.Identity(), nn.Identity(), nn.RMSNorm(8)

        def forward(self, hidden_states, extra, **kwargs):      # another call shape
            return hidden_states

    assert probe_roles(Layer(), 8) == {}
    assert probe_roles(nn.Sequential(nn.RMSNorm(8)), 8) == {}      # no self_attn / mlp
    assert torch.is_grad_enabled()


def test_the_parts_are_read_from_the_architecture(derived):
    for model_type, (block, roles, _) in TYPES.items():
        composition = derived[model_type][1]
        assert composition.parts["block"] == block, (model_type, composition.parts)
        assert {k: composition.options.get(k) for k in roles} == roles, model_type
    assert derived["hyperclovax"][1].options["LOGITS_DIVIDED"] is False
    assert derived["hyperclovax"][1].parts["head"] == "lm_head_logits_scaling"


def test_a_prefix_the_checkpoint_stores_its_tensors_under_is_a_rename():
    """apertus1p5_text's checkpoints hold the decoder under model.language_model.*: transformers' PrefixChange, the
    loader's rename (a name outside the prefix kept)."""
    import re

    from agent.recipe.native.parts.model import checkpoint_renames

    renames = checkpoint_renames("apertus1p5_text")

    def load_name(name):
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name, count=1)
        return name

    assert load_name("model.language_model.layers.0.mlp.act_fn.alpha_p") == "model.layers.0.mlp.act_fn.alpha_p"
    assert load_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert load_name("lm_head.weight") == "lm_head.weight"


def test_the_shrunk_config_keeps_hidden_size_the_heads_width_where_the_code_ties_them():
    """helium's o_proj maps hidden_size to hidden_size: with the heads' width kept (head_dim 128) and hidden_size
    shrunk to 64 transformers' own model cannot run; llama's can, so its shrunk hidden_size stays tiny."""
    from agent.recipe.native.parts.probe import _runs, shrunk_config

    helium = shrunk_config(type_config("helium"))
    assert helium.hidden_size == helium.num_attention_heads * helium.head_dim == 512
    broken = helium.__class__(**{**helium.to_dict(), "hidden_size": 64})
    broken._attn_implementation = "eager"
    assert not _runs(broken)
    llama = shrunk_config(type_config("llama"))
    assert llama.hidden_size == 64 and llama.num_attention_heads * llama.head_dim != 64


def test_norm_role_files_match_transformers_and_faults_fail(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family
    setting but the rope types (test_part_rotary.py), one stand-in process."""
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    jobs, labels = [], []
    for model_type, (_, _, faults) in TYPES.items():
        config, composition = derived[model_type]
        text = render_native(ctx(model_type), composition)
        good = tmp_path / f"{model_type}.py"
        good.write_text(text)
        for label, job in selfcheck_jobs(config, composition.checked_variants, str(good), "NrForCausalLM"):
            if not label.startswith("rope"):
                jobs.append(job)
                labels.append((model_type, label, True))
        # hyperclovax's defaults hold its multipliers at 1.0: its faults are checked on the family's other values
        changes = dict(composition.checked_variants).get("scalar multipliers", {})
        for index, (correct, faulty) in enumerate(faults):
            assert text.count(correct) == 1, (model_type, correct)
            bad = tmp_path / f"{model_type}_fault{index}.py"
            bad.write_text(text.replace(correct, faulty))
            jobs.append({"config": config, "file": str(bad), "class_name": "NrForCausalLM", "changes": changes,
                         "dtype": "float32"})
            labels.append((model_type, f"fault {index}", False))
    results = selfcheck(jobs, SNAPSHOT)
    wrong = [(t, label, r["reason"]) for (t, label, ok), r in zip(labels, results) if r["ok"] != ok]
    assert not wrong, wrong
