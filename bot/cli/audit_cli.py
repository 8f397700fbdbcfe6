"""``kazma audit verify|export|public-key``: the audit chain checked, taken out of the store, and its public keys.

``verify`` reads the configured store (or, with ``--from-export``, a file: no
configuration, no store, no secret needed) and checks every link, every
signature, and every head seen elsewhere (``--head SEQ:HEX`` from a settled card;
``--heads-from FILE`` for every checkpoint of an earlier export). An export that
does not start at the log's beginning is a slice, and fails unless ``--since SEQ``
says one is expected (its header is not signed, so it cannot say so). The store's
requests are checked against the log too: a request row whose event is not in it
(a finished one without its ending event) shows a log cut at a checkpoint; and every request the log says ended
has its row's decision seal checked (with the decision key here), since the seal alone binds what the row says
beyond its status and decider. Exit 0 when
all hold, 1 at the first problem (named with its sequence number and what is wrong).
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TextIO

import click

from kazma.approvals import ApprovalStore
from kazma.approvals.audit_export import (
    ExportError,
    ExportFile,
    checkpoints_in_order,
    export_records,
    header_record,
    line,
)
from kazma.approvals.audit_verify import Head, HeadError, Report, Seals, Verification, heads_of, verify
from kazma.approvals.chain import ChainedEvent
from kazma.approvals.checkpointer import vouched_tail
from kazma.approvals.checkpoints import HISTORY, Checkpoint, PublicKeyError, PublicKeys
from kazma.approvals.rules import RuleStore
from kazma.approvals.store import UnreadableRequest
from kazma.bot.cli.context import EXIT_CONFIG, Context
from kazma.bot.keys import audit_key_problem, read_audit_signer, read_decision_keyring
from kazma.bot.store import store_for_command
from kazma.config.keyring import Keyring
from kazma.config.models import KazmaConfig
from kazma.config.store.backend import StoreConnection

EXIT_FAILED = 1
PAGE = 5000
SHOWN = 20  # problems listed after the first one
UNRECORDED = 100  # requests named whose row the log does not record (a cut log leaves many alike)


@click.group()
def audit() -> None:
    """The audit chain: verify it, export it, print its public keys."""


def _fail(message: str, code: int = EXIT_CONFIG) -> None:
    click.echo(message, err=True)
    sys.exit(code)


def _heads(given: tuple[str, ...], files: tuple[Path, ...]) -> list[Head]:
    heads: list[Head] = []
    for text in given:
        try:
            heads.append(Head.parse(text, source=f"--head {text}"))
        except HeadError as exc:
            _fail(str(exc))
    for path in files:
        try:
            found = list(heads_of(checkpoints_in_order(_read_export(path)), source=f"in {path}"))
        except (HeadError, ExportError) as exc:
            _fail(f"{path}: {exc}")
        if not found:  # silence would read as "the log extends it"
            _fail(
                f"{path} holds no checkpoint: it proves nothing about the log (give an export or a sink's file "
                "made after a checkpoint was signed)"
            )
        heads += found
    return heads


def _read_export(path: Path) -> ExportFile:
    try:
        export = ExportFile(path)  # line by line: a line not UTF-8 is named by its number
    except OSError as exc:
        _fail(f"cannot read {path}: {exc}")
    except ExportError as exc:
        _fail(f"not an audit export: {exc}", EXIT_FAILED)
    else:
        # An export has its header, and a sink's file its first event: an empty file (one cut to nothing) is neither.
        if export.since is None and not export.events and not export.checkpoints:
            _fail(f"not an audit export: {path} holds no record", EXIT_FAILED)
        return export
    raise AssertionError("unreachable")


def _public_keys(path: Path | None, config: KazmaConfig | None) -> PublicKeys:
    if path is not None:
        try:
            return PublicKeys.parse(path.read_text(encoding="utf-8"), source=str(path))
        except (OSError, UnicodeDecodeError) as exc:
            _fail(f"cannot read {path}: {exc}")
        except PublicKeyError as exc:
            _fail(str(exc))
    signer = None if config is None else read_audit_signer(config)
    if signer is None:
        where = "" if config is None else f" ({audit_key_problem(config)})"
        _fail(f"give the public keys to verify with: --public-key FILE (from `kazma audit public-key`){where}")
        raise AssertionError("unreachable")
    return signer.public_keys()


def _print(report: Report) -> None:
    click.echo(report.summary())
    if report.history is not None:
        history = report.history
        click.echo(
            f"note: seq {history.first_seq}..{history.seq} were recorded before the audit chain and chained once "
            "(the one-time migration): their checkpoint proves them unchanged since then, not before"
        )
    first = report.first
    if first is not None:
        rest = sorted((p for p in report.problems if p is not first), key=lambda p: p.seq)
        for problem in rest[:SHOWN]:
            click.echo(f"  then {problem.line()}")
        if len(rest) > SHOWN:
            click.echo(f"  … and {len(rest) - SHOWN} more")
    if report.no_signature_holds:
        # Each line alone reads as a forgery; a key mix-up (a replica's $KAZMA_AUDIT_KEY, an old public-key file)
        # fails every checkpoint the same way, and is the first thing to rule out.
        click.echo(
            f"note: none of the {report.checkpoints} checkpoints verifies with the public keys given: either these "
            "are not the keys this log was signed with (check --public-key, $KAZMA_AUDIT_KEY or the key file against "
            "`kazma audit public-key` where Kazma runs), or every checkpoint was forged"
        )


@audit.command("verify")
@click.option("--head", "heads", multiple=True, metavar="SEQ:HEX", help="A checkpoint seen elsewhere (a settled card).")
@click.option(
    "--heads-from",
    "heads_from",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="An earlier export: the log must still hold every checkpoint in it.",
)
@click.option(
    "--from-export",
    "from_export",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Verify this export (or a sink's file) instead of the store: needs only --public-key.",
)
@click.option(
    "--public-key",
    "public_key",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The public keys (`kazma audit public-key`); default: derived from this machine's audit key.",
)
@click.option(
    "--since",
    type=click.IntRange(min=1),
    default=None,
    help="With --from-export: the export is a slice (`audit export --since SEQ`) that starts at SEQ at the latest."
    " Without it an export must start at the log's beginning.",
)
@click.pass_obj
def verify_command(
    obj: Context,
    heads: tuple[str, ...],
    heads_from: tuple[Path, ...],
    from_export: Path | None,
    public_key: Path | None,
    since: int | None,
) -> None:
    """Check every link and signature of the audit chain; name the first bad sequence number."""
    if since is not None and from_export is None:
        _fail("--since is for an export that is a slice: give it with --from-export FILE")
    given = _heads(heads, heads_from)
    if from_export is not None:
        export = _read_export(from_export)
        try:
            if export.conflict is not None:
                raise export.conflict
            checkpoints = checkpoints_in_order(export)
        except ExportError as exc:
            _fail(f"{from_export}: {exc}", EXIT_FAILED)
        keys = _public_keys(public_key, None if public_key is not None else _config_if_any(obj))
        # The header is not signed: whoever cut the export's front could write `since` there too. It can only make
        # the check stricter; a slice passes only where the verifier says one is expected.
        expected = 1 if since is None else min(since, export.since or since)
        try:
            # The events are read from the file as they are walked (again, if a second pass is needed).
            report = verify(export, checkpoints, keys, heads=given, anchored=export.anchored, since=expected)
        except (OSError, ExportError) as exc:  # the file changed (or went) after its first reading
            _fail(f"cannot read {from_export} again: {exc}", EXIT_FAILED)
            return
        if since is None and export.since not in (None, 1) and not report.from_start:
            click.echo(
                f"note: its header says --since {export.since}, but the header is not signed: verify it as a slice "
                f"with --since {export.since} if that is what was exported",
                err=True,
            )
    else:
        config = obj.load().config
        keys = _public_keys(public_key, config)
        report = asyncio.run(_verify_store(config, keys, given))
    _print(report)
    if report.seals is not None and report.ok:
        click.echo(report.seals.summary())
    if not report.ok:
        sys.exit(EXIT_FAILED)


def _config_if_any(obj: Context) -> KazmaConfig | None:
    """The configuration when there is one here (its audit key gives the public keys); None elsewhere."""
    path = obj.config_path or Path("kazma.yaml")
    return obj.load().config if path.exists() else None


async def _verify_store(config: KazmaConfig, keys: PublicKeys, heads: list[Head]) -> Report:
    async with store_for_command(config, read_only=True) as conn:
        store = ApprovalStore(conn)
        # The last checkpoint first: those to it are walked (read in pages beside the events, never held whole);
        # one Kazma signs meanwhile is for the next verify.
        last = await store.last_checkpoint()
        signed_to = 0 if last is None else last.seq
        # Read after it: anything a checkpoint to it signs is in. The events are read to here: those Kazma
        # appends meanwhile are for the next verify.
        newest = await store.last_event_seq()
        # A second pass (the same events) only where one is misplaced: see Verification.
        wanted: frozenset[str] | None = None
        while True:
            signed = _Signed(store, upto=signed_to)
            first = await signed.first()
            history = first if first is not None and first.kind == HISTORY else None
            verification = Verification((), keys, heads=heads, wanted=wanted, history=history)
            async for batch in _pages(store, upto=newest):
                for event in batch:
                    verification.add(event)
                    async for checkpoint in signed.through(event.seq):
                        verification.checkpoint(checkpoint)
            async for checkpoint in signed.through(signed_to):  # past the log's end: a cut
                verification.checkpoint(checkpoint)
            wanted = verification.asked
            if wanted is None:
                break
        signer = read_audit_signer(config)
        # The tail after the last checkpoint read: a running Kazma may have signed past it since, and a tail from
        # its new checkpoint on (not read here) left its own events before it vouched for by nobody.
        pending = (
            set() if signer is None else {s for s in await vouched_tail(store, signer, upto=signed_to) if s <= newest}
        )
        # Read after the events: a request Kazma opens or finishes meanwhile has its event in the log by then.
        unrecorded, more = await store.unrecorded_requests(limit=UNRECORDED)
        seals = Seals(read_decision_keyring(config), verification.history, await store.sealed_since())
        await _judge_seals(store, seals, upto=newest)
        await _judge_rules(conn, store, seals, seals.keyring, beyond=newest + 1)
        changed, more_changed = await store.calls_changed(limit=UNRECORDED)
        seals.changed_calls(changed, more=more_changed)
    return verification.report(unrecorded, unrecorded_more=more, pending=pending, seals=seals)


async def _judge_seals(store: ApprovalStore, seals: Seals, *, upto: int) -> None:
    """The row of every request the log says ended (to ``upto``, what was walked), a page at a time."""
    after = 0
    while True:
        endings = await store.first_endings(after, limit=PAGE, upto=upto)
        if not endings:
            return
        rows = await store.requests_of([request_id for _, request_id in endings if request_id is not None])
        for seq, request_id in endings:
            if request_id is None:
                continue
            row = rows.get(request_id)
            if isinstance(row, UnreadableRequest):
                seals.unreadable(seq, request_id, row.columns)
            else:
                seals.judge(seq, request_id, row)
        after = endings[-1][0]


async def _judge_rules(
    conn: StoreConnection, store: ApprovalStore, seals: Seals, keyring: Keyring | None, *, beyond: int
) -> None:
    """Every remembered approval's row, a page at a time: its seal, and a revocation within the log walked (to
    ``beyond``, exclusive) its row no longer says. A row with no ``rule_created`` (written around Kazma) is named
    where that log ends."""
    rules = RuleStore(conn)
    since = await rules.sealed_since()
    after = ""
    while True:
        page = await rules.page(after, limit=PAGE)
        if not page:
            return
        events = await RuleStore.recorded(store, page)
        for rule in page:
            created, revoked = events[rule.id]
            if revoked is not None and revoked >= beyond:
                revoked = None  # revoked after the log walked ends (Kazma runs): its row may have been read before
            problem = rule.seal_problem(keyring)
            unsealed_before = rule.seal is None and since is not None and rule.created_at < since
            seals.judge_rule(
                beyond if created is None else created, rule.id, rule.created_by, problem,
                unsealed_before=unsealed_before, revoked_seq=revoked, in_force=rule.revoked_at is None,
            )  # fmt: skip
        after = page[-1].id


async def _pages(store: ApprovalStore, after: int = 0, *, upto: int | None = None) -> AsyncIterator[list[ChainedEvent]]:
    while True:
        batch = await store.chain_events(after, limit=PAGE)
        if upto is not None:
            batch = [event for event in batch if event.seq <= upto]
        if not batch:
            return
        yield batch
        after = batch[-1].seq


class _Signed:
    """The store's checkpoints to ``upto``, in sequence order, read a page at a time as the walk reaches them."""

    def __init__(self, store: ApprovalStore, *, upto: int, after: int = 0) -> None:
        self.store = store
        self.upto = upto
        self.after = after
        self.page: deque[Checkpoint] = deque()
        self.done = False

    async def _fill(self) -> None:
        if self.page or self.done:
            return
        batch = [c for c in await self.store.chain_checkpoints(self.after, limit=PAGE) if c.seq <= self.upto]
        if not batch:
            self.done = True
            return
        self.page.extend(batch)
        self.after = batch[-1].seq

    async def first(self) -> Checkpoint | None:
        await self._fill()
        return self.page[0] if self.page else None

    async def through(self, seq: int) -> AsyncIterator[Checkpoint]:
        """Every checkpoint not yet given whose seq is ``seq`` or before it."""
        while True:
            await self._fill()
            if not self.page or self.page[0].seq > seq:
                return
            yield self.page.popleft()


