"""The ``/swarm`` command grammar, shared by Telegram, Discord, Slack, the web console and ``kazma swarm``.

Parsing is pure: it needs only the configured worker names and pipeline presets,
so every surface that accepts a ``/swarm`` command refuses exactly the same
input with exactly the same words. Who may run a parsed command is decided
separately in :mod:`kazma.engine.swarm.roles`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import ClassVar, TypedDict

from kazma.config.limits import MAX_WORKERS
from kazma.config.registry import ROUTE_PLATFORMS, chat_id_problem
from kazma.engine.swarm.limits import LimitExceeded, check_prompt
from kazma.engine.swarm.types import Pattern

AUTO = "auto"

_TASK_ID = re.compile(r"[A-Za-z0-9_-]{4,32}")
# A near miss of a platform name after "->" is far more likely a typo in a route
# than task text, so it is refused with a suggestion instead of being dispatched.
_PLATFORM_TYPO_CUTOFF = 0.75


class Access(StrEnum):
    """What running a subcommand does, which decides who may run it."""

    READ = "read"  # looks at the swarm: anyone allowed in the chat
    STEER = "steer"  # starts, changes or steers work: an admin
    ADMIN = "admin"  # shows the swarm's configuration: an admin


class GrammarError(ValueError):
    """Input that is not a ``/swarm`` command.

    ``message`` is complete on its own and written for the person who typed the
    command; ``usage`` is the relevant usage line (or the whole help text) for
    surfaces that render it separately, e.g. in a code block.
    """

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage


@dataclass(frozen=True)
class Route:
    """Where the result goes instead of the chat the command came from."""

    platform: str
    chat: str

    def __str__(self) -> str:
        return f"{self.platform}:{self.chat}"


@dataclass(frozen=True, kw_only=True)
class SwarmCommand:
    """A parsed ``/swarm`` command; each subcommand is a subclass."""

    verb: ClassVar[str]
    access: ClassVar[Access]
    route: Route | None = None

    def to_json(self) -> dict[str, object]:
        """A JSON-ready mapping: ``verb``, the subcommand's fields, then ``route``."""
        data: dict[str, object] = {"verb": self.verb}
        for f in fields(self):
            if f.name == "route":
                continue
            value = getattr(self, f.name)
            data[f.name] = list(value) if isinstance(value, tuple) else value
        data["route"] = None if self.route is None else {"platform": self.route.platform, "chat": self.route.chat}
        return data


@dataclass(frozen=True, kw_only=True)
class StartCommand(SwarmCommand):
    """A command that starts new work with one of the swarm's patterns.

    Options come right before the task: ``--expect json|<schema>`` makes every worker
    answer match, ``--deadline <seconds>`` bounds the whole task.
    """

    pattern: ClassVar[Pattern]
    expect: str | None = None
    deadline: int | None = None


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
class DispatchCommand(StartCommand):
    verb: ClassVar[str] = "dispatch"
    access: ClassVar[Access] = Access.STEER
    pattern: ClassVar[Pattern] = Pattern.DISPATCH
    worker: str | None  # None: "auto", the engine picks the worker whose expertise fits
    prompt: str


@dataclass(frozen=True)
class BroadcastCommand(StartCommand):
    verb: ClassVar[str] = "broadcast"
    access: ClassVar[Access] = Access.STEER
    pattern: ClassVar[Pattern] = Pattern.BROADCAST
    prompt: str


@dataclass(frozen=True)
class PipelineCommand(StartCommand):
    verb: ClassVar[str] = "pipeline"
    access: ClassVar[Access] = Access.STEER
    pattern: ClassVar[Pattern] = Pattern.PIPELINE
    workers: tuple[str, ...]  # the stages in order, resolved from the preset when one was named
    prompt: str
    preset: str | None = None


