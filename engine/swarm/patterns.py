"""The six swarm patterns and the aggregation strategies.

Patterns only orchestrate: every worker call goes through the injected
``call`` (which the swarm service wraps in breakers, retries and timeouts),
so each pattern is plain logic over :class:`WorkerResult`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import structlog

from kazma.engine.swarm.types import ErrorKind, TaskStatus, Worker, WorkerResult
from kazma.engine.tools import fence_untrusted

log = structlog.get_logger("kazma.swarm")

Call = Callable[[Worker, str, str], Awaitable[WorkerResult]]  # (worker, prompt, context)
Synthesizer = Callable[[str, Sequence[WorkerResult]], Awaitable[str]]
MAX_HANDOFF_DEPTH = 5
MAX_VISITS = 2
_WORD = re.compile(r"[a-z0-9]+")


class Aggregation(StrEnum):
    COLLECT = "collect"
    FIRST_VALID = "first_valid"
    MERGE_ALL = "merge_all"
    VOTE = "vote"
    SYNTHESIZE = "synthesize"


class NoCapableWorker(LookupError):
    """``workers=auto`` found nobody whose expertise matches the task."""


@dataclass
class SwarmOutcome:
    status: TaskStatus
    output: str
    results: list[WorkerResult] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


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


async def aggregate(
    strategy: Aggregation, prompt: str, results: Sequence[WorkerResult], synthesizer: Synthesizer | None = None
) -> str:
    ok = [r for r in results if r.ok]
    if strategy is Aggregation.COLLECT:
        return _labelled(results)
    if strategy is Aggregation.FIRST_VALID:
        return ok[0].output if ok else ""
    if strategy is Aggregation.MERGE_ALL:
        return _merge(ok)
    if strategy is Aggregation.VOTE:
        if not ok:
            return ""
        counts = Counter(r.output.strip() for r in ok)
        top = max(counts.values())
        # ties go to the answer that appeared first
        return next(r.output.strip() for r in ok if counts[r.output.strip()] == top)
    if synthesizer is not None and ok:
        try:
            return await synthesizer(prompt, ok)
        except Exception as exc:
            log.warning("swarm.synthesis_failed", error=str(exc))
    return _labelled(results)  # the deterministic fallback


def _merge(results: Sequence[WorkerResult]) -> str:
    """JSON objects are merged key by key (later workers fill gaps, never overwrite); other text is joined."""
    merged: dict[str, Any] = {}
    texts: list[str] = []
    for result in results:
        try:
            value = json.loads(result.output)
        except ValueError:
            value = None
        if isinstance(value, dict):
            for key, item in value.items():
                merged.setdefault(key, item)
        else:
            texts.append(result.output)
    parts = ([json.dumps(merged, sort_keys=True)] if merged else []) + texts
    return "\n\n".join(parts)


async def dispatch(
    call: Call,
    worker: Worker,
    prompt: str,
    *,
    fallbacks: Sequence[Worker] = (),
    by_name: Mapping[str, Worker] | None = None,
) -> SwarmOutcome:
    """One worker; on failure the fallback chain in order; handoffs followed within bounds."""
    results: list[WorkerResult] = []
    for candidate in (worker, *fallbacks):
        result = await _with_handoffs(call, candidate, prompt, by_name or {}, results)
        if result.ok or result.changed_state:
            break  # a result that changed something is never tried again elsewhere
    final = results[-1]
    return SwarmOutcome(
        TaskStatus.SUCCEEDED if final.ok else TaskStatus.FAILED,
        final.output if final.ok else final.error,
        results,
        {"worker": final.worker},
    )


async def _with_handoffs(
    call: Call, worker: Worker, prompt: str, by_name: Mapping[str, Worker], results: list[WorkerResult]
) -> WorkerResult:
    visits: Counter[str] = Counter()
    current, context, depth = worker, "", 0
    while True:
        visits[current.name] += 1
        result = await call(current, prompt, context)
        results.append(result)
        target = result.handoff_to
        if not result.ok or target is None:
            return result
        refusal = _handoff_refusal(target, depth, visits, by_name)
        if refusal is None:
            depth += 1
            context = fence_untrusted(result.output, source=f"{current.name}, handing over")
            current = by_name[target]
            continue
        log.info("swarm.handoff_refused", worker=current.name, target=target, reason=refusal)
        # the refusal is answered to the model, which gets one chance to finish the task itself
        retry = await call(
            current, prompt, f"Your handoff to {target} was refused: {refusal}. Finish the task yourself."
        )
        results.append(retry)
        if retry.ok and retry.handoff_to is not None:
            failed = WorkerResult(
                current.name, False, error=f"handoff refused: {refusal}", error_kind=ErrorKind.PERMANENT
            )
            results.append(failed)
            return failed
        return retry


def _handoff_refusal(target: str, depth: int, visits: Counter[str], by_name: Mapping[str, Worker]) -> str | None:
    if target not in by_name:
        return f"there is no worker named {target!r}"
    if depth + 1 > MAX_HANDOFF_DEPTH:
        return f"the task was already handed over {MAX_HANDOFF_DEPTH} times"
    if visits[target] >= MAX_VISITS:
        return f"{target} already had this task {MAX_VISITS} times"
    return None


async def broadcast(call: Call, workers: Sequence[Worker], prompt: str, *, concurrency: int = 8) -> SwarmOutcome:
    results = await _parallel(call, workers, prompt, concurrency)
    return SwarmOutcome(_status(results), _labelled(results), results)


async def fan_out(
    call: Call,
    workers: Sequence[Worker],
    prompt: str,
    *,
    aggregation: Aggregation = Aggregation.COLLECT,
    concurrency: int = 8,
    synthesizer: Synthesizer | None = None,
) -> SwarmOutcome:
    results = await _parallel(call, workers, prompt, concurrency)
    output = await aggregate(aggregation, prompt, results, synthesizer)
    return SwarmOutcome(_status(results), output, results, {"aggregation": aggregation.value})


async def consult(
    call: Call, workers: Sequence[Worker], question: str, *, synthesizer: Synthesizer | None, concurrency: int = 8
) -> SwarmOutcome:
    results = await _parallel(call, workers, question, concurrency)
    output = await aggregate(Aggregation.SYNTHESIZE, question, results, synthesizer)
    return SwarmOutcome(_status(results), output, results, {"synthesized": synthesizer is not None})


async def conditional(
    call: Call, route: Callable[[str], Awaitable[str]], routes: Mapping[str, Worker], prompt: str
) -> SwarmOutcome:
    branch = await route(prompt)
    worker = routes.get(branch)
    if worker is None:
        known = ", ".join(sorted(routes))
        return SwarmOutcome(TaskStatus.FAILED, f"the router chose {branch!r}, which is not a branch ({known})")
    result = await call(worker, prompt, "")
    return SwarmOutcome(
        TaskStatus.SUCCEEDED if result.ok else TaskStatus.FAILED,
        result.output if result.ok else result.error,
        [result],
        {"branch": branch},
    )


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
) -> SwarmOutcome:
    """Ordered stages sharing a blackboard; each sees earlier outputs fenced as untrusted.

    ``done`` holds the journaled results of a resumed run: the pipeline continues
    after the last of them and never runs a journaled stage again.
    """
    results = list(done)
    for index in range(len(results), len(stages)):
        worker = stages[index]
        blackboard = "\n".join(
            fence_untrusted(r.output, source=f"stage {i + 1} ({r.worker})") for i, r in enumerate(results)
        )
        result = await call(worker, prompt, blackboard)
        results.append(result)
        if journal is not None:
            await journal(index, result)
        if not result.ok:
            return SwarmOutcome(TaskStatus.FAILED, f"stage {index + 1} ({worker.name}) failed: {result.error}", results)
        if checkpoint is not None and index < len(stages) - 1 and not await checkpoint(index, result):
            return SwarmOutcome(TaskStatus.PAUSED, f"paused after stage {index + 1} ({worker.name})", results)
    return SwarmOutcome(TaskStatus.SUCCEEDED, results[-1].output if results else "", results)


async def _parallel(call: Call, workers: Sequence[Worker], prompt: str, concurrency: int) -> list[WorkerResult]:
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(worker: Worker) -> WorkerResult:
        async with gate:
            try:
                return await call(worker, prompt, "")
            except Exception as exc:  # one worker's crash is its own failure, not the fan-out's
                return WorkerResult(worker.name, False, error=f"{type(exc).__name__}: {exc}")

    return list(await asyncio.gather(*(one(w) for w in workers)))
