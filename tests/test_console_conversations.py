"""The console's conversations as a lead reads them: each by the title its platform gives it (a Telegram group's
title, a Slack or Discord channel's name, a DM's person), not a raw id, and every approval shown as its card in
the conversation it was asked in, where it can be decided.

Titles come from the real adapters on the wire fakes (python-telegram-bot, slack-bolt asking ``conversations.info``
once per channel, discord.py), are kept with the transcript on SQLite and on PostgreSQL, and a rename shows.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import aiohttp

from kazma.approvals.model import Status
from kazma.bot.console.pages import conversation_list
from kazma.config.metrics import failure_count
from kazma.engine.transcript import TranscriptStore
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import SLACK_CHANNEL, TG_ADMIN, TG_CHAT, kazma_on, three_fakes
from tests.store_backends import Engine, open_store
from tests.test_web_server import OPERATOR, console


async def test_a_conversation_keeps_the_title_its_platform_last_gave_it(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        transcript = TranscriptStore(conn)
        await transcript.record("telegram", "-1001", author="telegram:1", name="Ann", text="hi", direction="in",
                                title="Release\ncrew")  # fmt: skip
        await transcript.record("telegram", "-1001", author="agent:kazma", name="kazma", text="ok", direction="out")
        await transcript.record("slack", "C1", author="slack:U1", name="Bo", text="yo", direction="in")
        titles = {s.conversation: s.title for s in await transcript.conversations()}
        # a post with no title (Kazma's own) keeps it; a title is one line; a channel never named shows its id
        assert titles == {"telegram:-1001": "Release crew", "slack:C1": ""}
        await transcript.record("telegram", "-1001", author="telegram:1", name="Ann", text="renamed", direction="in",
                                title="Release crew 2027")  # fmt: skip
        titles = {s.conversation: s.title for s in await transcript.conversations()}
        assert titles["telegram:-1001"] == "Release crew 2027"


async def test_every_platform_names_its_conversation_and_the_console_lists_them_by_name(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        fakes.telegram.push_message(TG_CHAT, TG_ADMIN, "morning from telegram")
        assert fakes.slack_events_url is not None
        await fakes.slack.post_event(
            fakes.slack_events_url,
            fakes.slack.message_event(channel=SLACK_CHANNEL, user="U0ADMIN01", text="morning from slack"),
        )
        await fakes.discord.user_message(HOME_CHANNEL_ID, "morning from discord")

        async def titles() -> dict[str, str]:
            return {s.conversation: s.title for s in await app.transcript.conversations()}

        expected = {
            f"telegram:{TG_CHAT}": f"Group {TG_CHAT}",  # the fake's group title, from the update's chat
            f"slack:{SLACK_CHANNEL}": f"#channel-{SLACK_CHANNEL.lower()}",  # conversations.info
            f"discord:{HOME_CHANNEL_ID}": "#kazma-home",  # the gateway's channel
        }
        async with asyncio.timeout(20):  # each platform's message is taken in on its own task
            while await titles() != expected:
                await asyncio.sleep(0.02)
        listed = conversation_list(await app.transcript.conversations(), None)
        for conversation, title in expected.items():
            item = re.search(rf'<li data-conversation="{re.escape(conversation)}">(.*?)</li>', listed, re.S)
            assert item is not None, conversation
            assert f'<span class="title">{title}</span>' in item.group(1)

        # Slack is asked once per channel, not once per message
        asked = len(fakes.slack.calls_to("conversations.info"))
        await fakes.slack.post_event(
            fakes.slack_events_url,
            fakes.slack.message_event(channel=SLACK_CHANNEL, user="U0ADMIN01", text="again"),
        )
        async with asyncio.timeout(20):
            while (await titles()) and [
                s.last_text for s in await app.transcript.conversations() if s.platform == "slack"
            ] != ["again"]:
                await asyncio.sleep(0.02)
        assert len(fakes.slack.calls_to("conversations.info")) == asked


async def test_a_slack_channel_slack_will_not_name_is_shown_by_its_id_and_the_message_is_kept(
    tmp_path: Path,
) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        fakes.slack.missing_channels.add(SLACK_CHANNEL)  # conversations.info answers channel_not_found
        before = failure_count("channel_title", "slack")
        assert fakes.slack_events_url is not None
        await fakes.slack.post_event(
            fakes.slack_events_url,
            fakes.slack.message_event(channel=SLACK_CHANNEL, user="U0ADMIN01", text="still here"),
        )
        async with asyncio.timeout(20):
            while not [s for s in await app.transcript.conversations() if s.platform == "slack"]:
                await asyncio.sleep(0.02)
        [summary] = [s for s in await app.transcript.conversations() if s.platform == "slack"]
        assert (summary.title, summary.last_text) == ("", "still here")
        assert failure_count("channel_title", "slack") == before + 1
        assert f'<code class="chat-id">{SLACK_CHANNEL}</code>' in conversation_list([summary], None)


async def test_an_approval_appears_as_its_card_in_its_conversation_and_is_decided_there(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        transcript = con.app.transcript
        await transcript.record("telegram", "-1001", author="telegram:111", name="Ann", text="please clean up",
                                direction="in", title="Release crew")  # fmt: skip
        request = await con.open_approval({"command": "rm -rf /srv/old"})  # asked in web:console
        here = await con.app.service.open("shell", {"command": "rm -rf /srv/tmp"}, "agent:builder", "telegram:-1001")
        await transcript.record("telegram", "-1001", author="agent:kazma", name="kazma", text="waiting on you",
                                direction="out")  # fmt: skip
        csrf = await con.login(client, "alice", OPERATOR)

        listed = await (await client.get(f"{con.base}/conversations")).text()
        assert '<span class="title">Release crew</span>' in listed
        path = f"/conversations/{quote('telegram:-1001', safe='')}"
        page = await (await client.get(con.base + path)).text()
        assert "<h2>" in page
        assert '<span class="title">Release crew</span>' in page.split("<h2>", 1)[1].split("</h2>", 1)[0]
        # the card where it was asked: after the message that led to it, before the one that followed
        shown = page.split('id="transcript"', 1)[1]
        assert shown.index("please clean up") < shown.index(f'id="a-{here.id}"') < shown.index("waiting on you")
        assert "rm -rf /srv/tmp" in page
        assert f'id="a-{request.id}"' not in page  # another conversation's approval is not shown here
        assert f'action="/approvals/{here.id}/decide"' in page
        assert f'<input type="hidden" name="next" value="{path}">' in page

        decided = await client.post(
            f"{con.base}/approvals/{here.id}/decide",
            data={"csrf": csrf, "decision": "approve", "next": path},
            allow_redirects=False,
        )
        assert (decided.status, unquote(decided.headers["Location"])) == (303, unquote(path))  # back to it
        row = await con.app.service.store.get(here.id)
        assert row is not None
        assert row.status is Status.APPROVED
        page = await (await client.get(con.base + path)).text()
        item = re.search(rf'<li class="message approval" id="a-{here.id}".*?</li>', page, re.S)
        assert item is not None
        assert "APPROVED by alice (web:alice)" in item.group(0)
        assert f'action="/approvals/{here.id}/decide"' not in page  # settled: no buttons


async def _approval_event(events: aiohttp.ClientResponse, request_id: str, showing: str) -> dict[str, Any]:
    """The next live event placing ``request_id``'s card in its conversation with ``showing`` in it."""
    async with asyncio.timeout(20):
        while True:
            line = (await events.content.readline()).decode().strip()
            data: dict[str, Any] = json.loads(line.removeprefix("data: ")) if line.startswith("data: ") else {}
            if data.get("type") == "approval" and data.get("request") == request_id and showing in data["html"]:
                return data


