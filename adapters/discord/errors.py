"""Discord's failures as the bus's one error type: retryable or not, with Discord's ``retry_after``."""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass
from typing import Final

import aiohttp
import discord
import yarl

from kazma.adapters.contract import PlatformError

PLATFORM: Final = "discord"

# A path segment shown as it is: an id or a word. Anything else (an interaction's or webhook's token) is hidden.
_SHOWN_SEGMENT: Final = re.compile(r"\d+|[A-Za-z@._-]{1,24}|v\d+")


def route_of(url: object) -> str:
    """The path of a Discord URL, safe for a log line: tokens in interaction and webhook paths are hidden."""
    path = getattr(url, "path", str(url))
    return "/".join(s if not s or _SHOWN_SEGMENT.fullmatch(s) else "***" for s in str(path).split("/"))


@dataclass(frozen=True)
class RateLimit:
    """A 429 Discord answered: discord.py sleeps ``retry_after`` from ``at`` (``time.monotonic``), then tries again."""

    route: str  # "POST /api/v10/channels/…/messages"
    retry_after: float
    scope: str | None  # X-RateLimit-Scope: user, shared or global
    at: float
    is_global: bool = False  # every request waits it out (discord.py closes its global lock meanwhile)

    def left(self, now: float) -> float:
        return max(0.0, self.at + self.retry_after - now)


@dataclass
class CallWitness:
    """What discord.py's HTTP session did during one adapter call: its trace runs in the calling task."""

    requests: int = 0  # requests that went out
    waiting: RateLimit | None = None  # the last answer was a 429, and no request has gone out since
    failed: str | None = None  # the last 5xx Discord answered ("POST /api/v10/… with 503 Service Unavailable")
    retrying: bool = False  # that 5xx was the last answer: discord.py pauses before it tries again
    # A request may have been done by Discord: answered other than 4xx (a 5xx may come after the work, a 2xx did
    # it), or not answered at all (dropped). A 401 on discord.py's own retry after one says nothing of the first.
    maybe_done: bool = False


# The witness of the adapter call running in this task (see DiscordAdapter.call); None outside one.
CALL_WITNESS: contextvars.ContextVar[CallWitness | None] = contextvars.ContextVar("kazma_discord_call", default=None)


async def rate_limit_of(response: aiohttp.ClientResponse, route: str, now: float) -> RateLimit | None:
    """The 429 in ``response``, or None: the wait discord.py sleeps is the body's ``retry_after`` (read here once;
    aiohttp keeps the body for discord.py), else the headers' (``Retry-After`` is on every one, in whole seconds)."""
    if response.status != 429:
        return None
    headers = response.headers
    scope = headers.get("X-RateLimit-Scope")
    is_global = headers.get("X-RateLimit-Global", "").lower() == "true"
    with contextlib.suppress(aiohttp.ClientError, ValueError):
        body = await response.json(content_type=None)
        if isinstance(body, dict) and isinstance(body.get("retry_after"), int | float):
            is_global = is_global or body.get("global") is True
            return RateLimit(route, max(0.0, float(body["retry_after"])), scope, now, is_global)
    for name in ("X-RateLimit-Reset-After", "Retry-After"):
        with contextlib.suppress(ValueError):
            return RateLimit(route, max(0.0, float(headers.get(name, ""))), scope, now, is_global)
    return RateLimit(route, 0.0, scope, now, is_global)


# What the operator does about a token Discord refused (the words ``kazma doctor`` uses for the same 401).
OPERATOR_FIX: Final = (
    "Developer Portal → your application → Bot → Reset Token, put the new one in platforms.discord.token and "
    "restart Kazma"
)


def refuses_token(exc: BaseException) -> bool:
    """Whether Discord refused the bot token itself: discord.py's ``LoginFailure`` (a 401 on its login), or a 401
    that Discord's API answered on a route the bot token authorises. Interaction and webhook routes carry their
    own token in the path: a 401 there (an interaction token expired) says nothing of the bot's. Nor does a 401
    off the API (an attachment's CDN URL, which is never sent the token) or one that is not Discord's JSON (a
    proxy's sign-in page between Kazma and Discord): taken for the token's, each put Discord off until a restart."""
    if isinstance(exc, discord.LoginFailure):
        # discord.py raises it from the login's 401; one it raised without a response is its own word
        return not isinstance(exc.__cause__, discord.HTTPException) or refuses_token(exc.__cause__)
    if not isinstance(exc, discord.HTTPException) or exc.status != 401:
        return False
    response = exc.response
    # compared as URLs: the configured base may spell its host or port otherwise than the request's URL does
    api = yarl.URL(discord.http.Route.BASE)
    url = yarl.URL(str(getattr(response, "url", "")))
    base = api.path.rstrip("/")
    if (url.host, url.port) != (api.host, api.port) or not url.path.startswith(base + "/"):
        return False
    if url.path[len(base) :].startswith(("/webhooks/", "/interactions/")):
        return False
    headers = getattr(response, "headers", None) or {}
    return str(headers.get("Content-Type", "")).startswith("application/json")


