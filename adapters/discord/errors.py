"""Discord's failures as the bus's one error type: retryable or not, with Discord's ``retry_after``."""

from __future__ import annotations

from typing import Final

import aiohttp
import discord

from kazma.adapters.contract import PlatformError

PLATFORM: Final = "discord"


def describe(exc: BaseException) -> str:
    if isinstance(exc, discord.HTTPException):
        return f"HTTP {exc.status} (code {exc.code}): {exc.text or exc.response.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def classify(site: str, exc: BaseException, *, timeout: float | None = None) -> PlatformError:
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
        return PlatformError(PLATFORM, site, describe(exc), retryable=retryable)
    if isinstance(exc, discord.LoginFailure | discord.PrivilegedIntentsRequired):
        return PlatformError(PLATFORM, site, describe(exc), retryable=False)
    if isinstance(exc, discord.ConnectionClosed):
        # 4004 bad token, 4010-4014 bad shard/intents: trying again cannot help.
        return PlatformError(PLATFORM, site, describe(exc), retryable=exc.code not in (4004, *range(4010, 4015)))
    if isinstance(exc, aiohttp.ClientError | OSError | discord.GatewayNotFound):
        return PlatformError(PLATFORM, site, describe(exc), retryable=True)
    return PlatformError(PLATFORM, site, describe(exc), retryable=False)
