"""The plan executor: event-driven, one reconcile at a time per conversation.

Each step completion triggers a reconcile under the conversation's lock:
record the outcome, find ready steps, dispatch the lowest-index one. The
step is marked ``in_progress`` on disk (compare-and-set) *before* the
dispatch message is posted, and the dispatch happens after the lock is
released so a sub-agent that answers at once cannot deadlock the executor.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import structlog

from kazma.config.metrics import count_failure
from kazma.engine.plan import USER, OnFailure, Plan, PlanSpec, Step, StepStatus, dependencies, validate_plan
from kazma.engine.plan_store import PlanStore

log = structlog.get_logger("kazma.executor")

INTERRUPTED = "interrupted: the process stopped while this step ran; its outcome is unknown"


@dataclass(frozen=True)
class StepResult:
    ok: bool
    summary: str = ""
    files: tuple[str, ...] = ()
    error: str = ""
    transient: bool = False  # worth another attempt (timeouts, 5xx); never for work that changed state


class ActionKind(StrEnum):
    DISPATCH = "dispatch"  # post "@<sub-agent> <input>" as the lead
    ASK_USER = "ask_user"  # post the question; the plan waits for a human answer
    RUN_LEAD = "run_lead"  # a lead turn, no extra visible message
    ASK_LEAD = "ask_lead"  # a step failed: ask the lead what next
    FINISHED = "finished"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    plan: Plan
    step: Step | None = None
    text: str = ""


class Dispatcher(Protocol):
    async def perform(self, action: Action) -> None:
        """Carry out one action. Raise :class:`DispatchFailed` if a dispatch could not be posted."""
        ...


class DispatchFailed(Exception):
    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass
class PlanExecutor:
    store: PlanStore
    dispatcher: Dispatcher
    lead_name: str
    assignees: set[str]
    max_attempts: int = 3
    _locks: defaultdict[str, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))

    async def start(self, conversation: str, spec: PlanSpec) -> Plan:
        """Validate and persist a plan, then dispatch its first ready step."""
        validate_plan(spec, self.assignees | {self.lead_name})
        plan = await self.store.create(conversation, spec)
        log.info("plan.created", plan_id=plan.id, conversation=conversation, steps=len(plan.steps))
        await self._reconcile(plan.id)
        return plan

    async def complete(self, plan_id: str, index: int, result: StepResult, *, attempt: int | None = None) -> bool:
        """Record a step's real outcome and move the plan on.

        ``attempt`` is the step's attempt number the result belongs to (``Action.step.attempts``
        at dispatch); an answer from an earlier attempt is stale and changes nothing.
        Returns False when the result was not recorded.
        """
        plan = await self.store.load(plan_id)
        if plan is None:
            return False
        async with self._locks[plan.conversation]:
            recorded, actions = await self._record(plan_id, index, result, attempt)
            if recorded:
                actions += await self._next_actions(plan_id)
        await self.perform(actions)
        return recorded

    async def recover(self) -> list[tuple[str, int]]:
        """After a restart: steps left running are failed as interrupted, never dispatched again."""
        interrupted, actions = await self.mark_interrupted()
        await self.perform(actions)
        return interrupted

    async def mark_interrupted(self) -> tuple[list[tuple[str, int]], list[Action]]:
        """The store half of :meth:`recover`: fail interrupted steps, return what to tell the lead.

        Run it before any new work can start (a step started by this process must
        not be mistaken for one a dead process left behind); perform the actions
        once the platforms are up.
        """
        interrupted = await self.store.with_steps_in(StepStatus.IN_PROGRESS)
        actions: list[Action] = []
        for plan_id, index in interrupted:
            log.warning("plan.step_interrupted", plan_id=plan_id, step=index)
            count_failure("step_interrupted")
            plan = await self.store.load(plan_id)
            if plan is None:
                continue
            async with self._locks[plan.conversation]:
                await self.store.set_status(
                    plan_id, index, StepStatus.IN_PROGRESS, StepStatus.FAILED, failure_reason=INTERRUPTED
                )
                actions += await self._after_failure(plan_id, index, OnFailure.ASK_LEAD, INTERRUPTED)
        return interrupted, actions

    async def _reconcile(self, plan_id: str) -> None:
        plan = await self.store.load(plan_id)
        if plan is None:
            return
        async with self._locks[plan.conversation]:
            actions = await self._next_actions(plan_id)
        await self.perform(actions)

    async def _record(
        self, plan_id: str, index: int, result: StepResult, attempt: int | None
    ) -> tuple[bool, list[Action]]:
        plan = await self.store.load(plan_id)
        if plan is None or index not in plan.steps:
            return False, []
        step = plan.steps[index]
        if attempt is not None and attempt != step.attempts:
            log.info("plan.stale_completion", plan_id=plan_id, step=index, attempt=attempt, current=step.attempts)
            return False, []
        if step.status is not StepStatus.IN_PROGRESS:
            # a duplicate or stale completion: the executor only reacts to what is really running
            log.info("plan.stale_completion", plan_id=plan_id, step=index, status=step.status.value)
            return False, []
        if result.ok:
            changed = await self.store.set_status(
                plan_id,
                index,
                StepStatus.IN_PROGRESS,
                StepStatus.DONE,
                output_summary=result.summary,
                output_files=list(result.files),
            )
            if changed:
                log.info("plan.step_done", plan_id=plan_id, step=index)
            return changed, []
        if result.transient and step.attempts < self.max_attempts:
            changed = await self.store.set_status(
                plan_id, index, StepStatus.IN_PROGRESS, StepStatus.PENDING, failure_reason=result.error
            )
            log.warning("plan.step_retry", plan_id=plan_id, step=index, attempt=step.attempts, error=result.error)
            return changed, []
        changed = await self.store.set_status(
            plan_id,
            index,
            StepStatus.IN_PROGRESS,
            StepStatus.SKIPPED if step.spec.on_failure is OnFailure.CONTINUE else StepStatus.FAILED,
            failure_reason=result.error or "failed",
        )
        if not changed:
            return False, []
        log.warning("plan.step_failed", plan_id=plan_id, step=index, on_failure=step.spec.on_failure.value)
        return True, await self._after_failure(plan_id, index, step.spec.on_failure, result.error or "failed")

    async def _after_failure(self, plan_id: str, index: int, policy: OnFailure, reason: str) -> list[Action]:
        plan = await self.store.load(plan_id)
        assert plan is not None
        if policy is OnFailure.CONTINUE:
            return []
        if policy is OnFailure.ABORT_PLAN:
            for step in plan.steps.values():
                if step.status is StepStatus.PENDING:
                    await self.store.set_status(
                        plan_id,
                        step.index,
                        StepStatus.PENDING,
                        StepStatus.SKIPPED,
                        failure_reason=f"plan aborted: step {index} failed",
                    )
            await self.store.set_plan_status(plan_id, "aborted")
            return []
        # ask_lead: everything that depends on the failed step cannot run now
        for dependent in _dependents(plan, index):
            await self.store.set_status(
                plan_id,
                dependent,
                StepStatus.PENDING,
                StepStatus.BLOCKED,
                failure_reason=f"blocked: step {index} failed",
            )
        plan = await self.store.load(plan_id)
        assert plan is not None
        return [Action(ActionKind.ASK_LEAD, plan, plan.steps[index], f"Step {index} failed: {reason}")]

    async def _next_actions(self, plan_id: str) -> list[Action]:
        plan = await self.store.load(plan_id)
        if plan is None or await self.store.plan_status(plan_id) != "active":
            return []
        if plan.finished:
            await self.store.set_plan_status(plan_id, "finished")
            log.info("plan.finished", plan_id=plan_id)
            return [Action(ActionKind.FINISHED, plan)]
        if plan.in_progress():
            return []  # one at a time
        ready = plan.ready()
        if not ready:
            return []
        step = ready[0]
        if not await self.store.set_status(
            plan_id, step.index, StepStatus.PENDING, StepStatus.IN_PROGRESS, count_attempt=True
        ):
            return []
        plan = await self.store.load(plan_id)
        assert plan is not None
        step = plan.steps[step.index]
        text = plan.render_input(step)
        if step.spec.assignee == USER:
            kind = ActionKind.ASK_USER
        elif step.spec.assignee == self.lead_name:
            kind = ActionKind.RUN_LEAD
        else:
            kind = ActionKind.DISPATCH
        log.info("plan.step_started", plan_id=plan_id, step=step.index, assignee=step.spec.assignee, kind=kind.value)
        return [Action(kind, plan, step, text)]

    async def perform(self, actions: list[Action]) -> None:
        for action in actions:
            try:
                await self.dispatcher.perform(action)
            except DispatchFailed as exc:
                count_failure("dispatch")
                log.warning("plan.dispatch_failed", plan_id=action.plan.id, error=str(exc), transient=exc.transient)
                if action.step is not None:
                    await self.complete(
                        action.plan.id,
                        action.step.index,
                        StepResult(ok=False, error=f"dispatch failed: {exc}", transient=exc.transient),
                        attempt=action.step.attempts,
                    )


def _dependents(plan: Plan, index: int) -> list[int]:
    """Every pending step that waits, directly or not, for ``index``."""
    found: set[int] = set()
    frontier = {index}
    while frontier:
        nxt = {
            s.index
            for s in plan.steps.values()
            if s.index not in found and any(d in frontier for d in dependencies(s.spec))
        }
        found |= nxt
        frontier = nxt
    return sorted(i for i in found if plan.steps[i].status is StepStatus.PENDING)
