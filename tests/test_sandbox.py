"""The shell tool's bubblewrap sandbox, attacked for real: each test is something an approved call tried.

Every attack here succeeds against the unsandboxed shell (``mode: none``);
the sandbox must stop it. The tests need a working ``bwrap`` and skip, saying
so, only when there is none (``scripts/install-test-deps`` installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kazma.engine.tools.registry import ToolResult
from kazma.engine.tools.sandbox import (
    INSTALL_HINT,
    SANDBOX_PATH,
    Sandbox,
    SandboxMode,
    bwrap_argv,
    probe_bwrap,
    resolve_sandbox,
    sandbox_environment,
)
from kazma.engine.tools.shell import ShellArgs, ShellTool
from kazma.engine.tools.workspace import ToolContext

# The mode the attacks run against. Set it to "none" to watch every attack
# succeed on the unsandboxed shell (that is how these tests were checked).
MODE: SandboxMode = "bwrap"


@pytest.fixture
def sandbox() -> Sandbox:
    resolved = resolve_sandbox(MODE)
    if resolved.refuses:
        pytest.skip(f"bubblewrap is not usable here ({resolved.problem}); scripts/install-test-deps installs it")
    return resolved


@dataclass(frozen=True)
class Layout:
    """Kazma's state directory beside (not around) the conversation's workspace, as in production."""

    state: Path
    db: Path
    token: Path
    workspace: Path
    ctx: ToolContext


DB_CONTENT = b"SQLite format 3\x00 the approvals store"
TOKEN_CONTENT = b"web-token-original-value"


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "kazma.db"
    db.write_bytes(DB_CONTENT)
    token = state / "web-token"
    token.write_bytes(TOKEN_CONTENT)
    workspace = tmp_path / "workspaces" / "conv"
    return Layout(state, db, token, workspace, ToolContext(workspace=workspace, conversation="conv"))


def _tool(sandbox: Sandbox, layout: Layout, *, network: bool = False) -> ShellTool:
    return ShellTool(sandbox=sandbox, network=network, hidden_paths=[layout.state])


async def _run(tool: ShellTool, ctx: ToolContext, command: str, timeout_s: int = 30) -> ToolResult:
    return await tool.run(ShellArgs(command=command, timeout_s=timeout_s), ctx)


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (this test process excluded)."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


async def _eventually(condition: Callable[[], bool], bound_s: float = 15.0) -> bool:
    """Wait for ``condition`` to hold, polling; False if it still does not after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _marked_sleeper(marker: str) -> str:
    """Shell lines making ``./<marker>``: sleep under a name that shows in its command line on the host."""
    return f'ln -s "$(command -v sleep)" ./{marker}'


# --------------------------------------------------------------------------- secrets


async def test_an_approved_call_cannot_read_a_platform_token(
    sandbox: Sandbox, layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"tok-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", secret)
    monkeypatch.setenv("KAZMA_DECISION_KEY", f"k1:{secret}")  # the key that seals approvals
    command = (
        "env; cat /proc/*/environ; cat /proc/1/environ; cat /proc/$PPID/environ; "
        "for pid in /proc/[0-9]*; do cat $pid/environ; done; echo; echo done"
    )
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert "PATH=" in result.output, result.output  # the reads did run
    assert "done" in result.output, result.output
    assert secret not in result.output


KAZMA_CHILD = """
import asyncio, json, sys
from pathlib import Path
from kazma.engine.tools.sandbox import resolve_sandbox
from kazma.engine.tools.shell import ShellArgs, ShellTool
from kazma.engine.tools.workspace import ToolContext

async def main() -> None:
    mode, workspace, command = sys.argv[1:4]
    tool = ShellTool(sandbox=resolve_sandbox(mode))
    ctx = ToolContext(workspace=Path(workspace), conversation="conv")
    result = await tool.run(ShellArgs(command=command, timeout_s=120), ctx)
    print(json.dumps({"ok": result.ok, "output": result.output}))  # the last line of stdout

asyncio.run(main())
"""


