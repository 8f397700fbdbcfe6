"""The six built-in swarm patterns, each one :class:`~kazma.engine.swarm.registry.SwarmPattern`: its ``/swarm``
command and arguments, its help line, how it resolves its workers and how it runs.

They are registered when this module is imported; the grammar and the swarm service import it, so every
surface knows them. The orchestration itself is :mod:`kazma.engine.swarm.patterns`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kazma.config.limits import MAX_WORKERS
from kazma.engine.fence import Fenced
from kazma.engine.swarm import patterns
from kazma.engine.swarm.registry import PatternRun, SwarmPattern, register
from kazma.engine.swarm.syntax import STRATEGIES, Arguments, RequestFields, StartCommand
from kazma.engine.swarm.types import Pattern, SwarmRefused, SwarmRequest, TaskStatus, Worker, WorkerResult

# -- dispatch: one worker, its fallbacks, handoffs ---------------------------------------------------------


@dataclass(frozen=True)
class DispatchCommand(StartCommand):
    verb: ClassVar[str] = "dispatch"
    pattern: ClassVar[str] = Pattern.DISPATCH
    worker: str | None  # None: "auto", the engine picks the worker whose expertise fits
    prompt: str

    def request_fields(self) -> RequestFields:
        return {"workers": (self.worker,) if self.worker else ("auto",), "prompt": self.prompt}


def _parse_dispatch(args: Arguments, rest: str, opts: dict[str, str]) -> DispatchCommand:
    token, prompt, opts = args.word_then_task(rest, opts)
    return DispatchCommand(args.dispatch_worker(token), args.prompt(prompt), **args.start(opts))


async def _run_dispatch(run: PatternRun) -> patterns.SwarmOutcome:
    first, *fallbacks = run.workers
    await run.mark(first.name)
    return await patterns.dispatch(run.call, first, run.request.prompt, fallbacks=fallbacks, by_name=run.by_name)


DISPATCH = register(
    SwarmPattern(
        DispatchCommand,
        arguments="<worker|auto> <task>",
        needs="a worker and a task",
        summary="hand a task to one worker (auto: the best fit)",
        parse=_parse_dispatch,
        run=_run_dispatch,
        auto=True,
    )
)


# -- broadcast: the same task to every worker ----------------------------------------------------------------


@dataclass(frozen=True)
class BroadcastCommand(StartCommand):
    verb: ClassVar[str] = "broadcast"
    pattern: ClassVar[str] = Pattern.BROADCAST
    prompt: str

    def request_fields(self) -> RequestFields:
        return {"prompt": self.prompt}


def _parse_broadcast(args: Arguments, rest: str, opts: dict[str, str]) -> BroadcastCommand:
    return BroadcastCommand(args.prompt(rest), **args.start(opts))


def _every_worker_when_none(request: SwarmRequest, names: list[str], every: Sequence[str]) -> list[str]:
    return names or list(every)


async def _run_broadcast(run: PatternRun) -> patterns.SwarmOutcome:
    await run.mark("broadcast")
    return await patterns.broadcast(
        run.call, run.workers, run.request.prompt, concurrency=run.concurrency, by_name=run.by_name
    )


BROADCAST = register(
    SwarmPattern(
        BroadcastCommand,
        arguments="<task>",
        needs="a task",
        summary="give the same task to every worker",
        parse=_parse_broadcast,
        run=_run_broadcast,
        resolve=_every_worker_when_none,
    )
)


# -- pipeline: stages in turn, journaled, with checkpoints ---------------------------------------------------


@dataclass(frozen=True)
class PipelineCommand(StartCommand):
    verb: ClassVar[str] = "pipeline"
    pattern: ClassVar[str] = Pattern.PIPELINE
    workers: tuple[str, ...]  # the stages in order, resolved from the preset when one was named
    prompt: str
    preset: str | None = None

    def request_fields(self) -> RequestFields:
        return {"workers": self.workers, "prompt": self.prompt, "preset": self.preset}


def _parse_pipeline(args: Arguments, rest: str, opts: dict[str, str]) -> PipelineCommand:
    token, prompt, opts = args.word_then_task(rest, opts)
    preset, stages = args.pipeline_stages(token)
    return PipelineCommand(stages, args.prompt(prompt), preset=preset, **args.start(opts))


async def _run_pipeline(run: PatternRun) -> patterns.SwarmOutcome:
    stages = run.stages
    outcome = await patterns.pipeline(
        stages.call,
        run.workers,
        run.request.prompt,
        done=list(stages.done),
        journal=stages.journal,
        checkpoint=stages.checkpoint,
        by_name=run.by_name,
    )
    if outcome.status is TaskStatus.SUCCEEDED and len(outcome.results) > 1:
        await stages.refine(outcome)
    return outcome


PIPELINE = register(
    SwarmPattern(
        PipelineCommand,
        arguments="<preset|w1,w2,…> <task>",
        needs="a preset or workers, and a task",
        summary="pass a task through workers in turn",
        parse=_parse_pipeline,
        run=_run_pipeline,
        staged=True,
    )
)


# -- fanout: several workers at once, one aggregation ---------------------------------------------------------


@dataclass(frozen=True)
class FanOutCommand(StartCommand):
    verb: ClassVar[str] = "fanout"
    pattern: ClassVar[str] = Pattern.FAN_OUT
    workers: tuple[str, ...]
    prompt: str
    strategy: str = "collect"

    def request_fields(self) -> RequestFields:
        return {"workers": self.workers, "prompt": self.prompt, "aggregation": self.strategy}


def _parse_fanout(args: Arguments, rest: str, opts: dict[str, str]) -> FanOutCommand:
    token, prompt, opts = args.word_then_task(rest, opts)
    strategy = args.strategy(opts.pop("strategy", "collect"))
    return FanOutCommand(args.worker_list(token), args.prompt(prompt), strategy, **args.start(opts))


async def _run_fan_out(run: PatternRun) -> patterns.SwarmOutcome:
    await run.mark("fan_out")
    return await patterns.fan_out(
        run.call,
        run.workers,
        run.request.prompt,
        aggregation=patterns.parse_aggregation(run.request.aggregation),
        concurrency=run.concurrency,
        synthesizer=run.synthesizer,
        chooser=run.chooser,
        by_name=run.by_name,
    )


FAN_OUT = register(
    SwarmPattern(
        FanOutCommand,
        arguments=f"<w1,w2,…> [--strategy {'|'.join(STRATEGIES)}] <task>",
        needs="workers and a task",
        summary="run a task on several workers at once",
        parse=_parse_fanout,
        run=_run_fan_out,
        options=("strategy",),
    )
)


# -- conditional: a router's answer picks the branch --------------------------------------------------------


@dataclass(frozen=True)
class ConditionalCommand(StartCommand):
    verb: ClassVar[str] = "conditional"
    pattern: ClassVar[str] = Pattern.CONDITIONAL
    router: str  # the worker whose answer names the branch
    routes: tuple[tuple[str, str], ...]  # (branch, worker)
    prompt: str

    def request_fields(self) -> RequestFields:
        return {"workers": (self.router,), "prompt": self.prompt, "routes": self.routes}


def _parse_conditional(args: Arguments, rest: str, opts: dict[str, str]) -> ConditionalCommand:
    router, after = args.word_and_prompt(rest)
    routes_token, prompt = args.word_and_prompt(after)
    opts, prompt = args.options(prompt, opts)
    args.check_worker(router.lower())
    routes = args.route_map(routes_token)
    return ConditionalCommand(router.lower(), routes, args.prompt(prompt), **args.start(opts))


def _router_and_branches(request: SwarmRequest, names: list[str], every: Sequence[str]) -> list[str]:
    """The router (the first worker named) and every branch's worker."""
    if len(request.routes) > MAX_WORKERS:
        raise SwarmRefused(f"{len(request.routes)} branches given; at most {MAX_WORKERS}")
    if not request.routes:
        raise SwarmRefused("conditional needs a route map: branch=worker,…")
    if len(names) != 1:  # a second worker named was never run, nor said to be left out
        raise SwarmRefused(f"conditional takes one router worker, {len(names)} given")
    return [*names[:1], *(worker for _, worker in request.routes)]


