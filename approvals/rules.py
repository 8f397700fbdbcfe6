"""Remembered approvals: "Approve for 1 h" records a rule that lets the identical call run again without a card.

A rule is bound to one tool, one argument hash and one conversation, and ends
at ``expires_at`` or when revoked. It is made only by a person's press that won
the compare-and-set on a whole, warning-free card (see the service), and every
use of it is audited and said in the conversation. A call differing in one
byte has another hash and gets a card; so does the same call elsewhere.

Each rule row is sealed with the decision key when it is made
(:func:`kazma.approvals.seal.seal_rule`): the service lets only a rule whose
seal verifies stand for a call. Rows made before rules were sealed carry none
and are refused (the call gets a card; they expire within
``approvals.remember.max_seconds`` anyway).
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from kazma.approvals.approval_checks import approval_problem, decided_among
from kazma.approvals.chain import undecodable
from kazma.approvals.model import ApprovalRequest
from kazma.approvals.seal import FORGED, KEY_UNKNOWN, RuleFields, SealProblem, rule_seal_problem, seal_rule
from kazma.approvals.store import UnreadableRequest
from kazma.config.address import Address, AddressError
from kazma.config.keyring import Keyring
from kazma.config.limits import MAX_REMEMBER_SECONDS
from kazma.config.store.backend import StoreConnection, Tx, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

if TYPE_CHECKING:
    from kazma.approvals.store import ApprovalStore, AuditEvent
    from kazma.config.models import KazmaConfig

MIGRATIONS: Final = [
    Migration(
        "approval_rules",
        1,
        (
            """CREATE TABLE IF NOT EXISTS approval_rules (
                id TEXT PRIMARY KEY,
                tool TEXT NOT NULL,
                args_hash TEXT NOT NULL,
                conversation TEXT NOT NULL,
                created_by TEXT NOT NULL,
                created_via TEXT NOT NULL,
                request_id TEXT NOT NULL,
                created_at REAL NOT NULL,
                expires_at REAL NOT NULL,
                revoked_at REAL,
                revoked_by TEXT
            )""",
            "CREATE INDEX IF NOT EXISTS approval_rules_call ON approval_rules (tool, args_hash, conversation)",
        ),
    ),
    Migration(
        "approval_rules",
        2,
        ("ALTER TABLE approval_rules ADD COLUMN seal_key_id TEXT", "ALTER TABLE approval_rules ADD COLUMN seal TEXT"),
    ),
    # The digest of the tool definition its card was opened for, sealed with it (NULL: a tool fixed in Kazma's
    # code, or a rule made before it was recorded, which keeps the older check by time).
    Migration("approval_rules", 3, ("ALTER TABLE approval_rules ADD COLUMN definition_hash TEXT",)),
]
PG_MIGRATIONS: Final = [
    PgMigration(
        "approval_rules",
        1,
        (
            """CREATE TABLE IF NOT EXISTS approval_rules (
                id text PRIMARY KEY,
                tool text NOT NULL,
                args_hash text NOT NULL,
                conversation text NOT NULL,
                created_by text NOT NULL,
                created_via text NOT NULL,
                request_id text NOT NULL,
                created_at double precision NOT NULL,
                expires_at double precision NOT NULL,
                revoked_at double precision,
                revoked_by text
            )""",
            "CREATE INDEX IF NOT EXISTS approval_rules_call ON approval_rules (tool, args_hash, conversation)",
        ),
    ),
    PgMigration(
        "approval_rules",
        2,
        ("ALTER TABLE approval_rules ADD COLUMN seal_key_id text", "ALTER TABLE approval_rules ADD COLUMN seal text"),
    ),
    PgMigration("approval_rules", 3, ("ALTER TABLE approval_rules ADD COLUMN definition_hash text",)),
]
# How long after the press that approved a request its rule may have been made (the rule is written right after the
# decision's commit; generous for a slow store and replicas' clocks) and the most any rule lasts after it.
RULE_MADE_WITHIN: Final = 300.0
LONGEST_RULE: Final = MAX_REMEMBER_SECONDS + RULE_MADE_WITHIN
# The requesters whose calls consult a remembered approval before asking: agents' tool calls (the safety
# policy). Nothing else does (the approvals API and ``/mcp`` always ask; a checkpoint is never the same call).
CONSULTING_REQUESTERS: Final = ("agent:",)


def in_a_chat(conversation: str) -> bool:
    """Whether ``conversation`` is a chat (``<platform>:<chat>``), where a rule's use is said. A swarm worker's
    calls are in no chat ("swarm", shared by every task and every asker): nothing is remembered there."""
    try:
        return bool(Address.parse(conversation).chat)
    except AddressError:
        return False


def rules_consulted_for(requested_by: str, conversation: str) -> bool:
    """Whether a rule made from a request of ``requested_by`` in ``conversation`` would ever let a later call run:
    only then may a card offer "Approve for …"."""
    return requested_by.startswith(CONSULTING_REQUESTERS) and in_a_chat(conversation)


_COLUMNS = (
    "id, tool, args_hash, conversation, created_by, created_via, request_id, created_at, expires_at, revoked_at,"
    " seal_key_id, seal, definition_hash"
)
_INSERT = f"INSERT INTO approval_rules ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
# Only a rule in force is revoked: an expired one ended on its own, and a rule_revoked for it would say otherwise.
_REVOKE = (
    "UPDATE approval_rules SET revoked_at = ?, revoked_by = ? WHERE id = ? AND revoked_at IS NULL AND expires_at > ?"
)


@dataclass(frozen=True)
class Rule:
    id: str
    tool: str
    args_hash: str
    conversation: str
    created_by: str
    created_via: str
    request_id: str
    created_at: float
    expires_at: float
    revoked_at: float | None
    seal_key_id: str | None = None
    seal: str | None = None  # made by :func:`~kazma.approvals.seal.seal_rule`; None: not sealed (refused)
    # The digest of the tool definition its card was opened for (sealed with it); None: a tool fixed in Kazma's
    # code, or a rule made before definitions were recorded (then the time its request opened is compared).
    definition_hash: str | None = None

    def active(self, now: float) -> bool:
        return self.revoked_at is None and now < self.expires_at

    @property
    def bound(self) -> RuleFields:
        """What its seal binds (:data:`~kazma.approvals.seal.RuleFields`)."""
        return (
            self.id, self.tool, self.args_hash, self.conversation, self.created_by, self.created_via, self.request_id,
            self.created_at, self.expires_at,
        )  # fmt: skip

    def seal_problem(self, keyring: Keyring | None) -> SealProblem | None:
        """Why this row is not a rule Kazma made and sealed as it stands, or None when its seal verifies."""
        return rule_seal_problem(keyring, self.seal_key_id, self.seal, self.bound, self.definition_hash)


def _row(rule: Rule) -> tuple[object, ...]:
    """``rule`` as _INSERT's values."""
    return (*rule.bound, None, rule.seal_key_id, rule.seal, rule.definition_hash)


