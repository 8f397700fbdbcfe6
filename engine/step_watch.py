"""Stopping a plan step's turn that was taken away from this replica while it ran.

Among replicas the leader fails the running steps of a replica it judges gone (interrupted), and the lead may
run the step again elsewhere. A replica judged gone while it still ran (cut off from the database for longer
than the takeover bound, or paused) is told by nothing but the step's row: its turn went on beside the retry,
and its tools acted a second time (only its result was dropped, by the attempt check). Here, like the swarm's
watch for tasks ended elsewhere, each step turn running here is read back periodically, and once more just
before each of its tools starts; a run taken away is cancelled before its next tool can start. A read that
came just before the leader's write is closed by the tool's execution row, written only while the step is
still this run's (:class:`~kazma.engine.plan_store.StepFence`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from kazma.config.metrics import count_failure
from kazma.config.store.errors import store_errors
from kazma.config.supervisor import Supervisor
from kazma.engine.agent import StepRef
from kazma.engine.executor import ABORTED_WHILE_RUNNING, INTERRUPTED
from kazma.engine.plan import StepStatus
from kazma.engine.plan_store import PlanStore, StepRun

log = structlog.get_logger("kazma.step_watch")

STEP_POLL_SECONDS: Final = 1.0  # how long a turn taken away may go on between tools (a long tool, a model call)


def taken_away(step: StepRef, run: StepRun | None) -> str | None:
    """Why ``step``'s run is no longer this turn's to carry on (None: it still is).

    Only what someone else does to a running step counts: its own turn ends it only after the turn returns,
    and a question it asks (waiting for a person) leaves the same attempt running."""
    if run is None:
        return "its plan is gone"
    if run.attempts != step.attempt:
        return f"the step runs again (attempt {run.attempts})"
    if run.status is StepStatus.FAILED and run.failure_reason.startswith(INTERRUPTED):
        return "it was failed as interrupted: this replica was judged gone"
    if run.status is StepStatus.FAILED and run.failure_reason.startswith(ABORTED_WHILE_RUNNING):
        return "its plan was aborted"
    if run.status is StepStatus.PENDING:  # failed elsewhere and retried, not dispatched yet
        return "the step was retried"
    return None


@dataclass
class StepWatch:
    """The step turns running in this process, and the one task that reads them back while any run."""

    store: PlanStore
    poll_seconds: float = STEP_POLL_SECONDS
    polls: int = 0  # reads made (tests wait for one)
    _running: dict[StepRef, asyncio.Task[Any]] = field(default_factory=dict)
    _taken: dict[StepRef, str] = field(default_factory=dict)
    _cancels: dict[StepRef, int] = field(default_factory=dict)  # cancellations of a turn that are this watch's
    _tasks: Supervisor = field(default_factory=lambda: Supervisor("step_watch"))
    _watcher: asyncio.Task[None] | None = None
    _reading: bool = False

    @contextlib.contextmanager
    def watching(self, step: StepRef) -> Iterator[None]:
        """While the block runs (in the turn's task), the step is read back; taken away, the task is cancelled."""
        task = asyncio.current_task()
        assert task is not None
        self._running[step] = task
        if self._watcher is None or self._watcher.done():
            self._watcher = self._tasks.spawn(self._watch(), name="plan-steps-taken-elsewhere")
        try:
            yield
        finally:
            if self._running.get(step) is task:
                del self._running[step]
            if not self._running and self._watcher is not None and not self._reading:
                # Asleep between reads: nothing left to watch (a read under way ends the loop by itself).
                self._watcher.cancel()
                self._watcher = None

    def taken(self, step: StepRef) -> str | None:
        """Why ``step``'s turn was stopped here (None: it was not)."""
        return self._taken.get(step)

    def forget(self, step: StepRef) -> int:
        """Done with a stopped turn: how many cancellations of its task were this watch's (to take back)."""
        self._taken.pop(step, None)
        return self._cancels.pop(step, 0)

    async def check(self, step: StepRef) -> None:
        """From inside the turn, before a tool starts: a run taken away is cancelled here, at this await, never
        inside the tool. A store that cannot be read raises (the tool must not start on a guess)."""
        if step in self._taken:  # stopped before, and the cancellation was swallowed on its way out: again
            self._cancel(step)
        else:
            await self._stop_taken([step])
        await asyncio.sleep(0)

    async def _watch(self) -> None:
        while self._running:
            await asyncio.sleep(self.poll_seconds)
            self._reading = True
            try:
                await self._stop_taken(list(self._running))
                self.polls += 1
            except store_errors() as exc:  # read again next time; a tool's own check refuses it meanwhile
                count_failure("step_watch")
                log.warning("plan.step_watch_unread", error=str(exc))
            finally:
                self._reading = False

    async def _stop_taken(self, steps: Collection[StepRef]) -> None:
        for step in steps:
            reason = taken_away(step, await self.store.run_of(step.plan_id, step.index))
            task = self._running.get(step)
            if reason is None or task is None or task.done() or step in self._taken:
                continue
            self._taken[step] = reason
            log.warning(
                "plan.step_taken_elsewhere", plan_id=step.plan_id, step=step.index, attempt=step.attempt, reason=reason
            )
            self._cancel(step)

    def _cancel(self, step: StepRef) -> None:
        task = self._running.get(step)
        if task is not None and task.cancel():
            self._cancels[step] = self._cancels.get(step, 0) + 1
