"""`kazma mcp serve`'s lines, read in this process: one naming a member twice is refused, as /mcp refuses it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mcp

from kazma.bot.cli.mcp_stdio import asker, serve_checked, wire_server
from kazma.bot.console.mcp_tool import Asked, build_server
from tests.api_support import REQUESTER_TOKEN, Door, first_answer_withheld, kazma_door
from tests.child_env import child_env

WITHIN = 30


@dataclass
class Client:
    """The client's ends of the door's stdin and stdout."""

    to_door: Any
    from_door: asyncio.StreamReader  # read on the loop: a wait for an answer that never comes can time out

    def send(self, message: str) -> None:
        self.to_door.write(message + "\n")
        self.to_door.flush()

    async def initialise(self) -> None:
        """The MCP handshake (request id 1), answered, then told done."""
        params = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        self.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}))
        assert (await self.receive())["id"] == 1
        self.send('{"jsonrpc":"2.0","method":"notifications/initialized"}')

    async def receive(self) -> dict[str, Any]:
        with anyio.fail_after(WITHIN):
            line = await self.from_door.readline()
        assert line, "the door closed its stdout"
        found: dict[str, Any] = json.loads(line)
        return found


@dataclass
class Piped:
    """A stdio door serving over two pipes, and the client at their other ends; whoever starts it closes them."""

    client: Client
    serving: asyncio.Task[bool]  # the door: what serve_checked returns
    lines: anyio.AsyncFile[bytes]  # the door's end of its stdin
    out: anyio.AsyncFile[str]  # the door's end of its stdout
    transport: asyncio.ReadTransport  # the client's reading of the door's stdout


async def piped_door(door: Door, *, watch_stdout: bool = False) -> Piped:
    """The stdio door forwarding to ``door``, started serving over two pipes. ``watch_stdout``: its asker is given
    the door's stdout, as ``kazma mcp serve`` gives it a copy, to tell a client that no longer reads it."""
    lines_read, lines_written = os.pipe()
    out_read, out_written = os.pipe()
    answers_wire = out_written if watch_stdout else -1
    ask = asker(
        door.url, REQUESTER_TOKEN, wire=-1, answers_wire=answers_wire, interrupted=asyncio.Event(), asking=set()
    )
    lines = anyio.wrap_file(open(lines_read, "rb"))  # noqa: SIM115 - closed by whoever started the door
    out = anyio.wrap_file(open(out_written, "w", encoding="utf-8"))  # noqa: SIM115
    serving = asyncio.create_task(serve_checked(build_server(ask), lines, out))
    from_door = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(from_door),
        open(out_read, "rb"),  # noqa: SIM115
    )
    client = Client(open(lines_written, "w", encoding="utf-8"), from_door)  # noqa: SIM115
    return Piped(client, serving, lines, out, transport)


@asynccontextmanager
async def stdio_door(door: Door) -> AsyncIterator[Client]:
    """The stdio door forwarding to ``door``, serving over two pipes until the client closes its end."""
    piped = await piped_door(door)
    try:
        yield piped.client
    finally:
        piped.client.to_door.close()  # EOF: the door ends (a call still open is cancelled)
        try:
            with anyio.fail_after(WITHIN):
                await piped.serving
        finally:
            await piped.out.aclose()
            await piped.lines.aclose()
            piped.transport.close()


async def test_attack_a_line_naming_a_member_twice_is_refused_and_every_other_passes_in_order(tmp_path: Path) -> None:
    """The SDK's stdio reader keeps the last of a name given twice: before, the door forwarded the call and Kazma
    opened a request for env=staging while a client whose parser keeps the first meant env=prod."""
    call = (
        '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":'
        '{"tool":"deploy","arguments":%s,"deadline_seconds":60}}}'
    )
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        client.send(call % (2, '{"env":"prod","env":"staging"}'))
        client.send(call % (3, json.dumps('{"env":"prod","env":"staging"}')))  # arguments as a text of JSON
        client.send('{"jsonrpc":"2.0","id":4,"id":5,"method":"tools/list"}')
        client.send('{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":9,"requestId":2}}')
        client.send('{"jsonrpc":"2.0","id":6,"method":"tools/list"}')
        answered = {}
        for _ in range(4):
            found = await client.receive()
            answered[found["id"]] = found
        named = "the body is ambiguous: {!r} is named twice in one object{}; send each name once"
        assert answered[2]["error"] == {"code": -32600, "message": named.format("env", "")}
        assert answered[3]["error"] == {
            "code": -32600,
            "message": named.format("env", " (in the text given as arguments)"),
        }
        assert answered[None]["error"] == {"code": -32600, "message": named.format("id", "")}
        assert [tool["name"] for tool in answered[6]["result"]["tools"]] == ["request_approval"]
        assert await door.app.service.store.requests(limit=5) == []
        # the same call with each name once is forwarded, unchanged
        client.send(call % (7, '{"env":"prod"}'))
        await door.press("a")
        decided = await client.receive()
        assert decided["id"] == 7, decided
        assert decided["result"]["structuredContent"]["outcome"] == "approved", decided
        assert [request.args for request in await door.app.service.store.requests(limit=5)] == [{"env": "prod"}]


