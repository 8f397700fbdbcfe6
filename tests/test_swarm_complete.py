"""Issue 14: handoffs between real agent workers, every pattern from /swarm, deadlines, shutdown, failures answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiosqlite
from prometheus_client import REGISTRY

from kazma.approvals import SafetyPolicy
from kazma.bot.console.dashboard_data import DashboardData
from kazma.bot.console.pages import dashboard_page
from kazma.config import KazmaConfig, load_config_text
from kazma.config.store.database import connect, open_database
from kazma.engine.agent import AgentRunner, AgentSpec, TurnContext
from kazma.engine.history import MIGRATIONS as HISTORY
from kazma.engine.history import HistoryStore
from kazma.engine.model import ScriptedProvider, ScriptStep
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.patterns import Synthesis
from kazma.engine.swarm.reliability import BreakerState
from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.service import STORE_UNAVAILABLE, SwarmService
from kazma.engine.swarm.state_store import MIGRATIONS as STATE
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore, TaskRecord
from kazma.engine.swarm.types import ErrorKind, TaskStatus, Worker, WorkerResult
from kazma.engine.swarm.workers import HANDOFF_TOOL, AgentWorker
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.executions import ExecutionSummary
from kazma.engine.types import Message, ModelReply, ToolCall, Usage
from tests.approvals_support import approval_service
from tests.fakes.openai import FakeOpenAI
from tests.swarm_support import ScriptedWorker

CONFIG = """
approvals: {approvers: ["telegram:111"], deadline_seconds: 600}
platforms: {telegram: {admins: [111]}}
agents:
  workers:
    a: {system_prompt: "You are a.", expertise: [alpha]}
    b: {system_prompt: "You are b.", expertise: [beta]}
    c: {system_prompt: "You are c."}
    d: {system_prompt: "You are d."}
    e: {system_prompt: "You are e."}
    router: {system_prompt: "You route."}
pipelines: {}
swarm:
  max_parallel: 4
  schemas: {verdict: {type: object, required: [ok], properties: {ok: {type: boolean}}}}
  workers: {b: {breaker_threshold: 1, breaker_cooldown_seconds: 600, retries: 0}}
  prompt_price_per_thousand: 1.0
