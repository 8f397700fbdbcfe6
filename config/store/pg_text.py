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

from psycopg.abc import AdaptContext, Buffer
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


class NulSafeStrDumper(StrDumperUnknown):
    """Python text as PostgreSQL text, U+0000 escaped (see the module)."""

    def dump(self, obj: str) -> Buffer | None:
        return super().dump(encode(obj))


class NulSafeTextLoader(TextLoader):
    """PostgreSQL text as Python text, U+0000 restored."""

    def load(self, data: Buffer) -> bytes | str:
        value = super().load(data)
        return decode(value) if isinstance(value, str) else value


def nul_safe(context: AdaptContext) -> None:
    """Register the escaping on a connection (or any adapters context): text in, text out, NUL kept."""
    adapters = context.adapters
    adapters.register_dumper(str, NulSafeStrDumper)
    for oid_name in ("text", "varchar", "bpchar", "name"):
        adapters.register_loader(oid_name, NulSafeTextLoader)


async def nul_safe_async(conn: Any) -> None:
    """:func:`nul_safe` as a pool's ``configure`` callback."""
    nul_safe(conn)


__all__ = ["ESCAPE", "NulSafeStrDumper", "NulSafeTextLoader", "decode", "encode", "nul_safe", "nul_safe_async"]
