"""The swarm service: admission, running patterns reliably, checkpoints, progress and recovery."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from kazma.approvals.model import Decision, PressResult, Status
from kazma.approvals.service import ApprovalRefused, ApprovalService
from kazma.config.models import KazmaConfig
from kazma.engine.swarm import patterns
from kazma.engine.swarm.metrics import ROUTING, WORKER_CALLS, WORKER_LATENCY, WORKER_TOKENS, swarm_failure
from kazma.engine.swarm.reliability import BreakerState, CircuitBreaker, OutputValidator, RetryPolicy, with_timeout
from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import AtCapacity, StoreUnavailable, SwarmTaskStore, TaskRecord, TaskRun
from kazma.engine.swarm.types import ErrorKind, Pattern, TaskStatus, Worker, WorkerResult
from kazma.engine.types import Usage

log = structlog.get_logger("kazma.swarm")

MAX_PROMPT_BYTES = 64 * 1024
MAX_CONTEXT_BYTES = 256 * 1024
MAX_WORKERS = 32
CHECK_DEFAULT_WAIT = 60.0
CHECK_MAX_WAIT = 90.0
CHECKPOINT_TOOL = "pipeline_checkpoint"
STORE_UNAVAILABLE = "task store unavailable — nothing started, send again"

Report = Callable[[str], Awaitable[None]]


class SwarmRefused(ValueError):
    """The request is out of bounds or names what does not exist; nothing ran."""


@dataclass(frozen=True)
class SwarmRequest:
    pattern: Pattern
    workers: tuple[str, ...]  # ("auto",) lets dispatch route by expertise
    prompt: str
    owner: str
    route: str | None = None
    aggregation: str = "collect"
    preset: str | None = None
    conversation: str = "swarm"
    routes: tuple[tuple[str, str], ...] = ()  # conditional: (branch, worker); workers[0] is the router
    expect: str | None = None  # "json" or a schema name from swarm.schemas: every worker answer must match
    deadline_seconds: int | None = None  # None: swarm.task_deadline_seconds

    def as_json(self) -> dict[str, Any]:
        return {
            "workers": list(self.workers),
            "prompt": self.prompt,
            "aggregation": self.aggregation,
            "preset": self.preset,
            "conversation": self.conversation,
            "routes": [list(pair) for pair in self.routes],
            "expect": self.expect,
            "deadline_seconds": self.deadline_seconds,
        }


class CoalescingReporter:
    """Progress lines are gathered and sent at most once per ``interval``, so a busy swarm stays inside rate limits."""

    def __init__(self, send: Report, *, interval: float = 3.0) -> None:
        self.send = send
        self.interval = interval
        self._lines: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, line: str) -> None:
        self._lines.append(line)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.interval)
        await self.flush()

    async def flush(self) -> None:
        lines, self._lines = self._lines, []
        if lines:
            try:
                await self.send("\n".join(lines))
            except Exception as exc:
                swarm_failure("report")
                log.warning("swarm.report_failed", error=str(exc))

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()


@dataclass
class SwarmService:
    store: SwarmTaskStore
    workers: Mapping[str, Worker]
    config: KazmaConfig
    approvals: ApprovalService | None = None
    reporter: CoalescingReporter | None = None
    synthesizer: patterns.Synthesizer | None = None
    chooser: patterns.Chooser | None = None
    # posts a task's result into a conversation ("platform:chat"): the route if one was given, else its origin
    deliver: Callable[[str, str], Awaitable[None]] | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    clock: Callable[[], float] = time.monotonic
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    state: SwarmStateStore | None = None  # breakers and per-worker numbers survive restarts here
    refiner: patterns.Synthesizer | None = None  # distils a successful pipeline into one report
    router: EmbeddingRouter | None = None  # semantic routing for workers=auto; keywords when None
    _running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _finished: dict[str, asyncio.Event] = field(default_factory=dict)
    _gate: asyncio.Semaphore | None = None
    _waiters: set[asyncio.Task[None]] = field(default_factory=set)
    _current: dict[str, TaskRun] = field(default_factory=dict)  # a checkpoint resume moves a task to a new run
    # told (no arguments) whenever a task's state or a worker's numbers may have changed: the live dashboard
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in self.workers:
            self.breakers.setdefault(name, self._new_breaker(name))
        self._gate = asyncio.Semaphore(self.config.swarm.max_parallel)

    def _new_breaker(self, name: str) -> CircuitBreaker:
        swarm = self.config.swarm
        own = swarm.workers.get(name)
        threshold = own.breaker_threshold if own is not None and own.breaker_threshold else swarm.breaker_threshold
        cooldown = (
            own.breaker_cooldown_seconds
            if own is not None and own.breaker_cooldown_seconds
            else swarm.breaker_cooldown_seconds
        )
        return CircuitBreaker(name, failure_threshold=threshold, cooldown=cooldown, clock=self.clock)

    def _policy_for(self, name: str) -> RetryPolicy:
        own = self.config.swarm.workers.get(name)
        retries = own.retries if own is not None and own.retries is not None else None
        if retries is None:
            return self.policy
        policy = RetryPolicy(max_attempts=retries + 1, sleep=self.policy.sleep)
        policy.backoff = self.policy.backoff
        return policy

    def _timeout_for(self, name: str) -> float:
        own = self.config.swarm.workers.get(name)
        if own is not None and own.timeout_seconds is not None:
            return float(own.timeout_seconds)
        return float(self.config.swarm.step_timeout_seconds)

    async def restore_breakers(self) -> list[str]:
        """Breakers as they were saved before this start; returns the workers still resting."""
        if self.state is None:
            return []
        resting = []
        for saved in await self.state.breakers():
            breaker = self.breakers.get(saved.worker)
            if breaker is None:
                continue
            breaker.restore(BreakerState(saved.state), saved.failures, saved.retry_at - time.time())
            if breaker.state is not BreakerState.CLOSED:
                resting.append(saved.worker)
        return resting

    async def _save_breaker(self, breaker: CircuitBreaker) -> None:
        if self.state is None:
            return
        try:
            await self.state.save_breaker(breaker.worker, breaker.state.value, breaker.failures, breaker.retry_in())
        except Exception as exc:  # the breaker still works in memory; only its memory across a restart is lost
            swarm_failure("breaker_row")
            log.warning("swarm.breaker_unsaved", worker=breaker.worker, error=str(exc))

    async def sweep_retention(self) -> int:
        """Prune finished tasks older than ``swarm.retention_days`` (0 keeps everything); failures are counted."""
        days = self.config.swarm.retention_days
        if not days:
            return 0
        try:
            return await self.store.prune(days)
        except Exception as exc:
            swarm_failure("retention")
            log.warning("swarm.retention_failed", error=str(exc))
            return 0

    async def reset_breaker(self, worker: str, *, actor: str) -> str:
        breaker = self.breakers.get(worker)
        if breaker is None:
            return f"no worker {worker!r}"
        was = breaker.state
        breaker.reset()
        await self._save_breaker(breaker)
        log.info("swarm.breaker_reset", worker=worker, actor=actor, was=was.value)
        return f"{worker}'s breaker is closed (it was {was.value}); reset by {actor}"

    async def _count_call(self, worker: str, result: WorkerResult, latency: float) -> None:
        WORKER_CALLS.labels(worker=worker, outcome="completed" if result.ok else "failed").inc()
        WORKER_LATENCY.labels(worker=worker).observe(latency)
        WORKER_TOKENS.labels(worker=worker, kind="prompt").inc(result.usage.prompt_tokens)
        WORKER_TOKENS.labels(worker=worker, kind="completion").inc(result.usage.completion_tokens)
        if self.state is None:
            return
        swarm = self.config.swarm
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
            swarm_failure("metrics_row")
            log.warning("swarm.metrics_unsaved", worker=worker, error=str(exc))
        self._changed()

    async def metrics_text(self, days: int = 7) -> str:
        if self.state is None:
            return "per-worker numbers are not kept in this process"
        rows = await self.state.worker_days(days)
        if not rows:
            return f"no worker calls in the last {days} day(s)"
        return "\n".join(
            f"{r.day} {r.worker}: {r.completed} completed, {r.failed} failed, mean {r.mean_latency:.1f} s, "
            f"{r.prompt_tokens} + {r.completion_tokens} tokens, cost {r.cost:.4f}"
            for r in rows
        )

    # -- admission -------------------------------------------------------------------------------

    def check(self, request: SwarmRequest, *, route: bool = True) -> list[Worker]:
        """Every limit before anything runs; returns the workers in order.

        With ``route=False`` a ``workers=auto`` request comes back with no workers: the caller routes it.
        """
        size = len(request.prompt.encode("utf-8"))
        if not request.prompt.strip():
            raise SwarmRefused("the task is empty")
        if size > MAX_PROMPT_BYTES:
            raise SwarmRefused(f"the task is {size:,} bytes; at most {MAX_PROMPT_BYTES:,} are accepted")
        names = list(request.workers)
        if request.preset is not None:
            stages = self.config.pipelines.get(request.preset)
            if stages is None:
                raise SwarmRefused(f"unknown pipeline preset {request.preset!r} ({', '.join(self.config.pipelines)})")
            names = list(stages)
        if request.pattern is Pattern.BROADCAST and not names:
            names = list(self.workers)
        if len(names) > MAX_WORKERS:
            raise SwarmRefused(f"{len(names)} workers requested; at most {MAX_WORKERS}")
        if request.pattern is Pattern.CONDITIONAL:
            names = [*names[:1], *(worker for _, worker in request.routes)]
            if not request.routes:
                raise SwarmRefused("conditional needs a route map: branch=worker,…")
        if request.expect is not None:
            self.validator(request.expect)
        if request.deadline_seconds is not None and not 1 <= request.deadline_seconds <= 86400:
            raise SwarmRefused("a task deadline is 1 to 86400 seconds")
        if names == ["auto"]:
            if request.pattern is not Pattern.DISPATCH:
                raise SwarmRefused("workers=auto works with dispatch only")
            if not route:
                return []
            try:
                return [patterns.route_auto(request.prompt, list(self.workers.values()))]
            except patterns.NoCapableWorker as exc:
                raise SwarmRefused(str(exc)) from None
        unknown = [n for n in names if n not in self.workers]
        if unknown:
            raise SwarmRefused(f"unknown worker(s): {', '.join(unknown)} (workers: {', '.join(self.workers)})")
        if not names:
            raise SwarmRefused("no workers given")
        try:
            patterns.parse_aggregation(request.aggregation)
        except ValueError as exc:
            raise SwarmRefused(str(exc)) from None
        return [self.workers[n] for n in names]

    def validator(self, expect: str) -> OutputValidator:
        """``json``: any JSON; otherwise a schema named in ``swarm.schemas``."""
        if expect == "json":
            return OutputValidator({})
        schema = self.config.swarm.schemas.get(expect)
        if schema is None:
            known = ", ".join(["json", *self.config.swarm.schemas])
            raise SwarmRefused(f"unknown output schema {expect!r} (known: {known})")
        try:
            return OutputValidator(schema)
        except ValueError as exc:
            raise SwarmRefused(f"swarm.schemas.{expect}: {exc}") from None

    async def submit(self, request: SwarmRequest) -> str:
        """Admit the task (RUNNING on disk first) and start it; returns its id at once."""
        workers = self.check(request, route=self.router is None)
        routing: dict[str, object] | None = None
        if request.workers == ("auto",):
            if self.router is not None:
                try:
                    choice = await self.router.route(request.prompt, list(self.workers.values()))
                except patterns.NoCapableWorker as exc:
                    raise SwarmRefused(str(exc)) from None
                workers, routing = [choice.worker], choice.as_json()
            else:
                ROUTING.labels(method="keyword").inc()
                routing = {"method": "keyword", "chosen": workers[0].name, "candidates": []}
        try:
            run = await self.store.admit(
                request.pattern,
                {**request.as_json(), "resolved": [w.name for w in workers], "routing": routing},
                owner=request.owner,
                route=request.route,
                max_running=self.config.swarm.max_parallel,
            )
        except AtCapacity as exc:
            raise SwarmRefused(f"at capacity, retry in {exc.retry_in} s") from None
        except StoreUnavailable as exc:
            swarm_failure("running_row")
            log.error("swarm.not_admitted", owner=request.owner, error=str(exc))
            raise SwarmRefused(STORE_UNAVAILABLE) from None
        self._report(
            f"swarm task {run.task_id} started: {request.pattern.value} with {', '.join(w.name for w in workers)}"
        )
        self._spawn(run, request, workers)
        return run.task_id

    def _spawn(
        self, run: TaskRun, request: SwarmRequest, workers: Sequence[Worker], *, done: Sequence[WorkerResult] = ()
    ) -> None:
        self._finished.setdefault(run.task_id, asyncio.Event())
        task = asyncio.create_task(self._run(run, request, list(workers), list(done)), name=f"swarm-{run.task_id}")
        self._running[run.task_id] = task

    # -- running ---------------------------------------------------------------------------------

    def _task_call(
        self, request: SwarmRequest, finished: list[WorkerResult]
    ) -> Callable[[Worker, str, str], Awaitable[WorkerResult]]:
        """The call a task's pattern makes: reliable, checked against ``--expect``, and kept once it ends."""
        validator = None if request.expect is None else self.validator(request.expect)

        async def call(worker: Worker, prompt: str, context: str) -> WorkerResult:
            result = await self._call(worker, prompt, context)
            if validator is not None and result.ok and result.handoff_to is None:
                valid, why = validator.validate(result.output)
                if not valid:
                    result = WorkerResult(
                        worker.name,
                        False,
                        output=result.output,
                        error=f"{worker.name}'s answer was refused: {why}",
                        error_kind=ErrorKind.PERMANENT,
                        changed_state=result.changed_state,
                        usage=result.usage,
                    )
            finished.append(result)
            return result

        return call

    async def _call(self, worker: Worker, prompt: str, context: str) -> WorkerResult:
        if len(context.encode("utf-8")) > MAX_CONTEXT_BYTES:
            context = context.encode("utf-8")[-MAX_CONTEXT_BYTES:].decode("utf-8", "ignore")
        breaker = self.breakers.get(worker.name) or self.breakers.setdefault(
            worker.name, self._new_breaker(worker.name)
        )
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
        assert self._gate is not None
        started = time.monotonic()
        async with self._gate:
            result = await self._policy_for(worker.name).run(
                lambda: with_timeout(
                    lambda: worker.run(prompt, context=context),
                    self._timeout_for(worker.name),
                    worker=worker.name,
                ),
                worker=worker.name,
            )
        breaker.record(ticket, result.ok)
        if breaker.generation != generation:
            await self._save_breaker(breaker)
        await self._count_call(worker.name, result, time.monotonic() - started)
        return result

    async def _run(self, run: TaskRun, request: SwarmRequest, workers: list[Worker], done: list[WorkerResult]) -> None:
        self._current[run.task_id] = run
        finished: list[WorkerResult] = []
        deadline = float(request.deadline_seconds or self.config.swarm.task_deadline_seconds)
        try:
            limit = asyncio.timeout(deadline)
            try:
                async with limit:
                    outcome = await self._pattern(run, request, workers, done, self._task_call(request, finished))
            except TimeoutError:
                if not limit.expired():
                    raise
                # the deadline stops every worker still running; what finished before it is kept
                # a pipeline journals each finished stage into ``done`` (resumed stages included)
                kept = list(done) if request.pattern is Pattern.PIPELINE else finished
                outcome = patterns.SwarmOutcome(
                    TaskStatus.TIMEOUT,
                    f"the task's deadline of {deadline:g} s passed; {len(kept)} finished answer(s) kept",
                    kept,
                    {"deadline_seconds": deadline},
                )
            run = self._current.get(run.task_id, run)
            if outcome.status is TaskStatus.PAUSED:
                return  # the checkpoint keeps the task; a decision resumes or ends it
            result = outcome_json(outcome)
            stored = await self.store.finish(
                run,
                outcome.status,
                result=result,
                error=outcome.output if outcome.status in (TaskStatus.FAILED, TaskStatus.TIMEOUT) else None,
            )
            if stored:
                self._report(f"swarm task {run.task_id} {outcome.status.value}: {_short(outcome.output)}")
                await self._deliver(request, f"swarm task {run.task_id} {outcome.status.value}:\n{outcome.output}")
        except StoreUnavailable as exc:
            swarm_failure("finish_row")
            log.error("swarm.finish_unrecorded", task_id=run.task_id, error=str(exc))
            self._report(f"swarm task {run.task_id} failed: its result could not be stored ({exc})")
        except asyncio.CancelledError:
            self._report(f"swarm task {run.task_id} cancelled")
            raise
        except Exception as exc:
            swarm_failure("run")
            log.exception("swarm.run_crashed", task_id=run.task_id)
            with contextlib.suppress(StoreUnavailable):
                await self.store.finish(run, TaskStatus.FAILED, result=None, error=f"{type(exc).__name__}: {exc}")
            self._report(f"swarm task {run.task_id} failed: {type(exc).__name__}: {exc}")
        finally:
            self._running.pop(run.task_id, None)
            self._current.pop(run.task_id, None)
            event = self._finished.get(run.task_id)
            if event is not None:
                event.set()

    async def _pattern(
        self,
        run: TaskRun,
        request: SwarmRequest,
        workers: list[Worker],
        done: list[WorkerResult],
        call: patterns.Call,
    ) -> patterns.SwarmOutcome:
        concurrency = self.config.swarm.max_parallel
        if request.pattern is Pattern.DISPATCH:
            await self.store.step(run, workers[0].name)
            return await patterns.dispatch(
                call, workers[0], request.prompt, fallbacks=workers[1:], by_name=self.workers
            )
        if request.pattern is Pattern.BROADCAST:
            await self.store.step(run, "broadcast")
            return await patterns.broadcast(call, workers, request.prompt, concurrency=concurrency)
        if request.pattern is Pattern.FAN_OUT:
            await self.store.step(run, "fan_out")
            return await patterns.fan_out(
                call,
                workers,
                request.prompt,
                aggregation=patterns.parse_aggregation(request.aggregation),
                concurrency=concurrency,
                synthesizer=self.synthesizer,
                chooser=self.chooser,
            )
        if request.pattern is Pattern.CONDITIONAL:
            await self.store.step(run, f"routing ({workers[0].name})")
            routes = {branch: self.workers[name] for branch, name in request.routes}

            async def routed_call(worker: Worker, prompt: str, context: str) -> WorkerResult:
                # the router answers with a branch name, not the task's output: --expect does not apply to it
                return await (self._call if worker is workers[0] and prompt != request.prompt else call)(
                    worker, prompt, context
                )

            return await patterns.routed(routed_call, workers[0], routes, request.prompt)
        if request.pattern is Pattern.CONSULT:
            await self.store.step(run, "consult")
            return await patterns.consult(
                call, workers, request.prompt, synthesizer=self.synthesizer, concurrency=concurrency
            )
        if request.pattern is Pattern.PIPELINE:
            return await self._pipeline(run, request, workers, done, call)
        raise SwarmRefused(f"the {request.pattern.value} pattern is not available from commands")

    async def _pipeline(
        self,
        run: TaskRun,
        request: SwarmRequest,
        workers: list[Worker],
        done: list[WorkerResult],
        task_call: patterns.Call,
    ) -> patterns.SwarmOutcome:
        checkpoints = set(self.config.swarm.checkpoints.get(request.preset or "", []))
        task_id = run.task_id  # a checkpoint resume moves the task to a new run: always write as self._current's

        async def call(worker: Worker, prompt: str, context: str) -> WorkerResult:
            step = f"stage {len(done) + 1} ({worker.name})"
            await self.store.step(self._current[task_id], step)
            self._report(f"swarm task {run.task_id}: {step} started")
            return await task_call(worker, prompt, context)

        async def journal(index: int, result: WorkerResult) -> None:
            done.append(result)
            await self.store.journal(self._current[task_id], index, result.worker, result)

        async def checkpoint(index: int, result: WorkerResult) -> bool:
            if index + 1 not in checkpoints:
                return True
            decided = await self._checkpoint(self._current[task_id], request, index, result)
            if decided is None:
                return False
            self._current[task_id] = decided
            return True

        outcome = await patterns.pipeline(
            call, workers, request.prompt, done=list(done), journal=journal, checkpoint=checkpoint
        )
        if outcome.status is TaskStatus.SUCCEEDED and self.refiner is not None and len(outcome.results) > 1:
            await self._refine(request, outcome)
        return outcome

    async def _refine(self, request: SwarmRequest, outcome: patterns.SwarmOutcome) -> None:
        """One model call distils the stages into a report; when it fails the last stage's answer stays, counted."""
        assert self.refiner is not None
        try:
            answer = await self.refiner(request.prompt, outcome.results)
        except Exception as exc:
            swarm_failure("refiner")
            log.warning("swarm.refiner_failed", error=str(exc))
            outcome.details["refined"] = False
            return
        refined = answer if isinstance(answer, patterns.Synthesis) else patterns.Synthesis(answer)
        outcome.output = refined.text
        outcome.extra_usage = outcome.extra_usage + refined.usage
        outcome.details["refined"] = True

    async def _checkpoint(
        self, run: TaskRun, request: SwarmRequest, index: int, result: WorkerResult
    ) -> TaskRun | None:
        """Pause after stage ``index + 1``: an approval card everywhere; approve resumes, reject or deadline ends."""
        if self.approvals is None:
            raise RuntimeError("a checkpoint needs the approvals service")
        limit = self.config.swarm.max_paused_pipelines
        if await self.store.count(TaskStatus.PAUSED) >= limit:
            error = f"{limit} pipelines are already paused at checkpoints; approve or reject some first"
            await self.store.finish(run, TaskStatus.FAILED, result=None, error=error)
            self._report(f"swarm task {run.task_id} failed: {error}")
            return None
        args = {"task": run.task_id, "after_stage": index + 1, "worker": result.worker, "output": result.output[:2000]}
        try:
            approval = await self.approvals.open(
                CHECKPOINT_TOOL,
                args,
                f"swarm:{run.task_id}",
                request.conversation,
                task_id=run.task_id,
                durable=True,  # the paused pipeline picks it up again after a restart: not an orphan
            )
        except ApprovalRefused as exc:
            await self.store.finish(run, TaskStatus.FAILED, result=None, error=str(exc))
            return None
        await self.store.pause(run, f"checkpoint {approval.id} after stage {index + 1} ({result.worker})")
        self._report(f"swarm task {run.task_id} paused after stage {index + 1}: approve or reject it")
        return await self._await_checkpoint(run.task_id, approval.id)

    async def _await_checkpoint(self, task_id: str, approval_id: str) -> TaskRun | None:
        assert self.approvals is not None
        outcome = await self.approvals.wait(approval_id, cancel_with_waiter=False)
        if outcome.status is Status.APPROVED:
            resumed = await self.store.resume(task_id)
            self._report(f"swarm task {task_id} resumed ({outcome.summary()})")
            return resumed
        why = "rejected" if outcome.status is Status.DENIED else outcome.status.value
        await self.store.cancel(task_id, actor=outcome.decided_by or "the checkpoint deadline")
        self._report(f"swarm task {task_id} ended at its checkpoint: {why} ({outcome.summary()})")
        return None

    async def _deliver(self, request: SwarmRequest, text: str) -> None:
        target = request.route or request.conversation
        if self.deliver is None or ":" not in target:
            return
        try:
            await self.deliver(target, text)
        except Exception as exc:
            swarm_failure("deliver")
            log.warning("swarm.deliver_failed", target=target, error=str(exc))

    def _report(self, line: str) -> None:
        log.info("swarm.progress", line=line)
        if self.reporter is not None:
            self.reporter.add(line)
        self._changed()

    def _changed(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception as exc:  # a watcher's fault must never stop the swarm
                log.warning("swarm.listener_failed", error=str(exc))

    # -- operators -------------------------------------------------------------------------------

    async def wait(self, task_id: str, wait_seconds: float = CHECK_DEFAULT_WAIT) -> TaskRecord | None:
        """Answer as soon as the task ends, or after ``wait_seconds`` (at most 90 s) with where it is."""
        limit = max(0.0, min(wait_seconds, CHECK_MAX_WAIT))
        event = self._finished.get(task_id)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=limit)
        return await self.store.get(task_id)

    async def cancel(self, task_id: str, *, actor: str) -> str:
        record = await self.store.get(task_id)
        if record is None:
            return f"no swarm task {task_id!r}"
        if record.status.terminal:
            return f"swarm task {task_id} already ended: {record.status.value}"
        changed = await self.store.cancel(task_id, actor=actor)
        if changed:
            self._changed()
        task = self._running.get(task_id)
        if task is not None:
            task.cancel()
        return (
            f"swarm task {task_id} cancelled by {actor}" if changed else f"swarm task {task_id} could not be cancelled"
        )

    async def decide_checkpoint(self, task_id: str, decision: Decision, *, actor: str, platform: str) -> str:
        if self.approvals is None:
            return "checkpoints need the approvals service"
        record = await self.store.get(task_id)
        if record is None or record.status is not TaskStatus.PAUSED:
            return f"swarm task {task_id} is not waiting at a checkpoint"
        approval_id = _checkpoint_id(record.current_step)
        if approval_id is None:
            return f"swarm task {task_id} has no open checkpoint"
        result: PressResult = await self.approvals.decide(approval_id, decision, actor=actor, platform=platform)
        return result.message

    async def recover(self) -> list[str]:
        """Rows left RUNNING are reported interrupted (never re-run); paused pipelines wait again; breakers return."""
        lines = []
        for worker in await self.restore_breakers():
            lines.append(f"{worker} is still resting after repeated failures (its breaker was open before the restart)")
        for item in await self.store.recover():
            line = f"swarm task {item.task_id} was interrupted in {item.step}; its outcome is unknown. Nothing re-ran."
            lines.append(line)
            self._report(line)
        for record in await self.store.list(TaskStatus.PAUSED, limit=self.config.swarm.max_paused_pipelines):
            self._wait_again(record)
        return lines

    def _wait_again(self, record: TaskRecord) -> None:
        """A paused pipeline whose waiter is gone (a restart, a replica that died) waits for its checkpoint here."""
        approval_id = _checkpoint_id(record.current_step)
        if approval_id is None or record.id in self._finished:
            return  # no checkpoint to wait for, or this process waits for it already
        self._finished[record.id] = asyncio.Event()
        waiter = asyncio.create_task(self._resume_after_restart(record, approval_id))
        self._waiters.add(waiter)
        waiter.add_done_callback(self._waiters.discard)

    async def recover_gone(self, live: Collection[str]) -> list[str]:
        """Among replicas: tasks a replica not in ``live`` was running end interrupted (never re-run), reported;
        pipelines it had paused at a checkpoint wait here now (adopted once, by one replica)."""
        lines = []
        for item in await self.store.recover(live):
            line = (
                f"swarm task {item.task_id} was interrupted in {item.step}: the Kazma replica running it stopped; "
                "its outcome is unknown. Nothing re-ran."
            )
            lines.append(line)
            self._report(line)
        for task_id in await self.store.adopt_paused(live):
            record = await self.store.get(task_id)
            if record is not None and record.status is TaskStatus.PAUSED:
                self._wait_again(record)
        return lines

    async def _resume_after_restart(self, record: TaskRecord, approval_id: str) -> None:
        resumed = await self._await_checkpoint(record.id, approval_id)
        if resumed is None:
            event = self._finished.get(record.id)
            if event is not None:
                event.set()
            return
        request = request_from(record)
        workers = [self.workers[n] for n in record.request.get("resolved", []) if n in self.workers]
        done = [step.to_result() for step in await self.store.journaled(record.id)]
        self._spawn(resumed, request, workers, done=done)

    def worker_lines(self) -> list[str]:
        return [f"{name}: breaker {self.breakers[name].state}" for name in self.workers]

    async def close(self) -> None:
        """A clean stop: every running task ends ``cancelled`` (interrupted_by: shutdown) before this returns.

        Only a crash leaves rows RUNNING for :meth:`recover` to call interrupted. Paused pipelines stay paused.
        """
        running = list(self._running)
        for task in [*self._running.values(), *self._waiters]:
            task.cancel()
        for task in [*self._running.values(), *self._waiters]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task_id in running:
            try:
                if await self.store.cancel(
                    task_id, actor="shutdown", result={"interrupted_by": "shutdown"}, only=[TaskStatus.RUNNING]
                ):
                    log.info("swarm.shutdown_cancelled", task_id=task_id)
            except StoreUnavailable as exc:  # the row stays RUNNING: the next start calls it interrupted
                swarm_failure("finish_row")
                log.error("swarm.shutdown_unrecorded", task_id=task_id, error=str(exc))
        if self.reporter is not None:
            await self.reporter.close()