def _rule(row: tuple[object, ...]) -> Rule:
    revoked, key_id, mac, definition = row[9:13]
    return Rule(
        str(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]), str(row[5]), str(row[6]),
        float(str(row[7])), float(str(row[8])), None if revoked is None else float(str(revoked)),
        None if key_id is None else str(key_id), None if mac is None else str(mac),
        None if definition is None else str(definition),
    )  # fmt: skip


def _for_definition(definition_hash: str | None) -> str:
    """What an audit row adds about the tool definition a rule stands for (nothing for a tool fixed in code)."""
    return "" if definition_hash is None else f" for tool definition {definition_hash}"


class RuleStore:
    def __init__(self, conn: StoreConnection, *, clock: object = time.time) -> None:
        self.tables = tables_of(conn)
        self.clock = clock

    def _now(self) -> float:
        return float(self.clock())  # type: ignore[operator]

    def made(
        self, *, tool: str, args_hash: str, conversation: str, created_by: str, created_via: str, request_id: str,
        seconds: float, keyring: Keyring | None = None, definition_hash: str | None = None,
    ) -> Rule:  # fmt: skip
        """A new rule (not yet stored), sealed with ``keyring``'s current key (None: unsealed, so never let stand
        for a call). ``definition_hash``: the tool definition its card was opened for (None: fixed in code)."""
        now = self._now()
        rule = Rule(
            "rule_" + secrets.token_urlsafe(12), tool, args_hash, conversation, created_by, created_via, request_id,
            now, now + seconds, None, definition_hash=definition_hash,
        )  # fmt: skip
        if keyring is not None:
            made = seal_rule(keyring, rule.bound, definition_hash)
            rule = replace(rule, seal_key_id=made.key_id, seal=made.mac)
        return rule

    async def add_recorded(
        self, store: ApprovalStore, rule: Rule, *, actor: str, platform: str, person: str | None
    ) -> None:
        """Store ``rule`` (from :meth:`made`) with the audit's ``rule_created`` in one transaction of ``store``:
        both or neither (a rule the audit does not show is never made)."""

        def write(tx: Tx) -> None:
            tx.send(_INSERT, _row(rule))
            store.record(
                tx, request_id=rule.request_id, event="rule_created", actor=actor, platform=platform,
                detail=f"{rule.id} until {rule.expires_at:.0f}" + _for_definition(rule.definition_hash), person=person,
            )  # fmt: skip

        await store.write(write)

    async def revoke_recorded(
        self, store: ApprovalStore, rule: Rule, *, actor: str, platform: str, person: str | None
    ) -> bool:
        """End ``rule`` with the audit's ``rule_revoked`` in one transaction of ``store``: both or neither (the
        rule check consults rule_revoked, so a revocation the audit did not show could be undone by hand and
        pass). False: it was not in force."""
        now = self._now()

        def end(tx: Tx) -> bool:
            if tx.run(_REVOKE, (now, actor, rule.id, now)) != 1:
                return False
            store.record(
                tx, request_id=rule.request_id, event="rule_revoked", actor=actor, platform=platform,
                detail=rule.id, person=person,
            )  # fmt: skip
            return True

        return await store.write(end)

    async def add(
        self, *, tool: str, args_hash: str, conversation: str, created_by: str, created_via: str, request_id: str,
        seconds: float, keyring: Keyring | None = None, definition_hash: str | None = None,
    ) -> Rule:  # fmt: skip
        """A new rule, stored on its own (no audit event: the service writes a rule with its ``rule_created``)."""
        rule = self.made(
            tool=tool, args_hash=args_hash, conversation=conversation, created_by=created_by,
            created_via=created_via, request_id=request_id, seconds=seconds, keyring=keyring,
            definition_hash=definition_hash,
        )  # fmt: skip
        await self.tables.run(_INSERT, _row(rule))
        return rule

    async def match(
        self, tool: str, args_hash: str, conversation: str, definition_hash: str | None = None
    ) -> Rule | None:
        """The first of :meth:`candidates`, or None."""
        found = await self.candidates(tool, args_hash, conversation, definition_hash)
        return found[0] if found else None

    async def candidates(
        self, tool: str, args_hash: str, conversation: str, definition_hash: str | None = None, *, limit: int = 20
    ) -> list[Rule]:
        """The rules in force for exactly this call in exactly this conversation, in the order a call weighs them:
        those made for the tool's definition ``definition_hash`` first (a rule for another definition, made later,
        must not hide one), then the longest lasting. Every one is weighed, not the first alone: one that no
        longer stands (its maker no longer an approver, a row refused) must not hide one that does."""
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM approval_rules WHERE tool = ? AND args_hash = ? AND conversation = ?"  # noqa: S608
            " AND revoked_at IS NULL AND expires_at > ?"
            f" ORDER BY CASE WHEN definition_hash = ? THEN 0 ELSE 1 END, expires_at DESC LIMIT {int(limit)}",
            (tool, args_hash, conversation, self._now(), definition_hash),
        )
        return [_rule(tuple(row)) for row in rows]

    async def in_force(self, rule_id: str) -> Rule | None:
        """The rule ``rule_id`` while its row is in force (neither revoked nor expired), or None."""
        row = await self.tables.one(
            f"SELECT {_COLUMNS} FROM approval_rules WHERE id = ? AND revoked_at IS NULL AND expires_at > ?",  # noqa: S608
            (rule_id, self._now()),
        )
        return None if row is None else _rule(tuple(row))

    async def page(self, after: str = "", *, limit: int = 1000) -> list[Rule]:
        """Every rule row, in force or not, by id from the first after ``after``: `kazma audit verify` reads them a
        page at a time (by the primary key, whose order the same statement's comparison follows)."""
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM approval_rules WHERE id > ? ORDER BY id LIMIT {int(limit)}",  # noqa: S608
            (after,),
        )
        return [_rule(tuple(row)) for row in rows]

    async def sealed_since(self) -> float | None:
        """When this store began sealing rules (approval_rules schema v2 applied), or None."""
        row = await self.tables.one(
            "SELECT applied_at FROM kazma_schema WHERE component = 'approval_rules' AND version = 2"
        )
        return None if row is None else float(row[0])

    @staticmethod
    async def recorded(store: ApprovalStore, rules: Sequence[Rule]) -> dict[str, tuple[int | None, int | None]]:
        """Each rule's ``rule_created`` and first ``rule_revoked`` event seq in ``store``'s audit log (None: none),
        found by their requests (the rule's id begins each one's detail)."""
        found: dict[str, tuple[int | None, int | None]] = {rule.id: (None, None) for rule in rules}
        requests = {rule.request_id for rule in rules}
        async for seq, event, detail in store.audit_rows_of(
            "seq, event, detail", requests, ("rule_created", "rule_revoked")
        ):
            words = detail.split(maxsplit=1) if isinstance(detail, str) else []
            if not words or words[0] not in found:
                continue
            created, revoked = found[words[0]]
            if event == "rule_created" and created is None:
                found[words[0]] = (int(seq), revoked)
            elif event == "rule_revoked" and revoked is None:
                found[words[0]] = (created, int(seq))
        return found

    async def list(self, *, active_only: bool = True, limit: int = 100) -> list[Rule]:
        where = " WHERE revoked_at IS NULL AND expires_at > ?" if active_only else ""
        params: tuple[object, ...] = (self._now(),) if active_only else ()
        rows = await self.tables.all(
            f"SELECT {_COLUMNS} FROM approval_rules{where} ORDER BY created_at DESC LIMIT {int(limit)}",  # noqa: S608
            params,
        )
        return [_rule(tuple(row)) for row in rows]

    async def revoke(self, rule_id: str, *, actor: str) -> bool:
        """``rule_id`` ended on its own (no audit event: the service and the CLI revoke with ``rule_revoked``)."""
        now = self._now()
        return await self.tables.run(_REVOKE, (now, actor, rule_id, now)) == 1


