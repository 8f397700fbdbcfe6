"""End to end with Matrix as the fourth platform: a real Synapse beside the Telegram, Slack and Discord wire fakes,
the four real adapters and one Kazma app between them. Only the model is scripted.

A mention of an agent in a Matrix room becomes its tool call; the card goes to all four platforms at once; a
stranger's reaction changes nothing; an approver's ✅ on Matrix decides and every card, Matrix's by an edit,
shows the outcome. A Kazma stopped between the decision and the Matrix edit settles that card once after it
starts again.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import structlog

from kazma.adapters.matrix import MatrixAdapter
from kazma.adapters.matrix.position import ACCOUNT_DATA_TYPE
from kazma.adapters.matrix.render import CHOICES_KEY
from kazma.adapters.outbox import Outbox
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.slack import SlackAdapter
from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals.model import Decision, Status
from kazma.bot.app import App, build_app
from kazma.bot.store import open_store
from kazma.config import LoadedConfig, load_config, load_config_text
from kazma.config.store.database import connect
from kazma.engine.scenario import PerAgentScript, agent_prompts
from kazma.engine.types import ModelReply, ToolCall
from tests.matrix_support import FaultProxy, Person, Synapse, shared_synapse
from tests.platforms_support import PLATFORMS, Fakes, adapters_for, three_fakes
from tests.process_support import run_kazma

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning"),
]

COMMAND = "echo ran >> matrix-runs.log"
EDIT = r"/send/m\.room\.message/kazma-edit-"
EDITS_READ = r"/relations/[^/]+/m\.replace$"  # what an edit reads first: the card's newest edit


class Room:
    """A fresh Matrix room: the approver (alice), a stranger (bob) and the bot in it."""

    def __init__(self, server: Synapse) -> None:
        self.server = server
        self.bot = server.session(server.register("kazma"))
        self.alice = server.register("alice")
        self.bob = server.register("bob")
        self.id = ""

    def make(self) -> None:
        self.id = self.alice.create_room(invite=[self.bot.user_id, self.bob.user_id], name="e2e")
        self.bot.join(self.id)
        self.bob.join(self.id)
        self.bot.set_account_data(ACCOUNT_DATA_TYPE, {})  # Kazma starts here for the first time

    def cards(self) -> list[dict[str, Any]]:
        """The bot's cards in the room (their original events), oldest first."""
        return [
            e
            for e in self.alice.messages(self.id)
            if e.get("sender") == self.bot.user_id and "Approval needed" in str(e["content"].get("body", ""))
            and "m.new_content" not in e["content"]
        ]  # fmt: skip

    def edits(self, event_id: str) -> list[dict[str, Any]]:
        path = f"/_matrix/client/v1/rooms/{quote(self.id)}/relations/{quote(event_id)}/m.replace"
        return list(self.alice.request("GET", path).get("chunk", []))

    def notices_to(self, person: Person) -> list[str]:
        return [
            str(e["content"]["body"])
            for e in self.alice.messages(self.id)
            if e.get("sender") == self.bot.user_id and e["content"].get("msgtype") == "m.notice"
            and e["content"].get("m.mentions", {}).get("user_ids") == [person.user_id]
        ]  # fmt: skip


def config_yaml(fakes: Fakes, store: Path, room: Room, homeserver: str) -> str:
    return fakes.config_yaml(store, extra="tools: {shell: dangerous, sandbox: none}") + (
        "  matrix:\n"
        f"    homeserver: '{homeserver}'\n"
        f"    user_id: '{room.bot.user_id}'\n"
        f"    access_token: '{room.bot.token}'\n"
        f"    rooms: ['{room.id}']\n"
        f"    home_room: '{room.id}'\n"
        f"    admins: ['{room.alice.user_id}']\n"
    )


def scripted(loaded: LoadedConfig) -> PerAgentScript:
    call = ToolCall("s", "shell", {"command": COMMAND}, json.dumps({"command": COMMAND}))
    return PerAgentScript(
        {"builder": [ModelReply(content=None, tool_calls=(call,)), ModelReply(content="builder: it ran")]},
        agent_prompts(loaded.config),
        after={"kazma": lambda _messages: ModelReply(content="noted")},
    )


