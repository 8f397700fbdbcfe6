"""Two `kazma run` replicas on one PostgreSQL against the three wire-level platform fakes.

A hundred requests are opened; each card appears once per platform, whichever
replica posts it. Presses arrive at either replica (Slack's HTTP posts go to
the follower, Telegram and Discord presses reach whoever holds their single
connection). The leader is SIGKILLed in the middle, with Telegram presses it
fetched and may not have confirmed: the follower leads within 10 s (its
/healthz says so), opens Telegram polling and the Discord gateway, and the
rest of the presses decide. In the end every request is decided once (nobody
pressed twice: no Telegram press was lost with the leader), every card shows
its outcome, no card was posted twice, and no Telegram press was answered
twice.

The replicas run with ``--no-pacing`` (the fakes enforce no rate limits; a
hundred paced cards would take Telegram's group limit five minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalService, ApprovalStore, Status
from kazma.approvals.seal import seal_problem
from kazma.bot.store import pg_migrations
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.postgres import PgStore, open_pg_store
from tests.audit_support import AUDIT_KEY
from tests.child_env import child_env
from tests.contract.harness import free_port
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import PLATFORMS, SLACK_ADMIN, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, Fakes, three_fakes
from tests.tcp_proxy import CuttableProxy

REQUESTS = 100
TOKEN = "o" * 40
READER = "r" * 40
DECISION_KEY = "k1:" + "d" * 40
SHARED_KEYS = Keyring.of(DECISION_KEYS, ("k1", "d" * 40))
pytestmark = pytest.mark.slow


class Replica:
    def __init__(self, name: str, fakes: Fakes, dsn: str, folder: Path) -> None:
        self.name = name
        self.web_port, self.slack_port = free_port(), free_port()
        self.config = folder / f"{name}.yaml"
        self.log = folder / f"{name}.log"
        text = fakes.config_yaml(folder / f"{name}.db")
        text = text.replace(f"store: {{path: '{folder / f'{name}.db'}'}}", f"store: {{url: '{dsn}'}}")
        text = text.replace("web: {port: 0}", f"web: {{port: {self.web_port}}}")
        text = text.replace("http: {port: 0}", f"http: {{port: {self.slack_port}}}")
        assert dsn in text
        assert f"port: {self.web_port}" in text
        assert f"port: {self.slack_port}" in text
        self.config.write_text(text)
        self.process: asyncio.subprocess.Process | None = None

    @property
    def events_url(self) -> str:
        return f"http://127.0.0.1:{self.slack_port}/slack/events"

    async def start(self) -> None:
        env = child_env(
            {
                "NO_PROXY": "127.0.0.1,localhost",
                "KAZMA_REPLICA": self.name,
                "KAZMA_WEB_TOKEN": TOKEN,
                "KAZMA_WEB_READER_TOKEN": READER,
                "KAZMA_DECISION_KEY": DECISION_KEY,  # every replica verifies the others' seals
                "KAZMA_AUDIT_KEY": AUDIT_KEY,  # every replica signs the one audit chain
            }
        )
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(self.config), "--log-format", "json", "run",
            "--poll-interval", "2", "--no-pacing",
            stdout=asyncio.subprocess.DEVNULL, stderr=self.log.open("ab"), env=env, cwd=self.config.parent,
        )  # fmt: skip

    async def health(self) -> str:
        async with httpx.AsyncClient(timeout=5) as client:
            try:
                return (await client.get(f"http://127.0.0.1:{self.web_port}/healthz")).text
            except httpx.HTTPError:
                return ""

    async def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.process is None or self.process.returncode is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        return await asyncio.wait_for(self.process.wait(), timeout=60)

    def said(self, event: str) -> bool:
        """Whether the replica logged ``event`` (a stable event name) at all."""
        return self.log.exists() and f'"event": "{event}"' in self.log.read_text(errors="replace")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


async def until(predicate_async: object, timeout: float, what: str, *replicas: Replica) -> None:
    """Wait for ``predicate_async()`` (sync or async) to be true; on timeout say what and show the logs."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate_async()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {r.name}\n{r.tail()}" for r in replicas)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def opener(dsn: str) -> AsyncIterator[tuple[ApprovalService, Outbox, PgStore]]:
    """The test's own door to the store: it opens the requests a replica's agents would have opened. It is no
    replica, so its requests have no owner and no leader cancels them as orphans."""
    store = await open_pg_store(dsn, migrations=pg_migrations(), application_name="kazma-test")
    config = load_config_text("approvals: {approvers: ['cli:ops']}").config
    try:
        yield ApprovalService(ApprovalStore(store), config), Outbox(store), store
    finally:
        await store.close()


