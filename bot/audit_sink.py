"""``audit.sink``: every audit event, and every signed checkpoint, streamed out of the store as it commits.

The sink reads the chain from its last delivered position (kept in the store,
``audit_sink_positions``), delivers a batch to its target, then moves the
position on. It runs apart from every decision (a target that is down, slow or
refusing delays no press; see :class:`AuditSink`), retries with the one backoff
(:mod:`kazma.config.backoff`; a target's ``Retry-After`` is heeded up to
``retry_cap_seconds``) and says how far behind it is
(``kazma_audit_sink_behind_events``, kept current while it waits, and 0 on a
process that stopped sinking; each failed delivery counts at site
``audit_sink``).

Delivery is in sequence order and at least once to the file and the webhook: a
crash between a delivery and the write of its position sends that batch again
after the restart. Every record carries its sequence number, so a receiver that
drops what it has (an event by ``seq``; a checkpoint by ``seq``) sees each one
exactly once, in order. The file target does that itself: at start it reads the
last record it wrote, and checks that record is the store's (a file that went
past the store, or holds another chain, is set aside and a new one begun).

Syslog has no acknowledgement. Over TCP a record counts as delivered once the
kernel took it: a connection the collector closed is found before each write
(and counted, ``audit_sink_connection_lost``), but what was written just before
the collector went away may be lost without Kazma knowing. Over UDP a datagram
may be dropped anywhere; only a refusal (nothing listens) is seen, counted and
retried. Syslog is best effort: where every record must arrive, use the file
(a log shipper can follow it) or the webhook.

Records are those of ``kazma audit export`` (:mod:`kazma.approvals.audit_export`):
the file a file sink writes is verified by ``kazma audit verify --from-export``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Final, Protocol, cast
from urllib.parse import urlsplit

import httpx
import structlog
from prometheus_client import Gauge

from kazma.approvals.audit_export import checkpoint_record, event_record, line
from kazma.approvals.store import ApprovalStore
from kazma.config.audit_config import AuditSinkConfig
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.store.backend import StoreConnection, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration
from kazma.config.waits import bounded, until_set

log = structlog.get_logger("kazma.audit.sink")

MIGRATIONS: Final = [
    Migration(
        "audit_sink",
        1,
        (
            # How far each sink has delivered (by its target's name): events by seq, checkpoints by seq.
            """CREATE TABLE IF NOT EXISTS audit_sink_positions (
                sink TEXT PRIMARY KEY,
                event_seq INTEGER NOT NULL,
                checkpoint_seq INTEGER NOT NULL,
                at REAL NOT NULL
            )""",
        ),
    )
]
PG_MIGRATIONS: Final = [
    PgMigration(
        "audit_sink",
        1,
        (
            """CREATE TABLE IF NOT EXISTS audit_sink_positions (
                sink text PRIMARY KEY,
                event_seq bigint NOT NULL,
                checkpoint_seq bigint NOT NULL,
                at double precision NOT NULL
            )""",
        ),
    )
]

SINK_BEHIND = Gauge("kazma_audit_sink_behind_events", "Audit events committed but not yet delivered by the audit sink.")
SINK_DELIVERED = Gauge("kazma_audit_sink_delivered_seq", "The last audit event the audit sink delivered.")

POLL_SECONDS: Final = 1.0  # events appended by other processes (replicas, the CLI) are found this often
_SYSLOG_AUDIT_INFO: Final = 13 * 8 + 6  # facility 13 (log audit), severity 6 (informational)


class SinkError(Exception):
    """A delivery that failed; ``retry_after``: what the target asked for, if it said."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Held:
    """What a target holds itself (a file), as its last records say."""

    event_seq: int  # its last event's (0: it holds none)
    checkpoint_seq: int  # its last checkpoint's (0: none)
    chain_hash: Any = None  # its last event's chain hash, as written
    foreign: str = ""  # why what it holds last is no record of an audit sink (then it is set aside), "" when it is


