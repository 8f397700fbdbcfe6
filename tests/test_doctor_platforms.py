"""`kazma doctor` asks each platform (the wire-level fakes here) and names every problem with its fix."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kazma.bot.cli.checks import Check, Level
from kazma.bot.cli.doctor import run_checks
from kazma.bot.cli.platform_checks import check_platforms
from kazma.config import load_config_text
from kazma.config.errors import ConfigError
from kazma.config.platforms import console_warnings
from kazma.config.registry.discord import token_problem as discord_token_problem
from kazma.config.registry.slack import app_token_problem as slack_app_token_problem
from kazma.config.registry.slack import bot_token_problem as slack_bot_token_problem
from kazma.config.registry.telegram import token_problem as telegram_token_problem
from tests.fakes.discord import ATTACH_FILES, BOT_ID, BOT_ROLE_ID, GUILD_ID, HOME_CHANNEL_ID, VIEW_CHANNEL, FakeDiscord
from tests.fakes.openai import FakeOpenAI
from tests.fakes.slack import DEFAULT_SCOPES, FAKE_APP_TOKEN, FAKE_BOT_TOKEN, FAKE_SIGNING_SECRET, FakeSlack, FaultKind
from tests.fakes.telegram import FakeTelegram
from tests.platforms_support import Fakes, three_fakes
from tests.test_cli import CLEAN_ENV


def platforms_yaml(
    fakes: Fakes,
    *,
    telegram: str | None = None,
    slack: str = FAKE_BOT_TOKEN,
    slack_app: str = "",
    discord: str | None = None,
    slack_url: str | None = None,
) -> str:
    app = f"    app_token: '{slack_app}'\n" if slack_app else f"    signing_secret: '{FAKE_SIGNING_SECRET}'\n"
    return f"""platforms:
  telegram:
    token: '{fakes.telegram.token if telegram is None else telegram}'
    api_base_url: '{fakes.telegram.base_url}'
    chats: [-1001]
    home_chat: -1001
    admins: [111]
  slack:
    bot_token: '{slack}'
{app}    api_base_url: '{slack_url or fakes.slack.api_url}'
    http: {{port: 0}}
    home_channel: C0HOME0001
    admins: [U0ADMIN01]
  discord:
    token: '{fakes.discord.token if discord is None else discord}'
    api_base_url: '{fakes.discord.api_base}'
    gateway_url: '{fakes.discord.gateway_url}'
    home_channel: 1100000000000000101
    admins: [1100000000000000301]