def telegram_card(fakes: Fakes, request_id: str) -> tuple[int, str] | None:
    for message in fakes.telegram.bot_messages(TG_CHAT):
        for button in message.buttons:
            data = str(button.get("callback_data", ""))
            if request_id in data and data.endswith(":a"):
                return message.message_id, data
    return None


def cards_of(fakes: Fakes, platform: str, request_id: str) -> int:
    """How many cards of ``request_id`` were ever posted on ``platform`` (buttons or not)."""
    if platform == "telegram":
        return sum(request_id in m.text for m in fakes.telegram.bot_messages(TG_CHAT))
    if platform == "slack":
        return sum(request_id in " ".join(m.texts()) for m in fakes.slack.channel(SLACK_CHANNEL) if m.blocks)
    return sum(request_id in str(m.get("embeds")) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID))


def live_buttons(fakes: Fakes) -> int:
    telegram = sum(bool(m.buttons) for m in fakes.telegram.bot_messages(TG_CHAT))
    slack = sum(m.block("kazma_actions") is not None for m in fakes.slack.channel(SLACK_CHANNEL))
    discord = sum(bool(m.get("components")) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID))
    return telegram + slack + discord


async def press_slack(fakes: Fakes, replica: Replica, request_id: str) -> None:
    message = next(
        m
        for m in fakes.slack.channel(SLACK_CHANNEL)
        if (block := m.block("kazma_actions")) is not None
        and any(request_id in str(e["value"]) for e in block["elements"])
    )
    block = message.block("kazma_actions")
    assert block is not None
    value = next(str(e["value"]) for e in block["elements"] if e["action_id"] == "kazma_approve")
    await fakes.slack.post_block_action(
        replica.events_url, action_id="kazma_approve", value=value, user=SLACK_ADMIN, channel=SLACK_CHANNEL,
        message_ts=message.ts,
    )  # fmt: skip


