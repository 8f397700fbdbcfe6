"""The live dashboard: one snapshot per change, shared by every open dashboard, at most one push a second each.

Nothing polls. Whatever the dashboard shows changes only through something this process notices: an approval
opened, ended or a remembered one revoked (the approval service's listeners), a console card posted or settled,
a message in any conversation (plan dispatches and step results are messages), an executor action, a swarm
task's report or a worker call's tokens (the swarm service's listeners). Each such signal bumps a version
and wakes the followers. A follower waits out the rest of its one-second window (changes meanwhile fold into one
push), then takes the snapshot for the current version: the first follower to ask loads it, the others share it.

Among replicas on PostgreSQL, a decision made by another replica reaches this one's dashboards at once (its
NOTIFY wakes the approval service, which tells its listeners). Limitation: other changes made by another process
(a request opened or a message kept by another replica, ``kazma approvals decide`` on a SQLite store) are seen
only when something in this process changes next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

import structlog

from kazma.config.supervisor import Supervisor

log = structlog.get_logger("kazma.web")

T = TypeVar("T")


class ChangeFeed(Generic[T]):
    """Versioned change signal plus a shared, lazily loaded snapshot of what the version stands for."""

    def __init__(
        self,
        load: Callable[[], Awaitable[T]],
        *,
        min_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load = load
        self.min_interval = min_interval
        self._clock = clock
        self.version = 0
        self.loads = 0  # how many snapshots were read from the stores (tests and the log check the sharing)
        self._woken = asyncio.Event()
        self._lock = asyncio.Lock()
        self._cached: tuple[int, T] | None = None
        self._pumps = Supervisor("dashboard_task")  # one per watched source

    def touch(self, *_: object) -> None:
        """Something the dashboard shows may have changed (any arguments are ignored: usable as a listener)."""
        self.version += 1
        self._woken.set()
        self._woken = asyncio.Event()

    async def snapshot(self) -> T:
        """The snapshot of the current version, loaded once however many followers ask."""
        async with self._lock:
            if self._cached is not None and self._cached[0] == self.version:
                return self._cached[1]
            version = self.version  # a change during the load makes this snapshot stale, and is pushed next
            value = await self._load()
            self.loads += 1
            self._cached = (version, value)
            return value

    async def follow(self, *, since: int | None = None) -> AsyncIterator[T]:
        """A fresh snapshot after each change (coalesced): never two within ``min_interval`` seconds.

        ``since``: the version the follower already shows; a different one is followed by a snapshot at once.
        """
        seen = self.version if since is None else since
        last = -float("inf")
        while True:
            while self.version == seen:
                await self._woken.wait()
            wait = last + self.min_interval - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)  # rate limit: the changes of this window go out together
            seen = self.version
            value = await self.snapshot()
            last = self._clock()
            yield value

    def watch(self, source: AsyncIterator[object], wanted: Callable[[object], bool] = lambda _: True) -> None:
        """Touch on every item of ``source`` that is ``wanted``, until the feed closes or the source ends."""

        async def pump() -> None:
            try:
                async for item in source:
                    if wanted(item):
                        self.touch()
            except Exception as exc:  # a broken source must not end the server; the dashboard still reloads
                log.warning("web.dashboard_source_failed", error=str(exc))

        self._pumps.spawn(pump(), name="kazma-dashboard-feed")

    async def close(self) -> None:
        await self._pumps.stop()
