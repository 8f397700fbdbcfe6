"""The Discord adapter, on discord.py's plain ``Client``.

Why a plain ``Client`` and not ``discord.ext.commands.Bot``: the commands
extension drops messages whose author is a bot, and our own sub-agent
dispatches are bot messages that must reach the router. Every message in a
served channel is delivered with ``from_bot`` set; the router decides.

Buttons are not tracked by per-message ``View`` objects. A card's buttons carry
``kz1:<id>:a|d`` and every press is taken from the raw ``on_interaction``
event, so a card posted before a restart still works after it and memory does
not grow with every card.

Card text comes from tools and models, so it is escaped for Discord markdown,
mention syntax is broken with zero-width spaces, code blocks cannot be closed
from inside, and every send *and* edit carries ``AllowedMentions.none()``
(edits re-parse mentions with the defaults otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Final, TypeVar

import aiohttp
import discord
import structlog
import yarl
from discord import app_commands

from kazma.adapters import text
from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformError
from kazma.approvals.card import BUTTON_PREFIX, ApprovalCard, CardArgument
from kazma.approvals.model import Decision, Outcome, PressVerdict, Status
from kazma.config.metrics import count_failure
from kazma.config.models import DiscordConfig

log = structlog.get_logger("kazma.discord")

T = TypeVar("T")

PLATFORM: Final = "discord"
# What discord.py ships with; an empty ``gateway_url`` means "the platform's default".
DEFAULT_API_BASE: Final = "https://discord.com/api/v10"
DEFAULT_GATEWAY: Final = "wss://gateway.discord.gg/"

CONTENT_MAX: Final = 2000
TITLE_MAX: Final = 256
DESCRIPTION_MAX: Final = 4096
FIELDS_MAX: Final = 25
FIELD_NAME_MAX: Final = 256
FIELD_VALUE_MAX: Final = 1024
EMBED_TOTAL_MAX: Final = 6000
# The smallest value budget a shown argument gets: room for the cut marker and a
# readable head and tail. Below it the argument is listed by name only.
FIELD_VALUE_MIN: Final = 200
# Untrusted one-line strings in the description (requester, origin, outcome).
META_MAX: Final = 300

WEBHOOK_NAME: Final = "Kazma"
ZWSP: Final = "\u200b"
NO_MENTIONS: Final = discord.AllowedMentions.none()

_RAW_MENTION = re.compile(r"<(?=[@#/!])")
# Agent names start with a letter; a digit after @ is a (broken) user id, not a name.
_TEXT_MENTION = re.compile(r"(?<![\w@<`\u200b])@([A-Za-z][A-Za-z0-9_-]{0,31})")
_NOT_NAMES: Final = frozenset({"everyone", "here"})

_OUTCOME_STYLE: Final[dict[Status, tuple[str, discord.Colour]]] = {
    Status.APPROVED: ("✅ APPROVED", discord.Colour.green()),
    Status.DENIED: ("⛔ DENIED", discord.Colour.red()),
    Status.TIMEOUT: ("⌛ TIMED OUT", discord.Colour.light_grey()),
    Status.CANCELLED: ("⏹ CANCELLED", discord.Colour.light_grey()),
}
_PENDING_COLOUR: Final = discord.Colour.gold()


# --------------------------------------------------------------------------- rendering


def neutralise_mentions(value: str) -> str:
    """Break every mention syntax so it renders as text, even if a send forgot ``allowed_mentions``.

    ``escape_mentions`` covers ``@everyone``, ``@here`` and snowflake ids; raw
    ``<@…>``, ``<@&…>``, ``<#…>``, ``</…>`` and ``<!…>`` of any length are broken
    after the ``<``.
    """
    return _RAW_MENTION.sub("<" + ZWSP, discord.utils.escape_mentions(value))


def escape_text(value: str) -> str:
    """Untrusted text outside code blocks: markdown escaped, mentions neutralised."""
    return neutralise_mentions(discord.utils.escape_markdown(value))


def code_safe(value: str) -> str:
    """Text for inside a ``` block: a zero-width space after each backtick, so no fence can close early."""
    return neutralise_mentions(value.replace("`", "`" + ZWSP))


def clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "…"


def _fit_prefix(value: str, budget: int) -> str:
    """The longest prefix whose code-safe form fits ``budget`` (escaping only ever grows text)."""
    if len(code_safe(value)) <= budget:
        return value
    low, high = 0, min(len(value), max(budget, 0))
    while low < high:
        mid = (low + high + 1) // 2
        if len(code_safe(value[:mid])) <= budget:
            low = mid
        else:
            high = mid - 1
    return value[:low]


def _fit_suffix(value: str, budget: int) -> str:
    if len(code_safe(value)) <= budget:
        return value
    low, high = 0, min(len(value), max(budget, 0))
    while low < high:
        mid = (low + high + 1) // 2
        if len(code_safe(value[len(value) - mid :])) <= budget:
            low = mid
        else:
            high = mid - 1
    return value[len(value) - low :]


def _fence(value: str) -> str:
    return f"```\n{code_safe(value)}\n```"


def _cut_field(name: str, head: str, tail: str, original_length: int) -> str:
    marker = text.cut_marker(CardArgument(name=name, head=head, tail=tail, cut=True, original_length=original_length))
    return f"{_fence(head)}\n*{escape_text(marker)}*\n{_fence(tail)}"


def render_value(arg: CardArgument, budget: int) -> str:
    """The argument's value as a field value of at most ``budget`` characters.

    A value that does not fit is cut again, keeping part of its head *and* of
    its tail, and the marker reports what is missing from the original value.
    """
    if not arg.cut:
        whole = _fence(arg.head)
        if len(whole) <= budget:
            return whole
    # Size the layout for the longest marker this argument can have (nothing omitted
    # shown), then hand back any room the real, shorter marker leaves over.
    room = max(budget - len(_cut_field(arg.name, "", "", arg.original_length)), 2)
    best = _cut_at(arg, room)
    for _ in range(3):
        slack = budget - len(best)
        if slack <= 0:
            break
        room += slack
        wider = _cut_at(arg, room)
        if len(wider) > budget or wider == best:
            break
        best = wider
    return best


def _cut_at(arg: CardArgument, room: int) -> str:
    """The cut rendering with about two thirds of ``room`` for the head and the rest for the tail."""
    head_room = room - room // 3
    if arg.cut:
        head = _fit_prefix(arg.head, head_room)
        tail = _fit_suffix(arg.tail, room - len(code_safe(head)))
        head = _fit_prefix(arg.head, room - len(code_safe(tail)))
    else:
        head = _fit_prefix(arg.head, head_room)
        tail = _fit_suffix(arg.head[len(head) :], room - len(code_safe(head)))
    return _cut_field(arg.name, head, tail, arg.original_length)


def _field_name(name: str) -> str:
    return clip(escape_text(name), FIELD_NAME_MAX)


@dataclass(frozen=True)
class RenderedCard:
    embed: discord.Embed
    shown: int  # arguments shown as fields
    # Argument names that did not fit on the card itself; posted as plain
    # messages just before it so that no name is ever dropped.
    name_messages: tuple[str, ...] = ()


def _description_head(card: ApprovalCard, outcome: Outcome | None) -> str:
    lines: list[str] = []
    if outcome is not None:
        label, _ = _OUTCOME_STYLE[outcome.status]
        lines.append(f"**{label}**: {clip(escape_text(text.outcome_line(outcome)), META_MAX)}")
    deadline = int(card.deadline.astimezone(UTC).timestamp())
    lines += [
        f"**Tool:** {clip(escape_text(card.tool), META_MAX)}",
        f"**Requested by:** {clip(escape_text(card.requester), META_MAX)}",
        f"**Origin:** {clip(escape_text(card.origin), META_MAX)}",
        f"**Deadline:** {text.deadline_text(card)} (<t:{deadline}:R>)",
        f"**Arguments:** {len(card.arguments)} (SHA-256 of the full call in the footer)",
        f"**Full call:** {clip(escape_text(card.link), META_MAX * 3)}",
    ]
    return "\n".join(lines)


def _names_block(
    card: ApprovalCard, hidden: Sequence[CardArgument], shown: int, room: int
) -> tuple[str, list[str]] | None:
    """The description's overflow part and the names that did not fit in ``room``; None if even the notice does not."""
    if not hidden:
        return "", []
    block = f"\n\n{escape_text(text.overflow_notice(card, shown))}\n**Listed by name only ({len(hidden)}):**"
    more = f"\n… and {len(hidden)} more names in the messages just above this card"
    if len(block) + len(more) > room:
        return None
    left: list[str] = []
    for index, arg in enumerate(hidden):
        line = f"\n• {escape_text(arg.name)}"
        last = index == len(hidden) - 1
        # Keep room for the "more names" line unless this is the last name.
        if len(block) + len(line) + (0 if last else len(more)) <= room:
            block += line
            continue
        left = [a.name for a in hidden[index:]]
        block += f"\n… and {len(left)} more names in the messages just above this card"
        break
    return block, left


def _name_messages(card: ApprovalCard, names: Sequence[str]) -> tuple[str, ...]:
    if not names:
        return ()
    bodies: list[list[str]] = [[]]
    sizes = [0]
    budget = CONTENT_MAX - 200  # room for the header line
    for name in names:
        line = f"• {escape_text(name)}"
        if bodies[-1] and sizes[-1] + len(line) + 1 > budget:
            bodies.append([])
            sizes.append(0)
        bodies[-1].append(line)
        sizes[-1] += len(line) + 1
    total = len(bodies)
    return tuple(
        f"Argument names of approval request {escape_text(card.request_id)} that do not fit on its card "
        f"(part {i}/{total}):\n" + "\n".join(body)
        for i, body in enumerate(bodies, start=1)
    )


def _water_fill(needs: Sequence[int], floors: Sequence[int], total: int) -> list[int]:
    """Every value gets its floor; the rest of ``total`` goes to small values first, then evenly."""
    budgets = list(floors)
    extra = total - sum(floors)
    order = sorted(range(len(needs)), key=lambda i: needs[i] - floors[i])
    for position, index in enumerate(order):
        add = min(needs[index] - floors[index], max(extra, 0) // (len(order) - position))
        budgets[index] += add
        extra -= add
    return budgets


def render_card(card: ApprovalCard, outcome: Outcome | None = None) -> RenderedCard:
    """The card as one embed within every Discord limit, with as many argument fields as fit.

    Showing every argument name on the card comes first: fields are given up
    (largest count first) until the remaining names fit in the description.
    Only when not even the names fit are they posted as separate messages.
    """
    if outcome is None:
        title = clip(escape_text(card.title), TITLE_MAX)
        colour = _PENDING_COLOUR
    else:
        label, colour = _OUTCOME_STYLE[outcome.status]
        title = clip(f"{label} · {escape_text(card.title)}", TITLE_MAX)
    footer = f"SHA-256 of the arguments: {card.args_hash} · request {card.request_id}"
    head = _description_head(card, outcome)
    args = card.arguments
    names = [_field_name(a.name) for a in args]
    needs = [len(render_value(a, FIELD_VALUE_MAX)) for a in args]
    floors = [min(need, len(render_value(a, FIELD_VALUE_MIN))) for a, need in zip(args, needs, strict=True)]
    fixed = len(title) + len(footer)

    def attempt(shown: int) -> RenderedCard | None:
        fields_min = sum(len(names[i]) + floors[i] for i in range(shown))
        room = min(DESCRIPTION_MAX, EMBED_TOTAL_MAX - fixed - fields_min) - len(head)
        overflow = _names_block(card, args[shown:], shown, room)
        if overflow is None or (overflow[1] and shown > 0):
            return None
        block, left = overflow
        description = head + block
        values_room = EMBED_TOTAL_MAX - fixed - len(description) - sum(len(n) for n in names[:shown])
        if values_room < sum(floors[:shown]):
            return None
        budgets = _water_fill(needs[:shown], floors[:shown], values_room)
        # No embed ``url``: Discord refuses the whole message for a URL it deems malformed,
        # and the link is in the description already.
        embed = discord.Embed(title=title, description=description, colour=colour)
        for index in range(shown):
            embed.add_field(name=names[index], value=render_value(args[index], budgets[index]), inline=False)
        embed.set_footer(text=footer)
        if len(embed) > EMBED_TOTAL_MAX or len(description) > DESCRIPTION_MAX:
            return None
        return RenderedCard(embed=embed, shown=shown, name_messages=_name_messages(card, left))

    for shown in range(min(len(args), FIELDS_MAX), -1, -1):
        rendered = attempt(shown)
        if rendered is not None:
            return rendered
    # Unreachable with the card model's bounds (every untrusted line in the head is clipped).
    raise ValueError(f"approval card {card.request_id} cannot be laid out within Discord's embed limits")


def card_view(card: ApprovalCard) -> discord.ui.View:
    view = discord.ui.View(timeout=None)
    view.add_item(
        discord.ui.Button(
            style=discord.ButtonStyle.success, label=text.APPROVE_LABEL, custom_id=card.button_data(Decision.APPROVE)
        )
    )
    view.add_item(
        discord.ui.Button(
            style=discord.ButtonStyle.danger, label=text.DENY_LABEL, custom_id=card.button_data(Decision.DENY)
        )
    )
    # A stopped view still renders its components but discord.py does not keep it
    # in its view store: presses are handled in on_interaction (see module docstring).
    view.stop()
    return view


def split_text(value: str, limit: int) -> list[str]:
    """Chunks of at most ``limit`` characters, split at a newline or space where one is near."""
    chunks: list[str] = []
    rest = value
    while len(rest) > limit:
        cut = rest.rfind("\n", 0, limit + 1)
        if cut < limit // 2:
            cut = rest.rfind(" ", 0, limit + 1)
        if cut < limit // 2:
            cut = limit
        chunks.append(rest[:cut])
        rest = rest[cut:]
        if rest[:1] in ("\n", " "):
            rest = rest[1:]
    chunks.append(rest)
    return [c for c in chunks if c.strip()]


def text_mentions(content: str) -> list[str]:
    """``@name`` words in plain text: how a dispatch addresses a sub-agent that has no Discord account."""
    return [m.lower() for m in _TEXT_MENTION.findall(content) if m.lower() not in _NOT_NAMES]


# --------------------------------------------------------------------------- errors


def _describe(exc: BaseException) -> str:
    if isinstance(exc, discord.HTTPException):
        return f"HTTP {exc.status} (code {exc.code}): {exc.text or exc.response.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def to_platform_error(site: str, exc: BaseException, *, timeout: float | None = None) -> PlatformError:
    """Map a discord.py / aiohttp failure to the bus's one error type."""
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, TimeoutError):
        return PlatformError(PLATFORM, site, f"no answer within {timeout or 0:g} s", retryable=True)
    if isinstance(exc, discord.RateLimited):
        return PlatformError(PLATFORM, site, "rate limited", retryable=True, retry_after=exc.retry_after)
    if isinstance(exc, discord.HTTPException):
        # 429 only reaches us without Discord's Via header (a Cloudflare block) or after discord.py gave up.
        retryable = exc.status >= 500 or exc.status == 429
        return PlatformError(PLATFORM, site, _describe(exc), retryable=retryable)
    if isinstance(exc, discord.LoginFailure | discord.PrivilegedIntentsRequired):
        return PlatformError(PLATFORM, site, _describe(exc), retryable=False)
    if isinstance(exc, discord.ConnectionClosed):
        # 4004 bad token, 4010-4014 bad shard/intents: trying again cannot help.
        return PlatformError(PLATFORM, site, _describe(exc), retryable=exc.code not in (4004, *range(4010, 4015)))
    if isinstance(exc, aiohttp.ClientError | OSError | discord.GatewayNotFound):
        return PlatformError(PLATFORM, site, _describe(exc), retryable=True)
    return PlatformError(PLATFORM, site, _describe(exc), retryable=False)


# --------------------------------------------------------------------------- client


class _Client(discord.Client):
    """discord.py calls ``on_<event>`` methods; each forwards to the adapter."""

    def __init__(self, adapter: DiscordAdapter, *, guild_ready_timeout: float) -> None:
        intents = discord.Intents.none()
        intents.guilds = True
        intents.guild_messages = True
        intents.message_content = True
        super().__init__(
            intents=intents,
            allowed_mentions=NO_MENTIONS,
            guild_ready_timeout=guild_ready_timeout,
            # Longer waits raise RateLimited (with retry_after) instead of sleeping inside a call.
            max_ratelimit_timeout=30.0,
        )
        self.adapter = adapter
        self.tree: app_commands.CommandTree[_Client] = app_commands.CommandTree(self)
        adapter._register_commands(self.tree)

    async def setup_hook(self) -> None:
        await self.adapter._sync_commands(self.tree)

    async def on_ready(self) -> None:
        self.adapter._on_ready()

    async def on_message(self, message: discord.Message) -> None:
        await self.adapter._on_message(message)

    async def on_interaction(self, interaction: discord.Interaction[_Client]) -> None:
        await self.adapter._on_interaction(interaction)


class DiscordAdapter:
    """``PlatformAdapter`` for Discord: a gateway bot plus REST, on discord.py."""

    name = PLATFORM

    def __init__(
        self,
        config: DiscordConfig,
        *,
        guild_ready_timeout: float = 2.0,
        request_timeout: float = 10.0,
        start_timeout: float = 60.0,
        sync_commands: bool = True,
    ) -> None:
        self._config = config
        self._guild_ready_timeout = guild_ready_timeout
        self._request_timeout = request_timeout
        self._start_timeout = start_timeout
        self._sync_commands_enabled = sync_commands
        self._client: _Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._handlers: Handlers | None = None
        self._ready = asyncio.Event()
        self._webhooks: dict[int, discord.Webhook | None] = {}
        self._webhook_locks: dict[int, asyncio.Lock] = {}
        self._saved_endpoints: tuple[str, yarl.URL] | None = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def home_chat(self) -> str | None:
        return str(self._config.home_channel) if self._config.home_channel is not None else None

    async def start(self, handlers: Handlers) -> None:
        if self._client is not None:
            raise PlatformError(PLATFORM, "start", "already started", retryable=False)
        if not self._config.token:
            raise PlatformError(PLATFORM, "start", "no bot token configured", retryable=False)
        self._handlers = handlers
        self._ready = asyncio.Event()
        self._point_library_at_config()
        client = _Client(self, guild_ready_timeout=self._guild_ready_timeout)
        self._client = client
        self._task = asyncio.create_task(client.start(self._config.token), name="kazma-discord-client")
        ready = asyncio.create_task(self._ready.wait(), name="kazma-discord-ready")
        done, _ = await asyncio.wait(
            {self._task, ready}, timeout=self._start_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if ready in done:
            user = client.user
            log.info("discord.ready", user_id=user.id if user else None, guilds=len(client.guilds))
            return
        ready.cancel()
        task = self._task
        failure = task.exception() if task in done and not task.cancelled() else None
        if failure is not None:
            error = to_platform_error("start", failure)
        elif task in done:
            error = PlatformError(PLATFORM, "start", "the client stopped before READY", retryable=True)
        else:
            error = PlatformError(PLATFORM, "start", f"no READY within {self._start_timeout:g} s", retryable=True)
        log.error("discord.start_failed", error=str(error), retryable=error.retryable)
        count_failure("start", PLATFORM)
        await self.stop()
        raise error

    async def stop(self) -> None:
        client, task = self._client, self._task
        self._client = None
        self._task = None
        self._webhooks.clear()
        self._webhook_locks.clear()
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
                log.debug("discord.client_ended", error=_describe(exc))
        self._restore_library_endpoints()
        if client is not None:
            log.info("discord.stopped")

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
        discord.http.Route.BASE = self._config.api_base_url.rstrip("/") or DEFAULT_API_BASE
        gateway_cls.DEFAULT_GATEWAY = yarl.URL(self._config.gateway_url or DEFAULT_GATEWAY)

    def _restore_library_endpoints(self) -> None:
        if self._saved_endpoints is not None:
            discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = self._saved_endpoints
            self._saved_endpoints = None

    def _on_ready(self) -> None:
        self._ready.set()

    # ----------------------------------------------------------------- commands

    def _register_commands(self, tree: app_commands.CommandTree[_Client]) -> None:
        adapter = self

        @tree.command(name="swarm", description="Drive the Kazma swarm: /swarm <command> …")
        @app_commands.describe(args="The command and its arguments, e.g. 'status' or 'run standard <task>'")
        async def swarm(interaction: discord.Interaction[_Client], args: str = "") -> None:
            await adapter._on_swarm(interaction, args)

    async def _sync_commands(self, tree: app_commands.CommandTree[_Client]) -> None:
        if not self._sync_commands_enabled:
            return
        # A failed sync must not stop the bot: messages and buttons work without it.
        with contextlib.suppress(PlatformError):
            commands = await self._rest("commands", tree.sync())
            log.info("discord.commands_synced", commands=[c.name for c in commands])

    async def _on_swarm(self, interaction: discord.Interaction[_Client], args: str) -> None:
        handlers = self._handlers
        chat, thread = self._interaction_chat(interaction)
        if handlers is None or chat is None or not self._serves(chat):
            with contextlib.suppress(PlatformError):
                await self._rest(
                    "command",
                    interaction.response.send_message(
                        "Kazma does not serve this channel.", ephemeral=True, allowed_mentions=NO_MENTIONS
                    ),
                )
            return
        try:
            # Acknowledge before any work: Discord gives an interaction three seconds.
            await self._rest("command", interaction.response.defer(thinking=True), event="discord.command_ack_failed")
        except PlatformError:
            # The user was shown a failure; running the command anyway would surprise them.
            return
        user = interaction.user
        inbound = Inbound(
            platform=PLATFORM,
            chat=str(chat),
            thread=str(thread) if thread is not None else None,
            message_id=str(interaction.id),
            author=f"{PLATFORM}:{user.id}",
            author_name=user.display_name,
            text=args,
            command="swarm",
            from_bot=user.bot,
            is_admin=user.id in self._config.admins,
        )
        log.info("discord.command", chat=inbound.chat, author=inbound.author, command="swarm")
        reply = clip(f"Received /swarm {escape_text(args)}".rstrip(), CONTENT_MAX)
        try:
            await handlers.on_inbound(inbound)
        except Exception:
            log.exception("discord.command_failed", chat=inbound.chat, author=inbound.author)
            count_failure("command", PLATFORM)
            reply = "Kazma could not handle this command; the error was logged."
        with contextlib.suppress(PlatformError):
            await self._rest("command", interaction.followup.send(reply, allowed_mentions=NO_MENTIONS))

    # ----------------------------------------------------------------- inbound

    def _serves(self, chat: int) -> bool:
        channels = self._config.channels
        return not channels or chat in channels or chat == self._config.home_channel

    @staticmethod
    def _channel_chat(channel: object, channel_id: int) -> tuple[int, int | None]:
        """(chat, thread): a thread belongs to its parent channel's conversation."""
        if isinstance(channel, discord.Thread):
            return channel.parent_id, channel.id
        return channel_id, None

    def _interaction_chat(self, interaction: discord.Interaction[_Client]) -> tuple[int | None, int | None]:
        if interaction.channel_id is None:
            return None, None
        return self._channel_chat(interaction.channel, interaction.channel_id)

    async def _on_message(self, message: discord.Message) -> None:
        handlers = self._handlers
        if handlers is None or message.type not in (discord.MessageType.default, discord.MessageType.reply):
            return
        chat, thread = self._channel_chat(message.channel, message.channel.id)
        if not self._serves(chat):
            return
        names = [u.name.lower() for u in message.mentions] + text_mentions(message.content)
        author = message.author
        inbound = Inbound(
            platform=PLATFORM,
            chat=str(chat),
            thread=str(thread) if thread is not None else None,
            message_id=str(message.id),
            author=f"{PLATFORM}:{author.id}",
            author_name=author.display_name,
            text=message.content,
            mentions=tuple(dict.fromkeys(names)),
            from_bot=author.bot,
            is_admin=author.id in self._config.admins,
        )
        try:
            await handlers.on_inbound(inbound)
        except Exception:
            log.exception("discord.inbound_failed", chat=inbound.chat, message_id=inbound.message_id)
            count_failure("inbound", PLATFORM)

    async def _on_interaction(self, interaction: discord.Interaction[_Client]) -> None:
        if interaction.type is not discord.InteractionType.component or not interaction.data:
            return
        custom_id = interaction.data.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id.startswith(BUTTON_PREFIX + ":"):
            return
        await self._on_press(interaction, custom_id)

    async def _on_press(self, interaction: discord.Interaction[_Client], data: str) -> None:
        actor = f"{PLATFORM}:{interaction.user.id}"
        handlers = self._handlers
        # Acknowledge first (type 6, deferred update): a slow store must not cost the 3 s window.
        # The press is real even if the acknowledgement failed, so it is still recorded.
        with contextlib.suppress(PlatformError):
            await self._rest("press", interaction.response.defer(), event="discord.press_ack_failed")
        if handlers is None:
            return
        try:
            result = await handlers.on_press(data, actor, PLATFORM)
        except Exception:
            log.exception("discord.press_failed", data=data, actor=actor)
            count_failure("press", PLATFORM)
            await self._ephemeral(interaction, "Kazma could not record your press; please try again.")
            return
        log.info("discord.press", data=data, actor=actor, verdict=result.verdict.value, request_id=result.request_id)
        if result.verdict in (PressVerdict.LOST, PressVerdict.REFUSED):
            await self._ephemeral(interaction, result.message)

    async def _ephemeral(self, interaction: discord.Interaction[_Client], message: str) -> None:
        with contextlib.suppress(PlatformError):
            await self._rest(
                "press",
                interaction.followup.send(
                    clip(neutralise_mentions(message), CONTENT_MAX), ephemeral=True, allowed_mentions=NO_MENTIONS
                ),
                event="discord.press_reply_failed",
            )

    # ----------------------------------------------------------------- outbound

    async def _rest(self, site: str, call: Awaitable[T], *, event: str | None = None) -> T:
        """One REST call, bounded in time; every failure leaves as a logged, counted PlatformError."""
        try:
            async with asyncio.timeout(self._request_timeout):
                return await call
        except Exception as exc:
            error = to_platform_error(site, exc, timeout=self._request_timeout)
            log.warning(
                event or f"discord.{site}_failed",
                error=str(error),
                retryable=error.retryable,
                retry_after=error.retry_after,
            )
            count_failure(site, PLATFORM)
            raise error from exc

    def _connected(self, site: str) -> _Client:
        client = self._client
        if client is None or not self._ready.is_set():
            raise PlatformError(PLATFORM, site, "not connected", retryable=True)
        return client

    @staticmethod
    def _snowflake(site: str, value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise PlatformError(PLATFORM, site, f"{value!r} is not a Discord id", retryable=False) from None

    async def _guarded(self, site: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work``; anything that is not already a PlatformError becomes one (and is logged)."""
        try:
            return await work()
        except PlatformError:
            raise
        except Exception as exc:
            log.exception(f"discord.{site}_failed")
            count_failure(site, PLATFORM)
            raise to_platform_error(site, exc) from exc

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        return await self._guarded("send", lambda: self._send_text(chat, text, agent=agent, thread=thread))

    async def _send_text(self, chat: str, body: str, *, agent: str | None, thread: str | None) -> str:
        client = self._connected("send")
        channel_id = self._snowflake("send", chat)
        thread_id = self._snowflake("send", thread) if thread is not None else None
        safe = neutralise_mentions(body)
        if not safe.strip():
            raise PlatformError(PLATFORM, "send", "refusing to send an empty message", retryable=False)
        webhook = await self._webhook_for(channel_id) if agent else None
        if webhook is not None and agent:
            sent = await self._send_as_webhook(webhook, channel_id, safe, agent=agent, thread_id=thread_id)
            if sent is not None:
                return sent
        target = client.get_partial_messageable(thread_id or channel_id)
        prefix = text.agent_prefix(agent)
        first: str | None = None
        for chunk in split_text(safe, CONTENT_MAX - len(prefix)):
            message = await self._rest("send", target.send(prefix + chunk, allowed_mentions=NO_MENTIONS))
            first = first or str(message.id)
        log.info("discord.sent", chat=chat, agent=agent, message_id=first, via="bot")
        assert first is not None  # split_text of non-blank text has at least one chunk
        return first

    async def _send_as_webhook(
        self, webhook: discord.Webhook, channel_id: int, safe: str, *, agent: str, thread_id: int | None
    ) -> str | None:
        """Post as ``agent`` through the channel webhook; None means "use the bot instead".

        Only a definite refusal of the first chunk falls back (e.g. a deleted
        webhook or a name Discord does not allow); after a timeout or 5xx the
        message may have been posted, so the error is raised rather than risk a
        duplicate.
        """
        first: str | None = None
        thread = discord.Object(thread_id) if thread_id is not None else discord.utils.MISSING
        for chunk in split_text(safe, CONTENT_MAX):
            try:
                message = await self._rest(
                    "send",
                    webhook.send(chunk, username=agent, allowed_mentions=NO_MENTIONS, wait=True, thread=thread),
                )
            except PlatformError as exc:
                if first is not None or exc.retryable:
                    raise
                log.warning("discord.webhook_unavailable", channel=channel_id, error=str(exc))
                self._webhooks.pop(channel_id, None)
                return None
            first = first or str(message.id)
        log.info("discord.sent", chat=str(channel_id), agent=agent, message_id=first, via="webhook")
        return first

    async def _webhook_for(self, channel_id: int) -> discord.Webhook | None:
        """The bot's own webhook in this channel, found or created once; None when not allowed."""
        if channel_id in self._webhooks:
            return self._webhooks[channel_id]
        lock = self._webhook_locks.setdefault(channel_id, asyncio.Lock())
        async with lock:
            if channel_id in self._webhooks:
                return self._webhooks[channel_id]
            client = self._client
            channel = client.get_channel(channel_id) if client else None
            me = channel.guild.me if isinstance(channel, discord.TextChannel) else None
            hook: discord.Webhook | None = None
            if isinstance(channel, discord.TextChannel) and me is not None and client and client.user:
                if not channel.permissions_for(me).manage_webhooks:
                    self._webhooks[channel_id] = None
                    return None
                try:
                    # Reuse our webhook across restarts: a channel holds at most 15.
                    existing = await self._rest("webhook", channel.webhooks())
                    bot_id = client.user.id
                    hook = next(
                        (h for h in existing if h.token and h.user and h.user.id == bot_id and h.name == WEBHOOK_NAME),
                        None,
                    )
                    if hook is None:
                        hook = await self._rest(
                            "webhook", channel.create_webhook(name=WEBHOOK_NAME, reason="Kazma agent identities")
                        )
                except PlatformError as exc:
                    if exc.retryable:
                        return None  # not cached: try again next time
                    hook = None
            self._webhooks[channel_id] = hook
            return hook

    async def post_card(self, card: ApprovalCard) -> CardRef:
        return await self._guarded("card_post", lambda: self._post_card(card))

    async def _post_card(self, card: ApprovalCard) -> CardRef:
        client = self._connected("card_post")
        home = self.home_chat
        if home is None:
            raise PlatformError(PLATFORM, "card_post", "no home_channel configured", retryable=False)
        channel = client.get_partial_messageable(self._snowflake("card_post", home))
        rendered = render_card(card)
        # Names that do not fit go first, so a card never exists without every name in view.
        for body in rendered.name_messages:
            await self._rest("card_post", channel.send(body, allowed_mentions=NO_MENTIONS))
        message = await self._rest(
            "card_post", channel.send(embed=rendered.embed, view=card_view(card), allowed_mentions=NO_MENTIONS)
        )
        log.info(
            "discord.card_posted",
            request_id=card.request_id,
            chat=home,
            message_id=message.id,
            fields=rendered.shown,
            arguments=len(card.arguments),
            name_messages=len(rendered.name_messages),
        )
        return CardRef(platform=PLATFORM, chat=home, message_id=str(message.id))

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        await self._guarded("card_settle", lambda: self._settle_card(ref, card, outcome))

    async def _settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        if ref.platform != PLATFORM:
            raise PlatformError(PLATFORM, "card_settle", f"not a Discord card: {ref.platform}", retryable=False)
        client = self._connected("card_settle")
        channel = client.get_partial_messageable(self._snowflake("card_settle", ref.chat))
        message = channel.get_partial_message(self._snowflake("card_settle", ref.message_id))
        rendered = render_card(card, outcome)
        # An identical re-edit succeeds on Discord, so settling twice is harmless.
        await self._rest("card_settle", message.edit(embed=rendered.embed, view=None, allowed_mentions=NO_MENTIONS))
        log.info(
            "discord.card_settled",
            request_id=card.request_id,
            chat=ref.chat,
            message_id=ref.message_id,
            status=outcome.status.value,
        )
