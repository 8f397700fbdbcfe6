"""The Matrix adapter on mautrix's client-server API: transport and lifecycle only.

A bot account (its access token) in rooms of any homeserver. Cards are ``render.py``; failures are
``errors.py``; events in the bus's terms are ``inbound.py``; where the sync stands is ``position.py``; the
inbound door, the press policy, pacing and 429 handling are the kit's.

Presses are reactions on the card: the card carries which key means which button (``org.kazma.choices``,
kept on the bot's own event, so a reaction is read the same after a restart or on another replica), and a
reaction counts only on an event the bot itself sent. The homeserver proves who reacted: the press's actor is
the event's ``sender``. A card is settled by an edit (``m.replace``), which every client shows in place.

``/sync`` is the singleton ingress: only the leader replica syncs. Where it stands is kept on the homeserver
(``position.py``): the token the batch began at and each room's last event of it taken in, so a restart
or a new leader neither loses nor repeats an event. Events are taken in one at a time, and the position moves
past one only once the kit has it for good (a message handed to its conversation, a press decided): a process
that ends before that leaves it to the next start. Every replica sends.

Encrypted rooms are not supported (their messages cannot be read without keys this adapter does not keep):
the first encrypted event in a room gets a notice saying so and how to make an unencrypted room.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Unpack
from urllib.parse import quote

import structlog
from mautrix.api import Method, Path
from mautrix.client import ClientAPI
from mautrix.errors import MForbidden, MNotFound
from mautrix.types import RoomCreatePreset, RoomID, UserID

from kazma.adapters.card_layout import LaidOut, agent_prefix
from kazma.adapters.contract import CardRef, Handlers, PlatformError, Press
from kazma.adapters.deny_reason import (
    PROMPT_EXPIRED,
    PROMPT_NO_WORDS,
    REPLY_WINDOW_SECONDS,
    deny_data,
    reason_request,
    reply_prompt,
)
from kazma.adapters.kit import InboundStreak, KitOptions, PlatformBase, Posted, read_up_to
from kazma.adapters.matrix.client import close_client, long_poll, make_client
from kazma.adapters.matrix.errors import ENCRYPTED_NOTICE, PLATFORM, classify
from kazma.adapters.matrix.inbound import Reaction, media_of, normalise, reaction_of, reply_target, reply_words
from kazma.adapters.matrix.position import Position, SyncPosition
from kazma.adapters.matrix.render import (
    CHOICES_KEY,
    PROMPT_KEY,
    TEXT_LIMIT,
    Choice,
    MatrixCard,
    edit_content,
    json_units,
    legend,
    message_content,
    question_choices,
    render_card,
    same_key,
)
from kazma.adapters.pacing import ChatRateLimiter, Pacing
from kazma.adapters.press_policy import PressReply
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome, PressResult
from kazma.config.metrics import count_failure
from kazma.config.models import MatrixConfig
from kazma.config.waits import until_set

log = structlog.get_logger("kazma.adapters.matrix")

# What one sync asks for: messages, reactions and the signs of encryption; no presence, receipts or typing.
_TIMELINE_TYPES: Final = [
    "m.room.message", "m.reaction", "m.room.encrypted", "m.room.encryption", "m.room.member", "m.room.tombstone",
    "m.room.redaction",
]  # fmt: skip
SYNC_FILTER: Final = json.dumps(
    {
        "presence": {"types": []},
        "account_data": {"types": []},
        "room": {
            "timeline": {"limit": 100, "types": _TIMELINE_TYPES},
            "state": {"types": ["m.room.encryption"], "lazy_load_members": True},
            "ephemeral": {"types": []},
            "account_data": {"types": []},
        },
    },
    separators=(",", ":"),
)
DIRECT_TYPE: Final = "m.direct"  # the account's direct rooms, as every client keeps them
# A room's timeline in one sync holds at most 100 events ("limited" when more came); the rest are read back page
# by page, up to this many a room — more than a long outage of a busy room brings; beyond it they are counted.
GAP_LIMIT: Final = 2_000
_GAP_FILTER: Final = json.dumps({"types": _TIMELINE_TYPES, "lazy_load_members": True}, separators=(",", ":"))
TYPING_MS: Final = 5_000
# How long the sync waits for a press's decision before it moves on (the press is decided on all the same, and its
# presser told how it ends): a store that stops answering would otherwise hold every room's events behind one press.
DECISION_WAIT_SECONDS: Final = 30.0
# How many times the sync takes a batch again for one card the homeserver fails to show (a 5xx, no answer) before it
# passes that reaction by (counted): with the sync's backoff, about two minutes. A card event the homeserver can never
# serve would otherwise hold every room's later events behind it for ever.
CARD_READ_TRIES: Final = 8
# The same bound for the join of an upgraded room's replacement that fails with a 5xx or no answer (its only server
# down: "Failed to make_join via any server"): then the tombstone is passed by, counted, and the bot joins at an invite.
UPGRADE_JOIN_TRIES: Final = 8
# How many of a card's newest edits are read before editing it, to find the bot's own among any others'.
EDITS_PAGE: Final = 50


class _Tries:
    """Failures that may pass (a 5xx, no answer), counted per thing (a card event, a room's join): the batch comes
    again for it until ``limit`` tries, then it is passed by, so that one thing never holds every later event."""

    def __init__(self) -> None:
        self._failed: dict[str, int] = {}

    def again(self, key: str, limit: int) -> int | None:
        """None: take the batch again for ``key``; else its tries, now given up (and forgotten)."""
        failed = self._failed.get(key, 0) + 1
        if failed < limit:
            self._failed[key] = failed
            return None
        self._failed.pop(key, None)
        return failed

    def forget(self, key: str) -> None:
        self._failed.pop(key, None)

    def tried(self, key: str) -> bool:
        """Whether ``key`` failed before and is being tried again."""
        return key in self._failed


# Reason prompts (and events found to be none) remembered at once, the oldest forgotten first: read again if need be.
PROMPTS_KEPT: Final = 1000
# Events the homeserver said someone else sent, remembered so a reaction (or a reply) to an ordinary message costs
# no read of it after the first: the oldest forgotten first.
OTHERS_KEPT: Final = 10_000
# The bot's own events with choices (cards, questions) remembered with them, the least recently posted or pressed
# forgotten first, a settled card before any other. A forgotten one is read again from the homeserver at its next
# press (its content carries its choices): one read, the press the same.
CHOICES_KEPT: Final = 10_000

# What the caches of the bot's own events are keyed by: the room and the event. A reaction or a reply names its
# event by id alone, and only the sender's homeserver holds it to its room (a federated server's event arrives as
# that server made it; a reply is no relation, checked by nobody): keyed by id alone, a card or a prompt remembered
# in one room answered for an event in another, where reading it (in that room) finds nothing.
_Where = tuple[str, str]


@dataclass(frozen=True)
class _Prompt:
    """A "Deny with reason" prompt, as the prompt event carries it (:data:`PROMPT_KEY`)."""

    user: str  # only this person's reply counts
    data: str  # the plain Deny's data (kz1:<id>:d)
    card: str  # the card event the reason button was on
    until: float  # seconds since the epoch

    def content(self) -> dict[str, Any]:
        # Whole seconds: a homeserver refuses an event with a float in it (canonical JSON has integers only).
        return {"user": self.user, "data": self.data, "card": self.card, "until": int(self.until)}

    @classmethod
    def of(cls, kept: object) -> _Prompt | None:
        if not isinstance(kept, dict):
            return None
        user, data, card, until = (kept.get(k) for k in ("user", "data", "card", "until"))
        if not (isinstance(user, str) and isinstance(data, str) and isinstance(card, str)):
            return None
        if not isinstance(until, int | float) or isinstance(until, bool):
            return None
        return cls(user, data, card, float(until))


class _Notice:
    """The answer to a press: Matrix has no private message in a room, so a notice replies to the card and
    mentions the presser alone (``m.mentions``), which notifies them and nobody else."""

    def __init__(self, adapter: MatrixAdapter, room: str, card_event: str, user: str) -> None:
        self.adapter = adapter
        self.room = room
        self.card_event = card_event
        self.user = user

    async def acknowledge(self, text: str) -> None:
        return None  # the card, edited for everyone, says it

    async def notify(self, text: str) -> None:
        await self.adapter.notice(self.room, self.user, text, reply_to=self.card_event)


class MatrixAdapter(PlatformBase):
    """A :class:`~kazma.adapters.contract.PlatformAdapter` for one bot account on a Matrix homeserver."""

    name = PLATFORM
    # A card's post carries a transaction id made from the request and the room; the spec makes a send with the
    # same id from the same access token idempotent (Synapse keeps them a day), so a post tried again after a
    # crash or a lost answer gives the first event back instead of a second card.
    idempotent_posts = True

    def __init__(self, config: MatrixConfig, *, limiter: ChatRateLimiter | None = None, max_attempts: int = 5,
                 request_timeout: float = 10.0, poll_timeout: float = 25.0,
                 **options: Unpack[KitOptions]) -> None:  # fmt: skip
        # Homeservers limit messages per account (Synapse: a burst, then about one each few seconds); a gap
        # per room keeps a burst of cards from tripping it, and the 429s that still come are waited out.
        chosen = limiter or ChatRateLimiter(min_interval=0.5)
        super().__init__(config, pacing=Pacing(chosen, max_attempts=max_attempts), **options)
        self.config: MatrixConfig = config
        self.request_timeout = request_timeout
        self.poll_timeout = poll_timeout
        self.decision_wait = DECISION_WAIT_SECONDS
        self.card_read_tries = CARD_READ_TRIES
        self._card_read_failures = _Tries()  # card events whose reads failed and may pass (see above)
        self.upgrade_join_tries = UPGRADE_JOIN_TRIES
        self._join_failures = _Tries()  # rooms whose joins (an invite's, an upgrade's) failed and may pass
        self._prompt_failures = _Tries()  # "deny with reason" presses whose prompt the homeserver failed to take
        self._client: ClientAPI | None = None
        self.user_id = ""
        self._direct: set[str] = set()  # rooms that are direct chats of the bot's account (m.direct)
        self._direct_known = False  # whether m.direct was read (see _load_direct)
        # the bot's own events with choices: key -> data (least recently used first, see CHOICES_KEPT)
        self._choices: OrderedDict[_Where, dict[str, str]] = OrderedDict()
        # events seen redacted (a redaction in the sync, or a card read back so): no press on them counts, no edit goes
        self._redacted: OrderedDict[_Where, None] = OrderedDict()
        self._prompts: dict[_Where, _Prompt | None] = {}  # events read as reason prompts (None: no prompt), a cache
        self._others: dict[str, None] = {}  # events not the bot's own (an ordered set, see OTHERS_KEPT)
        self.reason_clock: Callable[[], float] = time.time  # a prompt's end is wall-clock time: any process reads it
        self._taking: dict[str, _Taking] = {}  # presses handed over, by key: the sync waits for their decision
        self._told_encrypted: set[str] = set()
        self._position: SyncPosition | None = None
        self._kept = Position("")  # where the sync stands: what was taken in, kept on the homeserver or to be
        self._syncing: asyncio.Task[None] | None = None
        self._sync_streak = InboundStreak("the sync")  # its failures in a row, for /healthz
        self._stop_sync = asyncio.Event()
        self._opening_direct = asyncio.Lock()  # two cards for one person at once open one direct room
        self._opened: dict[str, list[str]] = {}  # direct rooms this process opened, by person (see direct_chat)

    def classify(self, site: str, exc: BaseException) -> PlatformError:
        return classify(site, exc, timeout=self.request_timeout)

    @property
    def has_singleton_ingress(self) -> bool:
        return True

    @property
    def ingress_trouble(self) -> str | None:
        return self._sync_streak.trouble if self._syncing is not None else None

    # ----------------------------------------------------------------- lifecycle

    def _api(self, site: str) -> ClientAPI:
        if self._client is None:
            raise self.refuse(site, "the adapter is not started", retryable=True)
        return self._client

    def _can_send(self, site: str) -> None:
        self._api(site)

    async def _connect(self) -> None:
        client = make_client(self.config.homeserver, self.config.access_token, request_timeout=self.request_timeout)
        self._client = client
        try:
            async with asyncio.timeout(self.request_timeout):
                who = await client.whoami()
        except Exception as exc:
            raise self.classify("start", exc) from exc
        self.user_id = str(who.user_id)
        client.mxid = UserID(self.user_id)
        if self.config.user_id and self.config.user_id != self.user_id:
            raise self.refuse(
                "start",
                f"the access token is {self.user_id}'s, not {self.config.user_id}'s (platforms.matrix.user_id)",
            )
        self._position = SyncPosition(client)
        try:
            await self._load_direct(client)
        except Exception as exc:  # read before the sync takes anything in (see _take)
            self.failed("direct", None, self.classify("direct", exc))
        log.info("matrix.connected", user=self.user_id, rooms=sorted(self.served.chats))

    async def _open_ingress(self) -> None:
        client = self._api("ingress_start")
        position = self._position
        assert position is not None
        kept = await position.load()
        first: dict[str, Any] | None = None
        if kept is None:  # the first start: begin now, never answering the room's history
            first = await self._sync(client, None, timeout=0)
            kept = Position(str(first["next_batch"]))
            try:
                await self._begin(first)
                first = None
            except Exception as exc:  # tried again by the sync loop, before anything else
                self.failed("sync", None, self.classify("sync", exc))
        self._stop_sync = asyncio.Event()
        self._sync_streak = InboundStreak("the sync")
        self._syncing = asyncio.create_task(self._sync_loop(client, kept, first), name="matrix-sync")
        log.info("matrix.syncing", user=self.user_id, since=kept.since)

    async def _begin(self, first: dict[str, Any]) -> None:
        """Take the first sync ever: its invites (the only sync that shows an invite made before it), then keep
        where it ends. A join that fails for now raises before the position is kept, so it is tried again (in
        this process by the sync loop, else by the next start, which is a first one again)."""
        position = self._position
        assert position is not None
        await self._invites(first)
        await position.save(Position(str(first["next_batch"])))

    async def _close_ingress(self) -> None:
        """Stop syncing between two events. The one being taken in is waited for within the stop grace; one
        still not taken in then (a decision held up) is left before the kept position, for the next start."""
        self._stop_sync.set()
        task, self._syncing = self._syncing, None
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=self.stop_grace)
        if not done:
            task.cancel()
            await asyncio.wait({task})
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()

    async def _stop_receiving(self) -> None:
        await self._close_ingress()

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await close_client(client)

    # ----------------------------------------------------------------- the sync (singleton ingress)

    async def _sync(self, client: ClientAPI, since: str | None, *, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109 - the long poll's own
        query = {"timeout": str(int(timeout * 1000)), "filter": SYNC_FILTER}
        if since:
            query["since"] = since
        # The long poll is silent until something happens: bounded here, not by the transport's silence limit.
        async with asyncio.timeout(timeout + self.request_timeout):
            with long_poll():
                answer = await client.api.request(Method.GET, Path.v3.sync, query_params=query, retry_count=0)
        return dict(answer)

    async def _sync_loop(self, client: ClientAPI, kept: Position, first: dict[str, Any] | None = None) -> None:
        """Sync and take each batch in, backing off after a failure (``first``: the first sync ever, not yet
        taken, see :meth:`_begin`)."""
        self._kept = kept
        failures = 0
        while not self._stop_sync.is_set():
            try:
                if first is not None:
                    await self._begin(first)
                    first = None
                elif not await self._sync_once(client):
                    return
            except Exception as exc:  # the batch comes again, from what was kept of it
                failures += 1
                error = self.classify("sync", exc)
                self.failed("sync", None, error)
                self._sync_streak.failed(error)
                # Backing off, and never sooner than a 429 asked (its retry_after_ms).
                await until_set(self._stop_sync, max(min(2.0 ** min(failures, 5), 30.0), error.retry_after or 0.0))
                continue
            failures = 0

    async def _sync_once(self, client: ClientAPI) -> bool:
        """One long poll from the kept position, and its batch taken in; False when stopped during the poll
        (nothing of it was taken)."""
        asking = asyncio.create_task(self._sync(client, self._kept.since, timeout=self.poll_timeout))
        stopping = asyncio.create_task(self._stop_sync.wait())
        await asyncio.wait({asking, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not asking.done():
            asking.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asking
            return False
        batch = asking.result()
        self._sync_streak.succeeded()  # the homeserver answers again
        await self._take(await self._filled(client, batch, self._kept.since))
        return True

    async def _filled(self, client: ClientAPI, batch: dict[str, Any], since: str | None) -> dict[str, Any]:
        """``batch`` with each room's whole timeline since ``since``: a room whose timeline the homeserver cut
        short ("limited": more came than one sync holds, as after an outage) gets the events before the cut read
        back from ``/messages`` and put in front, so no message sent while Kazma was away is skipped. A first
        sync (no ``since``) is left as it is: a room's history is not a request."""
        if since is None:
            return batch
        for room, data in ((batch.get("rooms") or {}).get("join") or {}).items():
            timeline = (data or {}).get("timeline") or {}
            if not timeline.get("limited") or not timeline.get("prev_batch"):
                continue
            earlier = await self._read_back(client, str(room), str(timeline["prev_batch"]), since)
            timeline["events"] = [*earlier, *(timeline.get("events") or [])]
        return batch

    async def _read_back(self, client: ClientAPI, room: str, before: str, since: str) -> list[dict[str, Any]]:
        """The events of ``room`` between the sync token ``since`` and ``before``, oldest first (at most
        :data:`GAP_LIMIT`: the oldest beyond it are counted as lost). A failure raises: the batch comes again."""
        found: list[dict[str, Any]] = []
        page: str | None = before
        while page is not None:
            query = {"dir": "b", "from": page, "to": since, "limit": "100", "filter": _GAP_FILTER}
            answer = await client.api.request(Method.GET, Path.v3.rooms[RoomID(room)].messages, query_params=query)
            chunk = [e for e in answer.get("chunk") or [] if isinstance(e, dict)]
            found.extend(chunk)
            page = str(answer["end"]) if chunk and answer.get("end") else None
            if len(found) >= GAP_LIMIT and page is not None:
                count_failure("sync_gap", PLATFORM)
                log.error("matrix.sync_gap_cut", room=room, kept=len(found))
                break
        log.info("matrix.sync_gap_read", room=room, events=len(found))
        return found[::-1]

    async def _take(self, batch: dict[str, Any]) -> None:
        """Hand every new event of ``batch`` to the kit, one at a time in each room's order, keeping after each
        one is taken in where the sync stands (its room's mark); the next token once the batch is done.

        :attr:`_kept` moves past each event as it is passed, whether or not the homeserver keeps it now: the
        batch, should it come again in this process (a failure part-way), skips it; the next save that succeeds
        records it. Stopped part-way, the marks are kept and the rest of the batch comes at the next start."""
        position = self._position
        assert position is not None
        if not self._direct_known:  # else a direct room's messages would be taken for a group room's: raises
            await self._load_direct(self._api("direct"))
        await self._invites(batch)
        for room, events in _timelines(batch, self.user_id):
            for event in self._kept.after(room, events):
                if self._stop_sync.is_set():
                    await position.save(self._kept)  # with what was passed since the last event taken in
                    return
                handled = await self._event(room, event)
                self._kept = self._kept.passed(room, str(event.get("event_id", "")))
                if handled:
                    await position.save(self._kept)
        self._kept = Position(str(batch["next_batch"]))
        await position.save(self._kept)

    async def _invites(self, batch: dict[str, Any]) -> None:
        """Join the rooms Kazma serves when invited, and direct chats from people ``dm_policy`` allows. A join
        that may work later (a 5xx, no answer) raises, failing the batch; one the homeserver refuses is logged."""
        invites = (batch.get("rooms") or {}).get("invite") or {}
        for room, data in invites.items():
            states = ((data or {}).get("invite_state") or {}).get("events") or []
            # The invite itself is the last member event for the bot: the homeserver appends it to the stripped
            # state, which the inviting server supplies unchecked (a member event of its own making, "sent" by
            # anyone, may come before it). Taken from the front, a server inviting from someone dm_policy refuses
            # had the bot join as for someone it allows, and list the room as that person's direct room.
            mine: dict[str, Any] = next(
                (e for e in reversed(states) if isinstance(e, dict) and e.get("type") == "m.room.member"
                 and e.get("state_key") == self.user_id), {}
            )  # fmt: skip
            inviter = str(mine.get("sender", ""))
            direct = bool((mine.get("content") or {}).get("is_direct"))
            listed = room in self.served.chats or room == self.served.home
            if not listed and await self._upgrade_invited(str(room), states):
                continue
            if not (listed or (direct and self.direct.allows(self.actor(inviter)))):
                log.info("matrix.invite_ignored", room=room, inviter=inviter, direct=direct)
                continue
            client = self._api("join")
            try:
                await self.call("join", None, self._joiner(client, str(room)))
            except PlatformError as exc:
                if exc.retryable:  # the batch comes again with the invite in it: a sync shows an invite once
                    failed = self._join_failures.again(str(room), self.upgrade_join_tries)
                    if failed is None:
                        raise
                    # As many tries as an upgrade's join: one that never works held every room's later events
                    # behind this invite for ever. Passed by, said and counted: the room must invite the bot again.
                    count_failure("matrix_invite_join_failed", PLATFORM)
                    log.error("matrix.invite_join_failed", room=room, inviter=inviter, tries=failed, error=str(exc),
                              detail="invite the bot again once the room's server answers")  # fmt: skip
                    continue
                log.warning("matrix.join_refused", room=room, inviter=inviter, error=str(exc))
                continue
            self._join_failures.forget(str(room))
            if direct and not listed:
                await self._remember_direct(client, inviter, room)
            log.info("matrix.joined", room=room, inviter=inviter, direct=direct)

    @staticmethod
    def _joiner(client: ClientAPI, room: str) -> Callable[[], Awaitable[RoomID]]:
        return lambda: client.join_room_by_id(RoomID(room))

    async def _load_direct(self, client: ClientAPI) -> None:
        """Which rooms are direct chats (``m.direct``). Unread at the start (a 5xx, no answer), every direct room
        would have been taken for a group room until the next start: it is read again before each batch."""
        direct = await _direct_rooms(client)
        self._direct |= {str(room) for rooms in direct.values() for room in rooms}
        self._direct_known = True

    async def direct_chat(self, user: str) -> str:
        """The bot's direct room with ``user`` (a policy's DM card): the first one the account's ``m.direct``
        names for them that they are still in (or invited to), else a new private room with them invited,
        recorded there so every client and the next card find the same one."""
        client = self._api("card_dm")
        async with self._opening_direct:
            # A list that cannot be read fails the card's post (tried again): taken for "no direct rooms", it
            # opened a second room with the person each time, and the list written back lost everyone else's.
            current = await self.call("card_dm", None, lambda: _direct_rooms(client), paced=False)
            known = [str(room) for room in current.get(user, [])] or self._opened.get(user, [])
            for room in known:
                # The list keeps a room its person left (or whose invitation they declined): a card there is
                # seen by nobody who may decide it.
                if await self.call("card_dm", None, self._in_room(client, room, user), paced=False):
                    return room
            room = await self.call("card_dm", None, lambda: client.create_room(
                preset=RoomCreatePreset.TRUSTED_PRIVATE, is_direct=True, invitees=[UserID(user)]
            ))  # fmt: skip
            self._opened[user] = [str(room)]  # the next card finds it even if the list below is not written
            await self._remember_direct(client, user, str(room))
            log.info("matrix.direct_opened", room=str(room), user=user)
            return str(room)

    @staticmethod
    def _in_room(client: ClientAPI, room: str, user: str) -> Callable[[], Awaitable[bool]]:
        """Whether ``user`` is in ``room`` or invited to it; a room the bot itself is no longer in is nobody's."""

        async def present() -> bool:
            path = Path.v3.rooms[RoomID(room)].state["m.room.member"][user]
            try:
                member = await client.api.request(Method.GET, path)
            except (MNotFound, MForbidden):
                return False
            return member.get("membership") in ("join", "invite")

        return present

    async def _remember_direct(self, client: ClientAPI, user: str, room: str) -> None:
        """Add ``room`` to the account's direct rooms (``m.direct``), read first so that every other entry is kept:
        a list that cannot be read is not written (counted), never replaced by this one room."""
        self._direct.add(room)
        try:
            current = await _direct_rooms(client)
            rooms = [str(r) for r in current.get(user, [])]
            current[user] = [*rooms, room] if room not in rooms else rooms
            await client.set_account_data(DIRECT_TYPE, current)
        except Exception as exc:
            self.failed("direct", room, self.classify("direct", exc))

    async def _event(self, room: str, event: dict[str, Any]) -> bool:
        """One timeline event: True when it was handed to the kit (a message, a press, a reason) and taken in
        there, so the position may move past it (a process that ends before that takes it again at its start)."""
        etype = event.get("type")
        if etype in ("m.room.encrypted", "m.room.encryption"):
            await self._encrypted(room)
            return False
        if etype == "m.room.tombstone" and event.get("state_key") == "":
            await self._upgraded(room, event)
            return False
        if etype == "m.room.redaction":
            self._redaction(room, event)
            return False
        if event.get("sender") == self.user_id:
            return False  # our own posts: kept when sent
        reaction = reaction_of(event)
        if reaction is not None:
            return await self._reaction(room, reaction)
        content = event.get("content")
        replying = reply_target(content) if isinstance(content, dict) else None
        prompt = None if replying is None else await self._prompt_of(room, replying)
        if prompt is not None:
            return await self._reason_given(room, event, prompt)
        inbound = normalise(
            event,
            room,
            direct=room in self._direct,
            actor=self.actor,
            is_admin=self.is_admin,
            fetcher=self._fetcher,
        )
        if inbound is None:
            return False
        # Handed over and taken in (the door passed, the handler has it) before the sync moves past it.
        key = inbound.message_id
        await _ended(self.spawn(self.deliver(inbound, key=key), name=f"matrix-inbound-{key}"))
        return True

    async def _upgraded(self, room: str, event: dict[str, Any]) -> None:
        """A tombstone in a served room: the room may have been upgraded (a new room replaces it; the old one takes
        no more messages). Anyone with the power to send one may name any room, so the chat moves only once the
        replacement proves itself the old room's successor (see :meth:`_follow_upgrade`). Joining fails while the
        bot is not invited to an invite-only replacement: it is followed then at the invite."""
        content = event.get("content")
        replacement = content.get("replacement_room") if isinstance(content, dict) else None
        if not isinstance(replacement, str) or not replacement.startswith("!") or room not in self.served:
            return  # not ours, or moved already (which the replacement proved, joined)
        await self._follow_upgrade(room, replacement, str(event.get("event_id", "")), str(event.get("sender", "")))

    async def _follow_upgrade(self, room: str, replacement: str, tombstone: str, sender: str) -> None:
        """Join ``replacement``, then move the chat there only when its ``m.room.create`` names ``room`` as its
        predecessor, by the tombstone's own id where the room version lets it (Synapse's upgrade writes it). A
        room anyone made and named in a tombstone of their own is left again, the chat staying where it was:
        moved there, the bot posted every later card (a dangerous call and its arguments) in it, and its
        owner's presses decided them. Joined first because a room's create event is read by its members only."""
        client = self._api("join")
        try:
            await self.call("join", None, self._joiner(client, replacement))
        except PlatformError as exc:
            if exc.retryable:  # a 5xx, no answer: the batch comes again with the tombstone, and the join is tried again
                failed = self._join_failures.again(replacement, self.upgrade_join_tries)
                if failed is None:
                    raise
                # Up to upgrade_join_tries: a join that never works would hold every later event behind the
                # tombstone for ever. The chat stays where it is; the bot follows the upgrade at an invite.
                count_failure("matrix_upgrade_join_failed", PLATFORM)
                log.error("matrix.upgrade_join_failed", room=room, replacement=replacement, tries=failed,
                          error=str(exc), detail="invite the bot to the new room to move the chat there")  # fmt: skip
                return
            log.info("matrix.upgrade_join_waits_for_invite", room=room, replacement=replacement, error=str(exc))
            return
        self._join_failures.forget(replacement)
        try:
            create = await self.call("upgrade_check", None, self._create_event(client, replacement), paced=False)
        except PlatformError as exc:
            if exc.retryable:  # joined already: the batch comes again, the join is a no-op and the read tried again
                failed = self._join_failures.again(f"create {replacement}", self.upgrade_join_tries)
                if failed is None:
                    raise
            create = {}  # unreadable for good: not shown to be the successor
        self._join_failures.forget(f"create {replacement}")
        why = _not_successor(create, room, replacement, tombstone)
        if why is None:
            await self.chat_moved(room, replacement)
            log.info("matrix.joined", room=replacement, upgraded_from=room)
            return
        count_failure("matrix_upgrade_forged", PLATFORM)
        log.warning("matrix.upgrade_forged", room=room, replacement=replacement, sender=sender, why=why,
                    detail="the chat stays where it was")  # fmt: skip
        if replacement in self.served.chats or replacement == self.served.home or replacement in self._direct:
            return  # a room the bot serves anyway, named as the replacement: it stays, unmoved
        try:
            await self.call("leave", None, lambda: client.leave_room(RoomID(replacement)), paced=False)
        except PlatformError as exc:
            log.error("matrix.upgrade_forged_leave_failed", room=replacement, error=str(exc))
            return
        log.info("matrix.left", room=replacement, why="named by a tombstone it does not follow")

    @staticmethod
    def _create_event(client: ClientAPI, room: str) -> Callable[[], Awaitable[dict[str, Any]]]:
        async def read() -> dict[str, Any]:
            path = Path.v3.rooms[RoomID(room)].state["m.room.create"]
            return dict(await client.api.request(Method.GET, path, query_params={"format": "event"}))

        return read

    async def _upgrade_invited(self, room: str, states: list[Any]) -> bool:
        """An invite to the replacement of a served room (its invite state's create event names one as its
        predecessor, and that room's tombstone names this one): followed as the upgrade it may be, which checks
        the real create event once joined. True when it was one to follow."""
        creates = [e for e in states if isinstance(e, dict) and e.get("type") == "m.room.create"]
        predecessor = ((creates[-1].get("content") or {}).get("predecessor") or {}) if creates else {}
        old = predecessor.get("room_id") if isinstance(predecessor, dict) else None
        if not isinstance(old, str) or old not in self.served:
            return False
        client = self._api("join")
        path = Path.v3.rooms[RoomID(old)].state["m.room.tombstone"]

        async def tombstone() -> dict[str, Any] | None:
            try:
                return dict(await client.api.request(Method.GET, path, query_params={"format": "event"}))
            except MNotFound:
                return None

        try:
            found = await self.call("upgrade_check", None, tombstone, paced=False)
        except PlatformError as exc:
            # A 5xx, no answer: the batch comes again with the invite, a bounded number of times. Refused (the bot
            # no longer in the old room), or given up: no upgrade shown, so an invite like any other.
            if exc.retryable and self._join_failures.again(f"tombstone {room}", self.upgrade_join_tries) is None:
                raise
            log.warning("matrix.upgrade_unreadable", room=old, replacement=room, error=str(exc))
            return False
        self._join_failures.forget(f"tombstone {room}")
        if found is None or (found.get("content") or {}).get("replacement_room") != room:
            return False
        await self._follow_upgrade(old, room, str(found.get("event_id", "")), str(found.get("sender", "")))
        return True

    async def _encrypted(self, room: str) -> None:
        if room in self._told_encrypted or room not in self.served:
            return
        self._told_encrypted.add(room)
        count_failure("encrypted_room", PLATFORM)
        log.warning("matrix.encrypted_room", room=room)
        with contextlib.suppress(PlatformError):
            await self.send_text(room, ENCRYPTED_NOTICE)

    # ----------------------------------------------------------------- presses

    def _redaction(self, room: str, event: dict[str, Any]) -> None:
        """A redaction of one of the bot's cards (or questions) remembered with its choices: from now on a press on
        it counts as little as one read back after a restart does (its content, choices and all, is gone)."""
        content = event.get("content")
        target = event.get("redacts") or (content.get("redacts") if isinstance(content, dict) else None)
        if not isinstance(target, str):
            return
        where = (room, target)
        # Remembered whoever sent it: after a restart (or once forgotten) a card is not known as the bot's, yet an
        # edit of it must not carry again what the redaction removed (see _edit_card).
        self._remember_redacted(where)
        if not self._choices.get(where):
            return  # nothing of the bot's known here: a read of it later shows it redacted (see _own_event)
        del self._choices[where]
        log.info("matrix.card_redacted", room=room, card=target, by=str(event.get("sender", "")),
                 detail="presses on it no longer count; its request's other cards still stand")  # fmt: skip

    def _remember_redacted(self, where: _Where) -> None:
        self._redacted[where] = None
        self._redacted.move_to_end(where)
        while len(self._redacted) > CHOICES_KEPT:
            self._redacted.popitem(last=False)

    async def _choices_of(self, room: str, event_id: str) -> dict[str, str]:
        """Which key means which data on ``event_id``: only an event the bot itself sent has any.

        An event the homeserver says is not there (or not to be seen by the bot) is no card. A failure that may
        pass (a 5xx, no answer) raises: the batch is taken again from the kept position, so the reaction is read
        again rather than dropped (the homeserver would not take the same reaction from that person twice), up to
        :attr:`card_read_tries` times for one card; then the reaction is passed by, counted."""
        if (room, event_id) in self._redacted:
            return {}
        known = self._choices.get((room, event_id))
        if known is not None:
            self._choices.move_to_end((room, event_id))  # pressed: a card in use is the last forgotten
            return known
        content = await self._own_event(room, event_id, "press")
        if content is None or (room, event_id) in self._redacted:
            return {}
        found = _offered(content)
        self._remember_choices(room, event_id, found)
        return found

    def _remember_choices(self, room: str, event_id: str, choices: dict[str, str]) -> None:
        """Remember ``event_id``'s choices; past :data:`CHOICES_KEPT`, forget the least recently used: unbounded,
        the table held every card and question the bot ever posted (or anyone reacted to) until a restart."""
        self._choices[(room, event_id)] = choices
        self._choices.move_to_end((room, event_id))
        while len(self._choices) > CHOICES_KEPT:
            self._choices.popitem(last=False)

    async def _own_event(self, room: str, event_id: str, site: str) -> dict[str, Any] | None:
        """The content of ``event_id`` when the bot itself sent it, else None (an event the homeserver says is not
        there, or not to be seen by the bot, is nobody's). A failure that may pass raises, up to
        :attr:`card_read_tries` times for one event (see :meth:`_choices_of`); then None, counted."""
        if event_id in self._others:
            return None  # who sent an event never changes
        client = self._api(site)
        try:
            event = await self.call(
                site, None, lambda: client.api.request(Method.GET, Path.v3.rooms[room].event[event_id]), paced=False
            )
        except PlatformError as exc:
            if not exc.retryable:
                return None
            failed = self._card_read_failures.again(event_id, self.card_read_tries)
            if failed is None:
                raise
            # The press (or the reason) is lost, said and counted: its person can press again once the homeserver
            # serves the event.
            count_failure("matrix_press_card_unreadable", PLATFORM)
            log.error("matrix.press_card_unreadable", room=room, card=event_id, tries=failed, error=str(exc))
            return None
        self._card_read_failures.forget(event_id)
        if event.get("sender") != self.user_id:
            while len(self._others) >= OTHERS_KEPT:
                del self._others[next(iter(self._others))]
            self._others[event_id] = None
            return None
        if (event.get("unsigned") or {}).get("redacted_because"):
            self._remember_redacted((room, event_id))  # its content is gone: what it offered no longer stands
        content = event.get("content")
        return content if isinstance(content, dict) else {}

    async def _prompt_of(self, room: str, event_id: str) -> _Prompt | None:
        """The reason prompt ``event_id`` is, read from the prompt itself (the bot's own event), or None.

        The prompt carries what it asks (:data:`PROMPT_KEY`), so the process that posted it, the same one after a
        restart, or another replica reads a reply to it alike; nothing about it lives only in memory."""
        where = (room, event_id)
        if where in self._prompts:
            return self._prompts[where]
        if self._choices.get(where):
            # A card. Not any event of the bot's a reaction was read on: a prompt someone reacted to is remembered
            # there with no choices, and taken for a card its presser's reply was chat for the agents, not a reason.
            return None
        content = await self._own_event(room, event_id, "press")
        prompt = None if content is None else _Prompt.of(content.get(PROMPT_KEY))
        while len(self._prompts) >= PROMPTS_KEPT:
            del self._prompts[next(iter(self._prompts))]
        self._prompts[where] = prompt
        return prompt

    async def _reaction(self, room: str, reaction: Reaction) -> bool:
        data = (await self._choices_of(room, reaction.target)).get(same_key(reaction.key))
        if (room, reaction.target) in self._redacted:
            # Alike whether the card was remembered when it was redacted or read back after a restart: before,
            # a press counted while the card was remembered and was passed by unsaid once it was read back.
            log.info("matrix.press_on_redacted_card", room=room, card=reaction.target, key=reaction.key,
                     actor=self.actor(reaction.sender), detail="not counted: the card was redacted")  # fmt: skip
            return False
        if data is None:
            return False  # a reaction to anything else, or with another key: people react freely
        asked = reason_request(data)
        if asked is not None:  # taken in once the prompt is out
            asking = self.spawn(self._ask_reason(room, reaction, asked), name=f"matrix-reason-{reaction.event_id}",
                                awaited=True)  # fmt: skip
            await _ended(asking)
            failure = None if asking.cancelled() else asking.exception()
            if failure is not None:
                raise failure  # a prompt the homeserver may take later: the batch comes again (see _ask_reason)
            return True
        press = Press(
            platform=PLATFORM,
            data=data,
            actor=self.actor(reaction.sender),
            chat=room,
            message_id=reaction.target,
            is_admin=self.is_admin(reaction.sender),
        )
        await self._hand_over(press, _Notice(self, room, reaction.target, reaction.sender), reaction.event_id)
        return True

    async def _hand_over(self, press: Press, reply: _Notice, key: str) -> None:
        """Hand ``press`` to the press policy (tracked work) and return once it is taken in: its decision ended,
        however long after the policy's own answer (a decision slower than ``press_timeout`` is answered
        "recorded, updating" and goes on), or the policy answered it without one. Cancelled (the sync cut
        off), the press goes on; only the position stays before it."""
        taking = _Taking(asyncio.get_running_loop().create_future())
        self._taking[key] = taking
        try:
            pressing = self.spawn(self.press(press, reply, key=key), name=f"matrix-press-{key}")
            await asyncio.wait({pressing, taking.decided}, return_when=asyncio.FIRST_COMPLETED)
            if taking.deciding and not taking.decided.done():
                await asyncio.wait({taking.decided}, timeout=self.decision_wait)
                if not taking.decided.done():
                    count_failure("matrix_press_slow", "matrix")
                    log.warning(
                        "matrix.press_slow",
                        key=key,
                        waited=self.decision_wait,
                        detail="the sync goes on; the press is still being decided and its presser told",
                    )
        finally:
            self._taking.pop(key, None)

    async def _decide(self, handlers: Handlers, press: Press, key: str | None, reply: PressReply) -> PressResult:
        """The press policy's decision, and :meth:`_hand_over` told when it ends (however it ends)."""
        taking = None if key is None else self._taking.get(key)
        if taking is not None:
            taking.deciding = True
        try:
            return await super()._decide(handlers, press, key, reply)
        finally:
            if taking is not None and not taking.decided.done():
                taking.decided.set_result(None)

    async def _ask_reason(self, room: str, reaction: Reaction, request_id: str) -> None:
        """ "Deny with reason": a prompt replying to the card, answered by a reply from the presser alone."""
        refusal = await self._reason_refusal(self.actor(reaction.sender), request_id)
        if refusal is not None:
            # Said as a refused press is, in one line: no prompt that waits for words nobody can give, and none for
            # a request decided already.
            with contextlib.suppress(PlatformError):
                await self.notice(room, reaction.sender, refusal, reply_to=reaction.target)
            return
        prompt = _Prompt(reaction.sender, deny_data(request_id), reaction.target,
                         self.reason_clock() + REPLY_WINDOW_SECONDS)  # fmt: skip
        again = self._prompt_failures.tried(reaction.event_id)
        # One transaction per press: a prompt tried again after a lost answer is the same event, not a second one.
        txn = f"kazma-prompt-{_short(reaction.event_id)}"
        try:
            posted = await self.notice(room, reaction.sender, reply_prompt(request_id, reaction.sender),
                                       reply_to=reaction.target, extra={PROMPT_KEY: prompt.content()},
                                       txn=txn)  # fmt: skip
        except PlatformError as exc:
            if not exc.retryable:
                return
            failed = self._prompt_failures.again(reaction.event_id, self.card_read_tries)
            if failed is None:
                # The batch comes again with the 💬: passed by, the press was lost unsaid (the homeserver would not
                # take the same reaction from its presser twice, and nothing showed that it had done nothing).
                raise
            count_failure("matrix_reason_prompt_failed", PLATFORM)
            log.error("matrix.reason_prompt_failed", room=room, card=reaction.target, tries=failed, error=str(exc))
            return
        self._prompt_failures.forget(reaction.event_id)
        if not again:  # else the prompt may be an earlier try's, whose window the event itself says
            self._prompts[(room, posted)] = prompt

    async def _reason_given(self, room: str, event: dict[str, Any], prompt: _Prompt) -> bool:
        """A reply to a reason prompt, never chat for the agents: the presser's words in time deny the request
        through the one press policy; their late words are refused, told; anybody else's are passed by."""
        sender = str(event.get("sender", ""))
        if sender != prompt.user:
            return False
        if _said_at(event, self.reason_clock()) > prompt.until:
            log.info("matrix.reason_reply_refused", actor=self.actor(sender), data=prompt.data, why="expired")
            with contextlib.suppress(PlatformError):
                await self.notice(room, sender, PROMPT_EXPIRED, reply_to=str(event.get("event_id", "")) or None)
            return False
        content = event.get("content")
        reason = reply_words(content) if isinstance(content, dict) else ""
        if not reason:
            # A picture or a file alone was the reason "IMG_0001.jpg" (its name), and an empty reply a bare Deny:
            # as on Telegram, a reason is words, and the prompt stands for a reply with them.
            log.info("matrix.reason_reply_refused", actor=self.actor(sender), data=prompt.data, why="no words")
            with contextlib.suppress(PlatformError):
                await self.notice(room, sender, PROMPT_NO_WORDS, reply_to=str(event.get("event_id", "")) or None)
            return False
        card = prompt.card
        press = Press(PLATFORM, prompt.data, self.actor(sender), room, card, self.is_admin(sender), reason=reason)
        await self._hand_over(press, _Notice(self, room, card, sender), str(event.get("event_id", "")))
        return True

    async def notice(
        self,
        room: str,
        user: str,
        text: str,
        *,
        reply_to: str | None = None,
        extra: dict[str, Any] | None = None,
        txn: str | None = None,
    ) -> str:
        """An ``m.notice`` in ``room`` that mentions ``user`` alone (they are notified, nobody else); its id."""
        client = self._api("press_reply")
        pill = f'<a href="https://matrix.to/#/{quote(user)}">{_escape(user)}</a>'
        content: dict[str, Any] = {
            "msgtype": "m.notice",
            "body": f"{user}: {text}",
            "format": "org.matrix.custom.html",
            "formatted_body": f"{pill}: {_escape(text)}",
            "m.mentions": {"user_ids": [user]},
        }
        if reply_to:
            content["m.relates_to"] = {"m.in_reply_to": {"event_id": reply_to}}
        content.update(extra or {})
        return await self.call("press_reply", room, lambda: self._send(client, room, content, txn=txn), paced=False)

    # ----------------------------------------------------------------- files in

    def _fetcher(self, mxc: str) -> Callable[[], Awaitable[bytes]]:
        async def fetch() -> bytes:
            client = self._api("file_fetch")
            found = media_of(mxc)
            if found is None:  # never offered as a file (attachment_of): a path out of the media API, refused here too
                raise self.refuse("file_fetch", "the file's address is not a media address")
            server, media = found
            where = f"{quote(server, safe='')}/{quote(media, safe='')}"
            url = f"{self.config.homeserver}/_matrix/client/v1/media/download/{where}"
            limit = self.files.max_bytes + 1  # one byte more than allowed is enough to refuse it

            async def download() -> bytes:
                headers = {"Authorization": f"Bearer {self.config.access_token}"}
                async with client.api.session.get(url, headers=headers) as got:
                    if got.status >= 300:
                        # 401: the access token refused (the operator's to fix); 404: the media is gone.
                        raise PlatformError(PLATFORM, "file_fetch", f"HTTP {got.status}", retryable=got.status >= 500,
                                            operator_must_act=got.status == 401)  # fmt: skip
                    return await read_up_to(got.content, limit)

            return await self.call("file_fetch", None, download, paced=False)

        return fetch

    # ----------------------------------------------------------------- outbound

    async def _send(self, client: ClientAPI, room: str, content: dict[str, Any], *, txn: str | None = None,
                    event_type: str = "m.room.message") -> str:  # fmt: skip
        path = Path.v3.rooms[RoomID(room)].send[event_type][txn or client.api.get_txn_id()]
        answer = await client.api.request(Method.PUT, path, content)
        return str(answer["event_id"])

    def _text_room(self, agent: str | None) -> tuple[int, Callable[[str], int] | None]:
        return TEXT_LIMIT - sum(json_units(c) for c in agent_prefix(agent)), json_units

    async def _post_text(self, chat: str, part: str, *, agent: str | None, thread: str | None) -> Posted:
        client = self._api("send")
        content = message_content(agent_prefix(agent) + part, None, (), notice=False)
        _in_thread(content, thread)
        event_id = await self.call("send", chat, lambda: self._send(client, chat, content))
        return Posted(chat, event_id)

    async def _post_choices(
        self, chat: str, body: str, choices: Sequence[tuple[str, str]], *, thread: str | None
    ) -> str:
        client = self._api("send")
        made = question_choices(list(choices))
        if len(made) < len(choices):
            raise self.refuse("send", f"a question offers at most {len(made)} choices here", chat=chat)
        said = legend(made)
        content = message_content(f"{body}\n{said}" if said else body, None, made, notice=False)
        _in_thread(content, thread)
        event_id = await self.call("send", chat, lambda: self._send(client, chat, content))
        self._remember_choices(chat, event_id, {same_key(c.key): c.data for c in made})
        self.spawn(self._offer(client, chat, event_id, made), name=f"matrix-offer-{event_id}")
        return event_id

    async def _offer(self, client: ClientAPI, chat: str, event_id: str, choices: tuple[Choice, ...]) -> None:
        """React with each choice, so a person presses by clicking the reaction (a courtesy: a failure here
        leaves the legend, and any client can add the reaction itself)."""
        for choice in choices:
            relates = {"m.relates_to": {"rel_type": "m.annotation", "event_id": event_id, "key": choice.key}}
            try:
                await self.call("offer", chat, self._sender(client, chat, relates, event_type="m.reaction"))
            except PlatformError:
                return

    def _sender(
        self, client: ClientAPI, chat: str, content: dict[str, Any], *, event_type: str = "m.room.message"
    ) -> Callable[[], Awaitable[str]]:
        return lambda: self._send(client, chat, content, event_type=event_type)

    async def _post_file(self, chat: str, name: str, data: bytes, *, caption: str, thread: str | None) -> str:
        site = "send_file"
        client = self._api(site)
        mxc = await self.call(
            site, chat, lambda: client.upload_media(data, mime_type="application/octet-stream", filename=name)
        )
        content: dict[str, Any] = {
            "msgtype": "m.file",
            "body": caption,
            "filename": name,
            "url": str(mxc),
            "info": {"size": len(data), "mimetype": "application/octet-stream"},
            "m.mentions": {},
        }
        _in_thread(content, thread)
        return await self.call(site, chat, lambda: self._send(client, chat, content))

    async def _show_working(self, chat: str, thread: str | None) -> None:
        client = self._api("working")
        path = Path.v3.rooms[RoomID(chat)].typing[UserID(self.user_id)]
        typing = {"typing": True, "timeout": TYPING_MS}
        await self.call("working", chat, lambda: client.api.request(Method.PUT, path, typing), paced=False)

    def _write_card(self, card: ApprovalCard, outcome: Outcome | None) -> LaidOut[Any]:
        return render_card(card, outcome=outcome, approve_partial=self.approve_partial)

    async def _post_card(self, chat: str, laid: LaidOut[Any], card: ApprovalCard) -> Posted:
        client = self._api("card_post")
        written: MatrixCard = laid.written
        # One transaction id per card and room: a post tried again (a lost answer) is the same event.
        txn = f"kazma-card-{card.request_id}-{_short(chat)}"
        event_id = await self.call("card_post", chat, lambda: self._send(client, chat, written.content(), txn=txn))
        self._remember_choices(chat, event_id, {same_key(c.key): c.data for c in written.choices})
        # After the post, not inside it: the card is out once it is posted, and the reactions follow it.
        self.spawn(self._offer(client, chat, event_id, written.choices), name=f"matrix-offer-{event_id}")
        return Posted(chat, event_id)

    async def _edit_card(
        self, site: str, ref: CardRef, laid: LaidOut[Any], card: ApprovalCard, *, settled: bool
    ) -> bool:
        where = (ref.chat, ref.message_id)
        if settled and where not in self._choices and where not in self._redacted:
            # Not known either way (a restart, or forgotten): one read tells. Only for a settle, which comes once
            # per card; a progress edit goes by what the sync showed.
            await self._read_card(site, ref)
        if where in self._redacted:
            # A moderator removed it (what it showed, perhaps): an edit carries the whole card again and would
            # publish anew what was removed. Nothing to show on it; the request's other cards are edited.
            log.info("matrix.edit_skipped_redacted", room=ref.chat, card=ref.message_id, settled=settled,
                     request_id=card.request_id, detail="redacted: an edit would show it again")  # fmt: skip
            return False
        if settled and where in self._choices:
            # Its request is decided: a press on it only learns so, and a read of the card finds it again.
            self._choices.move_to_end(where, last=False)
        client = self._api(site)
        written: MatrixCard = laid.written
        content = edit_content(written, laid.view, ref.message_id)
        newest = await self.call(site, ref.chat, lambda: self._newest_edit(client, ref), paced=False)
        if newest is not None and newest[1] == content["m.new_content"]:
            return False  # shows this already: a settle repeated (after a lost answer, a restart) edits nothing
        # The transaction names what the edit goes over as well as what it says: the same edit tried again (its
        # answer lost) is one event, yet the same words again over another edit (the outcome again after a
        # progress edit landed on it) are a new edit. Named by its words alone, the homeserver answered that
        # one with the first settle's event and the card went on showing the progress, with its buttons.
        over = "unknown" if newest is None else newest[0]
        words = _short(json.dumps(content["m.new_content"], sort_keys=True))
        txn = f"kazma-edit-{_short(ref.message_id)}-{words}-{_short(over)}"
        await self.call(site, ref.chat, lambda: self._send(client, ref.chat, content, txn=txn))
        return True

    async def _read_card(self, site: str, ref: CardRef) -> None:
        """Read the card ``ref`` back: remembered as redacted when it was, else with its choices (so the next edit
        or press reads nothing). A failure raises: the edit is tried again as one that failed."""
        client = self._api(site)
        path = Path.v3.rooms[RoomID(ref.chat)].event[ref.message_id]
        event = await self.call(site, ref.chat, lambda: client.api.request(Method.GET, path), paced=False)
        where = (ref.chat, ref.message_id)
        if (event.get("unsigned") or {}).get("redacted_because"):
            self._remember_redacted(where)
        elif event.get("sender") == self.user_id:
            content = event.get("content")
            self._remember_choices(ref.chat, ref.message_id, _offered(content if isinstance(content, dict) else {}))

    async def _newest_edit(self, client: ClientAPI, ref: CardRef) -> tuple[str, dict[str, Any]] | None:
        """The card's newest edit by the bot (its id and what it shows), ``("", {})`` when it has none; None when
        that cannot be told (more edits by others than one page holds: anyone may relate an edit to any event,
        and clients show only the sender's own)."""
        path = Path.v1.rooms[RoomID(ref.chat)].relations[ref.message_id]["m.replace"]
        query = {"dir": "b", "limit": str(EDITS_PAGE)}
        answer = await client.api.request(Method.GET, path, query_params=query)
        chunk = [e for e in answer.get("chunk") or [] if isinstance(e, dict)]
        for event in chunk:
            shown = (event.get("content") or {}).get("m.new_content")
            if event.get("sender") == self.user_id and isinstance(shown, dict):
                return str(event.get("event_id", "")), shown
        return None if answer.get("next_batch") else ("", {})


@dataclass
class _Taking:
    """A press handed to the press policy, as the sync waits for it: whether its decision began, and its end."""

    decided: asyncio.Future[None]
    deciding: bool = False


async def _direct_rooms(client: ClientAPI) -> dict[str, Any]:
    """The account's direct rooms by person (``m.direct``); empty when it has none yet. Any other failure raises:
    an unreadable list is not an empty one."""
    try:
        return dict(await client.get_account_data(DIRECT_TYPE))
    except MNotFound:
        return {}


async def _ended(task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` to end without ending it when this wait is cancelled (tracked work goes on)."""
    await asyncio.wait({task})


def _said_at(event: dict[str, Any], now: float) -> float:
    """When ``event`` was sent, as its homeserver stamped it (``origin_server_ts``), else ``now``. A reply is read
    from the kept sync position, perhaps long after it was sent (a restart, an outage, the sync held by a slow
    press): judged by the time it was read, a reason given in time was refused "expired" and the presser, told to
    press again, found the card still pending. Never later than ``now``, so a homeserver clock ahead of Kazma's
    does not shorten the window."""
    sent = event.get("origin_server_ts")
    if isinstance(sent, int) and not isinstance(sent, bool) and sent > 0:
        return min(sent / 1000.0, now)
    return now


def _not_successor(create: dict[str, Any], old: str, room: str, tombstone: str) -> str | None:
    """Why ``create`` (``room``'s create event) does not make ``room`` the successor of ``old`` by the tombstone
    ``tombstone``; None when it does. Synapse's upgrade names the old room and the tombstone's id; a room whose id is
    its create event's hash (room version 12 on) is made before the tombstone, so it names the old room alone.
    Anyone may name an old room in a room of their own; the tombstone's id is known only once the tombstone is sent,
    after the room it names was made."""
    content = create.get("content")
    predecessor = content.get("predecessor") if isinstance(content, dict) else None
    if not isinstance(predecessor, dict) or predecessor.get("room_id") != old:
        return "the new room does not name this one as its predecessor"
    named = predecessor.get("event_id")
    if named is None:
        made_first = str(create.get("event_id", "")).removeprefix("$") == room.removeprefix("!")
        return None if made_first else "the new room does not name the tombstone"
    return None if named == tombstone else "the new room names another event than the tombstone"


def _offered(content: dict[str, Any]) -> dict[str, str]:
    """Which key means which data on a card or question of the bot's, by its content."""
    listed = content.get(CHOICES_KEY)
    return {
        same_key(str(c["key"])): str(c["data"])
        for c in (listed if isinstance(listed, list) else [])
        if isinstance(c, dict) and "key" in c and "data" in c
    }


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _in_thread(content: dict[str, Any], thread: str | None) -> None:
    if thread:
        content["m.relates_to"] = {"rel_type": "m.thread", "event_id": thread, "is_falling_back": True}


def _timelines(batch: dict[str, Any], me: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each joined room's new events, in order; in a room just joined, only what came after the bot's join (a
    room's history is not a request to Kazma)."""
    found = []
    for room, data in ((batch.get("rooms") or {}).get("join") or {}).items():
        events = [e for e in ((data or {}).get("timeline") or {}).get("events") or [] if isinstance(e, dict)]
        state = [e for e in ((data or {}).get("state") or {}).get("events") or [] if isinstance(e, dict)]
        for index, event in enumerate(events):
            joined = event.get("type") == "m.room.member" and event.get("state_key") == me
            before = ((event.get("unsigned") or {}).get("prev_content") or {}).get("membership")
            if joined and (event.get("content") or {}).get("membership") == "join" and before != "join":
                events = events[index + 1 :]
                break
        found.append((str(room), [*(e for e in state if e.get("type") == "m.room.encryption"), *events]))
    return found
