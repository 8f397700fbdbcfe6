from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from kazma.engine.fence import Fenced
from kazma.engine.swarm.patterns import (
    MAX_HANDOFF_DEPTH,
    Aggregation,
    NoCapableWorker,
    aggregate,
    broadcast,
    conditional,
    consult,
    dispatch,
    fan_out,
    parse_aggregation,
    pipeline,
    route_auto,
)
from kazma.engine.swarm.types import ErrorKind, TaskStatus, Worker, WorkerResult
from tests.swarm_support import ScriptedWorker


async def call(worker: Worker, prompt: str, context: Fenced) -> WorkerResult:
    return await worker.run(prompt, context=context)


def ok(name: str, output: str) -> WorkerResult:
    return WorkerResult(name, True, output=output)


def fail(name: str, kind: ErrorKind = ErrorKind.TRANSIENT, changed: bool = False) -> WorkerResult:
    return WorkerResult(name, False, error=f"{name} broke", error_kind=kind, changed_state=changed)


async def test_dispatch_and_fallback_chain() -> None:
    a = ScriptedWorker("a", [fail("a")])
    b = ScriptedWorker("b", [ok("b", "from b")])
    outcome = await dispatch(call, a, "task", fallbacks=[b])
    assert (outcome.status, outcome.output) == (TaskStatus.SUCCEEDED, "from b")
    assert [r.worker for r in outcome.results] == ["a", "b"]


async def test_a_result_that_changed_state_is_not_tried_elsewhere() -> None:
    a = ScriptedWorker("a", [fail("a", changed=True)])
    b = ScriptedWorker("b")
    outcome = await dispatch(call, a, "task", fallbacks=[b])
    assert outcome.status is TaskStatus.FAILED
    assert b.seen == []


async def test_handoff_followed_and_bounded() -> None:
    a = ScriptedWorker("a", [WorkerResult("a", True, output="over to b", handoff_to="b")])
    b = ScriptedWorker("b", [ok("b", "done by b")])
    outcome = await dispatch(call, a, "task", by_name={"a": a, "b": b})
    assert outcome.output == "done by b"
    assert "over to b" in b.seen[0][1]  # the handover note reaches b as fenced context
    assert "Untrusted data from a, handing over" in b.seen[0][1]


async def test_handoff_loops_stop_at_two_visits_and_refusals_reach_the_model() -> None:
    def bounce(to: str) -> Callable[[str, str], WorkerResult]:
        return lambda prompt, context: WorkerResult(to.upper(), True, output="bounce", handoff_to=to)

    a = ScriptedWorker("a", [bounce("b"), bounce("b")])
    b = ScriptedWorker("b", [bounce("a"), bounce("a"), ok("b", "b finished")])
    outcome = await dispatch(call, a, "task", by_name={"a": a, "b": b})
    assert (outcome.status, outcome.output) == (TaskStatus.SUCCEEDED, "b finished")
    assert (len(a.seen), len(b.seen)) == (2, 3)
    # the refusal is Kazma's own sentence, sent with the task; the context b had is kept as it was
    refused = [(prompt, ctx) for prompt, ctx in b.seen if "refused" in prompt]
    assert [prompt for prompt, _ in refused] == [
        "task\n\nYour handoff to a was refused: a already had this task 2 times. Finish the task yourself."
    ]
    assert ", handing over" in refused[0][1]


async def test_a_worker_that_insists_on_a_refused_handoff_fails() -> None:
    bounce = WorkerResult("a", True, output="x", handoff_to="ghost")
    outcome = await dispatch(call, ScriptedWorker("a", [bounce, bounce]), "task", by_name={})
    assert outcome.status is TaskStatus.FAILED
    assert outcome.output == "handoff refused: there is no such worker (workers: none)"


async def test_handoff_depth_limit() -> None:
    names = [f"w{i}" for i in range(MAX_HANDOFF_DEPTH + 3)]
    workers = {
        n: ScriptedWorker(
            n, [WorkerResult(n, True, output="next", handoff_to=names[i + 1])] if i + 1 < len(names) else []
        )
        for i, n in enumerate(names)
    }
    outcome = await dispatch(call, workers["w0"], "task", by_name=dict(workers.items()))
    visited = [r.worker for r in outcome.results]
    # the run at depth 5 may not hand off: four handoffs, five workers, and the fifth finishes itself
    assert len({w for w in visited}) == MAX_HANDOFF_DEPTH
    assert workers[names[MAX_HANDOFF_DEPTH]].seen == []


