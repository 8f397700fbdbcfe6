"""The audit chain: every audit event linked to the one before it by SHA-256, and signed at every commit.

An event's chain hash is ``SHA-256(canonical JSON of [domain, previous event's
chain hash, request id, event, actor, platform, at, arguments hash, detail])``;
the first event follows :data:`GENESIS`. Each row keeps its own ``prev_hash`` and
``chain_hash``, so a verifier can say which event is wrong and how: a row that no
longer hashes to its own chain hash was *changed*; a row whose ``prev_hash`` is not
the chain hash of the row before it sits in the wrong place (*reordered*), follows a
row that is not in the chain (*inserted*), or follows one that is gone (*missing*).
The sequence number is not hashed: the links fix the order, and the signed
checkpoints (:mod:`kazma.approvals.checkpoints`) bind sequence numbers to heads.

**How appends are ordered.** An operation does not write its events: it hands
them to the end of its transaction (``Tx.defer``). There, once per transaction,
:meth:`AuditChain._flush` takes the chain's order (on SQLite the write lock the
transaction already holds; on PostgreSQL a transaction-scoped advisory lock, held
from that moment to the commit), reads the head, numbers the events after it,
hashes them and inserts them, the last one carrying the transaction's commit seal
(:meth:`~kazma.approvals.checkpoints.AuditSigner.commit_seal`). Appends of several
replicas are therefore serialised for the last few statements of their
transactions only, and a chain never forks: sequence numbers follow commit order.
The Ed25519 checkpoint over them follows within a fiftieth of a second, by a pass of its own
that rides in the next group of writes (:mod:`kazma.approvals.checkpointer`): a
signature costs more than the rest of the chain together, and one may cover many
transactions. An event's hash is the one cost paid per event: :func:`event_hash`
writes json's canonical text itself (json's escaping, ``repr`` of the time), the
same bytes at about half json's cost.

**The one-time chaining.** Events written before the chain existed (approvals
schema v8 and older) have no chain fields. ``kazma run`` (or else the first
transaction that appends after the upgrade) hashes them all in sequence order as
if they had been chained, and signs one ``history`` checkpoint over them. A
verifier recomputes them the same way; it can tell that one of them changed after
that moment, but not which one, and it cannot tell anything about them before it.

**Rows written around Kazma.** A transaction that finds rows without chain fields
after the chain began chains on after them as a verifier computes them: the chain
stays one line, and those rows, vouched for by no commit seal, are never signed (a
verifier names them). A checkpoint that signs a sequence number past the last row
(events removed) makes the next event go after the highest number ever signed, so
no number is ever given twice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Final, NamedTuple

import structlog

from kazma.approvals import pg_press
from kazma.approvals.checkpoints import FIELDS as CHECKPOINT_FIELDS
from kazma.approvals.checkpoints import HISTORY, AuditSigner, Checkpoint, checkpoint_of
from kazma.config.metrics import count_failure
from kazma.config.store.backend import Tx

log = structlog.get_logger("kazma.approvals.chain")

GENESIS: Final = "0" * 64  # what the first event of a chain follows
_DOMAIN: Final = "kazma-audit-v1"
# Compact JSON, UTF-8 as is, no NaN: an event's canonical form (what ``json.dumps`` with these options writes).
_CANONICAL: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_quote: Final = encode_basestring  # json's escaping of one text (the C function its encoder calls)
_DOMAIN_TEXT: Final = _quote(_DOMAIN)
_NULL: Final = "null"
# An empty SHA-256, copied for each event: hashlib.sha256() looks the digest up by name in OpenSSL on every call
# (about a third of a short text's hashing).
_SHA256: Final = hashlib.sha256()
# Taken by the transaction that appends, from its flush to its commit (PostgreSQL; SQLite has its write lock).
CHAIN_LOCK: Final = 0x6B617A6D61_0029  # "kazma", issue 29
# SQLSTATE of a statement sent on a guess that found otherwise (kazma.config.store.postgres.STALE_GUESS).
_STALE_GUESS: Final = "KZ001"
# The decision of a request, as the compare-and-set writes it: ``decided`` for a person, else the outcome.
DECISION_EVENTS: Final = ("decided", "timeout", "cancelled")

# ``person`` last: the person who owns ``actor`` (people:), hashed only when there is one (see event_hash).
EVENT_COLUMNS: Final = "seq, request_id, event, actor, platform, at, args_hash, detail, prev_hash, chain_hash, person"
CHECKPOINT_COLUMNS: Final = "kind, first_seq, seq, head, at, key_id, signature"
_INSERT_EVENT_ROWS = f"INSERT INTO approval_events ({EVENT_COLUMNS}, commit_seal) VALUES"
_ROW_MARKS = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_INSERT_EVENT = f"{_INSERT_EVENT_ROWS} {_ROW_MARKS}"
_ONE_INSERT_MAX = 16  # a transaction's event rows written by one INSERT (all or none), at most; more go row by row


@functools.lru_cache(maxsize=_ONE_INSERT_MAX)
def _insert_events(count: int) -> str:
    """One INSERT of ``count`` event rows: they are written all or none."""
    return f"{_INSERT_EVENT_ROWS} {', '.join([_ROW_MARKS] * count)}"


def _send_rows(tx: Tx, rows: list[tuple[Any, ...]]) -> None:
    """The event rows inserted: in one statement (all or none) up to :data:`_ONE_INSERT_MAX` of them."""
    if len(rows) == 1:
        tx.send(_INSERT_EVENT, rows[0])
    elif len(rows) <= _ONE_INSERT_MAX:
        tx.send(_insert_events(len(rows)), [value for row in rows for value in row])
    else:
        tx.run_many(_INSERT_EVENT, rows)


_PG_SEQUENCE = "approval_events_seq_seq"  # the identity of approval_events.seq on PostgreSQL
_INSERT_CHECKPOINT = f"INSERT INTO audit_checkpoints ({CHECKPOINT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
_HEAD_SQLITE = (
    "SELECT (SELECT seq FROM approval_events ORDER BY seq DESC LIMIT 1),"
    " (SELECT chain_hash FROM approval_events ORDER BY seq DESC LIMIT 1),"
    " (SELECT seq FROM audit_checkpoints ORDER BY seq DESC LIMIT 1)"
)
# The checkpointer's read (ensure_history): the head and the last checkpoint (seq, head, time) in one statement.
_HEAD_AND_CHECKPOINT_SQLITE = (
    "SELECT e.seq, e.chain_hash, c.seq, c.head, c.at FROM (SELECT 1)"
    " LEFT JOIN (SELECT seq, chain_hash FROM approval_events ORDER BY seq DESC LIMIT 1) e"
    " LEFT JOIN (SELECT seq, head, at FROM audit_checkpoints ORDER BY seq DESC LIMIT 1) c"
)
LAST_CHECKPOINT: Final = "SELECT seq, head, at FROM audit_checkpoints ORDER BY seq DESC LIMIT 1"
_RUNS_KEPT: Final = 4096  # committed runs remembered for the checkpointer at most (then it reads the events back)
# Takes CHAIN_LOCK (waiting as long as it takes: the holder waits for nobody), then reads the head.
_HEAD_POSTGRES = "SELECT last_seq, last_hash, checkpoint_seq FROM kazma_audit_head(?)"
# The same and the last checkpoint's head and time. The join reads with the statement's snapshot, taken before the
# lock: a checkpoint another replica committed while this one waited is seen by the function (its seq) but not by
# the join (no head), and is then read on its own (ensure_history).
_HEAD_AND_CHECKPOINT_POSTGRES = (
    "SELECT h.last_seq, h.last_hash, h.checkpoint_seq, c.head, c.at FROM kazma_audit_head(?) h"
    " LEFT JOIN audit_checkpoints c ON c.seq = h.checkpoint_seq"
)


class _FromRequest:
    """The arguments hash of an event, read from its request's row when the chain writes it."""

    def __repr__(self) -> str:
        return "FROM_REQUEST"


