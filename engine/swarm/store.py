"""Swarm tasks on disk: every run is a RUNNING row before its first worker call.

A task row carries a ``generation`` and a random ``run_id``. Every write a run
makes (its current step, a journal entry, pause, finish) is a compare-and-set
on ``(id, generation, run_id, status)``, so a run that was cancelled, resumed
as a newer generation or marked interrupted after a restart can no longer
touch the row. A refused write is logged, counted and kept in
``swarm_rejected_writes`` as evidence rather than silently dropped.

After a crash :meth:`SwarmTaskStore.recover` turns rows left RUNNING into
INTERRUPTED with an unknown outcome. Nothing here ever re-runs a task.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import secrets
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog

from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.store.backend import SqlStatements, StoreConnection, Tx, is_postgres, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration
from kazma.engine.swarm.call_records import TASK_WORKER, CallRecords
from kazma.engine.swarm.metrics import swarm_failure
from kazma.engine.swarm.owners import held_by_a_terminal
from kazma.engine.swarm.types import ErrorKind, TaskStatus, WorkerResult
from kazma.engine.tools.executions import row_fence

log = structlog.get_logger("kazma.swarm")

T = TypeVar("T")
# Transient store errors (another process holding the write lock) clear in milliseconds.
_RETRY = Backoff(base=0.05, cap=2.0, jitter=False)

MIGRATIONS = [
    Migration(
        "swarm",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_tasks (
                id TEXT PRIMARY KEY,
                pattern TEXT NOT NULL,
                status TEXT NOT NULL,
                generation INTEGER NOT NULL,
                run_id TEXT NOT NULL,
                request_json TEXT NOT NULL,
                result_json TEXT,
                error TEXT,
                current_step TEXT NOT NULL DEFAULT '',
                owner TEXT NOT NULL,
                route TEXT,
                parent_id TEXT,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                finished_at REAL
            )
            """,
            "CREATE INDEX IF NOT EXISTS swarm_tasks_status ON swarm_tasks (status)",
            "CREATE INDEX IF NOT EXISTS swarm_tasks_created ON swarm_tasks (created_at)",
            "CREATE INDEX IF NOT EXISTS swarm_tasks_finished ON swarm_tasks (finished_at)",
            # One row per step position: the index is the step's place in the task,
            # shared by every generation, so a resumed pipeline cannot record a step twice.
            """
            CREATE TABLE IF NOT EXISTS swarm_steps (
                task_id TEXT NOT NULL,
                generation INTEGER NOT NULL,
                idx INTEGER NOT NULL,
                worker TEXT NOT NULL,
                ok INTEGER NOT NULL,
                output TEXT NOT NULL,
                error TEXT NOT NULL,
                error_kind TEXT,
                changed_state INTEGER NOT NULL DEFAULT 0,
                at REAL NOT NULL,
                PRIMARY KEY (task_id, idx)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS swarm_rejected_writes (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                task_id TEXT NOT NULL,
                generation INTEGER NOT NULL,
                run_id TEXT NOT NULL,
                attempted_status TEXT NOT NULL,
                reason TEXT NOT NULL,
                payload TEXT NOT NULL,
                at REAL NOT NULL
            )
            """,
            "CREATE INDEX IF NOT EXISTS swarm_rejected_task ON swarm_rejected_writes (task_id)",
        ),
    ),
    # The replica running a task: among replicas on one database, the leader marks a RUNNING task interrupted
    # only when the replica running it is gone. NULL: the only process on the store (or before this).
    Migration("swarm", 2, ("ALTER TABLE swarm_tasks ADD COLUMN replica TEXT",)),
    # Every worker call's record (model, tools with their approvals, times, tokens, cost, error), and which
    # workers each task named or ran, so tasks can be listed by worker with an exact match on both engines.
    Migration(
        "swarm",
        3,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_calls (
                task_id TEXT NOT NULL,
                seq INTEGER NOT NULL,
                generation INTEGER NOT NULL,
                worker TEXT NOT NULL,
                step TEXT NOT NULL DEFAULT '',
                attempt INTEGER NOT NULL,
                model TEXT NOT NULL DEFAULT '',
                tools_json TEXT NOT NULL DEFAULT '[]',
                started_at REAL NOT NULL,
                finished_at REAL,
                ok INTEGER,
                error TEXT NOT NULL DEFAULT '',
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                cost REAL,
                PRIMARY KEY (task_id, seq)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS swarm_task_workers (
                worker TEXT NOT NULL,
                task_id TEXT NOT NULL,
                PRIMARY KEY (worker, task_id)
            )
            """,
        ),
    ),
]

# The same tables on PostgreSQL. ``rowid`` is SQLite's implicit row id made a real column: the lists order
# equal times by it (newest admitted first), so the same SQL serves both engines, SQLite keeps reading its
# (created_at, rowid) index in order, and ``kazma store copy`` carries each row's id over.
PG_MIGRATIONS = [
    PgMigration(
        "swarm",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_tasks (
                id text PRIMARY KEY,
                pattern text NOT NULL,
                status text NOT NULL,
                generation integer NOT NULL,
                run_id text NOT NULL,
                request_json text NOT NULL,
                result_json text,
                error text,
                current_step text NOT NULL DEFAULT '',
                owner text NOT NULL,
                route text,
                parent_id text,
                created_at double precision NOT NULL,
                updated_at double precision NOT NULL,
                finished_at double precision,
                rowid bigint GENERATED BY DEFAULT AS IDENTITY UNIQUE
            )
            """,
            "CREATE INDEX IF NOT EXISTS swarm_tasks_status ON swarm_tasks (status)",
            "CREATE INDEX IF NOT EXISTS swarm_tasks_created ON swarm_tasks (created_at, rowid)",
            "CREATE INDEX IF NOT EXISTS swarm_tasks_finished ON swarm_tasks (finished_at, rowid)",
            """
            CREATE TABLE IF NOT EXISTS swarm_steps (
                task_id text NOT NULL,
                generation integer NOT NULL,
                idx integer NOT NULL,
                worker text NOT NULL,
                ok integer NOT NULL,
                output text NOT NULL,
                error text NOT NULL,
                error_kind text,
                changed_state integer NOT NULL DEFAULT 0,
                at double precision NOT NULL,
                PRIMARY KEY (task_id, idx)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS swarm_rejected_writes (
                id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                task_id text NOT NULL,
                generation integer NOT NULL,
                run_id text NOT NULL,
                attempted_status text NOT NULL,
                reason text NOT NULL,
                payload text NOT NULL,
                at double precision NOT NULL
            )
            """,
            "CREATE INDEX IF NOT EXISTS swarm_rejected_task ON swarm_rejected_writes (task_id)",
        ),
    ),
    PgMigration("swarm", 2, ("ALTER TABLE swarm_tasks ADD COLUMN replica text",)),
    PgMigration(
        "swarm",
        3,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_calls (
                task_id text NOT NULL,
                seq integer NOT NULL,
                generation integer NOT NULL,
                worker text NOT NULL,
                step text NOT NULL DEFAULT '',
                attempt integer NOT NULL,
                model text NOT NULL DEFAULT '',
                tools_json text NOT NULL DEFAULT '[]',
                started_at double precision NOT NULL,
                finished_at double precision,
                ok integer,
                error text NOT NULL DEFAULT '',
                prompt_tokens bigint NOT NULL DEFAULT 0,
                completion_tokens bigint NOT NULL DEFAULT 0,
                cost double precision,
                PRIMARY KEY (task_id, seq)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS swarm_task_workers (
                worker text NOT NULL,
                task_id text NOT NULL,
                PRIMARY KEY (worker, task_id)
            )
            """,
        ),
    ),
]

# Terminal states are never left, and there is no pending state to return to:
# a task is RUNNING from the moment it exists.
TRANSITIONS: dict[TaskStatus, frozenset[TaskStatus]] = {
    TaskStatus.RUNNING: frozenset(
        {
            TaskStatus.PAUSED,
            TaskStatus.SUCCEEDED,
            TaskStatus.PARTIAL,
            TaskStatus.FAILED,
            TaskStatus.CANCELLED,
            TaskStatus.TIMEOUT,
            TaskStatus.INTERRUPTED,
        }
    ),
    TaskStatus.PAUSED: frozenset({TaskStatus.RUNNING, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.INTERRUPTED}),
    TaskStatus.SUCCEEDED: frozenset(),
    TaskStatus.PARTIAL: frozenset(),
    TaskStatus.FAILED: frozenset(),
    TaskStatus.CANCELLED: frozenset(),
    TaskStatus.TIMEOUT: frozenset(),
    TaskStatus.INTERRUPTED: frozenset(),
}


def allowed_from(target: TaskStatus) -> frozenset[TaskStatus]:
    """The states from which ``target`` may be reached."""
    return frozenset(source for source, targets in TRANSITIONS.items() if target in targets)


class AtCapacity(Exception):
    """``max_running`` tasks already run; nothing was written."""

    def __init__(self, retry_in: int) -> None:
        super().__init__(f"the swarm is at capacity; try again in about {retry_in} s")
        self.retry_in = retry_in


class StoreUnavailable(Exception):
    """The store kept failing with transient errors after every retry."""

    def __init__(self, operation: str, reason: str) -> None:
        super().__init__(f"the task store is unavailable ({operation}): {reason}")
        self.operation = operation
        self.reason = reason


class UnknownTask(LookupError):
    def __init__(self, task_id: str) -> None:
        super().__init__(f"no swarm task {task_id!r}")
        self.task_id = task_id


class IllegalTransition(Exception):
    """An operator action (resume) asked for a transition the task's current state does not allow."""


@dataclass(frozen=True)
class TaskRun:
    """The capability to write to one run of a task; stale once the task moves on."""

    task_id: str
    generation: int
    run_id: str


@dataclass(frozen=True)
class TaskFence:
    """A tool of a swarm task starts only while the task is still the run that starts it: its row, that
    generation and run, RUNNING, on this replica (an :class:`~kazma.engine.tools.executions.Fence`).

    Among replicas the leader ends the running tasks of a replica it judged gone as interrupted, and a cancel
    heard elsewhere ends one; the process running it may still run, and learns of it only by reading the row
    (every :data:`~kazma.engine.swarm.service.ENDED_POLL_SECONDS`). The tool's execution row is written over
    the task's row in one statement (see :func:`~kazma.engine.tools.executions.row_fence`): the ending waits
    for a row going in and then names the tool, or comes first and the tool never starts."""

    current: Callable[[], TaskRun]  # the run now (a checkpoint's resume moves the task to a new one)
    replica: str | None
    postgres: bool
    stop: Callable[[], Awaitable[None]] | None = None  # stops the task here once it reads it ended elsewhere

    def source(self) -> tuple[str, tuple[Any, ...]]:
        run = self.current()
        where = {"id": run.task_id, "generation": run.generation, "run_id": run.run_id,
                 "status": TaskStatus.RUNNING.value}  # fmt: skip
        return row_fence("swarm_tasks", where, self.replica, self.postgres)

    async def refused(self) -> None:
        if self.stop is not None:
            await self.stop()


@dataclass(frozen=True)
class TaskRecord:
    id: str
    pattern: str  # the registered pattern's name
    status: TaskStatus
    generation: int
    run_id: str
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    current_step: str
    owner: str
    route: str | None
    parent_id: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class StepRecord:
    task_id: str
    generation: int
    idx: int
    worker: str
    ok: bool
    output: str
    error: str
    error_kind: ErrorKind | None
    changed_state: bool
    at: datetime

    def to_result(self) -> WorkerResult:
        """The journaled result as the pipeline saw it (usage is not kept)."""
        return WorkerResult(
            self.worker,
            self.ok,
            output=self.output,
            error=self.error,
            error_kind=self.error_kind,
            changed_state=self.changed_state,
        )


@dataclass(frozen=True)
class InterruptedTask:
    task_id: str
    pattern: str  # the registered pattern's name
    generation: int
    step: str
    owner: str
    route: str | None
    error: str


@dataclass(frozen=True)
class RejectedWrite:
    task_id: str
    generation: int
    run_id: str
    attempted_status: str
    reason: str
    payload: dict[str, Any]
    at: datetime


_TASK_COLUMNS = (
    "id, pattern, status, generation, run_id, request_json, result_json, error, current_step, owner, route,"
    " parent_id, created_at, updated_at, finished_at"
)


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return any(marker in text for marker in ("locked", "busy", "disk i/o", "unable to open"))
    # PostgreSQL's: a lost connection, a pool timeout, a deadlock victim, a serialisation failure. Looked up,
    # not imported: psycopg is loaded only when the store is on PostgreSQL.
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(exc, psycopg.OperationalError):
        return True
    return isinstance(exc, OSError)


_PAUSE = (
    "UPDATE swarm_tasks SET status = ?, current_step = ?, updated_at = ?"
    " WHERE id = ? AND generation = ? AND run_id = ? AND status = ?"
)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def new_task_id() -> str:
    """A task's id: 72 random bits, URL-safe, never starting with ``-`` (``kazma swarm status -x…`` reads an
    id like that as an option, and the person cannot look the task up)."""
    while (task_id := secrets.token_urlsafe(9)).startswith("-"):
        continue
    return task_id


async def _with_kept(db: SqlStatements, task_id: str, result_json: str | None) -> str | None:
    """``result_json`` with the answers the task's journal kept (``workers``, as a run's own ending lists them),
    for an ending written without its run (a crash, a stop, a cancel): what was kept must be visible wherever
    the task is shown (endings.kept_answers), not only in the journal. Unchanged when the result lists its
    workers already or nothing was kept."""
    result = json.loads(result_json) if result_json else {}
    if not isinstance(result, dict) or "workers" in result:
        return result_json
    rows = await db.all(
        "SELECT worker, output FROM swarm_steps WHERE task_id = ? AND ok = ? ORDER BY idx", (task_id, 1)
    )
    if not rows:
        return result_json
    result["workers"] = [{"worker": str(w), "ok": True, "output": str(o)} for w, o in rows]
    return json.dumps(result, sort_keys=True, default=str)


def interrupted_reason(step: str) -> str:
    if step:
        return f"interrupted: the process stopped in {step}; its outcome is unknown"
    return "interrupted: the process stopped before its first step; its outcome is unknown"


class SwarmTaskStore(CallRecords):
    """Swarm task rows, their step journal and the evidence of refused writes.

    Give it its own connection (:func:`kazma.config.store.database.connect` with
    :data:`MIGRATIONS` applied), or the PostgreSQL backend (:data:`PG_MIGRATIONS`).
    On SQLite every statement, reads included, runs under one lock: a read cursor
    left open on a shared connection pins an old WAL snapshot and a later
    ``BEGIN IMMEDIATE`` on it fails with SQLITE_BUSY. On PostgreSQL the writes'
    transactions run one after another under an advisory lock
    (:class:`~kazma.config.store.pg_tables.PgTables`), across replicas too.
    """

    def __init__(
        self,
        conn: StoreConnection,
        *,
        clock: Callable[[], float] = time.time,
        retries: int = 3,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        capacity_retry_in: int = 10,
        replica: str | None = None,
    ) -> None:
        self.conn = conn
        self.replica = replica  # recorded on each task this process admits or resumes (None: the only process)
        self.clock = clock
        self.retries = max(0, retries)
        self.sleep = sleep
        self.capacity_retry_in = capacity_retry_in
        self.tables = tables_of(conn)
        self.postgres = is_postgres(conn)

    def fence(self, current: Callable[[], TaskRun], stop: Callable[[], Awaitable[None]] | None = None) -> TaskFence:
        """What a tool of the task whose run is ``current()`` (run here) starts under: see :class:`TaskFence`.
        ``stop`` is awaited once a tool was refused under it."""
        return TaskFence(current, self.replica, self.postgres, stop)

    # -- plumbing ---------------------------------------------------------------

    async def _attempt(
        self, operation: str, body: Callable[[SqlStatements], Awaitable[T]], *, transaction: bool = False
    ) -> T:
        """Run ``body`` holding the tables (in a transaction when it writes), retrying transient errors.

        The tables are released between attempts so a slow retry does not hold up readers.
        """
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await self.sleep(_RETRY.delay(attempt - 1))
            try:
                async with self.tables.transaction() if transaction else self.tables.locked() as db:
                    return await body(db)
            except Exception as exc:
                if not _transient(exc):
                    raise
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("swarm.store_retry", operation=operation, attempt=attempt + 1, reason=reason)
        count_failure("task_store_unavailable")
        log.error("swarm.store_unavailable", operation=operation, reason=reason)
        raise StoreUnavailable(operation, reason)

    async def _guarded(
        self,
        operation: str,
        run: TaskRun,
        attempted: TaskStatus,
        sources: Iterable[TaskStatus],
        write: Callable[[SqlStatements], Awaitable[int]],
        payload: dict[str, Any],
    ) -> bool:
        """Run one compare-and-set ``write``; when it changes nothing, keep the evidence of why."""
        source_set = frozenset(sources)

        async def body(db: SqlStatements) -> str | None:
            if await write(db) == 1:
                return None
            row = await db.one("SELECT status, generation, run_id FROM swarm_tasks WHERE id = ?", (run.task_id,))
            return _why_rejected(row, run, attempted, source_set, operation)

        reason = await self._attempt(operation, body, transaction=True)
        if reason is None:
            return True
        log.warning(
            "swarm.write_rejected",
            task_id=run.task_id,
            generation=run.generation,
            run_id=run.run_id,
            operation=operation,
            attempted_status=attempted.value,
            reason=reason,
        )
        count_failure("task_stale_write")
        await self._keep_evidence(run, attempted, reason, {"operation": operation, **payload})
        return False

    async def _keep_evidence(self, run: TaskRun, attempted: TaskStatus, reason: str, payload: dict[str, Any]) -> None:
        """A refused write is kept in ``swarm_rejected_writes``; when even that fails, the log keeps it, counted."""
        text = json.dumps(payload, default=str)

        async def body(db: SqlStatements) -> None:
            await db.run(
                "INSERT INTO swarm_rejected_writes (task_id, generation, run_id, attempted_status, reason, payload, at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (run.task_id, run.generation, run.run_id, attempted.value, reason, text, self.clock()),
            )

        try:
            await self._attempt("orphan_evidence", body, transaction=True)
        except Exception as exc:  # the evidence must survive somewhere: the warning carries it whole
            swarm_failure("orphan_evidence")
            log.warning(
                "swarm.orphan_evidence_lost",
                task_id=run.task_id,
                generation=run.generation,
                attempted_status=attempted.value,
                reason=reason,
                payload=text,
                error=f"{type(exc).__name__}: {exc}",
            )

    # -- admission and a run's writes -----------------------------------------------

    async def admit(
        self,
        pattern: str,
        request: dict[str, Any],
        *,
        owner: str,
        route: str | None = None,
        parent_id: str | None = None,
        max_running: int | None = None,
        workers: Collection[str] = (),
    ) -> TaskRun:
        """Write the task RUNNING (generation 1, fresh run id) before any of its work starts.

        With ``max_running`` the count of RUNNING tasks and the insert happen in one
        ``BEGIN IMMEDIATE`` transaction, so two processes cannot both take the last slot;
        a full swarm raises :class:`AtCapacity` and writes nothing. Raises
        :class:`StoreUnavailable` when the row could not be written: the work must not start.
        ``workers`` are the ones the task names: :meth:`tasks_of` finds it by any of them.
        """
        body_json = json.dumps({"pattern": str(pattern), **request}, sort_keys=True)
        run = TaskRun(new_task_id(), 1, secrets.token_urlsafe(12))
        now = self.clock()

        values = (run.task_id, str(pattern), TaskStatus.RUNNING.value, run.generation, run.run_id,
                  body_json, owner, route, parent_id, now, now)  # fmt: skip
        # The cap is a condition of the insert itself (no parameter compared with NULL: PostgreSQL cannot type it).
        capped = "" if max_running is None else " WHERE (SELECT COUNT(*) FROM swarm_tasks WHERE status = ?) < ?"
        cap = () if max_running is None else (TaskStatus.RUNNING.value, max_running)

        tries = 0

        async def body(db: SqlStatements) -> None:
            nonlocal tries
            tries += 1
            if tries > 1:
                # An attempt whose commit went through with its answer lost (a connection dropped as the database
                # committed), tried again: the insert failed on the task's own id, and a task standing RUNNING was
                # reported not admitted (its work never started, its row left for a recovery to end).
                row = await db.one("SELECT run_id FROM swarm_tasks WHERE id = ?", (run.task_id,))
                if row is not None and str(row[0]) == run.run_id:
                    return
            inserted = await db.run(
                f"INSERT INTO swarm_tasks ({_TASK_COLUMNS})"
                f" SELECT ?, ?, ?, ?, ?, ?, NULL, NULL, '', ?, ?, ?, ?, ?, NULL{capped}",
                (*values, *cap),
            )
            if inserted != 1:
                raise AtCapacity(self.capacity_retry_in)
            if self.replica is not None:
                await db.run("UPDATE swarm_tasks SET replica = ? WHERE id = ?", (self.replica, run.task_id))
            await db.run_many(TASK_WORKER, [(worker, run.task_id) for worker in sorted(set(workers))])

        await self._attempt("admit", body, transaction=True)
        log.info("swarm.admitted", task_id=run.task_id, pattern=str(pattern), owner=owner, route=route)
        return run

    async def step(self, run: TaskRun, name: str) -> bool:
        """Record which step or worker the run is in now; refused unless ``run`` is current and RUNNING."""
        return await self._guarded(
            "step",
            run,
            TaskStatus.RUNNING,
            {TaskStatus.RUNNING},
            lambda db: db.run(
                "UPDATE swarm_tasks SET current_step = ?, updated_at = ?"
                " WHERE id = ? AND generation = ? AND run_id = ? AND status = ?",
                (name, self.clock(), run.task_id, run.generation, run.run_id, TaskStatus.RUNNING.value),
            ),
            {"step": name},
        )

    async def journal(self, run: TaskRun, idx: int, worker: str, result: WorkerResult) -> bool:
        """Append step ``idx`` to the journal; refused for a stale run, a task not RUNNING, or an ``idx`` already kept.

        ``idx`` is the step's position in the whole task, not within a generation.
        """
        return await self._guarded(
            "journal",
            run,
            TaskStatus.RUNNING,
            {TaskStatus.RUNNING},
            lambda db: db.run(
                "INSERT INTO swarm_steps"
                " (task_id, generation, idx, worker, ok, output, error, error_kind, changed_state, at)"
                " SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM swarm_tasks"
                " WHERE id = ? AND generation = ? AND run_id = ? AND status = ?) ON CONFLICT DO NOTHING",
                (
                    run.task_id,
                    run.generation,
                    idx,
                    worker,
                    int(result.ok),
                    result.output,
                    result.error,
                    None if result.error_kind is None else result.error_kind.value,
                    int(result.changed_state),
                    self.clock(),
                    run.task_id,
                    run.generation,
                    run.run_id,
                    TaskStatus.RUNNING.value,
                ),
            ),
            {"idx": idx, "worker": worker, "ok": result.ok, "error": result.error},
        )

    async def journaled(self, task_id: str) -> builtins.list[StepRecord]:
        """Every journaled step of the task, across all generations, in step order.

        A resumed pipeline continues after the last of these; ``generation`` tells
        which run recorded each one.
        """

        async def body(db: SqlStatements) -> builtins.list[Any]:
            return await db.all(
                "SELECT task_id, generation, idx, worker, ok, output, error, error_kind, changed_state, at"
                " FROM swarm_steps WHERE task_id = ? ORDER BY idx",
                (task_id,),
            )

        rows = await self._attempt("journaled", body)
        return [
            StepRecord(
                str(r[0]),
                int(r[1]),
                int(r[2]),
                str(r[3]),
                bool(r[4]),
                str(r[5]),
                str(r[6]),
                None if r[7] is None else ErrorKind(r[7]),
                bool(r[8]),
                _utc(float(r[9])),
            )
            for r in rows
        ]

    async def tasks_of(self, worker: str, limit: int = 50) -> builtins.list[TaskRecord]:
        """Tasks that named ``worker`` or ran it (a handoff's target too), newest first; the name matches exactly."""
        return await self._tasks(
            "tasks_of",
            f"SELECT {_TASK_COLUMNS} FROM swarm_tasks WHERE id IN"  # noqa: S608
            " (SELECT task_id FROM swarm_task_workers WHERE worker = ?) ORDER BY created_at DESC, rowid DESC LIMIT ?",
            (worker, limit),
        )

    async def pause(self, run: TaskRun, step: str) -> bool:
        """RUNNING → PAUSED at ``step`` (a checkpoint waits). The run keeps its generation until :meth:`resume`."""
        return await self._guarded(
            "pause",
            run,
            TaskStatus.PAUSED,
            allowed_from(TaskStatus.PAUSED),
            lambda db: db.run(
                _PAUSE,
                (
                    TaskStatus.PAUSED.value,
                    step,
                    self.clock(),
                    run.task_id,
                    run.generation,
                    run.run_id,
                    TaskStatus.RUNNING.value,
                ),
            ),
            {"step": step},
        )

    def pause_statements(self, run: TaskRun, step: str) -> Callable[[Tx], int]:
        """:meth:`pause` as statements for another store's transaction (the one that opens the checkpoint's
        approval request, so the paused row and its card commit together): the rows changed, 1 or 0."""
        now = self.clock()

        def op(tx: Tx) -> int:
            return tx.run(
                _PAUSE,
                (TaskStatus.PAUSED.value, step, now, run.task_id, run.generation, run.run_id, TaskStatus.RUNNING.value),
            )

        return op

    async def pause_refused(self, run: TaskRun, step: str) -> str:
        """Why a pause in another store's transaction changed no row (kept as evidence, as :meth:`pause` does)."""
        row = await self.tables.one("SELECT status, generation, run_id FROM swarm_tasks WHERE id = ?", (run.task_id,))
        reason = _why_rejected(row, run, TaskStatus.PAUSED, allowed_from(TaskStatus.PAUSED), "pause")
        log.warning("swarm.write_rejected", task_id=run.task_id, generation=run.generation, run_id=run.run_id,
                    operation="pause", attempted_status=TaskStatus.PAUSED.value, reason=reason)  # fmt: skip
        count_failure("task_stale_write")
        await self._keep_evidence(run, TaskStatus.PAUSED, reason, {"operation": "pause", "step": step})
        return reason

    async def resume(self, task_id: str, *, max_running: int | None = None) -> TaskRun:
        """PAUSED → RUNNING as a new generation with a new run id; the journal keeps the earlier steps.

        Every write of the paused run is stale from here on. Raises :class:`UnknownTask`,
        :class:`IllegalTransition` when the task is not paused (two resumers: one wins),
        or :class:`AtCapacity` when ``max_running`` tasks already run.
        """
        new_run_id = secrets.token_urlsafe(12)

        async def body(db: SqlStatements) -> int:
            row = await db.one("SELECT status, generation FROM swarm_tasks WHERE id = ?", (task_id,))
            if row is None:
                raise UnknownTask(task_id)
            if TaskStatus(row[0]) is not TaskStatus.PAUSED:
                raise IllegalTransition(f"task {task_id} is {row[0]}, not paused: it cannot be resumed")
            if max_running is not None:
                running = await db.one("SELECT COUNT(*) FROM swarm_tasks WHERE status = ?", (TaskStatus.RUNNING.value,))
                if int(running[0]) >= max_running:
                    raise AtCapacity(self.capacity_retry_in)
            generation = int(row[1]) + 1
            await db.run(
                "UPDATE swarm_tasks SET status = ?, generation = ?, run_id = ?, updated_at = ?, replica = ?"
                " WHERE id = ? AND status = ?",
                (
                    TaskStatus.RUNNING.value,
                    generation,
                    new_run_id,
                    self.clock(),
                    self.replica,
                    task_id,
                    TaskStatus.PAUSED.value,
                ),
            )
            return generation

        generation = await self._attempt("resume", body, transaction=True)
        log.info("swarm.resumed", task_id=task_id, generation=generation)
        return TaskRun(task_id, generation, new_run_id)

    async def finish(
        self,
        run: TaskRun,
        status: TaskStatus,
        *,
        result: dict[str, Any] | None,
        error: str | None,
    ) -> bool:
        """Move the run's task to the terminal ``status`` by compare-and-set.

        Returns False when the write is refused — ``run`` is an older generation or
        run, or the task's state does not allow ``status`` (it was cancelled, say);
        the refusal is logged as ``swarm.write_rejected``, counted and kept in
        ``swarm_rejected_writes``.

        Transient store errors are retried with backoff. When they persist this
        raises :class:`StoreUnavailable`: the caller must report the run as failed
        with that reason, never as stored work, because nothing was recorded.
        """
        if not status.terminal:
            raise ValueError(f"finish() takes a terminal status, not {status.value}; use pause() or resume()")
        result_json = None if result is None else json.dumps(result, sort_keys=True, default=str)
        sources = allowed_from(status)
        marks = ", ".join("?" for _ in sources)

        async def write(db: SqlStatements) -> int:
            now = self.clock()
            # an ending that lists no workers (a failed checkpoint, a crashed run) keeps the journal's answers
            kept = result_json if status is TaskStatus.SUCCEEDED else await _with_kept(db, run.task_id, result_json)
            changed = await db.run(
                "UPDATE swarm_tasks SET status = ?, result_json = ?, error = ?, updated_at = ?, finished_at = ?"  # noqa: S608
                f" WHERE id = ? AND generation = ? AND run_id = ? AND status IN ({marks})",
                (
                    status.value,
                    kept,
                    error,
                    now,
                    now,
                    run.task_id,
                    run.generation,
                    run.run_id,
                    *sorted(s.value for s in sources),
                ),
            )
            if changed:
                return changed
            # This very ending already there: an attempt whose commit went through with its answer lost (a
            # connection dropped as PostgreSQL committed), tried again. Refused, it was said as the run finishing
            # after its task was ended elsewhere, with its result "not recorded" and never delivered.
            row = await db.one(
                "SELECT generation, run_id, status, error, result_json FROM swarm_tasks WHERE id = ?", (run.task_id,)
            )
            here = row is not None and (int(row[0]), str(row[1]), str(row[2]), row[3], row[4])
            return int(here == (run.generation, run.run_id, status.value, error, kept))

        done = await self._guarded("finish", run, status, sources, write, {"result": result, "error": error})
        if done:
            log.info("swarm.finished", task_id=run.task_id, generation=run.generation, status=status.value)
        return done

    # -- operators and restart ------------------------------------------------------

    async def cancel(
        self,
        task_id: str,
        *,
        actor: str,
        result: dict[str, Any] | None = None,
        only: Iterable[TaskStatus] | None = None,
        error: str | None = None,
    ) -> bool:
        """An operator cancels a RUNNING or PAUSED task, whatever its generation (``error``: what its row says of
        why, "cancelled by <actor>" unless given).

        False when the task already ended. Later writes of its run are refused as
        stale; stopping the coroutine itself is the caller's job. Raises :class:`UnknownTask`.
        ``result`` is stored with it (a clean shutdown records ``interrupted_by``); ``only``
        narrows the states it may be cancelled from.
        """
        allowed = allowed_from(TaskStatus.CANCELLED) if only is None else frozenset(only)
        sources = sorted(s.value for s in allowed)
        given = None if result is None else json.dumps(result, sort_keys=True, default=str)

        async def body(db: SqlStatements) -> int:
            now = self.clock()
            existing = await db.one("SELECT result_json FROM swarm_tasks WHERE id = ?", (task_id,))
            result_json = await _with_kept(db, task_id, given or (None if existing is None else existing[0]))
            changed = await db.run(
                "UPDATE swarm_tasks SET status = ?, error = ?, result_json = COALESCE(?, result_json),"  # noqa: S608
                " updated_at = ?, finished_at = ?"
                f" WHERE id = ? AND status IN ({', '.join('?' for _ in sources)})",
                (
                    TaskStatus.CANCELLED.value,
                    error or f"cancelled by {actor}",
                    result_json,
                    now,
                    now,
                    task_id,
                    *sources,
                ),
            )
            if changed == 0 and await db.one("SELECT 1 FROM swarm_tasks WHERE id = ?", (task_id,)) is None:
                raise UnknownTask(task_id)
            return changed

        changed = await self._attempt("cancel", body, transaction=True)
        if changed:
            log.info("swarm.cancelled", task_id=task_id, actor=actor)
        return changed == 1

    async def keep(self, task_id: str, fields: dict[str, Any]) -> bool:
        """Add ``fields`` to a task's stored result (what its ending says of its tools, after a cancel or a
        restart), whatever its state; False for an unknown task. The result's other fields stay."""

        async def body(db: SqlStatements) -> bool:
            row = await db.one("SELECT result_json FROM swarm_tasks WHERE id = ?", (task_id,))
            if row is None:
                return False
            result = json.loads(row[0]) if row[0] else {}
            if not isinstance(result, dict):
                result = {"result": result}
            result.update(fields)
            await db.run(
                "UPDATE swarm_tasks SET result_json = ? WHERE id = ?",
                (json.dumps(result, sort_keys=True, default=str), task_id),
            )
            return True

        return await self._attempt("keep", body, transaction=True)

    async def recover(
        self, live: Collection[str] | None = None, *, leading: Callable[[], bool] | None = None
    ) -> builtins.list[InterruptedTask]:
        """At start, mark every RUNNING row INTERRUPTED (outcome unknown, naming its step); never re-run it.

        PAUSED rows stay paused: their pipeline can be resumed after the restart.
        Call it once at start, before this process admits work, and only when no
        other live process shares the file — it cannot tell their runs from dead ones.
        Among replicas the leader passes ``live`` (the replicas alive now): only tasks a replica that is
        gone was running are interrupted (a task with no replica recorded is left). A task a terminal runs
        (``kazma swarm …``) is left while that terminal is alive (:mod:`~kazma.engine.swarm.owners`).
        ``leading`` (the leader's sweep): asked before each task is interrupted; once it says no, the rest is
        left (a replica judged gone may be back under its name, running tasks again).
        """

        async def body(db: SqlStatements) -> builtins.list[InterruptedTask]:
            rows = await db.all(
                "SELECT id, pattern, generation, current_step, owner, route, replica, updated_at FROM swarm_tasks"
                " WHERE status = ?",
                (TaskStatus.RUNNING.value,),
            )
            now = self.clock()
            changed: builtins.list[InterruptedTask] = []
            for task_id, pattern, generation, step, owner, route, replica, updated in rows:
                if live is not None and (replica is None or replica in live):
                    continue
                if leading is not None and not leading():
                    break
                if held_by_a_terminal(replica, float(updated), now):  # `kazma swarm …` runs it, alive (see owners)
                    continue
                reason = interrupted_reason(str(step))
                existing = await db.one("SELECT result_json FROM swarm_tasks WHERE id = ?", (task_id,))
                kept = await _with_kept(db, str(task_id), None if existing is None else existing[0])
                if await db.run(
                    "UPDATE swarm_tasks SET status = ?, error = ?, result_json = ?, updated_at = ?, finished_at = ?"
                    " WHERE id = ? AND generation = ? AND status = ?",
                    (
                        TaskStatus.INTERRUPTED.value,
                        reason,
                        kept,
                        now,
                        now,
                        task_id,
                        generation,
                        TaskStatus.RUNNING.value,
                    ),
                ):
                    changed.append(
                        InterruptedTask(
                            str(task_id),
                            str(pattern),
                            int(generation),
                            str(step),
                            str(owner),
                            None if route is None else str(route),
                            reason,
                        )
                    )
            return changed

        interrupted = await self._attempt("recover", body, transaction=True)
        for task in interrupted:
            log.warning("swarm.interrupted", task_id=task.task_id, step=task.step, owner=task.owner)
        return interrupted

    async def adopt_paused(
        self, live: Collection[str], *, leading: Callable[[], bool] | None = None
    ) -> builtins.list[str]:
        """Among replicas: PAUSED tasks whose waiting replica is not in ``live`` (or none is recorded) become this
        replica's, one compare-and-set each, so exactly one replica waits for each checkpoint again. This
        replica's own count when it is left out of ``live`` (at its start: what its previous life paused).
        ``leading``: asked before each adoption; once it says no, the rest is left."""
        rows = await self.tables.all(
            "SELECT id, replica FROM swarm_tasks WHERE status = ? ORDER BY created_at", (TaskStatus.PAUSED.value,)
        )
        adopted: builtins.list[str] = []
        for task_id, replica in rows:
            if replica is not None and replica in live:
                continue
            if leading is not None and not leading():
                break
            held = "replica IS NULL" if replica is None else "replica = ?"
            params = (self.replica, task_id, TaskStatus.PAUSED.value, *(() if replica is None else (replica,)))
            if await self.tables.run(
                f"UPDATE swarm_tasks SET replica = ? WHERE id = ? AND status = ? AND {held}",  # noqa: S608
                params,
            ):
                log.warning("swarm.paused_adopted", task_id=task_id, gone=replica, replica=self.replica)
                adopted.append(str(task_id))
        return adopted

    # -- reads ------------------------------------------------------------------------

    async def _tasks(self, operation: str, sql: str, params: tuple[Any, ...]) -> builtins.list[TaskRecord]:
        async def body(db: SqlStatements) -> builtins.list[Any]:
            return await db.all(sql, params)

        return [_record(r) for r in await self._attempt(operation, body)]

    async def get(self, task_id: str) -> TaskRecord | None:
        rows = await self._tasks("get", f"SELECT {_TASK_COLUMNS} FROM swarm_tasks WHERE id = ?", (task_id,))  # noqa: S608
        return rows[0] if rows else None

    async def touch(self, task_ids: Collection[str]) -> None:
        """The running ``task_ids`` are alive here (a terminal's heartbeat: see owners)."""
        if not task_ids:
            return
        wanted = sorted(task_ids)

        async def body(db: SqlStatements) -> None:
            await db.run(
                f"UPDATE swarm_tasks SET updated_at = ? WHERE id IN ({', '.join('?' * len(wanted))})"  # noqa: S608
                " AND status = ?",
                (self.clock(), *wanted, TaskStatus.RUNNING.value),
            )

        await self._attempt("touch", body, transaction=True)

    async def ended(self, task_ids: Collection[str]) -> dict[str, TaskRecord]:
        """Those of ``task_ids`` whose rows have ended (or are gone: absent from the answer's keys and not asked
        again), each with its row: what a process running them learns of a cancel made elsewhere."""
        if not task_ids:
            return {}
        wanted = sorted(task_ids)
        terminal = [status.value for status in TaskStatus if status.terminal]
        rows = await self._tasks(
            "ended",
            f"SELECT {_TASK_COLUMNS} FROM swarm_tasks WHERE id IN ({', '.join('?' * len(wanted))})"  # noqa: S608
            f" AND status IN ({', '.join('?' * len(terminal))})",
            (*wanted, *terminal),
        )
        return {record.id: record for record in rows}

    async def list(self, status: TaskStatus | None = None, limit: int = 50) -> builtins.list[TaskRecord]:
        """Tasks newest first, optionally only those in ``status``."""
        if status is None:
            return await self._tasks(
                "list",
                f"SELECT {_TASK_COLUMNS} FROM swarm_tasks ORDER BY created_at DESC, rowid DESC LIMIT ?",  # noqa: S608
                (limit,),
            )
        return await self._tasks(
            "list",
            f"SELECT {_TASK_COLUMNS} FROM swarm_tasks WHERE status = ?"  # noqa: S608
            " ORDER BY created_at DESC, rowid DESC LIMIT ?",
            (status.value, limit),
        )

    async def history(self, limit: int = 20) -> builtins.list[TaskRecord]:
        """Finished tasks, most recently finished first."""
        return await self._tasks(
            "history",
            f"SELECT {_TASK_COLUMNS} FROM swarm_tasks WHERE finished_at IS NOT NULL"  # noqa: S608
            " ORDER BY finished_at DESC, rowid DESC LIMIT ?",
            (limit,),
        )

    async def count(self, status: TaskStatus) -> int:
        async def body(db: SqlStatements) -> Any:
            return await db.one("SELECT COUNT(*) FROM swarm_tasks WHERE status = ?", (status.value,))

        row = await self._attempt("count", body)
        return int(row[0])

    async def rejected_writes(self, task_id: str) -> builtins.list[RejectedWrite]:
        async def body(db: SqlStatements) -> builtins.list[Any]:
            return await db.all(
                "SELECT task_id, generation, run_id, attempted_status, reason, payload, at"
                " FROM swarm_rejected_writes WHERE task_id = ? ORDER BY id",
                (task_id,),
            )

        return [
            RejectedWrite(str(r[0]), int(r[1]), str(r[2]), str(r[3]), str(r[4]), json.loads(r[5]), _utc(float(r[6])))
            for r in await self._attempt("rejected_writes", body)
        ]

    async def prune(self, older_than_days: int) -> int:
        """Delete tasks that finished more than ``older_than_days`` ago, with their journal and rejected-write rows.

        RUNNING and PAUSED tasks are never pruned. Returns how many tasks went.
        """
        cutoff = self.clock() - older_than_days * 86400.0
        terminal = sorted(s.value for s in TaskStatus if s.terminal)
        marks = ", ".join("?" for _ in terminal)
        doomed = f"SELECT id FROM swarm_tasks WHERE finished_at IS NOT NULL AND finished_at < ? AND status IN ({marks})"  # noqa: S608

        async def body(db: SqlStatements) -> int:
            params = (cutoff, *terminal)
            await db.run(f"DELETE FROM swarm_steps WHERE task_id IN ({doomed})", params)  # noqa: S608
            await db.run(f"DELETE FROM swarm_rejected_writes WHERE task_id IN ({doomed})", params)  # noqa: S608
            await db.run(f"DELETE FROM swarm_calls WHERE task_id IN ({doomed})", params)  # noqa: S608
            await db.run(f"DELETE FROM swarm_task_workers WHERE task_id IN ({doomed})", params)  # noqa: S608
            return await db.run(f"DELETE FROM swarm_tasks WHERE id IN ({doomed})", params)  # noqa: S608

        pruned = await self._attempt("prune", body, transaction=True)
        if pruned:
            log.info("swarm.pruned", tasks=pruned, older_than_days=older_than_days)
        return pruned


def _why_rejected(row: Any, run: TaskRun, attempted: TaskStatus, sources: frozenset[TaskStatus], operation: str) -> str:
    if row is None:
        return "unknown task"
    status, generation, run_id = TaskStatus(row[0]), int(row[1]), str(row[2])
    if generation != run.generation:
        return f"stale generation {run.generation}: the task is at generation {generation} ({status.value})"
    if run_id != run.run_id:
        return f"stale run: the task's current run is another one ({status.value})"
    if status not in sources:
        if operation in ("step", "journal"):
            return f"the task is {status.value}, not running"
        return f"illegal transition {status.value} -> {attempted.value}"
    if operation == "journal":
        return "this step index is already journaled"
    return "the row changed underneath the write"


def _record(row: Any) -> TaskRecord:
    (
        task_id,
        pattern,
        status,
        generation,
        run_id,
        request_json,
        result_json,
        error,
        current_step,
        owner,
        route,
        parent_id,
        created_at,
        updated_at,
        finished_at,
    ) = row
    return TaskRecord(
        id=str(task_id),
        pattern=str(pattern),
        status=TaskStatus(status),
        generation=int(generation),
        run_id=str(run_id),
        request=json.loads(request_json),
        result=None if result_json is None else json.loads(result_json),
        error=None if error is None else str(error),
        current_step=str(current_step),
        owner=str(owner),
        route=None if route is None else str(route),
        parent_id=None if parent_id is None else str(parent_id),
        created_at=_utc(float(created_at)),
        updated_at=_utc(float(updated_at)),
        finished_at=None if finished_at is None else _utc(float(finished_at)),
    )
