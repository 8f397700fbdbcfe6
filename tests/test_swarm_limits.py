"""Issue 32: a prompt, context or metadata over its limit is refused with the limit named, on every surface —
chat (/swarm), the console, the CLI (kazma swarm) and the lead's dispatch_swarm — and a pipeline's context is never
cut without a word (it used to keep its last 256 KiB silently)."""

from __future__ import annotations

import asyncio
import html
import re
import subprocess
import sys
from pathlib import Path

from kazma.approvals import SafetyPolicy
from kazma.engine.agent import AgentSpec, TurnContext
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.limits import MAX_CONTEXT_BYTES, MAX_METADATA_BYTES, MAX_PROMPT_BYTES
from kazma.engine.swarm.types import TaskStatus, WorkerResult
from tests.approvals_support import RecordingPublisher, approval_service
from tests.swarm_rig import config, rig
from tests.swarm_support import ScriptedWorker
from tests.test_web_server import OPERATOR, console

PROMPT_LIMIT = "the limit is 65,536 bytes (64 KiB)"
CONTEXT_LIMIT = "the limit is 262,144 bytes (256 KiB)"
METADATA_LIMIT = "the limit is 65,536 bytes (64 KiB)"
CFG = """
agents:
  workers:
    a: {system_prompt: "You are a."}
    b: {system_prompt: "You are b."}
pipelines: {}
tools: {dispatch_swarm: read}
"""


async def test_chat_refuses_a_long_task_naming_the_limit(tmp_path: Path) -> None:
    async with rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b")}, config(CFG)) as r:
        answer = await r.send("dispatch a " + "x" * (MAX_PROMPT_BYTES + 1))
        assert f"the task is 65,537 bytes; {PROMPT_LIMIT}" in answer
        assert await r.service.store.list() == []


async def test_the_leads_tool_refuses_each_limit_by_name(tmp_path: Path) -> None:
    cfg = config(CFG)
    async with (
        rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b")}, cfg) as r,
        approval_service(tmp_path / "ap.db", config=cfg) as approvals,
    ):
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(approvals))
        ctx = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")
        long_task = await dispatch.handler(
            {"pattern": "dispatch", "task": "é" * MAX_PROMPT_BYTES, "workers": ["a"]}, ctx
        )
        assert not long_task.ok
        assert f"the task is {2 * MAX_PROMPT_BYTES:,} bytes; {PROMPT_LIMIT}" in (long_task.error or "")
        big_context = await dispatch.handler(
            {"pattern": "dispatch", "task": "go", "workers": ["a"], "context": "x" * (MAX_CONTEXT_BYTES + 1)}, ctx
        )
        assert not big_context.ok
        assert f"the task's context is 262,145 bytes; {CONTEXT_LIMIT}" in (big_context.error or "")
        # (branches are at most 32 characters each, as in /swarm, so the routes alone no longer reach the limit)
        big_metadata = await dispatch.handler(
            {"pattern": "fan_out", "task": "go", "workers": ["a", "w" * MAX_METADATA_BYTES]}, ctx
        )
        assert not big_metadata.ok
        assert "the task's metadata (workers, routes and options) is" in (big_metadata.error or "")
        assert METADATA_LIMIT in (big_metadata.error or "")
        assert await r.service.store.list() == []
        ok = await dispatch.handler({"pattern": "dispatch", "task": "go", "workers": ["a"], "context": "notes"}, ctx)
        assert ok.ok, ok.error


