"""No text on a card can pretend to be the card: only Kazma's layout starts a line with a label or an outcome.

The property: for any tool name, requester, origin, note, argument name,
argument value, decider and cancel reason — newlines, carriage returns, line
and paragraph separators, every control character, card labels, outcome words,
fences and markup included — every writer (Telegram, Slack, Discord, the
terminal, the web) shows exactly as many lines beginning with each label,
outcome word, bullet and cut marker as the same card shows with every such text
replaced by a plain ``x``. Free text never starts a line; a value's own lines
are drawn inside the value (a code block, or quoted on plain text).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kazma.adapters.card_layout import (
    CardTooLarge,
    CardView,
    CardWriter,
    LaidOut,
    PlainWriter,
    ShownArgument,
    lay_out,
)
from kazma.adapters.discord.render import DiscordCard, DiscordWriter
from kazma.adapters.matrix.render import MatrixCard, MatrixWriter
from kazma.adapters.slack.render import SlackCard, SlackWriter
from kazma.adapters.telegram.render import TelegramCard, TelegramWriter
from kazma.adapters.web.render import HtmlWriter
from kazma.approvals import UnrenderableArguments, args_hash, build_card, canonical_json
from kazma.approvals.card import render_value
from kazma.approvals.honesty import unreveal, unreveal_line
from kazma.approvals.model import ApprovalRequest, Outcome, Status, Witness
from tests.card_lines_support import (
    Line,
    card_tokens,
    discord_lines,
    html_lines,
    plain_lines,
    slack_lines,
    telegram_html_lines,
)

TERMINAL_FRAME = "│ "


def _telegram(card: TelegramCard) -> list[Line]:
    return telegram_html_lines(card.html)


def _slack(card: SlackCard) -> list[Line]:
    assert "\n" not in card.text  # the notification text is one line too
    return slack_lines(card.blocks)


def _discord(card: DiscordCard) -> list[Line]:
    return discord_lines(card.embed.to_dict())  # type: ignore[arg-type]


def _matrix(card: MatrixCard) -> list[Line]:
    assert "<br>" not in card.html.replace("<br>\n", "")  # every laid-out break is also a break in the source
    return html_lines(card.html)


def _matrix_body(card: MatrixCard) -> list[Line]:
    return plain_lines(card.body)


WRITERS: dict[str, tuple[CardWriter[Any], Callable[[Any], list[Line]]]] = {
    "telegram": (TelegramWriter(), _telegram),
    "slack": (SlackWriter(), _slack),
    "discord": (DiscordWriter(), _discord),
    "matrix": (MatrixWriter(), _matrix),  # what Element and other HTML clients show
    "matrix_body": (MatrixWriter(), _matrix_body),  # what a plain-text client (and a notification) shows
    "plain": (PlainWriter(), plain_lines),
    "terminal": (PlainWriter(frame=TERMINAL_FRAME), lambda text: plain_lines(text, frame=TERMINAL_FRAME)),
    "web": (HtmlWriter(), html_lines),
}

# What an attacker puts in a field: line breaks of every kind, the card's own words, every writer's markup.
PIECES = [
    "\n",
    "\r",
    "\r\n",
    "\x0b",
    "\x0c",
    "\x85",
    "\u2028",
    "\u2029",
    "\x1b[1A",
    "\u200b",
    "\u202e",
    " ",
    "Tool: github/list_issues",
    "APPROVED: approved by telegram:111 via telegram",
    "approved",
    "DENIED",
    "TIMED OUT",
    "CANCELLED",
    "Requested by",
    "From",
    "Deadline",
    "Arguments (1):",
    "Arguments SHA-256: 0000",
    "Full call: http://evil.example",
    "Audit checkpoint: #1 000000000000",
    "Listed by name only (1):",
    "Approval needed: shell",
    "• repo: docs",
    "env = staging",
    "[cut: 1 of 2 characters not shown]",
    "[Approve]",
    "  ┆ ",
    "│ ",
    "```",
    "</pre>",
    "<pre>",
    "<b>",
    "*",
    "_",
    "> ",
    "#",
    ":white_check_mark: ",
    "✅ ",
    "⚠️ ",
    "&lt;",
]
hostile = st.lists(st.sampled_from(PIECES) | st.characters(exclude_categories=["Cs"]), max_size=8).map("".join)
# Argument names with a C0 or C1 control, or longer than 100 characters, are refused before any card is built
# (checked below); every other name is shown escaped on one line.
names = hostile.map(lambda text: "".join(ch for ch in text if not (ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F)))
names = names.filter(lambda name: 0 < len(name) <= 100)
values = hostile | st.lists(hostile, max_size=3).map(lambda parts: "\n".join(parts)) | st.dictionaries(hostile, hostile)


@dataclasses.dataclass(frozen=True)
class Case:
    tool: str
    requester: str
    origin: str
    notes: tuple[str, ...]
    args: dict[str, Any]
    status: Status | None
    decider: str
    reason: str
    limit: int
    witness: Witness | None = None  # Kazma's own (a sequence number and hex): the footer of a settled card


cases = st.builds(
    Case,
    tool=hostile,
    requester=hostile,
    origin=hostile,
    # A note is Kazma's sentence around a caller's words, as the approvals API writes them.
    notes=st.lists(st.tuples(st.sampled_from(["On behalf of", "Reason given"]), hostile), max_size=2).map(
        lambda notes: tuple(f"{label}: {text}" for label, text in notes)
    ),
    args=st.dictionaries(names, values, min_size=1, max_size=3),
    status=st.none() | st.sampled_from([Status.APPROVED, Status.DENIED, Status.TIMEOUT, Status.CANCELLED]),
    decider=hostile,
    reason=hostile,
    limit=st.sampled_from([24, 120, 2_000]),
    witness=st.none()
    | st.builds(
        Witness,
        seq=st.integers(min_value=1, max_value=2**62),
        head=st.text("0123456789abcdef", min_size=64, max_size=64),
    ),
)


def request_of(case: Case) -> ApprovalRequest:
    now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    return ApprovalRequest(
        id="Rq7xK2mP9vL4nB8cT1wZ5aY3",
        tool=case.tool,
        args=case.args,
        args_json=canonical_json(case.args),
        args_hash=args_hash(case.args),
        requested_by=case.requester,
        conversation=case.origin,
        created_at=now,
        deadline=now + timedelta(minutes=10),
        status=Status.PENDING,
        notes=case.notes,
    )


def outcome_of(case: Case) -> Outcome | None:
    if case.status is None:
        return None
    return Outcome(
        request_id="Rq7xK2mP9vL4nB8cT1wZ5aY3",
        status=case.status,
        decided_by=case.decider,
        decided_via=case.decider,
        decided_at=datetime(2030, 1, 2, 3, 5, 0, tzinfo=UTC),
        reason=case.reason,
        witness=case.witness,
    )


def plain_twin(view: CardView) -> CardView:
    """The same card with every text that is not Kazma's own replaced by ``x``: its lines are the layout's alone."""

    def argument(arg: ShownArgument) -> ShownArgument:
        return dataclasses.replace(arg, name="x", head="v" if arg.head else "", tail="v" if arg.tail else "")

    outcome = view.outcome
    return dataclasses.replace(
        view,
        title=view.title.split(": ", 1)[0] + ": x",
        warnings=tuple("w" for _ in view.warnings),
        facts=tuple((label, "x") for label, _ in view.facts),
        arguments=tuple(argument(arg) for arg in view.arguments),
        names_only=tuple("x" for _ in view.names_only),
        outcome=None if outcome is None else dataclasses.replace(outcome, decided_by="x", decided_via="x", reason="x"),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
# Found by this test: discord.py's escape_markdown skips what looks like a link, and the backticks after it
# opened a code block in the Discord embed that took the card's own lines for a value.
@example(case=Case("", "", "Full call: http://evil.example```", (), {"\u2028": ""}, None, "", "", 24))
# Found by this test (the model's fault, not a card's): a Slack header is plain_text, where ``` opens nothing.
@example(case=Case("``````Tool: github/list_issues", "", "", (), {"\u2028": ""}, None, "", "", 24))
def test_no_text_can_start_a_line_that_looks_like_the_cards_own(case: Case) -> None:
    try:
        card = build_card(request_of(case), value_limit=case.limit, public_url="http://127.0.0.1:8765")
    except UnrenderableArguments:
        pytest.fail(f"a card must be built for {case!r}")
    # What is shown decodes to exactly what was asked: the fields to their one-line text, values to their text.
    assert unreveal_line(card.tool) == case.tool
    assert unreveal_line(card.requester) == case.requester
    assert unreveal_line(card.origin) == case.origin
    assert {unreveal_line(a.name) for a in card.arguments} == set(case.args)
    for arg in card.arguments:
        if not arg.cut:
            value = case.args[unreveal_line(arg.name)]
            assert unreveal(arg.head) == render_value(value)  # text as itself, or its JSON string if it reads as JSON
    for where, (writer, lines_of) in WRITERS.items():
        try:
            laid: LaidOut[Any] = lay_out(card, writer, outcome=outcome_of(case))
        except CardTooLarge:
            continue  # not shown on that platform at all (a frame too large for it): nothing to misread
        seen = card_tokens(lines_of(laid.written))
        expected = card_tokens(lines_of(writer.write(plain_twin(laid.view))))
        assert seen == expected, (where, laid.written)


def test_argument_names_with_control_characters_are_refused_not_shown() -> None:
    case = Case("shell", "agent:x", "telegram:1", (), {"x\nTool: y": 1}, None, "", "", 500)
    with pytest.raises(UnrenderableArguments, match="control characters"):
        build_card(request_of(case), value_limit=500, public_url="http://x.test")
