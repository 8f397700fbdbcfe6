"""What a replica's composition root hands an adapter, recorded: inbound messages, presses and inbound claims."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from kazma.adapters.contract import Handlers, Inbound, Press
from kazma.approvals.card import ApprovalCard, build_card
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import ApprovalRequest, Outcome, PressResult, PressVerdict, Status

T = TypeVar("T")
WAIT = 10.0

Claim = Callable[[str, str], Awaitable[bool]]


class Replica:
    """One replica's handlers: what reached it, and every claim it asked for with the answer it got."""

    def __init__(self, name: str, claim: Claim | None = None, *, changed: asyncio.Condition | None = None) -> None:
        self.name = name
        self.inbound: list[Inbound] = []
        self.presses: list[Press] = []
        self.claims: list[tuple[str, str, bool]] = []  # (platform, key, claimed)
        self._claim = claim
        self._changed = changed or asyncio.Condition()  # shared: one replica may wait on what another saw

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def on_inbound(self, inbound: Inbound) -> None:
        self.inbound.append(inbound)
        await self._notify()

    async def on_press(self, press: Press) -> PressResult:
        self.presses.append(press)
        await self._notify()
        return PressResult(PressVerdict.WON, "Approved.", request_id="r")

    async def claim_inbound(self, platform: str, key: str, payload: str | None = None, /) -> bool:
        assert self._claim is not None
        claimed = await self._claim(platform, key)
        self.claims.append((platform, key, claimed))
        await self._notify()
        return claimed

    def handlers(self) -> Handlers:
        return Handlers(
            on_inbound=self.on_inbound,
            on_press=self.on_press,
            claim_inbound=self.claim_inbound if self._claim is not None else None,
        )

    def texts(self) -> list[str]:
        """What people said (a platform may echo the bot's own posts; those are not counted)."""
        return [i.text for i in self.inbound if not i.from_bot]

    async def wait_until(self, predicate: Callable[[], T], timeout: float = WAIT) -> T:
        async with asyncio.timeout(timeout), self._changed:
            while not (value := predicate()):
                await self._changed.wait()
            return value


def make_card(conversation: str, **args: Any) -> ApprovalCard:
    now = datetime.now(UTC)
    values = args or {"command": "ls"}
    request = ApprovalRequest(
        id=secrets.token_hex(12),
        tool="shell",
        args=values,
        args_json=canonical_json(values),
        args_hash=args_hash(values),
        requested_by="agent:builder",
        conversation=conversation,
        created_at=now,
        deadline=now + timedelta(minutes=10),
        status=Status.PENDING,
    )
    return build_card(request, value_limit=500, public_url="http://127.0.0.1:8765")


def approved(card: ApprovalCard, by: str) -> Outcome:
    return Outcome(
        request_id=card.request_id,
        status=Status.APPROVED,
        decided_by=by,
        decided_via=by.partition(":")[0],
        decided_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
