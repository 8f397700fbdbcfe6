"""A press and an audit append on PostgreSQL, each one statement: the SQL functions and the calls to them.

On PostgreSQL every statement of a transaction is a round trip (the writer
thread's group runs in pipeline mode, so only the statements whose answers an
operation reads cost one). Two functions, created by approvals migration 13 and
called from :mod:`kazma.approvals.store` and :mod:`kazma.approvals.chain`, make
the hot statements one each:

- ``kazma_press``: the card check, the compare-and-set (its predicate also holds
  the tool and the arguments hash the seal was made over, and a policy of one
  press), the review row of the winner, or else the request as it stands now;
  read in a fresh snapshot after the compare-and-set, so a loser is told the
  outcome that beat it. Anything else (a card problem, a policy of several
  people, a request whose tool and hash this process did not know) is answered
  as a *miss*, and the press runs the general statements instead.
- ``kazma_audit_link`` (``kazma_audit_append`` before approvals migration 18):
  the chain's lock, the head, and the events inserted in the same call when the
  head is the one this process last committed (its hashes computed in Python
  before the call). Otherwise it inserts nothing and returns the head, and the
  chain hashes after it and inserts (one more round
  trip: another replica appended in between).
- a guessed append (the writer's pipeline, the head the one this process last
  committed) is a plain statement instead: the lock tried, the rows inserted on
  their numbers, and ``kazma_audit_stale_guess`` (approvals migration 19) failing
  the transaction when they did not all go in.

The hashes stay in Python: the chain's canonical form is Python's JSON of the
values as given (text with U+0000, floats as ``repr`` writes them), which
PostgreSQL stores escaped (:mod:`kazma.config.store.pg_text`) and prints its own way.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, cast

from kazma.config.store.backend import Tx
from kazma.config.store.group_commit import Later
from kazma.config.store.pg_schema import prepared

T = TypeVar("T")


def _indent(text: str, spaces: int) -> str:
    return textwrap.indent(text, " " * spaces)


# The card check of a press (the rule of approvals.store._card_problem, as a yes/no) up to its THEN: the counts of
# the request's cards on the platform, of those the press may be from, and of those cut; kazma_press answers a miss
# after it, kazma_press_on_guess fails the guess. One text, so the two functions cannot come to differ.
_CARD_PROBLEM: Final = """SELECT count(*),
       count(*) FILTER (WHERE (p_chat IS NULL OR c.chat = p_chat)
           AND (p_message_id IS NULL OR c.message_id = p_message_id)
           AND (c.bound_to IS NULL OR c.bound_to = coalesce(p_person, p_actor))),
       count(*) FILTER (WHERE (p_chat IS NULL OR c.chat = p_chat)
           AND (p_message_id IS NULL OR c.message_id = p_message_id)
           AND (c.bound_to IS NULL OR c.bound_to = coalesce(p_person, p_actor)) AND c.whole = 0)
  INTO posted, usable, cut
  FROM approval_cards c WHERE c.request_id = p_id AND c.platform = p_platform;
IF (posted = 0 AND (p_chat IS NOT NULL OR p_message_id IS NOT NULL))
   OR (posted > 0 AND (usable = 0 OR (p_needs_whole AND cut > 0))) THEN"""

# The press: returns one row (what became of it, then the request's standing), or none for an unknown id.
PG_PRESS_FUNCTION: Final = f"""
CREATE OR REPLACE FUNCTION kazma_press(
    p_id text, p_status text, p_actor text, p_platform text, p_now double precision, p_reason text,
    p_mac text, p_key_id text, p_person text, p_tool text, p_args_hash text, p_reviewer text, p_decision text,
    p_card boolean, p_chat text, p_message_id text, p_needs_whole boolean)
