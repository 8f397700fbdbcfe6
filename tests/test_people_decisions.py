"""Every decision records the person (under ``people:``) beside the identity they used, the seal binds both, and a
store made before people were recorded keeps every past decision readable — and its genuine approvals runnable.

Store-level tests run on SQLite and on PostgreSQL (``store_engine``); forgeries are written around Kazma, through a
connection of their own, as in tests/test_decision_seals.py.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from prometheus_client import REGISTRY

from kazma.approvals import ApprovalStore, Decision, Status
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.seal import seal_problem
from kazma.approvals.service import ApprovalService
from kazma.bot.store import all_migrations, pg_migrations
from kazma.config import load_config_text
from kazma.config.store.database import Migration
from kazma.config.store.postgres import pyformat
from tests.approvals_support import APPROVERS_YAML, TEST_KEY, TEST_KEYRING, approval_service
from tests.child_env import child_env
from tests.store_backends import Engine, open_store, raw_rows
from tests.test_decision_seals import ARGS, forge, refused

PEOPLE_YAML = """
people:
  alice: {telegram: 111, slack: U111, web: admin}
approvals:
  approvers: [alice, "discord:222"]
"""
PEOPLE = load_config_text(PEOPLE_YAML, environ={}).config


def decided_count(person: str, platform: str) -> float:
    labels = {"outcome": "approved", "platform": platform, "person": person}
    return REGISTRY.get_sample_value("kazma_approvals_decided_total", labels) or 0.0


async def test_a_decision_records_the_person_and_the_identity_and_the_seal_binds_both(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=PEOPLE) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        before = decided_count("alice", "slack")
        pressed = await service.decide(request.id, Decision.APPROVE, actor="slack:U111", platform="slack")
        assert pressed.won
        assert pressed.message == "Approved. Recorded as alice (slack:U111)."
        row = await service.store.get(request.id)
        assert row is not None
        assert (row.decided_person, row.decided_by, row.decided_via) == ("alice", "slack:U111", "slack")
        assert row.decision_mac is not None
        assert row.decision_mac.startswith("v2:")
        assert seal_problem(TEST_KEYRING, row) is None
        outcome = row.outcome()
        assert outcome is not None
        assert outcome.summary().startswith("approved by alice (slack:U111) via slack at ")
        assert outcome.for_agent() == "Approved by alice (slack:U111)."
        [decided] = await service.store.events(request.id, event="decided")
        assert (decided.actor, decided.person, decided.platform) == ("slack:U111", "alice", "slack")
        assert decided_count("alice", "slack") == before + 1
        await service.verify_execution(request.id, "shell", ARGS)  # a genuine, sealed approval runs

        # the same person at another door is still the same person; a press that loses names them too
        lost = await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert not lost.won
        [press_lost] = await service.store.events(request.id, event="press_lost")
        assert (press_lost.actor, press_lost.person) == ("telegram:111", "alice")

        # an identity nobody claimed is recorded alone
        other = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert (await service.decide(other.id, Decision.DENY, actor="discord:222", platform="discord")).won
        row = await service.store.get(other.id)
        assert row is not None
        assert row.decided_person is None
        assert seal_problem(TEST_KEYRING, row) is None
        outcome = row.outcome()
        assert outcome is not None
        assert outcome.summary().startswith("denied by discord:222 via discord at ")


async def test_a_refused_press_names_the_person_in_the_audit(store_engine: Engine) -> None:
    config = load_config_text(PEOPLE_YAML.replace("[alice, ", "[") + "\n", environ={}).config
    async with approval_service(store_engine.where, config=config) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        refusal = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert refusal.message == "You (alice (telegram:111)) are not an approver here; nothing was recorded."
        [refused_row] = await service.store.events(request.id, event="press_refused")
        assert (refused_row.actor, refused_row.person) == ("telegram:111", "alice")


async def test_changing_the_person_after_the_fact_breaks_the_seal(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=PEOPLE) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        await forge(
            store_engine,
            [
                ("UPDATE approval_requests SET decided_person = 'mallory' WHERE id = ?", (request.id,)),
                (
                    "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail, person)"
                    " VALUES (?, 'decided', 'telegram:111', 'telegram', 1, ?, 'approved', 'mallory')",
                    (request.id, request.args_hash),
                ),
            ],
            no_triggers=True,
        )
        await refused(service, request.id, "seal does not verify")


async def test_the_person_is_final_with_the_outcome(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=PEOPLE) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
    final = (sqlite3.IntegrityError, psycopg.errors.IntegrityError)
    with pytest.raises(final, match="approval outcomes are final"):
        await forge(store_engine, [("UPDATE approval_requests SET decided_person = 'bob' WHERE id = ?", (request.id,))])
    assert raw_rows(store_engine, "SELECT decided_person FROM approval_requests WHERE id = ?", (request.id,)) == [
        ("alice",)
    ]


# --------------------------------------------------------------------------- a store made before people

# What the release before people wrote, byte for byte: its seal (approvals/seal.py, "kazma-decision-v1") of these
# two decisions with TEST_KEY, computed by that release's own code.
OLD_ARGS = {"command": "ls /srv"}
OLD_SEALS = {
    ("OldApproved00000000000a1", "approved", "telegram:111", "telegram"): (
        "0516b802230bd635c57005aafbb4ab8cc248c2fa39e624ebcb853bab8ce7b2fb"
    ),
    ("OldDenied000000000000d1", "denied", "web:admin", "web"): (
        "32ed9916b012e3837ac52711a171da2f95eea96a4375a3fbb4e3ff905f712162"
    ),
}
OLD_DECIDED_AT = 1_700_000_100.5


def _before_people(migrations: list[Migration]) -> list[Migration]:
    """The store's schema as the release before people left it: approvals at v8, sessions at v1, no people."""
    limits = {"approvals": 8, "sessions": 1}
    return [m for m in migrations if m.component != "people" and m.version <= limits.get(m.component, m.version)]


