"""Protocol test of the optional LLM repairer: a local HTTP server stands in for the
OpenAI-compatible endpoint and returns canned diffs (no model is involved)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from migrator_cli import assert_repaired, repair_run

pytest.importorskip("openai")   # imported here, so the timed requests below do not pay its import


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
    """A fault no rule knows: a typo'd name in the runner (an override of the engine's step)."""
    runner = recipe / "runner_fi.py"
    broken = runner.read_text() + (
        "\n    def model_output_process(self, model_inputs, outputs, batch):\n"
        "        super().model_output_process(model_inputs, outputs, batch)\n"
        "        batch[\"is_prefill\"] = Flase\n")
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
    proc, summary, report = repair_run(working_recipe, "--apply-llm-patches",
                                       env={"MIGRATOR_LLM_BASE_URL": server.url, "MIGRATOR_LLM_API_KEY": "k"})
    assert_repaired(working_recipe, proc, summary, report, "llm_repairer", {"runner_fi.py": broken.encode()})
    assert runner.read_text() == fixed
    assert (working_recipe / ".migrator" / "llm" / "proposal_1.diff").read_text().startswith("--- a/runner_fi.py")
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer k"
    system, user = request["body"]["messages"]
    assert "model-infer-runtime-debug" in system["content"]            # the skill text
    assert "NameError" in user["content"] and "Flase" in user["content"]  # failure + relevant file


# ---- the policy: proposals by default; applied only with --apply-llm-patches, only to the failing files ----
def test_protocol_llm_diff_is_a_proposal_by_default(working_recipe, endpoint):
    runner, broken = _inject_unknown_fault(working_recipe)
    diff = _diff("runner_fi.py", broken, broken.replace("= Flase", "= False"))
    server = endpoint([diff])
    before = {p: p.read_bytes() for p in working_recipe.rglob("*") if p.is_file() and ".migrator" not in p.parts}
    proc, summary, report = repair_run(working_recipe, env={"MIGRATOR_LLM_BASE_URL": server.url})
    assert proc.returncode == 1 and summary["status"] == "failed"
    note = report["rounds"][0]["note"]
    assert "not applied" in note and ".migrator/llm/proposal_1.diff" in note and "--apply-llm-patches" in note
    assert not report["rounds"][0]["applied"] and len(report["runs"]) == 1          # no second trial run
    assert ".migrator/llm/proposal_1.diff" in summary["message"]
    assert (working_recipe / ".migrator" / "llm" / "proposal_1.diff").read_text() == diff
    after = {p: p.read_bytes() for p in working_recipe.rglob("*") if p.is_file() and ".migrator" not in p.parts
             and p.name not in ("migration_report.json", "migration_summary.md", "README.md")}
    assert all(before[p] == data for p, data in after.items())                     # nothing of the recipe edited
    # the proposal applies as the note says
    subprocess.run(["patch", "-p1", "-s", "-i", ".migrator/llm/proposal_1.diff"], cwd=working_recipe, check=True)
    assert "= False" in runner.read_text()


@pytest.mark.slow  # a protocol run; the diff-repairs and proposal-by-default runs stay by default
def test_protocol_llm_diff_that_also_edits_infer_sh_is_not_applied(working_recipe, endpoint):
    """The field case: a diff that fixes the failure and also adds a command to infer.sh. Even with
    --apply-llm-patches it stays a proposal (infer.sh is not in the traceback), and nothing runs it."""
    runner, broken = _inject_unknown_fault(working_recipe)
    infer_sh = working_recipe / "infer.sh"
    script = infer_sh.read_text()
    marker = working_recipe.parent / "llm_was_here"
    lines = script.splitlines(True)
    evil = "".join(lines[:1] + [f"touch {marker}\n"] + lines[1:])
    diff = _diff("runner_fi.py", broken, broken.replace("= Flase", "= False")) + _diff("infer.sh", script, evil)
    server = endpoint([diff])
    proc, summary, report = repair_run(working_recipe, "--apply-llm-patches",
                                       env={"MIGRATOR_LLM_BASE_URL": server.url})
    assert proc.returncode == 1
    note = report["rounds"][0]["note"]
    assert "not applied" in note and "infer.sh" in note and "runner_fi.py" in note
    assert infer_sh.read_text() == script and runner.read_text() == broken and not marker.exists()
    assert (working_recipe / ".migrator" / "llm" / "proposal_1.diff").read_text() == diff


@pytest.mark.slow  # a protocol run; the key-not-inherited run stays by default
def test_protocol_api_key_with_crlf_reaches_no_file(working_recipe, endpoint):
    _inject_unknown_fault(working_recipe)
    secret = "sk-SECRET\r\nX-Injected: 1"
    server = endpoint(["--- a/runner_fi.py\n+++ b/runner_fi.py\n@@ -1 +1 @@\n-x\n+y\n"])
    proc, summary, report = repair_run(working_recipe, env={"MIGRATOR_LLM_BASE_URL": server.url,
                                                            "MIGRATOR_LLM_API_KEY": secret})
    assert proc.returncode == 1 and not server.requests                             # never sent
    assert "control characters" in report["rounds"][0]["note"]
    for path in [p for p in working_recipe.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert b"sk-SECRET" not in data and b"X-Injected" not in data, path
    assert "sk-SECRET" not in proc.stdout + proc.stderr


def test_protocol_key_is_not_inherited_and_an_echoed_key_is_refused(working_recipe, endpoint):
    """The trial run does not see the key (a recipe printing its environment logs no secret), and a reply
    that carries the key back (a hostile endpoint) is refused, not saved or applied."""
    runner, broken = _inject_unknown_fault(working_recipe)
    (working_recipe / "infer.sh").write_text((working_recipe / "infer.sh").read_text().replace(
        "\n", "\nenv | grep -i llm_api || true\n", 1))
    secret = "sk-live-0123456789"
    fixed = broken.replace("= Flase", f"= False  # {secret}")
    server = endpoint([_diff("runner_fi.py", broken, fixed)])
    proc, summary, report = repair_run(working_recipe, "--apply-llm-patches",
                                       env={"MIGRATOR_LLM_BASE_URL": server.url, "MIGRATOR_LLM_API_KEY": secret})
    assert server.requests and server.requests[0]["auth"] == f"Bearer {secret}"
    assert proc.returncode == 1 and "contains the API key" in report["rounds"][0]["note"]
    assert runner.read_text() == broken
    for path in [p for p in working_recipe.rglob("*") if p.is_file()]:
        assert secret.encode() not in path.read_bytes(), path


@pytest.mark.slow  # in-process: test_rejected_diff_kinds_write_nothing[dotdot, absolute]
def test_protocol_llm_diff_outside_the_recipe_is_rejected(working_recipe, endpoint, tmp_path):
    runner, broken = _inject_unknown_fault(working_recipe)
    outside = "--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+print('pwned')\n"
    server = endpoint([outside])
    proc, summary, report = repair_run(working_recipe, env={"MIGRATOR_LLM_BASE_URL": server.url})
    assert proc.returncode == 1 and summary["status"] == "failed"
    assert "rejected" in report["rounds"][0]["note"] and "outside the recipe" in report["rounds"][0]["note"]
    assert not (working_recipe.parent / "evil.py").exists() and runner.read_text() == broken


@pytest.mark.slow  # in-process: test_rejected_diff_kinds_write_nothing[stale_context, missing_file]
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


# ---- the reply is untrusted: parse, check and apply in process (no model run) -------------------
import os
import shutil
import subprocess
import time

from agent.repair.llm_repair import DiffRejected, apply_diff, extract_diff, request_reply

RUNNER = "import os\n\n\ndef main():\n    x = 1\n    print(x)\n\n\nmain()\n"


@pytest.fixture
def tree(tmp_path):
    """A recipe-like folder, plus a folder outside it that links point to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.py").write_text("outside\n")
    recipe = tmp_path / "rec"
    (recipe / "models").mkdir(parents=True)
    (recipe / ".migrator").mkdir()
    (recipe / "runner_fi.py").write_text(RUNNER)
    (recipe / "crlf.py").write_bytes(b"a = 1\r\nb = 2\r\nc = 3\r\n")
    (recipe / "bom.py").write_bytes(b"\xef\xbb\xbfa = 1\nb = 2\n")
    (recipe / "infer.sh").write_text("#!/bin/bash\npython infer.py\n")
    os.chmod(recipe / "infer.sh", 0o755)
    (recipe / "blob.bin").write_bytes(b"a\x00b\n")
    (recipe / "link.py").symlink_to(outside / "victim.py")
    (recipe / "ext").symlink_to(outside, target_is_directory=True)
    return recipe


