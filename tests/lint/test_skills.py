"""Every `migrator` command and flag named in skills/ (their SKILL.md and evals) exists in the CLI.

Flags an open issue adds (`pending` in an eval) are allowed while absent, and a test holds them absent:
when the issue lands it fails, and the flag leaves the pending list.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

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


def _evals() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(skills_dir().glob("*/evals/evals.json")):
        data = json.loads(path.read_text())
        assert data["skill"] == path.parent.parent.name
        found += [(data["skill"], case) for case in data["evals"]]
    return found


def _pending() -> dict[str, str]:
    """flag -> the issue that adds it, from every eval's `pending`."""
    return {flag: why for _skill, case in _evals() for flag, why in (case.get("pending") or {}).items()}


def test_every_command_and_flag_in_skills_exists():
    commands = _cli_commands()
    mentions = _mentions()
    pending = _pending()
    assert len(mentions) >= 10
    for file, command, rest in mentions:
        assert command in commands, f"{file}: migrator {command} is not a CLI command"
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
            assert flag in commands[command] or flag in pending, f"{file}: migrator {command} has no {flag}"


def test_flags_listed_for_run_exist():
    run_flags = _cli_commands()["run"]
    pending = _pending()
    for path in skills_dir().rglob("*.md"):
        for flag in re.findall(r"`(--[a-z][a-z-]*)", path.read_text()):
            assert any(flag in flags for flags in _cli_commands().values()) or flag in pending, f"{path.name}: {flag}"
    assert {"--resume", "--trust-remote-code", "--weights", "--device", "--hub", "--apply-llm-patches"} <= run_flags


# ---- evals: questions with the expected behaviour -------------------------------------------------
def test_evals_cover_scenarios_asking_first_and_declining():
    cases = _evals()
    ids = [case["id"] for _skill, case in cases]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    migrator = [case for skill, case in cases if skill == "model-infer-migrator"]
    kinds = {case["kind"] for case in migrator}
    assert kinds == {"scenario", "ask_first", "decline"}
    for _skill, case in cases:
        assert case["prompt"].strip() and case["expected_behavior"] and "must_not" in case, case["id"]
    # the scenarios the skill tells apart: A from a link and from ModelScope, B, C, both targets, OOM
    text = json.dumps(migrator)
    for needle in ("scenario A", "scenario C", "(B:", "--hub modelscope", "framework", "standalone", "--world-size"):
        assert needle in text, needle
    # declines name the skill that does the job
    for case in migrator:
        if case["kind"] == "decline":
            assert re.search(r"model-infer-[a-z-]+", " ".join(case["expected_behavior"])), case["id"]


@pytest.mark.parametrize("skill,case", _evals(), ids=lambda v: v["id"] if isinstance(v, dict) else v)
def test_eval_commands_parse_with_the_real_cli(skill, case):
    from agent.cli import _parser

    pending = case.get("pending") or {}
    for command in case["commands"]:
        argv = shlex.split(command)
        assert argv[0] == "migrator", command
        argv = argv[1:]
        for flag in pending:                 # an open issue's flag and its value
            while flag in argv:
                i = argv.index(flag)
                del argv[i:i + 2]
        try:
            _parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{skill}/{case['id']}: `{command}` does not parse (exit {exc.code})")


def test_pending_flags_are_really_pending():
    """A pending flag is one the parser does not have yet; once its issue lands, drop it from `pending`."""
    all_flags = set().union(*_cli_commands().values())
    for flag, why in _pending().items():
        assert flag not in all_flags, f"{flag} exists now ({why}): remove it from the evals' pending"
