"""The stdio transport for Kazma's MCP servers: one message per line, and never more than a bound of one read.

The SDK's own stdio client keeps every byte of a line until its newline comes,
so a server answering 10 MB costs Kazma that many bytes several times over
(text, then parsed objects) before the result is cut to ``max_output_chars``.
Here a line longer than ``max_message_bytes`` is cut while it arrives: its
bytes are dropped as they come, and only enough of it is looked at — with
:class:`Envelope`, which keeps a few bytes of state — to learn the id of the
request it answers. That request then ends at once with an error saying the
answer was cut off unread (a JSON-RPC error only Kazma makes,
:data:`CUT_CODE`), and the connection goes on with the next line. A cut line
that is not an answer (the server's own request, a notification) is dropped
and logged. A cut line whose id is in doubt (more top-level members than a
JSON-RPC message has, or ``id`` named twice) may answer any request: every
request in flight to that server ends at once with the same kind of error,
rather than the one it answered waiting for its call's timeout.

The server's stderr is kept only as a short tail, for saying why a server
that died did so. The process gets exactly the environment and working
directory its :class:`~kazma.engine.tools.mcp_launch.Launch` says, and its own
process group; when the connection ends, its stdin is closed, and a server
that has not left within a grace period is terminated, then killed.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import operator
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import structlog

from kazma.config.metrics import count_failure
from kazma.engine.tools.mcp_launch import Launch

if TYPE_CHECKING:
    from anyio.abc import Process
    from mcp.client._transport import TransportStreams
    from mcp.shared.message import SessionMessage

__all__ = ["CUT_CODE", "Envelope", "LineCutter", "Oversize", "StderrTail", "bounded_stdio_client"]

log = structlog.get_logger("kazma.engine.mcp")

CUT_CODE = -32001  # in JSON-RPC's range for implementation-defined server errors
_EXIT_GRACE_S = 2.0
_KILL_GRACE_S = 2.0
_READ_CHUNK = 64 * 1024

RequestId = int | str


# --------------------------------------------------------------------------- what a cut line was


_STRING_STOP = re.compile(rb'["\\]')
# A string's body up to its closing quote, escapes and all, or to the end of what was read: one C search however
# long it is (a lone backslash at the end of a read stops it, to be taken with the next read)
_STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
# Nested content is looked at this much at a time: a return to the top level (at most _MAX_TOKENS of them) looks
# past itself by no more than this, so the whole line is looked at a bounded number of times.
_WINDOW = 64 * 1024
# Every bracket as a base-4 digit (an opening one 1, a closing one 2, anything else 0), so that int() packs four
# bytes into one (in C: base 4 is a power of two, free of the int-string limit) to be judged by the tables below.
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(set(range(256)) - set(b"[]{}"))
_AS_DIGITS = bytes(ord("1") if c in b"[{" else ord("2") if c in b"]}" else ord("0") for c in range(256))


def _quad_tables() -> tuple[bytes, bytes]:
    """For each packed byte (four brackets or others, the first in its top bits): its change of depth and the
    lowest it takes the depth to (0 or below), each plus 4 to be a byte."""
    change, lowest = bytearray(256), bytearray(256)
    for packed in range(256):
        depth = low = 0
        for shift in (6, 4, 2, 0):
            digit = (packed >> shift) & 3
            depth += 1 if digit == 1 else -1 if digit == 2 else 0
            low = min(low, depth)
        change[packed], lowest[packed] = depth + 4, low + 4
    return bytes(change), bytes(lowest)


_QUAD_CHANGE, _QUAD_LOWEST = _quad_tables()
_MAX_MEMBERS = 64  # a JSON-RPC message has a handful at its top level: past this many, its id is in doubt
# and a handful of tokens (key, colon, value, comma) per member: more is not a JSON-RPC message (``"" "" ""…``,
# ``::::…`` at the top level, each a Python step) and its id is in doubt too
_MAX_TOKENS = 4 * _MAX_MEMBERS + 8
_SIGNIFICANT = re.compile(rb"[^ \t\r\n]")
_LITERAL_END = re.compile(rb'[ \t\r\n,}\]:"{\[]')
_MAX_CAPTURE = 256  # an id or key longer than this is not one Kazma sent
_KINDS = (b"result", b"error", b"method")


class Envelope:
    """The top level of one JSON-RPC message, read incrementally: its ``id`` and which of result/error/method it has.

    Only the outermost object's keys are looked at; everything nested inside
    (the megabytes of a result) is skipped by searching for the next quote or
    bracket, strings by their closing quote. Malformed input never raises: the
    id just stays unknown.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = False
        self._capture: bytearray | None = None  # the key or id string being read
        self._capturing_id = False
        self._literal: bytearray | None = None  # a number (or other bare word) given as the id
        self._skipping = False  # in a bare word that is not the id
        self._key = b""
        self._value_of: bytes | None = None  # the key whose value comes next
        self._done = False
        self._members = 0
        self._tokens = 0
        # gave up reading (more top-level members than any JSON-RPC message has): the id is in doubt
        self.gave_up = False
        self.id_bytes: bytes | None = None  # the id as written (a JSON string with its quotes, or a number)
        # how often the top level names "id": more than once, which of them the sender's parser kept is in doubt
        self.ids = 0
        self.kinds: set[bytes] = set()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        i, n = 0, len(view)
        while i < n and not self._done:
            if self._escape:
                self._keep(view[i : i + 1])
                self._escape = False
                i += 1
            elif self._in_string:
                i = self._string(view, i, n)
            elif self._literal is not None:
                i = self._bare(view, i, n)
            elif self._skipping:
                found = _LITERAL_END.search(view, i)
                if found is None:
                    return
                self._skipping = False
                i = found.start()
            elif self._depth >= 2:
                i = self._skip_nested(view, i, n)
            else:
                found = _SIGNIFICANT.search(view, i)
                if found is None:
                    return
                i = found.end()
                self._top(view[found.start()])

    @property
    def request_id(self) -> RequestId | None:
        """The id, once it has been read whole and is a JSON-RPC id (an integer or a string)."""
        if self.id_bytes is None or self.gave_up:
            return None
        try:
            value = json.loads(self.id_bytes)
        except ValueError:
            return None
        return value if isinstance(value, int | str) and not isinstance(value, bool) else None

    @property
    def in_doubt(self) -> bool:
        """Whether which request this message answers (if any) cannot be told: it was given up on (more top-level
        members or tokens than a JSON-RPC message has), or it names ``id`` more than once and is no request."""
        return self.gave_up or (self.ids > 1 and b"method" not in self.kinds)

    @property
    def answers(self) -> RequestId | None:
        """The id of the request this message answers: set once it has an id and a result or error, no method."""
        if b"method" in self.kinds or not (self.kinds & {b"result", b"error"}):
            return None
        return self.request_id

    def _keep(self, piece: memoryview) -> None:
        if self._capture is not None:
            if len(self._capture) + len(piece) > _MAX_CAPTURE:
                self._capture = None
                self._capturing_id = False
            else:
                self._capture += piece

    def _skip_nested(self, view: memoryview, i: int, n: int) -> int:
        """Skip nested content from ``i``: to where it returns to the top level, or to a string not closed within
        the window looked at (then read as a string), or to the end of that window.

        Counted with bytes methods over the whole window, in C: a Python step per bracket or string held the
        event loop about half a second per MiB (50 MiB of ``"``, or megabytes of ``[[…]]`` closing within one read).
        """
        end = min(n, i + _WINDOW)
        # Escaped backslashes and quotes made two bytes that are neither (the same length, so places still match):
        # every quote left opens or closes a string, and the pieces between them alternate outside and inside.
        text = view[i:end].tobytes().replace(b"\\\\", b"__").replace(b'\\"', b"__")
        pieces = text.split(b'"')
        outside = b"".join(pieces[0::2])
        closes = outside.count(b"]") + outside.count(b"}")
        change = outside.count(b"[") + outside.count(b"{") - closes
        back = None if not _may_come_back(outside, self._depth, closes) else _first_return(outside, self._depth)
        if back is not None:
            self._depth = 1
            return i + _place_in(pieces, back) + 1
        self._depth += change
        if len(pieces) % 2:  # every string opened here closed here
            return end
        self._in_string = True  # a string that goes on past this window
        return i + text.rfind(b'"') + 1

    def _string(self, view: memoryview, i: int, n: int) -> int:
        if self._capture is None:  # nothing kept: the body is skipped whole, escapes and all
            body = _STRING_BODY.match(view, i)
            end = n if body is None else body.end()
            if end >= n:
                return n
            if view[end] == ord("\\"):  # the last byte read, its escaped byte still to come
                self._escape = True
                return n
            self._in_string = False
            self._string_ended()
            return end + 1
        found = _STRING_STOP.search(view, i)
        end = n if found is None else found.start()
        self._keep(view[i:end])
        if found is None:
            return n
        if view[end] == ord("\\"):
            self._keep(view[end : end + 1])
            self._escape = True
            return end + 1
        self._in_string = False
        self._string_ended()
        return end + 1

    def _string_ended(self) -> None:
        captured, self._capture = self._capture, None
        if self._capturing_id:
            self._capturing_id = False
            if captured is not None:
                self.id_bytes = b'"' + bytes(captured) + b'"'
        elif self._expect_key:
            self._expect_key = False
            self._key = _key_name(captured)
            if self._key in _KINDS:
                self.kinds.add(self._key)

    def _bare(self, view: memoryview, i: int, n: int) -> int:
        assert self._literal is not None
        found = _LITERAL_END.search(view, i)
        end = n if found is None else found.start()
        if len(self._literal) + (end - i) > _MAX_CAPTURE:
            self._literal = None
            return end
        self._literal += view[i:end]
        if found is not None:
            self.id_bytes = bytes(self._literal)
            self._literal = None
        return end

    def _top(self, byte: int) -> None:
        self._tokens += 1
        if self._tokens > _MAX_TOKENS:
            self.gave_up = self._done = True
            return
        if self._depth == 0:
            if byte == ord("{"):
                self._depth, self._expect_key = 1, True
            else:
                self._done = True  # not an object: nothing to learn
            return
        value_of, self._value_of = self._value_of, None
        if byte == ord('"'):
            self._in_string = True
            if self._expect_key:
                self._capture = bytearray()
            elif value_of == b"id":
                self._capture, self._capturing_id = bytearray(), True
        elif byte == ord(":"):
            self._value_of = self._key
            if self._key == b"id":
                self.ids += 1
        elif byte == ord(","):
            self._expect_key = True
            self._members += 1
            if self._members >= _MAX_MEMBERS:
                self.gave_up = self._done = True
        elif byte in (ord("{"), ord("[")):
            self._depth += 1
        elif byte == ord("}"):
            self._done = True
        elif value_of == b"id":
            self._literal = bytearray([byte])
        else:  # a bare word (a number, true) not kept: skipped whole, not a step per byte
            self._skipping = True


