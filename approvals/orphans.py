"""Orphans a start found: fenced at once, cancelled in batches once Kazma serves.

A pending request whose waiter died with an earlier process must never be
approved by one of its stale buttons (invariant 13). Cancelling thousands of
them one commit each held start-up for seconds, so the start only reads which
they are (:meth:`Orphans.find`, one query of their ids, not their rows: 10,000
whole rows cost a fifth of a second of CPU) and puts them behind the service's
gate: from that moment a press on one ends it first (:meth:`Orphans.ended`),
and is then judged against the ended request like any late press. Their
cancelling (rows, audit, cards) runs after the start in batches that group
commit writes together (:meth:`Orphans.cancel_all`), each batch's cards edited
as it commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from itertools import islice

import structlog

from kazma.approvals.model import ApprovalRequest, Status
from kazma.approvals.service import REPLICA_GONE, RESTARTED, ApprovalService
from kazma.approvals.withdrawal import Gone, withdrawn
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_decided, count_failure
from kazma.config.store.errors import store_errors

log = structlog.get_logger("kazma.approvals")

BATCH = 200  # cancellations written together: one group commit each, and the presses in between wait little
RETRY = Backoff(base=0.5, cap=30.0)  # a batch the store refused is tried again


class Orphans:
    """The orphans one start found, oldest first, until each is cancelled (here, or by a press or a sweep)."""

    def __init__(
        self, service: ApprovalService, requests: list[tuple[str, bool]], live: Collection[str] | None = None
    ) -> None:
        self.service = service
        self._live = live  # None: the only process on its store; else the replicas alive (this one's past life not)
        # id -> whether an open /mcp call held it (its reason differs), oldest first
        self._waiting = dict(requests)
        self.cancelled: list[ApprovalRequest] = []  # what this start cancelled: the conversations are told

    @classmethod
    async def find(cls, service: ApprovalService, live: Collection[str] | None = None) -> Orphans:
        """Every pending request of a process that is gone: on a store of its own, all of them; among replicas
        (``live``: every replica but this one), what this replica's previous life left. Only their ids are
        read: each one's row is read as it is cancelled."""
        return cls(service, await service.store.orphan_ids(live), live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    async def ended(self, request_id: str) -> bool:
        """A press on ``request_id`` may be judged: it is no orphan of this start, or it is one and has ended
        (now, here, with its cards settled). False when the store could not end it: the press is refused."""
        connection = self._waiting.get(request_id)
        if connection is None:
            return True
        if not await self._cancel(request_id, connection):
            return False
        if self.service.publisher is not None:
            await self.service.publisher.settle(request_id)
        return True

    async def cancel_all(self, *, batch: int = BATCH, committed: Callable[[], Awaitable[None] | None]) -> None:
        """Cancel every orphan still waiting, ``batch`` at a time; ``committed`` is called after each batch
        (the bus edits the cards of what ended). A batch the store refused is tried again until it ends."""
        failures = 0
        while self._waiting:
            chunk = list(islice(self._waiting.items(), batch))
            results = await asyncio.gather(*(self._cancel(rid, connection) for rid, connection in chunk))
            done = committed()
            if done is not None:
                await done
            if all(results):
                failures = 0
                continue
            failures += 1
            await asyncio.sleep(RETRY.delay(failures - 1))

    async def _cancel(self, request_id: str, connection: bool) -> bool:
        # an /mcp call's connection died with that process: its request is withdrawn, nobody denied it
        # (the reasons ApprovalService.recover gives, alone or among replicas)
        if connection:
            reason = withdrawn(Gone.RESTARTED if self._live is None else Gone.REPLICA_STOPPED)
        else:
            reason = RESTARTED if self._live is None else REPLICA_GONE
        try:
            won, after = await self.service.store.finish(
                request_id, Status.CANCELLED, actor=None, platform=None, reason=reason
            )
        except store_errors() as exc:  # still fenced: a press is refused, and the next batch tries again
            count_failure("approval_recovery")
            log.warning("approvals.orphan_cancel_failed", request_id=request_id, error=str(exc))
            return False
        self._waiting.pop(request_id, None)
        if won and after is not None:
            count_decided("cancelled", "", "")
            log.warning("approvals.orphan_cancelled", request_id=request_id, tool=after.tool)
            self.cancelled.append(after)
        return True
