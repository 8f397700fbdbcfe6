"""Slack on slack-bolt's ``AsyncApp`` and slack-sdk's ``AsyncWebClient``: transport and lifecycle only.

HTTP events mode serves Bolt from an aiohttp runner this adapter owns (Bolt
verifies every request's signature); Socket Mode is used when an app-level
token is configured. Cards are ``render.py``; failures are ``errors.py``; the
inbound door, the press policy, pacing and 429 handling are the kit's (so
slack-sdk's own rate-limit retry handler is left off: one rule, not two).

Socket Mode is the singleton ingress (Slack spreads events over every open
socket of an app, so only the leader replica opens one); every replica keeps
the Web API client. HTTP events mode is served by every replica behind the
load balancer: Slack retries an event whose acknowledgement was late, maybe to
another replica, so every message, command and press is claimed across
replicas before it is handled (messages by channel and ``ts``, which also
folds the ``message`` and ``app_mention`` events of one post into one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar, Unpack
from urllib.parse import urlsplit
from urllib.request import proxy_bypass

import aiohttp
import structlog
from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.async_app import AsyncApp
from slack_bolt.authorization import AuthorizeResult
from slack_bolt.authorization.async_authorize import AsyncAuthorize
from slack_bolt.context.ack.async_ack import AsyncAck
from slack_bolt.context.async_context import AsyncBoltContext
from slack_bolt.middleware.async_middleware import AsyncMiddleware
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_bolt.response import BoltResponse
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import AsyncConnectionErrorRetryHandler
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from kazma.adapters.card_layout import LaidOut, agent_prefix
from kazma.adapters.chat_commands import CHAT_COMMANDS
from kazma.adapters.chat_text import Columns
from kazma.adapters.contract import CardRef, Inbound, PlatformError, Press
from kazma.adapters.deny_reason import (
    REASON_LABEL,
    REASON_MAX,
    REASON_SUBMIT,
    REASON_TITLE,
    deny_data,
    reason_request,
)
from kazma.adapters.ingress import Arrival, Stopped
from kazma.adapters.kit import NOT_SERVED, InboundStreak, KitOptions, PlatformBase, Posted
from kazma.adapters.pacing import ChatRateLimiter, Pacing
from kazma.adapters.slack.errors import (
    APP_OPERATOR_FIX,
    NO_CUSTOM_IDENTITY,
    OPERATOR_FIX,
    PLATFORM,
    classify,
    download_refused,
    error_code,
    refusal,
    refuses_token,
)
from kazma.adapters.slack.inbound import (
    MESSAGE_SUBTYPES,
    Seen,
    attachments,
    interaction_key,
    mentions_in,
    replay_keys,
)
from kazma.adapters.slack.render import (
    APPROVE_ACTION,
    CHOICE_ACTION,
    DENY_ACTION,
    DENY_REASON_ACTION,
    MAX_MESSAGE_TEXT,
    MAX_SECTION_TEXT,
    REMEMBER_ACTION,
    choice_blocks,
    escape,
    escaped_units,
    home_view,
    render_card,
    unescape,
)
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome
from kazma.config.metrics import count_failure
from kazma.config.models import SlackConfig
from kazma.config.waits import bounded

if TYPE_CHECKING:
    from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler

T = TypeVar("T")

log = structlog.get_logger("kazma.adapters.slack")
# slack-sdk's client logger. slack-sdk formats every request's parameters and every answer (a card's blocks, both
# ways) for a debug line whenever the logger's own level is unset (it tests ``logger.level <= DEBUG``, not the
# effective level): ~80 us of CPU per card edit, for a line nobody sees. Its level is pinned to the effective one
# at each start, so the debug lines still come whenever debug logging is on.
_CLIENT_LOG = logging.getLogger("slack_sdk.web.async_client.kazma")
BOLT_APP_NAME: Final = "slack_bolt.kazma"
# slack_sdk's Socket Mode client pings this often, and opens a socket found closed or stale again; the adapter looks
# at the socket as often, for /healthz.
SOCKET_PING_SECONDS: Final = 10.0
CODE_FENCE: Final = "```"
ZWSP: Final = "\u200b"  # after a backtick inside a code block, so no run of them closes it early

AGENT_ICON: Final = ":robot_face:"


REASON_VIEW = "kazma_deny_reason"  # the modal's callback id
# The buttons _on_action hands over as presses, and where the middleware leaves a press's signed request for it.
_PRESS_ACTIONS: Final = frozenset((APPROVE_ACTION, DENY_ACTION, REMEMBER_ACTION, CHOICE_ACTION))
_SIGNED: Final = "kazma_signed"
# The card's buttons, one Bolt listener (a question's choices are CHOICE_ACTION's).
_CARD_BUTTONS: Final = re.compile(
    "^(?:{})$".format("|".join(map(re.escape, (APPROVE_ACTION, DENY_ACTION, REMEMBER_ACTION))))
)
REASON_BLOCK = "kazma_reason"
REASON_INPUT = "reason"


# Told to a presser whose press counted while Slack refuses the bot token: the card keeps its buttons here.
CARD_NOT_EDITED: Final = (
    "Slack refused Kazma's bot token, so this card is not edited here until the operator replaces the token."
)


# How long a reason submitted while Slack refuses the bot token waits for its answer before the submission is
# acknowledged (Slack shows the person an error past 3 seconds); the press policy says "Recorded, updating…" by
# then at its default press_timeout.
REASON_ANSWER_WITHIN: Final = 2.5
REASON_UNANSWERED: Final = (
    "Your Deny is still being decided, and Kazma cannot tell you here how it ends; the request's approval page "
    "shows it."
)


# A press's response URL takes answers for 30 minutes (Slack's documented lifetime): a winner waiting on a card
# edit longer than that cannot be told there. At most this many winners are kept waiting (the oldest go first).
RESPONSE_URL_LIFETIME: Final = 30 * 60.0
EDIT_WAITERS_KEPT: Final = 1000


# Told to a presser of "Deny with reason" while Slack refuses the bot token: views.open cannot open the form.
REASON_FORM_REFUSED: Final = (
    "The reason form cannot open: Slack refused Kazma's bot token. Press Deny to deny without a reason, or give "
    "it on the request's approval page."
)


class _EphemeralReply:
    """A press on Slack was acknowledged already; the card edit is the winner's answer, others hear privately.

    ``response_url``: the press's own (a button's, not a modal's). With the bot token refused no card is edited and
    ``chat.postEphemeral`` is refused too: the presser heard nothing and saw the buttons stay, after a press that
    decided. The response URL needs no token, so they are told there. The first press after a revocation decides
    before Kazma knows of it: the refusal of its own notice, or of its card's edit, is what tells Kazma, and the
    presser is told through the response URL then."""

    def __init__(
        self,
        adapter: SlackAdapter,
        channel: str,
        user: str,
        response_url: str | None = None,
        message_ts: str | None = None,
    ) -> None:
        self.adapter = adapter
        self.channel = channel
        self.user = user
        self.response_url = response_url
        self.message_ts = message_ts

    async def acknowledge(self, text: str) -> None:
        if not self.response_url:
            return  # the card, edited for everyone within moments, says it
        if self.adapter.setup_refused is not None:
            await self._respond(f"{text} {CARD_NOT_EDITED}")
        elif self.channel and self.message_ts:
            # The card's edit is the answer; should Slack refuse the token on it (or before it), the winner is told
            # through the response URL instead (see SlackAdapter._tell_edit_waiters).
            self.adapter._wait_for_edit(self.channel, self.message_ts, self.response_url, text)

    async def notify(self, text: str) -> None:
        if self.adapter.setup_refused is not None and self.response_url:
            await self._respond(f"{text} {CARD_NOT_EDITED}")
            return
        if not self.channel or not self.user:
            return
        try:
            await self.adapter.call(
                "press_reply",
                self.channel,
                lambda: self.adapter.client.chat_postEphemeral(channel=self.channel, user=self.user, text=escape(text)),
                paced=False,
            )
        except PlatformError:
            if self.adapter.setup_refused is None or not self.response_url:
                raise
            # This notice is what showed Slack refuses the token (the first press after a revocation): the
            # response URL still reaches the presser.
            await self._respond(f"{text} {CARD_NOT_EDITED}")

    async def _respond(self, text: str) -> None:
        url = self.response_url
        assert url is not None
        await self.adapter.respond(url, escape(text))


class _ModalReply:
    """The answer to a reason submitted while Slack refuses the bot token, kept for the submission's
    acknowledgement (see ``SlackAdapter._on_reason``): the first thing the press policy says. Anything said after
    the acknowledgement went has no way to the presser; it is logged."""

    def __init__(self) -> None:
        self.said: str | None = None
        self.done = asyncio.Event()

    async def acknowledge(self, text: str) -> None:
        self._say(text)

    async def notify(self, text: str) -> None:
        self._say(text)

    def _say(self, text: str) -> None:
        if self.done.is_set():
            log.info("slack.reason_answer_untold", said=text[:200])
            return
        self.said = text
        self.done.set()


def _answer_view(text: str) -> dict[str, Any]:
    """The reason modal, replaced with what its Deny did and why the card stays as it is (no submit button)."""
    shown = escape(f"{text} {CARD_NOT_EDITED}")
    return {
        "type": "modal",
        "title": {"type": "plain_text", "text": REASON_TITLE[:24]},
        "close": {"type": "plain_text", "text": "Close"},
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": shown[:MAX_SECTION_TEXT]}}],
    }


class _FallBack(Exception):
    """Slack refused an optional feature of a call; the caller retries without it."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class _SocketLog(logging.LoggerAdapter[logging.Logger]):
    """The logger slack_sdk's Socket Mode client writes to (Bolt's app logger), keeping the last error it wrote:
    its reconnects say why a socket does not open (apps.connections.open refused, the websocket refused) nowhere
    else, and /healthz says it."""

    last_error: str | None = None

    @property
    def level(self) -> int:  # read by Bolt on each envelope; a LoggerAdapter has none of its own
        return self.logger.level  # a LoggerAdapter[Logger] wraps a Logger

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if level >= logging.ERROR:
            try:
                self.last_error = str(msg) % args if args else str(msg)
            except (TypeError, ValueError):  # a message that is no format string for its arguments
                self.last_error = str(msg)
        super().log(level, msg, *args, **kwargs)


