"""Signed checkpoints of the audit chain: Ed25519 signatures over (range, sequence, head, time) by a key outside
the store; and the commit seals that let Kazma tell its own appends from anybody else's.

A checkpoint says "the chain's event ``seq`` hashes to ``head``, and the events
``first_seq`` … ``seq`` are Kazma's own". The checkpointer
(:mod:`kazma.approvals.checkpointer`) writes one within a fiftieth of a second of every
decision, and at least every minute while events arrive; the events that were
there before the chain began get one of ``kind`` ``history``, once (see
:mod:`kazma.approvals.chain`).

A *commit seal* is what an appending transaction writes on its last event: an
HMAC-SHA256, by a key derived from the current audit key, over (first sequence
number, last sequence number, head) of what it appended. It costs a few
microseconds in the transaction where an Ed25519 signature costs tens; the
checkpointer signs only ranges whose every event a valid commit seal vouches for,
so a row inserted around Kazma is never signed, whenever it was inserted.

The private keys live in the audit keyring (:data:`kazma.config.keyring.AUDIT_KEYS`:
``.kazma-keys/audit`` beside the store's folder, or ``KAZMA_AUDIT_KEY``), never in
the store and out of every tool's reach, exactly as the decision keys. Anyone can
verify with the public keys alone (``kazma audit public-key``), which is the point:
an auditor holds them, and Kazma cannot later deny what it signed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import importlib.util
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kazma.approvals.hashing import compact_json
from kazma.config.keyring import Keyring

# cryptography is imported by the first signature or key it handles, not with this module: its OpenSSL binding is
# about 9 MB of a started `kazma run`'s memory (bench/idle_rss.py), and a process that has decided nothing since
# it started has signed nothing. Its presence is still checked when a signer is made (AuditSigner), so an install
# without it fails at start, not at the first decision. Only the Ed25519 module is imported: the serialization
# package would bring the SSH key loader (and bcrypt, where installed) for two enum values.
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_DOMAIN = "kazma-audit-checkpoint-v1"  # a signature over anything else can never pass for a checkpoint's
_COMMIT_DOMAIN = "kazma-audit-commit-v1"
_SHA256_BLOCK = 64  # bytes: an HMAC key no longer than this is zero-padded to it
_SEQ_DIGITS = 19  # the most decimal digits of a sequence number (a 64-bit key)
_SEAL_KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # what a keyring's key id may be (kazma.config.keyring)

HISTORY = "history"  # covers the events recorded before the chain began, chained once (the one-time migration)
HEAD = "head"  # covers events Kazma appended (each vouched for by its transaction's commit seal)
KINDS = frozenset({HISTORY, HEAD})


@dataclass(frozen=True)
class Checkpoint:
    kind: str
    first_seq: int  # the first event it covers
    seq: int  # the last event it covers: the chain's head at this checkpoint
    head: str  # hex SHA-256: the chain hash of event ``seq``
    at: float  # epoch seconds when it was made
    key_id: str | None  # None: written without an audit key (never by a configured Kazma)
    signature: str | None  # URL-safe base64 of the Ed25519 signature
    # (field, what the store held) for each field changed around Kazma into what it never writes (see checkpoint_of):
    # that field holds a stand-in, and the checkpoint never verifies.
    never_written: tuple[tuple[str, str], ...] = ()

    @property
    def witness(self) -> str:
        """What a settled card shows: ``#<seq> <first 12 hex of the head>``."""
        return witness_text(self.seq, self.head)


FIELDS: Final = ("kind", "first_seq", "seq", "head", "at", "key_id", "signature")
# What stands in for a field that holds what Kazma never writes: values every reader of a checkpoint can handle (the
# verifier, an export's JSON, the sink), none of which makes a signature verify (never_written says it does not).
_STAND_INS: Final[dict[str, Any]] = {"kind": HEAD, "head": "", "at": 0.0, "key_id": None, "signature": None}


def _as_kazma_writes(name: str, value: Any, seq: int) -> bool:
    if name == "first_seq":
        return type(value) is int and 1 <= value <= seq
    if name == "at":
        return type(value) is int or (type(value) is float and math.isfinite(value))
    if name in ("key_id", "signature"):
        return value is None or type(value) is str
    return type(value) is str  # kind, head


