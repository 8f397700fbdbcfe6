"""Ceremony challenges under a flood: anonymous sign-in options never push out a person's step-up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kazma.approvals.model import Status
from kazma.bot.console.accounts import (
    CHALLENGE_SECONDS,
    MAX_CHALLENGES,
    AccountStore,
    Purpose,
    TooManyChallenges,
)
from kazma.bot.console.challenge_share import CLIENT_CHALLENGES
from kazma.bot.console.server import WebServer
from tests.passkey_support import SoftAuthenticator, enrol
from tests.store_backends import Engine, open_store
from tests.test_web_server import OPERATOR, READER, console

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


async def test_a_sign_in_answered_on_another_replica_gives_its_share_back(tmp_path: Path) -> None:
    """Two replicas behind one load balancer: the options reach one, the answer the other. Each answer uses its
    challenge up wherever it lands, so one address signing in again and again is never held back."""
    async with console(tmp_path) as con, con.client() as enrolling:
        device = SoftAuthenticator()
        await enrol(enrolling, con.base, await con.invite("alice"), device)
        # the second replica: its own web server (its own process state) over the same store
        other = WebServer(
            con.app.console, con.web, host="127.0.0.1", port=0, token_path=tmp_path / "web-token",
            operator_token=OPERATOR, reader_token=READER,
        )  # fmt: skip
        await other.start()
        try:
            there = other.url.replace("127.0.0.1", "localhost")
            for n in range(CLIENT_CHALLENGES * 2):
                async with con.client() as browser:
                    async with browser.post(f"{con.base}/login/passkey/options", json={}) as begun:
                        assert begun.status == 200, (n, await begun.text())
                        options = await begun.json()
                    answer = device.get(options["publicKey"], there)  # the page the answer is sent from
                    async with browser.post(f"{there}/login/passkey", json=answer) as done:
                        assert done.status == 200, (n, await done.text())
        finally:
            await other.stop()


async def test_a_clients_share_is_the_stores_on_either_engine(store_engine: Engine) -> None:
    """Two replicas' account stores over one database: a client's unanswered challenges count on both, one
    answered on either gives its place back, and a refused ask keeps nothing."""
    async with open_store(store_engine) as first, open_store(store_engine) as second:
        one, two = AccountStore(first), AccountStore(second)
        handles = [(await one.challenge(Purpose.SIGN_IN, client="198.51.100.7"))[0] for _ in range(CLIENT_CHALLENGES)]
        with pytest.raises(TooManyChallenges) as refused:
            await two.challenge(Purpose.SIGN_IN, client="198.51.100.7")
        assert 0 < refused.value.wait <= CHALLENGE_SECONDS
        await two.challenge(Purpose.SIGN_IN, client="203.0.113.9")  # another client, its own share
        await two.challenge(Purpose.PLATFORM, client="198.51.100.7")  # another purpose, its own share
        assert await two.take_challenge(handles[0], Purpose.SIGN_IN) is not None
        handle, _ = await one.challenge(Purpose.SIGN_IN, client="198.51.100.7")
        with pytest.raises(TooManyChallenges):
            await one.challenge(Purpose.SIGN_IN, client="198.51.100.7")
        assert await one.take_challenge(handle, Purpose.SIGN_IN) is not None