async def test_attack_a_line_naming_a_member_twice_then_not_json_is_refused_and_the_door_serves_on(
    tmp_path: Path,
) -> None:
    """A line whose name given twice came before it stopped being JSON (``{"id":2,"id":3,…} x``) was found
    ambiguous, then read again to answer it: that reading raised out of the door's reader, and the door ended, with
    every call open on it. Such a line is answered as not JSON, and the next line is served."""
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        client.send('{"jsonrpc":"2.0","id":2,"id":3,"method":"tools/list"} x')
        client.send('{"jsonrpc":"2.0","id":4,"method":"tools/list","params":{"a":1,"a":2}')  # never closed
        client.send('{"jsonrpc":"2.0","id":6,"method":"tools/list"}')
        refused = [await client.receive(), await client.receive()]
        for found in refused:
            assert found["id"] is None, found
            assert found["error"]["code"] == -32700, found
            assert "the line is not JSON" in found["error"]["message"], found
            assert "is named twice in one object" in found["error"]["message"], found
        listed = await client.receive()
        assert listed["id"] == 6, listed
        assert [tool["name"] for tool in listed["result"]["tools"]] == ["request_approval"]


async def test_the_stdio_door_serves_the_tool_as_the_sdk_s_own_server_does() -> None:
    """The stdio door runs its own low-level server (:func:`wire_server`) on the checked lines, built from
    MCPServer's public calls: it used to run MCPServer's private ``_lowlevel_server``, which an SDK upgrade could
    rename and so end the door. What it rebuilds is held to what MCPServer answers itself, message for message, so
    an upgrade that changes what MCPServer adds (its handshake, listings, how a tool's failure is answered) shows
    here rather than as a door that quietly answers otherwise than /mcp."""

    async def ask(asked: Asked) -> dict[str, Any]:
        if asked.tool == "crash":
            raise RuntimeError("the asker failed")
        return {"outcome": "approved", "asked": [asked.tool, asked.arguments, asked.reason, asked.deadline]}

    async def seen(server: Any) -> list[Any]:
        async with mcp.Client(server, mode="legacy") as client:
            found: list[Any] = [client.server_info, client.server_capabilities, client.instructions]
            found.append(await client.list_tools())
            for name, arguments in (
                ("request_approval", {"tool": "deploy", "arguments": {"env": "prod"}, "deadline_seconds": 60}),
                ("request_approval", {"tool": "deploy"}),  # arguments missing
                ("request_approval", {"tool": "crash", "arguments": {}}),
                ("no_such_tool", {}),
            ):
                found.append(await client.call_tool(name, arguments))
            found += [
                await client.list_resources(),
                await client.list_resource_templates(),
                await client.list_prompts(),
            ]
            for read in (client.read_resource("file:///nothing"), client.get_prompt("nothing")):
                try:
                    found.append(await read)
                except mcp.MCPError as exc:
                    found.append((exc.error.code, exc.error.message))
        return found

    sdk_s = await seen(build_server(ask))
    door_s = await seen(wire_server(build_server(ask)))
    assert door_s == sdk_s
    decided = door_s[4]
    assert decided.structured_content == {"outcome": "approved", "asked": ["deploy", {"env": "prod"}, "", 60]}
    assert [result.is_error for result in door_s[5:8]] == [True, True, True], door_s[5:8]