async def test_an_approval_arrives_and_settles_live_in_its_conversation(tmp_path: Path) -> None:
    """A page open on a conversation places the card the moment it is asked, and replaces it once decided."""
    async with console(tmp_path) as con, con.client() as client:
        await con.app.transcript.record("telegram", "-1001", author="telegram:111", name="Ann", text="go",
                                        direction="in")  # fmt: skip
        csrf = await con.login(client, "alice", OPERATOR)
        events = await client.get(f"{con.base}/events")
        async with asyncio.timeout(10):
            while (await events.content.readline()).decode().strip() != ": ready":
                pass
        here = await con.app.service.open("shell", {"command": "rm -rf /srv/tmp"}, "agent:builder", "telegram:-1001")
        placed = await _approval_event(events, here.id, "rm -rf /srv/tmp")
        assert placed["conversation"] == "telegram:-1001"  # only a page on that conversation places it
        assert f'id="a-{here.id}"' in placed["html"]
        assert f'action="/approvals/{here.id}/decide"' in placed["html"]  # decided right there
        assert "rm -rf /srv/tmp" in placed["html"]
        await client.post(
            f"{con.base}/approvals/{here.id}/decide",
            data={"csrf": csrf, "decision": "deny", "next": "/"},
            allow_redirects=False,
        )
        settled = await _approval_event(events, here.id, "DENIED by alice (web:alice)")
        assert f'action="/approvals/{here.id}/decide"' not in settled["html"]
        events.close()
        script = await (await client.get(f"{con.base}/static/console.js")).text()
        assert 'data.type === "approval"' in script


async def test_an_open_event_stream_ends_with_its_session_and_carries_nothing_after(tmp_path: Path) -> None:
    """The stream was let in once, at the door: a passkey revoked while it is open (after a compromise) must not
    leave it reading every conversation and every call's arguments."""
    async with console(tmp_path) as con, con.client() as client:
        await con.login(client, "alice", OPERATOR)
        events = await client.get(f"{con.base}/events")
        async with asyncio.timeout(10):
            while (await events.content.readline()).decode().strip() != ": ready":
                pass
        before = await con.app.service.open("shell", {"command": "ls /srv"}, "agent:builder", "telegram:-1001")
        await _approval_event(events, before.id, "ls /srv")  # the control: the stream carries cards
        assert con.server.signin is not None
        assert await con.server.signin.accounts.revoke(person="alice", credential_id=None, by="cli:root")
        await con.app.service.open("shell", {"command": "cat /srv/secret"}, "agent:builder", "telegram:-1001")
        rest = b""
        async with asyncio.timeout(20):
            while line := await events.content.readline():  # b"": the server ended the stream
                rest += line
        assert b"/srv/secret" not in rest
        assert (await client.get(f"{con.base}/events")).status == 401
