"""A follower's /healthz says what the leader recorded of the inbound connections only the leader holds.

Two replicas of the whole app on one real PostgreSQL, in this process, against the platforms' wire fakes, over
real HTTP. A follower said "serving (its inbound connection is the leader's)" for Telegram and Discord whatever
the leader's connections did: with the leader's gateway closed and its polling failing, every follower answered
200 "ok" to the load balancer while no press on a Telegram or Discord card came in anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from structlog.testing import capture_logs

from kazma.adapters import bus, kit
from kazma.adapters.bus import InboundState
from kazma.bot import lifecycle
from kazma.bot import replication as replication_module
from kazma.bot.app import App, build_app
from kazma.bot.leader_inbound import LeaderInboundRecord
from kazma.bot.replication import Replication
from kazma.config import failpoints, load_config_text
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from kazma.config.store import leader
from kazma.config.store.backend import tables_of
from kazma.config.store.leader import LeaseTiming
from kazma.config.store.postgres import PgStore
from kazma.config.waits import bounded
from tests.audit_support import AUDIT_KEY
from tests.fakes.telegram import Fault
from tests.pg_support import every_pool_session_opened_now
from tests.platforms_support import TG_ADMIN, TG_CHAT, Fakes, adapters_for, three_fakes
from tests.store_backends import replica_store
from tests.test_healthz_platforms import healthz, served

T = TypeVar("T")

# Quick intervals (checks, a follower's asks), the product's own bound on a check (1 s) and a server drop well past
# it: with a 0.3 s bound and a 1 s idle drop, a test process stalled under a loaded CI machine (two xdist workers on
# two cores) lost the lease mid-test, and a test about a steady leader read another leadership's record.
FAST = LeaseTiming(check_interval=0.3, check_timeout=1.0, retry_interval=0.1, server_drop_after=3.0)
SINCE = r"\d\d:\d\d:\d\d UTC"
STRANDED = "not deciding: no chat platform takes presses and nobody may decide on the console"


@contextlib.asynccontextmanager
async def replica(
    fakes: Fakes, dsn: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[App]:
    text = fakes.config_yaml(tmp_path / "unused.db")
    text = re.sub(r"store: \{path: '[^']*'\}", f"store: {{url: '{dsn}'}}", text)
    loaded = load_config_text(text, environ={})
    monkeypatch.setenv("KAZMA_REPLICA", name)  # read once, while the app is built
    app = await build_app(loaded, adapters=adapters_for(loaded), poll_interval=0.05, workspace_root=tmp_path / name)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


def line_of(lines: list[str], platform: str) -> str:
    return next((line for line in lines if line.startswith(f"platform {platform}: ")), "")


async def test_a_follower_says_what_the_leader_recorded_of_its_inbound_connections_and_counts_it_for_503(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the keys' default place is beside the working directory
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)  # shared by replicas, as kazma run requires
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: FAST)
    monkeypatch.setattr(bus, "START_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    monkeypatch.setattr(kit, "INBOUND_TROUBLE_AFTER", 2)
    # The leader's ingress check would open the gateway again before /healthz is read: it waits here.
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.05)
    async with three_fakes() as fakes:
        fakes.slack.fail("auth.test", "500", times=1_000_000)  # Slack takes no press on either replica
        async with replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a:
            assert a.replication is not None
            replication = a.replication
            await until(lambda: _true(replication.is_leader))
            async with (
                replica(fakes, pg_dsn, "b", tmp_path, monkeypatch) as b,
                served(a, tmp_path / "a") as a_url,
                served(b, tmp_path / "b") as b_url,
            ):
                assert b.replication is not None
                assert not b.replication.is_leader

                async def follower_says(platform: str, pattern: str) -> bool:
                    return re.fullmatch(pattern, line_of((await healthz(b_url))[1], platform)) is not None

                # The leader's gateway and polling open: the follower says so, and through whom.
                opened = r"serving through the leader \(a\): inbound open since " + SINCE
                await until(lambda: follower_says("telegram", f"platform telegram: {opened}"))
                await until(lambda: follower_says("discord", f"platform discord: {opened}"))
                status, lines = await healthz(b_url)
                assert (status, lines[0]) == (200, "ok"), lines
                assert "lease held by a" in lines

                # Discord ends the leader's gateway for good: the follower tells, with why and since when.
                lost = failure_count("ingress_lost", "discord")
                assert await fakes.discord.drop_gateway(code=4014) == 1  # the leader's: the follower holds none
                await until(lambda: _true(failure_count("ingress_lost", "discord") > lost))
                closed = rf"platform discord: leader a: inbound connection not open since {SINCE} \(.*\)"
                await until(lambda: follower_says("discord", closed))
                status, lines = await healthz(b_url)
                assert "PrivilegedIntentsRequired" in line_of(lines, "discord")
                assert (status, lines[0]) == (200, "ok"), lines  # the leader's polling still takes presses

                # The leader's polling keeps failing too: no press reaches a decision through any replica, and
                # the follower answers 503 as the leader does.
                conflict = Fault("status", status=409, description="Conflict: terminated by other getUpdates request")
                fakes.telegram.script("getUpdates", *[conflict] * 10_000)
                failing = rf"platform telegram: leader a: inbound failing since {SINCE} \(.*409.*\)"
                await until(lambda: follower_says("telegram", failing))
                status, lines = await healthz(b_url)
                assert (status, lines[0]) == (503, STRANDED), lines
                status, lines = await healthz(a_url)
                assert (status, lines[0]) == (503, STRANDED), lines  # the same rule on the leader

                # The leader's polling comes back: so does the follower's line, and its 200.
                fakes.telegram.unscript("getUpdates")
                await until(lambda: follower_says("telegram", f"platform telegram: {opened}"))
                status, lines = await healthz(b_url)
                assert (status, lines[0]) == (200, "ok"), lines

                # A record of another lease session (the leader's earlier life under the same name, or rows
                # written before it lost the lease) is unknown, not the state it names.
                assert isinstance(a.stores.pg, PgStore)
                moved = await tables_of(a.stores.pg).run(
                    "UPDATE leader_inbound SET state = 'open', lease_pid = lease_pid + 1"
                )
                assert moved == 2  # Telegram's and Discord's: Slack in HTTP mode has no singleton ingress
                status, lines = await healthz(b_url)
                for platform in ("telegram", "discord"):
                    assert line_of(lines, platform) == (
                        f"platform {platform}: inbound state unknown: leader a has not recorded it under its lease"
                    ), lines
                assert (status, lines[0]) == (503, STRANDED), lines


async def test_a_leader_of_these_tests_keeps_the_lease_through_a_stall_of_its_process(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests here are of a steady leader unless they change it themselves: a stall of the test process (a loaded
    CI machine runs two workers on two cores) is not a leader change. Blocked a second, the leader leads on, on
    the same lease session."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.05)
    async with three_fakes() as fakes, replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a:
        replication = a.replication
        assert replication is not None
        await until(lambda: _true(replication.is_leader))
        session, lost = replication.lease.backend_pid, failure_count("leader_lost")
        time.sleep(1.0)  # the whole process stalls: not a wait for anything, the stall under test
        checks = _count_looks(replication, monkeypatch)  # looks come from the leader's loop, after its checks
        await until(lambda: _true(checks[0] >= 30))  # some 1.5 s: checks of the lease among them
        assert (replication.is_leader, replication.lease.backend_pid) == (True, session)
        assert failure_count("leader_lost") == lost


async def _true(value: bool) -> bool:
    return value


def _count_looks(replication: Replication, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the leader has looked at its inbound states from now on (one counter, read as ``[0]``)."""
    looks = [0]
    record_inbound = replication.record_inbound

    async def counted() -> None:
        looks[0] += 1
        await record_inbound()

    monkeypatch.setattr(replication, "record_inbound", counted)
    return looks


