"""Shapes shared by the swarm engine, its task store, its reliability layer and the /swarm commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kazma.engine.types import Usage


class Pattern(StrEnum):
    DISPATCH = "dispatch"
    BROADCAST = "broadcast"
    PIPELINE = "pipeline"
    FAN_OUT = "fan_out"
    CONSULT = "consult"
    CONDITIONAL = "conditional"


class TaskStatus(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"  # a pipeline checkpoint waits for approval
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"  # some workers of a fan-out failed
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"  # the process died while it ran: outcome unknown

    @property
    def terminal(self) -> bool:
        return self not in (TaskStatus.RUNNING, TaskStatus.PAUSED)


class ErrorKind(StrEnum):
    TRANSIENT = "transient"  # timeouts, 5xx, connection errors: worth retrying
    PERMANENT = "permanent"  # auth, not found, quota, invalid input: never retried
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class WorkerResult:
    worker: str
    ok: bool
    output: str = ""
    error: str = ""
    error_kind: ErrorKind | None = None
    changed_state: bool = False  # a state-changing tool ran: never retry this result
    usage: Usage = field(default_factory=Usage)
    handoff_to: str | None = None  # the worker asks to hand the task to another worker


class Worker(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def expertise(self) -> tuple[str, ...]: ...

    async def run(self, prompt: str, *, context: str = "") -> WorkerResult:
        """Answer ``prompt``; ``context`` is earlier output, already fenced as untrusted data."""
        ...