"""


def config(extra: str = "") -> KazmaConfig:
    return load_config_text(CONFIG + extra).config


def sample(name: str, labels: Mapping[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, dict(labels or {})) or 0.0


async def no_sleep(_: float) -> None:
    return


@dataclass(frozen=True)
class Looker:
    login: str = "admin"
    role: str = "operator"
    csrf: str = "csrf"
    is_operator: bool = True
    may_decide: bool = True

    def may_decide_under(self, policy: str | None) -> bool:
        return self.may_decide

    proven: bool = True
    who: str = "admin (web:admin, passkey)"


@dataclass
class Rig:
    service: SwarmService
    commands: SwarmCommands
    conn: aiosqlite.Connection


@asynccontextmanager
async def rig(path: Path, workers: Mapping[str, Worker], cfg: KazmaConfig | None = None) -> AsyncIterator[Rig]:
    cfg = cfg or config()
    conn = await open_database(path, migrations=[*MIGRATIONS, *STATE], busy_timeout_ms=50)
    service = SwarmService(SwarmTaskStore(conn), workers, cfg, state=SwarmStateStore(conn), sleep=no_sleep)
    try:
        yield Rig(service, SwarmCommands(service, cfg), conn)
    finally:
        await service.close()
        await conn.close()


async def ended(service: SwarmService, answer: str) -> TaskRecord:
    assert answer.startswith("swarm task "), answer
    record = await service.wait(answer.split()[2], 30)
    assert record is not None
    return record


async def send(r: Rig, text: str) -> str:
    return await r.commands.run(text, actor="telegram:111", platform="telegram", chat="-1001", is_admin=True)


# -- handoffs between agent workers -------------------------------------------------------------


def handoff(to: str, reason: str) -> ModelReply:
    args = {"worker": to, "reason": reason, "context": f"notes for {to}"}
    return ModelReply(None, (ToolCall(f"h-{to}", HANDOFF_TOOL, args, json.dumps(args)),), usage=Usage(10, 2))


def say(text: str) -> ModelReply:
    return ModelReply(text, usage=Usage(3, 1))


@asynccontextmanager
async def agent_workers(
    tmp_path: Path, names: Sequence[str], script: list[ScriptStep]
) -> AsyncIterator[tuple[dict[str, Worker], ScriptedProvider, AgentRunner]]:
    provider = ScriptedProvider(script)
    conn = await open_database(tmp_path / "h.db", migrations=HISTORY)
    async with approval_service(tmp_path / "ap.db") as approvals:
        runner = AgentRunner(
            provider, default_registry(), SafetyPolicy(approvals), HistoryStore(conn), workspace_root=tmp_path / "w"
        )
        workers: dict[str, Worker] = {n: AgentWorker(AgentSpec(n, f"You are {n}."), runner, "swarm") for n in names}
        try:
            yield workers, provider, runner
        finally:
            await conn.close()


def offered(provider: ScriptedProvider, index: int) -> list[str]:
    tools = [t for t in provider.requests[index].tools if t.name == HANDOFF_TOOL]
    return list(tools[0].parameters["properties"]["worker"]["enum"]) if tools else []


def tool_answers(messages: Sequence[Message]) -> list[str]:
    return [str(m["content"]) for m in messages if m["role"] == "tool"]


async def test_a_b_a_b_is_allowed_then_a_third_visit_is_refused_to_the_model(tmp_path: Path) -> None:
    accepted = sample("kazma_swarm_handoffs_total", {"outcome": "accepted"})
    refused = sample("kazma_swarm_handoffs_total", {"outcome": "refused"})
    script: list[ScriptStep] = [
        handoff("b", "b knows beta"),
        say("over to b"),
        handoff("a", "back to a"),
        say("over to a"),
        handoff("b", "b again"),
        say("over to b once more"),
        handoff("a", "a a third time"),  # refused: a already ran twice
        say("b finished it"),
    ]
    async with (
        agent_workers(tmp_path, ["a", "b", "c"], script) as (workers, provider, _),
        rig(tmp_path / "s.db", workers) as r,
    ):
        record = await ended(r.service, await send(r, "dispatch a handle the alpha beta job"))
        assert record.status is TaskStatus.SUCCEEDED
        assert record.result is not None
        assert record.result["output"] == "b finished it"
        chain = record.result["details"]["handoffs"]
        assert [(h["from"], h["to"]) for h in chain] == [("a", "b"), ("b", "a"), ("a", "b")]
        assert chain[0]["reason"] == "b knows beta"
        assert chain[0]["context"] == "notes for b"
        # every run's tokens count, the handing-over ones included: 3 handoff runs + the last, 2 calls each
        assert record.result["tokens"] == {"prompt": 4 * (10 + 3), "completion": 4 * (2 + 1)}
        # the tool lists who the worker may hand to, never itself
        assert offered(provider, 0) == ["b", "c"]
        assert offered(provider, 2) == ["a", "c"]
        # the target saw the original prompt and the passed context fenced as data
        second_user = provider.requests[2].messages[-1]["content"]
        assert second_user.startswith("handle the alpha beta job")
        assert "Untrusted data from a, handing over" in second_user
        assert "notes for b" in second_user
        # the refusal was answered to the model, which then finished itself
        (answer,) = tool_answers(provider.requests[7].messages)
        assert answer == "Error: handoff refused: a already had this task 2 times. Finish the task yourself."
        page = dashboard_page(Looker(), DashboardData([record], [], [], {"succeeded": 1}))
        assert "handoffs: a → b → a → b" in page
        assert "handoffs: a → b → a → b" in await send(r, f"status {record.id}")
        assert "b knows beta" in page
    assert sample("kazma_swarm_handoffs_total", {"outcome": "accepted"}) == accepted + 3
    assert sample("kazma_swarm_handoffs_total", {"outcome": "refused"}) == refused + 1


async def test_a_chain_of_five_handoffs_stops_at_four(tmp_path: Path) -> None:
    names = ["a", "b", "c", "d", "e"]
    script: list[ScriptStep] = []
    for nxt in [*names[1:], "a"]:
        script += [handoff(nxt, f"to {nxt}"), say(f"over to {nxt}")]
    async with (
        agent_workers(tmp_path, names, script) as (workers, provider, _),
        rig(tmp_path / "s.db", workers) as r,
    ):
        record = await ended(r.service, await send(r, "dispatch a pass it along"))
        assert record.result is not None
        assert [h["to"] for h in record.result["details"]["handoffs"]] == ["b", "c", "d", "e"]
        assert record.result["output"] == "over to a"  # e's own answer after its fifth-level handoff was refused
        (answer,) = tool_answers(provider.requests[-1].messages)
        assert "refused: the chain is 5 runs deep; at most 4 handoffs are allowed" in answer


async def test_the_lead_and_plain_turns_are_never_offered_a_handoff(tmp_path: Path) -> None:
    async with agent_workers(tmp_path, ["a"], [say("hi"), say("hi")]) as (_, provider, runner):
        await runner.run(AgentSpec("kazma", "You lead.", is_lead=True), "c", "hello", requested_by="u")
        await runner.run(AgentSpec("a", "You are a."), "c", "hello", requested_by="u")
        assert all(HANDOFF_TOOL not in [t.name for t in req.tools] for req in provider.requests)


# -- every pattern from /swarm --------------------------------------------------------------------


def answers(name: str, *outputs: str) -> ScriptedWorker:
    return ScriptedWorker(name, [WorkerResult(name, True, output=o, usage=Usage(5, 5)) for o in outputs])


async def test_conditional_runs_the_branch_the_router_names(tmp_path: Path) -> None:
    workers = {"router": answers("router", "docs"), "a": answers("a", "code done"), "b": answers("b", "docs done")}
    async with rig(tmp_path / "s.db", workers) as r:
        record = await ended(r.service, await send(r, "conditional router code=a,docs=b write the manual"))
        assert record.status is TaskStatus.SUCCEEDED
        assert record.result is not None
        assert record.result["output"] == "docs done"
        assert record.result["details"]["branch"] == "docs"
        assert workers["a"].seen == []
        assert workers["b"].seen == [("write the manual", "")]
        assert "code, docs" in workers["router"].seen[0][0]


async def test_fanout_strategy_vote_aggregates_by_vote(tmp_path: Path) -> None:
    workers = {"a": answers("a", "42"), "b": answers("b", "41"), "c": answers("c", "42")}
    async with rig(tmp_path / "s.db", workers) as r:
        record = await ended(r.service, await send(r, "fanout a,b,c --strategy vote what is it"))
        assert record.result is not None
        assert (record.status, record.result["output"], record.result["details"]["aggregation"]) == (
            TaskStatus.SUCCEEDED,
            "42",
            "vote",
        )
        merged = await ended(r.service, await send(r, "fanout a,b --strategy merge_all again"))
        assert merged.result is not None
        assert merged.result["output"] == "[a] a ok\n\n[b] b ok"


async def test_expect_json_fails_an_answer_that_is_not_json(tmp_path: Path) -> None:
    workers = {"a": answers("a", "certainly! here it is"), "b": answers("b", '{"ok": true}', '{"ok": "yes"}')}
    async with rig(tmp_path / "s.db", workers) as r:
        bad = await ended(r.service, await send(r, "dispatch a --expect json give json"))
        assert bad.status is TaskStatus.FAILED
        assert "output is not JSON" in (bad.error or "")
        good = await ended(r.service, await send(r, "dispatch b --expect verdict give json"))
        assert good.status is TaskStatus.SUCCEEDED
        wrong = await ended(r.service, await send(r, "dispatch b --expect verdict give json"))
        assert wrong.status is TaskStatus.FAILED
        assert "$.ok: 'yes' is not of type 'boolean'" in (wrong.error or "")
        assert (await send(r, "dispatch b --expect nosuch x")).startswith("Not started: unknown output schema")


async def test_a_pipeline_whose_second_stage_hangs_ends_timeout_with_stage_one_kept(tmp_path: Path) -> None:
    hang = ScriptedWorker("b", gate=asyncio.Event())  # never set: the stage hangs
    workers = {"a": answers("a", "stage one"), "b": hang}
    async with rig(tmp_path / "s.db", workers) as r:
        record = await ended(r.service, await send(r, "pipeline a,b --deadline 1 build it"))
        assert record.status is TaskStatus.TIMEOUT
        assert record.result is not None
        assert [(w["worker"], w["ok"], w["output"]) for w in record.result["workers"]] == [("a", True, "stage one")]
        assert record.result["tokens"] == {"prompt": 5, "completion": 5}
        assert "deadline of 1 s passed" in (record.error or "")


async def test_the_configured_task_deadline_applies_without_an_option(tmp_path: Path) -> None:
    workers = {"a": ScriptedWorker("a", gate=asyncio.Event())}
    async with rig(tmp_path / "s.db", workers, config("  task_deadline_seconds: 1\n")) as r:
        record = await ended(r.service, await send(r, "dispatch a wait forever"))
        assert record.status is TaskStatus.TIMEOUT


# -- clean shutdown and an unavailable store -----------------------------------------------------


async def test_a_clean_close_cancels_running_tasks_as_shutdown_and_recovery_finds_nothing(tmp_path: Path) -> None:
    gate = asyncio.Event()
    workers = {"a": ScriptedWorker("a", gate=gate)}
    async with rig(tmp_path / "s.db", workers) as r:
        answer = await send(r, "dispatch a take your time")
        task_id = answer.split()[2]
        while not workers["a"].seen:
            await asyncio.sleep(0.01)
        await r.service.close()
        record = await r.service.store.get(task_id)
        assert record is not None
        assert record.status is TaskStatus.CANCELLED
        assert record.result == {"interrupted_by": "shutdown", "execution": ExecutionSummary().as_json()}
        assert await r.service.store.recover() == []


async def test_a_locked_store_answers_the_person_and_starts_nothing_until_sent_again(tmp_path: Path) -> None:
    before = sample("kazma_swarm_failures_total", {"site": "running_row"})
    workers = {"a": answers("a", "done")}
    async with rig(tmp_path / "s.db", workers) as r:
        locker = await connect(tmp_path / "s.db", busy_timeout_ms=10)
        try:
            await locker.execute("BEGIN IMMEDIATE")
            answer = await send(r, "dispatch a do it")
            assert answer == f"Not started: {STORE_UNAVAILABLE}"
            await locker.execute("ROLLBACK")
        finally:
            await locker.close()
        assert await r.service.store.list() == []
        assert workers["a"].seen == []
        record = await ended(r.service, await send(r, "dispatch a do it"))
        assert record.status is TaskStatus.SUCCEEDED
        assert len(await r.service.store.list()) == 1
        assert workers["a"].seen == [("do it", "")]
    assert sample("kazma_swarm_failures_total", {"site": "running_row"}) == before + 1


# -- breakers and numbers -------------------------------------------------------------------------


def breaker_state(r: Rig, worker: str) -> BreakerState:
    return r.service.breakers[worker].state


async def test_an_open_breaker_stays_open_across_a_restart_until_reset(tmp_path: Path) -> None:
    failing = WorkerResult("b", False, error="upstream 503", error_kind=ErrorKind.TRANSIENT)
    path = tmp_path / "s.db"
    async with rig(path, {"b": ScriptedWorker("b", [failing])}) as r:
        record = await ended(r.service, await send(r, "dispatch b try"))
        assert record.status is TaskStatus.FAILED
        assert r.service.breakers["b"].state is BreakerState.OPEN  # threshold 1, no retries: from kazma.yaml
    fresh = ScriptedWorker("b")
    async with rig(path, {"b": fresh}) as r:
        assert breaker_state(r, "b") is BreakerState.CLOSED  # before the restore
        lines = await r.service.recover()
        assert any("b is still resting" in line for line in lines)
        assert breaker_state(r, "b") is BreakerState.OPEN
        refused = await ended(r.service, await send(r, "dispatch b try again"))
        assert "circuit open" in (refused.error or "")
        assert fresh.seen == []
        reader = await r.commands.run(
            "breaker reset b", actor="telegram:999", platform="telegram", chat="-1001", is_admin=False
        )
        assert "needs a telegram admin" in reader
        assert (await send(r, "breaker reset b")).startswith("b's breaker is closed (it was open)")
    async with rig(path, {"b": ScriptedWorker("b")}) as r:
        await r.service.recover()
        assert r.service.breakers["b"].state is BreakerState.CLOSED
        assert (await ended(r.service, await send(r, "dispatch b go"))).status is TaskStatus.SUCCEEDED


async def test_per_worker_numbers_are_stored_shown_and_exported(tmp_path: Path) -> None:
    completed = sample("kazma_swarm_worker_calls_total", {"worker": "a", "outcome": "completed"})
    workers = {
        "a": answers("a", "one", "two"),
        "b": ScriptedWorker("b", [WorkerResult("b", False, error="bad input", error_kind=ErrorKind.PERMANENT)]),
    }
    async with rig(tmp_path / "s.db", workers) as r:
        await ended(r.service, await send(r, "dispatch a one"))
        await ended(r.service, await send(r, "dispatch a two"))
        await ended(r.service, await send(r, "dispatch b three"))
        assert r.service.state is not None
        rows = {row.worker: row for row in await r.service.state.worker_days(1)}
        assert (rows["a"].completed, rows["a"].failed, rows["a"].prompt_tokens) == (2, 0, 10)
        assert rows["a"].cost == 10 / 1000.0  # 1.0 per 1k prompt tokens in kazma.yaml
        assert (rows["b"].completed, rows["b"].failed) == (0, 1)
        text = await send(r, "metrics")
        assert "a: 2 completed, 0 failed" in text
        assert "b: 0 completed, 1 failed" in text
        page = dashboard_page(Looker(), DashboardData([], [], [], {}, worker_days=list(rows.values())))
        assert "<h2>Workers per day</h2>" in page
        assert "<td>a</td><td>2</td><td>0</td>" in page
    assert sample("kazma_swarm_worker_calls_total", {"worker": "a", "outcome": "completed"}) == completed + 2


async def test_the_refiner_distils_a_pipeline_and_its_failure_keeps_the_result_counted(tmp_path: Path) -> None:
    before = sample("kazma_swarm_failures_total", {"site": "refiner"})
    calls: list[int] = []

    async def refiner(prompt: str, results: Sequence[WorkerResult]) -> Synthesis:
        calls.append(len(results))
        if len(calls) > 1:
            raise RuntimeError("model down")
        return Synthesis(f"report on {prompt}: " + " / ".join(r.output for r in results), Usage(7, 3))

    workers = {"a": answers("a", "facts", "facts"), "b": answers("b", "built", "built")}
    async with rig(tmp_path / "s.db", workers) as r:
        r.service.refiner = refiner
        record = await ended(r.service, await send(r, "pipeline a,b make it"))
        assert record.result is not None
        assert record.result["output"] == "report on make it: facts / built"
        assert record.result["tokens"] == {"prompt": 5 + 5 + 7, "completion": 5 + 5 + 3}
        again = await ended(r.service, await send(r, "pipeline a,b make it"))
        assert again.result is not None
        assert (again.status, again.result["output"], again.result["details"]["refined"]) == (
            TaskStatus.SUCCEEDED,
            "built",
            False,
        )
    assert sample("kazma_swarm_failures_total", {"site": "refiner"}) == before + 1


# -- semantic routing ------------------------------------------------------------------------------

_POETRY = ("poetry", "vers", "poème", "mer")
_CODE = ("code", "programme", "script")


def concept_vector(text: str) -> list[float]:
    """The fake's embedding: how much a text is about poetry, about code, or neither (any language listed)."""
    words = text.lower().replace(",", " ").replace(":", " ").split()
    return [float(sum(w in _POETRY for w in words)), float(sum(w in _CODE for w in words)), 0.05]


