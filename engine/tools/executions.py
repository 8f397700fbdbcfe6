"""What ran: every tool execution on disk before it starts and when it ends, and what each ending says of it.

Two halves, one vocabulary:

- :class:`ExecutionRecord`, the rows (``tool_executions``, on either backend): a row is written — and
  committed — before a tool starts (tool, arguments hash, the approval it runs under, conversation, agent,
  the task or plan step it belongs to, the replica), and finished when it ends (ok, exit code, error). A
  call whose row cannot be written does not run. A row the process never finished (it died) reads
  *started, not finished* for ever after: the call may have run.
- :class:`Effects`, the same facts in memory for whatever is running now: a swarm task, one worker call, a
  plan step's turn push one with :func:`tracking`; every tool started inside is noted in each of them. A call
  cancelled mid-run (a deadline, ``/swarm cancel``, a shutdown) is *interrupted*: it may have run.

Every ending of a task, step or call says one of three things (:class:`ExecutionSummary`): **did not run**
(no tool that changes anything was started), **ran** (each one that started finished), or **may have run
(started, not finished)**, naming the tools. Read-only tools (``read_file``, ``http_get``) are recorded
but are not what an ending is about; a tool that needs approval counts as changing something.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import structlog

from kazma.config.store.backend import StoreConnection, Tx, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

log = structlog.get_logger("kazma.engine.tools")

MIGRATIONS = [
    Migration(
        "executions",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS tool_executions (
                id TEXT PRIMARY KEY,
                tool TEXT NOT NULL,
                args_hash TEXT NOT NULL,
                request_id TEXT,
                conversation TEXT NOT NULL,
                agent TEXT NOT NULL,
                scope TEXT NOT NULL DEFAULT '',
                task_id TEXT,
                replica TEXT,
                changes_state INTEGER NOT NULL,
                started_at REAL NOT NULL,
                finished_at REAL,
                outcome TEXT,
                exit_code INTEGER,
                error TEXT NOT NULL DEFAULT ''
            )
            """,
            "CREATE INDEX IF NOT EXISTS tool_executions_task ON tool_executions (task_id)",
            "CREATE INDEX IF NOT EXISTS tool_executions_scope ON tool_executions (scope)",
            "CREATE INDEX IF NOT EXISTS tool_executions_open ON tool_executions (outcome, started_at)",
            "CREATE INDEX IF NOT EXISTS tool_executions_call ON tool_executions (conversation, tool, args_hash)",
        ),
    ),
]

