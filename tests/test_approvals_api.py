"""The approvals API and `kazma approvals request`: one card, one decision, for callers Kazma does not run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from kazma.approvals.hashing import args_hash
from tests.api_support import (
    OPERATOR_TOKEN,
    OTHER_TOKEN,
    REQUESTER_TOKEN,
    VIEWER_TOKEN,
    Door,
    cards,
    kazma_door,
)

DEPLOY: dict[str, Any] = {"tool": "deploy", "arguments": {"env": "prod", "version": 42}, "reason": "release 42"}


def client(door: Door, token: str | None = REQUESTER_TOKEN) -> httpx.AsyncClient:
    headers = {} if token is None else door.auth(token)
    return httpx.AsyncClient(base_url=door.url, headers=headers, timeout=30, trust_env=False)


async def test_a_request_shows_a_card_and_a_press_decides_it(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        opened = await http.post("/api/v1/approvals", json=DEPLOY)
        assert opened.status_code == 201
        body = opened.json()
        assert body["status"] == "pending"
        assert body["hash"] == args_hash(DEPLOY["arguments"])
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        card = cards(door.telegram)[-1]
        assert "deploy" in card
        assert body["hash"] in card
        assert "release 42" in card
        assert "api:ci" in card
        waiting = asyncio.create_task(http.get(f"/api/v1/approvals/{body['id']}", params={"wait": "20"}))
        await door.press("a")
        decided = (await waiting).json()
        assert decided["status"] == "approved"
        assert decided["decided_by"] == "telegram:111"
        events = await door.app.service.store.events(body["id"])
        assert any(e.event == "api_opened" and e.actor == "api:ci" for e in events)


async def test_the_same_idempotency_key_gives_one_request_and_one_card(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        headers = {"Idempotency-Key": "job-7-attempt"}
        first, second = await asyncio.gather(
            http.post("/api/v1/approvals", json=DEPLOY, headers=headers),
            http.post("/api/v1/approvals", json=DEPLOY, headers=headers),
        )
        assert sorted([first.status_code, second.status_code]) == [200, 201]
        assert first.json()["id"] == second.json()["id"]
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        await asyncio.sleep(0)  # nothing to wait for: a second card would already be queued with the first
        assert len(await door.app.service.store.requests(limit=10)) == 1
        assert len(cards(door.telegram)) == 1
        # attack: the key replayed with another call is refused, not mapped onto the approved one
        other = {**DEPLOY, "arguments": {"env": "prod", "version": 43}}
        reused = await http.post("/api/v1/approvals", json=other, headers=headers)
        assert reused.status_code == 422


async def test_roles_and_credentials_stay_apart(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        async with client(door, VIEWER_TOKEN) as viewer:
            refused = await viewer.post("/api/v1/approvals", json=DEPLOY)
            assert refused.status_code == 403
        async with client(door, OPERATOR_TOKEN) as console_token:
            assert (await console_token.post("/api/v1/approvals", json=DEPLOY)).status_code == 401
        async with client(door, None) as anonymous:
            assert (await anonymous.post("/api/v1/approvals", json=DEPLOY)).status_code == 401
            # an API token is no console login
            form = await anonymous.get("/login")
            csrf = form.cookies.get("kazma_login_csrf") or ""
            login = await anonymous.post("/login", data={"csrf": csrf, "name": "mallory", "token": REQUESTER_TOKEN})
            assert login.status_code == 401
            assert "kazma_session" not in login.cookies
        assert await door.app.service.store.requests(limit=10) == []


async def test_attack_a_token_cannot_read_or_withdraw_another_tokens_request(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as ci, client(door, OTHER_TOKEN) as other:
        opened = (await ci.post("/api/v1/approvals", json=DEPLOY)).json()
        assert (await other.get(f"/api/v1/approvals/{opened['id']}")).status_code == 404
        assert (await other.delete(f"/api/v1/approvals/{opened['id']}")).status_code == 404
        still = await ci.get(f"/api/v1/approvals/{opened['id']}")
        assert still.json()["status"] == "pending"


async def test_openapi_document_describes_the_routes(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door, None) as http:
        document = (await http.get("/api/v1/openapi.json")).json()
        assert document["openapi"].startswith("3.")
        assert {"/api/v1/approvals", "/api/v1/approvals/{id}"} <= set(document["paths"])


# --------------------------------------------------------------------------- kazma approvals request --wait


async def _cli(door: Door, *extra: str, then: Any = None) -> tuple[int, str]:
    proc = await door.run_cli(
        "approvals", "request", "--url", door.url, "--tool", "deploy", "--arg", "env=prod", "--wait", *extra
    )
    if then is not None:
        await then()
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()


@pytest.mark.parametrize(("code", "status"), [("a", "approved"), ("d", "denied")])
async def test_cli_wait_exits_0_approved_1_denied(tmp_path: Path, code: str, status: str) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out = await _cli(door, then=lambda: door.press(code))
        assert returncode == {"approved": 0, "denied": 1}[status]
        assert status in out
        assert "request " in out


async def test_cli_wait_exits_2_on_timeout(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out = await _cli(door, "--deadline", "1")
        assert returncode == 2
        assert "timeout" in out


async def test_cli_wait_exits_3_when_cancelled(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:

        async def withdraw() -> None:
            await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=30)
            pending = await door.app.service.store.requests(pending_only=True, limit=1)
            assert (await http.delete(f"/api/v1/approvals/{pending[0].id}")).status_code == 200

        returncode, out = await _cli(door, then=withdraw)
        assert returncode == 3
        assert "cancelled" in out
