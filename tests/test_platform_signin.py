"""Sign in with Slack (OpenID Connect) and with Discord (OAuth2) on the console, against wire fakes that sign and
answer as each platform documents: the person is known by the platform's proof, decides as that identity, and
every forged, crossed or stale answer signs nobody in."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from kazma.approvals.model import Status
from kazma.bot.console.accounts import CHALLENGE_SECONDS
from kazma.bot.console.auth import SESSION_COOKIE
from kazma.bot.console.challenge_share import CLIENT_CHALLENGES
from kazma.bot.console.platform_signin import NEXT_COOKIE, STATE_COOKIE
from tests.fakes.discord import ALICE_ID, FakeDiscord
from tests.fakes.slack import FakeSlack
from tests.fakes.slack_oidc import Forgery
from tests.test_web_server import Console, console

SLACK_ALICE = "U0ALICE01"
PEOPLE = f"people:\n  alice: {{web: alice, slack: {SLACK_ALICE}, discord: {ALICE_ID}}}\n  bob: {{web: bob}}\n"


@asynccontextmanager
async def with_platforms(tmp_path: Path) -> AsyncIterator[tuple[Console, FakeSlack, FakeDiscord]]:
    slack, discord = FakeSlack(), FakeDiscord()
    await slack.start()
    await discord.start()
    oidc, oauth = slack.sign_in, discord.sign_in
    extra = (
        "platforms:\n"
        f"  slack: {{api_base_url: '{slack.api_url}', sign_in: {{client_id: '{oidc.client_id}',"
        f" client_secret: '{oidc.client_secret}', team_id: {slack.team_id},"
        f" authorize_url: '{slack.url}/openid/connect/authorize', keys_url: '{slack.url}/openid/connect/keys'}}}}\n"
        f"  discord: {{api_base_url: '{discord.api_base.rstrip('/')}', sign_in: {{client_id: '{oauth.client_id}',"
        f" client_secret: '{oauth.client_secret}',"
        f" authorize_url: '{discord.api_base.split('/api/')[0]}/oauth2/authorize'}}}}\n"
    )
    try:
        async with console(tmp_path, extra=extra, people=PEOPLE, approvers="[alice]") as con:
            yield con, slack, discord
    finally:
        await discord.stop()
        await slack.stop()


async def sign_in_with(client: aiohttp.ClientSession, con: Console, platform: str) -> aiohttp.ClientResponse:
    """Press "Sign in with …": the browser goes to the platform and back (the fake answers for the person)."""
    return await client.get(f"{con.base}/login/{platform}")


def signed_in(client: aiohttp.ClientSession, con: Console) -> bool:
    return SESSION_COOKIE in {c.key for c in client.cookie_jar.filter_cookies(URL(con.base)).values()}


async def test_sign_in_with_slack_names_the_person_who_decides_as_their_slack_identity(tmp_path: Path) -> None:
    async with with_platforms(tmp_path) as (con, slack, _), con.client() as client:
        request = await con.open_approval({"command": "ls"})
        page = await (await client.get(f"{con.base}/login")).text()
        assert 'href="/login/slack">Sign in with Slack<' in page
        assert 'href="/login/discord">Sign in with Discord<' in page
        slack.sign_in.user = SLACK_ALICE
        answer = await sign_in_with(client, con, "slack")
        assert answer.status == 200, await answer.text()
        assert "alice (slack:U0ALICE01, signed in with Slack)" in await answer.text()
        authorize = next(h for h in answer.history if "/openid/connect/authorize" in str(h.url))
        assert authorize.url.query["scope"] == "openid"
        assert authorize.url.query["team"] == slack.team_id
        approval = await (await client.get(f"{con.base}/swarm?approval={request.id}")).text()
        csrf = re.search(r'<meta name="kazma-csrf" content="([^"]+)">', approval)
        assert csrf is not None
        decided = await client.post(
            f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf.group(1), "decision": "deny"}
        )
        assert "Denied. Recorded as alice (slack:U0ALICE01)." in await decided.text()
        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert (row.status, row.decided_by, row.decided_via, row.decided_person) == (
            Status.DENIED, "slack:U0ALICE01", "slack", "alice",
        )  # fmt: skip


@pytest.mark.parametrize(
    "forgery", ["other-key", "other-audience", "other-team", "expired", "other-nonce", "other-issuer"]
)
async def test_an_id_token_slack_did_not_make_for_this_sign_in_signs_nobody_in(
    tmp_path: Path, forgery: Forgery
) -> None:
    async with with_platforms(tmp_path) as (con, slack, _), con.client() as client:
        slack.sign_in.user = SLACK_ALICE
        slack.sign_in.forge = forgery
        answer = await sign_in_with(client, con, "slack")
        assert answer.status == 403, forgery
        assert "Slack did not prove a person Kazma knows" in await answer.text()
        assert not signed_in(client, con)


async def test_slack_refusals_a_stranger_a_crossed_state_and_a_reused_code(tmp_path: Path) -> None:
    async with with_platforms(tmp_path) as (con, slack, _):
        async with con.client() as client:
            slack.sign_in.user = "U0STRANGER"  # signed in to Slack, but nobody Kazma knows
            stranger = await sign_in_with(client, con, "slack")
            assert stranger.status == 403
            assert "slack:U0STRANGER is nobody this Kazma knows" in await stranger.text()
            assert not signed_in(client, con)
        slack.sign_in.user = SLACK_ALICE
        async with con.client() as victim, con.client() as attacker:
            # the attacker begins a sign-in, then hands the way back to the victim's browser (login CSRF)
            first = await attacker.get(f"{con.base}/login/slack", allow_redirects=False)
            to_slack = first.headers["Location"]
            async with aiohttp.ClientSession() as at_slack:
                back = (await at_slack.get(to_slack, allow_redirects=False)).headers["Location"]
            crossed = await victim.get(back)
            assert crossed.status == 403
            assert "not begun in this browser" in await crossed.text()
            assert not signed_in(victim, con)
            # in the browser that began it, the way back signs in once; the same way back again, never
            exchanged = len(slack.sign_in.exchanged)
            own = await attacker.get(back)
            assert own.status == 200
            assert len(slack.sign_in.exchanged) == exchanged + 1
            async with con.client() as replay:
                replay.cookie_jar.update_cookies(
                    {c.key: c.value for c in attacker.cookie_jar if c.key != SESSION_COOKIE}
                )
                replayed = await replay.get(back)
                assert replayed.status == 403
                assert not signed_in(replay, con)


async def test_sign_in_with_discord_asks_discord_whose_token_it_is(tmp_path: Path) -> None:
    async with with_platforms(tmp_path) as (con, _, discord), con.client() as client:
        request = await con.open_approval({"command": "ls"})
        discord.sign_in.user = discord.alice.payload()
        answer = await sign_in_with(client, con, "discord")
        assert answer.status == 200, await answer.text()
        assert f"alice (discord:{ALICE_ID}, signed in with Discord)" in await answer.text()
        assert STATE_COOKIE not in {c.key for c in client.cookie_jar}
        approval = await (await client.get(f"{con.base}/swarm?approval={request.id}")).text()
        csrf = re.search(r'<meta name="kazma-csrf" content="([^"]+)">', approval)
        assert csrf is not None
        await client.post(f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf.group(1), "decision": "deny"})
        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert (row.decided_by, row.decided_via, row.decided_person) == (f"discord:{ALICE_ID}", "discord", "alice")


async def test_sign_in_with_a_platform_from_a_card_link_comes_back_to_that_approval(tmp_path: Path) -> None:
    async with with_platforms(tmp_path) as (con, slack, discord), con.client() as client:
        request = await con.open_approval({"command": "ls"})
        path = f"/swarm?approval={request.id}"
        discord.sign_in.user = discord.alice.payload()
        slack.sign_in.user = SLACK_ALICE
        for platform in ("discord", "slack"):
            client.cookie_jar.clear()
            asked = await client.get(con.base + path)  # signed out: the sign-in page, which knows the way back
            page = await asked.text()
            found = re.search(rf'href="(/login/{platform}[^"]*)"', page)
            assert found is not None, page
            answer = await client.get(con.base + html.unescape(found.group(1)))
            assert answer.status == 200, await answer.text()
            back = await answer.text()
            assert f'<meta http-equiv="refresh" content="0;url={html.escape(path)}">' in back, platform
            assert f'href="{html.escape(path)}">Continue to where you were going<' in back
            assert NEXT_COOKIE not in {c.key for c in client.cookie_jar}
            landed = await client.get(con.base + path, allow_redirects=False)
            assert landed.status == 200, platform


async def test_discord_refusals_a_wrong_secret_a_stranger_and_a_person_who_said_no(tmp_path: Path) -> None:
    async with with_platforms(tmp_path) as (con, _, discord):
        async with con.client() as client:
            discord.sign_in.user = discord.bob.payload()  # Discord's bob: no identity of anybody here
            stranger = await sign_in_with(client, con, "discord")
            assert stranger.status == 403
            assert "is nobody this Kazma knows" in await stranger.text()
        async with con.client() as client:
            discord.sign_in.user = None  # the person pressed "Cancel" at Discord
            declined = await sign_in_with(client, con, "discord")
            assert declined.status == 403
            assert "Discord said &#x27;access_denied&#x27;" in await declined.text()
        async with con.client() as client:
            discord.sign_in.user = discord.alice.payload()
            discord.sign_in.client_secret = "rotated-at-discord"  # Kazma's secret no longer matches
            refused = await sign_in_with(client, con, "discord")
            assert refused.status == 403
            assert "Discord refused the code" in await refused.text()
            assert not signed_in(client, con)


async def test_one_client_starting_sign_ins_without_pause_is_told_to_wait(tmp_path: Path) -> None:
    # each start is a challenge in the store; one client past its share would push out others' sign-ins
    async with with_platforms(tmp_path) as (con, _, _), con.client() as client:
        for _ in range(CLIENT_CHALLENGES):
            started = await client.get(f"{con.base}/login/slack", allow_redirects=False)
            assert started.status == 302
        for platform in ("slack", "discord"):  # one share: both keep their challenges in the same pool
            over = await client.get(f"{con.base}/login/{platform}", allow_redirects=False)
            assert over.status == 429, platform
            assert 0 < int(over.headers["Retry-After"]) <= CHALLENGE_SECONDS
            assert "Too many sign-in challenges asked for from here" in await over.text()
        # a passkey sign-in is another pool, with its own share
        async with client.post(f"{con.base}/login/passkey/options", json={}) as passkey:
            assert passkey.status == 200
