"""What every chat platform shares, written once: a platform adapter is only its dialect.

:class:`PlatformBase` owns the start/stop skeleton (the subclass connects and
disconnects; work in flight is drained on stop), the singleton ingress that
only the leader replica runs (opened and closed apart from the adapter, see
:class:`~kazma.adapters.contract.SingletonIngress`), the one inbound door (the
served-chat check, the claim across replicas, the admin flag, delivery that
counts failures and never raises), the one press policy (a claim across
replicas, decide, then a quiet acknowledgement for the winner and a private
notice for losers and refusals, with one apology that never shows exception
text; written in ``press_policy.py``), and the one outbound call wrapper
(pacing, the platform's ``retry_after``, classification into
:class:`PlatformError`, counting, logging). What the door lets in (served
chats, direct messages, file bounds) is ``admission.py``; how long text is
split by the platform's own length rule and how agents are addressed is
``chat_text.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, ClassVar, Final, Protocol, TypedDict, TypeVar, Unpack

import structlog

from kazma.adapters import call_note
from kazma.adapters.admission import DirectPolicy, FileBounds, Served
from kazma.adapters.card_layout import LaidOut, agent_prefix
from kazma.adapters.chat_text import COLUMNS_FENCES, Columns, split_text
from kazma.adapters.contract import CardRef, ChatMove, Handlers, Inbound, PlatformError, refuse_elsewhere
from kazma.adapters.ingress import (
    Arrival,
    Check,
    Ingress,
    SignedRequests,
    Stopped,
    chat_served,
    claimed_here,
    files_within,
    replay_guard,
    space_served,
)
from kazma.adapters.pacing import Pacing
from kazma.adapters.press_policy import NOT_YOURS, PressPolicy
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome
from kazma.config.address import Actor, Address
from kazma.config.metrics import count_failure
from kazma.config.outgoing import Outgoing
from kazma.config.registry import CHAT_PLATFORMS, PlatformSpec
from kazma.config.supervisor import Supervisor

log = structlog.get_logger("kazma.adapters")

T = TypeVar("T")

# Calls that edit a card people are waiting on: they take the chat's next slot, ahead of queued posts.
URGENT_SITES = frozenset({"card_settle"})

NOT_SERVED: Final = "Kazma does not serve this chat."
TYPING_INTERVAL: Final = 4.0  # Telegram's chat action shows for 5 s, Discord's typing for 10 s


# Failures in a row of what brings a platform's events in before /healthz says its inbound is failing: one is a
# moment's fault, which the library's own retry gets past.
INBOUND_TROUBLE_AFTER: Final = 3


class InboundStreak:
    """The failures in a row of what brings a platform's events in while its ingress is open (Matrix's sync,
    Telegram's ``getUpdates``, Slack's socket), for ``/healthz`` (see :class:`~kazma.adapters.contract.IngressTrouble`).
    Each failure is logged and counted where it happens and tried again by its loop, and no monitor saw any of
    it: after :data:`INBOUND_TROUBLE_AFTER` in a row, or one after which nothing tries again, :attr:`trouble` says
    why, until a success."""

    def __init__(self, what: str, *, retried: str = "tried again with backoff") -> None:
        self.what = what  # "the sync": what failed, as a reader of /healthz is told it
        self.retried = retried  # what the library does about it meanwhile
        self._failures = 0
        self._error = ""
        self._final = False

    def failed(self, error: object, *, final: bool = False) -> None:
        """One more failure; ``final`` when the library gave up and nothing tries again."""
        self._failures += 1
        self._error = str(error)
        self._final = self._final or final

    def succeeded(self) -> None:
        self._failures = 0
        self._final = False

    @property
    def trouble(self) -> str | None:
        if self._final:
            return f"{self.what} failed and is not tried again: {self._error}"
        if self._failures >= INBOUND_TROUBLE_AFTER:
            return f"{self.what} failed {self._failures} times in a row, {self.retried}: {self._error}"
        return None


# -- the base -----------------------------------------------------------------------------------


ErrorClassifier = Callable[[str, BaseException], PlatformError]


@dataclasses.dataclass(frozen=True)
class Posted:
    """Where one post landed (a chat that moved under it included) and the platform's id of its message."""

    chat: str
    message_id: str


class KitOptions(TypedDict, total=False):
    """What every platform adapter takes beside its own settings, handed on to :class:`PlatformBase`."""

    press_timeout: float
    stop_grace: float
    approve_partial: bool  # an approval card cut to fit may still be approved in the chat
    direct: DirectPolicy | None  # who may write to the lead directly; default: the platform's dm_policy
    files: FileBounds | None


