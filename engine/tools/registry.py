"""The tool registry and what every tool is: :class:`Tool`, its arguments (:class:`ToolArgs`) and its outcome.

Tools are called with arguments a model wrote, so nothing here trusts them:
arguments are validated against each tool's pydantic model and every
outcome — bad arguments, a crash, a timeout — comes back as a
:class:`ToolResult` the agent can show the model, never as an exception that
would end the agent's turn. Whether a call may run at all (approval) is
decided before :meth:`ToolRegistry.execute` by the safety policy; the
registry only runs what it is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from kazma.approvals.hashing import args_hash
from kazma.config.limits import MAX_TOOL_OUTPUT_CHARS
from kazma.config.metrics import count_failure
from kazma.config.models import DangerLevel
from kazma.engine.tools.workspace import ToolContext
from kazma.engine.types import ToolSpec

log = structlog.get_logger("kazma.engine.tools")


@dataclass(frozen=True)
class ToolResult:
    """What a tool call came to.

    ``changed_state`` is set whenever the call may have changed something
    (even when it failed part-way), so that callers never retry it blindly.
    """

    ok: bool
    output: str
    error: str | None = None
    changed_state: bool = False
    truncated: bool = False
    exit_code: int | None = None  # a command's exit code, where the tool runs one (the execution record keeps it)
    # Nobody can say whether it acted: the call went out and its answer never came (an MCP server that timed out or
    # broke mid-call). Recorded as interrupted ("may have run"), not as a call that ran and failed.
    outcome_unknown: bool = False


class ToolArgs(BaseModel):
    """Base of every tool's arguments: unknown arguments are errors, not silently dropped.

    Strict: a value of the wrong type (``"5"`` or ``true`` for a number) is refused, never converted. The card
    shows and hashes the arguments as sent; a conversion after it would run a call nobody was shown."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


ArgsT = TypeVar("ArgsT", bound=ToolArgs)