async def test_a_write_of_a_leader_that_lost_the_lease_landing_late_leaves_the_new_leaders_record_read(
    pg_dsn: str,
) -> None:
    """A leader's record began while it led and landed (a slow database) after the next leader's first record:
    keyed by platform alone, it overwrote the new leader's rows, and every follower said "inbound state unknown"
    (503 with no other way to decide) until the new leader's next write, up to INBOUND_REWRITE_SECONDS later."""
    async with (
        replica_store(pg_dsn, "t") as store,
        await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as session_a,
        await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as session_b,
    ):
        record = LeaderInboundRecord(store)
        a_pid, b_pid = session_a.info.backend_pid, session_b.info.backend_pid
        opened = {"telegram": InboundState(bus.INBOUND_OPEN, "serving", 100.0)}
        await record.record("a", a_pid, opened, 100.0)
        await record.record("b", b_pid, {"telegram": InboundState(bus.INBOUND_OPEN, "serving", 200.0)}, 200.0)
        late = {"telegram": InboundState(bus.INBOUND_FAILING, "inbound failing (409)", 150.0)}
        await record.record("a", a_pid, late, 250.0)  # the old leader's write, landing last

        assert await record.read("b", b_pid) == ({"telegram": InboundState(bus.INBOUND_OPEN, "serving", 200.0)}, True)
        assert await record.read("a", a_pid) == (late, True)  # kept apart, and never read while b holds the lease

        # The rows of a session that ended go at the next leader's first record; a live session's stay.
        await session_a.close()
        await until(lambda: _ended(store, a_pid))
        assert await record.forget_ended() == 1
        assert await record.read("a", a_pid) == ({}, False)
        assert await record.read("b", b_pid) == ({"telegram": InboundState(bus.INBOUND_OPEN, "serving", 200.0)}, True)


async def _ended(store: PgStore, pid: int) -> bool:
    rows = await tables_of(store).all("SELECT 1 FROM pg_stat_activity WHERE pid = ?", (pid,))
    return not rows


