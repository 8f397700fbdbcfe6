"""The platform-neutral approval card: the whole call, bounded and honest, with cuts and findings in the model.

A cut is a flag with the value's true length, not text inside the value, so a
renderer can show it distinctly and an argument cannot pretend to be cut (or
complete). A long value keeps its head *and* its tail: a harmless prefix must
not hide a destructive end.

Every text on a card is *shown* text (:mod:`kazma.approvals.honesty`):
hidden, direction-changing and control characters are escaped as
``⟨U+XXXX NAME⟩`` before anything is bounded, so a renderer that writes
``name``, ``head`` and ``tail`` as they are shows what runs. Cuts fall between
escapes, never inside one. What was found rides on each argument
(``findings``, ``name_findings``) and as plain sentences on the card
(``warnings``), computed over the *whole* value, cut part included. A card is
built only for a request whose stored arguments still hash to the hash it
shows.

Only argument values keep real newlines. The tool name, the requester, the
origin, every note and every argument name is a one-line *field*
(:func:`~kazma.approvals.honesty.reveal_line`): a newline there is escaped and
warned about like any control character, so nothing but Kazma's layout can
start a card line.

Padding (a run of blank lines or spaces that pushes the rest of a value out of
view, :func:`~kazma.approvals.honesty.padding_gaps`) is cut out of the value
as a cut is: the card shows what comes before the first such run and after the
last, marked as cut, so it offers Approve only where the whole call is seen.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from kazma.approvals.hashing import UnrenderableArguments, args_hash, canonical_json, text_hash
from kazma.approvals.honesty import (
    ESCAPE_OPEN,
    MAX_ESCAPE_LENGTH,
    NO_FINDINGS,
    Findings,
    examine,
    examine_line,
    padding_gaps,
    reveal,
    reveal_line,
    safe_prefix,
    safe_suffix,
    warnings_for,
)
from kazma.approvals.model import ApprovalRequest, Decision

BUTTON_PREFIX = "kz1"
MAX_NAME_LENGTH = 100
MIN_VALUE_LIMIT = MAX_ESCAPE_LENGTH  # a cut value must be able to show its last escape whole
MAX_CARD_WARNINGS = 6
MAX_QUOTED_NAME = 40
# C0, DEL and C1: a name with a control character is refused, not escaped (a name is chosen by a tool's
# schema; a control character in one is never legitimate). Other hidden characters in names are escaped.
_NAME_OK = re.compile(r"^[^\x00-\x1f\x7f-\x9f]+$")


class CardIntegrityError(Exception):
    """The stored arguments do not hash to the hash the card would show: no card is built, the call must not run."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}: {reason}; no card is shown for it")
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True)
class CardArgument:
    """One argument as a person must see it.

    ``name``, ``head`` and ``tail`` are shown text (escaped). ``original_length``
    counts *shown* characters of the whole value, in the same unit as ``head``
    and ``tail``, so ``omitted`` is what the cut hides of the shown value;
    ``value_length`` counts characters of the value as it runs (None when a
    renderer rebuilt the argument without carrying it over).
    """

    name: str
    head: str  # the whole shown value when not cut
    tail: str  # the last shown characters of a cut value; empty when not cut
    cut: bool
    original_length: int  # shown characters in the full value
    findings: Findings = NO_FINDINGS  # of the whole value, as it runs
    name_findings: Findings = NO_FINDINGS
    value_length: int | None = None  # characters in the full value as it runs

    @property
    def omitted(self) -> int:
        return self.original_length - len(self.head) - len(self.tail)

    @property
    def full(self) -> str | None:
        """The complete shown value, or None when it was cut."""
        return None if self.cut else self.head

    @property
    def flagged(self) -> bool:
        """True when the name or value holds something a person must be warned about."""
        return self.findings.warns or self.name_findings.warns


@dataclass(frozen=True)
class ApprovalCard:
    request_id: str
    title: str
    tool: str
    requester: str
    origin: str
    arguments: tuple[CardArgument, ...]
    args_hash: str
    deadline: datetime
    link: str
    warnings: tuple[str, ...] = ()  # plain sentences to show prominently; empty when nothing was found
    remember_seconds: int | None = None  # offer "Approve for …" (remembered approvals); None: not offered
    # Under a policy of several people: who approved or denied it so far and who may still (one line).
    progress: str = ""
    step_up: bool = False  # Approve only on its page with a passkey: chat cards carry Deny and the link
    about: tuple[str, ...] = ()  # what the asker said of the request (who for, why): shown plainly, not warned
    policy: str | None = None  # the policy that decides it (None: the default): who may press its buttons

    @property
    def remember_data(self) -> str:
        """``kz1:<id>:r``: approve, and remember the identical call in this conversation for a while."""
        return f"{BUTTON_PREFIX}:{self.request_id}:r"

    def button_data(self, decision: Decision) -> str:
        return button_data(self.request_id, decision)

    @property
    def any_cut(self) -> bool:
        return any(a.cut for a in self.arguments)

    @property
    def has_warnings(self) -> bool:
        return bool(self.warnings)


