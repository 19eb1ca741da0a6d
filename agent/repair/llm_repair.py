"""Optional LLM repairer: an OpenAI-compatible endpoint proposes a unified diff for failures no
rule knows. Off unless MIGRATOR_LLM_BASE_URL is set; the client is the `openai` library (the [llm] extra).

Policy (docs/llm-repairer.md): a diff is code from an untrusted source. By default it is only a proposal:
checked like any diff below, saved as `.migrator/llm/proposal_N.diff` and named in the report, the recipe
left as it was. With `migrator run --apply-llm-patches` it is applied, and only when every file it changes
is a recipe Python file that the failure's traceback names (or the file shown to the model); a diff that
also touches infer.sh, the YAML or a new file stays a proposal. The API key is taken out of the
environment at start (no trial run, parity check or install sees it), refused when it holds control
characters, and replaced by *** in every note; a reply that contains it is refused.

The reply is untrusted. It is read with a size cap (1 MB) and an overall deadline; the diff in it
is parsed here (not only its ---/+++ lines) and accepted only as edits or creations of regular
UTF-8 text files inside the recipe, outside `.migrator/` and `.git/`: symlinks, mode changes,
copies, renames, binary patches and deletions are rejected, and so is a path with `..`, an absolute
path, or one that goes through a symlink. The patch is applied here, hunk by hunk with its context
checked, keeping each file's line endings, BOM and mode (the same inside a git work tree or not);
nothing is written unless every hunk of every file applies.

    MIGRATOR_LLM_BASE_URL   e.g. http://127.0.0.1:8000/v1   (…/chat/completions is appended)
    MIGRATOR_LLM_MODEL      model name sent in the request (default: "default")
    MIGRATOR_LLM_API_KEY    bearer token, if the endpoint wants one (else "EMPTY" is sent)
    MIGRATOR_LLM_APPLY      1: apply diffs within the policy (what --apply-llm-patches sets)
    MIGRATOR_LLM_TIMEOUT_S  overall deadline for one request, reply included (default: 120)
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from agent.recipe.recipe import runner_files
from agent.recipe.backup import UnsafeRecipePath, atomic_write, real_dirs
from agent.repair.failure import Failure
from agent.repair.rules.rule import RepairContext, Rule
from agent.secrets import held, redact
from engine.safe_load import loads_json

TIMEOUT_S = 120
MAX_RESPONSE_BYTES = 1_000_000
MAX_FILE_CHARS = 40_000


class DiffRejected(ValueError):
    pass


def configured() -> bool:
    return bool(os.environ.get("MIGRATOR_LLM_BASE_URL"))


def relevant_file(failure: Failure) -> Path | None:
    """The recipe file named innermost in the traceback, else the runner."""
    for path, _line in reversed(failure.frames):
        candidate = Path(path)
        try:
            candidate.resolve().relative_to(failure.recipe_dir.resolve())
            return candidate
        except ValueError:
            continue
    runners = runner_files(failure.recipe_dir)
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


def _deadline_s() -> float:
    raw = os.environ.get("MIGRATOR_LLM_TIMEOUT_S")
    try:
        value = float(raw) if raw else float(TIMEOUT_S)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise DiffRejected(f"MIGRATOR_LLM_TIMEOUT_S={raw!r} is not a positive number of seconds")
    return value


def api_key() -> str | None:
    key = held("MIGRATOR_LLM_API_KEY")
    if key is not None and re.search(r"[\x00-\x1f\x7f]", key):
        raise DiffRejected("MIGRATOR_LLM_API_KEY contains control characters (CR, LF, ...); not sent: "
                           "set it to the bare key")
    return key or None


def base_url() -> str:
    url = os.environ.get("MIGRATOR_LLM_BASE_URL", "").strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c in url for c in "\0\r\n\t "):
        raise DiffRejected(f"MIGRATOR_LLM_BASE_URL is not an http(s) URL: {redact(url)[:100]!r}")
    return url


def request_reply(messages: list[dict], *, max_bytes: int = MAX_RESPONSE_BYTES, deadline_s: float | None = None) -> str:
    """The assistant's message text (untrusted), through the openai client (the optional [llm] extra).

    Around it: one overall deadline for connection, headers and body together (a watchdog closes the
    connection), the reply read incrementally and abandoned past `max_bytes`, no retries, and every
    failure mapped to one DiffRejected line with no secret in it."""
    deadline_s = _deadline_s() if deadline_s is None else deadline_s
    url, key = base_url(), api_key()
    try:
        import httpx
        import openai
    except ImportError:
        raise DiffRejected("the LLM repairer needs the openai library: pip install 'infer-migrator[llm]'") from None
    http = httpx.Client(timeout=httpx.Timeout(deadline_s))
    # "EMPTY" is the placeholder OpenAI-compatible servers (vLLM, llama.cpp, ...) take when they want no key.
    client = openai.OpenAI(base_url=url, api_key=key or "EMPTY", max_retries=0, timeout=deadline_s, http_client=http)
    start = time.monotonic()
    expired = threading.Event()

    def cut():                  # the deadline: unblock whatever read is waiting
        expired.set()
        http.close()

    watchdog = threading.Timer(deadline_s, cut)
    watchdog.daemon = True
    watchdog.start()
    data = bytearray()
    try:
        with client.chat.completions.with_streaming_response.create(
                model=os.environ.get("MIGRATOR_LLM_MODEL", "default"), messages=messages, temperature=0) as response:
            length = response.headers.get("content-length")
            if length and length.strip().isdigit() and int(length) > max_bytes:
                raise DiffRejected(f"reply larger than {max_bytes} bytes (Content-Length {int(length)})")
            for chunk in response.iter_bytes(64 * 1024):
                data += chunk
                if len(data) > max_bytes:
                    raise DiffRejected(f"reply larger than {max_bytes} bytes")
                if expired.is_set():
                    break
    except DiffRejected:
        raise
    except openai.APIStatusError as exc:
        raise DiffRejected(f"endpoint answered HTTP {exc.status_code}") from None
    except (openai.OpenAIError, httpx.HTTPError, OSError, RuntimeError, ValueError) as exc:
        if expired.is_set() or isinstance(exc, openai.APITimeoutError) or time.monotonic() - start >= deadline_s:
            raise DiffRejected(f"no complete reply within the deadline of {deadline_s:g} s") from None
        cause = exc.__cause__ or exc
        host = urllib.parse.urlsplit(url)
        raise DiffRejected(redact(f"endpoint {host.hostname}:{host.port or ''} failed: "
                                  f"{cause.__class__.__name__}: {' '.join(str(cause).split())[:200]}")) from None
    finally:
        watchdog.cancel()
        http.close()
    if expired.is_set() or time.monotonic() - start > deadline_s:
        raise DiffRejected(f"no complete reply within the deadline of {deadline_s:g} s")
    try:
        reply = loads_json(bytes(data))
    except ValueError:
        raise DiffRejected("the reply is not JSON") from None
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise DiffRejected("the reply has no choices[0].message.content") from None
    if not isinstance(content, str):
        raise DiffRejected("the reply's content is not text")
    return content


def request_diff(messages: list[dict], **limits) -> str:
    return extract_diff(request_reply(messages, **limits))


# ---- unified diff: parse, check, apply ------------------------------------------------------
REGULAR_MODES = ("100644", "100755")
FORBIDDEN_DIRS = {".migrator", ".git"}


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list = field(default_factory=list)      # [tag (" ", "-", "+"), text, ends with a newline]


@dataclass
class FilePatch:
    old: str | None             # None: /dev/null
    new: str | None
    hunks: list
    git_header: str | None = None
    new_file_mode: str | None = None


def _lines(text: str) -> list[str]:
    return [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]


def extract_diff(content: str) -> str:
    """The diff in a reply: from its first header line on (a fence around it, or fences inside
    its hunks, do not cut it; the parser stops at what is not diff)."""
    lines = content.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("diff --git ") or (line.startswith("--- ") and i + 1 < len(lines)
                                              and lines[i + 1].startswith("+++ ")):
            return "\n".join(lines[i:])
    raise DiffRejected("not a unified diff")


def _path(raw: str) -> str | None:
    raw = raw.split("\t")[0].rstrip()
    if raw.startswith('"'):
        raise DiffRejected(f"quoted path {raw[:80]!r} (special characters) is not accepted")
    return None if raw == "/dev/null" else raw


def _check_header(line: str) -> str | None:
    """Rejects every extended git header but index lines of regular files; returns a new file's mode."""
    if line.startswith("new file mode "):
        mode = line.split()[-1]
        if mode == "120000":
            raise DiffRejected("the diff creates a symlink (new file mode 120000)")
        if mode != "100644":
            raise DiffRejected(f"the diff creates a file with mode {mode}; only regular 100644 files")
        return mode
    if line.startswith(("old mode ", "new mode ")):
        raise DiffRejected("the diff changes a file mode")
    if line.startswith("deleted file mode"):
        raise DiffRejected("the diff deletes a file")
    if line.startswith(("copy from", "copy to", "rename from", "rename to", "similarity index",
                        "dissimilarity index")):
        raise DiffRejected("the diff copies or renames a file")
    if line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
        raise DiffRejected("the diff is a binary patch")
    if line.startswith("index "):
        fields = line.split()
        if len(fields) == 3 and fields[2] == "120000":
            raise DiffRejected("the diff edits a symlink (mode 120000)")
        if len(fields) == 3 and fields[2] not in REGULAR_MODES:
            raise DiffRejected(f"the diff names mode {fields[2]}; only regular files")
        return None
    raise DiffRejected(f"unsupported diff header {line[:80]!r}")


