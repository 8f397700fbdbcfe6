"""Matrix's dialect: the card as an ``m.room.message`` with ``org.matrix.custom.html`` and a plain body that says
the same, and the choices a reaction makes (the card's buttons, as emoji keys).

Everything a card shows comes from tools and models, so every piece is escaped for HTML; a value with more
than one line (or a long one) is a ``<pre>`` block, the only place the card breaks lines Kazma did not break.
Lines end ``<br>`` plus a newline: a client lays out the tag, and the newline keeps the source readable. The
plain ``body`` is the one plain-text layout (:class:`~kazma.adapters.card_layout.PlainWriter`) with the
reactions named instead of buttons. A card must fit one event (the homeserver refuses an event over 64 KiB),
so the writer measures the content as JSON.

``m.mentions`` is always sent empty: with it present, clients notify nobody for text in the body, so no
``@room`` or user id in an argument can ping (the intentional-mentions rule).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, replace
from typing import Any, Final, NamedTuple

from kazma.adapters.card_layout import (
    EMPTY_VALUE,
    ButtonKind,
    CardView,
    CardWriter,
    LaidOut,
    PlainWriter,
    ShownArgument,
    lay_out,
)
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome

HTML_FORMAT: Final = "org.matrix.custom.html"
CHOICES_KEY: Final = "org.kazma.choices"  # on the bot's own card: which reaction key means which button's data
PROMPT_KEY: Final = "org.kazma.reason_prompt"  # on the bot's own "Deny with reason" prompt: whose, what, until
# Bytes of content JSON: well under the 65,536 of a whole event with its envelope. An edit carries the card once,
# in ``m.new_content``, beside a one-line fallback (:func:`edit_content`), so the same budget holds for edits.
CARD_BUDGET: Final = 48_000
FALLBACK_MAX: Final = 200  # characters of the headline an edit's fallback line repeats
EDIT_POINTER: Final = "see the card above"
TEXT_LIMIT: Final = 8_000  # bytes of one text message's body as JSON: a few screens, one message each
INLINE_VALUE_MAX: Final = 60
# The reaction that stands for each button. ✅ and ❌ are what people already use for yes and no.
KEYS: Final[dict[ButtonKind, str]] = {
    ButtonKind.APPROVE: "✅",
    ButtonKind.REMEMBER: "🔁",
    ButtonKind.DENY: "❌",
    ButtonKind.DENY_REASON: "💬",
}
# A question's choices: keycap digits, then letters (a question offers a handful).
CHOICE_KEYS: Final = ("1️⃣", "2️⃣", "3️⃣", "4️⃣", "5️⃣", "6️⃣", "7️⃣", "8️⃣", "9️⃣", "🔟")
VARIATION_SELECTOR: Final = "\ufe0f"


def json_units(char: str) -> int:
    """How many bytes ``char`` takes in an event's JSON (UTF-8, escapes included)."""
    return len(json.dumps(char, ensure_ascii=False).encode()) - 2


def same_key(key: str) -> str:
    """A reaction key as compared: clients send ✅ with and without the emoji variation selector."""
    return key.replace(VARIATION_SELECTOR, "")


class Choice(NamedTuple):
    """One reaction a message offers: its key, what it means to people, and the data a press with it carries."""

    key: str
    label: str
    data: str


@dataclass(frozen=True)
class MatrixCard:
    body: str
    html: str
    choices: tuple[Choice, ...]

    def content(self) -> dict[str, Any]:
        """The ``m.room.message`` content of this card (the choices kept on it for the reactions to come)."""
        return message_content(self.body, self.html, self.choices, notice=False)


def message_content(body: str, formatted: str | None, choices: tuple[Choice, ...], *, notice: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"msgtype": "m.notice" if notice else "m.text", "body": body, "m.mentions": {}}
    if formatted is not None:
        content["format"] = HTML_FORMAT
        content["formatted_body"] = formatted
    if choices:
        content[CHOICES_KEY] = [{"key": c.key, "label": c.label, "data": c.data} for c in choices]
    return content


def edit_content(written: MatrixCard, view: CardView, target: str) -> dict[str, Any]:
    """The ``m.replace`` edit of the card ``target`` to ``written``: the card once, in ``m.new_content``, which every
    client that shows edits shows in place; the fallback a client without edits shows is one line pointing at the
    card (its outcome, else its title). The card twice would make an edit of a card at :data:`CARD_BUDGET` larger
    than an event may be (the homeserver refuses it, M_TOO_LARGE, and no retry mends that)."""
    headline = view.outcome_text or view.title
    if len(headline) > FALLBACK_MAX:
        headline = headline[: FALLBACK_MAX - 1] + "…"
    new = written.content()
    return {
        "msgtype": new["msgtype"],
        "body": f"* {headline} — {EDIT_POINTER}",
        "format": HTML_FORMAT,
        "formatted_body": f"* {_e(headline)} — {EDIT_POINTER}",
        "m.mentions": {},
        "m.new_content": new,
        "m.relates_to": {"rel_type": "m.replace", "event_id": target},
    }


