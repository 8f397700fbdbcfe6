"""The Slack adapter on the real Bolt AsyncApp and slack-sdk AsyncWebClient, against the wire-level fake."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from urllib.parse import urlencode

import aiohttp
import pytest
import structlog
from aiohttp import web

from kazma.adapters.card_layout import cut_marker, outcome_line
from kazma.adapters.contract import (
    Attachment,
    CardRef,
    Handlers,
    Inbound,
    PlatformAdapter,
    PlatformError,
    Press,
    ingress_trouble,
)
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.press_policy import NOT_YOURS
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.slack import adapter as slack_adapter
from kazma.adapters.slack.render import APPROVE_ACTION, DENY_ACTION, DENY_REASON_ACTION, REMEMBER_ACTION, escape
from kazma.approvals.card import ApprovalCard, build_card
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import ApprovalRequest, Decision, Outcome, PressResult, PressVerdict, Status
from kazma.config.metrics import failure_count
from kazma.config.models import SlackConfig, SlackHttpConfig
from tests.fakes.slack import FILE_DOWNLOAD, FakeSlack, SignedResponse, StoredMessage

HOME = "CHOME0001"
OTHER = "CWORK0002"
UNSERVED = "CELSE0003"
ADMIN = "UADMIN001"
PERSON = "UPERSON01"
WAIT = 5.0


class Signal:
    """Wake waiters whenever something they watch may have changed."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = WAIT) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self._event.clear()
                await self._event.wait()


class Recorder:
    """The handlers the bot would inject: records everything, optionally holds until released."""

    def __init__(self) -> None:
        self.inbound: list[Inbound] = []
        self.presses: list[Press] = []
        self.press_result: PressResult | Exception = PressResult(PressVerdict.WON, "Approved.", request_id="r")
        self.hold = asyncio.Event()
        self.hold.set()
        self.signal = Signal()

    async def on_inbound(self, message: Inbound) -> None:
        self.inbound.append(message)
        self.signal.notify()
        await self.hold.wait()

    async def on_press(self, press: Press) -> PressResult:
        self.presses.append(press)
        self.signal.notify()
        await self.hold.wait()
        if isinstance(self.press_result, Exception):
            raise self.press_result
        return self.press_result

    def handlers(self) -> Handlers:
        return Handlers(on_inbound=self.on_inbound, on_press=self.on_press)


