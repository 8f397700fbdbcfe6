"""Shapes shared by the model providers, the tools and the agents."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# An OpenAI-compatible chat message: {"role": ..., "content": ..., "tool_calls": ..., "tool_call_id": ...}
Message = dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """A tool as a model sees it: OpenAI "function" tool definition."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model asked for. ``error`` is set when its arguments were not a JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str = ""
    error: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None  # what the server says the call cost (OpenAI-compatible ``usage.cost``); None: not said

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        # a cost stays unknown only while no call has reported one
        cost = None if self.cost is None and other.cost is None else (self.cost or 0.0) + (other.cost or 0.0)
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens, cost)


@dataclass(frozen=True)
class ToolUse:
    """One tool call of a turn, as a step's record keeps it: which tool, the approval it ran under, how it went."""

    name: str
    ok: bool
    approval_id: str | None = None  # the request a person decided (None: the tool needed no approval)
    refused: bool = False  # never ran: not offered, not approved, or its arguments were unreadable

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "approval_id": self.approval_id, "refused": self.refused}

    @staticmethod
    def from_json(data: Any) -> ToolUse:
        approval = data.get("approval_id")
        return ToolUse(
            str(data.get("name", "")),
            bool(data.get("ok")),
            None if approval is None else str(approval),
            bool(data.get("refused", False)),
        )


def tools_line(tools: Sequence[ToolUse]) -> str:
    """``shell (approval abc, ok), read_file (ok)``: a step's tools for people."""
    if not tools:
        return "no tools"
    parts = []
    for tool in tools:
        how = "refused" if tool.refused else "ok" if tool.ok else "failed"
        approval = f"approval {tool.approval_id}, " if tool.approval_id else ""
        parts.append(f"{tool.name} ({approval}{how})")
    return ", ".join(parts)


@dataclass(frozen=True)
class ModelReply:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    finish_reason: str | None = None


class ModelError(Exception):
    """The model could not answer. ``permanent`` errors (bad key, unknown model) are not worth retrying."""

    def __init__(
        self, message: str, *, permanent: bool, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.status = status
        self.retry_after = retry_after  # seconds the server asked to wait before trying again (a 429's Retry-After)


class ModelProvider(Protocol):
    @property
    def label(self) -> str:
        """Shown wherever the provider runs, e.g. ``openai-compatible llama3.1 at http://…`` or ``scripted (demo)``."""
        ...

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply: ...
