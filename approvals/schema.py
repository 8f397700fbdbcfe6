"""Tables of the approvals store, on SQLite and on PostgreSQL. Additive only; triggers keep decisions final
and the audit append-only (what proves it was not rewritten around Kazma is the chain: approvals/chain.py)."""

from __future__ import annotations

from kazma.approvals.pg_press import (
    PG_AUDIT_APPEND_FUNCTION,
    PG_AUDIT_CHECKPOINT_FUNCTION,
    PG_AUDIT_LINK_FUNCTION,
    PG_AUDIT_STALE_GUESS_FUNCTION,
    PG_PRESS_FUNCTION,
    PG_PRESS_GUESSED_FUNCTION,
    PG_PRESS_ON_GUESS_FUNCTION,
)
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

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
    Migration(
        "approvals",
        5,
        (
            # Pending rows only: a decision removes one entry instead of moving it inside a (status, deadline)
            # index that held every request ever made (a page less in each decision's commit). The deadline
            # sweep and the pending list read it; the compare-and-set goes by the primary key.
            "CREATE INDEX IF NOT EXISTS approval_requests_open ON approval_requests (deadline)"
            " WHERE status = 'pending'",
            "DROP INDEX IF EXISTS approval_requests_pending",
        ),
    ),
    Migration(
        "approvals",
        6,
        # The replica whose call waits for the request. With several replicas on one database, a pending
        # request is an orphan only when that replica is gone; NULL (one process) is an orphan at start.
        (
            "ALTER TABLE approval_requests ADD COLUMN owner TEXT",
            # Who holds a card edit's claim (ApprovalStore.claim_settle): released at once when it is gone.
            "ALTER TABLE approval_cards ADD COLUMN settle_claimed_by TEXT",
        ),
    ),
    Migration(
        "approvals",
        7,
        (
            # The outcome's seal (approvals/seal.py): an HMAC by a key the store never holds, and that key's id.
            # Written by the compare-and-set itself; rows decided before stay NULL and can never run.
            "ALTER TABLE approval_requests ADD COLUMN decision_mac TEXT",
            "ALTER TABLE approval_requests ADD COLUMN decision_key_id TEXT",
            # Final with the outcome it seals (the v1 trigger cannot be widened additively: a second one).
            """
            CREATE TRIGGER IF NOT EXISTS approval_requests_seal_final
            BEFORE UPDATE OF decision_mac, decision_key_id ON approval_requests
            WHEN OLD.status != 'pending'
            BEGIN SELECT RAISE(ABORT, 'approval outcomes are final'); END
            """,
        ),
    ),
    Migration(
        "approvals",
        8,
        (
            # How a synchronous asker waits ('connection': an /mcp call held by the request's owner process;
            # 'polling': a process outside Kazma asking again and again); NULL: nobody waits synchronously.
            # Such a request is withdrawn when its asker goes away.
            "ALTER TABLE approval_requests ADD COLUMN waits TEXT"
            " CHECK (waits IS NULL OR waits IN ('connection', 'polling'))",
            # When an API asker last asked for its answer (epoch seconds; written at most every 10 s).
            "ALTER TABLE approval_requests ADD COLUMN last_seen REAL",
        ),
    ),
    Migration(
        "approvals",
        9,
        (
            # The person under people: who owned the identity that decided (decided_by keeps the identity);
            # NULL for an identity that is nobody's and for every decision made before people were recorded.
            # Sealed with the outcome (a "v2:" seal), and final with it.
            "ALTER TABLE approval_requests ADD COLUMN decided_person TEXT",
            """
            CREATE TRIGGER IF NOT EXISTS approval_requests_person_final
            BEFORE UPDATE OF decided_person ON approval_requests
            WHEN OLD.status != 'pending'
            BEGIN SELECT RAISE(ABORT, 'approval outcomes are final'); END
            """,
            # Who an audit row is about, beside the identity in ``actor``.
            "ALTER TABLE approval_events ADD COLUMN person TEXT",
        ),
    ),
    Migration(
        "approvals",
        10,
        (
            # The audit chain (approvals/chain.py): each event's link to the one before it and its own hash.
            # NULL on events written before the chain; the first append after this chains those once.
            "ALTER TABLE approval_events ADD COLUMN prev_hash TEXT",
            "ALTER TABLE approval_events ADD COLUMN chain_hash TEXT",
            # On the last event of each appending transaction: the HMAC that vouches for the events it appended
            # (approvals/checkpoints.py), so that only Kazma's own events are ever signed.
            "ALTER TABLE approval_events ADD COLUMN commit_seal TEXT",
            # Signed heads of the chain (approvals/checkpoints.py): each covers the events first_seq..seq, Kazma's
            # own ('head'), or those there before the chain began, chained once ('history').
            """
            CREATE TABLE IF NOT EXISTS audit_checkpoints (
                seq INTEGER PRIMARY KEY,
                first_seq INTEGER NOT NULL,
                kind TEXT NOT NULL CHECK (kind IN ('history', 'head')),
                head TEXT NOT NULL,
                at REAL NOT NULL,
                key_id TEXT,
                signature TEXT
            )
            """,
            """
            CREATE TRIGGER IF NOT EXISTS audit_checkpoints_append_only_update
            BEFORE UPDATE ON audit_checkpoints
            BEGIN SELECT RAISE(ABORT, 'audit_checkpoints is append-only'); END
            """,
            """
            CREATE TRIGGER IF NOT EXISTS audit_checkpoints_append_only_delete
            BEFORE DELETE ON audit_checkpoints
            BEGIN SELECT RAISE(ABORT, 'audit_checkpoints is append-only'); END
            """,
        ),
    ),
    Migration(
        "approvals",
        11,
        (
            # The policy a request is decided under (approvals.policies; NULL: the default) and what it asked,
            # fixed when it opened: how many distinct people approve or deny it, whether Approve needs a passkey
            # on its page, and who started the work (forbid_requester). Final from the start.
            "ALTER TABLE approval_requests ADD COLUMN policy TEXT",
            "ALTER TABLE approval_requests ADD COLUMN approve_needed INTEGER NOT NULL DEFAULT 1",
            "ALTER TABLE approval_requests ADD COLUMN deny_needed INTEGER NOT NULL DEFAULT 1",
            "ALTER TABLE approval_requests ADD COLUMN step_up INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE approval_requests ADD COLUMN started_by TEXT",
            """
            CREATE TRIGGER IF NOT EXISTS approval_requests_policy_fixed
            BEFORE UPDATE OF policy, approve_needed, deny_needed, step_up, started_by ON approval_requests
            BEGIN SELECT RAISE(ABORT, 'a request keeps the policy it opened under'); END
            """,
            # One review per person per request (the person's name, or the identity when it is nobody's): the
            # same person pressing on two platforms is one review. Written in the transaction of the press;
            # the press that brings a decision's count to its threshold also sets the outcome.
            """
            CREATE TABLE IF NOT EXISTS approval_reviews (
                request_id TEXT NOT NULL REFERENCES approval_requests (id),
                reviewer TEXT NOT NULL,
                actor TEXT NOT NULL,
                platform TEXT NOT NULL,
                decision TEXT NOT NULL CHECK (decision IN ('approve', 'deny')),
                reason TEXT,
                at REAL NOT NULL,
                PRIMARY KEY (request_id, reviewer)
            )
            """,
            """
            CREATE TRIGGER IF NOT EXISTS approval_reviews_append_only_update
            BEFORE UPDATE ON approval_reviews
            BEGIN SELECT RAISE(ABORT, 'approval_reviews is append-only'); END
            """,
            """
            CREATE TRIGGER IF NOT EXISTS approval_reviews_append_only_delete
            BEFORE DELETE ON approval_reviews
            BEGIN SELECT RAISE(ABORT, 'approval_reviews is append-only'); END
            """,
        ),
    ),
    # The person a card in a direct message was sent to (approvals.policies.<name>.to: {dm: …}): a press on it
    # by anyone else decides nothing. NULL: a card in a chat, pressed by whoever may decide.
    Migration("approvals", 12, ("ALTER TABLE approval_cards ADD COLUMN bound_to TEXT",)),
    # PostgreSQL's press and audit append as one statement each (approvals/pg_press.py); nothing on SQLite.
    Migration("approvals", 13, ()),
    # PostgreSQL's press sent on a guess of what it finds (approvals/pg_press.py); nothing on SQLite.
    Migration("approvals", 14, ()),
    # PostgreSQL's audit append inserts its rows by subscript (approvals/pg_press.py); nothing on SQLite.
    Migration("approvals", 15, ()),
    # A card posted again says so (an earlier attempt may have landed unrecorded): its edits keep saying it.
    Migration("approvals", 16, ("ALTER TABLE approval_cards ADD COLUMN reposted INTEGER NOT NULL DEFAULT 0",)),
    # PostgreSQL's guessed press as one function (approvals/pg_press.py); nothing on SQLite.
    Migration("approvals", 17, ()),
    # PostgreSQL's audit append with less server work, kazma_audit_link, and a checkpoint pass sent on a guess
    # (approvals/pg_press.py); nothing on SQLite.
    Migration("approvals", 18, ()),
    # PostgreSQL's guessed audit append as a plain statement, and the function that fails its stale guess
    # (approvals/pg_press.py); nothing on SQLite.
    Migration("approvals", 19, ()),
    # The digest of the tool's definition the card was opened for (engine/tools/registry.py definition_digest;
    # NULL: a tool fixed in Kazma's code, or a request opened before it was recorded): a remembered approval made
    # from the request stands only for that definition.
    Migration("approvals", 20, ("ALTER TABLE approval_requests ADD COLUMN definition_hash TEXT",)),
]