"""


def lines(checks: list[Check], level: Level) -> list[str]:
    return [f"{c.name} {c.detail}" for c in checks if c.level is level]


async def ask(yaml: str) -> dict[str, list[Check]]:
    return await check_platforms(load_config_text(yaml, environ={}), timeout=5)


async def test_good_tokens_pass_every_platform_check() -> None:
    async with three_fakes() as fakes:
        answers = await ask(platforms_yaml(fakes, slack_app=FAKE_APP_TOKEN))
    checks = [c for found in answers.values() for c in found]
    assert lines(checks, Level.FAIL) == []
    assert lines(checks, Level.WARN) == []
    ok = lines(checks, Level.OK)
    assert "platform.telegram token accepted: @kazma_bot; privacy mode on: in groups it sees commands, " in ok[0]
    assert any(line.startswith("platform.slack token accepted: kazma in Kazma Fake") for line in ok)
    assert "platform.slack scopes granted: every one Kazma needs" in ok
    assert "platform.slack app token accepted: Socket Mode can connect" in ok
    discord_ok = "platform.discord token accepted: kazma (application 1100000000000000201"
    assert any(line.startswith(discord_ok) for line in ok)


async def test_tokens_the_platforms_refuse_are_named_with_their_fix() -> None:
    async with three_fakes() as fakes:
        answers = await ask(
            platforms_yaml(
                fakes, telegram="123456:wrong-but-well-shaped", slack="xoxb-not-the-one", discord="not.the.token"
            )
        )
    assert [(c.level, c.detail) for c in answers["telegram"]] == [
        (
            Level.FAIL,
            "platforms.telegram.token was refused by Telegram (401 Unauthorized): copy it again from @BotFather "
            "(/mybots → API Token)",
        )
    ]
    assert [c.detail for c in answers["slack"]] == [
        "platforms.slack.bot_token was refused by Slack (invalid_auth): reinstall the app to the workspace and "
        "copy the Bot User OAuth Token (xoxb-) from OAuth & Permissions"
    ]
    assert [c.detail for c in answers["discord"]] == [
        "platforms.discord.token was refused by Discord (401 Unauthorized): Developer Portal → your application → "
        "Bot → Reset Token, and copy the new one"
    ]


async def test_a_missing_scope_a_refused_app_token_and_the_intent_off_are_failures() -> None:
    telegram, slack, discord = (
        FakeTelegram(),
        FakeSlack(scopes=("chat:write", "commands")),
        FakeDiscord(message_content_intent=False),
    )
    await asyncio.gather(telegram.start(), slack.start(), discord.start())
    try:
        fakes = Fakes(telegram, slack, discord)
        answers = await ask(platforms_yaml(fakes, slack_app="xapp-1-not-this-one"))
    finally:
        await asyncio.gather(telegram.stop(), slack.stop(), discord.stop())
    slack_failures = lines(answers["slack"], Level.FAIL)
    assert slack_failures == [
        "platform.slack the bot token lacks the scopes app_mentions:read, channels:history, groups:history: add them "
        "under OAuth & Permissions → Bot Token Scopes (or create the app from `kazma setup slack-manifest`) and "
        "reinstall the app",
        "platform.slack platforms.slack.app_token was refused by Slack (invalid_auth): create an app-level token "
        "with connections:write under Basic Information → App-Level Tokens",
    ]
    assert lines(answers["discord"], Level.FAIL) == [
        "platform.discord the Message Content intent is off, and Discord refuses a connection that asks for it: "
        "Developer Portal → your application → Bot → Privileged Gateway Intents → Message Content Intent"
    ]


async def test_only_the_optional_scope_missing_is_said_but_not_a_failure() -> None:
    async with three_fakes() as fakes:
        fakes.slack.scopes = tuple(s for s in DEFAULT_SCOPES if s != "chat:write.customize")
        answers = await ask(platforms_yaml(fakes))
    assert lines(answers["slack"], Level.FAIL) == []
    assert (
        "platform.slack scopes granted: every one Kazma needs; without chat:write.customize agents post with an "
        "[agent] prefix" in lines(answers["slack"], Level.OK)
    )


async def test_an_unreachable_platform_is_one_line_without_the_token() -> None:
    async with three_fakes() as fakes:
        answers = await ask(platforms_yaml(fakes, slack_url="http://127.0.0.1:9/api/"))
    (slack,) = answers["slack"]
    assert slack.level is Level.FAIL
    assert slack.detail.startswith("unreachable (ConnectError")
    assert FAKE_BOT_TOKEN not in slack.detail


@pytest.mark.parametrize(
    ("judge", "token", "expected"),
    [
        (telegram_token_problem, "abc", "does not look like a BotFather token"),
        (telegram_token_problem, "bot123:AAE-x", "starts with 'bot'"),
        (telegram_token_problem, "123:AAE x", "contains spaces"),
        (slack_bot_token_problem, "xoxp-1-2", "is a user token (xoxp-)"),
        (slack_bot_token_problem, "xapp-1-A-2", "is the app-level token (xapp-), which belongs in app_token"),
        (slack_bot_token_problem, "hello", "is not a bot token (expected xoxb-…)"),
        (slack_app_token_problem, "xoxb-1-2", "is the bot token (xoxb-), which belongs in bot_token"),
        (discord_token_problem, "Bot MTAx.abc.def", "starts with 'Bot ': Kazma adds that prefix itself"),
        (discord_token_problem, "a" * 32, "looks like the OAuth2 client secret"),
    ],
)
def test_token_shapes_name_the_likely_mix_up(judge: object, token: str, expected: str) -> None:
    assert callable(judge)
    problem = judge(token)
    assert problem is not None
    assert expected in problem


def test_plausible_tokens_have_no_shape_problem() -> None:
    assert telegram_token_problem("123456789:AAE-abc_DEF") is None
    assert slack_bot_token_problem("xoxb-1-2-abc") is None
    assert slack_bot_token_problem("xoxe.xoxb-1-abc") is None
    assert slack_app_token_problem("xapp-1-A1-abc") is None
    assert discord_token_problem("MTEw.Gx1-ab.cdef") is None


def test_the_slack_app_token_as_bot_token_is_refused_by_name_not_as_a_missing_signing_secret() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text("platforms: {slack: {bot_token: 'xapp-1-A1-abc'}}", environ={})
    assert caught.value.lines == [
        "kazma.yaml: platforms.slack.bot_token: is the app-level token (xapp-), which belongs in app_token "
        "(SLACK_APP_TOKEN); bot_token takes the Bot User OAuth Token (xoxb-) from OAuth & Permissions"
    ]


async def test_doctor_reports_each_problem_on_one_line_with_its_fix(tmp_path: Path) -> None:
    """The issue's list: bad Telegram token, Slack user token, Discord `Bot `, no web approver, loopback URL."""
    async with three_fakes() as fakes, FakeOpenAI(models=("llama3.1",)) as model:
        config = tmp_path / "kazma.yaml"
        config.write_text(
            f"store: {{path: '{tmp_path}/state/k.db'}}\n"
            f"model: {{base_url: '{model.base_url}'}}\n"
            + platforms_yaml(fakes, telegram="abc", slack="xoxp-1-2-3", discord=f"Bot {fakes.discord.token}")
        )
        doctor = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "doctor", "--log-level", "error",
            cwd=tmp_path, env=CLEAN_ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(doctor.communicate(), timeout=60)
        # a well-formed token with a missing scope is only found by asking Slack
        fakes.slack.scopes = ("chat:write", "commands", "app_mentions:read", "channels:history")
        scoped = load_config_text(f"store: {{path: '{tmp_path}/state/k.db'}}\n" + platforms_yaml(fakes), environ={})
        answers = await check_platforms(scoped, timeout=5)
    text = out.decode()
    assert doctor.returncode == 1, text + err.decode()
    expected = [
        "FAIL  platform.telegram platforms.telegram.token does not look like a BotFather token (<bot id>:<secret>, "
        "e.g. 123456789:AAE…): copy it again from @BotFather (/mybots → API Token)",
        "FAIL  platform.slack    platforms.slack.bot_token is a user token (xoxp-): Kazma would act as that person; "
        "use the Bot User OAuth Token (xoxb-) from OAuth & Permissions",
        "FAIL  platform.discord  platforms.discord.token starts with 'Bot ': Kazma adds that prefix itself; put only "
        "the token in the setting",
        "WARN  platform.web      no web approvers: every Approve or Deny pressed in the console is refused (add a "
        "person with a console identity, people.<name>.web, to approvals.approvers; then `kazma people invite "
        "<name>`)",
        "WARN  platform.web      web.public_url is http://localhost:8765 while Telegram, Slack and Discord are on: "
        "the links on chat cards point at this machine's loopback, which nobody in a chat can open (set "
        "web.public_url to the https:// address people reach the console at; README: Running in production)",
    ]
    got = text.splitlines()
    for line in expected:
        assert line in got, f"{line!r} not in:\n{text}"
    assert text.strip().endswith("3 failed, 2 warnings"), text
    assert [c.detail for c in answers["slack"] if c.level is Level.FAIL] == [
        "the bot token lacks the scope groups:history: add it under OAuth & Permissions → Bot Token Scopes (or "
        "create the app from `kazma setup slack-manifest`) and reinstall the app"
    ]


