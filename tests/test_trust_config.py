"""Configuration footguns at the trust boundary: a tool name that is not a tool, a dangerous tool lowered without
saying so, workspaces beside the store, every chat served. Errors name their path; allowed risks are warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from kazma.config import ConfigError, DangerLevel, load_config_text
from tests.test_cli import run


def problem(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, environ={})
    (line,) = caught.value.lines
    return line


def test_an_agent_listing_a_tool_that_does_not_exist_is_an_error_naming_it() -> None:
    line = problem("pipelines: {}\nagents: {workers: {builder: {system_prompt: b, tools: [shell, shel]}}}")
    assert line == (
        "kazma.yaml: agents.workers.builder.tools[1]: unknown tool 'shel' "
        "(known tools: http_get, read_file, send_file, shell, write_file)"
    )
    lead = problem("agents: {lead: {tools: [read_file, rm_rf]}}")
    assert lead.startswith("kazma.yaml: agents.lead.tools[1]: unknown tool 'rm_rf' (known tools: ")
    # a tool the team classified is a known tool
    loaded = load_config_text("tools: {deploy: dangerous}\nagents: {lead: {tools: [deploy]}}", environ={})
    assert loaded.config.agents.lead.tools == ["deploy"]


def test_lowering_a_dangerous_builtin_needs_allow_unapproved(tmp_path: Path) -> None:
    line = problem("tools: {shell: write}")
    assert line.startswith("kazma.yaml: tools.shell: shell runs on this host without anyone approving it")
    assert "tools.allow_unapproved" in line
    assert problem("tools: {write_file: read}").startswith("kazma.yaml: tools.write_file: ")

    accepted = "tools: {shell: write, allow_unapproved: [shell]}\n"
    config = load_config_text(accepted, environ={}).config
    assert config.danger_level("shell") is DangerLevel.WRITE
    assert config.warnings() == ["tools.shell is write: it runs on this host without approval (tools.allow_unapproved)"]
    path = tmp_path / "kazma.yaml"
    path.write_text(f"store: {{path: '{tmp_path / 'state' / 'k.db'}'}}\n" + accepted)
    checked = run(["config", "check", str(path)], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "  warning: tools.shell is write: it runs on this host without approval" in checked.stdout


def test_allow_unapproved_names_only_builtin_tools() -> None:
    line = problem("tools: {allow_unapproved: [shell, nope]}")
    assert line.startswith("kazma.yaml: tools.allow_unapproved[1]: 'nope' is not a built-in tool")
    assert "write_file, shell" in line
    # naming a dangerous tool there without lowering it is allowed, and nothing runs unapproved
    config = load_config_text("tools: {allow_unapproved: [shell]}", environ={}).config
    assert config.danger_level("shell") is DangerLevel.DANGEROUS
    assert config.warnings() == []


def test_serving_every_chat_is_warned_about_in_config_check_and_doctor(tmp_path: Path) -> None:
    path = tmp_path / "kazma.yaml"
    path.write_text(
        f"store: {{path: '{tmp_path / 'state' / 'k.db'}'}}\n"
        "model: {base_url: 'http://127.0.0.1:9/v1'}\n"  # nothing listens there: the model check fails fast
        "platforms: {telegram: {token: '1:abc', chats: ['*'], home_chat: -1001, admins: [111],"
        " api_base_url: 'http://127.0.0.1:9'}}\n"  # doctor asks Telegram on loopback, never on the internet
    )
    warning = "platforms.telegram.chats has '*': every chat the bot is added to is served, by anyone in it"
    checked = run(["config", "check", str(path)], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert f"  warning: {warning}" in checked.stdout
    doctor = run(["-c", str(path), "doctor", "--model-timeout", "1"], cwd=tmp_path)
    assert f"WARN  config            {warning}" in doctor.stdout, doctor.stdout

    # without a token the platform is off and the '*' serves nobody: no warning
    off = load_config_text("platforms: {telegram: {chats: ['*']}}", environ={}).config
    assert off.warnings() == []


def test_workspaces_inside_the_stores_folder_are_an_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = f"store: {{path: '{state / 'k.db'}'}}\n"
    for inside in (state, state / "workspaces", state / "deep" / "er"):
        line = problem(store + f"tools: {{workspace_root: '{inside}'}}")
        assert line == (
            f"kazma.yaml: tools.workspace_root: the workspaces must be outside the store's folder {state}: "
            "a tool could reach the store"
        )
    # a path that only resolves into it (through '..') is caught too
    sneaky = problem(store + f"tools: {{workspace_root: '{tmp_path / 'elsewhere' / '..' / 'state' / 'ws'}'}}")
    assert sneaky.startswith("kazma.yaml: tools.workspace_root: the workspaces must be outside")
    beside = load_config_text(store + f"tools: {{workspace_root: '{tmp_path / 'ws'}'}}", environ={}).config
    assert beside.tools.workspaces(beside.store.path) == tmp_path / "ws"