FROM_REQUEST: Final = _FromRequest()


def event_hash(
    prev_hash: str,
    request_id: str | None,
    event: str,
    actor: str | None,
    platform: str | None,
    at: float,
    args_hash: str | None,
    detail: str | None,
    person: str | None = None,
) -> str:
    """The chain hash of one event after ``prev_hash``. The person who owns the actor, when there is one, is one
    more field: a person added to a row, removed from it or changed changes its hash all the same."""
    if type(at) is float and math.isfinite(at):
        # What _CANONICAL writes for these fields, byte for byte, without building an encoder per call (json's
        # C encoder is made anew on every encode, with a Python callback for the float): about half the cost.
        # Text is escaped by json's own function; a field that is not text, or an ``at`` that is not a finite
        # float (an int, NaN), takes json's own path: written its way, or refused.
        try:
            text = _written(
                _NULL if prev_hash is None else _quote(prev_hash), _NULL if request_id is None else _quote(request_id),
                event, actor, platform, repr(at), _NULL if args_hash is None else _quote(args_hash), detail, person,
            )  # fmt: skip
        except TypeError:
            text = _canonical(prev_hash, request_id, event, actor, platform, at, args_hash, detail, person)
    else:
        text = _canonical(prev_hash, request_id, event, actor, platform, at, args_hash, detail, person)
    digest = _SHA256.copy()
    digest.update(text.encode("utf-8"))
    return digest.hexdigest()


