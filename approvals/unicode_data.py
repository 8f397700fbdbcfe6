"""Unicode's own data where Python's ``unicodedata`` has none: the script of a character and its look-alikes.

Both come from files the ``confusable-homoglyphs`` package ships, generated
from Unicode's ``Scripts.txt`` (``categories.json``: code point ranges with
their ISO 15924 script) and from UTS #39's ``confusables.txt``
(``confusables.json``: each character with the characters and sequences it is
confusable with). Only the data is read, with :mod:`importlib.resources`:
the package's own loader follows a ``CONFUSABLE_DATA`` environment variable
to another folder, and what a card warns about must not depend on the
environment of the process that builds it.

Loaded once, on first use (a look-alike check runs only on text that is not
ASCII); ``kazma --version`` never pays for it.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Final

DATA_PACKAGE: Final = "confusable_homoglyphs"
_NO_SCRIPT: Final = frozenset({"COMMON", "INHERITED", "UNKNOWN"})
_DIRECTION_MARKS: Final = str.maketrans("", "", "\u200e\u200f")  # the data wraps right-to-left glyphs in them


@dataclass(frozen=True)
class _Scripts:
    starts: list[int]
    ends: list[int]
    scripts: list[str | None]  # per range; None for Common, Inherited and Unknown


def _read(name: str) -> Any:
    return json.loads((resources.files(DATA_PACKAGE) / name).read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def _scripts() -> _Scripts:
    data = _read("categories.json")
    aliases: list[str] = data["iso_15924_aliases"]
    names = [None if alias.upper() in _NO_SCRIPT else alias.replace("_", " ").title() for alias in aliases]
    ranges: list[list[int]] = data["code_points_ranges"]
    return _Scripts(starts=[r[0] for r in ranges], ends=[r[1] for r in ranges], scripts=[names[r[2]] for r in ranges])


@lru_cache(maxsize=1)
def _ascii_lookalikes() -> dict[str, str]:
    """Every character outside ASCII that UTS #39 says is confusable with ASCII letters or digits, with them."""
    found: dict[str, str] = {}
    confusables: dict[str, list[dict[str, str]]] = _read("confusables.json")
    for char, glyphs in confusables.items():
        if len(char) != 1 or char.isascii():
            continue
        for glyph in glyphs:
            target = glyph["c"].translate(_DIRECTION_MARKS)
            if target.isascii() and target.isalnum():
                found[char] = target
                break
    return found


@lru_cache(maxsize=8192)
def script(ch: str) -> str | None:
    """The Unicode script of ``ch`` (``Latin``, ``Cyrillic``, ``Canadian Aboriginal``…); None for Common and
    Inherited characters (digits, punctuation, combining marks) and for code points the data does not know."""
    table = _scripts()
    index = bisect.bisect_right(table.starts, ord(ch)) - 1
    if index < 0 or ord(ch) > table.ends[index]:
        return None
    return table.scripts[index]


@lru_cache(maxsize=8192)
def ascii_lookalike(ch: str) -> str | None:
    """The ASCII letters or digits ``ch`` is confusable with (``ɡ`` → ``g``, ``Ꭺ`` → ``A``), or None."""
    if ch.isascii():
        return None
    return _ascii_lookalikes().get(ch)


__all__ = ["DATA_PACKAGE", "ascii_lookalike", "script"]
