"""The one-decision store: rows of approval requests, their audit trail and their posted cards.

Every outcome is written by one compare-and-set (``UPDATE … WHERE status =
'pending'``); whoever's statement changes the row decided it, and a trigger
refuses any later change. The audit trail is append-only (triggers again).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiosqlite

from kazma.approvals.model import ApprovalRequest, Status
from kazma.config.database import Statements, Tables

Clock = Callable[[], float]

_COLUMNS = (
    "id, tool, args_json, args_hash, requested_by, conversation, task_id, created_at, deadline, "
    "status, decided_by, decided_via, decided_at, reason, notes, durable"
)


_CAS = (
    "UPDATE approval_requests SET status = ?, decided_by = ?, decided_via = ?, decided_at = ?, reason = ?"
    " WHERE id = ? AND status = 'pending'"
)
_CAS_BEFORE_DEADLINE = _CAS + " AND deadline > ?"


def new_request_id() -> str:
    """144 random bits, URL-safe, 24 characters: ``kz1:<id>:a`` is 30 bytes."""
    return secrets.token_urlsafe(18)


def ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _row_to_request(row: Iterable[Any]) -> ApprovalRequest:
    (
        rid,
        tool,
        args_json,
        args_hash,
        requested_by,
        conversation,
        task_id,
        created,
        deadline,
        status,
        by,
        via,
        at,
        why,
        notes,
        durable,
    ) = tuple(row)
    return ApprovalRequest(
        id=rid,
        tool=tool,
        args=json.loads(args_json),
        args_json=args_json,
        args_hash=args_hash,
        requested_by=requested_by,
        conversation=conversation,
        created_at=datetime.fromtimestamp(created, UTC),
        deadline=datetime.fromtimestamp(deadline, UTC),
        status=Status(status),
        task_id=task_id,
        decided_by=by,
        decided_via=via,
        decided_at=ts(at),
        reason=why,
        notes=tuple(str(n) for n in json.loads(notes or "[]")),
        durable=bool(durable),
    )


@dataclass(frozen=True)
class AuditEvent:
    seq: int
    request_id: str | None
    event: str
    actor: str | None
    platform: str | None
    at: datetime
    args_hash: str | None
    detail: str | None


@dataclass(frozen=True)
class PostedCard:
    request_id: str
    platform: str
    chat: str
    message_id: str
    posted_at: datetime
    settled_at: datetime | None
    settled_status: str | None
    whole: bool = True  # the card showed the whole call


class ApprovalStore:
    """Data access for approvals on one aiosqlite connection.

    The connection is shared by every coroutine of the process, so every
    statement goes through :class:`~kazma.config.database.Tables`.
    """

    def __init__(self, conn: aiosqlite.Connection, *, clock: Clock = time.time) -> None:
        self.conn = conn
        self.clock = clock
        self.tables = Tables.of(conn)

    @staticmethod
    async def _hash_of(tx: Statements, request_id: str) -> str | None:
        row = await tx.one("SELECT args_hash FROM approval_requests WHERE id = ?", (request_id,))
        return None if row is None else str(row[0])

    async def insert(
        self,
        *,
        tool: str,
        args_json: str,
        args_hash: str,
        requested_by: str,
        conversation: str,
        deadline: float,
        task_id: str | None,
        notes: tuple[str, ...] = (),
        durable: bool = False,
    ) -> ApprovalRequest:
        request_id = new_request_id()
        now = self.clock()
        async with self.tables.transaction() as tx:
            await tx.run(
                "INSERT INTO approval_requests (id, tool, args_json, args_hash, requested_by, conversation, task_id,"
                " created_at, deadline, status, notes, durable) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                (
                    request_id,
                    tool,
                    args_json,
                    args_hash,
                    requested_by,
                    conversation,
                    task_id,
                    now,
                    deadline,
                    json.dumps(list(notes)),
                    int(durable),
                ),
            )
            await self._event(tx, request_id, "opened", requested_by, None, args_hash, f"tool={tool}")
        found = await self.get(request_id)
        assert found is not None
        return found

    async def get(self, request_id: str) -> ApprovalRequest | None:
        row = await self.tables.one(f"SELECT {_COLUMNS} FROM approval_requests WHERE id = ?", (request_id,))  # noqa: S608
        return None if row is None else _row_to_request(row)

    async def requests(self, *, pending_only: bool = False, limit: int = 100) -> list[ApprovalRequest]:
        where = "WHERE status = 'pending'" if pending_only else ""
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM approval_requests {where} ORDER BY created_at DESC LIMIT ?",  # noqa: S608
            (limit,),
        )
        return [_row_to_request(row) for row in rows]

    async def finish(
        self,
        request_id: str,
        status: Status,
        *,
        actor: str | None,
        platform: str | None,
        reason: str | None = None,
        require_before_deadline: bool = False,
        lost_event: str | None = None,
    ) -> tuple[bool, ApprovalRequest | None]:
        """The compare-and-set, in one transaction with its audit row.

        Returns whether this call moved the row out of ``pending``, and the row as
        it stands after the call (None for an unknown id). With ``lost_event``, a
        call that did not win is audited under that name in the same transaction.
        """
        now = self.clock()
        params: tuple[Any, ...] = (status.value, actor, platform, now, reason, request_id)
        sql = _CAS
        if require_before_deadline:
            sql, params = _CAS_BEFORE_DEADLINE, (*params, now)
        async with self.tables.transaction() as tx:
            won = await tx.run(sql, params) == 1
            row = await tx.one(f"SELECT {_COLUMNS} FROM approval_requests WHERE id = ?", (request_id,))  # noqa: S608
            request = None if row is None else _row_to_request(row)
            args_hash = None if request is None else request.args_hash
            if won:
                event = "decided" if status.human else status.value
                await self._event(tx, request_id, event, actor, platform, args_hash, reason)
            elif lost_event is not None and request is not None:
                standing = request.status.value if request.status.final else "pending past its deadline"
                await self._event(tx, request_id, lost_event, actor, platform, args_hash, f"standing: {standing}")
        return won, request

    async def audit(
        self,
        request_id: str | None,
        event: str,
        *,
        actor: str | None = None,
        platform: str | None = None,
        detail: str | None = None,
    ) -> None:
        async with self.tables.transaction() as tx:
            args_hash = None if request_id is None else await self._hash_of(tx, request_id)
            await self._event(tx, request_id, event, actor, platform, args_hash, detail)

    async def _event(
        self,
        tx: Statements,
        request_id: str | None,
        event: str,
        actor: str | None,
        platform: str | None,
        args_hash: str | None,
        detail: str | None,
    ) -> None:
        await tx.run(
            "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (request_id, event, actor, platform, self.clock(), args_hash, detail),
        )

    async def events(self, request_id: str | None = None, *, event: str | None = None) -> list[AuditEvent]:
        clauses, params = [], []
        if request_id is not None:
            clauses.append("request_id = ?")
            params.append(request_id)
        if event is not None:
            clauses.append("event = ?")
            params.append(event)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self.tables.all(
            "SELECT seq, request_id, event, actor, platform, at, args_hash, detail FROM approval_events "  # noqa: S608
            f"{where} ORDER BY seq",
            params,
        )
        return [AuditEvent(r[0], r[1], r[2], r[3], r[4], datetime.fromtimestamp(r[5], UTC), r[6], r[7]) for r in rows]

    async def approved_not_started(self) -> list[ApprovalRequest]:
        """Approved requests with no ``execution_started`` (nor an ``execution_lost`` already reported)."""
        # Only requests decided since executions are recorded (approvals schema v3): older ones ran, or not,
        # before anyone wrote it down, and must not all be reported after an upgrade.
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM approval_requests r WHERE r.status = 'approved' AND r.durable = 0"  # noqa: S608
            " AND r.decided_at >= COALESCE((SELECT applied_at FROM kazma_schema"
            " WHERE component = 'approvals' AND version = 3), 0)"
            " AND NOT EXISTS (SELECT 1 FROM approval_events e WHERE e.request_id = r.id"
            " AND e.event IN ('execution_started', 'execution_lost', 'execution_refused'))"
            " ORDER BY r.decided_at"
        )
        return [_row_to_request(row) for row in rows]

    async def overdue(self) -> list[str]:
        rows = await self.tables.all(
            "SELECT id FROM approval_requests WHERE status = 'pending' AND deadline <= ?", (self.clock(),)
        )
        return [str(r[0]) for r in rows]

    async def record_card(
        self, request_id: str, platform: str, chat: str, message_id: str, *, whole: bool = True
    ) -> None:
        async with self.tables.transaction() as tx:
            await tx.run(
                "INSERT OR IGNORE INTO approval_cards (request_id, platform, chat, message_id, posted_at, whole)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (request_id, platform, chat, message_id, self.clock(), int(whole)),
            )
            await self._event(
                tx,
                request_id,
                "card_posted",
                None,
                platform,
                await self._hash_of(tx, request_id),
                f"{chat}/{message_id}" + ("" if whole else " (not the whole call)"),
            )

    async def cards(self, request_id: str) -> list[PostedCard]:
        rows = await self.tables.all(
            "SELECT request_id, platform, chat, message_id, posted_at, settled_at, settled_status, whole"
            " FROM approval_cards WHERE request_id = ? ORDER BY posted_at",
            (request_id,),
        )
        return [_card(r) for r in rows]

    async def unsettled_cards(self) -> list[PostedCard]:
        """Cards of requests that have an outcome but still show buttons."""
        rows = await self.tables.all(
            "SELECT c.request_id, c.platform, c.chat, c.message_id, c.posted_at, c.settled_at, c.settled_status,"
            " c.whole"
            " FROM approval_cards c JOIN approval_requests r ON r.id = c.request_id"
            " WHERE c.settled_at IS NULL AND r.status != 'pending' ORDER BY r.decided_at"
        )
        return [_card(r) for r in rows]

    async def mark_card_settled(self, card: PostedCard, status: Status) -> None:
        async with self.tables.transaction() as tx:
            settled = (
                await tx.run(
                    "UPDATE approval_cards SET settled_at = ?, settled_status = ?"
                    " WHERE request_id = ? AND platform = ? AND chat = ? AND message_id = ? AND settled_at IS NULL",
                    (self.clock(), status.value, card.request_id, card.platform, card.chat, card.message_id),
                )
                == 1
            )
            if settled:
                await self._event(
                    tx,
                    card.request_id,
                    "card_settled",
                    None,
                    card.platform,
                    await self._hash_of(tx, card.request_id),
                    f"{card.chat}/{card.message_id} -> {status.value}",
                )


def _card(row: Iterable[Any]) -> PostedCard:
    request_id, platform, chat, message_id, posted, settled, status, whole = tuple(row)
    return PostedCard(
        request_id, platform, chat, message_id, datetime.fromtimestamp(posted, UTC), ts(settled), status, bool(whole)
    )
