"""`kazma audit export` → `kazma audit verify --from-export` on another machine's copy, with only the public key:
it passes; a change of one character anywhere in an event or a checkpoint fails it.

The export, the public key and the verification run as real `kazma` processes; the verifier runs in a folder of
its own holding just the two files, with no configuration, no store and no key in its environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kazma.approvals.audit_export import ExportError, checkpoints_in_order, events_in_order, read_export
from kazma.approvals.audit_verify import verify
from tests.approvals_support import TEST_SIGNER, approval_service
from tests.audit_support import KEY_ENV, Attacker, Log, config_text, make_log, run_async
from tests.child_env import child_env
from tests.store_backends import Engine


def kazma(cwd: Path, *args: str, keys: bool = True) -> subprocess.CompletedProcess[str]:
    env = child_env(base={k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")})
    if keys:
        env.update(KEY_ENV)
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture
def exported(store_engine: Engine, tmp_path: Path) -> tuple[Path, Path, Log]:
    """The export and the public keys, copied alone into a folder of their own (the other machine)."""
    log: Log = run_async(make_log(store_engine.where))
    here = tmp_path / "kazma"
    here.mkdir()
    (here / "kazma.yaml").write_text(config_text(here, store_engine))
    done = kazma(here, "audit", "export", "--out", "audit.jsonl")
    assert done.returncode == 0, done.stderr
    assert f"exported {log.last} events" in done.stderr
    done = kazma(here, "audit", "public-key", "--out", "audit.pub")
    assert done.returncode == 0, done.stderr
    other = tmp_path / "elsewhere"
    other.mkdir()
    for name in ("audit.jsonl", "audit.pub"):
        shutil.copy(here / name, other / name)
    return other / "audit.jsonl", other / "audit.pub", log


def test_an_export_verifies_elsewhere_with_only_the_public_key_and_one_changed_byte_fails(
    exported: tuple[Path, Path, Log],
) -> None:
    export, public, log = exported
    elsewhere = export.parent
    assert sorted(p.name for p in elsewhere.iterdir()) == ["audit.jsonl", "audit.pub"]
    assert "PRIVATE" not in public.read_text() and len(public.read_text().split(":")[1].strip()) == 43  # noqa: PT018
    done = kazma(elsewhere, "audit", "verify", "--from-export", "audit.jsonl", "--public-key", "audit.pub", keys=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ok: {log.last} events (seq 1..{log.last}) chained"), done.stdout

    # One byte: the denial's "no" reason made "mo" — the line still parses, the event no longer hashes.
    text = export.read_text()
    denied = next(line for line in text.splitlines() if '"detail":"denied: no"' in line)
    export.write_text(text.replace(denied, denied.replace('"denied: no"', '"denied: mo"')))
    done = kazma(elsewhere, "audit", "verify", "--from-export", "audit.jsonl", "--public-key", "audit.pub", keys=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"first bad sequence seq {log.seqs['decided:drop']}: changed" in done.stdout


def test_a_verifier_without_the_public_key_is_told_to_bring_it(exported: tuple[Path, Path, Log]) -> None:
    export, _, _ = exported
    done = kazma(export.parent, "audit", "verify", "--from-export", "audit.jsonl", keys=False)
    assert done.returncode == 2
    assert "give the public keys to verify with: --public-key FILE" in done.stderr


def test_every_single_character_changed_in_an_event_or_checkpoint_fails(exported: tuple[Path, Path, Log]) -> None:
    export, _, _ = exported
    text = export.read_text()
    keys = TEST_SIGNER.public_keys()
    header_end = text.index("\n") + 1  # the header says what was asked (since, key ids), nothing that is verified
    checked = 0
    for index in range(header_end, len(text)):
        original = text[index]
        for replacement in ("0" if original != "0" else "1", "x" if original != "x" else "y"):
            changed = text[:index] + replacement + text[index + 1 :]
            try:
                parsed = read_export(changed, source="export")
                report = verify(events_in_order(parsed), checkpoints_in_order(parsed), keys, anchored=parsed.anchored)
            except ExportError:
                continue  # refused as an export at all
            assert not report.ok, (index, original, replacement, text[max(0, index - 40) : index + 40])
            checked += 1
    assert checked > len(text) // 4  # most changes still parse, and are caught by the chain or a signature


def test_an_export_since_a_sequence_number_verifies_on_its_own_and_extends_an_earlier_export(
    store_engine: Engine, tmp_path: Path, exported: tuple[Path, Path, Log]
) -> None:
    earlier, public, log = exported
    here = tmp_path / "kazma"
    since = log.seqs["execution_started:deploy"]
    done = kazma(here, "audit", "export", "--since", str(since), "--out", "later.jsonl")
    assert done.returncode == 0, done.stderr
    later = read_export((here / "later.jsonl").read_text(), source="later")
    assert later.events[0].seq == since
    assert not later.anchored
    done = kazma(here, "audit", "verify", "--from-export", "later.jsonl", "--public-key", str(public), keys=False)
    assert done.returncode == 1, done.stdout + done.stderr  # its header is not signed: a slice is said to be one
    assert f"slice from seq {since}: the events before it are not in this file" in done.stdout, done.stdout
    done = kazma(here, "audit", "verify", "--from-export", "later.jsonl", "--public-key", str(public), "--since",
                 str(since), keys=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"a slice from seq {since}: nothing in it proves the events before it" in done.stdout, done.stdout
    # The store still holds every checkpoint of the earlier export.
    done = kazma(here, "audit", "verify", "--heads-from", str(earlier))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "head(s) seen elsewhere are in it" in done.stdout


def test_an_export_whose_first_events_were_removed_fails_and_a_head_it_cannot_show_is_said(
    exported: tuple[Path, Path, Log],
) -> None:
    # The decisions at the start cut out of the export (header and checkpoints kept): it verified "ok" from its
    # new first event, and a head from a card before that was skipped without a word.
    export, _, log = exported
    elsewhere = export.parent
    cut_to = log.seqs["decided:drop"]
    witness = next(c for c in read_export(export.read_text(), source="x").checkpoints if c.seq >= cut_to)
    kept = [
        line for line in export.read_text().splitlines()
        if '"type":"event"' not in line or int(line.split('"seq":')[1].split(",")[0]) > witness.seq
    ]  # fmt: skip
    export.write_text("\n".join(kept) + "\n")

    def verified(*more: str) -> subprocess.CompletedProcess[str]:
        return kazma(elsewhere, "audit", "verify", "--from-export", "audit.jsonl", "--public-key", "audit.pub",
                     *more, keys=False)  # fmt: skip

    done = verified()
    assert done.returncode == 1, done.stdout
    said = f"first bad sequence seq 1: missing: slice from seq {witness.seq + 1}: the events before it are not in"
    assert said in done.stdout, done.stdout
    # The header and the checkpoints before the cut taken out too: consistent in itself, but the header is not
    # signed, so it is still a slice; verified as one, a head seen on a card before the cut is said, not skipped.
    text = export.read_text().splitlines()
    header = text[0].replace('"since":1', f'"since":{witness.seq + 1}')
    rest = [line for line in text[1:] if '"type":"checkpoint"' not in line or f'"seq":{witness.seq},' not in line]
    rest = [
        line for line in rest if '"type":"event"' in line or int(line.split('"seq":')[1].split(",")[0]) > witness.seq
    ]
    export.write_text("\n".join([header, *rest]) + "\n")
    done = verified()
    assert done.returncode == 1, done.stdout
    assert said in done.stdout, done.stdout
    assert verified("--since", str(witness.seq + 1)).returncode == 0  # a slice expected: nothing inside can tell ...
    done = verified("--since", str(witness.seq + 1), "--head", f"{witness.seq}:{witness.head[:12]}")  # ... a head can
    assert done.returncode == 1, done.stdout
    assert f"seq {witness.seq}: missing:" in done.stdout
    assert "cannot show that it extends that head" in done.stdout


def test_events_not_yet_signed_are_left_out_of_an_export_so_it_verifies_elsewhere(
    store_engine: Engine, tmp_path: Path, exported: tuple[Path, Path, Log]
) -> None:
    # An export taken while Kazma appends (or after a crash left a tail unsigned) failed elsewhere: the tail, which
    # only the audit key can vouch for, read as "written outside Kazma".
    _, public, log = exported
    here = tmp_path / "kazma"

    async def one_more() -> None:
        async with approval_service(store_engine.where) as service:
            await service.open("shell", {"command": "uptime"}, "agent:builder", "telegram:-100")

    run_async(one_more())
    done = kazma(here, "audit", "export", "--out", "busy.jsonl")
    assert done.returncode == 0, done.stderr
    assert f"not exported: 1 event after seq {log.last}, not signed yet" in done.stderr
    assert f"exported {log.last} events" in done.stderr
    done = kazma(here, "audit", "verify", "--from-export", "busy.jsonl", "--public-key", str(public), keys=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rows_holding_what_kazma_never_writes_are_exported_and_named_changed_elsewhere(
    store_engine: Engine, tmp_path: Path, exported: tuple[Path, Path, Log]
) -> None:
    # The export crashed on them (json refuses NaN and bytes), and so did a sink reading them back: the evidence
    # of the change could not leave the machine. Now they are written as what they are and fail verification.
    if store_engine.name != "sqlite":
        pytest.skip("PostgreSQL's column types refuse text in a time and bytes in a text")
    _, public, log = exported
    here = tmp_path / "kazma"
    seq, later = log.seqs["decided:drop"], log.seqs["decided:deploy"]
    Attacker(store_engine).run(
        ("UPDATE approval_events SET detail = X'64656e696564' WHERE seq = ?", (seq,)),  # bytes where text was
        ("UPDATE approval_events SET at = 'yesterday' WHERE seq = ?", (later,)),  # text where a time was
    )
    done = kazma(here, "audit", "export", "--out", "odd.jsonl")
    assert done.returncode == 0, done.stderr
    assert f"exported {log.last} events" in done.stderr
    exported_lines = (here / "odd.jsonl").read_text().splitlines()
    assert any('"detail":{"never_written":"b\'denied\'"}' in line for line in exported_lines), exported_lines
    done = kazma(here, "audit", "verify", "--from-export", "odd.jsonl", "--public-key", str(public), keys=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"first bad sequence seq {min(seq, later)}: changed" in done.stdout, done.stdout
    assert f"seq {max(seq, later)}: changed: it holds what Kazma never writes" in done.stdout, done.stdout


def test_a_record_giving_a_field_twice_is_refused_not_read_as_its_last(exported: tuple[Path, Path, Log]) -> None:
    """json keeps the last of two same-named fields, other readers the first: a denial with ``"detail":
    "approved"`` written before its own detail verified "ok" (the hash covers the last) while a reader keeping the
    first showed an approval. A record giving a field twice is no record an export writes: refused, named."""
    export, _, log = exported
    text = export.read_text()
    denied = next(line for line in text.splitlines() if '"detail":"denied: no"' in line)
    doubled = text.replace(denied, denied.replace('"detail":"denied: no"', '"detail":"approved","detail":"denied: no"'))
    number = doubled.splitlines().index(denied.replace('"detail":', '"detail":"approved","detail":', 1)) + 1
    with pytest.raises(ExportError, match=rf"export, line {number}: field 'detail' given twice"):
        read_export(doubled, source="export")
    assert log.seqs["decided:drop"] > 0
