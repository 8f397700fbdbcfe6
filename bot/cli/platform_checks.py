"""``kazma doctor`` asks each platform that is on whether it accepts Kazma's tokens, all at once.

Each platform's own check (``kazma.adapters.<platform>.doctor``, named by its
registry entry) checks the shape of each secret first, for the usual mix-ups
(:mod:`kazma.config.tokens`), since a platform only answers "invalid_auth";
then it asks the platform. Every problem is one line naming its fix; no token
ever appears in one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import httpx

from kazma.adapters.platform_cli import Check, Level, PlatformCheck
from kazma.bot.console.passkeys import RelyingParty
from kazma.bot.logging import redact
from kazma.config import LoadedConfig, enabled_platforms
from kazma.config.platforms import console_warnings
from kazma.config.registry import CHAT_PLATFORMS, PlatformSpec, load_named


def console_checks(loaded: LoadedConfig) -> list[Check]:
    config = loaded.config
    checks = [
        Check(
            "platform.web",
            Level.OK,
            f"console on {config.web.host}:{config.web.port}, linked as {config.web.public_url}",
        )
    ]
    checks += [Check("platform.web", Level.WARN, warning) for warning in console_warnings(config)]
    # `kazma init --public-url http://10.0.0.5:8765` wrote such a file and said to sign in there with a passkey,
    # and doctor called it fine: only `kazma people invite` and the sign-in page said passkeys cannot work.
    problem = RelyingParty.of(config.web.public_url).problem
    if problem is not None:
        checks.append(Check("platform.web", Level.WARN, f"passkeys cannot work here: {problem}"))
    return checks


async def check_platforms(loaded: LoadedConfig, *, timeout: float) -> dict[str, list[Check]]:  # noqa: ASYNC109 - per request
    """Each platform that is on, asked at once; one list of lines per platform."""
    platforms = loaded.config.platforms
    names = [name for name in enabled_platforms(loaded) if CHAT_PLATFORMS[name].doctor]
    async with httpx.AsyncClient(timeout=timeout) as client:
        work = [_doctor(CHAT_PLATFORMS[name])(CHAT_PLATFORMS[name].section(platforms), client) for name in names]
        results = await asyncio.gather(*(_guarded(name, w, timeout) for name, w in zip(names, work, strict=True)))
    return dict(zip(names, results, strict=True))


def _doctor(spec: PlatformSpec) -> PlatformCheck:
    """The platform's own doctor check, as its registry entry names it."""
    check: PlatformCheck = load_named(spec.doctor)
    return check


async def _guarded(name: str, work: Awaitable[list[Check]], timeout: float) -> list[Check]:  # noqa: ASYNC109
    try:
        return await work
    except httpx.TimeoutException:
        return [Check(f"platform.{name}", Level.FAIL, f"no answer within {timeout:g} s: is the API address reachable?")]
    except httpx.HTTPError as exc:
        return [Check(f"platform.{name}", Level.FAIL, f"unreachable ({type(exc).__name__}: {redact(str(exc))})")]
