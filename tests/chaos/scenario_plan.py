"""The plan scenario: a plan of two dependent steps handed to sub-agents in the group, one step asking a
question a person answers, one failing and repaired by the lead — against a real ``kazma run`` on the wire
fakes, one failpoint armed, restarted when it died or hung (as :mod:`tests.chaos.rig` does).

A person asks the lead in Telegram; the lead writes a plan (1: the validator checks the target, 2: the
builder deploys, after step 1); the plan posts ``@validator …`` in the group, its model call fails for good,
the lead is asked and repairs the step (``retry_step`` with new input) while step 2 waits; the validator
answers; ``@builder …`` is posted, the builder asks the person which region (``ask_user``), the person answers
by replying to the question (once the builder's asking turn has said it waits), the builder finishes and
the lead sums up. A question still open after a restart is answered again, as a person would. At the end
``/plan`` is asked in the group, as a person would, and its answer kept.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from kazma.config import load_config_text
from kazma.engine.scenario import agent_prompts
from tests.chaos.rig import (
    STEP_SECONDS,
    TG_ADMIN,
    TG_CHAT,
    History,
    Rig,
    _until,
    fakes,
    observe,
    run_restarting,
)
from tests.chaos.scenario import Cell
from tests.chaos.scenario_swarm import rows
from tests.fakes.openai import Completion, FakeResponse, FakeToolCall, HttpError

ASK = "@kazma deploy the service please"
QUESTION = "Which region should I deploy to?"
ANSWER = "eu-west"
PLAN = {
    "goal": "deploy the service",
    "steps": [
        {"index": 1, "title": "check", "assignee": "validator", "input": "Check the target is reachable."},
        {"index": 2, "title": "deploy", "assignee": "builder", "input": "Deploy the service."},
    ],
}
REPAIRED = "Check the target is reachable, on the mirror."
DEPLOYED = "Deployed to the region given."
CHECKED = "The mirror is reachable."
SUMMED = "Deployed and checked."
WAITING = "Waiting to hear the region."
AGENTS = ("kazma", "builder", "validator")


def prompts() -> dict[str, str]:
    every = agent_prompts(load_config_text("", environ={}).config)
    return {name: every[name] for name in AGENTS}


@dataclass
class PlanHistory(History):
    plans: list[tuple[str, str]] = field(default_factory=list)  # id, status
    steps: list[tuple[str, int, str, str, str, int]] = field(default_factory=list)  # plan, idx, title, status, why, n
    questions: list[tuple[str, str, str | None]] = field(default_factory=list)  # id, status, answer
    events: dict[str, int] = field(default_factory=dict)  # plan event kind -> how many (answered, retried …)
    asked: dict[str, int] = field(default_factory=dict)  # agent -> model requests
    replies: int = 0  # answers the person sent
    plan_view: str = ""  # the answer to /plan at the end


def _asked_to_decide(messages: list[Any]) -> bool:
    """The lead's latest user message asks it to decide about a failed step, and it has not answered yet."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return False
        if message.get("role") == "user":
            return "Decide what to do next" in str(message.get("content") or "")
    return False


def _call(name: str, arguments: Mapping[str, object]) -> Completion:
    return Completion(tool_calls=(FakeToolCall(name, json.dumps(arguments)),))


