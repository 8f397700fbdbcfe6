"""The plan executor: event-driven, one reconcile at a time per conversation.

Each step completion triggers a reconcile under the conversation's lock:
record the outcome, find ready steps, dispatch the lowest-index one. The
step is marked ``in_progress`` on disk (compare-and-set) *before* the
dispatch message is posted, and the dispatch happens after the lock is
released so a sub-agent that answers at once cannot deadlock the executor.

The executor owns run state; the model owns intent (invariant 9). The lead
repairs a plan only through the repair methods here (retry, replace, skip,
abort), each validated against the graph and applied under the same lock,
recorded in the plan's history and said in the conversation in one line.
A person is asked through questions that survive a restart and are answered
by the person who made the request (or a platform admin), never by whoever
speaks next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol

import structlog
from pydantic import ValidationError

from kazma.config import failpoints
from kazma.config.backoff import Backoff
from kazma.config.identity import platform_of
from kazma.config.metrics import count_failure
from kazma.config.store.backend import Tx
from kazma.config.store.errors import simulated_failure
from kazma.engine.fence import fence_untrusted
from kazma.engine.plan import (
    USER,
    OnFailure,
    Plan,
    PlanError,
    PlanOrigin,
    PlanSpec,
    Step,
    StepRecord,
    StepSpec,
    StepStatus,
    dependencies,
    validate_plan,
)
from kazma.engine.plan_store import LeftStep, PlanStore, Question
from kazma.engine.tools.executions import ExecutionRecord, ExecutionSummary, step_scope
from kazma.engine.types import ToolUse, Usage

log = structlog.get_logger("kazma.executor")

INTERRUPTED = "interrupted: the process stopped while this step ran; its outcome is unknown"
# The failure reason of a step that was running when its plan was aborted (the step's watch stops its turn).
ABORTED_WHILE_RUNNING = "plan aborted while this step ran"
ANSWER_LIMIT = 4_000  # characters of a person's answer kept as a step's summary
MAX_CHOICES = 8


@dataclass(frozen=True)
class StepResult:
    ok: bool
    summary: str = ""
    files: tuple[str, ...] = ()
    error: str = ""
    transient: bool = False  # worth another attempt (timeouts, 5xx); never for work that changed state
    model: str = ""  # the model that answered the step's turn
    tools: tuple[ToolUse, ...] = ()  # the tools it called, with the approvals they ran under
    usage: Usage = field(default_factory=Usage)  # its tokens, and the cost its server reported
    execution: ExecutionSummary | None = None  # what its tools did: ran, did not run, may have run
    retry_after: float | None = None  # a transient failure's own word on when to try again (a 429's Retry-After)

    def record(self) -> StepRecord:
        return StepRecord(model=self.model, tools=self.tools, usage=self.usage, execution=self.execution)


class ActionKind(StrEnum):
    DISPATCH = "dispatch"  # post "@<sub-agent> <input>" as the lead
    RESUME = "resume"  # a person answered a sub-agent's question: its step goes on, with the answer
    ASK_USER = "ask_user"  # post a question to a person; the step (and the plan) waits for the answer
    RUN_LEAD = "run_lead"  # a lead turn, no extra visible message
    ASK_LEAD = "ask_lead"  # a step failed: ask the lead what next
    NOTICE = "notice"  # one line in the conversation: a repair, an answer taken
    FINISHED = "finished"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    plan: Plan
    step: Step | None = None
    text: str = ""
    question: Question | None = None
    # A hand-off's mark beside its mention ("(try 2 of 3)"): a step handed out again reads as a retry, not as a
    # duplicate of the first hand-off. Empty on a step's first hand-off.
    note: str = ""


class Dispatcher(Protocol):
    async def perform(self, action: Action) -> None:
        """Carry out one action. Raise :class:`DispatchFailed` if a dispatch could not be posted."""
        ...


# The wait before a step that failed for a passing reason runs again: a rate-limited model hit again at once fails
# again, and each attempt is a post in the chat. A Retry-After longer than the backoff wins, up to the cap.
RETRY_BACKOFF: Final = Backoff(base=5.0, cap=120.0)
MAX_RETRY_WAIT: Final = 300.0
MAX_STEP_ATTEMPTS: Final = 8  # runs of one step, retries by the lead included; then it is replaced, skipped or dropped


class DispatchFailed(Exception):
    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class RepairRefused(Exception):
    """A repair the lead asked for does not fit the plan as it stands; the message says why, for the model."""


class AnswerVerdict(StrEnum):
    TAKEN = "taken"
    LOST = "lost"  # answered (or cancelled) already
    REFUSED = "refused"  # not theirs to answer, or no such question


@dataclass(frozen=True)
class AnswerResult:
    verdict: AnswerVerdict
    message: str  # for the person who answered


def answerer_of(origin: PlanOrigin, conversation: str) -> str:
    """Who may answer a plan's questions: the person who asked for the plan (admins always may)."""
    return origin.requested_by or f"{platform_of(conversation)}:admins"


