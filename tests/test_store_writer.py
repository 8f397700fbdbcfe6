"""The group-committing store writer: one transaction per group, failures kept apart, nobody answered early."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiosqlite
import pytest

from kazma.config.store.database import Tables, connect
from kazma.config.store.errors import WriteGivenUp, is_busy
from kazma.config.store.writer import StoreWriter, Tx


@pytest.fixture
async def writer(tmp_path: Path) -> AsyncIterator[StoreWriter]:
    path = tmp_path / "w.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    conn.execute(
        "CREATE TABLE child (k TEXT REFERENCES t (k) DEFERRABLE INITIALLY DEFERRED)"
    )  # a violation shows only at COMMIT
    conn.close()
    w = StoreWriter(path)
    yield w
    await w.close()


def rows(path: str) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        return {str(k): int(v) for k, v in conn.execute("SELECT k, v FROM t")}
    finally:
        conn.close()


def put(key: str, value: int) -> Callable[[Tx], int]:
    def op(tx: Tx) -> int:
        return tx.run("INSERT INTO t (k, v) VALUES (?, ?)", (key, value))

    return op


async def test_operations_submitted_together_commit_as_one_group(writer: StoreWriter) -> None:
    results = await asyncio.gather(*(writer.submit(put(f"k{i}", i)) for i in range(50)))
    assert results == [1] * 50
    assert writer.groups == 1  # fifty callers, one transaction, one fsync
    assert rows(writer.path) == {f"k{i}": i for i in range(50)}


async def test_a_failing_operation_loses_only_its_own_writes(writer: StoreWriter) -> None:
    def broken(tx: Tx) -> None:
        tx.run("INSERT INTO t (k, v) VALUES ('half', 1)")
        raise ValueError("this operation changed its mind")

    outcomes = await asyncio.gather(
        writer.submit(put("a", 1)),
        writer.submit(broken),
        writer.submit(put("b", 2)),
        return_exceptions=True,
    )
    assert outcomes[0] == 1
    assert outcomes[2] == 1
    assert isinstance(outcomes[1], ValueError)
    assert rows(writer.path) == {"a": 1, "b": 2}  # nothing of "half"


async def test_a_failed_commit_fails_every_caller_and_keeps_nothing(writer: StoreWriter) -> None:
    def orphan(tx: Tx) -> None:
        tx.run("INSERT INTO child (k) VALUES ('nobody')")  # the deferred foreign key fails the COMMIT

    outcomes = await asyncio.gather(
        writer.submit(put("a", 1)),
        writer.submit(orphan),
        writer.submit(put("b", 2)),
        return_exceptions=True,
    )
    assert all(isinstance(o, sqlite3.IntegrityError) for o in outcomes), outcomes
    assert rows(writer.path) == {}
    assert await writer.submit(put("c", 3)) == 1  # and the writer goes on
    assert rows(writer.path) == {"c": 3}


async def test_a_lock_held_by_another_process_is_waited_for_off_the_loop(writer: StoreWriter) -> None:
    other = sqlite3.connect(writer.path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO t (k, v) VALUES ('theirs', 0)")
    pending = asyncio.create_task(writer.submit(put("mine", 1)))
    async with asyncio.timeout(10):
        while not writer._in_flight:  # the loop thread met the lock and handed the group to the thread
            await asyncio.sleep(0)
    ticks = 0
    while ticks < 50:  # the loop is free while the writer waits: other coroutines keep running
        await asyncio.sleep(0)
        ticks += 1
    assert not pending.done()
    other.execute("COMMIT")
    other.close()
    assert await asyncio.wait_for(pending, timeout=10) == 1
    assert rows(writer.path) == {"theirs": 0, "mine": 1}


@asynccontextmanager
async def lock_held(path: str) -> AsyncIterator[aiosqlite.Connection]:
    """Another connection holds the file's write lock for the block's length (from aiosqlite's thread: the loop
    never waits on it)."""
    holder = await aiosqlite.connect(path, isolation_level=None)
    try:
        await holder.execute("BEGIN IMMEDIATE")
        yield holder
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()


async def test_a_write_past_its_deadline_under_a_held_lock_is_given_up_and_never_commits(writer: StoreWriter) -> None:
    """Its group's other write waits on with its own patience, and commits once the lock is free; the one given up
    does not, then or ever (its caller was told it was not written). The writer used to wait for the lock past any
    caller's deadline, up to ``busy_timeout_ms`` (here ten minutes, were it not given up)."""
    patient_writer = StoreWriter(writer.path, busy_timeout_ms=600_000)
    try:
        async with lock_held(writer.path):
            loop = asyncio.get_running_loop()
            late = asyncio.ensure_future(patient_writer.submit(put("late", 1), deadline=loop.time() + 0.2))
            patient = asyncio.ensure_future(patient_writer.submit(put("patient", 2)))  # the same turn: one group
            async with asyncio.timeout(60):  # a guard against a hang, not a measure: the deadline is 0.2 s away
                with pytest.raises(WriteGivenUp, match="given up at its deadline"):
                    await late
            assert not patient.done()  # told while the lock is still held; the other write waits on
            assert patient_writer._in_flight  # ... in the group on the writer's thread
        assert await asyncio.wait_for(patient, timeout=60) == 1
        await patient_writer.submit(put("after", 3))  # one group at a time: everything before it has returned
        assert rows(writer.path) == {"patient": 2, "after": 3}
    finally:
        await patient_writer.close()


