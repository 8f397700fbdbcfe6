"""Plans on disk. Step status moves only by compare-and-set, so a step cannot be dispatched twice."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from kazma.config.store.backend import StoreConnection, Tx, is_postgres, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration
from kazma.engine.plan import OnFailure, Plan, PlanOrigin, PlanSpec, Step, StepRecord, StepSpec, StepStatus
from kazma.engine.tools.executions import ExecutionSummary, row_fence
from kazma.engine.types import ToolUse, Usage

MIGRATIONS = [
    Migration(
        "plans",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS plans (
                id TEXT PRIMARY KEY,
                conversation TEXT NOT NULL,
                goal TEXT NOT NULL,
                created_at REAL NOT NULL,
                status TEXT NOT NULL DEFAULT 'active'
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS plan_steps (
                plan_id TEXT NOT NULL REFERENCES plans (id),
                idx INTEGER NOT NULL,
                title TEXT NOT NULL,
                assignee TEXT NOT NULL,
                input TEXT NOT NULL,
                wait_for TEXT,
                on_failure TEXT NOT NULL,
                status TEXT NOT NULL DEFAULT 'pending',
                output_summary TEXT NOT NULL DEFAULT '',
                output_files TEXT NOT NULL DEFAULT '[]',
                failure_reason TEXT NOT NULL DEFAULT '',
                attempts INTEGER NOT NULL DEFAULT 0,
                updated_at REAL NOT NULL,
                PRIMARY KEY (plan_id, idx)
            )
            """,
            "CREATE INDEX IF NOT EXISTS plan_steps_status ON plan_steps (status)",
        ),
    ),
    Migration(
        "plans",
        2,
        (
            # What started the plan, so every step can see it (and who may answer its questions).
            "ALTER TABLE plans ADD COLUMN request_text TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE plans ADD COLUMN requested_by TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE plans ADD COLUMN request_files TEXT NOT NULL DEFAULT '[]'",
            # Every repair and every question, in order: the plan's history.
            """
            CREATE TABLE IF NOT EXISTS plan_events (
                seq INTEGER PRIMARY KEY,
                plan_id TEXT NOT NULL REFERENCES plans (id),
                at REAL NOT NULL,
                kind TEXT NOT NULL,
                step INTEGER,
                actor TEXT,
                detail TEXT NOT NULL DEFAULT ''
            )
            """,
            "CREATE INDEX IF NOT EXISTS plan_events_plan ON plan_events (plan_id, seq)",
            # Questions to people: a user step, or a sub-agent's ask_user. Decided once, like a card.
            """
            CREATE TABLE IF NOT EXISTS plan_questions (
                id TEXT PRIMARY KEY,
                plan_id TEXT NOT NULL REFERENCES plans (id),
                step INTEGER NOT NULL,
                attempt INTEGER NOT NULL,
                kind TEXT NOT NULL,
                conversation TEXT NOT NULL,
                asked_by TEXT NOT NULL,
                question TEXT NOT NULL,
                choices TEXT NOT NULL DEFAULT '[]',
                answerer TEXT NOT NULL,
                status TEXT NOT NULL DEFAULT 'pending',
                message_id TEXT,
                answer TEXT,
                answered_by TEXT,
                created_at REAL NOT NULL,
                answered_at REAL
            )
            """,
            "CREATE INDEX IF NOT EXISTS plan_questions_open ON plan_questions (conversation, status)",
        ),
    ),
    # The replica running a step: among replicas on one database, the leader fails a step as interrupted only
    # when the replica running it is gone. NULL: run by the only process on the store (or before this).
    Migration("plans", 3, ("ALTER TABLE plan_steps ADD COLUMN replica TEXT",)),
    # Each step's record of its latest attempt: the model, the tools with the approvals they ran under, when it
    # started and finished, its tokens and the cost the model's server reported (NULL: not said).
    Migration(
        "plans",
        4,
        (
            "ALTER TABLE plan_steps ADD COLUMN model TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE plan_steps ADD COLUMN tools_json TEXT NOT NULL DEFAULT '[]'",
            "ALTER TABLE plan_steps ADD COLUMN started_at REAL",
            "ALTER TABLE plan_steps ADD COLUMN finished_at REAL",
            "ALTER TABLE plan_steps ADD COLUMN prompt_tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE plan_steps ADD COLUMN completion_tokens INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE plan_steps ADD COLUMN cost REAL",
        ),
    ),
    # What the step's latest attempt's tools did (engine/tools/executions.py): ran, did not run, may have run.
    Migration("plans", 5, ("ALTER TABLE plan_steps ADD COLUMN execution_json TEXT",)),
    # The replica driving the plan: the last to move it (start it, a step's ending, a question asked or answered).
    # Among replicas a plan left idle is repaired only by a survivor that takes it over from an owner that is gone.
    # NULL: the only process on its store (or before this).
    Migration("plans", 6, ("ALTER TABLE plans ADD COLUMN owner TEXT",)),
    # When the plan finished or was aborted: the retention sweep prunes by it (agents.plan_retention_days). NULL
    # on a plan that ended before this: its last step's update stands in.
    Migration("plans", 7, ("ALTER TABLE plans ADD COLUMN ended_at REAL",)),
]

