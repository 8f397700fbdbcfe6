"""The inbound door: one ordered list of checks every arrival passes before a handler sees it.

After Bolt's middleware list: each check looks at one arrival and either passes it on (maybe changed: files
bounded) or stops it with a reason; the first stop ends the walk, nothing after it runs. The order is the
order of cost and of trust: a replayed signed request is dropped before anything is read from it; a server
the bot does not serve and a chat it does not serve before the claim across replicas (which writes); the
claim before the files, whose refusal is answered in the chat (only the replica that claimed answers).

Every chat platform runs the kit's list (:func:`chat_checks`), a platform adding what only its transport
knows (which server an event came from, which signed request carried it) as fields of the
:class:`Arrival`, never as a check of its own outside the list. The web console runs its own short list
through the same door.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

import structlog

from kazma.adapters.admission import FileBounds
from kazma.adapters.contract import Inbound

log = structlog.get_logger("kazma.adapters")

REPLAY_WINDOW: Final = 300.0  # seconds a signed request stays fresh (Slack's signature window)


@dataclass(frozen=True)
class Arrival:
    """One event at the door. ``inbound`` is None for a request not read yet (a signed HTTP request, checked
    for replays before its listener runs)."""

    platform: str
    inbound: Inbound | None = None
    key: str | None = None  # the platform's id of the event: claimed across replicas
    space: int | str | None = None  # the server (Discord's guild) the event came from, where a platform has one
    signed: tuple[str, ...] = ()  # what makes a signed request unique (its signature, event id, trigger id)
    # The event as the adapter can read it back, kept with its claim where the platform never delivers it again
    # (a Discord gateway message): a replica taking over a dead claimer's claim hands it over from there.
    kept: str | None = None


@dataclass(frozen=True)
class Stopped:
    """Why an arrival went no further: the check, its reason, and whether it counts as taken in (ignored and
    refused are handled: no next leader takes the event in again; one claimed elsewhere is not ours)."""

    check: str
    reason: str
    taken_in: bool = True
    reply: str | None = None  # what the sender is told in the chat, if anything


Verdict = Arrival | Stopped


@dataclass(frozen=True)
class Check:
    """One named step of the door."""

    name: str
    run: Callable[[Arrival], Awaitable[Verdict]]


class Ingress:
    """An ordered list of checks (the door); :meth:`admit` walks it."""

    def __init__(self, checks: Sequence[Check]) -> None:
        self.checks = tuple(checks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(check.name for check in self.checks)

    async def admit(self, arrival: Arrival) -> Verdict:
        for check in self.checks:
            verdict = await check.run(arrival)
            if isinstance(verdict, Stopped):
                return verdict
            arrival = verdict
        return arrival


class SignedRequests:
    """Signed requests seen within the signature window, so a replay inside it is dropped (in this process;
    the store remembers them across restarts and replicas)."""

    def __init__(
        self, *, window: float = REPLAY_WINDOW, limit: int = 50_000, clock: Callable[[], float] = time.monotonic
    ):
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.window = window
        self.limit = limit
        self.clock = clock

    def first_time(self, keys: Sequence[str]) -> bool:
        now = self.clock()
        while self._seen and (next(iter(self._seen.values())) <= now - self.window or len(self._seen) > self.limit):
            self._seen.popitem(last=False)
        if any(key in self._seen for key in keys):
            return False
        for key in keys:
            self._seen[key] = now
        return True


# -- the checks every chat platform runs, in this order ---------------------------------------------------


def replay_guard(seen: SignedRequests, first_in_store: Callable[[list[str]], Awaitable[bool]]) -> Check:
    """A signed request seen before (here, then in the store) is dropped, acknowledged: nothing runs twice."""

    async def run(arrival: Arrival) -> Verdict:
        keys = list(arrival.signed)
        if keys and not (seen.first_time(keys) and await first_in_store(keys)):
            return Stopped("replay_guard", "replayed")
        return arrival

    return Check("replay_guard", run)


def space_served(spaces: Callable[[], frozenset[int] | frozenset[str]]) -> Check:
    """Only events from the servers listed (none listed: every server); a direct message has no server."""

    async def run(arrival: Arrival) -> Verdict:
        allowed = spaces()
        if arrival.space is not None and allowed and arrival.space not in allowed:
            return Stopped("space_served", "guild_not_served")
        return arrival

    return Check("space_served", run)


def chat_served(serves: Callable[[Inbound], bool], *, refusal: str | None = None) -> Check:
    """Served chats, and direct messages from whom the dm policy allows."""

    async def run(arrival: Arrival) -> Verdict:
        inbound = arrival.inbound
        if inbound is not None and not serves(inbound):
            reason = "direct_not_allowed" if inbound.direct else "chat_not_served"
            return Stopped("chat_served", reason, reply=refusal)
        return arrival

    return Check("chat_served", run)


def claimed_here(claim: Callable[[str | None, str | None], Awaitable[bool]]) -> Check:
    """Only the replica that claims the event handles it (claimed with what is kept of it, see ``Arrival.kept``)."""

    async def run(arrival: Arrival) -> Verdict:
        if arrival.inbound is not None and not await claim(arrival.key, arrival.kept):
            return Stopped("claimed_here", "claimed_elsewhere", taken_in=False)
        return arrival

    return Check("claimed_here", run)


def files_within(bounds: Callable[[], FileBounds]) -> Check:
    """A person's files within the bounds, each fetch bounded too; a message over them is refused whole: an
    agent must not act on a message whose files it cannot see."""

    async def run(arrival: Arrival) -> Verdict:
        inbound = arrival.inbound
        if inbound is None or not inbound.attachments or inbound.from_bot:
            return arrival
        files = bounds()
        problem = files.problem(inbound.attachments)
        if problem is not None:
            return Stopped("files_within", "files_refused", reply=problem)
        bounded = tuple(files.bounded(a) for a in inbound.attachments)
        return replace(arrival, inbound=replace(inbound, attachments=bounded))

    return Check("files_within", run)