async def _run_conditional(run: PatternRun) -> patterns.SwarmOutcome:
    router, request = run.workers[0], run.request
    await run.mark(f"routing ({router.name})")
    routes = {branch: run.by_name[name] for branch, name in request.routes}

    async def routed_call(worker: Worker, prompt: str, context: Fenced) -> WorkerResult:
        # the router answers with a branch name, not the task's output: --expect does not apply to it
        if worker is router and prompt != request.prompt:
            return await run.plain_call(worker, prompt, context)
        return await run.call(worker, prompt, context)

    return await patterns.routed(routed_call, router, routes, request.prompt, by_name=run.by_name)


CONDITIONAL = register(
    SwarmPattern(
        ConditionalCommand,
        arguments="<router> <branch=worker,…> <task>",
        needs="a router worker, a route map and a task",
        summary="let the router's answer pick the branch that runs the task",
        parse=_parse_conditional,
        run=_run_conditional,
        resolve=_router_and_branches,
    )
)


# -- consult: several workers asked, their answers compared -------------------------------------------------


@dataclass(frozen=True)
class ConsultCommand(StartCommand):
    verb: ClassVar[str] = "consult"
    pattern: ClassVar[str] = Pattern.CONSULT
    workers: tuple[str, ...]
    question: str

    def request_fields(self) -> RequestFields:
        return {"workers": self.workers, "prompt": self.question}


def _parse_consult(args: Arguments, rest: str, opts: dict[str, str]) -> ConsultCommand:
    token, prompt, opts = args.word_then_task(rest, opts)
    return ConsultCommand(args.worker_list(token), args.prompt(prompt), **args.start(opts))


async def _run_consult(run: PatternRun) -> patterns.SwarmOutcome:
    await run.mark("consult")
    return await patterns.consult(
        run.call,
        run.workers,
        run.request.prompt,
        synthesizer=run.synthesizer,
        concurrency=run.concurrency,
        by_name=run.by_name,
    )


CONSULT = register(
    SwarmPattern(
        ConsultCommand,
        arguments="<w1,w2,…> <question>",
        needs="workers and a question",
        summary="ask several workers and compare their answers",
        parse=_parse_consult,
        run=_run_consult,
        prompt_word="question",
    )
)

PATTERNS: tuple[SwarmPattern, ...] = (DISPATCH, BROADCAST, PIPELINE, FAN_OUT, CONDITIONAL, CONSULT)
