"""Scenario B: diagnose a failed run and repair the recipe (rules, codemods, the optional LLM)."""
