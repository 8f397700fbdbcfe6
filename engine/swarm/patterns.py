"""The six swarm patterns and the aggregation strategies.

Patterns only orchestrate: every worker call goes through the injected
``call`` (which the swarm service wraps in breakers, retries and timeouts),
so each pattern is plain logic over :class:`WorkerResult`.

Every worker a pattern runs may hand its task on (``handoff_to_worker``): in
``dispatch`` the chain's runs are the task's results; in the other patterns a
handoff replaces that worker's answer in its place (a stage, a branch, one of
the parallel answers) and the runs that handed over count in the tokens. What a
worker reads of other workers' output always arrives fenced.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import structlog

from kazma.config import failpoints
from kazma.engine.fence import NOTHING, Fenced, fence_untrusted, join_fenced
from kazma.engine.swarm.metrics import HANDOFFS, swarm_failure
from kazma.engine.swarm.types import (
    ErrorKind,
    HandoffOffer,
    HandoffRecord,
    TaskStatus,
    Worker,
    WorkerResult,
    current_step,
    offering,
    step_named,
)
from kazma.engine.types import ModelError, Usage

log = structlog.get_logger("kazma.swarm")

Call = Callable[[Worker, str, Fenced], Awaitable[WorkerResult]]  # (worker, prompt, fenced context)


@dataclass(frozen=True)
class Synthesis:
    """A model call's answer with what it cost, so synthesis tokens count in the task's totals."""

    text: str
    usage: Usage = field(default_factory=Usage)


Synthesizer = Callable[[str, Sequence[WorkerResult]], Awaitable["str | Synthesis"]]
# The chooser names the worker whose answer is best ("best" aggregation).
Chooser = Callable[[str, Sequence[WorkerResult]], Awaitable["str | Synthesis"]]
# A handoff made from the run at depth MAX_HANDOFF_DEPTH is refused: at most 4 handoffs, 5 runs in a chain.
MAX_HANDOFF_DEPTH = 5
MAX_VISITS = 2  # a worker runs at most twice in one chain
_WORD = re.compile(r"[a-z0-9]+")
# A branch may hold '-' and '_' (syntax.BRANCH): read as _WORD alone, "needs-review" was never found in any answer.
_BRANCH_WORD = re.compile(r"[a-z0-9_-]+")


class Aggregation(StrEnum):
    COLLECT = "collect"  # metadata only: who answered, how much; the answers stay in the task record
    FIRST_VALID = "first_valid"
    MERGE_ALL = "merge_all"  # labelled "[worker] output" blocks
    VOTE = "vote"
    BEST = "best"  # the model picks the best answer; the first valid one when it cannot
    SYNTHESIZE = "synthesize"


class NoCapableWorker(LookupError):
    """``workers=auto`` found nobody whose expertise matches the task."""


@dataclass
class SwarmOutcome:
    status: TaskStatus
    output: str
    results: list[WorkerResult] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    extra_usage: Usage = field(default_factory=Usage)  # model calls beyond the workers' (synthesis, refiner)


def parse_aggregation(name: str) -> Aggregation:
    try:
        return Aggregation(name)
    except ValueError:
        known = ", ".join(a.value for a in Aggregation)
        raise ValueError(f"unknown aggregation strategy {name!r} (known: {known})") from None


def route_auto(task: str, workers: Sequence[Worker]) -> Worker:
    """The worker whose expertise words overlap the task most; ties go to the first listed."""
    words = set(_WORD.findall(task.lower()))
    best: Worker | None = None
    best_score = 0
    for worker in workers:
        score = sum(1 for keyword in worker.expertise if set(_WORD.findall(keyword.lower())) & words)
        if score > best_score:
            best, best_score = worker, score
    if best is None:
        expertise = "; ".join(f"{w.name}: {', '.join(w.expertise) or 'none'}" for w in workers)
        raise NoCapableWorker(f"no worker's expertise matches this task (workers: {expertise})")
    return best


def _status(results: Sequence[WorkerResult]) -> TaskStatus:
    ok = sum(r.ok for r in results)
    if results and ok == len(results):
        return TaskStatus.SUCCEEDED
    return TaskStatus.PARTIAL if ok else TaskStatus.FAILED


def _labelled(results: Sequence[WorkerResult]) -> str:
    return "\n\n".join(f"[{r.worker}] {r.output}" if r.ok else f"[{r.worker}] failed: {r.error}" for r in results)


def _metadata(results: Sequence[WorkerResult]) -> str:
    return "\n".join(
        f"[{r.worker}] ok, {len(r.output)} characters" if r.ok else f"[{r.worker}] failed: {r.error}" for r in results
    )


def _merged(results: Sequence[WorkerResult]) -> str:
    return "\n\n".join(f"[{r.worker}] {r.output}" for r in results if r.ok)


def _text(answer: str | Synthesis) -> Synthesis:
    return answer if isinstance(answer, Synthesis) else Synthesis(answer)


async def aggregate(
    strategy: Aggregation,
    prompt: str,
    results: Sequence[WorkerResult],
    synthesizer: Synthesizer | None = None,
    chooser: Chooser | None = None,
) -> str:
    return (await aggregate_with_usage(strategy, prompt, results, synthesizer, chooser)).text


async def aggregate_with_usage(
    strategy: Aggregation,
    prompt: str,
    results: Sequence[WorkerResult],
    synthesizer: Synthesizer | None = None,
    chooser: Chooser | None = None,
) -> Synthesis:
    ok = [r for r in results if r.ok]
    if strategy is Aggregation.COLLECT:
        return Synthesis(_metadata(results))
    if strategy is Aggregation.FIRST_VALID:
        return Synthesis(ok[0].output if ok else "")
    if strategy is Aggregation.MERGE_ALL:
        return Synthesis(_merged(results))
    if strategy is Aggregation.VOTE:
        if not ok:
            return Synthesis("")
        counts = Counter(r.output.strip() for r in ok)
        top = max(counts.values())
        # ties go to the answer that appeared first
        return Synthesis(next(r.output.strip() for r in ok if counts[r.output.strip()] == top))
    if strategy is Aggregation.BEST:
        if not ok:
            return Synthesis("")
        if chooser is not None:
            try:
                choice = _text(await chooser(prompt, ok))
            except Exception as exc:
                swarm_failure("synthesis")
                log.warning("swarm.choice_failed", error=str(exc))
            else:
                named = choice.text.strip().strip("[]").lower()
                for r in ok:
                    if r.worker == named:
                        return Synthesis(r.output, choice.usage)
                swarm_failure("synthesis")
                log.warning("swarm.choice_unknown", answer=choice.text[:100])
                return Synthesis(ok[0].output, choice.usage)
        return Synthesis(ok[0].output)
    if synthesizer is not None and ok:
        try:
            return _text(await synthesizer(prompt, ok))
        except Exception as exc:
            swarm_failure("synthesis")
            log.warning("swarm.synthesis_failed", error=str(exc))
    return Synthesis(_labelled(results))  # the deterministic fallback


async def dispatch(
    call: Call,
    worker: Worker,
    prompt: str,
    *,
    fallbacks: Sequence[Worker] = (),
    by_name: Mapping[str, Worker] | None = None,
    context: Fenced = NOTHING,
) -> SwarmOutcome:
    """One worker; on failure the fallback chain in order; handoffs followed within bounds."""
    results: list[WorkerResult] = []
    chain: list[HandoffRecord] = []
    for candidate in (worker, *fallbacks):
        result = await _with_handoffs(call, candidate, prompt, context, by_name or {}, results, chain)
        if result.ok or result.changed_state:
            break  # a result that changed something is never tried again elsewhere
    final = results[-1]
    details: dict[str, Any] = {"worker": final.worker}
    if chain:
        details["handoffs"] = [h.as_json() for h in chain]
    return SwarmOutcome(
        TaskStatus.SUCCEEDED if final.ok else TaskStatus.FAILED,
        final.output if final.ok else final.error,
        results,
        details,
    )


@dataclass
class Handoffs:
    """The handoffs of one task outside ``dispatch``: each worker call may hand on, within the chain's bounds.

    :meth:`call` wraps a pattern's call; the wrapped call returns the answer that ends the chain (the target's),
    keeps the chain, and keeps the runs that handed over so their tokens still count.
    """

    by_name: Mapping[str, Worker]
    chains: list[list[HandoffRecord]] = field(default_factory=list)
    handed: list[WorkerResult] = field(default_factory=list)

    def call(self, call: Call) -> Call:
        async def run(worker: Worker, prompt: str, context: Fenced) -> WorkerResult:
            runs: list[WorkerResult] = []
            chain: list[HandoffRecord] = []
            result = await _with_handoffs(call, worker, prompt, context, self.by_name, runs, chain)
            if chain:
                self.chains.append(chain)  # appended whole, so one chain's records stay together
            self.handed.extend(runs[:-1])
            return result

        return run

    def settle(self, outcome: SwarmOutcome) -> SwarmOutcome:
        """The outcome with the chains in its details and the handing-over runs' tokens in its totals."""
        if self.chains:
            outcome.details["handoffs"] = [
                {**record.as_json(), "chain": n} for n, chain in enumerate(self.chains) for record in chain
            ]
        outcome.extra_usage = sum((r.usage for r in self.handed), outcome.extra_usage)
        return outcome


