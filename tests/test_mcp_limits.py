"""What an MCP server can send Kazma: answers bounded while they arrive, and tool names that never collide.

Real SDK servers (tests/mcp_servers/spy.py) on stdio and streamable HTTP; memory is the test process's own,
read from /proc/self/status (its peak reset through /proc/self/clear_refs before the call).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kazma.config.metrics import failure_count
from kazma.config.models import MCPServerConfig
from kazma.engine.tools.mcp_stdio import Envelope, LineCutter, Oversize
from kazma.engine.tools.mcp_tools import MCPConnection
from tests.mcp_support import mcp_server_over_http

SPY = Path(__file__).resolve().parent / "mcp_servers" / "spy.py"
RAW_NUMBERS = Path(__file__).resolve().parent / "mcp_servers" / "raw_numbers.py"
CROWDED = Path(__file__).resolve().parent / "mcp_servers" / "crowded.py"
BIG_PONG = Path(__file__).resolve().parent / "mcp_servers" / "big_pong.py"
TEN_MB = 10_000_000
MB = 1024 * 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; return that (kB)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here ({exc})")
    return _status_kb("VmRSS")


@asynccontextmanager
async def _running(config: MCPServerConfig, *, ping_interval: float = 5.0) -> AsyncIterator[MCPConnection]:
    connection = MCPConnection("spy", config, ping_interval=ping_interval)
    connection.start()
    try:
        assert await connection.wait_ready(60), connection.problem
        yield connection
    finally:
        await connection.stop()


async def _flood_costs(connection: MCPConnection) -> tuple[Any, float]:
    """Call flood(10 MB); return the result and how much the peak RSS grew, in MB."""
    warm = await connection.call("flood", {"size": 1000})  # first-call allocations out of the measurement
    assert warm.ok, warm.error
    before = _reset_peak()
    result = await connection.call("flood", {"size": TEN_MB})
    grown = (_status_kb("VmHWM") - before) / 1024
    return result, grown


async def test_a_10_mb_stdio_answer_is_cut_while_it_arrives(tmp_path: Path) -> None:
    config = MCPServerConfig(command=sys.executable, args=[str(SPY)], call_timeout_seconds=120)
    async with _running(config) as connection:
        result, grown = await _flood_costs(connection)
        assert grown < 40, f"the peak RSS grew by {grown:.0f} MB for a 10 MB answer"
        assert not result.ok
        assert result.truncated
        assert "longer than 4194304 bytes" in (result.error or ""), result.error
        assert "mcp_servers.spy.max_message_bytes" in (result.error or "")
        # the connection carries on: the next call is answered by the same server
        after = await connection.call("flood", {"size": 10})
        assert after.ok
        assert after.output == "x" * 10
        assert connection.starts == 1


@pytest.mark.parametrize("answered_with", [(), ("sse",)], ids=["json", "events"])
async def test_a_10_mb_http_answer_is_cut_while_it_arrives(answered_with: tuple[str, ...]) -> None:
    """Over HTTP as over stdio: the call's answer (one JSON body, or one server-sent event) is cut at
    max_message_bytes while it arrives, and the call is said to have run with its outcome unknown. It was said to
    have "failed" (a JSON parse error, or "SSE stream failed"), so its execution was recorded as failed, not as
    one that may have acted; the event's error did not name the bound at all."""
    async with (
        mcp_server_over_http(SPY, *answered_with) as url,
        _running(MCPServerConfig(url=url, call_timeout_seconds=120)) as connection,
    ):
        result, grown = await _flood_costs(connection)
        assert grown < 40, f"the peak RSS grew by {grown:.0f} MB for a 10 MB answer"
        assert not result.ok
        assert "longer than 4194304 bytes" in (result.error or ""), result.error
        assert "mcp_servers.spy.max_message_bytes" in (result.error or ""), result.error
        assert result.outcome_unknown
        assert result.truncated
        after = await connection.call("flood", {"size": 10})
        assert after.ok
        assert after.output == "x" * 10


