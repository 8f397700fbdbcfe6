"""The Discord adapter, on discord.py's plain ``Client``: transport and lifecycle only.

Why a plain ``Client`` and not ``discord.ext.commands.Bot``: the commands
extension drops messages whose author is a bot, and our own sub-agent
dispatches are bot messages that must reach the router. Every message in a
served channel is delivered with ``from_bot`` set; the router decides.

Buttons are not tracked by per-message ``View`` objects. A card's buttons carry
``kz1:<id>:a|d`` and every press is taken from the raw ``on_interaction``
event, so a card posted before a restart still works after it and memory does
not grow with every card.

The gateway is the singleton ingress: messages and presses reach only the
replica connected to it (the leader), while every replica logs in over REST
(``Client.login``) and posts, edits and sends through partial messageables,
which need no gateway cache. Opening the ingress runs ``Client.connect`` as a
task until READY; closing it cancels that task and closes the websocket, and
the REST client stays logged in.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import time
from collections.abc import Awaitable, Callable, Sequence
from types import SimpleNamespace
from typing import Any, Final, TypeVar, Unpack

import aiohttp
import discord
import structlog
import yarl
from discord import app_commands

from kazma.adapters import call_note
from kazma.adapters.card_layout import LaidOut, agent_prefix
from kazma.adapters.chat_commands import CHAT_COMMANDS, ChatCommand
from kazma.adapters.chat_text import COLUMNS_FENCES, Columns, split_text
from kazma.adapters.contract import CardRef, PlatformError, Press
from kazma.adapters.deny_reason import (
    REASON_LABEL,
    REASON_MAX,
    REASON_TITLE,
    REPLY_WINDOW_SECONDS,
    deny_data,
    reason_request,
)
from kazma.adapters.discord.errors import (
    CALL_WITNESS,
    OPERATOR_FIX,
    PLATFORM,
    CallWitness,
    RateLimit,
    classify,
    closed_for_a_setting,
    describe,
    rate_limit_of,
    refuses_token,
    route_of,
)
from kazma.adapters.discord.inbound import (
    PRESS_PREFIXES,
    channel_chat,
    command_inbound,
    kept_message,
    message_inbound,
    modal_value,
    revived_message,
)
from kazma.adapters.discord.render import (
    CONTENT_MAX,
    NO_MENTIONS,
    card_footer,
    clip,
    code_block,
    escape_text,
    neutralise_mentions,
    render_card,
)
from kazma.adapters.discord.webhooks import AgentWebhooks
from kazma.adapters.ingress import REPLAY_WINDOW, SignedRequests
from kazma.adapters.kit import NOT_SERVED, KitOptions, PlatformBase, Posted
from kazma.adapters.pacing import ChatRateLimiter, Pacing
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome
from kazma.config.metrics import count_failure
from kazma.config.models import DiscordConfig

STREAM_EDIT_GAP: Final = 1.0  # seconds between two edits of a streamed reply in one channel

log = structlog.get_logger("kazma.adapters.discord")


T = TypeVar("T")

# What discord.py ships with; an empty ``gateway_url`` means "the platform's default".
DEFAULT_API_BASE: Final = "https://discord.com/api/v10"
DEFAULT_GATEWAY: Final = "wss://gateway.discord.gg/"
NONCE_LENGTH: Final = 25  # Discord's limit for a message nonce
# How many of a channel's latest messages are read looking for a card whose nonce Discord forgot (one request).
FIND_CARD_MESSAGES: Final = 100
# Discord allows a bot 1,000 gateway session starts (IDENTIFY) a day and resets the token of one that goes past
# them. A gateway closed for a setting (an intent switched off in the portal) is refused again until the operator
# changes it, so it is opened again at most this often: 288 a day, not the ingress check's 2,880 (every 30 s).
SETUP_CLOSE_RETRY: Final = 300.0


def card_nonce(request_id: str, channel: str) -> str:
    """The nonce of a request's card in ``channel``: the same for every attempt at that post, and no other's."""
    digest = hashlib.sha256(f"kazma-card:{request_id}:{channel}".encode()).digest()
    return base64.urlsafe_b64encode(digest).decode()[:NONCE_LENGTH]


def _chunks(safe: str, limit: int, *, columns: bool) -> list[str]:
    """``safe`` in messages of at most ``limit`` characters; columns each in a code block (its fences counted)."""
    if not columns:
        return split_text(safe, limit)
    return [code_block(part) for part in split_text(safe, limit - COLUMNS_FENCES)]


class _Client(discord.Client):
    """discord.py calls ``on_<event>`` methods; each forwards to the adapter."""

    def __init__(self, adapter: DiscordAdapter, *, guild_ready_timeout: float, http_trace: aiohttp.TraceConfig) -> None:
        intents = discord.Intents.none()
        intents.guilds = True
        intents.guild_messages = True
        intents.message_content = True
        intents.dm_messages = True  # direct messages with the lead (served only as dm_policy allows)
        super().__init__(
            intents=intents,
            allowed_mentions=NO_MENTIONS,
            guild_ready_timeout=guild_ready_timeout,
            # Longer waits raise RateLimited (with retry_after) instead of sleeping inside a call.
            max_ratelimit_timeout=30.0,
            http_trace=http_trace,  # what each call's requests were answered (a 429 it waits out)
        )
        self.adapter = adapter
        self.tree: app_commands.CommandTree[_Client] = app_commands.CommandTree(self)
        adapter._register_commands(self.tree)

    async def setup_hook(self) -> None:
        await self.adapter._sync_commands(self.tree)

    async def on_connect(self) -> None:
        self.adapter._guilds_arrived(self)

    async def on_guild_available(self, guild: discord.Guild) -> None:
        self.adapter._guilds_arrived(self)

    async def on_ready(self) -> None:  # discord.py's own: a guild Discord never sent ends its wait
        self.adapter._ready.set()

    async def on_message(self, message: discord.Message) -> None:
        await self.adapter._on_message(message)

    async def on_interaction(self, interaction: discord.Interaction[_Client]) -> None:
        await self.adapter._on_interaction(interaction)


REASON_INPUT = "reason"  # the modal's text input


class _FollowupReply:
    """A press on Discord was deferred already (type 6); the card edit answers the winner, others hear privately."""

    def __init__(self, adapter: DiscordAdapter, interaction: discord.Interaction[_Client]) -> None:
        self.adapter = adapter
        self.interaction = interaction

    async def acknowledge(self, text: str) -> None:
        return None  # the card, edited for everyone within moments, says it

    async def notify(self, text: str) -> None:
        await self.adapter.call(
            "press_reply",
            None,
            lambda: self.interaction.followup.send(
                clip(neutralise_mentions(text), CONTENT_MAX), ephemeral=True, allowed_mentions=NO_MENTIONS
            ),
            timeout=self.adapter.request_timeout,
        )


class DiscordAdapter(PlatformBase):
    """``PlatformAdapter`` for Discord: a gateway bot plus REST, on discord.py."""

    name = PLATFORM

    def __init__(
        self,
        config: DiscordConfig,
        *,
        # discord.py dispatches READY this long after the last guild arrived (its own default is 2 s, all of it
        # in every start). Kazma does not wait for it: the gateway serves once every guild READY named has
        # arrived (:meth:`_guilds_arrived`); this only bounds a guild Discord never sends.
        guild_ready_timeout: float = 0.5,
        request_timeout: float = 10.0,
        start_timeout: float = 60.0,
        sync_commands: bool = True,
        **options: Unpack[KitOptions],
    ) -> None:
        # discord.py keeps Discord's per-route buckets itself; Kazma only waits out a 429 it gives up on.
        super().__init__(config, pacing=Pacing(None), **options)
        # Discord allows 5 edits of messages in a channel per 5 s: a reply growing by edits keeps under that.
        self.stream_edits = ChatRateLimiter(min_interval=STREAM_EDIT_GAP, per_window=5, window=5.0)
        self.config: DiscordConfig = config
        self._guild_ready_timeout = guild_ready_timeout
        self.request_timeout = request_timeout
        self._start_timeout = start_timeout
        self._sync_commands_enabled = sync_commands
        self._client: _Client | None = None
        # Why the gateway ended for good (Discord's close code, as discord.py told it); None while it serves
        self._ended: str | None = None
        # Discord refused the bot token while Kazma ran, and what the operator does about it: the token comes from
        # the configuration, so until a restart every login, post or gateway try with it is refused again (and
        # each 401 counts towards Discord's limit of invalid requests, past which it blocks the host's address).
        self._token_refused: str | None = None
        # When Discord last closed the gateway for a setting (``time.monotonic``); None once it serves again
        self._setting_closed_at: float | None = None
        # A client discord.py closed is replaced by one login at a time: the ingress check and a refused call
        # (a follower's, which never opens the gateway) may both ask for it.
        self._renewing = asyncio.Lock()
        self._renewal: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._hooks = AgentWebhooks(self._rest)
        self._saved_endpoints: tuple[str, yarl.URL] | None = None
        self._last_429: RateLimit | None = None  # the last 429 Discord answered any call
        # Gateway events handled lately, by their id: Discord may deliver one again (around a RESUME, or during
        # its own incidents), and a message run twice or a press decided "lost" by its own winner must not follow.
        self._handled = SignedRequests(window=REPLAY_WINDOW)

    def classify(self, site: str, exc: BaseException) -> PlatformError:
        witness = CALL_WITNESS.get()
        now = time.monotonic()
        return classify(site, exc, timeout=self.request_timeout, witness=witness, held_by=self._last_429, now=now)

    async def call(
        self,
        site: str,
        chat: str | None,
        operation: Callable[[], Awaitable[T]],
        *,
        paced: bool = True,
        wait_out_429: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109 - per attempt, as the kit's
    ) -> T:
        """The kit's call, watched: a timeout while discord.py sleeps out a 429 is told as the rate limit it is."""
        witness = CallWitness()

        async def watched() -> T:
            try:
                return await operation()
            except BaseException as exc:
                self._reopen_global_lock(witness)
                if refuses_token(exc):
                    self._refuse_token(site, exc)
                    raise self._token_error(site, nothing_done=not witness.maybe_done) from exc
                raise

        token = CALL_WITNESS.set(witness)
        try:
            return await super().call(site, chat, watched, paced=paced, wait_out_429=wait_out_429, timeout=timeout)
        finally:
            CALL_WITNESS.reset(token)

    def _reopen_global_lock(self, witness: CallWitness) -> None:
        """A call ended (a timeout, a cancellation) while discord.py slept out a global 429: it closed its global
        lock for that sleep and reopens it only after the sleep, outside any ``finally``, so cut short it stays
        closed and every later request of the process waits on it for good. Reopen it when the limit ends."""
        limit = witness.waiting
        client = self._client
        if limit is None or not limit.is_global or client is None:
            return
        over = getattr(client.http, "_global_over", None)
        if not isinstance(over, asyncio.Event) or over.is_set():
            return
        log.warning("discord.global_limit_reopened", route=limit.route, retry_after=limit.retry_after)
        asyncio.get_running_loop().call_later(limit.left(time.monotonic()), over.set)

    def _http_trace(self) -> aiohttp.TraceConfig:
        """aiohttp's trace of discord.py's session: its callbacks run in the task making the request, so each
        adapter call sees its own requests (``CALL_WITNESS``), and the adapter the last 429 of any."""
        trace = aiohttp.TraceConfig()

        async def started(session: aiohttp.ClientSession, context: SimpleNamespace,
                          params: aiohttp.TraceRequestStartParams) -> None:  # fmt: skip
            witness = CALL_WITNESS.get()
            if witness is not None:
                witness.requests += 1
                witness.waiting = None  # discord.py waited it out and tried again
                witness.retrying = False
            call_note.moved("sent")

        async def answered(session: aiohttp.ClientSession, context: SimpleNamespace,
                           params: aiohttp.TraceRequestEndParams) -> None:  # fmt: skip
            route = f"{params.method} {route_of(params.url)}"
            limit = await rate_limit_of(params.response, route, time.monotonic())
            status = params.response.status
            witness = CALL_WITNESS.get()
            if witness is not None and not 400 <= status < 500:
                witness.maybe_done = True
            if limit is None:
                if status >= 500:  # discord.py tries a 5xx again after a pause: a timeout may end it meanwhile
                    failed = f"{route} with {status} {params.response.reason or ''}".rstrip()
                    call_note.answered(f"Discord answered {failed}")
                    witness = CALL_WITNESS.get()
                    if witness is not None:
                        witness.failed, witness.retrying = failed, True
                return
            scope = f", scope {limit.scope}" if limit.scope else ""
            call_note.answered(f"Discord answered {route} with 429{scope}", limit.retry_after)
            self._last_429 = limit
            witness = CALL_WITNESS.get()
            if witness is not None:
                witness.waiting = limit
            # Told when it happens: a bound around the whole call (the bus's) may end it without asking why.
            log.warning("discord.rate_limited", route=route, retry_after=limit.retry_after, scope=limit.scope,
                        via=params.response.headers.get("Via") is not None)  # fmt: skip

        async def dropped(session: aiohttp.ClientSession, context: SimpleNamespace,
                          params: aiohttp.TraceRequestExceptionParams) -> None:  # fmt: skip
            witness = CALL_WITNESS.get()
            if witness is not None:  # it may have reached Discord before the connection broke
                witness.maybe_done = True

        trace.on_request_start.append(started)
        trace.on_request_end.append(answered)
        trace.on_request_exception.append(dropped)
        return trace

    # ----------------------------------------------------------------- lifecycle

    @property
    def ingress_trouble(self) -> str | None:
        return self._ended

    @property
    def setup_refused(self) -> str | None:
        return self._token_refused

    def _refuse_token(self, site: str, exc: BaseException) -> None:
        """Discord refused the bot token (a 401 on a login or on a call of the bot's): said and counted once, and
        from now on nothing is tried with it (see ``_token_refused``). A gateway closed with 4004 alone does not
        say it: the login that follows it asks Discord's REST, and only its 401 does."""
        if self._token_refused is not None:
            return
        after = f", after the gateway closed ({self._ended})" if self._ended else ""
        self._token_refused = f"Discord refused the bot token ({describe(exc)}{after}): {OPERATOR_FIX}"
        count_failure("token_refused", PLATFORM)
        log.error("discord.token_refused", site=site, error=describe(exc), gateway=self._ended, fix=OPERATOR_FIX)

    def _token_error(self, site: str, *, nothing_done: bool = True) -> PlatformError:
        # Retryable, as for a platform whose start was refused: a card post or edit stays in the outbox (nothing goes
        # out to Discord meanwhile) and lands after the operator's restart with a new token. Given up for good, the
        # card never came to Discord, and a card decided meanwhile kept its buttons there.
        # ``nothing_done`` False: the 401 answered discord.py's own retry of a request Discord may have done (a 5xx
        # after it made the card): that card may be out there, so the post is an attempt (found by its nonce later).
        return PlatformError(
            PLATFORM, site, self._token_refused or "", retryable=True, operator_must_act=True, nothing_done=nothing_done
        )

    @property
    def has_singleton_ingress(self) -> bool:
        return True  # Discord has no HTTP ingress here: everything inbound comes over the gateway

    async def _connect(self) -> None:
        """Log in over REST (the bot user, the application, the command sync): enough to post and edit."""
        if not self.config.token:
            raise PlatformError(PLATFORM, "start", "no bot token configured", retryable=False)
        self._token_refused = None  # a start is the operator's "try again"
        self._ready = asyncio.Event()
        self._point_library_at_config()
        self._client = await self._login()

    async def _login(self) -> _Client:
        """A new discord.py client, logged in over REST; it replaces the adapter's only once logged in (a renewal
        that fails leaves the closed one, whose calls say why nothing is sent)."""
        client = _Client(self, guild_ready_timeout=self._guild_ready_timeout, http_trace=self._http_trace())
        try:
            async with asyncio.timeout(self._start_timeout):
                await client.login(self.config.token)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await client.close()
            if isinstance(exc, TimeoutError):
                message = f"no login within {self._start_timeout:g} s"
                raise PlatformError(PLATFORM, "start", message, retryable=True) from exc
            if refuses_token(exc):
                self._refuse_token("login", exc)
            raise
        user = client.user
        log.info("discord.logged_in", user_id=user.id if user else None)
        return client

    async def _renew(self) -> None:
        """A new client in place of one discord.py closed with the gateway (after a close it does not reconnect
        after: 4004, 4010-4013), which can never connect nor post again. REST needs no gateway: a replica that
        no longer leads, and so never opens the gateway again, posts with the new one."""
        async with self._renewing:
            closed = self._client
            if closed is None or not closed.is_closed() or self._token_refused is not None:
                return  # renewed meanwhile, stopped, or the token was refused: only the operator can help
            log.warning("discord.client_renewed", reason=self._ended)
            client = await self._login()
            if self._stopping or self._client is not closed:  # stopped while it logged in: nobody would close it
                with contextlib.suppress(Exception):
                    await client.close()
                return
            self._client = client
            # The channels' webhooks were fetched with the closed client and post through its closed session
            self._hooks.clear()

    def _renew_soon(self) -> None:
        if self._token_refused is not None:
            return
        if self._renewal is None or self._renewal.done():
            self._renewal = self.spawn(self._renew_or_say(), name="kazma-discord-renew")

    async def _renew_or_say(self) -> None:
        try:
            await self._renew()
        except Exception as exc:  # the next refused call asks again, and a leader's ingress check too
            count_failure("client_renew", PLATFORM)
            log.warning("discord.client_renew_failed", error=describe(exc))

    def _guilds_arrived(self, client: _Client) -> None:
        """READY named the bot's guilds (unavailable until each one's GUILD_CREATE): once every one has arrived,
        its channels are cached and events flow, so the gateway serves. discord.py's own READY comes a
        ``guild_ready_timeout`` of silence later, which every start would otherwise wait out."""
        if client is self._client and all(not guild.unavailable for guild in client.guilds):
            self._ready.set()

    async def _open_ingress(self) -> None:
        """The gateway, until every guild has arrived (the guilds and channels cached, the bot's webhooks usable)."""
        client = self._client
        if client is None:
            raise self.refuse("ingress_start", "not logged in", retryable=True)
        if self._token_refused is not None:
            raise self._token_error("ingress_start")
        self._wait_for_the_setting()
        if client.is_closed():
            # discord.py closes its whole client (its REST session too) after a close it does not reconnect after
            # (4004, 4010-4013): that client can never connect again, so a new one logs in first.
            await self._renew()
            client = self._client
            if client is None or client.is_closed():
                raise self.refuse("ingress_start", "the adapter stopped while it logged in again", retryable=True)
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(client.connect(reconnect=True), name="kazma-discord-gateway")
        ready = asyncio.create_task(self._ready.wait(), name="kazma-discord-ready")
        done, _ = await asyncio.wait(
            {self._task, ready}, timeout=self._start_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if ready in done:
            log.info("discord.ready", user_id=client.user.id if client.user else None, guilds=len(client.guilds))
            self._ended = None
            self._setting_closed_at = None
            self._task.add_done_callback(self._gateway_ended)
            self.spawn(self._hand_over_kept(), name="kazma-discord-kept")
            return
        ready.cancel()
        task = self._task
        failure = task.exception() if task in done and not task.cancelled() else None
        if failure is not None:
            if closed_for_a_setting(failure):
                self._setting_closed_at = time.monotonic()
            raise self.classify("start", failure)
        if task in done:
            raise PlatformError(PLATFORM, "start", "the gateway closed before READY", retryable=True)
        raise PlatformError(PLATFORM, "start", f"no READY within {self._start_timeout:g} s", retryable=True)

    def _wait_for_the_setting(self) -> None:
        """Refuse to IDENTIFY again within ``SETUP_CLOSE_RETRY`` of a close for a setting (see there)."""
        if self._setting_closed_at is None:
            return
        left = self._setting_closed_at + SETUP_CLOSE_RETRY - time.monotonic()
        if left > 0:
            why = self._ended or "Discord closed the gateway for a setting"
            message = f"{why}; opened again in {left:.0f} s (at most every {SETUP_CLOSE_RETRY:g} s: Discord resets "
            message += "the token of a bot past 1,000 gateway starts a day)"
            raise PlatformError(PLATFORM, "ingress_start", message, retryable=True, operator_must_act=True)

    def _gateway_ended(self, task: asyncio.Task[None]) -> None:
        """The gateway loop ended by itself, not by a close here (which lets go of it first): Discord closed the
        session with a code discord.py does not reconnect after (4004: the token was reset; 4014: an intent no
        longer allowed). Nothing comes in from Discord any more: logged and counted, and the ingress is no longer
        running (a leader's ingress check sees it missing). It ended unseen, the adapter still saying it ran."""
        if task is not self._task or task.cancelled():
            return
        error = task.exception()
        self._task = None
        self._ingress = False
        self._ended = describe(error) if error is not None else "the gateway loop returned"
        if closed_for_a_setting(error):
            self._setting_closed_at = time.monotonic()
        count_failure("ingress_lost", PLATFORM)
        log.error("discord.gateway_ended", error=self._ended, code=getattr(error, "code", None))
        if self._client is not None and self._client.is_closed():
            self._renew_soon()  # posting goes on before (or without: a follower) the gateway is opened again

    async def _close_ingress(self) -> None:
        """Cancel the gateway loop (so it does not reconnect) and close its websocket; REST stays logged in."""
        task, self._task = self._task, None
        self._ready.clear()
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the gateway's own failure was reported by start_ingress or its logs
                log.debug("discord.gateway_ended", error=describe(exc))
        client = self._client
        if client is not None and client.ws is not None and client.ws.open:
            await client.ws.close(code=1000)
        # Events dispatched just before the close run as tasks of their own: let them reach the kit's
        # tracking (each takes it on its first step) before the caller waits for tracked work.
        await asyncio.sleep(0)

    async def _stop_receiving(self) -> None:
        client, task = self._client, self._task
        self._client = None
        self._task = None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        if task is not None:
            try:
                async with asyncio.timeout(5.0):
                    await task
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            except Exception as exc:  # the client's own failure was reported by start() or its logs
                log.debug("discord.client_ended", error=describe(exc))

    async def _disconnect(self) -> None:
        self._hooks.clear()
        self._restore_library_endpoints()

    def _point_library_at_config(self) -> None:
        """Aim discord.py at the configured REST base and gateway.

        discord.py has no constructor option for either: every REST, interaction
        and webhook route is built from the class attribute ``Route.BASE`` and
        the first gateway connection uses ``DiscordWebSocket.DEFAULT_GATEWAY``.
        Both are process-wide, which is fine because a process runs one Discord
        bot; the previous values are restored on stop.
        """
        gateway_cls = discord.gateway.DiscordWebSocket
        if self._saved_endpoints is None:
            self._saved_endpoints = (discord.http.Route.BASE, gateway_cls.DEFAULT_GATEWAY)
        discord.http.Route.BASE = self.config.api_base_url.rstrip("/") or DEFAULT_API_BASE
        gateway_cls.DEFAULT_GATEWAY = yarl.URL(self.config.gateway_url or DEFAULT_GATEWAY)

    def _restore_library_endpoints(self) -> None:
        if self._saved_endpoints is not None:
            discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = self._saved_endpoints
            self._saved_endpoints = None

    # ----------------------------------------------------------------- commands

    def _register_commands(self, tree: app_commands.CommandTree[_Client]) -> None:
        for command in CHAT_COMMANDS:
            tree.add_command(self._slash_command(command))

    def _slash_command(self, command: ChatCommand) -> app_commands.Command[Any, Any, None]:
        # discord.py reads a command's options off its callback's parameters: one with ``args``, one without
        adapter, name = self, command.name
        if command.usage:

            @app_commands.describe(args=command.usage_example or command.usage)
            async def with_args(interaction: discord.Interaction[_Client], args: str = "") -> None:
                await adapter._on_command(interaction, name, args)

            return app_commands.Command(name=name, description=command.summary, callback=with_args)

        async def bare(interaction: discord.Interaction[_Client]) -> None:
            await adapter._on_command(interaction, name, "")

        return app_commands.Command(name=name, description=command.summary, callback=bare)

    async def _sync_commands(self, tree: app_commands.CommandTree[_Client]) -> None:
        if not self._sync_commands_enabled:
            return
        # A failed sync must not stop the bot: messages and buttons work without it.
        with contextlib.suppress(PlatformError):
            commands = await self.call("commands", None, tree.sync, timeout=self.request_timeout)
            log.info("discord.commands_synced", commands=[c.name for c in commands])

    def _first_delivery(self, key: str) -> bool:
        """Whether the gateway event ``key`` arrives here for the first time (within the replay window)."""
        if self._handled.first_time([key]):
            return True
        log.info("discord.event_repeated", key=key)
        return False

    async def _on_command(self, interaction: discord.Interaction[_Client], name: str, args: str) -> None:
        if not self._first_delivery(f"interaction:{interaction.id}"):
            return
        with self.tracking():
            chat, thread = self._interaction_chat(interaction)
            inbound = None
            if chat is not None:
                inbound = command_inbound(
                    interaction, chat, thread, name, args, actor=self.actor, is_admin=self.is_admin
                )
            if not self.started or inbound is None or not await self.screen(inbound, space=interaction.guild_id):
                with contextlib.suppress(PlatformError):
                    await self._rest(
                        "command",
                        lambda: interaction.response.send_message(
                            NOT_SERVED, ephemeral=True, allowed_mentions=NO_MENTIONS
                        ),
                    )
                return
            try:
                # Acknowledge before any work: Discord gives an interaction three seconds.
                await self._rest("command", lambda: interaction.response.defer(thinking=True))
            except PlatformError:
                return  # the user was shown a failure; running the command anyway would surprise them
            delivered = await self.deliver(inbound, key=f"interaction:{interaction.id}", space=interaction.guild_id)
            if not delivered:
                return
            reply = clip(f"Received /{name} {escape_text(args)}".rstrip(), CONTENT_MAX)
            with contextlib.suppress(PlatformError):
                await self._rest("command", lambda: interaction.followup.send(reply, allowed_mentions=NO_MENTIONS))

    # ----------------------------------------------------------------- inbound

    def _interaction_chat(self, interaction: discord.Interaction[_Client]) -> tuple[int | None, int | None]:
        if interaction.channel_id is None:
            return None, None
        return channel_chat(interaction.channel, interaction.channel_id)

    async def _on_message(self, message: discord.Message) -> None:
        if message.type not in (discord.MessageType.default, discord.MessageType.reply):
            return
        if not self._first_delivery(f"message:{message.id}"):
            return
        with self.tracking():
            inbound = message_inbound(message, actor=self.actor, is_admin=self.is_admin, fetcher=self._fetcher)
            space = message.guild.id if message.guild else None
            # ``guilds`` narrows every served channel, ``"*"`` included, to those servers: the door's space check.
            # The gateway never delivers a message again, to this replica or the next leader: it is kept with
            # its claim, so a leader taking over from a replica that died before taking it in hands it over.
            handlers = self._handlers
            claimed = handlers is not None and handlers.claim_inbound is not None  # among replicas only
            kept = kept_message(inbound, message, space) if claimed else None
            await self.deliver(inbound, key=f"message:{message.id}", space=space, kept=kept)

    async def _hand_over_kept(self) -> None:
        """Messages a gone leader claimed and never took in, now this replica's (the claims took them over):
        each through the door again, which lets it through once here, in the order they were claimed."""
        handlers = self._handlers
        inbox = None if handlers is None else handlers.inbox
        if inbox is None:
            return
        try:
            kept = await inbox.unfinished(PLATFORM)
        except Exception as exc:
            count_failure("inbound_inbox", PLATFORM)
            log.warning("discord.kept_unread", error=describe(exc))
            return
        for payload in kept:
            try:
                inbound, space = revived_message(payload, fetcher=self._cdn_fetcher)
            except (ValueError, KeyError, TypeError) as exc:
                count_failure("inbound_inbox", PLATFORM)
                log.warning("discord.kept_unreadable", error=describe(exc))
                continue
            log.warning("discord.message_taken_over", message_id=inbound.message_id, chat=inbound.chat)
            await self.deliver(inbound, key=f"message:{inbound.message_id}", space=space)
        log.info("discord.kept_handed_over", messages=len(kept))

    def _cdn_fetcher(self, url: str) -> Callable[[], Awaitable[bytes]]:
        async def fetch() -> bytes:
            data: bytes = await self._rest("file_fetch", lambda: self._connected("file_fetch").http.get_from_cdn(url))
            return data

        return fetch

    def _fetcher(self, attachment: discord.Attachment) -> Callable[[], Awaitable[bytes]]:
        async def fetch() -> bytes:
            data: bytes = await self._rest("file_fetch", attachment.read)
            return data

        return fetch

    async def _on_interaction(self, interaction: discord.Interaction[_Client]) -> None:
        if interaction.type is discord.InteractionType.modal_submit and interaction.data:
            if self._first_delivery(f"interaction:{interaction.id}"):
                await self._on_reason(interaction)
            return
        if interaction.type is not discord.InteractionType.component or not interaction.data:
            return
        custom_id = interaction.data.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id.startswith(PRESS_PREFIXES):
            return
        if not self._first_delivery(f"interaction:{interaction.id}"):
            return
        asked = reason_request(custom_id)
        if asked is not None:
            await self._ask_reason(interaction, asked)
            return
        await self._take_press(interaction, custom_id)

    async def _take_press(
        self, interaction: discord.Interaction[_Client], custom_id: str, reason: str | None = None
    ) -> None:
        """A button's press, or a reason modal's Deny, through the one press policy."""
        with self.tracking():
            # Acknowledge first (type 6, deferred update): a slow store must not cost the 3 s window.
            # The press is real even if the acknowledgement failed, so it is still decided.
            with contextlib.suppress(PlatformError):
                await self._rest("press", lambda: interaction.response.defer())
            chat, _ = self._interaction_chat(interaction)
            message = interaction.message
            press = Press(
                platform=PLATFORM,
                data=custom_id,
                actor=self.actor(interaction.user.id),
                chat=str(chat) if chat is not None else None,
                message_id=str(message.id) if message is not None else None,
                is_admin=self.is_admin(interaction.user.id),
                reason=reason,
            )
            await self.press(press, _FollowupReply(self, interaction), key=f"interaction:{interaction.id}")

    async def _ask_reason(self, interaction: discord.Interaction[_Client], request_id: str) -> None:
        """ "Deny with reason": a modal is the press's first answer (it cannot follow a deferral)."""
        refusal = await self._reason_refusal(self.actor(interaction.user.id), request_id)
        if refusal is not None:
            # Told now, privately, not after typing a reason into a modal whose Deny would not count.
            log.info("discord.reason_refused", actor=self.actor(interaction.user.id), request_id=request_id)
            with self.tracking(), contextlib.suppress(PlatformError):
                await self._rest(
                    "press_reply",
                    lambda: interaction.response.send_message(refusal, ephemeral=True, allowed_mentions=NO_MENTIONS),
                )
            return
        modal = discord.ui.Modal(title=REASON_TITLE, custom_id=deny_data(request_id), timeout=REPLY_WINDOW_SECONDS)
        modal.add_item(
            discord.ui.TextInput(
                label="Reason", custom_id=REASON_INPUT, style=discord.TextStyle.paragraph, max_length=REASON_MAX,
                placeholder=REASON_LABEL[:100],
            )
        )  # fmt: skip
        with self.tracking(), contextlib.suppress(PlatformError):
            await self._rest("reason_modal", lambda: interaction.response.send_modal(modal))

    async def _on_reason(self, interaction: discord.Interaction[_Client]) -> None:
        """The modal was submitted: the Deny, with the words, through the one press policy."""
        data: Any = interaction.data or {}
        custom_id = data.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id.startswith(PRESS_PREFIXES):
            return
        await self._take_press(interaction, custom_id, modal_value(data.get("components"), REASON_INPUT))

    # ----------------------------------------------------------------- outbound

    async def _rest(self, site: str, call: Any) -> Any:
        """One REST call through the kit: bounded in time, every failure a logged, counted PlatformError."""
        return await self.call(site, None, call, timeout=self.request_timeout)

    def _connected(self, site: str) -> _Client:
        """The logged-in client: REST works with or without the gateway."""
        if self._token_refused is not None:  # given up for good: the operator must set another token
            error = self._token_error(site)
            self.failed(site, None, error)
            raise error
        client = self._client
        if client is None or client.user is None:
            raise self.refuse(site, "not connected", retryable=True)
        if client.is_closed():
            # Not "RuntimeError: Session is closed", unretryable: every card posted meanwhile was given up for good.
            # Kept for later: a new client logs in (REST needs no gateway, so a follower's too), which sends again.
            self._renew_soon()
            why = f"Discord closed the gateway for good ({self._ended or 'no reason given'}), and discord.py closed "
            raise self.refuse(site, why + "its client with it: a new one is logging in, to send this when tried again",
                              retryable=True)  # fmt: skip
        return client

    def _snowflake(self, site: str, value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise self.refuse(site, f"{value!r} is not a Discord id") from None

    def _can_send(self, site: str) -> None:
        self._connected(site)

    def _writable(self, text: str) -> str:
        return neutralise_mentions(text)

    def _text_room(self, agent: str | None) -> tuple[int, Callable[[str], int] | None]:
        return CONTENT_MAX - len(agent_prefix(agent)), None

    def _target(self, site: str, chat: str, thread: str | None) -> discord.PartialMessageable:
        return self._connected(site).get_partial_messageable(self._snowflake(site, thread or chat))

    async def _send_whole(self, chat: str, text: str, *, agent: str, thread: str | None) -> str | None:
        """As the agent itself, through the channel's webhook, when the bot may make one."""
        channel_id = self._snowflake("send", chat)
        webhook = await self._hooks.for_channel(self._client, channel_id)
        if webhook is None:
            return None
        thread_id = self._snowflake("send", thread) if thread is not None else None
        chunks = _chunks(text, CONTENT_MAX, columns=isinstance(text, Columns))
        return await self._hooks.send(webhook, channel_id, chunks, agent=agent, thread_id=thread_id)

    async def _post_text(self, chat: str, part: str, *, agent: str | None, thread: str | None) -> Posted:
        target = self._target("send", chat, thread)
        text = agent_prefix(agent) + (code_block(part) if isinstance(part, Columns) else part)
        message = await self._rest("send", lambda: target.send(text, allowed_mentions=NO_MENTIONS))
        return Posted(chat, str(message.id))

    edits_text = True

    async def _edit_text(self, chat: str, message_id: str, part: str, *, agent: str | None, thread: str | None) -> None:
        target = self._target("stream", chat, thread)
        message = target.get_partial_message(self._snowflake("stream", message_id))
        text = agent_prefix(agent) + part
        await self.stream_edits.acquire(chat)  # discord.py waits out a 429; this keeps a stream from causing one
        await self._rest("stream", lambda: message.edit(content=text, allowed_mentions=NO_MENTIONS))

    async def _post_file(self, chat: str, name: str, data: bytes, *, caption: str, thread: str | None) -> str:
        site = "send_file"
        client = self._connected(site)
        channel_id = self._snowflake(site, thread if thread is not None else chat)
        target = client.get_partial_messageable(channel_id)
        content = clip(neutralise_mentions(caption), CONTENT_MAX)
        message = await self._rest(
            site,
            lambda: target.send(
                content, file=discord.File(io.BytesIO(data), filename=name), allowed_mentions=NO_MENTIONS
            ),
        )
        return str(message.id)

    async def _show_working(self, chat: str, thread: str | None) -> None:
        client = self._connected("working")
        channel_id = self._snowflake("working", thread if thread is not None else chat)
        # POST /channels/{id}/typing: shown for 10 s or until the bot's next message
        await self._rest("working", lambda: client.http.send_typing(channel_id))

    async def _post_choices(
        self, chat: str, body: str, choices: Sequence[tuple[str, str]], *, thread: str | None
    ) -> str:
        target = self._target("send", chat, thread)
        sending: dict[str, Any] = {"allowed_mentions": NO_MENTIONS}
        if choices:
            view = discord.ui.View(timeout=None)
            for label, data in choices:
                view.add_item(discord.ui.Button(style=discord.ButtonStyle.primary, label=label[:80], custom_id=data))
            view.stop()  # presses are taken from on_interaction, like a card's
            sending["view"] = view
        message = await self._rest("send", lambda: target.send(body, **sending))
        return str(message.id)

    # Card posts are idempotent on Discord (their nonce): the bus need not mark a post tried again.
    idempotent_posts = True

    async def find_card(self, request_id: str, chat: str) -> CardRef | None:
        """The bot's card of ``request_id`` among ``chat``'s last :data:`FIND_CARD_MESSAGES` messages, by the
        request id its embed's footer carries (``GET /channels/{id}/messages``). Discord answers a repeated nonce
        with the first message only for minutes: after a restart later than that, posting again made a second card
        and the first, never recorded, kept live buttons."""
        site = "card_find"
        client = self._connected(site)
        channel = self._target(site, chat, None)
        footer = card_footer(request_id)

        async def look() -> discord.Message | None:
            async for message in channel.history(limit=FIND_CARD_MESSAGES):
                bots = client.user is not None and message.author.id == client.user.id
                if bots and any(embed.footer.text == footer for embed in message.embeds):
                    return message
            return None

        found = await self._rest(site, look)
        return None if found is None else CardRef(self.name, chat, str(found.id))

    async def direct_chat(self, user: str) -> str:
        """The bot's DM channel with ``user`` (``POST /users/@me/channels``; Discord gives the same one again)."""
        site = "card_dm"
        client = self._connected(site)
        recipient = discord.Object(id=self._snowflake(site, user))
        channel = await self._rest(site, lambda: client.create_dm(recipient))
        return str(channel.id)

    def _write_card(self, card: ApprovalCard, outcome: Outcome | None) -> LaidOut[Any]:
        return render_card(card, outcome=outcome, approve_partial=self.approve_partial)

    async def _post_card(self, chat: str, laid: LaidOut[Any], card: ApprovalCard) -> Posted:
        channel = self._target("card_post", chat, None)
        written = laid.written
        # The same nonce for every attempt at this card: Discord (with enforce_nonce, which discord.py sends with
        # every nonce) answers a repeat within minutes with the first message, so a post tried again after a
        # crash or a lost answer never shows the card twice.
        sending: dict[str, Any] = {
            "embed": written.embed,
            "allowed_mentions": NO_MENTIONS,
            "nonce": card_nonce(card.request_id, chat),
        }
        if written.view is not None:
            sending["view"] = written.view
        message = await self._rest("card_post", lambda: channel.send(**sending))
        return Posted(chat, str(message.id))

    async def _edit_card(
        self, site: str, ref: CardRef, laid: LaidOut[Any], card: ApprovalCard, *, settled: bool
    ) -> bool:
        written = laid.written
        channel = self._target(site, ref.chat, None)
        message = channel.get_partial_message(self._snowflake(site, ref.message_id))
        view = None if settled else written.view  # settled: the buttons are removed
        # An identical re-edit succeeds on Discord, so settling twice is harmless.
        await self._rest(site, lambda: message.edit(embed=written.embed, view=view, allowed_mentions=NO_MENTIONS))
        return True
