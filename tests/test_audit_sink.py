"""audit.sink: every audit event and every signed checkpoint leaves the store in order and, deduplicated by
sequence number, exactly once, across a SIGKILL between a delivery and the write of its position; the file target
needs no deduplication of its receiver at all; a webhook that refuses connections, then hangs, delays no decision.

The receiver is a real HTTP server on 127.0.0.1 (aiohttp) that Kazma's sink reaches with its real client (httpx);
the stores are real SQLite files and real PostgreSQL databases. Waits are on conditions, each with a bound.
"""

from __future__ import annotations

import asyncio
import json
import os
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

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.checkpointer import Checkpointer
from kazma.bot.audit_sink import SINK_BEHIND, AuditSink
from kazma.bot.cli import main
from kazma.config.audit_config import AuditSinkConfig
from kazma.config.errors import ConfigError
from kazma.config.loader import load_config_text
from kazma.config.metrics import failure_count
from kazma.config.store.backend import StoreConnection
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.audit_support import Attacker
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
        env={**os.environ, "PYTHONPATH": str(REPO)},
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
        Attacker(store_engine).run(
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
        Attacker(store_engine).run(("UPDATE approval_events SET at = 'yesterday' WHERE seq = ?", (changed,)))
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
