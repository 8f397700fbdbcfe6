"""The swarm service: admission, running patterns reliably, progress and recovery (checkpoints: checkpoints.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog

from kazma.approvals.model import Decision
from kazma.approvals.service import ApprovalService
from kazma.config import failpoints
from kazma.config.backoff import Backoff
from kazma.config.limits import MAX_WORKERS
from kazma.config.models import KazmaConfig
from kazma.config.supervisor import Supervisor
from kazma.config.waits import until_set
from kazma.engine.fence import NOTHING, Fenced, fence_untrusted, join_fenced
from kazma.engine.swarm import builtin_patterns, patterns
from kazma.engine.swarm.calls import TaskCalls, WorkerCalls
from kazma.engine.swarm.checkpoints import Checkpoints, checkpoint_id
from kazma.engine.swarm.endings import Unsaved, ending_lines
from kazma.engine.swarm.limits import LimitExceeded, check_context, check_metadata, check_prompt
from kazma.engine.swarm.metrics import ROUTING, swarm_failure
from kazma.engine.swarm.owners import is_terminal
from kazma.engine.swarm.registry import PatternRun, Stages, SwarmPattern, named, registered
from kazma.engine.swarm.reliability import CircuitBreaker, OutputValidator
from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import (
    AtCapacity,
    StoreUnavailable,
    SwarmTaskStore,
    TaskFence,
    TaskRecord,
    TaskRun,
)
from kazma.engine.swarm.types import (
    ErrorKind,
    SwarmRefused,
    SwarmRequest,
    TaskStatus,
    Worker,
    WorkerResult,
    working_for,
)
from kazma.engine.tools.executions import Effects, ExecutionRecord, ExecutionSummary, Outcome, tracking
from kazma.engine.types import Usage

log = structlog.get_logger("kazma.swarm")

CHECK_DEFAULT_WAIT = 60.0
CANCEL_WAIT_SECONDS = 10.0  # how long /swarm cancel waits for the task's tools to stop before it answers
# How often a process that runs tasks asks whether another ended one of them (`kazma swarm cancel` in a terminal,
# /swarm cancel heard by another replica): such a task stops here within this, its tools with it.
ENDED_POLL_SECONDS = 1.0
CHECK_MAX_WAIT = 90.0
STORE_UNAVAILABLE = "task store unavailable — nothing started, send again"
# A task's ending the store refused is stored again after 1, 2, 4 … up to 60 seconds.
_STORE_LATER = Backoff(base=1.0, cap=60.0, jitter=False)
_EPOCH = datetime.fromtimestamp(0, UTC)
BUILTIN_PATTERNS = builtin_patterns.PATTERNS  # registered on import: a task names one of them or a later one

Report = Callable[[str], Awaitable[None]]


class StageUnrecorded(Exception):
    """A pipeline cannot pause: a finished stage is missing from the journal a resume would start from."""


@dataclass(frozen=True)
class ProgressLine:
    text: str
    heard_in: str | None = None  # "platform:chat" that hears this another way (a task's ending, delivered there)


ReportLines = Callable[[Sequence[ProgressLine]], Awaitable[None]]


class CoalescingReporter:
    """Progress lines are gathered and sent at most once per ``interval``, so a busy swarm stays inside rate limits.

    ``send_lines`` (when given) takes the lines themselves, so it can leave a line out where it is heard anyway
    (a home chat that a task's result is delivered to is not told the ending twice); else ``send`` gets them joined.
    """

    def __init__(
        self, send: Report, *, interval: float = 3.0, send_lines: ReportLines | None = None, held: bool = False
    ) -> None:
        self.send = send
        self.send_lines = send_lines
        self.interval = interval
        self._lines: list[ProgressLine] = []
        self._task: asyncio.Task[None] | None = None
        # held: lines gathered before the platforms are up (a restart's "interrupted" reports) wait for
        # release(); a timer alone sent them to platforms a slow start had not started yet, and they were lost
        self._open = asyncio.Event()
        if not held:
            self._open.set()

    def release(self) -> None:
        """The platforms are up: what was held goes out (coalesced, after the interval)."""
        self._open.set()
        if self._lines and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._flush_later())

    def add(self, line: str, *, heard_in: str | None = None) -> None:
        self._lines.append(ProgressLine(line, heard_in))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.interval)
        await self._open.wait()
        await self.flush()

    async def flush(self) -> None:
        lines, self._lines = self._lines, []
        if lines:
            try:
                if self.send_lines is not None:
                    await self.send_lines(lines)
                else:
                    await self.send("\n".join(line.text for line in lines))
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
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # between a worker's retries (tests: at once)
    rng: Callable[[], float] = random.random  # the retries' jitter
    clock: Callable[[], float] = time.monotonic
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    state: SwarmStateStore | None = None  # breakers and per-worker numbers survive restarts here
    refiner: patterns.Synthesizer | None = None  # distils a successful pipeline into one report
    router: EmbeddingRouter | None = None  # semantic routing for workers=auto; keywords when None
    executions: ExecutionRecord | None = None  # every tool execution's row: what each ending says of its tools
    _tasks: Supervisor = field(default_factory=lambda: Supervisor("swarm_task"))  # runs, and waits for checkpoints
    _running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _finished: dict[str, asyncio.Event] = field(default_factory=dict)
    _current: dict[str, TaskRun] = field(default_factory=dict)  # a checkpoint resume moves a task to a new run
    _capacity: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever a task stops running here
    _deadlines: dict[str, asyncio.Timeout] = field(default_factory=dict)  # each running task's deadline
    _effects: dict[str, Effects] = field(default_factory=dict)  # what each running task's tools did, in memory
    _unsaved: dict[str, Unsaved] = field(default_factory=dict)  # endings the store refused, kept until stored
    _kept_runs: dict[str, TaskRun] = field(default_factory=dict)  # the run each kept ending belongs to
    # endings decided (stored, or kept) and being said: a stop or cancel then lets the saying finish (once) and
    # never says "cancelled" over them
    _saying: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    # tasks whose ending this process is writing: a row it reads as ended meanwhile is its own ending, not a cancel
    _finishing: set[str] = field(default_factory=set)
    _ended_elsewhere: dict[str, TaskRecord] = field(default_factory=dict)  # why a running task was stopped here
    _watcher: asyncio.Task[None] | None = None
    ended_poll_seconds: float = ENDED_POLL_SECONDS
    polls: int = 0  # rounds of that asking done (tests wait on it)
    # told (no arguments) whenever a task's state or a worker's numbers may have changed: the live dashboard
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls = WorkerCalls(
            self.store,
            self.config,
            self.state,
            sleep=self.sleep,
            rng=self.rng,
            clock=self.clock,
            breakers=self.breakers,
            changed=self._changed,
        )
        for name in self.workers:
            self.calls.breaker(name)
        self.checkpoints = Checkpoints(
            self.store,
            self.config,
            self.approvals,
            self._capacity,
            self._report,
            ended=self._ended_at_checkpoint,
            ending=self._finishing.add,
        )

    async def _ended_at_checkpoint(self, task_id: str, line: str) -> None:
        """A pipeline rejected (or timed out, or refused) at its checkpoint: said in the progress lines and, like a
        result, in its chat or its route."""
        if task_id not in self._running:  # (waited for after a restart: no run here to end; the mark is done with)
            self._finishing.discard(task_id)
        try:
            record = await self.store.get(task_id)
        except StoreUnavailable as exc:
            swarm_failure("deliver")
            log.warning("swarm.ending_unread", task_id=task_id, error=str(exc))
            record = None
        if record is None:
            self._report(line)
            return
        execution = await self._execution(task_id)
        message = "\n".join([line, *ending_lines(record)])
        if not any(text.startswith("tools:") for text in message.splitlines()):
            message += f"\ntools: {execution.line()}"
        await self._say_ending(request_from(record), line, message)

    async def restore_breakers(self) -> list[str]:
        """Breakers as they were saved before this start; returns the workers still resting."""
        return await self.calls.restore_breakers()

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
        await self.calls.save_breaker(breaker)
        log.info("swarm.breaker_reset", worker=worker, actor=actor, was=was.value)
        return f"{worker}'s breaker is closed (it was {was.value}); reset by {actor}"

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
        pattern = self.pattern(request)
        if not request.prompt.strip():
            raise SwarmRefused("the task is empty")
        try:
            check_prompt(request.prompt, word=pattern.prompt_word)
            check_context(request.context, what="task's context")
            check_metadata(request.metadata())
        except LimitExceeded as exc:
            raise SwarmRefused(str(exc)) from None
        names = list(request.workers)
        if request.preset is not None:
            stages = self.config.pipelines.get(request.preset)
            if stages is None:
                raise SwarmRefused(f"unknown pipeline preset {request.preset!r} ({', '.join(self.config.pipelines)})")
            names = list(stages)
        if len(names) > MAX_WORKERS:
            raise SwarmRefused(f"{len(names)} workers requested; at most {MAX_WORKERS}")
        twice = sorted({n for n in request.workers if request.workers.count(n) > 1})
        if twice:
            # as /swarm refuses "researcher,researcher": the same worker twice would run twice, in one workspace
            raise SwarmRefused(f"worker(s) listed twice: {', '.join(twice)}")
        if pattern.resolve is not None:
            names = pattern.resolve(request, names, list(self.workers))
        if request.expect is not None:
            self.validator(request.expect)
        if request.deadline_seconds is not None and not 1 <= request.deadline_seconds <= 86400:
            raise SwarmRefused("a task deadline is 1 to 86400 seconds")
        if names == ["auto"]:
            if not pattern.auto:
                choosing = ", ".join(p.name for p in registered() if p.auto)
                raise SwarmRefused(f"workers=auto works with {choosing} only")
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

    @staticmethod
    def pattern(request: SwarmRequest) -> SwarmPattern:
        """The registered pattern the request names."""
        pattern = named(request.pattern)
        if pattern is None:
            known = ", ".join(p.name for p in registered())
            raise SwarmRefused(f"unknown swarm pattern {request.pattern!r} (patterns: {known})")
        return pattern

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
                workers=[w.name for w in workers],
            )
        except AtCapacity as exc:
            raise SwarmRefused(f"at capacity, retry in {exc.retry_in} s") from None
        except StoreUnavailable as exc:
            swarm_failure("running_row")
            log.warning("swarm.not_admitted", owner=request.owner, error=str(exc))
            raise SwarmRefused(STORE_UNAVAILABLE) from None
        if failpoints.armed:  # on disk RUNNING, nothing started yet
            try:
                await failpoints.reached(
                    "swarm.admitted", lambda: StoreUnavailable("admit", "the store refused the write (failpoint)")
                )
            except StoreUnavailable as exc:  # as if the row had not been written: the caller is told, it ends here
                with contextlib.suppress(StoreUnavailable):
                    await self.store.finish(run, TaskStatus.FAILED, result=None, error=f"not started: {exc}")
                raise SwarmRefused(STORE_UNAVAILABLE) from None
        self._report(f"swarm task {run.task_id} started: {request.pattern} with {', '.join(w.name for w in workers)}")
        self._spawn(run, request, workers)
        return run.task_id

    def _spawn(
        self, run: TaskRun, request: SwarmRequest, workers: Sequence[Worker], *, done: Sequence[WorkerResult] = ()
    ) -> None:
        self._finished.setdefault(run.task_id, asyncio.Event())
        task = self._tasks.spawn(self._run(run, request, list(workers), list(done)), name=f"swarm-{run.task_id}")
        self._running[run.task_id] = task
        if self._watcher is None or self._watcher.done():
            self._watcher = self._tasks.spawn(self._watch_ended(), name="swarm-ended-elsewhere")

    async def _watch_ended(self) -> None:
        """While tasks run here: stop those another process ended (a cancel from a terminal or another replica
        changes only the row; nothing else tells this process). The row refusing a stage's mark, or a tool's
        execution row (see :class:`TaskFence`), says it sooner."""
        while self._running:
            await asyncio.sleep(self.ended_poll_seconds)
            try:
                await self._stop_ended(list(self._running))
                if is_terminal(self.store.replica):  # alive, for a kazma run elsewhere that cannot ask the process
                    await self.store.touch(list(self._running))
                self.polls += 1
            except StoreUnavailable as exc:  # asked again next time
                swarm_failure("recovery_read")
                log.warning("swarm.ended_unread", error=str(exc))

    async def _stop_ended(self, task_ids: Collection[str]) -> None:
        """Cancel, here, each of ``task_ids`` whose row another process ended."""
        for task_id, record in (await self.store.ended(task_ids)).items():
            task = self._running.get(task_id)
            if task is None or task.done() or task_id in self._finishing or task_id in self._saying:
                continue  # not running here any more, or the ending read is this process's own
            self._ended_elsewhere[task_id] = record
            log.warning("swarm.ended_elsewhere", task_id=task_id, status=record.status.value, error=record.error or "")
            task.cancel()

    async def _stop_if_ended(self, task_id: str) -> None:
        """From inside the task: its row refused a write; ended elsewhere, the task's cancel lands here (at this
        await), not inside the work that would come next."""
        await self._stop_ended([task_id])
        await asyncio.sleep(0)

    # -- running ---------------------------------------------------------------------------------

    def _fence(self, run: TaskRun) -> TaskFence:
        """What the task's tools start under: its row still says its run now (see :class:`TaskFence`). A tool
        refused under it stops the task here at once, as the watch would on its next read, and says so."""
        task_id = run.task_id
        return self.store.fence(
            lambda: self._current.get(task_id, run), functools.partial(self._stop_if_ended, task_id)
        )

    def _task_calls(self, run: TaskRun) -> TaskCalls:
        task_id = run.task_id
        return self.calls.for_task(task_id, lambda: self._current.get(task_id, run))

    def _task_call(self, request: SwarmRequest, task: TaskCalls, finished: list[WorkerResult]) -> patterns.Call:
        """The call a task's pattern makes: reliable, checked against ``--expect``, and kept once it ends."""
        validator = None if request.expect is None else self.validator(request.expect)
        given = NOTHING if not request.context else fence_untrusted(request.context, source="the task's context")

        async def call(worker: Worker, prompt: str, context: Fenced) -> WorkerResult:
            result = await self.calls.call(worker, prompt, _with(given, context), task)
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
                        model=result.model,
                        tools=result.tools,
                    )
            finished.append(result)
            return result

        return call

    async def _run(self, run: TaskRun, request: SwarmRequest, workers: list[Worker], done: list[WorkerResult]) -> None:
        self._current[run.task_id] = run
        finished: list[WorkerResult] = []
        task = self._task_calls(run)
        deadline = float(request.deadline_seconds or self.config.swarm.task_deadline_seconds)
        effects = self._effects.setdefault(run.task_id, Effects(task_id=run.task_id))
        # Its tools start only while the row still says this run, here: a task ended elsewhere (the leader judged
        # this replica gone, a cancel heard by another process) starts none, whenever this process learns of it.
        effects.fence = self._fence(run)
        try:
            limit = asyncio.timeout(deadline)
            self._deadlines[run.task_id] = limit
            try:
                with tracking(effects), working_for(request.started_by, request.lineage or run.task_id):
                    async with limit:
                        call = self._task_call(request, task, finished)
                        outcome = await self._pattern(run, request, workers, done, call, task)
            except TimeoutError:
                if not limit.expired():
                    raise
                # the deadline stops every worker still running; what finished before it is kept
                # a pipeline journals each finished stage into ``done`` (resumed stages included)
                kept = list(done) if self.pattern(request).staged else finished
                outcome = patterns.SwarmOutcome(
                    TaskStatus.TIMEOUT,
                    f"the task's deadline of {deadline:g} s passed; {len(kept)} finished answer(s) kept",
                    kept,
                    {"deadline_seconds": deadline},
                )
            run = self._current.get(run.task_id, run)
            if outcome.status is TaskStatus.PAUSED:
                return  # the checkpoint keeps the task; a decision resumes or ends it
            execution = await self._execution(run.task_id)
            status, error = outcome.status, None
            if outcome.status in (TaskStatus.FAILED, TaskStatus.TIMEOUT):
                error = outcome.output
            if status is TaskStatus.SUCCEEDED and execution.outcome is Outcome.MAY_HAVE_RUN:
                # Its effects are not known: a result like that is never stored as a success.
                status, error = TaskStatus.FAILED, f"a tool it started never finished: {execution.line()}"
            result = {**outcome_json(outcome), "execution": execution.as_json()}
            await self._end(run, request, status, result, error, outcome.output, execution)
        except asyncio.CancelledError:
            saying = self._saying.pop(run.task_id, None)
            if saying is not None:  # its ending is decided and written (or kept): it is what the person hears
                await saying
                raise
            execution = await self._execution(run.task_id)
            elsewhere = self._ended_elsewhere.pop(run.task_id, None)
            if elsewhere is None:
                self._report(f"swarm task {run.task_id} cancelled; tools: {execution.line()}")
            else:
                how = elsewhere.error or elsewhere.status.value
                self._report(f"swarm task {run.task_id} stopped here: it was ended elsewhere ({how}); tools: "
                             f"{execution.line()}")  # fmt: skip
            await asyncio.shield(self._keep_execution(run.task_id, execution))
            raise
        except Exception as exc:
            swarm_failure("run")
            log.exception("swarm.run_crashed", task_id=run.task_id)
            run = self._current.get(run.task_id, run)
            execution = await self._execution(run.task_id)
            text = f"{type(exc).__name__}: {exc}"
            await self._end(run, request, TaskStatus.FAILED, {"execution": execution.as_json()}, text, text, execution)
        finally:
            self._running.pop(run.task_id, None)
            self._finishing.discard(run.task_id)
            self._ended_elsewhere.pop(run.task_id, None)
            self._current.pop(run.task_id, None)
            self._deadlines.pop(run.task_id, None)
            self._effects.pop(run.task_id, None)
            self._capacity.set()  # a resume waiting for room may try again
            event = self._finished.get(run.task_id)
            if event is not None:
                event.set()

    async def _execution(self, task_id: str, seen: Effects | None = None) -> ExecutionSummary:
        """What the task's tools did: its execution rows (every run of it, a resumed pipeline's too), or what this
        process saw when they cannot be read."""
        seen = seen or self._effects.get(task_id)
        if self.executions is not None:
            try:
                return await self.executions.summary_of_task(task_id)
            except Exception as exc:  # the rows are still there; this ending says what this process saw
                swarm_failure("step_journal")
                log.warning("swarm.executions_unread", task_id=task_id, error=str(exc))
        return ExecutionSummary() if seen is None else seen.summary()

    async def _keep_execution(self, task_id: str, execution: ExecutionSummary) -> None:
        try:
            await self.store.keep(task_id, {"execution": execution.as_json()})
        except Exception as exc:  # the ending's message said it; the row keeps the rest of its ending
            swarm_failure("task_write")
            log.warning("swarm.execution_unrecorded", task_id=task_id, error=str(exc))

    async def _end(
        self,
        run: TaskRun,
        request: SwarmRequest,
        status: TaskStatus,
        result: dict[str, Any],
        error: str | None,
        output: str,
        execution: ExecutionSummary,
    ) -> None:
        """Store a run's ending and say it; one the store refuses to take is kept, said, and stored later."""
        self._finishing.add(run.task_id)
        try:
            if failpoints.armed:
                await failpoints.reached(
                    "swarm.result.stored", lambda: StoreUnavailable("finish", "the store refused the write (failpoint)")
                )
            stored = await self.store.finish(run, status, result=result, error=error)
        except StoreUnavailable as exc:
            swarm_failure("task_write")
            log.warning("swarm.finish_unrecorded", task_id=run.task_id, status=status.value, error=str(exc))
            self._unsaved[run.task_id] = Unsaved(status, result, error, str(exc), time.time())
            self._kept_runs[run.task_id] = run
            self._tasks.spawn(self._store_later(run, status, result, error), name=f"swarm-store-later-{run.task_id}")
            message = self._ending_message(run.task_id, status, output, result, execution)
            # the store's refusal is news everywhere, the result's own conversation included: not "heard" there
            self._report(
                f"swarm task {run.task_id} {status.value}, but its result could not be stored ({exc.reason}); it is "
                f"kept here and stored when the store answers. Tools: {execution.line()}. {_short(output)}"
            )
            await self._say_whole(run.task_id, self._flush_and_deliver(request, message))
            return
        if stored:
            message = self._ending_message(run.task_id, status, output, result, execution)
            line = f"swarm task {run.task_id} {status.value}: {_short(output)} (tools: {execution.line()})"
            await self._say_whole(run.task_id, self._say_ending(request, line, message))
            return
        # Refused: ended meanwhile (a cancel heard by another process, the leader's "interrupted") and finished here
        # before this process read the row. The row keeps that ending; without this line the work this run did
        # would go unsaid.
        await self._say_whole(run.task_id, self._say_late(run.task_id, status, output, execution))

    async def _say_late(self, task_id: str, status: TaskStatus, output: str, execution: ExecutionSummary) -> None:
        """A run that finished after its task was ended: how it was ended, and what the run produced, said once."""
        how = await self._how_ended(task_id)
        self._report(
            f"swarm task {task_id} finished ({status.value}) after it had been {how}; its result was not recorded: "
            f"{_short(output)} (tools: {execution.line()})"
        )
        await self._keep_execution(task_id, execution)

    async def _how_ended(self, task_id: str) -> str:
        """How the task's row says it was ended: ``ended (<its error or status>)``, or ``ended`` when unread."""
        try:
            record = await self.store.get(task_id)
        except StoreUnavailable as exc:  # the line says it was ended, not how
            log.warning("swarm.ending_unread", task_id=task_id, error=str(exc))
            return "ended"
        if record is None or not record.status.terminal:
            return "ended"
        return f"ended ({record.error or record.status.value})"

    async def _say_whole(self, task_id: str, saying: Coroutine[Any, Any, None]) -> None:
        """Say a decided ending whole: a cancel (a stop, ``/swarm cancel``) arriving meanwhile waits for it in
        :meth:`_run` instead of cutting it off and calling the task cancelled."""
        future = asyncio.ensure_future(saying)
        self._saying[task_id] = future
        await asyncio.shield(future)
        self._saying.pop(task_id, None)

    async def _flush_and_deliver(self, request: SwarmRequest, message: str) -> None:
        if self.reporter is not None:
            await self.reporter.flush()
        await self._deliver(request, message)

    def _ending_message(
        self, task_id: str, status: TaskStatus, output: str, result: dict[str, Any], execution: ExecutionSummary
    ) -> str:
        record = TaskRecord(task_id, "", status, 0, "", {}, result, None, "", "", None, None,
                            _EPOCH, _EPOCH, None)  # fmt: skip
        lines = [f"swarm task {task_id} {status.value}:", output, *ending_lines(record)]
        if not any(line.startswith("tools:") for line in lines):
            lines.append(f"tools: {execution.line()}")
        return "\n".join(line for line in lines if line)

    async def _store_later(self, run: TaskRun, status: TaskStatus, result: dict[str, Any], error: str | None) -> None:
        """Store a kept ending once the store answers (backing off up to a minute); then it is no longer kept."""
        attempt = 0
        while True:
            await asyncio.sleep(_STORE_LATER.delay(attempt))
            attempt += 1
            try:
                stored = await self.store.finish(run, status, result=result, error=error)
            except StoreUnavailable as exc:
                log.warning("swarm.finish_still_unrecorded", task_id=run.task_id, attempt=attempt, error=str(exc))
                continue
            self._unsaved.pop(run.task_id, None)
            self._kept_runs.pop(run.task_id, None)
            if stored:
                self._report(f"swarm task {run.task_id}: its {status.value} result is stored now")
            else:  # ended elsewhere while the store was away (a cancel, the leader's "interrupted"): said, not kept
                how = await self._how_ended(run.task_id)
                self._report(
                    f"swarm task {run.task_id}: its {status.value} result, kept here, was not stored: the task had "
                    f"been {how} meanwhile, which is what its record keeps"
                )
            self._changed()
            return

    def as_ended(self, records: Sequence[TaskRecord]) -> list[TaskRecord]:
        """``records`` with the endings this process keeps unstored laid over their rows (see :meth:`task`)."""
        return [self._unsaved[r.id].over(r) if r.id in self._unsaved and not r.status.terminal else r for r in records]

    async def task(self, task_id: str) -> TaskRecord | None:
        """The task as it stands: its row, or the ending this process keeps for it when the store refused it."""
        record = await self.store.get(task_id)
        unsaved = self._unsaved.get(task_id)
        if record is not None and unsaved is not None and not record.status.terminal:
            return unsaved.over(record)
        return record

    async def _mark(self, run: TaskRun, step: str) -> None:
        """Record where the run is; a mark that cannot be written is counted and the run goes on."""
        try:
            marked = await self.store.step(run, step)
        except StoreUnavailable as exc:
            swarm_failure("step_journal")
            log.warning("swarm.step_unrecorded", task_id=run.task_id, step=step, error=str(exc))
            return
        if not marked:  # refused: ended elsewhere (a cancel), it stops here before this step starts
            await self._stop_if_ended(run.task_id)

    async def _pattern(
        self,
        run: TaskRun,
        request: SwarmRequest,
        workers: list[Worker],
        done: list[WorkerResult],
        call: patterns.Call,
        task: TaskCalls,
    ) -> patterns.SwarmOutcome:
        async def plain_call(worker: Worker, prompt: str, context: Fenced) -> WorkerResult:
            return await self.calls.call(worker, prompt, context, task)

        async def mark(step: str) -> None:
            await self._mark(run, step)

        return await self.pattern(request).run(
            PatternRun(
                request=request,
                workers=workers,
                call=call,
                plain_call=plain_call,
                by_name=self.workers,
                concurrency=self.config.swarm.task_concurrency,
                synthesizer=self.synthesizer,
                chooser=self.chooser,
                mark=mark,
                stages=self._stages(run, request, done, call),
            )
        )

    def _stages(
        self, run: TaskRun, request: SwarmRequest, done: list[WorkerResult], task_call: patterns.Call
    ) -> Stages:
        """Stages for a pattern that runs them in turn: marked, journaled, paused at the preset's checkpoints."""
        checkpoints = set(self.config.swarm.checkpoints.get(request.preset or "", []))
        task_id = run.task_id  # a checkpoint resume moves the task to a new run: always write as self._current's

        async def call(worker: Worker, prompt: str, context: Fenced) -> WorkerResult:
            step = f"stage {len(done) + 1} ({worker.name})"
            await self._mark(self._current[task_id], step)
            self._report(f"swarm task {run.task_id}: {step} started")
            return await task_call(worker, prompt, context)

        unkept: dict[int, WorkerResult] = {}  # stages whose journal write failed (asked again before a pause)

        async def journal(index: int, result: WorkerResult) -> None:
            done.append(result)
            try:
                kept = await self.store.journal(self._current[task_id], index, result.worker, result)
            except StoreUnavailable as exc:  # the stage stays done in this run; a resume after a crash redoes it
                swarm_failure("step_journal")
                log.warning("swarm.journal_unrecorded", task_id=task_id, stage=index + 1, error=str(exc))
                unkept[index] = result
                return
            if not kept:  # refused: ended elsewhere (a cancel) stops it here before the next stage
                await self._stop_if_ended(task_id)

        async def checkpoint(index: int, result: WorkerResult) -> bool:
            if index + 1 not in checkpoints:
                return True
            for stage in sorted(unkept):
                # A pause outlives this process: a stage the journal lacks would run again (its tools too) when a
                # restarted Kazma resumes it. Asked once more; still refused, the task ends here instead.
                try:
                    await self.store.journal(self._current[task_id], stage, unkept[stage].worker, unkept[stage])
                except StoreUnavailable as exc:
                    raise StageUnrecorded(
                        f"stage {stage + 1} ({unkept[stage].worker})'s result could not be recorded ({exc.reason}); "
                        "pausing at the checkpoint would run it again after a restart, so the task ends here"
                    ) from None
                del unkept[stage]
            # The task's deadline counts running time: a pipeline waiting for a person at its checkpoint is not
            # running (the checkpoint's own deadline is its approval request's).
            with self._clock_stopped(task_id):
                decided = await self.checkpoints.pause(self._current[task_id], request.conversation, index, result)
            if decided is None:
                return False
            self._current[task_id] = decided
            return True

        async def refine(outcome: patterns.SwarmOutcome) -> None:
            if self.refiner is not None:
                await self._refine(request, outcome)

        return Stages(done=list(done), call=call, journal=journal, checkpoint=checkpoint, refine=refine)

    @contextlib.contextmanager
    def _clock_stopped(self, task_id: str) -> Iterator[None]:
        """The task's deadline stands still inside the block, and runs on with what was left after it."""
        limit = self._deadlines.get(task_id)
        when = None if limit is None else limit.when()
        if limit is None or when is None:
            yield
            return
        loop = asyncio.get_running_loop()
        left = when - loop.time()
        limit.reschedule(None)
        try:
            yield
        finally:
            limit.reschedule(loop.time() + max(0.0, left))

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

    async def _deliver(self, request: SwarmRequest, text: str) -> None:
        target = request.route or request.conversation
        if self.deliver is None or ":" not in target:
            return
        try:
            await self.deliver(target, text)
        except Exception as exc:
            swarm_failure("deliver")
            log.warning("swarm.deliver_failed", target=target, error=str(exc))

    def _report(self, line: str, *, heard_in: str | None = None) -> None:
        log.info("swarm.progress", line=line)
        if self.reporter is not None:
            self.reporter.add(line, heard_in=heard_in)
        self._changed()

    async def _say_ending(self, request: SwarmRequest, line: str, message: str) -> None:
        """A task's ending: the progress so far goes out first (a result never arrives before its "started"),
        then the ending's progress line, left out where the result itself is delivered, then the result."""
        target = request.route or request.conversation
        self._report(line, heard_in=target if self.deliver is not None and ":" in target else None)
        if self.reporter is not None:
            await self.reporter.flush()
        await self._deliver(request, message)

    def _changed(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception as exc:  # a watcher's fault must never stop the swarm
                log.warning("swarm.listener_failed", error=str(exc))

    # -- operators -------------------------------------------------------------------------------

    async def decide_checkpoint(self, task_id: str, decision: Decision, *, actor: str, platform: str) -> str:
        """Approve or reject a paused pipeline: not pending, at capacity and not recorded are each said."""
        return await self.checkpoints.decide(task_id, decision, actor=actor, platform=platform)

    async def wait(self, task_id: str, wait_seconds: float = CHECK_DEFAULT_WAIT) -> TaskRecord | None:
        """Answer as soon as the task ends, or after ``wait_seconds`` (at most 90 s) with where it is."""
        limit = max(0.0, min(wait_seconds, CHECK_MAX_WAIT))
        event = self._finished.get(task_id)
        if event is not None:
            await until_set(event, limit)
        return await self.task(task_id)

    async def cancel(self, task_id: str, *, actor: str) -> str:
        record = await self.store.get(task_id)
        if record is None:
            return f"no swarm task {task_id!r}"
        if record.status.terminal:
            return f"swarm task {task_id} already ended: {record.status.value}"
        running_here = task_id in self._running
        if running_here:
            self._finishing.add(task_id)  # this cancel is this process's own (the poller must not take it for one made
            # elsewhere); the task is cancelled below, after its checkpoint card is withdrawn
        changed = await self.store.cancel(task_id, actor=actor)
        if changed:
            self._changed()
            approval_id = checkpoint_id(record.current_step)
            if record.status is TaskStatus.PAUSED and approval_id is not None:
                await self.checkpoints.settle(approval_id, task_id, f"cancelled by {actor}")
        task = self._running.get(task_id)
        if task is not None:
            task.cancel()
            # Its tools are stopped with it; the answer says what they did once they have stopped.
            await asyncio.wait({task}, timeout=CANCEL_WAIT_SECONDS)
        if not changed:
            return f"swarm task {task_id} could not be cancelled"
        tools = (await self._execution(task_id)).line()
        if task is None and record.status is TaskStatus.RUNNING:
            # Run by another process (`kazma run` for a terminal's cancel, another replica): it learns of this from
            # the row and stops the task within ENDED_POLL_SECONDS; until then its tools may still be working.
            return (
                f"swarm task {task_id} cancelled by {actor}; the Kazma process running it stops it within "
                f"{self.ended_poll_seconds:g} s and says what its tools did (tools so far: {tools})"
            )
        return f"swarm task {task_id} cancelled by {actor}; tools: {tools}"

    def serving(self) -> None:
        """The platforms are up: the progress lines held until now (what the recovery found) go out."""
        if self.reporter is not None:
            self.reporter.release()

    async def recover(self) -> list[str]:
        """Rows left RUNNING are reported interrupted (never re-run); paused pipelines wait again; breakers return."""
        lines = []
        for worker in await self.restore_breakers():
            lines.append(f"{worker} is still resting after repeated failures (its breaker was open before the restart)")
        try:
            interrupted = await self.store.recover()
            # Every paused one, not just as many as may be paused now: with the limit lowered across a restart, an
            # Approve on an older card was recorded and nothing resumed it.
            paused = await self.store.list(TaskStatus.PAUSED, limit=max(1, await self.store.count(TaskStatus.PAUSED)))
        except StoreUnavailable as exc:  # nothing was changed: the next start (or sweep) recovers them
            swarm_failure("recovery_read")
            log.warning("swarm.recovery_unread", error=str(exc))
            return [*lines, f"the swarm's tasks could not be read to recover them ({exc}); the next start tries again"]
        for item in interrupted:
            execution = await self._interrupted_execution(item.task_id)
            line = (
                f"swarm task {item.task_id} was interrupted in {item.step}; its outcome is unknown (tools: "
                f"{execution.line()}). Nothing re-ran."
            )
            lines.append(line)
            self._report(line)
        for record in paused:
            self._wait_again(record)
        await self.sweep_checkpoints()
        return lines

    async def _interrupted_execution(self, task_id: str) -> ExecutionSummary:
        """A task a dead process was running: what its execution rows say (kept with it), read after they were
        marked lost."""
        execution = await self._execution(task_id)
        await self._keep_execution(task_id, execution)
        return execution

    async def sweep_checkpoints(self) -> list[str]:
        """Withdraw checkpoint cards whose task is not paused at them (at start, then with every sweep)."""
        try:
            return await self.checkpoints.withdraw_stale()
        except Exception as exc:  # the next sweep tries again; the cards keep their buttons until then
            swarm_failure("gate_settle")
            log.warning("swarm.checkpoint_sweep_failed", error=f"{type(exc).__name__}: {exc}")
            return []

    def _wait_again(self, record: TaskRecord) -> None:
        """A paused pipeline whose waiter is gone (a restart, a replica that died) waits for its checkpoint here."""
        approval_id = checkpoint_id(record.current_step)
        if approval_id is None or record.id in self._finished:
            return  # no checkpoint to wait for, or this process waits for it already
        self._finished[record.id] = asyncio.Event()
        self._tasks.spawn(self._resume_after_restart(record, approval_id), name=f"swarm-checkpoint-{record.id}")

    async def recover_gone(self, live: Collection[str], *, leading: Callable[[], bool] | None = None) -> list[str]:
        """Among replicas: tasks a replica not in ``live`` was running end interrupted (never re-run), reported;
        pipelines it had paused at a checkpoint wait here now (adopted once, by one replica).

        ``leading`` (the leader's sweep): asked before each write that rests on the judgement of ``live``; once
        it says no, the rest is left to the replica that leads now (a replica judged gone may have come back
        under its name, running tasks and waiting at checkpoints again). What was adopted is waited for here."""
        lines = []
        try:
            interrupted = await self.store.recover(live, leading=leading)
            adopted = await self.store.adopt_paused(live, leading=leading)
        except StoreUnavailable as exc:  # the leader's next sweep tries again
            swarm_failure("recovery_read")
            log.warning("swarm.recovery_unread", error=str(exc))
            return [f"the swarm's tasks could not be read to recover them ({exc}); the next sweep tries again"]
        for item in interrupted:
            execution = await self._interrupted_execution(item.task_id)
            # Judged gone is not known stopped: a replica cut off from the database or paused may still run the
            # task, and stops it itself once it reads the row (its own line then says what its tools did). Its
            # tools are read after the write: one whose row was going in (holding the task's row) is committed
            # first and read; none starts after it (TaskFence).
            line = (
                f"swarm task {item.task_id} was interrupted in {item.step}: the Kazma replica running it was judged "
                f"gone (stopped, or cut off from the database); if it still runs, it stops the task once it reads "
                f"this (every {self.ended_poll_seconds:g} s while it reaches the database; no tool of the task starts "
                f"there from now on) and says what its tools did. Its outcome is unknown (tools so far: "
                f"{execution.line()}). Nothing re-ran."
            )
            lines.append(line)
            self._report(line)
        for task_id in adopted:
            record = await self.store.get(task_id)
            if record is not None and record.status is TaskStatus.PAUSED:
                self._wait_again(record)
        if leading is not None and not leading():
            log.warning("swarm.recovery_stopped", reason="this replica no longer leads", interrupted=len(lines))
        await self.sweep_checkpoints()
        return lines

    async def _resume_after_restart(self, record: TaskRecord, approval_id: str) -> None:
        resumed = await self.checkpoints.wait(record.id, approval_id)
        if resumed is None:
            event = self._finished.get(record.id)
            if event is not None:
                event.set()
            return
        request = request_from(record)
        resolved = [str(name) for name in record.request.get("resolved", [])]
        missing = [name for name in resolved if name not in self.workers]
        if missing:
            # Stages run by position after the journal: a stage left out would shift the rest (one skipped, or a
            # later one run in its place). What was approved cannot run as it was: the task ends failed.
            await self._unresumable(resumed, request, missing)
            return
        done = [step.to_result() for step in await self.store.journaled(record.id)]
        self._spawn(resumed, request, [self.workers[name] for name in resolved], done=done)

    async def _unresumable(self, run: TaskRun, request: SwarmRequest, missing: list[str]) -> None:
        names = ", ".join(missing)
        error = (
            f"not resumed: its stage worker{'s' if len(missing) > 1 else ''} {names} "
            f"{'are' if len(missing) > 1 else 'is'} no longer configured (agents.workers); nothing after the "
            "checkpoint ran"
        )
        log.warning("swarm.resume_refused", task_id=run.task_id, missing=missing)
        execution = await self._execution(run.task_id)
        try:
            await self._end(run, request, TaskStatus.FAILED, {"execution": execution.as_json()}, error, error,
                            execution)  # fmt: skip
        finally:
            self._finishing.discard(run.task_id)
            event = self._finished.get(run.task_id)
            if event is not None:
                event.set()

    def worker_lines(self) -> list[str]:
        return [f"{name}: breaker {self.breakers[name].state}" for name in self.workers]

    async def close(self) -> None:
        """A clean stop: every running task ends ``cancelled`` (interrupted_by: shutdown) before this returns.

        Only a crash leaves rows RUNNING for :meth:`recover` to call interrupted. Paused pipelines stay paused.
        """
        running = list(self._running)
        seen = dict(self._effects)
        await self._tasks.stop()
        for task_id in running:
            execution = await self._execution(task_id, seen.get(task_id))
            result = {"interrupted_by": "shutdown", "execution": execution.as_json()}
            try:
                if await self.store.cancel(task_id, actor="shutdown", result=result, only=[TaskStatus.RUNNING]):
                    log.info("swarm.shutdown_cancelled", task_id=task_id, tools=execution.line())
            except StoreUnavailable as exc:  # the row stays RUNNING: the next start calls it interrupted
                swarm_failure("task_write")
                log.error("swarm.shutdown_unrecorded", task_id=task_id, error=str(exc))
        for task_id, kept in list(self._unsaved.items()):  # one last try for endings the store refused
            try:
                await self.store.finish(self._kept_runs[task_id], kept.status, result=kept.result, error=kept.error)
            except StoreUnavailable as exc:  # the row stays RUNNING: the next start calls it interrupted
                swarm_failure("task_write")
                log.error("swarm.kept_result_lost", task_id=task_id, status=kept.status.value, error=str(exc))
        if self.reporter is not None:
            await self.reporter.close()


def _with(given: Fenced, context: Fenced) -> Fenced:
    """The task's own context first, then what the pattern hands over (both fenced)."""
    return join_fenced([given, context], "\n\n")


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
        "cost": usage.cost,
    }


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
        context=str(data.get("context") or ""),
        started_by=None if data.get("started_by") is None else str(data["started_by"]),
        lineage=None if data.get("lineage") is None else str(data["lineage"]),
    )


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
