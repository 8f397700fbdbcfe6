"""This replica among the others on one PostgreSQL database: its lease, its wake-ups, what it knows of the rest.

Every replica serves HTTP ingress, posts and edits cards (each claimed once in the
store) and runs the calls its agents make. What only one process may do — the
platform connections only one client may hold, recovery of what a dead replica
left, the sweeps — runs on the replica holding the leader lease
(:class:`~kazma.config.store.leader.LeaderLease`); the app hands those duties in as
``lead`` and ``follow``. Decisions and queued cards reach every replica at once
through ``LISTEN``/``NOTIFY`` (:class:`~kazma.config.store.pg_listen.PgListener`).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from kazma.adapters.bus import FanOutBus, InboundState, LeaderInbound, NullBus
from kazma.adapters.outbox import CARDS_CHANNEL, Outbox
from kazma.approvals import ApprovalService
from kazma.approvals.service import Recovery
from kazma.approvals.store import DECIDED_CHANNEL
from kazma.bot.leader_inbound import LeaderInboundRecord
from kazma.config import failpoints
from kazma.config.errors import ConfigError, Problem
from kazma.config.metrics import count_failure
from kazma.config.store.leader import LeaderLease, LeaseTiming, default_replica
from kazma.config.store.pg_listen import PgListener
from kazma.config.store.postgres import PgStore
from kazma.config.store.replicas import lease_session, live_replicas, read_only
from kazma.config.supervisor import Supervisor
from kazma.config.waits import bounded

log = structlog.get_logger("kazma.replicas")

# A replica's name is kept in the store (who owns a request, who claimed a post) and in pg_stat_activity,
# which keeps 63 bytes of a session's application_name, "kazma-lease " included.
MAX_REPLICA_NAME = 48
_REPLICA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")


class AllBut(frozenset[str]):
    """Every replica counts as alive but one: what a replica's previous life (same name) left, judged at its
    own start. Only membership is asked of it (``x in live``), never its elements."""

    def __new__(cls, gone: str) -> AllBut:
        made = super().__new__(cls)
        made.gone = gone
        return made

    gone: str

    def __contains__(self, name: object) -> bool:
        return name != self.gone


def replica_name(environ: Mapping[str, str] | None = None) -> str:
    """``KAZMA_REPLICA`` when set, else ``<host>:<pid>``: unique among the replicas alive at once."""
    env = os.environ if environ is None else environ
    given = env.get("KAZMA_REPLICA", "").strip()
    if not given:
        return default_replica()[:MAX_REPLICA_NAME]
    if len(given) > MAX_REPLICA_NAME or not _REPLICA_NAME.match(given):
        raise ConfigError(
            "KAZMA_REPLICA",
            [
                Problem(
                    "KAZMA_REPLICA",
                    f"a replica name is up to {MAX_REPLICA_NAME} letters, digits and . _ : @ -, got {given!r}",
                )
            ],
        )
    return given


# The leader records its inbound states when they change, and at least this often (seconds).
INBOUND_REWRITE_SECONDS = 60.0
# How long before a takeover the previous leadership's rows may have been written to be inherited (see
# record_inbound): its last rewrite, the takeover's wait, and clocks of replicas a little apart.
INHERIT_WITHIN_SECONDS = 3 * INBOUND_REWRITE_SECONDS

# How long /healthz waits for the database (every read it makes, together) before it says the store is
# unreachable.
HEALTH_TIMEOUT = 2.0


@dataclass(frozen=True)
class ReplicaHealth:
    replica: str
    leader: bool
    holder: str | None  # the replica holding the lease, as the database says; None: nobody, or unknown
    store_reachable: bool
    listening: bool
    problem: str | None
    # On a follower: what the lease holder recorded of its inbound connections (None on the leader)
    leader_inbound: LeaderInbound | None = None
    # This replica's lease session holds the lock (the leader, or one waiting out the old leader's grace)
    holds_lease: bool = False
    # The store answers reads and refuses writes (a hot standby, default_transaction_read_only): no press decides
    store_read_only: bool = False

    @property
    def ok(self) -> bool:
        return self.store_reachable and not self.store_read_only

    def lines(self) -> list[str]:
        lines = [
            f"replica {self.replica}: {'leader' if self.leader else 'follower'}",
            f"lease held by {self.holder or 'nobody'}",
            "store reachable, refusing writes (read-only)"
            if self.store_reachable and self.store_read_only
            else f"store {'reachable' if self.store_reachable else 'unreachable'}",
            f"wake-ups {'on' if self.listening else 'off (the safety scan covers them)'}",
        ]
        if self.problem:
            lines.append(f"problem: {self.problem}")
        return lines


class Replication:
    def __init__(
        self,
        *,
        conninfo: str,
        store: PgStore,
        replica: str,
        service: ApprovalService,
        bus: FanOutBus | NullBus,
        outbox: Outbox | None,
        lead: Callable[[], Awaitable[None]],
        follow: Callable[[str], Awaitable[None]],
        timing: LeaseTiming | None = None,
    ) -> None:
        self.store = store
        self.replica = replica
        self.service = service
        self.bus = bus
        self.outbox = outbox
        self._lead = lead
        self._follow = follow
        self.lease = LeaderLease(
            conninfo,
            name="kazma",
            replica=replica,
            on_acquired=self._acquired,
            on_lost=self._lost,
            timing=timing,
            on_locked=self._locked,
        )
        self.listener = PgListener(
            conninfo,
            (DECIDED_CHANNEL, CARDS_CHANNEL),
            self._notified,
            self._resync,
            application_name=f"kazma-listen {replica}"[:63],
        )
        self._tasks = Supervisor("replica_task")  # card edits another replica's decision asked for
        self.absence = self.lease.timing.takeover_bound  # missing this long: gone (see settled_live)
        self.clock: Callable[[], float] = time.monotonic
        self._first_look: float | None = None  # when the looks this replica judges by began
        self._last_look: float | None = None
        self._missing: dict[str, float] = {}  # a replica seen, missing from every look since this one
        self._seen: set[str] = set()
        self._stopping = False
        self.inbound_record = LeaderInboundRecord(store)
        self._recorded: dict[str, InboundState] = {}  # what this leader last recorded
        self._recorded_on: int | None = None  # ... on this lease session
        self._recorded_at = 0.0  # ... at this time
        self._health_reads: set[asyncio.Task[Any]] = set()  # health reads past their bound, still being cancelled
        # The writer's refusal count that a session opened for the question found outdated (the database took
        # writes): its next session opens now and takes them, no need to ask again until it is refused again.
        self._refusals_outdated: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    async def start(self) -> None:
        """Listen first (a decision made meanwhile is not missed), then take part in the lease, and return once
        the lease session shows this replica alive to the others (before it serves, so that no leader takes
        what it starts for a dead replica's)."""
        self.listener.start()
        if not await self.listener.wait_connected(10.0):
            log.warning("replica.listen_late", replica=self.replica, problem=self.listener.problem)
        self.lease.start()
        if not await self.lease.wait_session(10.0):
            log.warning("replica.lease_late", replica=self.replica)
        log.info("replica.started", replica=self.replica)

    async def stop(self) -> None:
        self._stopping = True  # a step-down in flight does not ask for the lease again
        await self.lease.stop()  # the lock goes with the connection: another replica leads at once
        await self.listener.stop()
        await self._tasks.stop()

    async def live(self) -> set[str]:
        """The replicas alive now (this one included, even while its lease connection reconnects)."""
        current = {*await live_replicas(self.store.pool), self.replica}
        now = self.clock()
        if self._last_look is None or now - self._last_look > self.absence:
            # No look for longer than a replica may be missing while it reconnects: what the earlier looks saw says
            # nothing of how long one missing now has been missing. The looks begin again.
            self._first_look = now
            self._missing.clear()
            self._seen.clear()
        self._last_look = now
        for name in current:
            self._missing.pop(name, None)
        for name in self._seen - current:
            self._missing.setdefault(name, now)
        self._seen |= current
        return current

    async def settled_live(self) -> set[str] | None:
        """The replicas to count as alive when judging what others left behind; None: too early to judge.

        A lease session drops and comes back in the ordinary course (a slow check, a server restart), so a
        replica missing from one look may only be reconnecting. It counts as gone once it has been missing from
        every look for longer than the lease's own takeover bound — and not before this replica has looked that
        long, without a pause as long: a replica seen at a look long ago and missing now may have been there until
        a moment ago (a follower looks only now and then; its last sighting said nothing of the time since).
        """
        current = await self.live()
        now = self.clock()
        assert self._first_look is not None
        if now - self._first_look < self.absence:
            return None
        for name in [n for n, since in self._missing.items() if now - since >= self.absence]:
            del self._missing[name]  # gone: from here it is simply not among the live
            self._seen.discard(name)
        return current | set(self._missing)

    async def recover_gone(self, live: set[str], *, leading: Callable[[], bool] | None = None) -> Recovery:
        """The approvals' part of recovery among replicas: what replicas not in ``live`` left behind.

        Their pending requests end cancelled (nobody waits for them any more; nothing ran), approved calls
        they never started are reported, and the posts and edits they had claimed are due at once instead
        of when the claims run out. ``leading``: asked before each write; once it says no, the rest is left to
        the replica that leads now (the leader's sweep passes :attr:`is_leader`).
        """
        recovery = await self.service.recover(live, leading=leading)
        if leading is not None and not leading():
            return recovery
        released = 0
        if self.outbox is not None:
            released += await self.outbox.release_claims(live)
        released += await self.service.store.release_settle_claims(live)
        if released:
            log.warning("replica.claims_released", posts_and_edits=released, live=sorted(live))
        if (released or recovery.cancelled) and isinstance(self.bus, FanOutBus):
            self.bus.rescan()
        return recovery

    async def record_inbound(self) -> None:
        """While leading (or holding the lock, waiting out the old leader's grace): record each singleton ingress's
        state for the followers' ``/healthz`` when one changed since the last record (or the lease session did: a
        row is trusted only on the session that wrote it)."""
        pid = self.lease.backend_pid
        holds = self.is_leader or self.lease.holds_lock
        if pid is None or not holds or not isinstance(self.bus, FanOutBus):
            return
        fresh = pid != self._recorded_on
        if fresh:  # before this record's forget_ended drops the previous leadership's rows
            # A leader rewrites its rows at least every INBOUND_REWRITE_SECONDS: the leadership just before this
            # one wrote within a few of those before it ended (room for its last rewrite and the takeover).
            after = time.time() - INHERIT_WITHIN_SECONDS
            self.bus.inherit_down(await self.inbound_record.down_before(pid, recorded_after=after))
        now = time.time()
        states = self.bus.inbound_states({} if fresh else self._recorded, now)
        same = {n: s.state for n, s in states.items()} == {n: s.state for n, s in self._recorded.items()}
        # Written again now and then though nothing changed: rows lost some other way (deleted by hand, a store
        # restored from a backup) are put right within that time, not at the next change. (Another replica's late
        # write cannot overwrite them: rows are keyed by their lease session.)
        if not fresh and same and now - self._recorded_at < INBOUND_REWRITE_SECONDS:
            return
        await self.inbound_record.record(self.replica, pid, states, now)
        if fresh:
            await self.inbound_record.forget_ended()
        self._recorded, self._recorded_on, self._recorded_at = states, pid, now
        if fresh or not same:  # the minute's rewrite of what did not change is no news: an info line a minute
            log.info("replica.inbound_recorded", replica=self.replica, states={n: s.state for n, s in states.items()})

    async def health(self) -> ReplicaHealth:
        holder: str | None = None
        problem: str | None = None
        reachable = True
        inbound: LeaderInbound | None = None
        held: tuple[str, int] | None = None
        leader = self.is_leader
        pid = self.lease.backend_pid

        refuses = False

        async def read() -> tuple[tuple[str, int] | None, LeaderInbound | None]:
            nonlocal refuses
            # "reachable" was told by reads alone: a database that refuses writes answered 200 on every replica
            # while every press failed to record its decision. The writer's own session counts: it is the one that
            # writes, and it may refuse while the read pool's take writes (each took the database's default
            # transaction_read_only when it opened). A refusal it met is not the answer for good: it dropped that
            # session, and once the database takes writes again its next one does (read_only asks one opened now).
            # Asked once per refusal: the refusal stands until the writer writes, and a quiet replica asked a
            # session opened for the question on every /healthz (a monitor's every second) for hours after it.
            refusals = self.store.writer_refusals
            refused = self.store.refusing_writes is not None and refusals != self._refusals_outdated
            refuses = await read_only(
                self.store.pool, self.store.conninfo, writer_refused=refused, connect_timeout=self.store.connect_timeout
            )
            if refused and not refuses:
                self._refusals_outdated = refusals
            held = await lease_session(self.store.pool, self.lease.key)
            if leader or (held is not None and pid is not None and held[1] == pid):
                # Its own lock, the grace not yet waited out: read as a follower, its empty record read as a
                # leader of an earlier release's, "serving through the leader (itself)" with nothing open.
                return held, None
            if held is None:
                return held, LeaderInbound(None, None)
            states, records = await self.inbound_record.read(*held)
            return held, LeaderInbound(held[0], states or None, records)

        unanswered = f"the store did not answer within {HEALTH_TIMEOUT:g} s"
        if self._health_reads:
            # A read given up on is still being cancelled: the store has not answered it since. Another read now
            # would only take one more pool connection for the same silence.
            reachable, problem = False, f"{unanswered} (an earlier read is still unanswered)"
        else:
            task = self._tasks.spawn(read(), name="kazma-health-read", awaited=True)
            try:
                # One wait for both reads: each bounded on its own, a slow database held /healthz twice as long.
                # The read runs as a task of its own: cancelled in place, psycopg waits for the server to cancel
                # the query (up to 5 s, then up to 5 s more before it closes the connection), and /healthz
                # answered 7 s and more after its bound while the server did not run.
                held, inbound = await bounded(asyncio.shield(task), HEALTH_TIMEOUT)
                holder = None if held is None else held[0]
            except TimeoutError:
                reachable, problem = False, unanswered
            except Exception as exc:
                reachable, problem = False, str(exc).strip() or type(exc).__name__
            finally:
                if not task.done():  # the bound passed, or this request was cancelled: the read ends behind it
                    self._give_up(task)
        if problem is None and not self.listener.connected:
            problem = self.listener.problem
        # Told by the session alone: the name the database shows is cut at 63 bytes, the replica's may be longer.
        holds = leader or (held is not None and pid is not None and held[1] == pid)
        return ReplicaHealth(
            self.replica,
            leader,
            holder,
            reachable,
            self.listener.connected,
            problem,
            inbound,
            holds_lease=holds,
            store_read_only=reachable and refuses,
        )

    def _give_up(self, task: asyncio.Task[Any]) -> None:
        """Cancel a health read past its bound without waiting for it: psycopg's cancel of the query (and its
        connection's return to the pool, or its close) goes on in the background, a task of this replica's that
        its stop waits for. Until it ends no other health read starts."""
        self._health_reads.add(task)
        task.cancel()
        given_up = time.monotonic()
        log.warning("replica.health_read_given_up", replica=self.replica, bound=HEALTH_TIMEOUT)

        def ended(done: asyncio.Task[Any]) -> None:
            self._health_reads.discard(done)
            took = round(time.monotonic() - given_up, 2)
            error = None if done.cancelled() else done.exception()
            if error is None:
                log.info("replica.health_read_ended", replica=self.replica, after=took)
                return
            # Ended by an error rather than the cancel: its connection may have been lost on the way.
            count_failure("health_read")
            log.warning("replica.health_read_failed", replica=self.replica, after=took, error=str(error))

        task.add_done_callback(ended)

    # -- the lease's callbacks (run one at a time, in order) ------------------------------------

    async def _locked(self) -> None:
        """The lock is this replica's; it leads once the old leader's grace is waited out (3.5 s by default).
        Recorded now: meanwhile the other replicas read a holder with no record at all, taken for a replica of an
        earlier release, and said "serving through the leader" with 200 of connections nobody had open."""
        try:
            await self.record_inbound()
        except Exception as exc:  # the leader's record loop writes again once it leads
            count_failure("inbound_record")
            log.warning("replica.inbound_record_failed", replica=self.replica, error=str(exc))

    async def _acquired(self) -> None:
        log.warning("replica.leading", replica=self.replica)
        try:
            if failpoints.armed:  # the lease is this replica's, none of the leader's duties started yet
                await failpoints.reached("leader.takeover", lambda: ConnectionError("the lease's duties failed"))
            await self._lead()
        except Exception as exc:
            count_failure("leader_duties")
            log.exception("replica.lead_failed", replica=self.replica, error=str(exc))
            # A leader whose duties never started polls no platform and sweeps nothing, and while it holds the
            # lease no other replica can: it gives the lease up, and another replica (or this one, asking
            # again) takes it and starts them.
            self._tasks.spawn(self._step_down(f"its leader duties failed to start: {exc}"), name="kazma-step-down")

    async def _step_down(self, reason: str) -> None:
        await self.lease.stop()  # the lock goes with the connection
        await self._lost(reason)  # what of the duties did start is stopped
        if not self._stopping:
            self.lease.start()

    async def _lost(self, reason: str) -> None:
        log.warning("replica.following", replica=self.replica, reason=reason)
        try:
            await self._follow(reason)
        except Exception as exc:
            count_failure("leader_duties")
            log.exception("replica.follow_failed", replica=self.replica, error=str(exc))

    # -- wake-ups --------------------------------------------------------------------------------

    def _notified(self, channel: str, payload: str, pid: int) -> None:
        if pid == self.store.writer_pid:
            return  # this replica's own write: it acted on it already
        if channel == DECIDED_CHANNEL and payload:
            self.service.wake(payload)  # a call waiting here goes on at once
            # the edits are claimed: one replica makes each
            settle = self.bus.settle_told if isinstance(self.bus, FanOutBus) else self.bus.settle
            self._tasks.spawn(settle(payload), name=f"kazma-settle-{payload}")
        elif channel == CARDS_CHANNEL and isinstance(self.bus, FanOutBus):
            self.bus.posts_waiting([p for p in payload.split(",") if p] or None)

    async def _resync(self) -> None:
        """After a (re)connect: what was told while nobody listened is looked for once."""
        if isinstance(self.bus, FanOutBus):
            self.bus.rescan()
        self.service.wake_all()
