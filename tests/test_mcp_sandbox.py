"""Stdio MCP servers run in the shell's sandbox: a real SDK server (tests/mcp_servers/spy.py) tries each attack.

The spy reports what it saw; the test judges. Every attack is also run against the same server with
``sandbox: none``, where it must succeed: that is what shows each test can see a leak when there is one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kazma.approvals.card import build_card
from kazma.bot.app import build_app
from kazma.bot.cli.doctor import Level, check_mcp_server
from kazma.config import load_config_text
from kazma.config.models import MCPServerConfig
from kazma.engine.model import ScriptedProvider
from kazma.engine.tools.mcp_launch import ServerPlaces, unsandboxed_note
from kazma.engine.tools.mcp_tools import MCPConnection
from kazma.engine.tools.sandbox import probe_bwrap

SPY = Path(__file__).resolve().parent / "mcp_servers" / "spy.py"
needs_bwrap = pytest.mark.skipif(not probe_bwrap().available, reason="bubblewrap is not installed here")

# --------------------------------------------------------------------------- Kazma's own secrets

# Variables a server has that do not come from Kazma: PATH and HOME made by Kazma, PWD set by bwrap to its
# working directory, LC_CTYPE added by Python itself in the C locale.
MADE_HERE = {"PATH", "HOME", "PWD", "LC_CTYPE"}

KAZMA_CHILD = """
import asyncio, json, os, sys
from pathlib import Path
from kazma.bot.app import build_app
from kazma.config import load_config
from kazma.engine.model import ScriptedProvider

async def main() -> None:
    config_file, token = Path(sys.argv[1]), sys.argv[2]
    loaded = load_config(config_file)
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    state = loaded.config.store.path.parent
    (state / "web-token").write_text(token)
    try:
        assert app.mcp is not None
        await app.mcp.start(wait=60)
        paths = [str(state), str(state / "web-token"), str(state / "kazma.db"), str(config_file)]
        result = await app.mcp.connections["spy"].call("snoop", {"kazma_pid": os.getpid(), "paths": paths})
        print("REPORT " + json.dumps({"ok": result.ok, "error": result.error, "output": result.output}), flush=True)
    finally:
        await app.stop()

asyncio.run(main())
"""


def _kazma_config(tmp: Path, sandbox: str) -> Path:
    config = tmp / "kazma.yaml"
    config.write_text(
        f"""
store: {{path: '{tmp / "state" / "kazma.db"}'}}
web: {{port: 0}}
approvals: {{approvers: ["web:alice"]}}
mcp_servers:
  spy: {{command: '{sys.executable}', args: ['{SPY}'], env: [SPY_NAMED], sandbox: {sandbox}, max_output_chars: 1000000}}
""",
        encoding="utf-8",
    )
    return config


async def _snoop_from_kazma(tmp: Path, sandbox: str) -> tuple[int, dict[str, Any], str, str]:
    """Start a stand-in for ``kazma run`` with tokens in the environment it was started with (where
    /proc/<pid>/environ shows them) and the spy as its MCP server; the spy snoops. Returns Kazma's pid, the
    spy's report, the secret and the console token."""
    secret = f"tok-secret-{uuid.uuid4().hex}"
    console = f"console-token-{uuid.uuid4().hex}"
    shared = ("TELEGRAM_BOT_TOKEN", "SLACK_BOT_TOKEN", "KAZMA_PG_PASSWORD", "KAZMA_WEB_TOKEN", "KAZMA_DECISION_KEY")
    env = {**os.environ, **dict.fromkeys(shared, secret), "SPY_NAMED": "named-value"}
    env["KAZMA_DECISION_KEY"] = f"k1:{secret}"  # a keyring is <id>:<secret> entries (config/keyring.py)
    script = tmp / "kazma_child.py"
    script.write_text(KAZMA_CHILD, encoding="utf-8")
    child = subprocess.Popen(
        [sys.executable, str(script), str(_kazma_config(tmp, sandbox)), console],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp,
    )
    out, err = await asyncio.to_thread(child.communicate, timeout=120)
    assert child.returncode == 0, err.decode()[-3000:]
    said = json.loads(next(line for line in out.splitlines() if line.startswith(b"REPORT "))[len("REPORT ") :])
    assert said["ok"], said
    return child.pid, json.loads(said["output"]), secret, console


@needs_bwrap
async def test_a_sandboxed_server_reads_no_token_no_store_and_no_state(tmp_path: Path) -> None:
    pid, report, secret, console = await _snoop_from_kazma(tmp_path, "bwrap")
    text = json.dumps(report)
    assert f"kazma:{pid}" in report["environs"]  # the attack aimed at Kazma's real pid
    assert report["environs"][f"kazma:{pid}"] is None  # no such process in its world
    assert secret not in text  # not in any /proc/*/environ, not in its own environment, not in a file
    assert console not in text
    own = report["own_environment"]
    assert set(own) - MADE_HERE == {"SPY_NAMED"}, own
    assert own["SPY_NAMED"] == "named-value"
    assert own["HOME"] == own.get("PWD", own["HOME"]) == report["cwd"]
    workdir = Path(report["cwd"])
    assert workdir == tmp_path / "state-workspaces" / ".mcp" / "spy"  # its own, beside the workspaces
    for path, seen in report["paths"].items():
        assert seen.startswith("refused: FileNotFoundError"), (path, seen)


