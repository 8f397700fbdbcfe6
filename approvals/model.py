"""Approval requests, their outcomes and the answers a press gets."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

# Who asked, for a request opened through the approvals API or ``/mcp``: ``api:<token name>``.
API_REQUESTER_PREFIX = "api:"
MAX_REASON = 500  # characters of a decider's reason kept (a card line, the audit, the agent's next turn)


def clean_reason(text: str | None) -> str | None:
    """A decider's reason as kept: one line (runs of whitespace, line breaks included, made one space), at most
    :data:`MAX_REASON` characters; None when nothing is left (a Deny without a reason)."""
    if text is None:
        return None
    said = " ".join(text.split())
    if not said:
        return None
    return said if len(said) <= MAX_REASON else said[: MAX_REASON - 1] + "…"


class Status(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self is not Status.PENDING

    @property
    def human(self) -> bool:
        """Only approve and deny are decisions a person made."""
        return self in (Status.APPROVED, Status.DENIED)


class Waits(StrEnum):
    """How the asker of a request from one of Kazma's doors waits for its answer (None: not synchronously)."""

    CONNECTION = "connection"  # an open /mcp call in one Kazma process (its ``owner``) holds the wait
    POLLING = "polling"  # a process outside Kazma asks again and again (GET): ``--wait``, ``kazma mcp serve``


class Decision(StrEnum):
    APPROVE = "approve"
    DENY = "deny"

    @property
    def status(self) -> Status:
        return Status.APPROVED if self is Decision.APPROVE else Status.DENIED

    @property
    def code(self) -> str:
        return "a" if self is Decision.APPROVE else "d"


@dataclass(frozen=True)
class ApprovalRequest:
    id: str
    tool: str
    args: dict[str, Any]
    args_json: str
    args_hash: str
    requested_by: str
    conversation: str
    created_at: datetime
    deadline: datetime
    status: Status
    task_id: str | None = None
    decided_by: str | None = None
    decided_via: str | None = None
    decided_at: datetime | None = None
    reason: str | None = None
    notes: tuple[str, ...] = ()  # how the call would run, said on every card (e.g. "runs unsandboxed on this host")
    durable: bool = False  # its waiter survives a restart (a paused pipeline's checkpoint): never an orphan
    waits: Waits | None = None  # how a synchronous asker waits: withdrawn when it goes away (None: not one)
    last_seen: datetime | None = None  # when an API asker last asked for its answer (written at most every 10 s)
    # The outcome's seal (approvals.seal), written by the compare-and-set; None on rows decided before seals.
    decision_mac: str | None = None
    decision_key_id: str | None = None
    # The person under ``people:`` who owns ``decided_by`` when they decided (None: nobody's identity, no
    # decision, or decided before people were recorded). Sealed with the outcome.
    decided_person: str | None = None
    # The policy it is decided under (approvals.policies; None: the default), fixed when it opened.
    policy: str | None = None
    approve_needed: int = 1  # distinct people who must approve
    deny_needed: int = 1  # distinct people whose denial ends it
    step_up: bool = False  # Approve only on its page, after a fresh passkey assertion
    started_by: str | None = None  # who started the work (a person or an identity): forbid_requester
    # The digest of the tool definition its card was opened for (None: a tool fixed in Kazma's code, or opened
    # before definitions were recorded): read with the row, so a rule's check needs no second read.
    definition_hash: str | None = None

    def outcome(self) -> Outcome | None:
        return outcome_of(self)

    @property
    def rememberable(self) -> bool:
        """A remembered approval may stand for it: one approval decides it, and not only with a passkey."""
        return self.approve_needed == 1 and not self.step_up


@dataclass(frozen=True)
class Review:
    """One person's approval or denial of a request (the same person on two platforms is one review)."""

    request_id: str
    reviewer: str  # the person's name, or the identity when it is nobody's
    actor: str
    platform: str
    decision: Decision
    reason: str | None
    at: datetime


@dataclass(frozen=True)
class Witness:
    """The signed checkpoint of the audit chain that holds a decision, as its settled cards show it: a person who
    saw it can later prove the audit log still holds that decision (``kazma audit verify --head SEQ:HEX``)."""

    seq: int
    head: str  # the chain hash at ``seq`` (hex); a card shows its first 12 characters

    def text(self) -> str:
        return f"#{self.seq} {self.head[:12]}"


