"""Discord's dialect: the card as one embed, with markdown escaped and every mention syntax broken.

Card text comes from tools and models, so it is escaped for Discord markdown,
mention syntax is broken with zero-width spaces, code blocks cannot be closed
from inside, and every send *and* edit carries ``AllowedMentions.none()``
(edits re-parse mentions with the defaults otherwise). A value's lines are
laid out only inside its code block, and every field is named ``• <argument>``,
so neither a value nor a name can stand as a line of the card's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import discord

from kazma.adapters.card_layout import EMPTY_VALUE, ButtonKind, CardView, LaidOut, lay_out
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome, Status

CONTENT_MAX: Final = 2000
TITLE_MAX: Final = 256
DESCRIPTION_MAX: Final = 4096
FIELDS_MAX: Final = 25
FIELD_NAME_MAX: Final = 256
FIELD_VALUE_MAX: Final = 1024
EMBED_TOTAL_MAX: Final = 6000
FOOTER_MAX: Final = 2048
ZWSP: Final = "\u200b"
ARGUMENT_MARK: Final = "• "  # before every argument's field name, as before every name the card lists
NO_MENTIONS: Final = discord.AllowedMentions.none()

_RAW_MENTION: Final = re.compile(r"<(?=[@#/!])")
# A backtick behind an even number of backslashes (none included) is live: it could open a code span or a fence.
_LIVE_BACKTICK: Final = re.compile(r"(?<!\\)((?:\\\\)*)`")
# Every character that escape_text's escapes act on (discord.py's markdown and mention patterns, and the two
# above): text with none of them comes out as it went in. Most of a settled card's texts (its labels, the
# hash, ids, times) have none, and the escapes' regexes were ~80% of writing a card (~100 µs of ~125).
_ESCAPE_TRIGGERS: Final = re.compile(r"[_\\~|*`>\[#\-@<]")
_COLOURS: Final[dict[Status, discord.Colour]] = {
    Status.APPROVED: discord.Colour.green(),
    Status.DENIED: discord.Colour.red(),
    Status.TIMEOUT: discord.Colour.light_grey(),
    Status.CANCELLED: discord.Colour.light_grey(),
}
_MARKS: Final[dict[Status, str]] = {
    Status.APPROVED: "✅",
    Status.DENIED: "⛔",
    Status.TIMEOUT: "⌛",
    Status.CANCELLED: "⏹",
}
_PENDING_COLOUR: Final = discord.Colour.gold()


def card_footer(request_id: str) -> str:
    """A card's embed footer: the request it is for (how a card a crash left unrecorded is found again)."""
    return f"request {request_id}"


def neutralise_mentions(value: str) -> str:
    """Break every mention syntax so it renders as text, even if a send forgot ``allowed_mentions``.

    ``escape_mentions`` covers ``@everyone``, ``@here`` and snowflake ids; raw
    ``<@…>``, ``<@&…>``, ``<#…>``, ``</…>`` and ``<!…>`` of any length are broken
    after the ``<``.
    """
    return _RAW_MENTION.sub("<" + ZWSP, discord.utils.escape_mentions(value))


def escape_text(value: str) -> str:
    """Untrusted text outside code blocks: markdown escaped, mentions neutralised.

    ``escape_markdown`` skips whatever looks like a link, so ``x```` at a URL's end opened a code block that
    swallowed the card's next lines as if they were a value: every backtick still live after it is escaped too.
    """
    if _ESCAPE_TRIGGERS.search(value) is None:
        return value
    return _escaped(value)


def _escaped(value: str) -> str:
    """:func:`escape_text` without its shortcut: every escape run."""
    escaped = discord.utils.escape_markdown(value)
    return neutralise_mentions(_LIVE_BACKTICK.sub(r"\1\\`", escaped))


def code_safe(value: str) -> str:
    """Text for inside a ``` block: a zero-width space after each backtick, so no fence can close early."""
    return neutralise_mentions(value.replace("`", "`" + ZWSP))


def clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "…"


