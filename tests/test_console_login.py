"""Logging in to the console behind a reverse proxy, over real HTTP: the throttle keys on the real client
(``web.trusted_proxies``), forged forwarding headers change nothing, a right token is never refused for
anybody's wrong ones, and guessing stays slow.

The proxy is tests/forwarding_proxy.py (what nginx does: it appends its peer to ``X-Forwarded-For``); clients
connect from different loopback addresses, so the proxy sees them apart while Kazma sees only the proxy.
How long a wrong answer is held is watched through the throttle's ``pause`` (the tests do not wait it out).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from kazma.bot.console.forwarded import ClientAddresses
from kazma.bot.console.login_throttle import FIRST_HOLD, LAST_HOLD, LOGIN_FAILURES, LoginThrottle
from tests.forwarding_proxy import ForwardingProxy
from tests.mcp_support import free_port
from tests.nginx_support import SINGLE, certificate, main_config, nginx_or_skip, running, with_certificate
from tests.test_web_server import OPERATOR, READER, Console, _field, console

STRANGER, OPERATOR_DESK, OTHER = "127.0.0.2", "127.0.0.3", "127.0.0.4"
TRUST_LOOPBACK_PROXY = "web: {trusted_proxies: ['127.0.0.1']}\n"


class Holds:
    """The throttle's pause: records each hold; ``blocking`` keeps each held until the test releases it."""

    def __init__(self, *, blocking: bool = False) -> None:
        self.seen: list[float] = []
        self.blocking = blocking
        self.released = 0
        self._changed = asyncio.Condition()

    async def __call__(self, seconds: float) -> None:
        async with self._changed:
            self.seen.append(seconds)
            number = len(self.seen)
            self._changed.notify_all()
            if self.blocking:
                await self._changed.wait_for(lambda: self.released >= number)

    async def release_one(self) -> None:
        async with self._changed:
            self.released += 1
            self._changed.notify_all()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(10), self._changed:
            await self._changed.wait_for(predicate)


def client_from(address: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(local_addr=(address, 0)), cookie_jar=aiohttp.CookieJar(unsafe=True)
    )


