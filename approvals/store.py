"""The one-decision store: rows of approval requests, their audit trail and their posted cards.

On SQLite or PostgreSQL: the store talks only to a
:class:`~kazma.config.store.backend.StoreBackend` (reads, and a writer of
operations), with SQL both engines run alike.

Every outcome is written by one compare-and-set (``UPDATE … WHERE status =
'pending'``); whoever's statement changes the row decided it, and a trigger
refuses any later change. The audit trail is append-only (triggers again), and every event of it is
appended to the audit chain (:mod:`kazma.approvals.chain`) in the transaction of the change it records.
"""

from __future__ import annotations

import functools
import json
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final, NamedTuple, TypeVar, cast

import aiosqlite
import structlog

from kazma.approvals import pg_press
from kazma.approvals.audit_verify import RecordedEnding, UnrecordedRequest
from kazma.approvals.chain import (
    CHECKPOINT_COLUMNS,
    DECISION_EVENTS,
    EVENT_COLUMNS,
    FROM_REQUEST,
    AuditChain,
    ChainedEvent,
    byte_safe,
    checkpoint_of_row,
    from_byte_safe,
    undecodable,
)
from kazma.approvals.checkpoints import AuditSigner, Checkpoint
from kazma.approvals.model import ApprovalRequest, Decision, Outcome, Review, Status, Waits, outcome_of
from kazma.approvals.pg_press import PressCall
from kazma.approvals.seal import seal
from kazma.config.keyring import Keyring
from kazma.config.metrics import count_failure
from kazma.config.store.backend import StoreBackend, Tx, Writer, backend_of, held_by_gone
from kazma.config.store.database import Tables
from kazma.config.store.group_commit import Together, Unasking

log = structlog.get_logger("kazma.approvals")

Clock = Callable[[], float]
T = TypeVar("T")

_COLUMNS = (
    "id, tool, args_json, args_hash, requested_by, conversation, task_id, created_at, deadline, "
    "status, decided_by, decided_via, decided_at, reason, notes, durable, waits, last_seen, decision_mac,"
    " decision_key_id, decided_person, policy, approve_needed, deny_needed, step_up, started_by, definition_hash"
)


