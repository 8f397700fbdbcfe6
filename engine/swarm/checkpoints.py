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
from collections.abc import Awaitable, Callable

import structlog

from kazma.approvals.chain import AuditChain
from kazma.approvals.model import Decision, PressVerdict, Status
from kazma.approvals.service import ApprovalService, ExecutionMismatch
from kazma.config import failpoints
from kazma.config.models import KazmaConfig
from kazma.config.store.backend import Tx, database_identity
from kazma.config.store.errors import simulated_failure
from kazma.config.waits import until_set
from kazma.engine.swarm.metrics import swarm_failure
from kazma.engine.swarm.store import (
    AtCapacity,
    IllegalTransition,
    StoreUnavailable,
    SwarmTaskStore,
    TaskRun,
    UnknownTask,
)
from kazma.engine.swarm.types import TaskStatus, WorkerResult, current_starter

log = structlog.get_logger("kazma.swarm")

CHECKPOINT_TOOL = "pipeline_checkpoint"
CHECKPOINT_OUTPUT_SHOWN = 65_536  # characters of a stage's output a checkpoint card holds (more: said to be cut)


def checkpoint_id(step: str) -> str | None:
    """The approval id a paused task's current step names (``checkpoint <id> after stage …``)."""
    parts = step.split()
    return parts[1] if len(parts) > 1 and parts[0] == "checkpoint" else None


class _NotPaused(Exception):
    """The pause changed no row (the task was cancelled, or this run is stale): nothing is opened."""


class _PauseGate:
    """The paused row, written first in the transaction that opens the checkpoint's request and queues its card
    posts; a pause that changes no row undoes the whole transaction (approvals' ``OpenGate``)."""

    def __init__(self, store: SwarmTaskStore, run: TaskRun, step_of: Callable[[str], str]) -> None:
        self.store = store
        self.run = run
        self.step_of = step_of

    def admit(self, tx: Tx, request_id: str) -> str | None:
        if failpoints.armed:
            failpoints.reached_sync("swarm.checkpoint.card", lambda: simulated_failure(tx, "checkpoint"))
        if self.store.pause_statements(self.run, self.step_of(request_id))(tx) != 1:
            raise _NotPaused(self.run.task_id)
        return None

    def opened(self, tx: Tx, request_id: str, audit: AuditChain) -> None:
        return None


