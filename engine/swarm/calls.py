"""One worker call as the swarm makes it: limits, breaker, retries, timeout, its record, its numbers.

Every call a pattern makes comes here. It takes a slot of its task (``swarm.task_concurrency``),
of its worker (``swarm.workers.<w>.max_concurrent``, when set) and of the process
(``swarm.max_parallel_workers``) for each attempt, and gives them back while it
waits to retry. Each attempt is recorded before it runs and when it ends (model,
tools and the approvals they ran under, times, tokens, cost, error); a record
that cannot be written is counted (``step_journal``) and the call goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

import structlog

from kazma.config import failpoints
from kazma.config.models import KazmaConfig
from kazma.engine.fence import Fenced
from kazma.engine.swarm.limits import LimitExceeded, check_context
from kazma.engine.swarm.metrics import WORKER_CALLS, WORKER_LATENCY, WORKER_TOKENS, swarm_failure
from kazma.engine.swarm.reliability import BreakerState, CircuitBreaker, RetryPolicy, with_timeout
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import StoreUnavailable, SwarmTaskStore, TaskRun
from kazma.engine.swarm.types import ErrorKind, Worker, WorkerResult, current_step
from kazma.engine.tools.executions import Effects, task_scope, tracking
from kazma.engine.types import ModelError

log = structlog.get_logger("kazma.swarm")

Sleep = Callable[[float], Awaitable[None]]


class CallLimits:
    """How many worker calls run at once: per task, per worker (when it has a limit), and in the process.

    A call takes its task's slot, then its worker's, then a process slot, and gives them back in reverse order.
    Nobody waits for a slot while holding a process slot, so no order of waits can deadlock, and a task
    waiting on its own limit never holds a process slot others could use.
    """

    def __init__(self, process: int, per_worker: Mapping[str, int | None]) -> None:
        self._process = asyncio.Semaphore(process)
        self._workers = {name: asyncio.Semaphore(n) for name, n in per_worker.items() if n is not None}

    @contextlib.asynccontextmanager
    async def slot(self, task: asyncio.Semaphore | None, worker: str) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if task is not None:
                await stack.enter_async_context(task)
            own = self._workers.get(worker)
            if own is not None:
                await stack.enter_async_context(own)
            await stack.enter_async_context(self._process)
            yield


@dataclass
class TaskCalls:
    """What a task's calls share: its concurrency slots and where its call records go (its current run)."""

    task_id: str
    gate: asyncio.Semaphore
    run: Callable[[], TaskRun]  # a checkpoint resume moves the task to a new run: always ask


