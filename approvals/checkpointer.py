"""Signing the audit chain's head: within a fiftieth of a second of every decision, and at least every minute.

Each process that appends runs one :class:`Checkpointer`. A commit that appended
audit events wakes it; it waits out :data:`MIN_INTERVAL` since its last signature
(a burst of decisions shares one), then, in one transaction holding the chain's
order (see :mod:`kazma.approvals.chain`), reads every event after the last
checkpoint, checks that each one is chained right and that a valid commit seal
vouches for the transaction that appended it, and signs one checkpoint over each
unbroken run of such events. An event no seal vouches for (a row written around
Kazma) is never signed: it is logged and counted (``audit_unvouched_events``),
and a verifier names it. When every event since the last checkpoint is one this
process appended itself, in transactions it saw commit (or in the transaction
the pass runs in: a decision signed in its own commit), ending at the head the
store holds (:meth:`~kazma.approvals.chain.AuditChain.appended_all`), the pass signs the head it
computed then instead of reading them back: what it signs is what Kazma wrote,
so a row changed since no longer matches the signature, and every verifier
names it.

Several replicas each run one; they take turns on the chain's lock, so each signs
what the others have not. A pass that finds another process's checkpoint younger
than :data:`MIN_INTERVAL` signs nothing and goes again when it is that old (unless
a card waits for its witness): the whole chain, not each replica, gets about one
signature per interval. A settled card waits (briefly) for the checkpoint that
holds its decision: :meth:`Checkpointer.witness`.

A decision a press wins on SQLite is signed in its own commit when no pass was made
within :data:`MIN_INTERVAL` (the same budget as the passes: a burst still shares
one signature): the pass runs at the end of the decision's transaction, after its
events are chained, so its cards have their witness as the decision commits, with
no commit, read or wait of their own. Its loses nothing: a transaction that rolls
back takes the checkpoint with it, and the next pass signs what is there.

A pass woken by appends *rides* (:mod:`kazma.config.store.group_commit`): it joins
the next group of writes the store commits anyway, after theirs, and commits alone
only when none comes within :data:`RIDE`. While decisions arrive a
checkpoint therefore costs no commit (no fsync) of its own, and never holds a
decision up behind it. Someone waiting for a checkpoint (a settled card's witness)
sends the pass at once.

On PostgreSQL a pass that read the head under the chain's lock waited for that
answer, so its group (and the press it rode with) could not go as one string of
statements. While this process's chain guesses hold, a pass instead signs the
head its chain last committed, after the checkpoint it last wrote, asking
nothing; the statement fails as a stale guess when another replica appended or
signed meanwhile, and the group runs again with the pass reading the head.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import structlog

from kazma.approvals import pg_press
from kazma.approvals.chain import (
    CHAIN_LOCK,
    EVENT_COLUMNS,
    GENESIS,
    LAST_CHECKPOINT,
    ChainedEvent,
    byte_safe,
    from_byte_safe,
    undecodable,
    write_checkpoint,
)
from kazma.approvals.checkpoints import HEAD, AuditSigner, Checkpoint
from kazma.config.backoff import Backoff
from kazma.config.metrics import audit_checkpoint_seen, count_failure
from kazma.config.store.backend import Tx
from kazma.config.store.group_commit import Unasking
from kazma.config.waits import until_set

if TYPE_CHECKING:
    from kazma.approvals.store import ApprovalStore

log = structlog.get_logger("kazma.approvals.checkpointer")

# Seconds between two signatures of one process: the decisions of that time share one. A pass costs an Ed25519
# signature and, on PostgreSQL, a round trip holding the chain's lock. 100 ms made passes a fifth as many, but every
# card's edit waits for the checkpoint holding its decision: press -> all cards settled went from 15.0/25.6 ms to
# 17.5/88.8 ms (p50/p95, bench/settle_latency.py), so it stays at 20 ms.
MIN_INTERVAL: Final = 0.02
# The pause between passes (``min_interval``) is cut short to this for a card waiting to settle with its witness
# (the checkpoint holding its decision): the edit of every card waits for that signature. At 20 ms a card pressed
# right after it showed (kazma demo; the benches), within 20 ms of the pass that signed its post, waited out that
# pause: it settled 17-25 ms after the press, after the agent its decision woke had run the tool (bare, 13-24 ms)
# and reported. 2 ms keeps witnesses asked for in a burst to one signature per 2 ms (a pass costs an Ed25519
# signature, ~35 us, and a commit) while a card waits at most that. Decisions nobody waits for keep to min_interval.
WITNESS_INTERVAL: Final = 0.002
RIDE: Final = 0.02  # how long a pass waits for other writes to commit with before it commits alone
EVERY: Final = 60.0  # at least this often while events arrive (events of other processes included)
WITNESS_WAIT: Final = 5.0  # the longest a settled card waits for the checkpoint of its decision
RETRY: Final = Backoff(base=0.5, cap=30.0)

WITNESSES_KEPT: Final = 1000  # decisions signed in their own commit whose witness nobody asked for yet, at most

_SINCE_FROM = "FROM approval_events WHERE seq > ? ORDER BY seq"
_LAST_CHECKPOINT_UPTO = "SELECT seq, head, at FROM audit_checkpoints WHERE seq <= ? ORDER BY seq DESC LIMIT 1"
_SINCE = f"SELECT {EVENT_COLUMNS}, commit_seal {_SINCE_FROM}"
_SINCE_BYTE_SAFE = f"SELECT {byte_safe(f'{EVENT_COLUMNS}, commit_seal')} {_SINCE_FROM}"
_DECISION_SEQS = (
    "SELECT request_id, MIN(seq) FROM approval_events WHERE request_id IN ({}) AND event IN ('decided', 'timeout',"
    " 'cancelled') GROUP BY request_id"
)


@dataclass
class Judged:
    """One pass over the events after the last checkpoint."""

    signed: list[Checkpoint] = field(default_factory=list)
    newest: tuple[int, float] | None = None  # (seq, at) of the newest checkpoint after this pass
    unvouched: list[int] = field(default_factory=list)  # rows no commit seal vouches for
    # Key ids that seals of unvouched rows name and this process does not hold: another replica's newer
    # KAZMA_AUDIT_KEY (a rotation not done everywhere yet), or forged.
    unknown_keys: set[str] = field(default_factory=set)
    missing_after: int | None = None  # a checkpoint signs past the last event: the log was cut here
    # Seconds until the newest checkpoint, another process's, is min_interval old: this pass signed nothing and the
    # next goes then (see Checkpointer._judge). 0.0: it did not wait.
    wait: float = 0.0


class Checkpointer:
    """Signs what this store's transactions (and everyone else's) appended to the audit chain."""

    def __init__(
        self,
        store: ApprovalStore,
        signer: AuditSigner,
        *,
        min_interval: float = MIN_INTERVAL,
        every: float = EVERY,
        ride: float = RIDE,
        clock: Callable[[], float] = time.time,
        in_decisions: bool = True,
    ) -> None:
        self.store = store
        self.signer = signer
        self.min_interval = min_interval
        self.every = every
        self.ride = ride
        self.clock = clock
        # While it runs, a decision a press wins on SQLite is signed in its own commit when no pass is due sooner
        # (False: only by passes, as on PostgreSQL).
        self.in_decisions = in_decisions
        self._due = asyncio.Event()
        self._signed = asyncio.Event()  # replaced after every pass: whoever waits on the old one wakes
        # Monotonic; -inf: no pass yet (0.0 is not "long ago": the clock starts at boot, younger than min_interval)
        self._last_pass = -math.inf
        self._running = False  # run() is signing: a witness waits for it, else signs itself
        self._reported: set[int] = set()  # unvouched rows already logged by this process
        self._wanted = False  # a witness waits: the next pass goes at once instead of riding
        self._hurry = asyncio.Event()  # set with _wanted: the pause between passes shortens to WITNESS_INTERVAL
        self._riding = False  # a pass waits to ride with other writes
        # Decisions signed in their own commit: the checkpoint holding each, until its cards ask (witness()).
        self._witnessed: OrderedDict[str, Checkpoint] = OrderedDict()
        self._signed_through = 0  # the last seq a checkpoint made in a decision's commit covers
        self._in_commits: list[Judged] = []  # those passes, committed, not yet told on the loop (wake)
        # The newest checkpoint this process wrote, (seq, at): a pass yields to a fresh one only if it is not this.
        self._own_newest: tuple[int, float] | None = None
        # The newest checkpoint this process wrote and saw commit: on PostgreSQL the next pass signs after it on a
        # guess (see _judge_on_guess).
        self._own_last: Checkpoint | None = None
        store.appended_listeners.append(self.wake)
        store.decided_in_commit = self._sign_in_commit
        store.sign_in_commit_due = self._due_in_commit

    def wake(self) -> None:
        """Something was appended: sign soon (unless the decision's own commit signed all of it)."""
        while self._in_commits:  # passes made in a decision's commit, told here on the loop
            self._passed(self._in_commits.pop(0))
        if not self._signed_all_appended():
            self._due.set()

    async def run(self) -> None:
        """Sign whenever woken (at most every :attr:`min_interval`) and at least every :attr:`every` seconds."""
        self._running = True
        try:
            await self._run()
        finally:
            self._running = False

    async def _run(self) -> None:
        failures = 0
        while True:
            # until_set keeps a cancel that arrives as the event is set (the last write of a stopping Kazma wakes
            # this loop); asyncio.wait_for dropped it on Python 3.11, and stop waited for good.
            await until_set(self._due, self.every)
            self._due.clear()
            paused_from = self._last_pass
            # The pause runs from the last pass, which a decision's own commit may make while this waits (SQLite):
            # measured again after each wait, or a second signature followed that one within WITNESS_INTERVAL.
            while not self._wanted and (gap := self._last_pass + self.min_interval - time.monotonic()) > 0:
                self._hurry.clear()
                await until_set(self._hurry, gap)  # a witness asking cuts the pause short
            if self._last_pass != paused_from and not self._wanted and self._signed_all_appended():
                continue  # that commit's pass signed everything appended meanwhile
            gap = self._last_pass + min(self.min_interval, WITNESS_INTERVAL) - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)
            patient = not self._wanted  # nobody waits for a witness: the pass may yield to another process's
            ride, self._wanted = (0.0 if self._wanted else self.ride), False
            try:
                judged = await self.sign(ride=ride, yield_to_fresh=patient)
                failures = 0
                if judged.wait > 0:
                    # The next pass goes when that checkpoint is min_interval old (or at once for a witness).
                    self._last_pass = time.monotonic() - self.min_interval + judged.wait
                    self._due.set()
            except Exception as exc:
                count_failure("audit_checkpoint")
                log.warning("audit.checkpoint_failed", attempt=failures + 1, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(RETRY.delay(failures))
                failures += 1
                self._due.set()

    def _signed_all_appended(self) -> bool:
        """Whether a pass in a decision's commit signed everything this process has appended (see wake())."""
        last = self.store.chain.last_committed_seq
        return last is not None and last <= self._signed_through

    async def sign(self, *, ride: float = 0.0, yield_to_fresh: bool = False) -> Judged:
        """One pass now (``ride`` > 0: with the next writes, or within that many seconds): sign every vouched event
        after the last checkpoint. ``yield_to_fresh``: sign nothing when another process signed the chain within
        :attr:`min_interval` (``Judged.wait`` says how long until it is that old)."""
        self._last_pass = time.monotonic()
        self._riding = ride > 0
        try:
            judge: Callable[[Tx], Judged] = (
                functools.partial(self._judge, yield_to_fresh=True) if yield_to_fresh else self._judge
            )
            if self.store.chain.postgres and self._own_last is not None:
                # It may sign on a guess, asking nothing (_judge_on_guess): its group may go as one string.
                judge = Unasking(judge)
            judged: Judged = await self.store.write(judge, ride=ride)
        finally:
            self._riding = False
        self._passed(judged)
        return judged

    def _passed(self, judged: Judged) -> None:
        """A pass committed: its metric, what it found wrong, and every witness waiting for it woken."""
        if judged.newest is not None:
            audit_checkpoint_seen(*judged.newest)
        if judged.signed and judged.newest is not None:
            self._own_newest = judged.newest
            self._own_last = judged.signed[-1]
        fresh = [seq for seq in judged.unvouched if seq not in self._reported]
        if fresh:
            self._reported.update(fresh)
            count_failure("audit_unvouched_events")
            log.error(
                "audit.unvouched_events",
                seqs=fresh[:20],
                count=len(fresh),
                detail="events no commit seal of Kazma's vouches for (written around Kazma): never signed",
            )
            if judged.unknown_keys:
                # Said apart: "written around Kazma" sent an operator hunting an intruder when a replica had been
                # restarted with a rotated KAZMA_AUDIT_KEY the others did not hold yet.
                log.error(
                    "audit.seal_key_unknown",
                    keys=sorted(judged.unknown_keys)[:20],
                    held=list(self.signer.keyring.ids),
                    detail="commit seals name audit keys this process does not hold: a replica with a newer "
                    "KAZMA_AUDIT_KEY (add a new key after the current one on every replica first, see README), or "
                    "forged; their events are never signed",
                )
        if judged.missing_after is not None and -judged.missing_after not in self._reported:
            self._reported.add(-judged.missing_after)
            count_failure("audit_events_missing")
            log.error("audit.events_missing", last=judged.missing_after, detail="a checkpoint signs past the log's end")
        signed, self._signed = self._signed, asyncio.Event()
        signed.set()

    def _due_in_commit(self, now: float | None = None) -> bool:
        """Whether a decision's own commit would sign now (asked as a press wins, and again at its commit: most
        would not, and they then hand nothing to the end of their transaction). Not when this store does not sign
        on its own (a store opened by a tool), a pass is on its way (riding with this group or the next), or one
        was made within :attr:`min_interval`: the decision is then the next pass's."""
        return (
            self.in_decisions
            and self._running
            and not self._riding
            and (time.monotonic() if now is None else now) - self._last_pass >= self.min_interval
        )

    def _sign_in_commit(self, tx: Tx, request_ids: list[str]) -> None:
        """At the end of the transaction of decisions ``request_ids`` (their events chained): a pass in it, unless
        one was made within :attr:`min_interval` (then the next pass, woken by this commit, signs them)."""
        now = time.monotonic()
        if not self._due_in_commit(now):
            return
        self._last_pass = now
        # In a savepoint: a pass that fails here costs the decision nothing (the loop's next pass signs it).
        tx.run("SAVEPOINT checkpoint_in_decision")
        try:
            judged = self._judge(tx)
            held = self._held(tx, judged, request_ids)
        except Exception as exc:
            tx.run("ROLLBACK TO checkpoint_in_decision")
            tx.run("RELEASE checkpoint_in_decision")
            count_failure("audit_checkpoint")
            log.warning("audit.checkpoint_failed", attempt=1, error=f"{type(exc).__name__}: {exc}", where="decision")
            return
        tx.run("RELEASE checkpoint_in_decision")
        if not judged.signed:
            return
        tx.after_commit(lambda: self._committed_in_decision(judged, held))

    def _held(self, tx: Tx, judged: Judged, request_ids: list[str]) -> dict[str, Checkpoint]:
        """The checkpoint of this pass holding each decision of ``request_ids`` (their events appended in ``tx``)."""
        if not judged.signed:
            return {}
        span, last = self.store.chain.appended_in(tx), judged.signed[-1]
        if span is not None and last.first_seq <= span[0] and span[1] <= last.seq:
            # Every event this transaction appended, these decisions' among them, is in that checkpoint: nothing to
            # read (a statement in every decision's commit that signs, ~30 us of a lone press's ~1.7 ms).
            return dict.fromkeys(request_ids, last)
        # This transaction's events not all in that checkpoint (a commit seal the pass could not verify, say):
        # where each decision's event is, and only the checkpoints that hold one.
        marks = ", ".join("?" * len(request_ids))
        seqs = {str(r[0]): int(r[1]) for r in tx.all(_DECISION_SEQS.format(marks), request_ids)}
        return {
            request_id: checkpoint
            for request_id, seq in seqs.items()
            for checkpoint in judged.signed
            if checkpoint.first_seq <= seq <= checkpoint.seq
        }

    def _committed_in_decision(self, judged: Judged, held: dict[str, Checkpoint]) -> None:
        # In the writer (maybe its thread): plain data only. The loop hears of it in wake(), which the commit
        # calls (it appended events) before anyone is answered.
        self._signed_through = max(self._signed_through, judged.signed[-1].seq)
        if judged.newest is not None:  # before any later pass can read it (wake() tells the loop after the commit)
            self._own_newest = judged.newest
        self._witnessed.update(held)
        while len(self._witnessed) > WITNESSES_KEPT:
            self._witnessed.popitem(last=False)
        self._in_commits.append(judged)

    async def witness(self, request_id: str, *, patience: float = WITNESS_WAIT) -> Checkpoint | None:
        """The checkpoint holding ``request_id``'s decision, waiting up to ``patience`` seconds for it to be signed."""
        signed_with_it = self._witnessed.pop(request_id, None)
        if signed_with_it is not None:  # signed in the decision's own commit: nothing to read or wait for
            return signed_with_it
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while True:
            found = await self.store.witness(request_id)
            remaining = deadline - loop.time()
            if found is not None or remaining <= 0:
                return found
            if not self._running:
                # Nobody signs on their own (a stopping Kazma stopped run(), or it never started): a card settled
                # now must not wait out the patience for a signature that is not coming. Signed here, once.
                await self.sign()
                return await self.store.witness(request_id)
            signed = self._signed
            if self._riding:
                # A pass waits to ride: it covers this decision (committed before the witness was asked for), so
                # it goes now, and that is all. Waking the loop too made a second, empty pass right behind it.
                await self.store.release_riders()
            else:
                self._wanted = True
                self._hurry.set()
                self.wake()
            await until_set(signed, remaining)

    # -- in the transaction --------------------------------------------------------------------------

    def _judge(self, tx: Tx, *, yield_to_fresh: bool = False) -> Judged:
        guessed = self._judge_on_guess(tx)
        if guessed is not None:
            return guessed
        # The chain's order first (nobody appends while this reads), and the one-time chaining if still due.
        chain = self.store.chain
        head, head_seq, last = chain.ensure_history(tx)
        after, prev = (0, GENESIS) if last is None else (last[0], last[1])
        judged = Judged(newest=None if last is None else (after, last[2]))
        if yield_to_fresh and last is not None and head_seq > after and (last[0], last[2]) != self._own_newest:
            # Another process (a replica) signed the chain less than min_interval ago. Each process keeps to
            # min_interval between its own passes, so N replicas signed N times as often as one: on PostgreSQL
            # with 3 replicas deciding one at a time, a pass (and an Ed25519 signature) for 3 decisions in 4.
            # Yielding keeps the whole chain to about one signature per min_interval; what this process appended
            # is signed by the next pass of any of them, at the latest when that checkpoint is min_interval old.
            # A clock behind or ahead of the other's by more than that makes the age fall outside: no wait.
            age = self.clock() - last[2]
            if 0 <= age < self.min_interval:
                judged.wait = self.min_interval - age
                return judged
        if head_seq > after and chain.appended_all(after, prev, head_seq, head, tx):
            # Every event since the last checkpoint is this process's own, appended in transactions that committed:
            # the head it computed from them is what it signs (reading them back would hash and check its own
            # work again). A row changed since is caught by every verifier against this very signature.
            now = self.clock()
            judged.signed.append(write_checkpoint(tx, self.signer, HEAD, after + 1, head_seq, head, now))
            judged.newest = (head_seq, now)
            chain.forget_through(head_seq)
            return judged
        try:
            rows = tx.all(_SINCE, (after,))
        except Exception as exc:  # a text not UTF-8 (SQLite): every pass failed at it, and nothing was signed again
            if not undecodable(exc):
                raise
            rows = [from_byte_safe(row) for row in tx.all(_SINCE_BYTE_SAFE, (after,))]
        if not rows:
            top = tx.one("SELECT MAX(seq) FROM approval_events")
            if last is not None and (top is None or top[0] is None or int(top[0]) < after):
                judged.missing_after = 0 if top is None or top[0] is None else int(top[0])
            return judged
        runs = _vouched_runs(self.signer, rows, prev, judged)
        now = self.clock()
        for first, seq, head in runs:
            judged.signed.append(write_checkpoint(tx, self.signer, HEAD, first, seq, head, now))
        if judged.signed:
            judged.newest = (judged.signed[-1].seq, now)
            chain.forget_through(judged.signed[-1].seq)
        return judged

    def _judge_on_guess(self, tx: Tx) -> Judged | None:
        """On PostgreSQL, while this process's chain guesses hold: a pass that signs, asking nothing, the head this
        chain last committed, after the last checkpoint this process wrote, when every event between is this
        chain's own (:meth:`~kazma.approvals.chain.AuditChain.appended_all`); its statement fails the transaction
        as a stale guess when the head or the newest checkpoint moved meanwhile (another replica), and the group
        runs again with the pass asking (:meth:`_judge`). None: no guess to make.

        The pass that asks reads the head under the chain's lock, one answered round trip: its group could not go
        as one string, and went by the writer thread in pipeline mode, the press it rode with too. That path cost
        the client about 0.8 ms per pass (~40-70 us per decision on PostgreSQL with one writer; the writer
        thread's own CPU, from /proc/self/task/<tid>/schedstat)."""
        guess = pg_press.guessing(tx)
        chain = self.store.chain
        own, head = self._own_last, chain.last_committed_head
        if guess is None or not chain.postgres or own is None or head is None or not chain.guesses_hold:
            return None
        head_seq, head_hash = head
        if head_seq <= own.seq or not chain.appended_all(own.seq, own.head, head_seq, head_hash):
            return None
        now = self.clock()
        made = self.signer.sign(HEAD, own.seq + 1, head_seq, head_hash, now)
        row = (made.kind, made.first_seq, made.seq, made.head, made.at, made.key_id, made.signature)
        pg_press.checkpoint_or_fail(guess, CHAIN_LOCK, head, own.seq, row)
        # Only once it committed: a group run again asks, and finds the runs it may sign without reading back.
        tx.after_commit(functools.partial(chain.forget_through, head_seq))
        return Judged(signed=[made], newest=(head_seq, now))


def _vouched_runs(signer: AuditSigner, rows: list[Any], prev: str, judged: Judged) -> list[tuple[int, int, str]]:
    """Unbroken runs (first, last, head) of events that are chained right and vouched for by a commit seal;
    every other event goes to ``judged.unvouched``."""
    runs: list[tuple[int, int, str]] = []
    pending: list[tuple[ChainedEvent, bool]] = []  # (event, chained right) since the last commit seal
    for row in rows:
        event = ChainedEvent.of_row(row[:-1])
        seal = row[-1]
        computed = _hash_or_none(event, prev)
        right = event.chain_hash is not None and event.prev_hash == prev and computed == event.chain_hash
        prev = event.chain_hash if event.chain_hash is not None else (computed or "")
        pending.append((event, right))
        if seal is None:
            continue
        first = signer.sealed_from(seal, event.seq, event.chain_hash or "")
        vouched = [e for e, ok in pending if first is not None and e.seq >= first and ok]
        if first is None or len(vouched) != event.seq - first + 1:
            vouched = []
        if first is None and (unknown := signer.unknown_key(seal)) is not None:
            judged.unknown_keys.add(unknown)
        judged.unvouched += [e.seq for e, _ in pending if not vouched or e.seq < vouched[0].seq]
        if vouched:
            if runs and runs[-1][1] == vouched[0].seq - 1:
                runs[-1] = (runs[-1][0], event.seq, prev)
            else:
                runs.append((vouched[0].seq, event.seq, prev))
        pending = []
    judged.unvouched += [e.seq for e, _ in pending]  # no seal after them: no transaction of Kazma's wrote them
    return runs


def _hash_or_none(event: ChainedEvent, prev: str) -> str | None:
    """``event``'s chain hash after ``prev``; None when it holds what Kazma never writes (bytes where a text was,
    changed around Kazma): never vouched for. Raising stopped every pass (nothing was signed again) and every
    verify or doctor reading the unsigned tail, at a row none of them named."""
    try:
        return event.hash_after(prev)
    except (TypeError, ValueError):
        return None


async def vouched_tail(store: ApprovalStore, signer: AuditSigner, *, upto: int | None = None) -> set[int]:
    """The events after the last checkpoint that Kazma's commit seals vouch for: appended by Kazma and about to be
    signed (read only; a verifier on Kazma's own machine, with its audit key, tells them from forged rows).

    ``upto``: the last event a verifier read; the tail then starts at the last checkpoint at or before it. A
    running Kazma may append and sign past it between the verifier's reads: a tail read from that checkpoint on
    left the events the verifier read after the one before vouched for by nobody, and verify named Kazma's own
    events "unsigned: written outside Kazma"."""
    if upto is None:
        last = await store.tables.one(LAST_CHECKPOINT)
    else:
        last = await store.tables.one(_LAST_CHECKPOINT_UPTO, (upto,))
    after, prev = (0, GENESIS) if last is None else (int(last[0]), str(last[1]))
    rows = await store.audit_rows(f"{EVENT_COLUMNS}, commit_seal", _SINCE_FROM, (after,))
    runs = _vouched_runs(signer, rows, prev, Judged())
    return {seq for first, end, _ in runs for seq in range(first, end + 1)}
