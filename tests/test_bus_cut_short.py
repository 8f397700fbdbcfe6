"""A card post the bus's own bound ends says what the platform was doing, on the real libraries against wire fakes.

The bus bounds each post with ``platform_timeout``; that bound starts before the adapter's request timeout and so
ends the call first. The card outbox's last error (what ``kazma doctor`` and an operator read) must then say whether
the platform had not answered, had said "slow down" (and for how long), or had failed and was being tried again —
never a bare ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.adapters.bus import FanOutBus
from kazma.bot.app import App
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.telegram import Fault
from tests.platforms_support import PLATFORMS, kazma_on, three_fakes

ARGS = {"command": "make release"}
HOME_POST = rf"/channels/{HOME_CHANNEL_ID}/messages"
BOUND = 0.5  # the bus's bound, shorter than the adapters' request timeouts (2 s here), as 10 s is beside 10 s


async def _last_errors(app: App, request_id: str, platforms: tuple[str, ...] = PLATFORMS) -> dict[str, str]:
    """Each of ``platforms``' last error for the request's card post, once every one of them has one."""
    bus = app.bus
    assert isinstance(bus, FanOutBus)
    found: dict[str, str] = {}
    async with asyncio.timeout(20):
        while not set(platforms) <= set(found):
            for request, platform, _, error in await bus.outbox.pending():
                if request == request_id and error:
                    found[platform] = error
            await asyncio.sleep(0.02)
    return found


def _bounded(app: App) -> None:
    bus = app.bus
    assert isinstance(bus, FanOutBus)
    bus.platform_timeout = BOUND


async def test_a_rate_limit_waited_out_past_the_bus_bound_is_told_with_its_wait(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        _bounded(app)
        # Each platform says "slow down" for 3 s, as it does on the wire (Telegram's parameters.retry_after,
        # Slack's Retry-After header, Discord's JSON retry_after with its Via header); the clients wait it out.
        fakes.telegram.script("sendMessage", *[Fault.too_many_requests(3)] * 5)
        fakes.slack.fail("chat.postMessage", "429", times=5, retry_after=3)
        fakes.discord.inject_fault("POST", HOME_POST, "429", retry_after=3, times=5)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        errors = await _last_errors(app, request.id)
    for platform, error in errors.items():
        assert "TimeoutError" not in error, (platform, error)
        assert "rate limited" in error, (platform, error)
        assert "retry after 3 s" in error, (platform, error)
        assert f"Kazma's {BOUND:g} s bound on the card_post ran out while waiting it out" in error, (platform, error)
    assert "Flood control exceeded" in errors["telegram"]
    assert "ratelimited" in errors["slack"]
    assert f"/channels/{HOME_CHANNEL_ID}/messages with 429" in errors["discord"]


async def test_no_answer_or_a_5xx_being_retried_past_the_bus_bound_is_told_as_such(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        _bounded(app)
        fakes.telegram.script("sendMessage", *[Fault.hang()] * 5)
        fakes.slack.fail("chat.postMessage", "hang", times=5)
        # discord.py tries a 500 again after a pause of its own (1 s, then 3 s): the bus's bound ends that pause
        fakes.discord.inject_fault("POST", HOME_POST, "500", times=50)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        errors = await _last_errors(app, request.id)
        fakes.slack.release_hangs()
    assert errors["telegram"] == f"telegram card_post: no answer from Telegram within {BOUND:g} s (card_post)"
    assert errors["slack"] == f"slack card_post: no answer from Slack within {BOUND:g} s (card_post)"
    discord = errors["discord"]
    assert f"Discord answered POST /api/v10/channels/{HOME_CHANNEL_ID}/messages with 500" in discord, discord
    assert "ran out before it was tried again" in discord, discord


async def test_a_429_the_adapter_s_own_timeout_cut_then_the_bus_bound_is_told_once(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db", request_timeout=0.2) as app:
        bus = app.bus
        assert isinstance(bus, FanOutBus)
        bus.platform_timeout = 1.5
        # discord.py sleeps out the 429 until the adapter's 0.2 s timeout ends it; the kit's pacing then waits out
        # the rest, until the bus's 1.5 s bound ends that: Discord's own account of the 429 is the one told
        fakes.discord.inject_fault("POST", HOME_POST, "429", retry_after=3, times=5)
        request = await app.service.open("shell", ARGS, "agent:builder", "discord:" + str(HOME_CHANNEL_ID))
        errors = await _last_errors(app, request.id, ("discord",))
    discord = errors["discord"]
    assert discord.count("Discord answered") == 1, discord
    assert f"rate limited: Discord answered POST /api/v10{HOME_POST} with 429" in discord, discord
    assert "retry after 3 s" in discord, discord
    assert "Kazma's 1.5 s bound on the card_post ran out while waiting it out" in discord, discord