async def test_unknown_handoff_target_is_refused_to_the_model() -> None:
    a = ScriptedWorker("a", [WorkerResult("a", True, output="x", handoff_to="ghost"), ok("a", "myself")])
    outcome = await dispatch(call, a, "task", by_name={"a": a})
    assert outcome.output == "myself"
    assert "Your handoff to that worker was refused: there is no such worker (workers: a)" in a.seen[1][0]
    assert "ghost" not in a.seen[1][0]  # a name the model made up is not repeated back to it as an instruction


async def test_broadcast_reaches_every_worker() -> None:
    workers = [ScriptedWorker(n) for n in ("a", "b", "c")]
    outcome = await broadcast(call, workers, "hello")
    assert outcome.status is TaskStatus.SUCCEEDED
    assert all(w.seen == [("hello", "")] for w in workers)


async def test_fan_out_bounded_concurrency() -> None:
    gate = asyncio.Event()
    workers = [ScriptedWorker(f"w{i}", gate=gate) for i in range(6)]
    task = asyncio.create_task(fan_out(call, workers, "p", concurrency=2))
    while sum(1 for w in workers if w.seen) < 2:
        await asyncio.sleep(0)
    for _ in range(20):  # give any over-eager worker the chance to start
        await asyncio.sleep(0)
    assert sum(1 for w in workers if w.seen) == 2
    gate.set()
    outcome = await task
    assert outcome.status is TaskStatus.SUCCEEDED


@pytest.mark.parametrize(
    ("replies", "status"),
    [
        ([ok("a", "1"), ok("b", "2")], TaskStatus.SUCCEEDED),
        ([ok("a", "1"), fail("b")], TaskStatus.PARTIAL),
        ([fail("a"), fail("b")], TaskStatus.FAILED),
    ],
)
async def test_fan_out_status(replies: list[WorkerResult], status: TaskStatus) -> None:
    workers = [ScriptedWorker(r.worker, [r]) for r in replies]
    assert (await fan_out(call, workers, "p")).status is status


async def test_a_crashing_worker_is_its_own_failure() -> None:
    def crash(prompt: str, context: str) -> WorkerResult:
        raise RuntimeError("kaput")

    outcome = await fan_out(call, [ScriptedWorker("a", [crash]), ScriptedWorker("b")], "p")
    assert outcome.status is TaskStatus.PARTIAL
    assert "RuntimeError: kaput" in outcome.results[0].error


async def test_every_aggregation_strategy() -> None:
    results = [ok("a", "yes"), fail("b"), ok("c", "no"), ok("d", "no"), ok("e", "yes")]
    labelled = "[a] yes\n\n[b] failed: b broke\n\n[c] no\n\n[d] no\n\n[e] yes"
    # collect keeps metadata only: the answers themselves stay in the task record
    assert await aggregate(Aggregation.COLLECT, "q", results) == (
        "[a] ok, 3 characters\n[b] failed: b broke\n[c] ok, 2 characters\n[d] ok, 2 characters\n[e] ok, 3 characters"
    )
    assert await aggregate(Aggregation.FIRST_VALID, "q", results) == "yes"
    assert await aggregate(Aggregation.VOTE, "q", results) == "yes"  # 2-2 tie: first appearance wins
    assert await aggregate(Aggregation.VOTE, "q", [ok("a", "x"), ok("b", "y"), ok("c", "y")]) == "y"
    merged = await aggregate(
        Aggregation.MERGE_ALL, "q", [ok("a", '{"k": 1}'), ok("b", '{"k": 2, "j": 3}'), ok("c", "t")]
    )
    assert merged == '[a] {"k": 1}\n\n[b] {"k": 2, "j": 3}\n\n[c] t'

    async def synth(prompt: str, rs: Sequence[WorkerResult]) -> str:
        return f"{prompt}: " + "+".join(r.output for r in rs)

    assert await aggregate(Aggregation.SYNTHESIZE, "q", results, synth) == "q: yes+no+no+yes"

    async def broken(prompt: str, rs: Sequence[WorkerResult]) -> str:
        raise TimeoutError("model down")

    fallback = await aggregate(Aggregation.SYNTHESIZE, "q", results, broken)
    assert fallback == labelled
    with pytest.raises(ValueError, match="unknown aggregation strategy 'average'"):
        parse_aggregation("average")


