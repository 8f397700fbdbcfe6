"""The audit chain outside the store: JSON lines that a verifier with only the public keys can check.

One record per line, in sequence order:

* ``{"type": "header", "format": "kazma-audit-v1", "since": 1, "key_ids": ["a1"], ...}`` first (an export has
  one; a sink's file may not);
* ``{"type": "event", "seq": …, "request_id": …, "event": …, "actor": …, "platform": …, "at": …,
  "args_hash": …, "detail": …, "prev_hash": …, "chain_hash": …}`` for every event;
* ``{"type": "checkpoint", "kind": …, "first_seq": …, "seq": …, "head": …, "at": …, "key_id": …,
  "signature": …}`` after the event it signs.

``at`` is epoch seconds as the store holds it (JSON keeps a float exactly). A field that holds what Kazma never
writes (changed around it) is ``{"never_written": "<repr>"}``: it leaves the store all the same, and fails
verification there. Everything an event's hash and a checkpoint's signature cover is in its record, so ``kazma audit
verify --from-export FILE --public-key KEYS`` needs nothing else: not the store, not a secret. The public keys are
*not* in the file: a verifier must hold them already (``kazma audit public-key``), or whoever forged the file would
bring their own.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kazma.approvals.chain import GENESIS, ChainedEvent
from kazma.approvals.checkpoints import Checkpoint, checkpoint_of

FORMAT: Final = "kazma-audit-v1"
_EVENT_FIELDS: Final = (
    "seq", "request_id", "event", "actor", "platform", "at", "args_hash", "detail", "prev_hash", "chain_hash",
    "person",
)  # fmt: skip
_CHECKPOINT_FIELDS: Final = ("kind", "first_seq", "seq", "head", "at", "key_id", "signature")


# A field that holds what Kazma never writes (a row changed around it: bytes where text was, a time that is text or
# not a finite number) is written as {"never_written": "<its repr>"}: JSON holds it, the export (or a sink) does not
# fail on it, and the reader gives the verifier a value no event hashes from, so the verifier names that event
# "changed", as verify on the store does.
NEVER_WRITTEN: Final = "never_written"
_TEXT_FIELDS: Final = frozenset(
    ("request_id", "event", "actor", "platform", "args_hash", "detail", "prev_hash", "chain_hash", "person")
)


_SEQ_MAX: Final = 2**63 - 1  # the largest key either store holds (SQLite's INTEGER, PostgreSQL's bigint)
_SHOWN: Final = 80  # characters of a bad value shown in an error


class ExportError(ValueError):
    """A line of an export that is not a record of this format: says which line and why."""


class NeverWritten:
    """A field's value as an export read it back when the store held what Kazma never writes: it hashes to
    nothing (event_hash raises TypeError), so the verifier names the event changed."""

    __slots__ = ("shown",)

    def __init__(self, shown: str) -> None:
        self.shown = shown

    def __repr__(self) -> str:
        return f"never written: {self.shown}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeverWritten) and other.shown == self.shown

    def __hash__(self) -> int:
        return hash(self.shown)


def _as_written(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as the export writes it (see NEVER_WRITTEN)."""
    if name in _TEXT_FIELDS:
        if value is None or type(value) is str:
            return value
    elif name == "at":
        if type(value) is int or (type(value) is float and math.isfinite(value)):
            return value
    else:  # seq: the table's integer key
        return value
    shown = value.shown if isinstance(value, NeverWritten) else repr(value)
    return {NEVER_WRITTEN: shown}


def event_record(event: ChainedEvent) -> dict[str, Any]:
    return {"type": "event", **{name: _as_written(name, getattr(event, name)) for name in _EVENT_FIELDS}}


def checkpoint_record(checkpoint: Checkpoint) -> dict[str, Any]:
    odd = dict(checkpoint.never_written)  # a field changed around Kazma leaves as what the store held (NEVER_WRITTEN)
    return {
        "type": "checkpoint",
        **{
            name: {NEVER_WRITTEN: odd[name]} if name in odd else getattr(checkpoint, name)
            for name in _CHECKPOINT_FIELDS
        },
    }


