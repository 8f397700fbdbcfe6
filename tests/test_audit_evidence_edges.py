"""Evidence read from outside the store (an export, a head copied off a card) and checkpoint rows changed into what
Kazma never writes: `kazma audit verify` names what is wrong (the line, or the sequence number), never stops at a
traceback, and never walks a gap number by number; an export of a legitimate log reads back whatever its texts hold.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kazma.approvals.audit_export import (
    checkpoint_record,
    checkpoints_in_order,
    event_record,
    events_in_order,
    header_record,
    line,
    read_export,
)
from kazma.approvals.audit_verify import verify
from kazma.bot.cli import main
from tests.approvals_support import TEST_SIGNER
from tests.audit_support import KEY_ENV, Attacker, Log, config_text, make_log, rechained, resigned, run_async
from tests.store_backends import Engine

ELSEWHERE: dict[str, str | None] = {name: None for name in KEY_ENV}  # the verifier's machine: no key in its environment


def kazma(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=KEY_ENV if env is None else env)


def export_of(tmp_path: Path, engine: Engine) -> tuple[Path, Path]:
    """The store's export and its public keys, written by the CLI."""
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, engine))
    export, public = tmp_path / "audit.jsonl", tmp_path / "audit.pub"
    done = kazma("-c", str(config), "audit", "export", "--out", str(export))
    assert done.exit_code == 0, done.output
    done = kazma("-c", str(config), "audit", "public-key", "--out", str(public))
    assert done.exit_code == 0, done.output
    return export, public


def verify_export(export: Path, public: Path, *args: str) -> Result:
    return kazma("audit", "verify", "--from-export", str(export), "--public-key", str(public), *args, env=ELSEWHERE)


@pytest.fixture
def sqlite(tmp_path: Path) -> Engine:
    return Engine("sqlite", str(tmp_path / "k.db"))


@pytest.fixture
def log(sqlite: Engine) -> Log:
    made: Log = run_async(make_log(sqlite.where))
    return made


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "not a record (nested too deep)"),
        (
            b'{"type":"event","seq":' + b"9" * 5000 + b"}",
            "not a record (a number of more digits than any record holds)",
        ),
        (b'{"type":"event","detail":"\xff\xfe"}', "not UTF-8 (invalid start byte at byte 27)"),
        (b'{"type":"header","format":"kazma-audit-v1","since":1,"key_ids":5}', "key_ids must be a list of key ids"),
    ],
    ids=["nested", "digits", "not-utf8", "key-ids"],
)
def test_a_malformed_line_in_an_export_is_named_by_its_number_never_a_traceback(
    tmp_path: Path, sqlite: Engine, log: Log, line: bytes, said: str
) -> None:
    export, public = export_of(tmp_path, sqlite)
    lines = export.read_bytes().splitlines()
    export.write_bytes(b"\n".join([*lines, line]) + b"\n")
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert isinstance(done.exception, SystemExit), done.exception
    assert f"not an audit export: {export}, line {len(lines) + 1}: {said}" in done.output, done.output


@pytest.mark.parametrize("seq", [0, -5])
def test_a_sequence_number_the_store_never_gives_is_not_a_record(
    tmp_path: Path, sqlite: Engine, log: Log, seq: int
) -> None:
    export, public = export_of(tmp_path, sqlite)
    text = export.read_text()
    export.write_text(text.replace('"seq":1,', f'"seq":{seq},', 1))
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert f"line 2: seq must be a sequence number (an integer from 1), got {seq}" in done.output, done.output


@pytest.mark.timeout(60)  # before: a range over every number of the gap, for hours
@pytest.mark.parametrize("record", ["event", "checkpoint"])
def test_a_sequence_number_far_past_the_log_is_judged_at_once(
    tmp_path: Path, sqlite: Engine, log: Log, record: str
) -> None:
    export, public = export_of(tmp_path, sqlite)
    lines = export.read_text().splitlines()
    far = 2**62
    copied = json.loads(next(line for line in lines if f'"type":"{record}"' in line))
    copied["seq"] = far
    if record == "checkpoint":
        copied["first_seq"] = far - 1
    export.write_text("\n".join([*lines, json.dumps(copied)]) + "\n")
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    if record == "event":
        assert f"FAILED: first bad sequence seq {log.last + 1}: missing: seqs {log.last + 1}..{far - 1}" in done.output
    else:
        assert f"FAILED: first bad sequence seq {log.last + 1}: truncated: checkpoint #{far}" in done.output


