"""Long-poll waiters of the approvals API: what 500 idle ones cost, and how soon one decision answers them all.

Kazma (the app from ``build_app`` with its web server and the approvals API, the web adapter as its one
platform) runs in a child process, so its CPU is its own: this process holds the ``--waiters`` long-polls
(``GET /api/v1/approvals/{id}?wait=60`` over real HTTP on 127.0.0.1) and reads the child's CPU time from
``/proc``. Two measurements per run:

* idle: ``--waiters`` long-polls, one per pending request, nothing decided for ``--idle`` seconds: the child's
  CPU as a share of one core (goal <= 1 %). The window starts right after the long-polls were asked (``wait=60``),
  so the default 10 s holds none of their asking again: ``--idle 75`` holds one round of it (each poll read and
  answered again: three reads of its request and a ``last_seen`` write each), the steady state's cost;
* wake: ``--waiters`` long-polls of one request; the child decides it (a bench-only control port calls
  ``ApprovalService.decide`` and says when it started, by the system-wide monotonic clock). Two times:
  ``wake ms``, from that to the last long-poll answered *here* (the figure this bench printed first), and
  ``server ms``, from the decision's commit to the last answer's bytes handed to the kernel, measured inside
  Kazma (:class:`Marks`). The first holds this one client process reading 500 answers, each woken by its
  socket, on the same two cores Kazma runs on: once Kazma writes every answer in one step (a few ms), that
  reading is most of it, so it measures the client as much as Kazma. Goal: <= 30 ms.

Long-polls are asked again as soon as they end without an outcome (``wait`` is at most 60 s). Prints numbers
with the load average beside them; asserts nothing.

    python bench/waiters.py [--waiters 500] [--idle 10] [--runs 3] [--postgres] [--calls [--top tottime]]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yarl
from aiohttp import web

if TYPE_CHECKING:
    from kazma.bot.app import App

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOKEN = "bench-" + "b" * 40
TICKS = os.sysconf("SC_CLK_TCK")


def _config(store: str) -> str:
    return f"""
store: {store}
web: {{port: 0}}
approvals: {{deadline_seconds: 3600, approvers: ["web:admin"]}}
api:
  tokens:
    bench: {{token: '{TOKEN}', roles: [approval_requester], max_pending: 10000}}
