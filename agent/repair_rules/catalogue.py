"""The failure catalogue: rules from every module, most specific first.

The first rule whose evidence and facts accept the failure is used, so specific rules come before
general ones. Out of memory comes first (any run that ran out of memory goes to the memory
estimate, whatever else it printed); the optional LLM repairer comes last: it only sees failures
no rule knows.
"""

from agent import llm_repair
from agent.repair_rules import code, config, field, files, run, upstream

CATALOGUE = [*run.FIRST, *field.EARLIEST, *files.RULES, *upstream.RULES, *run.RULES, *config.RULES, *field.FIRST, *code.RULES,
             *field.RULES, llm_repair.RULE]
