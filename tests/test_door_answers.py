"""What the API and /mcp tell a caller is what stands, by the checks Kazma makes before it runs a call itself.

The caller acts on the answer: "approved" runs its action, "withdrawn; nothing was decided" runs nothing. So an
answer must never say "approved" for a row Kazma would refuse to run, nor "nothing was decided" for a request a
person approved; and the audit must not say "withdrawn" for a request that was decided first.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from kazma.approvals import ApprovalService, ApprovalStore, Decision, PressVerdict
from kazma.bot.store import all_migrations
from kazma.config.store.database import open_database
from tests.api_support import OTHER_TOKEN, REQUESTER_TOKEN, kazma_door
from tests.approvals_support import RecordingPublisher
from tests.outside_writes import write_around

ASK: dict[str, Any] = {"tool": "git_push", "arguments": {"branch": "main"}, "reason": "release"}
TWO = ", policies: {two: {approve: 2, approvers: [telegram:111, telegram:222]}}"


def _payload(result: Any) -> dict[str, Any]:
    if result.structured_content:
        found = result.structured_content
        return dict(found.get("result", found))
    return dict(json.loads("".join(getattr(item, "text", "") for item in result.content)))


async def _pending_id(service: ApprovalService) -> str:
    async with asyncio.timeout(30):
        while not (found := await service.store.requests(pending_only=True, limit=5)):
            await asyncio.sleep(0.02)
    [request] = found
    return request.id


async def test_an_mcp_asker_gone_after_a_decision_it_had_not_heard_gets_that_decision(tmp_path: Path) -> None:
    # Another process (a replica, the command line) approves; before this process's waiter hears it (its sweep,
    # 30 s here), the web server stops. The call's answer was "withdrawn; nothing was decided", while the store
    # and every card said approved: a person's approval lost on the way to the asker.
    async with kazma_door(tmp_path) as door:
        service = door.app.service
        service.poll_interval = 30.0
        elsewhere = await open_database(tmp_path / "state" / "kazma.db", migrations=all_migrations())
        other = ApprovalService(
            ApprovalStore(elsewhere, keyring=service.store.keyring), service.config, publisher=RecordingPublisher()
        )
        headers = {"Authorization": f"Bearer {REQUESTER_TOKEN}"}
        try:
            async with (
                httpx2.AsyncClient(headers=headers, timeout=60, trust_env=False) as http,
                streamable_http_client(f"{door.url}/mcp", http_client=http) as streams,
                ClientSession(streams[0], streams[1]) as session,
            ):
                await session.initialize()
                call = asyncio.create_task(session.call_tool("request_approval", ASK))
                request_id = await _pending_id(service)
                won = await other.decide(request_id, Decision.APPROVE, actor="telegram:111", platform="telegram")
                assert won.verdict is PressVerdict.WON
                assert door.server.mcp is not None
                door.server.mcp.stopping.set()  # what the web server's shutdown does first
                result = await asyncio.wait_for(call, 30)
        finally:
            await elsewhere.close()
        assert not result.is_error, result
        answer = _payload(result)
        assert (answer["outcome"], answer["decided_by"]) == ("approved", "telegram:111")
        stored = await service.store.get(request_id)
        assert stored is not None
        assert stored.status.value == "approved"


async def test_the_api_never_says_approved_for_an_approval_kazma_would_not_run(tmp_path: Path) -> None:
    # Two approvals under policy "two", then a restart where 222 is no longer among its approvers: Kazma's own
    # executor refuses the approval (one approving review on record where two are needed); the API said approved.
    async with kazma_door(tmp_path, approvals=TWO) as door, httpx2.AsyncClient(trust_env=False) as http:
        opened = await http.post(
            f"{door.url}/api/v1/approvals", json={**ASK, "policy": "two"}, headers=door.auth(), timeout=30
        )
        assert opened.status_code == 201, opened.text
        request_id = opened.json()["id"]
        for approver in ("telegram:222", "telegram:111"):
            await door.app.service.decide(request_id, Decision.APPROVE, actor=approver, platform="telegram")
        read = await http.get(f"{door.url}/api/v1/approvals/{request_id}", headers=door.auth(), timeout=30)
        assert read.json()["status"] == "approved"  # while both may approve, it stands
    narrowed = TWO.replace("telegram:222", "telegram:333")
    async with kazma_door(tmp_path, approvals=narrowed) as door, httpx2.AsyncClient(trust_env=False) as http:
        read = await http.get(f"{door.url}/api/v1/approvals/{request_id}", headers=door.auth(), timeout=30)
        body = read.json()
        assert body["status"] == "unverified", body
        assert "1 approving reviews on record" in body["reason"]
        assert body["decided_by"] is None


async def test_the_api_says_unverified_for_an_approval_whose_decided_row_is_gone(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, httpx2.AsyncClient(trust_env=False) as http:
        opened = await http.post(f"{door.url}/api/v1/approvals", json=ASK, headers=door.auth(), timeout=30)
        request_id = opened.json()["id"]
        await door.app.service.decide(request_id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        # Whoever can write the file: the audit's guard dropped, the decided row deleted.
        store = tmp_path / "state" / "kazma.db"
        raw = sqlite3.connect(store)  # a read: it waits for no lock
        try:
            triggers = [name for (name,) in raw.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")]
        finally:
            raw.close()
        await write_around(
            store,
            [
                *(f'DROP TRIGGER "{name}"' for name in triggers if "event" in name),
                ("DELETE FROM approval_events WHERE request_id = ? AND event = 'decided'", (request_id,)),
            ],
        )
        body = (await http.get(f"{door.url}/api/v1/approvals/{request_id}", headers=door.auth(), timeout=30)).json()
        assert body["status"] == "unverified", body
        assert "decided audit row" in body["reason"]


async def test_a_delete_after_the_decision_is_audited_as_late_not_as_withdrawn(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, httpx2.AsyncClient(trust_env=False) as http:
        opened = await http.post(f"{door.url}/api/v1/approvals", json=ASK, headers=door.auth(), timeout=30)
        request_id = opened.json()["id"]
        await door.app.service.decide(request_id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        late = await http.delete(f"{door.url}/api/v1/approvals/{request_id}?why=cancelled", headers=door.auth())
        assert late.json()["status"] == "approved"
        events = [(e.event, e.detail) for e in await door.app.service.store.events(request_id)]
        assert ("api_withdrawn", "DELETE why=cancelled") not in events
        assert ("api_withdraw_late", "DELETE why=cancelled: it was approved already") in events
        second = await http.post(f"{door.url}/api/v1/approvals", json={**ASK, "reason": "b"}, headers=door.auth())
        withdrawn = await http.delete(f"{door.url}/api/v1/approvals/{second.json()['id']}", headers=door.auth())
        assert withdrawn.json()["status"] == "cancelled"
        events = [(e.event, e.detail) for e in await door.app.service.store.events(second.json()["id"])]
        assert ("api_withdrawn", "DELETE") in events


async def test_an_mcp_call_is_opened_as_the_token_the_door_checked(tmp_path: Path) -> None:
    # Two Authorization headers: the door checked the first; the tool read the headers again into a dict, which
    # kept the last, and opened the request as another token than the one its call was tracked under.
    async with kazma_door(tmp_path) as door, httpx2.AsyncClient(timeout=60, trust_env=False) as http:
        headers = [
            ("Authorization", f"Bearer {REQUESTER_TOKEN}"),
            ("Authorization", f"Bearer {OTHER_TOKEN}"),
            ("Accept", "application/json, text/event-stream"),
        ]
        call = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "request_approval", "arguments": ASK},
        }
        posted = asyncio.create_task(http.post(f"{door.url}/mcp", json=call, headers=headers))
        request_id = await _pending_id(door.app.service)
        stored = await door.app.service.store.get(request_id)
        assert stored is not None
        assert stored.requested_by == "api:ci"
        await door.app.service.decide(request_id, Decision.DENY, actor="telegram:111", platform="telegram")
        answered = await asyncio.wait_for(posted, 30)
        assert answered.status_code == 200, answered.text
