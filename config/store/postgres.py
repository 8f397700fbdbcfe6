"""The PostgreSQL store backend: pooled reads, one group-committing writer, migrations under an advisory lock.

Driver: psycopg 3. Components keep their SQL (``?`` placeholders, the dialect
both engines share) and their write operations — synchronous functions of a
:class:`~kazma.config.store.backend.Tx` — unchanged; :func:`pyformat` rewrites
a statement for psycopg once and caches it.

The writer runs its groups on a *synchronous* psycopg connection in its own
thread, as the SQLite writer does: an operation's statements depend on each
other's results (a press reads the cards, then compares and sets, then audits),
so driving them from the event loop would mean an ``await`` per statement and
rewriting every operation as a coroutine; the thread keeps the loop free while
a group's round trips run. Reads are short autocommit queries on psycopg_pool's
``AsyncConnectionPool``, straight from the loop.

One group is one transaction, without savepoints. A savepoint per operation
would cost two round trips each and a subtransaction id each; past 64 of them
in one transaction PostgreSQL's snapshots overflow into ``pg_subtrans`` for
every session of the server. Instead an operation that fails rolls the group
back, is answered with its error, and the others run again in a new
transaction (they are pure functions of the transaction, so running one again
is the same as running it once). Operations only wait for row locks other
replicas hold while those replicas commit; inside a group of several that wait
is bounded (``lock_timeout``), so two replicas' groups that lock rows in
opposite orders cannot deadlock for long: the one that times out rolls back,
letting the other commit, and runs its operations one per transaction (the
held-up one last), where each may wait as long as it takes — but for one with
a deadline (an approved call's start): the transaction under way is cancelled
at it (:class:`_Cut`), the operation given up, never to run again, and the
group's others run again without it.

A group whose operations wait for no answer before the commit (presses sent on
a guess, the audit chain's append on the head it expects, notifications) goes
out as one string of statements, bound on the client, in one simple-protocol
query: one send and one read. In psycopg's pipeline mode each statement costs a
cursor, a send and a poll of the socket, and the pipeline's end a sync; a lone
press cost about four times the client CPU so. Only a group whose every
operation is marked :class:`~kazma.config.store.group_commit.Unasking` by its
maker tries it (most groups ask: an open, a card's claim); when one asks after
all, it stops the attempt before anything was sent, and the group goes
pipelined as before. Such a group is sent from the event loop itself (libpq's
non-blocking send, its results read by a reader on the socket), not by the
thread, once the connection is open: a hand-off to the thread and back cost a
lone press two thread wake-ups (see :meth:`PgWriter._send_on_loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg_pool import AsyncConnectionPool

from kazma.config.metrics import count_failure
from kazma.config.store.errors import WriteGivenUp
from kazma.config.store.group_commit import Deferred, GroupQueue, Job, Later, Unasking, interrupted, own_operations
from kazma.config.store.migrations import Migration, run_migrations
from kazma.config.store.pg_schema import PREPARED
from kazma.config.store.pg_text import ESCAPE, encode, nul_safe, nul_safe_async

log = structlog.get_logger("kazma.store")

T = TypeVar("T")

# Held while migrations run: two replicas starting together apply each migration once.
MIGRATION_LOCK = 0x6B617A6D61_0001  # "kazma", 1
# Inside a group of several operations, the longest one statement waits for another replica's row lock.
LOCK_TIMEOUT_MS = 250
# At most this many operations in one transaction: a longer one holds its row locks longer.
MAX_GROUP = 128
# A lone operation chosen as a deadlock victim (or failing serialisation) is run again this many times.
ALONE_ATTEMPTS = 5
# Raised by a statement that was sent on a guess (its answer not waited for) and found the guess stale: the group
# is rolled back and run again, in pipeline mode, the operations now asking instead of guessing.
STALE_GUESS = "KZ001"
# SQLSTATEs after which a connection's prepared statements are not used again (see PgWriter._prepare): no such
# prepared statement, its cached plan's result type changed, or the function it calls is gone (a later migration).
_UNPREPARED = frozenset({"26000", "0A000", "42883"})
# SQLSTATEs after which an operation is run again on its own: lock_not_available, deadlock_detected,
# serialization_failure. None of them leaves anything of the transaction behind.
_RUN_ALONE = frozenset({"55P03", "40P01", "40001"})
# read_only_sql_transaction: the session refuses writes (a hot standby, default_transaction_read_only). A session
# takes the database's and role's defaults when it opens, so what refused may take writes when opened again.
READ_ONLY_SQL_TRANSACTION = "25006"
# Once an attempt ran past a job's deadline, its statements are cancelled again this often until it ends: a cancel
# that reaches the server between two statements is dropped there (PostgreSQL cancels a statement under way only),
# and the next statement might wait for a lock as long as another session holds it.
CUT_REPEAT = 0.02

# Every NOTIFY of a transaction in one statement, in the order they were asked for. Given value by value, not as
# arrays (psycopg dumps a list element by element in Python); past _NOTIFY_VALUES notices the text would be long.
_NOTIFY_ALL = "SELECT pg_notify(c, p) FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS n(c, p, i) ORDER BY i"
_NOTIFY_ONE = "SELECT pg_notify(%s, %s)"
_NOTIFY_VALUES = 32


@functools.lru_cache(maxsize=_NOTIFY_VALUES)
def _notify_values(notices: int) -> str:
    rows = ", ".join(f"({i}, %s, %s)" for i in range(notices))
    return f"SELECT pg_notify(n.c, n.p) FROM (VALUES {rows}) AS n(i, c, p) ORDER BY n.i"  # noqa: S608


_SCHEMA_TABLE = """
CREATE TABLE IF NOT EXISTS kazma_schema (
    component text NOT NULL,
    version integer NOT NULL,
    applied_at double precision NOT NULL,
    PRIMARY KEY (component, version)
)
"""


@functools.lru_cache(maxsize=1024)
def pyformat(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled), leaving quoted text alone."""
    out: list[str] = []
    quote: str | None = None
    for char in sql:
        if quote is not None:
            if char == quote:
                quote = None
            out.append("%%" if char == "%" else char)
        elif char in ("'", '"'):
            quote = char
            out.append(char)
        elif char == "?":
            out.append("%s")
        elif char == "%":
            out.append("%%")
        else:
            out.append(char)
    return "".join(out)


@functools.lru_cache(maxsize=1024)
def _pieces(sql: str) -> tuple[str, ...]:
    """``sql`` cut at its ``?`` placeholders (quoted text left alone, as :func:`pyformat` reads it): the text
    around them, one piece more than there are placeholders."""
    pieces: list[str] = []
    start = 0
    quote: str | None = None
    for at, char in enumerate(sql):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
        elif char == "?":
            pieces.append(sql[start:at])
            start = at + 1
    pieces.append(sql[start:])
    return tuple(pieces)


