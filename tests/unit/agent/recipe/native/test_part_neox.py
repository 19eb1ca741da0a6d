"""The NeoX-era layouts (agent/recipe/native/parts/layout.py: the model read under the file's names by role, the
checkpoint renamed at load; parts/mlp_plain.py's MLP linears by role; parts/attention.py's fused q/k/v stored in groups, QKV_GROUPS in parts/code/attention_fused.py;
parts/block_parallel.py's two-norm parallel layer; parts/head.py's biased lm_head; parts/rotary_interleaved.py's
GPT-J rotary, partial by config.rotary_dim; parts/mlp_plain.py's n_inner width, MLP_WIDTH): gpt_neox, phi, persimmon, gptj and
codegen are written natively. Each is held to transformers in float32 and bfloat16 and on its family settings but the rope
types, and a file with the part's arithmetic broken fails the same check. The default case is gpt_neox's (the layout,
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
                  [("query, key = self.q_layernorm(query), self.k_layernorm(key)", "query, key = query, key")]),
    "gptj": ({"block": "parallel", "position": "rotary_interleaved", "mlp": "plain_mlp"},
             {"ROTARY_DIM": "rotary_dim", "ROPE_INTERLEAVED": True, "MLP_WIDTH": "n_inner", "WIDTH_DEFAULT_4X": True, "LM_HEAD_BIAS": True},
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
    """A model already under the file's names gets no layout, no renames, an lm_head without bias."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.parts.probe import Probe

    probe = Probe(AutoConfig.for_model("llama").to_dict())
    assert probe.layout is None
    composition = derive(AutoConfig.for_model("llama").to_dict())
    assert "LM_HEAD_BIAS" not in composition.options and "QKV_GROUPS" not in composition.options
    assert composition.options["CHECKPOINT_RENAMES"] == ()


@pytest.mark.parametrize("model_type", list(TYPES))
def test_every_checkpoint_tensor_is_the_files_after_the_renames(model_type):
    """Each tensor a checkpoint of the type holds (save_pretrained's names), renamed as the file's loader renames it
    (its CHECKPOINT_RENAMES: transformers' own, the layout's, the MLP's), names the same tensor under the names the
    parts read (probe.children; the MLP's linears by role): the probe reads what the file loads."""
    import re

    from agent.recipe.native.parts.layout import mlp_roles
    from agent.recipe.native.parts.probe import Probe, children
    from agent.recipe.native.selfcheck import checkpoint_tensors

    config, composition = derived(model_type)
    renames = composition.options["CHECKPOINT_RENAMES"]
    assert renames, "a type of transformers' other names gets renames"
    probe = Probe(config)
    for name, tensor in checkpoint_tensors(probe.model, probe.config):
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name, count=1)
        *path, leaf = name.split(".")
        node = probe.model
        for part in path:
            named = children(node)
            if part not in named:          # the MLP's linears, read by their role (parts/layout.py)
                named = {role: named[n] for role, n in (mlp_roles(node) or {}).items()}
            node = node[int(part)] if part.isdigit() else named[part]
        got = getattr(node, leaf)
        assert got is tensor or got.data_ptr() == tensor.data_ptr(), name


def test_the_mlp_linears_are_read_by_the_order_they_are_called():
    """mlp_roles names up_proj the linear the forward calls first, whatever the module names or declares first (a
    table of names, or the declaration order, would take `w_a` for up here); an MLP of three linears is none."""
    import torch

    from agent.recipe.native.parts.layout import mlp_roles

    class Backwards(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_a, self.gate, self.w_b = torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 16)

        def forward(self, x):
            return self.w_a(self.gate(self.w_b(x)))

    assert mlp_roles(Backwards()) == {"up_proj": "w_b", "act_fn": "gate", "down_proj": "w_a"}
    three = Backwards()
    three.extra = torch.nn.Linear(16, 16)
    assert mlp_roles(three) is None


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
