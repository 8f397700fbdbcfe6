"""A task and its worker calls as one JSON object: ``kazma swarm show <id> --json`` and anything scripted on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kazma.engine.swarm.call_records import CallRecord
from kazma.engine.swarm.endings import execution_of, kept_answers
from kazma.engine.swarm.store import TaskRecord


def task_json(record: TaskRecord, calls: Sequence[CallRecord]) -> dict[str, Any]:
    return {
        "id": record.id,
        "pattern": record.pattern,
        "status": record.status.value,
        "owner": record.owner,
        "route": record.route,
        "created_at": record.created_at.isoformat(),
        "finished_at": None if record.finished_at is None else record.finished_at.isoformat(),
        "current_step": record.current_step,
        "error": record.error,
        "request": record.request,
        "result": record.result,
        # what its ending says of its tools (None: it has not ended), and the answers it kept when it did not succeed
        "execution": None if (execution := execution_of(record)) is None else execution.as_json(),
        "kept_answers": [{"worker": worker, "output": answer} for worker, answer in kept_answers(record)],
        "steps": [call.as_json() for call in calls],
    }
