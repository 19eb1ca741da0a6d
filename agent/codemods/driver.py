"""The one driver of the codemod commands: run a list of them on a source, or on a recipe file.

A command in a list is its class, or the class with its arguments bound (`command(Cls, **kwargs)`,
a functools.partial), as libcst's own codemod runner instantiates a command per file with its
arguments.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Union

import libcst as cst
from libcst.codemod import Codemod, CodemodContext
from engine.safe_write import UserTree

logger = logging.getLogger(__name__)

Command = Union[type[Codemod], Callable[[CodemodContext], Codemod]]
BOM = "\ufeff"


class CodemodError(Exception):
    """A command failed on a source file (or the file does not parse); the message names the command."""


def command(cls: type[Codemod], **kwargs) -> Command:
    """A command with its arguments bound."""
    return functools.partial(cls, **kwargs) if kwargs else cls


def name_of(cmd: Command) -> str:
    return (cmd.func if isinstance(cmd, functools.partial) else cmd).__name__


def transform(source: str, commands: Sequence[Command], context: CodemodContext | None = None,
              applied: list[str] | None = None) -> str:
    """Run the commands in order on one parse of `source` and return the new code. Each gets a fresh
    CodemodContext (its warnings are logged) unless `context` is given to share, e.g. to read its
    scratch. `applied`: the names of the commands that changed the code are appended to it."""
    try:
        tree = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise CodemodError(f"cannot parse source: {exc}") from exc
    code = tree.code
    for cmd in commands:
        ctx = context or CodemodContext()
        try:
            new_tree = cmd(ctx).transform_module(tree)
        except Exception as exc:
            raise CodemodError(f"{name_of(cmd)} failed: {exc}") from exc
        for warning in ctx.warnings if context is None else ():
            logger.warning("%s: %s", name_of(cmd), warning)
        if applied is not None and new_tree.code != code:
            applied.append(name_of(cmd))
        tree, code = new_tree, new_tree.code
    return code


def _rewritten(path: Path, commands: Sequence[Command], context: CodemodContext | None) -> bytes | None:
    """The file's new bytes (its BOM kept), or None when the commands change nothing or the file does not
    decode or parse."""
    try:
        text = path.read_bytes().decode("utf-8")
        bom = text.startswith(BOM)
        source = text[1:] if bom else text
        new = transform(source, commands, context)
    except (OSError, UnicodeDecodeError, CodemodError):
        return None
    return None if new == source else ((BOM if bom else "") + new).encode("utf-8")


def would_rewrite(path: Path, commands: Sequence[Command], context: CodemodContext | None = None) -> bool:
    """Whether the commands would change the file (nothing is written)."""
    return _rewritten(path, commands, context) is not None


def rewrite_file(path: Path, commands: Sequence[Command], context: CodemodContext | None = None, *,
                 root: Path) -> bool:
    """Run the commands on one recipe file, keeping its BOM and mode; True if it changed. A file that
    does not decode or parse is not touched. `root`: the recipe the file is in; the write is anchored
    there, so a link out anywhere between it and the file is refused."""
    data = _rewritten(path, commands, context)
    if data is None:
        return False
    UserTree(root, "the recipe").write_bytes(path, data)
    return True
