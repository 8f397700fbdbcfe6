"""The shell as Kazma wires it from kazma.yaml: outside the state directory, sandboxed, and honest when it is not."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from kazma.adapters.web import WebAdapter
from kazma.approvals.card import build_card
from kazma.bot.app import build_app
from kazma.bot.cli.doctor import Level, check_sandbox
from kazma.bot.keys import decision_key_file
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, open_keyring
from kazma.engine.agent import workspace_for
from kazma.engine.model import ScriptedProvider
from kazma.engine.tools.sandbox import probe_bwrap
from kazma.engine.tools.workspace import ToolContext

needs_bwrap = pytest.mark.skipif(not probe_bwrap().available, reason="bubblewrap is not installed here")


def config_text(state: Path, sandbox: str) -> str:
    return f"""
store: {{path: '{state / "kazma.db"}'}}
web: {{port: 0}}
tools: {{sandbox: {sandbox}}}
approvals: {{approvers: ["web:alice"]}}
"""


async def test_the_state_directory_is_private_and_the_workspaces_live_outside_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    loaded = load_config_text(config_text(state, "none"), environ={})
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "kazma.db").stat().st_mode) == 0o600
        root = app.conversations.runner.workspace_root
        assert root == tmp_path / "state-workspaces"
        assert not root.resolve().is_relative_to(state.resolve())
    finally:
        await app.stop()


@needs_bwrap
async def test_an_approved_shell_call_cannot_reach_the_store_or_the_tokens(tmp_path: Path) -> None:
    state = tmp_path / "state"
    loaded = load_config_text(config_text(state, "bwrap"), environ={})
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        (state / "web-token").write_text("operator-token-that-must-stay-secret-123456\n")
        before = (state / "kazma.db").read_bytes()
        runner = app.conversations.runner
        ctx = ToolContext(workspace_for(runner.workspace_root, "telegram:-1"), "telegram:-1")
        command = (
            f"ls {state}; cat {state}/web-token; cat ../../state/web-token; "
            f"echo forged > {state}/kazma.db; sqlite3 {state}/kazma.db 'select 1'; "
            "cat /proc/1/environ /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c TOKEN; echo done"
        )
        result = await runner.registry.execute("shell", {"command": command}, ctx)
        assert "done" in result.output
        assert "operator-token-that-must-stay-secret" not in result.output
        assert (state / "kazma.db").read_bytes() == before  # nothing written through to the store
    finally:
        await app.stop()


@needs_bwrap
async def test_an_approved_shell_call_cannot_read_the_decision_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whoever holds the key can seal approvals. Made at first start beside the store's folder (never inside it),
    # or given in the environment: neither reaches a command.
    state = tmp_path / "state"
    loaded = load_config_text(config_text(state, "bwrap"), environ={})
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        key_file = decision_key_file(loaded.config)
        assert key_file == tmp_path / "state-keys" / "decision"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        [written] = open_keyring(DECISION_KEYS, key_file.parent, environ={}).written()
        given = "k7:" + "e" * 40
        monkeypatch.setenv("KAZMA_DECISION_KEY", given)  # as replicas are given it
        runner = app.conversations.runner
        ctx = ToolContext(workspace_for(runner.workspace_root, "telegram:-1"), "telegram:-1")
        command = (
            f"cat {key_file}; cat ../../state-keys/decision; ls -a {key_file.parent} ../../state-keys; env; "
            "cat /proc/1/environ /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; echo done"
        )
        result = await runner.registry.execute("shell", {"command": command}, ctx)
        assert "done" in result.output, result.output
        assert "PATH=" in result.output  # the reads ran
        assert written not in result.output
        assert "e" * 40 not in result.output
    finally:
        await app.stop()


async def test_without_a_sandbox_every_shell_card_says_so_and_doctor_warns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    loaded = load_config_text(config_text(state, "none"), environ={})
    web = WebAdapter()
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[], web=web)
    await app.start()
    try:
        notes = app.conversations.runner.registry.notes("shell")
        assert notes == ("This command runs unsandboxed on this host.",)
        check = asyncio.create_task(
            app.policy.check(
                "shell", {"command": "ls"}, requested_by="agent:b", conversation="web:console", notes=notes
            )
        )
        async with asyncio.timeout(10):
            while not (pending := await app.service.store.requests(pending_only=True)):
                await asyncio.sleep(0.01)
        card = build_card(pending[0], value_limit=500, public_url="http://127.0.0.1:8765")
        assert card.warnings[0] == "This command runs unsandboxed on this host."
        check.cancel()
        with pytest.raises(asyncio.CancelledError):
            await check
    finally:
        await app.stop()
    doctor = check_sandbox(loaded)
    assert doctor.level is Level.WARN
    assert doctor.detail == (
        "shell commands run unsandboxed on this host (every shell card says so): tools.sandbox is none"
    )


async def test_tools_sandbox_bwrap_without_bubblewrap_refuses_before_anyone_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no bwrap to find
    loaded = load_config_text(config_text(tmp_path / "state", "bwrap"), environ={})
    doctor = check_sandbox(loaded)
    assert doctor.level is Level.FAIL
    assert "bubblewrap" in doctor.detail


async def test_auto_without_bubblewrap_says_unsandboxed_on_the_card_and_in_doctor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # the default mode, on a host without bwrap
    loaded = load_config_text(config_text(tmp_path / "state", "auto"), environ={})
    assert loaded.config.tools.sandbox == "auto"
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        shell = app.conversations.runner.registry
        assert shell.notes("shell") == ("This command runs unsandboxed on this host.",)
        request = await app.service.open(
            "shell", {"command": "ls"}, "agent:b", "web:console", notes=shell.notes("shell")
        )
        card = build_card(request, value_limit=500, public_url="http://127.0.0.1:8765")
        assert card.warnings[0] == "This command runs unsandboxed on this host."
    finally:
        await app.stop()
    doctor = check_sandbox(loaded)
    assert doctor.level is Level.WARN
    assert doctor.detail == (
        "shell commands run unsandboxed on this host (every shell card says so) ('bwrap' was not found on PATH): "
        "install bubblewrap (apt-get install bubblewrap) or set tools.sandbox: none to accept it"
    )


@needs_bwrap
async def test_auto_with_bubblewrap_runs_sandboxed_and_the_card_says_nothing_of_it(tmp_path: Path) -> None:
    loaded = load_config_text(config_text(tmp_path / "state", "auto"), environ={})
    app = await build_app(loaded, provider=ScriptedProvider([]), adapters=[])
    try:
        assert app.conversations.runner.registry.notes("shell") == ()
    finally:
        await app.stop()
    doctor = check_sandbox(loaded)
    assert doctor.level is Level.OK
    assert doctor.detail == "shell commands run in bubblewrap (network off)"