def _state(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p)
                                       if p.is_symlink() else None, os.lstat(p).st_mode)
            for p in sorted(root.rglob("*"))}


EDIT = "--- a/runner_fi.py\n+++ b/runner_fi.py\n@@ -4,3 +4,3 @@\n def main():\n-    x = 1\n+    x = 2\n     print(x)\n"
REJECTED = {
    "symlink_created": ("diff --git a/evil b/evil\nnew file mode 120000\nindex 0000000..1234567\n--- /dev/null\n"
                        "+++ b/evil\n@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n", "symlink"),
    "symlink_edited_by_mode": ("diff --git a/link.py b/link.py\nindex 1234567..89abcde 120000\n--- a/link.py\n"
                               "+++ b/link.py\n@@ -1 +1 @@\n-outside\n+pwned\n", "symlink"),
    "symlink_edited": ("--- a/link.py\n+++ b/link.py\n@@ -1 +1 @@\n-outside\n+pwned\n", "symlink"),
    "through_symlinked_dir": ("--- a/ext/victim.py\n+++ b/ext/victim.py\n@@ -1 +1 @@\n-outside\n+pwned\n",
                              "through a symlink"),
    "create_through_symlinked_dir": ("--- /dev/null\n+++ b/ext/new.py\n@@ -0,0 +1 @@\n+x\n", "through a symlink"),
    "mode_change": ("diff --git a/infer.sh b/infer.sh\nold mode 100755\nnew mode 100644\n", "mode"),
    "executable_created": ("diff --git a/x.sh b/x.sh\nnew file mode 100755\n--- /dev/null\n+++ b/x.sh\n"
                           "@@ -0,0 +1 @@\n+echo\n", "mode 100755"),
    "copy_into_migrator": ("diff --git a/runner_fi.py b/.migrator/threads.json\nsimilarity index 100%\n"
                           "copy from runner_fi.py\ncopy to .migrator/threads.json\n", "copies or renames"),
    "rename": ("diff --git a/runner_fi.py b/runner2.py\nsimilarity index 90%\nrename from runner_fi.py\n"
               "rename to runner2.py\n", "copies or renames"),
    "rename_by_paths": (EDIT.replace("+++ b/runner_fi.py", "+++ b/runner2.py"), "renames"),
    "binary_literal": ("diff --git a/blob.bin b/blob.bin\nindex 1234567..89abcde 100644\nGIT binary patch\n"
                       "literal 5\nMcmZQzWMXDy0001E\n\nliteral 0\nKcmV+b0RR6000031\n", "binary"),
    "binary_differ": ("diff --git a/blob.bin b/blob.bin\nindex 1234567..89abcde 100644\n"
                      "Binary files a/blob.bin and b/blob.bin differ\n", "binary"),
    "deleted_git": ("diff --git a/runner_fi.py b/runner_fi.py\ndeleted file mode 100644\n--- a/runner_fi.py\n"
                    "+++ /dev/null\n@@ -1 +0,0 @@\n-import os\n", "deletes"),
    "deleted_plain": ("--- a/infer.sh\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-#!/bin/bash\n-python infer.py\n", "deletes"),
    "dotdot": ("--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+print('pwned')\n", "outside the recipe"),
    "dotdot_inside": ("--- /dev/null\n+++ b/models/../../evil.py\n@@ -0,0 +1 @@\n+x\n", "outside the recipe"),
    "absolute": ("--- /etc/hostname\n+++ /etc/hostname\n@@ -1 +1 @@\n-a\n+b\n", "outside the recipe"),
    "into_migrator": ("--- /dev/null\n+++ b/.migrator/threads.json\n@@ -0,0 +1 @@\n+{}\n", ".migrator"),
    "into_git_hooks": ("--- /dev/null\n+++ b/.git/hooks/pre-commit\n@@ -0,0 +1 @@\n+rm -rf ~\n", ".git"),
    "creates_existing": ("--- /dev/null\n+++ b/infer.sh\n@@ -0,0 +1 @@\n+echo\n", "exists"),
    "binary_target": ("--- a/blob.bin\n+++ b/blob.bin\n@@ -1 +1 @@\n-a\n+b\n", "not a text file"),
    "stale_context": ("--- a/runner_fi.py\n+++ b/runner_fi.py\n@@ -1,2 +1,2 @@\n-not in the file\n+x\n ctx\n",
                      "does not apply"),
    "bad_counts": ("--- a/runner_fi.py\n+++ b/runner_fi.py\n@@ -1,5 +1,5 @@\n-import os\n+import sys\n",
                   "line counts"),
    "quoted_path": ('--- "a/r\\303\\251.py"\n+++ "b/r\\303\\251.py"\n@@ -0,0 +1 @@\n+x\n', "quoted"),
    "twice": (EDIT + EDIT, "twice"),
    "unknown_header": ("diff --git a/runner_fi.py b/runner_fi.py\nfoo bar\n--- a/runner_fi.py\n"
                       "+++ b/runner_fi.py\n@@ -1 +1 @@\n-import os\n+import sys\n", "unsupported diff header"),
    "missing_file": ("--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n", "does not apply"),
    "stray_text_between_hunks": (EDIT + "\n@@ -9 +9 @@\n-main()\n+main(1)\n", "outside a file section"),
    "prose_only": ("I think you should change x to 2.", "not a unified diff"),
    "second_file_bad": (EDIT + "--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+x\n", "outside the recipe"),
}


