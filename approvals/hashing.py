"""Canonical JSON of tool arguments and its SHA-256: what a card shows and an execution re-checks."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Any


class UnrenderableArguments(ValueError):
    """The arguments cannot be shown faithfully, so the call must not run."""


def _check(value: Any, path: str) -> None:
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnrenderableArguments(f"{path}: {value!r} is not a finite number")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UnrenderableArguments(f"{path}: key {key!r} is not text")
            _check(item, f"{path}.{key}")
        return
    raise UnrenderableArguments(f"{path}: a {type(value).__name__} is not JSON data")


def check_arguments(args: Mapping[str, Any]) -> None:
    """Refuse anything that JSON cannot carry exactly (non-finite numbers, objects, non-text keys)."""
    if not isinstance(args, Mapping):
        raise UnrenderableArguments(f"arguments must be a mapping, got {type(args).__name__}")
    for key, value in args.items():
        if not isinstance(key, str):
            raise UnrenderableArguments(f"argument name {key!r} is not text")
        _check(value, key)
    try:
        canonical_json(args).encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates cannot be shown or hashed
        raise UnrenderableArguments(f"arguments contain text that is not valid Unicode ({exc.reason})") from None


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
