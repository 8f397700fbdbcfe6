"""Text rules every platform shares: splitting by the platform's own length measure, and ``@name`` mentions.

Each platform passes its measure (Telegram counts UTF-16 code units, Slack the length once escaped,
Discord characters); the algorithm is one, so a long message breaks at the same places everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final


class Columns(str):
    """Text laid out in columns with spaces (``/swarm help``): each platform shows it in a fixed-width font —
    Telegram a ``pre`` entity, Slack and Discord a code block, the console ``<pre>`` — since spaces line up
    nothing in the proportional font chat text uses. Anything made from it (a slice, a join) is plain text
    again, so only the text itself, passed on whole, carries the layout."""

    __slots__ = ()


COLUMNS_FENCES: Final = 8  # "```\n" and "\n```" around columns, where a platform writes a code block


def split_text(text: str, limit: int, units: Callable[[str], int] | None = None) -> list[str]:
    """Cut ``text`` into parts of at most ``limit`` units, preferring a line break, then a space, in the
    second half of each part; the break itself is dropped. ``units`` measures one character the way the
    platform does (Telegram: UTF-16 code units; Slack: its length once escaped; default: one).

    Whitespace-only parts are dropped: platforms trim messages and refuse empty ones.
    """
    if limit < 1:
        raise ValueError("limit must be positive")
    measure = units or (lambda _char: 1)
    parts: list[str] = []
    rest = text
    while rest:
        size = 0
        end = 0
        for char in rest:
            size += measure(char)
            if size > limit:
                break
            end += 1
        else:
            parts.append(rest)
            break
        end = max(end, 1)  # a limit narrower than one character still makes progress
        window = rest[:end]
        cut = window.rfind("\n")
        if cut < end // 2:
            cut = max(window.rfind(" "), window.rfind("\t"))
        if cut >= end // 2 and cut > 0:
            parts.append(window[:cut])
            rest = rest[cut + 1 :]
        else:
            parts.append(window)
            rest = rest[end:]
    return [part for part in parts if part.strip()]


# ``@name`` where a name starts with a letter, not inside a word, an address or a code span, and not a
# mass mention. Agents have no platform accounts, so this is how a dispatch (or a person) addresses one.
_MENTION: Final = re.compile(r"(?<![\w.@<`\u200b])@([A-Za-z][A-Za-z0-9_-]{0,31})")
_MASS: Final = frozenset({"everyone", "here", "channel"})


def plain_mentions(text: str) -> tuple[str, ...]:
    """Lowercase ``@name`` words, once each, in order."""
    found = (m.lower() for m in _MENTION.findall(text))
    return tuple(dict.fromkeys(name for name in found if name not in _MASS))
