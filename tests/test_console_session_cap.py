"""Who can push whom out of the console's session table: a shared token's holders only each other."""

from __future__ import annotations

import re
from pathlib import Path

from yarl import URL

from kazma.bot.console.auth import MAX_SESSIONS
from tests.test_web_server import OPERATOR, READER, _field, console


async def test_a_reader_token_flood_does_not_sign_an_approver_out(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as alice, con.client() as reader:
        await con.login(alice, "alice", OPERATOR)  # alice's passkey: an approver's session
        form = await reader.get(f"{con.base}/login")
        login_csrf = _field(await form.text(), "csrf")
        for i in range(MAX_SESSIONS + 5):
            # each login makes a fresh session; the reader's cookie jar keeps only the newest
            reader.cookie_jar.update_cookies({"kazma_login_csrf": login_csrf}, URL(f"{con.base}/login"))
            answer = await reader.post(
                f"{con.base}/login",
                data={"csrf": login_csrf, "name": f"r{i}", "token": READER},
                allow_redirects=False,
            )
            assert answer.status == 303, await answer.text()
            reader.cookie_jar.clear(lambda cookie: cookie.key == "kazma_session")  # the old one stays open
        page = await alice.get(f"{con.base}/", allow_redirects=False)
        assert page.status == 200, "the approver was signed out by the reader's logins"
        assert re.search(r"alice \(web:alice, passkey\)", await page.text())
        assert con.server.auth is not None
        # the reader token's sessions are still bounded: its oldest made room for its newest
        assert await con.server.auth.store.count() == MAX_SESSIONS + 1