def parse_diff(diff: str) -> list[FilePatch]:
    """The diff's files and hunks, parsed with unidiff; every extended git header but the index line of a
    regular file is refused (_check_header), and so is what unidiff accepts but an applier must not guess
    at: a file section without hunks, text between two hunks, hunks whose line counts do not match."""
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    text = "\n".join(_lines(diff))
    try:
        parsed = PatchSet(text)
    except UnidiffParseError as exc:
        message = str(exc)
        if any(k in message for k in ("shorter than expected", "longer than expected", "Hunk diff line expected")):
            raise DiffRejected("malformed hunk (its line counts do not match)") from None
        if message.startswith("Unexpected hunk"):
            raise DiffRejected("a hunk outside a file section (text between hunks?)") from None
        raise DiffRejected(f"malformed diff: {message[:120]}") from None
    patches: list[FilePatch] = []
    for pf in parsed:
        info = list(pf.patch_info or [])
        git = next((i for i, ln in enumerate(info) if ln.startswith("diff --git ")), None)
        new_mode = None
        if git is not None:
            for line in info[git + 1:]:
                if line.strip():
                    new_mode = _check_header(line.rstrip("\n")) or new_mode
        if pf.is_binary_file:
            raise DiffRejected("the diff is a binary patch")
        header = info[git].rstrip("\n")[len("diff --git "):] if git is not None else None
        if not len(pf):
            raise DiffRejected(f"no hunks for {pf.target_file or pf.source_file}"
                               if header is None else f"the diff section {header[:80]!r} has no ---/+++ lines and hunks")
        hunks = []
        for k, uh in enumerate(pf):
            hunk = Hunk(uh.source_start, uh.source_length, uh.target_start, uh.target_length)
            for line in uh:
                if line.line_type == "\\":
                    if not hunk.lines:
                        raise DiffRejected("malformed hunk: a no-newline marker before any line")
                    hunk.lines[-1][2] = False
                elif line.line_type == "":          # unidiff: a blank line after a complete hunk
                    if k + 1 < len(pf):
                        raise DiffRejected("a hunk outside a file section (text between hunks?)")
                else:
                    hunk.lines.append([line.line_type, line.value.rstrip("\n"), True])
            hunks.append(hunk)
        patches.append(FilePatch(_path(pf.source_file), _path(pf.target_file), hunks, header, new_mode))
    if not patches:
        raise DiffRejected("not a unified diff")
    return patches