async def test_a_clean_configuration_passes_the_whole_doctor(tmp_path: Path) -> None:
    async with three_fakes() as fakes, FakeOpenAI(models=("llama3.1",)) as model:
        loaded = load_config_text(
            f"store: {{path: '{tmp_path}/state/k.db'}}\n"
            f"model: {{base_url: '{model.base_url}'}}\n"
            "web: {public_url: 'https://kazma.example.org', trusted_proxies: ['127.0.0.1']}\n"
            "people: {alice: {web: alice}}\n"
            "approvals: {approvers: ['web:alice']}\n" + platforms_yaml(fakes),
            environ={},
        )
        checks = await run_checks(loaded, model_timeout=5, platform_timeout=5)
    assert lines(checks, Level.FAIL) == []
    assert lines(checks, Level.WARN) == []

    names = [c.name for c in checks]
    # each platform's answers follow its own status line
    assert names.index("platform.telegram") < names.index("platform.slack") < names.index("platform.discord")
    assert names.count("platform.discord") == 3  # on; token accepted; the home channel
    ok = lines(checks, Level.OK)
    assert "platform.telegram home_chat -1001 (Group -1001): the bot is in it (member) and may post" in ok
    assert "platform.slack home_channel C0HOME0001 (#channel-c0home0001): the app is in it and may post" in ok
    assert (
        "platform.discord home_channel 1100000000000000101 (#kazma-home): the bot may post there, with embeds and files"
        in ok
    )


