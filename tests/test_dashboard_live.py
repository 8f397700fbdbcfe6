"""The live dashboard: the feed coalesces changes and shares one snapshot; the server pushes it over /events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from kazma.bot.console.feed import ChangeFeed
from tests.test_web_server import OPERATOR, READER, assert_security_headers, console


async def test_changes_are_coalesced_and_one_snapshot_is_shared() -> None:
    loaded: list[int] = []
    feed: ChangeFeed[int] = ChangeFeed(lambda: _load(feed, loaded), min_interval=0.3)
    first, second = feed.follow(), feed.follow()
    waiting = [asyncio.create_task(_next(first)), asyncio.create_task(_next(second))]
    await asyncio.sleep(0)  # both followers are waiting for a change
    assert loaded == []  # nothing is read while nothing changes
    feed.touch()
    assert await asyncio.wait_for(asyncio.gather(*waiting), 5) == [1, 1]
    assert feed.loads == 1  # two pages, one read of the stores
    pushed_at = time.monotonic()
    for _ in range(5):
        feed.touch()  # a burst: one push for all of it, a window after the last one
    assert await asyncio.wait_for(anext(first), 5) == 6
    assert time.monotonic() - pushed_at >= 0.25  # not sooner than the window (a little slack for the clock)
    assert feed.loads == 2


async def _next(follower: AsyncIterator[int]) -> int:
    return await anext(follower)


async def _load(feed: ChangeFeed[int], loaded: list[int]) -> int:
    loaded.append(feed.version)
    return feed.version


async def test_a_follower_behind_gets_the_current_snapshot_at_once() -> None:
    feed: ChangeFeed[int] = ChangeFeed(lambda: _load(feed, []), min_interval=10)
    feed.touch()
    feed.touch()
    assert await asyncio.wait_for(anext(feed.follow(since=0)), 5) == 2
    assert await asyncio.wait_for(anext(feed.follow(since=-1)), 5) == 2  # the shared snapshot, not read again
    assert feed.loads == 1


async def _dashboard_event(events: aiohttp.ClientResponse, wanted: str) -> dict[str, object]:
    """The next dashboard event whose fragment contains ``wanted`` (other events and older numbers are skipped)."""
    async with asyncio.timeout(10):
        while True:
            line = (await events.content.readline()).decode()
            if line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                if data.get("type") == "dashboard" and wanted in data["html"]:
                    return dict(data)


async def _ready(events: aiohttp.ClientResponse) -> None:
    async with asyncio.timeout(10):
        while (await events.content.readline()).decode().strip() != ": ready":
            pass


async def test_a_decision_reaches_an_open_dashboard_over_the_event_stream(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as op, con.client() as rd:
        csrf = await con.login(op, "alice", OPERATOR)
        await con.login(rd, "rita", READER)
        request = await con.open_approval({"command": "ls"})
        page = await (await rd.get(f"{con.base}/swarm")).text()
        assert 'http-equiv="refresh"' not in page  # no reloading
        assert "No approval request got an outcome in the last 24 hours." in page
        version = page.split('<div id="dashboard" data-version="', 1)[1].split('"', 1)[0]
        events = await rd.get(f"{con.base}/events?dashboard={version}")
        assert events.status == 200
        assert_security_headers(events)
        await _ready(events)

        pressed = await op.post(
            f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf, "decision": "approve"}
        )  # a press in another browser
        assert "Approved. Recorded as alice (web:alice)." in await pressed.text()
        pushed = await _dashboard_event(events, "1 approved")
        fragment = str(pushed["html"])
        assert fragment.startswith('<div id="dashboard"')
        assert "1 approval requests got an outcome in the last 24 hours: 1 approved, 0 denied" in fragment
        assert "Calls waited for a person (opened → deciding press, 24 h): 1 decisions" in fragment
        assert "presses decided since Kazma started; from a press reaching Kazma to its decision" in fragment
        assert "<td>approved</td><td>agent:builder</td>" in fragment  # the recent approvals table too
        assert "/decide" not in fragment  # rendered for a reader: no forms
        assert "/revoke" not in fragment
        events.close()


async def test_swarm_work_reaches_an_operators_dashboard_with_its_forms(tmp_path: Path) -> None:
    async with console(tmp_path, gated="builder") as con, con.client() as op:
        csrf = await con.login(op, "alice", OPERATOR)
        events = await op.get(f"{con.base}/events?dashboard=0")
        await _ready(events)
        await op.post(f"{con.base}/swarm/command", data={"csrf": csrf, "text": "dispatch builder build it"})
        pushed = await _dashboard_event(events, "1 running")
        fragment = str(pushed["html"])
        assert "/cancel" in fragment  # the operator's own forms…
        assert f'name="csrf" value="{csrf}"' in fragment  # …signed with the operator's session
        assert "1 swarm tasks and 0 plan steps" in fragment
        events.close()


async def test_a_version_too_long_to_be_a_number_is_answered_with_the_dashboard_not_a_cut_stream(
    tmp_path: Path,
) -> None:
    async with console(tmp_path) as con, con.client() as rd:
        await con.login(rd, "rita", READER)
        # 5,000 digits: past Python's int() limit of 4,300, which raised inside the already started stream
        events = await rd.get(f"{con.base}/events?dashboard={'9' * 5000}")
        assert events.status == 200
        lines: list[str] = []
        async with asyncio.timeout(10):
            while not any(line.startswith("data: ") and '"dashboard"' in line for line in lines):
                line = (await events.content.readline()).decode()
                assert line, f"the stream ended before any dashboard: {lines}"
                lines.append(line)
        events.close()
