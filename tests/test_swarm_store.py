"""The swarm task store: RUNNING before work, compare-and-set writes, evidence of refusals, recovery, admission.

Tests taking ``store_engine`` run on SQLite and on PostgreSQL; the ones about SQLite's file locks and
processes sharing one file stay on SQLite.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import aiosqlite
import pytest

from kazma.config.metrics import failure_count
from kazma.config.store.database import apply_migrations, connect
from kazma.engine.swarm.endings import ending_lines
from kazma.engine.swarm.owners import SILENT_SECONDS, this_terminal
from kazma.engine.swarm.store import (
    MIGRATIONS,
    PG_MIGRATIONS,
    TRANSITIONS,
    AtCapacity,
    IllegalTransition,
    StoreUnavailable,
    SwarmTaskStore,
    TaskRun,
    UnknownTask,
)
from kazma.engine.swarm.types import ErrorKind, Pattern, TaskStatus, WorkerResult
from tests.child_env import child_env
from tests.lost_commit_answer import LostCommitAnswer
from tests.pg_support import PostgresServer
from tests.store_backends import Engine, open_store, raw_rows

REPO = Path(__file__).resolve().parent.parent
REQUEST = {"workers": ["researcher", "builder"], "prompt": "write the report", "options": {"aggregation": "collect"}}
DAY = 86400.0


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def opened(
    engine: Engine | Path,
    *,
    clock: Callable[[], float] | None = None,
    busy_timeout_ms: int = 5000,
    retries: int = 3,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> AsyncIterator[SwarmTaskStore]:
    if isinstance(engine, Path):
        engine = Engine("sqlite", str(engine))
    migrations = PG_MIGRATIONS if engine.postgres else MIGRATIONS
    async with open_store(engine, migrations=migrations, busy_timeout_ms=busy_timeout_ms) as conn:
        if sleep is None:
            yield SwarmTaskStore(conn, clock=clock or Clock(), retries=retries)
        else:
            yield SwarmTaskStore(conn, clock=clock or Clock(), retries=retries, sleep=sleep)


async def admit(store: SwarmTaskStore, **kwargs: object) -> TaskRun:
    return await store.admit(Pattern.PIPELINE, dict(REQUEST), owner="telegram:111", **kwargs)  # type: ignore[arg-type]


def ok(worker: str, output: str = "done") -> WorkerResult:
    return WorkerResult(worker, True, output=output)


def status_on_disk(engine: Engine, task_id: str) -> str | None:
    """Read through a separate connection: only committed rows are visible there."""
    rows = raw_rows(engine, "SELECT status FROM swarm_tasks WHERE id = ?", (task_id,))
    return None if not rows else str(rows[0][0])


async def test_migrations_are_additive_and_apply_once(tmp_path: Path) -> None:
    conn = await connect(tmp_path / "k.db")
    try:
        assert [m.version for m in await apply_migrations(conn, MIGRATIONS)] == [1, 2, 3]
        assert await apply_migrations(conn, MIGRATIONS) == []
    finally:
        await conn.close()


async def test_the_row_is_running_on_disk_before_the_worker_is_called(store_engine: Engine) -> None:
    seen: list[str | None] = []

    async with opened(store_engine) as store:

        async def worker(run: TaskRun) -> WorkerResult:
            seen.append(status_on_disk(store_engine, run.task_id))
            return ok("researcher")

        run = await admit(store, route="telegram:-100", parent_id="abc")
        result = await worker(run)
        assert await store.finish(run, TaskStatus.SUCCEEDED, result={"output": result.output}, error=None)

        assert seen == ["running"]
        record = await store.get(run.task_id)
        assert record is not None
        assert record.status is TaskStatus.SUCCEEDED
        assert (record.generation, record.run_id) == (1, run.run_id)
        assert record.request == {**REQUEST, "pattern": "pipeline"}
        assert record.result == {"output": "done"}
        assert (record.owner, record.route, record.parent_id) == ("telegram:111", "telegram:-100", "abc")
        assert record.created_at == datetime.fromtimestamp(1_700_000_000.0, tz=UTC)
        assert record.finished_at is not None
        assert record.finished_at.tzinfo is UTC


async def test_an_admission_whose_commit_answer_was_lost_is_the_task_admitted(store_engine: Engine) -> None:
    # The store retries a write whose commit answered with a transient error; the admission's retry inserted the task
    # again, failed on its own id (an IntegrityError, not retried), and the task, standing RUNNING, was reported
    # not admitted: its work never started.
    async with opened(store_engine) as store:
        lost = LostCommitAnswer(store.tables, lambda sql: sql.startswith("INSERT INTO swarm_tasks"))
        store.tables = lost
        lost.armed = True
        run = await admit(store)
        assert not lost.armed, "the admission's commit was not reached"
        assert status_on_disk(store_engine, run.task_id) == "running"
        record = await store.get(run.task_id)
        assert record is not None
        assert (record.generation, record.run_id) == (1, run.run_id)
        assert await store.finish(run, TaskStatus.SUCCEEDED, result={"output": "done"}, error=None)


async def test_ids_are_server_made_and_distinct(store_engine: Engine) -> None:
    async with opened(store_engine) as store:
        runs = [await admit(store) for _ in range(20)]
    assert len({r.task_id for r in runs}) == 20
    assert len({r.run_id for r in runs}) == 20
    assert all(len(r.task_id) >= 12 and r.task_id.replace("-", "").replace("_", "").isalnum() for r in runs)


def test_transition_table_has_no_way_back() -> None:
    for status in TaskStatus:
        if status.terminal:
            assert TRANSITIONS[status] == frozenset()
    assert {s for s, targets in TRANSITIONS.items() if TaskStatus.RUNNING in targets} == {TaskStatus.PAUSED}
    assert set(TRANSITIONS) == set(TaskStatus)


async def _put_in(store: SwarmTaskStore, status: TaskStatus) -> TaskRun:
    run = await admit(store)
    if status is TaskStatus.PAUSED:
        assert await store.pause(run, "checkpoint")
    elif status.terminal:
        assert await store.finish(run, status, result=None, error=None)
    return run


async def _attempt(store: SwarmTaskStore, run: TaskRun, target: TaskStatus) -> bool:
    if target is TaskStatus.PAUSED:
        return await store.pause(run, "checkpoint")
    if target is TaskStatus.RUNNING:
        try:
            await store.resume(run.task_id)
        except IllegalTransition:
            return False
        return True
    return await store.finish(run, target, result=None, error="x")


@pytest.mark.parametrize("source", list(TaskStatus))
@pytest.mark.parametrize("target", list(TaskStatus))
async def test_every_transition_follows_the_table(store_engine: Engine, source: TaskStatus, target: TaskStatus) -> None:
    async with opened(store_engine) as store:
        run = await _put_in(store, source)
        accepted = await _attempt(store, run, target)
        record = await store.get(run.task_id)
        assert record is not None
        assert accepted is (target in TRANSITIONS[source])
        assert record.status is (target if accepted else source)


async def test_finish_refuses_a_non_terminal_status(store_engine: Engine) -> None:
    async with opened(store_engine) as store:
        run = await admit(store)
        with pytest.raises(ValueError, match="terminal"):
            await store.finish(run, TaskStatus.PAUSED, result=None, error=None)


async def test_stale_generation_writes_are_rejected_and_kept_as_evidence(
    store_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with opened(store_engine) as store:
        first = await admit(store)
        assert await store.journal(first, 0, "researcher", ok("researcher", "notes"))
        assert await store.pause(first, "checkpoint after stage 1")
        second = await store.resume(first.task_id)
        before = failure_count("task_stale_write")

        assert not await store.finish(first, TaskStatus.SUCCEEDED, result={"output": "old"}, error=None)
        assert not await store.step(first, "stage 2 (builder)")
        assert not await store.journal(first, 1, "builder", ok("builder"))
        forged = TaskRun(second.task_id, second.generation, "not-the-run")
        assert not await store.finish(forged, TaskStatus.FAILED, result=None, error="forged")

        assert failure_count("task_stale_write") == before + 4
        record = await store.get(first.task_id)
        assert record is not None
        assert record.status is TaskStatus.RUNNING
        assert record.result is None
        assert record.current_step == "checkpoint after stage 1"
        assert [s.idx for s in await store.journaled(first.task_id)] == [0]

        evidence = await store.rejected_writes(first.task_id)
        assert [(e.generation, e.attempted_status) for e in evidence] == [
            (1, "succeeded"),
            (1, "running"),
            (1, "running"),
            (2, "failed"),
        ]
        assert all("stale generation 1" in e.reason for e in evidence[:3])
        assert evidence[3].reason.startswith("stale run")
        assert evidence[0].payload == {"operation": "finish", "result": {"output": "old"}, "error": None}
        assert evidence[2].payload["idx"] == 1
        assert evidence[0].run_id == first.run_id
        rejected = [r for r in caplog.records if r.getMessage() == "swarm.write_rejected"]
        assert len(rejected) == 4
        assert rejected[0].task_id == first.task_id  # type: ignore[attr-defined]

        assert await store.finish(second, TaskStatus.SUCCEEDED, result={"output": "new"}, error=None)


async def test_writes_after_cancel_are_rejected_with_the_reason(store_engine: Engine) -> None:
    async with opened(store_engine) as store:
        run = await admit(store)
        assert await store.cancel(run.task_id, actor="web:admin")
        assert not await store.cancel(run.task_id, actor="web:admin")
        assert not await store.finish(run, TaskStatus.SUCCEEDED, result={"output": "late"}, error=None)
        record = await store.get(run.task_id)
        assert record is not None
        assert (record.status, record.error, record.result) == (TaskStatus.CANCELLED, "cancelled by web:admin", None)
        [evidence] = await store.rejected_writes(run.task_id)
        assert evidence.reason == "illegal transition cancelled -> succeeded"
        with pytest.raises(UnknownTask):
            await store.cancel("nope", actor="web:admin")
        assert not await store.finish(TaskRun("nope", 1, "x"), TaskStatus.FAILED, result=None, error=None)
        assert [e.reason for e in await store.rejected_writes("nope")] == ["unknown task"]


async def test_resume_bumps_the_generation_and_keeps_the_journal(store_engine: Engine) -> None:
    async with opened(store_engine) as store:
        first = await admit(store)
        assert await store.step(first, "stage 1 (researcher)")
        assert await store.journal(
            first, 0, "researcher", WorkerResult("researcher", True, output="notes", changed_state=True)
        )
        assert await store.pause(first, "checkpoint after stage 1")
        with pytest.raises(UnknownTask):
            await store.resume("nope")

        second = await store.resume(first.task_id)
        assert second.task_id == first.task_id
        assert second.generation == 2
        assert second.run_id != first.run_id
        with pytest.raises(IllegalTransition):
            await store.resume(first.task_id)  # a second resumer loses

        assert await store.journal(
            second, 1, "builder", WorkerResult("builder", False, error="boom", error_kind=ErrorKind.TRANSIENT)
        )
        assert not await store.journal(second, 0, "researcher", ok("researcher"))  # that step is already kept
        steps = await store.journaled(first.task_id)
        assert [(s.idx, s.generation, s.worker, s.ok) for s in steps] == [
            (0, 1, "researcher", True),
            (1, 2, "builder", False),
        ]
        assert steps[0].to_result() == WorkerResult("researcher", True, output="notes", changed_state=True)
        assert steps[1].to_result().error_kind is ErrorKind.TRANSIENT
        [dup] = await store.rejected_writes(first.task_id)
        assert dup.reason == "this step index is already journaled"


async def test_recover_marks_running_interrupted_naming_the_step_and_leaves_paused(store_engine: Engine) -> None:
    path = store_engine
    async with opened(path) as store:
        busy = await admit(store, route="slack:C1")
        assert await store.step(busy, "stage 2 (builder)")
        fresh = await admit(store)
        waiting = await admit(store)
        assert await store.pause(waiting, "checkpoint after stage 1")
        done = await admit(store)
        assert await store.finish(done, TaskStatus.SUCCEEDED, result={"output": "ok"}, error=None)
    # the process "restarts": a new connection and a new store over the same file
    async with opened(path) as store:
        interrupted = await store.recover()
        by_id = {t.task_id: t for t in interrupted}
        assert set(by_id) == {busy.task_id, fresh.task_id}
        assert by_id[busy.task_id].step == "stage 2 (builder)"
        assert by_id[busy.task_id].route == "slack:C1"
        assert by_id[busy.task_id].error == (
            "interrupted: the process stopped in stage 2 (builder); its outcome is unknown"
        )
        record = await store.get(busy.task_id)
        assert record is not None
        assert record.status is TaskStatus.INTERRUPTED
        assert record.error == by_id[busy.task_id].error
        assert record.finished_at is not None
        fresh_record = await store.get(fresh.task_id)
        assert fresh_record is not None
        assert fresh_record.error is not None
        assert "its outcome is unknown" in fresh_record.error
        paused = await store.get(waiting.task_id)
        assert paused is not None
        assert paused.status is TaskStatus.PAUSED
        finished = await store.get(done.task_id)
        assert finished is not None
        assert finished.status is TaskStatus.SUCCEEDED

        assert await store.recover() == []
        # the dead run's late write cannot resurrect its task
        assert not await store.finish(busy, TaskStatus.SUCCEEDED, result=None, error=None)
        assert await store.count(TaskStatus.INTERRUPTED) == 2
        assert await store.count(TaskStatus.RUNNING) == 0
        # the paused pipeline survives the restart and can go on
        assert (await store.resume(waiting.task_id)).generation == 2


async def test_admission_under_gather_never_exceeds_the_cap(store_engine: Engine) -> None:
    path = store_engine
    async with opened(path) as one, opened(path) as two:

        async def try_admit(store: SwarmTaskStore) -> TaskRun | AtCapacity:
            try:
                return await admit(store, max_running=3)
            except AtCapacity as exc:
                return exc

        outcomes = await asyncio.gather(*(try_admit(s) for s in [one, two] * 5))
        admitted = [o for o in outcomes if isinstance(o, TaskRun)]
        refused = [o for o in outcomes if isinstance(o, AtCapacity)]
        assert len(admitted) == 3
        assert len(refused) == 7
        assert all(r.retry_in > 0 for r in refused)
        assert await one.count(TaskStatus.RUNNING) == 3
        assert len(await one.list()) == 3  # a refusal writes nothing

        # paused tasks do not hold a slot, finished ones free theirs
        assert await one.pause(admitted[0], "checkpoint")
        extra = await admit(two, max_running=3)
        with pytest.raises(AtCapacity):
            await admit(two, max_running=3)
        with pytest.raises(AtCapacity):
            await one.resume(admitted[0].task_id, max_running=3)
        assert await two.finish(extra, TaskStatus.SUCCEEDED, result=None, error=None)
        assert (await one.resume(admitted[0].task_id, max_running=3)).generation == 2


ADMITTER = textwrap.dedent(
    """
    import asyncio, sys
    from kazma.config.store.database import open_database
    from kazma.engine.swarm.store import MIGRATIONS, AtCapacity, SwarmTaskStore
    from kazma.engine.swarm.types import Pattern

    async def main(path):
        conn = await open_database(path, migrations=MIGRATIONS)
        try:
            store = SwarmTaskStore(conn)
            print("ready", flush=True)
            sys.stdin.readline()
            try:
                run = await store.admit(Pattern.DISPATCH, {"prompt": "p"}, owner="web:a", max_running=1)
                print("admitted", run.task_id, flush=True)
            except AtCapacity:
                print("capacity", flush=True)
        finally:
            await conn.close()

    asyncio.run(main(sys.argv[1]))
    """
)


@pytest.mark.slow
async def test_two_processes_admit_against_one_file_exactly_one_wins(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    async with opened(path):
        pass  # schema in place before the race, so only admission is contended
    env = child_env()
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            ADMITTER,
            str(path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        for _ in range(2)
    ]
    for proc in procs:  # both are connected before either admits
        assert proc.stdout is not None
        assert (await proc.stdout.readline()).strip() == b"ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        # structlog's default logger also writes to stdout: keep only the verdict line
        [verdict] = [line.split() for line in out.decode().splitlines() if line.startswith(("admitted", "capacity"))]
        outputs.append(verdict)
    assert sorted(o[0] for o in outputs) == ["admitted", "capacity"]
    async with opened(path) as store:
        [running] = await store.list(TaskStatus.RUNNING)
        assert ["admitted", running.id] in outputs


async def test_a_transient_lock_is_retried_until_it_clears(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    locker = await aiosqlite.connect(str(path), isolation_level=None, timeout=0)
    delays: list[float] = []

    async def release_on_first_backoff(delay: float) -> None:
        delays.append(delay)
        if locker.in_transaction:
            await locker.execute("ROLLBACK")

    try:
        async with opened(path, busy_timeout_ms=0, sleep=release_on_first_backoff) as store:
            run = await admit(store)
            await locker.execute("BEGIN EXCLUSIVE")
            assert await store.finish(run, TaskStatus.SUCCEEDED, result={"output": "kept"}, error=None)
            assert len(delays) == 1
            record = await store.get(run.task_id)
            assert record is not None
            assert record.status is TaskStatus.SUCCEEDED
    finally:
        await locker.close()


async def test_a_persistent_lock_raises_store_unavailable_and_records_nothing(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    locker = await aiosqlite.connect(str(path), isolation_level=None, timeout=0)
    delays: list[float] = []

    async def record_only(delay: float) -> None:
        delays.append(delay)

    before = failure_count("task_store_unavailable")
    try:
        async with opened(path, busy_timeout_ms=0, retries=3, sleep=record_only) as store:
            run = await admit(store)
            await locker.execute("BEGIN EXCLUSIVE")
            with pytest.raises(StoreUnavailable) as raised:
                await store.finish(run, TaskStatus.SUCCEEDED, result={"output": "lost"}, error=None)
            assert "locked" in raised.value.reason
            assert raised.value.operation == "finish"
            assert len(delays) == 3
            assert delays == sorted(delays)
            assert failure_count("task_store_unavailable") == before + 1
            with pytest.raises(StoreUnavailable):
                await admit(store)  # no row, so the caller must not start the work
            await locker.execute("ROLLBACK")
            record = await store.get(run.task_id)
            assert record is not None
            assert record.status is TaskStatus.RUNNING
            assert record.result is None
            assert await store.count(TaskStatus.RUNNING) == 1
    finally:
        await locker.close()


async def test_a_non_transient_error_is_not_retried(tmp_path: Path) -> None:
    delays: list[float] = []

    async def record_only(delay: float) -> None:
        delays.append(delay)

    conn = await connect(tmp_path / "k.db")  # no migrations: the tables are missing
    try:
        store = SwarmTaskStore(conn, sleep=record_only)
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            await store.get("x")
    finally:
        await conn.close()
    assert delays == []


async def test_prune_deletes_old_finished_tasks_with_their_journal(store_engine: Engine) -> None:
    clock = Clock()
    async with opened(store_engine, clock=clock) as store:
        old = await admit(store)
        assert await store.journal(old, 0, "researcher", ok("researcher"))
        assert await store.finish(old, TaskStatus.SUCCEEDED, result=None, error=None)
        stale = TaskRun(old.task_id, 9, "x")
        assert not await store.finish(stale, TaskStatus.FAILED, result=None, error=None)
        old_running = await admit(store)
        old_paused = await admit(store)
        assert await store.pause(old_paused, "checkpoint")
        clock.now += 8 * DAY
        recent = await admit(store)
        assert await store.finish(recent, TaskStatus.FAILED, result=None, error="boom")
        clock.now += 1

        assert await store.prune(7) == 1
        assert await store.get(old.task_id) is None
        assert await store.journaled(old.task_id) == []
        assert await store.rejected_writes(old.task_id) == []
        for kept in (old_running, old_paused, recent):
            assert await store.get(kept.task_id) is not None
        assert await store.prune(7) == 0


async def test_list_history_and_count(store_engine: Engine) -> None:
    clock = Clock()
    async with opened(store_engine, clock=clock) as store:
        runs = []
        for _ in range(4):
            runs.append(await admit(store))
            clock.now += 1
        assert await store.finish(runs[2], TaskStatus.PARTIAL, result={"ok": 1}, error=None)
        clock.now += 1
        assert await store.finish(runs[0], TaskStatus.FAILED, result=None, error="boom")

        assert [r.id for r in await store.list()] == [r.task_id for r in reversed(runs)]
        assert [r.id for r in await store.list(limit=2)] == [runs[3].task_id, runs[2].task_id]
        assert [r.id for r in await store.list(TaskStatus.RUNNING)] == [runs[3].task_id, runs[1].task_id]
        assert [r.id for r in await store.history(10)] == [runs[0].task_id, runs[2].task_id]
        assert await store.count(TaskStatus.RUNNING) == 2
        assert await store.count(TaskStatus.PARTIAL) == 1
        assert await store.get("missing") is None


async def test_a_lost_postgresql_connection_is_retried(pg_server: PostgresServer, pg_dsn: str) -> None:
    """The server ends the store's read connections (a failover, a restart): the next read retries on a new one."""
    delays: list[float] = []

    async def record_only(delay: float) -> None:
        delays.append(delay)

    engine = Engine("postgresql", pg_dsn)
    async with open_store(engine, migrations=PG_MIGRATIONS, application_name="kazma-swarm-lost") as conn:
        store = SwarmTaskStore(conn, clock=Clock(), sleep=record_only)
        run = await admit(store)
        assert await store.get(run.task_id) is not None  # the pool's connection is open and used
        assert pg_server.terminate_client("kazma-swarm-lost-read") >= 1
        record = await store.get(run.task_id)
        assert record is not None
        assert record.status is TaskStatus.RUNNING
        assert len(delays) == 1


