"""Inbound events claimed once across replicas: the store side of ``Handlers.claim_inbound``.

A platform may deliver one event twice, to different replicas: Telegram hands
an update that was fetched but not confirmed to whoever polls next (a new
leader after the old one died), and Slack retries an event whose
acknowledgement was late, through the load balancer to any replica. Before an
adapter delivers an event it inserts the event's key here; the insert that
wins handles it, every later one is told no. The insert is one statement
(``ON CONFLICT DO NOTHING``) on either backend, so two replicas racing for one
key get one winner from the database itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import aiosqlite
import structlog

from kazma.config import failpoints
from kazma.config.store.backend import StoreBackend, Tx, backend_of
from kazma.config.store.database import Migration
from kazma.config.store.errors import simulated_failure
from kazma.config.store.pg_schema import PgMigration

log = structlog.get_logger("kazma.inbound")

# Keys of events this process let through, remembered so that one is never let through twice here.
_HANDLING_LIMIT: Final = 50_000

# How long a claim is kept. A day covers every redelivery: Telegram keeps an unconfirmed update for
# 24 hours at most, Slack retries an event three times within minutes, and a Discord interaction
# token lives 15 minutes. A key older than that cannot come back, so its claim can go.
RETENTION_SECONDS: Final = 24 * 60 * 60

MIGRATIONS: Final = [
    Migration(
        "inbound_claims",
        1,
        (
            """CREATE TABLE IF NOT EXISTS inbound_claims (
                platform TEXT NOT NULL,
                event_key TEXT NOT NULL,
                claimed_at REAL NOT NULL,
                replica TEXT NOT NULL,
                PRIMARY KEY (platform, event_key)
            )""",
            # retention deletes by age
            "CREATE INDEX IF NOT EXISTS inbound_claims_age ON inbound_claims (claimed_at)",
        ),
    ),
    Migration(
        "inbound_claims",
        2,
        (
            # When the claimer had taken the event in (a message handed to its conversation, a press decided):
            # a claim without it, held by a replica that is gone, is taken over; the event is lost otherwise.
            "ALTER TABLE inbound_claims ADD COLUMN done_at REAL",
            # The event itself, kept by a poller before it confirms the event to the platform (the inbox):
            # an event confirmed and never taken in is handed to the next leader from here.
            "ALTER TABLE inbound_claims ADD COLUMN payload TEXT",
        ),
    ),
]

PG_MIGRATIONS: Final = [
    PgMigration(
        "inbound_claims",
        1,
        (
            """CREATE TABLE IF NOT EXISTS inbound_claims (
                platform text NOT NULL,
                event_key text NOT NULL,
                claimed_at double precision NOT NULL,
                replica text NOT NULL,
                PRIMARY KEY (platform, event_key)
            )""",
            "CREATE INDEX IF NOT EXISTS inbound_claims_age ON inbound_claims (claimed_at)",
        ),
    ),
    PgMigration(
        "inbound_claims",
        2,
        (
            "ALTER TABLE inbound_claims ADD COLUMN done_at double precision",
            "ALTER TABLE inbound_claims ADD COLUMN payload text",
        ),
    ),
]

_SIGNED: Final = (
    "INSERT INTO inbound_claims (platform, event_key, claimed_at, replica, done_at) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)
_CLAIM: Final = (
    "INSERT INTO inbound_claims (platform, event_key, claimed_at, replica, payload) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)


class InboundClaims:
    """Claims of one replica (``replica`` names it in the rows, for whoever reads them after an incident)."""

    def __init__(
        self,
        conn: aiosqlite.Connection | StoreBackend,
        *,
        replica: str,
        clock: Callable[[], float] = time.time,
        live: Callable[[], Awaitable[set[str]]] | None = None,
    ) -> None:
        self.tables = backend_of(conn)
        self.replica = replica
        self.clock = clock
        # The replicas alive now: a claim a gone replica never finished is taken over (None: never).
        self.live = live
        # Events this process has let through: one it fetched itself (its own claim) is let through once.
        self._handling: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def claim(self, platform: str, key: str, payload: str | None = None, /) -> bool:
        """True when this call recorded the claim (handle the event here); False when it was claimed before.

        Through the store's group-committing writer (what ``Tables.run`` does with a writer attached), on
        either backend: answered once the commit holding the claim is durable. A claim held by a replica
        that is gone and that never took the event in (see :meth:`done`) is taken over: the platform
        delivered the event again because that replica never confirmed it, and nobody else will handle it.

        ``payload``: the event, kept in the same row (one statement: no claim without it) where the platform
        never delivers it again (Discord's gateway): the leader after this one hands it over from the row
        (:meth:`unfinished`) when this replica dies before taking it in. Cleared once taken in (:meth:`done`).
        """
        row = (platform, key, self.clock(), self.replica, payload)
        writer = await self.tables.writer()
        inserted = await writer.submit(lambda tx: tx.run(_CLAIM, row))
        if inserted == 1:
            if failpoints.armed:  # claimed and committed, not handled yet
                await failpoints.reached("inbound.claim", lambda: simulated_failure(self.tables, "claim"))
            return self._let_through(platform, key)
        held = await self.tables.one(
            "SELECT replica FROM inbound_claims WHERE platform = ? AND event_key = ? AND done_at IS NULL",
            (platform, key),
        )
        if held is None:
            return False
        if held[0] == self.replica:  # this replica's poller kept it (see fetched): let it through once
            return (platform, key) not in self._handling and self._let_through(platform, key)
        if self.live is None or held[0] in await self.live():
            return False
        if await self._take_over(platform, key, str(held[0])):
            return self._let_through(platform, key)
        return False

    def _let_through(self, platform: str, key: str) -> bool:
        self._handling[(platform, key)] = None
        while len(self._handling) > _HANDLING_LIMIT:
            self._handling.popitem(last=False)
        return True

    async def _take_over(self, platform: str, key: str, gone: str) -> bool:
        writer = await self.tables.writer()
        taken = await writer.submit(
            lambda tx: tx.run(
                "UPDATE inbound_claims SET replica = ?, claimed_at = ? WHERE platform = ? AND event_key = ?"
                " AND replica = ? AND done_at IS NULL",
                (self.replica, self.clock(), platform, key, gone),
            )
        )
        if taken == 1:
            log.warning("inbound.claim_taken_over", platform=platform, key=key, gone=gone)
        return taken == 1

    async def fetched(self, platform: str, events: Sequence[tuple[str, str]]) -> None:
        """Keep ``events`` ((key, payload) each) before the platform is told they arrived (the inbox).

        A poller calls this with what it fetched, before it confirms it: an event confirmed and then lost
        with this replica is handed to the next leader by :meth:`unfinished`. One another replica claimed
        already keeps its claim (the kit's :meth:`claim` decides who handles it).
        """
        if not events:
            return
        now = self.clock()
        rows = [(platform, key, now, self.replica, payload) for key, payload in events]
        writer = await self.tables.writer()
        await writer.submit(
            lambda tx: tx.run_many(
                "INSERT INTO inbound_claims (platform, event_key, claimed_at, replica, payload)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                rows,
            )
        )

    async def release_unhandled(self, platform: str) -> int:
        """This replica stops polling: what its poller kept and never let through goes back to the platform.

        The platform delivers those again to whoever polls next (it was never confirmed, or it was fetched by
        the poller's last call and dropped by the library on its way out); a claim left here, held by a
        replica that is alive, would refuse it there. How many were released.
        """
        rows = await self.tables.all(
            "SELECT event_key FROM inbound_claims WHERE platform = ? AND replica = ? AND done_at IS NULL"
            " AND payload IS NOT NULL",
            (platform, self.replica),
        )
        keys = [str(r[0]) for r in rows if (platform, str(r[0])) not in self._handling]
        if not keys:
            return 0
        writer = await self.tables.writer()
        await writer.submit(
            lambda tx: tx.run_many(
                "DELETE FROM inbound_claims WHERE platform = ? AND event_key = ? AND replica = ? AND done_at IS NULL",
                [(platform, key, self.replica) for key in keys],
            )
        )
        log.info("inbound.unhandled_released", platform=platform, events=len(keys))
        return len(keys)

    async def unfinished(self, platform: str) -> list[str]:
        """The payloads of events kept by a poller and never taken in, by a replica that is gone (or by this
        one's previous life), now claimed by this one: a new leader hands them to its handlers first."""
        rows = await self.tables.all(
            "SELECT event_key, replica, payload FROM inbound_claims"
            " WHERE platform = ? AND done_at IS NULL AND payload IS NOT NULL ORDER BY claimed_at",
            (platform,),
        )
        if not rows:
            return []
        live = set() if self.live is None else await self.live()
        found: list[str] = []
        for key, holder, payload in rows:
            if holder == self.replica:
                if (platform, str(key)) not in self._handling:
                    found.append(str(payload))
            elif holder not in live and await self._take_over(platform, str(key), str(holder)):
                found.append(str(payload))
        return found

    async def done(self, platform: str, key: str) -> bool:
        """The event is taken in here (a message handed to its conversation, a press decided): no replica
        takes the claim over any more, even once this one is gone. The event kept with it is dropped (it was
        kept only to be handed over; the conversation keeps what it keeps).

        False when the claim is another replica's now: this one was counted gone (its lease session dropped)
        and the leader took the claim over, so the leader hands the event over and this replica must not.
        One compare-and-set decides, so exactly one replica hands each kept event over.
        """
        writer = await self.tables.writer()
        marked = await writer.submit(
            lambda tx: tx.run(
                "UPDATE inbound_claims SET done_at = ?, payload = NULL"
                " WHERE platform = ? AND event_key = ? AND replica = ?",
                (self.clock(), platform, key, self.replica),
            )
        )
        if marked:
            return True
        holder = await self.holder(platform, key)  # none: never claimed (a claim that failed is let through)
        if holder is None or holder == self.replica:
            return True
        log.warning("inbound.claim_lost", platform=platform, key=key, holder=holder)
        return False

    async def first_signed(self, platform: str, keys: Sequence[str]) -> bool:
        """True when none of ``keys`` of one signed request was recorded before (each is recorded now).

        Kept as claims of ``<platform>:signed``, already taken in: never an inbox entry, never taken over,
        and gone with the day's retention like every claim (a signature is refused after five minutes).
        """
        writer = await self.tables.writer()
        return await writer.submit(self.first_signed_op(platform, keys))

    def first_signed_op(self, platform: str, keys: Sequence[str]) -> Callable[[Tx], bool]:
        """:meth:`first_signed` as an operation of a transaction (a press's decision: it is recorded in that
        commit, and the press decides nothing when this says False)."""
        now = self.clock()
        rows = [(f"{platform}:signed", key, now, self.replica, now) for key in keys]

        def op(tx: Tx) -> bool:
            return sum(tx.run(_SIGNED, row) for row in rows) == len(rows)

        return op

    async def forget_older_than(self, seconds: float = RETENTION_SECONDS) -> int:
        """Drop claims older than ``seconds`` (a day by default, see :data:`RETENTION_SECONDS`); how many."""
        cutoff = self.clock() - seconds
        writer = await self.tables.writer()
        return await writer.submit(lambda tx: tx.run("DELETE FROM inbound_claims WHERE claimed_at < ?", (cutoff,)))

    async def holder(self, platform: str, key: str) -> str | None:
        """The replica that claimed ``key``, or None when nobody has (doctor, tests)."""
        row = await self.tables.one(
            "SELECT replica FROM inbound_claims WHERE platform = ? AND event_key = ?", (platform, key)
        )
        return None if row is None else str(row[0])