def outcome_json(outcome: patterns.SwarmOutcome) -> dict[str, Any]:
    """The stored result: output, details (handoff chain, branch …), every worker's answer, token totals."""
    usage = sum((r.usage for r in outcome.results), Usage()) + outcome.extra_usage
    return {
        "output": outcome.output,
        "details": outcome.details,
        "workers": [
            {"worker": r.worker, "ok": r.ok, "error": r.error, "output": r.output[:4000]} for r in outcome.results
        ],
        "tokens": {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens},
    }


def _checkpoint_id(step: str) -> str | None:
    parts = step.split()
    return parts[1] if len(parts) > 1 and parts[0] == "checkpoint" else None


def request_from(record: TaskRecord) -> SwarmRequest:
    data = record.request
    return SwarmRequest(
        pattern=record.pattern,
        workers=tuple(data.get("workers", [])),
        prompt=str(data.get("prompt", "")),
        owner=record.owner,
        route=record.route,
        aggregation=str(data.get("aggregation", "collect")),
        preset=data.get("preset"),
        conversation=str(data.get("conversation", "swarm")),
        routes=tuple((str(b), str(w)) for b, w in data.get("routes") or []),
        expect=data.get("expect"),
        deadline_seconds=data.get("deadline_seconds"),
    )


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
