"""What has one home, and nothing else says otherwise: every default in engine/defaults.py (the CLI, the graph
and repair read it there, no timeout written out elsewhere), every node of the graph in
agent/workflow/nodes.py and added to the graph as it is, docs/recipes.md's table of the YAML keys generated
from the schema (engine.config)."""

from __future__ import annotations

import re

from engine import defaults
from engine.config import keys_markdown
from locations import REPO_ROOT

ROOT = REPO_ROOT


def test_docs_key_table_is_the_schema():
    page = (ROOT / "docs" / "recipes.md").read_text()
    found = re.search(r"<!-- yaml-keys[^>]*-->\n(.*?)\n<!-- /yaml-keys -->", page, re.S)
    assert found, "docs/recipes.md lacks the generated YAML key table"
    assert found.group(1) == keys_markdown(), \
        "docs/recipes.md's YAML key table is stale: paste engine.config.keys_markdown()"


def test_defaults_have_one_home():
    """Each default lives in engine/defaults.py; the CLI, the graph and repair read it from there."""
    from agent import cli
    from agent.repair.rules import rule as repair
    from agent.workflow.state import run_options

    run = cli._parser().parse_args(["run", "x"])
    assert (run.timeout, run.max_new_tokens, run.max_rounds) == \
        (defaults.TIMEOUT_S, defaults.MAX_NEW_TOKENS, defaults.MAX_ROUNDS)
    assert run_options(None)["max_rounds"] == defaults.MAX_ROUNDS     # the graph's run options
    assert repair.RepairContext().timeout_s == defaults.TIMEOUT_S
    literal = re.compile(r"(default=|or |= |, )1800\b")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for base in ("agent", "engine") for p in (ROOT / base).rglob("*.py")
                 if p.name != "defaults.py" for n, line in enumerate(p.read_text().splitlines(), 1)
                 if literal.search(line)]
    assert not offenders, f"timeouts written out instead of engine.defaults: {offenders}"


def test_every_node_lives_in_agent_nodes_and_is_added_as_is():
    from agent.workflow import nodes
    from agent.workflow.graph import NODES, build_graph

    assert all(getattr(nodes, fn.__name__) is fn for fn in NODES.values())
    assert set(build_graph().nodes) == set(NODES)
    wrapped = build_graph(wrap=lambda name, fn: (lambda state: {"message": name}))
    assert all(spec.runnable.invoke({}) == {"message": name} for name, spec in wrapped.nodes.items())
