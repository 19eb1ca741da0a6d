"""agent/workflow/nodes.py: a node run alone on a state."""

from __future__ import annotations


def test_classify_node_alone_gives_a_for_a_checkpoint(tiny_checkpoints):
    from agent.workflow.nodes import node_classify

    result = node_classify({"target": str(tiny_checkpoints("llama"))}, {})
    assert result["scenario"] == "A" and "no infer.sh" in result["classify_reason"]
