"""The one loader for every YAML and JSON file the migrator and a recipe read (SPEC §6): ours (recipe YAML,
reports, journals, stores) and upstream's (a checkout's YAML), and a checkpoint's JSON.

It lives in engine/ because a standalone recipe carries engine/ and must load its own YAML the same way
without infer-migrator installed: stdlib and PyYAML only, nothing from agent/.

Bounded by construction, never by what the machine happens to survive:
- size: the bytes are read with a cap (a FIFO, a device or a 5 GB file are refused, never read in full);
- UTF-8: bytes that are not UTF-8 are named (offset, line and column);
- YAML aliases: counted while the document is composed; the *expanded* node count (what walking the
  result would visit) is bounded, so an alias bomb is refused from its few hundred bytes, before any
  Python object is built; an alias to its own enclosing node (a recursive structure) is refused;
- depth (expanded through aliases too) and node count;
- duplicate mapping keys (YAML and JSON) are refused, naming the key and its line;
- a value that cannot be built as its type (YAML's `2001-13-45` date, `!!int "x"`, an integer of more than
  MAX_NUMBER_DIGITS digits in YAML or JSON) is refused at its line, never raised as Python's own error.

Every refusal is a LoadError (a ValueError and a yaml.YAMLError, so callers' existing handlers keep
working) whose message is one line: "FILE: PROBLEM at line N, column C; HINT".
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

YAML_MAX_BYTES = 16 * 2**20
JSON_MAX_BYTES = 1 * 2**30           # tokenizer.json can be large; /dev/zero cannot pass
MAX_DEPTH = 100
YAML_MAX_NODES = 1_000_000           # expanded through aliases
YAML_MAX_ALIASES = 10_000
JSON_MAX_NODES = 50_000_000
MAX_NUMBER_DIGITS = 4300             # Python's own default limit of an int's decimal digits
MAX_INT_BITS = int(MAX_NUMBER_DIGITS * 3.32)


class LoadError(yaml.YAMLError, ValueError):
    """A YAML or JSON file that cannot be used as given: one line naming the file, the place and what to do."""

    def __init__(self, name: str, problem: str, line: int | None = None, column: int | None = None,
                 hint: str = "fix the file", kind: str = "bound", syntax: yaml.MarkedYAMLError | None = None):
        self.name, self.problem, self.line, self.column, self.hint = str(name), problem, line, column, hint
        # kind: "syntax" (a slip a repair may fix: `syntax` is PyYAML's own error, its marks included),
        # "encoding", "duplicate", "bound" (size, depth, nodes, aliases, digits), "file" (not a regular
        # file), "value" (a scalar that cannot be built as its type)
        self.kind, self.syntax = kind, syntax
        where = ""
        if line is not None:
            where = f" at line {line}" + (f", column {column}" if column is not None else "")
        super().__init__(_one_line(f"{self.name}: {problem}{where}; {hint}"))

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_depth: int = MAX_DEPTH
    max_nodes: int = YAML_MAX_NODES
    max_aliases: int = YAML_MAX_ALIASES


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---- bytes --------------------------------------------------------------------------------------
def read_capped(path: str | os.PathLike, max_bytes: int, hint: str = "fix the file") -> bytes:
    """The bytes of a regular file (a symlink to one is fine), at most `max_bytes`; a FIFO, a device, a
    folder or a larger file is a LoadError. Opened non-blocking, checked again on the open file."""
    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise LoadError(name, "is a folder, not a file", hint=hint, kind="file") from None
    except OSError as exc:
        if exc.errno == 40:   # ELOOP
            raise LoadError(name, "a symlink loop", hint="remove the link or point it at a real file", kind="file") from None
        if exc.errno == 2 and os.path.islink(path):      # ENOENT through a link: a dangling one
            raise LoadError(name, f"a symlink to {os.readlink(path)}, which does not exist",
                            hint="remove the link or point it at the real file", kind="file") from None
        if exc.errno == 6:    # ENXIO: a socket
            raise LoadError(name, "a socket, not a regular file", hint="remove it", kind="file") from None
        raise               # a file that is not there: the caller's "absent"; permissions: the caller's fault class
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoadError(name, "not a regular file (a FIFO, a device or a socket)", hint="remove it", kind="file")
        if st.st_size > max_bytes:
            raise LoadError(name, f"is {st.st_size} bytes, larger than the {max_bytes}-byte limit for such a file",
                            hint=hint)
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise LoadError(name, f"larger than the {max_bytes}-byte limit for such a file", hint=hint)
    return data


def decode_utf8(data: bytes, name: str, hint: str = "re-save it as UTF-8") -> str:
    """`data` as text; bytes that are not UTF-8 are named with their offset, line and column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise LoadError(name, f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})", line, column,
                        hint=hint, kind="encoding") from None


