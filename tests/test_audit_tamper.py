"""The audit log rewritten around Kazma, on SQLite and on PostgreSQL: `kazma audit verify` fails on every kind of
rewrite and names the first bad sequence number and what is wrong with it.

Each test lets Kazma write a real log (requests opened, approved, denied, timed out, an execution audited; signed
by the checkpointer in several passes), checks that `kazma audit verify` passes, then rewrites the store through
a connection of its own with the append-only triggers taken away (what the file's or the role's owner can do),
and runs `kazma audit verify` again.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kazma.approvals import ApprovalStore, Decision, PressVerdict, Status
from kazma.approvals.chain import ChainedEvent, event_hash
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import Checkpoint
from kazma.approvals.withdrawal import Gone
from kazma.bot.cli import main
from kazma.bot.cli.cli_identity import system_login
from tests.approvals_support import TEST_SIGNER, ManualClock, RecordingPublisher, approval_service
from tests.audit_support import (
    ARGS,
    FORGER,
    KEY_ENV,
    Attacker,
    Log,
    config_text,
    make_log,
    rechained,
    resigned,
    run_async,
)
from tests.policy_support import ALICE_ON_SLACK, policy_config
from tests.store_backends import Engine


def verify(tmp_path: Path, engine: Engine, *args: str) -> Result:
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, engine))
    return CliRunner().invoke(main, ["-c", str(config), "audit", "verify", *args], env=KEY_ENV)


def failed_at(result: Result, seq: int, kind: str) -> None:
    assert result.exit_code == 1, result.stdout
    assert f"FAILED: first bad sequence seq {seq}: {kind}:" in result.stdout, result.stdout


@pytest.fixture
def log(store_engine: Engine, tmp_path: Path) -> Log:
    made: Log = run_async(make_log(store_engine.where))
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 0, result.stdout
    assert result.stdout.startswith(f"ok: {made.last} events (seq 1..{made.last}) chained"), result.stdout
    return made


def test_a_decided_outcome_changed_in_the_store_fails_at_its_event(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    denied = log.seqs["decided:drop"]
    Attacker(store_engine).run(
        ("UPDATE approval_events SET detail = 'approved' WHERE seq = ?", (denied,)),
        ("UPDATE approval_requests SET status = 'approved' WHERE id = ?", (log.requests["drop"],)),
    )
    failed_at(verify(tmp_path, store_engine), denied, "changed")


def test_a_decided_outcome_changed_and_hashed_again_fails_at_its_event_not_the_next(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    # The algorithm is public: the forger writes the changed row's own chain hash again, so the row is consistent
    # in itself. Verify named the next event ("missing: the event it was chained after is not in the log").
    attacker = Attacker(store_engine)
    rows = {e.seq: e for e in attacker.events()}
    # Both decisions: the first inside a checkpoint's range, the second the last event a checkpoint signs.
    for name, outcome in (("decided:deploy", "denied"), ("decided:drop", "approved")):
        seq = log.seqs[name]
        row = rows[seq]
        assert row.prev_hash is not None
        attacker.run(
            ("UPDATE approval_events SET detail = ?, chain_hash = ? WHERE seq = ?",
             (outcome, replace(row, detail=outcome).hash_after(row.prev_hash), seq)),
        )  # fmt: skip
        result = verify(tmp_path, store_engine)
        failed_at(result, seq, "changed")
        assert "it was changed (and its chain hash written again)" in result.stdout, result.stdout
        attacker.run(("UPDATE approval_events SET detail = ?, chain_hash = ? WHERE seq = ?",
                      (row.detail, row.chain_hash, seq)))  # fmt: skip
        assert verify(tmp_path, store_engine).exit_code == 0  # put back: it holds again


def test_an_event_deleted_fails_as_missing_whether_the_rest_is_renumbered_or_not(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    approved = log.seqs["decided:deploy"]
    attacker = Attacker(store_engine)
    attacker.run(("DELETE FROM approval_events WHERE seq = ?", (approved,)))
    failed_at(verify(tmp_path, store_engine), approved, "missing")
    # The gap closed: every later event moved down one.
    attacker.run(
        ("UPDATE approval_events SET seq = seq + 1000 WHERE seq > ?", (approved,)),
        ("UPDATE approval_events SET seq = seq - 1001 WHERE seq > 1000", ()),
    )
    failed_at(verify(tmp_path, store_engine), approved, "missing")


def test_a_forged_event_inserted_in_the_middle_and_chained_right_fails_as_inserted(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    at = log.seqs["decided:drop"]  # a forged approval put where the denial was, the rest moved up one
    attacker = Attacker(store_engine)
    before = next(e for e in attacker.events() if e.seq == at - 1)
    forged = ("decided", "telegram:111", "telegram", before.at + 0.001, "approved")
    digest = event_hash(before.chain_hash or "", log.requests["drop"], *forged[:3], forged[3], None, forged[4])
    attacker.run(
        ("UPDATE approval_events SET seq = seq + 1000 WHERE seq >= ?", (at,)),
        ("UPDATE approval_events SET seq = seq - 999 WHERE seq > 1000", ()),
        (
            "INSERT INTO approval_events (seq, request_id, event, actor, platform, at, args_hash, detail, prev_hash,"
            " chain_hash) VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?, ?)",
            (at, log.requests["drop"], *forged, before.chain_hash, digest),
        ),
    )
    failed_at(verify(tmp_path, store_engine), at, "inserted")


def test_a_forged_event_appended_at_the_end_is_never_signed_even_after_kazma_appends_more(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    attacker = Attacker(store_engine)
    last = attacker.events()[-1]
    seq = log.last + 1
    digest = event_hash(last.chain_hash or "", log.requests["drop"], "decided", "telegram:111", "telegram",
                        last.at + 1, None, "approved")  # fmt: skip
    attacker.run(
        (
            "INSERT INTO approval_events (seq, request_id, event, actor, platform, at, detail, prev_hash, chain_hash)"
            " VALUES (?, ?, 'decided', 'telegram:111', 'telegram', ?, 'approved', ?, ?)",
            (seq, log.requests["drop"], last.at + 1, last.chain_hash, digest),
        ),
    )
    failed_at(verify(tmp_path, store_engine), seq, "unsigned")

    async def kazma_goes_on() -> None:
        async with approval_service(store_engine.where) as service:
            checkpointer = Checkpointer(service.store, TEST_SIGNER)
            request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
            await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
            judged = await checkpointer.sign()
            assert judged.unvouched == [seq]  # Kazma's own events after it are signed; the forged one is not
            assert [c.first_seq for c in judged.signed] == [seq + 1]

    run_async(kazma_goes_on())
    failed_at(verify(tmp_path, store_engine), seq, "unsigned")


def test_two_events_swapped_fail_as_reordered(store_engine: Engine, tmp_path: Path, log: Log) -> None:
    first, second = log.seqs["decided:deploy"], log.seqs["decided:drop"]
    Attacker(store_engine).run(
        ("UPDATE approval_events SET seq = -1 WHERE seq = ?", (first,)),
        ("UPDATE approval_events SET seq = ? WHERE seq = ?", (first, second)),
        ("UPDATE approval_events SET seq = ? WHERE seq = -1", (second,)),
    )
    failed_at(verify(tmp_path, store_engine), first, "reordered")


def test_the_last_events_cut_off_fail_as_truncated_and_a_cut_at_a_checkpoint_fails_against_an_earlier_head(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    attacker = Attacker(store_engine)
    head = attacker.events()[-1]
    keep = attacker.checkpoints()[-2].seq  # the last events and the checkpoint over them go
    attacker.run(("DELETE FROM approval_events WHERE seq > ?", (keep,)))
    failed_at(verify(tmp_path, store_engine), keep + 1, "truncated")
    # The checkpoints past the cut removed too: the log is consistent in itself, signed to its new end. The
    # request rows it recorded show the cut (test below); a head seen earlier, outside it, shows it too.
    attacker.run(("DELETE FROM audit_checkpoints WHERE seq > ?", (keep,)))
    late = log.requests["late"]
    result = verify(tmp_path, store_engine)
    failed_at(result, keep + 1, "truncated")
    assert f"request {late} is timeout (sealed) but the audit log has no timeout event for it" in result.stdout
    seen = f"{head.seq}:{(head.chain_hash or '')[:12]}"
    failed_at(verify(tmp_path, store_engine, "--head", seen), keep + 1, "truncated")


def test_a_cut_at_a_checkpoint_fails_on_the_finished_requests_whose_ending_events_went_with_it(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """The log cut right after its first checkpoint (the two requests opened), every later checkpoint removed: the
    chain and its signatures hold to the new end, but the rows of the requests decided after the cut are finished
    and sealed with no ending event in the log. Verify and doctor name each of them, not "3 decisions verified"."""
    attacker = Attacker(store_engine)
    keep = attacker.checkpoints()[0].seq
    assert keep == log.seqs["opened:drop"]
    attacker.run(
        ("DELETE FROM approval_events WHERE seq > ?", (keep,)), ("DELETE FROM audit_checkpoints WHERE seq > ?", (keep,))
    )
    result = verify(tmp_path, store_engine)
    failed_at(result, keep + 1, "truncated")
    deploy, drop, late = log.requests["deploy"], log.requests["drop"], log.requests["late"]
    cut = f"events after seq {keep} may have been cut"
    for line in (
        f"request {deploy} is approved (sealed) but the audit log has no decided event for it: {cut}",
        f"request {drop} is denied (sealed) but the audit log has no decided event for it: {cut}",
        f"request {late} is timeout (sealed) but the audit log has no timeout event for it: {cut}",
    ):
        assert line in result.stdout, result.stdout
    said = doctor(tmp_path, store_engine)
    assert said.startswith("FAIL"), said
    assert f"first bad sequence seq {keep + 1}: truncated" in said
    for rid, status, event in (
        (deploy, "approved", "decided"),
        (drop, "denied", "decided"),
        (late, "timeout", "timeout"),
    ):
        assert f"{rid} ({status}, no {event} event)" in said, said
    # The whole log cut, every checkpoint with it: an empty log beside request rows is no "empty, ok".
    attacker.run(("DELETE FROM approval_events", ()), ("DELETE FROM audit_checkpoints", ()))
    result = verify(tmp_path, store_engine)
    failed_at(result, 1, "truncated")
    assert (
        f"request {deploy} is approved (sealed) but the audit log has no decided event for it: the audit log is empty"
        in result.stdout
    )
    said = doctor(tmp_path, store_engine)
    assert said.startswith("FAIL"), said
    assert f"{deploy} (approved, no decided event)" in said, said


def test_a_consistent_rechained_forgery_without_the_key_fails_on_the_signature_and_against_a_head(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    attacker = Attacker(store_engine)
    events, checkpoints = attacker.events(), attacker.checkpoints()
    witness = events[log.seqs["decided:drop"] - 1]  # what the denial's settled card showed: its seq and head
    assert witness.seq == log.seqs["decided:drop"]
    head = f"{witness.seq}:{(witness.chain_hash or '')[:12]}"
    # The denial turned into an approval, and everything after it chained again: every link holds.
    forged = rechained([replace(e, detail="approved") if e.seq == witness.seq else e for e in events])
    # The original checkpoints kept: their heads are not the forged chain's.
    attacker.replace_log(forged, checkpoints)
    failed_at(verify(tmp_path, store_engine), next(c.first_seq for c in checkpoints if c.seq >= witness.seq),
              "changed")  # fmt: skip
    # Checkpoints signed again by a key of the forger's own under the real key's id: the signatures fail.
    attacker.replace_log(forged, resigned(forged, checkpoints, FORGER))
    result = verify(tmp_path, store_engine)
    failed_at(result, checkpoints[0].first_seq, "bad signature")
    assert "its signature does not verify with key a1" in result.stdout
    # Against the head the settled card showed, the forged log fails at that very event.
    failed_at(verify(tmp_path, store_engine, "--head", head), 1, "bad signature")
    assert f"seq {witness.seq}: changed: it hashes to" in verify(tmp_path, store_engine, "--head", head).stdout


def doctor(tmp_path: Path, engine: Engine) -> str:
    """The line `kazma doctor` prints for the audit chain (the other checks meet no platform here)."""
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, engine))
    result = CliRunner().invoke(
        main, ["-c", str(config), "doctor", "--platform-timeout", "1", "--model-timeout", "1"], env=KEY_ENV
    )
    [line] = [text for text in result.stdout.splitlines() if "audit chain" in text]
    return line


def test_doctor_verifies_the_tail_of_the_log_and_names_the_first_bad_sequence(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    clean = doctor(tmp_path, store_engine)
    assert clean.startswith("OK"), clean
    assert f"(seq 1..{log.last}) verify" in clean
    denied = log.seqs["decided:drop"]
    Attacker(store_engine).run(("UPDATE approval_events SET detail = 'approved' WHERE seq = ?", (denied,)))
    tampered = doctor(tmp_path, store_engine)
    assert tampered.startswith("FAIL"), tampered
    assert f"first bad sequence seq {denied}: changed" in tampered


def test_a_person_written_onto_a_decision_in_the_store_fails_at_its_event(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    approved = log.seqs["decided:deploy"]  # decided by an identity that is nobody's: no person recorded
    Attacker(store_engine).run(("UPDATE approval_events SET person = 'mallory' WHERE seq = ?", (approved,)))
    failed_at(verify(tmp_path, store_engine), approved, "changed")


def test_the_last_event_cut_from_inside_a_checkpoint_fails_as_truncated_there_not_as_unsigned(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    # The cut blamed Kazma's own intact events before it: "first bad sequence <the checkpoint's first>:
    # unsigned: ... written outside Kazma".
    attacker = Attacker(store_engine)
    last = attacker.checkpoints()[-1]
    assert last.first_seq < last.seq == log.last  # the cut falls inside its range
    attacker.run(("DELETE FROM approval_events WHERE seq = ?", (log.last,)))
    result = verify(tmp_path, store_engine)
    failed_at(result, log.last, "truncated")
    assert "unsigned" not in result.stdout, result.stdout


def test_the_last_event_a_checkpoint_signs_removed_mid_log_is_named_missing_not_the_one_before_it_unsigned(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    # The denial (the last event its checkpoint signs) deleted, or moved far past the end: verify named the intact
    # approval before it the first bad sequence, "unsigned: ... written outside Kazma".
    denied, approved = log.seqs["decided:drop"], log.seqs["decided:deploy"]
    attacker = Attacker(store_engine)
    over = next(c for c in attacker.checkpoints() if c.seq == denied)
    assert over.first_seq == approved < denied  # the approval is signed by the same checkpoint
    for rewrite in (
        ("UPDATE approval_events SET seq = ? WHERE seq = ?", (log.last + 100, denied)),
        ("DELETE FROM approval_events WHERE seq = ?", (log.last + 100,)),
    ):
        attacker.run(rewrite)
        result = verify(tmp_path, store_engine)
        failed_at(result, denied, "missing")
        assert f"seq {approved}: unsigned" not in result.stdout, result.stdout


def test_a_row_holding_what_kazma_never_writes_is_named_not_a_crash(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    if store_engine.name != "sqlite":
        pytest.skip("PostgreSQL's column types refuse text in a time and bytes in a text")
    attacker = Attacker(store_engine)
    seq, later = log.seqs["decided:drop"], log.seqs["decided:deploy"]
    attacker.run(
        ("UPDATE approval_events SET detail = X'64656e696564' WHERE seq = ?", (seq,)),  # bytes where text was
        ("UPDATE approval_events SET at = 'yesterday' WHERE seq = ?", (later,)),  # text where a time was
    )
    result = verify(tmp_path, store_engine)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    failed_at(result, min(seq, later), "changed")
    assert f"seq {max(seq, later)}: changed: it holds what Kazma never writes" in result.stdout, result.stdout


def test_doctor_names_a_log_whose_last_signed_events_were_removed(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    # Before: doctor left out every checkpoint past the last event it read, so this cut read "OK … verify".
    Attacker(store_engine).run(("DELETE FROM approval_events WHERE seq = ?", (log.last,)))
    line = doctor(tmp_path, store_engine)
    assert line.startswith("FAIL"), line
    assert f"FAILED: first bad sequence seq {log.last}: truncated: checkpoint #{log.last} (head)" in line, line


def test_kazma_appending_and_signing_between_verifys_reads_is_no_forgery(
    store_engine: Engine, tmp_path: Path, log: Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """doctor reads the events, then the checkpoints (verify: the checkpoints, then the events in pages), then
    the unsigned tail Kazma's commit seals vouch for. A running Kazma that appended and signed between those reads
    left that tail starting after its new checkpoint (not read): Kazma's own event, not signed when read, was named
    "unsigned: ... written outside Kazma", and both failed."""

    async def kazma_appends(title: str) -> None:
        async with approval_service(store_engine.where) as service:
            await service.open("shell", {"command": title}, "agent:builder", "telegram:-100")

    run_async(kazma_appends("uptime"))  # seq log.last + 1: sealed by its commit, not signed yet
    read_events: Callable[..., Coroutine[Any, Any, list[ChainedEvent]]] = ApprovalStore.chain_events
    read_checkpoints: Callable[..., Coroutine[Any, Any, list[Checkpoint]]] = ApprovalStore.chain_checkpoints
    read: set[str] = set()  # what this command read so far: Kazma goes on between its first two kinds of read

    async def between_reads(kind: str) -> None:
        if read and kind not in read and "kazma" not in read:  # once per command
            read.add("kazma")
            async with approval_service(store_engine.where) as service:
                await service.open("shell", {"command": "date"}, "agent:builder", "telegram:-100")
                judged = await Checkpointer(service.store, TEST_SIGNER).sign()
            # It signs the event the command read (or is about to) and the one appended meanwhile.
            assert [(c.first_seq, c.seq) for c in judged.signed] == [(unsigned[-1], unsigned[-1] + 1)]
        read.add(kind)

    async def events(store: ApprovalStore, *args: Any, **kwargs: Any) -> list[ChainedEvent]:
        await between_reads("events")
        return await read_events(store, *args, **kwargs)

    async def checkpoints(store: ApprovalStore, *args: Any, **kwargs: Any) -> list[Checkpoint]:
        await between_reads("checkpoints")
        return await read_checkpoints(store, *args, **kwargs)

    monkeypatch.setattr(ApprovalStore, "chain_events", events)
    monkeypatch.setattr(ApprovalStore, "chain_checkpoints", checkpoints)
    unsigned = [log.last + 1]
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 0, result.stdout
    # verify reads the checkpoints, then the events to the last seq then (Kazma's "date" is for the next verify).
    assert f"ok: {log.last + 1} events" in result.stdout, result.stdout
    assert "the last 1 are sealed by Kazma and not signed yet" in result.stdout, result.stdout
    read.clear()
    run_async(kazma_appends("whoami"))
    unsigned.append(log.last + 3)  # unsigned again
    line = doctor(tmp_path, store_engine)
    assert line.startswith("OK"), line


def test_every_way_kazma_ends_a_request_leaves_its_ending_event_so_no_cut_is_claimed(
    store_engine: Engine, tmp_path: Path
) -> None:
    """No false alarm: requests ended by every path Kazma has (a press without and with a card, the CLI, two people
    under a policy, a lost and a repeated press, a timeout by waiting, by the sweep and by a press past the deadline,
    a cancel, a withdrawal, a start's orphans) and one still pending: each row's event is on the log."""
    where = store_engine.where

    async def end_every_way() -> dict[str, str]:
        made: dict[str, str] = {}
        clock = ManualClock()
        async with approval_service(where, clock=clock, publisher=RecordingPublisher()) as service:
            checkpointer = Checkpointer(service.store, TEST_SIGNER)

            async def opened(name: str, deadline: float | None = None, *, durable: bool = False) -> str:
                request = await service.open("shell", ARGS, "agent:b", "telegram:-100", deadline, durable=durable)
                made[name] = request.id
                return made[name]

            press = await opened("press")
            assert (await service.decide(press, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
            lost = await service.decide(press, Decision.DENY, actor="slack:U111", platform="slack")
            assert lost.verdict is PressVerdict.LOST
            card = await opened("card")
            data = f"kz1:{card}:d"
            assert (await service.decide_from_button(data, actor="telegram:111", platform="telegram")).won
            await opened("cli", durable=True)  # a waiter a restart keeps: decided from the CLI after it
            await checkpointer.sign()
            overdue = await opened("overdue", deadline=5)
            swept = await opened("swept", deadline=5)
            clock.advance(10)
            late = await service.decide(overdue, Decision.APPROVE, actor="telegram:111", platform="telegram")
            assert late.verdict is PressVerdict.LOST
            assert swept in [o.request_id for o in await service.expire_overdue()]
            waited = await opened("waited", deadline=0.01)
            clock.advance(1)
            assert (await service.wait(waited)).status is Status.TIMEOUT
            cancelled = await opened("cancelled")
            assert (await service.cancel(cancelled, reason="the requester withdrew it")) is not None
            withdrawn = await opened("withdrawn")
            assert (await service.withdraw(withdrawn, Gone.DISCONNECTED))[0]
            await opened("pending", deadline=10_000, durable=True)
            await opened("orphan")
            await checkpointer.sign()
        async with approval_service(where, config=policy_config(), publisher=RecordingPublisher()) as service:
            two = (await service.open("shell", {"command": "rm -rf build"}, "agent:b", "telegram:-100")).id
            made["two"] = two
            first = await service.decide(two, Decision.APPROVE, actor="telegram:111", platform="telegram")
            assert first.verdict is PressVerdict.COUNTED
            again = await service.decide(two, Decision.APPROVE, actor=ALICE_ON_SLACK[0], platform="slack")
            assert again.verdict is PressVerdict.REPEATED
            second = await service.decide(two, Decision.APPROVE, actor="telegram:333", platform="telegram")
            assert second.verdict is PressVerdict.WON
        async with approval_service(where, publisher=RecordingPublisher()) as restarted:
            recovery = await restarted.recover()
            assert made["orphan"] in [r.id for r in recovery.cancelled]
            await Checkpointer(restarted.store, TEST_SIGNER).sign()
        return made

    made = run_async(end_every_way())
    config = tmp_path / "kazma.yaml"
    me = f"cli:{system_login()}"  # the command line decides as the system user running it
    config.write_text(config_text(tmp_path, store_engine).replace('"cli:ops"]', f'"cli:ops", "{me}"]'))
    cli = CliRunner().invoke(main, ["-c", str(config), "approvals", "approve", made["cli"]], env=KEY_ENV)
    assert cli.exit_code == 0, cli.output

    async def statuses() -> dict[str, str]:
        async with approval_service(where) as service:
            await Checkpointer(service.store, TEST_SIGNER).sign()
            assert await service.store.unrecorded_requests() == ([], False)
            return {name: str((await service.store.get(rid)).status) for name, rid in made.items()}  # type: ignore[union-attr]

    ended = run_async(statuses())
    assert set(ended.values()) == {"approved", "denied", "timeout", "cancelled", "pending"}, ended
    assert (ended["orphan"], ended["cli"], ended["two"]) == ("cancelled", "approved", "approved"), ended
    result = verify(tmp_path, store_engine)
    assert result.exit_code == 0, result.stdout
    assert doctor(tmp_path, store_engine).startswith("OK")


def test_show_says_a_finished_requests_ending_event_is_missing_from_the_log(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """`kazma approvals show` of a request decided after a cut showed its trail without its decision, and an empty
    trail once the whole log was cut, without saying why."""
    attacker = Attacker(store_engine)
    keep = attacker.checkpoints()[0].seq
    attacker.run(
        ("DELETE FROM approval_events WHERE seq > ?", (keep,)), ("DELETE FROM audit_checkpoints WHERE seq > ?", (keep,))
    )
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, store_engine))

    def show(request_id: str) -> list[str]:
        done = CliRunner().invoke(main, ["-c", str(config), "approvals", "show", request_id], env=KEY_ENV)
        assert done.exit_code == 0, done.output
        lines = done.stdout.splitlines()
        return lines[lines.index("audit") + 1 :]

    deploy, late = log.requests["deploy"], log.requests["late"]
    trail = show(deploy)
    assert "opened" in trail[0]
    assert trail[-1] == (
        f"  MISSING  request {deploy} is approved (sealed) but the audit log has no decided event for it: "
        f"events after seq {keep} may have been cut (`kazma audit verify`)"
    )
    [missing] = show(late)  # opened after the cut: nothing of it is left in the log
    assert missing.startswith(f"  MISSING  request {late} is timeout (sealed) but the audit log has no timeout event")
    attacker.run(("DELETE FROM approval_events", ()), ("DELETE FROM audit_checkpoints", ()))
    [missing] = show(deploy)
    assert "the audit log is empty" in missing


def test_a_request_row_changed_beside_its_ending_event_fails_at_that_event(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """A denial's row, and a timed-out request's, made approvals by someone else around Kazma, the log untouched:
    any ending event stood for any outcome, so verify said "ok" beside a log recording a denial by another person
    and a timeout. Each row is named at the event it contradicts, as changed, and so is doctor's."""
    drop, late = log.requests["drop"], log.requests["late"]
    attacker = Attacker(store_engine)
    attacker.run(
        ("UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:999' WHERE id = ?", (drop,)),
        ("UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:999' WHERE id = ?", (late,)),
    )
    result = verify(tmp_path, store_engine)
    denied, timed_out = log.seqs["decided:drop"], log.seqs["timeout:late"]
    failed_at(result, denied, "changed")
    assert (
        f"request {drop}'s row says approved by telegram:999, but the audit log records its decided event at seq "
        f"{denied} ('denied: no') by slack:U111: the row was changed around Kazma" in result.stdout
    ), result.stdout
    assert f"seq {timed_out}: changed: request {late}'s row says approved by telegram:999" in result.stdout
    said = doctor(tmp_path, store_engine)
    assert said.startswith("FAIL"), said
    assert f"request {drop}'s row says approved by telegram:999" in said, said
    # The decider alone changed on an approval: its decided event names another person.
    deploy = log.requests["deploy"]
    attacker.run(
        ("UPDATE approval_requests SET status = 'denied', decided_by = 'slack:U111' WHERE id = ?", (drop,)),
        ("UPDATE approval_requests SET status = 'timeout', decided_by = NULL WHERE id = ?", (late,)),
        ("UPDATE approval_requests SET decided_by = 'telegram:999' WHERE id = ?", (deploy,)),
    )
    result = verify(tmp_path, store_engine)
    failed_at(result, log.seqs["decided:deploy"], "changed")
    assert f"request {deploy}'s row says approved by telegram:999" in result.stdout


def test_an_audit_key_that_cannot_be_used_is_said_with_why(store_engine: Engine, tmp_path: Path, log: Log) -> None:
    """$KAZMA_AUDIT_KEY set but malformed read "no usable audit key at ... or in $KAZMA_AUDIT_KEY", as if never set:
    what is wrong with it is said, and a key missing is told apart from one that cannot be used."""
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, store_engine))
    for env, command, said in (
        (
            {**KEY_ENV, "KAZMA_AUDIT_KEY": "a1:short"},
            "verify",
            "the audit key cannot be used: $KAZMA_AUDIT_KEY: key a1",
        ),
        ({**KEY_ENV, "KAZMA_AUDIT_KEY": "a1:short"}, "public-key", "the audit key cannot be used: $KAZMA_AUDIT_KEY"),
        ({**KEY_ENV, "KAZMA_AUDIT_KEY": None}, "verify", "no audit key at "),
    ):
        result = CliRunner().invoke(main, ["-c", str(config), "audit", command], env=env)
        assert result.exit_code == 2, result.stderr
        assert said in result.stderr, result.stderr


