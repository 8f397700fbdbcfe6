"""One card layout: the same facts, in the same order, with the same labels, on every platform and page."""

from __future__ import annotations

import dataclasses
import html
import io
import re
from typing import Any

import pytest

from kazma.adapters.card_layout import (
    DEADLINE_LABEL,
    FROM_LABEL,
    FULL_CALL_LABEL,
    HASH_LABEL,
    MIN_EXCERPT,
    REQUESTED_BY_LABEL,
    TOOL_LABEL,
    ButtonKind,
    CardTooLarge,
    CardView,
    CardWriter,
    PlainWriter,
    lay_out,
    outcome_line,
    view_of,
)
from kazma.adapters.discord.render import DiscordWriter
from kazma.adapters.matrix.render import MatrixWriter
from kazma.adapters.slack.render import SlackWriter
from kazma.adapters.telegram.render import TelegramWriter
from kazma.adapters.terminal import TerminalAdapter
from kazma.adapters.web.render import HtmlWriter
from kazma.approvals import Hidden
from kazma.approvals.card import ASKED_THROUGH_API, REASON_GIVEN, build_card
from kazma.approvals.model import Status
from tests.contract.harness import make_card, outcome_of
from tests.test_honesty import CASES, request_for


def visible(written: Any) -> str:
    """Whatever a writer wrote, as the text a person would read (markup stripped, escapes resolved)."""
    if isinstance(written, str):
        if written.lstrip().startswith("<div"):
            return html.unescape(re.sub(r"<[^>]+>", "\n", written))
        return written
    if hasattr(written, "html"):
        return html.unescape(re.sub(r"<[^>]+>", "", written.html))
    if hasattr(written, "blocks"):
        texts: list[str] = []
        for block in written.blocks:
            for key in ("text",):
                if key in block:
                    texts.append(block[key]["text"])
            texts += [f["text"] for f in block.get("fields", [])]
        joined = "\n".join(texts)
        return joined.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    embed = written.embed
    parts = [embed.title or "", embed.description or ""] + [f"{f.name}\n{f.value}" for f in embed.fields]
    return re.sub(r"\\(.)", r"\1", "\n".join(parts).replace("*", ""))


WRITERS: dict[str, CardWriter[Any]] = {
    "telegram": TelegramWriter(),
    "slack": SlackWriter(),
    "discord": DiscordWriter(),
    "matrix": MatrixWriter(),
    "terminal": PlainWriter(),
    "web": HtmlWriter(),
}
ORDER = [TOOL_LABEL, REQUESTED_BY_LABEL, FROM_LABEL, DEADLINE_LABEL, HASH_LABEL, "Arguments (2)", FULL_CALL_LABEL]


@pytest.mark.parametrize("where", sorted(WRITERS))
def test_every_writer_shows_the_same_labels_in_the_same_order(where: str) -> None:
    card = make_card({"command": "ls", "cwd": "/srv"})
    text = visible(lay_out(card, WRITERS[where]).written)
    positions = [text.find(label) for label in [card.title, *ORDER]]
    assert -1 not in positions, (where, text)
    assert positions == sorted(positions), (where, text)
    for value in ("ls", "/srv", card.args_hash, card.link):
        assert value in text, where


@pytest.mark.parametrize("where", sorted(WRITERS))
def test_every_writer_puts_the_outcome_first_once_decided(where: str) -> None:
    card = make_card({"command": "ls"})
    outcome = outcome_of(card, Status.TIMEOUT)
    laid = lay_out(card, WRITERS[where], outcome=outcome)
    text = visible(laid.written)
    assert text.index(outcome_line(outcome)) < text.index(TOOL_LABEL)
    assert laid.view.buttons == ()


SETTLED = {
    Status.APPROVED: "APPROVED by telegram:111 via telegram at 2030-01-02 03:04:05 UTC",
    Status.DENIED: "DENIED by telegram:111 via telegram at 2030-01-02 03:04:05 UTC",
    Status.TIMEOUT: "TIMED OUT at 2030-01-02 03:04:05 UTC: no decision before the deadline (not a denial)",
    Status.CANCELLED: "CANCELLED at 2030-01-02 03:04:05 UTC: the waiter stopped (not a denial)",
}


@pytest.mark.parametrize("where", sorted(WRITERS))
@pytest.mark.parametrize("status", list(SETTLED))
def test_a_settled_card_says_its_outcome_once(where: str, status: Status) -> None:
    """``APPROVED by …``, never ``APPROVED: approved by …``: the headline says the status, the rest who and when."""
    card = make_card({"command": "ls"})
    outcome = outcome_of(card, status)
    assert outcome_line(outcome) == SETTLED[status]
    text = visible(lay_out(card, WRITERS[where], outcome=outcome).written)
    assert SETTLED[status] in text, (where, text)
    word = {Status.TIMEOUT: "timed out"}.get(status, status.value)
    assert text.lower().count(word) == 1, (where, text)  # the status once, on the whole card


