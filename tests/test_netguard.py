"""http_get reaches public addresses only: the address policy, resolve-once-and-connect, redirects, proxies, TLS.

Nothing here leaves the machine. A "public" server is simulated with a second
loopback address (127.0.0.2) that a test lets through on purpose
(``also_allow``), while the "internal" victim listens on 127.0.0.1 at the same
port: whatever reaches the victim is a request that should never have been
made, and each server logs every request it receives.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kazma.engine.tools.http_get import HttpGetTool
from kazma.engine.tools.netguard import (
    AddressPolicy,
    AddressRefused,
    IPAddress,
    embedded_ipv4,
    host_networks,
    is_public_address,
    resolve_checked,
    system_resolver,
)
from kazma.engine.tools.registry import ToolRegistry, ToolResult
from kazma.engine.tools.workspace import ToolContext

# --------------------------------------------------------------------------- the address policy

PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "2606:4700:4700::1111",
    "2a00:1450:4001:81b::200e",
    "::ffff:8.8.8.8",  # IPv4-mapped form of a public address
    "2002:808:808::1",  # 6to4 of 8.8.8.8
    "64:ff9b::808:808",  # well-known NAT64 of 8.8.8.8
]

NOT_PUBLIC = [
    # IPv4
    "127.0.0.1",
    "127.255.255.254",
    "10.1.2.3",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.1.1",
    "100.64.1.1",  # carrier-grade NAT
    "100.127.255.254",
    "169.254.169.254",  # cloud metadata
    "0.0.0.0",  # noqa: S104 (the unspecified address, as data)
    "0.1.2.3",
    "255.255.255.255",
    "224.0.0.1",  # multicast
    "239.255.255.250",
    "240.0.0.1",
    "192.0.0.8",
    "192.0.2.1",
    "198.18.0.1",
    "198.51.100.7",
    "203.0.113.9",
    "192.88.99.1",
    # IPv6 by itself
    "::",
    "::1",
    "fe80::1",
    "fc00::1",
    "fd12:3456::1",
    "fec0::1",
    "ff02::1",
    "ff0e::1",  # global-scope multicast is still multicast
    "100::1",
    "2001:db8::1",
    "3fff::1",
    # IPv6 forms carrying a private IPv4
    "::ffff:127.0.0.1",
    "::ffff:10.1.2.3",
    "::ffff:169.254.169.254",
    "::ffff:100.64.1.1",
    "::127.0.0.1",  # IPv4-compatible
    "::10.1.2.3",
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a01:203::1",  # 6to4 of 10.1.2.3
    "2002:a9fe:a9fe::",  # 6to4 of 169.254.169.254
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a01:203",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::7f00:1",  # local-use NAT64
    "64:ff9b:1::808:808",  # local-use NAT64 is a translator inside some network, whatever it embeds
    "2001:0:a01:203::1",  # Teredo with a private server
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "::ffff:0:7f00:1",  # IPv4-translated 127.0.0.1 (RFC 2765): Python's is_global says True
    "::ffff:0:808:808",  # IPv4-translated, whatever it carries: reserved space, not global unicast
    "1::1",  # unassigned (outside 2000::/3)
    "4000::1",  # unassigned
    "e000::1",  # unassigned
]


@pytest.mark.parametrize("text", PUBLIC)
def test_public_addresses_are_allowed(text: str) -> None:
    assert is_public_address(ipaddress.ip_address(text))


@pytest.mark.parametrize("text", NOT_PUBLIC)
def test_addresses_inside_some_network_are_refused(text: str) -> None:
    assert not is_public_address(ipaddress.ip_address(text))


@pytest.mark.parametrize(
    ("text", "inside"),
    [
        ("::ffff:127.0.0.1", ["127.0.0.1"]),
        ("::10.1.2.3", ["10.1.2.3"]),
        ("2002:7f00:1::1", ["127.0.0.1"]),
        ("64:ff9b::a01:203", ["10.1.2.3"]),
        ("64:ff9b:1::a01:203", ["10.1.2.3"]),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", ["65.54.227.120", "192.0.2.45"]),
        ("2606:4700:4700::1111", []),
    ],
)
def test_embedded_ipv4(text: str, inside: list[str]) -> None:
    address = ipaddress.ip_address(text)
    assert isinstance(address, ipaddress.IPv6Address)
    assert [str(found) for found in embedded_ipv4(address)] == inside


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_ipv6_forms_are_never_more_public_than_the_ipv4_inside(value: int) -> None:
    v4 = ipaddress.IPv4Address(value)
    mapped = ipaddress.IPv6Address(0xFFFF_0000_0000 | value)
    assert is_public_address(mapped) == is_public_address(v4)
    if not is_public_address(v4):
        for form in (
            ipaddress.IPv6Address(value),  # IPv4-compatible
            ipaddress.IPv6Address((0x2002 << 112) | (value << 80) | 1),  # 6to4
            ipaddress.IPv6Address((0x64FF9B << 96) | value),  # NAT64
        ):
            assert not is_public_address(form), form


def test_policy_widenings() -> None:
    loopback = ipaddress.ip_address("127.0.0.1")
    assert not AddressPolicy().allows(loopback)
    assert AddressPolicy.of(allow_private=True).allows(loopback)
    only_two = AddressPolicy.of(also_allow=["127.0.0.2/32"])
    assert only_two.allows(ipaddress.ip_address("127.0.0.2"))
    assert not only_two.allows(loopback)
    assert not only_two.allows(ipaddress.ip_address("::1"))  # another IP version is not "in" the network
    assert only_two.allows(ipaddress.ip_address("8.8.8.8"))


# --------------------------------------------------------------------------- resolve once, check all


@dataclass
class ScriptedResolver:
    """Answers each host from a script of successive answers (the last repeats) and records every question."""

    script: dict[str, list[list[str]]]
    asked: list[str] = field(default_factory=list)

    async def __call__(self, host: str) -> Sequence[str]:
        self.asked.append(host)
        answers = self.script.get(host)
        if answers is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        turn = sum(1 for asked in self.asked if asked == host) - 1
        return answers[min(turn, len(answers) - 1)]


async def test_resolve_checked_refuses_if_any_answer_is_private() -> None:
    resolver = ScriptedResolver({"mixed.test": [["8.8.8.8", "10.0.0.1"]]})
    with pytest.raises(AddressRefused, match=r"mixed\.test is 10\.0\.0\.1, an address inside"):
        await resolve_checked("mixed.test", resolver=resolver, policy=AddressPolicy())


async def test_resolve_checked_returns_every_checked_address_once() -> None:
    resolver = ScriptedResolver({"two.test": [["8.8.8.8", "2606:4700:4700::1111", "8.8.8.8"]]})
    found = await resolve_checked("two.test", resolver=resolver, policy=AddressPolicy())
    assert [str(address) for address in found] == ["8.8.8.8", "2606:4700:4700::1111"]
    assert resolver.asked == ["two.test"]


async def test_resolve_checked_does_not_resolve_literals() -> None:
    resolver = ScriptedResolver({})
    found = await resolve_checked("8.8.8.8", resolver=resolver, policy=AddressPolicy())
    assert [str(address) for address in found] == ["8.8.8.8"]
    with pytest.raises(AddressRefused, match=r"refused to contact ::1: ::1 is an address inside"):
        await resolve_checked("::1", resolver=resolver, policy=AddressPolicy())
    assert resolver.asked == []


async def test_resolve_checked_refuses_what_does_not_resolve() -> None:
    resolver = ScriptedResolver({"empty.test": [[]], "odd.test": [["not-an-address"]]})
    with pytest.raises(AddressRefused, match=r"^could not resolve nowhere\.test: .*not known"):
        await resolve_checked("nowhere.test", resolver=resolver, policy=AddressPolicy(allow_private=True))
    with pytest.raises(AddressRefused, match=r"^could not resolve empty\.test: the resolver returned no addresses"):
        await resolve_checked("empty.test", resolver=resolver, policy=AddressPolicy(allow_private=True))
    with pytest.raises(AddressRefused, match=r"^could not resolve odd\.test: .*not an IP address"):
        await resolve_checked("odd.test", resolver=resolver, policy=AddressPolicy(allow_private=True))


async def test_system_resolver_answers_numeric_hosts_without_a_lookup() -> None:
    assert await system_resolver("127.0.0.1") == ["127.0.0.1"]


# --------------------------------------------------------------------------- http_get against local servers


@dataclass(frozen=True)
class Seen:
    """One request a test server received: on which local address, for which path, with which Host header."""

    address: str
    path: str
    host: str


@dataclass
class Servers:
    """The same app listening on 127.0.0.1 (the internal victim) and 127.0.0.2 (the stand-in public host)."""

    port: int
    log: list[Seen]

    def seen_at(self, address: str) -> list[Seen]:
        return [seen for seen in self.log if seen.address == address]


def _app(log: list[Seen]) -> web.Application:
    async def record(request: web.Request) -> None:
        assert request.transport is not None
        log.append(Seen(request.transport.get_extra_info("sockname")[0], request.path, request.headers["Host"]))

    async def text(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(text="hello from the server", content_type="text/plain")

    async def redirect(request: web.Request) -> web.Response:
        await record(request)
        raise web.HTTPFound(request.query["to"])

    app = web.Application()
    app.router.add_get("/text", text)
    app.router.add_get("/redirect", redirect)
    return app


async def _start_pair(runner: web.AppRunner) -> int:
    """Listen on 127.0.0.1 and 127.0.0.2 at one port (a few tries, in case another test took it)."""
    for _ in range(20):
        first = web.TCPSite(runner, "127.0.0.1", 0)
        await first.start()
        port = int(runner.addresses[-1][1])
        try:
            await web.TCPSite(runner, "127.0.0.2", port).start()
        except OSError:
            await first.stop()
            continue
        return port
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    log: list[Seen] = []
    runner = web.AppRunner(_app(log))
    await runner.setup()
    try:
        yield Servers(port=await _start_pair(runner), log=log)
    finally:
        await runner.cleanup()


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(workspace=tmp_path / "ws", conversation="conv-1")


def _tool(resolver: ScriptedResolver, *, max_redirects: int = 5) -> ToolRegistry:
    # 127.0.0.2 plays the public internet; 127.0.0.1 stays refused.
    return ToolRegistry([HttpGetTool(resolver=resolver, also_allow=["127.0.0.2/32"], max_redirects=max_redirects)])


async def _get(registry: ToolRegistry, ctx: ToolContext, url: str) -> ToolResult:
    return await registry.execute("http_get", {"url": url}, ctx)


async def test_connects_to_the_address_it_checked(servers: Servers, ctx: ToolContext) -> None:
    # DNS rebinding: public to the first question, 127.0.0.1 to any later one.
    resolver = ScriptedResolver({"rebind.test": [["127.0.0.2"], ["127.0.0.1"]]})
    result = await _get(_tool(resolver), ctx, f"http://rebind.test:{servers.port}/text")
    assert result.ok, result
    assert result.output.endswith("hello from the server")
    assert resolver.asked == ["rebind.test"]
    assert servers.log == [Seen("127.0.0.2", "/text", f"rebind.test:{servers.port}")]


async def test_rebinding_between_redirect_hops_is_refused(servers: Servers, ctx: ToolContext) -> None:
    resolver = ScriptedResolver({"rebind.test": [["127.0.0.2"], ["127.0.0.1"]]})
    url = f"http://rebind.test:{servers.port}/redirect?to=/text"
    result = await _get(_tool(resolver), ctx, url)
    assert not result.ok
    assert result.error == (
        "refused to contact rebind.test: rebind.test is 127.0.0.1, an address inside this machine or its network "
        "(http_get reaches public addresses only)"
    )
    assert resolver.asked == ["rebind.test", "rebind.test"]  # once per hop
    assert servers.seen_at("127.0.0.1") == []
    assert [seen.path for seen in servers.seen_at("127.0.0.2")] == ["/redirect"]


@pytest.mark.parametrize(
    "target",
    [
        "http://internal.test:{port}/text",  # a name that resolves privately
        "http://127.0.0.1:{port}/text",  # a literal
        "http://[::ffff:127.0.0.1]:{port}/text",  # a literal in IPv6 clothing
    ],
)
async def test_redirects_into_the_network_are_refused(servers: Servers, ctx: ToolContext, target: str) -> None:
    resolver = ScriptedResolver({"public.test": [["127.0.0.2"]], "internal.test": [["127.0.0.1"]]})
    to = target.format(port=servers.port)
    result = await _get(_tool(resolver), ctx, f"http://public.test:{servers.port}/redirect?to={to}")
    assert not result.ok
    assert result.error is not None
    assert "an address inside this machine or its network" in result.error
    assert servers.seen_at("127.0.0.1") == []
    assert [seen.path for seen in servers.log] == ["/redirect"]


@pytest.mark.parametrize("target", ["file:///etc/passwd", "ftp://127.0.0.2/x", "gopher://127.0.0.2:70/"])
async def test_redirects_to_other_schemes_are_refused(servers: Servers, ctx: ToolContext, target: str) -> None:
    resolver = ScriptedResolver({"public.test": [["127.0.0.2"]]})
    result = await _get(_tool(resolver), ctx, f"http://public.test:{servers.port}/redirect?to={target}")
    assert not result.ok
    assert result.error is not None
    assert result.error.startswith(f"refused to follow a redirect from http://public.test:{servers.port}/redirect")
    assert result.error.endswith("only http:// and https:// URLs are fetched")


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("http://xn--/", "its Location names no valid host"),  # a malformed A-label: httpx raises decoding it
        ("http://a..b/", "could not resolve a..b: it is not a valid host name"),  # the idna codec refuses the label
        (f"http://{'a' * 64}.example/", "it is not a valid host name"),  # a label over 63 characters
    ],
)
async def test_a_malformed_host_name_is_refused_in_words_not_as_a_crash(
    servers: Servers, ctx: ToolContext, target: str, said: str
) -> None:
    # Any server's redirect (or a model) chooses the name; the system resolver meets it, as in production.
    registry = ToolRegistry([HttpGetTool(also_allow=["127.0.0.2/32"])])
    with capture_logs() as logs:
        result = await _get(registry, ctx, f"http://127.0.0.2:{servers.port}/redirect?to={target}")
    assert not result.ok
    assert result.error is not None
    assert said in result.error
    assert "unexpectedly" not in result.error
    assert [entry for entry in logs if entry["event"] == "tool.crashed"] == []
    assert [seen.path for seen in servers.log] == ["/redirect"]


async def test_a_malformed_international_name_asked_for_is_refused_in_words(ctx: ToolContext) -> None:
    with capture_logs() as logs:
        result = await _get(_tool(ScriptedResolver({})), ctx, "http://xn--/")
    assert result.error is not None
    assert result.error.startswith("could not resolve xn--: ")
    assert [entry for entry in logs if entry["event"] == "tool.crashed"] == []


async def test_redirects_are_bounded(servers: Servers, ctx: ToolContext) -> None:
    resolver = ScriptedResolver({"public.test": [["127.0.0.2"]]})
    loop = f"http://public.test:{servers.port}/redirect?to=/redirect%3Fto%3D/text"
    # Two hops to reach /text; one redirect allowed.
    result = await _get(_tool(resolver, max_redirects=1), ctx, loop)
    assert not result.ok
    assert result.error == f"more than 1 redirects fetching {loop}"
    assert [seen.path for seen in servers.log] == ["/redirect", "/redirect"]
    followed = await _get(_tool(resolver, max_redirects=2), ctx, loop)
    assert followed.ok, followed
    assert f"url: http://public.test:{servers.port}/text" in followed.output


async def test_a_name_with_any_private_address_is_refused_whole(servers: Servers, ctx: ToolContext) -> None:
    resolver = ScriptedResolver({"mixed.test": [["127.0.0.2", "127.0.0.1"]]})
    result = await _get(_tool(resolver), ctx, f"http://mixed.test:{servers.port}/text")
    assert not result.ok
    assert result.error is not None
    assert "mixed.test is 127.0.0.1" in result.error
    assert servers.log == []


@pytest.mark.parametrize(
    "answer",
    [
        "100.64.1.1",
        "169.254.169.254",
        "::ffff:127.0.0.1",
        "::ffff:10.1.2.3",
        "2002:7f00:1::1",
        "2002:a01:203::1",
        "64:ff9b::7f00:1",
        "64:ff9b::a01:203",
    ],
)
async def test_private_answers_are_refused_before_connecting(ctx: ToolContext, answer: str) -> None:
    resolver = ScriptedResolver({"sneaky.test": [[answer]]})
    result = await _get(_tool(resolver), ctx, "http://sneaky.test/latest/meta-data/")
    assert not result.ok
    shown = ipaddress.ip_address(answer)  # Python 3.11 writes ::ffff:10.1.2.3 as ::ffff:a01:203
    assert result.error == (
        f"refused to contact sneaky.test: sneaky.test is {shown}, an address inside this machine or its network "
        "(http_get reaches public addresses only)"
    )


async def test_a_name_that_does_not_resolve_is_refused(ctx: ToolContext) -> None:
    resolver = ScriptedResolver({"empty.test": [[]]})
    registry = ToolRegistry([HttpGetTool(resolver=resolver, allow_private=True)])
    missing = await _get(registry, ctx, "http://nowhere.test/")
    assert not missing.ok
    assert missing.error == "could not resolve nowhere.test: [Errno -2] Name or service not known"
    empty = await _get(registry, ctx, "http://empty.test/")
    assert empty.error == "could not resolve empty.test: the resolver returned no addresses"


async def test_allow_private_still_resolves_once_and_keeps_the_name(servers: Servers, ctx: ToolContext) -> None:
    resolver = ScriptedResolver({"name.test": [["127.0.0.1"], ["127.0.0.2"]]})
    registry = ToolRegistry([HttpGetTool(resolver=resolver, allow_private=True)])
    result = await _get(registry, ctx, f"http://name.test:{servers.port}/text")
    assert result.ok, result
    assert resolver.asked == ["name.test"]
    assert servers.log == [Seen("127.0.0.1", "/text", f"name.test:{servers.port}")]


async def test_international_names_are_resolved_and_sent_in_their_ascii_form(
    servers: Servers, ctx: ToolContext
) -> None:
    resolver = ScriptedResolver({"xn--bcher-kva.test": [["127.0.0.2"]]})
    result = await _get(_tool(resolver), ctx, f"http://bücher.test:{servers.port}/text")
    assert result.ok, result
    assert resolver.asked == ["xn--bcher-kva.test"]
    assert servers.log == [Seen("127.0.0.2", "/text", f"xn--bcher-kva.test:{servers.port}")]


async def test_the_next_checked_address_is_tried_when_one_refuses(servers: Servers, ctx: ToolContext) -> None:
    # Nothing listens on 127.0.0.3, so its connection is refused at once.
    resolver = ScriptedResolver({"name.test": [["127.0.0.3", "127.0.0.1"]]})
    registry = ToolRegistry([HttpGetTool(resolver=resolver, allow_private=True)])
    result = await _get(registry, ctx, f"http://name.test:{servers.port}/text")
    assert result.ok, result
    assert servers.log == [Seen("127.0.0.1", "/text", f"name.test:{servers.port}")]


# --------------------------------------------------------------------------- proxies from the environment

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[str]]:
    """A listener every proxy variable points at; it records each connection it gets."""
    connections: list[str] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(str(writer.get_extra_info("peername")))
        writer.close()

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, f"http://127.0.0.1:{port}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield connections
    finally:
        listener.close()
        await listener.wait_closed()


async def test_proxy_variables_are_ignored(servers: Servers, proxy: list[str], ctx: ToolContext) -> None:
    registry = ToolRegistry([HttpGetTool(allow_private=True)])
    result = await _get(registry, ctx, f"http://127.0.0.1:{servers.port}/text")
    assert result.ok, result
    assert servers.log == [Seen("127.0.0.1", "/text", f"127.0.0.1:{servers.port}")]
    assert proxy == []


async def test_a_proxy_variable_does_not_carry_a_refused_address(
    servers: Servers, proxy: list[str], ctx: ToolContext
) -> None:
    # A proxy would fetch 127.0.0.1 on the tool's behalf: the address is refused, and the proxy never asked.
    registry = ToolRegistry([HttpGetTool()])
    for url in (f"http://127.0.0.1:{servers.port}/text", f"http://localhost:{servers.port}/text"):
        result = await _get(registry, ctx, url)
        assert not result.ok
        assert result.error is not None
        assert "an address inside this machine or its network" in result.error
    public = await _get(
        _tool(ScriptedResolver({"public.test": [["127.0.0.2"]]})), ctx, f"http://public.test:{servers.port}/text"
    )
    assert public.ok, public  # and a public address is fetched directly
    assert servers.log == [Seen("127.0.0.2", "/text", f"public.test:{servers.port}")]
    assert proxy == []


# --------------------------------------------------------------------------- TLS to a name, connected by address


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path: Path) -> Certificates:
    """A throwaway CA and a certificate for ``secure.test`` only (no IP address in it)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path / "pki"
    d.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_extensions = ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=Kazma test CA",
             *ca_extensions, cwd=d)  # fmt: skip
    _openssl("req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=secure.test", cwd=d)
    (d / "leaf.ext").write_text(
        "subjectAltName=DNS:secure.test\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "leaf.pem", "-days", "2", "-extfile", "leaf.ext", cwd=d)  # fmt: skip
    return Certificates(ca=d / "ca.pem", cert=d / "leaf.pem", key=d / "leaf.key")


@dataclass
class TlsServer:
    port: int
    server_names: list[str | None]
    hosts: list[str]


@pytest.fixture
async def tls_server(certificates: Certificates) -> AsyncIterator[TlsServer]:
    server_names: list[str | None] = []
    hosts: list[str] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificates.cert, certificates.key)

    def on_sni(connection: ssl.SSLObject, name: str | None, context: ssl.SSLContext) -> None:
        server_names.append(name)

    context.sni_callback = on_sni

    async def text(request: web.Request) -> web.Response:
        hosts.append(request.headers["Host"])
        return web.Response(text="secret-free hello", content_type="text/plain")

    app = web.Application()
    app.router.add_get("/", text)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    try:
        yield TlsServer(port=int(runner.addresses[0][1]), server_names=server_names, hosts=hosts)
    finally:
        await runner.cleanup()


