"""An audit key rotated while ``kazma run`` runs: another process (``kazma approvals approve``) seals its events with
the new key; the running Kazma reads its key file again to vouch for them, keeps signing with the key it started
with, and a forged seal (a made-up key, or the new key's id with a wrong MAC) is never vouched for, costs no read
of the key file per seal, and stops nothing of Kazma's own being signed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import AuditSigner
from kazma.config.keyring import AUDIT_KEYS, Keyring, open_keyring, retire_key, rotate_key_file
from tests.approvals_support import approval_service
from tests.audit_support import Attacker, whole_log
from tests.store_backends import Engine

ARGS = {"command": "uptime"}


@pytest.mark.parametrize("signed_before", [True, False], ids=["signed-before", "first-signature-after"])
async def test_events_sealed_with_a_key_rotated_in_while_kazma_ran_are_signed_and_verify(
    store_engine: Engine, tmp_path: Path, signed_before: bool
) -> None:
    folder = tmp_path / "keys"
    running = AuditSigner(open_keyring(AUDIT_KEYS, folder, environ={}))
    async with approval_service(store_engine.where, audit=running) as here:
        checkpointer = Checkpointer(here.store, running)
        await here.open("shell", ARGS, "agent:builder", "telegram:-100")
        if signed_before:
            await checkpointer.sign()
        rotate_key_file(AUDIT_KEYS, folder, environ={})
        cli = AuditSigner(open_keyring(AUDIT_KEYS, folder, environ={}))
        assert (running.key_id, cli.key_id) == ("k1", "k2")
        async with approval_service(store_engine.where, audit=cli) as elsewhere:
            # Sealed with k2; the process ends before any signing pass of its own.
            await elsewhere.open("shell", ARGS, "agent:builder", "telegram:-100")
        await here.open("shell", ARGS, "agent:builder", "telegram:-100")
        judged = await checkpointer.sign()
        events, checkpoints = await whole_log(here)
    assert judged.unvouched == []
    assert judged.signed[-1].seq == 3
    # It keeps signing with the key it started with: its first signature after reading the rotated file signed
    # with k2's seed under k1's id, a checkpoint that never verified.
    assert {c.key_id for c in checkpoints} == {"k1"}
    report = verify(events, checkpoints, cli.public_keys())
    assert report.ok, [p.line() for p in report.problems]


async def test_forged_seals_are_never_vouched_for_read_the_key_file_once_and_stop_no_signing(
    store_engine: Engine, tmp_path: Path
) -> None:
    folder = tmp_path / "keys"
    ring = open_keyring(AUDIT_KEYS, folder, environ={})
    running = AuditSigner(ring)
    rotate_key_file(AUDIT_KEYS, folder, environ={})
    cli = AuditSigner(open_keyring(AUDIT_KEYS, folder, environ={}))
    async with approval_service(store_engine.where, audit=cli) as elsewhere:
        for _ in range(4):
            await elsewhere.open("shell", ARGS, "agent:builder", "telegram:-100")
    # Seals naming keys that are nowhere, and one naming the rotated-in key with a MAC it did not make.
    forge = "UPDATE approval_events SET commit_seal = ? WHERE seq = ?"
    Attacker(store_engine).run(
        (forge, (f"x1:1:{'0' * 64}", 1)),
        (forge, (f"x2:2:{'0' * 64}", 2)),
        (forge, (f"k2:3:{'0' * 64}", 3)),
    )
    async with approval_service(store_engine.where, audit=running) as here:
        checkpointer = Checkpointer(here.store, running)
        await here.open("shell", ARGS, "agent:builder", "telegram:-100")
        judged = await checkpointer.sign()
        read = ring.current  # a read of the file makes new keys
        assert ring.ids == ("k2", "k1")
        async with approval_service(store_engine.where, audit=cli) as elsewhere:
            await elsewhere.open("shell", ARGS, "agent:builder", "telegram:-100")
        await Attacker(store_engine).run_around((forge, (f"made-up:6:{'0' * 64}", 6)))
        await here.open("shell", ARGS, "agent:builder", "telegram:-100")
        again = await checkpointer.sign()
        assert ring.current is read  # the file did not change: the made-up key cost no read of it
        events, checkpoints = await whole_log(here)
    assert judged.unvouched == [1, 2, 3]
    assert judged.unknown_keys == {"x1", "x2"}  # k2 is held: its seal is forged by its MAC, not its key
    assert [(c.first_seq, c.seq) for c in judged.signed] == [(4, 5)]
    assert again.unvouched == [6]
    assert again.unknown_keys == {"made-up"}
    assert [(c.first_seq, c.seq) for c in again.signed] == [(7, 7)]
    report = verify(events, checkpoints, cli.public_keys())
    assert report.first is not None
    assert (report.first.seq, report.first.kind) == (1, "unsigned")


async def test_kazma_keeps_vouching_for_its_own_events_when_its_key_is_retired_while_it_runs(tmp_path: Path) -> None:
    # `kazma keys rotate --audit` then `keys retire k1 --audit` without a restart: the running Kazma still seals
    # with k1. Reading the file again (for k2's seal) dropped k1 from its keyring, and every event it appended after
    # was counted unvouched, never signed, until a restart.
    folder = tmp_path / "keys"
    running = AuditSigner(open_keyring(AUDIT_KEYS, folder, environ={}))
    rotate_key_file(AUDIT_KEYS, folder, environ={})
    retire_key(AUDIT_KEYS, folder, "k1", environ={})
    cli = AuditSigner(open_keyring(AUDIT_KEYS, folder, environ={}))
    async with approval_service(tmp_path / "k.db", audit=cli) as elsewhere:
        await elsewhere.open("shell", ARGS, "agent:builder", "telegram:-100")
    async with approval_service(tmp_path / "k.db", audit=running) as here:
        checkpointer = Checkpointer(here.store, running)
        await here.open("shell", ARGS, "agent:builder", "telegram:-100")
        judged = await checkpointer.sign()
    assert running.keyring.ids == ("k2",)
    assert judged.unvouched == []
    assert [(c.first_seq, c.seq, c.key_id) for c in judged.signed] == [(1, 2, "k1")]


async def test_a_replica_sealing_with_a_key_the_others_do_not_hold_is_named_in_their_log(
    store_engine: Engine,
) -> None:
    # KAZMA_AUDIT_KEY rotated on one replica first (the new key put first there): the others cannot read it
    # anywhere, count its events unvouched and sign past them. Their log said only "written around Kazma".
    old = AuditSigner(Keyring.of(AUDIT_KEYS, ("a1", "YXVkaXQta2V5LW9mLWV2ZXJ5LWthem1hLXRlc3QtLS0")))
    new = AuditSigner(
        Keyring.of(
            AUDIT_KEYS, ("a2", "bmV3LWF1ZGl0LWtleS1vZi1rYXptYS10ZXN0LS0tLS0"), ("a1", old.keyring.current.written)
        )
    )
    async with approval_service(store_engine.where, audit=new) as rotated:
        await rotated.open("shell", ARGS, "agent:builder", "telegram:-100")
    async with approval_service(store_engine.where, audit=old) as here:
        await here.open("shell", ARGS, "agent:builder", "telegram:-100")
        with capture_logs() as logs:
            judged = await Checkpointer(here.store, old).sign()
    assert judged.unvouched == [1]
    assert judged.unknown_keys == {"a2"}
    [said] = [e for e in logs if e["event"] == "audit.seal_key_unknown"]
    assert (said["keys"], said["held"]) == (["a2"], ["a1"])
    assert "KAZMA_AUDIT_KEY" in said["detail"]
