"""Switches of upstream's models that only some parts of the native generator honour (agent/recipe/native/
preflight.py SWITCHES): set where the generated file has no part that reads them, they are refused in one line
before any rank starts, at the one place the run's YAML is checked against the generated file (preflight.check,
which Recipe.run_plan and agent.run.plan call). Each row of the table is tried with a fault (switch set, part
absent: refused) and a pass (the part present, or the switch off), on files the generator writes from real
configs (a dense llama; DeepSeek-V3 with MLA, sparse-MoE layers and an MTP layer; DeepSeek-V3 without q LoRA,
every layer dense, no MTP layer; qwen3_moe, fused attention beside sparse-MoE layers; gemma2, soft-capped
attention). In-process; the slow runs that hold each honoured switch per step are test_mla_features.py's (enable_mla_prolog, moe_chunk_max_len), test_mtp.py's (next_n) and
tests/e2e/test_context_parallel.py's (cp_size; in process: test_context_parallel.py)."""

from __future__ import annotations

import json

import pytest

from agent.recipe.native.assemble import CODE_DIR
from agent.recipe.native.preflight import SWITCHES, check, names_read, switch_problem

CTX = {"model_name": "tiny_switches", "framework_class": "TinySwitchesForCausalLM", "display_name": "switches",
       "model_class": "ForCausalLM", "transformers_version": "5.0.0"}
# model -> its config: what the file is written from
MODELS = {
    "llama": ("llama", {}),
    # MLA with q LoRA on every layer, sparse-MoE layers from layer 1, one MTP layer
    "deepseek_v3": ("deepseek_v3", {"first_k_dense_replace": 1, "num_nextn_predict_layers": 1}),
    # MLA whose query is one q_proj (no prolog), every layer dense, no MTP layer
    "deepseek_v3_plain": ("deepseek_v3", {"q_lora_rank": None, "first_k_dense_replace": 1000,
                                          "num_nextn_predict_layers": 0}),
    # fused attention beside sparse-MoE layers; soft-capped attention (plain torch over the paged cache)
    "qwen3_moe": ("qwen3_moe", {}),
    "gemma2": ("gemma2", {}),
}


@pytest.fixture(scope="module")
def sources():
    from transformers import AutoConfig

    from agent.recipe.native.assemble import write
    from agent.recipe.native.compose import derive

    return {name: write(derive({**AutoConfig.for_model(kind).to_dict(), **changes}), CTX)
            for name, (kind, changes) in MODELS.items()}


def custom(**params) -> dict:
    return {"model_config": {"custom_params": params}}