def definition_text(rule: Rule) -> str:
    """What a listing says of the tool definition ``rule`` is bound to: its digest as a card shows it (16 hex
    digits), or ``none`` (a tool fixed in Kazma's code, or a rule made before definitions were recorded)."""
    return "definition none" if rule.definition_hash is None else f"definition {rule.definition_hash[:16]}…"


@dataclass(frozen=True)
class RuleState:
    """How a rule stands now, as ``kazma approvals rules list`` and the dashboard say it and as the service weighs
    it before it lets a call run (:func:`rule_standing`): ``active`` (it lets its call run), ``ended`` (its row
    says in force, but the configuration now lets it run no more: quietly, no forgery), ``refused`` (a row no
    "Approve for …" made as it stands: it lets nothing run), ``unchecked`` (it would stand if its seal holds, which
    cannot be checked without the decision key), ``expired`` or ``revoked``. ``why``: said for ``ended``,
    ``refused`` and ``unchecked``. ``site``: for ``refused`` and ``unchecked``, the failure counter a call it is
    refused for counts (a row written around Kazma, or a key not held here)."""

    name: str
    why: str | None = None
    site: str | None = None

    @property
    def stands(self) -> bool:
        return self.name == "active"


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


async def rule_states(
    store: ApprovalStore, rules: Sequence[Rule], *, config: KazmaConfig, keyring: Keyring | None, now: float
) -> list[RuleState]:
    """How each of ``rules`` stands at ``now`` under ``config``: :func:`rule_standing`, the reading the service
    makes before it lets a call run, short of what only a live call knows (whose work it is, under
    ``forbid_requester``; whether an MCP tool's definition now is the one the rule is bound to: its digest is
    shown instead). ``keyring`` None: seals cannot be checked here (no usable decision key), so a rule nothing
    else ends is ``unchecked``, never ``active``."""
    unread = [_standing_unread(rule, config=config, keyring=keyring, now=now) for rule in rules]
    # Every rule's approval and audit rows in a few queries: read a rule at a time (three queries each), a listing
    # of --all over 1,000 rules made 3,000 round trips before it printed a line.
    wanted = [rule.request_id for rule, state in zip(rules, unread, strict=True) if state is None]
    reads = await _ReadAhead.of(store, wanted) if wanted else _Reads(store)
    return [
        state if state is not None else (await _standing_read(reads, rule, config=config, keyring=keyring, now=now))[0]
        for rule, state in zip(rules, unread, strict=True)
    ]


