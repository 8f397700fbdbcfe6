"""One way to run work in the background: named tasks, one failure path, a stop that drains or cancels.

The model is python-telegram-bot's ``Application.create_task`` with its one ``process_error``: every task a
part of Kazma starts in the background goes through that part's :class:`Supervisor`. A task that fails is
logged with one event name (``task.failed``, naming the task and the supervisor's site) and counted
(``kazma_failures_total{site=…}``) the moment it ends, never lost to a "Task exception was never retrieved"
at garbage collection; whoever owns the tasks waits for them, drains them or cancels them in one call; and a
long-lived loop can be kept: started again after a failure, waiting by the one :class:`Backoff`.

Every layer may use it: it sits at the bottom of the import graph with the counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import structlog

from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure

log = structlog.get_logger("kazma.tasks")

T = TypeVar("T")

# A task still running this long after its cancel, at a stop, is cancelled again (seconds; see Supervisor.stop).
RECANCEL_AFTER = 2.0


class Supervisor:
    """The background tasks of one owner (a platform adapter, the conversations, the swarm …).

    ``site`` names the owner in the failure counter and the log; ``platform`` fills the counter's platform
    label where the owner is one platform's.
    """

    def __init__(self, site: str, *, platform: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.site = site
        self.platform = platform
        self.failures = 0  # tasks of this supervisor that failed (a kept loop counts each failed run)
        self._clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()
        self._awaited: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._others())

    def names(self) -> list[str]:
        """The names of the tasks running now, sorted."""
        return sorted(task.get_name() for task in self._tasks)

    # -- starting --------------------------------------------------------------------------------

    def spawn(self, work: Coroutine[Any, Any, T], *, name: str, awaited: bool = False) -> asyncio.Task[T]:
        """Run ``work`` as a task named ``name``; its failure is logged and counted when it ends.

        ``awaited``: the caller awaits the task and handles its failure itself (the supervisor still tracks
        it for stopping, and does not report that failure a second time).
        """
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        if awaited:
            self._awaited.add(task)
        task.add_done_callback(self._done)
        return task

    def keep(self, loop: Callable[[], Coroutine[Any, Any, None]], *, name: str, backoff: Backoff) -> asyncio.Task[None]:
        """Run the long-lived ``loop()`` as a task, starting it again after each failure.

        Each failed run is logged and counted like any task's failure; the next run starts after
        ``backoff.delay(n)`` for the n-th failure in a row, and a run that lasted longer than the backoff's cap
        starts the count again. A loop that returns is done; cancelling the task stops it.
        """
        return self.spawn(self._keep(loop, name, backoff), name=name)

    async def _keep(self, loop: Callable[[], Coroutine[Any, Any, None]], name: str, backoff: Backoff) -> None:
        failures = 0
        while True:
            started = self._clock()
            try:
                await loop()
                return
            except Exception as exc:
                if self._clock() - started > backoff.cap:
                    failures = 0
                delay = backoff.delay(failures)
                self._report(name, exc, restart_in=delay)
                failures += 1
            await asyncio.sleep(delay)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """The current task (one a library started, e.g. a listener) counts as this supervisor's in the block:
        waiting and stopping include it. Its failures stay its starter's."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            yield
        finally:
            if task is not None:
                self._tasks.discard(task)

    # -- stopping --------------------------------------------------------------------------------

    async def wait(self, within: float | None = None) -> set[asyncio.Task[Any]]:
        """Wait up to ``within`` seconds until no task is left, those started meanwhile included (a press decided
        during a stop's grace starts the notice that tells its presser); the ones still running after it.
        Waiting only for the tasks running when it began, a stop closed the platform under the notice."""
        loop = asyncio.get_running_loop()
        until = None if within is None else loop.time() + within
        while pending := self._others():
            left = None if until is None else until - loop.time()
            if left is not None and left <= 0:
                return {task for task in pending if not task.done()}
            await asyncio.wait(pending, timeout=left)
        return set()

    async def drain(self) -> None:
        """Wait until no task is left, those started meanwhile included."""
        await self.wait()

    def cancel(self) -> int:
        """Cancel every task now, without waiting for them to end; how many were cancelled."""
        pending = self._others()
        for task in pending:
            task.cancel()
        return len(pending)

    async def stop(self, *, grace: float = 0.0, patience: float | None = None) -> set[asyncio.Task[Any]]:
        """Let the tasks finish for ``grace`` seconds, then cancel the rest and wait for them to end (at most
        ``patience`` seconds; None: as long as they take). Returns the tasks it cancelled."""
        late = await self.wait(grace) if grace > 0 else self._others()
        cancelled: set[asyncio.Task[Any]] = set()
        loop = asyncio.get_running_loop()
        until = None if patience is None else loop.time() + patience
        # Past the grace: what is still running is cancelled, and so is what a cancelled task starts as it ends.
        # One still running RECANCEL_AFTER after its cancel is cancelled again: a cancel can be lost on the way
        # (Python 3.11's asyncio.wait_for, which psycopg_pool waits for a connection with, returns the result when
        # the cancel meets it, and the task goes on), and a task that went on to its loop's sleep held the stop
        # forever — an app's stop hung with its sweep "cancelling" in its sleep.
        while late:
            for task in late - cancelled:
                task.cancel()
            cancelled |= late
            left = None if until is None else until - loop.time()
            if left is not None and left <= 0:
                break
            _, running = await asyncio.wait(late, timeout=RECANCEL_AFTER if left is None else min(left, RECANCEL_AFTER))
            for task in running:
                task.cancel()
            late = self._others()
        return cancelled

    # -- the one failure path --------------------------------------------------------------------

    def _others(self) -> set[asyncio.Task[Any]]:
        """Every task but the one asking: a task that stops its own supervisor must not wait for itself."""
        current = asyncio.current_task()
        return {task for task in self._tasks if task is not current}

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        awaited = task in self._awaited
        self._awaited.discard(task)
        if task.cancelled():
            return
        error = task.exception()  # retrieved here, whoever else looks at it
        if error is not None and not awaited:
            self._report(task.get_name(), error)

    def _report(self, name: str, error: BaseException, *, restart_in: float | None = None) -> None:
        self.failures += 1
        report_failure(self.site, name, error, platform=self.platform, restart_in=restart_in)


def report_failure(
    site: str, name: str, error: BaseException, *, platform: str = "", restart_in: float | None = None
) -> None:
    """The one failure path, for a loop that keeps itself going without a :class:`Supervisor` (the replica's
    listener and lease, which must tidy up their own connection between runs): logged and counted as a
    supervised task's failure is."""
    count_failure(site, platform)
    log.error(
        "task.failed",
        site=site,
        platform=platform or None,
        task=name,
        error=f"{type(error).__name__}: {error}",
        restart_in=None if restart_in is None else round(restart_in, 2),
        exc_info=error,
    )
