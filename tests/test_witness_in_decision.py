"""A decision signed in its own commit (SQLite, a running checkpointer): its cards' witness is there as the decision
commits, with no commit, read or pass of its own; what the chain must not sign is still never signed, and a pass
that fails there costs the decision nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.audit_verify import verify
from kazma.approvals.chain import event_hash
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import AuditSigner, Checkpoint
from kazma.approvals.model import Status
from kazma.config.metrics import failure_count
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.audit_support import Attacker, whole_log
from tests.store_backends import Engine, open_store

ARGS = {"command": "deploy --prod"}


@asynccontextmanager
async def running(path: Path, signer: AuditSigner = TEST_SIGNER) -> AsyncIterator[tuple[ApprovalService, Checkpointer]]:
    """A service on a SQLite file and its checkpointer, running (what ``kazma run`` has)."""
    async with open_store(Engine("sqlite", str(path))) as conn:
        service = ApprovalService(ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER), approvals_config())
        # No pause between passes: whether a decision is signed in its commit depends on nothing but the code.
        checkpointer = Checkpointer(service.store, signer, min_interval=0.0)
        task = asyncio.create_task(checkpointer.run())
        try:
            yield service, checkpointer
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def idle(service: ApprovalService, checkpointer: Checkpointer) -> None:
    """Until the loop waits to be woken with no pass under way or riding, and nothing is unsigned."""
    writer: Any = await service.store.tables.writer()
    async with asyncio.timeout(10):
        while not (checkpointer._due._waiters and writer.riders == 0 and not checkpointer._due.is_set()):
            await asyncio.sleep(0.001)


def counted_passes(checkpointer: Checkpointer) -> list[None]:
    passes: list[None] = []
    sign = checkpointer.sign

    async def counted(**kwargs: Any) -> Any:
        passes.append(None)
        return await sign(**kwargs)

    checkpointer.sign = counted  # type: ignore[method-assign]
    return passes


async def test_a_lone_decision_commits_with_its_checkpoint_and_its_witness_needs_no_pass(tmp_path: Path) -> None:
    async with running(tmp_path / "k.db") as (service, checkpointer):
        store = service.store
        writer: Any = await store.tables.writer()
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await idle(service, checkpointer)  # the open's events signed by a pass of their own
        passes = counted_passes(checkpointer)
        groups = writer.groups
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        assert writer.groups == groups + 1  # one commit: the decision and the checkpoint holding it
        stored = await store.witness(request.id)
        assert stored is not None
        # What the card asks for is there at once: no read, no pass, no patience.
        assert await checkpointer.witness(request.id, patience=0) == stored
        [decided] = await store.events(request.id, event="decided")
        assert stored.first_seq <= decided.seq == stored.seq
        assert TEST_SIGNER.public_keys().problem(stored) is None
        await idle(service, checkpointer)
        assert passes == []  # the decision's commit woke no pass: there was nothing left to sign
        assert writer.groups == groups + 1
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    assert report.pending == 0


async def test_a_forged_event_before_a_decision_is_never_signed_by_the_decisions_commit(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    async with running(path) as (service, checkpointer):
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await idle(service, checkpointer)
        [opened] = await service.store.chain_events(limit=10)
        # Someone with the file appends a well-chained "decided" of their own, around Kazma (no commit seal).
        forged = opened.seq + 1
        digest = event_hash(opened.chain_hash or "", request.id, "decided", "telegram:111", "telegram",
                            opened.at + 1, None, "approved")  # fmt: skip
        await Attacker(Engine("sqlite", str(path))).run_around(
            (
                "INSERT INTO approval_events (seq, request_id, event, actor, platform, at, detail, prev_hash,"
                " chain_hash) VALUES (?, ?, 'decided', 'telegram:111', 'telegram', ?, 'approved', ?, ?)",
                (forged, request.id, opened.at + 1, opened.chain_hash, digest),
            ),
        )
        unvouched = failure_count("audit_unvouched_events")
        other = await service.open("shell", {"n": 2}, "agent:builder", "telegram:-100")
        await idle(service, checkpointer)
        assert (await service.decide(other.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        witness = await checkpointer.witness(other.id, patience=0)
        assert witness is not None
        assert witness.first_seq > forged  # the decision's checkpoint starts after the forged row, never over it
        assert failure_count("audit_unvouched_events") > unvouched
        signed = await service.store.chain_checkpoints(limit=100_000)
        assert not any(c.first_seq <= forged <= c.seq for c in signed)
        events = await service.store.chain_events(limit=100_000)
    report = verify(events, signed, TEST_SIGNER.public_keys())
    assert report.problems
    assert report.problems[0].seq == forged
    assert report.problems[0].kind == "unsigned", report.problems[0].line()


class _FailsInDecisions:
    """The audit signer, whose signature fails when asked for in a decision's own commit (its key gone, say)."""

    def __init__(self, signer: AuditSigner) -> None:
        self.signer = signer
        self.failing = False

    def sign(self, *args: Any, **kwargs: Any) -> Checkpoint:
        if self.failing:
            self.failing = False
            raise OSError("the audit key could not be read")
        return self.signer.sign(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.signer, name)


