"""Plans on disk. Step status moves only by compare-and-set, so a step cannot be dispatched twice."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import aiosqlite

from kazma.config.database import Migration, Tables
from kazma.engine.plan import OnFailure, Plan, PlanSpec, Step, StepSpec, StepStatus

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
    )
]

# Terminal states are never left; nothing returns to pending except a transient retry.
TRANSITIONS: dict[StepStatus, set[StepStatus]] = {
    StepStatus.PENDING: {StepStatus.IN_PROGRESS, StepStatus.SKIPPED, StepStatus.BLOCKED},
    StepStatus.IN_PROGRESS: {StepStatus.DONE, StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.PENDING},
    StepStatus.DONE: set(),
    StepStatus.FAILED: set(),
    StepStatus.SKIPPED: set(),
    StepStatus.BLOCKED: set(),
}


class TransitionError(Exception):
    pass


class PlanStore:
    def __init__(self, conn: aiosqlite.Connection, *, clock: Callable[[], float] = time.time) -> None:
        self.conn = conn
        self.clock = clock
        self.tables = Tables.of(conn)

    async def create(self, conversation: str, spec: PlanSpec) -> Plan:
        plan_id = secrets.token_urlsafe(9)
        now = self.clock()
        async with self.tables.transaction() as tx:
            await tx.run(
                "INSERT INTO plans (id, conversation, goal, created_at) VALUES (?, ?, ?, ?)",
                (plan_id, conversation, spec.goal, now),
            )
            await tx.run_many(
                "INSERT INTO plan_steps (plan_id, idx, title, assignee, input, wait_for, on_failure, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        plan_id,
                        s.index,
                        s.title,
                        s.assignee,
                        s.input,
                        None if s.wait_for is None else json.dumps(s.wait_for),
                        s.on_failure.value,
                        now,
                    )
                    for s in spec.steps
                ],
            )
        plan = await self.load(plan_id)
        assert plan is not None
        return plan

    async def load(self, plan_id: str) -> Plan | None:
        async with self.tables.locked() as db:
            head = await db.one("SELECT conversation, goal FROM plans WHERE id = ?", (plan_id,))
            if head is None:
                return None
            rows = await db.all(
                "SELECT idx, title, assignee, input, wait_for, on_failure, status, output_summary, output_files,"
                " failure_reason, attempts FROM plan_steps WHERE plan_id = ? ORDER BY idx",
                (plan_id,),
            )
        steps = {int(r[0]): _step(r) for r in rows}
        return Plan(plan_id, str(head[0]), str(head[1]), steps)

    async def set_status(
        self,
        plan_id: str,
        index: int,
        expected: StepStatus,
        new: StepStatus,
        **fields: Any,
    ) -> bool:
        """Compare-and-set one step along the transition table. False when the step was not ``expected``."""
        if new not in TRANSITIONS[expected]:
            raise TransitionError(f"step {index}: {expected.value} -> {new.value} is not allowed")
        sets = ["status = ?", "updated_at = ?"]
        params: list[Any] = [new.value, self.clock()]
        for name in ("output_summary", "failure_reason"):
            if name in fields:
                sets.append(f"{name} = ?")
                params.append(str(fields[name]))
        if "output_files" in fields:
            sets.append("output_files = ?")
            params.append(json.dumps(list(fields["output_files"])))
        if fields.get("count_attempt"):
            sets.append("attempts = attempts + 1")
        params.extend([plan_id, index, expected.value])
        changed = await self.tables.run(
            f"UPDATE plan_steps SET {', '.join(sets)} WHERE plan_id = ? AND idx = ? AND status = ?",  # noqa: S608
            params,
        )
        return changed == 1

    async def set_plan_status(self, plan_id: str, status: str) -> None:
        await self.tables.run("UPDATE plans SET status = ? WHERE id = ?", (status, plan_id))

    async def plan_status(self, plan_id: str) -> str | None:
        row = await self.tables.one("SELECT status FROM plans WHERE id = ?", (plan_id,))
        return None if row is None else str(row[0])

    async def with_steps_in(self, status: StepStatus) -> list[tuple[str, int]]:
        rows = await self.tables.all(
            "SELECT plan_id, idx FROM plan_steps WHERE status = ? ORDER BY plan_id, idx", (status.value,)
        )
        return [(str(r[0]), int(r[1])) for r in rows]

    async def active_plan(self, conversation: str) -> str | None:
        row = await self.tables.one(
            "SELECT id FROM plans WHERE conversation = ? AND status = 'active' ORDER BY created_at DESC LIMIT 1",
            (conversation,),
        )
        return None if row is None else str(row[0])


def _step(row: Any) -> Step:
    idx, title, assignee, text, wait_for, on_failure, status, summary, files, reason, attempts = row
    spec = StepSpec(
        index=int(idx),
        title=title,
        assignee=assignee,
        input=text,
        wait_for=None if wait_for is None else json.loads(wait_for),
        on_failure=OnFailure(on_failure),
    )
    return Step(spec, StepStatus(status), summary, list(json.loads(files)), reason, int(attempts))
