"""``kazma mcp serve``: the MCP door on stdio, forwarding each ``request_approval`` to a running Kazma.

It speaks stdio to a local client and asks Kazma's approvals API over HTTP
(``KAZMA_API_TOKEN``), so it holds no store and no platform of its own; the
tool itself is the web server's (:func:`kazma.bot.console.mcp.build_server`).
What it forwarded is withdrawn when its client closes stdin or cancels the
call, or when it is interrupted (SIGINT, SIGTERM); Kazma withdraws it itself
when this process stops asking (killed outright).
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import io
import json
import os
import re
import select
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any, cast

import anyio
import structlog
from mcp.server import Server, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError, UnexpectedToolError
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    PARSE_ERROR,
    BlobResourceContents,
    CallToolRequestParams,
    CallToolResult,
    ErrorData,
    GetPromptRequestParams,
    GetPromptResult,
    InputRequiredResult,
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    ListPromptsResult,
    ListResourcesResult,
    ListResourceTemplatesResult,
    ListToolsResult,
    PaginatedRequestParams,
    ReadResourceRequestParams,
    ReadResourceResult,
    TextContent,
    TextResourceContents,
    jsonrpc_message_adapter,
)
from pydantic import ValidationError

from kazma.approvals.withdrawal import Gone
from kazma.bot.console.api import ambiguity, unrepresentable
from kazma.bot.console.mcp_door import READ_FROM_TEXT
from kazma.bot.console.mcp_tool import Ask, Asked, answer, build_server
from kazma.engine.tools.mcp_stdio import Envelope

log = structlog.get_logger("kazma.mcp_server")
# How long a poll may fail in a row (Kazma restarting, a replica failing over) before the call gives up: less
# than POLL_GRACE, after which Kazma withdraws a request nobody asks about.
POLL_RETRY_SECONDS = 45.0
WITHDRAW_TIMEOUT = 5.0  # an interrupted asker waits this long for Kazma to confirm the withdrawal
# The longest line read: the approvals API's body limit (WebServer.BODY_LIMIT), past which Kazma would refuse the
# call anyway. A longer line is let go as it arrives, never held whole (the SDK's reader holds any length).
MAX_LINE_BYTES = 256 * 1024
_READ_CHUNK = 64 * 1024


def serve_stdio(base_url: str, token: str) -> None:
    """Serve MCP on stdin/stdout, forwarding each ``request_approval`` to Kazma's approvals API."""
    # The SDK points fd 0 at /dev/null while it serves and reads the client from a private copy: a copy of our
    # own tells whether the client hung up.
    try:
        wire = os.dup(0)
    except OSError:
        wire = -1  # no stdin to watch: a cancelled call is reported as cancelled, never as a hang-up
    # and of stdout, which tells a client that stopped reading (closed its end) from one cancelling a call
    try:
        answers_wire = os.dup(1)
    except OSError:
        answers_wire = -1
    asyncio.run(_serve_stdio(base_url, token, wire, answers_wire))


