"""Telegram's dialect: the card as HTML (parse mode HTML), measured the way Telegram measures it.

Everything a card shows comes from tools and models, so every piece is escaped
for HTML and the whole message is measured in UTF-16 units of its *visible*
text — what Telegram counts after parsing — before it is sent. A value with
more than one line is written in a ``<pre>`` block, the only place a card's
text breaks lines that Kazma did not break.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Final

from telegram import InlineKeyboardButton, InlineKeyboardMarkup, WebAppInfo

from kazma.adapters.card_layout import EMPTY_VALUE, ButtonKind, CardView, CardWriter, LaidOut, lay_out
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome

TEXT_LIMIT: Final = 4096  # UTF-16 units of visible text, as Telegram counts after parsing
CARD_BUDGET: Final = 4000  # below TEXT_LIMIT so a rounding difference on Telegram's side cannot reject a card
CALLBACK_DATA_LIMIT: Final = 64  # bytes
ANSWER_LIMIT: Final = 200  # characters of an answerCallbackQuery text
MAX_ENTITIES: Final = 100  # Telegram silently drops formatting past the 100th entity of a message
INLINE_VALUE_MAX: Final = 60  # longer values (or any with a newline) go in a <pre> block


def utf16_len(text: str) -> int:
    """Length as Telegram counts it: UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


def utf16_units(char: str) -> int:
    return 2 if ord(char) > 0xFFFF else 1


@dataclass(frozen=True)
class TelegramCard:
    html: str
    visible_length: int  # UTF-16 units after Telegram parses the HTML
    entities: int  # formatting entities Telegram will create
    keyboard: InlineKeyboardMarkup | None


class _Html:
    """HTML for Telegram, built from escaped pieces, counting the visible text and entities as it goes."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.visible = 0
        self.entities = 0

    def text(self, value: str) -> None:
        self._parts.append(html.escape(value))
        self.visible += utf16_len(value)

    def tag(self, tag: str, value: str) -> None:
        self._parts.append(f"<{tag}>{html.escape(value)}</{tag}>")
        self.visible += utf16_len(value)
        self.entities += 1

    @property
    def markup(self) -> str:
        return "".join(self._parts)


def keyboard(view: CardView) -> InlineKeyboardMarkup | None:
    if not view.buttons:
        return None  # an edit without reply_markup drops the keyboard: decided cards cannot be pressed
    return InlineKeyboardMarkup(
        [[InlineKeyboardButton(button.label, callback_data=button.data) for button in view.buttons]]
    )


MINI_APP_LABEL: Final = "Open the whole call"
MINI_APP_PATH: Final = "/telegram/app"  # where the console serves the Mini App's landing page


def mini_app_url(card: ApprovalCard) -> str:
    """The approval page as a Telegram Mini App: the console's landing page, which hands Telegram's signed
    ``initData`` to Kazma and goes on to the request's page."""
    base = card.link.partition("/swarm?approval=")[0]
    return f"{base}{MINI_APP_PATH}?approval={card.request_id}"


def mini_app_button(
    card: ApprovalCard, chat: str, *, bot_username: str, short_name: str
) -> InlineKeyboardButton | None:
    """The button that opens the approval page inside Telegram, where Telegram signs who opened it.

    Telegram opens Mini Apps over HTTPS only. In a private chat with the bot an inline ``web_app`` button opens
    the page itself; in a group Telegram refuses such a button, and the way in is the bot's Mini App link
    (``https://t.me/<bot>/<short name>?startapp=<request id>``), which needs the Mini App made at @BotFather
    with the landing page as its URL (``platforms.telegram.mini_app``). None: neither applies here.
    """
    if not card.link.startswith("https://"):
        return None
    if not chat.startswith("-"):
        return InlineKeyboardButton(MINI_APP_LABEL, web_app=WebAppInfo(url=mini_app_url(card)))
    if short_name and bot_username:
        return InlineKeyboardButton(
            MINI_APP_LABEL, url=f"https://t.me/{bot_username}/{short_name}?startapp={card.request_id}"
        )
    return None