def _start_kazma(tmp_path: Path, workspace: Path, command: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A stand-in for ``kazma run``: a process started with platform tokens in its environment runs one call."""
    script = tmp_path / "kazma_child.py"
    script.write_text(KAZMA_CHILD)
    return subprocess.Popen(
        [sys.executable, str(script), MODE, str(workspace), command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )


async def test_kazmas_own_environment_is_out_of_reach(sandbox: Sandbox, tmp_path: Path, layout: Layout) -> None:
    # Kazma gets its tokens in the environment it was started with, which
    # /proc/<pid>/environ shows to anyone who can see the process.
    secret = f"tok-secret-{uuid.uuid4().hex}"
    # The PostgreSQL password and the console tokens replicas share are there too (store.url's ${VAR}).
    # And the decision key, which seals approvals (config/keyring.py).
    shared = (
        "TELEGRAM_BOT_TOKEN",
        "SLACK_BOT_TOKEN",
        "KAZMA_PG_PASSWORD",
        "POSTGRES_PASSWORD",  # deploy/compose.yaml's postgres.env
        "KAZMA_WEB_TOKEN",
        "KAZMA_WEB_READER_TOKEN",
        "KAZMA_DECISION_KEY",
    )
    env = {**os.environ, **dict.fromkeys(shared, secret)}
    command = "env; cat /proc/*/environ; cat /proc/$PPID/environ; cat /proc/1/environ; echo; echo done"
    child = await asyncio.to_thread(_start_kazma, tmp_path, layout.workspace, command, env)
    out, err = await asyncio.to_thread(child.communicate, timeout=60)
    assert child.returncode == 0, err.decode()
    result = json.loads(out.splitlines()[-1])  # after the child's log lines
    assert "PATH=" in result["output"], result["output"]
    assert "done" in result["output"], result["output"]
    assert secret not in result["output"]


# --------------------------------------------------------------------------- the store


async def test_an_approved_call_cannot_see_or_change_the_store(sandbox: Sandbox, layout: Layout) -> None:
    state = layout.state
    command = f"""
        pwd
        ls {state} && echo LEAK-ls-absolute
        ls ../../state && echo LEAK-ls-relative
        cat {layout.db} && echo LEAK-cat-absolute
        cat ../../state/web-token && echo LEAK-cat-relative
        echo pwned > {layout.db} && echo LEAK-write-absolute
        echo pwned > ../../state/web-token && echo LEAK-write-relative
        rm -f {layout.token} ../../state/kazma.db; ls {layout.token} && echo LEAK-rm-absolute
        ls -a ../..; ls -a ..
        echo done
    """
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert "done" in result.output, result.output
    assert "LEAK" not in result.output, result.output
    assert DB_CONTENT.decode(errors="replace") not in result.output
    assert TOKEN_CONTENT.decode() not in result.output
    assert layout.db.read_bytes() == DB_CONTENT
    assert layout.token.read_bytes() == TOKEN_CONTENT
    # Above the workspace there are only the empty directories leading to it.
    listing = result.output.splitlines()
    assert "state" not in listing


async def test_the_launchers_own_files_are_invisible(
    sandbox: Sandbox, layout: Layout, repo: Path, tmp_path: Path
) -> None:
    beside = tmp_path / "kazma.yaml"
    beside.write_text("telegram: {token: hunter2}\n")
    targets = [beside, repo / "pyproject.toml", Path.home(), Path.cwd(), Path(sys.executable)]
    command = "\n".join(f"ls -d {target} && echo LEAK-{n}" for n, target in enumerate(targets)) + "\necho done"
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert "done" in result.output, result.output
    assert "LEAK" not in result.output, result.output


async def test_etc_is_a_vetted_subset(sandbox: Sandbox, layout: Layout) -> None:
    command = (
        "for f in /etc/shadow /etc/ssl/private /etc/ssh /etc/pip.conf /etc/environment; do "
        "ls -d $f 2>/dev/null && echo LEAK-$f; done; "
        "test -r /etc/passwd && test -r /etc/nsswitch.conf && echo usable-etc"
    )
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert "usable-etc" in result.output, result.output
    assert "LEAK" not in result.output, result.output


async def test_hidden_paths_under_system_directories_are_covered(sandbox: Sandbox, layout: Layout) -> None:
    # A state directory that lives where the sandbox binds system files (say
    # /usr/local/kazma) is covered: a directory by an empty tmpfs, a file by
    # /dev/null (unreadable there: binds are nodev), and a path that is itself
    # bound is left out. Existing system paths stand in for such a state directory.
    hidden: list[Path | str] = ["/usr/share", "/usr/bin/env", "/etc/passwd", layout.state]
    tool = ShellTool(sandbox=sandbox, network=False, hidden_paths=hidden)
    command = (
        "echo share=$(ls -A /usr/share | wc -l); echo env=$(cat /usr/bin/env 2>/dev/null | wc -c); "
        "ls /etc/passwd && echo LEAK-passwd; echo sh-still-works"
    )
    result = await _run(tool, layout.ctx, command)
    assert result.ok, result.output
    assert "share=0" in result.output
    assert "env=0" in result.output
    assert "LEAK" not in result.output
    baseline = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert "share=0" not in baseline.output
    assert "env=0" not in baseline.output


async def test_a_hidden_path_inside_the_workspace_is_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    if not sandbox.active:
        pytest.skip("unsandboxed, hidden paths are not enforced (see isolation)")
    workspace = tmp_path / "ws"
    (workspace / ".kazma").mkdir(parents=True)
    ctx = ToolContext(workspace=workspace, conversation="conv")
    for hidden in (workspace / ".kazma", workspace):
        tool = ShellTool(sandbox=sandbox, hidden_paths=[hidden])
        result = await _run(tool, ctx, "touch ran")
        assert not result.ok
        assert result.error is not None
        assert "keep workspaces outside Kazma's state directory" in result.error
        assert not result.changed_state
        assert not (workspace / "ran").exists()


async def test_a_workspace_inside_the_state_directory_shows_only_itself(sandbox: Sandbox, tmp_path: Path) -> None:
    # The old layout, <state>/workspaces/<conversation>: the state directory is
    # hidden, the workspace inside it is deliberately shared.
    state = tmp_path / "state"
    workspace = state / "workspaces" / "conv"
    workspace.mkdir(parents=True)
    (state / "kazma.db").write_bytes(DB_CONTENT)
    (state / "workspaces" / "other").mkdir()
    tool = ShellTool(sandbox=sandbox, hidden_paths=[state])
    ctx = ToolContext(workspace=workspace, conversation="conv")
    result = await _run(tool, ctx, "ls -A ../..; ls -A ..; cat ../../kazma.db && echo LEAK; touch mine; echo done")
    assert "done" in result.output, result.output
    assert "LEAK" not in result.output
    assert result.output.splitlines()[:2] == ["workspaces", "conv"]
    assert (workspace / "mine").exists()


# --------------------------------------------------------------------------- processes


async def test_no_process_outlives_the_call(sandbox: Sandbox, layout: Layout) -> None:
    marker = f"kz-{uuid.uuid4().hex}"
    command = f"""
        {_marked_sleeper(marker)}
        setsid -f sh -c 'touch started-setsid; exec ./{marker} 300'
        sh -c '(sh -c "touch started-fork; exec ./{marker} 301" &) &'
        while [ ! -e started-setsid ] || [ ! -e started-fork ]; do sleep 0.05; done
        echo started
    """
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert result.ok, result.output
    assert "started" in result.output
    assert await _eventually(lambda: not _processes_with(marker)), _processes_with(marker)


async def test_a_timeout_kills_everything(sandbox: Sandbox, layout: Layout) -> None:
    marker = f"kz-{uuid.uuid4().hex}"
    command = f"{_marked_sleeper(marker)}; setsid -f ./{marker} 300; ./{marker} 301"
    result = await _run(_tool(sandbox, layout), layout.ctx, command, timeout_s=1)
    assert not result.ok
    assert result.error is not None
    assert result.error.startswith("timed out after 1 s")
    assert await _eventually(lambda: not _processes_with(marker)), _processes_with(marker)


async def test_cancelling_a_call_kills_everything(sandbox: Sandbox, layout: Layout) -> None:
    marker = f"kz-{uuid.uuid4().hex}"
    layout.workspace.mkdir(parents=True)
    started = layout.workspace / "started"
    command = f"{_marked_sleeper(marker)}; setsid -f ./{marker} 300; touch started; ./{marker} 301"
    call = asyncio.create_task(_run(_tool(sandbox, layout), layout.ctx, command, timeout_s=600))
    assert await _eventually(started.exists)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await _eventually(lambda: not _processes_with(marker)), _processes_with(marker)


async def test_nothing_survives_kazma_being_killed(sandbox: Sandbox, tmp_path: Path, layout: Layout) -> None:
    marker = f"kz-{uuid.uuid4().hex}"
    layout.workspace.mkdir(parents=True)
    command = f"{_marked_sleeper(marker)}; setsid -f ./{marker} 300; touch started; ./{marker} 301"
    child = await asyncio.to_thread(_start_kazma, tmp_path, layout.workspace, command, dict(os.environ))
    try:
        assert await _eventually((layout.workspace / "started").exists)
        assert await _eventually(lambda: len(_processes_with(marker)) >= 2)
    finally:
        child.send_signal(signal.SIGKILL)
        await asyncio.to_thread(child.communicate, timeout=30)
    assert await _eventually(lambda: not _processes_with(marker)), _processes_with(marker)


async def test_kazmas_processes_are_invisible(sandbox: Sandbox, layout: Layout) -> None:
    command = "ls /proc; echo init=$(tr '\\0' ' ' < /proc/1/cmdline | cut -d' ' -f1)"
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert result.ok, result.output
    *listing, init, _status = result.output.splitlines()
    pids = {int(name) for name in listing if name.isdigit()}
    # bwrap's init, the shell and the two commands of its pipeline: nothing else.
    assert {1, 2} <= pids <= {1, 2, 3, 4, 5}, pids
    assert os.getpid() not in pids
    assert init.startswith("init="), init
    assert init.endswith("bwrap"), init


async def test_the_command_has_no_capabilities_and_proc_is_read_only(sandbox: Sandbox, layout: Layout) -> None:
    # bwrap started by root keeps every capability unless told; and uid 0 owns
    # the global sysctls in /proc/sys (kernel.core_pattern runs a host program).
    command = (
        "grep CapEff /proc/self/status; "
        "[ -w /proc/sys/kernel/core_pattern ] && echo LEAK-sysctl-writable; "
        "[ -w /proc/sysrq-trigger ] && echo LEAK-sysrq-writable; echo done"
    )
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert "CapEff:\t0000000000000000" in result.output, result.output
    assert "LEAK" not in result.output
    assert "done" in result.output


# --------------------------------------------------------------------------- network


@pytest.fixture
async def local_server() -> AsyncIterator[tuple[int, str]]:
    greeting = f"hello-{uuid.uuid4().hex}"

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(greeting.encode() + b"\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield port, greeting


def _connect_command(port: int) -> str:
    if shutil.which("python3", path=SANDBOX_PATH) is None:
        pytest.skip("no python3 in the system directories to make a TCP connection with")
    script = f"import socket; print(socket.create_connection(('127.0.0.1', {port}), timeout=5).recv(100).decode())"
    return f'python3 -c "{script}"'


async def test_network_off_cannot_reach_a_local_server(
    sandbox: Sandbox, layout: Layout, local_server: tuple[int, str]
) -> None:
    port, greeting = local_server
    result = await _run(_tool(sandbox, layout, network=False), layout.ctx, _connect_command(port))
    assert greeting not in result.output
    assert not result.ok
    assert "Connection refused" in result.output or "unreachable" in result.output, result.output


async def test_network_on_reaches_a_local_server(
    sandbox: Sandbox, layout: Layout, local_server: tuple[int, str]
) -> None:
    port, greeting = local_server
    result = await _run(_tool(sandbox, layout, network=True), layout.ctx, _connect_command(port))
    assert result.ok, result.output
    assert greeting in result.output


# --------------------------------------------------------------------------- the workspace


async def test_the_workspace_is_the_writable_cwd_and_home(sandbox: Sandbox, layout: Layout) -> None:
    command = "pwd; echo home=$HOME; echo data > made.txt; mkdir -p sub/dir; touch sub/dir/deep; echo done"
    result = await _run(_tool(sandbox, layout), layout.ctx, command)
    assert result.ok, result.output
    real = layout.workspace.resolve()
    assert result.output.splitlines()[:2] == [str(real), f"home={real}"]
    assert (real / "made.txt").read_text() == "data\n"
    assert (real / "sub" / "dir" / "deep").is_file()


# --------------------------------------------------------------------------- modes and detection


async def test_mode_bwrap_without_bubblewrap_refuses_and_runs_nothing(tmp_path: Path, layout: Layout) -> None:
    missing = resolve_sandbox("bwrap", binary=str(tmp_path / "no-such-bwrap"))
    assert missing.refuses
    assert not missing.active
    assert missing.refusal is not None
    assert "apt-get install bubblewrap" in missing.refusal
    tool = ShellTool(sandbox=missing)
    assert tool.isolation.startswith("refuses to run")
    result = await _run(tool, layout.ctx, "touch ran")
    assert not result.ok
    assert result.error == missing.refusal
    assert not result.changed_state
    assert not (layout.workspace / "ran").exists()


def test_bubblewrap_missing_from_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not probe_bwrap().available
    resolved = resolve_sandbox("bwrap")
    assert resolved.refuses
    assert resolved.problem == "'bwrap' was not found on PATH"
    assert resolved.refusal is not None
    assert INSTALL_HINT in resolved.refusal


def test_a_bwrap_that_cannot_make_namespaces_counts_as_missing(tmp_path: Path) -> None:
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    probe = probe_bwrap(str(broken))
    assert not probe.available
    assert probe.problem is not None
    assert "No permissions to create new namespace" in probe.problem
    auto = resolve_sandbox("auto", binary=str(broken))
    assert not auto.active
    assert not auto.refuses
    assert auto.describe() == "runs unsandboxed on this host"
    strict = resolve_sandbox("bwrap", binary=str(broken))
    assert strict.refusal is not None
    assert "No permissions to create new namespace" in strict.refusal


def test_mode_none_says_it_runs_unsandboxed() -> None:
    none = resolve_sandbox("none")
    assert not none.active
    assert not none.refuses
    assert none.refusal is None
    assert none.describe() == "runs unsandboxed on this host"
    assert ShellTool(sandbox=none).isolation == "runs unsandboxed on this host"


def test_an_active_sandbox_says_so(sandbox: Sandbox) -> None:
    if not sandbox.active:
        pytest.skip("describes the active sandbox")
    assert sandbox.describe() == "sandboxed (bubblewrap)"
    assert ShellTool(sandbox=sandbox, network=False).isolation == "sandboxed (bubblewrap, network off)"
    assert ShellTool(sandbox=sandbox, network=True).isolation == "sandboxed (bubblewrap, network on)"
    assert probe_bwrap() is probe_bwrap()  # probed once per process


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="auto, bwrap, none"):
        resolve_sandbox("docker")  # type: ignore[arg-type]


def test_argv_cuts_the_network_only_when_asked(tmp_path: Path) -> None:
    env = sandbox_environment(tmp_path, {"TELEGRAM_BOT_TOKEN": "x", "LANG": "C.UTF-8", "LC_SECRET": "y"})
    assert env == {"LANG": "C.UTF-8", "PATH": SANDBOX_PATH, "HOME": str(tmp_path)}
    off = bwrap_argv("bwrap", ["true"], workspace=tmp_path, network=False, env=env)
    on = bwrap_argv("bwrap", ["true"], workspace=tmp_path, network=True, env=env)
    assert "--unshare-net" in off
    assert "--unshare-net" not in on
    for argv in (off, on):
        assert argv[argv.index("--cap-drop") + 1] == "ALL"
        assert argv[-2:] == ["--", "true"]
        assert "--clearenv" in argv


async def test_a_setuid_program_a_call_leaves_is_out_of_every_other_users_reach(sandbox: Sandbox) -> None:
    # The sandbox drops every capability, but the command may still chmod u+s a file it made (nosuid holds only
    # inside the sandbox) and open its workspace to all: any local user then ran it as Kazma's user (root here).
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to try it as another user")
    base = Path(tempfile.mkdtemp(prefix="kazma-setuid-"))
    try:
        base.chmod(0o755)  # a state folder others may list, as a deployment's often is
        ctx = ToolContext(workspace=base / "workspaces" / "conv", conversation="conv")
        result = await _run(
            ShellTool(sandbox=sandbox), ctx, "cp /bin/cat ./suidcat && chmod 4755 ./suidcat && chmod 755 . && echo made"
        )
        assert result.ok, result
        planted = ctx.workspace / "suidcat"
        assert planted.stat().st_mode & 0o4000  # the bit is there on the host: what must not be reachable
        tried = subprocess.run(
            ["runuser", "-u", "nobody", "--", str(planted), "/etc/hostname"], capture_output=True, text=True,
            timeout=30, check=False,
        )  # fmt: skip
        assert tried.returncode != 0, tried.stdout
        assert "Permission denied" in tried.stderr, tried.stderr
        assert (base / "workspaces").stat().st_mode & 0o077 == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
