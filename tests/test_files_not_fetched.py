"""A file sent with a message that Kazma could not fetch: what the sender is told depends on whether sending it
again can help (Slack's fake, a real Slack adapter and a whole Kazma app between them)."""

from __future__ import annotations

from pathlib import Path

from kazma.adapters.contract import setup_refused
from kazma.config.metrics import failure_count
from tests.fakes.discord import BOT_ID, HOME_CHANNEL_ID
from tests.fakes.slack import FILE_DOWNLOAD
from tests.platforms_support import SLACK_ADMIN, SLACK_CHANNEL, Fakes, kazma_on, three_fakes


async def _share(fakes: Fakes, *, deleted: bool = False) -> str:
    """A person shares build.log in Slack's home channel (``deleted``: and deletes it before Kazma fetches it);
    Kazma's answer in that channel."""
    before = {m.ts for m in fakes.slack.channel(SLACK_CHANNEL)}
    shared = fakes.slack.add_file("build.log", b"line 1\n")
    if deleted:
        del fakes.slack.files[shared["id"]]
    event = fakes.slack.file_event(channel=SLACK_CHANNEL, user=SLACK_ADMIN, text="the log", files=[shared])
    assert fakes.slack_events_url is not None
    assert (await fakes.slack.post_event(fakes.slack_events_url, event)).status == 200

    def answers() -> list[str]:
        return [m.text for m in fakes.slack.channel(SLACK_CHANNEL) if m.bot_id and m.ts not in before]

    await fakes.slack.wait_for(lambda: bool(answers()), timeout=20)
    (answer,) = answers()
    return answer


async def test_a_file_the_app_may_not_download_is_a_setup_problem_not_a_reason_to_send_it_again(
    tmp_path: Path,
) -> None:
    """Without files:read Slack sends the download to its sign-in page (not retryable, the scope named to the
    operator): the sender was told to send the file again, which can never help. Now they are told it is a
    setup problem for the operator, and nothing of the platform's error (its URLs, its scopes) is shown."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db"):
        fakes.slack.scopes = tuple(s for s in fakes.slack.scopes if s != "files:read")
        before = failure_count("attachment_save", "slack")
        answer = await _share(fakes)
        assert fakes.slack.downloads, "the file was never asked for"
    assert "send them again" not in answer.lower(), answer
    assert "sending them again will not change" in answer, answer
    assert "setup problem for Kazma's operator" in answer, answer
    assert "nothing was passed on" in answer, answer
    for internal in ("files:read", "signin", "HTTP", fakes.slack.url):
        assert internal not in answer, answer
    assert failure_count("attachment_save", "slack") == before + 1


async def test_a_file_deleted_on_slack_before_kazma_fetched_it_is_said_gone(tmp_path: Path) -> None:
    """With files:read granted, a file deleted before the download answers 404: nothing the operator can change,
    and the sender, told before that it was a setup problem, is now told it is gone and to send it again."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db"):
        answer = await _share(fakes, deleted=True)
        assert fakes.slack.downloads, "the file was never asked for"
    assert "operator" not in answer, answer
    assert "setup" not in answer, answer
    assert "no longer hands them over" in answer, answer
    assert "send them again" in answer, answer
    assert "404" not in answer, answer


async def test_a_file_slack_could_not_serve_for_now_is_asked_for_again(tmp_path: Path) -> None:
    """Slack answered the download 503 (retryable): sending the file again may well work, and the sender is
    asked to."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db"):
        fakes.slack.fail(FILE_DOWNLOAD, "500")
        answer = await _share(fakes)
    assert "send them again" in answer, answer
    assert "operator" not in answer, answer
    assert "503" not in answer, answer


async def test_a_file_deleted_on_discord_before_kazma_fetched_it_is_said_gone_not_a_setup_problem(
    tmp_path: Path,
) -> None:
    """The person deleted the attachment before Kazma fetched it: Discord's CDN answers 404 (not retryable: the
    same URL will never serve it). The sender was told it was most likely a setup problem for the operator, who
    has nothing to change; now they are told the file is gone and to send it again."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db"):
        discord = fakes.discord
        attachment = discord.attachment(HOME_CHANNEL_ID, "build.log", b"line 1\n")
        del discord.attachments[int(attachment["id"])]
        before = {str(m["id"]) for m in discord.channel_messages(HOME_CHANNEL_ID)}
        before_failures = failure_count("attachment_save", "discord")

        def answers() -> list[str]:
            return [
                str(m.get("content") or "")
                for m in discord.channel_messages(HOME_CHANNEL_ID)
                if str(m["id"]) not in before and int(m["author"]["id"]) == BOT_ID
            ]

        await discord.user_message_with_files(HOME_CHANNEL_ID, "the log", [attachment])
        await discord.wait_until(answers, timeout=20)
        (answer,) = answers()
    assert "operator" not in answer, answer
    assert "setup" not in answer, answer
    assert "no longer hands them over" in answer, answer
    assert "send them again" in answer, answer
    assert "nothing was passed on" in answer, answer
    assert "404" not in answer, answer
    assert failure_count("attachment_save", "discord") == before_failures + 1


async def test_attack_a_401_on_an_attachment_s_cdn_url_does_not_take_discord_off(tmp_path: Path) -> None:
    """A 401 on an attachment's CDN URL (the CDN or a proxy before it refusing that URL: the bot token is never
    sent there) was taken as Discord refusing the bot token: Discord went off until a restart, every card post
    on it given up, and the sender was never even told the file could not be fetched. Only a 401 on Discord's
    API says that; the file is said not fetched and Discord serves on."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        discord = fakes.discord
        attachment = discord.attachment(HOME_CHANNEL_ID, "build.log", b"line 1\n")
        discord.attachment_refusals[int(attachment["id"])] = 401
        before = {str(m["id"]) for m in discord.channel_messages(HOME_CHANNEL_ID)}

        def answers() -> list[str]:
            return [
                str(m.get("content") or "")
                for m in discord.channel_messages(HOME_CHANNEL_ID)
                if str(m["id"]) not in before and int(m["author"]["id"]) == BOT_ID
            ]

        refused = failure_count("token_refused", "discord")
        await discord.user_message_with_files(HOME_CHANNEL_ID, "the log", [attachment])
        await discord.wait_until(answers, timeout=20)
        (answer,) = answers()
        assert "nothing was passed on" in answer, answer
        assert failure_count("token_refused", "discord") == refused
        assert setup_refused(app.bus.adapters["discord"]) is None