# The same tables on PostgreSQL, version for version: REAL is double precision there (its REAL has 6
# digits, too few for epoch seconds), AUTOINCREMENT an identity column, and each trigger calls a function.
# Errors carry SQLSTATE 23000 (integrity_constraint_violation), psycopg's IntegrityError, as SQLite's do.
_PG_FINAL = """
CREATE OR REPLACE FUNCTION kazma_approval_outcome_final() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'approval outcomes are final' USING ERRCODE = 'integrity_constraint_violation';
END
$$
"""
_PG_APPEND_ONLY = """
CREATE OR REPLACE FUNCTION kazma_approval_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'approval_events is append-only' USING ERRCODE = 'integrity_constraint_violation';
END
$$
"""

_PG_CHECKPOINTS_APPEND_ONLY = """
CREATE OR REPLACE FUNCTION kazma_audit_checkpoints_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_checkpoints is append-only' USING ERRCODE = 'integrity_constraint_violation';
END
$$
"""
# The audit chain's order (approvals/chain.py): the appending transaction takes the lock, waiting as long as it
# takes (its holder is past every row lock of its own transaction and waits for nobody), then reads the head
# with a snapshot taken after the lock (a VOLATILE function's statements each take a fresh one), so it sees
# the previous holder's commit. One round trip, from the moment the lock is held.
_PG_AUDIT_HEAD = """
CREATE OR REPLACE FUNCTION kazma_audit_head(lock_key bigint)
RETURNS TABLE (last_seq bigint, last_hash text, checkpoint_seq bigint) LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('lock_timeout', '0', true);
    PERFORM pg_advisory_xact_lock(lock_key);
    RETURN QUERY SELECT
        (SELECT e.seq FROM approval_events e ORDER BY e.seq DESC LIMIT 1),
        (SELECT e.chain_hash FROM approval_events e ORDER BY e.seq DESC LIMIT 1),
        (SELECT c.seq FROM audit_checkpoints c ORDER BY c.seq DESC LIMIT 1);
END
$$
"""

