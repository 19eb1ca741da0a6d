"""Rules about code: vendored modeling, runner, imports, packages, devices."""

from __future__ import annotations

from agent.repair import Rule

RULES: list[Rule] = []