@dataclass(frozen=True)
class FanOutCommand(StartCommand):
    verb: ClassVar[str] = "fanout"
    access: ClassVar[Access] = Access.STEER
    pattern: ClassVar[Pattern] = Pattern.FAN_OUT
    workers: tuple[str, ...]
    prompt: str
    strategy: str = "collect"


@dataclass(frozen=True)
class ConditionalCommand(StartCommand):
    verb: ClassVar[str] = "conditional"
    access: ClassVar[Access] = Access.STEER
    pattern: ClassVar[Pattern] = Pattern.CONDITIONAL
    router: str  # the worker whose answer names the branch
    routes: tuple[tuple[str, str], ...]  # (branch, worker)
    prompt: str


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
class ConsultCommand(StartCommand):
    verb: ClassVar[str] = "consult"
    access: ClassVar[Access] = Access.STEER
    pattern: ClassVar[Pattern] = Pattern.CONSULT
    workers: tuple[str, ...]
    question: str


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


AnySwarmCommand = (
    HelpCommand
    | StatusCommand
    | ListCommand
    | HistoryCommand
    | TasksCommand
    | WorkersCommand
    | DispatchCommand
    | BroadcastCommand
    | PipelineCommand
    | FanOutCommand
    | ConsultCommand
    | ConditionalCommand
    | BreakerResetCommand
    | MetricsCommand
    | CancelCommand
    | ApproveCommand
    | RejectCommand
    | RetryCommand
    | ConfigCommand
)


@dataclass(frozen=True)
class Usage:
    verb: str
    arguments: str  # after the verb, e.g. "<worker|auto> <task>"
    needs: str  # what the subcommand cannot do without, for error messages
    summary: str
    access: Access

    @property
    def line(self) -> str:
        return f"/swarm {self.verb} {self.arguments}".rstrip()


USAGES: Mapping[str, Usage] = {
    u.verb: u
    for u in (
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
        Usage(
            "dispatch",
            "<worker|auto> <task>",
            "a worker and a task",
            "hand a task to one worker (auto: the best fit)",
            Access.STEER,
        ),
        Usage("broadcast", "<task>", "a task", "give the same task to every worker", Access.STEER),
        Usage(
            "pipeline",
            "<preset|w1,w2,…> <task>",
            "a preset or workers, and a task",
            "pass a task through workers in turn",
            Access.STEER,
        ),
        Usage(
            "fanout",
            "<w1,w2,…> [--strategy collect|merge_all|vote|best|synthesize] <task>",
            "workers and a task",
            "run a task on several workers at once",
            Access.STEER,
        ),
        Usage(
            "conditional",
            "<router> <branch=worker,…> <task>",
            "a router worker, a route map and a task",
            "let the router's answer pick the branch that runs the task",
            Access.STEER,
        ),
        Usage(
            "consult",
            "<w1,w2,…> <question>",
            "workers and a question",
            "ask several workers and compare their answers",
            Access.STEER,
        ),
        Usage("cancel", "<task-id>", "a task id", "stop a running task", Access.STEER),
        Usage("approve", "<task-id>", "a task id", "continue a pipeline paused at a checkpoint", Access.STEER),
        Usage("reject", "<task-id>", "a task id", "stop a pipeline paused at a checkpoint", Access.STEER),
        Usage("retry", "<task-id>", "a task id", "run a failed or interrupted task again", Access.STEER),
        Usage("config", "", "nothing", "the swarm's settings", Access.ADMIN),
        Usage("breaker", "reset <worker>", "'reset' and a worker", "close a worker's circuit breaker", Access.ADMIN),
        Usage("metrics", "[days]", "at most a number of days", "per-worker numbers per day", Access.READ),
    )
}
VERBS: tuple[str, ...] = tuple(USAGES)

_ACCESS_LABEL = {
    Access.READ: "reading, anyone",
    Access.STEER: "steering, admin",
    Access.ADMIN: "admin",
}
ROUTE_USAGE = "/swarm <subcommand> … -> <platform>:<chat>"


