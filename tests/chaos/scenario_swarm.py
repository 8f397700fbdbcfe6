"""The swarm scenario: a ``/swarm`` pipeline with a checkpoint a person approves, a handoff, its result stored
and delivered — against a real ``kazma run`` on the wire fakes, one failpoint armed, restarted when it died or
hung, as the approval scenario is (:mod:`tests.chaos.rig`).

A person sends ``/swarm pipeline quick …`` in Telegram. ``quick`` is researcher then builder, with a
checkpoint after stage 1 (``swarm.checkpoints``): the researcher answers, the task pauses, its checkpoint card
goes to Telegram and Discord, the person presses Approve on Telegram, the task resumes; the builder hands its
stage to the validator (``handoff_to_worker``), whose answer takes the stage's place; the pipeline's report is
written by one more model call, stored and delivered to the home chats. A process that died (or hung) is
started again without the failpoint; a card still live then is pressed again, as a person would. At the end,
with Kazma stopped, ``kazma swarm status <task>`` is run as a person would run it, and its output kept.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from kazma.config import load_config_text
from tests.audit_support import KEY_ENV
from tests.chaos.rig import (
    REPLICA,
    STEP_SECONDS,
    TG_ADMIN,
    TG_CHAT,
    History,
    Rig,
    _discord_text,
    _until,
    fakes,
    observe,
    run_restarting,
)
from tests.chaos.scenario import Cell
from tests.child_env import child_env
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.openai import Completion, FakeToolCall

ASK = "/swarm pipeline quick collect facts about the sky"
FACTS = "FACTS: the sky is blue by day"  # the researcher's answer (stage 1), kept in the journal
CHECKED = "CHECKED: blue, confirmed by the validator"  # the handoff target's answer (stage 2)
REPORT = "REPORT: the sky is blue, checked"  # every other model call (the pipeline's report)
WORKERS = ("researcher", "builder", "validator")


def worker_prompts() -> dict[str, str]:
    workers = load_config_text("", environ={}).config.agents.workers
    return {name: workers[name].system_prompt for name in WORKERS}


@dataclass
class SwarmHistory(History):
    tasks: list[tuple[str, str, str | None]] = field(default_factory=list)  # id, status, error
    steps: list[tuple[str, int, str, bool, str]] = field(default_factory=list)  # task, idx, worker, ok, output
    checkpoints: list[tuple[str, str, str]] = field(default_factory=list)  # approval id, status, requested_by
    retries: dict[str, int] = field(default_factory=dict)  # worker -> calls recorded as a retry (attempt > 1)
    asked: dict[str, int] = field(default_factory=dict)  # worker -> model requests under its system prompt
    status_text: str = ""  # `kazma swarm status <task>` after the end, for the (first) task
    status_exit: int | None = None
    discord_texts: list[str] = field(default_factory=list)


class SwarmRig(Rig):
    def __init__(self, tmp: Path, *, store: str, dsn: str | None) -> None:
        super().__init__(
            tmp, store=store, dsn=dsn, extra="swarm: {checkpoints: {quick: [1]}, allow_shared_operators: true}\n"
        )

    def script_workers(self) -> None:
        prompts = worker_prompts()
        self.model.script_agent(prompts["researcher"], Completion(content=FACTS))
        handoff = json.dumps({"worker": "validator", "reason": "checking is the validator's job"})
        self.model.script_agent(
            prompts["builder"], Completion(tool_calls=(FakeToolCall("handoff_to_worker", handoff),))
        )
        self.model.script_agent(prompts["validator"], Completion(content=CHECKED))
        self.model.fallback = Completion(content=REPORT)

    def tasks(self) -> list[tuple[str, str, str | None]]:
        return [
            (str(r[0]), str(r[1]), r[2])
            for r in rows(self.store, self.where(), "SELECT id, status, error FROM swarm_tasks")
        ]

    def where(self) -> str:
        return self.dsn if self.store == "postgresql" and self.dsn else str(self.tmp / "state" / "k.db")

    def ended(self) -> bool:
        try:
            found = self.tasks()
        except (sqlite3.Error, psycopg.Error):
            return False  # the store is not written yet
        if not found:  # refused before anything started: the person was told so
            return any("nothing started" in m.text for m in self.telegram.bot_messages(TG_CHAT))
        return all(status not in ("running", "paused") for _, status, _ in found)

    def heard(self) -> bool:
        """Every task's ending reached its conversation (what a person reads: ``swarm task <id> <status>``)."""
        texts = [m.text for m in self.telegram.bot_messages(TG_CHAT)]
        return all(told(texts, task_id, status, error) for task_id, status, error in self.tasks())

    def env(self) -> dict[str, str]:
        env = child_env({"NO_PROXY": "127.0.0.1,localhost", "KAZMA_FAILPOINTS": ""})
        if self.store == "postgresql":
            env |= {"KAZMA_WEB_TOKEN": "o" * 40, "KAZMA_WEB_READER_TOKEN": "r" * 40, **KEY_ENV}
            env["KAZMA_REPLICA"] = REPLICA
        return env

    async def status(self, task_id: str) -> tuple[int, str]:
        """``kazma swarm status <task>`` as a person runs it (Kazma stopped)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(self.tmp / "kazma.yaml"), "swarm", "status", task_id,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=self.env(), cwd=str(self.tmp),
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        return int(proc.returncode or 0), out.decode(errors="replace")


def said(text: str, task_id: str, status: str) -> bool:
    """``text`` tells the task's ending ``status`` (``swarm task <id> <status>``, or ``… was interrupted``)."""
    return f"swarm task {task_id} {status}" in text or (
        status == "interrupted" and task_id in text and "interrupted" in text
    )


