"""A model per agent: ``models:`` names endpoints, ``agents.*.model`` picks one, the rest use ``model:``.

The agents keep calling one :class:`ModelProvider`; the router sends each call
to the provider of the endpoint its agent named. An agent ``model`` that is not
a ``models:`` name keeps its old meaning: a model name asked of the default
endpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from kazma.config.models import KazmaConfig
from kazma.engine.model import OpenAIProvider
from kazma.engine.types import Message, ModelProvider, ModelReply, ToolSpec


class ModelRouter:
    def __init__(self, default: ModelProvider, named: Mapping[str, ModelProvider]) -> None:
        self.default = default
        self.named = dict(named)

    @property
    def label(self) -> str:
        named = "; ".join(f"{name}: {provider.label}" for name, provider in self.named.items())
        return f"{self.default.label}; {named}" if named else self.default.label

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply:
        provider = self.named.get(model) if model is not None else None
        if provider is not None:
            return await provider.complete(messages, tools)  # that endpoint's own model name
        return await self.default.complete(messages, tools, model=model)

    async def aclose(self) -> None:
        for provider in [self.default, *self.named.values()]:
            closer = getattr(provider, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()


def provider_for(config: KazmaConfig) -> ModelProvider:
    """``model:`` alone, or a router over it and every ``models:`` endpoint."""
    default = OpenAIProvider(config.model)
    if not config.models:
        return default
    return ModelRouter(default, {name: OpenAIProvider(model) for name, model in config.models.items()})