async def test_a_leader_whose_store_refuses_its_records_says_so_once_and_again_when_they_land(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record task logged a warning (and counted a failure) at every look, every second, for as long as the
    store refused the write: one run of failures is now one warning, one count, and one line when it ends."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: FAST)
    monkeypatch.setattr(bus, "START_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)  # the closed gateway stays closed
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.02)
    async with three_fakes() as fakes, replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a:
        fakes.slack.fail("auth.test", "500", times=1_000_000)
        replication = a.replication
        assert replication is not None
        assert isinstance(a.stores.pg, PgStore)
        tables = tables_of(a.stores.pg)

        async def recorded(state: str) -> bool:
            rows = await tables.all("SELECT state FROM leader_inbound WHERE platform = 'discord'")
            return [tuple(r) for r in rows] == [(state,)]

        await until(lambda: recorded(bus.INBOUND_OPEN))
        looks = _count_looks(replication, monkeypatch)
        await tables.run("ALTER TABLE leader_inbound RENAME TO leader_inbound_away")  # every write fails
        before = failure_count("inbound_record")
        with capture_logs() as logs:
            assert await fakes.discord.drop_gateway(code=4014) == 1  # a change: the leader writes
            await until(lambda: _true(failure_count("inbound_record") > before))
            seen = looks[0]
            await until(lambda: _true(looks[0] >= seen + 10))  # ten more looks, each failing
            failed = [e for e in logs if e["event"] == "app.inbound_record_failed"]
            assert len(failed) == 1, failed
            assert failure_count("inbound_record") == before + 1
            await tables.run("ALTER TABLE leader_inbound_away RENAME TO leader_inbound")
            await until(lambda: recorded(bus.INBOUND_NOT_OPEN))
            await until(lambda: _true(any(e["event"] == "app.inbound_record_recovered" for e in logs)))
        assert failure_count("inbound_record") == before + 1


async def test_a_followers_healthz_waits_for_a_slow_database_once_not_once_per_read(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower's /healthz reads the lease holder, then the holder's record, and bounded each read by
    HEALTH_TIMEOUT: a database slow on both held it for nearly twice that before it answered "the store cannot be
    reached". Both reads now share the one wait: every bound /healthz sets is recorded, and the follower's reads
    (both of them made: "x" holds the lease and its record is read) run under one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: FAST)
    holder_name = leader.LeaderLease.APPLICATION_PREFIX + "x"
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, application_name=holder_name) as x:
        await x.execute("SELECT pg_advisory_lock(%s)", (leader.lock_key("kazma"),))  # "x" leads all along
        async with three_fakes() as fakes, replica(fakes, pg_dsn, "b", tmp_path, monkeypatch) as b:
            replication = b.replication
            assert replication is not None
            waits: list[float | None] = []
            reads: list[str] = []
            real_read = replication.inbound_record.read

            async def recorded_bounded(awaitable: Awaitable[T], seconds: float | None) -> T:
                waits.append(seconds)
                return await bounded(awaitable, seconds)

            async def recorded_read(*held: Any) -> Any:
                reads.append("record")
                return await real_read(*held)

            monkeypatch.setattr(replication_module, "bounded", recorded_bounded)
            monkeypatch.setattr(replication.inbound_record, "read", recorded_read)
            health = await replication.health()
            assert (health.holder, health.leader, health.store_reachable) == ("x", False, True)
            assert reads == ["record"]  # the holder's record was read too ...
            assert waits == [replication_module.HEALTH_TIMEOUT]  # ... under the one wait, not a second of its own


async def test_a_leader_of_the_previous_release_which_records_nothing_leaves_the_new_followers_at_200(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling upgrade: a replica of the previous release leads (it writes no leader_inbound row). Every new
    follower said "inbound state unknown" for the leader's platforms and counted them down: 503 wherever no
    other platform took presses, for as long as the old replica led, so an upgrade waiting for the new replicas
    to be ready never went on. A holder with no row at all is now taken as the previous release's followers took it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: FAST)
    monkeypatch.setattr(bus, "START_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    name = leader.LeaderLease.APPLICATION_PREFIX + "old"
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, application_name=name) as old:
        await old.execute("SELECT pg_advisory_lock(%s)", (leader.lock_key("kazma"),))  # the previous release leads
        async with three_fakes() as fakes:
            fakes.slack.fail("auth.test", "500", times=1_000_000)  # Slack takes no press
            async with replica(fakes, pg_dsn, "new", tmp_path, monkeypatch) as b, served(b, tmp_path / "b") as url:
                status, lines = await healthz(url)
                assert (status, lines[0]) == (200, "ok"), lines
                assert "lease held by old" in lines
                for platform in ("telegram", "discord"):
                    assert line_of(lines, platform) == (
                        f"platform {platform}: serving through the leader (old), which records no inbound state"
                        " (a replica of an earlier release, or one that took the lease a moment ago)"
                    ), lines


async def test_the_leader_says_inbound_recorded_on_a_change_not_at_each_rewrite_of_the_same_states(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replica.inbound_recorded (info) came with every write, the once-a-minute rewrite of unchanged states
    included: an info line a minute on every leader for as long as it ran, saying nothing new."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: FAST)
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.02)
    monkeypatch.setattr(replication_module, "INBOUND_REWRITE_SECONDS", 0.0)  # every look writes again
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)  # the closed gateway stays closed
    both_open = {"discord": bus.INBOUND_OPEN, "telegram": bus.INBOUND_OPEN}
    with capture_logs() as logs:

        def said() -> list[Any]:
            return [e["states"] for e in logs if e["event"] == "replica.inbound_recorded"]

        async with three_fakes() as fakes, replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a:
            replication = a.replication
            assert replication is not None
            # Waited for as said, not as written: the line comes after the write's commit (and, on a new lease
            # session, after the ended sessions' rows are forgotten), so rows read open may still have their line
            # to come.
            await until(lambda: _true(both_open in said()))  # both singleton ingresses open: no change is due
            lines = len(said())
            looks = _count_looks(replication, monkeypatch)
            await until(lambda: _true(looks[0] >= 10))  # ten rewrites of the same states
            assert said()[lines:] == []
            assert await fakes.discord.drop_gateway(code=4014) == 1  # a change is said
            await until(lambda: _true(len(said()) > lines))
            assert said()[lines] == {"discord": bus.INBOUND_NOT_OPEN, "telegram": bus.INBOUND_OPEN}


