"""`kazma audit verify` walks the log, never holds it: the store read in pages ordered by seq, an export read line
by line. Held whole, a log of 200,008 events took 179 MB to verify on the store (0.9 KB an event) and a 94 MB export
351 MB. Measured here with tracemalloc on 20,000 events: held whole, 20 MB and more; walked, a page's worth."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
from click.testing import CliRunner, Result

from kazma.approvals.audit_export import (
    ExportError,
    ExportFile,
    checkpoint_record,
    checkpoints_in_order,
    event_record,
    events_in_order,
    line,
    read_export,
)
from kazma.approvals.audit_verify import verify
from kazma.approvals.chain import ChainedEvent
from kazma.approvals.checkpoints import HEAD, Checkpoint
from kazma.bot.cli import audit_cli, decision_checks, main
from kazma.bot.cli.checks import Level
from kazma.config import load_config
from tests.approvals_support import TEST_SIGNER, approval_service
from tests.audit_support import KEY_ENV, Attacker, config_text, make_log, rechained, run_async
from tests.store_backends import Engine, raw_rows

T = TypeVar("T")
EVENTS = 20_000
SIGNED_EVERY = 1_000
PAGE = 500  # events a page: what a walk holds at a time, so the bound below is far under the log held whole
BOUND = 4 * 1024 * 1024  # held whole, the 20,000 events took 20 MB (the export 40 MB); walked, 1.2 MB


def _log(signed_every: int = SIGNED_EVERY) -> tuple[list[ChainedEvent], list[Checkpoint]]:
    events = rechained(
        [
            ChainedEvent(
                seq=0, request_id=None, event="note", actor="telegram:111", platform="telegram",
                at=1_700_000_000.0 + n, args_hash="a" * 64, detail=f"a reason someone typed, number {n}" * 4,
                prev_hash=None, chain_hash=None, person=None,
            )
            for n in range(EVENTS)
        ]
    )  # fmt: skip
    checkpoints = [
        TEST_SIGNER.sign(HEAD, first, min(first + signed_every - 1, EVENTS), "", 1_700_000_000.0)
        for first in range(1, EVENTS + 1, signed_every)
    ]
    heads = {e.seq: e.chain_hash or "" for e in events}
    return events, [TEST_SIGNER.sign(c.kind, c.first_seq, c.seq, heads[c.seq], c.at) for c in checkpoints]


@pytest.fixture(params=[SIGNED_EVERY], ids=["signed_every_1000"])
def big_log(
    store_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Path:
    """A store (its schema made by Kazma) holding a signed chain of EVENTS events, a checkpoint every
    ``request.param`` of them; the config file naming it."""

    async def schema() -> None:
        async with approval_service(store_engine.where):
            pass

    run_async(schema())
    events, checkpoints = _log(request.param)
    Attacker(store_engine).replace_log(events, checkpoints)
    monkeypatch.setattr(audit_cli, "PAGE", PAGE)
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, store_engine))
    return config


def _peak(run: Callable[[], T]) -> tuple[T, int]:
    """What ``run`` returns, and the most memory Python held while it ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = run()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _verify(config: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["-c", str(config), "audit", "verify", *args], env=KEY_ENV)


def test_verify_on_the_store_reads_the_events_in_pages_never_the_whole_log(big_log: Path, store_engine: Engine) -> None:
    result, peak = _peak(lambda: _verify(big_log))
    assert result.exit_code == 0, result.stdout
    assert (
        f"ok: {EVENTS} events (seq 1..{EVENTS}) chained, {EVENTS // SIGNED_EVERY} checkpoints signed" in result.stdout
    )
    assert peak < BOUND, f"verify held {peak / 1e6:.1f} MB for {EVENTS} events"


