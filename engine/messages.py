"""Every message Kazma sends a model is made here, by these few constructors and nowhere else.

A guard test holds the engine to it: a model message (a dict with a ``role``)
built anywhere but this module fails it. Text that came from a worker or a
tool arrives as :class:`~kazma.engine.fence.Fenced` (only the fence makes one),
so what a model reads of other models and tools is data, never instructions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kazma.engine.fence import Fenced
from kazma.engine.types import Message, ToolCall


def system(instruction: str) -> Message:
    """Kazma's own instruction, or a system prompt from kazma.yaml."""
    return {"role": "system", "content": instruction}


def user(text: str) -> Message:
    """What the turn is asked: a person's message, or a step or task Kazma composed (its data already fenced)."""
    return {"role": "user", "content": text}


def user_with_data(question: str, data: Fenced) -> Message:
    """A question, then worker or tool output it is about, fenced."""
    return {"role": "user", "content": f"{question}\n\n{data}" if data else question}


def assistant_calls(content: str | None, calls: Sequence[ToolCall]) -> Message:
    """The model's own turn that asked for tools, sent back to it as it was."""
    return {
        "role": "assistant",
        "content": content or "",
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.raw_arguments or json.dumps(call.arguments)},
            }
            for call in calls
        ],
    }


def tool_reply(call_id: str, content: Fenced | str) -> Message:
    """A tool call's answer: a tool's output fenced, or Kazma's own sentence (a refusal, an internal tool)."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def replayed(role: str, content: str) -> Message:
    """A message of the agent's own history, as it was first sent (or answered) in an earlier turn."""
    return {"role": role, "content": content}
