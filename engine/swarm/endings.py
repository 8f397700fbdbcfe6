"""What a task's ending says, the same on every surface that shows the task.

``/swarm status`` (chat, the console's command box, ``kazma swarm status|show``), ``check_swarm_task``, the
dashboard and the message a finished task delivers all read a task through these functions:

- what its tools did (:func:`execution_of`): *did not run*, *ran*, or *may have run (started, not finished)*,
  naming them (:mod:`kazma.engine.tools.executions`);
- the answers it kept (:func:`kept_answers`): a task that hit its deadline, or failed part-way, keeps the
  answers of the workers that finished, and they are shown, not only counted;
- a result not stored yet (:class:`Unsaved`): the run ended, the store refused its ending; the result is
  kept in the process and stored when the store answers, and meanwhile the task reads as it ended.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from kazma.engine.swarm.store import TaskRecord
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.tools.executions import ExecutionSummary

ANSWER_LIMIT = 1500  # characters of each kept answer in a chat message (the console and --json have them whole)


@dataclass(frozen=True)
class Unsaved:
    """A run's ending the store did not take (yet): kept here, shown as the task's state, stored later."""

    status: TaskStatus
    result: dict[str, Any]
    error: str | None
    why: str  # the store's error
    at: float  # when it ended (epoch seconds)

    def over(self, record: TaskRecord) -> TaskRecord:
        """``record`` (its last stored state, ``running``) as the run really ended."""
        note = f"its result is not stored yet ({self.why}); it is kept by this Kazma and stored when the store answers"
        return replace(
            record,
            status=self.status,
            result=self.result,
            error=f"{self.error}; {note}" if self.error else note,
            finished_at=datetime.fromtimestamp(self.at, UTC),
        )


def execution_of(record: TaskRecord) -> ExecutionSummary | None:
    """What the task's tools did, as its ending said (None: it has not ended, or ended before this was kept)."""
    return ExecutionSummary.from_json((record.result or {}).get("execution"))


def kept_answers(record: TaskRecord) -> list[tuple[str, str]]:
    """(worker, answer) of every worker that finished, when the task did not succeed as a whole (a deadline, a
    failure part-way): what was kept must be visible, not only counted."""
    if record.status in (TaskStatus.SUCCEEDED, TaskStatus.RUNNING, TaskStatus.PAUSED):
        return []
    workers = (record.result or {}).get("workers") or []
    return [
        (str(w.get("worker", "")), str(w.get("output", "")))
        for w in workers
        if isinstance(w, dict) and w.get("ok") and str(w.get("output", "")).strip()
    ]


def ending_lines(record: TaskRecord, *, limit: int = ANSWER_LIMIT) -> list[str]:
    """The lines every surface adds to a task's status: its tools, and the answers it kept."""
    lines: list[str] = []
    execution = execution_of(record)
    if execution is not None:
        lines.append(f"tools: {execution.line()}")
    elif record.status is TaskStatus.INTERRUPTED:
        lines.append("tools: unknown (it stopped before executions were recorded)")
    answers = kept_answers(record)
    if answers:
        lines.append(f"kept answers ({len(answers)}):")
        lines.extend(f"[{worker}] {_cut(answer, limit)}" for worker, answer in answers)
    return lines


def _cut(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