async def test_two_replicas_post_once_decide_once_and_survive_the_leader_being_killed(
    tmp_path: Path, pg_dsn: str
) -> None:
    async with three_fakes() as fakes, opener(pg_dsn) as (service, outbox, _store):
        a, b = Replica("rep-a", fakes, pg_dsn, tmp_path), Replica("rep-b", fakes, pg_dsn, tmp_path)
        try:
            await a.start()
            await until(lambda: a.health(), 60, "rep-a serving", a)
            await until(lambda: _says(a, "replica rep-a: leader"), 30, "rep-a leading", a)
            await b.start()
            await until(lambda: _says(b, "replica rep-b: follower", "lease held by rep-a"), 60, "rep-b following", a, b)
            identifies = len(fakes.discord.identifies)
            # A console session opened on one replica is served by the other (sessions live in the store).
            async with httpx.AsyncClient(timeout=10) as browser:
                form = await browser.get(f"http://127.0.0.1:{a.web_port}/login")
                login_csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
                assert login_csrf is not None
                logged_in = await browser.post(
                    f"http://127.0.0.1:{a.web_port}/login",
                    data={"csrf": login_csrf.group(1), "name": "alice", "token": TOKEN},
                )
                assert logged_in.status_code == 303, logged_in.text
                elsewhere = await browser.get(f"http://127.0.0.1:{b.web_port}/")
                assert elsewhere.status_code == 200  # not sent to /login: b knows the session a opened
                assert "alice" in elsewhere.text

            requests = [
                await service.open("shell", {"command": f"deploy {n}"}, "agent:builder", f"telegram:{TG_CHAT}")
                for n in range(REQUESTS)
            ]
            for request in requests:
                await outbox.enqueue(request.id, list(PLATFORMS))  # NOTIFY: both replicas' workers race to claim
            await until(lambda: live_buttons(fakes) == 3 * REQUESTS, 120, "every card posted", a, b)

            first, second = requests[: REQUESTS // 2], requests[REQUESTS // 2 :]
            # The first half: Slack presses to the follower, Telegram presses through the leader's polling.
            for n, request in enumerate(first):
                if n % 2:
                    await press_slack(fakes, b, request.id)
                else:
                    found = telegram_card(fakes, request.id)
                    assert found is not None
                    fakes.telegram.push_callback(TG_CHAT, found[0], TG_ADMIN, found[1])

            async def first_half_decided() -> bool:
                pending = {r.id for r in await service.store.requests(pending_only=True, limit=1000)}
                return not pending & {r.id for r in first}

            await until(first_half_decided, 60, "the first half decided", a, b)
            # Telegram presses the leader may fetch and never confirm: it dies now.
            for request in second[:10]:
                found = telegram_card(fakes, request.id)
                assert found is not None
                fakes.telegram.push_callback(TG_CHAT, found[0], TG_ADMIN, found[1])
            killed_at = time.monotonic()
            assert await a.stop(signal.SIGKILL) == -signal.SIGKILL

            await until(lambda: _says(b, "replica rep-b: leader"), 10, "rep-b leading within 10 s", b)
            took = time.monotonic() - killed_at
            assert took <= 10.0
            await until(lambda: len(fakes.discord.identifies) > identifies, 30, "rep-b on the gateway", b)

            # The rest: Discord presses through the new leader's gateway, Slack through it too.
            for n, request in enumerate(second[10:]):
                if n % 2:
                    await press_slack(fakes, b, request.id)
                else:
                    message = next(
                        m
                        for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)
                        if m.get("components") and request.id in str(m["components"])
                    )
                    custom = next(
                        str(c["custom_id"])
                        for row in message["components"]
                        for c in row["components"]
                        if str(c["custom_id"]).endswith(":a")
                    )
                    await fakes.discord.press_button(int(message["id"]), custom)

            # Every Telegram press the dead leader fetched reaches the new leader: Telegram gives it again when
            # the dead one never confirmed it, or the new leader finds it in the store when it had (the inbox).
            # Nobody presses twice.
            async def all_decided() -> bool:
                return not await service.store.requests(pending_only=True, limit=1000)

            await until(all_decided, 120, "every request decided", b)
            await until(lambda: live_buttons(fakes) == 0, 120, "every card settled", b)

            for request in requests:
                after = await service.store.get(request.id)
                assert after is not None
                assert after.status is Status.APPROVED, request.id
                assert len(await service.store.events(request.id, event="decided")) == 1
                # Sealed by whichever replica decided it, with the key they share: it verifies anywhere.
                assert seal_problem(SHARED_KEYS, after) is None, request.id
                for platform in PLATFORMS:
                    assert cards_of(fakes, platform, request.id) == 1, (platform, request.id)  # posted once
            # Each card edited once by whoever claimed it; only a card whose edit the dead leader may have made
            # before it could record it is edited again.
            after_kill = {r.id for r in second[10:]}
            edits = {
                request_id: m.edits
                for m in fakes.telegram.bot_messages(TG_CHAT)
                for request_id in after_kill
                if request_id in m.text
            }
            assert len(edits) == len(after_kill)
            assert set(edits.values()) == {1}, edits
            answered = [c.params.get("callback_query_id") for c in fakes.telegram.calls_to("answerCallbackQuery")]
            assert len(answered) == len(set(answered))  # no Telegram press handled twice
            assert await outbox.pending() == []

            # A card the dead leader edited without living to record it is recorded settled once the leader
            # counts it gone and releases its claim (or the claim runs out): its buttons were gone already.
            async def all_recorded_settled() -> bool:
                return not await service.store.unsettled_cards()

            await until(all_recorded_settled, 60, "every card recorded settled", b)
            assert await b.stop() == 0, b.tail()
        finally:
            for replica in (a, b):
                with contextlib.suppress(Exception):
                    await replica.stop(signal.SIGKILL)


