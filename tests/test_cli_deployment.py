"""The command line against a real deployment: run from any folder, without the platforms' secrets where it never
talks to a platform, as the operator `kazma init` made an approver, and `init --force` keeping a person's edits.
A second `kazma run` on a busy port says so in one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml

from kazma.approvals import Status
from kazma.bot.cli.cli_identity import system_login
from kazma.config import load_config
from tests.approvals_support import approval_service
from tests.test_cli import CLEAN_ENV

ARGS = {"command": "deploy --prod"}
SECRET_PLATFORMS = """platforms:
  telegram:
    token: ${TELEGRAM_BOT_TOKEN}
    chats: [-1001]
    home_chat: -1001
    admins: [111]
  slack:
    bot_token: ${SLACK_BOT_TOKEN}
    app_token: ${SLACK_APP_TOKEN}
    home_channel: C0HOME0001
  discord:
    token: ${DISCORD_BOT_TOKEN}
    home_channel: 1100000000000000101
"""


def kazma(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", *args],
        cwd=cwd,
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


async def _pending(db: Path) -> str:
    async with approval_service(db, keyring=None) as service:
        request = await service.open("shell", ARGS, "agent:builder", "web:ops")
        return request.id


async def test_a_relative_store_path_is_the_config_files_folders_from_any_folder(tmp_path: Path) -> None:
    conf, elsewhere = tmp_path / "deploy", tmp_path / "elsewhere"
    conf.mkdir()
    elsewhere.mkdir()
    (conf / "kazma.yaml").write_text("store: {path: state/kazma.db}\napprovals: {approvers: ['web:ops']}\n")
    request_id = await _pending(conf / "state" / "kazma.db")

    listed = kazma("-c", "../deploy/kazma.yaml", "approvals", "list", "--log-level", "warning", cwd=elsewhere)
    assert listed.returncode == 0, listed.stderr
    assert request_id in listed.stdout
    assert "no approval requests" not in listed.stdout
    assert not (elsewhere / "state").exists()  # no new, empty store beside the command
    # the same from the file's own folder, through $KAZMA_CONFIG
    here = kazma("approvals", "list", cwd=conf, env={"KAZMA_CONFIG": "kazma.yaml"})
    assert request_id in here.stdout


def test_kazma_base_dir_names_the_folder_relative_paths_start_from(tmp_path: Path) -> None:
    """The Docker image and the systemd unit keep kazma.yaml on a read-only /etc/kazma, the state elsewhere."""
    conf, state = tmp_path / "etc", tmp_path / "var"
    conf.mkdir()
    (conf / "kazma.yaml").write_text(
        "store: {path: .kazma/kazma.db}\ntools: {workspace_root: work}\naudit: {sink: {file: audit/log.jsonl}}\n"
    )
    config = load_config(conf / "kazma.yaml", environ={}).config
    assert config.store.path == conf / ".kazma" / "kazma.db"
    assert config.tools.workspace_root == conf / "work"
    assert config.audit.sink is not None
    assert config.audit.sink.file == conf / "audit" / "log.jsonl"
    moved = load_config(conf / "kazma.yaml", environ={"KAZMA_BASE_DIR": str(state)}).config
    assert moved.store.path == state / ".kazma" / "kazma.db"
    assert moved.tools.workspace_root == state / "work"
    assert moved.audit.sink is not None
    assert moved.audit.sink.file == state / "audit" / "log.jsonl"
    absolute = tmp_path / "abs.db"
    (conf / "kazma.yaml").write_text(f"store: {{path: '{absolute}'}}\n")
    assert load_config(conf / "kazma.yaml", environ={}).config.store.path == absolute


def test_commands_that_never_talk_to_a_platform_need_no_platform_secret(tmp_path: Path) -> None:
    (tmp_path / "kazma.yaml").write_text(
        f"store: {{path: '{tmp_path}/state/kazma.db'}}\npeople: {{ops: {{web: ops}}}}\n"
        "approvals: {approvers: [ops]}\n" + SECRET_PLATFORMS
    )
    quiet = ("--log-level", "warning")
    for command in (
        ("people", "invite", "ops"),  # first, as in the first steps: it makes the store the others read
        ("approvals", "list"),
        ("approvals", "rules", "list"),
        ("keys", "rotate"),
        ("keys", "list"),
        ("people", "list"),
        ("swarm", "status"),
        ("setup", "slack-manifest"),
    ):
        done = kazma(*command, *quiet, cwd=tmp_path)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert "is not set" not in done.stderr, command
    # the commands that do talk to platforms still say exactly what is missing, one line per secret
    for needing in (["run"], ["config", "check"]):
        refused = kazma(*needing, *quiet, cwd=tmp_path)
        assert refused.returncode == 2, (needing, refused.stderr)
        assert "platforms.telegram.token: environment variable TELEGRAM_BOT_TOKEN is not set" in refused.stderr
        assert "Traceback" not in refused.stderr
    invite = kazma("setup", "discord-invite", *quiet, cwd=tmp_path)
    assert invite.returncode == 2
    assert "give --client-id" in invite.stderr
    assert "or export DISCORD_BOT_TOKEN so it can be asked from Discord" in " ".join(invite.stderr.split())


async def test_init_makes_the_operator_an_approver_at_the_command_line(tmp_path: Path) -> None:
    written = kazma("init", "--web-login", "alice", "--no-input", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    me = system_login()
    assert f"cli:{me}" in written.stdout
    config = load_config(tmp_path / "kazma.yaml", environ={}).config
    assert config.roster.is_approver(f"cli:{me}", "cli")
    request_id = await _pending(tmp_path / ".kazma" / "kazma.db")
    # what the README says to do next
    approved = kazma("approvals", "approve", request_id, "--log-level", "warning", cwd=tmp_path)
    assert approved.returncode == 0, approved.stdout + approved.stderr
    assert "not an approver" not in approved.stdout + approved.stderr
    async with approval_service(tmp_path / ".kazma" / "kazma.db", keyring=None) as service:
        decided = await service.store.get(request_id)
    assert decided is not None
    assert (decided.status, decided.decided_by) == (Status.APPROVED, f"cli:{me}")


def test_init_force_keeps_the_persons_edits_adds_the_new_platform_and_keeps_a_copy(tmp_path: Path) -> None:
    first = kazma(
        "init", "--web-login", "alice", "--platform", "telegram", "--telegram-user", "111",
        "--telegram-chat", "-1001234567890", "--no-input", cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    path = tmp_path / "kazma.yaml"
    mine = path.read_text()
    mine = mine.replace("  port: 8765", "  port: 9876  # ours: 8765 is taken here")
    mine = mine.replace("    - alice  #", "    - telegram:222  # bob, on call\n    - alice  #")
    mine += f"\napi:\n  tokens:\n    deployer: {{token: '{'d' * 40}', roles: [approval_requester]}}\n"
    path.write_text(mine)

    again = kazma(
        "init", "--force", "--web-login", "alice", "--platform", "discord", "--discord-user", "333",
        "--discord-channel", "444", "--no-input", cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    backups = sorted(tmp_path.glob("kazma.yaml.*.bak"))
    assert len(backups) == 1
    assert backups[0].read_text() == mine  # the file as it was, byte for byte
    assert f"Kept a copy of the old file: {backups[0].relative_to(tmp_path)}" in again.stdout
    assert "added people.alice.discord" in again.stdout
    assert "platforms.discord" in again.stdout

    merged = path.read_text()
    assert "# ours: 8765 is taken here" in merged  # their comments too
    raw = yaml.safe_load(merged)
    assert raw["web"]["port"] == 9876
    assert raw["api"]["tokens"]["deployer"]["roles"] == ["approval_requester"]
    assert raw["approvals"]["approvers"] == ["telegram:222", "alice"]
    assert set(raw["platforms"]) == {"telegram", "discord"}  # the new platform merged in, the old one kept
    assert raw["platforms"]["discord"]["home_channel"] == 444
    assert raw["people"]["alice"]["telegram"] == 111
    assert raw["people"]["alice"]["discord"] == 333
    tokens = {"TELEGRAM_BOT_TOKEN": "1:abc", "DISCORD_BOT_TOKEN": "MTEw.abc.def"}
    config = load_config(path, environ=tokens).config
    assert config.web.port == 9876
    assert config.roster.is_approver("discord:333", "discord")

    # a file that is not settings at all: written anew, and still copied first
    path.write_text("# just a note\n")
    third = kazma("init", "--force", "--web-login", "bob", "--no-input", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert any(b.read_text() == "# just a note\n" for b in tmp_path.glob("kazma.yaml.*.bak"))
    assert load_config(path, environ={}).config.approvals.approvers == ["bob"]


def test_a_second_run_on_a_busy_port_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "kazma.yaml").write_text(
            f"store: {{path: '{tmp_path}/state/kazma.db'}}\nweb: {{port: {port}}}\n"
            "approvals: {approvers: ['web:ops']}\n"
        )
        second = kazma("run", "--log-level", "error", cwd=tmp_path)
    assert second.returncode == 1
    assert "Traceback" not in second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert f"127.0.0.1:{port} is already in use" in lines[0]
    assert "another `kazma run`" in lines[0]