class Checkpoints:
    def __init__(
        self,
        store: SwarmTaskStore,
        config: KazmaConfig,
        approvals: ApprovalService | None,
        capacity: asyncio.Event,  # set whenever a task stops running in this process
        report: Callable[[str], None],
        ended: Callable[[str, str], Awaitable[None]] | None = None,
        ending: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.approvals = approvals
        self.capacity = capacity
        self.report = report
        # says a task's ending at its checkpoint where its result would have gone (task id, the ending's line)
        self.ended = ended
        # told (task id) before this writes a task's ending: a row this process ends is its own ending, not a cancel
        # made elsewhere that stops the task here (SwarmService._stop_ended)
        self.ending = ending if ending is not None else (lambda _task_id: None)
        self._shared: bool | None = None  # the task store and the approvals write to one database

    async def pause(self, run: TaskRun, conversation: str, index: int, result: WorkerResult) -> TaskRun | None:
        """Pause after stage ``index + 1``: an approval card everywhere; approve resumes, reject or deadline ends.

        The card and the paused row are one commit where the task store and the approvals share a database
        (every running Kazma): a card is never out for a task that is not paused at it, whatever stops in
        between. Elsewhere (stores in two files: only tests build that) the request opens first and the pause
        follows, the pair shielded from a stop; the sweep (:meth:`withdraw_stale`) withdraws what a crash left.
        """
        if self.approvals is None:
            raise RuntimeError("a checkpoint needs the approvals service")
        limit = self.config.swarm.max_paused_pipelines
        if await self.store.count(TaskStatus.PAUSED) >= limit:
            error = f"{limit} pipelines are already paused at checkpoints; approve or reject some first"
            self.ending(run.task_id)
            await self.store.finish(run, TaskStatus.FAILED, result=None, error=error)
            self.report(f"swarm task {run.task_id} failed: {error}")
            return None
        # The stage's output is what the person judges and what the next stage gets: shown whole (the card cuts
        # a long value visibly, the approval page never), and past CHECKPOINT_OUTPUT_SHOWN said to be cut.
        output = result.output
        args: dict[str, object] = {
            "task": run.task_id, "after_stage": index + 1, "worker": result.worker,
            "output": output[:CHECKPOINT_OUTPUT_SHOWN],
        }  # fmt: skip
        if len(output) > CHECKPOINT_OUTPUT_SHOWN:
            args["output_cut"] = (
                f"only the first {CHECKPOINT_OUTPUT_SHOWN:,} of {len(output):,} characters are shown; the next stage "
                "gets them all"
            )

        def step_of(approval_id: str) -> str:
            return f"checkpoint {approval_id} after stage {index + 1} ({result.worker})"

        if await self._one_database():
            approval_id = await self._open_paused(run, conversation, index, args, step_of)
        else:
            approval_id = await asyncio.shield(self._open_then_pause(run, conversation, index, args, step_of))
        if approval_id is None:
            return None
        self.report(f"swarm task {run.task_id} paused after stage {index + 1}: approve or reject it")
        try:
            if failpoints.armed:
                await failpoints.reached(
                    "swarm.checkpoint.paused", lambda: simulated_failure(self.approvals_tables(), "checkpoint wait")
                )
            return await self.wait(run.task_id, approval_id)
        except Exception as exc:
            # The task ends with this error (failed); its card must not outlive it with live buttons.
            await self.settle(approval_id, run.task_id, f"the pipeline stopped at its checkpoint: {exc}")
            raise

    def approvals_tables(self) -> object:
        assert self.approvals is not None
        return self.approvals.store.tables

    async def _one_database(self) -> bool:
        if self._shared is None:
            self._shared = await database_identity(self.store.tables) == await database_identity(
                self.approvals_tables()
            )
        return self._shared

    async def _gate_failed(self, run: TaskRun, index: int, exc: BaseException) -> None:
        swarm_failure("gate_register")
        log.warning("swarm.checkpoint_unopened", task_id=run.task_id, error=f"{type(exc).__name__}: {exc}")
        error = f"the checkpoint after stage {index + 1} could not be opened: {exc}"
        self.ending(run.task_id)
        await self.store.finish(run, TaskStatus.FAILED, result=None, error=error)
        self.report(f"swarm task {run.task_id} failed: {error}")

    async def _open_paused(
        self, run: TaskRun, conversation: str, index: int, args: dict[str, object], step_of: Callable[[str], str]
    ) -> str | None:
        """The checkpoint's request, its card posts and the paused row in one transaction: its id, or None."""
        assert self.approvals is not None
        gate = _PauseGate(self.store, run, step_of)
        try:
            approval, _ = await self.approvals.open_once(
                CHECKPOINT_TOOL,
                args,
                f"swarm:{run.task_id}",
                conversation,
                task_id=run.task_id,
                durable=True,  # the paused pipeline picks it up again after a restart: not an orphan
                gate=gate,
                started_by=current_starter(),  # the task's asker: a no-self policy bars their Approve
            )
        except _NotPaused:  # cancelled meanwhile (or a stale run): nothing was opened, the canceller ends it
            await self.store.pause_refused(run, step_of("-"))
            return None
        except Exception as exc:  # no gate, no pause: the task ends, saying why
            await self._gate_failed(run, index, exc)
            return None
        return approval.id

    async def _open_then_pause(
        self, run: TaskRun, conversation: str, index: int, args: dict[str, object], step_of: Callable[[str], str]
    ) -> str | None:
        assert self.approvals is not None
        try:
            approval = await self.approvals.open(
                CHECKPOINT_TOOL, args, f"swarm:{run.task_id}", conversation, task_id=run.task_id, durable=True,
                started_by=current_starter(),
            )  # fmt: skip
        except Exception as exc:  # ApprovalRefused, a store error: no gate, no pause
            await self._gate_failed(run, index, exc)
            return None
        try:
            recorded = await self.store.pause(run, step_of(approval.id))
        except StoreUnavailable as exc:
            swarm_failure("task_write")
            log.warning("swarm.pause_unrecorded", task_id=run.task_id, error=str(exc))
            await self.settle(approval.id, run.task_id, "the pipeline did not pause")
            raise
        if not recorded:  # cancelled meanwhile: nobody must approve a pause that is not there
            await self.settle(approval.id, run.task_id, "the pipeline did not pause")
            return None
        return approval.id

    async def withdraw_stale(self) -> list[str]:
        """Withdraw every pending checkpoint request whose task is not paused at it (ended, or paused at another
        one): what a crash between a card and its pause left, or an ending that could not withdraw its card.
        Run at start and by the sweep; the ids withdrawn."""
        if self.approvals is None:
            return []
        withdrawn: list[str] = []
        for request in await self.approvals.store.pending_of(CHECKPOINT_TOOL):
            if not request.requested_by.startswith("swarm:"):
                continue
            task_id = request.task_id or request.requested_by.removeprefix("swarm:")
            record = await self.store.get(task_id)
            waiting = record is not None and (
                record.status is TaskStatus.RUNNING  # about to pause at it (stores in two files)
                or (record.status is TaskStatus.PAUSED and checkpoint_id(record.current_step) == request.id)
            )
            if waiting:
                continue
            state = "gone" if record is None else f"{record.status.value} without it"
            await self.settle(request.id, task_id, f"the task is {state}")
            withdrawn.append(request.id)
            log.warning("swarm.checkpoint_withdrawn", task_id=task_id, approval=request.id, task_state=state)
        return withdrawn

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
                if failpoints.armed:  # RUNNING again on disk, the next stage not started
                    try:
                        await failpoints.reached(
                            "swarm.resumed", lambda: StoreUnavailable("step", "the store refused the write (failpoint)")
                        )
                    except StoreUnavailable as exc:  # as a step mark that is not written: counted, the run goes on
                        swarm_failure("step_journal")
                        log.warning("swarm.step_unrecorded", task_id=task_id, step="resumed", error=str(exc))
            return resumed
        why = "rejected" if outcome.status is Status.DENIED else outcome.status.value
        if forged is not None:
            why = f"refused: {forged}"
        line = f"swarm task {task_id} ended at its checkpoint: {why} ({outcome.summary()})"
        ended = False
        self.ending(task_id)
        with contextlib.suppress(UnknownTask):
            ended = await self.store.cancel(
                task_id, actor=outcome.decided_by or "the checkpoint deadline", error=f"ended at its checkpoint: {why}"
            )
        if ended and self.ended is not None:
            await self.ended(task_id, line)  # its chat (or route) hears it, as it would have heard its result
        else:
            self.report(line)
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
            await until_set(self.capacity, wait)

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