C8 = {"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {"type": "int", "num_bits": 8}}}
# (model, YAML settings, checkpoint config, the switch refused or None)
CASES = [
    # enable_mla_prolog: an MLA attention with q LoRA (npu_mla_prolog_v3), and NZ weights (upstream's condition)
    ("llama", custom(enable_mla_prolog=True), {}, "enable_mla_prolog"),
    ("deepseek_v3_plain", custom(enable_mla_prolog=True), {}, "enable_mla_prolog"),
    ("deepseek_v3", custom(enable_mla_prolog=True), {}, None),
    ("deepseek_v3", {"model_config": {"enable_weight_nz": False, "custom_params": {"enable_mla_prolog": True}}}, {},
     "enable_weight_nz"),
    ("llama", custom(enable_mla_prolog=False), {}, None),
    # next_n: an MTP draft
    ("llama", {"model_config": {"next_n": 1}}, {}, "next_n"),
    ("deepseek_v3_plain", {"model_config": {"next_n": 2}}, {}, "next_n"),
    ("deepseek_v3", {"model_config": {"next_n": 1}}, {}, None),
    ("llama", {"model_config": {"next_n": 0}}, {}, None),
    # moe_chunk_max_len: sparse-MoE layers
    ("llama", custom(moe_chunk_max_len=1024), {}, "moe_chunk_max_len"),
    ("deepseek_v3_plain", custom(moe_chunk_max_len=65536), {}, "moe_chunk_max_len"),
    ("deepseek_v3", custom(moe_chunk_max_len=16), {}, None),
    # the int8 KV cache (upstream's C8, from the checkpoint's kv_cache_scheme): no part writes it
    ("deepseek_v3", custom(enable_mla_prolog=True), C8, "kv_cache_scheme"),
    ("llama", {}, {"quantization_config": {**C8["quantization_config"], "kv_cache_scheme": {}}}, "kv_cache_scheme"),
    ("deepseek_v3", {}, {"quantization_config": {**C8["quantization_config"], "kv_cache_scheme": None}}, None),
    # read by the format reader (agent.quantization_formats): compressed-tensors' older compression_config too, and
    # a quantization_config that is no object is no cache scheme
    ("llama", {}, {"compression_config": C8["quantization_config"]}, "kv_cache_scheme"),
    ("llama", {}, {"quantization_config": "int8"}, None),
    # cp_size: the dense fused attention reads the executor's prefill context-parallel segments (cp_metadata);
    # MLA (deepseek_v3_plain: dense layers) and sparse-MoE layers (qwen3_moe: fused attention) do not
    ("llama", {"parallel_config": {"world_size": 2, "attn_tp_size": 1, "cp_size": 2}}, {}, None),
    ("deepseek_v3_plain", {"parallel_config": {"world_size": 2, "attn_tp_size": 1, "cp_size": 2}}, {}, "cp_size"),
    ("deepseek_v3", {"parallel_config": {"world_size": 4, "attn_tp_size": 1, "cp_size": 4}}, {}, "cp_size"),
    ("qwen3_moe", {"parallel_config": {"world_size": 2, "attn_tp_size": 1, "cp_size": 2}}, {}, "cp_size"),
    ("gemma2", {"parallel_config": {"world_size": 2, "attn_tp_size": 1, "cp_size": 2}}, {}, "cp_size"),
    ("llama", {"parallel_config": {"world_size": 2, "cp_size": 1}}, {}, None),
    # everything deepseek_v3's file honours, at once
    ("deepseek_v3", {"model_config": {"next_n": 1, "enable_weight_nz": True,
                                      "custom_params": {"enable_mla_prolog": True, "moe_chunk_max_len": 16}}}, {}, None),
]


@pytest.mark.parametrize("model,settings,config,refused", CASES,
                         ids=[f"{c[0]}-{c[3] or 'ok'}-{i}" for i, c in enumerate(CASES)])
def test_a_switch_the_file_does_not_honour_is_refused_in_one_line(sources, model, settings, config, refused):
    problem = switch_problem(settings, config, sources[model], model)
    if refused is None:
        assert problem is None, problem
        return
    assert problem is not None and refused in problem and "\n" not in problem, problem
    # names what to do
    assert any(word in problem for word in ("remove", "set ", "use ")), problem


def test_every_switch_of_the_table_has_a_fault_and_a_pass():
    """A row added to SWITCHES without cases here fails: each switch is refused somewhere and passes somewhere."""
    for switch in SWITCHES:
        name = switch.path[-1]

        def sets(case):
            source = case[1] if switch.where == "yaml" else case[2]
            for key in switch.path:
                source = source.get(key) if isinstance(source, dict) else None
            return switch.is_set(source)

        assert any(case[3] == name for case in CASES), name
        # a pass wherever some part's code reads the switch (none reads the int8 cache's yet)
        if any(f'"{switch.reads}"' in code.read_text() or f".{switch.reads}" in code.read_text()
               for code in CODE_DIR.glob("*.py")):
            assert any(case[3] is None and sets(case) for case in CASES), name


def test_the_generated_files_read_what_their_parts_honour(sources):
    """The table's `reads` is what the parts' code reads: present exactly where the part is."""
    read = {model: names_read(text) for model, text in sources.items()}
    assert {"enable_mla_prolog", "next_n", "moe_chunk_max_len"} <= read["deepseek_v3"]
    assert not {"enable_mla_prolog", "next_n", "moe_chunk_max_len", "kv_cache_quant_mode"} & read["llama"]
    assert not {"enable_mla_prolog", "next_n", "moe_chunk_max_len"} & read["deepseek_v3_plain"]
    assert "cp_metadata" in read["llama"]
    assert not {"cp_metadata"} & (read["deepseek_v3"] | read["deepseek_v3_plain"] | read["qwen3_moe"] | read["gemma2"])
    # a docstring that names a switch is not a part reading it
    assert "next_n" not in names_read('"""next_n"""\n\n\ndef f():\n    """next_n"""\n    return 1\n')
    assert "next_n" in names_read('def f(c):\n    return c.get("next_n", 0)\n')


def test_the_run_is_refused_before_it_starts_with_the_yaml_named(sources, tmp_path):
    """preflight.check, the one place both run paths go through: a native recipe folder and its checkpoint."""
    from agent.errors import InputError

    recipe, checkpoint = tmp_path / "tiny_switches", tmp_path / "ckpt"
    (recipe / "models").mkdir(parents=True)
    checkpoint.mkdir()
    (recipe / "models" / "modeling_tiny_switches.py").write_text(sources["llama"])
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    settings = {"parallel_config": {"world_size": 1}, "model_config": {"next_n": 1}}
    with pytest.raises(InputError) as caught:
        check(recipe, checkpoint, settings, "config/tiny.yaml")
    assert str(caught.value).startswith("config/tiny.yaml: model_config.next_n is set (1)"), caught.value
    assert InputError.exit_code != 0
    settings["model_config"]["next_n"] = 0
    check(recipe, checkpoint, settings, "config/tiny.yaml")


def test_the_int8_cache_refusal_names_its_first_blocker(sources):
    """C8's refusal says what stops it, not only that no part exists: upstream's prolog documents
    kv_cache_quant_mode 1 only with W8A8 weights, and the fused attention's full-quant MLA form it feeds
    (query_quant_mode 3) has no documented arithmetic (docs/quantization.md, "MLA's int8 KV cache")."""
    problem = switch_problem(custom(enable_mla_prolog=True), C8, sources["deepseek_v3"], "deepseek_v3")
    assert problem is not None and "\n" not in problem, problem
    for blocker in ("kv_cache_quant_mode 1", "W8A8", "npu_fused_infer_attention_score_v2",
                    "query_quant_mode 3", "does not compute it"):
        assert blocker in problem, (blocker, problem)
    # the same checkpoint without its kv_cache_scheme runs (a float cache)
    float_cache = {"quantization_config": {**C8["quantization_config"], "kv_cache_scheme": None}}
    assert switch_problem(custom(enable_mla_prolog=True), float_cache, sources["deepseek_v3"], "deepseek_v3") is None
