"""Replayed Slack requests are dropped: a captured signed request posted again inside Slack's five-minute
signature window, and Slack's own retries of one event, reach Kazma once, also across a restart (the store
remembers signed requests). Real Bolt, the wire-level fake."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlencode

import aiohttp
import pytest

from kazma.adapters.slack import SlackAdapter
from kazma.adapters.slack.render import APPROVE_ACTION
from kazma.approvals.model import Decision
from kazma.bot.inbound_claims import MIGRATIONS as CLAIMS
from kazma.bot.inbound_claims import InboundClaims
from kazma.config.metrics import failure_count
from kazma.config.store.database import open_database
from tests.fakes.slack import FakeSlack, sign
from tests.test_slack_adapter import ADMIN, HOME, OTHER, Recorder, events_url, make_card, slack_config

FORM = "application/x-www-form-urlencoded"


@dataclass(frozen=True)
class Signed:
    """One request exactly as Slack would send it: what an eavesdropper could capture and post again."""

    body: str
    content_type: str
    headers: dict[str, str]


def signed(fake: FakeSlack, body: str, content_type: str, *, timestamp: int | None = None) -> Signed:
    stamp = str(timestamp if timestamp is not None else int(time.time()))
    headers = {
        "Content-Type": content_type,
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": sign(fake.signing_secret, stamp, body),
    }
    return Signed(body, content_type, headers)


async def post(url: str, request: Signed, extra: dict[str, str] | None = None) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=request.body.encode(), headers={**request.headers, **(extra or {})}) as response,
    ):
        await response.read()
        return response.status


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
async def adapter(fake: FakeSlack, recorder: Recorder) -> AsyncIterator[SlackAdapter]:
    started = SlackAdapter(slack_config(fake), request_timeout=1)
    await started.start(recorder.handlers())
    yield started
    recorder.hold.set()
    await started.stop()


def dropped() -> float:
    return failure_count("replay_dropped", "slack")


async def test_a_replayed_swarm_command_runs_once_and_a_different_one_still_arrives(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    url = events_url(adapter)
    before = dropped()
    command = signed(fake, urlencode(fake.command_form(text="cancel all", channel=HOME, user=ADMIN)), FORM)
    # The same bytes, the same headers, three times: every copy is acknowledged (so Slack would not retry)…
    assert [await post(url, command) for _ in range(3)] == [200, 200, 200]
    assert dropped() == before + 2  # …and the copies were dropped before any listener ran
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)

    other = signed(fake, urlencode(fake.command_form(text="status", channel=HOME, user=ADMIN)), FORM)
    assert await post(url, other) == 200
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 2)
    assert [(m.command, m.text) for m in recorder.inbound] == [("swarm", "cancel all"), ("swarm", "status")]
    assert dropped() == before + 2


async def test_a_replayed_button_press_is_handled_once(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    url = events_url(adapter)
    card = make_card({"command": "deploy"})
    ref = await adapter.post_card(card)
    before = dropped()

    def press() -> Signed:
        payload = fake.block_action_payload(
            action_id=APPROVE_ACTION,
            value=card.button_data(Decision.APPROVE),
            user=ADMIN,
            channel=HOME,
            message_ts=ref.message_id,
        )
        return signed(fake, urlencode({"payload": json.dumps(payload)}), FORM)

    captured = press()
    assert [await post(url, captured) for _ in range(3)] == [200, 200, 200]
    assert dropped() == before + 2
    await recorder.signal.wait_until(lambda: len(recorder.presses) >= 1)
    # A second real press (its own trigger id and signature) is not a replay.
    assert await post(url, press()) == 200
    await recorder.signal.wait_until(lambda: len(recorder.presses) >= 2)
    assert len(recorder.presses) == 2
    assert dropped() == before + 2


async def test_slacks_own_retry_of_an_event_is_handled_once(
    fake: FakeSlack, adapter: SlackAdapter, recorder: Recorder
) -> None:
    url = events_url(adapter)
    before = dropped()
    now = int(time.time())
    event = fake.message_event(channel=OTHER, user=ADMIN, text="@builder ship it")
    body = json.dumps(fake.event_envelope(event))  # one event_id
    assert await post(url, signed(fake, body, "application/json", timestamp=now)) == 200
    # Slack retries an event it thinks went unanswered: same body and event_id, a new timestamp, so a new signature.
    retry = signed(fake, body, "application/json", timestamp=now + 1)
    assert (
        retry.headers["X-Slack-Signature"]
        != signed(fake, body, "application/json", timestamp=now).headers["X-Slack-Signature"]
    )
    assert await post(url, retry, {"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"}) == 200
    assert dropped() == before + 1

    # A different event (its own event_id) is delivered.
    second = fake.message_event(channel=OTHER, user=ADMIN, text="and test it")
    assert await post(url, signed(fake, json.dumps(fake.event_envelope(second)), "application/json")) == 200
    await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 2)
    assert [m.text for m in recorder.inbound] == ["@builder ship it", "and test it"]
    assert dropped() == before + 1


async def test_a_request_replayed_after_a_restart_is_dropped_by_the_stores_memory(
    fake: FakeSlack, tmp_path: Path
) -> None:
    conn = await open_database(tmp_path / "kazma.db", migrations=CLAIMS)
    store = InboundClaims(conn, replica="local")
    command = signed(fake, urlencode(fake.command_form(text="cancel all", channel=HOME, user=ADMIN)), FORM)
    before = dropped()
    runs = [Recorder(), Recorder()]  # one process, then the next one on the same store
    try:
        for recorder in runs:
            adapter = SlackAdapter(slack_config(fake), request_timeout=1)
            await adapter.start(replace(recorder.handlers(), first_signed=store.first_signed))
            try:
                assert await post(events_url(adapter), command) == 200
                if recorder is runs[0]:
                    await recorder.signal.wait_until(lambda: len(runs[0].inbound) >= 1)
            finally:
                recorder.hold.set()
                await adapter.stop()
    finally:
        await conn.close()
    assert [(m.command, m.text) for m in runs[0].inbound] == [("swarm", "cancel all")]
    assert runs[1].inbound == []  # the new process had never seen it; the store had
    assert dropped() == before + 1


async def test_a_store_that_cannot_answer_lets_a_first_request_through_and_counts_it(
    fake: FakeSlack, recorder: Recorder
) -> None:
    async def broken(platform: str, keys: Sequence[str]) -> bool:
        raise OSError("disk I/O error")

    adapter = SlackAdapter(slack_config(fake), request_timeout=1)
    await adapter.start(replace(recorder.handlers(), first_signed=broken))
    before = failure_count("replay_check", "slack")
    try:
        command = signed(fake, urlencode(fake.command_form(text="status", channel=HOME, user=ADMIN)), FORM)
        assert await post(events_url(adapter), command) == 200
        await recorder.signal.wait_until(lambda: len(recorder.inbound) >= 1)
        assert await post(events_url(adapter), command) == 200  # this process's own memory still drops a copy
    finally:
        recorder.hold.set()
        await adapter.stop()
    assert [m.text for m in recorder.inbound] == ["status"]
    assert failure_count("replay_check", "slack") == before + 1
