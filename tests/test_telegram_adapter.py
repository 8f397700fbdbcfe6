"""The Telegram adapter, on the real python-telegram-bot, against the wire-level fake Bot API."""

from __future__ import annotations

import asyncio
import gc
import html
import secrets
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from telegram import Message

from kazma.adapters import kit
from kazma.adapters.card_layout import CardTooLarge, lay_out, outcome_line
from kazma.adapters.contract import (
    CardRef,
    Handlers,
    Inbound,
    PlatformAdapter,
    PlatformError,
    Press,
    ingress_trouble,
)
from kazma.adapters.deny_reason import PROMPT_EXPIRED, PROMPT_NOT_YOURS, reply_prompt
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.press_policy import PRESS_APOLOGY, PRESS_NOT_ON_MESSAGE, PRESS_PENDING
from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.telegram.adapter import DRAFTS_LEAVE
from kazma.adapters.telegram.reasons import prompt_of
from kazma.adapters.telegram.render import CARD_BUDGET, MAX_ENTITIES, TEXT_LIMIT, TelegramWriter, render_card, utf16_len
from kazma.approvals.card import ApprovalCard, build_card
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import ApprovalRequest, Decision, Outcome, PressResult, PressVerdict, Status
from kazma.config.metrics import failure_count
from kazma.config.models import TelegramConfig, TelegramWebhookConfig
from tests.fakes.telegram import FakeTelegram, Fault

GROUP = -1001234567890
OTHER_GROUP = -1009876543210
ADMIN = 111
MEMBER = 222
WAIT = 5.0

# PTB itself reads RetryAfter.retry_after while building the exception; that warning is PTB's own.
pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


# --------------------------------------------------------------------------- helpers


class FakeTime:
    """A limiter clock that moves only when the limiter sleeps; each sleep notes how many sends preceded it."""

    def __init__(self, fake: FakeTelegram) -> None:
        self.fake = fake
        self.now = 1000.0
        self.sleeps: list[tuple[float, int]] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append((seconds, len(self.fake.calls_to("sendMessage"))))
        self.now += seconds

    def limiter(self, *, drafts_leave: int = 0) -> ChatRateLimiter:
        return ChatRateLimiter(
            min_interval=1.0, per_window=20, window=60.0, clock=self.clock, sleep=self.sleep, drafts_leave=drafts_leave
        )


class Recorder:
    """The handlers the composition root would inject, recording what reaches them."""

    def __init__(self) -> None:
        self.inbound: asyncio.Queue[Inbound] = asyncio.Queue()
        self.presses: list[Press] = []
        self.result: PressResult | Exception = PressResult(PressVerdict.WON, "Approved: the call runs now.")
        self.hold: asyncio.Event | None = None  # when set, presses wait for it
        self.press_finished = asyncio.Event()

    async def on_inbound(self, inbound: Inbound) -> None:
        await self.inbound.put(inbound)

    async def on_press(self, press: Press) -> PressResult:
        self.presses.append(press)
        try:
            if self.hold is not None:
                await self.hold.wait()
            if isinstance(self.result, Exception):
                raise self.result
            return self.result
        finally:
            self.press_finished.set()

    def handlers(self) -> Handlers:
        return Handlers(on_inbound=self.on_inbound, on_press=self.on_press)

    async def next_inbound(self) -> Inbound:
        return await asyncio.wait_for(self.inbound.get(), WAIT)


def make_card(
    args: dict[str, Any],
    *,
    value_limit: int = 500,
    tool: str = "shell",
    requester: str = "agent:builder",
    public_url: str = "http://127.0.0.1:8765",
) -> ApprovalCard:
    now = datetime.now(UTC)
    request = ApprovalRequest(
        id=secrets.token_hex(16),
        tool=tool,
        args=args,
        args_json=canonical_json(args),
        args_hash=args_hash(args),
        requested_by=requester,
        conversation=f"telegram:{GROUP}",
        created_at=now,
        deadline=now + timedelta(minutes=10),
        status=Status.PENDING,
    )
    return build_card(request, value_limit=value_limit, public_url=public_url)


def approved_by_admin(card: ApprovalCard) -> Outcome:
    return Outcome(
        request_id=card.request_id,
        status=Status.APPROVED,
        decided_by=f"telegram:{ADMIN}",
        decided_via="telegram",
        decided_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
    )


