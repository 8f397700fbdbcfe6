"""Decisions per second on PostgreSQL: the approvals service against a raw psycopg compare-and-set loop.

Both run on the same server in one process, one after the other: the service
(authorisation, the card check, the compare-and-set with its audit row, group
commits through :class:`kazma.config.store.postgres.PgWriter`) and a bare loop of
``UPDATE … WHERE status = 'pending' RETURNING`` statements on one autocommit
connection, one transaction per press. Prints numbers; asserts nothing.

    python bench/pg_decide.py [--dsn postgresql://…] [--requests 2000] [--presses 3]

Without ``--dsn`` it starts a throwaway server with the test suite's
``tests/pg_support.py`` (run from the repository root) — that server runs with
``fsync`` and ``synchronous_commit`` off, so commits cost no disk flush there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterator

import psycopg

from kazma.approvals import ApprovalService, ApprovalStore, Decision, button_data
from kazma.bot.logging import configure_logging
from kazma.bot.store import pg_migrations
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.postgres import open_pg_store

CONFIG = load_config_text('approvals: {approvers: ["telegram:1", "slack:U1", "discord:2"]}').config
# Every outcome sealed, as in production (approvals/seal.py): the seal is part of what a decision costs.
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
PRESSERS = (("telegram:1", "telegram"), ("slack:U1", "slack"), ("discord:2", "discord"))


async def service_run(dsn: str, requests: int, presses: int) -> tuple[float, int, int, int]:
    backend = await open_pg_store(dsn, migrations=pg_migrations(), application_name="bench")
    try:
        service = ApprovalService(ApprovalStore(backend, keyring=KEYS), CONFIG)
        opened = await asyncio.gather(*(service.open("shell", {"n": i}, "bench", "bench") for i in range(requests)))
        writer = await backend.writer()
        groups_before = writer.groups
        jobs = [
            service.decide_from_button(button_data(r.id, Decision.APPROVE), actor=actor, platform=platform)
            for r in opened
            for actor, platform in PRESSERS[:presses]
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - start
        return elapsed, sum(r.won for r in results), writer.groups - groups_before, writer.run_alone
    finally:
        await backend.close()


async def raw_run(dsn: str, requests: int, presses: int) -> tuple[float, int]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE raw_r (id text PRIMARY KEY, status text NOT NULL, decided_by text)")
        async with conn.cursor() as cursor:
            await cursor.executemany(
                "INSERT INTO raw_r VALUES (%s, 'pending', NULL)", [(f"r{i}",) for i in range(requests)]
            )
        wins = 0
        start = time.perf_counter()
        for i in range(requests):
            for actor, _ in PRESSERS[:presses]:
                cursor = await conn.execute(
                    "UPDATE raw_r SET status = 'approved', decided_by = %s WHERE id = %s AND status = 'pending'"
                    " RETURNING decided_by",
                    (actor, f"r{i}"),
                )
                wins += (await cursor.fetchone()) is not None
        return time.perf_counter() - start, wins


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[tuple[str, str]]:
    """(dsn, where): a fresh database on the given server, or on a throwaway one."""
    if dsn is not None:
        name = f"kazma_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield psycopg.conninfo.make_conninfo(dsn, dbname=name), "the given server"
        finally:
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return
    from tests.pg_support import PostgresServer  # the suite's throwaway server: run from the repository root

    with PostgresServer() as server, server.database() as db:
        yield db.dsn, "a throwaway test server (fsync off)"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dsn", default=None, help="a server to create a scratch database on (default: start one)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--presses", type=int, default=3, choices=(1, 2, 3))
    args = parser.parse_args()
    configure_logging("warning")  # measure the store, not the log sink
    with database(args.dsn) as (dsn, where):
        service_elapsed, service_wins, groups, alone = await service_run(dsn, args.requests, args.presses)
        raw_elapsed, raw_wins = await raw_run(dsn, args.requests, args.presses)
    total = args.requests * args.presses
    print(f"{args.requests} requests x {args.presses} simultaneous presses = {total} presses on {where} "
          f"(pid {os.getpid()})")  # fmt: skip
    print(f"{'':<24}{'presses/s':>12}{'decisions/s':>14}{'winners':>10}{'seconds':>10}")
    for name, elapsed, wins in (
        ("approvals service", service_elapsed, service_wins),
        ("raw psycopg CAS loop", raw_elapsed, raw_wins),
    ):
        print(f"{name:<24}{total / elapsed:>12.0f}{wins / elapsed:>14.0f}{wins:>10}{elapsed:>10.2f}")
    print(f"service: {groups} group commits ({total / max(groups, 1):.1f} presses each), {alone} run alone")


if __name__ == "__main__":
    asyncio.run(main())