class _Reads:
    """Where the reading of a rule finds its approval and that approval's audit rows: the store, a rule at a
    time (the service's reading before a call runs)."""

    def __init__(self, store: ApprovalStore) -> None:
        self.store = store

    async def request(self, request_id: str) -> ApprovalRequest | None:
        return await self.store.get(request_id)

    async def events(self, request_id: str, event: str) -> list[AuditEvent]:
        return await self.store.events(request_id, event=event)


class _ReadAhead(_Reads):
    """The same rows, read beforehand for many rules at once (a listing)."""

    def __init__(
        self,
        store: ApprovalStore,
        requests: Mapping[str, ApprovalRequest | UnreadableRequest],
        events: Mapping[str, list[AuditEvent]] | None,
    ) -> None:
        super().__init__(store)
        self._requests = requests
        self._events = events  # None: each rule's read from the store, as alone

    @classmethod
    async def of(cls, store: ApprovalStore, request_ids: Sequence[str]) -> _ReadAhead:
        requests = await store.requests_of(request_ids)
        try:
            events: Mapping[str, list[AuditEvent]] | None = await store.events_of(request_ids, _READ_EVENTS)
        except sqlite3.OperationalError as exc:
            if not undecodable(exc):
                raise
            # An audit row that is not UTF-8 (written around Kazma) failed the read of every listed rule's, and the
            # listing raised, though reading a rule alone reads such a row only when that rule's judging needs it
            # (never for an approval whose own row cannot be read): each rule reads its own, as alone.
            events = None
        return cls(store, requests, events)

    async def request(self, request_id: str) -> ApprovalRequest | None:
        found = self._requests.get(request_id)
        if isinstance(found, UnreadableRequest):
            raise found
        return found

    async def events(self, request_id: str, event: str) -> list[AuditEvent]:
        assert event in _READ_EVENTS  # a row not read beforehand would read as none: never there
        if self._events is None:
            return await super().events(request_id, event)
        return [e for e in self._events.get(request_id, ()) if e.event == event]


