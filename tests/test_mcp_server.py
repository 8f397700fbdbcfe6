"""Kazma as an MCP server: the SDK's own client calls request_approval over stdio and over /mcp."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from kazma.approvals.hashing import args_hash
from kazma.config.metrics import failure_count
from tests.api_support import OPERATOR_TOKEN, REQUESTER_TOKEN, VIEWER_TOKEN, Door, kazma_door
from tests.child_env import child_env

ASK: dict[str, Any] = {"tool": "git_push", "arguments": {"branch": "main", "force": True}, "reason": "hotfix"}


def _payload(result: Any) -> dict[str, Any]:
    if result.structured_content:
        found = result.structured_content
        return dict(found.get("result", found))
    text = "".join(getattr(item, "text", "") for item in result.content)
    return dict(json.loads(text))


async def _ask_and_press(door: Door, session: ClientSession, code: str) -> dict[str, Any]:
    await session.initialize()
    tools = await session.list_tools()
    assert [tool.name for tool in tools.tools] == ["request_approval"]
    call = asyncio.create_task(session.call_tool("request_approval", ASK))
    await door.press(code)
    result = await asyncio.wait_for(call, 30)
    assert not result.is_error, result
    return _payload(result)


async def test_sdk_client_over_stdio_gets_the_outcome_and_hash(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "kazma.bot.cli", "mcp", "serve", "--url", door.url],
            env=child_env({"KAZMA_API_TOKEN": REQUESTER_TOKEN, "PATH": os.environ.get("PATH", "")}, base={}),
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            answer = await _ask_and_press(door, session, "a")
        assert answer["outcome"] == "approved"
        assert answer["decided_by"] == "telegram:111"
        assert answer["hash"] == args_hash(ASK["arguments"])
        stored = await door.app.service.store.get(answer["request_id"])
        assert stored is not None
        assert stored.requested_by == "api:ci"


async def test_sdk_client_over_streamable_http_gets_the_outcome_and_hash(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        headers = {"Authorization": f"Bearer {REQUESTER_TOKEN}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=60, trust_env=False) as http,
            streamable_http_client(f"{door.url}/mcp", http_client=http) as streams,
            ClientSession(streams[0], streams[1]) as session,
        ):
            answer = await _ask_and_press(door, session, "d")
        assert answer["outcome"] == "denied"
        assert answer["hash"] == args_hash(ASK["arguments"])


async def test_attack_mcp_endpoint_refuses_console_and_viewer_tokens(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        async with httpx2.AsyncClient(trust_env=False) as http:
            for token in (OPERATOR_TOKEN, "x" * 40):
                refused = await http.post(
                    f"{door.url}/mcp",
                    json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                    headers={"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"},
                )
                assert refused.status_code == 401
        headers = {"Authorization": f"Bearer {VIEWER_TOKEN}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=60, trust_env=False) as http,
            streamable_http_client(f"{door.url}/mcp", http_client=http) as streams,
            ClientSession(streams[0], streams[1]) as session,
        ):
            await session.initialize()
            result = await session.call_tool("request_approval", ASK)
            assert result.is_error
        assert await door.app.service.store.requests(limit=5) == []


async def test_attack_a_body_naming_a_member_twice_is_refused_before_the_sdk(tmp_path: Path) -> None:
    """The SDK's parser keeps the last of a name given twice: before, the card asked about env=staging while a
    client whose own parser keeps the first meant env=prod. /api/v1 answered such a body 400; /mcp now does too."""
    headers = {
        "Authorization": f"Bearer {REQUESTER_TOKEN}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    call = (
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"request_approval","arguments":'
        b'{"tool":"deploy","arguments":{"env":"prod","env":"staging"},"deadline_seconds":1}}}'
    )
    listing = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call"}'
    async with kazma_door(tmp_path) as door, httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        for body, name in ((call, "env"), (listing, "method")):
            refused = await http.post(f"{door.url}/mcp", content=body, headers=headers)
            assert refused.status_code == 400, refused.text
            assert refused.json() == {
                "jsonrpc": "2.0",
                "id": None,
                "error": {
                    "code": -32600,
                    "message": f"the body is ambiguous: {name!r} is named twice in one object; send each name once",
                },
            }
        assert await door.app.service.store.requests(limit=5) == []
        # the same call with each name once still reaches the SDK and its tool
        listed = await http.post(
            f"{door.url}/mcp", content=b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}', headers=headers
        )
        assert listed.status_code == 200, listed.text
        assert [tool["name"] for tool in listed.json()["result"]["tools"]] == ["request_approval"]


async def test_attack_arguments_sent_as_text_naming_a_member_twice_are_refused_too(tmp_path: Path) -> None:
    """The SDK's tools read a text given for a parameter that is not text as JSON, with Python's parser (which keeps
    the last of a name given twice): before, arguments sent as such a text passed the door's check and the card
    asked about env=staging while a client whose parser keeps the first meant env=prod."""
    headers = {
        "Authorization": f"Bearer {REQUESTER_TOKEN}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    inner = '{"env":"prod","env":"staging"}'
    call: dict[str, Any] = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {
            "name": "request_approval",
            "arguments": {"tool": "deploy", "arguments": inner, "deadline_seconds": 1},
        },
    }
    async with kazma_door(tmp_path) as door, httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        refused = await http.post(f"{door.url}/mcp", content=json.dumps(call).encode(), headers=headers)
        opened = [request.args for request in await door.app.service.store.requests(limit=5)]
        assert refused.status_code == 400, f"{refused.text} (opened: {opened})"
        assert refused.json()["error"] == {
            "code": -32600,
            "message": "the body is ambiguous: 'env' is named twice in one object (in the text given as arguments); "
            "send each name once",
        }
        assert opened == []
        # the same text with each name once is still read as the arguments (as clients that send text rely on)
        call["params"]["arguments"]["arguments"] = '{"env":"prod"}'
        answered = await http.post(f"{door.url}/mcp", content=json.dumps(call).encode(), headers=headers)
        assert answered.status_code == 200, answered.text
        assert [request.args for request in await door.app.service.store.requests(limit=5)] == [{"env": "prod"}]


async def test_sdk_client_reaching_kazma_by_its_public_name_gets_the_outcome(tmp_path: Path) -> None:
    """A client of ``<public_url>/mcp`` sends that name as Host (a proxy passes it on): before, the SDK's
    localhost-only DNS-rebinding check answered every such call 421 "Invalid Host header". Its headers may also
    hold UTF-8 (here "€"), which the bridge to the SDK re-encoded as latin-1: a 500."""
    async with kazma_door(tmp_path) as door:
        headers = {
            b"Authorization": f"Bearer {REQUESTER_TOKEN}".encode(),
            b"Host": b"kazma.example.com",
            b"X-Client-Note": "déploiement à 5 €".encode(),
        }
        async with (
            httpx2.AsyncClient(headers=headers, timeout=60, trust_env=False) as http,
            streamable_http_client(f"{door.url}/mcp", http_client=http) as streams,
            ClientSession(streams[0], streams[1]) as session,
        ):
            answer = await _ask_and_press(door, session, "a")
        assert answer["outcome"] == "approved"
        assert answer["hash"] == args_hash(ASK["arguments"])


async def test_attack_a_browser_preflight_to_mcp_is_refused_without_a_token(tmp_path: Path) -> None:
    """What stands in for the SDK's Host check: a page on another origin cannot send the bearer token, because the
    preflight its Authorization header needs gets no CORS answer from the door."""
    async with kazma_door(tmp_path) as door, httpx2.AsyncClient(trust_env=False) as http:
        preflight = await http.options(
            f"{door.url}/mcp",
            headers={
                "Origin": "http://evil.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 401
        assert "access-control-allow-origin" not in preflight.headers


async def test_a_get_on_mcp_is_refused_not_held_open_as_a_stream(tmp_path: Path) -> None:
    """The stateless endpoint has no stream to offer: before, a GET got a text/event-stream that never ended."""
    async with (
        kazma_door(tmp_path) as door,
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {REQUESTER_TOKEN}"}, trust_env=False) as http,
        http.stream("GET", f"{door.url}/mcp", headers={"Accept": "text/event-stream"}) as answer,
    ):
        assert answer.status_code == 405
        assert answer.headers["allow"] == "POST"
        assert "POST" in json.loads(await answer.aread())["error"]


async def _tool_names(door: Door) -> list[str]:
    headers = {"Authorization": f"Bearer {REQUESTER_TOKEN}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30, trust_env=False) as http,
        streamable_http_client(f"{door.url}/mcp", http_client=http) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
        return [tool.name for tool in (await session.list_tools()).tools]


async def test_the_sdk_s_session_manager_ending_is_said_counted_and_started_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with kazma_door(tmp_path) as door:
        assert await _tool_names(door) == ["request_approval"]
        (manager,) = [task for task in asyncio.all_tasks() if task.get_name() == "kazma-mcp-http"]
        counted = failure_count("mcp_endpoint")
        # No request is known to end it; whatever does (an error escaping the SDK's task group), its task ends.
        # Before, nobody looked at it after start: every later /mcp call answered 500 ("Task group is not
        # initialized") and nothing was logged or counted.
        manager.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await manager
        assert failure_count("mcp_endpoint") == counted + 1
        assert [r for r in caplog.records if r.getMessage() == "mcp.endpoint_ended"]
        assert await _tool_names(door) == ["request_approval"]  # the next call starts a new one
        (again,) = [task for task in asyncio.all_tasks() if task.get_name() == "kazma-mcp-http"]
        assert again is not manager
    assert failure_count("mcp_endpoint") == counted + 1  # a stop is no failure


async def _healthz(door: Door) -> httpx2.Response:
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        return await http.get(f"{door.url}/healthz")


async def test_healthz_says_whether_mcp_serves_and_that_an_ended_one_starts_again(tmp_path: Path) -> None:
    """/healthz said "ok" whatever /mcp's state: an endpoint whose session manager had ended (or whose start
    kept failing) was seen by no monitor. Said as a line: approvals are still decided, the status stays 200."""
    async with kazma_door(tmp_path) as door:
        assert await _tool_names(door) == ["request_approval"]
        serving = await _healthz(door)
        assert (serving.status_code, serving.text) == (200, "ok\nplatform telegram: serving\nmcp: serving\n")
        (manager,) = [task for task in asyncio.all_tasks() if task.get_name() == "kazma-mcp-http"]
        manager.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await manager
        ended = await _healthz(door)
        assert ended.status_code == 200
        assert ended.text == (
            "ok\nplatform telegram: serving\n"
            "mcp: not running (its session manager ended: cancelled): the next /mcp call starts it again\n"
        )
        assert await _tool_names(door) == ["request_approval"]
        assert (await _healthz(door)).text == "ok\nplatform telegram: serving\nmcp: serving\n"
