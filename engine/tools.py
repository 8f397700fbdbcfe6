"""The tool registry and the built-in tools: ``shell``, ``read_file``, ``write_file`` and ``http_get``.

Tools are called with arguments a model wrote, so nothing here trusts them:
arguments are validated against each tool's pydantic model, file paths are
confined to the conversation's workspace, and every outcome — bad arguments,
a crash, a timeout — comes back as a :class:`ToolResult` the agent can show the
model, never as an exception that would end the agent's turn. Whether a call
may run at all (approval) is decided before :meth:`ToolRegistry.execute` by
the safety policy; the registry only runs what it is given.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import os
import secrets
import signal
import ssl
import stat
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kazma.config.models import DangerLevel
from kazma.config.version import __version__
from kazma.engine.fence import Fenced, fence_untrusted
from kazma.engine.netguard import (
    AddressPolicy,
    AddressRefused,
    IPAddress,
    IPNetwork,
    Resolver,
    is_ip_literal,
    resolve_checked,
    system_resolver,
)
from kazma.engine.sandbox import Sandbox, SandboxRefused, resolve_sandbox
from kazma.engine.types import ToolSpec

__all__ = [
    "Fenced",
    "HttpGetTool",
    "ReadFileTool",
    "ShellTool",
    "Tool",
    "ToolArgs",
    "ToolContext",
    "ToolRegistry",
    "ToolResult",
    "UnknownToolError",
    "WriteFileTool",
    "default_registry",
    "fence_untrusted",
]

log = structlog.get_logger("kazma.engine.tools")

KIB = 1024
MIB = 1024 * KIB


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


@dataclass(frozen=True)
class ToolContext:
    """Where a call runs: ``workspace`` is the conversation's own directory, created on first use.

    ``approved_hash``: the argument hash a person approved for this call (None when it needed no approval);
    a tool that sends its arguments elsewhere re-hashes what it sends against it.
    """

    workspace: Path
    conversation: str
    approved_hash: str | None = None
    agent: str = ""  # who calls (files an agent posts are shown under its name)

    def ensure_workspace(self) -> Path:
        """Create the workspace if needed and return its real path; :class:`PathRefused` when it is a symlink."""
        return _workspace_root(self)


class ToolArgs(BaseModel):
    """Base of every tool's arguments: unknown arguments are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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

    def refusal(self) -> str | None:
        """Why every call of this tool is refused before anyone is asked (None: calls may run)."""
        return None