async def test_consult_synthesizes_opinions() -> None:
    async def synth(prompt: str, rs: Sequence[WorkerResult]) -> str:
        return "synthesis of " + ", ".join(r.worker for r in rs)

    outcome = await consult(call, [ScriptedWorker("a"), ScriptedWorker("b")], "which db?", synthesizer=synth)
    assert outcome.output == "synthesis of a, b"


async def test_conditional_picks_one_branch() -> None:
    a, b = ScriptedWorker("a"), ScriptedWorker("b")

    async def router(prompt: str) -> str:
        return "billing" if "invoice" in prompt else "tech"

    outcome = await conditional(call, router, {"billing": a, "tech": b}, "an invoice question")
    assert outcome.details == {"branch": "billing"}
    assert a.seen
    assert not b.seen

    async def lost(prompt: str) -> str:
        return "sales"

    missing = await conditional(call, lost, {"billing": a}, "x")
    assert missing.status is TaskStatus.FAILED
    assert "not a branch" in missing.output


async def test_pipeline_blackboard_is_fenced_and_resumes_after_the_journal() -> None:
    a, b, c = ScriptedWorker("a", [ok("a", "A-out")]), ScriptedWorker("b", [ok("b", "B-out")]), ScriptedWorker("c")
    journal: list[tuple[int, str]] = []

    async def record(index: int, result: WorkerResult) -> None:
        journal.append((index, result.worker))

    paused_at: list[int] = []

    async def checkpoint(index: int, result: WorkerResult) -> bool:
        paused_at.append(index)
        return index != 1  # pause after the second stage

    outcome = await pipeline(call, [a, b, c], "p", journal=record, checkpoint=checkpoint)
    assert outcome.status is TaskStatus.PAUSED
    assert journal == [(0, "a"), (1, "b")]
    assert "Untrusted data from stage 1 (a)" in b.seen[0][1]
    assert "A-out" in b.seen[0][1]
    assert c.seen == []
    resumed = await pipeline(call, [a, b, c], "p", done=outcome.results, journal=record)
    assert resumed.status is TaskStatus.SUCCEEDED
    assert len(a.seen) == 1  # journaled stages never run again
    assert len(b.seen) == 1
    assert "B-out" in c.seen[0][1]


async def test_pipeline_stops_at_a_failed_stage() -> None:
    outcome = await pipeline(call, [ScriptedWorker("a", [fail("a")]), ScriptedWorker("b")], "p")
    assert outcome.status is TaskStatus.FAILED
    assert outcome.output == "stage 1 (a) failed: a broke"


def test_auto_routing_by_expertise() -> None:
    workers = [
        ScriptedWorker("researcher", expertise=("research", "sources")),
        ScriptedWorker("builder", expertise=("code", "build", "script")),
    ]
    assert route_auto("please build a deploy script", workers).name == "builder"
    assert route_auto("find sources on X", workers).name == "researcher"
    with pytest.raises(NoCapableWorker, match="no worker's expertise matches"):
        route_auto("bake a cake", workers)


async def test_best_takes_the_answer_the_model_names_and_falls_back_to_the_first_valid() -> None:
    results = [fail("a"), ok("b", "short"), ok("c", "the careful one")]

    async def choose(prompt: str, rs: Sequence[WorkerResult]) -> str:
        assert [r.worker for r in rs] == ["b", "c"]  # only answers that succeeded are judged
        return " C "

    assert await aggregate(Aggregation.BEST, "q", results, chooser=choose) == "the careful one"

    async def broken(prompt: str, rs: Sequence[WorkerResult]) -> str:
        raise TimeoutError("model down")

    async def nonsense(prompt: str, rs: Sequence[WorkerResult]) -> str:
        return "nobody"

    assert await aggregate(Aggregation.BEST, "q", results, chooser=broken) == "short"
    assert await aggregate(Aggregation.BEST, "q", results, chooser=nonsense) == "short"
    assert parse_aggregation("best") is Aggregation.BEST
