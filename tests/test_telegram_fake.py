"""The fake Telegram Bot API enforces what Telegram enforces, so adapter tests against it mean something."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup
from telegram.constants import ParseMode
from telegram.error import BadRequest, RetryAfter

from tests.fakes.telegram import (
    NOT_MODIFIED,
    QUERY_TOO_OLD,
    FakeTelegram,
    Fault,
    HtmlError,
    command_and_mention_entities,
    parse_html,
)

CHAT = -1001000000001

# PTB itself reads RetryAfter.retry_after while building the exception; that warning is PTB's own.
pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    server = FakeTelegram()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def api(
    http: aiohttp.ClientSession, fake: FakeTelegram, method: str, **params: Any
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{fake.base_url}/bot{fake.token}/{method}", json=params) as response:
        body: dict[str, Any] = await response.json()
        return response.status, body


# --------------------------------------------------------------------------- HTML parse mode


def test_html_visible_text_and_utf16_entities() -> None:
    text, entities = parse_html(
        '😀 <b>bold</b> &lt;x&gt; &amp; &quot;q&quot; &#65;&#x42; <a href="http://e/?a=1&amp;b=2">l</a>'
    )
    assert text == '😀 bold <x> & "q" AB l'
    assert entities[0] == {"type": "bold", "offset": 3, "length": 4}  # the emoji is two UTF-16 units
    assert entities[1] == {"type": "text_link", "offset": 21, "length": 1, "url": "http://e/?a=1&b=2"}


def test_html_pre_with_language_and_nesting() -> None:
    text, entities = parse_html('<pre><code class="language-python">x = 1</code></pre><i><b>y</b></i>')
    assert text == "x = 1y"
    assert sorted(e["type"] for e in entities) == ["bold", "italic", "pre"]
    assert entities[0] == {"type": "pre", "offset": 0, "length": 5}


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("<img src=x onerror=alert(1)>", 'Unsupported start tag "img"'),
        ("<b>open", "Can't find end tag"),
        ("<b>x</i>", "Unmatched end tag"),
        ("x</b>", "Unexpected end tag"),
        ("a & b", 'Unescaped "&"'),
        ("a < b", "Unclosed start tag"),
        ("a > b", 'Unescaped ">"'),
        ("&nbsp;", "Unsupported HTML entity"),
        ('<span class="x">s</span>', 'Unsupported start tag "span"'),
    ],
)
def test_html_errors(source: str, fragment: str) -> None:
    with pytest.raises(HtmlError, match=fragment):
        parse_html(source)


def test_user_message_entities() -> None:
    found = command_and_mention_entities("/swarm@kazma_bot ask @Builder and @researcher, not a@b or @x")
    assert found == [
        {"type": "bot_command", "offset": 0, "length": 16},
        {"type": "mention", "offset": 21, "length": 8},
        {"type": "mention", "offset": 34, "length": 11},
    ]


# --------------------------------------------------------------------------- limits and errors


async def test_text_limit_counts_visible_utf16_units(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    status, _ = await api(http, fake, "sendMessage", chat_id=CHAT, text="x" * 4096)
    assert status == 200
    # Markup does not count, only what is visible after parsing.
    status, _ = await api(http, fake, "sendMessage", chat_id=CHAT, text="<b>" + "x" * 4096 + "</b>", parse_mode="HTML")
    assert status == 200
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="x" * 4097)
    assert (status, body["description"]) == (400, "Bad Request: message is too long")
    # 2049 emoji are 4098 UTF-16 units though only 2049 characters.
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="😀" * 2049)
    assert (status, body["description"]) == (400, "Bad Request: message is too long")
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="  ")
    assert (status, body["description"]) == (400, "Bad Request: message text is empty")


async def test_formatting_past_100_entities_is_dropped_silently(
    fake: FakeTelegram, http: aiohttp.ClientSession
) -> None:
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="<b>x</b> " * 101, parse_mode="HTML")
    assert status == 200
    assert len(body["result"]["entities"]) == 100
    assert fake.messages(CHAT)[0].dropped_entities == 1


async def test_bad_html_is_refused(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="<b>x", parse_mode="HTML")
    assert status == 400
    assert body["description"].startswith("Bad Request: can't parse entities: ")
    assert fake.messages(CHAT) == []


async def test_callback_data_is_limited_in_bytes(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    def markup(data: str) -> dict[str, Any]:
        return {"inline_keyboard": [[{"text": "Go", "callback_data": data}]]}

    status, _ = await api(http, fake, "sendMessage", chat_id=CHAT, text="a", reply_markup=markup("é" * 32))
    assert status == 200
    for data in ("é" * 33, ""):  # 66 bytes in 33 characters; and empty
        status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="a", reply_markup=markup(data))
        assert (status, body["description"]) == (400, "Bad Request: BUTTON_DATA_INVALID")


async def test_edits(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    keyboard = {"inline_keyboard": [[{"text": "Go", "callback_data": "kz1:x:a"}]]}
    _, sent = await api(
        http, fake, "sendMessage", chat_id=CHAT, text="<b>card</b>", parse_mode="HTML", reply_markup=keyboard
    )
    message_id = sent["result"]["message_id"]
    assert fake.message(CHAT, message_id).buttons == [{"text": "Go", "callback_data": "kz1:x:a"}]

    # Same text and keyboard: not modified.
    status, body = await api(
        http,
        fake,
        "editMessageText",
        chat_id=CHAT,
        message_id=message_id,
        text="<b>card</b>",
        parse_mode="HTML",
        reply_markup=keyboard,
    )
    assert (status, body["description"]) == (400, NOT_MODIFIED)
    # Same text without the keyboard: a change (the keyboard goes), then identical again.
    status, _ = await api(
        http, fake, "editMessageText", chat_id=CHAT, message_id=message_id, text="<b>card</b>", parse_mode="HTML"
    )
    assert status == 200
    assert fake.message(CHAT, message_id).reply_markup is None
    status, body = await api(
        http, fake, "editMessageText", chat_id=CHAT, message_id=message_id, text="<b>card</b>", parse_mode="HTML"
    )
    assert (status, body["description"]) == (400, NOT_MODIFIED)
    status, body = await api(http, fake, "editMessageText", chat_id=CHAT, message_id=9999, text="x")
    assert (status, body["description"]) == (400, "Bad Request: message to edit not found")
    user_message = fake.push_message(CHAT, 5, "mine")
    status, body = await api(http, fake, "editMessageText", chat_id=CHAT, message_id=user_message, text="x")
    assert (status, body["description"]) == (400, "Bad Request: message can't be edited")
    assert fake.message(CHAT, message_id).edits == 1


async def test_callback_query_is_answered_once(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    query = fake.push_callback(CHAT, 1, 42, "kz1:abc:a")
    status, _ = await api(http, fake, "answerCallbackQuery", callback_query_id=query, text="ok", show_alert=True)
    assert status == 200
    assert fake.callback_answers[query]["text"] == "ok"
    assert fake.callback_answers[query]["show_alert"] is True
    status, body = await api(http, fake, "answerCallbackQuery", callback_query_id=query, text="again")
    assert (status, body["description"]) == (400, QUERY_TOO_OLD)
    status, body = await api(http, fake, "answerCallbackQuery", callback_query_id="nope")
    assert (status, body["description"]) == (400, QUERY_TOO_OLD)
    other = fake.push_callback(CHAT, 1, 42, "kz1:abc:d")
    status, body = await api(http, fake, "answerCallbackQuery", callback_query_id=other, text="x" * 201)
    assert status == 400


async def test_wrong_token_and_unknown_method(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{fake.base_url}/bot1:wrong/getMe") as response:
        assert response.status == 401
    status, _ = await api(http, fake, "noSuchMethod")
    assert status == 404


# --------------------------------------------------------------------------- long polling


async def test_get_updates_long_poll_is_woken_by_a_push(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    poll = asyncio.create_task(api(http, fake, "getUpdates", timeout=30))
    await fake.wait_for_call("getUpdates", answered=False)
    assert not poll.done()
    fake.push_message(CHAT, 7, "hi @builder")
    status, body = await asyncio.wait_for(poll, 5)
    assert status == 200
    [update] = body["result"]
    assert update["message"]["text"] == "hi @builder"
    assert update["message"]["entities"] == [{"type": "mention", "offset": 3, "length": 8}]
    assert update["message"]["chat"]["type"] == "supergroup"
    # Unconfirmed updates come again; an offset past them confirms them.
    _, again = await api(http, fake, "getUpdates", timeout=0)
    assert [u["update_id"] for u in again["result"]] == [update["update_id"]]
    _, after = await api(http, fake, "getUpdates", offset=update["update_id"] + 1, timeout=0)
    assert after["result"] == []
    assert fake.pending_updates == 0


async def test_a_second_poller_ends_the_first_with_conflict(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    first = asyncio.create_task(api(http, fake, "getUpdates", timeout=30))
    await fake.wait_for_call("getUpdates", answered=False)
    second = asyncio.create_task(api(http, fake, "getUpdates", timeout=0))
    status, body = await asyncio.wait_for(first, 5)
    assert status == 409
    assert body["description"].startswith("Conflict: terminated by other getUpdates request")
    status, _ = await asyncio.wait_for(second, 5)
    assert status == 200


async def test_stop_wakes_a_pending_poll() -> None:
    fake = FakeTelegram()
    await fake.start()
    async with aiohttp.ClientSession() as http:
        poll = asyncio.create_task(api(http, fake, "getUpdates", timeout=60))
        await fake.wait_for_call("getUpdates", answered=False)
        await fake.stop()
        status, body = await asyncio.wait_for(poll, 5)
    assert (status, body["result"]) == (200, [])


# --------------------------------------------------------------------------- faults


async def test_scripted_faults_come_first_and_in_order(fake: FakeTelegram, http: aiohttp.ClientSession) -> None:
    fake.script("sendMessage", Fault.server_error(), Fault.too_many_requests(3))
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="a")
    assert (status, body["error_code"]) == (500, 500)
    status, body = await api(http, fake, "sendMessage", chat_id=CHAT, text="a")
    assert status == 429
    assert body == {
        "ok": False,
        "error_code": 429,
        "description": "Too Many Requests: retry after 3",
        "parameters": {"retry_after": 3},
    }
    status, _ = await api(http, fake, "sendMessage", chat_id=CHAT, text="a")
    assert status == 200
    assert [c.status for c in fake.calls_to("sendMessage")] == [500, 429, 200]


async def test_hang_never_answers_until_stop() -> None:
    fake = FakeTelegram()
    await fake.start()
    fake.script("sendMessage", Fault.hang())
    async with aiohttp.ClientSession() as http:
        call = asyncio.create_task(api(http, fake, "sendMessage", chat_id=CHAT, text="a"))
        first = await fake.wait_for_call("sendMessage", answered=False)
        # Other methods still answer while one hangs.
        status, _ = await api(http, fake, "getMe")
        assert status == 200
        assert first.status is None
        assert not call.done()
        await fake.stop()
        try:
            status, _ = await asyncio.wait_for(call, 5)
        except aiohttp.ClientError:
            status = 0  # the server closed the connection while stopping: also an end at stop
    assert status in (503, 0)


# --------------------------------------------------------------------------- the real client's wire format


async def test_python_telegram_bot_form_bodies_are_understood(fake: FakeTelegram) -> None:
    bot = Bot(fake.token, base_url=f"{fake.base_url}/bot", base_file_url=f"{fake.base_url}/file/bot")
    async with bot:
        assert bot.username == fake.bot_username
        keyboard = InlineKeyboardMarkup([[InlineKeyboardButton("Approve", callback_data="kz1:abc:a")]])
        sent = await bot.send_message(CHAT, "<i>123</i>", parse_mode=ParseMode.HTML, reply_markup=keyboard)
        assert sent.text == "123"
        call = fake.calls_to("sendMessage")[-1]
        assert call.params["text"] == "<i>123</i>"  # text stays text even when it looks like JSON
        assert call.params["chat_id"] == CHAT
        assert call.params["reply_markup"] == {"inline_keyboard": [[{"text": "Approve", "callback_data": "kz1:abc:a"}]]}
        with pytest.raises(BadRequest, match=r"(?i)button_data_invalid"):
            await bot.send_message(
                CHAT, "x", reply_markup=InlineKeyboardMarkup([[InlineKeyboardButton("a", callback_data="x" * 65)]])
            )
        fake.script("sendMessage", Fault.too_many_requests(2))
        with pytest.raises(RetryAfter):
            await bot.send_message(CHAT, "x")
        with pytest.raises(BadRequest, match=r"(?i)message is not modified"):
            await bot.edit_message_text(
                "<i>123</i>", chat_id=CHAT, message_id=sent.message_id, parse_mode=ParseMode.HTML, reply_markup=keyboard
            )