class LogWatch(logging.Handler):
    """The adapter's structlog events, as the test configuration routes them through stdlib logging."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.signal = Signal()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.signal.notify()

    def matching(self, event: str, **fields: str) -> list[logging.LogRecord]:
        found = []
        for record in self.records:
            message = record.getMessage()
            if event not in message:
                continue
            if all(getattr(record, k, None) == v or f"{k}={v}" in message for k, v in fields.items()):
                found.append(record)
        return found

    async def wait_for(self, event: str, **fields: str) -> None:
        await self.signal.wait_until(lambda: bool(self.matching(event, **fields)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def slack_config(fake: FakeSlack, **overrides: Any) -> SlackConfig:
    values: dict[str, Any] = {
        "bot_token": fake.bot_token,
        "signing_secret": fake.signing_secret,
        "api_base_url": fake.api_url,
        "http": SlackHttpConfig(host="127.0.0.1", port=free_port(), path="/slack/events"),
        "channels": [HOME, OTHER],
        "home_channel": HOME,
        "admins": [ADMIN],
    }
    values.update(overrides)
    return SlackConfig(**values)


StartAdapter = Callable[..., Awaitable[SlackAdapter]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    server = FakeSlack()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def logs() -> Iterator[LogWatch]:
    watch = LogWatch()
    logger = logging.getLogger("kazma.adapters")  # the kit's events and the Slack adapter's own
    previous = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watch)
    yield watch
    logger.removeHandler(watch)
    logger.setLevel(previous)


@pytest.fixture
async def start_adapter(fake: FakeSlack, recorder: Recorder) -> AsyncIterator[StartAdapter]:
    started: list[SlackAdapter] = []

    async def start(*, config: SlackConfig | None = None, **kwargs: Any) -> SlackAdapter:
        kwargs.setdefault("limiter", ChatRateLimiter(min_interval=0.0))
        kwargs.setdefault("request_timeout", 1)
        adapter = SlackAdapter(config or slack_config(fake), **kwargs)
        await adapter.start(recorder.handlers())
        started.append(adapter)
        return adapter

    yield start
    recorder.hold.set()
    for adapter in started:
        await adapter.stop()


@pytest.fixture
async def adapter(start_adapter: StartAdapter) -> SlackAdapter:
    return await start_adapter()


def events_url(adapter: SlackAdapter) -> str:
    assert adapter.events_url is not None
    return adapter.events_url


def request_for(args: dict[str, Any], *, tool: str = "shell", requester: str = "builder") -> ApprovalRequest:
    now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    return ApprovalRequest(
        id="Rq7xK2mP9vL4nB8cT1wZ5aY3",
        tool=tool,
        args=args,
        args_json=canonical_json(args),
        args_hash=args_hash(args),
        requested_by=requester,
        conversation=f"slack:{HOME}",
        created_at=now,
        deadline=now + timedelta(minutes=10),
        status=Status.PENDING,
    )


def make_card(args: dict[str, Any], *, value_limit: int = 500, **kwargs: Any) -> ApprovalCard:
    return build_card(request_for(args, **kwargs), value_limit=value_limit, public_url="http://127.0.0.1:8765")


def outcome_for(card: ApprovalCard, status: Status = Status.APPROVED) -> Outcome:
    return Outcome(
        request_id=card.request_id,
        status=status,
        decided_by=f"slack:{ADMIN}" if status.human else None,
        decided_via="slack" if status.human else None,
        decided_at=datetime(2030, 1, 2, 3, 6, 0, tzinfo=UTC),
    )


def section_texts(msg: StoredMessage) -> list[str]:
    texts = []
    for block in msg.blocks:
        if block.get("type") == "section":
            if "text" in block:
                texts.append(block["text"]["text"])
            texts += [field["text"] for field in block.get("fields", [])]
    return texts


def buttons(msg: StoredMessage) -> list[dict[str, Any]]:
    return [e for b in msg.blocks if b.get("type") == "actions" for e in b["elements"]]


def assert_inert(texts: list[str]) -> None:
    for text in texts:
        assert "<!" not in text, text
        assert "<@" not in text, text
        # Any remaining '<' may only open the dashboard link we made ourselves.
        for match in re.finditer("<", text):
            assert text.startswith("<http://127.0.0.1:8765/", match.start()), text


def test_the_adapter_satisfies_the_contract(fake: FakeSlack) -> None:
    adapter = SlackAdapter(slack_config(fake))
    assert isinstance(adapter, PlatformAdapter)
    assert adapter.name == "slack"
    assert adapter.home_chat == HOME
    assert SlackAdapter(slack_config(fake, home_channel="")).home_chat is None


# -- inbound -----------------------------------------------------------------


async def test_message_and_app_mention_of_one_post_are_delivered_once(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    url = events_url(adapter)
    ts = fake.next_ts()
    text = f"<@{fake.bot_user_id}> ask @Builder to fix a &lt;b&gt; &amp; tag, cc <@{PERSON}|person>"
    mention = fake.message_event(
        channel=HOME, user=ADMIN, text=text, ts=ts, thread_ts="1700.000001", kind="app_mention"
    )
    plain = fake.message_event(channel=HOME, user=ADMIN, text=text, ts=ts, thread_ts="1700.000001")
    assert (await fake.post_event(url, mention)).status == 200
    assert (await fake.post_event(url, plain)).status == 200

    await logs.wait_for("slack.inbound_duplicate", ts=ts)
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
    (got,) = recorder.inbound
    assert got == Inbound(
        platform="slack",
        chat=HOME,
        message_id=ts,
        author=f"slack:{ADMIN}",
        author_name=ADMIN,
        text=f"<@{fake.bot_user_id}> ask @Builder to fix a <b> & tag, cc <@{PERSON}|person>",
        thread="1700.000001",
        mentions=(fake.bot_user_id.lower(), PERSON.lower(), "builder"),
        from_bot=False,
        command=None,
        is_admin=True,
        reply_to="1700.000001",  # a reply in a thread answers the thread's first message
        chat_title=f"#channel-{HOME.lower()}",  # conversations.info's name for the channel
    )


async def test_a_handled_request_leaves_the_levels_of_kazmas_loggers_alone(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    # Bolt sets its app's logger to the root's level of the moment on every request. The app was named "kazma", so
    # that logger was the parent of all of Kazma's: a request handled while the root stood at WARNING pinned every
    # kazma.* logger there, and their INFO events stayed hidden after the root was lowered (a later test waiting
    # for an INFO event timed out only when it ran after a Slack test in the same process).
    kazma = logging.getLogger("kazma")
    caplog.set_level(logging.WARNING)
    before = kazma.level
    await fake.post_event(events_url(adapter), fake.message_event(channel=HOME, user=PERSON, text="hello"))
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
    caplog.set_level(logging.INFO)
    structlog.get_logger("kazma.adapters.level_probe").info("slack.level_probe")
    assert (kazma.level, before) == (logging.NOTSET, logging.NOTSET)
    assert "slack.level_probe" in [r.getMessage() for r in caplog.records]


async def test_other_bots_posts_arrive_marked_and_edits_do_not(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    url = events_url(adapter)
    bot_post = fake.message_event(channel=OTHER, user="UOTHERBOT", text="@researcher go", bot_id="BOTHER001")
    edit = fake.message_event(channel=OTHER, user=PERSON, text="edited", subtype="message_changed")
    await fake.post_event(url, edit)
    await fake.post_event(url, bot_post)
    await logs.wait_for("slack.inbound_ignored", ts=edit["ts"])
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
    (got,) = recorder.inbound
    assert (got.chat, got.from_bot, got.is_admin, got.mentions) == (OTHER, True, False, ("researcher",))


async def test_our_own_posts_do_not_come_back(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    url = events_url(adapter)
    own = fake.message_event(channel=HOME, user=fake.bot_user_id, text="@builder step 1", bot_id=fake.bot_id)
    other = fake.message_event(channel=HOME, user=PERSON, text="after")
    await fake.post_event(url, own)
    await fake.post_event(url, other)
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
    assert [m.message_id for m in recorder.inbound] == [other["ts"]]
    # Bolt drops its own bot's events before any listener runs.
    assert not logs.matching("slack.inbound", ts=own["ts"])


async def test_forged_signatures_are_rejected_and_nothing_is_delivered(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    url = events_url(adapter)
    forged = await fake.post_event(url, fake.message_event(channel=HOME, user=ADMIN, text="forged"), bad_signature=True)
    forged_press = await fake.post_block_action(
        url, action_id=APPROVE_ACTION, value="kz1:abc:a", user=ADMIN, channel=HOME, message_ts="1.1", bad_signature=True
    )
    forged_command = await fake.post_command(url, text="stop", channel=HOME, user=ADMIN, bad_signature=True)
    stale = await fake.post_signed(
        url, '{"type":"event_callback","event":{"type":"message"}}', "application/json", timestamp=1_000_000_000
    )
    assert [forged.status, forged_press.status, forged_command.status, stale.status] == [401, 401, 401, 401]

    genuine = fake.message_event(channel=HOME, user=ADMIN, text="genuine")
    assert (await fake.post_event(url, genuine)).status == 200
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
    assert [m.text for m in recorder.inbound] == ["genuine"]
    assert recorder.presses == []


async def test_a_timestamp_that_is_not_a_number_is_refused_like_any_unverified_request(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    body = json.dumps(fake.event_envelope(fake.message_event(channel=HOME, user=ADMIN, text="forged")))
    headers = {"Content-Type": "application/json", "X-Slack-Request-Timestamp": "soon", "X-Slack-Signature": "v0=00"}
    url = events_url(adapter)
    with caplog.at_level(logging.ERROR):
        async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as response:
            assert (response.status, await response.json()) == (401, {"error": "invalid request"})
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    genuine = fake.message_event(channel=HOME, user=ADMIN, text="genuine")
    assert (await fake.post_event(events_url(adapter), genuine)).status == 200
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
    assert [m.text for m in recorder.inbound] == ["genuine"]


async def test_url_verification_is_answered(fake: FakeSlack, adapter: SlackAdapter) -> None:
    body = '{"token":"t","challenge":"kazma-challenge","type":"url_verification"}'
    response = await fake.post_signed(events_url(adapter), body, "application/json")
    assert response.status == 200
    assert "kazma-challenge" in response.body


async def test_swarm_command_is_acknowledged_before_it_is_handled(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    recorder.hold.clear()  # the handler will not finish until the test says so
    response = await fake.post_command(
        events_url(adapter), text="  run quick build a &lt;b&gt; &amp; CLI ", channel=OTHER, user=ADMIN, user_name="ada"
    )
    # The answer came back while the handler is still held: the ack did not wait for the work.
    assert response.status == 200
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 1)
    recorder.hold.set()
    (got,) = recorder.inbound
    assert got.command == "swarm"
    assert got.text == "run quick build a <b> & CLI"  # Slack's entities undone, as for messages
    assert (got.chat, got.author, got.author_name, got.is_admin) == (OTHER, f"slack:{ADMIN}", "ada", True)
    assert "trigger" in got.message_id  # Slack's trigger_id names the command


async def test_swarm_command_in_an_unserved_channel_is_refused_politely(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    response = await fake.post_command(events_url(adapter), text="status", channel=UNSERVED, user=ADMIN)
    assert response.status == 200
    assert "does not serve this chat" in response.body
    assert recorder.inbound == []


async def test_a_command_typed_in_a_dm_is_judged_by_dm_policy_not_by_the_channels(
    fake: FakeSlack, start_adapter: StartAdapter, recorder: Recorder
) -> None:
    # channels: ["*"] serves every channel the bot is in, never every person who writes to it: a slash command in
    # a DM was taken in as a channel's (direct=False), so dm_policy: off let anyone read the swarm through it.
    adapter = await start_adapter(config=slack_config(fake, channels=["*"], dm_policy="off"))
    response = await fake.post_command(events_url(adapter), text="tasks", channel="DPERSON01", user="UPERSON01")
    assert response.status == 200
    assert "does not serve this chat" in response.body
    assert recorder.inbound == []
    await adapter.stop()
    admitted = await start_adapter(config=slack_config(fake, dm_policy="approvers"))  # its admins among them
    response = await fake.post_command(events_url(admitted), text="tasks", channel="DADMIN001", user=ADMIN)
    assert response.status == 200
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 1)
    assert (recorder.inbound[0].chat, recorder.inbound[0].direct) == ("DADMIN001", True)


# -- cards ---------------------------------------------------------------------


async def test_card_shows_the_whole_call(fake: FakeSlack, adapter: SlackAdapter) -> None:
    long_value = "echo harmless; " + "x" * 9_969 + "; rm -rf / # END"
    assert len(long_value) == 10_000
    args = {"command": long_value, "cwd": "/srv/app", "env": {"A": "1"}, "timeout": 30}
    card = make_card(args)
    ref = await adapter.post_card(card)
    assert ref == CardRef(platform="slack", chat=HOME, message_id=ref.message_id, whole=False)

    msg = fake.message(HOME, ref.message_id)
    sections = "\n".join(section_texts(msg))
    for name in args:
        assert f"*{name}*" in sections
    command = next(t for t in section_texts(msg) if t.startswith("• *command*"))
    cut = card.arguments[0]
    assert cut.name == "command"
    assert cut.cut
    assert f"```{cut.head}```" in command
    assert f"```{cut.tail}```" in command
    assert command.endswith("; rm -rf / # END```")
    assert f"_{cut_marker(cut.original_length, cut.omitted)}_" in command
    assert f"{len(long_value):,}" in command
    assert "```/srv/app```" in sections
    assert '```{"A":"1"}```' in sections

    assert len(card.args_hash) == 64
    assert card.args_hash in sections
    assert f"<{card.link}|" in sections
    header = msg.block("kazma_title")
    assert header is not None
    assert header["text"]["text"] == "Approval needed: shell"
    # a value is cut, so the card is decided on the approval page: Deny only here
    assert [(b["action_id"], b["value"], b["style"], b["text"]["text"]) for b in buttons(msg)] == [
        (DENY_ACTION, f"kz1:{card.request_id}:d", "danger", "Deny"),
        ("kazma_deny_reason", f"kz1:{card.request_id}:n", "primary", "Deny with reason"),
    ]
    whole = await adapter.post_card(make_card({"cwd": "/srv/app"}))
    assert [(b["action_id"], b["style"]) for b in buttons(fake.message(HOME, whole.message_id))] == [
        (APPROVE_ACTION, "primary"),
        (DENY_ACTION, "danger"),
        ("kazma_deny_reason", "primary"),
    ]
    assert card.request_id in msg.text
    assert card.args_hash in msg.text
    assert all("link_names" not in call.params for call in fake.calls_to("chat.postMessage"))


async def test_markup_in_a_card_is_inert(fake: FakeSlack, adapter: SlackAdapter) -> None:
    args = {
        "channel_ping": "<!channel> deploy now",
        "here_ping": "<!here>",
        "everyone": "<!everyone> and @everyone and @here",
        "user_ping": "ask <@U123> or <@U123|bob>",
        "html": "<b>bold</b> <script>x</script>",
        "fence": "```\n*bold* _it_ ~st~ ``` `tick`",
        "amp": "a & b &amp; c &lt;!channel&gt;",
        "link": "<https://evil.example|click me>",
        "<@U999> name": "x",
    }
    card = make_card(args, tool="deploy<!here>", requester="builder <!channel>")
    ref = await adapter.post_card(card)
    msg = fake.message(HOME, ref.message_id)

    assert_inert(msg.texts())
    joined = "\n".join(msg.texts())
    for escaped in ("&lt;!channel&gt;", "&lt;!here&gt;", "&lt;!everyone&gt;", "&lt;@U123&gt;", "&lt;@U123|bob&gt;"):
        assert escaped in joined
    assert "&lt;b&gt;bold&lt;/b&gt;" in joined
    assert "a &amp; b &amp;amp; c &amp;lt;!channel&amp;gt;" in joined
    assert "&lt;https://evil.example|click me&gt;" in joined
    assert "*&lt;@U999&gt; name*" in joined
    assert "@everyone and @here" in joined  # plain words: Slack only pings through <!…> markup
    assert "&lt;!here&gt;" in msg.block("kazma_title")["text"]["text"]  # type: ignore[index]

    fence = next(t for t in section_texts(msg) if t.startswith("• *fence*"))
    assert fence.count("```") == 2  # the value cannot close our code block early
    assert fence.replace("\u200b", "") == "• *fence*\n``````\n*bold* _it_ ~st~ ``` `tick````"
    for block in msg.blocks:
        if block.get("type") == "section":
            for text_object in [*([block["text"]] if "text" in block else []), *block.get("fields", [])]:
                assert text_object["verbatim"] is True


async def test_sixty_long_arguments_fit_slack_limits_and_every_name_shows(
    fake: FakeSlack, adapter: SlackAdapter
) -> None:
    args = {f"arg_{i:02d}": f"{i:02d}<&>" + "v" * 1_990 + f"END{i:02d}" for i in range(60)}
    card = make_card(args, value_limit=2_000)
    ref = await adapter.post_card(card)
    msg = fake.message(HOME, ref.message_id)

    assert len(msg.blocks) <= 50
    assert all(len(t) <= 3000 for t in section_texts(msg))
    joined = "\n".join(section_texts(msg))
    for name in args:
        assert f"*{name}*" in joined
    shown = sum(1 for t in section_texts(msg) if t.startswith("• *arg_"))
    assert 0 < shown < 60
    assert "Part of this call is not shown here" in joined
    assert f"*Listed by name only ({60 - shown})*" in joined
    assert card.link in joined
    for name, text in zip(args, (t for t in section_texts(msg) if t.startswith("• *arg_")), strict=False):
        # Each shown value is whole: 2,000 characters fit a section even after escaping.
        assert text == f"• *{name}*\n```{args[name].replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')}```"
    assert [b["text"]["text"] for b in buttons(msg)] == [
        "Deny",
        "Deny with reason",
    ]  # not the whole call: approved on its page

    await adapter.settle_card(ref, card, outcome_for(card))
    assert len(fake.message(HOME, ref.message_id).blocks) <= 50


async def test_a_value_that_grows_when_escaped_is_shrunk_keeping_head_and_tail(
    fake: FakeSlack, adapter: SlackAdapter
) -> None:
    value = "HEAD" + "&" * 3_000 + "<TAIL>"
    card = make_card({"payload": value}, value_limit=4_000)
    assert not card.arguments[0].cut  # whole in the card model, too large only once escaped
    ref = await adapter.post_card(card)
    (text,) = [t for t in section_texts(fake.message(HOME, ref.message_id)) if t.startswith("• *payload*")]
    assert len(text) <= 3000
    assert text.startswith("• *payload*\n```HEAD&amp;")
    assert text.endswith("&amp;&lt;TAIL&gt;```")
    shown = re.search(r"_\[cut: ([\d,]+) of ([\d,]+) characters not shown\]_", text)
    assert shown is not None
    assert shown.group(2) == f"{len(value):,}"
    head, tail = text.split("_[cut:")[0], text.split("characters not shown]_")[1]
    visible = (head + tail).count("&amp;") + 4 + 6
    assert int(shown.group(1).replace(",", "")) == len(value) - visible


async def test_settle_replaces_buttons_with_the_outcome_and_repeats_cleanly(
    fake: FakeSlack, adapter: SlackAdapter
) -> None:
    card = make_card({"path": "/etc/hosts", "content": "127.0.0.1 example"})
    ref = await adapter.post_card(card)
    before = fake.message(HOME, ref.message_id).blocks
    outcome = outcome_for(card, Status.DENIED)

    await adapter.settle_card(ref, card, outcome)
    settled = fake.message(HOME, ref.message_id)
    assert "actions" not in settled.block_types()
    assert settled.blocks[0]["block_id"] == "kazma_outcome"
    assert outcome_line(outcome) in settled.blocks[0]["text"]["text"]
    assert settled.blocks[1:] == [b for b in before if b["type"] != "actions"]
    assert outcome_line(outcome) in settled.text

    await adapter.settle_card(ref, card, outcome)
    assert fake.message(HOME, ref.message_id).blocks == settled.blocks
    assert fake.message(HOME, ref.message_id).edits == 2


async def test_settling_a_missing_or_foreign_message_is_not_retryable(fake: FakeSlack, adapter: SlackAdapter) -> None:
    card = make_card({"x": 1})
    with pytest.raises(PlatformError) as missing:
        await adapter.settle_card(CardRef("slack", HOME, "1.000999"), card, outcome_for(card))
    assert (missing.value.retryable, "message_not_found" in str(missing.value)) == (False, True)
    human = fake.add_user_message(HOME, "a person's message")
    with pytest.raises(PlatformError) as foreign:
        await adapter.settle_card(CardRef("slack", HOME, human.ts), card, outcome_for(card))
    assert (foreign.value.retryable, "cant_update_message" in str(foreign.value)) == (False, True)


# -- presses ---------------------------------------------------------------------


async def _posted_card(adapter: SlackAdapter) -> tuple[ApprovalCard, CardRef]:
    card = make_card({"x": 1})
    return card, await adapter.post_card(card)


async def _refuse_the_token_known(fake: FakeSlack, adapter: SlackAdapter) -> None:
    """Revoke the bot token and let the adapter learn it from a refused send."""
    fake.revoke(fake.bot_token, "token_revoked")
    with pytest.raises(PlatformError):
        await adapter.send_text(HOME, "the refusal, known")


def _approve_payload(fake: FakeSlack, card: ApprovalCard, ref: CardRef) -> dict[str, Any]:
    return fake.block_action_payload(
        action_id=APPROVE_ACTION,
        value=card.button_data(Decision.APPROVE),
        user=ADMIN,
        channel=HOME,
        message_ts=ref.message_id,
    )


async def _post_press(fake: FakeSlack, adapter: SlackAdapter, payload: dict[str, Any]) -> SignedResponse:
    form = urlencode({"payload": json.dumps(payload)})
    return await fake.post_signed(events_url(adapter), form, "application/x-www-form-urlencoded")


async def _press_approve(fake: FakeSlack, adapter: SlackAdapter, card: ApprovalCard, ref: CardRef) -> SignedResponse:
    """ADMIN presses Approve on the posted card."""
    return await _post_press(fake, adapter, _approve_payload(fake, card, ref))


async def _ask_reason_form(
    fake: FakeSlack, adapter: SlackAdapter, card: ApprovalCard, ref: CardRef, *, user: str
) -> SignedResponse:
    return await fake.post_block_action(
        events_url(adapter),
        action_id=DENY_REASON_ACTION,
        value=f"kz1:{card.request_id}:n",
        user=user,
        channel=HOME,
        message_ts=ref.message_id,
    )


async def _told_privately(fake: FakeSlack) -> dict[str, Any]:
    """The one answer posted to the press's response URL, checked to be an ephemeral that leaves the card."""
    await fake.wait_for(lambda: len(fake.responses) == 1)
    said = fake.responses[0]
    assert (said["response_type"], said["replace_original"]) == ("ephemeral", False)
    return said