async def test_a_signature_that_fails_in_a_decisions_commit_costs_the_decision_nothing(tmp_path: Path) -> None:
    flaky = _FailsInDecisions(TEST_SIGNER)
    async with running(tmp_path / "k.db", signer=flaky) as (service, checkpointer):  # type: ignore[arg-type]
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await idle(service, checkpointer)
        failed = failure_count("audit_checkpoint")
        flaky.failing = True
        pressed = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert pressed.won
        assert failure_count("audit_checkpoint") == failed + 1
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.APPROVED
        assert [e.event for e in await service.store.events(request.id)] == ["opened", "decided"]
        # Nothing was signed in that commit; the loop's pass (woken by it) signs the decision instead.
        witness = await checkpointer.witness(request.id, patience=10)
        assert witness is not None
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]


async def test_a_decisions_own_commit_signs_what_it_chained_without_reading_the_events_back(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import kazma.approvals.checkpointer as checkpointer_module

    read_back: list[int] = []
    judge_rows = checkpointer_module._vouched_runs

    def counted(signer: AuditSigner, rows: list[Any], prev: str, judged: Any) -> list[tuple[int, int, str]]:
        read_back.append(len(rows))
        return judge_rows(signer, rows, prev, judged)

    monkeypatch.setattr(checkpointer_module, "_vouched_runs", counted)
    async with running(tmp_path / "k.db") as (service, checkpointer):
        requests = [await service.open("shell", {"n": n}, "agent:builder", "telegram:-100") for n in range(3)]
        await idle(service, checkpointer)
        for request in requests:
            assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
            # Signed in the decision's own commit, over the events this very transaction chained: the head it
            # computed is what is signed, as for the runs of commits before it (no event read back and hashed again).
            witness = await checkpointer.witness(request.id, patience=0)
            assert witness is not None
        assert read_back == []
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    assert report.pending == 0


def log_reads(monkeypatch: Any) -> list[str]:
    """Every read the writer's transactions make from here (their SQL), in order."""
    from kazma.config.store import writer as writer_module

    reads: list[str] = []
    read_all = writer_module.Tx.all

    def counted(self: Any, sql: str, params: Any = ()) -> list[Any]:
        reads.append(sql)
        return read_all(self, sql, params)

    monkeypatch.setattr(writer_module.Tx, "all", counted)
    return reads


async def decided_with_its_witness(
    service: ApprovalService, checkpointer: Checkpointer, request_id: str, reads: list[str]
) -> int:
    """Decide ``request_id``; its witness is known from the decision's own commit (what witness() hands out with
    no read or pass) and holds the decision. Returns the reads of the log the decision's transaction made."""
    reads.clear()
    assert (await service.decide(request_id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
    log_read = len([sql for sql in reads if "approval_events" in sql])
    witness = checkpointer._witnessed.get(request_id)
    assert witness is not None
    assert witness == await service.store.witness(request_id)
    [decided] = await service.store.events(request_id, event="decided")
    assert witness.first_seq <= decided.seq <= witness.seq
    return log_read


async def test_a_decisions_own_commit_knows_its_witness_without_reading_where_its_decision_is(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Every event the decision's transaction appended is in the checkpoint signed at its end: which checkpoint holds
    the decision needs no read of the log (it took one statement in every decision's commit that signed)."""
    reads = log_reads(monkeypatch)
    async with running(tmp_path / "k.db") as (service, checkpointer):
        requests = [await service.open("shell", {"n": n}, "agent:builder", "telegram:-100") for n in range(2)]
        await idle(service, checkpointer)
        for request in requests:
            assert await decided_with_its_witness(service, checkpointer, request.id, reads) == 0
        events, checkpoints = await whole_log(service)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]


async def test_without_the_transactions_run_the_decisions_own_commit_reads_where_its_decision_is(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """When the chain cannot say which events the transaction appended, the pass reads where each decision's event
    is: the witness is the same checkpoint."""
    from kazma.approvals.chain import AuditChain

    reads = log_reads(monkeypatch)
    monkeypatch.setattr(AuditChain, "appended_in", lambda self, tx: None)
    async with running(tmp_path / "k.db") as (service, checkpointer):
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await idle(service, checkpointer)
        assert await decided_with_its_witness(service, checkpointer, request.id, reads) == 1
