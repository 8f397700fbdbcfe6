from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import psycopg
import pytest
from structlog.testing import capture_logs

from kazma.approvals import (
    ApprovalRefused,
    ApprovalService,
    Decision,
    ExecutionMismatch,
    PressVerdict,
    Status,
    args_hash,
    button_data,
    parse_button,
)
from kazma.approvals import service as service_module
from kazma.approvals.service import ButtonError, CardLocation
from kazma.approvals.store import FoundCard, new_request_id
from kazma.config import load_config_text
from kazma.config.metrics import failure_count
from kazma.config.store.database import Tables
from kazma.config.store.errors import simulated_failure
from kazma.config.store.postgres import PgStore, pyformat
from kazma.config.store.writer import StoreWriter
from tests.approvals_support import ManualClock, RecordingPublisher, approval_service
from tests.store_backends import Engine

ARGS = {"command": "rm -rf build/", "timeout_s": 30}


async def raw(service: ApprovalService, sql: str, params: tuple[object, ...] = ()) -> None:
    """A statement around the store, as someone with the database itself would run it."""
    tables = service.store.tables
    if isinstance(tables, Tables):
        await tables.conn.execute(sql, params)
        return
    assert isinstance(tables, PgStore)
    async with tables.pool.connection() as conn:
        await conn.execute(pyformat(sql), params)


INTEGRITY = (sqlite3.IntegrityError, psycopg.IntegrityError)


def test_request_ids_never_start_with_a_dash_a_command_line_would_take_for_an_option() -> None:
    ids = [new_request_id() for _ in range(5000)]  # drawn as before, (63/64)^5000 < 1e-34 to have none
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{24}", i) for i in ids)
    assert not [i for i in ids if i.startswith("-")]
    assert len(set(ids)) == len(ids)


async def test_open_records_the_whole_call_with_a_fresh_id(store_engine: Engine) -> None:
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        first = await service.open("shell", ARGS, "agent:builder", "telegram:-100", task_id="t1")
        second = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert first.id != second.id  # two identical calls are two requests
        for request in (first, second):
            assert re.fullmatch(r"[A-Za-z0-9_-]{24}", request.id)  # 144 bits, URL-safe
            assert len(button_data(request.id, Decision.APPROVE).encode()) <= 64
        stored = await service.store.get(first.id)
        assert stored is not None
        assert stored.args == ARGS
        assert stored.args_json == '{"command":"rm -rf build/","timeout_s":30}'
        assert stored.args_hash == hashlib.sha256(stored.args_json.encode()).hexdigest()
        assert (stored.status, stored.task_id, stored.requested_by) == (Status.PENDING, "t1", "agent:builder")
        assert stored.deadline.timestamp() - stored.created_at.timestamp() == pytest.approx(600, abs=1)
        assert [c.request_id for c in publisher.published] == [first.id, second.id]
        events = await service.store.events(first.id)
        assert [(e.event, e.actor, e.args_hash) for e in events] == [("opened", "agent:builder", first.args_hash)]


def test_hash_is_sha256_of_canonical_json() -> None:
    args = {"b": [1, 2.5, None], "a": "é ✓", "c": {"z": True, "y": "x"}}
    canonical = '{"a":"é ✓","b":[1,2.5,null],"c":{"y":"x","z":true}}'
    assert args_hash(args) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"x": float("nan")}, "not a finite number"),
        ({"x": float("inf")}, "not a finite number"),
        ({"x": {1, 2}}, "is not JSON data"),
        ({"x": object()}, "is not JSON data"),
        ({"x": {1: "a"}}, "is not text"),
        ({"x": "\ud800"}, "not valid Unicode"),
        ({"a" * 101: 1}, "longer than 100"),
        ({"": 1}, "empty or has control characters"),
        ({"bad\nname": 1}, "empty or has control characters"),
    ],
)
async def test_unrenderable_arguments_are_refused_and_nothing_is_opened(
    store_engine: Engine, args: dict[object, object], why: str
) -> None:
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        with pytest.raises(ApprovalRefused, match=why):
            await service.open("shell", args, "agent:x", "web:c")  # type: ignore[arg-type]
        assert await service.store.requests() == []
        assert publisher.published == []