def closed_for_a_setting(exc: BaseException | None) -> bool:
    """Whether Discord closed the gateway for a setting of the bot's (4010-4014: the shard, the API version, an
    intent not allowed): the same IDENTIFY is refused again until the operator changes it in the portal."""
    if isinstance(exc, discord.PrivilegedIntentsRequired):  # discord.py's 4014
        return True
    return isinstance(exc, discord.ConnectionClosed) and exc.code in range(4010, 4015)


def describe(exc: BaseException) -> str:
    if isinstance(exc, discord.HTTPException):
        return f"HTTP {exc.status} (code {exc.code}): {exc.text or exc.response.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _limited(limit: RateLimit, timeout: float | None, now: float) -> str:
    scope = f", scope {limit.scope}" if limit.scope else ""
    return (
        f"rate limited: Discord answered {limit.route} with 429 (retry after {limit.retry_after:g} s{scope}); "
        f"the {timeout or 0:g} s request timeout ran out while waiting ({limit.left(now):.2g} s still to wait)"
    )


def classify(
    site: str,
    exc: BaseException,
    *,
    timeout: float | None = None,
    witness: CallWitness | None = None,
    held_by: RateLimit | None = None,
    now: float = 0.0,
) -> PlatformError:
    """Map a discord.py / aiohttp failure to the bus's one error type.

    ``witness``: what the call's requests saw; ``held_by``: a 429 another call is still waiting out (discord.py
    holds later requests on that bucket, or all of them for a global one), read at ``now`` (``time.monotonic``).
    """
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, TimeoutError):
        # discord.py sleeps out a 429 inside the call: Discord did answer, it said "slow down". Saying "no answer"
        # would send a reader looking for a network fault.
        waiting = witness.waiting if witness is not None else None
        if waiting is not None:
            return PlatformError(PLATFORM, site, _limited(waiting, timeout, now), retryable=True,
                                 retry_after=waiting.left(now))  # fmt: skip
        if witness is not None and witness.requests == 0 and held_by is not None and held_by.left(now) > 0:
            message = "not sent: discord.py held it back for Discord's rate limit; " + _limited(held_by, timeout, now)
            return PlatformError(PLATFORM, site, message, retryable=True, retry_after=held_by.left(now))
        failed = witness.failed if witness is not None else None
        if failed is not None and witness is not None and witness.retrying:
            # discord.py pauses 1 s, 3 s, … after a 5xx: Discord answered, and the timeout ended that pause
            message = f"Discord answered {failed}; the {timeout or 0:g} s request timeout ran out before discord.py "
            message += "tried again"
            return PlatformError(PLATFORM, site, message, retryable=True)
        before = f"; before that Discord answered {failed}, and discord.py tried again" if failed else ""
        return PlatformError(PLATFORM, site, f"no answer within {timeout or 0:g} s{before}", retryable=True)
    if isinstance(exc, discord.RateLimited):
        return PlatformError(PLATFORM, site, "rate limited", retryable=True, retry_after=exc.retry_after)
    if isinstance(exc, discord.HTTPException):
        # 429 only reaches us without Discord's Via header (a Cloudflare block) or after discord.py gave up.
        retryable = exc.status >= 500 or exc.status == 429
        # 401 on a route of the bot token: that token refused, the operator's to replace (a 401 on a webhook's or
        # an interaction's own token is not). A 403 or 404 is about the thing asked for (a channel the bot may not
        # see, an attachment deleted before Kazma fetched it), not Kazma's setup.
        return PlatformError(PLATFORM, site, describe(exc), retryable=retryable, operator_must_act=refuses_token(exc))
    if isinstance(exc, discord.LoginFailure | discord.PrivilegedIntentsRequired):
        return PlatformError(PLATFORM, site, describe(exc), retryable=False, operator_must_act=True)
    if isinstance(exc, discord.ConnectionClosed):
        # 4004 bad token, 4010-4014 bad shard/intents: trying again cannot help, the operator's setup must change.
        setup = exc.code in (4004, *range(4010, 4015))
        return PlatformError(PLATFORM, site, describe(exc), retryable=not setup, operator_must_act=setup)
    if isinstance(exc, aiohttp.ClientError | OSError | discord.GatewayNotFound):
        return PlatformError(PLATFORM, site, describe(exc), retryable=True)
    return PlatformError(PLATFORM, site, describe(exc), retryable=False)