PG_MIGRATIONS = [
    PgMigration(
        "approvals",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS approval_requests (
                id text PRIMARY KEY,
                tool text NOT NULL,
                args_json text NOT NULL,
                args_hash text NOT NULL,
                requested_by text NOT NULL,
                conversation text NOT NULL,
                task_id text,
                created_at double precision NOT NULL,
                deadline double precision NOT NULL,
                status text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'approved', 'denied', 'timeout', 'cancelled')),
                decided_by text,
                decided_via text,
                decided_at double precision,
                reason text
            )
            """,
            # Pending rows only, in creation order. Not SQLite's (status, deadline): before PostgreSQL has
            # statistics on a new table it rated that index as good as the primary key for the
            # compare-and-set (id = ? AND status = 'pending' AND deadline > ?), and each press scanned every
            # pending row. The deadline sweep reads the pending rows, which are few, through this one.
            "CREATE INDEX IF NOT EXISTS approval_requests_pending ON approval_requests (created_at)"
            " WHERE status = 'pending'",
            """
            CREATE TABLE IF NOT EXISTS approval_events (
                seq bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                request_id text,
                event text NOT NULL,
                actor text,
                platform text,
                at double precision NOT NULL,
                args_hash text,
                detail text
            )
            """,
            "CREATE INDEX IF NOT EXISTS approval_events_request ON approval_events (request_id, seq)",
            _PG_APPEND_ONLY,
            """
            CREATE OR REPLACE TRIGGER approval_events_append_only
            BEFORE UPDATE OR DELETE ON approval_events
            FOR EACH ROW EXECUTE FUNCTION kazma_approval_events_append_only()
            """,
            # SQLite has no TRUNCATE; PostgreSQL's would skip the row triggers.
            """
            CREATE OR REPLACE TRIGGER approval_events_no_truncate
            BEFORE TRUNCATE ON approval_events
            FOR EACH STATEMENT EXECUTE FUNCTION kazma_approval_events_append_only()
            """,
            _PG_FINAL,
            """
            CREATE OR REPLACE TRIGGER approval_requests_final
            BEFORE UPDATE OF status, decided_by, decided_via, decided_at ON approval_requests
            FOR EACH ROW WHEN (OLD.status <> 'pending')
            EXECUTE FUNCTION kazma_approval_outcome_final()
            """,
            """
            CREATE TABLE IF NOT EXISTS approval_cards (
                request_id text NOT NULL REFERENCES approval_requests (id),
                platform text NOT NULL,
                chat text NOT NULL,
                message_id text NOT NULL,
                posted_at double precision NOT NULL,
                settled_at double precision,
                settled_status text,
                PRIMARY KEY (request_id, platform, chat, message_id)
            )
            """,
            "CREATE INDEX IF NOT EXISTS approval_cards_unsettled ON approval_cards (settled_at, request_id)",
        ),
    ),
    PgMigration("approvals", 2, ("ALTER TABLE approval_cards ADD COLUMN whole integer NOT NULL DEFAULT 1",)),
    PgMigration(
        "approvals",
        3,
        (
            "ALTER TABLE approval_requests ADD COLUMN notes text NOT NULL DEFAULT '[]'",
            "ALTER TABLE approval_requests ADD COLUMN durable integer NOT NULL DEFAULT 0",
        ),
    ),
    PgMigration(
        "approvals",
        4,
        (
            "ALTER TABLE approval_cards ADD COLUMN retry_at double precision",
            "ALTER TABLE approval_cards ADD COLUMN settle_attempts integer NOT NULL DEFAULT 0",
            "CREATE INDEX IF NOT EXISTS approval_cards_to_settle ON approval_cards (platform, retry_at)"
            " WHERE settled_at IS NULL",
            "DROP INDEX IF EXISTS approval_cards_unsettled",
        ),
    ),
    # SQLite's v5 makes its pending index partial; PostgreSQL's has been partial from v1. Kept so that the
    # version numbers of both backends say the same.
    PgMigration(
        "approvals",
        5,
        (
            "CREATE INDEX IF NOT EXISTS approval_requests_pending ON approval_requests (created_at)"
            " WHERE status = 'pending'",
        ),
    ),
    PgMigration(
        "approvals",
        6,
        (
            "ALTER TABLE approval_requests ADD COLUMN owner text",
            "ALTER TABLE approval_cards ADD COLUMN settle_claimed_by text",
        ),
    ),
    PgMigration(
        "approvals",
        7,
        (
            "ALTER TABLE approval_requests ADD COLUMN decision_mac text",
            "ALTER TABLE approval_requests ADD COLUMN decision_key_id text",
            """
            CREATE OR REPLACE TRIGGER approval_requests_seal_final
            BEFORE UPDATE OF decision_mac, decision_key_id ON approval_requests
            FOR EACH ROW WHEN (OLD.status <> 'pending')
            EXECUTE FUNCTION kazma_approval_outcome_final()
            """,
        ),
    ),
    PgMigration(
        "approvals",
        8,
        (
            "ALTER TABLE approval_requests ADD COLUMN waits text"
            " CHECK (waits IS NULL OR waits IN ('connection', 'polling'))",
            "ALTER TABLE approval_requests ADD COLUMN last_seen double precision",
        ),
    ),
    PgMigration(
        "approvals",
        9,
        (
            "ALTER TABLE approval_requests ADD COLUMN decided_person text",
            """
            CREATE OR REPLACE TRIGGER approval_requests_person_final
            BEFORE UPDATE OF decided_person ON approval_requests
            FOR EACH ROW WHEN (OLD.status <> 'pending')
            EXECUTE FUNCTION kazma_approval_outcome_final()
            """,
            "ALTER TABLE approval_events ADD COLUMN person text",
        ),
    ),
    PgMigration(
        "approvals",
        10,
        (
            "ALTER TABLE approval_events ADD COLUMN prev_hash text",
            "ALTER TABLE approval_events ADD COLUMN chain_hash text",
            "ALTER TABLE approval_events ADD COLUMN commit_seal text",
            """
            CREATE TABLE IF NOT EXISTS audit_checkpoints (
                seq bigint PRIMARY KEY,
                first_seq bigint NOT NULL,
                kind text NOT NULL CHECK (kind IN ('history', 'head')),
                head text NOT NULL,
                at double precision NOT NULL,
                key_id text,
                signature text
            )
            """,
            _PG_CHECKPOINTS_APPEND_ONLY,
            """
            CREATE OR REPLACE TRIGGER audit_checkpoints_append_only
            BEFORE UPDATE OR DELETE ON audit_checkpoints
            FOR EACH ROW EXECUTE FUNCTION kazma_audit_checkpoints_append_only()
            """,
            """
            CREATE OR REPLACE TRIGGER audit_checkpoints_no_truncate
            BEFORE TRUNCATE ON audit_checkpoints
            FOR EACH STATEMENT EXECUTE FUNCTION kazma_audit_checkpoints_append_only()
            """,
            _PG_AUDIT_HEAD,
        ),
    ),
    PgMigration(
        "approvals",
        11,
        (
            "ALTER TABLE approval_requests ADD COLUMN policy text",
            "ALTER TABLE approval_requests ADD COLUMN approve_needed integer NOT NULL DEFAULT 1",
            "ALTER TABLE approval_requests ADD COLUMN deny_needed integer NOT NULL DEFAULT 1",
            "ALTER TABLE approval_requests ADD COLUMN step_up integer NOT NULL DEFAULT 0",
            "ALTER TABLE approval_requests ADD COLUMN started_by text",
            """
            CREATE OR REPLACE FUNCTION kazma_approval_policy_fixed() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'a request keeps the policy it opened under'
                    USING ERRCODE = 'integrity_constraint_violation';
            END
            $$
            """,
            """
            CREATE OR REPLACE TRIGGER approval_requests_policy_fixed
            BEFORE UPDATE OF policy, approve_needed, deny_needed, step_up, started_by ON approval_requests
            FOR EACH ROW EXECUTE FUNCTION kazma_approval_policy_fixed()
            """,
            """
            CREATE TABLE IF NOT EXISTS approval_reviews (
                request_id text NOT NULL REFERENCES approval_requests (id),
                reviewer text NOT NULL,
                actor text NOT NULL,
                platform text NOT NULL,
                decision text NOT NULL CHECK (decision IN ('approve', 'deny')),
                reason text,
                at double precision NOT NULL,
                PRIMARY KEY (request_id, reviewer)
            )
            """,
            """
            CREATE OR REPLACE TRIGGER approval_reviews_append_only
            BEFORE UPDATE OR DELETE ON approval_reviews
            FOR EACH ROW EXECUTE FUNCTION kazma_approval_events_append_only()
            """,
            """
            CREATE OR REPLACE TRIGGER approval_reviews_no_truncate
            BEFORE TRUNCATE ON approval_reviews
            FOR EACH STATEMENT EXECUTE FUNCTION kazma_approval_events_append_only()
            """,
        ),
    ),
    PgMigration("approvals", 12, ("ALTER TABLE approval_cards ADD COLUMN bound_to text",)),
    PgMigration("approvals", 13, (PG_PRESS_FUNCTION, PG_AUDIT_APPEND_FUNCTION)),
    PgMigration("approvals", 14, (PG_PRESS_GUESSED_FUNCTION,)),
    PgMigration("approvals", 15, (PG_AUDIT_APPEND_FUNCTION,)),
    PgMigration("approvals", 16, ("ALTER TABLE approval_cards ADD COLUMN reposted integer NOT NULL DEFAULT 0",)),
    PgMigration("approvals", 17, (PG_PRESS_ON_GUESS_FUNCTION,)),
    PgMigration("approvals", 18, (PG_AUDIT_LINK_FUNCTION, PG_AUDIT_CHECKPOINT_FUNCTION)),
    PgMigration("approvals", 19, (PG_AUDIT_STALE_GUESS_FUNCTION,)),
    PgMigration("approvals", 20, ("ALTER TABLE approval_requests ADD COLUMN definition_hash text",)),
]
