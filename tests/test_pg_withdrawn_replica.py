"""The replica holding an /mcp call's wait is SIGKILLed: the surviving replica withdraws its request.

Two `kazma run` replicas share one PostgreSQL database and the three platform fakes. A real MCP SDK client
asks through replica A (the leader), and waits on A's HTTP connection; its cards are posted. A is killed
outright, so nothing of A can withdraw anything. Replica B takes the lease, sees A gone and must withdraw the
request on every card within 60 s ("withdrawn: the replica holding the wait stopped"); a press on the stale
Approve then changes nothing. Before, the request was opened as durable: it stayed approvable until its
deadline, and an Approve turned every card APPROVED with nobody left to act on it.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import psycopg
import pytest

from tests.platforms_support import PLATFORMS, three_fakes
from tests.test_crash_settle import wait_connected
from tests.withdraw_support import (
    KazmaRun,
    live_cards,
    mcp_client,
    press_changes_nothing,
    stale_approve,
    until,
    withdrawn_everywhere,
)

pytestmark = pytest.mark.slow
WITHIN = 60.0  # seconds from the replica's death to every card withdrawn


def stored(dsn: str) -> list[tuple[str, str, str | None, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT r.id, r.status, r.reason, (SELECT COUNT(*) FROM approval_events e"
            " WHERE e.request_id = r.id AND e.event = 'decided') FROM approval_requests r"
        ).fetchall()
    return [(str(a), str(b), c, int(d)) for a, b, c, d in rows]


def cards_recorded(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT COUNT(*) FROM approval_cards WHERE platform IN ('telegram', 'slack', 'discord')"
        ).fetchone()
    return 0 if row is None else int(row[0])


async def test_sigkill_of_the_replica_holding_an_mcp_wait_withdraws_it_from_the_other(
    tmp_path: Path, pg_dsn: str
) -> None:
    async with three_fakes() as fakes:
        a = KazmaRun(fakes, tmp_path, "rep-a", store_url=pg_dsn)
        b = KazmaRun(fakes, tmp_path, "rep-b", store_url=pg_dsn)
        client = None
        try:
            await a.start()
            await until(lambda: _says(a, "replica rep-a: leader"), 30, "rep-a leading", a)
            await wait_connected(fakes, 0)
            await b.start()
            await until(lambda: _says(b, "replica rep-b: follower", "lease held by rep-a"), 60, "rep-b following", a, b)

            client = await mcp_client(a.url)  # A holds the wait
            await until(lambda: live_cards(fakes), 60, "the cards posted", a, b)
            await until(lambda: cards_recorded(pg_dsn) == len(PLATFORMS), 30, "the cards recorded", a, b)
            stale = stale_approve(fakes)

            assert await a.stop(signal.SIGKILL) == -signal.SIGKILL
            why = "the replica holding the wait stopped"
            await until(lambda: withdrawn_everywhere(fakes, why), WITHIN, "withdrawn by rep-b", b)

            before = stored(pg_dsn)
            [(_, status, reason, decided)] = before
            assert (status, reason, decided) == ("cancelled", f"withdrawn: {why}", 0)
            told = await press_changes_nothing(fakes, stale)  # rep-b polls Telegram now
            assert "withdrawn" in told.lower(), told
            assert stored(pg_dsn) == before
            assert await b.stop() == 0, b.tail()
        finally:
            for replica in (a, b):
                with contextlib.suppress(Exception):
                    await replica.stop(signal.SIGKILL)
            if client is not None:
                with contextlib.suppress(ProcessLookupError):
                    client.send_signal(signal.SIGKILL)
                await client.wait()


async def _says(replica: KazmaRun, *lines: str) -> bool:
    text = await replica.health()
    return all(line in text for line in lines)