async def _serve_stdio(base_url: str, token: str, wire: int, answers_wire: int = -1) -> None:
    """Serve until the client hangs up, or until this process is interrupted (SIGINT, SIGTERM)."""
    interrupted = asyncio.Event()
    asking: set[asyncio.Task[Any]] = set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)

    ask = asker(base_url, token, wire=wire, answers_wire=answers_wire, interrupted=interrupted, asking=asking)
    serving = asyncio.create_task(serve_checked(build_server(ask), _client_lines()))
    stop = asyncio.create_task(interrupted.wait())
    await asyncio.wait((serving, stop), return_when=asyncio.FIRST_COMPLETED)
    if serving.done():  # the client hung up: every open call was cancelled and withdrew its request
        stop.cancel()
        if not serving.result():
            return
        # It stopped reading with stdin still open: the read of stdin, let go, still blocks a worker thread, which
        # the interpreter would wait for at exit (until the client closes stdin). Nothing is left to do: leave.
        sys.stderr.flush()
        os._exit(0)
    serving.cancel()
    if asking:
        await asyncio.wait(set(asking), timeout=WITHDRAW_TIMEOUT + 1)
    # The SDK reads stdin in a worker thread that stays blocked while the client keeps stdin open, and neither
    # the loop nor the interpreter can end while it does. What was asked is withdrawn: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def asker(
    base_url: str,
    token: str,
    *,
    wire: int,
    interrupted: asyncio.Event,
    asking: set[asyncio.Task[Any]],
    answers_wire: int = -1,
) -> Ask:
    """How this door asks: each call is forwarded to Kazma's approvals API and polled until it is decided; a call
    cancelled (``interrupted`` set, or the client gone: ``wire`` hung up, or ``answers_wire``, a copy of stdout,
    no longer read) withdraws what it forwarded. Each call in flight is in ``asking``."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"}

    async def ask(asked: Asked) -> dict[str, Any]:
        current = asyncio.current_task()
        assert current is not None
        asking.add(current)
        try:
            # What JSON cannot carry (NaN, an infinity, a lone surrogate: the SDK reads them) cannot be sent on:
            # refused as Kazma refuses it, saying what and where, not as the tool failing with a traceback.
            problem = unrepresentable(asked.body())
            if problem is not None:
                raise ToolError(f"refused: {problem}; send it as JSON can carry it")
            async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=90, trust_env=False) as client:
                # Kazma-Wait: this process waits and keeps asking; Kazma withdraws the request if it stops.
                opening = asyncio.ensure_future(
                    client.post("/api/v1/approvals", json=asked.body(), headers={"Kazma-Wait": "sync"})
                )
                try:
                    opened = await asyncio.shield(opening)
                except asyncio.CancelledError:
                    # Cancelled while the open was on its way (a call sent as stdin closed): Kazma may have opened
                    # it, its cards out, and the id never came back to be withdrawn; the request stayed pending
                    # until Kazma's own grace for an asker gone quiet. Its answer is awaited (bounded) to withdraw it.
                    with anyio.move_on_after(WITHDRAW_TIMEOUT, shield=True):
                        late = await opening
                        if late.status_code < 400:
                            await _withdraw_remote(client, late.json()["id"], _gone(interrupted, wire, answers_wire))
                    opening.cancel()
                    raise
                if opened.status_code >= 400:
                    raise ToolError(f"Kazma refused the request (HTTP {opened.status_code}): {opened.text[:500]}")
                found: dict[str, Any] = opened.json()
                try:
                    return answer(await _poll(client, found))
                except asyncio.CancelledError:
                    # The client cancelled the call or hung up, or this process was told to stop.
                    with anyio.move_on_after(WITHDRAW_TIMEOUT, shield=True):
                        await _withdraw_remote(client, found["id"], _gone(interrupted, wire, answers_wire))
                    raise
        finally:
            asking.discard(current)

    return ask


def _gone(interrupted: asyncio.Event, wire: int, answers_wire: int) -> Gone:
    """Why a call was cancelled: this process was told to stop, the client hung up (stdin closed, or stdout no
    longer read), or the client cancelled that call."""
    if interrupted.is_set():
        return Gone.INTERRUPTED
    return Gone.DISCONNECTED if _hung_up(wire) or _stopped_reading(answers_wire) else Gone.CANCELLED


def _client_lines() -> anyio.AsyncFile[bytes]:
    """The client's side of stdin, read from a private copy while fd 0 points at the null device.

    The SDK does this itself only for a stdin it opens: what this door hands it instead is claimed the same way,
    so a child (or a stray read) still finds EOF rather than a line of the client's."""
    try:
        private = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError:
        return anyio.wrap_file(sys.stdin.buffer)
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            os.dup2(null, 0)
        finally:
            os.close(null)
    except OSError:
        pass  # the diversion failed: the client is still read from the copy, as the SDK would
    # closefd=False: the SDK's reader thread may still block on it as the process leaves
    return anyio.wrap_file(os.fdopen(private, "rb", closefd=False))


