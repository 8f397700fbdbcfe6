"""audit.sink: every audit event and every signed checkpoint leaves the store in order and, deduplicated by
sequence number, exactly once, across a SIGKILL between a delivery and the write of its position; the file target
needs no deduplication of its receiver at all; a webhook that refuses connections, then hangs, delays no decision.

The receiver is a real HTTP server on 127.0.0.1 (aiohttp) that Kazma's sink reaches with its real client (httpx);
the stores are real SQLite files and real PostgreSQL databases. Waits are on conditions, each with a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from click.testing import CliRunner
from structlog.testing import capture_logs

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.audit_export import checkpoints_in_order, events_in_order, read_export
from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.bot.audit_sink import SINK_BEHIND, AuditSink, FileTarget, SinkPositions
from kazma.bot.cli import main
from kazma.config.audit_config import AuditSinkConfig
from kazma.config.backoff import Backoff
from kazma.config.errors import ConfigError
from kazma.config.loader import load_config_text
from kazma.config.metrics import failure_count
from kazma.config.redaction import redact, redact_config_secrets
from kazma.config.store.backend import StoreConnection
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.audit_support import Attacker
from tests.child_env import child_env
from tests.hang_report import awaits
from tests.process_support import REPO
from tests.store_backends import Engine, open_store, raw_rows

# The sink as `kazma run` starts it (AuditSink.of with the configured target), in a process of its own.
SINK_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from kazma.approvals import ApprovalStore
    from kazma.bot.audit_sink import AuditSink
    from kazma.config.audit_config import AuditSinkConfig
    from tests.store_backends import Engine, open_store

    async def main(backend, where, url):
        async with open_store(Engine(backend, where), application_name="kazma-sink-child") as conn:
            config = AuditSinkConfig(webhook=url, batch=5, retry_base_seconds=0.05, retry_cap_seconds=0.2)
            await AuditSink.of(ApprovalStore(conn), conn, config).run()

    asyncio.run(main(*sys.argv[1:4]))
    """
)


async def until(condition: Callable[[], bool], *, within: float = 60.0, what: str = "") -> None:
    async with asyncio.timeout(within):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


class Receiver:
    """An audit webhook: keeps every POSTed batch as it came; can hang a request, or act on one before answering."""

    def __init__(self) -> None:
        # The port is held from the start by a bound socket that does not listen: a connection to it is refused
        # (the webhook is down) and no other test's server can take the port before this one serves on it.
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/audit"
        self.batches: list[list[dict[str, Any]]] = []
        self.hang = False
        self.hanging = asyncio.Event()  # a request is held open
        self.release = asyncio.Event()
        self.before_answer: Callable[[], None] | None = None  # runs once, after the batch is kept

    async def handle(self, request: web.Request) -> web.Response:
        records = (await request.json())["records"]
        if self.hang:
            self.hanging.set()
            await self.release.wait()
        self.batches.append(records)
        act, self.before_answer = self.before_answer, None
        if act is not None:
            act()
        return web.json_response({"ok": True})

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Receiver]:
        app = web.Application()
        app.router.add_post("/audit", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, self.socket).start()
        try:
            yield self
        finally:
            self.release.set()
            async with asyncio.timeout(90):  # aiohttp waits up to 60 s for handlers still running
                await runner.cleanup()

    def records(self) -> list[dict[str, Any]]:
        return [record for batch in self.batches for record in batch]