def help_text() -> str:
    """One line per subcommand: usage, who may run it, what it does; then the routing suffix."""
    width = max(len(u.line) for u in USAGES.values())
    lines = [f"{u.line:<{width}}  ({_ACCESS_LABEL[u.access]}) {u.summary}" for u in USAGES.values()]
    lines.append(
        "Before the task, work commands take --expect json|<schema> (every answer must match) "
        "and --deadline <seconds> (the whole task)."
    )
    lines.append(
        f"End any command with -> <platform>:<chat> ({', '.join(ROUTE_PLATFORMS)}) "
        "to post the result in another chat (admin)."
    )
    return "\n".join(lines)


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
    head, rest = _first_word(body)
    verb = head.lower()
    usage = USAGES.get(verb)
    if usage is None:
        raise _unknown_subcommand(head)
    p = _Parser(usage, workers, pipelines)
    match verb:
        case "help":
            p.no_arguments(rest)
            return HelpCommand(route=route)
        case "status":
            return StatusCommand(p.optional_task_id(rest), route=route)
        case "list":
            p.no_arguments(rest)
            return ListCommand(route=route)
        case "history":
            p.no_arguments(rest)
            return HistoryCommand(route=route)
        case "workers":
            p.no_arguments(rest)
            return WorkersCommand(route=route)
        case "tasks":
            if not rest:
                return TasksCommand(route=route)
            option, worker = _first_word(rest)
            if option.lower() != "--worker" or not worker or len(worker.split()) != 1:
                raise p.fail("tasks takes --worker <worker> or nothing")
            p._check_worker(worker.lower())
            return TasksCommand(worker.lower(), route=route)
        case "config":
            p.no_arguments(rest)
            return ConfigCommand(route=route)
        case "breaker":
            action, worker = _first_word(rest) if rest else ("", "")
            if action.lower() != "reset" or not worker or len(worker.split()) != 1:
                raise p.missing()
            p._check_worker(worker.lower())
            return BreakerResetCommand(worker.lower(), route=route)
        case "metrics":
            if not rest:
                return MetricsCommand(route=route)
            if not rest.isdigit() or not 1 <= int(rest) <= 366:
                raise p.fail("metrics takes a number of days from 1 to 366")
            return MetricsCommand(int(rest), route=route)
    opts, rest = p.options(rest)
    match verb:
        case "dispatch":
            token, prompt = p.word_and_prompt(rest)
            opts, prompt = p.options(prompt, opts)
            return DispatchCommand(p.dispatch_worker(token), p.prompt(prompt), route=route, **p.start(opts))
        case "broadcast":
            return BroadcastCommand(p.prompt(rest), route=route, **p.start(opts))
        case "pipeline":
            token, prompt = p.word_and_prompt(rest)
            opts, prompt = p.options(prompt, opts)
            preset, stages = p.pipeline_stages(token)
            return PipelineCommand(stages, p.prompt(prompt), preset=preset, route=route, **p.start(opts))
        case "fanout":
            token, prompt = p.word_and_prompt(rest)
            opts, prompt = p.options(prompt, opts)
            strategy = p.strategy(opts.pop("strategy", "collect"))
            return FanOutCommand(p.worker_list(token), p.prompt(prompt), strategy, route=route, **p.start(opts))
        case "conditional":
            router, after = p.word_and_prompt(rest)
            routes_token, prompt = p.word_and_prompt(after)
            opts, prompt = p.options(prompt, opts)
            p._check_worker(router.lower())
            routes = p.route_map(routes_token)
            return ConditionalCommand(router.lower(), routes, p.prompt(prompt), route=route, **p.start(opts))
        case "consult":
            token, prompt = p.word_and_prompt(rest)
            opts, prompt = p.options(prompt, opts)
            return ConsultCommand(p.worker_list(token), p.prompt(prompt), route=route, **p.start(opts))
        case "cancel":
            return CancelCommand(p.task_id(rest), route=route)
        case "approve":
            return ApproveCommand(p.task_id(rest), route=route)
        case "reject":
            return RejectCommand(p.task_id(rest), route=route)
        case "retry":
            return RetryCommand(p.task_id(rest), route=route)
    raise AssertionError(f"USAGES names {verb!r} but parse does not handle it")  # pragma: no cover


