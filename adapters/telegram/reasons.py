"""Deny with a reason on Telegram, which has no modal: the press posts a prompt replying to the card, and the
presser's reply to that prompt, within :data:`~kazma.adapters.deny_reason.REPLY_WINDOW_SECONDS`, is the reason.
A reply by anybody else, or after the window, is no reason (the presser is told; it is not handed to the
agents either). The prompts live in this process: Telegram's updates reach one replica (its poller)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kazma.adapters.deny_reason import REPLY_WINDOW_SECONDS

_LIMIT = 1000  # prompts remembered at once: the oldest go first


@dataclass(frozen=True)
class Prompt:
    user: int  # only this person's reply counts
    data: str  # the plain Deny's data (kz1:<id>:d)
    card_message: str  # the card it is about, where the press was
    expires_at: float


class ReasonPrompts:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, window: float = REPLY_WINDOW_SECONDS) -> None:
        self.clock = clock
        self.window = window
        self._open: dict[tuple[str, str], Prompt] = {}

    def open(self, chat: str, prompt_message: str, *, user: int, data: str, card_message: str) -> None:
        while len(self._open) >= _LIMIT:
            del self._open[next(iter(self._open))]
        self._open[(chat, prompt_message)] = Prompt(user, data, card_message, self.clock() + self.window)

    def is_open(self, chat: str, prompt_message: str) -> bool:
        """Whether a reply to ``prompt_message`` would be read as a reason (the prompt is known here: it is
        registered once its post's answer came back, a moment after the prompt shows in the chat)."""
        return (chat, prompt_message) in self._open

    def answer(self, chat: str, replied_to: str, user: int) -> tuple[Prompt | None, str | None]:
        """The prompt ``user``'s reply answers (taken: it answers once), or why it answers none (None, None: the
        reply is not to a prompt at all)."""
        prompt = self._open.get((chat, replied_to))
        if prompt is None:
            return None, None
        if prompt.user != user:
            return None, "only the person who pressed Deny with reason can give its reason"
        del self._open[(chat, replied_to)]
        if self.clock() > prompt.expires_at:
            return None, "too late for that reason: press Deny with reason on the card again"
        return prompt, None