# The same tables on PostgreSQL, version for version: double precision for REAL, an identity column where
# SQLite numbers rows itself (INTEGER PRIMARY KEY).
PG_MIGRATIONS = [
    PgMigration(
        "plans",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS plans (
                id text PRIMARY KEY,
                conversation text NOT NULL,
                goal text NOT NULL,
                created_at double precision NOT NULL,
                status text NOT NULL DEFAULT 'active'
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS plan_steps (
                plan_id text NOT NULL REFERENCES plans (id),
                idx integer NOT NULL,
                title text NOT NULL,
                assignee text NOT NULL,
                input text NOT NULL,
                wait_for text,
                on_failure text NOT NULL,
                status text NOT NULL DEFAULT 'pending',
                output_summary text NOT NULL DEFAULT '',
                output_files text NOT NULL DEFAULT '[]',
                failure_reason text NOT NULL DEFAULT '',
                attempts integer NOT NULL DEFAULT 0,
                updated_at double precision NOT NULL,
                PRIMARY KEY (plan_id, idx)
            )
            """,
            "CREATE INDEX IF NOT EXISTS plan_steps_status ON plan_steps (status)",
        ),
    ),
    PgMigration(
        "plans",
        2,
        (
            "ALTER TABLE plans ADD COLUMN request_text text NOT NULL DEFAULT ''",
            "ALTER TABLE plans ADD COLUMN requested_by text NOT NULL DEFAULT ''",
            "ALTER TABLE plans ADD COLUMN request_files text NOT NULL DEFAULT '[]'",
            """
            CREATE TABLE IF NOT EXISTS plan_events (
                seq bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                plan_id text NOT NULL REFERENCES plans (id),
                at double precision NOT NULL,
                kind text NOT NULL,
                step integer,
                actor text,
                detail text NOT NULL DEFAULT ''
            )
            """,
            "CREATE INDEX IF NOT EXISTS plan_events_plan ON plan_events (plan_id, seq)",
            """
            CREATE TABLE IF NOT EXISTS plan_questions (
                id text PRIMARY KEY,
                plan_id text NOT NULL REFERENCES plans (id),
                step integer NOT NULL,
                attempt integer NOT NULL,
                kind text NOT NULL,
                conversation text NOT NULL,
                asked_by text NOT NULL,
                question text NOT NULL,
                choices text NOT NULL DEFAULT '[]',
                answerer text NOT NULL,
                status text NOT NULL DEFAULT 'pending',
                message_id text,
                answer text,
                answered_by text,
                created_at double precision NOT NULL,
                answered_at double precision
            )
            """,
            "CREATE INDEX IF NOT EXISTS plan_questions_open ON plan_questions (conversation, status)",
        ),
    ),
    PgMigration("plans", 3, ("ALTER TABLE plan_steps ADD COLUMN replica text",)),
    PgMigration(
        "plans",
        4,
        (
            "ALTER TABLE plan_steps ADD COLUMN model text NOT NULL DEFAULT ''",
            "ALTER TABLE plan_steps ADD COLUMN tools_json text NOT NULL DEFAULT '[]'",
            "ALTER TABLE plan_steps ADD COLUMN started_at double precision",
            "ALTER TABLE plan_steps ADD COLUMN finished_at double precision",
            "ALTER TABLE plan_steps ADD COLUMN prompt_tokens bigint NOT NULL DEFAULT 0",
            "ALTER TABLE plan_steps ADD COLUMN completion_tokens bigint NOT NULL DEFAULT 0",
            "ALTER TABLE plan_steps ADD COLUMN cost double precision",
        ),
    ),
    PgMigration("plans", 5, ("ALTER TABLE plan_steps ADD COLUMN execution_json text",)),
    PgMigration("plans", 6, ("ALTER TABLE plans ADD COLUMN owner text",)),
    PgMigration("plans", 7, ("ALTER TABLE plans ADD COLUMN ended_at double precision",)),
]

_OWN: Final = "UPDATE plans SET owner = ? WHERE id = ?"

# Done and skipped are never left. A failed or blocked step returns to pending only by a repair the lead
# asked for (retry_step, replace_steps); a running one returns to pending only for a transient retry.
TRANSITIONS: dict[StepStatus, set[StepStatus]] = {
    StepStatus.PENDING: {StepStatus.IN_PROGRESS, StepStatus.SKIPPED, StepStatus.BLOCKED, StepStatus.WAITING_FOR_USER},
    StepStatus.IN_PROGRESS: {
        StepStatus.DONE,
        StepStatus.FAILED,
        StepStatus.SKIPPED,
        StepStatus.PENDING,
        StepStatus.WAITING_FOR_USER,
    },
    StepStatus.WAITING_FOR_USER: {StepStatus.IN_PROGRESS, StepStatus.DONE, StepStatus.SKIPPED, StepStatus.FAILED},
    StepStatus.DONE: set(),
    StepStatus.FAILED: {StepStatus.PENDING, StepStatus.SKIPPED},
    StepStatus.SKIPPED: set(),
    StepStatus.BLOCKED: {StepStatus.PENDING, StepStatus.SKIPPED},
}


@dataclass(frozen=True)
class Question:
    """A question to a person, asked by a user step or by a sub-agent in the middle of its step."""

    id: str
    plan_id: str
    step: int
    attempt: int
    kind: str  # "user_step" | "ask_user"
    conversation: str
    asked_by: str  # the agent (or "plan") that asks
    question: str
    choices: tuple[str, ...]
    answerer: str  # the actor who may answer (besides the platform's admins)
    status: str  # "pending" | "answered" | "cancelled"
    message_id: str | None  # where it was posted, so a reply to it can be recognised
    answer: str | None
    answered_by: str | None


@dataclass(frozen=True)
class LeftStep:
    """A step found running: its attempt and the replica running it (None: the only process on its store)."""

    plan_id: str
    index: int
    attempt: int
    replica: str | None


@dataclass(frozen=True)
class StepRun:
    """Where one step's run stands on disk: what a replica running it reads to learn it was taken away."""

    status: StepStatus
    attempts: int
    failure_reason: str
    replica: str | None


@dataclass(frozen=True)
class StepFence:
    """A tool of a step's turn starts only while the step is still that turn's: its row, this attempt, running,
    on the replica that runs the turn (an :class:`~kazma.engine.tools.executions.Fence`).

    Among replicas the leader fails the running step of a replica it judged gone; that replica may still run.
    Its turn's check just before a tool and the tool's execution row are one statement here, and on PostgreSQL
    it holds the step's row (``FOR SHARE``) until its row commits: the leader's write taking the step away waits
    for it and then reads the row (the tool is reported), or comes first and no row is written (the tool never
    starts). Never both the retry elsewhere and an unreported tool here."""

    plan_id: str
    index: int
    attempt: int
    replica: str | None
    postgres: bool

    def source(self) -> tuple[str, tuple[Any, ...]]:
        where = {"plan_id": self.plan_id, "idx": self.index, "attempts": self.attempt,
                 "status": StepStatus.IN_PROGRESS.value}  # fmt: skip
        return row_fence("plan_steps", where, self.replica, self.postgres)

    async def refused(self) -> None:
        """Nothing more here: the turn's ``before_tool`` reads the step again and stops the turn."""


@dataclass(frozen=True)
class PlanEvent:
    seq: int
    at: float
    kind: str
    step: int | None
    actor: str | None
    detail: str


_QUESTION_COLUMNS = (
    "id, plan_id, step, attempt, kind, conversation, asked_by, question, choices, answerer, status, message_id,"
    " answer, answered_by"
)


def _question(row: Any) -> Question:
    (qid, plan_id, step, attempt, kind, conversation, asked_by, question, choices, answerer, status, message_id,
     answer, answered_by) = row  # fmt: skip
    return Question(
        str(qid),
        str(plan_id),
        int(step),
        int(attempt),
        str(kind),
        str(conversation),
        str(asked_by),
        str(question),
        tuple(str(c) for c in json.loads(choices)),
        str(answerer),
        str(status),
        None if message_id is None else str(message_id),
        answer,
        answered_by,
    )


class TransitionError(Exception):
    pass


class _StartedMeanwhile(Exception):
    """A step to be replaced started while the replacement ran: roll it back."""


class PlanStore:
    def __init__(
        self, conn: StoreConnection, *, clock: Callable[[], float] = time.time, replica: str | None = None
    ) -> None:
        self.conn = conn
        self.clock = clock
        self.tables = tables_of(conn)
        self.replica = replica  # recorded on each step this process starts (None: the only process)
        self.postgres = is_postgres(conn)

    def fence(self, plan_id: str, index: int, attempt: int) -> StepFence:
        """What a tool of this step's turn (``attempt``, run here) starts under: see :class:`StepFence`."""
        return StepFence(plan_id, index, attempt, self.replica, self.postgres)

    async def create(self, conversation: str, spec: PlanSpec, origin: PlanOrigin | None = None) -> Plan:
        plan_id = secrets.token_urlsafe(9)
        now = self.clock()
        origin = origin or PlanOrigin()
        async with self.tables.transaction() as tx:
            await tx.run(
                "INSERT INTO plans (id, conversation, goal, created_at, request_text, requested_by, request_files,"
                " owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    plan_id,
                    conversation,
                    spec.goal,
                    now,
                    origin.text,
                    origin.requested_by,
                    json.dumps(list(origin.files)),
                    self.replica,
                ),
            )
            await tx.run_many(_INSERT_STEP, [_step_row(plan_id, s, now) for s in spec.steps])
        plan = await self.load(plan_id)
        assert plan is not None
        return plan

    async def replace_pending(self, plan_id: str, from_index: int, steps: list[StepSpec]) -> bool:
        """Put ``steps`` in place of every step from ``from_index`` on, all of which must not have started.

        One transaction: the old steps are gone (the plan's history keeps them) and the new ones are pending.
        False when a step from ``from_index`` on started meanwhile.
        """
        now = self.clock()
        replaceable = (StepStatus.PENDING.value, StepStatus.BLOCKED.value)
        try:
            async with self.tables.transaction() as tx:
                rows = await tx.all(
                    "SELECT idx, status FROM plan_steps WHERE plan_id = ? AND idx >= ?", (plan_id, from_index)
                )
                if any(str(status) not in replaceable for _, status in rows):
                    return False
                # The delete checks the states again: on PostgreSQL a single-statement write (set_status) is not
                # held back by this transaction as SQLite's write lock holds it, and may have started a step since.
                deleted = await tx.run(
                    "DELETE FROM plan_steps WHERE plan_id = ? AND idx >= ? AND status IN (?, ?)",
                    (plan_id, from_index, *replaceable),
                )
                if deleted != len(rows):
                    raise _StartedMeanwhile
                await tx.run_many(_INSERT_STEP, [_step_row(plan_id, s, now) for s in steps])
        except _StartedMeanwhile:
            return False
        return True

    async def set_input(self, plan_id: str, index: int, text: str) -> None:
        await self.tables.run(
            "UPDATE plan_steps SET input = ?, updated_at = ? WHERE plan_id = ? AND idx = ?",
            (text, self.clock(), plan_id, index),
        )

    # -- history ---------------------------------------------------------------------------------

    async def record(self, plan_id: str, kind: str, *, step: int | None = None, actor: str | None = None,
                     detail: str = "") -> None:  # fmt: skip
        await self.tables.run(
            "INSERT INTO plan_events (plan_id, at, kind, step, actor, detail) VALUES (?, ?, ?, ?, ?, ?)",
            (plan_id, self.clock(), kind, step, actor, detail),
        )

    async def events(self, plan_id: str) -> list[PlanEvent]:
        rows = await self.tables.all(
            "SELECT seq, at, kind, step, actor, detail FROM plan_events WHERE plan_id = ? ORDER BY seq", (plan_id,)
        )
        return [PlanEvent(int(r[0]), float(r[1]), str(r[2]), r[3], r[4], str(r[5])) for r in rows]

    # -- questions -------------------------------------------------------------------------------

    async def ask(
        self,
        *,
        plan_id: str,
        step: int,
        attempt: int,
        kind: str,
        conversation: str,
        asked_by: str,
        question: str,
        choices: tuple[str, ...],
        answerer: str,
    ) -> Question:
        qid = secrets.token_urlsafe(12)
        row = (qid, plan_id, step, attempt, kind, conversation, asked_by, question, json.dumps(list(choices)),
               answerer, self.clock())  # fmt: skip
        insert = (
            "INSERT INTO plan_questions (id, plan_id, step, attempt, kind, conversation, asked_by, question, choices,"
            " answerer, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        await self._moved(plan_id, insert, row)
        found = await self.question(qid)
        assert found is not None
        return found

    async def question(self, question_id: str) -> Question | None:
        row = await self.tables.one(
            f"SELECT {_QUESTION_COLUMNS} FROM plan_questions WHERE id = ?",  # noqa: S608 - fixed columns
            (question_id,),
        )
        return None if row is None else _question(row)

    async def open_questions(self, conversation: str | None = None) -> list[Question]:
        where = "status = 'pending'" + (" AND conversation = ?" if conversation is not None else "")
        rows = await self.tables.all(
            f"SELECT {_QUESTION_COLUMNS} FROM plan_questions WHERE {where} ORDER BY created_at",  # noqa: S608
            () if conversation is None else (conversation,),
        )
        return [_question(r) for r in rows]

    async def answered_unresumed(self) -> list[Question]:
        """Questions answered whose step still waits for a person: the answer committed, the step never resumed
        (a process that died between the two)."""
        columns = ", ".join(f"q.{c.strip()}" for c in _QUESTION_COLUMNS.split(","))
        rows = await self.tables.all(
            f"SELECT {columns} FROM plan_questions q JOIN plan_steps s ON s.plan_id = q.plan_id AND s.idx = q.step"  # noqa: S608
            " WHERE q.status = 'answered' AND s.status = ? AND q.attempt = s.attempts ORDER BY q.created_at",
            (StepStatus.WAITING_FOR_USER.value,),
        )
        return [_question(r) for r in rows]

    async def question_posted(self, question_id: str, message_id: str) -> None:
        await self.tables.run("UPDATE plan_questions SET message_id = ? WHERE id = ?", (message_id, question_id))

    async def settle_question(self, question_id: str, status: str, *, answer: str | None, actor: str | None) -> bool:
        """Compare-and-set: the first answer (or cancellation) wins; False when it was settled already."""
        settle = (
            "UPDATE plan_questions SET status = ?, answer = ?, answered_by = ?, answered_at = ?"
            " WHERE id = ? AND status = 'pending'"
        )
        params = (status, answer, actor, self.clock(), question_id)
        plan_id = None
        if self.replica is not None:
            row = await self.tables.one("SELECT plan_id FROM plan_questions WHERE id = ?", (question_id,))
            plan_id = None if row is None else str(row[0])
        return await self._moved(plan_id, settle, params) == 1

    async def load(self, plan_id: str) -> Plan | None:
        async with self.tables.locked() as db:
            head = await db.one(
                "SELECT conversation, goal, request_text, requested_by, request_files, status FROM plans WHERE id = ?",
                (plan_id,),
            )
            if head is None:
                return None
            rows = await db.all(
                "SELECT idx, title, assignee, input, wait_for, on_failure, status, output_summary, output_files,"
                " failure_reason, attempts, model, tools_json, started_at, finished_at, prompt_tokens,"
                " completion_tokens, cost, execution_json FROM plan_steps WHERE plan_id = ? ORDER BY idx",
                (plan_id,),
            )
        steps = {int(r[0]): _step(r) for r in rows}
        origin = PlanOrigin(str(head[2]), str(head[3]), tuple(str(f) for f in json.loads(head[4])))
        return Plan(plan_id, str(head[0]), str(head[1]), steps, origin, str(head[5]))

    async def set_status(
        self,
        plan_id: str,
        index: int,
        expected: StepStatus,
        new: StepStatus,
        *,
        attempt: int | None = None,
        started_by: str | None = None,
        **fields: Any,
    ) -> bool:
        """Compare-and-set one step along the transition table. False when the step was not ``expected``.

        The step's record moves with it: a step that starts (or starts waiting for a person) gets a fresh start
        time and an empty record; one that stops running gets its finish time (``finished=False``: it is not
        known when it stopped, e.g. interrupted by a crash) and what ``record`` says of its turn.
        ``attempt`` and ``started_by`` narrow the compare to that attempt, run by that replica: a recovery
        ends the run it judged abandoned, never a later one of the same step (a retry, a resumption elsewhere).
        """
        if new not in TRANSITIONS[expected]:
            raise TransitionError(f"step {index}: {expected.value} -> {new.value} is not allowed")
        now = self.clock()
        sets = ["status = ?", "updated_at = ?"]
        params: list[Any] = [new.value, now]
        if expected is StepStatus.PENDING and new in _ACTIVE:
            sets += ["started_at = ?", "finished_at = NULL", "model = ''", "tools_json = '[]'", "prompt_tokens = 0",
                     "completion_tokens = 0", "cost = NULL", "execution_json = NULL"]  # fmt: skip
            params.append(now)
        elif expected in _ACTIVE and new not in _ACTIVE and fields.get("finished", True):
            sets.append("finished_at = ?")
            params.append(now)
        record: StepRecord | None = fields.get("record")
        if record is not None:
            sets += ["model = ?", "tools_json = ?", "prompt_tokens = ?", "completion_tokens = ?", "cost = ?",
                     "execution_json = ?"]  # fmt: skip
            params += [
                record.model,
                json.dumps([t.as_json() for t in record.tools]),
                record.usage.prompt_tokens,
                record.usage.completion_tokens,
                record.usage.cost,
                None if record.execution is None else json.dumps(record.execution.as_json()),
            ]
        if new is StepStatus.DONE and "failure_reason" not in fields:
            fields = {**fields, "failure_reason": ""}  # an earlier attempt's failure is not this step's story
        for name in ("output_summary", "failure_reason"):
            if name in fields:
                sets.append(f"{name} = ?")
                params.append(str(fields[name]))
        if "output_files" in fields:
            sets.append("output_files = ?")
            params.append(json.dumps(list(fields["output_files"])))
        if fields.get("count_attempt"):
            sets.append("attempts = attempts + 1")
        if new is StepStatus.IN_PROGRESS:
            sets.append("replica = ?")
            params.append(self.replica)
        params.extend([plan_id, index, expected.value])
        where = ["plan_id = ?", "idx = ?", "status = ?"]
        if attempt is not None:
            where.append("attempts = ?")
            params.append(attempt)
        if started_by is not None:
            where.append("replica = ?")
            params.append(started_by)
        alone = expected is StepStatus.PENDING and new in _ACTIVE
        if alone:
            # One step of a plan at a time, said by the store: among replicas each chooses the step to start from
            # what it read (and from backoffs only it knows of), and two compare-and-sets on two steps both won.
            where.append(
                "NOT EXISTS (SELECT 1 FROM plan_steps o WHERE o.plan_id = ? AND o.idx <> ? AND o.status IN (?, ?))"
            )
            params += [plan_id, index, *(s.value for s in _ACTIVE)]
        update = f"UPDATE plan_steps SET {', '.join(sets)} WHERE {' AND '.join(where)}"  # noqa: S608
        return await self._moved(plan_id, update, params, lock=alone) == 1

    async def fail_interrupted(
        self,
        left: LeftStep,
        record: StepRecord,
        tools: Callable[[Tx], ExecutionSummary],
        reason: Callable[[ExecutionSummary], str],
    ) -> ExecutionSummary | None:
        """Fail the run ``left`` names as interrupted (a compare-and-set on its attempt and replica, as
        :meth:`set_status`); what ``tools`` read of its tools, None when it was not that run any more.

        ``tools`` reads in the same transaction, after the write: a tool of that run whose row was going in (it
        holds the step's row, see :class:`StepFence`) is committed before the write could take the row, so it is
        read; a later one finds the step failed and never starts. Its ending says what really ran."""
        where = ["plan_id = ?", "idx = ?", "status = ?", "attempts = ?"]
        params: list[Any] = [left.plan_id, left.index, StepStatus.IN_PROGRESS.value, left.attempt]
        if left.replica is not None:
            where.append("replica = ?")
            params.append(left.replica)
        take = f"UPDATE plan_steps SET status = ?, updated_at = ? WHERE {' AND '.join(where)}"  # noqa: S608
        replica = self.replica

        def op(tx: Tx) -> ExecutionSummary | None:
            if tx.run(take, (StepStatus.FAILED.value, self.clock(), *params)) != 1:
                return None
            summary = tools(tx)
            ended = replace(record, execution=summary)
            tx.run(
                "UPDATE plan_steps SET failure_reason = ?, model = ?, tools_json = ?, prompt_tokens = ?,"
                " completion_tokens = ?, cost = ?, execution_json = ? WHERE plan_id = ? AND idx = ?",
                (
                    reason(summary),
                    ended.model,
                    json.dumps([t.as_json() for t in ended.tools]),
                    ended.usage.prompt_tokens,
                    ended.usage.completion_tokens,
                    ended.usage.cost,
                    json.dumps(summary.as_json()),
                    left.plan_id,
                    left.index,
                ),
            )
            if replica is not None:
                tx.run(_OWN, (replica, left.plan_id))
            return summary

        writer = await self.tables.writer()
        return await writer.submit(op)

    async def _moved(self, plan_id: str | None, sql: str, params: Sequence[Any], *, lock: bool = False) -> int:
        """Run ``sql`` (a write that moves the plan); among replicas the plan is this replica's to drive from the
        same commit on (one group commit of the writer: both or neither). How many rows ``sql`` changed.

        ``lock``: ``sql`` reads the plan's other steps (a start, see :meth:`set_status`). Among replicas on
        PostgreSQL the plan's row is locked first: another replica's start of the plan waits for this one's
        commit, and its read then sees this step started (two reads before either write both saw none)."""
        if self.replica is None or plan_id is None:
            return await self.tables.run(sql, params)
        replica = self.replica
        postgres = self.postgres

        def op(tx: Tx) -> int:
            if lock and postgres:
                tx.one("SELECT 1 FROM plans WHERE id = ? FOR UPDATE", (plan_id,))
            changed = tx.run(sql, params)
            if changed:
                tx.run(_OWN, (replica, plan_id))
            return changed

        writer = await self.tables.writer()
        return await writer.submit(op)

    async def set_plan_status(self, plan_id: str, status: str) -> None:
        ended_at = None if status == "active" else self.clock()
        await self.tables.run("UPDATE plans SET status = ?, ended_at = ? WHERE id = ?", (status, ended_at, plan_id))

    async def prune(self, older_than_days: int) -> int:
        """Delete plans that ended (finished or aborted) more than ``older_than_days`` ago, with their steps,
        events and questions. A plan still active is never pruned, nor one with a step still running or waiting
        for a person, or a question still open. Returns how many plans went."""
        cutoff = self.clock() - older_than_days * 86400.0
        waiting = (StepStatus.IN_PROGRESS.value, StepStatus.WAITING_FOR_USER.value)
        # A plan that ended before ended_at was recorded: its steps' last update (or its creation) is its end.
        doomed = (
            "SELECT p.id FROM plans p WHERE p.status IN ('finished', 'aborted')"
            " AND COALESCE(p.ended_at, (SELECT MAX(s.updated_at) FROM plan_steps s WHERE s.plan_id = p.id),"
            " p.created_at) < ?"
            " AND NOT EXISTS (SELECT 1 FROM plan_steps s WHERE s.plan_id = p.id AND s.status IN (?, ?))"
            " AND NOT EXISTS (SELECT 1 FROM plan_questions q WHERE q.plan_id = p.id AND q.status = 'pending')"
        )
        params = (cutoff, *waiting)
        async with self.tables.transaction() as tx:
            ids = [str(r[0]) for r in await tx.all(doomed, params)]
            if not ids:
                return 0
            marks = ", ".join("?" for _ in ids)
            for table in ("plan_questions", "plan_events", "plan_steps"):
                await tx.run(f"DELETE FROM {table} WHERE plan_id IN ({marks})", ids)  # noqa: S608 - fixed names
            return await tx.run(f"DELETE FROM plans WHERE id IN ({marks})", ids)  # noqa: S608

    async def take_over_plans(self, live: Collection[str], *, leading: Callable[[], bool] | None = None) -> list[str]:
        """Active plans whose owner is not in ``live`` (the replicas alive now), each now this replica's: a
        compare-and-set on the owner, so one survivor repairs each, and a plan whose owner lives (its lead
        deciding, a turn running there) is never touched. A plan with no owner recorded (the only process on
        its store, or from before owners) cannot be told dead and is left. ``leading``: asked before each
        take; once it says no, the rest is left (an owner judged gone may be back under its name)."""
        rows = await self.tables.all(
            "SELECT id, owner FROM plans WHERE status = 'active' AND owner IS NOT NULL ORDER BY created_at", ()
        )
        taken: list[str] = []
        for plan_id, owner in rows:
            if owner in live:
                continue
            if leading is not None and not leading():
                break
            changed = await self.tables.run(
                "UPDATE plans SET owner = ? WHERE id = ? AND owner = ? AND status = 'active'",
                (self.replica, plan_id, owner),
            )
            if changed == 1:
                taken.append(str(plan_id))
        return taken

    async def owner(self, plan_id: str) -> str | None:
        """The replica driving ``plan_id`` (None: the only process on its store, or no such plan)."""
        row = await self.tables.one("SELECT owner FROM plans WHERE id = ?", (plan_id,))
        return None if row is None or row[0] is None else str(row[0])

    async def plan_status(self, plan_id: str) -> str | None:
        row = await self.tables.one("SELECT status FROM plans WHERE id = ?", (plan_id,))
        return None if row is None else str(row[0])

    async def with_steps_in(self, status: StepStatus, *, live: Collection[str] | None = None) -> list[tuple[str, int]]:
        """(plan, step) of every step in ``status``; with ``live`` (the replicas alive now), only those a
        replica not among them started (a step with no replica recorded cannot be told dead and is left)."""
        rows = await self.tables.all(
            "SELECT plan_id, idx, replica FROM plan_steps WHERE status = ? ORDER BY plan_id, idx", (status.value,)
        )
        return [(str(r[0]), int(r[1])) for r in rows if live is None or (r[2] is not None and r[2] not in live)]

    async def left_running(self, live: Collection[str] | None = None) -> list[LeftStep]:
        """The running steps :meth:`with_steps_in` names for ``live``, each with the attempt that runs and the
        replica running it: what a recovery judged abandoned, to end that run and no later one."""
        rows = await self.tables.all(
            "SELECT plan_id, idx, attempts, replica FROM plan_steps WHERE status = ? ORDER BY plan_id, idx",
            (StepStatus.IN_PROGRESS.value,),
        )
        return [
            LeftStep(str(r[0]), int(r[1]), int(r[2]), None if r[3] is None else str(r[3]))
            for r in rows
            if live is None or (r[3] is not None and r[3] not in live)
        ]

    async def run_of(self, plan_id: str, index: int) -> StepRun | None:
        """The step's run as it stands now (None: no such step, its plan pruned)."""
        row = await self.tables.one(
            "SELECT status, attempts, failure_reason, replica FROM plan_steps WHERE plan_id = ? AND idx = ?",
            (plan_id, index),
        )
        if row is None:
            return None
        return StepRun(StepStatus(row[0]), int(row[1]), str(row[2] or ""), None if row[3] is None else str(row[3]))

    async def last_plan(self, conversation: str) -> str | None:
        row = await self.tables.one(
            "SELECT id FROM plans WHERE conversation = ? ORDER BY created_at DESC LIMIT 1", (conversation,)
        )
        return None if row is None else str(row[0])

    async def active_plans(self) -> list[str]:
        """Every active plan, oldest first."""
        rows = await self.tables.all("SELECT id FROM plans WHERE status = 'active' ORDER BY created_at", ())
        return [str(r[0]) for r in rows]

    async def active_plan(self, conversation: str) -> str | None:
        row = await self.tables.one(
            "SELECT id FROM plans WHERE conversation = ? AND status = 'active' ORDER BY created_at DESC LIMIT 1",
            (conversation,),
        )
        return None if row is None else str(row[0])


# A step is active while it runs or waits for a person: its record has a start and no finish.
_ACTIVE = frozenset({StepStatus.IN_PROGRESS, StepStatus.WAITING_FOR_USER})

_INSERT_STEP = (
    "INSERT INTO plan_steps (plan_id, idx, title, assignee, input, wait_for, on_failure, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def _step_row(plan_id: str, spec: StepSpec, now: float) -> tuple[Any, ...]:
    wait_for = None if spec.wait_for is None else json.dumps(spec.wait_for)
    return (plan_id, spec.index, spec.title, spec.assignee, spec.input, wait_for, spec.on_failure.value, now)


def _step(row: Any) -> Step:
    (idx, title, assignee, text, wait_for, on_failure, status, summary, files, reason, attempts, model, tools,
     started_at, finished_at, prompt_tokens, completion_tokens, cost, execution) = row  # fmt: skip
    spec = StepSpec(
        index=int(idx),
        title=title,
        assignee=assignee,
        input=text,
        wait_for=None if wait_for is None else json.loads(wait_for),
        on_failure=OnFailure(on_failure),
    )
    record = StepRecord(
        model=str(model),
        tools=tuple(ToolUse.from_json(t) for t in json.loads(tools)),
        usage=Usage(int(prompt_tokens), int(completion_tokens), None if cost is None else float(cost)),
        started_at=None if started_at is None else float(started_at),
        finished_at=None if finished_at is None else float(finished_at),
        execution=None if execution is None else ExecutionSummary.from_json(json.loads(execution)),
    )
    return Step(spec, StepStatus(status), summary, list(json.loads(files)), reason, int(attempts), record)