async def test_decision_is_final_and_losers_are_told_what_stands(store_engine: Engine) -> None:
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        won = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE), actor="slack:U111", platform="slack"
        )
        assert won.verdict is PressVerdict.WON
        lost = await service.decide_from_button(
            button_data(request.id, Decision.DENY), actor="telegram:111", platform="telegram"
        )
        assert lost.verdict is PressVerdict.LOST
        assert lost.outcome is not None
        assert (lost.outcome.status, lost.outcome.decided_by, lost.outcome.decided_via) == (
            Status.APPROVED,
            "slack:U111",
            "slack",
        )
        assert lost.message.startswith("Already approved by slack:U111 via slack at ")
        row = await service.store.get(request.id)
        assert row is not None
        assert (row.status, row.decided_by) == (Status.APPROVED, "slack:U111")
        assert publisher.settled == [request.id]
        # the database itself refuses to change a final row
        with pytest.raises(INTEGRITY, match="final"):
            await raw(service, "UPDATE approval_requests SET status = 'denied' WHERE id = ?", (request.id,))
        events = [(e.event, e.actor) for e in await service.store.events(request.id)]
        assert events == [("opened", "agent:builder"), ("decided", "slack:U111"), ("press_lost", "telegram:111")]


async def test_requests_ended_here_are_remembered_newest_first_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests a service ended are kept, the oldest dropped first once the bound is passed (a waiter looks up
    only a recent one)."""
    monkeypatch.setattr(service_module, "_RECENT_KEPT", 3)
    async with approval_service(tmp_path / "a.db") as service:
        ids = [(await service.open("shell", {"n": n}, "agent:builder", "telegram:-100")).id for n in range(5)]
        for request_id in ids:
            won = await service.decide_from_button(
                button_data(request_id, Decision.DENY), actor="slack:U111", platform="slack"
            )
            assert won.verdict is PressVerdict.WON
        assert list(service._ended_here) == ids[2:]


async def test_audit_trail_is_append_only(store_engine: Engine) -> None:
    async with approval_service(store_engine.where) as service:
        await service.open("shell", ARGS, "agent:builder", "web:c")
        with pytest.raises(INTEGRITY, match="append-only"):
            await raw(service, "DELETE FROM approval_events")
        with pytest.raises(INTEGRITY, match="append-only"):
            await raw(service, "UPDATE approval_events SET actor = 'someone else'")


async def test_presses_that_arrive_together_are_decided_in_one_commit(store_engine: Engine) -> None:
    """No read of the store comes before a press (who may decide is checked on the rules the press's own first
    statement reads): three presses made in the same turn of the loop join one group commit, one wins, and the
    two others are told what stands, each audited."""
    async with approval_service(store_engine.where) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        writer: Any = await service.store.tables.writer()  # StoreWriter or PgWriter: both count their groups
        await writer.caught_up()
        groups = writer.groups
        presses = (("telegram:111", "telegram"), ("slack:U111", "slack"), ("discord:222", "discord"))
        results = await asyncio.gather(
            *(
                service.decide_from_button(button_data(request.id, Decision.DENY), actor=actor, platform=platform)
                for actor, platform in presses
            )
        )
        assert writer.groups == groups + 1
        assert [r.verdict for r in results] == [PressVerdict.WON, PressVerdict.LOST, PressVerdict.LOST]
        assert all(r.outcome is not None and r.outcome.decided_by == "telegram:111" for r in results)
        events = [(e.event, e.actor) for e in await service.store.events(request.id)]
        assert events == [
            ("opened", "agent:builder"),
            ("decided", "telegram:111"),
            ("press_lost", "slack:U111"),
            ("press_lost", "discord:222"),
        ]


@pytest.mark.slow
async def test_thousand_requests_three_simultaneous_presses_each(store_engine: Engine) -> None:
    async with approval_service(store_engine.where) as service:
        requests = [await service.open("shell", {"n": i}, "agent:b", "web:c") for i in range(1000)]
        presses = []
        for i, request in enumerate(requests):
            for j, (actor, platform) in enumerate(
                (("telegram:111", "telegram"), ("slack:U111", "slack"), ("discord:222", "discord"))
            ):
                decision = Decision.APPROVE if (i + j) % 2 == 0 else Decision.DENY
                presses.append((request.id, actor, platform, button_data(request.id, decision)))
        results = await asyncio.gather(
            *(service.decide_from_button(data, actor=actor, platform=platform) for _, actor, platform, data in presses)
        )
        winners: dict[str, list[str]] = {}
        for (request_id, actor, _, _), result in zip(presses, results, strict=True):
            assert result.verdict in (PressVerdict.WON, PressVerdict.LOST)
            if result.won:
                winners.setdefault(request_id, []).append(actor)
        assert len(winners) == 1000
        assert all(len(actors) == 1 for actors in winners.values())
        rows = {r.id: r for r in await service.store.requests(limit=2000)}
        for (request_id, _, _, _), result in zip(presses, results, strict=True):
            row = rows[request_id]
            assert row.decided_by == winners[request_id][0]
            assert result.outcome is not None
            assert (result.outcome.status, result.outcome.decided_by) == (row.status, row.decided_by)
        decided = await service.store.events(event="decided")
        assert len(decided) == 1000


async def test_deadline_passes_to_timeout_not_denial(store_engine: Engine) -> None:
    clock = ManualClock()
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, clock=clock, publisher=publisher, poll_interval=0.01) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c", deadline=60)
        waiter = asyncio.create_task(service.wait(request.id))
        clock.advance(61)
        outcome = await asyncio.wait_for(waiter, timeout=10)
        assert outcome.status is Status.TIMEOUT
        assert outcome.decided_by is None
        assert "not denied" in outcome.for_agent()
        assert not outcome.for_agent().lower().startswith("denied")
        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.TIMEOUT
        assert row.decided_by is None
        events = [e.event for e in await service.store.events(request.id)]
        assert events == ["opened", "timeout"]
        assert publisher.settled == [request.id]
        # a press after the deadline cannot turn the timeout into a decision
        late = await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        assert late.verdict is PressVerdict.LOST
        assert late.outcome is not None
        assert late.outcome.status is Status.TIMEOUT


async def test_press_after_deadline_before_any_sweep_is_a_timeout(store_engine: Engine) -> None:
    clock = ManualClock()
    async with approval_service(store_engine.where, clock=clock) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c", deadline=5)
        clock.advance(5)
        result = await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        assert result.verdict is PressVerdict.LOST
        assert result.outcome is not None
        assert result.outcome.status is Status.TIMEOUT


async def test_overdue_requests_of_dead_waiters_are_expired(store_engine: Engine) -> None:
    clock = ManualClock()
    async with approval_service(store_engine.where, clock=clock) as service:
        old = await service.open("shell", ARGS, "agent:b", "web:c", deadline=5)
        fresh = await service.open("shell", ARGS, "agent:b", "web:c", deadline=500)
        clock.advance(10)
        outcomes = await service.expire_overdue()
        assert [(o.request_id, o.status) for o in outcomes] == [(old.id, Status.TIMEOUT)]
        still = await service.store.get(fresh.id)
        assert still is not None
        assert still.status is Status.PENDING


async def test_cancelled_waiter_ends_cancelled_not_denied(store_engine: Engine) -> None:
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c")
        waiter = asyncio.create_task(service.wait(request.id))
        while request.id not in service._waiters.watches:  # the waiter has started waiting
            await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.CANCELLED
        assert row.decided_by is None
        outcome = row.outcome()
        assert outcome is not None
        assert "not denied" in outcome.for_agent()
        assert [e.event for e in await service.store.events(request.id)] == ["opened", "cancelled"]
        assert publisher.settled == [request.id]


async def test_waiter_wakes_at_once_on_an_in_process_decision(store_engine: Engine) -> None:
    # a long poll interval proves the wake-up comes from the decision, not the poll
    async with approval_service(store_engine.where, poll_interval=3600) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c")
        waiter = asyncio.create_task(service.wait(request.id))
        while request.id not in service._waiters.watches:
            await asyncio.sleep(0)
        await service.decide(request.id, Decision.DENY, actor="web:admin", platform="web", reason="too broad")
        outcome = await asyncio.wait_for(waiter, timeout=10)
        assert (outcome.status, outcome.decided_by, outcome.reason) == (Status.DENIED, "web:admin", "too broad")
        assert outcome.for_agent() == "Denied by web:admin. They gave a reason (below). Do not retry this call."


@pytest.mark.parametrize(
    ("data", "actor", "platform", "message", "detail"),
    [
        ("{id}:a", "telegram:999", "telegram", "not an approver here", "not an approver"),
        ("{id}:a", "slack:U111", "telegram", "not an approver here", "not an approver"),  # right user, wrong place
        ("{id}:a", "telegram:111", "slack", "not an approver here", "not an approver"),
        ("kz1:{rid}:x", "telegram:111", "telegram", "not valid", "unknown decision code"),
        ("kz2:{rid}:a", "telegram:111", "telegram", "not valid", "unsupported button version"),
        ("kz1:{rid}", "telegram:111", "telegram", "not valid", "garbled"),
        ("kz1:../../etc:a", "telegram:111", "telegram", "not valid", "garbled"),
        ("", "telegram:111", "telegram", "not valid", "garbled"),
        ("kz1:AAAAAAAAAAAAAAAAAAAAAAAA:a", "telegram:111", "telegram", "Unknown approval request", "unknown request"),
    ],
)
async def test_refused_presses_change_nothing_and_are_audited(
    store_engine: Engine, data: str, actor: str, platform: str, message: str, detail: str
) -> None:
    async with approval_service(store_engine.where) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c")
        press = data.format(id=f"kz1:{request.id}", rid=request.id)
        result = await service.decide_from_button(press, actor=actor, platform=platform)
        assert result.verdict is PressVerdict.REFUSED
        assert message in result.message
        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        refused = await service.store.events(event="press_refused")
        assert len(refused) == 1
        assert refused[0].actor == actor
        assert refused[0].detail is not None
        assert detail in refused[0].detail
        # and the request is still decidable by a real approver
        ok = await service.decide_from_button(f"kz1:{request.id}:a", actor="telegram:111", platform="telegram")
        assert ok.won


async def test_platform_admins_are_approvers_there(store_engine: Engine) -> None:
    async with approval_service(store_engine.where) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c")
        result = await service.decide_from_button(f"kz1:{request.id}:d", actor="telegram:112", platform="telegram")
        assert result.won


def test_parse_button() -> None:
    parsed = parse_button("kz1:AbC_-0123456789abcdefgh:a")
    assert (parsed.request_id, parsed.decision) == ("AbC_-0123456789abcdefgh", Decision.APPROVE)
    with pytest.raises(ButtonError):
        parse_button("kz1:AbC_-0123456789abcdefgh:a\n")
    with pytest.raises(ButtonError):
        parse_button("x" * 500)


async def test_store_locked_during_press_warns_counts_and_keeps_pending(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    async with approval_service(path, busy_timeout_ms=50) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c")
        blocker = await aiosqlite.connect(str(path), isolation_level=None)
        before = failure_count("approval_resolve")
        try:
            await blocker.execute("BEGIN EXCLUSIVE")
            with capture_logs() as logs:
                result = await service.decide_from_button(
                    f"kz1:{request.id}:a", actor="discord:222", platform="discord"
                )
            assert result.verdict is PressVerdict.REFUSED
            assert "still pending" in result.message
            warnings = [e for e in logs if e["event"] == "approvals.store_unavailable"]
            assert len(warnings) == 1
            assert warnings[0]["log_level"] == "warning"
            assert warnings[0]["actor"] == "discord:222"
            assert failure_count("approval_resolve") == before + 1
        finally:
            await blocker.execute("ROLLBACK")
            await blocker.close()
        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        retry = await service.decide_from_button(f"kz1:{request.id}:a", actor="discord:222", platform="discord")
        assert retry.won


async def test_execution_refuses_changed_arguments(store_engine: Engine) -> None:
    async with approval_service(store_engine.where) as service:
        request = await service.open("shell", ARGS, "agent:b", "web:c")
        with pytest.raises(ExecutionMismatch, match="pending, not approved"):
            await service.verify_execution(request.id, "shell", ARGS)
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        await service.verify_execution(request.id, "shell", dict(ARGS))
        with pytest.raises(ExecutionMismatch, match="arguments changed after approval"):
            await service.verify_execution(request.id, "shell", {**ARGS, "command": "rm -rf /"})
        with pytest.raises(ExecutionMismatch, match="approved 'shell', not 'write_file'"):
            await service.verify_execution(request.id, "write_file", ARGS)
        assert [e.event for e in await service.store.events(request.id)][-1] == "execution_refused"


async def test_failed_audit_write_is_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path = tmp_path / "k.db"
    async with approval_service(path, busy_timeout_ms=50) as service:
        blocker = await aiosqlite.connect(str(path), isolation_level=None)
        before = failure_count("approval_audit")
        try:
            await blocker.execute("BEGIN EXCLUSIVE")
            result = await service.decide_from_button("garbage", actor="telegram:5", platform="telegram")
        finally:
            await blocker.execute("ROLLBACK")
            await blocker.close()
        assert result.verdict is PressVerdict.REFUSED
        assert failure_count("approval_audit") == before + 1


async def _approved_with_start_watched(service: ApprovalService) -> tuple[str, asyncio.Event]:
    """An approved request, and an event set when its start's first record fails (the store's own call, watched)."""
    request = await service.open("shell", ARGS, "lead", "conv-1")
    await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
    failed = asyncio.Event()
    record = service.store.execution_starts

    async def watched(request_id: str, detail: str, **options: Any) -> str | None:
        try:
            return await record(request_id, detail, **options)
        except Exception:
            failed.set()
            raise

    service.store.execution_starts = watched  # type: ignore[method-assign]
    return request.id, failed


@asynccontextmanager
async def _locked_out(path: Path) -> AsyncIterator[None]:
    """Another connection holds the file's write lock (BEGIN EXCLUSIVE) for the block's length."""
    blocker = await aiosqlite.connect(str(path), isolation_level=None)
    try:
        await blocker.execute("BEGIN EXCLUSIVE")
        yield
    finally:
        await blocker.execute("ROLLBACK")
        await blocker.close()


async def test_an_approved_call_whose_start_is_locked_out_runs_once_the_store_takes_its_record(
    tmp_path: Path,
) -> None:
    path = tmp_path / "k.db"
    async with approval_service(path, busy_timeout_ms=50) as service:
        request_id, failed = await _approved_with_start_watched(service)
        unrecorded = failure_count("approval_start_unrecorded")
        async with _locked_out(path):
            verifying = asyncio.create_task(service.verify_execution(request_id, "shell", ARGS))
            await failed.wait()
            assert not verifying.done()  # a failed record is no permission to run: it waits and tries again
        await verifying  # allowed to run now, with its start on the record
        events = [e.event for e in await service.store.events(request_id)]
        assert events.count("execution_started") == 1
        assert "execution_refused" not in events
        assert failure_count("approval_start_unrecorded") == unrecorded


async def test_an_approved_call_whose_start_cannot_be_recorded_does_not_run_and_is_reported_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_module, "START_RECORD_WITHIN", 0.3)
    path = tmp_path / "k.db"
    async with approval_service(path, busy_timeout_ms=50) as service:
        request_id, failed = await _approved_with_start_watched(service)
        unrecorded = failure_count("approval_start_unrecorded")
        async with _locked_out(path):
            with pytest.raises(ExecutionMismatch, match=r"start could not be recorded .* it did not run; ask again"):
                await service.verify_execution(request_id, "shell", ARGS)
        assert failed.is_set()
        assert failure_count("approval_start_unrecorded") == unrecorded + 1
        events = [e.event for e in await service.store.events(request_id)]
        assert "execution_started" not in events
        # Nothing on the record says it ran: a recovery reports it as never run, which is true.
        assert request_id in [r.id for r in await service.store.approved_not_started()]


async def test_a_start_locked_out_past_its_bound_is_refused_while_the_lock_is_held_and_never_recorded_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """START_RECORD_WITHIN bounds the refusal whatever the store's patience: the attempt under way when it passes is
    given up, not waited out. The writer used to wait for another process's lock up to ``busy_timeout_ms`` past the
    bound (here ten minutes), twice over (the start, then the refusal's own record)."""
    monkeypatch.setattr(service_module, "START_RECORD_WITHIN", 0.3)
    monkeypatch.setattr(service_module, "REFUSAL_RECORD_WITHIN", 0.1)
    path = tmp_path / "k.db"
    async with approval_service(path, busy_timeout_ms=600_000) as service:
        request_id, failed = await _approved_with_start_watched(service)
        async with _locked_out(path):
            # A guard against a hang, not a measure: the bound is 0.4 s, the writer's patience ten minutes.
            async with asyncio.timeout(60):
                with pytest.raises(
                    ExecutionMismatch, match=r"start could not be recorded .*given up at its deadline.* it did not run"
                ):
                    await service.verify_execution(request_id, "shell", ARGS)
            assert failed.is_set()  # refused here, while the other connection still holds the lock
        # The lock is free: a start the writer still held would commit now. One group goes at a time, so once a
        # write submitted after the refusal is answered, every group before it has returned.
        await service.store.write(lambda tx: tx.one("SELECT 1"))
        events = [e.event for e in await service.store.events(request_id)]
        assert "execution_started" not in events  # refused as not recorded, and not recorded later either
        assert request_id in [r.id for r in await service.store.approved_not_started()]


async def test_a_verification_whose_first_read_waits_behind_a_locked_out_write_is_refused_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read waits for this process's earlier writes, and one of them waits for another process's lock (up
    to ``busy_timeout_ms``, here ten minutes): START_RECORD_WITHIN used to start counting only after that read, so no
    refusal came while the lock was held, and the call ran whenever it was freed."""
    monkeypatch.setattr(service_module, "START_RECORD_WITHIN", 0.3)
    monkeypatch.setattr(service_module, "REFUSAL_RECORD_WITHIN", 0.1)
    path = tmp_path / "k.db"
    async with approval_service(path, busy_timeout_ms=600_000) as service:
        request = await service.open("shell", ARGS, "lead", "conv-1")
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        unrecorded = failure_count("approval_start_unrecorded")
        writer = await service.store.tables.writer()
        assert isinstance(writer, StoreWriter)
        async with _locked_out(path):
            earlier = asyncio.ensure_future(service.store.write(lambda tx: tx.one("SELECT 1")))
            async with asyncio.timeout(60):
                while not writer._in_flight:  # the earlier write waits for the lock on the writer's thread
                    await asyncio.sleep(0)
                with pytest.raises(
                    ExecutionMismatch,
                    match=r"start could not be recorded .*did not even answer the reads.* did not run",
                ):
                    await service.verify_execution(request.id, "shell", ARGS)
            assert not earlier.done()  # refused while the earlier write still waits for the lock
        await earlier
        await service.store.write(lambda tx: tx.one("SELECT 1"))  # every group before it has returned
        events = [e.event for e in await service.store.events(request.id)]
        assert "execution_started" not in events
        assert request.id in [r.id for r in await service.store.approved_not_started()]
        assert failure_count("approval_start_unrecorded") == unrecorded + 1


async def test_a_start_whose_commit_answer_was_lost_is_recorded_once(store_engine: Engine) -> None:
    """The first record of the start commits, but its answer is lost (the connection dropped after COMMIT was
    sent: the store's own error reaches the caller). The retry used to write ``execution_started`` a second
    time: the record said the call started twice, and an auditor counts two runs of one approval."""
    async with approval_service(store_engine.where) as service:
        request = await service.open("shell", ARGS, "lead", "conv-1")
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        record = service.store.execution_starts
        lost: list[str] = []

        async def answer_lost(request_id: str, detail: str, **options: Any) -> str | None:
            reported = await record(request_id, detail, **options)
            if not lost:  # committed; the store's error it would raise had the link dropped before the answer
                lost.append(request_id)
                raise simulated_failure(service.store.tables, "execution start")
            return reported

        service.store.execution_starts = answer_lost  # type: ignore[method-assign]
        await service.verify_execution(request.id, "shell", ARGS)
        assert lost == [request.id]
        events = [e.event for e in await service.store.events(request.id)]
        assert events.count("execution_started") == 1
        assert "execution_refused" not in events


async def test_whether_a_cut_off_press_committed_is_read_from_the_record(store_engine: Engine) -> None:
    """What a platform asks when a press's decision was cancelled midway (the process stopping): the presser is
    told to press again only when their press is not on the record."""
    async with approval_service(store_engine.where) as service:
        request = await service.open("shell", ARGS, "lead", "conv-1")
        data = f"kz1:{request.id}:a"
        assert await service.press_recorded(data, actor="telegram:111") is False
        assert (await service.decide_from_button(data, actor="telegram:111", platform="telegram")).won
        assert await service.press_recorded(data, actor="telegram:111") is True
        assert await service.press_recorded(data, actor="slack:U111") is False
        lost = await service.decide_from_button(f"kz1:{request.id}:d", actor="slack:U111", platform="slack")
        assert not lost.won
        assert await service.press_recorded(data, actor="slack:U111") is True  # its loss is on the record
        assert await service.press_recorded("garbage", actor="telegram:111") is False


async def test_metrics_count_opened_decided_and_time_presses(store_engine: Engine) -> None:
    from prometheus_client import REGISTRY

    def sample(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    opened = sample("kazma_approvals_opened_total", {"tool": "metrics_probe"})
    decided = sample("kazma_approvals_decided_total", {"outcome": "denied", "platform": "slack", "person": ""})
    presses = sample("kazma_press_to_decision_seconds_count", {})
    async with approval_service(store_engine.where) as service:
        request = await service.open("metrics_probe", ARGS, "agent:b", "web:c")
        await service.decide_from_button(f"kz1:{request.id}:d", actor="slack:U111", platform="slack")
    assert sample("kazma_approvals_opened_total", {"tool": "metrics_probe"}) == opened + 1
    assert (
        sample("kazma_approvals_decided_total", {"outcome": "denied", "platform": "slack", "person": ""}) == decided + 1
    )
    assert sample("kazma_press_to_decision_seconds_count", {}) == presses + 1


async def test_an_approver_removed_by_a_new_configuration_is_refused_though_admitted_before(
    store_engine: Engine,
) -> None:
    # The service keeps which presses its configuration admitted (and each presser's person) while that
    # configuration is the one it holds. A press admitted once must not carry over to a configuration that no
    # longer names the presser: the same rules, decision, actor and place, now refused.
    async with approval_service(store_engine.where) as service:
        first = await service.open("shell", ARGS, "agent:b", "web:c")
        second = await service.open("shell", ARGS, "agent:b", "web:c")
        assert (await service.decide_from_button(f"kz1:{first.id}:a", actor="telegram:111", platform="telegram")).won
        service.config = load_config_text('approvals: {approvers: ["slack:U111"]}').config
        refused = await service.decide_from_button(f"kz1:{second.id}:a", actor="telegram:111", platform="telegram")
        assert refused.verdict is PressVerdict.REFUSED
        assert "not an approver here" in refused.message
        row = await service.store.get(second.id)
        assert row is not None
        assert row.status is Status.PENDING
        assert (await service.decide_from_button(f"kz1:{second.id}:a", actor="slack:U111", platform="slack")).won


async def test_a_message_recorded_as_one_requests_card_is_never_found_as_anothers(store_engine: Engine) -> None:
    # An ended request's data pressed on another request's card (Telegram lets a modified client send any data on
    # any message): the "card found" path recorded that card as the ended request's too, and the bus edited it to
    # that outcome while its own request was pending, its buttons gone.
    async with approval_service(store_engine.where) as service:
        ended = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        open_ = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        await service.store.record_card(open_.id, "telegram", "-100", "5")
        assert (await service.decide(ended.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        before = failure_count("card_found_elsewhere")
        with capture_logs() as logs:
            refused = await service.decide(ended.id, Decision.APPROVE, actor="telegram:111", platform="telegram",
                                           card=CardLocation("-100", "5"))  # fmt: skip
        assert not refused.won
        assert failure_count("card_found_elsewhere") == before + 1
        assert [e["request_id"] for e in logs if e["event"] == "approvals.stale_card_of_another"] == [ended.id]
        assert [c.request_id for c in await service.store.cards(ended.id)] == []
        assert [c.request_id for c in await service.store.cards(open_.id)] == [open_.id]
        # a message nobody recorded is still found as the ended request's card
        assert await service.store.record_stale_card(ended.id, "telegram", "-100", "6") is FoundCard.RECORDED
        assert [c.message_id for c in await service.store.cards(ended.id)] == ["6"]