async def test_a_new_leader_opening_its_gateway_says_opening_not_closed_on_every_replica(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a leader change the new leader's first record (and its own /healthz) said Discord's gateway was
    "not open (it closed)" although it was being opened, and once the opening had begun, "serving" although no
    interaction could arrive before READY. The gateway is held here while the new leader opens it: every replica
    says "opening", counted down as a connection not open is, and "open" once it is."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.02)
    two = _replicas_a_and_b_while_x_holds_the_lock(tmp_path, pg_dsn, monkeypatch)
    async with two as (fakes, x, a, a_url, b, b_url):
        fakes.discord.gateway_open.clear()  # the new leader's gateway waits here, opening
        await x.execute("SELECT pg_advisory_unlock(%s)", (leader.lock_key("kazma"),))
        assert a.replication is not None
        assert b.replication is not None
        ra, rb = a.replication, b.replication
        await until(lambda: _true(ra.is_leader or rb.is_leader))
        (new, new_url), follower_url = ((a, a_url), b_url) if ra.is_leader else ((b, b_url), a_url)
        assert new.replication is not None
        holder = new.replication.replica
        assert isinstance(new.stores.pg, PgStore)
        tables = tables_of(new.stores.pg)

        async def recorded() -> list[tuple[str, str]]:
            rows = await tables.all(
                "SELECT state, detail FROM leader_inbound WHERE platform = 'discord' AND replica = ?",
                (holder,),
            )
            return [tuple(r) for r in rows]

        # The first record the new leader makes of Discord, and every one while the gateway is held.
        await until(lambda: _not_empty(recorded()))
        assert [state for state, _ in await recorded()] == [bus.INBOUND_OPENING], await recorded()
        # The record made as the lock was taken may still be the one read (the grace's words after "since")
        took = re.escape(bus.TOOK_THE_LEASE)
        opening = rf"platform discord: leader {holder}: inbound connection opening since {SINCE}( \({took}\))?"
        status, lines = await healthz(follower_url)
        assert re.fullmatch(opening, line_of(lines, "discord")), lines
        _, lines = await healthz(new_url)
        mine = rf"platform discord: inbound connection opening since {SINCE}"
        assert re.fullmatch(mine, line_of(lines, "discord")), lines

        # Down, yet Telegram's polling (opened meanwhile) takes presses: 200 on both.
        telegram = rf"platform telegram: serving through the leader \({holder}\): inbound open since {SINCE}"

        async def follower_says_telegram_open() -> bool:
            return re.fullmatch(telegram, line_of((await healthz(follower_url))[1], "telegram")) is not None

        await until(follower_says_telegram_open)
        for url in (follower_url, new_url):
            status, lines = await healthz(url)
            assert (status, lines[0]) == (200, "ok"), lines
            assert " opening since " in line_of(lines, "discord"), lines
        looks = _count_looks(new.replication, monkeypatch)
        await until(lambda: _true(looks[0] >= 5))  # five more looks with the gateway still held
        assert [state for state, _ in await recorded()] == [bus.INBOUND_OPENING], await recorded()

        fakes.discord.gateway_open.set()
        opened = rf"platform discord: serving through the leader \({holder}\): inbound open since {SINCE}"

        async def follower_says_open() -> bool:
            return re.fullmatch(opened, line_of((await healthz(follower_url))[1], "discord")) is not None

        await until(follower_says_open)
        assert line_of((await healthz(new_url))[1], "discord") == "platform discord: serving"


async def _not_empty(rows: Awaitable[list[T]]) -> bool:
    return bool(await rows)


def test_an_opening_connection_the_leader_recorded_counts_as_down_for_the_503_rule() -> None:
    """Nothing comes in through a connection being opened: a follower counts it down, as the leader does its own."""
    recorded = {"discord": InboundState(bus.INBOUND_OPENING, "", 1.0)}
    health = bus._through_leader("discord", bus.LeaderInbound("b", recorded))
    assert health == bus.PlatformHealth("discord", False, "leader b: inbound connection opening since 00:00:01 UTC")


def _keys_timing_and_quick_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timing: LeaseTiming) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: timing)
    monkeypatch.setattr(bus, "START_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))


@contextlib.asynccontextmanager
async def _replica_a_while_x_holds_the_lock(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[psycopg.AsyncConnection[Any], Replication, str]]:
    """Replica a, served, started while a connection "x" holds the leader's lock: yields x, a's replication and
    a's URL; x unlocks when the test is ready for a to lead."""
    name = leader.LeaderLease.APPLICATION_PREFIX + "x"
    async with (
        three_fakes() as fakes,
        await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, application_name=name) as x,
    ):
        await x.execute("SELECT pg_advisory_lock(%s)", (leader.lock_key("kazma"),))  # "x" leads at first
        async with replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a, served(a, tmp_path / "a") as url:
            replication = a.replication
            assert replication is not None
            yield x, replication, url