async def test_attack_a_line_the_sdk_cannot_read_is_answered_not_left_waiting(tmp_path: Path) -> None:
    """The SDK's stdio reader drops a line it cannot read, saying so only in a debug log: a request in it was
    never answered, and its caller waited for ever (a lone surrogate escape, arrays nested past the SDK's parser's
    limit: each JSON that Python reads, or a line that is no JSON at all). Each is
    answered now: a request whose id can be read, with an error for that id; any other line, as not JSON."""
    call = '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":%s}}'
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        client.send(call % (2, '{"tool":"deploy","arguments":{"env":"\\ud800"}}'))
        client.send(call % (3, '{"tool":"deploy","arguments":{"env":%s}}' % ("[" * 300 + "]" * 300)))
        client.send('{"jsonrpc":"2.0","id":5,"method":"tools/list"')  # cut short
        client.send("hello")
        client.send('{"jsonrpc":"2.0","method":"notifications/progress","params":{"a":"\\udc00"}}')  # not answered
        client.send('{"jsonrpc":"2.0","id":6,"method":"tools/list"}')
        answered = [await client.receive() for _ in range(5)]
        assert [found["id"] for found in answered] == [2, 3, None, None, 6], answered
        for found, why in zip(answered[:2], ("hex escape", "recursion limit"), strict=True):
            assert found["error"]["code"] == -32600, found
            assert found["error"]["message"].startswith("the message cannot be read: "), found
            assert why in found["error"]["message"], found
        for found in answered[2:4]:
            assert found["error"]["code"] == -32700, found
            assert found["error"]["message"].startswith("the line is not JSON"), found
        assert [tool["name"] for tool in answered[4]["result"]["tools"]] == ["request_approval"]
        assert await door.app.service.store.requests(limit=5) == []


async def test_attack_arguments_json_cannot_carry_are_refused_with_a_reason(tmp_path: Path) -> None:
    """NaN, an infinity (both read by the SDK) and a lone surrogate (in arguments sent as a text of JSON, which
    the SDK reads with Python's parser) could not be sent on to Kazma: the call failed as "Error executing tool
    request_approval", with a traceback on stderr and no reason. /mcp refuses them saying what and where; so does
    this door now, before anything is sent."""
    call = '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":%s}}'
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        client.send(call % (2, '{"tool":"deploy","arguments":{"replicas":NaN}}'))
        client.send(call % (3, '{"tool":"deploy","arguments":{"cap":[1e999]}}'))
        as_text = json.dumps({"tool": "deploy", "arguments": '{"env":"\\ud800"}'})  # the text holds the escape
        client.send(call % (4, as_text))
        answered = {}
        for _ in range(3):
            found = await client.receive()
            answered[found["id"]] = found["result"]
        for request_id, why in (
            (2, "body.arguments.replicas is nan, not a finite number"),
            (3, "body.arguments.cap[0] is inf, not a finite number"),
            (4, "body.arguments.env holds a lone surrogate (\\ud800)"),
        ):
            result = answered[request_id]
            assert result["isError"] is True, result
            assert f": refused: {why}" in result["content"][0]["text"], result
        assert await door.app.service.store.requests(limit=5) == []


async def test_attack_a_line_not_utf8_is_refused_not_put_on_a_card_with_its_bytes_replaced(tmp_path: Path) -> None:
    """`kazma mcp serve` read stdin replacing bytes that are not UTF-8 (as the SDK's own reader does): a client
    writing Latin-1 sent ``caf\\xe9`` and Kazma opened a request for ``caf\\ufffd``, a call nobody sent, its hash
    another than the client's. Such a line is refused now, with the request's id, and nothing is opened. And a
    refused line whose id is a lone surrogate (``"\\ud800"``) was answered with that id, which the SDK's writer
    cannot encode: the door crashed (exit 1), every call open on it with it; it is answered with id null."""
    call = (
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"request_approval",'
        b'"arguments":{"tool":"deploy","arguments":{"path":"/srv/caf\xe9"}}}}\n'
    )
    initialise = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    async with kazma_door(tmp_path) as door:
        env = child_env({"KAZMA_API_TOKEN": REQUESTER_TOKEN, "PATH": os.environ.get("PATH", "")}, base={})
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "mcp", "serve", "--url", door.url,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={**env, "NO_PROXY": "127.0.0.1"},
        )  # fmt: skip
        assert serve.stdin is not None
        assert serve.stdout is not None
        try:
            first = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialise}
            serve.stdin.write(json.dumps(first).encode() + b"\n")
            serve.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n' + call)
            serve.stdin.write(b'{"jsonrpc":"2.0","id":"\\ud800","method":"tools/list","params":{"a":1,"a":2}}\n')
            serve.stdin.write(b'{"jsonrpc":"2.0","id":3,"method":"tools/list"}\n')
            await serve.stdin.drain()
            with anyio.fail_after(WITHIN):
                answered = [json.loads(await serve.stdout.readline()) for _ in range(4)]
            assert [found["id"] for found in answered] == [1, 2, None, 3], answered
            assert answered[1]["error"] == {
                "code": -32600,
                "message": "the message cannot be read: the line is not UTF-8 (byte 0xe9 at character 140); send UTF-8",
            }
            assert "is named twice in one object" in answered[2]["error"]["message"], answered[2]
            assert await door.app.service.store.requests(limit=5) == []
        finally:
            serve.stdin.close()
            with anyio.fail_after(WITHIN):
                await serve.wait()


