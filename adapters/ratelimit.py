"""Per-chat send pacing: a minimum gap between sends and a cap per rolling window.

Platforms punish bursts into one chat (Telegram: about 1 message a second per
chat and 20 a minute per group; Slack: about 1 a second per channel). Waiting
here is cheaper than a 429 and keeps every chat's order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass
class _ChatState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sent: deque[float] = field(default_factory=deque)
    blocked_until: float = 0.0


class ChatRateLimiter:
    """``await limiter.acquire(chat)`` before each send into ``chat``."""

    def __init__(
        self,
        *,
        min_interval: float = 1.0,
        per_window: int | None = None,
        window: float = 60.0,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.min_interval = min_interval
        self.per_window = per_window
        self.window = window
        self._clock = clock
        self._sleep = sleep
        self._chats: dict[str, _ChatState] = {}

    def _state(self, chat: str) -> _ChatState:
        state = self._chats.get(chat)
        if state is None:
            state = self._chats[chat] = _ChatState()
        return state

    def delay_for(self, chat: str) -> float:
        """Seconds the next send into ``chat`` would wait now (0 when it may go)."""
        state = self._state(chat)
        now = self._clock()
        waits = [state.blocked_until - now]
        if state.sent:
            waits.append(state.sent[-1] + self.min_interval - now)
        if self.per_window is not None:
            while state.sent and state.sent[0] <= now - self.window:
                state.sent.popleft()
            if len(state.sent) >= self.per_window:
                waits.append(state.sent[0] + self.window - now)
        return max(0.0, *waits)

    async def acquire(self, chat: str) -> float:
        """Wait until a send into ``chat`` is allowed, record it, return how long it waited."""
        state = self._state(chat)
        waited = 0.0
        async with state.lock:
            while (delay := self.delay_for(chat)) > 0:
                await self._sleep(delay)
                waited += delay
            state.sent.append(self._clock())
            keep = self.per_window or 1
            while len(state.sent) > keep:
                state.sent.popleft()
        return waited

    def block(self, chat: str, seconds: float) -> None:
        """The platform said 429 with ``retry_after``: hold every send into ``chat`` that long."""
        state = self._state(chat)
        state.blocked_until = max(state.blocked_until, self._clock() + seconds)
