"""API opens per second: ``POST /api/v1/approvals`` through the real Kazma app against a one-transaction anchor.

Both sides are served by aiohttp on 127.0.0.1 in this one process and asked over real HTTP by the same
``--agents`` concurrent agents (each its own API token, each opening one request after another with a fresh
``Idempotency-Key``), alternating every ``--chunk`` opens so disk and machine noise hit both alike:

* product: the Kazma app built by ``build_app`` (the web adapter as its one platform), its web server, the
  approvals API: token check, body validation, the idempotency key and the token's quota decided in the
  store, the request row, its card job rows and audit rows in one commit (group commit), the answer;
* anchor: a minimal aiohttp handler that checks the bearer token against the same tokens, parses the body,
  hashes the arguments and writes the same rows — the request row, its card job row, the idempotency row and
  two chained audit rows — in one transaction of its own on the same store file (tables ``anchor_*`` made
  like the product's), one open after another on one connection.

Between chunks, untimed, the product's card posts (its outbox, after the commit) are left to drain, so that
work never lands in the anchor's time; the CPU it took is printed as ``after``. Every run starts on warmed
files. ``--postgres`` runs the same on a throwaway PostgreSQL server (the test suite's, fsync off) or
``--dsn``. Prints numbers and the load average beside them; asserts nothing.

    python bench/api_open.py [--opens 2000] [--agents 20] [--chunk 200] [--runs 3] [--postgres] [--dsn …]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import cProfile
import hashlib
import hmac
import json
import os
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.pg_support, run from anywhere

from kazma.approvals.hashing import args_hash, canonical_json
from kazma.bot.app import App
from kazma.bot.logging import configure_logging
from tests.console_support import console_only

TOOL = "deploy"
TABLES = ("approval_requests", "card_outbox", "api_idempotency", "approval_events")


@dataclass
class Tally:
    seconds: float = 0.0
    cpu: float = 0.0
    after_cpu: float = 0.0
    opens: int = 0

    @property
    def rate(self) -> float:
        return self.opens / self.seconds if self.seconds else 0.0

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu / self.opens if self.opens else 0.0


@dataclass
class Agents:
    tokens: dict[str, str]
    session: aiohttp.ClientSession
    counter: int = 0
    failures: list[str] = field(default_factory=list)

    async def open_all(self, url: str, opens: int) -> None:
        """``opens`` requests, by every agent at once, each agent one after another."""
        names = list(self.tokens)
        share = [opens // len(names) + (1 if i < opens % len(names) else 0) for i in range(len(names))]

        async def agent(name: str, count: int) -> None:
            headers = {"Authorization": f"Bearer {self.tokens[name]}"}
            for _ in range(count):
                self.counter += 1
                body = {"tool": TOOL, "arguments": {"env": "prod", "build": self.counter}, "reason": "bench"}
                async with self.session.post(
                    url, json=body, headers={**headers, "Idempotency-Key": uuid.uuid4().hex}
                ) as answer:
                    text = await answer.read()
                    if answer.status != 201:
                        self.failures.append(f"{answer.status} {text[:200]!r}")

        await asyncio.gather(*(agent(n, c) for n, c in zip(names, share, strict=True)))


# -- the product -----------------------------------------------------------------------------------


def _config_text(store: str, tokens: dict[str, str]) -> str:
    lines = "\n".join(
        f"    {name}: {{token: '{token}', roles: [approval_requester], max_pending: 10000}}"
        for name, token in tokens.items()
    )
    return f"""
store: {store}
web: {{port: 0}}
approvals: {{deadline_seconds: 600, approvers: ["web:admin"]}}
api:
  tokens:
{lines}
"""


@contextlib.asynccontextmanager
async def product(folder: Path, store: str, tokens: dict[str, str]) -> AsyncIterator[tuple[App, str]]:
    async with console_only(folder, _config_text(store, tokens)) as (app, server):
        yield app, f"{server.url}/api/v1/approvals"


async def drained(app: App) -> None:
    """The product's card posts are all made (its outbox empty of due posts)."""
    outbox = app.bus.outbox if hasattr(app.bus, "outbox") else None
    if outbox is None:
        return
    async with asyncio.timeout(120):
        while True:
            if not await outbox.pending():
                return
            await asyncio.sleep(0.01)


# -- the anchor ------------------------------------------------------------------------------------