async def test_an_ending_written_without_its_run_keeps_the_journaled_answers_visible(store_engine: Engine) -> None:
    """A crash (recover), a stop or a cancel ends a task with no run to list its workers: the stages its journal
    kept are written into its result, so every surface's ``kept answers`` shows them (endings.ending_lines), as
    a deadline's ending does (found by the chaos matrix's swarm scenario: a crash in stage 2 hid stage 1)."""
    path = store_engine
    async with opened(path) as store:
        crashed = await admit(store)
        assert await store.journal(crashed, 0, "researcher", ok("researcher", "FACTS: the sky is blue"))
        assert await store.step(crashed, "stage 2 (builder)")
        stopped = await admit(store)
        assert await store.journal(stopped, 0, "researcher", ok("researcher", "FACTS: kept at the stop"))
        waiting = await admit(store)
        assert await store.journal(waiting, 0, "researcher", ok("researcher", "FACTS: kept while paused"))
        assert await store.pause(waiting, "checkpoint after stage 1")
        assert await store.cancel(stopped.task_id, actor="shutdown", result={"interrupted_by": "shutdown"})
        assert await store.cancel(waiting.task_id, actor="telegram:111")
        # a run that fails without listing its workers (its checkpoint could not be opened)
        unopened = await admit(store)
        assert await store.journal(unopened, 0, "researcher", ok("researcher", "FACTS: kept when it failed"))
        assert await store.finish(unopened, TaskStatus.FAILED, result={"execution": {}}, error="gate not opened")
    async with opened(path) as store:
        await store.recover()
        for run, words in (
            (crashed, "the sky is blue"),
            (stopped, "kept at the stop"),
            (waiting, "kept while"),
            (unopened, "kept when it failed"),
        ):
            record = await store.get(run.task_id)
            assert record is not None
            assert record.status.terminal
            lines = ending_lines(record)
            assert "kept answers (1):" in lines, (record.status, lines)
            assert any(line.startswith("[researcher] FACTS: ") and words in line for line in lines), lines
        stopped_record = await store.get(stopped.task_id)
        assert stopped_record is not None
        assert stopped_record.result is not None
        assert stopped_record.result["interrupted_by"] == "shutdown"  # what the stop wrote stays