async def test_attack_a_batch_or_a_json_text_that_is_no_object_is_answered_not_left_waiting(tmp_path: Path) -> None:
    """A JSON-RPC batch (a client on MCP 2025-03-26 may send one; the SDK reads none) was dropped with nothing
    said: each request in it waited for ever. So did an empty batch and a JSON text that is no object (``"hi"``),
    which JSON-RPC answers with id null. Each request in a batch is answered with an error for its id now (its
    notifications, as ever, with nothing), and the others with one error with id null."""
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        listing = '{"jsonrpc":"2.0","id":%s,"method":"tools/list"}'
        notified = '{"jsonrpc":"2.0","method":"notifications/progress","params":{}}'
        client.send(f"[{listing % 2},{notified},{listing % 3}]")
        client.send(f"[{notified}]")  # notifications only: nothing to answer
        client.send("[]")
        client.send('"hi"')
        client.send(listing % 4)
        answered = [await client.receive() for _ in range(5)]
        assert [found["id"] for found in answered] == [2, 3, None, None, 4], answered
        for found in answered[:2]:
            assert found["error"]["code"] == -32600, found
            assert "send each message on its own line" in found["error"]["message"], found
        for found in answered[2:4]:
            assert found["error"]["code"] == -32600, found
            assert found["error"]["message"].startswith("the message cannot be read: "), found
        assert "result" in answered[4], answered[4]
        assert await door.app.service.store.requests(limit=5) == []


async def test_attack_a_byte_order_mark_before_the_first_line_is_read_past(tmp_path: Path) -> None:
    """A client writing UTF-8 with a byte order mark (PowerShell's pipes, a Windows editor's script) put it before
    its first line, the handshake: the door answered it as not JSON with id null, and the client waited for its
    initialize answer for ever. The mark says only "UTF-8" (JSON's RFC 8259 lets a reader ignore it): it is read
    past, and the handshake answered."""
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        client.to_door.write("\ufeff")  # before the first line only
        await client.initialise()
        client.send('{"jsonrpc":"2.0","id":2,"method":"tools/list"}')
        assert [tool["name"] for tool in (await client.receive())["result"]["tools"]] == ["request_approval"]


async def test_attack_a_carriage_return_does_not_end_a_line_nor_make_one_call_another(tmp_path: Path) -> None:
    """The door read stdin as text in universal-newline mode (as the SDK's own reader does), so a bare CR ended a
    line. JSON reads a CR as whitespace: a client's one call for env=prod with a member ``"x"`` holding, after a
    CR, a call for env=staging became three lines, the middle one a call of its own, and Kazma opened a request
    for env=staging, a call the client never made. A batch with CRs between its members got past the batch refusal
    the same way. Only LF ends a line now (MCP's stdio transport is newline-delimited); CRLF still ends one."""
    call = (
        '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":'
        '{"tool":"deploy","arguments":%s,"deadline_seconds":60}}}'
    )
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        client.send("[\r" + call % (2, '{"env":"staging"}') + "\r]")
        refused = await client.receive()
        assert refused["id"] == 2, refused
        assert "a batch (a JSON array) is not taken" in refused["error"]["message"], refused
        meant = call % (3, '{"env":"prod"}')
        client.send(meant[:-1] + ',"x":\r' + call % (3, '{"env":"staging"}') + "\r}")  # one call, for env=prod
        await door.press("a")
        decided = await client.receive()
        assert decided["id"] == 3, decided
        assert decided["result"]["structuredContent"]["outcome"] == "approved", decided
        assert [request.args for request in await door.app.service.store.requests(limit=5)] == [{"env": "prod"}]
        client.to_door.write('{"jsonrpc":"2.0","id":4,"method":"tools/list"}\r\n')
        client.to_door.flush()
        assert [tool["name"] for tool in (await client.receive())["result"]["tools"]] == ["request_approval"]