def deduplicated(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a receiver keeps when it drops every record whose sequence number it has (per type). A record sent
    again must be the very record it had, and a new one must come right after the last (events: seq + 1)."""
    kept: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    last = {"event": 0, "checkpoint": 0}
    for record in records:
        kind, seq = record["type"], int(record["seq"])
        if seq <= last[kind]:
            assert seen[(kind, seq)] == record, f"{kind} {seq} sent again with other contents"
            continue
        if kind == "event":
            assert seq == last["event"] + 1, f"event {seq} came after event {last['event']}"
        else:
            assert seq <= last["event"], f"checkpoint {seq} came before the event it signs"
        last[kind] = seq
        seen[(kind, seq)] = record
        kept.append(record)
    return kept


async def in_store(store: ApprovalStore) -> tuple[list[int], list[int]]:
    events = await store.chain_events(0, limit=100_000)
    checkpoints = await store.chain_checkpoints(0, limit=100_000)
    return [e.seq for e in events], [c.seq for c in checkpoints]


def kinds(records: list[dict[str, Any]], kind: str) -> list[int]:
    return [int(r["seq"]) for r in records if r["type"] == kind]


async def decisions(service: ApprovalService, checkpointer: Checkpointer, n: int, *, tag: str) -> None:
    for i in range(n):
        request = await service.open("shell", {"command": f"{tag} {i}"}, "agent:builder", "telegram:-100")
        decision = Decision.APPROVE if i % 2 == 0 else Decision.DENY
        assert (await service.decide(request.id, decision, actor="telegram:111", platform="telegram")).won
    await checkpointer.sign()


@asynccontextmanager
async def kazma_store(engine: Engine) -> AsyncIterator[tuple[StoreConnection, ApprovalService, Checkpointer]]:
    async with open_store(engine) as conn:
        store = ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER)
        yield conn, ApprovalService(store, approvals_config()), Checkpointer(store, TEST_SIGNER)


async def sink_child(engine: Engine, url: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SINK_CHILD,
        engine.name,
        engine.where,
        url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env=child_env(),
        cwd=REPO,
    )


async def test_a_sink_killed_between_a_delivery_and_its_position_sends_it_again_and_loses_nothing(
    store_engine: Engine,
) -> None:
    async with kazma_store(store_engine) as (_, service, checkpointer):
        await decisions(service, checkpointer, 6, tag="before")
        receiver = Receiver()
        async with receiver.serving():
            first = await sink_child(store_engine, receiver.url)
            # The first batch is kept by the receiver, then the sink is killed before it hears the answer: it
            # never writes that it delivered.
            receiver.before_answer = lambda: os.kill(first.pid, signal.SIGKILL)
            async with asyncio.timeout(60):
                assert await first.wait() == -signal.SIGKILL
            assert [len(b) for b in receiver.batches] == [5]
            stored = raw_rows(store_engine, "SELECT event_seq FROM audit_sink_positions")
            assert stored in ([], [(0,)])  # nothing recorded as delivered

            await decisions(service, checkpointer, 4, tag="while down")  # the log goes on without its sink
            second = await sink_child(store_engine, receiver.url)
            try:
                events, checkpoints = await in_store(service.store)
                await until(
                    lambda: (
                        kinds(receiver.records(), "event")[-1:] == events[-1:]
                        and kinds(receiver.records(), "checkpoint")[-1:] == checkpoints[-1:]
                    ),
                    what="the sink caught up after its restart",
                )
            finally:
                second.kill()
                await second.wait()
    received = receiver.records()
    assert received[:5] == receiver.batches[0]
    assert received[5:10] == receiver.batches[0]  # the killed delivery, sent again from the stored position
    kept = deduplicated(received)
    assert kinds(kept, "event") == events  # every event once, in order
    assert kinds(kept, "checkpoint") == checkpoints  # every checkpoint once, after the events it signs


async def test_a_file_sink_restarted_ahead_of_its_stored_position_writes_each_record_once_and_it_verifies(
    store_engine: Engine, tmp_path: Path
) -> None:
    path = tmp_path / "audit" / "kazma-audit.jsonl"
    config = AuditSinkConfig(file=path, batch=4, retry_base_seconds=0.05, retry_cap_seconds=0.2)
    async with kazma_store(store_engine) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 5, tag="first run")
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        while await sink.deliver_once():
            pass
        delivered = sink.position
        assert delivered[0] == (await service.store.last_event_seq())
        # A crash after the file's fsync and before the position's write: the store says less was delivered,
        # and the last line was being written when the process died.
        await Attacker(store_engine).run_around(
            ("UPDATE audit_sink_positions SET event_seq = 2, checkpoint_seq = 0", ()),
        )
        with path.open("a", encoding="utf-8") as handle:
            handle.write('{"type":"event","seq":')

        await decisions(service, checkpointer, 3, tag="second run")
        restarted = AuditSink.of(service.store, conn, config)
        await restarted.start()
        assert restarted.position == delivered  # what the file itself holds wins over the stored position
        while await restarted.deliver_once():
            pass
        events, checkpoints = await in_store(service.store)

    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert kinds(lines, "event") == events  # not even a duplicate for a receiver to drop
    assert kinds(lines, "checkpoint") == checkpoints
    assert deduplicated(lines) == lines
    keys = tmp_path / "audit.pub"
    keys.write_text(TEST_SIGNER.public_keys().text(), encoding="utf-8")
    result = CliRunner().invoke(
        main, ["audit", "verify", "--from-export", str(path), "--public-key", str(keys)], env={"KAZMA_AUDIT_KEY": ""}
    )
    assert result.exit_code == 0, result.stdout


async def test_a_row_changed_around_kazma_into_what_it_never_writes_still_leaves_and_fails_verification(
    store_engine: Engine, tmp_path: Path
) -> None:
    # json refused the row (a time that is text reads back as NaN): the sink's task ended there, and nothing after
    # that row ever left the store.
    if store_engine.name != "sqlite":
        pytest.skip("PostgreSQL's column types refuse text in a time")
    path = tmp_path / "kazma-audit.jsonl"
    config = AuditSinkConfig(file=path, batch=100, retry_base_seconds=0.05, retry_cap_seconds=0.2)
    async with kazma_store(store_engine) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="before")
        changed = (await service.store.chain_events(0, limit=100))[1].seq
        await Attacker(store_engine).run_around(
            ("UPDATE approval_events SET at = 'yesterday' WHERE seq = ?", (changed,))
        )
        await decisions(service, checkpointer, 1, tag="after")
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        while await sink.deliver_once():
            pass
        events, _ = await in_store(service.store)
    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert kinds(lines, "event") == events
    keys = tmp_path / "audit.pub"
    keys.write_text(TEST_SIGNER.public_keys().text(), encoding="utf-8")
    result = CliRunner().invoke(
        main, ["audit", "verify", "--from-export", str(path), "--public-key", str(keys)], env={"KAZMA_AUDIT_KEY": ""}
    )
    assert result.exit_code == 1, result.stdout
    assert f"first bad sequence seq {changed}: changed: it holds what Kazma never writes" in result.stdout


async def test_a_webhook_that_refuses_then_hangs_delays_no_decision_and_gets_everything_after(
    store_engine: Engine,
) -> None:
    receiver = Receiver()
    config = AuditSinkConfig(
        webhook=receiver.url, batch=50, timeout_seconds=300, retry_base_seconds=0.05, retry_cap_seconds=0.2
    )
    async with kazma_store(store_engine) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 3, tag="before")
        sink = AuditSink.of(service.store, conn, config)
        failed_before = failure_count("audit_sink", "webhook")
        running = asyncio.create_task(sink.run())
        try:
            # Down: nothing listens on the port. Each attempt fails, is counted, and is tried again later.
            await until(lambda: failure_count("audit_sink", "webhook") >= failed_before + 2, what="refused twice")
            assert sink.behind == await service.store.last_event_seq()
            assert SINK_BEHIND._value.get() == sink.behind  # what /metrics shows
            # Then up but hanging: the sink's delivery waits on an answer that does not come.
            receiver.hang = True
            async with receiver.serving():
                try:
                    async with asyncio.timeout(60):
                        await receiver.hanging.wait()
                except TimeoutError:
                    where = "\n".join(awaits(running))
                    raise AssertionError(f"no delivery reached the webhook in 60 s; the sink is at:\n{where}") from None
                async with asyncio.timeout(60):  # decisions go on, every one, while the delivery hangs
                    await decisions(service, checkpointer, 20, tag="while the webhook hangs")
                assert not receiver.batches  # the hung delivery is still open: nothing was answered
                assert not running.done()
                receiver.hang = False
                receiver.release.set()
                events, checkpoints = await in_store(service.store)
                await until(
                    lambda: (
                        kinds(receiver.records(), "event")[-1:] == events[-1:]
                        and kinds(receiver.records(), "checkpoint")[-1:] == checkpoints[-1:]
                    ),
                    what="the webhook caught up",
                )
        finally:
            running.cancel()
            async with asyncio.timeout(60):  # a sink that does not end when cancelled fails here, by name
                await asyncio.gather(running, return_exceptions=True)
    kept = deduplicated(receiver.records())
    assert kinds(kept, "event") == events
    assert kinds(kept, "checkpoint") == checkpoints
    assert sink.failures == 0


@pytest.mark.parametrize(
    ("sink", "says"),
    [
        ("webhook: 'https://audit.example:99999/in'", "port"),
        ("webhook: 'https://audit.example:https/in'", "port"),
        ("webhook: 'https://audit.example:0/in'", "port"),
        ("syslog: 'tcp://127.0.0.1:65536'", "port"),
        ("syslog: 'udp://127.0.0.1:five'", "port"),
        ("webhook: 'https://audit.example/in', headers: {X-Key: 'clé'}", "header 'X-Key'"),
        ("webhook: 'https://audit.example/in', headers: {X-Key: \"a\\x01b\"}", "header 'X-Key'"),
        ("webhook: 'https://audit.example/in', headers: {X-Key: \"a\\x7fb\"}", "header 'X-Key'"),
        ("webhook: 'https://audit.example/in', headers: {X-Key: ' padded'}", "header 'X-Key'"),
    ],
)
def test_an_audit_sink_that_kazma_run_could_not_start_fails_the_config_check(sink: str, says: str) -> None:
    # The webhook's passed `kazma config check` and then crashed `kazma run` (the port read as the sink was made, a
    # header value httpx cannot encode) or failed every delivery (a value h11 refuses). Syslog's ports were refused
    # already, in the words of urllib.
    with pytest.raises(ConfigError, match=f"(?i)audit.sink.*{says}"):
        load_config_text(f"audit: {{sink: {{{sink}}}}}", environ={})


# --- The sink's targets, each against a real receiver on 127.0.0.1 (review findings) ---------------------------------


@pytest.fixture
def lite(tmp_path: Path) -> Engine:
    """A SQLite store: what these tests check is the sink's and its target's, the same on either engine."""
    return Engine("sqlite", str(tmp_path / "k.db"))


async def caught_up(store: ApprovalStore, records: Callable[[], list[dict[str, Any]]], *, within: float = 60.0) -> None:
    """Until ``records()`` holds the store's last event (a bounded wait; fails naming what was received)."""
    last = await store.last_event_seq()
    await until(lambda: last in kinds(records(), "event"), within=within, what=f"event {last} received")


async def delivered_all(sink: AuditSink) -> None:
    while await sink.deliver_once():
        pass


@asynccontextmanager
async def http(path: str, handler: Callable[[web.Request], Any]) -> AsyncIterator[str]:
    """One POST route served on 127.0.0.1; its URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}{path}"
    finally:
        async with asyncio.timeout(90):
            await runner.cleanup()


def free_port(kind: socket.SocketKind) -> int:
    """A port of 127.0.0.1 that nothing holds now (bound, then let go)."""
    with socket.socket(socket.AF_INET, kind) as held:
        held.bind(("127.0.0.1", 0))
        return int(held.getsockname()[1])


def syslog_record(message: bytes) -> dict[str, Any]:
    """The audit record an RFC 5424 message of the sink carries (after its header's `- MSGID -`)."""
    return dict(json.loads(message.split(b" - ", 2)[2]))


class TcpCollector:
    """A syslog collector over TCP (octet-counted frames, RFC 6587) on 127.0.0.1; can go away and come back."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._peers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._peers.add(writer)
        try:
            while True:
                size = await reader.readuntil(b" ")
                self.records.append(syslog_record(await reader.readexactly(int(size))))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._peers.discard(writer)
            writer.close()

    async def stop(self) -> None:
        """Gone as a restarted collector is: the listener and every connection closed."""
        assert self._server is not None
        self._server.close()
        peers = list(self._peers)
        for writer in peers:
            writer.close()
        for writer in peers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await self._server.wait_closed()


SECRET_PATH = "/hooks/T0SECRETPATH/B0SECRETPATH/x0secretpathtoken"


async def test_a_webhook_url_s_path_is_not_in_the_sink_s_name_its_logs_or_its_position(lite: Engine) -> None:
    # The path (the secret of a Slack, Discord or Sumo Logic webhook) was the sink's name: logged at every start and
    # failure, and kept in audit_sink_positions.
    received: list[dict[str, Any]] = []

    async def keep(request: web.Request) -> web.Response:
        received.extend((await request.json())["records"])
        return web.json_response({"ok": True})

    async with kazma_store(lite) as (conn, service, checkpointer), http(SECRET_PATH, keep) as url:
        await decisions(service, checkpointer, 1, tag="one")
        config = AuditSinkConfig(webhook=url)
        assert config.target.startswith("webhook:http://127.0.0.1:")
        assert "SECRET" not in config.target.upper()
        assert AuditSinkConfig(webhook=url + "-other").target != config.target  # each URL its own position
        sink = AuditSink.of(service.store, conn, config)
        with capture_logs() as logged:
            await sink.start()
            await delivered_all(sink)
            await sink.target.close()
            failing = AuditSink.of(service.store, conn, AuditSinkConfig(webhook=url.replace("/hooks", "/gone")))
            failing.backoff = Backoff(base=0.01, cap=0.01)
            await failing.start()
            assert not await failing.deliver_once()  # a 404: its failure logged
            await failing.target.close()
    assert received
    assert {e["event"] for e in logged} >= {"audit.sink_started", "audit.sink_failed"}
    assert "SECRET" not in repr(logged).upper()
    assert "SECRET" not in repr(raw_rows(lite, "SELECT * FROM audit_sink_positions")).upper()


async def test_a_webhook_sink_s_position_under_its_old_name_is_carried_over(store_engine: Engine) -> None:
    # A deployment from before the name changed goes on from where it was, and the old row (the URL whole) goes.
    url = f"https://audit.example{SECRET_PATH}"
    config = AuditSinkConfig(webhook=url)
    async with kazma_store(store_engine) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="one")
        await SinkPositions(conn).save(f"webhook:{url}", 3, 1, 0.0)
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        await sink.target.close()
        assert sink.position == (3, 1)
    rows = raw_rows(store_engine, "SELECT sink, event_seq, checkpoint_seq FROM audit_sink_positions")
    assert rows == [(config.target, 3, 1)]


def test_a_webhook_s_url_and_headers_are_never_logged() -> None:
    # The header values (an Authorization, a collector's token) and the URL reached the log as any text does.
    loaded = load_config_text(
        "audit: {sink: {webhook: 'https://audit.example/in/0urlsecret0token0', headers: {X-Key: '${KEY}'}}}",
        environ={"KEY": "0headersecret0value0"},
    )
    redact_config_secrets(loaded.config)
    shown = redact("POST https://audit.example/in/0urlsecret0token0 with X-Key: 0headersecret0value0")
    assert "secret" not in shown


def test_a_valid_webhook_config_makes_a_sink_target() -> None:
    loaded = load_config_text(
        "audit: {sink: {webhook: 'https://audit.example:8443/in', headers: {Authorization: 'Bearer a b\tc'}}}",
        environ={},
    )
    assert loaded.config.audit.sink is not None
    assert loaded.config.audit.sink.target.startswith("webhook:https://audit.example:8443#")


async def test_a_webhook_sink_run_again_after_it_stopped_delivers_again(lite: Engine) -> None:
    # Its run closed the HTTP client for good: a sink the supervisor restarts, or that a replica runs again once it
    # wins the lease back, failed every delivery ("the client has been closed"), uncounted, and its task died.
    receiver = Receiver()
    config = AuditSinkConfig(webhook=receiver.url, retry_base_seconds=0.05, retry_cap_seconds=0.2)
    async with kazma_store(lite) as (conn, service, checkpointer), receiver.serving():
        sink = AuditSink.of(service.store, conn, config)
        await decisions(service, checkpointer, 2, tag="first run")
        first = asyncio.create_task(sink.run())
        await caught_up(service.store, receiver.records)
        first.cancel()  # the lease lost, or app stop
        await asyncio.gather(first, return_exceptions=True)

        await decisions(service, checkpointer, 2, tag="second run")
        second = asyncio.create_task(sink.run())
        try:
            last = await service.store.last_event_seq()
            await until(lambda: second.done() or last in kinds(receiver.records(), "event"), what="delivered again")
            assert not second.done(), f"the sink's run ended: {second.exception()!r}"
        finally:
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)


class Flaky:
    """A target whose first delivery fails with what no target is meant to raise."""

    kind = "flaky"

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.calls = 0

    async def deliver(self, records: list[dict[str, Any]]) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug in a target")
        self.records += records

    async def delivered(self) -> None:
        return None

    async def start_over(self) -> str:
        raise AssertionError("never asked")

    async def close(self) -> None:
        return


async def test_an_unexpected_error_in_a_delivery_is_a_counted_failed_delivery(lite: Engine) -> None:
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 1, tag="one")
        target = Flaky()
        sink = AuditSink(service.store, SinkPositions(conn), target, name="flaky", backoff=Backoff(base=0.01, cap=0.01))
        failed = failure_count("audit_sink", "flaky")
        await sink.start()
        assert not await sink.deliver_once()  # failed, counted, waited out: not raised out of the sink's loop
        assert failure_count("audit_sink", "flaky") == failed + 1
        assert sink.failures == 1
        await delivered_all(sink)
        assert kinds(target.records, "event") == (await in_store(service.store))[0]


async def test_retry_after_is_capped_at_retry_cap_seconds(lite: Engine) -> None:
    # A 503 with Retry-After: 86400 silenced the sink for a day, whatever retry_cap_seconds said.
    async def busy(request: web.Request) -> web.Response:
        return web.Response(status=503, headers={"Retry-After": "86400"})

    async with kazma_store(lite) as (conn, service, checkpointer), http("/audit", busy) as url:
        await decisions(service, checkpointer, 1, tag="one")
        config = AuditSinkConfig(webhook=url, retry_base_seconds=0.1, retry_cap_seconds=0.5)
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        with capture_logs() as logged:
            attempt = asyncio.create_task(sink.deliver_once())
            try:
                await until(lambda: any(e["event"] == "audit.sink_failed" for e in logged), what="the attempt failed")
            finally:
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
                await sink.target.close()
    [failed] = [e for e in logged if e["event"] == "audit.sink_failed"]
    assert failed["retry_in"] <= 0.5


async def test_a_webhook_s_error_answer_is_not_read_whole(lite: Engine) -> None:
    # The body of an answer was read whole, whatever its size: a 400 MB error page took 900 MB of memory.
    size = 64 * 1024 * 1024
    served = {"sent": 0, "whole": False}
    ended = asyncio.Event()

    async def huge(request: web.Request) -> web.StreamResponse:
        try:
            answer = web.StreamResponse(status=400, headers={"Content-Type": "text/plain"})
            answer.content_length = size
            await answer.prepare(request)
            chunk = b"refused: " + b"x" * (65536 - 9)
            while served["sent"] < size:
                await answer.write(chunk)
                served["sent"] += len(chunk)
            served["whole"] = True
            return answer
        finally:
            ended.set()

    async with kazma_store(lite) as (conn, service, checkpointer), http("/audit", huge) as url:
        await decisions(service, checkpointer, 1, tag="one")
        sink = AuditSink.of(service.store, conn, AuditSinkConfig(webhook=url, timeout_seconds=120))
        sink.backoff = Backoff(base=0.01, cap=0.01)
        await sink.start()
        with capture_logs() as logged:
            assert not await sink.deliver_once()
        await sink.target.close()
        async with asyncio.timeout(60):
            await ended.wait()
    assert not served["whole"], f"the whole {served['sent']} bytes were read"
    [failed] = [e for e in logged if e["event"] == "audit.sink_failed"]
    assert failed["error"].startswith("webhook answered 400: refused: xxx")
    assert len(failed["error"]) < 1000


async def test_tcp_syslog_to_a_collector_that_restarted_reconnects_before_it_writes(lite: Engine) -> None:
    # The connection the collector closed still took writes (its FIN does not make it "closing"): the next batch
    # went into it, counted as delivered, and never reached anyone.
    collector = TcpCollector()
    await collector.start()
    config = AuditSinkConfig(syslog=f"tcp://127.0.0.1:{collector.port}", retry_base_seconds=0.05, retry_cap_seconds=0.2)
    async with kazma_store(lite) as (conn, service, checkpointer):
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        try:
            await decisions(service, checkpointer, 2, tag="before the restart")
            await delivered_all(sink)
            await caught_up(service.store, lambda: collector.records)
            lost_before = failure_count("audit_sink_connection_lost", "syslog")

            await collector.stop()  # restarted: the old connection closed, a new listener on the same port
            await collector.start()
            await decisions(service, checkpointer, 2, tag="after the restart")
            await delivered_all(sink)
            await caught_up(service.store, lambda: collector.records, within=10)
            assert failure_count("audit_sink_connection_lost", "syslog") == lost_before + 1
            events, checkpoints = await in_store(service.store)
        finally:
            await sink.target.close()
            await collector.stop()
    kept = deduplicated(collector.records)
    assert kinds(kept, "event") == events
    assert kinds(kept, "checkpoint") == checkpoints


async def test_udp_syslog_with_nothing_listening_is_a_counted_failed_delivery(lite: Engine) -> None:
    # Datagrams to a port nobody listens on were "delivered": nothing was lost as far as the sink knew.
    port = free_port(socket.SOCK_DGRAM)
    config = AuditSinkConfig(syslog=f"udp://127.0.0.1:{port}", retry_base_seconds=0.01, retry_cap_seconds=0.01)
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 1, tag="nobody listens")
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        failed = failure_count("audit_sink", "syslog")
        try:
            assert not await sink.deliver_once()
        finally:
            await sink.target.close()
        assert failure_count("audit_sink", "syslog") == failed + 1
        assert sink.position == (0, 0)
        assert raw_rows(lite, "SELECT event_seq FROM audit_sink_positions") in ([], [(0,)])


async def test_udp_syslog_delivers_every_record_to_a_listening_collector(lite: Engine) -> None:
    received: list[dict[str, Any]] = []

    class Collect(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
            received.append(syslog_record(data))

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Collect, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    config = AuditSinkConfig(syslog=f"udp://127.0.0.1:{port}", batch=7)
    try:
        async with kazma_store(lite) as (conn, service, checkpointer):
            await decisions(service, checkpointer, 3, tag="udp")
            sink = AuditSink.of(service.store, conn, config)
            await sink.start()
            try:
                await delivered_all(sink)
            finally:
                await sink.target.close()
            await caught_up(service.store, lambda: received)
            events, checkpoints = await in_store(service.store)
    finally:
        transport.close()
    assert kinds(received, "event") == events
    assert kinds(received, "checkpoint") == checkpoints


CUT_SHORT = textwrap.dedent(
    """
    import asyncio, resource, sys
    from pathlib import Path
    from kazma.bot.audit_sink import FileTarget, SinkError

    def record(seq):
        return {"type": "event", "seq": seq, "detail": "x" * 200}

    async def main(path):
        target = FileTarget(Path(path))
        await target.deliver([record(1)])
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (Path(path).stat().st_size + 300, hard))  # a full disk, as near
        try:
            await target.deliver([record(2), record(3)])
        except SinkError as exc:
            print("failed:", exc)
        else:
            print("delivered")
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        await target.deliver([record(2), record(3)])  # the retry, once there is room

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_a_file_sink_that_cannot_write_a_whole_batch_fails_it_and_leaves_the_file_whole(tmp_path: Path) -> None:
    # A short write (the file size limit; a full disk) was counted as delivered: half a batch in the file, the next
    # append glued to its cut line, and the file no longer read back.
    path = tmp_path / "kazma-audit.jsonl"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CUT_SHORT, str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(),
        cwd=REPO,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    assert out.decode().startswith("failed: cannot write"), out.decode()
    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert kinds(lines, "event") == [1, 2, 3]


async def test_a_file_sink_makes_its_file_durable_in_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file was fsynced, its folder's entry for it never: a crash could lose the whole new file.
    synced: list[int] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = tmp_path / "audit" / "kazma-audit.jsonl"
    await FileTarget(path).deliver([{"type": "event", "seq": 1}])
    assert path.stat().st_ino in synced
    assert path.parent.stat().st_ino in synced


def copy_store(source: Path, to: Path) -> None:
    """A backup of a SQLite store that is closed (its WAL folded in)."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            (to.parent / (to.name + suffix)).unlink()
        if (source.parent / (source.name + suffix)).exists():
            shutil.copyfile(source.parent / (source.name + suffix), to.parent / (to.name + suffix))


@pytest.mark.parametrize("after_restore", [1, 6], ids=["store-shorter", "same-seq-other-event"])
async def test_a_file_sink_whose_file_goes_past_a_store_restored_from_backup_starts_a_new_file(
    lite: Engine, tmp_path: Path, after_restore: int
) -> None:
    # The file's last seq won over the store's: a store restored from an older backup went on appending events under
    # seqs the file had already, and the sink skipped each of them (and later wrote a chain that did not verify).
    db, backup = Path(lite.where), tmp_path / "backup.db"
    path = tmp_path / "kazma-audit.jsonl"
    config = AuditSinkConfig(file=path, retry_base_seconds=0.05, retry_cap_seconds=0.2)
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="backed up")
    copy_store(db, backup)
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="lost with the store")
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        await delivered_all(sink)
    written = path.read_bytes()
    copy_store(backup, db)  # the store restored from its backup; the file keeps what it had
    diverged_before = failure_count("audit_sink_diverged", "file")
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, after_restore, tag="after the restore")
        restarted = AuditSink.of(service.store, conn, config)
        with capture_logs() as logged:
            await restarted.start()
        await delivered_all(restarted)
        events, checkpoints = await in_store(service.store)
    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert kinds(lines, "event") == events  # the new file: the store's whole chain, from its first event
    assert kinds(lines, "checkpoint") == checkpoints
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("kazma-audit.jsonl.diverged-")]
    assert len(aside) == 1
    assert aside[0].read_bytes() == written  # kept as it was: it holds events the store no longer has
    assert failure_count("audit_sink_diverged", "file") == diverged_before + 1
    assert [e["log_level"] for e in logged if e["event"] == "audit.sink_diverged"] == ["error"]
    keys = tmp_path / "audit.pub"
    keys.write_text(TEST_SIGNER.public_keys().text(), encoding="utf-8")
    result = CliRunner().invoke(
        main, ["audit", "verify", "--from-export", str(path), "--public-key", str(keys)], env={"KAZMA_AUDIT_KEY": ""}
    )
    assert result.exit_code == 0, result.stdout


async def test_a_file_sink_whose_file_continues_the_store_goes_on_from_the_file(lite: Engine, tmp_path: Path) -> None:
    path = tmp_path / "kazma-audit.jsonl"
    config = AuditSinkConfig(file=path)
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="one")
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        await delivered_all(sink)
        await decisions(service, checkpointer, 1, tag="two")
        again = AuditSink.of(service.store, conn, config)
        await again.start()
        assert again.position == sink.position
        await delivered_all(again)
        events, _ = await in_store(service.store)
    assert not [p for p in tmp_path.iterdir() if ".diverged-" in p.name]
    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert kinds(lines, "event") == events


async def test_the_behind_gauge_follows_the_store_while_the_sink_waits_and_resets_when_it_stops(lite: Engine) -> None:
    # It was measured only around attempts: during a long retry wait it said what it said at the last attempt, and on
    # a replica that lost the lease it said that for good.
    receiver = Receiver()  # nothing listens: every attempt is refused
    config = AuditSinkConfig(webhook=receiver.url, retry_base_seconds=600, retry_cap_seconds=600)
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 1, tag="before")
        sink = AuditSink.of(service.store, conn, config)
        failed = failure_count("audit_sink", "webhook")
        running = asyncio.create_task(sink.run())
        try:
            await until(lambda: failure_count("audit_sink", "webhook") == failed + 1, what="the first attempt failed")
            await decisions(service, checkpointer, 2, tag="while it waits")
            last = await service.store.last_event_seq()
            await until(lambda: SINK_BEHIND._value.get() == last, within=30, what="the gauge followed the store")
            assert failure_count("audit_sink", "webhook") == failed + 1  # measured while waiting: no new attempt
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        assert SINK_BEHIND._value.get() == 0  # this process no longer sinks: it says nothing is behind here


async def test_a_checkpoint_changed_into_what_kazma_never_writes_is_sunk_and_named_in_the_file(
    lite: Engine, tmp_path: Path
) -> None:
    """A checkpoint row whose time was made text around Kazma (SQLite keeps it) stops no delivery: the file gets
    every record, that checkpoint as it was held, and a verifier of the file names it."""
    path = tmp_path / "audit.jsonl"
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="one")
        signed = (await in_store(service.store))[1][0]
        await Attacker(lite).run_around(("UPDATE audit_checkpoints SET at = 'soon' WHERE seq = ?", (signed,)))
        sink = AuditSink(service.store, SinkPositions(conn), FileTarget(path), name="file")
        await sink.start()
        await delivered_all(sink)
        events, checkpoints = await in_store(service.store)
    export = read_export(path.read_bytes(), source=str(path))
    assert [e.seq for e in events_in_order(export)] == events
    assert [c.seq for c in checkpoints_in_order(export)] == checkpoints
    report = verify(events_in_order(export), checkpoints_in_order(export), TEST_SIGNER.public_keys())
    assert report.first is not None
    assert report.first.kind == "bad signature"
    assert f"checkpoint #{signed} (head): it holds what Kazma never writes (at is 'soon')" in report.first.detail


@pytest.mark.parametrize(
    "last",
    [
        b'{"type":"event"}\n',
        b'{"type":"event","seq":"7"}\n',
        b'{"type":"checkpoint","seq":1e400}\n',
        b"2026-12-04 12:00:01 INFO app started\n",
    ],
    ids=["no-seq", "seq-text", "seq-infinite", "another-log"],
)
async def test_a_file_sink_whose_file_ends_in_what_no_sink_writes_sets_it_aside_and_starts_a_new_file(
    lite: Engine, tmp_path: Path, last: bytes
) -> None:
    # Before: its start raised (KeyError, ValueError, OverflowError) at every restart and nothing was delivered
    # again; or, for lines of another log, the chain was appended to them and the file no longer verified.
    path = tmp_path / "kazma-audit.jsonl"
    config = AuditSinkConfig(file=path)
    async with kazma_store(lite) as (conn, service, checkpointer):
        await decisions(service, checkpointer, 2, tag="one")
        sink = AuditSink.of(service.store, conn, config)
        await sink.start()
        await delivered_all(sink)
        with path.open("ab") as handle:
            handle.write(last)
        written = path.read_bytes()
        await decisions(service, checkpointer, 1, tag="two")
        again = AuditSink.of(service.store, conn, config)
        with capture_logs() as logged:
            await again.start()
        await delivered_all(again)
        events, checkpoints = await in_store(service.store)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("kazma-audit.jsonl.diverged-")]
    assert [p.read_bytes() for p in aside] == [written]
    assert [e["foreign"] for e in logged if e["event"] == "audit.sink_diverged"]
    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert kinds(lines, "event") == events
    assert kinds(lines, "checkpoint") == checkpoints
