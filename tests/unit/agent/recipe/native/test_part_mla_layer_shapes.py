"""MLA layers of unequal widths (agent/recipe/native/parts/mla_layer_shapes.py; its code: parts/code/attention_mla.py
under MLA_PER_LAYER): dots3_note_text's sliding layers set kv_lora_rank 1024 and qk_nope_head_dim 192 beside its
indexed layers' 512 and 128 through transformers' per_layer_config.

Default suite, in-process: each layer's widths read from transformers' modules and held to its layer's config
(a layer built from another layer's widths is refused, naming it); the written attention builds each layer from
config.per_layer_config[layer_idx], with its own latent / rope cache entries (a file that builds every layer
from layer 0's widths fails the same check); dots3's row names its next blockers, not the per-layer refusal.
No end-to-end self-check: no transformers model with MLA widths per layer is written natively yet (dots3's
position and attention extras below), so the MLA code file is written alone with the option set.
"""

from __future__ import annotations

import types

import pytest

import native_moe_harness as harness
from agent.recipe.native.not_native import NotNative

@pytest.fixture(scope="module")
def dots3():
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    return Probe(AutoConfig.for_model("dots3_note_text").to_dict())


def test_each_layers_mla_widths_are_read_from_its_modules_and_held_to_its_config(dots3):
    from agent.recipe.native.parts.mla_layer_shapes import layer_shapes

    shapes = layer_shapes(dots3)
    assert dots3.config.layer_types == ["indexed_attention", "indexed_attention", "sliding_attention"]
    assert [(s["kv_lora_rank"], s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]) for s in shapes] == [
        (512, 128, 64, 128), (512, 128, 64, 128), (1024, 192, 64, 128)]


def test_a_layer_built_with_another_layers_widths_is_refused_naming_it(dots3):
    """Fault: the sliding layer's attention built with layer 0's kv_lora_rank (its module swapped for layer 0's)."""
    from agent.recipe.native.parts.mla_layer_shapes import layer_shapes

    sliding = dots3.layers[2].self_attn
    dots3.layers[2].self_attn = dots3.layers[0].self_attn
    try:
        with pytest.raises(NotNative) as caught:
            layer_shapes(dots3)
    finally:
        dots3.layers[2].self_attn = sliding
    assert caught.value.kind == "attention"
    assert "layer 2's MLA" in caught.value.reason and "kv_lora_rank 512 (config 1024)" in caught.value.reason


def test_the_probe_lets_through_a_config_that_sets_mla_widths_alone_per_layer():
    """MLA widths per layer are this part's; anything else set per layer (a layer's own sliding window beside
    them, gemma4's head_dim) still falls back at the probe, naming it."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import per_layer_refusal, sets_mla_shapes_per_layer

    dots3 = AutoConfig.for_model("dots3_note_text", num_hidden_layers=3)
    assert sets_mla_shapes_per_layer(dots3)
    sliding = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 1024,
               "head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 128}
    windowed = AutoConfig.for_model("dots3_note_text", num_hidden_layers=3,
                                    per_layer_config={2: {**sliding, "sliding_window": 8}})
    assert not sets_mla_shapes_per_layer(windowed) and "sliding_window" in per_layer_refusal(windowed)
    assert not sets_mla_shapes_per_layer(AutoConfig.for_model("gemma4_text", num_hidden_layers=6))
    assert not sets_mla_shapes_per_layer(AutoConfig.for_model("deepseek_v3"))


def test_dots3_falls_back_at_its_next_blockers_not_at_the_per_layer_widths(dots3):
    """The probe lets MLA widths per layer through: the row names the position (its partial_rotary_factor is of
    head_dim), and the attention part, asked alone, its modules beyond MLA's."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.parts.mla_layer_shapes import MLA_LAYER_SHAPES

    with pytest.raises(NotNative) as caught:
        derive(AutoConfig.for_model("dots3_note_text").to_dict())
    assert caught.value.kind == "position" and "MLA with partial_rotary_factor 0.25" in caught.value.reason
    assert "per_layer_config" not in caught.value.reason
    with pytest.raises(NotNative) as caught:
        MLA_LAYER_SHAPES.probe(dots3, {})
    # (its g_proj is the MLA part's output gate)
    assert "['indexer', 'k_rope_only_layernorm'] beyond MLA's projections" in caught.value.reason


def _attention_code(per_layer: bool, edit=None):
    """The MLA code file written alone with MLA_PER_LAYER, loaded under the stand-in's torch_npu (upstream's
    cache_info read from its file: executor.core's package imports the engine)."""
    import importlib.util
    import sys
    import tempfile
    from pathlib import Path

    from agent.recipe.native.assemble import assemble
    from agent.recipe.native.parts import OPTION_NAMES

    text = assemble(["attention_mla.py"], options={"MLA_PER_LAYER": per_layer}, option_names=OPTION_NAMES, roles={},
                    prefix="Tiny", framework_class="TinyForCausalLM", keep=("ModelMlaAttention",))
    if not per_layer:
        return text
    assert text.count("config = config.per_layer_config[layer_idx]") == 1
    harness.ensure_imports()
    for name in ("executor.core", "executor.core.kv_cache"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
    if "executor.core.kv_cache.cache_info" not in sys.modules:
        spec = importlib.util.spec_from_file_location("executor.core.kv_cache.cache_info",
                                                      harness.UPSTREAM / "executor/core/kv_cache/cache_info.py")
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    path = Path(tempfile.mkdtemp(prefix="mla_layer_shapes_")) / "attention.py"
    path.write_text(edit(text) if edit else text)
    spec = importlib.util.spec_from_file_location("mla_layer_shapes_attention", path)
    module = importlib.util.module_from_spec(spec)
    with harness.torch_npu_importable():
        spec.loader.exec_module(module)
    return module


def _built_widths(module, config):
    infer = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(attn_tp_size=1),
        scheduler_config=types.SimpleNamespace(block_size=16),
        model_config=types.SimpleNamespace(exe_mode="eager", custom_params={}, enable_weight_nz=False))
    found = []
    for index in range(config.num_hidden_layers):
        attention = module.TinyMlaAttention(config, infer, None, index, prefix=f"model.layers.{index}.self_attn")
        found.append((attention.kv_lora_rank, attention.qk_nope_head_dim, attention.kv_b_proj.weight.shape[0],
                      [entry.dim for entry in attention.cache_entries]))
    return found


def test_the_written_attention_builds_each_layer_and_its_cache_from_its_own_config(dots3):
    """Each layer's widths, kv_b_proj rows (heads x (nope + v)) and latent / rope cache entries its own; a file
    that builds every layer from layer 0's widths fails the same check; without the option no per-layer read."""
    heads = dots3.config.num_attention_heads
    want = [(512, 128, heads * 256, [512, 64]), (512, 128, heads * 256, [512, 64]),
            (1024, 192, heads * 320, [1024, 64])]
    assert _built_widths(_attention_code(True), dots3.config) == want
    faulty = _attention_code(True, lambda text: text.replace("config.per_layer_config[layer_idx]",
                                                             "config.per_layer_config[0]"))
    assert _built_widths(faulty, dots3.config) != want
    assert "per_layer_config" not in _attention_code(False)
