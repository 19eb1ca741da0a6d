"""Family settings the parts read that failed their self-check jobs (#46): cohere2_moe's dense-MLP layers rotate
where prefix_dense_sliding_window_pattern is 1 (parts/rotary_nope.py sliding_or_dense_prefix), hy_v3's shared
experts where their count is 0 are transformers' shared MLP of intermediate_size (parts/moe.py
shared_width_without_count), deepseek_v2's and ernie4_5_moe's shared experts and ernie's output head take biases by
mlp_bias / use_bias (parts/moe.py shared_bias, parts/head.py head_bias), and ministral3's position-scaled attention
is the fused attention's QUERY_POSITION_SCALE (parts/attention_positions.py; any other form refused). The readings
in-process here; each file against transformers on that setting, with a fault that must fail, in the slow test at
the bottom."""

from __future__ import annotations

import pytest

from part_selfcheck import SNAPSHOT


def _config(model_type: str):
    """transformers' config of the type's checkpoint shape (agent.testing.checkpoint_shapes), else its defaults."""
    from transformers import AutoConfig

    from agent.testing.checkpoint_shapes import checkpoint_config

    shaped = checkpoint_config(model_type)
    data = dict(shaped[0]) if shaped is not None else {}
    data.pop("model_type", None)
    return AutoConfig.for_model(model_type, **data)


def _probe(model_type: str, **changes):
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    return Probe(AutoConfig.for_model(model_type, **changes).to_dict())


def test_cohere2_moe_dense_layers_rotate_and_a_rule_that_ignores_them_is_not_taken():
    from agent.recipe.native.parts.rotary_nope import _rule_holds, flipped_mlp_kinds, nope_rule, rule_toggles

    probe = _probe("cohere2_moe")
    assert set(probe.config.mlp_layer_types) == {"sparse"}
    assert nope_rule(probe) == "sliding_or_dense_prefix"
    # global_nope gives the same layers on this config, and not once the layers are dense: the toggle tells them apart
    assert _rule_holds("global_nope", probe)
    flipped = probe.variant({"mlp_layer_types": flipped_mlp_kinds(probe.config)})
    assert not _rule_holds("global_nope", flipped) and _rule_holds("sliding_or_dense_prefix", flipped)
    assert rule_toggles("sliding_or_dense_prefix", probe.config)[-1]["prefix_dense_sliding_window_pattern"] == 2
    assert rule_toggles("global_nope", _probe("exaone4").config) == []     # no MLP kinds: nothing to turn over


@pytest.mark.parametrize("model_type, count_key, width", [
    ("hy_v3", "num_shared_experts", "intermediate_size"),     # HYV3MLP(width or config.intermediate_size)
    ("deepseek_v3", "n_shared_experts", None),                # a shared MLP of width 0: none
])
def test_the_shared_width_where_the_count_is_0_is_read_off_the_block(model_type, count_key, width):
    from agent.recipe.native.parts import moe

    config = _config(model_type)
    block_cls = moe._sparse_blocks(config)[1]
    expr = f"config.moe_intermediate_size * config.{count_key}"
    assert moe.shared_width_without_count(config, block_cls, "shared_experts", expr) == width
    assert moe.shared_width_without_count(config, block_cls, "shared_experts", "config.intermediate_size") is None


@pytest.mark.parametrize("model_type, bias", [("deepseek_v2", "config.mlp_bias"), ("ernie4_5_moe", "config.use_bias"),
                                              ("deepseek_v3", None)])
def test_the_shared_experts_biases_follow_the_key_that_sets_them(model_type, bias):
    from agent.recipe.native.parts import moe
    from agent.recipe.native.parts.part import Expr

    from agent.recipe.native.parts.mlp import BIAS_KEYS

    assert moe.SHARED_BIAS_KEYS == BIAS_KEYS
    config = _config(model_type)
    block_cls = moe._sparse_blocks(config)[1]
    _, block, _ = moe._probe_block(config, block_cls)
    found = moe.shared_bias(config, block_cls, block, "shared_experts")
    assert found == (Expr(bias) if bias else False)


def test_the_output_heads_bias_follows_use_bias():
    from agent.recipe.native.parts.head import head_bias
    from agent.recipe.native.parts.part import Expr

    assert head_bias(_probe("ernie4_5_moe")) == Expr("config.use_bias")
    assert head_bias(_probe("ernie4_5")) is False           # its dense sibling: use_bias sets no head bias
    assert head_bias(_probe("llama")) is False


def _llama4_faults():
    import torch

    return {  # transformers' formula with one piece changed: each must be refused
        "floor dropped": lambda positions, beta, original: 1 + beta * torch.log(1 + positions / original),
        "log without 1 +": lambda positions, beta, original: 1 + beta * torch.log(
            torch.floor(positions / original).clamp_min(1)),
        "beta doubled": lambda positions, beta, original: 1 + 2 * beta * torch.log(
            1 + torch.floor(positions / original)),
    }


def _shaped_as(original_fn, formula):
    """`formula` in the shape transformers' own function gives (5.0 takes cache_position, later position_ids)."""
    return lambda positions, beta, original: formula(positions, beta, original).reshape(
        original_fn(positions, beta, original).shape)