@pytest.mark.parametrize("kind", sorted(REJECTED))
def test_rejected_diff_kinds_write_nothing(tree, kind):
    diff, reason = REJECTED[kind]
    before, outside_before = _state(tree), _state(tree.parent / "outside")
    with pytest.raises(DiffRejected, match=reason.replace("(", r"\(")):
        apply_diff(extract_diff("```diff\n" + diff + "```\n") if kind != "prose_only" else diff, tree)
    assert _state(tree) == before and _state(tree.parent / "outside") == outside_before
    assert not (tree.parent / "evil.py").exists()


def test_fences_inside_the_diff_do_not_cut_it(tree):
    (tree / "README.md").write_text("# recipe\n\nRun:\n\n```bash\nbash infer.sh\n```\n\nDone.\n")
    good = ("--- a/README.md\n+++ b/README.md\n@@ -5,5 +5,10 @@\n ```bash\n bash infer.sh\n ```\n+\n+Debug:\n"
            "+```bash\n+DEBUG=1 bash infer.sh\n+```\n \n Done.\n")
    reply = f"Here is the fix:\n```diff\n{good}```\nThis adds a fenced block.\n"
    assert apply_diff(extract_diff(reply), tree) == ["README.md"]
    assert (tree / "README.md").read_text() == ("# recipe\n\nRun:\n\n```bash\nbash infer.sh\n```\n\nDebug:\n```bash\n"
                                                 "DEBUG=1 bash infer.sh\n```\n\nDone.\n")