async def test_press_is_acknowledged_first_then_handed_to_the_approvals_layer(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    card, ref = await _posted_card(adapter)
    recorder.hold.clear()
    response = await _press_approve(fake, adapter, card, ref)
    # Answered while on_press is still held: the ack did not wait for the decision.
    assert response.status == 200
    await recorder.signal.wait_until(lambda: len(recorder.presses) == 1)
    assert [(p.data, p.actor, p.chat, p.message_id) for p in recorder.presses] == [
        (f"kz1:{card.request_id}:a", f"slack:{ADMIN}", HOME, ref.message_id)
    ]
    recorder.hold.set()
    await logs.wait_for("platform.press_result", platform="slack", verdict="won")
    assert fake.ephemerals == []  # a winning press is answered by the edited card


async def test_every_button_a_card_or_question_shows_is_handed_over_and_no_other(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    # The card's three buttons share one listener (the first Bolt tries); a question's choices have their own.
    card = make_card({"x": 1})
    ref = await adapter.post_card(card)
    pressed = [APPROVE_ACTION, DENY_ACTION, REMEMBER_ACTION, "kazma_choice_0", "kazma_choice_12"]

    def handed_over(count: int) -> Callable[[], bool]:
        return lambda: len(recorder.presses) == count

    for n, action_id in enumerate([*pressed, "kazma_approved", "my_kazma_deny", "kazma_choice_x"]):
        response = await fake.post_block_action(
            events_url(adapter), action_id=action_id, value=f"v{n}", user=ADMIN, channel=HOME, message_ts=ref.message_id
        )
        assert (action_id, response.status) == (action_id, 200 if action_id in pressed else 404)
        if action_id in pressed:
            await recorder.signal.wait_until(handed_over(n + 1))
    assert [p.data for p in recorder.presses] == [f"v{n}" for n in range(len(pressed))]


# -- sending text ------------------------------------------------------------------


async def test_agent_posts_under_its_own_name_with_text_escaped(fake: FakeSlack, adapter: SlackAdapter) -> None:
    ts = await adapter.send_text(OTHER, "@builder please check <!here> & <@U123>", agent="kazma", thread="1700.1")
    msg = fake.message(OTHER, ts)
    assert (msg.username, msg.icon_emoji, msg.thread_ts) == ("kazma", ":robot_face:", "1700.1")
    assert msg.text == "@builder please check &lt;!here&gt; &amp; &lt;@U123&gt;"
    assert "link_names" not in fake.calls_to("chat.postMessage")[0].params


async def test_agent_name_falls_back_to_a_prefix_without_the_customize_scope(
    fake: FakeSlack, adapter: SlackAdapter
) -> None:
    fake.allow_customize = False
    first = await adapter.send_text(OTHER, "one <b>", agent="builder")
    second = await adapter.send_text(OTHER, "two", agent="builder")
    assert fake.message(OTHER, first).text == "[builder] one &lt;b&gt;"
    assert fake.message(OTHER, second).text == "[builder] two"
    assert fake.message(OTHER, first).username is None
    # After the first refusal the adapter stops asking for an identity it does not have.
    assert [c.error for c in fake.calls_to("chat.postMessage")] == ["missing_scope", None, None]


async def test_sends_into_one_channel_are_paced(fake: FakeSlack, start_adapter: StartAdapter) -> None:
    now = [1000.0]
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    limiter = ChatRateLimiter(min_interval=1.0, clock=lambda: now[0], sleep=sleep)
    adapter = await start_adapter(limiter=limiter)
    await adapter.send_text(HOME, "a")
    await adapter.send_text(OTHER, "b")
    await adapter.send_text(HOME, "c")
    await adapter.post_card(make_card({"x": 1}))
    assert sleeps == [1.0, 1.0]
    assert len(fake.channel(HOME)) == 3


# -- failures ----------------------------------------------------------------------


async def test_rate_limit_is_waited_out_by_the_kit_and_delivered(fake: FakeSlack, adapter: SlackAdapter) -> None:
    fake.fail("chat.postMessage", "429", retry_after=0)
    ts = await adapter.send_text(HOME, "eventually")
    assert fake.message(HOME, ts).text == "eventually"
    assert [c.status for c in fake.calls_to("chat.postMessage")] == [429, 200]


async def test_rate_limit_surviving_retries_blocks_the_channel(fake: FakeSlack, start_adapter: StartAdapter) -> None:
    limiter = ChatRateLimiter(min_interval=0.0, clock=lambda: 5000.0)
    adapter = await start_adapter(limiter=limiter, max_attempts=1)
    fake.fail("chat.postMessage", "429", retry_after=7)
    before = failure_count("send", "slack")
    with pytest.raises(PlatformError) as info:
        await adapter.send_text(HOME, "too fast")
    assert (info.value.retryable, info.value.retry_after) == (True, 7.0)
    # the card outbox and the log keep the words: they say the wait Slack asked for, not only "ratelimited"
    assert str(info.value) == "slack send: rate limited: ratelimited (retry after 7 s)"
    assert limiter.delay_for(HOME) == 7.0
    assert limiter.delay_for(OTHER) == 0.0
    assert failure_count("send", "slack") == before + 1

    card = make_card({"x": 1})
    ref = CardRef("slack", OTHER, fake.add_user_message(OTHER, "x").ts)
    fake.fail("chat.update", "429", retry_after=3)
    with pytest.raises(PlatformError) as update:
        await adapter.settle_card(ref, card, outcome_for(card))
    assert (update.value.retryable, update.value.retry_after) == (True, 3.0)
    # chat.update is limited per method, not per channel: new posts there are not held.
    assert limiter.delay_for(OTHER) == 0.0


@pytest.mark.parametrize("site", ["send", "card_post", "card_settle"])
async def test_server_errors_are_retryable(fake: FakeSlack, adapter: SlackAdapter, site: str) -> None:
    card = make_card({"x": 1})
    ref = await adapter.post_card(card)
    before = failure_count(site, "slack")
    operations: dict[str, tuple[str, Callable[[], Awaitable[object]]]] = {
        "send": ("chat.postMessage", lambda: adapter.send_text(HOME, "x")),
        "card_post": ("chat.postMessage", lambda: adapter.post_card(card)),
        "card_settle": ("chat.update", lambda: adapter.settle_card(ref, card, outcome_for(card))),
    }
    method, operation = operations[site]
    fake.fail(method, "500")
    with pytest.raises(PlatformError) as info:
        await operation()
    assert (info.value.retryable, info.value.site) == (True, site)
    assert failure_count(site, "slack") == before + 1


async def test_a_card_post_whose_answer_was_lost_is_not_posted_again_unmarked(
    fake: FakeSlack, adapter: SlackAdapter
) -> None:
    """Slack posted the card and the connection dropped before its answer: the post fails (retryable), so the bus
    posts it again marked as a repost, never a silent second copy with live buttons nobody settles."""
    card = make_card({"command": "deploy"})
    before = failure_count("card_post", "slack")
    fake.fail("chat.postMessage", "lost")
    with pytest.raises(PlatformError) as info:
        await adapter.post_card(card)
    assert (info.value.retryable, info.value.site) == (True, "card_post")
    assert failure_count("card_post", "slack") == before + 1
    assert len(fake.channel(HOME)) == 1  # the one Slack posted; nothing posted behind the bus's back
    # Texts are not posted again by anyone else, so their client still repeats a post whose answer was lost.
    fake.fail("chat.postMessage", "lost")
    await adapter.send_text(HOME, "the agent's answer")
    assert [m.text for m in fake.channel(HOME)][1:] == ["the agent's answer"] * 2


async def test_a_hanging_slack_is_a_retryable_timeout(fake: FakeSlack, adapter: SlackAdapter) -> None:
    fake.fail("chat.postMessage", "hang")
    with pytest.raises(PlatformError) as info:
        await adapter.send_text(HOME, "anyone there?")
    assert info.value.retryable is True
    assert fake.calls_to("chat.postMessage")[0].error == "hang"


async def test_other_api_errors_are_not_retryable(fake: FakeSlack, adapter: SlackAdapter) -> None:
    fake.fail("chat.postMessage", "error", error="channel_not_found")
    with pytest.raises(PlatformError) as info:
        await adapter.send_text(HOME, "x")
    assert info.value.retryable is False
    assert "channel_not_found" in str(info.value)


@pytest.mark.parametrize("code", ["invalid_auth", "token_revoked", "account_inactive", "not_authed"])
async def test_a_token_slack_refuses_while_running_fails_every_later_call_at_once_naming_the_fix(
    fake: FakeSlack, adapter: SlackAdapter, code: str
) -> None:
    """Slack refused the bot token on a call (revoked, the app uninstalled): each later call asked Slack again with
    it, and each failure said only the code. Now the first refusal turns Slack off for this process: every later
    call fails at once with the operator's fix, and nothing more is sent with that token. Retryable: a card's post
    or edit waits in the outbox for the restart with a new token (tests/test_healthz_platforms.py)."""
    fake.fail("chat.postMessage", "error", error=code)
    before = failure_count("token_refused", "slack")
    with pytest.raises(PlatformError) as info:
        await adapter.send_text(HOME, "x")
    assert (info.value.retryable, info.value.operator_must_act) == (True, True)
    assert f"Slack refused the bot token ({code} on chat.postMessage)" in str(info.value)
    assert "platforms.slack.bot_token" in str(adapter.setup_refused)
    calls = len(fake.calls)
    with pytest.raises(PlatformError) as later:
        await adapter.post_card(make_card({"x": 1}))
    assert (later.value.site, later.value.retryable, later.value.operator_must_act) == ("card_post", True, True)
    assert "reinstall the app to the workspace" in str(later.value)
    assert len(fake.calls) == calls
    assert failure_count("token_refused", "slack") == before + 1


async def test_a_bot_token_refused_on_a_channels_name_turns_slack_off_and_the_message_still_arrives(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    """In HTTP mode events still come (they are signed with the signing secret, not the token): the first sign of a
    revoked bot token may be the channel-name lookup of an arriving message. It is the same refusal, said there;
    the message goes on without the name, and the reply is refused at once with the fix."""
    # An earlier message, so this one's channel name is asked of Slack first with the refused token.
    await fake.post_event(events_url(adapter), fake.message_event(channel=OTHER, user=PERSON, text="earlier"))
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 1)
    fake.revoke(fake.bot_token, "account_inactive")
    await fake.post_event(events_url(adapter), fake.message_event(channel=HOME, user=PERSON, text="hello"))
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 2)
    assert recorder.inbound[1].text == "hello"
    assert [c.error for c in fake.calls_to("conversations.info")] == [None, "account_inactive"]
    assert str(adapter.setup_refused).startswith("Slack refused the bot token (account_inactive on conversations.info)")
    with pytest.raises(PlatformError) as info:
        await adapter.send_text(HOME, "the answer")
    assert info.value.operator_must_act
    assert fake.calls_to("chat.postMessage") == []


async def test_a_bot_token_refused_before_the_first_request_loses_no_press_or_message(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    """Bolt asked auth.test with the bot token at the first signed request it was handed and kept only a good
    answer: revoked before this process's first event (a replica that had seen nothing yet), every press and
    message was answered "Please install this app" and dropped before any listener, uncounted, and Slack still
    "serving". A press is signed with the signing secret: it reaches the decision as before the refusal, and the
    message its agent; Bolt asks Slack nothing of its own."""
    card, ref = await _posted_card(adapter)
    fake.revoke(fake.bot_token, "token_revoked")
    response = await _press_approve(fake, adapter, card, ref)
    assert (response.status, response.body) == (200, "")
    await recorder.signal.wait_until(lambda: len(recorder.presses) == 1)
    assert (recorder.presses[0].data, recorder.presses[0].actor) == (f"kz1:{card.request_id}:a", f"slack:{ADMIN}")
    await fake.post_event(events_url(adapter), fake.message_event(channel=HOME, user=PERSON, text="still here"))
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 1)
    assert recorder.inbound[0].text == "still here"
    assert [c.error for c in fake.calls_to("auth.test")] == [None]  # the start's, and no other


@pytest.mark.parametrize("verdict", [PressVerdict.WON, PressVerdict.LOST])
async def test_a_presser_is_told_through_the_response_url_while_slack_refuses_the_bot_token(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, verdict: PressVerdict
) -> None:
    """With the bot token refused a press still decides, but its card is not edited and chat.postEphemeral is
    refused too: the presser saw the buttons stay and heard nothing, whether their press decided or not. The
    press's response URL needs no token: they are told there, and that the card stays as it is."""
    card, ref = await _posted_card(adapter)
    await _refuse_the_token_known(fake, adapter)
    recorder.press_result = PressResult(verdict, f"{verdict.value} <here>", request_id=card.request_id)
    await _press_approve(fake, adapter, card, ref)
    said = await _told_privately(fake)
    assert said["text"] == f"{verdict.value} &lt;here&gt; {slack_adapter.CARD_NOT_EDITED}"
    assert fake.calls_to("chat.postEphemeral") == []  # refused at once, not asked


@contextlib.asynccontextmanager
async def forwarding_proxy() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP proxy that forwards each request and keeps the URL it was asked for."""
    asked: list[str] = []

    async def forward(request: web.Request) -> web.Response:
        asked.append(str(request.url))
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, request.url, data=await request.read(), headers=request.headers) as got,
        ):
            return web.Response(status=got.status, body=await got.read())

    server = web.Application()
    server.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(server)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", asked
    finally:
        await runner.cleanup()


async def test_a_press_reply_through_the_response_url_goes_through_the_configured_proxy(
    fake: FakeSlack, start_adapter: StartAdapter, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slack's Web API calls go through HTTP(S)_PROXY (slack_sdk reads it) unless NO_PROXY names the host, but the
    press's response URL was posted to directly: where the only way out is the proxy, the presser told there while
    Slack refuses the bot token heard nothing. It goes the Web API's way now."""
    async with forwarding_proxy() as (proxy, asked):
        monkeypatch.setenv("HTTP_PROXY", proxy)
        for name in ("NO_PROXY", "no_proxy"):  # the fake's API straight; its other name through the proxy
            monkeypatch.setenv(name, "127.0.0.1")
        adapter = await start_adapter()
        card, ref = await _posted_card(adapter)
        await _refuse_the_token_known(fake, adapter)
        payload = _approve_payload(fake, card, ref)
        payload["response_url"] = str(payload["response_url"]).replace("127.0.0.1", "localhost")
        assert (await _post_press(fake, adapter, payload)).status == 200
        await fake.wait_for(lambda: len(fake.responses) == 1)
        assert asked == [payload["response_url"]]


@pytest.mark.parametrize("verdict", [PressVerdict.LOST, PressVerdict.REFUSED])
async def test_the_first_press_after_the_bot_token_is_revoked_is_told_through_the_response_url(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, verdict: PressVerdict
) -> None:
    """The first press after a revocation: Kazma does not know yet that the token is refused, so the press's notice
    went to chat.postEphemeral, whose refusal is what revealed it, and the presser heard nothing. Told now through
    the press's response URL as soon as that refusal is seen."""
    card, ref = await _posted_card(adapter)
    fake.revoke(fake.bot_token, "token_revoked")
    recorder.press_result = PressResult(verdict, "Not yours <here>.", request_id=card.request_id)
    await _press_approve(fake, adapter, card, ref)
    said = await _told_privately(fake)
    assert said["text"] == f"Not yours &lt;here&gt;. {slack_adapter.CARD_NOT_EDITED}"
    assert [c.error for c in fake.calls_to("chat.postEphemeral")] == ["token_revoked"]  # what revealed it
    assert adapter.setup_refused is not None


async def test_the_winner_of_the_first_press_after_a_revocation_is_told_when_the_card_edit_is_refused(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    """The winner's answer is the card edit. The first press after a revocation decided while Kazma did not know the
    token was refused; the edit after it was refused (which revealed it): the card kept its buttons and the winner
    heard nothing. The winner waiting on that edit is told through the press's response URL once it is refused."""
    card, ref = await _posted_card(adapter)
    fake.revoke(fake.bot_token, "token_revoked")
    recorder.press_result = PressResult(PressVerdict.WON, "Approved <now>.", request_id=card.request_id)
    await _press_approve(fake, adapter, card, ref)
    await logs.wait_for("platform.press_result")  # answered: the winner waits on the card edit
    assert fake.responses == []
    with pytest.raises(PlatformError):
        await adapter.settle_card(ref, card, outcome_for(card))
    said = await _told_privately(fake)
    assert said["text"] == f"Approved &lt;now&gt;. {slack_adapter.CARD_NOT_EDITED}"
    with pytest.raises(PlatformError):  # told once: a second refusal tells nobody again
        await adapter.settle_card(ref, card, outcome_for(card))
    await adapter.stop()
    assert len(fake.responses) == 1


async def test_the_winner_whose_card_was_edited_is_not_told_of_a_later_refusal(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    """A winner whose card was edited heard their answer there: a refusal of the token later tells them nothing."""
    card, ref = await _posted_card(adapter)
    recorder.press_result = PressResult(PressVerdict.WON, "Approved.", request_id=card.request_id)
    await _press_approve(fake, adapter, card, ref)
    await logs.wait_for("platform.press_result")
    await adapter.settle_card(ref, card, outcome_for(card))
    await _refuse_the_token_known(fake, adapter)
    await adapter.stop()
    assert fake.responses == []


async def _reason_view(fake: FakeSlack, adapter: SlackAdapter, card: ApprovalCard, ref: CardRef) -> dict[str, Any]:
    await _ask_reason_form(fake, adapter, card, ref, user=ADMIN)
    await fake.wait_for(lambda: len(fake.views) == 1)
    return fake.views[0]


@pytest.mark.parametrize("verdict", [PressVerdict.WON, PressVerdict.LOST])
async def test_a_reason_submitted_while_slack_refuses_the_bot_token_is_answered_in_the_modal(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, verdict: PressVerdict
) -> None:
    """A view submission carries no response URL, and with the bot token refused the card is not edited and
    chat.postEphemeral is refused: the modal closed and the presser heard nothing of their Deny. The ack of the
    submission needs no token: the modal is replaced with what their Deny did."""
    card, ref = await _posted_card(adapter)
    view = await _reason_view(fake, adapter, card, ref)
    await _refuse_the_token_known(fake, adapter)
    recorder.press_result = PressResult(verdict, f"{verdict.value} <here>", request_id=card.request_id)
    answered = await fake.post_view_submission(
        events_url(adapter), view=view, user=ADMIN, values={"kazma_reason": {"reason": "no"}}
    )
    assert answered.status == 200
    assert [p.reason for p in recorder.presses] == ["no"]
    said = json.loads(answered.body)
    assert said["response_action"] == "update"
    shown = json.dumps(said["view"]["blocks"])
    assert escape(f"{verdict.value} <here>") in shown
    assert escape(slack_adapter.CARD_NOT_EDITED) in shown
    assert said["view"]["type"] == "modal"
    assert fake.calls_to("chat.postEphemeral") == []


async def test_deny_with_reason_while_slack_refuses_the_bot_token_says_the_form_cannot_open(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    """ "Deny with reason" opens a modal with views.open, which the refused bot token cannot: the listener failed
    with the refusal and the presser saw nothing happen. They are told through the press's response URL that the
    form cannot open and to press Deny; nothing is decided."""
    card, ref = await _posted_card(adapter)
    await _refuse_the_token_known(fake, adapter)
    await _ask_reason_form(fake, adapter, card, ref, user=ADMIN)
    await fake.wait_for(lambda: len(fake.responses) == 1)
    assert fake.responses[0]["response_type"] == "ephemeral"
    assert fake.responses[0]["text"] == slack_adapter.REASON_FORM_REFUSED
    assert (fake.calls_to("views.open"), fake.views, recorder.presses) == ([], [], [])


async def test_a_press_reply_slack_does_not_take_counts_once(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder, logs: LogWatch
) -> None:
    """The kit counts a failed call at its site (press_reply), and the press policy counted the same failure again
    when the reply failed: a press whose response URL answered 404, or whose chat.postEphemeral Slack refused, read
    as 2 on kazma_failures_total{site="press_reply",platform="slack"}. Once each now."""
    card, ref = await _posted_card(adapter)
    recorder.press_result = PressResult(PressVerdict.LOST, "Decided already.", request_id=card.request_id)
    fake.fail("chat.postEphemeral", "error", error="user_not_in_channel")
    before = failure_count("press_reply", "slack")
    await _press_approve(fake, adapter, card, ref)
    await logs.signal.wait_until(lambda: len(logs.matching("platform.press_reply_failed")) == 1)
    assert [c.error for c in fake.calls_to("chat.postEphemeral")] == ["user_not_in_channel"]
    await _refuse_the_token_known(fake, adapter)
    payload = _approve_payload(fake, card, ref)
    payload["response_url"] = f"{fake.url}/respond-gone"  # expired: Slack answers 404
    assert (await _post_press(fake, adapter, payload)).status == 200
    await logs.signal.wait_until(lambda: len(logs.matching("platform.press_reply_failed")) == 2)
    assert len(recorder.presses) == 2
    assert failure_count("press_reply", "slack") == before + 2


async def test_an_unserved_deny_with_reason_while_slack_refuses_the_bot_token_is_told_through_the_response_url(
    fake: FakeSlack, recorder: Recorder
) -> None:
    """ "Deny with reason" from someone whose press would not count is told so privately instead of a form, with
    chat.postEphemeral, which a refused bot token cannot send: they saw nothing happen. The press's response URL
    needs no token: they are told there."""

    async def may_decide(actor: str, platform: str, request_id: str) -> bool:
        return actor != f"slack:{PERSON}"

    adapter = SlackAdapter(slack_config(fake), request_timeout=1)
    await adapter.start(Handlers(on_inbound=recorder.on_inbound, on_press=recorder.on_press, may_decide=may_decide))
    try:
        card, ref = await _posted_card(adapter)
        await _refuse_the_token_known(fake, adapter)
        await _ask_reason_form(fake, adapter, card, ref, user=PERSON)
        await fake.wait_for(lambda: len(fake.responses) == 1)
        assert fake.responses[0]["response_type"] == "ephemeral"
        assert fake.responses[0]["text"].startswith(escape(NOT_YOURS))
        assert (fake.calls_to("views.open"), fake.calls_to("chat.postEphemeral"), recorder.presses) == ([], [], [])
    finally:
        await adapter.stop()


@pytest.mark.parametrize(
    ("kind", "code"),
    [("error", "ratelimited"), ("error", "fatal_error"), ("500", ""), ("error", "not_in_channel"),
     ("error", "channel_not_found"), ("error", "missing_scope")],
)  # fmt: skip
async def test_a_refusal_that_is_not_the_tokens_leaves_slack_on(
    fake: FakeSlack, adapter: SlackAdapter, kind: Literal["error", "500"], code: str
) -> None:
    """Slack's moment (rate limited, a fatal_error, a 5xx), one channel, or a scope: the next call still asks."""
    fake.fail("chat.postMessage", kind, error=code, retry_after=0)
    with contextlib.suppress(PlatformError):
        await adapter.send_text(HOME, "x")
    assert adapter.setup_refused is None
    await adapter.send_text(HOME, "y")
    assert [m.text for m in fake.channel(HOME)][-1] == "y"


async def test_a_bad_token_fails_start(fake: FakeSlack, recorder: Recorder) -> None:
    adapter = SlackAdapter(slack_config(fake, bot_token="xoxb-not-the-token"))
    with pytest.raises(PlatformError) as info:
        await adapter.start(recorder.handlers())
    assert info.value.retryable is False
    assert "invalid_auth" in str(info.value)
    await adapter.stop()


# -- Socket Mode -------------------------------------------------------------------


async def test_socket_mode_delivers_events_commands_and_presses(
    fake: FakeSlack, start_adapter: StartAdapter, recorder: Recorder
) -> None:
    config = slack_config(fake, app_token=fake.app_token, signing_secret="")
    adapter = await start_adapter(config=config)
    assert adapter.events_url is None  # no HTTP server in Socket Mode
    assert fake.socket_connected
    assert [c.token for c in fake.calls_to("apps.connections.open")] == [fake.app_token]

    event = fake.message_event(channel=HOME, user=ADMIN, text="over the socket")
    assert await fake.socket_send("events_api", fake.event_envelope(event)) is None
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 1)
    assert (recorder.inbound[0].message_id, recorder.inbound[0].text) == (event["ts"], "over the socket")

    recorder.hold.clear()
    form = fake.command_form(text="status", channel=HOME, user=ADMIN)
    # Acknowledged while the handler is still held.
    assert not await fake.socket_send("slash_commands", form)
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 2)
    recorder.hold.set()
    assert recorder.inbound[1].command == "swarm"

    recorder.press_result = PressResult(PressVerdict.LOST, "Already denied.")
    payload = fake.block_action_payload(
        action_id=DENY_ACTION, value="kz1:abc:d", user=PERSON, channel=HOME, message_ts="1.1"
    )
    await fake.socket_send("interactive", payload)
    await fake.wait_for(lambda: len(fake.ephemerals) == 1)
    assert [(p.data, p.actor) for p in recorder.presses] == [("kz1:abc:d", f"slack:{PERSON}")]
    assert (fake.ephemerals[0].user, fake.ephemerals[0].text) == (PERSON, "Already denied.")

    await adapter.stop()
    await fake.wait_for(lambda: not fake.socket_connected)


async def test_a_socket_that_closed_and_does_not_open_again_is_said_as_the_inbound_failing_until_it_opens(
    fake: FakeSlack, start_adapter: StartAdapter, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slack closed the socket and apps.connections.open failed from then on (Slack's fault): slack_sdk tried again
    every ping and said so only in its own log, and /healthz said Slack served while nothing came in."""
    monkeypatch.setattr(slack_adapter, "SOCKET_PING_SECONDS", 0.2)
    adapter = await start_adapter(config=slack_config(fake, app_token=fake.app_token, signing_secret=""))
    assert ingress_trouble(adapter) is None
    fake.fail("apps.connections.open", "error", times=1_000_000, error="internal_error")
    assert await fake.drop_sockets() == 1
    async with asyncio.timeout(20):
        while ingress_trouble(adapter) is None:
            await asyncio.sleep(0.02)
    trouble = ingress_trouble(adapter)  # what the bus says on /healthz: "platform slack: inbound failing (...)"
    assert trouble is not None
    assert trouble.startswith("Socket Mode's connection failed "), trouble
    assert "slack_sdk opening it again every 0.2 s" in trouble
    assert "internal_error" in trouble  # why, from slack_sdk's own log

    fake.heal("apps.connections.open")
    async with asyncio.timeout(20):
        while ingress_trouble(adapter) is not None:
            await asyncio.sleep(0.02)
    event = fake.message_event(channel=HOME, user=ADMIN, text="over the socket opened again")
    assert await fake.socket_send("events_api", fake.event_envelope(event)) is None
    await recorder.signal.wait_until(lambda: len(recorder.inbound) == 1)
    assert recorder.inbound[0].text == "over the socket opened again"


async def test_an_app_token_slack_refuses_while_running_is_not_asked_again_and_says_the_fix(
    fake: FakeSlack,
    start_adapter: StartAdapter,
    logs: LogWatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The app-level token revoked while Kazma ran: Slack closed the socket and answered apps.connections.open
    invalid_auth. slack_sdk asked again every ping (10 s) for ever, each time with two error lines of its own, and
    /healthz said only that the socket was found closed, naming no fix. Now the refusal is said once, nothing asks
    Slack with that token again, and the inbound trouble says which token and what to do; posting (the bot
    token's) goes on."""
    monkeypatch.setattr(slack_adapter, "SOCKET_PING_SECONDS", 0.05)
    adapter = await start_adapter(config=slack_config(fake, app_token=fake.app_token, signing_secret=""))
    before = failure_count("token_refused", "slack")
    fake.revoke(fake.app_token, "invalid_auth")
    assert await fake.drop_sockets() == 1
    await logs.wait_for("slack.token_refused")
    await asyncio.sleep(1.0)  # twenty pings: slack_sdk asked for a new socket at each before
    assert [c.error for c in fake.calls_to("apps.connections.open")] == [None, "invalid_auth"]
    assert failure_count("token_refused", "slack") == before + 1
    assert len(logs.matching("slack.token_refused")) == 1
    trouble = ingress_trouble(adapter)
    assert trouble is not None
    assert trouble.startswith("Socket Mode's connection failed and is not tried again: Slack refused the app-level "
                              "token (invalid_auth on apps.connections.open)"), trouble  # fmt: skip
    assert trouble.endswith("put it in platforms.slack.app_token and restart Kazma"), trouble
    assert adapter.setup_refused is None  # the bot token still posts
    await adapter.send_text(HOME, "still posting")
    assert [m.text for m in fake.channel(HOME)][-1] == "still posting"
    # Leading again later (a replica handed the lead back): refused at once, without asking Slack.
    await adapter.stop_ingress()
    with pytest.raises(PlatformError) as info:
        await adapter.start_ingress()
    assert (info.value.retryable, info.value.operator_must_act) == (False, True)
    assert "platforms.slack.app_token" in str(info.value)
    assert len(fake.calls_to("apps.connections.open")) == 2


async def test_socket_mode_with_a_bad_app_token_fails_start(fake: FakeSlack, recorder: Recorder) -> None:
    adapter = SlackAdapter(slack_config(fake, app_token="xapp-1-wrong", signing_secret=""), request_timeout=1)
    with pytest.raises(PlatformError) as info:
        await adapter.start(recorder.handlers())
    assert info.value.retryable is False
    assert "invalid_auth" in str(info.value)
    assert not fake.socket_connected


class _DebugLines(logging.Handler):
    """Every record slack-sdk's client logger hands on, whatever its level."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("level", [logging.WARNING, logging.DEBUG])
async def test_slack_sdk_formats_its_debug_lines_only_when_debug_logging_is_on(
    start_adapter: StartAdapter, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # slack-sdk tests its logger's own level (``logger.level <= DEBUG``), 0 when unset: it built a debug line of
    # every request's and answer's parameters (a card's blocks, both ways) at any log level.
    sdk = logging.getLogger("slack_sdk")
    monkeypatch.setattr(sdk, "level", level)
    seen = _DebugLines()
    sdk.addHandler(seen)
    formatted: list[str] = []
    original = logging.Logger.debug

    def counted(self: logging.Logger, msg: object, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith("slack_sdk.web"):
            formatted.append(str(msg))
        original(self, msg, *args, **kwargs)

    monkeypatch.setattr(logging.Logger, "debug", counted)
    try:
        adapter = await start_adapter()
        card = make_card({"path": "/etc/hosts"})
        ref = await adapter.post_card(card)
        await adapter.settle_card(ref, card, outcome_for(card))
    finally:
        sdk.removeHandler(seen)
    requests = [line for line in formatted if line.startswith("Sending a request")]
    if level == logging.DEBUG:
        assert len(requests) >= 3  # auth.test, the post, the edit: the debug lines are still there when wanted
        assert any("chat.update" in line for line in seen.lines)
    else:
        assert requests == []  # not even formatted


async def test_a_long_title_is_cut_before_an_escape_never_inside_one(fake: FakeSlack, adapter: SlackAdapter) -> None:
    # Escaped first and cut after, a title of "<" and "&" ended in half an entity ("&l…"); each start of the cut
    # (one to five characters of a five-character escape) is tried.
    for pad in range(5):
        card = make_card({"cwd": "/srv"}, tool="t" * pad + "<&" * 80)
        ref = await adapter.post_card(card)
        msg = fake.message(HOME, ref.message_id)
        header = msg.block("kazma_title")["text"]["text"]  # type: ignore[index]
        assert len(header) <= 150
        assert header.endswith("…")
        body = header.removeprefix("Approval needed: " + "t" * pad).removesuffix("…")
        assert re.fullmatch(r"(&lt;|&amp;)*", body), header[-12:]
        assert len(msg.text) <= 3000
        assert re.search(r"&[a-z]{0,3}…", msg.text) is None


async def shared_file(fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder) -> Attachment:
    """A file a person shares in the home channel, as the adapter hands it over (not yet fetched)."""
    shared = fake.add_file("build.log", b"line 1\n")
    event = fake.file_event(channel=HOME, user=PERSON, text="the log", files=[shared])
    assert (await fake.post_event(events_url(adapter), event)).status == 200
    await recorder.signal.wait_until(lambda: bool(recorder.inbound))
    [attachment] = recorder.inbound[0].attachments
    return attachment


async def test_a_file_download_slack_could_not_serve_is_retryable(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    attachment = await shared_file(fake, adapter, recorder)
    fake.fail(FILE_DOWNLOAD, "500")
    with pytest.raises(PlatformError) as info:
        await attachment.fetch()
    assert (info.value.retryable, info.value.site) == (True, "file_fetch")
    assert "503" in str(info.value)
    assert await attachment.fetch() == b"line 1\n"  # Slack is back: the same file comes


async def test_a_rate_limited_file_download_is_waited_out(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    attachment = await shared_file(fake, adapter, recorder)
    fake.fail(FILE_DOWNLOAD, "429", retry_after=0)
    assert await attachment.fetch() == b"line 1\n"
    assert len(fake.downloads) == 2


async def test_a_401_on_a_file_download_is_said_as_the_downloads_and_leaves_the_bot_token_in_use(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    """A 401 on a file's url_private was told as "Slack refused the bot token" while Slack stayed on and the token
    kept working: Slack answers a download with a token it does not take by its sign-in page, so a 401 is
    another's (a proxy's). It is said as the download's refusal, counted once at file_fetch; the token is not taken
    as refused (that would stop every post until a restart), and the next post goes."""
    attachment = await shared_file(fake, adapter, recorder)
    fake.fail(FILE_DOWNLOAD, "401")
    before = failure_count("file_fetch", "slack"), failure_count("token_refused", "slack")
    with pytest.raises(PlatformError) as info:
        await attachment.fetch()
    assert (info.value.site, info.value.retryable, info.value.operator_must_act) == ("file_fetch", False, True)
    assert "HTTP 401: the file's download was refused" in str(info.value)
    assert "refused the bot token" not in str(info.value)
    assert (failure_count("file_fetch", "slack"), failure_count("token_refused", "slack")) == (
        before[0] + 1,
        before[1],
    )
    assert adapter.setup_refused is None
    await adapter.send_text(HOME, "still posting")
    assert fake.channel(HOME)[-1].text == "still posting"


async def test_a_download_sent_to_the_sign_in_page_names_the_missing_scope(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    """Slack answers a download by an app without files:read with a redirect to its sign-in page, not an error:
    the operator is told which scope to add, and sending the file again would not help."""
    attachment = await shared_file(fake, adapter, recorder)
    fake.scopes = tuple(s for s in fake.scopes if s != "files:read")
    with pytest.raises(PlatformError) as info:
        await attachment.fetch()
    assert (info.value.retryable, info.value.site) == (False, "file_fetch")
    assert "files:read" in str(info.value)
    assert f"({fake.url}/signin)" in str(info.value)
