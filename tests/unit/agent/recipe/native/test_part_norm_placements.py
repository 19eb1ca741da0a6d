"""Norm kinds and placements, and the depth-scaled residual (agent/recipe/native/parts): the LayerNorm without weight
or bias (parts/norm_weightless.py, code parts/code/norm_weightless.py: olmo's, its epsilon fixed in transformers'
code and measured numerically), the post-LN layer (parts/block_post_ln.py, code parts/code/block_post_ln.py:
openai-gpt's norm(h + attn(h)), then norm(h + mlp(h)), no final norm; its MLP's activation under the architecture's
own name, afn "gelu" running gelu_new: parts/mlp_plain.py's ACT_NAMES; its attention's softmax scale measured on
the fused c_attn) and the residual multiplier scale_depth / sqrt(num_hidden_layers) (parts/scalar_multipliers.py,
RESIDUAL_DEPTH_SCALED: minicpm3's, on its own 32-wide MLA rope, which the MLA part rotates and caches in plain torch:
npu_interleave_rope takes 64 only).

Each file, derived on its checkpoint-shaped config (agent.testing.checkpoint_shapes) or transformers' defaults, is
held to transformers per step; a file with the part's arithmetic broken fails the same check. By default one
stand-in process checks olmo's and openai-gpt's files in float32 and one fault (openai-gpt's norm moved before the
residual add); minicpm3's file, float32 and bfloat16 with every family setting and every type's faults are slow
(their default case: test_the_files_match_transformers_and_a_post_ln_fault_fails)."""

from __future__ import annotations

import pytest

from part_selfcheck import selfcheck_with_faults

POST_LN_FAULT = ("hidden_states, _ = self.post_feedforward_layernorm(self.mlp(hidden_states), hidden_states)",
                 "hidden_states = hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))")
# type: (the parts the probe reads, config changes over its shape or defaults, faults: (correct text, faulty text))
TYPES = {
    "olmo": ({"norm": "weightless_layer_norm", "block": "pre_norm"}, {},
             [("self.normalized_shape, None, None, self.variance_epsilon)", "self.normalized_shape, None, None, 1e-12)")]),
    "openai-gpt": ({"norm": "layer_norm", "block": "post_ln", "mlp": "plain_mlp", "position": "absolute_positions"}, {},
                   # the activation table read at run time (afn "gelu" as relu; exact gelu is within the tolerance)
                   [POST_LN_FAULT, ('("gelu", "gelu_new"),', '("gelu", "relu"),')]),
    "minicpm3": ({"attention": "mla", "block": "pre_norm_residual_multiplier", "embedding": "embedding_multiplier"},
                 {},
                 [("config.scale_depth / config.num_hidden_layers ** 0.5", "config.scale_depth")]),
}
CLASS = "NpForCausalLM"


# checked by default (the post-LN fault's type and the weightless norm); minicpm3's MLA file is slow
DEFAULT_TYPES = ("olmo", "openai-gpt")


@pytest.fixture(scope="module")
def derived():
    """get(type) -> (the config it is measured on, its composition), each derived once."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.testing.checkpoint_shapes import checkpoint_config

    found = {}

    def get(model_type):
        if model_type not in found:
            shaped = checkpoint_config(model_type)
            config = {**(shaped[0] if shaped else AutoConfig.for_model(model_type).to_dict()), **TYPES[model_type][1]}
            found[model_type] = (config, derive(config))
        return found[model_type]
    return get


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3e-4])
def test_the_epsilon_of_a_weightless_layer_norm_is_measured(eps):
    import torch

    from agent.recipe.native.parts.norm_weightless import weightless_eps

    class Weightless(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, eps)

    assert weightless_eps(Weightless(), 16) == pytest.approx(eps, rel=1e-2)


@pytest.mark.parametrize("kind", ["with-weight", "rms"])
def test_what_is_not_a_weightless_layer_norm_is_refused(kind):
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.norm_weightless import weightless_eps

    class WeightlessRms(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    module = torch.nn.LayerNorm(16) if kind == "with-weight" else WeightlessRms()
    with pytest.raises(NotNative):
        weightless_eps(module, 16)


@pytest.mark.parametrize("add_first, want", [(True, True), (False, False)], ids=["post-ln", "post-norm"])
def test_the_post_ln_layer_is_read_numerically(add_first, want):
    """norm(h + attn(h)) is post-LN; h + norm(attn(h)) (olmo2's post-norm) is not."""
    import torch

    from agent.recipe.native.parts.block_post_ln import post_ln_layer

    class Identity(torch.nn.Module):
        def forward(self, x, *args, **kwargs):
            return x

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Identity(), Identity()
            self.post_attention_layernorm, self.post_feedforward_layernorm = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)

        def forward(self, x):
            a, m = self.post_attention_layernorm, self.post_feedforward_layernorm
            h = a(x + self.self_attn(x)[0]) if add_first else x + a(self.self_attn(x)[0])
            return m(h + self.mlp(h)) if add_first else h + m(self.mlp(h))

    assert post_ln_layer(Layer(), 8) is want