@pytest.mark.parametrize("where", sorted(WRITERS))
def test_every_writer_marks_a_cut_the_same_way(where: str) -> None:
    card = make_card({"command": "A" * 300 + "Z" * 700}, value_limit=100)
    text = visible(lay_out(card, WRITERS[where]).written)
    assert "[cut: 900 of 1,000 characters not shown]" in text, where
    assert "AAAA" in text
    assert "ZZZZ" in text


def test_a_whole_card_offers_approve_and_deny() -> None:
    view = view_of(make_card({"a": 1}))
    assert view.whole
    assert [b.kind for b in view.buttons] == [ButtonKind.APPROVE, ButtonKind.DENY, ButtonKind.DENY_REASON]
    assert view.notice == ""


def test_a_cut_value_takes_approve_away_unless_the_team_opted_in() -> None:
    card = make_card({"a": "x" * 2_000}, value_limit=100)
    refused = view_of(card)
    assert not refused.whole
    assert [b.kind for b in refused.buttons] == [ButtonKind.DENY, ButtonKind.DENY_REASON]
    assert "cannot be approved here" in refused.notice
    allowed = view_of(card, approve_partial=True)
    assert [b.kind for b in allowed.buttons] == [ButtonKind.APPROVE, ButtonKind.DENY, ButtonKind.DENY_REASON]
    assert "Review the whole call before deciding" in allowed.notice


