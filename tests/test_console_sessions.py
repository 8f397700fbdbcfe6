"""Console sessions live in the store: they survive a restart, only a hash of the token is kept, and a
forged, expired or logged-out cookie opens nothing."""

from __future__ import annotations

import hashlib
import secrets
import time
from pathlib import Path

import aiohttp
from yarl import URL

from kazma.bot.console.auth import SESSION_COOKIE, SESSION_SECONDS, session_csrf
from kazma.bot.console.sessions import MIGRATIONS, Opening, SessionStore
from kazma.config.store.database import Tables, open_database
from tests.test_web_server import OPERATOR, Console, console

AsyncClient = aiohttp.ClientSession
READER = Opening(login="a", role="reader", proof="reader-token")


def cookie_of(client: AsyncClient, con: Console) -> str:
    return client.cookie_jar.filter_cookies(URL(con.base))[SESSION_COOKIE].value


async def status_with(con: Console, sid: str, path: str = "/") -> int:
    async with aiohttp.ClientSession() as fresh:
        response = await fresh.get(
            f"{con.base}{path}", headers={"Cookie": f"{SESSION_COOKIE}={sid}"}, allow_redirects=False
        )
        return response.status


Row = tuple[str, str, str, float, float, float]


async def rows(con: Console) -> list[Row]:
    """(token hash, login, role, created, last seen, expires) of every stored session."""
    found = await Tables.of(con.app.stores.connections[0]).all(
        "SELECT token_hash, login, role, created_at, last_seen, expires_at FROM web_sessions"
    )
    return [(str(h), str(login), str(role), float(c), float(s), float(e)) for h, login, role, c, s, e in found]


