"""Every chat platform runs the kit's door, in its order: an unserved chat is stopped before the claim across
replicas is asked, and taken in (no next leader takes it in again)."""

from __future__ import annotations

import dataclasses

import pytest

from kazma.adapters.contract import Handlers
from tests.contract.harness import Harness

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")

KIT_ORDER = ("replay_guard", "space_served", "chat_served", "claimed_here", "files_within")


async def test_every_platform_walks_the_kits_door_in_order(harness: Harness) -> None:
    claimed: list[str] = []
    taken_in: list[str] = []

    async def claim(platform: str, key: str, payload: str | None = None, /) -> bool:
        claimed.append(key)
        return True

    async def done(platform: str, key: str) -> None:
        taken_in.append(key)

    plain = harness.recorder.handlers

    def handlers() -> Handlers:
        return dataclasses.replace(plain(), claim_inbound=claim, inbound_done=done)

    harness.recorder.handlers = handlers  # type: ignore[method-assign]
    adapter = await harness.start()
    assert adapter.door.names == KIT_ORDER
    await harness.say(harness.unserved, harness.admin, "@builder not here")
    await harness.say(harness.home, harness.admin, "@builder here")
    [arrived] = await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    assert arrived.chat == harness.home
    await harness.recorder.wait_until(lambda: len(taken_in) >= 2)
    assert len(claimed) == 1  # only the served message was claimed: the unserved one stopped before the claim
    assert len(taken_in) == 2
    assert claimed[0] in taken_in
