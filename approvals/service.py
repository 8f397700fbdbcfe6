"""Approval requests end to end: open, show, decide once, wait, settle.

The service owns the rules; :class:`ApprovalStore` owns the rows. Platform
adapters never decide anything themselves: they forward a press here with
:meth:`ApprovalService.decide_from_button` and show what it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol, cast, runtime_checkable

import structlog

from kazma.approvals.approval_checks import approval_problem, decided_on_record
from kazma.approvals.card import (
    BUTTON_PREFIX,
    TOOL_DEFINITION,
    ApprovalCard,
    CardIntegrityError,
    build_card,
    check_names,
    verify_integrity,
)
from kazma.approvals.chain import AuditChain, undecodable
from kazma.approvals.hashing import args_hash, canonical_json, check_arguments
from kazma.approvals.model import (
    ApprovalRequest,
    Decision,
    Outcome,
    PressResult,
    PressVerdict,
    Review,
    Status,
    Waits,
    clean_reason,
    decider_text,
)
from kazma.approvals.progress import Progress, approval_counts, progress_line, progress_of
from kazma.approvals.rules import Rule, RuleStore, in_a_chat, rule_standing, rules_consulted_for
from kazma.approvals.seal import FORGED, SealProblem
from kazma.approvals.store import (
    ApprovalStore,
    CardCheck,
    CardProblem,
    Clock,
    Decided,
    FirstUse,
    FoundCard,
    NewRequest,
    PostedCard,
    ReviewState,
    Rules,
    Standing,
    UnreadableRequest,
    new_request_id,
)
from kazma.approvals.waiters import Waiters
from kazma.approvals.withdrawal import POLL_GRACE, SEEN_EVERY, Gone, is_withdrawn, withdrawn
from kazma.config import failpoints
from kazma.config.address import Address, AddressError
from kazma.config.backoff import Backoff
from kazma.config.log_gate import LevelGate
from kazma.config.metrics import (
    APPROVALS_OPENED,
    PRESS_TO_DECISION,
    count_decided,
    count_failure,
    count_reviewed,
)
from kazma.config.models import DEFAULT_POLICY, KazmaConfig, PolicyConfig
from kazma.config.outgoing import Outgoing
from kazma.config.people import person_key, requester_key
from kazma.config.store.backend import Tx
from kazma.config.store.errors import simulated_failure, store_errors
from kazma.config.waits import until_set

log = structlog.get_logger("kazma.approvals")
_INFO = LevelGate("kazma.approvals", logging.INFO)  # asked before an info line on the press path builds anything

_BUTTON = re.compile(r"^(?P<version>kz\d+):(?P<id>[A-Za-z0-9_-]{16,64}):(?P<code>[a-z])$")
_CODES = {"a": Decision.APPROVE, "d": Decision.DENY, "r": Decision.APPROVE, "n": Decision.DENY}
REMEMBER_CODE = "r"  # approve, and remember the identical call in its conversation (approvals.remember)
REASON_CODE = "n"  # deny, with a reason the platform asks for first (a modal, a reply); pressed bare: a plain Deny
STORE_SITE = "approval_resolve"
# What a press on a request whose record cannot be read is told (its row, or one of its cards, changed outside Kazma).
UNREADABLE_ANSWER = (
    "This request cannot be decided: its record in the approvals store cannot be read (it was changed outside "
    "Kazma). Nothing it asks for will run; tell an operator (kazma doctor names it)."
)
# A waiter whose first read of its request failed reads again this soon (then ever later, up to 5 s).
WAIT_READ_RETRY = Backoff(base=0.1, cap=5.0)
# How long an approved call waits, from the start of its verification, for its start to be recorded
# (``execution_started``) through store failures, tried again after WAIT_READ_RETRY's pauses; then it does not run
# (see ApprovalService.verify_execution). A bound, lock or no lock, on either store: an attempt still waiting for
# another process's lock then is given up, never to commit, and so is a read waiting for this process's writes.
START_RECORD_WITHIN = 10.0
# How long past that the refusal's own record (``execution_refused``) may wait before the call is told: on the
# record if the store takes it by then; otherwise a recovery reports the call as never run, which is true.
REFUSAL_RECORD_WITHIN = 1.0
_NO_PUBLISHER = object()  # no publisher was checked yet (None is a publisher's value: none)
_CONFIG_READS_KEPT = 4096  # persons and admissions a service keeps of its configuration at most (then starts again)
_RECENT_KEPT = 10_000  # requests ended here, and asked after, a service remembers (the oldest go first)
_RECORD_GRACE = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8)  # seconds, about 1.6 in all


class CardPublisher(Protocol):
    """What the approvals need from a bus: show cards, and settle them once a request ends."""

    def can_show_cards(self, policy: str | None = None) -> bool:
        """Some platform that is connected can show a card of a request under ``policy`` (None: the default)."""
        ...

    async def publish(self, card: ApprovalCard) -> None:
        """Show ``card`` on every platform. Failures to post are the bus's to retry; it raises only
        :class:`CardsNotQueued`, when the posts could not even be queued (the request is withdrawn then)."""
        ...

    async def settle(self, request_id: str) -> None:
        """A request of ours reached an outcome: edit its cards. Must not raise."""
        ...


@runtime_checkable
class SettlesDecided(Protocol):
    """A publisher that settles a request from the request and its cards as its decision committed them."""

    async def settle_decided(self, request: ApprovalRequest, cards: list[PostedCard]) -> None:
        """:meth:`CardPublisher.settle` without reading the request or its cards again. Must not raise."""
        ...


@runtime_checkable
class QueuesCards(Protocol):
    """A publisher whose card posts can be queued in the very transaction that opens the request, so no
    request is ever pending without them (a crash between two commits left exactly that)."""

    async def queue_statements(self, request_id: str, policy: str | None = None) -> Callable[[Tx], object] | None:
        """The statements that queue ``request_id``'s posts, or None when they cannot share that transaction
        (the publisher then gets :meth:`CardPublisher.publish` after it)."""
        ...

    def cards_queued(self, request_id: str, policy: str | None = None) -> None:
        """The transaction holding those statements committed: post the cards now."""
        ...


@runtime_checkable
class ShowsProgress(Protocol):
    """A publisher whose cards can show each review of a policy of several people as it is counted."""

    async def refresh(self, request_id: str) -> None:
        """A review of ``request_id`` was counted: edit its cards to show the progress. Must not raise."""
        ...


class OpenGate(Protocol):
    """What a door adds to the transaction that opens a request (the approvals API: its idempotency key, its
    token's quota and its audit rows), so they stand or fall with the request."""

    def admit(self, tx: Tx, request_id: str) -> str | None:
        """First: None lets ``request_id`` open; another request's id stands instead, and nothing is opened.
        Raising refuses (the whole transaction is undone and the exception reaches the caller)."""
        ...

    def opened(self, tx: Tx, request_id: str, audit: AuditChain) -> None:
        """After the request's rows: the door's own rows of it (its audit events through ``audit``)."""
        ...


# Orphans a recovery cancels together (one group commit a batch), as kazma.approvals.orphans.BATCH at a start.
RECOVER_BATCH: Final = 200


class CardLocation(NamedTuple):
    """Where a pressed card is, as far as the platform says (None: it does not say). (A named tuple, as
    :class:`ParsedButton`: made on every press, a frozen dataclass cost several times as much.)"""

    chat: str | None
    message_id: str | None


class RefusalWindow:
    """At most one audited refusal per actor per window: presses refused over and over cannot fill the store."""

    def __init__(self, *, window: float = 60.0, clock: Clock = time.time, limit: int = 10_000) -> None:
        self.window = window
        self.clock = clock
        self.limit = limit
        self._last: dict[str, float] = {}

    def first_in_window(self, actor: str) -> bool:
        now = self.clock()
        last = self._last.get(actor)
        if last is not None and now - last < self.window:
            return False
        if len(self._last) >= self.limit:  # bounded memory: forget the stalest half
            for stale in sorted(self._last, key=self._last.__getitem__)[: self.limit // 2]:
                del self._last[stale]
        self._last[actor] = now
        return True


RESTARTED = "Kazma restarted before a decision; nothing ran"
# A turn's request still pending when Kazma stops cleanly ends with this, at the stop (withdraw_turns).
STOPPED = "Kazma stopped before a decision; nothing ran"
# What an approved call's cards and audit say when Kazma stopped after the decision (execution_lost's detail).
STOPPED_BEFORE_IT_RAN = "approved, but Kazma stopped before it ran: it did not run and will not run on its own"
MAY_HAVE_RUN = "it may have run (started, not finished)"
STOPPED_WHILE_IT_RAN = f"approved, but Kazma stopped while it ran: {MAY_HAVE_RUN}; it will not run again on its own"

# (request ids) -> each one's execution outcomes in the execution record ("ok", "failed", "lost", "interrupted",
# None while running); a request with no row never started its call.
ExecutionLookup = Callable[[Sequence[str]], Awaitable[Mapping[str, list[str | None]]]]
REPLICA_GONE = "the Kazma replica waiting for it stopped before a decision; nothing ran"


@dataclass(frozen=True)
class Recovery:
    """What start-up found: requests it cancelled as orphans, approved calls that never ran."""

    cancelled: list[ApprovalRequest]
    never_ran: list[ApprovalRequest]
    # Of ``never_ran``, those whose approval could never have run anyway (no seal, or one that does not
    # verify), by request id: why.
    unrunnable: dict[str, str] = field(default_factory=dict)
    # Approved calls whose execution record shows a start and no end: they may have run, and never run again
    # by themselves.
    may_have_run: list[ApprovalRequest] = field(default_factory=list)

    def messages(self) -> list[tuple[str, str]]:
        """(conversation, what to tell it), one per request. A withdrawn request's asker waited on a connection
        that is gone, not in a chat: there is nobody to tell (its cards say it)."""
        told = [
            (r.conversation, f"The approval request for {r.tool} ({r.id}) was cancelled: {r.reason or RESTARTED}.")
            for r in self.cancelled
            if r.waits is None
        ]
        for r in self.never_ran:
            why = self.unrunnable.get(r.id)
            if why is None:
                line = (
                    f"{r.tool} ({r.id}) was approved by {r.decided_by}, but Kazma stopped before it ran; "
                    "it did not run and will not run on its own. Ask again if it is still wanted."
                )
            else:
                line = (
                    f"{r.tool} ({r.id}) is marked approved by {r.decided_by}, but {why}: it did not run and "
                    "cannot run. Ask again if it is still wanted."
                )
            told.append((r.conversation, line))
        for r in self.may_have_run:
            told.append((r.conversation, (
                f"{r.tool} ({r.id}) was approved by {r.decided_by} and started, but Kazma stopped before it "
                f"finished: {MAY_HAVE_RUN}. It will not run again on its own; check before asking again."
            )))  # fmt: skip
        return told


class OrphanGate(Protocol):
    """Pending requests a dead process left, not yet cancelled (:class:`kazma.approvals.orphans.Orphans`)."""

    def __contains__(self, request_id: object) -> bool: ...

    async def ended(self, request_id: str) -> bool:
        """End ``request_id`` now if it is still pending; False when the store could not say it ended."""


class ApprovalRefused(Exception):
    """The call cannot be put to a human (unrenderable arguments, or no card could be queued); it must not run."""


class CardsNotQueued(Exception):
    """A publisher could not queue a request's card posts (its store refused them, after retries): no person
    would ever see the request, so it must not stay pending until its deadline."""


class ExecutionMismatch(Exception):
    """The arguments about to run are not the ones that were approved."""


class ParsedButton(NamedTuple):
    request_id: str
    decision: Decision
    remember: bool = False


class ButtonError(ValueError):
    pass


# Buttons parsed lately, by their data: a request's presses on several platforms carry the same text, and a button
# is pressed again and again; only what parsed is kept (a parsed button is immutable). Emptied when full.
_PARSED: dict[str, ParsedButton] = {}
_PARSED_KEPT = 4096


def parse_button(data: str) -> ParsedButton:
    """Validate ``kz1:<id>:a|d`` strictly; anything else is refused with the reason."""
    known = _PARSED.get(data) if type(data) is str else None
    if known is not None:
        return known
    parsed = _parse_button(data)
    if len(_PARSED) >= _PARSED_KEPT:
        _PARSED.clear()
    _PARSED[data] = parsed
    return parsed


def _parse_button(data: str) -> ParsedButton:
    if not isinstance(data, str) or len(data) > 100:
        raise ButtonError("garbled button data")
    match = _BUTTON.fullmatch(data)
    if match is None:
        raise ButtonError("garbled button data")
    version, request_id, code = match.groups()
    if version != BUTTON_PREFIX:
        raise ButtonError(f"unsupported button version {version!r}")
    decision = _CODES.get(code)
    if decision is None:
        raise ButtonError(f"unknown decision code {code!r}")
    return ParsedButton(request_id, decision, code == REMEMBER_CODE)


def remember_offer(config: KazmaConfig, request: ApprovalRequest) -> int | None:
    """How long "Approve for …" would remember ``request``'s call, or None where the button is not offered: the
    team did not enable it, or no later call of this requester ever consults a rule (a request from the
    approvals API or ``/mcp``, or a call in no chat: the button would promise something that never happens)."""
    remember = config.approvals.remember
    consulted = rules_consulted_for(request.requested_by, request.conversation)
    if not remember.enabled or not consulted or not request.rememberable:
        return None  # (a policy of several people or a passkey is never remembered)
    return remember.max_seconds


def _integrity_problem(request: ApprovalRequest) -> str | None:
    """Why ``request``'s stored call no longer hashes to its hash, or None. The stored call is what the approval
    page and ``kazma approvals show`` put before a person: changed, they may have approved other text."""
    try:
        verify_integrity(request)
    except CardIntegrityError as exc:
        return exc.reason
    return None


class _Admit:
    """A press's admission (what :meth:`ApprovalStore.press` holds it to, in its transaction), kept per configuration
    when it admits. An object, not a closure in ``decide``: a closure made every variable it reads a cell there,
    about ten objects per press for the garbage collector to count and, with many presses in flight, to trace."""

    __slots__ = ("actor", "decision", "person", "platform", "request_id", "service", "stepped_up")

    def __init__(
        self,
        service: ApprovalService,
        request_id: str,
        decision: Decision,
        actor: str,
        platform: str,
        person: str | None,
        stepped_up: bool,
    ) -> None:
        self.service, self.request_id, self.decision = service, request_id, decision
        self.actor, self.platform, self.person, self.stepped_up = actor, platform, person, stepped_up

    def __call__(self, rules: Rules | None) -> tuple[str, str] | None:
        key = (rules, self.decision, self.actor, self.platform, self.person, self.stepped_up)
        service = self.service
        admitted = service._admitted
        if key in admitted:
            return None
        refused = service._admission(
            self.request_id, rules, self.decision, self.actor, self.platform, self.person, stepped_up=self.stepped_up
        )
        if refused is None and rules is not None:
            if len(admitted) >= _CONFIG_READS_KEPT:
                admitted.clear()
            admitted.add(key)
        return refused


class ApprovalService:
    def __init__(
        self,
        store: ApprovalStore,
        config: KazmaConfig,
        *,
        publisher: CardPublisher | None = None,
        clock: Clock = time.time,
        poll_interval: float = 0.5,
        rules: RuleStore | None = None,
    ) -> None:
        self.rules = rules  # remembered approvals (approvals.remember); None: never offered
        # The execution record, as recovery reads it (set by the composition root; None: not recorded here).
        self.executions_of: ExecutionLookup | None = None
        self.store = store
        self.config = config
        store.person_of = self._person_now  # reviews weighed by whose each identity is under this configuration
        store.approval_counts = self._approval_counts  # and approvals by whether they would count if made now
        self.publisher = publisher
        self.clock = clock
        self._waiters = Waiters(
            store.ended_among, poll_interval, clock, store.commits_seen, lambda request_id: self.store.get(request_id)
        )
        # Requests this process ended (and told the bus), newest last; and, by request id, when this process last
        # wrote its asker's last_seen. Ordered dictionaries: each is trimmed from its oldest end, and a plain dict
        # finds its first live entry by stepping over every one deleted before it (about 3 microseconds a press
        # once 10,000 requests had ended).
        self._ended_here: OrderedDict[str, None] = OrderedDict()
        self._refusals = RefusalWindow(clock=clock)
        self._looked: OrderedDict[str, float] = OrderedDict()
        self.halted: str | None = None  # why no decision is taken right now (the store vanished), or None
        # Orphans a start found and has yet to cancel (:mod:`kazma.approvals.orphans`): a press on one ends it
        # first. None: nothing is fenced.
        self.orphans: OrphanGate | None = None
        # request id -> why: opened, then its opening failed and so did its cancel; nobody waits for it here
        self._unwaited: dict[str, str] = {}
        # Withdrawals under way: their askers' handlers may be cancelled mid-way (a web server shutting down
        # cancels what runs past its timeout), so each runs on its own and the stop waits for them.
        self._withdrawals: set[asyncio.Future[tuple[bool, Outcome | None]]] = set()
        self._turns: dict[str, None] = {}  # requests a waiter here ends with itself (cancel_with_waiter)
        self.stopping = False  # a clean stop began: nothing new is put to anyone
        # told the request id whenever a request opens or ends, or a remembered approval is revoked (the live
        # dashboard); a listener must be quick and must not raise (one that does is logged and skipped)
        self.listeners: list[Callable[[str], None]] = []
        # What a press asks of the configuration, kept while ``config`` is the object they were read from (a new
        # configuration empties them): each press's person, and which presses its admission let through (only
        # those: a refusal's words name the request). The configuration and a request's rules never change
        # under them, and an admission reads nothing else.
        self._config_seen: KazmaConfig | None = None
        self._persons: dict[str, str | None] = {}
        self._admitted: set[tuple[Rules | None, Decision, str, str, str | None, bool]] = set()
        # Which optional protocols the publisher speaks, asked once per publisher object (see _publisher_is).
        self._checked_publisher: object = _NO_PUBLISHER
        self._publisher_kinds: dict[type, bool] = {}

    @property
    def poll_interval(self) -> float:
        """How often the waiters' safety sweep looks for what ended unheard (one look for all of them)."""
        return self._waiters.every

    @poll_interval.setter
    def poll_interval(self, seconds: float) -> None:
        self._waiters.every = seconds

    def _publisher_is(self, protocol: type) -> bool:
        """``isinstance(self.publisher, protocol)`` for a runtime-checkable protocol, asked once per publisher: the
        check walks the protocol's members by ``getattr`` (~12 µs), and every decision and every opening asks."""
        publisher = self.publisher
        if publisher is not self._checked_publisher:
            self._checked_publisher = publisher
            self._publisher_kinds.clear()
        known = self._publisher_kinds.get(protocol)
        if known is None:
            known = self._publisher_kinds[protocol] = isinstance(publisher, protocol)
        return known

    def _tell(self, request_id: str) -> None:
        for listener in list(self.listeners):
            try:
                listener(request_id)
            except Exception as exc:  # a watcher's fault must never stop a decision
                log.warning("approvals.listener_failed", request_id=request_id, error=str(exc))

    def halt(self, reason: str) -> None:
        """Stop deciding: every press and decision is refused with ``reason`` until the process restarts."""
        if self.halted is None:
            self.halted = reason
            log.error("approvals.halted", reason=reason)

    # -- opening ---------------------------------------------------------------------------------

    async def open(
        self,
        tool: str,
        args: Mapping[str, Any],
        requested_by: str,
        conversation: str,
        deadline: float | None = None,
        task_id: str | None = None,
        *,
        notes: tuple[str, ...] = (),
        durable: bool = False,
        waits: Waits | None = None,
        seen: bool = False,
        policy: str | None = None,
        started_by: str | None = None,
        definition_hash: str | None = None,
    ) -> ApprovalRequest:
        """Record a new request and put its card on every platform.

        ``notes`` say how the call would run (shown on every card); ``durable``
        marks a request whose waiter survives a restart (a paused pipeline's
        checkpoint), so start-up never cancels it as an orphan. ``waits``: how
        a synchronous asker at one of the doors waits; the request is withdrawn
        when it goes away. ``seen``: the asker is an API caller, seen asking now.

        ``deadline`` is in seconds from now (default ``approvals.deadline_seconds``).
        ``policy`` names the approvals policy it is decided under (None: the tool's own, else the default);
        ``started_by`` is who started the work (a person or an identity), whom ``forbid_requester`` refuses.
        ``definition_hash``: the digest of the tool's definition as the card shows it (None: a tool fixed in
        Kazma's code); a remembered approval made from the request stands only for that definition.

        Raises :class:`ApprovalRefused` when the arguments cannot be shown faithfully.
        """
        request, _ = await self.open_once(
            tool, args, requested_by, conversation, deadline, task_id, notes=notes, durable=durable, waits=waits,
            seen=seen, policy=policy, started_by=started_by, definition_hash=definition_hash,
        )  # fmt: skip
        return request

    async def open_once(
        self,
        tool: str,
        args: Mapping[str, Any],
        requested_by: str,
        conversation: str,
        deadline: float | None = None,
        task_id: str | None = None,
        *,
        notes: tuple[str, ...] = (),
        durable: bool = False,
        waits: Waits | None = None,
        seen: bool = False,
        gate: OpenGate | None = None,
        policy: str | None = None,
        started_by: str | None = None,
        definition_hash: str | None = None,
    ) -> tuple[ApprovalRequest, bool]:
        """:meth:`open`, with a door's ``gate`` in the opening transaction: the request and whether this call
        opened it (False: the gate named the request that stands instead, and nothing was opened).

        The request's row, its audit row, its card posts (when the publisher can queue them there) and the
        gate's rows are one commit: whoever commits first opens, and a crash leaves all of them or none.
        """
        try:
            check_arguments(args)
            check_names(dict(args))
        except ValueError as exc:
            log.warning("approvals.refused_unrenderable", tool=tool, requested_by=requested_by, reason=str(exc))
            raise ApprovalRefused(
                f"the call to {tool!r} cannot be shown faithfully, so it will not run: {exc}"
            ) from None
        if self.stopping:
            raise ApprovalRefused(f"Kazma is stopping, so the call to {tool!r} was not put to anyone. Nothing ran.")
        seconds = self.config.approvals.deadline_seconds if deadline is None else deadline
        if seconds <= 0:
            raise ValueError(f"deadline must be positive, got {seconds}")
        name = policy or self.config.policy_name_for(tool)
        chosen = self.config.policy(name)
        if chosen is None:
            raise ApprovalRefused(
                f"unknown approvals policy {name!r} (approvals.policies: "
                f"{', '.join(self.config.approvals.policies) or 'none configured'}), so the call will not run"
            )
        if definition_hash is not None:
            notes = (*notes, f"{TOOL_DEFINITION}{definition_hash[:16]}…")
        new = NewRequest(
            new_request_id(),
            tool,
            canonical_json(dict(args)),
            args_hash(args),
            requested_by,
            conversation,
            self.clock() + seconds,
            task_id,
            Rules(name, chosen.approve, chosen.deny, chosen.step_up, started_by),
        )
        queuer = cast(QueuesCards, self.publisher) if self._publisher_is(QueuesCards) else None
        queue = None if queuer is None else await queuer.queue_statements(new.id, name)
        also: list[Callable[[Tx], object]] = (
            [] if gate is None else [lambda tx: gate.opened(tx, new.id, self.store.chain)]
        )
        if queue is not None:
            also.append(queue)
        if failpoints.armed:  # nothing written yet: the asker is told the store's own error
            await failpoints.reached("approvals.open.row", lambda: simulated_failure(self.store.tables, "open"))
        request, opened = await self.store.insert_once(
            new,
            notes=notes,
            durable=durable,
            waits=waits,
            seen=seen,
            guard=None if gate is None else gate.admit,
            also=also,
            definition_hash=definition_hash,
        )
        if not opened:
            return request, False
        log.info(
            "approvals.opened", request_id=request.id, tool=tool, requested_by=requested_by, hash=request.args_hash
        )
        APPROVALS_OPENED.labels(tool=self._tool_label(tool, requested_by)).inc()
        try:
            if failpoints.armed:  # committed (row, audit, card posts), no card posted yet
                await failpoints.reached(
                    "approvals.open.committed", lambda: simulated_failure(self.store.tables, "open")
                )
            self._tell(request.id)
            if queuer is not None and queue is not None:
                queuer.cards_queued(request.id, name)
            elif self.publisher is not None:
                await self.publisher.publish(self.card(request))
        except CardsNotQueued as exc:
            # Two writes (the outbox is not in the request's transaction) and the second failed: nobody
            # would see this request until its deadline. It ends now, and the asker hears why.
            await self._cancel_now(request.id, f"its card could not be queued on any platform ({exc})")
            count_failure("card_enqueue")
            log.error("approvals.open_unqueued", request_id=request.id, tool=tool, error=str(exc))
            raise ApprovalRefused(
                f"the call to {tool!r} was not put to anyone: its approval card could not be queued ({exc}). "
                "Nothing ran; ask again."
            ) from None
        except Exception as exc:
            # Committed, and then this call fails: its asker never waits for the request. Left standing, its
            # cards would take a press ("Approved") that nothing acts on; it ends now, and the asker hears why.
            raise await self._unopened(request.id, tool, exc) from None
        return request, True

    async def _unopened(self, request_id: str, tool: str, exc: Exception) -> ApprovalRefused:
        """End a request whose opening failed after its commit (its asker will not wait for it): the refusal to
        raise, saying whether it could be cancelled."""
        count_failure("approval_open_unfinished")
        log.error("approvals.open_unfinished", request_id=request_id, tool=tool, error=str(exc))
        told = f"the call to {tool!r} was not put to anyone: opening its approval failed after it was written ({exc})"
        reason = f"opening it failed after it was written; nothing ran ({exc})"
        try:
            await self._cancel_now(request_id, reason)
        except store_errors() as failed:
            # Still pending, its cards live, nobody waiting: a press here cancels it (tried again) instead of
            # approving a call nothing would run, a clean stop cancels it, and the next start reports it.
            self._unwaited[request_id] = reason
            while len(self._unwaited) > 10_000:  # bounded: the next start ends the rest as orphans
                del self._unwaited[next(iter(self._unwaited))]
            count_failure("approval_open_uncancelled")
            log.error("approvals.open_uncancelled", request_id=request_id, tool=tool, error=str(failed))
            return ApprovalRefused(
                f"{told}, and it could not be cancelled yet ({failed}): nobody waits for it, so a press on its "
                "card cancels it instead of approving, and Kazma's next start cancels it. Nothing ran; ask again."
            )
        return ApprovalRefused(f"{told}; it was cancelled, so no press can approve it. Nothing ran; ask again.")

    async def _press_unwaited(self, request_id: str, actor: str, platform: str) -> PressResult:
        """A press on a request whose opening failed after its commit and whose cancel failed too: nobody waits
        for it, so the press ends it ``cancelled`` (the cancel tried again) and approves nothing."""
        reason = self._unwaited[request_id]
        try:
            won, outcome = await self._cancel_now(request_id, reason)
        except store_errors() as exc:
            count_failure("approval_open_uncancelled")
            log.warning("approvals.unwaited_uncancelled", request_id=request_id, actor=actor, error=str(exc))
            return PressResult(
                PressVerdict.REFUSED,
                "Nobody waits for this request (opening it failed after it was written), and it could not be "
                "cancelled yet; nothing was recorded, and nothing runs.",
                request_id=request_id,
            )
        del self._unwaited[request_id]
        await self._refused(request_id, actor, platform, "nobody waits for it: opening it failed after it was written")
        ended = "was cancelled" if won or outcome is None else f"had ended {outcome.status.value}"
        return PressResult(
            PressVerdict.REFUSED,
            f"This request {ended}: {reason}. Your press was not recorded.",
            outcome=outcome,
            request_id=request_id,
        )

    def _tool_label(self, tool: str, requested_by: str) -> str:
        """The metrics label of ``tool``: its name when the tools an agent may call or ``tools:`` bound it, or
        "other" for a name a caller of a door made up (every name would be a series on ``/metrics``)."""
        if requested_by.startswith(("agent:", "swarm:")) or tool in self.config.tools.levels:
            return tool
        return "other"

    def link(self, request_id: str) -> str:
        """The request's approval page, where the whole call is shown and can be decided."""
        return f"{self.config.web.public_url.rstrip('/')}/swarm?approval={request_id}"

    def card(self, request: ApprovalRequest, reviews: Sequence[Review] = ()) -> ApprovalCard:
        """``request``'s card; ``reviews``: those on record, for its progress line (a policy of several people)."""
        return build_card(
            request,
            value_limit=self.config.approvals.value_limit,
            public_url=self.config.web.public_url,
            remember_seconds=remember_offer(self.config, request) if self.rules is not None else None,
            progress=progress_line(self.config, request, reviews),
        )

    async def revoke_rule(self, rule_id: str, *, actor: str, platform: str) -> Rule | None:
        """End a remembered approval now (the next identical call gets a card again); audited. None: not in force."""
        if self.rules is None:
            return None
        found = await self.rules.in_force(rule_id)
        if found is None:
            return None
        person = self.config.roster.person_of(actor)
        if not await self.rules.revoke_recorded(self.store, found, actor=actor, platform=platform, person=person):
            return None
        log.info("approvals.rule_revoked", rule=rule_id, actor=actor, platform=platform)
        self._tell(found.request_id)
        return found

    async def remembered(
        self,
        tool: str,
        args: Mapping[str, Any],
        conversation: str,
        *,
        started_by: str | None = None,
        defined_since: float | None = None,
        definition_hash: str | None = None,
    ) -> Rule | None:
        """The standing rule that lets exactly this call run here without a card (audited and said), or None.

        ``started_by``: whose message started the work. Under a policy with ``forbid_requester`` a rule its
        maker made never lets their own work run: they could not approve that call on a card either.
        ``definition_hash``: the digest of the tool's definition now (None: fixed in Kazma's code). A rule stands
        only for the definition its card was opened for: one made for the tool defined otherwise (an MCP server
        listed it again with another description, schema or hints) does not, as a call whose tool changed while it
        waited does not run; the same definition listed again (after a restart) keeps it.
        ``defined_since``: when the tool as it stands now was first seen here; consulted only for a rule made
        before definitions were recorded (it names none): one whose card was opened before it may have approved
        another definition, so the call gets a card."""
        if self.rules is None or not self.config.approvals.remember.enabled or not in_a_chat(conversation):
            return None
        try:
            check_arguments(args)
            digest = args_hash(args)
        except ValueError:
            return None
        policy = self.config.policy(self.config.policy_name_for(tool))
        # Every rule in force for this call, in the order match gives: one that does not stand (its maker no longer
        # an approver, a row refused, not for this requester or definition) must not hide one that does.
        for rule in await self.rules.candidates(tool, digest, conversation, definition_hash):
            # The one reading of a rule, the listings' too (rule_states): what they show is what happens here.
            state, request = await rule_standing(
                self.store, rule, config=self.config, keyring=self.store.keyring, now=self.clock()
            )
            if state.site is not None:
                # A rule row is an approval too: one the decision it names cannot account for was written
                # outside Kazma (or sealed with a key not held here). The call gets a card instead.
                count_failure(state.site)
                await self._audit_safely(rule.request_id, "rule_refused", None, None, f"{rule.id}: {state.why}")
                log.error("approvals.forged_rule", rule=rule.id, request_id=rule.request_id, detail=state.why)
                continue
            if not state.stands:
                # Ended by a change of configuration (its maker no longer an approver, max_seconds lowered, a
                # policy of several people now), or expired meanwhile: not a forgery, so not counted or audited.
                log.info("approvals.rule_ended", rule=rule.id, tool=tool, state=state.name, why=state.why)
                continue
            assert policy is not None  # it stands: its maker may decide under it
            assert request is not None
            if started_by is not None and policy.forbid_requester and self._same_person(started_by, rule.created_by):
                log.info("approvals.rule_not_for_requester", rule=rule.id, tool=tool, started_by=started_by)
                continue
            if rule.definition_hash is not None:
                if rule.definition_hash != definition_hash:
                    log.info("approvals.rule_tool_redefined", rule=rule.id, tool=tool, request_id=rule.request_id,
                             approved=rule.definition_hash, now=definition_hash)  # fmt: skip
                    continue
            elif defined_since is not None and request.created_at.timestamp() < defined_since:
                log.info("approvals.rule_tool_redefined", rule=rule.id, tool=tool, request_id=rule.request_id)
                continue
            await self._rule_used(rule, tool, digest, conversation)
            return rule
        return None

    async def _rule_used(self, rule: Rule, tool: str, digest: str, conversation: str) -> None:
        """``rule`` lets this call run: audited ``rule_used`` and said in the conversation."""
        definition = "" if rule.definition_hash is None else f", tool definition {rule.definition_hash[:12]}…"
        detail = f"{rule.id} ({tool} {digest[:12]}… in {conversation}{definition}; made by {rule.created_by})"
        await self._audit_safely(
            rule.request_id, "rule_used", rule.created_by, rule.created_via, detail,
            person=self.config.roster.person_of(rule.created_by),
        )  # fmt: skip
        log.info("approvals.rule_used", rule=rule.id, tool=tool, conversation=conversation, hash=digest)
        until = time.strftime("%H:%M:%S UTC", time.gmtime(rule.expires_at))
        say = getattr(self.publisher, "send", None)
        try:
            where = Address.parse(conversation)
        except AddressError:
            where = None  # a call outside any conversation: nobody to tell
        if say is not None and where is not None and where.chat:
            await say(
                where,
                Outgoing(
                    f"{tool} ran without a card under remembered approval {rule.id}, made by {rule.created_by} "
                    f"(request {rule.request_id}); it covers this exact call here until {until}.",
                ),
            )

    # -- deciding --------------------------------------------------------------------------------

    def is_approver(self, actor: str, platform: str) -> bool:
        return self.config.roster.is_approver(actor, platform)

    def may_decide_under(self, actor: str, platform: str, policy: str | None) -> bool:
        """Whether ``actor``'s press counts under the request policy ``policy`` (None: the default), as a press is
        judged: a policy's own ``approvers`` replace approvals.approvers; a policy no longer configured, nobody."""
        found = self.config.policy(policy or DEFAULT_POLICY)
        return found is not None and self.config.roster.may_decide(actor, platform, found.approvers)

    def decides_anywhere(self, actor: str, platform: str) -> bool:
        """Whether ``actor`` may decide under some configured policy (the default among them)."""
        return any(self.may_decide_under(actor, platform, name) for name in self.config.policy_names)

    async def decide_from_button(
        self,
        data: str,
        *,
        actor: str,
        platform: str,
        chat: str | None = None,
        message_id: str | None = None,
        reason: str | None = None,
        first_use: FirstUse | None = None,
    ) -> PressResult:
        """A button press from any platform: validate, authorise, check the card it came from, then compare-and-set.

        ``chat`` and ``message_id`` say where the pressed card is, when the
        platform says: a press counts only from a card of that request posted
        there, and Approve only from a card that showed the whole call.
        ``first_use``: the store's record of the signed request that carried the press, written in the press's
        own transaction; when it says the request was seen before, nothing is decided (``REPLAYED``).
        """
        began = time.perf_counter()  # (the histogram's own timer is an object and two calls more per press)
        once = None if first_use is None else [first_use]  # taken by the first write of the press
        try:
            try:
                parsed = parse_button(data)
            except ButtonError as exc:
                await self._refused(None, actor, platform, f"{exc}: {data[:100]!r}")
                return PressResult(PressVerdict.REFUSED, "This button is not valid; nothing was recorded.")
            return await self.decide(
                parsed.request_id,
                parsed.decision,
                actor=actor,
                platform=platform,
                card=CardLocation(chat, message_id),
                remember=parsed.remember,
                reason=reason if parsed.decision is Decision.DENY else None,
                first_use=once,
            )
        finally:
            PRESS_TO_DECISION.observe(time.perf_counter() - began)
            if once:  # the press ended before its compare-and-set: the record goes on its own
                with contextlib.suppress(*store_errors()):
                    await self.store.write(once.pop())

    async def press_recorded(self, data: str, *, actor: str) -> bool:
        """Whether the press of a button ``data`` by ``actor`` committed (asked when its decision was cut off midway:
        the answer it would have had is gone). Button data that is not valid was never recorded. A store error
        propagates: then nobody can say."""
        try:
            parsed = parse_button(data)
        except ButtonError:
            return False
        return await self.store.press_on_record(parsed.request_id, actor)

    async def decide(
        self,
        request_id: str,
        decision: Decision,
        *,
        actor: str,
        platform: str,
        reason: str | None = None,
        card: CardLocation | None = None,
        remember: bool = False,
        stepped_up: bool = False,
        first_use: list[FirstUse] | None = None,
    ) -> PressResult:
        """Authorise ``actor``, then decide ``request_id`` once: whether this call won and, if not, what stands.

        ``card``: the decision came from a button on a posted card (chat
        platforms); None for the approval page and the CLI, where the whole
        call is shown. ``stepped_up``: the approval page verified a fresh
        passkey assertion with user verification for this very approval (a
        ``step_up`` policy's Approve counts only so).

        Under a policy of several people a press is a review: it is recorded, and the one that brings its
        decision's count to the policy's threshold sets the outcome in the same transaction.
        """
        if self.halted is not None:
            count_failure(STORE_SITE)
            log.warning("approvals.decision_halted", request_id=request_id, actor=actor, reason=self.halted)
            return PressResult(
                PressVerdict.REFUSED,
                f"Kazma is not deciding right now: {self.halted}. Nothing was recorded.",
                request_id=request_id,
            )
        orphans = self.orphans
        # A stale button of a request a dead process left never approves it: ended here first if not yet.
        if orphans is not None and request_id in orphans and not await orphans.ended(request_id):
            await self._refused(request_id, actor, platform, "an orphan not yet cancelled")
            return PressResult(
                PressVerdict.REFUSED,
                f"This request is ending: {RESTARTED}. Nothing was recorded.",
                request_id=request_id,
            )
        if request_id in self._unwaited:
            return await self._press_unwaited(request_id, actor, platform)
        reason = clean_reason(reason)
        if self._config_seen is not self.config:
            self._config_seen = self.config
            self._persons.clear()
            self._admitted.clear()
        persons = self._persons
        if actor in persons:
            person = persons[actor]
        else:
            person = self.config.roster.person_of(actor)
            if len(persons) >= _CONFIG_READS_KEPT:
                persons.clear()
            persons[actor] = person

        admit = _Admit(self, request_id, decision, actor, platform, person, stepped_up)
        if remember:
            # A rare path, checked the old way round: who may decide first, then whether it may be remembered.
            refused = admit(await self._rules(request_id))
            if refused is not None:
                await self._refused(request_id, actor, platform, refused[0])
                return PressResult(PressVerdict.REFUSED, refused[1], request_id=request_id)
            unremembered = await self._remember_problem(request_id, card)
            if unremembered is not None:
                await self._refused(request_id, actor, platform, unremembered)
                return PressResult(
                    PressVerdict.REFUSED, f"{unremembered}; nothing was recorded.", request_id=request_id
                )
        check = None
        if card is not None:
            needs_whole = decision is Decision.APPROVE and not self.config.approvals.approve_cut_in_chat
            check = CardCheck(platform, card.chat, card.message_id, needs_whole)
        try:
            if failpoints.armed:  # nothing written: the presser is told to press again
                await failpoints.reached("approvals.decide.before_commit", self._decide_failure)
            pressed = await self.store.press(
                request_id, decision.status, actor=actor, platform=platform, reason=reason, card=check, person=person,
                admit=admit, first_use=first_use.pop() if first_use else None,
            )  # fmt: skip
            if pressed.replayed:
                return PressResult(PressVerdict.REPLAYED, "", request_id=request_id)
            if failpoints.armed and pressed.won:  # the decision is committed, nobody told yet
                await failpoints.reached("approvals.decide.after_commit", self._decide_failure)
            # A press can land between a card's post and the bus recording it (a person is not that fast,
            # a script is): give the record a moment before judging the press by it.
            for pause in _RECORD_GRACE if pressed.problem == CardProblem.NOT_RECORDED else ():
                await asyncio.sleep(pause)
                pressed = await self.store.press(
                    request_id, decision.status, actor=actor, platform=platform, reason=reason, card=check,
                    person=person, admit=admit,
                )  # fmt: skip
                if pressed.problem != CardProblem.NOT_RECORDED:
                    break
        except UnreadableRequest:
            # Its row was changed outside Kazma (a text not UTF-8; the store named, logged and counted it): no
            # press can ever decide it, so "press again" would be a lie; it stays undecided (nothing it asked runs)
            # and doctor names it. Not "the store is unavailable": it answered.
            return PressResult(PressVerdict.REFUSED, UNREADABLE_ANSWER, request_id=request_id)
        except store_errors() as exc:
            count_failure(STORE_SITE)
            log.warning(
                "approvals.store_unavailable",
                site=STORE_SITE,
                actor=actor,
                platform=platform,
                request_id=request_id,
                decision=decision.value,
                error=str(exc),
            )
            if undecodable(exc):  # a text not UTF-8 elsewhere than the request's row (one of its cards)
                return PressResult(PressVerdict.REFUSED, UNREADABLE_ANSWER, request_id=request_id)
            stands = await self._decided_meanwhile(request_id, decision, actor=actor, platform=platform)
            if stands is not None:
                return stands
            return PressResult(
                PressVerdict.REFUSED,
                "Your decision could not be recorded (the approvals store is unavailable). "
                "The request is still pending; please press again.",
                request_id=request_id,
            )
        if pressed.refused is not None:
            why, message = pressed.refused
            await self._refused(request_id, actor, platform, why)
            return PressResult(PressVerdict.REFUSED, message, request_id=request_id)
        if pressed.problem is not None and await self._stale_card(request_id, pressed.problem, check):
            # The request ended and this card is now recorded, to be edited to its outcome: the press is judged
            # again against it, and loses (nothing pending is ever decided from a card found this way).
            pressed = await self.store.press(
                request_id, decision.status, actor=actor, platform=platform, reason=reason, card=check, person=person,
                admit=admit,
            )  # fmt: skip
        if pressed.problem is not None:
            refusal = await self._card_refusal(request_id, pressed.problem, card)
            if refusal is not None:
                why, message = refusal
                await self._refused(request_id, actor, platform, why)
                return PressResult(PressVerdict.REFUSED, message, request_id=request_id)
            pressed = await self.store.press(
                request_id, decision.status, actor=actor, platform=platform, reason=reason, card=None, person=person,
                admit=admit,
            )  # fmt: skip
        won, request = pressed.won, pressed.request
        if request is None:
            await self._refused(request_id, actor, platform, "unknown request id")
            return PressResult(PressVerdict.REFUSED, "Unknown approval request; nothing was recorded.")
        if pressed.review is not None:
            return await self._reviewed(request_id, decision, pressed.review, actor, person, platform)
        if won:
            outcome = request.outcome()
            assert outcome is not None
            if _INFO.on:
                log.info(
                    "approvals.decided",
                    request_id=request_id,
                    status=outcome.status.value,
                    actor=actor,
                    person=person,
                    platform=platform,
                    hash=request.args_hash,
                )
            # People are configured, so the person label is bounded (an identity nobody claimed counts as "").
            count_decided(outcome.status.value, platform, person or "")
            if remember and self.rules is not None and outcome.approved:
                rule = await self._make_rule(request, actor, platform, person)
                if rule is not None:
                    log.info("approvals.rule_created", rule=rule.id, request_id=request_id, actor=actor)
            # What the decision's transaction read of the request and its cards holds only while nothing else
            # was awaited since its commit (a card recorded meanwhile would be missing from it).
            await self._ended(request_id, None if remember or failpoints.armed else pressed.decided)
            if failpoints.armed:  # decided, the waiter woken and the cards settling: the presser not answered yet
                await failpoints.reached("approvals.decide.before_answer", self._decide_failure)
            verb = "Approved" if decision is Decision.APPROVE else "Denied"
            return PressResult(PressVerdict.WON, f"{verb}. Recorded as {outcome.decider}.", outcome, request_id)
        # still pending but the compare-and-set failed: the deadline has passed
        outcome = request.outcome() or await self._expire(request_id)
        if outcome.status is Status.CANCELLED and is_withdrawn(outcome.reason):
            message = f"This request was withdrawn ({outcome.reason}); nothing changed."
            return PressResult(PressVerdict.LOST, message, outcome, request_id)
        return PressResult(PressVerdict.LOST, f"Already {outcome.summary()}.", outcome, request_id)

    async def _decided_meanwhile(
        self, request_id: str, decision: Decision, *, actor: str, platform: str
    ) -> PressResult | None:
        """After a press whose write failed: what stands when the request is no longer pending, or None.

        The error may come after the commit (a connection lost as it answered): the decision then stands, and
        nobody else will settle its cards or wake its waiter here (a replica ignores its own write's wake-up,
        and a waiter polls only every so often). Its ending goes on as after any decision, and the presser is
        told the outcome, never "still pending, press again"."""
        try:
            request = await self.store.get(request_id)
        except store_errors():
            return None  # unknown: the presser is told to press again, and a second press meets what stands
        outcome = None if request is None else request.outcome()
        if request is None or outcome is None:
            return None
        log.warning("approvals.decided_despite_error", request_id=request_id, status=outcome.status.value)
        await self._ended(request_id)
        if (request.decided_by, request.decided_via, outcome.status) == (actor, platform, decision.status):
            verb = "Approved" if decision is Decision.APPROVE else "Denied"
            return PressResult(PressVerdict.WON, f"{verb}. Recorded as {outcome.decider}.", outcome, request_id)
        return PressResult(PressVerdict.LOST, f"Already {outcome.summary()}.", outcome, request_id)

    async def _rules(self, request_id: str) -> Rules | None:
        try:
            return await self.store.rules_of(request_id)
        except store_errors():
            return None  # the press below meets the same store and says so

    def _decide_failure(self) -> BaseException:
        return simulated_failure(self.store.tables, "decide")

    def _admission(
        self,
        request_id: str,
        rules: Rules | None,
        decision: Decision,
        actor: str,
        platform: str,
        person: str | None,
        *,
        stepped_up: bool,
    ) -> tuple[str, str] | None:
        """Why ``actor`` may not decide ``request_id`` under ``rules`` (None: an unknown request) as (what the
        audit says, what the presser is told), or None. Pure: it runs inside the press's transaction."""
        policy = None if rules is None else self.config.policy(rules.policy or DEFAULT_POLICY)
        if rules is not None and policy is None:
            return (
                f"policy {rules.policy} is no longer configured",
                f"This request's approvals policy {rules.policy!r} is no longer configured, so nobody can decide "
                "it; nothing was recorded.",
            )
        if not self.config.roster.may_decide(actor, platform, () if policy is None else policy.approvers):
            return (
                "not an approver",
                f"You ({decider_text(person, actor)}) are not an approver here; nothing was recorded.",
            )
        if rules is not None and policy is not None and decision is Decision.APPROVE:
            return self._approve_barred(request_id, rules, policy, actor, stepped_up=stepped_up)
        return None

    def _person_now(self, actor: str) -> str | None:
        """Whose ``actor`` is under the configuration running now (a review's store weighs earlier reviews by it)."""
        return self.config.roster.person_of(actor)

    def _approval_counts(self, rules: Rules, actor: str, platform: str) -> bool:
        """Whether an approving review of a request opened under ``rules`` counts under the configuration now."""
        return approval_counts(self.config, rules.policy, rules.started_by, actor, platform)

    def _same_person(self, started_by: str, actor: str) -> bool:
        """Whether ``actor`` is the one who started the work (``started_by``: a person's name or an identity)."""
        people = self.config.people
        return person_key(people, actor) == requester_key(people, started_by)

    def _approve_barred(
        self, request_id: str, rules: Rules, policy: PolicyConfig, actor: str, *, stepped_up: bool
    ) -> tuple[str, str] | None:
        """Why ``actor``'s Approve may not count under the request's policy (audit, presser), or None."""
        if policy.forbid_requester and rules.started_by is not None and self._same_person(rules.started_by, actor):
            return (
                "forbid_requester: the requester may not approve",
                f"You asked for this call, so under policy {rules.policy} you cannot approve it; someone else must. "
                "Nothing was recorded.",
            )
        if rules.step_up and not stepped_up:
            return (
                "step_up: approve needs a passkey on the approval page",
                f"This call is approved only on its page, with your passkey: {self.link(request_id)} "
                "(Deny works here). Nothing was recorded.",
            )
        return None

    async def _reviewed(
        self, request_id: str, decision: Decision, state: str, actor: str, person: str | None, platform: str
    ) -> PressResult:
        """A review that did not decide: counted (its cards show the progress), or this person's second."""
        progress = await self.progress(request_id)
        said = "" if progress is None else f" {progress.line()}"
        if state == ReviewState.REPEATED:
            return PressResult(
                PressVerdict.REPEATED,
                f"You ({decider_text(person, actor)}) reviewed this already; one person counts once.{said}",
                request_id=request_id,
            )
        log.info("approvals.reviewed", request_id=request_id, decision=decision.value, actor=actor, person=person,
                 platform=platform)  # fmt: skip
        count_reviewed(decision.value, platform)
        await self._progressed(request_id)
        verb = "approval" if decision is Decision.APPROVE else "denial"
        return PressResult(PressVerdict.COUNTED, f"Your {verb} is recorded.{said}", request_id=request_id)

    async def progress(self, request_id: str) -> Progress | None:
        """Who reviewed ``request_id`` so far and who may still (None: unknown, or one press decides it)."""
        request = await self.store.get(request_id)
        if request is None:
            return None
        return progress_of(self.config, request, await self.store.reviews(request_id))

    async def _progressed(self, request_id: str) -> None:
        """A review was counted: every card of the request shows the progress (its publisher edits them)."""
        if self._publisher_is(ShowsProgress):
            await cast(ShowsProgress, self.publisher).refresh(request_id)
        self._tell(request_id)

    async def _remember_problem(self, request_id: str, where: CardLocation | None) -> str | None:
        """Why "Approve for …" must not count here: only from a button on a whole card without warnings."""
        if self.rules is None or not self.config.approvals.remember.enabled:
            return "Remembered approvals are off here"
        if where is None:
            return "A remembered approval is made only with its button on a card"
        request = await self.store.get(request_id)
        if request is None:
            return None  # the compare-and-set reports the unknown id
        if not rules_consulted_for(request.requested_by, request.conversation):
            return (
                "This call cannot be remembered: a remembered approval only ever lets an agent's tool call in a chat "
                "run"
            )
        if not request.rememberable:
            return "This call cannot be remembered: its policy needs more than one person's press, or a passkey"
        if self.card(request).remember_seconds is None:
            return "This call cannot be remembered: its card warns about what it holds"
        cards = await self.store.cards(request_id)
        if any(not c.whole for c in cards if where.chat is None or c.chat == where.chat):
            return "This call cannot be remembered: its card does not show the whole call"
        return None

    async def _stale_card(self, request_id: str, problem: str, where: CardCheck | None) -> bool:
        """A press on a card message of ``request_id`` that Kazma has no record of (posted just before a crash,
        its message id lost): once the request has ended, that message is recorded and edited to the outcome,
        like every card of it. Pending, it stays refused: only a recorded card may decide."""
        if problem not in (CardProblem.NOT_RECORDED, CardProblem.NOT_HERE) or where is None:
            return False
        if where.chat is None or where.message_id is None:
            return False  # the platform did not say which message: nothing to edit
        try:
            found = await self.store.record_stale_card(request_id, where.platform, where.chat, where.message_id)
        except store_errors() as exc:
            count_failure("card_stale")
            log.warning("approvals.stale_card_unrecorded", request_id=request_id, platform=where.platform,
                        chat=where.chat, message_id=where.message_id, error=str(exc))  # fmt: skip
            return False
        if found is FoundCard.ANOTHERS:
            # The press's data names this request on another request's card: forged (a client that sends any
            # data, as Telegram's can), never a card lost here. That card is left as it is.
            count_failure("card_found_elsewhere")
            log.warning("approvals.stale_card_of_another", request_id=request_id, platform=where.platform,
                        chat=where.chat, message_id=where.message_id)  # fmt: skip
            return False
        if found is not FoundCard.RECORDED:
            return False
        log.warning("approvals.stale_card_found", request_id=request_id, platform=where.platform,
                    chat=where.chat, message_id=where.message_id)  # fmt: skip
        if self.publisher is not None:
            await self.publisher.settle(request_id)
        return True

    async def _card_refusal(self, request_id: str, problem: str, where: CardLocation | None) -> tuple[str, str] | None:
        """What the audit says and what the presser is told for a card problem; None: let the
        compare-and-set answer (the request is unknown)."""
        if problem == CardProblem.NOT_RECORDED:
            if await self.store.get(request_id) is None:
                return None
            return ("no card of this request was posted here", "This button is not on a card of that request.")
        if problem == CardProblem.NOT_HERE:
            return (
                f"pressed in {where.chat if where else None}/{where.message_id if where else None}, "
                "where no card of this request was posted",
                "This button is not on a card of that request.",
            )
        if problem == CardProblem.NOT_YOURS:
            return (
                f"pressed in {where.chat if where else None}/{where.message_id if where else None}: a card sent to "
                "another person in a direct message",
                "This card was sent to another person in a direct message: only they can decide with it. Nothing "
                "was recorded.",
            )
        return (
            "approve pressed on a card that does not show the whole call",
            f"This card does not show the whole call, so it cannot be approved here. Review it and approve it "
            f"on its page: {self.link(request_id)}",
        )

    async def _refused(self, request_id: str | None, actor: str, platform: str, why: str) -> None:
        person = self.config.roster.person_of(actor)
        log.warning(
            "approvals.press_refused", request_id=request_id, actor=actor, person=person, platform=platform, reason=why
        )
        if not self._refusals.first_in_window(actor):
            # Someone pressing over and over: the first refusal in the window is audited, the rest only counted,
            # so refused presses cannot fill the store.
            count_failure("press_refused_unaudited", platform)
            return
        await self._audit_safely(request_id, "press_refused", actor, platform, why, person=person)

    async def _make_rule(self, request: Standing, actor: str, platform: str, person: str | None) -> Rule | None:
        """The rule an "Approve for …" press that won asks for, written with its ``rule_created`` in one
        transaction (a rule the audit does not show is never made). None when the store could not: the decision
        stands, and the next identical call gets a card (the safe side), counted and logged."""
        assert self.rules is not None
        try:
            # The definition the card was opened for: the rule stands for it alone (None: fixed in Kazma's code).
            definition = await self.store.definition_of(request.id)
            rule = self.rules.made(
                tool=request.tool, args_hash=request.args_hash, conversation=request.conversation, created_by=actor,
                created_via=platform, request_id=request.id, seconds=self.config.approvals.remember.max_seconds,
                keyring=self.store.keyring, definition_hash=definition,
            )  # fmt: skip
            await self.rules.add_recorded(self.store, rule, actor=actor, platform=platform, person=person)
        except store_errors() as exc:
            count_failure("approval_rule")
            log.warning("approvals.rule_not_made", request_id=request.id, actor=actor, error=str(exc))
            return None
        return rule

    async def _audit_safely(
        self,
        request_id: str | None,
        event: str,
        actor: str | None,
        platform: str | None,
        detail: str,
        *,
        person: str | None = None,
        deadline: float | None = None,
    ) -> None:
        try:
            await self.store.audit(
                request_id, event, actor=actor, platform=platform, detail=detail, person=person, deadline=deadline
            )
        except store_errors() as exc:
            count_failure("approval_audit")
            log.warning("approvals.audit_failed", request_id=request_id, audit_event=event, actor=actor, error=str(exc))

    # -- waiting ---------------------------------------------------------------------------------

    async def wait(self, request_id: str, *, cancel_with_waiter: bool = True) -> Outcome:
        """Return the outcome as soon as there is one.

        At the request's deadline the outcome is ``timeout``; if this waiter is
        cancelled, the request ends ``cancelled`` — unless ``cancel_with_waiter``
        is False, for requests that outlive the process waiting on them (a paused
        pipeline's checkpoint is picked up again after a restart). Neither is a
        denial.
        """
        request = await self.wait_request(request_id, cancel_with_waiter=cancel_with_waiter)
        outcome = request.outcome()
        assert outcome is not None  # wait_request returns only an ended request
        return outcome

    async def wait_request(
        self, request_id: str, *, cancel_with_waiter: bool = True, within: float | None = None
    ) -> ApprovalRequest:
        """:meth:`wait`, answering the ended request itself (read once for all its waiters in this process).

        A decision made here wakes every waiter at once; one made by another replica, when its ``NOTIFY``
        arrives (:meth:`wake`). Anything neither says (another process on the same SQLite file, a lost
        notification) is found by the waiters' sweep, every ``poll_interval`` seconds, one query for all.

        ``within``: this waiter gives up after that many seconds (:class:`TimeoutError`; with
        ``cancel_with_waiter`` False the request is left as it is): an API long-poll's ``?wait=``, on the one
        timer the wait has anyway rather than a second one around it.
        """
        loop = asyncio.get_running_loop()
        give_up = None if within is None else loop.time() + within
        watch = self._waiters.join(request_id)
        deadline: float | None = None
        first_failed: float | None = None  # when its first read failed (no read has succeeded yet)
        failed_reads = 0
        failed_expiries = 0

        async def after_backoff(failures: int, error: BaseException) -> None:
            """The one backoff after a store failure, never past ``within``; woken at once by an ending here."""
            pause = WAIT_READ_RETRY.delay(failures)
            if give_up is not None:
                if give_up <= loop.time():
                    raise TimeoutError(f"no outcome for {request_id} within {within} s") from error
                pause = min(pause, give_up - loop.time())
            await until_set(watch.event, pause)

        if cancel_with_waiter:
            self._turns[request_id] = None
        try:
            while True:
                try:
                    request = await watch.read(lambda: self.store.get(request_id))
                except store_errors() as exc:
                    # a passing lock must not end the wait; the next wake-up or sweep tries again
                    count_failure("approval_wait")
                    log.warning("approvals.wait_read_failed", request_id=request_id, error=str(exc))
                    if deadline is None:
                        # Never read yet (its deadline unknown): raising here left an opened request that nobody
                        # waits for (a press approved it, nothing ran). Read again after the one backoff, woken
                        # at once by a decision here, for as long as a request may wait by default.
                        first_failed = self.clock() if first_failed is None else first_failed
                        if self.clock() - first_failed > self.config.approvals.deadline_seconds:
                            raise
                        await after_backoff(failed_reads, exc)
                        failed_reads += 1
                        continue  # the read clears the event first: a decision meanwhile is read, never lost
                else:
                    if request is None:
                        raise KeyError(f"unknown approval request {request_id!r}")
                    if request.status.final:  # not outcome(): built per waiter, for nothing
                        if request_id not in self._ended_here and self.publisher is not None:
                            # Decided by another process (the CLI, another replica): this process's cards
                            # settle now, not at the bus's slow safety scan.
                            await self.publisher.settle(request_id)
                        return request
                    deadline = watch.deadline = request.deadline.timestamp()
                assert deadline is not None
                remaining = deadline - self.clock()
                if remaining <= 0:
                    try:
                        await watch.expire(lambda: self._expire(request_id))  # one compare-and-set for all waiters
                    except store_errors() as exc:
                        # The store refused the timeout for now (another process holds the write lock, the
                        # database is unreachable): a press past the deadline loses, so nothing else can end it
                        # now. It is tried again after the one backoff, woken at once by an ending seen here; this
                        # raised the store's error out of the wait (the agent's turn ended in it, not "timeout").
                        count_failure("approval_wait")
                        log.warning("approvals.expire_failed", request_id=request_id, error=str(exc))
                        await after_backoff(failed_expiries, exc)
                        failed_expiries += 1
                    continue  # read again: the outcome that stands, shared with the other waiters
                if give_up is not None:
                    left = give_up - loop.time()
                    if left <= 0:
                        raise TimeoutError(f"no outcome for {request_id} within {within} s")
                    remaining = min(remaining, left)
                # Asleep until a wake-up or the deadline (or ``within``): one timer per waiter. The sweep wakes what
                # ended unheard, and what its deadline passed by ``clock`` (which need not be the loop's).
                await until_set(watch.event, remaining)
        except asyncio.CancelledError:
            if cancel_with_waiter:
                await asyncio.shield(self._cancel(request_id))
            raise
        finally:
            self._waiters.leave(request_id, watch)
            self._turns.pop(request_id, None)

    def wake(self, request_id: str) -> None:
        """Another replica decided ``request_id``: its waiters here, if any, read the outcome now, and what
        watches this service (the live dashboard) hears of it as of a decision made here."""
        self._waiters.wake(request_id)
        self._tell(request_id)

    def wake_all(self) -> None:
        """Every waiter reads its request again (wake-ups may have been missed while disconnected)."""
        self._waiters.wake_all()

    async def cancel(self, request_id: str, *, reason: str) -> Outcome | None:
        """End a pending request ``cancelled`` (its requester withdrew it); the outcome that stands, None if unknown."""
        return (await self._cancel_now(request_id, reason))[1]

    async def cancel_asked(self, request_id: str, *, reason: str) -> tuple[bool, Outcome | None]:
        """:meth:`cancel`, and whether this call ended it (False: a decision or another ending came first)."""
        return await self._cancel_now(request_id, reason)

    async def _cancel_now(self, request_id: str, reason: str) -> tuple[bool, Outcome | None]:
        won, request = await self.store.finish(request_id, Status.CANCELLED, actor=None, platform=None, reason=reason)
        if won:
            log.info("approvals.cancelled", request_id=request_id, reason=reason)
            count_decided("cancelled", "", "")
            await self._ended(request_id)
        return won, None if request is None else request.outcome()

    async def withdraw(self, request_id: str, why: Gone) -> tuple[bool, Outcome | None]:
        """Its synchronous asker went away: end the request ``cancelled`` ("withdrawn: …") and settle every card.
        Whether this call ended it, and the outcome that stands (a decision made first stays; None: unknown id).
        The caller being cancelled does not stop it half-way: a request ended with its cards left live is what
        the stop's card drain then missed."""
        withdrawal = asyncio.ensure_future(self._withdraw_now(request_id, why))
        self._withdrawals.add(withdrawal)
        withdrawal.add_done_callback(self._withdrawals.discard)
        try:
            return await asyncio.shield(withdrawal)
        except asyncio.CancelledError:
            # Nobody awaits it now: a failure of it is reported here, or it went unseen (the request pending,
            # its buttons live, its asker gone).
            withdrawal.add_done_callback(lambda done: self._withdrawal_unawaited(done, request_id, why))
            raise

    def _withdrawal_unawaited(
        self, withdrawal: asyncio.Future[tuple[bool, Outcome | None]], request_id: str, why: Gone
    ) -> None:
        if withdrawal.cancelled():
            return
        error = withdrawal.exception()
        if error is None:
            return
        # The request stays pending: withdrawn by the sweep of silent askers (a polling one), else it ends at its
        # deadline or as an orphan of the next start.
        count_failure("approval_withdraw")
        log.warning(
            "approvals.withdraw_failed",
            request_id=request_id,
            why=why.value,
            error=str(error) or type(error).__name__,
            asker="cancelled",
        )

    async def _withdraw_now(self, request_id: str, why: Gone) -> tuple[bool, Outcome | None]:
        won, outcome = await self._cancel_now(request_id, withdrawn(why))
        if won:
            log.warning("approvals.withdrawn", request_id=request_id, why=why.value)
        return won, outcome

    async def looked(self, request_id: str) -> None:
        """An API asker asked for ``request_id``'s answer: remember when (written at most every ``SEEN_EVERY``
        seconds per request, so a poll costs a write only now and then; the dashboard hears of it then)."""
        now = self.clock()
        last = self._looked.get(request_id)
        if last is not None and now - last < SEEN_EVERY:
            return
        self._looked[request_id] = now
        if len(self._looked) > _RECENT_KEPT:  # bounded: only recent polls are throttled here
            self._looked.popitem(last=False)
        try:
            written = await self.store.seen(request_id, every=SEEN_EVERY)
        except store_errors() as exc:  # a lost look costs the asker nothing while it keeps asking
            count_failure("approval_last_seen")
            log.warning("approvals.last_seen_failed", request_id=request_id, error=str(exc))
            return
        if written:
            self._tell(request_id)

    async def withdraw_turns(self) -> list[ApprovalRequest]:
        """At a clean stop, while the store and the platforms are up: every request still pending that a waiter
        here ends with itself (a turn's tool call), or whose opening failed with nobody waiting, ends
        ``cancelled`` ("Kazma stopped before a decision"), its cards settling; nothing new opens from now on.
        The requests ended here (their askers are to be told); one the store refuses is left to the next start.
        """
        self.stopping = True
        if self._withdrawals:  # their cards' edits are queued before the bus drains
            await asyncio.wait(set(self._withdrawals))  # (not gather: a stop cut short must not cancel them)
        ended: list[ApprovalRequest] = []
        for request_id in [*self._turns, *self._unwaited]:
            try:
                won, request = await self.store.finish(
                    request_id, Status.CANCELLED, actor=None, platform=None, reason=STOPPED
                )
            except store_errors() as exc:  # still pending: the next start cancels it and says so
                count_failure(STORE_SITE)
                log.warning("approvals.stop_uncancelled", request_id=request_id, error=str(exc))
                continue
            self._unwaited.pop(request_id, None)
            if won and request is not None:
                log.warning("approvals.cancelled_at_stop", request_id=request_id, tool=request.tool)
                count_decided("cancelled", "", "")
                await self._ended(request_id)
                ended.append(request)
        return ended

    async def withdraw_silent(self) -> list[str]:
        """Withdraw every request whose polling asker stopped asking for its answer ``POLL_GRACE`` ago (a
        script killed mid-``--wait``, a lost ``kazma mcp serve``); the ids withdrawn here."""
        ended: list[str] = []
        for request_id in await self.store.silent(self.clock() - POLL_GRACE):
            if (await self.withdraw(request_id, Gone.SILENT))[0]:
                ended.append(request_id)
        return ended

    async def _cancel(self, request_id: str) -> None:
        try:
            won, _ = await self.store.finish(
                request_id, Status.CANCELLED, actor=None, platform=None, reason="the waiting call was cancelled"
            )
            if won:
                log.info("approvals.cancelled", request_id=request_id)
                count_decided("cancelled", "", "")
                await self._ended(request_id)
        except store_errors() as exc:
            count_failure(STORE_SITE)
            log.warning("approvals.store_unavailable", site=STORE_SITE, request_id=request_id, error=str(exc))

    async def _expire(self, request_id: str) -> Outcome:
        won, request = await self.store.finish(
            request_id, Status.TIMEOUT, actor=None, platform=None, reason="no decision before the deadline"
        )
        if won:
            log.info("approvals.timeout", request_id=request_id)
            count_decided("timeout", "", "")
            await self._ended(request_id)
        assert request is not None
        outcome = request.outcome()
        assert outcome is not None
        return outcome

    async def recover(
        self,
        live: Collection[str] | None = None,
        *,
        orphans: bool = True,
        batch: int = RECOVER_BATCH,
        leading: Callable[[], bool] | None = None,
    ) -> Recovery:
        """At start, before any platform: end what the process that died left hanging, and say so.

        Every pending request whose waiter died with that process ends
        ``cancelled`` ("Kazma restarted before a decision; nothing ran"; an
        ``/mcp`` call's request "withdrawn: Kazma restarted while it waited");
        its cards settle to that outcome as the bus comes up. Requests owned by a
        durable waiter (a paused pipeline's checkpoint) stay pending. Every
        approved call that never started running is reported once, never
        silently dropped.

        With several replicas on one database (``live``: the replicas alive now), only what a replica that
        is gone left behind: the leader runs this when it takes the lease and at every sweep.
        ``orphans=False``: the pending ones are left to :class:`kazma.approvals.orphans.Orphans`. ``batch``: how
        many are cancelled together (``bench/recover_orphans.py`` sets 1, one commit each, to compare).
        ``leading``: whether this replica still leads, asked before every write; once it says no, the recovery
        stops with what it did (the new leader recovers the rest).
        """
        cancelled: list[ApprovalRequest] = []
        never_ran: list[ApprovalRequest] = []
        unrunnable: dict[str, str] = {}
        may_have_run: list[ApprovalRequest] = []

        def deposed() -> bool:
            # A leader that stalled (a paused process, a stuck loop) long enough to lose the lease goes on from
            # where it stopped with ``live`` as it judged it then: a replica it judged gone may have come back
            # under its name since, and an approved call it is about to run would be reported as never run (and
            # so refused). The new leader judges again and recovers what is left.
            if leading is None or leading():
                return False
            log.warning("approvals.recovery_stopped", reason="this replica no longer leads",
                        cancelled=len(cancelled), reported=len(never_ran) + len(may_have_run))  # fmt: skip
            return True

        found = await self.store.orphans(live) if orphans else []
        # Written together in batches (group commit), as a start's Orphans does: one commit each held the leader's
        # sweep 2.4 s for a dead replica's 500 (about 50 s for 10,000), every card waiting for the last.
        for start in range(0, len(found), batch):
            if deposed():
                return Recovery(cancelled, never_ran, unrunnable, may_have_run)
            ended = await asyncio.gather(*(self._cancel_orphan(r, live) for r in found[start : start + batch]))
            cancelled.extend(after for after in ended if after is not None)
        for request in await self.store.approved_not_started(live):
            if deposed():
                return Recovery(cancelled, never_ran, unrunnable, may_have_run)
            problem = self.approval_problem(request)
            detail = STOPPED_BEFORE_IT_RAN
            if problem is not None:
                # Decided before seals (an upgrade), or written outside Kazma: nothing may run it, ever.
                detail = f"approved, but it cannot run: {problem.detail}; it did not run"
            if await self._execution_lost(request.id, detail, unless_started=True) is False:
                # Its replica, judged gone, started it (or another leader reported it) meanwhile: nothing to say.
                log.info("approvals.never_ran_started_meanwhile", request_id=request.id)
                continue
            if problem is not None:
                unrunnable[request.id] = problem.detail
            count_failure("approval_never_ran")
            log.warning(
                "approvals.approved_never_ran",
                request_id=request.id,
                tool=request.tool,
                runnable=problem is None,
                detail=detail,
            )
            never_ran.append(request)
        # Verified to run, never reported ended: the execution record says whether the call started.
        verified = await self.store.approved_verified_unfinished(live) if self.executions_of is not None else []
        ran = await self.executions_of([r.id for r in verified]) if self.executions_of is not None and verified else {}
        for request in verified:
            if deposed():
                break
            outcomes = ran.get(request.id, [])
            if not outcomes:
                if await self._execution_lost(request.id, STOPPED_BEFORE_IT_RAN, unless_ended=True) is False:
                    # Reported meanwhile by the recovery of another leader (a leader change while both ran), or
                    # its call's ending came in: said once, by whoever wrote it.
                    log.info("approvals.never_ran_reported_meanwhile", request_id=request.id)
                    continue
                count_failure("approval_never_ran")
                log.warning("approvals.approved_never_ran", request_id=request.id, tool=request.tool, runnable=True,
                            detail=STOPPED_BEFORE_IT_RAN)  # fmt: skip
                never_ran.append(request)
            elif any(o is None or o in ("lost", "interrupted") for o in outcomes):
                if await self._execution_lost(request.id, STOPPED_WHILE_IT_RAN, unless_ended=True) is False:
                    log.info("approvals.may_have_run_reported_meanwhile", request_id=request.id)
                    continue
                log.warning("approvals.approved_may_have_run", request_id=request.id, tool=request.tool)
                may_have_run.append(request)
            # else it ran to its end; only its audit row was lost with the process
        return Recovery(cancelled, never_ran, unrunnable, may_have_run)

    async def _cancel_orphan(self, request: ApprovalRequest, live: Collection[str] | None) -> ApprovalRequest | None:
        """``request``, left pending by a process that is gone, ended cancelled; None when something else ended it."""
        if request.waits is Waits.CONNECTION:  # an /mcp call whose connection died with that process
            reason = withdrawn(Gone.RESTARTED if live is None else Gone.REPLICA_STOPPED)
        else:
            reason = RESTARTED if live is None else REPLICA_GONE
        won, after = await self.store.finish(request.id, Status.CANCELLED, actor=None, platform=None, reason=reason)
        if not won or after is None:
            return None
        count_decided("cancelled", "", "")
        log.warning("approvals.orphan_cancelled", request_id=request.id, tool=request.tool)
        return after

    async def _execution_lost(
        self, request_id: str, detail: str, *, unless_started: bool = False, unless_ended: bool = False
    ) -> bool | None:
        """Audit what became of an approved call a stopped process did not finish, and have its cards say it.
        True: written; False: not, ``unless_started`` and an execution of it was audited first (or
        ``unless_ended`` and an ending of it); None: the store failed (reported all the same, as before)."""
        try:
            written = await self.store.execution_lost(
                request_id, detail, unless_started=unless_started, unless_ended=unless_ended
            )
        except store_errors() as exc:
            count_failure("approval_audit")
            log.warning("approvals.audit_failed", request_id=request_id, audit_event="execution_lost", error=str(exc))
            return None
        if written and self.publisher is not None:
            await self.publisher.settle(request_id)
        return written

    async def expire_overdue(self) -> list[Outcome]:
        """End every request past its deadline (requests whose waiter died with a process)."""
        return [await self._expire(request_id) for request_id in await self.store.overdue()]

    async def _ended(self, request_id: str, decided: Decided | None = None) -> None:
        """``request_id`` ended here: its cards settle, its waiters wake, its listeners are told. ``decided``: the
        request and its cards as the commit that ended it left them, read in that transaction (a press on
        SQLite), and nothing awaited since: neither the bus nor the waiters read them again."""
        ended = self._ended_here
        ended[request_id] = None
        if len(ended) > _RECENT_KEPT:  # bounded: only a waiter's recent request is looked up
            ended.popitem(last=False)
        known = None if decided is None else decided.request
        if self.publisher is not None:
            # Before the waiter wakes: the bus puts the card edits ahead of the reply to this decision.
            if known is not None and decided is not None and self._publisher_is(SettlesDecided):
                await cast(SettlesDecided, self.publisher).settle_decided(known, decided.cards)
            else:
                await self.publisher.settle(request_id)
        self._waiters.wake(request_id, known)
        self._tell(request_id)

    # -- executing -------------------------------------------------------------------------------

    def approval_problem(self, request: ApprovalRequest) -> SealProblem | None:
        """Why ``request`` is not an approval a decision path of Kazma made, or None when it is: approved,
        sealed by a key held here, the seal matching every bound field, and decided by an approver."""
        return approval_problem(self.store.keyring, self.config, request)

    def stored_approval_problem(self, request: ApprovalRequest) -> SealProblem | None:
        """:meth:`approval_problem`, and first whether the stored call still hashes to the sealed hash: the seal
        binds the hash, not the arguments, and a door that hands the arguments back (the API, ``/mcp``) hands
        back what its caller will run."""
        changed = _integrity_problem(request)
        if changed is not None:
            return SealProblem(f"its stored call was changed ({changed}) outside Kazma", FORGED)
        return self.approval_problem(request)

    async def verify_approval(self, request_id: str) -> ApprovalRequest:
        """The request if it is an approval Kazma made and sealed; otherwise refused (raises
        :class:`ExecutionMismatch`), counted, audited ``execution_refused`` and logged. For what runs on an
        approval that has no arguments of its own to compare (a paused pipeline's checkpoint)."""
        request = await self.store.get(request_id)
        if request is None or request.status is not Status.APPROVED:
            state = "unknown" if request is None else request.status.value
            raise ExecutionMismatch(f"request {request_id} is {state}, not approved")
        problem = await self.approval_to_act_on_problem(request)
        if problem is not None:
            count_failure(problem.site)
            await self._audit_safely(request_id, "execution_refused", None, None, problem.detail)
            log.error(
                "approvals.forged_approval",
                request_id=request_id,
                detail=problem.detail,
                decided_by=request.decided_by,
                key_id=request.decision_key_id,
            )
            raise ExecutionMismatch(f"request {request_id} is marked approved, but {problem.detail}: it will not run")
        return request

    async def approval_to_act_on_problem(self, request: ApprovalRequest) -> SealProblem | None:
        """Why the approved ``request`` is not one to act on, by every check Kazma makes before it runs an approved
        call itself (:meth:`stored_approval_problem`, the ``decided`` audit row, the reviews a policy of several
        people needs), or None. The doors that answer "approved" to a caller who then acts (the API, ``/mcp``)
        ask the same: nothing is told "approved" that Kazma would refuse to run."""
        problem = self.stored_approval_problem(request)
        if problem is None and not await self._decided_on_record(request):
            problem = SealProblem("it was approved without its decided audit row (changed outside Kazma)", FORGED)
        if problem is None:
            problem = await self._reviews_problem(request)
        return problem

    async def _reviews_problem(self, request: ApprovalRequest) -> SealProblem | None:
        """An approval under a policy of several people stands on that many approving reviews, each by a
        different person allowed to decide under the policy (never the requester under ``forbid_requester``), the
        decider's among them."""
        if request.approve_needed == 1:
            return None
        approving = {
            r.reviewer
            for r in await self.store.reviews(request.id)
            if r.decision is Decision.APPROVE
            and approval_counts(self.config, request.policy, request.started_by, r.actor, r.platform)
        }
        if len(approving) < request.approve_needed:
            return SealProblem(
                f"it has {len(approving)} approving reviews on record, and its policy needs {request.approve_needed}",
                FORGED,
            )
        return None

    async def _decided_on_record(self, request: ApprovalRequest) -> bool:
        """The ``decided`` audit row the compare-and-set wrote with it: same identity and person, same hash, that
        outcome."""
        return await decided_on_record(self.store, request)

    async def verify_execution(self, request_id: str, tool: str, args: Mapping[str, Any]) -> None:
        """Refuse to run anything but the exact call that was approved, by a person, on the record.

        An ``approved`` row runs only when its seal verifies (made by a decision path of Kazma with a key the
        store never holds: see :mod:`kazma.approvals.seal`), it has the ``decided`` audit row the
        compare-and-set wrote in the same transaction, its decider is an approver, and its stored call still
        hashes to the approved hash. Anything else does not run, and is counted, audited and logged.

        :data:`START_RECORD_WITHIN` counts from here: the first read waits for the writes this process submitted
        before it (a read sees them), and one of those may wait for another process's lock as long as it is held
        (the start's own attempts only began after, each bounded). Past the bound the call is refused unverified.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + START_RECORD_WITHIN
        bound = asyncio.timeout_at(give_up)
        try:
            async with bound:
                request = await self.verify_approval(request_id)
        except TimeoutError as exc:
            if not bound.expired():
                raise
            await self._start_unrecorded(request_id, tool, "the approvals store did not answer its reads", give_up)
            raise ExecutionMismatch(
                f"request {request_id}: its start could not be recorded in the approvals store within "
                f"{START_RECORD_WITHIN:g} s (the store did not even answer the reads that verify the approval; "
                "another process may hold a lock): it did not run; ask again"
            ) from exc
        if request.tool != tool:
            raise ExecutionMismatch(f"request {request_id} approved {request.tool!r}, not {tool!r}")
        actual = args_hash(args)
        if actual != request.args_hash:
            await self._audit_safely(request_id, "execution_refused", None, None, f"hash {actual} != approved")
            log.warning(
                "approvals.execution_mismatch", request_id=request_id, approved=request.args_hash, actual=actual
            )
            raise ExecutionMismatch(
                f"the arguments changed after approval (approved {request.args_hash[:12]}…, now {actual[:12]}…)"
            )
        reported = await self._record_start(request_id, tool, give_up)
        if reported is not None:
            # A leader judged this replica gone (its link to the database was down, or it was paused) and told
            # the conversation and every card that the call did not run and will not on its own: it does not.
            count_failure("approval_reported_not_run")
            log.error("approvals.execution_after_report", request_id=request_id, tool=tool, reported=reported)
            raise ExecutionMismatch(
                f"request {request_id} was already reported as not run ({reported}): it does not run now; ask again"
            )

    async def _record_start(self, request_id: str, tool: str, give_up: float) -> str | None:
        """``execution_started`` written (None), or the detail of a report that the call will not run.

        A call whose start is not on the record does not run: the start is what fences it against a recovery
        on another replica reporting it never ran (``execution_lost``), and what tells an auditor it ran. A
        passing failure (a lock, a dropped connection) is tried again for :data:`START_RECORD_WITHIN` seconds;
        then the call is refused, and the approval stands unrun (a recovery reports it as never run, which is
        then true). Every attempt carries that deadline: one still waiting for another process's lock then is given
        up by the writer and never commits (on SQLite it used to wait out ``busy_timeout_ms`` first, and a caller
        that stopped waiting instead would have left a start that commits after its refusal). ``give_up``: the loop's
        time the bound ends (set as the verification began)."""
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                # A retry must not write the start twice: the failed attempt may have committed, its answer lost.
                return await self.store.execution_starts(
                    request_id, f"tool={tool}", again=failures > 0, deadline=give_up
                )
            except store_errors() as exc:
                count_failure("approval_audit")
                log.warning(
                    "approvals.audit_failed", request_id=request_id, audit_event="execution_started",
                    attempt=failures + 1, error=str(exc),
                )  # fmt: skip
                pause = WAIT_READ_RETRY.delay(failures)
                failures += 1
                if loop.time() + pause > give_up:
                    await self._start_unrecorded(request_id, tool, str(exc), give_up, attempts=failures)
                    raise ExecutionMismatch(
                        f"request {request_id} was approved, but its start could not be recorded in the approvals "
                        f"store within {START_RECORD_WITHIN:g} s ({exc}): it did not run; ask again"
                    ) from exc
                await asyncio.sleep(pause)

    async def _start_unrecorded(
        self, request_id: str, tool: str, why: str, give_up: float, *, attempts: int = 0
    ) -> None:
        """An approved call refused because its start was not recorded within the bound: counted, logged, and said
        on the record if the store takes it within :data:`REFUSAL_RECORD_WITHIN` more (a recovery reports it as
        never run otherwise, which is true)."""
        count_failure("approval_start_unrecorded")
        log.error("approvals.start_unrecorded", request_id=request_id, tool=tool, attempts=attempts, error=why)
        loop = asyncio.get_running_loop()
        await self._audit_safely(
            request_id, "execution_refused", None, None,
            f"tool={tool}: its start could not be recorded ({why}); not run",
            deadline=max(loop.time(), give_up) + REFUSAL_RECORD_WITHIN,
        )  # fmt: skip

    async def execution_finished(self, request_id: str, *, ok: bool, output: str, error: str | None) -> None:
        """After an approved call ran: how it ended, audited. The output itself stays out of the audit (it goes
        wherever the audit is streamed): its length and SHA-256 say which output it was; an error, bounded."""
        digest = hashlib.sha256(output.encode("utf-8", "replace")).hexdigest()
        said = f"{len(output)} characters of output, sha256 {digest}"
        detail = f"ok: {said}" if ok else f"failed: {(error or 'no reason given')[:200]}; {said}"
        await self._audit_safely(request_id, "execution_finished", None, None, detail)