async def test_the_same_attacks_succeed_on_a_server_run_with_sandbox_none(tmp_path: Path) -> None:
    """The control: the report above would show each leak (so those assertions can fail)."""
    pid, report, secret, console = await _snoop_from_kazma(tmp_path, "none")
    assert secret in (report["environs"][f"kazma:{pid}"] or "")
    state = tmp_path / "state"
    assert report["paths"][str(state / "web-token")] == f"read: {console}"
    assert report["paths"][str(state / "kazma.db")].startswith("read: SQLite format 3")
    assert "web-token" in report["paths"][str(state)]
    # Its own environment is the same few variables either way: only the named one comes from Kazma.
    assert set(report["own_environment"]) - MADE_HERE == {"SPY_NAMED"}


# --------------------------------------------------------------------------- places it is given


def _spy(**settings: Any) -> MCPServerConfig:
    return MCPServerConfig(command=sys.executable, args=[str(SPY)], max_output_chars=1_000_000, **settings)


@asynccontextmanager
async def _running(config: MCPServerConfig, places: ServerPlaces | None = None) -> AsyncIterator[MCPConnection]:
    connection = MCPConnection("spy", config, places=places)
    connection.start()
    try:
        assert await connection.wait_ready(60), connection.problem
        yield connection
    finally:
        await connection.stop()


async def _snoop(connection: MCPConnection, paths: list[Path]) -> dict[str, Any]:
    result = await connection.call("snoop", {"kazma_pid": os.getpid(), "paths": [str(p) for p in paths]})
    assert result.ok, result.error
    report: dict[str, Any] = json.loads(result.output)
    return report


@needs_bwrap
async def test_a_folder_given_to_a_server_does_not_show_the_state_inside_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "web-token").write_text("console-secret")
    places = ServerPlaces(root=tmp_path / "ws" / ".mcp", hidden=(state,))
    async with _running(_spy(read_only=[tmp_path]), places) as connection:
        report = await _snoop(connection, [tmp_path, state, state / "web-token"])
    assert "state" in report["paths"][str(tmp_path)]  # the folder it was given is there...
    assert report["paths"][str(state)] == "listed: []"  # ...with the state directory covered, empty
    assert report["paths"][str(state / "web-token")].startswith("refused: FileNotFoundError")


@needs_bwrap
async def test_a_folder_given_through_a_link_is_read_where_it_was_named(tmp_path: Path) -> None:
    (tmp_path / "data-v2").mkdir()
    (tmp_path / "data-v2" / "notes.txt").write_text("the server's data")
    (tmp_path / "data").symlink_to(tmp_path / "data-v2")
    places = ServerPlaces(root=tmp_path / "ws" / ".mcp")
    async with _running(_spy(read_only=[tmp_path / "data"]), places) as connection:
        report = await _snoop(connection, [tmp_path / "data" / "notes.txt", tmp_path / "elsewhere"])
    assert report["paths"][str(tmp_path / "data" / "notes.txt")] == "read: the server's data"
    assert report["paths"][str(tmp_path / "elsewhere")].startswith("refused: FileNotFoundError")