# The audit events the reading of a rule consults.
_READ_EVENTS: Final = ("decided", "rule_revoked")


async def rule_standing(
    store: ApprovalStore, rule: Rule, *, config: KazmaConfig, keyring: Keyring | None, now: float
) -> tuple[RuleState, ApprovalRequest | None]:
    """Whether ``rule`` lets its call run at ``now`` under ``config`` and, if not, why; with the approval it was
    made from, as read (None: not read, or none). The one reading of a rule: the service's before a call runs
    (:meth:`~kazma.approvals.service.ApprovalService.remembered`) and the listings' (:func:`rule_states`), so a
    rule shown ended, refused, expired or revoked never lets a call run, and one shown active does, but for the
    checks only a live call can make. ``keyring`` None: nothing sealed can be checked, so the best it says is
    ``unchecked``."""
    unread = _standing_unread(rule, config=config, keyring=keyring, now=now)
    if unread is not None:
        return unread, None
    return await _standing_read(_Reads(store), rule, config=config, keyring=keyring, now=now)


def _standing_unread(rule: Rule, *, config: KazmaConfig, keyring: Keyring | None, now: float) -> RuleState | None:
    """How ``rule`` stands from its own row and ``config`` alone, or None: its approval must be read to say."""
    if rule.revoked_at is not None:
        return RuleState("revoked")
    if now >= rule.expires_at:
        return RuleState("expired")
    sealed = None if keyring is None else rule.seal_problem(keyring)
    if sealed is not None:
        return RuleState("refused", sealed.detail, sealed.site)
    ended = _ended_by_config(rule, config)
    if ended is not None:
        return RuleState("ended", ended)
    return None