class PgTx(Deferred):
    """Statements inside the PostgreSQL writer's transaction; the same methods as the SQLite writer's ``Tx``.

    In pipeline mode (``pipeline`` given) a statement is sent without waiting for its answer; a read, or
    ``run``'s row count, waits for the answers sent before it. ``send``'s and ``notify``'s answers are only
    ever waited for at the commit.
    """

    def __init__(
        self, cursor: psycopg.Cursor[Any], pipeline: psycopg.Pipeline | None = None, *, guessing: bool = False
    ) -> None:
        super().__init__()
        self._cursor = cursor
        self._pipeline = pipeline
        self._notices: list[tuple[str, str]] = []
        self._laters: list[tuple[psycopg.Cursor[Any], Callable[[Any], Any], Later[Any]]] = []
        self._guesses: list[tuple[psycopg.Cursor[Any], Callable[[Any], Any], Later[Any]]] = []
        # Whether an operation may send a statement on a guess of its answer (:meth:`guess`): pipelined, and not
        # a group run again because a guess was stale.
        self.guessing = guessing and pipeline is not None
        # What the operations of this transaction note for each other (keyed by a name of the component's).
        self.notes: dict[str, Any] = {}

    def later(self, sql: str, params: Iterable[Any], then: Callable[[Any], T]) -> Later[T]:
        """One statement whose single row (or None) ``then`` turns into an operation's result; in pipeline mode
        the answer is waited for only once every operation of the group has sent its statements, all answers
        together, before the transaction's deferred work (``then`` may run more statements and defer more)."""
        later: Later[T] = Later()
        if self._pipeline is None:
            later.set(then(self.one(sql, params)))
            return later
        cursor = self._cursor.connection.cursor()
        cursor.execute(pyformat(sql), tuple(params))
        self._laters.append((cursor, then, later))
        return later

    def guess(self, sql: str, params: Iterable[Any], then: Callable[[Any], T]) -> Later[T]:
        """One statement sent on a guess of its answer, which fails the transaction with :data:`STALE_GUESS` when
        the guess is wrong. Nothing waits for it: its single row is read once the transaction committed, and
        ``then`` (which must run no statement) turns it into an operation's result. Only while :attr:`guessing`."""
        if not self.guessing:
            raise RuntimeError("a statement was sent on a guess in a transaction that does not guess")
        later: Later[T] = Later()
        cursor = self._cursor.connection.cursor()
        cursor.execute(pyformat(sql), tuple(params))
        self._guesses.append((cursor, then, later))
        return later

    def _resolve_guesses(self) -> None:
        guesses, self._guesses = self._guesses, []
        for cursor, then, later in guesses:
            with cursor:
                later.set(then(cursor.fetchone()))

    def _drop_guesses(self) -> None:
        guesses, self._guesses = self._guesses, []
        for cursor, _, _ in guesses:
            cursor.close()

    def _resolve_laters(self) -> None:
        laters, self._laters = self._laters, []
        for cursor, then, later in laters:
            with cursor:
                row = cursor.fetchone()
            later.set(then(row))

    @property
    def pipelined(self) -> bool:
        """Whether statements go out without waiting (an answer nobody waits for may fail the commit instead)."""
        return self._pipeline is not None

    def prepares(self, sql: str) -> bool:
        """Whether ``sql`` reaches the server as the ``EXECUTE`` of a statement prepared on the connection (planned
        once per session), not as a statement parsed and planned each time: never here (see PgWriter._connection)."""
        return False

    def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        return self._cursor.execute(pyformat(sql), tuple(params)).fetchone()

    def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        return self._cursor.execute(pyformat(sql), tuple(params)).fetchall()

    def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement; the number of rows it changed."""
        self._cursor.execute(pyformat(sql), tuple(params))
        if self._pipeline is not None:
            self._pipeline.sync()  # the row count is known once the answer is back
        return int(self._cursor.rowcount)

    def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        self._cursor.executemany(pyformat(sql), [tuple(row) for row in rows])

    def send(self, sql: str, params: Iterable[Any] = ()) -> None:
        self._cursor.execute(pyformat(sql), tuple(params))

    def notify(self, channel: str, payload: str = "") -> None:
        """``NOTIFY``, delivered to every listening replica when (and only if) this transaction commits. Sent
        with the transaction's others in one statement, just before the commit."""
        self._notices.append((channel, payload))

    def _send_notices(self) -> None:
        notices, self._notices = self._notices, []
        if not notices:
            return
        if len(notices) == 1:
            self._cursor.execute(_NOTIFY_ONE, notices[0])
        elif len(notices) <= _NOTIFY_VALUES:
            self._cursor.execute(_notify_values(len(notices)), [value for notice in notices for value in notice])
        else:
            channels, payloads = zip(*notices, strict=True)
            self._cursor.execute(_NOTIFY_ALL, (list(channels), list(payloads)))


class _NeedsAnswers(BaseException):
    """An operation asked for a statement's answer in a transaction sent as one string (:class:`PgBatchTx`).

    A BaseException, so an operation's ``except Exception`` cannot take it for a database error and go on."""


