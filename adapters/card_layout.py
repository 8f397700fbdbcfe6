"""One approval card layout for every platform, and one algorithm that fits it into each platform's limits.

The layout fixes what a card says and in which order — the outcome once
decided, the title, warnings, the facts (tool, requester, origin, deadline,
hash), every argument with its value or a marked cut, names that could only be
listed, why Approve is elsewhere when it is, the link to the whole call, once
settled the audit checkpoint that holds the decision, the buttons — and the
wording of every label. Each platform's ``render.py`` only
*writes* a :class:`CardView` in its dialect (Telegram HTML, Slack blocks, a
Discord embed, plain text, HTML for the web pages) and says whether the result
fits; :func:`lay_out` finds the most complete view that does.

Lines: every text a card shows is one line except an argument's value (see
:mod:`kazma.approvals.card`), and every writer shows a value's lines visibly
inside the value — a code block, or an indented quote on plain text — so no
value can write a line that looks like a label, an argument or an outcome.
The outcome line is escaped the same way (a cancel reason or a decider is
text too).

Fitting: values shrink evenly (every value gets the same excerpt length, both
ends kept, the cut marked with the true length) until the card fits. When even
the shortest excerpts do not fit, as many arguments as fit keep an excerpt and
the rest are listed by name. When not even every name fits, the card says how
many arguments it cannot list. A card that shows less than the whole call
offers Deny and a link to the approval page, not Approve (unless the team opted
in with ``approvals.approve_cut_in_chat``): what a person approves must be what
they could see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC
from enum import StrEnum
from typing import Final, Generic, Protocol, TypeVar

from kazma.approvals.card import ApprovalCard, CardArgument
from kazma.approvals.honesty import ESCAPE_OPEN, reveal_line, safe_prefix, safe_suffix
from kazma.approvals.model import Decision, Outcome, Status

# -- wording: every label a card shows, once ----------------------------------------------------

APPROVE_LABEL: Final = "Approve"
DENY_LABEL: Final = "Deny"
DENY_REASON_LABEL: Final = "Deny with reason"
TOOL_LABEL: Final = "Tool"
REQUESTED_BY_LABEL: Final = "Requested by"
FROM_LABEL: Final = "From"
DEADLINE_LABEL: Final = "Deadline"
HASH_LABEL: Final = "Arguments SHA-256"
FULL_CALL_LABEL: Final = "Full call"
PROGRESS_LABEL: Final = "Approvals"
STEP_UP_NOTICE: Final = (
    "Approve on its page (Full call) with your passkey: this call's policy asks for one. Deny works here."
)
AUDIT_LABEL: Final = "Audit checkpoint"  # a settled card's footer: the signed checkpoint holding its decision
EMPTY_VALUE: Final = "(empty)"
MIN_EXCERPT: Final = 24  # shortest head + tail a shrunk value keeps

OUTCOME_HEADLINES: Final[dict[Status, str]] = {
    Status.APPROVED: "APPROVED",
    Status.DENIED: "DENIED",
    Status.TIMEOUT: "TIMED OUT",
    Status.CANCELLED: "CANCELLED",
}


def arguments_heading(total: int) -> str:
    return f"Arguments ({total})"


def names_heading(count: int) -> str:
    return f"Listed by name only ({count})"


def cut_marker(original_length: int, omitted: int) -> str:
    """Plain text marking a cut; writers style it distinctly and escape around it."""
    return f"[cut: {omitted:,} of {original_length:,} characters not shown]"


def deadline_text(card: ApprovalCard) -> str:
    return card.deadline.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def outcome_line(outcome: Outcome) -> str:
    """The outcome as one line; its words (who decided, a cancel reason) escaped like every field."""
    afterwards = f" · {outcome.afterwards[:1].upper()}{outcome.afterwards[1:]}" if outcome.afterwards else ""
    # "APPROVED by alice (…) via slack at …": the status said once, in the headline
    return reveal_line(f"{OUTCOME_HEADLINES[outcome.status]} {outcome.details()}{afterwards}")


def agent_prefix(agent: str | None) -> str:
    """How a message names its agent where the platform cannot post under the agent's own name."""
    return f"[{agent}] " if agent else ""


