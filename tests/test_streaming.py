"""A long answer is shown while the model writes it, on Telegram, Slack and Discord, within each one's edit limits.

The fake model streams its answer as server-sent events, one piece each time the test releases one (never on a
timer). Through the real adapters and their wire fakes, the answer's message appears after the first piece, grows
by edits as more is released, and ends as the whole answer exactly once — one message, the transcript keeping the
final text once. The edits the fakes record are spaced as each platform's pacing says (Telegram: one a second per
chat; Slack: one a second per channel; Discord: five per five seconds per channel, one a second), checked on the
gaps between the fakes' own arrival times, never on how fast the whole took. The model client's side: a streamed
reply is assembled to exactly the reply the same server sends whole, tool calls included.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kazma.adapters.discord.adapter import STREAM_EDIT_GAP
from kazma.bot.app import App
from kazma.config.metrics import failure_count
from kazma.config.models import ModelConfig
from kazma.engine import answer_stream
from kazma.engine.model import OpenAIProvider
from kazma.engine.types import ToolSpec
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.platforms_support import SLACK_ADMIN, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, Fakes, kazma_on, three_fakes

PIECES = 5
PIECE = 48
# Telegram and Slack: one send or edit a second into a chat (their limiters' min_interval); Discord: the stream's.
GAP = {"telegram": 1.0, "slack": 1.0, "discord": STREAM_EDIT_GAP}
# The fakes stamp a call when it reaches them (Slack's when it answers it): a loaded machine can hold one call
# in transit longer than the next, so two calls paced a second apart may be stamped closer. Unpaced edits come
# back to back (milliseconds apart); half the interval tells the two apart without reading the machine's load.
JITTER = 0.5


def long_answer() -> str:
    words = " ".join(f"word{i:03d}" for i in range(200))
    return words[: PIECES * PIECE].rstrip()


class Stream:
    """What the model client showed: each text so far, and how often a reply turned to tools."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.drops = 0

    def grew(self, text: str) -> None:
        self.texts.append(text)

    def dropped(self) -> None:
        self.drops += 1


# -- the model client ------------------------------------------------------------------------------------


async def test_a_streamed_reply_is_the_reply_sent_whole_and_its_text_is_shown_as_it_grows() -> None:
    arguments = '{"command": "rm -rf /tmp/build \\u00e9t\\u00e9", "paths": ["a", "b"], "n": 3}'
    async with FakeOpenAI() as fake:
        fake.chunk_size = 7
        config = ModelConfig(base_url=fake.base_url, name="fake-model", max_retries=0)
        tools = [ToolSpec("shell", "run", {"type": "object"})]
        async with OpenAIProvider(config) as provider:
            # whole (no stream open): the reference
            fake.script(Completion("Let me look.", (FakeToolCall("shell", arguments, id="call_1"),)))
            whole = await provider.complete([{"role": "user", "content": "x"}], tools)
            stream = Stream()
            fake.script(Completion("Let me look.", (FakeToolCall("shell", arguments, id="call_1"),), usage=(3, 4)))
            with answer_stream.feeding(stream):
                streamed = await provider.complete([{"role": "user", "content": "x"}], tools)
            text_stream = Stream()
            fake.script(Completion("All done: the build is clean."))
            with answer_stream.feeding(text_stream):
                answer = await provider.complete([{"role": "user", "content": "x"}], tools)
    assert fake.completions[1].body["stream"] is True
    assert fake.completions[0].body.get("stream") is None  # nobody showing it: asked whole, as before
    # the tool call put back together from 5-character pieces is exactly the one sent whole
    assert streamed.tool_calls == whole.tool_calls
    assert streamed.tool_calls[0].raw_arguments == arguments
    assert streamed.tool_calls[0].arguments["command"] == "rm -rf /tmp/build été"
    assert (streamed.content, streamed.finish_reason) == ("Let me look.", "tool_calls")
    assert (streamed.usage.prompt_tokens, streamed.usage.completion_tokens) == (3, 4)
    assert stream.texts == ["Let me ", "Let me look."]
    assert stream.drops == 1  # words, then tools: what was shown is not the answer
    assert answer.content == "All done: the build is clean."
    assert not answer.tool_calls
    assert text_stream.texts[-1] == answer.content
    assert len(text_stream.texts) == 5
    assert text_stream.drops == 0
    assert all(b.startswith(a) for a, b in itertools.pairwise(text_stream.texts))