def test_texts_holding_line_separators_are_read_back_whole(sqlite: Engine, log: Log) -> None:
    """JSON leaves U+2028 and U+0085 raw in a text (an export is written with ensure_ascii off): they are not the
    end of a record, whether the export is read as text or as the file's bytes."""
    attacker = Attacker(sqlite)
    events = [
        replace(event, detail=f"{event.detail}\u2028and\u0085more") if event.seq == 2 else event
        for event in attacker.events()
    ]
    events = rechained(events)
    checkpoints = resigned(events, attacker.checkpoints(), TEST_SIGNER)
    records = [header_record(since=1, key_ids=["a1"])]
    records += [event_record(e) for e in events] + [checkpoint_record(c) for c in checkpoints]
    text = "".join(line(record) for record in records)
    assert "\u2028" in text
    for written in (text, text.encode("utf-8")):
        export = read_export(written, source="export")
        report = verify(events_in_order(export), checkpoints_in_order(export), TEST_SIGNER.public_keys())
        assert report.ok, report.summary()
        assert report.events == log.last


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        ("at = 'soon'", "at is 'soon'"),
        ("signature = X'00ff'", "signature is b'\\x00\\xff'"),
        ("key_id = X'6131'", "key_id is b'a1'"),
        ("first_seq = 'x'", "first_seq is 'x'"),
    ],
    ids=["at", "signature", "key-id", "first-seq"],
)
def test_a_checkpoint_changed_into_what_kazma_never_writes_is_named_in_the_store_and_in_its_export(
    tmp_path: Path, sqlite: Engine, log: Log, change: str, shown: str
) -> None:
    """SQLite keeps any type in any column: a checkpoint row so changed is read, exported and named, and nothing
    stops at it (on PostgreSQL the columns' types refuse such a change)."""
    signed = log.seqs["decided:drop"]  # the second checkpoint signs up to the two decisions
    Attacker(sqlite).run((f"UPDATE audit_checkpoints SET {change} WHERE seq = ?", (signed,)))  # noqa: S608
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, sqlite))
    done = kazma("-c", str(config), "audit", "verify")
    assert done.exit_code == 1, done.output
    assert isinstance(done.exception, SystemExit), done.exception
    said = f"bad signature: checkpoint #{signed} (head): it holds what Kazma never writes ({shown})"
    assert said in done.output, done.output

    export, public = export_of(tmp_path, sqlite)  # the export does not stop at it either
    done = verify_export(export, public)
    assert done.exit_code == 1, done.output
    assert said in done.output, done.output


def test_a_head_pasted_with_the_footers_label_is_read_and_a_longer_head_is_shown_whole(
    tmp_path: Path, sqlite: Engine, log: Log
) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, sqlite))
    full = next(event.chain_hash for event in Attacker(sqlite).events() if event.seq == log.last)
    assert full is not None
    done = kazma("-c", str(config), "audit", "verify", "--head", f"Audit checkpoint: #{log.last} {full[:12]}")
    assert done.exit_code == 0, done.output
    assert "1 head(s) seen elsewhere are in it" in done.output
    # Right in its first 12 hex, wrong after them: both sides shown as far as the head given goes.
    wrong = full[:12] + ("1" if full[12] == "0" else "0") * 2
    done = kazma("-c", str(config), "audit", "verify", "--head", f"{log.last}:{wrong}")
    assert done.exit_code == 1, done.output
    assert f"it hashes to {full[:14]}…, but the head seen --head {log.last}:{wrong} says {wrong}" in done.output


def test_heads_from_a_file_holding_no_checkpoint_is_refused_never_read_as_proof(
    tmp_path: Path, sqlite: Engine, log: Log
) -> None:
    export, _ = export_of(tmp_path, sqlite)
    events_only = tmp_path / "events-only.jsonl"
    events_only.write_text("".join(f"{text}\n" for text in export.read_text().splitlines() if "checkpoint" not in text))
    done = kazma("-c", str(tmp_path / "kazma.yaml"), "audit", "verify", "--heads-from", str(events_only))
    assert done.exit_code == 2, done.output
    assert f"{events_only} holds no checkpoint: it proves nothing about the log" in done.output, done.output


def test_an_empty_file_is_not_an_export_and_an_export_to_a_missing_folder_says_so(
    tmp_path: Path, sqlite: Engine, log: Log
) -> None:
    _, public = export_of(tmp_path, sqlite)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    done = verify_export(empty, public)
    assert done.exit_code == 1, done.output
    assert f"not an audit export: {empty} holds no record" in done.output, done.output
    nowhere = tmp_path / "missing" / "audit.jsonl"
    done = kazma("-c", str(tmp_path / "kazma.yaml"), "audit", "export", "--out", str(nowhere))
    assert done.exit_code == 2, done.output
    assert isinstance(done.exception, SystemExit), done.exception
    assert f"cannot write {nowhere}:" in done.output, done.output
