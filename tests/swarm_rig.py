"""A swarm service on a real store (SQLite or PostgreSQL) with scripted or agent workers, for the issue-32 tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY

from kazma.approvals import ApprovalService
from kazma.config import KazmaConfig, load_config_text
from kazma.config.store.backend import StoreConnection
from kazma.config.store.database import open_database
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.service import CoalescingReporter, SwarmService
from kazma.engine.swarm.state_store import MIGRATIONS as STATE
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore, TaskRecord
from kazma.engine.swarm.types import TaskStatus, Worker

BASE = """
approvals: {approvers: ["telegram:111"], deadline_seconds: 600}
platforms: {telegram: {admins: [111]}}
"""


def config(text: str = "") -> KazmaConfig:
    return load_config_text(BASE + text).config


def sample(name: str, labels: Mapping[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, dict(labels or {})) or 0.0


def failures(site: str) -> float:
    return sample("kazma_swarm_failures_total", {"site": site})


@dataclass
class Sleeps:
    """Backoff waits recorded, never slept."""

    delays: list[float] = field(default_factory=list)

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@dataclass
class Rig:
    service: SwarmService
    commands: SwarmCommands
    path: Path
    progress: list[str]  # every progress line the swarm reported, in order

    async def send(self, text: str, *, actor: str = "telegram:111", admin: bool = True) -> str:
        return await self.commands.run(text, actor=actor, platform="telegram", chat="-1001", is_admin=admin)

    async def ended(self, answer: str) -> TaskRecord:
        assert answer.startswith("swarm task "), answer
        record = await self.service.wait(answer.split()[2], 30)
        assert record is not None
        assert record.status.terminal, record
        return record

    async def said(self, words: str) -> str:
        """Wait for a progress line containing ``words``."""
        async with asyncio.timeout(20):
            while not (found := [line for line in self.progress if words in line]):
                await asyncio.sleep(0.01)
        return found[0]

    async def status(self, task_id: str, wanted: TaskStatus) -> TaskRecord:
        async with asyncio.timeout(20):
            while (record := await self.service.store.get(task_id)) is None or record.status is not wanted:
                await asyncio.sleep(0.01)
        return record


async def no_sleep(_: float) -> None:
    return


@asynccontextmanager
async def rig(
    path: Path,
    workers: Mapping[str, Worker],
    cfg: KazmaConfig,
    *,
    sleep: Callable[[float], Awaitable[None]] = no_sleep,
    rng: Callable[[], float] = lambda: 1.0,
    approvals: ApprovalService | None = None,
    busy_timeout_ms: int = 50,
    store: StoreConnection | None = None,
) -> AsyncIterator[Rig]:
    """``store``: the swarm's tables on a store the caller opened (PostgreSQL); else a SQLite file at ``path``."""
    conn: StoreConnection = (
        store
        if store is not None
        else await open_database(path, migrations=[*MIGRATIONS, *STATE], busy_timeout_ms=busy_timeout_ms)
    )
    progress: list[str] = []

    async def report(lines: str) -> None:
        progress.extend(lines.splitlines())

    service = SwarmService(
        SwarmTaskStore(conn, sleep=no_sleep),
        workers,
        cfg,
        approvals=approvals,
        reporter=CoalescingReporter(report, interval=0),
        state=SwarmStateStore(conn),
        sleep=sleep,
        rng=rng,
    )
    try:
        yield Rig(service, SwarmCommands(service, cfg), path, progress)
    finally:
        await service.close()
        if store is None:
            await conn.close()
