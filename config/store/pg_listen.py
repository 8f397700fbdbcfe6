"""Wake-ups between replicas: PostgreSQL ``LISTEN``/``NOTIFY`` on one dedicated connection per replica.

A decision or a queued card is told with ``NOTIFY`` inside the transaction that
writes it (``Tx.notify``), so the other replicas hear of it the moment it is
committed, and never of a write that rolled back. Notifications sent while a
listener is disconnected are lost: after every (re)connect the listener calls
``on_resync``, which looks at the store once (the bus rescans, waiters re-read).
That and the bus's slow safety scan are the only polling left.

A silent network can leave a connection that looks open: the listener asks
the server a trivial question whenever no notification came for
``check_every`` seconds, so a dead link is noticed and replaced within about
``check_every + connect_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
import structlog
from psycopg import sql

from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.supervisor import report_failure
from kazma.config.waits import bounded, until_set

log = structlog.get_logger("kazma.store")

# The failure site of the replica's own long-lived loops (this listener, the leader lease) when they fail in a way
# they do not handle: they are the replica's background tasks, as those its Supervisor runs.
REPLICA_TASK_SITE = "replica_task"

# (channel, payload, the server process that sent it): called in order, on the loop, never awaited twice at once.
OnNotify = Callable[[str, str, int], None]


async def until_readable(conn: psycopg.AsyncConnection[Any], seconds: float) -> bool:
    """Wait until the server sends something on ``conn`` (a notification, an error, the end of the session) or
    ``seconds`` pass; whether it sent something (read it with ``conn.notifies(timeout=0)``, which raises if the
    session ended). One wake-up of the loop: psycopg's own wait (``notifies(timeout=…)``) wakes it every 0.1 s
    to look, and an idle replica's two waiting connections (this listener, the lease) made twenty a second."""
    loop = asyncio.get_running_loop()
    fd = conn.fileno()
    ready: asyncio.Future[bool] = loop.create_future()

    def settle(value: bool) -> None:
        if not ready.done():
            ready.set_result(value)

    loop.add_reader(fd, settle, True)
    timer = loop.call_later(seconds, settle, False)
    try:
        return await ready
    finally:
        timer.cancel()
        loop.remove_reader(fd)


class PgListener:
    """Listens on ``channels`` until stopped, reconnecting with backoff; ``connected`` says whether it hears now."""

    def __init__(
        self,
        conninfo: str,
        channels: Sequence[str],
        on_notify: OnNotify,
        on_resync: Callable[[], Awaitable[None]],
        *,
        application_name: str = "kazma-listen",
        check_every: float = 5.0,
        connect_timeout: int = 5,
    ) -> None:
        self.conninfo = conninfo
        self.channels = tuple(channels)
        self.on_notify = on_notify
        self.on_resync = on_resync
        self.application_name = application_name
        self.check_every = check_every
        self.connect_timeout = connect_timeout
        self.connected = False
        self.connects = 0  # successful (re)connections, for tests and /healthz
        self.problem: str | None = None  # why it does not hear now, when it does not
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._backoff = Backoff(base=0.5, cap=10.0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kazma-pg-listen")

    async def wait_connected(self, within: float) -> bool:
        """Whether it is listening within ``within`` seconds (a replica starts serving either way)."""
        await until_set(self._ready, within)
        return self.connected

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.connected = False

    async def _run(self) -> None:
        failures = 0
        while True:
            conn: psycopg.AsyncConnection[Any] | None = None
            unexpected: Exception | None = None
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.conninfo,
                    autocommit=True,
                    application_name=self.application_name,
                    connect_timeout=self.connect_timeout,
                )
                for channel in self.channels:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                self.connected, self.problem = True, None
                self.connects += 1
                self._ready.set()
                if failures:
                    log.info("store.listen_resumed", channels=list(self.channels))
                failures = 0
                await self._resync()
                await self._hear(conn)
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:
                self.connected = False
                self.problem = str(exc).strip() or type(exc).__name__
                if failures == 0:  # once per outage, not once per attempt
                    count_failure("store_listen")
                    log.warning("store.listen_lost", error=self.problem, detail="the safety scan covers the gap")
                failures += 1
            except Exception as exc:
                # Not the link: the driver could not read what the server sent (a payload it cannot decode, as in a
                # SQL_ASCII database), or this code failed. The connection is given up as if lost, and a new one
                # listens (its resync looks for what the lost notification said) instead of the task ending here
                # with nobody told, every later wake-up lost until stop() raised it.
                self.connected = False
                self.problem = f"{type(exc).__name__}: {exc}"
                unexpected = exc
                failures += 1
            finally:
                self.connected = False
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            delay = self._backoff.delay(max(0, failures - 1))
            if unexpected is not None:
                report_failure(REPLICA_TASK_SITE, "kazma-pg-listen", unexpected, restart_in=delay)
            await asyncio.sleep(delay)

    async def _hear(self, conn: psycopg.AsyncConnection[Any]) -> None:
        while True:
            # What came (on the socket, or kept by psycopg while a query ran) is read without waiting; then one
            # wait on the socket itself, not psycopg's, which looks every 0.1 s even when nothing comes.
            heard = False
            async for notify in conn.notifies(timeout=0):
                heard = True
                try:
                    self.on_notify(notify.channel, notify.payload, notify.pid)
                except Exception:  # one bad handler must not deafen the replica
                    count_failure("store_listen_handler")
                    log.exception("store.listen_handler_failed", channel=notify.channel)
            if heard:
                continue
            if not await until_readable(conn, self.check_every):
                # Nothing for a while: prove the link (a dead one raises here, and the loop reconnects).
                await bounded(conn.execute("SELECT 1"), self.connect_timeout)

    async def _resync(self) -> None:
        try:
            await self.on_resync()
        except Exception as exc:
            count_failure("store_listen_resync")
            log.warning("store.listen_resync_failed", error=str(exc))