def test_a_verifier_holding_another_key_is_told_no_checkpoint_verifies_with_it(
    store_engine: Engine, tmp_path: Path, log: Log
) -> None:
    """$KAZMA_AUDIT_KEY of another deployment under the same id: every checkpoint "bad signature", each line alone
    reading as a forgery. The output says that none verifies, and that the keys are the first thing to check."""
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, store_engine))
    other = {**KEY_ENV, "KAZMA_AUDIT_KEY": "a1:Zm9yZ2VyLWtleS1vZi0zMi1ieXRlcy1vbmx5LWZha2U"}
    result = CliRunner().invoke(main, ["-c", str(config), "audit", "verify"], env=other)
    failed_at(result, 1, "bad signature")
    assert "note: none of the 3 checkpoints verifies with the public keys given" in result.stdout, result.stdout
    # One checkpoint forged among good ones is no key mix-up: no such note.
    attacker = Attacker(store_engine)
    last = attacker.checkpoints()[-1]
    attacker.run(("UPDATE audit_checkpoints SET signature = ? WHERE seq = ?", (FORGER.sign(
        last.kind, last.first_seq, last.seq, last.head, last.at).signature, last.seq)))  # fmt: skip
    result = verify(tmp_path, store_engine)
    failed_at(result, last.first_seq, "bad signature")
    assert "note: none of" not in result.stdout
