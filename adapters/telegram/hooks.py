"""The python-telegram-bot extension points Kazma plugs into: the poller's HTTP client (keeps what
``getUpdates`` returns before PTB confirms it), the rate-limiter hook (the shared pacing for every send and
edit), and the one reply a press gets (``answerCallbackQuery``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any, Final

import structlog
from telegram import CallbackQuery
from telegram.error import NetworkError, RetryAfter
from telegram.ext import BaseRateLimiter

from kazma.adapters import call_note
from kazma.adapters.pacing import Pacing
from kazma.adapters.telegram.errors import PLATFORM, retry_after_seconds
from kazma.adapters.telegram.render import ANSWER_LIMIT
from kazma.adapters.telegram.transport import AiohttpRequest, described
from kazma.config.metrics import count_failure

# Calls that post into a chat: these share the chat's send budget. Answers to button presses must be quick
# and getUpdates is never limited by PTB. A chat action posts nothing: it must not spend the group's 20
# messages a minute (the kit already shows it at most once per few seconds per chat).
_PACED_ENDPOINTS: Final = frozenset({"sendMessage", "editMessageText", "sendDocument", "sendPhoto"})
_URGENT_ENDPOINTS: Final = frozenset({"editMessageText"})

log = structlog.get_logger("kazma.adapters.telegram")

# Set while a streamed reply is edited: such an edit waits its turn like a post (only card edits go first), and
# as a draft: the group's per-minute budget keeps room for cards and new messages (ChatRateLimiter.drafts_leave).
streamed_edit: ContextVar[bool] = ContextVar("kazma_telegram_streamed_edit", default=False)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _retry_after_of(exc: BaseException) -> float | None:
    if not isinstance(exc, RetryAfter):
        return None
    wait = retry_after_seconds(exc)
    call_note.answered(
        f"Telegram answered flood control: {exc}", wait
    )  # waited out here, inside PTB's call: a bound may end it
    return wait


class InboxRequest(AiohttpRequest):
    """The poller's HTTP client: what ``getUpdates`` returns is kept in the inbox before PTB sees it.

    PTB confirms a batch with its next ``getUpdates`` (the offset), which it sends as soon as it has queued
    this one, before the updates are handled. Kept here first, an update confirmed and then lost with this
    replica reaches the next leader from the store. When the store cannot keep them, the poll fails as a
    network error and PTB asks again with the same offset: nothing is confirmed that is not kept.
    """

    keep: Callable[[bytes], Awaitable[None]] | None = None
    # Told how each getUpdates ended: None when it was answered (and kept), else why not, and whether PTB's
    # poller gives up after it. PTB's own error callback hears neither a timeout nor a refused token.
    polled: Callable[[str | None, bool], None] | None = None

    async def do_request(self, url: str, method: str, *args: Any, **kwargs: Any) -> tuple[int, bytes]:
        polling = url.endswith("/getUpdates")
        try:
            status, body = await super().do_request(url, method, *args, **kwargs)
            keep = self.keep
            if keep is not None and status == 200 and polling:
                try:
                    await keep(body)
                except Exception as exc:
                    count_failure("inbound_inbox", PLATFORM)
                    log.warning("telegram.inbox_failed", error=str(exc) or type(exc).__name__)
                    raise NetworkError("the fetched updates could not be kept; asking again") from exc
        except Exception as exc:
            if polling and self.polled is not None:
                self.polled(str(exc) or type(exc).__name__, False)
            raise
        if polling and self.polled is not None:
            # PTB raises InvalidToken for a 401 or a 404, and its poller ends there for good.
            ended = status in (HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND)
            self.polled(None if status == HTTPStatus.OK else f"Telegram answered {status}{described(body)}", ended)
        return status, body


class KazmaPacing(BaseRateLimiter[None]):
    """PTB's rate-limit hook, backed by the shared pacing: every send and edit waits its chat's turn."""

    def __init__(self, pacing: Pacing, on_rate_limited: Callable[[str, float, int], None]) -> None:
        self.pacing = pacing
        self.on_rate_limited = on_rate_limited

    async def initialize(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def process_request(
        self,
        callback: Callable[..., Coroutine[Any, Any, bool | dict[str, Any] | list[dict[str, Any]]]],
        args: Any,
        kwargs: dict[str, Any],
        endpoint: str,
        data: dict[str, Any],
        rate_limit_args: None,
    ) -> bool | dict[str, Any] | list[dict[str, Any]]:
        chat = data.get("chat_id")
        if endpoint not in _PACED_ENDPOINTS or chat is None:
            return await callback(*args, **kwargs)
        return await self.pacing.run(
            str(chat),
            lambda: callback(*args, **kwargs),
            retry_after_of=_retry_after_of,
            on_rate_limited=lambda wait, attempt: self.on_rate_limited(str(chat), wait, attempt),
            # a card's edit goes first (people wait to see it settle); a streamed reply's edit takes its turn
            urgent=endpoint in _URGENT_ENDPOINTS and not streamed_edit.get(),
            draft=streamed_edit.get(),
        )


class QueryReply:
    """A press on Telegram is answered exactly once (``answerCallbackQuery``): the first reply wins. A notice that
    comes after it (a press answered "Recorded, updating…" and then refused, lost, or not recorded at all) goes
    to ``late`` instead (a reply in the chat), so the presser is never left believing a press counted."""

    def __init__(self, query: CallbackQuery, *, late: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.query = query
        self.late = late
        self.answered = False

    async def acknowledge(self, text: str) -> None:
        await self._answer(text, alert=False)

    async def notify(self, text: str) -> None:
        if self.answered and self.late is not None:
            log.info("telegram.press_reply_late", query=self.query.id)
            await self.late(text)
            return
        await self._answer(text, alert=True)

    async def _answer(self, text: str, *, alert: bool) -> None:
        if self.answered:
            log.info("telegram.press_reply_dropped", query=self.query.id, reason="already answered")
            return
        self.answered = True
        await self.query.answer(text=clip(text, ANSWER_LIMIT), show_alert=alert)