class UnknownToolError(LookupError):
    """A tool name that is not registered (a configuration mistake, so it is raised rather than returned)."""


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool[Any]] = ()) -> None:
        self._tools: dict[str, Tool[Any]] = {}
        self._aliases: dict[str, str] = {}
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

    def refusal(self, name: str) -> str | None:
        tool = self._tools.get(name)
        return None if tool is None else tool.refusal()

    async def execute(self, name: str, arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        """Validate and run one call. Problems with the call or inside the tool become error results."""
        tool = self._tools.get(name)
        if tool is None:
            return ToolResult(ok=False, output="", error=f"unknown tool {name!r}; known tools: {self._known()}")
        try:
            args = tool.Args.model_validate(dict(arguments))
        except (TypeError, ValueError) as exc:
            problems = _describe_validation(exc)
            log.info("tool.invalid_arguments", tool=name, conversation=ctx.conversation, problems=problems)
            return ToolResult(ok=False, output="", error=f"invalid arguments for {name}: " + "; ".join(problems))
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


def _describe_validation(exc: Exception) -> list[str]:
    if not isinstance(exc, ValidationError):
        return [f"(arguments): expected a JSON object of named arguments ({exc})"]
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "(arguments)"
        problems.append(f"{where}: {error['msg']}")
    return problems


def default_registry(
    *, sandbox: Sandbox | None = None, shell_network: bool = False, hidden: Iterable[Path] = ()
) -> ToolRegistry:
    """The built-in tools with their default limits; ``shell`` in ``sandbox`` (default: bubblewrap when it works).

    ``hidden``: paths a sandboxed command must never see (Kazma's state directory).
    """
    shell = ShellTool(sandbox=sandbox, network=shell_network, hidden_paths=hidden)
    return ToolRegistry([shell, ReadFileTool(), WriteFileTool(), HttpGetTool()])


# --------------------------------------------------------------------------- shell


class ShellArgs(ToolArgs):
    command: str = Field(min_length=1, description="A command line for /bin/sh -c, run in the workspace directory.")
    timeout_s: int = Field(
        default=60, ge=1, le=600, description="Seconds before the command and everything it started are killed."
    )


class _HeadTail:
    """Keeps the first and last bytes of a stream of unbounded length, counting what falls between."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                del self.tail[:excess]

    def render(self) -> tuple[str, bool]:
        cut = self.total - len(self.head) - len(self.tail)
        if cut <= 0:
            return bytes(self.head + self.tail).decode("utf-8", errors="replace"), False
        head = bytes(self.head).decode("utf-8", errors="replace")
        tail = bytes(self.tail).decode("utf-8", errors="replace")
        return f"{head}\n[… {cut} bytes cut …]\n{tail}", True


class _Capture(asyncio.SubprocessProtocol):
    """Collects the child's combined output and reports its exit and the pipe's end separately.

    ``asyncio.subprocess.Process.wait()`` (3.11) only returns once every pipe
    is closed, so a background child holding stdout would hide the shell's
    exit; a protocol sees both events on their own.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, cap: int) -> None:
        self.output = _HeadTail(cap)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.output.feed(data)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _kill_group(pgid: int) -> None:
    # The shell leads its own process group (start_new_session), so this reaches
    # everything it started unless a process deliberately left the session. The
    # kernel does not hand out a pid that is still some group's id, so after the
    # shell is reaped this can only reach what is left of that same group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


_ENV_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


