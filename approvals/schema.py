"""Tables of the approvals store. Additive only; triggers keep decisions final and the audit append-only."""

from __future__ import annotations

from kazma.config.database import Migration

MIGRATIONS = [
    Migration(
        "approvals",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS approval_requests (
                id TEXT PRIMARY KEY,
                tool TEXT NOT NULL,
                args_json TEXT NOT NULL,
                args_hash TEXT NOT NULL,
                requested_by TEXT NOT NULL,
                conversation TEXT NOT NULL,
                task_id TEXT,
                created_at REAL NOT NULL,
                deadline REAL NOT NULL,
                status TEXT NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'approved', 'denied', 'timeout', 'cancelled')),
                decided_by TEXT,
                decided_via TEXT,
                decided_at REAL,
                reason TEXT
            )
            """,
            "CREATE INDEX IF NOT EXISTS approval_requests_pending ON approval_requests (status, deadline)",
            """
            CREATE TABLE IF NOT EXISTS approval_events (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                request_id TEXT,
                event TEXT NOT NULL,
                actor TEXT,
                platform TEXT,
                at REAL NOT NULL,
                args_hash TEXT,
                detail TEXT
            )
            """,
            "CREATE INDEX IF NOT EXISTS approval_events_request ON approval_events (request_id, seq)",
            """
            CREATE TRIGGER IF NOT EXISTS approval_events_append_only_update
            BEFORE UPDATE ON approval_events
            BEGIN SELECT RAISE(ABORT, 'approval_events is append-only'); END
            """,
            """
            CREATE TRIGGER IF NOT EXISTS approval_events_append_only_delete
            BEFORE DELETE ON approval_events
            BEGIN SELECT RAISE(ABORT, 'approval_events is append-only'); END
            """,
            """
            CREATE TRIGGER IF NOT EXISTS approval_requests_final
            BEFORE UPDATE OF status, decided_by, decided_via, decided_at ON approval_requests
            WHEN OLD.status != 'pending'
            BEGIN SELECT RAISE(ABORT, 'approval outcomes are final'); END
            """,
            """
            CREATE TABLE IF NOT EXISTS approval_cards (
                request_id TEXT NOT NULL REFERENCES approval_requests (id),
                platform TEXT NOT NULL,
                chat TEXT NOT NULL,
                message_id TEXT NOT NULL,
                posted_at REAL NOT NULL,
                settled_at REAL,
                settled_status TEXT,
                PRIMARY KEY (request_id, platform, chat, message_id)
            )
            """,
            "CREATE INDEX IF NOT EXISTS approval_cards_unsettled ON approval_cards (settled_at, request_id)",
        ),
    ),
    Migration(
        "approvals",
        2,
        # Whether the posted card showed the whole call: an Approve pressed on a card that did not is refused.
        ("ALTER TABLE approval_cards ADD COLUMN whole INTEGER NOT NULL DEFAULT 1",),
    ),
    Migration(
        "approvals",
        3,
        (
            # How the call would run, said on its cards; JSON list of sentences.
            "ALTER TABLE approval_requests ADD COLUMN notes TEXT NOT NULL DEFAULT '[]'",
            # 1: its waiter survives a restart (a paused pipeline's checkpoint), so it is never an orphan.
            "ALTER TABLE approval_requests ADD COLUMN durable INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    Migration(
        "approvals",
        4,
        (
            # A card edit that failed waits in its row until retry_at, so a scan need not even read it.
            "ALTER TABLE approval_cards ADD COLUMN retry_at REAL",
            "ALTER TABLE approval_cards ADD COLUMN settle_attempts INTEGER NOT NULL DEFAULT 0",
            # Only cards still showing buttons, per platform: the settle scan's index, small as work is done.
            "CREATE INDEX IF NOT EXISTS approval_cards_to_settle ON approval_cards (platform, retry_at)"
            " WHERE settled_at IS NULL",
            # Replaced by the one above; its (settled_at, request_id) entries grew with every card ever posted.
            "DROP INDEX IF EXISTS approval_cards_unsettled",
        ),
    ),
]
