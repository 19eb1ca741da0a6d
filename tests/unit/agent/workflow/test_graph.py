"""agent/workflow/graph.py, the LangGraph workflow as data: its nodes and edges as the spec draws them, the
reducers of what nodes return, and the pure routing functions after a trial run, a diagnosis and a repair."""

from __future__ import annotations


# ---- graph structure and routing functions (no model needed) ------------------------------
def test_graph_has_the_nodes_and_edges_of_the_spec():
    from agent.workflow.graph import build_graph

    graph = build_graph().compile().get_graph()
    edges = {(e.source, e.target) for e in graph.edges}
    for edge in [("__start__", "detect_env"), ("detect_env", "classify"), ("classify", "acquire"),
                 ("classify", "diagnose"), ("classify", "collect_baseline"), ("acquire", "vendor"),
                 ("vendor", "decide_native"), ("decide_native", "render"), ("render", "trial_run"), ("trial_run", "collect_baseline"),
                 ("trial_run", "diagnose"), ("diagnose", "repair"), ("diagnose", "estimate_memory"),
                 ("repair", "trial_run"), ("collect_baseline", "verify"), ("verify", "report"),
                 ("estimate_memory", "report"), ("report", "__end__")]:
        assert edge in edges, edge


def test_runs_and_rounds_are_reduced_from_the_new_items_nodes_return():
    """Nodes return only new items: runs are appended, a round's repair completes its diagnosis."""
    from langgraph.graph import END, START, StateGraph

    from agent.workflow.state import MigrationState

    graph = StateGraph(MigrationState)
    graph.add_node("run", lambda state: {"runs": [{"label": f"trial{len(state['runs'])}"}]})
    graph.add_node("diagnose", lambda state: {"rounds": [{"round": len(state["rounds"]) + 1, "diagnosis": "d"}]})
    graph.add_node("repair", lambda state: {"rounds": [dict(state["rounds"][-1], applied=True)]})
    for source, target in [(START, "run"), ("diagnose", "repair"), ("repair", "run")]:
        graph.add_edge(source, target)
    graph.add_conditional_edges("run", lambda state: END if len(state["runs"]) == 3 else "diagnose")
    final = graph.compile().invoke({"target": "t"})
    assert [r["label"] for r in final["runs"]] == ["trial0", "trial1", "trial2"]
    assert final["rounds"] == [{"round": 1, "diagnosis": "d", "applied": True},
                               {"round": 2, "diagnosis": "d", "applied": True}]


def _state_with_run(tmp_path, ok, output=""):
    out = tmp_path / "output.txt"
    out.write_text(output)
    return {"runs": [{"ok": ok, "output_file": str(out)}]}


def test_after_trial_run_routes_success_failure_and_oom(tmp_path):
    from agent.workflow.graph import after_diagnose, after_trial_run
    from agent.repair.diagnose import diagnose

    assert after_trial_run(_state_with_run(tmp_path, True)) == "collect_baseline"
    assert after_trial_run(_state_with_run(tmp_path, False, "ValueError: bad")) == "diagnose"
    # Out of memory is a rule: the failed run goes to diagnose, its diagnosis to the memory estimate.
    oom = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
    for output in (oom, "torch.OutOfMemoryError: CUDA out of memory."):
        state = _state_with_run(tmp_path, False, output)
        assert after_trial_run(state) == "diagnose"
        diagnosis = diagnose(tmp_path, state["runs"][-1])
        assert diagnosis["rule"] == "out_of_memory" and diagnosis["oom"]
        assert after_diagnose({"rounds": [{"diagnosis": diagnosis}]}, {"configurable": {"max_rounds": 0}}) == "estimate_memory"
    bad = diagnose(tmp_path, _state_with_run(tmp_path, False, "ValueError: bad")["runs"][-1])
    assert not bad["oom"] and after_diagnose({"rounds": [{"diagnosis": bad}]}, {"configurable": {"max_rounds": 5}}) == "give_up"


def _round(signature, rule="some_rule"):
    return {"diagnosis": {"signature": signature, "rule": rule, "diagnosis": signature}}


def test_after_diagnose_counts_rounds_and_stops_on_repeats():
    from agent.workflow.graph import after_diagnose

    assert after_diagnose({"rounds": [_round("a")]}, {"configurable": {"max_rounds": 5}}) == "repair"
    assert after_diagnose({"rounds": [_round("a"), _round("b")]}, {"configurable": {"max_rounds": 5}}) == "repair"
    assert after_diagnose({"rounds": [_round("a"), _round("a")]}, {"configurable": {"max_rounds": 5}}) == "give_up"
    # the same failure, now taken by another rule (the first fix removed what it matched): that rule runs
    assert after_diagnose({"rounds": [_round("a", "r1"), _round("a", "r2")]}, {"configurable": {"max_rounds": 5}}) == "repair"
    assert after_diagnose({"rounds": [_round("a", "r1"), _round("a", "r2"), _round("a", "r1")]},
                          {"configurable": {"max_rounds": 5}}) == "give_up"
    assert after_diagnose({"rounds": [_round(str(i)) for i in range(6)]}, {"configurable": {"max_rounds": 5}}) == "give_up"
    assert after_diagnose({"rounds": [_round("x", rule=None)]}, {"configurable": {"max_rounds": 5}}) == "give_up"


def test_after_repair_reruns_only_when_something_changed():
    from agent.workflow.graph import after_repair

    assert after_repair({"rounds": [{"applied": True}]}) == "trial_run"
    assert after_repair({"rounds": [{"applied": False, "note": "pip install einops"}]}) == "give_up"
