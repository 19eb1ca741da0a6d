"""The workflow graph of SPEC §2 (LangGraph StateGraph).

detect_env -> classify -> A: acquire -> vendor -> decide_native -> render -> trial_run
                          B: ------------------------------------------------> diagnose -> repair -> trial_run
                          C: collect_baseline
trial_run -> ok: collect_baseline | fail: diagnose -> OOM: estimate_memory -> report | repair (<= max_rounds)
collect_baseline -> verify -> report

Routing functions read the state (and the run options of the graph's config) and name the next node;
the nodes are agent.workflow.nodes; the graph is run (checkpoints, --resume) by
agent.workflow.run.run_migration.
"""

from __future__ import annotations

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from agent.workflow import nodes
from agent.workflow.state import MigrationState, last_run, run_options


def after_classify(state: MigrationState) -> str:
    return {"A": "acquire", "B": "diagnose", "C": "collect_baseline"}[state["scenario"]]


def after_trial_run(state: MigrationState) -> str:
    """A run that worked is measured; any other goes to diagnose (out of memory included: a rule)."""
    return "collect_baseline" if last_run(state).get("ok") else "diagnose"


def after_verify(state: MigrationState) -> str:
    run = last_run(state)
    return "diagnose" if run.get("label") == "verify" and not run.get("ok") else "report"


def after_diagnose(state: MigrationState, config: RunnableConfig) -> str:
    rounds = state.get("rounds") or []
    if rounds and rounds[-1]["diagnosis"].get("oom"):     # the out_of_memory rule matched
        return "estimate_memory"
    if len(rounds) > run_options(config)["max_rounds"]:
        return "give_up"
    # Stop early when the same failure repeats after a fix: the fix did not help. Unless another rule
    # now takes it (the first one's fix removed what it matched): that rule has not been tried on it.
    last = rounds[-1]["diagnosis"]
    if len(rounds) >= 2 and last["signature"] == rounds[-2]["diagnosis"]["signature"]:
        tried = {r["diagnosis"].get("rule") for r in rounds[:-1] if r["diagnosis"]["signature"] == last["signature"]}
        if last.get("rule") in tried or last.get("rule") is None:
            return "give_up"
    if rounds[-1]["diagnosis"].get("rule") is None:
        return "give_up"     # no rule knows this failure: report it precisely
    return "repair"


def after_repair(state: MigrationState) -> str:
    """Nothing changed (a report-only rule, or a fix that could not apply): re-running is pointless."""
    return "trial_run" if state["rounds"][-1].get("applied") else "give_up"


# Every node, in the order of SPEC §2; the edges and routes below are the graph as data.
NODES = {
    "detect_env": nodes.node_detect_env,
    "classify": nodes.node_classify,
    "acquire": nodes.node_acquire,
    "vendor": nodes.node_vendor,
    "decide_native": nodes.node_decide_native,
    "render": nodes.node_render,
    "trial_run": nodes.node_trial_run,
    "diagnose": nodes.node_diagnose,
    "repair": nodes.node_repair,
    "estimate_memory": nodes.node_estimate_memory,
    "give_up": nodes.node_give_up,
    "collect_baseline": nodes.node_collect_baseline,
    "verify": nodes.node_verify,
    "report": nodes.node_report,
}

EDGES = [
    (START, "detect_env"),
    ("detect_env", "classify"),
    ("acquire", "vendor"),
    ("vendor", "decide_native"),
    ("decide_native", "render"),
    ("render", "trial_run"),
    ("estimate_memory", "report"),
    ("give_up", "report"),
    ("collect_baseline", "verify"),
    ("report", END),
]

# node -> (routing function, the nodes it may name)
ROUTES = {
    "classify": (after_classify, ["acquire", "diagnose", "collect_baseline"]),
    "trial_run": (after_trial_run, ["collect_baseline", "diagnose"]),
    "diagnose": (after_diagnose, ["repair", "estimate_memory", "give_up"]),
    "repair": (after_repair, ["trial_run", "give_up"]),
    "verify": (after_verify, ["diagnose", "report"]),
}


def build_graph(wrap=None) -> StateGraph:
    """The uncompiled graph; `wrap(name, fn)` may decorate every node (e.g. progress output)."""
    graph = StateGraph(MigrationState)
    for name, node in NODES.items():
        graph.add_node(name, wrap(name, node) if wrap else node)
    for source, target in EDGES:
        graph.add_edge(source, target)
    for source, (route, targets) in ROUTES.items():
        graph.add_conditional_edges(source, route, targets)
    return graph
