"""The audit chain under attack: a real log made by Kazma, then rewritten the way anyone who can write the store
could (a connection of their own, the append-only triggers taken away first), never through Kazma.

:class:`Attacker` knows everything but the audit key: the chain's algorithm is public
(:func:`kazma.approvals.chain.event_hash`), so it can re-chain whatever it changes; it can sign checkpoints
only with a key of its own.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

from kazma.approvals import ApprovalService, Decision
from kazma.approvals.chain import EVENT_COLUMNS, GENESIS, ChainedEvent
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import AuditSigner, Checkpoint
from kazma.config.keyring import AUDIT_KEYS, Keyring
from kazma.config.store.postgres import pyformat
from tests.approvals_support import APPROVERS_YAML, TEST_AUDIT_KEY, TEST_KEY, TEST_SIGNER, approval_service
from tests.store_backends import Engine

ARGS = {"command": "deploy --prod"}


async def whole_log(service: ApprovalService) -> tuple[list[Any], list[Any]]:
    """Every event and every checkpoint of the service's audit chain, as a verifier reads them."""
    return await service.store.chain_events(limit=100_000), await service.store.chain_checkpoints(limit=100_000)


# A key of the attacker's own, under the id the real one has: what a forger without the key can sign with.
FORGER = AuditSigner(Keyring.of(AUDIT_KEYS, (TEST_AUDIT_KEY[0], "Zm9yZ2VyLWtleS1vZi0zMi1ieXRlcy1vbmx5LWZha2U")))
# The audit keyring replicas share through the environment, as KAZMA_AUDIT_KEY holds it.
AUDIT_KEY = f"{TEST_AUDIT_KEY[0]}:{TEST_AUDIT_KEY[1]}"
KEY_ENV = {
    "KAZMA_DECISION_KEY": f"{TEST_KEY[0]}:{TEST_KEY[1]}",
    "KAZMA_AUDIT_KEY": f"{TEST_AUDIT_KEY[0]}:{TEST_AUDIT_KEY[1]}",
}
CHECKPOINT_COLUMNS = "kind, first_seq, seq, head, at, key_id, signature"


@dataclass
class Log:
    """What Kazma wrote: request ids by name, and the events' sequence numbers by what they record."""

    requests: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    last: int = 0


async def make_log(where: str) -> Log:
    """Three requests (approved, denied, timed out), executions and rules audited, signed in several passes."""
    log = Log()
    async with approval_service(where) as service:
        checkpointer = Checkpointer(service.store, TEST_SIGNER)
        deploy = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        drop = await service.open("shell", {"command": "drop table users"}, "agent:builder", "telegram:-100")
        await checkpointer.sign()
        assert (await service.decide(deploy.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        assert (await service.decide(drop.id, Decision.DENY, actor="slack:U111", platform="slack", reason="no")).won
        await checkpointer.sign()
        await service.verify_execution(deploy.id, "shell", ARGS)
        await service.execution_finished(deploy.id, ok=True, output="deployed", error=None)
        late = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100", deadline=0.01)
        await service.wait(late.id)
        await checkpointer.sign()
        log.requests = {"deploy": deploy.id, "drop": drop.id, "late": late.id}
        for event in await service.store.chain_events():
            log.seqs.setdefault(f"{event.event}:{_name(log, event.request_id)}", event.seq)
            log.last = event.seq
    return log


def _name(log: Log, request_id: str | None) -> str:
    return next((name for name, rid in log.requests.items() if rid == request_id), "-")


def config_text(tmp_path: Path, engine: Engine) -> str:
    store = f"url: '{engine.where}'" if engine.postgres else f"path: '{engine.where}'"
    return f"store: {{{store}}}\n{APPROVERS_YAML}"


def where_of(engine: Engine) -> str:
    return engine.where


class Attacker:
    """Direct writes to the store around Kazma, with the append-only triggers taken away."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        if self.engine.postgres:
            with psycopg.connect(self.engine.where, autocommit=False) as pg:
                for table in ("approval_events", "audit_checkpoints", "approval_requests"):
                    pg.execute(f"ALTER TABLE IF EXISTS {table} DISABLE TRIGGER USER")
                yield pg
                pg.commit()
            return
        lite = sqlite3.connect(self.engine.where)
        try:
            with lite:
                for trigger in (
                    "approval_events_append_only_update",
                    "approval_events_append_only_delete",
                    "audit_checkpoints_append_only_update",
                    "audit_checkpoints_append_only_delete",
                    "approval_requests_final",
                    "approval_requests_seal_final",
                ):
                    lite.execute(f"DROP TRIGGER IF EXISTS {trigger}")
                yield lite
        finally:
            lite.close()

    def run(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        with self._connection() as conn:
            for sql, params in statements:
                conn.execute(pyformat(sql) if self.engine.postgres else sql, params)

    async def run_around(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """:meth:`run`, off the event loop: for a test whose loop runs a live Kazma, which may hold the store's
        write lock across loop turns (a blocking write on the loop would wait for a commit that cannot come)."""
        await asyncio.to_thread(self.run, *statements)

    def events(self) -> list[ChainedEvent]:
        with self._connection() as conn:
            rows = conn.execute(f"SELECT {EVENT_COLUMNS} FROM approval_events ORDER BY seq").fetchall()  # noqa: S608
        return [ChainedEvent.of_row(row) for row in rows]

    def checkpoints(self) -> list[Checkpoint]:
        with self._connection() as conn:
            rows = conn.execute(f"SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints ORDER BY seq").fetchall()  # noqa: S608
        return [Checkpoint(str(r[0]), int(r[1]), int(r[2]), str(r[3]), float(r[4]), r[5], r[6]) for r in rows]

    def replace_log(self, events: list[ChainedEvent], checkpoints: list[Checkpoint]) -> None:
        """The whole log (and its checkpoints) replaced by these."""
        marks = ", ".join(["?"] * 12)
        with self._connection() as conn:
            conn.execute("DELETE FROM approval_events")
            conn.execute("DELETE FROM audit_checkpoints")
            for e in events:
                sql = f"INSERT INTO approval_events ({EVENT_COLUMNS}, commit_seal) VALUES ({marks})"  # noqa: S608
                params = (e.seq, e.request_id, e.event, e.actor, e.platform, e.at, e.args_hash, e.detail,
                          e.prev_hash, e.chain_hash, e.person, None)  # fmt: skip
                conn.execute(pyformat(sql) if self.engine.postgres else sql, params)
            for c in checkpoints:
                sql = f"INSERT INTO audit_checkpoints ({CHECKPOINT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
                row = (c.kind, c.first_seq, c.seq, c.head, c.at, c.key_id, c.signature)
                conn.execute(pyformat(sql) if self.engine.postgres else sql, row)


def rechained(events: list[ChainedEvent]) -> list[ChainedEvent]:
    """``events`` numbered 1.. and chained again from the start, as the public algorithm says."""
    out: list[ChainedEvent] = []
    prev = GENESIS
    for seq, event in enumerate(events, start=1):
        digest = replace(event, seq=seq).hash_after(prev)
        out.append(replace(event, seq=seq, prev_hash=prev, chain_hash=digest))
        prev = digest
    return out


def resigned(events: list[ChainedEvent], originals: list[Checkpoint], signer: AuditSigner) -> list[Checkpoint]:
    """Checkpoints at the original places over ``events``, signed by ``signer``."""
    heads = {e.seq: e.chain_hash or "" for e in events}
    return [signer.sign(c.kind, c.first_seq, c.seq, heads[c.seq], c.at) for c in originals if c.seq in heads]


def run_async(coroutine: Any) -> Any:
    return asyncio.run(coroutine)