@dataclass(frozen=True)
class Outcome:
    """How a request ended. ``decided_by`` is a human only for approved/denied."""

    request_id: str
    status: Status
    decided_by: str | None
    decided_via: str | None
    decided_at: datetime
    reason: str | None = None
    witness: Witness | None = None  # the checkpoint holding it (set where a settled card is made)
    person: str | None = None  # the person who owns ``decided_by`` (None: nobody's identity)
    # What became of an approved call Kazma stopped before finishing (did not run / may have run), on its cards
    afterwards: str | None = None

    @property
    def approved(self) -> bool:
        return self.status is Status.APPROVED

    @property
    def decider(self) -> str:
        """Who decided, for people: ``alice (telegram:111)``, or the identity alone when it is nobody's."""
        return decider_text(self.person, self.decided_by)

    def summary(self) -> str:
        """One line for notices, e.g. ``approved by alice (slack:U123) via slack at 12:03:04 UTC``."""
        return self._summary

    @functools.cached_property
    def _summary(self) -> str:
        # Made once per outcome: every press that lost to it in its group is told this line.
        words = "timed out" if self.status is Status.TIMEOUT else self.status.value
        return f"{words} {self.details()}"

    def details(self) -> str:
        """The summary after its status word (``by alice (slack:U123) via slack at …``): a card's outcome line
        puts its own headline first, and says the status once."""
        when = utc_text(self.decided_at)
        if self.status.human:
            why = f"; reason: {self.reason}" if self.status is Status.DENIED and self.reason else ""
            return f"by {self.decider} via {self.decided_via} at {when}{why}"
        if self.status is Status.TIMEOUT:
            return f"at {when}: no decision before the deadline (not a denial)"
        return f"at {when}: {self.reason or 'the waiter stopped'} (not a denial)"

    def for_agent(self) -> str:
        """What the agent is told; a timeout or cancellation is never reported as a denial."""
        if self.status is Status.APPROVED:
            return f"Approved by {self.decider}."
        if self.status is Status.DENIED:
            # Their reason is a person's words: whoever hands this to a model adds it fenced (engine/fence.py).
            said = " They gave a reason (below)." if self.reason else ""
            return f"Denied by {self.decider}.{said} Do not retry this call."
        if self.status is Status.TIMEOUT:
            return "No decision before the approval deadline; the call did not run. It was not denied."
        return "The approval wait was cancelled; the call did not run. It was not denied."


class PressVerdict(StrEnum):
    WON = "won"  # this press decided the request
    COUNTED = "counted"  # this press is a review on the record; the request waits for more
    REPEATED = "repeated"  # this person reviewed the request already (perhaps on another platform)
    LOST = "lost"  # someone decided first; ``outcome`` is what stands
    REFUSED = "refused"  # nothing changed: bad data, unknown id, not an approver, store down
    REPLAYED = "replayed"  # the signed request that carried it was seen before: nothing changed, nobody is told


@dataclass(frozen=True)
class PressResult:
    verdict: PressVerdict
    message: str
    outcome: Outcome | None = None
    request_id: str | None = None

    @property
    def won(self) -> bool:
        return self.verdict is PressVerdict.WON


def decider_text(person: str | None, identity: str | None) -> str:
    """A person and the identity they used (``alice (telegram:111)``); the identity alone when it is nobody's."""
    if person is None:
        return identity or ""
    return f"{person} ({identity})" if identity else person


def utc_text(at: datetime) -> str:
    """``2026-12-02 01:02:03 UTC``: what ``strftime("%Y-%m-%d %H:%M:%S UTC")`` says, at half its cost (a press
    that lost says it)."""
    u = at if at.tzinfo is UTC else at.astimezone(UTC)
    return f"{u.year:04d}-{u.month:02d}-{u.day:02d} {u.hour:02d}:{u.minute:02d}:{u.second:02d} UTC"


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Decidable(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def status(self) -> Status: ...
    @property
    def decided_by(self) -> str | None: ...
    @property
    def decided_via(self) -> str | None: ...
    @property
    def decided_at(self) -> datetime | None: ...
    @property
    def deadline(self) -> datetime: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def decided_person(self) -> str | None: ...


def outcome_of(request: _Decidable) -> Outcome | None:
    """How a request ended (None while pending): the one reading of a request row's outcome columns."""
    if not request.status.final:
        return None
    return Outcome(
        request_id=request.id,
        status=request.status,
        decided_by=request.decided_by,
        decided_via=request.decided_via,
        decided_at=request.decided_at or request.deadline,
        reason=request.reason,
        person=request.decided_person,
    )