def checkpoint_of(held: Mapping[str, Any], *, never_written: Mapping[str, str] | None = None) -> Checkpoint:
    """A checkpoint from its fields as a store row (or an export's record) held them. A field changed around Kazma
    into what it never writes (bytes where text was, a time that is text, a range that ends before it begins) is
    kept as ``never_written`` with a stand-in in its place, so the verifier, an export and the sink read the row
    and name it, rather than stopping at it. ``seq`` is the table's integer key. ``never_written``: fields already
    found so (an export's ``{"never_written": …}``), by name, as shown there."""
    seq = held["seq"]
    odd = dict(never_written or {})
    values: dict[str, Any] = {"seq": seq}
    for name in FIELDS:
        if name == "seq":
            continue
        value = held[name]
        if name not in odd and not _as_kazma_writes(name, value, seq):
            odd[name] = repr(value)
        if name in odd:
            values[name] = seq if name == "first_seq" else _STAND_INS[name]
        else:
            values[name] = float(value) if name == "at" else value
    return Checkpoint(**values, never_written=tuple((name, odd[name]) for name in FIELDS if name in odd))


def witness_text(seq: int, head: str) -> str:
    return f"#{seq} {head[:12]}"


def message(kind: str, key_id: str | None, first_seq: int, seq: int, head: str, at: float) -> bytes:
    """The bytes a checkpoint's signature covers (a JSON array: every field delimited whatever it holds)."""
    # json.dumps's bytes without an encoder made per call (a pass signs one, and a verifier checks each).
    return compact_json([_DOMAIN, key_id, kind, first_seq, seq, head, at])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    """URL-safe base64 without padding, written only one way: unused low bits of the last character must be
    zero, so no second spelling of a signature (or a key) passes for it."""
    data = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    if _b64(data) != text:
        raise ValueError("not canonical URL-safe base64")
    return data


def _commit_key(seed: bytes) -> bytes:
    return hashlib.sha256(_COMMIT_DOMAIN.encode("ascii") + seed).digest()


def _commit_message(key_id: str, first_seq: int, seq: int, head: str) -> bytes:
    # Every field is from a closed alphabet (a key id is [A-Za-z0-9_.-], numbers, hex): "|" delimits them.
    return f"{key_id}|{first_seq}|{seq}|{head}".encode("ascii")