async def test_attack_a_line_longer_than_the_api_takes_is_answered_without_being_held(tmp_path: Path) -> None:
    """The SDK's reader (and the door's) held a line of any length whole, then parsed it: a client (or whatever
    writes to its pipe) could make the door hold gigabytes. A line longer than the approvals API's body limit is
    let go as it arrives and answered for its request's id (read in passing), and the next line is served."""
    from kazma.bot.cli.mcp_stdio import MAX_LINE_BYTES
    from kazma.bot.console.server import WebServer

    assert MAX_LINE_BYTES == WebServer.BODY_LIMIT
    call = '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":%s}}'
    huge = call % (2, json.dumps({"tool": "deploy", "arguments": {"blob": "a" * MAX_LINE_BYTES}}))
    notified = '{"jsonrpc":"2.0","method":"notifications/progress","params":{"x":"%s"}}' % ("b" * MAX_LINE_BYTES)
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        # written from a thread: the door reads on this loop, and a pipe holds less than the line
        await anyio.to_thread.run_sync(client.send, huge)
        await anyio.to_thread.run_sync(client.send, notified)  # a notification: not answered
        await anyio.to_thread.run_sync(client.send, "[" * (MAX_LINE_BYTES + 1))  # no id to read: id null
        client.send('{"jsonrpc":"2.0","id":3,"method":"tools/list"}')
        answered = [await client.receive() for _ in range(3)]
        assert [found["id"] for found in answered] == [2, None, 3], answered
        for found in answered[:2]:
            assert found["error"]["code"] == -32600, found
            assert found["error"]["message"].startswith("the line is longer than the 256 KiB a message may be ("), found
        assert [tool["name"] for tool in answered[2]["result"]["tools"]] == ["request_approval"]
        assert await door.app.service.store.requests(limit=5) == []


async def test_attack_json_python_s_parser_reads_only_leniently_is_answered_for_its_id(tmp_path: Path) -> None:
    """A raw control character inside a string (NUL, U+001F: JSON says escape them) and an integer longer than
    Python's int-string limit (4300 digits; JSON has none) were answered ``-32700`` "the line is not JSON" with id
    null, the second quoting Python's own advice to raise the limit: the request in the line waited for an answer
    with its id for ever. Each is answered for its id now, saying what is wrong and what to send; an id that is
    itself such a number is answered with null, and a notification not at all."""
    call = '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":%s}}'
    digits = "1" * (sys.get_int_max_str_digits() + 1)
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        raw = ['{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{"a":"x\x00y"}}']
        raw.append(call % (3, '{"tool":"deploy","arguments":{"env":"prod\x1f"}}'))
        for line in raw:
            client.send(line)
        client.send(call % (4, '{"tool":"deploy","arguments":{"replicas":' + digits + "}}"))
        client.send('{"jsonrpc":"2.0","id":' + digits + ',"method":"tools/list"}')
        client.send('{"jsonrpc":"2.0","method":"notifications/progress","params":{"a":"\x00"}}')  # not answered
        client.send('{"jsonrpc":"2.0","id":6,"method":"tools/list"}')
        answered = [await client.receive() for _ in range(5)]
        assert [found["id"] for found in answered] == [2, 3, 4, None, 6], answered
        for found, line, code in zip(answered[:2], raw, (0, 0x1F), strict=True):
            at = line.index(chr(code))
            assert found["error"] == {
                "code": -32700,
                "message": f"the line is not JSON: a control character (U+{code:04X}) at character {at} is inside a"
                f" string; write it as an escape (\\u{code:04x})",
            }
        for found in answered[2:4]:
            assert found["error"] == {
                "code": -32600,
                "message": f"the message cannot be read: a number with more than {len(digits) - 1} digits cannot be"
                " read; send it as a string",
            }
        assert [tool["name"] for tool in answered[4]["result"]["tools"]] == ["request_approval"]
        assert await door.app.service.store.requests(limit=5) == []