async def test_auto_routes_by_embeddings_and_falls_back_to_keywords_counted(tmp_path: Path) -> None:
    fallback = sample("kazma_swarm_routing_total", {"method": "keyword_fallback"})
    failures = sample("kazma_swarm_failures_total", {"site": "semantic_routing"})
    poet = ScriptedWorker("poet", expertise=("poetry",))
    coder = ScriptedWorker("coder", expertise=("code",))
    cfg = load_config_text(
        'agents: {workers: {poet: {system_prompt: "p", expertise: [poetry]},'
        ' coder: {system_prompt: "c", expertise: [code]}}}\npipelines: {}\n'
        'platforms: {telegram: {admins: [111]}}\napprovals: {approvers: ["telegram:111"]}\n'
    ).config
    async with FakeOpenAI(models=("embedder",)) as model:
        model.embed = concept_vector
        async with rig(tmp_path / "s.db", {"poet": poet, "coder": coder}, cfg) as r:
            r.service.router = EmbeddingRouter(model.base_url, "embedder", deadline=5)
            task = "écris-moi des vers sur la mer"  # no worker keyword, another language
            assert "poet" not in task
            record = await ended(r.service, await send(r, f"dispatch auto {task}"))
            assert record.status is TaskStatus.SUCCEEDED
            assert poet.seen == [(task, "")]
            routing = record.request["routing"]
            assert routing["method"] == "semantic"
            assert routing["chosen"] == "poet"
            assert [name for name, _ in routing["candidates"]] == ["poet", "coder"]
            assert routing["candidates"][0][1] > 0.9
            (asked,) = model.embedding_requests
            assert asked.body == {"model": "embedder", "input": [task, "poet: poetry", "coder: code"]}

            model.embeddings_error = 500
            record = await ended(r.service, await send(r, "dispatch auto fix the code please"))
            assert coder.seen == [("fix the code please", "")]
            assert record.request["routing"]["method"] == "keyword_fallback"
            assert "embeddings failed" in record.request["routing"]["reason"]
            refused = await send(r, "dispatch auto écris des vers")  # no keyword either: refused, and says why
            assert refused.startswith("Not started: no worker's expertise matches")
            assert "embeddings failed" in refused
    assert sample("kazma_swarm_routing_total", {"method": "keyword_fallback"}) == fallback + 2
    # two failures in a row are one degraded spell: counted once
    assert sample("kazma_swarm_failures_total", {"site": "semantic_routing"}) == failures + 1


