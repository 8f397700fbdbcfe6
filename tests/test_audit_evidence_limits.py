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

from kazma.bot.cli import main
from tests.audit_support import KEY_ENV, Attacker, Log, config_text, make_log, run_async
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
    doctor = kazma("-c", str(config), "doctor", "--platform-timeout", "1", "--model-timeout", "1")
    [line] = [text for text in doctor.output.splitlines() if "audit chain" in text]
    assert line.startswith("FAIL"), line
    assert f"first bad sequence seq {seq}: changed" in line, line