async def test_attack_a_line_longer_than_the_api_takes_with_its_id_in_doubt_is_answered_with_null(
    tmp_path: Path,
) -> None:
    """A line over the limit was answered for the id its top level was read to have, checked less than a line within
    the limit is: an id given as ``"\\ud800"`` (no Unicode text) made the SDK's writer raise and ended the door,
    with every call open on it; an id named twice (``"id"`` and ``"\\u0069d"`` alike, which the reader did not
    know for ``id``) was answered for the last, another request of the client's own when its parser kept the
    first; an id too long to keep was not answered at all. Each is answered with id null now, as a line within the
    limit is, and a request naming ``"\\u0069d"`` once is answered for it."""
    from kazma.bot.cli.mcp_stdio import MAX_LINE_BYTES

    over = '{"jsonrpc":"2.0",%s,"method":"tools/list","params":{"_meta":{"pad":"%s"}}}'
    pad = "b" * MAX_LINE_BYTES
    ids = ['"id":7,"id":8', '"id":7,"\\u0069d":8', f'"id":"{"i" * 300}"', '"\\u0069d":9']
    ids.append('"id":"\\ud800"')  # last: the line that ended the door, once every other is read
    lines = [over % (given, pad) for given in ids]
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        for line in lines:
            await anyio.to_thread.run_sync(client.send, line)  # from a thread: a pipe holds less than the line
        client.send('{"jsonrpc":"2.0","id":3,"method":"tools/list"}')
        answered = [await client.receive() for _ in range(len(lines) + 1)]
        assert [found["id"] for found in answered] == [None, None, None, 9, None, 3], answered
        for found in answered[:-1]:
            assert found["error"]["message"].startswith("the line is longer than the 256 KiB a message may be ("), found
        assert [tool["name"] for tool in answered[-1]["result"]["tools"]] == ["request_approval"]


async def test_a_line_of_exactly_the_limit_is_served_and_one_byte_more_is_not(tmp_path: Path) -> None:
    """The limit is the longest line served (its LF not counted): a line of exactly ``MAX_LINE_BYTES`` is answered
    as any other; one byte more is refused for its id."""
    from kazma.bot.cli.mcp_stdio import MAX_LINE_BYTES

    def padded(request_id: int, size: int) -> str:
        shape = '{"jsonrpc":"2.0","id":%d,"method":"tools/list","params":{"_meta":{"pad":"%s"}}}'
        line = shape % (request_id, "b" * (size - len(shape % (request_id, ""))))
        assert len(line.encode()) == size
        return line

    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        await anyio.to_thread.run_sync(client.send, padded(2, MAX_LINE_BYTES))
        await anyio.to_thread.run_sync(client.send, padded(3, MAX_LINE_BYTES + 1))
        served, refused = await client.receive(), await client.receive()
        assert served["id"] == 2, served
        assert [tool["name"] for tool in served["result"]["tools"]] == ["request_approval"]
        assert refused["id"] == 3, refused
        assert refused["error"]["message"].startswith(
            f"the line is longer than the 256 KiB a message may be ({MAX_LINE_BYTES + 1} bytes)"
        ), refused