def check_parts(model_type: str, composition) -> None:
    parts = TYPES[model_type][0]
    assert {slot: composition.parts.get(slot) for slot in parts} == parts, (model_type, composition.parts)
    options = composition.options
    if model_type == "olmo":
        assert options["NORM_EPS"] is None                      # no config key: torch's 1e-5, as OlmoLayerNorm's
        assert "FINAL_NORM" not in options and "ACT_NAMES" not in options
    elif model_type == "openai-gpt":
        assert options["FINAL_NORM"] is False and options["WIDTH_FIXED_4X"] is True
        assert options["ACT"] == "afn" and options["ACT_NAMES"] == (("gelu", "gelu_new"),)
    else:
        assert options["RESIDUAL_DEPTH_SCALED"] is True


def test_the_parts_are_read_from_the_architectures(derived):
    for model_type in DEFAULT_TYPES:
        check_parts(model_type, derived(model_type)[1])


def test_the_files_match_transformers_and_a_post_ln_fault_fails(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck), olmo's and openai-gpt's files on their
    configs in float32, and openai-gpt's file with its last norm before the residual add: one stand-in process."""
    rows = selfcheck_with_faults({t: derived(t) for t in DEFAULT_TYPES}, {"openai-gpt": [POST_LN_FAULT]}, CLASS,
                                 tmp_path, keep=lambda label: label == "the checkpoint's config")
    assert sorted((t, ok) for t, _, ok, _ in rows) == sorted([(t, True) for t in DEFAULT_TYPES] + [("openai-gpt", False)])
    texts = {t: (tmp_path / f"{t}.py").read_text() for t in DEFAULT_TYPES}
    assert "nn.Parameter" not in texts["olmo"].split("class NpWeightlessLayerNorm")[1].split("\nclass ")[0]
    assert texts["olmo"].count("WeightlessLayerNorm(config.hidden_size, eps=FIXED_NORM_EPS)") == 3
    assert "self.norm" not in texts["openai-gpt"] and "ACT2FN[name]" in texts["openai-gpt"]
    assert "ACT_NAMES" not in texts["olmo"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_each_file_in_every_dtype_and_setting_and_its_faults(derived, model_type, tmp_path):
    """Slow: float32, bfloat16 and each family setting but the rope types (test_part_rotary.py), and every fault of
    the type; the default case of their path: test_the_files_match_transformers_and_a_post_ln_fault_fails."""
    check_parts(model_type, derived(model_type)[1])
    rows = selfcheck_with_faults({model_type: derived(model_type)}, {model_type: TYPES[model_type][2]}, CLASS,
                                 tmp_path)
    assert (model_type, "the checkpoint's config in bfloat16", True) in [row[:3] for row in rows]
    if model_type == "minicpm3":
        assert "scale_depth / config.num_hidden_layers ** 0.5" in (tmp_path / "minicpm3.py").read_text()


@pytest.mark.parametrize("model_type", ["olmo", "olmoe"])
def test_a_checkpoint_that_clamps_q_k_v_falls_back_naming_clip_qkv(model_type):
    """OLMo-7B-0424's clip_qkv 8.0: no part writes the clamp, and random probe weights never reach it, so the
    self-check would pass a file without it — the derive refuses it by name."""
    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative
    from agent.testing.checkpoint_shapes import checkpoint_config

    config, _ = checkpoint_config(model_type)
    with pytest.raises(NotNative, match="clip_qkv 8.0"):
        derive({**config, "clip_qkv": 8.0})