class Tool(ABC, Generic[ArgsT]):
    """A tool: its name, what it does, its arguments model and how dangerous it is by default.

    ``changes_state`` says whether a call may change anything; a crashed call
    of such a tool is reported as possibly having changed state.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    default_level: ClassVar[DangerLevel]
    changes_state: ClassVar[bool] = False
    Args: type[ArgsT]

    @abstractmethod
    async def run(self, args: ArgsT, ctx: ToolContext) -> ToolResult:
        """Run with validated arguments. Expected failures are returned as results, not raised."""

    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description, parameters=self.Args.model_json_schema())

    def notes(self) -> tuple[str, ...]:
        """What every approval card of this tool must say about how the call would run (empty: nothing)."""
        return ()

    def call_notes(self, arguments: Mapping[str, Any]) -> tuple[str, ...]:
        """What the card of this one call must say about how it would run beyond its arguments (empty: nothing)."""
        return ()

    def as_run(self, args: ArgsT) -> dict[str, Any]:
        """``args`` as they run, defaults filled in: what a card shows and its hash covers
        (:meth:`ToolRegistry.prepare`), and what is hashed again just before the call runs."""
        return args.model_dump(mode="json")

    def refusal(self) -> str | None:
        """Why every call of this tool is refused before anyone is asked (None: calls may run)."""
        return None

    def output_limit(self) -> int:
        """The most of one result a model is handed (characters); beyond it the agent keeps its head and tail."""
        return MAX_TOOL_OUTPUT_CHARS

    def definition(self) -> object:
        """What this tool is, as its source says it (None: fixed in Kazma's code). A tool whose definition may
        change while it runs (an MCP server listing its tools again) returns a value compared before and after
        a call waits for approval: a call runs only against the tool the person was shown."""
        return None


class InvalidArguments(ValueError):
    """A call's arguments its tool's model refuses; ``problems`` say each one to the model."""

    def __init__(self, name: str, problems: list[str]) -> None:
        super().__init__(f"invalid arguments for {name}: " + "; ".join(problems))
        self.problems = problems


def definition_digest(tool: Tool[Any]) -> str | None:
    """The SHA-256 of the canonical JSON of ``tool``'s definition and its kind, or None for a tool fixed in Kazma's
    code. Stable across processes (unlike when a definition was first seen): a remembered approval is bound to it,
    so it stands after a restart for the very tool it was made for, and for no other."""
    definition = tool.definition()
    if definition is None:
        return None
    if isinstance(definition, BaseModel):
        described: object = definition.model_dump(mode="json")
    elif dataclasses.is_dataclass(definition) and not isinstance(definition, type):
        described = dataclasses.asdict(definition)
    else:
        described = definition
    kind = f"{type(tool).__module__}.{type(tool).__qualname__}"
    # Sorted keys, compact separators, UTF-8, as every hash Kazma shows; a value JSON has no form for is hashed by
    # its repr (deterministic for what a definition holds), never dropped.
    text = json.dumps(
        {"kind": kind, "definition": described}, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
        default=repr,
    )  # fmt: skip
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class UnknownToolError(LookupError):
    """A tool name that is not registered (a configuration mistake, so it is raised rather than returned)."""


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool[Any]] = (), *, clock: Callable[[], float] = time.time) -> None:
        self._tools: dict[str, Tool[Any]] = {}
        self._aliases: dict[str, str] = {}
        # A tool whose definition may change (Tool.definition): that definition, and when it was first put here.
        # Kept when the tool is removed, so a tool offered again as it was keeps its time.
        self._defined: dict[str, tuple[object, float]] = {}
        self._clock = clock
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool[Any]) -> None:
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self.put(tool)

    def put(self, tool: Tool[Any]) -> None:
        """Add or replace ``tool`` (tools of an MCP server change when it says its list changed).

        A model calls a tool by its spec name: one already answering for another tool is never taken
        over (:class:`ValueError`), or a model's call would reach a different tool than before.
        """
        spec_name = tool.spec().name
        holder = self._aliases.get(spec_name, spec_name)
        if holder != tool.name and holder in self._tools:
            raise ValueError(f"{tool.name!r} would be offered to models as {spec_name!r}, which is {holder!r}")
        self._tools[tool.name] = tool
        if spec_name != tool.name:
            self._aliases[spec_name] = tool.name
        definition = tool.definition()
        if definition is not None:
            now = (type(tool), definition)
            known = self._defined.get(tool.name)
            if known is None or known[0] != now:
                self._defined[tool.name] = (now, self._clock())

    def remove(self, name: str) -> None:
        tool = self._tools.pop(name, None)
        if tool is not None:
            self._aliases.pop(tool.spec().name, None)

    def canonical(self, name: str) -> str:
        """The registered name for what a model called (models see ``server__tool`` for ``server/tool``)."""
        return self._aliases.get(name, name)

    def matching(self, pattern: str) -> list[str]:
        """``pattern`` itself, or every registered ``server/…`` tool for ``server/*``."""
        if pattern.endswith("/*"):
            prefix = pattern[:-1]
            return [name for name in self.names() if name.startswith(prefix)]
        return [pattern] if pattern in self._tools else []

    def get(self, name: str) -> Tool[Any] | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def names(self) -> list[str]:
        return sorted(self._tools)

    def _require(self, name: str) -> Tool[Any]:
        tool = self._tools.get(name)
        if tool is None:
            raise UnknownToolError(f"unknown tool {name!r} (known tools: {self._known()})")
        return tool

    def _known(self) -> str:
        return ", ".join(self.names()) or "none registered"

    def specs(self, names: Iterable[str]) -> list[ToolSpec]:
        """The specs of ``names`` in the order given; an unknown name raises :class:`UnknownToolError`."""
        return [self._require(name).spec() for name in names]

    def default_level(self, name: str) -> DangerLevel:
        return self._require(name).default_level

    def notes(self, name: str) -> tuple[str, ...]:
        tool = self._tools.get(name)
        return () if tool is None else tool.notes()

    def call_notes(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, ...]:
        tool = self._tools.get(name)
        return () if tool is None else tool.call_notes(arguments)

    def definition_digest(self, name: str) -> str | None:
        """``name``'s definition now as a digest (see :func:`definition_digest`); None for a tool fixed in Kazma's
        code or not registered."""
        tool = self._tools.get(name)
        return None if tool is None else definition_digest(tool)

    def defined_since(self, name: str) -> float | None:
        """When ``name``'s definition as it stands was first put here (epoch seconds), or None for a tool fixed in
        Kazma's code (or not registered). A remembered approval that names no definition (made before they were
        recorded) and was made before it does not stand for a call of it now (see :meth:`SafetyPolicy.check`)."""
        tool = self._tools.get(name)
        if tool is None or tool.definition() is None:
            return None
        known = self._defined.get(name)
        return None if known is None else known[1]

    def output_limit(self, name: str) -> int:
        """The most of one result of ``name`` a model is handed (see :meth:`Tool.output_limit`)."""
        tool = self._tools.get(name)
        return MAX_TOOL_OUTPUT_CHARS if tool is None else tool.output_limit()

    def refusal(self, name: str) -> str | None:
        tool = self._tools.get(name)
        return None if tool is None else tool.refusal()

    def changes_state(self, name: str) -> bool:
        """Whether a call of ``name`` may change anything (an unknown tool is presumed to)."""
        tool = self._tools.get(name)
        return True if tool is None else tool.changes_state

    def prepare(self, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The call of ``name`` as it would run (:meth:`Tool.as_run`: validated, every default filled in), for the
        card and the hash, before anyone is asked; :class:`InvalidArguments` when its model refuses them, so a
        person is never asked to approve a call that cannot run as shown. An unknown tool: ``arguments`` as
        they are (it never runs)."""
        tool = self._tools.get(name)
        if tool is None:
            return dict(arguments)
        try:
            return tool.as_run(tool.Args.model_validate(dict(arguments)))
        except (TypeError, ValueError) as exc:
            raise InvalidArguments(name, validation_problems(exc)) from None

    async def execute(self, name: str, arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        """Validate and run one call. Problems with the call or inside the tool become error results.

        With ``ctx.approved_hash`` (a person approved the call), what is about to run is hashed again against it
        first: arguments changed since the card, or a default it did not show, do not run. With
        ``ctx.definition_hash``, the tool found here is compared with the definition its card showed: its server
        may have listed it again since (list-changed, a reconnect) while the caller awaited the store, and from
        here to the send nothing is awaited, so the tool compared is the tool that runs."""
        tool = self._tools.get(name)
        if tool is None:
            return ToolResult(ok=False, output="", error=f"unknown tool {name!r}; known tools: {self._known()}")
        if ctx.definition_hash is not None:
            now = definition_digest(tool)
            if now != ctx.definition_hash:
                count_failure("tool_changed")
                log.warning("tool.definition_changed", tool=name, conversation=ctx.conversation,
                            shown=ctx.definition_hash, now=now)  # fmt: skip
                checked = "approved (its description, arguments or hints are not what the card showed)"
                if ctx.approved_hash is None:  # a call no card was needed for: checked when it was made
                    checked = "made (its description, arguments or hints are not what they were then)"
                return ToolResult(
                    ok=False,
                    output="",
                    error=f"refused: {name} changed on its server after its call was {checked}; nothing ran, ask again",
                )
        try:
            args = tool.Args.model_validate(dict(arguments))
        except (TypeError, ValueError) as exc:
            problems = validation_problems(exc)
            log.info("tool.invalid_arguments", tool=name, conversation=ctx.conversation, problems=problems)
            return ToolResult(ok=False, output="", error=f"invalid arguments for {name}: " + "; ".join(problems))
        if ctx.approved_hash is not None:
            actual = args_hash(tool.as_run(args))
            if actual != ctx.approved_hash:
                count_failure("tool_hash_mismatch")
                log.warning("tool.hash_mismatch", tool=name, conversation=ctx.conversation,
                            approved=ctx.approved_hash, actual=actual)  # fmt: skip
                return ToolResult(
                    ok=False,
                    output="",
                    error=f"refused: the arguments about to run {name} hash to {actual[:12]}…, not to what was "
                    f"approved ({ctx.approved_hash[:12]}…); nothing ran",
                )
        try:
            return await tool.run(args, ctx)
        except Exception as exc:
            # Cancellation is a BaseException and deliberately passes through.
            log.exception("tool.crashed", tool=name, conversation=ctx.conversation)
            return ToolResult(
                ok=False,
                output="",
                error=f"{name} failed unexpectedly: {type(exc).__name__}: {exc}",
                changed_state=tool.changes_state,
            )


def validation_problems(exc: Exception) -> list[str]:
    """Each problem pydantic found, with where it is (``timeout_s: Input should be a valid integer``)."""
    if not isinstance(exc, ValidationError):
        return [f"(arguments): expected a JSON object of named arguments ({exc})"]
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "(arguments)"
        problems.append(f"{where}: {error['msg']}")
    return problems