class _Chunks(io.RawIOBase):
    """A pipe whose reads return ``chunks`` one at a time (no more than a read asks for), as a pipe returns what
    has been written so far."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._chunks:
            return 0
        chunk = self._chunks.pop(0)
        taken, rest = chunk[: len(buffer)], chunk[len(buffer) :]
        if rest:
            self._chunks.insert(0, rest)
        buffer[: len(taken)] = taken
        return len(taken)


async def _lines_read(chunks: list[bytes]) -> list[bytes | tuple[int, Any]]:
    from kazma.bot.cli.mcp_stdio import _bounded_lines

    # a buffer no larger than the smallest read: each read1 returns one chunk, as written
    source = anyio.wrap_file(io.BufferedReader(_Chunks(chunks), buffer_size=1))
    return [
        read if isinstance(read, bytes) else (read.size, read.envelope.request_id)
        async for read in _bounded_lines(source)
    ]


async def test_lines_are_the_same_wherever_the_reads_cut_them() -> None:
    """What the door reads is cut into reads wherever the pipe happened to be: a CR ending one read and its LF
    beginning the next, a line of exactly the limit whose LF comes in the next read, a UTF-8 character split
    between reads, a last line with no LF before EOF, EOF while a line over the limit is being let go. The lines
    (and the answers to the lines over the limit) are the same for every cut."""
    from kazma.bot.cli.mcp_stdio import MAX_LINE_BYTES

    exact = b'{"id":1,"x":"' + b"a" * (MAX_LINE_BYTES - 15) + b'"}'
    over = b'{"id":2,"x":"' + b"a" * (MAX_LINE_BYTES - 14) + b'"}'
    stream = b'{"a":"\xc3\xa9"}\r\n\n' + exact + b"\n" + over + b'\n{"b":"\xe2\x80\xa8"}\r\n' + b'{"id":3'
    wanted = [b'{"a":"\xc3\xa9"}\r', b"", exact, (len(over), 2), b'{"b":"\xe2\x80\xa8"}\r', b'{"id":3']
    assert len(exact) == MAX_LINE_BYTES
    assert len(over) == MAX_LINE_BYTES + 1
    assert await _lines_read([stream]) == wanted
    # cut at (and one byte either side of) each CRLF's LF, inside each UTF-8 character, at each long line's LF
    cuts = [stream.index(b"\r\n") + 1, stream.index(b"\xc3") + 1, stream.index(b"\xe2") + 2, len(stream) - 1]
    cuts += [stream.index(line) + len(line) for line in (exact, over)] + [stream.rindex(b"\r\n") + 1]
    for end in cuts:
        for cut in (end - 1, end, end + 1):
            assert await _lines_read([stream[:cut], stream[cut:]]) == wanted, cut
    assert await _lines_read([stream[at : at + 4096] for at in range(0, len(stream), 4096)]) == wanted
    # EOF with a line over the limit half let go: it is answered for, and reading ends
    assert await _lines_read([over[: MAX_LINE_BYTES + 1], over[MAX_LINE_BYTES + 1 : -5]]) == [(MAX_LINE_BYTES + 1, 2)]


async def test_a_message_of_exactly_the_limit_is_served_whether_crlf_or_lf_ends_it() -> None:
    """The CR of a CRLF counted toward the limit: a message of exactly ``MAX_LINE_BYTES`` was served when LF ended
    it and refused as too long when CRLF did. The limit is the message's own now, whichever ends its line, cut
    anywhere by the pipe; one byte more is refused either way, and a CR that ends no CRLF (EOF after it) counts."""
    from kazma.bot.cli.mcp_stdio import MAX_LINE_BYTES

    exact = b'{"id":1,"x":"' + b"a" * (MAX_LINE_BYTES - 15) + b'"}'
    over = b'{"id":2,"x":"' + b"a" * (MAX_LINE_BYTES - 14) + b'"}'
    assert (len(exact), len(over)) == (MAX_LINE_BYTES, MAX_LINE_BYTES + 1)
    for end in (b"\n", b"\r\n"):
        stream = exact + end + over + end + b'{"id":3}' + end
        wanted = [exact + end[:-1], (len(over) + len(end) - 1, 2), b'{"id":3}' + end[:-1]]
        assert await _lines_read([stream]) == wanted, end
        for cut in (len(exact), len(exact) + 1, len(exact) + len(end) + len(over), len(stream) - 1):
            assert await _lines_read([stream[:cut], stream[cut:]]) == wanted, (end, cut)
    assert await _lines_read([exact + b"\r"]) == [(MAX_LINE_BYTES + 1, 1)]  # EOF: that CR is the message's


async def test_attack_requests_sent_as_stdin_closes_are_each_answered_and_no_call_stays_open(tmp_path: Path) -> None:
    """The door ended as its lines did, and the SDK's server cancels what it holds then: a request it had not
    started yet was never answered at all (a tools/list or ping sent with stdin's close, with or without its LF,
    was dropped without a word, as was a request_approval). What the client asked is answered now before the door
    ends; a request_approval arriving with the close is abandoned (the client closed stdin: MCP's stdio shutdown),
    so it is answered as ended and nothing it could have opened stays open on a card."""
    call = (
        '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"request_approval","arguments":'
        '{"tool":"deploy","arguments":{"n":%s},"deadline_seconds":60}}}'
    )
    asked = [2, 3, 4, 5, 6, 7]
    async with kazma_door(tmp_path) as door:
        async with stdio_door(door) as client:
            await client.initialise()
            last = '{"jsonrpc":"2.0","id":7,"method":"tools/list"}'  # no LF: stdin closes right after it
            client.to_door.write(
                '{"jsonrpc":"2.0","id":2,"method":"tools/list"}\n{"jsonrpc":"2.0","id":3,"method":"ping"}\n'
                + call % (4, 4) + "\n" + call % (5, 5) + '\n{"jsonrpc":"2.0","id":6,"method":"ping"}\n' + last
            )  # fmt: skip
            client.to_door.close()
            answered = {}
            for _ in asked:
                found = await client.receive()
                answered[found["id"]] = found
        rest = await client.from_door.read()
        assert sorted(answered) == asked, answered
        assert rest == b"", rest  # each request answered once
        for listed in (2, 7):
            assert [tool["name"] for tool in answered[listed]["result"]["tools"]] == ["request_approval"]
        assert answered[3]["result"] == {}, answered
        assert answered[6]["result"] == {}, answered
        for ended in (4, 5):
            assert answered[ended]["error"]["code"] == -32000, answered[ended]
        opened = await door.app.service.store.requests(limit=5)
        assert [request.status.value for request in opened if request.status.value == "pending"] == [], opened


async def test_attack_a_client_that_stops_reading_stdout_is_gone_and_what_it_asked_is_withdrawn(tmp_path: Path) -> None:
    """A client that closed its end of the door's stdout but kept stdin open made the SDK's writer fail at the
    next answer: the call it had open was cancelled (said on the card as "the asking call was cancelled", not as
    the client gone), and the door stayed until stdin closed, then ended with a traceback (an exception group of
    BrokenPipeError, exit 1). Such a client hung up: what it asked is withdrawn as disconnected, and the door ends
    at once, with stdin still open, saying so (``True``) rather than raising."""
    call = (
        '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"request_approval","arguments":'
        '{"tool":"deploy","arguments":{"n":1},"deadline_seconds":60}}}'
    )
    async with kazma_door(tmp_path) as door:
        piped = await piped_door(door, watch_stdout=True)
        client, serving, transport = piped.client, piped.serving, piped.transport
        try:
            await client.initialise()
            client.send(call)
            with anyio.fail_after(WITHIN):
                while not await door.app.service.store.requests(pending_only=True):
                    await anyio.sleep(0.02)
            transport.close()  # the client stops reading; stdin stays open
            client.send('{"jsonrpc":"2.0","id":3,"method":"ping"}')  # its answer finds stdout broken
            # waited for, not cancelled at a deadline: cancelled, the door would wait for stdin to close
            await asyncio.wait({serving}, timeout=WITHIN)
            assert serving.done(), "the door stayed while stdin was open"
            assert serving.result() is True
            [request] = await door.app.service.store.requests()
            assert (request.status.value, request.reason) == ("cancelled", "withdrawn: the MCP client disconnected")
        finally:
            client.to_door.close()
            if not serving.done():
                serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            with contextlib.suppress(BrokenPipeError):  # the answer the client never read is still buffered
                await piped.out.aclose()
            await piped.lines.aclose()
            transport.close()


async def test_attack_a_line_too_long_with_more_members_than_read_is_answered_even_with_method_first(
    tmp_path: Path,
) -> None:
    """A line over the limit whose top level has more members than are read (64) is given up on, its id in
    doubt: when its ``method`` came before the 64th member and its ``id`` after, it was taken for a notification
    (a method and no id read) and never answered, the client's request waiting for ever. It is answered with id
    null now, as a line given up on with its id first is."""
    from kazma.bot.cli.mcp_stdio import MAX_LINE_BYTES

    crowd = "".join(f'"a{n}":1,' for n in range(64))
    pad = "b" * MAX_LINE_BYTES
    line = '{"jsonrpc":"2.0","method":"tools/list",' + crowd + '"id":5,"params":{"_meta":{"pad":"' + pad + '"}}}'
    async with kazma_door(tmp_path) as door, stdio_door(door) as client:
        await client.initialise()
        await anyio.to_thread.run_sync(client.send, line)  # from a thread: a pipe holds less than the line
        client.send('{"jsonrpc":"2.0","id":3,"method":"tools/list"}')
        answered = [await client.receive(), await client.receive()]
        assert [found["id"] for found in answered] == [None, 3], answered
        assert answered[0]["error"]["message"].startswith("the line is longer than the 256 KiB"), answered[0]


async def test_attack_a_call_cancelled_while_its_open_is_on_the_way_is_withdrawn_once_the_open_answers(
    tmp_path: Path,
) -> None:
    """A call cancelled (stdin closed, the client's cancel) after its POST reached Kazma and before the answer came
    back: the id never reached the door, which withdrew nothing, and the request stayed pending with its cards out
    (under load in CI: a request_approval sent as stdin closed). The open's answer is awaited, bounded, and what
    it opened is withdrawn."""
    release = asyncio.Event()
    async with kazma_door(tmp_path) as door, first_answer_withheld(door.url, release=release) as proxy:
        ask = asker(proxy.url, REQUESTER_TOKEN, wire=-1, interrupted=asyncio.Event(), asking=set())
        call = asyncio.ensure_future(ask(Asked("deploy", {"env": "prod"}, "", 60, None)))
        with anyio.fail_after(WITHIN):
            while not await door.app.service.store.requests(pending_only=True):
                await asyncio.sleep(0.02)  # polling the store for the open Kazma made, not standing in for it
        call.cancel()
        await asyncio.sleep(0)  # one turn: the call takes its cancellation before the held answer can come back
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        [request] = await door.app.service.store.requests()
        assert (request.status.value, request.reason) == ("cancelled", "withdrawn: the asking call was cancelled")