Factory = Callable[..., Awaitable[tuple[TelegramAdapter, Recorder]]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    server = FakeTelegram()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def make_adapter(fake: FakeTelegram) -> AsyncIterator[Factory]:
    started: list[TelegramAdapter] = []

    async def factory(
        *,
        limiter: ChatRateLimiter | str | None = "fake-time",
        config: dict[str, Any] | None = None,
        **options: Any,
    ) -> tuple[TelegramAdapter, Recorder]:
        settings: dict[str, Any] = {
            "token": fake.token,
            "api_base_url": fake.base_url,
            "chats": [GROUP],
            "home_chat": GROUP,
            "admins": [ADMIN],
        }
        settings.update(config or {})
        chosen = FakeTime(fake).limiter() if limiter == "fake-time" else limiter
        assert chosen is None or isinstance(chosen, ChatRateLimiter)
        options.setdefault("poll_timeout", 2.0)
        options.setdefault("request_timeout", 5.0)
        adapter = TelegramAdapter(TelegramConfig(**settings), limiter=chosen, **options)
        recorder = Recorder()
        await adapter.start(recorder.handlers())
        started.append(adapter)
        return adapter, recorder

    yield factory
    for adapter in reversed(started):
        await adapter.stop()


@pytest.fixture
async def adapter(make_adapter: Factory) -> tuple[TelegramAdapter, Recorder]:
    return await make_adapter()


# --------------------------------------------------------------------------- lifecycle


async def test_is_a_platform_adapter_and_starts_on_the_real_library(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    assert isinstance(bot, PlatformAdapter)
    assert bot.name == "telegram"
    assert bot.home_chat == str(GROUP)
    assert bot.bot_username == "kazma_bot"
    assert [c.method for c in fake.calls[:2]] == ["getMe", "setMyCommands"]
    assert fake.commands == [
        {"command": "swarm", "description": "Drive the agent swarm"},
        {"command": "plan", "description": "Show this chat's current plan"},
        {"command": "approvals", "description": "List the approval requests waiting for you"},
    ]
    await fake.wait_for_call("getUpdates", answered=False)
    assert fake.calls_to("deleteWebhook"), "polling must clear a webhook first"


def _tls_contexts() -> int:
    gc.collect()
    return sum(isinstance(o, ssl.SSLContext) for o in gc.get_objects())


async def test_a_start_loads_the_root_certificates_once_for_both_http_clients(make_adapter: Factory) -> None:
    """Each of PTB's two HTTP clients made its own TLS context, each loading every root certificate (about 3 MB
    and 30 ms of CPU at every start); they share one, and a restart of the adapter reuses it."""
    before = _tls_contexts()
    bot, _ = await make_adapter()
    assert _tls_contexts() - before == 1
    await bot.stop()
    await bot.start(Recorder().handlers())
    assert _tls_contexts() - before == 1


async def test_the_root_certificates_load_on_a_thread_while_the_start_waits_for_nothing(
    make_adapter: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading every root certificate (20-30 ms, in OpenSSL with the GIL released) held the event loop while the
    platforms started; it runs on a thread of its own from the adapter's making, once, and the start takes it."""
    loaded_on: list[int] = []
    real = httpx.create_ssl_context

    def watched(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        loaded_on.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "create_ssl_context", watched)
    bot, _ = await make_adapter()
    assert len(loaded_on) == 1
    assert loaded_on[0] != threading.get_ident()  # not the event loop's thread
    await bot.stop()
    await bot.start(Recorder().handlers())
    assert len(loaded_on) == 1


async def test_a_tls_context_that_cannot_be_made_fails_the_start(
    fake: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made on a thread, its failure (a bad SSL_CERT_FILE, say) still reaches the start that needs it."""

    def broken(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        raise ssl.SSLError("no roots here")

    monkeypatch.setattr(httpx, "create_ssl_context", broken)
    bot = TelegramAdapter(TelegramConfig(token=fake.token, api_base_url=fake.base_url), poll_timeout=1.0)
    with pytest.raises(ssl.SSLError, match="no roots here"):
        bot._build_application()


async def test_home_chat_unset(fake: FakeTelegram) -> None:
    config = TelegramConfig(token=fake.token, api_base_url=fake.base_url)
    assert TelegramAdapter(config).home_chat is None


async def test_a_bad_token_fails_start_with_a_platform_error(fake: FakeTelegram) -> None:
    config = TelegramConfig(token="1:wrong", api_base_url=fake.base_url)
    adapter = TelegramAdapter(config)
    with pytest.raises(PlatformError) as caught:
        await adapter.start(Recorder().handlers())
    assert caught.value.retryable is False
    assert "1:wrong" not in str(caught.value)  # PTB quotes the token; we must not pass it on
    with pytest.raises(PlatformError, match="not started"):
        await adapter.send_text(str(GROUP), "hello")


# --------------------------------------------------------------------------- inbound (dialect)


async def test_topics_bots_and_admins_are_read_from_telegrams_fields(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    _, recorder = adapter
    message_id = fake.push_message(GROUP, ADMIN, "please @Builder look", username="alice", first_name="Alice")
    inbound = await recorder.next_inbound()
    assert inbound == Inbound(
        platform="telegram",
        chat=str(GROUP),
        message_id=str(message_id),
        author=f"telegram:{ADMIN}",
        author_name="Alice",
        text="please @Builder look",
        thread=None,
        mentions=("builder",),
        from_bot=False,
        command=None,
        is_admin=True,
        chat_title=f"Group {GROUP}",  # the group's title, from the update's chat
    )
    fake.push_message(GROUP, MEMBER, "me too", is_bot=True, thread_id=7)
    other = await recorder.next_inbound()
    assert (other.is_admin, other.from_bot, other.thread, other.author) == (False, True, "7", f"telegram:{MEMBER}")


async def test_a_message_sent_on_behalf_of_a_chat_is_that_chats_and_nobodys_to_authorise(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    # Telegram puts a fake user in "from" when a message is sent on behalf of a chat: GroupAnonymousBot (a bot) for
    # the group's anonymous admins, whose messages were dropped as a bot's posts; "Telegram" (777000, no bot) for
    # a linked channel, who was taken for a person.
    _, recorder = adapter
    fake.push_message(GROUP, ADMIN, "@kazma deploy it", on_behalf_of=GROUP)
    anonymous = await recorder.next_inbound()
    assert (anonymous.author, anonymous.from_bot, anonymous.is_admin) == (f"telegram:{GROUP}", False, False)
    assert anonymous.author_name == f"Group {GROUP}"
    fake.push_message(GROUP, ADMIN, "@kazma a post", on_behalf_of=-1009999)
    channel = await recorder.next_inbound()
    assert (channel.author, channel.from_bot, channel.is_admin) == ("telegram:-1009999", False, False)


async def test_short_agent_names_are_mentions_even_where_telegram_makes_no_entity(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    _, recorder = adapter
    # Telegram only marks @names of 5+ characters as mentions; an agent called "dev" is addressed all the same.
    fake.push_message(GROUP, ADMIN, "@dev fix it", entities=[])
    assert (await recorder.next_inbound()).mentions == ("dev",)


async def test_swarm_command(fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]) -> None:
    _, recorder = adapter
    fake.push_message(GROUP, ADMIN, "/swarm plan build a release")
    fake.push_message(GROUP, ADMIN, "/swarm@Kazma_Bot  status  ")
    fake.push_message(GROUP, ADMIN, "/swarm@other_bot status")  # another bot's command: not ours
    fake.push_message(GROUP, ADMIN, "/start hello")
    received = [await recorder.next_inbound() for _ in range(3)]
    by_text = {i.text: i.command for i in received}
    assert by_text == {"plan build a release": "swarm", "status": "swarm", "/start hello": None}
    await bot_settled(adapter[0])
    assert recorder.inbound.empty()


async def bot_settled(bot: TelegramAdapter) -> None:
    await bot.quiesce()


# --------------------------------------------------------------------------- cards (dialect)


async def test_card_is_telegram_html_with_the_cut_marked_in_italics(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    long_value = "HEAD-echo harmless " + "x" * 9_950 + " ; rm -rf / TAIL"
    card = make_card({"command": long_value, "cwd": "/srv/app"}, value_limit=500)
    ref = await bot.post_card(card)
    message = fake.message(GROUP, ref.message_id)
    assert message.parse_mode == "HTML"
    assert [c.status for c in fake.calls_to("sendMessage")] == [200]  # Telegram's HTML parser accepted it
    cut_marker = next(e for e in message.entities if e["type"] == "italic")
    marked = message.text.encode("utf-16-le")[
        cut_marker["offset"] * 2 : (cut_marker["offset"] + cut_marker["length"]) * 2
    ]
    assert marked.decode("utf-16-le").startswith("[cut:")
    deny = card.button_data(Decision.DENY)
    assert [b["callback_data"] for b in message.buttons] == [deny, deny[:-1] + "n"]
    assert all(len(b["callback_data"].encode()) <= 64 for b in message.buttons)


async def test_markup_in_a_value_is_escaped_in_the_html(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    card = make_card({"bold": "<b>not bold</b>", "attr": '"><img src=x onerror=x>', "multi": "a\n</pre><b>b</b>"})
    ref = await bot.post_card(card)
    message = fake.message(GROUP, ref.message_id)
    for raw in ("<img", "<b>not", "</pre><b>"):
        assert raw not in message.source
    assert html.escape("<b>not bold</b>") in message.source
    assert message.dropped_entities == 0


async def test_sixty_long_arguments_fit_telegrams_budget_with_every_name(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    args = {f"argument_{i:02d}": f"start{i:02d}-" + "v" * 1_985 + f"-end{i:02d}" for i in range(60)}
    card = make_card(args, value_limit=2_000)
    assert not card.any_cut  # the model kept them whole: only the platform cannot
    ref = await bot.post_card(card)
    message = fake.message(GROUP, ref.message_id)
    assert utf16_len(message.text) <= TEXT_LIMIT
    for name in args:
        assert name in message.text
    laid = render_card(card)
    assert laid.view.names_only
    assert len(laid.view.arguments) + len(laid.view.names_only) == 60
    assert message.dropped_entities == 0  # no formatting silently lost past Telegram's cap
    assert "start00-" in message.text
    assert "-end00" in message.text
    assert ref.whole is False
    assert [b["text"] for b in message.buttons] == ["Deny", "Deny with reason"]


def test_rendering_shrinks_values_evenly_before_listing_names() -> None:
    card = make_card({f"a{i}": "y" * 1_000 for i in range(8)}, value_limit=1_000)
    laid = render_card(card)
    assert laid.view.names_only == ()
    assert laid.written.visible_length <= CARD_BUDGET
    assert laid.written.html.count("[cut: ") == 8


def test_many_short_arguments_drop_bold_names_before_any_value() -> None:
    laid = render_card(make_card({f"flag_{i:02d}": i for i in range(70)}))
    assert laid.view.names_only == ()
    assert laid.written.entities <= MAX_ENTITIES
    assert "<b>flag_00</b>" not in laid.written.html
    assert "<code>0</code>" in laid.written.html
    assert "<b>a</b>" in render_card(make_card({"a": 1, "b": 2})).written.html


def test_names_that_do_not_fit_are_counted_and_the_card_offers_only_deny() -> None:
    laid = render_card(make_card({f"{i:03d}" + "n" * 97: i for i in range(60)}))
    assert laid.view.names_hidden > 0
    assert f"{laid.view.names_hidden} of 60 argument names do not fit here" in laid.written.html
    assert [b.label for b in laid.view.buttons] == ["Deny", "Deny with reason"]


def test_a_card_whose_frame_cannot_fit_is_refused() -> None:
    with pytest.raises(CardTooLarge):
        lay_out(make_card({"a": 1}), TelegramWriter(budget=40))


# --------------------------------------------------------------------------- presses (dialect)


async def test_a_won_press_is_answered_with_a_quiet_toast(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, recorder = adapter
    card = make_card({"path": "/tmp/x"})
    ref = await bot.post_card(card)
    query = fake.push_callback(GROUP, ref.message_id, ADMIN, card.button_data(Decision.APPROVE))
    answer = await fake.wait_for_answer(query)
    assert answer == {**answer, "text": "Approved: the call runs now.", "show_alert": False}
    assert recorder.presses[0].actor == f"telegram:{ADMIN}"


async def test_data_that_is_no_button_of_the_pressed_message_is_refused_before_the_press_policy(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    """Telegram does not check a callback's data against the pressed message (a modified client sends any data on
    any of the bot's messages). Another request's Deny (or Deny with reason) pressed on this card was handed on as
    a press from this card: an ended request's data on an open card got that card recorded as the ended request's
    ("card found") and edited to its outcome, its own buttons gone. It is refused here, counted; nothing is
    decided and no reason prompt is posted."""
    bot, recorder = adapter
    card = make_card({"path": "/tmp/x"})
    other = make_card({"path": "/etc"})
    ref = await bot.post_card(card)
    before = failure_count("press_unbound", "telegram")
    sends = len(fake.calls_to("sendMessage"))
    for data in (other.button_data(Decision.DENY), f"kz1:{other.request_id}:n", "kz1:abc:a"):
        answer = await fake.wait_for_answer(fake.push_callback(GROUP, ref.message_id, ADMIN, data))
        assert answer["text"] == PRESS_NOT_ON_MESSAGE
        assert answer["show_alert"] is True
    await bot.quiesce()
    assert recorder.presses == []
    assert len(fake.calls_to("sendMessage")) == sends  # no reason prompt
    assert failure_count("press_unbound", "telegram") == before + 3
    # the card's own buttons still press as ever
    answer = await fake.wait_for_answer(
        fake.push_callback(GROUP, ref.message_id, ADMIN, card.button_data(Decision.DENY))
    )
    assert answer["text"] == "Approved: the call runs now."  # the recorder's answer
    assert [p.data for p in recorder.presses] == [card.button_data(Decision.DENY)]


async def test_a_press_on_a_settled_card_goes_on_to_be_told_what_stands(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    # A card settled as someone pressed it (their client still showed the buttons): nothing forged, not counted as
    # press_unbound evidence; the press goes on, and its presser is told what stands (the store's answer).
    bot, recorder = adapter
    card = make_card({"path": "/tmp/x"})
    ref = await bot.post_card(card)
    await bot.settle_card(ref, card, approved_by_admin(card))
    before = failure_count("press_unbound", "telegram")
    answer = await fake.wait_for_answer(
        fake.push_callback(GROUP, ref.message_id, ADMIN, card.button_data(Decision.DENY))
    )
    assert answer["text"] == "Approved: the call runs now."  # the recorder's answer
    assert [p.data for p in recorder.presses] == [card.button_data(Decision.DENY)]
    assert failure_count("press_unbound", "telegram") == before


async def test_answers_are_clipped_to_telegrams_200_characters(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    _, recorder = adapter
    recorder.result = PressResult(PressVerdict.LOST, "x" * 300)
    query = fake.push_callback(GROUP, 1, MEMBER, "kz1:abc:d")
    answer = await fake.wait_for_answer(query)
    assert answer["show_alert"] is True
    assert len(answer["text"]) <= 200


async def test_a_slow_press_is_answered_at_once_and_keeps_running(fake: FakeTelegram, make_adapter: Factory) -> None:
    _, recorder = await make_adapter(press_timeout=0.2)
    recorder.hold = asyncio.Event()
    query = fake.push_callback(GROUP, 1, ADMIN, "kz1:abc:a")
    answer = await fake.wait_for_answer(query)
    assert answer["text"] == PRESS_PENDING
    assert not recorder.press_finished.is_set()  # the decision was not cut short by the answer
    recorder.hold.set()
    await asyncio.wait_for(recorder.press_finished.wait(), WAIT)


@pytest.mark.parametrize(
    "result",
    [
        PressResult(PressVerdict.REFUSED, "You are not an approver for this request; nothing was recorded."),
        PressResult(PressVerdict.LOST, "Already denied by telegram:333."),
        RuntimeError("the store went away"),
    ],
    ids=["refused", "lost", "failed"],
)
async def test_a_slow_press_that_does_not_count_is_still_told_to_its_presser(
    fake: FakeTelegram, make_adapter: Factory, result: PressResult | Exception
) -> None:
    """A press slower than ``press_timeout`` is answered "Recorded, updating…"; Telegram answers a query once, so
    the refusal, the loss or the apology that came after was dropped: the presser believed their press counted
    while nothing was recorded. It reaches them as a reply to the card, naming them."""
    bot, recorder = await make_adapter(press_timeout=0.2)
    card = make_card({"path": "/tmp/x"})
    ref = await bot.post_card(card)
    recorder.hold = asyncio.Event()
    recorder.result = result
    query = fake.push_callback(GROUP, ref.message_id, MEMBER, card.button_data(Decision.APPROVE), username="mia")
    assert (await fake.wait_for_answer(query))["text"] == PRESS_PENDING
    recorder.hold.set()
    await asyncio.wait_for(recorder.press_finished.wait(), WAIT)
    await bot.quiesce()
    expected = result.message if isinstance(result, PressResult) else PRESS_APOLOGY
    (notice,) = [m for m in fake.bot_messages(GROUP) if m.message_id != int(ref.message_id)]
    assert notice.text == f"@mia: {expected}"
    replying = fake.calls_to("sendMessage")[-1].params["reply_parameters"]
    assert replying["message_id"] == int(ref.message_id)
    assert len(fake.calls_to("answerCallbackQuery")) == 1


# --------------------------------------------------------------------------- settling (dialect)


async def test_settling_twice_is_telegrams_message_is_not_modified_and_counts_as_done(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    card = make_card({"path": "/etc/passwd", "mode": "w"})
    ref = await bot.post_card(card)
    outcome = approved_by_admin(card)
    await bot.settle_card(ref, card, outcome)
    message = fake.message(GROUP, ref.message_id)
    assert outcome_line(outcome) in message.text.splitlines()[0]
    await bot.settle_card(ref, card, outcome)
    edits = fake.calls_to("editMessageText")
    assert [c.status for c in edits] == [200, 400]
    assert edits[1].response is not None
    assert "not modified" in edits[1].response["description"]
    assert message.edits == 1


async def test_settling_a_vanished_card_is_not_retryable(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    card = make_card({"a": 1})
    before = failure_count("card_settle", "telegram")
    with pytest.raises(PlatformError) as caught:
        await bot.settle_card(CardRef("telegram", str(GROUP), "424242"), card, approved_by_admin(card))
    assert caught.value.retryable is False
    assert "not found" in str(caught.value).lower()
    assert failure_count("card_settle", "telegram") == before + 1
    with pytest.raises(PlatformError) as caught:
        await bot.settle_card(CardRef("slack", "C123", "1.2"), card, approved_by_admin(card))
    assert caught.value.retryable is False
    assert fake.calls_to("editMessageText")[-1].params["message_id"] == 424242  # the Slack card never reached Telegram


# --------------------------------------------------------------------------- flood control (dialect)


async def test_429_blocks_the_chat_for_retry_after_then_succeeds(fake: FakeTelegram, make_adapter: Factory) -> None:
    time = FakeTime(fake)
    bot, _ = await make_adapter(limiter=time.limiter())
    fake.script("sendMessage", Fault.too_many_requests(7))
    message_id = await bot.send_text(str(GROUP), "hello")
    calls = fake.calls_to("sendMessage")
    assert [c.status for c in calls] == [429, 200]
    assert fake.message(GROUP, message_id).text == "hello"
    # PTB's rate-limit hook (our pacing) waited out retry_after after the refused send and before the retry.
    assert any(seconds >= 7.0 and sends_before == 1 for seconds, sends_before in time.sleeps)


async def test_the_default_pacing_caps_groups_per_minute_but_not_private_chats(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    bot, _ = await make_adapter(limiter=None)
    limiter = bot.pacing.limiter
    assert limiter is not None
    assert (limiter.min_interval, limiter.per_window, limiter.drafts_leave) == (1.0, 20, DRAFTS_LEAVE)
    assert limiter.windowed is not None
    assert limiter.windowed(str(GROUP)) is True
    assert limiter.windowed(str(ADMIN)) is False
    fake.script("sendMessage", Fault.too_many_requests(1))
    ref = await bot.post_card(make_card({"a": 1}))
    assert [c.status for c in fake.calls_to("sendMessage")] == [429, 200]
    assert fake.message(GROUP, ref.message_id).buttons


async def test_a_reply_growing_in_a_group_leaves_room_in_the_minute_for_a_card(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    time = FakeTime(fake)
    bot, _ = await make_adapter(limiter=time.limiter(drafts_leave=DRAFTS_LEAVE))
    shown = await bot.show_text(str(GROUP), [], "word 0")
    stamps = [time.now]
    for count in range(1, 20):  # a reply growing by 19 edits, each as soon as the chat allows
        shown = await bot.show_text(str(GROUP), shown, " ".join(f"word {i}" for i in range(count + 1)))
        stamps.append(time.now)
    assert len(fake.calls_to("editMessageText")) == 19
    # the stream never takes more than its share of any minute
    assert all(sum(t <= s < t + 60.0 for s in stamps) <= 20 - DRAFTS_LEAVE for t in stamps), stamps
    # so a card posted right after it waits only the chat's one-second gap, not for the minute to pass
    before = time.now
    ref = await bot.post_card(make_card({"a": 1}))
    assert time.now - before <= 1.0
    assert fake.message(GROUP, ref.message_id).buttons


async def test_429_without_end_gives_up_retryable(fake: FakeTelegram, make_adapter: Factory) -> None:
    bot, _ = await make_adapter(max_attempts=3)
    fake.script("sendMessage", *[Fault.too_many_requests(2)] * 3)
    before = failure_count("send", "telegram")
    with pytest.raises(PlatformError) as caught:
        await bot.send_text(str(GROUP), "hello")
    assert caught.value.retryable is True
    assert caught.value.retry_after == 2.0
    assert len(fake.calls_to("sendMessage")) == 3
    assert failure_count("send", "telegram") == before + 1


async def test_a_reason_prompt_is_paced_once_like_every_send(fake: FakeTelegram, make_adapter: Factory) -> None:
    """The "Deny with reason" prompt went through the kit's pacing and then PTB's rate-limit hook again: it took
    two of the group's twenty sends a minute (and waited two gaps), and a 429 was tried max_attempts squared
    times. It is paced by the hook alone, as every send is."""
    time = FakeTime(fake)
    bot, _ = await make_adapter(limiter=time.limiter(), max_attempts=2)
    card = make_card({"cmd": "ls"})
    ref = await bot.post_card(card)
    slept = len(time.sleeps)
    fake.push_callback(GROUP, int(ref.message_id), ADMIN, f"kz1:{card.request_id}:n")
    await fake.wait_until(lambda: len(fake.calls_to("sendMessage")) == 2)
    await bot.quiesce()
    assert [seconds for seconds, _ in time.sleeps[slept:]] == [1.0]  # one gap after the card, not two
    prompt = fake.bot_messages(GROUP)[-1]
    assert "reply to this message with your reason" in prompt.text

    fake.script("sendMessage", *[Fault.too_many_requests(1)] * 4)
    sends = len(fake.calls_to("sendMessage"))
    fake.push_callback(GROUP, int(ref.message_id), ADMIN, f"kz1:{card.request_id}:n")
    await fake.wait_until(lambda: len(fake.calls_to("answerCallbackQuery")) == 2)
    await bot.quiesce()
    assert [c.status for c in fake.calls_to("sendMessage")[sends:]] == [429, 429]  # max_attempts, then given up


async def test_bad_request_is_not_retryable(fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]) -> None:
    bot, _ = adapter
    fake.script("sendMessage", Fault.server_error(400, "Bad Request: chat not found"))
    with pytest.raises(PlatformError) as caught:
        await bot.send_text(str(GROUP), "hello")
    assert caught.value.retryable is False
    with pytest.raises(PlatformError) as caught:
        await bot.send_text("general", "hello")
    assert caught.value.retryable is False


async def test_a_hung_server_times_out_retryable(fake: FakeTelegram, make_adapter: Factory) -> None:
    bot, _ = await make_adapter(request_timeout=1.0)
    fake.script("sendMessage", Fault.hang())
    with pytest.raises(PlatformError) as caught:
        await bot.post_card(make_card({"a": 1}))
    assert caught.value.retryable is True
    # which bound ran out and how long it was: PTB's own words were a bare "TimedOut: Timed out"
    assert str(caught.value) == "telegram card_post: no answer from Telegram within 1 s"
    assert fake.calls_to("sendMessage")[0].status is None  # the fake never answered


@pytest.mark.parametrize(("status", "words"), [(500, "Internal Server Error"), (502, "Bad Gateway")])
async def test_a_5xx_is_told_as_telegram_s_answer_with_its_status(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder], status: int, words: str
) -> None:
    bot, _ = adapter
    # as the Bot API answers one: {"ok": false, "error_code": 500, "description": "Internal Server Error"}
    fake.script("sendMessage", Fault.server_error(status, words))
    with pytest.raises(PlatformError) as caught:
        await bot.post_card(make_card({"a": 1}))
    assert caught.value.retryable is True
    # PTB's own words were the description alone ("NetworkError: Bad Gateway"), as an unreachable host's are
    assert str(caught.value) == f"telegram card_post: NetworkError: Telegram answered {status} {words}"


# --------------------------------------------------------------------------- long polling's health


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        (Fault.server_error(502, "Bad Gateway"), "Telegram answered 502 Bad Gateway"),
        # another process polling with the same token (a second Kazma, a developer's laptop)
        (
            Fault.server_error(409, "Conflict: terminated by other getUpdates request"),
            "Telegram answered 409: Conflict: terminated by other getUpdates request",
        ),
    ],
)
async def test_polling_that_keeps_failing_is_said_as_the_inbound_failing_until_a_poll_is_answered(
    fake: FakeTelegram, make_adapter: Factory, monkeypatch: pytest.MonkeyPatch, fault: Fault, said: str
) -> None:
    """Every getUpdates answered 502, or 409 Conflict: each failure was logged and counted, PTB polled again with
    backoff, and /healthz said Telegram served while nothing came in from it."""
    monkeypatch.setattr(kit, "INBOUND_TROUBLE_AFTER", 2)
    bot, recorder = await make_adapter()
    await fake.wait_for_call("getUpdates", answered=False)
    assert ingress_trouble(bot) is None
    failed = failure_count("poll", "telegram")
    fake.script("getUpdates", *[fault] * 1_000)
    fake.push_message(GROUP, ADMIN, "wakes the long poll; the next polls meet the fault")
    await until(lambda: failure_count("poll", "telegram") >= failed + 2)
    trouble = ingress_trouble(bot)  # what the bus says on /healthz: "platform telegram: inbound failing (...)"
    assert trouble is not None
    assert trouble.startswith("getUpdates (long polling) failed "), trouble
    assert "tried again with backoff" in trouble
    assert trouble.endswith(said), trouble
    fake.unscript("getUpdates")
    fake.push_message(GROUP, ADMIN, "after")
    texts = [(await recorder.next_inbound()).text, (await recorder.next_inbound()).text]
    assert texts == ["wakes the long poll; the next polls meet the fault", "after"]
    assert ingress_trouble(bot) is None


async def test_a_token_refused_on_getupdates_ends_the_ingress_which_opens_again_once_the_token_is_good(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    """Telegram answering getUpdates 401 (the token revoked in BotFather): PTB's poller ends for good without a
    word to its error callback. The adapter still believed it polled, so no ingress check opened it again, and
    with the token good again nothing came in until a restart. Now its ingress is not running, says why, and
    opening it again (what the ingress check does) polls with a new Updater."""
    bot, recorder = await make_adapter()
    await fake.wait_for_call("getUpdates", answered=False)
    lost = failure_count("ingress_lost", "telegram")
    fake.script("getUpdates", Fault.server_error(401, "Unauthorized"))
    fake.push_message(GROUP, ADMIN, "wakes the long poll")
    assert (await recorder.next_inbound()).text == "wakes the long poll"
    await until(lambda: not bot.ingress_running)
    assert ingress_trouble(bot) == (
        "getUpdates (long polling) ended, python-telegram-bot does not poll again: Telegram answered 401: Unauthorized"
    )
    assert failure_count("ingress_lost", "telegram") == lost + 1
    await bot.start_ingress()  # the token is good again (the 401 was scripted once)
    assert bot.ingress_running
    assert ingress_trouble(bot) is None
    fake.push_message(GROUP, ADMIN, "after")
    # The new Updater asks from the start: Telegram sends again what the old one never confirmed (the inbound
    # claims take it in once in a Kazma app; this recorder has none).
    texts = [(await recorder.next_inbound()).text]
    if texts[0] != "after":
        texts.append((await recorder.next_inbound()).text)
    assert texts in (["after"], ["wakes the long poll", "after"]), texts


# --------------------------------------------------------------------------- plain text (dialect)


async def test_text_is_sent_without_a_parse_mode_and_into_topics(
    fake: FakeTelegram, adapter: tuple[TelegramAdapter, Recorder]
) -> None:
    bot, _ = adapter
    message_id = await bot.send_text(str(GROUP), "done <b>& @everyone", agent="builder")
    message = fake.message(GROUP, message_id)
    assert message.text == "[builder] done <b>& @everyone"
    assert message.parse_mode is None
    assert message.entities == []
    threaded = await bot.send_text(str(GROUP), "in a topic", thread="7")
    assert fake.message(GROUP, threaded).thread_id == 7


# --------------------------------------------------------------------------- webhook mode


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_webhook_mode_receives_updates_with_the_secret(fake: FakeTelegram, make_adapter: Factory) -> None:
    pytest.importorskip("tornado", reason="webhook mode needs python-telegram-bot[webhooks]")
    port = _free_port()
    hook = TelegramWebhookConfig(
        url=f"http://127.0.0.1:{port}/telegram", secret_token="s3cret-token", listen="127.0.0.1", port=port
    )
    _, recorder = await make_adapter(config={"mode": "webhook", "webhook": hook})
    assert fake.webhook_url == hook.url
    assert fake.calls_to("setWebhook")[0].params["secret_token"] == "s3cret-token"
    fake.push_message(GROUP, ADMIN, "/swarm status")
    inbound = await recorder.next_inbound()
    assert (inbound.command, inbound.text) == ("swarm", "status")
    assert fake.calls_to("getUpdates") == []


async def test_a_reply_to_a_reason_prompt_after_a_restart_is_still_the_reason_and_never_chat(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    """The prompts were kept in the process alone: after a restart (or on another replica serving the webhook) a
    reply to a prompt was no reason, and its words, meant for the approvals record, reached the agents as an
    ordinary message while the request stayed pending. The prompt is its own record now: the replied-to message
    Telegram hands with the reply, the bot's own, naming the presser by id."""
    first, _ = await make_adapter()
    card = make_card({"cmd": "rm -rf /srv"})
    ref = await first.post_card(card)
    fake.push_callback(GROUP, int(ref.message_id), ADMIN, f"kz1:{card.request_id}:n", username="boss")
    await fake.wait_until(lambda: any("reply to this message" in m.text for m in fake.bot_messages(GROUP)))
    prompt = fake.bot_messages(GROUP)[-1]
    await first.quiesce()
    await first.stop()
    bot, recorder = await make_adapter()

    fake.push_message(GROUP, 999, "ship it", reply_to=prompt.message_id)  # not the presser
    await fake.wait_until(lambda: any("only the person who pressed" in m.text for m in fake.bot_messages(GROUP)))
    fake.push_message(GROUP, ADMIN, "it wipes the backups too", reply_to=prompt.message_id)
    await asyncio.wait_for(recorder.press_finished.wait(), WAIT)
    [press] = recorder.presses
    assert (press.data, press.reason, press.actor, press.chat) == (
        card.button_data(Decision.DENY),
        "it wipes the backups too",
        f"telegram:{ADMIN}",
        str(GROUP),
    )
    # past the window: answered "expired", and still nobody's chat
    bot.reason_clock = lambda: time.time() + 10_000
    fake.push_message(GROUP, ADMIN, "late words", reply_to=prompt.message_id)
    await fake.wait_until(lambda: any("that prompt has expired" in m.text for m in fake.bot_messages(GROUP)))
    fake.push_message(GROUP, ADMIN, "after the replies")
    # the replies to the prompt came first: the first chat the agents get is the message after them
    arrived = await recorder.next_inbound()
    assert arrived.text == "after the replies"
    await bot.quiesce()
    assert recorder.inbound.empty()
    assert len(recorder.presses) == 1


async def test_a_look_alike_of_a_reason_prompt_is_no_prompt(fake: FakeTelegram, make_adapter: Factory) -> None:
    """Only the bot's own prompt is one: a person's message with the same words, replied to, is chat."""
    bot, recorder = await make_adapter()
    card = make_card({"cmd": "ls"})
    fake.push_callback(GROUP, int((await bot.post_card(card)).message_id), ADMIN, f"kz1:{card.request_id}:n")
    await fake.wait_until(lambda: any("reply to this message" in m.text for m in fake.bot_messages(GROUP)))
    words = fake.bot_messages(GROUP)[-1]
    copied = fake.push_message(GROUP, 999, words.text, entities=words.entities)
    fake.push_message(GROUP, ADMIN, "a reply to a person", reply_to=copied)
    assert (await recorder.next_inbound()).text == words.text
    assert (await recorder.next_inbound()).text == "a reply to a person"
    assert recorder.presses == []


def _said_by_bot(text: str, entities: list[dict[str, Any]], *, sender: int = 123456) -> Message:
    """A message as Telegram hands it in ``reply_to_message`` (read by the real library)."""
    body = {
        "message_id": 7,
        "date": int(time.time()),
        "chat": {"id": GROUP, "type": "supergroup", "title": "g"},
        "from": {"id": sender, "is_bot": sender == 123456, "first_name": "Kazma"},
        "text": text,
        "entities": entities,
    }
    message = Message.de_json(body, None)
    assert message is not None
    return message


def test_a_prompt_whose_mention_telegram_dropped_is_still_a_prompt_bound_to_the_named_username() -> None:
    """Telegram drops a mention of a user whose privacy settings hide them from the bot: the prompt is then told
    by its wording, bound to the @username it names, and a person without one can give no reason through it
    (answered "expired", never chat)."""
    request_id = "Rq7xK2mP9vL4nB8cT1wZ5aY3"
    now = time.time()
    named = _said_by_bot(reply_prompt(request_id, "@Boss"), [{"type": "mention", "offset": 0, "length": 5}])
    prompt = prompt_of(named, 123456)
    assert prompt is not None
    assert prompt.data == f"kz1:{request_id}:d"
    assert prompt.refusal(ADMIN, "boss", now) is None
    assert prompt.refusal(ADMIN, "someone", now) == PROMPT_NOT_YOURS
    assert prompt.refusal(ADMIN, "boss", now + 10_000) == PROMPT_EXPIRED
    unnamed = prompt_of(_said_by_bot(reply_prompt(request_id, "Alice: Smith"), []), 123456)
    assert unnamed is not None
    assert unnamed.refusal(ADMIN, None, now) == PROMPT_EXPIRED
    # the same words from anyone but the bot are no prompt
    assert prompt_of(_said_by_bot(reply_prompt(request_id, "@Boss"), [], sender=ADMIN), 123456) is None
    assert prompt_of(_said_by_bot("@Boss: approve it", []), 123456) is None
