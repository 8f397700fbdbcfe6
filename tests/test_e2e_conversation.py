"""End to end on the real client libraries against wire-level fakes.

A user asks the lead in the group; the lead plans; each step is dispatched as a
visible ``@sub-agent`` message; the builder's shell call raises an approval
card; an admin presses Approve on the platform; the command runs once; the
lead reports. Only the model is scripted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

from kazma.adapters.contract import PlatformAdapter
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.telegram import TelegramAdapter
from kazma.bot.app import App, build_app
from kazma.config import LoadedConfig, load_config_text
from kazma.engine.model import ScriptStep
from kazma.engine.scenario import PerAgentScript, agent_prompts
from kazma.engine.types import Message, ModelReply, ToolCall
from tests.fakes.slack import FAKE_BOT_TOKEN, FAKE_SIGNING_SECRET, FakeSlack
from tests.fakes.telegram import FakeTelegram

COMMAND = "echo ran >> runs.log && wc -l < runs.log"
PLAN = {
    "goal": "count runs",
    "steps": [
        {"index": 1, "title": "research", "assignee": "researcher", "input": "How should we count runs?"},
        {
            "index": 2,
            "title": "build",
            "assignee": "builder",
            "input": "Count one run as the research says:{{step_1.output_summary}}",
        },
    ],
}
RESEARCH = "Append a line to runs.log per run; the line count is the number of runs."


def _tool_output(messages: Sequence[Message]) -> ModelReply:
    tool = next(str(m["content"]) for m in reversed(messages) if m["role"] == "tool")
    counts = [line.strip() for line in tool.splitlines() if line.strip().isdigit()]
    return ModelReply(content=f"builder result: {counts[-1] if counts else 'no count in: ' + tool[:200]}")


def _report(messages: Sequence[Message]) -> ModelReply:
    return ModelReply(content="Done: " + ("builder ran it" if "builder result: 1" in str(messages[-1]) else "??"))


def script(config: LoadedConfig) -> PerAgentScript:
    c = config.config
    prompts = agent_prompts(c)
    steps: dict[str, list[ScriptStep]] = {
        "kazma": [
            ModelReply(content=None, tool_calls=(ToolCall("p", "write_plan", PLAN, json.dumps(PLAN)),)),
            ModelReply(content="On it: research first, then build."),
            _report,
        ],
        "researcher": [ModelReply(content=RESEARCH)],
        "builder": [
            ModelReply(
                content=None,
                tool_calls=(ToolCall("s", "shell", {"command": COMMAND}, json.dumps({"command": COMMAND})),),
            ),
            _tool_output,
        ],
    }
    return PerAgentScript(steps, prompts)


class Platform(Protocol):
    async def say(self, text: str) -> None: ...
    def bot_texts(self) -> list[str]: ...
    def card_texts(self) -> list[str]: ...
    async def press_approve(self) -> None: ...
    async def wait(self, needle: str) -> None: ...


@dataclass
class TelegramSide:
    fake: FakeTelegram
    chat: int = -1001

    async def say(self, text: str) -> None:
        self.fake.push_message(self.chat, 42, text, username="alice")

    def bot_texts(self) -> list[str]:
        return [m.text for m in self.fake.bot_messages(self.chat)]

    def card_texts(self) -> list[str]:
        return [m.text for m in self.fake.bot_messages(self.chat) if "Approval needed" in m.text]

    async def press_approve(self) -> None:
        card = next(m for m in self.fake.bot_messages(self.chat) if m.buttons)
        data = next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(":a"))
        query = self.fake.push_callback(self.chat, card.message_id, 111, str(data))
        await self.fake.wait_for_answer(query, timeout=10)

    async def wait(self, needle: str) -> None:
        await self.fake.wait_until(lambda: any(needle in t for t in self.bot_texts()), timeout=20)


@dataclass
class SlackSide:
    fake: FakeSlack
    adapter: SlackAdapter
    channel: str = "C0HOME0001"

    async def say(self, text: str) -> None:
        assert self.adapter.events_url is not None
        event = self.fake.message_event(channel=self.channel, user="U0ALICE01", text=text)
        await self.fake.post_event(self.adapter.events_url, event)

    def bot_texts(self) -> list[str]:
        return [m.text for m in self.fake.channel(self.channel)]

    def card_texts(self) -> list[str]:
        return [
            " ".join(m.texts()) for m in self.fake.channel(self.channel) if "Approval needed" in " ".join(m.texts())
        ]

    async def press_approve(self) -> None:
        assert self.adapter.events_url is not None
        card = next(m for m in self.fake.channel(self.channel) if m.block("kazma_actions"))
        actions = card.block("kazma_actions")
        assert actions is not None
        value = next(e["value"] for e in actions["elements"] if e["action_id"] == "kazma_approve")
        await self.fake.post_block_action(
            self.adapter.events_url,
            action_id="kazma_approve",
            value=value,
            user="U0ADMIN01",
            channel=self.channel,
            message_ts=card.ts,
        )

    async def wait(self, needle: str) -> None:
        await self.fake.wait_for(lambda: any(needle in t for t in self.bot_texts()), timeout=20)


@asynccontextmanager
async def running(
    tmp_path: Path, yaml: str, adapter: PlatformAdapter, config: LoadedConfig | None = None
) -> AsyncIterator[App]:
    loaded = config or load_config_text(yaml, environ={})
    app = await build_app(
        loaded, provider=script(loaded), adapters=[adapter], poll_interval=0.05, workspace_root=tmp_path / "ws"
    )
    await app.start()
    try:
        yield app
    finally:
        await app.conversations.drain()
        await app.stop()


@asynccontextmanager
async def telegram(tmp_path: Path) -> AsyncIterator[tuple[Platform, App]]:
    fake = FakeTelegram()
    await fake.start()
    try:
        yaml = (
            f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
            f"platforms: {{telegram: {{token: '{fake.token}', api_base_url: '{fake.base_url}',"
            " chats: [-1001], home_chat: -1001, admins: [111]}}\n"
        )
        loaded = load_config_text(yaml, environ={})
        adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1)
        async with running(tmp_path, yaml, adapter, loaded) as app:
            yield TelegramSide(fake), app
    finally:
        await fake.stop()


@asynccontextmanager
async def slack(tmp_path: Path) -> AsyncIterator[tuple[Platform, App]]:
    fake = FakeSlack()
    await fake.start()
    try:
        yaml = (
            f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
            f"platforms: {{slack: {{bot_token: '{FAKE_BOT_TOKEN}', signing_secret: '{FAKE_SIGNING_SECRET}',"
            f" api_base_url: '{fake.api_url}', http: {{port: 0}}, channels: [C0HOME0001],"
            " home_channel: C0HOME0001, admins: [U0ADMIN01]}}\n"
        )
        loaded = load_config_text(yaml, environ={})
        adapter = SlackAdapter(loaded.config.platforms.slack)
        async with running(tmp_path, yaml, adapter, loaded) as app:
            yield SlackSide(fake, adapter), app
    finally:
        await fake.stop()


@pytest.mark.parametrize("platform", ["telegram", "slack"])
async def test_request_plan_dispatch_approval_and_report(tmp_path: Path, platform: str) -> None:
    side_factory = telegram if platform == "telegram" else slack
    async with side_factory(tmp_path) as (side, app):
        await side.say("@kazma please count a run")
        await side.wait("@researcher How should we count runs?")
        await side.wait("@builder Count one run")
        await side.wait("Approval needed")
        # the researcher's summary is inside the builder's dispatch: fenced as data for the model, and shown
        # to people with a quiet label instead of the fence
        dispatch = next(t for t in side.bot_texts() if "@builder" in t)
        assert RESEARCH in dispatch
        assert "from @researcher" in dispatch
        assert all("untrusted-data" not in t and "Untrusted data" not in t for t in side.bot_texts())
        card = side.card_texts()[0]
        assert "command" in card
        assert "runs.log" in card
        await side.press_approve()
        await side.wait("Done: builder ran it")
        texts = side.bot_texts()
        order = ["@researcher", RESEARCH, "@builder", "builder result: 1", "Done: builder ran it"]
        positions = [next(i for i, t in enumerate(texts) if needle in t) for needle in order]
        assert positions == sorted(positions), texts
        runs = (tmp_path / "ws").rglob("runs.log")
        assert [p.read_text() for p in runs] == ["ran\n"]  # the command ran exactly once
        requests = await app.service.store.requests()
        assert len(requests) == 1
        admin = "telegram:111" if platform == "telegram" else "slack:U0ADMIN01"
        assert requests[0].decided_by == admin