class Anchor:
    """The same writes by hand, one transaction per open, behind the smallest aiohttp handler."""

    def __init__(self, tokens: dict[str, str], write: Callable[[list[tuple[str, tuple[Any, ...]]]], Awaitable[None]]):
        self.tokens = tokens
        self.write = write
        self.head = "0" * 64
        self.seq = 0

    def app(self) -> web.Application:
        application = web.Application()
        application.add_routes([web.post("/anchor", self.open)])
        return application

    async def open(self, request: web.Request) -> web.Response:
        supplied = request.headers.get("Authorization", "").partition(" ")[2].encode()
        name = None
        for token_name, token in self.tokens.items():
            if hmac.compare_digest(supplied, token.encode()):
                name = token_name
        if name is None:
            raise web.HTTPUnauthorized()
        body = json.loads(await request.read())
        key = request.headers["Idempotency-Key"]
        arguments = body["arguments"]
        digest = args_hash(arguments)
        rid = secrets.token_urlsafe(18)
        now = time.time()
        actor = f"api:{name}"
        statements: list[tuple[str, tuple[Any, ...]]] = [
            (
                "INSERT INTO anchor_approval_requests (id, tool, args_json, args_hash, requested_by, conversation,"
                " created_at, deadline, status, notes, durable, approve_needed, deny_needed, step_up)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, 1, 1, 1, 0)",
                (
                    rid,
                    body["tool"],
                    canonical_json(arguments),
                    digest,
                    actor,
                    actor,
                    now,
                    now + 600,
                    json.dumps([body.get("reason") or ""]),
                ),
            ),
            (
                "INSERT INTO anchor_card_outbox (request_id, platform, created_at, next_at) VALUES (?, ?, ?, ?)",
                (rid, "web", now, now),
            ),
            (
                "INSERT INTO anchor_api_idempotency (token_name, idem_key, body_hash, request_id, created_at,"
                " expires_at) VALUES (?, ?, ?, ?, ?, ?)",
                (name, key, hashlib.sha256(canonical_json(body).encode()).hexdigest(), rid, now, now + 600 + 86400),
            ),
        ]
        for event in ("opened", "api_opened"):
            self.seq += 1
            chained = hashlib.sha256(f"{self.head}|{self.seq}|{rid}|{event}|{actor}|{now}|{digest}".encode())
            statements.append(
                (
                    "INSERT INTO anchor_approval_events (seq, request_id, event, actor, platform, at, args_hash,"
                    " detail, prev_hash, chain_hash) VALUES (?, ?, ?, ?, 'api', ?, ?, ?, ?, ?)",
                    (self.seq, rid, event, actor, now, digest, f"tool={body['tool']}", self.head, chained.hexdigest()),
                )
            )
            self.head = chained.hexdigest()
        await self.write(statements)
        return web.json_response(
            {"id": rid, "status": "pending", "tool": body["tool"], "arguments": arguments, "hash": digest,
             "requested_by": actor, "deadline": now + 600, "link": f"http://127.0.0.1/swarm?approval={rid}"},
            status=201,
        )  # fmt: skip