# ---- YAML -----------------------------------------------------------------------------------------
class _Refused(Exception):
    def __init__(self, problem: str, mark, kind: str = "bound"):
        super().__init__(problem)
        self.problem, self.mark, self.kind = problem, mark, kind


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer counts what the document expands to before anything is constructed."""

    def __init__(self, stream, limits: Limits):
        super().__init__(stream)
        self._limits = limits
        self._depth = 0
        self._nodes = 0       # expanded nodes so far
        self._aliases = 0
        self._size: dict[int, int] = {}     # id(node) -> expanded size of its subtree
        self._height: dict[int, int] = {}   # id(node) -> expanded height of its subtree

    def compose_node(self, parent, index):
        limits = self._limits
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > limits.max_aliases:
                raise _Refused(f"more than {limits.max_aliases} aliases", mark)
            node = super().compose_node(parent, index)
            size = self._size.get(id(node))
            if size is None:
                raise _Refused("an alias to its own enclosing node (a recursive structure)", mark)
            if self._depth + self._height[id(node)] > limits.max_depth:
                raise _Refused(f"nested deeper than {limits.max_depth} levels (through aliases)", mark)
            self._grow(size, mark)
            return node
        self._depth += 1
        if self._depth > limits.max_depth:
            raise _Refused(f"nested deeper than {limits.max_depth} levels", mark)
        before = self._nodes
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._grow(1, mark)
        self._size[id(node)] = self._nodes - before
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
            self._check_keys(node)
        else:
            children = []
        self._height[id(node)] = 1 + max((self._height.get(id(c), 1) for c in children), default=0)
        return node

    def _grow(self, count: int, mark) -> None:
        self._nodes += count
        if self._nodes > self._limits.max_nodes:
            raise _Refused(f"expands to more than {self._limits.max_nodes} nodes (aliases included: an alias "
                           "bomb or a file far larger than a settings file)", mark)

    def construct_object(self, node, deep=False):
        # a scalar whose type's constructor fails (a date of month 13, `!!int "x"`, `!!float ''`, a 5000-digit
        # int): PyYAML raises Python's own ValueError / KeyError / IndexError there, with no place; name the
        # node's line instead
        try:
            value = super().construct_object(node, deep)
        except (yaml.YAMLError, _Refused, RecursionError):
            raise
        except Exception as exc:         # noqa: BLE001 - whatever a type's constructor raises on the file's text
            value = node.value if isinstance(node, yaml.ScalarNode) else ""
            shown = repr(value if len(value) <= 40 else value[:40] + "...")
            raise _Refused(f"the value {shown} cannot be read as {node.tag.rsplit(':', 1)[-1]} "
                           f"({type(exc).__name__}: {_one_line(exc)[:120]})", node.start_mark, "value") from None
        # 0x / base-60 integers convert without Python's digit limit, then fail wherever they are printed
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise _Refused(f"an integer of more than {MAX_NUMBER_DIGITS} digits", node.start_mark)
        return value

    @staticmethod
    def _check_keys(node) -> None:
        seen: dict[tuple, Any] = {}
        for key, _value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            ident = (key.tag, key.value)
            if ident in seen:
                first = seen[ident].start_mark.line + 1
                raise _Refused(f"duplicate key {key.value!r} (first at line {first})", key.start_mark, "duplicate")
            seen[ident] = key


def loads_yaml(text: str | bytes, name: str = "<yaml>", *, max_bytes: int = YAML_MAX_BYTES,
               max_depth: int = MAX_DEPTH, max_nodes: int = YAML_MAX_NODES, max_aliases: int = YAML_MAX_ALIASES,
               hint: str = "fix the file") -> Any:
    """One YAML document, bounded (module docstring); LoadError naming `name` and the line otherwise."""
    if isinstance(text, bytes):
        if len(text) > max_bytes:
            raise LoadError(name, f"larger than the {max_bytes}-byte limit for a YAML file", hint=hint)
        text = decode_utf8(text, name)
    elif len(text) > max_bytes:
        raise LoadError(name, f"larger than the {max_bytes}-byte limit for a YAML file", hint=hint)
    loader = None
    try:
        loader = _BoundedLoader(text, Limits(max_bytes, max_depth, max_nodes, max_aliases))
        return loader.get_single_data()
    except _Refused as exc:
        mark = exc.mark
        raise LoadError(name, exc.problem, mark.line + 1 if mark else None, mark.column + 1 if mark else None,
                        hint=hint, kind=exc.kind) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = _one_line(exc.problem or exc.context or type(exc).__name__)
        raise LoadError(name, f"not valid YAML ({type(exc).__name__}: {problem})", mark.line + 1 if mark else None,
                        mark.column + 1 if mark else None, hint=hint, kind="syntax", syntax=exc) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1 if isinstance(exc.position, int) else None
        char = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
        raise LoadError(name, f"not valid YAML (character {char} is not allowed in YAML: {exc.reason})", line,
                        hint=hint, kind="encoding") from None
    except yaml.YAMLError as exc:
        raise LoadError(name, f"not valid YAML ({_one_line(exc)})", hint=hint, kind="syntax") from None
    except RecursionError:
        raise LoadError(name, f"nested deeper than {max_depth} levels", hint=hint) from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml(path: str | os.PathLike, *, max_bytes: int = YAML_MAX_BYTES, hint: str = "fix the file",
              **limits) -> Any:
    """A YAML file read with a size cap and loaded with loads_yaml (None for an empty file)."""
    return loads_yaml(read_capped(path, max_bytes, hint), str(path), max_bytes=max_bytes, hint=hint, **limits)


# ---- JSON -----------------------------------------------------------------------------------------
class _Duplicate(Exception):
    pass


class _TooLong(Exception):
    pass


def _key_line(text: str, key: str, nth: int = 2) -> int | None:
    """The line of the `nth` occurrence of `"key":` in `text` (a duplicate key's second occurrence)."""
    import re

    found = 0
    for match in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text):
        found += 1
        if found == nth:
            return text.count("\n", 0, match.start()) + 1
    return None


