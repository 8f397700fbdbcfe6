"""The console under a hostile client on the same network, over real HTTP: bytes that are no text where a token
is expected (a cookie a sibling host planted, a CSRF header) are answered as a refusal, never a 500; and the
secret in a link's path (an enrolment link, kazma demo's one-time sign-in) is never written to the log when
a request for it is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from yarl import URL

from kazma.bot.console.mcp_askers import jsonrpc
from kazma.bot.console.miniapp import InitDataRefused, verify_init_data
from tests.passkey_support import CeremonyRefused, SoftAuthenticator, enrol
from tests.test_web_server import OPERATOR, Console, console


async def _raw(con: Console, head: bytes, body: bytes = b"") -> int:
    """The status of one request written byte for byte (a client library would not send bytes that are no text)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", URL(con.base).port)
    try:
        length = f"Content-Length: {len(body)}\r\n".encode()
        writer.write(head + length + b"Host: localhost\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        status_line = await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()
    return int(status_line.split()[1])


async def test_bytes_that_are_no_text_in_a_cookie_or_a_csrf_header_are_refused_not_a_server_error(
    tmp_path: Path,
) -> None:
    async with console(tmp_path) as con, con.client() as alice:
        await con.login(alice, "alice", OPERATOR)
        request = await con.open_approval({"cmd": "ls"})
        [sid] = [c.value for c in alice.cookie_jar if c.key == "kazma_session"]
        session = f"Cookie: kazma_session={sid}\r\n".encode()
        form = b"Content-Type: application/x-www-form-urlencoded\r\n"
        decide = f"POST /approvals/{request.id}/decide HTTP/1.1\r\n".encode()
        step_up = f"POST /approvals/{request.id}/step-up/options HTTP/1.1\r\n".encode()
        cases = {
            # a session cookie of bytes that are no UTF-8 (planted for the domain by a sibling host over http)
            "session cookie": (b"GET / HTTP/1.1\r\nCookie: kazma_session=\xff\xfe\r\n", b"", 302),
            # a signed-in person's form with such a CSRF header: refused like any wrong token
            "decide csrf": (decide + session + form + b"X-CSRF-Token: \xff\xfe\r\n", b"decision=deny", 403),
            "step-up csrf": (step_up + session + b"X-CSRF-Token: \xff\xfe\r\n", b"", 403),
            "upload csrf": (
                b"POST /console/upload HTTP/1.1\r\n" + session + form + b"X-CSRF-Token: \xff\xfe\r\n",
                b"",
                403,
            ),
            # a ceremony's cookie: no ceremony was begun with it
            "ceremony cookie": (b"POST /login/passkey HTTP/1.1\r\nCookie: kazma_ceremony=\xff\r\n", b"{}", 403),
            "login form cookie": (
                b"POST /login HTTP/1.1\r\nCookie: kazma_login_csrf=\xff\r\n" + form,
                b"csrf=%FF&name=m&token=t",
                403,
            ),
        }
        for name, (head, body, expected) in cases.items():
            assert await _raw(con, head, body) == expected, name
        # nothing was decided, and the person's own session still works
        stored = await con.app.service.store.get(request.id)
        assert stored is not None
        assert stored.status.value == "pending"
        assert (await alice.get(f"{con.base}/", allow_redirects=False)).status == 200


async def test_a_refused_request_for_an_enrolment_link_does_not_write_its_token_to_the_log(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        link = await con.invite("alice")
        token = URL(link).parts[-1]
        path = URL(link).path
        with capture_logs() as events:
            # the link opened at a name the console does not answer to (an internal name, a proxy's)
            misdirected = await client.get(f"{con.base}{path}", headers={"Host": "kazma.internal:8765"})
            assert misdirected.status == 421
            # its ceremony begun from a page the browser says is another site's
            cross = await client.post(
                f"{con.base}{path}/options",
                json={},
                headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
            )
            assert cross.status == 403
        refusals = [e for e in events if e["event"] in ("web.host_refused", "web.origin_refused")]
        assert [e["event"] for e in refusals] == ["web.host_refused", "web.origin_refused"]
        for event in refusals:
            assert token not in repr(event), event
            assert event["path"] in ("/enrol/…", "/enrol/…/options"), event
        # the link itself still enrols: the refusals took nothing from it
        assert (await client.get(link)).status == 200


@pytest.mark.parametrize("init_data", ["auth_date=1&user=\ud800&hash=abc", "auth_date=1&user=%7B%7D&hash=\ud800"])
def test_initdata_with_a_lone_surrogate_from_json_is_refused_not_a_server_error(init_data: str) -> None:
    # the Mini App's POST is JSON, whose "\ud800" escape is a string no UTF-8 encodes
    with pytest.raises(InitDataRefused, match="signature"):
        verify_init_data(init_data, "123456:this-bots-token")


async def test_revoking_all_of_a_persons_passkeys_closes_their_open_enrolment_links(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as alice, con.client() as mallory:
        signin = con.server.signin
        assert signin is not None
        leaked = await con.invite("alice")  # a link sent over a chat that turned out to be read by others
        await enrol(alice, con.base, await con.invite("alice"), SoftAuthenticator())
        request = await con.open_approval({"cmd": "rm -rf /srv"})
        # the compromise is noticed: every passkey of alice's is revoked, the step the README gives for it
        assert len(await signin.accounts.revoke(person="alice", credential_id=None, by="cli:root")) == 1
        with pytest.raises(CeremonyRefused) as refused:
            await enrol(mallory, con.base, leaked, SoftAuthenticator())
        assert refused.value.status == 410
        assert "expired" in refused.value.message
        assert [p for p in await signin.accounts.passkeys("alice") if not p.revoked] == []
        # nobody holds a session as alice, so nobody approves as her
        page = await mallory.get(f"{con.base}/swarm?approval={request.id}", allow_redirects=False)
        assert page.status == 302
        stored = await con.app.service.store.get(request.id)
        assert stored is not None
        assert stored.status.value == "pending"
        # a link made after the revocation enrols her new device
        await enrol(alice, con.base, await con.invite("alice"), SoftAuthenticator())


async def test_an_answer_nested_thousands_deep_is_not_json_to_the_ceremonies_not_a_server_error(
    tmp_path: Path,
) -> None:
    deep = b"[" * 20_000 + b"]" * 20_000  # within the 64 KiB an answer may have, past the JSON parser's stack
    async with console(tmp_path) as con, con.client() as alice, con.client() as anyone:
        csrf = await con.login(alice, "alice", OPERATOR)
        request = await con.open_approval({"cmd": "ls"})
        token = URL(await con.invite("bob")).parts[-1]
        step_up = f"{con.base}/approvals/{request.id}/step-up"
        assert (await alice.post(f"{step_up}/options", json={}, headers={"X-CSRF-Token": csrf})).status == 200
        answered = await alice.post(step_up, data=deep, headers={"X-CSRF-Token": csrf})
        assert answered.status == 400, await answered.text()
        assert (await answered.json())["error"] == "the answer is not JSON"
        await anyone.post(f"{con.base}/login/passkey/options", json={})
        for path in ("/login/passkey", f"/enrol/{token}"):
            answered = await anyone.post(f"{con.base}{path}", data=deep)
            assert answered.status == 400, path
            assert (await answered.json())["error"] == "the answer is not JSON", path
        stored = await con.app.service.store.get(request.id)
        assert stored is not None
        assert stored.status.value == "pending"


def test_a_jsonrpc_body_nested_thousands_deep_is_no_message_not_a_server_error() -> None:
    # /mcp reads the body for its cancellations before the SDK does: a token holder's deep array raised there
    assert jsonrpc(b"[" * 20_000 + b"]" * 20_000) is None


async def test_an_answer_that_arrives_in_two_parts_is_read_whole() -> None:
    # read_answer took one read of the stream, which gives what has arrived so far: a passkey's answer whose body
    # came in two TCP segments was cut at the first and refused as "the answer is not JSON".
    import json

    from aiohttp import web

    from kazma.bot.console.signin import read_answer

    reading = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        reading.set()  # the headers and the first part are in: the second is sent only now
        return web.json_response({"got": await read_answer(request)})

    application = web.Application()
    application.router.add_post("/answer", answer)
    runner = web.AppRunner(application)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        body = json.dumps({"clientDataJSON": "x" * 3000}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = f"POST /answer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body[:1000])
        await writer.drain()
        await reading.wait()
        writer.write(body[1000:])
        await writer.drain()
        response = await reader.read()
        writer.close()
    finally:
        await runner.cleanup()
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 200 OK", response[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2]) == {"got": json.loads(body)}