def _written(
    prev_text: str,
    id_text: str,
    event: str,
    actor: str | None,
    platform: str | None,
    at_text: str,
    digest_text: str,
    detail: str | None,
    person: str | None,
) -> str:
    """What _CANONICAL writes for an event, given its previous hash, request id, time and arguments hash already
    written (the fields a transaction's events mostly share: AuditChain._rows writes them once). TypeError for a
    field that is not text: the caller takes json's own path."""
    return (
        f"[{_DOMAIN_TEXT},{prev_text},{id_text},{_quote(event)},"
        f"{_NULL if actor is None else _quote(actor)},{_NULL if platform is None else _quote(platform)},"
        f"{at_text},{digest_text},{_NULL if detail is None else _quote(detail)}"
        f"{']' if person is None else f',{_quote(person)}]'}"
    )


def _canonical(*fields: Any) -> str:
    """json's canonical text of an event's hashed fields (``person`` only when there is one)."""
    listed = [_DOMAIN, *fields]
    if listed[-1] is None:
        listed.pop()
    return _CANONICAL.encode(listed)


@dataclass(frozen=True)
class ChainedEvent:
    """One row of the audit log with its chain fields (None on a row written before the chain began)."""

    seq: int
    request_id: str | None
    event: str
    actor: str | None
    platform: str | None
    at: float
    args_hash: str | None
    detail: str | None
    prev_hash: str | None
    chain_hash: str | None
    person: str | None = None

    def hash_after(self, prev_hash: str) -> str:
        """This event's chain hash were it to follow ``prev_hash``."""
        return event_hash(
            prev_hash, self.request_id, self.event, self.actor, self.platform, self.at, self.args_hash, self.detail,
            self.person,
        )  # fmt: skip

    @classmethod
    def of_row(cls, row: Sequence[Any]) -> ChainedEvent:
        seq, request_id, event, actor, platform, at, digest, detail, prev, chain, person = tuple(row)
        try:
            when = float(at)
        except (TypeError, ValueError):  # a time Kazma never writes (text, by hand): it hashes to nothing
            when = math.nan
        return cls(int(seq), request_id, str(event), actor, platform, when, digest, detail, prev, chain, person)


def checkpoint_of_row(row: Sequence[Any]) -> Checkpoint:
    """A checkpoint row; one changed around Kazma into what it never writes is read all the same (see
    checkpoint_of), so it is named by the verifier, exported and sunk, never a stop for any of them."""
    return checkpoint_of(dict(zip(CHECKPOINT_FIELDS, row, strict=True)))


class _Pending(NamedTuple):
    """An event handed to the end of its transaction (a tuple: made once per event, on every operation's path)."""

    request_id: str | None
    event: str
    actor: str | None
    platform: str | None
    at: float
    args_hash: str | _FromRequest | None
    detail: str | None
    person: str | None