@pytest.mark.parametrize("big_log", [1], ids=["signed_every_event"], indirect=True)
def test_verify_on_the_store_reads_the_checkpoints_in_pages_too(big_log: Path, store_engine: Engine) -> None:
    """A checkpoint for every event (a Kazma deciding one at a time signs each decision within a fiftieth of a
    second): held whole, the 20,000 checkpoints took more than the bound by themselves."""
    result, peak = _peak(lambda: _verify(big_log))
    assert result.exit_code == 0, result.stdout
    assert f"ok: {EVENTS} events (seq 1..{EVENTS}) chained, {EVENTS} checkpoints signed" in result.stdout
    assert peak < BOUND, f"verify held {peak / 1e6:.1f} MB for {EVENTS} checkpoints"


@pytest.mark.parametrize("big_log", [1], ids=["signed_every_event"], indirect=True)
def test_export_reads_the_checkpoints_in_pages_beside_the_events(
    big_log: Path, store_engine: Engine, tmp_path: Path
) -> None:
    """`audit export` read every checkpoint into a list first (and the ones it kept into another): with one for
    every event, the 20,000 checkpoints alone took more than the bound, where verify on the store reads pages."""
    out = tmp_path / "audit.jsonl"
    result, peak = _peak(
        lambda: CliRunner().invoke(main, ["-c", str(big_log), "audit", "export", "--out", str(out)], env=KEY_ENV)
    )
    assert result.exit_code == 0, result.output
    assert f"exported {EVENTS} events and {EVENTS} checkpoints from seq 1" in result.output, result.output
    assert peak < BOUND, f"export held {peak / 1e6:.1f} MB for {EVENTS} checkpoints"
    # What it wrote is what it wrote before: each checkpoint right after the event it signs.
    assert _verify(big_log, "--from-export", str(out)).exit_code == 0


def test_an_event_removed_is_named_as_before_in_the_second_pass_without_holding_the_log(
    big_log: Path, store_engine: Engine
) -> None:
    """An event that does not follow the one before it is looked up among the earlier ones: a second pass over
    the same pages, keeping only the hashes asked for. Its answer is the one a walk holding every hash gave."""
    Attacker(store_engine).run(("DELETE FROM approval_events WHERE seq = ?", (12_345,)))
    result, peak = _peak(lambda: _verify(big_log))
    assert result.exit_code == 1, result.stdout
    assert "FAILED: first bad sequence seq 12345: missing: seq 12345 is not in the log" in result.stdout
    assert "then seq 12346: missing: the event it was chained after" in result.stdout, result.stdout
    assert peak < BOUND, f"verify held {peak / 1e6:.1f} MB for {EVENTS} events"


