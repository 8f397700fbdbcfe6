"""Scripted swarm workers for tests, and a second connection that takes the store's write lock on cue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiosqlite

from kazma.engine.swarm.types import WorkerResult

Reply = WorkerResult | Callable[[str, str], WorkerResult]


@dataclass
class ScriptedWorker:
    """A worker that answers from a script and records what it was asked."""

    name: str
    replies: list[Reply] = field(default_factory=list)
    expertise: tuple[str, ...] = ()
    seen: list[tuple[str, str]] = field(default_factory=list)
    gate: asyncio.Event | None = None

    async def run(self, prompt: str, *, context: str = "") -> WorkerResult:
        self.seen.append((prompt, context))
        if self.gate is not None:
            await self.gate.wait()
        reply = self.replies.pop(0) if self.replies else WorkerResult(self.name, True, output=f"{self.name} ok")
        return reply(prompt, context) if callable(reply) else reply


class Locker:
    """Another process's connection holding the store's write lock, taken and given back on cue."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: aiosqlite.Connection | None = None

    async def lock(self) -> None:
        self.conn = await aiosqlite.connect(str(self.path), isolation_level=None, timeout=0)
        await self.conn.execute("BEGIN IMMEDIATE")

    async def unlock(self) -> None:
        if self.conn is not None:
            await self.conn.execute("ROLLBACK")
            await self.conn.close()
            self.conn = None


@asynccontextmanager
async def store_locked(path: Path) -> AsyncIterator[Locker]:
    """The store's write lock held by another connection for the block."""
    locker = Locker(path)
    await locker.lock()
    try:
        yield locker
    finally:
        await locker.unlock()
