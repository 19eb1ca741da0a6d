"""Repair rules, one module per kind of failure; `catalogue.CATALOGUE` orders them.

Each module defines its rules as rows (agent.repair.rules.rule.Rule). Importing this package
imports nothing else, so rule modules, agent.recipe.backup and agent.repair.llm_repair can share its helpers
without an import cycle.
"""
