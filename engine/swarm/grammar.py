"""The ``/swarm`` command grammar, shared by Telegram, Discord, Slack, the web console and ``kazma swarm``.

Parsing is pure: it needs only the configured worker names and pipeline presets,
so every surface that accepts a ``/swarm`` command refuses exactly the same
input with exactly the same words. Who may run a parsed command is decided
separately in :mod:`kazma.engine.swarm.roles`. The subcommands that start work
are the registered patterns' (:mod:`kazma.engine.swarm.registry`): the grammar
reads each with the pattern's own argument reading and names none of them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kazma.adapters.chat_text import Columns
from kazma.config.address import Address, AddressError
from kazma.config.registry import ROUTE_PLATFORMS, chat_id_problem
from kazma.engine.swarm import builtin_patterns
from kazma.engine.swarm.registry import for_verb, registered
from kazma.engine.swarm.syntax import (
    Access,
    Arguments,
    GrammarError,
    Route,
    SwarmCommand,
    Usage,
    first_word,
    shown,
    small_count,
)

# A near miss of a platform name after "->" is far more likely a typo in a route
# than task text, so it is refused with a suggestion instead of being dispatched.
_PLATFORM_TYPO_CUTOFF = 0.75
BUILTIN_PATTERNS = builtin_patterns.PATTERNS  # registered on import: every surface that parses knows them


@dataclass(frozen=True)
class HelpCommand(SwarmCommand):
    verb: ClassVar[str] = "help"
    access: ClassVar[Access] = Access.READ


@dataclass(frozen=True)
class StatusCommand(SwarmCommand):
    verb: ClassVar[str] = "status"
    access: ClassVar[Access] = Access.READ
    task_id: str | None = None  # None: an overview of the swarm


@dataclass(frozen=True)
class ListCommand(SwarmCommand):
    verb: ClassVar[str] = "list"
    access: ClassVar[Access] = Access.READ


@dataclass(frozen=True)
class HistoryCommand(SwarmCommand):
    verb: ClassVar[str] = "history"
    access: ClassVar[Access] = Access.READ


@dataclass(frozen=True)
class TasksCommand(SwarmCommand):
    """Tasks newest first, or only those a worker was named in or ran (``--worker``)."""

    verb: ClassVar[str] = "tasks"
    access: ClassVar[Access] = Access.READ
    worker: str | None = None


@dataclass(frozen=True)
class WorkersCommand(SwarmCommand):
    verb: ClassVar[str] = "workers"
    access: ClassVar[Access] = Access.READ


@dataclass(frozen=True)
class BreakerResetCommand(SwarmCommand):
    verb: ClassVar[str] = "breaker"
    access: ClassVar[Access] = Access.ADMIN
    worker: str


@dataclass(frozen=True)
class MetricsCommand(SwarmCommand):
    verb: ClassVar[str] = "metrics"
    access: ClassVar[Access] = Access.READ
    days: int = 7


@dataclass(frozen=True)
class CancelCommand(SwarmCommand):
    verb: ClassVar[str] = "cancel"
    access: ClassVar[Access] = Access.STEER
    task_id: str


@dataclass(frozen=True)
class ApproveCommand(SwarmCommand):
    """Resume a pipeline paused at a checkpoint."""

    verb: ClassVar[str] = "approve"
    access: ClassVar[Access] = Access.STEER
    task_id: str


@dataclass(frozen=True)
class RejectCommand(SwarmCommand):
    """Stop a pipeline paused at a checkpoint."""

    verb: ClassVar[str] = "reject"
    access: ClassVar[Access] = Access.STEER
    task_id: str


@dataclass(frozen=True)
class RetryCommand(SwarmCommand):
    verb: ClassVar[str] = "retry"
    access: ClassVar[Access] = Access.STEER
    task_id: str


@dataclass(frozen=True)
class ConfigCommand(SwarmCommand):
    verb: ClassVar[str] = "config"
    access: ClassVar[Access] = Access.ADMIN


_READING = (
    Usage("help", "", "nothing", "the subcommands and who may run them", Access.READ),
    Usage("status", "[task-id]", "at most one task id", "the swarm at a glance, or one task", Access.READ),
    Usage("list", "", "nothing", "running and paused tasks", Access.READ),
    Usage("history", "", "nothing", "recently finished tasks", Access.READ),
    Usage(
        "tasks",
        "[--worker <worker>]",
        "at most --worker and a worker",
        "tasks newest first, or those a worker was named in or ran",
        Access.READ,
    ),
    Usage("workers", "", "nothing", "the workers and what they are good at", Access.READ),
)
_STEERING = (
    Usage("cancel", "<task-id>", "a task id", "stop a running task", Access.STEER),
    Usage("approve", "<task-id>", "a task id", "continue a pipeline paused at a checkpoint", Access.STEER),
    Usage("reject", "<task-id>", "a task id", "stop a pipeline paused at a checkpoint", Access.STEER),
    Usage("retry", "<task-id>", "a task id", "run a failed or interrupted task again", Access.STEER),
    Usage("config", "", "nothing", "the swarm's settings", Access.ADMIN),
    Usage("breaker", "reset <worker>", "'reset' and a worker", "close a worker's circuit breaker", Access.ADMIN),
    Usage("metrics", "[days]", "at most a number of days", "per-worker numbers per day", Access.READ),
)


class _Usages(Mapping[str, Usage]):
    """Every subcommand's usage in help order: reading, then the registered patterns, then steering the rest."""

    def _all(self) -> dict[str, Usage]:
        # the grammar's own verbs cannot be taken by a pattern
        starting = [p.usage for p in registered() if p.verb not in _OWN_VERBS]
        return {usage.verb: usage for usage in (*_READING, *starting, *_STEERING)}

    def __getitem__(self, verb: str) -> Usage:
        return self._all()[verb]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