@dataclass
class WorkerCalls:
    store: SwarmTaskStore
    config: KazmaConfig
    state: SwarmStateStore | None = None
    sleep: Sleep = asyncio.sleep  # between retries; tests pass one that returns at once
    rng: Callable[[], float] = random.random  # the retries' jitter
    clock: Callable[[], float] = time.monotonic  # the breakers'
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    changed: Callable[[], None] = lambda: None  # told when a worker's numbers may have changed
    limits: CallLimits | None = None

    def __post_init__(self) -> None:
        swarm = self.config.swarm
        if self.limits is None:
            self.limits = CallLimits(
                swarm.max_parallel_workers, {name: s.max_concurrent for name, s in swarm.workers.items()}
            )

    def for_task(self, task_id: str, run: Callable[[], TaskRun]) -> TaskCalls:
        return TaskCalls(task_id, asyncio.Semaphore(self.config.swarm.task_concurrency), run)

    # -- breakers ------------------------------------------------------------------------------------

    def breaker(self, name: str) -> CircuitBreaker:
        found = self.breakers.get(name)
        if found is None:
            settings = self.config.swarm.reliability(name)
            found = self.breakers[name] = CircuitBreaker(
                name,
                failure_threshold=settings.breaker_threshold,
                cooldown=settings.breaker_cooldown_seconds,
                clock=self.clock,
            )
        return found

    async def restore_breakers(self) -> list[str]:
        """Breakers as they were saved before this start; returns the workers still resting."""
        if self.state is None:
            return []
        try:
            saved = await self.state.breakers()
        except Exception as exc:  # every breaker starts closed; a worker that was resting is asked again
            swarm_failure("breaker_read")
            log.warning("swarm.breakers_unread", error=f"{type(exc).__name__}: {exc}")
            return []
        resting = []
        for row in saved:
            breaker = self.breakers.get(row.worker)
            if breaker is None:
                continue
            breaker.restore(BreakerState(row.state), row.failures, row.retry_at - time.time())
            if breaker.state is not BreakerState.CLOSED:
                resting.append(row.worker)
        return resting

    async def save_breaker(self, breaker: CircuitBreaker) -> None:
        if self.state is None:
            return
        try:
            await self.state.save_breaker(breaker.worker, breaker.state.value, breaker.failures, breaker.retry_in())
        except Exception as exc:  # the breaker still works in memory; only its memory across a restart is lost
            swarm_failure("breaker_persist")
            log.warning("swarm.breaker_unsaved", worker=breaker.worker, error=f"{type(exc).__name__}: {exc}")

    # -- one call ------------------------------------------------------------------------------------

    async def call(self, worker: Worker, prompt: str, context: Fenced, task: TaskCalls | None = None) -> WorkerResult:
        try:
            check_context(context, what=f"context handed to {worker.name} (the earlier answers it would read)")
        except LimitExceeded as exc:
            return WorkerResult(worker.name, False, error=str(exc), error_kind=ErrorKind.PERMANENT)
        breaker = self.breaker(worker.name)
        generation = breaker.generation
        ticket = breaker.admit()
        if ticket is None:
            return WorkerResult(
                worker.name,
                False,
                error=f"{worker.name} is resting after repeated failures"
                f" (circuit open; retry in {breaker.retry_in():.0f} s)",
                error_kind=ErrorKind.TRANSIENT,
            )
        settings = self.config.swarm.reliability(worker.name)
        assert self.limits is not None
        limits = self.limits
        attempts = 0

        async def attempt() -> WorkerResult:
            nonlocal attempts
            attempts += 1
            async with limits.slot(None if task is None else task.gate, worker.name):
                return await self._recorded(worker, prompt, context, task, attempts, settings.timeout_seconds)

        started = time.monotonic()
        result = await RetryPolicy.of(settings, sleep=self.sleep, rng=self.rng).run(attempt, worker=worker.name)
        breaker.record(ticket, result.ok)
        if breaker.generation != generation:
            await self.save_breaker(breaker)
        await self._count(worker.name, result, time.monotonic() - started)
        return result

    async def _recorded(
        self, worker: Worker, prompt: str, context: Fenced, task: TaskCalls | None, attempt: int, seconds: float
    ) -> WorkerResult:
        seq = None if task is None else await self._start_record(task, worker.name, attempt)
        scope = "" if task is None else task_scope(task.task_id, seq)
        effects = Effects(scope=scope, task_id=None if task is None else task.task_id)
        try:
            if failpoints.armed and task is not None:
                await failpoints.reached("swarm.step.started", _model_failure)
            with tracking(effects):
                result = await with_timeout(lambda: worker.run(prompt, context=context), seconds, worker=worker.name)
            if failpoints.armed and task is not None:
                await failpoints.reached("swarm.step.finished", _journal_failure)
        except asyncio.CancelledError:
            if task is not None and seq is not None:
                stopped = WorkerResult(worker.name, False, error="stopped: the task's deadline, a cancel or shutdown")
                await asyncio.shield(self._finish_record(task, seq, stopped))
            raise
        except Exception as exc:
            crashed = WorkerResult(worker.name, False, error=f"{type(exc).__name__}: {exc}")
            if effects.started_changing:
                # A tool that changes things ran before the failure: a failed result that is never retried.
                crashed = replace(crashed, changed_state=True, error=f"{crashed.error}; {effects.summary().line()}")
            if task is not None and seq is not None:
                await self._finish_record(task, seq, crashed)
            if not crashed.changed_state:
                raise
            return crashed
        if isinstance(result, WorkerResult) and not result.ok and not result.changed_state and effects.started_changing:
            # Cut off (its own timeout) while a tool that changes things had started: it may have run, and a retry
            # or a fallback would run it again. Said, and never repeated.
            result = replace(result, changed_state=True, error=f"{result.error}; {effects.summary().line()}")
        if task is not None and seq is not None:
            await self._finish_record(task, seq, result)
        return result

    async def _start_record(self, task: TaskCalls, worker: str, attempt: int) -> int | None:
        try:
            return await self.store.start_call(task.run(), worker, step=current_step(), attempt=attempt)
        except Exception as exc:  # the call still runs; its record is what is lost
            swarm_failure("step_journal")
            log.warning("swarm.call_unrecorded", task_id=task.task_id, worker=worker, error=f"{exc}")
            return None

    async def _finish_record(self, task: TaskCalls, seq: int, result: WorkerResult) -> None:
        try:
            await self.store.finish_call(task.task_id, seq, result)
        except Exception as exc:
            swarm_failure("step_journal")
            log.warning("swarm.call_end_unrecorded", task_id=task.task_id, seq=seq, error=f"{exc}")

    async def _count(self, worker: str, result: WorkerResult, latency: float) -> None:
        WORKER_CALLS.labels(worker=worker, outcome="completed" if result.ok else "failed").inc()
        WORKER_LATENCY.labels(worker=worker).observe(latency)
        WORKER_TOKENS.labels(worker=worker, kind="prompt").inc(result.usage.prompt_tokens)
        WORKER_TOKENS.labels(worker=worker, kind="completion").inc(result.usage.completion_tokens)
        if self.state is None:
            return
        swarm = self.config.swarm
        cost = result.usage.cost  # what the model's server said it cost; else the configured prices
        if cost is None:
            cost = (
                result.usage.prompt_tokens * swarm.prompt_price_per_thousand
                + result.usage.completion_tokens * swarm.completion_price_per_thousand
            ) / 1000.0
        try:
            await self.state.record_call(
                worker,
                ok=result.ok,
                latency=latency,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                cost=cost,
            )
        except Exception as exc:
            swarm_failure("worker_metric")
            log.warning("swarm.metrics_unsaved", worker=worker, error=f"{type(exc).__name__}: {exc}")
        self.changed()


def _model_failure() -> BaseException:
    """A worker call's start failing as a model's server does (the ``swarm.step.started`` failpoint)."""
    return ModelError("the model's server closed the connection (failpoint)", permanent=False)


def _journal_failure() -> BaseException:
    """A step's ending not taken by the store (the ``swarm.step.finished`` failpoint)."""
    return StoreUnavailable("journal", "the store refused the write (failpoint)")
