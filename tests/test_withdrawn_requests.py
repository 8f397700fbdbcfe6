"""Withdrawn requests in the store and at the API: who waits, who is gone, and what a person is told.

Store-level tests run on SQLite and on PostgreSQL (``store_engine``) with a clock the test moves; the API
tests run against the console's real HTTP server with the Telegram fake.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import aiohttp
import httpx
import pytest

from kazma.approvals import Decision, PressVerdict, Status
from kazma.approvals.client import require_approval
from kazma.approvals.model import Waits
from kazma.approvals.withdrawal import POLL_GRACE, SEEN_EVERY, Gone, withdrawn
from kazma.bot.console.api import MAX_WAIT
from tests.api_support import OPERATOR_TOKEN, REQUESTER_TOKEN, Door, cards, kazma_door
from tests.approvals_support import ManualClock, RecordingPublisher, approval_service
from tests.child_env import child_env
from tests.store_backends import Engine
from tests.test_web_server import _field

ARGS = {"env": "prod"}


def test_a_polling_askers_longest_poll_fits_well_inside_its_grace() -> None:
    # A live asker waits at most MAX_WAIT on one GET and is noted at most every SEEN_EVERY: it is seen again
    # well before POLL_GRACE, so only one that stopped asking is ever withdrawn.
    assert MAX_WAIT + SEEN_EVERY + 15 <= POLL_GRACE


async def test_a_polling_asker_that_stops_asking_is_withdrawn_and_nobody_else_is(store_engine: Engine) -> None:
    clock = ManualClock()
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, clock=clock, publisher=publisher) as service:
        gone = await service.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.POLLING, seen=True)
        asking = await service.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.POLLING, seen=True)
        api = await service.open("deploy", ARGS, "api:ci", "api:ci", durable=True, seen=True)  # may come back
        agent = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        clock.advance(POLL_GRACE - 30)
        await service.looked(asking.id)  # still asking
        assert await service.withdraw_silent() == []
        clock.advance(31)  # `gone` last asked POLL_GRACE + 1 s ago
        assert await service.withdraw_silent() == [gone.id]

        ended = await service.store.get(gone.id)
        assert ended is not None
        assert (ended.status, ended.reason) == (Status.CANCELLED, "withdrawn: the asker stopped asking for the answer")
        assert gone.id in publisher.settled  # its cards are edited
        for kept in (asking, api, agent):
            row = await service.store.get(kept.id)
            assert row is not None
            assert row.status is Status.PENDING, kept.tool

        # a press after the withdrawal changes nothing, and says why
        pressed = await service.decide(gone.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert pressed.verdict is PressVerdict.LOST
        assert pressed.message.startswith("This request was withdrawn (withdrawn: the asker stopped asking")
        assert "nothing changed" in pressed.message
        assert await service.store.events(gone.id, event="decided") == []
        again = await service.store.get(gone.id)
        assert again is not None
        assert again.status is Status.CANCELLED


async def test_last_seen_is_written_at_most_every_ten_seconds_whichever_process_is_asked(
    store_engine: Engine,
) -> None:
    clock = ManualClock()
    publisher = RecordingPublisher()
    async with (
        approval_service(store_engine.where, clock=clock, publisher=publisher) as one,
        approval_service(store_engine.where, clock=clock) as other,
    ):
        request = await one.open("deploy", ARGS, "api:ci", "api:ci", durable=True, seen=True)
        start = clock()
        for process, step in ((one, 3), (other, 8), (one, 1), (one, 5), (other, 2)):
            clock.advance(step)
            await process.looked(request.id)
        # at +3 (one): 3 s since the open; +11 (other): written; +12 (one), +17 (one): 1 and 6 s since that;
        # +19 (other): 8 s since its own write
        row = await one.store.get(request.id)
        assert row is not None
        assert row.last_seen is not None
        assert row.last_seen.timestamp() == pytest.approx(start + 11)
        # a look is not a card edit: nothing was settled or posted again
        assert publisher.settled == []
        assert len(publisher.published) == 1


async def test_a_restart_withdraws_an_mcp_calls_request_and_never_reports_it_as_a_call_that_did_not_run(
    store_engine: Engine,
) -> None:
    async with approval_service(store_engine.where) as first:
        waiting = await first.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.CONNECTION)
        approved = await first.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.CONNECTION)
        await first.decide(approved.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        polling = await first.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.POLLING, seen=True)

    async with approval_service(store_engine.where) as restarted:
        recovery = await restarted.recover()
        assert [r.id for r in recovery.cancelled] == [waiting.id]
        assert recovery.never_ran == []  # Kazma runs nothing for the API's requests: the caller does
        assert recovery.messages() == []  # its asker waited on a connection, not in a chat: the cards say it
        ended = await restarted.store.get(waiting.id)
        assert ended is not None
        assert (ended.status, ended.reason) == (Status.CANCELLED, "withdrawn: Kazma restarted while it waited")
        # a polling asker may be asking again already (it retries across a restart): not ended here
        kept = await restarted.store.get(polling.id)
        assert kept is not None
        assert kept.status is Status.PENDING


async def test_among_replicas_only_a_gone_replicas_mcp_requests_are_withdrawn(store_engine: Engine) -> None:
    async with approval_service(store_engine.where) as service:
        service.store.replica = "rep-a"
        held_by_a = await service.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.CONNECTION)
        service.store.replica = "rep-b"
        held_by_b = await service.open("deploy", ARGS, "api:ci", "api:ci", durable=True, waits=Waits.CONNECTION)
        recovery = await service.recover({"rep-b"})
        assert [r.id for r in recovery.cancelled] == [held_by_a.id]
        ended = await service.store.get(held_by_a.id)
        assert ended is not None
        assert ended.reason == withdrawn(Gone.REPLICA_STOPPED) == "withdrawn: the replica holding the wait stopped"
        alive = await service.store.get(held_by_b.id)
        assert alive is not None
        assert alive.status is Status.PENDING


# -- at the API ------------------------------------------------------------------------------------


def api(door: Door) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=door.url, headers=door.auth(), timeout=30, trust_env=False)


async def test_a_waiting_api_caller_says_so_and_withdraws_with_a_reason_kazma_words(tmp_path: Path) -> None:
    body = {"tool": "deploy", "arguments": ARGS}
    async with kazma_door(tmp_path) as door, api(door) as http:
        refused = await http.post("/api/v1/approvals", json=body, headers={"Kazma-Wait": "later"})
        assert refused.status_code == 400
        assert "Kazma-Wait must be 'sync'" in refused.json()["error"]
        opened = await http.post("/api/v1/approvals", json=body, headers={"Kazma-Wait": "sync"})
        assert opened.status_code == 201, opened.text
        found = opened.json()
        assert found["waits"] == "polling"
        assert found["last_seen"] is not None
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        assert "if it is interrupted or stops asking, this request is withdrawn" in cards(door.telegram)[-1]

        bad = await http.delete(f"/api/v1/approvals/{found['id']}", params={"why": "APPROVED: by telegram:111"})
        assert bad.status_code == 400  # the reason on the card is Kazma's words, never the caller's
        assert (await http.get(f"/api/v1/approvals/{found['id']}")).json()["status"] == "pending"

        gone = await http.delete(f"/api/v1/approvals/{found['id']}", params={"why": "interrupted"})
        assert gone.status_code == 200
        assert (gone.json()["status"], gone.json()["reason"]) == (
            "cancelled",
            "withdrawn: the asker's process was interrupted",
        )
        await door.telegram.wait_until(
            lambda: not any(m.buttons for m in door.telegram.bot_messages(-1001)), timeout=20
        )
        assert "withdrawn: the asker's process was interrupted" in cards(door.telegram)[-1]


async def test_an_api_request_stays_open_and_its_page_says_who_asked_and_when_they_last_asked(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, api(door) as http:
        opened = (await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": ARGS})).json()
        assert opened["waits"] is None
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        assert "may come back for the answer until the deadline" in cards(door.telegram)[-1]
        for _ in range(3):
            found = (await http.get(f"/api/v1/approvals/{opened['id']}")).json()
        assert found["status"] == "pending"
        assert found["last_seen"] is not None
        card = next(m for m in door.telegram.bot_messages(-1001) if m.buttons)
        assert card.edits == 0  # looking is not a card edit

        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            form = await browser.get(f"{door.url}/login")
            logged_in = await browser.post(
                f"{door.url}/login",
                data={"csrf": _field(await form.text(), "csrf"), "name": "alice", "token": OPERATOR_TOKEN},
                allow_redirects=False,
            )
            assert logged_in.status == 303
            page = await (await browser.get(f"{door.url}/swarm?approval={opened['id']}")).text()
            dashboard = await (await browser.get(f"{door.url}/swarm")).text()
        assert "<th>Requested by</th><td><code>api:ci</code></td>" in page  # on the card, shown once
        assert "not waiting: it may come back for the answer until the deadline" in page
        last = re.search(r"<th>Last asked for the answer</th><td><time datetime=\"([^\"]+)\"", page)
        assert last is not None, page
        assert last.group(1) == found["last_seen"]
        assert "asker last asked" in dashboard
        assert found["last_seen"] in dashboard


async def test_require_approval_in_a_cancelled_task_withdraws_its_request(tmp_path: Path) -> None:
    ran: list[str] = []
    async with kazma_door(tmp_path) as door:

        @require_approval(url=door.url, token=REQUESTER_TOKEN)
        async def deploy(env: str) -> None:
            ran.append(env)

        task = asyncio.create_task(deploy("prod"))
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        [request] = await door.app.service.store.requests(limit=5)
        assert request.waits is Waits.POLLING
        async with asyncio.timeout(10):
            while (await door.app.service.store.get(request.id)).status is Status.PENDING:  # type: ignore[union-attr]
                await asyncio.sleep(0.05)
        ended = await door.app.service.store.get(request.id)
        assert ended is not None
        assert (ended.status, ended.reason) == (Status.CANCELLED, "withdrawn: the asking call was cancelled")
        assert ran == []


INTERRUPTED_SCRIPT = """
import sys
from kazma.approvals.client import require_approval

@require_approval()
def deploy(env: str) -> None:
    print("RAN", flush=True)

print("asking", flush=True)
deploy("prod")
"""


async def test_require_approval_interrupted_by_ctrl_c_withdraws_its_request(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        env = child_env({"KAZMA_API_TOKEN": REQUESTER_TOKEN, "KAZMA_URL": door.url})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", INTERRUPTED_SCRIPT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=30)
            proc.send_signal(signal.SIGINT)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
        assert b"KeyboardInterrupt" in out  # the interruption goes on, after the withdrawal
        assert b"RAN" not in out
        [request] = await door.app.service.store.requests(limit=5)
        assert (request.status, request.reason) == (Status.CANCELLED, "withdrawn: the asker's process was interrupted")