_OWN_VERBS = frozenset(u.verb for u in (*_READING, *_STEERING))
USAGES: Mapping[str, Usage] = _Usages()
VERBS: tuple[str, ...] = tuple(USAGES)  # the subcommands as built: the grammar's and the built-in patterns'

_ACCESS_LABEL = {
    Access.READ: "reading, anyone",
    Access.STEER: "steering, admin",
    Access.ADMIN: "admin",
}
ROUTE_USAGE = "/swarm <subcommand> … -> <platform>:<chat>"


def help_text() -> Columns:
    """One line per subcommand: usage, who may run it, what it does; then the routing suffix. Its columns are
    lined up with spaces, so every platform shows it in a fixed-width font (:class:`Columns`)."""
    usages = list(USAGES.values())
    width = max(len(u.line) for u in usages)
    lines = [f"{u.line:<{width}}  ({_ACCESS_LABEL[u.access]}) {u.summary}" for u in usages]
    lines.append(
        "Before the task, work commands take --expect json|<schema> (every answer must match) "
        "and --deadline <seconds> (the whole task)."
    )
    lines.append(
        f"End any command with -> <platform>:<chat> ({', '.join(ROUTE_PLATFORMS)}) "
        "to post the result in another chat (admin)."
    )
    return Columns("\n".join(lines))


def parse(text: str, *, workers: Collection[str], pipelines: Mapping[str, Sequence[str]]) -> SwarmCommand:
    """Parse the text after ``/swarm`` (or the words after ``kazma swarm``).

    Empty text is ``help``. Raises :class:`GrammarError` for anything else that
    is not a well-formed command.
    """
    body, route = _split_route(text.strip())
    if not body:
        if route is not None:
            raise GrammarError(f"a route needs a command before it: {ROUTE_USAGE}", ROUTE_USAGE)
        return HelpCommand()
    head, rest = first_word(body)
    verb = head.lower()
    usage = USAGES.get(verb)
    if usage is None:
        raise _unknown_subcommand(head)
    pattern = None if verb in _OWN_VERBS else for_verb(verb)
    if pattern is None:
        return dataclasses.replace(_own(verb, Arguments(usage, workers, pipelines), rest), route=route)
    p = Arguments(usage, workers, pipelines, options=pattern.options, prompt_word=pattern.prompt_word)
    opts, rest = p.options(rest)
    return dataclasses.replace(pattern.parse(p, rest, opts), route=route)