class Target(Protocol):
    kind: str

    async def deliver(self, records: list[dict[str, Any]]) -> None:
        """Deliver every record, in order, or raise (:class:`SinkError`)."""
        ...

    async def delivered(self) -> Held | None:
        """What the target itself knows it has (a file), or None (it cannot say)."""
        ...

    async def start_over(self) -> str:
        """What it holds is not the store's chain: keep it aside and begin anew; where it was kept ("" nowhere)."""
        ...

    async def close(self) -> None:
        """Let go of connections; a delivery after it opens them again (the sink is run again after a stop)."""
        ...


_TAIL_BYTES: Final = 1_048_576  # how far back from its end a file sink looks for its last records


class FileTarget:
    """JSON lines appended to a file and fsynced per delivery (all of a batch or none of it); reads its own last
    record at start."""

    kind = "file"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entry_synced = False  # the folder fsynced since the file was made (or first written here)

    async def deliver(self, records: list[dict[str, Any]]) -> None:
        data = "".join(line(record) for record in records).encode("utf-8")
        try:
            await asyncio.to_thread(self._append, data)
        except OSError as exc:
            raise SinkError(f"cannot write {self.path}: {exc}") from None

    def _append(self, data: bytes) -> None:
        """Every byte written and fsynced, or none: a short write (the file size limit, a full disk) or a failed
        fsync cuts the file back to where it was and raises. The folder holding a new file (and each folder made
        for it) is fsynced too: the file's entry is as durable as its lines."""
        for made in _missing_folders(self.path.parent):
            made.mkdir(exist_ok=True)
            _fsync_folder(made.parent)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
            self._entry_synced = False
        except FileExistsError:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        try:
            size = _whole_lines(fd)  # a line an earlier failure left cut (its cut back failed too) was never delivered
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    if written <= 0:
                        raise OSError(errno.EIO, "the file took none of the bytes written")
                    view = view[written:]
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                    os.fsync(fd)
                raise
        finally:
            os.close(fd)
        if not self._entry_synced:  # once per file: made by this process, or found at its first delivery
            _fsync_folder(self.path.parent)
            self._entry_synced = True

    async def delivered(self) -> Held | None:
        return await asyncio.to_thread(self._last_records)

    def _last_records(self) -> Held | None:
        """The last event (seq and chain hash) and checkpoint seq in the file; a line cut by a crash is removed
        first."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            size = _whole_lines(fd)
            start = max(0, size - _TAIL_BYTES)
            tail = os.pread(fd, size - start, start)
        finally:
            os.close(fd)
        lines = tail.splitlines()
        if start > 0:
            lines = lines[1:]  # the window began inside that line
        event_seq = checkpoint_seq = 0
        chain_hash: Any = None
        for raw in reversed(lines):
            if not raw.strip():
                continue
            record = _sink_record(raw)
            if record is None:
                # Not this sink's: appended after it, the file would no longer verify (nor be read back here).
                return Held(0, 0, foreign=f"its line {raw[:80]!r} is no audit record")
            kind, seq = record["type"], record.get("seq")
            if kind == "header":
                continue
            if type(seq) is not int or seq < 1:
                return Held(0, 0, foreign=f"a {kind} record holds seq {seq!r}")
            if kind == "event" and not event_seq:
                event_seq, chain_hash = seq, record.get("chain_hash")
            if kind == "checkpoint" and not checkpoint_seq:
                checkpoint_seq = seq
            if event_seq and checkpoint_seq:
                break
        return Held(event_seq, checkpoint_seq, chain_hash)

    async def start_over(self) -> str:
        return await asyncio.to_thread(self._set_aside)

    def _set_aside(self) -> str:
        """The file renamed to ``<name>.diverged-<UTC time>`` beside it (never over another); the next delivery
        begins a new one."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        for n in range(1, 1000):
            aside = self.path.with_name(f"{self.path.name}.diverged-{stamp}" + (f"-{n}" if n > 1 else ""))
            if aside.exists():
                continue
            try:
                self.path.rename(aside)
            except FileNotFoundError:
                return ""
            _fsync_folder(self.path.parent)
            self._entry_synced = False
            return str(aside)
        raise SinkError(f"cannot set {self.path} aside: too many diverged files beside it")

    async def close(self) -> None:
        return