@dataclass
class PlanExecutor:
    store: PlanStore
    dispatcher: Dispatcher
    lead_name: str
    assignees: set[str]
    max_attempts: int = 3
    executions: ExecutionRecord | None = None  # what each step's tools did: its endings say ran / may have run
    _locks: defaultdict[str, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    # Conversations where the lead is speaking (how many turns), and the plans it wrote meanwhile.
    _speaking: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    _written: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # Failed steps the lead is being asked about: (plan, step) -> the step's attempt then. While one is, its plan
    # does not finish (the last step failing under ask_lead finished it at once, refusing the lead's repair).
    _deciding: dict[tuple[str, int], int] = field(default_factory=dict)
    retry_backoff: Backoff | None = RETRY_BACKOFF  # None: a step runs again at once (the state machine's tests)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the retry wait's (tests hold it on an event)
    # Steps waiting out a transient failure's backoff: (plan, step) -> the task that moves the plan on after it.
    # Kept in memory only: a process that stops meanwhile leaves the step pending, moved on at its next start.
    _waits: dict[tuple[str, int], asyncio.Task[None]] = field(default_factory=dict)
    # Every retry task until it ends, those past their wait (moving their plan on) too: a stop waits for them.
    _retrying: set[asyncio.Task[None]] = field(default_factory=set)

    # -- starting and completing -----------------------------------------------------------------

    async def start(self, conversation: str, spec: PlanSpec, origin: PlanOrigin | None = None) -> Plan:
        """Validate and persist a plan, then dispatch its first ready step.

        While the lead is speaking in the conversation (:meth:`announcing`) the first dispatch waits for the end
        of its turn: the lead's reply announces the plan, and people read the announcement before the first
        ``@sub-agent`` message, in the order the plan was meant.
        """
        validate_plan(spec, self.assignees | {self.lead_name})
        async with self._locks[conversation]:
            # One active plan a conversation: the repairs, /plan and the lead's questions name no plan, so with two
            # a repair asked about one landed on the other (another person's plan aborted, its step still running).
            active = await self.store.active_plan(conversation)
            if active is not None:
                running = await self.store.load(active)
                goal = "" if running is None else f" ({running.goal})"
                asker = "" if running is None else running.origin.requested_by
                who = f", asked for by {asker}," if asker else ""
                raise PlanError(
                    [f"plan {active}{goal}{who} is still active in this conversation, and a conversation has one plan "
                     "at a time: tell the person so; it ends when it finishes, or when whoever asked for it (or an "
                     "admin) has it aborted"]
                )  # fmt: skip
            plan = await self.store.create(conversation, spec, origin)
        log.info("plan.created", plan_id=plan.id, conversation=conversation, steps=len(plan.steps))
        if self._speaking[conversation]:
            self._written[conversation].append(plan.id)
        else:
            self._speaking.pop(conversation, None)
            await self._reconcile(plan.id)
        return plan

    @contextlib.asynccontextmanager
    async def announcing(self, conversation: str) -> AsyncIterator[None]:
        """The lead's turn and the posting of its reply: plans written in it are dispatched when it ends.

        The plan is on disk (its steps pending) from the moment it is written; only the first dispatch waits.
        Whatever ends the block (a reply, an error, a cancellation), the written plans are started.
        """
        self._speaking[conversation] += 1
        try:
            yield
        finally:
            self._speaking[conversation] -= 1
            if not self._speaking[conversation]:
                del self._speaking[conversation]
                for plan_id in self._written.pop(conversation, []):
                    await self._reconcile(plan_id)

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
            if recorded and failpoints.armed:  # the step's outcome is committed, the plan not moved on yet
                await self._at("plan.complete")
            if recorded:
                actions += await self._next_actions(plan_id)
        await self.perform(actions)
        return recorded

    async def recover(self) -> list[tuple[str, int]]:
        """After a restart: steps left running are failed as interrupted, never dispatched again."""
        interrupted, actions = await self.mark_interrupted()
        await self.perform(actions)
        return interrupted

    async def mark_interrupted(
        self, live: Collection[str] | None = None, *, leading: Callable[[], bool] | None = None
    ) -> tuple[list[tuple[str, int]], list[Action]]:
        """The store half of :meth:`recover`: fail interrupted steps, return what to tell the lead and people.

        Run it before any new work can start (a step started by this process must
        not be mistaken for one a dead process left behind); perform the actions
        once the platforms are up. A step waiting for a person is not
        interrupted: its question is shown again.

        Among replicas (``live``: the replicas alive now) only steps a replica that is gone started are
        interrupted, and only plans whose owner is gone are repaired, each by the one replica that takes it over
        (a compare-and-set on its owner): their open questions shown again, an answer taken and never resumed
        resumed, an idle plan moved on. A plan whose owner lives is its owner's to move, never touched here.

        ``leading`` (the leader's sweep): asked before each write that rests on the judgement of ``live``; once
        it says no, what is left is the replica's that leads now (a replica judged gone may have come back
        under its name meanwhile). The plans already taken over are this replica's own: it repairs them.
        """
        interrupted = await self.store.left_running(live)
        actions: list[Action] = []
        failed: list[tuple[str, int]] = []
        for left in interrupted:
            plan_id, index = left.plan_id, left.index
            plan = await self.store.load(plan_id)
            if plan is None:
                continue
            async with self._locks[plan.conversation]:
                if leading is not None and not leading():
                    log.warning("plan.recovery_stopped", reason="this replica no longer leads", failed=len(failed))
                    return failed, actions
                # Compare-and-set on the run judged abandoned (its attempt, its replica): another recoverer (a
                # replica restarted under its name, the leader's sweep) or the step's own result may have got
                # there first, and the step may run again since (the lead retried it, an answer resumed it
                # elsewhere): the lead is asked about a failure once, and a run that goes on is never failed.
                # Its tools are read in the same transaction, after the write: one that run was starting (the
                # replica judged gone may still run) is either read there or never starts.
                execution = await self.store.fail_interrupted(
                    left, plan.steps[index].record, self._step_tools(step_scope(plan_id, index, left.attempt)),
                    lambda summary: f"{INTERRUPTED} (tools: {summary.line()})",
                )  # fmt: skip
                if execution is None:
                    continue
                reason = f"{INTERRUPTED} (tools: {execution.line()})"
                log.warning("plan.step_interrupted", plan_id=plan_id, step=index, tools=execution.line())
                count_failure("step_interrupted")
                failed.append((plan_id, index))
                actions += await self._after_failure(plan_id, index, OnFailure.ASK_LEAD, reason)
        taken: set[str] | None = None  # the plans to repair; None: every one (the only process on its store)
        if live is not None:
            taken = set(await self.store.take_over_plans(live, leading=leading))
            if taken:
                log.warning("plan.taken_over", plans=sorted(taken))
        for question in await self.store.open_questions():
            plan = await self.store.load(question.plan_id) if taken is None or question.plan_id in taken else None
            if plan is not None:
                log.info("plan.question_shown_again", plan_id=plan.id, question=question.id)
                actions.append(Action(ActionKind.ASK_USER, plan, plan.steps.get(question.step), question=question))
        for question in await self.store.answered_unresumed():
            plan = await self.store.load(question.plan_id) if taken is None or question.plan_id in taken else None
            if plan is None or question.answer is None:
                continue
            log.warning("plan.answer_taken_at_start", plan_id=plan.id, question=question.id)
            async with self._locks[plan.conversation]:
                actions += await self._take_answer(plan.id, question, question.answer, question.answered_by or "")
        actions += await self._move_idle_plans_on(skip={plan_id for plan_id, _ in failed}, only=taken)
        return failed, actions

    async def _move_idle_plans_on(self, skip: Collection[str], only: Collection[str] | None = None) -> list[Action]:
        """At the start of the one process on its store (among replicas: the plans taken over from a gone owner,
        ``only``): active plans with nothing running and nobody asked.

        A step's ending commits before the plan moves on (the lead asked about a failure, the next step handed
        out); a process that died between the two, or during the lead's turn about a failure, leaves the plan
        idle for good. Move each on now: the lead is asked again about a failed step whose dependents still
        wait for its decision (its earlier turn died with the process), else the next step goes out or the plan
        finishes."""
        actions: list[Action] = []
        for plan_id in await self.store.active_plans():
            if plan_id in skip or (only is not None and plan_id not in only):
                continue
            plan = await self.store.load(plan_id)
            if plan is None:
                continue
            async with self._locks[plan.conversation]:
                plan = await self.store.load(plan_id)
                if plan is None or plan.status != "active" or plan.in_progress():
                    continue
                if any(s.status is StepStatus.WAITING_FOR_USER for s in plan.steps.values()):
                    continue  # its question is shown again above
                undecided = await self._undecided(plan)
                if undecided:
                    step = undecided[0]
                    log.warning("plan.lead_asked_again", plan_id=plan_id, step=step.index)
                    text = _failure_for_lead(step.index, step.failure_reason or "failed")
                    self._deciding[(plan_id, step.index)] = step.attempts
                    actions.append(Action(ActionKind.ASK_LEAD, plan, step, text))
                    continue
                moved = await self._next_actions(plan_id)
                if moved:
                    log.warning("plan.moved_on_at_start", plan_id=plan_id, actions=[a.kind.value for a in moved])
                actions += moved
        return actions

    def _step_tools(self, scope: str) -> Callable[[Tx], ExecutionSummary]:
        """What an interrupted step's tools did, read from their rows in the transaction that fails the step."""
        if self.executions is None:
            return lambda tx: ExecutionSummary()
        return lambda tx: ExecutionRecord.summary_in(tx, scope)

    async def _at(self, name: str) -> None:
        """A named failpoint (config/failpoints.py) reached here; its error is the plan store's own."""
        await failpoints.reached(name, lambda: simulated_failure(self.store.tables, "plan"))

    async def _reconcile(self, plan_id: str) -> None:
        plan = await self.store.load(plan_id)
        if plan is None:
            return
        async with self._locks[plan.conversation]:
            actions = await self._next_actions(plan_id)
        await self.perform(actions)

    def will_retry(self, transient: bool, attempt: int) -> bool:
        """Whether a failure of attempt ``attempt`` runs the step again (after a backoff) rather than ending it."""
        return transient and attempt < self.max_attempts

    def retry_delay(self, attempt: int, retry_after: float | None) -> float:
        """The wait before attempt ``attempt + 1`` of a step whose attempt ``attempt`` failed for a passing reason."""
        if self.retry_backoff is None:
            return 0.0
        return min(MAX_RETRY_WAIT, self.retry_backoff.delay(max(attempt - 1, 0), retry_after=retry_after))

    def _wait_then_reconcile(self, plan_id: str, index: int, delay: float) -> None:
        key = (plan_id, index)

        async def wait() -> None:
            try:
                await self.sleep(delay)
            finally:
                if self._waits.get(key) is task:
                    del self._waits[key]
            try:
                await self._reconcile(plan_id)
            except Exception as exc:
                # The plan stays idle with the step pending: the next completion, repair or start moves it on.
                count_failure("plan_retry")
                log.exception("plan.retry_failed", plan_id=plan_id, step=index, error=str(exc))

        task = asyncio.get_running_loop().create_task(wait(), name=f"plan-retry-{plan_id}-{index}")
        self._waits[key] = task
        self._retrying.add(task)
        task.add_done_callback(self._retrying.discard)

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
            # a duplicate or stale completion (or the end of a turn that asked a person and now waits):
            # the executor only reacts to what is really running
            log.info("plan.stale_completion", plan_id=plan_id, step=index, status=step.status.value)
            return False, []
        # Each write compares the attempt read above too: the step may have been failed as interrupted since (its
        # replica judged gone while it still ran) and retried elsewhere, and this result is not the retry's.
        if result.ok:
            changed = await self.store.set_status(
                plan_id,
                index,
                StepStatus.IN_PROGRESS,
                StepStatus.DONE,
                attempt=step.attempts,
                output_summary=result.summary,
                output_files=list(result.files),
                record=result.record(),
            )
            if changed:
                log.info("plan.step_done", plan_id=plan_id, step=index, files=len(result.files))
            return changed, []
        if self.will_retry(result.transient, step.attempts):
            changed = await self.store.set_status(
                plan_id,
                index,
                StepStatus.IN_PROGRESS,
                StepStatus.PENDING,
                attempt=step.attempts,
                failure_reason=result.error,
                record=result.record(),
            )
            if not changed:
                return False, []
            delay = self.retry_delay(step.attempts, result.retry_after)
            log.warning("plan.step_retry", plan_id=plan_id, step=index, attempt=step.attempts, error=result.error,
                        delay=round(delay, 3))  # fmt: skip
            if delay > 0:
                self._wait_then_reconcile(plan_id, index, delay)
            error = " ".join((result.error or "failed").split())[:300]
            waiting = await self.store.load(plan_id)
            other = None if delay <= 0 or waiting is None else self._next_step(waiting)
            # Steps of the plan waiting out a backoff of their own: one whose wait ends first runs first, and this
            # one then waits for all of its run.
            also = [] if delay <= 0 or waiting is None else self._waiting_steps(waiting, but=index)
            when = f"in about {_seconds(delay)}" if delay > 0 else "now"
            if other is not None and other.index == index:
                # its wait ended while the plan was read (a store slow to answer): it is the step that runs next
                other, when = None, "now"
            elif other is not None or also or any(key[0] == plan_id for key in self._deciding):
                # "runs again in about 5 seconds" would be wrong by however long the step run meanwhile takes (one
                # the lead is deciding about may be run again before its wait ends)
                when += " at the earliest"
            line = (
                f"Plan: step {index} ({step.spec.title}) failed for a passing reason ({error}); it runs again {when} "
                f"(attempt {step.attempts + 1} of {self.max_attempts})."
            )
            if other is not None:
                # what the plan does next (under the same lock) is run that step
                line += (
                    f" Meanwhile step {other.index} ({other.spec.title}), which does not need it, goes on; step "
                    f"{index} waits for it to end."
                )
            if also:
                names = ", ".join(f"step {s.index} ({s.spec.title})" for s in also)
                line += f" {names[0].upper()}{names[1:]} {'wait' if len(also) > 1 else 'waits'} to run again too, "
                line += "and one step runs at a time."
            return True, [Action(ActionKind.NOTICE, plan, step, line)]
        reason = result.error or "failed"
        if result.execution is not None and result.execution.changed_state:
            reason = f"{reason} (tools: {result.execution.line()})"  # the lead hears what may have changed
        changed = await self.store.set_status(
            plan_id,
            index,
            StepStatus.IN_PROGRESS,
            StepStatus.SKIPPED if step.spec.on_failure is OnFailure.CONTINUE else StepStatus.FAILED,
            attempt=step.attempts,
            failure_reason=reason,
            record=result.record(),
        )
        if not changed:
            return False, []
        log.warning("plan.step_failed", plan_id=plan_id, step=index, on_failure=step.spec.on_failure.value)
        return True, await self._after_failure(plan_id, index, step.spec.on_failure, reason)

    async def _undecided(self, plan: Plan) -> list[Step]:
        """Failed ask_lead steps the lead never decided about (its turn died with a process): one whose dependents
        still wait, or one (the last step, say) with no "gave up" on record since it failed."""
        failed = [
            step
            for _, step in sorted(plan.steps.items())
            if step.status is StepStatus.FAILED and step.spec.on_failure is OnFailure.ASK_LEAD
        ]
        if not failed:
            return []
        events = await self.store.events(plan.id)
        undecided = []
        for step in failed:
            since = step.record.finished_at or step.record.started_at or 0.0
            gave_up = any(e.kind == "gave_up" and e.step == step.index and e.at >= since for e in events)
            if _dependents(plan, step.index, StepStatus.PENDING) or not gave_up:
                undecided.append(step)
        return undecided

    async def _after_failure(self, plan_id: str, index: int, policy: OnFailure, reason: str) -> list[Action]:
        plan = await self.store.load(plan_id)
        assert plan is not None
        if policy is OnFailure.CONTINUE:
            return []
        if policy is OnFailure.ABORT_PLAN:
            await self._abort(plan, f"plan aborted: step {index} failed")
            return []
        # ask_lead: the steps that depend on the failed one wait (pending) while the lead decides; they are
        # blocked only when the lead gives up (see lead_decided) or the plan is aborted
        self._deciding[(plan_id, index)] = plan.steps[index].attempts
        return [Action(ActionKind.ASK_LEAD, plan, plan.steps[index], _failure_for_lead(index, reason))]

    async def _next_actions(self, plan_id: str) -> list[Action]:
        plan = await self.store.load(plan_id)
        if plan is None or plan.status != "active":
            return []
        if plan.finished:
            if any(key[0] == plan_id for key in self._deciding):
                return []  # the lead decides about a failed step first: it may retry it (see lead_decided)
            await self.store.set_plan_status(plan_id, "finished")
            log.info("plan.finished", plan_id=plan_id)
            return [Action(ActionKind.FINISHED, plan)]
        step = self._next_step(plan)
        if step is None:
            return []
        if step.spec.assignee == USER:
            return await self._ask_for_user_step(plan, step)
        if not await self.store.set_status(
            plan_id, step.index, StepStatus.PENDING, StepStatus.IN_PROGRESS, count_attempt=True
        ):
            return []
        plan = await self.store.load(plan_id)
        assert plan is not None
        step = plan.steps[step.index]
        text = plan.render_input(step)
        kind = ActionKind.RUN_LEAD if step.spec.assignee == self.lead_name else ActionKind.DISPATCH
        log.info("plan.step_started", plan_id=plan_id, step=step.index, assignee=step.spec.assignee, kind=kind.value)
        if failpoints.armed:  # the step is running on disk, nobody was handed it yet
            await self._at("plan.dispatch")
        return [Action(kind, plan, step, text, note=self._try_note(step))]

    def _try_note(self, step: Step) -> str:
        """``(try 2 of 3)`` for a step handed out again; empty for its first hand-off.

        The total is the executor's own tries; a step the lead runs again past them counts on without one. Why it
        is tried again is the chat's notice before it, never this note: the note is part of the sub-agent's
        prompt, and a failure's text (a model server's or a tool's words) is no instruction to it.
        """
        if step.attempts <= 1:
            return ""
        total = f" of {self.max_attempts}" if step.attempts <= self.max_attempts else ""
        return f"(try {step.attempts}{total})"

    def _next_step(self, plan: Plan) -> Step | None:
        """The step to run next: the lowest ready one, while none runs and nobody is asked (one at a time).

        A step waiting out its backoff runs again when its wait ends (its task moves the plan on then); meanwhile
        the next ready step that does not need it goes on. The whole plan waited for it, up to two minutes a try.
        """
        if plan.in_progress() or any(s.status is StepStatus.WAITING_FOR_USER for s in plan.steps.values()):
            return None  # one at a time; a question to a person pauses the plan
        return next((s for s in plan.ready() if (plan.id, s.index) not in self._waits), None)

    def _waiting_steps(self, plan: Plan, *, but: int) -> list[Step]:
        """The plan's steps (``but`` that one) waiting out a backoff in this process, lowest index first."""
        return [s for i, s in sorted(plan.steps.items()) if i != but and (plan.id, i) in self._waits]

    async def _ask_for_user_step(self, plan: Plan, step: Step) -> list[Action]:
        if not await self.store.set_status(
            plan.id, step.index, StepStatus.PENDING, StepStatus.WAITING_FOR_USER, count_attempt=True
        ):
            return []
        text = plan.render_input(step, context=False) or step.spec.title
        question = await self.store.ask(
            plan_id=plan.id,
            step=step.index,
            attempt=step.attempts + 1,
            kind="user_step",
            conversation=plan.conversation,
            asked_by=self.lead_name,
            question=text,
            choices=(),
            answerer=answerer_of(plan.origin, plan.conversation),
        )
        await self.store.record(plan.id, "asked", step=step.index, actor=self.lead_name, detail=text[:500])
        loaded = await self.store.load(plan.id)
        assert loaded is not None
        log.info("plan.step_started", plan_id=plan.id, step=step.index, assignee=USER, kind="ask_user")
        return [Action(ActionKind.ASK_USER, loaded, loaded.steps[step.index], text, question)]

    async def perform(self, actions: list[Action]) -> None:
        for action in actions:
            try:
                await self.dispatcher.perform(action)
            except DispatchFailed as exc:
                count_failure("dispatch")
                log.warning("plan.dispatch_failed", plan_id=action.plan.id, error=str(exc), transient=exc.transient)
                if action.step is not None and action.kind in (ActionKind.DISPATCH, ActionKind.RESUME):
                    await self.complete(
                        action.plan.id,
                        action.step.index,
                        StepResult(ok=False, error=f"dispatch failed: {exc}", transient=exc.transient),
                        attempt=action.step.attempts,
                    )

    # -- questions to people ---------------------------------------------------------------------

    async def ask_user(
        self,
        plan_id: str,
        index: int,
        attempt: int,
        question: str,
        choices: Sequence[str] = (),
        *,
        asked_by: str,
    ) -> Question:
        """A sub-agent in the middle of its step asks a person: the step waits, the plan pauses.

        Raises :class:`RepairRefused` (with a message for the model) when the step is not its running attempt.
        """
        text = question.strip()
        options = tuple(dict.fromkeys(c.strip() for c in choices if c.strip()))
        if not text:
            raise RepairRefused("the question is empty")
        if len(options) > MAX_CHOICES or any(len(c) > 60 for c in options):
            raise RepairRefused(f"give at most {MAX_CHOICES} choices of at most 60 characters each")
        plan = await self.store.load(plan_id)
        if plan is None or index not in plan.steps:
            raise RepairRefused("this step is not part of a plan any more")
        async with self._locks[plan.conversation]:
            plan = await self.store.load(plan_id)
            assert plan is not None
            step = plan.steps[index]
            if step.status is not StepStatus.IN_PROGRESS or step.attempts != attempt:
                raise RepairRefused(f"step {index} is {step.status.value}, not running: no question was asked")
            await self.store.set_status(plan_id, index, StepStatus.IN_PROGRESS, StepStatus.WAITING_FOR_USER)
            asked = await self.store.ask(
                plan_id=plan_id,
                step=index,
                attempt=attempt,
                kind="ask_user",
                conversation=plan.conversation,
                asked_by=asked_by,
                question=text,
                choices=options,
                answerer=answerer_of(plan.origin, plan.conversation),
            )
            await self.store.record(plan_id, "asked", step=index, actor=asked_by, detail=text[:500])
            loaded = await self.store.load(plan_id)
            assert loaded is not None
        log.info("plan.question_asked", plan_id=plan_id, step=index, question=asked.id, by=asked_by)
        if failpoints.armed:  # the question is committed, not posted yet
            await self._at("plan.question.asked")
        await self.perform([Action(ActionKind.ASK_USER, loaded, loaded.steps[index], text, asked)])
        return asked

    async def answer(self, question_id: str, text: str, *, actor: str, is_admin: bool = False) -> AnswerResult:
        """A person answers a question (a reply to it, or a press of one of its choices): decided once."""
        question = await self.store.question(question_id)
        if question is None:
            return AnswerResult(AnswerVerdict.REFUSED, "That question is not known; nothing was recorded.")
        if question.status != "pending":
            by = f" by {question.answered_by}" if question.answered_by else ""
            return AnswerResult(AnswerVerdict.LOST, f"That question was {question.status}{by} already.")
        same_platform = platform_of(actor) == platform_of(question.conversation)
        if not (actor == question.answerer or (is_admin and same_platform)):
            log.info("plan.answer_refused", question=question_id, actor=actor, answerer=question.answerer)
            return AnswerResult(
                AnswerVerdict.REFUSED, f"Only {question.answerer} (or an admin) may answer this question."
            )
        answer = text.strip()[:ANSWER_LIMIT]  # ("us-east\n" from a chat is the choice "us-east")
        if question.choices and answer not in question.choices:
            return AnswerResult(AnswerVerdict.REFUSED, f"Choose one of: {', '.join(question.choices)}.")
        plan = await self.store.load(question.plan_id)
        if plan is None:
            return AnswerResult(AnswerVerdict.REFUSED, "That question's plan is gone; nothing was recorded.")
        async with self._locks[plan.conversation]:
            if not await self.store.settle_question(question_id, "answered", answer=answer, actor=actor):
                again = await self.store.question(question_id)
                by = f" by {again.answered_by}" if again is not None and again.answered_by else ""
                return AnswerResult(AnswerVerdict.LOST, f"That question was answered{by} already.")
            await self.store.record(plan.id, "answered", step=question.step, actor=actor, detail=answer[:500])
            if failpoints.armed:  # the answer is committed, the step not resumed yet
                await self._at("plan.question.answered")
            actions = await self._take_answer(plan.id, question, answer, actor)
        await self.perform(actions)
        log.info("plan.question_answered", plan_id=plan.id, step=question.step, question=question_id, by=actor)
        return AnswerResult(AnswerVerdict.TAKEN, "Answer recorded; the plan goes on.")

    async def _take_answer(self, plan_id: str, question: Question, answer: str, actor: str) -> list[Action]:
        plan = await self.store.load(plan_id)
        assert plan is not None
        step = plan.steps.get(question.step)
        if step is None or step.status is not StepStatus.WAITING_FOR_USER:
            return []  # skipped or aborted while it waited: the answer is on record, nothing resumes
        if question.kind == "user_step":
            await self.store.set_status(
                plan_id, step.index, StepStatus.WAITING_FOR_USER, StepStatus.DONE, output_summary=answer
            )
            return await self._next_actions(plan_id)
        await self.store.set_status(plan_id, step.index, StepStatus.WAITING_FOR_USER, StepStatus.IN_PROGRESS)
        reply = fence_untrusted(f"Q: {question.question}\nA: {answer}", source=f"the answer from {actor}")
        loaded = await self.store.load(plan_id)
        assert loaded is not None
        # The step itself again: the turn that asked may never have ended (a crash before it was kept in the
        # history), or its messages have been pushed out of the history since; the answer alone is no step.
        text = (
            f"Your question was answered. Go on with your step from where you stopped.\n{reply}\n"
            f"Your step, as it was given to you:\n{loaded.render_input(loaded.steps[step.index])}"
        )
        return [Action(ActionKind.RESUME, loaded, loaded.steps[step.index], text)]

    async def question_posted(self, question_id: str, message_id: str) -> None:
        await self.store.question_posted(question_id, message_id)

    async def open_questions(self, conversation: str) -> list[Question]:
        return await self.store.open_questions(conversation)

    # -- repairs by the lead ---------------------------------------------------------------------

    async def _active(self, conversation: str) -> Plan:
        plan_id = await self.store.active_plan(conversation)
        plan = await self.store.load(plan_id) if plan_id else None
        if plan is None:
            raise RepairRefused("there is no active plan in this conversation")
        return plan

    async def _repaired(
        self, plan_id: str, repair: str, actions: list[Action], line: str, *, by: str, step: int | None = None
    ) -> str:
        """A repair is committed: say so in the log, then move the plan on (its actions) and answer ``line``."""
        log.info("plan.repaired", plan_id=plan_id, repair=repair, step=step, by=by)
        if failpoints.armed:  # the repair is committed, the plan not moved on yet
            await self._at("plan.repair")
        await self.perform(actions)
        return line

    async def retry_step(self, conversation: str, index: int, new_input: str | None, *, by: str) -> str:
        """A failed or interrupted step back to pending, optionally with new input."""
        plan = await self._active(conversation)
        async with self._locks[conversation]:
            plan = await self._active(conversation)
            step = plan.steps.get(index)
            if step is None:
                raise RepairRefused(f"there is no step {index} (steps 1..{len(plan.steps)})")
            if (plan.id, index) in self._waits:
                # pending on disk, but not "not run yet": the lead read the notice of its passing failure
                raise RepairRefused(
                    f"step {index} failed for a passing reason and runs again by itself once its backoff is over "
                    f"(attempt {step.attempts + 1} of {self.max_attempts}); skip_step, replace_steps or abort_plan "
                    "end that wait"
                )
            if step.status is not StepStatus.FAILED:
                raise RepairRefused(f"step {index} is {step.status.value}; only a failed step can be retried")
            if step.attempts >= MAX_STEP_ATTEMPTS:
                # A lead that always retries would loop failure, ask, retry for ever (each turn a model's cost).
                raise RepairRefused(
                    f"step {index} has run {step.attempts} times; it is not retried again: replace_steps, skip_step "
                    "or abort_plan"
                )
            if new_input is not None:
                candidate = step.spec.model_copy(update={"input": new_input})
                self._validate([candidate if s.index == index else s.spec for s in plan.steps.values()], plan.goal)
                await self.store.set_input(plan.id, index, new_input)
            await self.store.set_status(plan.id, index, StepStatus.FAILED, StepStatus.PENDING, failure_reason="")
            for dependent in _unblocked(plan, index):
                await self.store.set_status(plan.id, dependent, StepStatus.BLOCKED, StepStatus.PENDING)
            detail = "with new input" if new_input is not None else "as it was"
            await self.store.record(plan.id, "retried", step=index, actor=by, detail=detail)
            line = f"Plan: step {index} ({step.spec.title}) runs again, {detail}."
            actions = [Action(ActionKind.NOTICE, plan, step, line), *await self._next_actions(plan.id)]
        return await self._repaired(plan.id, "retry_step", actions, line, by=by, step=index)

    async def replace_steps(self, conversation: str, from_index: int, steps: Sequence[dict[str, Any]], *,
                            by: str) -> str:  # fmt: skip
        """Every not-yet-started step from ``from_index`` on is replaced by ``steps`` (indices from_index, …)."""
        try:
            new = [StepSpec.model_validate(s) for s in steps]
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise RepairRefused(f"the new steps are malformed: {problems}") from None
        if not new:
            raise RepairRefused("give at least one new step")
        async with self._locks[conversation]:
            plan = await self._active(conversation)
            if from_index < 1 or from_index > len(plan.steps) + 1:
                raise RepairRefused(f"from_index must be 1..{len(plan.steps) + 1}")
            started = [
                s.index
                for s in plan.steps.values()
                if s.index >= from_index and s.status not in (StepStatus.PENDING, StepStatus.BLOCKED)
            ]
            if started:
                raise RepairRefused(f"step {started[0]} has already run or is running; replace from a later step")
            expected = list(range(from_index, from_index + len(new)))
            if [s.index for s in new] != expected:
                raise RepairRefused(f"the new steps must be numbered {expected}")
            kept = [s.spec for s in plan.steps.values() if s.index < from_index]
            self._validate([*kept, *new], plan.goal)
            old = [s.spec.model_dump(mode="json") for s in plan.steps.values() if s.index >= from_index]
            if not await self.store.replace_pending(plan.id, from_index, new):
                raise RepairRefused("a step to replace started meanwhile; look at the plan again")
            self._end_waits(plan.id, {s.index for s in plan.steps.values() if s.index >= from_index})
            await self.store.record(
                plan.id, "replaced", step=from_index, actor=by, detail=json.dumps({"old": old}, ensure_ascii=False)
            )
            line = f"Plan: steps from {from_index} on replaced by {len(new)} new step{'s' * (len(new) != 1)}."
            reloaded = await self.store.load(plan.id)
            assert reloaded is not None
            actions = [Action(ActionKind.NOTICE, reloaded, None, line), *await self._next_actions(plan.id)]
        return await self._repaired(plan.id, "replace_steps", actions, line, by=by, step=from_index)

    async def skip_step(self, conversation: str, index: int, reason: str, *, by: str) -> str:
        """A step that has not run, or failed, counts as skipped: steps waiting for it go on."""
        async with self._locks[conversation]:
            plan = await self._active(conversation)
            step = plan.steps.get(index)
            if step is None:
                raise RepairRefused(f"there is no step {index} (steps 1..{len(plan.steps)})")
            skippable = (StepStatus.PENDING, StepStatus.BLOCKED, StepStatus.FAILED, StepStatus.WAITING_FOR_USER)
            if step.status not in skippable:
                raise RepairRefused(f"step {index} is {step.status.value} and cannot be skipped")
            await self.store.set_status(
                plan.id, index, step.status, StepStatus.SKIPPED, failure_reason=f"skipped by {by}: {reason}"
            )
            if step.status is StepStatus.WAITING_FOR_USER:
                await self._cancel_questions(plan.id, index)
            self._end_waits(plan.id, {index})
            for dependent in _unblocked(plan, index):
                await self.store.set_status(plan.id, dependent, StepStatus.BLOCKED, StepStatus.PENDING)
            await self.store.record(plan.id, "skipped", step=index, actor=by, detail=reason)
            line = f"Plan: step {index} ({step.spec.title}) skipped: {reason}"
            actions = [Action(ActionKind.NOTICE, plan, step, line), *await self._next_actions(plan.id)]
        return await self._repaired(plan.id, "skip_step", actions, line, by=by, step=index)

    async def abort_plan(self, conversation: str, reason: str, *, by: str) -> str:
        """Nothing more of the plan runs: every step that has not run is skipped, questions are withdrawn."""
        async with self._locks[conversation]:
            plan = await self._active(conversation)
            await self._abort(plan, f"plan aborted by {by}: {reason}")
            await self.store.record(plan.id, "aborted", actor=by, detail=reason)
            line = f"Plan aborted: {reason}"
            actions = [Action(ActionKind.NOTICE, plan, None, line)]
        return await self._repaired(plan.id, "abort_plan", actions, line, by=by)

    async def lead_decided(self, plan_id: str, index: int, attempt: int | None = None) -> None:
        """The lead's turn about a failed step ended. If it did not repair the step, it gave up on it:
        the steps that depend on it are blocked, and the plan goes on (or finishes) without them.

        ``attempt``: the step's attempt the turn was asked about. A turn that retried the step, whose new attempt
        failed too (and asked the lead again) before this turn ended, leaves that newer failure to its own turn."""
        plan = await self.store.load(plan_id)
        if plan is None:
            return
        async with self._locks[plan.conversation]:
            plan = await self.store.load(plan_id)
            assert plan is not None
            step = plan.steps.get(index)
            key = (plan_id, index)
            if attempt is None or self._deciding.get(key) == attempt:
                self._deciding.pop(key, None)  # (a newer attempt's failure, asked about since, keeps its own)
            if plan.status != "active":
                return
            newer = attempt is not None and step is not None and step.attempts != attempt
            if newer or step is None or step.status is not StepStatus.FAILED:
                # Repaired (retried, skipped), or a newer attempt is the lead's to decide: nothing given up. The
                # plan moves on, and finishes if all that is left has ended.
                actions = await self._next_actions(plan_id)
            else:
                blocked = _dependents(plan, index, StepStatus.PENDING)
                for dependent in blocked:
                    await self.store.set_status(
                        plan_id,
                        dependent,
                        StepStatus.PENDING,
                        StepStatus.BLOCKED,
                        failure_reason=f"blocked: step {index} failed",
                    )
                await self.store.record(plan_id, "gave_up", step=index, actor=self.lead_name, detail=str(blocked))
                actions = await self._next_actions(plan_id)
        await self.perform(actions)

    async def _abort(self, plan: Plan, reason: str) -> None:
        for step in plan.steps.values():
            if step.status is StepStatus.IN_PROGRESS:
                # "Nothing more of the plan runs": its running step too. It is failed here, its tools read in the
                # same transaction (one starting now either is read or never starts: its row is fenced on the
                # step running); the step's watch stops the turn, withdrawing a card it waits on. It went on
                # after "Plan aborted", and an approval pressed afterwards ran its tool.
                left = LeftStep(plan.id, step.index, step.attempts, replica=None)
                scope = step_scope(plan.id, step.index, step.attempts)
                execution = await self.store.fail_interrupted(
                    left, step.record, self._step_tools(scope),
                    lambda summary: f"{ABORTED_WHILE_RUNNING} ({reason}) (tools: {summary.line()})",
                )  # fmt: skip
                if execution is not None:
                    log.warning("plan.running_step_aborted", plan_id=plan.id, step=step.index, tools=execution.line())
            elif step.status in (StepStatus.PENDING, StepStatus.BLOCKED, StepStatus.WAITING_FOR_USER):
                await self.store.set_status(plan.id, step.index, step.status, StepStatus.SKIPPED, failure_reason=reason)
                if step.status is StepStatus.WAITING_FOR_USER:
                    await self._cancel_questions(plan.id, step.index)
        await self.store.set_plan_status(plan.id, "aborted")
        self._end_waits(plan.id)

    async def stop_waits(self) -> None:
        """At a stop, every backoff wait ends: its step stays pending, moved on at the next start; a retry already
        past its wait (moving its plan on) is waited for, not cut half-way. Left to end during the stop, a wait
        moved its plan on against a closing store (``plan.retry_failed``)."""
        waits = list(self._waits.values())
        self._waits.clear()
        for task in waits:
            task.cancel()
        if self._retrying:
            await asyncio.wait(set(self._retrying))
        if waits:
            log.info("plan.retries_put_off", waits=sorted(task.get_name() for task in waits))

    def _end_waits(self, plan_id: str, indices: Collection[int] | None = None) -> None:
        """Backoffs of the plan's steps (``indices``: of these only) end now: nothing runs after them any more.

        A wait left to its end found nothing to run, but held the step's place: a new step at that index
        (replace_steps) did not start until it ended, and an aborted plan kept a task up to two minutes.
        """
        for key in [k for k in self._waits if k[0] == plan_id and (indices is None or k[1] in indices)]:
            self._waits.pop(key).cancel()

    async def _cancel_questions(self, plan_id: str, index: int) -> None:
        for question in await self.store.open_questions():
            if question.plan_id == plan_id and question.step == index:
                await self.store.settle_question(question.id, "cancelled", answer=None, actor=None)

    def _validate(self, steps: list[StepSpec], goal: str) -> None:
        try:
            validate_plan(PlanSpec(goal=goal, steps=steps), self.assignees | {self.lead_name})
        except (PlanError, ValidationError) as exc:
            raise RepairRefused(f"the repaired plan would be invalid: {exc}") from None

    # -- seeing the plan -------------------------------------------------------------------------

    async def describe(self, conversation: str) -> str:
        """The conversation's current (or last) plan, a line per step: status, assignee, summary or reason."""
        plan_id = await self.store.active_plan(conversation) or await self.store.last_plan(conversation)
        plan = await self.store.load(plan_id) if plan_id else None
        if plan is None:
            return "There is no plan in this conversation yet."
        lines = [f"Plan {plan.id} ({plan.status}): {plan.goal}"]
        for step in plan.steps.values():
            detail = step.output_summary or (step.failure_reason if step.status in _ENDED_WITHOUT else "")
            if not detail and step.status is StepStatus.PENDING and step.attempts and step.failure_reason:
                # it ran and failed for a passing reason: beside a step that went on meanwhile, a bare "pending"
                # read as a step that never ran, jumped
                total = f" of {self.max_attempts}" if step.attempts < self.max_attempts else ""
                detail = (
                    f"runs again (attempt {step.attempts + 1}{total}) after a passing failure: {step.failure_reason}"
                )
            line = f"{step.index}. [{step.status.value}] {step.spec.title} — @{step.spec.assignee}"
            if detail:
                line += f": {' '.join(detail.split())[:200]}"
            if step.output_files:
                line += f" (files: {', '.join(step.output_files)})"
            lines.append(line)
            done = step.record.line() if step.spec.assignee != USER else ""  # a person's answer has no model
            if done:
                lines.append(f"   {done}")
        for question in await self.store.open_questions(conversation):
            if question.plan_id == plan.id:
                unseen = " (not posted yet: the platform did not take it; Kazma posts it again)"
                lines.append(
                    f"Waiting for {question.answerer} to answer: {question.question[:200]}"
                    + (unseen if question.message_id is None else "")
                )
        return "\n".join(lines)


# Steps whose failure reason is their story (/plan shows it); a step running again after a transient failure, or
# done, is not described by its earlier attempt's.
_ENDED_WITHOUT: Final = frozenset({StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.BLOCKED})


def _unblocked(plan: Plan, index: int) -> list[int]:
    """The blocked steps that may wait again once ``index`` is repaired (retried or skipped).

    A blocked step waits again only when nothing else it depends on has failed
    for good or stays blocked: a step waiting on two failures is not freed by
    repairing one of them, or it would wait forever.
    """
    status = {i: s.status for i, s in plan.steps.items()}
    status[index] = StepStatus.PENDING  # repaired: it will run, or counts as skipped
    freed: list[int] = []
    candidates = _dependents(plan, index, StepStatus.BLOCKED)
    changed = True
    while changed:
        changed = False
        for i in candidates:
            if i in freed:
                continue
            deps = dependencies(plan.steps[i].spec)
            if all(status.get(d) not in (StepStatus.FAILED, StepStatus.BLOCKED) for d in deps):
                status[i] = StepStatus.PENDING
                freed.append(i)
                changed = True
    return sorted(freed)


def _dependents(plan: Plan, index: int, status: StepStatus) -> list[int]:
    """Every step in ``status`` that waits, directly or not, for ``index``."""
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
    return sorted(i for i in found if plan.steps[i].status is status)


def _seconds(delay: float) -> str:
    whole = max(1, round(delay))
    return f"{whole} second{'s' * (whole != 1)}"


def _failure_for_lead(index: int, reason: str) -> str:
    """What the lead is told of a failed step: the reason is the sub-agent's or its tools' words (a model's
    output may carry anything), so it reaches the lead fenced, as data."""
    return f"Step {index} failed:\n" + fence_untrusted(reason, source=f"step {index}'s failure")
