"""Swarm workers backed by Kazma's agents: a sub-agent's turn as a :class:`WorkerResult`.

A worker run by the swarm is offered ``handoff_to_worker`` for that turn only (the
lead and plan-dispatched turns never see it). The tool checks the chain's guards
at once, so a refused handoff is answered to the model inside the same turn and
the model finishes the task itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kazma.config.limits import KIB
from kazma.engine.agent import AgentRunner, AgentSpec, InternalTool, TurnContext
from kazma.engine.fence import NOTHING, Fenced
from kazma.engine.swarm.metrics import HANDOFFS
from kazma.engine.swarm.types import (
    ErrorKind,
    HandoffOffer,
    WorkerResult,
    current_offer,
    current_starter,
    task_conversation,
)
from kazma.engine.tools.registry import ToolResult
from kazma.engine.types import ToolSpec

_PERMANENT_WORDS = ("401", "403", "404", "api key", "not found", "quota", "unknown model")
HANDOFF_TOOL = "handoff_to_worker"
MAX_HANDOFF_TEXT = 64 * KIB  # characters of the restated task, and of the context, a handoff passes on


class HandoffArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker: str = Field(min_length=1)
    reason: str = Field(min_length=1, max_length=2000)
    task: str | None = Field(default=None, max_length=MAX_HANDOFF_TEXT)
    context: str | None = Field(default=None, max_length=MAX_HANDOFF_TEXT)


@dataclass
class _Handoff:
    args: HandoffArgs | None = None


def handoff_tool(offer: HandoffOffer, chosen: _Handoff) -> InternalTool:
    """The per-turn tool: validates the target against the chain's guards and remembers an accepted handoff."""

    async def handle(arguments: Mapping[str, Any], _ctx: TurnContext) -> ToolResult:
        try:
            args = HandoffArgs.model_validate(dict(arguments))
        except ValidationError as exc:
            return ToolResult(ok=False, output="", error=f"invalid arguments: {exc.errors()[0]['msg']}")
        if chosen.args is not None:
            return ToolResult(ok=False, output="", error=f"you already handed this task to {chosen.args.worker}")
        why = offer.refusal(args.worker)
        if why is not None:
            HANDOFFS.labels(outcome="refused").inc()
            return ToolResult(ok=False, output="", error=f"handoff refused: {why}. Finish the task yourself.")
        chosen.args = args
        return ToolResult(
            ok=True,
            output=f"Handoff accepted: {args.worker} takes the task when your turn ends. "
            "End your turn now with one line on what you pass on.",
        )

    targets = ", ".join(offer.targets) or "none"
    schema = HandoffArgs.model_json_schema()
    schema["properties"]["worker"]["enum"] = list(offer.targets)
    return InternalTool(
        ToolSpec(
            HANDOFF_TOOL,
            f"Hand this task to another worker better suited to it (you may hand to: {targets}). "
            "Give the reason; optionally restate the task and pass context.",
            schema,
        ),
        handle,
    )


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

    async def run(self, prompt: str, *, context: Fenced = NOTHING) -> WorkerResult:
        text = f"{prompt}\n\n{context}" if context else prompt
        offer = current_offer()
        chosen = _Handoff()
        extra = [handoff_tool(offer, chosen)] if offer is not None and offer.targets and not self.spec.is_lead else []
        result = await self.runner.run(
            self.spec, task_conversation(self.conversation), text, requested_by=self.requested_by, extra_tools=extra,
            started_by=current_starter(),
        )  # fmt: skip
        if result.ok:
            handoff = chosen.args
            return WorkerResult(
                self.name,
                True,
                output=result.text,
                changed_state=result.changed_state,
                usage=result.usage,
                model=result.model,
                tools=result.tools,
                handoff_to=None if handoff is None else handoff.worker,
                handoff_reason="" if handoff is None else handoff.reason,
                handoff_task="" if handoff is None or handoff.task is None else handoff.task,
                handoff_context="" if handoff is None or handoff.context is None else handoff.context,
            )
        error = result.error or "failed"
        permanent = any(word in error.lower() for word in _PERMANENT_WORDS)
        kind = ErrorKind.PERMANENT if permanent or not result.transient else ErrorKind.TRANSIENT
        return WorkerResult(
            self.name,
            False,
            error=error,
            error_kind=kind,
            changed_state=result.changed_state,
            usage=result.usage,
            model=result.model,
            tools=result.tools,
        )