def _first_word(text: str) -> tuple[str, str]:
    parts = text.split(None, 1)
    return parts[0], (parts[1] if len(parts) == 2 else "")


def _split_route(text: str) -> tuple[str, Route | None]:
    """Take a final ``-> platform:chat`` token pair off ``text``; anything earlier is task text."""
    parts = text.rsplit(None, 2)
    if len(parts) < 2 or parts[-2] != "->":
        return text, None
    platform, colon, chat = parts[-1].partition(":")
    if not colon:
        return text, None
    platform = platform.lower()
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
            f"cannot route to {_shown(f'{platform}:{chat}', 60)}: {problem}; routes look like {ROUTE_USAGE}",
            ROUTE_USAGE,
        )
    return chat


def _unknown_subcommand(word: str) -> GrammarError:
    near = difflib.get_close_matches(word.lower(), VERBS, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return GrammarError(f"unknown subcommand {_shown(word)}{hint}\n{help_text()}", help_text())


def _shown(value: str, limit: int = 40) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "…")


class _StartOptions(TypedDict):
    expect: str | None
    deadline: int | None


class _Parser:
    """Argument checks for one subcommand, so every error names its usage."""

    def __init__(self, usage: Usage, workers: Collection[str], pipelines: Mapping[str, Sequence[str]]) -> None:
        self.usage = usage
        self.workers = workers
        self.pipelines = pipelines

    def fail(self, message: str) -> GrammarError:
        return GrammarError(f"{message}: {self.usage.line}", self.usage.line)

    def missing(self) -> GrammarError:
        return self.fail(f"{self.usage.verb} needs {self.usage.needs}")

    def no_arguments(self, rest: str) -> None:
        if rest:
            raise self.fail(f"{self.usage.verb} takes no arguments")

    def task_id(self, rest: str) -> str:
        if not rest:
            raise self.missing()
        token, extra = _first_word(rest)
        if extra:
            raise self.fail(f"{self.usage.verb} takes one task id")
        return self._check_task_id(token)

    def optional_task_id(self, rest: str) -> str | None:
        if not rest:
            return None
        token, extra = _first_word(rest)
        if extra:
            raise self.fail(f"{self.usage.verb} takes at most one task id")
        return self._check_task_id(token)

    def _check_task_id(self, token: str) -> str:
        if not _TASK_ID.fullmatch(token):
            raise self.fail(f"{_shown(token)} is not a task id (4 to 32 letters, digits, '-' or '_')")
        return token

    _OPTIONS = ("expect", "deadline", "strategy")
    _STRATEGIES = ("collect", "merge_all", "vote", "best", "synthesize")

    def options(self, text: str, found: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
        """Take leading ``--name value`` pairs off ``text``; the rest is the task."""
        opts = dict(found or {})
        while text.startswith("--"):
            name, rest = _first_word(text)
            value, text = _first_word(rest) if rest else ("", "")
            key = name[2:].lower()
            if key not in self._OPTIONS or (key == "strategy" and self.usage.verb != "fanout"):
                raise self.fail(f"unknown option {_shown(name)}")
            if not value:
                raise self.fail(f"{name} needs a value")
            if key in opts:
                raise self.fail(f"{name} is given twice")
            opts[key] = value
        return opts, text

    def start(self, opts: dict[str, str]) -> _StartOptions:
        deadline = opts.get("deadline")
        if deadline is not None and (not deadline.isdigit() or not 1 <= int(deadline) <= 86400):
            raise self.fail("--deadline takes whole seconds from 1 to 86400")
        expect = opts.get("expect")
        if expect is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", expect):
            raise self.fail("--expect takes json or a schema name from swarm.schemas")
        return {"expect": expect, "deadline": None if deadline is None else int(deadline)}

    def strategy(self, value: str) -> str:
        if value.lower() not in self._STRATEGIES:
            raise self.fail(f"unknown strategy {_shown(value)} (strategies: {', '.join(self._STRATEGIES)})")
        return value.lower()

    def route_map(self, token: str) -> tuple[tuple[str, str], ...]:
        pairs: list[tuple[str, str]] = []
        for item in token.split(","):
            branch, eq, worker = item.partition("=")
            if not eq or not re.fullmatch(r"[a-z0-9_-]{1,32}", branch.lower()):
                raise self.fail(f"the route map {_shown(token)} needs branch=worker pairs separated by commas")
            self._check_worker(worker.lower())
            if any(b == branch.lower() for b, _ in pairs):
                raise self.fail(f"branch {branch.lower()!r} is listed twice")
            pairs.append((branch.lower(), worker.lower()))
        if len(pairs) > MAX_WORKERS:
            raise self.fail(f"at most {MAX_WORKERS} branches")
        return tuple(pairs)

    def word_and_prompt(self, rest: str) -> tuple[str, str]:
        token, prompt = _first_word(rest) if rest else ("", "")
        if not prompt:
            raise self.missing()
        return token, self.prompt(prompt)

    def prompt(self, text: str) -> str:
        if not text:
            raise self.missing()
        try:
            check_prompt(text, word=self._prompt_word())
        except LimitExceeded as exc:
            raise self.fail(str(exc)) from None
        return text

    def _prompt_word(self) -> str:
        return "question" if self.usage.verb == "consult" else "task"

    def dispatch_worker(self, token: str) -> str | None:
        name = token.lower()
        if name == AUTO:
            return None
        self._check_worker(name)
        return name

    def pipeline_stages(self, token: str) -> tuple[str | None, tuple[str, ...]]:
        if token in self.pipelines:
            stages = tuple(self.pipelines[token])
            for stage in stages:
                if stage not in self.workers:
                    raise self.fail(f"pipeline preset {token!r} names unknown worker {stage!r}")
            return token, stages
        if "," in token or token.lower() in self.workers:
            return None, self.worker_list(token)
        if token.lower() == AUTO:
            raise self._auto_refused()
        candidates = [*self.pipelines, *self.workers]
        near = difflib.get_close_matches(token.lower(), candidates, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        presets = ", ".join(sorted(self.pipelines)) or "none configured"
        raise self.fail(
            f"unknown pipeline preset or worker {_shown(token)}{hint} (presets: {presets}; workers: {self._known()})"
        )

    def worker_list(self, token: str) -> tuple[str, ...]:
        names = token.split(",")
        if len(names) > MAX_WORKERS:
            raise self.fail(f"{len(names)} workers listed; at most {MAX_WORKERS} may take part in one task")
        if any(not name for name in names):
            raise self.fail(
                f"the worker list {_shown(token)} has an empty name; "
                "separate worker names with commas and no spaces, e.g. researcher,builder"
            )
        lowered = [name.lower() for name in names]
        seen: set[str] = set()
        for name in lowered:
            if name == AUTO:
                raise self._auto_refused()
            self._check_worker(name)
            if name in seen:
                raise self.fail(f"worker {name!r} is listed twice")
            seen.add(name)
        return tuple(lowered)

    def _check_worker(self, name: str) -> None:
        if name in self.workers:
            return
        near = difflib.get_close_matches(name, list(self.workers), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise self.fail(f"unknown worker {_shown(name)}{hint} (workers: {self._known()})")

    def _auto_refused(self) -> GrammarError:
        return self.fail(
            f"'auto' picks a single worker and only works with dispatch; name the {self.usage.verb} workers"
        )

    def _known(self) -> str:
        return ", ".join(sorted(self.workers)) or "none configured"