class PgBatchTx(PgTx):
    """A transaction whose statements are collected, bound on the client, and sent as one string at its commit.

    Every statement given must be one statement (no ``;`` between two): its answer is found by its place among
    the string's results. Only for operations that wait for no answer: ``send``, ``guess`` and ``notify`` are
    collected; ``one``, ``all``, ``run``, ``run_many`` and ``later`` stop the attempt (:class:`_NeedsAnswers`)
    before anything went out, and the writer runs the group pipelined instead (operations are pure functions of
    the transaction).
    """

    def __init__(
        self,
        cursor: psycopg.ClientCursor[Any],
        literals: psycopg.abc.Transformer | None = None,
        executes: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(cursor)
        # Statements prepared on the connection: each one's EXECUTE, cut at its values (see PgWriter._prepare).
        self._executes = executes if executes is not None else {}
        self.guessing = True
        self.asked = False  # an operation asked for an answer (set even if it swallowed the stop)
        self.statements: list[str] = []
        self.first = 0  # the results before the first statement's (BEGIN, and SET LOCAL when bounded)
        self._answers: list[tuple[int, Callable[[Any], Any], Later[Any]]] = []
        # Each value as the literal psycopg's client-side binding makes of it (the connection's adapters: text
        # through pg_text's escaping), one transformer for the whole transaction. Not ClientCursor.mogrify: it
        # parses a statement of more than 50 values again every time (the chain's append of four events or more
        # has 52), about 40 µs per event row against 8 here. The writer keeps one per connection (``literals``):
        # making one per transaction was a fifth of what a lone press's binding cost.
        self._literals = literals if literals is not None else psycopg.adapt.Transformer(cursor)
        info = cursor.connection.info
        self._encoding = info.encoding
        # Text, integers, floats and booleans are written here instead (the same literals, without psycopg's
        # dumper calls: about a third of the binding's cost), where a quoted literal means exactly its characters:
        # standard_conforming_strings on (a backslash is itself, only a quote is doubled), and UTF-8.
        self._plain = info.parameter_status("standard_conforming_strings") == "on" and self._encoding == "utf-8"

    @property
    def pipelined(self) -> bool:
        return True  # nothing is waited for before the commit, as in pipeline mode

    def prepares(self, sql: str) -> bool:
        return sql in self._executes

    def _add(self, sql: str, params: Iterable[Any]) -> None:
        pieces = self._executes.get(sql) or _pieces(sql)
        values = tuple(params)
        if len(values) != len(pieces) - 1:
            raise psycopg.ProgrammingError(
                f"the statement has {len(pieces) - 1} placeholders but {len(values)} values were given"
            )
        literal = self._literals.as_literal
        out = [pieces[0]]
        append = out.append
        if not self._plain:
            for value, piece in zip(values, pieces[1:], strict=True):
                append("NULL" if value is None else literal(value).decode(self._encoding))
                append(piece)
            self.statements.append("".join(out))
            return
        for value, piece in zip(values, pieces[1:], strict=True):
            kind = type(value)
            if kind is str:  # the common case first
                if "\x00" in value or ESCAPE in value:
                    value = encode(value)  # as the connection's text dumper writes it (pg_text)
                append(f"'{value}'" if "'" not in value else "'" + value.replace("'", "''") + "'")
            elif value is None:
                append("NULL")
            elif kind is int:
                # A leading space, as psycopg writes it: "- -1" must not read as a comment.
                append(str(value) if value >= 0 else f" {value}")
            elif kind is float and math.isfinite(value):
                text = repr(value)  # the shortest text that reads back as the same double
                append(f" {text}" if text[0] == "-" else text)
            elif kind is bool:
                append("true" if value else "false")
            else:
                append(literal(value).decode(self._encoding))
            append(piece)
        self.statements.append("".join(out))

    def _ask(self) -> Any:
        self.asked = True
        raise _NeedsAnswers

    def guess(self, sql: str, params: Iterable[Any], then: Callable[[Any], T]) -> Later[T]:
        later: Later[T] = Later()
        self._answers.append((len(self.statements), then, later))
        self._add(sql, params)
        return later

    def send(self, sql: str, params: Iterable[Any] = ()) -> None:
        self._add(sql, params)

    def later(self, sql: str, params: Iterable[Any], then: Callable[[Any], T]) -> Later[T]:
        return self._ask()  # type: ignore[no-any-return]

    def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        return self._ask()

    def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        return self._ask()  # type: ignore[no-any-return]

    def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        return self._ask()  # type: ignore[no-any-return]

    def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        self._ask()

    def _send_notices(self) -> None:
        notices, self._notices = self._notices, []
        for notice in notices:  # one statement each, in the order asked for: the string is one send anyway
            self._add("SELECT pg_notify(?, ?)", notice)

    def _read_answers(self, cursor: psycopg.ClientCursor[Any], first: int) -> list[Any]:
        """Each guess's row, in order, from the results of the string (its statements' start at result ``first``);
        the cursor is left on the last result (the ``COMMIT``'s)."""
        rows: list[Any] = []
        at = 0
        for index, _, _ in self._answers:
            while at < first + index:
                cursor.nextset()
                at += 1
            rows.append(cursor.fetchone())
        while cursor.nextset():
            pass
        return rows

    def _rows_of(self, results: Sequence[psycopg.pq.abc.PGresult], first: int) -> list[Any]:
        """Each guess's row (a tuple, or None), in order, from the string's results (its statements' start at
        result ``first``), loaded by the connection's loaders as a cursor loads them."""
        rows: list[Any] = []
        literals = self._literals
        for index, _, _ in self._answers:
            result = results[first + index]
            if result.ntuples == 0:
                rows.append(None)
                continue
            literals.set_pgresult(result)
            rows.append(literals.load_row(0, tuple))
        return rows

    def _drop_answers(self) -> None:
        self._answers = []

    def _resolve_answers(self, rows: list[Any]) -> None:
        """The transaction committed: each guess's ``then`` turns its row into an operation's result."""
        answers, self._answers = self._answers, []
        for (_, then, later), row in zip(answers, rows, strict=True):
            later.set(then(row))


class _SwallowedError(psycopg.Error):
    """An operation caught a database error and returned: its transaction is aborted, so it failed."""


class _UnseenRollback(psycopg.Error):
    """A group's COMMIT answered ROLLBACK: something swallowed a database error after its operations ran."""


class _LoopGroup:
    """A group sent as one string from the loop (:meth:`PgWriter._send_on_loop`), while its results come in."""

    __slots__ = ("fd", "first", "flushing", "jobs", "results", "tx")

    def __init__(self, jobs: list[Job[Any]], tx: PgBatchTx, fd: int) -> None:
        self.jobs, self.tx, self.fd = jobs, tx, fd
        self.first = tx.first
        self.results: list[psycopg.pq.abc.PGresult] = []
        self.flushing = False  # the query is not all sent yet: a writer callback sends the rest


class _Cut:
    """The attempt under way on the writer's connection, cut at ``at`` (``time.monotonic()``, the earliest deadline of
    its jobs): from then until :meth:`close`, a timer thread cancels whatever statement the connection runs.

    A group already sent used to wait for another session's row lock as long as that session held it (a lone
    operation has no ``lock_timeout``): a start with a deadline (an approved call's) then was neither refused in
    time nor, once the lock was free, kept from committing after its caller stopped waiting. A cancel is sent only
    while the attempt is :attr:`_live`, and returns once the server took it (libpq waits for that), so it never
    lands on a statement of a later attempt: a cancel the server receives between statements is dropped there."""

    def __init__(self, conn: psycopg.Connection[Any], at: float) -> None:
        self._cancel = conn.pgconn.get_cancel()  # made here, by the connection's own thread
        self._lock = threading.Lock()
        self._live = True
        self.fired = False  # a cancel was sent: the attempt must not commit (unless its COMMIT was already out)
        self._timer = self._arm(at - time.monotonic())

    def _arm(self, delay: float) -> threading.Timer:
        timer = threading.Timer(max(0.0, delay), self._fire)
        timer.daemon = True
        timer.start()
        return timer

    def _fire(self) -> None:
        with self._lock:
            if not self._live:
                return
            if not self.fired:
                log.warning("store.write_cut", backend="postgresql", reason="a job's deadline passed")
            self.fired = True
            try:
                self._cancel.cancel()
            except psycopg.Error as exc:  # the connection is gone: its statement ended with it
                log.warning("store.cancel_failed", backend="postgresql", error=str(exc))
            self._timer = self._arm(CUT_REPEAT)

    def close(self) -> None:
        """The attempt has ended: nothing is cancelled from now on."""
        with self._lock:
            self._live = False
            self._timer.cancel()


class PgWriter(GroupQueue):
    """Group-committing writer for one PostgreSQL database. Create it on the event loop that will use it."""

    def __init__(
        self,
        conninfo: str,
        *,
        application_name: str = "kazma-writer",
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
        max_group: int = MAX_GROUP,
        connect_timeout: float = 10.0,
        pipelined: bool = True,
    ) -> None:
        self.conninfo = conninfo
        self.application_name = application_name
        self.lock_timeout_ms = lock_timeout_ms
        self.max_group = max_group
        self.connect_timeout = connect_timeout
        super().__init__()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue[tuple[list[Job[Any]], bool | None] | None] = queue.SimpleQueue()
        self._on_loop: _LoopGroup | None = None  # the group sent from the loop, whose answers are awaited
        self._reading: int | None = None  # the connection's socket, while the loop's reader watches it
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None  # the writer thread's own
        self.groups = 0  # committed groups, for tests and benchmarks
        self.run_alone = 0  # operations run one per transaction after a group met another replica's lock
        # Groups run in pipeline mode (see _attempt_pipelined); off: every statement waits for its answer.
        self.pipelined = pipelined
        self.pipeline_retries = 0  # pipelined groups rolled back and run again statement by statement
        self.batched = 0  # groups committed as one string of statements (see _attempt_batched)
        # Such a group is sent from the loop when the connection is open (see _send_on_loop); off: by the thread.
        self.send_from_loop = True
        self.sent_from_loop = 0  # groups sent so, committed or not
        self._client: psycopg.ClientCursor[Any] | None = None  # the writer connection's, for _attempt_batched
        self._literals: psycopg.abc.Transformer | None = None  # its, for every PgBatchTx on it
        self._executes: dict[str, tuple[str, ...]] = {}  # the connection's prepared statements (see _prepare)
        # The server process of the writer's connection: a NOTIFY this process sent carries it, so the
        # replica's listener can tell its own notifications from the others'.
        self.backend_pid: int | None = None
        # Why the writer's last operations were refused as writes on a read-only session, until one is taken again
        # (None: none was). Written by the writer thread; /healthz reads it: the read pool's sessions, opened at
        # other moments, may take writes while this one, the only one that writes, refuses them.
        self.refusing_writes: str | None = None
        self.refusals = 0  # writes refused so (each group's refusal counts once): tells a new refusal from an old

    # -- the loop side ---------------------------------------------------------------------------

    def _closed_error(self) -> Exception:
        return psycopg.InterfaceError("the store writer is closed")

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._late():
            return
        if self._in_flight or not self._pending:
            return  # the group on its way collects these when it is back
        jobs = self._take(self.max_group)
        self._in_flight = True
        self._loop = asyncio.get_running_loop()  # the thread answers on the loop that handed it the group
        if self._send_on_loop(jobs):
            return
        self._to_thread(jobs, None)

    def _to_thread(self, jobs: list[Job[Any]], batch_failed: bool | None) -> None:
        """The group in flight to the writer thread (``batch_failed``: see :meth:`_commit`)."""
        self._stop_reading()  # the thread reads the socket now
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="kazma-pg-writer", daemon=True)
            self._thread.start()
        self._queue.put((jobs, batch_failed))

    # -- one string, from the loop ----------------------------------------------------------------

    def _send_on_loop(self, jobs: list[Job[Any]]) -> bool:
        """Send a group that goes as one string (see :meth:`_attempt_batched`) from the loop, without the writer
        thread; whether it went. Its answers are read by a reader callback on the connection's socket, which
        answers the callers once the ``COMMIT``'s result is in.

        A lone press handed to the thread cost two thread wake-ups (loop to thread, thread back to the loop's
        self-pipe) besides the server's: on a busy machine each is a wait for a core, and the press took several
        times its CPU in wall time. Only one group is ever in flight, so the thread never uses the connection
        meanwhile; anything but a clean commit hands the group to the thread (the transaction left to roll back
        there), which runs it as it runs any other."""
        conn = self._conn
        if (
            not self.send_from_loop
            or not self.pipelined
            or conn is None
            or conn.closed
            or conn.broken
            or conn.info.transaction_status != TransactionStatus.IDLE
            or not all(type(job.op) is Unasking and job.deadline is None for job in jobs)
        ):
            # (A job with a deadline goes by the thread, which cuts an attempt at it: see _Cut.)
            return False
        try:
            built = self._build_batch(conn, jobs, bounded=own_operations(jobs) > 1)
        except BaseException as exc:
            # An interrupt or an exit while an operation ran (nothing went out): every caller told, then it goes
            # on. Escaping here, it left the group in flight for good, and every later write waiting.
            self._returned(jobs, interrupted(exc), True)
            raise
        if built is None:
            return False
        tx, query = built
        pgconn = conn.pgconn
        try:
            pgconn.send_query(query)
            flushed = pgconn.flush() == 0
        except psycopg.Error:
            self._to_thread(jobs, False)  # the thread finds the connection broken and opens another
            return True
        loop = self._loop
        assert loop is not None
        group = _LoopGroup(jobs, tx, pgconn.socket)
        self._on_loop = group
        self.sent_from_loop += 1
        if self._reading != group.fd:
            # Left registered between groups (adding and removing a reader per group was a tenth of a lone
            # press's CPU): taken off only when the thread is handed a group or the connection ends.
            self._stop_reading()
            loop.add_reader(group.fd, self._read_on_loop)
            self._reading = group.fd
        if not flushed:
            group.flushing = True
            loop.add_writer(group.fd, self._flush_on_loop)
        return True

    def _flush_on_loop(self) -> None:
        group, conn = self._on_loop, self._conn
        if group is None or conn is None:  # never: the callback is removed as the group ends
            return
        try:
            done = conn.pgconn.flush() == 0
        except BaseException as exc:
            self._loop_group_failed(group, exc)
            return
        if done:
            group.flushing = False
            asyncio.get_running_loop().remove_writer(group.fd)

    def _read_on_loop(self) -> None:
        group, conn = self._on_loop, self._conn
        if conn is None:  # never: the reader is taken off before the connection goes
            self._stop_reading()
            return
        if group is None:
            # Between groups the server says nothing unasked, but for ending the session: read what it said
            # (libpq keeps it), and stop watching a connection that is gone (the next group reconnects).
            try:
                conn.pgconn.consume_input()
            except psycopg.Error:
                self._stop_reading()
                return
            if conn.broken:
                self._stop_reading()
            return
        try:
            pgconn = conn.pgconn
            pgconn.consume_input()
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    self._loop_group_read(group)
                    return
                group.results.append(result)
        except BaseException as exc:
            self._loop_group_failed(group, exc)

    def _end_loop_group(self, group: _LoopGroup) -> None:
        if group.flushing:
            asyncio.get_running_loop().remove_writer(group.fd)
        self._on_loop = None

    def _stop_reading(self) -> None:
        fd, self._reading = self._reading, None
        if fd is not None and self._loop is not None:
            self._loop.remove_reader(fd)

    def _loop_group_read(self, group: _LoopGroup) -> None:
        """Every result of the string is in: answer the group, or hand it to the thread when it did not commit."""
        self._end_loop_group(group)
        conn = self._conn
        assert conn is not None
        tx = group.tx
        failed: psycopg.Error | None = None
        for result in group.results:
            if result.status == ExecStatus.FATAL_ERROR:
                failed = psycopg.errors.error_from_result(result, encoding=tx._encoding)
                break
        last = group.results[-1] if group.results else None
        committed = failed is None and last is not None and last.command_status == b"COMMIT"
        if not committed and (conn.broken or conn.closed):
            # Whether the COMMIT was kept is unknown (the thread's path fails such a group the same way): the
            # group must not run again, a press that won would be told it lost to itself.
            self._loop_group_failed(group, failed or psycopg.OperationalError("the writer's connection was lost"))
            return
        if not committed:
            tx._drop_answers()
            self._unprepare(failed)
            self.pipeline_retries += 1
            # Rolled back by the thread (the transaction is still open, aborted), then run as after a failed string.
            self._to_thread(group.jobs, failed is not None and _sqlstate(failed) == STALE_GUESS)
            return
        try:
            tx._resolve_answers(tx._rows_of(group.results, group.first))
            tx._committed()
        except BaseException as exc:  # committed: what the answers made of the rows failed (a bug)
            log.exception("store.writer_failed", backend="postgresql")
            self.batched += 1
            self.groups += 1
            self._returned(group.jobs, exc, True)
            return
        self.batched += 1
        self.groups += 1
        for job in group.jobs:
            if isinstance(job.result, Later):
                job.result = job.result.value if job.result.done else None
        self._returned(group.jobs, None, True)

    def _loop_group_failed(self, group: _LoopGroup, exc: BaseException) -> None:
        """Reading or sending failed: the connection is gone, and nobody's write is known to be kept."""
        if self._on_loop is group:
            self._end_loop_group(group)
        self._stop_reading()
        group.tx._drop_answers()
        if isinstance(exc, psycopg.Error):
            error: BaseException = self._failed(exc, len(group.jobs))
        else:
            log.error("store.writer_failed", backend="postgresql", error=f"{type(exc).__name__}: {exc}")
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            error = exc
        self._returned(group.jobs, error, True)

    def _returned(self, jobs: Sequence[Job[Any]], error: BaseException | None, last: bool) -> None:
        self._answer_jobs(jobs, error)
        if last:
            self._group_returned()

    async def close(self) -> None:
        """Commit what is queued, then end the thread and close the connection."""
        await self._drain()
        self._stop_reading()
        self._finished = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(thread.join)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- the thread side -------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            jobs, batch_failed = item
            alone: list[Job[Any]] = []
            try:
                error = self._commit(jobs, alone, batch_failed)
            except BaseException as exc:  # a bug here must fail the group, not leave its callers waiting forever
                log.exception("store.writer_failed", backend="postgresql")
                error, alone = exc, []
            # The group's committed operations are answered now; each one left to run alone once it ran.
            waiting = {id(job) for job in alone}
            if not self._hand_back([j for j in jobs if id(j) not in waiting], error, last=not alone):
                return
            for index, job in enumerate(alone):
                try:
                    error = self._commit_alone(job)
                except BaseException as exc:
                    log.exception("store.writer_failed", backend="postgresql")
                    error = exc
                if not self._hand_back([job], error, last=index == len(alone) - 1):
                    return

    def _hand_back(self, jobs: Sequence[Job[Any]], error: BaseException | None, *, last: bool) -> bool:
        self._note_refusal(jobs, error)
        for job in jobs:  # an operation's result given as a Later was filled before its commit
            if isinstance(job.result, Later):
                job.result = job.result.value if job.result.done else None
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._returned, jobs, error, last)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            return False
        return True

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            # Autocommit: BEGIN and COMMIT are ours, so nothing is ever left open between groups.
            self._conn = psycopg.connect(
                self.conninfo,
                autocommit=True,
                application_name=self.application_name,
                connect_timeout=max(1, int(self.connect_timeout)),
            )
            nul_safe(self._conn)  # text with U+0000 is kept, as on SQLite (pg_text.py)
            # No server-side prepared statements: psycopg counts a PREPARE sent in a pipeline that was then
            # aborted as done, and the next use fails ("prepared statement _pg3_n does not exist"). The hot
            # statements are function calls, whose plans PostgreSQL caches per session anyway.
            self._conn.prepare_threshold = None
            self.backend_pid = self._conn.info.backend_pid
            self._executes = self._prepare(self._conn)
        return self._conn

    @staticmethod
    def _prepare(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, ...]]:
        """``PREPARE`` the statements components registered (:func:`kazma.config.store.pg_schema.prepared`) on a new
        connection; for each that was, its ``EXECUTE`` cut at its values, as :func:`_pieces` cuts a statement.

        Only a group sent as one string uses them: its statements are literals in a simple query, which the server
        parses and plans again every time (a press's call, once per press); ``EXECUTE name(literals)`` is planned
        once per session. Not psycopg's own preparing (see above): these are SQL statements on the autocommit
        connection, outside any pipeline. A statement that cannot be prepared here (a database without that
        component's migrations) is sent as itself."""
        executes: dict[str, tuple[str, ...]] = {}
        for sql, (name, types) in PREPARED.items():
            pieces = _pieces(sql)
            numbered = "".join(f"{piece}${n}" for n, piece in enumerate(pieces[:-1], start=1)) + pieces[-1]
            try:
                # No values given: psycopg sends the text as it is (no placeholders, no % read).
                conn.execute(f"PREPARE {name} ({', '.join(types)}) AS {numbered}")
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise
                log.debug("store.not_prepared", backend="postgresql", statement=name, error=str(exc))
                continue
            executes[sql] = (
                (f"EXECUTE {name}(", *([", "] * (len(pieces) - 2)), ")") if len(pieces) > 1 else (f"EXECUTE {name}",)
            )
        return executes

    def _unprepare(self, exc: BaseException | None) -> None:
        """A string failed for want of a prepared statement or of what it calls: the connection's go unused."""
        if exc is not None and _sqlstate(exc) in _UNPREPARED:
            self._executes = {}

    def _commit(
        self, jobs: list[Job[Any]], alone: list[Job[Any]], batch_failed: bool | None = None
    ) -> BaseException | None:
        """Run ``jobs`` to a commit; the error that failed all of them, or None (each job may have its own).

        When one waits too long for another replica's row lock, it and the jobs not yet committed are put
        in ``alone`` (it last), to run one per transaction. ``batch_failed``: the group was already sent as one
        string from the loop and did not commit (True: because a guess was stale); its transaction is rolled
        back first, and it is not tried as one string again.
        """
        try:
            conn = self._connection()
            self._roll_back(conn)  # what a string sent from the loop left open (nothing, usually)
            todo = list(jobs)
            while todo:
                todo = self._give_up_late(todo)
                if not todo:
                    return None
                cut = self._cut_for(conn, todo)
                try:
                    # A rider (a checkpoint) makes no group bounded: a lone press with one waits for locks as before.
                    failed = self._attempt(
                        conn, todo, bounded=own_operations(todo) > 1, batch_failed=batch_failed, cut=cut
                    )
                except psycopg.Error:
                    if not _was_cut(cut, conn):
                        raise
                    failed = todo[0], _cut_error()  # a cancel met the ROLLBACK or the COMMIT: nothing was kept
                finally:
                    if cut is not None:
                        cut.close()
                batch_failed = None
                if failed is None:
                    break
                if cut is not None and cut.fired:
                    # Cut at a job's deadline, rolled back: that job is given up (next turn), the others run again.
                    self._roll_back(conn)
                    continue
                job, exc = failed
                todo = [j for j in todo if j is not job]
                if len(jobs) > 1 and _sqlstate(exc) in _RUN_ALONE:
                    # Another replica holds a row this group wants, and may be waiting for one of ours: let
                    # it go on, and take the rest one operation per transaction (the one held up last), as
                    # a group tried again could meet the same cycle once per operation.
                    alone.extend([*todo, job])
                    return None
                job.error = exc
            self.groups += 1
            return None
        except psycopg.Error as exc:
            alone.clear()
            return self._failed(exc, len(jobs))

    def _commit_alone(self, job: Job[Any]) -> BaseException | None:
        """``job`` in a transaction of its own, waiting for locks as long as it takes (or until its deadline)."""
        if not self._give_up_late([job]):
            return None
        try:
            self.run_alone += 1
            self._run_alone(self._connection(), job)
            return None
        except psycopg.Error as exc:
            return self._failed(exc, 1)

    def _cut_for(self, conn: psycopg.Connection[Any], jobs: Sequence[Job[Any]]) -> _Cut | None:
        """A cut at the earliest deadline among ``jobs``, or None when none has one."""
        deadlines = [job.deadline for job in jobs if job.deadline is not None]
        return _Cut(conn, min(deadlines)) if deadlines else None

    def _give_up_late(self, jobs: list[Job[Any]]) -> list[Job[Any]]:
        """``jobs`` but those whose deadline has passed: those are given up (never run again, so never committed),
        and their callers told now, from the thread, while the others may go on waiting for a lock."""
        now = time.monotonic()
        late = [job for job in jobs if job.deadline is not None and job.deadline <= now]
        if not late:
            return jobs
        self._give_up(late)
        return [job for job in jobs if job.deadline is None or job.deadline > now]

    def _give_up(self, late: list[Job[Any]]) -> None:
        for job in late:
            job.result = None
            job.error = WriteGivenUp(
                "the write was given up at its deadline before it could commit (it waited for a lock another"
                " session of the database held, or for the writer busy before it): nothing of it was committed"
            )
        log.warning("store.write_given_up", backend="postgresql", operations=len(late), waiting_for="lock")
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for an answer
                self._loop.call_soon_threadsafe(self._answer_given_up, late)

    def _note_refusal(self, jobs: Sequence[Job[Any]], error: BaseException | None) -> None:
        """Writes refused on a read-only session: the session goes, and the next group opens another. Kept, a session
        opened while ``default_transaction_read_only`` was set on the database (or the role) refused every write
        for good after the setting was reset, until a restart; only sessions opened since take the new default."""
        failures = [error, *(job.error for job in jobs)]
        refusal = next((f for f in failures if f is not None and _sqlstate(f) == READ_ONLY_SQL_TRANSACTION), None)
        if refusal is not None:
            if self.refusing_writes is None:
                log.error("store.writes_refused", backend="postgresql", error=str(refusal).strip())
            self.refusals += 1  # first: /healthz that sees the refusal sees it counted
            self.refusing_writes = str(refusal).strip() or type(refusal).__name__
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
        elif self.refusing_writes is not None and error is None and any(job.error is None for job in jobs):
            self.refusing_writes = None
            log.info("store.writes_taken", backend="postgresql")

    def _failed(self, exc: psycopg.Error, operations: int) -> psycopg.Error:
        """The connection or a COMMIT failed: nobody's write is known to be kept."""
        count_failure("store_commit")
        log.error("store.commit_failed", backend="postgresql", operations=operations, error=str(exc))
        if self._conn is not None and (self._conn.broken or self._conn.closed):
            self._conn.close()
            self._conn = None
        return exc

    def _run_alone(self, conn: psycopg.Connection[Any], job: Job[Any]) -> None:
        for attempt in range(1, ALONE_ATTEMPTS + 1):
            if not self._give_up_late([job]):
                return
            cut = self._cut_for(conn, [job])
            try:
                failed = self._attempt(conn, [job], bounded=False, cut=cut)
            except psycopg.Error:
                if not _was_cut(cut, conn):
                    raise
                failed = job, _cut_error()
            finally:
                if cut is not None:
                    cut.close()
            if failed is None:
                return
            if cut is not None and cut.fired:
                self._roll_back(conn)
                self._give_up([job])  # cut at its deadline: given up, never run again
                return
            _, exc = failed
            if _sqlstate(exc) not in _RUN_ALONE or attempt == ALONE_ATTEMPTS:
                job.error = exc
                return

    def _attempt(
        self,
        conn: psycopg.Connection[Any],
        jobs: Sequence[Job[Any]],
        *,
        bounded: bool,
        batch_failed: bool | None = None,
        cut: _Cut | None = None,
    ) -> tuple[Job[Any], Exception] | None:
        """One transaction for ``jobs``: None once committed, or the job that failed (all rolled back).

        First in pipeline mode; when anything goes wrong there, the group is rolled back and run again statement
        by statement, which tells exactly which operation failed (see :meth:`_attempt_pipelined`).
        Raises when the connection itself fails, or the ``COMMIT`` does. Once ``cut`` fired, no way is tried again:
        the first job is returned with the cut's error (its caller decides who was late).
        """
        if self.pipelined:
            guesses: tuple[bool, ...] = (True, False)
            # Only a group of operations that said they ask nothing tries the one string: any other would run
            # its first operations' Python (and bind their values) only to find one asking, then run it all again.
            if batch_failed is not None:  # tried as one string from the loop already
                if batch_failed:
                    guesses = (False,)
            elif all(type(job.op) is Unasking for job in jobs):
                committed, stale = self._attempt_batched(conn, jobs, bounded=bounded)
                if committed:
                    return None
                if cut is not None and cut.fired:
                    return jobs[0], _cut_error()
                if stale:
                    guesses = (False,)
            for guessing in guesses:  # once more, guessing nothing, when a guess was stale
                committed, again = self._attempt_pipelined(conn, jobs, bounded=bounded, guessing=guessing, cut=cut)
                if committed:
                    return None
                if cut is not None and cut.fired:
                    return jobs[0], _cut_error()
                if not again:
                    break
        return self._attempt_plain(conn, jobs, bounded=bounded, cut=cut)

    def _attempt_batched(
        self, conn: psycopg.Connection[Any], jobs: Sequence[Job[Any]], *, bounded: bool
    ) -> tuple[bool, bool]:
        """``jobs`` in one transaction sent as one string (see the module): (committed, whether a guess was stale).
        When an operation asks for an answer nothing was sent: (False, False), and the work its group did in Python
        is done again pipelined. Rolled back unless committed."""
        built = self._build_batch(conn, jobs, bounded=bounded)
        if built is None:
            return False, False
        tx, query = built
        cursor = self._client
        assert cursor is not None
        try:
            cursor.execute(query)
            rows = tx._read_answers(cursor, tx.first)
            committed = cursor.statusmessage == "COMMIT"  # a transaction aborted unseen would answer ROLLBACK
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise
            self._roll_back(conn)
            self._unprepare(exc)
            self.pipeline_retries += 1
            return False, _sqlstate(exc) == STALE_GUESS
        except BaseException:
            if not conn.broken and not conn.closed:
                self._roll_back(conn)
            raise
        if not committed:
            self._roll_back(conn)
            self.pipeline_retries += 1
            return False, False
        self.batched += 1
        tx._resolve_answers(rows)
        tx._committed()
        return True, False

    def _build_batch(
        self, conn: psycopg.Connection[Any], jobs: Sequence[Job[Any]], *, bounded: bool
    ) -> tuple[PgBatchTx, bytes] | None:
        """``jobs`` run into a :class:`PgBatchTx`, and the string of their transaction (encoded); None when one asked
        for an answer, failed, or bound a value the string cannot carry (nothing was sent: the pipelined path runs
        them, and tells who failed)."""
        if self._client is None or self._client.connection is not conn:
            self._client = psycopg.ClientCursor(conn)
            self._literals = psycopg.adapt.Transformer(self._client)
        tx = PgBatchTx(self._client, self._literals, self._executes)
        try:
            for job in jobs:
                job.result, job.error = None, None
                job.result = job.op(tx)
                if tx.asked:
                    return None
            tx._run_deferred()
            if tx.asked:
                return None
            tx._send_notices()
        except (_NeedsAnswers, Exception):
            return None
        head = ["BEGIN"]
        if bounded:
            head.append(f"SET LOCAL lock_timeout = {int(self.lock_timeout_ms)}")
        tx.first = len(head)
        try:
            return tx, ";\n".join([*head, *tx.statements, "COMMIT"]).encode(tx._encoding)
        except UnicodeEncodeError:
            # A value that is no text in the connection's encoding (a lone surrogate, say): the pipelined path binds
            # each operation's values apart, so that operation alone fails. Raised here, it left a group sent from
            # the loop in flight for good (every later write waited), and failed a whole group on the thread.
            return None

    def _attempt_pipelined(
        self,
        conn: psycopg.Connection[Any],
        jobs: Sequence[Job[Any]],
        *,
        bounded: bool,
        guessing: bool = False,
        cut: _Cut | None = None,
    ) -> tuple[bool, bool]:
        """``jobs`` in one transaction in pipeline mode: (committed, whether to try again so because a guess was
        stale, :data:`STALE_GUESS`). Rolled back unless committed.

        A statement whose answer nobody waits for (``BEGIN``, ``send``, the notifications, the audit rows) goes
        out with the next one that is waited for, so a group costs a round trip per read, not per statement (one
        in all when its operations read nothing before the commit: ``guessing``, see :meth:`PgTx.guess`). An
        error surfaces at the next read, possibly inside another operation than the one that caused it: any
        failure here therefore rolls the whole group back and leaves it to the plain path to run again.
        """
        failure: Exception | None = None
        committed = False
        tx: PgTx | None = None
        try:
            with conn.cursor() as cursor:
                with conn.pipeline() as pipeline:
                    try:
                        cursor.execute("BEGIN")
                        if bounded:
                            cursor.execute(f"SET LOCAL lock_timeout = {int(self.lock_timeout_ms)}")
                        tx = PgTx(cursor, pipeline, guessing=guessing)
                        for job in jobs:
                            job.result, job.error = None, None
                            job.result = job.op(tx)
                        tx._resolve_laters()
                        tx._run_deferred()
                        tx._send_notices()
                        if cut is not None and cut.fired:  # past a deadline: no COMMIT goes out
                            raise _cut_error()
                        cursor.execute("COMMIT")
                    except Exception as exc:  # caught here, so the pipeline's end is no error psycopg logs as ignored
                        failure = exc
                # The pipeline's end sent the one sync and read every answer, the COMMIT's among them.
                committed = failure is None and cursor.statusmessage == "COMMIT"  # an aborted one answers ROLLBACK
        except Exception as exc:  # the pipeline's end: the sync of what an aborted transaction still had out
            failure = failure or exc
        except BaseException:
            if tx is not None:
                tx._drop_guesses()
            if not conn.broken and not conn.closed:
                self._roll_back(conn)
            raise
        assert tx is not None or failure is not None
        if failure is not None or not committed or tx is None:
            if tx is not None:
                tx._drop_guesses()
            if failure is not None and (conn.broken or conn.closed):
                raise failure
            self._roll_back(conn)
            self.pipeline_retries += 1
            return False, failure is not None and _sqlstate(failure) == STALE_GUESS
        tx._resolve_guesses()  # their answers came in with the COMMIT's
        tx._committed()
        return True, False

    @staticmethod
    def _roll_back(conn: psycopg.Connection[Any]) -> None:
        if conn.info.transaction_status == TransactionStatus.IDLE:
            return
        try:
            conn.execute("ROLLBACK")
        except psycopg.Error as rollback:  # the original error matters more
            log.warning("store.rollback_failed", error=f"{type(rollback).__name__}: {rollback}")

    def _attempt_plain(
        self, conn: psycopg.Connection[Any], jobs: Sequence[Job[Any]], *, bounded: bool, cut: _Cut | None = None
    ) -> tuple[Job[Any], Exception] | None:
        """``jobs`` in one transaction, each statement waited for: None once committed, or the job that failed."""
        with conn.cursor() as cursor:
            cursor.execute("BEGIN")
            try:
                if bounded:
                    cursor.execute(f"SET LOCAL lock_timeout = {int(self.lock_timeout_ms)}")
                tx = PgTx(cursor)
                for job in jobs:
                    job.result, job.error = None, None
                    try:
                        job.result = job.op(tx)
                        if conn.info.transaction_status == TransactionStatus.INERROR:
                            raise _SwallowedError("the operation went on after a database error")
                    except Exception as exc:
                        if conn.broken or conn.closed:
                            raise
                        cursor.execute("ROLLBACK")
                        return job, exc
                # What the operations deferred to the end (the audit chain's links): a failure undoes them all.
                tx._resolve_laters()
                tx._run_deferred()
                tx._send_notices()
                if cut is not None and cut.fired:  # past a deadline: no COMMIT goes out
                    self._roll_back(conn)
                    return jobs[0], _cut_error()
                cursor.execute("COMMIT")
                if cursor.statusmessage != "COMMIT":
                    # Aborted unseen (what ran at its end swallowed a database error): the server answered the
                    # COMMIT with ROLLBACK and kept nothing, so no operation may be answered as if it had.
                    raise _UnseenRollback(
                        f"the transaction was aborted unseen: its COMMIT answered {cursor.statusmessage}"
                    )
                tx._committed()
            except BaseException:
                if not conn.broken and not conn.closed:
                    self._roll_back(conn)
                raise
        return None