def told(texts: list[str], task_id: str, status: str, error: str | None) -> bool:
    """The person heard the task's ending: said by its id, or — a task whose row was written and then refused
    before anything started (``not started: …``) — the refusal's own words."""
    if any(said(text, task_id, status) for text in texts):
        return True
    return (error or "").startswith("not started") and any("nothing started" in text for text in texts)


def rows(store: str, where: str, sql: str) -> list[tuple[Any, ...]]:
    if store == "postgresql":
        with psycopg.connect(where, autocommit=True) as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]
    if not Path(where).exists():
        return []
    lite = sqlite3.connect(where)
    try:
        return [tuple(r) for r in lite.execute(sql).fetchall()]
    finally:
        lite.close()


async def _drive(s: Rig, proc: asyncio.subprocess.Process, h: History, ask: bool) -> bool:
    """The scenario's steps on ``proc``; True when the task ended, every card settled and the person heard."""
    assert isinstance(s, SwarmRig)
    if ask:
        s.telegram.push_message(TG_CHAT, TG_ADMIN, ASK, username="ops")
    # a checkpoint card to press (after a restart, which has recovered by now: a paused task's card, still live or
    # posted again), or the task's end
    if ask and not await _until(lambda: bool(s.tg_live()) or s.ended(), proc, STEP_SECONDS):
        return False  # asked, and within the bound neither a card nor an ending: stuck (not a second bound more)
    if s.tg_live() and not s.ended():
        s.press()
        h.presses += 1
    if not await _until(lambda: s.ended() and not s.tg_live() and not s.dc_live(), proc, STEP_SECONDS):
        return False
    if not await _until(s.heard, proc, STEP_SECONDS):
        return False  # ended in the store, and the person never heard: stuck
    return proc.returncode is None


async def run_swarm_cell(tmp: Path, cell: Cell, dsn: str | None) -> SwarmHistory:
    point, action, store = cell
    s = SwarmRig(tmp, store=store, dsn=dsn)
    h = SwarmHistory(point, action, store, s.where(), tmp / "ws")
    async with fakes(s):
        s.script_workers()
        await run_restarting(s, h, f"{point}={action}", _drive)
        observe(s, h, ASK)
        h.discord_texts = [_discord_text(m) for m in s.discord.channel_messages(HOME_CHANNEL_ID)]
        prompts = worker_prompts()
        h.asked = {
            name: sum(1 for r in s.model.completions if r.body["messages"][0].get("content") == prompt)
            for name, prompt in prompts.items()
        }
        h.tasks = s.tasks()
        h.steps = [
            (str(r[0]), int(r[1]), str(r[2]), bool(r[3]), str(r[4]))
            for r in rows(
                store, s.where(), "SELECT task_id, idx, worker, ok, output FROM swarm_steps ORDER BY task_id, idx"
            )
        ]
        h.checkpoints = [
            (str(r[0]), str(r[1]), str(r[2]))
            for r in rows(
                store,
                s.where(),
                "SELECT id, status, requested_by FROM approval_requests WHERE tool = 'pipeline_checkpoint'",
            )
        ]
        h.retries = {
            str(r[0]): int(r[1])
            for r in rows(
                store, s.where(), "SELECT worker, count(*) FROM swarm_calls WHERE attempt > 1 GROUP BY worker"
            )
        }
        if h.tasks:
            h.status_exit, h.status_text = await s.status(h.tasks[0][0])
    return h
