"""Slack's dialect: the card as Block Kit blocks in mrkdwn, escaped so nothing in it can ping or link.

Slack parses ``<!channel>``, ``<@U…>`` and links only inside ``<…>``; escaping
``& < >`` neutralises all of them, and every text object is ``verbatim`` so
Slack auto-links nothing. Sizes are checked after escaping, since escaping
only ever grows text.

Only a value's lines are laid out as lines, inside a code block; a fact's
value follows its label on the same line and an argument's name follows a
bullet, so no name or value starts a line of its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kazma.adapters.card_layout import (
    EMPTY_VALUE,
    HASH_LABEL,
    REQUESTED_BY_LABEL,
    ButtonKind,
    CardView,
    LaidOut,
    lay_out,
)
from kazma.adapters.contract import Home
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome, Status

APPROVE_ACTION: Final = "kazma_approve"
DENY_ACTION: Final = "kazma_deny"
REMEMBER_ACTION: Final = "kazma_remember"
DENY_REASON_ACTION: Final = "kazma_deny_reason"
_ACTIONS: Final = {
    ButtonKind.APPROVE: APPROVE_ACTION,
    ButtonKind.DENY: DENY_ACTION,
    ButtonKind.REMEMBER: REMEMBER_ACTION,
    ButtonKind.DENY_REASON: DENY_REASON_ACTION,
}
CHOICE_ACTION: Final = re.compile(r"^kazma_choice_\d+$")  # one per choice of a question
ACTIONS_BLOCK_ID: Final = "kazma_actions"

# Slack's Block Kit limits (https://docs.slack.dev/reference/block-kit).
MAX_BLOCKS: Final = 50
MAX_SECTION_TEXT: Final = 3000
HOME_ITEM_TEXT: Final = 500  # characters of one waiting request's line on the App Home
MAX_HEADER_TEXT: Final = 150
MAX_FIELDS: Final = 10
MAX_FIELD_TEXT: Final = 2000
# Slack refuses text over 40,000 characters but folds long messages well before
# that; 3,900 keeps every part readable and clear of the hard limit.
MAX_MESSAGE_TEXT: Final = 3900

_STATUS_EMOJI: Final = {
    Status.APPROVED: ":white_check_mark:",
    Status.DENIED: ":no_entry:",
    Status.TIMEOUT: ":hourglass:",
    Status.CANCELLED: ":heavy_minus_sign:",
}
_USER_MENTION: Final = re.compile(r"<@([UW][A-Z0-9]+)(?:\|[^>]*)?>")


def escape(text: str) -> str:
    """Neutralise Slack's control sequences: ``<!channel>``, ``<@U…>`` and links all need ``<``."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def escaped_units(char: str) -> int:
    """How many characters ``char`` takes once escaped (Slack's limits count the escaped text)."""
    return len(escape(char))


def user_mentions(text: str) -> list[str]:
    """Slack user ids mentioned as ``<@U…>`` in raw (escaped) event text, lowercased."""
    return [m.lower() for m in _USER_MENTION.findall(text)]


def strip_user_mentions(text: str) -> str:
    return _USER_MENTION.sub(" ", text)


def _defang_backticks(text: str) -> str:
    # A value cannot close our code fence (or merge with it) when no backtick
    # touches another; zero-width spaces keep what a reader sees unchanged.
    return text.replace("`", "\u200b`\u200b")


def _code(value: str) -> str:
    return f"```{_inert(value)}```"


def _inert(text: str) -> str:
    """Untrusted text for mrkdwn outside a code block: escaped, and no backtick can open or close a code span."""
    return escape(_defang_backticks(text))


def _mrkdwn(text: str) -> dict[str, Any]:
    # verbatim: Slack must not auto-link or auto-parse anything in what we show.
    return {"type": "mrkdwn", "text": text, "verbatim": True}


def _plain(text: str) -> dict[str, Any]:
    return {"type": "plain_text", "text": text, "emoji": False}


