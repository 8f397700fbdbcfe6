"""Signing in leads back to the page that asked for it, over real HTTP: a card's link opened while signed out
comes back to its approval after the token form or a passkey (tests/test_browser_approval_page.py walks the same
path in Chromium). Where to go back to is a local path, checked on the server: another site, a scheme, a
protocol-relative or backslashed path, or a control character leads to the console instead.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from kazma.bot.console.auth import login_href
from tests.passkey_support import SoftAuthenticator, _post, enrol
from tests.test_web_server import READER, _field, console

HOSTILE = ["//evil.example/x", "https://evil.example/x", "/\\evil.example", "javascript:alert(1)", "/swarm\r\nX: y"]


def test_the_sign_in_link_carries_only_a_local_path() -> None:
    assert parse_qs(urlsplit(login_href("/swarm?approval=abc")).query) == {"next": ["/swarm?approval=abc"]}
    assert login_href("/") == "/login"
    assert login_href("/login?next=%2Fswarm") == "/login"  # never back to the sign-in page itself
    for hostile in HOSTILE:
        assert login_href(hostile) == "/login", hostile


async def test_a_card_link_signed_out_comes_back_to_its_approval_after_the_token_form(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        request = await con.open_approval({"command": "ls"})
        path = f"/swarm?approval={request.id}"
        first = await client.get(con.base + path, allow_redirects=False)
        assert first.status == 302
        sign_in = first.headers["Location"]
        assert parse_qs(urlsplit(sign_in).query) == {"next": [path]}

        page = await (await client.get(con.base + sign_in)).text()
        assert _field(page, "next") == path  # the token form carries it
        found = re.search(r'id="passkey-sign-in"[^>]*data-verify="([^"]+)"', page)
        assert found is not None
        assert html.unescape(found.group(1)) == login_href(path).replace("/login", "/login/passkey")
        posted = await client.post(
            f"{con.base}/login",
            data={"csrf": _field(page, "csrf"), "name": "rita", "token": READER, "next": path},
            allow_redirects=False,
        )
        assert (posted.status, posted.headers["Location"]) == (303, path)
        landed = await client.get(con.base + path, allow_redirects=False)
        assert landed.status == 200
        assert request.id in await landed.text()


@pytest.mark.parametrize("hostile", HOSTILE)
async def test_a_hostile_next_leads_to_the_console(tmp_path: Path, hostile: str) -> None:
    async with console(tmp_path) as con, con.client() as client:
        page = await (await client.get(f"{con.base}/login", params={"next": hostile})).text()
        assert _field(page, "next") == "/"
        posted = await client.post(
            f"{con.base}/login",
            data={"csrf": _field(page, "csrf"), "name": "rita", "token": READER, "next": hostile},
            allow_redirects=False,
        )
        assert (posted.status, posted.headers["Location"]) == (303, "/")


async def test_a_passkey_sign_in_answers_with_the_page_it_was_asked_for_and_never_another_site(
    tmp_path: Path,
) -> None:
    async with console(tmp_path) as con:
        authenticator = SoftAuthenticator()
        async with con.client() as client:
            await enrol(client, con.base, await con.invite("alice"), authenticator)
        request = await con.open_approval({"command": "ls"})
        path = f"/swarm?approval={request.id}"
        for asked, answered in ((path, path), ("//evil.example/x", "/"), ("https://evil.example", "/")):
            async with con.client() as client:
                options = await _post(client, f"{con.base}/login/passkey/options")
                answer = authenticator.get(options["publicKey"], con.base)
                done = await _post(client, f"{con.base}{login_href(asked).replace('/login', '/login/passkey')}", answer)
                if asked != path:  # login_href already dropped it: ask the server directly too
                    done = await _post(
                        client,
                        f"{con.base}/login/passkey?next={asked}",
                        authenticator.get((await _post(client, f"{con.base}/login/passkey/options"))["publicKey"],
                                          con.base),
                    )  # fmt: skip
                assert done["next"] == answered, asked
