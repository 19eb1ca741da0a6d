"""The one check every hub reference goes through (Hugging Face and ModelScope, SPEC §6): a repo id,
a revision and the file names a hub or its index names are validated after URL-decoding (repeatedly:
`%252F` is `/` too) before any cache lookup or download, and every path a hub library hands back must
lie inside that hub's cache.

- revision: a branch or tag name by git's ref-name rules (`git check-ref-format`), or a commit hash;
  never `..`, an absolute path, a backslash, a control character or a `%` left after decoding;
- repo id: `Org/Name` of letters, digits, `-`, `_`, `.` (no `..`, no leading `.` or `-`);
- file names (a weight index's shards, a listing's paths): relative, `/`-separated, no `..` or `.`
  segment, no backslash, no control character.

A bad reference is an InputError (exit 2) naming the part and what is wrong with it.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

from agent.errors import InputError

MAX_DECODE_ROUNDS = 8
MAX_REVISION = 255
MAX_NAME_PART = 96
MAX_FILENAME = 1024
COMMIT_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
NAME_PART_RE = re.compile(r"^\w[\w.-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# characters git refuses anywhere in a ref name, plus '%' (left after full decoding: never a real name)
_REF_FORBIDDEN = set(" ~^:?*[\\%")


class BadHubReference(InputError):
    """A hub reference whose repo id, revision or a file name is not what the hub allows."""


def decoded(text: str) -> str:
    """`text` URL-decoded until it no longer changes (`%252F` -> `%2F` -> `/`), at most 8 rounds."""
    text = str(text)
    for _ in range(MAX_DECODE_ROUNDS):
        try:
            once = unquote(text, errors="strict")
        except UnicodeDecodeError:
            raise BadHubReference(f"{_shown(text)}: URL-encodes bytes that are not UTF-8") from None
        if once == text:
            return text
        text = once
    raise BadHubReference(f"{_shown(text)}: still URL-encoded after {MAX_DECODE_ROUNDS} rounds of decoding")


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:79] + "…")


def revision_problem(revision: str) -> str | None:
    """Why `revision` (already decoded) is not a branch, tag or commit hash; None when it is one."""
    shown = _shown(revision)
    if not revision:
        return "an empty revision"
    if COMMIT_RE.match(revision):
        return None
    if len(revision) > MAX_REVISION:
        return f"revision {shown} is longer than {MAX_REVISION} characters"
    if _CONTROL.search(revision) or any(unicodedata.category(c)[0] in "CZ" for c in revision):
        return f"revision {shown} contains control, format or space characters"
    if "\ufffd" in revision:
        return f"revision {shown} URL-encodes bytes that are not UTF-8"
    if revision.startswith("/") or re.match(r"^[A-Za-z]:", revision) or revision.startswith("~"):
        return f"revision {shown} is an absolute path, not a branch, tag or commit hash"
    if "\\" in revision:
        return f"revision {shown} contains a backslash"
    if any(seg == ".." for seg in revision.split("/")) or ".." in revision:
        return f"revision {shown} contains '..'"
    bad = sorted(set(revision) & _REF_FORBIDDEN)
    if bad:
        return f"revision {shown} contains {''.join(bad)!r}, which git does not allow in a branch or tag name"
    if revision.startswith("-"):
        return f"revision {shown} starts with '-'"
    if revision == "@" or "@{" in revision:
        return f"revision {shown} is not a branch or tag name ('@{{' / '@')"
    if revision.endswith("/") or "//" in revision:
        return f"revision {shown} has an empty '/' component"
    if revision.endswith("."):
        return f"revision {shown} ends with '.'"
    for part in revision.split("/"):
        if part.startswith("."):
            return f"revision {shown} has a component starting with '.'"
        if part.endswith(".lock"):
            return f"revision {shown} has a component ending with '.lock'"
    return None


def repo_id_problem(repo_id: str, hub: str = "Hugging Face") -> str | None:
    """Why `repo_id` (already decoded) is not a hub model id Org/Name; None when it is one."""
    shown = _shown(repo_id)
    if _CONTROL.search(repo_id):
        return f"repo id {shown} contains control characters"
    if "\\" in repo_id:
        return f"repo id {shown} contains a backslash"
    parts = repo_id.split("/")
    if repo_id.startswith("/") or len(parts) != 2 or not all(parts):
        return f"repo id {shown} is not a {hub} model id (Org/Name)"
    for part in parts:
        if part in (".", "..") or ".." in part:
            return f"repo id {shown} contains '..'"
        if len(part) > MAX_NAME_PART or not NAME_PART_RE.match(part):
            return (f"repo id {shown} is not a {hub} model id (Org/Name: letters, digits, '-', '_', '.'; "
                    f"not starting with '.' or '-', at most {MAX_NAME_PART} each)")
    return None


def filename_problem(name: str) -> str | None:
    """Why `name` (a path inside a hub repo, already decoded) is not a safe relative file name."""
    shown = _shown(name)
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is empty or not a string"
    if len(name) > MAX_FILENAME:
        return f"file name {shown} is longer than {MAX_FILENAME} characters"
    if _CONTROL.search(name):
        return f"file name {shown} contains control characters"
    if "\\" in name:
        return f"file name {shown} contains a backslash"
    if name.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", name):
        return f"file name {shown} is an absolute path"
    if any(seg in ("", ".", "..") for seg in name.split("/")):
        return f"file name {shown} has an empty, '.' or '..' segment"
    if set(name) & set("*?[]"):
        return f"file name {shown} contains a glob character (it would select other files to download)"
    return None


def _printable(label: str) -> str:
    """A reference as given, safe on one line (control characters escaped)."""
    text = label if len(label) <= 200 else label[:199] + "…"
    return repr(text)[1:-1] if _CONTROL.search(text) or any(unicodedata.category(c) == "Cf" for c in text) else text


def checked_revision(revision: str | None, label: str) -> str | None:
    """The decoded revision, or BadHubReference naming `label` (the reference as given)."""
    if revision is None:
        return None
    label = _printable(label)
    value = decoded(revision)
    problem = revision_problem(value)
    if problem:
        raise BadHubReference(f"{label}: {problem}; give a branch, tag or commit hash of the repository")
    return value


def checked_repo_id(repo_id: str, label: str, hub: str = "Hugging Face") -> str:
    label = _printable(label)
    value = decoded(repo_id)
    problem = repo_id_problem(value, hub)
    if problem:
        raise BadHubReference(f"{label}: {problem}")
    return value


def checked_filenames(names, where: str) -> list[str]:
    """Every name decoded and checked; BadHubReference naming `where` (the index or listing) otherwise."""
    out = []
    for raw in names:
        if not isinstance(raw, str):
            raise BadHubReference(f"{where}: file name {raw!r} is not a string")
        try:
            name = decoded(raw)
        except BadHubReference as exc:
            raise BadHubReference(f"{where}: {exc}") from None
        problem = filename_problem(name)
        if problem or name != raw:
            raise BadHubReference(f"{where}: {problem or f'file name {_shown(raw)} is URL-encoded'}; "
                                  "the repository's file names must be plain relative paths")
        out.append(name)
    return out


def inside_cache(path: str | os.PathLike, cache: str | os.PathLike, label: str) -> Path:
    """`path` (as the hub library returned it) resolved, refused unless it lies inside `cache`."""
    resolved = Path(path).resolve()
    root = Path(cache).expanduser().resolve()
    if resolved != root and root not in resolved.parents:
        raise BadHubReference(f"{label}: the hub library returned {resolved}, which is outside its cache "
                              f"{root}; refusing to read it (check the revision and the cache)")
    return resolved


MAX_TREE_ENTRIES = 100_000


def inside_cache_tree(folder: str | os.PathLike, cache: str | os.PathLike, label: str) -> Path:
    """`folder` (a snapshot the hub library returned) and every entry under it resolved inside `cache`
    (a snapshot's files are links into the cache's blobs); returns the folder as given, made absolute,
    so its files keep the names the hub gave them."""
    inside_cache(folder, cache, label)
    root = Path(cache).expanduser().resolve()
    seen = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            seen += 1
            if seen > MAX_TREE_ENTRIES:
                raise BadHubReference(f"{label}: the snapshot {folder} holds more than {MAX_TREE_ENTRIES} entries")
            entry = Path(dirpath) / name
            resolved = entry.resolve()
            if resolved != root and root not in resolved.parents:
                raise BadHubReference(f"{label}: {entry} in the hub's snapshot resolves to {resolved}, outside "
                                      f"its cache {root}; refusing to read it")
    return Path(os.path.abspath(folder))
