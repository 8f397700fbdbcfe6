"""The Discord fake itself, driven with a raw aiohttp client: the wire details discord.py depends on."""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.fakes.discord import (
    APP_ID,
    BOT_ID,
    HOME_CHANNEL_ID,
    OTHER_CHANNEL_ID,
    SYNC_FLUSH_SUFFIX,
    FakeDiscord,
)

Json = dict[str, Any]


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    server = FakeDiscord()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def http(fake: FakeDiscord) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bot {fake.token}"}) as session:
        yield session


class Gateway:
    """A raw gateway client: one inflater for the whole connection, as discord.py has."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.inflater = zlib.decompressobj()
        self.frames: list[bytes] = []

    async def receive(self) -> Json:
        msg = await self.ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.BINARY, msg
        frame: bytes = msg.data
        assert frame.endswith(SYNC_FLUSH_SUFFIX)
        self.frames.append(frame)
        data: Json = json.loads(self.inflater.decompress(frame))
        return data

    async def identify(self, token: str) -> tuple[Json, Json]:
        await self.ws.send_json({"op": 2, "d": {"token": token, "intents": 1 | 1 << 9 | 1 << 15, "properties": {}}})
        return await self.receive(), await self.receive()


@pytest.fixture
async def gateway(fake: FakeDiscord) -> AsyncIterator[Gateway]:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{fake.gateway_url}?v=10&encoding=json&compress=zlib-stream") as ws,
    ):
        yield Gateway(ws)


async def post_message(http: aiohttp.ClientSession, fake: FakeDiscord, payload: Json) -> tuple[int, Json]:
    async with http.post(f"{fake.api_base}/channels/{HOME_CHANNEL_ID}/messages", json=payload) as response:
        return response.status, await response.json()


def nulls(value: Any, path: str = "") -> list[str]:
    """Paths of null values, to check optional fields are absent rather than null."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nulls(v, f"{path}.{k}")] or []
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{path}[{i}]")]
    return [path] if value is None else []


# Fields Discord defines as present-but-nullable; everything else must be absent when unset.
NULLABLE = {"avatar", "global_name", "icon", "edited_timestamp", "secondary_color", "tertiary_color"}