class PlanRig(Rig):
    def __init__(self, tmp: Path, *, store: str, dsn: str | None) -> None:
        super().__init__(tmp, store=store, dsn=dsn, tools="[]")
        self.replied: set[int] = set()  # question messages the person answered

    def script_agents(self) -> None:
        """Each agent's answer is chosen by what its request says, so a restart mid-plan gets the right one."""
        by_prompt = {v: k for k, v in prompts().items()}

        def respond(body: Any) -> FakeResponse | None:
            messages = body.get("messages") or []
            agent = by_prompt.get(str(messages[0].get("content"))) if messages else None
            last = messages[-1] if messages else {}
            text = str(last.get("content") or "")
            tool = last.get("role") == "tool"
            if agent == "kazma":
                if tool:
                    return Completion(
                        content="Planned." if "runs again" not in text else "Retrying step 1 on the mirror."
                    )
                if ASK in text:
                    return _call("write_plan", PLAN)
                if "Decide what to do next" in text or _asked_to_decide(messages):
                    return _call("retry_step", {"index": 1, "input": REPAIRED})
                return Completion(content=SUMMED)
            if agent == "builder":
                if tool:
                    return Completion(content=WAITING)
                if f"A: {ANSWER}" in text:
                    return Completion(content=DEPLOYED)
                return _call("ask_user", {"question": QUESTION})
            if agent == "validator":
                if REPAIRED in text:
                    return Completion(content=CHECKED)
                return HttpError(400, {"error": {"message": "the check's target is unreachable", "type": "invalid"}})
            return Completion(content="Noted.")

        self.model.responder = respond

    def where(self) -> str:
        return self.dsn if self.store == "postgresql" and self.dsn else str(self.tmp / "state" / "k.db")

    def plan_rows(self) -> list[tuple[str, str]]:
        try:
            return [(str(r[0]), str(r[1])) for r in rows(self.store, self.where(), "SELECT id, status FROM plans")]
        except (sqlite3.Error, psycopg.Error):
            return []

    def ended(self) -> bool:
        found = self.plan_rows()
        return bool(found) and all(status != "active" for _, status in found)

    def open_questions(self, *, restarted: bool) -> list[object]:
        """Question messages in the group not answered by the person yet (a restart may show one again), once
        the sub-agent's asking turn has ended (its "waiting" line is out; after a restart that turn may have
        died with the process, and the question shown again is answered as it comes)."""
        if not restarted and not self.said(WAITING):
            return []
        return [
            m
            for m in self.telegram.bot_messages(TG_CHAT)
            if QUESTION in m.text and "Question from" in m.text and m.message_id not in self.replied
        ]

    def answer(self, message: object) -> None:
        message_id = message.message_id  # type: ignore[attr-defined]
        self.replied.add(message_id)
        self.telegram.push_message(TG_CHAT, TG_ADMIN, ANSWER, username="ops", reply_to=message_id)

    def said(self, words: str) -> bool:
        return any(words in m.text for m in self.telegram.bot_messages(TG_CHAT))


async def _drive(s: Rig, proc: asyncio.subprocess.Process, h: History, ask: bool) -> bool:
    """The scenario's steps on ``proc``; True when the plan ended, the person heard and read ``/plan``."""
    assert isinstance(s, PlanRig)
    assert isinstance(h, PlanHistory)
    if ask:
        s.telegram.push_message(TG_CHAT, TG_ADMIN, ASK, username="ops")
    loop = asyncio.get_running_loop()
    end = loop.time() + (STEP_SECONDS * 3 if ask else STEP_SECONDS * 2)  # a restart has recovered by now
    progress = loop.time()
    while loop.time() < end and proc.returncode is None:
        for question in s.open_questions(restarted=not ask):
            s.answer(question)
            h.replies += 1
            progress = loop.time()
        if s.ended():
            break
        if loop.time() - progress > STEP_SECONDS:
            return False  # no question to answer and no ending within the bound: stuck
        await asyncio.sleep(0.05)
    if not s.ended() or not await _until(lambda: s.said(SUMMED), proc, STEP_SECONDS):
        return False
    # what a person reads of the plan: /plan in the group
    before = len(s.telegram.bot_messages(TG_CHAT))
    s.telegram.push_message(TG_CHAT, TG_ADMIN, "/plan", username="ops")

    def views() -> list[str]:  # its answer, among whatever else the group is told meanwhile
        return [m.text for m in s.telegram.bot_messages(TG_CHAT)[before:] if "Plan " in m.text or "plan" in m.text]

    if not await _until(lambda: bool(views()), proc, STEP_SECONDS):
        return False
    h.plan_view = "\n".join(views())
    return proc.returncode is None


async def run_plan_cell(tmp: Path, cell: Cell, dsn: str | None) -> PlanHistory:
    point, action, store = cell
    s = PlanRig(tmp, store=store, dsn=dsn)
    h = PlanHistory(point, action, store, s.where(), tmp / "ws")
    async with fakes(s):
        s.script_agents()
        await run_restarting(s, h, f"{point}={action}", _drive)
        observe(s, h, ASK)
        by_prompt = {v: k for k, v in prompts().items()}
        h.asked = dict.fromkeys(AGENTS, 0)
        for r in s.model.completions:
            name = by_prompt.get(str(r.body["messages"][0].get("content")))
            if name is not None:
                h.asked[name] += 1
        where = s.where()
        h.plans = s.plan_rows()
        h.steps = [
            (str(r[0]), int(r[1]), str(r[2]), str(r[3]), str(r[4]), int(r[5]))
            for r in rows(
                store,
                where,
                "SELECT plan_id, idx, title, status, failure_reason, attempts FROM plan_steps ORDER BY plan_id, idx",
            )
        ]
        h.questions = [
            (str(r[0]), str(r[1]), r[2])
            for r in rows(store, where, "SELECT id, status, answer FROM plan_questions ORDER BY created_at")
        ]
        h.events = {
            str(r[0]): int(r[1]) for r in rows(store, where, "SELECT kind, count(*) FROM plan_events GROUP BY kind")
        }
    return h
