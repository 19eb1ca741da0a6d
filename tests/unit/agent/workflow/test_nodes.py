"""agent/workflow/nodes.py: a node run alone on a state."""

from __future__ import annotations

import pytest


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


def test_the_state_carries_one_run_plan_and_a_standin_plan_is_kept_as_the_input_step_made_it(tmp_path, monkeypatch):
    """--standin's plan is the state's `run_plan` (no second copy): the nodes run it as it is, the baseline is named
    and placed as a stand-in one, and the report names it with its notes; a plan without `standin` (classify's or
    render's) is no stand-in run, and a state without one is planned (once, by agent.run.plan)."""
    import json
    import typing

    from agent.workflow import nodes, report
    from agent.workflow.state import MigrationState, standin_run

    assert [k for k in typing.get_type_hints(MigrationState) if "plan" in k or "standin" in k] == ["run_plan"]
    yaml = tmp_path / "r" / "config" / "r.yaml"
    standin = {"yaml": str(yaml), "world_size": 1, "source_yaml": str(yaml), "checkpoint": None, "standin": "cpu",
               "tiny": True, "model_type": "qwen3", "max_new_tokens": 16, "notes": ["a tiny random qwen3 checkpoint"],
               "parallel": None}
    planned = []

    class Planned(Exception):
        pass

    def plan_again(*args, **kw):
        planned.append(args)
        raise Planned

    monkeypatch.setattr(nodes.run_plan, "plan_run", plan_again)
    assert standin_run({"run_plan": standin}) and nodes.plan_run(None, {"run_plan": standin}) == standin
    assert not planned
    own = {**standin, "standin": None, "tiny": False, "notes": []}
    assert not standin_run({"run_plan": own}) and not standin_run({})
    with pytest.raises(Planned):         # not the stand-in's: the recipe's own plan is made
        nodes.plan_run(None, {"run_plan": own})
    assert len(planned) == 1
    (tmp_path / "r").mkdir()
    for plan, named in ((standin, True), (own, False)):
        report.write_report({"recipe_dir": str(tmp_path / "r"), "run_plan": plan, "status": "ok"})
        written = json.loads(report.report_path(tmp_path / "r").read_text())
        assert ("upstream_standin" in written) is named, written
        if named:
            assert written["upstream_standin"]["notes"] == ["a tiny random qwen3 checkpoint"]