def test_accepted_edits_keep_line_endings_bom_and_mode(tree):
    diff = ("--- a/crlf.py\n+++ b/crlf.py\n@@ -1,3 +1,4 @@\n a = 1\n-b = 2\n+b = 20\n+b2 = 21\n c = 3\n"
            "--- a/bom.py\n+++ b/bom.py\n@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n+b = 3\n"
            "diff --git a/infer.sh b/infer.sh\nindex 1234567..89abcde 100755\n--- a/infer.sh\n+++ b/infer.sh\n"
            "@@ -1,2 +1,3 @@\n #!/bin/bash\n+export X=1\n python infer.py\n"
            "--- /dev/null\n+++ b/models/extra/new_helper.py\n@@ -0,0 +1,2 @@\n+def helper():\n+    return 1\n")
    assert apply_diff(diff, tree) == ["bom.py", "crlf.py", "infer.sh", "models/extra/new_helper.py"]
    assert (tree / "crlf.py").read_bytes() == b"a = 1\r\nb = 20\r\nb2 = 21\r\nc = 3\r\n"
    assert (tree / "bom.py").read_bytes() == b"\xef\xbb\xbfa = 1\nb = 3\n"
    assert (tree / "infer.sh").read_bytes() == b"#!/bin/bash\nexport X=1\npython infer.py\n"
    assert os.stat(tree / "infer.sh").st_mode & 0o777 == 0o755
    assert (tree / "models" / "extra" / "new_helper.py").read_text() == "def helper():\n    return 1\n"


