"""An answer shown while the model writes it: the text so far, handed from the model client to whoever shows it.

The conversation opens a stream for a turn whose reply can be edited in place (``AgentRunner.run(stream=…)``);
the agent hands it to the model client for each model call only (:func:`feeding`), never to the tools it runs,
so a sub-agent started by a tool cannot write into the lead's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol

__all__ = ["AnswerStream", "current", "feeding"]


class AnswerStream(Protocol):
    def grew(self, text: str) -> None:
        """The reply's text so far (the whole of it, not the newest piece)."""

    def dropped(self) -> None:
        """The reply turned out to ask for tools: what was shown of it is not the answer (it stays as said)."""


_current: ContextVar[AnswerStream | None] = ContextVar("kazma_answer_stream", default=None)


def current() -> AnswerStream | None:
    """The stream the model call in progress writes into (None: answer all at once)."""
    return _current.get()


@contextlib.contextmanager
def feeding(stream: AnswerStream | None) -> Iterator[None]:
    token = _current.set(stream)
    try:
        yield
    finally:
        _current.reset(token)
