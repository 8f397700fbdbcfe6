"""The waiters of this process, per request: woken by a decision, read once per wake-up, swept as a safety net.

Every caller waiting for one request (an agent's tool call, an API long-poll, an ``/mcp`` call) shares one
event, set the moment the request ends here (``ApprovalService._ended``, right after the commit) or another
replica says so (``NOTIFY``). The event lives as long as anybody waits for the request: a waiter that gives up
(a long-poll's own timeout) never takes it away from the others.

A wake-up is read once for all of them, before any of them runs: the wake-up itself reads the request and
sets the event when the read is in, so each waiter runs once and takes what was read (500 waiters of one
request cost one query and 500 task steps, not 500 reads, nor twice 500 steps each parked on the read). A
waiter that finds no outcome read (the read failed, or the request is still pending) reads itself, shared
with the others as before. What ended stays known while anybody waits.

Decisions this process cannot hear of (another process on the same SQLite file, the CLI; a ``NOTIFY`` lost
with its connection) are found by one sweep every ``every`` seconds: a single query for all the waited
requests, never one read per waiter. The sweep is a kept loop of its own supervisor (``approval_wait_task``):
a store error is one sweep's failure (counted at ``approval_wait``, tried at the next), and anything else is
logged as ``task.failed``, counted, and the sweep started again after the one backoff. It ended silently on
anything but a store error, and from then on nothing found what ended unheard until another waiter joined.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import structlog

from kazma.approvals.model import ApprovalRequest
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.store.errors import store_errors
from kazma.config.supervisor import Supervisor

log = structlog.get_logger("kazma.approvals")

# At most this many ids in one sweep query (SQLite's default limit on parameters is far above it).
SWEEP_CHUNK = 500
# How soon a sweep that failed unexpectedly starts again (the n-th failure in a row waits longer, up to the cap).
SWEEP_RESTART = Backoff(base=1.0, cap=30.0)

Load = Callable[[], Awaitable[ApprovalRequest | None]]
# request id -> the request as stored now (what a wake-up reads for every waiter of it)
LoadById = Callable[[str], Awaitable[ApprovalRequest | None]]
# (waited request ids) -> those of them that ended
EndedAmong = Callable[[Sequence[str]], Awaitable[list[str]]]
# A number that changes whenever the store may have changed (None: it cannot say, so always look)
CommitsSeen = Callable[[], Awaitable[int | None]]


class Watch:
    """The waiters of one request: one event, one read per wake-up, the request once it ended."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.waiters = 0
        self.ended: ApprovalRequest | None = None
        self.deadline: float | None = None  # the request's, by the service's clock, once read
        self._reading: asyncio.Future[ApprovalRequest | None] | None = None
        self._expiring: asyncio.Future[object] | None = None

    async def read(self, load: Load) -> ApprovalRequest | None:
        """The request as stored now; a read already under way is shared, an ended request is not read again."""
        if self.ended is not None:
            return self.ended
        # Shielded: a waiter cancelled mid-read (a long-poll that timed out) must not cancel the others' read.
        return await asyncio.shield(self._start_read(load))

    def woken(self, load: Load) -> None:
        """Something may have ended the request: read it once, then wake every waiter (each finds it read)."""
        if self.ended is not None:
            self.event.set()
            return
        # Set whatever the read found (or if it failed): a waiter that finds no outcome reads again itself, and a
        # wake-up during this read is not lost (the read after it is the waiter's).
        self._start_read(load).add_done_callback(lambda _: self.event.set())

    def _start_read(self, load: Load) -> asyncio.Future[ApprovalRequest | None]:
        if self._reading is None:
            # Cleared before the read: a wake-up that lands while it runs is read again, never lost.
            self.event.clear()
            self._reading = asyncio.ensure_future(load())
            self._reading.add_done_callback(self._read_done)
        return self._reading

    async def expire(self, end: Callable[[], Awaitable[object]]) -> None:
        """End the request at its deadline once for all its waiters (``end``); one that failed is tried again."""
        if self._expiring is None:
            self._expiring = asyncio.ensure_future(end())
            self._expiring.add_done_callback(self._expire_done)
        await asyncio.shield(self._expiring)

    def _expire_done(self, ending: asyncio.Future[object]) -> None:
        if ending.cancelled() or ending.exception() is not None:
            self._expiring = None  # the next waiter past the deadline tries again

    def _read_done(self, reading: asyncio.Future[ApprovalRequest | None]) -> None:
        self._reading = None
        if reading.cancelled() or reading.exception() is not None:
            return  # every waiter awaiting it gets the error; a later wake-up reads again
        found = reading.result()
        if found is not None and found.outcome() is not None:
            self.ended = found  # final: no later read can say otherwise


