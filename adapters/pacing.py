"""Pacing: a minimum gap between sends into one chat, a cap per rolling window, and 429s waited out.

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
from typing import TypeVar

from kazma.adapters import call_note
from kazma.config.waits import until_set

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass
class _ChatState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sent: deque[float] = field(default_factory=deque)
    blocked_until: float = 0.0
    # Card edits announced and not yet sent: until when each holds ordinary sends back.
    expected: list[float] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def expecting(self, now: float) -> float | None:
        """Until when ordinary sends wait for an announced edit, or None when none is due."""
        self.expected = [until for until in self.expected if until > now]
        return max(self.expected) if self.expected else None

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ChatRateLimiter:
    """``await limiter.acquire(chat)`` before each send into ``chat``.

    Ordinary sends take turns in arrival order. An urgent send (a card edit:
    a decision people are waiting to see) skips that queue and takes the
    chat's next slot; :meth:`expect` announces one before it is made, so a
    reply racing it (the agent answering that very decision) waits for it —
    for at most ``expect_seconds``, so an edit that never comes holds nobody.
    The chat's limits hold for every send alike.
    """

    def __init__(
        self,
        *,
        min_interval: float = 1.0,
        per_window: int | None = None,
        window: float = 60.0,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        windowed: Callable[[str], bool] | None = None,
        expect_seconds: float = 5.0,
        drafts_leave: int = 0,
    ) -> None:
        if per_window is not None and not 0 <= drafts_leave < per_window:
            raise ValueError("drafts_leave must leave drafts at least one send of per_window")
        self.min_interval = min_interval
        # Of a capped window, the sends a draft (a streamed reply's edit) may not take: kept for cards and new
        # messages, so a long reply growing in a group never makes a card wait out the platform's minute.
        self.drafts_leave = drafts_leave
        self.expect_seconds = expect_seconds
        self.per_window = per_window
        # Which chats the per-window cap applies to (Telegram caps groups, not private chats); None: all.
        self.windowed = windowed
        self.window = window
        self._clock = clock
        self._sleep = sleep
        self._chats: dict[str, _ChatState] = {}

    def _state(self, chat: str) -> _ChatState:
        state = self._chats.get(chat)
        if state is None:
            state = self._chats[chat] = _ChatState()
        return state

    def delay_for(self, chat: str, *, draft: bool = False) -> float:
        """Seconds the next send into ``chat`` would wait now (0 when it may go); ``draft``: a send that may
        be late (it shows text that a later send shows again), which leaves ``drafts_leave`` of the window."""
        state = self._state(chat)
        now = self._clock()
        waits = [state.blocked_until - now]
        if state.sent:
            waits.append(state.sent[-1] + self.min_interval - now)
        if self.per_window is not None and (self.windowed is None or self.windowed(chat)):
            while state.sent and state.sent[0] <= now - self.window:
                state.sent.popleft()
            cap = self.per_window - self.drafts_leave if draft else self.per_window
            if len(state.sent) >= cap:
                # the window has room again when enough of its oldest sends have left it
                waits.append(state.sent[len(state.sent) - cap] + self.window - now)
        return max(0.0, *waits)

    async def acquire(self, chat: str, *, urgent: bool = False, draft: bool = False) -> float:
        """Wait until a send into ``chat`` is allowed, record it, return how long it waited (``draft``: see
        :meth:`delay_for`)."""
        state = self._state(chat)
        waited = 0.0
        if urgent:
            while (delay := self.delay_for(chat)) > 0:
                await self._sleep(delay)
                waited += delay
            self._record(state)
            return waited
        async with state.lock:
            while True:
                started = self._clock()
                until = state.expecting(started)
                if until is not None:
                    # An announced edit goes first; woken when it went, or when the announcement lapses.
                    await until_set(state.changed, until - started)
                    waited += self._clock() - started
                    continue
                delay = self.delay_for(chat, draft=draft)
                if delay <= 0:
                    break
                await self._sleep(delay)
                waited += delay
            self._record(state)
        return waited

    def _record(self, state: _ChatState) -> None:
        state.sent.append(self._clock())
        keep = self.per_window or 1
        while len(state.sent) > keep:
            state.sent.popleft()

    def expect(self, chat: str) -> None:
        """An urgent send into ``chat`` is coming: ordinary sends there wait for it."""
        self._state(chat).expected.append(self._clock() + self.expect_seconds)

    def expected_done(self, chat: str) -> None:
        """The announced send went, or will not come: stop holding ordinary sends for it."""
        state = self._state(chat)
        if state.expected:
            state.expected.pop(0)
            state.notify()

    def block(self, chat: str, seconds: float) -> None:
        """The platform said 429 with ``retry_after``: hold every send into ``chat`` that long."""
        state = self._state(chat)
        state.blocked_until = max(state.blocked_until, self._clock() + seconds)


T = TypeVar("T")
RetryAfterOf = Callable[[BaseException], "float | None"]


class Pacing:
    """Per-chat pacing and the platform's "slow down" answers, as one object every transport calls.

    ``run(chat, call)`` waits for the chat's turn, makes the call, and when the
    platform answers 429 with a ``retry_after`` it holds every send into that
    chat that long and tries again — at most ``max_attempts`` times, and never
    for a wait longer than ``max_wait`` (then the error goes up with its
    ``retry_after``, and the durable outbox retries later instead of a caller
    hanging). Which exceptions mean 429 is the platform's to say
    (``retry_after_of``); every other exception passes straight through.
    """

    def __init__(
        self,
        limiter: ChatRateLimiter | None = None,
        *,
        max_attempts: int = 5,
        max_wait: float = 30.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.limiter = limiter
        self.max_attempts = max_attempts
        self.max_wait = max_wait

    async def run(
        self,
        chat: str | None,
        call: Callable[[], Awaitable[T]],
        *,
        retry_after_of: RetryAfterOf,
        on_rate_limited: Callable[[float, int], None] | None = None,
        urgent: bool = False,
        draft: bool = False,
    ) -> T:
        attempt = 1
        while True:
            if self.limiter is not None and chat is not None:
                call_note.moved("turn")
                await self.limiter.acquire(chat, urgent=urgent, draft=draft)
            call_note.moved("sent")
            try:
                return await call()
            except Exception as exc:
                wait = retry_after_of(exc)
                if wait is None:
                    raise
                if self.limiter is not None and chat is not None:
                    self.limiter.block(chat, wait)
                if on_rate_limited is not None:
                    on_rate_limited(wait, attempt)
                if attempt >= self.max_attempts or wait > self.max_wait:
                    raise
                if self.limiter is None or chat is None:
                    await asyncio.sleep(wait)  # nothing else will hold this call back
                attempt += 1
