"""What the web server needs from the rest of Kazma, declared where it is used: the console never imports ``App``.

The composition root builds one object that offers all of it
(:class:`kazma.bot.services.KazmaServices`) and hands it to the web server.
The approvals API and ``/mcp`` need only :class:`ApprovalsServices`; the
console's pages, forms, live events and machine endpoints need
:class:`ConsoleServices`. Decisions go through the approval service itself (the
same compare-and-set every platform's buttons use); everything else the console
reads or runs is a method here, so a change behind one (a store, the swarm, the
transcript) is one change in the composition root, not a hunt through the
console. A call with many inputs takes one dataclass (:class:`SwarmCommand`): a
new field changes that class, not every signature on the way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import ApprovalRequest
from kazma.approvals.rules import Rule, RuleState
from kazma.approvals.service import ApprovalService
from kazma.approvals.store import AuditEvent, PostedCard
from kazma.bot.api_store import IdempotencyKeys
from kazma.config.models import KazmaConfig
from kazma.config.store.backend import StoreConnection
from kazma.engine.swarm.call_records import CallRecord
from kazma.engine.swarm.state_store import WorkerDay
from kazma.engine.swarm.store import TaskRecord
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.transcript import Entry, Summary, Working

if TYPE_CHECKING:  # the replicas' machinery (psycopg) is imported only where replicas run
    from kazma.adapters.bus import PlatformHealth
    from kazma.bot.replication import ReplicaHealth


@dataclass(frozen=True)
class InlineApproval:
    """An approval asked in a conversation, for that conversation's page: its card as the console shows it."""

    request: ApprovalRequest
    card: ApprovalCard
    changed: bool = False  # the stored call no longer matches its hash: an integrity card, never Approve


@dataclass(frozen=True)
class SwarmCommand:
    """One ``/swarm`` command from a console person (the words after ``/swarm``)."""

    text: str
    actor: str  # "web:<login>"
    platform: str
    chat: str
    is_admin: bool  # operators count as a chat's admins


@dataclass(frozen=True)
class ApprovalRecord:
    """One approval request with its audit trail and the cards that show it (the approval page)."""

    request: ApprovalRequest
    events: Sequence[AuditEvent]
    cards: Sequence[PostedCard]


@dataclass(frozen=True)
class DashboardReads:
    """What the swarm dashboard shows from the stores, read in one go (its charts read the store themselves)."""

    tasks: Sequence[TaskRecord]
    calls: Mapping[str, Sequence[CallRecord]]  # each task's worker calls, in order
    counts: dict[str, int]  # tasks by status
    approvals: Sequence[ApprovalRequest]
    worker_lines: Sequence[str]
    worker_days: Sequence[WorkerDay]
    rules: Sequence[tuple[Rule, RuleState]]  # remembered approvals whose rows are in force, each as it stands


class ApprovalsServices(Protocol):
    """What the approvals API (``/api/v1``) and ``/mcp`` use."""

    @property
    def config(self) -> KazmaConfig: ...

    @property
    def approvals(self) -> ApprovalService:
        """The one approval service: opening, waiting, deciding, withdrawing, reading requests."""
        ...

    @property
    def api_keys(self) -> IdempotencyKeys: ...

    @property
    def replicated(self) -> bool:
        """Whether several replicas share the store (a stop here is one replica's, not Kazma's)."""
        ...


class ConsoleServices(ApprovalsServices, Protocol):
    """What the web console uses, beyond the approvals API's part."""

    @property
    def store(self) -> StoreConnection:
        """The store the console's own tables live in (sessions, the dashboard's chart queries)."""
        ...

    @property
    def replica(self) -> str:
        """This replica's name ("local" for one process on SQLite)."""
        ...

    def watch(self, changed: Callable[[], None]) -> Callable[[], None]:
        """Call ``changed`` whenever an approval, a swarm task or a plan changes here; returns the way to stop."""
        ...

    def follow_transcript(self) -> AsyncIterator[Entry | Working]:
        """Every message kept from now on, in any conversation, and the signs that an agent is working."""
        ...

    async def conversations(self) -> list[Summary]: ...

    async def conversation(self, conversation: str) -> list[Entry]:
        """The messages of one conversation (none: no such conversation)."""
        ...

    async def describe_plans(self, conversation: str) -> str:
        """What ``/plan`` answers in ``conversation``."""
        ...

    async def approval_record(self, request_id: str) -> ApprovalRecord | None: ...

    async def conversation_approvals(self, conversation: str) -> list[InlineApproval]:
        """The approvals asked in one conversation, each with its card, oldest first."""
        ...

    async def dashboard_reads(self) -> DashboardReads: ...

    async def task_counts(self) -> dict[TaskStatus, int]: ...

    async def run_swarm(self, command: SwarmCommand) -> str | None:
        """The answer to a ``/swarm`` command; None when this process runs without the swarm engine."""
        ...

    async def replica_health(self) -> ReplicaHealth | None:
        """Who leads and whether the store answers, among replicas; None for one process on SQLite."""
        ...

    def platform_health(self, replica: ReplicaHealth | None = None) -> Sequence[PlatformHealth]:
        """Each configured chat platform's state (none configured: empty); on a follower, ``replica`` carries
        what the leader recorded of the inbound connections only it holds."""
        ...

    @property
    def console_decides(self) -> bool:
        """Whether somebody may decide on the console (an approver with an identity it can prove: ``web:``, or a
        platform's whose sign-in it offers, see :func:`~kazma.bot.console.auth.console_proves`): a way to decide
        that no chat platform's inbound state takes away."""
        ...