class AuditSigner:
    """Signs checkpoints with the audit keyring's current key; knows the public half of every key in it."""

    def __init__(self, keyring: Keyring) -> None:
        if importlib.util.find_spec("cryptography") is None:  # looked up, not imported (see the imports)
            raise ImportError("the audit chain's checkpoints are signed with cryptography, which is not installed")
        self.keyring = keyring
        # The key this process seals and signs with, for as long as it runs: the keyring's current key may change
        # under it (it reads its file again on meeting a seal by a key rotated in). The first signature took the
        # keyring's current key then, and signed with the new key under this one's id: a checkpoint that never
        # verified, and the events it covered stayed unsigned for good.
        self._own = keyring.current
        self._private: Ed25519PrivateKey | None = None  # made at the first signature
        self.key_id = self._own.id
        # HMAC-SHA256's two keyed states (RFC 2104: the key, 32 bytes, zero-padded to SHA-256's 64-byte block,
        # XOR 0x36 and 0x5c), made once: each seal copies them. A seal is on every appending transaction's path,
        # and hmac's own object costs twice as much per seal in Python calls around the same hashing.
        # sealed_from checks seals with hmac itself.
        block = _commit_key(self._own.secret).ljust(_SHA256_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def commit_seal(self, first_seq: int, seq: int, head: str) -> str:
        """``<key id>:<first seq>:<HMAC>``: what an appending transaction writes on its last event."""
        inner = self._inner.copy()
        inner.update(_commit_message(self.key_id, first_seq, seq, head))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return f"{self.key_id}:{first_seq}:{outer.hexdigest()}"

    def sealed_from(self, seal: str | None, seq: int, head: str) -> int | None:
        """The first sequence number of the commit whose seal ``seal`` (on event ``seq``, of chain hash ``head``)
        is, when it verifies with a key of this keyring; None otherwise."""
        if type(seal) is not str or not seal:  # bytes, on SQLite: written around Kazma
            return None
        key_id, _, rest = seal.partition(":")
        first, _, mac = rest.partition(":")
        # Its own seals by the key it seals with, whatever the keyring read since (a file rotated and that key
        # retired while it ran: every event it appended went unvouched, and nothing of it was signed again).
        key = self._own if key_id == self._own.id else self.keyring.find(key_id)
        # ASCII digits, as many as a sequence number has: str.isdigit() also passes "²", which int() refuses, and
        # int() refuses more than 4300 digits. Raising here stopped every signing pass, verify and doctor for good.
        if key is None or not (first.isascii() and first.isdigit()) or len(first) > _SEQ_DIGITS:
            return None
        expected = hmac.new(
            _commit_key(key.secret), _commit_message(key_id, int(first), seq, head), hashlib.sha256
        ).hexdigest()
        return int(first) if hmac.compare_digest(expected.encode(), mac.encode("utf-8")) else None

    def unknown_key(self, seal: object) -> str | None:
        """The key id ``seal`` names when this process holds no such key (its file read again if it changed):
        another replica's newer keyring, or a forged seal. None: a key it holds, or no key id a seal can name."""
        if type(seal) is not str:
            return None
        key_id = seal.partition(":")[0]
        if not _SEAL_KEY_ID.fullmatch(key_id) or key_id == self._own.id or self.keyring.find(key_id) is not None:
            return None
        return key_id

    def sign(self, kind: str, first_seq: int, seq: int, head: str, at: float) -> Checkpoint:
        if self._private is None:
            self._private = _private_key(self._own.secret)
        signature = self._private.sign(message(kind, self.key_id, first_seq, seq, head, at))
        return Checkpoint(kind, first_seq, seq, head, at, self.key_id, _b64(signature))

    def public_keys(self) -> PublicKeys:
        """The public half of every key in the keyring (older keys verify what they signed)."""
        return public_keys_of(self.keyring)


def public_keys_of(keyring: Keyring) -> PublicKeys:
    held = [key for key in (keyring.find(key_id) for key_id in keyring.ids) if key is not None]
    return PublicKeys({key.id: _private_key(key.secret).public_key() for key in held})


def _private_key(seed: bytes) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(seed)


class PublicKeyError(ValueError):
    """A public key file or line that cannot be used, with the reason."""


class PublicKeys:
    """The public keys that verify checkpoints, by key id."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey]) -> None:
        self._keys = dict(keys)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def text(self) -> str:
        """``<id>:<URL-safe base64 of the raw 32-byte public key>`` lines: what ``kazma audit public-key`` prints
        and ``kazma audit verify --public-key`` reads."""
        return "".join(f"{key_id}:{_b64(key.public_bytes_raw())}\n" for key_id, key in self._keys.items())

    @classmethod
    def parse(cls, text: str, *, source: str) -> PublicKeys:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        keys: dict[str, Ed25519PublicKey] = {}
        lines: dict[str, int] = {}  # key id -> the line that gave it
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            for entry in line.split():
                key_id, colon, written = entry.partition(":")
                if not colon or not key_id:
                    raise PublicKeyError(f"{source} (line {number}): expected <id>:<public key>, got {entry[:40]!r}")
                try:
                    raw = _unb64(written)
                    key = Ed25519PublicKey.from_public_bytes(raw)
                except (ValueError, binascii.Error):
                    raise PublicKeyError(
                        f"{source} (line {number}): key {key_id} is not a 32-byte Ed25519 public key in URL-safe base64"
                    ) from None
                held = keys.get(key_id)
                if held is not None and held.public_bytes_raw() != raw:
                    # The later one silently replaced the earlier: which key verifies depended on the order of
                    # lines, and a line added at the end swapped the key a checkpoint is checked with.
                    raise PublicKeyError(
                        f"{source} (line {number}): key id {key_id} is given twice (first on line {lines[key_id]}) "
                        "with two different keys: keep the one `kazma audit public-key` printed"
                    )
                keys[key_id] = key
                lines.setdefault(key_id, number)
        if not keys:
            raise PublicKeyError(f"{source} holds no public key")
        return cls(keys)

    def merged(self, others: Iterable[PublicKeys]) -> PublicKeys:
        keys = dict(self._keys)
        for other in others:
            keys.update(other._keys)
        return PublicKeys(keys)

    def problem(self, checkpoint: Checkpoint) -> str | None:
        """Why ``checkpoint``'s signature does not verify, or None when it does."""
        from cryptography.exceptions import InvalidSignature

        if checkpoint.never_written:
            shown = "; ".join(f"{name} is {held}" for name, held in checkpoint.never_written)
            return f"it holds what Kazma never writes ({shown}): changed around Kazma"
        if checkpoint.signature is None or checkpoint.key_id is None:
            return "it is not signed (written without an audit key)"
        key = self._keys.get(checkpoint.key_id)
        if key is None:
            held = ", ".join(self._keys) or "none"
            return f"it is signed with key {checkpoint.key_id!r}, which is not among the public keys given ({held})"
        try:
            signature = _unb64(checkpoint.signature)
            key.verify(
                signature,
                message(
                    checkpoint.kind,
                    checkpoint.key_id,
                    checkpoint.first_seq,
                    checkpoint.seq,
                    checkpoint.head,
                    checkpoint.at,
                ),
            )
        except (InvalidSignature, ValueError, binascii.Error):
            return f"its signature does not verify with key {checkpoint.key_id}"
        return None
