"""One grammar of tool names for every door: parts of A-Z a-z 0-9 _ . - joined by '/'; anything else is refused."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kazma.approvals.honesty import examine_line, reveal_line
from kazma.approvals.tool_names import (
    MAX_PART_LENGTH,
    MCP_TOOL_RULE,
    TOOL_PATTERN,
    TOOL_RULE,
    ToolNameError,
    check_mcp_tool_name,
    check_tool_name,
    mcp_tool_name_problem,
    tool_name_problem,
)
from kazma.config.models import BUILTIN_TOOLS
from kazma.engine.tools.mcp_tools import model_name

GOOD = ["shell", "github/list_issues", "deploy", "aws.s3/put-object", "a__x", "DATA_EXPORT_v2", "admin.tools.list"]
BAD = [
    ("report\nTool: github/list_issues", "U+000A LF at character 7"),
    ("deploy\rAPPROVED", "U+000D CR at character 7"),
    ("deploy now", "' ' at character 7"),
    ("\u0261ithub/list", "U+0261 at character 1"),
    ("git\u200bhub", "U+200B ZWSP at character 4"),
    ("a//b", "an empty part at character 3"),
    ("/a", "an empty part at character 1"),
    ("a/", "an empty part at character 3"),
    ("", "the name is empty"),
    ("x" * (MAX_PART_LENGTH + 1), f"a part of {MAX_PART_LENGTH + 1} characters"),
    ("tool:name", "':' at character 5"),
]


@pytest.mark.parametrize("name", GOOD)
def test_names_in_the_grammar_pass_every_door(name: str) -> None:
    assert tool_name_problem(name) is None
    assert check_tool_name(name) == name
    assert re.fullmatch(TOOL_PATTERN, name)
    if "/" not in name:
        assert check_mcp_tool_name(name) == name


@pytest.mark.parametrize(("name", "problem"), BAD)
def test_names_outside_it_are_refused_with_the_rule_and_the_place(name: str, problem: str) -> None:
    assert problem in (tool_name_problem(name) or "")
    with pytest.raises(ToolNameError) as refused:
        check_tool_name(name)
    message = str(refused.value)
    assert TOOL_RULE in message
    assert not {"\n", "\r"} & set(message)  # the name is quoted escaped, on one line
    assert not re.fullmatch(TOOL_PATTERN, name)


def test_an_mcp_server_may_not_put_the_separator_in_its_own_names() -> None:
    assert mcp_tool_name_problem("github/list_issues") == "'/' at character 7 is not allowed"
    with pytest.raises(ToolNameError, match=re.escape(MCP_TOOL_RULE)):
        check_mcp_tool_name("x/y")


def test_the_built_in_tools_follow_the_grammar() -> None:
    assert all(tool_name_problem(name) is None for name in BUILTIN_TOOLS)


part = st.text(alphabet="abcXYZ019_.-", min_size=1, max_size=12)


@given(parts=st.lists(part, min_size=1, max_size=4))
def test_every_name_of_the_grammar_is_shown_as_itself_with_nothing_to_warn(parts: list[str]) -> None:
    name = "/".join(parts)
    assert tool_name_problem(name) is None
    assert reveal_line(name) == name
    assert examine_line(name).empty
    # the model-facing name keeps only characters OpenAI-style function names allow (no collision rule here)
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", model_name("server", parts[0]))


@given(name=st.text(max_size=30))
def test_a_name_the_grammar_accepts_holds_no_line_break_space_or_letter_outside_ascii(name: str) -> None:
    if tool_name_problem(name) is None:
        assert name.isascii()
        assert not any(ch.isspace() or not ch.isprintable() for ch in name)
