"""Slack on slack-bolt's ``AsyncApp`` and slack-sdk's ``AsyncWebClient``.

HTTP events mode serves Bolt from an aiohttp runner this adapter owns (Bolt
verifies every request's signature); Socket Mode is used when an app-level
token is configured. Everything the adapter posts is escaped for mrkdwn so no
argument value or agent output can ping a channel or a person, and nothing
but :class:`PlatformError` leaves the send methods.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit
from urllib.request import proxy_bypass

import aiohttp
import structlog
from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.async_app import AsyncApp
from slack_bolt.context.ack.async_ack import AsyncAck
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry.async_handler import AsyncRetryHandler
from slack_sdk.http_retry.builtin_async_handlers import (
    AsyncConnectionErrorRetryHandler,
    AsyncRateLimitErrorRetryHandler,
)
from slack_sdk.web.async_client import AsyncWebClient

from kazma.adapters import text as wording
from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformError
from kazma.adapters.ratelimit import ChatRateLimiter
from kazma.approvals.card import ApprovalCard, CardArgument
from kazma.approvals.model import Decision, Outcome, PressVerdict, Status
from kazma.config.metrics import count_failure
from kazma.config.models import SlackConfig

log = structlog.get_logger("kazma.adapters.slack")

PLATFORM = "slack"
APPROVE_ACTION = "kazma_approve"
DENY_ACTION = "kazma_deny"
ACTIONS_BLOCK_ID = "kazma_actions"

# Slack's Block Kit limits (https://docs.slack.dev/reference/block-kit).
MAX_BLOCKS = 50
MAX_SECTION_TEXT = 3000
MAX_HEADER_TEXT = 150
MAX_CONTEXT_TEXT = 2000
# Slack refuses text over 40,000 characters but folds long messages well before
# that; 3,900 keeps every part readable and clear of the hard limit.
MAX_MESSAGE_TEXT = 3900

AGENT_ICON = ":robot_face:"
_STATUS_EMOJI = {
    Status.APPROVED: ":white_check_mark:",
    Status.DENIED: ":no_entry:",
    Status.TIMEOUT: ":hourglass:",
    Status.CANCELLED: ":heavy_minus_sign:",
}
# Only ordinary posts are conversation; edits, joins, deletions and the like are not.
_MESSAGE_SUBTYPES = frozenset({None, "bot_message", "thread_broadcast", "file_share", "me_message"})
_USER_MENTION = re.compile(r"<@([UW][A-Z0-9]+)(?:\|[^>]*)?>")
_NAME_MENTION = re.compile(r"(?<![\w.@])@([A-Za-z][\w-]{0,31})")
_RETRYABLE_ERRORS = frozenset(
    {"ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"}
)
# What Slack answers when the token lacks chat:write.customize (username/icon_emoji).
_NO_CUSTOM_IDENTITY = frozenset({"missing_scope", "not_allowed_token_type"})
_SEEN_LIMIT = 4096
_STOP_GRACE = 5.0


class _FallBack(Exception):
    """Slack refused an optional feature of a call; the caller retries without it."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class CardTooLarge(ValueError):
    """Even names alone do not fit in one Slack message; posting a partial card would hide arguments."""


# ---------------------------------------------------------------------------
# Rendering (pure functions: no I/O, tested through the fake's stored payloads)


