"""People at the console, over real HTTP: a shared token never decides; a passkey enrolled from a one-time link
signs a person in, and every decision made there names them; used links, revoked passkeys, passkeys without
user verification, answers for another site and replayed answers are refused.

The passkeys are a software authenticator's (tests/passkey_support.py): real P-256 signatures over real
WebAuthn data, verified by the console with py_webauthn as a browser's would be — nothing is mocked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import aiohttp
import pytest

from kazma.approvals.model import Decision, PressVerdict, Status
from kazma.approvals.rules import RuleStore
from kazma.bot.console.auth import SESSION_COOKIE
from kazma.bot.console.signin import CEREMONY_COOKIE
from tests.passkey_support import CeremonyRefused, SoftAuthenticator, _post, b64url, csrf_of, enrol, sign_in
from tests.test_web_server import OPERATOR, READER, Console, console


def _field(page: str, name: str) -> str:
    match = re.search(rf'name="{name}" value="([^"]*)"', page)
    assert match is not None, page[:2000]
    return match.group(1)


async def _decided(con: Console, request_id: str) -> list[str]:
    return [e.event for e in await con.app.service.store.events(request_id) if e.event == "decided"]


async def test_the_shared_operator_token_alone_decides_nothing(tmp_path: Path) -> None:
    """Logged in with the operator token under the approver's own name: no form offers a decision, and every
    route that decides refuses — the console's Approve and Deny, a paused task's approve, revoking a rule."""
    async with console(tmp_path) as con, con.client() as client:
        request = await con.open_approval({"command": "rm -rf /srv"})
        csrf = await con.login_with_token(client, "alice", OPERATOR)
        console_page = await (await client.get(f"{con.base}/")).text()
        approval_page = await (await client.get(f"{con.base}/swarm?approval={request.id}")).text()
        for page in (console_page, approval_page):
            assert "/decide" not in page
            assert "web:alice (the shared operator token: reads only) · reader" in page
        assert "A shared token reads only: to decide, sign in with a passkey" in approval_page
        for decision in ("approve", "deny"):
            refused = await client.post(
                f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf, "decision": decision},
                allow_redirects=False,
            )  # fmt: skip
            assert refused.status == 403
            assert "a shared token reads only" in await refused.text()
        rule = await RuleStore(con.app.stores.primary).add(
            tool="shell", args_hash="ab" * 32, conversation="web:console", created_by="web:alice",
            created_via="web", request_id=request.id, seconds=600,
        )  # fmt: skip
        for path in (f"/swarm/tasks/{'t' * 12}/approve", f"/approvals/rules/{rule.id}/revoke", "/swarm/command"):
            answer = await client.post(f"{con.base}{path}", data={"csrf": csrf, "text": "broadcast hi"})
            assert answer.status == 403, path
        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        assert await _decided(con, request.id) == []
        assert [r.id for r in await RuleStore(con.app.stores.primary).list(active_only=True)] == [rule.id]


async def test_an_invite_enrols_a_passkey_once_and_the_person_decides_as_themselves(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        request = await con.open_approval({"command": "ls"})
        link = await con.invite("alice")
        page = await client.get(link)
        assert page.status == 200
        assert "Enrol a passkey" in await page.text()
        alice = SoftAuthenticator()
        csrf = await enrol(client, con.base, link, alice)
        home = await (await client.get(f"{con.base}/")).text()
        assert "alice (web:alice, passkey) · operator" in home
        decided = await client.post(
            f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf, "decision": "approve"}
        )
        assert "Approved. Recorded as alice (web:alice)." in await decided.text()
        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert (row.status, row.decided_by, row.decided_via, row.decided_person) == (
            Status.APPROVED, "web:alice", "web", "alice",
        )  # fmt: skip
        [audit] = await con.app.service.store.events(request.id, event="decided")
        assert (audit.actor, audit.person) == ("web:alice", "alice")

        # the link worked once: a second browser finds a clear page, and its ceremony is refused
        async with con.client() as other:
            again = await other.get(link)
            assert again.status == 410
            assert "This enrolment link was already used" in await again.text()
            with pytest.raises(CeremonyRefused) as refused:
                await enrol(other, con.base, link, SoftAuthenticator())
            assert refused.value.status == 410

        # the passkey signs alice in again, in a new browser
        async with con.client() as later:
            await sign_in(later, con.base, alice)
            assert "alice (web:alice, passkey)" in await (await later.get(f"{con.base}/")).text()


async def test_an_expired_or_unknown_link_enrols_nothing(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        assert con.server.signin is not None
        token, _ = await con.server.signin.accounts.invite("alice", created_by="test", lifetime=-1)
        expired = await client.get(f"{con.base}/enrol/{token}")
        assert expired.status == 410
        assert "This enrolment link has expired" in await expired.text()
        unknown = await client.get(f"{con.base}/enrol/{'u' * 43}")
        assert unknown.status == 410
        assert "This enrolment link is not valid" in await unknown.text()
        for link in (f"{con.base}/enrol/{token}", f"{con.base}/enrol/{'u' * 43}"):
            with pytest.raises(CeremonyRefused):
                await enrol(client, con.base, link, SoftAuthenticator())
        assert await con.server.signin.accounts.passkeys() == []


async def test_a_revoked_passkey_signs_nobody_in_and_its_sessions_end(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as first, con.client() as second:
        laptop, phone = SoftAuthenticator(), SoftAuthenticator()
        await enrol(first, con.base, await con.invite("alice"), laptop)
        await enrol(second, con.base, await con.invite("alice"), phone)  # a second passkey for the same person
        assert con.server.signin is not None
        keys = await con.server.signin.accounts.passkeys("alice")
        assert [k.label for k in keys] == ["passkey 1", "passkey 2"]
        laptop_id = b64url(laptop.credentials[0].id)
        assert await con.server.signin.accounts.revoke(person="alice", credential_id=laptop_id[:10], by="test") == [
            laptop_id
        ]
        # the session the laptop's passkey opened has ended; the phone's has not
        assert (await first.get(f"{con.base}/", allow_redirects=False)).status == 302
        assert (await second.get(f"{con.base}/", allow_redirects=False)).status == 200
        async with con.client() as again:
            with pytest.raises(CeremonyRefused) as refused:
                await sign_in(again, con.base, laptop)
            assert refused.value.status == 401
            assert "this passkey was revoked" in refused.value.message
            assert SESSION_COOKIE not in {c.key for c in again.cookie_jar}
            await sign_in(again, con.base, phone)  # the other passkey still works


async def test_a_session_ends_once_its_person_is_taken_out_of_the_configuration(tmp_path: Path) -> None:
    """Sign-in refuses a passkey whose person is no longer under people:; a session it opened before stops too
    when Kazma next runs without them (it read every conversation for up to 12 hours more), while a person who
    stays keeps theirs."""
    jar = aiohttp.CookieJar(unsafe=True)
    async with (
        aiohttp.ClientSession(cookie_jar=jar) as alices,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as bobs,
    ):
        async with console(tmp_path, approvers="['web:alice', 'web:bob']") as con:
            alice = SoftAuthenticator()
            await enrol(alices, con.base, await con.invite("alice"), alice)
            await enrol(bobs, con.base, await con.invite("bob"), SoftAuthenticator())
            assert (await alices.get(f"{con.base}/", allow_redirects=False)).status == 200
        # alice leaves the team: out of people: and the approvers; her passkey is not revoked
        async with console(tmp_path, people="people:\n  bob: {web: bob}\n", approvers="['web:bob']") as con:
            assert (await bobs.get(f"{con.base}/", allow_redirects=False)).status == 200
            for path in ("/", "/conversations", "/events"):
                answer = await alices.get(f"{con.base}{path}", allow_redirects=False)
                assert answer.status in (302, 401), (path, answer.status)
            assert con.server.auth is not None
            assert await con.server.auth.store.count() == 1  # hers ended, bob's stands
            with pytest.raises(CeremonyRefused) as refused:
                await sign_in(alices, con.base, alice)
            assert refused.value.status == 401


async def test_a_cloned_passkey_answering_beside_the_real_one_signs_in_once(tmp_path: Path) -> None:
    """The signature counter is what tells a copied authenticator: two assertions with the same counter, sent at
    once, both passed the library's check against the counter read before it; only one signs in now, and a
    counter behind the one kept never moves it back (a later replay of an old counter would pass again)."""
    async with console(tmp_path) as con, con.client() as first, con.client() as second, con.client() as third:
        alice = SoftAuthenticator()
        await enrol(first, con.base, await con.invite("alice"), alice)
        clone = SoftAuthenticator(credentials=[dataclasses.replace(alice.credentials[0])])
        options = [await _post(c, f"{con.base}/login/passkey/options") for c in (second, third)]
        answers = [alice.get(options[0]["publicKey"], con.base), clone.get(options[1]["publicKey"], con.base)]
        results = await asyncio.gather(
            *(_post(c, f"{con.base}/login/passkey", a) for c, a in zip((second, third), answers, strict=True)),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, CeremonyRefused)]
        assert len(refused) == 1, results
        assert refused[0].status == 401
        assert "did not move on past 1" in refused[0].message
        assert con.server.signin is not None
        accounts = con.server.signin.accounts
        credential = b64url(alice.credentials[0].id)
        assert await accounts.used(credential, 7) is None
        assert "did not move on past 7" in (await accounts.used(credential, 5) or "")
        kept = await accounts.passkey(credential)
        assert kept is not None
        assert kept.sign_count == 7


async def test_a_passkey_without_user_verification_is_refused(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        link = await con.invite("alice")
        with pytest.raises(CeremonyRefused) as refused:
            await enrol(client, con.base, link, SoftAuthenticator(user_verified=False))
        assert refused.value.status == 400
        assert "verif" in refused.value.message.lower()
        # enrolled with verification, then a sign-in where the device did not verify the person
        device = SoftAuthenticator()
        await enrol(client, con.base, await con.invite("alice"), device)
        device.user_verified = False
        async with con.client() as again:
            with pytest.raises(CeremonyRefused) as signed:
                await sign_in(again, con.base, device)
            assert signed.value.status == 401


async def test_an_answer_made_for_another_site_or_replayed_signs_nobody_in(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        device = SoftAuthenticator()
        await enrol(client, con.base, await con.invite("alice"), device)
        async with con.client() as phished:
            # a look-alike site got the person to sign its challenge: the origin in the signed data is its own
            options = await (await phished.post(f"{con.base}/login/passkey/options", json={})).json()
            answer = device.get(options["publicKey"], "https://kazma-login.example")
            refused = await phished.post(f"{con.base}/login/passkey", json=answer)
            assert refused.status == 401
            assert SESSION_COOKIE not in {c.key for c in phished.cookie_jar}
        async with con.client() as browser, con.client() as thief:
            options = await (await browser.post(f"{con.base}/login/passkey/options", json={})).json()
            handle = next(c.value for c in browser.cookie_jar if c.key == CEREMONY_COOKIE)
            answer = device.get(options["publicKey"], con.base)
            # the answer carried to another browser: no challenge was begun there
            stolen = await thief.post(f"{con.base}/login/passkey", json=answer)
            assert stolen.status == 403
            accepted = await browser.post(f"{con.base}/login/passkey", json=answer)
            assert accepted.status == 200
            # the same answer again, with the same challenge's handle: the challenge was used up
            async with con.client() as replay:
                replay.cookie_jar.update_cookies({CEREMONY_COOKIE: handle})
                replayed = await replay.post(f"{con.base}/login/passkey", json=answer)
                assert replayed.status == 403
                assert SESSION_COOKIE not in {c.key for c in replay.cookie_jar}


async def test_the_operator_token_enrols_the_first_account_only(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as reader:
        csrf = await con.login_with_token(reader, "rita", READER)
        refused = await reader.post(f"{con.base}/people/bootstrap", data={"csrf": csrf, "person": "alice"})
        assert "Only the shared operator token enrols the first account." in await refused.text()
        async with con.client() as first:
            csrf = await con.login_with_token(first, "alice", OPERATOR)
            page = await (await first.get(f"{con.base}/")).text()
            assert "Enrol the first account" in page
            assert '<option value="alice">alice</option>' in page
            assert '<option value="bob">' not in page  # bob's console identity is no operator
            moved = await first.post(
                f"{con.base}/people/bootstrap", data={"csrf": csrf, "person": "alice"}, allow_redirects=False
            )
            assert moved.status == 303
            link = f"{con.base}{moved.headers['Location']}"
            assert "/enrol/" in link
            await enrol(first, con.base, link, SoftAuthenticator())
            assert "alice (web:alice, passkey) · operator" in await (await first.get(f"{con.base}/")).text()
        async with con.client() as later:
            csrf = await con.login_with_token(later, "mallory", OPERATOR)
            assert "Enrol the first account" not in await (await later.get(f"{con.base}/")).text()
            again = await later.post(f"{con.base}/people/bootstrap", data={"csrf": csrf, "person": "alice"})
            assert "Somebody has enrolled a passkey" in await again.text()
        assert con.server.signin is not None
        assert len(await con.server.signin.accounts.passkeys()) == 1


async def test_the_operator_token_never_enrols_again_after_a_revocation_nor_with_a_link_made_before(
    tmp_path: Path,
) -> None:
    # Attack: whoever holds the shared token enrols their own authenticator as an approver, and decides as them.
    async with console(tmp_path) as con, con.client() as first, con.client() as mallory:
        await con.login_with_token(first, "alice", OPERATOR)
        await con.login_with_token(mallory, "mallory", OPERATOR)
        links = []
        for client in (first, mallory):  # two first-account links, both before anybody enrolled
            csrf = await csrf_of(client, con.base)
            moved = await client.post(
                f"{con.base}/people/bootstrap", data={"csrf": csrf, "person": "alice"}, allow_redirects=False
            )
            assert moved.status == 303
            links.append(f"{con.base}{moved.headers['Location']}")
        await enrol(first, con.base, links[0], SoftAuthenticator())
        with pytest.raises(CeremonyRefused, match="for the first account, and somebody has enrolled since"):
            await enrol(mallory, con.base, links[1], SoftAuthenticator())
        assert con.server.signin is not None
        accounts = con.server.signin.accounts
        [held] = await accounts.passkeys()
        # alice's passkey revoked (after a compromise): nobody holds one in force, and still no first account
        assert await accounts.revoke(person="alice", credential_id=None, by="cli:root")
        assert await accounts.passkeys(revoked=False) == []
        page = await (await mallory.get(f"{con.base}/")).text()
        assert "Enrol the first account" not in page
        csrf = await csrf_of(mallory, con.base)
        again = await mallory.post(f"{con.base}/people/bootstrap", data={"csrf": csrf, "person": "alice"})
        assert "Somebody has enrolled a passkey" in await again.text()
        assert [p.credential_id for p in await accounts.passkeys()] == [held.credential_id]


async def test_the_login_page_offers_passkeys_by_name_and_says_why_not_at_an_address(tmp_path: Path) -> None:
    async with console(tmp_path) as con, aiohttp.ClientSession() as client:
        page = await (await client.get(f"{con.base}/login")).text()
        assert 'id="passkey-sign-in"' in page
        assert '<script src="/static/people.js" defer></script>' in page
    ip = "web: {public_url: 'http://127.0.0.1:8765'}\n"
    async with console(tmp_path / "ip", extra=ip) as con, aiohttp.ClientSession() as client:
        page = await (await client.get(f"{con.base}/login")).text()
        assert 'id="passkey-sign-in"' not in page
        assert "browsers make passkeys only for a name" in page


async def test_the_approval_page_offers_its_buttons_by_the_requests_policy_not_the_global_approvers(
    tmp_path: Path,
) -> None:
    # bob approves only under "steps" (its own approvers), alice only elsewhere: each page must say what the
    # service will do with their press (a step_up policy can be approved only on its page).
    approvers = "['web:alice'], policies: {steps: {approvers: [bob], step_up: true}}"
    async with console(tmp_path, approvers=approvers) as con, con.client() as bob, con.client() as alice:
        request = await con.app.service.open("shell", {"command": "make"}, "agent:builder", "web:console",
                                             policy="steps")  # fmt: skip
        page_of = f"{con.base}/swarm?approval={request.id}"
        await con.login(bob, "bob", OPERATOR)
        his = await (await bob.get(page_of)).text()
        assert 'id="passkey-step-up"' in his
        assert f'action="/approvals/{request.id}/decide"' in his  # Deny, one press
        await con.login(alice, "alice", OPERATOR)
        hers = await (await alice.get(page_of)).text()
        assert 'id="passkey-step-up"' not in hers
        assert f'action="/approvals/{request.id}/decide"' not in hers
        assert "may not decide under policy steps" in hers
        other = await con.app.service.open("shell", {"command": "ls"}, "agent:builder", "web:console")
        assert f'action="/approvals/{other.id}/decide"' in await (await alice.get(
            f"{con.base}/swarm?approval={other.id}")).text()  # fmt: skip
        assert f'action="/approvals/{other.id}/decide"' not in await (await bob.get(
            f"{con.base}/swarm?approval={other.id}")).text()  # fmt: skip


async def test_a_request_whose_policy_was_taken_out_of_the_configuration_says_nobody_can_decide_it(
    tmp_path: Path,
) -> None:
    # A request that outlives a restart (an API asker may come back for it) keeps the policy it opened under; when
    # that policy is gone from kazma.yaml, every press is refused, and the page said "only its approvers can".
    async with console(tmp_path, approvers="['web:alice'], policies: {retired: {approvers: [bob]}}") as con:
        request = await con.app.service.open("shell", {"command": "make"}, "agent:builder", "web:console",
                                             policy="retired", durable=True)  # fmt: skip
    async with console(tmp_path) as con, con.client() as alice:
        await con.login(alice, "alice", OPERATOR)
        page = await (await alice.get(f"{con.base}/swarm?approval={request.id}")).text()
        assert f'action="/approvals/{request.id}/decide"' not in page
        assert "policy &#x27;retired&#x27; is no longer configured, so nobody can decide it" in page
        pressed = await con.app.service.decide(request.id, Decision.DENY, actor="web:alice", platform="web")
        assert pressed.verdict is PressVerdict.REFUSED  # what the page says is what a press gets