class Waiters:
    """The requests waited for in this process, and the sweep that finds what ended elsewhere unheard."""

    def __init__(
        self,
        ended_among: EndedAmong,
        every: float,
        clock: Callable[[], float],
        commits_seen: CommitsSeen | None = None,
        load: LoadById | None = None,
    ) -> None:
        self.ended_among = ended_among
        self.load = load  # None: a wake-up only sets the event, and the first waiter to run reads for all
        self.commits_seen = commits_seen
        self._seen: int | None = None  # what commits_seen said at the last sweep that looked
        self.every = every
        self.clock = clock
        self.watches: dict[str, Watch] = {}
        self.restart = SWEEP_RESTART
        self._tasks = Supervisor("approval_wait_task")
        self._sweep: asyncio.Task[None] | None = None

    def join(self, request_id: str) -> Watch:
        watch = self.watches.get(request_id)
        if watch is None:
            watch = self.watches[request_id] = Watch()
        watch.waiters += 1
        if self._sweep is None or self._sweep.done():
            self._sweep = self._tasks.keep(self._sweeping, name="kazma-approval-waiters-sweep", backoff=self.restart)
        return watch

    def leave(self, request_id: str, watch: Watch) -> None:
        watch.waiters -= 1
        if watch.waiters <= 0 and self.watches.get(request_id) is watch:
            del self.watches[request_id]
        if not self.watches and self._sweep is not None:
            self._sweep.cancel()  # nobody waits: no sweeping either
            self._sweep = None

    def wake(self, request_id: str, ended: ApprovalRequest | None = None) -> None:
        """Something may have ended ``request_id``: its waiters read it (once for all). ``ended``: it ended, and
        this is the request as that commit left it: nothing to read."""
        watch = self.watches.get(request_id)
        if watch is None:
            return
        if ended is not None and ended.status.final:
            if watch.ended is None:
                watch.ended = ended
            watch.event.set()
            return
        load = self.load
        if load is None:
            watch.event.set()
        else:
            watch.woken(lambda: load(request_id))

    def wake_all(self) -> None:
        for request_id in list(self.watches):
            self.wake(request_id)

    async def _sweeping(self) -> None:
        while self.watches:
            await asyncio.sleep(self.every)
            await self.sweep()

    async def sweep(self) -> None:
        """Wake the waiters of every waited request that ended (one query per ``SWEEP_CHUNK`` requests) or whose
        deadline passed (they end it). Skipped when nothing was committed since the last sweep that looked."""
        if not self.watches:
            return
        try:
            # Taken before the list of what is waited for: a commit after it is looked at by the next sweep, and a
            # waiter that joins after the list reads its request itself, after that commit.
            seen = None if self.commits_seen is None else await self.commits_seen()
        except store_errors() as exc:
            count_failure("approval_wait")
            log.warning("approvals.wait_sweep_failed", waited=len(self.watches), error=str(exc))
            return
        now = self.clock()
        waited: list[str] = []
        for request_id, watch in list(self.watches.items()):
            if watch.deadline is not None and watch.deadline <= now:
                watch.event.set()
            elif watch.ended is None:
                waited.append(request_id)
        if seen is not None and seen == self._seen:
            return  # nothing committed since the last look: nothing can have ended
        for start in range(0, len(waited), SWEEP_CHUNK):
            try:
                ended = await self.ended_among(waited[start : start + SWEEP_CHUNK])
            except store_errors() as exc:  # a passing lock: the next sweep tries again
                count_failure("approval_wait")
                log.warning("approvals.wait_sweep_failed", waited=len(waited), error=str(exc))
                return
            for request_id in ended:
                self.wake(request_id)
        self._seen = seen