def _write_as_the_old_release(engine: Engine) -> None:
    """Rows exactly as the old release's statements wrote them: its columns, its audit rows, its seals."""
    statements: list[tuple[str, tuple[object, ...]]] = []
    for (rid, status, by, via), mac in OLD_SEALS.items():
        statements += [
            (
                "INSERT INTO approval_requests (id, tool, args_json, args_hash, requested_by, conversation, task_id,"
                " created_at, deadline, status, decided_by, decided_via, decided_at, reason, notes, durable, waits,"
                " last_seen, decision_mac, decision_key_id, owner)"
                " VALUES (?, 'shell', ?, ?, 'agent:builder', 'telegram:-100', NULL, ?, ?, ?, ?, ?, ?, NULL, '[]', 0,"
                " NULL, NULL, ?, 'k1', NULL)",
                (
                    rid,
                    canonical_json(OLD_ARGS),
                    args_hash(OLD_ARGS),
                    OLD_DECIDED_AT - 30,
                    OLD_DECIDED_AT + 600,
                    status,
                    by,
                    via,
                    OLD_DECIDED_AT,
                    mac,
                ),
            ),
            (
                "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
                " VALUES (?, 'opened', 'agent:builder', NULL, ?, ?, 'tool=shell')",
                (rid, OLD_DECIDED_AT - 30, args_hash(OLD_ARGS)),
            ),
            (
                "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
                " VALUES (?, 'decided', ?, ?, ?, ?, ?)",
                (rid, by, via, OLD_DECIDED_AT, args_hash(OLD_ARGS), status),
            ),
        ]
    statements.append(
        (
            "INSERT INTO web_sessions (token_hash, login, role, binding, flash, created_at, last_seen, expires_at)"
            " VALUES ('h', 'admin', 'operator', 'b', '[]', 1, 1, 2)",
            (),
        )
    )
    if engine.postgres:
        with psycopg.connect(engine.where, autocommit=True) as pg, pg.transaction():
            for sql, params in statements:
                pg.execute(pyformat(sql), params)
        return
    with sqlite3.connect(engine.where) as lite:
        for sql, params in statements:
            lite.execute(sql, params)
    lite.close()


async def test_a_store_made_before_people_keeps_every_past_decision(store_engine: Engine) -> None:
    old = _before_people(pg_migrations() if store_engine.postgres else all_migrations())
    async with open_store(store_engine, migrations=old):
        pass
    _write_as_the_old_release(store_engine)
    # This release opens it: people are recorded from now on, and alice now claims telegram:111.
    async with open_store(store_engine) as conn:
        service = ApprovalService(ApprovalStore(conn, keyring=TEST_KEYRING), PEOPLE)
        for (rid, status, by, via), mac in OLD_SEALS.items():
            row = await service.store.get(rid)
            assert row is not None
            assert (row.status.value, row.decided_by, row.decided_via, row.decided_person) == (status, by, via, None)
            assert row.decision_mac == mac
            assert seal_problem(TEST_KEYRING, row) is None  # the old seal still verifies, as it was made
            outcome = row.outcome()
            assert outcome is not None
            assert outcome.summary().startswith(f"{status} by {by} via {via} at ")  # no person made up afterwards
            events = await service.store.events(rid)
            assert [(e.event, e.actor, e.person) for e in events] == [
                ("opened", "agent:builder", None),
                ("decided", by, None),
            ]
        # the old approval is a genuine one: it still runs
        await service.verify_execution("OldApproved00000000000a1", "shell", OLD_ARGS)
        # a person written onto a decision sealed before people is refused, not believed
        await forge(
            store_engine,
            [("UPDATE approval_requests SET decided_person = 'alice' WHERE id = 'OldApproved00000000000a1'", ())],
            no_triggers=True,
        )
        row = await service.store.get("OldApproved00000000000a1")
        assert row is not None
        problem = seal_problem(TEST_KEYRING, row)
        assert problem is not None
        assert "made before seals bound people" in problem.detail
        # and new decisions on the upgraded store name the person
        new = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert (await service.decide(new.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        row = await service.store.get(new.id)
        assert row is not None
        assert (row.decided_person, row.status) == ("alice", Status.APPROVED)
    sessions = raw_rows(store_engine, "SELECT login, role FROM web_sessions")
    assert sessions == [("admin", "operator")]


def test_kazma_approvals_show_reads_a_decision_made_before_people(tmp_path: Path) -> None:
    engine = Engine("sqlite", str(tmp_path / "k.db"))

    async def make() -> None:
        async with open_store(engine, migrations=_before_people(all_migrations())):
            pass

    asyncio.run(make())
    _write_as_the_old_release(engine)
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: '{engine.where}'}}\n" + APPROVERS_YAML)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}

    def kazma(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kazma.bot.cli", "-c", str(config), *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=child_env({"KAZMA_DECISION_KEY": f"{TEST_KEY[0]}:{TEST_KEY[1]}"}, base=clean),
            timeout=120,
            check=False,
        )

    # A command that only reads refuses a store this old (it would have to upgrade it); the upgrade is its own step.
    migrated = kazma("store", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    shown = kazma("approvals", "show", "OldApproved00000000000a1")
    assert shown.returncode == 0, shown.stderr
    assert "outcome    approved by telegram:111 via telegram at" in shown.stdout
    assert "seal       verified (key k1)" in shown.stdout