async def test_a_session_and_its_pending_message_survive_a_restart(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        csrf = await con.login(client, "alice", OPERATOR)
        sid = cookie_of(client, con)
        sent = await client.post(f"{con.base}/console/send", data={"csrf": csrf, "text": "  "}, allow_redirects=False)
        assert sent.status == 303  # "Nothing to send." waits for the next page, in the store
    async with console(tmp_path) as again, aiohttp.ClientSession() as client:  # a new process on the same store
        headers = {"Cookie": f"{SESSION_COOKIE}={sid}"}
        page = await client.get(f"{again.base}/", headers=headers, allow_redirects=False)
        assert page.status == 200
        text = await page.text()
        assert "alice (web:alice, passkey) · operator" in text
        assert "Nothing to send." in text
        assert f'<meta name="kazma-csrf" content="{csrf}">' in text  # the same CSRF token: derived, not stored
        shown_once = await (await client.get(f"{again.base}/", headers=headers)).text()
        assert "Nothing to send." not in shown_once
        out = await client.post(f"{again.base}/logout", data={"csrf": csrf}, headers=headers, allow_redirects=False)
        assert (out.status, out.headers["Location"]) == (303, "/login")
        assert await rows(again) == []  # logout deleted the row
        assert await status_with(again, sid) == 302


async def test_only_a_hash_of_the_session_token_is_stored(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        before = time.time()
        csrf = await con.login(client, "alice", OPERATOR)
        sid = cookie_of(client, con)
        (row,) = await rows(con)
        token_hash, login, role, created, seen, expires = row
        assert token_hash == hashlib.sha256(sid.encode()).hexdigest()
        assert (login, role) == ("alice", "operator")
        assert before <= created == seen <= time.time()
        assert expires - created == SESSION_SECONDS
        assert csrf == session_csrf(sid)
        # Neither the session token, nor its CSRF token, nor the console token is anywhere in the store's files.
        raw = b"".join(p.read_bytes() for p in tmp_path.glob("k.db*"))
        assert token_hash.encode() in raw  # the files read are the ones holding the sessions
        for secret in (sid, csrf, OPERATOR):
            assert secret.encode() not in raw

        # Last seen is written when it is a minute old, not at every request.
        tables = Tables.of(con.app.stores.connections[0])
        await tables.run("UPDATE web_sessions SET last_seen = ?", (seen - 30,))
        assert await status_with(con, sid) == 200
        assert (await rows(con))[0][4] == seen - 30
        await tables.run("UPDATE web_sessions SET last_seen = ?", (seen - 61,))
        touched = time.time()
        assert await status_with(con, sid) == 200
        assert (await rows(con))[0][4] >= touched


async def test_a_forged_or_expired_cookie_is_refused(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        await con.login(client, "alice", OPERATOR)
        sid = cookie_of(client, con)
        ((token_hash, *_),) = await rows(con)
        for forged in (secrets.token_urlsafe(32), token_hash, sid[:-1], sid + "x", "x" * 500):
            assert await status_with(con, forged) == 302
            assert await status_with(con, forged, "/events") == 401
        assert await status_with(con, sid) == 200

        await Tables.of(con.app.stores.connections[0]).run(
            "UPDATE web_sessions SET expires_at = ? WHERE token_hash = ?", (time.time() - 1, token_hash)
        )
        assert await status_with(con, sid) == 302
        assert await rows(con) == []  # refused and deleted when met


async def test_logins_sweep_expired_sessions_and_keep_at_most_the_limit(tmp_path: Path) -> None:
    now = [1_000_000.0]
    conn = await open_database(tmp_path / "s.db", migrations=MIGRATIONS)
    try:
        store = SessionStore(conn, clock=lambda: now[0])
        for i in range(3):
            await store.open(f"h{i}", READER, binding="b", lifetime=10.0 + i, max_sessions=3)
        assert await store.count() == 3
        await store.open("h3", READER, binding="b", lifetime=100.0, max_sessions=3)
        assert await store.find("h0") is None  # the one closest to expiring made room
        assert await store.count() == 3
        now[0] += 11.5  # h1 (11 s) has expired, h2 (12 s) has not
        assert await store.find("h1") is None
        assert await store.count() == 2  # deleted when met
        now[0] += 1.0
        await store.open("h4", READER, binding="b", lifetime=100.0, max_sessions=3)
        assert sorted(r[0] for r in await Tables.of(conn).all("SELECT token_hash FROM web_sessions")) == ["h3", "h4"]
    finally:
        await conn.close()


async def test_an_https_console_names_its_session_cookie_with_the_host_prefix(tmp_path: Path) -> None:
    # __Host-: Secure, Path=/, no Domain, so a sibling host or a plain-http page cannot plant or replace it
    extra = "web: {public_url: 'https://kazma.example.org'}"
    async with console(tmp_path, extra=extra) as con, aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as c:
        form = await c.get(f"{con.base}/login")
        login_csrf = form.cookies["__Host-kazma_login_csrf"].value
        page = await form.text()
        field = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        opened = await c.post(
            f"{con.base}/login",
            data={"csrf": field, "name": "rita", "token": OPERATOR},
            headers={"Cookie": f"__Host-kazma_login_csrf={login_csrf}"},
            allow_redirects=False,
        )
        assert opened.status == 303, await opened.text()
        set_cookie = [v for v in opened.headers.getall("Set-Cookie") if "session=" in v]
        assert len(set_cookie) == 1
        cookie = set_cookie[0]
        assert cookie.startswith("__Host-kazma_session=")
        assert "Secure" in cookie
        assert "Path=/;" in cookie or cookie.endswith("Path=/")
        assert "Domain" not in cookie
        sid = opened.cookies["__Host-kazma_session"].value
        prefixed = {"Cookie": f"__Host-kazma_session={sid}"}
        served = await c.get(f"{con.base}/", headers=prefixed, allow_redirects=False)
        assert served.status == 200
        # the unprefixed name is one any sibling host could have set: it opens nothing here
        plain = await c.get(f"{con.base}/", headers={"Cookie": f"kazma_session={sid}"}, allow_redirects=False)
        assert plain.status == 302
        csrf = session_csrf(sid)
        out = await c.post(f"{con.base}/logout", data={"csrf": csrf}, headers=prefixed, allow_redirects=False)
        assert out.status == 303
        ended = next(v for v in out.headers.getall("Set-Cookie") if v.startswith("__Host-kazma_session="))
        assert "Secure" in ended  # a browser ignores a __Host- cookie's deletion without it
        assert "Max-Age=0" in ended
        assert (await c.get(f"{con.base}/", headers=prefixed, allow_redirects=False)).status == 302
