"""Shared set-up for approvals tests: a real store on a temporary file, a controllable clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite

from kazma.approvals import (
    ApprovalCard,
    ApprovalRequest,
    ApprovalService,
    ApprovalStore,
    PressVerdict,
    Status,
)
from kazma.approvals.checkpoints import AuditSigner
from kazma.approvals.store import PostedCard
from kazma.bot.store import all_migrations, pg_migrations
from kazma.config import KazmaConfig, load_config_text
from kazma.config.keyring import AUDIT_KEYS, DECISION_KEYS, Keyring
from kazma.config.store.database import open_database
from kazma.config.store.postgres import PgStore, open_pg_store

# The decision keyring of every test service: what the store seals outcomes with and execution verifies.
TEST_KEY = ("k1", "test-decision-key-" + "0" * 32)
TEST_KEYRING = Keyring.of(DECISION_KEYS, TEST_KEY)
# The audit keyring of every test service: an Ed25519 seed (URL-safe base64 of 32 bytes) that signs checkpoints.
TEST_AUDIT_KEY = ("a1", "YXVkaXQta2V5LW9mLWV2ZXJ5LWthem1hLXRlc3QtLS0")
TEST_AUDIT_KEYRING = Keyring.of(AUDIT_KEYS, TEST_AUDIT_KEY)
TEST_SIGNER = AuditSigner(TEST_AUDIT_KEYRING)

APPROVERS_YAML = """
approvals:
  deadline_seconds: 600
  approvers: ["telegram:111", "slack:U111", "discord:222", "web:admin", "cli:ops"]
platforms:
  telegram: {admins: [112]}
"""


def approvals_config(extra: str = "") -> KazmaConfig:
    return load_config_text(APPROVERS_YAML + extra).config


class ManualClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingPublisher:
    """A CardPublisher that keeps what it was asked to do (the real bus is tested with the adapters)."""

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.published: list[ApprovalCard] = []
        self.settled: list[str] = []

    def can_show_cards(self, policy: str | None = None) -> bool:
        return self.available

    async def publish(self, card: ApprovalCard) -> None:
        self.published.append(card)

    async def settle(self, request_id: str) -> None:
        self.settled.append(request_id)


@asynccontextmanager
async def approval_service(
    path: Path | str,
    *,
    config: KazmaConfig | None = None,
    clock: ManualClock | None = None,
    publisher: RecordingPublisher | None = None,
    busy_timeout_ms: int = 5000,
    poll_interval: float = 0.5,
    keyring: Keyring | None = TEST_KEYRING,
    audit: AuditSigner | None = TEST_SIGNER,
) -> AsyncIterator[ApprovalService]:
    conn: aiosqlite.Connection | PgStore
    if isinstance(path, str) and path.startswith("postgresql://"):  # a test database on the suite's server
        conn = await open_pg_store(path, migrations=pg_migrations(), application_name="kazma-test")
    else:
        # Every component, as Kazma makes a store: the commands that only read refuse one with fewer migrations.
        conn = await open_database(path, busy_timeout_ms=busy_timeout_ms, migrations=all_migrations())
    try:
        kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
        store = ApprovalStore(conn, keyring=keyring, audit=audit, **kwargs)
        yield ApprovalService(
            store,
            config or approvals_config(),
            publisher=publisher,
            poll_interval=poll_interval,
            **kwargs,
        )
    finally:
        await conn.close()


def assert_one_winner_each(
    ids: Iterable[str], rows: Mapping[str, ApprovalRequest], presses: Iterable[Sequence[Sequence[str]]]
) -> None:
    """Presses made by several processes, each (request id, verdict, status, decided by): every request
    decided, exactly one press won it, and every losing press was told the outcome that stands."""
    wins = dict.fromkeys(ids, 0)
    for per_process in presses:
        for rid, verdict, status, decided_by in per_process:
            row = rows[rid]
            assert row.status in (Status.APPROVED, Status.DENIED)
            assert (status, decided_by) == (row.status.value, row.decided_by)  # losers told what stands
            if verdict == PressVerdict.WON.value:
                wins[rid] += 1
            else:
                assert verdict == PressVerdict.LOST.value
    assert set(wins.values()) == {1}


async def settled_rows(store: ApprovalStore, request_id: str, timeout: float = 20.0) -> list[PostedCard]:
    """The request's card rows once each says it is settled: an edit's row commits after it (riding with other
    writes when its worker has nothing else to edit: bus.SETTLED_RIDE)."""
    async with asyncio.timeout(timeout):
        while True:
            cards = await store.cards(request_id)
            if all(card.settled_status is not None for card in cards):
                return cards
            await asyncio.sleep(0.005)