def loads_json(text: str | bytes, name: str = "<json>", *, allow_nan: bool = True, max_bytes: int = JSON_MAX_BYTES,
               max_depth: int = MAX_DEPTH, max_nodes: int = JSON_MAX_NODES, hint: str = "fix the file") -> Any:
    """One JSON document, bounded in size, depth and nodes, duplicate keys refused; LoadError otherwise."""
    if isinstance(text, bytes):
        if len(text) > max_bytes:
            raise LoadError(name, f"larger than the {max_bytes}-byte limit for a JSON file", hint=hint)
        text = decode_utf8(text, name)
    elif len(text) > max_bytes:
        raise LoadError(name, f"larger than the {max_bytes}-byte limit for a JSON file", hint=hint)

    def pairs(items):
        data = dict(items)
        if len(data) != len(items):
            seen = set()
            for key, _ in items:
                if key in seen:
                    raise _Duplicate(key)
                seen.add(key)
        return data

    def number(digits: str) -> int:
        if len(digits) > MAX_NUMBER_DIGITS + 1:      # the sign counts once
            raise _TooLong(digits)
        return int(digits)

    def constant(word):
        at = text.find(word)
        raise LoadError(name, f"{word} is not a JSON number", text.count("\n", 0, at) + 1 if at >= 0 else None,
                        hint=hint, kind="syntax")

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_int=number,
                          **({} if allow_nan else {"parse_constant": constant}))
    except _TooLong as exc:
        at = text.find(exc.args[0])
        raise LoadError(name, f"a number of {len(exc.args[0])} digits (more than {MAX_NUMBER_DIGITS})",
                        text.count("\n", 0, at) + 1 if at >= 0 else None, hint=hint) from None
    except _Duplicate as exc:
        key = exc.args[0]
        raise LoadError(name, f"duplicate key {key!r}", _key_line(text, key), hint=hint, kind="duplicate") from None
    except json.JSONDecodeError as exc:
        raise LoadError(name, f"not valid JSON ({exc.msg})", exc.lineno, exc.colno, hint=hint, kind="syntax") from None
    except RecursionError:
        raise LoadError(name, f"nested deeper than {max_depth} levels", hint=hint) from None
    _check_tree(data, name, max_depth, max_nodes, hint)
    return data


def loads_json_prefix(text: str, name: str = "<json>", *, max_depth: int = MAX_DEPTH,
                      max_nodes: int = JSON_MAX_NODES) -> tuple[Any, int]:
    """The JSON value at the start of `text` and where it ends (json's raw_decode), bounded like loads_json."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as exc:
        raise LoadError(name, f"not valid JSON ({exc.msg})", exc.lineno, exc.colno, kind="syntax") from None
    except RecursionError:
        raise LoadError(name, f"nested deeper than {max_depth} levels") from None
    _check_tree(value, name, max_depth, max_nodes, "fix the file")
    return value, end


def load_json(path: str | os.PathLike, *, max_bytes: int = JSON_MAX_BYTES, hint: str = "fix the file",
              **limits) -> Any:
    """A JSON file read with a size cap and loaded with loads_json."""
    return loads_json(read_capped(path, max_bytes, hint), str(path), max_bytes=max_bytes, hint=hint, **limits)


def _check_tree(data: Any, name: str, max_depth: int, max_nodes: int, hint: str) -> None:
    """Depth and node count of a loaded JSON value, walked without recursion."""
    stack = [(data, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise LoadError(name, f"more than {max_nodes} values", hint=hint)
        if depth > max_depth:
            raise LoadError(name, f"nested deeper than {max_depth} levels", hint=hint)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
