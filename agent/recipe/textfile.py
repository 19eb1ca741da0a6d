"""Editing a user's text file with its bytes otherwise kept: line endings (per line), encoding,
BOM and mode. A fix edits text read with `read_source` and writes it back with `write_source`."""

from __future__ import annotations

import difflib
from pathlib import Path

from agent.recipe.fs_guard import user_tree


BOMS = (b"\xef\xbb\xbf",)


def detect_format(data: bytes) -> dict:
    """{bom, encoding, newline} of a text file's bytes (newline: the dominant line ending)."""
    bom = next((b for b in BOMS if data.startswith(b)), b"")
    body = data[len(bom):]
    encoding = "utf-8"
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        encoding = "gb18030"
        try:
            body.decode(encoding)
        except UnicodeDecodeError:
            encoding = "latin-1"
    crlf = body.count(b"\r\n")
    lf = body.count(b"\n") - crlf
    cr = body.count(b"\r") - crlf
    newline = "\r\n" if crlf > lf and crlf >= cr else ("\r" if cr > lf else "\n")
    return {"bom": bom, "encoding": encoding, "newline": newline}


def read_source(path: Path) -> str:
    """A file's text with '\n' line endings and no BOM, whatever its encoding: edit this, then
    write it back with write_source (which restores the original bytes' format)."""
    data = path.read_bytes()
    fmt = detect_format(data)
    text = data[len(fmt["bom"]):].decode(fmt["encoding"])
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _lines(data: str) -> list[str]:
    return data.splitlines(keepends=True)


def restore_format(original: bytes, new: bytes) -> bytes:
    """`new` (bytes a fix wrote) re-encoded like `original`: unchanged lines keep their exact
    original bytes (line endings included), changed lines get the file's dominant line ending,
    and the BOM and encoding are the original's. Returns `new` untouched when it is not text."""
    fmt = detect_format(original)
    old_text = original[len(fmt["bom"]):].decode(fmt["encoding"])
    new_body = new[len(fmt["bom"]):] if fmt["bom"] and new.startswith(fmt["bom"]) else new
    try:
        new_text = new_body.decode("utf-8")
    except UnicodeDecodeError:
        try:
            new_text = new_body.decode(fmt["encoding"])
        except UnicodeDecodeError:
            return new
    new_text = new_text.lstrip("\ufeff") if fmt["bom"] else new_text
    old_lines, new_lines = _lines(old_text), _lines(new_text)
    strip = lambda line: line.rstrip("\r\n")   # noqa: E731
    matcher = difflib.SequenceMatcher(None, [strip(x) for x in old_lines], [strip(x) for x in new_lines],
                                      autojunk=False)
    out: list[str] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                old_line, new_line = old_lines[i1 + k], new_lines[j1 + k]
                # keep the original ending, unless the fix changed whether the line ends at all
                ends_old = old_line != strip(old_line)
                ends_new = new_line != strip(new_line)
                out.append(old_line if ends_old == ends_new else
                           strip(old_line) + (fmt["newline"] if ends_new else ""))
        else:
            for line in new_lines[j1:j2]:
                body = strip(line)
                out.append(body + (fmt["newline"] if line != body else ""))
    try:
        encoded = "".join(out).encode(fmt["encoding"])
    except UnicodeEncodeError:
        encoded = "".join(out).encode("utf-8")
    return fmt["bom"] + encoded


def write_source(path: Path, text: str, original: bytes | None = None, *, root: Path) -> None:
    """Write edited text back keeping the file's original bytes format (see restore_format) and
    its mode. `original`: the file's bytes before the edit (default: what is on disk now). `root`:
    the recipe the file is in: a link anywhere between it and the file that leads out is refused."""
    if original is None:
        original = path.read_bytes() if path.is_file() else b""
    mode = path.stat().st_mode if path.exists() else None
    data = text.encode("utf-8")
    user_tree(root).write_bytes(path, restore_format(original, data) if original else data,
                                None if mode is None else mode & 0o777)


def restore_formats(recipe_dir: Path, snapshot: dict[str, tuple[bytes, int]]) -> list[str]:
    """After a fix: every file it changed gets its original line endings, encoding, BOM and mode
    back (the edit itself is kept). Returns the files whose format was restored."""
    fixed = []
    recipe_tree = user_tree(recipe_dir)
    for rel, (original, mode) in snapshot.items():
        path = recipe_dir / rel
        try:
            if not path.is_file():
                continue
            current = path.read_bytes()
            changed = False
            if current != original:
                restored = restore_format(original, current)
                if restored != current:
                    recipe_tree.write_bytes(path, restored)
                    changed = True
            if path.stat().st_mode & 0o777 != mode & 0o777:
                recipe_tree.chmod(path, mode & 0o777)
                changed = True
        except OSError:
            continue
        if changed:
            fixed.append(rel)
    return fixed


def read_exact_lines(path: Path) -> list[str]:
    """Lines with their exact endings (no newline translation), for a true diff."""
    data = path.read_bytes()
    fmt = detect_format(data)
    return data[len(fmt["bom"]):].decode(fmt["encoding"], errors="replace").splitlines(True)
