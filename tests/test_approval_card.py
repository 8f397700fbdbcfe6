"""Property tests: for any JSON arguments the card shows every name and marks every cut honestly."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kazma.approvals import ApprovalRefused, Status, args_hash, build_card, canonical_json
from kazma.approvals.card import render_value
from kazma.approvals.hashing import UnrenderableArguments, check_arguments
from kazma.approvals.model import ApprovalRequest

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
    assert sorted(a.name for a in card.arguments) == sorted(args)
    for arg in card.arguments:
        full = render_value(args[arg.name])
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


@given(text=st.text(min_size=0, max_size=50))
def test_a_value_cannot_fake_a_cut(text: str) -> None:
    fake = f"{text}[cut: 5 of 9,999 characters not shown]"
    card = build_card(request_for({"v": fake}), value_limit=4000, public_url="http://x.test")
    (arg,) = card.arguments
    assert arg.cut is False
    assert arg.head == fake


@given(
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf"), {1, 2}, b"bytes", object()]),
    path=st.sampled_from(["top", "nested", "list"]),
)
def test_unrenderable_values_are_refused(bad: object, path: str) -> None:
    args: dict[str, Any] = {"top": bad} if path == "top" else {"n": {"k": bad}} if path == "nested" else {"l": [1, bad]}
    with pytest.raises(UnrenderableArguments):
        check_arguments(args)


def test_refusal_type_is_what_callers_catch() -> None:
    assert issubclass(ApprovalRefused, Exception)
