"""Protocol test of the optional LLM repairer: a local HTTP server stands in for the
OpenAI-compatible endpoint and returns canned diffs (no model is involved)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from conftest import assert_repaired, repair_run


class CannedEndpoint:
    """POST /v1/chat/completions -> the next canned reply; records the requests."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append({"path": self.path, "body": body,
                                          "auth": self.headers.get("Authorization")})
                content = endpoint.replies.pop(0) if endpoint.replies else "no idea"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def _inject_unknown_fault(recipe):
    """A fault no rule knows: a typo'd attribute in the runner."""
    runner = recipe / "runner_fi.py"
    original = runner.read_text()
    broken = original.replace('input_dict["is_prefill"] = False', 'input_dict["is_prefill"] = Flase')
    assert broken != original
    runner.write_text(broken)
    return runner, broken


def _diff(path, before, after):
    import difflib

    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))


@pytest.fixture
def endpoint():
    servers = []

    def start(replies):
        servers.append(CannedEndpoint(replies))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_protocol_llm_diff_repairs_an_unknown_failure(working_recipe, endpoint):
    runner, broken = _inject_unknown_fault(working_recipe)
    fixed = broken.replace("= Flase", "= False")
    server = endpoint(["Here is the fix:\n```diff\n" + _diff("runner_fi.py", broken, fixed) + "```\n"])
    proc, summary, report = repair_run(working_recipe, env={"MIGRATOR_LLM_BASE_URL": server.url,
                                                            "MIGRATOR_LLM_API_KEY": "k"})
    assert_repaired(working_recipe, proc, summary, report, "llm_repairer", {"runner_fi.py": broken.encode()})
    assert runner.read_text() == fixed
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer k"
    system, user = request["body"]["messages"]
    assert "model-infer-runtime-debug" in system["content"]            # the skill text
    assert "NameError" in user["content"] and "Flase" in user["content"]  # failure + relevant file


def test_protocol_llm_diff_outside_the_recipe_is_rejected(working_recipe, endpoint, tmp_path):
    runner, broken = _inject_unknown_fault(working_recipe)
    outside = "--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+print('pwned')\n"
    server = endpoint([outside])
    proc, summary, report = repair_run(working_recipe, env={"MIGRATOR_LLM_BASE_URL": server.url})
    assert proc.returncode == 1 and summary["status"] == "failed"
    assert "rejected" in report["rounds"][0]["note"] and "outside the recipe" in report["rounds"][0]["note"]
    assert not (working_recipe.parent / "evil.py").exists() and runner.read_text() == broken


def test_protocol_llm_diff_that_does_not_apply_is_rejected(working_recipe, endpoint):
    runner, broken = _inject_unknown_fault(working_recipe)
    stale = "--- a/runner_fi.py\n+++ b/runner_fi.py\n@@ -1,2 +1,2 @@\n-not in the file\n+whatever\n ctx\n"
    server = endpoint([stale])
    proc, summary, report = repair_run(working_recipe, env={"MIGRATOR_LLM_BASE_URL": server.url})
    assert proc.returncode == 1
    assert "does not apply" in report["rounds"][0]["note"] and runner.read_text() == broken


def test_llm_repairer_is_off_without_configuration(working_recipe):
    _inject_unknown_fault(working_recipe)
    proc, summary, report = repair_run(working_recipe)
    assert proc.returncode == 1
    assert report["rounds"][0]["diagnosis"]["rule"] is None and "NameError" in summary["message"]
