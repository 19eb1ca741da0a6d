"""Every `migrator` command and flag named in skills/ exists in the CLI."""

from __future__ import annotations

import argparse
import re

from agent.cli import _parser
from agent.paths import skills_dir


def _cli_commands() -> dict[str, set[str]]:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {opt for action in p._actions for opt in action.option_strings}
            for name, p in sub.choices.items()}


def _mentions() -> list[tuple[str, str, str]]:
    """(file, command, rest of line) for every `migrator <command> ...` in the skills."""
    found = []
    for path in sorted(skills_dir().rglob("*.md")):
        text = path.read_text()
        # Code only: fenced blocks and inline `code` spans (prose may say "the migrator saw").
        code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for chunk in code:
            for match in re.finditer(r"(?:^|\s)migrator (\w[\w-]*)([^\n#]*)", chunk, re.M):
                found.append((path.name, match.group(1), match.group(2)))
    return found


def test_skills_exist_with_front_matter():
    for name in ("model-infer-migrator", "model-infer-runtime-debug"):
        text = (skills_dir() / name / "SKILL.md").read_text()
        assert text.startswith("---\nname: " + name + "\n") and "\ndescription: " in text


def test_every_command_and_flag_in_skills_exists():
    commands = _cli_commands()
    mentions = _mentions()
    assert len(mentions) >= 10
    for file, command, rest in mentions:
        assert command in commands, f"{file}: migrator {command} is not a CLI command"
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
            assert flag in commands[command], f"{file}: migrator {command} has no {flag}"


def test_flags_listed_for_run_exist():
    run_flags = _cli_commands()["run"]
    for path in skills_dir().rglob("*.md"):
        for flag in re.findall(r"`(--[a-z][a-z-]*)", path.read_text()):
            assert any(flag in flags for flags in _cli_commands().values()), f"{path.name}: {flag}"
    assert {"--resume", "--trust-remote-code", "--weights", "--device"} <= run_flags
