"""A request row whose text is not UTF-8 (SQLite keeps whatever bytes it is given; only a write around Kazma puts
such bytes there) is named by its id and left out, never a read of the whole table failing at it, and never an
approval: doctor's seal check, the request lists, a start's recovery and the sweeps go on with the other rows."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from kazma.approvals.model import Decision, PressVerdict, Status, Waits
from kazma.approvals.store import UnreadableRequest
from kazma.approvals.withdrawal import POLL_GRACE
from kazma.bot.cli import decision_checks, main
from kazma.config.metrics import failure_count
from tests.approvals_support import ManualClock, approval_service
from tests.audit_support import KEY_ENV, Attacker, Log, config_text, make_log, run_async
from tests.store_backends import Engine
from tests.test_web_server import OPERATOR, console

NOT_UTF8 = "CAST(X'ff64' AS TEXT)"


@pytest.fixture
def sqlite(tmp_path: Path) -> Engine:
    return Engine("sqlite", str(tmp_path / "k.db"))


async def _open_pending(where: str) -> tuple[str, str]:
    async with approval_service(where) as service:
        spoilt = await service.open("shell", {"command": "a"}, "agent:builder", "telegram:-100", deadline=600)
        kept = await service.open("shell", {"command": "b"}, "agent:builder", "telegram:-100", deadline=600)
        return spoilt.id, kept.id


def test_doctor_names_a_decided_row_it_cannot_read_and_checks_the_others(tmp_path: Path, sqlite: Engine) -> None:
    """Before: "decision seals: cannot read the store: Could not decode to UTF-8 column 'reason'", no row named,
    and no other seal checked."""
    log: Log = run_async(make_log(sqlite.where))
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, sqlite))
    drop = log.requests["drop"]
    Attacker(sqlite).run((f"UPDATE approval_requests SET reason = {NOT_UTF8} WHERE id = ?", (drop,)))  # noqa: S608
    doctor = CliRunner().invoke(
        main, ["-c", str(config), "doctor", "--platform-timeout", "1", "--model-timeout", "1"], env=KEY_ENV
    )
    [line] = [text for text in doctor.output.splitlines() if "decision seals" in text]
    assert line.startswith("FAIL"), line
    assert "1 decided rows cannot be read, a text in them not UTF-8" in line, line
    assert f"{drop} (reason)" in line, line
    assert "cannot read the store" not in line, line

    async def read() -> None:
        async with approval_service(sqlite.where) as service:
            readable, unreadable = await service.store.decided_rows()
            assert {r.id for r in readable} == {log.requests["deploy"], log.requests["late"]}
            assert [(u.request_id, u.columns) for u in unreadable] == [(drop, ("reason",))]

    run_async(read())


@pytest.mark.parametrize("page", [1, 2, 500])
def test_doctor_reading_pages_names_each_unreadable_row_once_whatever_its_page(
    tmp_path: Path, sqlite: Engine, monkeypatch: pytest.MonkeyPatch, page: int
) -> None:
    """doctor reads the decided rows a page at a time by id: a row whose id is not text (SQLite sorts it after
    every text) and one whose reason is not UTF-8 are each named once, and the readable one is still checked."""
    log: Log = run_async(make_log(sqlite.where))
    drop, late = log.requests["drop"], log.requests["late"]
    Attacker(sqlite).run(
        (f"UPDATE approval_requests SET reason = {NOT_UTF8} WHERE id = ?", (drop,)),  # noqa: S608
        ("UPDATE approval_requests SET id = X'ff64' WHERE id = ?", (late,)),
    )
    monkeypatch.setattr(decision_checks, "PAGE", page)
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, sqlite))
    doctor = CliRunner().invoke(
        main, ["-c", str(config), "doctor", "--platform-timeout", "1", "--model-timeout", "1"], env=KEY_ENV
    )
    [line] = [text for text in doctor.output.splitlines() if "decision seals" in text]
    assert "2 decided rows cannot be read, a text in them not UTF-8" in line, line
    assert line.count(f"{drop} (reason)") == 1, line
    assert line.count("ff64 (id") == 1, line
    assert "of the others" not in line, line  # the approved deploy's seal verifies


def test_lists_and_a_start_go_on_past_an_unreadable_row_and_it_is_never_approved(sqlite: Engine) -> None:
    spoilt, kept = run_async(_open_pending(sqlite.where))
    Attacker(sqlite).run((f"UPDATE approval_requests SET tool = {NOT_UTF8} WHERE id = ?", (spoilt,)))  # noqa: S608

    async def after() -> None:
        async with approval_service(sqlite.where) as service:
            before = failure_count("approval_row_unreadable")
            assert [r.id for r in await service.store.requests(pending_only=True)] == [kept]
            assert failure_count("approval_row_unreadable") == before + 1
            with pytest.raises(UnreadableRequest, match=rf"approval request {spoilt} cannot be read: tool holds"):
                await service.store.get(spoilt)
            # a start ends the readable orphan as before (it stopped at the unreadable one, ending none)
            recovery = await service.recover(None)
            assert [r.id for r in recovery.cancelled] == [kept]
            # a press on it decides nothing, and the presser is told why rather than to press again
            pressed = await service.decide(spoilt, Decision.APPROVE, actor="telegram:111", platform="telegram")
            assert pressed.verdict is PressVerdict.REFUSED
            assert pressed.message.startswith("This request cannot be decided: its record in the approvals store")

    run_async(after())
    raw = sqlite3.connect(sqlite.where)
    try:
        assert raw.execute("SELECT status FROM approval_requests WHERE id = ?", (spoilt,)).fetchall() == [("pending",)]
    finally:
        raw.close()


async def test_the_console_lists_the_others_and_names_the_row_on_its_page(tmp_path: Path) -> None:
    """Before, the approval page of such a row was aiohttp's bare "500 Internal Server Error" naming nothing."""
    async with console(tmp_path) as con:
        spoilt = await con.open_approval({"command": "a"})
        kept = await con.open_approval({"command": "b"})
        path = con.app.loaded.config.store.path

        def spoil() -> None:
            raw = sqlite3.connect(path, timeout=60)  # in a thread: Kazma's writer shares this event loop
            try:
                raw.execute(f"UPDATE approval_requests SET reason = {NOT_UTF8} WHERE id = ?", (spoilt.id,))  # noqa: S608
                raw.commit()
            finally:
                raw.close()

        await asyncio.to_thread(spoil)
        async with con.client() as alice:
            await con.login(alice, "alice", OPERATOR)
            waiting = await alice.get(f"{con.base}/approvals")
            assert waiting.status == 200
            listed = await waiting.text()
            assert f"/swarm?approval={kept.id}" in listed
            assert f"/swarm?approval={spoilt.id}" not in listed
            page = await alice.get(f"{con.base}/swarm?approval={spoilt.id}")
            assert page.status == 500
            assert f"approval request {spoilt.id} cannot be read: reason holds bytes that are not UTF-8" in (
                await page.text()
            )


