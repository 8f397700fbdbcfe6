"""Tools from MCP servers (``mcp_servers:``), offered through the same registry, policy and cards as built-ins.

Each server has one supervisor task that owns its connection (the SDK's
context managers must be entered and left in one task): it starts the server
(a stdio subprocess, or a streamable-HTTP session), lists its tools, re-lists
them when the server says its list changed, pings it, and when the server
crashes or hangs it drops the connection and starts again with backoff. While
a server is down its tools stay registered but refuse every call with the
reason, so an agent is told rather than left waiting.

Nothing a server says lowers a tool's danger level: every MCP tool is
``dangerous`` unless ``tools:`` classifies it by its ``server/tool`` name. The
server's hints (read-only, destructive) are shown on the card as notes only.
The arguments that go to the server are re-hashed against the hash a person
approved, just before they are sent. Results are bounded here and fenced as
untrusted data by the agent like every tool output.

The ``mcp`` SDK is imported inside functions: it takes about a second to
import and ``kazma --version`` must stay fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import structlog
from pydantic import ConfigDict

from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.honesty import reveal_line
from kazma.approvals.tool_names import MCP_TOOL_RULE, mcp_tool_name_problem
from kazma.config import failpoints
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.models import DangerLevel, MCPServerConfig
from kazma.config.waits import until_set
from kazma.engine.tools.mcp_launch import ServerPlaces, plan_launch, server_sandbox, unsandboxed_note
from kazma.engine.tools.mcp_stdio import CUT_CODE, StderrTail, bounded_stdio_client
from kazma.engine.tools.registry import Tool, ToolArgs, ToolRegistry, ToolResult
from kazma.engine.tools.workspace import ToolContext
from kazma.engine.types import ToolSpec

if TYPE_CHECKING:
    from mcp import ClientSession

__all__ = ["MCPArgs", "MCPConnection", "MCPSources", "MCPTool", "list_server_tools", "model_name"]

log = structlog.get_logger("kazma.engine.mcp")

MAX_DESCRIPTION = 1000
MAX_MODEL_NAME = 64  # what OpenAI-style function names allow, from [A-Za-z0-9_-]
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_AS_IS = re.compile(r"[A-Za-z0-9_-]+")


def model_name(server: str, tool: str) -> str:
    """The name a model calls ``server/tool`` by: ``server__tool``, and never the same for two tools.

    The server part never contains ``__`` nor ends with ``_``, so the first
    ``__`` of a model name is where the server's name ends: tools of two
    servers cannot meet (``a`` + ``x__y`` is ``a__x__y``; ``a__x`` + ``y`` is
    ``a_x-<hash>__y``). A tool name that would be changed to fit (a character
    outside ``[A-Za-z0-9_-]``, or too long) gets a hash of the whole name, so
    ``x.y`` and ``x_y`` of one server stay apart too.
    """
    head = server
    if "__" in server or server.endswith("_") or _UNSAFE.search(server) or not server:
        head = (re.sub("_+", "_", _UNSAFE.sub("_", server)).strip("_") or "mcp") + "-" + _digest(server, 6)
    name = f"{head}__{tool}"
    if _AS_IS.fullmatch(tool) and len(name) <= MAX_MODEL_NAME:
        return name
    room = MAX_MODEL_NAME - len(head) - len("__") - len("_") - 8
    return f"{head}__{_UNSAFE.sub('_', tool)[:room]}_{_digest(tool, 8)}"


def _digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:size]


class MCPArgs(ToolArgs):
    """Any JSON object: the server validates its own arguments against the schema it published."""

    model_config = ConfigDict(extra="allow", frozen=True)


@dataclass(frozen=True)
class ListedTool:
    name: str
    description: str
    schema: dict[str, Any]
    read_only: bool | None
    destructive: bool | None


@dataclass(frozen=True)
class MCPDefinition:
    """What an MCP tool is (:meth:`Tool.definition`): the tool as its server lists it, and that server as
    configured (where it is reached or what runs it, its sandbox). A remembered approval is bound to its digest and
    now outlives a restart, so pointing the name at another server, or unsandboxing it, must not inherit one."""

    listed: ListedTool
    server: dict[str, Any]


# stop(): how long each cancel of a supervisor is waited for (its server's own exit is bounded at a few seconds),
# and how many are sent before it is given up on.
_STOP_WAIT_S = 15.0
_STOP_ATTEMPTS = 3


class ServerUnavailable(Exception):
    """The server is not connected now (starting, crashed, restarting)."""


class MCPConnection:
    """One configured server: its supervisor, its current tools, and calls to them."""

    def __init__(
        self,
        name: str,
        config: MCPServerConfig,
        *,
        on_tools: Callable[[MCPConnection, list[ListedTool]], None] | None = None,
        backoff: Backoff | None = None,
        ping_interval: float = 5.0,
        places: ServerPlaces | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.places = places or scratch_places()
        self.on_tools = on_tools
        self.backoff = backoff or Backoff(base=0.5, cap=30.0)
        self.ping_interval = ping_interval
        self.session: ClientSession | None = None
        self.tools: dict[str, ListedTool] = {}
        self.problem: str | None = "starting"  # why calls are refused now; None while connected
        self.starts = 0
        self._broken = asyncio.Event()
        self._relist = asyncio.Event()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Set by stop(): the supervisor's loops end on it, not only on the cancel, which can be lost on the way
        # (asyncio merges a cancel landing while an anyio scope's own is pending into that one, which the scope
        # then swallows as its own).
        self._stopping = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping.clear()
        self._task = asyncio.create_task(self._supervise(), name=f"kazma-mcp-{self.name}")

    async def wait_ready(self, seconds: float) -> bool:
        return await until_set(self._ready, seconds)

    async def stop(self) -> None:
        """End the supervisor and with it the server. Its loops see ``_stopping`` (and a connection being watched
        ends at once), so a lost cancel costs at most one ping; the cancel is repeated, and a supervisor still
        running after every bounded wait is left running, logged and counted, rather than hang the shutdown."""
        self._stopping.set()
        self._broken.set()  # _watch, waiting between pings, returns now
        task, self._task = self._task, None
        if task is None:
            return
        for _attempt in range(_STOP_ATTEMPTS):
            task.cancel()
            # Waited for, not awaited: awaiting the task would cancel it again when this stop is cancelled.
            done, _ = await asyncio.wait({task}, timeout=_STOP_WAIT_S)
            if done:
                break
        else:
            count_failure("mcp_stop", self.name)
            log.error("mcp.stop_stuck", server=self.name, cancelling=task.cancelling(), waited_s=_STOP_WAIT_S)
            return
        failure = None if task.cancelled() else task.exception()
        if failure is not None:  # retrieved, so asyncio does not report it unretrieved at exit
            log.warning("mcp.supervisor_failed", server=self.name, error=_describe(failure))

    async def _supervise(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            self._broken.clear()
            stderr = StderrTail()
            try:
                async with connect(
                    self.name, self.config, on_list_changed=self._relist.set, places=self.places, stderr=stderr
                ) as session:
                    await self._list(session)
                    self.session, self.problem = session, None
                    self.starts += 1
                    self._ready.set()
                    failures = 0
                    log.info("mcp.connected", server=self.name, tools=sorted(self.tools), starts=self.starts)
                    await self._watch(session)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server's fault, whatever it is: say so and start again
                # Its stderr goes to the log only: the problem reaches models, and the server's words are not ours.
                self.problem = f"MCP server {self.name!r} failed: {_describe(exc)}"
                count_failure("mcp_server", self.name)
                log.warning("mcp.server_failed", server=self.name, error=_describe(exc), stderr=stderr.last_line())
            finally:
                self.session = None
                self._ready.clear()
            if self._stopping.is_set():
                return
            if self.problem is None:
                self.problem = f"MCP server {self.name!r} is restarting"
            delay = self.backoff.delay(failures)
            failures += 1
            log.info("mcp.restarting", server=self.name, in_seconds=round(delay, 2))
            await asyncio.sleep(delay)

    async def _watch(self, session: ClientSession) -> None:
        """Until the connection breaks: re-list on list-changed, ping between."""
        while not self._broken.is_set() and not self._stopping.is_set():
            broken = asyncio.create_task(self._broken.wait())
            relist = asyncio.create_task(self._relist.wait())
            try:
                await asyncio.wait({broken, relist}, timeout=self.ping_interval, return_when="FIRST_COMPLETED")
            finally:
                for task in (broken, relist):
                    task.cancel()
            if self._broken.is_set():
                return
            if self._relist.is_set():
                self._relist.clear()
                await self._list(session)
                log.info("mcp.tools_relisted", server=self.name, tools=sorted(self.tools))
                continue
            await self._ping(session)

    async def _ping(self, session: ClientSession) -> None:
        """Ping the server; what it raises ends the connection. Its answer cut off unread (over the bound, or ended
        with every request in flight when a cut message's id was in doubt) is the server talking, not a server that
        stopped: a restart for it would cut off its other calls and refuse its tools meanwhile, for nothing."""
        from mcp import MCPError

        from kazma.engine.tools.mcp_http import answer_cut

        try:
            async with asyncio.timeout(self.config.call_timeout_seconds):
                await session.send_ping()
        except MCPError as exc:
            if exc.code != CUT_CODE and not answer_cut(exc):
                raise
            log.warning("mcp.ping_cut", server=self.name, error=_describe(exc))

    async def _list(self, session: ClientSession) -> None:
        async with asyncio.timeout(self.config.start_timeout_seconds):
            listed = admitted(self.name, await _list_tools(session))
        self.tools = {tool.name: tool for tool in listed}
        if self.on_tools is not None:
            self.on_tools(self, listed)

    # -- calls -----------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        session = self.session
        if session is None:
            return ToolResult(ok=False, output="", error=self.problem or f"MCP server {self.name!r} is not connected")
        try:
            async with asyncio.timeout(self.config.call_timeout_seconds):
                if failpoints.armed:  # approved and verified, about to go to the server: its stream breaking here
                    await failpoints.reached(
                        "mcp.call", lambda: ConnectionResetError("the MCP server's stream broke (failpoint)")
                    )
                result = await session.call_tool(tool, arguments)
        except TimeoutError:
            self._fail(f"{self.name}/{tool} did not answer within {self.config.call_timeout_seconds:g} s")
            return ToolResult(
                ok=False,
                output="",
                error=f"{self.name}/{tool} timed out after {self.config.call_timeout_seconds:g} s; "
                "the server is being restarted and may or may not have acted",
                changed_state=True,
                outcome_unknown=True,
            )
        except Exception as exc:
            from mcp import MCPError

            from kazma.engine.tools.mcp_http import answer_cut

            if isinstance(exc, MCPError) and (exc.code == CUT_CODE or answer_cut(exc)):
                # Over HTTP the SDK says it in its own words (a parse error, "SSE stream failed"): said as stdio does
                said = exc.message if exc.code == CUT_CODE else self._cut_said()
                return ToolResult(
                    ok=False,
                    output="",
                    error=f"{self.name}/{tool}: {said}. The tool may have acted.",
                    changed_state=True,
                    truncated=True,
                    outcome_unknown=True,
                )
            if isinstance(exc, MCPError) and "closed" not in str(exc).lower():
                # the server answered with a protocol error: it is alive, the call failed
                return ToolResult(ok=False, output="", error=f"{self.name}/{tool} failed: {exc}", changed_state=True)
            self._fail(f"{self.name}/{tool}: {_describe(exc)}")
            return ToolResult(
                ok=False,
                output="",
                error=f"the MCP server {self.name!r} failed during the call ({_describe(exc)}); "
                "it is being restarted. The call may or may not have acted.",
                changed_state=True,
                outcome_unknown=True,
            )
        return _result(self.name, tool, result, self.config.max_output_chars)

    def _cut_said(self) -> str:
        return (
            f"the server's answer was longer than {self.config.max_message_bytes} bytes "
            f"(mcp_servers.{self.name}.max_message_bytes); Kazma cut it off unread"
        )

    def _fail(self, why: str) -> None:
        self.problem = f"MCP server {self.name!r} is restarting after: {why}"
        self.session = None  # no further call goes to a connection that is being dropped
        count_failure("mcp_call", self.name)
        log.warning("mcp.call_failed", server=self.name, reason=why)
        self._broken.set()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}"[:500]


@functools.cache
def scratch_places() -> ServerPlaces:
    """Working directories for servers started without places of their own: private to this process."""
    return ServerPlaces(root=Path(tempfile.mkdtemp(prefix="kazma-mcp-")))


@asynccontextmanager
async def connect(
    name: str,
    config: MCPServerConfig,
    *,
    on_list_changed: Callable[[], None] | None = None,
    places: ServerPlaces | None = None,
    stderr: StderrTail | None = None,
) -> AsyncIterator[ClientSession]:
    """A started, initialised session with ``config``'s server; a stdio one runs as :mod:`.mcp_launch` says."""
    from mcp import ClientSession
    from mcp.types import ToolListChangedNotification

    async def on_message(message: Any) -> None:
        if isinstance(getattr(message, "root", message), ToolListChangedNotification) and on_list_changed:
            on_list_changed()

    async with contextlib.AsyncExitStack() as stack:
        if config.command:
            sandbox = await asyncio.to_thread(server_sandbox, config)  # the first probe runs bwrap once
            launch = await asyncio.to_thread(plan_launch, name, config, places or scratch_places(), sandbox)
            log.info("mcp.starting", server=name, sandboxed=launch.sandboxed, network=config.network)
            read, write = await stack.enter_async_context(
                bounded_stdio_client(launch, server=name, max_message_bytes=config.max_message_bytes, stderr=stderr)
            )
        else:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            from kazma.engine.tools.mcp_http import bounded_http_transport

            headers = {header: os.environ.get(var, "") for header, var in config.headers.items()}
            http = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=headers,
                    timeout=config.call_timeout_seconds + 5,
                    trust_env=False,
                    transport=bounded_http_transport(config.max_message_bytes),
                )
            )
            streams = await stack.enter_async_context(
                streamable_http_client(config.url, http_client=http, max_sse_event_size=config.max_message_bytes)
            )
            read, write = streams[0], streams[1]
        session = await stack.enter_async_context(ClientSession(read, write, message_handler=on_message))
        async with asyncio.timeout(config.start_timeout_seconds):
            await session.initialize()
        log.debug("mcp.session_open", server=name)
        yield session