class ShellTool(Tool[ShellArgs]):
    """Runs ``/bin/sh -c`` in the workspace, inside the bubblewrap sandbox when there is one.

    Sandboxed (see :mod:`kazma.engine.sandbox`), the command sees the system
    directories, its workspace and nothing of Kazma: not the state directory,
    not Kazma's processes or environment, and — with ``network=False`` — no
    network. When its shell exits, its PID namespace ends and the kernel kills
    everything it started, also processes that left the session.

    Unsandboxed (``mode: none``, or ``auto`` where bubblewrap does not work),
    the command does not inherit the bus's environment either (it gets PATH and
    locale variables, with HOME set to the workspace, unless ``env`` is given),
    and anything left in its process group is killed when the shell exits; a
    process that moves itself into a new session escapes that, and the command
    can read whatever Kazma's user can. :attr:`isolation` says which applies.

    With ``mode: bwrap`` and no working bubblewrap every call is refused.
    """

    name = "shell"
    description = (
        "Run a shell command (/bin/sh -c) in the conversation's workspace directory. stdin is closed; "
        "stdout and stderr are returned together with the exit code. Background processes do not outlive the call."
    )
    default_level = DangerLevel.DANGEROUS
    changes_state = True
    Args = ShellArgs

    def __init__(
        self,
        *,
        output_cap: int = 64 * KIB,
        env: Mapping[str, str] | None = None,
        drain_grace_s: float = 5.0,
        sandbox: Sandbox | None = None,
        network: bool = True,
        hidden_paths: Iterable[Path | str] = (),
    ) -> None:
        """``sandbox`` defaults to ``resolve_sandbox("auto")``; ``network`` only matters sandboxed;
        ``hidden_paths`` (Kazma's state directory, its configuration file) stay invisible to sandboxed commands."""
        if output_cap < 2:
            raise ValueError("output_cap must be at least 2 bytes")
        self.output_cap = output_cap
        self.env = dict(env) if env is not None else None
        self.drain_grace_s = drain_grace_s
        self.sandbox = sandbox if sandbox is not None else resolve_sandbox("auto")
        self.network = network
        self.hidden_paths = tuple(Path(path) for path in hidden_paths)

    def notes(self) -> tuple[str, ...]:
        return () if self.sandbox.active else ("This command runs unsandboxed on this host.",)

    def refusal(self) -> str | None:
        return self.sandbox.refusal if self.sandbox.refuses else None

    @property
    def isolation(self) -> str:
        """How commands run here, in one line for approval cards and ``kazma doctor``."""
        if self.sandbox.active:
            return f"sandboxed (bubblewrap, network {'on' if self.network else 'off'})"
        return self.sandbox.describe()

    def _environment(self, workspace: Path) -> dict[str, str]:
        if self.env is not None:
            return dict(self.env)
        if self.sandbox.active:
            return self.sandbox.environment(workspace)
        env = {key: os.environ[key] for key in _ENV_PASSTHROUGH if key in os.environ}
        env.setdefault("PATH", os.defpath)
        env["HOME"] = str(workspace)
        return env

    def _prepare(self, command: str, ctx: ToolContext) -> tuple[Path, list[str], dict[str, str]]:
        """The workspace (created), the argv and the environment of one call; may raise SandboxRefused."""
        workspace = ctx.ensure_workspace()
        env = self._environment(workspace)
        argv = ["/bin/sh", "-c", command]
        if self.sandbox.active:
            argv = self.sandbox.wrap(argv, workspace=workspace, network=self.network, env=env, hidden=self.hidden_paths)
        return workspace, argv, env

    async def _spawn(
        self, argv: list[str], workspace: Path, env: dict[str, str]
    ) -> tuple[asyncio.SubprocessTransport, _Capture]:
        loop = asyncio.get_running_loop()
        # Sandboxed, ``env`` is also bwrap's own environment: inside, /proc/1 is
        # bwrap and shows the environment it was started with.
        return await loop.subprocess_exec(
            lambda: _Capture(loop, self.output_cap),
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workspace,
            env=env,
            start_new_session=True,
        )

    async def _stop(self, transport: asyncio.SubprocessTransport, capture: _Capture) -> None:
        """Kill the command's process group, reap the shell and collect the last output.

        Sandboxed, the group is bwrap's: killing it kills bwrap, whose sandbox
        dies with it (--die-with-parent) and takes its PID namespace along.
        """
        _kill_group(transport.get_pid())
        if transport.get_returncode() is None:
            with contextlib.suppress(ProcessLookupError):
                transport.kill()
        await capture.exited  # the shell is reaped by asyncio's child watcher
        # Only a process that escaped the group can still hold the pipe open.
        await asyncio.wait({capture.closed}, timeout=self.drain_grace_s)
        transport.close()

    async def run(self, args: ShellArgs, ctx: ToolContext) -> ToolResult:
        refusal = self.sandbox.refusal
        if refusal is not None:
            log.warning("sandbox.refused", tool=self.name, conversation=ctx.conversation, problem=self.sandbox.problem)
            return ToolResult(ok=False, output="", error=refusal)
        try:
            workspace, argv, env = await asyncio.to_thread(self._prepare, args.command, ctx)
        except SandboxRefused as exc:
            log.warning("sandbox.refused", tool=self.name, conversation=ctx.conversation, problem=str(exc))
            return ToolResult(ok=False, output="", error=f"refused to run: {exc}")
        except PathRefused as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        # Cancelled while the process is starting, asyncio would kill the shell
        # alone and leave its children running; shielded, the start completes
        # and the whole group is stopped below.
        spawn = asyncio.ensure_future(self._spawn(argv, workspace, env))
        try:
            transport, capture = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                transport, capture = await spawn
                await self._stop(transport, capture)
            raise
        except OSError as exc:
            return ToolResult(ok=False, output="", error=f"could not start {argv[0]}: {exc}")
        timed_out = False
        try:
            done, _ = await asyncio.wait({capture.exited}, timeout=args.timeout_s)
            timed_out = not done
        finally:
            # On normal exit (left-over background processes), on timeout and on
            # cancellation alike: nothing the command started survives the call.
            await self._stop(transport, capture)
        text, truncated = capture.output.render()
        if text and not text.endswith("\n"):
            text += "\n"
        if timed_out:
            killed = "sandbox killed" if self.sandbox.active else "process group killed"
            message = f"timed out after {args.timeout_s} s ({killed})"
            return ToolResult(
                ok=False, output=f"{text}[{message}]", error=message, changed_state=True, truncated=truncated
            )
        code = transport.get_returncode()
        assert code is not None  # process_exited has fired
        status = f"exit code {code}" + self._signal_note(code)
        return ToolResult(
            ok=code == 0,
            output=f"{text}[{status}]",
            error=None if code == 0 else status,
            changed_state=True,
            truncated=truncated,
        )

    def _signal_note(self, code: int) -> str:
        if code < 0:
            with contextlib.suppress(ValueError):
                return f" (killed by {signal.Signals(-code).name})"
        elif self.sandbox.active and code > 128:
            # bwrap reports a shell killed by signal N as exit code 128 + N, as
            # shells do; a command can also exit with that code itself.
            with contextlib.suppress(ValueError):
                return f" (likely killed by {signal.Signals(code - 128).name})"
        return ""


