"""The one grammar of tool names, for every door a name comes through (MCP servers, the approvals API, ``/mcp``).

A tool name is what a card shows after ``Tool:`` and in its title, so it must
not be able to carry anything but a name: no line break that could start a
forged card line, no space, no look-alike letter. The grammar is the MCP
specification's rule for a tool's name (SEP-986: 1-128 characters of ASCII
letters, digits, ``_``, ``.`` and ``-``), applied per *part*, with ``/``
between parts (``github/list_issues``: Kazma names an MCP tool
``<server>/<tool>``; an API caller may namespace its own names the same way).
``__`` needs no rule of its own: ``_`` is a name character.

Pure functions, no I/O: the engine (MCP listing) and the bot (the API door)
both call them.
"""

from __future__ import annotations

import re
from typing import Final

from kazma.approvals.honesty import code_point_label, reveal_line, safe_prefix

MAX_PART_LENGTH: Final = 128  # the MCP specification's limit for one tool name
SEPARATOR: Final = "/"
PART_RULE: Final = f"1-{MAX_PART_LENGTH} characters of A-Z, a-z, 0-9, '_', '.' and '-'"
MCP_TOOL_RULE: Final = f"an MCP tool's name is {PART_RULE} (the MCP specification's tool-name rule)"
TOOL_RULE: Final = f"a tool name is one or more parts joined by '{SEPARATOR}', each part {PART_RULE}"

_PART_CHAR: Final = re.compile(r"[A-Za-z0-9_.\-]")
_PART: Final = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_PART_LENGTH}}}")
# The same grammar as one regular expression, for schemas (the API's OpenAPI document). It ends with a lookahead
# for "nothing left": ``$`` alone lets a trailing newline through in Python's re (which JSON-schema validators in
# Python use), though not in ECMA-262's; the lookahead means the same in both.
TOOL_PATTERN: Final = rf"^[A-Za-z0-9_.\-]{{1,{MAX_PART_LENGTH}}}(/[A-Za-z0-9_.\-]{{1,{MAX_PART_LENGTH}}})*$(?![\s\S])"
MAX_QUOTED: Final = 60  # characters of a refused name quoted in an error


class ToolNameError(ValueError):
    """A tool name outside the grammar; the message names the rule and where the name breaks it."""

    def __init__(self, name: str, problem: str, rule: str) -> None:
        super().__init__(f"tool name {_quote(name)} is refused: {problem}; {rule}")
        self.name = name
        self.problem = problem
        self.rule = rule


def _quote(name: str) -> str:
    shown = reveal_line(name)
    if len(shown) > MAX_QUOTED:
        shown = safe_prefix(shown, MAX_QUOTED - 1) + "…"
    return f"'{shown}'"


def _char_label(ch: str) -> str:
    return f"'{ch}'" if ch.isascii() and ch.isprintable() else code_point_label(ord(ch))


def _part_problem(part: str, offset: int) -> str | None:
    if not part:
        return f"an empty part at character {offset + 1}"
    for index, ch in enumerate(part):
        if _PART_CHAR.fullmatch(ch) is None:
            return f"{_char_label(ch)} at character {offset + index + 1} is not allowed"
    if len(part) > MAX_PART_LENGTH:
        return f"a part of {len(part)} characters (at most {MAX_PART_LENGTH})"
    return None


def mcp_tool_name_problem(name: str) -> str | None:
    """Why ``name`` (a tool's name as an MCP server lists it) is refused, or None when it is a valid name."""
    if _PART.fullmatch(name):
        return None
    if not name:
        return "the name is empty"
    # A '/' is refused with the rest: the server's name and the '/' after it are Kazma's to add, and a name with
    # one inside would read as a tool of another server.
    return _part_problem(name, 0)


def tool_name_problem(name: str) -> str | None:
    """Why ``name`` (a Kazma tool name, e.g. from an API caller) is refused, or None when it is a valid name."""
    if not name:
        return "the name is empty"
    offset = 0
    for part in name.split(SEPARATOR):
        if not _PART.fullmatch(part):
            return _part_problem(part, offset)
        offset += len(part) + 1
    return None


def check_tool_name(name: str) -> str:
    """``name`` when it follows the grammar; :class:`ToolNameError` naming the rule otherwise."""
    problem = tool_name_problem(name)
    if problem is not None:
        raise ToolNameError(name, problem, TOOL_RULE)
    return name


def check_mcp_tool_name(name: str) -> str:
    """``name`` when an MCP server may list a tool by it; :class:`ToolNameError` naming the rule otherwise."""
    problem = mcp_tool_name_problem(name)
    if problem is not None:
        raise ToolNameError(name, problem, MCP_TOOL_RULE)
    return name


__all__ = [
    "MAX_PART_LENGTH",
    "MCP_TOOL_RULE",
    "TOOL_PATTERN",
    "TOOL_RULE",
    "ToolNameError",
    "check_mcp_tool_name",
    "check_tool_name",
    "mcp_tool_name_problem",
    "tool_name_problem",
]