# The outcome and its seal in one statement: the seal is made in Python before it (approvals/seal.py).
_CAS = (
    "UPDATE approval_requests SET status = ?, decided_by = ?, decided_via = ?, decided_at = ?, reason = ?,"
    " decision_mac = ?, decision_key_id = ?, decided_person = ? WHERE id = ? AND status = 'pending'"
)
_CAS_BEFORE_DEADLINE = _CAS + " AND deadline > ?"
# What the seal binds besides the outcome, read in the decision's transaction before the compare-and-set; for a
# press from a card, with that request's cards on the press's platform in the same statement.
_SEALED_FIELDS = "SELECT tool, args_hash FROM approval_requests WHERE id = ?"
# A press's first statement: how its request stands (a decided one loses at once, with no seal made and no second
# read), the rules it opened under (the decider's admission is checked on them in this transaction, so no read
# comes before a press), and, for a press from a card, that request's cards on the press's platform.
_PRESS_FIELDS = (
    "r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status, r.decided_by, r.decided_via, r.decided_at,"
    " r.reason, r.decided_person, r.policy, r.approve_needed, r.deny_needed, r.step_up, r.started_by"
)
_PRESS_HEAD = f"SELECT {_PRESS_FIELDS} FROM approval_requests r WHERE r.id = ?"  # noqa: S608
_PRESS_CARDS = (
    f"SELECT {_PRESS_FIELDS}, c.chat, c.message_id, c.whole, c.bound_to"  # noqa: S608
    " FROM approval_requests r LEFT JOIN approval_cards c ON c.request_id = r.id AND c.platform = ? WHERE r.id = ?"
)
_PRESS_CARD_AT = 16  # where a card's columns start in a row of _PRESS_CARDS
# The presses of one request in one group (ApprovalStore._press_together): its cards on every platform, each
# row naming its platform (at _PRESS_CARD_AT) before the columns _PRESS_CARDS gives.
_PRESS_ALL_CARDS = (
    f"SELECT {_PRESS_FIELDS}, c.platform, c.chat, c.message_id, c.whole, c.bound_to"  # noqa: S608
    " FROM approval_requests r LEFT JOIN approval_cards c ON c.request_id = r.id WHERE r.id = ?"
)
# A review's first statement: the request's row locked while it is pending and before its deadline, so that on
# PostgreSQL reviews of one request follow one another (each count below then sees every review committed
# before it) and a decision made meanwhile is seen. Changes nothing (the final-outcome triggers watch only a
# row that is no longer pending).
_REVIEW_LOCK = "UPDATE approval_requests SET status = status WHERE id = ? AND status = 'pending' AND deadline > ?"
_REVIEW = (
    "INSERT INTO approval_reviews (request_id, reviewer, actor, platform, decision, reason, at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
_REVIEW_COLUMNS = "request_id, reviewer, actor, platform, decision, reason, at"
# A request's reviews, as a press under a policy of several people weighs them (after _REVIEW_LOCK).
_REVIEWS_OF = "SELECT reviewer, actor, decision, platform FROM approval_reviews WHERE request_id = ?"
_RETURNING = f" RETURNING {_COLUMNS}"
# The checkpoint that signs a request's decision: the first one at or after the event the compare-and-set wrote.
_DECISION_SEQ = (
    "SELECT seq FROM approval_events WHERE request_id = ?"  # noqa: S608
    f" AND event IN ({', '.join(repr(e) for e in DECISION_EVENTS)}) ORDER BY seq LIMIT 1"
)
# Request rows whose own event is not in the log. Each request's row is written in one transaction with its
# event: "opened" with the row, its ending event (DECISION_EVENTS) with the compare-and-set that finishes it, on
# every path since the first release (a press, the CLI, the API, a timeout, a cancel, a start's orphans). A log cut
# at a checkpoint, with the checkpoints after it removed, verifies in itself; the rows it recorded do not go with
# it. One statement: its snapshot holds a row and its event both or neither, whatever Kazma commits meanwhile.
#
# A finished row's event must be the one its outcome is written with: ``decided`` by its decider for a person's
# outcome (saying that outcome, when it says one: before ``decided_detail`` a decided event's detail was the reason
# alone), else the event named as the status. Any decision event would do before, so a row rewritten around Kazma
# (a denial or a timeout turned into an approval by someone else) verified "ok" beside a log saying otherwise.
_UNRECORDED = (
    "FROM approval_requests r WHERE NOT EXISTS (SELECT 1 FROM approval_events e WHERE e.request_id = r.id"
    " AND ((r.status = 'pending' AND e.event = 'opened')"
    " OR (r.status IN ('approved', 'denied') AND e.event = 'decided' AND e.actor = r.decided_by"
    " AND (CASE WHEN e.detail = 'approved' OR e.detail LIKE 'approved:%' THEN 'approved'"
    " WHEN e.detail = 'denied' OR e.detail LIKE 'denied:%' THEN 'denied' ELSE r.status END) = r.status)"
    " OR (r.status IN ('timeout', 'cancelled') AND e.event = r.status)))"
    " ORDER BY r.created_at, r.id LIMIT ?"
)
# Requests whose sealed fields a store remembers at most (then it forgets them all and reads them again).
_SEALED_KEPT = 4096
# Past every sequence number a store gives (a signed 64-bit key): "no upper bound" in one statement.
_LAST_SEQ: Final = 2**63 - 1
# A transaction's notes (PgTx.notes): each request a press of it was guessed to decide, and the status it set.
_PRESS_GUESSES = "approvals.press_guesses"
# The claimer's name when no replica name is given: the only process on its store.
LOCAL = "local"
# Told at every decision: each replica wakes the call waiting for it and settles the cards (PostgreSQL NOTIFY).
DECIDED_CHANNEL = "kazma_decided"
_CARD_COLUMNS = (
    "request_id, platform, chat, message_id, posted_at, settled_at, settled_status, whole, bound_to, reposted"
)
# One request, and its cards in the order they were posted (read through the store, or in a transaction).
# Ids bound in one IN (...) of a batched read: below SQLite's oldest limit of 999 variables per statement.
IDS_PER_QUERY: Final = 900
_REQUEST_BY_ID = f"SELECT {_COLUMNS} FROM approval_requests WHERE id = ?"  # noqa: S608
_CARDS_OF = f"SELECT {_CARD_COLUMNS} FROM approval_cards WHERE request_id = ? ORDER BY posted_at"  # noqa: S608

# A card recorded after its request ended (found by its nonce, or pressed): when a stopped process left an approved
# call unrun, ``execution_lost`` already marked the cards it knew of; this one is marked the same way in the write
# that records it, so its first edit says "did not run" / "may have run" too.
_INSERT_FOUND_CARD = (
    "INSERT INTO approval_cards (request_id, platform, chat, message_id, posted_at, whole, bound_to, settled_status)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, (SELECT 'approved' FROM approval_events"
    " WHERE request_id = ? AND event = 'execution_lost' LIMIT 1)) ON CONFLICT DO NOTHING"
)


class UnreadableRequest(sqlite3.OperationalError):
    """A request row holding a text whose bytes are not UTF-8 (or bytes where Kazma writes text): only a write
    around Kazma puts them there. A store error (callers already fail closed on those: nothing it says runs, no
    press decides it), which names the row and its columns where SQLite's own error named neither."""

    def __init__(self, request_id: str, columns: Sequence[str]) -> None:
        self.request_id = request_id
        self.columns = tuple(columns)
        super().__init__(
            f"approval request {request_id} cannot be read: {', '.join(self.columns)} holds bytes that are not "
            "UTF-8 text (written around Kazma); it counts as no decision and nothing it approved runs"
        )


def _split_unreadable(
    columns: str, read: Sequence[Sequence[Any]]
) -> tuple[list[Sequence[Any]], list[UnreadableRequest]]:
    """Rows of ``columns`` as read, and those holding bytes where Kazma writes text, named by id."""
    names = [column.strip() for column in columns.split(",")]
    rows: list[Sequence[Any]] = []
    unreadable: list[UnreadableRequest] = []
    for row in read:
        bad = [name for name, value in zip(names, row, strict=True) if isinstance(value, bytes)]
        if not bad:
            rows.append(row)
            continue
        rid = row[0]
        # An id that is itself not text is shown as the bytes it holds: still the row to look for.
        unreadable.append(UnreadableRequest(rid.hex() if isinstance(rid, bytes) else str(rid), bad))
    return rows, unreadable


class Rules(NamedTuple):
    """The policy a request opens under, as its row keeps it (approvals.policies).

    A named tuple, not a frozen dataclass: every press reads one from its request's row, and the service keys the
    admissions it has granted by it. A frozen dataclass cost a call per field to build and ran Python code to hash
    and compare (about 2 microseconds a press); a tuple's are C."""

    policy: str | None = None  # None: the default
    approve_needed: int = 1
    deny_needed: int = 1
    step_up: bool = False
    started_by: str | None = None  # who started the work: a person's name or an identity


_DEFAULT_RULES = Rules()  # (immutable: one for every request opened with the defaults)


# Whether a decider may decide a request under the rules it opened under (None: no such request): None, or why
# not as (what the audit says, what the presser is told). Run in the press's transaction on the rules its first
# statement read, before anything is written, so that no read of the store comes before a press.
Admission = Callable[[Rules | None], "tuple[str, str] | None"]


@dataclass(frozen=True)
class NewRequest:
    """What opening a request writes, before it is written (its id is made first: a door may keep it)."""

    id: str
    tool: str
    args_json: str
    args_hash: str
    requested_by: str
    conversation: str
    deadline: float  # epoch seconds
    task_id: str | None = None
    rules: Rules = _DEFAULT_RULES


# Run first in the transaction that opens a request (given its id): None lets it open; another request's id
# stands instead, and nothing is written.
Guard = Callable[[Tx, str], "str | None"]


def new_request_id() -> str:
    """144 random bits, URL-safe, 24 characters: ``kz1:<id>:a`` is 30 bytes.

    Never starting with ``-``: a command line reads that as an option, so ``kazma approvals approve <id>``
    failed for one request in 64 (drawing again costs under 0.03 of a bit).
    """
    while True:
        request_id = secrets.token_urlsafe(18)
        if not request_id.startswith("-"):
            return request_id


def ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _row_to_request(row: Iterable[Any]) -> ApprovalRequest:
    (
        rid,
        tool,
        args_json,
        args_hash,
        requested_by,
        conversation,
        task_id,
        created,
        deadline,
        status,
        by,
        via,
        at,
        why,
        notes,
        durable,
        waits,
        last_seen,
        mac,
        key_id,
        person,
        policy,
        approve_needed,
        deny_needed,
        step_up,
        started_by,
        definition_hash,
    ) = tuple(row)
    return ApprovalRequest(
        id=rid,
        tool=tool,
        args=json.loads(args_json),
        args_json=args_json,
        args_hash=args_hash,
        requested_by=requested_by,
        conversation=conversation,
        created_at=datetime.fromtimestamp(created, UTC),
        deadline=datetime.fromtimestamp(deadline, UTC),
        status=Status(status),
        task_id=task_id,
        decided_by=by,
        decided_via=via,
        decided_at=ts(at),
        reason=why,
        notes=tuple(str(n) for n in json.loads(notes or "[]")),
        durable=bool(durable),
        waits=None if waits is None else Waits(waits),
        last_seen=ts(last_seen),
        decision_mac=mac,
        decision_key_id=key_id,
        decided_person=person,
        policy=policy,
        approve_needed=int(approve_needed),
        deny_needed=int(deny_needed),
        step_up=bool(step_up),
        started_by=started_by,
        definition_hash=definition_hash,
    )


def _review(row: Iterable[Any]) -> Review:
    request_id, reviewer, actor, platform, decision, reason, at = tuple(row)
    return Review(request_id, reviewer, actor, platform, Decision(decision), reason, datetime.fromtimestamp(at, UTC))


@dataclass(frozen=True)
class AuditEvent:
    seq: int
    request_id: str | None
    event: str
    actor: str | None
    platform: str | None
    at: datetime
    args_hash: str | None
    detail: str | None
    person: str | None = None  # the person the identity in ``actor`` belongs to (None: nobody's, or older rows)


@dataclass(frozen=True)
class PostedCard:
    request_id: str
    platform: str
    chat: str
    message_id: str
    posted_at: datetime
    settled_at: datetime | None
    settled_status: str | None
    whole: bool = True  # the card showed the whole call
    bound_to: str | None = None  # a card in a direct message: the person it was sent to (only they press it)
    reposted: bool = False  # posted again, marked so (an earlier attempt may have landed unrecorded): kept marked


class CardCheck(NamedTuple):
    """Where a press came from, held against the cards recorded for its request (in the press's transaction).
    (A named tuple: every press from a card makes one.)"""

    platform: str
    chat: str | None
    message_id: str | None
    needs_whole: bool  # an Approve where cut cards may not approve


class CardProblem:
    """Why a press was not held to be from a card of its request (:attr:`Pressed.problem`)."""

    NOT_RECORDED = "not_recorded"  # no card of the request recorded on that platform (yet)
    NOT_HERE = "not_here"  # cards are recorded there, but not at the place pressed
    CUT = "cut"  # an Approve on a card that did not show the whole call
    NOT_YOURS = "not_yours"  # a card in someone else's direct message (bound to another person)


class Standing:
    """What a press needs to know of its request: how it stands, without its arguments (never parsed on
    this path: nothing here renders or runs the call). Read-only by convention; a plain class with slots, not a
    frozen dataclass, because every press makes one (a frozen dataclass's fields cost a call each to set), and
    the presses that lose to a decision made in their group share the winner's, and its outcome."""

    __slots__ = (
        "_outcome",
        "args_hash",
        "conversation",
        "deadline",
        "decided_at",
        "decided_by",
        "decided_person",
        "decided_via",
        "id",
        "reason",
        "status",
        "tool",
    )

    def __init__(
        self,
        id: str,
        tool: str,
        args_hash: str,
        conversation: str,
        deadline: datetime,
        status: Status,
        decided_by: str | None,
        decided_via: str | None,
        decided_at: datetime | None,
        reason: str | None,
        decided_person: str | None = None,
    ) -> None:
        self.id, self.tool, self.args_hash, self.conversation = id, tool, args_hash, conversation
        self.deadline, self.status, self.decided_by, self.decided_via = deadline, status, decided_by, decided_via
        self.decided_at, self.reason, self.decided_person = decided_at, reason, decided_person
        self._outcome: Outcome | None = None

    def outcome(self) -> Outcome | None:
        """How the request ended (None while pending); made once, however many presses are told it."""
        if self._outcome is None:
            self._outcome = outcome_of(self)
        return self._outcome

    def __repr__(self) -> str:
        return f"Standing({self.id!r}, {self.status.value}, decided_by={self.decided_by!r})"


_STANDING = (
    "id, tool, args_hash, conversation, deadline, status, decided_by, decided_via, decided_at, reason, decided_person"
)
# A status column's value to its Status: a dict lookup, where Status(value) costs a press two microseconds.
_STATUS_OF = {status.value: status for status in Status}


def _standing(row: Iterable[Any]) -> Standing:
    rid, tool, digest, conversation, deadline, status, by, via, at, why, person = tuple(row)
    deadline_at = datetime.fromtimestamp(deadline, UTC)
    at_time = None if at is None else datetime.fromtimestamp(at, UTC)
    return Standing(rid, tool, digest, conversation, deadline_at, _STATUS_OF[status], by, via, at_time, why, person)


class ReviewState:
    """What a press under a policy of several people did, short of deciding (:attr:`Pressed.review`)."""

    COUNTED = "counted"  # its review is on the record; the request waits for more
    REPEATED = "repeated"  # its person reviewed the request already (perhaps on another platform)


# A write a press carries into its own transaction (SQLite): True when it may go on (a signed request's first use).
FirstUse = Callable[[Tx], bool]
# Whose an identity is under the configuration a press runs with (people:), or None: a review made before an
# identity was linked to its person is then still that person's.
PersonOf = Callable[[str], "str | None"]
# Whether an approving review (by an identity, on a platform) of a request opened under these rules counts under
# the configuration a press runs with.
ApprovalCounts = Callable[["Rules", str, str], bool]


class FoundCard(StrEnum):
    """What :meth:`ApprovalStore.record_stale_card` made of a message pressed with a request's data."""

    RECORDED = "recorded"  # the ended request's card now, to be edited to its outcome
    NOT_ENDED = "not_ended"  # the request is pending or unknown: nothing written
    ANOTHERS = "anothers"  # the message is another request's card: the data on it is forged; nothing written


class Decided:
    """A request a press decided on SQLite, and all its cards, as its decision's transaction committed them: read
    in that transaction, after the group's last operation (a card recorded in the same group is among them), so
    the bus edits the cards and the waiters answer without reading again (a read is a hop to the reader's thread
    and back, between the commit and the first card edit). Filled before the commit; empty when not read."""

    __slots__ = ("cards", "request")

    def __init__(self) -> None:
        self.request: ApprovalRequest | None = None
        self.cards: list[PostedCard] = []


class Pressed(NamedTuple):
    """What a press did: refused by its admission or a card problem (nothing written), or the compare-and-set's
    result. (A named tuple: every press makes one.)"""

    problem: str | None
    won: bool
    request: Standing | None
    review: str | None = None  # a ReviewState when the press was a review that did not decide
    refused: tuple[str, str] | None = None  # what its admission said: (for the audit, for the presser)
    replayed: bool = False  # its ``first_use`` said the signed request that carried it was seen before
    decided: Decided | None = None  # won on SQLite: the request and its cards as committed


class _Press:
    """One press as :meth:`ApprovalStore.press_op` was given it: its part in :meth:`ApprovalStore._press_together`,
    and, called, the press run on its own. One object that is its own operation, where closures over ``press_op``'s
    arguments made each of them a cell: about a dozen objects per press for the garbage collector to count, and
    with many presses waiting for one group commit, to trace (bench/store_decide.py, 60 in flight)."""

    __slots__ = ("actor", "admit", "card", "person", "platform", "reason", "request_id", "status", "store")

    def __init__(
        self,
        store: ApprovalStore,
        request_id: str,
        status: Status,
        actor: str,
        platform: str,
        reason: str | None,
        card: CardCheck | None,
        person: str | None,
        admit: Admission | None,
    ) -> None:
        self.store, self.request_id, self.status, self.actor, self.platform = store, request_id, status, actor, platform
        self.reason, self.card, self.person, self.admit = reason, card, person, admit

    def __call__(self, tx: Tx) -> Pressed:
        return self.store._press_alone(tx, self)


def _first_then(first_use: FirstUse, op: Callable[[Tx], Pressed], tx: Tx) -> Pressed:
    """A press whose signed request's record (``first_use``) is written first in its transaction: nothing else when
    that request was seen before."""
    if not first_use(tx):
        return Pressed(None, False, None, replayed=True)
    return op(tx)


def _presses_together(tx: Tx, presses: list[_Press]) -> list[Pressed]:
    # A function, not the store's bound method: that was one more object per press, alive until its group ran.
    return presses[0].store._press_together(tx, presses)


def _rules_of_press(head: Sequence[Any]) -> Rules:
    policy, approve_needed, deny_needed, step_up, started_by = head[11:16]
    return Rules(policy, int(approve_needed), int(deny_needed), bool(step_up), started_by)


class ApprovalStore:
    """Data access for approvals on one aiosqlite connection, or on another backend (PostgreSQL).

    A SQLite connection is shared by every coroutine of the process, so every
    statement goes through its :class:`~kazma.config.store.database.Tables`.
    """

    def __init__(
        self,
        conn: aiosqlite.Connection | StoreBackend,
        *,
        clock: Clock = time.time,
        replica: str | None = None,
        keyring: Keyring | None = None,
        audit: AuditSigner | None = None,
    ) -> None:
        self._conn = conn if isinstance(conn, aiosqlite.Connection) else None
        self.clock = clock
        # Every audit event goes through the chain; ``audit`` signs its checkpoints (None: they are written
        # unsigned, and ``kazma audit verify`` fails on them: a store opened only to read, or a test of rows).
        self.tables = backend_of(conn)
        # SQLite's writer holds the file's write lock for the whole transaction; PostgreSQL's needs the chain's.
        self.chain = AuditChain(postgres=not isinstance(self.tables, Tables), signer=audit, clock=lambda: self.clock())
        # Told after a commit that appended audit events (the checkpointer, the audit sink).
        self.appended_listeners: list[Callable[[], None]] = []
        # Called at the end of the transaction of a decision a press won (SQLite), after its events are chained,
        # with the ids decided there: the checkpointer signs the head in that very commit, so the settled cards
        # have their witness without a commit of its own (None: no checkpointer here).
        self.decided_in_commit: Callable[[Tx, list[str]], None] | None = None
        # Whether that would sign now (None: always ask it): a decision whose commit would not sign (a pass was made
        # within the checkpointer's interval, or one rides) defers nothing to the end of its transaction.
        self.sign_in_commit_due: Callable[[], bool] | None = None
        # Written as the owner of every request this process opens (None: the only process on the store).
        self.replica = replica
        # Seals every outcome this store writes (approvals/seal.py). None: outcomes are written unsealed, and an
        # approval written so can never run (a store opened only to read, or by a test of the rows alone).
        self.keyring = keyring
        # PostgreSQL: a press is one statement when this process knows what its seal binds (pg_press.py).
        self._one_statement = not isinstance(self.tables, Tables)
        self._sealed_fields: dict[str, tuple[str, str]] = {}
        # The outcome of each request a press guessed here won, once committed (final): a later press of it, in a
        # later group, is guessed to lose to it (a burst of presses split between two groups stays one string).
        self._decided_here: dict[str, str] = {}
        # The policy each request opened under, as read or written here (it never changes: rules_of).
        self._rules: dict[str, Rules] = {}
        # Whose an identity is under the configuration running now (set by the ApprovalService over this store;
        # None: as each review was recorded): under a policy of several people, a review an identity made before
        # it was linked to its person is that person's too (one person counts once, whenever their doors were linked).
        self.person_of: PersonOf | None = None
        # Whether an earlier approving review still counts (set by the ApprovalService; None: every one does): one
        # by somebody the policy no longer lets decide, or by the requester under forbid_requester, does not.
        self.approval_counts: ApprovalCounts | None = None

    @property
    def conn(self) -> aiosqlite.Connection:
        """The SQLite connection (the console's dashboard reads it directly); a PostgreSQL store has none."""
        if self._conn is None:
            raise RuntimeError("this approvals store is not on SQLite: it has no SQLite connection")
        return self._conn

    async def _write(self, op: Callable[[Tx], T], *, ride: float = 0.0, deadline: float | None = None) -> T:
        """Every write: one operation in the store's next group commit (see :mod:`kazma.config.store.writer`);
        ``deadline`` (the loop's time): given up past it while it waits, never to commit (``WriteGivenUp``)."""
        writer: Writer = await self.tables.writer()
        result = await writer.submit(op, ride=ride, deadline=deadline)
        if self.chain.appended:  # audit events committed: the checkpointer signs them, the sink sends them
            self.chain.appended = False
            for listener in self.appended_listeners:
                listener()
        return result

    async def write(self, op: Callable[[Tx], T], *, ride: float = 0.0) -> T:
        """One operation of another approvals module (the checkpointer) in the store's next group commit; ``ride``
        > 0: in the next group other writes start, or alone after that many seconds (the checkpointer's passes)."""
        return await self._write(op, ride=ride)

    async def release_riders(self) -> None:
        """Writes waiting to ride (a checkpoint) go now: someone waits for them."""
        writer: Writer = await self.tables.writer()
        writer.release_riders()

    async def insert(
        self,
        *,
        tool: str,
        args_json: str,
        args_hash: str,
        requested_by: str,
        conversation: str,
        deadline: float,
        task_id: str | None,
        notes: tuple[str, ...] = (),
        durable: bool = False,
        waits: Waits | None = None,
        seen: bool = False,
    ) -> ApprovalRequest:
        request, _ = await self.insert_once(
            NewRequest(new_request_id(), tool, args_json, args_hash, requested_by, conversation, deadline, task_id),
            notes=notes,
            durable=durable,
            waits=waits,
            seen=seen,
        )
        return request

    async def insert_once(
        self,
        new: NewRequest,
        *,
        notes: tuple[str, ...] = (),
        durable: bool = False,
        waits: Waits | None = None,
        seen: bool = False,
        guard: Guard | None = None,
        also: Sequence[Callable[[Tx], object]] = (),
        definition_hash: str | None = None,
    ) -> tuple[ApprovalRequest, bool]:
        """The request's row and its ``opened`` audit row, and ``also``'s statements, in one transaction.
        ``waits``: how a synchronous asker waits; ``seen``: the asker is an API caller, seen asking now.
        ``definition_hash``: the digest of the tool definition the card is opened for (None: fixed in code).

        ``guard`` runs first in that transaction: when it names another request, that one is read and
        returned (False) and nothing else is written; None lets this one open (True). Whatever ``guard`` or
        ``also`` raises undoes the whole transaction and reaches the caller.
        """
        now = self.clock()
        row = (
            new.id,
            new.tool,
            new.args_json,
            new.args_hash,
            new.requested_by,
            new.conversation,
            new.task_id,
            now,
            new.deadline,
            "pending",
            None,
            None,
            None,
            None,
            json.dumps(list(notes)),
            int(durable),
            None if waits is None else waits.value,
            now if seen else None,
            None,
            None,
            None,
            new.rules.policy,
            new.rules.approve_needed,
            new.rules.deny_needed,
            int(new.rules.step_up),
            new.rules.started_by,
            definition_hash,
        )

        def op(tx: Tx) -> tuple[ApprovalRequest, bool]:
            standing = None if guard is None else guard(tx, new.id)
            if standing is not None:
                found = tx.one(_REQUEST_BY_ID, (standing,))
                if found is None:
                    raise LookupError(f"approval request {standing} is gone")
                return _row_to_request(found), False
            tx.send(  # nothing waits for it on PostgreSQL: a failure fails the transaction all the same
                f"INSERT INTO approval_requests ({_COLUMNS}, owner)"  # noqa: S608
                f" VALUES ({', '.join('?' * (len(row) + 1))})",
                (*row, self.replica),
            )
            # The audit says which definition of the tool was put to people, so a rule made from it can be traced.
            opened = f"tool={new.tool}" if definition_hash is None else f"tool={new.tool} definition={definition_hash}"
            self.chain.append(tx, new.id, "opened", actor=new.requested_by, at=now, args_hash=new.args_hash,
                              detail=opened)  # fmt: skip
            for statements in also:
                statements(tx)
            tx.after_commit(lambda: self._opened(new))
            return _row_to_request(row), True

        return await self._write(op)

    async def get(self, request_id: str) -> ApprovalRequest | None:
        """The request, or None; :class:`UnreadableRequest` for a row that cannot be read (see
        :meth:`_request_rows`)."""
        try:
            row = await self.tables.one(_REQUEST_BY_ID, (request_id,))
        except sqlite3.OperationalError as exc:
            unreadable = await self._unreadable(request_id, exc)
            if unreadable is None:
                raise
            raise unreadable from None
        return None if row is None else _row_to_request(row)

    async def _unreadable(self, request_id: str, exc: BaseException) -> UnreadableRequest | None:
        """After a statement about ``request_id`` failed with ``exc``: when SQLite could not decode a text of that
        request's row, the error naming it and its columns (logged and counted as the lists do); else None (the
        text was elsewhere: a card's, a review's)."""
        if not undecodable(exc):
            return None
        _, unreadable = await self._request_rows_and_unreadable(
            _COLUMNS, "FROM approval_requests WHERE id = ?", (request_id,)
        )
        return unreadable[0] if unreadable else None

    async def _request_rows(self, columns: str, rest: str, params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        """``SELECT columns rest`` over approval_requests (``columns`` start with the id), without the rows that
        cannot be read: each is logged by its id and counted, and the others are read on.

        SQLite keeps whatever bytes a text column is given and hands a text back as str: one that is not UTF-8
        (written around Kazma) failed the whole read with an error naming no row, so doctor's seal check, the
        pending lists of a start and the sweeps all stopped at it. A row left out is never taken as approved:
        what is not read is not run, and a press on it fails in the store."""
        rows, _ = await self._request_rows_and_unreadable(columns, rest, params)
        return rows

    async def _request_rows_and_unreadable(
        self, columns: str, rest: str, params: Sequence[Any] = ()
    ) -> tuple[list[Sequence[Any]], list[UnreadableRequest]]:
        try:
            return list(await self.tables.all(f"SELECT {columns} {rest}", tuple(params))), []
        except Exception as exc:
            if not undecodable(exc):
                raise
        rows, unreadable = await self._read_byte_safe(columns, rest, params)
        for bad in unreadable:
            count_failure("approval_row_unreadable")
            log.warning("approvals.request_unreadable", request_id=bad.request_id, columns=list(bad.columns))
        return rows, unreadable

    async def _read_byte_safe(
        self, columns: str, rest: str, params: Sequence[Any]
    ) -> tuple[list[Sequence[Any]], list[UnreadableRequest]]:
        return _split_unreadable(columns, await self._byte_safe_rows(columns, rest, params))

    async def definition_of(self, request_id: str) -> str | None:
        """The digest of the tool definition ``request_id`` was opened for (None: a tool fixed in Kazma's code, a
        request opened before definitions were recorded, or no such request)."""
        row = await self.tables.one("SELECT definition_hash FROM approval_requests WHERE id = ?", (request_id,))
        return None if row is None or row[0] is None else str(row[0])

    async def commits_seen(self) -> int | None:
        """A number that changes whenever another connection committed to the SQLite file (``PRAGMA
        data_version``: this process's own writer is such a connection, and so is the CLI); None on PostgreSQL,
        where nothing this cheap says so."""
        if not isinstance(self.tables, Tables):
            return None
        row = await self.tables.one("PRAGMA data_version")
        return int(row[0])

    async def ended_among(self, request_ids: Sequence[str]) -> list[str]:
        """Which of ``request_ids`` are no longer pending (one query: the waiters' safety sweep)."""
        if not request_ids:
            return []
        marks = ", ".join("?" * len(request_ids))
        rows = await self.tables.all(
            f"SELECT id FROM approval_requests WHERE id IN ({marks}) AND status <> 'pending'",  # noqa: S608
            tuple(request_ids),
        )
        return [str(row[0]) for row in rows]

    async def requests(self, *, pending_only: bool = False, limit: int = 100) -> list[ApprovalRequest]:
        where = "WHERE status = 'pending'" if pending_only else ""
        rows = await self._request_rows(
            _COLUMNS,
            f"FROM approval_requests {where} ORDER BY created_at DESC LIMIT ?",
            (limit,),
        )
        return [_row_to_request(row) for row in rows]

    async def pending_of(self, tool: str) -> list[ApprovalRequest]:
        """Every pending request for ``tool``, newest first: only theirs are read (a sweep for one kind read every
        pending row, 10,000 of them at a start after a crash, and every five seconds after)."""
        rows = await self._request_rows(
            _COLUMNS,
            "FROM approval_requests WHERE status = 'pending' AND tool = ? ORDER BY created_at DESC",
            (tool,),
        )
        return [_row_to_request(row) for row in rows]

    async def requests_in(self, conversation: str, *, limit: int = 200) -> list[ApprovalRequest]:
        """The newest ``limit`` requests asked in one conversation (``telegram:-100…``), oldest first."""
        rows = await self._request_rows(
            _COLUMNS,
            "FROM approval_requests WHERE conversation = ? ORDER BY created_at DESC LIMIT ?",
            (conversation, limit),
        )
        return [_row_to_request(row) for row in reversed(rows)]

    async def finish(
        self,
        request_id: str,
        status: Status,
        *,
        actor: str | None,
        platform: str | None,
        reason: str | None = None,
        require_before_deadline: bool = False,
        lost_event: str | None = None,
    ) -> tuple[bool, ApprovalRequest | None]:
        """The compare-and-set, in one transaction with its audit row.

        Returns whether this call moved the row out of ``pending``, and the row as
        it stands after the call (None for an unknown id). With ``lost_event``, a
        call that did not win is audited under that name in the same transaction.
        """
        try:
            return await self._write(
                lambda tx: self._finish(
                    tx,
                    request_id,
                    status,
                    actor=actor,
                    platform=platform,
                    reason=reason,
                    require_before_deadline=require_before_deadline,
                    lost_event=lost_event,
                )
            )
        except sqlite3.OperationalError as exc:
            unreadable = await self._unreadable(request_id, exc)
            if unreadable is None:
                raise
            raise unreadable from exc

    async def press(
        self,
        request_id: str,
        status: Status,
        *,
        actor: str,
        platform: str,
        reason: str | None,
        card: CardCheck | None,
        person: str | None = None,
        admit: Admission | None = None,
        first_use: FirstUse | None = None,
    ) -> Pressed:
        """A person's decision: its admission and the card it came from checked, the compare-and-set and its audit
        row, as one write.

        A press that loses is audited ``press_lost`` in the same group commit; one refused by ``admit`` or with a
        card problem writes nothing (the caller decides what to audit, and whether to look again). ``first_use``
        (SQLite): a write of the same transaction run first, the record of the signed request that carried the
        press; when it says False, nothing else is written (``replayed``).
        """
        op = self.press_op(
            request_id, status, actor=actor, platform=platform, reason=reason, card=card, person=person, admit=admit,
        )  # fmt: skip
        if first_use is not None and self.chain.postgres:
            raise ValueError("a press's first_use rides in its transaction on SQLite only")
        try:
            if first_use is None:
                return await self._write(op)
            return await self._write(functools.partial(_first_then, first_use, op))
        except sqlite3.OperationalError as exc:
            # A press's own reads of its row (_PRESS_HEAD, _STANDING, …) fail with SQLite's error, which names a
            # column and no row: the row is named, logged and counted here as every list of requests does.
            unreadable = await self._unreadable(request_id, exc)
            if unreadable is None:
                raise
            raise unreadable from exc

    def press_op(
        self,
        request_id: str,
        status: Status,
        *,
        actor: str,
        platform: str,
        reason: str | None,
        card: CardCheck | None,
        person: str | None = None,
        admit: Admission | None = None,
    ) -> Callable[[Tx], Pressed]:
        """The statements of :meth:`press`, as the writer runs them inside its transaction.

        The first statement reads how the request stands, its rules and (from a card) its cards on the press's
        platform; ``admit`` is held to those rules, then the card; a request already decided or past its deadline
        is lost there, without a seal or another read. Public so ``bench/store_decide.py`` can run exactly these
        statements with no service, writer or event loop around them: the most any code around them could reach.
        """
        part = _Press(self, request_id, status, actor, platform, reason, card, person, admit)
        if self._one_statement:
            return self._one_statement_op(part)
        # SQLite: the presses of this request in the same group run together (_press_together).
        return Together(part, (self, request_id), part, _presses_together)

    def _one_statement_op(self, part: _Press) -> Callable[[Tx], Pressed]:
        """:meth:`press_op` on PostgreSQL: the press as one statement when it can be (:meth:`_press_in_one`)."""

        def op(tx: Tx) -> Pressed:
            pressed = self._press_in_one(tx, part)
            return part(tx) if pressed is None else pressed

        request_id, card = part.request_id, part.card
        if (
            request_id in self._sealed_fields
            and request_id in self._rules
            and (card is None or card.platform == part.platform)
            and self.chain.guesses_hold
        ):
            # One statement sent on a guess (_press_in_one), asking nothing: its group may go as one string.
            # Not while the chain's head guesses fail (another replica appended since): its append asks for
            # the head, and the one string was abandoned after the group's Python had run, then all run again.
            return Unasking(op)
        return op

    def _press_alone(self, tx: Tx, press: _Press) -> Pressed:
        """:meth:`press_op`'s statements for one press on its own (see there)."""
        request_id, status, actor, platform, reason = (
            press.request_id,
            press.status,
            press.actor,
            press.platform,
            press.reason,
        )
        card, person, admit = press.card, press.person, press.admit
        if card is not None:
            rows = tx.all(_PRESS_CARDS, (card.platform, request_id))
            head = rows[0] if rows else None
        else:
            rows = []
            head = tx.one(_PRESS_HEAD, (request_id,))
        if head is None:
            return Pressed(None, False, None, refused=None if admit is None else admit(None))
        rules = _rules_of_press(head)
        self._remember_rules(request_id, rules)
        self._sealed_over(request_id, (head[1], head[2], rules.approve_needed, rules.deny_needed))
        stopped = _stopped(rules, admit, card, rows, None, person or actor)
        if stopped is not None:
            return stopped
        now = self.clock()
        if head[5] != Status.PENDING.value or float(head[4]) <= now:
            # Decided already (final: the triggers keep it so) or past its deadline: lost, as the
            # compare-and-set below would find it.
            return self._lost_as(tx, _standing(head[:11]), actor, platform, now, person)
        decision = Decision.APPROVE if status is Status.APPROVED else Decision.DENY
        reviewer = person or actor  # one person counts once, whatever the platform
        needed = rules.approve_needed if decision is Decision.APPROVE else rules.deny_needed
        reviewed = (rules.approve_needed, rules.deny_needed) != (1, 1)
        if reviewed:
            if tx.run(_REVIEW_LOCK, (request_id, now)) == 0:
                return self._lost(tx, request_id, actor, platform, now, person)
            earlier = tx.all(_REVIEWS_OF, (request_id,))
            of = self.person_of
            repeated = any(_same_reviewer(row, reviewer, actor, person, of) for row in earlier)
            if repeated or tx.run(_REVIEW, (request_id, reviewer, actor, platform, decision.value, reason, now)) == 0:
                standing = tx.one(f"SELECT {_STANDING} FROM approval_requests WHERE id = ?", (request_id,))  # noqa: S608
                request = _standing(standing)
                self.chain.append(tx, request_id, "review_repeated", actor=actor, platform=platform, at=now,
                                  args_hash=request.args_hash, detail=f"{reviewer} reviewed it already",
                                  person=person)  # fmt: skip
                return Pressed(None, False, request, ReviewState.REPEATED)
            # People, not rows: two reviews by identities linked to one person since they were made count once.
            counts = self.approval_counts
            counted = {
                _reviewer_now(row, of)
                for row in earlier
                if row[2] == decision.value
                and (decision is Decision.DENY or counts is None or counts(rules, str(row[1]), str(row[3])))
            } | {reviewer}
            if len(counted) < needed:
                standing = tx.one(f"SELECT {_STANDING} FROM approval_requests WHERE id = ?", (request_id,))  # noqa: S608
                request = _standing(standing)
                detail = f"{decision.value} {len(counted)} of {needed}" + (f": {reason}" if reason else "")
                self.chain.append(tx, request_id, "reviewed", actor=actor, platform=platform, at=now,
                                  args_hash=request.args_hash, detail=detail, person=person)  # fmt: skip
                tx.notify(DECIDED_CHANNEL, request_id)
                return Pressed(None, False, request, ReviewState.COUNTED)
        return self._set(tx, request_id, head, status, actor, platform, reason, person, now, reviewed=reviewed)

    def _set(
        self,
        tx: Tx,
        request_id: str,
        head: Sequence[Any],
        status: Status,
        actor: str,
        platform: str,
        reason: str | None,
        person: str | None,
        now: float,
        *,
        reviewed: bool,
    ) -> Pressed:
        """A press's compare-and-set on the request ``head`` read (pending, before its deadline, admitted): the
        outcome sealed, its review unless the press was already counted as one, its audit row; lost if another
        write got there first."""
        sealed = self._seal(request_id, str(head[1]), str(head[2]), status, actor, platform, now, person)
        params = (status.value, actor, platform, now, reason, *sealed, person, request_id, now)
        row = tx.one(f"{_CAS_BEFORE_DEADLINE} RETURNING {_STANDING}", params)
        if row is None:
            return self._lost(tx, request_id, actor, platform, now, person)
        request = _standing(row)
        if not reviewed:  # one press decides: its review is written with the outcome
            decision = Decision.APPROVE if status is Status.APPROVED else Decision.DENY
            tx.run(_REVIEW, (request_id, person or actor, actor, platform, decision.value, reason, now))
        detail = decided_detail(status, reason)
        self.chain.append(tx, request_id, "decided", actor=actor, platform=platform, at=now,
                          args_hash=request.args_hash, detail=detail, person=person)  # fmt: skip
        tx.notify(DECIDED_CHANNEL, request_id)
        if self.chain.postgres:
            return Pressed(None, True, request)
        if self.decided_in_commit is not None and (self.sign_in_commit_due is None or self.sign_in_commit_due()):
            tx.defer(self._after_chaining, request_id)
        decided = Decided()
        tx.defer(_read_decided, (request_id, decided))
        return Pressed(None, True, request, decided=decided)

    def _press_together(self, tx: Tx, presses: list[_Press]) -> list[Pressed]:
        """The presses of one request in one group, decided as :meth:`press_op` run one after another would decide
        them, with one read of the request and all its cards and at most one compare-and-set: in their order, a
        press refused by its admission or from no card of the request writes nothing; the first other one, while
        the request is pending and before its deadline, decides it; every one after that loses to the outcome
        it set (their ``press_lost`` rows go in the chain's one insert at the end of the transaction). Under a
        policy of several people each press is a review that must see the ones before it: they run one by one.
        """
        request_id = presses[0].request_id
        if any(p.card is not None for p in presses):
            rows = tx.all(_PRESS_ALL_CARDS, (request_id,))
            head = rows[0] if rows else None
        else:
            rows = []
            head = tx.one(_PRESS_HEAD, (request_id,))
        if head is None:
            return [Pressed(None, False, None, refused=None if p.admit is None else p.admit(None)) for p in presses]
        rules = _rules_of_press(head)
        self._remember_rules(request_id, rules)
        if (rules.approve_needed, rules.deny_needed) != (1, 1):
            return [p(tx) for p in presses]
        now = self.clock()
        # How the request stands once decided (here or before): every later press that gets that far loses to it.
        standing = None if head[5] == Status.PENDING and float(head[4]) > now else _standing(head[:11])
        results: list[Pressed] = []
        for p in presses:
            on = None if p.card is None else p.card.platform
            stopped = _stopped(rules, p.admit, p.card, rows, on, p.person or p.actor)
            if stopped is not None:
                results.append(stopped)
                continue
            if standing is not None:
                results.append(self._lost_as(tx, standing, p.actor, p.platform, now, p.person))
                continue
            pressed = self._set(tx, request_id, head, p.status, p.actor, p.platform, p.reason, p.person, now,
                                reviewed=False)  # fmt: skip
            standing = pressed.request
            results.append(pressed)
            if standing is None:  # the request is gone (never: its row cannot be deleted): the rest alone
                results += [q(tx) for q in presses[len(results) :]]
                break
        return results

    def _press_in_one(self, tx: Tx, press: _Press) -> Pressed | None:
        """:meth:`press_op` on PostgreSQL as one statement (:mod:`kazma.approvals.pg_press`), or None: the
        general statements (``press`` called) decide it now (a request whose policy or sealed fields this process
        has not read). A request of a policy of several people, a card problem to name, or fields changed around
        Kazma make the statement a miss, and the general statements decide it once the statement's answer is in.

        In pipeline mode the statement's answer is waited for with the group's others (what is returned is a
        :class:`~kazma.config.store.group_commit.Later` the writer fills before the commit)."""
        request_id, status, actor, platform, reason = (
            press.request_id,
            press.status,
            press.actor,
            press.platform,
            press.reason,
        )
        card, person, admit = press.card, press.person, press.admit
        known = self._sealed_fields.get(request_id)
        rules = self._rules.get(request_id)
        if known is None or rules is None or (card is not None and card.platform != platform):
            return None
        if admit is not None:  # on the rules the request opened under, which never change
            refused = admit(rules)
            if refused is not None:
                return Pressed(None, False, None, refused=refused)
        tool, digest = known
        now = self.clock()
        decision = Decision.APPROVE if status is Status.APPROVED else Decision.DENY
        mac, key_id = self._seal(request_id, tool, digest, status, actor, platform, now, person)
        call = PressCall(
            request_id, status.value, actor, platform, now, reason, mac, key_id, person, tool, digest,
            person or actor, decision.value, card is not None, None if card is None else card.chat,
            None if card is None else card.message_id, card is not None and card.needs_whole,
        )  # fmt: skip

        guessed = pg_press.guessing(tx)
        if guessed is not None:
            return self._press_guessed(guessed, call, status, actor, platform, reason, now, person, digest)

        def then(found: tuple[str, tuple[Any, ...]] | None) -> Pressed:
            if found is None:
                return Pressed(None, False, None)
            outcome, row = found
            if outcome == pg_press.MISS:
                return press(tx)
            request = _standing(row)
            if outcome == pg_press.WON:
                self._sealed_fields.pop(request_id, None)  # decided: no press of it can win again
                self.chain.append(tx, request_id, "decided", actor=actor, platform=platform, at=now,
                                  args_hash=request.args_hash, detail=decided_detail(status, reason),
                                  person=person)  # fmt: skip
                tx.notify(DECIDED_CHANNEL, request_id)
                return Pressed(None, True, request)
            standing = request.status.value if request.status.final else "pending past its deadline"
            self.chain.append(tx, request_id, "press_lost", actor=actor, platform=platform, at=now,
                              args_hash=request.args_hash, detail=f"standing: {standing}", person=person)  # fmt: skip
            return Pressed(None, False, request)

        later = pg_press.press(tx, call, then)
        if later.done:  # statements waited for one by one (no pipeline): the answer is in
            return later.value
        # In a pipeline the writer answers the caller with the Later's value once its transaction filled it.
        return cast(Pressed, later)

    def _press_guessed(
        self,
        tx: pg_press.GuessTx,
        call: PressCall,
        status: Status,
        actor: str,
        platform: str,
        reason: str | None,
        now: float,
        person: str | None,
        digest: str,
    ) -> Pressed:
        """:meth:`_press_in_one` without waiting for its answer: the first press of a request in a transaction is
        guessed to win (its NOTIFY made by the same call), the others of it there to lose to it; their audit
        events go out beside them, and a wrong guess (another replica decided, the deadline passed, a card
        problem) runs the group again without guessing (:func:`kazma.approvals.pg_press.press_guessed`)."""
        request_id = call.request_id
        # Per request guessed to win here: its status, and the winner's row once the answers are in (a list the
        # winner's answer fills, read by the losers' answers after it: answers are read in the order sent).
        decided: dict[str, tuple[str, list[Any]]] = tx.notes.setdefault(_PRESS_GUESSES, {})
        guessed = decided.get(request_id)
        winner: list[Any] | None
        if guessed is not None:
            first, winner = guessed
        elif (committed := self._decided_here.get(request_id)) is not None:
            # Decided by a press of an earlier group of this process: guessed to lose to that outcome, checked by
            # the press function (the row is final; should it say otherwise, the group runs again unguessed).
            first, winner = committed, None
        else:
            row_of_winner: list[Any] = []
            decided[request_id] = (status.value, row_of_winner)
            self.chain.append(tx, request_id, "decided", actor=actor, platform=platform, at=now, args_hash=digest,
                              detail=decided_detail(status, reason), person=person)  # fmt: skip
            tx.after_commit(functools.partial(self._decided_by_guess, request_id, status.value))

            def won(row: tuple[Any, ...]) -> Pressed:
                row_of_winner.append(row)
                return Pressed(None, True, _standing(row))

            return cast(Pressed, pg_press.press_guessed(tx, call, pg_press.WON, status.value, won,
                                                        notify=DECIDED_CHANNEL))  # fmt: skip
        self.chain.append(tx, request_id, "press_lost", actor=actor, platform=platform, at=now, args_hash=digest,
                          detail=f"standing: {first}", person=person)  # fmt: skip
        if winner is not None and call.card and pg_press.lost_check_prepared(tx):
            # Told the request as its winner left it (final: nothing after it in the transaction can change it);
            # the server checks only the card (pg_press.lost_on_guess).
            left = winner  # its row is in once the winner's answer was read, before this one's
            lost = pg_press.lost_on_guess(tx, call, first, lambda: Pressed(None, False, _standing(left[0])))
        else:
            lost = pg_press.press_guessed(
                tx, call, pg_press.LOST, first, lambda row: Pressed(None, False, _standing(row))
            )
        return cast(Pressed, lost)

    def _after_chaining(self, tx: Tx, request_ids: list[str]) -> None:
        # Run with the chain's own flush (same round): handed on once more, so it runs after every event of the
        # transaction is chained, whatever order the flushes were first asked for in.
        sign = self.decided_in_commit
        if sign is None:
            return
        for request_id in request_ids:
            tx.defer(sign, request_id)

    def _decided_by_guess(self, request_id: str, status: str) -> None:
        """A press guessed here won ``request_id`` and committed: no press of it can win again, and each later one
        here is guessed to lose to ``status`` (its sealed fields are kept for that call)."""
        if len(self._decided_here) >= _SEALED_KEPT:
            self._decided_here.clear()
        self._decided_here[request_id] = status

    def _opened(self, new: NewRequest) -> None:
        """A request this store opened committed: a press of it reads neither its policy nor its sealed fields."""
        self._remember_rules(new.id, new.rules)
        self._sealed_over(new.id, (new.tool, new.args_hash, new.rules.approve_needed, new.rules.deny_needed))

    def _sealed_over(self, request_id: str, head: Sequence[Any]) -> None:
        """Remember what a press's seal binds of a request of one press (tool, arguments hash), read or written
        here: a press of it on PostgreSQL is then one statement. Neither ever changes once the request opened
        (and the compare-and-set holds them in its predicate all the same)."""
        if not self._one_statement or (int(head[2]), int(head[3])) != (1, 1):
            return
        if len(self._sealed_fields) >= _SEALED_KEPT:
            self._sealed_fields.clear()
        self._sealed_fields[request_id] = (str(head[0]), str(head[1]))

    def _lost(self, tx: Tx, request_id: str, actor: str, platform: str, now: float, person: str | None) -> Pressed:
        """A press that found the request decided (or past its deadline): audited ``press_lost``."""
        row = tx.one(f"SELECT {_STANDING} FROM approval_requests WHERE id = ?", (request_id,))  # noqa: S608
        if row is None:
            return Pressed(None, False, None)
        return self._lost_as(tx, _standing(row), actor, platform, now, person)

    def _lost_as(self, tx: Tx, request: Standing, actor: str, platform: str, now: float, person: str | None) -> Pressed:
        standing = request.status.value if request.status.final else "pending past its deadline"
        self.chain.append(tx, request.id, "press_lost", actor=actor, platform=platform, at=now,
                          args_hash=request.args_hash, detail=f"standing: {standing}", person=person)  # fmt: skip
        return Pressed(None, False, request)

    async def press_on_record(self, request_id: str, actor: str) -> bool:
        """Whether a press of ``actor`` on ``request_id`` is on the record: its decision, its review, or its loss
        to a decision made before it (each is audited in the press's own commit)."""
        row = await self.tables.one(
            "SELECT 1 FROM approval_events WHERE request_id = ? AND actor = ?"
            " AND event IN ('decided', 'reviewed', 'review_repeated', 'press_lost') LIMIT 1",
            (request_id, actor),
        )
        return row is not None

    async def reviews(self, request_id: str) -> list[Review]:
        """Every review of ``request_id``, in the order they were made."""
        rows = await self.tables.all(
            f"SELECT {_REVIEW_COLUMNS} FROM approval_reviews WHERE request_id = ? ORDER BY at, reviewer",  # noqa: S608
            (request_id,),
        )
        return [_review(r) for r in rows]

    async def rules_of(self, request_id: str) -> Rules | None:
        """The policy ``request_id`` opened under (None: unknown id), without reading its call."""
        known = self._rules.get(request_id)
        if known is not None:  # fixed when the request opened (a trigger refuses any change)
            return known
        row = await self.tables.one(
            "SELECT policy, approve_needed, deny_needed, step_up, started_by, tool, args_hash FROM approval_requests"
            " WHERE id = ?",
            (request_id,),
        )
        if row is None:
            return None
        self._sealed_over(request_id, (row[5], row[6], row[1], row[2]))
        rules = Rules(row[0], int(row[1]), int(row[2]), bool(row[3]), row[4])
        self._remember_rules(request_id, rules)
        return rules

    def _remember_rules(self, request_id: str, rules: Rules) -> None:
        if len(self._rules) >= _SEALED_KEPT:
            self._rules.clear()
        self._rules[request_id] = rules

    def _seal(
        self,
        request_id: str,
        tool: str,
        digest: str,
        status: Status,
        actor: str | None,
        platform: str | None,
        now: float,
        person: str | None = None,
    ) -> tuple[str | None, str | None]:
        """(decision_mac, decision_key_id) for the compare-and-set: made before it, with the time it stores."""
        if self.keyring is None:
            return None, None
        made = seal(
            self.keyring,
            request_id=request_id,
            tool=tool,
            args_hash=digest,
            status=status.value,
            decided_by=actor,
            decided_via=platform,
            decided_at=now,
            decided_person=person,
        )
        return made.mac, made.key_id

    def _finish(
        self,
        tx: Tx,
        request_id: str,
        status: Status,
        *,
        actor: str | None,
        platform: str | None,
        reason: str | None,
        require_before_deadline: bool,
        lost_event: str | None,
    ) -> tuple[bool, ApprovalRequest | None]:
        head = tx.one(_SEALED_FIELDS, (request_id,))
        if head is None:
            return False, None
        now = self.clock()
        sealed = self._seal(request_id, str(head[0]), str(head[1]), status, actor, platform, now)
        params: tuple[Any, ...] = (status.value, actor, platform, now, reason, *sealed, None, request_id)
        sql = _CAS
        if require_before_deadline:
            sql, params = _CAS_BEFORE_DEADLINE, (*params, now)
        row = tx.one(sql + _RETURNING, params)
        won = row is not None
        if not won:
            row = tx.one(_REQUEST_BY_ID, (request_id,))
        request = None if row is None else _row_to_request(row)
        if request is None:
            return False, None
        if won:
            event, detail = ("decided", decided_detail(status, reason)) if status.human else (status.value, reason)
            self.chain.append(
                tx,
                request_id,
                event,
                actor=actor,
                platform=platform,
                at=now,
                args_hash=request.args_hash,
                detail=detail,
            )
            tx.notify(DECIDED_CHANNEL, request_id)
        elif lost_event is not None:
            standing = request.status.value if request.status.final else "pending past its deadline"
            self.chain.append(tx, request_id, lost_event, actor=actor, platform=platform, at=now,
                              args_hash=request.args_hash, detail=f"standing: {standing}")  # fmt: skip
        return won, request

    async def audit(
        self,
        request_id: str | None,
        event: str,
        *,
        actor: str | None = None,
        platform: str | None = None,
        detail: str | None = None,
        person: str | None = None,
        deadline: float | None = None,
    ) -> None:
        await self._write(
            functools.partial(
                self.record, request_id=request_id, event=event, actor=actor, platform=platform, detail=detail,
                person=person, at=self.clock(),
            ),
            deadline=deadline,
        )  # fmt: skip

    def record(
        self,
        tx: Tx,
        *,
        request_id: str | None,
        event: str,
        actor: str | None = None,
        platform: str | None = None,
        detail: str | None = None,
        person: str | None = None,
        at: float | None = None,
    ) -> None:
        """One audit event, written with what else ``tx`` writes (a rule with its ``rule_created``; its end with
        its ``rule_revoked``): both or neither. ``at``: now, when not given."""
        self.chain.append(
            tx, request_id, event, actor=actor, platform=platform, at=self.clock() if at is None else at,
            args_hash=FROM_REQUEST, detail=detail, person=person,
        )  # fmt: skip

    async def start_chain(self) -> None:
        """Chain the events written before the audit chain began, once (``kazma run`` does it at start, so the
        first decision after an upgrade does not wait for it); a no-op once done."""
        await self._write(self.chain.start)

    async def witness(self, request_id: str) -> Checkpoint | None:
        """The signed checkpoint that holds ``request_id``'s decision (what its settled cards show), or None."""
        found = await self.tables.one(_DECISION_SEQ, (request_id,))
        if found is None:
            return None
        rows = await self.audit_rows(
            CHECKPOINT_COLUMNS,
            "FROM audit_checkpoints WHERE seq >= ? AND first_seq <= ? ORDER BY seq LIMIT 1",
            (found[0], found[0]),
        )
        return checkpoint_of_row(rows[0]) if rows else None

    async def audit_rows(self, columns: str, rest: str, params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        """``SELECT columns rest`` over the audit tables, readable whatever a row holds.

        SQLite keeps whatever bytes a text column is given, and hands a text back as str: one that is not UTF-8
        (written around Kazma, whose own texts are all str) fails the whole read, so verify, export, the sink and
        doctor stopped at a traceback naming no row. Read again as bytes, such a text comes back as ``bytes``: what
        Kazma never writes, so its event hashes to nothing and the verifier names it at its sequence number."""
        try:
            return list(await self.tables.all(f"SELECT {columns} {rest}", tuple(params)))
        except Exception as exc:
            if not undecodable(exc):
                raise
        return await self._byte_safe_rows(columns, rest, params)

    async def _byte_safe_rows(self, columns: str, rest: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """``SELECT columns rest`` again after SQLite failed to decode a text: such a text comes back as ``bytes``."""
        rows = await self.tables.all(f"SELECT {byte_safe(columns)} {rest}", tuple(params))
        return [from_byte_safe(row) for row in rows]

    async def chain_events(self, after: int = 0, *, limit: int = 1000) -> list[ChainedEvent]:
        """Audit events with their chain fields, in sequence order, from the first after ``after``."""
        rows = await self.audit_rows(
            EVENT_COLUMNS, "FROM approval_events WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)
        )
        return [ChainedEvent.of_row(row) for row in rows]

    async def chain_checkpoints(self, after: int = 0, *, limit: int = 1000) -> list[Checkpoint]:
        """Signed checkpoints in sequence order, from the first whose head comes after ``after``."""
        rows = await self.audit_rows(
            CHECKPOINT_COLUMNS, "FROM audit_checkpoints WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)
        )
        return [checkpoint_of_row(row) for row in rows]

    async def last_checkpoint(self) -> Checkpoint | None:
        rows = await self.audit_rows(CHECKPOINT_COLUMNS, "FROM audit_checkpoints ORDER BY seq DESC LIMIT 1")
        return checkpoint_of_row(rows[0]) if rows else None

    async def unrecorded_requests(self, *, limit: int = 100) -> tuple[list[UnrecordedRequest], bool]:
        """Requests whose row the audit log does not record: a pending one without its ``opened`` event, a
        finished one without its ending event (``decided``, ``timeout``, ``cancelled``); the oldest ``limit``, and
        whether there are more. What a log cut at a checkpoint leaves behind (see :data:`_UNRECORDED`)."""
        rows = await self.audit_rows("r.id, r.decided_by, r.status, r.decision_mac", _UNRECORDED, (limit + 1,))
        # A finished row whose log has another ending event than its own: the row is what changed, not the log.
        finished = sorted({str(r[0]) for r in rows[:limit] if r[2] != Status.PENDING.value})
        ending: dict[str, RecordedEnding] = {}
        # Read as verify reads the events (audit_rows): a text not UTF-8 in one is shown, never a stop.
        async for seq, request_id, event, actor, detail in self.audit_rows_of(
            "seq, request_id, event, actor, detail", finished, DECISION_EVENTS
        ):
            ending.setdefault(str(request_id), RecordedEnding(int(seq), str(event), actor, detail))
        found = [
            UnrecordedRequest(str(r[0]), str(r[2]), r[3] is not None, r[1], ending.get(str(r[0]))) for r in rows[:limit]
        ]
        return found, len(rows) > limit

    async def first_endings(
        self, after: int = 0, *, limit: int = 1000, upto: int | None = None
    ) -> list[tuple[int, str | None]]:
        """(seq, request id) of each request's first ending event (``decided``, ``timeout``, ``cancelled``) in
        sequence order, from the first after ``after`` (to ``upto``): ``kazma audit verify`` checks the row of every
        request the log says ended, a page at a time, by the log's own integer key (an id's order is the database
        collation's, which PostgreSQL's locale may set). An id that is not text (written around Kazma) is None: its
        event no longer hashes, and the chain names it."""
        kinds = ", ".join("?" * len(DECISION_EVENTS))
        rows = await self.audit_rows(
            "e.seq, e.request_id",
            f"FROM approval_events e WHERE e.seq > ? AND e.seq <= ? AND e.event IN ({kinds})"  # noqa: S608
            " AND e.request_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM approval_events f"
            f" WHERE f.request_id = e.request_id AND f.event IN ({kinds}) AND f.seq < e.seq) ORDER BY e.seq LIMIT ?",
            (after, _LAST_SEQ if upto is None else upto, *DECISION_EVENTS, *DECISION_EVENTS, limit),
        )
        return [(int(seq), rid if isinstance(rid, str) else None) for seq, rid in rows]

    async def calls_changed(self, *, limit: int = 100) -> tuple[list[tuple[str, int, str, str]], bool]:
        """Requests whose stored call no longer hashes as its ``opened`` event (chained, written with the row)
        records it: (id, the event's seq, the row's hash, the event's), the first ``limit`` by seq, and whether
        there are more. A call is never changed by Kazma; one changed around it while pending is what its cards
        show and what a person then approves, its seal binding the new hash."""
        rows = await self.audit_rows(
            "r.id, e.seq, r.args_hash, e.args_hash",
            "FROM approval_requests r JOIN approval_events e ON e.request_id = r.id AND e.event = 'opened'"
            " WHERE e.args_hash IS NOT NULL AND (r.args_hash IS NULL OR r.args_hash <> e.args_hash)"
            " ORDER BY e.seq LIMIT ?",
            (limit + 1,),
        )
        found = [(str(rid), int(seq), str(stored), str(opened)) for rid, seq, stored, opened in rows[:limit]]
        return found, len(rows) > limit

    async def endings_of(self, request_ids: Collection[str]) -> dict[str, tuple[int, bool]]:
        """Each request's first ending event (``decided``, ``timeout``, ``cancelled``) as (seq, whether it carries
        chain fields), a query per :data:`IDS_PER_QUERY` requests; a request with none is absent."""
        found: dict[str, tuple[int, bool]] = {}
        async for seq, request_id, chain_hash in self.audit_rows_of(
            "seq, request_id, chain_hash", request_ids, DECISION_EVENTS
        ):
            found.setdefault(str(request_id), (int(seq), chain_hash is not None))
        return found

    async def audit_rows_of(
        self, columns: str, request_ids: Collection[str], events: Sequence[str]
    ) -> AsyncIterator[Sequence[Any]]:
        """``columns`` of the audit events named ``events`` of ``request_ids``, read as :meth:`audit_rows` reads
        them, a query per :data:`IDS_PER_QUERY` requests: every event of one request comes in the same query, so
        each request's events come oldest first (the requests' own order is not kept)."""
        ids = sorted(set(request_ids))
        kinds = ", ".join("?" * len(events))
        for start in range(0, len(ids) if events else 0, IDS_PER_QUERY):
            part = ids[start : start + IDS_PER_QUERY]
            for row in await self.audit_rows(
                columns,
                f"FROM approval_events WHERE request_id IN ({', '.join('?' * len(part))}) AND event IN ({kinds})"
                " ORDER BY seq",
                (*part, *events),
            ):
                yield row

    async def last_event_seq(self) -> int:
        row = await self.tables.one("SELECT seq FROM approval_events ORDER BY seq DESC LIMIT 1")
        return 0 if row is None else int(row[0])

    async def events(self, request_id: str | None = None, *, event: str | None = None) -> list[AuditEvent]:
        clauses, params = [], []
        if request_id is not None:
            clauses.append("request_id = ?")
            params.append(request_id)
        if event is not None:
            clauses.append("event = ?")
            params.append(event)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self.tables.all(
            "SELECT seq, request_id, event, actor, platform, at, args_hash, detail, person FROM approval_events "  # noqa: S608
            f"{where} ORDER BY seq",
            params,
        )
        return [
            AuditEvent(r[0], r[1], r[2], r[3], r[4], datetime.fromtimestamp(r[5], UTC), r[6], r[7], r[8]) for r in rows
        ]

    async def events_of(self, request_ids: Collection[str], events: Collection[str]) -> dict[str, list[AuditEvent]]:
        """The audit events named ``events`` of each of ``request_ids``, oldest first, as :meth:`events` reads them
        one request at a time: a query per :data:`IDS_PER_QUERY` requests (a listing of 1,000 rules read two per
        rule). A request with none is absent."""
        found: dict[str, list[AuditEvent]] = {}
        ids, kinds = sorted(set(request_ids)), sorted(set(events))
        if not kinds:
            return found
        for start in range(0, len(ids), IDS_PER_QUERY):
            part = ids[start : start + IDS_PER_QUERY]
            rows = await self.tables.all(
                "SELECT seq, request_id, event, actor, platform, at, args_hash, detail, person FROM approval_events "  # noqa: S608
                f"WHERE request_id IN ({', '.join('?' * len(part))}) AND event IN ({', '.join('?' * len(kinds))})"
                " ORDER BY seq",
                (*part, *kinds),
            )
            for r in rows:
                event = AuditEvent(r[0], r[1], r[2], r[3], r[4], datetime.fromtimestamp(r[5], UTC), r[6], r[7], r[8])
                found.setdefault(str(r[1]), []).append(event)
        return found

    async def requests_of(self, request_ids: Collection[str]) -> dict[str, ApprovalRequest | UnreadableRequest]:
        """Each of ``request_ids`` as :meth:`get` reads it, a query per :data:`IDS_PER_QUERY`: the request, or the
        :class:`UnreadableRequest` :meth:`get` would raise for it; one that does not exist is absent."""
        found: dict[str, ApprovalRequest | UnreadableRequest] = {}
        ids = sorted(set(request_ids))
        for start in range(0, len(ids), IDS_PER_QUERY):
            part = ids[start : start + IDS_PER_QUERY]
            rows, unreadable = await self._request_rows_and_unreadable(
                _COLUMNS, f"FROM approval_requests WHERE id IN ({', '.join('?' * len(part))})", part
            )
            found.update((request.id, request) for request in map(_row_to_request, rows))
            found.update((bad.request_id, bad) for bad in unreadable)
        return found

    async def approved_not_started(self, live: Collection[str] | None = None) -> list[ApprovalRequest]:
        """Approved requests with no ``execution_started`` (nor an ``execution_lost`` already reported); with
        ``live``, only those whose owner is not a live replica (a live one may be about to start its call)."""
        # Only requests decided since executions are recorded (approvals schema v3): older ones ran, or not,
        # before anyone wrote it down, and must not all be reported after an upgrade.
        rows = await self._request_rows(
            _COLUMNS + ", owner",
            "FROM approval_requests r WHERE r.status = 'approved' AND r.durable = 0"
            " AND r.decided_at >= COALESCE((SELECT applied_at FROM kazma_schema"
            " WHERE component = 'approvals' AND version = 3), 0)"
            " AND NOT EXISTS (SELECT 1 FROM approval_events e WHERE e.request_id = r.id"
            " AND e.event IN ('execution_started', 'execution_lost', 'execution_refused'))"
            " ORDER BY r.decided_at",
        )
        return [_row_to_request(row[:-1]) for row in rows if _gone(row[-1], live)]

    async def orphan_ids(self, live: Collection[str] | None) -> list[tuple[str, bool]]:
        """The requests :meth:`orphans` names, oldest first, as (id, whether an open ``/mcp`` call held it): all
        a start needs to fence them (10,000 whole rows took a fifth of a second of CPU to read)."""
        rows = await self.tables.all(
            "SELECT id, waits, owner FROM approval_requests WHERE status = 'pending'"
            " AND (durable = 0 OR waits = 'connection') ORDER BY created_at"
        )
        return [(str(rid), waits == Waits.CONNECTION.value) for rid, waits, owner in rows if _gone(owner, live)]

    async def approved_verified_unfinished(self, live: Collection[str] | None = None) -> list[ApprovalRequest]:
        """Approved requests whose call was verified to run (``execution_started``) and never reported ended
        (no ``execution_finished``, ``execution_lost`` or ``execution_refused``): a process stopped between the
        check and the end of the call. Whether the call started is the execution record's to say."""
        rows = await self._request_rows(
            _COLUMNS + ", owner",
            "FROM approval_requests r WHERE r.status = 'approved' AND r.durable = 0"
            " AND EXISTS (SELECT 1 FROM approval_events e WHERE e.request_id = r.id AND e.event = 'execution_started')"
            " AND NOT EXISTS (SELECT 1 FROM approval_events e WHERE e.request_id = r.id"
            " AND e.event IN ('execution_finished', 'execution_lost', 'execution_refused'))"
            " ORDER BY r.decided_at",
        )
        return [_row_to_request(row[:-1]) for row in rows if _gone(row[-1], live)]

    def _hold_request(self, tx: Tx, request_id: str) -> None:
        """Take ``request_id``'s row for the rest of ``tx`` (PostgreSQL: a row lock; SQLite's one writer already
        holds the file's): what a transaction reads of its execution events after this, no other can change."""
        if self.chain.postgres:
            tx.one("SELECT 1 FROM approval_requests WHERE id = ? FOR UPDATE", (request_id,))

    async def execution_starts(
        self, request_id: str, detail: str, *, again: bool = False, deadline: float | None = None
    ) -> str | None:
        """An approved call is about to run: audited ``execution_started``, unless a recovery already reported it
        as never run (``execution_lost``: its replica was judged gone while it waited, or paused, or cut off).
        Then it must not run, since that report told people it will not: the refusal is audited in the same
        transaction and the report's detail returned. None: it may run. One lock on the request's row orders
        this against :meth:`execution_lost` on any replica.

        ``again``: a retry after a failed attempt whose commit may still have happened (the connection dropped
        after COMMIT was sent). A start with this ``detail`` already on the record is that attempt's own, since
        a request has one asker and its start is recorded once: it is not written a second time.

        ``deadline`` (the loop's time): past it, a start still waiting (for another process's lock) is given up
        and never recorded (``WriteGivenUp``): the caller may refuse the call knowing no start turns up later."""
        at = self.clock()

        def op(tx: Tx) -> str | None:
            self._hold_request(tx, request_id)
            row = tx.one(
                "SELECT detail FROM approval_events WHERE request_id = ? AND event = 'execution_lost'"
                " ORDER BY seq DESC LIMIT 1",
                (request_id,),
            )
            if row is not None:
                reported = str(row[0] or "reported as not run")
                self.chain.append(tx, request_id, "execution_refused", actor=None, platform=None, at=at,
                                  args_hash=FROM_REQUEST, detail=f"{detail}: already reported: {reported}")  # fmt: skip
                return reported
            if again and tx.one(
                "SELECT 1 FROM approval_events WHERE request_id = ? AND event = 'execution_started' AND detail = ?"
                " LIMIT 1",
                (request_id, detail),
            ):
                return None
            self.chain.append(tx, request_id, "execution_started", actor=None, platform=None, at=at,
                              args_hash=FROM_REQUEST, detail=detail)  # fmt: skip
            return None

        return await self._write(op, deadline=deadline)

    async def execution_lost(
        self, request_id: str, detail: str, *, unless_started: bool = False, unless_ended: bool = False
    ) -> bool:
        """An approved call that never ran (or may have run) because a process stopped: audited, and its cards
        asked to be edited (again) so they say it too. ``unless_started``: only if no execution of it was audited
        (started, refused or reported) by the time this transaction holds the request, for the report that it
        never ran: its replica, judged gone, may have started it meanwhile. ``unless_ended``: only if no ending
        of the call (finished, refused or reported) was audited by then, for the report on a call that was
        verified to run: two leaders' recoveries overlap after a leader change, and each read the call as
        unreported before either wrote. Whether it was written."""
        at = self.clock()
        first = "execution_started" if unless_started else "execution_finished"

        def op(tx: Tx) -> bool:
            if unless_started or unless_ended:
                self._hold_request(tx, request_id)
                if (
                    tx.one(
                        "SELECT 1 FROM approval_events WHERE request_id = ?"
                        " AND event IN (?, 'execution_lost', 'execution_refused') LIMIT 1",
                        (request_id, first),
                    )
                    is not None
                ):
                    return False
            self.chain.append(tx, request_id, "execution_lost", actor=None, platform=None, at=at,
                              args_hash=FROM_REQUEST, detail=detail)  # fmt: skip
            # Every card edited (again): settled_status set even on one not yet settled is what tells the bus
            # to read this note when it edits it (a first settle after a decision never reads it).
            tx.run(
                "UPDATE approval_cards SET settled_at = NULL, retry_at = NULL, settle_attempts = 0,"
                " settle_claimed_by = NULL, settled_status = 'approved' WHERE request_id = ?",
                (request_id,),
            )
            return True

        return await self._write(op)

    async def execution_note(self, request_id: str) -> str | None:
        """What became of an approved call that a stopped process never ran (``execution_lost``'s detail), or None."""
        row = await self.tables.one(
            "SELECT detail FROM approval_events WHERE request_id = ? AND event = 'execution_lost'"
            " ORDER BY seq DESC LIMIT 1",
            (request_id,),
        )
        return None if row is None or row[0] is None else str(row[0])

    async def decided(self) -> list[ApprovalRequest]:
        """Every request with an outcome that can be read, in the order they were decided."""
        readable, _ = await self.decided_rows()
        return readable

    async def decided_rows(
        self, after: str | None = None, *, limit: int | None = None
    ) -> tuple[list[ApprovalRequest], list[UnreadableRequest]]:
        """Every request with an outcome, in the order they were decided, and the rows that cannot be read (named
        by id). With ``after`` (an id, "" for the first) and ``limit``: a page of them by id instead, what ``kazma
        doctor`` checks the seals of a page at a time (the next from :meth:`page_end`)."""
        if after is None:
            rows, unreadable = await self._request_rows_and_unreadable(
                _COLUMNS, "FROM approval_requests WHERE status != 'pending' ORDER BY decided_at"
            )
        else:
            page = "" if limit is None else f" LIMIT {int(limit)}"
            rest = f"FROM approval_requests WHERE status != 'pending' AND id > ? ORDER BY id{page}"
            rows, unreadable = await self._request_rows_and_unreadable(_COLUMNS, rest, (after,))
            if any(isinstance(value, bytes) for row in rows for value in row):
                # A BLOB where Kazma writes text (an id, say) reads without a decoding error, so only as bytes:
                # a page of such rows, without a text that fails to decode beside them, is split here.
                rows, blobs = _split_unreadable(_COLUMNS, rows)
                unreadable += blobs
        return [_row_to_request(row) for row in rows], unreadable

    def page_end(self, rows: Sequence[ApprovalRequest], unreadable: Sequence[UnreadableRequest]) -> str | None:
        """Where the page of :meth:`decided_rows` that gave ``rows`` and ``unreadable`` ends: its last id in the
        database's order (None: nothing to go on from). PostgreSQL keeps no text that is not UTF-8, so its pages
        are all readable, in its collation's order; SQLite's compares texts as bytes, as Python does. An id that
        is not text at all (SQLite sorts it after every text, so the page holding it holds the last of them) ends
        the walk."""
        if not unreadable:
            return rows[-1].id if rows else None
        if any("id" in u.columns for u in unreadable):
            return None  # the texts all came before it: what is left is more such ids, already read
        texts = [r.id for r in rows] + [u.request_id for u in unreadable]
        return max(texts) if texts else None

    async def sealed_since(self) -> float | None:
        """When this store began sealing outcomes (approvals schema v7 applied), or None (not yet)."""
        row = await self.tables.one("SELECT applied_at FROM kazma_schema WHERE component = 'approvals' AND version = 7")
        return None if row is None else float(row[0])

    async def orphans(self, live: Collection[str] | None) -> list[ApprovalRequest]:
        """Pending requests whose waiter is gone: every non-durable one and every one an open ``/mcp`` call
        held (``Waits.CONNECTION``), when ``live`` is None (this is the only process); among replicas, those
        whose owner is a replica not in ``live``. A request with no owner was opened by a process that is no
        replica (a CLI command, an older release): nobody can tell whether it still waits, so among replicas
        only its deadline ends it."""
        rows = await self._request_rows(
            _COLUMNS + ", owner",
            "FROM approval_requests WHERE status = 'pending'"
            " AND (durable = 0 OR waits = 'connection') ORDER BY created_at",
        )
        return [_row_to_request(row[:-1]) for row in rows if _gone(row[-1], live)]

    async def silent(self, before: float) -> list[str]:
        """Pending requests whose polling asker has not asked for its answer since ``before``."""
        # Whole rows, read as the lists read them: an unreadable one is named and left out, since its withdrawal
        # would fail at every sweep, and the readable ones after it with it.
        rows = await self._request_rows(
            _COLUMNS,
            "FROM approval_requests WHERE status = 'pending' AND waits = 'polling'"
            " AND (last_seen IS NULL OR last_seen < ?) ORDER BY created_at",
            (before,),
        )
        return [str(r[0]) for r in rows]

    async def seen(self, request_id: str, *, every: float) -> bool:
        """Its asker asked for the answer now: ``last_seen`` moves on, at most once every ``every`` seconds
        (whichever replica it asked). True when this call wrote it."""
        now = self.clock()
        return (
            await self._write(
                lambda tx: tx.run(
                    "UPDATE approval_requests SET last_seen = ? WHERE id = ? AND status = 'pending'"
                    " AND (last_seen IS NULL OR last_seen <= ?)",
                    (now, request_id, now - every),
                )
            )
            == 1
        )

    async def overdue(self) -> list[str]:
        """Pending requests past their deadline. Whole rows, read as the lists read them: an unreadable one is
        named and left out, since its timeout would fail at every sweep, and the readable ones after it with it."""
        rows = await self._request_rows(
            _COLUMNS, "FROM approval_requests WHERE status = 'pending' AND deadline <= ?", (self.clock(),)
        )
        return [str(r[0]) for r in rows]

    async def record_card(
        self,
        request_id: str,
        platform: str,
        chat: str,
        message_id: str,
        *,
        whole: bool = True,
        ended: bool = False,
        bound_to: str | None = None,
        reposted: bool = False,
    ) -> None:
        """Record a posted card. ``ended``: found after its request ended (Discord's nonce gives back a post a
        stopped process never recorded): it is marked the way ``execution_lost`` marks every card, so its edit
        reads that note too. ``bound_to``: the person a card in a direct message was sent to (only they press it).
        ``reposted``: the card says it was posted again (every later edit of it says so too)."""
        now = self.clock()
        detail = f"{chat}/{message_id}" + ("" if whole else " (not the whole call)")
        if bound_to is not None:
            detail += f" (a direct message to {bound_to})"
        if reposted:
            detail += " (posted again, marked so)"

        def op(tx: Tx) -> None:
            if ended:
                tx.send(_INSERT_FOUND_CARD, (request_id, platform, chat, message_id, now, int(whole), bound_to,
                                            request_id))  # fmt: skip
            else:
                tx.send(
                    "INSERT INTO approval_cards (request_id, platform, chat, message_id, posted_at, whole, bound_to,"
                    " reposted) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (request_id, platform, chat, message_id, now, int(whole), bound_to, int(reposted)),
                )
            self.chain.append(
                tx,
                request_id,
                "card_posted",
                actor=None,
                platform=platform,
                at=now,
                args_hash=FROM_REQUEST,
                detail=detail,
            )

        await self._write(op)

    async def record_stale_card(self, request_id: str, platform: str, chat: str, message_id: str) -> FoundCard:
        """A card message of ``request_id`` nobody recorded (a crash took its post's answer), found when someone
        pressed it: recorded so the bus edits it to the outcome, but only once the request has ended (checked in
        the same write), so a card found this way can never carry a decision. Otherwise nothing is written: the
        request is pending or unknown, or the message is recorded as another request's card."""
        now = self.clock()

        def op(tx: Tx) -> FoundCard:
            ended = tx.one("SELECT 1 FROM approval_requests WHERE id = ? AND status <> 'pending'", (request_id,))
            if ended is None:
                return FoundCard.NOT_ENDED
            # A message recorded as another request's card is that request's: data naming this one on it is
            # forged (a platform that lets a client send any data, as Telegram does), never a card lost here.
            other = tx.one(
                "SELECT request_id FROM approval_cards WHERE platform = ? AND chat = ? AND message_id = ?"
                " AND request_id <> ? LIMIT 1",
                (platform, chat, message_id, request_id),
            )
            if other is not None:
                return FoundCard.ANOTHERS
            tx.run(_INSERT_FOUND_CARD, (request_id, platform, chat, message_id, now, 1, None, request_id))
            self.chain.append(
                tx,
                request_id,
                "card_found",
                actor=None,
                platform=platform,
                at=now,
                args_hash=FROM_REQUEST,
                detail=f"{chat}/{message_id}: pressed after the request ended, its post never recorded",
            )
            return FoundCard.RECORDED

        return await self._write(op)

    async def cards(self, request_id: str) -> list[PostedCard]:
        return [_card(r) for r in await self.tables.all(_CARDS_OF, (request_id,))]

    async def cards_to_settle(self, request_id: str, platform: str) -> list[PostedCard]:
        """``request_id``'s cards on ``platform`` that still show buttons although it has an outcome."""
        rows = await self.tables.all(
            "SELECT c.request_id, c.platform, c.chat, c.message_id, c.posted_at, c.settled_at, c.settled_status,"
            " c.whole, c.bound_to, c.reposted FROM approval_cards c JOIN approval_requests r ON r.id = c.request_id"
            " WHERE c.request_id = ? AND c.platform = ? AND c.settled_at IS NULL AND r.status != 'pending'"
            " ORDER BY c.posted_at",
            (request_id, platform),
        )
        return [_card(r) for r in rows]

    async def unsettled_cards(self, platform: str | None = None, *, due_by: float | None = None) -> list[PostedCard]:
        """Cards of requests that have an outcome but still show buttons: on ``platform`` (None: every
        platform), and with ``due_by`` only those whose retry time, if any, has come by then."""
        clauses = ["c.settled_at IS NULL", "r.status != 'pending'"]
        params: list[Any] = []
        if platform is not None:
            clauses.append("c.platform = ?")
            params.append(platform)
        if due_by is not None:
            clauses.append("(c.retry_at IS NULL OR c.retry_at <= ?)")
            params.append(due_by)
        rows = await self.tables.all(
            "SELECT c.request_id, c.platform, c.chat, c.message_id, c.posted_at, c.settled_at, c.settled_status,"  # noqa: S608
            " c.whole, c.bound_to, c.reposted FROM approval_cards c JOIN approval_requests r ON r.id = c.request_id"
            f" WHERE {' AND '.join(clauses)} ORDER BY r.decided_at",
            params,
        )
        return [_card(r) for r in rows]

    async def next_settle_retry(self, platform: str) -> float | None:
        """When the earliest card edit waiting out a failure on ``platform`` is due again, or None."""
        row = await self.tables.one(
            "SELECT MIN(retry_at) FROM approval_cards WHERE settled_at IS NULL AND platform = ?"
            " AND retry_at IS NOT NULL",
            (platform,),
        )
        return None if row is None or row[0] is None else float(row[0])

    async def settle_failed(self, card: PostedCard, retry_in: float) -> int:
        """A card edit failed and is tried again in ``retry_in`` seconds; how many times it has failed now."""
        retry_at = self.clock() + retry_in

        def op(tx: Tx) -> int:
            return _settle_failed(tx, card, retry_at)

        return await self._write(op)

    async def claim_settle(self, card: PostedCard, lease: float) -> bool:
        """Take ``card``'s edit for ``lease`` seconds: True when this process may edit it now.

        The claim is the row's ``retry_at`` moved ahead, so the other replicas neither edit it nor list it
        in a scan until the lease runs out (the edit's outcome replaces it: settled, or a backoff). False:
        settled already, claimed by another replica, or waiting out a failed edit.
        """
        now = self.clock()

        def op(tx: Tx) -> int:
            return tx.run(
                "UPDATE approval_cards SET retry_at = ?, settle_claimed_by = ? WHERE request_id = ? AND platform = ?"
                " AND chat = ? AND message_id = ? AND settled_at IS NULL AND (retry_at IS NULL OR retry_at <= ?)",
                (now + lease, self.replica or LOCAL, card.request_id, card.platform, card.chat, card.message_id, now),
            )

        return await self._write(op) == 1

    async def settle_refused(self, card: PostedCard) -> int:
        """The platform refused the token ``card``'s edit carried (Telegram's 401): counted as a failed edit (its
        count stretches the refusing process's wait), yet due again now, and every other replica is told to edit
        it at once. How many times it has failed now.

        The token refused is this process's: during a rolling token change another replica's works. A refusal that
        held the shared rows by a backoff held that replica's edits too, so decided cards kept live buttons; the
        refusing process waits in its own memory instead (the bus worker's hold)."""

        def op(tx: Tx) -> int:
            failed = _settle_failed(tx, card, None)  # due at once
            tx.notify(DECIDED_CHANNEL, card.request_id)  # each replica edits a decided request's cards at once
            return failed

        return await self._write(op)

    async def settles_due_now(self, platforms: Sequence[str]) -> int:
        """Every card edit on ``platforms`` waiting to be tried again (none claimed) is due now; how many. For
        platforms that have just started (see :meth:`kazma.adapters.outbox.Outbox.due_now`)."""
        now = self.clock()
        marks = ", ".join("?" for _ in platforms)

        def op(tx: Tx) -> int:
            return tx.run(
                f"UPDATE approval_cards SET retry_at = NULL WHERE platform IN ({marks})"  # noqa: S608
                " AND settled_at IS NULL AND settle_claimed_by IS NULL AND retry_at > ?",
                (*platforms, now),
            )

        return await self._write(op)

    async def release_settle_claims(self, live: Collection[str]) -> int:
        """Card edits claimed by replicas not in ``live`` are due now; how many were released."""
        gone, names = held_by_gone("settle_claimed_by", live)

        def op(tx: Tx) -> int:
            return tx.run(
                "UPDATE approval_cards SET retry_at = NULL, settle_claimed_by = NULL"  # noqa: S608
                f" WHERE settled_at IS NULL AND {gone}",
                names,
            )

        return await self._write(op)

    async def settle_attempts(self, card: PostedCard) -> int:
        row = await self.tables.one(
            "SELECT settle_attempts FROM approval_cards WHERE request_id = ? AND platform = ? AND chat = ?"
            " AND message_id = ?",
            (card.request_id, card.platform, card.chat, card.message_id),
        )
        return 0 if row is None else int(row[0])

    async def mark_card_settled(self, card: PostedCard, status: Status, *, ride: float = 0.0) -> None:
        """The card shows ``status``: it is not edited again. ``ride`` > 0: committed with the next group of writes,
        or alone after that many seconds."""
        now = self.clock()
        detail = f"{card.chat}/{card.message_id} -> {status.value}"

        def op(tx: Tx) -> None:
            settled = tx.run(
                "UPDATE approval_cards SET settled_at = ?, settled_status = ?, retry_at = NULL,"
                " settle_claimed_by = NULL WHERE request_id = ? AND platform = ? AND chat = ? AND message_id = ?"
                " AND settled_at IS NULL",
                (now, status.value, card.request_id, card.platform, card.chat, card.message_id),
            )
            if settled == 1:
                self.chain.append(
                    tx, card.request_id, "card_settled", actor=None, platform=card.platform, at=now,
                    args_hash=FROM_REQUEST, detail=detail,
                )  # fmt: skip

        await self._write(op, ride=ride)


def _settle_failed(tx: Tx, card: PostedCard, retry_at: float | None) -> int:
    """``card``'s edit failed once more, unclaimed, due again at ``retry_at`` (None: now); how many times now."""
    row = tx.one(
        "UPDATE approval_cards SET settle_attempts = settle_attempts + 1, retry_at = ?,"
        " settle_claimed_by = NULL WHERE request_id = ? AND platform = ? AND chat = ? AND message_id = ?"
        " RETURNING settle_attempts",
        (retry_at, card.request_id, card.platform, card.chat, card.message_id),
    )
    return 0 if row is None else int(row[0])


def decided_detail(status: Status, reason: str | None) -> str:
    """The ``decided`` audit row's detail: the outcome, then the decider's reason if any."""
    return status.value if not reason else f"{status.value}: {reason}"


def _stopped(
    rules: Rules,
    admit: Admission | None,
    card: CardCheck | None,
    rows: Sequence[Sequence[Any]],
    on: str | None,
    presser: str,
) -> Pressed | None:
    """What a press comes to before its compare-and-set when it goes no further (nothing written), or None: its
    admission held to ``rules``, then the card it came from held to the request's cards in ``rows`` (read by the
    press's first statement: a row of _PRESS_CARDS when ``on`` is None, else of _PRESS_ALL_CARDS, whose cards on
    platform ``on`` are the press's). One function for a press alone and for presses decided together, so the two
    paths cannot come to differ."""
    if admit is not None:
        refused = admit(rules)
        if refused is not None:
            return Pressed(None, False, None, refused=refused)
    if card is None:
        return None
    # Only a card of this request on that platform, at the place pressed, whole for an Approve.
    if on is None:
        cards = [tuple(r[_PRESS_CARD_AT:]) for r in rows if r[_PRESS_CARD_AT] is not None]
    else:
        cards = [tuple(r[_PRESS_CARD_AT + 1 :]) for r in rows if r[_PRESS_CARD_AT] == on]
    problem = _card_problem(cards, card, presser)
    return None if problem is None else Pressed(problem, False, None)


def _card_problem(cards: list[tuple[Any, ...]], check: CardCheck, presser: str) -> str | None:
    """Why a press is not from one of ``cards`` ((chat, message id, whole, bound to) on the press's platform), or
    None. ``presser``: the person pressing (their identity when nobody's), held to a card bound to someone."""
    if not cards:
        # Only a press that says where it was is held to a card; the platform may say nothing.
        located = check.chat is not None or check.message_id is not None
        return CardProblem.NOT_RECORDED if located else None
    here = [
        r
        for r in cards
        if (check.chat is None or r[0] == check.chat) and (check.message_id is None or r[1] == check.message_id)
    ]
    if not here:
        return CardProblem.NOT_HERE
    # A card in a direct message is its person's: a press on it by anyone else (forged button data, the card
    # forwarded) decides nothing. A press the platform did not place stands only if one card it could be
    # from is not someone else's.
    here = [r for r in here if r[3] is None or r[3] == presser]
    if not here:
        return CardProblem.NOT_YOURS
    if check.needs_whole and not all(r[2] for r in here):
        return CardProblem.CUT
    return None


def _reviewer_now(row: Sequence[Any], person_of: PersonOf | None) -> str:
    """Who made the review ``row`` (reviewer, actor, decision) by the configuration running now: the person its
    identity belongs to, else who it was recorded as."""
    found = None if person_of is None else person_of(str(row[1]))
    return found if found is not None else str(row[0])


def _same_reviewer(
    row: Sequence[Any], reviewer: str, actor: str, person: str | None, person_of: PersonOf | None
) -> bool:
    """Whether the review ``row`` (reviewer, actor, decision) is by whoever presses now (``reviewer``: their person,
    or their identity when nobody's): recorded as them or made by this identity, or by an identity that is their
    person's now (linked to them after it reviewed)."""
    if row[0] == reviewer or row[1] == actor:
        return True
    return person is not None and person_of is not None and person_of(str(row[1])) == person


def _gone(owner: str | None, live: Collection[str] | None) -> bool:
    """Whether a request's waiter is gone: the only process restarted (``live`` None), or its replica left."""
    return live is None or (owner is not None and owner not in live)


def _read_decided(tx: Tx, items: list[tuple[str, Decided]]) -> None:
    """The decided requests of a transaction and their cards, read at its end (a deferred flush: after every
    operation of the group, before the commit)."""
    for request_id, decided in items:
        row = tx.one(_REQUEST_BY_ID, (request_id,))
        if row is None:
            continue
        decided.cards = [_card(r) for r in tx.all(_CARDS_OF, (request_id,))]
        decided.request = _row_to_request(row)


def _card(row: Iterable[Any]) -> PostedCard:
    request_id, platform, chat, message_id, posted, settled, status, whole, bound_to, reposted = tuple(row)
    return PostedCard(
        request_id, platform, chat, message_id, datetime.fromtimestamp(posted, UTC), ts(settled), status, bool(whole),
        bound_to, bool(reposted),
    )  # fmt: skip
