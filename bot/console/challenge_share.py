"""One client's share of the anonymous sign-in challenges, so that one client cannot crowd out another's.

Anybody may ask for a sign-in challenge (passkey sign-in options, the start of Sign in with Slack / Discord):
nobody is signed in yet. The store keeps at most :data:`~kazma.bot.console.accounts.MAX_CHALLENGES` of them
per purpose and drops the oldest past that, so one client asking without pause used to push out another
person's sign-in in progress ("not begun in this browser, or took too long"). Now each client (as
:mod:`~kazma.bot.console.forwarded` finds it: an IPv6 client by its /64) may hold at most
:data:`CLIENT_CHALLENGES` of each purpose at once: asked for in a challenge's lifetime and not answered yet
(an answer, right or wrong, uses its challenge up, so it leaves the store and the client's count). Past it,
the client is answered 429 with ``Retry-After`` until its oldest ask expires. People who sign in, even many
behind one address, answer their challenges and never come near it.

The count is the store's (:meth:`~kazma.bot.console.accounts.AccountStore.challenge`: the client's unanswered
rows), so with several replicas a sign-in begun on one and answered on another gives its share back. (A count
per process did not: the replica that counted the ask never saw the answer.) Two replicas asked at the same
instant by one client may let it hold one or two more than its share; the bound is a fairness bound, not a
lock.
"""

from __future__ import annotations

from prometheus_client import Counter

from kazma.bot.console.accounts import CHALLENGE_SECONDS, CLIENT_CHALLENGES

__all__ = ["CLIENT_CHALLENGES", "REFUSED", "too_many_challenges"]

REFUSED = Counter(
    "kazma_web_challenges_refused", "Anonymous sign-in challenges refused: the client had taken its share.", ["purpose"]
)


def too_many_challenges(wait: int) -> str:
    """What a client past its share is told."""
    return (
        f"Too many sign-in challenges asked for from here: try again in {wait} s (each one lasts "
        f"{CHALLENGE_SECONDS // 60} minutes, and one address may hold only {CLIENT_CHALLENGES} unanswered)."
    )