def _target(root: Path, raw: str) -> tuple[str, Path]:
    """The recipe-relative path of a diff path; refused outside the recipe or through a symlink."""
    rel = raw[2:] if raw.startswith(("a/", "b/")) else raw
    if not rel or "\0" in rel or "\\" in rel or rel.startswith("/") or Path(rel).is_absolute():
        raise DiffRejected(f"diff touches {raw[:100]}, outside the recipe (absolute or empty path)")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise DiffRejected(f"diff touches {raw[:100]}, outside the recipe (..)")
    if set(parts) & FORBIDDEN_DIRS:
        raise DiffRejected(f"diff touches {raw[:100]}: .migrator/ and .git/ are outside the recipe's sources")
    if not parts:
        raise DiffRejected(f"diff touches {raw[:100]}, not a file")
    path = root
    for part in parts[:-1]:
        path = path / part
        if path.is_symlink():
            raise DiffRejected(f"diff touches {raw[:100]} through a symlink ({path.relative_to(root)})")
        if path.exists() and not path.is_dir():
            raise DiffRejected(f"diff touches {raw[:100]} below a file")
    return "/".join(parts), root.joinpath(*parts)


def _split_keepends(text: str) -> list[str]:
    pieces = text.split("\n")
    out = [p + "\n" for p in pieces[:-1]]
    return out + [pieces[-1]] if pieces[-1] else out


