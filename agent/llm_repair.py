"""Optional LLM repairer: an OpenAI-compatible endpoint proposes a unified diff for failures no
rule knows. Off unless MIGRATOR_LLM_BASE_URL is set. The diff must apply cleanly and touch only
files inside the recipe; it is validated before anything is written.

    MIGRATOR_LLM_BASE_URL   e.g. http://127.0.0.1:8000/v1   (…/chat/completions is appended)
    MIGRATOR_LLM_MODEL      model name sent in the request (default: "default")
    MIGRATOR_LLM_API_KEY    bearer token, if the endpoint wants one
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

from agent.repair import Failure, RepairContext, Rule

TIMEOUT_S = 120
MAX_FILE_CHARS = 40_000


class DiffRejected(ValueError):
    pass


def configured() -> bool:
    return bool(os.environ.get("MIGRATOR_LLM_BASE_URL"))


def relevant_file(failure: Failure) -> Path | None:
    """The recipe file named innermost in the traceback, else the runner."""
    for path, _line in reversed(re.findall(r'File "([^"]+)", line (\d+)', failure.output)):
        candidate = Path(path)
        try:
            candidate.resolve().relative_to(failure.recipe_dir.resolve())
            return candidate
        except ValueError:
            continue
    runners = sorted(failure.recipe_dir.glob("runner_*.py"))
    return runners[0] if runners else None


def build_messages(failure: Failure) -> list[dict]:
    from agent.paths import skills_dir

    skill = (skills_dir() / "model-infer-runtime-debug" / "SKILL.md").read_text()
    target = relevant_file(failure)
    file_part = ""
    if target is not None:
        rel = target.resolve().relative_to(failure.recipe_dir.resolve())
        file_part = f"\n\nFile {rel}:\n```python\n{target.read_text()[:MAX_FILE_CHARS]}\n```"
    tail = "\n".join(failure.output.strip().splitlines()[-60:])
    return [
        {"role": "system", "content": skill + "\n\nAnswer with one unified diff (paths relative to the "
                                              "recipe directory, a/ and b/ prefixes) and nothing else."},
        {"role": "user", "content": f"`bash infer.sh` failed with:\n```\n{tail}\n```{file_part}"},
    ]


def request_diff(messages: list[dict]) -> str:
    url = os.environ["MIGRATOR_LLM_BASE_URL"].rstrip("/") + "/chat/completions"
    body = json.dumps({"model": os.environ.get("MIGRATOR_LLM_MODEL", "default"), "messages": messages,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get("MIGRATOR_LLM_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['MIGRATOR_LLM_API_KEY']}"
    with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=TIMEOUT_S) as response:
        reply = json.loads(response.read())
    content = reply["choices"][0]["message"]["content"]
    fenced = re.search(r"```(?:diff|patch)?\n(.*?)```", content, re.S)
    return fenced.group(1) if fenced else content


def validate_diff(diff: str, recipe_dir: Path) -> list[str]:
    """Paths the diff touches, all inside the recipe; raises DiffRejected otherwise."""
    paths = re.findall(r"^(?:---|\+\+\+) (\S+)", diff, re.M)
    if not paths:
        raise DiffRejected("not a unified diff")
    touched = []
    root = recipe_dir.resolve()
    for raw in paths:
        if raw == "/dev/null":
            continue
        rel = raw[2:] if raw.startswith(("a/", "b/")) else raw
        target = (root / rel).resolve()
        if Path(rel).is_absolute() or not target.is_relative_to(root) or ".migrator" in Path(rel).parts:
            raise DiffRejected(f"diff touches {raw}, outside the recipe")
        touched.append(rel)
    check = subprocess.run(["git", "apply", "--check", "-p1", "-"], input=diff, text=True, cwd=root,
                           capture_output=True)
    if check.returncode != 0:
        raise DiffRejected(f"diff does not apply: {check.stderr.strip().splitlines()[-1:]}")
    return sorted(set(touched))


def _match(failure: Failure) -> dict | None:
    return {} if configured() else None


def _fix(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    # The round's Failure has no output (rules pass facts); re-read the last run's output.
    runs = sorted((failure.recipe_dir / ".migrator" / "runs").glob("run_*/output.txt"),
                  key=lambda p: p.stat().st_mtime)
    if runs:
        failure = Failure(failure.recipe_dir, runs[-1].read_text(errors="replace"), failure.error, failure.location)
    diff = request_diff(build_messages(failure))
    try:
        touched = validate_diff(diff, failure.recipe_dir)
    except DiffRejected as exc:
        return f"LLM diff rejected: {exc}"
    subprocess.run(["git", "apply", "-p1", "-"], input=diff, text=True, cwd=failure.recipe_dir, check=True,
                   capture_output=True)
    return f"applied LLM diff to {', '.join(touched)}"


RULE = Rule("llm_repairer", "no rule matched; an LLM proposed a patch", _match, _fix, kind="llm")