async def serve_checked(
    server: MCPServer[Any], lines: anyio.AsyncFile[bytes], out: anyio.AsyncFile[str] | None = None
) -> bool:
    """Serve ``server`` over stdio, reading the client's ``lines`` (bytes, one message a line: only ``\\n`` ends
    one) and answering on ``out`` (by default stdout), refusing a message that names one member twice before the
    SDK parses it.

    The SDK's parser keeps the last of a name given twice, where the client's own may have acted on the first: the
    card would show another call than the one the client meant. The ``/mcp`` door refuses such a body; this door
    refuses such a line, with a JSON-RPC error for its request, and passes every other line on as it came.

    It ends when the client closes stdin (False), or stops reading stdout (True: an answer could not be written;
    every call open was cancelled, so withdrawn, and the read of stdin still waiting is let go)."""
    checked = _CheckedLines(lines)
    stopped_reading = False
    try:
        await _serve_lines(server, checked, out)
    except* (BrokenPipeError, ConnectionResetError):
        # The client closed its end of stdout and kept stdin open: the SDK's writer failed and ended the server
        # (each open call cancelled, and so withdrawn), but the door stayed until stdin closed, then left with a
        # traceback and exit 1. No answer can reach the client any more: it hung up.
        log.warning("mcp.client_stopped_reading", open_requests=checked.open_requests)
        stopped_reading = True
    return stopped_reading


async def _serve_lines(server: MCPServer[Any], checked: _CheckedLines, out: anyio.AsyncFile[str] | None) -> None:
    async with stdio_server(checked, out) as (read_stream, write_stream):
        # set before the SDK's reader task first runs (nothing awaited since it was started): no line is refused
        # before there is somewhere to answer it
        # The server answers through the door, which so learns which requests are still unanswered; the door's own
        # refusals go the same way, so the client reads every answer in the order it was made (a refusal no longer
        # overtakes the answer to an earlier request).
        answering, answered = anyio.create_memory_object_stream[SessionMessage](0)
        checked.out, checked.answers = write_stream, answering.clone()
        lowlevel = wire_server(server)
        async with anyio.create_task_group() as relaying:
            relaying.start_soon(checked.relay, answered)
            try:
                await lowlevel.run(read_stream, answering, lowlevel.create_initialization_options())
            finally:
                checked.answers.close()  # the relay ends once the server's stream and this one are closed
        checked.answers = write_stream  # what is abandoned is answered straight to the client
        await checked.answer_abandoned()
        await write_stream.aclose()


