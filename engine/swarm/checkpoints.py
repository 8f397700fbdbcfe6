"""Pipeline checkpoints: a paused pipeline is an approval card on every platform; approving it resumes the
pipeline through the same capacity check as a new task.

Approving says *not waiting at a checkpoint*, *at capacity* (nothing is decided, the checkpoint stays open) or
*could not be recorded* when that is so. An approval pressed on a card while the swarm is full is final, so the
task stays paused until a running task ends, then resumes. Every gate that cannot be opened, withdrawn or
decided is counted at its site (``gate_register``, ``gate_settle``, ``approval_resolve``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from kazma.approvals.model import Decision, PressVerdict, Status
from kazma.approvals.service import ApprovalRefused, ApprovalService, ExecutionMismatch
from kazma.config.models import KazmaConfig
from kazma.engine.swarm.metrics import swarm_failure
from kazma.engine.swarm.store import (
    AtCapacity,
    IllegalTransition,
    StoreUnavailable,
    SwarmTaskStore,
    TaskRun,
    UnknownTask,
)
from kazma.engine.swarm.types import TaskStatus, WorkerResult

log = structlog.get_logger("kazma.swarm")

CHECKPOINT_TOOL = "pipeline_checkpoint"


def checkpoint_id(step: str) -> str | None:
    """The approval id a paused task's current step names (``checkpoint <id> after stage …``)."""
    parts = step.split()
    return parts[1] if len(parts) > 1 and parts[0] == "checkpoint" else None


