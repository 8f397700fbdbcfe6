"""Discord's escape of untrusted text: the shortcut for text with nothing to escape changes no output."""

from __future__ import annotations

import string

import pytest

from kazma.adapters.discord.render import _escaped, escape_text

# Every printable ASCII character alone, at a line's start, inside words, doubled, and the shapes discord.py's
# patterns look for (a link, a quote, a heading, a list, mentions, a URL): a character the shortcut let through
# while some escape acts on it shows up here as a difference.
_SHAPES = ("{c}", "{c}x", "x{c}", "x{c}x", "{c}{c}", "a\n{c} b", " {c}", "{c}{c}{c} h", "a{c}b{c}c")
CORPUS = [shape.format(c=c) for c in string.printable for shape in _SHAPES] + [
    "",
    "Tool",
    "Arguments SHA-256",
    "3a2d5d26598c3ea9219a0f7b2c9e8d1f3a2d5d26598c3ea9219a0f7b2c9e8d1f",
    "[a](https://example.com/x_y)",
    "> quoted",
    ">>> quoted",
    "# heading",
    "  - item",
    "@everyone @here <@123> <@&456> <#789> </cmd:1> <!x>",
    "@123456789012345678",
    "see https://example.com/a_b*c and x```",
    "a\\`b",
    "résumé — ünïcode 🙂 text",
]


@pytest.mark.parametrize("text", CORPUS)
def test_escape_text_matches_every_escape_run(text: str) -> None:
    assert escape_text(text) == _escaped(text)


def test_plain_text_is_returned_as_it_is() -> None:
    assert escape_text("Requested by") == "Requested by"
    assert escape_text("Deny_me") == "Deny\\_me"  # and a character to escape still takes the full path
