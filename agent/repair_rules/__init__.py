"""The failure catalogue: rules from every module, most specific first.

Each module defines RULES (a list of agent.repair.Rule). Order matters: the first rule whose
matcher accepts the failure is used, so specific rules come before general ones. The optional
LLM repairer comes last: it only sees failures no rule knows.
"""

from agent import llm_repair
from agent.repair_rules import code, config, field, files

CATALOGUE = [*field.EARLIEST, *files.RULES, *config.RULES, *field.FIRST, *code.RULES, *field.RULES, llm_repair.RULE]