@contextlib.asynccontextmanager
async def _replicas_a_and_b_while_x_holds_the_lock(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Fakes, psycopg.AsyncConnection[Any], App, str, App, str]]:
    """Replicas a and b, served, started while a connection "x" holds the leader's lock and Slack takes no press on
    either: yields the fakes, x, a and its URL, b and its URL; x unlocks when the test is ready for one to lead."""
    name = leader.LeaderLease.APPLICATION_PREFIX + "x"
    async with three_fakes() as fakes:
        fakes.slack.fail("auth.test", "500", times=1_000_000)
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, application_name=name) as x:
            await x.execute("SELECT pg_advisory_lock(%s)", (leader.lock_key("kazma"),))  # "x" leads at first
            async with (
                replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a,
                replica(fakes, pg_dsn, "b", tmp_path, monkeypatch) as b,
                served(a, tmp_path / "a") as a_url,
                served(b, tmp_path / "b") as b_url,
            ):
                yield fakes, x, a, a_url, b, b_url


async def test_a_replica_that_took_the_lease_before_its_duties_start_says_so_of_itself(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between taking the lease and starting the leader's duties (held here by the leader.takeover failpoint) the
    leader read its own platforms as a follower does, and said "inbound state unknown: the leader's record could
    not be read" of the record it was about to write itself."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    async with _replica_a_while_x_holds_the_lock(tmp_path, pg_dsn, monkeypatch) as (x, replication, url):
        failpoints.arm_for_test("leader.takeover=hang")  # the lease is taken, the duties wait
        try:
            await x.execute("SELECT pg_advisory_unlock(%s)", (leader.lock_key("kazma"),))
            await until(lambda: _true(replication.is_leader))
            status, lines = await healthz(url)
        finally:
            failpoints.disarm()
        assert "replica a: leader" in lines
        for platform in ("telegram", "discord"):
            assert line_of(lines, platform) == f"platform {platform}: {bus.OPENING_WITH_THE_LEASE}", lines
        assert (status, lines[0]) == (200, "ok"), lines  # Slack, served by every replica, takes presses


async def test_a_replica_holding_the_lock_while_it_waits_out_the_grace_does_not_say_it_serves_through_itself(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that took the advisory lock waits out the old leader's grace (3.5 s by default) before it leads,
    and records nothing meanwhile. Reading itself as a follower, it took its own empty record for a leader of an
    earlier release and said "serving through the leader (a), which records no inbound state" of Telegram's
    polling and Discord's gateway, which nobody had open. It now says it took the lease and is about to open
    them, as once its duties start."""
    # A grace long enough to look inside it: the lock is taken, the lease not yet declared.
    slow = LeaseTiming(check_interval=30.0, check_timeout=0.3, retry_interval=0.1, server_drop_after=60.0)
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, slow)
    async with _replica_a_while_x_holds_the_lock(tmp_path, pg_dsn, monkeypatch) as (x, replication, url):
        await x.execute("SELECT pg_advisory_unlock(%s)", (leader.lock_key("kazma"),))

        async def lock_taken() -> bool:
            return "lease held by a" in (await healthz(url))[1]

        await until(lock_taken)
        _, lines = await healthz(url)
        assert not replication.is_leader  # still waiting out the grace
        for platform in ("telegram", "discord"):
            assert line_of(lines, platform) == f"platform {platform}: {bus.OPENING_WITH_THE_LEASE}", lines


async def test_the_other_replicas_say_a_replica_waiting_out_the_grace_is_opening_not_serving(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that took the lock waits out the old leader's grace before it leads, and recorded nothing
    meanwhile: the other replicas took a holder with no record for a replica of an earlier release and answered
    200 "serving through the leader (a), which records no inbound state" of Telegram's polling and Discord's
    gateway, which nobody had open (3.5 s by default, at every leader change). It records "opening" as soon as it
    holds the lock, and the others say so, counted down."""
    slow = LeaseTiming(check_interval=30.0, check_timeout=0.3, retry_interval=0.1, server_drop_after=60.0)
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, slow)
    two = _replicas_a_and_b_while_x_holds_the_lock(tmp_path, pg_dsn, monkeypatch)
    async with two as (_fakes, x, a, a_url, b, b_url):
        assert a.replication is not None
        assert b.replication is not None
        ra, rb = a.replication, b.replication
        await x.execute("SELECT pg_advisory_unlock(%s)", (leader.lock_key("kazma"),))

        async def lock_taken() -> bool:
            lines = (await healthz(a_url))[1]
            return "lease held by a" in lines or "lease held by b" in lines

        await until(lock_taken)
        holder, other_url = ("a", b_url) if "lease held by a" in (await healthz(a_url))[1] else ("b", a_url)
        assert not ra.is_leader  # the grace (30 s here) is still being waited out
        assert not rb.is_leader

        assert isinstance(a.stores.pg, PgStore)
        tables = tables_of(a.stores.pg)

        async def holder_recorded() -> bool:
            return bool(await tables.all("SELECT 1 FROM leader_inbound WHERE replica = ?", (holder,)))

        # Within the grace (30 s here); before, the holder recorded nothing until it led.
        await until(holder_recorded, timeout=10.0)
        status, lines = await healthz(other_url)
        assert not ra.is_leader, lines
        assert not rb.is_leader, lines
        for platform in ("telegram", "discord"):
            assert re.fullmatch(
                rf"platform {platform}: leader {holder}: inbound connection opening since {SINCE}"
                rf" \({re.escape(bus.TOOK_THE_LEASE)}\)",
                line_of(lines, platform),
            ), lines
        assert (status, lines[0]) == (503, STRANDED), lines


@contextlib.asynccontextmanager
async def _telegram_refused_on_the_leader(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Fakes, bus.FanOutBus, str, Callable[[], Awaitable[list[tuple[str, str, float]]]]]]:
    """Leader a (its polling ended by Telegram's 401, recorded not open, nothing opening it again by itself) and
    follower b, served: yields the fakes, a's bus, b's URL and a reader of a's record of Telegram (state, detail,
    since)."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)  # only the test opens it again
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.02)
    async with three_fakes() as fakes, replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a:
        replication = a.replication
        assert replication is not None
        await until(lambda: _true(replication.is_leader))
        assert isinstance(a.stores.pg, PgStore)
        assert isinstance(a.bus, bus.FanOutBus)
        tables = tables_of(a.stores.pg)

        async def record() -> list[tuple[str, str, float]]:
            rows = await tables.all(
                "SELECT state, detail, since FROM leader_inbound WHERE platform = 'telegram' AND replica = 'a'"
            )
            return [(str(s), str(d), float(t)) for s, d, t in rows]

        async def recorded(state: str) -> bool:
            return [s for s, _, _ in await record()] == [state]

        await until(lambda: recorded(bus.INBOUND_OPEN))
        async with replica(fakes, pg_dsn, "b", tmp_path, monkeypatch) as b, served(b, tmp_path / "b") as b_url:
            await fakes.telegram.wait_for_call("getUpdates", answered=False)
            fakes.telegram.script("getUpdates", *[Fault.server_error(401, "Unauthorized")] * 10_000)
            fakes.telegram.push_message(TG_CHAT, TG_ADMIN, "wakes the long poll; the next one meets the 401")
            await until(lambda: recorded(bus.INBOUND_NOT_OPEN))
            yield fakes, a.bus, b_url, record


async def test_a_follower_says_why_the_leaders_connection_was_not_open_while_the_leader_opens_it_again(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's own line said "inbound connection opening since ... (it was not open: <Telegram's 401>)"; a
    follower's said only "leader a: inbound connection opening since ...": the reason, the one thing that told
    an operator what to fix, was on one replica of several, behind a load balancer."""
    async with _telegram_refused_on_the_leader(tmp_path, pg_dsn, monkeypatch) as (fakes, leader_bus, b_url, record):
        release = asyncio.Event()
        fakes.telegram.script("deleteWebhook", Fault.answer_held(release))  # the open waits here
        opening = asyncio.create_task(leader_bus.start_ingress())
        try:
            await until(lambda: _states(record(), bus.INBOUND_OPENING))
            _, lines = await healthz(b_url)
            line = line_of(lines, "telegram")
            assert re.fullmatch(
                rf"platform telegram: leader a: inbound connection opening since {SINCE} \(it was not open: .*\)", line
            ), lines
            assert "401" in line or "Unauthorized" in line, lines
        finally:
            release.set()
            await opening


