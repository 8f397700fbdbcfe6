"""The audit chain as Kazma writes it, on SQLite and PostgreSQL: one line whatever writes at once, nothing left of a
transaction that failed, a signature within milliseconds of a decision, and the history from before the chain
chained once, said so in its checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals import checkpointer as checkpointer_module
from kazma.approvals.audit_verify import verify
from kazma.approvals.chain import FROM_REQUEST, GENESIS
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import HISTORY
from kazma.bot.store import all_migrations, pg_migrations
from kazma.config.metrics import failure_count
from kazma.config.store.backend import Tx
from kazma.config.store.database import Migration
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.audit_support import Attacker, whole_log
from tests.store_backends import Engine, open_store, raw_rows

ARGS = {"command": "deploy --prod"}


@asynccontextmanager
async def services(engine: Engine, count: int) -> AsyncIterator[list[ApprovalService]]:
    """``count`` services, each on a store (a connection, a writer) of its own: replicas on PostgreSQL, processes
    sharing one file on SQLite."""
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(open_store(engine, application_name=f"w{n}")) for n in range(count)]
        yield [
            ApprovalService(ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER), approvals_config())
            for conn in opened
        ]


async def test_writers_appending_at_once_make_one_chain_in_commit_order(store_engine: Engine) -> None:
    async with services(store_engine, 3) as writers:
        checkpointers = [Checkpointer(w.store, TEST_SIGNER, min_interval=0.0) for w in writers]

        async def work(n: int) -> None:
            service = writers[n % len(writers)]
            request = await service.open("shell", {"n": n}, "agent:builder", "telegram:-100")
            presses = [
                writers[(n + k) % len(writers)].decide(request.id, Decision.APPROVE, actor=actor, platform=platform)
                for k, (actor, platform) in enumerate((("telegram:111", "telegram"), ("slack:U111", "slack")))
            ]
            results = await asyncio.gather(*presses)
            assert sum(r.won for r in results) == 1
            await checkpointers[n % len(checkpointers)].sign()

        await asyncio.gather(*(work(n) for n in range(60)))
        await checkpointers[0].sign()
        events, checkpoints = await whole_log(writers[0])
    # opened, decided and press_lost for each request: every one there, numbered 1..N without a gap or a repeat
    assert len(events) == 180
    assert [e.seq for e in events] == list(range(1, 181))
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    assert events[0].prev_hash == GENESIS


async def test_a_transaction_that_fails_after_appending_leaves_no_event_and_no_gap(store_engine: Engine) -> None:
    async with services(store_engine, 1) as [service]:
        store = service.store
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")

        def appends_then_fails(tx: Tx) -> None:
            store.chain.append(tx, request.id, "forgotten", actor=None, at=store.clock(), args_hash=FROM_REQUEST)
            raise RuntimeError("the operation fails after its audit event")

        def appends(tx: Tx) -> None:
            store.chain.append(tx, request.id, "kept", actor=None, at=store.clock(), args_hash=FROM_REQUEST)

        # In one group: the failing operation's event goes with it, the other's stays.
        outcomes = await asyncio.gather(store.write(appends_then_fails), store.write(appends), return_exceptions=True)
        assert isinstance(outcomes[0], RuntimeError)
        assert outcomes[1] is None
        with pytest.raises(RuntimeError):
            await store.write(appends_then_fails)  # alone in its transaction
        await store.write(appends)
        events, _ = await whole_log(service)
    assert [(e.seq, e.event) for e in events] == [(1, "opened"), (2, "kept"), (3, "kept")]
    assert all(e.args_hash == request.args_hash for e in events)
    assert [e.prev_hash for e in events[1:]] == [e.chain_hash for e in events[:-1]]


async def test_a_decision_is_signed_within_moments_by_the_running_checkpointer(store_engine: Engine) -> None:
    async with services(store_engine, 1) as [service]:
        checkpointer = Checkpointer(service.store, TEST_SIGNER)
        running = asyncio.create_task(checkpointer.run())
        try:
            request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
            await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
            # No explicit signature here: the decision's commit woke the checkpointer.
            async with asyncio.timeout(10):
                while (witness := await service.store.witness(request.id)) is None:
                    await asyncio.sleep(0.01)
            [decided] = await service.store.events(request.id, event="decided")
            assert witness.first_seq <= decided.seq <= witness.seq
            assert TEST_SIGNER.public_keys().problem(witness) is None
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_checkpoint_rides_with_the_next_decision_and_a_witness_sends_it_at_once(store_engine: Engine) -> None:
    async with services(store_engine, 1) as [service]:
        store = service.store
        writer: Any = await store.tables.writer()  # StoreWriter or PgWriter: both count their groups
        checkpointer = Checkpointer(store, TEST_SIGNER, min_interval=0.0, ride=3600.0)
        first = await service.open("shell", {"n": 1}, "agent:builder", "telegram:-100")
        second = await service.open("shell", {"n": 2}, "agent:builder", "telegram:-100")
        running = asyncio.create_task(checkpointer.run())
        try:
            checkpointer.wake()

            async def riding() -> None:
                async with asyncio.timeout(10):
                    while writer.riders == 0:
                        await asyncio.sleep(0.001)

            await riding()  # the pass waits for other writes: no commit of its own, no read held up
            groups = writer.groups
            assert (await service.decide(first.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
            await riding()  # the next pass: the one before went with the decision
            # One commit held the decision and the checkpoint before it (the decision's event, hashed at the end
            # of that transaction, is the next pass's to sign).
            assert writer.groups == groups + 1
            assert await store.witness(first.id) is None
            assert len(await store.chain_checkpoints()) == 1
            # A settled card waits for the checkpoint of its decision: the riding pass goes at once.
            witness = await checkpointer.witness(first.id, patience=10)
            assert witness is not None
            [decided] = await store.events(first.id, event="decided")
            assert witness.first_seq <= decided.seq <= witness.seq
            assert TEST_SIGNER.public_keys().problem(witness) is None
            assert (await service.decide(second.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        await checkpointer.sign()
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]


async def test_a_witness_asked_for_while_a_pass_rides_costs_that_pass_alone(store_engine: Engine) -> None:
    # Press -> card settled: the bus asks for the decision's witness while the pass the decision woke waits to
    # ride. That pass covers the decision (committed before it was asked for): sending it at once is all it
    # takes. Waking the loop as well made a second, empty pass right behind it, on the settled card's way.
    async with services(store_engine, 1) as [service]:
        writer: Any = await service.store.tables.writer()
        # Passes only: a lone decision is otherwise signed in its own commit, and no pass rides after it.
        checkpointer = Checkpointer(service.store, TEST_SIGNER, min_interval=0.0, ride=3600.0, in_decisions=False)
        passes: list[None] = []
        sign = checkpointer.sign

        async def counted(**kwargs: Any) -> Any:
            try:
                return await sign(**kwargs)
            finally:
                passes.append(None)  # counted as it ends: the pass riding when the witness is asked ends after

        checkpointer.sign = counted  # type: ignore[method-assign]
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        running = asyncio.create_task(checkpointer.run())
        try:

            async def idle() -> None:  # the loop waits to be woken, no pass under way or riding
                async with asyncio.timeout(10):
                    while not (checkpointer._due._waiters and writer.riders == 0):
                        await asyncio.sleep(0.001)

            checkpointer.wake()
            async with asyncio.timeout(10):
                while writer.riders == 0:
                    await asyncio.sleep(0.001)
            await checkpointer.sign()  # the open's events signed; the riding pass boards this one's group
            await idle()
            assert (await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
            async with asyncio.timeout(10):
                while writer.riders == 0:  # the pass the decision woke, riding
                    await asyncio.sleep(0.001)
            passes.clear()
            witness = await checkpointer.witness(request.id, patience=10)
            assert witness is not None
            await idle()
            assert len(passes) == 1  # the riding pass, sent at once; no second one after it
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_settling_card_does_not_wait_out_the_pause_between_passes(store_engine: Engine) -> None:
    # Passes are at most one per min_interval so a burst of decisions shares a signature; but every card's edit
    # waits for the checkpoint holding its decision, so a witness asked for cuts the pause short (to
    # WITNESS_INTERVAL). With the pause an hour long, the witness is found within its patience only if so.
    async with services(store_engine, 1) as [service]:
        checkpointer = Checkpointer(service.store, TEST_SIGNER, min_interval=3600.0, ride=0.0)
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        running = asyncio.create_task(checkpointer.run())
        try:
            checkpointer.wake()  # the open's pass: the next one is an hour away
            async with asyncio.timeout(10):
                while checkpointer._last_pass == 0.0:
                    await asyncio.sleep(0.005)
            assert (await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
            witness = await checkpointer.witness(request.id, patience=10)
            assert witness is not None
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_pass_in_a_decisions_commit_restarts_the_pause_between_passes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On SQLite a decision is signed in its own commit when no pass was made within min_interval. When that commit
    # came while the loop waited out the pause after its own pass, the loop still measured the pause from its own
    # pass and signed again WITNESS_INTERVAL after the commit's checkpoint: under a stream of decisions a fifth of
    # all passes (bench/audit_chain.py). The pause runs from the commit's pass: what was appended after it is the
    # next pass's, min_interval later. The checkpointer's monotonic clock is this test's, so "min_interval later"
    # is a step of it; the loop's timer running out is _hurry set without a witness asked for.
    now = [1000.0]
    monkeypatch.setattr(checkpointer_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    async with services(Engine("sqlite", str(tmp_path / "k.db")), 1) as [service]:
        checkpointer = Checkpointer(service.store, TEST_SIGNER, min_interval=10.0, ride=0.0, every=3600.0)
        first = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        running = asyncio.create_task(checkpointer.run())
        try:

            async def checkpoints() -> int:
                return len(await service.store.chain_checkpoints(limit=100))

            checkpointer.wake()
            async with asyncio.timeout(10):
                while await checkpoints() < 1:  # the loop's pass over the first open, at 1000
                    await asyncio.sleep(0.001)
            await service.open("shell", ARGS, "agent:builder", "telegram:-100")  # wakes the loop: it waits to 1010
            async with asyncio.timeout(10):
                while not checkpointer._hurry._waiters:
                    await asyncio.sleep(0.001)
            now[0] = 1010.0
            assert (await service.decide(first.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
            assert await checkpoints() == 2  # signed in the decision's commit, at 1010
            await service.open("shell", ARGS, "agent:builder", "telegram:-100")  # appended after it
            now[0] = 1010.5
            signed = checkpointer._signed
            checkpointer._hurry.set()  # the pause the loop measured from 1000 is over
            async with asyncio.timeout(10):  # the loop waits again (or it signed)
                while checkpointer._hurry.is_set() and checkpointer._signed is signed:
                    await asyncio.sleep(0.001)
            assert checkpointer._signed is signed
            assert await checkpoints() == 2  # the third open waits for the pass at 1020
            now[0] = 1020.0
            checkpointer._hurry.set()  # that pause over too
            async with asyncio.timeout(10):
                while await checkpoints() < 3:
                    await asyncio.sleep(0.001)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        events, checkpoints_made = await whole_log(service)
    assert verify(events, checkpoints_made, TEST_SIGNER.public_keys()).first is None
    assert checkpoints_made[-1].seq == events[-1].seq  # every event signed, the last open by the third checkpoint


async def test_a_checkpoint_signs_the_head_kazma_computed_and_a_row_changed_before_it_is_still_caught(
    store_engine: Engine,
) -> None:
    # The checkpointer signs the head this process computed from its own committed appends, not what the rows say
    # by then: a decision rewritten between its commit and the next checkpoint is still named by verify.
    async with services(store_engine, 1) as [service]:
        store = service.store
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert (await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        [decided] = await store.events(request.id, event="decided")
        await Attacker(store_engine).run_around(
            ("UPDATE approval_events SET detail = 'approved' WHERE seq = ?", (decided.seq,))
        )
        judged = await Checkpointer(store, TEST_SIGNER).sign()
        assert [(c.first_seq, c.seq) for c in judged.signed] == [(1, decided.seq)]
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.first is not None
    assert (report.first.seq, report.first.kind) == (decided.seq, "changed")


async def test_a_transaction_failed_after_the_chain_linked_leaves_the_next_checkpoint_right(
    store_engine: Engine,
) -> None:
    async with services(store_engine, 1) as [service]:
        store = service.store
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")

        def fails_after_the_chain_linked(tx: Tx) -> None:
            store.chain.append(tx, request.id, "forgotten", actor=None, at=store.clock(), args_hash=FROM_REQUEST)

            def fail(_tx: Any, _items: list[Any]) -> None:
                raise RuntimeError("the end of the transaction fails after the chain linked its events")

            tx.defer(fail, None)

        with pytest.raises(RuntimeError):
            await store.write(fails_after_the_chain_linked)
        # The next append takes the same sequence number after the same head, with another hash.
        await store.audit(request.id, "kept")
        judged = await Checkpointer(store, TEST_SIGNER).sign()
        events, checkpoints = await whole_log(service)
    assert [e.event for e in events] == ["opened", "kept"]
    assert [(c.first_seq, c.seq, c.head) for c in judged.signed] == [(1, 2, events[-1].chain_hash)]
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]


def _before_the_chain(engine: Engine) -> list[Migration]:
    """Every migration of the release before the audit chain (approvals up to v8, no sink)."""
    chosen = pg_migrations() if engine.postgres else all_migrations()
    return [m for m in chosen if not (m.component == "approvals" and m.version >= 9) and m.component != "audit_sink"]


async def test_events_from_before_the_chain_are_chained_once_and_their_checkpoint_says_so(store_engine: Engine) -> None:
    async with open_store(store_engine, migrations=_before_the_chain(store_engine)):
        pass
    # The release before wrote its audit rows as plain inserts (ids given by the store).
    old = [("r1", "opened", "agent:builder", None, 1_800_000_000.5, "h1", "tool=shell"),
           ("r1", "decided", "telegram:111", "telegram", 1_800_000_001.25, "h1", "approved"),
           (None, "press_refused", "telegram:999", "telegram", 1_800_000_002.0, None, "not an approver")]  # fmt: skip
    attacker = Attacker(store_engine)
    for row in old:
        attacker.run(
            (
                "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            )
        )
    async with services(store_engine, 1) as [service]:
        await service.store.start_chain()  # what kazma run does first
        await service.store.start_chain()  # once only
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await Checkpointer(service.store, TEST_SIGNER).sign()
        events, checkpoints = await whole_log(service)
    history = [c for c in checkpoints if c.kind == HISTORY]
    assert len(history) == 1
    assert (history[0].first_seq, history[0].seq) == (events[0].seq, events[2].seq)
    assert [e.chain_hash for e in events[:3]] == [None, None, None]  # the old rows are as they were
    assert events[3].request_id == request.id
    assert events[3].prev_hash == history[0].head  # the chain goes on from the history's head
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    assert report.history == history[0]

    # A row from before the chain changed afterwards: the history's signed head no longer matches.
    attacker.run(("UPDATE approval_events SET detail = 'denied' WHERE seq = ?", (events[1].seq,)))
    rows = raw_rows(store_engine, "SELECT detail FROM approval_events WHERE seq = ?", (events[1].seq,))
    assert rows == [("denied",)]
    async with services(store_engine, 1) as [service]:
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.first is not None
    assert (report.first.seq, report.first.kind) == (events[0].seq, "changed")
    assert "chained once at the upgrade" in report.first.detail


async def test_rows_inserted_around_kazma_are_counted_and_never_signed(store_engine: Engine) -> None:
    async with services(store_engine, 1) as [service]:
        await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await Attacker(store_engine).run_around(
            (
                "INSERT INTO approval_events (seq, request_id, event, actor, at) VALUES (2, NULL, 'decided', 'x', 1)",
                (),
            )
        )
        before = failure_count("audit_unvouched_events")
        await service.open("shell", ARGS, "agent:builder", "telegram:-100")  # chained on after the stray row
        judged = await Checkpointer(service.store, TEST_SIGNER).sign()
        assert judged.unvouched == [2]
        assert failure_count("audit_unvouched_events") > before
        events, checkpoints = await whole_log(service)
    assert [e.seq for e in events] == [1, 2, 3]
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.first is not None
    assert (report.first.seq, report.first.kind) == (2, "inserted")


async def test_a_checkpointer_woken_as_it_is_cancelled_stops(store_engine: Engine) -> None:
    # The hang seen at `kazma run`'s stop: the last write woke the checkpointer in the same turn of the loop as the
    # supervisor cancelled it. Python 3.11's wait_for returns the finished wait and drops the cancel, so the loop
    # went round again and slept for a minute at a time while stop waited for it.
    async with services(store_engine, 1) as [service]:
        checkpointer = Checkpointer(service.store, TEST_SIGNER, min_interval=0.0, every=3600.0)
        running = asyncio.create_task(checkpointer.run())
        for _ in range(3):  # it is waiting to be woken
            await asyncio.sleep(0)
        checkpointer.wake()
        running.cancel()
        done, _ = await asyncio.wait({running}, timeout=10)
        assert done == {running}, "the checkpointer kept running after it was cancelled"
        assert running.cancelled()


async def test_a_witness_asked_for_when_no_checkpointer_runs_is_signed_at_once(store_engine: Engine) -> None:
    # A Kazma stopping: its checkpointer task is stopped, then an /mcp call it withdraws ends a request and its
    # cards settle. The witness waited its whole patience for a signature nobody would make, longer than the
    # stop lets the cards' edits take, and the cards kept their buttons.
    async with services(store_engine, 1) as [service]:
        checkpointer = Checkpointer(service.store, TEST_SIGNER)
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        async with asyncio.timeout(30):
            witness = await checkpointer.witness(request.id, patience=3600)
        assert witness is not None
        [decided] = await service.store.events(request.id, event="decided")
        assert witness.first_seq <= decided.seq <= witness.seq


async def test_a_pass_yields_to_another_process_that_signed_within_min_interval(store_engine: Engine) -> None:
    # Replicas (or processes sharing a file) each kept min_interval between their own passes only: three of them
    # signed three times as often as one. A pass now signs nothing while another process's checkpoint is younger
    # than min_interval, says how long until it is not, and signs then; its own fresh checkpoint is no reason.
    now = [1_000_000.0]
    async with services(store_engine, 2) as [a, b]:
        signs_a = Checkpointer(a.store, TEST_SIGNER, clock=lambda: now[0])
        signs_b = Checkpointer(b.store, TEST_SIGNER, clock=lambda: now[0])
        first = await a.open("shell", ARGS, "agent:builder", "telegram:-100")
        await a.decide(first.id, Decision.DENY, actor="telegram:111", platform="telegram")
        [by_a] = (await signs_a.sign()).signed
        second = await b.open("shell", ARGS, "agent:builder", "telegram:-100")
        await b.decide(second.id, Decision.APPROVE, actor="telegram:111", platform="telegram")

        now[0] += 0.005
        yielded = await signs_b.sign(yield_to_fresh=True)
        assert yielded.signed == []
        assert yielded.wait == pytest.approx(signs_b.min_interval - 0.005)
        assert await b.store.witness(second.id) is None

        now[0] += yielded.wait
        [by_b] = (await signs_b.sign(yield_to_fresh=True)).signed
        [decided] = await b.store.events(second.id, event="decided")
        assert by_a.seq < decided.seq <= by_b.seq
        assert by_b.first_seq == by_a.seq + 1

        third = await b.open("shell", ARGS, "agent:builder", "telegram:-100")
        await b.decide(third.id, Decision.DENY, actor="telegram:111", platform="telegram")
        now[0] += 0.001  # B's own checkpoint is fresh: B does not wait for itself
        assert len((await signs_b.sign(yield_to_fresh=True)).signed) == 1
        report = verify(*await whole_log(b), TEST_SIGNER.public_keys())
        assert report.ok, report


async def test_a_witness_is_signed_at_once_though_another_process_just_signed(store_engine: Engine) -> None:
    # The clock stands still just after A's checkpoint: B's passes would yield for good. A settling card's
    # witness does not wait for that: the pass it asks for signs.
    now = [1_000_000.0]
    async with services(store_engine, 2) as [a, b]:
        signs_a = Checkpointer(a.store, TEST_SIGNER, clock=lambda: now[0])
        signs_b = Checkpointer(b.store, TEST_SIGNER, clock=lambda: now[0])
        first = await a.open("shell", ARGS, "agent:builder", "telegram:-100")
        await a.decide(first.id, Decision.DENY, actor="telegram:111", platform="telegram")
        await signs_a.sign()
        now[0] += 0.001
        running = asyncio.create_task(signs_b.run())
        try:
            second = await b.open("shell", ARGS, "agent:builder", "telegram:-100")
            await b.decide(second.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
            async with asyncio.timeout(30):
                witness = await signs_b.witness(second.id, patience=3600)
            assert witness is not None
            [decided] = await b.store.events(second.id, event="decided")
            assert witness.first_seq <= decided.seq <= witness.seq
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
