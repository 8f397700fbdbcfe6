"""Discord's rate limits and gateway drops, end to end: the real discord.py and Kazma against the wire fake."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.adapters.discord import DiscordAdapter
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import kazma_on, three_fakes

ARGS = {"command": "make release"}
HOME_POST = rf"/channels/{HOME_CHANNEL_ID}/messages"


async def test_a_card_post_rate_limited_past_the_request_timeout_says_so_and_is_posted_later(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        adapter = app.bus.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        adapter.request_timeout = 0.2
        # Discord says "slow down" for longer than a request may take, every time, until it stops.
        fakes.discord.inject_fault("POST", HOME_POST, "429", retry_after=0.4, times=1000)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        outbox = app.bus.outbox  # type: ignore[union-attr]

        async def told() -> list[str]:
            return [str(e) for r, p, _, e in await outbox.pending() if r == request.id and p == "discord" and e]

        async with asyncio.timeout(20):
            while not (errors := await told()):
                await asyncio.sleep(0.02)
        assert "rate limited" in errors[0], errors
        assert "retry after 0.4 s" in errors[0]
        assert "no answer" not in errors[0]
        assert not fakes.posted("discord")
        fakes.discord.clear_faults()
        await fakes.wait(lambda: fakes.posted("discord") and fakes.has_buttons("discord"))
        async with asyncio.timeout(20):
            while not [c for c in await app.service.store.cards(request.id) if c.platform == "discord"]:
                await asyncio.sleep(0.02)
        cards = [m for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]
        assert len(cards) == 1