def _trusting(certificates: Certificates) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certificates.ca))


async def test_tls_uses_the_name_while_connecting_to_the_checked_address(
    tls_server: TlsServer, certificates: Certificates, proxy: list[str], ctx: ToolContext
) -> None:
    resolver = ScriptedResolver({"secure.test": [["127.0.0.1"]]})
    tool = HttpGetTool(resolver=resolver, allow_private=True, ssl_context=_trusting(certificates))
    result = await _get(ToolRegistry([tool]), ctx, f"https://secure.test:{tls_server.port}/")
    assert result.ok, result
    assert result.output.endswith("secret-free hello")
    assert tls_server.server_names == ["secure.test"]  # SNI
    assert tls_server.hosts == [f"secure.test:{tls_server.port}"]
    assert resolver.asked == ["secure.test"]
    assert proxy == []  # HTTPS_PROXY and ALL_PROXY are set, and ignored


async def test_tls_certificate_is_checked_against_the_name(
    tls_server: TlsServer, certificates: Certificates, ctx: ToolContext
) -> None:
    resolver = ScriptedResolver({"other.test": [["127.0.0.1"]]})
    tool = HttpGetTool(resolver=resolver, allow_private=True, ssl_context=_trusting(certificates))
    result = await _get(ToolRegistry([tool]), ctx, f"https://other.test:{tls_server.port}/")
    assert not result.ok
    assert result.error is not None
    assert result.error.startswith("could not connect to other.test: 127.0.0.1:")
    assert "CERTIFICATE_VERIFY_FAILED" in result.error
    assert "other.test" in result.error  # the name the certificate was checked against
    assert tls_server.server_names == ["other.test"]
    assert tls_server.hosts == []