class _ConnectionsClient(AsyncWebClient):
    """The Web API client slack_sdk's Socket Mode client asks for each socket's URL (``apps.connections.open``, with
    the app-level token). After any refusal slack_sdk asks again at every ping, for ever, and says why only in its
    own log: a refusal of the token itself is handed to ``refused``, which ends that."""

    def __init__(self, refused: Callable[[SlackApiError], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._refused = refused

    async def apps_connections_open(self, *, app_token: str, **kwargs: Any) -> AsyncSlackResponse:
        try:
            return await super().apps_connections_open(app_token=app_token, **kwargs)
        except SlackApiError as exc:
            if refuses_token(exc):
                self._refused(exc)
            raise


class _StartAuthorized(AsyncAuthorize):
    """Bolt's authorization of every request, from the ``auth.test`` answer of the adapter's start.

    Left to itself, Bolt asks ``auth.test`` with the bot token at the first request it is handed and keeps only a
    good answer: a token Slack refused before this process's first event or press (revoked, the app reinstalled,
    on a replica that had seen nothing yet) had every signed request after it answered "Please install this app"
    and dropped before any listener, presses included, while /healthz said Slack was serving. A press is signed
    with the signing secret, not the token: it decides whatever Slack now answers the token."""

    def __init__(self, adapter: SlackAdapter) -> None:
        self.adapter = adapter

    async def __call__(
        self,
        *,
        context: AsyncBoltContext,
        enterprise_id: str | None,
        team_id: str | None,
        user_id: str | None,
        actor_enterprise_id: str | None = None,
        actor_team_id: str | None = None,
        actor_user_id: str | None = None,
    ) -> AuthorizeResult | None:
        return self.adapter._authorized  # None only before a start, when no request is served


class _ReplayDoor(AsyncMiddleware):
    """:meth:`SlackAdapter._drop_replays` as Bolt's middleware."""

    def __init__(self, adapter: SlackAdapter) -> None:
        self.adapter = adapter

    async def async_process(
        self, *, req: AsyncBoltRequest, resp: BoltResponse, next: Callable[[], Awaitable[BoltResponse]]
    ) -> BoltResponse | None:
        return await self.adapter._drop_replays(req, req.body, next)


class SlackAdapter(PlatformBase):
    """A :class:`~kazma.adapters.contract.PlatformAdapter` for one Slack workspace."""

    name = PLATFORM

    def __init__(
        self,
        config: SlackConfig,
        *,
        limiter: ChatRateLimiter | None = None,
        request_timeout: int = 30,
        shutdown_timeout: float = 1.0,
        max_attempts: int = 5,
        **options: Unpack[KitOptions],
    ) -> None:
        super().__init__(
            config, pacing=Pacing(limiter or ChatRateLimiter(min_interval=1.0), max_attempts=max_attempts), **options
        )
        self.config: SlackConfig = config
        self._timeout = request_timeout
        self._shutdown_timeout = shutdown_timeout
        self.client = AsyncWebClient(
            token=config.bot_token,
            base_url=config.api_base_url,
            timeout=request_timeout,
            retry_handlers=[AsyncConnectionErrorRetryHandler()],
            logger=_CLIENT_LOG,
        )
        # Cards are posted by a client that repeats a call only when it never reached Slack. slack-sdk's handler
        # above also repeats a call whose connection dropped before the answer (Slack may have posted it): a card
        # posted twice so, silently, left an unrecorded copy with live buttons that no settle ever edited. A card
        # post whose answer was lost fails instead, and the bus posts it again marked as a repost.
        self._card_client = AsyncWebClient(
            token=config.bot_token,
            base_url=config.api_base_url,
            timeout=request_timeout,
            retry_handlers=[AsyncConnectionErrorRetryHandler(error_types=[aiohttp.ClientConnectorError])],
            logger=_CLIENT_LOG,
        )
        # slack-sdk reads HTTP(S)_PROXY but ignores NO_PROXY; honour it.
        host = urlsplit(config.api_base_url).hostname or ""
        # Kept for the calls made outside slack_sdk (a press's response URL, a file's download): each asks NO_PROXY
        # of its own host (see _proxy_for).
        self._env_proxy: str | None = self.client.proxy or None
        if self.client.proxy and host and proxy_bypass(host):
            self.client.proxy = self._card_client.proxy = None
        self._authorized: AuthorizeResult | None = None  # Bolt's, from the start's auth.test (_StartAuthorized)
        self.app = AsyncApp(
            # Bolt's own client, which Kazma's listeners do not use: given the token, Bolt would ask auth.test with
            # it on its own (and warn that the authorize below makes it unused); the token of each request's
            # client is the start's authorization's.
            client=AsyncWebClient(base_url=config.api_base_url, timeout=request_timeout, logger=_CLIENT_LOG),
            authorize=_StartAuthorized(self),  # type: ignore[arg-type]  # Bolt annotates a function, takes this too
            signing_secret=config.signing_secret,
            # Bolt names its loggers after the app and, on every request, sets the app's logger to the root's level
            # of that moment. Named "kazma", that logger was the parent of all of Kazma's: a request handled while
            # the root stood at WARNING pinned every kazma.* logger there, and their INFO events vanished even after
            # the root was lowered. Under slack_bolt, Bolt's loggers stay in Bolt's own tree.
            name=BOLT_APP_NAME,
            # Our own posts (cards, agent messages) must not come back as inbound.
            ignoring_self_events_enabled=True,
            # Kazma registers no workflow functions: a middleware looking for their token on every request
            # has nothing to find. The signature check, ssl_check and url_verification stay Bolt's.
            attaching_function_token_enabled=False,
        )
        self._seen = Seen()
        self._titles: dict[str, str] = {}  # channel -> "#name", asked once per channel (conversations.info)
        self._customize = True  # chat:write.customize granted until Slack says otherwise
        self._runner: web.AppRunner | None = None
        self._socket: AsyncSocketModeHandler | None = None
        self._socket_streak = self._new_streak()  # the socket found closed in a row, for /healthz
        self._watching: asyncio.Task[None] | None = None  # looks at the socket (see _watch_socket)
        self._session: aiohttp.ClientSession | None = None
        self._events_url: str | None = None
        self.bot_user_id: str | None = None
        # Slack refused the bot token while Kazma ran, and what the operator does about it: the token comes from the
        # configuration, so until a restart every call with it is refused again.
        self._token_refused: str | None = None
        # Winners of a press waiting on their card's edit (channel, ts) -> (response URL, answer, since), or None
        # once the card was edited: told if Slack refuses the token first (see _wait_for_edit). Oldest first.
        self._edit_waiters: OrderedDict[tuple[str, str], tuple[str, str, float] | None] = OrderedDict()
        # The same for the app-level token (Socket Mode's): inbound only, so the bot token still posts.
        self._app_token_refused: str | None = None
        self._register()

    @property
    def events_url(self) -> str | None:
        """Where the HTTP events server listens (after ``start`` in HTTP mode)."""
        return self._events_url

    def classify(self, site: str, exc: BaseException) -> PlatformError:
        return classify(site, exc, timeout=self._timeout)

    @property
    def has_singleton_ingress(self) -> bool:
        return bool(self.config.app_token)  # Socket Mode; HTTP events are served by every replica

    @property
    def ingress_trouble(self) -> str | None:
        return self._socket_streak.trouble if self.has_singleton_ingress and self.ingress_running else None

    @property
    def setup_refused(self) -> str | None:
        return self._token_refused

    # A refused bot token leaves presses deciding: they are signed with the signing secret (HTTP events) or come
    # over the app-level token's socket, and Bolt authorizes them from the start's auth.test (_StartAuthorized).
    presses_outlive_refusal = True

    def _refuse_token(self, site: str, exc: BaseException) -> None:
        """Slack refused the bot token on a call (see ``refuses_token``): said and counted once, and from now on no
        call is made with it (see ``_token_refused``)."""
        if self._token_refused is not None:
            return
        self._token_refused = f"Slack refused the bot token ({refusal(exc)}): {OPERATOR_FIX}"
        count_failure("token_refused", PLATFORM)
        log.error("slack.token_refused", refused="bot token", site=site, error=refusal(exc), fix=OPERATOR_FIX)
        self._tell_edit_waiters()

    def _wait_for_edit(self, chat: str, ts: str, response_url: str, text: str) -> None:
        """A winner's answer is the edit of card ``chat``/``ts``: kept with the press's response URL until the edit
        lands, so a refusal of the token meanwhile still reaches them (see :meth:`_tell_edit_waiters`)."""
        key = (chat, ts)
        if key in self._edit_waiters and self._edit_waiters[key] is None:
            return  # edited already: they saw it
        self._keep_edit_waiter(key, (response_url, text, self._clock()))

    def _card_edited(self, chat: str, ts: str) -> None:
        self._keep_edit_waiter((chat, ts), None)  # a press answered after this edit needs no word later

    def _keep_edit_waiter(self, key: tuple[str, str], waiter: tuple[str, str, float] | None) -> None:
        """``key``'s waiter (None: its card was edited) as the newest, the oldest forgotten past EDIT_WAITERS_KEPT."""
        self._edit_waiters[key] = waiter
        self._edit_waiters.move_to_end(key)
        while len(self._edit_waiters) > EDIT_WAITERS_KEPT:
            self._edit_waiters.popitem(last=False)

    def _tell_edit_waiters(self) -> None:
        """Slack refused the bot token: the winners whose card was not edited yet never will see it edited (until
        the operator's restart), so each is told through their press's response URL, which needs no token."""
        now = self._clock()
        waiting = [w for w in self._edit_waiters.values() if w is not None and now - w[2] < RESPONSE_URL_LIFETIME]
        self._edit_waiters.clear()
        for url, text, _ in waiting:
            self.spawn(self._tell_waiter(url, text), name="kazma-slack-tell-winner")

    async def _tell_waiter(self, url: str, text: str) -> None:
        try:
            await self.respond(url, escape(f"{text} {CARD_NOT_EDITED}"))
        except PlatformError as exc:  # counted by the kit's call (press_reply)
            log.warning("slack.winner_untold", error=str(exc))

    def _refuse_app_token(self, exc: SlackApiError) -> None:
        """Slack refused the app-level token on ``apps.connections.open``: said and counted once, and no socket is
        asked for with it again (slack_sdk's reconnecting is ended); the inbound trouble says what to do."""
        if self._app_token_refused is not None:
            return
        self._app_token_refused = f"Slack refused the app-level token ({refusal(exc)}): {APP_OPERATOR_FIX}"
        count_failure("token_refused", PLATFORM)
        log.error(
            "slack.token_refused", refused="app-level token", site="socket", error=refusal(exc), fix=APP_OPERATOR_FIX
        )
        socket = self._socket
        if socket is not None:  # from slack_sdk's own reconnecting: it is ended by closing its client
            self.spawn(self._end_socket(socket), name="kazma-slack-socket-refused")

    async def _end_socket(self, socket: AsyncSocketModeHandler) -> None:
        await self._stop_watching()
        if self._socket is socket:
            self._socket = None
        self._socket_streak.failed(self._app_token_refused, final=True)
        await socket.close_async()  # type: ignore[no-untyped-call]  # Bolt leaves it unannotated

    def _token_error(self, site: str) -> PlatformError:
        # Retryable, as for a platform whose start was refused: a card post or edit stays in the outbox (nothing goes
        # out to Slack meanwhile: call refuses first) and lands after the operator's restart with a new token. Given
        # up for good, the card never came to Slack, and a card decided meanwhile kept its buttons there.
        return PlatformError(
            PLATFORM, site, self._token_refused or "", retryable=True, operator_must_act=True, nothing_done=True
        )

    async def call(
        self,
        site: str,
        chat: str | None,
        operation: Callable[[], Awaitable[T]],
        *,
        paced: bool = True,
        wait_out_429: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109 - the kit's: per attempt
    ) -> T:
        """The kit's call, given up at once after Slack refused the bot token (every call carries it)."""
        if self._token_refused is not None:
            error = self._token_error(site)
            self.failed(site, chat, error)
            raise error
        try:
            return await super().call(site, chat, operation, paced=paced, wait_out_429=wait_out_429, timeout=timeout)
        except PlatformError as exc:
            cause = exc.__cause__
            if cause is None or not refuses_token(cause):
                raise
            self._refuse_token(site, cause)
            error = self._token_error(site)
            error.counted = exc.counted  # the kit counted the call's failure; this is that one failure, told better
            raise error from exc

    @staticmethod
    def _new_streak() -> InboundStreak:
        return InboundStreak(
            "Socket Mode's connection", retried=f"slack_sdk opening it again every {SOCKET_PING_SECONDS:g} s"
        )

    # -- lifecycle --------------------------------------------------------

    async def _connect(self) -> None:
        parent = _CLIENT_LOG.parent
        _CLIENT_LOG.setLevel(logging.NOTSET if parent is None else parent.getEffectiveLevel())
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        self.client.session = self._card_client.session = self._session
        self._token_refused = self._app_token_refused = None  # a start is the operator's "try again"
        auth = await self.client.auth_test()
        self.bot_user_id = str(auth.get("user_id") or "") or None
        self._authorized = AuthorizeResult.from_auth_test_response(
            bot_token=self.config.bot_token, auth_test_response=auth
        )
        if not self.config.app_token:
            await self._start_http()
        log.info(
            "slack.connected",
            mode="socket" if self.config.app_token else "http",
            events_url=self._events_url,
            bot_user_id=self.bot_user_id,
        )

    async def _open_ingress(self) -> None:
        await self._start_socket_mode()
        log.info("slack.socket_opened", bot_user_id=self.bot_user_id)

    async def _close_ingress(self) -> None:
        """Close the socket (its own session); acknowledged envelopes run on as tracked work."""
        await self._stop_watching()
        if self._socket is not None:
            socket, self._socket = self._socket, None
            await socket.close_async()  # type: ignore[no-untyped-call]  # Bolt leaves it unannotated
            log.info("slack.socket_closed")

    async def _stop_receiving(self) -> None:
        await self._stop_watching()
        if self._socket is not None:
            socket, self._socket = self._socket, None
            await socket.close_async()  # type: ignore[no-untyped-call]  # Bolt leaves it unannotated
        if self._runner is not None:
            runner, self._runner = self._runner, None
            self._events_url = None
            await runner.cleanup()

    async def _disconnect(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            self.client.session = self._card_client.session = None
            await session.close()

    async def _start_http(self) -> None:
        http = self.config.http
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
        stamp = request.headers.get("X-Slack-Request-Timestamp")
        if stamp is not None:
            try:
                int(stamp)
            except ValueError:
                # Bolt's signature check reads it with int() outside its own guard: a 500 and an error with a
                # traceback in the log for each such post, which anyone who can reach the URL may send. Refused as
                # Bolt refuses any request it cannot verify.
                log.info("slack.request_unverified", reason="timestamp is not a number")
                return web.json_response({"error": "invalid request"}, status=401)
        bolt_request = await to_bolt_request(request)
        bolt_response = await self.app.async_dispatch(bolt_request)
        return await to_aiohttp_response(bolt_response)

    async def _start_socket_mode(self) -> None:
        if self._app_token_refused is not None:  # refused while Kazma ran: asking again can only be refused
            raise PlatformError(
                PLATFORM, "ingress_start", self._app_token_refused, retryable=False, operator_must_act=True
            )
        connections = _ConnectionsClient(
            self._refuse_app_token,
            base_url=self.config.api_base_url,
            timeout=self._timeout,
            session=self._session,
            proxy=self.client.proxy,
            logger=_CLIENT_LOG,
        )
        # slack-sdk retries a failed connect forever, so a bad app token would hang
        # start; asking for the socket URL first turns it into a clear error.
        opened = await connections.apps_connections_open(app_token=self.config.app_token)
        # Socket mode's client (slack_sdk.socket_mode, its aiohttp websocket): imported only by a socket-mode start
        from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler

        said = _SocketLog(self.app.logger)
        handler = AsyncSocketModeHandler(
            self.app,
            self.config.app_token,
            # a Logger as slack_sdk uses one (see _SocketLog), which Bolt's annotation does not know
            logger=said,  # type: ignore[arg-type]
            web_client=connections,
            ping_interval=SOCKET_PING_SECONDS,
        )
        handler.client.wss_uri = str(opened["url"])
        try:
            await bounded(handler.connect_async(), max(self._timeout, 1))  # type: ignore[no-untyped-call]
        except BaseException:
            await handler.close_async()  # type: ignore[no-untyped-call]
            raise
        self._socket = handler
        self._socket_streak = self._new_streak()
        self._watching = asyncio.create_task(self._watch_socket(handler, said), name="kazma-slack-socket-watch")

    async def _watch_socket(self, handler: AsyncSocketModeHandler, said: _SocketLog) -> None:
        """slack_sdk opens a socket that closed (or went stale) again by itself, and says why an opening failed
        (apps.connections.open refused, the websocket refused) only in its own log: a socket that never opened
        again was an ingress /healthz called serving. Looked at every ping, a socket found closed
        INBOUND_TROUBLE_AFTER times in a row is the inbound failing, until it is found open."""
        client = handler.client
        while True:
            await asyncio.sleep(SOCKET_PING_SECONDS)
            if await client.is_connected():
                self._socket_streak.succeeded()
                said.last_error = None  # an old reason must not explain a later closing
                continue
            self._socket_streak.failed(f"found closed ({said.last_error or 'slack_sdk said no error'})")

    async def _stop_watching(self) -> None:
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    # -- listeners --------------------------------------------------------

    def _register(self) -> None:
        # After Bolt's own signature check (its middleware runs first), before any listener. A middleware object,
        # not a function: Bolt builds a function's keyword arguments anew for each request (~20 µs).
        self.app.use(_ReplayDoor(self))
        # Bolt tries listeners in this order and builds each one's arguments to match it (~100 Python calls a
        # try), so the card's buttons, whose latency people watch, are one listener and the first; messages
        # second. No two listeners can match one request (each is its own action ids, view, event type or
        # command), so the order decides nothing else.
        self.app.action(_CARD_BUTTONS)(self._on_action)
        self.app.event("message")(self._on_message)
        self.app.event("app_mention")(self._on_message)
        self.app.action(CHOICE_ACTION)(self._on_action)
        self.app.action(DENY_REASON_ACTION)(self._on_deny_reason)
        self.app.view(REASON_VIEW)(self._on_reason)
        self.app.event("app_home_opened")(self._on_home_opened)
        for command in CHAT_COMMANDS:
            self.app.command(f"/{command.name}")(self._on_command)

    async def _drop_replays(
        self, req: AsyncBoltRequest, body: dict[str, Any], next: Callable[[], Awaitable[BoltResponse]]
    ) -> BoltResponse:
        """Bolt's hook into the kit's door: a signed request walks it (its replay guard) before any listener."""
        keys = replay_keys(req, body)
        if keys and self._pressed(body) and self._handlers is not None and self._handlers.signed_with_press:
            # A button press: the store remembers its signed request in the commit of the decision it makes (one
            # commit before the press is answered), and a replay decides nothing there. Here, this process's
            # own memory only.
            if not self._signed.first_time(keys):
                self._stopped(Stopped("replay_guard", "replayed"), Arrival(PLATFORM, signed=tuple(keys)))
                return BoltResponse(status=200, body="")
            req.context[_SIGNED] = tuple(keys)
            return await next()
        if keys and await self.admit(Arrival(PLATFORM, signed=tuple(keys))) is None:
            return BoltResponse(status=200, body="")  # acknowledged, so Slack does not retry; nothing runs
        return await next()

    @staticmethod
    def _pressed(body: dict[str, Any]) -> bool:
        """Whether ``body`` is a press of a button that :meth:`_on_action` hands over as a :class:`Press`."""
        actions = body.get("actions") if body.get("type") == "block_actions" else None
        return (
            isinstance(actions, list)
            and len(actions) == 1
            and isinstance(actions[0], dict)
            and actions[0].get("action_id") in _PRESS_ACTIONS
        )

    async def _on_message(self, event: dict[str, Any]) -> None:
        with self.tracking():
            kind = str(event.get("type", ""))
            channel = str(event.get("channel", ""))
            ts = str(event.get("ts", ""))
            subtype = event.get("subtype")
            if subtype not in MESSAGE_SUBTYPES:
                log.debug("slack.inbound_ignored", reason="subtype", subtype=subtype, channel=channel, ts=ts)
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
            await self.deliver(
                Inbound(
                    platform=PLATFORM,
                    chat=channel,
                    message_id=ts,
                    author=self.actor(user),
                    author_name=name or str(event.get("username") or user),
                    text=unescape(raw),
                    thread=str(event["thread_ts"]) if event.get("thread_ts") else None,
                    mentions=mentions_in(raw),
                    from_bot=bool(event.get("bot_id")) or subtype == "bot_message",
                    is_admin=self.is_admin(user),
                    direct=event.get("channel_type") == "im" or channel.startswith("D"),
                    # a reply in a thread answers the thread's first message (a question, say)
                    reply_to=str(event["thread_ts"]) if event.get("thread_ts") and event["thread_ts"] != ts else None,
                    attachments=attachments(event, self._fetcher),
                    chat_title=await self._channel_title(channel, direct_with=name),
                ),
                # One post, however many events and retries carry it: a ts is unique within its channel.
                key=f"message:{channel}:{ts}",
            )

    async def _on_home_opened(self, event: dict[str, Any]) -> None:
        """The person opened the app's Home tab: publish what waits for a decision, as they may see it."""
        with self.tracking():
            user = str(event.get("user") or "")
            handlers = self._handlers
            if event.get("tab") != "home" or not user or handlers is None or handlers.home is None:
                return  # the Messages tab is a DM: messages reach the agents as every DM does
            try:
                home = await handlers.home(self.actor(user), PLATFORM)
                await self.call("home", None, lambda: self.client.views_publish(user_id=user, view=home_view(home)))
            except Exception as exc:  # the home tab is a view of what is stored: nothing is lost
                if not (isinstance(exc, PlatformError) and exc.counted):  # views.publish's failure: counted by call
                    count_failure("home", PLATFORM)
                log.warning("slack.home_failed", user=user, error=str(exc))
                return
            log.info("slack.home_published", user=user, waiting=len(home.waiting) + home.more)

    async def _channel_title(self, channel: str, *, direct_with: str) -> str:
        """``#name`` of a channel, asked of Slack once per channel per process (events carry only the id); a
        DM's is the person's name. Unknown (no ``channels:read``, Slack down) it is "": the console shows the id."""
        if channel.startswith("D"):
            return direct_with
        if channel in self._titles:
            return self._titles[channel]
        title = ""
        if self._token_refused is not None:
            return title  # not kept: asked again once the operator set a token Slack takes
        try:
            found = await self.client.conversations_info(channel=channel)
            name = (found.get("channel") or {}).get("name")
            title = f"#{name}" if isinstance(name, str) and name else ""
        except Exception as exc:  # a name is a nicety: the message goes on without it
            if refuses_token(exc):
                self._refuse_token("channel_title", exc)
            count_failure("channel_title", PLATFORM)
            log.info("slack.channel_title_unknown", channel=channel, error=error_code(exc) or type(exc).__name__)
        if len(self._titles) < 10_000:
            self._titles[channel] = title
        return title

    async def respond(self, url: str, text: str) -> None:
        """Say ``text`` (mrkdwn) privately to whoever pressed, through the press's ``response_url``: no token, so
        also while Slack refuses the bot token (the kit's call, not :meth:`call`, which refuses at once then)."""
        session = self._session
        if session is None:
            raise self.refuse("press_reply", "the adapter is not started", retryable=True)

        async def post() -> None:
            body = {"text": text, "response_type": "ephemeral", "replace_original": False}
            async with session.post(url, json=body, allow_redirects=False, proxy=self._proxy_for(url)) as response:
                if response.status != 200:  # counted once, by the kit's call
                    raise PlatformError(
                        PLATFORM, "press_reply", f"the response URL answered HTTP {response.status}", retryable=False
                    )

        await PlatformBase.call(self, "press_reply", None, post, paced=False)

    def _proxy_for(self, url: str) -> str | None:
        """The proxy a call to ``url`` goes through, as slack_sdk's calls go: HTTP(S)_PROXY unless NO_PROXY names
        its host. The adapter's session does not read the environment: a response URL posted to directly where
        the proxy is the only way out left the presser told nothing while Slack refused the bot token."""
        host = urlsplit(url).hostname or ""
        return None if self._env_proxy is None or (host and proxy_bypass(host)) else self._env_proxy

    def _fetcher(self, url: str) -> Callable[[], Awaitable[bytes]]:
        async def fetch() -> bytes:
            session = self._session
            if session is None:
                raise self.refuse("file_fetch", "the adapter is not started", retryable=True)

            async def download() -> bytes:
                headers = {"Authorization": f"Bearer {self.config.bot_token}"}
                async with session.get(
                    url, headers=headers, allow_redirects=False, proxy=self._proxy_for(url)
                ) as response:
                    if response.status != 200:
                        raise download_refused(
                            response.status, response.headers.get("Retry-After"), response.headers.get("Location")
                        )
                    return await response.read()

            return await self.call("file_fetch", None, download, paced=False)

        return fetch

    async def _on_command(self, ack: AsyncAck, command: dict[str, Any]) -> None:
        channel = str(command.get("channel_id", ""))
        user = str(command.get("user_id", ""))
        raw = str(command.get("text") or "")
        trigger = command.get("trigger_id")
        inbound = Inbound(
            platform=PLATFORM,
            chat=channel,
            message_id=str(trigger or f"cmd-{uuid.uuid4().hex}"),
            author=self.actor(user),
            author_name=str(command.get("user_name") or user),
            text=unescape(raw).strip(),
            mentions=mentions_in(raw),
            command=str(command.get("command") or "/swarm").removeprefix("/"),
            is_admin=self.is_admin(user),
            # A command typed in a DM is a DM: dm_policy decides, as for a message there ("*" serves every
            # channel the bot is in, never every person who writes to it).
            direct=command.get("channel_name") == "directmessage" or channel.startswith("D"),
        )
        if not await self.screen(inbound):
            await ack(text=NOT_SERVED)
            return
        # Slack gives a slash command 3 seconds; the swarm's work starts after the ack.
        await ack()
        with self.tracking():
            await self.deliver(inbound, key=f"command:{trigger}" if trigger else None)

    async def _on_action(
        self, ack: AsyncAck, body: dict[str, Any], action: dict[str, Any], context: dict[str, Any]
    ) -> None:
        # Acknowledge before any work: a slow decision must not cost the 3-second window.
        await ack()
        with self.tracking():
            user = str((body.get("user") or {}).get("id", ""))
            channel = str(
                (body.get("channel") or {}).get("id") or (body.get("container") or {}).get("channel_id") or ""
            )
            message_ts = (body.get("container") or {}).get("message_ts") or (body.get("message") or {}).get("ts")
            press = Press(
                platform=PLATFORM,
                data=str(action.get("value") or ""),
                actor=self.actor(user),
                chat=channel or None,
                message_id=str(message_ts) if message_ts else None,
                is_admin=self.is_admin(user),
                signed=tuple(context.get(_SIGNED, ())),
            )
            responds = body.get("response_url")
            reply = _EphemeralReply(
                self, channel, user, responds if isinstance(responds, str) else None, press.message_id
            )
            await self.press(press, reply, key=interaction_key(body, action))

    async def _on_deny_reason(self, ack: AsyncAck, body: dict[str, Any], action: dict[str, Any]) -> None:
        """ "Deny with reason": a modal asks for it (Slack keeps where the card is in the view's metadata)."""
        await ack()
        with self.tracking():
            request_id = reason_request(str(action.get("value") or ""))
            trigger = body.get("trigger_id")
            if request_id is None or not trigger:
                return
            channel = str(
                (body.get("channel") or {}).get("id") or (body.get("container") or {}).get("channel_id") or ""
            )
            message_ts = (body.get("container") or {}).get("message_ts") or (body.get("message") or {}).get("ts")
            user = str((body.get("user") or {}).get("id", ""))
            refusal = await self._reason_refusal(self.actor(user), request_id)
            if refusal is not None:
                # Told now, privately, not after typing a reason into a modal whose Deny would not count.
                log.info("slack.reason_refused", actor=self.actor(user), request_id=request_id)
                # The response URL too: with the bot token refused it is the one way they hear it.
                responds = body.get("response_url")
                reply = _EphemeralReply(self, channel, user, responds if isinstance(responds, str) else None)
                with contextlib.suppress(PlatformError):
                    await reply.notify(refusal)
                return
            meta = json.dumps({"data": deny_data(request_id), "channel": channel, "ts": message_ts})
            view = {
                "type": "modal",
                "callback_id": REASON_VIEW,
                "private_metadata": meta,
                "title": {"type": "plain_text", "text": REASON_TITLE[:24]},
                "submit": {"type": "plain_text", "text": REASON_SUBMIT},
                "close": {"type": "plain_text", "text": "Cancel"},
                "blocks": [
                    {
                        "type": "input",
                        "block_id": REASON_BLOCK,
                        "label": {"type": "plain_text", "text": REASON_LABEL[:2000]},
                        "element": {
                            "type": "plain_text_input", "action_id": REASON_INPUT, "multiline": True,
                            "max_length": REASON_MAX,
                        },
                    }
                ],
            }  # fmt: skip
            try:
                await self.call(
                    "reason_modal",
                    channel or None,
                    lambda: self.client.views_open(trigger_id=trigger, view=view),
                    paced=False,
                )
            except PlatformError:
                responds = body.get("response_url")
                if self.setup_refused is None or not isinstance(responds, str):
                    raise
                # The press's response URL needs no token: they learn the form will not come, not nothing at all.
                await self.respond(responds, escape(REASON_FORM_REFUSED))

    async def _on_reason(self, ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
        """The modal was submitted: the Deny, with the words, through the one press policy.

        While Slack refuses the bot token, the submission is acknowledged only once the Deny is answered (within
        Slack's 3 seconds), with the modal replaced by that answer: a submission has no response URL, the card is
        not edited and ``chat.postEphemeral`` is refused, so the acknowledgement, which needs no token, is the one
        way the presser hears what their Deny did."""
        refused = self.setup_refused is not None
        if not refused:
            await ack()
        with self.tracking():
            try:
                meta = json.loads(str(view.get("private_metadata") or "{}"))
            except ValueError:
                if refused:
                    await ack()
                return
            user = str((body.get("user") or {}).get("id", ""))
            values = ((view.get("state") or {}).get("values") or {}).get(REASON_BLOCK) or {}
            reason = str((values.get(REASON_INPUT) or {}).get("value") or "")
            channel = str(meta.get("channel") or "")
            press = Press(
                platform=PLATFORM,
                data=str(meta.get("data") or ""),
                actor=self.actor(user),
                chat=channel or None,
                message_id=str(meta["ts"]) if meta.get("ts") else None,
                is_admin=self.is_admin(user),
                reason=reason,
            )
            key = f"view:{view.get('id')}" if view.get("id") else None
            if not refused:
                await self.press(press, _EphemeralReply(self, channel, user), key=key)
                return
            answer = _ModalReply()
            self.spawn(self._decide_reason(press, answer, key), name="kazma-slack-reason")
            with contextlib.suppress(TimeoutError):
                await bounded(answer.done.wait(), REASON_ANSWER_WITHIN)
            if answer.said is None:
                log.info("slack.reason_answer_late", actor=press.actor)
            await ack(response_action="update", view=_answer_view(answer.said or REASON_UNANSWERED))

    async def _decide_reason(self, press: Press, answer: _ModalReply, key: str | None) -> None:
        try:
            await self.press(press, answer, key=key)
        finally:
            answer.done.set()  # also when nothing was said (another replica's press): the modal is not held

    # -- outbound ---------------------------------------------------------

    def _text_room(self, agent: str | None) -> tuple[int, Callable[[str], int] | None]:
        return MAX_MESSAGE_TEXT - len(escape(agent_prefix(agent))), escaped_units

    async def _post_text(self, chat: str, part: str, *, agent: str | None, thread: str | None) -> Posted:
        columns = isinstance(part, Columns)

        def shown(text: str) -> str:  # escaped; columns in a code block, its own backticks unable to close it
            if not columns:
                return escape(text)
            return f"{CODE_FENCE}\n{escape(text).replace('`', '`' + ZWSP)}\n{CODE_FENCE}"

        if agent and self._customize:
            try:
                response = await self.call(
                    "send",
                    chat,
                    lambda: self._optional(
                        self.client.chat_postMessage(
                            channel=chat, text=shown(part), thread_ts=thread, username=agent, icon_emoji=AGENT_ICON
                        )
                    ),
                )
                return Posted(chat, str(response.get("ts")))
            except PlatformError as exc:
                if not isinstance(exc.__cause__, _FallBack):
                    raise
                # Without chat:write.customize the agent is named in the text instead.
                self._customize = False
                log.warning("slack.identity_unavailable", channel=chat, agent=agent, error=exc.__cause__.code)
        body = escape(agent_prefix(agent)) + shown(part)
        response = await self.call(
            "send", chat, lambda: self.client.chat_postMessage(channel=chat, text=body, thread_ts=thread)
        )
        return Posted(chat, str(response.get("ts")))

    edits_text = True

    async def _edit_text(self, chat: str, message_id: str, part: str, *, agent: str | None, thread: str | None) -> None:
        # as it was posted: under the agent's own name, or with the name in the text
        named = "" if agent and self._customize else escape(agent_prefix(agent))
        await self.call(
            "stream", chat, lambda: self.client.chat_update(channel=chat, ts=message_id, text=named + escape(part))
        )  # paced like a post: a reply growing in a channel is held to the channel's pace

    @staticmethod
    async def _optional(call: Any) -> Any:
        try:
            return await call
        except Exception as exc:
            if (code := error_code(exc)) in NO_CUSTOM_IDENTITY:
                raise _FallBack(code) from exc
            raise

    async def _post_file(self, chat: str, name: str, data: bytes, *, caption: str, thread: str | None) -> str:
        # files_upload_v2: getUploadURLExternal, the upload itself, then completeUploadExternal shares it here.
        response = await self.call(
            "send_file",
            chat,
            lambda: self.client.files_upload_v2(
                channel=chat, content=data, filename=name, title=name, initial_comment=escape(caption), thread_ts=thread
            ),
        )
        shared = response.get("file") or {}
        return str(shared.get("id") or "")

    async def _show_working(self, chat: str, thread: str | None) -> None:
        # The Web API has no typing indicator for apps (RTM's is gone): the agent's reply is the sign.
        return None

    def _question_room(self) -> tuple[int, Callable[[str], int] | None]:
        return MAX_SECTION_TEXT, escaped_units  # a question is one section block: its limit, below a message's

    async def _post_choices(
        self, chat: str, body: str, choices: Sequence[tuple[str, str]], *, thread: str | None
    ) -> str:
        text = escape(body)
        blocks = choice_blocks(text, choices)
        response = await self.call(
            "send", chat, lambda: self.client.chat_postMessage(channel=chat, text=text, blocks=blocks, thread_ts=thread)
        )
        return str(response.get("ts"))

    async def direct_chat(self, user: str) -> str:
        """The app's direct-message channel with ``user`` (``conversations.open``; the same one every time)."""
        response = await self.call("card_dm", None, lambda: self.client.conversations_open(users=user))
        channel = response.get("channel")
        found = channel.get("id") if isinstance(channel, dict) else None
        if not isinstance(found, str) or not found:
            raise self.refuse("card_dm", f"conversations.open gave no channel for {user}")
        return found

    def _write_card(self, card: ApprovalCard, outcome: Outcome | None) -> LaidOut[Any]:
        return render_card(card, outcome=outcome, approve_partial=self.approve_partial)

    async def _post_card(self, chat: str, laid: LaidOut[Any], card: ApprovalCard) -> Posted:
        written = laid.written
        response = await self.call(
            "card_post",
            chat,
            lambda: self._card_client.chat_postMessage(
                channel=chat, text=written.text, blocks=written.blocks, unfurl_links=False, unfurl_media=False
            ),
        )
        return Posted(chat, str(response.get("ts")))

    async def _edit_card(
        self, site: str, ref: CardRef, laid: LaidOut[Any], card: ApprovalCard, *, settled: bool
    ) -> bool:
        written = laid.written  # its blocks hold the buttons while the card is open, none once settled
        await self.call(
            site,
            ref.chat,
            lambda: self.client.chat_update(
                channel=ref.chat, ts=ref.message_id, text=written.text, blocks=written.blocks
            ),
            paced=False,  # chat.update is not limited per channel like chat.postMessage
        )
        if settled:
            self._card_edited(ref.chat, ref.message_id)
        return True
