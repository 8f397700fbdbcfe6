"""The record of every worker call of a task, and which workers each task named or ran.

:class:`CallRecords` is part of :class:`~kazma.engine.swarm.store.SwarmTaskStore` (its plumbing — the tables,
retried transient errors — is the store's); the rows live in the swarm component's own migration 3.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from kazma.config.store.backend import SqlStatements
from kazma.engine.swarm.types import WorkerResult
from kazma.engine.types import ToolUse

T = TypeVar("T")


class RunRef(Protocol):
    """The run a call belongs to (a :class:`~kazma.engine.swarm.store.TaskRun`)."""

    @property
    def task_id(self) -> str: ...

    @property
    def generation(self) -> int: ...


_CALL_COLUMNS = (
    "task_id, seq, generation, worker, step, attempt, model, tools_json, started_at, finished_at, ok, error,"
    " prompt_tokens, completion_tokens, cost"
)

TASK_WORKER = "INSERT INTO swarm_task_workers (worker, task_id) VALUES (?, ?) ON CONFLICT DO NOTHING"


@dataclass(frozen=True)
class CallRecord:
    """One worker call of a task (one attempt): what ran it, what it called, when, what it cost, how it ended."""

    task_id: str
    seq: int  # the call's place in the task, from 1
    generation: int
    worker: str
    step: str  # where in the task ("stage 2", "branch docs", "handoff from a"; "" for a plain dispatch)
    attempt: int  # 1 for the first attempt, 2 for its first retry …
    model: str
    tools: tuple[ToolUse, ...]
    started_at: datetime
    finished_at: datetime | None  # None: still running, or the process stopped during it
    ok: bool | None  # None while running
    error: str
    prompt_tokens: int
    completion_tokens: int
    cost: float | None  # what the model's server reported; None when it did not say

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.started_at).total_seconds()

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "generation": self.generation,
            "worker": self.worker,
            "step": self.step,
            "attempt": self.attempt,
            "model": self.model,
            "tools": [t.as_json() for t in self.tools],
            "started_at": self.started_at.isoformat(),
            "finished_at": None if self.finished_at is None else self.finished_at.isoformat(),
            "seconds": self.seconds,
            "ok": self.ok,
            "error": self.error,
            "tokens": {"prompt": self.prompt_tokens, "completion": self.completion_tokens},
            "cost": self.cost,
        }


class CallRecords:
    """Calls of tasks: recorded before each one runs and when it ends, read back in order."""

    clock: Callable[[], float]

    async def _attempt(
        self, operation: str, body: Callable[[SqlStatements], Awaitable[T]], *, transaction: bool = False
    ) -> T:
        raise NotImplementedError  # the store's own, with its retries

    async def start_call(self, run: RunRef, worker: str, *, step: str, attempt: int) -> int:
        """Record that a worker call starts (before it runs); returns its place in the task (``seq``).

        Calls are recorded whatever the run's generation: a call that happened is evidence either way.
        """
        now = self.clock()

        async def body(db: SqlStatements) -> int:
            row = await db.one("SELECT COALESCE(MAX(seq), 0) FROM swarm_calls WHERE task_id = ?", (run.task_id,))
            seq = int(row[0]) + 1
            await db.run(
                "INSERT INTO swarm_calls (task_id, seq, generation, worker, step, attempt, started_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (run.task_id, seq, run.generation, worker, step, attempt, now),
            )
            await db.run(TASK_WORKER, (worker, run.task_id))
            return seq

        return await self._attempt("start_call", body, transaction=True)

    async def finish_call(self, task_id: str, seq: int, result: WorkerResult) -> None:
        """Record how call ``seq`` ended: model, tools with their approvals, tokens, cost, error."""
        usage = result.usage

        async def body(db: SqlStatements) -> None:
            await db.run(
                "UPDATE swarm_calls SET finished_at = ?, ok = ?, error = ?, model = ?, tools_json = ?,"
                " prompt_tokens = ?, completion_tokens = ?, cost = ? WHERE task_id = ? AND seq = ?",
                (
                    self.clock(),
                    int(result.ok),
                    result.error,
                    result.model,
                    json.dumps([t.as_json() for t in result.tools]),
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    usage.cost,
                    task_id,
                    seq,
                ),
            )

        await self._attempt("finish_call", body, transaction=True)

    async def calls(self, task_id: str) -> builtins.list[CallRecord]:
        """Every recorded worker call of the task, in the order they started."""

        async def body(db: SqlStatements) -> builtins.list[Any]:
            return await db.all(
                f"SELECT {_CALL_COLUMNS} FROM swarm_calls WHERE task_id = ? ORDER BY seq",  # noqa: S608
                (task_id,),
            )

        return [_call_record(r) for r in await self._attempt("calls", body)]

    async def calls_of(self, task_ids: Collection[str]) -> dict[str, builtins.list[CallRecord]]:
        """The recorded calls of several tasks at once (the dashboard's tasks), by task, each in order."""
        ids = sorted(set(task_ids))
        found: dict[str, builtins.list[CallRecord]] = {task_id: [] for task_id in ids}
        if not ids:
            return found

        async def body(db: SqlStatements) -> builtins.list[Any]:
            return await db.all(
                f"SELECT {_CALL_COLUMNS} FROM swarm_calls WHERE task_id IN ({', '.join('?' for _ in ids)})"  # noqa: S608
                " ORDER BY task_id, seq",
                ids,
            )

        for row in await self._attempt("calls_of", body):
            record = _call_record(row)
            found[record.task_id].append(record)
        return found


def _call_record(row: Any) -> CallRecord:
    (task_id, seq, generation, worker, step, attempt, model, tools_json, started_at, finished_at, ok, error,
     prompt_tokens, completion_tokens, cost) = row  # fmt: skip
    return CallRecord(
        task_id=str(task_id),
        seq=int(seq),
        generation=int(generation),
        worker=str(worker),
        step=str(step),
        attempt=int(attempt),
        model=str(model),
        tools=tuple(ToolUse.from_json(t) for t in json.loads(tools_json)),
        started_at=_utc(float(started_at)),
        finished_at=None if finished_at is None else _utc(float(finished_at)),
        ok=None if ok is None else bool(ok),
        error=str(error),
        prompt_tokens=int(prompt_tokens),
        completion_tokens=int(completion_tokens),
        cost=None if cost is None else float(cost),
    )


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)