async def test_attack_an_answer_over_the_bound_whose_id_is_in_doubt_ends_every_call_in_flight_at_once() -> None:
    """An answer over the bound whose id came after more top-level members than the envelope reads (64) was cut
    off answering nothing: the call it answered waited for its timeout (the server restarted then), and so did
    every other call to that server. Now every request in flight ends at once with an error naming the server
    and the size, counted; the connection goes on."""
    config = MCPServerConfig(
        command=sys.executable, args=[str(CROWDED)], max_message_bytes=65536, call_timeout_seconds=20
    )
    before = failure_count("mcp_answer_in_doubt", "spy")
    # no ping in flight meanwhile: it would be ended too (and, being cut, not restart the connection)
    async with _running(config, ping_interval=3600) as connection:
        held = asyncio.create_task(connection.call("hold", {}))
        crowded = await connection.call("crowded", {})
        other = await held
        after = await connection.call("small", {})
        starts = connection.starts
    for result in (crowded, other):
        assert not result.ok
        assert result.outcome_unknown
        assert "timed out" not in (result.error or ""), result.error
        assert "MCP server 'spy' sent a message longer than 65536 bytes" in (result.error or ""), result.error
        assert "ended every request in flight" in (result.error or "")
    assert after.ok
    assert after.output == "small"
    assert starts == 1
    assert failure_count("mcp_answer_in_doubt", "spy") == before + 1


async def test_attack_a_ping_answered_over_the_bound_does_not_restart_the_server() -> None:
    """A ping whose answer Kazma cut off unread (over the bound; or ended with every request in flight when a cut
    message's id is in doubt) failed the ping, and the connection was dropped and the server restarted: its other
    calls were cut off, its tools refused calls meanwhile. A cut answer is the server talking: the ping is only
    there to find a server that stopped, so the connection goes on."""
    config = MCPServerConfig(
        command=sys.executable, args=[str(BIG_PONG)], max_message_bytes=65536, call_timeout_seconds=30
    )
    before = failure_count("mcp_message_cut", "spy")
    async with _running(config, ping_interval=0.02) as connection:
        armed = await connection.call("arm", {})
        assert armed.ok, armed.error
        after = await connection.call("after_pings", {})  # answered at the first ping after the long answer
        starts = connection.starts
    assert after.ok, after.error
    assert after.output == "pings 2"
    assert starts == 1
    assert failure_count("mcp_message_cut", "spy") == before + 1


async def test_an_answer_under_the_bound_is_read_and_cut_to_max_output_chars() -> None:
    config = MCPServerConfig(command=sys.executable, args=[str(SPY)], max_output_chars=1000)
    async with _running(config) as connection:
        result = await connection.call("flood", {"size": 100_000})
    assert result.ok
    assert result.truncated
    assert result.output.startswith("x" * 1000 + "\n[… result cut at 1000 of 100000 characters …]")


async def test_attack_an_answer_holding_numbers_json_has_no_place_for_is_shown_as_a_call_that_ran() -> None:
    """Before, structured content holding 1e400 or NaN (which the SDK's parser reads as floats) made the answer
    raise in canonical JSON, and the registry reported a call the server had run as one that failed unexpectedly."""
    config = MCPServerConfig(command=sys.executable, args=[str(RAW_NUMBERS)])
    async with _running(config) as connection:
        result = await connection.call("measure", {})
    assert result.ok, result.error
    shown = json.loads(result.output)
    assert math.isinf(shown["reading"])
    assert math.isnan(shown["spread"])
    assert shown["unit"] == "K"


# --------------------------------------------------------------------------- the cutter, as a unit