async def test_a_write_past_its_deadline_while_it_waits_for_its_group_is_given_up(writer: StoreWriter) -> None:
    """A group on its way waits for the lock; a write submitted meanwhile waits for that group to return, and its
    deadline passes there: it is given up without ever going into a group, and the earlier write stands."""
    patient_writer = StoreWriter(writer.path, busy_timeout_ms=600_000)
    try:
        async with lock_held(writer.path):
            first = asyncio.ensure_future(patient_writer.submit(put("first", 1)))
            async with asyncio.timeout(60):
                while not patient_writer._in_flight:  # the loop thread met the lock and handed the group on
                    await asyncio.sleep(0)
            loop = asyncio.get_running_loop()
            late = asyncio.ensure_future(patient_writer.submit(put("late", 2), deadline=loop.time() + 0.2))
            async with asyncio.timeout(60):
                with pytest.raises(WriteGivenUp, match="waited for the writer"):
                    await late
            assert not first.done()
        assert await asyncio.wait_for(first, timeout=60) == 1
        await patient_writer.submit(put("after", 3))
        assert rows(writer.path) == {"first": 1, "after": 3}
        with pytest.raises(WriteGivenUp, match="before it was submitted"):
            await patient_writer.submit(put("too late", 4), deadline=asyncio.get_running_loop().time())
        await patient_writer.caught_up()
        assert "too late" not in rows(writer.path)
    finally:
        await patient_writer.close()


async def test_the_writer_a_connection_makes_is_as_patient_as_the_connection(tmp_path: Path) -> None:
    # Tables.writer() made its writer with the default busy_timeout_ms (5 s), whatever the store was configured with.
    conn = await connect(tmp_path / "patience.db", busy_timeout_ms=1234)
    try:
        writer = await Tables(conn).writer()
        assert writer.busy_timeout_ms == 1234
        await writer.close()
    finally:
        await conn.close()


