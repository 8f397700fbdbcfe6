"""http_get runs without approval, so a body must never cost more than its cap, whatever its encoding says.

httpx decodes a response's whole stack of content-encodings chunk by chunk, before the caller sees a byte: a few
hundred bytes sent as ``gzip, gzip`` became hundreds of MiB in memory before the 1 MiB cap was checked. The tool now
asks for gzip or deflate only, decodes one layer itself never past the cap, and refuses anything else.

The server is aiohttp on 127.0.0.2 (the tests' stand-in for a public host); memory is measured with tracemalloc.
"""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from kazma.engine.tools.http_get import HttpGetTool
from kazma.engine.tools.registry import ToolRegistry, ToolResult
from kazma.engine.tools.workspace import ToolContext

CAP = 64 * 1024
ZEROS = 64 * 1024 * 1024  # what the bomb decodes to: a thousand times the cap


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def bodies() -> dict[str, tuple[bytes, str]]:
    zeros = gzip.compress(bytes(ZEROS), compresslevel=9)
    text = b"hello from a compressed answer\n" * 10
    return {
        "/bomb": (zeros, "gzip"),
        "/double": (gzip.compress(zeros, compresslevel=9), "gzip, gzip"),
        "/small-gzip": (gzip.compress(text), "gzip"),
        "/small-deflate": (zlib.compress(text), "deflate"),
        "/raw-deflate": (_raw_deflate(text), "deflate"),  # what some servers send as "deflate"
        "/broken": (b"\x1f\x8b\x08\x00not gzip at all", "gzip"),
        "/brotli": (b"\x0b\x02\x80hello\x03", "br"),
    }


@pytest.fixture
async def server() -> AsyncIterator[str]:
    table = bodies()

    async def serve(request: web.Request) -> web.Response:
        body, encoding = table[request.path]
        return web.Response(body=body, headers={"Content-Encoding": encoding, "Content-Type": "text/plain"})

    app = web.Application()
    for path in table:
        app.router.add_get(path, serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.2", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.2:{port}"
    finally:
        await runner.cleanup()


async def get(url: str, tmp_path: Path) -> ToolResult:
    registry = ToolRegistry([HttpGetTool(also_allow=["127.0.0.2/32"], max_bytes=CAP)])
    return await registry.execute("http_get", {"url": url}, ToolContext(workspace=tmp_path / "ws", conversation="c"))


async def test_a_compressed_bomb_is_cut_at_the_cap_without_being_decoded_whole(server: str, tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        result = await get(f"{server}/bomb", tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok, result
    assert result.truncated
    assert result.output.endswith(f"[… body cut at {CAP} bytes …]")
    # httpx's decoder turned each ~64 KiB read into ~64 MiB at once; bounded, a few times the cap at most.
    assert peak < 8 * 1024 * 1024, f"peak {peak} bytes traced while fetching a {CAP}-byte cap"


async def test_stacked_or_unknown_encodings_are_refused_with_what_was_sent(server: str, tmp_path: Path) -> None:
    for path, said in (("/double", "gzip, gzip"), ("/brotli", "br")):
        result = await get(f"{server}{path}", tmp_path)
        assert not result.ok
        assert f"answered with content-encoding {said!r}" in (result.error or ""), result
        assert "at most one layer of gzip or deflate" in (result.error or "")


async def test_ordinary_gzip_and_deflate_answers_read_as_before(server: str, tmp_path: Path) -> None:
    for path in ("/small-gzip", "/small-deflate", "/raw-deflate"):
        result = await get(f"{server}{path}", tmp_path)
        assert result.ok, result
        assert not result.truncated
        assert result.output.endswith("hello from a compressed answer\n" * 10)


async def test_a_body_that_is_not_what_its_encoding_says_is_a_clear_error(server: str, tmp_path: Path) -> None:
    result = await get(f"{server}/broken", tmp_path)
    assert not result.ok
    assert "the gzip body could not be decoded" in (result.error or ""), result
