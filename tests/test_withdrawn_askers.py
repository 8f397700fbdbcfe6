"""A request whose waiting asker goes away is withdrawn on every card, end to end on the wire.

`kazma run` is a real process serving the approvals API and /mcp, with cards on the Telegram, Slack and
Discord fakes. Each asker waits synchronously — a real MCP SDK client over streamable HTTP, `kazma approvals
request --wait`, `kazma mcp serve` under the SDK's stdio client — and then goes away: killed, cancelled,
interrupted, hung up, or Kazma itself restarted under it. Every card must lose its buttons and say the
request was withdrawn and why (not a denial) within 10 s, and a later press on a stale Approve must change
nothing. Before this, such a request stayed approvable: an Approve turned every card APPROVED, nothing ran
and nobody was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from kazma.approvals.model import Decision
from tests.child_env import child_env
from tests.platforms_support import PLATFORMS, Fakes, three_fakes
from tests.test_crash_settle import wait_connected
from tests.withdraw_support import (
    ASK,
    REQUESTER_TOKEN,
    KazmaRun,
    StaleButton,
    cli,
    live_cards,
    mcp_client,
    press_changes_nothing,
    stale_approve,
    until,
    withdrawn_everywhere,
)

pytestmark = pytest.mark.slow
WITHIN = 10.0  # seconds from the asker going away to every card withdrawn


@contextlib.asynccontextmanager
async def kazma(tmp_path: Path) -> AsyncIterator[tuple[Fakes, KazmaRun]]:
    async with three_fakes() as fakes:
        run = KazmaRun(fakes, tmp_path)
        try:
            await run.start()
            await wait_connected(fakes, 0)
            yield fakes, run
        finally:
            await run.stop(signal.SIGKILL)


def stored(run: KazmaRun) -> list[tuple[str, str, str | None, int]]:
    """Every request as the store holds it: id, status, reason, how many 'decided' audit rows it has."""
    with contextlib.closing(sqlite3.connect(run.store)) as conn:
        return [
            (str(rid), str(status), reason, int(decided))
            for rid, status, reason, decided in conn.execute(
                "SELECT r.id, r.status, r.reason, (SELECT COUNT(*) FROM approval_events e"
                " WHERE e.request_id = r.id AND e.event = 'decided') FROM approval_requests r"
            )
        ]


def cards_recorded(run: KazmaRun) -> int:
    with contextlib.closing(sqlite3.connect(run.store)) as conn:
        row = conn.execute("SELECT COUNT(*) FROM approval_cards WHERE platform IN ('telegram', 'slack', 'discord')")
        return int(row.fetchone()[0])


async def the_press_changes_nothing(fakes: Fakes, run: KazmaRun, why: str, stale: StaleButton) -> None:
    before = stored(run)
    told = await press_changes_nothing(fakes, stale)
    assert "withdrawn" in told.lower(), told
    assert stored(run) == before
    [(_, status, reason, decided)] = before
    assert (status, reason, decided) == ("cancelled", f"withdrawn: {why}", 0)


async def test_a_killed_mcp_client_gets_its_request_withdrawn_on_every_card(tmp_path: Path) -> None:
    async with kazma(tmp_path) as (fakes, run):
        client = await mcp_client(run.url)
        try:
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            stale = stale_approve(fakes)
        finally:
            client.send_signal(signal.SIGKILL)
            await client.wait()
        await until(lambda: withdrawn_everywhere(fakes, "the MCP client disconnected"), WITHIN, "withdrawn", run)
        await the_press_changes_nothing(fakes, run, "the MCP client disconnected", stale)


async def test_an_mcp_call_its_client_cancels_is_withdrawn_on_every_card(tmp_path: Path) -> None:
    async with kazma(tmp_path) as (fakes, run):
        headers = {"Authorization": f"Bearer {REQUESTER_TOKEN}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=None, trust_env=False) as http,
            streamable_http_client(f"{run.url}/mcp", http_client=http) as streams,
            ClientSession(streams[0], streams[1]) as session,
        ):
            await session.initialize()
            call = asyncio.create_task(session.call_tool("request_approval", ASK))
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            stale = stale_approve(fakes)
            call.cancel()  # the client stops waiting, but keeps its session (and its connections) open
            with contextlib.suppress(asyncio.CancelledError):
                await call
            why = "the asking call was cancelled"
            await until(lambda: withdrawn_everywhere(fakes, why), WITHIN, "withdrawn", run)
            await the_press_changes_nothing(fakes, run, why, stale)


async def test_kazma_killed_and_restarted_with_an_mcp_call_waiting_withdraws_it_after_the_restart(
    tmp_path: Path,
) -> None:
    async with kazma(tmp_path) as (fakes, run):
        client = await mcp_client(run.url)
        try:
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            # posted *and recorded* (a kill between a post and its record is the outbox's case, not this one)
            await until(lambda: cards_recorded(run) == len(PLATFORMS), 30, "the cards recorded", run)
            stale = stale_approve(fakes)
            assert await run.stop(signal.SIGKILL) == -signal.SIGKILL
            assert live_cards(fakes)  # the crash left every card live
            identifies = len(fakes.discord.identifies)
            await run.start()
            await wait_connected(fakes, identifies)
            why = "Kazma restarted while it waited"
            await until(lambda: withdrawn_everywhere(fakes, why), WITHIN, "withdrawn after the restart", run)
            await the_press_changes_nothing(fakes, run, why, stale)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it may have given up when Kazma went away
                client.send_signal(signal.SIGKILL)
            await client.wait()


async def test_kazma_stopped_with_an_mcp_call_waiting_withdraws_it_before_it_exits(tmp_path: Path) -> None:
    async with kazma(tmp_path) as (fakes, run):
        client = await mcp_client(run.url)
        try:
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            assert await run.stop(signal.SIGTERM) == 0, run.tail()
            # the cards were edited by the stopping process itself: nobody restarted it
            assert withdrawn_everywhere(fakes, "Kazma stopped while it waited")
            [(_, status, reason, decided)] = stored(run)
            assert (status, reason, decided) == ("cancelled", "withdrawn: Kazma stopped while it waited", 0)
            out, _ = await asyncio.wait_for(client.communicate(), 30)  # the client was answered, not left hanging
            assert b"withdrawn" in out
        finally:
            with contextlib.suppress(ProcessLookupError):
                client.send_signal(signal.SIGKILL)


async def test_ctrl_c_on_wait_withdraws_the_request_and_exits_with_its_own_code(tmp_path: Path) -> None:
    async with kazma(tmp_path) as (fakes, run):
        waiting = await cli(
            "approvals", "request", "--tool", "deploy", "--arg", "env=prod", "--wait", "--url", run.url
        )  # fmt: skip
        try:
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            stale = stale_approve(fakes)
            waiting.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(waiting.communicate(), 30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                waiting.send_signal(signal.SIGKILL)
        assert waiting.returncode == 5, err.decode()  # not 1, "denied": nobody denied anything
        assert b"withdrawn" in err
        why = "the asker's process was interrupted"
        await until(lambda: withdrawn_everywhere(fakes, why), WITHIN, "withdrawn", run)
        await the_press_changes_nothing(fakes, run, why, stale)


async def test_sigterm_on_wait_withdraws_the_request_too(tmp_path: Path) -> None:
    async with kazma(tmp_path) as (fakes, run):
        waiting = await cli(
            "approvals", "request", "--tool", "deploy", "--arg", "env=prod", "--wait", "--url", run.url
        )  # fmt: skip
        try:
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            waiting.send_signal(signal.SIGTERM)  # a CI runner cancelling the job
            await asyncio.wait_for(waiting.wait(), 30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                waiting.send_signal(signal.SIGKILL)
        assert waiting.returncode == 5
        why = "the asker's process was interrupted"
        await until(lambda: withdrawn_everywhere(fakes, why), WITHIN, "withdrawn", run)


async def test_mcp_serve_whose_client_hangs_up_withdraws_what_it_forwarded(tmp_path: Path) -> None:
    async with kazma(tmp_path) as (fakes, run):
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "kazma.bot.cli", "mcp", "serve", "--url", run.url],
            env=child_env({"KAZMA_API_TOKEN": REQUESTER_TOKEN, "PATH": os.environ.get("PATH", "")}, base={}),
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            call = asyncio.create_task(session.call_tool("request_approval", ASK))
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            stale = stale_approve(fakes)
        # leaving the client closed the server's stdin mid-call
        with contextlib.suppress(Exception):
            await call
        why = "the MCP client disconnected"
        await until(lambda: withdrawn_everywhere(fakes, why), WITHIN, "withdrawn", run)
        await the_press_changes_nothing(fakes, run, why, stale)


async def test_wait_outlives_a_kazma_restart_and_still_gets_the_answer(tmp_path: Path) -> None:
    # A polling asker is not gone when Kazma restarts under it: it asks again, its request stays open, and the
    # press made after the restart reaches it. (Before, the first failed poll ended it with exit 4 and left the
    # card approvable for nobody.)
    async with kazma(tmp_path) as (fakes, run):
        waiting = await cli(
            "approvals", "request", "--tool", "deploy", "--arg", "env=prod", "--wait", "--url", run.url
        )  # fmt: skip
        try:
            await until(lambda: live_cards(fakes), 60, "the cards posted", run)
            await until(lambda: cards_recorded(run) == len(PLATFORMS), 30, "the cards recorded", run)
            assert await run.stop(signal.SIGKILL) == -signal.SIGKILL
            identifies = len(fakes.discord.identifies)
            await run.start()
            await wait_connected(fakes, identifies)
            assert waiting.returncode is None  # still waiting
            [(_, status, _, _)] = stored(run)
            assert status == "pending"
            await fakes.press("telegram", Decision.APPROVE)
            out, err = await asyncio.wait_for(waiting.communicate(), 60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                waiting.send_signal(signal.SIGKILL)
        assert await waiting.wait() == 0, err.decode()
        assert b"approved by telegram:111" in out
