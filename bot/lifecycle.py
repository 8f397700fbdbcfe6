"""How a running Kazma starts, leads, sweeps and stops (the parts themselves are wired in :mod:`kazma.bot.app`).

Start recovers what an earlier process left before any platform can start new
work, then opens the platforms. Among replicas on PostgreSQL the start makes
this replica visible first, and the duties only one replica may hold (the
singleton ingress, the sweeps, judging what gone replicas left) run while its
lease lasts: the lease calls :meth:`Lifecycle.lead` and :meth:`Lifecycle.follow`.
Stop hands the lease over first, then ends the background work and closes the
parts in the reverse order of their start.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import structlog

from kazma.adapters.bus import FanOutBus, NullBus
from kazma.adapters.contract import Handlers
from kazma.approvals import ApprovalService
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.orphans import Orphans
from kazma.approvals.service import Recovery
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.audit_sink import AuditSink
from kazma.bot.chat_moves import ChatMoves
from kazma.bot.inbound_claims import InboundClaims
from kazma.bot.store import StoreWatch
from kazma.bot.store_handles import StoreHandles
from kazma.config import LoadedConfig
from kazma.config.address import Address, AddressError
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.outgoing import Outgoing
from kazma.config.supervisor import Supervisor
from kazma.engine.conversation import Conversations
from kazma.engine.executor import Action, PlanExecutor
from kazma.engine.swarm.service import SwarmService
from kazma.engine.tools.executions import ExecutionRecord
from kazma.engine.transcript import TranscriptStore
from kazma.engine.types import ModelProvider

if TYPE_CHECKING:
    from kazma.bot.replication import Replication
    from kazma.engine.tools.mcp_tools import MCPSources

log = structlog.get_logger("kazma.app")

# A leader's singleton ingress that failed to open is tried again this often; an open one is checked this often.
INGRESS_RETRY = Backoff(base=1.0, cap=30.0)
INGRESS_CHECK_SECONDS = 10.0
# The leader looks this often whether a platform's inbound state changed, to record it for the followers'
# /healthz (a look is local; the store is written only on a change).
INBOUND_RECORD_SECONDS = 1.0
# A long-lived loop (a sweep, the store watch, the leader's ingress) that failed is started again this soon.
LOOP_RESTART = Backoff(base=1.0, cap=60.0)
# At a clean stop the turns in flight may finish this long (a turn whose approval the stop withdrew tells its asker).
TURN_GRACE = 2.0


@dataclass(kw_only=True)
class Lifecycle(ABC):
    """The parts a running Kazma starts and stops, and the work it does in the background meanwhile."""

    loaded: LoadedConfig
    stores: StoreHandles
    service: ApprovalService
    bus: FanOutBus | NullBus
    conversations: Conversations
    executor: PlanExecutor
    provider: ModelProvider
    swarm: SwarmService
    chat_moves: ChatMoves
    mcp: MCPSources | None = None
    replica: str = "local"
    # Several replicas on one PostgreSQL database: this one's lease and wake-ups (None on SQLite).
    replication: Replication | None = None
    # Signed requests seen (Slack's replay guard), in the store on either backend; the claims table holds them.
    signed_requests: InboundClaims | None = None
    # The approvals API's idempotency keys, swept with the other retention (None: not swept here).
    api_keys: IdempotencyKeys | None = None
    # Every tool execution's row (None: not recorded here); rows a dead process left running end "lost" at start.
    executions: ExecutionRecord | None = None
    # Signs the audit chain's head within milliseconds of each decision (every replica runs one).
    checkpointer: Checkpointer | None = None
    # audit.sink: streams the audit chain out as it commits (the leader's duty among replicas).
    audit_sink: AuditSink | None = None
    # The console's transcript, pruned by the retention sweep (web.transcript_retention_days; None: not here).
    transcript: TranscriptStore | None = None
    sweep_interval: float = 5.0
    # A turn in flight at a clean stop may finish this long (seconds); then it is cancelled.
    turn_grace: float = TURN_GRACE
    store_watch: StoreWatch | None = field(init=False, default=None)
    _tasks: Supervisor = field(init=False, default_factory=lambda: Supervisor("app_task"))  # sweeps, watch, notices
    _leader_tasks: Supervisor = field(init=False, default_factory=lambda: Supervisor("leader_task"))  # while leading
    _live: set[str] = field(init=False, default_factory=set)  # the replicas alive at the leader's last look
    _recovery_due: bool = field(init=False, default=False)  # the leader has yet to judge what gone replicas left
    _serving: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # Recovery notices not yet sent, oldest first: the background notices send them, and a stop that cancelled
    # those sends what is left before the platforms stop (a SIGTERM soon after a start lost them).
    _untold: deque[tuple[str, str]] = field(init=False, default_factory=deque)
    _telling: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    # The orphans this start fenced while their cancelling runs: the stop tells those it already cancelled.
    _orphans: Orphans | None = field(init=False, default=None)

    @property
    @abstractmethod
    def handlers(self) -> Handlers:
        """What the platforms call (the app's)."""

    async def start(self, *, serving: Callable[[], Awaitable[None]] | None = None) -> None:
        """Recover, then open the platforms; ``serving`` is called as soon as they answer (the web console opens
        there, and says Kazma runs), before what may come after: recovery's notices, the orphans' cancelling,
        the sweeps. That work no longer holds the moment Kazma answers presses and messages."""
        log.info("app.model", provider=self.provider.label)
        if self.replication is not None:
            await self._start_replica(self.replication, serving)
            return
        # Recover before any platform can start new work: a task or step started by
        # this process must never be mistaken for one a dead process left running.
        await self._start_audit()
        await self._executions_lost(None)  # first: the endings below say what may have run
        interrupted, tell_lead = await self.executor.mark_interrupted()
        if interrupted:
            log.warning("app.steps_interrupted", steps=[f"{p}#{i}" for p, i in interrupted])
        await self.swarm.recover()  # its reports are held until the platforms are up (swarm.serving below)
        # Orphans are fenced before anyone can press their stale buttons (a press ends one first), and
        # cancelled in batches once this process serves: thousands of them no longer hold the start.
        orphans = await Orphans.find(self.service)
        self.service.orphans = orphans
        recovery = await self.service.recover(orphans=False)  # approved calls that never ran: reported now
        self._tasks.keep(self._retention, name="kazma-swarm-retention", backoff=LOOP_RESTART)
        if self.audit_sink is not None:
            self._tasks.keep(self.audit_sink.run, name="kazma-audit-sink", backoff=LOOP_RESTART)
        await self._follow_chat_moves()
        if self.mcp is not None:  # tools listed before the first turn when the servers are quick; later otherwise
            await self.mcp.start(wait=10.0)
        await self.bus.start(self.handlers)
        # Alone on the store this process is the leader for good: an ingress its platform closed (Discord's gateway
        # after a close discord.py does not reconnect after) stayed closed until a restart, with nothing retrying.
        self._tasks.keep(self._keep_ingress, name="kazma-ingress", backoff=LOOP_RESTART)
        self.swarm.serving()
        if serving is not None:
            await serving()
        await self._tell(recovery)
        await self.executor.perform(tell_lead)
        self._tasks.spawn(self._recovered(orphans), name="kazma-orphans")  # then the sweeps
        store_path = self.loaded.config.store.path
        if str(store_path) != ":memory:" and store_path.exists():
            self.store_watch = StoreWatch(store_path, self._store_lost)
            self._tasks.keep(self.store_watch.run, name="kazma-store-watch", backoff=LOOP_RESTART)
        log.info("app.started", platforms=sorted(self.bus.adapters), store=str(self.loaded.config.store.path))

    async def _start_replica(
        self, replication: Replication, serving: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """One of several replicas: visible to the others first, then what its previous life left, then serve.
        The sweeps and the singleton ingress wait for the lease (:meth:`lead`)."""
        from kazma.bot.replication import AllBut

        # Its name goes on what it starts from now on: the others tell from its lease session whether it lives.
        self.service.store.replica = self.replica
        self.executor.store.replica = self.replica
        self.swarm.store.replica = self.replica
        if self.executions is not None:
            self.executions.replica = self.replica
        await replication.start()  # its lease session is up: no leader takes what it starts for a dead one's
        await self._start_audit()
        # What this replica's previous life (same name) left: the others may never have seen it gone. Its
        # orphans are fenced here and cancelled in batches once it serves, as on a store of its own.
        await self.swarm.restore_breakers()
        orphans = await Orphans.find(self.service, AllBut(self.replica))
        self.service.orphans = orphans
        told = await self._recover_replicas(AllBut(self.replica), claims=False, orphans=False)
        await self._follow_chat_moves()
        if self.mcp is not None:
            await self.mcp.start(wait=10.0)
        await self.bus.start(self.handlers, ingress=False)  # the leader's own, opened with the lease
        self.swarm.serving()
        if serving is not None:
            await serving()
        self._serving.set()
        self._tasks.spawn(self._recovered(orphans, told, sweep=False), name="kazma-orphans")  # the leader sweeps
        log.info("app.started", platforms=sorted(self.bus.adapters), store="postgresql", replica=self.replica)

    async def lead(self) -> None:
        """This replica took the lease: open the singleton ingress and run the sweeps at once; the sweep judges
        what gone replicas left (once they have been missing long enough to be sure) and retries until done."""
        await self._serving.wait()  # the lease may come before this replica serves
        self._recovery_due = True
        self._leader_tasks.keep(self._keep_ingress, name="kazma-leader-ingress", backoff=LOOP_RESTART)
        self._leader_tasks.keep(self._record_inbound, name="kazma-leader-inbound", backoff=LOOP_RESTART)
        self._leader_tasks.keep(self._sweep, name="kazma-approvals-sweep", backoff=LOOP_RESTART)
        self._leader_tasks.keep(self._retention, name="kazma-swarm-retention", backoff=LOOP_RESTART)
        if self.audit_sink is not None:  # one replica streams: a new leader goes on from the stored position
            self._leader_tasks.keep(self.audit_sink.run, name="kazma-audit-sink", backoff=LOOP_RESTART)

    async def _start_audit(self) -> None:
        """The audit chain before anything appends: the one-time chaining of events from before it (after an
        upgrade), then a signature over whatever a previous run left unsigned, then the checkpointer."""
        await self.service.store.start_chain()
        if self.checkpointer is not None:
            await self.checkpointer.sign()
            self._tasks.keep(self.checkpointer.run, name="kazma-audit-checkpointer", backoff=LOOP_RESTART)

    async def _keep_ingress(self) -> None:
        """While leading (or alone on the store): every singleton ingress open; one that failed to open, or that
        its platform closed later (Discord ending the gateway for good), tried again with backoff."""
        if not isinstance(self.bus, FanOutBus):
            return
        failures = 0
        while True:
            if self.bus.ingress_missing():  # an open one is left alone: no start (nor its log line) every check
                await self.bus.start_ingress()
            missing = self.bus.ingress_missing()
            failures = failures + 1 if missing else 0
            if missing:
                log.warning("app.ingress_retry", platforms=missing, attempt=failures)
            await asyncio.sleep(INGRESS_RETRY.delay(failures - 1) if missing else INGRESS_CHECK_SECONDS)

    async def _record_inbound(self) -> None:
        """While leading: the platforms' inbound states recorded for the followers' /healthz, on each change."""
        replication = self.replication
        assert replication is not None
        failures = 0
        while True:
            try:
                await replication.record_inbound()
            except Exception as exc:  # the followers read the last record (or none) meanwhile; tried at the next look
                # Said and counted once per run of failures: a store refusing writes would otherwise log a
                # warning every look (every second) for as long as it lasts.
                if failures == 0:
                    count_failure("inbound_record")
                    log.warning("app.inbound_record_failed", error=str(exc))
                failures += 1
            else:
                if failures:
                    log.info("app.inbound_record_recovered", attempts=failures)
                failures = 0
            await asyncio.sleep(INBOUND_RECORD_SECONDS)

    async def _recover_replicas(
        self, live: Collection[str], *, claims: bool = True, orphans: bool = True
    ) -> tuple[Recovery, list[Action]]:
        """End what replicas not in ``live`` left running: pending requests (unless ``orphans`` is False: a
        start leaves its own to :class:`Orphans`), plan steps, swarm tasks (and release their post and edit
        claims); what to tell people and the lead is returned, not said."""
        replication = self.replication
        assert replication is not None
        if claims and not replication.is_leader:
            # The leader's sweep judged ``live``, then this replica stalled and lost the lease: the one leading
            # now judges again (what replicas it judged gone may have come back since).
            log.warning("app.recovery_skipped", replica=self.replica, reason="this replica no longer leads")
            return Recovery([], []), []
        # The leader's sweep asks before each write whether it still leads: one that stalled half-way and lost
        # the lease stops there (its judgement of ``live`` is stale); a start recovers its own previous life.
        leading: Callable[[], bool] | None = (lambda: replication.is_leader) if claims else None
        await self._executions_lost(live, leading)
        interrupted, tell_lead = await self.executor.mark_interrupted(live, leading=leading)
        if interrupted:
            log.warning("app.steps_interrupted", steps=[f"{p}#{i}" for p, i in interrupted])
        await self.swarm.recover_gone(live, leading=leading)
        if claims:
            recovery = await replication.recover_gone(set(live), leading=leading)
        else:
            recovery = await self.service.recover(live, orphans=orphans)
        return recovery, tell_lead

    async def _executions_lost(self, live: Collection[str] | None, leading: Callable[[], bool] | None = None) -> None:
        """Executions a process that is gone left running end "lost": they may have run, and every ending that
        names them says so."""
        if self.executions is None:
            return
        try:
            await self.executions.mark_lost(live, leading=leading)
        except Exception as exc:  # they still read "started, not finished"; the next start marks them
            count_failure("execution_record")
            log.warning("app.executions_unmarked", error=str(exc))

    async def _recovered(
        self, orphans: Orphans, told: tuple[Recovery, list[Action]] | None = None, *, sweep: bool = True
    ) -> None:
        """End what the previous life left that the start put off (its orphans; among replicas its notices too, side
        by side), wait until every card post and edit then due has been tried (the orphans' edits, the posts and
        edits the previous life queued), then say ``app.recovered``: from that line on an operator (or a test)
        reads the restart's own ending of its past, not a moment in the middle of it."""
        found = len(orphans)
        work = [self._end_orphans(orphans, sweep=sweep)]
        if told is not None:
            work.append(self._say(*told))
        await asyncio.gather(*work)
        if isinstance(self.bus, FanOutBus):
            await self.bus.caught_up()
        log.info("app.recovered", orphans=found, cancelled=len(orphans.cancelled))

    async def _end_orphans(self, orphans: Orphans, *, sweep: bool = True) -> None:
        """Cancel the orphans the start fenced, a batch at a time, each batch's cards edited as it commits;
        then tell their conversations and start the sweeps (an overdue orphan ends "cancelled" at a restart,
        as it always did, not "timeout"; among replicas the sweeps are the leader's, started with the lease)."""
        self._orphans = orphans
        if len(orphans):
            found = len(orphans)
            log.info("app.orphans_cancelling", requests=found)
            bus = self.bus
            await orphans.cancel_all(committed=bus.rescan if isinstance(bus, FanOutBus) else lambda: None)
            log.info("app.orphans_cancelled", requests=found, cancelled=len(orphans.cancelled))
        self.service.orphans = None
        self._orphans = None  # from here the notices queue holds what is left to say
        if sweep:
            self._tasks.keep(self._sweep, name="kazma-approvals-sweep", backoff=LOOP_RESTART)
        if orphans.cancelled:
            await self._say(Recovery(orphans.cancelled, []), [])

    async def _say(self, recovery: Recovery, tell_lead: list[Action]) -> None:
        """Recovery's notices, in the background: a paced platform must not hold up the sweeps or the ingress."""
        try:
            await self._tell(recovery)
            await self.executor.perform(tell_lead)
        except Exception as exc:
            count_failure("recovery_notice")
            log.warning("app.recovery_notice_failed", error=str(exc))

    async def follow(self, reason: str) -> None:
        """The lease is gone (another replica leads, or the database cannot be reached): stop the sweeps."""
        await self._leader_tasks.stop()
        if self.audit_sink is not None and self.replication is not None:
            self.audit_sink.stopped()  # stopped wherever its task was (a restart's wait too): its gauge says so
        if self.replication is not None and isinstance(self.bus, FanOutBus):
            await self.bus.stop_ingress()  # another replica may be opening them already

    async def _tell(self, recovery: Recovery) -> None:
        self._untold.extend(recovery.messages())
        await self._tell_untold()

    async def _tell_untold(self) -> None:
        """Send the notices waiting, one at a time; one is dropped from the queue only once it was sent (a send
        cancelled half-way may be sent again by the stop: once more rather than never)."""
        async with self._telling:
            while self._untold:
                conversation, text = self._untold[0]
                try:
                    to = Address.parse(conversation)
                except AddressError:
                    # A swarm worker's call ("swarm"): no chat to tell; its task's own report says what became of
                    # it, and its cards. This raised and ended the start: Kazma did not come up again after being
                    # killed while a worker's approved call ran.
                    log.info("app.recovery_notice_unaddressed", conversation=conversation[:80])
                else:
                    await self.bus.send(to, Outgoing(text, agent=self.conversations.lead.name))
                self._untold.popleft()

    async def _tell_at_stop(self) -> None:
        """What the background notices had not sent yet (and the orphans cancelled so far, when the stop cut
        their cancelling short: the rest stay pending, and the next start cancels them and says so)."""
        orphans, self._orphans = self._orphans, None
        if orphans is not None:
            self._untold.extend(Recovery(orphans.cancelled, []).messages())
        if not self._untold:
            return
        try:
            await self._tell_untold()
        except Exception as exc:
            count_failure("recovery_notice")
            log.warning("app.recovery_notice_failed", error=str(exc), untold=len(self._untold))

    async def _withdraw_turns(self) -> None:
        """At a clean stop, while the store and the platforms are up (the swarm's tasks closed already): the
        turns' requests still pending end cancelled, their cards settle (the bus drains its edits as it stops)
        and each asker hears why. They ended only at the next start (the turns end with the event loop, after
        the store closed)."""
        try:
            ended = await self.service.withdraw_turns()
            if ended:
                await self._tell(Recovery(ended, []))
        except Exception as exc:  # what is left pending, the next start cancels and says
            count_failure("approval_stop_withdraw")
            log.warning("app.turns_unwithdrawn", error=str(exc))

    async def _stop_turns(self, grace: float) -> None:
        """The conversations' turns and the plans' backoff waits end before the store closes: a turn still running
        after ``turn_grace`` is cancelled (its tool's execution row then says "may have run"). They ran on until the
        event loop closed, writing to a closed store: what they did was lost without a word."""
        cut = await self.conversations.stop(grace=grace)
        if cut:
            count_failure("turn_cut_at_stop")
            log.warning("app.turns_cut", turns=cut, grace=grace)

    async def _follow_chat_moves(self) -> None:
        """Chats that moved before this start (kazma.yaml may still name the old id): serve the new one."""
        adapters: dict[str, object] = getattr(self.bus, "adapters", {})
        for move in await self.chat_moves.all():
            follow = getattr(adapters.get(move.platform), "follow_move", None)
            if follow is not None and follow(move.old, move.new) is not None:
                log.warning("chat.move_followed", platform=move.platform, old=move.old, new=move.new)

    async def _store_lost(self, reason: str) -> None:
        """Stop deciding, and say why wherever people are: a decision now would be written nowhere."""
        self.service.halt(reason)
        await self.bus.broadcast(
            f"Kazma has stopped deciding approvals: {reason}. Restart Kazma with its store in place.",
            agent=self.conversations.lead.name,
        )

    async def _sweep(self) -> None:
        """End requests whose waiter died with an earlier process (or, among replicas, with a replica that is
        gone), or whose polling asker stopped asking, so their cards settle too."""
        while True:
            await self.sweep_once()
            await asyncio.sleep(self.sweep_interval)

    async def sweep_once(self) -> None:
        """One pass of the approvals sweep, each part on its own: one that fails is counted and logged, and the
        others still run (a deadline that could not be ended held up, every pass, the withdrawals, the checkpoint
        cards and, among replicas, the recovery of what a gone replica left)."""
        parts: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("deadlines", self._expire_overdue),
            ("silent", self.service.withdraw_silent),  # polling askers gone quiet (a script killed mid-wait)
            ("checkpoints", self.swarm.sweep_checkpoints),  # a checkpoint card whose task is not paused at it
        ]
        if self.replication is not None:
            parts.append(("replicas", partial(self._judge_replicas, self.replication)))
        for part, run in parts:
            try:
                await run()
            except Exception as exc:  # the next pass tries again
                count_failure("approval_sweep")
                log.warning("approvals.sweep_failed", part=part, error=str(exc))

    async def _expire_overdue(self) -> None:
        for outcome in await self.service.expire_overdue():
            log.info("approvals.swept", request_id=outcome.request_id, status=outcome.status.value)

    async def _judge_replicas(self, replication: Replication) -> None:
        """What a replica that left ran ends now: at takeover, when one goes missing for good, after a failure."""
        live = await replication.settled_live()
        if live is None:
            return  # looked for too short a time: one missing now may only be reconnecting
        if self._recovery_due or self._live - live:
            self._tasks.spawn(self._say(*await self._recover_replicas(live)), name="kazma-recovery-notices")
            self._recovery_due = False  # done: only now (a failure above leaves it due for the next sweep)
        self._live = live

    async def _retention(self) -> None:
        """Swarm tasks older than ``swarm.retention_days`` go at start and then every sweep (0 keeps all), with
        what :meth:`prune_kept` prunes. A pass never ends the loop: each part that fails is counted and logged,
        and tried again at the next sweep."""
        while True:
            await self.swarm.sweep_retention()
            await self.prune_kept()
            await asyncio.sleep(self.loaded.config.swarm.retention_sweep_seconds)

    async def prune_kept(self) -> None:
        """What grew without end before: each agent's history past what a turn can ever read (always), the
        transcript past ``web.transcript_retention_days`` and ended plans past ``agents.plan_retention_days``
        (0 keeps them); inbound claims and signed requests older than a day (no platform delivers an event again
        after that, and Slack refuses a signature after five minutes), and the approvals API's idempotency keys a
        day past their request's deadline (bot/api_store.py). Each part on its own: one that fails is counted and
        logged, and the others still run."""
        config = self.loaded.config
        parts: list[tuple[str, Callable[[], Awaitable[int]]]] = [("history", self.conversations.runner.history.prune)]
        if self.transcript is not None and config.web.transcript_retention_days:
            parts.append(("transcript", partial(self.transcript.prune, config.web.transcript_retention_days)))
        if config.agents.plan_retention_days:
            parts.append(("plans", partial(self.executor.store.prune, config.agents.plan_retention_days)))
        if self.signed_requests is not None:  # the same table as the replicas' inbound claims
            parts.append(("inbound_claims", self.signed_requests.forget_older_than))
        if self.api_keys is not None:
            parts.append(("api_keys", self.api_keys.forget_expired))
        for part, prune in parts:
            try:
                pruned = await prune()
            except Exception as exc:  # kept until the next sweep: nothing is lost but space
                count_failure("retention")
                log.warning("retention.sweep_failed", part=part, error=str(exc))
            else:
                if pruned:
                    log.info("retention.pruned", part=part, rows=pruned)

    async def stop(self) -> None:
        if self.replication is not None:
            await self.replication.stop()  # the lease first: another replica takes the duties at once
        await self.follow("stopping")
        await self._tasks.stop()
        await self.swarm.close()
        if self.mcp is not None:
            await self.mcp.stop()
        await self._withdraw_turns()  # the platforms still up: the cards settle as the bus stops
        await self._tell_at_stop()
        await self._stop_turns(self.turn_grace)  # the platforms still up: a turn finishing in its grace says so
        await self.bus.stop()
        await self._stop_turns(0.0)  # any a message started meanwhile, before the platforms closed
        if self.executions is not None:  # a call still running says "may have run" before the store closes
            try:
                await self.executions.interrupt_open()
            except Exception as exc:  # the next start marks them lost instead
                count_failure("execution_record")
                log.warning("app.executions_unmarked", error=str(exc))
        if self.checkpointer is not None:  # what this run appended last, signed before the store closes
            try:
                await self.checkpointer.sign()
            except Exception as exc:
                count_failure("audit_checkpoint")
                log.warning("audit.checkpoint_at_stop_failed", error=str(exc))
        closer = getattr(self.provider, "aclose", None)
        if closer is not None:
            await closer()
        await self.stores.close()
        log.info("app.stopped")