"""


# -- the child: Kazma, and a control port ---------------------------------------------------------


async def serve(folder: Path, store: str, log_level: str) -> None:
    from kazma.bot import start_gc
    from kazma.bot.logging import configure_logging
    from tests.console_support import console_only

    configure_logging(log_level)
    # Replicas on PostgreSQL must share their keys (SQLite makes its own beside the file): bench keys, not secrets.
    os.environ.setdefault("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    audit_key = base64.urlsafe_b64encode(b"bench-audit-key-" * 2).decode().rstrip("=")
    os.environ.setdefault("KAZMA_AUDIT_KEY", f"a1:{audit_key}")
    marks = _mark_writes()  # before the server accepts anything: every connection of its port is watched
    async with console_only(folder, _config(store)) as (app, server):
        marks.port = yarl.URL(server.url).port
        start_gc.served()  # as `kazma run` does once it serves: what the start holds frozen (kazma.bot.start_gc)
        _mark_commits(app, marks)
        await _serve_control(app, server, f"{server.url}/api/v1/approvals", marks)


class Marks:
    """Kazma's side of a wake-up, by the system-wide monotonic clock: when the decision's commit was done (the
    service's ``_ended``, called right after it) and when the last bytes went to a socket of the web server's
    port (``transport.write`` returned: the kernel has them). Measured in the server, so the client's own
    reading of 500 answers is not in it."""

    def __init__(self) -> None:
        self.port: int | None = None
        self.committed = 0.0
        self.written = 0.0


def _mark_writes() -> Marks:
    from aiohttp.web_protocol import RequestHandler

    marks = Marks()
    made = RequestHandler.connection_made

    def connection_made(handler: RequestHandler, transport: asyncio.BaseTransport) -> None:
        made(handler, transport)
        if not isinstance(transport, asyncio.Transport) or transport.get_extra_info("sockname")[1] != marks.port:
            return  # the control port's own answers are not Kazma's
        write, writelines = transport.write, transport.writelines

        def written(data: Any) -> None:
            write(data)
            marks.written = time.monotonic()

        def lines_written(data: Any) -> None:
            writelines(data)
            marks.written = time.monotonic()

        transport.write = written  # type: ignore[method-assign]
        transport.writelines = lines_written  # type: ignore[method-assign,assignment]

    RequestHandler.connection_made = connection_made  # type: ignore[method-assign,assignment]
    return marks


def _mark_commits(app: App, marks: Marks) -> None:
    service = app.service
    ended = service._ended

    async def ended_marked(request_id: str, *decided: Any) -> None:
        marks.committed = time.monotonic()
        await ended(request_id, *decided)

    service._ended = ended_marked  # type: ignore[method-assign,assignment]


async def _serve_control(app: App, server: Any, api: str, marks: Marks) -> None:
    """A control port beside Kazma: decide a request, count its waiters; prints both addresses, runs forever."""
    from kazma.approvals import Decision

    async def decide(request: web.Request) -> web.Response:
        started = time.monotonic()
        result = await app.service.decide(request.match_info["id"], Decision.APPROVE, actor="web:admin",
                                          platform="web")  # fmt: skip
        return web.json_response({"started": started, "won": result.won})

    async def written(request: web.Request) -> web.Response:
        return web.json_response({"committed": marks.committed, "written": marks.written})

    async def waiting(request: web.Request) -> web.Response:
        waiters = getattr(app.service, "_waiters", None)
        of = request.query.get("id")
        api = getattr(server, "api", None)  # the API's long-polls share one wait per request on the service
        if api is not None:
            count = api.polling(of)
        elif waiters is None:  # before waiters were counted: one event per request, so requests, not waiters
            decided = getattr(app.service, "_decided", {})  # an older tree's one event per waited request
            count = len(decided) if of is None else int(of in decided)
        elif of is None:
            count = sum(w.waiters for w in waiters.watches.values())
        else:
            watch = waiters.watches.get(of)
            count = 0 if watch is None else watch.waiters
        outbox = getattr(app.bus, "outbox", None)
        due = 0 if outbox is None else len(await outbox.pending())
        return web.json_response({"waiting": count, "posts_due": due})

    async def cpu(request: web.Request) -> web.Response:
        # This process's CPU time (every thread), precise to the microsecond: /proc's ticks are 10 ms.
        return web.json_response({"cpu": time.process_time()})

    profiles: list[cProfile.Profile] = []

    async def calls(request: web.Request) -> web.Response:
        # --calls: Python function calls on the loop's thread from "start" to "stop", a count the machine's load
        # does not change (CPU time under load does, by tens of per cent).
        if request.query.get("do") == "start":
            profiles.append(cProfile.Profile())
            profiles[-1].enable()
            return web.json_response({})
        profile = profiles.pop()
        profile.disable()
        stats = pstats.Stats(profile, stream=(text := io.StringIO()))
        if request.query.get("top"):  # the functions that took the most time, for a person reading the profile
            stats.sort_stats(request.query["top"]).print_stats(40)
            if request.query.get("callers"):
                stats.print_callers(request.query["callers"])
        return web.json_response({"calls": stats.total_calls, "top": text.getvalue()})  # type: ignore[attr-defined]

    control = web.Application()
    routes = [web.post("/decide/{id}", decide), web.get("/waiting", waiting), web.get("/cpu", cpu)]
    control.add_routes([*routes, web.post("/calls", calls), web.get("/written", written)])
    runner = web.AppRunner(control, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(json.dumps({"api": api, "control": f"http://127.0.0.1:{port}"}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


# -- the parent: the waiters ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


@contextlib.asynccontextmanager
async def kazma(folder: Path, store: str, log_level: str) -> AsyncIterator[tuple[int, dict[str, str]]]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", str(folder), "--store", store, "--log-level", log_level,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        yield child.pid, json.loads(line)
    finally:
        child.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.wait(), 30)
        if child.returncode is None:
            child.kill()
            await child.wait()


async def open_requests(session: aiohttp.ClientSession, api: str, count: int) -> list[str]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    gate = asyncio.Semaphore(20)

    async def one(n: int) -> str:
        async with gate, session.post(api, json={"tool": "deploy", "arguments": {"n": n}}, headers=headers) as r:
            body: dict[str, Any] = await r.json()
            assert r.status == 201, body
            return str(body["id"])

    return list(await asyncio.gather(*(one(n) for n in range(count))))


class LongPoll(asyncio.Protocol):
    """One long-poll over its own keep-alive connection, asked again until the request has an outcome.

    A bare protocol, not an HTTP client library: what is measured is Kazma's answer, so this side does the least
    a client can per answer (its bytes collected in a callback, one JSON parse, no task woken) — an aiohttp client
    cost about as much CPU per answer as Kazma spent writing it, and on a 2-core machine that time was in the
    measured wake-up.
    """

    def __init__(self, ask: bytes) -> None:
        self.ask = ask
        self.ended: asyncio.Future[float] = asyncio.get_running_loop().create_future()  # when the outcome arrived
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.ask)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(self.buffer[:head_end]).lower()
        at = head.find(b"content-length:")
        assert at >= 0, head
        line_end = head.find(b"\r\n", at)
        length = int(head[at + 15 : None if line_end < 0 else line_end])
        if len(self.buffer) < head_end + 4 + length:
            return
        body = json.loads(bytes(self.buffer[head_end + 4 : head_end + 4 + length]))
        del self.buffer[: head_end + 4 + length]
        if not head.startswith(b"http/1.1 200"):
            self.ended.set_exception(RuntimeError(f"answered {head[:40]!r}: {body}"))
        elif body["status"] == "pending":
            assert self.transport is not None
            self.transport.write(self.ask)  # the wait ran out: ask again
        elif not self.ended.done():
            self.ended.set_result(time.monotonic())

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_exception(exc or ConnectionError("Kazma closed the long-poll's connection"))


@contextlib.asynccontextmanager
async def long_polls(api: str, request_ids: list[str]) -> AsyncIterator[list[asyncio.Future[float]]]:
    """One long-poll per id, each asked until its request has an outcome: when each answer that had it arrived
    here (monotonic clock). Their connections close on the way out, not as each answer arrives: a close is work
    for Kazma, and it is not the wake-up's."""
    loop = asyncio.get_running_loop()
    opened: list[tuple[asyncio.BaseTransport, LongPoll]] = []
    try:
        for request_id in request_ids:
            url = yarl.URL(f"{api}/{request_id}")
            ask = (
                f"GET {url.raw_path}?wait=60 HTTP/1.1\r\nHost: {url.raw_authority}\r\n"
                f"Authorization: Bearer {TOKEN}\r\n\r\n"
            ).encode()
            host, port = url.host, url.port
            assert host is not None
            assert port is not None
            opened.append(await loop.create_connection(functools.partial(LongPoll, ask), host, port))
        yield [poll.ended for _, poll in opened]
    finally:
        for transport, poll in opened:
            poll.ended.cancel()
            transport.close()


async def until_waiting(session: aiohttp.ClientSession, control: str, count: int, of: str | None = None) -> None:
    async with asyncio.timeout(120):
        while True:
            async with session.get(f"{control}/waiting", params={} if of is None else {"id": of}) as answer:
                if (await answer.json())["waiting"] >= count:
                    return
            await asyncio.sleep(0.05)


async def until_quiet(session: aiohttp.ClientSession, control: str) -> None:
    async with asyncio.timeout(300):
        while True:
            async with session.get(f"{control}/waiting") as answer:
                if (await answer.json())["posts_due"] == 0:
                    return
            await asyncio.sleep(0.1)


async def one_run(
    args: argparse.Namespace, store: str, folder: Path
) -> tuple[float, list[tuple[float, float, float, float]]]:
    async with (
        kazma(folder, store, args.log_level) as (pid, urls),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)) as s,
    ):
        api, control = urls["api"], urls["control"]
        # idle: one long-poll per pending request
        ids = await open_requests(s, api, args.waiters)
        async with long_polls(api, ids):
            await until_waiting(s, control, args.waiters)
            await until_quiet(s, control)  # the opens' own after-work (their card posts) done before measuring
            cpu, start = cpu_seconds(pid), time.monotonic()
            spy = None
            if args.spy is not None:  # py-spy's samples of the idle child (collapsed stacks)
                spy = await asyncio.create_subprocess_exec(
                    "py-spy", "record", "-p", str(pid), "-d", str(int(args.idle)), "-r", "200", "--format", "raw",
                    "-o", str(args.spy), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            await asyncio.sleep(args.idle)
            if spy is not None:
                await spy.wait()
            idle_share = (cpu_seconds(pid) - cpu) / (time.monotonic() - start)
        wakes = [await wake(args, s, api, control, pid, round_no) for round_no in range(args.wakes)]
        return idle_share, wakes


async def child_cpu(session: aiohttp.ClientSession, control: str) -> float:
    async with session.get(f"{control}/cpu") as answer:
        return float((await answer.json())["cpu"])


async def wake(
    args: argparse.Namespace, s: aiohttp.ClientSession, api: str, control: str, pid: int, round_no: int
) -> tuple[float, float, float, float]:
    """Every long-poll on one request, one decision: (decision -> last answered here, the decision's commit ->
    the last answer's bytes written in Kazma, Kazma's CPU for it, this process's CPU for it), in seconds.
    Kazma's CPU counts from before the decision to the last answer read here (the control port's two calls
    included, a fraction of a millisecond); this process's is the client side."""
    (one,) = await open_requests(s, api, 1)
    async with long_polls(api, [one] * args.waiters) as polls:
        await until_waiting(s, control, args.waiters, one)
        await until_quiet(s, control)
        spy = None
        if args.spy is not None and round_no == 0:
            spy = await asyncio.create_subprocess_exec(
                "py-spy", "record", "-p", str(pid), "-d", "4", "-r", "500", "--format", "raw",
                "-o", f"{args.spy}.wake", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            await asyncio.sleep(1)
        if args.calls:
            async with s.post(f"{control}/calls", params={"do": "start"}) as answer:
                await answer.read()
        before = await child_cpu(s, control)
        here = time.process_time()
        async with s.post(f"{control}/decide/{one}") as answer:
            decided = await answer.json()
        answered = await asyncio.wait_for(asyncio.gather(*polls), 120)
        here = time.process_time() - here
        kazma_cpu = await child_cpu(s, control) - before
        async with s.get(f"{control}/written") as answer:
            marks = await answer.json()
        if args.calls:
            params = {"do": "stop"} if args.top is None else {"do": "stop", "top": args.top}
            async with s.post(f"{control}/calls", params=params) as answer:
                profile = await answer.json()
            kazma_cpu = float(profile["calls"])  # reported in place of the CPU time
            if args.top is not None and round_no == 0:
                print(profile["top"], flush=True)
        if spy is not None:
            await spy.wait()
    server = float(marks["written"]) - float(marks["committed"])
    return max(answered) - float(decided["started"]), server, kazma_cpu, here


async def main(args: argparse.Namespace) -> None:
    backend = "PostgreSQL" if args.postgres else "SQLite (WAL, synchronous=FULL)"
    print(f"{args.waiters} long-poll waiters on {backend}; idle window {args.idle:g} s; {args.wakes} wake-ups per run")
    if args.idle < 60:
        print("(the idle window holds none of the long-polls' asking again after wait=60: --idle 75 holds a round)")
    print("wake: decision -> last long-poll answered here, in this client (the figure printed before; it holds this")
    print("process reading 500 answers); server: the decision's commit -> the last answer's bytes written, measured")
    print("in Kazma (the client's reading is not in it); medians of the run's wake-ups. CPU ms per wake-up of Kazma")
    print("(all of its threads) and of this client process (parsing the answers, here: not Kazma's cost)")
    kazma = "Kazma calls" if args.calls else "Kazma CPU ms"
    print(
        f"{'run':<5}{'idle CPU % of a core':>22}{'wake ms':>9}{'server ms':>11}{kazma:>14}{'client CPU ms':>15}"
        f"{'load':>7}"
    )
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory() as tmp:
            if args.postgres:
                from tests.pg_support import PostgresServer

                with PostgresServer() as pg, pg.database() as db:
                    idle, wakes = await one_run(args, f"{{url: '{db.dsn}'}}", Path(tmp))
            else:
                idle, wakes = await one_run(args, f"{{path: '{Path(tmp) / 'kazma.db'}'}}", Path(tmp))
        wall, server, kazma_cpu, client_cpu = (statistics.median(column) * 1000 for column in zip(*wakes, strict=True))
        # --calls: a count of calls, not seconds (and the wall time is cProfile's, not Kazma's)
        kazma = f"{kazma_cpu / 1000:>14.0f}" if args.calls else f"{kazma_cpu:>14.1f}"
        load = os.getloadavg()[0]
        print(f"{run:<5}{100 * idle:>22.2f}{wall:>9.1f}{server:>11.1f}{kazma}{client_cpu:>15.1f}{load:>7.2f}")
    print("goals: idle <= 1 % of a core; decision -> last answered <= 30 ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="API long-poll waiters: idle CPU and wake-up time")
    parser.add_argument("--waiters", type=int, default=500)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wakes", type=int, default=3, help="wake-ups measured per run (the median is printed)")
    parser.add_argument("--postgres", action="store_true", help="on a throwaway PostgreSQL server (fsync off)")
    parser.add_argument("--log-level", default="warning", help="Kazma's log level (default warning)")
    parser.add_argument(
        "--calls", action="store_true", help="count Kazma's Python calls per wake-up (cProfile) instead of its CPU"
    )
    parser.add_argument(
        "--top", default=None, help="with --calls: print the first wake-up's profile sorted by this (e.g. tottime)"
    )
    parser.add_argument("--spy", type=Path, default=None, help="py-spy the idle window into this file")
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve is not None:
        asyncio.run(serve(parsed.serve, parsed.store, parsed.log_level))
    else:
        asyncio.run(main(parsed))
