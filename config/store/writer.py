"""One writer per store file: every write is a small synchronous operation, committed in groups.

A press, a card record, an audit row: each is a function of a :class:`Tx` that
runs a few statements and returns a value. Callers ``await writer.submit(op)``.
Operations submitted in the same turn of the event loop (or while a commit is
on its way to the disk) form one group: one ``BEGIN IMMEDIATE``, every
operation, one ``COMMIT``, one fsync — and every caller is answered only after
that ``COMMIT`` returned, so nobody is told about a write that is not on disk.
An operation that raises loses only its own writes: the group is run again
with a ``SAVEPOINT`` around each operation (operations rarely fail, so the
first pass goes without them).

Where the group runs: a writer thread with its own ``sqlite3`` connection,
so the event loop never waits for the disk. A lone operation on a disk whose
commits have been quick runs on the loop thread instead: a thread hop and the
wake-ups it costs are dearer than such a commit (measured in
``bench/store_decide.py``). A commit that is not that quick, but still no
slow disk's, also runs on the loop when the loop has nothing else to do: no
other callback ready, no timer due before the commit should be done (see
:meth:`StoreWriter._goes_inline`). When commits slow down further, the loop
is busy, or another process holds the write lock, the group goes through the
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from kazma.config.metrics import count_failure
from kazma.config.store.errors import WriteGivenUp, is_busy
from kazma.config.store.group_commit import (
    Deferred,
    GroupQueue,
    Job,
    batches,
    callbacks_ready,
    interrupted,
    own_operations,
    run_batch,
)

log = structlog.get_logger("kazma.store")

T = TypeVar("T")

# A lone operation runs on the loop thread while commits have averaged under this ...
INLINE_COMMIT_SECONDS = 0.001
# ... or under this while nothing else waits for the loop: the most a commit may hold an idle loop, on average. A
# healthy SSD's fsync stays under it even with busy neighbours; a spinning or network disk's does not.
INLINE_IDLE_COMMIT_SECONDS = 0.005
# ... and only this many operations at a time: a bigger group is worth the hop.
INLINE_MAX_OPS = 4
# How often the writer thread tries again for a write lock another process holds.
LOCK_RETRY_SECONDS = 0.001
# A writer thread with nothing to do for this long closes its connection and ends (the next write starts one).
IDLE_SECONDS = 10.0


class Tx(Deferred):
    """Statements inside the writer's transaction. Only an operation passed to :meth:`StoreWriter.submit` has one."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__()
        self._conn = conn

    def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        return self._conn.execute(sql, tuple(params)).fetchone()

    def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        return self._conn.execute(sql, tuple(params)).fetchall()

    def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement; the number of rows it changed."""
        return self._conn.execute(sql, tuple(params)).rowcount

    def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        self._conn.executemany(sql, [tuple(row) for row in rows])

    def send(self, sql: str, params: Iterable[Any] = ()) -> None:
        self._conn.execute(sql, tuple(params))

    def notify(self, channel: str, payload: str = "") -> None:
        """Tell other processes at commit (PostgreSQL's NOTIFY). One SQLite file has one ``kazma run``, which
        learns of its own writes directly; other processes on the file see them at their next read."""


Op = Callable[[Tx], T]


class _Group:
    """The jobs of one transaction, and how it went. (Slots, not a dataclass: one is made for every group.)"""

    __slots__ = ("busy", "committed_in", "error", "inline", "interrupt", "jobs")

    def __init__(self, jobs: list[Job[Any]]) -> None:
        self.jobs = jobs
        self.committed_in = 0.0
        self.error: BaseException | None = None
        self.inline = False
        self.busy = False  # the loop thread met another process's write lock: go to the thread
        # An interrupt met on the loop thread (KeyboardInterrupt, SystemExit...): raised again once all are answered.
        self.interrupt: BaseException | None = None


class StoreWriter(GroupQueue):
    """Group-committing writer for one SQLite file. Create it on the event loop that will use it."""

    def __init__(
        self,
        path: Path | str,
        *,
        busy_timeout_ms: int = 5000,
        inline_commit_seconds: float = INLINE_COMMIT_SECONDS,
        inline_idle_commit_seconds: float = INLINE_IDLE_COMMIT_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.path = str(path)
        if self.path == ":memory:":
            raise ValueError("the store writer needs a file: an in-memory database is private to one connection")
        self.busy_timeout_ms = busy_timeout_ms
        self.inline_commit_seconds = inline_commit_seconds
        self.inline_idle_commit_seconds = inline_idle_commit_seconds
        self.idle_seconds = idle_seconds
        super().__init__()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Shared with the thread: the connection, and whether a thread is alive to serve the queue.
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._commit_ewma = 0.0
        self.groups = 0  # committed groups, for tests and benchmarks
        self.inline_groups = 0

    # -- the loop side ---------------------------------------------------------------------------

    def _closed_error(self) -> Exception:
        return sqlite3.ProgrammingError("the store writer is closed")

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._late():
            return
        if self._in_flight or not self._pending:
            return  # the group on its way collects these when it is back
        jobs = self._take()
        group = _Group(jobs)
        small = len(jobs) <= INLINE_MAX_OPS or own_operations(jobs) <= INLINE_MAX_OPS  # (riders never count)
        if small and self._goes_inline() and self._lock.acquire(blocking=False):
            try:
                self._run_group(group, inline=True)
            finally:
                self._lock.release()
            if not group.busy:
                self._answer(group)
                if group.interrupt is not None:
                    raise group.interrupt
                return
            group = _Group(jobs)  # another process holds the write lock: wait for it on the thread
        self._in_flight = True
        self._loop = asyncio.get_running_loop()  # the thread answers on the loop that handed it the group
        with self._lock:
            self._queue.put(group)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="kazma-store-writer", daemon=True)
                self._thread.start()

    def _goes_inline(self) -> bool:
        """Whether a small group commits on the loop thread now, by what its commit should cost (the average).

        On the thread a group costs its callers a hand-off there and a wake-up back: two thread switches, which on
        a loaded machine take the scheduler's time (a 3-press request on disk with ~3 ms commits: 8-15 ms per
        request through the thread, ~6 ms inline, in one probe), and it frees the loop for others while the
        disk works. Holding the loop costs whoever else wants it during the commit. So: under
        ``inline_commit_seconds`` nobody waits long, always inline. Up to ``inline_idle_commit_seconds``, only
        when nobody is known to want the loop: no callback ready, no timer due before the commit should be done.
        What arrives by socket meanwhile waits at most that commit, and a press among it would have waited for
        this commit anyway (one group is on its way at a time). Above the cap (a slow disk) or on a busy loop,
        the thread: other platforms' presses and card edits go on while the disk works.
        """
        average = self._commit_ewma
        if average < self.inline_commit_seconds:
            return True
        return average < self.inline_idle_commit_seconds and _loop_idle(asyncio.get_running_loop(), average)

    def _answer(self, group: _Group) -> None:
        self.groups += 1
        self.inline_groups += group.inline
        self._commit_ewma = 0.8 * self._commit_ewma + 0.2 * group.committed_in
        self._answer_jobs(group.jobs, group.error)

    def _returned(self, group: _Group) -> None:
        self._answer(group)
        self._group_returned()

    async def close(self) -> None:
        """Commit what is queued, then end the thread and close the connection."""
        await self._drain()
        self._finished = True
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with self._lock:
            self._close_connection()

    # -- the thread side -------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                group = self._queue.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    if not self._queue.empty():
                        continue
                    self._thread = None
                    self._close_connection()
                    return
            if group is None:
                with self._lock:
                    self._thread = None
                return
            groups = [group]
            # Groups handed over while this thread was busy commit together: one fsync for all of them.
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                groups.append(more)
            merged = _Group([job for g in groups for job in g.jobs])
            with self._lock:
                self._run_group(merged, inline=False)
            loop = self._loop
            assert loop is not None
            for g in groups:
                g.committed_in, g.error = merged.committed_in, merged.error
            try:
                loop.call_soon_threadsafe(self._returned_all, groups)
            except RuntimeError:  # the loop is gone: nobody is waiting any more
                with self._lock:
                    self._thread = None
                    self._close_connection()
                return

    def _returned_all(self, groups: Sequence[_Group]) -> None:
        for group in groups[:-1]:
            self._answer(group)
        self._returned(groups[-1])

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            # No busy handler: the loop thread must never wait for another process's lock, and the
            # writer thread waits in :meth:`_begin`, which is fairer than SQLite's growing sleeps (a
            # second process committing group after group would otherwise starve this one).
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=0)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._conn = conn
        return self._conn

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _run_group(self, group: _Group, *, inline: bool) -> None:
        """One transaction for every job of ``group``; called with ``_lock`` held.

        Another process holding the write lock (or, briefly, the WAL index) makes any statement fail
        "database is locked": the whole group is rolled back and tried again — on the loop thread not
        at all (the group goes to the writer thread), on the writer thread every millisecond until
        ``busy_timeout_ms`` has passed. Polling this often is fairer than SQLite's own growing sleeps,
        which let a second process committing group after group starve this one.

        A job whose deadline (:attr:`Job.deadline`) has passed is given up before the next attempt: its caller
        is told at once, and the group goes on without it, so it never commits after its caller was told it did
        not. (Patience alone outlasted a caller's deadline by up to ``busy_timeout_ms``; and a caller that gave
        up by cancelling only stopped listening, so its write still committed once the lock was free.)
        """
        group.inline = inline
        patience = time.monotonic() + self.busy_timeout_ms / 1000
        careful = False
        dropped: set[Job[Any]] = set()  # operations whose failure undid the whole transaction: not run again
        live = group.jobs
        while True:
            live = self._give_up_late(live, inline=inline)
            if not live:
                return
            for job in live:
                if job not in dropped:
                    job.result, job.error = None, None
            try:
                self._attempt(group, live, careful=careful, dropped=dropped)
                return
            except _Undone as undone:
                # SQLite rolled the whole transaction back under an operation (SQLITE_FULL, an I/O error), so
                # there was no savepoint to go back to: the group runs again without it, and its caller gets
                # that error (not "no such savepoint", as every caller of the group did before).
                dropped.add(undone.job)
                careful = True
                continue
            except _FlushFailed as failed:
                # What the operations deferred to the end could not be written: none of them is kept.
                if self._conn is not None:
                    self._rollback(self._conn)
                self._failed(group, failed.__cause__ or failed)
                return
            except _OpFailed:
                # Optimistic pass: no savepoints, since operations rarely fail. One did: the whole
                # transaction is undone and the group runs again, each operation in a savepoint.
                if self._conn is not None:
                    self._rollback(self._conn)
                careful = True
                continue
            except sqlite3.OperationalError as exc:
                if self._conn is not None:
                    self._rollback(self._conn)
                if not is_busy(exc):
                    self._failed(group, exc)
                    return
                if inline:
                    group.busy = True
                    return
                if time.monotonic() >= patience:
                    self._failed(group, exc)
                    return
            except sqlite3.Error as exc:  # the transaction as a whole failed: nobody's write is kept
                self._failed(group, exc)
                if self._conn is not None:
                    self._rollback(self._conn)
                return
            except BaseException as exc:
                # An interrupt or an exit from inside an operation (a second Ctrl-C in a command on the loop
                # thread): undone, every caller told, and on the loop the interrupt goes on once they are. It left
                # the transaction open (the write lock held from every other process) and nobody answered, so a
                # close or any read waited forever; on the thread it ended the thread, and every write with it.
                if self._conn is not None:
                    self._rollback(self._conn)
                self._failed(group, interrupted(exc))
                if inline:
                    group.interrupt = exc
                return
            time.sleep(LOCK_RETRY_SECONDS)

    def _give_up_late(self, jobs: list[Job[Any]], *, inline: bool) -> list[Job[Any]]:
        """``jobs`` but those whose deadline has passed: those are given up, and their callers told now (from the
        thread, on the loop: the group's other jobs may wait on for the lock)."""
        now = time.monotonic()
        late = [job for job in jobs if job.deadline is not None and job.deadline <= now]
        if not late:
            return jobs
        for job in late:
            job.result = None
            job.error = WriteGivenUp(
                f"the write was given up at its deadline before it could commit (another connection held the"
                f" write lock of {self.path}, or the writer was busy before it): nothing of it was committed"
            )
        log.warning("store.write_given_up", path=self.path, operations=len(late), waiting_for="lock")
        if inline:
            self._answer_given_up(late)
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for an answer
                self._loop.call_soon_threadsafe(self._answer_given_up, late)
        return [job for job in jobs if job.deadline is None or job.deadline > now]

    def _attempt(self, group: _Group, jobs: list[Job[Any]], *, careful: bool, dropped: set[Job[Any]]) -> None:
        """One transaction for ``jobs`` (the group's that are still wanted)."""
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        tx = Tx(conn)
        if len(jobs) == 1:
            job = jobs[0]
            try:
                job.result = job.op(tx)
            except Exception as exc:  # the caller gets it; nothing of this operation is kept
                if isinstance(exc, sqlite3.OperationalError) and is_busy(exc):
                    raise
                job.error = exc
                self._rollback(conn)
                return
        elif not careful:
            # Operations of one Together key run in one go (one press of several decides, the others lose in the
            # same statements); the careful pass below runs each alone, which gives the same results.
            for batch in batches(jobs):
                try:
                    run_batch(tx, batch)
                except Exception as exc:
                    if isinstance(exc, sqlite3.OperationalError) and is_busy(exc):
                        raise
                    raise _OpFailed from exc
        else:
            for job in jobs:
                if job in dropped:
                    continue
                conn.execute("SAVEPOINT op")
                mark = tx._mark()
                try:
                    job.result = job.op(tx)
                except Exception as exc:  # this operation's statements go; the group's others stay
                    if isinstance(exc, sqlite3.OperationalError) and is_busy(exc):
                        raise
                    job.error = exc
                    if not conn.in_transaction:
                        raise _Undone(job) from exc
                    tx._discard_since(mark)
                    conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
        try:
            tx._run_deferred()
        except Exception as exc:
            if isinstance(exc, sqlite3.OperationalError) and is_busy(exc):
                raise
            raise _FlushFailed from exc
        started = time.perf_counter()
        conn.execute("COMMIT")
        group.committed_in = time.perf_counter() - started
        tx._committed()

    def _failed(self, group: _Group, exc: BaseException) -> None:
        group.error = exc
        count_failure("store_commit")
        log.error("store.commit_failed", path=self.path, operations=len(group.jobs), error=str(exc))

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error as exc:  # the original error matters more than a failed rollback
                log.warning("store.rollback_failed", error=f"{type(exc).__name__}: {exc}")


def _loop_idle(loop: asyncio.AbstractEventLoop, within: float) -> bool:
    """Whether no callback of ``loop`` is ready to run and no timer falls due within ``within`` seconds.

    Read from asyncio's own queues (``_ready``, ``_scheduled``: the pure-Python loop's, the one Kazma runs on); a
    loop that keeps them elsewhere says nothing, and counts as busy: the thread, as before this rule.
    """
    timers = getattr(loop, "_scheduled", None)
    if timers is None or callbacks_ready(loop):
        return False
    # A cancelled timer at the head of the heap counts as due: at worst a group goes to the thread.
    return not timers or timers[0].when() > loop.time() + within


class _OpFailed(Exception):
    """An operation raised during a group's optimistic pass (see :meth:`StoreWriter._run_group`)."""


class _Undone(Exception):
    """An operation of the careful pass failed, and SQLite had rolled the whole transaction back under it."""

    def __init__(self, job: Job[Any]) -> None:
        super().__init__()
        self.job = job


class _FlushFailed(Exception):
    """Work the group's operations deferred to its end failed: the whole group is undone."""