# --------------------------------------------------------------------------- files


class PathRefused(Exception):
    """A path the model asked for that the tool will not touch; the message is shown to the model."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _workspace_root(ctx: ToolContext) -> Path:
    """The workspace's real path, created when missing; refused when the workspace itself is a symbolic link.

    Paths are confined to the real path of the root, so a root that is a link
    would confine them to wherever the link points (and whoever can replace
    the link chooses that). It is checked before it is created or used.
    """

    def check() -> None:
        info = os.lstat(ctx.workspace)
        if stat.S_ISLNK(info.st_mode):
            raise PathRefused("the workspace directory is a symbolic link; refused (it must be a real directory)")
        if not stat.S_ISDIR(info.st_mode):
            raise PathRefused("the workspace is not a directory; refused")

    try:
        try:
            check()
        except FileNotFoundError:
            ctx.workspace.mkdir(parents=True, exist_ok=True)
            check()
        return ctx.workspace.resolve(strict=True)
    except OSError as exc:
        raise PathRefused(f"the workspace directory cannot be used: {exc.strerror or exc}") from exc


def _refuse_hard_links(shown: str, info: os.stat_result) -> str | None:
    """Why a file with several names is refused, or None when it has one.

    A shell call can hard-link a file from outside the workspace into it
    (``ln /elsewhere/file ws/x``); the link is a regular file, not a symlink,
    so only the link count shows that the same file has another name.
    """
    if info.st_nlink <= 1:
        return None
    return (
        f"{shown!r} has {info.st_nlink} hard links (other names for the same file, possibly outside the "
        "workspace); refused"
    )


def _inside(root: Path, raw: str) -> tuple[str, ...]:
    """The components, relative to ``root``, of the real path ``raw`` names; refused if it leaves ``root``."""
    if not raw or "\x00" in raw:
        raise PathRefused("expected a file path relative to the workspace")
    candidate = Path(raw)
    target = candidate if candidate.is_absolute() else root / candidate
    try:
        resolved = target.resolve()
    except (OSError, RuntimeError) as exc:  # 3.11 raises RuntimeError on symlink loops
        raise PathRefused(f"{raw!r} cannot be resolved: {exc}") from exc
    if not resolved.is_relative_to(root):
        if Path(os.path.normpath(target)).is_relative_to(root):
            raise PathRefused(f"{raw!r} leads outside the workspace through a symbolic link")
        raise PathRefused(f"{raw!r} is outside the workspace; use a path relative to the workspace")
    parts = resolved.relative_to(root).parts
    if not parts:
        raise PathRefused(f"{raw!r} names the workspace directory itself, not a file")
    return parts


def _open_parent(root: Path, parts: tuple[str, ...], *, create: bool) -> tuple[int, bool]:
    """Open the directory holding ``parts[-1]`` one component at a time without following symlinks.

    ``_inside`` already resolved every symlink, so a symlink met here was put
    there since (for example by a concurrent shell call); refusing it closes
    that race instead of following it out of the workspace. Returns the
    directory's fd and whether any directory was created.
    """
    created = False
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                    created = True
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as exc:
        os.close(fd)
        shown = "/".join(parts)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PathRefused(f"{shown!r}: a parent is not a directory (or changed into a symbolic link)") from exc
        if isinstance(exc, FileNotFoundError):
            raise PathRefused(f"no such file: {shown!r}") from exc
        raise
    return fd, created


class ReadFileArgs(ToolArgs):
    path: str = Field(description="Path of a text file, relative to the workspace.")


class ReadFileTool(Tool[ReadFileArgs]):
    name = "read_file"
    description = "Read a UTF-8 text file from the conversation's workspace (paths are relative to the workspace)."
    default_level = DangerLevel.READ
    Args = ReadFileArgs

    def __init__(self, *, max_bytes: int = 256 * KIB) -> None:
        self.max_bytes = max_bytes

    async def run(self, args: ReadFileArgs, ctx: ToolContext) -> ToolResult:
        return await asyncio.to_thread(self._read, ctx, args.path)

    def _read(self, ctx: ToolContext, raw: str) -> ToolResult:
        try:
            root = _workspace_root(ctx)
            parts = _inside(root, raw)
            parent, _ = _open_parent(root, parts, create=False)
        except PathRefused as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        shown = "/".join(parts)
        try:
            try:
                # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
            except FileNotFoundError:
                return ToolResult(ok=False, output="", error=f"no such file: {shown!r}")
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return ToolResult(ok=False, output="", error=f"{shown!r} changed into a symbolic link; refused")
                raise
        finally:
            os.close(parent)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if stat.S_ISDIR(info.st_mode):
                return ToolResult(ok=False, output="", error=f"{shown!r} is a directory, not a file")
            if not stat.S_ISREG(info.st_mode):
                return ToolResult(ok=False, output="", error=f"{shown!r} is not a regular file")
            # Counted on the open file itself: what is read below is the file whose names were counted.
            refused = _refuse_hard_links(shown, info)
            if refused is not None:
                return ToolResult(ok=False, output="", error=refused)
            data = handle.read(self.max_bytes + 1)
        truncated = len(data) > self.max_bytes
        data = data[: self.max_bytes]
        try:
            # Not final when cut: a multi-byte character split by the cap is not a sign of binary data.
            text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
        except UnicodeDecodeError:
            return ToolResult(ok=False, output="", error=f"{shown!r} is a binary file (not UTF-8 text); not shown")
        if "\x00" in text:
            return ToolResult(ok=False, output="", error=f"{shown!r} is a binary file (contains NUL bytes); not shown")
        if truncated:
            text += f"\n[… file is {info.st_size} bytes; only the first {self.max_bytes} are shown …]"
        return ToolResult(ok=True, output=text, truncated=truncated)


class WriteFileArgs(ToolArgs):
    path: str = Field(description="Path of the file to write, relative to the workspace. Parents are created.")
    content: str = Field(description="The whole new content of the file (UTF-8 text).")


class WriteFileTool(Tool[WriteFileArgs]):
    name = "write_file"
    description = (
        "Write a UTF-8 text file in the conversation's workspace, replacing it whole if it exists "
        "(paths are relative to the workspace; missing parent directories are created)."
    )
    default_level = DangerLevel.DANGEROUS
    changes_state = True
    Args = WriteFileArgs

    def __init__(self, *, max_bytes: int = MIB) -> None:
        self.max_bytes = max_bytes

    async def run(self, args: WriteFileArgs, ctx: ToolContext) -> ToolResult:
        return await asyncio.to_thread(self._write, ctx, args.path, args.content)

    def _write(self, ctx: ToolContext, raw: str, content: str) -> ToolResult:
        data = content.encode("utf-8")
        if len(data) > self.max_bytes:
            return ToolResult(
                ok=False, output="", error=f"content is {len(data)} bytes; the limit is {self.max_bytes} bytes"
            )
        try:
            root = _workspace_root(ctx)
            parts = _inside(root, raw)
            parent, created = _open_parent(root, parts, create=True)
        except PathRefused as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        shown = "/".join(parts)
        name = parts[-1]
        try:
            try:
                existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                mode = None
            else:
                if stat.S_ISDIR(existing.st_mode):
                    return ToolResult(
                        ok=False, output="", error=f"{shown!r} is a directory, not a file", changed_state=created
                    )
                if not stat.S_ISREG(existing.st_mode):
                    return ToolResult(
                        ok=False,
                        output="",
                        error=f"{shown!r} exists and is not a regular file; refused",
                        changed_state=created,
                    )
                # The rename below only replaces this name, so a link made after this check
                # still never has its other name written through.
                refused = _refuse_hard_links(shown, existing)
                if refused is not None:
                    return ToolResult(ok=False, output="", error=refused, changed_state=created)
                mode = stat.S_IMODE(existing.st_mode)
            # Write a temporary sibling and rename it over the target: readers see
            # the old file or the new one, never a half-written one.
            temp = f".kazma-{secrets.token_hex(8)}.tmp"
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=parent
            )
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    if mode is not None:
                        os.fchmod(handle.fileno(), mode)
                    os.fsync(handle.fileno())
                os.replace(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=parent)
                raise
            os.fsync(parent)
        finally:
            os.close(parent)
        return ToolResult(ok=True, output=f"wrote {len(data)} bytes to {shown}", changed_state=True)


# --------------------------------------------------------------------------- http


class HttpGetArgs(ToolArgs):
    url: str = Field(description="An http:// or https:// URL to fetch with GET.")


_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})


class _FetchFailed(Exception):
    """A fetch that stopped for a reason the message explains to the model."""


class _Unreachable(_FetchFailed):
    """No checked address of a host accepted a connection."""


class HttpGetTool(Tool[HttpGetArgs]):
    """GET a URL from the public internet, following redirects itself so that every hop is checked.

    For each hop the host is resolved once (``resolver``), every answer must
    pass the address policy (:mod:`kazma.engine.netguard`), and the connection
    goes to one of those checked addresses while the ``Host`` header and TLS
    (SNI and certificate check) still use the name. Proxy variables from the
    environment are ignored: a proxy would resolve and connect on its own.
    ``allow_private`` and ``also_allow`` widen the policy, never the path.
    """

    name = "http_get"
    description = (
        "Fetch a URL with HTTP GET and return the status, the content type and the body as text "
        "(bodies over the size limit are cut)."
    )
    default_level = DangerLevel.READ
    Args = HttpGetArgs

    def __init__(
        self,
        *,
        timeout_s: float = 20.0,
        max_bytes: int = MIB,
        max_redirects: int = 5,
        allow_private: bool = False,
        also_allow: Iterable[IPNetwork | str] = (),
        resolver: Resolver = system_resolver,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        # A "read" tool runs without approval, so by default it must not become a way
        # into the bus's own network: loopback, private, link-local (cloud metadata) …
        self.policy = AddressPolicy.of(allow_private=allow_private, also_allow=also_allow)
        self.resolver = resolver
        self.ssl_context = ssl_context

    async def run(self, args: HttpGetArgs, ctx: ToolContext) -> ToolResult:
        try:
            url = httpx.URL(args.url)
        except httpx.InvalidURL as exc:
            return ToolResult(ok=False, output="", error=f"invalid URL {args.url!r}: {exc}")
        if not _fetchable(url):
            return ToolResult(
                ok=False, output="", error=f"only http:// and https:// URLs are fetched, not {args.url!r}"
            )
        try:
            # httpx's timeout bounds each read; this bounds the whole fetch, so a
            # server trickling bytes cannot hold the call open.
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url)
        except (TimeoutError, httpx.TimeoutException):
            return ToolResult(ok=False, output="", error=f"timed out after {self.timeout_s:g} s fetching {url}")
        except (AddressRefused, _FetchFailed) as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        except httpx.HTTPError as exc:
            return ToolResult(ok=False, output="", error=f"fetching {url} failed: {type(exc).__name__}: {exc}")

    async def _fetch(self, url: httpx.URL) -> ToolResult:
        current = url
        for _ in range(self.max_redirects + 1):
            # raw_host is the ASCII (IDNA) form, the same name TLS is given below.
            host = current.raw_host.decode("ascii")
            addresses = await resolve_checked(host, resolver=self.resolver, policy=self.policy)
            # A client per hop: a pooled connection is never reused for a
            # different name than the one its certificate was checked for.
            async with self._client() as client:
                response = await self._connect(client, current, addresses)
                try:
                    target = _redirect_target(current, response)
                    if target is None:
                        return await self._result(url, current, response)
                finally:
                    await response.aclose()
            current = target
        return ToolResult(ok=False, output="", error=f"more than {self.max_redirects} redirects fetching {url}")

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=self.timeout_s,
            follow_redirects=False,  # followed in _fetch, each hop resolved and checked
            trust_env=False,  # no HTTP(S)_PROXY / ALL_PROXY, no .netrc
            verify=self.ssl_context if self.ssl_context is not None else True,
            headers={"User-Agent": f"kazma/{__version__}"},
        )

    async def _connect(
        self, client: httpx.AsyncClient, url: httpx.URL, addresses: Sequence[IPAddress]
    ) -> httpx.Response:
        """Send the GET to the first checked address that accepts a connection."""
        failures: list[str] = []
        for address in addresses:
            request = _pinned_request(client, url, address)
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                failures.append(f"{address}: {exc or type(exc).__name__}")
        raise _Unreachable(f"could not connect to {url.host}: " + "; ".join(failures))

    async def _result(self, url: httpx.URL, final: httpx.URL, response: httpx.Response) -> ToolResult:
        body = bytearray()
        truncated = False
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > self.max_bytes:
                del body[self.max_bytes :]
                truncated = True
                break
        try:
            text = bytes(body).decode(response.encoding or "utf-8", errors="replace")
        except LookupError:  # a charset Python does not know
            text = bytes(body).decode("utf-8", errors="replace")
        status = f"{response.http_version} {response.status_code} {response.reason_phrase}".rstrip()
        lines = [status, f"content-type: {response.headers.get('content-type', '(none)')}"]
        if final != url:
            lines.append(f"url: {final}")
        output = "\n".join(lines) + "\n\n" + text
        if truncated:
            output += f"\n[… body cut at {self.max_bytes} bytes …]"
        ok = response.is_success
        error = None if ok else f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
        return ToolResult(ok=ok, output=output, error=error, truncated=truncated)


def _fetchable(url: httpx.URL) -> bool:
    return url.scheme in ("http", "https") and bool(url.host)


def _pinned_request(client: httpx.AsyncClient, url: httpx.URL, address: IPAddress) -> httpx.Request:
    """A GET for ``url`` that connects to ``address`` but still speaks to the name.

    The URL's host becomes the checked address, so nothing resolves the name
    again. ``Host`` is set to what httpx would have sent for the name
    (``url.netloc``), and the ``sni_hostname`` request extension makes httpcore
    pass the name as ``server_hostname`` to TLS, which both sends it as SNI and
    checks the certificate against it (httpcore 1.0.9, ``_async/connection.py``:
    ``"server_hostname": sni_hostname or self._origin.host``).
    """
    if is_ip_literal(url.raw_host.decode("ascii")):
        return client.build_request("GET", url)  # checked as it is; there is no name to resolve or keep
    return client.build_request(
        "GET",
        url.copy_with(host=str(address)),
        headers={"Host": url.netloc.decode("ascii")},
        extensions={"sni_hostname": url.raw_host.decode("ascii")},
    )


def _redirect_target(current: httpx.URL, response: httpx.Response) -> httpx.URL | None:
    """Where a redirect response points (resolved against ``current``), or None when it is no redirect."""
    if response.status_code not in _REDIRECT_CODES or "Location" not in response.headers:
        return None
    location = response.headers["Location"]
    try:
        target = current.join(location)
    except httpx.InvalidURL as exc:
        raise _FetchFailed(f"refused to follow a redirect from {current} to {location!r}: {exc}") from exc
    if not _fetchable(target):
        raise _FetchFailed(
            f"refused to follow a redirect from {current} to {location!r}: only http:// and https:// URLs are fetched"
        )
    return target