async def test_the_leads_tool_refuses_before_asking_anyone_to_approve(tmp_path: Path) -> None:
    """dispatch_swarm needs approval by default: a request over a limit (or naming an unknown worker) was put on an
    approval card first, and refused only once a person had approved it; the card held the whole oversized task."""
    cfg = config(CFG.replace("tools: {dispatch_swarm: read}\n", ""))
    publisher = RecordingPublisher()
    async with (
        rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b")}, cfg) as r,
        approval_service(tmp_path / "ap.db", config=cfg, publisher=publisher) as approvals,
    ):
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(approvals))
        ctx = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")
        refused = [
            ({"pattern": "dispatch", "task": "x" * (MAX_PROMPT_BYTES + 1), "workers": ["a"]}, PROMPT_LIMIT),
            (
                {"pattern": "dispatch", "task": "go", "workers": ["a"], "context": "x" * (MAX_CONTEXT_BYTES + 1)},
                CONTEXT_LIMIT,
            ),
            ({"pattern": "fan_out", "task": "go", "workers": ["a", "nobody"]}, "unknown worker(s): nobody"),
            # as /swarm fanout a,a is refused ("listed twice"), so is the lead's
            ({"pattern": "fan_out", "task": "go", "workers": ["a", "b", "a"]}, "worker(s) listed twice: a"),
            ({"pattern": "consult", "task": "go", "workers": ["b", "b"]}, "worker(s) listed twice: b"),
        ]
        async with asyncio.timeout(20):  # before, each waited here for a person's decision on its card
            for arguments, expected in refused:
                result = await dispatch.handler(arguments, ctx)
                assert not result.ok
                assert expected in (result.error or "")
        assert publisher.published == []
        assert await r.service.store.list() == []


async def test_the_context_given_with_a_task_reaches_every_worker_fenced(tmp_path: Path) -> None:
    a = ScriptedWorker("a")
    async with rig(tmp_path / "s.db", {"a": a, "b": ScriptedWorker("b")}, config(CFG)) as r:
        answer = await r.commands.run(
            "dispatch a go", actor="telegram:111", platform="telegram", chat="-1001", is_admin=True, context="notes"
        )
        await r.ended(answer)
    ((prompt, context),) = a.seen
    assert prompt == "go"
    assert "Untrusted data from the task's context" in context
    assert "notes" in context


async def test_a_pipeline_context_over_the_limit_fails_its_stage_instead_of_being_cut(tmp_path: Path) -> None:
    big = WorkerResult("a", True, output="z" * (MAX_CONTEXT_BYTES + 10))
    b = ScriptedWorker("b")
    async with rig(tmp_path / "s.db", {"a": ScriptedWorker("a", [big]), "b": b}, config(CFG)) as r:
        record = await r.ended(await r.send("pipeline a,b build it"))
    assert record.status is TaskStatus.FAILED
    assert "stage 2 (b) failed: the context handed to b" in (record.error or "")
    assert CONTEXT_LIMIT in (record.error or "")
    assert b.seen == []  # b never got a shortened context


def kazma(config_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "--log-level", "warning", "-c", str(config_path), "swarm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_the_cli_refuses_a_long_task_and_a_big_context_file_naming_the_limits(tmp_path: Path) -> None:
    path = tmp_path / "kazma.yaml"
    path.write_text(f"store: {{path: '{tmp_path / 'k.db'}'}}\napprovals: {{approvers: ['cli:ops']}}\n")
    long_task = await asyncio.to_thread(kazma, path, "--as", "ops", "dispatch", "builder", "x" * (MAX_PROMPT_BYTES + 1))
    assert long_task.returncode == 2
    assert PROMPT_LIMIT in long_task.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("n" * (MAX_CONTEXT_BYTES + 1))
    big = await asyncio.to_thread(kazma, path, "--as", "ops", "dispatch", "--context-file", str(notes), "builder", "go")
    assert big.returncode == 2
    assert f"the context file notes.txt is 262,145 bytes; {CONTEXT_LIMIT}" in " ".join(big.stderr.split())


async def test_the_console_refuses_a_long_task_naming_the_limit(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as op:
        csrf = await con.login(op, "alice", OPERATOR)
        page = await op.post(
            f"{con.base}/swarm/command", data={"csrf": csrf, "text": "dispatch builder " + "x" * (MAX_PROMPT_BYTES + 1)}
        )
        shown = html.unescape(re.sub(r"<[^>]+>", " ", await page.text()))
        assert f"the task is 65,537 bytes; {PROMPT_LIMIT}" in shown
        huge = await op.post(f"{con.base}/swarm/command", data={"csrf": csrf, "text": "x" * (MAX_PROMPT_BYTES * 2)})
        shown = html.unescape(re.sub(r"<[^>]+>", " ", await huge.text()))
        assert "a swarm task may be at most 65,536 bytes (64 KiB)" in shown
        assert await con.app.swarm.store.list() == []