class Door:
    """The login form at ``base`` (the console, or the proxy in front of it), for one client."""

    def __init__(self, client: aiohttp.ClientSession, base: str) -> None:
        self.client = client
        self.base = base
        self.csrf = ""

    async def attempt(
        self, token: str, *, name: str = "mallory", headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        if not self.csrf:
            self.csrf = _field(await (await self.client.get(f"{self.base}/login")).text(), "csrf")
        response = await self.client.post(
            f"{self.base}/login",
            data={"csrf": self.csrf, "name": name, "token": token},
            headers=headers,
            allow_redirects=False,
        )
        await response.read()
        return response

    def logged_in(self) -> bool:
        return "kazma_session" in self.client.cookie_jar.filter_cookies(URL(self.base))


def guess(number: int) -> str:
    return f"guess-{number:04d}-padded-to-look-like-a-console-token"


@asynccontextmanager
async def behind_proxy(tmp_path: Path, *, extra: str = "") -> AsyncIterator[tuple[Console, ForwardingProxy, Holds]]:
    async with console(tmp_path, extra=extra) as con, ForwardingProxy(con.base) as proxy:
        holds = Holds()
        assert con.server.auth is not None
        con.server.auth.throttle.pause = holds
        yield con, proxy, holds


def expected_holds(count: int) -> list[float]:
    return [min(LAST_HOLD, FIRST_HOLD * 2**n) for n in range(count)]


# -- behind the documented proxy -----------------------------------------------------------------


async def test_behind_a_trusted_proxy_a_strangers_guesses_keep_nobody_else_out(tmp_path: Path) -> None:
    async with (
        behind_proxy(tmp_path, extra=TRUST_LOOPBACK_PROXY) as (_con, proxy, holds),
        client_from(STRANGER) as stranger_client,
        client_from(OPERATOR_DESK) as operator_client,
    ):
        stranger = Door(stranger_client, proxy.base)
        statuses = [(await stranger.attempt(guess(n))).status for n in range(100)]
        assert statuses == [401] * LOGIN_FAILURES + [429] * (100 - LOGIN_FAILURES)
        assert holds.seen == expected_holds(100 - LOGIN_FAILURES)  # every wrong one past the first few held longer

        # the operator, through the same proxy from another machine: in at once, nothing held for them
        operator = Door(operator_client, proxy.base)
        held_before = len(holds.seen)
        answer = await operator.attempt(OPERATOR, name="alice")
        assert (answer.status, answer.headers["Location"]) == (303, "/")
        assert operator.logged_in()
        assert len(holds.seen) == held_before
        # a typo of theirs is their own first one: answered at once, not held
        assert (await Door(operator_client, proxy.base).attempt("typo-" + OPERATOR, name="alice")).status == 401
        assert len(holds.seen) == held_before

        # the stranger's next guesses are still slowed, at the longest hold
        again = await stranger.attempt(guess(100))
        assert again.status == 429
        assert 0 < int(again.headers["Retry-After"]) <= 60
        assert holds.seen[-1] == LAST_HOLD

        # and someone with the right token at the stranger's address (the same office) is let in, not refused
        colleague = Door(stranger_client, proxy.base)
        colleague.csrf = stranger.csrf
        accepted = await colleague.attempt(READER, name="rita")
        assert accepted.status == 303
        assert colleague.logged_in()


async def test_without_trusted_proxies_the_proxy_is_the_client_and_the_right_token_still_gets_in(
    tmp_path: Path,
) -> None:
    # The bug seen: behind the proxy a stranger's 5 wrong tokens answered the operator's right one with 429.
    async with (
        behind_proxy(tmp_path) as (_con, proxy, holds),
        client_from(STRANGER) as stranger_client,
        client_from(OPERATOR_DESK) as operator_client,
    ):
        stranger = Door(stranger_client, proxy.base)
        statuses = [(await stranger.attempt(guess(n))).status for n in range(100)]
        assert statuses == [401] * LOGIN_FAILURES + [429] * (100 - LOGIN_FAILURES)

        operator = Door(operator_client, proxy.base)
        answer = await operator.attempt(OPERATOR, name="alice")
        assert (answer.status, answer.headers["Location"]) == (303, "/")
        assert operator.logged_in()
        # everyone is the proxy here, so the operator's own typo is held like the stranger's guesses: the cost of
        # not naming the proxy in web.trusted_proxies (README: Behind a TLS reverse proxy)
        held = len(holds.seen)
        assert (await Door(operator_client, proxy.base).attempt("typo-" + OPERATOR, name="alice")).status == 429
        assert len(holds.seen) == held + 1
        assert (await stranger.attempt(guess(100))).status == 429


# -- forged headers ------------------------------------------------------------------------------


async def test_a_forged_forwarded_for_does_not_change_who_is_slowed(tmp_path: Path) -> None:
    async with (
        behind_proxy(tmp_path, extra=TRUST_LOOPBACK_PROXY) as (con, proxy, holds),
        client_from(STRANGER) as stranger_client,
    ):
        # straight to Kazma from a peer that is not a trusted proxy: its headers are not read at all
        direct = Door(stranger_client, con.base)
        for n in range(LOGIN_FAILURES + 3):
            forged = {"X-Forwarded-For": f"203.0.113.{n}", "Forwarded": f"for=198.51.100.{n}"}
            response = await direct.attempt(guess(n), headers=forged)
            assert response.status == (401 if n < LOGIN_FAILURES else 429), n
        assert holds.seen == expected_holds(3)

    async with (
        behind_proxy(tmp_path / "2", extra=TRUST_LOOPBACK_PROXY) as (con, proxy, holds),
        client_from(STRANGER) as stranger_client,
    ):
        # through the trusted proxy: what the client wrote is left of what the proxy appended, and not believed
        through = Door(stranger_client, proxy.base)
        for n in range(LOGIN_FAILURES + 3):
            forged = {"X-Forwarded-For": f"203.0.113.{n}, 127.0.0.1"}  # even naming the trusted proxy itself
            response = await through.attempt(guess(n), headers=forged)
            assert response.status == (401 if n < LOGIN_FAILURES else 429), n
        assert holds.seen == expected_holds(3)


@asynccontextmanager
async def who_is_asking(trusted: list[str]) -> AsyncIterator[str]:
    """A bare aiohttp app that answers with the client :class:`ClientAddresses` finds, on 127.0.0.1."""
    addresses = ClientAddresses(trusted)

    async def whoami(request: web.Request) -> web.Response:
        client = addresses.of(request)
        return web.json_response({"address": client.address, "peer": client.peer, "key": client.throttle_key})

    application = web.Application()
    application.router.add_get("/", whoami)
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("trusted", "headers", "expected", "key"),
    [
        # no proxy trusted: the socket's peer, whatever the headers say
        ([], {"X-Forwarded-For": "203.0.113.7"}, "127.0.0.2", "127.0.0.2"),
        (["127.0.0.1"], {"X-Forwarded-For": "203.0.113.7"}, "127.0.0.2", "127.0.0.2"),  # the peer is not trusted
        # a trusted peer: right to left, trusted hops skipped, the first other one is the client
        (["127.0.0.0/8"], {"X-Forwarded-For": "203.0.113.7"}, "203.0.113.7", "203.0.113.7"),
        (["127.0.0.0/8"], {"X-Forwarded-For": "198.51.100.1, 203.0.113.7"}, "203.0.113.7", "203.0.113.7"),
        (["127.0.0.0/8", "10.0.0.0/8"], {"X-Forwarded-For": "198.51.100.1, 203.0.113.7, 10.1.2.3"}, "203.0.113.7",
         "203.0.113.7"),
        (["127.0.0.0/8"], {"X-Forwarded-For": "198.51.100.1, 203.0.113.7:4711"}, "203.0.113.7", "203.0.113.7"),
        # several header lines are one list, in order
        (["127.0.0.0/8"], [("X-Forwarded-For", "198.51.100.1"), ("X-Forwarded-For", "203.0.113.8")], "203.0.113.8",
         "203.0.113.8"),
        # RFC 7239 Forwarded when there is no X-Forwarded-For; IPv6 quoted with a port; clients grouped by /64
        (["127.0.0.0/8"], {"Forwarded": 'for=198.51.100.1;proto=https, for="[2001:db8:1:2::9]:4711"'},
         "2001:db8:1:2::9", "2001:db8:1:2::/64"),
        (["127.0.0.0/8"], {"Forwarded": "For=203.0.113.9;Proto=https"}, "203.0.113.9", "203.0.113.9"),
        # X-Forwarded-For wins over Forwarded (the shipped nginx files set both, to the same client)
        (["127.0.0.0/8"], {"X-Forwarded-For": "203.0.113.7", "Forwarded": "for=198.51.100.1"}, "203.0.113.7",
         "203.0.113.7"),
        # only trusted hops: the far end; no header: the proxy itself; an opaque token is a client of its own
        (["127.0.0.0/8", "10.0.0.0/8"], {"X-Forwarded-For": "10.0.0.9, 10.0.0.8"}, "10.0.0.9", "10.0.0.9"),
        (["127.0.0.0/8"], {}, "127.0.0.2", "127.0.0.2"),
        (["127.0.0.0/8"], {"Forwarded": "for=_hidden-1"}, "_hidden-1", "token:_hidden-1"),
    ],
)  # fmt: skip
async def test_the_client_behind_trusted_proxies(
    trusted: list[str], headers: dict[str, str] | list[tuple[str, str]], expected: str, key: str
) -> None:
    async with who_is_asking(trusted) as url, client_from(STRANGER) as client:
        answer = json.loads(await (await client.get(url, headers=headers)).text())
        assert answer == {"address": expected, "peer": "127.0.0.2", "key": key}