def handoff_paths(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The stored handoff records as paths of worker names, one per chain: ``[["a", "b", "a"], ["c", "d"]]``."""
    paths: list[list[str]] = []
    last: object = object()
    for record in records:
        chain = record.get("chain", 0)
        if not paths or chain != last:
            paths.append([str(record.get("from", "?"))])
            last = chain
        paths[-1].append(str(record.get("to", "?")))
    return paths


def _handover(original: Fenced, result: WorkerResult) -> Fenced:
    """What the target sees: the original context, then what the source passed on, fenced as data."""
    passed = [f"reason: {result.handoff_reason}"] if result.handoff_reason else []
    if result.handoff_task:
        passed.append(f"task as restated: {result.handoff_task}")
    if result.handoff_context:
        passed.append(f"context: {result.handoff_context}")
    if result.output:
        passed.append(f"note: {result.output}")
    fenced = fence_untrusted("\n".join(passed), source=f"{result.worker}, handing over")
    return join_fenced([original, fenced], "\n\n")


async def _with_handoffs(
    call: Call,
    worker: Worker,
    prompt: str,
    original: Fenced,
    by_name: Mapping[str, Worker],
    results: list[WorkerResult],
    chain: list[HandoffRecord],
) -> WorkerResult:
    visits: Counter[str] = Counter()
    depth0 = len(chain)
    current, context = worker, original
    label = current_step()
    while True:
        visits[current.name] += 1
        depth = len(chain) - depth0 + 1  # this run's place in the chain (1 = the first)

        def refusal(target: str, source: str = current.name, at: int = depth) -> str | None:
            return _handoff_refusal(source, target, at, visits, by_name)

        offer = HandoffOffer(current.name, tuple(n for n in by_name if n != current.name), refusal)
        here = label if depth == 1 else f"{label + ', ' if label else ''}handoff from {chain[-1].source}"
        with offering(offer), step_named(here):
            result = await call(current, prompt, context)
        results.append(result)
        target = result.handoff_to
        if not result.ok or target is None:
            return result
        why = refusal(target)
        if why is None:
            chain.append(
                HandoffRecord(current.name, target, result.handoff_reason, result.handoff_context, result.handoff_task)
            )
            HANDOFFS.labels(outcome="accepted").inc()
            log.info("swarm.handoff", source=current.name, target=target, depth=depth, reason=result.handoff_reason)
            if failpoints.armed:  # the handoff accepted, its target not called yet: its call fails as a model's
                try:
                    await failpoints.reached("swarm.handoff", _handoff_failure)
                except ModelError as exc:
                    failed = WorkerResult(target, False, error=f"ModelError: {exc}", error_kind=ErrorKind.TRANSIENT)
                    results.append(failed)
                    return failed
            context = _handover(original, result)
            current = by_name[target]
            continue
        HANDOFFS.labels(outcome="refused").inc()
        log.info("swarm.handoff_refused", worker=current.name, target=target, reason=why)
        # the refusal is answered to the model, which gets one chance to finish the task itself; the refusal is
        # Kazma's own words (no worker text in it), so it goes with the task, and the context stays as it was
        named = target if target in by_name else "that worker"
        retry_prompt = f"{prompt}\n\nYour handoff to {named} was refused: {why}. Finish the task yourself."
        with offering(None), step_named(f"{label + ', ' if label else ''}after a refused handoff"):
            retry = await call(current, retry_prompt, context)
        results.append(retry)
        if retry.ok and retry.handoff_to is not None:
            failed = WorkerResult(current.name, False, error=f"handoff refused: {why}", error_kind=ErrorKind.PERMANENT)
            results.append(failed)
            return failed
        return retry


def _handoff_failure() -> BaseException:
    return ModelError("the model's server closed the connection (failpoint)", permanent=False)


def _handoff_refusal(
    source: str, target: str, depth: int, visits: Counter[str], by_name: Mapping[str, Worker]
) -> str | None:
    if target == source:
        return "a worker cannot hand a task to itself"
    if target not in by_name:
        return f"there is no such worker (workers: {', '.join(by_name) or 'none'})"
    if depth >= MAX_HANDOFF_DEPTH:
        return f"the chain is {depth} runs deep; at most {MAX_HANDOFF_DEPTH - 1} handoffs are allowed"
    if visits[target] >= MAX_VISITS:
        return f"{target} already had this task {MAX_VISITS} times"
    return None


async def broadcast(
    call: Call,
    workers: Sequence[Worker],
    prompt: str,
    *,
    concurrency: int = 5,
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    handoffs = Handoffs(by_name or {})
    results = await _parallel(handoffs.call(call), workers, prompt, concurrency)
    return handoffs.settle(SwarmOutcome(_status(results), _labelled(results), results))


async def fan_out(
    call: Call,
    workers: Sequence[Worker],
    prompt: str,
    *,
    aggregation: Aggregation = Aggregation.COLLECT,
    concurrency: int = 5,
    synthesizer: Synthesizer | None = None,
    chooser: Chooser | None = None,
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    handoffs = Handoffs(by_name or {})
    results = await _parallel(handoffs.call(call), workers, prompt, concurrency)
    answer = await aggregate_with_usage(aggregation, prompt, results, synthesizer, chooser)
    return handoffs.settle(
        SwarmOutcome(
            _status(results), answer.text, results, {"aggregation": aggregation.value}, extra_usage=answer.usage
        )
    )


async def consult(
    call: Call,
    workers: Sequence[Worker],
    question: str,
    *,
    synthesizer: Synthesizer | None,
    concurrency: int = 5,
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    handoffs = Handoffs(by_name or {})
    results = await _parallel(handoffs.call(call), workers, question, concurrency)
    answer = await aggregate_with_usage(Aggregation.SYNTHESIZE, question, results, synthesizer)
    return handoffs.settle(
        SwarmOutcome(
            _status(results), answer.text, results, {"synthesized": synthesizer is not None}, extra_usage=answer.usage
        )
    )


async def conditional(
    call: Call,
    route: Callable[[str], Awaitable[str]],
    routes: Mapping[str, Worker],
    prompt: str,
    *,
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    branch = await route(prompt)
    worker = routes.get(branch)
    if worker is None:
        known = ", ".join(sorted(routes))
        return SwarmOutcome(
            TaskStatus.FAILED, f"the router chose {branch!r}, which is not a branch ({known})", [], {"branch": branch}
        )
    handoffs = Handoffs(by_name or {})
    with step_named(f"branch {branch}"):
        result = await handoffs.call(call)(worker, prompt, NOTHING)
    return handoffs.settle(
        SwarmOutcome(
            TaskStatus.SUCCEEDED if result.ok else TaskStatus.FAILED,
            result.output if result.ok else result.error,
            [result],
            {"branch": branch},
        )
    )


def router_prompt(prompt: str, branches: Sequence[str]) -> str:
    return f"Choose the branch for this task. Answer with exactly one of: {', '.join(branches)}.\n\nTask:\n{prompt}"


async def routed(
    call: Call,
    router: Worker,
    routes: Mapping[str, Worker],
    prompt: str,
    *,
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    """``conditional`` with a worker as the router: its answer names the branch; both results are kept.

    The router only names a branch: it is not offered a handoff. The branch's worker is.
    """
    with step_named("router"):
        decision = await call(router, router_prompt(prompt, list(routes)), NOTHING)
    if not decision.ok:
        return SwarmOutcome(
            TaskStatus.FAILED, f"the router {router.name} failed: {decision.error}", [decision], {"router": router.name}
        )
    answer = decision.output.lower()
    words = _BRANCH_WORD.findall(answer)
    # whole branch-shaped words first; then plain words, so "ok-ish" still names the branch "ok" as it always did
    branch = next((w for w in (*words, *_WORD.findall(answer)) if w in routes), words[0] if words else "")

    async def chosen(_: str) -> str:
        return branch

    outcome = await conditional(call, chosen, routes, prompt, by_name=by_name)
    outcome.results.insert(0, decision)
    outcome.details["router"] = router.name
    outcome.details.setdefault("branch", branch)
    return outcome


Journal = Callable[[int, WorkerResult], Awaitable[None]]
Checkpoint = Callable[[int, WorkerResult], Awaitable[bool]]  # True: go on; False: the pipeline pauses here


async def pipeline(
    call: Call,
    stages: Sequence[Worker],
    prompt: str,
    *,
    done: Sequence[WorkerResult] = (),
    journal: Journal | None = None,
    checkpoint: Checkpoint | None = None,
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    """Ordered stages sharing a blackboard; each sees earlier outputs fenced as untrusted.

    ``done`` holds the journaled results of a resumed run: the pipeline continues
    after the last of them and never runs a journaled stage again. A stage's worker may hand the stage on; the
    answer that ends its chain is the stage's.
    """
    results = list(done)
    handoffs = Handoffs(by_name or {})
    stage_call = handoffs.call(call)
    for index in range(len(results), len(stages)):
        worker = stages[index]
        blackboard = join_fenced(
            fence_untrusted(r.output, source=f"stage {i + 1} ({r.worker})") for i, r in enumerate(results)
        )
        with step_named(f"stage {index + 1}"):
            result = await stage_call(worker, prompt, blackboard)
        results.append(result)
        if journal is not None:
            await journal(index, result)
        if not result.ok:
            return handoffs.settle(
                SwarmOutcome(TaskStatus.FAILED, f"stage {index + 1} ({worker.name}) failed: {result.error}", results)
            )
        if checkpoint is not None and index < len(stages) - 1 and not await checkpoint(index, result):
            return handoffs.settle(
                SwarmOutcome(TaskStatus.PAUSED, f"paused after stage {index + 1} ({worker.name})", results)
            )
    return handoffs.settle(SwarmOutcome(TaskStatus.SUCCEEDED, results[-1].output if results else "", results))


async def _parallel(call: Call, workers: Sequence[Worker], prompt: str, concurrency: int) -> list[WorkerResult]:
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(worker: Worker) -> WorkerResult:
        async with gate:
            try:
                with step_named(worker.name):
                    return await call(worker, prompt, NOTHING)
            except Exception as exc:  # one worker's crash is its own failure, not the fan-out's
                log.warning("swarm.worker_crashed", worker=worker.name, error=f"{type(exc).__name__}: {exc}")
                return WorkerResult(worker.name, False, error=f"{type(exc).__name__}: {exc}")

    return list(await asyncio.gather(*(one(w) for w in workers)))
