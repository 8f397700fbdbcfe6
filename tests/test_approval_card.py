"""Property tests: for any JSON arguments the card shows every name and marks every cut honestly."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kazma.approvals import (
    ApprovalRefused,
    CardArgument,
    CardIntegrityError,
    Findings,
    Status,
    args_hash,
    build_card,
    canonical_json,
    reveal,
    unreveal,
)
from kazma.approvals.card import MAX_CARD_WARNINGS, render_value
from kazma.approvals.hashing import UnrenderableArguments, check_arguments
from kazma.approvals.honesty import MAX_ESCAPE_LENGTH
from kazma.approvals.model import ApprovalRequest
from tests.approvals_support import RecordingPublisher, approval_service

json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=300)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
arg_names = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40)
arguments = st.dictionaries(arg_names, json_values, max_size=12)


def request_for(args: dict[str, Any]) -> ApprovalRequest:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return ApprovalRequest(
        id="AbCdEfGhIjKlMnOpQrStUvWx",
        tool="shell",
        args=args,
        args_json=canonical_json(args),
        args_hash=args_hash(args),
        requested_by="agent:builder",
        conversation="telegram:-100",
        created_at=now,
        deadline=now,
        status=Status.PENDING,
    )


@settings(max_examples=300, deadline=None)
@given(args=arguments, limit=st.integers(min_value=16, max_value=400))
def test_card_shows_every_name_and_marks_every_cut(args: dict[str, Any], limit: int) -> None:
    card = build_card(request_for(args), value_limit=limit, public_url="http://x.test/")
    # Names and values are shown escaped (kazma.approvals.honesty): compare against the shown text.
    assert sorted(unreveal(a.name) for a in card.arguments) == sorted(args)
    for arg in card.arguments:
        full = reveal(render_value(args[unreveal(arg.name)]))
        assert arg.original_length == len(full)
        if arg.cut:
            assert len(full) > limit
            assert len(arg.head) + len(arg.tail) <= limit
            assert full.startswith(arg.head)
            assert full.endswith(arg.tail)
            assert arg.tail  # the end of a cut value is always shown
            assert arg.omitted == len(full) - len(arg.head) - len(arg.tail) > 0
            assert arg.full is None
        else:
            assert arg.head == full
            assert arg.tail == ""
            assert arg.full == full
    assert card.args_hash == args_hash(args)
    assert card.link == f"http://x.test/swarm?approval={card.request_id}"


@pytest.mark.parametrize(
    ("text", "value"),
    [("false", False), ("true", True), ("42", 42), ("-1.5", -1.5), ("null", None), ('["a"]', ["a"]),
     ('{"a":1}', {"a": 1}), (" 7 ", 7)],
)  # fmt: skip
def test_text_that_reads_as_another_value_is_shown_as_text(text: str, value: Any) -> None:
    """The text ``false`` and the boolean ``false`` looked the same on every card; a tool testing its argument for
    truth (``if args.force``) runs one as the other. Text that reads as JSON is shown as its JSON string."""
    as_text = build_card(request_for({"force": text}), value_limit=400, public_url="http://x.test").arguments[0]
    as_value = build_card(request_for({"force": value}), value_limit=400, public_url="http://x.test").arguments[0]
    assert as_text.head != as_value.head
    assert as_text.head == reveal(json.dumps(text, ensure_ascii=False))
    assert as_value.head == canonical_json(value)


@settings(max_examples=500, deadline=None)
@given(a=json_values, b=json_values)
@example(a="false", b=False)
@example(a='"false"', b="false")
@example(a="[]", b=[])
@example(a=" 1", b=1)
def test_no_two_different_values_are_shown_alike(a: Any, b: Any) -> None:
    assume(canonical_json(a) != canonical_json(b))
    assert reveal(render_value(a)) != reveal(render_value(b))


@given(text=st.text(min_size=0, max_size=50))
def test_a_value_cannot_fake_a_cut(text: str) -> None:
    fake = f"{text}[cut: 5 of 9,999 characters not shown]"
    card = build_card(request_for({"v": fake}), value_limit=4000, public_url="http://x.test")
    (arg,) = card.arguments
    assert arg.cut is False
    assert arg.head == reveal(fake)


@given(
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf"), {1, 2}, b"bytes", object()]),
    path=st.sampled_from(["top", "nested", "list"]),
)
def test_unrenderable_values_are_refused(bad: object, path: str) -> None:
    args: dict[str, Any] = {"top": bad} if path == "top" else {"n": {"k": bad}} if path == "nested" else {"l": [1, bad]}
    with pytest.raises(UnrenderableArguments):
        check_arguments(args)


def _nested_args(depth: int) -> dict[str, Any]:
    """Arguments whose objects nest ``depth`` levels (their own mapping the first), a list at the bottom."""
    args: dict[str, Any] = {"k": ["bottom"]} if depth > 1 else {}
    for _ in range(depth - 2):
        args = {"k": args}
    return args


@pytest.mark.parametrize("depth", [33, 900, 5000])
def test_arguments_deeper_than_every_door_allows_are_refused_by_any_caller_not_a_recursion_error(depth: int) -> None:
    args = _nested_args(depth)
    with pytest.raises(UnrenderableArguments, match="nested deeper than 32 levels"):
        check_arguments(args)


def test_arguments_as_deep_as_every_door_allows_are_checked_and_shown() -> None:
    args = _nested_args(32)
    check_arguments(args)
    assert build_card(request_for(args), value_limit=4000, public_url="http://x.test").arguments


def test_refusal_type_is_what_callers_catch() -> None:
    assert issubclass(ApprovalRefused, Exception)


# -- honesty: escaped names and values, warnings, integrity ---------------------------------------------------


def test_a_plain_card_has_no_warnings_and_unchanged_text() -> None:
    card = build_card(request_for({"command": "ls -la /srv", "timeout": 30}), value_limit=500, public_url="http://x")
    assert card.warnings == ()
    assert not card.has_warnings
    assert [(a.name, a.head, a.flagged) for a in card.arguments] == [
        ("command", "ls -la /srv", False),
        ("timeout", "30", False),
    ]


def test_shown_and_running_lengths_are_both_on_the_argument() -> None:
    value = "rm\u202e" * 100  # 300 characters run, 100 of them shown as 12-character escapes
    (arg,) = build_card(request_for({"c": value}), value_limit=100, public_url="http://x").arguments
    assert arg.cut
    assert arg.value_length == 300
    assert arg.original_length == len(reveal(value)) == 200 + 100 * len("\u27e8U+202E RLO\u27e9")
    assert arg.omitted == arg.original_length - len(arg.head) - len(arg.tail)
    assert arg.tail.endswith("\u27e8U+202E RLO\u27e9")  # the last escape is whole


def test_hidden_characters_in_an_argument_name_are_escaped_and_warned() -> None:
    args = {"comm\u202eand": "ls", "cwd\u200b": "/srv"}
    card = build_card(request_for(args), value_limit=500, public_url="http://x")
    assert [a.name for a in card.arguments] == ["comm\u27e8U+202E RLO\u27e9and", "cwd\u27e8U+200B ZWSP\u27e9"]
    assert all(a.flagged for a in card.arguments)
    assert any("the name of argument 'comm\u27e8U+202E RLO\u27e9and'" in w for w in card.warnings)
    assert any("zero-width characters" in w and "'cwd\u27e8U+200B ZWSP\u27e9'" in w for w in card.warnings)


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\x1bb", "a\x85b", "a\x9bb", "a\x7fb", ""])
def test_control_characters_in_argument_names_are_refused(name: str) -> None:
    with pytest.raises(UnrenderableArguments, match="control characters"):
        build_card(request_for({name: "x"}), value_limit=500, public_url="http://x")


def test_tool_requester_and_origin_are_shown_escaped() -> None:
    args = {"path": "/tmp/x"}
    request = replace(request_for(args), tool="read_file\u202e", requested_by="agent:\u200bbuilder")
    card = build_card(request, value_limit=500, public_url="http://x")
    assert card.tool == "read_file\u27e8U+202E RLO\u27e9"
    assert card.title == "Approval needed: read_file\u27e8U+202E RLO\u27e9"
    assert card.requester == "agent:\u27e8U+200B ZWSP\u27e9builder"
    assert card.warnings[0].startswith("Hidden or control characters in the tool name: direction controls")
    assert card.warnings[1].startswith("Hidden or control characters in the requester: zero-width characters")


def test_card_warnings_are_bounded() -> None:
    args = {f"arg{i:02}": f"x\u202e{i} g\u0456thub.com" for i in range(20)}  # two warnings per argument
    card = build_card(request_for(args), value_limit=500, public_url="http://x")
    assert len(card.warnings) == MAX_CARD_WARNINGS
    assert card.warnings[-1] == (
        f"{40 - MAX_CARD_WARNINGS + 1} more warnings of hidden or look-alike characters: "
        "review the whole call on its approval page."
    )


def test_renderers_may_still_build_arguments_positionally() -> None:
    arg = CardArgument("name", "head", "tail", True, 20)
    assert (arg.findings, arg.name_findings, arg.value_length, arg.flagged) == (Findings(), Findings(), None, False)
    assert arg.omitted == 12


def test_a_value_limit_that_cannot_hold_an_escape_is_refused() -> None:
    with pytest.raises(ValueError, match="below 16"):
        build_card(request_for({"v": "x" * 100}), value_limit=MAX_ESCAPE_LENGTH - 1, public_url="http://x")


def forged(request: ApprovalRequest, **changes: Any) -> ApprovalRequest:
    return replace(request, **changes)


@pytest.mark.parametrize(
    "tamper",
    ["args", "args_json", "both", "duplicate_key", "hash"],
)
def test_a_forged_request_row_builds_no_card(tamper: str) -> None:
    shown = {"command": "ls"}
    runs = {"command": "rm -rf ~"}
    request = request_for(shown)
    if tamper == "args":  # the row's parsed arguments changed, its hash kept
        request = forged(request, args=runs)
    elif tamper == "args_json":  # the stored text changed, the parsed copy and the hash kept
        request = forged(request, args_json=canonical_json(runs))
    elif tamper == "both":  # arguments replaced consistently, the approved hash kept
        request = forged(request, args=runs, args_json=canonical_json(runs))
    elif tamper == "duplicate_key":  # text whose own hash is on the card, but that parses to something else
        text = '{"command":"ls","command":"rm -rf ~"}'
        request = forged(
            request, args=json.loads(text), args_json=text, args_hash=hashlib.sha256(text.encode()).hexdigest()
        )
    else:
        request = forged(request, args_hash="0" * 64)
    with pytest.raises(CardIntegrityError, match="hash") as info:
        build_card(request, value_limit=500, public_url="http://x")
    assert info.value.request_id == request.id
    assert "no card is shown" in str(info.value)


def test_an_unhashable_row_builds_no_card() -> None:
    request = forged(request_for({"n": 1}), args={"n": float("nan")})
    with pytest.raises(CardIntegrityError, match="cannot be hashed"):
        build_card(request, value_limit=500, public_url="http://x")


async def test_a_row_tampered_in_the_store_builds_no_card(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher) as service:
        request = await service.open("shell", {"command": "echo hi\u202e"}, "agent:builder", "telegram:-100")
        (published,) = publisher.published
        assert published.has_warnings  # the honest card went out with its warning
        assert "direction controls" in published.warnings[0]
        await service.store.conn.execute(
            "UPDATE approval_requests SET args_json = ? WHERE id = ?", ('{"command":"rm -rf ~"}', request.id)
        )
        await service.store.conn.commit()
        tampered = await service.store.get(request.id)
        assert tampered is not None
        assert tampered.args == {"command": "rm -rf ~"}
        with pytest.raises(CardIntegrityError):
            service.card(tampered)
