"""Ceremony challenges under a flood: anonymous sign-in options never push out a person's step-up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from kazma.approvals.model import Status
from kazma.bot.console.accounts import CHALLENGE_SECONDS, MAX_CHALLENGES
from kazma.bot.console.challenge_share import CLIENT_CHALLENGES
from tests.test_web_server import OPERATOR, console

APPROVERS = "['web:alice'], policies: {steps: {approvers: ['web:alice'], step_up: true}}"


async def test_anonymous_sign_in_options_do_not_evict_a_step_up_in_progress(tmp_path: Path) -> None:
    extra = "web: {trusted_proxies: ['127.0.0.1']}\n"  # the flood comes from many addresses, each within its share
    async with (
        console(tmp_path, approvers=APPROVERS, extra=extra) as con,
        con.client() as alice,
        con.client() as stranger,
    ):
        csrf = await con.login(alice, "alice", OPERATOR)
        request = await con.app.service.open("deploy", {"env": "prod"}, "agent:builder", "web:console", policy="steps")
        assert request.step_up
        base = f"{con.base}/approvals/{request.id}/step-up"
        async with alice.post(f"{base}/options", json={}, headers={"X-CSRF-Token": csrf}) as answer:
            assert answer.status == 200, await answer.text()
            options = await answer.json()
        # while alice touches her key, somebody with no session at all asks for sign-in challenges, en masse
        sent = asyncio.Semaphore(8)

        async def ask(n: int) -> int:
            address = {"X-Forwarded-For": f"10.0.{n // CLIENT_CHALLENGES // 256}.{n // CLIENT_CHALLENGES % 256}"}
            async with sent, stranger.post(f"{con.base}/login/passkey/options", json={}, headers=address) as flood:
                return flood.status

        assert set(await asyncio.gather(*(ask(n) for n in range(MAX_CHALLENGES)))) == {200}
        signed = con.passkeys["alice"].get(options["publicKey"], con.base)
        async with alice.post(base, json=signed, headers={"X-CSRF-Token": csrf}) as approved:
            assert approved.status == 200, await approved.text()
        decided = await con.app.service.store.get(request.id)
        assert decided is not None
        assert decided.status is Status.APPROVED


async def test_one_client_flooding_sign_in_options_cannot_push_out_anothers_sign_in(tmp_path: Path) -> None:
    # every client reaches Kazma through the proxy on 127.0.0.1, which names it in X-Forwarded-For
    extra = "web: {trusted_proxies: ['127.0.0.1']}\n"
    here, there = {"X-Forwarded-For": "198.51.100.7"}, {"X-Forwarded-For": "203.0.113.9"}
    async with console(tmp_path, approvers=APPROVERS, extra=extra) as con, con.client() as enrolling:
        await con.login(enrolling, "alice", OPERATOR)  # her passkey
        jar = aiohttp.CookieJar(unsafe=True)
        async with (
            aiohttp.ClientSession(cookie_jar=jar, headers=here) as alice,
            aiohttp.ClientSession(headers=there) as stranger,
        ):
            async with alice.post(f"{con.base}/login/passkey/options", json={}) as begun:
                assert begun.status == 200, await begun.text()
                options = await begun.json()
            # while alice touches her key, one stranger asks for sign-in challenges without pause
            sent = asyncio.Semaphore(8)
            statuses: list[int] = []
            retry_after: set[str] = set()

            async def ask() -> None:
                async with sent, stranger.post(f"{con.base}/login/passkey/options", json={}) as flood:
                    statuses.append(flood.status)
                    if flood.status == 429:
                        retry_after.add(flood.headers["Retry-After"])
                        assert "sign-in challenges" in (await flood.json())["error"]

            await asyncio.gather(*(ask() for _ in range(MAX_CHALLENGES)))
            answer = con.passkeys["alice"].get(options["publicKey"], con.base)
            async with alice.post(f"{con.base}/login/passkey", json=answer) as signed:
                assert signed.status == 200, await signed.text()
            assert statuses.count(200) == CLIENT_CHALLENGES  # its share, and not one more
            assert statuses.count(429) == MAX_CHALLENGES - CLIENT_CHALLENGES
            assert all(0 < int(seconds) <= CHALLENGE_SECONDS for seconds in retry_after)
            # another client is not the stranger: its own share is whole
            async with (
                aiohttp.ClientSession(headers={"X-Forwarded-For": "192.0.2.44"}) as other,
                other.post(f"{con.base}/login/passkey/options", json={}) as fresh,
            ):
                assert fresh.status == 200


async def test_people_who_answer_their_challenges_are_never_held_back(tmp_path: Path) -> None:
    # a whole office behind one address signs in all morning: each answer uses its challenge up
    async with console(tmp_path) as con, con.client() as enrolling:
        await con.login(enrolling, "alice", OPERATOR)
        for _ in range(CLIENT_CHALLENGES * 2):
            async with con.client() as browser:
                await con.login(browser, "alice", OPERATOR)  # a passkey sign-in from 127.0.0.1 each time