def legend(choices: tuple[Choice, ...]) -> str:
    """What to react with, as one line (empty when nothing can be chosen)."""
    if not choices:
        return ""
    return "React: " + " · ".join(f"{c.key} {c.label}" for c in choices)


def card_choices(view: CardView) -> tuple[Choice, ...]:
    return tuple(Choice(KEYS[b.kind], b.label, b.data) for b in view.buttons)


def question_choices(choices: list[tuple[str, str]]) -> tuple[Choice, ...]:
    return tuple(Choice(key, label, data) for key, (label, data) in zip(CHOICE_KEYS, choices, strict=False))


class _Html:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def text(self, value: str) -> None:
        self.parts.append(html.escape(value, quote=False))

    def tag(self, tag: str, value: str) -> None:
        self.parts.append(f"<{tag}>{html.escape(value, quote=False)}</{tag}>")

    def line(self) -> None:
        self.parts.append("<br>\n")

    def raw(self, markup: str) -> None:
        self.parts.append(markup)


class MatrixWriter:
    """Writes a :class:`CardView` as Matrix HTML and its plain body; fits one event."""

    def __init__(self, *, budget: int = CARD_BUDGET) -> None:
        self.budget = budget
        self._plain = PlainWriter()

    def write(self, view: CardView) -> MatrixCard:
        choices = card_choices(view)
        body = self._plain.write(replace(view, buttons=()))
        said = legend(choices)
        if said:
            body = f"{body}\n{said}"
        return MatrixCard(body, self._html(view, said), choices)

    def fits(self, written: MatrixCard) -> bool:
        return len(json.dumps(written.content(), ensure_ascii=False).encode()) <= self.budget

    def _html(self, view: CardView, said: str) -> str:
        out = _Html()
        if view.outcome is not None:
            out.tag("b", view.outcome_text)
            out.line()
            out.line()
        out.tag("b", view.title)
        for line in view.about:  # who asked and why: the asker's words, plain, never a warning
            out.line()
            out.text(line)
        for warning in view.warnings:
            out.line()
            out.text("⚠️ ")
            out.tag("b", warning)
        for label, value in view.facts:
            out.line()
            out.text(f"{label}: ")
            out.tag("code", value)
        out.line()
        out.line()
        out.text(f"{view.arguments_heading}:")
        for arg in view.arguments:
            out.line()
            out.text("• ")
            out.tag("b", arg.name)
            out.raw(_value(arg))
        if view.names_only:
            out.line()
            out.line()
            out.text(f"{view.names_heading}:")
            for name in view.names_only:
                out.line()
                out.text(f"• {name}")
        if view.notice:
            out.line()
            out.line()
            out.tag("i", view.notice)
        out.line()
        out.line()
        out.text(f"{view.link_label}: ")
        link = html.escape(view.link, quote=True)
        out.raw(f'<a href="{link}">{link}</a>')
        if view.footer is not None:
            out.line()
            out.text(f"{view.footer[0]}: ")
            out.tag("code", view.footer[1])
        if said:
            out.line()
            out.line()
            out.text(said)
        return "".join(out.parts)


def _value(arg: ShownArgument) -> str:
    """An argument's value after its name: inline code when short and one line, else blocks; a cut value's
    tail as prominent as its head, so a harmless start cannot hide a destructive end."""
    if arg.empty:
        return f": <i>{_e(EMPTY_VALUE)}</i>"
    if arg.cut:
        head = f"<pre>{_e(arg.head)}</pre>" if arg.head else ""
        return f":{head}<i>{_e(arg.marker)}</i><pre>{_e(arg.tail)}</pre>"
    block = "\n" in arg.head or len(arg.head) > INLINE_VALUE_MAX
    return f":<pre>{_e(arg.head)}</pre>" if block else f": <code>{_e(arg.head)}</code>"


def _e(text: str) -> str:
    return html.escape(text, quote=False)


_WRITER: CardWriter[MatrixCard] = MatrixWriter()


def render_card(
    card: ApprovalCard, *, outcome: Outcome | None = None, approve_partial: bool = False
) -> LaidOut[MatrixCard]:
    return lay_out(card, _WRITER, outcome=outcome, approve_partial=approve_partial)
