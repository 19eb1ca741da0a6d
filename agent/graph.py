"""The workflow graph of SPEC §2 (LangGraph StateGraph).

detect_env -> classify -> A: acquire -> vendor -> render -> trial_run
                          B: -------------------------------> diagnose -> repair -> trial_run
                          C: collect_baseline
trial_run -> ok: collect_baseline | fail: diagnose -> OOM: estimate_memory -> report | repair (<= max_rounds)
collect_baseline -> verify -> report
"""

from __future__ import annotations

from langgraph.graph import END, START, StateGraph

from agent import nodes
from agent.nodes import MigrationState

DEFAULT_MAX_ROUNDS = 5


def after_classify(state: MigrationState) -> str:
    return {"A": "acquire", "B": "diagnose", "C": "collect_baseline"}[state["scenario"]]


def after_trial_run(state: MigrationState) -> str:
    """A run that worked is measured; any other goes to diagnose (out of memory included: a rule)."""
    return "collect_baseline" if nodes.last_run(state).get("ok") else "diagnose"


def after_verify(state: MigrationState) -> str:
    run = nodes.last_run(state)
    return "diagnose" if run.get("label") == "verify" and not run.get("ok") else "report"


def after_diagnose(state: MigrationState) -> str:
    rounds = state.get("rounds") or []
    if rounds and rounds[-1]["diagnosis"].get("oom"):     # the out_of_memory rule matched
        return "estimate_memory"
    if len(rounds) > state.get("max_rounds", DEFAULT_MAX_ROUNDS):
        return "give_up"
    # Stop early when the same failure repeats after a fix: the fix did not help.
    if len(rounds) >= 2 and rounds[-1]["diagnosis"]["signature"] == rounds[-2]["diagnosis"]["signature"]:
        return "give_up"
    if rounds[-1]["diagnosis"].get("rule") is None:
        return "give_up"     # no rule knows this failure: report it precisely
    return "repair"


def after_repair(state: MigrationState) -> str:
    """Nothing changed (a report-only rule, or a fix that could not apply): re-running is pointless."""
    return "trial_run" if state["rounds"][-1].get("applied") else "give_up"


def node_give_up(state: MigrationState) -> dict:
    last = state["rounds"][-1]
    diagnosis = last["diagnosis"]
    where = f" at {diagnosis['location']}" if diagnosis.get("location") else ""
    # A rule that only reports (e.g. the pip install line) says what to do in its note.
    note = f"; {last['note']}" if last.get("note") and last.get("note") != "no repair rule matched" else ""
    return {"status": "failed", "message": f"{diagnosis['diagnosis']}{where}{note}"}


def build_graph(wrap=None) -> StateGraph:
    """The uncompiled graph; `wrap(name, fn)` may decorate every node (e.g. progress output)."""
    graph = StateGraph(MigrationState)
    add_node = graph.add_node
    graph.add_node = lambda name, fn: add_node(name, wrap(name, fn) if wrap else fn)
    graph.add_node("detect_env", nodes.node_detect_env)
    graph.add_node("classify", nodes.node_classify)
    graph.add_node("acquire", nodes.node_acquire)
    graph.add_node("vendor", nodes.node_vendor)
    graph.add_node("render", nodes.node_render)
    graph.add_node("trial_run", nodes.node_trial_run)
    graph.add_node("diagnose", nodes.node_diagnose)
    graph.add_node("repair", nodes.node_repair)
    graph.add_node("estimate_memory", nodes.node_estimate_memory)
    graph.add_node("give_up", node_give_up)
    graph.add_node("collect_baseline", nodes.node_collect_baseline)
    graph.add_node("verify", nodes.node_verify)
    graph.add_node("report", nodes.node_report)

    graph.add_edge(START, "detect_env")
    graph.add_edge("detect_env", "classify")
    graph.add_conditional_edges("classify", after_classify, ["acquire", "diagnose", "collect_baseline"])
    graph.add_edge("acquire", "vendor")
    graph.add_edge("vendor", "render")
    graph.add_edge("render", "trial_run")
    graph.add_conditional_edges("trial_run", after_trial_run,
                                ["collect_baseline", "estimate_memory", "diagnose"])
    graph.add_conditional_edges("diagnose", after_diagnose, ["repair", "estimate_memory", "give_up"])
    graph.add_conditional_edges("repair", after_repair, ["trial_run", "give_up"])
    graph.add_edge("estimate_memory", "report")
    graph.add_edge("give_up", "report")
    graph.add_edge("collect_baseline", "verify")
    graph.add_conditional_edges("verify", after_verify, ["diagnose", "report"])
    graph.add_edge("report", END)
    graph.add_node = add_node
    return graph
