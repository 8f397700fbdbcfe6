"""A checkpoint pass on PostgreSQL sent on a guess (approvals PG migration 18): while a process's chain guesses hold,
its pass signs the head it last committed after the checkpoint it last wrote, asking nothing, so a pass riding with
a press goes with it as one string from the loop. Every way the guess can be wrong (another replica appended, or
signed, since) must end as the pass would have ended unguessed: one chain, every checkpoint where a pass that read
the head would have put it, nothing signed twice."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.bot.store import pg_migrations
from kazma.config.store.postgres import PgStore, PgWriter, open_pg_store
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

Replica = tuple[ApprovalService, PgWriter, Checkpointer]


@contextlib.asynccontextmanager
async def replicas(dsn: str, count: int) -> AsyncIterator[list[Replica]]:
    async with contextlib.AsyncExitStack() as stack:
        made = []
        for n in range(count):
            backend: PgStore = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"ckpt{n}")
            stack.push_async_callback(backend.close)
            store = ApprovalStore(backend, keyring=TEST_KEYRING, audit=TEST_SIGNER)
            made.append(
                (ApprovalService(store, approvals_config()), await backend.writer(), Checkpointer(store, TEST_SIGNER))
            )
        yield made


async def decided(service: ApprovalService, n: int) -> str:
    request = await service.open("shell", {"n": n}, "agent:builder", "telegram:-100")
    assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
    return request.id


async def checked(service: ApprovalService) -> tuple[int, list[tuple[int, int]]]:
    """The log verified: its last seq, and each checkpoint's (first seq, seq) in order."""
    events = await service.store.chain_events(limit=10_000)
    checkpoints = await service.store.chain_checkpoints(limit=10_000)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    return events[-1].seq, sorted((c.first_seq, c.seq) for c in checkpoints)


async def test_a_pass_riding_with_a_press_goes_with_it_as_one_string_from_the_loop(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 1) as [(service, writer, checkpointer)]:
        await decided(service, 0)
        await checkpointer.sign()  # the first pass asks: no checkpoint of this process's yet
        await decided(service, 1)
        request = await service.open("shell", {"n": 2}, "agent:builder", "telegram:-100")
        groups, from_loop, retries = writer.groups, writer.sent_from_loop, writer.pipeline_retries
        riding = asyncio.create_task(checkpointer.sign(ride=60.0))
        while not writer.riders:  # the pass waits to ride (a minute: only the press below takes it along)
            await asyncio.sleep(0)
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        judged = await riding
        # One group, the press and the pass, sent from the loop as one string; no guess was stale.
        assert (writer.groups, writer.sent_from_loop, writer.pipeline_retries) == (groups + 1, from_loop + 1, retries)
        assert len(judged.signed) == 1
        # It signed what was committed before its group: its press's events come after, for the next pass.
        assert judged.signed[0].seq < (await service.store.chain_events(limit=10_000))[-1].seq
        retries = writer.pipeline_retries
        final = await checkpointer.sign()  # alone, on the guess too
        assert writer.pipeline_retries == retries
        last, signed = await checked(service)
    assert final.signed[-1].seq == last
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(signed))  # no seq signed twice, none skipped


async def test_a_pass_guessing_after_another_replica_appended_signs_that_replicas_events_too(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 2) as [(first, writer, checkpointer), (other, _, _)]:
        await decided(first, 0)
        await checkpointer.sign()
        await decided(first, 1)  # the first replica's guesses hold: its next pass would guess its own head
        await decided(other, 2)  # ... which another replica appended after
        retries = writer.pipeline_retries
        judged = await checkpointer.sign()
        assert writer.pipeline_retries == retries + 1  # the guess was stale: the pass ran again, asking
        last, signed = await checked(first)
    assert judged.signed[-1].seq == last  # through the other replica's events, not only up to its own head
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(signed))  # no seq signed twice


async def test_a_pass_guessing_after_another_replica_signed_signs_nothing_twice(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 2) as [(first, writer, checkpointer), (_, _, other_checkpointer)]:
        await decided(first, 0)
        await checkpointer.sign()
        await decided(first, 1)
        await other_checkpointer.sign()  # another replica signs the first one's head
        retries = writer.pipeline_retries
        judged = await checkpointer.sign()
        assert writer.pipeline_retries == retries + 1  # the guess was stale: the pass ran again, asking
        last, signed = await checked(first)
    assert judged.signed == []  # the other replica signed it all
    assert signed[-1][1] == last
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(signed))  # no seq signed twice