def header_record(*, since: int, key_ids: Iterable[str], exported_at: float | None = None) -> dict[str, Any]:
    return {
        "type": "header",
        "format": FORMAT,
        "since": since,
        "key_ids": list(key_ids),
        "exported_at": time.time() if exported_at is None else exported_at,
    }


def line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"


@dataclass
class Export:
    """An export read back: its header (if any), events and checkpoints."""

    since: int | None = None
    key_ids: list[str] = field(default_factory=list)
    events: list[ChainedEvent] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)

    @property
    def anchored(self) -> bool:
        """Whether it starts where the chain starts (else its first event's link is taken as given, and only a
        checkpoint or a head seen elsewhere can vouch for it)."""
        return not self.events or min(self.events, key=lambda e: e.seq).prev_hash in (None, GENESIS)


class _FieldTwice(Exception):
    """A field given twice in one JSON object (caught in read_export, never raised past it)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every field is given once. json keeps the last of two, other readers the first: a
    record verified with one value of a field would be read elsewhere with the other (``"detail": "approved",
    "detail": "denied: no"`` verified as the denial it is hashed with, and shown as an approval)."""
    record: dict[str, Any] = {}
    for name, value in pairs:
        if name in record:
            raise _FieldTwice(name)
        record[name] = value
    return record


def read_export(text: str | bytes, *, source: str) -> Export:
    """The records of an export (or a sink's file), checked field by field; ExportError names the bad line.

    ``bytes`` (a file as read): each line is decoded on its own, so one that is not UTF-8 is named by its number."""
    export = Export()
    # Split at "\n" alone: str.splitlines also splits at U+2028, U+0085 and more, which JSON leaves raw inside a
    # text (a reason someone typed), cutting a record in two. A "\r" left at a line's end is JSON whitespace.
    lines: list[str | bytes] = [*(text.split(b"\n") if isinstance(text, bytes) else text.split("\n"))]
    for number, written in enumerate(lines, start=1):
        record = _record(written, f"{source}, line {number}")
        if isinstance(record, ChainedEvent):
            export.events.append(record)
        elif isinstance(record, Checkpoint):
            export.checkpoints.append(record)
        elif record is not None:
            export.since, export.key_ids = record
    return export


