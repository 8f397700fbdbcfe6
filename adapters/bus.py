"""The bus: every connected platform behind one object.

``FanOutBus`` puts each approval card on every platform and settles every
card when the request ends. Each platform has its own worker, so a slow or
failing platform never delays the others; posts go through durable outbox
rows and edits are derived from recorded cards, so both survive a restart.
``NullBus`` stands in when no platform is configured: it cannot show cards,
so dangerous tools are refused (fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Protocol

import structlog

from kazma.adapters.call_note import CutShort, within
from kazma.adapters.contract import (
    CardRef,
    FileAdapter,
    FindsCards,
    Handlers,
    IdempotentPosts,
    PlatformAdapter,
    PlatformError,
    RoutesCards,
    ShowsText,
    SingletonIngress,
    UpdatesCards,
    UrgentEdits,
    ingress_trouble,
    presses_outlive_refusal,
    setup_refused,
    singleton_ingress,
)
from kazma.adapters.outbox import Outbox, PostJob
from kazma.approvals.card import ApprovalCard, CardIntegrityError, build_card, integrity_card
from kazma.approvals.checkpoints import Checkpoint
from kazma.approvals.honesty import reveal_line
from kazma.approvals.model import ApprovalRequest, Review, Status, Witness
from kazma.approvals.progress import progress_line
from kazma.approvals.service import CardsNotQueued, remember_offer
from kazma.approvals.store import ApprovalStore, PostedCard
from kazma.config import failpoints
from kazma.config.address import Address
from kazma.config.backoff import Backoff
from kazma.config.card_routes import CardTarget
from kazma.config.metrics import DECISION_TO_SETTLED, count_failure
from kazma.config.models import KazmaConfig
from kazma.config.outgoing import Outgoing
from kazma.config.registry import CHAT_PLATFORMS
from kazma.config.store.backend import Tx
from kazma.config.store.errors import simulated_failure, store_errors
from kazma.config.supervisor import Supervisor
from kazma.config.waits import bounded, until_set

log = structlog.get_logger("kazma.bus")

# Card posts and edits: from half a second up to a minute; a platform's own retry_after wins when longer.
RETRY = Backoff(base=0.5, cap=60.0)
# A platform whose start failed for a fault that may pass (the platform answered 5xx, or nothing) is started again.
START_RETRY = Backoff(base=1.0, cap=60.0)
# A retry far enough along that RETRY waits its longest (its cap), whatever its base.
RETRY_LONGEST = 64


def _count_once(site: str, platform: str, exc: BaseException) -> None:
    """Count a card post's or edit's failure, unless the adapter's own call counted it already (the kit counts each
    failed call at its site): one failure counted twice read as two on kazma_failures_total."""
    if not (isinstance(exc, PlatformError) and exc.counted):
        count_failure(site, platform)


def _passing(exc: BaseException) -> bool:
    """Whether a platform's start failed for a fault that may pass by itself (not a refused token or setting)."""
    if isinstance(exc, PlatformError):
        return exc.retryable
    return isinstance(exc, TimeoutError | OSError)


@dataclass(frozen=True)
class PlatformHealth:
    """One chat platform's state as ``/healthz`` says it: whether a press on one of its cards reaches a decision
    now, and if not, why and what Kazma does about it."""

    platform: str
    takes_presses: bool
    state: str

    def line(self) -> str:
        return f"platform {self.platform}: {self.state}"


# The states of a platform's singleton ingress the leader records for the followers (see inbound_states).
INBOUND_OPEN: Final = "open"
INBOUND_FAILING: Final = "failing"
INBOUND_NOT_OPEN: Final = "not open"
# Being opened (a new leader's first moments, or an open tried again): not open yet, and not closed either.
INBOUND_OPENING: Final = "opening"
# A replica's own line for an ingress it leads for and has not been asked to open yet.
OPENING_WITH_THE_LEASE: Final = "inbound connection opening: this replica took the lease and starts the leader's duties"
# What such a replica records of it for the followers (from the moment its session holds the lease's lock).
TOOK_THE_LEASE: Final = "it took the lease and starts the leader's duties"


@dataclass(frozen=True)
class InboundState:
    """One platform's inbound connection on the leader: open, open yet failing, opening, or not open; since when (wall
    clock, as the leader's ``time.time()``) and why, as the leader's own ``/healthz`` says it."""

    state: str
    detail: str
    since: float


@dataclass(frozen=True)
class LeaderInbound:
    """What a follower knows of the leader's inbound connections, for its ``/healthz``.

    ``replica``: the lease holder (None: nobody leads); ``states``: what that holder recorded on the lease
    session it holds now (None: nothing yet, or it could not be read: unknown, never taken for open);
    ``records``: whether that holder has any row at all, on any session (none: a replica of an earlier release,
    which records nothing, or one that took the lease a moment ago)."""

    replica: str | None
    states: Mapping[str, InboundState] | None
    records: bool = True


def _clock_time(at: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(at))


def _reopens(adapter: PlatformAdapter) -> bool:
    """Whether the leader opens ``adapter``'s ingress (again): not one that refused Kazma's setup while it ran,
    which could only be refused again, unless its presses outlive that refusal (Slack's socket is the app-level
    token's, not the refused bot token's). Every place that opens it, or says it is opening, asks this one."""
    return setup_refused(adapter) is None or presses_outlive_refusal(adapter)


def _kept(since: Mapping[str, InboundState], name: str, state: str, now: float) -> float:
    """When a platform's inbound state began: the last record's moment when the state is the same, else now."""
    before = since.get(name)
    return before.since if before is not None and before.state == state else now


def _through_leader(name: str, leader: LeaderInbound | None) -> PlatformHealth:
    """A follower's line for a platform whose inbound connection is the leader's: open only when the leader
    holding the lease now recorded it open; a record it cannot trust (stale, missing, unread) is unknown."""
    if leader is None:
        return PlatformHealth(name, False, "inbound state unknown: the leader's record could not be read")
    if leader.replica is None:
        return PlatformHealth(name, False, "inbound connection not open: no replica leads")
    state = None if leader.states is None else leader.states.get(name)
    if state is None and not leader.records:
        # A leader of the previous release records nothing: counted down, every new follower answered 503 for
        # as long as it led, and a rolling upgrade waiting for them to be ready never went on. Taken as the
        # previous release's followers took it.
        return PlatformHealth(
            name,
            True,
            f"serving through the leader ({leader.replica}), which records no inbound state (a replica of an"
            " earlier release, or one that took the lease a moment ago)",
        )
    if state is None:
        return PlatformHealth(
            name, False, f"inbound state unknown: leader {leader.replica} has not recorded it under its lease"
        )
    at = _clock_time(state.since)
    if state.state == INBOUND_OPEN:
        return PlatformHealth(name, True, f"serving through the leader ({leader.replica}): inbound open since {at}")
    if state.state == INBOUND_FAILING:
        return PlatformHealth(name, False, f"leader {leader.replica}: inbound failing since {at} ({state.detail})")
    if state.state == INBOUND_OPENING:  # no press comes in through it yet: down, as the leader's own line is
        # With the reason the leader recorded (a 4004 that closed the gateway, a 401 that ended the polling): the
        # leader's own line said it, the followers' did not.
        why = f" ({state.detail})" if state.detail else ""
        return PlatformHealth(name, False, f"leader {leader.replica}: inbound connection opening since {at}{why}")
    return PlatformHealth(
        name, False, f"leader {leader.replica}: inbound connection not open since {at} ({state.detail})"
    )


# A posted card whose message id could not be recorded: recorded again after these pauses (seconds).
RECORD_RETRIES = (0.1, 0.5, 2.0)
# A card post queued in a write of its own (not in its request's transaction) is tried again after these pauses.
ENQUEUE_RETRIES = (0.05, 0.25, 1.0)
# A settled card's row, when its worker has no other card to edit: it waits this long to commit with the next
# group of writes instead of one of its own. The card already shows its outcome (a row lost with a crash means
# one more edit to the same outcome at the next start); a press's other cards are still on their way, and four
# commits of their own (console, Telegram, Slack, Discord), each with its fsync, ran among their edits.
SETTLED_RIDE = 0.02
# What a card posted again says, where the platform cannot make a post idempotent (Telegram, Slack).
REPOSTED = (
    "Posted again: Kazma stopped, or lost the platform's answer, while posting this card before. If an earlier "
    "copy is above, its buttons do nothing: decide here."
)


@dataclass
class _Decided:
    """A request decided here, read once for every platform's worker: the card edits start from this."""

    request: ApprovalRequest | None
    cards: list[PostedCard]
    witness: Witness | None = None
    # The card every platform writes in its dialect, built once (None: each builds its own, as a scan does).
    card: ApprovalCard | None = None
    # Its cards still to be edited by a worker: the last one settled is when "decision to settled" is observed.
    unsettled: int = 0


class Witnesses(Protocol):
    """Where a settled card finds the signed audit checkpoint holding its decision (the checkpointer)."""

    async def witness(self, request_id: str) -> Checkpoint | None: ...