async def _list_tools(session: ClientSession) -> list[ListedTool]:
    listed: list[ListedTool] = []
    cursor: str | None = None
    from mcp.types import PaginatedRequestParams

    for _ in range(100):  # a server paging for ever cannot hold the start
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        for tool in page.tools:
            hints = tool.annotations
            listed.append(
                ListedTool(
                    name=tool.name,
                    description=(tool.description or "")[:MAX_DESCRIPTION],
                    schema=dict(tool.input_schema or {"type": "object"}),
                    read_only=None if hints is None else hints.read_only_hint,
                    destructive=None if hints is None else hints.destructive_hint,
                )
            )
        cursor = page.next_cursor
        if not cursor:
            break
    return listed


def admitted(server: str, listed: list[ListedTool]) -> list[ListedTool]:
    """The tools whose names follow the tool-name grammar; the rest are left out, logged and counted.

    A tool's name is shown on every card after ``Tool:``: a name with a line break or a space could lay out card
    lines of its own (``Tool: github/list_issues`` above the real call), so it never becomes a tool.
    """
    kept: list[ListedTool] = []
    for tool in listed:
        problem = mcp_tool_name_problem(tool.name)
        if problem is None:
            kept.append(tool)
            continue
        count_failure("mcp_tool_refused", server)
        log.warning(
            "mcp.tool_refused", server=server, tool=reveal_line(tool.name)[:300], reason=problem, rule=MCP_TOOL_RULE
        )
    return kept


