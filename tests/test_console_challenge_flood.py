"""Ceremony challenges under a flood: anonymous sign-in options never push out a person's step-up."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.approvals.model import Status
from kazma.bot.console.accounts import MAX_CHALLENGES
from tests.test_web_server import OPERATOR, console

APPROVERS = "['web:alice'], policies: {steps: {approvers: ['web:alice'], step_up: true}}"


async def test_anonymous_sign_in_options_do_not_evict_a_step_up_in_progress(tmp_path: Path) -> None:
    async with console(tmp_path, approvers=APPROVERS) as con, con.client() as alice, con.client() as stranger:
        csrf = await con.login(alice, "alice", OPERATOR)
        request = await con.app.service.open("deploy", {"env": "prod"}, "agent:builder", "web:console", policy="steps")
        assert request.step_up
        base = f"{con.base}/approvals/{request.id}/step-up"
        async with alice.post(f"{base}/options", json={}, headers={"X-CSRF-Token": csrf}) as answer:
            assert answer.status == 200, await answer.text()
            options = await answer.json()
        # while alice touches her key, somebody with no session at all asks for sign-in challenges, en masse
        sent = asyncio.Semaphore(8)

        async def ask() -> int:
            async with sent, stranger.post(f"{con.base}/login/passkey/options", json={}) as flood:
                return flood.status

        assert set(await asyncio.gather(*(ask() for _ in range(MAX_CHALLENGES)))) == {200}
        signed = con.passkeys["alice"].get(options["publicKey"], con.base)
        async with alice.post(base, json=signed, headers={"X-CSRF-Token": csrf}) as approved:
            assert approved.status == 200, await approved.text()
        decided = await con.app.service.store.get(request.id)
        assert decided is not None
        assert decided.status is Status.APPROVED
