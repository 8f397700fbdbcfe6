"""Issue 32: every swarm step leaves a record on both backends — model, tools with their approval ids, start,
finish, tokens in and out, the cost the model reports, the error — shown by /swarm status, the console and
`kazma swarm show <id> --json`; and `/swarm tasks --worker` lists tasks by worker with the same answers on both.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kazma.approvals import ApprovalService
from kazma.approvals.model import Decision
from kazma.bot.console.dashboard_data import DashboardData
from kazma.bot.console.pages import dashboard_page
from kazma.config.store.backend import StoreConnection
from kazma.config.store.database import Migration
from kazma.engine.swarm.state_store import MIGRATIONS as STATE
from kazma.engine.swarm.state_store import PG_MIGRATIONS as STATE_PG
from kazma.engine.swarm.store import MIGRATIONS, PG_MIGRATIONS, SwarmTaskStore
from kazma.engine.swarm.types import ErrorKind, Pattern, TaskStatus, WorkerResult
from kazma.engine.types import ToolUse, Usage
from tests.agent_swarm import agent_workers, say
from tests.approvals_support import RecordingPublisher
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.store_backends import Engine, open_store
from tests.swarm_rig import config, rig
from tests.swarm_support import ScriptedWorker

CFG = """
agents:
  workers:
    researcher: {system_prompt: "You are researcher."}
    builder: {system_prompt: "You are builder.", tools: [write_file]}
    ab: {system_prompt: "You are ab."}
