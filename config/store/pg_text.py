"""Text holding U+0000 on PostgreSQL: escaped at the connection, so both backends give back what they were given.

SQLite stores NUL inside text; PostgreSQL refuses it (``DataError``: "text fields cannot contain NUL"). A
model's answer, a tool's output or a chat message may hold one, and losing the whole write over it (a swarm
step, a turn of history) or changing it silently would both be dishonest. So every connection Kazma's
PostgreSQL store uses dumps text through :func:`encode` and loads it through :func:`decode`:

- U+0000 is written as U+FDD0 followed by ``0``;
- U+FDD0 itself (a Unicode *noncharacter*, never meant to be exchanged) is written doubled.

The mapping is reversible and a no-op for text holding neither character (nearly all text: the check is one
scan in C). The stored form is PostgreSQL's business: every reader goes through these connections, and
``kazma store copy`` registers the same adapters, so a value copied from SQLite reads back as it was.
A value stored on PostgreSQL before this existed and holding a lone U+FDD0 reads back unchanged; one holding
U+FDD0 twice in a row reads back with one.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg.abc import AdaptContext, Buffer, Dumper, Loader
from psycopg.adapt import PyFormat
from psycopg.pq import Format
from psycopg.types.string import StrDumperUnknown, TextLoader

ESCAPE = "\ufdd0"
_PAIR = re.compile(f"{ESCAPE}(.)", re.DOTALL)


def encode(text: str) -> str:
    if "\x00" not in text and ESCAPE not in text:
        return text
    return text.replace(ESCAPE, ESCAPE + ESCAPE).replace("\x00", ESCAPE + "0")


def _pair(match: re.Match[str]) -> str:
    second = match.group(1)
    if second == ESCAPE:
        return ESCAPE
    if second == "0":
        return "\x00"
    return match.group(0)  # written before the escaping existed: left as it is


def decode(text: str) -> str:
    if ESCAPE not in text:
        return text
    return _PAIR.sub(_pair, text)


_TEXT_TYPES = ("text", "varchar", "bpchar", "name")
# The driver's own text adapters, before any connection's escaping is registered: with psycopg[binary] they are
# its C ones. The escaping wraps them, so text that needs none (nearly all) costs a check and a call, not
# psycopg's pure-Python encoding (a press sends about twenty text values and reads eight).
_PLAIN_DUMPER: type[Dumper] = psycopg.adapters.get_dumper(str, PyFormat.TEXT)
_PLAIN_LOADERS: dict[int, type[Loader]] = {}
for _name in _TEXT_TYPES:
    _oid = psycopg.adapters.types[_name].oid
    _PLAIN_LOADERS[_oid] = psycopg.adapters.get_loader(_oid, Format.TEXT) or TextLoader


class NulSafeStrDumper(StrDumperUnknown):
    """Python text as PostgreSQL text, U+0000 escaped (see the module)."""

    def __init__(self, cls: type, context: AdaptContext | None = None) -> None:
        super().__init__(cls, context)
        self._plain = _PLAIN_DUMPER(cls, context).dump

    def dump(self, obj: str) -> Buffer | None:
        if "\x00" in obj or ESCAPE in obj:
            obj = encode(obj)
        return self._plain(obj)


class NulSafeTextLoader(TextLoader):
    """PostgreSQL text as Python text, U+0000 restored."""

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        self._plain = _PLAIN_LOADERS.get(oid, TextLoader)(oid, context).load

    def load(self, data: Buffer) -> bytes | str:
        value = self._plain(data)
        return decode(value) if type(value) is str and ESCAPE in value else value


def nul_safe(context: AdaptContext) -> None:
    """Register the escaping on a connection (or any adapters context): text in, text out, NUL kept."""
    adapters = context.adapters
    adapters.register_dumper(str, NulSafeStrDumper)
    for oid_name in _TEXT_TYPES:
        adapters.register_loader(oid_name, NulSafeTextLoader)


async def nul_safe_async(conn: Any) -> None:
    """:func:`nul_safe` as a pool's ``configure`` callback."""
    nul_safe(conn)


__all__ = ["ESCAPE", "NulSafeStrDumper", "NulSafeTextLoader", "decode", "encode", "nul_safe", "nul_safe_async"]