def _may_come_back(outside: bytes, depth: int, closes: int) -> bool:
    """Whether nesting at ``depth`` may come back to the top level within ``outside``, which closes ``closes``."""
    if depth - closes >= 2:
        return False
    # A pair opened and closed at once never takes the depth lower than it was before it: dropped (a few passes,
    # in C), what is left often cannot come back (``[][]…``, ``][][…`` one level down), and is not looked at further.
    brackets = outside.translate(_AS_SQUARE, _NOT_BRACKET)
    for _ in range(4):
        fewer = brackets.replace(b"[]", b"")
        if len(fewer) == len(brackets):
            break
        brackets = fewer
    return depth - brackets.count(b"]") < 2


def _first_return(outside: bytes, depth: int) -> int | None:
    """Where in ``outside`` (nested content, strings taken out) the nesting at ``depth`` first comes back to the
    top level (depth 1): the place of that closing bracket, or None. A step per four bytes, all of them in C."""
    if not outside:
        return None
    digits = outside.translate(_AS_DIGITS) + b"0" * (-len(outside) % 4)
    packed = int(digits, 4).to_bytes(len(digits) // 4, "big")
    changes = packed.translate(_QUAD_CHANGE)
    # Before packed byte j the depth is depth + sum(changes[:j]) - 4j; within it, it goes as low as that plus
    # lowest[j] - 4. The first that reaches 1 (by steps of one, so it is 1 there) holds the return.
    lows = map(operator.add, itertools.accumulate(changes, initial=0), packed.translate(_QUAD_LOWEST))
    reached = itertools.compress(itertools.count(), map(operator.le, lows, itertools.count(5 - depth, 4)))
    quad = next(reached, None)
    if quad is None:
        return None
    depth += sum(changes[:quad]) - 4 * quad
    for at in range(4 * quad, min(4 * quad + 4, len(outside))):
        depth += {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}.get(outside[at], 0)
        if depth == 1:
            return at
    raise AssertionError("the packed byte said the depth came back within it")


def _place_in(pieces: list[bytes], at: int) -> int:
    """Where ``at``, a place in the outside pieces of ``pieces`` (split at quotes) joined, is in the whole."""
    ends = list(itertools.accumulate(map(len, pieces[0::2])))
    piece = bisect.bisect_right(ends, at)
    # before outside piece j: j outside pieces (at counts those), j inside ones and 2j quotes
    return at + sum(map(len, pieces[1 : 2 * piece : 2])) + 2 * piece


def _key_name(raw: bytearray | None) -> bytes:
    """A top-level key as a JSON parser reads it: one written with escapes (``"\\u0069d"``) is still ``id``."""
    if raw is None:
        return b""
    if b"\\" not in raw:
        return bytes(raw)
    try:
        name = json.loads((b'"' + raw + b'"').decode("utf-8"))
    except ValueError:
        return bytes(raw)
    return str(name).encode("utf-8", "surrogatepass")


# --------------------------------------------------------------------------- lines, bounded


@dataclass(frozen=True)
class Oversize:
    """A line longer than the bound: ``answer`` says to end the request ``reply_to`` now (once per line), or, when
    ``in_doubt``, every request in flight (which one it answers cannot be told)."""

    size: int  # bytes of the line seen so far (all of it when ``ended``)
    ended: bool
    reply_to: RequestId | None
    answer: bool
    in_doubt: bool = False


class LineCutter:
    """Splits a byte stream into lines, keeping at most ``limit`` bytes of any one line."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._over: Envelope | None = None
        self._over_size = 0
        self._answered = False

    def feed(self, chunk: bytes) -> Iterator[bytes | Oversize]:
        """Whole lines (without their newline; blank ones skipped) and news of cut lines, in order."""
        start, n = 0, len(chunk)
        while start <= n:
            newline = chunk.find(b"\n", start)
            end = n if newline < 0 else newline
            yield from self._take(memoryview(chunk)[start:end])
            if newline < 0:
                return
            yield from self._end_line()
            start = newline + 1

    def _take(self, piece: memoryview) -> Iterator[Oversize]:
        if not piece:
            return
        if self._over is None:
            if len(self._buffer) + len(piece) <= self.limit:
                self._buffer += piece
                return
            self._over, self._over_size, self._answered = Envelope(), len(self._buffer), False
            self._over.feed(self._buffer)
            self._buffer = bytearray()  # the bytes kept so far are let go now, not at the newline
        self._over.feed(piece)
        self._over_size += len(piece)
        if self._answered:
            return
        # Given up on, nothing more will be learned of it: said at once. Naming its id twice is known at its end.
        if self._over.gave_up:
            self._answered = True
            yield Oversize(self._over_size, ended=False, reply_to=None, answer=True, in_doubt=True)
            return
        reply_to = self._over.answers
        if reply_to is not None:
            self._answered = True
            yield Oversize(self._over_size, ended=False, reply_to=reply_to, answer=True)

    def _end_line(self) -> Iterator[bytes | Oversize]:
        if self._over is not None:
            over, self._over = self._over, None
            reply_to = None if over.in_doubt else over.answers
            # an id named twice: the one answered already may not be the one meant, so the rest in flight end too
            in_doubt = over.in_doubt and (not self._answered or not over.gave_up)
            answer = in_doubt or (reply_to is not None and not self._answered)
            yield Oversize(self._over_size, ended=True, reply_to=reply_to, answer=answer, in_doubt=in_doubt)
            return
        line, self._buffer = bytes(self._buffer), bytearray()
        if line.strip():
            yield line


# --------------------------------------------------------------------------- the server's stderr


class StderrTail:
    """The last bytes a server wrote to stderr, shown (escaped, one line) when it fails."""

    def __init__(self, keep: int = 2048) -> None:
        self.keep = keep
        self._data = bytearray()

    def add(self, chunk: bytes) -> None:
        self._data += chunk
        del self._data[: max(0, len(self._data) - self.keep)]

    def last_line(self, limit: int = 300) -> str:
        """The last non-empty line, with every control character escaped (it is the server's text, not ours)."""
        lines = [line for line in bytes(self._data).decode("utf-8", errors="replace").splitlines() if line.strip()]
        if not lines:
            return ""
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in lines[-1].strip())
        return text[:limit]


# --------------------------------------------------------------------------- the transport


@asynccontextmanager
async def bounded_stdio_client(
    launch: Launch, *, server: str, max_message_bytes: int, stderr: StderrTail | None = None
) -> AsyncIterator[TransportStreams]:
    """Start ``launch`` and yield the (read, write) streams a ``ClientSession`` takes."""
    import mcp_types
    from mcp.shared.message import SessionMessage

    process = await anyio.open_process(
        launch.argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(launch.cwd),
        env=launch.env,
        start_new_session=True,
    )
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    tail = stderr if stderr is not None else StderrTail()
    # Kazma's requests the server has not answered yet, by the id the SDK matches answers with ("7" is 7): what a
    # cut message whose id is in doubt may have answered.
    in_flight: dict[RequestId, RequestId] = {}

    def cut_answer(reply_to: RequestId, message: str) -> SessionMessage:
        in_flight.pop(_matched_as(reply_to), None)
        said = mcp_types.ErrorData(code=CUT_CODE, message=message)
        return SessionMessage(mcp_types.JSONRPCError(jsonrpc="2.0", id=reply_to, error=said))

    async def end_in_flight(size: int) -> None:
        """A message over the bound whose id cannot be read may answer any request in flight: left waiting, the
        one it answered would wait for its call's timeout, so every one of them ends now, saying why."""
        ended = list(in_flight.values())
        count_failure("mcp_answer_in_doubt", server)
        log.warning("mcp.answer_in_doubt", server=server, bytes=size, limit=max_message_bytes, ended=ended)
        for request_id in ended:
            await read_writer.send(
                cut_answer(
                    request_id,
                    f"the MCP server {server!r} sent a message longer than {max_message_bytes} bytes "
                    f"(mcp_servers.{server}.max_message_bytes; {size} bytes read) that names no one request "
                    "Kazma can tell, so Kazma cut it off unread and ended every request in flight to that server",
                )
            )

    async def deliver(event: bytes | Oversize) -> None:
        if isinstance(event, Oversize):
            if event.answer and event.in_doubt:
                await end_in_flight(event.size)
            elif event.answer and event.reply_to is not None:
                await read_writer.send(
                    cut_answer(
                        event.reply_to,
                        f"the server's answer was longer than {max_message_bytes} bytes "
                        f"(mcp_servers.{server}.max_message_bytes); Kazma cut it off unread",
                    )
                )
            if event.ended:
                count_failure("mcp_message_cut", server)
                log.warning(
                    "mcp.message_cut",
                    server=server,
                    bytes=event.size,
                    limit=max_message_bytes,
                    answered=event.reply_to,
                )
            return
        try:
            message = mcp_types.jsonrpc_message_adapter.validate_json(event, by_name=False)
        except ValueError as exc:
            count_failure("mcp_bad_message", server)
            log.warning("mcp.bad_message", server=server, bytes=len(event), error=str(exc)[:300])
            await read_writer.send(exc)
            return
        if isinstance(message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError) and message.id is not None:
            in_flight.pop(_matched_as(message.id), None)
        await read_writer.send(SessionMessage(message))

    async def read_stdout() -> None:
        assert process.stdout is not None
        lines = LineCutter(max_message_bytes)
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            async with read_writer:
                while True:
                    try:
                        chunk = await process.stdout.receive(_READ_CHUNK)
                    except anyio.EndOfStream:
                        return
                    for event in lines.feed(chunk):
                        await deliver(event)

    async def read_stderr() -> None:
        assert process.stderr is not None
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            while True:
                tail.add(await process.stderr.receive(_READ_CHUNK))

    async def write_stdin() -> None:
        assert process.stdin is not None
        try:
            async with write_reader:
                async for outgoing in write_reader:
                    sent = outgoing.message
                    if isinstance(sent, mcp_types.JSONRPCRequest):
                        in_flight[_matched_as(sent.id)] = sent.id
                    elif isinstance(sent, mcp_types.JSONRPCNotification) and sent.method == "notifications/cancelled":
                        # a request given up on is answered by no one (so the protocol says): no longer in flight
                        cancelled = (sent.params or {}).get("requestId")
                        if isinstance(cancelled, int | str):
                            in_flight.pop(_matched_as(cancelled), None)
                    text = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send(text.encode("utf-8") + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()  # the session sees the end instead of waiting for an answer

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(read_stdout)
        tasks.start_soon(read_stderr)
        tasks.start_soon(write_stdin)
        try:
            yield read_stream, write_stream
        finally:
            # Shielded: a cancelled caller must still leave no server behind; every wait inside is bounded.
            with anyio.CancelScope(shield=True):
                await _stop(process)
                for stream in (read_stream, write_stream, read_writer, write_reader):
                    await stream.aclose()
            tasks.cancel_scope.cancel()


def _matched_as(request_id: RequestId) -> RequestId:
    """An id as the SDK matches answers to requests: a string of an integer is that integer."""
    if isinstance(request_id, str):
        with contextlib.suppress(ValueError):
            return int(request_id)
    return request_id


async def _stop(process: Process) -> None:
    """Close stdin, give the server a moment to leave, then terminate and kill its whole process group."""
    if process.returncode is None and process.stdin is not None:
        with contextlib.suppress(OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await process.stdin.aclose()
    for sig, grace in ((None, _EXIT_GRACE_S), (signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, _KILL_GRACE_S)):
        if process.returncode is not None:
            break
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        with anyio.move_on_after(grace):
            await process.wait()
    if process.returncode is None:
        log.warning("mcp.server_unkillable", pid=process.pid)
        return
    # A server that left on its own (stdin closed) may have left children in its group (``sleep &``): killed too,
    # as the shell's are. Its pid is not handed out again while that group still has a member, so this reaches
    # only what is left of it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        await process.aclose()