# The full scan for unsettled cards (requests decided by another process, a missed kick): this often.
SAFETY_SCAN_SECONDS = 120.0
# At stop, the card edits already asked for (a request ended as Kazma stops: an /mcp call withdrawn because
# its connection goes with the process) get this long to be made; what is left is made at the next start.
# The same seconds also bound a post or an edit a worker has under way as it stops (see FanOutBus.stop).
STOP_SETTLE_SECONDS = 5.0


@dataclass
class _Worker:
    adapter: PlatformAdapter
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # Requests decided here whose cards on this platform are still to be edited, oldest first.
    # Each maps to one read of the request and its cards, shared by every platform's worker.
    to_settle: dict[str, asyncio.Future[_Decided]] = field(default_factory=dict)
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # set once to_settle has been emptied
    # Pending requests under a policy of several people whose cards here are to show a new review, oldest first.
    to_refresh: dict[str, None] = field(default_factory=dict)
    scan_at: float = 0.0  # when the next full scan is due (0: at once, as at start)
    retry_at: float | None = None  # the earliest card edit waiting out a failure, when one is
    asleep_until: float | None = None  # while waiting for a kick: when it wakes by itself (None: awake)
    kept_upto: int | None = None  # the highest post id said to wait for a refused setup (see Outbox.kept)
    # Until when the platform refused the token this process's posts and edits carry (Telegram's 401): its drain
    # of posts and its scan of edits try nothing before then, so one call a backoff asks whether the token is good
    # again. Held here, not in the shared rows: another replica's token may work (a rolling token change).
    held_until: float | None = None
    # Its passes over the store: how many began, and the last one that ended whole (no failure, nothing new queued
    # meanwhile), so :meth:`FanOutBus.caught_up` can tell a pass begun after its call from one already under way.
    began: int = 0
    whole: int = 0
    passed: asyncio.Event = field(default_factory=asyncio.Event)  # set as each pass ends whole


def _retry_by(worker: _Worker, at: float) -> None:
    """The worker's next card edit is due no later than ``at``."""
    worker.retry_at = at if worker.retry_at is None else min(worker.retry_at, at)