def code_block(value: str) -> str:
    """``value`` in a ``` block that nothing in it can close (a card's value, a table's columns)."""
    return f"```\n{code_safe(value)}\n```"


@dataclass(frozen=True)
class DiscordCard:
    embed: discord.Embed
    view: discord.ui.View | None
    oversized: bool  # some part is over a per-part limit (a field, the title, the description)


def buttons_view(view: CardView) -> discord.ui.View | None:
    if not view.buttons:
        return None
    ui = discord.ui.View(timeout=None)
    for button in view.buttons:
        denies = button.kind in (ButtonKind.DENY, ButtonKind.DENY_REASON)
        style = discord.ButtonStyle.danger if denies else discord.ButtonStyle.success
        ui.add_item(discord.ui.Button(style=style, label=button.label, custom_id=button.data))
    # A stopped view still renders its components but discord.py does not keep it
    # in its view store: presses are handled in on_interaction (see the adapter).
    ui.stop()
    return ui


class DiscordWriter:
    """Writes a :class:`CardView` as one embed; fits within every embed limit Discord enforces."""

    def write(self, view: CardView) -> DiscordCard:
        colour = _PENDING_COLOUR if view.outcome is None else _COLOURS[view.outcome.status]
        lines: list[str] = []
        if view.outcome is None:
            title = escape_text(view.title)
        else:
            # Decided: the outcome is the first thing a reader sees, the request's title right below it.
            title = f"{_MARKS[view.outcome.status]} {escape_text(view.outcome_text)}"
            lines.append(f"**{escape_text(view.title)}**")
        lines += [escape_text(line) for line in view.about]
        lines += [f"⚠️ **{escape_text(warning)}**" for warning in view.warnings]
        lines += [f"**{escape_text(label)}:** {escape_text(value)}" for label, value in view.facts]
        lines.append(f"**{escape_text(view.arguments_heading)}** below")
        if view.names_only:
            lines.append(f"**{escape_text(view.names_heading)}:**")
            lines += [f"• {escape_text(name)}" for name in view.names_only]
        if view.notice:
            lines.append(f"*{escape_text(view.notice)}*")
        lines.append(f"**{escape_text(view.link_label)}:** {escape_text(view.link)}")
        if view.footer is not None:
            # Kazma's own digits and hex, in code: "#" would otherwise be escaped (a heading mark) and shown "\#".
            lines.append(f"**{escape_text(view.footer[0])}:** `{code_safe(view.footer[1])}`")
        description = "\n".join(lines)
        # No embed ``url``: Discord refuses the whole message for a URL it deems malformed.
        embed = discord.Embed(title=clip(title, TITLE_MAX), description=description, colour=colour)
        oversized = len(description) > DESCRIPTION_MAX  # a long title is clipped: the outcome leads it
        for arg in view.arguments:
            if arg.cut:
                head = f"{code_block(arg.head)}\n" if arg.head else ""  # padding cut out at the very start: no head
                value = f"{head}*{escape_text(arg.marker)}*\n{code_block(arg.tail)}"
            elif arg.empty:
                value = f"*{EMPTY_VALUE}*"
            else:
                value = code_block(arg.head)
            name = f"{ARGUMENT_MARK}{escape_text(arg.name)}"
            oversized |= len(name) > FIELD_NAME_MAX or len(value) > FIELD_VALUE_MAX
            embed.add_field(name=name[:FIELD_NAME_MAX], value=value, inline=False)
        embed.set_footer(text=card_footer(view.request_id))
        return DiscordCard(embed, buttons_view(view), oversized)

    def fits(self, written: DiscordCard) -> bool:
        embed = written.embed
        return not written.oversized and len(embed.fields) <= FIELDS_MAX and len(embed) <= EMBED_TOTAL_MAX


_WRITER: Final = DiscordWriter()


def render_card(
    card: ApprovalCard, *, outcome: Outcome | None = None, approve_partial: bool = False
) -> LaidOut[DiscordCard]:
    return lay_out(card, _WRITER, outcome=outcome, approve_partial=approve_partial)