# --------------------------------------------------------------------------- this host's own addresses


def _interface_addresses() -> list[IPAddress]:
    """Every address of this host's interfaces as iproute2 lists them (a second source, apart from /proc)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip is not installed here")
    listing = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout
    return [ipaddress.ip_address(a["local"]) for link in json.loads(listing) for a in link.get("addr_info", [])]


def _bindable(address: IPAddress) -> bool:
    """The kernel's own word: a socket binds only to an address this host holds."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def test_host_networks_hold_every_address_of_this_hosts_interfaces() -> None:
    own = host_networks()
    for address in _interface_addresses():
        held = any(address in network for network in own)
        assert held != address.is_loopback, (address, own)  # loopback is left to the address policy
    for network in own:
        first = network.network_address
        if network.num_addresses == 1 and not first.is_link_local:  # link-local needs a scope to bind
            assert _bindable(first), network
    assert not any(ipaddress.ip_address("8.8.8.8") in network for network in own)


def test_the_policy_refuses_this_hosts_own_address_in_every_form() -> None:
    """As if this host were 8.8.8.8 and 2606:4700:4700::1111: public, and its own."""
    own = (ipaddress.ip_network("8.8.8.8/32"), ipaddress.ip_network("2606:4700:4700::1111/128"))
    policy = AddressPolicy(host=lambda: own)
    for text in ("8.8.8.8", "::ffff:8.8.8.8", "2002:808:808::1", "64:ff9b::808:808", "2606:4700:4700::1111"):
        assert not policy.allows(ipaddress.ip_address(text)), text
        assert policy.is_own(ipaddress.ip_address(text)), text
    for text in ("8.8.4.4", "1.1.1.1", "2606:4700:4700::1001"):
        assert policy.allows(ipaddress.ip_address(text)), text
    widened = AddressPolicy(also_allow=(ipaddress.ip_network("8.8.8.0/24"),), host=lambda: own)
    assert not widened.allows(ipaddress.ip_address("8.8.8.8"))  # a widening never reaches the host itself
    assert AddressPolicy(allow_private=True, host=lambda: own).allows(ipaddress.ip_address("8.8.8.8"))


async def test_http_get_cannot_reach_a_service_on_this_hosts_own_address(ctx: ToolContext) -> None:
    """A server listening on this machine's non-loopback address, which a widening lets through as if it were
    public: the request must never arrive."""
    candidates = [
        network.network_address
        for network in host_networks()
        if network.num_addresses == 1 and network.version == 4 and _bindable(network.network_address)
    ]
    if not candidates:
        pytest.skip("this host has no non-loopback IPv4 address to listen on")
    own = str(candidates[0])
    log: list[Seen] = []
    runner = web.AppRunner(_app(log))
    await runner.setup()
    try:
        site = web.TCPSite(runner, own, 0)
        await site.start()
        port = int(runner.addresses[-1][1])
        resolver = ScriptedResolver({"myself.test": [[own]]})
        registry = ToolRegistry([HttpGetTool(resolver=resolver, also_allow=[f"{own}/32"])])
        result = await _get(registry, ctx, f"http://myself.test:{port}/text")
        literal = await _get(registry, ctx, f"http://{own}:{port}/text")
    finally:
        await runner.cleanup()
    assert not result.ok
    assert f"myself.test is {own}, an address of this machine itself" in (result.error or ""), result.error
    assert not literal.ok
    assert log == []