_CUT_MARKER_ROOM = 80  # "\n[… result cut at N of M characters …]", with room for long numbers


def _result(server: str, tool: str, result: Any, limit: int) -> ToolResult:
    parts: list[str] = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(str(item.text))
        else:
            parts.append(f"[{kind or 'unknown'} content from the server, not shown]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        # Shown, not hashed: a server's NaN or 1e400 (its parser reads them as floats) is written as such. Canonical
        # JSON refused them, and a call that had run was reported as one that "failed unexpectedly".
        parts.append(json.dumps(structured, sort_keys=True, ensure_ascii=False, separators=(",", ":")))
    text = "\n".join(parts)
    truncated = len(text) > limit
    if truncated:
        text = text[:limit] + f"\n[… result cut at {limit} of {len(text)} characters …]"
    if getattr(result, "is_error", False):
        return ToolResult(ok=False, output=text, error=f"{server}/{tool} reported an error", changed_state=True)
    return ToolResult(ok=True, output=text, changed_state=True, truncated=truncated)


class MCPTool(Tool[MCPArgs]):
    """``server/tool`` as a Kazma tool: dangerous by default, whatever the server's hints say."""

    default_level: ClassVar[DangerLevel] = DangerLevel.DANGEROUS
    changes_state: ClassVar[bool] = True
    Args = MCPArgs
    description = ""

    def __init__(self, connection: MCPConnection, listed: ListedTool, level_of: Callable[[str], DangerLevel]) -> None:
        self.connection = connection
        self.listed = listed
        self.name = f"{connection.name}/{listed.name}"  # type: ignore[misc]  # per instance, not per class
        self.level_of = level_of

    def spec(self) -> ToolSpec:
        schema = self.listed.schema if self.listed.schema.get("type") == "object" else {"type": "object"}
        description = f"[MCP tool {self.name}] {self.listed.description}".strip()
        return ToolSpec(
            name=model_name(self.connection.name, self.listed.name), description=description, parameters=schema
        )

    def notes(self) -> tuple[str, ...]:
        config = self.connection.config
        unsandboxed = (unsandboxed_note(),) if config.command and config.sandbox == "none" else ()
        said = []
        if self.listed.read_only:
            said.append("read-only")
        if self.listed.destructive:
            said.append("destructive")
        if not said:
            return (*unsandboxed, f"MCP tool from server {self.connection.name!r}.")
        return (
            *unsandboxed,
            f"MCP tool from server {self.connection.name!r}, which calls it {' and '.join(said)} "
            "(the server's own words; Kazma does not rely on them).",
        )

    def call_notes(self, arguments: Mapping[str, Any]) -> tuple[str, ...]:
        # Built-in tools' defaults are filled into the call before its card; an MCP server applies its own, so
        # the arguments are sent as the card shows them and the defaults its schema declares are said beside them
        # (the tracker's create_issue filing issues publicly unless told otherwise).
        properties = self.listed.schema.get("properties")
        if not isinstance(properties, dict):
            return ()
        unsent = [
            f"{name} = {_shown_default(spec['default'])}"
            for name, spec in properties.items()
            if isinstance(spec, dict) and "default" in spec and name not in arguments
        ]
        if not unsent:
            return ()
        listed = "; ".join(unsent[:_MAX_DEFAULTS_SHOWN])
        more = f" (and {len(unsent) - _MAX_DEFAULTS_SHOWN} more)" if len(unsent) > _MAX_DEFAULTS_SHOWN else ""
        return (f"Not sent, so the server's own defaults apply (as its schema declares them): {listed}{more}.",)

    def output_limit(self) -> int:
        # The server's own max_output_chars, with room for the cut marker _result adds: set above the default, it
        # was still cut at the default by the agent, so the setting could only ever lower the limit.
        return self.connection.config.max_output_chars + _CUT_MARKER_ROOM

    def definition(self) -> object:
        # Its description, input schema and the server's hints as last listed, and the server's configuration.
        return MCPDefinition(self.listed, self.connection.config.model_dump(mode="json"))

    def refusal(self) -> str | None:
        if self.connection.session is None:
            return f"{self.name} is unavailable now: {self.connection.problem or 'its server is not connected'}"
        if self.listed.name not in self.connection.tools:
            return f"{self.name} is no longer offered by its server"
        return None

    async def run(self, args: MCPArgs, ctx: ToolContext) -> ToolResult:
        # What goes to the server is rebuilt from canonical JSON, then hashed: the very bytes approved.
        payload: dict[str, Any] = json.loads(canonical_json(dict(args.model_extra or {})))
        actual = args_hash(payload)
        if self.level_of(self.name) is DangerLevel.DANGEROUS and ctx.approved_hash != actual:
            count_failure("mcp_hash_mismatch", self.connection.name)
            log.warning("mcp.hash_mismatch", tool=self.name, approved=ctx.approved_hash, actual=actual)
            return ToolResult(
                ok=False,
                output="",
                error=f"refused: the arguments about to go to {self.name} hash to {actual[:12]}…, "
                f"not to what was approved ({(ctx.approved_hash or 'nothing')[:12]}…)",
            )
        log.info("mcp.call", tool=self.name, conversation=ctx.conversation, hash=actual)
        return await self.connection.call(self.listed.name, payload)


_MAX_DEFAULTS_SHOWN = 10
_DEFAULT_CHARS = 80


def _shown_default(value: object) -> str:
    # Plain json, not canonical_json: a schema's own NaN is said as NaN, not a reason to refuse the call. ASCII:
    # the note is Kazma's words on the card, so a server's text in it (a bidi control, a line break) is escaped.
    text = json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= _DEFAULT_CHARS else f"{text[: _DEFAULT_CHARS - 1]}…"


class MCPSources:
    """Every configured server, its tools kept in ``registry`` as they come and go."""

    def __init__(
        self,
        servers: dict[str, MCPServerConfig],
        registry: ToolRegistry,
        level_of: Callable[[str], DangerLevel],
        *,
        backoff: Backoff | None = None,
        ping_interval: float = 5.0,
        places: ServerPlaces | None = None,
    ) -> None:
        self.registry = registry
        self.level_of = level_of
        self.connections = {
            name: MCPConnection(
                name, config, on_tools=self._tools_listed, backoff=backoff, ping_interval=ping_interval, places=places
            )
            for name, config in servers.items()
        }

    def _tools_listed(self, connection: MCPConnection, listed: list[ListedTool]) -> None:
        prefix = f"{connection.name}/"
        names = {f"{prefix}{tool.name}" for tool in listed}
        for stale in [n for n in self.registry.names() if n.startswith(prefix) and n not in names]:
            self.registry.remove(stale)
        for tool in listed:
            try:
                self.registry.put(MCPTool(connection, tool, self.level_of))
            except ValueError as exc:  # its model-facing name belongs to another tool: that one keeps it
                count_failure("mcp_tool_name_taken", connection.name)
                log.error("mcp.tool_name_taken", server=connection.name, tool=tool.name, problem=str(exc))

    async def start(self, *, wait: float = 0.0) -> None:
        """Start every server; wait up to ``wait`` seconds for them to list their tools (the rest come later)."""
        for connection in self.connections.values():
            connection.start()
        if wait > 0 and self.connections:
            await asyncio.gather(*(c.wait_ready(wait) for c in self.connections.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.connections.values()))


async def list_server_tools(
    name: str, config: MCPServerConfig, *, places: ServerPlaces | None = None, stderr: StderrTail | None = None
) -> list[str]:
    """Start ``name`` as ``kazma run`` would, list its tools, stop it: for ``kazma doctor``, every name as listed
    (refused ones too, so the doctor can say why, :func:`~kazma.approvals.tool_names.mcp_tool_name_problem`).
    Raises what went wrong."""
    async with asyncio.timeout(config.start_timeout_seconds + 5):
        async with connect(name, config, places=places, stderr=stderr) as session:
            return [tool.name for tool in await _list_tools(session)]
