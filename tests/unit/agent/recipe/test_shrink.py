"""agent/recipe/shrink.py, the shrunk config the parity code check runs on: the same architecture (every layer
kind, MHA, MoE and MLA shapes, partial rotary inside the heads) with only sizes reduced; a layer cut the
config rejects falls back to widths only."""

from __future__ import annotations

import pytest

from agent.recipe.shrink import shrink_config


def test_shrink_keeps_structure_and_only_reduces():
    qwen3_06b = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": True}
    shrunk = shrink_config(qwen3_06b)
    assert shrunk["hidden_size"] == 64 and shrunk["num_hidden_layers"] == 2 and shrunk["head_dim"] == 16
    assert shrunk["num_key_value_heads"] < shrunk["num_attention_heads"]          # GQA stays GQA
    for kept in ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "model_type"):
        assert kept not in shrunk
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert "hidden_size" not in shrink_config(small) and shrink_config(small)["num_hidden_layers"] == 1


def test_shrink_keeps_every_layer_kind_and_mha():
    gemma3 = {"hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 8,
              "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4}
    shrunk = shrink_config(gemma3)
    assert shrunk["num_hidden_layers"] == 6
    assert shrunk["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert shrunk["num_key_value_heads"] == shrunk["num_attention_heads"]          # MHA stays MHA


def test_shrink_keeps_the_first_layer_an_index_list_names():
    """bamba's attn_layer_indices (its attention layers among Mamba2 ones): the cut keeps the first, and the list
    names only the layers kept; a cut to the usual two layers would keep no attention layer."""
    bamba = {"model_type": "bamba", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "attn_layer_indices": [9, 18, 27]}
    shrunk = shrink_config(bamba)
    assert shrunk["num_hidden_layers"] == 10 and shrunk["attn_layer_indices"] == [9]
    assert shrink_config({**bamba, "attn_layer_indices": [1, 3]})["attn_layer_indices"] == [1]


def test_an_index_list_of_every_layer_is_no_per_layer_list():
    """llama4's moe_layers names every layer where each is sparse (48 distinct values): read as a per-layer list it
    kept all 48 layers; as an index list the cut is the prefix its other lists need (no_rope_layers' first NoPE)."""
    llama4 = {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
              "moe_layers": list(range(48)), "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)]}
    shrunk = shrink_config(llama4)
    assert shrunk["num_hidden_layers"] == 4 and shrunk["moe_layers"] == [0, 1, 2, 3]
    assert shrink_config({**llama4, "moe_layers": list(range(1, 48, 2))})["moe_layers"] == [1, 3]


def test_a_state_space_mixers_groups_divide_its_fewer_heads():
    """nemotron_h's 8 B / C groups over 128 heads: cut with the heads to a count that divides them (transformers
    repeats each group heads / groups times; 8 groups over 2 heads is no model); a count that divides stays."""
    nemotron = {"model_type": "nemotron_h", "hidden_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 32,
                "mamba_num_heads": 128, "mamba_head_dim": 64, "expand": 2, "n_groups": 8}
    shrunk = shrink_config(nemotron)
    heads, groups = shrunk["mamba_num_heads"], shrunk.get("n_groups", 8)
    assert heads < 8 and heads % groups == 0, shrunk
    assert "n_groups" not in shrink_config({**nemotron, "n_groups": 1})


def test_shrink_moe_and_mla():
    dsv2 = {"hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
            "first_k_dense_replace": 1}
    shrunk = shrink_config(dsv2)
    assert shrunk["n_routed_experts"] == 4 and shrunk["num_experts_per_tok"] == 2
    assert shrunk["kv_lora_rank"] == 16 and "q_lora_rank" not in shrunk and "head_dim" not in shrunk
    assert shrunk["first_k_dense_replace"] == 1 and shrunk["num_hidden_layers"] == 2   # a dense and an MoE layer


def test_shrink_keeps_partial_rotary_inside_the_heads():
    """GPT-J-6B's published shape (n_embd 4096, 16 heads of 256, rotary_dim 64): the shrunk heads are
    16 wide, so rotary_dim must shrink too (it stayed 64 and transformers failed on the shrunk config;
    found by the --all sweep on gptj and codegen)."""
    from transformers import AutoConfig

    gptj_6b = {"n_embd": 4096, "n_head": 16, "n_layer": 28, "rotary_dim": 64, "n_positions": 2048,
               "vocab_size": 50400}
    shrunk = shrink_config(gptj_6b)
    config = AutoConfig.for_model("gptj", **{**gptj_6b, **shrunk})
    assert (config.n_embd, config.n_head, config.n_layer) == (64, 4, 2)      # GPT-2-era names shrink too
    assert config.rotary_dim <= config.n_embd // config.n_head
    # xlnet names its width d_model: its heads are not cut alone (d_model // n_head must stay d_head;
    # the final --all sweep caught that regression).
    xlnet_large = {"d_model": 1024, "n_head": 16, "d_head": 64, "n_layer": 24, "vocab_size": 32000}
    config = AutoConfig.for_model("xlnet", **{**xlnet_large, **shrink_config(xlnet_large)})
    assert config.d_model // config.n_head == config.d_head


def test_a_layer_cut_the_config_rejects_falls_back_to_widths_only(tmp_path):
    """dory's input + recurrent + output sections must add up to its layer count (config.json stores
    each doubled): cutting layers breaks the config, so the code check keeps every layer and shrinks
    only the widths (found by the --all sweep: "transformers cannot build the shrunk config")."""
    from transformers import AutoConfig

    from agent.testing.tiny_checkpoint import tiny_config

    saved = tiny_config("dory", 384, hidden_size=256, intermediate_size=512).to_dict()
    saved.pop("model_type")
    cut, widths = shrink_config(saved), shrink_config(saved, cut_layers=False)
    assert cut["num_hidden_layers"] < saved["num_hidden_layers"]
    with pytest.raises(Exception, match="must equal num_hidden_layers"):
        AutoConfig.for_model("dory", **{**saved, **cut})
    assert widths["hidden_size"] == 64 and not set(widths) & {"num_hidden_layers", "layer_types"}
    config = AutoConfig.for_model("dory", **{**saved, **widths})
    assert (config.hidden_size, config.num_hidden_layers, config.n_recurrent_layers) == (64, 3, 1)


def test_a_tiny_gemma4_text_is_the_moe_model_upstream_serves():
    """Gemma 4's MoE keys are its own (enable_moe_block, top_k_experts): the type's defaults are dense with
    top_k_experts None, on which upstream's gemma_4 (gemma-4-26B-A4B, 8ep) sizes its MC2 buffer (None + int)."""
    from transformers import AutoConfig

    from agent.testing.tiny_checkpoint import tiny_config

    try:
        AutoConfig.for_model("gemma4_text")
    except (ValueError, KeyError):
        pytest.skip("this transformers has no gemma4_text")
    config = tiny_config("gemma4_text", 384)
    assert config.enable_moe_block is True and config.top_k_experts == 2 and config.num_experts == 4


def test_a_layer_kinds_fewer_key_heads_stay_fewer():
    """gemma-4-26B's full layers' 2 key/value heads beside num_key_value_heads 8 (num_global_key_value_heads, or
    the per_layer_config entries a saved config holds) shrink in proportion, at least 1 — not to the same 2, which
    would leave a file that builds every layer alike unchecked; its top_k_experts shrinks with its experts."""
    from transformers import AutoConfig

    from agent.testing.checkpoint_shapes import checkpoint_config

    try:
        config, _ = checkpoint_config("gemma4_text")
    except (ValueError, KeyError):
        pytest.skip("this transformers has no gemma4_text")
    shrunk = shrink_config(config)          # transformers' saved form: the full layers' entries of per_layer_config
    assert shrunk["num_key_value_heads"] == 2
    assert {values["num_key_value_heads"] for values in shrunk["per_layer_config"].values()} == {1}
    assert (shrunk["num_experts"], shrunk["top_k_experts"]) == (4, 2)
    # a config.json stating the key instead (upstream's configuration_gemma4.py reads it so)
    stated = {key: value for key, value in config.items() if key != "per_layer_config"}
    stated.update(num_global_key_value_heads=2, global_head_dim=512)
    assert shrink_config(stated)["num_global_key_value_heads"] == 1
    built = AutoConfig.for_model("gemma4_text", **{k: v for k, v in {**stated, **shrink_config(stated)}.items()
                                                   if k != "model_type"})
    assert {built.per_layer_config[index].num_key_value_heads for index in range(built.num_hidden_layers)} == {1, 2}


@pytest.mark.parametrize("model_type", ["gemma4_text", "dots3_note_text"])
def test_per_layer_overrides_keep_the_layers_the_cut_keeps_and_shrink_with_the_config(model_type):
    """per_layer_config (keyed by layer index) is a layer kind: the cut holds its first layer, drops the others,
    and its widths are no larger than the shrunk config's; transformers builds the config."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    shrunk = shrink_config(config)
    layers = shrunk["num_hidden_layers"]
    first = min(int(index) for index in config["per_layer_config"])
    assert layers > first and layers < config["num_hidden_layers"]
    kept = shrunk["per_layer_config"]
    assert kept and all(int(index) < layers for index in kept)
    for values in kept.values():
        for key in ("num_attention_heads", "num_key_value_heads", "hidden_size"):
            if key in values:
                assert values[key] <= shrunk.get(key, config[key])
    from agent.recipe.native.parts.probe import shrunk_config

    built = shrunk_config(config)           # the probe's copy (kernel widths kept) validates
    assert sorted(int(index) for index in built.to_dict()["per_layer_config"]) == sorted(int(index) for index in kept)


@pytest.mark.parametrize("model_type, heads, width, expand", [
    ("bamba", "mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("mamba2", "num_heads", "head_dim", "expand"),
    ("falcon_h1", "mamba_n_heads", "mamba_d_head", "mamba_expand"),
])
def test_a_state_space_mixers_heads_tile_its_shrunk_inner_width(model_type, heads, width, expand):
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import shrunk_config

    config = AutoConfig.for_model(model_type).to_dict()
    merged = {**config, **shrink_config(config)}
    assert merged[heads] * merged[width] == merged[expand] * merged["hidden_size"]
    built = shrunk_config(config)           # the probe's copy, head widths restored: still valid
    assert getattr(built, heads) * getattr(built, width) == getattr(built, expand) * built.hidden_size
    if isinstance(config.get("mamba_d_ssm"), int):
        # falcon_h1's inner width set apart from expand: shrunk with the heads (its checkpoints' 3072 would not tile)
        assert built.mamba_d_ssm == getattr(built, heads) * getattr(built, width)
        checkpoint = {**config, "hidden_size": 3072, "mamba_d_ssm": 3072, "mamba_n_heads": 24, "mamba_d_head": 128}
        built = shrunk_config(checkpoint)
        assert built.mamba_d_ssm == built.mamba_n_heads * built.mamba_d_head == built.mamba_expand * built.hidden_size


def test_shrink_keeps_linear_attention_grouping_and_kernel_widths():
    """qwen3_next's Gated DeltaNet heads: 2 key heads, each value-head group kept (16 / 32 -> 2 / 4), the head
    widths the NPU ops constrain kept; a config whose value heads do not group by key heads is left alone."""
    qwen3_next = {"hidden_size": 2048, "num_hidden_layers": 48, "linear_num_key_heads": 16,
                  "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
    shrunk = shrink_config(qwen3_next)
    assert (shrunk["linear_num_key_heads"], shrunk["linear_num_value_heads"]) == (2, 4)
    assert "linear_key_head_dim" not in shrunk and "linear_value_head_dim" not in shrunk
    assert "linear_num_key_heads" not in shrink_config({**qwen3_next, "linear_num_value_heads": 24 + 1})
    assert "linear_num_key_heads" not in shrink_config({**qwen3_next, "linear_num_key_heads": 2})
