"""What a running Kazma offers its web server: the console's services (:mod:`kazma.bot.console.services`),
made from the parts the composition root built. The console sees only the protocol; this is the one place that
knows which store, service or engine part answers each of its calls."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from kazma.approvals.card import CardIntegrityError, integrity_card
from kazma.approvals.hashing import UnrenderableArguments
from kazma.approvals.rules import rule_states
from kazma.approvals.service import ApprovalService
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.console.auth import console_proves
from kazma.bot.console.services import ApprovalRecord, DashboardReads, InlineApproval, SwarmCommand
from kazma.config.address import platform_of
from kazma.config.models import KazmaConfig
from kazma.config.store.backend import StoreConnection
from kazma.engine.conversation import Conversations
from kazma.engine.swarm.service import SwarmService
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.transcript import Entry, Summary, TranscriptStore, Working

if TYPE_CHECKING:
    from kazma.adapters.bus import FanOutBus, NullBus, PlatformHealth
    from kazma.bot.replication import ReplicaHealth, Replication

DASHBOARD_TASKS = 50
DASHBOARD_APPROVALS = 20
DASHBOARD_DAYS = 7


class KazmaServices:
    """:class:`~kazma.bot.console.services.ConsoleServices` over a running Kazma's parts."""

    def __init__(
        self,
        *,
        config: KazmaConfig,
        store: StoreConnection,
        approvals: ApprovalService,
        api_keys: IdempotencyKeys,
        swarm: SwarmService,
        conversations: Conversations,
        transcript: TranscriptStore,
        replica: str,
        replication: Replication | None,
        bus: FanOutBus | NullBus,
    ) -> None:
        self.config = config
        self.store = store
        self.approvals = approvals
        self.api_keys = api_keys
        self.replica = replica
        self._swarm = swarm
        self._conversations = conversations
        self._transcript = transcript
        self._replication = replication
        self._bus = bus

    @property
    def replicated(self) -> bool:
        return self._replication is not None

    def watch(self, changed: Callable[[], None]) -> Callable[[], None]:
        def on_approval(_request_id: str) -> None:
            changed()

        def on_action(_action: object) -> None:
            changed()

        self.approvals.listeners.append(on_approval)
        self._swarm.listeners.append(changed)
        self._conversations.listeners.append(on_action)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self.approvals.listeners.remove(on_approval)
            with contextlib.suppress(ValueError):
                self._swarm.listeners.remove(changed)
            with contextlib.suppress(ValueError):
                self._conversations.listeners.remove(on_action)

        return stop

    def follow_transcript(self) -> AsyncIterator[Entry | Working]:
        return self._transcript.follow()

    async def conversations(self) -> list[Summary]:
        return await self._transcript.conversations()

    async def conversation(self, conversation: str) -> list[Entry]:
        return await self._transcript.messages(conversation)

    async def describe_plans(self, conversation: str) -> str:
        return await self._conversations.describe(conversation)

    async def approval_record(self, request_id: str) -> ApprovalRecord | None:
        store = self.approvals.store
        request = await store.get(request_id)
        if request is None:
            return None
        return ApprovalRecord(request, await store.events(request_id), await store.cards(request_id))

    async def conversation_approvals(self, conversation: str) -> list[InlineApproval]:
        shown = []
        for request in await self.approvals.store.requests_in(conversation):
            try:
                shown.append(InlineApproval(request, self.approvals.card(request)))
            except CardIntegrityError:  # changed outside Kazma: a card with none of it, and no Approve
                shown.append(InlineApproval(request, integrity_card(request, public_url=self.config.web.public_url),
                                            changed=True))  # fmt: skip
            except UnrenderableArguments:  # never carded: its page says why
                continue
        return shown

    async def dashboard_reads(self) -> DashboardReads:
        store = self._swarm.store
        tasks = self._swarm.as_ended(await store.list(limit=DASHBOARD_TASKS))  # an ending kept unstored, as it ended
        calls = await store.calls_of([t.id for t in tasks])
        counts = {status.value: count for status, count in (await self.task_counts()).items()}
        approvals = await self.approvals.store.requests(limit=DASHBOARD_APPROVALS)
        state = self._swarm.state
        days = await state.worker_days(DASHBOARD_DAYS) if state is not None else []
        found = await self.approvals.rules.list() if self.approvals.rules is not None else []
        # Each as the service would judge it for a call now: a row the configuration has ended (max_seconds
        # lowered, say) or whose seal does not hold is not shown as one in force.
        states = await rule_states(
            self.approvals.store, found, config=self.config, keyring=self.approvals.store.keyring, now=time.time()
        )
        rules = list(zip(found, states, strict=True))
        return DashboardReads(tasks, calls, counts, approvals, self._swarm.worker_lines(), days, rules)

    async def task_counts(self) -> dict[TaskStatus, int]:
        return {status: await self._swarm.store.count(status) for status in TaskStatus}

    async def run_swarm(self, command: SwarmCommand) -> str | None:
        commands = self._conversations.swarm
        if commands is None:
            return None
        return await commands.run(
            command.text,
            actor=command.actor,
            platform=command.platform,
            chat=command.chat,
            is_admin=command.is_admin,
        )

    async def replica_health(self) -> ReplicaHealth | None:
        return None if self._replication is None else await self._replication.health()

    def platform_health(self, replica: ReplicaHealth | None = None) -> list[PlatformHealth]:
        if replica is None:
            return self._bus.health()
        return self._bus.health(replica.leader_inbound, leads=replica.holds_lease)

    @property
    def console_decides(self) -> bool:
        roster = self.config.roster
        # A Slack, Discord or Telegram approver signed in there decides on the console as that identity: counted
        # only as web: identities, a Kazma whose approvers all sign in with Slack answered 503 while they could.
        proves = console_proves(self.config)
        return any(
            platform_of(identity) in proves
            for name in self.config.policy_names
            if (policy := self.config.policy(name)) is not None
            for identity in roster.deciders(policy.approvers)
        )