# -- guessing stays slow, the right token is never refused ---------------------------------------


async def test_slowed_guesses_are_checked_one_at_a_time_and_the_right_token_waits_only_its_turn(
    tmp_path: Path,
) -> None:
    async with (
        console(tmp_path) as con,
        client_from(STRANGER) as stranger_client,
        client_from(OPERATOR_DESK) as operator_client,
    ):
        holds = Holds(blocking=True)
        auth = con.server.auth
        assert auth is not None
        auth.throttle.pause = holds
        stranger = Door(stranger_client, con.base)
        for n in range(LOGIN_FAILURES):
            assert (await stranger.attempt(guess(n))).status == 401

        # ten guesses at once from the slowed address: one is checked and held, the rest wait their turn
        guesses = [asyncio.create_task(stranger.attempt(guess(100 + n))) for n in range(10)]
        await holds.until(lambda: len(holds.seen) == 1)
        async with asyncio.timeout(10):
            while auth.throttle.waiting(STRANGER) < 10:
                await asyncio.sleep(0.01)
        assert len(holds.seen) == 1  # nine are queued unchecked while the first is held

        # someone else, elsewhere: not queued behind them at all
        operator = Door(operator_client, con.base)
        assert (await operator.attempt(OPERATOR, name="alice")).status == 303

        # the right token from the slowed address joins the queue; released guess by guess, it is let in
        right = asyncio.create_task(Door(stranger_client, con.base).attempt(READER, name="rita"))
        async with asyncio.timeout(10):
            while auth.throttle.waiting(STRANGER) < 11:
                await asyncio.sleep(0.01)
        for _ in range(10):
            await holds.release_one()
        answers = await asyncio.gather(*guesses)
        assert [a.status for a in answers] == [429] * 10
        assert (await right).status == 303
        assert holds.seen == expected_holds(10)


def test_a_spray_from_many_addresses_slows_every_client() -> None:
    now = [1000.0]
    throttle = LoginThrottle(clock=lambda: now[0], team_failures=20)
    for n in range(20):
        assert throttle.failed(f"198.51.100.{n}") == 0.0  # one typo each, from twenty addresses
    assert throttle.slowed("203.0.113.1")  # a fresh address is slowed too: the team's bound is crossed
    assert throttle.failed("203.0.113.1") == FIRST_HOLD
    now[0] += 61  # a window later the spray is forgotten
    assert not throttle.slowed("203.0.113.1")


