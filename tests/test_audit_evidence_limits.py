"""What the audit trail proves, and what it cannot: an export cut at its front is a slice and says so (its header is
not signed, so only a signed start counts); a head too short to prove anything is refused; a public-key file that
names a key twice is refused; a row whose text is not UTF-8 is named at its sequence number by verify, export and
doctor, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kazma.approvals.checkpointer import Checkpointer, Judged
from kazma.approvals.checkpoints import PublicKeyError, PublicKeys
from kazma.bot.cli import main
from tests.approvals_support import TEST_SIGNER, approval_service
from tests.audit_support import FORGER, KEY_ENV, Attacker, Log, config_text, make_log, run_async
from tests.store_backends import Engine

ELSEWHERE: dict[str, str | None] = {name: None for name in KEY_ENV}  # the verifier's machine: no key in its environment


def kazma(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=KEY_ENV if env is None else env)


@pytest.fixture
def sqlite(tmp_path: Path) -> Engine:
    return Engine("sqlite", str(tmp_path / "k.db"))


@pytest.fixture
def log(sqlite: Engine) -> Log:
    made: Log = run_async(make_log(sqlite.where))
    return made


@pytest.fixture
def config(tmp_path: Path, sqlite: Engine, log: Log) -> Path:
    path = tmp_path / "kazma.yaml"
    path.write_text(config_text(tmp_path, sqlite))
    return path


def export_of(tmp_path: Path, config: Path) -> tuple[Path, Path]:
    export, public = tmp_path / "audit.jsonl", tmp_path / "audit.pub"
    done = kazma("-c", str(config), "audit", "export", "--out", str(export))
    assert done.exit_code == 0, done.output
    done = kazma("-c", str(config), "audit", "public-key", "--out", str(public))
    assert done.exit_code == 0, done.output
    return export, public


def verify_export(export: Path, public: Path, *args: str) -> Result:
    return kazma("audit", "verify", "--from-export", str(export), "--public-key", str(public), *args, env=ELSEWHERE)


def _records(export: Path) -> list[dict[str, object]]:
    return [json.loads(text) for text in export.read_text().splitlines() if text.strip()]


def _write(export: Path, records: list[dict[str, object]]) -> None:
    export.write_text("".join(json.dumps(record) + "\n" for record in records))


def _doctors_audit_chain_line(config: Path) -> str:
    doctor = kazma("-c", str(config), "doctor", "--platform-timeout", "1", "--model-timeout", "1")
    [line] = [text for text in doctor.output.splitlines() if "audit chain" in text]
    return line


def _two_appended_the_first_rewritten_then_signed(sqlite: Engine, assignment: str, seq: int) -> Judged:
    """Two requests opened, the row at `seq` rewritten by an attacker with the SQL `assignment`, then a signing
    pass by a process that did not append them (it reads them back)."""

    async def appended() -> None:
        async with approval_service(sqlite.where) as service:
            await service.open("shell", {"command": "uptime"}, "agent:builder", "telegram:-100")
            await service.open("shell", {"command": "date"}, "agent:builder", "telegram:-100")

    async def signed() -> Judged:
        async with approval_service(sqlite.where) as service:
            return await Checkpointer(service.store, TEST_SIGNER).sign()

    run_async(appended())
    Attacker(sqlite).run((f"UPDATE approval_events SET {assignment} WHERE seq = ?", (seq,)))  # noqa: S608
    judged: Judged = run_async(signed())
    return judged


def test_an_export_cut_at_its_front_is_a_slice_and_passes_only_where_a_slice_is_expected(
    tmp_path: Path, config: Path, log: Log
) -> None:
    export, public = export_of(tmp_path, config)
    done = verify_export(export, public)
    assert done.exit_code == 0, done.output
    assert "from the start of the log (seq 1, chained from its first link)" in done.output, done.output
    # The events before (and the checkpoints over) the first checkpoint's head removed, and the header with them:
    # what is left is consistent in itself, and read "ok" as if it were the whole log.
    records = _records(export)
    cut = min(int(str(r["seq"])) for r in records if r["type"] == "checkpoint")
    kept = [r for r in records if r["type"] != "header" and int(str(r["seq"])) > cut]
    _write(export, kept)
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    said = f"slice from seq {cut + 1}: the events before it are not in this file"
    assert f"FAILED: first bad sequence seq 1: missing: {said}" in done.output, done.output
    # Named as a slice, it verifies as one, and says so.
    done = verify_export(export, public, "--since", str(cut + 1))
    assert done.exit_code == 0, done.output
    assert f"a slice from seq {cut + 1}: nothing in it proves the events before it" in done.output, done.output
    # A header claiming the slice is what was asked is not signed: it changes nothing.
    header = {"type": "header", "format": "kazma-audit-v1", "since": cut + 1, "key_ids": ["a1"], "exported_at": 1.0}
    _write(export, [header, *kept])
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert said in done.output, done.output
    assert f"its header says --since {cut + 1}, but the header is not signed" in done.output, done.output
    # A slice expected from earlier than it starts lost the events between.
    done = verify_export(export, public, "--since", "2")
    assert done.exit_code == 1, done.output
    span = "seq 2 is" if cut == 2 else f"seqs 2..{cut} are"
    assert f"FAILED: first bad sequence seq 2: missing: {span} not in this file" in done.output, done.output


def test_an_export_cut_down_to_its_header_proves_nothing_and_fails(tmp_path: Path, config: Path, log: Log) -> None:
    export, public = export_of(tmp_path, config)
    _write(export, _records(export)[:1])  # every event and checkpoint removed: it read "ok: the audit log is empty"
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert "FAILED: first bad sequence seq 1: missing: this file holds no event: it proves nothing" in done.output
    # Its header says it holds the log from seq 1: a slice expected does not excuse it ...
    assert verify_export(export, public, "--since", str(log.last + 1)).exit_code == 1
    # ... but an empty slice asked for (`audit export --since` past the last event) is what it is.
    done = kazma("-c", str(config), "audit", "export", "--since", str(log.last + 1), "--out", str(export))
    assert done.exit_code == 0, done.output
    done = verify_export(export, public, "--since", str(log.last + 1))
    assert done.exit_code == 0, done.output
    assert "ok: this slice holds no event" in done.output, done.output


def test_an_export_asked_since_a_sequence_number_verifies_as_a_slice_when_told_so(
    tmp_path: Path, config: Path, log: Log
) -> None:
    since = log.seqs["execution_started:deploy"]
    export = tmp_path / "later.jsonl"
    done = kazma("-c", str(config), "audit", "export", "--since", str(since), "--out", str(export))
    assert done.exit_code == 0, done.output
    _, public = export_of(tmp_path, config)
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert f"slice from seq {since}: the events before it are not in this file" in done.output, done.output
    done = verify_export(export, public, "--since", str(since))
    assert done.exit_code == 0, done.output


@pytest.mark.parametrize("hex_digits", [0, 6, 11])
def test_a_head_too_short_to_prove_anything_is_refused(
    tmp_path: Path, config: Path, sqlite: Engine, log: Log, hex_digits: int
) -> None:
    full = next(event.chain_hash for event in Attacker(sqlite).events() if event.seq == log.last)
    assert full is not None
    head = f"{log.last}:{full[:hex_digits]}"
    done = kazma("-c", str(config), "audit", "verify", "--head", head)
    assert done.exit_code == 2, done.output
    assert "at least 12 hex digits" in done.output, done.output
    # The same in an earlier export's checkpoint (a file anyone could have edited).
    export, _ = export_of(tmp_path, config)
    records = _records(export)
    for record in records:
        if record["type"] == "checkpoint":
            record["head"] = str(record["head"])[:hex_digits]
    _write(export, records)
    done = kazma("-c", str(config), "audit", "verify", "--heads-from", str(export))
    assert done.exit_code == 2, done.output
    assert "at least 12 hex digits" in done.output, done.output


def test_a_public_key_file_naming_one_key_id_twice_is_refused_naming_the_line_and_the_id() -> None:
    ours, key_id = TEST_SIGNER.public_keys().text().strip(), TEST_SIGNER.key_id
    other = FORGER.public_keys().text().strip()  # another key under the same id
    assert other != ours
    assert FORGER.key_id == key_id
    with pytest.raises(
        PublicKeyError, match=rf"keys\.pub \(line 3\): key id {key_id} is given twice \(first on line 1\)"
    ):
        PublicKeys.parse(f"{ours}\n# a comment\n{other}\n", source="keys.pub")
    # The same key twice (two `kazma audit public-key` outputs joined) replaces nothing: read.
    assert PublicKeys.parse(f"{ours}\n{ours}\n", source="keys.pub").ids == (key_id,)


def test_a_row_whose_text_is_not_utf8_is_named_at_its_sequence_by_verify_export_and_doctor(
    tmp_path: Path, config: Path, sqlite: Engine, log: Log
) -> None:
    """SQLite keeps whatever bytes a text column is given: one not UTF-8 failed every read of the log (a traceback
    from verify and export, "cannot read the audit log" with no sequence from doctor)."""
    seq = log.seqs["decided:drop"]
    Attacker(sqlite).run(("UPDATE approval_events SET detail = CAST(X'ff64' AS TEXT) WHERE seq = ?", (seq,)))
    done = kazma("-c", str(config), "audit", "verify")
    assert done.exit_code == 1, done.output
    assert isinstance(done.exception, SystemExit), done.exception
    assert f"FAILED: first bad sequence seq {seq}: changed: it holds what Kazma never writes" in done.output
    export = tmp_path / "odd.jsonl"
    done = kazma("-c", str(config), "audit", "export", "--out", str(export))
    assert done.exit_code == 0, done.output
    assert f"exported {log.last} events" in done.output
    _, public = export_of(tmp_path, config)
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert f"FAILED: first bad sequence seq {seq}: changed" in done.output, done.output
    line = _doctors_audit_chain_line(config)
    assert line.startswith("FAIL"), line
    assert f"first bad sequence seq {seq}: changed" in line, line


@pytest.mark.parametrize("written", ["CAST(X'ff64' AS TEXT)", "X'6464'"], ids=["not-utf8", "bytes"])
def test_a_row_kazma_never_writes_in_the_unsigned_tail_stops_neither_the_checkpointer_nor_verify(
    config: Path, sqlite: Engine, log: Log, written: str
) -> None:
    """The events after the last checkpoint are read by every signing pass and by verify and doctor (to tell
    Kazma's own from forged rows): one holding bytes, or a text not UTF-8, raised there. Signing stopped for good
    (every later decision unsigned), verify ended in a traceback, doctor said "cannot read the audit log"."""
    seq = log.last + 1
    judged = _two_appended_the_first_rewritten_then_signed(sqlite, f"detail = {written}", seq)
    assert seq in judged.unvouched
    done = kazma("-c", str(config), "audit", "verify")
    assert done.exit_code == 1, done.output
    assert isinstance(done.exception, SystemExit), done.exception
    assert f"FAILED: first bad sequence seq {seq}: changed: it holds what Kazma never writes" in done.output
    line = _doctors_audit_chain_line(config)
    assert f"first bad sequence seq {seq}: changed" in line, line


@pytest.mark.parametrize(
    "seal",
    ["'a1:²:00'", "'a1:' || printf('%.5000d', 1) || ':00'", "X'61313a313a3030'", "CAST(X'61313aff' AS TEXT)"],
    ids=["not-ascii-digit", "too-long", "bytes", "not-utf8"],
)
def test_a_commit_seal_kazma_never_writes_in_the_unsigned_tail_stops_neither_the_checkpointer_nor_verify(
    config: Path, sqlite: Engine, log: Log, seal: str
) -> None:
    """A commit seal is read by every signing pass, and by verify and doctor: one whose first sequence number is a
    digit Python's int() refuses ('²'), more digits than it reads, or bytes raised there (a text not UTF-8 is read
    as bytes). Signing stopped for good,
    verify ended in a traceback, doctor said "cannot read the audit log"."""
    seq = log.last + 1
    judged = _two_appended_the_first_rewritten_then_signed(sqlite, f"commit_seal = {seal}", seq)
    assert judged.unvouched == [seq]  # never signed; Kazma's own commit after it is
    assert [(c.first_seq, c.seq) for c in judged.signed] == [(seq + 1, seq + 1)]
    done = kazma("-c", str(config), "audit", "verify")
    assert isinstance(done.exception, SystemExit), done.exception
    assert f"FAILED: first bad sequence seq {seq}: unsigned" in done.output, done.output
    line = _doctors_audit_chain_line(config)
    assert f"first bad sequence seq {seq}: unsigned" in line, line