def wire_server(server: MCPServer[Any]) -> Server[Any]:
    """A low-level server serving ``server``'s tools through its public API, to run on streams of our own.

    MCPServer.run_stdio_async opens stdio_server() itself, with no way to hand it the checked lines, and the
    low-level server it runs on is private to it (``_lowlevel_server``; the SDK's own in-memory client reaches
    in for it, marked as a TODO to make public): an SDK upgrade could rename it and end this door. What it
    adds is rebuilt here from public calls: its name, version and instructions, its middleware chain (the same
    list), its listings, and a tool call answered as its own handler answers one (a ToolError, or any failure of
    the tool, is a result with ``isError``; an MCPError stays a JSON-RPC error)."""

    async def list_tools(ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=await server.list_tools())

    async def call_tool(
        ctx: ServerRequestContext[Any], params: CallToolRequestParams
    ) -> CallToolResult | InputRequiredResult:
        context: Context[Any, Any] = Context(request_context=ctx, mcp_server=server, input_params=params)
        try:
            return await server.call_tool(params.name, params.arguments or {}, context)
        except MCPError:
            raise
        except Exception as exc:
            if isinstance(exc, ToolError) and not isinstance(exc, UnexpectedToolError):
                # the message only: rejected argument values are the caller's data
                log.info("mcp.tool_refused", tool=params.name, error=str(exc)[:200])
            else:
                log.exception("mcp.tool_failed", tool=params.name)
            return CallToolResult(content=[TextContent(type="text", text=str(exc))], is_error=True)

    async def list_resources(
        ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None
    ) -> ListResourcesResult:
        return ListResourcesResult(resources=await server.list_resources())

    async def list_templates(
        ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None
    ) -> ListResourceTemplatesResult:
        return ListResourceTemplatesResult(resource_templates=await server.list_resource_templates())

    async def read_resource(
        ctx: ServerRequestContext[Any], params: ReadResourceRequestParams
    ) -> ReadResourceResult | InputRequiredResult:
        context: Context[Any, Any] = Context(request_context=ctx, mcp_server=server, input_params=params)
        try:
            read = await server.read_resource(params.uri, context)
        except ResourceError as exc:
            code = INVALID_PARAMS if isinstance(exc, ResourceNotFoundError) else INTERNAL_ERROR
            raise MCPError(code=code, message=str(exc), data={"uri": str(params.uri)}) from exc
        if isinstance(read, InputRequiredResult):
            return read
        contents: list[TextResourceContents | BlobResourceContents] = []
        for item in read:
            if isinstance(item.content, bytes):
                blob = base64.b64encode(item.content).decode()
                mime = item.mime_type or "application/octet-stream"
                contents.append(BlobResourceContents(uri=params.uri, blob=blob, mime_type=mime, _meta=item.meta))
            else:
                mime = item.mime_type or "text/plain"
                contents.append(
                    TextResourceContents(uri=params.uri, text=item.content, mime_type=mime, _meta=item.meta)
                )
        return ReadResourceResult(contents=contents)

    async def list_prompts(ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None) -> ListPromptsResult:
        return ListPromptsResult(prompts=await server.list_prompts())

    async def get_prompt(
        ctx: ServerRequestContext[Any], params: GetPromptRequestParams
    ) -> GetPromptResult | InputRequiredResult:
        context: Context[Any, Any] = Context(request_context=ctx, mcp_server=server, input_params=params)
        return await server.get_prompt(params.name, params.arguments, context)

    lowlevel: Server[Any] = Server(
        server.name,
        version=server.version,
        title=server.title,
        description=server.description,
        instructions=server.instructions,
        website_url=server.website_url,
        icons=server.icons,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=read_resource,
        on_list_prompts=list_prompts,
        on_get_prompt=get_prompt,
    )
    # the same chain as MCPServer's (its request-state seal first), so a message meets what it meets on /mcp
    lowlevel.middleware.extend(server.middleware)
    return lowlevel