def _notice_names_hidden(hidden: int, total: int) -> str:
    return f"{hidden} of {total} argument names do not fit here."


def _notice_partial(approve_here: bool) -> str:
    if approve_here:
        return "Part of this call is not shown here. Review the whole call before deciding."
    return "Part of this call is not shown here, so it cannot be approved here: review and approve it on its page."


# -- the view a writer writes ---------------------------------------------------------------------


class ButtonKind(StrEnum):
    APPROVE = "approve"
    DENY = "deny"
    DENY_REASON = "deny_reason"  # asks for a reason first (a modal, a reply), then denies
    REMEMBER = "remember"  # approve, and let the identical call run again here until the rule expires


@dataclass(frozen=True)
class Button:
    kind: ButtonKind
    label: str
    data: str  # the compact ``kz1:<id>:<a|d>`` every platform's buttons carry


@dataclass(frozen=True)
class ShownArgument:
    """One argument as a card shows it: the whole value, or its head and tail around a marked cut."""

    name: str
    head: str
    tail: str
    cut: bool
    marker: str  # empty unless cut

    @property
    def empty(self) -> bool:
        return not self.cut and self.head == ""


@dataclass(frozen=True)
class CardView:
    """Everything a card says, laid out once; writers add only their platform's markup."""

    request_id: str
    outcome: Outcome | None
    title: str
    warnings: tuple[str, ...]
    about: tuple[str, ...]  # who asked and why, in the asker's words after Kazma's label: plain lines
    facts: tuple[tuple[str, str], ...]  # (label, value), in this order on every platform
    arguments_heading: str
    arguments: tuple[ShownArgument, ...]
    names_heading: str
    names_only: tuple[str, ...]  # arguments listed by name only
    names_hidden: int  # arguments not even listed by name (too many for this platform)
    notice: str  # why the card shows less than the whole call, and where the rest is; empty when whole
    link_label: str
    link: str
    buttons: tuple[Button, ...]  # empty once decided

    @property
    def outcome_text(self) -> str:
        return outcome_line(self.outcome) if self.outcome is not None else ""

    @property
    def footer(self) -> tuple[str, str] | None:
        """(label, value) of a settled card's witness: the audit checkpoint that holds its decision."""
        if self.outcome is None or self.outcome.witness is None:
            return None
        return AUDIT_LABEL, self.outcome.witness.text()

    @property
    def whole(self) -> bool:
        """Every argument's name and whole value is on this card."""
        return not self.names_only and not self.names_hidden and not any(a.cut for a in self.arguments)

    @property
    def total_arguments(self) -> int:
        return len(self.arguments) + len(self.names_only) + self.names_hidden


Out = TypeVar("Out")
Out_co = TypeVar("Out_co", covariant=True)


class CardWriter(Protocol[Out]):
    """A platform's dialect: write a view, and say whether what was written fits the platform."""

    def write(self, view: CardView) -> Out: ...

    def fits(self, written: Out) -> bool: ...


@dataclass(frozen=True)
class LaidOut(Generic[Out]):
    written: Out
    view: CardView

    @property
    def whole(self) -> bool:
        return self.view.whole


class CardTooLarge(ValueError):
    """Not even the card's frame (title, facts, hash, link) fits this platform: it cannot be shown here."""


# -- excerpts -----------------------------------------------------------------------------------