def test_doctor_names_a_web_approver_nobody_can_enrol_as() -> None:
    """An upgrade's console approver ('web:alice' with no person): it can no longer decide, and doctor says why."""
    config = load_config_text("approvals: {approvers: ['web:alice', 'web:bob']}\npeople: {bob: {web: bob}}\n").config
    assert console_warnings(config) == [
        "web:alice is an approver in the console, but no person under people: has that identity: nobody can enrol a "
        "passkey for it, so it decides nothing (add people.<name>: {web: <login>}; README: Web console)"
    ]


# --------------------------------------------------------------------------- the home chat, on each platform


async def _home_checks(fakes: Fakes) -> dict[str, list[str]]:
    answers = await ask(platforms_yaml(fakes, slack_app=FAKE_APP_TOKEN))
    return {
        name: [f"{c.level.value} {c.detail}" for c in found if "home_" in c.detail] for name, found in answers.items()
    }


async def test_doctor_fails_a_home_chat_that_is_missing_or_the_bot_is_not_in_or_may_not_post_to() -> None:
    async with three_fakes() as fakes:
        fakes.telegram.bot_membership[-1001] = {"status": "left"}
        fakes.slack.channels_without_bot.add("C0HOME0001")
        fakes.discord.bot_in_guild = False
        gone = await _home_checks(fakes)

        fakes.telegram.bot_membership[-1001] = {"status": "restricted", "can_send_messages": False}
        fakes.slack.channels_without_bot.clear()
        fakes.slack.missing_channels.add("C0HOME0001")
        fakes.discord.bot_in_guild = True
        # a channel overwrite for the bot's role that takes Attach Files away (file posts then fail)
        fakes.discord.overwrites[HOME_CHANNEL_ID] = [
            {"id": str(BOT_ROLE_ID), "type": 0, "allow": "0", "deny": str(ATTACH_FILES)}
        ]
        muted = await _home_checks(fakes)

        fakes.telegram.bot_membership.clear()
        fakes.slack.missing_channels.clear()
        fakes.slack.scopes = tuple(s for s in DEFAULT_SCOPES if s not in ("channels:read", "groups:read"))
        # @everyone denied View Channels on the channel, but the bot's member overwrite allows it back
        fakes.discord.overwrites[HOME_CHANNEL_ID] = [
            {"id": str(GUILD_ID), "type": 0, "allow": "0", "deny": str(VIEW_CHANNEL | ATTACH_FILES)},
            {"id": str(BOT_ID), "type": 1, "allow": str(VIEW_CHANNEL | ATTACH_FILES), "deny": "0"},
        ]
        fine = await _home_checks(fakes)

    assert gone["telegram"] == [
        "fail home_chat -1001: Telegram says 'Bad Request: chat not found': add the bot to that group (or fix the id: "
        "the platform.inbound_ignored log event shows the ids of chats it is in)"
    ]
    assert gone["slack"] == [
        "fail home_channel C0HOME0001 (#channel-c0home0001): the app is not in it: /invite the app in that channel"
    ]
    assert gone["discord"] == [
        "fail home_channel 1100000000000000101: the bot cannot see it: invite it to that server with `kazma setup "
        "discord-invite`, or let its role view the channel"
    ]
    assert muted["telegram"] == ["fail home_chat -1001 (Group -1001): the bot may not send messages there"]
    assert muted["slack"][0].startswith("fail home_channel C0HOME0001: Slack knows no such channel the app can see")
    assert muted["discord"] == [
        "fail home_channel 1100000000000000101 (#kazma-home): the bot lacks Attach Files (post files and cut calls "
        "whole): grant them to its role on that channel (Edit Channel → Permissions)"
    ]
    assert fine["telegram"][0].startswith("ok ")
    assert fine["slack"][0].startswith("warn home_channel C0HOME0001: not checked: the bot token lacks channels:read")
    assert fine["discord"][0].startswith("ok ")


# --------------------------------------------------------------------------- the whole doctor, as a command