class _CheckedLines(anyio.AsyncFile[str]):
    """The client's lines, less the ambiguous ones, each of which is answered with an error instead."""

    def __init__(self, lines: anyio.AsyncFile[bytes]) -> None:
        # The SDK takes a text file but only iterates it (our __aiter__), which reads the bytes beneath itself.
        super().__init__(cast("IO[str]", lines.wrapped))
        self._lines = lines
        self.answers: Any = None  # where the door's own answers go (in line with the server's), once it is open
        self.out: Any = None  # the SDK's write stream to the client
        self._own: set[int] = set()  # the door's own answers on their way through the relay (by object id)
        # The requests passed on and not yet answered (nor cancelled by the client), each with its method.
        self._open: dict[tuple[bool, str | int], str] = {}
        self._answered = anyio.Event()  # set (and replaced) each time one of them is answered

    @property
    def open_requests(self) -> list[str | int]:
        """The ids of the requests passed on and not yet answered."""
        return [request_id for _, request_id in self._open]

    async def __aiter__(self) -> AsyncIterator[str]:
        async for line in self._checked():
            yield line
        self.answers.close()  # no line is refused after the last: the relay may end once the server's answers do
        # EOF. The SDK's server cancels every request it holds once the lines end, and one it had not started yet
        # was never answered at all: a tools/list sent just before stdin closed was dropped without a word. What
        # the client asked is answered first, within a bound; a tools/call (request_approval) is not waited for:
        # the client that closed stdin abandoned it (MCP's stdio shutdown), so it is cancelled, which withdraws
        # what it forwarded, and answered (by the SDK, or by answer_abandoned when it never started).
        with anyio.move_on_after(WITHDRAW_TIMEOUT):
            while any(method != "tools/call" for method in self._open.values()):
                await self._answered.wait()

    async def relay(self, answered: anyio.abc.ObjectReceiveStream[SessionMessage]) -> None:
        """Pass the server's messages on to the client, noting each request answered."""
        async with answered:
            async for outgoing in answered:
                message = outgoing.message
                if id(outgoing) in self._own:  # a refusal of a line never passed on: it answers no open request
                    self._own.discard(id(outgoing))
                elif isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
                    self._settle(message.id)
                await self.out.send(outgoing)

    async def answer_abandoned(self) -> None:
        """Answer each request the server ended with unanswered as stdin closed: none is dropped without a word."""
        for (_, request_id), method in list(self._open.items()):
            log.warning("mcp.request_abandoned", request_id=request_id, method=method)
            await self._send(
                request_id,
                CONNECTION_CLOSED,
                "stdin closed before this request was answered: the client abandoned it, and nothing it asked for"
                " stays open (a request_approval is withdrawn on every card, or was never sent to Kazma)",
            )
        self._open.clear()

    def _note(self, message: JSONRPCMessage | None) -> None:
        """Note a message passed on to the server (as the check before it read it): a request waits for its answer;
        a cancellation ends the wait for the request it names (which JSON-RPC then never answers)."""
        if isinstance(message, JSONRPCRequest):
            self._open[_id_key(message.id)] = message.method
        elif isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled":
            cancelled = (message.params or {}).get("requestId")
            if isinstance(cancelled, str | int) and not isinstance(cancelled, bool):
                self._settle(cancelled)

    def _settle(self, request_id: str | int) -> None:
        if self._open.pop(_id_key(request_id), None) is not None:
            self._answered.set()
            self._answered = anyio.Event()

    async def _checked(self) -> AsyncIterator[str]:
        first = True
        async for read in _bounded_lines(self._lines):
            if isinstance(read, _TooLong):
                await self._answer_too_long(read)
                continue
            line = read.decode("utf-8", "surrogateescape")
            if first:
                # A byte order mark before the first line (PowerShell's pipes write one) says only "UTF-8", and
                # RFC 8259 lets a reader ignore it: kept, the handshake was answered as not JSON with id null and
                # the client waited for its answer for ever.
                line, first = line.removeprefix("\ufeff"), False
            # Bytes that are not UTF-8 are kept (surrogateescape) to be refused here: replaced, as the SDK reads
            # them, a Latin-1 "café" went on the card as "caf\ufffd", a call the client never sent.
            not_utf8 = _NOT_UTF8.search(line)
            if not_utf8 is not None:
                byte = ord(not_utf8.group()) - 0xDC00
                await self._answer_unreadable(
                    line, f"the line is not UTF-8 (byte 0x{byte:02x} at character {not_utf8.start()}); send UTF-8"
                )
                continue
            problem = ambiguity(line.encode("utf-8", "surrogatepass"), read_from_text=READ_FROM_TEXT)
            if problem is None:
                message = None if not line.strip() else _read_message(line)
                if isinstance(message, str):
                    await self._answer_unreadable(line, message)
                else:
                    self._note(message)
                    yield line
                continue
            # the members of the message itself, each name as often as given (an object becomes a tuple of its
            # pairs; a batch stays a list, which the SDK does not take anyway)
            try:
                members = json.loads(line, object_pairs_hook=tuple)
            except (ValueError, RecursionError) as exc:
                # The name given twice came before the line stopped being JSON (`{"id":1,"id":2} x`). Raised from
                # here, it ended the door and every call open on it; passed on, another parser might read it.
                log.warning("mcp.message_not_json", problem=problem[:200], error=str(exc)[:200])
                await self._send(None, PARSE_ERROR, f"the line is not JSON ({exc}); {problem}")
                continue
            await self._refuse(members, problem)

    async def _answer_too_long(self, line: _TooLong) -> None:
        """Answer a line longer than ``MAX_LINE_BYTES``, for the request it began (its id as far as it was read)."""
        log.warning("mcp.line_too_long", size=line.size, limit=MAX_LINE_BYTES)
        envelope = line.envelope
        # Given up on (more members than are read), an "id" may follow what was read: the line may be a request,
        # which left unanswered waits for ever, so it is answered (with id null) whatever was read before.
        told = (b"method" in envelope.kinds and not envelope.ids) or (
            b"method" not in envelope.kinds and envelope.kinds
        )
        if told and not envelope.gave_up:
            return  # a notification, or the client's answer to a request of ours: JSON-RPC answers neither
        problem = (
            f"the line is longer than the {MAX_LINE_BYTES // 1024} KiB a message may be ({line.size} bytes):"
            " send smaller arguments"
        )
        # As a line within the limit is answered: an id named twice is in doubt (the client's parser may have kept
        # the other, another request of its own), and one that is no Unicode text ("\ud800") cannot be written
        # back (the SDK's writer raised, and the door ended with every call open on it).
        request_id = _answerable_id((("id", envelope.request_id),)) if envelope.ids == 1 else None
        await self._send(request_id, INVALID_REQUEST, problem)

    async def _answer_unreadable(self, line: str, error: str) -> None:
        """Answer a line the SDK cannot read, which it would drop unanswered (its caller waiting for ever)."""
        try:
            members = json.loads(line, object_pairs_hook=tuple)
        except (ValueError, RecursionError) as exc:
            members = _read_leniently(line)
            if members is None:
                log.warning("mcp.message_not_json", error=str(exc)[:200])
                await self._send(None, PARSE_ERROR, f"the line is not JSON ({exc})")
                return
            # What stopped Python's parser is one of its own strict rules, read around: a request whose id is
            # known is answered for it (with id null, its caller waited for ever), saying what to send instead.
            if isinstance(exc, json.JSONDecodeError):
                found = line[exc.pos] if 0 <= exc.pos < len(line) else "\x00"
                problem = (
                    f"the line is not JSON: a control character (U+{ord(found):04X}) at character {exc.pos} is"
                    f" inside a string; write it as an escape (\\u{ord(found):04x})"
                )
                await self._refuse(members, problem, unreadable=True, code=PARSE_ERROR)
            else:  # Python's int-string limit (CVE-2020-10735), which JSON itself does not have
                limit = sys.get_int_max_str_digits()
                problem = f"the message cannot be read: a number with more than {limit} digits cannot be read"
                await self._refuse(members, f"{problem}; send it as a string", unreadable=True)
            return
        await self._refuse(members, f"the message cannot be read: {error}", unreadable=True)

    async def _refuse(
        self, members: Any, problem: str, *, unreadable: bool = False, code: int = INVALID_REQUEST
    ) -> None:
        if unreadable:  # event names stay literals (tests/test_log_events.py): one for each kind of refusal
            log.warning("mcp.message_unreadable", problem=problem[:200])
        else:
            log.warning("mcp.message_ambiguous", problem=problem[:200])
        if isinstance(members, list):
            # A JSON-RPC batch (MCP 2025-03-26 allowed them; the SDK reads none): dropped unanswered, each request in
            # it waited for ever. Each is answered for its id; an empty one, as JSON-RPC says, with id null.
            batch = f"{problem}; a batch (a JSON array) is not taken: send each message on its own line"
            requests = [member for member in members if isinstance(member, tuple) and _asks(member)]
            for request in requests:
                await self._send(_answerable_id(request), code, batch)
            if not members:
                await self._send(None, code, problem)
            return
        if not isinstance(members, tuple):
            # a JSON text that is no object ("hi", 5, null): no request the client could tell from a notification,
            # answered as JSON-RPC answers an invalid request, with id null
            await self._send(None, code, problem)
            return
        if not _asks(members):
            return  # a notification (or a response): JSON-RPC answers neither; said in the log, never forwarded
        await self._send(_answerable_id(members), code, problem)

    async def _send(self, request_id: str | int | None, code: int, message: str) -> None:
        refused = SessionMessage(
            JSONRPCError(jsonrpc="2.0", id=request_id, error=ErrorData(code=code, message=message))
        )
        if self.answers is not self.out:
            self._own.add(id(refused))
        await self.answers.send(refused)


