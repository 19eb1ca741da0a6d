"""agent/workflow/nodes.py: a node run alone on a state."""

from __future__ import annotations


def test_classify_node_alone_gives_a_for_a_checkpoint(tiny_checkpoints):
    from agent.workflow.nodes import node_classify

    result = node_classify({"target": str(tiny_checkpoints("llama"))}, {})
    assert result["scenario"] == "A" and "no infer.sh" in result["classify_reason"]


def test_acquire_converts_a_checkpoint_the_npu_cannot_compute_and_render_documents_it(tmp_path):
    """acquire -> vendor -> render on the Qwen3-8B-FP8 form, in-process: the recipe's checkpoint is the bf16
    conversion in its state folder, vendoring reads the converted config, the README says what was converted
    and the command that redoes it (the whole migration with its trial run and precision check:
    tests/e2e/test_quantized_checkpoints.py, slow)."""
    import json

    import quantized_checkpoints as forms
    from agent import folder_lock
    from agent.workflow.nodes import node_acquire, node_render, node_vendor

    src, _ = forms.qwen3_fp8(tmp_path / "Qwen3-8B-FP8")
    (tmp_path / "models").mkdir()        # the input step makes the output folder
    state = {"target": str(src), "output_dir": str(tmp_path / "models"), "recipe_target": "standalone",
             "transformers_source": None}
    with folder_lock.released_at_end():
        state.update(node_acquire(state))
        recipe = tmp_path / "models" / "qwen3_8b_fp8"
        converted = recipe / ".migrator" / "checkpoints" / "bfloat16"
        assert state["model_dir"] == str(converted) == state["conversion"]["path"]
        assert state["conversion"]["command"] == f"migrator convert {src} {converted}"   # it names no code
        assert "quantization_config" not in json.loads((converted / "config.json").read_text())
        state.update(node_vendor(state))
        assert state["vendored"]["model_class"] == "Qwen3ForCausalLM"
        state.update(node_render(state, config={"configurable": {"device": "cpu"}}))
    readme = (recipe / "README.md").read_text()
    assert "## 权重转换" in readme and state["conversion"]["command"] in readme and str(converted) in readme


def test_the_auto_map_note_reaches_the_vendored_record_when_the_run_checkpoint_drops_the_auto_map(tmp_path):
    import json

    import quantized_checkpoints as forms
    from agent import folder_lock
    from agent.workflow.nodes import node_acquire, node_vendor

    src, _ = forms.deepseek_v3_fp8(tmp_path / "DeepSeek-V3")
    (tmp_path / "models").mkdir()
    state = {"target": str(src), "output_dir": str(tmp_path / "models"), "recipe_target": "standalone",
             "transformers_source": None}
    with folder_lock.released_at_end():
        state.update(node_acquire(state))
        assert "auto_map" not in json.loads((tmp_path / "models" / "deepseek_v3" / ".migrator" / "checkpoints" / "bfloat16" / "config.json").read_text())
        state.update(node_vendor(state))
    assert state["vendored"]["model_class"] == "DeepseekV3ForCausalLM"
    assert "served by transformers' own class" in state["vendored"]["auto_map_note"]
    assert not (src / forms.REMOTE_CODE_MARKER).exists()