_RECORD_TYPES: Final = frozenset({"event", "checkpoint", "header"})


def _sink_record(raw: bytes) -> dict[str, Any] | None:
    """A line as an audit record (a JSON object of a record type), or None."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested (or a number) past what json reads
        return None
    if not isinstance(record, dict) or record.get("type") not in _RECORD_TYPES:
        return None
    return record


def _missing_folders(folder: Path) -> list[Path]:
    """The folders of ``folder``'s path that do not exist yet, outermost first."""
    missing: list[Path] = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _whole_lines(fd: int) -> int:
    """The file's size once a last line without its newline (cut by a crash or a failed write) is removed."""
    size = os.fstat(fd).st_size
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - 65_536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            end = start + cut + 1
            break
        end = start
    os.ftruncate(fd, end)
    os.fsync(fd)
    return end


class SyslogTarget:
    """RFC 5424 messages, facility log audit: one UDP datagram per record, or octet-counted frames over TCP.

    Neither has an acknowledgement (see the module's docstring). Over TCP the connection is checked before each
    write: one the collector closed (a restart) is counted and opened again, never written into. Over UDP the
    socket is connected, so a refusal (nothing listens) comes back as an error and fails the delivery.
    """

    kind = "syslog"

    def __init__(self, address: str, *, timeout: float) -> None:
        parts = urlsplit(address)
        self.tcp = parts.scheme == "tcp"
        self.host, self.port = str(parts.hostname), int(parts.port or 514)
        self.timeout = timeout
        self._socket: socket.socket | None = None
        self._written = 0  # the last event seq written on the TCP connection open now
        self._hostname = socket.gethostname()

    def _message(self, record: dict[str, Any]) -> bytes:
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        msgid = str(record.get("type", "-"))
        return f"<{_SYSLOG_AUDIT_INFO}>1 {stamp} {self._hostname} kazma - {msgid} - {line(record).strip()}".encode()

    async def deliver(self, records: list[dict[str, Any]]) -> None:
        messages = [self._message(record) for record in records]
        try:
            if self.tcp:
                await self._send_tcp(b"".join(b"%d %s" % (len(m), m) for m in messages))
                self._written = max((int(r["seq"]) for r in records if r.get("type") == "event"), default=self._written)
            else:
                await self._send_udp(messages)
        except OSError as exc:
            await self.close()
            raise SinkError(f"syslog {self.host}:{self.port}: {exc}") from None
        except BaseException:  # cancelled (the delivery's limit) half-way: a frame may be cut, the stream is lost
            await self.close()
            raise

    async def _connect(self, kind: socket.SocketKind) -> socket.socket:
        loop = asyncio.get_running_loop()
        error: OSError = OSError(errno.EADDRNOTAVAIL, f"no address for {self.host}")
        for family, _, proto, _, address in await loop.getaddrinfo(self.host, self.port, type=kind):
            connection = socket.socket(family, kind, proto)
            connection.setblocking(False)
            try:
                await loop.sock_connect(connection, address)
            except OSError as exc:
                connection.close()
                error = exc
                continue
            except BaseException:
                connection.close()
                raise
            return connection
        raise error

    async def _send_udp(self, messages: list[bytes]) -> None:
        if self._socket is None:
            self._socket = await self._connect(socket.SOCK_DGRAM)
        loop = asyncio.get_running_loop()
        for message in messages:
            await loop.sock_sendall(self._socket, message)
        refused = self._socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # an ICMP answer that came already
        if refused:
            raise OSError(refused, os.strerror(refused))

    async def _send_tcp(self, frames: bytes) -> None:
        if self._socket is not None and not _still_open(self._socket):
            # The collector closed it (a restart, an idle timeout): written into, it would take the bytes and lose
            # them. What was written on it last may be lost as well: nothing acknowledges a syslog frame.
            count_failure("audit_sink_connection_lost", self.kind)
            log.warning(
                "audit.sink_connection_lost",
                syslog=f"tcp://{self.host}:{self.port}",
                last_event_written=self._written,
                note="closed by the collector; records written just before may not have reached it",
            )
            await self.close()
        if self._socket is None:
            self._socket = await self._connect(socket.SOCK_STREAM)
        await asyncio.get_running_loop().sock_sendall(self._socket, frames)

    async def delivered(self) -> Held | None:
        return None

    async def start_over(self) -> str:
        return ""

    async def close(self) -> None:
        held, self._socket = self._socket, None
        if held is not None:
            held.close()