@dataclass(frozen=True)
class _TooLong:
    """A line longer than ``MAX_LINE_BYTES``: its size as far as it was read, and its top level read in passing."""

    size: int
    envelope: Envelope


async def _bounded_lines(source: anyio.AsyncFile[bytes]) -> AsyncIterator[bytes | _TooLong]:
    """The lines of ``source`` (without their ``\\n``), each at most ``MAX_LINE_BYTES``; a longer one is let go
    as it arrives, only its top level read (for its id), and given as :class:`_TooLong`.

    Only ``\\n`` ends a line, as MCP's stdio transport says. A text reader in universal-newline mode (the SDK's,
    and this door's before) also ended one at a bare ``\\r``, which JSON reads as whitespace: a client's one
    call ``{…"env":"prod"…,"x":\\r{…"env":"staging"…}\\r}`` became three lines, the middle one a call of its
    own, and the card showed env=staging."""
    kept = bytearray()
    over: Envelope | None = None
    size = 0
    # One byte more is held than a message may be: the CR of a CRLF is no part of the message, so a message of
    # exactly the limit ending in CRLF is served as the same one ending in LF is.
    held = MAX_LINE_BYTES + 1
    # A read let go when the door ends without stdin having closed (the client stopped reading stdout): the read
    # cannot be interrupted, and waited for, it held the door until the client closed stdin.
    read1 = cast("io.BufferedIOBase", source.wrapped).read1
    while chunk := await anyio.to_thread.run_sync(read1, _READ_CHUNK, abandon_on_cancel=True):
        start = 0
        while True:
            newline = chunk.find(b"\n", start)
            piece = memoryview(chunk)[start : len(chunk) if newline < 0 else newline]
            if over is None and len(kept) + len(piece) > held:
                over, size = Envelope(), len(kept)
                over.feed(kept)
                kept = bytearray()  # let go now, not at the newline
            if over is None:
                kept += piece
            else:
                over.feed(piece)
                size += len(piece)
            if newline < 0:
                break
            yield _line_read(kept, over, size, ended=True)
            kept, over, start = bytearray(), None, newline + 1
    if over is not None or kept:
        yield _line_read(kept, over, size, ended=False)


