"""`kazma setup`: the Slack app manifest and the Discord invite URL match what Kazma really uses."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import discord
import yaml

from kazma.adapters.discord.setup import PERMISSIONS as DISCORD_PERMISSIONS
from kazma.adapters.discord.setup import discord_invite_url, discord_permissions
from kazma.adapters.slack.setup import BOT_EVENTS as SLACK_BOT_EVENTS
from kazma.adapters.slack.setup import BOT_SCOPES as SLACK_BOT_SCOPES
from kazma.adapters.slack.setup import slack_manifest
from kazma.config import load_config_text
from tests.fakes.discord import APP_ID, FakeDiscord
from tests.fakes.slack import DEFAULT_SCOPES
from tests.test_cli import CLEAN_ENV, run

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_invite_integer_is_exactly_the_permissions_kazma_uses() -> None:
    # discord.py's own flag table, independent of ours
    expected = discord.Permissions(
        view_channel=True,
        send_messages=True,
        send_messages_in_threads=True,
        embed_links=True,
        attach_files=True,  # file posts (an agent's output, a cut call) fail without it
        read_message_history=True,
        use_application_commands=True,
        manage_webhooks=True,
    ).value
    assert discord_permissions() == expected == 277562379264
    assert discord_permissions(webhooks=False) == expected - discord.Permissions(manage_webhooks=True).value
    assert discord_invite_url(42) == (
        f"https://discord.com/oauth2/authorize?client_id=42&scope=bot+applications.commands&permissions={expected}"
    )
    assert {"Send Messages in Threads", "Attach Files"} <= {p.name for p in DISCORD_PERMISSIONS}


def test_the_readme_invite_carries_the_same_integer() -> None:
    found = re.findall(r"permissions=(\d+)", README.read_text())
    assert found
    assert {int(value) for value in found} == {discord_permissions()}


def test_discord_invite_command_explains_every_bit(tmp_path: Path) -> None:
    result = run(["setup", "discord-invite", "--client-id", "123456789012345678"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == discord_invite_url(123456789012345678)
    assert lines[1] == f"permissions={discord_permissions()} is the sum of:"
    explained = lines[2:]
    assert len(explained) == len(DISCORD_PERMISSIONS)
    total = 0
    for line in explained:
        value, bit = re.match(r"\s*(\d+)\s+\(1 << (\d+)\s*\)", line).groups()  # type: ignore[union-attr]
        assert int(value) == 1 << int(bit)
        total += int(value)
    assert total == discord_permissions()
    bad = run(["setup", "discord-invite", "--client-id", "abc"], cwd=tmp_path)
    assert bad.returncode == 2
    assert "a Discord application id is a number" in bad.stderr


async def test_discord_invite_asks_discord_for_the_application_id(tmp_path: Path) -> None:
    fake = FakeDiscord()
    await fake.start()
    try:
        config = tmp_path / "kazma.yaml"
        config.write_text(f"platforms: {{discord: {{token: '{fake.token}', api_base_url: '{fake.api_base}'}}}}\n")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "setup", "discord-invite", "--no-webhooks",
            cwd=tmp_path, env=CLEAN_ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        await fake.stop()
    assert process.returncode == 0, err.decode()
    assert out.decode().splitlines()[0] == discord_invite_url(APP_ID, webhooks=False)
    assert "Manage Webhooks" not in out.decode()


def test_manifest_in_socket_mode_has_no_request_urls() -> None:
    config = load_config_text(
        "platforms: {slack: {bot_token: xoxb-1, app_token: xapp-1-A-b, home_channel: C0HOME0001}}", environ={}
    ).config
    manifest = slack_manifest(config)
    assert manifest["settings"]["socket_mode_enabled"] is True
    assert "request_url" not in manifest["settings"]["event_subscriptions"]
    assert "request_url" not in manifest["settings"]["interactivity"]
    assert all("url" not in command for command in manifest["features"]["slash_commands"])
    assert [c["command"] for c in manifest["features"]["slash_commands"]] == ["/swarm", "/plan"]
    assert manifest["settings"]["event_subscriptions"]["bot_events"] == list(SLACK_BOT_EVENTS)
    assert manifest["settings"]["interactivity"]["is_enabled"] is True
    # the scopes an app installed from the manifest gets are the ones the wire-level fake grants by default,
    # with which every Slack test of Kazma runs
    assert sorted(manifest["oauth_config"]["scopes"]["bot"]) == sorted(DEFAULT_SCOPES)
    assert set(SLACK_BOT_SCOPES) < set(DEFAULT_SCOPES)


def test_manifest_command_in_http_mode_points_every_url_at_the_public_events_path(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(
        "web: {public_url: 'https://kazma.example.org/'}\n"
        "platforms: {slack: {bot_token: xoxb-1, signing_secret: s3cret-s3cret, http: {path: /slack/kazma}}}\n"
    )
    result = run(["-c", str(config), "setup", "slack-manifest"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # a public https:// URL: nothing to warn about
    manifest = yaml.safe_load(result.stdout)
    url = "https://kazma.example.org/slack/kazma"
    assert manifest["settings"]["socket_mode_enabled"] is False
    assert manifest["settings"]["event_subscriptions"]["request_url"] == url
    assert manifest["settings"]["interactivity"]["request_url"] == url
    assert {c["url"] for c in manifest["features"]["slash_commands"]} == {url}

    local = tmp_path / "local.yaml"
    local.write_text("platforms: {slack: {bot_token: xoxb-1, signing_secret: s3cret-s3cret}}\n")
    warned = run(["-c", str(local), "setup", "slack-manifest", "--json"], cwd=tmp_path)
    assert warned.returncode == 0
    assert "Slack only posts to a public https:// URL, and http://localhost:8765/slack/events is not one" in (
        warned.stderr
    )
    forced = run(["-c", str(local), "setup", "slack-manifest", "--socket"], cwd=tmp_path)
    assert yaml.safe_load(forced.stdout)["settings"]["socket_mode_enabled"] is True
    assert forced.stderr == ""