def _shown(arg: CardArgument, limit: int | None) -> ShownArgument:
    """``arg`` with at most ``limit`` characters of value (None: as the card model holds it), both ends kept.

    The text is the card model's *shown* text, so a cut falls between ``⟨U+…⟩`` escapes, never inside one.
    """
    head, tail, cut = arg.head, arg.tail, arg.cut
    if limit is not None and len(head) + len(tail) > limit:
        keep_tail = max(limit // 3, 1)
        if not cut:  # both excerpts come from the whole value
            tail = _end_of(head, keep_tail)
            head = safe_prefix(head, max(limit - len(tail), 0))
        else:
            tail = _end_of(tail, keep_tail)
            head = safe_prefix(head, max(limit - len(tail), 0))
        cut = True
    if not cut:
        return ShownArgument(arg.name, head, "", False, "")
    omitted = arg.original_length - len(head) - len(tail)
    return ShownArgument(arg.name, head, tail, True, cut_marker(arg.original_length, omitted))


def _end_of(shown: str, keep: int) -> str:
    """The last ``keep`` characters of ``shown``, never cut inside an escape; when those fall inside the final
    escape (longer than ``keep``), that escape whole: a tail is never empty, or the end of the value would be
    hidden behind a harmless start (as :func:`kazma.approvals.card.bound_value` keeps it)."""
    if len(shown) <= keep:
        return shown
    return safe_suffix(shown, keep) or shown[shown.rfind(ESCAPE_OPEN) :]


# -- the layout ---------------------------------------------------------------------------------


def remember_label(seconds: int) -> str:
    return f"Approve for {seconds // 3600} h" if seconds % 3600 == 0 else f"Approve for {seconds // 60} min"


def _buttons(card: ApprovalCard, *, approve: bool, whole: bool) -> tuple[Button, ...]:
    deny = Button(ButtonKind.DENY, DENY_LABEL, card.button_data(Decision.DENY))
    why = Button(ButtonKind.DENY_REASON, DENY_REASON_LABEL, f"{card.button_data(Decision.DENY)[:-1]}n")
    if not approve:
        return (deny, why)
    buttons = [Button(ButtonKind.APPROVE, APPROVE_LABEL, card.button_data(Decision.APPROVE)), deny, why]
    # Never on a cut card (``remember_seconds`` is None on a card that warns): a rule needs the whole call in view.
    if card.remember_seconds and whole:
        buttons.insert(1, Button(ButtonKind.REMEMBER, remember_label(card.remember_seconds), card.remember_data))
    return tuple(buttons)


def view_of(
    card: ApprovalCard,
    *,
    outcome: Outcome | None = None,
    limit: int | None = None,
    shown: int | None = None,
    list_names: bool = True,
    approve_partial: bool = False,
) -> CardView:
    """The card with values cut to ``limit`` characters and only the first ``shown`` arguments given a value.

    ``list_names=False`` leaves out the names of the arguments without a value
    (the last resort on a platform too small for them). ``approve_partial``:
    offer Approve even when the card shows less than the whole call.
    """
    total = len(card.arguments)
    count = total if shown is None else max(0, min(shown, total))
    arguments = tuple(_shown(arg, limit) for arg in card.arguments[:count])
    rest = tuple(arg.name for arg in card.arguments[count:])
    names_only = rest if list_names else ()
    hidden = 0 if list_names else len(rest)
    whole = not rest and not any(a.cut for a in arguments)
    approve_here = (whole or approve_partial) and not card.step_up
    notice = ""
    if not whole:
        notice = _notice_partial(approve_here or card.step_up)
        if hidden:
            notice = f"{_notice_names_hidden(hidden, total)} {notice}"
    if card.step_up and outcome is None:
        notice = f"{notice} {STEP_UP_NOTICE}".strip()
    facts: tuple[tuple[str, str], ...] = (
        (TOOL_LABEL, card.tool),
        (REQUESTED_BY_LABEL, card.requester),
        (FROM_LABEL, card.origin),
        (DEADLINE_LABEL, deadline_text(card)),
        (HASH_LABEL, card.args_hash),
    )
    if card.progress:
        facts += ((PROGRESS_LABEL, card.progress),)
    return CardView(
        request_id=card.request_id,
        outcome=outcome,
        title=card.title,
        warnings=tuple(card_warnings(card)),
        about=card.about,
        facts=facts,
        arguments_heading=arguments_heading(total),
        arguments=arguments,
        names_heading=names_heading(len(names_only)),
        names_only=names_only,
        names_hidden=hidden,
        notice=notice,
        link_label=FULL_CALL_LABEL,
        link=card.link,
        buttons=() if outcome is not None else _buttons(card, approve=approve_here, whole=whole),
    )


def card_warnings(card: ApprovalCard) -> list[str]:
    """Warnings a person must read before deciding (hidden characters, look-alikes, how the call would run)."""
    return list(card.warnings)


def lay_out(
    card: ApprovalCard,
    writer: CardWriter[Out],
    *,
    outcome: Outcome | None = None,
    approve_partial: bool = False,
    min_excerpt: int = MIN_EXCERPT,
) -> LaidOut[Out]:
    """The most complete view of ``card`` that ``writer`` says fits, written.

    Order of sacrifice: value length (evenly, both ends kept), then values
    (later arguments become names only), then names (counted, not listed).
    """

    def attempt(view: CardView) -> LaidOut[Out] | None:
        written = writer.write(view)
        return LaidOut(written, view) if writer.fits(written) else None

    def at(limit: int | None, shown: int) -> LaidOut[Out] | None:
        return attempt(view_of(card, outcome=outcome, limit=limit, shown=shown, approve_partial=approve_partial))

    total = len(card.arguments)
    whole = at(None, total)
    if whole is not None:
        return whole
    if total == 0:
        raise CardTooLarge(f"the approval card for {card.tool!r} does not fit even without arguments")
    if at(min_excerpt, 0) is None:
        bare = attempt(view_of(card, outcome=outcome, shown=0, list_names=False, approve_partial=approve_partial))
        if bare is None:
            raise CardTooLarge(f"the approval card for {card.tool!r} does not fit even without arguments")
        return bare
    shown = _largest(lambda n: at(min_excerpt, n) is not None, 0, total)
    longest = max(len(a.head) + len(a.tail) for a in card.arguments[:shown]) if shown else min_excerpt
    if longest <= min_excerpt:
        best = at(min_excerpt, shown)
    else:
        limit = _largest(lambda n: at(n, shown) is not None, min_excerpt, longest)
        best = at(limit, shown)
    assert best is not None  # _largest only returns values whose attempt fitted
    return best


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), given fits(low) and that fitting is monotone."""
    if fits(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def settled_view(view: CardView, outcome: Outcome) -> CardView:
    """The same card once decided: the outcome on top, no buttons."""
    return replace(view, outcome=outcome, buttons=())


# -- plain text (the terminal, logs, tests) -----------------------------------------------------


VALUE_QUOTE: Final = "  ┆ "  # plain text's mark on every line of a multi-line value


def quoted_lines(value: str) -> list[str]:
    """A value's lines for plain text, each behind :data:`VALUE_QUOTE`: a line of a value never starts a line."""
    return [f"{VALUE_QUOTE}{line}" for line in value.split("\n")] if value else []