@audit.command("export")
@click.option("--since", type=click.IntRange(min=1), default=1, show_default=True, help="The first sequence number.")
@click.option("--format", "fmt", type=click.Choice(["jsonl"]), default="jsonl", show_default=True)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None, help="A file (default: stdout).")
@click.pass_obj
def export_command(obj: Context, since: int, fmt: str, out: Path | None) -> None:
    """Write the audit events with their chain fields and checkpoints, as JSON lines."""
    config = obj.load().config
    if out is None:
        written = asyncio.run(_export(config, since, sys.stdout))
    else:
        try:
            handle = out.open("w", encoding="utf-8")
        except OSError as exc:
            _fail(f"cannot write {out}: {exc}")
            return
        with handle:
            written = asyncio.run(_export(config, since, handle))
    click.echo(f"exported {written[0]} events and {written[1]} checkpoints from seq {written[2]}", err=True)


async def _export(config: KazmaConfig, since: int, out: TextIO) -> tuple[int, int, int]:
    signer = read_audit_signer(config)
    async with store_for_command(config, read_only=True) as conn:
        store = ApprovalStore(conn)
        # The last checkpoint first, the others read a page at a time beside the events (never held whole): only
        # what a checkpoint read here signs is exported. An event appended since (Kazma runs) or left unsigned by a
        # crash can be vouched for only with the audit key, which a verifier elsewhere does not hold, so it would
        # fail there as "written outside Kazma". The next export (after the next checkpoint) holds it.
        last = await store.last_checkpoint()
        signed_to = None if last is None else last.seq
        first = await _Signed(store, upto=signed_to or 0).first()
        if first is not None and first.kind == HISTORY and first.first_seq < since <= first.seq:
            since = first.first_seq  # events before the chain can only be checked from their first one
        out.write(line(header_record(since=since, key_ids=[] if signer is None else signer.keyring.ids)))
        events = kept = 0
        signed = _Signed(store, upto=signed_to or 0, after=since - 1)
        async for record in export_records(_pages(store, since - 1, upto=signed_to), signed.through(signed_to or 0)):
            out.write(line(record))
            events += record["type"] == "event"
            kept += record["type"] == "checkpoint"
        newest = await store.last_event_seq()
        if signed_to is not None and newest > signed_to:
            left = newest - signed_to
            click.echo(
                f"not exported: {left} event{'s' if left != 1 else ''} after seq {signed_to}, not signed yet (export"
                " again after the next checkpoint, within a minute while Kazma runs)",
                err=True,
            )
        return events, kept, since


@audit.command("public-key")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None, help="A file (default: stdout).")
@click.pass_obj
def public_key_command(obj: Context, out: Path | None) -> None:
    """Print the public keys that verify the audit chain's checkpoints (give them to whoever verifies)."""
    config = obj.load().config
    signer = read_audit_signer(config)
    if signer is None:
        _fail(audit_key_problem(config))
        return
    text = signer.public_keys().text()
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        click.echo(f"{out}: {', '.join(signer.keyring.ids)}", err=True)
