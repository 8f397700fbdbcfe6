"""The inbound door (adapters/ingress.py): one ordered list of checks, walked until the first stop; every chat
platform runs the kit's list, the console runs the same door."""

from __future__ import annotations

import dataclasses

import pytest

from kazma.adapters.admission import FileBounds
from kazma.adapters.contract import Attachment, Inbound, PlatformError
from kazma.adapters.ingress import Arrival, Check, Ingress, SignedRequests, Stopped, Verdict, files_within
from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.web import WebAdapter
from kazma.config.models import TelegramConfig
from tests.contract.harness import Recorder

KIT_ORDER = ("replay_guard", "space_served", "chat_served", "claimed_here", "files_within")


def inbound(**changes: object) -> Inbound:
    base = Inbound(platform="x", chat="c", message_id="1", author="x:1", author_name="one", text="hi")
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


async def test_the_walk_stops_at_the_first_stop_and_later_checks_never_run() -> None:
    ran: list[str] = []

    def step(name: str, verdict: Stopped | None = None) -> Check:
        async def run(arrival: Arrival) -> Verdict:
            ran.append(name)
            return verdict or dataclasses.replace(arrival, key=f"{arrival.key}>{name}")

        return Check(name, run)

    door = Ingress([step("a"), step("b"), step("c", Stopped("c", "no")), step("d")])
    assert door.names == ("a", "b", "c", "d")
    assert await door.admit(Arrival("x", inbound(), key="k")) == Stopped("c", "no")
    assert ran == ["a", "b", "c"]
    ran.clear()
    passed = await Ingress([step("a"), step("b")]).admit(Arrival("x", inbound(), key="k"))
    assert isinstance(passed, Arrival)
    assert passed.key == "k>a>b"


def test_a_signed_request_is_new_once_within_the_window() -> None:
    now = [0.0]
    seen = SignedRequests(window=300.0, clock=lambda: now[0])
    assert seen.first_time(["sig:a", "event:1"])
    assert not seen.first_time(["sig:b", "event:1"])  # the platform's retry of one event, signed anew
    now[0] = 301.0
    assert seen.first_time(["sig:a"])  # older than the signature window: Bolt refuses it by age anyway


async def test_files_over_the_bounds_are_refused_whole_with_a_reply() -> None:
    async def fetch() -> bytes:
        return b"x" * 10

    many = tuple(Attachment(f"f{i}", 1, fetch) for i in range(3))
    door = Ingress([files_within(lambda: FileBounds(max_bytes=100, max_count=2))])
    stopped = await door.admit(Arrival("x", inbound(attachments=many)))
    assert isinstance(stopped, Stopped)
    assert stopped.reason == "files_refused"
    assert "at most 2" in (stopped.reply or "")
    one = await door.admit(Arrival("x", inbound(attachments=many[:1])))
    assert isinstance(one, Arrival)
    assert one.inbound is not None
    assert await one.inbound.attachments[0].fetch() == b"x" * 10  # bounded, still whole


async def test_a_file_over_what_telegram_hands_a_bot_is_refused_as_such_not_fetched_and_called_gone() -> None:
    # files.max_bytes may allow more than the 20 MB the Bot API's getFile hands a bot: such a file passed the bound,
    # Telegram refused its fetch ("File is too big"), and the sender read that it was most likely deleted.
    async def fetch() -> bytes:
        raise AssertionError("a file Telegram will not hand over is not fetched")

    config = TelegramConfig(token="1:x", chats=[-100], home_chat=-100)
    adapter = TelegramAdapter(config, files=FileBounds(max_bytes=100 * 1024 * 1024))
    door = Ingress([files_within(lambda: adapter.files)])
    big = Attachment("build.zip", 25 * 1024 * 1024, fetch)
    stopped = await door.admit(Arrival("x", inbound(attachments=(big,))))
    assert isinstance(stopped, Stopped)
    assert stopped.reply == (
        "Not saved: build.zip is 25.0 MB; Telegram hands a bot files up to 20.0 MB, so Kazma cannot fetch it (sending"
        " it again will not change that). Nothing was saved."
    )
    # under a files.max_bytes below Telegram's own limit, that bound is the one said
    small = TelegramAdapter(config, files=FileBounds(max_bytes=10 * 1024 * 1024))
    refused = await Ingress([files_within(lambda: small.files)]).admit(Arrival("x", inbound(attachments=(big,))))
    assert isinstance(refused, Stopped)
    assert "(files.max_bytes)" in (refused.reply or "")


async def test_the_console_runs_the_door_and_a_refused_message_reaches_no_agent() -> None:
    async def fetch() -> bytes:
        return b"data"

    recorder = Recorder()
    web = WebAdapter(files=FileBounds(max_bytes=100, max_count=1))
    assert set(web.door.names) <= set(KIT_ORDER)  # the kit's checks, not a rule of its own
    await web.start(recorder.handlers())
    try:
        with pytest.raises(PlatformError, match="at most 1"):
            await web.say("alice", "two files", attachments=(Attachment("a", 4, fetch), Attachment("b", 4, fetch)))
        assert recorder.inbound == []
        assert web.messages() == []
        await web.say("alice", "@builder one file", attachments=(Attachment("a", 4, fetch),))
    finally:
        await web.stop()
    [arrived] = recorder.inbound
    assert arrived.mentions == ("builder",)
    assert await arrived.attachments[0].fetch() == b"data"
