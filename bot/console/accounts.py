"""Console accounts: each person's passkeys, their one-time enrolment links, and the challenges of a ceremony.

A person under ``people:`` who uses the web console has an account: a stable WebAuthn user handle and any
number of passkeys (several devices; each can be revoked alone). A passkey is enrolled only through an
*invite*: a one-time link ``kazma people invite <person>`` prints, short-lived, single-use, and kept here
only as the SHA-256 of its token (a copy of the store opens nothing). Using it and keeping the new passkey
are one transaction, so two browsers racing with one link enrol one passkey.

A *challenge* is what a WebAuthn ceremony signs: made here with 256 random bits, kept until it is used once
or expires, found by the hash of a handle the browser holds in an HttpOnly cookie (so a ceremony begun in
one browser cannot be finished from another, whichever replica answers).

One component (``people``), SQL that runs on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from kazma.config.store.backend import StoreConnection, Tx, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

_TABLES: Final = (
    """CREATE TABLE IF NOT EXISTS people_accounts (
        person TEXT PRIMARY KEY,
        user_handle TEXT NOT NULL UNIQUE,
        created_at {real} NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS people_passkeys (
        credential_id TEXT PRIMARY KEY,
        person TEXT NOT NULL,
        public_key TEXT NOT NULL,
        sign_count {bigint} NOT NULL,
        label TEXT NOT NULL,
        created_at {real} NOT NULL,
        last_used_at {real},
        revoked_at {real},
        revoked_by TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS people_passkeys_person ON people_passkeys (person)",
    """CREATE TABLE IF NOT EXISTS people_invites (
        token_hash TEXT PRIMARY KEY,
        person TEXT NOT NULL,
        created_by TEXT NOT NULL,
        created_at {real} NOT NULL,
        expires_at {real} NOT NULL,
        used_at {real},
        credential_id TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS people_challenges (
        handle_hash TEXT PRIMARY KEY,
        purpose TEXT NOT NULL,
        person TEXT,
        subject TEXT,
        challenge TEXT NOT NULL,
        expires_at {real} NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS people_challenges_expiry ON people_challenges (expires_at)",
)

# Which client asked for an anonymous challenge, so that its share is counted where every replica sees it.
_CLIENT_COLUMN: Final = (
    "ALTER TABLE people_challenges ADD COLUMN client TEXT",
    "CREATE INDEX IF NOT EXISTS people_challenges_client ON people_challenges (client, purpose)"
    " WHERE client IS NOT NULL",
)

MIGRATIONS: Final = [
    Migration("people", 1, tuple(t.format(real="REAL", bigint="INTEGER") for t in _TABLES)),
    Migration("people", 2, _CLIENT_COLUMN),
]
PG_MIGRATIONS: Final = [
    PgMigration("people", 1, tuple(t.format(real="double precision", bigint="bigint") for t in _TABLES)),
    PgMigration("people", 2, _CLIENT_COLUMN),
]

INVITE_SECONDS: Final = 24 * 3600  # an enrolment link is good for a day
CHALLENGE_SECONDS: Final = 300  # a ceremony's challenge, from options to answer
MAX_CHALLENGES: Final = 10_000  # kept at once per purpose and person; past it their oldest go (rows, not memory)
CLIENT_CHALLENGES: Final = 20  # unanswered anonymous challenges one client may hold per purpose (challenge_share)


def digest(token: str) -> str:
    """What the store keeps of a token: its SHA-256 (256 random bits: no salt needed). A cookie's or a path's
    bytes that are no UTF-8 (kept as surrogates) hash too, and match nothing: never a 500."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class Purpose(StrEnum):
    """What a challenge is for: it is answered only by the ceremony it was made for."""

    ENROL = "enrol"  # a new passkey, with an invite
    SIGN_IN = "sign-in"  # any enrolled passkey (discoverable: the passkey says whose it is)
    ASSERT = "assert"  # a fresh assertion by one person's passkey (step-up: issue 28's approvals)
    PLATFORM = "platform"  # a platform's sign-in (Slack, Discord): its state, and Slack's nonce


class InviteState(StrEnum):
    USABLE = "usable"
    USED = "used"
    EXPIRED = "expired"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Invite:
    person: str
    state: InviteState
    expires_at: float
    used_at: float | None


@dataclass(frozen=True)
class Passkey:
    credential_id: str  # base64url, as the browser names it
    person: str
    public_key: str  # base64url of the COSE key
    sign_count: int
    label: str
    created_at: float
    last_used_at: float | None
    revoked_at: float | None
    revoked_by: str | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class Challenge:
    purpose: Purpose
    challenge: str  # base64url
    person: str | None  # whose passkey must answer (enrol, assert); None: any (sign-in)
    subject: str | None  # what it was made for: the invite's hash (enrol), or what a step-up approves


# How a first-account invite made with the shared operator token ends its ``created_by`` (see ``enrol``).
FIRST_ACCOUNT = "(operator token, first account)"
FIRST_ACCOUNT_TAKEN = (
    "this link was for the first account, and somebody has enrolled since: ask for a new one (kazma people invite "
    "<person>)"
)


REVOKED_MEANWHILE: Final = "this passkey was revoked"  # what used() says of a passkey revoked meanwhile


class TooManyChallenges(Exception):
    """The client holds its share of unanswered challenges of this purpose: no new one until one leaves."""

    def __init__(self, wait: float) -> None:
        super().__init__(f"too many unanswered challenges: {wait:.0f} s until the oldest expires")
        self.wait = wait  # seconds until the client's oldest unanswered challenge expires


class EnrolRefused(Exception):
    """The invite cannot enrol a passkey (used, expired, unknown) or the passkey is enrolled already."""


_PASSKEY = "credential_id, person, public_key, sign_count, label, created_at, last_used_at, revoked_at, revoked_by"


def _passkey(row: Any) -> Passkey:
    return Passkey(
        str(row[0]), str(row[1]), str(row[2]), int(row[3]), str(row[4]), float(row[5]),
        None if row[6] is None else float(row[6]), None if row[7] is None else float(row[7]), row[8],
    )  # fmt: skip


def _invite_state(row: Any, now: float) -> InviteState:
    if row[3] is not None:
        return InviteState.USED
    return InviteState.EXPIRED if float(row[2]) <= now else InviteState.USABLE


class AccountStore:
    def __init__(self, conn: StoreConnection, *, clock: Callable[[], float] = time.time) -> None:
        self.tables = tables_of(conn)
        self.clock = clock  # epoch seconds: rows outlive the process

    # -- accounts ----------------------------------------------------------------------------------

    async def user_handle(self, person: str) -> str:
        """The person's WebAuthn user handle (base64url of 32 random bytes), made at first use and kept."""
        handle = secrets.token_urlsafe(32)
        await self.tables.run(
            "INSERT INTO people_accounts (person, user_handle, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            (person, handle, self.clock()),
        )
        row = await self.tables.one("SELECT user_handle FROM people_accounts WHERE person = ?", (person,))
        return str(row[0])

    # -- invites -----------------------------------------------------------------------------------

    async def invite(self, person: str, *, created_by: str, lifetime: float = INVITE_SECONDS) -> tuple[str, float]:
        """A new one-time enrolment token for ``person`` and when it expires; only its hash is kept."""
        token = secrets.token_urlsafe(32)
        now = self.clock()
        await self.user_handle(person)
        await self.tables.run(
            "INSERT INTO people_invites (token_hash, person, created_by, created_at, expires_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (digest(token), person, created_by, now, now + lifetime),
        )
        return token, now + lifetime

    async def find_invite(self, token: str) -> Invite | None:
        row = await self.tables.one(
            "SELECT person, created_at, expires_at, used_at FROM people_invites WHERE token_hash = ?", (digest(token),)
        )
        if row is None:
            return None
        state = _invite_state(row, self.clock())
        return Invite(str(row[0]), state, float(row[2]), None if row[3] is None else float(row[3]))

    async def invites(self) -> list[tuple[str, float, float, float | None]]:
        """Every invite as (person, created, expires, used), newest first (``kazma people list``)."""
        rows = await self.tables.all(
            "SELECT person, created_at, expires_at, used_at FROM people_invites ORDER BY created_at DESC"
        )
        return [(str(r[0]), float(r[1]), float(r[2]), None if r[3] is None else float(r[3])) for r in rows]

    # -- passkeys ----------------------------------------------------------------------------------

    async def enrol(self, token: str, passkey: Passkey) -> Passkey:
        """Use the invite ``token`` and keep ``passkey`` for its person, in one transaction.

        Raises :class:`EnrolRefused` (nothing written) when the invite is not usable now or the passkey is
        enrolled already (a browser offering a passkey it holds for this account twice).
        """
        now = self.clock()
        hashed = digest(token)

        def op(tx: Tx) -> Passkey:
            used = tx.one(
                "UPDATE people_invites SET used_at = ?, credential_id = ? WHERE token_hash = ? AND used_at IS NULL"
                " AND expires_at > ? RETURNING person, created_by",
                (now, passkey.credential_id, hashed, now),
            )
            if used is None:
                row = tx.one(
                    "SELECT person, created_at, expires_at, used_at FROM people_invites WHERE token_hash = ?",
                    (hashed,),
                )
                state = InviteState.UNKNOWN if row is None else _invite_state(row, now)
                raise EnrolRefused(state.value)
            if str(used[0]) != passkey.person:
                raise EnrolRefused("the invite is another person's")
            if tx.one("SELECT 1 FROM people_passkeys WHERE credential_id = ?", (passkey.credential_id,)):
                raise EnrolRefused("this passkey is enrolled already")
            if str(used[1]).endswith(FIRST_ACCOUNT) and tx.one("SELECT 1 FROM people_passkeys LIMIT 1"):
                # A first-account link made with the shared token is good only while it is the first: one made
                # before somebody enrolled does not add a passkey to anyone afterwards.
                raise EnrolRefused(FIRST_ACCOUNT_TAKEN)
            tx.run(
                f"INSERT INTO people_passkeys ({_PASSKEY}) VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, NULL)",  # noqa: S608
                (passkey.credential_id, passkey.person, passkey.public_key, passkey.sign_count, passkey.label, now),
            )
            return Passkey(
                passkey.credential_id, passkey.person, passkey.public_key, passkey.sign_count, passkey.label, now,
                None, None, None,
            )  # fmt: skip

        writer = await self.tables.writer()
        return await writer.submit(op)

    async def passkey(self, credential_id: str) -> Passkey | None:
        row = await self.tables.one(
            f"SELECT {_PASSKEY} FROM people_passkeys WHERE credential_id = ?",  # noqa: S608
            (credential_id,),
        )
        return None if row is None else _passkey(row)

    async def passkeys(self, person: str | None = None, *, revoked: bool = True) -> list[Passkey]:
        clauses, params = [], []
        if person is not None:
            clauses.append("person = ?")
            params.append(person)
        if not revoked:
            clauses.append("revoked_at IS NULL")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self.tables.all(
            f"SELECT {_PASSKEY} FROM people_passkeys{where} ORDER BY person, created_at",  # noqa: S608
            params,
        )
        return [_passkey(r) for r in rows]

    async def any_enrolled(self) -> bool:
        """Whether anybody ever enrolled a passkey, revoked since or not: the shared token may enrol the first one
        only. (Counting only those in force reopened it to whoever holds the token once a person's passkeys were
        revoked, the usual step after a compromise: they would enrol their own as that person.)"""
        return await self.tables.one("SELECT 1 FROM people_passkeys LIMIT 1") is not None

    async def used(self, credential_id: str, sign_count: int) -> str | None:
        """Record an assertion by this passkey, whose signature counter is now ``sign_count``: None when recorded,
        else why it is refused — revoked meanwhile, or its counter did not move on past the one kept *now*.

        A compare-and-set: the library checked the counter against the one read before it verified, and two
        assertions verified at once (a cloned authenticator answering beside the real one) both passed that
        check; only one of them moves the counter here, and it never moves back. An authenticator that keeps
        no counter (always 0) is let through, as WebAuthn says."""
        now = self.clock()

        def op(tx: Tx) -> str | None:
            changed = tx.run(
                "UPDATE people_passkeys SET sign_count = ?, last_used_at = ? WHERE credential_id = ?"
                " AND revoked_at IS NULL AND (sign_count < ? OR (sign_count = 0 AND ? = 0))",
                (sign_count, now, credential_id, sign_count, sign_count),
            )
            if changed == 1:
                return None
            row = tx.one("SELECT revoked_at, sign_count FROM people_passkeys WHERE credential_id = ?", (credential_id,))
            if row is None or row[0] is not None:
                return REVOKED_MEANWHILE
            return (
                f"its signature counter ({sign_count}) did not move on past {int(row[1])}: an answer used already, "
                "or a copy of this passkey"
            )

        writer = await self.tables.writer()
        return await writer.submit(op)

    async def revoke(self, *, person: str, credential_id: str | None, by: str) -> list[str]:
        """Revoke one passkey of ``person`` (a credential id or its first characters), or all of theirs; every
        session they opened ends in the same transaction. The ids revoked (none: nothing matched).

        Revoking all of them (the step after a compromise) also closes the person's open enrolment links, in
        the same transaction: a link that leaked with the rest enrolled its holder as the person afterwards, a
        fresh passkey and session the revocation was meant to end. A link made afterwards works."""
        now = self.clock()

        def op(tx: Tx) -> list[str]:
            rows = tx.all(
                "SELECT credential_id FROM people_passkeys WHERE person = ? AND revoked_at IS NULL", (person,)
            )
            ids = [str(r[0]) for r in rows if credential_id is None or str(r[0]).startswith(credential_id)]
            if credential_id is not None and len(ids) > 1:
                raise LookupError(f"{credential_id!r} names {len(ids)} passkeys of {person}: give more of its id")
            for found in ids:
                tx.run(
                    "UPDATE people_passkeys SET revoked_at = ?, revoked_by = ? WHERE credential_id = ?",
                    (now, by, found),
                )
                tx.run("DELETE FROM web_sessions WHERE credential_id = ?", (found,))
            if credential_id is None:
                tx.run(
                    "UPDATE people_invites SET expires_at = ? WHERE person = ? AND used_at IS NULL AND expires_at > ?",
                    (now, person, now),
                )
            return ids

        writer = await self.tables.writer()
        return await writer.submit(op)

    # -- challenges --------------------------------------------------------------------------------

    async def challenge(
        self,
        purpose: Purpose,
        *,
        person: str | None = None,
        subject: str | None = None,
        client: str | None = None,
        share: int = CLIENT_CHALLENGES,
    ) -> tuple[str, bytes]:
        """A new challenge for one ceremony: (the handle the browser keeps, the challenge's bytes).

        Past :data:`MAX_CHALLENGES` of the same purpose for the same person (or for nobody yet: sign-in), the
        oldest of those go, never others': anybody may ask for sign-in options, and a flood of them pushed out
        a person's step-up (an approval) and enrolment in progress, answered "not begun on this page".

        ``client`` (an anonymous asker, as :mod:`~kazma.bot.console.forwarded` names it) may hold at most
        ``share`` unanswered challenges of ``purpose``; past it :class:`TooManyChallenges` is raised and
        nothing is kept. They are counted here, in the rows, not in a process: an answer uses its row up on
        whichever replica it reaches, where a count per process was never given back when the answer went to
        another replica than the options (20 sign-ins so, and that address waited five minutes).
        """
        handle = secrets.token_urlsafe(32)
        value = secrets.token_bytes(32)
        now = self.clock()
        key: tuple[str, ...]
        if person is None:
            same, key = "purpose = ? AND person IS NULL", (purpose.value,)
        else:
            same, key = "purpose = ? AND person = ?", (purpose.value, person)

        def op(tx: Tx) -> None:
            tx.run("DELETE FROM people_challenges WHERE expires_at <= ?", (now,))
            if client is not None:
                held = tx.one(
                    "SELECT COUNT(*), MIN(expires_at) FROM people_challenges WHERE client = ? AND purpose = ?",
                    (client, purpose.value),
                )
                if held is not None and int(held[0]) >= share:
                    raise TooManyChallenges(max(float(held[1]) - now, 1.0))
            row = tx.one(f"SELECT COUNT(*) FROM people_challenges WHERE {same}", key)  # noqa: S608
            over = int(row[0]) - MAX_CHALLENGES + 1 if row else 0
            if over > 0:
                tx.run(
                    "DELETE FROM people_challenges WHERE handle_hash IN"  # noqa: S608
                    f" (SELECT handle_hash FROM people_challenges WHERE {same} ORDER BY expires_at LIMIT ?)",
                    (*key, over),
                )
            tx.run(
                "INSERT INTO people_challenges (handle_hash, purpose, person, subject, challenge, expires_at, client)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (digest(handle), purpose.value, person, subject, _b64(value), now + CHALLENGE_SECONDS, client),
            )

        writer = await self.tables.writer()
        await writer.submit(op)
        return handle, value

    async def take_challenge(self, handle: str, purpose: Purpose) -> Challenge | None:
        """The challenge behind ``handle``, used up now (a second answer to it finds nothing); None when there
        is none, it expired, or it was made for another ceremony."""
        now = self.clock()

        def op(tx: Tx) -> Any:
            return tx.one(
                "DELETE FROM people_challenges WHERE handle_hash = ? RETURNING purpose, challenge, person, subject,"
                " expires_at",
                (digest(handle),),
            )

        writer = await self.tables.writer()
        row = await writer.submit(op)
        if row is None or str(row[0]) != purpose.value or float(row[4]) <= now:
            return None
        return Challenge(Purpose(str(row[0])), str(row[1]), row[2], row[3])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")
