"""The approvals API picks a policy by name, and a token's owner is its requester under forbid_requester."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.api_support import REQUESTER_TOKEN, Door, cards, kazma_door
from tests.mcp_support import TG_ADMIN, TG_CHAT

OWNED = ", owner: alice"
POLICIES = ", policies: {not-mine: {forbid_requester: true}}"
PEOPLE = f"people: {{alice: {{telegram: {TG_ADMIN}}}}}"


def client(door: Door) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=door.url, headers=door.auth(REQUESTER_TOKEN), timeout=30, trust_env=False)


async def test_a_request_names_its_policy_and_the_tokens_owner_cannot_approve_it(tmp_path: Path) -> None:
    async with kazma_door(tmp_path, extra=PEOPLE, approvals=POLICIES, ci=OWNED) as door, client(door) as http:
        unknown = await http.post("/api/v1/approvals", json={"tool": "deploy", "policy": "nope"})
        assert unknown.status_code == 400
        assert "approvals.policies" in unknown.json()["error"]
        assert await door.app.service.store.requests() == []

        opened = await http.post("/api/v1/approvals", json={"tool": "deploy", "policy": "not-mine"})
        assert opened.status_code == 201
        request_id = opened.json()["id"]
        row = await door.app.service.store.get(request_id)
        assert row is not None
        assert (row.policy, row.started_by) == ("not-mine", "alice")

        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        card = next(m for m in door.telegram.bot_messages(TG_CHAT) if m.buttons)
        data = next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(":a"))
        query = door.telegram.push_callback(TG_CHAT, card.message_id, TG_ADMIN, str(data))
        answer = await door.telegram.wait_for_answer(query, timeout=10)
        # refused privately (the callback answer only she sees), nothing decided, no message in the chat
        assert "You asked for this call" in str(answer["text"])
        assert (await door.app.service.store.get(request_id)).status.value == "pending"  # type: ignore[union-attr]
        assert not [m for m in door.telegram.bot_messages(TG_CHAT) if "You asked" in m.text]