def test_verify_from_export_reads_the_file_line_by_line(big_log: Path, store_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "audit.jsonl"
    done = CliRunner().invoke(main, ["-c", str(big_log), "audit", "export", "--out", str(out)], env=KEY_ENV)
    assert done.exit_code == 0, done.output
    assert out.stat().st_size > BOUND  # held whole, the file alone passes the bound
    result, peak = _peak(lambda: _verify(big_log, "--from-export", str(out)))
    assert result.exit_code == 0, result.stdout
    assert f"ok: {EVENTS} events (seq 1..{EVENTS})" in result.stdout, result.stdout
    assert peak < BOUND, f"verify --from-export held {peak / 1e6:.1f} MB for {EVENTS} events"


def _small() -> tuple[list[ChainedEvent], list[Checkpoint]]:
    events = rechained(
        [
            ChainedEvent(0, None, "note", "telegram:111", "telegram", 1_700_000_000.0 + n, None, f"n{n}", None, None)
            for n in range(10)
        ]
    )
    heads = {e.seq: e.chain_hash or "" for e in events}
    return events, [TEST_SIGNER.sign(HEAD, 1, 5, heads[5], 1.0), TEST_SIGNER.sign(HEAD, 6, 10, heads[10], 2.0)]


@pytest.mark.parametrize(
    "order",
    [
        pytest.param([*range(1, 11)], id="in-order"),
        pytest.param([1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10], id="one-sent-twice-in-a-row"),
        pytest.param([*range(1, 11), 8, 9, 10], id="a-batch-sent-again"),
        pytest.param([1, 2, 3, 4, 5, 7, 6, 8, 9, 10], id="out-of-order"),
        pytest.param([1, 2, 3, 4, 6, 7, 8, 9, 10], id="one-missing"),
    ],
)
def test_a_file_read_line_by_line_reads_as_the_whole_file_read_at_once(order: list[int], tmp_path: Path) -> None:
    """What a sink's receiver may have written (a record twice, a batch again, out of order): the events and the
    report are those the whole file, read and sorted at once, gave."""
    events, checkpoints = _small()
    by_seq = {e.seq: e for e in events}
    path = tmp_path / "sink.jsonl"
    path.write_text(
        "".join(line(event_record(by_seq[s])) for s in order) + "".join(line(checkpoint_record(c)) for c in checkpoints)
    )
    whole = read_export(path.read_bytes(), source=str(path))
    streamed = ExportFile(path)
    assert streamed.conflict is None
    assert list(streamed) == events_in_order(whole)
    assert streamed.anchored == whole.anchored
    assert checkpoints_in_order(streamed) == checkpoints_in_order(whole)
    keys = TEST_SIGNER.public_keys()
    assert verify(streamed, checkpoints_in_order(streamed), keys, anchored=streamed.anchored, since=1) == verify(
        events_in_order(whole), checkpoints_in_order(whole), keys, anchored=whole.anchored, since=1
    )


@pytest.mark.parametrize("later", [pytest.param(5, id="in-a-row"), pytest.param(11, id="after-the-rest")])
def test_a_seq_given_twice_with_different_contents_is_refused_as_before(later: int, tmp_path: Path) -> None:
    events, _ = _small()
    changed = replace(events[4], detail="denied: no")
    path = tmp_path / "sink.jsonl"
    records = [line(event_record(e)) for e in events]
    records.insert(later, line(event_record(changed)))
    path.write_text("".join(records))
    with pytest.raises(ExportError) as whole:
        events_in_order(read_export(path.read_bytes(), source=str(path)))
    assert str(ExportFile(path).conflict) == str(whole.value) == "seq 5 appears twice with different contents"


DECIDED = 20_000


def test_doctor_checks_the_decided_rows_seals_a_page_at_a_time(
    store_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kazma doctor`'s seal check read every decided row at once (and kept every failing one): 20,000 rows copied
    around Kazma from one real decision (each seal then binds another id) took more than the bound."""
    log = run_async(make_log(store_engine.where))
    if store_engine.postgres:
        columns = [
            str(r[0])
            for r in raw_rows(
                store_engine,
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'approval_requests'"
                " ORDER BY ordinal_position",
            )
        ]
        numbers = f"generate_series(1, {DECIDED}) AS n(i)"
        prefix = ""
    else:
        columns = [str(r[1]) for r in raw_rows(store_engine, "PRAGMA table_info(approval_requests)")]
        prefix = f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {DECIDED}) "  # noqa: S608
        numbers = "n"
    others = ", ".join(c for c in columns if c != "id")
    copied = ", ".join(f"r.{c}" for c in columns if c != "id")
    Attacker(store_engine).run(
        (
            f"INSERT INTO approval_requests (id, {others}) {prefix}SELECT r.id || '-' || CAST(i AS TEXT), {copied}"  # noqa: S608
            f" FROM approval_requests r, {numbers} WHERE r.id = ?",
            (log.requests["deploy"],),
        )
    )
    monkeypatch.setattr(decision_checks, "PAGE", 500)
    config = tmp_path / "kazma.yaml"
    config.write_text(config_text(tmp_path, store_engine))
    monkeypatch.setenv("KAZMA_DECISION_KEY", str(KEY_ENV["KAZMA_DECISION_KEY"]))
    loaded = load_config(config)
    (check, sealed), peak = _peak(lambda: run_async(decision_checks.check_decision_seals(loaded)))
    assert sealed == DECIDED + 3
    assert check.level is Level.FAIL, check
    assert f"{DECIDED} decided rows whose seal does not verify, {DECIDED} of them approved" in check.detail, check
    assert peak < BOUND, f"doctor held {peak / 1e6:.1f} MB for {DECIDED} decided rows"
