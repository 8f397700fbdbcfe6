"""The bus contract every platform adapter satisfies.

Adapters never import the engine: inbound messages and button presses leave an
adapter through two callables that the composition root injects at start.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome, PressResult
from kazma.config.address import Actor, Address
from kazma.config.outgoing import Outgoing

AttachmentFetch = Callable[[], Awaitable[bytes]]


@dataclass(frozen=True)
class Attachment:
    """A file someone sent with a message: its name, the size the platform declares, and how to fetch it.

    Adapters never save files (they do not know workspaces): the engine fetches what the kit let through.
    """

    name: str
    size: int | None  # bytes, as the platform declares them; None: unknown until fetched
    fetch: AttachmentFetch = field(compare=False, repr=False)


@dataclass(frozen=True)
class Inbound:
    """A message normalised away from its platform."""

    platform: str  # "telegram" | "slack" | "discord" | "web"
    chat: str  # platform chat/channel id as text
    message_id: str
    author: str  # "<platform>:<user id>", the form approvers are written in
    author_name: str
    text: str  # for a command: the text after the command word
    thread: str | None = None
    mentions: tuple[str, ...] = ()  # lowercase names mentioned with @, without the @
    from_bot: bool = False  # posted by a bot (our own dispatches included)
    command: str | None = None  # "swarm" for `/swarm …`; None for plain messages
    is_admin: bool = False  # the author is in this platform's configured admins
    direct: bool = False  # a direct message to the bot, not a group conversation
    reply_to: str | None = None  # the message this one replies to, when the platform says (answers to questions)
    attachments: tuple[Attachment, ...] = ()  # files sent with the message, within the configured bounds
    chat_title: str = ""  # what the platform calls the conversation (a group's title, a channel's name); "" unsaid

    @property
    def where(self) -> Address:
        """Where it was said: its chat, and its thread there (an answer goes back to the same place)."""
        return Address(self.platform, self.chat, self.thread)

    @property
    def who(self) -> Actor:
        """Its author as an actor (raises :class:`~kazma.config.address.ActorError` for an agent's dispatch)."""
        return Actor.parse(self.author)


@runtime_checkable
class IdempotentPosts(Protocol):
    """An adapter whose platform makes a card post idempotent (Discord's ``nonce``): a post tried again after a
    crash or a lost answer gives back the first message, never a second card."""

    idempotent_posts: bool


@dataclass(frozen=True)
class CardRef:
    """Where one card of a request was posted, so it can be edited later."""

    platform: str
    chat: str
    message_id: str
    whole: bool = True  # the card showed the whole call (every name, every value uncut)

    @property
    def where(self) -> Address:
        return Address(self.platform, self.chat)


class PlatformError(Exception):
    """A platform call failed. ``retryable`` tells the outbox whether trying again may help.

    ``operator_must_act``: the platform refused because of Kazma's own setup (a missing scope, a refused token,
    an intent not enabled), which only the operator can change. Not retryable says only that the same call
    will fail again; a file deleted before Kazma fetched it is not retryable either, yet nobody's setup is
    wrong, and a person told "ask the operator" about it is sent the wrong way.

    ``counted``: a failure counter (``count_failure``) has this failure already (the kit counts every call it
    makes); whoever catches it counts it only when not, so one failure is one count.

    ``nothing_done``: the platform certainly did nothing with the call: it never left Kazma (a token refused
    earlier, see :class:`SetupRefused`), or the platform refused the token it carried. A card post that failed so
    cannot have landed, so it is no attempt that may have (the outbox marks a post after one "posted again").
    """

    def __init__(
        self,
        platform: str,
        site: str,
        message: str,
        *,
        retryable: bool,
        retry_after: float | None = None,
        operator_must_act: bool = False,
        nothing_done: bool = False,
    ) -> None:
        super().__init__(f"{platform} {site}: {message}")
        self.platform = platform
        self.site = site
        self.retryable = retryable
        self.retry_after = retry_after
        self.operator_must_act = operator_must_act
        self.counted = False
        self.nothing_done = nothing_done


@dataclass(frozen=True)
class Press:
    """A button press, as every platform reports it."""

    platform: str
    data: str  # the button's data, untrusted: ``kz1:<id>:<a|d>`` when genuine
    actor: str  # "<platform>:<user id>" of the person who pressed
    chat: str | None = None  # where the pressed card is, when the platform says
    message_id: str | None = None  # which message the pressed card is, when the platform says
    is_admin: bool = False  # the presser is one of this platform's configured admins
    reason: str | None = None  # a Deny's reason, as the presser wrote it (a modal, a reply); None: none given
    # What makes the signed request that carried it unique, not yet in the store's memory of signed requests:
    # recorded in the press's own commit (``Handlers.signed_with_press``), and a replay decides nothing there.
    signed: tuple[str, ...] = ()

    @property
    def where(self) -> Address | None:
        """The pressed card's chat, when the platform says."""
        return None if self.chat is None else Address(self.platform, self.chat)

    @property
    def who(self) -> Actor:
        """The presser as an actor."""
        return Actor.parse(self.actor)


@dataclass(frozen=True)
class ChatMove:
    """A chat got a new id on its platform (a Telegram group upgraded to a supergroup), old → new."""

    platform: str
    old: str
    new: str
    was_home: bool = False  # the moved chat was the platform's home chat
    was_listed: bool = False  # the moved chat was listed among the served chats


InboundHandler = Callable[[Inbound], Awaitable[None]]
PressHandler = Callable[[Press], Awaitable[PressResult]]
# Whether a press is on the record (True), is not (False), or nobody can say (None): asked when its decision was
# cut off midway (the process stopping), so its presser is told the truth.
PressRecorded = Callable[[Press], Awaitable[bool | None]]
ChatMoveHandler = Callable[[ChatMove], Awaitable[None]]


class InboundClaim(Protocol):
    def __call__(self, platform: str, key: str, payload: str | None = None, /) -> Awaitable[bool]:
        """True when this replica may handle the event ``key`` (it was the first to claim it). ``payload``: the
        event, kept with the claim where the platform never delivers it again (a Discord gateway message), so
        that a replica taking the claim over from a dead one can hand it over in its place."""
        ...


# (platform, event key) -> False when the claim is no longer this replica's (taken over by another, which hands
# the event over instead); True or None: hand it over here
InboundDone = Callable[[str, str], Awaitable[bool | None]]
SignedCheck = Callable[[str, Sequence[str]], Awaitable[bool]]


@runtime_checkable
class InboundInbox(Protocol):
    async def fetched(self, platform: str, events: Sequence[tuple[str, str]]) -> None:
        """Keep (key, payload) of each event fetched, before the platform is told it arrived."""
        ...

    async def unfinished(self, platform: str) -> list[str]:
        """Payloads kept by a replica that is gone and never taken in, now this replica's to handle."""
        ...

    async def release_unhandled(self, platform: str) -> int:
        """This replica stops polling: forget what it kept and never let through (the platform sends it again)."""
        ...


@dataclass
class Handlers:
    on_inbound: InboundHandler
    on_press: PressHandler
    extra: dict[str, object] = field(default_factory=dict)
    # told once the adapter already serves the new id: record it, say it, tell people what to change
    on_chat_moved: ChatMoveHandler | None = None
    # Several replicas on one store: asked once per inbound event (a message, a command, a press) before it is
    # delivered, with the platform's own key for it (a Telegram update id, a Slack message or trigger id, a
    # Discord message or interaction id); False means another replica has it, so it is dropped here. A
    # platform delivers an event again when leadership moves before it was confirmed (Telegram) or when its
    # acknowledgement was late (Slack retries). None: every event is handled, as with one process.
    claim_inbound: InboundClaim | None = None
    # Told once a claimed event is taken in (a message handed to its handler, a press decided): until then a
    # replica that claimed it and died has not handled it, and another may take the claim over.
    inbound_done: InboundDone | None = None
    # Several replicas and a poller that confirms what it fetched (Telegram): the events are kept here before
    # they are confirmed, and a new leader takes in first what a gone one kept and never took in.
    inbox: InboundInbox | None = None
    # Signed requests (Slack): True the first time any of these keys (signature, event id, trigger id) is seen,
    # remembered in the store, so a captured request posted again after a restart, or to another replica, is
    # dropped inside its signature window too. None: the adapter's own memory alone (it ends with the process).
    first_signed: SignedCheck | None = None
    # on_press records a press's signed request (``Press.signed``) in the transaction of its decision, and answers
    # a replay with ``PressVerdict.REPLAYED``: the adapter checks only its own memory before handing it over.
    signed_with_press: bool = False
    # A platform's own home page for one person (Slack's App Home): what waits for a decision, and whether this
    # person may decide. None: the adapter shows none.
    home: HomeHandler | None = None
    # Whether a press of (identity, platform) on request id would count (its policy's approvers): asked before a
    # step that posts in the chat for a press (Telegram's "Deny with reason" prompt), so nobody who may not decide
    # makes the bot post. None, or an error: the step goes on (the press itself is judged as every press is).
    may_decide: DecidesCheck | None = None
    # The outcome of a request that is decided already, as its presser would be told it ("Already denied by …"):
    # asked with may_decide, so nobody is asked for the reason of a decision that stands. None (or an error, or
    # an answer of None): the step goes on, and the press itself meets what stands.
    decided: DecidedCheck | None = None
    # Whether a press whose decision was cancelled midway (the process stopping past its grace) committed anyway.
    # None: the adapter cannot look, and tells its presser the press was not recorded.
    press_recorded: PressRecorded | None = None


@dataclass(frozen=True)
class HomeItem:
    """One request waiting for a decision, as a person's home page lists it."""

    text: str  # "shell, asked by agent:builder in telegram:-1001" (plain text: the writer escapes it)
    link: str  # its approval page, where the whole call is shown
    yours: bool = True  # whether this person's press counts under the request's policy


@dataclass(frozen=True)
class Home:
    """A person's home page on a platform: who they are to Kazma and what waits for a decision."""

    who: str  # "alice (slack:U1)", or the identity alone
    may_decide: bool  # under some policy (each item says whether under its own)
    waiting: tuple[HomeItem, ...]
    more: int = 0  # waiting beyond those listed
    console: str = ""  # the console's address, for what the page cannot show


HomeHandler = Callable[[str, str], Awaitable[Home]]  # (identity, platform) -> that person's home page
DecidesCheck = Callable[[str, str, str], Awaitable[bool]]  # (identity, platform, request id) -> their press counts
DecidedCheck = Callable[[str], Awaitable[str | None]]  # request id -> its outcome told, or None while pending


@runtime_checkable
class PlatformAdapter(Protocol):
    """One chat platform on its real client library."""

    @property
    def name(self) -> str:
        """The platform's registry name: the prefix of its actors and conversations."""
        ...

    @property
    def home_chat(self) -> str | None:
        """Where approval cards, reports and alerts go; None when unset."""
        ...

    async def start(self, handlers: Handlers) -> None:
        """Connect and begin delivering inbound messages and presses to ``handlers``."""
        ...

    async def stop(self) -> None: ...

    async def send(self, to: Address, message: Outgoing) -> str:
        """Post ``message`` at ``to`` (a chat of this platform, a thread in it): text escaped and never pinging
        anyone, a question's buttons (a press arrives like a card's), a file. The message id; raises
        :class:`PlatformError`."""
        ...

    async def post_card(self, card: ApprovalCard) -> CardRef:
        """Post the approval card with Approve/Deny buttons into the home chat."""
        ...

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        """Edit a posted card to show ``outcome`` and remove its buttons. Idempotent."""
        ...


@runtime_checkable
class SingletonIngress(Protocol):
    """A platform whose inbound connection only one process may hold at a time.

    Telegram long polling (a second ``getUpdates`` ends the first with 409), the Discord gateway and Slack
    Socket Mode each deliver every event to whoever is connected, so with several replicas only the leader
    runs them. Every replica still posts, edits and sends over the platform's HTTP API, and serves HTTP
    ingress (webhooks, Slack's HTTP events), which is not singleton. ``start(handlers, ingress=False)``
    connects for sending only; :meth:`start_ingress` and :meth:`stop_ingress` may follow any number of times.
    """

    @property
    def has_singleton_ingress(self) -> bool:
        """True when this adapter's inbound path is one only a single process may run (by its configuration)."""
        ...

    @property
    def ingress_running(self) -> bool:
        """Whether inbound events reach this adapter now (always, once started, without singleton ingress)."""
        ...

    async def start(self, handlers: Handlers, *, ingress: bool = True) -> None:
        """Connect; with ``ingress=False`` the singleton ingress stays closed until :meth:`start_ingress`."""
        ...

    async def start_ingress(self) -> None:
        """Open the singleton ingress (started adapters only); a no-op when it runs or there is none."""
        ...

    async def stop_ingress(self) -> None:
        """Close the singleton ingress: no new events are taken, and what was taken is handled here first.

        Sending and editing keep working. A no-op when it is not running or there is none.
        """
        ...


@runtime_checkable
class IngressTrouble(Protocol):
    """A platform that can say why inbound events do not reach it now, though its ingress was opened: Discord
    closing the gateway for good (a close discord.py does not reconnect after), Matrix's sync failing again and
    again (a revoked token, a homeserver down)."""

    @property
    def ingress_trouble(self) -> str | None:
        """Why inbound events do not come in now; None while they do."""
        ...


def ingress_trouble(adapter: object) -> str | None:
    """Why ``adapter``'s inbound events do not come in now (see :class:`IngressTrouble`), or None."""
    return adapter.ingress_trouble if isinstance(adapter, IngressTrouble) else None


@runtime_checkable
class SetupRefused(Protocol):
    """A platform that refused Kazma's own setup while it ran (Discord refusing the bot token): the same setting
    can only be refused again, so nothing is tried with it (no login, no ingress, no post) until the operator
    changes it and restarts Kazma, as after a start the platform refused."""

    @property
    def setup_refused(self) -> str | None:
        """What was refused and what the operator does about it; None while nothing is."""
        ...


def setup_refused(adapter: object) -> str | None:
    """What ``adapter``'s platform refused of Kazma's setup while it ran (see :class:`SetupRefused`), or None."""
    return adapter.setup_refused if isinstance(adapter, SetupRefused) else None


@runtime_checkable
class PressesOutliveRefusal(Protocol):
    """A platform whose presses still reach Kazma and decide after it refused Kazma's setup (Slack refusing the bot
    token: presses are signed with the signing secret, or come over Socket Mode's app-level token), while its card
    posts and edits wait for the restart."""

    @property
    def presses_outlive_refusal(self) -> bool: ...


def presses_outlive_refusal(adapter: object) -> bool:
    """Whether presses on ``adapter``'s cards still decide after it refused Kazma's setup (see
    :class:`PressesOutliveRefusal`); a platform that does not say so is off then."""
    return isinstance(adapter, PressesOutliveRefusal) and adapter.presses_outlive_refusal


def singleton_ingress(adapter: object) -> SingletonIngress | None:
    """``adapter`` when it has an ingress only the leader may run (start it with ``ingress=``), else None."""
    if isinstance(adapter, SingletonIngress) and adapter.has_singleton_ingress:
        return adapter
    return None


@runtime_checkable
class FindsCards(Protocol):
    """A platform whose card posts are idempotent only for a while (Discord keeps a nonce minutes): a card an
    unrecorded attempt landed is looked for among the chat's recent messages after that."""

    async def find_card(self, request_id: str, chat: str) -> CardRef | None:
        """The bot's card of ``request_id`` among ``chat``'s recent messages, or None when none is there. Raises
        :class:`PlatformError` (e.g. the bot may not read the channel's history)."""
        ...


@runtime_checkable
class RoutesCards(Protocol):
    """A platform that posts a card where a policy sends it (``approvals.policies.<name>.to``): into a chat it
    serves other than its home chat, or into a person's direct messages with the bot."""

    async def post_card_in(self, card: ApprovalCard, chat: str) -> CardRef:
        """Post the approval card with its buttons into ``chat``. Raises :class:`PlatformError`."""
        ...

    async def direct_chat(self, user: str) -> str:
        """The chat of the bot's direct messages with ``user`` (a user id on this platform), opened when the
        platform needs that. Raises :class:`PlatformError` (e.g. the person never started a chat with the bot)."""
        ...


@runtime_checkable
class UrgentEdits(Protocol):
    """A platform that paces sends per chat and can put a card edit ahead of what is queued there."""

    def expect_edit(self, chat: str) -> None:
        """A card edit into ``chat`` is coming: hold other sends there until it went (or a short while)."""
        ...

    def edit_done(self, chat: str) -> None:
        """The expected edit went, or will not come: release what :meth:`expect_edit` held."""
        ...


@runtime_checkable
class UpdatesCards(Protocol):
    """A platform that can edit a pending card in place, keeping its buttons: a policy of several people's
    card shows each review as it comes ("1 of 2 approvals: alice on Telegram; waiting for: bob")."""

    async def update_card(self, ref: CardRef, card: ApprovalCard) -> None:
        """Show ``card`` (still pending) in place of what ``ref`` shows now. Raises :class:`PlatformError`."""
        ...


def refuse_elsewhere(platform: str, to: Address) -> None:
    """An adapter is handed only addresses on its own platform: another's is refused before any call."""
    if to.platform != platform:
        raise PlatformError(platform, "send", f"not an address on {platform}: {to}", retryable=False)


@runtime_checkable
class ShowsText(Protocol):
    """An adapter that can show a text growing: post it, then edit what it posted (Telegram, Slack, Discord)."""

    edits_text: bool

    async def show_text(
        self,
        chat: str,
        shown: Sequence[tuple[str, str]],
        text: str,
        *,
        agent: str | None = None,
        thread: str | None = None,
    ) -> list[tuple[str, str]]: ...


@runtime_checkable
class FileAdapter(Protocol):
    """A platform that can post files and show that an agent is working (every chat platform and the console)."""

    async def send_file(
        self, chat: str, name: str, data: bytes, *, agent: str | None = None, thread: str | None = None
    ) -> str:
        """Post ``data`` as a file called ``name``; return the message id."""
        ...

    async def working(self, chat: str, *, thread: str | None = None) -> bool:
        """Show that an agent is working in ``chat`` (rate-limited: False when skipped or failed)."""
        ...