class Budget:
    """A writer that fits while the plain text stays within ``limit`` characters."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.plain = PlainWriter()

    def write(self, view: CardView) -> str:
        return self.plain.write(view)

    def fits(self, written: str) -> bool:
        return len(written) <= self.limit


def test_values_shrink_evenly_keeping_both_ends_before_any_becomes_a_name() -> None:
    card = make_card({f"a{i}": f"<{i}" + "y" * 996 + f"{i}>" for i in range(4)}, value_limit=1_000)
    laid = lay_out(card, Budget(2_000))
    assert laid.view.names_only == ()
    lengths = {len(a.head) + len(a.tail) for a in laid.view.arguments}
    assert len(lengths) == 1  # every value got the same excerpt
    assert all(a.head.startswith(f"<{i}") and a.tail.endswith(f"{i}>") for i, a in enumerate(laid.view.arguments))
    assert len(laid.written) <= 2_000


def test_when_excerpts_cannot_shrink_further_later_arguments_become_names() -> None:
    card = make_card({f"arg{i:02d}": "v" * 500 for i in range(30)})
    laid = lay_out(card, Budget(2_500))
    assert laid.view.arguments
    assert laid.view.names_only
    assert len(laid.view.arguments) + len(laid.view.names_only) == 30
    assert all(len(a.head) + len(a.tail) >= MIN_EXCERPT for a in laid.view.arguments)
    assert not laid.whole


def test_when_not_even_the_names_fit_they_are_counted() -> None:
    card = make_card({f"argument_{i:03d}": i for i in range(300)})
    laid = lay_out(card, Budget(1_500))
    assert laid.view.names_hidden == 300
    assert "300 of 300 argument names do not fit here" in laid.written


def test_a_frame_that_cannot_fit_is_refused() -> None:
    with pytest.raises(CardTooLarge):
        lay_out(make_card({"a": 1}), Budget(50))


@pytest.mark.parametrize("where", sorted(WRITERS))
def test_every_writer_shows_hidden_characters_escaped_with_the_warning(where: str) -> None:
    card = make_card({"command": "echo hi; true # \u202e ; rm -rf ~\r\x1b[1A"})
    text = visible(lay_out(card, WRITERS[where]).written)
    assert "\u202e" not in text
    assert "\x1b" not in text
    assert "⟨U+202E" in text
    assert "⟨U+000D" in text
    assert "Hidden or control characters" in text
    assert text.index("Hidden or control characters") < text.index(TOOL_LABEL)  # prominent: before the facts


@pytest.mark.parametrize("where", sorted(WRITERS))
@pytest.mark.parametrize(("value", "char", "kind", "shown"), CASES, ids=[f"U+{ord(c[1]):04X}" for c in CASES])
def test_every_writer_shows_every_hidden_class_escaped_under_its_warning(
    where: str, value: str, char: str, kind: Hidden, shown: str
) -> None:
    card = make_card({"command": value})
    text = visible(lay_out(card, WRITERS[where]).written)
    assert shown in text
    facts = text[text.index(TOOL_LABEL) :]  # (the warning line is Kazma's own: its ⚠️ holds U+FE0F)
    assert char not in facts.replace(shown, "")  # the character is gone (for ⟨: but where an escape starts)
    warning = next(line for line in text.splitlines() if kind.label in line)
    assert f"U+{ord(char):04X}" in warning
    assert text.index(warning) < text.index(TOOL_LABEL)
    assert card.args_hash in text  # the hash of the raw call, which runs unchanged


@pytest.mark.parametrize("where", sorted(WRITERS))
def test_a_long_escaped_value_is_never_cut_inside_an_escape(where: str) -> None:
    card = make_card({"blob": "\u202e" * 400}, value_limit=500)
    text = visible(lay_out(card, WRITERS[where]).written)
    assert re.search(r"⟨U\+202E[^⟩]*$", text, flags=re.MULTILINE) is None  # every escape that starts, ends


async def test_the_terminal_prints_no_control_character_of_a_value() -> None:
    # An ANSI sequence in a value could move the cursor and overwrite the card's own lines on a terminal.
    out = io.StringIO()
    terminal = TerminalAdapter(out=out, interactive=False, auto=None)
    card = make_card({"command": "rm -rf ~ \x1b[1A\x1b[2K\recho harmless \u202e"})
    ref = await terminal.post_card(card)
    printed = out.getvalue()
    assert not any(char in printed for char in "\x1b\r\u202e")
    for escape in ("⟨U+001B", "⟨U+000D", "⟨U+202E"):
        assert escape in printed
    assert "Hidden or control characters" in printed
    assert card.args_hash in printed
    assert ref.whole


async def test_the_terminal_prints_no_control_character_of_an_agents_message() -> None:
    # Printed after a card, "\x1b[8A\x1b[2K" would move up and rewrite the card's arguments in place.
    out = io.StringIO()
    terminal = TerminalAdapter(out=out, interactive=False, auto=None)
    await terminal.send_text("terminal", "done\x1b[8A\x1b[2K│ command: ls\nnext line", agent="builder\u202e")
    printed = out.getvalue()
    assert "\x1b" not in printed
    assert "\u202e" not in printed
    assert "done⟨U+001B ESC⟩[8A⟨U+001B ESC⟩[2K│ command: ls" in printed
    assert "[builder⟨U+202E RLO⟩]" in printed
    assert "\n" in printed.strip()  # a newline stays a newline


@pytest.mark.parametrize("where", sorted(WRITERS))
def test_who_asked_and_why_is_said_plainly_and_a_warning_stays_a_warning(where: str) -> None:
    """The approvals API's notes (who asked, for whom, the reason given, how the asker waits) are not warnings;
    how the call would run ("runs unsandboxed") and what was found in it are."""
    request = dataclasses.replace(
        request_for({"command": "ls"}),
        notes=(
            f"{ASKED_THROUGH_API}api:ci; Kazma does not run it, the caller does.",
            f"{REASON_GIVEN}nightly clean-up",
            "runs unsandboxed on this host",
        ),
    )
    card = build_card(request, value_limit=4000, public_url="http://x.test")
    assert card.about == (f"{ASKED_THROUGH_API}api:ci; Kazma does not run it, the caller does.",
                          f"{REASON_GIVEN}nightly clean-up")  # fmt: skip
    assert card.warnings == ("runs unsandboxed on this host",)
    text = visible(lay_out(card, WRITERS[where]).written)
    for line in text.splitlines():
        if "nightly clean-up" in line or "Asked through the approvals API" in line:
            assert "⚠" not in line, (where, line)
            assert ":warning:" not in line, (where, line)
        if "runs unsandboxed" in line:
            assert "⚠" in line or ":warning:" in line, (where, line)
    assert "Reason given: nightly clean-up" in text, where


@pytest.mark.parametrize("limit", range(MIN_EXCERPT, 64, 3))
@pytest.mark.parametrize("value_limit", [100, 2_000])  # cut when the card was built, or whole until laid out
def test_a_shrunk_value_ending_in_an_escape_keeps_its_end(limit: int, value_limit: int) -> None:
    # The last escape (13 characters) is longer than a short excerpt's tail budget: the tail came out empty, and
    # the card showed "echo fine xxx…" and a cut, never the "rm -rf" it ends with.
    card = make_card({"command": "echo fine " + "x" * 400 + "; rm -rf /srv\t"}, value_limit=value_limit)
    shown = view_of(card, limit=limit).arguments[0]
    assert shown.cut
    assert shown.tail.endswith("⟨U+0009 TAB⟩")
    assert shown.head.startswith("echo fine")


def test_a_telegram_card_shrunk_to_short_excerpts_shows_every_values_end() -> None:
    args = {f"s{'p' * 89}{i:02d}": "echo fine " + "x" * 400 + f"; rm -rf /srv/{i}\t" for i in range(21)}
    laid = lay_out(make_card(args), TelegramWriter())
    assert laid.view.arguments
    assert all(a.cut and a.tail.endswith("⟨U+0009 TAB⟩") for a in laid.view.arguments)
    assert TelegramWriter().fits(laid.written)
