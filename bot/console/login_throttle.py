"""How guessing a console token is kept slow without ever refusing the right token.

Every login is checked, in constant time, whoever sends it: a right token is never refused because of
somebody else's wrong ones (behind a proxy without ``web.trusted_proxies`` everyone is one client, and a
stranger's guesses used to lock the whole team out). What is slowed is the *wrong* answer:

- a client's first few wrong tokens in a window are answered at once (typos happen);
- past them the client is *slowed*: its attempts are checked one at a time, and each wrong one is held
  before it is answered (1 s, doubling up to 30 s) while the next attempt from that client waits for its
  turn. A right token waiting its turn behind a held guess is accepted when its turn comes;
- all slowed attempts together are checked a few at a time, so many connections or many addresses cannot
  multiply the rate; and when the wrong tokens answered at once, from everyone in a window, pass a bound
  (a spray from many addresses, each within its own few), every client's attempts are slowed that way.

So a guesser tests at most a handful of tokens per hold, whatever it opens, and a person with the right token
waits at most for the turns ahead of them — they are never told no. The state is per process: with several
replicas, each slows what reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

LOGIN_FAILURES = 5  # wrong logins per client in a window answered at once
LOGIN_WINDOW = 60.0  # seconds a wrong login counts
TEAM_FAILURES = 100  # wrong logins answered at once, from everyone in a window, before every client is slowed
FIRST_HOLD = 1.0  # seconds a slowed client's first wrong login is held; each next one twice as long…
LAST_HOLD = 30.0  # …up to this
CHECKS_AT_ONCE = 4  # slowed attempts checked (or held) at the same time, all clients together
LOGINS = Counter(
    "kazma_web_logins", "Console logins by outcome: accepted, wrong (answered at once), held (slowed).", ["outcome"]
)
_MAX_CLIENTS = 10_000  # clients remembered; beyond, the quiet ones are forgotten (bounded memory under a spray)


@dataclass
class _Turn:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class LoginThrottle:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
        failures: int = LOGIN_FAILURES,
        window: float = LOGIN_WINDOW,
        team_failures: int = TEAM_FAILURES,
        checks_at_once: int = CHECKS_AT_ONCE,
    ) -> None:
        self.clock = clock
        self.pause = pause  # how a wrong answer is held (the tests watch it instead of waiting)
        self.failures = failures
        self.window = window
        self.team_failures = team_failures
        self._seen: dict[str, deque[float]] = {}
        self._team: deque[float] = deque()
        self._turns: dict[str, _Turn] = {}
        self._gate = asyncio.Semaphore(checks_at_once)

    def slowed(self, client: str) -> bool:
        """Whether ``client``'s attempts wait for their turn and its wrong ones are held."""
        return len(self._recent(client)) >= self.failures or len(self._prune(self._team)) >= self.team_failures

    def failed(self, client: str) -> float:
        """Count a wrong login; returns how long its answer is held (0: answered at once)."""
        now = self.clock()
        recent = self._seen.setdefault(client, deque())
        self._prune(recent).append(now)
        self._forget_quiet()
        over = len(recent) - self.failures
        if over <= 0 and len(self._prune(self._team)) < self.team_failures:
            self._team.append(now)  # the team's bound counts the wrong logins answered at once
            return 0.0
        return min(LAST_HOLD, FIRST_HOLD * 2.0 ** max(0, over - 1))

    def retry_after(self, client: str) -> float:
        """Seconds until ``client``'s oldest counted wrong login leaves the window."""
        recent = self._recent(client)
        return max(0.0, recent[0] + self.window - self.clock()) if recent else 0.0

    def waiting(self, client: str) -> int:
        """Attempts of ``client`` in or waiting for their turn."""
        turn = self._turns.get(client)
        return turn.users if turn is not None else 0

    @contextlib.asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        """One attempt of a slowed client at a time, and a few of all slowed clients together."""
        turn = self._turns.setdefault(client, _Turn())
        turn.users += 1
        try:
            async with turn.lock, self._gate:
                yield
        finally:
            turn.users -= 1
            if turn.users == 0:
                self._turns.pop(client, None)

    def _prune(self, times: deque[float]) -> deque[float]:
        while times and times[0] <= self.clock() - self.window:
            times.popleft()
        return times

    def _recent(self, client: str) -> deque[float]:
        times = self._seen.get(client)
        if times is None:
            return deque() if client not in self._seen else self._seen[client]
        return self._prune(times)

    def _forget_quiet(self) -> None:
        if len(self._seen) <= _MAX_CLIENTS:
            return
        for client in [c for c, times in self._seen.items() if not self._prune(times)][: _MAX_CLIENTS // 2]:
            del self._seen[client]
