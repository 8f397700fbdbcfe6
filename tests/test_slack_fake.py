"""The Slack fake behaves like Slack where the adapter depends on it, checked with the real slack-sdk."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from slack_sdk.errors import SlackApiError
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient

from tests.fakes.slack import FakeSlack, sign, validate_blocks

CHANNEL = "CFAKE0001"


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    server = FakeSlack()
    await server.start()
    yield server
    await server.stop()


def client(fake: FakeSlack, token: str | None = None, timeout: int = 5) -> AsyncWebClient:
    # No retry handlers: these tests look at what the fake answers, not at recovery.
    return AsyncWebClient(token=token or fake.bot_token, base_url=fake.api_url, timeout=timeout, retry_handlers=[])


def section(text: str, block_id: str | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "section", "text": {"type": "mrkdwn", "text": text}}
    if block_id:
        block["block_id"] = block_id
    return block


def button(action_id: str, value: str) -> dict[str, Any]:
    return {"type": "button", "action_id": action_id, "text": {"type": "plain_text", "text": "Go"}, "value": value}


async def error_of(call: Any) -> tuple[int, str]:
    with pytest.raises(SlackApiError) as info:
        await call
    response = info.value.response
    data = response.data if isinstance(response.data, dict) else {}
    return response.status_code, str(data.get("error", ""))


async def test_auth_test_identifies_the_bot_and_bad_tokens_are_refused(fake: FakeSlack) -> None:
    ok = await client(fake).auth_test()
    assert ok["user_id"] == fake.bot_user_id
    assert ok["bot_id"] == fake.bot_id
    assert await error_of(client(fake, token="xoxb-wrong").auth_test()) == (200, "invalid_auth")
    assert await error_of(client(fake, token="xoxb-wrong").chat_postMessage(channel=CHANNEL, text="x")) == (
        200,
        "invalid_auth",
    )
    assert fake.channel(CHANNEL) == []
    assert [c.error for c in fake.calls] == [None, "invalid_auth", "invalid_auth"]


async def test_post_and_update_keep_current_text_and_blocks(fake: FakeSlack) -> None:
    web_client = client(fake)
    posted = await web_client.chat_postMessage(
        channel=CHANNEL, text="hello", blocks=[section("one", "b1")], thread_ts="1.2"
    )
    ts = posted["ts"]
    stored = fake.message(CHANNEL, ts)
    assert (stored.text, stored.thread_ts, stored.block_types()) == ("hello", "1.2", ["section"])
    # slack-sdk sends JSON; a form body (as older clients send) carries blocks as a JSON string.
    assert fake.calls_to("chat.postMessage")[0].content_type == "application/json"

    await web_client.chat_update(channel=CHANNEL, ts=ts, text="edited")
    assert fake.message(CHANNEL, ts).block_types() == ["section"]  # omitted blocks are kept
    await web_client.chat_update(channel=CHANNEL, ts=ts, text="cleared", blocks=[])
    assert (fake.message(CHANNEL, ts).text, fake.message(CHANNEL, ts).blocks) == ("cleared", [])
    assert fake.message(CHANNEL, ts).edits == 2


async def test_form_encoded_calls_are_understood(fake: FakeSlack) -> None:
    web_client = client(fake)
    await web_client.api_call(
        "chat.postMessage", data={"channel": CHANNEL, "text": "form", "blocks": json.dumps([section("f")])}
    )
    (stored,) = fake.channel(CHANNEL)
    assert stored.text == "form"
    assert stored.texts() == ["form", "f"]


async def test_update_of_unknown_or_foreign_messages_fails_like_slack(fake: FakeSlack) -> None:
    web_client = client(fake)
    assert await error_of(web_client.chat_update(channel=CHANNEL, ts="1.000001", text="x")) == (
        200,
        "message_not_found",
    )
    human = fake.add_user_message(CHANNEL, "mine")
    assert await error_of(web_client.chat_update(channel=CHANNEL, ts=human.ts, text="x")) == (
        200,
        "cant_update_message",
    )
    assert fake.message(CHANNEL, human.ts).text == "mine"


@pytest.mark.parametrize(
    ("blocks", "text", "error"),
    [
        ([section(f"s{i}") for i in range(51)], "t", "invalid_blocks"),
        ([section("x" * 3001)], "t", "invalid_blocks"),
        ([{"type": "actions", "elements": [button("a", "v" * 2001)]}], "t", "invalid_blocks"),
        ([{"type": "actions", "elements": [button("a", "1"), button("a", "2")]}], "t", "invalid_blocks"),
        ([section("a", "same"), section("b", "same")], "t", "invalid_blocks"),
        ([{"type": "header", "text": {"type": "plain_text", "text": "h" * 151}}], "t", "invalid_blocks"),
        (
            [{"type": "actions", "elements": [{**button("a", "1"), "text": {"type": "plain_text", "text": "b" * 76}}]}],
            "t",
            "invalid_blocks",
        ),
        ([], "x" * 40_001, "msg_too_long"),
        ([], "", "no_text"),
    ],
)
@pytest.mark.filterwarnings("ignore:The top-level `text` argument is missing:UserWarning")
async def test_limits_are_enforced(fake: FakeSlack, blocks: list[dict[str, Any]], text: str, error: str) -> None:
    call = client(fake).chat_postMessage(channel=CHANNEL, text=text, blocks=blocks or None)
    assert await error_of(call) == (200, error)
    assert fake.channel(CHANNEL) == []


def test_limits_accept_what_slack_accepts() -> None:
    blocks = [section("x" * 3000, f"b{i}") for i in range(49)]
    blocks.append({"type": "actions", "elements": [button("a", "v" * 2000), button("b", "w")]})
    assert validate_blocks(json.dumps(blocks)) == blocks


async def test_customised_identity_needs_its_scope(fake: FakeSlack) -> None:
    fake.allow_customize = False
    call = client(fake).chat_postMessage(channel=CHANNEL, text="x", username="builder", icon_emoji=":robot_face:")
    assert await error_of(call) == (200, "missing_scope")
    fake.allow_customize = True
    await client(fake).chat_postMessage(channel=CHANNEL, text="x", username="builder", icon_emoji=":robot_face:")
    (stored,) = fake.channel(CHANNEL)
    assert (stored.username, stored.icon_emoji) == ("builder", ":robot_face:")


async def test_ephemeral_messages_are_recorded(fake: FakeSlack) -> None:
    await client(fake).chat_postEphemeral(channel=CHANNEL, user="UPERSON01", text="only you")
    assert [(e.channel, e.user, e.text) for e in fake.ephemerals] == [(CHANNEL, "UPERSON01", "only you")]


async def test_scripted_faults(fake: FakeSlack) -> None:
    web_client = client(fake, timeout=1)
    fake.fail("chat.postMessage", "500")
    fake.fail("chat.postMessage", "429", retry_after=9)
    fake.fail("chat.postMessage", "error", error="channel_not_found")
    assert (await error_of(web_client.chat_postMessage(channel=CHANNEL, text="a")))[0] == 500
    with pytest.raises(SlackApiError) as info:
        await web_client.chat_postMessage(channel=CHANNEL, text="b")
    assert info.value.response.status_code == 429
    assert info.value.response.headers["Retry-After"] == "9"
    assert await error_of(web_client.chat_postMessage(channel=CHANNEL, text="c")) == (200, "channel_not_found")
    await web_client.chat_postMessage(channel=CHANNEL, text="d")
    assert [m.text for m in fake.channel(CHANNEL)] == ["d"]

    fake.fail("chat.update", "hang")
    with pytest.raises(TimeoutError):
        await web_client.chat_update(channel=CHANNEL, ts="1.1", text="x")
    assert fake.calls_to("chat.update")[0].error == "hang"


async def test_faults_can_repeat(fake: FakeSlack) -> None:
    fake.fail("chat.postMessage", "error", error="fatal_error", times=2)
    for _ in range(2):
        assert await error_of(client(fake).chat_postMessage(channel=CHANNEL, text="x")) == (200, "fatal_error")
    await client(fake).chat_postMessage(channel=CHANNEL, text="x")


async def _receiving_app(received: list[web.Request], bodies: list[str]) -> web.AppRunner:
    async def handler(request: web.Request) -> web.Response:
        received.append(request)
        bodies.append(await request.text())
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/hook", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def test_posts_to_the_app_are_signed_as_slack_signs_them(fake: FakeSlack) -> None:
    received: list[web.Request] = []
    bodies: list[str] = []
    runner = await _receiving_app(received, bodies)
    try:
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}/hook"
        await fake.post_event(url, fake.message_event(channel=CHANNEL, user="UPERSON01", text="hi"))
        await fake.post_command(url, text="status", channel=CHANNEL, user="UPERSON01")
        await fake.post_block_action(
            url, action_id="kazma_approve", value="kz1:x:a", user="UPERSON01", channel=CHANNEL, message_ts="1.1"
        )
        await fake.post_event(url, {"type": "message"}, bad_signature=True)
    finally:
        await runner.cleanup()

    verifier = SignatureVerifier(fake.signing_secret)
    verdicts = [verifier.is_valid_request(body, dict(req.headers)) for req, body in zip(received, bodies, strict=True)]
    assert verdicts == [True, True, True, False]

    event = json.loads(bodies[0])
    assert event["type"] == "event_callback"
    assert event["event"]["channel"] == CHANNEL
    assert received[1].content_type == "application/x-www-form-urlencoded"
    assert "command=%2Fswarm" in bodies[1]
    assert bodies[2].startswith("payload=")


def test_signature_matches_the_sdk_verifier() -> None:
    fake = FakeSlack(signing_secret="s3cret")
    stamp = str(int(time.time()))
    headers = {"x-slack-request-timestamp": stamp, "x-slack-signature": sign("s3cret", stamp, "body")}
    assert SignatureVerifier(fake.signing_secret).is_valid_request("body", headers)
    assert not SignatureVerifier(fake.signing_secret).is_valid_request("other", headers)


async def test_socket_mode_urls_need_the_app_token_and_open_once(fake: FakeSlack) -> None:
    assert await error_of(client(fake).apps_connections_open(app_token=fake.bot_token)) == (200, "invalid_auth")
    opened = await client(fake).apps_connections_open(app_token=fake.app_token)
    url = str(opened["url"])
    assert url.startswith(f"ws://127.0.0.1:{fake.url.rsplit(':', 1)[1]}/socket?ticket=")

    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            hello = await ws.receive_json()
            assert hello["type"] == "hello"
            await fake.wait_for(lambda: fake.socket_connected)
            ack = asyncio.ensure_future(fake.socket_send("events_api", {"type": "event_callback"}))
            envelope = await ws.receive_json()
            assert (envelope["type"], envelope["accepts_response_payload"]) == ("events_api", False)
            await ws.send_json({"envelope_id": envelope["envelope_id"], "payload": {"text": "done"}})
            assert await ack == {"text": "done"}
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await session.ws_connect(url)
    await fake.wait_for(lambda: not fake.socket_connected)