_ids = st.one_of(
    st.integers(min_value=-(2**53), max_value=2**53),
    st.text(min_size=0, max_size=40),
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def _messages(draw: st.DrawFn) -> tuple[dict[str, Any], Any]:
    """A JSON-RPC message in any key order, and the id it answers (None for requests and notifications)."""
    kind = draw(st.sampled_from(["result", "error", "request", "notification"]))
    fields: dict[str, Any] = {"jsonrpc": "2.0"}
    answers = None
    if kind in ("result", "error", "request"):
        fields["id"] = draw(_ids)
    if kind == "result":
        fields["result"] = draw(_json)
        answers = fields["id"]
    elif kind == "error":
        fields["error"] = {"code": -1, "message": draw(st.text(max_size=20)), "data": draw(_json)}
        answers = fields["id"]
    else:
        fields["method"] = draw(st.text(min_size=1, max_size=20))
        fields["params"] = draw(st.dictionaries(st.text(max_size=8), _json, max_size=3))
    keys = draw(st.permutations(list(fields)))
    return {key: fields[key] for key in keys}, answers


@settings(max_examples=300, deadline=None)
@given(_messages(), st.booleans(), st.integers(min_value=1, max_value=64), st.randoms())
def test_the_envelope_finds_the_id_an_answer_carries_in_any_key_order(
    message: tuple[dict[str, Any], Any], ascii_only: bool, piece: int, rnd: random.Random
) -> None:
    fields, answers = message
    text = json.dumps(fields, ensure_ascii=ascii_only, separators=rnd.choice([(",", ":"), (", ", ": ")]))
    data = text.encode("utf-8")
    envelope = Envelope()
    at = 0
    while at < len(data):  # fed in pieces of any size, cut anywhere (inside escapes and UTF-8 sequences too)
        step = rnd.randint(1, piece)
        envelope.feed(data[at : at + step])
        at += step
    assert envelope.answers == answers


def test_the_envelope_reads_a_key_written_with_escapes_and_counts_the_ids_named() -> None:
    """A key written with escapes (``"\\u0069d"``) is the key ``id`` to any JSON parser: the envelope read it as
    some other key, so a line naming ``id`` twice so was taken to name it once, and a request naming it only so
    for a notification. It is read as the parser reads it, and how often ``id`` is named is counted."""
    escaped = Envelope()
    escaped.feed(b'{"jsonrpc":"2.0","\\u0069d":9,"\\u006dethod":"x","params":{"id":1}}')
    assert (escaped.request_id, escaped.ids, escaped.kinds) == (9, 1, {b"method"})
    twice = Envelope()
    twice.feed(b'{"id":7,"method":"x","\\u0069d":8}')
    assert twice.ids == 2
    unread = Envelope()
    unread.feed(b'{"\\u00')
    unread.feed(b'69d":"\\ud800","method":"x"}')
    assert (unread.ids, unread.kinds) == (1, {b"method"})


def test_the_cutter_passes_lines_within_the_bound_and_answers_one_over_it_once() -> None:
    big = json.dumps({"result": {"content": [{"type": "text", "text": "x" * 5000}]}, "jsonrpc": "2.0", "id": 7})
    cutter = LineCutter(limit=1000)
    stream = (
        b'{"jsonrpc":"2.0","id":1,"result":{}}\n' + big.encode() + b"\n" + b'{"jsonrpc":"2.0","id":2,"result":{}}\n'
    )
    events: list[bytes | Oversize] = []
    for at in range(0, len(stream), 300):
        events.extend(cutter.feed(stream[at : at + 300]))
    assert events[0] == b'{"jsonrpc":"2.0","id":1,"result":{}}'
    cut = [e for e in events if isinstance(e, Oversize)]
    assert [e.reply_to for e in cut if e.answer] == [7]  # answered once, though its id came last
    assert [e.size for e in cut if e.ended] == [len(big)]
    assert events[-1] == b'{"jsonrpc":"2.0","id":2,"result":{}}'
    early = LineCutter(limit=1000)
    head_first = json.dumps({"jsonrpc": "2.0", "id": "a", "result": {"text": "y" * 5000}}).encode()
    said = list(early.feed(head_first[:2000]))
    assert [(e.reply_to, e.answer, e.ended) for e in said if isinstance(e, Oversize)] == [("a", True, False)]
    said = list(early.feed(head_first[2000:] + b"\n"))
    assert [(e.reply_to, e.answer, e.ended) for e in said if isinstance(e, Oversize)] == [("a", False, True)]


def test_the_cutter_says_when_the_id_of_a_line_over_the_bound_is_in_doubt() -> None:
    """A line over the bound given up on (more top-level members than a JSON-RPC message has) is said to be in
    doubt as soon as it is given up on, once; one naming ``id`` twice is said so at its end (the id answered first
    may not be the one its sender meant)."""
    crowded = b'{"jsonrpc":"2.0",' + b'"m":1,' * 70 + b'"result":"' + b"x" * 5000 + b'","id":3}\n'
    cutter = LineCutter(limit=1000)
    said = [e for at in range(0, len(crowded), 500) for e in cutter.feed(crowded[at : at + 500])]
    assert [(e.answer, e.in_doubt, e.ended, e.reply_to) for e in said if isinstance(e, Oversize)] == [
        (True, True, False, None),
        (False, False, True, None),
    ]
    twice = b'{"jsonrpc":"2.0","id":3,"result":"' + b"x" * 5000 + b'","id":4}\n'
    cutter = LineCutter(limit=1000)
    said = [e for at in range(0, len(twice), 500) for e in cutter.feed(twice[at : at + 500])]
    assert [(e.answer, e.in_doubt, e.ended, e.reply_to) for e in said if isinstance(e, Oversize)] == [
        (True, False, False, 3),
        (True, True, True, None),
    ]


def test_the_envelope_skips_what_is_nested_without_a_python_step_per_byte() -> None:
    """The envelope stepped through nested content in Python, one step per bracket and per string: 50 MiB of
    ``[`` (or of ``"",``, or a list of small records) held the event loop 15-30 s while a line over the limit was
    let go (the stdio door's client, or an MCP server's answer). It is skipped in C now: the Python calls made
    do not grow with the bytes skipped, and the id after the nesting is still read where the nesting ends."""
    import cProfile
    import pstats

    mib = 1024 * 1024
    shapes = {
        "deep": b"[" * mib + b"]" * mib,
        "pairs": b"[" + b"[]" * (mib // 2) + b"]",
        "strings": b"[" + b'"",' * (mib // 3) + b'""]',
        "escapes": b'{"s":"' + b'\\\\\\"' * (mib // 4) + b'"}',
        "records": b"[" + b'{"a":1,"b":"x]"},' * (mib // 17) + b"{}]",
    }
    for name, nested in shapes.items():
        data = b'{"jsonrpc":"2.0","params":{"x":' + nested + b'},"id":5,"method":"tools/call"}'
        envelope = Envelope()
        profile = cProfile.Profile()
        profile.enable()
        for at in range(0, len(data), 65536):
            envelope.feed(data[at : at + 65536])
        profile.disable()
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
        assert (envelope.request_id, envelope.ids, envelope.kinds) == (5, 1, {b"method"}), name
        assert calls < 2000, f"{name}: {calls} Python calls for {len(data)} bytes"
    crowded = Envelope()  # more top-level members than any JSON-RPC message has: another "id" may follow unread
    crowded.feed(b'{"id":5,"method":"x"' + b',"a":1' * 64 + b"}")
    assert crowded.request_id is None


_TEXT = '[]{}"\\/,: a\u00e9\u2028\n\t\U0001f600'


def _random_value(rnd: random.Random, depth: int) -> Any:
    pick = rnd.random()
    if depth > 0 and pick < 0.3:
        return [_random_value(rnd, depth - 1) for _ in range(rnd.randint(0, 8))]
    if depth > 0 and pick < 0.55:
        return {_random_text(rnd, 6): _random_value(rnd, depth - 1) for _ in range(rnd.randint(0, 6))}
    if pick < 0.6:
        return _random_text(rnd, 20_000)  # a long string now and then, across many reads
    return rnd.choice(
        [None, True, False, rnd.randint(-(10**20), 10**20), rnd.uniform(-1e9, 1e9), _random_text(rnd, 12)]
    )


def _random_text(rnd: random.Random, most: int) -> str:
    size = rnd.randint(0, rnd.choice([most, 12]))
    return ("".join(rnd.choices(_TEXT, k=min(size, 97))) * (size // 97 + 1))[:size]


def test_the_envelope_reads_random_messages_cut_anywhere_as_json_loads_does() -> None:
    """The envelope against json.loads: random JSON-RPC messages (nested brackets, strings full of brackets,
    quotes and escapes, deep nesting written out, long enough to span many reads and the envelope's windows) fed
    in pieces cut at random places. Its id, the kinds it names and how often it names ``id`` are what the parser
    reads."""
    rnd = random.Random(61)
    for _ in range(100):
        fields: dict[str, Any] = {"jsonrpc": "2.0"}
        if rnd.random() < 0.85:
            fields["id"] = rnd.choice([rnd.randint(-(2**53), 2**53), _random_text(rnd, 20)])
        kind = rnd.choice(["result", "error", "method"])
        if kind == "method":
            fields["method"] = "tools/call"
            fields["params"] = _random_value(rnd, 6)
        elif kind == "error":
            fields["error"] = {"code": -1, "message": "no", "data": _random_value(rnd, 6)}
        else:
            fields["result"] = _random_value(rnd, 6)
        for extra in range(rnd.randint(0, 3)):
            fields[f"x{extra}"] = _random_value(rnd, 3)
        keys = list(fields)
        rnd.shuffle(keys)
        body = {key: fields[key] for key in keys}
        text = json.dumps(body, ensure_ascii=rnd.random() < 0.5, separators=rnd.choice([(",", ":"), (", ", ": ")]))
        nesting = rnd.choice([0, 0, 1, 300])  # a member nested deeper than json.dumps writes
        text = text[:-1] + f', "deep": {"[" * nesting}1{"]" * nesting}}}' if nesting else text
        data = text.encode("utf-8")
        parsed = json.loads(data)
        envelope = Envelope()
        at = 0
        while at < len(data):
            step = rnd.choice([1, 7, 4096, 65536, 300_000])
            envelope.feed(data[at : at + step])
            at += step
        expected_id = parsed.get("id")
        assert envelope.request_id == expected_id, text[:300]
        assert envelope.kinds == {key.encode() for key in parsed} & {b"result", b"error", b"method"}
        assert envelope.ids == ("id" in parsed)
        assert not envelope.gave_up


def _python_calls(feeds: list[bytes]) -> tuple[Envelope, int]:
    import cProfile
    import pstats

    envelope = Envelope()
    profile = cProfile.Profile()
    profile.enable()
    for piece in feeds:
        envelope.feed(piece)
    profile.disable()
    return envelope, pstats.Stats(profile).total_calls  # type: ignore[attr-defined]


def _calls_allowed(size: int) -> int:
    """A few Python calls per 64 KiB looked at (the envelope's window, and the reads fed), never one per byte."""
    return 20 * (size // 65536 + 1) + 5000  # and a few for each of the tokens read at the top level


def test_attack_nesting_that_closes_within_one_read_is_skipped_without_a_python_step_per_bracket() -> None:
    """Where nested content came back to the top level within one read, the envelope walked it in Python, a step
    per bracket and per string: a 4 MiB ``[[…]]`` member read in one piece (the first feed of a line over the
    bound) held Kazma's event loop 2 s, three of them 8 s, and bare words, colons or strings at the top level a step
    per byte (4 MiB of digits: 5 s). The Python calls made now are a few per 64 KiB, not one per bracket."""
    mib = 1024 * 1024
    member = b"[" * (2 * mib) + b"]" * (2 * mib)
    whole = [b'{"jsonrpc":"2.0","result":{"a":' + member + b',"b":' + member + b',"c":' + member + b'},"id":5}']
    envelope, calls = _python_calls(whole)
    assert calls < _calls_allowed(len(whole[0])), f"three 4 MiB members: {calls} Python calls"
    assert (envelope.answers, envelope.gave_up) == (5, False)
    for name, top in {"digits": b"1" * (4 * mib), "colons": b":" * (4 * mib), "strings": b'"" ' * mib}.items():
        data = b'{"jsonrpc":"2.0","x":' + top + b',"id":5,"result":{}}'
        envelope, calls = _python_calls([data[at : at + 65536] for at in range(0, len(data), 65536)])
        assert calls < _calls_allowed(len(data)), f"{name} at the top level: {calls} Python calls"
        # a bare word is skipped whole; more tokens at the top level than a JSON-RPC message has are given up on
        assert (envelope.answers, envelope.gave_up) == ((5, False) if name == "digits" else (None, True)), name
    quotes = b'{"jsonrpc":"2.0","result":[' + b'"' * (8 * mib) + b'"]}'
    _, calls = _python_calls([quotes[at : at + 65536] for at in range(0, len(quotes), 65536)])
    assert calls < _calls_allowed(len(quotes)), f"8 MiB of quotes: {calls} Python calls"