def _clip_escaped(text: str, limit: int) -> str:
    """``text`` escaped, in at most ``limit`` characters: cut (with "…") before a whole character's escape, never
    inside one (``&am…`` showed a broken entity, and the cut's budget was spent on half an escape)."""
    escaped = escape(text)
    if len(escaped) <= limit:
        return escaped
    kept: list[str] = []
    used = 1  # the "…"
    for char in text:
        piece = escape(char)
        if used + len(piece) > limit:
            break
        kept.append(piece)
        used += len(piece)
    return "".join(kept) + "…"


def _link(url: str, label: str) -> str:
    # Inside <url|label> a '|' or '>' would end the URL early.
    return f"<{escape(url).replace('|', '%7C')}|{escape(label)}>"


def _chunk_lines(first: str, lines: list[str], limit: int) -> list[str]:
    """Pack ``first`` then ``lines`` into texts of at most ``limit`` characters, never splitting a line."""
    chunks: list[str] = []
    current = first
    for line in lines:
        candidate = f"{current}\n{line}" if current else line
        if len(candidate) <= limit or not current:
            current = candidate
            continue
        chunks.append(current)
        current = line
    if current:
        chunks.append(current)
    return chunks


def choice_blocks(escaped_text: str, choices: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """A question: its (already escaped) text, then one button per choice."""
    question: list[dict[str, Any]] = [{"type": "section", "block_id": "kazma_question", "text": _mrkdwn(escaped_text)}]
    if not choices:
        return question
    return [
        *question,
        {
            "type": "actions",
            "block_id": "kazma_choices",
            "elements": [
                {"type": "button", "action_id": f"kazma_choice_{i}", "text": _plain(label[:75]), "value": data}
                for i, (label, data) in enumerate(choices)
            ],
        },
    ]


@dataclass(frozen=True)
class SlackCard:
    blocks: list[dict[str, Any]]
    text: str  # the notification / fallback text


class SlackWriter:
    """Writes a :class:`CardView` as blocks; fits within Slack's block, section and header limits."""

    def write(self, view: CardView) -> SlackCard:
        blocks: list[dict[str, Any]] = []
        if view.outcome is not None:
            emoji = _STATUS_EMOJI.get(view.outcome.status, ":information_source:")
            blocks.append(
                {
                    "type": "section",
                    "block_id": "kazma_outcome",
                    "text": _mrkdwn(f"{emoji} *{_inert(view.outcome_text)}*"),
                }
            )
        # plain text is not parsed, but nothing from a tool reaches Slack unescaped
        title = _clip_escaped(view.title, MAX_HEADER_TEXT)
        blocks.append({"type": "header", "block_id": "kazma_title", "text": _plain(title)})
        for index, line in enumerate(view.about):
            blocks.append({"type": "section", "block_id": f"kazma_about_{index}", "text": _mrkdwn(_inert(line))})
        for index, warning in enumerate(view.warnings):
            blocks.append(
                {
                    "type": "section",
                    "block_id": f"kazma_warning_{index}",
                    "text": _mrkdwn(f":warning: *{_inert(warning)}*"),
                }
            )
        blocks.append(
            {
                "type": "section",
                "block_id": "kazma_facts",
                "fields": [_mrkdwn(f"*{escape(label)}:* `{_inert(value)}`") for label, value in view.facts],
            }
        )
        blocks.append(
            {"type": "section", "block_id": "kazma_arguments", "text": _mrkdwn(f"*{escape(view.arguments_heading)}*")}
        )
        for index, arg in enumerate(view.arguments):
            name = f"• *{_inert(arg.name)}*"
            if arg.cut:
                head = f"\n{_code(arg.head)}" if arg.head else ""  # padding cut out at the very start leaves no head
                text = f"{name}{head}\n_{escape(arg.marker)}_\n{_code(arg.tail)}"
            elif arg.empty:
                text = f"{name}\n_{escape(EMPTY_VALUE)}_"
            else:
                text = f"{name}\n{_code(arg.head)}"
            blocks.append({"type": "section", "block_id": f"kazma_arg_{index}", "text": _mrkdwn(text)})
        if view.names_only:
            names = [f"• *{_inert(name)}*" for name in view.names_only]
            for index, chunk in enumerate(_chunk_lines(f"*{escape(view.names_heading)}*", names, MAX_SECTION_TEXT)):
                blocks.append({"type": "section", "block_id": f"kazma_more_{index}", "text": _mrkdwn(chunk)})
        if view.notice:
            blocks.append(
                {"type": "section", "block_id": "kazma_notice", "text": _mrkdwn(f":warning: _{escape(view.notice)}_")}
            )
        blocks.append(
            {
                "type": "section",
                "block_id": "kazma_link",
                "text": _mrkdwn(f"*{escape(view.link_label)}:* {_link(view.link, view.link)}"),
            }
        )
        if view.footer is not None:
            label, value = view.footer
            blocks.append(
                {
                    "type": "section",
                    "block_id": "kazma_witness",
                    "text": _mrkdwn(f"*{escape(label)}:* `{_inert(value)}`"),
                }
            )
        if view.buttons:
            blocks.append(
                {
                    "type": "actions",
                    "block_id": ACTIONS_BLOCK_ID,
                    "elements": [
                        {
                            "type": "button",
                            "action_id": _ACTIONS[button.kind],
                            "text": _plain(button.label),
                            "style": "danger" if button.kind is ButtonKind.DENY else "primary",
                            "value": button.data,
                        }
                        for button in view.buttons
                    ],
                }
            )
        return SlackCard(blocks, self._fallback(view))

    @staticmethod
    def _fallback(view: CardView) -> str:
        facts = dict(view.facts)
        parts = [view.title, *(f"{label} {facts[label]}" for label in (REQUESTED_BY_LABEL, HASH_LABEL))]
        if view.outcome is not None:
            parts.insert(0, view.outcome_text)
        return _clip_escaped(" — ".join(parts) + f". {view.link_label}: {view.link}", MAX_SECTION_TEXT)

    def fits(self, written: SlackCard) -> bool:
        # One block stays free on a pending card for the outcome a settle puts in place of the buttons.
        room = MAX_BLOCKS - (1 if any(b["type"] == "actions" for b in written.blocks) else 0)
        if len(written.blocks) > room:
            return False
        for block in written.blocks:
            if block["type"] == "section":
                if "text" in block and len(block["text"]["text"]) > MAX_SECTION_TEXT:
                    return False
                fields = block.get("fields", [])
                if len(fields) > MAX_FIELDS or any(len(f["text"]) > MAX_FIELD_TEXT for f in fields):
                    return False
        return True


_WRITER: Final = SlackWriter()


def render_card(
    card: ApprovalCard, *, outcome: Outcome | None = None, approve_partial: bool = False
) -> LaidOut[SlackCard]:
    return lay_out(card, _WRITER, outcome=outcome, approve_partial=approve_partial)


# -- the App Home -----------------------------------------------------------------------------------


def home_view(home: Home) -> dict[str, Any]:
    """A person's App Home tab: who they are to Kazma, what waits for a decision (each with its page), and how
    to talk to the agents. Every text is escaped; links are Kazma's own approval pages."""
    if home.may_decide:
        standing = f"You are *{escape(home.who)}*: an approver here."
    else:
        standing = f"You are *{escape(home.who)}*: not an approver here, so you can read but not decide."
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": "Kazma"}},
        {"type": "section", "text": {"type": "mrkdwn", "text": standing}},
        {
            "type": "header",
            "text": {"type": "plain_text", "text": f"Waiting for a decision ({len(home.waiting) + home.more})"},
        },
    ]
    for item in home.waiting:
        # the text cut before escaping (an escape is never split), well inside a section's 3,000 characters
        line = f"{escape(item.text[:HOME_ITEM_TEXT])}\n<{escape(item.link)}|Full call>"
        if home.may_decide and not item.yours:
            line += " · _not yours to decide under its policy_"
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": line}})
    if not home.waiting:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "Nothing waits for a decision."}})
    if home.more:
        more = f"{home.more} more"
        if home.console:
            more += f": <{escape(home.console)}/swarm|every approval in the console>"
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": more}]})
    blocks += [
        {"type": "divider"},
        {
            "type": "context",
            "elements": [
                {
                    "type": "mrkdwn",
                    "text": "Talk to the agents by mentioning the app in a channel, or here in Messages. "
                    "`/swarm help` lists the swarm commands; `/plan` shows a channel's plan.",
                }
            ],
        },
    ]
    return {"type": "home", "blocks": blocks}
