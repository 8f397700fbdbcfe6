"""A card post under way when Kazma stops cleanly lands once: it is let finish and recorded, not cut off."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.adapters.bus import FanOutBus
from tests.fakes.telegram import Fault
from tests.platforms_support import TG_CHAT, Fakes, kazma_on, three_fakes

ARGS = {"command": "make release"}


def _telegram_cards(fakes: Fakes) -> list[str]:
    return [m.text for m in fakes.telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]


async def test_a_card_post_under_way_at_a_clean_stop_is_posted_once(tmp_path: Path) -> None:
    """Telegram has the card but has not answered yet when the stop begins. The stop cancelled the bus's workers
    at once: the card landed with its message id unrecorded, so the next start posted it again ("Posted again",
    two cards with buttons; a request that is no checkpoint's ended at that start with the first card's buttons
    left showing). The post under way is let finish within the stop, and recorded."""
    store = tmp_path / "k.db"
    release = asyncio.Event()
    async with three_fakes() as fakes:
        async with kazma_on(fakes, store) as app:
            bus = app.bus
            assert isinstance(bus, FanOutBus)
            fakes.telegram.script("sendMessage", Fault.answer_held(release))
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
            await fakes.wait(lambda: len(_telegram_cards(fakes)) == 1)  # landed; its answer is held

            async def answer_once_stopping() -> None:
                await fakes.wait(lambda: bus._stopping)
                release.set()

            answering = asyncio.create_task(answer_once_stopping())
        await answering  # (the stop ran as the block ended)
        async with kazma_on(fakes, store) as again:
            outbox = again.bus.outbox  # type: ignore[union-attr]
            await fakes.wait(lambda: fakes.posted("slack") and fakes.posted("discord"))
            async with asyncio.timeout(20):
                while any(r == request.id for r, *_ in await outbox.pending()):
                    await asyncio.sleep(0.02)
            cards = _telegram_cards(fakes)
            assert len(cards) == 1, cards
            assert "Posted again" not in cards[0]
            recorded = [c for c in await again.service.store.cards(request.id) if c.platform == "telegram"]
            assert len(recorded) == 1