class PlainWriter:
    """The card as plain lines of text; nothing to escape, nothing to fit.

    A value on one line follows its name (``• command: ls``); a longer one is quoted below it, every line behind
    :data:`VALUE_QUOTE`, as a cut value's head and tail are.
    """

    def __init__(self, *, frame: str = "") -> None:
        self.frame = frame  # a prefix for every line, e.g. "│ " on a terminal

    def write(self, view: CardView) -> str:
        lines: list[str] = []
        if view.outcome is not None:
            lines += [view.outcome_text, ""]
        lines.append(view.title)
        lines += list(view.about)
        lines += [f"⚠ {warning}" for warning in view.warnings]
        lines += [f"{label}: {value}" for label, value in view.facts]
        lines.append(f"{view.arguments_heading}:")
        for arg in view.arguments:
            if arg.cut:
                lines += [f"• {arg.name}:", *quoted_lines(arg.head), f"  {arg.marker}", *quoted_lines(arg.tail)]
            elif "\n" in arg.head:
                lines += [f"• {arg.name}:", *quoted_lines(arg.head)]
            else:
                lines.append(f"• {arg.name}: {arg.head if not arg.empty else EMPTY_VALUE}")
        if view.names_only:
            lines.append(f"{view.names_heading}:")
            lines += [f"• {name}" for name in view.names_only]
        if view.notice:
            lines.append(view.notice)
        lines.append(f"{view.link_label}: {view.link}")
        if view.footer is not None:
            lines.append(f"{view.footer[0]}: {view.footer[1]}")
        if view.buttons:
            lines.append("  ".join(f"[{b.label}]" for b in view.buttons))
        return "\n".join(self.frame + line for line in "\n".join(lines).split("\n"))

    def fits(self, written: str) -> bool:
        return True


def plain_text(card: ApprovalCard, *, outcome: Outcome | None = None, approve_partial: bool = False) -> str:
    return lay_out(card, PlainWriter(), outcome=outcome, approve_partial=approve_partial).written
