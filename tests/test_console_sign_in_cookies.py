"""The short-lived cookies of signing in (a passkey ceremony's handle, a platform sign-in's state and where it
leads) over https: named with the ``__Host-`` prefix, as the session's, so that a sibling host, which may set a
cookie for the whole domain, cannot plant one in a person's browser. Under the plain name a handle opens nothing.

The browser is stood in for by explicit ``Cookie`` headers: the console is served over plain http on 127.0.0.1
here (behind the TLS proxy a real https console has), where a client keeps no ``Secure`` cookie."""

from __future__ import annotations

from http.cookies import SimpleCookie
from pathlib import Path

import aiohttp
from yarl import URL

from kazma.bot.console.auth import LOGIN_CSRF_COOKIE
from kazma.bot.console.platform_signin import STATE_COOKIE
from kazma.bot.console.signin import CEREMONY_COOKIE
from tests.fakes.slack import FakeSlack
from tests.passkey_support import SoftAuthenticator
from tests.test_platform_signin import SLACK_ALICE
from tests.test_web_server import OPERATOR, _field, console

PUBLIC = "https://kazma.example.org"
PEOPLE = f"people:\n  alice: {{web: alice}}\n  mallory: {{web: mallory, slack: {SLACK_ALICE}}}\n"


def _set_cookies(response: aiohttp.ClientResponse) -> dict[str, str]:
    """Each cookie the response sets, by name: its whole ``Set-Cookie`` line."""
    found: dict[str, str] = {}
    for line in response.headers.getall("Set-Cookie", []):
        found[line.split("=", 1)[0]] = line
    return found


def _value(line: str) -> str:
    cookie: SimpleCookie = SimpleCookie()
    cookie.load(line)
    return next(iter(cookie.values())).value


def _is_host_prefixed(line: str) -> bool:
    parts = [p.strip() for p in line.split(";")]
    return (
        line.startswith("__Host-")
        and "Secure" in parts
        and "Path=/" in parts
        and not any(p.lower().startswith("domain=") for p in parts)
    )


async def test_a_passkey_ceremony_is_found_only_by_its_host_prefixed_cookie(tmp_path: Path) -> None:
    async with (
        console(tmp_path, extra=f"web: {{public_url: '{PUBLIC}'}}") as con,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client,
    ):
        assert con.server.signin is not None
        device = SoftAuthenticator()
        # a passkey for the https console's relying party, enrolled through the store (the ceremony is below)
        token, _ = await con.server.signin.accounts.invite("alice", created_by="test")
        begun = await client.post(f"{con.base}/enrol/{token}/options", json={})
        [line] = _set_cookies(begun).values()
        assert _is_host_prefixed(line), line
        options = (await begun.json())["publicKey"]
        handle = _value(line)
        enrolled = await client.post(
            f"{con.base}/enrol/{token}", json=device.create(options, PUBLIC),
            headers={"Cookie": f"__Host-{CEREMONY_COOKIE}={handle}"},
        )  # fmt: skip
        assert enrolled.status == 200, await enrolled.text()
        dropped = _set_cookies(enrolled)[f"__Host-{CEREMONY_COOKIE}"]
        assert "Max-Age=0" in dropped
        assert "Secure" in dropped  # else a browser keeps a __Host- cookie

        for name, status in ((CEREMONY_COOKIE, 403), (f"__Host-{CEREMONY_COOKIE}", 200)):
            begun = await client.post(f"{con.base}/login/passkey/options", json={})
            [line] = _set_cookies(begun).values()
            assert _is_host_prefixed(line), line
            answer = device.get((await begun.json())["publicKey"], PUBLIC)
            # under the plain name (what a sibling host could have set), the handle finds no ceremony
            finished = await client.post(
                f"{con.base}/login/passkey", json=answer, headers={"Cookie": f"{name}={_value(line)}"}
            )
            assert finished.status == status, (name, await finished.text())


async def test_a_platform_sign_in_planted_by_a_sibling_host_signs_nobody_in(tmp_path: Path) -> None:
    """Login CSRF by cookie tossing: mallory begins Sign in with Slack in her own browser, then puts her state's
    handle into alice's browser under the plain cookie name (a sibling host may set one for the whole domain)
    and sends alice along mallory's way back. Alice must not end up signed in as mallory."""
    slack = FakeSlack()
    await slack.start()
    oidc = slack.sign_in
    extra = (
        f"web: {{public_url: '{PUBLIC}'}}\n"
        "platforms:\n"
        f"  slack: {{api_base_url: '{slack.api_url}', sign_in: {{client_id: '{oidc.client_id}',"
        f" client_secret: '{oidc.client_secret}', team_id: {slack.team_id},"
        f" authorize_url: '{slack.url}/openid/connect/authorize', keys_url: '{slack.url}/openid/connect/keys'}}}}\n"
    )
    try:
        async with (
            console(tmp_path, extra=extra, people=PEOPLE, approvers="[alice]") as con,
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as browser,
        ):
            oidc.user = SLACK_ALICE  # Slack says: mallory's account (mallory: {slack: U0ALICE01} above)

            async def way_back() -> tuple[str, str]:
                """Begin a sign-in; (the cookie line it set, the console URL Slack sends the browser back to)."""
                start = await browser.get(f"{con.base}/login/slack", allow_redirects=False)
                [line] = [v for k, v in _set_cookies(start).items() if STATE_COOKIE in k]
                at_slack = await browser.get(start.headers["Location"], allow_redirects=False)
                back = URL(at_slack.headers["Location"])  # on the public URL: reached here through the "proxy"
                return line, str(URL(con.base).with_path(back.path).with_query(back.query))

            line, back = await way_back()
            assert _is_host_prefixed(line), line
            planted = await browser.get(back, headers={"Cookie": f"{STATE_COOKIE}={_value(line)}"})
            assert planted.status == 403, await planted.text()
            assert "not begun in this browser" in await planted.text()
            assert not [k for k in _set_cookies(planted) if "session" in k]

            # the cookie as the console set it still signs its own browser in
            line, back = await way_back()
            own = await browser.get(back, headers={"Cookie": f"__Host-{STATE_COOKIE}={_value(line)}"})
            assert own.status == 200, await own.text()
            assert "mallory (slack:U0ALICE01, signed in with Slack)" in await own.text()
    finally:
        await slack.stop()


async def test_the_token_login_forms_pair_is_found_only_by_its_host_prefixed_cookie(tmp_path: Path) -> None:
    """The shared-token login's double-submit cookie, as the others: a sibling host that sets the plain name for
    the whole domain (and writes the same value in its own form) cannot make a login's pair match."""
    async with (
        console(tmp_path, extra=f"web: {{public_url: '{PUBLIC}'}}") as con,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as browser,
    ):
        for name, status in ((LOGIN_CSRF_COOKIE, 403), (f"__Host-{LOGIN_CSRF_COOKIE}", 303)):
            form = await browser.get(f"{con.base}/login")
            [line] = _set_cookies(form).values()
            assert _is_host_prefixed(line), line
            field = _field(await form.text(), "csrf")
            assert _value(line) == field
            answer = await browser.post(
                f"{con.base}/login",
                data={"csrf": field, "name": "rita", "token": OPERATOR},
                headers={"Cookie": f"{name}={field}"},
                allow_redirects=False,
            )
            assert answer.status == status, (name, await answer.text())
        dropped = _set_cookies(answer)[f"__Host-{LOGIN_CSRF_COOKIE}"]
        assert "Max-Age=0" in dropped
        assert "Secure" in dropped  # else a browser keeps a __Host- cookie
