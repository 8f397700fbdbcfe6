"""``kazma doctor``'s checks of the audit chain: its key is there and private, and the tail of the log verifies.

The tail is the last :data:`TAIL` events with the checkpoints over them, verified
the way ``kazma audit verify`` verifies the whole log (every link, every
signature with the public keys of the audit key here), and every request row of
the store against the log (a finished request whose ending event is not in it
shows a log cut at a checkpoint: one anti-join). ``kazma audit verify``
is the full check; this one is quick enough to run at every doctor.
"""

from __future__ import annotations

import time

from kazma.approvals.audit_verify import UnrecordedRequest, verify
from kazma.approvals.checkpointer import vouched_tail
from kazma.approvals.checkpoints import HISTORY, AuditSigner
from kazma.approvals.store import ApprovalStore
from kazma.bot.cli.checks import Check, Level
from kazma.bot.cli.key_checks import key_file_problem, replicas_need_it
from kazma.bot.keys import audit_key_file, decision_keys_folder
from kazma.bot.store import store_for_command
from kazma.config import LoadedConfig
from kazma.config.keyring import AUDIT_KEYS, KeyMissing, KeyringError, read_keyring

KEY_CHECK = "audit key"
CHAIN_CHECK = "audit chain"
TAIL = 1000  # events verified from the end of the log
UNRECORDED = 20  # requests named whose row the log does not record


def check_audit_key(loaded: LoadedConfig) -> Check:
    """Present and readable, private, outside the store's folder and the workspaces; which key signs."""
    config = loaded.config
    try:
        ring = read_keyring(AUDIT_KEYS, decision_keys_folder(config))
    except KeyMissing as exc:
        if config.store.backend == "postgresql":
            return Check(KEY_CHECK, Level.FAIL, replicas_need_it(exc, AUDIT_KEYS.env))
        return Check(KEY_CHECK, Level.OK, f"none yet: kazma run makes {audit_key_file(config)} at its first start")
    except KeyringError as exc:
        return Check(KEY_CHECK, Level.FAIL, f"unusable: {exc}; no checkpoint can be signed")
    problem = key_file_problem(ring, config, power="can sign checkpoints")
    if problem is not None:
        return Check(KEY_CHECK, Level.FAIL, problem)
    return Check(KEY_CHECK, Level.OK, ring.describe())


async def check_audit_chain(loaded: LoadedConfig) -> Check:
    """The last :data:`TAIL` events and the checkpoints over them verify with the public keys held here."""
    try:
        signer = AuditSigner(read_keyring(AUDIT_KEYS, decision_keys_folder(loaded.config)))
    except KeyringError:
        signer = None
    try:
        async with store_for_command(loaded.config, read_only=True) as opened:
            store = ApprovalStore(opened)
            last = await store.last_event_seq()
            if last == 0:
                # An empty log beside request rows is the whole log cut (with every checkpoint): nothing to walk.
                unrecorded, more = await store.unrecorded_requests(limit=UNRECORDED)
                if not unrecorded:
                    return Check(CHAIN_CHECK, Level.OK, "no audit events yet")
                return Check(CHAIN_CHECK, Level.FAIL, _unrecorded_text(unrecorded, more))
            if signer is None:
                return Check(CHAIN_CHECK, Level.FAIL, f"{last} audit events, but no audit key here to verify them with")
            after = max(0, last - TAIL)
            first = await store.chain_checkpoints(0, limit=1)
            if first and first[0].kind == HISTORY and after < first[0].seq:
                after = 0  # events from before the chain are only checked from their first one
            events = await store.chain_events(after, limit=last - after)
            read_to = events[-1].seq
            checkpoints = await store.chain_checkpoints(after, limit=10 * TAIL)
            newest = await store.last_checkpoint()
            now_last = await store.last_event_seq()  # read after the checkpoints: anything a checkpoint signs is in
            # A checkpoint made after the events were read (Kazma runs) signs what this read did not see: not a cut.
            # One past the log's end as it is now is a cut (its last events removed): verify says "truncated".
            checkpoints = [c for c in checkpoints if c.seq <= read_to or c.seq > now_last]
            pending = {s for s in await vouched_tail(store, signer, upto=read_to) if s <= read_to}
            unrecorded, more = await store.unrecorded_requests(limit=UNRECORDED)
    except Exception as exc:
        said = str(exc).strip() or type(exc).__name__
        return Check(CHAIN_CHECK, Level.FAIL, f"cannot read the audit log: {said}")
    report = verify(
        events,
        checkpoints,
        signer.public_keys(),
        anchored=after == 0,
        pending=pending,
        unrecorded=unrecorded,
        unrecorded_more=more,
    )
    if not report.ok:
        # The summary names the first problem only: every request the log lost is named, so each can be looked at.
        named = f"; {_unrecorded_text(unrecorded, more)}" if unrecorded else ""
        return Check(CHAIN_CHECK, Level.FAIL, f"the last {len(events)} events: {report.summary()}{named}")
    age = "" if newest is None else f"; newest checkpoint #{newest.seq}, {time.time() - newest.at:.0f} s old"
    return Check(
        CHAIN_CHECK, Level.OK, f"the last {len(events)} events (seq {events[0].seq}..{events[-1].seq}) verify{age}"
    )


def _unrecorded_text(unrecorded: list[UnrecordedRequest], more: bool) -> str:
    cut = [r for r in unrecorded if r.recorded is None]
    changed = [r for r in unrecorded if r.recorded is not None]
    tail = f" and more (the oldest {len(unrecorded)} named)" if more else ""
    said: list[str] = []
    if cut:
        listed = ", ".join(f"{r.id} ({r.status}, no {r.event()} event)" for r in cut)
        said.append(
            f"requests whose events are not in the audit log (it was cut, with the checkpoints after the cut): {listed}"
        )
    if changed:
        said.append("; ".join(r.changed() for r in changed))
    return "; ".join(said) + tail


async def check_audit(loaded: LoadedConfig, *, store_ok: bool = True) -> list[Check]:
    checks = [check_audit_key(loaded)]
    if store_ok:
        checks.append(await check_audit_chain(loaded))
    return checks