def button_data(request_id: str, decision: Decision) -> str:
    """``kz1:<id>:a|d``: fits Telegram's 64-byte ``callback_data``."""
    return f"{BUTTON_PREFIX}:{request_id}:{decision.code}"


def render_value(value: Any) -> str:
    """Text as itself, unless it reads as JSON: then as its JSON string, quotes and all. Everything else as compact
    canonical JSON (the value as it runs, before escaping).

    So no two different values look the same on a card. Shown as itself, the text ``false`` was the boolean
    ``false`` to a reader (``"42"`` and ``42``, ``"null"`` and ``null``, ``'["a"]'`` and ``["a"]`` too), and a tool
    that tests its argument for truth (``if args.force``) runs the one as the other. Text that reads as a JSON
    string (``"x"``, quotes in it) is quoted as well, so the quoted ``"false"`` can only be the text ``false``.
    """
    if not isinstance(value, str):
        return canonical_json(value)
    return canonical_json(value) if _reads_as_json(value) else value


# What a JSON text can start with, after blanks (NaN and Infinity: Python's reader takes them).
_JSON_STARTS: Final = frozenset('{["-0123456789tfnNI')


def _reads_as_json(text: str) -> bool:
    start = text.lstrip(" \t\n\r")[:1]
    if start not in _JSON_STARTS:
        return False  # the usual text (a command, a path, a name): not read at all
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # not JSON (or nested too deep to read: never a value of ours either)
        return False
    return True