class FanOutBus:
    """One or more platforms. Satisfies the approvals' ``CardPublisher``."""

    def __init__(
        self,
        adapters: Sequence[PlatformAdapter],
        *,
        store: ApprovalStore,
        outbox: Outbox,
        config: KazmaConfig,
        platform_timeout: float = 10.0,
        poll_interval: float = SAFETY_SCAN_SECONDS,
        clock: Callable[[], float] = time.time,
        shared: bool = False,
        claim_seconds: float | None = None,
        witnesses: Witnesses | None = None,
    ) -> None:
        if not adapters:
            raise ValueError("FanOutBus needs at least one platform; use NullBus for none")
        self.adapters = {a.name: a for a in adapters}
        self.store = store
        self.outbox = outbox
        self.config = config
        self.platform_timeout = platform_timeout
        # The slow safety net: every worker rescans the store this often. Decisions made here reach the
        # workers at once (:meth:`settle`), failed posts and edits wake them when they are due.
        self.poll_interval = poll_interval
        self.clock = clock
        # Several replicas share the store: each card edit is claimed first, so one replica makes it. A single
        # process on its own SQLite file has nobody to race and skips that write. Posts are always claimed:
        # the claim is the attempt count written before each post anyway.
        self.shared = shared
        # How long a claim keeps the others off: longer than a post or an edit can take (each is bounded by
        # platform_timeout), so only a replica that died leaves one to run out.
        self.claim_seconds = claim_seconds if claim_seconds is not None else 2 * platform_timeout + 10
        # Every settled card shows the audit checkpoint holding its decision (None: the store's, if signed yet).
        self.witnesses = witnesses
        self._workers = {name: _Worker(adapter) for name, adapter in self.adapters.items()}
        self._started: set[str] = set()
        self._stopping = False
        self._halt = asyncio.Event()  # set by stop: a platform still being started again gives up
        # What /healthz says of a platform that does not serve: its last failed start (and the tries so far), or
        # why it stays off for good; the last failure to open its singleton ingress.
        self._start_failed: dict[str, tuple[str, int]] = {}
        self._off: dict[str, str] = {}
        self._ingress_failed: dict[str, str] = {}
        self._leading = True  # whether this process holds the singleton ingress (a replica only while it leads)
        # The singleton ingresses a start_ingress is opening: since when (wall clock), and why each was not open
        # then. The adapter counts one as running from the moment its open begins (Discord's until READY), and
        # from then on no longer says its own trouble (Discord's closed gateway, Telegram's ended poller).
        self._opening: dict[str, tuple[float, str | None]] = {}
        # While leading: since when (wall clock) each singleton ingress has not been open, across the opens tried
        # again meanwhile (each "opening" between two "not open" records restarted the followers' "since").
        self._down_since: dict[str, float] = {}
        # Since when the leadership before this one had found each not open (read from its record at takeover): a
        # connection down across a leader change is down since then, not since the new leader's first failed open.
        self._down_before: dict[str, float] = {}
        self._tasks = Supervisor("bus_task")  # one worker per platform
        # (platform, person) whose direct messages refused a card, said in the home chat once until one lands
        self._dm_refused: set[tuple[str, str]] = set()
        # Why a started platform refused the token its last card post or edit carried (Telegram's 401: its cards
        # wait, tried again with backoff), until one lands: /healthz says it, as "serving" alone hid it.
        self._cards_refused: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, handlers: Handlers, *, ingress: bool = True) -> None:
        """Connect every platform concurrently; one that fails to start is logged, the rest serve.

        ``ingress=False``: the connections only one process may hold (Telegram polling, the Discord gateway,
        Slack Socket Mode) stay closed until :meth:`start_ingress` — a replica that does not lead.
        """
        if not self.shared:
            # The only process on the store: a claim still held was taken by the process before this one.
            released = await self.outbox.release_claims()
            if released:
                log.warning("bus.post_claims_released", posts=released, detail="left by the previous process")
        self._leading = ingress
        names = list(self.adapters)
        results = await asyncio.gather(
            *(self._start_one(self.adapters[n], handlers, ingress) for n in names), return_exceptions=True
        )
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                count_failure("platform_start", name)
                log.error("bus.platform_start_failed", platform=name, error=str(result))
                self._start_failed[name] = (str(result), 1)
                if not _passing(result):
                    self._off[name] = str(result)
                else:
                    # Started only at the next restart, the platform stayed off for good after a moment's fault
                    # (Slack answering 500 as Kazma started): no presses came in from cards posted there meanwhile.
                    adapter = self.adapters[name]
                    self._tasks.spawn(self._start_again(adapter, handlers, ingress), name=f"kazma-bus-start-{name}")
            else:
                self._started.add(name)
        await self._due_now([name for name in names if name in self._started])
        for name, worker in self._workers.items():
            worker.task = self._tasks.spawn(self._run(worker), name=f"kazma-bus-{name}")
            worker.kick.set()  # resume what a previous run left: unposted cards, unsettled edits

    async def _due_now(self, names: list[str]) -> None:
        """A start is the operator's "try again" (a new token after one was refused): the started platforms' posts
        and edits waiting out their backoff go now, two writes for all of them. Before, a card kept while Slack or
        Discord refused the token landed only when its last backoff (up to a minute) ran out after the restart."""
        if not names:
            return
        for name in names:  # a platform started again may carry a new token: it is asked at once
            self._workers[name].held_until = None
            self._workers[name].kick.set()
        try:
            posts = await self.outbox.due_now(names)
            edits = await self.store.settles_due_now(names)
        except store_errors() as exc:  # they go when their backoff ends, as before
            log.warning("bus.due_now_failed", platforms=names, error=str(exc).strip() or repr(exc))
            return
        if posts or edits:
            log.info("bus.due_now", platforms=names, posts=posts, edits=edits)

    async def _start_one(self, adapter: PlatformAdapter, handlers: Handlers, ingress: bool) -> None:
        single = singleton_ingress(adapter)
        if single is not None:
            await single.start(handlers, ingress=ingress)
        else:
            await adapter.start(handlers)
        log.info("bus.platform_started", platform=adapter.name, home_chat=adapter.home_chat, ingress=ingress)

    async def _start_again(self, adapter: PlatformAdapter, handlers: Handlers, ingress: bool) -> None:
        """Start ``adapter`` again with backoff until it starts, fails for good (a refused token) or the bus stops.
        Among replicas it starts without its singleton ingress as the others did; the leader's check opens it."""
        tries = 0
        while not await until_set(self._halt, START_RETRY.delay(tries)):
            tries += 1
            try:
                await self._start_one(adapter, handlers, ingress)
            except Exception as exc:  # counted and logged; tried again while the fault may pass
                count_failure("platform_start", adapter.name)
                log.warning("bus.platform_start_retry_failed", platform=adapter.name, attempt=tries, error=str(exc))
                self._start_failed[adapter.name] = (str(exc), tries + 1)
                if _passing(exc):
                    continue
                self._off[adapter.name] = str(exc)
                log.error("bus.platform_start_given_up", platform=adapter.name, attempt=tries, error=str(exc))
                return
            if self._halt.is_set():  # stop began while it started: it must not serve past the bus
                await self._stop_one(adapter)
                return
            self._started.add(adapter.name)
            self._start_failed.pop(adapter.name, None)
            await self._due_now([adapter.name])
            log.info("bus.platform_started_late", platform=adapter.name, attempt=tries)
            worker = self._workers.get(adapter.name)
            if worker is not None:
                worker.kick.set()  # what waited for it: unposted cards, unsettled edits
            return

    async def start_ingress(self) -> None:
        """This replica leads now: open every singleton ingress (one that fails is logged and counted)."""
        self._leading = True
        await self._each_ingress("start_ingress")

    async def stop_ingress(self) -> None:
        """This replica no longer leads: close every singleton ingress, finishing what it took."""
        self._leading = False
        await self._each_ingress("stop_ingress")

    def ingress_missing(self) -> list[str]:
        """The started platforms whose singleton ingress is not open (after a failed start_ingress). One that
        refused Kazma's setup while it ran is not, opening it again could only be refused again, unless its
        presses outlive that refusal (Slack's socket is the app-level token's, not the refused bot token's)."""
        return [
            name
            for name, adapter in self.adapters.items()
            if name in self._started
            and (single := singleton_ingress(adapter))
            and not single.ingress_running
            and _reopens(adapter)
        ]

    async def _each_ingress(self, what: str) -> None:
        targets = [(n, s) for n, a in self.adapters.items() if n in self._started and (s := singleton_ingress(a))]
        # Marked before any of them runs: a look in between (the leader's first record) saw a closed ingress and
        # said "it closed", then "open" while Discord's gateway still waited for READY.
        began = time.time()
        if what == "start_ingress":
            for name, single in targets:
                adapter = self.adapters[name]
                if not single.ingress_running and _reopens(adapter):
                    # Read now: once the open begins the adapter runs, and its trouble (the reason) reads None.
                    self._opening[name] = (began, self._ingress_failed.get(name) or ingress_trouble(adapter))

        async def one(name: str, single: SingletonIngress) -> None:
            try:
                await (single.start_ingress() if what == "start_ingress" else single.stop_ingress())
                self._ingress_failed.pop(name, None)
                log.info("bus.ingress_changed", platform=name, action=what)
            except Exception as exc:  # the other platforms' ingress must not depend on this one
                if what == "start_ingress":
                    self._ingress_failed[name] = str(exc)
                count_failure(what, name)
                log.error("bus.ingress_change_failed", platform=name, action=what, error=str(exc))
            finally:
                self._opened(name, began)

        try:
            await asyncio.gather(*(one(name, single) for name, single in targets))
        finally:
            # Cancelled before an open ran (a stop, a lost lease), that open's own cleanup never ran: its mark
            # said "opening" of an ingress nothing opened, until another start replaced it.
            for name, _ in targets:
                self._opened(name, began)

    def _opened(self, name: str, began: float) -> None:
        """The open of ``name`` begun at ``began`` ended (or never ran): its mark goes, not a later start's."""
        mark = self._opening.get(name)
        if mark is not None and mark[0] == began:
            del self._opening[name]

    def inherit_down(self, down: Mapping[str, float]) -> None:
        """Since when the previous leadership recorded each singleton ingress not open (a new leader's takeover):
        kept as this leadership's "not open since" of a platform it cannot open either, until one is found open."""
        self._down_before = dict(down)

    def inbound_states(self, since: Mapping[str, InboundState], now: float) -> dict[str, InboundState]:
        """This replica's singleton ingresses, as the leader records them for the followers' ``/healthz``: each
        started platform's state, keeping ``since`` of a state that did not change (``since`` holds the last
        recorded), ``now`` for one that did."""
        states: dict[str, InboundState] = {}
        for name, adapter in self.adapters.items():
            if name not in CHAT_PLATFORMS or (single := singleton_ingress(adapter)) is None:
                continue
            if name in self._started and not self._leading and _reopens(adapter):
                # The lease is this replica's and the leader's duties are starting: the ingress is about to open.
                # This replica's own outage of an earlier leadership: what the leadership just before found is
                # kept in _down_before instead (read from its record, whoever held it).
                self._down_since.pop(name, None)
                at = _kept(since, name, INBOUND_OPENING, now)
                states[name] = InboundState(INBOUND_OPENING, TOOK_THE_LEASE, at)
                continue
            if name in self._started and name in self._opening:
                # The detail is the reason alone (a follower's line says it after its own "opening since").
                began, why = self._opening[name]
                states[name] = InboundState(INBOUND_OPENING, f"it was not open: {why}" if why else "", began)
                continue
            if name in self._started and single.ingress_running:
                self._down_since.pop(name, None)
                self._down_before.pop(name, None)
                health = self._health(name, adapter)
                state, detail = (INBOUND_OPEN if health.takes_presses else INBOUND_FAILING), health.state
            elif name in self._started:
                state = INBOUND_NOT_OPEN
                detail = self._ingress_failed.get(name) or ingress_trouble(adapter) or "it closed"
                # Down since it was first found so, whatever opens were tried since: an hour's outage of a
                # platform retried every minute read as a minute's.
                down = self._down_since.setdefault(name, self._down_before.get(name) or _kept(since, name, state, now))
                states[name] = InboundState(state, detail, down)
                continue
            else:
                state, detail = INBOUND_NOT_OPEN, self._health(name, adapter).state
            states[name] = InboundState(state, detail, _kept(since, name, state, now))
        return states

    def health(self, leader: LeaderInbound | None = None, *, leads: bool = False) -> list[PlatformHealth]:
        """Each chat platform's state, for ``/healthz``: a platform whose start is being retried, that stays off,
        or whose inbound connection is closed shows its cards (or not) but no press on them reaches a decision.
        The console (the web adapter) is not among them: it serves whatever answers ``/healthz``.

        ``leader``: on a follower, what the leader recorded of its inbound connections (none given: unknown).
        ``leads``: this replica holds the lease (its ingress may not have been asked to open yet)."""
        return [
            self._health(name, adapter, leader, leads=leads)
            for name, adapter in self.adapters.items()
            if name in CHAT_PLATFORMS
        ]

    def _health(
        self, name: str, adapter: PlatformAdapter, leader: LeaderInbound | None = None, *, leads: bool = False
    ) -> PlatformHealth:
        if name not in self._started:
            if name in self._off:
                return PlatformHealth(
                    name, False, f"off, its start was refused ({self._off[name]}): fix the setting and restart Kazma"
                )
            if name in self._start_failed:
                error, tries = self._start_failed[name]
                return PlatformHealth(name, False, f"not started, tried {tries} times and trying again ({error})")
            return PlatformHealth(name, False, "starting")
        refused = setup_refused(adapter)
        if refused is not None and not presses_outlive_refusal(adapter):
            return PlatformHealth(name, False, f"off, {refused}")
        inbound = self._inbound_health(name, adapter, leader, leads=leads)
        if refused is None:
            cards = self._cards_refused.get(name)
            if cards is not None:
                why = f"card posts and edits refused ({cards}): they wait, tried again with backoff"
                return PlatformHealth(name, inbound.takes_presses, f"{inbound.state}; {why}")
            return inbound
        if inbound.takes_presses:
            # "off" here sent an operator to a platform whose presses still decided (and a monitor, or a load
            # balancer in front of Slack's HTTP events, away from them); what is refused is what it shows.
            return PlatformHealth(name, True, f"presses still decide, card posts and edits refused: {refused}")
        return PlatformHealth(name, False, f"off, {refused}; {inbound.state}")

    def _inbound_health(
        self, name: str, adapter: PlatformAdapter, leader: LeaderInbound | None, *, leads: bool
    ) -> PlatformHealth:
        """A started platform's state by whether its presses come in (``leads``: see :meth:`health`)."""
        single = singleton_ingress(adapter)
        trouble = ingress_trouble(adapter)
        if single is not None and self._leading and name in self._opening:
            began, why = self._opening[name]
            at = _clock_time(began)
            return PlatformHealth(
                name, False, f"inbound connection opening since {at}" + (f" (it was not open: {why})" if why else "")
            )
        if single is None or single.ingress_running:
            if trouble is not None:  # open, yet nothing comes in (Matrix's sync failing again and again)
                return PlatformHealth(name, False, f"inbound failing ({trouble})")
            return PlatformHealth(name, True, "serving")
        if not self._leading and leads:
            # The lease is this replica's and the leader's duties are starting: read as a follower, it said the
            # leader's record "could not be read" of the record it is about to write itself.
            return PlatformHealth(name, False, OPENING_WITH_THE_LEASE)
        if not self._leading:  # presses reach the leader, whose ingress this is: as open as the leader recorded
            return _through_leader(name, leader)
        why = self._ingress_failed.get(name) or trouble or "it closed"
        return PlatformHealth(name, False, f"inbound connection not open ({why}): opened again with backoff")

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + STOP_SETTLE_SECONDS
        await self._finish_settles(STOP_SETTLE_SECONDS)
        self._stopping = True
        self._halt.set()
        for worker in self._workers.values():
            worker.kick.set()
        # Within what is left of those seconds, each worker ends after the post or edit it has under way (it looks
        # at _stopping between them); one still busy then is cancelled. Cut off at once, a card the platform had
        # already shown stayed unrecorded: posted again at the next start, or left showing its buttons.
        late = await self._tasks.stop(grace=max(0.0, until - loop.time()), patience=self.platform_timeout)
        if late:
            log.warning("bus.stop_cut_work", platforms=sorted(t.get_name() for t in late))
        await asyncio.gather(*(self._stop_one(a) for a in self.adapters.values()))

    async def _finish_settles(self, seconds: float) -> None:
        """Let running workers make the card edits they were asked for, for up to ``seconds``."""
        busy = [w for w in self._workers.values() if w.to_settle and w.task is not None and not w.task.done()]
        for worker in busy:
            worker.kick.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):  # not wait_for: see kazma.config.waits
                await asyncio.gather(*(w.drained.wait() for w in busy))

    async def _stop_one(self, adapter: PlatformAdapter) -> None:
        try:
            await bounded(adapter.stop(), self.platform_timeout)
        except Exception as exc:
            log.warning("bus.platform_stop_failed", platform=adapter.name, error=str(exc))

    # -- CardPublisher ---------------------------------------------------------------------------

    def can_show_cards(self, policy: str | None = None) -> bool:
        """A platform that *started* and shows the cards of ``policy`` there (its home chat, or where the
        policy's ``to:`` sends them) can show a card; configured is not enough, and neither is one that refused
        Kazma's setup while it ran (its cards wait for a restart, as a platform's whose start was refused)."""
        return any(
            name in self._started and setup_refused(a) is None and self._places(a, policy)
            for name, a in self.adapters.items()
        )

    def _places(self, adapter: PlatformAdapter, policy: str | None) -> list[CardTarget]:
        """Where ``adapter``'s platform shows the cards of a request under ``policy`` (its ``to:``; none
        written: the home chat, when there is one; the console's too)."""
        routed = self.config.card_targets(policy)
        if routed is None:
            return [CardTarget(adapter.name)] if adapter.home_chat else []
        return [t for t in routed if t.platform == adapter.name]

    def _targets(self, policy: str | None = None) -> list[str]:
        """The platforms that show a card of a request under ``policy`` (one outbox row each)."""
        return [name for name, a in self.adapters.items() if self._places(a, policy)]

    async def queue_statements(self, request_id: str, policy: str | None = None) -> Callable[[Tx], object] | None:
        """The card posts of ``request_id``, to commit with the request itself (approvals' ``QueuesCards``);
        None when the outbox and the approvals do not share one writer, hence one transaction."""
        if await self.outbox.tables.writer() is not await self.store.tables.writer():
            return None
        queue = self.outbox.enqueue_statements(request_id, self._targets(policy))
        if not failpoints.armed:
            return queue

        def queue_or_fail(tx: Tx) -> None:  # inside the opening transaction: a failure undoes the request too
            failpoints.reached_sync("approvals.open.card_job", lambda: simulated_failure(tx, "queue"))
            queue(tx)

        return queue_or_fail

    def cards_queued(self, request_id: str, policy: str | None = None) -> None:
        for name in self._targets(policy):
            self._workers[name].kick.set()

    async def publish(self, card: ApprovalCard) -> None:
        """Queue ``card``'s posts in a write of their own (the outbox has another writer than the request): tried
        again after short pauses; :class:`CardsNotQueued` when the store still refuses, so the request is ended
        at once instead of waiting, card-less, for its deadline."""
        rules = await self.store.rules_of(card.request_id)
        targets = self._targets(None if rules is None else rules.policy)
        for attempt, pause in enumerate((*ENQUEUE_RETRIES, None)):
            try:
                if failpoints.armed:
                    await failpoints.reached("approvals.open.card_job", lambda: simulated_failure(self.outbox, "queue"))
                await self.outbox.enqueue(card.request_id, targets)
                break
            except store_errors() as exc:
                count_failure("card_enqueue")
                log.error("bus.card_enqueue_failed", request_id=card.request_id, attempt=attempt + 1, error=str(exc))
                if pause is None:
                    raise CardsNotQueued(str(exc)) from exc
                await asyncio.sleep(pause)
        for name in targets:
            self._workers[name].kick.set()

    async def settle(self, request_id: str) -> None:
        """``request_id`` has its outcome: every platform edits its cards now, ahead of queued posts."""
        self._settle_from(request_id, asyncio.ensure_future(self._decided(request_id)))

    async def settle_decided(self, request: ApprovalRequest, cards: list[PostedCard]) -> None:
        """:meth:`settle`, with ``request`` and its cards as its decision's transaction committed them (read at its
        end): no read of either between the commit and the edits."""
        self._settle_from(request.id, asyncio.ensure_future(self._decided(request.id, (request, cards))))

    async def settle_told(self, request_id: str) -> None:
        """:meth:`settle` of a decision another replica told of, or of an edit it handed back (its token refused, see
        ApprovalStore.settle_refused). A platform whose token this process's own edit or post saw refused waits out
        its hold (its scan edits the card then): tried at once, two replicas with a stale token handed each edit
        back and forth, one refused call each time."""
        workers = [w for w in self._workers.values() if not self._held(w)]
        if workers:
            self._settle_from(request_id, asyncio.ensure_future(self._decided(request_id)), workers)

    def _settle_from(
        self, request_id: str, loaded: asyncio.Future[_Decided], workers: Sequence[_Worker] | None = None
    ) -> None:
        for worker in self._workers.values() if workers is None else workers:
            adapter = worker.adapter
            if isinstance(adapter, UrgentEdits) and adapter.home_chat and request_id not in worker.to_settle:
                # Before the decision's waiter runs: the agent's reply to it must not take the card's turn.
                adapter.expect_edit(adapter.home_chat)
            worker.to_settle[request_id] = loaded
            worker.drained.clear()
            worker.kick.set()

    async def refresh(self, request_id: str) -> None:
        """A review of ``request_id`` was counted: each platform edits its cards to show the progress, in its
        worker, so an edit of progress never lands after the edit to the outcome made there."""
        for worker in self._workers.values():
            if isinstance(worker.adapter, UpdatesCards):
                worker.to_refresh[request_id] = None
                worker.kick.set()

    def posts_waiting(self, platforms: Sequence[str] | None = None) -> None:
        """Another replica queued card posts: the workers of ``platforms`` (None: all) look for them now."""
        for name, worker in self._workers.items():
            if platforms is None or name in platforms:
                worker.kick.set()

    def rescan(self) -> None:
        """Scan the store for unposted and unsettled cards now (notifications may have been missed)."""
        for worker in self._workers.values():
            worker.scan_at = 0.0
            worker.kick.set()

    async def caught_up(self) -> None:
        """Return once every started platform's worker has made a whole pass begun after this call: each card post
        and edit the store held due when it was called has been tried (made, or put off by its platform's failure).
        A restart says it has recovered from then on; a platform that never started is not waited for."""
        marks = {name: worker.began for name, worker in self._workers.items() if name in self._started}
        for worker in self._workers.values():  # a scan of its own, whatever else asked for one
            worker.scan_at = 0.0
            worker.kick.set()
        for name, mark in marks.items():
            worker = self._workers[name]
            while worker.whole <= mark:
                worker.passed.clear()
                await worker.passed.wait()

    async def _decided(
        self, request_id: str, known: tuple[ApprovalRequest, list[PostedCard]] | None = None
    ) -> _Decided:
        """The request, its cards, its decision's audit checkpoint and its card, read and built once for every
        platform. The three reads go together: the checkpoint is what takes long (a signature, committed), and
        the two reads need not wait for it, nor it for them. ``known``: the request and its cards, as committed."""
        request: ApprovalRequest | None
        if known is not None:
            (request, cards), witness = known, await self._witness(request_id)
        else:
            request, cards, witness = await asyncio.gather(
                self.store.get(request_id), self.store.cards(request_id), self._witness(request_id)
            )
        decided = _Decided(request, cards, witness, unsettled=sum(1 for c in cards if c.settled_at is None))
        if request is not None and request.outcome() is not None:
            try:
                decided.card = self._card_for(request, await self._reviews(request))
            except CardIntegrityError:
                # Settled all the same (the buttons must go), but showing no value from the changed row.
                decided.card = integrity_card(request, public_url=self.config.web.public_url)
        return decided

    async def _witness(self, request_id: str) -> Witness | None:
        """The signed checkpoint holding ``request_id``'s decision; a card settles without it (counted) only
        when none comes in time: its buttons must go either way."""
        try:
            found = await (
                self.store.witness(request_id) if self.witnesses is None else self.witnesses.witness(request_id)
            )
        except Exception as exc:
            found = None
            log.warning("bus.witness_failed", request_id=request_id, error=str(exc))
        if found is None:
            count_failure("card_without_witness")
            log.warning("bus.card_without_witness", request_id=request_id)
            return None
        return Witness(found.seq, found.head)

    # -- messages --------------------------------------------------------------------------------

    async def send(self, to: Address, message: Outgoing) -> str | None:
        """Post ``message`` into one conversation (a file on a platform that posts files); the message id, or None:
        failures are logged and counted, never raised."""
        adapter = self.adapters.get(to.platform)
        file = message.file is not None
        if adapter is None or (file and not isinstance(adapter, FileAdapter)):
            if file:
                log.warning("bus.unknown_platform", platform=to.platform, site="send_file")
            else:
                log.warning("bus.unknown_platform", platform=to.platform)
            return None
        try:
            # a file may be megabytes: it has longer than a text
            return await within(
                adapter.send(to, message),
                self.platform_timeout * (4 if file else 1),
                platform=to.platform,
                site="send_file" if file else "send",
            )
        except (PlatformError, TimeoutError) as exc:
            if file:
                count_failure("send_file", to.platform)
                log.warning("bus.send_file_failed", platform=to.platform, chat=to.chat, error=str(exc))
            else:
                count_failure("send", to.platform)
                log.warning("bus.send_failed", platform=to.platform, chat=to.chat, error=str(exc))
            return None

    def can_show(self, to: Address) -> bool:
        """Whether a text posted at ``to`` can be shown growing (its platform edits posted texts)."""
        adapter: object = self.adapters.get(to.platform)
        return isinstance(adapter, ShowsText) and adapter.edits_text

    async def show(
        self, to: Address, shown: Sequence[tuple[str, str]], message: Outgoing
    ) -> list[tuple[str, str]] | None:
        """Make the messages ``shown`` at ``to`` show ``message``'s text (see ``show_text``); what is shown now, or
        None when it could not be shown: logged and counted, never raised (the caller sends the text instead)."""
        adapter: object = self.adapters.get(to.platform)
        if not isinstance(adapter, ShowsText):
            return None
        try:
            return await within(
                adapter.show_text(to.chat, shown, message.text, agent=message.agent, thread=to.thread),
                self.platform_timeout,
                platform=to.platform,
                site="stream",
            )
        except (PlatformError, TimeoutError) as exc:
            if isinstance(exc, CutShort | TimeoutError):  # a refused or failed call is counted by the adapter already
                count_failure("stream", to.platform)
            log.warning("bus.show_failed", platform=to.platform, chat=to.chat, error=str(exc) or type(exc).__name__)
            return None

    async def send_text(self, platform: str, chat: str, text: str, *, agent: str | None = None) -> str | None:
        """:meth:`send` of a text, for a caller holding a platform and a chat (a script, a test)."""
        return await self.send(Address(platform, chat), Outgoing(text, agent=agent))

    async def working(self, at: Address) -> bool:
        """Show that an agent is working in one conversation (the adapter rate-limits it; never raises)."""
        adapter: object = self.adapters.get(at.platform)
        if not isinstance(adapter, FileAdapter):
            return False
        try:
            return await bounded(adapter.working(at.chat, thread=at.thread), self.platform_timeout)
        except TimeoutError:
            return False

    async def broadcast(
        self, text: str, *, agent: str | None = None, skip: Collection[str] = (), only: str | None = None
    ) -> dict[str, str | None]:
        """Report or alert into every platform's home chat at once; ``skip``: home chats (conversation keys) left
        out, ``only``: this home chat alone (nothing when it is none)."""
        homes = [Address(n, a.home_chat) for n, a in self.adapters.items() if a.home_chat]
        targets = [
            (home.platform, home.chat)
            for home in homes
            if home.conversation not in skip and (only is None or only == home.conversation)
        ]
        results = await asyncio.gather(
            *(self.send(Address(n, chat), Outgoing(text, agent=agent)) for n, chat in targets if chat)
        )
        return {n: r for (n, _), r in zip(targets, results, strict=True)}

    # -- workers ---------------------------------------------------------------------------------

    async def _run(self, worker: _Worker) -> None:
        name = worker.adapter.name
        while not self._stopping:
            worker.kick.clear()
            worker.began += 1
            number = worker.began
            wake_at: float | None = None
            try:
                await self._settle_requested(worker)
                await self._refresh_requested(worker)
                # Edits found by a scan go before posts too, as a decision's do: at a start, the edits of cards
                # decided while the platform was off (a refused token) waited behind every post kept meanwhile,
                # one a second in its pacing, their cards showing live buttons all that time.
                scan_failed: Exception | None = None
                if self.clock() >= worker.scan_at or (worker.retry_at is not None and self.clock() >= worker.retry_at):
                    try:
                        await self._scan_settles(worker)
                    except Exception as exc:  # told below, once the posts went
                        # A scan failing again and again (a row it cannot read, its retry time still due) held
                        # every post behind it since the scan goes first: the posts go all the same.
                        scan_failed = exc
                await self._drain_posts(worker)
                if scan_failed is not None:
                    raise scan_failed
                wake_at = await self._next_due(worker)
                if not worker.kick.is_set():  # else its drain may have stopped short to read the queue again
                    worker.whole = number
                    worker.passed.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store hiccuped: keep the worker alive and try again
                count_failure("bus_worker", name)
                if isinstance(exc, store_errors()):  # an outage: one line per attempt, not a traceback each
                    log.warning("bus.worker_store_unavailable", platform=name, error=str(exc).strip() or repr(exc))
                else:
                    log.error("bus.worker_error", platform=name, error=repr(exc), exc_info=True)
                wake_at = self.clock() + RETRY.delay(0)
            # Asleep until kicked or until the next thing falls due: an idle bus reads nothing.
            timeout = None if wake_at is None else max(0.0, wake_at - self.clock())
            worker.asleep_until = wake_at
            await until_set(worker.kick, timeout)
            worker.asleep_until = None

    async def _next_due(self, worker: _Worker) -> float:
        due = [] if worker.retry_at is None else [worker.retry_at]
        if setup_refused(worker.adapter) is not None:
            return min([worker.scan_at, *due])  # its posts wait for the restart: their due times would wake it
        next_post = await self.outbox.next_due_at(worker.adapter.name)
        if next_post is not None:
            due.append(next_post)
        held = worker.held_until
        if held is not None and self.clock() < held:
            # The rows stay due for the other replicas: here they wake the worker only once its hold is over.
            due = [max(at, held) for at in due]
        return min([worker.scan_at, *due])

    def _held(self, worker: _Worker) -> bool:
        """Whether the platform refused this process's token within its backoff (see :attr:`_Worker.held_until`)."""
        return worker.held_until is not None and self.clock() < worker.held_until

    def _hold(self, worker: _Worker, delay: float, why: str) -> None:
        """The platform refused this process's token: its posts and scanned edits wait ``delay`` seconds here (a
        longer wait already running is kept), then one of them asks again; a scan is due when the hold ends."""
        until = self.clock() + delay
        worker.held_until = until if worker.held_until is None else max(worker.held_until, until)
        _retry_by(worker, worker.held_until)
        self._cards_refused[worker.adapter.name] = why

    def _token_good(self, worker: _Worker) -> None:
        """A card post or edit landed: the platform takes this process's token (again)."""
        worker.held_until = None
        self._cards_refused.pop(worker.adapter.name, None)

    async def _drain_posts(self, worker: _Worker) -> None:
        adapter = worker.adapter
        refused = setup_refused(adapter)
        if refused is not None:
            # Nothing is tried with a refused token until the operator's restart (see SetupRefused): each try
            # failed at once, yet counted as an attempt that may have landed, so the card went out after the
            # restart marked "posted again", and one whose request ended meanwhile was said maybe unsettled.
            # The posts only say why they wait (doctor lists them), no attempt counted.
            kept, worker.kept_upto = await self.outbox.kept(adapter.name, refused, above=worker.kept_upto)
            if kept:
                log.warning("bus.card_posts_kept", platform=adapter.name, posts=kept, why=refused)
            return
        if self._held(worker):
            # The token was refused: one post asks again when the hold ends (see _post). Those queued since only
            # say why they wait (doctor lists them), as the ones waiting then do.
            why = self._cards_refused.get(adapter.name)
            if why is not None:
                _, worker.kept_upto = await self.outbox.kept(adapter.name, why, above=worker.kept_upto)
            return
        for index, job in enumerate(await self.outbox.due(adapter.name)):
            if self._stopping:
                return
            if worker.to_settle:  # a decision came in: its edits go before the next post
                await self._settle_requested(worker)
            if index and worker.kick.is_set():
                # Something new was queued: read the queue again, so new posts take their place in its order
                # (an agent's card is not held behind a batch of API cards read before it came). At least one
                # post per pass, so a stream of kicks cannot hold every post back.
                return
            if await self._post(worker, job):
                return  # the token was refused: the rest of this pass waits with every other post (see _post)

    async def _post(self, worker: _Worker, job: PostJob) -> bool:
        """Post ``job``'s card wherever its policy sends it on ``worker``'s platform. True: the platform refused
        the token it carried (Telegram's 401), and this process holds every post waiting on it untried."""
        adapter = worker.adapter
        request = await self.store.get(job.request_id)
        if request is None:
            await self.outbox.done(job, "dropped", "unknown request")
            return False
        if request.status is not Status.PENDING:
            routed = self._places(adapter, request.policy)
            known = {c.chat for c in await self.store.cards(request.id) if c.platform == adapter.name}
            if job.attempts and len(known) < len(routed):
                if isinstance(adapter, IdempotentPosts) and adapter.idempotent_posts:
                    await self._find_by_nonce(adapter, job, request, routed, known)
                    return False
                # A post was under way when a process stopped: it may have landed without being recorded. Its
                # buttons are refused while the request is pending; a press on it now finds it, and it is edited
                # to the outcome then (approvals record_stale_card). Until someone presses, it shows buttons.
                count_failure("card_maybe_unsettled", adapter.name)
                log.warning("bus.card_maybe_unsettled", platform=adapter.name, request_id=request.id)
            await self.outbox.done(job, "skipped", f"request already {request.status.value}")
            return False
        try:
            card = self._card_for(request, await self._reviews(request))
        except CardIntegrityError as exc:
            await self._refuse_tampered(request, exc)
            await self.outbox.done(job, "refused", exc.reason)
            return False
        places = self._places(adapter, request.policy)
        if not places:
            # The policy's to: changed since the post was queued (a restart with another configuration).
            await self.outbox.done(job, "skipped", f"policy {request.policy} sends no card to {adapter.name}")
            return False
        if not await self.outbox.claim(job, self.claim_seconds):
            log.debug("bus.card_post_claimed_elsewhere", platform=adapter.name, request_id=job.request_id)
            return False
        cards = [c for c in await self.store.cards(request.id) if c.platform == adapter.name]
        recorded = {c.chat for c in cards}
        named = {p.chat for p in places if p.chat is not None}
        # The home chat's card is any unbound card outside the chats the policy names: Telegram records a card
        # where it landed, so a home group that moved records its new id.
        home_recorded = any(c.bound_to is None and c.chat not in named for c in cards)
        retry: PlatformError | TimeoutError | None = None
        failed: list[str] = []
        may_have_landed = False  # a failure of this attempt that may hide a card out there, unrecorded
        for place in places:
            try:
                home = place.chat is None and place.user is None
                chat = await self._chat_of(adapter, place)
                if (home and home_recorded) or (not home and chat in recorded):
                    # An earlier attempt at this post was under way when a process stopped; its card is recorded.
                    log.info("bus.card_post_already_recorded", platform=adapter.name, request_id=request.id)
                    continue
                ref = await self._post_one(adapter, job, card, chat if chat != adapter.home_chat else None)
            except (PlatformError, TimeoutError) as exc:
                _count_once("card_post", adapter.name, exc)
                nothing_done = _nothing_done(exc)
                may_have_landed = may_have_landed or not nothing_done
                if isinstance(exc, TimeoutError) or exc.retryable:
                    retry = exc if retry is None else retry
                    # A try that certainly did nothing is taken back from the count (see Outbox.retry_later): every
                    # refused try said "attempt 1", as if each were the first to reach the platform. It has none.
                    log.warning(
                        "bus.card_post_failed",
                        platform=adapter.name,
                        request_id=job.request_id,
                        attempt=None if nothing_done else job.attempts + 1,
                        nothing_done=nothing_done,
                        person=place.person,
                        error=str(exc) or type(exc).__name__,
                    )
                else:
                    failed.append(str(exc))
                    log.error("bus.card_post_gave_up", platform=adapter.name, request_id=job.request_id,
                              person=place.person, error=str(exc))  # fmt: skip
                    if place.person is not None:
                        await self._say_dm_refused(adapter, place.person, request, exc)
                continue
            if place.person is not None:
                self._dm_refused.discard((adapter.name, place.person))
            await self._record_post(request.id, ref, bound_to=place.person, reposted=_reposts(adapter, job))
            recorded.add(ref.chat)
            self._token_good(worker)
            log.info("bus.card_posted", platform=adapter.name, request_id=request.id, chat=ref.chat,
                     message=ref.message_id, person=place.person)  # fmt: skip
        if request.id in worker.to_settle:
            # Decided while this post was under way: the decision's one read of the request's cards (shared by
            # every platform) may have been made before this card was recorded. Read them again for this
            # platform, or the card keeps its buttons until the slow safety scan.
            worker.to_settle[request.id] = asyncio.ensure_future(self._decided(request.id))
        if retry is not None:
            retry_after = retry.retry_after if isinstance(retry, PlatformError) else None
            delay = RETRY.delay(job.attempts, retry_after=retry_after)
            refused = not may_have_landed and isinstance(retry, PlatformError) and retry.operator_must_act
            if refused:
                # Not counted, so the attempts do not stretch its backoff: a refusal only the operator can end (a
                # token Telegram refused) is tried again as seldom as the backoff's longest wait, not at its first.
                delay = RETRY.delay(RETRY_LONGEST, retry_after=retry_after)
            error = str(retry) or type(retry).__name__
            if refused:
                # Every other post carries the same token: each was tried in turn and refused, one refused call
                # (and a turn of the chat's pacing, a count, a warning) per waiting card at every backoff. They
                # wait with this one, untried, so one post a backoff asks whether the token is good again. They
                # wait here only: the rows stay due for a replica whose token works (see Outbox.refused).
                held, worker.kept_upto = await self.outbox.refused(job, error, above=worker.kept_upto)
                self._hold(worker, delay, error)
                log.warning("bus.card_posts_held", platform=adapter.name, posts=held, retry_in=round(delay, 2),
                            error=error)  # fmt: skip
                return True
            await self.outbox.retry_later(job, delay, error, attempted=may_have_landed)
        elif failed and not recorded:
            await self.outbox.done(job, "failed", "; ".join(failed))
        else:
            await self.outbox.done(job, "posted", "; ".join(failed) or None)
        return False

    async def _say_dm_refused(
        self, adapter: PlatformAdapter, person: str, request: ApprovalRequest, exc: PlatformError
    ) -> None:
        """A card for ``person``'s direct messages was refused for good: a request routed only there would wait
        with nobody seeing it, so the platform's home chat hears why (once per person, until a card lands)."""
        if adapter.home_chat is None or (adapter.name, person) in self._dm_refused:
            return
        self._dm_refused.add((adapter.name, person))
        why = str(exc).removeprefix(f"{exc.platform} {exc.site}: ")
        title = CHAT_PLATFORMS[adapter.name].title if adapter.name in CHAT_PLATFORMS else adapter.name
        text = (
            f"{person} did not get the approval card for {reveal_line(request.tool)} in a direct message on {title}: "
            f"{why}. It still waits for a decision on the console's Approvals page, and on any other card its "
            "policy posts."
        )
        await self.send(Address(adapter.name, adapter.home_chat), Outgoing(text))

    async def _chat_of(self, adapter: PlatformAdapter, place: CardTarget) -> str:
        """The chat a card goes to: the home chat, a chat the policy names, or a person's direct messages."""
        if place.chat is None and place.user is None:
            assert adapter.home_chat is not None  # _places keeps a home place only where there is one
            return adapter.home_chat
        if not isinstance(adapter, RoutesCards):
            raise PlatformError(adapter.name, "card_post", "this platform posts cards only in its home chat",
                                retryable=False)  # fmt: skip
        if place.user is not None:
            return await within(
                adapter.direct_chat(place.user), self.platform_timeout, platform=adapter.name, site="card_dm"
            )
        assert place.chat is not None
        return place.chat

    async def _post_one(self, adapter: PlatformAdapter, job: PostJob, card: ApprovalCard, chat: str | None) -> CardRef:
        """Post ``card`` into ``chat`` (None: the home chat), said to be a second copy when an earlier attempt may
        have landed unrecorded (where the platform cannot make a post idempotent). Raises on failure."""
        if _reposts(adapter, job):
            # That attempt may have landed, unrecorded: its copy's buttons are refused (not a recorded card of
            # the request), but it still shows them. This copy says so (and every later edit of it: the card's
            # row remembers). On Discord the nonce gives the first message back instead.
            card = _marked(card)
            count_failure("card_reposted", adapter.name)
            log.warning("bus.card_reposted", platform=adapter.name, request_id=card.request_id,
                        attempt=job.attempts + 1)  # fmt: skip
        if failpoints.armed:
            await failpoints.reached(
                "bus.post",
                lambda: PlatformError(adapter.name, "card_post", "503 (failpoint)", retryable=True),
                where=adapter.name,
            )
        if chat is None:
            return await within(adapter.post_card(card), self.platform_timeout, platform=adapter.name, site="card_post")
        assert isinstance(adapter, RoutesCards)
        return await within(
            adapter.post_card_in(card, chat), self.platform_timeout, platform=adapter.name, site="card_post"
        )

    async def _find_by_nonce(
        self,
        adapter: PlatformAdapter,
        job: PostJob,
        request: ApprovalRequest,
        places: list[CardTarget],
        recorded: set[str],
    ) -> None:
        """The request ended while an attempt at its post was unrecorded: post it again with the same nonce, so
        the platform gives the first message back (or, had it never landed, posts it now), record it and settle
        it to the outcome. Its buttons never decide: the request is no longer pending. Only where the policy
        sends its cards (a DM card is found in that DM, never in the home chat)."""
        try:
            card = self._card_for(request)
        except CardIntegrityError:
            card = integrity_card(request, public_url=self.config.web.public_url)
        if not await self.outbox.claim(job, self.claim_seconds):
            return
        found = 0
        for place in places:
            try:
                chat = await self._chat_of(adapter, place)
                if chat in recorded:
                    continue
                try:
                    earlier = await self._look_for_card(adapter, request, chat)
                except (PlatformError, TimeoutError) as exc:
                    # A look that may work later (a 5xx, a 429 outlasting the call, a timeout): posting again now
                    # made a second card once Discord forgot the nonce, and the first, never recorded, kept live
                    # buttons. The post waits and looks again; a read landed nothing, so no attempt is counted.
                    _count_once("card_find", adapter.name, exc)
                    retry_after = exc.retry_after if isinstance(exc, PlatformError) else None
                    error = str(exc) or type(exc).__name__
                    await self.outbox.retry_later(
                        job, RETRY.delay(job.attempts, retry_after=retry_after), error, attempted=False
                    )
                    log.warning("bus.card_look_deferred", platform=adapter.name, request_id=request.id, error=error)
                    return
                if earlier is not None:
                    ref = earlier
                elif chat == adapter.home_chat:
                    ref = await within(
                        adapter.post_card(card), self.platform_timeout, platform=adapter.name, site="card_post"
                    )
                else:
                    assert isinstance(adapter, RoutesCards)  # _chat_of refuses a route elsewhere
                    ref = await within(
                        adapter.post_card_in(card, chat), self.platform_timeout, platform=adapter.name, site="card_post"
                    )
            except (PlatformError, TimeoutError) as exc:
                _count_once("card_post", adapter.name, exc)
                if isinstance(exc, TimeoutError) or exc.retryable:
                    retry_after = exc.retry_after if isinstance(exc, PlatformError) else None
                    delay = RETRY.delay(job.attempts, retry_after=retry_after)
                    await self.outbox.retry_later(job, delay, str(exc), attempted=not _nothing_done(exc))
                else:
                    await self.outbox.done(job, "failed", str(exc))
                log.warning("bus.card_find_failed", platform=adapter.name, request_id=request.id, error=str(exc))
                return
            await self._record_post(request.id, ref, ended=True, bound_to=place.person)
            found += 1
            log.info("bus.card_found_by_nonce", platform=adapter.name, request_id=request.id,
                     message_id=ref.message_id)  # fmt: skip
        await self.outbox.done(job, "posted", f"found again by its nonce after the request was {request.status.value}")
        if found:
            await self.settle(request.id)

    async def _look_for_card(self, adapter: PlatformAdapter, request: ApprovalRequest, chat: str) -> CardRef | None:
        """The card an unrecorded attempt landed in ``chat``, found among its recent messages where the platform
        can (see :class:`FindsCards`): its nonce may be forgotten by now. None: post again with the nonce, also when the
        platform refuses the look for good (no Read Message History): the nonce finds it while the platform still
        keeps it. Raises a failure that may pass (see :meth:`_find_by_nonce`)."""
        if not isinstance(adapter, FindsCards):
            return None
        try:
            return await within(
                adapter.find_card(request.id, chat), self.platform_timeout, platform=adapter.name, site="card_find"
            )
        except PlatformError as exc:
            if exc.retryable:
                raise
            log.warning("bus.card_look_failed", platform=adapter.name, request_id=request.id,
                        error=str(exc) or type(exc).__name__)  # fmt: skip
            return None

    async def _record_post(
        self,
        request_id: str,
        ref: CardRef,
        *,
        ended: bool = False,
        bound_to: str | None = None,
        reposted: bool = False,
    ) -> None:
        """Record a posted card's message id. The card is out: a write that fails is tried again for a few
        seconds before giving up (then the post is tried again when its claim runs out, marked as such)."""
        for attempt, pause in enumerate((*RECORD_RETRIES, None)):
            try:
                if failpoints.armed:
                    await failpoints.reached(
                        "bus.post.recorded",
                        lambda: simulated_failure(self.store.tables, "record_card"),
                        where=ref.platform,
                    )
                await self.store.record_card(
                    request_id, ref.platform, ref.chat, ref.message_id, whole=ref.whole, ended=ended,
                    bound_to=bound_to, reposted=reposted,
                )  # fmt: skip
                return
            except store_errors() as exc:
                count_failure("card_record", ref.platform)
                log.warning("bus.card_record_failed", platform=ref.platform, request_id=request_id,
                            attempt=attempt + 1, error=str(exc))  # fmt: skip
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    async def _refuse_tampered(self, request: ApprovalRequest, exc: CardIntegrityError) -> None:
        """A request whose stored call does not hash to its hash: no card, and it ends now, never to run."""
        count_failure("card_integrity")
        log.error("bus.card_refused", request_id=request.id, reason=exc.reason)
        await self.store.audit(request.id, "card_refused", detail=exc.reason)
        await self.store.finish(
            request.id,
            Status.CANCELLED,
            actor=None,
            platform=None,
            reason=f"its stored call was changed outside Kazma ({exc.reason}); nothing ran",
        )
        await self.settle(request.id)

    def _card_for(self, request: ApprovalRequest, reviews: Sequence[Review] = ()) -> ApprovalCard:
        return build_card(
            request,
            value_limit=self.config.approvals.value_limit,
            public_url=self.config.web.public_url,
            # "Approve for …" where a team enabled it and a rule would ever be consulted (build_card decides the rest)
            remember_seconds=remember_offer(self.config, request),
            progress=progress_line(self.config, request, reviews),
        )

    async def _reviews(self, request: ApprovalRequest) -> list[Review]:
        """The reviews a card's progress line shows (none to read when one press decides the request)."""
        if request.approve_needed == 1 and request.deny_needed == 1:
            return []
        return await self.store.reviews(request.id)

    async def _settle_requested(self, worker: _Worker) -> None:
        """Edit the cards of every request decided here, by request id: no scan."""
        adapter = worker.adapter
        while worker.to_settle and not self._stopping:
            request_id, loaded = next(iter(worker.to_settle.items()))
            try:
                decided = await loaded
                mine = [p for p in decided.cards if p.platform == adapter.name and p.settled_at is None]
                for index, posted in enumerate(mine):
                    # The last card of the last request queued: nothing else to edit after it, its row may ride.
                    idle = index == len(mine) - 1 and len(worker.to_settle) == 1
                    if not self._stopping:
                        await self._settle_one(
                            worker, posted, decided.request, decided.witness, decided=decided,
                            ride=SETTLED_RIDE if idle else 0.0,
                        )  # fmt: skip
            finally:
                del worker.to_settle[request_id]
                if not worker.to_settle:
                    worker.drained.set()
                if isinstance(adapter, UrgentEdits) and adapter.home_chat:
                    adapter.edit_done(adapter.home_chat)

    async def _refresh_requested(self, worker: _Worker) -> None:
        """Edit this platform's cards of every request a review changed: the progress, buttons kept. Best
        effort: a failed edit is logged and counted (the next review or the outcome edits the card again)."""
        adapter = worker.adapter
        if setup_refused(adapter) is not None:
            worker.to_refresh.clear()  # best effort, and nothing is tried with a refused token: the outcome edits all
            return
        while worker.to_refresh and not self._stopping and isinstance(adapter, UpdatesCards):
            request_id = next(iter(worker.to_refresh))
            del worker.to_refresh[request_id]
            request = await self.store.get(request_id)
            if request is None or request.status is not Status.PENDING:
                continue  # decided: the edit to its outcome is the settle's
            try:
                card = self._card_for(request, await self._reviews(request))
            except CardIntegrityError:
                continue  # the post refuses it, and it ends
            edited: list[PostedCard] = []
            for posted in await self.store.cards(request_id):
                if posted.platform != adapter.name or posted.settled_at is not None:
                    continue
                ref = CardRef(posted.platform, posted.chat, posted.message_id)
                shown = _marked(card) if posted.reposted else card
                try:
                    await within(
                        adapter.update_card(ref, shown),
                        self.platform_timeout,
                        platform=adapter.name,
                        site="card_update",
                    )
                except (PlatformError, TimeoutError) as exc:
                    count_failure("card_progress", adapter.name)
                    log.warning("bus.card_progress_failed", platform=adapter.name, request_id=request_id,
                                error=str(exc) or type(exc).__name__)  # fmt: skip
                    continue
                edited.append(posted)
            await self._outcome_after_progress(worker, request_id, edited)

    async def _outcome_after_progress(self, worker: _Worker, request_id: str, edited: list[PostedCard]) -> None:
        """Decided while its progress was being shown (another replica may have edited it to the outcome
        meanwhile, under this edit): the edited cards show the outcome again, now."""
        if not edited:
            return
        after = await self.store.get(request_id)
        if after is None or after.outcome() is None:
            return
        for posted in edited:
            await self._settle_one(worker, replace(posted, settled_at=None), after, force=True)

    async def _scan_settles(self, worker: _Worker) -> None:
        """Every card on this platform still to be edited, found in the store: at start, when an edit that
        failed is due again, and every :attr:`poll_interval` as a safety net."""
        adapter = worker.adapter
        now = self.clock()
        worker.scan_at = now + self.poll_interval
        if setup_refused(adapter) is not None:  # its edits wait for the restart, as its posts (see _drain_posts)
            worker.retry_at = None
            return
        if self._held(worker):  # the token was refused: one edit asks again when the hold ends (see _settle_one)
            return
        for posted in await self.store.unsettled_cards(adapter.name, due_by=now):
            if self._stopping:
                return
            if await self._settle_one(worker, posted):
                break  # the token was refused: the rest wait with that edit (see _settle_one)
        worker.retry_at = await self.store.next_settle_retry(adapter.name)
        if self._held(worker) and worker.held_until is not None:  # the refused edits are due in the rows already
            _retry_by(worker, worker.held_until)

    async def _settle_one(
        self,
        worker: _Worker,
        posted: PostedCard,
        request: ApprovalRequest | None = None,
        witness: Witness | None = None,
        *,
        force: bool = False,
        decided: _Decided | None = None,
        ride: float = 0.0,
    ) -> bool:
        """Edit ``posted`` to its request's outcome. ``force``: even when its row says it is settled already
        (a progress edit may have landed over that edit). ``decided``: the request decided here that ``request``
        and ``witness`` come from, with its card built already. ``ride``: how long the row saying it is settled
        may wait for other writes to commit with (:data:`SETTLED_RIDE`). True: the platform refused the token the
        edit carried (Telegram's 401), and every other decided card's edit there was held untried."""
        adapter = worker.adapter
        if setup_refused(adapter) is not None:
            return False  # left unsettled in the store: the scan at the operator's restart edits it (see _scan_settles)
        if request is None or request.id != posted.request_id:
            request = await self.store.get(posted.request_id)
            witness = decided = None
        if request is None:
            return False
        outcome = request.outcome()
        if outcome is None:
            return False
        if witness is None:
            witness = await self._witness(request.id)
        afterwards = None
        if posted.settled_status is not None and outcome.approved:
            # Settled before and asked again: Kazma stopped before the approved call finished (recovery). Only
            # then is the note read: a first settle never pays for it.
            afterwards = await self.store.execution_note(request.id)
        outcome = replace(outcome, witness=witness, afterwards=afterwards)
        card = None if decided is None else decided.card
        if card is None:
            try:
                card = self._card_for(request, await self._reviews(request))
            except CardIntegrityError:
                # Settled all the same (the buttons must go), but showing no value from the changed row.
                card = integrity_card(request, public_url=self.config.web.public_url)
        if posted.reposted:  # it said it was posted again: its edit says so still
            card = _marked(card)
        if self.shared and not force and not await self.store.claim_settle(posted, self.claim_seconds):
            # Another replica edits it (or it waits out a failed edit): look again when that claim has run out.
            due = self.clock() + self.claim_seconds
            _retry_by(worker, due)
            return False
        ref = CardRef(posted.platform, posted.chat, posted.message_id)
        try:
            if failpoints.armed:
                await failpoints.reached(
                    "bus.settle.sent",
                    lambda: PlatformError(adapter.name, "card_settle", "503 (failpoint)", retryable=True),
                    where=adapter.name,
                )
            await within(
                adapter.settle_card(ref, card, outcome),
                self.platform_timeout,
                platform=adapter.name,
                site="card_settle",
            )
        except (PlatformError, TimeoutError) as exc:
            retryable = isinstance(exc, TimeoutError) or exc.retryable
            retry_after = exc.retry_after if isinstance(exc, PlatformError) else None
            _count_once("card_settle", adapter.name, exc)
            if not retryable:
                # The card cannot be edited any more (deleted, or not ours): record that
                # it is as settled as it will ever be, so the worker stops trying.
                log.error("bus.card_settle_gave_up", platform=adapter.name, request_id=request.id, error=str(exc))
                await self.store.mark_card_settled(posted, request.status)
                if decided is not None:
                    decided.unsettled -= 1
                return False
            attempts = await self.store.settle_attempts(posted)
            delay = RETRY.delay(attempts + 1, retry_after=retry_after)
            refused = isinstance(exc, PlatformError) and exc.operator_must_act and exc.nothing_done
            if refused:
                # This process's token: the edit is due at once for a replica whose token works, and this one
                # waits in its memory (see ApprovalStore.settle_refused).
                await self.store.settle_refused(posted)
            else:
                # The retry time lives in the card's row: a scan before then does not even read it.
                await self.store.settle_failed(posted, delay)
                due = self.clock() + delay
                _retry_by(worker, due)
            log.warning(
                "bus.card_settle_failed",
                platform=adapter.name,
                request_id=request.id,
                attempt=attempts + 1,
                retry_in=round(delay, 2),
                error=str(exc) or type(exc).__name__,
            )
            if refused:
                # Every other edit carries the same token: each was tried in turn and refused, one refused call
                # per decided card at every backoff. They wait with this one, untried (see _post's hold).
                self._hold(worker, delay, str(exc))
                log.warning("bus.card_settles_held", platform=adapter.name, retry_in=round(delay, 2))
                return True
            return False
        edited = time.time()  # what the histogram counts: the card shows the outcome (its row may ride after)
        self._token_good(worker)
        if failpoints.armed:
            await failpoints.reached(
                "bus.settle.recorded", lambda: simulated_failure(self.store.tables, "card_settled"), where=adapter.name
            )
        await self.store.mark_card_settled(posted, request.status, ride=ride)
        if decided is not None:  # its cards are counted here: no read of them after each edit
            decided.unsettled -= 1
            last = decided.unsettled == 0
        else:
            last = all(c.settled_at for c in await self.store.cards(request.id))
        if request.decided_at is not None and last:
            DECISION_TO_SETTLED.observe(max(0.0, edited - request.decided_at.timestamp()))
        log.info("bus.card_settled", platform=adapter.name, request_id=request.id, status=request.status.value)
        return False


