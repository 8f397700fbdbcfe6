"""Daily use, one behaviour on every platform: direct messages by ``dm_policy``, files in (bounded) and
out, and the working sign — each through the real library against its platform's wire-level fake."""

from __future__ import annotations

import pytest

from kazma.adapters.admission import DirectPolicy, FileBounds, FileTooLarge
from kazma.adapters.contract import FileAdapter
from tests.contract.harness import Harness

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


def actor(harness: Harness, user: str) -> str:
    return f"{harness.platform}:{user}"


# --------------------------------------------------------------------------- direct messages


async def test_a_direct_message_is_ignored_when_dm_policy_is_off(harness: Harness) -> None:
    await harness.start()
    await harness.say_direct(harness.admin, "hello from my DM")
    await harness.say(harness.home, harness.member, "in the group")
    await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    await harness.settled()
    assert [i.text for i in harness.recorder.inbound] == ["in the group"]


async def test_a_direct_message_from_an_allowed_actor_arrives_as_direct(harness: Harness) -> None:
    await harness.start(direct=DirectPolicy.of([actor(harness, harness.admin)], ()))
    chat = await harness.say_direct(harness.admin, "plan the release with me")
    [inbound] = await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    assert inbound.direct is True
    assert inbound.chat == chat != harness.home
    assert inbound.author == actor(harness, harness.admin)
    assert inbound.text == "plan the release with me"


async def test_approvers_policy_lets_approvers_in_and_keeps_others_out(harness: Harness) -> None:
    await harness.start(direct=DirectPolicy.of("approvers", [actor(harness, harness.admin)]))
    await harness.say_direct(harness.member, "not an approver")
    await harness.say_direct(harness.admin, "an approver")
    await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    await harness.settled()
    assert [(i.text, i.direct) for i in harness.recorder.inbound] == [("an approver", True)]


async def test_the_bot_answers_in_the_dm(harness: Harness) -> None:
    adapter = await harness.start(direct=DirectPolicy.of([actor(harness, harness.admin)], ()))
    chat = await harness.say_direct(harness.admin, "hi")
    await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    await adapter.send_text(chat, "hello in private", agent="kazma")
    assert [t.removeprefix("[kazma] ") for t in harness.bot_texts(chat)] == ["hello in private"]


def test_dm_policy_settings() -> None:
    assert not DirectPolicy.of("off", ["telegram:1"]).allows("telegram:1")
    assert DirectPolicy.of("approvers", ["telegram:1"]).allows("telegram:1")
    assert not DirectPolicy.of("approvers", ["telegram:1"]).allows("telegram:2")
    assert DirectPolicy.of(["slack:U1"], []).allows("slack:U1")


# --------------------------------------------------------------------------- files in


async def test_a_file_sent_in_arrives_with_its_name_and_content(harness: Harness) -> None:
    await harness.start()
    await harness.send_files(
        harness.home, harness.member, "here is the log", [("build.log", b"line 1\nline 2\n", None)]
    )
    [inbound] = await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    assert inbound.text == "here is the log"
    [attachment] = inbound.attachments
    assert attachment.name == "build.log"
    assert attachment.size == 14
    assert await attachment.fetch() == b"line 1\nline 2\n"


async def test_an_oversized_file_is_refused_with_a_reply_and_never_delivered(harness: Harness) -> None:
    await harness.start(files=FileBounds(max_bytes=1000, max_count=3))
    await harness.send_files(harness.home, harness.member, "too big", [("dump.bin", b"x" * 2000, None)])
    await harness.say(harness.home, harness.member, "after")
    await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    await harness.settled()
    # (Discord echoes the bot's own reply back as a bot message; the router drops those)
    assert [i.text for i in harness.recorder.inbound if not i.from_bot] == ["after"]
    [reply] = harness.bot_texts(harness.home)
    assert "dump.bin" in reply
    assert "files.max_bytes" in reply
    assert "Nothing was saved" in reply


async def test_a_file_whose_declared_size_lies_is_refused_when_fetched(harness: Harness) -> None:
    await harness.start(files=FileBounds(max_bytes=1000, max_count=3))
    await harness.send_files(harness.home, harness.member, "small, it says", [("liar.bin", b"y" * 3000, 10)])
    [inbound] = await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    with pytest.raises(FileTooLarge, match=r"liar\.bin"):
        await inbound.attachments[0].fetch()


# --------------------------------------------------------------------------- files out


async def test_send_file_posts_the_file_with_who_sent_it(harness: Harness) -> None:
    adapter = await harness.start()
    assert isinstance(adapter, FileAdapter)
    content = bytes(range(256)) * 8  # binary, with every byte value
    message_id = await adapter.send_file(harness.home, "report.bin", content, agent="builder")
    assert message_id
    [(name, data, caption)] = harness.files_posted(harness.home)
    assert (name, data) == ("report.bin", content)
    assert "builder" in caption


async def test_send_file_into_a_dm(harness: Harness) -> None:
    adapter = await harness.start(direct=DirectPolicy.of([actor(harness, harness.admin)], ()))
    chat = await harness.say_direct(harness.admin, "send me the notes")
    await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    await adapter.send_file(chat, "notes.txt", b"the notes\n", agent="kazma")
    assert [(n, d) for n, d, _ in harness.files_posted(chat)] == [("notes.txt", b"the notes\n")]


# --------------------------------------------------------------------------- the working sign


async def test_the_working_sign_is_shown_and_rate_limited_per_chat(harness: Harness) -> None:
    adapter = await harness.start()
    now = [100.0]
    adapter._clock = lambda: now[0]  # the kit's clock: the limit is time-based, not call-count based
    first = await adapter.working(harness.home)
    again = await adapter.working(harness.home)  # within the interval: skipped
    other = await adapter.working(harness.other)  # another chat has its own budget
    now[0] += adapter.typing_interval
    later = await adapter.working(harness.home)
    assert (first, again, other, later) == (True, False, True, True)
    signs = harness.working_signs(harness.home)
    assert signs is None or signs == 2
