"""PTB's calls over Kazma's aiohttp transport (adapters/telegram/transport.py): the same forms PTB's httpx transport
sends (URL-encoded fields, multipart with files), a proxy from the environment honoured (NO_PROXY too), and the
same errors (TimedOut, NetworkError) for what fails."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import BodyPartReader, web
from telegram import InputFile
from telegram.error import NetworkError, TelegramError, TimedOut
from telegram.request import RequestData
from telegram.request._requestparameter import RequestParameter

from kazma.adapters.telegram.transport import AiohttpRequest
from tests.forwarding_proxy import ForwardingProxy

# A host that resolves nowhere: reached only through the proxy.
UNREACHABLE = "http://telegram.invalid:81"


@dataclass
class BotApi:
    base: str = ""
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (path, content type, fields)
    files: list[tuple[str, str, bytes]] = field(default_factory=list)  # (field, filename, content)
    hold: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def bot_api() -> AsyncIterator[BotApi]:
    api = BotApi()

    async def answer(request: web.Request) -> web.Response:
        if request.path.endswith("/hang"):
            await asyncio.wait_for(api.hold.wait(), 30)
        if request.path.endswith("/moved"):
            api.seen.append((request.path, request.content_type, {}))
            raise web.HTTPTemporaryRedirect(request.path.replace("/moved", "/elsewhere"))
        fields: dict[str, str] = {}
        if request.content_type == "multipart/form-data":
            reader = await request.multipart()
            async for part in reader:
                assert isinstance(part, BodyPartReader)
                if part.filename:
                    api.files.append((str(part.name), part.filename, bytes(await part.read())))
                else:
                    fields[str(part.name)] = await part.text()
        else:
            fields = {k: str(v) for k, v in (await request.post()).items()}
        api.seen.append((request.path, request.content_type, fields))
        return web.json_response({"ok": True, "result": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    api.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield api
    finally:
        api.hold.set()
        await runner.cleanup()


def _request(api_url: str, *, read: float = 5.0) -> AiohttpRequest:
    return AiohttpRequest(
        connection_pool_size=4, connect_timeout=2.0, read_timeout=read, write_timeout=2.0, pool_timeout=2.0,
        tls=ssl.create_default_context(), api_url=api_url,
    )  # fmt: skip


def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "no_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


async def test_fields_and_files_arrive_as_ptb_sends_them(bot_api: BotApi, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    request = _request(bot_api.base)
    await request.initialize()
    try:
        plain = RequestData(
            [RequestParameter.from_input("chat_id", -100), RequestParameter.from_input("text", "é&=<b>")]
        )
        assert await request.post(f"{bot_api.base}/botT/sendMessage", plain) is True
        document = RequestData(
            [
                RequestParameter.from_input("chat_id", 7),
                RequestParameter.from_input("document", InputFile(b"\x00bytes\xff", filename="a b.txt")),
            ]
        )
        assert await request.post(f"{bot_api.base}/botT/sendDocument", document) is True
    finally:
        await request.shutdown()
    (path, kind, fields), (path2, kind2, fields2) = bot_api.seen
    assert (path, kind, fields) == ("/botT/sendMessage", "application/x-www-form-urlencoded", plain.json_parameters)
    assert (path2, kind2) == ("/botT/sendDocument", "multipart/form-data")
    assert fields2 == {"chat_id": "7"}
    assert bot_api.files == [("document", "a b.txt", b"\x00bytes\xff")]


async def test_a_proxy_from_the_environment_is_used_and_no_proxy_goes_around_it(
    bot_api: BotApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_proxies(monkeypatch)
    async with ForwardingProxy(bot_api.base) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.base)
        request = _request(UNREACHABLE)
        await request.initialize()
        try:
            assert await request.post(f"{UNREACHABLE}/botT/getMe", None) is True
        finally:
            await request.shutdown()
        assert [seen[0] for seen in bot_api.seen] == ["/botT/getMe"]  # through the proxy to the API
        monkeypatch.setenv("NO_PROXY", "telegram.invalid")
        direct = _request(UNREACHABLE)
        await direct.initialize()
        try:
            with pytest.raises(NetworkError, match="aiohttp"):
                await direct.post(f"{UNREACHABLE}/botT/getMe", None)
        finally:
            await direct.shutdown()
        assert len(bot_api.seen) == 1


async def test_a_socks_proxy_is_refused_not_gone_around(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(RuntimeError, match="only an HTTP proxy"):
        await _request(UNREACHABLE).initialize()


async def test_an_answer_that_does_not_come_is_timed_out(bot_api: BotApi, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    request = _request(bot_api.base, read=0.2)
    await request.initialize()
    try:
        with pytest.raises(TimedOut):
            await request.post(f"{bot_api.base}/botT/hang", None)
        with pytest.raises(TimedOut):  # PTB's per-call bound wins over the default
            await _request_with(request, f"{bot_api.base}/botT/hang")
    finally:
        await request.shutdown()
    assert bot_api.seen == []


async def _request_with(request: AiohttpRequest, url: str) -> object:
    return await request.post(url, None, read_timeout=0.1)


async def test_a_redirect_is_not_followed(bot_api: BotApi, monkeypatch: pytest.MonkeyPatch) -> None:
    # As under PTB's httpx transport: the call and its fields go to the Bot API's address and nowhere else.
    _no_proxies(monkeypatch)
    request = _request(bot_api.base)
    await request.initialize()
    try:
        with pytest.raises(TelegramError):
            await request.post(f"{bot_api.base}/botT/moved", RequestData([RequestParameter.from_input("text", "x")]))
    finally:
        await request.shutdown()
    assert [seen[0] for seen in bot_api.seen] == ["/botT/moved"]