class PlatformBase(PressPolicy):
    """The shared half of every platform adapter; subclasses are their platform's transport and dialect.

    Outbound, the kit writes the template once (the call site's name, the checks, a card the dialect cannot
    write refused, the split loop, the log lines ``platform.card_posted``, ``platform.card_settled`` and
    ``platform.text_sent``); a dialect supplies how to write a card (:meth:`_write_card`), how to post one
    (:meth:`_post_card`), edit one (:meth:`_edit_card`) and post a piece of text (:meth:`_post_text`).
    """

    name: ClassVar[str]

    def __init__(
        self,
        config: Any,
        *,
        pacing: Pacing | None = None,
        typing_interval: float = TYPING_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        **options: Unpack[KitOptions],
    ) -> None:
        spec = self.spec
        self.config = config  # the platform's section of the configuration
        self.approve_partial = options.get("approve_partial", False)
        admins: Iterable[object] = config.admins
        served = Served.of(getattr(config, spec.chats_key), getattr(config, spec.home_key))
        press_timeout = options.get("press_timeout", 2.0)
        stop_grace = options.get("stop_grace", 5.0)
        direct = options.get("direct") or DirectPolicy.of(config.dm_policy, (self.actor(a) for a in admins))
        files = options.get("files")
        self.served = served
        self.direct = direct
        self.files = files or FileBounds()
        self.typing_interval = typing_interval
        self._clock = clock
        self._typing_at: dict[str, float] = {}  # chat -> when the working indicator was last shown
        self.admins = frozenset(str(a) for a in admins)  # user ids on this platform
        self.pacing = pacing or Pacing()
        self.press_timeout = press_timeout
        self.stop_grace = stop_grace
        self._handlers: Handlers | None = None
        self._work = Supervisor("platform_task", platform=self.name)  # work in flight: drained on stop
        self._stopping = False
        self._ingress = False  # the singleton ingress is open
        self._ingress_lock = asyncio.Lock()  # one open or close at a time: leadership may flap
        self._moves: dict[str, str] = {}  # chat ids that changed on the platform, old → new
        spaces = getattr(config, spec.spaces_key) if spec.spaces_key else ()
        self.spaces = frozenset(spaces)  # the servers served (none: every one), where the platform has servers
        self._signed = SignedRequests()
        self.door = Ingress(self._door_checks())

    @property
    def spec(self) -> PlatformSpec:
        """This platform's registry entry (its settings' keys, how its ids look)."""
        return CHAT_PLATFORMS[self.name]

    # -- what subclasses provide -----------------------------------------------------------------

    @abstractmethod
    async def _connect(self) -> None:
        """Connect to the platform and begin receiving; raise :class:`PlatformError` when that fails."""

    @abstractmethod
    async def _stop_receiving(self) -> None:
        """Stop taking new events (close the poller, the socket, the HTTP listener)."""

    @property
    def has_singleton_ingress(self) -> bool:
        """True when inbound events come over a connection only one process may hold (see ``_open_ingress``)."""
        return False

    @abstractmethod
    async def _open_ingress(self) -> None:
        """Open the singleton ingress (the poller, the gateway, the socket) on a connected adapter; raise
        :class:`PlatformError` when that fails. Called only when :attr:`has_singleton_ingress`."""

    @abstractmethod
    async def _close_ingress(self) -> None:
        """Close the singleton ingress so that no new event is taken; events already taken from the platform
        (and confirmed to it) must have reached the kit's doors when this returns. Sending keeps working."""

    @abstractmethod
    async def _disconnect(self) -> None:
        """Release the platform's clients once in-flight work has finished (it may still send until then)."""

    @abstractmethod
    def classify(self, site: str, exc: BaseException) -> PlatformError:
        """The platform's failure as a :class:`PlatformError`: retryable or not, with ``retry_after``."""

    # the dialect: how to write, post and edit (the template around them is :meth:`post_card` and the rest)

    @abstractmethod
    def _write_card(self, card: ApprovalCard, outcome: Outcome | None) -> LaidOut[Any]:
        """The one layout written in this platform's dialect; ``ValueError`` when the card cannot be written."""

    @abstractmethod
    async def _post_card(self, chat: str, laid: LaidOut[Any], card: ApprovalCard) -> Posted:
        """Post a written card into ``chat``; where it landed."""

    @abstractmethod
    async def _edit_card(
        self, site: str, ref: CardRef, laid: LaidOut[Any], card: ApprovalCard, *, settled: bool
    ) -> bool:
        """Make the posted card ``ref`` show ``laid``: with its buttons while open, none once ``settled``; False
        when it already showed it."""

    @abstractmethod
    def _text_room(self, agent: str | None) -> tuple[int, Callable[[str], int] | None]:
        """How much text one message holds beside ``agent``'s name, and how the platform counts a character."""

    @abstractmethod
    async def _post_text(self, chat: str, part: str, *, agent: str | None, thread: str | None) -> Posted:
        """Post one part of a text (it fits :meth:`_text_room`) as ``agent``; where it landed."""

    @abstractmethod
    async def _post_choices(
        self, chat: str, body: str, choices: Sequence[tuple[str, str]], *, thread: str | None
    ) -> str:
        """Post ``body`` (it fits) with one button per ``(label, data)``; the message id."""

    def _question_room(self) -> tuple[int, Callable[[str], int] | None]:
        """How much text a message with buttons holds (a whole message's room by default)."""
        return self._text_room(None)

    def _writable(self, text: str) -> str:
        """``text`` as it may be posted here (Discord neutralises mentions); itself by default."""
        return text

    async def _send_whole(self, chat: str, text: str, *, agent: str, thread: str | None) -> str | None:
        """The dialect's own way to send an agent's whole text (Discord's webhooks); None: post it in parts."""
        return None

    def _can_send(self, site: str) -> None:
        """Raise a retryable refusal when the platform's client cannot send yet (not started)."""

    @abstractmethod
    async def _post_file(self, chat: str, name: str, data: bytes, *, caption: str, thread: str | None) -> str:
        """Post ``data`` as a file named ``name`` with ``caption``; the message id."""

    @abstractmethod
    async def _show_working(self, chat: str, thread: str | None) -> None:
        """Show the platform's own "working" sign in ``chat`` once (it fades by itself)."""

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def home_chat(self) -> str | None:
        return self.served.home

    # -- card edits first (UrgentEdits) ------------------------------------------------------------

    def expect_edit(self, chat: str) -> None:
        if self.pacing.limiter is not None:
            self.pacing.limiter.expect(self.moved_to(chat))

    def edit_done(self, chat: str) -> None:
        if self.pacing.limiter is not None:
            self.pacing.limiter.expected_done(self.moved_to(chat))

    @property
    def started(self) -> bool:
        return self._handlers is not None

    async def start(self, handlers: Handlers, *, ingress: bool = True) -> None:
        """Connect and serve. ``ingress=False`` leaves the singleton ingress closed (a replica that is not the
        leader): the adapter posts, edits and sends, and serves HTTP ingress, until :meth:`start_ingress`."""
        if self._handlers is not None:
            raise PlatformError(self.name, "start", "already started", retryable=False)
        self._handlers = handlers
        self._stopping = False
        try:
            await self._connect()
            if ingress and self.has_singleton_ingress:
                async with self._ingress_lock:
                    self._ingress = True  # before opening: a failure half-way still gets closed below
                    await self._open_ingress()
        except BaseException as exc:
            self._handlers = None
            self._ingress = False
            with contextlib.suppress(Exception):
                await self._close_ingress()
            with contextlib.suppress(Exception):
                await self._stop_receiving()
            with contextlib.suppress(Exception):
                await self._disconnect()
            if isinstance(exc, Exception):
                error = exc if isinstance(exc, PlatformError) else self.classify("start", exc)
                count_failure("start", self.name)
                log.error("platform.start_failed", platform=self.name, error=str(error))
                raise error from exc
            raise
        log.info("platform.started", platform=self.name, home_chat=self.home_chat, ingress=self.ingress_running)

    async def stop(self) -> None:
        if self._handlers is None or self._stopping:
            return
        self._stopping = True
        try:
            async with self._ingress_lock:
                if self._ingress:
                    self._ingress = False
                    with contextlib.suppress(Exception):
                        await self._close_ingress()
            with contextlib.suppress(Exception):
                await self._stop_receiving()
            await self._drain()
            await self._disconnect()
        finally:
            self._handlers = None
            self._stopping = False
        log.info("platform.stopped", platform=self.name)

    # -- the singleton ingress (SingletonIngress) ---------------------------------------------------

    @property
    def ingress_running(self) -> bool:
        if not self.started or self._stopping:
            return False
        return self._ingress or not self.has_singleton_ingress

    async def start_ingress(self) -> None:
        """Open the singleton ingress of a started adapter (this replica became the leader)."""
        if not self.has_singleton_ingress:
            return
        async with self._ingress_lock:
            if self._handlers is None or self._stopping:
                raise self.refuse("ingress_start", "the adapter is not started", retryable=True)
            if self._ingress:
                return
            self._ingress = True
            try:
                await self._open_ingress()
            except BaseException as exc:
                self._ingress = False
                with contextlib.suppress(Exception):
                    await self._close_ingress()
                if isinstance(exc, Exception):
                    error = exc if isinstance(exc, PlatformError) else self.classify("ingress_start", exc)
                    count_failure("ingress_start", self.name)
                    log.error("platform.ingress_start_failed", platform=self.name, error=str(error))
                    raise error from exc
                raise
        log.info("platform.ingress_started", platform=self.name)

    async def stop_ingress(self) -> None:
        """Close the singleton ingress (this replica is no longer the leader); the adapter keeps sending.

        Events already taken are handled here: the platform was told they arrived, so no other replica
        will get them. Their work is awaited within the stop grace and never cancelled (it was claimed
        here; cancelling it would lose it), only reported when it outlives the grace.
        """
        async with self._ingress_lock:
            if not self._ingress:
                return
            self._ingress = False
            try:
                await self._close_ingress()
            except Exception as exc:
                error = exc if isinstance(exc, PlatformError) else self.classify("ingress_stop", exc)
                self.failed("ingress_stop", None, error)
        late = await self._work.wait(self.stop_grace)
        if late:
            log.warning("platform.ingress_work_outlives_stop", platform=self.name, tasks=len(late))
        log.info("platform.ingress_stopped", platform=self.name)

    async def _drain(self) -> None:
        """Let acknowledged work (presses, commands, deliveries) finish within the grace, then cancel the rest."""
        late = await self._work.stop(grace=self.stop_grace, patience=self.stop_grace)
        if late:
            log.warning("platform.stop_cancelled_work", platform=self.name, tasks=len(late))

    async def quiesce(self) -> None:
        """Wait until no tracked work is left (tests, and a clean hand-over before stopping)."""
        await self._work.drain()

    def spawn(self, work: Coroutine[Any, Any, T], *, name: str, awaited: bool = False) -> asyncio.Task[T]:
        """Run ``work`` as tracked work: ``stop`` lets it finish (within the grace) before disconnecting."""
        return self._work.spawn(work, name=name, awaited=awaited)

    def tracking(self) -> contextlib.AbstractContextManager[None]:
        """Track the current task (a library's listener task) as in-flight work while the block runs."""
        return self._work.tracking()

    # -- inbound ---------------------------------------------------------------------------------

    def serves(self, chat: str, *, direct: bool = False, author: str | None = None) -> bool:
        """Listed chats and the home chat; every group chat with ``"*"``. A direct message is served when its
        chat is listed or ``dm_policy`` allows its author: ``"*"`` means every group the bot is in, never every
        person who writes to it."""
        if direct:
            listed = chat in self.served.chats or chat == self.served.home
            return listed or (author is not None and self.direct.allows(author))
        return chat in self.served

    def is_admin(self, user_id: object) -> bool:
        return str(user_id) in self.admins

    # -- chats that change their id ----------------------------------------------------------------

    def follow_move(self, old: str, new: str) -> ChatMove | None:
        """Serve ``new`` wherever ``old`` was served (listed, home) and send to it instead of ``old``.

        Returns the move when ``old`` was served here (None otherwise: nothing of ours moved). Applied
        again at every start from the store, before anything is received, so it is quiet.
        """
        if old == new or old not in self.served:  # listed, home, or any chat under "*"
            return None
        move = ChatMove(self.name, old, new, was_home=old == self.served.home, was_listed=old in self.served.chats)
        self.served = self.served.moved(old, new)
        self._moves[old] = new
        for earlier, later in list(self._moves.items()):  # a chat that moved twice: old ids lead to the newest
            if later == old:
                self._moves[earlier] = new
        return move

    def moved_to(self, chat: str) -> str:
        """Where a message for ``chat`` goes now: its new id if it moved, else itself."""
        return self._moves.get(chat, chat)

    async def chat_moved(self, old: str, new: str) -> None:
        """The platform said ``old`` is now ``new``: follow it at once, then let the composition root record
        and announce it. Told twice (Telegram sends a notice in both chats), the second is a no-op."""
        if self._moves.get(old) == new:
            return
        move = self.follow_move(old, new)
        if move is None:
            log.info("platform.chat_moved_ignored", platform=self.name, old=old, new=new, reason="not served")
            return
        log.warning("platform.chat_moved", platform=self.name, old=old, new=new, home=move.was_home)
        handlers = self._handlers
        if handlers is None or handlers.on_chat_moved is None:
            return
        try:
            await handlers.on_chat_moved(move)
        except Exception:
            count_failure("chat_moved", self.name)
            log.exception("platform.chat_moved_failed", platform=self.name, old=old, new=new)

    def actor(self, user_id: object) -> str:
        return str(Actor(self.name, str(user_id)))

    async def _claim(self, key: str | None, kept: str | None = None) -> bool:
        """Whether this replica handles the inbound event ``key`` (True without a key or a claim handler).

        A claim that cannot be recorded is handled here anyway: the platform has been told the event
        arrived, so dropping it would lose it for good, while a rare second handling is harmless where it
        matters (a decision is one compare-and-set).
        """
        handlers = self._handlers
        if key is None or handlers is None or handlers.claim_inbound is None:
            return True
        try:
            claimed = await handlers.claim_inbound(self.name, key, kept)
        except Exception:
            count_failure("inbound_claim", self.name)
            log.exception("platform.inbound_claim_failed", platform=self.name, key=key)
            return True
        if not claimed:
            log.info("platform.inbound_claimed_elsewhere", platform=self.name, key=key)
        return claimed

    async def _may_decide(self, actor: str, request_id: str) -> bool:
        """Whether ``actor``'s press on ``request_id`` would count (see ``Handlers.may_decide``); True when there is
        nobody to ask or the asking fails (the press itself is judged as every press is)."""
        handlers = self._handlers
        if handlers is None or handlers.may_decide is None:
            return True
        try:
            return await handlers.may_decide(actor, self.name, request_id)
        except Exception as exc:
            log.warning("platform.may_decide_unknown", platform=self.name, request_id=request_id, error=str(exc))
            return True

    async def _reason_refusal(self, actor: str, request_id: str) -> str | None:
        """Why ``actor`` is not asked for a reason to deny ``request_id`` (a modal, a prompt), or None to ask: the
        request is decided already (its outcome), or their press would not count (:data:`NOT_YOURS`)."""
        handlers = self._handlers
        if handlers is not None and handlers.decided is not None:
            try:
                outcome = await handlers.decided(request_id)
            except Exception as exc:
                log.warning("platform.decided_unknown", platform=self.name, request_id=request_id, error=str(exc))
                outcome = None
            if outcome is not None:
                return f"{outcome} There is no reason to give now."
        return None if await self._may_decide(actor, request_id) else NOT_YOURS

    async def _taken_in(self, key: str | None) -> bool:
        """Tell the claims that the event ``key`` is taken in here; False when its claim is another replica's now.

        A replica counted gone (its lease session dropped) may still be running: its claim, taken over by the
        leader, is handed over there, and here it is dropped, so the event is handled once. A store that cannot
        say lets the event through (never raises): the platform was told it arrived, and losing it is worse.
        """
        handlers = self._handlers
        if key is None or handlers is None or handlers.inbound_done is None:
            return True
        try:
            return await handlers.inbound_done(self.name, key) is not False
        except Exception as exc:
            count_failure("inbound_claim", self.name)
            log.warning("platform.inbound_done_failed", platform=self.name, key=key, error=str(exc))
            return True

    # -- the door (adapters/ingress.py) -----------------------------------------------------------

    def _door_checks(self) -> list[Check]:
        """The checks every arrival passes, in order (see :mod:`kazma.adapters.ingress`)."""
        return [
            replay_guard(self._signed, self._first_in_store),
            space_served(lambda: self.spaces),
            chat_served(lambda inbound: self.serves(inbound.chat, direct=inbound.direct, author=inbound.author)),
            claimed_here(self._claim),
            files_within(lambda: self.files),
        ]

    async def _first_in_store(self, keys: list[str]) -> bool:
        """The store's memory of signed requests (across restarts and replicas). One it cannot ask lets the
        request through, counted: its signature and age were checked, and this process had not seen it."""
        handlers = self._handlers
        if handlers is None or handlers.first_signed is None:
            return True
        try:
            return await handlers.first_signed(self.name, keys)
        except Exception as exc:
            count_failure("replay_check", self.name)
            log.warning("platform.replay_check_failed", platform=self.name, error=str(exc))
            return True

    async def admit(self, arrival: Arrival) -> Arrival | None:
        """Walk the door; None when a check stopped ``arrival`` (logged, counted where evidence is dropped, taken
        in when handled, and answered in the chat when the check says so)."""
        verdict = await self.door.admit(arrival)
        if not isinstance(verdict, Stopped):
            return verdict
        inbound = arrival.inbound
        self._stopped(verdict, arrival)
        if verdict.taken_in:
            await self._taken_in(arrival.key)  # ignored or refused is handled: no next leader takes it in again
        if verdict.reply and inbound is not None:
            with contextlib.suppress(PlatformError):
                await self.send_text(inbound.chat, verdict.reply, thread=inbound.thread)
        return None

    async def screen(self, inbound: Inbound, *, space: int | str | None = None) -> bool:
        """Whether ``inbound`` would pass the door's checks that need no claim (a command answered before it
        is claimed: Slack and Discord give three seconds)."""
        arrival = Arrival(self.name, inbound, space=space)
        for check in self.door.checks:
            if check.name == "claimed_here":
                return True
            verdict = await check.run(arrival)
            if isinstance(verdict, Stopped):
                self._stopped(verdict, arrival)
                return False
            arrival = verdict
        return True

    def _stopped(self, verdict: Stopped, arrival: Arrival) -> None:
        """Say why the door stopped ``arrival``; a replay is counted (evidence of an attack or a retry storm)."""
        if verdict.reason == "replayed":
            count_failure("replay_dropped", self.name)
            kinds = [key.split(":", 1)[0] for key in arrival.signed]  # never the signature itself
            log.warning("platform.replay_dropped", platform=self.name, keys=kinds)
        elif verdict.reason != "claimed_elsewhere":  # logged by the claim
            inbound = arrival.inbound
            log.info(
                "platform.inbound_ignored",
                platform=self.name,
                check=verdict.check,
                reason=verdict.reason,
                chat=inbound.chat if inbound is not None else None,
                space=arrival.space,
            )

    async def deliver(
        self, inbound: Inbound, *, key: str | None = None, space: int | str | None = None, kept: str | None = None
    ) -> bool:
        """The one inbound door: ``inbound`` (``key``: the platform's id of the event; ``space``: the server it
        came from; ``kept``: the event as the adapter reads it back, kept with its claim) passes the door's
        checks, then the handler has it; a failing handler is counted and logged, never raised. True when the
        message was handed to the handler."""
        admitted = await self.admit(Arrival(self.name, inbound, key=key, space=space, kept=kept))
        handlers = self._handlers
        if admitted is None or admitted.inbound is None or handlers is None:
            return False
        inbound = admitted.inbound
        log.info(
            "platform.inbound",
            platform=self.name,
            chat=inbound.chat,
            message_id=inbound.message_id,
            author=inbound.author,
            from_bot=inbound.from_bot,
            command=inbound.command,
        )
        # Taken in as it is handed over: the conversation's own recovery covers a turn cut short by a crash,
        # and a message taken over again after that would run its turn twice.
        if not await self._taken_in(key):
            log.warning("platform.inbound_taken_over", platform=self.name, key=key, chat=inbound.chat)
            return False
        try:
            await handlers.on_inbound(inbound)
        except Exception:
            count_failure("inbound", self.name)
            log.exception("platform.inbound_failed", platform=self.name, chat=inbound.chat)
        return True

    # -- presses: PressPolicy.press ----------------------------------------------------------------

    # -- outbound --------------------------------------------------------------------------------

    async def call(
        self,
        site: str,
        chat: str | None,
        operation: Callable[[], Awaitable[T]],
        *,
        paced: bool = True,
        wait_out_429: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109 - per attempt, never around the pacing wait
    ) -> T:
        """One platform call: paced per chat (``paced``), 429s waited out (``wait_out_429``), bounded in
        time, and every failure a counted, logged :class:`PlatformError`.

        A transport that already runs every request through :attr:`pacing` (Telegram's rate-limit hook)
        passes both flags off, so nothing is paced or retried twice.
        """

        async def attempt() -> T:
            if timeout is None:
                return await operation()
            async with asyncio.timeout(timeout):
                return await operation()

        def rate_limited(wait: float, attempt_no: int) -> None:
            self.rate_limited(site, chat, wait, attempt_no)

        call_note.begun(self.name, site)  # a bound around this call (the bus's) can say where it was
        try:
            if wait_out_429:
                return await self.pacing.run(
                    chat if paced else None,
                    attempt,
                    retry_after_of=self._retry_after_of(site),
                    on_rate_limited=rate_limited,
                    urgent=site in URGENT_SITES,
                )
            return await attempt()
        except Exception as exc:
            error = exc if isinstance(exc, PlatformError) else self.classify(site, exc)
            self.failed(site, chat, error)
            raise error from exc

    async def send_file(
        self, chat: str, name: str, data: bytes, *, agent: str | None = None, thread: str | None = None
    ) -> str:
        """Post a file an agent produced, named by who posts it; the message id."""
        if not name.strip() or not data:
            raise self.refuse("send_file", "nothing to send: the file is empty or unnamed", chat=chat)
        caption = f"{agent}: {name}" if agent else name
        message_id = await self._post_file(self.moved_to(chat), name, data, caption=caption, thread=thread)
        log.info("platform.file_sent", platform=self.name, chat=chat, name=name, size=len(data), agent=agent)
        return message_id

    async def working(self, chat: str, *, thread: str | None = None) -> bool:
        """Show that an agent is working, at most once per ``typing_interval`` per chat; never raises."""
        now = self._clock()
        last = self._typing_at.get(chat)
        if last is not None and now - last < self.typing_interval:
            return False
        self._typing_at[chat] = now
        try:
            await self._show_working(self.moved_to(chat), thread)
        except Exception as exc:  # a sign of life is a courtesy: its failure changes nothing else
            error = exc if isinstance(exc, PlatformError) else self.classify("working", exc)
            self.failed("working", chat, error)
            return False
        return True

    # -- outbound: the template (a dialect writes, posts and edits) ------------------------------------

    def _check_chat(self, site: str, chat: str) -> None:
        if not self.spec.is_chat_id(chat):
            raise self.refuse(site, f"not a {self.spec.title} chat: {chat!r} ({self.spec.chat_id_hint})", chat=chat)

    def _lay_out(self, site: str, card: ApprovalCard, outcome: Outcome | None, chat: str) -> LaidOut[Any]:
        try:
            return self._write_card(card, outcome)
        except ValueError as exc:  # too large even cut, or a limit of the platform's: refused, never half-posted
            raise self.refuse(site, str(exc), chat=chat) from exc

    async def post_card(self, card: ApprovalCard) -> CardRef:
        """Post the approval card (the one layout, in this platform's dialect) into the home chat."""
        self._can_send("card_post")
        home = self.home_chat
        if home is None:
            raise self.refuse("card_post", f"no {self.spec.home_key} configured for approval cards")
        return await self.post_card_in(card, home)

    async def post_card_in(self, card: ApprovalCard, chat: str) -> CardRef:
        """Post the approval card into ``chat``: where a policy's ``to:`` sends it (another served chat, a
        person's direct messages: :meth:`direct_chat`), or the home chat."""
        site = "card_post"
        self._can_send(site)
        self._check_chat(site, chat)
        laid = self._lay_out(site, card, None, chat)
        posted = await self._post_card(chat, laid, card)
        log.info(
            "platform.card_posted",
            platform=self.name,
            request_id=card.request_id,
            chat=posted.chat,
            message_id=posted.message_id,
            whole=laid.whole,
        )
        return CardRef(platform=self.name, chat=posted.chat, message_id=posted.message_id, whole=laid.whole)

    def _editable(self, site: str, ref: CardRef) -> None:
        self._can_send(site)
        if ref.platform != self.name:
            raise self.refuse(site, f"not a {self.spec.title} card: {ref.platform}", chat=ref.chat)
        self._check_chat(site, ref.chat)

    async def _edit(self, site: str, ref: CardRef, card: ApprovalCard, outcome: Outcome | None) -> dict[str, Any]:
        """Edit a posted card in place: the checks, the one layout (settled with ``outcome``, else still open),
        the dialect's edit. What its log line says."""
        self._editable(site, ref)
        laid = self._lay_out(site, card, outcome, ref.chat)
        changed = await self._edit_card(site, ref, laid, card, settled=outcome is not None)
        return {
            "platform": self.name,
            "request_id": card.request_id,
            "chat": ref.chat,
            "message_id": ref.message_id,
            "changed": changed,
        }

    async def update_card(self, ref: CardRef, card: ApprovalCard) -> None:
        """Edit a posted, still open card to show ``card`` as it is now (a policy's progress), buttons kept."""
        log.info("platform.card_updated", **await self._edit("card_update", ref, card, None))

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        """Edit a posted card to show ``outcome`` and remove its buttons. Idempotent."""
        edited = await self._edit("card_settle", ref, card, outcome)
        log.info("platform.card_settled", status=outcome.status.value, **edited)

    async def send(self, to: Address, message: Outgoing) -> str:
        """Post ``message`` at ``to``: a file, a question or a text, each by its step below."""
        refuse_elsewhere(self.name, to)
        if message.file is not None:
            file = message.file
            return await self.send_file(to.chat, file.name, file.data, agent=message.agent, thread=to.thread)
        if message.choices:
            return await self.send_choices(
                to.chat, message.text, message.choices, agent=message.agent, thread=to.thread
            )
        return await self.send_text(to.chat, message.text, agent=message.agent, thread=to.thread)

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        """Post ``text`` (split by the platform's measure, never pinging anyone) as ``agent``; the first id."""
        site = "send"
        self._can_send(site)
        chat = self.moved_to(chat)
        self._check_chat(site, chat)
        columns = isinstance(text, Columns)  # laid out with spaces: every part keeps the mark (fixed width)
        text = Columns(self._writable(text)) if columns else self._writable(text)
        if not text.strip():
            raise self.refuse(site, "nothing to send: the text is empty", chat=chat)
        whole = None if agent is None else await self._send_whole(chat, text, agent=agent, thread=thread)
        if whole is not None:
            log.info("platform.text_sent", platform=self.name, chat=chat, agent=agent, message_id=whole, parts=1)
            return whole
        limit, units = self._text_room(agent)
        if columns:  # room for a code block's fences where the dialect writes one
            parts: list[str] = [Columns(part) for part in split_text(text, limit - COLUMNS_FENCES, units)]
        else:
            parts = split_text(text, limit, units)
        first: str | None = None
        for part in parts:
            posted = await self._post_text(chat, part, agent=agent, thread=thread)
            chat = posted.chat  # the rest follows a chat that moved under the first part
            first = first or posted.message_id
        if first is None:
            raise self.refuse(site, "nothing to send: the text is empty", chat=chat)
        log.info("platform.text_sent", platform=self.name, chat=chat, agent=agent, message_id=first, parts=len(parts))
        return first

    async def show_text(
        self,
        chat: str,
        shown: Sequence[tuple[str, str]],
        text: str,
        *,
        agent: str | None = None,
        thread: str | None = None,
    ) -> list[tuple[str, str]]:
        """Make the messages ``shown`` (``(message id, the part it shows)``, in order) show ``text``: split as
        :meth:`send_text` splits it, a posted part edited where it changed, the parts after them posted. What is
        shown now. A reply growing while the model writes it is shown by calling this again as it grows; each
        edit waits its turn in the chat's pacing, so a stream never edits faster than the platform allows."""
        site = "stream"
        self._can_send(site)
        chat = self.moved_to(chat)
        self._check_chat(site, chat)
        text = self._writable(text)
        if not text.strip():
            raise self.refuse(site, "nothing to send: the text is empty", chat=chat)
        limit, units = self._text_room(agent)
        now = list(shown)
        for index, part in enumerate(split_text(text, limit, units)):
            if index >= len(now):
                posted = await self._post_text(chat, part, agent=agent, thread=thread)
                now.append((posted.message_id, part))
            elif now[index][1] != part:
                await self._edit_text(chat, now[index][0], part, agent=agent, thread=thread)
                now[index] = (now[index][0], part)
        log.debug("platform.text_shown", platform=self.name, chat=chat, agent=agent, parts=len(now))
        return now

    edits_text: ClassVar[bool] = False  # the dialect can edit a posted text (:meth:`_edit_text`)

    async def _edit_text(self, chat: str, message_id: str, part: str, *, agent: str | None, thread: str | None) -> None:
        """Make the posted text ``message_id`` (posted by :meth:`_post_text` as ``agent``) show ``part``, paced."""
        raise self.refuse("stream", f"{self.spec.title} messages are not edited here", chat=chat)

    async def send_choices(
        self,
        chat: str,
        text: str,
        choices: Sequence[tuple[str, str]],
        *,
        agent: str | None = None,
        thread: str | None = None,
    ) -> str:
        """Post ``text`` (plain, escaped) with one button per ``(label, data)``; the message id."""
        site = "send"
        self._can_send(site)
        chat = self.moved_to(chat)
        self._check_chat(site, chat)
        body = self._writable(agent_prefix(agent) + text)
        limit, units = self._question_room()
        size = len(body) if units is None else sum(units(c) for c in body)
        if not text.strip() or size > limit:
            problem = f"a question must be 1 to {limit} characters as {self.spec.title} counts them"
            raise self.refuse(site, problem, chat=chat)
        return await self._post_choices(chat, body, choices, thread=thread)

    def _retry_after_of(self, site: str) -> Callable[[BaseException], float | None]:
        def retry_after(exc: BaseException) -> float | None:
            error = exc if isinstance(exc, PlatformError) else self.classify(site, exc)
            title = self.spec.title
            what = call_note.wording(error).removeprefix("rate limited: ")
            call_note.answered(f"{title} answered {what}", error.retry_after, kept=True)
            return error.retry_after

        return retry_after

    def rate_limited(self, site: str, chat: str | None, wait: float, attempt: int) -> None:
        """The platform said to wait (a 429); the call is tried again after ``wait`` seconds."""
        log.warning(
            "platform.rate_limited", platform=self.name, site=site, chat=chat, retry_after=wait, attempt=attempt
        )

    def failed(self, site: str, chat: str | None, error: PlatformError) -> None:
        count_failure(site, self.name)
        error.counted = True
        log.warning(
            "platform.call_failed",
            site=site,
            platform=self.name,
            chat=chat,
            error=str(error),
            retryable=error.retryable,
            retry_after=error.retry_after,
        )

    def refuse(self, site: str, message: str, *, chat: str | None = None, retryable: bool = False) -> PlatformError:
        """A failure decided before any call (no home chat, empty text, a malformed id): counted and logged."""
        error = PlatformError(self.name, site, message, retryable=retryable)
        self.failed(site, chat, error)
        return error


class _Reads(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


async def read_up_to(stream: _Reads, limit: int) -> bytes:
    """``stream``'s bytes to its end, or its first ``limit`` once it holds that many (an aiohttp body: a file
    fetched, a request's). One ``read(limit)`` is not that: it gives what has arrived so far, and a 1 MB file
    reached the agents as its first 118 KB, a passkey's answer in two TCP segments was cut at the first."""
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = await stream.read(limit - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