def _own(verb: str, p: Arguments, rest: str) -> SwarmCommand:
    """The grammar's own subcommands: reading the swarm and steering its tasks."""
    match verb:
        case "help":
            p.no_arguments(rest)
            return HelpCommand()
        case "status":
            return StatusCommand(p.optional_task_id(rest))
        case "list":
            p.no_arguments(rest)
            return ListCommand()
        case "history":
            p.no_arguments(rest)
            return HistoryCommand()
        case "workers":
            p.no_arguments(rest)
            return WorkersCommand()
        case "tasks":
            if not rest:
                return TasksCommand()
            option, worker = first_word(rest)
            if option.lower() != "--worker" or not worker or len(worker.split()) != 1:
                raise p.fail("tasks takes --worker <worker> or nothing")
            p.check_worker(worker.lower())
            return TasksCommand(worker.lower())
        case "config":
            p.no_arguments(rest)
            return ConfigCommand()
        case "breaker":
            action, worker = first_word(rest) if rest else ("", "")
            if action.lower() != "reset" or not worker or len(worker.split()) != 1:
                raise p.missing()
            p.check_worker(worker.lower())
            return BreakerResetCommand(worker.lower())
        case "metrics":
            if not rest:
                return MetricsCommand()
            days = small_count(rest)
            if days is None or not 1 <= days <= 366:
                raise p.fail("metrics takes a number of days from 1 to 366")
            return MetricsCommand(days)
    given, rest = p.options(rest)
    if given:  # read, and then dropped, they would have done nothing the person could see
        raise p.fail(f"{verb} takes a task id only: {', '.join('--' + name for name in given)} would change nothing")
    match verb:
        case "cancel":
            return CancelCommand(p.task_id(rest))
        case "approve":
            return ApproveCommand(p.task_id(rest))
        case "reject":
            return RejectCommand(p.task_id(rest))
        case "retry":
            return RetryCommand(p.task_id(rest))
    raise AssertionError(f"USAGES names {verb!r} but parse does not handle it")  # pragma: no cover


def _split_route(text: str) -> tuple[str, Route | None]:
    """Take a final ``-> platform:chat`` token pair off ``text``; anything earlier is task text."""
    parts = text.rsplit(None, 2)
    if parts and parts[-1] == "->":
        # a route begun and never finished: taken as task text, the result came back here, not where it was meant
        raise GrammarError(
            f"a route needs <platform>:<chat> after '->' ({', '.join(ROUTE_PLATFORMS)}): {ROUTE_USAGE}", ROUTE_USAGE
        )
    if len(parts) < 2 or parts[-2] != "->":
        return text, None
    try:
        written = Address.parse(parts[-1])
    except AddressError:
        return text, None
    platform, chat = written.platform.lower(), written.chat
    if platform not in ROUTE_PLATFORMS:
        near = difflib.get_close_matches(platform, ROUTE_PLATFORMS, n=1, cutoff=_PLATFORM_TYPO_CUTOFF)
        if not near:
            return text, None
        raise GrammarError(
            f"unknown platform {platform!r} in the route; did you mean {near[0]!r}? "
            f"Routes look like {ROUTE_USAGE} with platform one of {', '.join(ROUTE_PLATFORMS)}",
            ROUTE_USAGE,
        )
    route = Route(platform, _route_chat(platform, chat))
    body = parts[0] if len(parts) == 3 else ""
    return body, route


def _route_chat(platform: str, chat: str) -> str:
    problem = chat_id_problem(platform, chat)
    if problem is not None:
        raise GrammarError(
            f"cannot route to {shown(Address(platform, chat).conversation, 60)}: {problem}; routes look like "
            f"{ROUTE_USAGE}",
            ROUTE_USAGE,
        )
    return chat


def _unknown_subcommand(word: str) -> GrammarError:
    near = difflib.get_close_matches(word.lower(), list(USAGES), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return GrammarError(f"unknown subcommand {shown(word)}{hint}\n{help_text()}", help_text())
