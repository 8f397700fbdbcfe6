"""Step-up under a policy of two people, attacked over HTTP with real assertions (``py_webauthn`` verifies them):
an answer replayed, one made for another request, another person's passkey, a counter that went back, a passkey
revoked between the challenge and the answer, and one person stepping up twice. Only two people's fresh
assertions approve the call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from kazma.approvals.model import Status
from tests.test_web_server import OPERATOR, Console, console

APPROVERS = (
    "['web:alice', 'web:bob'], policies: {steps: {approve: 2, approvers: ['web:alice', 'web:bob'], step_up: true}}"
)


async def _options(client: aiohttp.ClientSession, base: str, request_id: str, csrf: str) -> dict[str, Any]:
    url = f"{base}/approvals/{request_id}/step-up/options"
    async with client.post(url, json={}, headers={"X-CSRF-Token": csrf}) as answer:
        assert answer.status == 200, await answer.text()
        options: dict[str, Any] = (await answer.json())["publicKey"]
        return options


async def _approve(
    client: aiohttp.ClientSession, base: str, request_id: str, csrf: str, signed: dict[str, Any]
) -> tuple[int, str]:
    url = f"{base}/approvals/{request_id}/step-up"
    async with client.post(url, json=signed, headers={"X-CSRF-Token": csrf}) as answer:
        return answer.status, await answer.text()


async def _answered(
    expected: int, client: aiohttp.ClientSession, base: str, request_id: str, csrf: str, signed: dict[str, Any]
) -> str:
    """The step-up answer's text, its status checked to be `expected`."""
    status, said = await _approve(client, base, request_id, csrf, signed)
    assert status == expected, said
    return said


async def _fresh_assertion(
    con: Console, person: str, client: aiohttp.ClientSession, request_id: str, csrf: str
) -> dict[str, Any]:
    """`person`'s passkey answering a challenge asked for `request_id` in `client`'s session."""
    return con.passkeys[person].get(await _options(client, con.base, request_id, csrf), con.base)


async def test_only_two_peoples_fresh_assertions_approve_a_step_up_call(tmp_path: Path) -> None:
    async with console(tmp_path, approvers=APPROVERS) as con, con.client() as alice, con.client() as bob:
        alice_csrf = await con.login(alice, "alice", OPERATOR)
        bob_csrf = await con.login(bob, "bob", OPERATOR)
        service, base = con.app.service, con.base
        target = await service.open("deploy", {"env": "prod"}, "agent:builder", "web:console", policy="steps")
        other = await service.open("deploy", {"env": "dev"}, "agent:builder", "web:console", policy="steps")

        signed = await _fresh_assertion(con, "alice", alice, target.id, alice_csrf)
        said = await _answered(200, alice, base, target.id, alice_csrf, signed)
        assert "1 of 2 approvals: alice on the web" in said, said
        # the same answer again: its challenge was used up
        assert (await _approve(alice, base, target.id, alice_csrf, signed))[0] == 409
        # a fresh assertion by alice again: one person counts once
        signed = await _fresh_assertion(con, "alice", alice, target.id, alice_csrf)
        said = await _answered(200, alice, base, target.id, alice_csrf, signed)
        assert "one person counts once" in said, said
        # bob answers a challenge made for the other request, on this one
        signed = await _fresh_assertion(con, "bob", bob, other.id, bob_csrf)
        assert (await _approve(bob, base, target.id, bob_csrf, signed))[0] == 409
        # bob's session, his challenge, alice's passkey
        options = await _options(bob, base, target.id, bob_csrf)
        signed = con.passkeys["alice"].get({**options, "allowCredentials": []}, base)
        said = await _answered(401, bob, base, target.id, bob_csrf, signed)
        assert "not one of bob's" in said, said
        # bob approves the other request (his counter is kept), then a copy of his passkey answers with an old one
        signed = await _fresh_assertion(con, "bob", bob, other.id, bob_csrf)
        assert (await _approve(bob, base, other.id, bob_csrf, signed))[0] == 200
        options = await _options(bob, base, target.id, bob_csrf)
        con.passkeys["bob"].credentials[-1].sign_count = 0
        said = await _answered(401, bob, base, target.id, bob_csrf, con.passkeys["bob"].get(options, base))
        assert "sign count" in said, said
        # his passkey revoked between the challenge and the answer
        con.passkeys["bob"].credentials[-1].sign_count = 50
        signed = await _fresh_assertion(con, "bob", bob, target.id, bob_csrf)
        signin = con.server.signin
        assert signin is not None
        assert await signin.accounts.revoke(person="bob", credential_id=None, by="cli:test")
        assert (await _approve(bob, base, target.id, bob_csrf, signed))[0] == 401

        row = await service.store.get(target.id)
        assert row is not None
        assert row.status is Status.PENDING
        assert [r.reviewer for r in await service.store.reviews(target.id)] == ["alice"]
