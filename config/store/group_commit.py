"""The event-loop side every group-committing store writer shares (SQLite's and PostgreSQL's).

Callers ``await writer.submit(op)``; operations submitted in the same turn of
the loop, or while a group is on its way, wait in :attr:`GroupQueue._pending`
for the next group. A backend says how a group runs (:meth:`_flush`, taking its
jobs with :meth:`_take`) and hands the answers back with :meth:`_answer_jobs`
and :meth:`_group_returned`.

An operation that is in no hurry may *ride* (``submit(op, ride=seconds)``): it
starts no group of its own, but joins, last, the next group other operations
start, and goes alone only when none starts within ``ride`` seconds (or when
:meth:`GroupQueue.release_riders` says it is wanted now). The audit chain's
checkpoints ride: while decisions arrive, a checkpoint costs no commit (no fsync)
of its own, and it never waits in front of a decision.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any, Generic, TypeVar, cast

import structlog

from kazma.config.store.errors import WriteGivenUp

log = structlog.get_logger("kazma.store")

T = TypeVar("T")

# Run once just before a transaction commits, with every item its operations deferred to it (in their order).
Flush = Callable[[Any, list[Any]], None]


class Deferred:
    """Work an operation hands to the end of its transaction (:meth:`defer`), kept apart per operation.

    A writer marks where each operation's items start, drops the items of an operation it rolls back, and
    runs every flush once, after the group's last operation and before ``COMMIT``: what a flush writes commits
    with the operations that asked for it, or not at all. (The audit chain links a transaction's events there,
    so that what orders them across writers is held only for the last moment of the transaction.)
    """

    def __init__(self) -> None:
        self._deferred: list[tuple[Flush, Any]] = []
        self._on_commit: list[Callable[[], None]] = []

    def defer(self, flush: Flush, item: Any) -> None:
        """Hand ``item`` to ``flush`` once this transaction's operations have run, just before it commits."""
        self._deferred.append((flush, item))

    def after_commit(self, done: Callable[[], None]) -> None:
        """Call ``done`` once this transaction committed (never if it did not); in the writer, before the next."""
        self._on_commit.append(done)

    def _mark(self) -> tuple[int, int]:
        return len(self._deferred), len(self._on_commit)

    def _discard_since(self, mark: tuple[int, int]) -> None:
        del self._deferred[mark[0] :]
        del self._on_commit[mark[1] :]

    def _committed(self) -> None:
        """The transaction committed: what waited for that runs (a failure here is logged; the commit stands)."""
        done, self._on_commit = self._on_commit, []
        for call in done:
            try:
                call()
            except Exception as exc:  # bookkeeping only: the commit is on disk whatever happens here
                log.error("store.after_commit_failed", error=f"{type(exc).__name__}: {exc}")

    def _run_deferred(self) -> None:
        """Every flush once, with its items; a flush may defer more (run in the next round)."""
        while self._deferred:
            pending, self._deferred = self._deferred, []
            by_flush: dict[Flush, list[Any]] = {}
            for flush, item in pending:
                by_flush.setdefault(flush, []).append(item)
            for flush, items in by_flush.items():
                flush(self, items)