class Checkpoints:
    def __init__(
        self,
        store: SwarmTaskStore,
        config: KazmaConfig,
        approvals: ApprovalService | None,
        capacity: asyncio.Event,  # set whenever a task stops running in this process
        report: Callable[[str], None],
    ) -> None:
        self.store = store
        self.config = config
        self.approvals = approvals
        self.capacity = capacity
        self.report = report

    async def pause(self, run: TaskRun, conversation: str, index: int, result: WorkerResult) -> TaskRun | None:
        """Pause after stage ``index + 1``: an approval card everywhere; approve resumes, reject or deadline ends."""
        if self.approvals is None:
            raise RuntimeError("a checkpoint needs the approvals service")
        limit = self.config.swarm.max_paused_pipelines
        if await self.store.count(TaskStatus.PAUSED) >= limit:
            error = f"{limit} pipelines are already paused at checkpoints; approve or reject some first"
            await self.store.finish(run, TaskStatus.FAILED, result=None, error=error)
            self.report(f"swarm task {run.task_id} failed: {error}")
            return None
        args = {"task": run.task_id, "after_stage": index + 1, "worker": result.worker, "output": result.output[:2000]}
        try:
            approval = await self.approvals.open(
                CHECKPOINT_TOOL,
                args,
                f"swarm:{run.task_id}",
                conversation,
                task_id=run.task_id,
                durable=True,  # the paused pipeline picks it up again after a restart: not an orphan
            )
        except (ApprovalRefused, Exception) as exc:  # no gate, no pause: the task ends, saying why
            swarm_failure("gate_register")
            log.warning("swarm.checkpoint_unopened", task_id=run.task_id, error=f"{type(exc).__name__}: {exc}")
            error = f"the checkpoint after stage {index + 1} could not be opened: {exc}"
            await self.store.finish(run, TaskStatus.FAILED, result=None, error=error)
            self.report(f"swarm task {run.task_id} failed: {error}")
            return None
        paused = f"checkpoint {approval.id} after stage {index + 1} ({result.worker})"
        try:
            recorded = await self.store.pause(run, paused)
        except StoreUnavailable as exc:
            swarm_failure("task_write")
            log.warning("swarm.pause_unrecorded", task_id=run.task_id, error=str(exc))
            recorded = False
        if not recorded:  # cancelled meanwhile, or not written: nobody must approve a pause that is not there
            await self.settle(approval.id, run.task_id, "the pipeline did not pause")
            return None
        self.report(f"swarm task {run.task_id} paused after stage {index + 1}: approve or reject it")
        return await self.wait(run.task_id, approval.id)

    async def settle(self, approval_id: str, task_id: str, why: str) -> None:
        """Withdraw a checkpoint's approval request (its cards show it ended); a failure is counted."""
        if self.approvals is None:
            return
        try:
            await self.approvals.cancel(approval_id, reason=f"swarm task {task_id}: {why}")
        except Exception as exc:  # the cards stay until the request's own deadline ends it
            swarm_failure("gate_settle")
            log.warning("swarm.checkpoint_unsettled", task_id=task_id, approval=approval_id, error=f"{exc}")

    async def wait(self, task_id: str, approval_id: str) -> TaskRun | None:
        assert self.approvals is not None
        outcome = await self.approvals.wait(approval_id, cancel_with_waiter=False)
        forged: str | None = None
        if outcome.status is Status.APPROVED:
            try:
                await self.approvals.verify_approval(approval_id)  # sealed by a press, not written into the store
            except ExecutionMismatch as exc:  # counted and audited by the approvals service
                forged = str(exc)
                log.warning("swarm.checkpoint_refused", task_id=task_id, approval=approval_id, reason=forged)
        if outcome.status is Status.APPROVED and forged is None:
            resumed = await self._resume_when_room(task_id)
            if resumed is not None:
                self.report(f"swarm task {task_id} resumed ({outcome.summary()})")
            return resumed
        why = "rejected" if outcome.status is Status.DENIED else outcome.status.value
        if forged is not None:
            why = f"refused: {forged}"
        with contextlib.suppress(UnknownTask):
            await self.store.cancel(task_id, actor=outcome.decided_by or "the checkpoint deadline")
        self.report(f"swarm task {task_id} ended at its checkpoint: {why} ({outcome.summary()})")
        return None

    async def _resume_when_room(self, task_id: str) -> TaskRun | None:
        """An approved checkpoint resumes through the same capacity check as a new task.

        When the swarm is full (the approval came from a card while it filled up) the task stays paused and
        resumes as soon as a running task ends; a resume the store cannot record is tried again. None: the
        task was cancelled while it waited.
        """
        told: set[str] = set()
        while True:
            self.capacity.clear()
            try:
                return await self.store.resume(task_id, max_running=self.config.swarm.max_parallel)
            except (IllegalTransition, UnknownTask):
                return None
            except AtCapacity as exc:
                wait = float(exc.retry_in)
                if "capacity" not in told:
                    told.add("capacity")
                    self.report(
                        f"swarm task {task_id} was approved, but the swarm is at capacity: "
                        "it resumes when a running task ends"
                    )
            except StoreUnavailable as exc:
                swarm_failure("running_row")
                log.warning("swarm.resume_unrecorded", task_id=task_id, error=str(exc))
                wait = float(self.store.capacity_retry_in)
                if "store" not in told:
                    told.add("store")
                    self.report(f"swarm task {task_id} was approved; its resume is not recorded yet, trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.capacity.wait(), timeout=wait)

    async def decide(self, task_id: str, decision: Decision, *, actor: str, platform: str) -> str:
        """Approve or reject a paused pipeline: not pending, at capacity and not recorded are each said."""
        if self.approvals is None:
            return "checkpoints need the approvals service"
        record = await self.store.get(task_id)
        if record is None:
            return f"no swarm task {task_id!r}"
        if record.status is not TaskStatus.PAUSED:
            return f"swarm task {task_id} is not waiting at a checkpoint (it is {record.status.value}); nothing changed"
        approval_id = checkpoint_id(record.current_step)
        if approval_id is None:
            return f"swarm task {task_id} has no open checkpoint"
        if decision is Decision.APPROVE:
            running = await self.store.count(TaskStatus.RUNNING)
            limit = self.config.swarm.max_parallel
            if running >= limit:
                log.info("swarm.resume_refused_at_capacity", task_id=task_id, actor=actor, running=running)
                return (
                    f"Not approved: the swarm is at capacity ({running} of {limit} tasks running), so swarm task "
                    f"{task_id} cannot resume now. Its checkpoint stays open: approve again in about "
                    f"{self.store.capacity_retry_in} s."
                )
        result = await self.approvals.decide(approval_id, decision, actor=actor, platform=platform)
        if (
            result.verdict is PressVerdict.REFUSED
            and self.approvals.is_approver(actor, platform)
            and await self._still_pending(approval_id)
        ):
            swarm_failure("approval_resolve")
            log.warning(
                "swarm.checkpoint_decision_unrecorded",
                task_id=task_id,
                approval=approval_id,
                actor=actor,
                platform=platform,
                decision=decision.value,
                reason=result.message,
            )
        return result.message

    async def _still_pending(self, approval_id: str) -> bool:
        assert self.approvals is not None
        try:
            request = await self.approvals.store.get(approval_id)
        except Exception as exc:  # cannot tell: the decision is certainly not known to be recorded
            log.warning("swarm.checkpoint_unreadable", approval=approval_id, error=f"{exc}")
            return True
        return request is not None and request.outcome() is None
