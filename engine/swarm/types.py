"""Shapes shared by the swarm engine, its task store, its reliability layer and the /swarm commands."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from kazma.engine.fence import NOTHING, Fenced
from kazma.engine.types import ToolUse, Usage

T = TypeVar("T")


class Pattern(StrEnum):
    """The names of the built-in patterns (:mod:`kazma.engine.swarm.builtin_patterns`); a registered pattern
    may bring another name, so requests and records hold the name as a string."""

    DISPATCH = "dispatch"
    BROADCAST = "broadcast"
    PIPELINE = "pipeline"
    FAN_OUT = "fan_out"
    CONSULT = "consult"
    CONDITIONAL = "conditional"


class SwarmRefused(ValueError):
    """The request is out of bounds or names what does not exist; nothing ran."""


@dataclass(frozen=True)
class SwarmRequest:
    pattern: str  # a registered pattern's name (kazma.engine.swarm.registry)
    workers: tuple[str, ...]  # ("auto",) lets dispatch route by expertise
    prompt: str
    owner: str
    route: str | None = None
    aggregation: str = "collect"
    preset: str | None = None
    conversation: str = "swarm"
    routes: tuple[tuple[str, str], ...] = ()  # conditional: (branch, worker); workers[0] is the router
    expect: str | None = None  # "json" or a schema name from swarm.schemas: every worker answer must match
    deadline_seconds: int | None = None  # None: swarm.task_deadline_seconds
    context: str = ""  # material every worker gets with the task, fenced as data (the lead's, or a file's)
    # Who asked for the work (the /swarm command's sender, or the person whose message started the lead's turn
    # that dispatched it): its workers' dangerous calls are theirs, so a forbid_requester policy bars them.
    started_by: str | None = None
    # The task this one runs again (the first of its line, for a retry of a retry): its workers work in that task's
    # conversation (see task_conversation), with its workspace, and a call of it that may have run is said so on
    # the card again. None: a task of its own.
    lineage: str | None = None

    def metadata(self) -> dict[str, Any]:
        """Everything but the prompt and the context: what the metadata limit bounds."""
        return {
            "workers": list(self.workers),
            "aggregation": self.aggregation,
            "preset": self.preset,
            "conversation": self.conversation,
            "routes": [list(pair) for pair in self.routes],
            "expect": self.expect,
            "deadline_seconds": self.deadline_seconds,
            "started_by": self.started_by,
            "lineage": self.lineage,
        }

    def as_json(self) -> dict[str, Any]:
        return {**self.metadata(), "prompt": self.prompt, "context": self.context}


class TaskStatus(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"  # a pipeline checkpoint waits for approval
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"  # some workers of a fan-out failed
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"  # the task's deadline passed; whatever finished before it is kept
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
    model: str = ""  # the model that answered, as its server named it ("" for workers that are not models)
    tools: tuple[ToolUse, ...] = ()  # the tools the worker's turn called, with the approvals they ran under
    handoff_to: str | None = None  # the worker asks to hand the task to another worker
    handoff_reason: str = ""
    handoff_task: str = ""  # the task as the worker restates it for the target (optional)
    handoff_context: str = ""  # what the worker passes on; the target sees it fenced as data


@dataclass(frozen=True)
class HandoffRecord:
    """One accepted handoff of a chain, as the task record and the dashboard show it."""

    source: str
    target: str
    reason: str
    context: str = ""
    task: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "from": self.source,
            "to": self.target,
            "reason": self.reason,
            "context": self.context,
            "task": self.task,
        }


@dataclass(frozen=True)
class HandoffOffer:
    """What a swarm-run worker may hand to: its ``targets`` and the chain's guard (None: allowed, else why not)."""

    source: str
    targets: tuple[str, ...]
    refusal: Callable[[str], str | None]


# The offer travels beside the call rather than through it: the retry, breaker and timeout layers between a
# pattern and a worker stay unchanged, and workers that cannot hand off (scripted ones) simply never look.
_OFFER: ContextVar[HandoffOffer | None] = ContextVar("kazma_swarm_handoff_offer", default=None)


@contextmanager
def _holding(var: ContextVar[T], value: T) -> Iterator[None]:
    """``var`` set to ``value`` for the calls made inside (and the tasks they start), as it was after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def offering(offer: HandoffOffer | None) -> AbstractContextManager[None]:
    return _holding(_OFFER, offer)


def current_offer() -> HandoffOffer | None:
    """The handoff offer of the swarm call running now; None outside a swarm chain (and for the lead)."""
    return _OFFER.get()


# Which step of its task a worker call is ("stage 2", "branch docs", "handoff from a"), for the call's record.
_STEP: ContextVar[str] = ContextVar("kazma_swarm_step", default="")


def step_named(label: str) -> AbstractContextManager[None]:
    return _holding(_STEP, label)


def current_step() -> str:
    return _STEP.get()


# Who the task a worker call serves was asked for by, beside the call like the offer (every layer between a
# pattern and a worker stays as it is).
_STARTER: ContextVar[str | None] = ContextVar("kazma_swarm_started_by", default=None)


# The task a worker call serves: its worker's history and workspace are that task's (see task_conversation).
_TASK: ContextVar[str | None] = ContextVar("kazma_swarm_task", default=None)


@contextmanager
def working_for(started_by: str | None, task_id: str | None = None) -> Iterator[None]:
    with _holding(_STARTER, started_by), _holding(_TASK, task_id):
        yield


def current_starter() -> str | None:
    """Who asked for the swarm task running now (None: nobody known, or outside a task)."""
    return _STARTER.get()


def task_conversation(base: str) -> str:
    """The conversation a worker's call runs in: ``base`` ("swarm") and the task running now (the first of its line
    for a retry), so each task's workers have a history and a workspace of their own. Every task's workers shared
    "swarm": a task read the earlier tasks' prompts and answers (any chat's, anyone's) as its own history, and
    their files. No ``:``, so it is never taken for a chat (nothing is remembered or told there, as with
    "swarm")."""
    task_id = _TASK.get()
    return base if task_id is None else f"{base}-{task_id}"


class Worker(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def expertise(self) -> tuple[str, ...]: ...

    async def run(self, prompt: str, *, context: Fenced = NOTHING) -> WorkerResult:
        """Answer ``prompt``; ``context`` is earlier output, fenced as untrusted data (only the fence makes one)."""
        ...