def _still_open(connection: socket.socket) -> bool:
    """Whether the peer of a TCP connection has not closed it (nor reset it), without waiting: a syslog collector
    says nothing, so what it sent (read and dropped here) only delays the answer, and the end of the stream (or an
    error) means it is gone."""
    try:
        for _ in range(16):
            if not connection.recv(65_536):
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    return True


_ANSWER_READ: Final = 65_536  # of a 2xx answer's body: read to let the connection be used again, no more
_ERROR_SHOWN: Final = 200  # characters of an error answer's body in the failure's message


class WebhookTarget:
    """``POST {"records": [...]}`` as JSON; a 2xx answer is a delivery, anything else a failure to retry. The
    answer's body is never read whole: at most its first bytes. The client is made when first needed, and again
    after it was closed (the sink is run again after a stop: by its supervisor, or when a replica leads again)."""

    kind = "webhook"

    def __init__(self, url: str, *, name: str = "", headers: dict[str, str], timeout: float) -> None:
        self.url = url
        self.name = name or "webhook"  # what messages show of it: never the URL (its path may be the secret)
        self._headers = headers
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers, follow_redirects=False)
        return self._client

    async def deliver(self, records: list[dict[str, Any]]) -> None:
        body = json.dumps({"records": records}, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        try:
            async with self._http().stream("POST", self.url, content=body.encode("utf-8"), headers=headers) as answer:
                if 200 <= answer.status_code < 300:
                    await _first_bytes(answer, _ANSWER_READ)
                    return
                said = _printable((await _first_bytes(answer, _ERROR_SHOWN * 4)).decode("utf-8", "replace"))
                status, retry_after = answer.status_code, _retry_after(answer.headers.get("Retry-After"))
        except httpx.HTTPError as exc:
            raise SinkError(f"webhook: {type(exc).__name__}: {str(exc).replace(self.url, self.name)}") from None
        raise SinkError(
            f"webhook answered {status}" + (f": {said[:_ERROR_SHOWN]}" if said else ""), retry_after=retry_after
        )

    async def delivered(self) -> Held | None:
        return None

    async def start_over(self) -> str:
        return ""

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


async def _first_bytes(answer: httpx.Response, limit: int) -> bytes:
    """Up to ``limit`` bytes of the answer's body, as sent; an answer longer than that is closed unread."""
    got = bytearray()
    # Closed when left early, not at garbage collection: it is an async generator (httpx types it an iterator).
    async with contextlib.aclosing(cast(AsyncGenerator[bytes, None], answer.aiter_raw())) as chunks:
        async for chunk in chunks:
            got += chunk
            if len(got) >= limit:
                break
    return bytes(got[:limit])


def _printable(text: str) -> str:
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        with contextlib.suppress(TypeError, ValueError):
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return None


def target_of(config: AuditSinkConfig) -> Target:
    if config.file is not None:
        return FileTarget(config.file)
    if config.syslog:
        return SyslogTarget(config.syslog, timeout=config.timeout_seconds)
    return WebhookTarget(
        config.webhook, name=config.target, headers=dict(config.headers), timeout=config.timeout_seconds
    )


class SinkPositions:
    """Where each sink has delivered to, in the store: survives a restart (and a new leader among replicas)."""

    def __init__(self, conn: StoreConnection) -> None:
        self.tables = tables_of(conn)

    async def get(self, sink: str, *, formerly: Sequence[str] = ()) -> tuple[int, int]:
        """The position of ``sink``; one kept under a name it had ``formerly`` is moved to its name first (that
        row goes: a webhook's old name held its URL's path)."""
        for old in formerly:
            if old != sink and await self.tables.one("SELECT 1 FROM audit_sink_positions WHERE sink = ?", (old,)):
                async with self.tables.transaction() as tx:
                    await tx.run(
                        "INSERT INTO audit_sink_positions (sink, event_seq, checkpoint_seq, at)"
                        " SELECT ?, event_seq, checkpoint_seq, at FROM audit_sink_positions WHERE sink = ?"
                        " ON CONFLICT (sink) DO NOTHING",
                        (sink, old),
                    )
                    await tx.run("DELETE FROM audit_sink_positions WHERE sink = ?", (old,))
        row = await self.tables.one(
            "SELECT event_seq, checkpoint_seq FROM audit_sink_positions WHERE sink = ?", (sink,)
        )
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    async def save(self, sink: str, event_seq: int, checkpoint_seq: int, at: float) -> None:
        await self.tables.run(
            "INSERT INTO audit_sink_positions (sink, event_seq, checkpoint_seq, at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (sink) DO UPDATE SET event_seq = excluded.event_seq,"
            " checkpoint_seq = excluded.checkpoint_seq, at = excluded.at",
            (sink, event_seq, checkpoint_seq, at),
        )


class AuditSink:
    """Streams the audit chain to one target, in order, never in a decision's way. Run again after it stopped (the
    supervisor restarts it; a replica that leads again), it goes on from the stored position."""

    def __init__(
        self,
        store: ApprovalStore,
        positions: SinkPositions,
        target: Target,
        *,
        name: str,
        formerly: Sequence[str] = (),
        batch: int = 100,
        timeout: float = 10.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.store = store
        self.positions = positions
        self.target = target
        self.name = name
        self.formerly = tuple(formerly)  # names its position was kept under before (carried over at start)
        self.batch = batch
        self.timeout = timeout
        self.backoff = backoff or Backoff(base=1.0, cap=300.0)
        self.clock = clock
        self.poll_seconds = poll_seconds
        self.position = (0, 0)  # (event seq, checkpoint seq) delivered
        self.failures = 0  # deliveries failed in a row
        self.behind = 0
        self._due = asyncio.Event()
        store.appended_listeners.append(self.wake)

    @classmethod
    def of(cls, store: ApprovalStore, conn: StoreConnection, config: AuditSinkConfig) -> AuditSink:
        return cls(
            store,
            SinkPositions(conn),
            target_of(config),
            name=config.target,
            formerly=config.legacy_targets,
            batch=config.batch,
            timeout=config.timeout_seconds,
            backoff=Backoff(base=config.retry_base_seconds, cap=config.retry_cap_seconds),
        )

    def wake(self) -> None:
        self._due.set()

    async def start(self) -> None:
        """The position to go on from: the store's, or further where the target itself knows it has more (and
        what it has is the store's chain: else it is set aside and the target begins again from the first event)."""
        stored = await self.positions.get(self.name, formerly=self.formerly)
        held = await self.target.delivered()
        if held is None:
            self.position = stored
        elif await self._continues(held):
            self.position = (max(stored[0], held.event_seq), max(stored[1], held.checkpoint_seq))
        else:
            await self._diverged(held)
        log.info("audit.sink_started", sink=self.name, event_seq=self.position[0], checkpoint_seq=self.position[1])
        await self._measure()

    async def _continues(self, held: Held) -> bool:
        """Whether the target's last event is the store's event of that seq (a store restored from an older
        backup, or another store, has other events under the seqs the target holds, or none)."""
        if held.foreign:
            return False
        if not held.event_seq:
            return True
        found = await self.store.chain_events(held.event_seq - 1, limit=1)
        return (
            bool(found) and found[0].seq == held.event_seq and event_record(found[0])["chain_hash"] == held.chain_hash
        )

    async def _diverged(self, held: Held) -> None:
        """The target holds what the store does not: appending would skip the store's new events under seqs it
        has (or write a chain that never verifies). It is kept aside, whole, and a new one gets the store's chain
        from its first event, so it verifies on its own. The position is reset first: a crash in between sets the
        same target aside again, never resumes a new one half-way."""
        last = await self.store.last_event_seq()
        await self.positions.save(self.name, 0, 0, self.clock())
        aside = await self.target.start_over()
        self.position = (0, 0)
        count_failure("audit_sink_diverged", self.target.kind)
        log.error(
            "audit.sink_diverged",
            sink=self.name,
            target_event_seq=held.event_seq,
            store_last_event_seq=last,
            **({"foreign": held.foreign} if held.foreign else {}),
            kept_aside=aside,
            note="the target's last event is not the store's (a store restored from a backup, or another store):"
            " it was set aside as it was, and the store's chain is delivered again from its first event",
        )

    async def run(self) -> None:
        try:
            await self.start()
            while True:
                if not await self.deliver_once() and not self.failures:
                    self._due.clear()
                    await until_set(self._due, self.poll_seconds)
        except asyncio.CancelledError:  # no longer sinking here (a stop, or the lease went to another replica)
            self.stopped()
            raise
        finally:
            await self.target.close()

    def stopped(self) -> None:
        """This process no longer sinks: its gauge says nothing is behind here (the replica that leads says how far
        behind it is), rather than what it measured last, for good."""
        self.behind = 0
        SINK_BEHIND.set(0)

    async def deliver_once(self) -> bool:
        """One batch delivered (True), or nothing to deliver or a failed delivery, waited out (False)."""
        records, event_seq, checkpoint_seq = await self._batch()
        await self._measure()
        if not records:
            return False
        try:
            await bounded(self.target.deliver(records), self.timeout)
        except Exception as exc:  # SinkError, its time limit, or what no target should raise: a failed delivery
            self.failures += 1
            count_failure("audit_sink", self.target.kind)
            retry_after = exc.retry_after if isinstance(exc, SinkError) else None
            if retry_after is not None:  # heeded, up to retry_cap_seconds: never silenced for as long as it says
                retry_after = min(retry_after, self.backoff.cap)
            delay = self.backoff.delay(self.failures - 1, retry_after=retry_after)
            unexpected = {} if isinstance(exc, SinkError | TimeoutError) else {"exc_info": exc}
            log.warning(
                "audit.sink_failed",
                sink=self.name,
                attempt=self.failures,
                behind=self.behind,
                retry_in=round(delay, 2),
                error=str(exc) if isinstance(exc, SinkError) else f"{type(exc).__name__}: {exc}".rstrip(": "),
                **unexpected,
            )
            await self._wait_out(delay)
            return False
        if self.failures:
            log.info("audit.sink_recovered", sink=self.name, after_failures=self.failures)
        self.failures = 0
        self.position = (event_seq, checkpoint_seq)
        try:
            await self.positions.save(self.name, event_seq, checkpoint_seq, self.clock())
        except Exception as exc:  # delivered all the same: after a restart this batch goes again (deduped)
            count_failure("audit_sink_position")
            log.warning("audit.sink_position_not_saved", sink=self.name, error=str(exc))
        await self._measure()
        return True

    async def _wait_out(self, delay: float) -> None:
        """The wait before the next attempt, saying how far behind all along: measured at each append here, and
        each poll (other processes append)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + delay
        while (left := end - loop.time()) > 0:
            self._due.clear()
            await until_set(self._due, min(left, self.poll_seconds))
            await self._measure()

    async def _batch(self) -> tuple[list[dict[str, Any]], int, int]:
        """The next records in order: events after the position, and each checkpoint after the event it signs."""
        event_seq, checkpoint_seq = self.position
        events = await self.store.chain_events(event_seq, limit=self.batch)
        top = events[-1].seq if events else event_seq
        checkpoints = [c for c in await self.store.chain_checkpoints(checkpoint_seq, limit=self.batch) if c.seq <= top]
        records: list[dict[str, Any]] = []
        index = 0
        for event in events:
            while index < len(checkpoints) and checkpoints[index].seq < event.seq:
                records.append(checkpoint_record(checkpoints[index]))
                index += 1
            records.append(event_record(event))
        records += [checkpoint_record(c) for c in checkpoints[index:]]
        return records, top, checkpoints[-1].seq if checkpoints else checkpoint_seq

    async def _measure(self) -> None:
        last = await self.store.last_event_seq()
        self.behind = max(0, last - self.position[0])
        SINK_BEHIND.set(self.behind)
        SINK_DELIVERED.set(self.position[0])