def _bare(line: str) -> str:
    line = line[:-1] if line.endswith("\n") else line
    return line[:-1] if line.endswith("\r") else line


def _find(lines: list[str], block: list[str], expected: int, lo: int) -> int | None:
    hi = len(lines) - len(block)
    if hi < lo:
        return None
    expected = min(max(expected, lo), hi)
    for delta in range(0, max(expected - lo, hi - expected) + 1):
        for pos in ((expected - delta, expected + delta) if delta else (expected,)):
            if lo <= pos <= hi and all(_bare(lines[pos + k]) == block[k] for k in range(len(block))):
                return pos
    return None


def apply_hunks(text: str, hunks: list[Hunk], rel: str) -> str:
    """Apply hunks in order, each where its context matches (nearest to its line number); new lines
    take the file's dominant line ending."""
    lines = _split_keepends(text)
    crlf = sum(ln.endswith("\r\n") for ln in lines)
    eol = "\r\n" if crlf * 2 > sum(ln.endswith("\n") for ln in lines) else "\n"
    out, pos, offset = [], 0, 0
    for hunk in hunks:
        block = [t for tag, t, _nl in hunk.lines if tag in " -"]
        expected = (hunk.old_start - 1 if hunk.old_len else hunk.old_start) + offset
        found = _find(lines, block, expected, pos)
        if found is None:
            raise DiffRejected(f"diff does not apply: hunk @@ -{hunk.old_start},{hunk.old_len} does not match {rel}")
        offset = found - (hunk.old_start - 1 if hunk.old_len else hunk.old_start)
        out.extend(lines[pos:found])
        idx = found
        for k, (tag, t, nl) in enumerate(hunk.lines):
            if tag == " ":
                line = lines[idx]
                if not line.endswith("\n") and any(tg == "+" for tg, _, _ in hunk.lines[k + 1:]):
                    line += eol          # the old last line, now followed by added lines
                out.append(line)
                idx += 1
            elif tag == "-":
                idx += 1
            else:
                out.append(t + (eol if nl else ""))
        pos = idx
    out.extend(lines[pos:])
    return "".join(out)


def plan_diff(diff: str, recipe_dir: Path) -> list[tuple[str, Path, bytes, int | None]]:
    """Check the whole diff and compute the new files: [(rel, path, bytes, mode or None for new)]."""
    root = recipe_dir.resolve()
    plan, seen = [], set()
    for patch in parse_diff(diff):
        if patch.new is None:
            raise DiffRejected(f"the diff deletes {patch.old}")
        if patch.old is not None:
            old_rel = patch.old[2:] if patch.old.startswith("a/") else patch.old
            new_rel = patch.new[2:] if patch.new.startswith("b/") else patch.new
            if old_rel != new_rel:
                _target(root, patch.old)
                _target(root, patch.new)
                raise DiffRejected(f"the diff renames {patch.old} to {patch.new}")
        rel, path = _target(root, patch.new)
        if patch.git_header is not None and patch.git_header not in (f"a/{rel} b/{rel}", f"{rel} {rel}"):
            raise DiffRejected(f"the diff header names other paths than {rel}")
        if rel in seen:
            raise DiffRejected(f"the diff patches {rel} twice")
        seen.add(rel)
        if path.is_symlink():
            raise DiffRejected(f"diff touches {rel}, a symlink")
        if patch.old is None:            # creation
            if path.exists():
                raise DiffRejected(f"the diff creates {rel}, which exists")
            if any(tag != "+" for hunk in patch.hunks for tag, _, _ in hunk.lines) or len(patch.hunks) != 1:
                raise DiffRejected(f"malformed creation of {rel}")
            text = "".join(t + ("\n" if nl else "") for _, t, nl in patch.hunks[0].lines)
            plan.append((rel, path, text.encode("utf-8"), None))
            continue
        if patch.new_file_mode:
            raise DiffRejected(f"the diff creates {rel} but names an old version")
        if not path.is_file():
            raise DiffRejected(f"diff does not apply: {rel} is not a file of the recipe")
        data = path.read_bytes()
        if b"\0" in data:
            raise DiffRejected(f"{rel} is not a text file")
        bom = data.startswith(b"\xef\xbb\xbf")
        try:
            text = data.decode("utf-8-sig" if bom else "utf-8")
        except UnicodeDecodeError:
            raise DiffRejected(f"{rel} is not UTF-8 text") from None
        new = apply_hunks(text, patch.hunks, rel)
        plan.append((rel, path, (b"\xef\xbb\xbf" if bom else b"") + new.encode("utf-8"), path.stat().st_mode))
    return plan


