"""The approvals API's Idempotency-Key across two real `kazma run` replicas on one PostgreSQL.

A hundred keys, each sent with its body to both replicas at the same moment (two hundred requests in
flight together): the key row decides in the store, so each key opens exactly one request, both answers
name it, and Telegram shows one card for it. Replays add a count, not audit rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalStore
from kazma.bot.store import pg_migrations
from kazma.config.store.postgres import PgStore, open_pg_store
from tests.audit_support import AUDIT_KEY
from tests.child_env import child_env
from tests.contract.harness import free_port
from tests.fakes.telegram import FakeTelegram
from tests.platforms_support import TG_ADMIN, TG_CHAT

KEYS = 100
API_TOKEN = "ci-" + "c" * 40
pytestmark = pytest.mark.slow


class ApiReplica:
    """One `kazma run` replica serving the approvals API, its logs in a file."""

    def __init__(self, name: str, telegram: FakeTelegram, dsn: str, folder: Path) -> None:
        self.name = name
        self.port = free_port()
        self.config = folder / f"{name}.yaml"
        self.log = folder / f"{name}.log"
        self.config.write_text(f"""
store: {{url: '{dsn}'}}
web: {{port: {self.port}}}
approvals: {{deadline_seconds: 600, approvers: ["telegram:{TG_ADMIN}"]}}
api:
  tokens:
    ci: {{token: '{API_TOKEN}', roles: [approval_requester], max_pending: {4 * KEYS}}}
platforms:
  telegram:
    token: '{telegram.token}'
    api_base_url: '{telegram.base_url}'
    chats: [{TG_CHAT}]
    home_chat: {TG_CHAT}
    admins: [{TG_ADMIN}]
""")
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        env = child_env(
            {
                "NO_PROXY": "127.0.0.1,localhost",
                "KAZMA_REPLICA": self.name,
                "KAZMA_WEB_TOKEN": "o" * 40,  # replicas share the console's tokens
                "KAZMA_WEB_READER_TOKEN": "r" * 40,
                "KAZMA_DECISION_KEY": "k1:" + "d" * 40,  # every replica verifies the others' seals
                "KAZMA_AUDIT_KEY": AUDIT_KEY,  # every replica signs the one audit chain
            }
        )
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(self.config), "--log-format", "json", "run",
            "--poll-interval", "2", "--no-pacing",
            stdout=asyncio.subprocess.DEVNULL, stderr=self.log.open("ab"), env=env, cwd=self.config.parent,
        )  # fmt: skip

    async def serving(self) -> bool:
        if self.process is not None and self.process.returncode is not None:
            raise AssertionError(f"{self.name} exited {self.process.returncode}\n{self.tail()}")
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            try:
                return (await client.get(f"{self.url}/api/v1/openapi.json")).status_code == 200
            except httpx.HTTPError:
                return False

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout=60)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


async def until(check: Callable[[], Awaitable[bool] | bool], timeout: float, what: str, *logs: ApiReplica) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            shown = "\n".join(f"--- {r.name}\n{r.tail()}" for r in logs)
            raise AssertionError(f"timed out waiting for {what}\n{shown}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def two_replicas(tmp_path: Path, dsn: str, telegram: FakeTelegram) -> AsyncIterator[tuple[ApiReplica, ...]]:
    replicas = (ApiReplica("rep-a", telegram, dsn, tmp_path), ApiReplica("rep-b", telegram, dsn, tmp_path))
    try:
        for replica in replicas:
            await replica.start()
        for replica in replicas:
            await until(replica.serving, 90, f"{replica.name} serving", *replicas)
        yield replicas
    finally:
        await asyncio.gather(*(r.stop() for r in replicas), return_exceptions=True)


@contextlib.asynccontextmanager
async def reader(dsn: str) -> AsyncIterator[tuple[ApprovalStore, Outbox, PgStore]]:
    store = await open_pg_store(dsn, migrations=pg_migrations(), application_name="kazma-test")
    try:
        yield ApprovalStore(store), Outbox(store), store
    finally:
        await store.close()


def card_counts(telegram: FakeTelegram) -> Counter[str]:
    """How many Telegram cards name each request (its id is in the card's buttons)."""
    counts: Counter[str] = Counter()
    for message in telegram.bot_messages(TG_CHAT):
        for button in message.buttons:
            data = str(button.get("callback_data", ""))
            if data.startswith("kz1:") and data.endswith(":a"):
                counts[data.split(":")[1]] += 1
    return counts


async def test_one_key_sent_to_two_replicas_at_once_opens_one_request(tmp_path: Path, pg_dsn: str) -> None:
    telegram = FakeTelegram()
    await telegram.start()
    try:
        async with two_replicas(tmp_path, pg_dsn, telegram) as replicas, reader(pg_dsn) as (store, outbox, pg):
            headers = {"Authorization": f"Bearer {API_TOKEN}"}
            # A connection for each request: once (CI on a loaded machine) the second round failed with ReadError on
            # a kept connection, the race of a client reusing a connection its server is closing (aiohttp ends an
            # idle one after its keep-alive), not what this test asks of the replicas: one request per key.
            limits = httpx.Limits(max_connections=2 * KEYS, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=120, trust_env=False, limits=limits, headers=headers) as http:

                async def ask(replica: ApiReplica, key: int) -> httpx.Response:
                    body = {"tool": "deploy", "arguments": {"build": key}, "reason": f"release {key}"}
                    return await http.post(
                        f"{replica.url}/api/v1/approvals", json=body, headers={"Idempotency-Key": f"build-{key}"}
                    )

                answers = await asyncio.gather(*(ask(r, key) for key in range(KEYS) for r in replicas))
                again = await asyncio.gather(*(ask(r, key) for key in range(KEYS) for r in replicas))

            ids: dict[int, set[str]] = {}
            for index, answer in enumerate([*answers, *again]):
                assert answer.status_code in (200, 201), answer.text
                ids.setdefault(index // 2 % KEYS, set()).add(answer.json()["id"])
            assert all(len(found) == 1 for found in ids.values()), {k: v for k, v in ids.items() if len(v) > 1}
            created = Counter((i // 2, a.status_code) for i, a in enumerate(answers))
            assert all(created[(key, 201)] == 1 for key in range(KEYS)), created  # the first commit opened it
            opened = {r.id for r in await store.requests(limit=10 * KEYS)}
            assert len(opened) == KEYS
            assert opened == {next(iter(v)) for v in ids.values()}

            # One card each, and nothing left to post that could make a second.
            await until(lambda: len(card_counts(telegram)) == KEYS, 120, "every card posted", *replicas)
            await until(lambda: _empty(outbox), 60, "the outbox drained", *replicas)
            assert set(card_counts(telegram).values()) == {1}
            # A replay is a count on its key, not an audit row: one request, one api_opened, three replays.
            for request_id in opened:
                events = [e.event for e in await store.events(request_id)]
                assert events.count("api_opened") == 1, events
                assert "api_replayed" not in events
            replays = await pg.all("SELECT replays FROM api_idempotency WHERE token_name = 'ci'")
            assert sorted(int(r[0]) for r in replays) == [3] * KEYS
    finally:
        await telegram.stop()


async def _empty(outbox: Outbox) -> bool:
    return not await outbox.pending()