async def test_a_task_id_never_starts_with_a_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kazma swarm status -EGG…` reads the id as an option (found by the chaos matrix: a task the person could
    not look up); the id drawn is drawn again until it does not start with one."""
    drawn = iter(["-EGGT4WeXA1t", "EGGT4WeXA1tx"])
    real = secrets.token_urlsafe
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n=None: next(drawn) if n == 9 else real(n))
    async with opened(tmp_path / "s.db") as store:
        run = await admit(store)
    assert run.task_id == "EGGT4WeXA1tx"


async def test_recover_leaves_a_task_a_live_terminal_runs_and_ends_one_whose_terminal_is_gone(
    store_engine: Engine,
) -> None:
    # `kazma run` starting while `kazma swarm dispatch …` ran its task in a terminal marked that live task
    # interrupted: its worker went on, its real result was refused, the row kept "interrupted".
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)  # fmt: skip
    prefix, host, boot, _pid, started = this_terminal().split("/")  # this terminal: prefix, host, boot, pid, start
    dead_owner = "/".join((prefix, host, boot, gone.stdout.strip(), started))  # a pid that has exited
    async with opened(store_engine) as store:
        store.replica = this_terminal()  # as `kazma swarm …` sets it
        live = await admit(store)
        store.replica = dead_owner
        dead = await admit(store)
    async with opened(store_engine) as store:  # `kazma run` starting on the same store
        assert [t.task_id for t in await store.recover()] == [dead.task_id]
        record = await store.get(live.task_id)
        assert record is not None
        assert record.status is TaskStatus.RUNNING
        assert await store.finish(live, TaskStatus.SUCCEEDED, result={"output": "ok"}, error=None)


async def test_a_task_of_a_terminal_elsewhere_is_left_while_touched_and_ended_once_it_falls_silent(
    store_engine: Engine,
) -> None:
    # A terminal on another host (another container) was taken for alive for ever: a dead one's task stayed
    # running and held a place under max_parallel.
    clock = [1_000_000.0]
    elsewhere = "terminal/another-host/0000abcd/42/12345"
    async with opened(store_engine, clock=lambda: clock[0]) as store:
        store.replica = elsewhere
        task = await admit(store)
        clock[0] += 60
        assert await store.recover() == []  # touched a minute ago: alive
        await store.touch([task.task_id])
        clock[0] += SILENT_SECONDS + 1
        assert [t.task_id for t in await store.recover()] == [task.task_id]
