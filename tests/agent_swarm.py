"""Swarm workers that are real agents talking to the wire-level fake model (OpenAIProvider on 127.0.0.1)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from kazma.approvals import ApprovalService, SafetyPolicy
from kazma.config import KazmaConfig
from kazma.config.models import ModelConfig
from kazma.config.store.database import open_database
from kazma.engine.agent import AgentRunner, AgentSpec
from kazma.engine.history import MIGRATIONS as HISTORY
from kazma.engine.history import HistoryStore
from kazma.engine.model import OpenAIProvider
from kazma.engine.swarm.types import Worker
from kazma.engine.swarm.workers import HANDOFF_TOOL, AgentWorker
from kazma.engine.tools.builtin import default_registry
from tests.approvals_support import RecordingPublisher, approval_service
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall, RecordedRequest

MODEL = "fake-model"


def prompt_of(name: str) -> str:
    return f"You are {name}."


def handoff(to: str, reason: str) -> Completion:
    args = {"worker": to, "reason": reason, "context": f"notes for {to}"}
    return Completion(tool_calls=(FakeToolCall(HANDOFF_TOOL, json.dumps(args)),), usage=(10, 2))


def say(text: str, *, usage: tuple[int, int] = (3, 1), cost: float | None = None) -> Completion:
    return Completion(content=text, usage=usage, cost=cost)


def requests_of(model: FakeOpenAI, name: str) -> list[RecordedRequest]:
    """The chat requests one agent made, in order (its system prompt is the first message)."""
    return [r for r in model.completions if r.body["messages"][0]["content"] == prompt_of(name)]


def offered_tools(request: RecordedRequest) -> list[str]:
    return [t["function"]["name"] for t in request.body.get("tools", [])]


def user_text(request: RecordedRequest) -> str:
    return str([m for m in request.body["messages"] if m["role"] == "user"][-1]["content"])


@dataclass
class Agents:
    workers: dict[str, Worker]
    model: FakeOpenAI
    approvals: ApprovalService
    publisher: RecordingPublisher
    runner: AgentRunner


@asynccontextmanager
async def agent_workers(
    tmp_path: Path, names: Sequence[str], cfg: KazmaConfig, *, tools: dict[str, tuple[str, ...]] | None = None
) -> AsyncIterator[Agents]:
    """Agent workers named ``names`` (system prompt ``You are <name>.``) on one fake model server."""
    publisher = RecordingPublisher()
    async with FakeOpenAI(models=(MODEL,)) as model:
        provider = OpenAIProvider(ModelConfig(base_url=model.base_url, name=MODEL, max_retries=0))
        history = await open_database(tmp_path / "history.db", migrations=HISTORY)
        try:
            async with approval_service(
                tmp_path / "approvals.db", config=cfg, publisher=publisher, poll_interval=0.01
            ) as approvals:
                runner = AgentRunner(
                    provider,
                    default_registry(),
                    SafetyPolicy(approvals),
                    HistoryStore(history),
                    workspace_root=tmp_path / "workspaces",
                )
                workers: dict[str, Worker] = {
                    name: AgentWorker(AgentSpec(name, prompt_of(name), (tools or {}).get(name, ())), runner, "swarm")
                    for name in names
                }
                yield Agents(workers, model, approvals, publisher, runner)
        finally:
            await provider.aclose()
            await history.close()
