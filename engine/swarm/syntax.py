"""The pieces every ``/swarm`` subcommand is made of: who may run it, its usage line, its parsed command, and the
argument checks that make every refusal name the usage.

:mod:`kazma.engine.swarm.grammar` puts them together into the grammar; a swarm pattern
(:mod:`kazma.engine.swarm.registry`) brings its own start command and its own argument reading, made of
these pieces, so the grammar names no pattern.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import ClassVar, Final, TypedDict

from kazma.config.address import Address
from kazma.config.limits import MAX_WORKERS
from kazma.engine.swarm.limits import LimitExceeded, check_prompt

# The fan-out aggregation strategies every surface accepts (chat, console, `kazma swarm`, the lead's
# dispatch_swarm): one list, so that one surface cannot refuse what another runs (patterns.Aggregation).
STRATEGIES: Final = ("collect", "first_valid", "merge_all", "vote", "best", "synthesize")

AUTO = "auto"

_TASK_ID = re.compile(r"[A-Za-z0-9_-]{4,32}")
# ASCII digits only, and few of them: str.isdigit() also takes "²" and "٣", which int() refuses or reads as
# another number, and int() refuses a string of more than 4,300 digits; either escaped as a crash, not a refusal.
_COUNT = re.compile(r"0*[0-9]{1,6}")
# A conditional's branch, written lowercase: what a router's answer is read for (patterns.routed), on every surface.
BRANCH = re.compile(r"[a-z0-9_-]{1,32}")


def preset_named(written: str, pipelines: Collection[str]) -> str | None:
    """The configured pipeline preset ``written`` names, in any case (as a worker's name is), else None.

    The configuration refuses two presets that differ only in case, so at most one matches."""
    if written in pipelines:
        return written
    return next((name for name in pipelines if name.lower() == written.lower()), None)


def small_count(text: str) -> int | None:
    """``text`` as a whole number written in ASCII digits with at most six significant ones, else None."""
    return int(text) if _COUNT.fullmatch(text) else None


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


# Where the result goes instead of the chat the command came from.
Route = Address


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
    """A command that starts new work with one of the swarm's patterns (see :mod:`kazma.engine.swarm.registry`).

    Options come right before the task: ``--expect json|<schema>`` makes every worker
    answer match, ``--deadline <seconds>`` bounds the whole task.
    """

    pattern: ClassVar[str]  # the pattern's name, as a task's record and the lead's dispatch_swarm name it
    access: ClassVar[Access] = Access.STEER
    expect: str | None = None
    deadline: int | None = None

    def request_fields(self) -> RequestFields:
        """What this command puts in the task's request beside what every start shares (owner, route, options)."""
        raise NotImplementedError(f"{type(self).__name__} says nothing of its request")


class RequestFields(TypedDict, total=False):
    """The request fields a start command fills (:class:`~kazma.engine.swarm.types.SwarmRequest`)."""

    workers: tuple[str, ...]
    prompt: str
    aggregation: str
    preset: str | None
    routes: tuple[tuple[str, str], ...]


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


def first_word(text: str) -> tuple[str, str]:
    """The first word of ``text`` and the rest (stripped of the space between)."""
    parts = text.split(None, 1)
    return parts[0], (parts[1] if len(parts) == 2 else "")


def shown(value: str, limit: int = 40) -> str:
    """``value`` quoted for an error message, cut at ``limit`` characters."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


class StartOptions(TypedDict):
    expect: str | None
    deadline: int | None


class Arguments:
    """Argument checks for one subcommand, so every error names its usage.

    ``options``: the ``--options`` the subcommand takes beside ``--expect`` and ``--deadline``;
    ``prompt_word``: what its task is called in a refusal (``task``, ``question``).
    """

    def __init__(
        self,
        usage: Usage,
        workers: Collection[str],
        pipelines: Mapping[str, Sequence[str]],
        *,
        options: Sequence[str] = (),
        prompt_word: str = "task",
    ) -> None:
        self.usage = usage
        self.workers = workers
        self.pipelines = pipelines
        self.allowed = ("expect", "deadline", *options)
        self.prompt_word = prompt_word

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
        token, extra = first_word(rest)
        if extra:
            raise self.fail(f"{self.usage.verb} takes one task id")
        return self._check_task_id(token)

    def optional_task_id(self, rest: str) -> str | None:
        if not rest:
            return None
        token, extra = first_word(rest)
        if extra:
            raise self.fail(f"{self.usage.verb} takes at most one task id")
        return self._check_task_id(token)

    def _check_task_id(self, token: str) -> str:
        if not _TASK_ID.fullmatch(token):
            raise self.fail(f"{shown(token)} is not a task id (4 to 32 letters, digits, '-' or '_')")
        return token

    def options(self, text: str, found: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
        """Take leading ``--name value`` pairs off ``text``; the rest is the task."""
        opts = dict(found or {})
        while text.startswith("--"):
            name, rest = first_word(text)
            value, text = first_word(rest) if rest else ("", "")
            key = name[2:].lower()
            if key not in self.allowed:
                raise self.fail(f"unknown option {shown(name)}")
            if not value:
                raise self.fail(f"{name} needs a value")
            if key in opts:
                raise self.fail(f"{name} is given twice")
            opts[key] = value
        return opts, text

    def start(self, opts: dict[str, str]) -> StartOptions:
        deadline = opts.get("deadline")
        seconds = None if deadline is None else small_count(deadline)
        if deadline is not None and (seconds is None or not 1 <= seconds <= 86400):
            raise self.fail("--deadline takes whole seconds from 1 to 86400")
        expect = opts.get("expect")
        if expect is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", expect):
            raise self.fail("--expect takes json or a schema name from swarm.schemas")
        return {"expect": expect, "deadline": seconds}

    def strategy(self, value: str) -> str:
        if value.lower() not in STRATEGIES:
            raise self.fail(f"unknown strategy {shown(value)} (strategies: {', '.join(STRATEGIES)})")
        return value.lower()

    def route_map(self, token: str) -> tuple[tuple[str, str], ...]:
        pairs: list[tuple[str, str]] = []
        for item in token.split(","):
            branch, eq, worker = item.partition("=")
            if not eq or not BRANCH.fullmatch(branch.lower()):
                raise self.fail(f"the route map {shown(token)} needs branch=worker pairs separated by commas")
            self.check_worker(worker.lower())
            if any(b == branch.lower() for b, _ in pairs):
                raise self.fail(f"branch {branch.lower()!r} is listed twice")
            pairs.append((branch.lower(), worker.lower()))
        if len(pairs) > MAX_WORKERS:
            raise self.fail(f"at most {MAX_WORKERS} branches")
        return tuple(pairs)

    def word_then_task(self, rest: str, opts: dict[str, str]) -> tuple[str, str, dict[str, str]]:
        """The first word, then the task after any options written right before it; with every option so far."""
        token, prompt = self.word_and_prompt(rest)
        opts, prompt = self.options(prompt, opts)
        return token, prompt, opts

    def word_and_prompt(self, rest: str) -> tuple[str, str]:
        token, prompt = first_word(rest) if rest else ("", "")
        if not prompt:
            raise self.missing()
        return token, self.prompt(prompt)

    def prompt(self, text: str) -> str:
        if not text:
            raise self.missing()
        try:
            check_prompt(text, word=self.prompt_word)
        except LimitExceeded as exc:
            raise self.fail(str(exc)) from None
        return text

    def dispatch_worker(self, token: str) -> str | None:
        name = token.lower()
        if name == AUTO:
            return None
        self.check_worker(name)
        return name

    def pipeline_stages(self, token: str) -> tuple[str | None, tuple[str, ...]]:
        preset = preset_named(token, self.pipelines)
        if preset is not None:
            stages = tuple(self.pipelines[preset])
            for stage in stages:
                if stage not in self.workers:
                    raise self.fail(f"pipeline preset {preset!r} names unknown worker {stage!r}")
            return preset, stages
        if "," in token or token.lower() in self.workers:
            return None, self.worker_list(token)
        if token.lower() == AUTO:
            raise self._auto_refused()
        candidates = [*self.pipelines, *self.workers]
        near = difflib.get_close_matches(token.lower(), candidates, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        presets = ", ".join(sorted(self.pipelines)) or "none configured"
        raise self.fail(
            f"unknown pipeline preset or worker {shown(token)}{hint} (presets: {presets}; workers: {self._known()})"
        )

    def worker_list(self, token: str) -> tuple[str, ...]:
        names = token.split(",")
        if len(names) > MAX_WORKERS:
            raise self.fail(f"{len(names)} workers listed; at most {MAX_WORKERS} may take part in one task")
        if any(not name for name in names):
            raise self.fail(
                f"the worker list {shown(token)} has an empty name; "
                "separate worker names with commas and no spaces, e.g. researcher,builder"
            )
        lowered = [name.lower() for name in names]
        seen: set[str] = set()
        for name in lowered:
            if name == AUTO:
                raise self._auto_refused()
            self.check_worker(name)
            if name in seen:
                raise self.fail(f"worker {name!r} is listed twice")
            seen.add(name)
        return tuple(lowered)

    def check_worker(self, name: str) -> None:
        if name in self.workers:
            return
        near = difflib.get_close_matches(name, list(self.workers), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise self.fail(f"unknown worker {shown(name)}{hint} (workers: {self._known()})")

    def _auto_refused(self) -> GrammarError:
        return self.fail(
            f"'auto' picks a single worker and only works with dispatch; name the {self.usage.verb} workers"
        )

    def _known(self) -> str:
        return ", ".join(sorted(self.workers)) or "none configured"