def _tail_of(shown: str, limit: int) -> str:
    # When the last characters fall inside the final escape, show that escape whole.
    return safe_suffix(shown, max(limit // 4, 1)) or shown[shown.rfind(ESCAPE_OPEN) :]


def _excerpts(shown: str, limit: int, *, cut_padding: bool) -> tuple[str, str, bool]:
    """``(head, tail, cut)`` of a shown value: the whole of it, or both ends within ``limit``, never showing padding.

    With padding, the head ends where the first padding run starts and the tail starts where the last one ends: a
    person reads what follows the padding right below the cut marker instead of scrolling past a blank wall.
    """
    gaps = padding_gaps(shown) if cut_padding else []
    if not gaps:
        if len(shown) <= limit:
            return shown, "", False
        tail = _tail_of(shown, limit)
        return safe_prefix(shown, limit - len(tail)), tail, True
    before, after = shown[: gaps[0][0]], shown[gaps[-1][1] :]
    if len(before) + len(after) <= limit:
        return before, after, True
    tail = after if len(after) <= max(limit // 4, 1) else _tail_of(after, limit)
    return safe_prefix(before, limit - len(tail)), tail, True


def bound_value(name: str, value: Any, limit: int, *, cut_padding: bool = True) -> CardArgument:
    """The argument ``name`` = ``value`` escaped, then bounded to ``limit`` shown characters, padding cut out.

    ``cut_padding=False`` keeps padding in (the whole-call doors: the approval page, ``kazma approvals show``).
    """
    if limit < MIN_VALUE_LIMIT:
        raise ValueError(f"value limit {limit} is below {MIN_VALUE_LIMIT}: an escape could not be shown whole")
    text = render_value(value)
    shown = reveal(text)
    head, tail, cut = _excerpts(shown, limit, cut_padding=cut_padding)
    return CardArgument(
        name=reveal_line(name),
        head=head,
        tail=tail,
        cut=cut,
        original_length=len(shown),
        findings=examine(text),
        name_findings=examine_line(name),
        value_length=len(text),
    )


def check_names(args: dict[str, Any]) -> None:
    for name in args:
        if len(name) > MAX_NAME_LENGTH:
            raise UnrenderableArguments(
                f"argument name of {len(name)} characters is longer than {MAX_NAME_LENGTH}: it cannot be shown whole"
            )
        if not _NAME_OK.match(name):
            raise UnrenderableArguments(f"argument name {name!r} is empty or has control characters")


def verify_integrity(request: ApprovalRequest) -> None:
    """Refuse a request whose stored arguments (text or parsed) do not hash to ``request.args_hash``."""
    try:
        stored = text_hash(request.args_json)
        parsed = args_hash(request.args)
    except (ValueError, TypeError) as exc:
        raise CardIntegrityError(request.id, f"the stored arguments cannot be hashed ({exc})") from None
    if stored != request.args_hash:
        raise CardIntegrityError(
            request.id, f"the stored arguments hash to {stored[:12]}…, not to the card's {request.args_hash[:12]}…"
        )
    if parsed != request.args_hash:
        raise CardIntegrityError(
            request.id,
            f"the arguments to show hash to {parsed[:12]}…, not to the card's {request.args_hash[:12]}…",
        )


def _quoted(shown: str) -> str:
    short = shown if len(shown) <= MAX_QUOTED_NAME else safe_prefix(shown, MAX_QUOTED_NAME - 1) + "…"
    return f"'{short}'"


def card_warnings(places: list[tuple[str, Findings]]) -> tuple[str, ...]:
    """Every place's warning sentences, in order, at most :data:`MAX_CARD_WARNINGS` of them."""
    sentences = [s for where, findings in places for s in warnings_for(findings, where)]
    if len(sentences) <= MAX_CARD_WARNINGS:
        return tuple(sentences)
    rest = len(sentences) - MAX_CARD_WARNINGS + 1
    return (
        *sentences[: MAX_CARD_WARNINGS - 1],
        f"{rest} more warnings of hidden or look-alike characters: review the whole call on its approval page.",
    )


def build_card(
    request: ApprovalRequest,
    *,
    value_limit: int,
    public_url: str,
    remember_seconds: int | None = None,
    cut_padding: bool = True,
    progress: str = "",
) -> ApprovalCard:
    """The card for ``request``; raises :class:`CardIntegrityError` or :class:`UnrenderableArguments`.

    ``remember_seconds``: offer "Approve for …" (approvals.remember) — never when anything was found in the call.
    ``cut_padding=False``: a whole-call door, where a value is shown with its padding (and its warning).
    """
    verify_integrity(request)
    check_names(request.args)
    arguments = tuple(
        bound_value(name, request.args[name], value_limit, cut_padding=cut_padding) for name in sorted(request.args)
    )
    places = [
        ("the tool name", examine_line(request.tool)),
        ("the requester", examine_line(request.requested_by)),
        ("the origin", examine_line(request.conversation)),
    ]
    places += [(f"note {number} on the request", examine_line(note)) for number, note in enumerate(request.notes, 1)]
    for arg in arguments:
        places.append((f"the name of argument {_quoted(arg.name)}", arg.name_findings))
        places.append((f"argument {_quoted(arg.name)}", arg.findings))
    tool = reveal_line(request.tool)
    findings = card_warnings(places)
    return ApprovalCard(
        request_id=request.id,
        title=f"Approval needed: {tool}",
        tool=tool,
        requester=reveal_line(request.requested_by),
        origin=reveal_line(request.conversation),
        arguments=arguments,
        args_hash=request.args_hash,
        deadline=request.deadline,
        link=f"{public_url.rstrip('/')}/swarm?approval={request.id}",
        # How the call would run (e.g. "runs unsandboxed on this host") comes first: it is about every value.
        warnings=tuple(reveal_line(note) for note in request.notes if not note.startswith(ABOUT_PREFIXES)) + findings,
        about=tuple(reveal_line(note) for note in request.notes if note.startswith(ABOUT_PREFIXES)),
        remember_seconds=None if findings or request.step_up else remember_seconds,
        progress=progress,
        step_up=request.step_up,
        policy=request.policy,
    )


# Notes that tell who asked and why (the approvals API's door writes them), not how the call would run: a card
# shows them as what they are, not under a warning sign. Only Kazma writes a note's start; an asker's words come
# after it (a reason cannot make itself a warning, nor a warning pass for a reason).
ASKED_THROUGH_API: Final = "Asked through the approvals API by "
ON_BEHALF_OF: Final = "On behalf of: "
REASON_GIVEN: Final = "Reason given: "
ASKER_WAITS: Final = "The asker "
# Which definition of the tool (an MCP server's description, schema and hints) the card was opened for: the
# digest the request records and a remembered approval made from it stands for (the audit has it whole).
TOOL_DEFINITION: Final = "Definition SHA-256: "
ABOUT_PREFIXES: Final = (ASKED_THROUGH_API, ON_BEHALF_OF, REASON_GIVEN, ASKER_WAITS, TOOL_DEFINITION)


INTEGRITY_WARNING = (
    "The stored call no longer matches the hash it was opened with: it was changed outside Kazma. "
    "Nothing from it will run."
)


def integrity_card(request: ApprovalRequest, *, public_url: str) -> ApprovalCard:
    """What a card shows for a request whose stored arguments fail :func:`verify_integrity`: no values at all."""
    tool = reveal_line(request.tool)
    return ApprovalCard(
        request_id=request.id,
        title=f"Approval refused: {tool}",
        tool=tool,
        requester=reveal_line(request.requested_by),
        origin=reveal_line(request.conversation),
        arguments=(),
        args_hash=request.args_hash,
        deadline=request.deadline,
        link=f"{public_url.rstrip('/')}/swarm?approval={request.id}",
        warnings=(INTEGRITY_WARNING,),
        policy=request.policy,
    )