RETURNS TABLE (outcome text, id text, tool text, args_hash text, conversation text, deadline double precision,
               status text, decided_by text, decided_via text, decided_at double precision, reason text,
               decided_person text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    posted bigint;
    usable bigint;
    cut bigint;
BEGIN
    IF p_card THEN
        -- The rule of approvals.store._card_problem, as a yes/no: a miss lets Python say which problem it is.
{_indent(_CARD_PROBLEM, 8)}
            RETURN QUERY SELECT 'miss'::text, r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status,
                r.decided_by, r.decided_via, r.decided_at, r.reason, r.decided_person
                FROM approval_requests r WHERE r.id = p_id;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY UPDATE approval_requests r SET status = p_status, decided_by = p_actor, decided_via = p_platform,
            decided_at = p_now, reason = p_reason, decision_mac = p_mac, decision_key_id = p_key_id,
            decided_person = p_person
        WHERE r.id = p_id AND r.status = 'pending' AND r.deadline > p_now AND r.tool = p_tool
            AND r.args_hash = p_args_hash AND r.approve_needed = 1 AND r.deny_needed = 1
        RETURNING 'won'::text, r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status, r.decided_by,
            r.decided_via, r.decided_at, r.reason, r.decided_person;
    IF FOUND THEN
        INSERT INTO approval_reviews (request_id, reviewer, actor, platform, decision, reason, at)
            VALUES (p_id, p_reviewer, p_actor, p_platform, p_decision, p_reason, p_now) ON CONFLICT DO NOTHING;
        RETURN;
    END IF;
    -- A statement of its own, so a fresh snapshot: the decision that beat this press is seen.
    RETURN QUERY SELECT CASE WHEN r.status = 'pending' AND r.deadline > p_now THEN 'miss' ELSE 'lost' END,
        r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status, r.decided_by, r.decided_via,
        r.decided_at, r.reason, r.decided_person
        FROM approval_requests r WHERE r.id = p_id;
END
$$
"""  # noqa: S608 - constant SQL, one fragment of it shared

# The press sent on a guess of what it finds (see press_guessed): kazma_press, and KZ001 when its outcome or the
# request's status afterwards is not the one guessed; a press that won notifies ``p_channel`` (when given) with its
# request id in the same call (approvals PG migration 14).
PG_PRESS_GUESSED_FUNCTION: Final = """
CREATE OR REPLACE FUNCTION kazma_press_guessed(
    p_outcome text, p_standing text, p_channel text,
    p_id text, p_status text, p_actor text, p_platform text, p_now double precision, p_reason text,
    p_mac text, p_key_id text, p_person text, p_tool text, p_args_hash text, p_reviewer text, p_decision text,
    p_card boolean, p_chat text, p_message_id text, p_needs_whole boolean)
RETURNS TABLE (outcome text, id text, tool text, args_hash text, conversation text, deadline double precision,
               status text, decided_by text, decided_via text, decided_at double precision, reason text,
               decided_person text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    got record;
BEGIN
    SELECT k.* INTO got FROM kazma_press(p_id, p_status, p_actor, p_platform, p_now, p_reason, p_mac, p_key_id,
        p_person, p_tool, p_args_hash, p_reviewer, p_decision, p_card, p_chat, p_message_id, p_needs_whole) AS k;
    IF NOT FOUND OR got.outcome IS DISTINCT FROM p_outcome OR got.status IS DISTINCT FROM p_standing THEN
        RAISE EXCEPTION 'a press guessed % (standing %) found otherwise', p_outcome, p_standing
            USING ERRCODE = 'KZ001';
    END IF;
    IF got.outcome = 'won' AND p_channel IS NOT NULL THEN
        PERFORM pg_notify(p_channel, p_id);
    END IF;
    RETURN QUERY SELECT got.outcome, got.id, got.tool, got.args_hash, got.conversation, got.deadline, got.status,
        got.decided_by, got.decided_via, got.decided_at, got.reason, got.decided_person;
END
$$
"""

# kazma_press_guessed as one function, kazma_press_on_guess (approvals PG migration 17; a new name, since a function's
# result type cannot be replaced, and an older release still calls the old one): kazma_press's body inlined instead
# of called, the answer in OUT parameters instead of a set, a press guessed to win one statement (its card check in
# the compare-and-set's predicate, its review row inserted from the RETURNING), and a press guessed to lose reading
# the row without the compare-and-set that could only miss. Each saves the server work: the nested plpgsql call and
# its tuplestore, RETURN QUERY's tuplestore, two statements of a winner's, an UPDATE's plan and index probe of a
# loser's. Server CPU of "BEGIN; press; COMMIT" (the backend's /proc schedstat, 9 interleaved rounds): 1 press
# 193 -> 175 us (load 4.4) with the winner's three statements, 267 -> 234 us more with them as one (load 12).
# The answers are kazma_press_guessed's of migration 14 in every case: a miss, an unknown id, a standing other
# than the one guessed fail with KZ001, and a press that won notifies ``p_channel``.
PG_PRESS_ON_GUESS_FUNCTION: Final = f"""
CREATE OR REPLACE FUNCTION kazma_press_on_guess(
    p_outcome text, p_standing text, p_channel text,
    p_id text, p_status text, p_actor text, p_platform text, p_now double precision, p_reason text,
    p_mac text, p_key_id text, p_person text, p_tool text, p_args_hash text, p_reviewer text, p_decision text,
    p_card boolean, p_chat text, p_message_id text, p_needs_whole boolean,
    OUT outcome text, OUT id text, OUT tool text, OUT args_hash text, OUT conversation text,
    OUT deadline double precision, OUT status text, OUT decided_by text, OUT decided_via text,
    OUT decided_at double precision, OUT reason text, OUT decided_person text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    posted bigint;
    usable bigint;
    cut bigint;
BEGIN
    IF p_outcome = 'won' THEN
        -- One statement: the card check (kazma_press's rule, as the predicate "no problem") folded into the
        -- compare-and-set, the review row inserted from its RETURNING. A card problem makes it miss, and the
        -- miss fails the guess below; the group run again without guessing names the problem.
        WITH won AS (
            UPDATE approval_requests r SET status = p_status, decided_by = p_actor, decided_via = p_platform,
                    decided_at = p_now, reason = p_reason, decision_mac = p_mac, decision_key_id = p_key_id,
                    decided_person = p_person
                WHERE r.id = p_id AND r.status = 'pending' AND r.deadline > p_now AND r.tool = p_tool
                    AND r.args_hash = p_args_hash AND r.approve_needed = 1 AND r.deny_needed = 1
                    AND (NOT p_card OR (
                        SELECT CASE WHEN count(*) = 0 THEN p_chat IS NULL AND p_message_id IS NULL
                                    ELSE count(*) FILTER (WHERE cards.usable) > 0
                                         AND NOT (p_needs_whole AND count(*) FILTER (WHERE cards.usable
                                                                                      AND cards.whole = 0) > 0)
                               END
                          FROM (SELECT (p_chat IS NULL OR c.chat = p_chat)
                                       AND (p_message_id IS NULL OR c.message_id = p_message_id)
                                       AND (c.bound_to IS NULL OR c.bound_to = coalesce(p_person, p_actor))
                                       AS usable,
                                       c.whole
                                  FROM approval_cards c
                                 WHERE c.request_id = p_id AND c.platform = p_platform) AS cards))
                RETURNING r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status, r.decided_by,
                    r.decided_via, r.decided_at, r.reason, r.decided_person),
        review AS (
            INSERT INTO approval_reviews (request_id, reviewer, actor, platform, decision, reason, at)
                SELECT p_id, p_reviewer, p_actor, p_platform, p_decision, p_reason, p_now FROM won
                ON CONFLICT DO NOTHING)
        SELECT 'won', w.id, w.tool, w.args_hash, w.conversation, w.deadline, w.status, w.decided_by,
               w.decided_via, w.decided_at, w.reason, w.decided_person
          INTO outcome, id, tool, args_hash, conversation, deadline, status, decided_by, decided_via,
               decided_at, reason, decided_person
          FROM won w;
    ELSE
        IF p_card THEN
            -- kazma_press's card check, word for word.
{_indent(_CARD_PROBLEM, 12)}
                -- kazma_press would answer a miss, which is never a guess.
                RAISE EXCEPTION 'a press guessed % (standing %) found a card problem', p_outcome, p_standing
                    USING ERRCODE = 'KZ001';
            END IF;
        END IF;
        -- A press guessed to lose follows one of the same request that won earlier in this transaction (else the
        -- transaction failed there): the row is decided, and kazma_press's compare-and-set would miss it. Its
        -- read-back alone gives the same answer; should the row be pending after all, the check below fails.
        SELECT CASE WHEN r.status = 'pending' AND r.deadline > p_now THEN 'miss' ELSE 'lost' END,
            r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status, r.decided_by, r.decided_via,
            r.decided_at, r.reason, r.decided_person
          INTO outcome, id, tool, args_hash, conversation, deadline, status, decided_by, decided_via,
               decided_at, reason, decided_person
          FROM approval_requests r WHERE r.id = p_id;
    END IF;
    IF outcome IS DISTINCT FROM p_outcome OR status IS DISTINCT FROM p_standing THEN
        RAISE EXCEPTION 'a press guessed % (standing %) found otherwise', p_outcome, p_standing
            USING ERRCODE = 'KZ001';
    END IF;
    IF outcome = 'won' AND p_channel IS NOT NULL THEN
        PERFORM pg_notify(p_channel, p_id);
    END IF;
END
$$
"""  # noqa: S608 - constant SQL, one fragment of it shared

# The chain's append: the lock, the head, and the events when the head is the expected one (see the module). Created
# by approvals migration 13, its insert rewritten by 15.
PG_AUDIT_APPEND_FUNCTION: Final = """
CREATE OR REPLACE FUNCTION kazma_audit_append(
    lock_key bigint, expect_seq bigint, expect_hash text, p_seq bigint[], p_request_id text[], p_event text[],
    p_actor text[], p_platform text[], p_at double precision[], p_args_hash text[], p_detail text[],
    p_prev_hash text[], p_chain_hash text[], p_person text[], p_commit_seal text[], p_strict boolean)
RETURNS TABLE (appended boolean, last_seq bigint, last_hash text, checkpoint_seq bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    head_seq bigint;
    head_hash text;
    signed bigint;
BEGIN
    PERFORM set_config('lock_timeout', '0', true);
    PERFORM pg_advisory_xact_lock(lock_key);
    SELECT e.seq, e.chain_hash INTO head_seq, head_hash FROM approval_events e ORDER BY e.seq DESC LIMIT 1;
    SELECT c.seq INTO signed FROM audit_checkpoints c ORDER BY c.seq DESC LIMIT 1;
    IF cardinality(p_seq) > 0 AND head_seq = expect_seq AND head_hash = expect_hash
       AND (signed IS NULL OR signed <= expect_seq) THEN
        -- The rows by subscript: unnest over twelve arrays cost about twice the server's CPU of the whole call
        -- (approvals migration 15).
        INSERT INTO approval_events (seq, request_id, event, actor, platform, at, args_hash, detail, prev_hash,
                                     chain_hash, person, commit_seal)
            SELECT p_seq[i], p_request_id[i], p_event[i], p_actor[i], p_platform[i], p_at[i], p_args_hash[i],
                   p_detail[i], p_prev_hash[i], p_chain_hash[i], p_person[i], p_commit_seal[i]
              FROM generate_subscripts(p_seq, 1) AS i ORDER BY i;
        -- A row inserted by hand without a seq must not take a number the chain gave.
        PERFORM setval('approval_events_seq_seq', p_seq[cardinality(p_seq)]);
        RETURN QUERY SELECT true, head_seq, head_hash, signed;
        RETURN;
    END IF;
    IF p_strict THEN
        RAISE EXCEPTION 'the audit chain head moved (another writer appended)' USING ERRCODE = 'KZ001';
    END IF;
    RETURN QUERY SELECT false, head_seq, head_hash, signed;
END
$$
"""

# kazma_audit_append as approvals migration 18 has it (a new name: a function's result type cannot be replaced, and an
# older release still calls the old one). The same answers; less server work per call: the answer in OUT parameters
# instead of a set (RETURN QUERY's tuplestore), the chain's lock tried first (lock_timeout is set to wait without
# bound only when another transaction holds it), the head and the last checkpoint read in one statement, and a lone
# row inserted by VALUES instead of generate_subscripts. Server CPU of "BEGIN; append of one row; COMMIT", both
# prepared (raw psycopg, the backend's /proc schedstat, 9 interleaved rounds of 300): 162 -> 143 us (min 149 -> 118)
# with the heads read in two statements; one statement for both, 132-138 -> 118-133 us (min 112-128 -> 109-121).
PG_AUDIT_LINK_FUNCTION: Final = """
CREATE OR REPLACE FUNCTION kazma_audit_link(
    lock_key bigint, expect_seq bigint, expect_hash text, p_seq bigint[], p_request_id text[], p_event text[],
    p_actor text[], p_platform text[], p_at double precision[], p_args_hash text[], p_detail text[],
    p_prev_hash text[], p_chain_hash text[], p_person text[], p_commit_seal text[], p_strict boolean,
    OUT appended boolean, OUT last_seq bigint, OUT last_hash text, OUT checkpoint_seq bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer := cardinality(p_seq);
BEGIN
    IF NOT pg_try_advisory_xact_lock(lock_key) THEN
        -- Held by another transaction, which waits for nobody: wait as long as it takes (a bounded group's
        -- lock_timeout is for row locks).
        PERFORM set_config('lock_timeout', '0', true);
        PERFORM pg_advisory_xact_lock(lock_key);
    END IF;
    -- A statement after the lock, so a fresh snapshot: the previous holder's commit is seen. One statement for
    -- both heads (the join keeps a row when there is no event: the checkpoint's seq is still read).
    SELECT e.seq, e.chain_hash, (SELECT c.seq FROM audit_checkpoints c ORDER BY c.seq DESC LIMIT 1)
      INTO last_seq, last_hash, checkpoint_seq
      FROM (SELECT 1) AS one
      LEFT JOIN LATERAL (SELECT seq, chain_hash FROM approval_events ORDER BY seq DESC LIMIT 1) AS e ON true;
    IF n > 0 AND last_seq = expect_seq AND last_hash = expect_hash
       AND (checkpoint_seq IS NULL OR checkpoint_seq <= expect_seq) THEN
        IF n = 1 THEN
            INSERT INTO approval_events (seq, request_id, event, actor, platform, at, args_hash, detail, prev_hash,
                                         chain_hash, person, commit_seal)
                VALUES (p_seq[1], p_request_id[1], p_event[1], p_actor[1], p_platform[1], p_at[1], p_args_hash[1],
                        p_detail[1], p_prev_hash[1], p_chain_hash[1], p_person[1], p_commit_seal[1]);
        ELSE
            INSERT INTO approval_events (seq, request_id, event, actor, platform, at, args_hash, detail, prev_hash,
                                         chain_hash, person, commit_seal)
                SELECT p_seq[i], p_request_id[i], p_event[i], p_actor[i], p_platform[i], p_at[i], p_args_hash[i],
                       p_detail[i], p_prev_hash[i], p_chain_hash[i], p_person[i], p_commit_seal[i]
                  FROM generate_subscripts(p_seq, 1) AS i ORDER BY i;
        END IF;
        -- A row inserted by hand without a seq must not take a number the chain gave.
        PERFORM setval('approval_events_seq_seq', p_seq[n]);
        appended := true;
        RETURN;
    END IF;
    IF p_strict THEN
        RAISE EXCEPTION 'the audit chain head moved (another writer appended)' USING ERRCODE = 'KZ001';
    END IF;
    appended := false;
END
$$
"""

# A checkpoint pass sent on a guess (approvals migration 18; see kazma.approvals.checkpointer): the chain's lock, and
# the checkpoint inserted only when the head is still (expect_seq, expect_hash) and the newest checkpoint is still
# expect_signed, the one the pass signed after; else KZ001, and the writer runs the group again, the pass asking.
PG_AUDIT_CHECKPOINT_FUNCTION: Final = """
CREATE OR REPLACE FUNCTION kazma_audit_checkpoint_on_guess(
    lock_key bigint, expect_seq bigint, expect_hash text, expect_signed bigint, p_kind text, p_first_seq bigint,
    p_seq bigint, p_head text, p_at double precision, p_key_id text, p_signature text)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    head_seq bigint;
    head_hash text;
    signed bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock(lock_key) THEN
        PERFORM set_config('lock_timeout', '0', true);
        PERFORM pg_advisory_xact_lock(lock_key);
    END IF;
    SELECT e.seq, e.chain_hash INTO head_seq, head_hash FROM approval_events e ORDER BY e.seq DESC LIMIT 1;
    SELECT c.seq INTO signed FROM audit_checkpoints c ORDER BY c.seq DESC LIMIT 1;
    IF head_seq IS DISTINCT FROM expect_seq OR head_hash IS DISTINCT FROM expect_hash
       OR signed IS DISTINCT FROM expect_signed THEN
        RAISE EXCEPTION 'the audit chain moved since this process last signed it' USING ERRCODE = 'KZ001';
    END IF;
    INSERT INTO audit_checkpoints (kind, first_seq, seq, head, at, key_id, signature)
        VALUES (p_kind, p_first_seq, p_seq, p_head, p_at, p_key_id, p_signature);
END
$$
"""
_CHECKPOINT_GUESSED_CALL: Final = prepared(
    "kazma_audit_checkpoint_on_guess_call",
    "SELECT kazma_audit_checkpoint_on_guess(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    ("bigint", "bigint", "text", "bigint", "text", "bigint", "bigint", "text", "double precision", "text", "text"),
)

_PRESS_CALL: Final = (
    "SELECT outcome, id, tool, args_hash, conversation, deadline, status, decided_by, decided_via, decided_at,"
    " reason, decided_person FROM kazma_press(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# Prepared on the writer's connections: a group sent as one string (most presses) runs it as EXECUTE, planned once
# per session instead of once per press (server CPU of "BEGIN; press; COMMIT", 9 interleaved rounds: 1 press
# 175 -> 164 us, 3 presses 315 -> 265 us).
_PRESS_GUESSED_CALL: Final = prepared(
    "kazma_press_on_guess_call",
    "SELECT outcome, id, tool, args_hash, conversation, deadline, status, decided_by, decided_via, decided_at,"
    " reason, decided_person FROM kazma_press_on_guess(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    ("text", "text", "text", "text", "text", "text", "text", "double precision", "text", "text", "text", "text",
     "text", "text", "text", "text", "boolean", "text", "text", "boolean"),
)  # fmt: skip
# A press guessed to lose to one of its request's that was guessed to win earlier in the same transaction: what it
# is answered (the request as that winner left it) is that winner's row, which nothing can change after it in the
# transaction (a decided row is final), so the server is asked only for its card check. The check is
# kazma_press_on_guess's (_CARD_PROBLEM's rule) in plain SQL, and only a problem found calls that function, which
# fails the guess with KZ001 as it always did (the group run again without guessing names the problem); it decides,
# this text only whether to ask it. Its parameters: chat, message, needs whole, chat twice, message twice, the
# person a bound card must be (the person, else the actor), the request, the platform, then the function's own.
# Server instructions per press of a 3-press request in one string (postgres --single under callgrind, 20 and 40
# requests): 866,000 with kazma_press_on_guess per loser, 766,000 so.
_LOST_CARD_CHECK: Final = prepared(
    "kazma_press_lost_check",
    "SELECT CASE WHEN (SELECT (count(*) = 0 AND (?::text IS NOT NULL OR ?::text IS NOT NULL))"
    " OR (count(*) > 0 AND (count(*) FILTER (WHERE cards.usable) = 0"
    " OR (?::boolean AND count(*) FILTER (WHERE cards.usable AND cards.whole = 0) > 0)))"
    " FROM (SELECT (?::text IS NULL OR c.chat = ?) AND (?::text IS NULL OR c.message_id = ?)"
    " AND (c.bound_to IS NULL OR c.bound_to = ?) AS usable, c.whole"
    " FROM approval_cards c WHERE c.request_id = ? AND c.platform = ?) AS cards)"
    " THEN (SELECT f.outcome FROM kazma_press_on_guess(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) f)"
    " END",
    ("text", "text", "boolean", "text", "text", "text", "text", "text", "text", "text",
     "text", "text", "text", "text", "text", "text", "text", "double precision", "text", "text", "text", "text",
     "text", "text", "text", "text", "boolean", "text", "text", "boolean"),
)  # fmt: skip
# The append's columns, each an array of one value per event row. Sent as ``ARRAY[?, ?, …]`` of plain values, not
# as arrays: psycopg dumps a Python list element by element in Python (about a tenth of a millisecond per call for
# twelve one-element lists), a plain value in C; past _SCALAR_ROWS rows the statement's text would be long, and
# the rows go as arrays after all.
_COLUMN_TYPES: Final = ("bigint", "text", "text", "text", "text", "double precision", "text", "text", "text",
                        "text", "text", "text")  # fmt: skip
_APPEND_HEAD: Final = "SELECT appended, last_seq, last_hash, checkpoint_seq FROM kazma_audit_link(?, ?, ?, "
_SCALAR_ROWS: Final = 64


@functools.lru_cache(maxsize=_SCALAR_ROWS + 1)
def _append_call(rows: int) -> str:
    """The call to ``kazma_audit_link`` for ``rows`` event rows, value by value (past _SCALAR_ROWS, as arrays)."""
    if rows > _SCALAR_ROWS:
        columns = [f"?::{kind}[]" for kind in _COLUMN_TYPES]
    else:
        marks = ", ".join("?" * rows)
        columns = [f"ARRAY[{marks}]::{kind}[]" for kind in _COLUMN_TYPES]
    return f"{_APPEND_HEAD}{', '.join(columns)}, ?)"


# The calls of the common sizes (a transaction's events: one for a lone press, a few for a decision with its reviews)
# prepared on the writer's connections, as the press's call is: sent as one string, the call was parsed and planned
# at every append, its twelve ARRAY constructors and the function's set of rows included. Server CPU of
# "BEGIN; append of one row; COMMIT" (the backend's /proc schedstat, raw psycopg, 9 interleaved rounds of 300):
# 166-189 -> 142 us (min 143-161 -> 120). A bigger transaction's call stays plain text.
_PREPARED_ROWS: Final = 4
for _rows in range(1, _PREPARED_ROWS + 1):
    prepared(
        f"kazma_audit_link_{_rows}",
        _append_call(_rows),
        ("bigint", "bigint", "text", *(kind for kind in _COLUMN_TYPES for _ in range(_rows)), "boolean"),
    )

# A guessed append (the head is the one this process last committed: the rows' numbers follow it and the first is
# hashed after it) needs neither the head read nor the function: the chain's lock tried, the rows inserted, the
# identity moved past them, in one statement. The head moved, or another transaction holds the lock (it may be
# appending right now): fewer rows than sent, and kazma_audit_stale_guess fails the transaction with KZ001, which
# sends the group to run again asking (kazma_audit_link, which waits for the lock). ``seq`` is the table's primary
# key, so a row numbered as these by anyone since leaves them out whole; the transaction's end is the same as a head
# the function found moved. As on SQLite (approvals.chain: _appended_after_own), a row removed around Kazma since is
# not seen: these link to what it was, and the verifier names the gap. Server CPU of "BEGIN; append of one row;
# COMMIT" (the backend's /proc schedstat, raw psycopg, 9 interleaved rounds of 400, a noisy machine): the call of
# kazma_audit_link 389 us median, this statement 330, the bare INSERT with its setval 286.
PG_AUDIT_STALE_GUESS_FUNCTION: Final = """
CREATE OR REPLACE FUNCTION kazma_audit_stale_guess() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'the audit chain head moved (another writer appended)' USING ERRCODE = 'KZ001';
END
$$
"""
_GUESSED_ROWS: Final = _PREPARED_ROWS  # a bigger transaction's guessed append calls kazma_audit_link (strict)


@functools.lru_cache(maxsize=_GUESSED_ROWS)
def _guessed_append(rows: int) -> str:
    """The statement of a guessed append of ``rows`` event rows: the chain's lock, then each row's values."""
    row = "(" + ", ".join(f"?::{kind}" for kind in _COLUMN_TYPES) + ")"
    return (
        "WITH chain_lock AS (SELECT pg_try_advisory_xact_lock(?::bigint) AS held),"  # noqa: S608 - marks, a count
        " added AS (INSERT INTO approval_events (seq, request_id, event, actor, platform, at, args_hash, detail,"
        " prev_hash, chain_hash, person, commit_seal)"
        f" SELECT v.* FROM (VALUES {', '.join([row] * rows)}) AS v, chain_lock WHERE chain_lock.held"
        " ON CONFLICT (seq) DO NOTHING RETURNING seq)"
        " SELECT setval('approval_events_seq_seq', (SELECT max(seq) FROM added))"
        f" WHERE (SELECT count(*) FROM added) = {rows}"
        f" UNION ALL SELECT kazma_audit_stale_guess() WHERE (SELECT count(*) FROM added) <> {rows}"
    )


for _rows in range(1, _GUESSED_ROWS + 1):
    prepared(f"kazma_audit_guessed_{_rows}", _guessed_append(_rows), ("bigint", *(_COLUMN_TYPES * _rows)))


WON: Final = "won"
LOST: Final = "lost"
MISS: Final = "miss"


@dataclass(frozen=True)
class PressCall:
    """What ``kazma_press`` is given: the press, its seal, and what the seal was made over."""

    request_id: str
    status: str
    actor: str
    platform: str
    now: float
    reason: str | None
    mac: str | None
    key_id: str | None
    person: str | None
    tool: str
    args_hash: str
    reviewer: str
    decision: str
    card: bool
    chat: str | None
    message_id: str | None
    needs_whole: bool


class LaterTx(Tx, Protocol):
    """The PostgreSQL writer's transaction (:class:`kazma.config.store.postgres.PgTx`): a statement whose answer
    becomes an operation's result when the group's answers are in."""

    def later(self, sql: str, params: Iterable[Any], then: Callable[[Any], T]) -> Later[T]: ...


class GuessTx(Tx, Protocol):
    """The PostgreSQL writer's transaction when it may send statements on a guess of their answers
    (:attr:`kazma.config.store.postgres.PgTx.guessing`)."""

    guessing: bool
    notes: dict[str, Any]

    def guess(self, sql: str, params: Iterable[Any], then: Callable[[Any], T]) -> Later[T]: ...

    def prepares(self, sql: str) -> bool: ...


def guessing(tx: Tx) -> GuessTx | None:
    """``tx`` when a press may be sent on a guess in it, else None (SQLite, a group run again, no pipeline)."""
    return cast(GuessTx, tx) if getattr(tx, "guessing", False) else None


def press_guessed(
    tx: GuessTx,
    call: PressCall,
    outcome: str,
    standing: str,
    then: Callable[[tuple[Any, ...]], T],
    *,
    notify: str | None = None,
) -> Later[T]:
    """One press sent on a guess of what it finds, its answer read only once the transaction committed: ``WON``
    (then the request's status is the press's own), or ``LOST`` to the status ``standing`` (a decision earlier
    in the same transaction). What the press writes with it (its audit event) is written beside it without
    waiting, and a press that won notifies the channel ``notify`` (its request id) in the same call; a wrong
    guess fails the transaction with SQLSTATE ``KZ001`` (:data:`kazma.config.store.postgres.STALE_GUESS`), and
    the writer runs the group again without guessing.
    ``then`` is given the request's standing row and must run no statement."""
    params = (outcome, standing, notify, *_press_params(call))
    return tx.guess(_PRESS_GUESSED_CALL, params, lambda row: then(tuple(row[1:])))


def lost_check_prepared(tx: GuessTx) -> bool:
    """Whether :func:`lost_on_guess` pays in ``tx``: its statement goes as a prepared one's EXECUTE (a group sent as
    one string). Parsed and planned for each press (a pipelined group on the writer thread, a connection behind a
    pooler), its text costs the server more than kazma_press_on_guess's short call: 3 presses, 60 in flight (half
    the groups go on the thread there), 108-119 us of server CPU per press with it against 100-110 without
    (interleaved, three runs)."""
    return tx.prepares(_LOST_CARD_CHECK)


def lost_on_guess(tx: GuessTx, call: PressCall, standing: str, then: Callable[[], T]) -> Later[T]:
    """A press from a card (``call.card``) of a request whose press guessed to win (to the status ``standing``) was
    sent earlier in this transaction, guessed to lose to it: only its card check is sent (see _LOST_CARD_CHECK),
    and a card problem fails the transaction with SQLSTATE ``KZ001`` as :func:`press_guessed` would. ``then``
    makes its result once the transaction committed (from the winner's row: the answer carries none)."""
    if not call.card:
        raise ValueError("a press without a card check has nothing to ask the server: use press_guessed")
    bound = call.actor if call.person is None else call.person  # coalesce(p_person, p_actor), as the function
    params = (call.chat, call.message_id, call.needs_whole, call.chat, call.chat, call.message_id, call.message_id,
              bound, call.request_id, call.platform, LOST, standing, None, *_press_params(call))  # fmt: skip
    return tx.guess(_LOST_CARD_CHECK, params, lambda _: then())


def press(tx: Tx, call: PressCall, then: Callable[[tuple[str, tuple[Any, ...]] | None], T]) -> Later[T]:
    """One press in one statement; ``then`` is given (``WON``/``LOST``/``MISS``, the request's standing row), or
    None (no such request), once its answer is in."""

    def answered(row: Any) -> T:
        return then(None if row is None else (str(row[0]), tuple(row[1:])))

    return cast(LaterTx, tx).later(_PRESS_CALL, _press_params(call), answered)


def _press_params(call: PressCall) -> tuple[Any, ...]:
    return (call.request_id, call.status, call.actor, call.platform, call.now, call.reason, call.mac, call.key_id,
            call.person, call.tool, call.args_hash, call.reviewer, call.decision, call.card, call.chat,
            call.message_id, call.needs_whole)  # fmt: skip


def append(
    tx: Tx, lock_key: int, expect: tuple[int, str] | None, rows: Sequence[tuple[Any, ...]]
) -> tuple[bool, Any, Any, Any]:
    """Take the chain's lock and read its head; insert ``rows`` (event rows in the chain's column order, with
    the commit seal last) in the same call when the head is ``expect`` (seq, hash). (appended, head seq, head
    hash, last checkpoint's seq)."""
    expect_seq, expect_hash = expect if expect is not None else (-1, "")
    found = tx.one(_append_call(len(rows)), (lock_key, expect_seq, expect_hash, *_columns(rows), False))
    appended, last_seq, last_hash, signed = tuple(found)
    return bool(appended), last_seq, last_hash, signed


def append_or_fail(tx: Tx, lock_key: int, expect: tuple[int, str], rows: Sequence[tuple[Any, ...]]) -> None:
    """:func:`append`, its answer not waited for, of ``rows`` numbered and hashed after ``expect`` (seq, hash): when
    the head moved past ``expect`` (up to _GUESSED_ROWS rows: one of their numbers is taken, or another transaction
    holds the chain's lock; beyond: the head is not ``expect``) the statement fails the transaction with SQLSTATE
    ``KZ001`` (:data:`kazma.config.store.postgres.STALE_GUESS`)."""
    if len(rows) <= _GUESSED_ROWS:
        tx.send(_guessed_append(len(rows)), (lock_key, *(value for row in rows for value in row)))
        return
    tx.send(_append_call(len(rows)), (lock_key, expect[0], expect[1], *_columns(rows), True))


def _columns(rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The rows' values column by column: flat (``ARRAY[?, …]``) or one list per column (see _append_call)."""
    if len(rows) > _SCALAR_ROWS:
        return [[row[i] for row in rows] for i in range(12)]
    return [row[i] for i in range(12) for row in rows]


def checkpoint_or_fail(
    tx: GuessTx, lock_key: int, expect: tuple[int, str], signed: int, checkpoint: tuple[Any, ...]
) -> None:
    """A checkpoint (its row: kind, first seq, seq, head, time, key id, signature) written in ``tx`` without waiting
    for an answer, guessing that the chain's head is ``expect`` (seq, hash) and its newest checkpoint ``signed``: when
    either moved the statement fails the transaction with SQLSTATE ``KZ001``
    (:data:`kazma.config.store.postgres.STALE_GUESS`), and the writer runs the group again without guessing."""
    tx.send(_CHECKPOINT_GUESSED_CALL, (lock_key, expect[0], expect[1], signed, *checkpoint))