def test_hunks_apply_at_an_offset_and_without_final_newline(tree):
    (tree / "runner_fi.py").write_text("# a header line\n# another\n" + RUNNER + "last")
    diff = EDIT + "@@ -9,1 +9,2 @@\n-main()\n+main()\n+print('done')\n"
    diff = diff.replace("@@ -9,1 +9,2 @@\n-main()\n+main()\n+print('done')\n",
                        "@@ -9,2 +9,3 @@\n main()\n-last\n\\ No newline at end of file\n+last\n+tail\n")
    apply_diff(diff, tree)
    assert (tree / "runner_fi.py").read_text() == "# a header line\n# another\n" + RUNNER.replace("x = 1", "x = 2") \
        + "last\ntail\n"


def test_the_same_patch_applies_inside_and_outside_a_git_work_tree(tree, tmp_path):
    plain, in_git = tmp_path / "plain", tmp_path / "repo" / "recipes" / "rec"
    for dest in (plain, in_git):
        shutil.copytree(tree, dest, symlinks=True)
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    subprocess.run(["git", "-C", str(tmp_path / "repo"), "add", "-A"], check=True)
    creation = "--- /dev/null\n+++ b/models/helper.py\n@@ -0,0 +1 @@\n+X = 1\n"
    for dest in (plain, in_git):
        assert apply_diff(EDIT + creation, dest) == ["models/helper.py", "runner_fi.py"]
    assert _state(plain) == _state(in_git)
    assert "x = 2" in (in_git / "runner_fi.py").read_text() and (in_git / "models" / "helper.py").is_file()


# ---- the endpoint: size cap and overall deadline (real HTTP on 127.0.0.1) -----------------------
class RawEndpoint:
    """A local HTTP server whose handler `behaviour(handler)` writes whatever the test wants."""

    def __init__(self, behaviour):
        from http.server import ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    behaviour(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/chat/completions"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _reply(content):
    return json.dumps({"choices": [{"message": {"content": content}}]}).encode()


def _send(handler, body, length=True, status=200):
    handler.send_response(status)
    if length:
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _endless(handler):
    handler.send_response(200)
    handler.end_headers()
    while True:
        handler.wfile.write(b" " * 65536)


def _drip(handler):
    handler.send_response(200)
    handler.send_header("Content-Length", "500")
    handler.end_headers()
    for _ in range(500):
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.02)


def _silent(handler):
    time.sleep(5)


ENDPOINT_CASES = {
    "too_large_declared": (lambda h: _send(h, _reply("x" * 5000)), "larger than 1000 bytes"),
    "too_large_undeclared": (lambda h: _send(h, _reply("x" * 5000), length=False), "larger than 1000 bytes"),
    "endless_stream": (_endless, "larger than 1000 bytes"),
    "slow_drip_past_deadline": (_drip, "deadline"),
    "no_answer": (_silent, "deadline"),
    "http_error": (lambda h: _send(h, b"{}", status=500), "HTTP 500"),
    "not_json": (lambda h: _send(h, b"<html>"), "not JSON"),
    "no_content": (lambda h: _send(h, b'{"choices": []}'), "no choices"),
}


@pytest.mark.parametrize("case", sorted(ENDPOINT_CASES))
def test_endpoint_reply_limits(case, monkeypatch):
    behaviour, reason = ENDPOINT_CASES[case]
    server = RawEndpoint(behaviour)
    monkeypatch.setenv("MIGRATOR_LLM_BASE_URL", server.url.removesuffix("/chat/completions"))
    try:
        start = time.monotonic()
        with pytest.raises(DiffRejected, match=reason):
            request_reply([{"role": "user", "content": "x"}], max_bytes=1000, deadline_s=1.0)
        assert time.monotonic() - start < 3.0          # the deadline is overall, not per read
    finally:
        server.close()


def test_endpoint_reply_within_limits_is_read(monkeypatch):
    server = RawEndpoint(lambda h: _send(h, _reply("```diff\n" + EDIT + "```")))
    try:
        monkeypatch.setenv("MIGRATOR_LLM_BASE_URL", server.url.removesuffix("/chat/completions"))
        assert extract_diff(request_reply([{"role": "user", "content": "x"}])) == EDIT + "```"
        monkeypatch.setenv("MIGRATOR_LLM_TIMEOUT_S", "soon")
        with pytest.raises(DiffRejected, match="MIGRATOR_LLM_TIMEOUT_S"):
            request_reply([{"role": "user", "content": "x"}])
    finally:
        server.close()
