"""The relying party's origin is the public URL's as a browser serialises it (lower case, no default port):
the origin a passkey's signed client data names is compared with it, so a public URL written with its default
port (``https://kazma.example.org:443``) must not refuse every passkey."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from kazma.bot.console.passkeys import RelyingParty
from kazma.bot.console.signin import CEREMONY_COOKIE
from tests.passkey_support import SoftAuthenticator
from tests.test_console_sign_in_cookies import _set_cookies, _value
from tests.test_web_server import console

BROWSER_ORIGIN = "https://kazma.example.org"  # what a browser puts in clientDataJSON for that page


def test_the_relying_partys_origin_is_serialised_as_a_browser_does() -> None:
    for written in ("https://Kazma.Example.org:443", "https://kazma.example.org:443/", "https://kazma.example.org"):
        assert RelyingParty.of(written) == RelyingParty(id="kazma.example.org", origin=BROWSER_ORIGIN), written
    assert RelyingParty.of("https://kazma.example.org:8443").origin == "https://kazma.example.org:8443"
    assert RelyingParty.of("http://localhost:80").origin == "http://localhost"


async def test_a_public_url_with_its_default_port_still_enrols_and_signs_in(tmp_path: Path) -> None:
    async with (
        console(tmp_path, extra="web: {public_url: 'https://kazma.example.org:443'}") as con,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client,
    ):
        assert con.server.signin is not None
        device = SoftAuthenticator()
        token, _ = await con.server.signin.accounts.invite("alice", created_by="test")
        begun = await client.post(f"{con.base}/enrol/{token}/options", json={})
        [line] = _set_cookies(begun).values()
        cookie = {"Cookie": f"__Host-{CEREMONY_COOKIE}={_value(line)}"}
        answer = device.create((await begun.json())["publicKey"], BROWSER_ORIGIN)
        enrolled = await client.post(f"{con.base}/enrol/{token}", json=answer, headers=cookie)
        assert enrolled.status == 200, await enrolled.text()

        begun = await client.post(f"{con.base}/login/passkey/options", json={})
        [line] = _set_cookies(begun).values()
        cookie = {"Cookie": f"__Host-{CEREMONY_COOKIE}={_value(line)}"}
        answer = device.get((await begun.json())["publicKey"], BROWSER_ORIGIN)
        signed_in = await client.post(f"{con.base}/login/passkey", json=answer, headers=cookie)
        assert signed_in.status == 200, await signed_in.text()
