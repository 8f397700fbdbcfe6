"""Which replica does the singleton work: a PostgreSQL advisory-lock lease.

Several ``kazma run`` replicas share one PostgreSQL database; Telegram long polling, the Discord
gateway, start-up recovery and the sweeps must run on exactly one of them. Each replica keeps one
dedicated connection and asks ``pg_try_advisory_lock(key)`` (session-level) on it; the session that
holds the lock is the leader. PostgreSQL frees the lock the moment it notices the session is gone,
so a replica that dies hands over without anyone's help.

Two things make "exactly one at a time" hold and the takeover bounded:

* **The old leader stops believing first.** A leader counts as leader only until
  ``last successful check sent + grace`` (``grace = check_interval + 2 * check_timeout``); it
  checks every ``check_interval`` and gives up on a check unanswered within ``check_timeout``.
  A new holder of the lock waits ``grace`` after taking it before it declares itself leader. The
  lock can only have been freed after the old leader's last successful check ran, so the new one
  starts after the old one's belief has run out, even when the old one could not be told.
* **The server drops a silent leader.** A partition leaves the old session open on the server and
  the lock held. The lease session sets ``idle_session_timeout`` (PostgreSQL 14+) to
  ``server_drop_after``: a healthy lease session is never idle longer than ``check_interval``, so
  the server ends a silent one — and frees the lock — within that time. Server-side TCP
  keepalives and ``tcp_user_timeout`` are set too, for the case where the kernel learns first.

With the defaults (check 1.5 s, timeout 1 s, retry 0.5 s, server drop 3 s) the takeover after a
leader is SIGKILLed or its backend is terminated takes about ``retry_interval + grace`` (≈ 4 s);
after a silent partition at most :attr:`LeaseTiming.takeover_bound` (9 s).

Not bounded: a lease *backend* that does not run (stopped, hung in the kernel) holds the lock until it
runs again, since the server ends a session only through that session's own process (its idle timeout,
a terminate signal). The leader steps down after a check it does not answer and rejoins on a new session;
nobody leads meanwhile, and never two.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.rows import TupleRow

from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.store.pg_listen import REPLICA_TASK_SITE, until_readable
from kazma.config.supervisor import report_failure
from kazma.config.waits import bounded, until_set

log = structlog.get_logger("kazma.leader")

T = TypeVar("T")
AsyncConn = psycopg.AsyncConnection[TupleRow]

_TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
# The lock we hold, as the server lists it: a bigint key is split into classid (high half) and objid
# (low half), with objsubid 1. Checking it (not just `SELECT 1`) proves the lease, not only the link.
_HOLDING = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    " AND granted AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1)"
)
_MAX_APPLICATION_NAME = 63  # PostgreSQL keeps NAMEDATALEN - 1 bytes
# When a check is abandoned, psycopg tries to cancel the query on the server (up to 5 s, then 5 s
# more). The lease does not wait for that: it has already stopped being leader; this bounds only
# the clean-up in the background.
_DISCARD_WAIT = 12.0


@dataclass(frozen=True)
class LeaseTiming:
    check_interval: float = 1.5  # a leader proves it still holds the lock this often
    check_timeout: float = 1.0  # a check (or an acquire attempt) unanswered by then has failed
    retry_interval: float = 0.5  # a follower asks for the lock this often
    server_drop_after: float = 3.0  # idle_session_timeout of the lease session: the server's bound
    connect_timeout: int = 3  # libpq's connect_timeout (whole seconds, at least 2)

    def __post_init__(self) -> None:
        if min(self.check_interval, self.check_timeout, self.retry_interval) <= 0:
            raise ValueError("lease intervals and timeouts must be positive")
        if self.server_drop_after <= max(self.check_interval, self.retry_interval):
            # the server would end a healthy lease session between two of its own checks
            raise ValueError("server_drop_after must be longer than check_interval and retry_interval")

    @property
    def grace(self) -> float:
        """How long after its last successful check an old leader may still believe it leads."""
        return self.check_interval + 2 * self.check_timeout

    @property
    def takeover_bound(self) -> float:
        """Worst case from a silent partition of the leader to another replica declaring itself leader.

        The server drops the silent session (``server_drop_after``), a follower's next attempt
        comes and is answered (``retry_interval + check_timeout``), it waits out ``grace`` and its
        first check after that is answered (``check_timeout``).
        """
        return self.server_drop_after + self.retry_interval + self.check_timeout + self.grace + self.check_timeout


def lock_key(name: str) -> int:
    """The advisory-lock key for a lease name: the first 8 bytes of a SHA-256, as a signed bigint."""
    digest = hashlib.sha256(f"kazma.leader:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def default_replica() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _Broken(Exception):
    """The lease connection can no longer prove anything; the message says why."""


class LeaderLease:
    """Leadership among replicas, held as a session advisory lock on a dedicated connection.

    ``async with LeaderLease(dsn, on_acquired=..., on_lost=...) as lease:`` runs the lease in the
    background until the block ends (leadership, if held, is given up by closing the connection).
    ``on_lost`` gets the reason. Callbacks run one after another, in order, in a task of their own:
    a slow one never delays the checks that keep the lease (a delayed check would let the server
    drop the session). ``is_leader`` is already true (or false) when its callback starts.
    """

    APPLICATION_PREFIX = "kazma-lease "

    def __init__(
        self,
        dsn: str,
        *,
        name: str = "kazma",
        replica: str | None = None,
        on_acquired: Callable[[], Awaitable[None]] | None = None,
        on_lost: Callable[[str], Awaitable[None]] | None = None,
        timing: LeaseTiming | None = None,
        on_locked: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.dsn = dsn
        self.name = name
        self.key = lock_key(name)
        self.replica = replica or default_replica()
        self.timing = timing or LeaseTiming()
        self._on_acquired = on_acquired
        self._on_lost = on_lost
        self._on_locked = on_locked
        self._leader = False
        self._locked = False  # this session holds the lock (a leader, or one waiting out the old leader's grace)
        self._valid_until = 0.0
        self._became_leader = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._calls: asyncio.Queue[tuple[str, Callable[[], Awaitable[None]]]] = asyncio.Queue()
        self._caller: asyncio.Task[None] | None = None
        self._backend_pid: int | None = None
        self._session_up = asyncio.Event()  # set once a lease session has been open (the others see this replica)
        self._server_said = ""
        self._abandoned: set[asyncio.Task[Any]] = set()  # checks given up on, still unwinding
        self._closing: set[asyncio.Task[None]] = set()
        self._backoff = Backoff(base=self.timing.retry_interval, cap=5.0)
        self.state = "starting"  # starting | follower | leader | disconnected | stopped

    # -- what callers see -------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this replica leads; false as soon as its last proof is older than ``grace``,
        even if the lease's own task has not run since (a stalled event loop must not extend it)."""
        return self._leader and time.monotonic() < self._valid_until

    @property
    def holds_lock(self) -> bool:
        """This replica's lease session holds the lock: it leads, or it waits out the old leader's grace first."""
        return self._locked and self._backend_pid is not None

    @property
    def backend_pid(self) -> int | None:
        """The server process of the lease connection, when connected (for operators and tests)."""
        return self._backend_pid

    @property
    def application_name(self) -> str:
        """How the lease connection shows in ``pg_stat_activity``: the other replicas read who is alive there."""
        name = f"{self.APPLICATION_PREFIX}{self.replica}"
        return name.encode()[:_MAX_APPLICATION_NAME].decode(errors="ignore")

    async def wait_session(self, within: float) -> bool:
        """Whether a lease session was open within ``within`` seconds (from then on the others see this replica)."""
        await until_set(self._session_up, within)
        return self._session_up.is_set()

    async def wait_leader(self) -> None:
        """Return once this replica is the leader (at once if it is)."""
        while not self.is_leader:
            if self._leader:  # its proof went stale: the loop settles it within a check_timeout
                await asyncio.sleep(self.timing.check_timeout / 4)
            else:
                await self._became_leader.wait()

    # -- life -------------------------------------------------------------------------------------

    @property
    def _task_name(self) -> str:
        return f"leader-lease-{self.name}"

    async def __aenter__(self) -> LeaderLease:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._task_name)
            self._caller = asyncio.create_task(self._call_back(), name=f"leader-lease-{self.name}-callbacks")

    async def stop(self) -> None:
        """Give the lease up: closing the connection frees the lock at once for the others."""
        for task in (self._task, self._caller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._caller = None
        self._locked = False
        if self._leader:
            self._leader = False
            log.info("leader.released", lease=self.name, replica=self.replica)
        self.state = "stopped"
        if self._closing or self._abandoned:
            await asyncio.wait({*self._closing, *self._abandoned}, timeout=_DISCARD_WAIT)

    # -- the loop ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                conn = await self._connect()
            except Exception as exc:
                delay = self._backoff.delay(failures)
                if not isinstance(exc, psycopg.Error | OSError | TimeoutError | _Broken):
                    # Not the server refusing or the network failing (a host name psycopg cannot even encode, say):
                    # said and counted at every attempt, as a supervised loop's failure is, and tried again.
                    report_failure(REPLICA_TASK_SITE, self._task_name, exc, restart_in=delay)
                elif failures == 0:
                    log.warning("leader.connect_failed", lease=self.name, replica=self.replica, error=_short(exc))
                self.state = "disconnected"
                await asyncio.sleep(delay)
                failures += 1
                continue
            if failures:
                log.info("leader.reconnected", lease=self.name, replica=self.replica)
            failures = 0
            try:
                reason = await self._hold(conn)
            except _Broken as exc:
                reason = str(exc)
            except Exception as exc:
                # An error nobody expected while following or leading: this session proves nothing any more. It
                # goes the way a broken one goes — given up, and leadership with it at once (on_lost told) — rather
                # than the task ending with is_leader running out only after the grace and on_lost never called,
                # the duties going on beside the next leader's.
                reason = f"the lease failed: {_short(exc)}"
                report_failure(REPLICA_TASK_SITE, self._task_name, exc, restart_in=self.timing.retry_interval)
            finally:
                self._backend_pid = None
                self._locked = False
                self._discard(conn)
            await self._lose(reason)
            await asyncio.sleep(self.timing.retry_interval)

    async def _connect(self) -> AsyncConn:
        t = self.timing
        # Server side, for this session only: drop it when it falls silent, and bound every statement.
        options = (
            f"-c idle_session_timeout={int(t.server_drop_after * 1000)}"
            f" -c statement_timeout={int(t.check_timeout * 1000)}"
            " -c tcp_keepalives_idle=1 -c tcp_keepalives_interval=1 -c tcp_keepalives_count=3"
            f" -c tcp_user_timeout={int(t.server_drop_after * 1000)}"
        )
        conn = await bounded(
            psycopg.AsyncConnection.connect(
                self.dsn,
                autocommit=True,
                application_name=self.application_name,
                connect_timeout=max(2, t.connect_timeout),
                # client side: a dead peer ends the connection instead of leaving it hanging
                keepalives=1,
                keepalives_idle=1,
                keepalives_interval=1,
                keepalives_count=3,
                tcp_user_timeout=int(t.server_drop_after * 1000),
                options=options,
            ),
            max(2, t.connect_timeout) + 1,
        )
        # A server that ends the session says why (57P01 "terminating connection due to administrator
        # command", an idle-session timeout …) in a FATAL message that libpq hands to the notice
        # handler, not to the error raised afterwards: keep it for the reason.
        self._server_said = ""
        conn.add_notice_handler(self._notice)
        try:
            self._backend_pid = await self._bounded(_backend_pid(conn), t.check_timeout, "no answer from PostgreSQL")
            self._session_up.set()
        except BaseException:
            self._discard(conn)
            raise
        return conn

    def _notice(self, diag: psycopg.errors.Diagnostic) -> None:
        if diag.severity in ("FATAL", "PANIC", "ERROR") and diag.message_primary:
            self._server_said = f"{diag.message_primary} ({diag.sqlstate})"

    async def _hold(self, conn: AsyncConn) -> str:
        """Follow until the lock is ours, then lead until the connection can no longer prove it.

        Returns (or raises :class:`_Broken` with) the reason the connection is no good any more.
        """
        t = self.timing
        if self.state != "follower":
            self.state = "follower"
            log.info("leader.following", lease=self.name, replica=self.replica)
        while not await self._ask(conn, _TRY_LOCK, (self.key,)):
            await self._idle(conn, t.retry_interval)
        taken = time.monotonic()
        self._locked = True
        log.info("leader.lock_taken", lease=self.name, replica=self.replica, grace=t.grace)
        if self._on_locked is not None:  # told at once, not after the grace: the others may read what it says
            self._calls.put_nowait(("on_locked", self._on_locked))
        while True:
            sent = time.monotonic()
            held = await self._ask(conn, _HOLDING, ((self.key >> 32) & 0xFFFFFFFF, self.key & 0xFFFFFFFF))
            if not held:
                return "the advisory lock is no longer held by this session"
            if self._leader:
                self._valid_until = sent + t.grace
            elif time.monotonic() >= taken + t.grace:
                await self._declare(sent)
            wait = t.check_interval if self._leader else min(t.check_interval, max(0.0, taken + t.grace - sent))
            await self._idle(conn, wait)

    async def _declare(self, sent: float) -> None:
        self._leader = True
        self._valid_until = sent + self.timing.grace
        self.state = "leader"
        log.info("leader.acquired", lease=self.name, replica=self.replica, backend_pid=self._backend_pid)
        self._became_leader.set()
        if self._on_acquired is not None:
            self._calls.put_nowait(("on_acquired", self._on_acquired))

    async def _lose(self, reason: str) -> None:
        self.state = "disconnected"
        if not self._leader:
            log.info("leader.follower_disconnected", lease=self.name, replica=self.replica, reason=reason)
            return
        self._leader = False
        self._became_leader.clear()
        count_failure("leader_lost")
        log.warning("leader.lost", lease=self.name, replica=self.replica, reason=reason)
        if self._on_lost is not None:
            on_lost = self._on_lost
            self._calls.put_nowait(("on_lost", lambda: on_lost(reason)))

    async def _call_back(self) -> None:
        while True:
            which, call = await self._calls.get()
            try:
                await call()
            except Exception as exc:  # the owner's failure must not end the lease
                count_failure("leader_callback")
                log.error("leader.callback_failed", lease=self.name, callback=which, error=_short(exc))

    # -- talking to the server, bounded -----------------------------------------------------------

    async def _ask(self, conn: AsyncConn, query: str, params: tuple[int, ...]) -> bool:
        async def run() -> bool:
            cur = await conn.execute(query, params)
            row = await cur.fetchone()
            return bool(row and row[0])

        return await self._bounded(run(), self.timing.check_timeout, "no answer from PostgreSQL")

    async def _idle(self, conn: AsyncConn, seconds: float) -> None:
        """Wait on the connection itself, so a server that ends the session is noticed at once."""

        async def wait() -> None:
            # On the socket itself (psycopg's own wait looks every 0.1 s); what the server sends is read at once,
            # and a session it ended raises there.
            loop = asyncio.get_running_loop()
            until = loop.time() + max(seconds, 0.01)
            while (left := until - loop.time()) > 0:
                if await until_readable(conn, left):
                    async for _ in conn.notifies(timeout=0):
                        pass

        await self._bounded(wait(), seconds + self.timing.check_timeout, "the connection stopped answering")

    async def _bounded(self, work: Coroutine[Any, Any, T], limit: float, silent: str) -> T:
        task = asyncio.create_task(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=limit)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            # Do not wait for psycopg's cancel of the query: it may itself wait on the dead network.
            task.cancel()
            self._abandoned.add(task)
            task.add_done_callback(self._forget)
            raise _Broken(f"{silent} within {limit:g} s")
        try:
            return task.result()
        except (psycopg.OperationalError, OSError) as exc:
            said = f"the server said: {self._server_said}; " if self._server_said else ""
            raise _Broken(f"connection lost: {said}{_short(exc)}") from exc
        except psycopg.Error as exc:  # a statement timeout, say: the session can prove nothing now
            raise _Broken(f"check failed: {_short(exc)}") from exc

    def _discard(self, conn: AsyncConn) -> None:
        async def close() -> None:
            if self._abandoned:
                await asyncio.wait(set(self._abandoned), timeout=_DISCARD_WAIT)
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.discard(task)
        self._closing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the failure was already reported as the reason


async def _backend_pid(conn: AsyncConn) -> int | None:
    cur = await conn.execute("SELECT pg_backend_pid()")
    row = await cur.fetchone()
    return int(row[0]) if row else None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
