"""The NeoX-era layouts (agent/recipe/native/parts/names.py: the model under the file's names, the checkpoint renamed
at load; parts/attention.py's fused q/k/v stored in groups, QKV_GROUPS in parts/code/attention_fused.py;
parts/block_parallel.py's two-norm parallel layer; parts/head.py's biased lm_head; parts/rotary_interleaved.py's
GPT-J rotary, partial by config.rotary_dim; parts/mlp_plain.py's n_inner width): gpt_neox, phi, persimmon, gptj and
codegen are written natively. Each is held to transformers in float32 and bfloat16 and on its family settings but the rope
types, and a file with the part's arithmetic broken fails the same check. The default case is gpt_neox's (the view,
the per-head q/k/v, the two-norm parallel layer and its sequential setting); the others' are slow."""

from __future__ import annotations

import functools

import pytest

# type: (parts expected, options expected, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "gpt_neox": ({"block": "parallel_two_norms", "attention": "fused_paged", "mlp": "plain_mlp", "norm": "layer_norm"},
                 {"QKV_GROUPS": ("kv_heads", "qkv"), "QKV": "qkv_proj", "MLP_NORM": True, "PARALLEL_KEY": "use_parallel_residual"},
                 [('for name in "qkv"])', 'for name in "qvk"])'),
                  ("hidden_states = self.post_attention_layernorm(residual)", "hidden_states = hidden_states")]),
    "phi": ({"block": "parallel", "attention": "fused_paged", "mlp": "plain_mlp", "position": "rotary"},
            {"LM_HEAD_BIAS": True},
            [("output_size=config.vocab_size, bias=True,", "output_size=config.vocab_size, bias=False,")]),
    "persimmon": ({"block": "pre_norm", "attention": "fused_paged", "mlp": "plain_mlp"},
                  {"QKV_GROUPS": ("kv_heads", "qkv"), "QK_NORM": True},
                  [("query, key = self.q_norm(query), self.k_norm(key)", "query, key = query, key")]),
    "gptj": ({"block": "parallel", "position": "rotary_interleaved", "mlp": "plain_mlp"},
             {"ROTARY_DIM": "rotary_dim", "ROPE_INTERLEAVED": True, "N_INNER": True, "LM_HEAD_BIAS": True},
             [("return config.rotary_dim or head_dim", "return head_dim")]),
    "codegen": ({"block": "parallel", "position": "rotary_interleaved", "attention": "fused_paged"},
                {"QKV_GROUPS": (4, "qvk"), "ROTARY_DIM": "rotary_dim"},
                [('count, order = (4, "qvk")', 'count, order = (4, "qkv")')]),
}
FAST = ("gpt_neox",)


def config_of(model_type: str) -> dict:
    from transformers import AutoConfig

    from agent.testing.checkpoint_shapes import checkpoint_config

    shaped = checkpoint_config(model_type)
    return shaped[0] if shaped else AutoConfig.for_model(model_type).to_dict()


@functools.lru_cache(maxsize=None)
def derived(model_type: str):
    from agent.recipe.native.compose import derive

    config = config_of(model_type)
    return config, derive(config)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_the_parts_are_read_from_the_architecture(model_type):
    parts, options, _ = TYPES[model_type]
    composition = derived(model_type)[1]
    assert {slot: composition.parts.get(slot) for slot in parts} == parts, composition.parts
    assert {k: composition.options.get(k) for k in options} == options


def test_a_llama_keeps_its_names_and_head():
    """A model already under the file's names gets no view, no renames, an lm_head without bias."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.parts.probe import Probe

    probe = Probe(AutoConfig.for_model("llama").to_dict())
    assert probe.view is probe.model and probe.renames == ()
    composition = derive(AutoConfig.for_model("llama").to_dict())
    assert "LM_HEAD_BIAS" not in composition.options and "QKV_GROUPED" not in composition.options


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi", "persimmon", "gptj", "codegen", "falcon", "bloom",
                                        pytest.param("mpt", marks=pytest.mark.slow)])     # mpt's stays 2048 wide
def test_every_checkpoint_tensor_is_the_views_after_the_renames(model_type):
    """Each tensor a checkpoint of the type holds (save_pretrained's names), renamed as the loader renames it
    (the view's renames, then transformers' own), names the same tensor in the view: the probe reads what the
    file loads."""
    import re

    from agent.recipe.native.parts.model import checkpoint_renames
    from agent.recipe.native.parts.probe import Probe
    from agent.recipe.native.selfcheck import checkpoint_tensors

    probe = Probe(config_of(model_type))
    renames = probe.renames + checkpoint_renames(probe.model_type, type(probe.model).__name__)
    assert renames, "a type of transformers' other names gets renames"
    for name, tensor in checkpoint_tensors(probe.model, probe.config):
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name, count=1)
        node = probe.view
        for part in name.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        assert node is tensor or node.data_ptr() == tensor.data_ptr(), name


def test_the_qkv_layout_is_read_and_another_is_refused():
    """gpt_neox's fused rows are per head [q; k; v], phi3's [q; k; v]; an architecture that reads its stored rows
    in another order (here: permuted) is neither, and not native."""
    import torch
    from transformers import AutoConfig

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention import fused_qkv_groups
    from agent.recipe.native.parts.probe import Probe

    for model_type, grouped in (("gpt_neox", ("kv_heads", "qkv")), ("phi3", ()), ("codegen", (4, "qvk"))):
        probe = Probe(AutoConfig.for_model(model_type).to_dict())
        attention = probe.layers[0].self_attn
        assert fused_qkv_groups(probe, 0, attention.qkv_proj, attention.o_proj) == grouped, model_type
    probe = Probe(AutoConfig.for_model("gpt_neox").to_dict())
    qkv = probe.layers[0].self_attn.qkv_proj
    order = torch.randperm(qkv.out_features, generator=torch.Generator().manual_seed(0))
    qkv.forward = lambda x: torch.nn.functional.linear(x, qkv.weight, qkv.bias)[..., order]
    with pytest.raises(NotNative, match="neither"):
        fused_qkv_groups(probe, 0, qkv, probe.layers[0].self_attn.o_proj)


def test_a_sequential_neox_is_the_pre_norm_layer():
    """use_parallel_residual false: gpt_neox's layer is the pre-norm one, not the two-norm parallel part's."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = {**AutoConfig.for_model("gpt_neox").to_dict(), "use_parallel_residual": False}
    assert derive(config).parts["block"] == "pre_norm"


def _check(model_types, tmp_path):
    from part_selfcheck import selfcheck_with_faults

    rows = selfcheck_with_faults({t: derived(t) for t in model_types}, {t: TYPES[t][2] for t in model_types},
                                 "NxForCausalLM", tmp_path)
    if "gpt_neox" in model_types:
        assert ("gpt_neox", "use_parallel_residual off") in {(t, label) for t, label, _, _ in rows}


def test_the_neox_file_matches_transformers_and_faults_fail(tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16, with
    use_parallel_residual off and the attention bias toggled; a file that takes k's rows for v's, or feeds the
    MLP the attention's norm, fails."""
    _check(FAST, tmp_path)


@pytest.mark.slow
def test_the_other_neox_era_files_match_transformers_and_faults_fail(tmp_path):
    """As the default case, for phi (biased lm_head, one-norm parallel layer), persimmon (per-head q/k LayerNorms
    on per-head q/k/v rows), gptj (the interleaved rotary on config.rotary_dim dims) and codegen (4 shards of
    [q; v; k]): a file without the head's bias, the q/k norms, rotating every dim, or reading [q; k; v] shards
    fails."""
    _check([t for t in TYPES if t not in FAST], tmp_path)
