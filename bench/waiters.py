"""Long-poll waiters of the approvals API: what 500 idle ones cost, and how soon one decision answers them all.

Kazma (the app from ``build_app`` with its web server and the approvals API, the web adapter as its one
platform) runs in a child process, so its CPU is its own: this process holds the ``--waiters`` long-polls
(``GET /api/v1/approvals/{id}?wait=60`` over real HTTP on 127.0.0.1) and reads the child's CPU time from
``/proc``. Two measurements per run:

* idle: ``--waiters`` long-polls, one per pending request, nothing decided for ``--idle`` seconds: the child's
  CPU as a share of one core (goal <= 1 %);
* wake: ``--waiters`` long-polls of one request; the child decides it (a bench-only control port calls
  ``ApprovalService.decide`` and says when it started, by the system-wide monotonic clock); the time from
  that to the last long-poll answered here (goal <= 30 ms).

Long-polls are asked again as soon as they end without an outcome (``wait`` is at most 60 s). Prints numbers
with the load average beside them; asserts nothing.

    python bench/waiters.py [--waiters 500] [--idle 10] [--runs 3] [--postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
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
    from kazma.bot.logging import configure_logging
    from tests.console_support import console_only

    configure_logging(log_level)
    # Replicas on PostgreSQL must share their keys (SQLite makes its own beside the file): bench keys, not secrets.
    os.environ.setdefault("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    audit_key = base64.urlsafe_b64encode(b"bench-audit-key-" * 2).decode().rstrip("=")
    os.environ.setdefault("KAZMA_AUDIT_KEY", f"a1:{audit_key}")
    async with console_only(folder, _config(store)) as (app, server):
        await _serve_control(app, f"{server.url}/api/v1/approvals")


async def _serve_control(app: App, api: str) -> None:
    """A control port beside Kazma: decide a request, count its waiters; prints both addresses, runs forever."""
    from kazma.approvals import Decision

    async def decide(request: web.Request) -> web.Response:
        started = time.monotonic()
        result = await app.service.decide(request.match_info["id"], Decision.APPROVE, actor="web:admin",
                                          platform="web")  # fmt: skip
        return web.json_response({"started": started, "won": result.won})

    async def waiting(request: web.Request) -> web.Response:
        waiters = getattr(app.service, "_waiters", None)
        of = request.query.get("id")
        if waiters is None:  # before waiters were counted: one event per request, so requests, not waiters
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

    control = web.Application()
    control.add_routes([web.post("/decide/{id}", decide), web.get("/waiting", waiting)])
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


async def long_poll(session: aiohttp.ClientSession, api: str, request_id: str) -> float:
    """Ask until the request has an outcome; when the answer that had it arrived here (monotonic clock)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    while True:
        async with session.get(f"{api}/{request_id}", params={"wait": "60"}, headers=headers) as answer:
            body = await answer.json()
            if body["status"] != "pending":
                return time.monotonic()


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


async def one_run(args: argparse.Namespace, store: str, folder: Path) -> tuple[float, float]:
    async with (
        kazma(folder, store, args.log_level) as (pid, urls),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)) as s,
    ):
        api, control = urls["api"], urls["control"]
        # idle: one long-poll per pending request
        ids = await open_requests(s, api, args.waiters)
        polls = [asyncio.create_task(long_poll(s, api, i)) for i in ids]
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
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        # wake: every long-poll on one request, one decision
        (one,) = await open_requests(s, api, 1)
        polls = [asyncio.create_task(long_poll(s, api, one)) for _ in range(args.waiters)]
        await until_waiting(s, control, args.waiters, one)
        await until_quiet(s, control)
        spy = None
        if args.spy is not None:
            spy = await asyncio.create_subprocess_exec(
                "py-spy", "record", "-p", str(pid), "-d", "4", "-r", "500", "--format", "raw",
                "-o", f"{args.spy}.wake", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            await asyncio.sleep(1)
        async with s.post(f"{control}/decide/{one}") as answer:
            decided = await answer.json()
        answered = await asyncio.wait_for(asyncio.gather(*polls), 120)
        if spy is not None:
            await spy.wait()
        return idle_share, max(answered) - float(decided["started"])


async def main(args: argparse.Namespace) -> None:
    backend = "PostgreSQL" if args.postgres else "SQLite (WAL, synchronous=FULL)"
    print(f"{args.waiters} long-poll waiters on {backend}; idle window {args.idle:g} s; pid {os.getpid()}")
    print(f"{'run':<5}{'idle CPU % of a core':>22}{'decision -> last answered ms':>30}{'load':>7}")
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory() as tmp:
            if args.postgres:
                from tests.pg_support import PostgresServer

                with PostgresServer() as pg, pg.database() as db:
                    idle, wake = await one_run(args, f"{{url: '{db.dsn}'}}", Path(tmp))
            else:
                idle, wake = await one_run(args, f"{{path: '{Path(tmp) / 'kazma.db'}'}}", Path(tmp))
        print(f"{run:<5}{100 * idle:>22.2f}{1000 * wake:>30.1f}{os.getloadavg()[0]:>7.2f}")
    print("goals: idle <= 1 % of a core; decision -> last answered <= 30 ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="API long-poll waiters: idle CPU and wake-up time")
    parser.add_argument("--waiters", type=int, default=500)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--postgres", action="store_true", help="on a throwaway PostgreSQL server (fsync off)")
    parser.add_argument("--log-level", default="warning", help="Kazma's log level (default warning)")
    parser.add_argument("--spy", type=Path, default=None, help="py-spy the idle window into this file")
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve is not None:
        asyncio.run(serve(parsed.serve, parsed.store, parsed.log_level))
    else:
        asyncio.run(main(parsed))