@contextlib.asynccontextmanager
async def sqlite_writer(path: Path) -> AsyncIterator[Callable[[list[tuple[str, tuple[Any, ...]]]], Awaitable[None]]]:
    from kazma.config.store.database import connect

    conn = await connect(path)
    rows = await conn.execute_fetchall(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name IN (?, ?, ?, ?)", TABLES
    )
    for name, create in rows:
        made = str(create).replace(f"CREATE TABLE {name}", f"CREATE TABLE IF NOT EXISTS anchor_{name}", 1)
        made = made.replace(f"CREATE TABLE IF NOT EXISTS {name}", f"CREATE TABLE IF NOT EXISTS anchor_{name}", 1)
        await conn.execute(made)
    await conn.commit()
    lock = asyncio.Lock()

    async def write(statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        async with lock:
            await conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    await conn.execute(sql, params)
                await conn.execute("COMMIT")
            except BaseException:
                await conn.execute("ROLLBACK")
                raise

    try:
        yield write
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def pg_writer(dsn: str) -> AsyncIterator[Callable[[list[tuple[str, tuple[Any, ...]]]], Awaitable[None]]]:
    import psycopg

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    for name in TABLES:
        await conn.execute(f"CREATE TABLE IF NOT EXISTS anchor_{name} (LIKE {name} INCLUDING ALL)")
    lock = asyncio.Lock()

    async def write(statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        async with lock, conn.transaction():
            for sql, params in statements:
                await conn.execute(sql.replace("?", "%s"), params)

    try:
        yield write
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def anchor_server(anchor: Anchor) -> AsyncIterator[str]:
    runner = web.AppRunner(anchor.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/anchor"
    finally:
        await runner.cleanup()


# -- the run ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def pg_database(dsn: str | None) -> Iterator[str]:
    if dsn is not None:
        import psycopg

        name = f"kazma_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield psycopg.conninfo.make_conninfo(dsn, dbname=name)
        finally:
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return
    from tests.pg_support import PostgresServer

    with PostgresServer() as server, server.database() as db:
        yield db.dsn


async def one_run(
    args: argparse.Namespace, folder: Path, dsn: str | None, profiler: cProfile.Profile | None = None
) -> tuple[Tally, Tally, list[str]]:
    after_profiler = cProfile.Profile() if profiler is not None else None
    tokens = {f"agent{i}": f"tok-{i}-" + secrets.token_hex(16) for i in range(args.agents)}
    if dsn is None:
        path = folder / "kazma.db"
        store = f"{{path: '{path}'}}"
    else:
        store = f"{{url: '{dsn}'}}"
    async with product(folder, store, tokens) as (app, product_url):
        writer = sqlite_writer(folder / "kazma.db") if dsn is None else pg_writer(dsn)
        async with (
            writer as write,
            anchor_server(Anchor(tokens, write)) as anchor_url,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            agents = Agents(tokens, session)
            # warm both sides (files, WAL, caches, connections)
            await agents.open_all(product_url, args.agents * 5)
            await agents.open_all(anchor_url, args.agents * 5)
            await drained(app)
            sides = {"product": Tally(), "anchor": Tally()}
            done = 0
            while done < args.opens:
                n = min(args.chunk, args.opens - done)
                for name, url in (("product", product_url), ("anchor", anchor_url)):
                    tally = sides[name]
                    cpu, start = time.process_time(), time.perf_counter()
                    if profiler is not None and name == "product":
                        profiler.enable()
                    await agents.open_all(url, n)
                    if profiler is not None and name == "product":
                        profiler.disable()
                    tally.seconds += time.perf_counter() - start
                    tally.cpu += time.process_time() - cpu
                    tally.opens += n
                    cpu = time.process_time()
                    if name == "product":
                        if after_profiler is not None:
                            after_profiler.enable()
                        await drained(app)
                        if after_profiler is not None:
                            after_profiler.disable()
                    tally.after_cpu += time.process_time() - cpu
                done += n
            if after_profiler is not None:
                after_profiler.dump_stats(f"{args.profile}.after")
            return sides["product"], sides["anchor"], agents.failures


async def main() -> None:
    parser = argparse.ArgumentParser(description="API opens per second, product vs a one-transaction anchor")
    parser.add_argument("--opens", type=int, default=2000)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=200, help="opens per side before switching sides")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the SQLite files go (default: a temp dir)")
    parser.add_argument("--postgres", action="store_true", help="on PostgreSQL (a throwaway server unless --dsn)")
    parser.add_argument("--dsn", default=None, help="a PostgreSQL server to make a scratch database on")
    parser.add_argument("--profile", type=Path, default=None, help="write cProfile stats of the product's chunks")
    parser.add_argument("--log-level", default="warning", help="the product's log level (default warning)")
    args = parser.parse_args()
    configure_logging(args.log_level)
    # Replicas on PostgreSQL must share their keys (SQLite makes its own beside the file): bench keys, not secrets.
    os.environ.setdefault("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    audit_key = base64.urlsafe_b64encode(b"bench-audit-key-" * 2).decode().rstrip("=")
    os.environ.setdefault("KAZMA_AUDIT_KEY", f"a1:{audit_key}")
    backend = "PostgreSQL" if args.postgres or args.dsn else "SQLite (WAL, synchronous=FULL)"
    print(f"{args.opens} opens per side, {args.agents} agents, chunks of {args.chunk}, on {backend}, pid {os.getpid()}")
    print(f"{'run':<5}{'product/s':>10}{'anchor/s':>10}{'ratio':>7}{'cpu ms/open':>13}{'anchor ms':>10}"
          f"{'after ms':>10}{'load':>7}")  # fmt: skip
    ratios: list[float] = []
    profiler = cProfile.Profile() if args.profile else None
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            if args.postgres or args.dsn:
                with pg_database(args.dsn) as dsn:
                    ours, anchor, failures = await one_run(args, Path(tmp), dsn, profiler)
            else:
                ours, anchor, failures = await one_run(args, Path(tmp), None, profiler)
        ratio = ours.rate / anchor.rate if anchor.rate else 0.0
        ratios.append(ratio)
        after = 1000 * ours.after_cpu / ours.opens if ours.opens else 0.0
        print(f"{run:<5}{ours.rate:>10.0f}{anchor.rate:>10.0f}{ratio:>7.2f}{ours.cpu_ms:>13.2f}{anchor.cpu_ms:>10.2f}"
              f"{after:>10.2f}{os.getloadavg()[0]:>7.2f}")  # fmt: skip
        if failures:
            print(f"  {len(failures)} opens failed, e.g. {failures[0]}")
    if profiler is not None:
        profiler.dump_stats(args.profile)
    print(f"product / anchor: {' '.join(f'{r:.2f}' for r in ratios)} (goal >= 0.8)")


if __name__ == "__main__":
    asyncio.run(main())
