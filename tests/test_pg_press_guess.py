"""A press on PostgreSQL sent on a guess of what it finds (approvals PG migration 14), attacked: the first press of
a request in a group is guessed to win and the others there to lose to it, their audit events written beside
them without waiting. Every way the guess can be wrong (another replica decided first, the deadline passed, the
card pressed is not one of the request's) must end as the press would have ended unguessed: the right winner,
the loser told what beat it, one audit event per press, one chain."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision, button_data
from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.model import Status
from kazma.approvals.seal import seal_problem
from kazma.bot.store import pg_migrations
from kazma.config.metrics import failure_count
from kazma.config.store.postgres import PgStore, PgWriter, open_pg_store
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

PRESSERS = (("telegram:111", "telegram"), ("slack:U111", "slack"))


@contextlib.asynccontextmanager
async def replicas(dsn: str, count: int) -> AsyncIterator[list[tuple[ApprovalService, PgWriter]]]:
    async with contextlib.AsyncExitStack() as stack:
        made = []
        for n in range(count):
            backend: PgStore = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"guess{n}")
            stack.push_async_callback(backend.close)
            store = ApprovalStore(backend, keyring=TEST_KEYRING, audit=TEST_SIGNER)
            made.append((ApprovalService(store, approvals_config()), await backend.writer()))
        yield made


async def checked_log(service: ApprovalService) -> list[tuple[str, str | None, str | None]]:
    """Every event (name, request, actor), once the chain verifies."""
    await Checkpointer(service.store, TEST_SIGNER, min_interval=0.0).sign()
    events = await service.store.chain_events(limit=10_000)
    checkpoints = await service.store.chain_checkpoints(limit=10_000)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    return [(e.event, e.request_id, e.actor) for e in events]


async def test_presses_of_one_request_in_one_group_one_wins_the_others_lose_to_it_on_the_guess(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 1) as [(service, writer)]:
        opened = [await service.open("shell", {"n": n}, "agent:builder", "telegram:-100") for n in range(5)]
        retries = writer.pipeline_retries
        presses = [
            service.decide_from_button(button_data(r.id, decision), actor=actor, platform=platform)
            for r in opened
            for decision, (actor, platform) in zip((Decision.DENY, Decision.APPROVE), PRESSERS, strict=True)
        ]
        results = await asyncio.gather(*presses)
        assert writer.pipeline_retries == retries  # every guess held: nothing ran twice
        for n, request in enumerate(opened):
            won, lost = results[2 * n], results[2 * n + 1]
            assert won.won
            assert not lost.won
            assert lost.outcome is not None
            assert lost.outcome.status is Status.DENIED
            assert lost.outcome.decided_by == "telegram:111"  # the loser is told what beat it
            stored = await service.store.get(request.id)
            assert stored is not None
            assert stored.status is Status.DENIED
            assert seal_problem(TEST_KEYRING, stored) is None
        log = await checked_log(service)
    expected = [("opened", r.id, "agent:builder") for r in opened]
    for r in opened:
        expected += [("decided", r.id, "telegram:111"), ("press_lost", r.id, "slack:U111")]
    assert log == expected


async def test_a_press_guessed_to_win_that_another_replica_beat_loses_and_is_audited_once(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 2) as [(opener, writer), (other, _)]:
        request = await opener.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        first = await other.decide(request.id, Decision.DENY, actor="slack:U111", platform="slack")
        assert first.won
        retries = writer.pipeline_retries
        # The opener knows what a press of it seals, so it guesses its press wins: the guess is stale.
        late = await opener.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert writer.pipeline_retries == retries + 1  # the group ran again, asking
        assert not late.won
        assert late.outcome is not None
        assert late.outcome.status is Status.DENIED
        assert late.outcome.decided_by == "slack:U111"
        stored = await opener.store.get(request.id)
        assert stored is not None
        assert (stored.status, stored.decided_by) == (Status.DENIED, "slack:U111")
        log = await checked_log(opener)
    assert log == [
        ("opened", request.id, "agent:builder"),
        ("decided", request.id, "slack:U111"),
        ("press_lost", request.id, "telegram:111"),
    ]


async def test_a_stale_press_guess_surfacing_at_the_chains_append_is_no_chain_failure(pg_dsn: str) -> None:
    # The press guessed to win fails its transaction (KZ001); in pipeline mode the error comes back as the answer
    # the chain's append waits for. The writer runs the group again by design: not an audit chain failure.
    async with replicas(pg_dsn, 2) as [(opener, writer), (other, _)]:
        request = await opener.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        assert (await other.decide(request.id, Decision.DENY, actor="slack:U111", platform="slack")).won
        retries, failures = writer.pipeline_retries, failure_count("audit_chain")
        late = await opener.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert writer.pipeline_retries == retries + 1  # the stale guess was met, and the group ran again
        assert not late.won
        assert failure_count("audit_chain") == failures
        await checked_log(opener)


async def test_a_press_guessed_to_win_past_its_deadline_loses_and_the_request_times_out(pg_dsn: str) -> None:
    now = [1_000_000.0]
    async with replicas(pg_dsn, 1) as [(service, writer)]:
        service.store.clock = lambda: now[0]
        service.clock = lambda: now[0]
        request = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100", deadline=5)
        now[0] += 10
        retries = writer.pipeline_retries
        late = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert writer.pipeline_retries == retries + 1  # guessed to win, it found the deadline past
        assert not late.won
        assert late.outcome is not None
        assert late.outcome.status is Status.TIMEOUT
        log = await checked_log(service)
    assert [event for event, _, _ in log] == ["opened", "press_lost", "timeout"]


async def test_a_press_from_a_card_that_is_not_the_requests_is_refused_though_guessed_to_win(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 1) as [(service, writer)]:
        request = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        retries = writer.pipeline_retries
        pressed = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE), actor="telegram:111", platform="telegram",
            chat="-100", message_id="4242",
        )  # fmt: skip
        assert not pressed.won
        assert writer.pipeline_retries > retries  # the guess was stale: the card check said no
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.PENDING
        log = await checked_log(service)
    assert [event for event, _, _ in log if event in ("decided", "press_lost")] == []