@needs_bwrap
async def test_a_writable_folder_around_the_state_is_refused_before_the_server_starts(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    places = ServerPlaces(root=tmp_path / "ws" / ".mcp", hidden=(state,))
    connection = MCPConnection("spy", _spy(writable=[tmp_path]), places=places)
    connection.start()
    try:
        assert not await connection.wait_ready(5)
        assert "must stay hidden" in (connection.problem or ""), connection.problem
    finally:
        await connection.stop()


@needs_bwrap
async def test_the_network_is_off_unless_the_server_says_it_needs_it(tmp_path: Path) -> None:
    reached = asyncio.Event()

    async def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.set()
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with _running(_spy()) as connection:
            off = await connection.call("dial", {"port": port})
        assert off.output.startswith("failed:"), off.output
        assert not reached.is_set()
        async with _running(_spy(network=True)) as connection:
            on = await connection.call("dial", {"port": port})
        assert on.output == "connected", on.output
        assert reached.is_set()
    finally:
        listener.close()
        await listener.wait_closed()


# --------------------------------------------------------------------------- without bubblewrap; doctor; cards


def _no_bwrap_config(tmp: Path, sandbox: str) -> str:
    return f"""
store: {{path: '{tmp / "state" / "kazma.db"}'}}
web: {{port: 0}}
approvals: {{approvers: ["web:alice"]}}
agents:
  lead: {{name: kazma, tools: ["spy/*"]}}
mcp_servers:
  spy: {{command: '{sys.executable}', args: ['{SPY}'], sandbox: {sandbox}}}
"""


async def test_without_bubblewrap_a_server_is_not_started_unless_it_says_sandbox_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no bwrap to find; the command is a full path
    loaded = load_config_text(_no_bwrap_config(tmp_path, "bwrap"), environ={})
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        assert app.mcp is not None
        await app.mcp.start(wait=3)
        connection = app.mcp.connections["spy"]
        assert connection.session is None
        problem = connection.problem or ""
        assert "bubblewrap" in problem, problem
        assert "mcp_servers.spy.sandbox: none" in problem, problem
        assert app.conversations.runner.registry.matching("spy/*") == []  # nothing offered, nothing ran
    finally:
        await app.stop()
    doctor = await check_mcp_server("spy", loaded.config.mcp_servers["spy"])
    assert doctor.level is Level.FAIL
    assert doctor.detail.startswith("not started: MCP server 'spy' runs in bubblewrap")
    assert "set mcp_servers.spy.sandbox: none to run it unsandboxed" in doctor.detail


async def test_a_server_with_sandbox_none_says_so_on_every_card_and_in_doctor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    loaded = load_config_text(_no_bwrap_config(tmp_path, "none"), environ={})
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        assert app.mcp is not None
        await app.mcp.start(wait=60)
        registry = app.conversations.runner.registry
        assert sorted(registry.matching("spy/*")) == ["spy/dial", "spy/flood", "spy/snoop"]
        notes = registry.notes("spy/flood")
        assert notes[0] == unsandboxed_note() == "This MCP server runs unsandboxed on this host."
        request = await app.service.open("spy/flood", {"size": 1}, "agent:kazma", "web:console", notes=notes)
        card = build_card(request, value_limit=500, public_url="http://127.0.0.1:8765")
        assert card.warnings[0] == "This MCP server runs unsandboxed on this host."
    finally:
        await app.stop()
    doctor = await check_mcp_server("spy", loaded.config.mcp_servers["spy"])
    assert doctor.level is Level.WARN
    assert doctor.detail == (
        "runs unsandboxed on this host (mcp_servers.spy.sandbox: none; every card of its tools says so); "
        "3 tools: spy/dial, spy/flood, spy/snoop"
    )


@needs_bwrap
async def test_doctor_says_a_server_runs_sandboxed_and_its_cards_say_nothing_of_it(tmp_path: Path) -> None:
    places = ServerPlaces(root=tmp_path / "ws" / ".mcp")
    doctor = await check_mcp_server("spy", _spy(network=True), places=places)
    assert doctor.level is Level.OK, doctor.detail
    assert doctor.detail == "sandboxed (bubblewrap, network on); 3 tools: spy/dial, spy/flood, spy/snoop"
    async with _running(_spy(), places) as connection:
        from kazma.config.models import DangerLevel
        from kazma.engine.tools.mcp_tools import MCPTool

        tool = MCPTool(connection, connection.tools["flood"], lambda _name: DangerLevel.DANGEROUS)
        assert unsandboxed_note() not in tool.notes()


@needs_bwrap
async def test_doctor_shows_why_a_sandboxed_server_could_not_start(tmp_path: Path) -> None:
    """A server that needs a file it was not given dies in the sandbox: doctor shows its last words and the key."""
    hidden_script = tmp_path / "elsewhere" / "server.py"
    hidden_script.parent.mkdir()
    hidden_script.write_text(f"exec(open({str(SPY)!r}).read())\n")
    config = MCPServerConfig(command=sys.executable, args=[str(hidden_script)], start_timeout_seconds=20)
    doctor = await check_mcp_server("spy", config, places=ServerPlaces(root=tmp_path / "ws" / ".mcp"))
    assert doctor.level is Level.FAIL
    assert "FileNotFoundError" in doctor.detail, doctor.detail  # the server's own words, from its stderr
    assert "mcp_servers.spy.read_only" in doctor.detail


def test_config_keys_for_the_sandbox() -> None:
    from kazma.config import ConfigError

    bad = {
        "mcp_servers: {x: {command: a, sandbox: auto}}": "expected bwrap or none, got 'auto'",
        "mcp_servers: {x: {url: 'http://h', network: true}}": "only for stdio servers (command)",
        "mcp_servers: {x: {command: a, read_only: [relative]}}": "expected an absolute path",
        "mcp_servers: {x: {command: a, sandbox: none, network: false}}": "no sandbox for network to shape",
        "store: {path: /srv/k/state/kazma.db}\nmcp_servers: {x: {command: a, read_only: [/srv/k/state/x]}}": (
            "mcp_servers.x.read_only[0]: /srv/k/state/x would let the server reach the store's folder"
        ),
        "store: {path: /srv/k/state/kazma.db}\nmcp_servers: {x: {command: a, writable: [/srv/k]}}": (
            "mcp_servers.x.writable[0]: /srv/k would let the server reach the store's folder"
        ),
    }
    for text, problem in bad.items():
        with pytest.raises(ConfigError) as caught:
            load_config_text(text, environ={})
        assert problem in str(caught.value), (text, str(caught.value))
    good = load_config_text("mcp_servers: {x: {command: a, network: on, read_only: [/srv]}}", environ={})
    server = good.config.mcp_servers["x"]
    assert (server.sandbox, server.network, server.read_only) == ("bwrap", True, [Path("/srv")])