def test_the_llama4_query_scaling_is_read_and_any_other_position_scaling_refused(monkeypatch):
    """ministral3's attention scales its queries by 1 + beta log(1 + floor(position / original)): read (the fused
    attention's QUERY_POSITION_SCALE), with the family setting that brings the scaling within the self-check's
    prompts; the same attention with that formula changed is refused; an attention that takes position_ids and
    follows none is not scaled."""
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_positions import (SMALL_ORIGINAL, _position_args,
                                                               query_position_scale, small_original_setting)

    probe = _probe("ministral3")
    assert query_position_scale(probe, 0) is True
    setting = small_original_setting(probe.config)["rope_parameters"]
    assert setting["original_max_position_embeddings"] == SMALL_ORIGINAL
    assert setting["llama_4_scaling_beta"] == probe.config.rope_parameters["llama_4_scaling_beta"]
    checked = 0
    for other in ("stablelm", "mistral"):       # take positions (for flash attention, the cache), follow none
        try:
            plain = _probe(other)
        except NotNative:
            continue                            # stablelm under transformers 5.0
        if _position_args(plain.layers[0].self_attn):
            assert query_position_scale(plain, 0) is False
            checked += 1
    assert checked

    import transformers.models.ministral3.modeling_ministral3 as modeling

    name = next(n for n in ("get_llama_4_attn_scale", "_get_llama_4_attn_scale") if hasattr(modeling, n))
    fault = _llama4_faults()["floor dropped"]
    monkeypatch.setattr(modeling, name, _shaped_as(getattr(modeling, name), fault))
    with pytest.raises(NotNative, match="not as the llama-4 query scaling"):
        query_position_scale(_probe("ministral3"), 0)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["log without 1 +", "beta doubled"])
def test_other_position_scalings_are_refused(monkeypatch, fault):
    """The other changed formulas (default case: floor dropped, above)."""
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_positions import query_position_scale
    import transformers.models.ministral3.modeling_ministral3 as modeling

    name = next(n for n in ("get_llama_4_attn_scale", "_get_llama_4_attn_scale") if hasattr(modeling, n))
    formula = _llama4_faults()[fault]
    monkeypatch.setattr(modeling, name, _shaped_as(getattr(modeling, name), formula))
    with pytest.raises(NotNative, match="not as the llama-4 query scaling"):
        query_position_scale(_probe("ministral3"), 0)


# type: (the setting's label prefix, (text of the correct file, its faulty replacement))
SETTINGS = {
    "cohere2_moe": ("mlp_layer_types flipped", (
        '\n            or config.mlp_layer_types[layer_idx] == "dense" and config.prefix_dense_sliding_window_pattern == 1',
        "")),
    "hy_v3": ("num_shared_experts 0", (" \\\n            or config.intermediate_size", "")),
    "deepseek_v2": ("bias mlp_bias", ("[width] * 2, bias=config.mlp_bias", "[width] * 2, bias=False")),
    "ernie4_5_moe": ("bias use_bias", ("output_size=config.vocab_size, bias=config.use_bias",
                                       "output_size=config.vocab_size, bias=False")),
    # the floor dropped from the llama-4 query scaling: wrong from position 1 on an original context of 4
    "ministral3": ("query scaling original_max_position_embeddings", (
        "torch.floor(positions[:q_len].float() / self.query_scale_original)",
        "(positions[:q_len].float() / self.query_scale_original)")),
}


@pytest.mark.slow
@pytest.mark.skipif(not SNAPSHOT.is_dir(), reason="needs the upstream snapshot")
def test_each_setting_matches_transformers_and_its_fault_fails(tmp_path):
    """One stand-in process: each type's file on the setting that failed (and cohere2_moe's pattern 2), within the
    tolerance; the file with that reading undone fails the same job. Default-suite coverage of the readings: the
    tests above."""
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs
    from agent.testing.checkpoint_shapes import checkpoint_config
    from part_selfcheck import ctx
    from transformers import AutoConfig

    rows = []
    for model_type, (label, (correct, faulty)) in SETTINGS.items():
        shaped = checkpoint_config(model_type)
        config = shaped[0] if shaped is not None else AutoConfig.for_model(model_type).to_dict()
        composition = derive(config)
        text = render_native(ctx(model_type, "VsForCausalLM"), composition)
        assert text.count(correct) >= 1, (model_type, correct)
        for name, body in (("good", text), ("fault", text.replace(correct, faulty))):
            path = tmp_path / f"{model_type}_{name}.py"
            path.write_text(body)
            jobs = [(lab, job) for lab, job in selfcheck_jobs(config, composition.checked_variants, str(path),
                                                                "VsForCausalLM")
                    if lab.startswith(label) or (name == "good" and lab.startswith("nope prefix_dense"))]
            assert jobs, (model_type, label)
            rows += [(model_type, name, lab, job) for lab, job in jobs]
    results = selfcheck([job for *_, job in rows], SNAPSHOT)
    for (model_type, name, label, _), result in zip(rows, results):
        assert result["ok"] is (name == "good"), (model_type, name, label, result)