def _was_cut(cut: _Cut | None, conn: psycopg.Connection[Any]) -> bool:
    """Whether an attempt that raised was cut at a deadline, on a connection still up: then it failed on the server,
    which rolled it back (a COMMIT it refused included), so nothing of it was kept."""
    return cut is not None and cut.fired and not conn.broken and not conn.closed


def _cut_error() -> WriteGivenUp:
    return WriteGivenUp("the transaction was cut at a write's deadline and rolled back: nothing of it was committed")


def _sqlstate(exc: BaseException) -> str | None:
    return exc.sqlstate if isinstance(exc, psycopg.Error) else None


class PgStore:
    """A component's backend on PostgreSQL: ``one``/``all`` reads and the shared :class:`PgWriter`.

    A read first waits for the writes this process submitted before it, as on
    SQLite: whoever wrote and then reads sees the write.
    """

    def __init__(self, pool: AsyncConnectionPool[Any], writer: PgWriter) -> None:
        self.pool = pool
        self._writer = writer

    async def writer(self) -> PgWriter:
        return self._writer

    @property
    def conninfo(self) -> str:
        return self._writer.conninfo

    @property
    def connect_timeout(self) -> float:
        """How long an open of a session of this store may take (the pool's and the writer's bound)."""
        return self._writer.connect_timeout

    @property
    def writer_pid(self) -> int | None:
        """The server process of the writer's connection (NOTIFYs this process sends carry it)."""
        return self._writer.backend_pid

    @property
    def refusing_writes(self) -> str | None:
        """Why the writer's last writes were refused by a read-only session, until one is taken again."""
        return self._writer.refusing_writes

    @property
    def writer_refusals(self) -> int:
        """How many of the writer's groups were refused by a read-only session so far."""
        return self._writer.refusals

    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        await self._writer.caught_up()
        async with self.pool.connection() as conn:
            cursor = await conn.execute(pyformat(sql), tuple(params))
            return await cursor.fetchone()

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        await self._writer.caught_up()
        async with self.pool.connection() as conn:
            cursor = await conn.execute(pyformat(sql), tuple(params))
            return list(await cursor.fetchall())

    async def close(self) -> None:
        await self._writer.close()
        await self.pool.close()