# -- the lead's tool, synthesis tokens, retention --------------------------------------------------


async def test_the_leads_tool_answers_when_the_store_cannot_admit(tmp_path: Path) -> None:
    workers = {"a": answers("a", "done")}
    cfg = config("tools: {dispatch_swarm: read}\n")
    async with rig(tmp_path / "s.db", workers, cfg) as r, approval_service(tmp_path / "ap.db", config=cfg) as ap:
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(ap))
        ctx = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")
        locker = await connect(tmp_path / "s.db", busy_timeout_ms=10)
        try:
            await locker.execute("BEGIN IMMEDIATE")
            answer = await dispatch.handler({"pattern": "dispatch", "task": "x", "workers": ["a"]}, ctx)
            await locker.execute("ROLLBACK")
        finally:
            await locker.close()
        assert not answer.ok
        assert answer.error == STORE_UNAVAILABLE
        assert await r.service.store.list() == []
        again = await dispatch.handler(
            {"pattern": "conditional", "task": "x", "workers": ["a"], "routes": {"y": "a"}}, ctx
        )
        assert again.ok, again.error


async def test_synthesis_tokens_count_and_a_failed_synthesis_is_counted(tmp_path: Path) -> None:
    before = sample("kazma_swarm_failures_total", {"site": "synthesis"})

    async def synthesize(question: str, results: Sequence[WorkerResult]) -> Synthesis:
        if question == "broken":
            raise RuntimeError("model down")
        return Synthesis("combined", Usage(100, 20))

    workers = {"a": answers("a", "x", "x"), "b": answers("b", "y", "y")}
    async with rig(tmp_path / "s.db", workers) as r:
        r.service.synthesizer = synthesize
        record = await ended(r.service, await send(r, "consult a,b what now"))
        assert record.result is not None
        assert record.result["output"] == "combined"
        assert record.result["tokens"] == {"prompt": 5 + 5 + 100, "completion": 5 + 5 + 20}
        fallback = await ended(r.service, await send(r, "fanout a,b --strategy synthesize broken"))
        assert fallback.result is not None
        assert fallback.result["output"] == "[a] x\n\n[b] y"
    assert sample("kazma_swarm_failures_total", {"site": "synthesis"}) == before + 1


async def test_retention_sweeps_old_tasks_and_zero_keeps_everything(tmp_path: Path) -> None:
    now = [1_800_000_000.0]
    async with rig(tmp_path / "s.db", {"a": answers("a", "done")}, config("  retention_days: 0\n")) as r:
        r.service.store.clock = lambda: now[0]
        await ended(r.service, await send(r, "dispatch a go"))
        now[0] += 400 * 86400.0
        assert await r.service.sweep_retention() == 0
        assert len(await r.service.store.list()) == 1
        r.service.config = config("  retention_days: 30\n")
        assert await r.service.sweep_retention() == 1
        assert await r.service.store.list() == []
