"""The ``shell`` tool: ``/bin/sh -c`` in the workspace, in the sandbox when there is one, output bounded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog
from pydantic import Field

from kazma.config.limits import KIB
from kazma.config.models import DangerLevel
from kazma.engine.tools.registry import Tool, ToolArgs, ToolResult
from kazma.engine.tools.sandbox import Sandbox, SandboxRefused, resolve_sandbox
from kazma.engine.tools.workspace import PathRefused, ToolContext

log = structlog.get_logger("kazma.engine.tools")


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

    Sandboxed (see :mod:`kazma.engine.tools.sandbox`), the command sees the system
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
            exit_code=code,
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