def _line_read(kept: bytearray, over: Envelope | None, size: int, *, ended: bool) -> bytes | _TooLong:
    """One line as :func:`_bounded_lines` gives it: ``kept`` whole, or a :class:`_TooLong` when it was let go
    (``over``) or is one byte over the limit without being a message of the limit and the CR of its CRLF."""
    if over is not None:
        return _TooLong(size, over)
    if len(kept) > MAX_LINE_BYTES and not (ended and kept.endswith(b"\r")):
        envelope = Envelope()
        envelope.feed(kept)
        return _TooLong(len(kept), envelope)
    return bytes(kept)


def _id_key(request_id: str | int) -> tuple[bool, str | int]:
    """A request id as a key: ``1`` and ``"1"`` are two requests."""
    return isinstance(request_id, str), request_id


def _asks(members: tuple[tuple[str, Any], ...]) -> bool:
    """Whether a message's ``members`` (its name-value pairs) make a request, which JSON-RPC answers."""
    names = [name for name, _ in members]
    return "method" in names and "id" in names


def _answerable_id(members: tuple[tuple[str, Any], ...]) -> str | int | None:
    """The id to answer a request with: its own, or null when it is in doubt or not one JSON-RPC allows."""
    ids = [value for name, value in members if name == "id"]
    if len(ids) != 1 or not isinstance(ids[0], str | int) or isinstance(ids[0], bool):
        return None
    if isinstance(ids[0], str) and _SURROGATE.search(ids[0]):
        return None  # an id that is not Unicode text cannot be written back
    return ids[0]