def _record(written: str | bytes, where: str) -> ChainedEvent | Checkpoint | tuple[int, list[str]] | None:
    """One line of an export: an event, a checkpoint, a header's (since, key_ids), or None for a blank line."""
    raw = _decoded(written, where)
    if not raw.strip():
        return None
    try:
        record = json.loads(raw, object_pairs_hook=_once_each)
    except _FieldTwice as exc:
        raise ExportError(f"{where}: field {exc.name!r} given twice (no export writes one twice)") from None
    except json.JSONDecodeError as exc:
        raise ExportError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:  # arrays or objects nested deeper than any record: crafted, never written
        raise ExportError(f"{where}: not a record (nested too deep)") from None
    except ValueError:  # an integer of more digits than Python reads (int_max_str_digits)
        raise ExportError(f"{where}: not a record (a number of more digits than any record holds)") from None
    if not isinstance(record, dict):
        raise ExportError(f"{where}: expected a JSON object")
    kind = record.get("type")
    try:
        if kind == "event":
            return _event(record)
        if kind == "checkpoint":
            return _checkpoint(record)
        if kind == "header":
            if record.get("format") != FORMAT:
                raise ExportError(f"format {_shown(record.get('format'))} is not {FORMAT!r}")
            return _int(record, "since"), _key_ids(record.get("key_ids", []))
        raise ExportError(f"unknown record type {_shown(kind)}")
    except (ExportError, KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{where}: {exc}") from None


class ExportFile:
    """An export (or a sink's file) read from its file line by line, never whole: a first pass checks every line
    (as :func:`read_export` does, the same errors) and keeps its header and checkpoints; iterating it reads the
    events again, in sequence order, each time (:func:`~kazma.approvals.audit_verify.verify` may walk them twice).

    A file whose events are not in sequence order (a receiver of a sink's redeliveries that appended them as they
    came) is read whole instead, and sorted as :func:`events_in_order` does: only order needs the memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.since: int | None = None
        self.key_ids: list[str] = []
        self.checkpoints: list[Checkpoint] = []
        self.events = 0  # event records, a redelivered one counted each time
        # What events_in_order says of a seq given twice with different contents: raised by the verifier, which
        # alone reads the events (heads taken from the file need its checkpoints only).
        self.conflict: ExportError | None = None
        self._first: ChainedEvent | None = None  # the event with the lowest seq (the first so given)
        self._sorted: list[ChainedEvent] | None = None  # the events, when the file does not give them in order
        last: ChainedEvent | None = None
        for record in self._records():
            if isinstance(record, ChainedEvent):
                self.events += 1
                if self._first is None or record.seq < self._first.seq:
                    self._first = record
                if last is None or record.seq > last.seq:
                    last = record
                elif record.seq < last.seq:
                    self._sorted = []  # sorted below, once every line is known to read
                elif record != last and self.conflict is None:
                    self.conflict = ExportError(f"seq {record.seq} appears twice with different contents")
            elif isinstance(record, Checkpoint):
                self.checkpoints.append(record)
            elif record is not None:
                self.since, self.key_ids = record
        if self._sorted is not None:
            self.conflict = None
            try:
                self._sorted = events_in_order(
                    Export(events=[r for r in self._records() if isinstance(r, ChainedEvent)])
                )
            except ExportError as exc:
                self.conflict = exc

    def _records(self) -> Iterator[ChainedEvent | Checkpoint | tuple[int, list[str]] | None]:
        source = str(self.path)
        with self.path.open("rb") as handle:
            # A binary file's lines end at b"\n" alone, as read_export splits them.
            for number, written in enumerate(handle, start=1):
                yield _record(written[:-1] if written.endswith(b"\n") else written, f"{source}, line {number}")

    @property
    def anchored(self) -> bool:
        """As :attr:`Export.anchored`: whether it starts where the chain starts."""
        return self._first is None or self._first.prev_hash in (None, GENESIS)

    def __iter__(self) -> Iterator[ChainedEvent]:
        """The events by sequence number, a record sent twice (identical) once."""
        if self._sorted is not None:
            yield from self._sorted
            return
        last: ChainedEvent | None = None
        for record in self._records():
            if isinstance(record, ChainedEvent) and (last is None or record.seq > last.seq):
                last = record
                yield record


def _decoded(written: str | bytes, where: str) -> str:
    if isinstance(written, str):
        return written
    try:
        return written.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExportError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start + 1})") from None


def events_in_order(export: Export) -> list[ChainedEvent]:
    """The events by sequence number; a record sent twice (a sink's redelivery) counts once when identical."""
    by_seq: dict[int, ChainedEvent] = {}
    for event in export.events:
        kept = by_seq.setdefault(event.seq, event)
        if kept != event:
            raise ExportError(f"seq {event.seq} appears twice with different contents")
    return [by_seq[seq] for seq in sorted(by_seq)]


def checkpoints_in_order(export: Export | ExportFile) -> list[Checkpoint]:
    by_seq: dict[tuple[int, int], Checkpoint] = {}
    for checkpoint in export.checkpoints:
        kept = by_seq.setdefault((checkpoint.seq, checkpoint.first_seq), checkpoint)
        if kept != checkpoint:
            raise ExportError(f"checkpoint #{checkpoint.seq} appears twice with different contents")
    return [by_seq[key] for key in sorted(by_seq)]


def _int(record: dict[str, Any], name: str) -> int:
    """A sequence number: the store numbers events and checkpoints from 1, and no further than a 64-bit key."""
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _SEQ_MAX:
        raise ValueError(f"{name} must be a sequence number (an integer from 1), got {_shown(value)}")
    return value


def _key_ids(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"key_ids must be a list of key ids, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}… ({len(text)} characters)"


def _fields(record: dict[str, Any], names: tuple[str, ...]) -> None:
    """A record has exactly its fields: one missing or unknown (a name changed) is no record of this format."""
    expected = {"type", *names}
    if set(record) != expected:
        missing, unknown = sorted(expected - set(record)), sorted(set(record) - expected)
        raise ValueError(f"fields missing: {missing or '-'}; unknown: {_shown(unknown) if unknown else '-'}")


def _never_written(value: Any) -> NeverWritten | None:
    if isinstance(value, dict) and set(value) == {NEVER_WRITTEN} and isinstance(value[NEVER_WRITTEN], str):
        return NeverWritten(value[NEVER_WRITTEN])
    return None


def _text(record: dict[str, Any], name: str, *, optional: bool = True) -> str | None:
    value = record[name]
    if value is None and optional:
        return None
    odd = _never_written(value)
    if odd is not None:
        return odd  # type: ignore[return-value]  # hashes to nothing: the verifier names the event changed
    if not isinstance(value, str):
        raise ValueError(f"{name} must be text{' or null' if optional else ''}, got {_shown(value)}")
    return value


def _float(record: dict[str, Any], name: str) -> float:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {_shown(value)}")
    return float(value)


def _event(record: dict[str, Any]) -> ChainedEvent:
    _fields(record, _EVENT_FIELDS)
    event = _text(record, "event", optional=False)
    return ChainedEvent(
        seq=_int(record, "seq"),
        request_id=_text(record, "request_id"),
        event=event if isinstance(event, NeverWritten) else str(event),
        actor=_text(record, "actor"),
        platform=_text(record, "platform"),
        at=math.nan if _never_written(record["at"]) is not None else _float(record, "at"),
        args_hash=_text(record, "args_hash"),
        detail=_text(record, "detail"),
        prev_hash=_text(record, "prev_hash"),
        chain_hash=_text(record, "chain_hash"),
        person=_text(record, "person"),
    )


def _checkpoint(record: dict[str, Any]) -> Checkpoint:
    _fields(record, _CHECKPOINT_FIELDS)
    odd = {name: found.shown for name in _CHECKPOINT_FIELDS if (found := _never_written(record[name])) is not None}
    seq = _int(record, "seq")  # the table's key: always an integer there
    # Every other field is what Kazma writes, or what the store held instead (odd): then the verifier names it.
    readers: dict[str, Callable[[], Any]] = {
        "kind": lambda: _text(record, "kind", optional=False),
        "first_seq": lambda: _int(record, "first_seq"),
        "head": lambda: _text(record, "head", optional=False),
        "at": lambda: _float(record, "at"),
        "key_id": lambda: _text(record, "key_id"),
        "signature": lambda: _text(record, "signature"),
    }
    values: dict[str, Any] = {name: None if name in odd else read() for name, read in readers.items()}
    return checkpoint_of({**values, "seq": seq}, never_written=odd)


async def export_records(
    events: AsyncIterator[list[ChainedEvent]], checkpoints: AsyncIterator[Checkpoint]
) -> AsyncIterator[dict[str, Any]]:
    """Events (in batches, in sequence order) with each checkpoint (read as they come, in sequence order: never
    held whole) right after the event it signs."""
    ahead = await anext(checkpoints, None)
    async for batch in events:
        for event in batch:
            while ahead is not None and ahead.seq < event.seq:
                yield checkpoint_record(ahead)
                ahead = await anext(checkpoints, None)
            yield event_record(event)
            while ahead is not None and ahead.seq == event.seq:
                yield checkpoint_record(ahead)
                ahead = await anext(checkpoints, None)
    while ahead is not None:
        yield checkpoint_record(ahead)
        ahead = await anext(checkpoints, None)
