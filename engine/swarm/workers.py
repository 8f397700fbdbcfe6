"""Swarm workers backed by Kazma's agents: a sub-agent's turn as a :class:`WorkerResult`."""

from __future__ import annotations

from dataclasses import dataclass

from kazma.engine.agent import AgentRunner, AgentSpec
from kazma.engine.swarm.types import ErrorKind, WorkerResult

_PERMANENT_WORDS = ("401", "403", "404", "api key", "not found", "quota", "unknown model")


@dataclass
class AgentWorker:
    spec: AgentSpec
    runner: AgentRunner
    conversation: str
    expertise: tuple[str, ...] = ()
    requested_by: str = "swarm"

    @property
    def name(self) -> str:
        return self.spec.name

    async def run(self, prompt: str, *, context: str = "") -> WorkerResult:
        text = f"{prompt}\n\n{context}" if context else prompt
        result = await self.runner.run(self.spec, self.conversation, text, requested_by=self.requested_by)
        if result.ok:
            return WorkerResult(
                self.name, True, output=result.text, changed_state=result.changed_state, usage=result.usage
            )
        error = result.error or "failed"
        permanent = any(word in error.lower() for word in _PERMANENT_WORDS)
        kind = ErrorKind.PERMANENT if permanent or not result.transient else ErrorKind.TRANSIENT
        return WorkerResult(
            self.name, False, error=error, error_kind=kind, changed_state=result.changed_state, usage=result.usage
        )