async def test_a_follower_says_since_when_the_leaders_connection_is_down_across_the_opens_tried_again(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each open tried again recorded "opening", then "not open" since the moment that open failed: a platform
    down for an hour, retried every half minute, read on every follower as down for a few seconds."""
    async with _telegram_refused_on_the_leader(tmp_path, pg_dsn, monkeypatch) as (fakes, leader_bus, b_url, record):
        [(_, _, first)] = await record()
        for _ in range(2):  # opened again, seen opening, refused again
            release = asyncio.Event()
            # Refused before polling begins: never open in between, as a look could otherwise find it.
            fakes.telegram.script("deleteWebhook", Fault.refused_once(release))
            opening = asyncio.create_task(leader_bus.start_ingress())
            try:
                await until(lambda: _states(record(), bus.INBOUND_OPENING))
            finally:
                release.set()
                await opening  # the bus says and counts the failed open; it does not raise
            await until(lambda: _states(record(), bus.INBOUND_NOT_OPEN))
            [(_, _, since)] = await record()
            assert since == first
        _, lines = await healthz(b_url)
        at = bus._clock_time(first)
        assert line_of(lines, "telegram").startswith(
            f"platform telegram: leader a: inbound connection not open since {at} ("
        ), lines


async def _states(rows: Awaitable[list[tuple[str, str, float]]], state: str) -> bool:
    return [s for s, _, _ in await rows] == [state]


@contextlib.asynccontextmanager
async def _replica_a_served_and_an_admin(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[App, str, psycopg.AsyncConnection[Any]]]:
    """Replica a, served, and a connection of the test's own to its database: yields a, its URL and that
    connection (to change the database under it)."""
    async with (
        three_fakes() as fakes,
        replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a,
        served(a, tmp_path / "a") as url,
        await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin,
    ):
        yield a, url, admin


async def test_a_store_that_refuses_writes_is_503_not_ok_on_every_replica(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "store reachable" was told by reads alone: a database answering reads and refusing every write (the DSN
    naming a hot standby after a failover, default_transaction_read_only) had every replica answer 200 "ok" while
    no press could record its decision."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    async with _replica_a_served_and_an_admin(tmp_path, pg_dsn, monkeypatch) as (a, url, admin):
        status, lines = await healthz(url)
        assert (status, lines[0]) == (200, "ok"), lines
        assert "store reachable" in lines, lines
        database = psycopg.sql.Identifier(admin.info.dbname)
        await admin.execute(
            psycopg.sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database)
        )
        await admin.execute(  # every session starts again, read-only
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        )
        assert isinstance(a.stores.pg, PgStore)

        tables = tables_of(a.stores.pg)

        async def write_refused() -> bool:  # the pool's connections were ended: an attempt may meet a closed one
            try:
                await tables.run("DELETE FROM leader_inbound WHERE replica = 'nobody'")
            except psycopg.errors.ReadOnlySqlTransaction:
                return True
            except psycopg.OperationalError:
                return False
            return False

        await until(write_refused, timeout=15.0)  # what a press's decision meets now

        async def refused() -> bool:
            return (await healthz(url))[0] == 503

        await until(refused, timeout=15.0)
        status, lines = await healthz(url)
        assert lines[0].startswith("not deciding: the store refuses writes"), lines
        assert "store reachable, refusing writes (read-only)" in lines, lines
        await admin.execute(psycopg.sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))


@contextlib.asynccontextmanager
async def _read_only_database(
    a: App, admin: psycopg.AsyncConnection[Any]
) -> AsyncIterator[tuple[PgStore, Callable[[], Awaitable[str]]]]:
    """``ALTER DATABASE ... SET default_transaction_read_only = on`` with the writer's session ended (a network
    blip, a pooler) until a write of a's is refused; RESET when the body ends. Yields a's store and a write."""
    store = a.stores.pg
    assert isinstance(store, PgStore)
    tables = tables_of(store)
    database = psycopg.sql.Identifier(admin.info.dbname)

    async def write() -> str:
        try:
            await tables.run("DELETE FROM leader_inbound WHERE replica = 'nobody'")
        except psycopg.errors.ReadOnlySqlTransaction:
            return "refused"
        except psycopg.OperationalError:  # the writer's session was ended: the next write opens another
            return "lost"
        return "taken"

    async def refused() -> bool:
        return await write() == "refused"

    await admin.execute(psycopg.sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database))
    try:
        await admin.execute("SELECT pg_terminate_backend(%s)", (store.writer_pid,))
        await until(refused, timeout=15.0)
        yield store, write
    finally:
        await admin.execute(psycopg.sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))


async def test_a_writer_whose_own_session_refuses_writes_is_503_and_writes_again_once_the_database_takes_them(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decisions are written on the writer's own connection, and /healthz asked a read-pool connection whether the
    store takes writes. With ``ALTER DATABASE ... SET default_transaction_read_only = on`` a session opened since
    refuses writes, one opened before takes them: the writer, reconnected meanwhile, refused every press's write
    while /healthz said 200 "ok ... store reachable". And once the database took writes again (RESET), the writer
    kept its read-only session (a refused write leaves the connection open) and refused every write for good,
    /healthz still "ok", until a restart. The read pool's sessions opened in the read-only time keep refusing
    writes after the RESET too: /healthz asked one and said 503 "refusing writes" while every write was taken."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    async with _replica_a_served_and_an_admin(tmp_path, pg_dsn, monkeypatch) as (a, url, admin):
        async with _read_only_database(a, admin) as (store, write):
            status, lines = await healthz(url)
            assert (status, lines[0].startswith("not deciding: the store refuses writes")) == (503, True), lines
            assert "store reachable, refusing writes (read-only)" in lines, lines
            await every_pool_session_opened_now(store.pool, "on")
        assert await write() == "taken"  # the first write since, not one after a restart
        status, lines = await healthz(url)
        assert (status, lines[0]) == (200, "ok"), lines
        async with store.pool.connection() as conn:  # the stale sessions were replaced, not only stepped around
            cursor = await conn.execute("SHOW transaction_read_only")
            assert await cursor.fetchone() == ("off",)


async def test_a_writer_that_met_a_read_only_database_is_not_503_once_the_database_takes_writes_before_it_writes(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's refusal stood until its next write was taken: a replica with nothing to write (a follower, a
    quiet night) answered 503 "refusing writes" long after the operator's RESET, every write there taken."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 3600.0)  # no record written again in the test
    async with _replica_a_served_and_an_admin(tmp_path, pg_dsn, monkeypatch) as (a, url, admin):
        async with _read_only_database(a, admin) as (store, _):
            assert store.refusing_writes is not None
            status, lines = await healthz(url)
            assert (status, lines[0].startswith("not deciding: the store refuses writes")) == (503, True), lines
        assert store.refusing_writes is not None  # nothing written since
        status, lines = await healthz(url)
        assert (status, lines[0]) == (200, "ok"), lines


async def test_a_writers_old_refusal_is_asked_of_a_new_session_once_not_on_every_healthz(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's refusal stands until its next write: a quiet replica opened a session for the question on
    every /healthz (a monitor's every second) for as long, and said 503 "refusing writes" when the server
    could not give it one (full), every write taken. A new refusal is asked about again."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 3600.0)  # no record written again in the test
    async with _replica_a_served_and_an_admin(tmp_path, pg_dsn, monkeypatch) as (a, url, admin):
        async with _read_only_database(a, admin) as (store, _):
            pass
        status, lines = await healthz(url)
        assert (status, lines[0]) == (200, "ok"), lines
        assert store.refusing_writes is not None  # nothing written since: the refusal stands
        # A pool session opened in the read-only time is asked about by a new session too (another test's matter).
        await every_pool_session_opened_now(store.pool, "off")
        database = psycopg.sql.Identifier(admin.info.dbname)
        allow = psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}")  # said from another database
        maintenance = psycopg.conninfo.make_conninfo(pg_dsn, dbname="postgres")
        async with await psycopg.AsyncConnection.connect(maintenance, autocommit=True) as other:
            # No new session of the database from now on, a superuser's neither: the question is not asked again.
            await other.execute(allow.format(database, psycopg.sql.SQL("false")))
            try:
                for _ in range(2):
                    status, lines = await healthz(url)
                    assert (status, lines[0]) == (200, "ok"), lines
            finally:
                await other.execute(allow.format(database, psycopg.sql.SQL("true")))
        async with _read_only_database(a, admin):  # refused again: asked again
            status, lines = await healthz(url)
            assert (status, lines[0].startswith("not deciding: the store refuses writes")) == (503, True), lines
        status, lines = await healthz(url)
        assert (status, lines[0]) == (200, "ok"), lines


@pytest.mark.parametrize("a_record_age", [0.0, 7 * 86400.0], ids=["just-before", "a-week-old"])
async def test_a_new_leader_that_cannot_open_the_connection_either_says_it_is_down_since_the_old_leader_found_it_so(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, a_record_age: float
) -> None:
    """Telegram's polling ended on leader a (401) and stayed down; the lease went to b, whose own open met the same
    401. b recorded "not open since" its own failed open: a platform down for an hour across a leader change (a
    deploy, a restart) read on every replica as down since the change. A record last written long before (a
    leadership that ended a week ago, every replica stopped since, none to forget its rows) is not inherited:
    b said "not open since last week" of a platform nobody had tried in the meantime."""
    _keys_timing_and_quick_starts(tmp_path, monkeypatch, FAST)
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)  # nothing opens it again but a new leader
    monkeypatch.setattr(lifecycle, "INBOUND_RECORD_SECONDS", 0.02)
    async with three_fakes() as fakes, replica(fakes, pg_dsn, "a", tmp_path, monkeypatch) as a:
        a_replication = a.replication
        assert a_replication is not None
        await until(lambda: _true(a_replication.is_leader))
        assert isinstance(a.stores.pg, PgStore)
        tables = tables_of(a.stores.pg)

        async def record(of: str) -> list[tuple[str, float]]:
            rows = await tables.all(
                "SELECT state, since FROM leader_inbound WHERE platform = 'telegram' AND replica = ?", (of,)
            )
            return [(str(s), float(t)) for s, t in rows]

        async def recorded(of: str, state: str) -> bool:
            return [s for s, _ in await record(of)] == [state]

        await until(lambda: recorded("a", bus.INBOUND_OPEN))
        async with replica(fakes, pg_dsn, "b", tmp_path, monkeypatch) as b:
            b_replication = b.replication
            assert b_replication is not None
            await fakes.telegram.wait_for_call("getUpdates", answered=False)
            fakes.telegram.script("getUpdates", *[Fault.server_error(401, "Unauthorized")] * 10_000)
            fakes.telegram.push_message(TG_CHAT, TG_ADMIN, "wakes the long poll; the next one meets the 401")
            await until(lambda: recorded("a", bus.INBOUND_NOT_OPEN))
            if a_record_age:  # a's record, and what it found, as written that long ago
                await tables.run(
                    "UPDATE leader_inbound SET recorded = recorded - ?, since = since - ? WHERE replica = 'a'",
                    (a_record_age, a_record_age),
                )
            [(_, first)] = await record("a")
            # b's open is refused before its polling begins: never open in between, as a look could otherwise find it
            fakes.telegram.script("deleteWebhook", *[Fault.server_error(401, "Unauthorized")] * 100)
            await a_replication.lease.stop()  # a leaves the lease (its session ends); b takes it
            await until(lambda: _true(b_replication.is_leader))
            await until(lambda: recorded("b", bus.INBOUND_NOT_OPEN))  # b's own open met the 401 too
            [(_, since)] = await record("b")
            if a_record_age:
                assert since > first + a_record_age  # since b's own failed open, after a's
            else:
                assert since == first
