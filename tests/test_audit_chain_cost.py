"""What the audit chain does to be cheaper must not change what it proves.

The event hash is written without json's encoder on the common path: it must hash the very bytes json writes for
the field list (compact separators, UTF-8 as is, no NaN), for any text and any time, or every chain written before
would stop verifying. And the checkpointer reads the head and the last
checkpoint in one statement: on PostgreSQL that statement's snapshot is older than the chain's lock, so a
checkpoint another replica committed while it waited must still be the one it goes on after.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import sqlite3
import time
from typing import Any

import psycopg
from hypothesis import given, settings
from hypothesis import strategies as st

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.audit_verify import verify
from kazma.approvals.chain import CHAIN_LOCK, AuditChain, _Pending, event_hash
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import AuditSigner, message
from kazma.bot.store import all_migrations
from kazma.config.keyring import AUDIT_KEYS, Keyring
from kazma.config.store.database import open_database
from kazma.config.store.writer import Tx as SqliteTx
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.audit_support import Attacker
from tests.store_backends import Engine, open_store, raw_rows

# Every code point, surrogates and controls included: a lone surrogate cannot be UTF-8, and both ways must refuse it.
_ANY_TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
_FIELD = st.one_of(st.none(), _ANY_TEXT, st.sampled_from(["decided", "telegram:111", "approved\u202e", '"\\\n\x00']))
_AT = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70), st.just(-0.0))


def _reference(fields: list[Any]) -> str:
    """The chain's canonical hash as it was first written: json's encoder over the field list."""
    text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _outcome(call: Any) -> tuple[str, str]:
    try:
        return "hash", call()
    except (ValueError, UnicodeEncodeError) as exc:  # NaN or infinity; text that is not Unicode
        return "refused", type(exc).__name__


@settings(max_examples=400, deadline=None)
@given(
    prev=st.one_of(st.just("0" * 64), _ANY_TEXT),
    fields=st.tuples(_FIELD, _ANY_TEXT, _FIELD, _FIELD),
    at=_AT,
    args_hash=_FIELD,
    detail=_FIELD,
    person=_FIELD,
)
def test_the_event_hash_is_json_canonical_byte_for_byte(
    prev: str, fields: tuple[Any, ...], at: Any, args_hash: Any, detail: Any, person: Any
) -> None:
    request_id, event, actor, platform = fields
    listed = ["kazma-audit-v1", prev, request_id, event, actor, platform, at, args_hash, detail]
    if person is not None:
        listed.append(person)
    got = _outcome(lambda: event_hash(prev, request_id, event, actor, platform, at, args_hash, detail, person))
    assert got == _outcome(lambda: _reference(listed))


_SHARED = st.sampled_from(["req-1", "a" * 64, '"\\\n'])


@settings(max_examples=300, deadline=None)
@given(
    prev=st.one_of(st.just("0" * 64), _ANY_TEXT),
    events=st.lists(
        st.tuples(
            st.one_of(_SHARED, _FIELD),  # request id: mostly one per transaction
            _FIELD,
            _FIELD,
            _FIELD,
            st.one_of(st.sampled_from([1764640000.25, 0.0, -0.0]), _AT),  # time: mostly one per transaction
            st.one_of(_SHARED, _FIELD),
            _FIELD,
            _FIELD,
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_a_transactions_rows_hash_as_json_canonical_one_by_one(prev: str, events: list[tuple[Any, ...]]) -> None:
    # The chain writes the text of the fields a transaction's events share once (time, request, arguments hash):
    # every row must still hash as json's encoder writes it, after the row before.
    pending = [_Pending(*event) for event in events]
    got = _outcome(lambda: [row[9] for row in AuditChain(postgres=False)._rows(pending, {}, prev, 0, None)])  # type: ignore[arg-type]
    hashes: list[str] = []
    refused: tuple[str, str] | None = None
    for request_id, event, actor, platform, at, digest, detail, person in events:
        listed = ["kazma-audit-v1", prev, request_id, event, actor, platform, at, digest, detail]
        if person is not None:
            listed.append(person)
        outcome = _outcome(lambda: _reference(listed))  # noqa: B023
        if outcome[0] == "refused":
            refused = outcome
            break
        prev = outcome[1]
        hashes.append(prev)
    assert got == (refused or ("hash", hashes))


@settings(max_examples=300, deadline=None)
@given(
    kind=st.one_of(st.sampled_from(["head", "history"]), _ANY_TEXT),
    key_id=st.one_of(st.none(), st.just("a1"), _ANY_TEXT),
    first_seq=st.one_of(st.integers(-(2**70), 2**70), st.booleans()),
    seq=st.integers(0, 2**64),
    head=st.one_of(st.just("f" * 64), _ANY_TEXT),
    at=st.one_of(st.just(1764640000.25), _AT),
)
def test_a_checkpoints_signed_bytes_are_json_byte_for_byte(
    kind: str, key_id: str | None, first_seq: int, seq: int, head: str, at: float
) -> None:
    # Checkpoints signed before are verified with these bytes: they are json's, whatever the fields hold.
    fields = ["kazma-audit-checkpoint-v1", key_id, kind, first_seq, seq, head, at]
    expected = _outcome(lambda: json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    assert _outcome(lambda: message(kind, key_id, first_seq, seq, head, at)) == expected


def test_the_event_hash_of_a_known_event_is_unchanged() -> None:
    # A chain written by an earlier Kazma keeps verifying: this digest was computed with json's encoder.
    digest = event_hash("0" * 64, "req-1", "decided", "telegram:111", "telegram", 1764640000.25, "a" * 64, "approved")
    assert digest == _reference(
        ["kazma-audit-v1", "0" * 64, "req-1", "decided", "telegram:111", "telegram", 1764640000.25, "a" * 64,
         "approved"]
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    secret=st.binary(min_size=32, max_size=32),
    first=st.integers(0, 2**62),
    count=st.integers(0, 2**20),
    head=st.text(alphabet="0123456789abcdef", min_size=0, max_size=64),
)
def test_the_commit_seal_is_hmac_sha256_of_its_fields(secret: bytes, first: int, count: int, head: str) -> None:
    # The seal is computed from two keyed SHA-256 states instead of hmac's object: it must be HMAC-SHA256 byte for
    # byte (seals written before still verify, and a verifier with only the standard library agrees).
    written = base64.urlsafe_b64encode(secret).decode("ascii").rstrip("=")
    signer = AuditSigner(Keyring.of(AUDIT_KEYS, ("k7", written)))
    seal = signer.commit_seal(first, first + count, head)
    key = hashlib.sha256(b"kazma-audit-commit-v1" + secret).digest()
    mac = hmac.new(key, f"k7|{first}|{first + count}|{head}".encode("ascii"), hashlib.sha256).hexdigest()
    assert seal == f"k7:{first}:{mac}"
    assert signer.sealed_from(seal, first + count, head) == first
    assert signer.sealed_from(seal, first + count + 1, head) is None


async def test_a_checkpoint_committed_while_the_checkpointer_waited_for_the_lock_is_gone_on_after(pg_dsn: str) -> None:
    # Replica A holds the chain's lock and writes a checkpoint; this process's pass starts meanwhile (its statement's
    # snapshot taken before the lock is granted), then A commits. The pass must go on after A's checkpoint at the
    # first try: it signs nothing again (a second checkpoint at the same seq fails the pass, which the writer then
    # runs again), and the log verifies.
    engine = Engine("postgresql", pg_dsn)
    async with open_store(engine) as conn:
        service = ApprovalService(ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER), approvals_config())
        request = await service.open("shell", {"command": "deploy"}, "agent:builder", "telegram:-100")
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        events = await service.store.chain_events(limit=100)
        last = events[-1]
        theirs = TEST_SIGNER.sign("head", events[0].seq, last.seq, last.chain_hash or "", time.time())
        with psycopg.connect(pg_dsn, autocommit=False) as replica:
            replica.execute("SELECT pg_advisory_xact_lock(%s)", (CHAIN_LOCK,))
            replica.execute(
                "INSERT INTO audit_checkpoints (kind, first_seq, seq, head, at, key_id, signature)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (theirs.kind, theirs.first_seq, theirs.seq, theirs.head, theirs.at, theirs.key_id, theirs.signature),
            )
            writer: Any = await service.store.tables.writer()
            retries = writer.pipeline_retries
            passing = asyncio.create_task(Checkpointer(service.store, TEST_SIGNER).sign())
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            async with asyncio.timeout(10):
                while raw_rows(engine, waiting)[0][0] == 0:
                    await asyncio.sleep(0.005)
            replica.commit()
        judged = await asyncio.wait_for(passing, 10)
        assert judged.signed == []
        # ... at the first try: a pass that signed again (and failed on the checkpoint's seq) was run again.
        assert writer.pipeline_retries == retries
        assert judged.newest == (theirs.seq, theirs.at)
        checkpoints = await service.store.chain_checkpoints(limit=100)
        assert [(c.first_seq, c.seq, c.key_id) for c in checkpoints] == [(theirs.first_seq, theirs.seq, "a1")]
        report = verify(events, checkpoints, TEST_SIGNER.public_keys())
        assert report.ok, [p.line() for p in report.problems]


async def test_events_with_hostile_text_read_back_as_written_and_verify(store_engine: Engine) -> None:
    # On PostgreSQL the chain's columns travel as array literals built by Kazma: quotes, backslashes, braces,
    # commas, the word NULL, U+0000 and U+FDD0 must come back exactly (the hash is over what was given).
    hostile = ['say "hi"\\n', "{a,b}", "NULL", "", "nul\x00here", "\ufdd0\ufdd0", "  spaced  ", "é😀\u202e"]
    async with open_store(store_engine) as conn:
        store = ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER)
        service = ApprovalService(store, approvals_config())
        request = await service.open("shell", {"command": "deploy"}, "agent:builder", "telegram:-100")

        def hostile_events(tx: Any) -> None:
            for n, text in enumerate(hostile):
                store.chain.append(tx, request.id, "note", actor=text, platform=None, at=1764640000.0 + n / 3,
                                   args_hash=None, detail=text, person=text or None)  # fmt: skip

        await store.write(hostile_events)
        await Checkpointer(store, TEST_SIGNER).sign()
        events = await store.chain_events(limit=100)
        checkpoints = await store.chain_checkpoints(limit=100)
    notes = [e for e in events if e.event == "note"]
    assert [(e.actor, e.detail, e.person, e.at) for e in notes] == [
        (t, t, t or None, 1764640000.0 + n / 3) for n, t in enumerate(hostile)
    ]
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]


async def test_a_pass_finds_the_transactions_since_the_last_checkpoint_as_one_run(tmp_path: Any) -> None:
    # One SQLite writer: each transaction's events follow the last one's, so the chain keeps one run growing,
    # not one per transaction (a pass walked them all, and dropped them one by one). A run a checkpoint ends in
    # is never extended: the next pass looks its run up from that checkpoint's head, and signs without reading
    # the events back, every time.
    async with open_store(Engine("sqlite", str(tmp_path / "k.db"))) as conn:
        store = ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER)
        service = ApprovalService(store, approvals_config())
        checkpointer = Checkpointer(store, TEST_SIGNER)
        for _ in range(3):
            for _ in range(4):
                await service.open("shell", {"command": "deploy"}, "agent:builder", "telegram:-100")
            assert len(store.chain._committed_runs) == 1
            judged = await checkpointer.sign()
            assert not judged.unvouched
            assert len(judged.signed) == 1
            assert store.chain._committed_runs == {}
        events = await store.chain_events(limit=100)
        checkpoints = await store.chain_checkpoints(limit=100)
    assert [c.seq for c in checkpoints] == [4, 8, 12]
    assert verify(events, checkpoints, TEST_SIGNER.public_keys()).ok


async def test_sqlite_appends_after_the_head_it_remembers_and_reads_the_head_when_someone_else_wrote(
    tmp_path: Any,
) -> None:
    # One SQLite writer knows the head it last committed: it inserts after it without reading the head first. A
    # row another process (or someone around Kazma) wrote at the next number makes that insert fail whole (the
    # number is the table's key): nothing of the transaction's events is written twice or half, the head is read,
    # and the events go after what is there.
    path = tmp_path / "k.db"
    async with open_store(Engine("sqlite", str(path))) as conn:
        store = ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER)
        service = ApprovalService(store, approvals_config())
        first = await service.open("shell", {"command": "deploy"}, "agent:builder", "telegram:-100")
        writer = await store.tables.writer()
        heads: list[str] = []
        writer._connection().set_trace_callback(  # type: ignore[attr-defined]
            lambda sql: heads.append(sql) if sql.startswith("SELECT (SELECT seq FROM approval_events") else None
        )
        await service.decide(first.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert heads == []  # decided: appended after the head it remembered, none read
        await Attacker(Engine("sqlite", str(path))).run_around(
            ("INSERT INTO approval_events (seq, request_id, event, actor, at) VALUES (3, NULL, 'decided', 'x', 1)", ())
        )
        second = await service.open("shell", {"command": "deploy"}, "agent:builder", "telegram:-100")
        assert len(heads) == 1  # its insert at 3 failed: the head was read, the event went after the stray row
        await service.decide(second.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert len(heads) == 1  # and the head it then committed is remembered again
        assert (await Checkpointer(store, TEST_SIGNER).sign()).unvouched == [3]
        events = await store.chain_events(limit=100)
        checkpoints = await store.chain_checkpoints(limit=100)
    assert [(e.seq, e.event) for e in events] == [
        (1, "opened"),
        (2, "decided"),
        (3, "decided"),
        (4, "opened"),
        (5, "decided"),
    ]
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.first is not None
    assert (report.first.seq, report.first.kind) == (3, "inserted")


async def test_sqlite_events_of_one_transaction_are_written_all_or_none_after_the_remembered_head(
    tmp_path: Any,
) -> None:
    # Three events of one transaction (a decision and two lost presses) go in one insert after the remembered
    # head. A row around Kazma at the second of their numbers fails it whole: none of the three is left at 2
    # (under a row it did not follow), and all three go after the stray row, one chain.
    path = tmp_path / "k.db"
    await (await open_database(path, migrations=all_migrations())).close()
    conn = sqlite3.connect(path, isolation_level=None)
    chain = AuditChain(postgres=False, signer=TEST_SIGNER)

    def transaction(*events: str) -> None:
        conn.execute("BEGIN IMMEDIATE")
        tx = SqliteTx(conn)
        for event in events:
            chain.append(tx, "r1", event, actor="telegram:111", platform="telegram", at=1.5, args_hash="a" * 64)
        tx._run_deferred()
        conn.execute("COMMIT")
        tx._committed()

    try:
        transaction("opened")
        Attacker(Engine("sqlite", str(path))).run(
            ("INSERT INTO approval_events (seq, request_id, event, actor, at) VALUES (3, NULL, 'decided', 'x', 1)", ())
        )
        transaction("decided", "press_lost", "press_lost")
        rows = conn.execute("SELECT seq, event, prev_hash FROM approval_events ORDER BY seq").fetchall()
    finally:
        conn.close()
    assert [(seq, event) for seq, event, _ in rows] == [
        (1, "opened"), (3, "decided"), (4, "decided"), (5, "press_lost"), (6, "press_lost"),
    ]  # fmt: skip
    assert chain.last_committed_seq == 6


async def test_two_appends_in_one_sqlite_transaction_are_one_committed_run(tmp_path: Any) -> None:
    # The chain's flush runs once per transaction today; a flush that hands the chain more events in a later round
    # of the same transaction appends a second time. What commits must still be this chain's own, one run from the
    # head it followed to the last event: the checkpointer then signs the head it computed, reading nothing back.
    path = tmp_path / "k.db"
    await (await open_database(path, migrations=all_migrations())).close()
    conn = sqlite3.connect(path, isolation_level=None)
    chain = AuditChain(postgres=False, signer=TEST_SIGNER)

    def append(tx: Any, event: str) -> None:
        chain.append(tx, "r1", event, actor="telegram:111", platform="telegram", at=1.5, args_hash="a" * 64)

    def later_round(tx: Any, items: list[Any]) -> None:
        for event in items:
            append(tx, event)

    try:
        conn.execute("BEGIN IMMEDIATE")
        tx = SqliteTx(conn)
        append(tx, "opened")
        tx.defer(later_round, "decided")  # runs in the first round, hands "decided" to the chain for the second
        tx._run_deferred()
        conn.execute("COMMIT")
        tx._committed()
        rows = conn.execute("SELECT seq, event, chain_hash FROM approval_events ORDER BY seq").fetchall()
    finally:
        conn.close()
    assert [(seq, event) for seq, event, _ in rows] == [(1, "opened"), (2, "decided")]
    assert chain.last_committed_head == (2, rows[-1][2])
    assert chain.appended_all(0, "0" * 64, 2, rows[-1][2])


async def test_two_appends_in_one_sqlite_transaction_are_one_open_run_before_it_commits(tmp_path: Any) -> None:
    # A pass in the same transaction (a decision signed in its own commit) must find both appends this chain's own,
    # and which events the transaction appended: the second flush continues the first's run.
    path = tmp_path / "k.db"
    await (await open_database(path, migrations=all_migrations())).close()
    conn = sqlite3.connect(path, isolation_level=None)
    chain = AuditChain(postgres=False, signer=TEST_SIGNER)
    seen: list[Any] = []

    def append(tx: Any, event: str) -> None:
        chain.append(tx, "r1", event, actor="telegram:111", platform="telegram", at=1.5, args_hash="a" * 64)

    def later_round(tx: Any, items: list[Any]) -> None:
        for event in items:
            append(tx, event)
        tx.defer(look, None)  # runs after the chain's second flush (deferred before it in this round)

    def look(tx: Any, items: list[Any]) -> None:
        head = tx.one("SELECT seq, chain_hash FROM approval_events ORDER BY seq DESC LIMIT 1")
        seen.append((chain.appended_in(tx), chain.appended_all(0, "0" * 64, int(head[0]), str(head[1]), tx)))

    try:
        conn.execute("BEGIN IMMEDIATE")
        tx = SqliteTx(conn)
        append(tx, "opened")
        tx.defer(later_round, "decided")
        tx._run_deferred()
        conn.execute("COMMIT")
        tx._committed()
    finally:
        conn.close()
    assert seen == [((1, 2), True)]
    assert chain.appended_in(tx) is None  # committed: no open run
