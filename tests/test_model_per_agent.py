"""A model per agent: two agents on two fake OpenAI-compatible servers, each talking to its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kazma.approvals import ApprovalService, ApprovalStore, SafetyPolicy
from kazma.bot.store import open_store
from kazma.config import ConfigError, load_config_text
from kazma.engine.agent import AgentRunner, agents_from_config
from kazma.engine.history import HistoryStore
from kazma.engine.model_router import ModelRouter, provider_for
from kazma.engine.tools.registry import ToolRegistry
from tests.fakes.openai import Completion, FakeOpenAI


async def test_two_agents_talk_to_their_own_servers(tmp_path: Path) -> None:
    async with FakeOpenAI(models=("small",)) as first, FakeOpenAI(models=("big",)) as second:
        text = f"""
store: {{path: '{tmp_path / "kazma.db"}'}}
model: {{base_url: '{first.base_url}', name: small}}
models:
  big: {{base_url: '{second.base_url}', name: big}}
agents:
  lead: {{name: kazma, system_prompt: "lead prompt"}}
  workers:
    builder: {{system_prompt: "builder prompt", model: big}}
pipelines: {{quick: [builder]}}
"""
        config = load_config_text(text, environ={}).config
        provider = provider_for(config)
        assert isinstance(provider, ModelRouter)
        first.script_agent("lead prompt", Completion(content="lead here"))
        second.script_agent("builder prompt", Completion(content="builder here"))
        conn = await open_store(config)
        try:
            policy = SafetyPolicy(ApprovalService(ApprovalStore(conn), config))
            runner = AgentRunner(provider, ToolRegistry(), policy, HistoryStore(conn), workspace_root=tmp_path / "ws")
            agents = agents_from_config(config)
            lead, builder = await asyncio.gather(
                runner.run(agents["kazma"], "web:console", "hi", requested_by="web:alice"),
                runner.run(agents["builder"], "web:console", "build", requested_by="web:alice"),
            )
        finally:
            await provider.aclose()
            await conn.close()
        assert (lead.text, builder.text) == ("lead here", "builder here")
        assert [r.body["model"] for r in first.completions] == ["small"]
        assert [r.body["model"] for r in second.completions] == ["big"]
        assert first.completions[0].body["messages"][0]["content"] == "lead prompt"
        assert second.completions[0].body["messages"][0]["content"] == "builder prompt"


def test_an_agent_naming_an_unknown_model_is_refused() -> None:
    text = "models: {big: {base_url: 'http://127.0.0.1:1/v1', name: big}}\nagents: {lead: {model: huge}}\n"
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, environ={})
    assert "unknown model 'huge'" in str(caught.value)
