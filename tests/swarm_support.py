"""Scripted swarm workers for tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kazma.engine.swarm.types import WorkerResult

Reply = WorkerResult | Callable[[str, str], WorkerResult]


@dataclass
class ScriptedWorker:
    """A worker that answers from a script and records what it was asked."""

    name: str
    replies: list[Reply] = field(default_factory=list)
    expertise: tuple[str, ...] = ()
    seen: list[tuple[str, str]] = field(default_factory=list)
    gate: asyncio.Event | None = None

    async def run(self, prompt: str, *, context: str = "") -> WorkerResult:
        self.seen.append((prompt, context))
        if self.gate is not None:
            await self.gate.wait()
        reply = self.replies.pop(0) if self.replies else WorkerResult(self.name, True, output=f"{self.name} ok")
        return reply(prompt, context) if callable(reply) else reply
