"""One client's share of the anonymous sign-in challenges, so that one client cannot crowd out another's.

Anybody may ask for a sign-in challenge (passkey sign-in options, the start of Sign in with Slack / Discord):
nobody is signed in yet. The store keeps at most :data:`~kazma.bot.console.accounts.MAX_CHALLENGES` of them
per purpose and drops the oldest past that, so one client asking without pause used to push out another
person's sign-in in progress ("not begun in this browser, or took too long"). Now each client (as
:mod:`~kazma.bot.console.forwarded` finds it: an IPv6 client by its /64) may hold at most
:data:`CLIENT_CHALLENGES` of each purpose at once: asked for in a challenge's lifetime and not answered yet
(an answer, right or wrong, uses its challenge up, so it leaves the store and the client's count). Past it,
the client is answered 429 with ``Retry-After`` until its oldest ask leaves the window. People who sign in,
even many behind one address, answer their challenges and never come near it.

The state is per process: with several replicas, each counts what reaches it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from prometheus_client import Counter

from kazma.bot.console.accounts import CHALLENGE_SECONDS

CLIENT_CHALLENGES = 20  # held per client and purpose: 1/500 of a purpose's MAX_CHALLENGES
REFUSED = Counter(
    "kazma_web_challenges_refused", "Anonymous sign-in challenges refused: the client had taken its share.", ["purpose"]
)
_MAX_CLIENTS = 10_000  # (client, purpose) pairs remembered; beyond, the quiet ones are forgotten


class ChallengeShare:
    def __init__(
        self, *, clock: Callable[[], float], per_client: int = CLIENT_CHALLENGES, window: float = CHALLENGE_SECONDS
    ) -> None:
        self.clock = clock
        self.per_client = per_client
        self.window = window
        self._asked: dict[tuple[str, str], deque[float]] = {}

    def take(self, client: str, purpose: str) -> float:
        """Count one challenge for ``client``: 0.0 when it is within its share, else the seconds until it is
        (nothing counted then)."""
        now = self.clock()
        asked = self._asked.setdefault((client, purpose), deque())
        while asked and asked[0] <= now - self.window:
            asked.popleft()
        if len(asked) >= self.per_client:
            REFUSED.labels(purpose=purpose).inc()
            return max(asked[0] + self.window - now, 1.0)
        asked.append(now)
        self._forget_quiet(now)
        return 0.0

    def release(self, client: str, purpose: str) -> None:
        """A challenge of ``client``'s was answered (and so used up): it no longer counts against its share."""
        asked = self._asked.get((client, purpose))
        if asked:
            asked.popleft()

    def _forget_quiet(self, now: float) -> None:
        if len(self._asked) <= _MAX_CLIENTS:
            return
        for key in [k for k, asked in self._asked.items() if not asked or asked[-1] <= now - self.window]:
            del self._asked[key]


def too_many_challenges(wait: int) -> str:
    """What a client past its share is told."""
    return (
        f"Too many sign-in challenges asked for from here: try again in {wait} s (each one lasts "
        f"{CHALLENGE_SECONDS // 60} minutes, and one address may hold only {CLIENT_CHALLENGES} unanswered)."
    )