_new_pending: Final = tuple.__new__


class AuditChain:
    """Appends a store's audit events to the chain, at the end of the transaction that records them."""

    def __init__(
        self, *, postgres: bool, signer: AuditSigner | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.postgres = postgres
        self.signer = signer  # None: no commit seals, no signatures (a store opened without the audit key)
        self.clock = clock
        # Set by a transaction that appended (in the writer's thread), read once its commit was answered.
        self.appended = False
        # What this chain appended in transactions that committed, since the last checkpoint it made: each run
        # (first seq, last seq, head) by the hash it followed. A checkpointer that finds every event since the
        # last checkpoint here signs the head this chain computed instead of reading the events back.
        self._committed_runs: dict[str, tuple[int, int, str]] = {}
        # On SQLite (one writer) each commit's run usually follows the one before it: it extends that run rather
        # than adding one, so a pass walks one run, not one per transaction since the last checkpoint. Never a run
        # a checkpoint ends in (the next pass looks its runs up from that checkpoint's head).
        self._tail: str | None = None  # the key of the run appended last
        self._forgotten = 0  # the highest seq a checkpoint covered (forget_through)
        # The run the transaction being written appended, until it commits: (its Tx, the hash it followed, first
        # seq, last seq, head). A pass in that same transaction (a decision signed in its own commit) counts it as
        # this chain's own: the checkpoint commits with these events or not at all. Without it, that pass read every
        # event since the last checkpoint back and hashed it again (nearly every event, once).
        self._open_run: tuple[Tx, str, int, int, str] | None = None
        # The head this chain last committed (seq, hash): on PostgreSQL the next append is hashed after it before
        # the head is read, and inserted in the same statement when it still is the head (pg_press.append).
        self._last_head: tuple[int, str] | None = None
        self._guesses_hold = False  # the last append found the head it expected (see _link_postgres)

    def append(
        self,
        tx: Tx,
        request_id: str | None,
        event: str,
        *,
        actor: str | None,
        at: float,
        args_hash: str | _FromRequest | None,
        platform: str | None = None,
        detail: str | None = None,
        person: str | None = None,
    ) -> None:
        """One audit event, written with the transaction ``tx`` commits (and only if it commits)."""
        # tuple.__new__ directly: a NamedTuple's own __new__ is one more Python call on every operation's path.
        tx.defer(
            self._flush, _new_pending(_Pending, (request_id, event, actor, platform, at, args_hash, detail, person))
        )

    def start(self, tx: Tx) -> None:
        """Chain what was there before the chain began, if that is still to be done (no event of its own)."""
        tx.defer(self._flush, None)

    def ensure_history(self, tx: Tx) -> tuple[str, int, tuple[int, str, float] | None]:
        """Take the chain's order in ``tx`` now, and chain what was there before the chain began if still due.
        Returns the head (the hash the next event follows, the sequence number it comes after) and the last
        checkpoint (seq, head, time), read in the same statement (one round trip on PostgreSQL, under the lock)."""
        if self.postgres:
            found = tx.one(_HEAD_AND_CHECKPOINT_POSTGRES, (CHAIN_LOCK,))
        else:
            found = tx.one(_HEAD_AND_CHECKPOINT_SQLITE)
        last_seq, last_hash, signed_seq, signed_head, signed_at = found
        prev, seq = self._head(tx, last_seq, last_hash, signed_seq)
        if last_hash is None or (signed_seq is not None and signed_head is None):
            # The one-time chaining may just have written a checkpoint, or the join did not see the newest one.
            last = tx.one(LAST_CHECKPOINT)
            return prev, seq, None if last is None else (int(last[0]), str(last[1]), float(last[2]))
        return prev, seq, None if signed_seq is None else (int(signed_seq), str(signed_head), float(signed_at))

    def appended_in(self, tx: Tx) -> tuple[int, int] | None:
        """(first seq, last seq) of the events ``tx`` appended, once its end of transaction chained them and until it
        commits (SQLite); None when it appended none, or on PostgreSQL."""
        run = self._open_run
        return None if run is None or run[0] is not tx else (run[2], run[3])

    @property
    def last_committed_seq(self) -> int | None:
        """The sequence number of the last event this chain appended in a transaction that committed."""
        return None if self._last_head is None else self._last_head[0]

    @property
    def last_committed_head(self) -> tuple[int, str] | None:
        """(seq, hash) of the last event this chain appended in a transaction that committed."""
        return self._last_head

    def appended_all(self, after: int, prev: str, seq: int, head: str, tx: Tx | None = None) -> bool:
        """Whether the events after ``after`` (which follow ``prev``) up to ``seq`` (whose hash is ``head``) are all
        this chain's own appends, each in a transaction that committed, or in ``tx`` itself (what is signed in it
        commits with them). Called holding the chain's order."""
        at, link = after, prev
        open_run = self._open_run
        while at < seq:
            run = self._committed_runs.get(link)
            if run is None and open_run is not None and open_run[0] is tx and open_run[1] == link:
                run = open_run[2:]
            if run is None or run[0] != at + 1:
                return False
            at, link = run[1], run[2]
        return at == seq and link == head

    def forget_through(self, seq: int) -> None:
        """A checkpoint covers everything up to ``seq``: its runs are no longer needed."""
        self._forgotten = max(self._forgotten, seq)
        for link in [k for k, run in self._committed_runs.items() if run[1] <= seq]:
            del self._committed_runs[link]

    def _committed(self, prev: str, first: int, last: int, head: str, held: bool = False) -> None:
        self._open_run = None
        self._last_head = (last, head)
        self._guesses_hold = held
        runs, tail = self._committed_runs, self._tail
        if tail is not None and not self.postgres:
            run = runs.get(tail)
            if run is not None and run[2] == prev and run[1] + 1 == first and run[1] > self._forgotten:
                runs[tail] = (run[0], last, head)
                return
        if len(runs) >= _RUNS_KEPT:  # nobody signs (no checkpointer here): keep memory bounded
            runs.clear()
        runs[prev] = (first, last, head)
        self._tail = prev

    # -- the end of the transaction ---------------------------------------------------------------

    def _flush(self, tx: Tx, items: list[Any]) -> None:
        # items: each a _Pending, or None (start(): no event of its own); the list is passed on as it is when it
        # holds no None, which is every operation's case.
        events: list[_Pending] = items if None not in items else [item for item in items if item is not None]
        try:
            self._link(tx, events)
        except Exception as exc:
            if getattr(exc, "sqlstate", None) == _STALE_GUESS:
                # A statement sent on a guess earlier in the transaction (a press's, or this chain's) found
                # otherwise, and its error surfaced at this append's answer: the writer runs the group again
                # without guessing. Neither the chain's failure nor an error (3 replicas, 3 presses: one a decision).
                raise
            # The transaction is undone: the decision it held is not recorded either (it stays pending).
            count_failure("audit_chain")
            log.error("audit.append_failed", events=len(items), error=f"{type(exc).__name__}: {exc}")
            raise

    def _link(self, tx: Tx, events: list[_Pending]) -> None:
        if self.postgres and events:
            self._link_postgres(tx, events)
            return
        own = self._last_head
        if own is not None and 0 < len(events) <= _ONE_INSERT_MAX and self._appended_after_own(tx, events, own):
            return
        last_seq, last_hash, signed_seq = (
            tx.one(_HEAD_POSTGRES, (CHAIN_LOCK,)) if self.postgres else tx.one(_HEAD_SQLITE)
        )
        if last_hash is not None and (signed_seq is None or signed_seq <= last_seq):
            prev, seq = last_hash, last_seq  # the common case: a chained row is the head, nothing signed past it
        else:
            prev, seq = self._head(tx, last_seq, last_hash, signed_seq)
        if not events:
            return
        rows = self._rows(events, None, prev, seq, tx)
        _send_rows(tx, rows)
        self._appended(tx, prev, seq + 1, rows)

    def _appended_after_own(self, tx: Tx, events: list[_Pending], own: tuple[int, str]) -> bool:
        """SQLite: the events hashed after the head this chain last committed and inserted in one statement, without
        reading the head first (a statement: ~3 us hot, ~6 in the decision flow, of the ~10-18 the chain adds).
        Their numbers follow that head's, and ``seq`` is the table's primary key: if anyone else appended since
        (another process on the file, a row written around Kazma at that number), the statement fails whole, writes
        nothing, and False sends the caller to read the head. A row removed around Kazma since leaves these linked
        to what it was: the verifier names the gap, as a checkpoint signed over it would."""
        seq, head = own
        rows = self._rows(events, None, head, seq, tx)
        try:
            _send_rows(tx, rows)  # (one statement: the caller sends at most _ONE_INSERT_MAX events here)
        except Exception as exc:
            if getattr(exc, "sqlite_errorname", None) != "SQLITE_CONSTRAINT_PRIMARYKEY":
                raise
            return False
        self._appended(tx, head, seq + 1, rows)
        return True

    def _appended(self, tx: Tx, prev: str, first: int, rows: list[tuple[Any, ...]]) -> None:
        """``rows`` (from ``first``, after ``prev``) are written in ``tx``: this chain's own once it commits."""
        last, head = int(rows[-1][0]), str(rows[-1][9])
        run = self._open_run
        if run is not None and run[0] is tx and run[3] + 1 == first and run[4] == prev:
            # A second flush of the same transaction (a later round handed the chain more events): one open run
            # from the first's start, so a pass in this transaction finds all of its events its own.
            self._open_run = (tx, run[1], run[2], last, head)
        else:
            self._open_run = (tx, prev, first, last, head)
        tx.after_commit(functools.partial(self._committed, prev, first, last, head))
        self.appended = True

    def _link_postgres(self, tx: Tx, events: list[_Pending]) -> None:
        """The lock, the head and the insert in one statement when the head is the one this chain last committed
        (hashed after it beforehand); else the head that call read, the events hashed after it and inserted.

        In pipeline mode, while this chain's guesses hold (its last append found the head it expected), the call
        is sent without waiting for its answer: a head that moved fails the transaction with
        :data:`~kazma.config.store.postgres.STALE_GUESS`, and the writer runs the group again, this time asking.
        While they do not hold (another replica appended since this one did: with N replicas taking turns, every
        time), the call carries no rows: the events are hashed and sealed once, after the head it answers, not
        first after a head that is gone and then again.
        """
        hashes = self._request_hashes(tx, events)
        expect = self._last_head
        likely = expect is not None and self._guesses_hold
        guessed = self._rows(events, hashes, expect[1], expect[0], tx) if likely and expect is not None else []
        if likely and expect is not None and getattr(tx, "pipelined", False):
            self._guesses_hold = False  # until this transaction commits
            pg_press.append_or_fail(tx, CHAIN_LOCK, expect, guessed)
            rows, held = guessed, True
        else:
            appended, last_seq, last_hash, signed_seq = pg_press.append(tx, CHAIN_LOCK, expect, guessed)
            rows, held = guessed, appended
            if not appended:
                # The head this one found: when it is the one expected after all (nothing appended by anyone
                # else since), the next append guesses again.
                held = (
                    expect is not None
                    and last_seq is not None
                    and (int(last_seq), last_hash) == expect
                    and (signed_seq is None or int(signed_seq) <= expect[0])
                )
                prev, seq = self._head(tx, last_seq, last_hash, signed_seq)
                rows = self._rows(events, hashes, prev, seq, tx)
                # Also moves the identity past them: a row inserted without a seq (by hand, around Kazma) must
                # not take a number the chain gave, or the chain's next append would fail. Nobody reads its answer.
                tx.send(
                    f"WITH added AS ({_insert_events(len(rows))} RETURNING seq)"  # noqa: S608
                    f" SELECT setval('{_PG_SEQUENCE}', (SELECT max(seq) FROM added))",
                    [value for row in rows for value in row],
                )
        first, last = rows[0], rows[-1]
        tx.after_commit(
            functools.partial(self._committed, str(first[8]), int(first[0]), int(last[0]), str(last[9]), held)
        )
        self.appended = True

    @property
    def guesses_hold(self) -> bool:
        """Whether the next append on PostgreSQL is expected to be sent on its guess of the head, waiting for no
        answer (see _link_postgres): a press may then go with its group as one string of statements."""
        return self._guesses_hold

    def _rows(
        self, events: list[_Pending], hashes: dict[str | None, str | None] | None, prev: str, seq: int, tx: Tx
    ) -> list[tuple[Any, ...]]:
        """The events as rows after ``prev`` (number ``seq``), the last one sealed; ``hashes``: the arguments hashes
        of their requests, read here from ``tx`` when None and an event wants one."""
        rows: list[tuple[Any, ...]] = []
        first, last = seq + 1, seq + len(events)
        # The events of one transaction mostly share their time and their request (a request's presses in one
        # group: decided, press_lost, press_lost): each field's canonical text is written once and kept while the
        # next event has the same (repr of a time is ~10,000 instructions, more than the rest of an event's text).
        # The hash an event follows is, after the first, one this loop computed: hex, quoted as it is.
        prev_text = _quote(prev)
        at_kept: float | None = None
        at_text = id_text = digest_text = ""
        id_kept: str | None = None
        digest_kept: str | None = None
        for request_id, event, actor, platform, at, digest, detail, person in events:
            if isinstance(digest, _FromRequest):
                if hashes is None:
                    hashes = self._request_hashes(tx, events)
                digest = hashes.get(request_id)
            seq += 1
            if type(at) is float and math.isfinite(at) and type(request_id) is str and type(digest) is str:
                if at != at_kept or not at:  # (0.0 == -0.0, written apart)
                    at_kept, at_text = at, repr(at)
                if request_id != id_kept:
                    id_kept, id_text = request_id, _quote(request_id)
                if digest != digest_kept:
                    digest_kept, digest_text = digest, _quote(digest)
                try:
                    text = _written(prev_text, id_text, event, actor, platform, at_text, digest_text, detail, person)
                except TypeError:  # a field that is not text: json's own path, as event_hash takes it
                    chained = event_hash(prev, request_id, event, actor, platform, at, digest, detail, person)
                else:
                    hashed = _SHA256.copy()
                    hashed.update(text.encode("utf-8"))
                    chained = hashed.hexdigest()
            else:
                chained = event_hash(prev, request_id, event, actor, platform, at, digest, detail, person)
            # The last event carries what vouches for them all (its tuple made once, with the seal in it).
            seal = None if seq != last or self.signer is None else self.signer.commit_seal(first, seq, chained)
            rows.append((seq, request_id, event, actor, platform, at, digest, detail, prev, chained, person, seal))
            prev = chained
            prev_text = f'"{chained}"'
        return rows

    def _head(self, tx: Tx, last_seq: int | None, last_hash: str | None, signed_seq: int | None) -> tuple[str, int]:
        """(the hash the next event follows, the sequence number it comes after)."""
        if last_seq is None:
            return GENESIS, int(signed_seq or 0)
        last_seq = int(last_seq)
        after = max(last_seq, int(signed_seq or 0))
        if after > last_seq:
            count_failure("audit_events_missing")
            log.error(
                "audit.events_missing",
                last=last_seq,
                signed=after,
                detail="a checkpoint signs events past the end of the log: events were removed around Kazma",
            )
        if last_hash is not None:
            return str(last_hash), after
        if signed_seq is None and tx.one("SELECT 1 FROM approval_events WHERE chain_hash IS NOT NULL LIMIT 1") is None:
            return self._chain_history(tx), after
        return self._chain_strays(tx), after

    def _chain_history(self, tx: Tx) -> str:
        """The one-time chaining: every event written before the chain, hashed in sequence order, and one
        ``history`` checkpoint over them. Returns their head."""
        rows = tx.all(f"SELECT {EVENT_COLUMNS} FROM approval_events ORDER BY seq")  # noqa: S608
        events = [ChainedEvent.of_row(row) for row in rows]
        head = GENESIS
        for event in events:
            head = event.hash_after(head)
        self._checkpoint(tx, HISTORY, events[0].seq, events[-1].seq, head)
        log.warning(
            "audit.history_chained",
            events=len(events),
            first=events[0].seq,
            last=events[-1].seq,
            head=head,
            detail="events recorded before the audit chain, chained once and signed as they stand now",
        )
        return head

    def _chain_strays(self, tx: Tx) -> str:
        """Rows without chain fields after the chain began (inserted around Kazma): the chain goes on after them
        as a verifier will compute it; no checkpoint ever covers them."""
        anchor = tx.one(
            "SELECT seq, chain_hash FROM approval_events WHERE chain_hash IS NOT NULL ORDER BY seq DESC LIMIT 1"
        )
        start, prev = (0, GENESIS) if anchor is None else (int(anchor[0]), str(anchor[1]))
        rows = tx.all(f"SELECT {EVENT_COLUMNS} FROM approval_events WHERE seq > ? ORDER BY seq", (start,))  # noqa: S608
        for row in rows:
            event = ChainedEvent.of_row(row)
            prev = event.chain_hash if event.chain_hash is not None else event.hash_after(prev)
        count_failure("audit_unvouched_events")
        log.error(
            "audit.rows_without_chain",
            after=start,
            rows=len(rows),
            detail="rows without chain fields after the chain began: written around Kazma; they are never signed",
        )
        return prev

    def _request_hashes(self, tx: Tx, events: Iterable[_Pending]) -> dict[str | None, str | None]:
        wanted = sorted({e.request_id for e in events if e.args_hash is FROM_REQUEST and e.request_id})
        if not wanted:  # the common case: every event came with its hash
            return {}
        rows = tx.all(
            f"SELECT id, args_hash FROM approval_requests WHERE id IN ({', '.join('?' * len(wanted))})",  # noqa: S608
            wanted,
        )
        return {str(r[0]): str(r[1]) for r in rows}

    def _checkpoint(self, tx: Tx, kind: str, first_seq: int, seq: int, head: str) -> Checkpoint:
        return write_checkpoint(tx, self.signer, kind, first_seq, seq, head, self.clock())


def write_checkpoint(
    tx: Tx, signer: AuditSigner | None, kind: str, first_seq: int, seq: int, head: str, at: float
) -> Checkpoint:
    """A checkpoint over ``first_seq..seq`` at ``head``, signed when there is a signer, written in ``tx``."""
    if signer is None:
        made = Checkpoint(kind, first_seq, seq, head, at, None, None)
    else:
        made = signer.sign(kind, first_seq, seq, head, at)
    tx.send(_INSERT_CHECKPOINT, (made.kind, made.first_seq, made.seq, made.head, made.at, made.key_id, made.signature))
    return made


_UNDECODABLE: Final = "Could not decode to UTF-8"  # sqlite3's error for a text column whose bytes are not UTF-8


def undecodable(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite failing a read at a text whose bytes are not UTF-8 (SQLite keeps any bytes in a
    text column; only a write around Kazma puts such bytes there): read it again with :func:`byte_safe`."""
    return isinstance(exc, sqlite3.OperationalError) and _UNDECODABLE in str(exc)


def byte_safe(columns: str) -> str:
    """Each column as two: its value unless it is a text, and a text's bytes (SQLite's typeof and CAST)."""
    parts: list[str] = []
    for name in (column.strip() for column in columns.split(",")):
        parts.append(f"CASE WHEN typeof({name}) = 'text' THEN NULL ELSE {name} END")
        parts.append(f"CASE WHEN typeof({name}) = 'text' THEN CAST({name} AS BLOB) END")
    return ", ".join(parts)


def from_byte_safe(row: Sequence[Any]) -> tuple[Any, ...]:
    values: list[Any] = []
    for value, text in zip(row[0::2], row[1::2], strict=True):
        if text is None:
            values.append(value)
            continue
        try:
            values.append(bytes(text).decode("utf-8"))
        except UnicodeDecodeError:
            values.append(bytes(text))  # what Kazma never writes: its event hashes to nothing (see undecodable)
    return tuple(values)