pipelines: {}
swarm: {retries: 0}
"""


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


def migrations(engine: Engine) -> list[Migration]:
    return [*PG_MIGRATIONS, *STATE_PG] if engine.postgres else [*MIGRATIONS, *STATE]


async def test_call_records_and_tasks_by_worker_give_the_same_answers_on_both_backends(store_engine: Engine) -> None:
    async with open_store(store_engine, migrations=migrations(store_engine)) as conn:
        store = SwarmTaskStore(conn)
        only_ab = await store.admit(Pattern.DISPATCH, {"prompt": "x"}, owner="o", workers=["ab"])
        named = await store.admit(Pattern.FAN_OUT, {"prompt": "y"}, owner="o", workers=["a", "b"])
        handed = await store.admit(Pattern.DISPATCH, {"prompt": "z"}, owner="o", workers=["b"])
        # ``a`` ran in ``handed`` only as a handoff's target: its call record names it
        first = await store.start_call(handed, "b", step="", attempt=1)
        second = await store.start_call(handed, "a", step="handoff from b", attempt=1)
        assert (first, second) == (1, 2)
        running = await store.calls(handed.task_id)
        assert [(c.seq, c.worker, c.ok, c.finished_at) for c in running] == [(1, "b", None, None), (2, "a", None, None)]
        tools = (ToolUse("write_file", True, "req-1"), ToolUse("shell", False, "req-2", refused=True))
        await store.finish_call(
            handed.task_id,
            2,
            WorkerResult("a", True, output="done", usage=Usage(12, 5, 0.0031), model="m-1", tools=tools),
        )
        await store.finish_call(
            handed.task_id, 1, WorkerResult("b", False, error="upstream 503", error_kind=ErrorKind.TRANSIENT)
        )
        calls = await store.calls(handed.task_id)
        assert [(c.worker, c.step, c.ok, c.error, c.model, c.tools) for c in calls] == [
            ("b", "", False, "upstream 503", "", ()),
            ("a", "handoff from b", True, "", "m-1", tools),
        ]
        assert (calls[1].prompt_tokens, calls[1].completion_tokens, calls[1].cost) == (12, 5, 0.0031)
        assert calls[0].cost is None  # not reported is not zero
        assert all(c.seconds is not None and c.seconds >= 0 for c in calls)

        # an exact match on the worker's name: "a" is not "ab"; newest first
        assert [t.id for t in await store.tasks_of("a")] == [handed.task_id, named.task_id]
        assert [t.id for t in await store.tasks_of("ab")] == [only_ab.task_id]
        assert [t.id for t in await store.tasks_of("b")] == [handed.task_id, named.task_id]
        assert await store.tasks_of("nobody") == []
        by_task = await store.calls_of([handed.task_id, named.task_id])
        assert [c.seq for c in by_task[handed.task_id]] == [1, 2]
        assert by_task[named.task_id] == []


async def test_swarm_tasks_by_worker_through_the_command_on_both_backends(store_engine: Engine, tmp_path: Path) -> None:
    workers = {n: ScriptedWorker(n) for n in ("researcher", "builder", "ab")}
    async with (
        open_store(store_engine, migrations=migrations(store_engine)) as conn,
        rig(tmp_path / "unused.db", workers, config(CFG), store=conn) as r,
    ):
        built = (await r.ended(await r.send("dispatch builder make it"))).id
        both = (await r.ended(await r.send("fanout researcher,builder look"))).id
        other = (await r.ended(await r.send("dispatch ab other"))).id
        listed = await r.send("tasks --worker builder")
        assert [line.split()[0] for line in listed.splitlines()] == [both, built]
        assert [line.split()[0] for line in (await r.send("tasks --worker ab")).splitlines()] == [other]
        assert (await r.send("tasks --worker researcher")).split()[0] == both
        assert len((await r.send("tasks")).splitlines()) == 3


async def _approve_when_asked(publisher: RecordingPublisher, approvals: ApprovalService) -> str:
    """Press Approve on the first card that appears; return its request id."""
    async with asyncio.timeout(20):
        while not publisher.published:
            await asyncio.sleep(0.01)
    card = publisher.published[0]
    press = await approvals.decide_from_button(
        card.button_data(Decision.APPROVE), actor="telegram:111", platform="telegram"
    )
    assert press.won
    return str(card.request_id)


async def pipeline_with_an_approved_tool(
    tmp_path: Path, store: StoreConnection | None = None
) -> tuple[str, str, str, str]:
    """researcher answers; builder writes a file (a dangerous tool: a card, approved) and answers.

    Returns the task's /swarm status, the approval id, the task id and the dashboard page.
    """
    cfg = config(CFG)
    async with agent_workers(tmp_path, ["researcher", "builder"], cfg, tools={"builder": ("write_file",)}) as agents:
        model = agents.model
        model.script_agent("You are researcher.", say("the facts", usage=(10, 5), cost=0.001))
        write = FakeToolCall("write_file", json.dumps({"path": "out.txt", "content": "built"}))
        model.script_agent(
            "You are builder.",
            Completion(tool_calls=(write,), usage=(20, 7), cost=0.002),
            say("built it", usage=(30, 4), cost=0.003),
        )
        async with rig(
            tmp_path / "swarm.db",
            agents.workers,
            cfg,
            approvals=agents.approvals,
            store=store,
        ) as r:
            answer = await r.send("pipeline researcher,builder build the thing")
            approval = await _approve_when_asked(agents.publisher, agents.approvals)
            record = await r.ended(answer)
            assert record.status is TaskStatus.SUCCEEDED, record.error
            status = await r.send(f"status {record.id}")
            calls = await r.service.store.calls_of([record.id])
            page = dashboard_page(Looker(), DashboardData([record], [], [], {}, calls=calls))
            return status, approval, record.id, page


STEP = r"(\d+\.\d) s"


async def test_status_shows_each_step_with_model_tools_approvals_duration_tokens_and_cost(tmp_path: Path) -> None:
    status, approval, _, page = await pipeline_with_an_approved_tool(tmp_path)
    steps = status.split("steps:\n", 1)[1].split("\nresult:", 1)[0].splitlines()
    assert len(steps) == 2
    assert re.fullmatch(
        rf"1\. stage 1: researcher · model fake-model · tools: no tools · {STEP} · 10 \+ 5 tokens, cost 0\.0010 · ok",
        steps[0],
    ), steps[0]
    assert re.fullmatch(
        rf"2\. stage 2: builder · model fake-model · tools: write_file \(approval {re.escape(approval)}, ok\) · {STEP}"
        r" · 50 \+ 11 tokens, cost 0\.0050 · ok",
        steps[1],
    ), steps[1]
    # the console shows the same record under the task
    assert "<summary>2 steps</summary>" in page
    assert f"write_file (approval {approval}, ok)" in page
    assert "<td>50 + 11</td><td>0.0050</td>" in page


async def test_the_record_is_the_same_on_postgresql(store_engine: Engine, tmp_path: Path) -> None:
    async with open_store(store_engine, migrations=migrations(store_engine)) as conn:
        status, approval, task_id, _ = await pipeline_with_an_approved_tool(tmp_path, conn)
        calls = await SwarmTaskStore(conn).calls(task_id)
    assert [(c.step, c.worker, c.model, c.ok) for c in calls] == [
        ("stage 1", "researcher", "fake-model", True),
        ("stage 2", "builder", "fake-model", True),
    ]
    assert calls[1].tools == (ToolUse("write_file", True, approval),)
    assert (calls[1].prompt_tokens, calls[1].completion_tokens, calls[1].cost) == (50, 11, 0.005)
    assert f"write_file (approval {approval}, ok)" in status


def kazma(config_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "--log-level", "warning", "-c", str(config_path), "swarm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_kazma_swarm_show_prints_the_task_and_its_steps_as_json(tmp_path: Path) -> None:
    async with FakeOpenAI(models=("llama3.1",)) as model:
        path = tmp_path / "kazma.yaml"
        path.write_text(
            f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
            f"model: {{base_url: '{model.base_url}', max_retries: 0}}\n"
            "approvals: {approvers: ['cli:ops'], cli_identity: declared}\n"
        )
        model.script(Completion(content="built it", usage=(9, 4), cost=0.0007))
        ran = await asyncio.to_thread(kazma, path, "--as", "ops", "dispatch", "builder", "make", "it")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        task_id = ran.stdout.split()[2]
        shown = await asyncio.to_thread(kazma, path, "show", task_id, "--json")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        data = json.loads(shown.stdout)
        assert data["steps"], shown.stdout + shown.stderr
        assert (data["id"], data["status"], data["pattern"]) == (task_id, "succeeded", "dispatch")
        (step,) = data["steps"]
        assert (step["worker"], step["model"], step["ok"], step["tools"]) == ("builder", "llama3.1", True, [])
        assert (step["tokens"], step["cost"], step["attempt"]) == ({"prompt": 9, "completion": 4}, 0.0007, 1)
        assert step["seconds"] >= 0
        missing = await asyncio.to_thread(kazma, path, "show", "nosuchtask", "--json")
        assert missing.returncode == 1
        assert "no swarm task 'nosuchtask'" in missing.stderr