async def test_rest_answers_exact_json_content_type_and_checks_the_token(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{fake.api_base}/users/@me") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/json"
        me = await response.json()
    assert me["id"] == str(BOT_ID)
    assert me["bot"] is True
    async with http.get(f"{fake.api_base}/oauth2/applications/@me") as response:
        app = await response.json()
    assert app["id"] == str(APP_ID)
    assert "flags" in app
    assert "interactions_endpoint_url" not in app  # else discord.py ignores gateway interactions
    async with (
        aiohttp.ClientSession() as anonymous,
        anonymous.get(f"{fake.api_base}/users/@me") as response,
    ):
        assert response.status == 401
        assert response.headers["Content-Type"] == "application/json"
    assert [(c.method, c.path, c.status) for c in fake.calls] == [
        ("GET", "/users/@me", 200),
        ("GET", "/oauth2/applications/@me", 200),
        ("GET", "/users/@me", 401),
    ]


async def test_gateway_speaks_zlib_stream_from_one_compressor(fake: FakeDiscord, gateway: Gateway) -> None:
    hello = await gateway.receive()
    assert hello["op"] == 10
    assert hello["d"]["heartbeat_interval"] > 0
    ready, guild = await gateway.identify(fake.token)
    assert (ready["op"], ready["t"], ready["s"]) == (0, "READY", 1)
    data = ready["d"]
    assert data["resume_gateway_url"] == fake.gateway_url
    assert data["session_id"]
    assert data["user"]["id"] == str(BOT_ID)
    assert data["application"] == {"id": str(APP_ID), "flags": 0}
    assert "shard" not in data  # not asked for, so absent
    assert (guild["t"], guild["s"]) == ("GUILD_CREATE", 2)
    channels = {int(c["id"]) for c in guild["d"]["channels"]}
    assert {HOME_CHANNEL_ID, OTHER_CHANNEL_ID} <= channels
    assert str(BOT_ID) in {m["user"]["id"] for m in guild["d"]["members"]}
    assert {p.rsplit(".", 1)[-1] for p in nulls(guild["d"]) + nulls(data)} <= NULLABLE

    await gateway.ws.send_json({"op": 1, "d": 2})
    assert (await gateway.receive())["op"] == 11
    assert fake.heartbeats == 1

    await fake.user_message(HOME_CHANNEL_ID, "hi")
    event = await gateway.receive()
    assert (event["t"], event["s"]) == ("MESSAGE_CREATE", 3)
    assert event["d"]["content"] == "hi"
    assert event["d"]["guild_id"] == str(fake_guild_id(guild))
    assert "poll" not in event["d"]
    assert "webhook_id" not in event["d"]
    assert {p.rsplit(".", 1)[-1] for p in nulls(event["d"])} <= NULLABLE
    # Later frames continue the first one's deflate stream: alone they cannot be inflated.
    with pytest.raises(zlib.error):
        zlib.decompressobj().decompress(gateway.frames[-1])


def fake_guild_id(guild: Json) -> int:
    return int(guild["d"]["id"])


async def test_gateway_rejects_a_bad_token_with_4004(fake: FakeDiscord, gateway: Gateway) -> None:
    await gateway.receive()
    await gateway.ws.send_json({"op": 2, "d": {"token": "wrong", "intents": 1, "properties": {}}})
    msg = await gateway.ws.receive(timeout=5)
    assert msg.type == aiohttp.WSMsgType.CLOSE
    assert gateway.ws.close_code == 4004


@pytest.mark.parametrize(
    ("payload", "error_path"),
    [
        ({"content": "x" * 2001}, "content"),
        ({"embeds": [{"title": "t" * 257}]}, "embeds"),
        ({"embeds": [{"description": "d" * 4097}]}, "embeds"),
        ({"embeds": [{"fields": [{"name": "n", "value": "v"}] * 26}]}, "embeds"),
        ({"embeds": [{"fields": [{"name": "n" * 257, "value": "v"}]}]}, "embeds"),
        ({"embeds": [{"fields": [{"name": "n", "value": "v" * 1025}]}]}, "embeds"),
        ({"embeds": [{"fields": [{"name": "n", "value": ""}]}]}, "embeds"),
        ({"embeds": [{"title": "t" * 200, "fields": [{"name": "n", "value": "v" * 1024}] * 6}]}, "embeds"),
        ({"components": [{"type": 1, "components": [{"type": 2, "style": 1, "custom_id": "c" * 101}]}]}, "components"),
        (
            {
                "components": [
                    {
                        "type": 1,
                        "components": [
                            {"type": 2, "style": 3, "label": "a", "custom_id": "kz1:x:a"},
                            {"type": 2, "style": 4, "label": "b", "custom_id": "kz1:x:a"},
                        ],
                    }
                ]
            },
            "components",
        ),
    ],
)
async def test_message_limits_answer_50035(
    fake: FakeDiscord, http: aiohttp.ClientSession, payload: Json, error_path: str
) -> None:
    status, body = await post_message(http, fake, payload)
    assert status == 400
    assert body["code"] == 50035
    assert body["message"] == "Invalid Form Body"
    assert error_path in body["errors"]
    assert fake.messages == {}


async def test_limits_are_inclusive_and_empty_messages_answer_50006(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    status, body = await post_message(http, fake, {"content": "x" * 2000})
    assert status == 200
    assert body["content"] == "x" * 2000
    embed = {"title": "t" * 256, "fields": [{"name": "n", "value": "v" * 1024}] * 5, "footer": {"text": "f" * 610}}
    status, _ = await post_message(http, fake, {"embeds": [embed]})
    assert status == 200  # 256 + 5 × 1025 + 610 = 5991
    status, body = await post_message(http, fake, {"content": "  "})
    assert (status, body["code"]) == (400, 50006)


async def test_edits_apply_and_unknown_messages_answer_10008(fake: FakeDiscord, http: aiohttp.ClientSession) -> None:
    _, message = await post_message(http, fake, {"content": "before"})
    url = f"{fake.api_base}/channels/{HOME_CHANNEL_ID}/messages"
    async with http.patch(f"{url}/{message['id']}", json={"content": "after", "components": []}) as response:
        assert response.status == 200
        edited = await response.json()
    assert edited["content"] == "after"
    assert edited["edited_timestamp"]
    assert fake.messages[int(message["id"])]["content"] == "after"
    async with http.patch(f"{url}/1", json={"content": "x"}) as response:
        assert response.status == 404
        assert (await response.json())["code"] == 10008


async def test_interaction_callbacks_ack_once_and_followups_need_an_ack(
    fake: FakeDiscord, http: aiohttp.ClientSession, gateway: Gateway
) -> None:
    await gateway.receive()
    await gateway.identify(fake.token)
    buttons = [{"type": 1, "components": [{"type": 2, "style": 3, "label": "Approve", "custom_id": "kz1:r1:a"}]}]
    _, message = await post_message(http, fake, {"content": "card", "components": buttons})
    await gateway.receive()  # the echo of our own message
    with pytest.raises(LookupError):
        await fake.press_button(int(message["id"]), "kz1:r1:d")
    interaction = await fake.press_button(int(message["id"]), "kz1:r1:a", user=fake.bob)
    event = (await gateway.receive())["d"]
    assert event["type"] == 3
    assert event["data"] == {"custom_id": "kz1:r1:a", "component_type": 2}
    assert event["attachment_size_limit"] > 0
    assert event["entitlements"] == []
    assert event["member"]["user"]["id"] == str(fake.bob.id)
    assert event["message"]["id"] == message["id"]

    base = f"{fake.api_base}/webhooks/{APP_ID}/{interaction.token}"
    async with http.post(f"{base}?wait=true", json={"content": "too early"}) as response:
        assert (response.status, (await response.json())["code"]) == (404, 10015)
    callback = f"{fake.api_base}/interactions/{interaction.id}/{interaction.token}/callback"
    async with http.post(callback, params={"with_response": "1"}, json={"type": 6}) as response:
        assert response.status == 200
        assert (await response.json())["interaction"]["id"] == str(interaction.id)
    async with http.post(callback, json={"type": 6}) as response:
        assert response.status == 400
        assert (await response.json())["code"] == 40060
    async with http.post(f"{fake.api_base}/interactions/1/nope/callback", json={"type": 6}) as response:
        assert (response.status, (await response.json())["code"]) == (404, 10062)
    async with http.post(f"{base}?wait=true", json={"content": "only you", "flags": 64}) as response:
        followup = await response.json()
    assert followup["flags"] == 64
    assert followup["content"] == "only you"
    assert interaction.followup_ids == [int(followup["id"])]


async def test_slash_commands_must_be_registered_and_carry_options(
    fake: FakeDiscord, http: aiohttp.ClientSession, gateway: Gateway
) -> None:
    await gateway.receive()
    await gateway.identify(fake.token)
    with pytest.raises(LookupError):
        await fake.slash_command(HOME_CHANNEL_ID, options={"args": "status"})
    command = {"name": "swarm", "description": "d", "options": [{"type": 3, "name": "args", "description": "a"}]}
    async with http.put(f"{fake.api_base}/applications/{APP_ID}/commands", json=[command]) as response:
        assert response.status == 200
        (registered,) = await response.json()
    assert registered["application_id"] == str(APP_ID)
    assert registered["name"] == "swarm"
    await fake.slash_command(HOME_CHANNEL_ID, options={"args": "status"})
    event = (await gateway.receive())["d"]
    assert event["type"] == 2
    assert event["data"]["options"] == [{"name": "args", "type": 3, "value": "status"}]


async def test_faults_are_scripted_per_route(fake: FakeDiscord, http: aiohttp.ClientSession) -> None:
    fake.inject_fault("POST", r"/channels/\d+/messages", "429", retry_after=0.25)
    fake.inject_fault("POST", r"/channels/\d+/messages", "429-no-via")
    fake.inject_fault("POST", r"/channels/\d+/messages", "500")
    url = f"{fake.api_base}/channels/{HOME_CHANNEL_ID}/messages"
    async with http.get(f"{fake.api_base}/users/@me") as response:
        assert response.status == 200  # other routes are untouched
    async with http.post(url, json={"content": "a"}) as response:
        assert response.status == 429
        assert response.headers["Via"]
        assert response.headers["Content-Type"] == "application/json"
        assert (await response.json())["retry_after"] == 0.25
    async with http.post(url, json={"content": "a"}) as response:
        assert response.status == 429
        assert "Via" not in response.headers
    async with http.post(url, json={"content": "a"}) as response:
        assert response.status == 500
    async with http.post(url, json={"content": "a"}) as response:
        assert response.status == 200
    fake.inject_fault("PATCH", r"/channels/\d+/messages/\d+", "hang")
    async with http.post(url, json={"content": "b"}) as response:
        assert response.status == 200
        message = await response.json()
    with pytest.raises(TimeoutError):
        await http.patch(f"{url}/{message['id']}", json={"content": "c"}, timeout=aiohttp.ClientTimeout(total=0.2))
    hung = fake.calls_to("PATCH", r"/channels/\d+/messages/\d+")
    assert len(hung) == 1
    assert hung[0].status is None


async def test_channel_webhooks_post_under_a_chosen_name(fake: FakeDiscord, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{fake.api_base}/channels/{HOME_CHANNEL_ID}/webhooks", json={"name": "Kazma"}) as response:
        hook = await response.json()
    assert hook["user"]["id"] == str(BOT_ID)
    assert hook["token"]
    url = f"{fake.api_base}/webhooks/{hook['id']}/{hook['token']}?wait=true"
    async with http.post(url, json={"content": "hi", "username": "researcher"}) as response:
        message = await response.json()
    assert message["webhook_id"] == hook["id"]
    assert message["author"]["username"] == "researcher"
    assert message["author"]["bot"] is True
    async with http.post(url, json={"content": "hi", "username": "my discord bot"}) as response:
        assert (response.status, (await response.json())["code"]) == (400, 50035)
    fake.manage_webhooks = False
    async with http.get(f"{fake.api_base}/channels/{HOME_CHANNEL_ID}/webhooks") as response:
        assert (response.status, (await response.json())["code"]) == (403, 50013)


async def test_resume_replays_what_was_missed_after_seq_then_resumed_and_an_unknown_session_is_invalid(
    fake: FakeDiscord, gateway: Gateway
) -> None:
    await gateway.receive()  # HELLO
    ready, _ = await gateway.identify(fake.token)
    session_id = ready["d"]["session_id"]
    await fake.user_message(HOME_CHANNEL_ID, "seen")
    seen = await gateway.receive()
    assert (seen["t"], seen["s"]) == ("MESSAGE_CREATE", 3)
    assert await fake.drop_gateway() == 1
    assert fake.gateway_sessions() == (0, 1)
    await fake.user_message(HOME_CHANNEL_ID, "missed")  # kept for the dropped session
    url = f"{fake.gateway_url}?v=10&encoding=json&compress=zlib-stream"
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            again = Gateway(ws)
            assert (await again.receive())["op"] == 10
            await ws.send_json({"op": 6, "d": {"token": fake.token, "session_id": session_id, "seq": 3}})
            missed, resumed = await again.receive(), await again.receive()
            assert (missed["t"], missed["s"], missed["d"]["content"]) == ("MESSAGE_CREATE", 4, "missed")
            assert (resumed["t"], resumed["s"]) == ("RESUMED", 5)
            assert fake.gateway_sessions() == (1, 1)
            await fake.user_message(HOME_CHANNEL_ID, "live")
            live = await again.receive()
            assert (live["s"], live["d"]["content"]) == (6, "live")
            await ws.close(code=1000)  # the client ends its session
        await fake.wait_until(lambda: fake.gateway_sessions() == (0, 0))
        async with session.ws_connect(url) as ws:
            late = Gateway(ws)
            await late.receive()
            await ws.send_json({"op": 6, "d": {"token": fake.token, "session_id": session_id, "seq": 6}})
            assert await late.receive() == {"op": 9, "d": False}
    assert [r["outcome"] for r in fake.resumes] == ["resumed", "invalid"]
    with pytest.raises(RuntimeError):  # no session left to send to
        await fake.user_message(HOME_CHANNEL_ID, "nobody")