# -- three platforms -------------------------------------------------------------------------------------


def shown(fakes: Fakes, platform: str) -> list[str]:
    """The bot's messages in the chat, as people read them."""
    if platform == "telegram":
        return [m.text for m in fakes.telegram.bot_messages(TG_CHAT)]
    if platform == "slack":
        return [m.text for m in fakes.slack.channel(SLACK_CHANNEL) if m.bot_id or m.username]
    return [str(m.get("content") or "") for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)
            if m.get("author", {}).get("bot")]  # fmt: skip


def sends_and_edits(fakes: Fakes, platform: str) -> tuple[list[float], int]:
    """When each paced call reached the platform, in order (Telegram, Slack: posts and edits share the chat's
    pace; Discord: edits); and how many were edits."""
    if platform == "telegram":
        calls = [c for c in fakes.telegram.calls if c.method.lower() in ("sendmessage", "editmessagetext")]
        return sorted(c.at for c in calls), sum(c.method.lower() == "editmessagetext" for c in calls)
    if platform == "slack":
        posts = [c for c in fakes.slack.calls if c.method in ("chat.postMessage", "chat.update")]
        return sorted(c.at for c in posts), sum(c.method == "chat.update" for c in posts)
    # Discord's limit is on edits (5 per 5 s per channel); its posts have a bucket of their own
    edits = fakes.discord.calls_to("PATCH", rf"/channels/{HOME_CHANNEL_ID}/messages/\d+")
    return sorted(c.at for c in edits), len(edits)


async def say(fakes: Fakes, platform: str, text: str) -> None:
    if platform == "telegram":
        fakes.telegram.push_message(TG_CHAT, TG_ADMIN, text)
    elif platform == "slack":
        assert fakes.slack_events_url is not None
        event = fakes.slack.message_event(channel=SLACK_CHANNEL, user=SLACK_ADMIN, text=text)
        await fakes.slack.post_event(fakes.slack_events_url, event)
    else:
        await fakes.discord.user_message(HOME_CHANNEL_ID, text)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not seen within {timeout:g} s: {what}") from None


@asynccontextmanager
async def streaming(tmp_path: Path, answer: str, piece: int) -> AsyncIterator[tuple[FakeOpenAI, Fakes, App]]:
    """Kazma on the three fakes with a model that streams ``answer`` in pieces of ``piece`` characters, one each
    time the test calls ``model.release()``."""
    async with FakeOpenAI() as model, three_fakes() as fakes:
        model.chunk_size = piece
        model.gate = asyncio.Semaphore(0)
        model.script(Completion(answer))
        extra = f"model: {{base_url: '{model.base_url}', name: fake-model, max_retries: 0}}"
        async with kazma_on(fakes, tmp_path / "k.db", extra=extra) as app:
            yield model, fakes, app


@pytest.mark.parametrize("platform", ["telegram", "slack", "discord"])
async def test_a_long_answer_appears_early_grows_by_paced_edits_and_ends_whole_exactly_once(
    tmp_path: Path, platform: str
) -> None:
    answer = long_answer()
    pieces = [answer[i : i + PIECE] for i in range(0, len(answer), PIECE)]
    async with streaming(tmp_path, answer, PIECE) as (model, fakes, app):
        await say(fakes, platform, "tell me everything")
        # one piece written: the message is there already, showing that piece and nothing more
        model.release()
        await until(lambda: any(pieces[0].strip() in t for t in shown(fakes, platform)), "the first piece")
        [first] = shown(fakes, platform)
        assert pieces[1].strip() not in first
        # each piece released shows up in that same message, edited
        for count in range(2, len(pieces) + 1):
            model.release()
            so_far = "".join(pieces[:count]).strip()

            def grown(so_far: str = so_far) -> bool:
                return any(so_far in t for t in shown(fakes, platform))

            await until(grown, f"{count} pieces")
            assert len(shown(fakes, platform)) == 1
        await app.conversations.drain()
        conversation = {"telegram": f"telegram:{TG_CHAT}", "slack": f"slack:{SLACK_CHANNEL}"}.get(
            platform, f"discord:{HOME_CHANNEL_ID}"
        )
        kept = [e.text for e in await app.transcript.messages(conversation) if e.direction == "out"]
    messages = shown(fakes, platform)
    times, edits = sends_and_edits(fakes, platform)

    # the whole answer, exactly once, in the one message that grew
    assert len(messages) == 1, messages
    assert messages[0].endswith(answer), messages
    assert sum(answer in t for t in messages) == 1
    assert edits >= len(pieces) - 1  # it grew by edits, not by new messages
    # never faster than the platform allows: every send or edit into the chat after the one before by the gap
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= GAP[platform] - JITTER, gaps
    if platform == "discord":  # and at most 5 edits in any 5 seconds
        assert all(sum(t <= s < t + 5.0 - JITTER for s in times) <= 5 for t in times)
    # the transcript keeps the final text once, not the drafts
    assert kept == [answer]