# -- what the doctor says ------------------------------------------------------------------------


def test_the_doctor_warns_when_an_https_console_does_not_name_its_proxy() -> None:
    from kazma.bot.cli.checks import Level
    from kazma.bot.cli.platform_checks import console_checks
    from kazma.config import load_config_text

    behind = load_config_text("web: {public_url: 'https://kazma.example.org'}", environ={})
    warned = [c.detail for c in console_checks(behind) if c.level is Level.WARN]
    assert any("web.trusted_proxies is empty" in line for line in warned), warned
    named = load_config_text(
        "web: {public_url: 'https://kazma.example.org', trusted_proxies: ['10.0.0.5']}", environ={}
    )
    assert not any("trusted_proxies" in c.detail for c in console_checks(named))
    local = load_config_text("web: {public_url: 'http://127.0.0.1:8765'}", environ={})
    assert not any("trusted_proxies" in c.detail for c in console_checks(local))


@pytest.mark.parametrize("url", ["http://10.0.0.5:8765", "http://127.0.0.1:8765", "https://[fd00::5]"])
def test_the_doctor_warns_when_the_public_url_is_an_address_passkeys_cannot_use(url: str) -> None:
    # The README: web.public_url must be a name, never an address, browsers refusing passkeys for one. `kazma init
    # --public-url http://10.0.0.5:8765` wrote it and said to sign in there with a passkey; doctor said all was well.
    from kazma.bot.cli.checks import Level
    from kazma.bot.cli.platform_checks import console_checks
    from kazma.config import load_config_text

    loaded = load_config_text(f"web: {{public_url: '{url}'}}", environ={})
    warned = [c.detail for c in console_checks(loaded) if c.level is Level.WARN]
    assert any(line.startswith("passkeys cannot work here: web.public_url names the address") for line in warned)
    named = load_config_text("web: {public_url: 'http://localhost:8765'}", environ={})
    assert not any("passkeys cannot work" in c.detail for c in console_checks(named))


# -- behind the shipped nginx ----------------------------------------------------------------------


async def test_behind_the_shipped_nginx_file_the_throttle_sees_each_client(tmp_path: Path) -> None:
    """deploy/nginx.conf itself, run by Debian's nginx in front of a real console, TLS and all. Changed in the
    copy run here: its certificate (one made now), where it listens (a free port on 127.0.0.1) and where it
    forwards the console (the test console's port)."""
    nginx = nginx_or_skip()
    cert, key = certificate(tmp_path)
    port = free_port()
    async with console(tmp_path, extra=TRUST_LOOPBACK_PROXY) as con:
        holds = Holds()
        assert con.server.auth is not None
        con.server.auth.throttle.pause = holds
        site = with_certificate(SINGLE.read_text(), cert, key)
        site = site.replace("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;")
        site = site.replace("proxy_pass http://127.0.0.1:8765;", f"proxy_pass {con.base};")
        assert site.count(con.base) == 2  # the console and its upload location
        async with (
            running(nginx, main_config(tmp_path / "nginx", site), port),
            tls_client_from(STRANGER) as stranger_client,
            tls_client_from(OPERATOR_DESK) as operator_client,
        ):
            front = f"https://127.0.0.1:{port}"
            stranger = Door(stranger_client, front)
            statuses = [(await stranger.attempt(guess(n))).status for n in range(20)]
            assert statuses == [401] * LOGIN_FAILURES + [429] * (20 - LOGIN_FAILURES)
            assert holds.seen == expected_holds(20 - LOGIN_FAILURES)

            operator = Door(operator_client, front)
            answer = await operator.attempt(OPERATOR, name="alice")
            assert (answer.status, answer.headers["Location"]) == (303, "/")
            # the operator's own typo is their own first wrong token: answered at once, nothing held
            assert (await Door(operator_client, front).attempt("typo-" + OPERATOR, name="alice")).status == 401
            assert len(holds.seen) == 20 - LOGIN_FAILURES
            # logged in through nginx, the session works there (Host, cookies and redirects pass)
            page = await operator_client.get(f"{front}/", allow_redirects=False)
            assert page.status == 200
            assert "web:alice (the shared operator token: reads only)" in await page.text()


def tls_client_from(address: str) -> aiohttp.ClientSession:
    """A client on ``address`` that accepts the test's self-signed certificate."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(local_addr=(address, 0), ssl=False), cookie_jar=aiohttp.CookieJar(unsafe=True)
    )
