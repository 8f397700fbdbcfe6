"""A card as the lines a person reads, on every writer, and which of them say something a card's own lines say.

Each platform's output is reduced to lines the way the platform lays it out:
a code block (Telegram ``pre``, Slack and Discord ````` fences, the web's
``<pre>``) and plain text's quoted value lines (``  ┆ ``) are *value lines*,
drawn as part of a value; everything else is a *card line*. The reduction
parses the markup as the platform does (a fence a value could close would
close here too), so a value that escapes its block shows up as card lines.

:func:`card_tokens` counts the card lines that begin, once decoration is
stripped (spaces, the outcome's emoji, bold/italic markers), with a label, an
outcome word, a bullet or a cut marker: what a value must never produce.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kazma.adapters.card_layout import (
    AUDIT_LABEL,
    DEADLINE_LABEL,
    FROM_LABEL,
    FULL_CALL_LABEL,
    HASH_LABEL,
    OUTCOME_HEADLINES,
    REQUESTED_BY_LABEL,
    TOOL_LABEL,
    VALUE_QUOTE,
)
from tests.fakes.telegram import parse_html

ZWSP = "\u200b"

# Longest first: "Arguments SHA-256" before "Arguments (".
TOKENS: tuple[str, ...] = tuple(
    sorted(
        {
            TOOL_LABEL,
            REQUESTED_BY_LABEL,
            FROM_LABEL,
            DEADLINE_LABEL,
            HASH_LABEL,
            FULL_CALL_LABEL,
            AUDIT_LABEL,
            "Arguments (",
            "Listed by name only",
            "Approval needed",
            "Approval refused",
            *OUTCOME_HEADLINES.values(),
            "•",
            "[cut:",
            "[Approve",
            "[Deny",
        },
        key=len,
        reverse=True,
    )
)
_DECORATION = re.compile(r"^(?:[\s\u200b*_~`>✅⛔⌛⏹⚠\ufe0f│]|:[a-z_]+:)+")


@dataclass(frozen=True)
class Line:
    text: str
    value: bool  # drawn inside a value (a code block, a quoted line)


def _split(text: str, value: bool) -> list[Line]:
    return [Line(line, value) for line in text.split("\n")]


def _fenced(text: str, unescape: Callable[[str], str] = lambda text: text) -> list[Line]:
    """Markdown with ``` fences (Slack mrkdwn, Discord): a fence's inside is a block of value lines; ``unescape``
    resolves escapes outside fences (after the fences are found, as the platform does: an escaped backtick
    opens nothing)."""
    lines: list[Line] = []
    for index, part in enumerate(text.split("```")):
        inside = index % 2 == 1
        lines += _split(part if inside else unescape(part), value=inside)
    return lines


def telegram_lines(text: str, entities: list[dict[str, Any]]) -> list[Line]:
    """Telegram's text and entities (UTF-16 offsets): a ``pre`` entity is a block of value lines."""
    in_pre: list[bool] = []
    units = 0
    starts: dict[int, int] = {}
    for index, char in enumerate(text):
        starts[units] = index
        units += 2 if ord(char) > 0xFFFF else 1
    starts[units] = len(text)
    in_pre = [False] * len(text)
    for entity in entities:
        if entity["type"] == "pre":
            start, end = starts[entity["offset"]], starts[entity["offset"] + entity["length"]]
            for index in range(start, end):
                in_pre[index] = True
    lines: list[Line] = []
    run_start = 0
    for index in range(1, len(text) + 1):
        if index == len(text) or in_pre[index] != in_pre[run_start]:
            lines += _split(text[run_start:index], value=bool(in_pre[run_start]) if text else False)
            run_start = index
    return lines


def telegram_html_lines(source: str) -> list[Line]:
    return telegram_lines(*parse_html(source))


def slack_lines(blocks: list[dict[str, Any]]) -> list[Line]:
    lines: list[Line] = []
    for block in blocks:
        texts = [block["text"]] if "text" in block else []
        texts += block.get("fields", [])
        for text in texts:  # every block and every field starts a line of its own
            shown = text["text"].replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
            if text.get("type") == "plain_text":  # a header: Slack shows it as written, no markup at all
                lines += _split(shown, value=False)
            else:
                lines += _fenced(shown)  # zero-width spaces between backticks keep them from making a fence
    return [Line(line.text.replace(ZWSP, ""), line.value) for line in lines]


def discord_lines(embed: dict[str, Any]) -> list[Line]:
    def shown(text: str) -> str:
        return re.sub(r"\\(.)", r"\1", text)

    lines = _split(shown(str(embed.get("title", ""))), value=False)
    lines += _fenced(str(embed.get("description", "")), shown)
    for field in embed.get("fields", []):
        lines += _split(shown(str(field.get("name", ""))), value=False)
        lines += _fenced(str(field.get("value", "")), shown)
    return [Line(line.text.replace(ZWSP, ""), line.value) for line in lines]


def plain_lines(text: str, *, frame: str = "") -> list[Line]:
    lines = [line.removeprefix(frame) for line in text.split("\n")]
    return [Line(line, line.startswith(VALUE_QUOTE)) for line in lines]


_BLOCK_TAG = re.compile(r"</?(?:div|tr|table|ul|li|h\d|p)\b[^>]*>")
_CELL_TAG = re.compile(r"</?(?:th|td)\b[^>]*>")
_ANY_TAG = re.compile(r"<[^>]+>")


def html_lines(source: str) -> list[Line]:
    """HTML as a browser lays it out: block elements break lines, a row's cells share one, ``<pre>`` is a block."""
    lines: list[Line] = []
    for index, part in enumerate(re.split(r"(<pre>.*?</pre>)", source, flags=re.DOTALL)):
        if index % 2 == 1:
            lines += _split(html.unescape(part[len("<pre>") : -len("</pre>")]), value=True)
            continue
        text = _ANY_TAG.sub("", _CELL_TAG.sub(" ", _BLOCK_TAG.sub("\n", part)))
        lines += _split(html.unescape(text), value=False)
    return lines


def token_of(line: str) -> str | None:
    """The label, outcome word, bullet or marker a card line begins with (case-insensitively), if any."""
    bare = _DECORATION.sub("", line).casefold()
    return next((token for token in TOKENS if bare.startswith(token.casefold())), None)


def card_tokens(lines: list[Line]) -> Counter[str]:
    return Counter(token for line in lines if not line.value and (token := token_of(line.text)) is not None)
