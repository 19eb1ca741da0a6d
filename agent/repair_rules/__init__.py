"""Repair rules, one module per kind of failure; `catalogue.CATALOGUE` orders them.

Each module defines its rules as rows (agent.repair_rules.rule.Rule). Importing this package
imports nothing else, so rule modules, agent.backup and agent.llm_repair can share its helpers
without an import cycle.
"""
