"""Verifying the audit chain: every link, every signature, and heads seen elsewhere.

:func:`verify` walks the events in sequence order and the checkpoints beside
them, and reports every problem it finds, each at the sequence number where it
shows and with what is wrong:

* ``changed``: an event no longer hashes to the chain hash written with it, or
  events no longer hash to the head a checkpoint (or a head seen elsewhere) signed;
* ``missing``: a sequence number is absent, or an event follows one that is gone;
* ``reordered``: an event follows another event than the one before it;
* ``inserted``: an event that is not part of the chain (no chain fields, or the
  event after it was chained to the one before it);
* ``unsigned``: an event no signed checkpoint covers;
* ``truncated``: a checkpoint, or a head seen elsewhere, names a sequence number
  past the end of the log; or (verifying the store) a request's row records an outcome, or its opening, whose
  event is not in the log: the events that recorded it were cut, with the checkpoints that signed them;
* ``bad signature``: a checkpoint whose signature does not verify with the public
  keys given (or that is not signed at all);
* ``decision seal`` (verifying the store, with its decision key): a request the log says ended whose row's decision
  seal does not verify, is missing, or cannot be checked here; or whose row is gone, or says it is pending again.
  The chain proves the log; what a row says beyond its status and decider (the call approved, where, when, the
  person) only its seal binds.

:attr:`Report.first` is the problem with the lowest sequence number: the first
bad sequence number. Nothing here needs a secret: only the public keys.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kazma.approvals.card import CardIntegrityError, verify_integrity
from kazma.approvals.chain import GENESIS, ChainedEvent
from kazma.approvals.checkpoints import HISTORY, Checkpoint, PublicKeys
from kazma.approvals.model import ApprovalRequest, Status
from kazma.approvals.seal import KEY_UNKNOWN, SealProblem, seal_problem
from kazma.config.keyring import Keyring

CHANGED = "changed"
MISSING = "missing"
REORDERED = "reordered"
INSERTED = "inserted"
UNSIGNED = "unsigned"
TRUNCATED = "truncated"
BAD_SIGNATURE = "bad signature"
SEAL = "decision seal"
CHAINED_UNSEALED = (
    "it carries no decision seal, but its ending event was recorded after Kazma sealed every outcome: the seal was "
    "taken off around Kazma, or the row written there"
)
SEALS_NAMED = 100  # requests named whose seal does not hold (a forger's bulk rewrite leaves many alike)

# SEQ:HEX, or a settled card's footer as copied off it, its label too ("Audit checkpoint: #SEQ HEX"). The hex is
# checked for its length apart, so a short one is told why.
_HEAD = re.compile(r"^(?:audit checkpoint:?\s*)?#?(\d+)[:\s]+([0-9a-fA-F]*)$", re.IGNORECASE)
# The fewest hex of a chain hash a head may give: what a settled card shows. Fewer prove nothing: a log whose hash
# starts with 6 given hex (24 bits) is found in seconds.
HEAD_MIN_HEX = 12
_HASH_HEX = 64
_HEX = frozenset("0123456789abcdef")


class HeadError(ValueError):
    """A head given on the command line that cannot be read."""


@dataclass(frozen=True)
class Head:
    """A checkpoint seen elsewhere: a sequence number and (a prefix of) the chain hash there."""

    seq: int
    prefix: str  # lower-case hex, HEAD_MIN_HEX to 64 characters
    source: str = "given"

    def __post_init__(self) -> None:
        if not HEAD_MIN_HEX <= len(self.prefix) <= _HASH_HEX or not _HEX.issuperset(self.prefix):
            raise HeadError(
                f"head #{self.seq} {self.prefix[: _HASH_HEX + 1]!r} ({self.source}) is not a chain hash: a head "
                f"needs at least {HEAD_MIN_HEX} hex digits of it (a settled card shows {HEAD_MIN_HEX}, an export all "
                f"{_HASH_HEX}); fewer prove nothing, since a log whose hash starts with them is easily made"
            )

    @classmethod
    def parse(cls, text: str, *, source: str = "given") -> Head:
        """``SEQ:HEX`` (or ``#SEQ HEX`` as a settled card shows it)."""
        match = _HEAD.match(text.strip())
        if match is None:
            raise HeadError(
                f"{text!r} is not a head: write SEQ:HEX, e.g. 1234:3fa9c2d18e0b"
                " (a settled card shows it as #1234 3fa9c2d18e0b)"
            )
        return cls(int(match.group(1)), match.group(2).lower(), source)


@dataclass(frozen=True)
class RecordedEnding:
    """The ending event the log holds for a request (a decision, a timeout, a cancel), as it reads."""

    seq: int
    event: str
    actor: str | None
    detail: str | None

    def said(self) -> str:
        by = f" by {self.actor}" if self.actor else ""
        detail = f" ({self.detail!r})" if self.detail else ""
        return f"its {self.event} event at seq {self.seq}{detail}{by}"


@dataclass(frozen=True)
class UnrecordedRequest:
    """A request whose row the audit log does not record: the event written with the row's current state (its
    ``opened`` while pending, its ending event once finished: ``decided`` by its decider with its outcome, or the
    ``timeout`` or ``cancelled`` it is) is not in the log."""

    id: str
    status: str
    sealed: bool  # the row carries a decision seal
    decided_by: str | None = None
    # The ending event the log holds instead, when it holds one: then the row was changed, not the log cut.
    recorded: RecordedEnding | None = None

    def event(self) -> str:
        if self.status == "pending":
            return "opened"
        return "decided" if self.status in ("approved", "denied") else self.status

    def changed(self) -> str:
        """What is wrong with a row the log records another ending for (``recorded`` is set)."""
        by = f" by {self.decided_by}" if self.decided_by and self.status in ("approved", "denied") else ""
        said = self.recorded.said() if self.recorded is not None else "its ending event"
        return (
            f"request {self.id}'s row says {self.status}{by}, but the audit log records {said}: the row was "
            "changed around Kazma (`kazma doctor` checks its decision seal)"
        )

    def detail(self, last: int) -> str:
        state = "pending" if self.status == "pending" else f"{self.status} ({'sealed' if self.sealed else 'no seal'})"
        cut = "the audit log is empty" if last == 0 else f"events after seq {last} may have been cut"
        return f"request {self.id} is {state} but the audit log has no {self.event()} event for it: {cut}"


@dataclass(frozen=True)
class Problem:
    seq: int
    kind: str
    detail: str

    def line(self) -> str:
        return f"seq {self.seq}: {self.kind}: {self.detail}"


@dataclass
class Report:
    events: int = 0
    checkpoints: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    head: str | None = None
    heads_checked: int = 0
    signatures_failed: int = 0  # checkpoints whose signature does not verify with the keys given
    pending: int = 0  # events after the last checkpoint that Kazma's commit seals vouch for: signed any moment
    history: Checkpoint | None = None  # the one-time chaining's checkpoint, if the log had events before the chain
    # Whether the events start where the chain starts (its first link, or the history's first event): what the
    # signatures prove then covers the log from its beginning. Else a slice: its first link is taken as given.
    from_start: bool = True
    problems: list[Problem] = field(default_factory=list)
    seals: Seals | None = None  # the decision seals judged (verifying the store), None where there are none to judge

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def no_signature_holds(self) -> bool:
        """Not one checkpoint verifies with the keys given: every one forged, or (far likelier where nothing else
        is wrong) the keys are not the ones the log was signed with."""
        return self.checkpoints > 0 and self.signatures_failed == self.checkpoints

    @property
    def first(self) -> Problem | None:
        return min(self.problems, key=lambda p: p.seq) if self.problems else None

    def summary(self) -> str:
        if self.first is not None:
            more = len(self.problems) - 1
            tail = f" ({more} more problem{'s' if more != 1 else ''} after it)" if more else ""
            return f"FAILED: first bad sequence {self.first.line()}{tail}"
        if not self.events:
            return "ok: the audit log is empty" if self.from_start else "ok: this slice holds no event"
        span = f"{self.first_seq}..{self.last_seq}"
        heads = f"; {self.heads_checked} head(s) seen elsewhere are in it" if self.heads_checked else ""
        pending = f"; the last {self.pending} are sealed by Kazma and not signed yet" if self.pending else ""
        start = (
            f"from the start of the log (seq {self.first_seq}, chained from its first link)"
            if self.from_start
            else f"a slice from seq {self.first_seq}: nothing in it proves the events before it"
        )
        return (
            f"ok: {self.events} events (seq {span}) chained, {self.checkpoints} checkpoints signed; "
            f"head #{self.last_seq} {(self.head or '')[:12]}{heads}{pending}; {start}"
        )


class Seals:
    """The decision seals of every request the log says ended, judged a page at a time as the store is read: only
    the first :data:`SEALS_NAMED` problems are kept, the rest counted.

    Which rows must carry a seal is the chain's to say, not the store's: a decision whose ending event was chained
    after the history checkpoint (every one, where the log has none) was made by a Kazma that sealed every outcome.
    The schema row that says when seals began is in the store too, so the forger who takes a seal off moves it."""

    def __init__(self, keyring: Keyring | None, history: Checkpoint | None, sealed_since: float | None) -> None:
        self.keyring = keyring
        self.history = history
        self.sealed_since = sealed_since
        self.verified = 0
        self.historic = 0  # decided before seals (in the history, and before they began): they can never run
        self.problems: list[Problem] = []
        self.more = 0
        self.unknown = 0  # sealed with a key not held here (or no decision key here): not checked
        # Sealed with a key the keyring records as retired (`kazma keys retire`): history, not checked; by key id.
        self.retired: dict[str, int] = {}
        self.first_unknown: Problem | None = None
        self.calls: list[Problem] = []  # calls changed since they were opened
        # Remembered approvals ("Approve for 1 h"): each row's seal, and its revocation against the log's.
        self.rules_verified = 0
        self.rules_historic = 0  # made before rules were sealed: refused when consulted, as they always were
        self.rules_retired = 0
        self.rules_unknown = 0
        self.first_rule_unknown: Problem | None = None

    def _bad(self, seq: int, detail: str) -> None:
        if len(self.problems) < SEALS_NAMED:
            self.problems.append(Problem(seq, SEAL, detail))
        else:
            self.more += 1

    def judge(self, seq: int, request_id: str, row: ApprovalRequest | None) -> None:
        """``request_id``'s row (None: there is none) against its first ending event, at ``seq``."""
        if row is None:
            self._bad(seq, f"request {request_id}'s row is gone, but the audit log records its ending event: "
                      "deleted around Kazma")  # fmt: skip
            return
        if row.status is Status.PENDING:
            self._bad(
                seq,
                f"request {request_id}'s row says pending, but the audit log records its ending event: the row was "
                "changed around Kazma, so that it can be decided again",
            )
            return
        who = f"{row.status.value} by {row.decided_by}" if row.decided_by else row.status.value
        if row.decision_mac is None and self._historic(seq, row):
            self.historic += 1
            return
        if row.decision_mac is None:
            self._bad(seq, f"request {request_id} ({who}): {CHAINED_UNSEALED}")
            return
        try:
            verify_integrity(row)  # the seal binds the arguments' hash: the text beside it could say another call
        except CardIntegrityError as exc:
            self._bad(seq, f"request {request_id} ({who}): its stored call was changed around Kazma: {exc.reason}")
            return
        problem = seal_problem(self.keyring, row)
        if problem is None:
            self.verified += 1
        elif problem.retired and row.decision_key_id is not None:
            self.retired[row.decision_key_id] = self.retired.get(row.decision_key_id, 0) + 1
        elif problem.site == KEY_UNKNOWN:
            self.unknown += 1
            if self.first_unknown is None:
                self.first_unknown = Problem(seq, SEAL, f"request {request_id} ({who}): {problem.detail}")
        else:
            self._bad(seq, f"request {request_id} ({who}): {problem.detail}")

    def changed_calls(self, changed: Sequence[tuple[str, int, str, str]], *, more: bool) -> None:
        """Requests whose stored call does not hash as their ``opened`` event records it (see
        :meth:`~kazma.approvals.store.ApprovalStore.calls_changed`): ``changed`` at that event."""
        for request_id, seq, stored, opened in changed:
            self.calls.append(
                Problem(
                    seq,
                    CHANGED,
                    f"request {request_id}'s stored call hashes to {stored[:12]}…, but the audit log records it opened "
                    f"for {opened[:12]}…: its call was changed around Kazma (what its cards showed, and any decision "
                    "on it, is of that call)",
                )
            )
        if more and changed:
            self.calls.append(
                Problem(changed[-1][1], CHANGED, f"more requests like these: only the first {len(changed)} are named")
            )

    def judge_rule(
        self,
        seq: int,
        rule_id: str,
        made_by: str,
        problem: SealProblem | None,
        *,
        unsealed_before: bool,
        revoked_seq: int | None,
        in_force: bool,
    ) -> None:
        """A remembered approval's row: ``problem`` is its seal's (None: it verifies); ``seq`` its ``rule_created``
        (or where its log ends, when it has none); ``revoked_seq`` the log's ``rule_revoked`` for it.
        ``unsealed_before``: it carries no seal and was made before this store sealed rules. ``in_force``: its row
        says it was never revoked. A row that fails is refused when a call consults it, but only verify says so
        before anyone's call does."""
        who = f"remembered approval {rule_id} (by {made_by})"
        if in_force and revoked_seq is not None:
            self._bad(
                revoked_seq,
                f"{who} says in force, but the audit log records it revoked here: set back in force around Kazma "
                "(a call it would stand for is refused)",
            )
        if problem is None:
            self.rules_verified += 1
        elif problem.retired:
            self.rules_retired += 1
        elif problem.site == KEY_UNKNOWN:
            self.rules_unknown += 1
            if self.first_rule_unknown is None:
                self.first_rule_unknown = Problem(seq, SEAL, f"{who}: {problem.detail}")
        elif unsealed_before:
            self.rules_historic += 1
        else:
            self._bad(seq, f"{who}: {problem.detail}; written or changed around Kazma (it is refused when consulted)")

    def unreadable(self, seq: int, request_id: str, columns: Sequence[str]) -> None:
        self._bad(
            seq,
            f"request {request_id}'s row cannot be read (a text in {', '.join(columns)} is not UTF-8): written "
            "outside Kazma, so its seal cannot be checked (none of it will run)",
        )

    def _historic(self, seq: int, row: ApprovalRequest) -> bool:
        """Decided before Kazma sealed outcomes: its ending event is among those chained once at the upgrade, and
        (where the store says when seals began) decided before then."""
        if self.history is None or seq > self.history.seq:
            return False
        began = self.sealed_since
        return began is None or (row.decided_at is not None and row.decided_at.timestamp() < began)

    def summary(self) -> str:
        """One line for people once all holds: what was verified, and what was not checked and why."""
        before = f" ({self.historic} decided before seals)" if self.historic else ""
        retired = "".join(
            f"; {count} sealed by retired key {key_id}, not checked (the log still records each one's outcome, "
            "decider and call)"
            for key_id, count in sorted(self.retired.items())
        )
        rules = ""
        if self.rules_verified or self.rules_historic or self.rules_retired:
            rules = f"; remembered approvals: {self.rules_verified} verified"
            rules += f" ({self.rules_historic} made before they were sealed)" if self.rules_historic else ""
            rules += f", {self.rules_retired} sealed by a retired key, not checked" if self.rules_retired else ""
        return f"decision seals: {self.verified} verified{before}{retired}{rules}"

    def said(self) -> list[Problem]:
        found = [*self.calls, *self.problems]
        if self.more:
            last = max(p.seq for p in self.problems)
            found.append(Problem(last, SEAL, f"{self.more} more requests like these: only the first {SEALS_NAMED} "
                                 "are named (`kazma doctor` names them too)"))  # fmt: skip
        if self.unknown and self.first_unknown is not None:
            first = self.first_unknown
            found.append(
                Problem(
                    first.seq,
                    SEAL,
                    f"{self.unknown} finished request{'s' if self.unknown != 1 else ''} carry a decision seal that "
                    f"cannot be checked here, the first {first.detail.removeprefix('request ')} (verify where "
                    "Kazma's decision keys are: $KAZMA_DECISION_KEY, or the key file beside the store; a key "
                    "retired on purpose is recorded by `kazma keys retire`, or by a `# retired ID` line in "
                    "$KAZMA_DECISION_KEY, and what it sealed is then history)",
                )
            )
        if self.rules_unknown and self.first_rule_unknown is not None:
            first = self.first_rule_unknown
            found.append(
                Problem(
                    first.seq,
                    SEAL,
                    f"{self.rules_unknown} remembered approval{'s' if self.rules_unknown != 1 else ''} carry a seal "
                    f"that cannot be checked here, the first {first.detail.removeprefix('remembered approval ')}",
                )
            )
        return found


class _Walk:
    """The state of one pass over events and checkpoints, both in sequence order."""

    def __init__(
        self,
        keys: PublicKeys,
        heads: Iterable[Head],
        anchored: bool,
        history: Checkpoint | None,
        pending: Collection[int],
        since: int | None = None,
        wanted: frozenset[str] | None = None,
    ) -> None:
        self.keys = keys
        self.since = since  # the first sequence number the events must reach back to (None: any, doctor's tail)
        self.pending = pending
        self.report = Report(history=history, from_start=anchored)
        self.history = history
        self.heads: dict[int, list[Head]] = {}
        for head in heads:
            self.heads.setdefault(head.seq, []).append(head)
        self.anchored = anchored  # the log starts at its beginning (not an export --since)
        self.prev: str | None = None  # the hash the next event should follow
        self.last: ChainedEvent | None = None
        self.last_misplaced = False  # the last event did not follow the one before it
        # Nothing is kept per event (a log of millions is walked in pages): where a misplaced event belongs is
        # looked up among the hashes it names alone. A first pass (wanted None) notes them in `asked`; only if
        # one is asked does a second pass keep them (chain hash -> the first seq there), the answers exact.
        self.wanted = wanted
        self.asked: set[str] = set()
        self.seen: dict[str, int] = {}
        # A prev_hash no earlier event has -> the index of its problem ("missing" until an event with that hash
        # turns up later in the log: then "reordered"), and the chain hash of the event before it, if in the log.
        self.orphans: dict[str, tuple[int, str | None]] = {}
        # The seqs of links not yet covered by a checkpoint, as runs [first, last] in order: a span between two
        # numbers is looked up by them, never walked number by number (an export may name seq 2**62: a range
        # over the gap would never end), and a run without gaps is two numbers however long.
        self.runs: list[list[int]] = []
        self.covered_to = 0  # the last seq a checkpoint covers
        self.mismatches: list[tuple[Checkpoint, Problem]] = []  # checkpoints whose head the events do not reach
        # What a "missing" event's checkpoints say of it (see _changed_and_rehashed), judged as they are walked so
        # that no checkpoint is kept: the last one with a good signature, as (seq, head); the orphans (seq, the hash
        # they follow) no checkpoint has vouched for yet, in seq order; and the seq of the checkpoint that did.
        self.last_signed: tuple[int, str] | None = None
        self.open_orphans: list[tuple[int, str]] = []
        self.signed_over: dict[str, int] = {}

    def earlier(self, chain_hash: str) -> int | None:
        """The first seq walked so far whose link hashes to ``chain_hash``."""
        if self.wanted is None:
            self.asked.add(chain_hash)
        return self.seen.get(chain_hash)

    def link_at(self, seq: int) -> str | None:
        """The chain hash at ``seq`` if it is the last event walked (the only one a checkpoint can still ask for:
        they are walked right after the event they sign, events in ascending order)."""
        return self.prev if self.last is not None and self.last.seq == seq else None

    def problem(self, seq: int, kind: str, detail: str) -> None:
        self.report.problems.append(Problem(seq, kind, detail))


class Verification:
    """One pass of :func:`verify`, fed the events one at a time (a store read in pages, a file line by line):
    what it keeps does not grow with the log, only with the problems found (and the checkpoints given at the
    start; those fed one at a time with :meth:`checkpoint` are not kept).

    After the events, :attr:`asked` says whether a second pass is needed: an event that does not follow the one
    before it names a hash to look up among the earlier ones, which a first pass does not keep. Feed the same
    events again to a Verification made with ``wanted=asked``; its report is the one to take."""

    def __init__(
        self,
        checkpoints: Iterable[Checkpoint],
        keys: PublicKeys,
        *,
        heads: Iterable[Head] = (),
        anchored: bool = True,
        pending: Collection[int] = (),
        since: int | None = None,
        wanted: frozenset[str] | None = None,
        history: Checkpoint | None = None,
    ) -> None:
        self.ordered = sorted(checkpoints, key=lambda c: c.seq)
        # Fed apart (see checkpoint()), the checkpoints are not all here: the caller says which is the history's.
        history = next((c for c in self.ordered if c.kind == HISTORY), history)
        self.walk = _Walk(keys, heads, anchored, history, pending, since, wanted)
        self.index = 0

    def add(self, event: ChainedEvent) -> None:
        """The next event, in ascending sequence order."""
        walk, ordered = self.walk, self.ordered
        _event(walk, event)
        while self.index < len(ordered) and ordered[self.index].seq <= event.seq:
            _checkpoint(walk, ordered[self.index])
            self.index += 1

    def checkpoint(self, checkpoint: Checkpoint) -> None:
        """A checkpoint fed apart from those given at the start (a store read in pages: none kept once judged), in
        sequence order: after every event up to its seq was added, before the next one."""
        _checkpoint(self.walk, checkpoint)

    @property
    def asked(self) -> frozenset[str] | None:
        """The hashes to keep in a second pass; None when this pass's answers are exact already."""
        if self.walk.wanted is not None or not self.walk.asked:
            return None
        return frozenset(self.walk.asked)

    def report(
        self,
        unrecorded: Sequence[UnrecordedRequest] = (),
        *,
        unrecorded_more: bool = False,
        pending: Collection[int] | None = None,
        seals: Seals | None = None,
    ) -> Report:
        """The report, once every event was added. ``pending`` (see :func:`verify`) may be given here, read after
        the events: only events past the last checkpoint can be pending, and those are judged only now."""
        walk = self.walk
        if pending is not None:
            walk.pending = pending
        for checkpoint in self.ordered[self.index :]:
            _checkpoint(walk, checkpoint)
        self.index = len(self.ordered)
        _ends(walk)
        _unrecorded(walk, unrecorded, more=unrecorded_more)
        if seals is not None:
            walk.report.problems += seals.said()
            walk.report.seals = seals
        return walk.report

    @property
    def history(self) -> Checkpoint | None:
        """The one-time chaining's checkpoint, if the log had events before the chain."""
        return self.walk.history


def verify(
    events: Iterable[ChainedEvent],
    checkpoints: Iterable[Checkpoint],
    keys: PublicKeys,
    *,
    heads: Iterable[Head] = (),
    anchored: bool = True,
    pending: Collection[int] = (),
    since: int | None = None,
    unrecorded: Sequence[UnrecordedRequest] = (),
    unrecorded_more: bool = False,
) -> Report:
    """Check ``events`` (in ascending sequence order) against their chain fields, ``checkpoints`` against ``keys``
    and the events, and ``heads`` seen elsewhere against the log.

    ``events`` is iterated once, and a second time when an event does not follow the one before it (see
    :class:`Verification`): a collection, or an object that reads the events again each time it is iterated.

    ``anchored=False``: the events start after the beginning of the log (an export with ``--since``, or one whose
    front was cut): the first one's ``prev_hash`` is taken as given, and only a checkpoint or head can vouch for
    it. ``pending``: events after the last checkpoint whose commit seals Kazma verified (only where its audit key
    is): not yet signed, not a problem. ``since``: where such a slice must start, at the latest: 1 when the whole
    log is expected (a slice then fails, ``missing``), the verifier's own ``--since`` for a slice. Never an
    export header's alone: the header is not signed, so whoever cut the front could write it too. None: any
    start (doctor's tail, read as a slice on purpose). ``unrecorded``: the store's requests whose row the log
    does not record (:meth:`~kazma.approvals.store.ApprovalStore.unrecorded_requests`; ``unrecorded_more``: more
    than those were found): each is ``truncated`` past the log's end, since a log cut at a checkpoint with the
    checkpoints after it removed is consistent in itself, and only the rows it recorded still show the cut.
    """
    ordered = sorted(checkpoints, key=lambda c: c.seq)
    given = list(heads)

    def walked(wanted: frozenset[str] | None) -> Verification:
        verification = Verification(
            ordered, keys, heads=given, anchored=anchored, pending=pending, since=since, wanted=wanted
        )
        for event in events:
            verification.add(event)
        return verification

    verification = walked(None)
    if verification.asked is not None:
        verification = walked(verification.asked)
    return verification.report(unrecorded, unrecorded_more=unrecorded_more)


def _unrecorded(walk: _Walk, requests: Sequence[UnrecordedRequest], *, more: bool) -> None:
    last = walk.last.seq if walk.last is not None else 0
    for request in requests:
        if request.recorded is not None:
            walk.problem(request.recorded.seq, CHANGED, request.changed())
        else:
            walk.problem(last + 1, TRUNCATED, request.detail(last))
    if more:
        walk.problem(last + 1, TRUNCATED, f"more requests like these: only the oldest {len(requests)} are named")


def _in_history(walk: _Walk, event: ChainedEvent) -> bool:
    return walk.history is not None and event.seq <= walk.history.seq and event.chain_hash is None


def _event(walk: _Walk, event: ChainedEvent) -> None:
    report = walk.report
    report.events += 1
    last = walk.last
    in_history = _in_history(walk, event)
    if last is None:
        report.first_seq = event.seq
        expected = (walk.history.first_seq if walk.history is not None else 1) if walk.anchored else event.seq
        if not walk.anchored and walk.since is not None and event.chain_hash is not None:
            # Chained events are numbered without gaps (events before the chain may have some): an export from
            # `since` whose first chained event comes later lost the ones between.
            expected = min(expected, walk.since)
        if event.seq > expected:
            if walk.anchored or expected != 1:
                _gap(walk, expected, event.seq)
            else:
                walk.problem(
                    1,
                    MISSING,
                    f"slice from seq {event.seq}: the events before it are not in this file, and nothing signed "
                    f"in it shows where it starts (verify it as a slice with --since {event.seq})",
                )
        walk.prev = GENESIS if walk.anchored or event.prev_hash is None else event.prev_hash
        walk.covered_to = 0 if walk.anchored else event.seq - 1
    elif event.seq != last.seq + 1 and not in_history:
        _gap(walk, last.seq + 1, event.seq)
    prev = walk.prev or GENESIS
    if event.chain_hash is None:
        # Before the chain began (its history checkpoint vouches for it), or written around Kazma.
        if not in_history:
            walk.problem(event.seq, INSERTED, "it carries no chain fields: written outside Kazma")
        computed = _hash_after(walk, event, prev)
        # One that cannot be hashed: what follows is judged against the link before it.
        _link(walk, event, prev if computed is None else computed, misplaced=False)
        return
    recomputed = None
    if event.prev_hash is not None:
        recomputed = _hash_after(walk, event, event.prev_hash)
        if recomputed is None:  # said; what follows is judged against what it said
            _link(walk, event, event.chain_hash, misplaced=False)
            return
    if recomputed != event.chain_hash:
        walk.problem(
            event.seq, CHANGED, f"it no longer hashes to the chain hash written with it ({event.chain_hash[:12]}…)"
        )
        _link(walk, event, event.chain_hash, misplaced=False)  # what follows it is judged against what it said
        return
    orphan = walk.orphans.pop(event.chain_hash, None)
    if orphan is not None:
        resolved = orphan[0]
        seq = walk.report.problems[resolved].seq
        walk.report.problems[resolved] = Problem(
            seq, REORDERED, f"it was chained after seq {event.seq}, which comes later in the log"
        )
    vouched = (
        last is not None
        and walk.history is not None
        and last.chain_hash is None
        and last.seq == walk.history.seq
        and event.prev_hash == walk.history.head
    )
    misplaced = event.prev_hash != prev and not vouched
    if misplaced:
        _misplaced(walk, event)
    _link(walk, event, event.chain_hash, misplaced=misplaced)


def _hash_after(walk: _Walk, event: ChainedEvent, prev: str) -> str | None:
    """``event``'s chain hash after ``prev``; None, the problem said, when a field holds a type or value Kazma
    never writes (bytes, a time that is text)."""
    try:
        return event.hash_after(prev)
    except (TypeError, ValueError) as exc:
        walk.problem(event.seq, CHANGED, f"it holds what Kazma never writes ({exc})")
        return None


def _gap(walk: _Walk, first: int, after: int) -> None:
    span = f"seq {first} is" if after == first + 1 else f"seqs {first}..{after - 1} are"
    where = "this file" if walk.report.last_seq is None and not walk.anchored else "the log"
    walk.problem(first, MISSING, f"{span} not in {where}")


def _misplaced(walk: _Walk, event: ChainedEvent) -> None:
    """``event`` is intact but does not follow the event before it: say where it belongs."""
    prev_hash = event.prev_hash or ""
    last = walk.last
    earlier = 0 if prev_hash == GENESIS else walk.earlier(prev_hash)
    if earlier is None:  # reordered if that event comes later in the log, else missing
        if prev_hash not in walk.orphans:
            walk.orphans[prev_hash] = (len(walk.report.problems), walk.link_at(event.seq - 1))
            walk.problem(event.seq, MISSING, f"the event it was chained after ({prev_hash[:12]}…) is not in the log")
            if walk.last_signed == (event.seq - 1, prev_hash):  # a checkpoint signed that very hash at seq - 1
                walk.signed_over[prev_hash] = event.seq - 1
            else:
                walk.open_orphans.append((event.seq, prev_hash))
    elif last is not None and earlier == last.seq - 1 and not walk.last_misplaced:
        walk.problem(
            last.seq,
            INSERTED,
            f"seq {event.seq} was chained right after seq {earlier}: seq {last.seq} is not part of the chain",
        )
    else:
        where = "the start of the chain" if earlier == 0 else f"seq {earlier}"
        walk.problem(event.seq, REORDERED, f"it was chained after {where}, not after seq {event.seq - 1}")


def _link(walk: _Walk, event: ChainedEvent, computed: str, *, misplaced: bool) -> None:
    walk.prev = computed
    walk.last = event
    walk.last_misplaced = misplaced
    _ran(walk, event.seq)
    if walk.wanted is not None and computed in walk.wanted:
        walk.seen.setdefault(computed, event.seq)
    walk.report.last_seq = event.seq
    walk.report.head = computed
    for head in walk.heads.pop(event.seq, []):
        walk.report.heads_checked += 1
        if not computed.startswith(head.prefix):
            # As many hex as the head holds: cut to 12, a head that differs after them read as the same twice.
            shown = max(12, len(head.prefix))
            walk.problem(
                event.seq,
                CHANGED,
                f"it hashes to {computed[:shown]}…, but the head seen {head.source} says {head.prefix}",
            )


def _ran(walk: _Walk, seq: int) -> None:
    runs = walk.runs
    if seq <= walk.covered_to:
        return  # covered already: no span asked about again reaches it
    if runs and runs[-1][1] + 1 == seq:
        runs[-1][1] = seq
    elif not runs or runs[-1][1] < seq:
        runs.append([seq, seq])
    else:  # out of order (a caller's own list): kept exact all the same
        at = bisect_right(runs, [seq, seq])
        if not (at and runs[at - 1][0] <= seq <= runs[at - 1][1]):
            runs.insert(at, [seq, seq])


def _checkpoint(walk: _Walk, checkpoint: Checkpoint) -> None:
    walk.report.checkpoints += 1
    where = f"checkpoint #{checkpoint.seq} ({checkpoint.kind})"
    problem = walk.keys.problem(checkpoint)
    if problem is not None:
        walk.report.signatures_failed += 1
        walk.problem(checkpoint.first_seq, BAD_SIGNATURE, f"{where}: {problem}")
    last = walk.last
    if last is None or checkpoint.seq > last.seq:
        end = "the log is empty" if last is None else f"the log ends at seq {last.seq}"
        walk.problem(1 if last is None else last.seq + 1, TRUNCATED, f"{where} signs seq {checkpoint.seq}, but {end}")
        if last is not None:
            # Its events before the cut were signed (by this checkpoint, whose head went with the cut): what is
            # wrong with them is the cut, not that nobody signed them.
            _covered(walk, checkpoint, last.seq)
        return
    computed = walk.link_at(checkpoint.seq)
    if computed is None:
        first = walk.report.first_seq
        if first is not None and checkpoint.seq >= first:
            walk.problem(checkpoint.seq, MISSING, f"{where} signs seq {checkpoint.seq}, which is not in the log")
        elif first is not None:
            # An export holds only checkpoints from its first event on: one before it lost its events.
            walk.problem(
                checkpoint.seq, MISSING, f"{where} signs seq {checkpoint.seq}, but the events here start at seq {first}"
            )
        # Its events before the gap were signed (by this checkpoint, whose head went with the event): what is wrong
        # with them is that gap. Named "unsigned", the intact event before it read as the first forged one.
        _covered(walk, checkpoint)
        return
    if problem is None:
        walk.last_signed = (checkpoint.seq, checkpoint.head)
        if computed == checkpoint.head:
            _vouches(walk, checkpoint)
    if computed != checkpoint.head:
        if checkpoint.kind == HISTORY:
            detail = (
                f"the events chained once at the upgrade (seq {checkpoint.first_seq}..{checkpoint.seq}) no longer hash "
                f"to the head signed then ({checkpoint.head[:12]}…): one of them was changed, removed or moved"
            )
        else:
            detail = (
                f"the events it covers (seq {checkpoint.first_seq}..{checkpoint.seq}) hash to {computed[:12]}…, "
                f"not to the head it signed ({checkpoint.head[:12]}…)"
            )
        # Said at the end, unless an event in its range is found wrong by then (that says better what changed).
        walk.mismatches.append((checkpoint, Problem(checkpoint.first_seq, CHANGED, detail)))
    _covered(walk, checkpoint)


def _vouches(walk: _Walk, checkpoint: Checkpoint) -> None:
    """``checkpoint`` holds (its signature and its head): the orphans whose seq and the one before it it covers
    were chained, in the log it signed, after the hash they follow. The first such checkpoint is the one named."""
    orphans = walk.open_orphans
    low = bisect_left(orphans, (checkpoint.first_seq + 1, ""))
    high = low
    while high < len(orphans) and orphans[high][0] <= checkpoint.seq:
        walk.signed_over.setdefault(orphans[high][1], checkpoint.seq)
        high += 1
    del orphans[low:high]


def _covered(walk: _Walk, checkpoint: Checkpoint, to: int | None = None) -> None:
    """``checkpoint``'s range (to ``to`` when the log ends before it) counted as signed; a span before it that no
    checkpoint covers is named."""
    if checkpoint.first_seq > walk.covered_to + 1:
        _uncovered(walk, walk.covered_to + 1, checkpoint.first_seq - 1)
    walk.covered_to = max(walk.covered_to, checkpoint.seq if to is None else to)
    while walk.runs and walk.runs[0][1] <= walk.covered_to:
        del walk.runs[0]
    if walk.runs and walk.runs[0][0] <= walk.covered_to:
        walk.runs[0][0] = walk.covered_to + 1


def _uncovered(walk: _Walk, first: int, last: int) -> None:
    # Every seq asked about is past covered_to: one Kazma's seals vouch for is waiting, not unsigned.
    count = 0
    low: int | None = None
    high: int | None = None
    waiting = 0
    for start, end in walk.runs:
        start, end = max(start, first), min(end, last)
        if start > end:
            continue
        inside = [seq for seq in walk.pending if start <= seq <= end] if walk.pending else []
        waiting += len(inside)
        count += end - start + 1 - len(inside)
        if len(inside) < end - start + 1:
            held = set(inside)
            if low is None:
                low = next(seq for seq in _upwards(start, end) if seq not in held)
            high = next(seq for seq in _downwards(end, start) if seq not in held)
    walk.report.pending += waiting
    if count and low is not None and high is not None:
        span = "" if count == 1 else f" (to seq {high}: {count} events)"
        walk.problem(
            low,
            UNSIGNED,
            f"no signed checkpoint covers it{span}: written outside Kazma, or its checkpoint was removed",
        )


def _upwards(start: int, end: int) -> Iterator[int]:
    seq = start
    while seq <= end:
        yield seq
        seq += 1


def _downwards(end: int, start: int) -> Iterator[int]:
    seq = end
    while seq >= start:
        yield seq
        seq -= 1


def _changed_and_rehashed(walk: _Walk) -> None:
    """An event "missing" before seq s, where the signed chain had, at s - 1, the event s follows: a checkpoint
    that still holds covers s - 1 and s, or one signed exactly that hash at s - 1 (both noted as they are walked).
    The row at s - 1 hashes to something else, though to its own chain hash (changed and hashed again, the
    algorithm being public): it is the first bad one, not s."""
    problems = walk.report.problems
    for prev_hash, (index, before) in walk.orphans.items():
        seq = problems[index].seq
        if before is None or before == prev_hash:
            continue
        signed = walk.signed_over.get(prev_hash)
        if signed is not None:
            problems[index] = Problem(
                seq - 1,
                CHANGED,
                f"it hashes to {before[:12]}…, but seq {seq} follows {prev_hash[:12]}… in the chain checkpoint "
                f"#{signed} signed: it was changed (and its chain hash written again)",
            )


def _ends(walk: _Walk) -> None:
    _changed_and_rehashed(walk)
    found = list(walk.report.problems)
    for checkpoint, problem in walk.mismatches:
        if not any(checkpoint.first_seq <= p.seq <= checkpoint.seq for p in found):
            walk.report.problems.append(problem)
    last = walk.last
    if last is None:
        walk.report.from_start = walk.since is None or walk.since == 1
        if walk.since == 1:
            # A file expected to hold the whole log: an empty log has nothing signed, so an export cut down to its
            # header (or nothing but checkpoints' absence) would read "ok, empty" with nothing to vouch for it.
            walk.problem(
                1,
                MISSING,
                "this file holds no event: it proves nothing about the log (an empty log has nothing signed, and an "
                "export cut down to its header reads the same): verify the store itself",
            )
        for seq in sorted(walk.heads):
            walk.problem(1, TRUNCATED, f"the log is empty, but a head seen elsewhere names seq {seq}")
        return
    if last.seq > walk.covered_to:
        _uncovered(walk, walk.covered_to + 1, last.seq)
    first = walk.report.first_seq or 1
    for seq, heads in sorted(walk.heads.items()):
        if seq > last.seq:
            walk.problem(
                last.seq + 1,
                TRUNCATED,
                f"the log ends at seq {last.seq}, but the head seen {heads[0].source} names seq {seq}",
            )
        elif walk.anchored or seq >= first:
            walk.problem(
                seq, MISSING, f"seq {seq} is named by the head seen {heads[0].source}, but it is not in the log"
            )
        else:
            # Not skipped: a head this log cannot show proves nothing, and silence would read as "it extends it".
            walk.problem(
                seq,
                MISSING,
                f"seq {seq} is named by the head seen {heads[0].source}, but this log starts at seq {first}: it "
                "cannot show that it extends that head (verify the store, or an export from before it)",
            )


def heads_of(checkpoints: Iterable[Checkpoint], *, source: str) -> Iterator[Head]:
    """Every checkpoint of an earlier export as a head seen elsewhere (the current log must extend them)."""
    for checkpoint in checkpoints:
        yield Head(checkpoint.seq, checkpoint.head, source)
