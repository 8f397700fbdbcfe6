"""Canonical JSON of tool arguments and its SHA-256: what a card shows and an execution re-checks."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Any

MAX_ARGUMENT_DEPTH = 32  # no real tool needs more; deeper values are a way to break renderers and hashers


class UnrenderableArguments(ValueError):
    """The arguments cannot be shown faithfully, so the call must not run."""


def _check(value: Any, path: str, depth: int) -> None:
    """``depth``: how deep a list or object ``value`` is would nest (the arguments' own mapping is 1)."""
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnrenderableArguments(f"{path}: {value!r} is not a finite number")
        return
    if isinstance(value, list | tuple | Mapping) and depth > MAX_ARGUMENT_DEPTH:
        where = path if len(path) <= 120 else f"{path[:60]}…{path[-40:]}"  # 32 names of any length
        raise UnrenderableArguments(f"{where}: arguments nested deeper than {MAX_ARGUMENT_DEPTH} levels")
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]", depth + 1)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UnrenderableArguments(f"{path}: key {key!r} is not text")
            _check(item, f"{path}.{key}", depth + 1)
        return
    raise UnrenderableArguments(f"{path}: a {type(value).__name__} is not JSON data")


def check_arguments(args: Mapping[str, Any]) -> None:
    """Refuse anything that JSON cannot carry exactly (non-finite numbers, objects, non-text keys), and values
    nested deeper than :data:`MAX_ARGUMENT_DEPTH` (every door refuses those first; here for any caller of
    ``open``, whose checks, card and hash would otherwise end in a RecursionError)."""
    if not isinstance(args, Mapping):
        raise UnrenderableArguments(f"arguments must be a mapping, got {type(args).__name__}")
    for key, value in args.items():
        if not isinstance(key, str):
            raise UnrenderableArguments(f"argument name {key!r} is not text")
        _check(value, key, 2)
    try:
        canonical_json(args).encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates cannot be shown or hashed
        raise UnrenderableArguments(f"arguments contain text that is not valid Unicode ({exc.reason})") from None


def nesting_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects, counted without recursion (so no depth can crash it)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_ARGUMENT_DEPTH:
            return deepest  # enough to refuse; no need to walk the rest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def canonical_json(value: Any) -> str:
    """Sorted keys, compact separators, no ASCII escaping; NaN and infinities refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def args_hash(args: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of ``args`` encoded as UTF-8."""
    return text_hash(canonical_json(args))


def text_hash(args_json: str) -> str:
    """SHA-256 (hex) of already-canonical JSON text, e.g. a stored ``args_json``."""
    return hashlib.sha256(args_json.encode("utf-8")).hexdigest()


_quote = encode_basestring  # json's escaping of one text with ensure_ascii=False (the C function its encoder calls)


def compact_json(fields: list[object]) -> bytes:
    """``json.dumps(fields, ensure_ascii=False, separators=(",", ":"))`` as UTF-8, the same bytes, written without
    building json's encoder (``json.dumps`` with options makes one anew on every call: most of what a seal or a
    checkpoint's message costs). Text, None, ints and finite floats are written here; any other field sends the
    whole list json's own way. What the decision seals and the audit checkpoints sign (their verification writes
    with json and checks against it)."""
    parts: list[str] = []
    for value in fields:
        if isinstance(value, str):  # a subclass too: json writes it as text as well
            parts.append(_quote(value))
        elif value is None:
            parts.append("null")
        elif type(value) is int or (type(value) is float and math.isfinite(value)):  # not a bool: json writes true
            parts.append(repr(value))
        else:
            return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return ("[" + ",".join(parts) + "]").encode("utf-8")
