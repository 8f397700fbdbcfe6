"""`kazma init`: a first kazma.yaml in which the operator is an approver everywhere, from flags or answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kazma.bot.cli.cli_identity import system_login
from kazma.bot.cli.init_config import InitAnswers, Presence, render
from kazma.config import ConfigError, load_config, load_config_text
from kazma.config.platforms import console_warnings
from tests.test_cli import CLEAN_ENV, run

TOKENS = {
    "TELEGRAM_BOT_TOKEN": "123456:abcdefghijklmnop",
    "SLACK_BOT_TOKEN": "xoxb-1-2-abc",
    "SLACK_APP_TOKEN": "xapp-1-A1-abc",
    "SLACK_SIGNING_SECRET": "0123456789abcdef",
    "DISCORD_BOT_TOKEN": "MTEw.abc.def",
}
EVERYWHERE = [
    "--platform", "telegram", "--telegram-user", "111", "--telegram-chat", "-1001234567890",
    "--platform", "slack", "--slack-user", "U0111AAAA", "--slack-channel", "C0HOME0001",
    "--platform", "discord", "--discord-user", "222", "--discord-channel", "333",
    "--web-login", "alice", "--public-url", "https://kazma.example.org/", "--no-input",
]  # fmt: skip


def test_flags_write_a_file_where_the_operator_is_an_approver_everywhere(tmp_path: Path) -> None:
    result = run(["init", *EVERYWHERE], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    written = tmp_path / "kazma.yaml"
    text = written.read_text()
    # secrets are references, never values; and nothing starts without them
    for name in ("TELEGRAM_BOT_TOKEN", "SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "DISCORD_BOT_TOKEN"):
        assert f"${{{name}}}" in text
    with pytest.raises(ConfigError) as missing:
        load_config(written, environ={})
    assert "environment variable TELEGRAM_BOT_TOKEN is not set" in "\n".join(missing.value.lines)

    config = load_config(written, environ=TOKENS).config
    roster = config.roster
    for actor, platform in [
        ("web:alice", "web"),
        ("telegram:111", "telegram"),
        ("slack:U0111AAAA", "slack"),
        ("discord:222", "discord"),
    ]:
        assert roster.is_approver(actor, platform), actor
        assert roster.is_operator(actor, platform), actor
    # one person with four identities may steer the swarm (and the file says why it allows that)
    # one person with four identities is one operator: the swarm's steering needs no sharing between people
    assert config.roster.human_operators() == {"alice"}
    assert config.swarm.allow_shared_operators is False
    # chats are explicit: the home chat and nothing else
    assert config.platforms.telegram.chats == [-1001234567890]
    assert config.platforms.telegram.home_chat == -1001234567890
    assert config.platforms.slack.channels == ["C0HOME0001"]
    assert config.platforms.discord.channels == [333]
    assert config.platforms.slack.app_token == TOKENS["SLACK_APP_TOKEN"]  # Socket Mode unless asked otherwise
    assert config.web.public_url == "https://kazma.example.org"
    assert config.web.trusted_proxies == ["127.0.0.1/32", "::1/128"]  # the TLS proxy on this machine names who logs in
    assert console_warnings(config) == []
    assert text.count("\n#") + text.count("  # ") > 20  # it is commented

    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"Wrote {Path('kazma.yaml')}: you are alice, an approver as web:alice, telegram:111, slack:U0111AAAA, "
        f"discord:222, cli:{system_login()}."
    )
    assert lines[1] == "Next:"
    commands = [line.split("#")[0].strip() for line in lines[2:]]
    assert commands == [
        "export TELEGRAM_BOT_TOKEN=… SLACK_BOT_TOKEN=… DISCORD_BOT_TOKEN=… SLACK_APP_TOKEN=…",
        "kazma doctor",
        "kazma people invite alice",
        "kazma run",
    ]
    assert "sign in at https://kazma.example.org/login with that passkey" in lines[5]


def test_config_check_of_the_written_file_has_no_warning(tmp_path: Path) -> None:
    assert run(["init", *EVERYWHERE], cwd=tmp_path).returncode == 0
    checked = run(["config", "check"], cwd=tmp_path, env=TOKENS)
    assert checked.returncode == 0, checked.stderr
    assert "warn" not in checked.stdout
    assert "telegram  on" in checked.stdout
    assert "slack     on   Socket Mode" in checked.stdout


def test_it_never_overwrites_without_force(tmp_path: Path) -> None:
    mine = tmp_path / "kazma.yaml"
    mine.write_text("# my own configuration\n")
    refused = run(["init", "--web-login", "bob", "--no-input"], cwd=tmp_path)
    assert refused.returncode == 1
    assert "kazma.yaml already exists; nothing was written (--force adds to it, keeping a copy)" in refused.stderr
    assert mine.read_text() == "# my own configuration\n"
    other = tmp_path / "elsewhere.yaml"
    other.write_text("# another\n")
    assert run(["-c", str(other), "init", "--no-input"], cwd=tmp_path).returncode == 1
    assert other.read_text() == "# another\n"
    forced = run(["init", "--web-login", "bob", "--no-input", "--force"], cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    config = load_config(mine, environ={}).config
    assert config.approvals.approvers == ["bob"]
    assert config.people.persons == {"bob": ("web:bob", f"cli:{system_login()}")}
    assert config.swarm.allow_shared_operators is False  # one identity: nothing to share
    assert "held no settings to keep: written anew" in forced.stdout  # only a comment: the backup keeps it
    shown = forced.stdout.splitlines()
    commands = [line.split("#")[0].strip() for line in shown[shown.index("Next:") + 1 :]]
    assert commands == ["kazma config check", "kazma doctor", "kazma people invite bob", "kazma run"]


def test_a_path_argument_and_a_config_flag_show_up_in_the_next_commands(tmp_path: Path) -> None:
    result = run(["init", str(tmp_path / "conf" / "team.yaml"), "--web-login", "ops", "--no-input"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "conf" / "team.yaml").exists()
    assert f"kazma -c {tmp_path / 'conf' / 'team.yaml'} doctor" in result.stdout


def test_bad_flags_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    bad_user = run(["init", "--platform", "telegram", "--telegram-user", "alice", "--no-input"], cwd=tmp_path)
    assert bad_user.returncode == 2
    assert "--telegram-user: a Telegram user id is a number" in bad_user.stderr
    missing = run(["init", "--platform", "discord", "--no-input"], cwd=tmp_path)
    assert missing.returncode == 2
    assert "--discord-user is required here (or run `kazma init` on a terminal to be asked)" in missing.stderr
    bad_chat = run(
        ["init", "--platform", "slack", "--slack-user", "U0111AAAA", "--slack-channel", "general", "--no-input"],
        cwd=tmp_path,
    )
    assert bad_chat.returncode == 2
    assert "a Slack channel id is C, G or D" in bad_chat.stderr
    assert not (tmp_path / "kazma.yaml").exists()


def test_on_a_terminal_it_asks_and_asks_again_after_a_wrong_answer(tmp_path: Path) -> None:
    answers = "\n".join(
        [
            "telegram, slack",  # platforms
            "carol",  # console login
            "not-a-number",  # Telegram user id: refused, asked again
            "111",
            "",  # the Telegram chat: not known yet
            "U0CAROL01",  # Slack member id
            "C0HOME0001",  # Slack channel
            "http",  # Slack transport
            "https://kazma.example.org",  # public URL
            "",  # model server: the default
        ]
    )
    result = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "init", "--interactive"],
        cwd=tmp_path,
        input=answers + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=CLEAN_ENV,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Error: a Telegram user id is a number" in result.stdout  # said, then asked again
    config = load_config(tmp_path / "kazma.yaml", environ=TOKENS).config
    assert config.approvals.approvers == ["carol"]
    assert config.people.persons == {"carol": ("web:carol", "telegram:111", "slack:U0CAROL01", f"cli:{system_login()}")}
    assert config.platforms.telegram.home_chat is None  # not known yet, and the file says how to find it
    assert (
        "the platform.inbound_ignored log event (platform=telegram) shows its id"
        in (tmp_path / "kazma.yaml").read_text()
    )
    assert config.platforms.slack.signing_secret == TOKENS["SLACK_SIGNING_SECRET"]  # HTTP events
    assert config.platforms.slack.app_token == ""
    assert config.model.base_url == "http://127.0.0.1:11434/v1"


def test_render_refuses_a_login_the_console_would_not_accept() -> None:
    with pytest.raises(ValueError, match="a console login is 1 to 32"):
        render(InitAnswers("alice smith"))


def test_rendered_ids_are_read_back_exactly() -> None:
    text = render(InitAnswers("a.b-c_d", discord=Presence("1100000000000000301", "1100000000000000101")))
    config = load_config_text(text, environ=TOKENS).config
    assert config.platforms.discord.admins == [1100000000000000301]
    assert config.platforms.discord.home_channel == 1100000000000000101
    assert config.approvals.approvers == ["a-b-c_d"]
    assert config.people.persons == {"a-b-c_d": ("web:a.b-c_d", "discord:1100000000000000301")}


@pytest.mark.parametrize(
    ("mine", "said"),
    [
        # a typo was "held no settings to keep: written anew": every setting replaced, the copy the only trace
        (
            b"web: {port: 9001\n",
            "kazma.yaml: line 2, column 1: invalid YAML: expected ',' or '}', but got '<stream end>'",
        ),
        (b"web: {port: 1}\nweb: {port: 2}\n", "kazma.yaml: line 2, column 1: invalid YAML: found duplicate key"),
        (b"web: {port: \xff}\n", "kazma.yaml cannot be read ('utf-8' codec can't decode byte 0xff"),  # a traceback
    ],
)
def test_force_on_a_file_it_cannot_read_says_why_and_changes_nothing(
    tmp_path: Path, mine: bytes, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from kazma.bot.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kazma.yaml").write_bytes(mine)
    result = CliRunner().invoke(main, ["init", "--web-login", "bob", "--no-input", "--force"])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2
    assert result.stderr.startswith(said), result.stderr
    assert result.stderr.rstrip().endswith("nothing was written")
    assert (tmp_path / "kazma.yaml").read_bytes() == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kazma.yaml"]  # no copy made either


def test_two_forced_runs_in_one_second_keep_both_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both copies were named by the second: the second overwrote the first, which held the original file.
    from datetime import datetime, tzinfo

    from click.testing import CliRunner

    from kazma.bot.cli import init_cli, main

    class Frozen(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> Frozen:
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(init_cli, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kazma.yaml").write_text("web: {port: 9001}\n")
    for login in ("bob", "bob"):
        result = CliRunner().invoke(main, ["init", "--web-login", login, "--no-input", "--force"])
        assert result.exit_code == 0, result.output
    assert (tmp_path / "kazma.yaml.20260102-030405.bak").read_text() == "web: {port: 9001}\n"
    assert (tmp_path / "kazma.yaml.20260102-030405-2.bak").read_text() != "web: {port: 9001}\n"


def test_matrix_from_flags_writes_a_file_instead_of_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Matrix has one way its events arrive (sync), so no --matrix-mode flag exists: init read that flag's value
    # all the same and `kazma init --platform matrix` ended in KeyError: 'matrix_mode', on a terminal or not.
    from click.testing import CliRunner

    from kazma.bot.cli import main

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        main,
        ["init", "--platform", "matrix", "--matrix-user", "@alice:example.org", "--matrix-room", "!room:example.org",
         "--web-login", "alice", "--no-input"],
    )  # fmt: skip
    assert result.exception is None, result.exception
    assert result.exit_code == 0, result.output
    text = (tmp_path / "kazma.yaml").read_text()
    assert "${MATRIX_ACCESS_TOKEN}" in text
    config = load_config(
        tmp_path / "kazma.yaml", environ={"MATRIX_ACCESS_TOKEN": "t", "MATRIX_HOMESERVER": "https://m.example.org"}
    ).config
    assert config.roster.is_approver("matrix:@alice:example.org", "matrix")


def test_force_names_the_public_url_the_file_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --force keeps the file's settings, web.public_url with them; it then said "sign in at <the flag's URL>",
    # a console the file does not link to, and "these answers add nothing" without a word about the URL left out.
    from click.testing import CliRunner

    from kazma.bot.cli import main

    monkeypatch.chdir(tmp_path)
    first = ["init", "--web-login", "alice", "--no-input", "--public-url", "https://a.example.org"]
    assert CliRunner().invoke(main, first).exit_code == 0
    again = CliRunner().invoke(
        main, ["init", "--web-login", "alice", "--no-input", "--force", "--public-url", "https://b.example.org"]
    )
    assert again.exit_code == 0, again.output
    assert load_config(tmp_path / "kazma.yaml", environ={}).config.web.public_url == "https://a.example.org"
    assert (
        "Kept web.public_url: https://a.example.org, as your file says; --public-url https://b.example.org was not "
        "applied: change web.public_url in kazma.yaml if it should be"
    ) in again.stdout
    assert "then sign in at https://a.example.org/login with that passkey" in again.stdout
    assert "b.example.org/login" not in again.stdout
    same = CliRunner().invoke(
        main, ["init", "--web-login", "alice", "--no-input", "--force", "--public-url", "https://a.example.org/"]
    )
    assert same.exit_code == 0
    assert "Kept web.public_url" not in same.stdout  # the same URL, as Kazma reads it: nothing was left out


def test_force_without_web_login_keeps_the_login_the_file_gives_you(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --force without --web-login answered with the system user's name: a second person claiming cli:<login>,
    # which the file gives to alice, and "cli:root is claimed twice" with nothing written and no word on what to do.
    from click.testing import CliRunner

    from kazma.bot.cli import main

    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, ["init", "--web-login", "alice", "--no-input"]).exit_code == 0
    again = CliRunner().invoke(main, ["init", "--no-input", "--force", "--public-url", "https://b.example.org"])
    assert again.exit_code == 0, again.output
    assert f"you are alice, an approver as web:alice, cli:{system_login()}" in again.stdout
    assert set(load_config(tmp_path / "kazma.yaml", environ={}).config.people.persons) == {"alice"}
    # another login named on purpose still clashes with the file: the refusal says who the file says you are
    other = CliRunner().invoke(main, ["init", "--no-input", "--force", "--web-login", "bob"])
    assert other.exit_code == 2
    assert "you are web:alice in kazma.yaml: leave --web-login out, or pass --web-login alice" in other.stderr


def test_a_public_url_scheme_in_any_case_is_an_http_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # HTTPS://… was refused as "an http(s) URL, e.g. https://kazma.example.org": schemes are case-insensitive.
    from click.testing import CliRunner

    from kazma.bot.cli import main

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        main, ["init", "--web-login", "alice", "--no-input", "--public-url", "HTTPS://A.example.org/"]
    )
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "kazma.yaml", environ={}).config
    assert config.web.public_url == "https://A.example.org"
    assert config.web.trusted_proxies  # an https:// console: the TLS proxy's address, as for https://
    assert "then sign in at https://A.example.org/login" in result.stdout