async def _says(replica: Replica, *lines: str) -> bool:
    text = await replica.health()
    return all(line in text for line in lines)


async def test_a_replica_cut_off_from_the_database_stops_leading_and_deciding_and_rejoins(
    tmp_path: Path, pg_dsn: str
) -> None:
    url = urlsplit(pg_dsn)
    proxy = CuttableProxy(url.hostname or "127.0.0.1", url.port or 5432)
    await proxy.start()
    proxied = urlunsplit(url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}"))
    async with three_fakes() as fakes, opener(pg_dsn) as (service, outbox, _store):
        a, b = Replica("rep-a", fakes, proxied, tmp_path), Replica("rep-b", fakes, pg_dsn, tmp_path)
        try:
            await a.start()
            await until(lambda: _says(a, "replica rep-a: leader"), 60, "rep-a leading", a)
            await b.start()
            await until(lambda: _says(b, "replica rep-b: follower", "lease held by rep-a"), 60, "rep-b following", a, b)
            first = await service.open("shell", {"command": "deploy 1"}, "agent:builder", f"telegram:{TG_CHAT}")
            await outbox.enqueue(first.id, list(PLATFORMS))
            await until(lambda: live_buttons(fakes) == 3, 60, "the cards posted", a, b)

            # Posted is not yet recorded: cut off before it records them, rep-a could not say where its cards
            # are, and a press on a card the store does not know is refused. Cut once all three are recorded.
            async def all_recorded() -> bool:
                return len(await service.store.cards(first.id)) == 3

            await until(all_recorded, 60, "the cards recorded", a, b)
            proxy.cut()  # rep-a's sessions end and it cannot open new ones
            cut_at = time.monotonic()
            await until(lambda: _says(b, "replica rep-b: leader"), 10, "rep-b leading within 10 s", a, b)
            assert time.monotonic() - cut_at <= 10.0
            health = await a.health()
            assert health.startswith("not deciding: the store cannot be reached"), health
            assert "replica rep-a: follower" in health  # it stopped believing it leads
            await until(lambda: a.said("replica.following"), 10, "rep-a saying why it stopped leading", a)

            # A press reaching the cut-off replica is not decided there (and says so); the request stays open.
            await press_slack(fakes, a, first.id)
            await until(lambda: a.said("approvals.store_unavailable"), 30, "rep-a refusing the press", a)
            pending = await service.store.get(first.id)
            assert pending is not None
            assert pending.status is Status.PENDING
            # The same press through the replica that can reach the store decides, and every card settles.
            await press_slack(fakes, b, first.id)
            await until(lambda: live_buttons(fakes) == 0, 60, "every card settled by rep-b", b)

            proxy.restore()
            await until(lambda: _says(a, "ok", "replica rep-a: follower", "lease held by rep-b"), 30, "rep-a back", a)
            second = await service.open("shell", {"command": "deploy 2"}, "agent:builder", f"telegram:{TG_CHAT}")
            await outbox.enqueue(second.id, list(PLATFORMS))
            await until(lambda: live_buttons(fakes) == 3, 60, "the second request's cards", a, b)
            await press_slack(fakes, a, second.id)  # rep-a decides again
            await until(lambda: live_buttons(fakes) == 0, 60, "the second request settled", a, b)
            decided = await service.store.get(second.id)
            assert decided is not None
            assert decided.status is Status.APPROVED
            events = await service.store.events(first.id, event="decided")
            assert [e.actor for e in events] == [f"slack:{SLACK_ADMIN}"]
        finally:
            for replica in (a, b):
                with contextlib.suppress(Exception):
                    await replica.stop(signal.SIGKILL)
            await proxy.stop()
