"""agent/secrets.py: the LLM repairer's key leaves the environment when the CLI holds it (no child process
inherits it), is still handed to the one client that sends it, and is replaced by *** in any text that may
reach a file or the terminal (the whole value, and each line of a multi-line one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent import secrets

KEY = "sk-test-0123456789abcdef"


@pytest.fixture
def held_key(monkeypatch):
    monkeypatch.setattr(secrets, "_held", {})
    monkeypatch.setenv("MIGRATOR_LLM_API_KEY", KEY)
    secrets.hold_secrets()
    return KEY


def test_a_held_key_leaves_the_environment_and_no_child_sees_it(held_key):
    assert "MIGRATOR_LLM_API_KEY" not in os.environ
    assert secrets.held("MIGRATOR_LLM_API_KEY") == held_key
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MIGRATOR_LLM_API_KEY'))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "None"


def test_redact_replaces_the_key_wherever_it_appears(held_key):
    text = f"POST failed: Authorization: Bearer {held_key}; retry with {held_key}"
    assert secrets.redact(text) == "POST failed: Authorization: Bearer ***; retry with ***"
    assert secrets.redact("nothing secret here") == "nothing secret here"


def test_each_line_of_a_multi_line_key_is_redacted_and_short_pieces_are_not(monkeypatch):
    monkeypatch.setattr(secrets, "_held", {})
    monkeypatch.setenv("MIGRATOR_LLM_API_KEY", "first-line-of-key\r\nab\nsecond-line-of-key")
    secrets.hold_secrets()
    shown = secrets.redact("echoed: second-line-of-key, then first-line-of-key; ab stays")
    assert shown == "echoed: ***, then ***; ab stays"        # 'ab': too short to be told from ordinary text


def test_a_library_caller_that_did_not_hold_still_gets_and_redacts_the_key(monkeypatch):
    monkeypatch.setattr(secrets, "_held", {})
    monkeypatch.setenv("MIGRATOR_LLM_API_KEY", KEY)
    assert secrets.held("MIGRATOR_LLM_API_KEY") == KEY and secrets.redact(KEY) == "***"
