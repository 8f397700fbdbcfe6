"""Scripted providers for tests and ``kazma demo``: each agent replays its own script.

Agents run concurrently (a sub-agent starts while the lead is still finishing
its turn), so one global script order would be a race. Each request is routed
by the agent's system prompt to that agent's own :class:`ScriptedProvider`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kazma.config.models import KazmaConfig
from kazma.engine.agent import agents_from_config
from kazma.engine.model import ScriptedProvider, ScriptStep
from kazma.engine.types import Message, ModelError, ModelReply, ToolSpec

DEMO_LABEL = "scripted (demo — no model is called)"


def agent_prompts(config: KazmaConfig) -> dict[str, str]:
    """Each agent's system prompt by name: what routes a scripted request to its agent."""
    return {name: spec.system_prompt for name, spec in agents_from_config(config).items()}


class PerAgentScript:
    def __init__(
        self, scripts: Mapping[str, Sequence[ScriptStep]], prompts: Mapping[str, str], *, label: str = DEMO_LABEL
    ):
        """``scripts`` and ``prompts`` are keyed by agent name; prompts identify who is asking."""
        self._by_prompt = {prompts[name]: ScriptedProvider(steps, label=label) for name, steps in scripts.items()}
        self._names = {prompts[name]: name for name in scripts}
        self._label = label

    @property
    def label(self) -> str:
        return self._label

    def provider(self, agent_prompt: str) -> ScriptedProvider:
        return self._by_prompt[agent_prompt]

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply:
        prompt = str(messages[0].get("content", "")) if messages else ""
        provider = self._by_prompt.get(prompt)
        if provider is None:
            raise ModelError("the scripted scenario has no replies for this agent", permanent=True)
        return await provider.complete(messages, tools, model=model)