def with_button(
    markup: InlineKeyboardMarkup | None, button: InlineKeyboardButton | None
) -> InlineKeyboardMarkup | None:
    """``markup`` with ``button`` on a row of its own below (unchanged when there is no button)."""
    if button is None:
        return markup
    rows = [list(row) for row in markup.inline_keyboard] if markup is not None else []
    return InlineKeyboardMarkup([*rows, [button]])


_OUTCOME_MARK: Final = {"approved": "✅", "denied": "⛔", "timeout": "⌛", "cancelled": "⏹"}


class TelegramWriter:
    """Writes a :class:`CardView` as Telegram HTML; fits within the card budget and the entity cap."""

    def __init__(self, *, budget: int = CARD_BUDGET, max_entities: int = MAX_ENTITIES) -> None:
        self.budget = budget
        self.max_entities = max_entities

    def write(self, view: CardView) -> TelegramCard:
        out = self._write(view, lean=False)
        if out.entities > self.max_entities:
            # Names lose their bold before any argument loses its value to the entity cap.
            out = self._write(view, lean=True)
        return TelegramCard(out.markup, out.visible, out.entities, keyboard(view))

    def fits(self, written: TelegramCard) -> bool:
        return written.visible_length <= self.budget and written.entities <= self.max_entities

    def _write(self, view: CardView, *, lean: bool) -> _Html:
        out = _Html()
        if view.outcome is not None:
            out.text(_OUTCOME_MARK.get(view.outcome.status.value, "") + " ")
            out.tag("b", view.outcome_text)
            out.text("\n\n")
        out.tag("b", view.title)
        for line in view.about:
            out.text(f"\n{line}")
        for warning in view.warnings:
            out.text("\n⚠️ ")
            out.tag("b", warning)
        for label, value in view.facts:
            out.text(f"\n{label}: ")
            out.tag("code", value)
        out.text(f"\n\n{view.arguments_heading}:")
        for arg in view.arguments:
            out.text("\n• ")
            if lean:
                out.text(arg.name)
            else:
                out.tag("b", arg.name)
            if arg.cut:
                # The tail is shown as prominently as the head: a harmless start must not hide a destructive end.
                out.text(":\n")
                if arg.head:  # padding cut out at the very start of a value leaves no head
                    out.tag("pre", arg.head)
                    out.text("\n")
                out.tag("i", arg.marker)
                out.text("\n")
                out.tag("pre", arg.tail)
            elif arg.empty:
                out.text(": ")
                out.tag("i", EMPTY_VALUE)
            elif "\n" in arg.head or len(arg.head) > INLINE_VALUE_MAX:
                out.text(":\n")
                out.tag("pre", arg.head)
            else:
                out.text(": ")
                out.tag("code", arg.head)
        if view.names_only:
            out.text(f"\n\n{view.names_heading}:")
            for name in view.names_only:
                out.text(f"\n• {name}")  # names have no line breaks (checked when the card is built)
        if view.notice:
            out.text("\n\n")
            out.tag("i", view.notice)
        out.text(f"\n\n{view.link_label}: {view.link}")
        if view.footer is not None:
            out.text(f"\n{view.footer[0]}: ")
            out.tag("code", view.footer[1])
        return out


_WRITER: CardWriter[TelegramCard] = TelegramWriter()


def render_card(
    card: ApprovalCard,
    *,
    outcome: Outcome | None = None,
    approve_partial: bool = False,
    writer: TelegramWriter | None = None,
) -> LaidOut[TelegramCard]:
    return lay_out(card, writer or _WRITER, outcome=outcome, approve_partial=approve_partial)


def button_data_fits(view: CardView) -> bool:
    return all(1 <= len(b.data.encode("utf-8")) <= CALLBACK_DATA_LIMIT for b in view.buttons)


__all__ = [
    "ANSWER_LIMIT",
    "CARD_BUDGET",
    "MAX_ENTITIES",
    "TEXT_LIMIT",
    "ButtonKind",
    "TelegramCard",
    "TelegramWriter",
    "button_data_fits",
    "keyboard",
    "mini_app_button",
    "mini_app_url",
    "render_card",
    "utf16_len",
    "utf16_units",
    "with_button",
]
