"""The swarm's patterns, each one registered object: its command and arguments, its help line, how it runs.

The grammar, the swarm service, the ``/swarm`` commands, the lead's ``dispatch_swarm`` tool and
``kazma swarm`` look a pattern up here by its verb or its name and never name one themselves, so a new
pattern is its orchestration (usually a function in :mod:`~kazma.engine.swarm.patterns`) and one
:class:`SwarmPattern` registered beside the built-in ones (:mod:`~kazma.engine.swarm.builtin_patterns`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kazma.engine.swarm.patterns import Call, Checkpoint, Chooser, Journal, SwarmOutcome, Synthesizer
from kazma.engine.swarm.syntax import Access, Arguments, StartCommand, Usage
from kazma.engine.swarm.types import SwarmRequest, Worker, WorkerResult


@dataclass(frozen=True)
class Stages:
    """What the service offers a pattern that runs stages in turn and may pause between them (``pipeline``).

    ``done``: the stages journaled before (a run resumed after a checkpoint or a restart continues after them);
    ``call``: the task's call that also marks and reports which stage runs; ``journal``: keeps a finished
    stage (a deadline keeps what was journaled); ``checkpoint``: False pauses the task after that stage;
    ``refine``: distils a finished run's stages into one report (when a refiner is configured).
    """

    done: Sequence[WorkerResult]
    call: Call
    journal: Journal
    checkpoint: Checkpoint
    refine: Callable[[SwarmOutcome], Awaitable[None]]


@dataclass(frozen=True)
class PatternRun:
    """Everything a pattern's run gets from the service for one admitted task."""

    request: SwarmRequest
    workers: Sequence[Worker]  # the workers the request resolved to, in order
    call: Call  # reliable, checked against --expect, and kept in the task's record
    plain_call: Call  # reliable only: for an answer that is not the task's output (a router's branch name)
    by_name: Mapping[str, Worker]  # every configured worker: whom a worker may hand its task to
    concurrency: int  # worker calls of this task at once
    synthesizer: Synthesizer | None
    chooser: Chooser | None
    mark: Callable[[str], Awaitable[None]]  # records where the run is (its current step)
    stages: Stages


Parse = Callable[[Arguments, str, dict[str, str]], StartCommand]
Run = Callable[[PatternRun], Awaitable[SwarmOutcome]]
# (request, the worker names it resolved to so far, every configured worker) -> the worker names it runs
Resolve = Callable[[SwarmRequest, list[str], Sequence[str]], list[str]]


@dataclass(frozen=True)
class SwarmPattern:
    """One pattern. ``command`` is its parsed ``/swarm`` command (its verb, its name, what it puts in a request).

    ``arguments``, ``needs`` and ``summary`` make its usage and help line; ``parse`` reads its arguments (the
    text after any leading ``--options``, and the options read so far); ``run`` runs an admitted task;
    ``resolve`` turns the request's worker list into the workers it runs (refusing with ``SwarmRefused``);
    ``options`` are the ``--options`` it takes beside ``--expect`` and ``--deadline``; ``prompt_word`` is what
    its task is called in refusals; ``auto``: ``workers=auto`` picks one worker by expertise; ``staged``: its
    stages are journaled, so a deadline keeps the journal.
    """

    command: type[StartCommand]
    arguments: str
    needs: str
    summary: str
    parse: Parse
    run: Run
    resolve: Resolve | None = None
    options: tuple[str, ...] = ()
    prompt_word: str = "task"
    auto: bool = False
    staged: bool = False
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        usage = Usage(self.command.verb, self.arguments, self.needs, self.summary, self.command.access)
        object.__setattr__(self, "usage", usage)

    @property
    def name(self) -> str:
        return self.command.pattern

    @property
    def verb(self) -> str:
        return self.command.verb


class PatternClash(ValueError):
    """A pattern whose name or verb another registered pattern has already."""


_PATTERNS: dict[str, SwarmPattern] = {}  # by name, in the order they were registered (the help's order)


def register(pattern: SwarmPattern) -> SwarmPattern:
    """Make ``pattern`` known to every surface; a name or verb already taken is refused."""
    if pattern.command.access is not Access.STEER:
        raise PatternClash(f"{pattern.verb}: a pattern starts work, so its command is a steering one")
    for known in _PATTERNS.values():
        if pattern.name == known.name or pattern.verb == known.verb:
            raise PatternClash(f"{pattern.verb} ({pattern.name}): {known.verb} ({known.name}) is registered already")
    _PATTERNS[pattern.name] = pattern
    return pattern


def unregister(name: str) -> None:
    """Forget the pattern ``name`` (a test's own pattern, once the test is over)."""
    _PATTERNS.pop(name, None)


def registered() -> tuple[SwarmPattern, ...]:
    return tuple(_PATTERNS.values())


def named(name: str) -> SwarmPattern | None:
    """The pattern a request or a record names."""
    return _PATTERNS.get(name)


def for_verb(verb: str) -> SwarmPattern | None:
    """The pattern a ``/swarm`` verb starts."""
    return next((p for p in _PATTERNS.values() if p.verb == verb), None)