async def test_a_reader_cancelled_while_it_waits_for_writes_leaves_their_callers_answered(writer: StoreWriter) -> None:
    # A read waiting for the writes before it (caught_up) that was cancelled (a long-poll whose client left, a task
    # stopped) cancelled those writes' futures: their callers got CancelledError for writes that committed.
    other = sqlite3.connect(writer.path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    pending = asyncio.create_task(writer.submit(put("mine", 1)))
    async with asyncio.timeout(10):
        while not writer._in_flight:  # the write waits for the lock on the writer's thread
            await asyncio.sleep(0)
    reader = asyncio.create_task(writer.caught_up())
    await asyncio.sleep(0)  # the reader is waiting for the write
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    other.execute("COMMIT")
    other.close()
    assert await asyncio.wait_for(pending, timeout=10) == 1  # answered, not cancelled
    assert rows(writer.path) == {"mine": 1}


async def test_a_read_after_a_write_sees_it(tmp_path: Path, writer: StoreWriter) -> None:
    conn = await connect(writer.path)
    other = sqlite3.connect(writer.path, isolation_level=None, check_same_thread=False)
    try:
        tables = Tables.of(conn)
        tables.use_writer(writer)
        other.execute("BEGIN IMMEDIATE")  # the write cannot commit yet
        write = asyncio.create_task(writer.submit(put("seen", 7)))
        async with asyncio.timeout(10):
            while not writer._in_flight:
                await asyncio.sleep(0)
        read = asyncio.create_task(tables.one("SELECT v FROM t WHERE k = 'seen'"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not read.done()  # the read waits for the write submitted before it
        other.execute("COMMIT")
        assert await asyncio.wait_for(read, timeout=10) == (7,)
        await write
    finally:
        other.close()
        await conn.close()


async def test_close_commits_what_is_queued_and_refuses_more(writer: StoreWriter) -> None:
    queued = [asyncio.create_task(writer.submit(put(f"q{i}", i))) for i in range(5)]
    await asyncio.sleep(0)
    await writer.close()
    assert [t.result() for t in queued] == [1] * 5
    assert len(rows(writer.path)) == 5
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        await writer.submit(put("late", 1))


def test_an_in_memory_database_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a file"):
        StoreWriter(":memory:")


async def test_a_riding_operation_joins_the_next_group_and_a_read_does_not_wait_for_it(
    tmp_path: Path, writer: StoreWriter
) -> None:
    conn = await connect(writer.path)
    try:
        tables = Tables.of(conn)
        tables.use_writer(writer)
        groups = writer.groups
        rider = asyncio.create_task(writer.submit(put("rider", 1), ride=3600.0))
        async with asyncio.timeout(10):
            while writer.riders == 0:
                await asyncio.sleep(0)
        # It starts no commit, and a read (which waits for every write submitted before it) is not held by it.
        assert await asyncio.wait_for(tables.one("SELECT COUNT(*) FROM t"), timeout=10) == (0,)
        assert writer.groups == groups
        assert not rider.done()
        # The next write's group takes it along, after the write itself: one commit for both.
        assert await writer.submit(put("first", 2)) == 1
        assert await asyncio.wait_for(rider, timeout=10) == 1
        assert writer.groups == groups + 1
        assert rows(writer.path) == {"first": 2, "rider": 1}
    finally:
        await conn.close()


async def test_a_riding_operation_goes_alone_in_time_when_asked_and_at_close(writer: StoreWriter) -> None:
    groups = writer.groups
    # Nothing else is written: it commits on its own once its time is up.
    assert await asyncio.wait_for(writer.submit(put("late", 1), ride=0.01), timeout=10) == 1
    assert writer.groups == groups + 1
    # Released: it goes at once, however long it could have waited.
    released = asyncio.create_task(writer.submit(put("released", 2), ride=3600.0))
    async with asyncio.timeout(10):
        while writer.riders == 0:
            await asyncio.sleep(0)
    writer.release_riders()
    assert await asyncio.wait_for(released, timeout=10) == 1
    # Still waiting when the writer closes: committed before it stops.
    closing = asyncio.create_task(writer.submit(put("closing", 3), ride=3600.0))
    async with asyncio.timeout(10):
        while writer.riders == 0:
            await asyncio.sleep(0)
    await asyncio.wait_for(writer.close(), timeout=10)
    assert closing.result() == 1
    assert rows(writer.path) == {"late": 1, "released": 2, "closing": 3}


async def test_after_commit_runs_only_for_what_committed(writer: StoreWriter) -> None:
    told: list[str] = []

    def put_telling(key: str, *, fail: bool = False, orphan: bool = False) -> Callable[[Tx], int]:
        def op(tx: Tx) -> int:
            changed = tx.run("INSERT INTO t (k, v) VALUES (?, 0)", (key,))
            tx.after_commit(lambda: told.append(key))
            if orphan:
                tx.run("INSERT INTO child (k) VALUES ('nobody')")  # the deferred foreign key fails the COMMIT
            if fail:
                raise ValueError("this operation changed its mind")
            return changed

        return op

    # One group: the failing operation's statements and its callback go; the others' stay.
    outcomes = await asyncio.gather(
        writer.submit(put_telling("a")), writer.submit(put_telling("b", fail=True)), writer.submit(put_telling("c")),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(outcomes[1], ValueError)
    assert told == ["a", "c"]
    # A commit that fails: nobody is told.
    with pytest.raises(sqlite3.IntegrityError):
        await writer.submit(put_telling("d", orphan=True))
    assert told == ["a", "c"]
    assert rows(writer.path) == {"a": 0, "c": 0}


async def test_a_lone_write_is_answered_in_the_turn_its_group_runs(writer: StoreWriter) -> None:
    """The caller that starts a group runs it itself after one yield: a lone write run on the loop thread costs
    its caller one turn of the loop, not a flush callback and then a turn to be woken."""
    writer.inline_commit_seconds = 60.0  # on the loop thread however slow a busy machine's commits are
    loop = asyncio.get_running_loop()
    turns = 0

    def tick() -> None:
        nonlocal turns
        turns += 1
        loop.call_soon(tick)

    await writer.submit(put("warm", 0))  # the connection opened, commits known to be quick: inline from here
    loop.call_soon(tick)
    await asyncio.sleep(0)
    before = turns
    assert await writer.submit(put("lone", 1)) == 1
    assert turns - before == 1
    assert writer.inline_groups == writer.groups == 2
    assert rows(writer.path) == {"warm": 0, "lone": 1}


def test_a_lone_write_with_nothing_else_ready_is_answered_without_a_turn(tmp_path: Path) -> None:
    """With no callback ready, a turn would gather no other write (what the next turn polls is queued after the
    starter): the starter runs its group at once, and its caller is answered without yielding to the loop."""
    path = tmp_path / "lone.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    conn.close()

    async def main() -> None:
        writer = StoreWriter(path, inline_commit_seconds=60.0)  # on the loop thread however slow the commits
        try:
            await writer.submit(put("warm", 0))
            loop = asyncio.get_running_loop()
            assert not loop._ready  # type: ignore[attr-defined]  # this task's step is all that runs
            lone = writer.submit(put("lone", 1))
            with pytest.raises(StopIteration) as answered:
                lone.send(None)  # one step: the group ran and the caller is answered, never suspended
            assert answered.value.value == 1
            assert writer.inline_groups == writer.groups == 2
        finally:
            await writer.close()

    asyncio.run(main())  # a loop of its own: nothing but this test's task is ready on it
    assert rows(str(path)) == {"warm": 0, "lone": 1}


async def test_a_group_starter_cancelled_before_its_turn_still_commits_the_others(writer: StoreWriter) -> None:
    """The caller that starts a group is cancelled during the turn it yields: the group runs all the same (its
    own write too, as any cancelled caller's), and the others are answered."""
    first = asyncio.ensure_future(writer.submit(put("starter", 1)))
    await asyncio.sleep(0)  # ``first`` submitted: it starts the group and yields its turn
    second = asyncio.ensure_future(writer.submit(put("other", 2)))
    first.cancel()
    assert await asyncio.wait_for(second, timeout=5) == 1
    with pytest.raises(asyncio.CancelledError):
        await first
    assert rows(writer.path) == {"starter": 1, "other": 2}


async def test_an_answered_write_is_no_longer_unanswered_when_its_caller_resumes(writer: StoreWriter) -> None:
    """A write leaves the unanswered ones as it is answered, not by a done callback the loop runs a turn later
    (one more callback for every write: on the old code the set still held a lone write after its answer)."""
    writer.inline_commit_seconds = 60.0  # on the loop thread however slow a busy machine's commits are
    await writer.submit(put("warm", 0))
    assert await writer.submit(put("lone", 1)) == 1
    assert writer._unanswered == set()
    together = await asyncio.gather(*(writer.submit(put(k, 1)) for k in ("a", "b", "c")))
    assert together == [1, 1, 1]
    assert writer._unanswered == set()


async def test_a_cancelled_caller_leaves_nothing_unanswered_and_its_write_commits(writer: StoreWriter) -> None:
    """A caller that gives up is taken out by its future's done callback (the answer skips it): nothing of it is
    left among the unanswered for a close or a read's catching up to wait on, and its write commits all the same."""
    first = asyncio.ensure_future(writer.submit(put("gave_up", 1)))
    await asyncio.sleep(0)  # ``first`` submitted: it starts the group and yields its turn
    second = asyncio.ensure_future(writer.submit(put("stays", 2)))
    first.cancel()
    assert await asyncio.wait_for(second, timeout=5) == 1
    with pytest.raises(asyncio.CancelledError):
        await first
    assert writer._unanswered == set()
    await asyncio.wait_for(writer.caught_up(), timeout=5)
    assert rows(writer.path) == {"gave_up": 1, "stays": 2}


def _where(ran: list[int]) -> Callable[[Tx], int]:
    """An operation that records the thread it ran on."""

    def op(tx: Tx) -> int:
        ran.append(threading.get_ident())
        return tx.run("INSERT INTO t (k, v) VALUES (?, ?)", (f"k{len(ran)}", 0))

    return op


def _loop_runs_meanwhile(loop: asyncio.AbstractEventLoop, seen: list[bool]) -> Callable[[Tx], int]:
    """An operation that asks the loop to run a callback and waits for it: the loop ran while the group was on its
    way (True), or it was held by the group (False, after the wait's guard ran out)."""

    def op(tx: Tx) -> int:
        done = threading.Event()
        loop.call_soon_threadsafe(done.set)
        seen.append(done.wait(timeout=5))
        return tx.run("INSERT INTO t (k, v) VALUES ('meanwhile', 1)")

    return op


async def test_a_commit_a_little_slow_goes_inline_on_an_idle_loop(writer: StoreWriter) -> None:
    """Commits averaging more than the quick bound but under the idle cap: a lone write on a loop with nothing else
    ready runs on the loop thread (no hop for a press nobody else waits behind). The old rule sent it to the thread."""
    await writer.submit(put("warm", 0))
    writer.inline_commit_seconds, writer.inline_idle_commit_seconds = 1.0, 10.0  # the same whatever the machine
    writer._commit_ewma = 2.0
    ran: list[int] = []
    assert await writer.submit(_where(ran)) == 1
    assert ran == [threading.get_ident()]


async def test_a_commit_a_little_slow_goes_to_the_thread_while_the_loop_is_busy(writer: StoreWriter) -> None:
    """The same commit time, but other callbacks are ready on the loop: the group goes to the thread, and the loop
    keeps running them while it commits."""
    await writer.submit(put("warm", 0))
    writer.inline_commit_seconds, writer.inline_idle_commit_seconds = 1.0, 10.0
    average = 2.0
    loop = asyncio.get_running_loop()
    running = True

    def busy() -> None:  # always one callback ready, as on a loop serving other presses
        if running:
            loop.call_soon(busy)

    loop.call_soon(busy)
    seen: list[bool] = []
    try:
        writer._commit_ewma = average
        assert await writer.submit(_loop_runs_meanwhile(loop, seen)) == 1
    finally:
        running = False
    assert seen == [True]
    assert writer.inline_groups == 1  # only the warm-up


async def test_a_slow_disk_never_holds_the_loop_even_when_idle(writer: StoreWriter) -> None:
    """Commits averaging over the idle cap (a slow disk): even a lone write on an idle loop goes to the thread, and
    the loop runs other callbacks while it commits."""
    await writer.submit(put("warm", 0))
    writer._commit_ewma = writer.inline_idle_commit_seconds * 2
    seen: list[bool] = []
    ran: list[int] = []
    assert await writer.submit(_loop_runs_meanwhile(asyncio.get_running_loop(), seen)) == 1
    writer._commit_ewma = writer.inline_idle_commit_seconds * 2
    assert await writer.submit(_where(ran)) == 1
    assert seen == [True]
    assert ran != [threading.get_ident()]
    assert writer.inline_groups == 1  # only the warm-up


async def test_a_timer_due_during_the_commit_keeps_a_little_slow_commit_off_the_loop(writer: StoreWriter) -> None:
    """A timer due before the commit should be done counts as somebody waiting for the loop: the thread."""
    await writer.submit(put("warm", 0))
    loop = asyncio.get_running_loop()
    writer.inline_commit_seconds, writer.inline_idle_commit_seconds = 1.0, 10.0
    writer._commit_ewma = 2.0
    due = loop.call_later(1.0, lambda: None)  # due before the commit's 2 s (on average) would be done
    ran: list[int] = []
    try:
        assert await writer.submit(_where(ran)) == 1
    finally:
        due.cancel()
    assert ran != [threading.get_ident()]


def _goes(writer: StoreWriter, where: str) -> None:
    """The next group runs on the loop thread (``loop``) or on the writer's thread (``thread``)."""
    if where == "loop":
        writer.inline_commit_seconds = 60.0  # however slow a busy machine's commits are
    else:
        writer._commit_ewma = writer.inline_idle_commit_seconds * 2  # a slow disk: never on the loop


@pytest.mark.parametrize("where", ["loop", "thread"])
async def test_an_operation_raising_stop_iteration_is_answered_and_the_writer_goes_on(
    writer: StoreWriter, where: str
) -> None:
    """asyncio refuses a StopIteration in a future (a TypeError from set_exception). Given one raw, the answering
    of the group stopped there: the operations after it were never answered and, from the thread, the writer stayed
    in flight for good (every later write and read waited)."""

    def empty(tx: Tx) -> int:
        return int(next(iter(tx.all("SELECT v FROM t WHERE k = 'nobody'"))))

    await writer.submit(put("warm", 0))
    _goes(writer, where)
    async with asyncio.timeout(30):
        outcomes = await asyncio.gather(
            writer.submit(put("a", 1)), writer.submit(empty), writer.submit(put("b", 2)), return_exceptions=True
        )
        _goes(writer, where)
        assert await writer.submit(put("c", 3)) == 1
    assert outcomes[0] == 1
    assert outcomes[2] == 1
    assert isinstance(outcomes[1], RuntimeError), outcomes[1]
    assert isinstance(outcomes[1].__cause__, StopIteration)
    assert rows(writer.path) == {"warm": 0, "a": 1, "b": 2, "c": 3}


class _Interrupt(BaseException):
    """What an interrupt or an exit is to the writer: no Exception."""


@pytest.mark.parametrize("where", ["loop", "thread"])
async def test_an_interrupt_inside_an_operation_undoes_its_group_answers_everyone_and_frees_the_file(
    writer: StoreWriter, where: str
) -> None:
    """A BaseException from inside an operation (a second Ctrl-C in a command, an exit) left the transaction open,
    the write lock held from every other process, and nobody answered (a close or a read then waited forever); on
    the thread it ended the thread, and every later write with it. Now the group is undone, every caller told, and
    on the loop the interrupt goes on through the coroutine that ran the group."""

    def interrupted(tx: Tx) -> int:
        tx.run("INSERT INTO t (k, v) VALUES ('half', 1)")
        raise _Interrupt

    await writer.submit(put("warm", 0))
    _goes(writer, where)
    async with asyncio.timeout(30):
        outcomes = await asyncio.gather(writer.submit(put("a", 1)), writer.submit(interrupted), return_exceptions=True)
        other = sqlite3.connect(writer.path, timeout=0)  # the write lock is free: another process writes at once
        try:
            other.execute("INSERT INTO t (k, v) VALUES ('other', 9)")
            other.commit()
        finally:
            other.close()
        _goes(writer, where)
        assert await writer.submit(put("c", 3)) == 1
    told = outcomes[1]
    assert isinstance(told, RuntimeError), told
    assert isinstance(told.__cause__, _Interrupt)
    if where == "loop":  # the caller whose turn ran the group carries the interrupt on
        assert isinstance(outcomes[0], _Interrupt), outcomes[0]
    else:
        assert isinstance(outcomes[0], RuntimeError), outcomes[0]
    assert rows(writer.path) == {"warm": 0, "other": 9, "c": 3}  # nothing of the interrupted group


async def test_an_operation_that_fills_the_disk_fails_alone_with_the_disks_error(writer: StoreWriter) -> None:
    # SQLITE_FULL rolls the whole transaction back, savepoints and all: the careful pass's ROLLBACK TO then
    # failed with "no such savepoint", and every caller of the group was told that instead of the real error.
    pages = await writer.submit(lambda tx: int(tx.one("PRAGMA page_count")[0]))
    await writer.submit(lambda tx: tx.one(f"PRAGMA max_page_count = {pages + 3}"))  # the writer's connection

    def huge(tx: Tx) -> int:
        return tx.run("INSERT INTO t (k, v) VALUES (?, 0)", ("x" * 200_000,))

    outcomes = await asyncio.gather(
        writer.submit(put("a", 1)), writer.submit(huge), writer.submit(put("b", 2)), return_exceptions=True
    )
    assert outcomes[0] == 1
    assert outcomes[2] == 1
    assert isinstance(outcomes[1], sqlite3.OperationalError)
    assert "database or disk is full" in str(outcomes[1])
    assert rows(writer.path) == {"a": 1, "b": 2}
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):  # alone: the same words
        await writer.submit(huge)
    assert await writer.submit(put("c", 3)) == 1  # and the writer goes on


async def test_an_error_that_only_mentions_a_lock_is_not_waited_for(tmp_path: Path) -> None:
    # The lock test read the message: "no such column: locked" (a schema error) was taken for another
    # process's lock, and the operation was run again every millisecond until busy_timeout_ms ran out.
    path = tmp_path / "w.db"
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("PRAGMA journal_mode = WAL")
    setup.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    setup.close()
    writer = StoreWriter(path, busy_timeout_ms=30_000)
    runs = 0

    def misspelt(tx: Tx) -> None:
        nonlocal runs
        runs += 1
        tx.run("UPDATE t SET v = locked")

    try:
        with pytest.raises(sqlite3.OperationalError, match="no such column: locked"):
            await writer.submit(misspelt)
        assert runs == 1
        assert await writer.submit(put("a", 1)) == 1
    finally:
        await writer.close()


def test_busy_is_told_by_sqlites_code_not_by_words() -> None:
    held = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as schema_error:
        held.execute("SELECT locked")
    held.close()
    assert not is_busy(schema_error.value)
    assert is_busy(sqlite3.OperationalError("database is locked"))  # raised by Python code: SQLite's own words
    assert not is_busy(sqlite3.OperationalError("disk I/O error (failpoint)"))
