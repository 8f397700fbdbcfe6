"""Scripted providers for tests and ``kazma demo``: each agent replays its own script.

Agents run concurrently (a sub-agent starts while the lead is still finishing
its turn), so one global script order would be a race. Each request is routed
by the agent's system prompt to that agent's own :class:`ScriptedProvider`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
        self,
        scripts: Mapping[str, Sequence[ScriptStep]],
        prompts: Mapping[str, str],
        *,
        label: str = DEMO_LABEL,
        after: Mapping[str, Callable[[Sequence[Message]], ModelReply]] | None = None,
        otherwise: Callable[[Sequence[Message]], ModelReply] | None = None,
    ):
        """``scripts`` and ``prompts`` are keyed by agent name; prompts identify who is asking.

        ``after`` answers an agent once its script is used up, as often as it is asked (the demo's
        workers keep working for ``/swarm``, its lead says how to connect a real model); ``otherwise``
        answers a request from no known agent (a swarm synthesis). Without them, running out is an error.
        """
        after = after or {}
        names = [*scripts, *(name for name in after if name not in scripts)]
        self._by_prompt = {prompts[name]: ScriptedProvider(scripts.get(name, ()), label=label) for name in names}
        self._names = {prompts[name]: name for name in names}
        self._after = {prompts[name]: reply for name, reply in after.items()}
        self._otherwise = otherwise
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
            if self._otherwise is not None:
                return self._otherwise(messages)
            raise ModelError("the scripted scenario has no replies for this agent", permanent=True)
        after = self._after.get(prompt)
        if after is not None and provider.remaining == 0:
            return after(messages)
        return await provider.complete(messages, tools, model=model)