def _doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "-c", str(tmp_path / "kazma.yaml"), "doctor", *args],
        cwd=tmp_path, env=CLEAN_ENV, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip


def _unset_secret_config(tmp_path: Path, model_url: str) -> None:
    (tmp_path / "kazma.yaml").write_text(
        f"store: {{path: '{tmp_path}/state/k.db'}}\nmodel: {{base_url: '{model_url}'}}\n"
        "people: {alice: {web: alice}}\napprovals: {approvers: [alice]}\n"
        "platforms:\n  telegram: {token: '${TELEGRAM_BOT_TOKEN}', chats: [-1001], home_chat: -1001, admins: [111]}\n"
    )


async def test_doctor_goes_on_past_a_secret_that_is_not_exported(tmp_path: Path) -> None:
    async with FakeOpenAI(models=("llama3.1",)) as model:
        _unset_secret_config(tmp_path, model.base_url)
        done = await asyncio.to_thread(_doctor, tmp_path, "--model-timeout", "5")
    assert done.returncode == 1, done.stdout + done.stderr  # a failed check, not a configuration error (2)
    out = done.stdout.splitlines()
    assert (
        "FAIL  platform.telegram environment variable TELEGRAM_BOT_TOKEN is not set (platforms.telegram.token reads "
        "it): export it, or write ${TELEGRAM_BOT_TOKEN:-} to leave the platform off"
    ) in out
    names = [line.split()[1] for line in out[:-1]]
    for ran in ("config", "platform.web", "sandbox", "store", "decision", "model"):
        assert ran in names, done.stdout  # every other check still ran
    assert [line for line in out if line.startswith("OK    model ")] != []
    assert out[-1] == "1 failed, 0 warnings"
    # before the first `kazma run` there is no store, and doctor makes none (it made and migrated one)
    assert "store.migration_applied" not in done.stderr
    assert "store.migrated" not in done.stderr


async def test_doctor_json_is_one_object_a_program_reads(tmp_path: Path) -> None:
    async with FakeOpenAI(models=("llama3.1",)) as model:
        _unset_secret_config(tmp_path, model.base_url)
        done = await asyncio.to_thread(_doctor, tmp_path, "--json", "--log-level", "warning")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert set(report) == {"checks", "failed", "warnings"}
    assert report["failed"] == 1
    assert report["warnings"] == 0
    assert report["checks"][0] == {"name": "config", "level": "ok", "detail": f"{tmp_path / 'kazma.yaml'} is valid"}
    assert {"name", "level", "detail"} == set().union(*(check.keys() for check in report["checks"]))
    failed = [c for c in report["checks"] if c["level"] == "fail"]
    assert [c["name"] for c in failed] == ["platform.telegram"]
    assert {c["level"] for c in report["checks"]} <= {"ok", "warn", "fail"}


@pytest.mark.parametrize(
    ("kind", "error", "said"), [("500", "", "HTTP 500"), ("error", "internal_error", "internal_error")]
)
async def test_slack_failing_to_answer_is_not_blamed_on_the_configuration(
    kind: FaultKind, error: str, said: str
) -> None:
    """Slack answered apps.connections.open with 500 (or internal_error): the doctor asked "is Socket Mode on?",
    sending people to change a setting that was right; the same for auth.test and the home channel."""
    async with three_fakes() as fakes:
        for method in ("auth.test", "apps.connections.open", "conversations.info"):
            fakes.slack.fail(method, kind, error=error)
        first = await ask(platforms_yaml(fakes, slack_app=FAKE_APP_TOKEN))
        second = await ask(platforms_yaml(fakes, slack_app=FAKE_APP_TOKEN))  # auth.test answered now
    outage = "Slack could not answer just now, which says nothing about the configuration"
    assert lines(first["slack"], Level.FAIL) == [
        f"platform.slack auth.test failed ({said}): {outage}; run `kazma doctor` again in a minute"
    ]
    failures = lines(second["slack"], Level.FAIL)
    assert failures == [
        f"platform.slack apps.connections.open failed ({said}): {outage}; run `kazma doctor` again in a minute",
        f"platform.slack home_channel C0HOME0001: not checked: conversations.info failed ({said}): {outage}; run "
        "`kazma doctor` again in a minute",
    ]
    assert not any("Socket Mode on" in line for line in failures)
