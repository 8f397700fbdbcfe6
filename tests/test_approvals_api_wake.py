"""Long-polls of one request woken by its decision: the first to run writes every parked one's answer at once.

Attacked over raw HTTP/1.1 connections to the real web server: an answer written twice or not at all (the
connection's next request then reads the wrong answer), an answer that differs from what aiohttp writes for
the same request (a header hook skipped), a connection left unusable after it, a client that went away while
parked, and the clients this path must leave to aiohttp (HTTP/1.0, ``Connection: close``, ``HEAD``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client import REGISTRY

from kazma.approvals.model import Status
from tests.api_support import REQUESTER_TOKEN, Door, kazma_door

DEPLOY = {"tool": "deploy", "arguments": {"env": "prod"}}
BATCHED = "kazma_api_long_polls_batched_total"


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


class Raw:
    """One client connection, written and read by hand: every byte Kazma sends on it is read here."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, door: Door) -> Raw:
        url = httpx.URL(door.url)
        assert url.port is not None
        reader, writer = await asyncio.open_connection(url.host, url.port)
        return cls(reader, writer, f"{url.host}:{url.port}")

    def ask(self, path: str, *, method: str = "GET", version: str = "1.1", extra: str = "") -> None:
        self.writer.write(
            f"{method} {path} HTTP/{version}\r\nHost: {self.host}\r\nAuthorization: Bearer {REQUESTER_TOKEN}\r\n"
            f"{extra}\r\n".encode()
        )

    async def answer(self, *, head_only: bool = False) -> tuple[str, dict[str, str], bytes]:
        """The next response on the connection: status line, headers (lower-case names), body."""
        async with asyncio.timeout(20):
            head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status, *lines = head[:-4].split("\r\n")
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                assert name.lower() not in headers, f"{name} twice in one answer"
                headers[name.lower()] = value.strip()
            length = 0 if head_only else int(headers["content-length"])
            return status, headers, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def _batched() -> float:
    return REGISTRY.get_sample_value(BATCHED) or 0.0


def _asleep(door: Door, request_id: str, count: int) -> Callable[[], bool]:
    def check() -> bool:
        watch = door.app.service._waiters.watches.get(request_id)
        return watch is not None and watch.waiters == count and len(watch.event._waiters) == count

    return check


def _same(headers: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name != "date"}


async def test_woken_long_polls_get_what_aiohttp_writes_once_each_and_keep_their_connections(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        async with httpx.AsyncClient(base_url=door.url, headers=door.auth(), trust_env=False) as http:
            opened = await http.post("/api/v1/approvals", json=DEPLOY)
        request_id = opened.json()["id"]
        poll = f"/api/v1/approvals/{request_id}?wait=30"
        kept = [await Raw.open(door) for _ in range(12)]
        gone = [await Raw.open(door) for _ in range(2)]
        old, closing, head = await Raw.open(door), await Raw.open(door), await Raw.open(door)
        for raw in [*kept, *gone]:
            raw.ask(poll)
        old.ask(poll, version="1.0")
        closing.ask(poll, extra="Connection: close\r\n")
        head.ask(poll, method="HEAD")
        await _until(_asleep(door, request_id, 17))
        for raw in gone:  # their clients go while parked (their handlers wait on): the others are still answered
            raw.close()
        before = _batched()

        await door.press("a")

        answers = [await raw.answer() for raw in kept]
        head_answer = await head.answer(head_only=True)
        old_answer, closing_answer = await old.answer(), await closing.answer()
        reference = await Raw.open(door)  # the same request asked after its decision: aiohttp's own answer
        reference.ask(f"/api/v1/approvals/{request_id}")
        status, headers, body = await reference.answer()
        assert status == "HTTP/1.1 200 OK"
        assert json.loads(body)["status"] == Status.APPROVED.value
        for answer in [*answers, head_answer]:
            assert answer[0] == status
            assert _same(answer[1]) == _same(headers)  # security headers, type, length, server: all of them
        assert {answer[2] for answer in answers} == {body}
        assert head_answer[2] == b""
        assert (old_answer[0], old_answer[2]) == ("HTTP/1.0 200 OK", body)  # its own version, from aiohttp
        assert (closing_answer[1]["connection"], closing_answer[2]) == ("close", body)
        # The kept-alive polls but one were answered by the first one to run, in its one step (and the two gone
        # ones too, unless the server had seen them close by then).
        assert 11 <= _batched() - before <= 13
        # Each connection's next request reads its own answer: nothing was written twice, nothing is missing.
        for raw in [*kept, head]:
            raw.ask("/api/v1/openapi.json")
        for raw in [*kept, head]:
            _, _, document = await raw.answer()
            assert json.loads(document)["openapi"].startswith("3.")
        for raw in [*kept, old, closing, head, reference]:
            raw.close()
