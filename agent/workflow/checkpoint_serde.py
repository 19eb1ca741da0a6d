"""The serializer of the `--resume` checkpoint store: JSON data only, nothing is ever imported or called.

langgraph's default serializer rebuilds any module/function a checkpoint names, so a tampered
`.migrator/checkpoints.sqlite` could run code on `--resume`. The workflow state is plain data
(`MigrationState`: dicts, lists, str, int, float, bool, None); this serializer stores exactly that,
plus an explicit allow-list of tagged containers langgraph itself uses (tuple, set, frozenset,
bytes, dicts with non-string keys) and exceptions reduced to their class name and message.
Anything else is refused when written (a programming error) and when read (`UnsafeStoreError`).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any
from engine.safe_load import loads_json

FORMAT = "migrator-json-v1"
TAG = "__migrator_type__"


class UnsafeStoreError(ValueError):
    """The store holds something this serializer does not read: refused, never executed."""


class StoredError(Exception):
    """An exception stored by a node that failed (langgraph re-runs that node on resume)."""


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)) and type(obj) in (int, float):
        return obj
    if isinstance(obj, list) and type(obj) is list:
        return [_encode(v) for v in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: _encode(v) for k, v in obj.items()}
        return {TAG: "dict", "items": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if type(obj) is tuple:
        return {TAG: "tuple", "items": [_encode(v) for v in obj]}
    if type(obj) in (set, frozenset):
        return {TAG: type(obj).__name__, "items": [_encode(v) for v in obj]}
    if type(obj) in (bytes, bytearray):
        return {TAG: "bytes", "b64": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, BaseException):
        return {TAG: "error", "type": type(obj).__name__, "message": str(obj)[:2000]}
    raise TypeError(f"checkpoint store: {type(obj).__module__}.{type(obj).__qualname__} is not in the "
                    "allow-list of state types (dict, list, str, int, float, bool, None)")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if TAG not in obj:
        return {k: _decode(v) for k, v in obj.items()}
    kind = obj[TAG]
    if kind == "dict":
        return {_key(_decode(k)): _decode(v) for k, v in _pairs(obj.get("items"))}
    if kind in ("tuple", "set", "frozenset"):
        items = obj.get("items")
        if not isinstance(items, list):
            raise UnsafeStoreError(f"malformed {kind}")
        values = [_decode(v) for v in items]
        if kind == "tuple":
            return tuple(values)
        return {"set": set, "frozenset": frozenset}[kind](_key(v) for v in values)
    if kind == "bytes":
        if not isinstance(obj.get("b64"), str):
            raise UnsafeStoreError("malformed bytes")
        try:
            return base64.b64decode(obj["b64"], validate=True)
        except ValueError as exc:
            raise UnsafeStoreError("malformed bytes") from exc
    if kind == "error":
        return StoredError(f"{obj.get('type')}: {obj.get('message')}")
    raise UnsafeStoreError(f"unknown stored type {str(kind)[:60]!r}")


def _pairs(items: Any) -> list:
    if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
        raise UnsafeStoreError("malformed mapping")
    return items


def _key(value: Any) -> Any:
    try:
        hash(value)
    except TypeError as exc:
        raise UnsafeStoreError("unhashable key") from exc
    return value


class StateSerializer:
    """langgraph SerializerProtocol (dumps_typed/loads_typed) storing allow-listed JSON data only."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return FORMAT, json.dumps(_encode(obj), ensure_ascii=False, separators=(",", ":")).encode()

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        type_, payload = data
        if type_ != FORMAT:
            raise UnsafeStoreError(f"entry of type {str(type_)[:40]!r}, not {FORMAT}")
        if not isinstance(payload, (bytes, bytearray, str)):
            raise UnsafeStoreError("entry is not text")
        try:
            return _decode(loads_json(payload))
        except UnsafeStoreError:
            raise
        except (ValueError, RecursionError) as exc:
            raise UnsafeStoreError(f"entry is not valid JSON data ({exc.__class__.__name__})") from exc
