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
from tests.approvals_support import TEST_SIGNER
from tests.audit_support import KEY_ENV, Log, config_text, make_log, run_async
from tests.process_support import REPO
from tests.store_backends import Engine


def kazma(cwd: Path, *args: str, keys: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}
    env["PYTHONPATH"] = str(REPO)
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
    assert done.returncode == 0, done.stdout + done.stderr
    # The store still holds every checkpoint of the earlier export.
    done = kazma(here, "audit", "verify", "--heads-from", str(earlier))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "head(s) seen elsewhere are in it" in done.stdout