async def test_an_edit_that_fails_loses_nothing_the_whole_answer_is_posted_once(tmp_path: Path) -> None:
    answer = long_answer()
    pieces = [answer[i : i + PIECE] for i in range(0, len(answer), PIECE)]
    async with streaming(tmp_path, answer, PIECE) as (model, fakes, app):
        before = failure_count("stream", "slack")
        await say(fakes, "slack", "tell me everything")
        model.release()
        await until(lambda: any(pieces[0].strip() in t for t in shown(fakes, "slack")), "the first piece")
        fakes.slack.fail("chat.update", "error", error="cant_update_message")  # the next edit is refused
        model.release(len(pieces) - 1)
        await until(lambda: any(answer in t for t in shown(fakes, "slack")), "the whole answer")
        await app.conversations.drain()
        kept = [e.text for e in await app.transcript.messages(f"slack:{SLACK_CHANNEL}") if e.direction == "out"]
    messages = shown(fakes, "slack")
    # the draft shown before the failure stays as it was; the whole answer follows it, once
    assert len(messages) == 2, messages
    assert answer.startswith(messages[0])
    assert messages[0] != answer
    assert sum(answer in t for t in messages) == 1
    assert messages[-1] == answer
    assert kept == [answer]
    assert failure_count("stream", "slack") == before + 1


async def test_an_answer_longer_than_a_message_continues_in_a_new_message_as_it_grows(tmp_path: Path) -> None:
    # Discord holds 2000 characters a message: 2,600 arrive in three pieces and end as two messages
    answer = " ".join(f"token{i:04d}" for i in range(260))
    size = len(answer) // 3 + 1
    async with streaming(tmp_path, answer, size) as (model, fakes, app):
        await say(fakes, "discord", "tell me everything")
        model.release()
        first_piece = answer[:size].strip()
        await until(lambda: any(first_piece in t for t in shown(fakes, "discord")), "the first piece")
        assert [m.removeprefix("[kazma] ") for m in shown(fakes, "discord")] == [first_piece]  # nothing more yet
        model.release(2)
        await until(lambda: "token0259" in " ".join(shown(fakes, "discord")), "the last piece")
        await app.conversations.drain()
    messages = shown(fakes, "discord")
    assert len(messages) == 2, messages
    assert all(len(m) <= 2000 for m in messages)
    # the two parts are the answer, cut at a space (which the cut drops), each said once
    joined = messages[0].removeprefix("[kazma] ") + " " + messages[1].removeprefix("[kazma] ")
    assert joined == answer


async def test_model_stream_false_asks_for_the_whole_reply_even_where_it_could_be_shown() -> None:
    async with FakeOpenAI() as fake:
        config = ModelConfig(base_url=fake.base_url, name="fake-model", max_retries=0, stream=False)
        async with OpenAIProvider(config) as provider:
            stream = Stream()
            fake.script(Completion("whole, as before"))
            with answer_stream.feeding(stream):
                reply = await provider.complete([{"role": "user", "content": "x"}])
    assert fake.completions[0].body.get("stream") is None
    assert reply.content == "whole, as before"
    assert stream.texts == []