async def _standing_read(
    reads: _Reads, rule: Rule, *, config: KazmaConfig, keyring: Keyring | None, now: float
) -> tuple[RuleState, ApprovalRequest | None]:
    """The rest of :func:`rule_standing` for a rule its own row does not settle: its approval and audit rows."""
    try:
        request = await reads.request(rule.request_id)
    except UnreadableRequest as exc:  # a text in its row that is not UTF-8 (written around Kazma)
        return RuleState("refused", f"its approval {rule.request_id} cannot be read ({exc})", FORGED), None
    forged = await _made_problem(reads, rule, request, config, keyring)
    if forged is not None:
        return RuleState("refused", forged.detail, forged.site), request
    assert request is not None  # else refused above
    assert request.decided_at is not None
    max_seconds = config.approvals.remember.max_seconds
    ends = request.decided_at.timestamp() + max_seconds
    if now >= ends:
        # A rule Kazma made lasts max_seconds from its approval, as configured now (lowered since: ended, no forgery).
        why = f"approvals.remember.max_seconds is {max_seconds} s now, so it ended at {_utc(ends)}"
        return RuleState("ended", why), request
    if keyring is None:
        # A row written around Kazma would look active too: without the key nothing here says it is not.
        why = "its seal cannot be checked here: no usable decision key (kazma doctor says why)"
        return RuleState("unchecked", why, KEY_UNKNOWN), request
    return RuleState("active"), request


def _ended_by_config(rule: Rule, config: KazmaConfig) -> str | None:
    """Why the configuration now lets ``rule`` (sealed, in force) stand for no call, or None: a change of
    configuration, not a forgery, so it is said and not counted."""
    if not config.approvals.remember.enabled:
        return "approvals.remember.enabled is off: no rule is consulted"
    if not in_a_chat(rule.conversation):
        return f"{rule.conversation} is no chat: no rule is consulted there"
    name = config.policy_name_for(rule.tool)
    policy = config.policy(name)
    if policy is None or not config.roster.may_decide(rule.created_by, rule.created_via, policy.approvers):
        # Who may approve this tool was narrowed since: its maker could not approve the call on a card now.
        return f"{rule.created_by} may no longer approve {rule.tool}"
    if not policy.single:
        # One person's press never stands for a call its policy now gives to several people, or to a passkey.
        return f"{rule.tool}'s policy {name} now needs more than one person's press, or a passkey"
    return None


async def _made_problem(
    reads: _Reads, rule: Rule, request: ApprovalRequest | None, config: KazmaConfig, keyring: Keyring | None
) -> SealProblem | None:
    """Why ``rule``, its seal verified, is not one a person's "Approve for …" made from ``request`` (its approval,
    as read; None: none) for its call, or None. ``keyring`` None: every check but the seals."""
    revoked = [e for e in await reads.events(rule.request_id, "rule_revoked") if e.detail == rule.id]
    if revoked:
        return SealProblem(
            f"it was revoked by {revoked[0].actor} (the audit says so), but its row says it is in force", FORGED
        )
    if request is None:
        return SealProblem("it names no request", FORGED)
    problem = approval_problem(keyring, config, request, check_seal=keyring is not None)
    if problem is not None:
        return SealProblem(f"its approval {request.id} does not hold: {problem.detail}", problem.site)
    made_for = (request.tool, request.args_hash, request.conversation, request.decided_by)
    if made_for != (rule.tool, rule.args_hash, rule.conversation, rule.created_by):
        return SealProblem(f"its approval {request.id} was for another call, place or person", FORGED)
    if rule.definition_hash is not None and rule.definition_hash != request.definition_hash:
        return SealProblem(f"its approval {request.id} was for another definition of {rule.tool}", FORGED)
    if request.decided_at is None:
        return SealProblem(f"its approval {request.id} is not on record as decided", FORGED)
    decided = request.decided_at.timestamp()
    # Kazma makes a rule with the press that approved (moments after the decision) and never for longer than
    # max_seconds can ever be. One made later, or lasting longer, is no rule Kazma made: a forgery. A genuine
    # rule past the max_seconds configured now (lowered since) is only ended (see rule_standing).
    if rule.created_at - decided > RULE_MADE_WITHIN or rule.expires_at - decided > LONGEST_RULE:
        return SealProblem(
            f"it outlives approvals.remember.max_seconds from its approval {request.id} (made "
            f"{rule.created_at - decided:.0f} s after it, until {rule.expires_at - decided:.0f} s after it)",
            FORGED,
        )
    if not decided_among(await reads.events(request.id, "decided"), request):  # as a call run from its card is held
        return SealProblem(f"its approval {request.id} has no decided audit row (changed outside Kazma)", FORGED)
    return None