def escape(text: str) -> str:
    """Neutralise Slack's control sequences: ``<!channel>``, ``<@U…>`` and links all need ``<``."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def _defang_backticks(text: str) -> str:
    # A value cannot close our code fence (or merge with it) when no backtick
    # touches another; zero-width spaces keep what a reader sees unchanged.
    return text.replace("`", "\u200b`\u200b")


def _code(value: str) -> str:
    if value == "":
        return "_(empty text)_"
    return f"```{escape(_defang_backticks(value))}```"


def _mrkdwn(text: str) -> dict[str, Any]:
    # verbatim: Slack must not auto-link or auto-parse anything in what we show.
    return {"type": "mrkdwn", "text": text, "verbatim": True}


def _plain(text: str) -> dict[str, Any]:
    return {"type": "plain_text", "text": text, "emoji": False}


def _clip_escaped(text: str, limit: int) -> str:
    """``escape(text)`` in at most ``limit`` characters, visibly shortened when it had to be."""
    escaped = escape(text)
    if len(escaped) <= limit:
        return escaped
    keep = len(text)
    while keep > 0:
        keep = min(keep - 1, keep * limit // max(len(escaped), 1))
        escaped = escape(text[:keep]) + "…"
        if len(escaped) <= limit:
            return escaped
    return "…"


def argument_text(arg: CardArgument) -> str:
    name = f"*{escape(arg.name)}*"
    if not arg.cut:
        return f"{name}\n{_code(arg.head)}"
    marker = f"_{escape(wording.cut_marker(arg))}_"
    return f"{name}\n{_code(arg.head)}\n{marker}\n{_code(arg.tail)}"


def fit_argument(arg: CardArgument, limit: int = MAX_SECTION_TEXT) -> tuple[CardArgument, str]:
    """Shrink a value's excerpt until its section fits, keeping a head and a non-empty tail."""
    text = argument_text(arg)
    if len(text) <= limit:
        return arg, text
    if arg.cut:
        head_src, tail_src = arg.head, arg.tail
    else:
        # Both excerpts come from the whole value; the original length stays true.
        head_src, tail_src = arg.head, arg.head
    budget = len(arg.head) + len(arg.tail)
    while True:
        budget = max(2, min(budget - 1, int(budget * limit / len(text) * 0.9)))
        tail_len = min(max(budget // 4, 1), len(tail_src))
        head_len = min(budget - tail_len, len(head_src))
        shrunk = CardArgument(
            name=arg.name,
            head=head_src[:head_len],
            tail=tail_src[len(tail_src) - tail_len :],
            cut=True,
            original_length=arg.original_length,
        )
        text = argument_text(shrunk)
        if len(text) <= limit or budget <= 2:
            return shrunk, text


def _chunk_lines(first: str, lines: list[str], limit: int) -> list[str]:
    """Pack ``first`` then ``lines`` into texts of at most ``limit`` characters, never splitting a line."""
    chunks: list[str] = []
    current = first
    for line in lines:
        candidate = f"{current}\n{line}" if current else line
        if len(candidate) <= limit:
            current = candidate
            continue
        chunks.append(current)
        current = line
    if current:
        chunks.append(current)
    return chunks


@dataclass(frozen=True)
class RenderedCard:
    blocks: list[dict[str, Any]]
    text: str
    shown: int  # arguments shown with an excerpt; the rest are listed by name


def _link_markup(url: str, label: str) -> str:
    # Inside <url|label> a '|' or '>' would end the URL early.
    safe_url = escape(url).replace("|", "%7C")
    return f"<{safe_url}|{escape(label)}>"


def _header_blocks(card: ApprovalCard) -> list[dict[str, Any]]:
    context = [
        f"Tool *{escape(card.tool)}*",
        f"Requested by *{escape(card.requester)}*",
        f"From {escape(card.origin)}",
        f"Deadline {escape(wording.deadline_text(card))}",
    ]
    return [
        {"type": "header", "block_id": "kazma_title", "text": _plain(_clip_escaped(card.title, MAX_HEADER_TEXT))},
        {
            "type": "context",
            "block_id": "kazma_context",
            "elements": [_mrkdwn(_clip_escaped_markup(item, MAX_CONTEXT_TEXT)) for item in context],
        },
    ]


def _clip_escaped_markup(markup: str, limit: int) -> str:
    # Requester and origin come from our own configuration, so this only guards
    # against a pathological value; cutting an entity in half is avoided.
    if len(markup) <= limit:
        return markup
    cut = markup[: limit - 1]
    amp = cut.rfind("&")
    if amp != -1 and ";" not in cut[amp:]:
        cut = cut[:amp]
    return cut + "…"


def _footer_blocks(card: ApprovalCard) -> list[dict[str, Any]]:
    return [
        {
            "type": "section",
            "block_id": "kazma_hash",
            "text": _mrkdwn(f"*Arguments SHA-256* `{escape(card.args_hash)}`"),
        },
        {
            "type": "section",
            "block_id": "kazma_link",
            "text": _mrkdwn(_link_markup(card.link, "Review the full request on the dashboard")),
        },
    ]


def _actions_block(card: ApprovalCard) -> dict[str, Any]:
    return {
        "type": "actions",
        "block_id": ACTIONS_BLOCK_ID,
        "elements": [
            {
                "type": "button",
                "action_id": APPROVE_ACTION,
                "text": _plain(wording.APPROVE_LABEL),
                "style": "primary",
                "value": card.button_data(Decision.APPROVE),
            },
            {
                "type": "button",
                "action_id": DENY_ACTION,
                "text": _plain(wording.DENY_LABEL),
                "style": "danger",
                "value": card.button_data(Decision.DENY),
            },
        ],
    }


def _argument_blocks(card: ApprovalCard, room: int) -> tuple[list[dict[str, Any]], int]:
    """Sections for as many arguments as fit in ``room`` blocks, then every remaining name."""
    args = card.arguments
    texts = [fit_argument(arg)[1] for arg in args]
    for shown in range(min(len(args), room), -1, -1):
        if shown == len(args):
            overflow: list[str] = []
        else:
            notice = f":warning: {escape(wording.overflow_notice(card, shown))}"
            names = [f"• *{escape(arg.name)}*" for arg in args[shown:]]
            overflow = _chunk_lines(notice, names, MAX_SECTION_TEXT)
        if shown + len(overflow) <= room:
            blocks = [
                {"type": "section", "block_id": f"kazma_arg_{i}", "text": _mrkdwn(texts[i])} for i in range(shown)
            ]
            blocks += [
                {"type": "section", "block_id": f"kazma_more_{i}", "text": _mrkdwn(chunk)}
                for i, chunk in enumerate(overflow)
            ]
            return blocks, shown
    raise CardTooLarge(f"{len(args)} argument names do not fit in {room} Slack blocks")


def _fallback_text(card: ApprovalCard, outcome: Outcome | None = None) -> str:
    parts = [card.title, f"requested by {card.requester}", f"arguments SHA-256 {card.args_hash}"]
    if outcome is not None:
        parts.insert(0, wording.outcome_line(outcome))
    return _clip_escaped(" — ".join(parts) + f". Review: {card.link}", MAX_SECTION_TEXT)


def render_card(card: ApprovalCard) -> RenderedCard:
    head = _header_blocks(card)
    foot = _footer_blocks(card)
    # One block stays free for the outcome a settle puts in place of the buttons.
    room = MAX_BLOCKS - len(head) - len(foot) - 1
    args, shown = _argument_blocks(card, room)
    blocks = [*head, *args, *foot, _actions_block(card)]
    return RenderedCard(blocks=blocks, text=_fallback_text(card), shown=shown)


def render_settled(card: ApprovalCard, outcome: Outcome) -> RenderedCard:
    rendered = render_card(card)
    emoji = _STATUS_EMOJI.get(outcome.status, ":information_source:")
    line = _clip_escaped(wording.outcome_line(outcome), MAX_SECTION_TEXT - len(emoji) - 4)
    outcome_block = {"type": "section", "block_id": "kazma_outcome", "text": _mrkdwn(f"{emoji} *{line}*")}
    blocks = [outcome_block, *(b for b in rendered.blocks if b.get("type") != "actions")]
    return RenderedCard(blocks=blocks, text=_fallback_text(card, outcome), shown=rendered.shown)


def split_text(text: str, limit: int = MAX_MESSAGE_TEXT) -> list[str]:
    """Split raw ``text`` so every part, once escaped, fits ``limit``; prefer line breaks."""
    parts: list[str] = []
    rest = text
    while rest:
        if len(escape(rest)) <= limit:
            parts.append(rest)
            break
        end = 0
        size = 0
        for ch in rest:
            step = len(escape(ch))
            if size + step > limit:
                break
            size += step
            end += 1
        newline = rest.rfind("\n", 0, end)
        if newline >= end // 2:
            end = newline + 1
        parts.append(rest[:end])
        rest = rest[end:]
    return parts


# ---------------------------------------------------------------------------
# Inbound normalisation


def mentions_in(text: str) -> tuple[str, ...]:
    """``<@U…>`` user ids and plain ``@name`` words (how agents address each other), lowercased, once each."""
    found: list[str] = []
    for match in _USER_MENTION.finditer(text):
        found.append(match.group(1).lower())
    plain = _USER_MENTION.sub(" ", unescape(text))
    for match in _NAME_MENTION.finditer(plain):
        found.append(match.group(1).lower())
    return tuple(dict.fromkeys(found))


class _Seen:
    """A bounded memory of (channel, ts) keys: app_mention and message both fire for one post."""

    def __init__(self, limit: int = _SEEN_LIMIT) -> None:
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._limit = limit

    def first_time(self, key: tuple[str, str]) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)
        return True


# ---------------------------------------------------------------------------
# Errors


def _response_status(exc: SlackApiError) -> int | None:
    response = exc.response
    for attr in ("status_code", "status"):
        value = getattr(response, attr, None)
        if isinstance(value, int):
            return value
    return None


def _response_field(exc: SlackApiError, field: str) -> str:
    response = exc.response
    try:
        value = response.get(field) if response is not None else None
    except (AttributeError, ValueError):
        return ""
    return str(value) if value is not None else ""


def _retry_after(exc: SlackApiError) -> float:
    headers = getattr(exc.response, "headers", None)
    raw = headers.get("Retry-After") if headers is not None else None
    if isinstance(raw, list):
        raw = raw[0] if raw else None
    try:
        return max(float(raw), 0.0) if raw is not None else 1.0
    except (TypeError, ValueError):
        return 1.0


# ---------------------------------------------------------------------------
# The adapter


class SlackAdapter:
    """A :class:`~kazma.adapters.contract.PlatformAdapter` for one Slack workspace."""

    name = PLATFORM

    def __init__(
        self,
        config: SlackConfig,
        *,
        limiter: ChatRateLimiter | None = None,
        request_timeout: int = 30,
        rate_limit_retries: int = 1,
        shutdown_timeout: float = 1.0,
    ) -> None:
        self._config = config
        self._limiter = limiter or ChatRateLimiter(min_interval=1.0)
        self._timeout = request_timeout
        self._shutdown_timeout = shutdown_timeout
        self._admins = frozenset(config.admins)
        self._channels = frozenset(config.channels)
        retry_handlers: list[AsyncRetryHandler] = [
            AsyncConnectionErrorRetryHandler(),
            AsyncRateLimitErrorRetryHandler(max_retry_count=rate_limit_retries),
        ]
        self.client = AsyncWebClient(
            token=config.bot_token,
            base_url=config.api_base_url,
            timeout=request_timeout,
            retry_handlers=retry_handlers,
        )
        # slack-sdk reads HTTP(S)_PROXY but ignores NO_PROXY; honour it.
        host = urlsplit(config.api_base_url).hostname or ""
        if self.client.proxy and host and proxy_bypass(host):
            self.client.proxy = None
        self.app = AsyncApp(
            client=self.client,
            signing_secret=config.signing_secret,
            name="kazma",
            # Our own posts (cards, agent messages) must not come back as inbound.
            ignoring_self_events_enabled=True,
        )
        self._handlers: Handlers | None = None
        self._seen = _Seen()
        self._customize = True  # chat:write.customize granted until Slack says otherwise
        self._inflight: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._socket: AsyncSocketModeHandler | None = None
        self._session: aiohttp.ClientSession | None = None
        self._events_url: str | None = None
        self.bot_user_id: str | None = None
        self._register()

    # -- contract ---------------------------------------------------------

    @property
    def home_chat(self) -> str | None:
        return self._config.home_channel or None

    @property
    def events_url(self) -> str | None:
        """Where the HTTP events server listens (after ``start`` in HTTP mode)."""
        return self._events_url

    async def start(self, handlers: Handlers) -> None:
        self._handlers = handlers
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        self.client.session = self._session
        try:
            try:
                auth = await self.client.auth_test()
            except Exception as exc:
                raise self._platform_error(exc, "start") from exc
            self.bot_user_id = str(auth.get("user_id") or "") or None
            if self._config.app_token:
                await self._start_socket_mode()
            else:
                await self._start_http()
        except BaseException as exc:
            await self._close_session()
            if isinstance(exc, Exception):
                count_failure("start", PLATFORM)
                log.error("slack.start_failed", error=str(exc))
            raise
        log.info(
            "slack.started",
            mode="socket" if self._config.app_token else "http",
            events_url=self._events_url,
            bot_user_id=self.bot_user_id,
        )

    async def stop(self) -> None:
        if self._socket is not None:
            socket, self._socket = self._socket, None
            await socket.close_async()  # type: ignore[no-untyped-call]  # Bolt leaves it unannotated
        if self._runner is not None:
            runner, self._runner = self._runner, None
            self._events_url = None
            await runner.cleanup()
        if self._inflight:
            # Presses and commands already acknowledged deserve to finish.
            _, pending = await asyncio.wait(set(self._inflight), timeout=_STOP_GRACE)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=_STOP_GRACE)
        await self._close_session()
        log.info("slack.stopped")

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        if not text.strip():
            count_failure("send", PLATFORM)
            raise PlatformError(PLATFORM, "send", "nothing to send: the text is empty", retryable=False)
        first: str | None = None
        for part in split_text(text):
            ts = await self._post_text(chat, part, agent=agent, thread=thread)
            first = first or ts
        assert first is not None
        return first

    async def post_card(self, card: ApprovalCard) -> CardRef:
        channel = self.home_chat
        if channel is None:
            count_failure("card_post", PLATFORM)
            raise PlatformError(PLATFORM, "card_post", "no home_channel is configured", retryable=False)
        try:
            rendered = render_card(card)
        except CardTooLarge as exc:
            count_failure("card_post", PLATFORM)
            log.error("slack.card_unrenderable", request_id=card.request_id, error=str(exc))
            raise PlatformError(PLATFORM, "card_post", str(exc), retryable=False) from exc
        response = await self._call(
            "card_post",
            channel,
            lambda: self.client.chat_postMessage(
                channel=channel,
                text=rendered.text,
                blocks=rendered.blocks,
                unfurl_links=False,
                unfurl_media=False,
            ),
            paced=True,
        )
        ts = str(response.get("ts"))
        log.info(
            "slack.card_posted",
            request_id=card.request_id,
            channel=channel,
            ts=ts,
            blocks=len(rendered.blocks),
            shown=rendered.shown,
            arguments=len(card.arguments),
        )
        return CardRef(platform=PLATFORM, chat=channel, message_id=ts)

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        rendered = render_settled(card, outcome)
        await self._call(
            "card_settle",
            ref.chat,
            lambda: self.client.chat_update(
                channel=ref.chat, ts=ref.message_id, text=rendered.text, blocks=rendered.blocks
            ),
        )
        log.info(
            "slack.card_settled",
            request_id=card.request_id,
            channel=ref.chat,
            ts=ref.message_id,
            status=outcome.status.value,
        )

    # -- outbound helpers -------------------------------------------------

    async def _post_text(self, chat: str, part: str, *, agent: str | None, thread: str | None) -> str:
        if agent and self._customize:
            try:
                response = await self._call(
                    "send",
                    chat,
                    lambda: self.client.chat_postMessage(
                        channel=chat, text=escape(part), thread_ts=thread, username=agent, icon_emoji=AGENT_ICON
                    ),
                    paced=True,
                    fall_back_on=_NO_CUSTOM_IDENTITY,
                )
                return str(response.get("ts"))
            except _FallBack as exc:
                # Without chat:write.customize the agent is named in the text instead.
                self._customize = False
                log.warning("slack.identity_unavailable", channel=chat, agent=agent, error=exc.code)
        body = escape(wording.agent_prefix(agent) + part)
        response = await self._call(
            "send",
            chat,
            lambda: self.client.chat_postMessage(channel=chat, text=body, thread_ts=thread),
            paced=True,
        )
        return str(response.get("ts"))

    async def _call(
        self,
        site: str,
        chat: str | None,
        call: Callable[[], Awaitable[Any]],
        *,
        paced: bool = False,
        fall_back_on: frozenset[str] = frozenset(),
    ) -> Any:
        if paced and chat is not None:
            await self._limiter.acquire(chat)
        try:
            return await call()
        except Exception as exc:
            if isinstance(exc, SlackApiError) and (code := _response_field(exc, "error")) in fall_back_on:
                raise _FallBack(code) from exc
            error = self._platform_error(exc, site)
            if paced and chat is not None and error.retry_after is not None:
                # Slack's postMessage limit is per channel: hold every send into it.
                self._limiter.block(chat, error.retry_after)
            count_failure(site, PLATFORM)
            log.warning(
                f"slack.{site}_failed",
                site=site,
                channel=chat,
                error=str(error),
                retryable=error.retryable,
                retry_after=error.retry_after,
            )
            raise error from exc

    def _platform_error(self, exc: BaseException, site: str) -> PlatformError:
        if isinstance(exc, PlatformError):
            return exc
        if isinstance(exc, SlackApiError):
            status = _response_status(exc)
            code = _response_field(exc, "error") or f"HTTP {status}"
            needed = _response_field(exc, "needed")
            detail = f"{code} (needs {needed})" if needed else code
            if status == 429 or code == "ratelimited":
                wait = _retry_after(exc)
                return PlatformError(PLATFORM, site, f"rate limited: {detail}", retryable=True, retry_after=wait)
            if (status is not None and status >= 500) or code in _RETRYABLE_ERRORS:
                return PlatformError(PLATFORM, site, detail, retryable=True)
            return PlatformError(PLATFORM, site, detail, retryable=False)
        if isinstance(exc, TimeoutError):
            return PlatformError(PLATFORM, site, f"no answer within {self._timeout} s", retryable=True)
        if isinstance(exc, aiohttp.ClientError | OSError):
            return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=True)
        if isinstance(exc, SlackClientError):
            return PlatformError(PLATFORM, site, str(exc), retryable=False)
        log.exception("slack.unexpected_error", site=site)
        return PlatformError(PLATFORM, site, f"unexpected {type(exc).__name__}: {exc}", retryable=False)

    async def _close_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            self.client.session = None
            await session.close()

    # -- serving ----------------------------------------------------------

    async def _start_http(self) -> None:
        http = self._config.http
        web_app = web.Application()
        web_app.router.add_post(http.path, self._handle_http)
        runner = web.AppRunner(web_app, shutdown_timeout=self._shutdown_timeout, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, http.host, http.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise PlatformError(
                PLATFORM, "start", f"cannot listen on {http.host}:{http.port}: {exc}", retryable=False
            ) from exc
        self._runner = runner
        host, port = self._bound_address(runner, http.host, http.port)
        self._events_url = f"http://{host}:{port}{http.path}"

    @staticmethod
    def _bound_address(runner: web.AppRunner, host: str, port: int) -> tuple[str, int]:
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                return (f"[{address[0]}]" if ":" in str(address[0]) else str(address[0])), int(address[1])
        return host, port

    async def _handle_http(self, request: web.Request) -> web.Response:
        bolt_request = await to_bolt_request(request)
        bolt_response = await self.app.async_dispatch(bolt_request)
        return await to_aiohttp_response(bolt_response)

    async def _start_socket_mode(self) -> None:
        # slack-sdk retries a failed connect forever, so a bad app token would hang
        # start; asking for the socket URL first turns it into a clear error.
        try:
            opened = await self.client.apps_connections_open(app_token=self._config.app_token)
        except Exception as exc:
            raise self._platform_error(exc, "start") from exc
        handler = AsyncSocketModeHandler(self.app, self._config.app_token, web_client=self.client)
        handler.client.wss_uri = str(opened["url"])
        try:
            await asyncio.wait_for(handler.connect_async(), timeout=max(self._timeout, 1))  # type: ignore[no-untyped-call]
        except Exception as exc:
            await handler.close_async()  # type: ignore[no-untyped-call]
            raise self._platform_error(exc, "start") from exc
        self._socket = handler

    # -- listeners --------------------------------------------------------

    def _register(self) -> None:
        self.app.event("message")(self._on_message)
        self.app.event("app_mention")(self._on_message)
        self.app.command("/swarm")(self._on_command)
        self.app.action(APPROVE_ACTION)(self._on_action)
        self.app.action(DENY_ACTION)(self._on_action)

    @contextmanager
    def _track(self) -> Iterator[None]:
        """Keep an acknowledged listener's task so ``stop`` can let it finish."""
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            yield
        finally:
            if task is not None:
                self._inflight.discard(task)

    def _served(self, channel: str) -> bool:
        return not self._channels or channel in self._channels

    async def _on_message(self, event: dict[str, Any]) -> None:
        with self._track():
            await self._deliver_event(event)

    async def _deliver_event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type", ""))
        channel = str(event.get("channel", ""))
        ts = str(event.get("ts", ""))
        subtype = event.get("subtype")
        if subtype not in _MESSAGE_SUBTYPES:
            log.debug("slack.inbound_ignored", reason="subtype", subtype=subtype, channel=channel, ts=ts)
            return
        if not self._served(channel):
            log.info("slack.inbound_ignored", reason="channel_not_served", channel=channel, ts=ts, kind=kind)
            return
        if not self._seen.first_time((channel, ts)):
            log.debug("slack.inbound_duplicate", channel=channel, ts=ts, kind=kind)
            return
        user = str(event.get("user") or event.get("bot_id") or "")
        raw = str(event.get("text") or "")
        profile = event.get("user_profile")
        name = ""
        if isinstance(profile, dict):
            name = str(profile.get("display_name") or profile.get("real_name") or profile.get("name") or "")
        inbound = Inbound(
            platform=PLATFORM,
            chat=channel,
            message_id=ts,
            author=f"slack:{user}",
            author_name=name or str(event.get("username") or user),
            text=unescape(raw),
            thread=str(event["thread_ts"]) if event.get("thread_ts") else None,
            mentions=mentions_in(raw),
            from_bot=bool(event.get("bot_id")) or subtype == "bot_message",
            is_admin=user in self._admins,
        )
        log.info("slack.inbound", channel=channel, ts=ts, kind=kind, author=inbound.author, from_bot=inbound.from_bot)
        await self._hand_inbound(inbound)

    async def _hand_inbound(self, inbound: Inbound) -> None:
        if self._handlers is None:
            return
        try:
            await self._handlers.on_inbound(inbound)
        except Exception:
            count_failure("inbound", PLATFORM)
            log.exception("slack.inbound_failed", channel=inbound.chat, message_id=inbound.message_id)

    async def _on_command(self, ack: AsyncAck, command: dict[str, Any]) -> None:
        channel = str(command.get("channel_id", ""))
        if not self._served(channel):
            await ack(text="Kazma does not serve this channel.")
            log.info("slack.command_ignored", reason="channel_not_served", channel=channel)
            return
        # Slack gives a slash command 3 seconds; the swarm's work starts after the ack.
        await ack()
        with self._track():
            user = str(command.get("user_id", ""))
            inbound = Inbound(
                platform=PLATFORM,
                chat=channel,
                message_id=str(command.get("trigger_id") or f"cmd-{uuid.uuid4().hex}"),
                author=f"slack:{user}",
                author_name=str(command.get("user_name") or user),
                text=unescape(str(command.get("text") or "")).strip(),
                mentions=mentions_in(str(command.get("text") or "")),
                command="swarm",
                is_admin=user in self._admins,
            )
            log.info("slack.command", channel=channel, author=inbound.author)
            await self._hand_inbound(inbound)

    async def _on_action(self, ack: AsyncAck, body: dict[str, Any], action: dict[str, Any]) -> None:
        # Acknowledge before any work: a slow decision must not cost the 3-second window.
        await ack()
        with self._track():
            await self._press(body, action)

    async def _press(self, body: dict[str, Any], action: dict[str, Any]) -> None:
        user = str((body.get("user") or {}).get("id", ""))
        channel = str((body.get("channel") or {}).get("id") or (body.get("container") or {}).get("channel_id") or "")
        actor = f"slack:{user}"
        if self._handlers is None:
            return
        try:
            # The button data alone says what was pressed; the approvals layer
            # validates it and audits a refusal, so nothing is judged here.
            result = await self._handlers.on_press(str(action.get("value") or ""), actor, PLATFORM)
        except Exception:
            count_failure("press", PLATFORM)
            log.exception("slack.press_failed", actor=actor, channel=channel)
            await self._tell(channel, user, "Kazma could not record your press. Please try again.")
            return
        log.info(
            "slack.press",
            actor=actor,
            channel=channel,
            verdict=result.verdict.value,
            request_id=result.request_id,
        )
        if result.verdict in (PressVerdict.LOST, PressVerdict.REFUSED):
            await self._tell(channel, user, result.message)

    async def _tell(self, channel: str, user: str, message: str) -> None:
        if not channel or not user:
            return
        try:
            await self.client.chat_postEphemeral(channel=channel, user=user, text=escape(message))
        except Exception as exc:
            count_failure("press", PLATFORM)
            log.warning("slack.press_notice_failed", channel=channel, user=user, error=str(exc))