class _Unread:
    """An integer too long for Python's int-string limit, read only to answer the message it is in."""


def _read_leniently(line: str) -> Any:
    """``line`` read past Python's parser's own strict rules (a raw control character in a string, an integer
    past its int-string limit, which becomes an :class:`_Unread`), or None when it is not JSON even so. Only to
    answer a line that is refused: never passed on."""
    try:
        return json.loads(line, strict=False, parse_int=_int_or_unread, object_pairs_hook=tuple)
    except (ValueError, RecursionError):
        return None


def _int_or_unread(text: str) -> int | _Unread:
    try:
        return int(text)
    except ValueError:
        return _Unread()  # never an id to answer with: the client's was a number, not this


def _read_message(line: str) -> JSONRPCMessage | str:
    """``line`` as the SDK's reader reads it, or why it cannot (one read: the door notes what it passes on)."""
    try:
        return jsonrpc_message_adapter.validate_json(line, by_name=False)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        # the first reason only, without the values (they are the caller's data, and may be huge)
        first = errors[0] if errors else {"msg": str(exc)}
        where = ".".join(str(part) for part in first.get("loc", ()))
        return f"{first['msg']}" + (f" (at {where})" if where else "")


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as surrogateescape keeps it
_SURROGATE = re.compile("[\ud800-\udfff]")


async def _poll(client: Any, found: dict[str, Any]) -> dict[str, Any]:
    """Ask for the answer until there is one; a Kazma that does not answer for a while (a restart) is asked
    again, for up to ``POLL_RETRY_SECONDS`` in a row."""
    import httpx

    failing_since: float | None = None
    loop = asyncio.get_running_loop()
    while found["status"] == "pending":
        try:
            polled = await client.get(f"/api/v1/approvals/{found['id']}", params={"wait": "30"})
        except httpx.TransportError as exc:
            problem = str(exc) or type(exc).__name__
        else:
            if polled.status_code < 400:
                found = polled.json()
                failing_since = None
                continue
            if polled.status_code not in (502, 503, 504):
                raise ToolError(f"Kazma answered HTTP {polled.status_code}: {polled.text[:500]}")
            problem = f"HTTP {polled.status_code}"
        now = loop.time()
        failing_since = now if failing_since is None else failing_since
        if now - failing_since > POLL_RETRY_SECONDS:
            raise ToolError(f"Kazma stopped answering ({problem}); the request is withdrawn when it is back")
        await asyncio.sleep(1.0)
    return found


async def _withdraw_remote(client: Any, request_id: str, why: Gone) -> None:
    """Tell Kazma the asker is gone (``DELETE …?why=``); best effort: if it cannot be told, it withdraws the
    request itself once nobody asks about it."""
    word = {Gone.INTERRUPTED: "interrupted", Gone.DISCONNECTED: "disconnected"}.get(why, "cancelled")
    try:
        await client.delete(f"/api/v1/approvals/{request_id}", params={"why": word}, timeout=WITHDRAW_TIMEOUT)
    except Exception as exc:
        log.warning("mcp.withdraw_failed", request_id=request_id, why=why.value, error=str(exc))


def _stopped_reading(answers_wire: int) -> bool:
    """Whether the MCP client closed its end of our stdout (``answers_wire``, a copy of it): no answer reaches it."""
    # no event asked: an error (the reader gone) is reported all the same
    return _polled(answers_wire, 0, select.POLLERR | select.POLLHUP)


def _hung_up(wire: int) -> bool:
    """Whether the MCP client closed our stdin (``wire``, a copy of it), as opposed to cancelling one call."""
    return _polled(wire, select.POLLIN, select.POLLHUP | select.POLLERR | select.POLLNVAL)


def _polled(fd: int, asked: int, ended: int) -> bool:
    """Whether polling ``fd`` for ``asked`` at once reports any of ``ended`` (False when it cannot be polled)."""
    try:
        poller = select.poll()
        poller.register(fd, asked)
        return any(event & ended for _, event in poller.poll(0))
    except (OSError, ValueError):
        return False