def answerable(error: BaseException) -> BaseException:
    """``error`` as a caller's future can be given it. asyncio refuses a ``StopIteration`` (a ``TypeError`` from
    ``set_exception``: it would end the awaiting coroutine as a return): given one, the answering of a group stopped
    there, and its callers and every later write waited forever. It is said in a ``RuntimeError`` instead."""
    if isinstance(error, StopIteration | StopAsyncIteration):
        wrapped = RuntimeError(f"the operation raised {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        return wrapped
    return error


def interrupted(error: BaseException) -> Exception:
    """What the callers of a group an interrupt (or an exit, or any other ``BaseException``) undid are told."""
    if isinstance(error, Exception):
        return error
    told = RuntimeError(f"the write was interrupted ({type(error).__name__}); nothing of it was kept")
    told.__cause__ = error
    return told


@types.coroutine
def _one_turn() -> Generator[None, None, None]:
    """Give the loop one turn (what ``asyncio.sleep(0)`` does, without its call)."""
    yield


def callbacks_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether some callback is queued to run in this turn of ``loop`` or the next, before anything the next turn
    polls. Read from asyncio's own queue (``_ready``: the pure-Python loop's, the one Kazma runs on); a loop that
    keeps it elsewhere says nothing, and counts as having some."""
    return bool(getattr(loop, "_ready", True))


class Later(Generic[T]):
    """An operation's result given before its statements' answers are in (PostgreSQL's pipeline mode): filled by
    the end of its transaction; the writer answers the caller with the value."""

    __slots__ = ("_value", "done")

    def __init__(self) -> None:
        self.done = False
        self._value: T | None = None

    def set(self, value: T) -> None:
        self._value, self.done = value, True

    @property
    def value(self) -> T:
        if not self.done:
            raise RuntimeError("an operation's result was read before its transaction filled it")
        return self._value  # type: ignore[return-value]  # set: a T (which may itself be None)


class Together(Generic[T]):
    """An operation that runs in one go with the others of its ``key`` in a group (a writer that can, SQLite's).

    Called alone it is ``op``. When a group holds several of one key, the writer calls the first one's
    ``together`` once, where the first stood, with every one's ``part`` in their order, and takes each one's
    result from the list it returns: what running them one after another would give (the presses of one request
    that arrive together, decided by one compare-and-set). The group's other operations keep their order around
    them; none of theirs was answered before the group, so either order is one its callers could have seen.
    """

    __slots__ = ("key", "op", "part", "together")

    def __init__(
        self,
        op: Callable[[Any], T],
        key: Hashable,
        part: Any,
        together: Callable[[Any, list[Any]], list[T]],
    ) -> None:
        self.op, self.key, self.part, self.together = op, key, part, together

    def __call__(self, tx: Any) -> T:
        return self.op(tx)


class Unasking(Generic[T]):
    """An operation whose maker expects it to wait for no statement's answer before the commit (it only sends,
    guesses and notifies: a press of a request whose seal and rules this process knows). A hint, for a writer that
    can send such a group as one string of statements (PostgreSQL's): it tries that only when every operation of
    the group is one, and runs the group as any other when one asks after all. Called, it is ``op``."""

    __slots__ = ("op",)

    def __init__(self, op: Callable[[Any], T]) -> None:
        self.op = op

    def __call__(self, tx: Any) -> T:
        return self.op(tx)


class Job(Generic[T]):
    """One submitted operation, its caller's future, and what running it gave. (A class with slots, not a
    dataclass: one is made for every write, and a dataclass's instance dictionary and keyword call cost more.)"""

    __slots__ = ("deadline", "error", "future", "op", "result", "rides")

    def __init__(self, op: Callable[[Any], T], future: asyncio.Future[T], *, rides: bool = False) -> None:
        self.op, self.future = op, future
        self.result: Any = None
        self.error: BaseException | None = None
        self.rides = rides  # submitted to ride: it never makes a group count as bigger than its other operations
        # When its caller stops waiting (``time.monotonic()``), or None: a writer waiting for a lock past it gives
        # the job up (see :meth:`GroupQueue.submit`).
        self.deadline: float | None = None

    def __repr__(self) -> str:
        return f"Job({self.op!r}, rides={self.rides})"


def batches(jobs: Sequence[Job[Any]]) -> list[list[Job[Any]]]:
    """``jobs`` in their order, those of one :class:`Together` key gathered at the place of the first of them."""
    out: list[list[Job[Any]]] = []
    keyed: dict[Hashable, list[Job[Any]]] = {}
    for job in jobs:
        op = job.op
        if type(op) is Together:
            same = keyed.get(op.key)
            if same is not None:
                same.append(job)
                continue
            keyed[op.key] = same = [job]
            out.append(same)
        else:
            out.append([job])
    return out


def run_batch(tx: Any, batch: list[Job[Any]]) -> None:
    """Each job's result: one call of its op, or, for several of one :class:`Together` key, one call of theirs."""
    if len(batch) == 1:
        batch[0].result = batch[0].op(tx)
        return
    first = batch[0].op
    assert isinstance(first, Together)
    results = first.together(tx, [cast("Together[Any]", job.op).part for job in batch])
    if len(results) != len(batch):
        raise RuntimeError(f"{len(batch)} operations run together gave {len(results)} results")
    for job, result in zip(batch, results, strict=True):
        job.result = result


def own_operations(jobs: Sequence[Job[Any]]) -> int:
    """How many of ``jobs`` started their group (riders aside): what decides how a group is run."""
    return sum(1 for job in jobs if not job.rides)


class GroupQueue:
    """Collects operations into groups, one group on its way at a time, and answers their callers."""

    def __init__(self) -> None:
        self._pending: list[Job[Any]] = []
        self._unanswered: set[asyncio.Future[Any]] = set()
        self._flush_scheduled = False
        self._in_flight = False
        self._closed = False
        self._finished = False  # close() ended the writer: nothing runs any more
        self._riders: list[Job[Any]] = []
        self._riders_due: asyncio.TimerHandle | None = None

    def _closed_error(self) -> Exception:
        """What a submit after :meth:`close` raises (the backend's own error type)."""
        raise NotImplementedError

    def _flush(self) -> None:
        """Take pending jobs and run them as a group (or hand them to a thread)."""
        raise NotImplementedError

    async def submit(self, op: Callable[[Any], T], *, ride: float = 0.0, deadline: float | None = None) -> T:
        """Run ``op`` in the next group commit; its result once that commit returned.

        ``ride`` > 0: ``op`` starts no group; it joins the next one other operations start (after theirs), or goes
        alone once ``ride`` seconds passed without one (see the module's docstring).

        ``deadline`` (the loop's time): past it, ``op`` is given up while it waits for its group, or while the
        writer waits for a lock another connection holds (SQLite's writer before its next attempt; PostgreSQL's
        cancels the transaction under way, and runs the group's other operations again without it), and its caller
        gets :class:`WriteGivenUp`: it did not commit, and never will. Its group's other operations wait on. A
        commit already under way when it passes is not stopped: its caller is answered how it ended. (A caller that
        merely stopped waiting, cancelled, leaves its write to commit whenever it can.)
        """
        if self._closed:
            raise self._closed_error()
        loop = asyncio.get_running_loop()
        if deadline is not None and deadline <= loop.time():
            raise WriteGivenUp("the write's deadline had passed before it was submitted: nothing was written")
        future: asyncio.Future[T] = loop.create_future()
        job = Job(op, future, rides=ride > 0)
        if deadline is not None:
            self._give_up_at(job, loop, deadline)
        if ride > 0:
            # Not yet among the unanswered: a read (``caught_up``) does not wait for a write that waits to ride.
            self._riders.append(job)
            if self._riders_due is None:
                self._riders_due = loop.call_later(ride, self.release_riders)
            return await future
        self._track(future)
        self._pending.append(job)
        if self._flush_scheduled:
            return await future
        # This caller starts the group, and runs it itself one turn later: everything submitted during this turn
        # of the loop joins it, and a group run on the loop thread answers this caller in that same turn (a
        # flush callback, then a turn to wake this caller, cost a lone press a second turn of the loop). When no
        # callback is ready, nothing runs before this caller's next step anyway (what the next turn's poll and
        # timers bring is queued after it): the group is this write (and riders), and the turn is skipped.
        self._flush_scheduled = True
        try:
            if callbacks_ready(loop):
                await _one_turn()
        except BaseException:  # cancelled meanwhile: the group still runs, for the others and for this write
            loop.call_soon(self._flush)
            raise
        self._flush()
        if future.done():
            return future.result()
        return await future

    def _give_up_at(self, job: Job[Any], loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Give ``job`` up at ``deadline`` (the loop's time) if it still waits for its group then; a writer gives
        it up after that while it waits for a lock (it reads :attr:`Job.deadline`, on its own clock)."""
        job.deadline = time.monotonic() + (deadline - loop.time())
        timer = loop.call_at(deadline, self._given_up_waiting, job)
        job.future.add_done_callback(lambda _: timer.cancel())

    def _given_up_waiting(self, job: Job[Any]) -> None:
        """``job``'s deadline passed: given up if it has not gone into a group yet (one that has is the writer's)."""
        for waiting in (self._pending, self._riders):
            if job in waiting:
                waiting.remove(job)
                job.error = WriteGivenUp(
                    "the write was given up at its deadline while it waited for the writer (busy with an earlier"
                    " group, which may be waiting for another connection's lock): nothing was written"
                )
                self._answer_jobs([job], None)
                log.warning("store.write_given_up", waiting_for="group")
                return

    def _answer_given_up(self, jobs: Sequence[Job[Any]]) -> None:
        """Jobs a writer gave up (each with its :class:`WriteGivenUp`) while their group goes on: told now."""
        self._answer_jobs(jobs, None)

    @property
    def riders(self) -> int:
        """Operations waiting to ride."""
        return len(self._riders)

    def release_riders(self) -> None:
        """The riding operations go in the next group now, whether or not other operations start one."""
        if self._riders_due is not None:
            self._riders_due.cancel()
            self._riders_due = None
        if not self._riders:
            return
        self._pending += self._board()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _take(self, limit: int | None = None) -> list[Job[Any]]:
        """The jobs of the group that starts now: the pending ones (at most ``limit``), then every rider."""
        if limit is None or len(self._pending) <= limit:
            jobs, self._pending = self._pending, []
        else:
            jobs, self._pending = self._pending[:limit], self._pending[limit:]
        if self._riders:
            jobs += self._board()
            if self._riders_due is not None:
                self._riders_due.cancel()
                self._riders_due = None
        return jobs

    def _board(self) -> list[Job[Any]]:
        """Every rider, taken into a group: from now on a read waits for it like for any write."""
        riders, self._riders = self._riders, []
        for job in riders:
            self._track(job.future)
        return riders

    def _late(self) -> bool:
        """Whether the writer has ended (:meth:`close` drained it): what is still pending then belongs to callers
        who gave up (a cancelled rider, say: the drain waits only for answers someone waits for). It is refused
        here, never handed to a new thread that nobody would end (a close joining the old one then waited
        forever when the new one took its stop signal)."""
        if not self._finished:
            return False
        self._answer_jobs(self._take(), self._closed_error())
        return True

    def _track(self, future: asyncio.Future[Any]) -> None:
        # Taken out when its group is answered (_answer_jobs), cancelled or not. A future its caller cancelled meanwhile
        # is done: a close or a read catching up that gathers it does not wait for it. No done callback: one was a
        # bound method and a copy of the context per write, alive while it waited (with 180 presses in one group,
        # objects the garbage collector traced and promoted), and added and taken off again for every write.
        if not future.done():
            self._unanswered.add(future)

    def _answer_jobs(self, jobs: Sequence[Job[Any]], error: BaseException | None) -> None:
        discard = self._unanswered.discard
        for job in jobs:
            future = job.future
            discard(future)
            if future.done():
                continue  # its caller was cancelled; the write stands all the same
            failure = error or job.error
            if failure is not None:
                future.set_exception(answerable(failure))
            else:
                future.set_result(job.result)

    def _group_returned(self) -> None:
        """The group on its way is back (and answered): the next one may go."""
        self._in_flight = False
        if self._pending and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def caught_up(self) -> None:
        """Return once every write submitted so far is answered: a read after this sees them all (except a write
        still waiting to ride: its own caller waits for it)."""
        waiting = self._waited_for()
        if waiting:
            # asyncio.wait, not gather: a reader cancelled meanwhile must not cancel the writes it waits for (gather
            # cancels what it gathers), whose callers would be told CancelledError for writes that commit.
            await asyncio.wait(waiting)

    async def _drain(self) -> None:
        """Refuse new operations and wait until every submitted one is answered (the start of a close)."""
        self._closed = True
        self.release_riders()
        while waiting := self._waited_for():
            await asyncio.wait(waiting)  # (not gather: see caught_up)

    def _waited_for(self) -> list[asyncio.Future[Any]]:
        """The unanswered writes whose callers still wait (one cancelled is left among them until its group is
        answered: nobody waits for it)."""
        return [future for future in self._unanswered if not future.done()]