class _PgMigrations:
    """Migrations on their own connection, in one transaction under an advisory lock.

    DDL is transactional in PostgreSQL: a failed migration leaves nothing behind, and a replica that
    waited for the lock finds every migration recorded and applies none.
    """

    name = "postgresql"

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self.conn.transaction():
            await self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await self.conn.execute(_SCHEMA_TABLE)
            yield

    async def execute(self, sql: str, params: Sequence[object] = ()) -> None:
        if params:
            await self.conn.execute(pyformat(sql), tuple(params))
        else:  # sent as written: psycopg reads no placeholders in a statement without parameters
            await self.conn.execute(sql)

    async def fetch(self, sql: str) -> list[Sequence[Any]]:
        cursor = await self.conn.execute(sql)
        return list(await cursor.fetchall())


async def apply_pg_migrations(
    conninfo: str, migrations: Iterable[Migration], *, application_name: str = "kazma-migrate"
) -> list[Migration]:
    """Apply every migration not yet recorded, in one transaction under an advisory lock; the ones applied now."""
    conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True, application_name=application_name)
    async with conn:
        return await run_migrations(_PgMigrations(conn), migrations)


async def open_pg_store(
    conninfo: str,
    *,
    migrations: Iterable[Migration] = (),
    application_name: str = "kazma",
    pool_size: int = 4,
    connect_timeout: float = 10.0,
) -> PgStore:
    """Migrate, then open the read pool (waiting until it has a connection) and the writer."""
    await apply_pg_migrations(conninfo, migrations, application_name=f"{application_name}-migrate")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        conninfo,
        min_size=1,
        max_size=max(1, pool_size),
        open=False,
        timeout=connect_timeout,
        kwargs={"autocommit": True, "application_name": f"{application_name}-read"},
        configure=nul_safe_async,  # text with U+0000 reads back as written (pg_text.py)
        name=f"{application_name}-read",
    )
    await pool.open(wait=True, timeout=connect_timeout)
    writer = PgWriter(conninfo, application_name=f"{application_name}-writer", connect_timeout=connect_timeout)
    return PgStore(pool, writer)
