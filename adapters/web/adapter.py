"""The web console as a platform: conversations, cards and presses behind the same bus contract.

The adapter holds the console's state (messages, cards) and pushes every change
to subscribers; the web server in ``kazma.bot`` renders it and forwards what a
logged-in person does. Decisions made here are recorded as ``web:<login>``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from kazma.adapters.admission import FileBounds
from kazma.adapters.card_layout import view_of
from kazma.adapters.chat_text import plain_mentions
from kazma.adapters.contract import Attachment, CardRef, Handlers, Inbound, PlatformError, Press, refuse_elsewhere
from kazma.adapters.human_text import for_humans
from kazma.adapters.ingress import Arrival, Check, Ingress, Stopped, files_within
from kazma.adapters.kit import TYPING_INTERVAL
from kazma.approvals.card import ApprovalCard, button_data
from kazma.approvals.honesty import reveal_line
from kazma.approvals.model import Decision, Outcome, PressResult
from kazma.config.address import Actor, Address
from kazma.config.outgoing import Outgoing

log = structlog.get_logger("kazma.adapters.web")

CONSOLE = "console"
# What an upload the server read is held to when no bounds were given (the server reads within ``files:``).
READ_BY_THE_SERVER = FileBounds(max_bytes=2**63 - 1, max_count=2**31 - 1)


@dataclass
class WebMessage:
    id: str
    chat: str
    author: str  # "agent:<name>" or "web:<login>"
    name: str
    text: str
    at: float
    card: ApprovalCard | None = None
    outcome: Outcome | None = None
    choices: tuple[tuple[str, str], ...] = ()  # a question's (label, button data)
    question: bool = False  # a question to a person: answered by a reply (or a choice)
    reply_to: str | None = None
    file: tuple[str, int] | None = None  # a posted file: (name, size); its bytes are kept by the adapter

    def as_event(self) -> dict[str, Any]:
        event: dict[str, Any] = {
            "id": self.id,
            "chat": self.chat,
            "author": self.author,
            "name": self.name,
            "text": self.text,
            "at": self.at,
            "choices": [label for label, _ in self.choices],
            "question": self.question,
            "reply_to": self.reply_to,
            "file": None if self.file is None else {"name": self.file[0], "size": self.file[1]},
        }
        if self.card is not None:
            event["card"] = {
                "request_id": self.card.request_id,
                "title": self.card.title,
                "tool": self.card.tool,
                "requester": self.card.requester,
                "origin": self.card.origin,
                "hash": self.card.args_hash,
                "link": self.card.link,
                "deadline": self.card.deadline.isoformat(),
                "arguments": [
                    {
                        "name": a.name,
                        "head": a.head,
                        "tail": a.tail,
                        "cut": a.cut,
                        "original_length": a.original_length,
                    }
                    for a in self.card.arguments
                ],
                "outcome": None if self.outcome is None else reveal_line(self.outcome.summary()),
                "status": None if self.outcome is None else self.outcome.status.value,
            }
        return event


@dataclass
class WebAdapter:
    """Platform ``web``. Keeps the newest ``history`` messages per process (the store keeps the audit)."""

    history: int = 500
    name: str = "web"
    max_files: int = 50  # files kept for download (in memory, newest first out last)
    typing_interval: float = TYPING_INTERVAL
    _files: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    _typing_at: dict[str, float] = field(default_factory=dict)
    _messages: deque[WebMessage] = field(default_factory=deque)
    _by_id: dict[str, WebMessage] = field(default_factory=dict)
    _subscribers: set[asyncio.Queue[dict[str, Any]]] = field(default_factory=set)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _handlers: Handlers | None = None
    files: FileBounds | None = None  # ``files:``; None: what the server read (it reads within them) is taken

    def __post_init__(self) -> None:
        self.door = Ingress(self.door_checks())

    def door_checks(self) -> list[Check]:
        """The console's door: the kit's checks that apply to it. A person here is signed in (the server's
        part); the console serves its own chats and has no servers, replays or replicas to race."""
        return [files_within(lambda: self.files or READ_BY_THE_SERVER)]

    @property
    def home_chat(self) -> str | None:
        return CONSOLE

    @property
    def started(self) -> bool:
        return self._handlers is not None

    async def start(self, handlers: Handlers) -> None:
        self._handlers = handlers

    async def stop(self) -> None:
        self._handlers = None
        for queue in list(self._subscribers):
            queue.put_nowait({"type": "closed"})

    # -- what the server shows -------------------------------------------------------------------

    def messages(self, chat: str = CONSOLE) -> list[WebMessage]:
        return [m for m in self._messages if m.chat == chat]

    def message(self, message_id: str) -> WebMessage | None:
        return self._by_id.get(message_id)

    def card_message(self, request_id: str) -> WebMessage | None:
        return next((m for m in self._messages if m.card and m.card.request_id == request_id), None)

    async def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        """Every change from now on, as events; ends when the adapter stops."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)
        self._subscribers.add(queue)
        try:
            while True:
                event = await queue.get()
                if event.get("type") == "closed":
                    return
                yield event
        finally:
            self._subscribers.discard(queue)

    def _publish(self, kind: str, message: WebMessage) -> None:
        self._emit({"type": kind, "message": message.as_event()})

    def _emit(self, event: dict[str, Any]) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:  # a stalled browser loses live updates, not the page
                log.warning("web.subscriber_dropped")
                self._subscribers.discard(queue)

    def _add(self, message: WebMessage) -> None:
        self._messages.append(message)
        self._by_id[message.id] = message
        while len(self._messages) > self.history:
            old = self._messages.popleft()
            self._by_id.pop(old.id, None)
        self._publish("message", message)

    # -- what a person does ----------------------------------------------------------------------

    async def say(
        self,
        login: str,
        text: str,
        *,
        chat: str = CONSOLE,
        reply_to: str | None = None,
        is_admin: bool = False,
        attachments: tuple[Attachment, ...] = (),
    ) -> str:
        """A logged-in person writes into the console; it reaches the agents like any platform message.

        ``attachments``: files sent with it (already within ``files:``'s bounds); the engine saves them into the
        conversation's workspace, as it does for every platform. The console shows their names under the text.
        """
        if self._handlers is None:
            raise PlatformError("web", "inbound", "the web console is not started", retryable=True)
        message_id = str(next(self._ids))
        inbound = Inbound(
            platform="web",
            chat=chat,
            message_id=message_id,
            author=str(Actor("web", login)),
            author_name=login,
            text=text,
            mentions=plain_mentions(text),  # the chat platforms' rule: a code span or an address is no call
            reply_to=reply_to,
            is_admin=is_admin,
            attachments=attachments,
        )
        admitted = await self.door.admit(Arrival(self.name, inbound))
        if isinstance(admitted, Stopped) or admitted.inbound is None:
            reason = admitted.reply or admitted.reason if isinstance(admitted, Stopped) else "not read"
            log.info("platform.inbound_ignored", platform=self.name, chat=chat, reason=reason)
            raise PlatformError("web", "inbound", reason, retryable=False)
        shown = "\n".join([text, *(f"📎 {a.name} ({a.size or 0:,} bytes)" for a in attachments)]).strip()
        message = WebMessage(message_id, chat, str(Actor("web", login)), login, shown, time.time(), reply_to=reply_to)
        self._add(message)
        await self._handlers.on_inbound(admitted.inbound)
        return message.id

    async def press(self, request_id: str, decision: Decision, login: str) -> PressResult:
        """Approve or Deny on a web card: the same path as every platform's buttons."""
        if self._handlers is None:
            raise PlatformError("web", "press", "the web console is not started", retryable=True)
        card = self.card_message(request_id)
        return await self._handlers.on_press(
            Press(
                platform=self.name,
                data=button_data(request_id, decision),
                actor=str(Actor("web", login)),
                chat=card.chat if card is not None else None,
                message_id=card.id if card is not None else None,
            )
        )

    # -- PlatformAdapter -------------------------------------------------------------------------

    async def send(self, to: Address, message: Outgoing) -> str:
        """A message in a console chat: an agent's text (fences meant for models made quiet), a question with its
        choices, or a file (:meth:`send_file`)."""
        refuse_elsewhere(self.name, to)
        if message.file is not None:
            return await self.send_file(to.chat, message.file.name, message.file.data, agent=message.agent)
        who = message.agent or "kazma"
        text = message.text if message.choices else for_humans(message.text)
        posted = WebMessage(
            str(next(self._ids)), to.chat, f"agent:{who}", who, text, time.time(),
            choices=message.choices, question=bool(message.choices),
        )  # fmt: skip
        self._add(posted)
        return posted.id

    async def send_file(
        self, chat: str, name: str, data: bytes, *, agent: str | None = None, thread: str | None = None
    ) -> str:
        """A file an agent posts: a message with a download link; the newest ``max_files`` are kept."""
        message = WebMessage(
            str(next(self._ids)), chat, f"agent:{agent or 'kazma'}", agent or "kazma", name, time.time(),
            file=(name, len(data)),
        )  # fmt: skip
        self._files[message.id] = (name, data)
        while len(self._files) > self.max_files:
            self._files.pop(next(iter(self._files)))
        self._add(message)
        return message.id

    def file(self, message_id: str) -> tuple[str, bytes] | None:
        """A posted file's name and bytes, while it is kept."""
        return self._files.get(message_id)

    async def working(self, chat: str, *, thread: str | None = None) -> bool:
        """The console's own sign: a ``working`` event, at most once per ``typing_interval`` per chat."""
        now = time.monotonic()
        last = self._typing_at.get(chat)
        if last is not None and now - last < self.typing_interval:
            return False
        self._typing_at[chat] = now
        self._emit({"type": "working", "chat": chat, "conversation": Address(self.name, chat).conversation})
        return True

    async def choose(self, message_id: str, choice: int, login: str, *, is_admin: bool = False) -> PressResult:
        """A person presses one of a question's choices in the console."""
        if self._handlers is None:
            raise PlatformError("web", "press", "the web console is not started", retryable=True)
        message = self._by_id.get(message_id)
        if message is None or not 0 <= choice < len(message.choices):
            raise PlatformError("web", "press", "no such choice", retryable=False)
        return await self._handlers.on_press(
            Press(self.name, message.choices[choice][1], str(Actor("web", login)), message.chat, message.id, is_admin)
        )

    async def post_card(self, card: ApprovalCard) -> CardRef:
        message = WebMessage(
            str(next(self._ids)), CONSOLE, card.requester, card.requester, card.title, time.time(), card
        )
        self._add(message)
        return CardRef(self.name, CONSOLE, message.id, whole=view_of(card).whole)

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        message = self._by_id.get(ref.message_id)
        if message is None:
            # restarted since the card was posted: the console starts empty, nothing left to edit
            return
        message.outcome = outcome
        self._publish("settled", message)