def _nothing_done(exc: PlatformError | TimeoutError) -> bool:
    """Whether a failed post certainly landed nothing (see :attr:`PlatformError.nothing_done`)."""
    return isinstance(exc, PlatformError) and exc.nothing_done


def _reposts(adapter: PlatformAdapter, job: PostJob) -> bool:
    """Whether a post of ``job`` is a second copy that says so: an earlier attempt may have landed unrecorded, on a
    platform that cannot make a post idempotent."""
    return bool(job.attempts) and not (isinstance(adapter, IdempotentPosts) and adapter.idempotent_posts)


def _marked(card: ApprovalCard) -> ApprovalCard:
    """``card`` saying it was posted again."""
    return card if REPOSTED in card.warnings else replace(card, warnings=(*card.warnings, REPOSTED))


class NullBus:
    """No platform configured: nothing can show a card, so dangerous tools are refused."""

    adapters: dict[str, PlatformAdapter] = {}  # noqa: RUF012 - never mutated

    async def start(self, handlers: Handlers, *, ingress: bool = True) -> None:
        log.warning("bus.no_platforms", detail="no chat platform is configured; dangerous tools will be refused")

    async def stop(self) -> None:
        return

    def health(self, leader: LeaderInbound | None = None, *, leads: bool = False) -> list[PlatformHealth]:
        return []

    def can_show_cards(self, policy: str | None = None) -> bool:
        return False

    async def publish(self, card: ApprovalCard) -> None:
        count_failure("card_post", "none")
        log.error("bus.card_dropped", request_id=card.request_id, reason="no platform configured")

    async def settle(self, request_id: str) -> None:
        return

    async def send(self, to: Address, message: Outgoing) -> str | None:
        if message.file is not None:
            log.info("bus.file_dropped", platform=to.platform, chat=to.chat, reason="no platform configured")
        else:
            log.info("bus.message_dropped", platform=to.platform, chat=to.chat, reason="no platform configured")
        return None

    async def send_text(self, platform: str, chat: str, text: str, *, agent: str | None = None) -> str | None:
        return await self.send(Address(platform, chat), Outgoing(text, agent=agent))

    async def working(self, at: Address) -> bool:
        return False

    async def broadcast(
        self, text: str, *, agent: str | None = None, skip: Collection[str] = (), only: str | None = None
    ) -> dict[str, str | None]:
        return {}