@pytest.mark.parametrize("column", ["tool", "conversation", "reason"])
def test_a_press_on_an_unreadable_row_names_it_and_counts_it_as_unreadable(sqlite: Engine, column: str) -> None:
    """Before, a press's own reads of the row (_PRESS_HEAD and the rest) raised SQLite's error, which named a
    column and no row: it was logged ``approvals.store_unavailable`` and counted at ``approval_resolve`` (a store
    that did answer), never at ``approval_row_unreadable`` as every list's read of the same row is."""
    spoilt, kept = run_async(_open_pending(sqlite.where))
    Attacker(sqlite).run((f"UPDATE approval_requests SET {column} = {NOT_UTF8} WHERE id = ?", (spoilt,)))  # noqa: S608

    async def press() -> None:
        async with approval_service(sqlite.where) as service:
            unreadable, resolve = failure_count("approval_row_unreadable"), failure_count("approval_resolve")
            with capture_logs() as logs:
                pressed = await service.decide(spoilt, Decision.APPROVE, actor="telegram:111", platform="telegram")
            assert pressed.verdict is PressVerdict.REFUSED
            assert pressed.message.startswith("This request cannot be decided: its record in the approvals store")
            assert failure_count("approval_row_unreadable") == unreadable + 1
            assert failure_count("approval_resolve") == resolve
            named = [(e["request_id"], e["columns"]) for e in logs if e["event"] == "approvals.request_unreadable"]
            assert named == [(spoilt, [column])]
            assert not [e for e in logs if e["event"] == "approvals.store_unavailable"]
            # the other request is decided as ever
            other = await service.decide(kept, Decision.APPROVE, actor="telegram:111", platform="telegram")
            assert other.verdict is PressVerdict.WON

    run_async(press())


def test_the_deadline_and_silence_sweeps_go_on_past_an_unreadable_row(sqlite: Engine) -> None:
    """Before, the deadline sweep listed ids only and failed at the unreadable row's timeout, every pass: the
    overdue requests after it never ended, and the rest of the approvals sweep never ran. So did the withdrawal
    of polling requests whose askers went quiet."""
    clock = ManualClock()

    async def open_them() -> dict[str, str]:
        async with approval_service(sqlite.where, clock=clock) as service:
            opened = {}
            for name in ("late_spoilt", "late_kept"):
                opened[name] = (await service.open("shell", {"c": name}, "agent:b", "telegram:-100", deadline=60)).id
            for name in ("quiet_spoilt", "quiet_kept"):  # polling askers, to go quiet
                polled = await service.open(
                    "deploy",
                    {"c": name},
                    "api:ci",
                    "api:ci",
                    durable=True,
                    waits=Waits.POLLING,
                    seen=True,
                    deadline=3600,
                )
                opened[name] = polled.id
            return opened

    opened = run_async(open_them())
    for name in ("late_spoilt", "quiet_spoilt"):
        Attacker(sqlite).run((f"UPDATE approval_requests SET tool = {NOT_UTF8} WHERE id = ?", (opened[name],)))  # noqa: S608
    clock.advance(POLL_GRACE + 1)

    async def sweep() -> None:
        async with approval_service(sqlite.where, clock=clock) as service:
            before = failure_count("approval_row_unreadable")
            assert [o.request_id for o in await service.expire_overdue()] == [opened["late_kept"]]
            assert await service.withdraw_silent() == [opened["quiet_kept"]]
            assert failure_count("approval_row_unreadable") == before + 2
            for name in ("late_kept", "quiet_kept"):
                request = await service.store.get(opened[name])
                assert request is not None
                assert request.status is not Status.PENDING, name

    run_async(sweep())