def apply_diff(diff: str, recipe_dir: Path) -> list[str]:
    """Check everything, then write (nothing is written unless every file applies)."""
    plan = plan_diff(diff, recipe_dir)
    root = recipe_dir.resolve()
    for rel, path, data, mode in plan:
        try:
            real_dirs(root, *rel.split("/")[:-1])
        except UnsafeRecipePath as exc:
            raise DiffRejected(str(exc)) from None
        atomic_write(path, data, mode, root=recipe_dir)
    return sorted(rel for rel, *_ in plan)


# ---- the policy: an LLM diff is a proposal; applied only when asked, and only to the failing files ----
APPLY_ENV = "MIGRATOR_LLM_APPLY"        # set by `migrator run --apply-llm-patches`
PROPOSALS_DIR = (".migrator", "llm")


def apply_requested() -> bool:
    return os.environ.get(APPLY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def editable_files(failure: Failure) -> set[str]:
    """What an applied LLM diff may change: the recipe's Python files the failure's traceback names, and
    the file the request showed (the runner when no frame is in the recipe). Never infer.sh, the YAML,
    a new file."""
    allowed = {rel for rel, _line in failure.recipe_frames()}
    shown = relevant_file(failure)
    if shown is not None:
        allowed.add(str(shown.resolve().relative_to(failure.recipe_dir.resolve())))
    return allowed


def save_proposal(recipe_dir: Path, diff: str) -> Path:
    """The checked diff, kept for review as .migrator/llm/proposal_N.diff (recipe-relative)."""
    folder = real_dirs(recipe_dir.resolve(), *PROPOSALS_DIR)
    n = 1 + sum(1 for p in folder.glob("proposal_*.diff"))
    path = folder / f"proposal_{n}.diff"
    atomic_write(path, diff.encode("utf-8"), 0o100644, root=recipe_dir)
    return path.relative_to(recipe_dir.resolve())


def _configured(failure: Failure, found=None) -> dict | None:
    return {} if configured() else None


def _fix(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    recipe = failure.recipe_dir
    try:
        diff = request_diff(build_messages(failure))
        if redact(diff) != diff:
            raise DiffRejected("the reply contains the API key; nothing is kept or applied")
        touched = sorted(rel for rel, *_ in plan_diff(diff, recipe))   # checks every path, raises DiffRejected
        saved = save_proposal(recipe, diff)
    except (DiffRejected, UnsafeRecipePath, OSError) as exc:
        return redact(f"LLM diff rejected: {exc}")
    if not apply_requested():
        return (f"an LLM proposed a diff to {', '.join(touched)}, not applied (LLM diffs are proposals by default): "
                f"review {saved}, then `cd {recipe} && patch -p1 < {saved}` or rerun with --apply-llm-patches")
    outside = [rel for rel in touched if rel not in editable_files(failure)]
    if outside:
        return (f"LLM diff not applied: it changes {', '.join(outside)}, which the failure's traceback does not "
                f"name (an applied LLM diff may change only {', '.join(sorted(editable_files(failure)))}); "
                f"the proposal is in {saved}")
    try:
        applied = apply_diff(diff, recipe)
    except DiffRejected as exc:
        return redact(f"LLM diff rejected: {exc}")
    return f"applied LLM diff to {', '.join(applied)} (kept in {saved})"


RULE = Rule("llm_repairer", None, "no rule matched; an LLM proposed a patch", _fix, facts=_configured, kind="llm")
