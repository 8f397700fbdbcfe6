"""The Discord adapter on the real discord.py, against the wire-level fake in tests/fakes/discord.py."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import discord
import pytest
import yarl

from kazma.adapters.card_layout import cut_marker, outcome_line
from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformAdapter, PlatformError, Press
from kazma.adapters.discord import DiscordAdapter
from kazma.adapters.discord.errors import classify, route_of
from kazma.adapters.discord.render import ARGUMENT_MARK, ZWSP, render_card
from kazma.approvals.card import ApprovalCard, build_card
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import ApprovalRequest, Decision, Outcome, PressResult, PressVerdict, Status
from kazma.config.metrics import failure_count
from kazma.config.models import DiscordConfig
from tests.fakes.discord import (
    ALICE_ID,
    APP_ID,
    GUILD_ID,
    HELPER_BOT_ID,
    HOME_CHANNEL_ID,
    OTHER_CHANNEL_ID,
    UNSERVED_CHANNEL_ID,
    FakeDiscord,
    Json,
    RecordedCall,
)

T = TypeVar("T")
PressFn = Callable[[Press], Awaitable[PressResult]]
CALLBACK = r"/interactions/\d+/[^/]+/callback"
CHANNEL_POST = r"/channels/\d+/messages"
CHANNEL_PATCH = r"/channels/\d+/messages/\d+"
LIVE_MENTION = re.compile(r"@(everyone|here)|<[@#!/]")


class Recorder:
    """The bus side of the adapter: records what arrives, answers presses as a test scripts."""

    def __init__(self) -> None:
        self.inbound: list[Inbound] = []
        self.presses: list[Press] = []
        self.press: PressFn = self.won
        self.inbound_hook: Callable[[Inbound], None] | None = None
        self._changed = asyncio.Condition()

    @staticmethod
    async def won(press: Press) -> PressResult:
        return PressResult(PressVerdict.WON, "Approved.")

    def handlers(self) -> Handlers:
        return Handlers(on_inbound=self.on_inbound, on_press=self.on_press)

    async def on_inbound(self, inbound: Inbound) -> None:
        if self.inbound_hook is not None:
            self.inbound_hook(inbound)
        self.inbound.append(inbound)
        async with self._changed:
            self._changed.notify_all()

    async def on_press(self, press: Press) -> PressResult:
        self.presses.append(press)
        async with self._changed:
            self._changed.notify_all()
        return await self.press(press)

    async def wait_until(self, predicate: Callable[[], T], timeout: float = 5.0) -> T:
        async with asyncio.timeout(timeout), self._changed:
            while not (value := predicate()):
                await self._changed.wait()
            return value

    async def inbound_where(self, predicate: Callable[[Inbound], bool]) -> Inbound:
        found = await self.wait_until(lambda: [i for i in self.inbound if predicate(i)])
        return found[0]


@dataclass
class Running:
    fake: FakeDiscord
    adapter: DiscordAdapter
    recorder: Recorder


def make_config(fake: FakeDiscord, **overrides: Any) -> DiscordConfig:
    values: dict[str, Any] = {
        "token": fake.token,
        "api_base_url": fake.api_base,
        "gateway_url": fake.gateway_url,
        "channels": [HOME_CHANNEL_ID, OTHER_CHANNEL_ID],
        "home_channel": HOME_CHANNEL_ID,
        "admins": [ALICE_ID],
    }
    values.update(overrides)
    return DiscordConfig(**values)


def make_adapter(fake: FakeDiscord, **config: Any) -> DiscordAdapter:
    return DiscordAdapter(make_config(fake, **config), guild_ready_timeout=0.05, request_timeout=1.0)


@pytest.fixture
def library_endpoints() -> Iterator[tuple[str, yarl.URL]]:
    """discord.py's endpoints are process-wide class attributes: put them back whatever a test did."""
    saved = (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
    yield saved
    discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = saved


async def started_fake(**options: Any) -> FakeDiscord:
    server = FakeDiscord(**options)
    await server.start()
    return server


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    server = await started_fake()
    yield server
    await server.stop()


@pytest.fixture
async def running(fake: FakeDiscord, library_endpoints: tuple[str, yarl.URL]) -> AsyncIterator[Running]:
    adapter = make_adapter(fake)
    recorder = Recorder()
    await adapter.start(recorder.handlers())
    yield Running(fake, adapter, recorder)
    await adapter.stop()


def make_card(
    args: dict[str, Any], *, value_limit: int = 500, requester: str = "kazma", origin: str = ""
) -> ApprovalCard:
    now = datetime.now(UTC)
    request = ApprovalRequest(
        id=secrets.token_hex(16),
        tool="shell",
        args=args,
        args_json=canonical_json(args),
        args_hash=args_hash(args),
        requested_by=requester,
        conversation=origin or f"discord:{HOME_CHANNEL_ID}",
        created_at=now,
        deadline=now + timedelta(minutes=10),
        status=Status.PENDING,
    )
    return build_card(request, value_limit=value_limit, public_url="http://127.0.0.1:8765")


def outcome_of(card: ApprovalCard, status: Status, by: str | None = f"discord:{ALICE_ID}") -> Outcome:
    human = status in (Status.APPROVED, Status.DENIED)
    return Outcome(
        request_id=card.request_id,
        status=status,
        decided_by=by if human else None,
        decided_via="discord" if human else None,
        decided_at=datetime.now(UTC),
    )


def shown(value: str) -> str:
    """What a reader sees: markdown escapes resolved, zero-width spaces invisible."""
    return re.sub(r"\\(.)", r"\1", value).replace(ZWSP, "")


def code_blocks(value: str) -> list[str]:
    """The contents of the ``` blocks in a field value (as rendered: zero-width spaces removed)."""
    parts = value.split("```")
    assert len(parts) % 2 == 1, f"unbalanced code fences in {value!r}"
    return [p.removeprefix("\n").removesuffix("\n").replace(ZWSP, "") for p in parts[1::2]]


def card_embed(fake: FakeDiscord, ref: CardRef) -> Json:
    embed: Json = fake.messages[int(ref.message_id)]["embeds"][0]
    return embed


def texts_of(embed: Json) -> list[str]:
    fields = embed.get("fields", [])
    return [
        embed.get("title", ""),
        embed.get("description", ""),
        embed["footer"]["text"],
        *(f["name"] for f in fields),
        *(f["value"] for f in fields),
    ]


def field_name(field: Json) -> str:
    """The argument a field is named after (every field name is ``• <argument>``)."""
    name = shown(field["name"])
    assert name.startswith(ARGUMENT_MARK), name
    return name.removeprefix(ARGUMENT_MARK)


def names_on(fake: FakeDiscord, embed: Json, before: int) -> list[str]:
    """Every argument name a reader can find: field names, the description's list, and name messages."""
    names = [field_name(f) for f in embed.get("fields", [])]
    lines = embed["description"].splitlines()
    for message in fake.channel_messages(HOME_CHANNEL_ID):
        if int(message["id"]) < before and message["content"].startswith("Argument names of approval request"):
            lines += message["content"].splitlines()[1:]
    names += [shown(line.removeprefix("• ")) for line in lines if line.startswith("• ")]
    return names


def assert_no_mentions_allowed(calls: list[RecordedCall]) -> None:
    assert calls
    for call in calls:
        body = call.json.get("data", call.json) if "/interactions/" in call.path else call.json
        assert body.get("allowed_mentions") == {"parse": []}, (call.method, call.path, body)


# --------------------------------------------------------------------------- connecting


async def test_start_returns_after_ready_with_intents_and_swarm_command(
    fake: FakeDiscord, library_endpoints: tuple[str, yarl.URL]
) -> None:
    adapter = make_adapter(fake)
    assert isinstance(adapter, PlatformAdapter)
    assert adapter.name == "discord"
    assert adapter.home_chat == str(HOME_CHANNEL_ID)
    await adapter.start(Recorder().handlers())
    try:
        assert fake.api_base == discord.http.Route.BASE
        assert fake.identified
        (identify,) = fake.identifies
        intents = discord.Intents._from_value(identify["intents"])
        assert intents.guilds
        assert intents.guild_messages
        assert intents.message_content
        assert not intents.members
        assert not intents.presences
        command, plan, approvals = fake.commands
        assert (command["name"], plan["name"], approvals["name"]) == ("swarm", "plan", "approvals")
        assert [(o["name"], o["type"], o.get("required", False)) for o in command["options"]] == [("args", 3, False)]
        assert not plan.get("options")  # they take nothing after them
        assert not approvals.get("options")
    finally:
        await adapter.stop()
    assert library_endpoints == (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)


async def test_start_serves_once_every_guild_arrived_without_waiting_out_the_library_ready(
    fake: FakeDiscord, library_endpoints: tuple[str, yarl.URL]
) -> None:
    """discord.py dispatches its READY only after ``guild_ready_timeout`` of silence following the last guild;
    the start must not wait that out (it held every `kazma run` start). With a wait longer than the start's own
    bound, the start still returns, every guild cached, and a message and a press arriving meanwhile are
    delivered while discord.py has still not called itself ready."""
    recorder = Recorder()
    adapter = DiscordAdapter(make_config(fake), guild_ready_timeout=3600.0, request_timeout=1.0, start_timeout=10.0)
    await adapter.start(recorder.handlers())
    try:
        client = adapter._client
        assert client is not None
        assert not client.is_ready()  # the library's own wait is still running
        assert [g.id for g in client.guilds if not g.unavailable] == [GUILD_ID]
        assert client.get_channel(HOME_CHANNEL_ID) is not None
        card = make_card({"command": "rm -rf /tmp/early"})
        ref = await adapter.post_card(card)
        await fake.user_message(HOME_CHANNEL_ID, "@researcher early bird", author=fake.alice)
        await fake.press_button(int(ref.message_id), card.button_data(Decision.APPROVE))
        message = await recorder.inbound_where(lambda i: i.text == "@researcher early bird")
        assert message.author == f"discord:{ALICE_ID}"
        await recorder.wait_until(lambda: recorder.presses)
        assert [(p.data, p.actor) for p in recorder.presses] == [
            (card.button_data(Decision.APPROVE), f"discord:{ALICE_ID}")
        ]
        assert not client.is_ready()
    finally:
        await adapter.stop()


async def test_bad_token_is_a_non_retryable_platform_error(
    fake: FakeDiscord, library_endpoints: tuple[str, yarl.URL]
) -> None:
    adapter = make_adapter(fake, token="not-the-token")
    with pytest.raises(PlatformError) as caught:
        await adapter.start(Recorder().handlers())
    assert caught.value.retryable is False
    assert caught.value.platform == "discord"
    assert [(c.path, c.status) for c in fake.calls] == [("/users/@me", 401)]
    assert library_endpoints[0] == discord.http.Route.BASE


async def test_calls_before_start_are_retryable_platform_errors(fake: FakeDiscord) -> None:
    adapter = make_adapter(fake)
    with pytest.raises(PlatformError) as caught:
        await adapter.send_text(str(HOME_CHANNEL_ID), "hello")
    assert caught.value.retryable is True
    assert fake.calls == []


# --------------------------------------------------------------------------- inbound


async def test_messages_from_users_and_bots_are_delivered_with_from_bot(running: Running) -> None:
    fake, recorder = running.fake, running.recorder
    await fake.user_message(
        HOME_CHANNEL_ID, "@researcher look at this, <@1> and @everyone", author=fake.alice, mentions=[fake.bot]
    )
    await fake.user_message(OTHER_CHANNEL_ID, "@builder build it", author=fake.helper_bot)
    human = await recorder.inbound_where(lambda i: i.author == f"discord:{ALICE_ID}")
    bot = await recorder.inbound_where(lambda i: i.author == f"discord:{HELPER_BOT_ID}")
    assert human.platform == "discord"
    assert human.chat == str(HOME_CHANNEL_ID)
    assert human.text == "@researcher look at this, <@1> and @everyone"
    assert human.author_name == "Alice"
    assert human.is_admin
    assert not human.from_bot
    assert human.mentions == ("kazma", "researcher")
    assert human.command is None
    assert human.thread is None
    assert human.message_id.isdigit()
    assert bot.chat == str(OTHER_CHANNEL_ID)
    assert bot.from_bot
    assert not bot.is_admin
    assert bot.mentions == ("builder",)


async def test_a_message_or_command_the_gateway_delivers_again_is_handled_once(running: Running) -> None:
    """Discord may deliver a gateway event again (around a RESUME, in its incidents): an agent must not get the
    same message, or the same /swarm, twice."""
    fake, recorder = running.fake, running.recorder
    await fake.user_message(HOME_CHANNEL_ID, "@builder deploy once")
    (first,) = fake.dispatched("MESSAGE_CREATE")
    await fake.dispatch("MESSAGE_CREATE", first)
    await fake.user_message(HOME_CHANNEL_ID, "@builder and then this")
    await recorder.inbound_where(lambda i: i.text == "@builder and then this")
    command = await fake.slash_command(HOME_CHANNEL_ID, options={"args": "status"})
    await recorder.inbound_where(lambda i: i.command is not None)
    (pressed,) = [d for d in fake.dispatched("INTERACTION_CREATE") if d["id"] == str(command.id)]
    await fake.dispatch("INTERACTION_CREATE", pressed)
    await fake.user_message(HOME_CHANNEL_ID, "@builder last")
    await recorder.inbound_where(lambda i: i.text == "@builder last")
    assert [i.text for i in recorder.inbound if i.text == "@builder deploy once"] == ["@builder deploy once"]
    assert len([i for i in recorder.inbound if i.command is not None]) == 1


async def test_swarm_command_is_acknowledged_then_delivered_then_answered(running: Running) -> None:
    fake, recorder = running.fake, running.recorder
    acks_at_delivery: list[list[tuple[Any, int | None]]] = []
    recorder.inbound_hook = lambda _: acks_at_delivery.append(
        [(c.json.get("type"), c.status) for c in fake.calls_to("POST", CALLBACK)]
    )
    interaction = await fake.slash_command(
        HOME_CHANNEL_ID, user=fake.bob, options={"args": "run standard <@&456> @here"}
    )
    inbound = await recorder.inbound_where(lambda i: i.command == "swarm")
    assert inbound.text == "run standard <@&456> @here"
    assert inbound.author == f"discord:{fake.bob.id}"
    assert not inbound.is_admin
    assert inbound.chat == str(HOME_CHANNEL_ID)
    assert inbound.message_id == str(interaction.id)
    assert acks_at_delivery == [[(5, 200)]]  # "thinking" defer answered before the bus saw the command
    followup = await fake.wait_for_call("POST", rf"/webhooks/{APP_ID}/{interaction.token}")
    assert followup.status == 200
    assert shown(followup.json["content"]) == "Received /swarm run standard <@&456> @here"
    assert not LIVE_MENTION.search(followup.json["content"])
    assert_no_mentions_allowed([followup])


async def test_swarm_command_in_unserved_channel_is_refused_privately(running: Running) -> None:
    fake, recorder = running.fake, running.recorder
    interaction = await fake.slash_command(UNSERVED_CHANNEL_ID, options={"args": "status"})
    call = await fake.wait_for_call("POST", rf"/interactions/{interaction.id}/[^/]+/callback")
    assert call.json["type"] == 4
    assert call.json["data"]["flags"] == 64
    assert recorder.inbound == []


def _delivered(recorder: Recorder, count: int) -> Callable[[], bool]:
    return lambda: len(recorder.inbound) == count


@pytest.mark.parametrize("channels", [[HOME_CHANNEL_ID], ["*"]])
async def test_guilds_narrow_every_served_channel_to_those_servers(
    fake: FakeDiscord, library_endpoints: tuple[str, yarl.URL], channels: list[Any]
) -> None:
    # The fake's one server is GUILD_ID; Kazma is told to serve another one only.
    for guilds, served in (([GUILD_ID + 1], False), ([GUILD_ID], True)):
        adapter = make_adapter(fake, channels=channels, guilds=guilds)
        recorder = Recorder()
        await adapter.start(recorder.handlers())
        try:
            await fake.user_message(HOME_CHANNEL_ID, f"@kazma hello ({served})", author=fake.alice)
            interaction = await fake.slash_command(HOME_CHANNEL_ID, user=fake.alice, options={"args": "history"})
            answer = await fake.wait_for_call("POST", rf"/interactions/{interaction.id}/[^/]+/callback")
            if served:
                assert answer.json["type"] == 5  # deferred: the command is taken
                await recorder.wait_until(_delivered(recorder, 2))
            else:
                assert (answer.json["type"], answer.json["data"]["flags"]) == (4, 64)  # refused, privately
                await adapter.quiesce()  # the message came first on the gateway: it was handled by now
                assert recorder.inbound == []
        finally:
            await adapter.stop()


# --------------------------------------------------------------------------- cards


async def test_card_shows_every_name_a_marked_cut_the_hash_link_and_buttons(running: Running) -> None:
    fake = running.fake
    long_value = "HEAD:" + "x" * 9_990 + ":TAIL"
    args = {"command": "ls -la", "script": long_value, "count": 3, "options": {"force": True}}
    card = make_card(args)
    ref = await running.adapter.post_card(card)
    assert ref == CardRef("discord", str(HOME_CHANNEL_ID), ref.message_id, whole=False)
    message = fake.messages[int(ref.message_id)]
    embed = message["embeds"][0]
    assert [field_name(f) for f in embed["fields"]] == sorted(args)
    values = {field_name(f): f["value"] for f in embed["fields"]}
    assert code_blocks(values["command"]) == ["ls -la"]
    assert code_blocks(values["count"]) == ["3"]
    assert code_blocks(values["options"]) == ['{"force":true}']
    script = next(a for a in card.arguments if a.name == "script")
    assert script.cut
    head, tail = code_blocks(values["script"])
    assert (head, tail) == (script.head, script.tail)
    assert head.startswith("HEAD:")
    assert tail.endswith(":TAIL")
    assert f"*{cut_marker(script.original_length, script.omitted)}*" in shown(values["script"])
    assert "of 10,000 characters not shown" in values["script"]
    assert card.args_hash in embed["description"]
    assert len(card.args_hash) == 64
    assert card.link in embed["description"]
    assert "url" not in embed
    (row,) = message["components"]
    buttons = [(b["style"], b["label"], b["custom_id"]) for b in row["components"]]
    # a value is cut here, so Approve happens on the approval page
    assert buttons == [
        (discord.ButtonStyle.danger.value, "Deny", f"kz1:{card.request_id}:d"),
        (discord.ButtonStyle.danger.value, "Deny with reason", f"kz1:{card.request_id}:n"),
    ]
    assert_no_mentions_allowed(fake.message_calls())


async def test_long_values_are_cut_again_with_an_honest_marker(running: Running) -> None:
    value = "".join(f"{i:05d}" for i in range(2_000))  # 10,000 distinct characters
    card = make_card({"blob": value}, value_limit=4_000)
    ref = await running.adapter.post_card(card)
    (field,) = card_embed(running.fake, ref)["fields"]
    assert len(field["value"]) <= 1024
    head, tail = code_blocks(field["value"])
    assert value.startswith(head)
    assert value.endswith(tail)
    assert tail
    omitted = 10_000 - len(head) - len(tail)
    assert f"[cut: {omitted:,} of 10,000 characters not shown]" in field["value"]


HOSTILE = (
    "@everyone @here <@123> <@&456> <#789> <!channel> <b>bold</b> a & b ``` `x` ||spoiler|| **loud** [x](http://e.vil)"
)


async def test_card_escapes_markdown_and_mentions_everywhere(running: Running) -> None:
    fake = running.fake
    args = {
        "cmd": HOSTILE,
        "@everyone": "fence breakout ```\n@here\n``` after",
        "<@&456>": "`",
        "name`with```ticks": "trailing backtick`",
    }
    card = make_card(args, requester="<@123> @everyone", origin="<!channel> @here **x**")
    ref = await running.adapter.post_card(card)
    embed = card_embed(fake, ref)
    for piece in texts_of(embed):
        assert not LIVE_MENTION.search(piece), piece
    values = {field_name(f): f["value"] for f in embed["fields"]}
    assert sorted(values) == sorted(args)  # names escaped, yet read back exactly
    for name, value in args.items():
        assert code_blocks(values[name]) == [value]  # one block each, content exact: nothing broke out
    assert "a & b" in values["cmd"]
    assert "&amp;" not in values["cmd"]
    assert "<b>bold</b>" in shown(values["cmd"])
    description = embed["description"]
    assert "\\*\\*x\\*\\*" in description
    assert shown(description).count("<!channel> @here **x**") == 1
    assert_no_mentions_allowed(fake.message_calls())


async def test_sixty_long_arguments_fit_the_embed_with_every_name_and_the_notice(running: Running) -> None:
    fake = running.fake
    args = {f"arg_{i:02d}": f"start-{i:02d}-" + "v" * 1_984 + f"-end-{i:02d}" for i in range(60)}
    card = make_card(args)
    ref = await running.adapter.post_card(card)
    (post,) = fake.calls_to("POST", CHANNEL_POST)
    assert post.status == 200  # the fake enforces every embed limit
    embed = card_embed(fake, ref)
    fields = embed["fields"]
    assert 0 < len(fields) <= 25
    assert len(embed["description"]) <= 4096
    assert len(discord.Embed.from_dict(embed)) <= 6000
    assert sorted(names_on(fake, embed, int(ref.message_id))) == sorted(args)
    assert "Part of this call is not shown here" in shown(embed["description"])
    assert f"Listed by name only ({60 - len(fields)})" in shown(embed["description"])
    for item in fields:
        i = shown(item["name"])[-2:]
        head, tail = code_blocks(item["value"])
        assert head.startswith(f"start-{i}-")
        assert tail.endswith(f"-end-{i}")
        assert "characters not shown]*" in item["value"]


async def test_names_that_cannot_fit_on_the_card_are_counted_and_it_offers_only_deny(running: Running) -> None:
    fake = running.fake
    args = {f"{i:03d}-" + "n" * 96: "v" for i in range(120)}
    card = make_card(args)
    ref = await running.adapter.post_card(card)
    (post,) = fake.calls_to("POST", CHANNEL_POST)
    assert post.status == 200
    embed = card_embed(fake, ref)
    listed = names_on(fake, embed, int(ref.message_id))
    hidden = 120 - len(listed)
    assert hidden > 0
    assert f"{hidden} of 120 argument names do not fit here" in shown(embed["description"])
    assert [c["label"] for row in fake.messages[int(ref.message_id)]["components"] for c in row["components"]] == [
        "Deny",
        "Deny with reason",
    ]
    assert_no_mentions_allowed(fake.message_calls())


def test_rendering_keeps_limits_for_many_shapes() -> None:
    shapes: list[dict[str, Any]] = [
        {},
        {"a": ""},
        {f"k{i}": "`" * 500 for i in range(30)},
        {f"{i:02d}" + "_" * 98: "@everyone" * 60 for i in range(40)},
        {"x" * 100: "y" * 500},
    ]
    for args in shapes:
        card = make_card(args)
        for outcome in (None, outcome_of(card, Status.DENIED), outcome_of(card, Status.TIMEOUT)):
            embed = render_card(card, outcome=outcome).written.embed
            assert len(embed) <= 6000
            assert len(embed.fields) <= 25
            assert len(embed.description or "") <= 4096
            assert len(embed.title or "") <= 256
            assert all(len(f.name or "") <= 256 and 0 < len(f.value or "") <= 1024 for f in embed.fields)


# --------------------------------------------------------------------------- presses


async def test_press_is_deferred_before_on_press_and_a_lost_press_gets_an_ephemeral_answer(running: Running) -> None:
    fake, recorder = running.fake, running.recorder
    card = make_card({"command": "rm -rf /tmp/x"})
    ref = await running.adapter.post_card(card)
    acks_at_press: list[list[tuple[Any, int | None]]] = []

    async def lost(press: Press) -> PressResult:
        acks_at_press.append([(c.json.get("type"), c.status) for c in fake.calls_to("POST", CALLBACK)])
        return PressResult(PressVerdict.LOST, "Already denied by <@123> @everyone.", request_id=card.request_id)

    recorder.press = lost
    interaction = await fake.press_button(int(ref.message_id), card.button_data(Decision.APPROVE), user=fake.bob)
    followup = await fake.wait_for_call("POST", rf"/webhooks/{APP_ID}/{interaction.token}")
    assert [(p.data, p.actor, p.chat, p.message_id) for p in recorder.presses] == [
        (f"kz1:{card.request_id}:a", f"discord:{fake.bob.id}", str(HOME_CHANNEL_ID), ref.message_id)
    ]
    assert acks_at_press == [[(6, 200)]]
    assert followup.json["flags"] == 64
    assert shown(followup.json["content"]) == "Already denied by <@123> @everyone."
    assert not LIVE_MENTION.search(followup.json["content"])
    assert_no_mentions_allowed([followup])


async def test_buttons_of_a_card_posted_before_a_restart_still_work(
    fake: FakeDiscord, library_endpoints: tuple[str, yarl.URL]
) -> None:
    card = make_card({"command": "restart me"})
    first = make_adapter(fake)
    await first.start(Recorder().handlers())
    ref = await first.post_card(card)
    await first.stop()
    recorder = Recorder()
    second = make_adapter(fake)
    await second.start(recorder.handlers())
    try:
        await fake.press_button(int(ref.message_id), card.button_data(Decision.APPROVE))
        await recorder.wait_until(lambda: recorder.presses)
        assert [(p.data, p.actor) for p in recorder.presses] == [
            (card.button_data(Decision.APPROVE), f"discord:{ALICE_ID}")
        ]
    finally:
        await second.stop()


# --------------------------------------------------------------------------- settling


async def test_settle_shows_the_outcome_removes_buttons_and_is_idempotent(running: Running) -> None:
    fake, adapter = running.fake, running.adapter
    card = make_card({"command": "deploy @everyone"})
    ref = await adapter.post_card(card)
    outcome = outcome_of(card, Status.APPROVED)
    await adapter.settle_card(ref, card, outcome)
    message = fake.messages[int(ref.message_id)]
    embed = message["embeds"][0]
    assert message["components"] == []
    assert embed["title"].startswith("✅ APPROVED")
    assert embed["color"] == discord.Colour.green().value
    assert shown(outcome_line(outcome)) in shown(embed["title"])
    assert [field_name(f) for f in embed["fields"]] == ["command"]
    with pytest.raises(LookupError):
        await fake.press_button(int(ref.message_id), card.button_data(Decision.DENY))
    await adapter.settle_card(ref, card, outcome)
    patches = fake.calls_to("PATCH", CHANNEL_PATCH)
    assert [p.status for p in patches] == [200, 200]
    assert all(p.json["components"] == [] for p in patches)
    assert_no_mentions_allowed(fake.message_calls())


async def test_settling_an_unknown_message_is_not_retryable(running: Running) -> None:
    card = make_card({"command": "x"})
    ref = CardRef("discord", str(HOME_CHANNEL_ID), "1234567890123456789")
    with pytest.raises(PlatformError) as caught:
        await running.adapter.settle_card(ref, card, outcome_of(card, Status.DENIED))
    assert caught.value.retryable is False
    assert "10008" in str(caught.value)


# --------------------------------------------------------------------------- faults


async def test_a_401_on_an_interaction_s_own_token_is_not_the_bot_token_refused(running: Running) -> None:
    """Discord answers 401 on an interaction's or a webhook's route for that route's own token (an interaction
    token expired): the bot's token is fine, and Discord is not taken off as it is when it refuses the bot's."""
    fake, adapter, recorder = running.fake, running.adapter, running.recorder
    card = make_card({"command": "x"})
    ref = await adapter.post_card(card)
    callback = r"/interactions/\d+/[^/]+/callback"
    fake.inject_fault("POST", callback, "401")
    await fake.press_button(int(ref.message_id), card.button_data(Decision.APPROVE))
    await recorder.wait_until(lambda: recorder.presses)  # the press decides though its acknowledgement failed
    assert (await fake.wait_for_call("POST", callback)).status == 401
    assert adapter.setup_refused is None
    await adapter.settle_card(ref, card, outcome_of(card, Status.APPROVED))  # the bot's token still edits
    assert [p.status for p in fake.calls_to("PATCH", CHANNEL_PATCH)] == [200]


async def test_a_401_on_a_webhooks_own_token_asks_nothing_of_the_operator(running: Running) -> None:
    """A webhook's (or an interaction's) route carries its own token: a 401 there says nothing of the bot token,
    and the error must not tell the conversation that the operator has to replace it. The bot's own 401 does."""
    fake, adapter = running.fake, running.adapter
    await adapter.send_text(str(HOME_CHANNEL_ID), "hi", agent="builder")  # the channel's webhook, made
    webhook = await adapter._hooks.for_channel(adapter._client, HOME_CHANNEL_ID)
    assert webhook is not None
    fake.inject_fault("POST", r"/webhooks/\d+/[^/]+", "401")
    with pytest.raises(discord.HTTPException) as caught:
        await webhook.send("again", username="builder", wait=True)
    assert caught.value.status == 401
    assert not classify("send", caught.value).operator_must_act
    fake.inject_fault("POST", CHANNEL_POST, "401")
    with pytest.raises(PlatformError) as refused:
        await adapter.send_text(str(HOME_CHANNEL_ID), "as the bot")
    assert refused.value.operator_must_act


async def test_a_401_on_discord_py_s_retry_of_a_card_discord_made_is_not_nothing_done(running: Running) -> None:
    """Discord made the card and answered 500; discord.py's own retry met the bot token reset meanwhile (401).
    That was told as a call that certainly did nothing, though its first try had landed the card. Only a 401 with
    no request before it that Discord may have done is "nothing done"."""
    fake, adapter = running.fake, running.adapter
    adapter.request_timeout = 3.0  # room for discord.py's own pause (1 s) before its retry

    def reset() -> None:
        fake.token = "reset-in-the-developer-portal"

    fake.inject_fault("POST", CHANNEL_POST, "500-landed", after=reset)
    with pytest.raises(PlatformError) as caught:
        await adapter.post_card(make_card({"a": 1}))
    assert [c.status for c in fake.calls_to("POST", CHANNEL_POST)] == [500, 401]
    assert caught.value.operator_must_act
    assert not caught.value.nothing_done
    assert len(fake.channel_messages(HOME_CHANNEL_ID)) == 1
    with pytest.raises(PlatformError) as kept:  # refused before it leaves Kazma: certainly nothing done
        await adapter.post_card(make_card({"a": 2}))
    assert kept.value.nothing_done


async def test_a_401_on_a_card_post_s_only_request_is_nothing_done(running: Running) -> None:
    running.fake.token = "reset-in-the-developer-portal"
    with pytest.raises(PlatformError) as caught:
        await running.adapter.post_card(make_card({"a": 1}))
    assert caught.value.operator_must_act
    assert caught.value.nothing_done


async def test_server_errors_are_retryable(running: Running) -> None:
    fake, adapter = running.fake, running.adapter
    fake.inject_fault("POST", CHANNEL_POST, "503")
    with pytest.raises(PlatformError) as caught:
        await adapter.post_card(make_card({"a": 1}))
    assert caught.value.retryable is True
    assert caught.value.site == "card_post"
    # discord.py retries a 500 itself (after 1 s, 3 s, …); the request timeout ends the wait.
    fake.inject_fault("POST", CHANNEL_POST, "500", times=10)
    with pytest.raises(PlatformError) as caught:
        await adapter.send_text(str(HOME_CHANNEL_ID), "hello")
    assert caught.value.retryable is True
    assert [c.status for c in fake.calls_to("POST", CHANNEL_POST)][:2] == [503, 500]


async def test_rate_limit_with_via_is_retried_by_discord_py_and_delivered(running: Running) -> None:
    fake = running.fake
    fake.inject_fault("POST", CHANNEL_POST, "429", retry_after=0.05)
    message_id = await running.adapter.send_text(str(HOME_CHANNEL_ID), "after the limit")
    assert [c.status for c in fake.calls_to("POST", CHANNEL_POST)] == [429, 200]
    assert fake.messages[int(message_id)]["content"] == "after the limit"


async def test_rate_limit_without_via_is_a_retryable_error(running: Running) -> None:
    running.fake.inject_fault("POST", CHANNEL_POST, "429-no-via")
    with pytest.raises(PlatformError) as caught:
        await running.adapter.send_text(str(HOME_CHANNEL_ID), "blocked")
    assert caught.value.retryable is True


async def test_a_hanging_server_becomes_a_retryable_error_and_the_next_call_works(running: Running) -> None:
    fake, adapter = running.fake, running.adapter
    card = make_card({"command": "x"})
    ref = await adapter.post_card(card)
    fake.inject_fault("PATCH", CHANNEL_PATCH, "hang")
    with pytest.raises(PlatformError) as caught:
        await adapter.settle_card(ref, card, outcome_of(card, Status.DENIED))
    assert caught.value.retryable is True
    assert "no answer within 1 s" in str(caught.value)
    await adapter.settle_card(ref, card, outcome_of(card, Status.DENIED))
    assert fake.messages[int(ref.message_id)]["components"] == []


async def test_a_429_waited_out_past_the_request_timeout_is_told_as_a_rate_limit(running: Running) -> None:
    """discord.py sleeps out a 429's retry_after inside the call; when the request timeout ends that sleep, the
    error says Discord rate limited the call (with how long to wait), not that nothing answered."""
    fake, adapter = running.fake, running.adapter
    adapter.request_timeout = 0.2
    # Longer than the timeout, every time: the kit waits out what is left and tries again, then gives up.
    fake.inject_fault("POST", CHANNEL_POST, "429", retry_after=0.5, times=20)
    with pytest.raises(PlatformError) as caught:
        await adapter.send_text(str(HOME_CHANNEL_ID), "slow down")
    error = caught.value
    assert "no answer" not in str(error)
    assert "rate limited" in str(error)
    assert "429" in str(error)
    assert "retry after 0.5 s" in str(error)
    assert f"POST /api/v10/channels/{HOME_CHANNEL_ID}/messages" in str(error)
    assert error.retryable is True
    assert error.retry_after is not None
    assert 0 < error.retry_after <= 0.5
    statuses = [c.status for c in fake.calls_to("POST", CHANNEL_POST)]
    assert len(statuses) > 1  # tried again after each wait
    assert statuses == [429] * len(statuses)
    fake.clear_faults()
    message_id = await adapter.send_text(str(HOME_CHANNEL_ID), "after the limit")
    assert fake.messages[int(message_id)]["content"] == "after the limit"


async def test_a_global_429_cut_short_by_the_request_timeout_does_not_stop_every_later_request(
    running: Running,
) -> None:
    """discord.py closes its global lock while it sleeps out a global 429 and reopens it only after the sleep: a
    timeout ending that sleep left it closed, and every later request of the process waited on it for good."""
    fake, adapter = running.fake, running.adapter
    adapter.request_timeout = 0.2
    fake.inject_fault("POST", CHANNEL_POST, "429-global", retry_after=0.4)
    first = await adapter.send_text(str(HOME_CHANNEL_ID), "first")  # the kit waits out what is left, then sends
    assert fake.messages[int(first)]["content"] == "first"
    adapter.request_timeout = 1.0
    second = await adapter.send_text(str(OTHER_CHANNEL_ID), "second")
    assert fake.messages[int(second)]["content"] == "second"
    assert [c.status for c in fake.calls_to("POST", CHANNEL_POST)] == [429, 200, 200]


def test_a_rate_limited_route_is_logged_without_its_token() -> None:
    token = "aW50ZXJhY3Rpb246MTIzNDU2Nzg5MDEyMzQ1Njc4OTpzZWNyZXQ"
    url = yarl.URL(f"https://discord.com/api/v10/webhooks/{APP_ID}/{token}/messages/@original")
    assert route_of(url) == f"/api/v10/webhooks/{APP_ID}/***/messages/@original"
    assert route_of(yarl.URL(f"https://discord.com/api/v10/interactions/1/{token}/callback")).count("***") == 1


async def test_a_call_held_behind_another_calls_429_waits_it_out_and_is_sent(running: Running) -> None:
    """discord.py holds a request on a bucket another request is sleeping a 429 out on: nothing was sent when the
    request timeout ran out, so it is the rate limit's wait (what is left of it), then sent; not "no answer"."""
    fake, adapter = running.fake, running.adapter
    fake.inject_fault("POST", CHANNEL_POST, "429", retry_after=1.0)
    first = asyncio.ensure_future(adapter.send_text(str(HOME_CHANNEL_ID), "first"))  # sleeps the 429 out
    await fake.wait_for_call("POST", CHANNEL_POST)
    adapter.request_timeout = 0.2
    second = await adapter.send_text(str(HOME_CHANNEL_ID), "second")
    assert fake.messages[int(second)]["content"] == "second"
    assert fake.messages[int(await first)]["content"] == "first"
    contents = [(c.json.get("content"), c.status) for c in fake.calls_to("POST", CHANNEL_POST)]
    assert sorted(contents, key=str) == sorted([("first", 429), ("first", 200), ("second", 200)], key=str)


async def test_client_errors_are_not_retryable(running: Running) -> None:
    with pytest.raises(PlatformError) as caught:
        await running.adapter.send_text("42", "to a channel that does not exist")
    assert caught.value.retryable is False
    with pytest.raises(PlatformError) as caught:
        await running.adapter.send_text(str(HOME_CHANNEL_ID), " \n ")
    assert caught.value.retryable is False
    with pytest.raises(PlatformError):
        await running.adapter.send_text("general", "not an id")


# --------------------------------------------------------------------------- agent identity


async def test_agents_post_through_one_channel_webhook_under_their_name(running: Running) -> None:
    fake, adapter, recorder = running.fake, running.adapter, running.recorder
    first = await adapter.send_text(str(HOME_CHANNEL_ID), "@builder please <@123> @everyone", agent="researcher")
    await adapter.send_text(str(HOME_CHANNEL_ID), "done", agent="builder")
    assert len(fake.calls_to("POST", r"/channels/\d+/webhooks")) == 1
    executes = fake.calls_to("POST", r"/webhooks/\d+/[^/]+")
    assert [c.json["username"] for c in executes] == ["researcher", "builder"]
    assert not LIVE_MENTION.search(executes[0].json["content"])
    assert_no_mentions_allowed(executes)
    echo = await recorder.inbound_where(lambda i: i.message_id == first)
    assert echo.author_name == "researcher"
    assert echo.from_bot
    assert echo.mentions == ("builder",)


async def test_without_manage_webhooks_agents_are_named_by_prefix_and_long_text_is_split(
    library_endpoints: tuple[str, yarl.URL],
) -> None:
    fake = await started_fake(manage_webhooks=False)
    adapter = make_adapter(fake)
    await adapter.start(Recorder().handlers())
    try:
        body = "\n".join(f"line {i:04d} " + "w" * 40 for i in range(100))  # ~5,000 characters
        first = await adapter.send_text(str(HOME_CHANNEL_ID), body, agent="validator")
        posts = fake.calls_to("POST", CHANNEL_POST)
        assert len(posts) == 3
        assert fake.calls_to("GET", r"/channels/\d+/webhooks") == []
        contents = [p.json["content"] for p in posts]
        assert all(c.startswith("[validator] ") and len(c) <= 2000 for c in contents)
        assert "\n".join(c.removeprefix("[validator] ") for c in contents) == body
        assert fake.messages[int(first)]["content"] == contents[0]
        assert_no_mentions_allowed(posts)
    finally:
        await adapter.stop()
        await fake.stop()


async def test_a_name_discord_refuses_for_a_webhook_falls_back_to_the_prefix(running: Running) -> None:
    fake = running.fake
    message_id = await running.adapter.send_text(str(HOME_CHANNEL_ID), "hi", agent="discord-helper")
    (refused,) = fake.calls_to("POST", r"/webhooks/\d+/[^/]+")
    assert refused.status == 400
    assert fake.messages[int(message_id)]["content"] == "[discord-helper] hi"


@pytest.mark.parametrize("code", [4004, 4013])
async def test_a_follower_whose_gateway_discord_closed_for_good_still_posts_cards(running: Running, code: int) -> None:
    """The leader's gateway was closed with a code after which discord.py closes its whole client, then the replica
    lost the lease: it closed its ingress and no ingress check opens the gateway there any more. Its own REST posts
    (the cards of the requests it opened) were refused on that replica for good, although REST needs no gateway."""
    fake, adapter = running.fake, running.adapter
    await adapter.send_text(str(HOME_CHANNEL_ID), "before", agent="builder")  # its channel's webhook, kept
    lost = failure_count("ingress_lost", "discord")
    assert await fake.drop_gateway(code=code) == 1
    async with asyncio.timeout(10):
        while failure_count("ingress_lost", "discord") == lost:
            await asyncio.sleep(0.02)
    await adapter.stop_ingress()  # what a replica that lost the lease does (Lifecycle.follow)
    card = make_card({"command": "deploy"})
    refused: list[PlatformError] = []  # what was refused before a new client served
    async with asyncio.timeout(10):  # the card outbox tries again: a refusal may come first, each retryable
        while True:
            try:
                ref = await adapter.post_card(card)
                break
            except PlatformError as exc:
                if not exc.retryable:
                    raise  # the outbox would give the card up
                refused.append(exc)
                await asyncio.sleep(0.05)
    assert fake.messages[int(ref.message_id)]["embeds"]
    after = await adapter.send_text(str(HOME_CHANNEL_ID), "after", agent="builder")
    assert fake.messages[int(after)]["content"] == "after"  # through the webhook, under the agent's name
    assert not adapter.ingress_running  # the gateway stays the leader's: only REST logged in again
    assert len([i for i in fake.identifies if "rejected" not in i]) == 1