@asynccontextmanager
async def kazma(fakes: Fakes, store: Path, room: Room, homeserver: str) -> AsyncIterator[App]:
    loaded = load_config_text(config_yaml(fakes, store, room, homeserver), environ={})
    matrix = MatrixAdapter(loaded.config.platforms.matrix, limiter=ChatRateLimiter(min_interval=0.0), poll_timeout=5)
    adapters = [*adapters_for(loaded), matrix]
    app = await build_app(
        loaded, provider=scripted(loaded), adapters=adapters, poll_interval=0.05, workspace_root=store.parent / "ws"
    )
    await app.start()
    fakes.slack_events_url = next(a for a in adapters if isinstance(a, SlackAdapter)).events_url
    try:
        yield app
    finally:
        await app.conversations.drain()
        await app.stop()


async def until(predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Wait for ``predicate`` (it may read the homeserver: run in a thread), bounded."""
    async with asyncio.timeout(timeout):
        while not (found := await asyncio.to_thread(predicate)):
            await asyncio.sleep(0.05)
        return found


async def test_a_mention_on_matrix_a_card_everywhere_a_reaction_decides_every_card_settles(tmp_path: Path) -> None:
    room = Room(shared_synapse())
    await asyncio.to_thread(room.make)
    async with three_fakes() as fakes, kazma(fakes, tmp_path / "k.db", room, room.server.url) as app:
        await asyncio.to_thread(room.alice.say, room.id, "@builder please run the release check")
        [card] = await until(room.cards)
        await fakes.wait(lambda: all(fakes.posted(p) and fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
        [request] = await app.service.store.requests()
        for platform in PLATFORMS:
            assert request.args_hash in fakes.card_text(platform), platform
        assert request.args_hash in card["content"]["body"]
        assert request.args_hash in card["content"]["formatted_body"]
        assert request.conversation == f"matrix:{room.id}"

        # a stranger's ✅ is refused and changes nothing anywhere
        await asyncio.to_thread(room.bob.react, room.id, card["event_id"], "✅")
        async with asyncio.timeout(60):
            while not await app.service.store.events(request.id, event="press_refused"):
                await asyncio.sleep(0.05)
        [refused] = await app.service.store.events(request.id, event="press_refused")
        assert refused.actor == f"matrix:{room.bob.user_id}"
        row = await app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        assert all(fakes.has_buttons(p) for p in PLATFORMS)
        assert room.edits(card["event_id"]) == []
        await until(lambda: room.notices_to(room.bob))  # told privately (a mention of them alone)

        # the approver's ✅ decides, once, for every platform
        await asyncio.to_thread(room.alice.react, room.id, card["event_id"], "✅")
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=60)
        assert (outcome.status, outcome.decided_by) == (Status.APPROVED, f"matrix:{room.alice.user_id}")
        await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
        for platform in PLATFORMS:
            assert f"APPROVED by matrix:{room.alice.user_id}" in fakes.card_text(platform), platform
        [edit] = await until(lambda: room.edits(card["event_id"]))
        shown = edit["content"]["m.new_content"]
        assert CHOICES_KEY not in shown  # settled: nothing left to react with
        assert shown["body"].startswith("APPROVED")
        assert f"APPROVED by matrix:{room.alice.user_id}" in shown["formatted_body"]
        await app.conversations.drain()
        runs = [p.read_text() for p in (tmp_path / "ws").rglob("matrix-runs.log")]
        assert runs == ["ran\n"]  # what was approved ran, once
        assert room.notices_to(room.alice) == []  # the winner is not alarmed: the edit is the answer


async def test_a_redacted_matrix_card_is_not_edited_when_the_request_is_decided(tmp_path: Path) -> None:
    """A moderator redacts the Matrix card (its arguments showed a secret); the request is decided through the
    API. Every other platform's card shows the outcome, the Matrix card's settle is done without any edit that
    would carry the card again, and nothing tries it again."""
    room = Room(shared_synapse())
    await asyncio.to_thread(room.make)
    async with three_fakes() as fakes, kazma(fakes, tmp_path / "k.db", room, room.server.url) as app:
        with structlog.testing.capture_logs() as logged:
            request = await app.service.open("shell", {"command": "deploy --token s3cret"}, "agent:builder",
                                             f"matrix:{room.id}")  # fmt: skip
            [card] = await until(room.cards)
            await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
            path = f"/_matrix/client/v3/rooms/{quote(room.id)}/redact/{quote(card['event_id'])}/kazma-e2e"
            await asyncio.to_thread(room.alice.request, "PUT", path, {"reason": "shows a secret"})
            await until(lambda: any(e["event"] == "matrix.card_redacted" for e in logged))  # the sync took it
            decided = await app.service.decide(request.id, Decision.APPROVE, actor=f"matrix:{room.alice.user_id}",
                                               platform="matrix")  # fmt: skip
            assert decided.won
            await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
            async with asyncio.timeout(60):
                while any(c.settled_at is None for c in await app.service.store.cards(request.id)):
                    await asyncio.sleep(0.05)
        for platform in PLATFORMS:
            assert "APPROVED" in fakes.card_text(platform), platform
        assert room.edits(card["event_id"]) == []
        replaces = [
            e for e in room.alice.messages(room.id)
            if (e.get("content") or {}).get("m.relates_to", {}).get("rel_type") == "m.replace"
            and e["content"]["m.relates_to"].get("event_id") == card["event_id"]
        ]  # fmt: skip
        assert replaces == []
        [skipped] = [e for e in logged if e["event"] == "matrix.edit_skipped_redacted"]
        assert (skipped["card"], skipped["settled"]) == (card["event_id"], True)


@pytest.mark.parametrize("lost", ["edit", "answer"])
async def test_a_restart_between_the_decision_and_the_matrix_edit_settles_the_card_once(
    tmp_path: Path, lost: str
) -> None:
    """``edit``: every edit fails until Kazma stops; ``answer``: every edit reaches the homeserver but its answer
    is lost, so Kazma tries it again (reading first that it landed) and once more after the restart: still one
    edit on the room."""
    room = Room(shared_synapse())
    await asyncio.to_thread(room.make)
    proxy = FaultProxy(room.server.url)
    await proxy.start()
    store = tmp_path / "k.db"
    try:
        async with three_fakes() as fakes:
            # every Matrix edit fails while the first Kazma runs (or lands, and its answer is lost)
            proxy.fail("PUT", EDIT, 500, times=10_000, after=lost == "answer")
            async with kazma(fakes, store, room, proxy.url) as app:
                request = await app.service.open("shell", {"command": "deploy --prod"}, "agent:builder",
                                                 f"matrix:{room.id}")  # fmt: skip
                [card] = await until(room.cards)
                await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
                await asyncio.to_thread(room.alice.react, room.id, card["event_id"], "✅")
                outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=60)
                assert outcome.status is Status.APPROVED
                await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
                if lost == "edit":
                    await until(lambda: proxy.count("PUT", EDIT) >= 2)  # the Matrix edit was tried, and tried again
                else:  # tried again, it read that the edit landed, and sent nothing more
                    await until(lambda: proxy.count("GET", EDITS_READ) >= 2)
                    assert proxy.count("PUT", EDIT) == 1
                assert len(room.edits(card["event_id"])) == (1 if lost == "answer" else 0)
            proxy.faults.clear()
            async with kazma(fakes, store, room, proxy.url) as app:
                newest = await until(lambda: room.edits(card["event_id"])[:1])  # the relations API: newest first
                assert newest[0]["content"]["m.new_content"]["body"].startswith("APPROVED")
                assert "it did not run" in newest[0]["content"]["m.new_content"]["body"]  # what became of it
                async with asyncio.timeout(60):
                    cards = await app.service.store.cards(request.id)
                    while any(c.settled_at is None for c in cards):
                        await asyncio.sleep(0.05)
                        cards = await app.service.store.cards(request.id)
                assert sorted(c.platform for c in cards) == sorted([*PLATFORMS, "matrix"])
                row = await app.service.store.get(request.id)
                assert row is not None
                assert (row.status, row.decided_by) == (Status.APPROVED, f"matrix:{room.alice.user_id}")
            # Each thing the card had to say was said once: an edit tried again and again (its answer lost) is one
            # edit on the room; the restart adds only what became of the call (approved, but it did not run).
            bodies = [e["content"]["m.new_content"]["body"] for e in room.edits(card["event_id"])]
            assert len(bodies) == len(set(bodies)) == (2 if lost == "answer" else 1)
            assert room.notices_to(room.alice) == []  # the reaction was not taken again after the restart
    finally:
        await proxy.stop()


async def test_sigkill_after_a_reaction_decided_then_a_restart_settles_the_matrix_card(tmp_path: Path) -> None:
    """`kazma run` as a real process, its Matrix adapter built from the registry: an approver's ✅ decides, the
    process is killed while every Matrix edit fails, and the next process settles the card from the store —
    without taking the reaction in a second time (its sync position was kept)."""
    room = Room(shared_synapse())
    await asyncio.to_thread(room.make)
    proxy = FaultProxy(room.server.url)
    await proxy.start()
    store_path, config, log = tmp_path / "k.db", tmp_path / "kazma.yaml", tmp_path / "kazma.log"
    try:
        async with three_fakes() as fakes:
            config.write_text(config_yaml(fakes, store_path, room, proxy.url))
            loaded = load_config(config, environ={})
            first = await run_kazma(config, log)
            conn = await open_store(loaded.config)
            outbox_conn = await connect(store_path)
            try:
                await until(lambda: proxy.count("GET", r"/sync$") >= 2)  # the first process syncs: it leads
                service = ApprovalService(ApprovalStore(conn), loaded.config)
                request = await service.open(
                    "shell", {"command": "deploy --prod"}, "agent:builder", f"matrix:{room.id}"
                )
                await Outbox(outbox_conn).enqueue(request.id, [*PLATFORMS, "matrix"])
                [card] = await until(room.cards)
                proxy.fail("PUT", EDIT, 500, times=10_000)
                await asyncio.to_thread(room.alice.react, room.id, card["event_id"], "✅")
                async with asyncio.timeout(60):
                    while (row := await service.store.get(request.id)) is None or row.status is Status.PENDING:
                        await asyncio.sleep(0.05)
                assert row.decided_by == f"matrix:{room.alice.user_id}"
                await until(lambda: proxy.count("PUT", EDIT) >= 1)
            finally:
                first.send_signal(signal.SIGKILL)
                await first.wait()
            assert first.returncode == -signal.SIGKILL
            assert room.edits(card["event_id"]) == []  # the kill left the Matrix card showing its reactions
            proxy.faults.clear()
            second = await run_kazma(config, log)
            try:
                newest = await until(lambda: room.edits(card["event_id"])[:1])
                assert newest[0]["content"]["m.new_content"]["body"].startswith("APPROVED")
                async with asyncio.timeout(60):
                    while any(c.settled_at is None for c in await service.store.cards(request.id)):
                        await asyncio.sleep(0.05)
                assert len(await service.store.events(request.id, event="decided")) == 1
                assert len(await service.store.events(request.id, event="press_lost")) == 0  # not taken in twice
            finally:
                second.send_signal(signal.SIGTERM)
                await asyncio.wait_for(second.wait(), timeout=60)
                await conn.close()
                await outbox_conn.close()
            assert second.returncode == 0, log.read_text()[-3000:]
            bodies = [e["content"]["m.new_content"]["body"] for e in room.edits(card["event_id"])]
            assert len(bodies) == len(set(bodies))  # nothing said twice
    finally:
        await proxy.stop()