PG_MIGRATIONS = [
    PgMigration(
        "executions",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS tool_executions (
                id text PRIMARY KEY,
                tool text NOT NULL,
                args_hash text NOT NULL,
                request_id text,
                conversation text NOT NULL,
                agent text NOT NULL,
                scope text NOT NULL DEFAULT '',
                task_id text,
                replica text,
                changes_state integer NOT NULL,
                started_at double precision NOT NULL,
                finished_at double precision,
                outcome text,
                exit_code integer,
                error text NOT NULL DEFAULT ''
            )
            """,
            "CREATE INDEX IF NOT EXISTS tool_executions_task ON tool_executions (task_id)",
            "CREATE INDEX IF NOT EXISTS tool_executions_scope ON tool_executions (scope)",
            "CREATE INDEX IF NOT EXISTS tool_executions_open ON tool_executions (outcome, started_at)",
            "CREATE INDEX IF NOT EXISTS tool_executions_call ON tool_executions (conversation, tool, args_hash)",
        ),
    ),
]


class Ended(StrEnum):
    """How an execution ended. A row with none is running, or was left by a process that died."""

    OK = "ok"
    FAILED = "failed"  # it ran and said it failed (a non-zero exit, an error result)
    INTERRUPTED = "interrupted"  # cancelled mid-run (a deadline, a cancel, a shutdown): it may have run
    LOST = "lost"  # started by a process that died before it ended: it may have run


UNFINISHED = frozenset({None, Ended.INTERRUPTED, Ended.LOST})


@dataclass
class Ran:
    """One tool execution as a running scope sees it (shared by every scope it was started in)."""

    tool: str
    changes_state: bool
    execution_id: str | None = None
    ended: Ended | None = None
    exit_code: int | None = None

    def shown(self) -> str:
        if self.ended in UNFINISHED:
            return f"{self.tool} (started, not finished)"
        if self.exit_code is not None:
            return f"{self.tool} (exit {self.exit_code})"
        return self.tool if self.ended is Ended.OK else f"{self.tool} (failed)"


class Outcome(StrEnum):
    DID_NOT_RUN = "did not run"
    RAN = "ran"
    MAY_HAVE_RUN = "may have run"


@dataclass(frozen=True)
class ExecutionSummary:
    """What an ending says of the tools that change things: did not run, ran, or may have run (with the tools)."""

    ran: tuple[str, ...] = ()  # "shell (exit 0)", each one that started and finished
    may_have_run: tuple[str, ...] = ()  # "shell (started, not finished)"

    @property
    def outcome(self) -> Outcome:
        if self.may_have_run:
            return Outcome.MAY_HAVE_RUN
        return Outcome.RAN if self.ran else Outcome.DID_NOT_RUN

    @property
    def changed_state(self) -> bool:
        """Something may have been changed: a retry must ask first."""
        return self.outcome is not Outcome.DID_NOT_RUN

    def line(self) -> str:
        """One sentence for people: ``may have run: shell (started, not finished); ran: write_file``."""
        if self.may_have_run:
            line = f"may have run: {', '.join(self.may_have_run)}"
            return f"{line}; ran: {', '.join(self.ran)}" if self.ran else line
        if self.ran:
            return f"ran: {', '.join(self.ran)}"
        return "did not run: no tool that changes anything was started"

    def as_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "ran": list(self.ran), "may_have_run": list(self.may_have_run)}

    @staticmethod
    def from_json(data: Any) -> ExecutionSummary | None:
        if not isinstance(data, dict):
            return None
        return ExecutionSummary(
            tuple(str(t) for t in data.get("ran") or []), tuple(str(t) for t in data.get("may_have_run") or [])
        )

    @staticmethod
    def of(runs: Sequence[Ran]) -> ExecutionSummary:
        changing = [r for r in runs if r.changes_state]
        return ExecutionSummary(
            tuple(r.shown() for r in changing if r.ended not in UNFINISHED),
            tuple(r.shown() for r in changing if r.ended in UNFINISHED),
        )


@dataclass
class Effects:
    """The tools started in one running scope (a swarm task, one worker call, a plan step's turn)."""

    scope: str = ""  # what its rows are filed under: "swarm:<task>:<call>", "plan:<plan>:<step>:<attempt>"
    task_id: str | None = None  # the swarm task it belongs to, if any
    runs: list[Ran] = field(default_factory=list)
    # What each tool started inside writes its row under (a swarm task's: the task is still this run's, here).
    # It travels beside the calls, as the scope does: the layers between a task and its workers' turns stay as
    # they are.
    fence: Fence | None = None

    def summary(self) -> ExecutionSummary:
        return ExecutionSummary.of(self.runs)

    @property
    def started_changing(self) -> bool:
        """A tool that changes things was started here (finished or not): never repeat this blindly."""
        return any(r.changes_state for r in self.runs)


def step_scope(plan_id: str, index: int, attempt: int | None = None) -> str:
    """Where a plan step's executions are filed: ``plan:<plan>:<step>:<attempt>`` (without the attempt: a prefix
    of every attempt's)."""
    return f"plan:{plan_id}:{index}:" + ("" if attempt is None else str(attempt))


def task_scope(task_id: str, call: int | None = None) -> str:
    """Where a swarm task's executions are filed: ``swarm:<task>:<call>``."""
    return f"swarm:{task_id}:" + ("" if call is None else str(call))


_SCOPES: ContextVar[tuple[Effects, ...]] = ContextVar("kazma_tool_effects", default=())


@contextmanager
def tracking(effects: Effects) -> Iterator[Effects]:
    """Note in ``effects`` every tool started inside the block (tasks created inside inherit it)."""
    token = _SCOPES.set((*_SCOPES.get(), effects))
    try:
        yield effects
    finally:
        _SCOPES.reset(token)


def current_scope() -> tuple[str, str | None]:
    """Where a tool started now is filed: the innermost scope with a name, and the task of any scope."""
    scopes = _SCOPES.get()
    scope = next((e.scope for e in reversed(scopes) if e.scope), "")
    task_id = next((e.task_id for e in reversed(scopes) if e.task_id), None)
    return scope, task_id


def current_fence() -> Fence | None:
    """What a tool started now writes its row under: the innermost running scope's fence, if any."""
    return next((e.fence for e in reversed(_SCOPES.get()) if e.fence is not None), None)


def note(ran: Ran) -> None:
    """``ran`` started: every scope running now sees it (the same object, so its ending shows everywhere)."""
    for effects in _SCOPES.get():
        effects.runs.append(ran)


@dataclass(frozen=True)
class Execution:
    """One row of ``tool_executions``."""

    id: str
    tool: str
    args_hash: str
    request_id: str | None
    conversation: str
    agent: str
    scope: str
    task_id: str | None
    replica: str | None
    changes_state: bool
    started_at: float
    finished_at: float | None
    ended: Ended | None
    exit_code: int | None
    error: str

    def as_ran(self) -> Ran:
        return Ran(self.tool, self.changes_state, self.id, self.ended, self.exit_code)


_COLUMNS = (
    "id, tool, args_hash, request_id, conversation, agent, scope, task_id, replica, changes_state, started_at,"
    " finished_at, outcome, exit_code, error"
)

_STARTED_COLUMNS = (
    "id, tool, args_hash, request_id, conversation, agent, scope, task_id, replica, changes_state, started_at"
)


def _row(row: Any) -> Execution:
    (eid, tool, digest, request_id, conversation, agent, scope, task_id, replica, changes, started, finished,
     ended, exit_code, error) = row  # fmt: skip
    return Execution(
        str(eid), str(tool), str(digest), None if request_id is None else str(request_id), str(conversation),
        str(agent), str(scope), None if task_id is None else str(task_id), None if replica is None else str(replica),
        bool(changes), float(started), None if finished is None else float(finished),
        None if ended is None else Ended(ended), None if exit_code is None else int(exit_code), str(error),
    )  # fmt: skip


class Fence(Protocol):
    """What an execution's row is written only while it holds (a plan step's turn: the step is still that turn's;
    a swarm task's: the task is still that run's, here).

    The row goes in by ``INSERT … SELECT`` over what :meth:`source` gives (``FROM … WHERE …``, on PostgreSQL
    locking the row it reads): the check and the row are one statement, so whoever takes that away either waits
    for the row (and then sees it) or the row is not written and the call never starts."""

    def source(self) -> tuple[str, tuple[Any, ...]]: ...

    async def refused(self) -> None:
        """Told once a row was not written under it, before the call's refusal is answered: what stops the work
        it fences out (the rest of it would only be refused one tool at a time)."""


def row_fence(table: str, where: Mapping[str, Any], replica: str | None, postgres: bool) -> tuple[str, tuple[Any, ...]]:
    """A :meth:`Fence.source` over the one row of ``table`` whose columns are ``where`` and that ``replica`` runs
    (``replica IS NULL``: the only process), held ``FOR SHARE`` on PostgreSQL until the execution's row commits.

    Whoever takes that row away (the leader's write ending a gone replica's work, a cancel) waits on PostgreSQL
    for a row going in and then sees it, or comes first and no row is written. On SQLite the one statement is
    atomic among every connection to the file."""
    conditions = [f"{column} = ?" for column in where]
    conditions.append("replica IS NULL" if replica is None else "replica = ?")
    sql = f"FROM {table} WHERE {' AND '.join(conditions)}" + (" FOR SHARE" if postgres else "")
    params = tuple(where.values())
    return sql, params if replica is None else (*params, replica)


class FencedOut(Exception):
    """The row of an execution was not written: what its :class:`Fence` holds no longer held. It must not run."""


class ExecutionRecord:
    """The ``tool_executions`` rows, on the store every component shares (SQLite or PostgreSQL)."""

    def __init__(self, conn: StoreConnection, *, replica: str | None = None, clock: Any = time.time) -> None:
        self.tables = tables_of(conn)
        self.replica = replica  # written on every row this process starts (None: the only process)
        self.clock = clock
        self._open: set[str] = set()  # the rows this process started and has not finished

    async def started(
        self,
        *,
        tool: str,
        args_hash: str,
        request_id: str | None,
        conversation: str,
        agent: str,
        changes_state: bool,
        scope: str = "",
        task_id: str | None = None,
        fence: Fence | None = None,
    ) -> str:
        """Write the row of an execution about to start; its id once committed. Raises when it cannot be written
        (:class:`FencedOut`: ``fence`` no longer held): the call must not run then."""
        execution_id = secrets.token_urlsafe(12)
        row = (execution_id, tool, args_hash, request_id, conversation, agent, scope, task_id, self.replica,
               int(changes_state), self.clock())  # fmt: skip
        # The columns an execution starts with; its ending's keep their defaults: PostgreSQL reads a bare NULL in
        # an INSERT's SELECT list as text, which the number columns refuse.
        columns = _STARTED_COLUMNS
        values = ", ".join("?" * len(row))
        if fence is None:
            await self.tables.run(f"INSERT INTO tool_executions ({columns}) VALUES ({values})", row)  # noqa: S608
        else:
            source, params = fence.source()
            written = await self.tables.run(
                f"INSERT INTO tool_executions ({columns}) SELECT {values} {source}",
                (*row, *params),
            )
            if written != 1:
                log.warning("tools.execution_fenced_out", tool=tool, scope=scope, conversation=conversation)
                raise FencedOut(f"{tool} was not started: what it ran for is no longer this process's to run")
        self._open.add(execution_id)
        return execution_id

    async def finished(self, execution_id: str, ended: Ended, *, exit_code: int | None = None, error: str = "") -> None:
        await self.tables.run(
            "UPDATE tool_executions SET finished_at = ?, outcome = ?, exit_code = ?, error = ?"
            " WHERE id = ? AND outcome IS NULL",
            (self.clock(), ended.value, exit_code, error[:2000], execution_id),
        )
        self._open.discard(execution_id)

    async def interrupt_open(self) -> list[str]:
        """At a clean stop, before the store closes: every row this process started and has not finished ends
        ``interrupted`` (it may have run). A call still running then is cancelled only after the store has
        closed, too late to write its own ending, and its row would read "running" until the next start."""
        ended: list[str] = []
        for execution_id in sorted(self._open):
            await self.tables.run(
                "UPDATE tool_executions SET finished_at = ?, outcome = ?, error = ? WHERE id = ? AND outcome IS NULL",
                (self.clock(), Ended.INTERRUPTED.value, "Kazma stopped while it ran", execution_id),
            )
            log.warning("tools.execution_interrupted_at_stop", execution=execution_id)
            ended.append(execution_id)
        self._open.clear()
        return ended

    async def of_task(self, task_id: str) -> list[Execution]:
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM tool_executions WHERE task_id = ? ORDER BY started_at",  # noqa: S608
            (task_id,),
        )
        return [_row(r) for r in rows]

    async def of_scope(self, prefix: str) -> list[Execution]:
        """The executions filed under ``prefix`` or below it (``plan:<id>:<step>:`` for every attempt)."""
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM tool_executions WHERE substr(scope, 1, ?) = ? ORDER BY started_at",  # noqa: S608
            (len(prefix), prefix),
        )
        return [_row(r) for r in rows]

    @staticmethod
    def summary_in(tx: Tx, scope: str) -> ExecutionSummary:
        """What the executions filed under exactly ``scope`` did, read in a writer's transaction ``tx`` (another
        component's write, on the same store, that must see every row committed before it)."""
        rows = tx.all(f"SELECT {_COLUMNS} FROM tool_executions WHERE scope = ? ORDER BY started_at", (scope,))  # noqa: S608
        return ExecutionSummary.of([_row(r).as_ran() for r in rows])

    async def summary_of_task(self, task_id: str) -> ExecutionSummary:
        return ExecutionSummary.of([e.as_ran() for e in await self.of_task(task_id)])

    async def summary_of_scope(self, prefix: str) -> ExecutionSummary:
        return ExecutionSummary.of([e.as_ran() for e in await self.of_scope(prefix)])

    async def mark_lost(
        self, live: Collection[str] | None = None, *, leading: Callable[[], bool] | None = None
    ) -> list[Execution]:
        """At start (``live`` None: the only process), or among replicas for rows of replicas not in ``live``:
        rows left running by a process that died end ``lost`` — started, not finished: they may have run. A row
        with no replica, among replicas, was started by a process that is no replica: left alone. The rows so
        marked. ``leading`` (the leader's sweep): asked before each row; once it says no, the rest is left (a
        replica judged gone may be back under its name, its calls running)."""
        rows = await self.tables.all(f"SELECT {_COLUMNS} FROM tool_executions WHERE outcome IS NULL")  # noqa: S608
        lost = [e for e in (_row(r) for r in rows) if live is None or (e.replica is not None and e.replica not in live)]
        marked: list[Execution] = []
        for execution in lost:
            if leading is not None and not leading():
                log.warning("tools.recovery_stopped", reason="this replica no longer leads", marked=len(marked))
                break
            marked.append(execution)
            await self.tables.run(
                "UPDATE tool_executions SET outcome = ?, error = ? WHERE id = ? AND outcome IS NULL",
                (Ended.LOST.value, "the process stopped while it ran", execution.id),
            )
            log.warning("tools.execution_lost", execution=execution.id, tool=execution.tool,
                        task_id=execution.task_id, scope=execution.scope)  # fmt: skip
        return marked

    async def outcomes_of_requests(self, request_ids: Sequence[str]) -> dict[str, list[str | None]]:
        """Each approval's executions' outcomes (None: not finished), for those with any: one with none never
        started its call."""
        found: dict[str, list[str | None]] = {}
        for start in range(0, len(request_ids), 500):  # bounded statements however many are asked about
            chunk = list(request_ids[start : start + 500])
            rows = await self.tables.all(
                f"SELECT request_id, outcome FROM tool_executions WHERE request_id IN ({', '.join('?' * len(chunk))})"  # noqa: S608
                " ORDER BY started_at",
                chunk,
            )
            for request_id, outcome in rows:
                found.setdefault(str(request_id), []).append(None if outcome is None else str(outcome))
        return found

    async def may_have_run(self, tool: str, args_hash: str, conversation: str) -> Execution | None:
        """The latest execution of exactly this call here that started and never finished (it may have run)."""
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM tool_executions WHERE conversation = ? AND tool = ? AND args_hash = ?"  # noqa: S608
            " AND (outcome IS NULL OR outcome IN (?, ?)) ORDER BY started_at DESC LIMIT 1",
            (conversation, tool, args_hash, Ended.INTERRUPTED.value, Ended.LOST.value),
        )
        return _row(rows[0]) if rows else None
