"""The seal on a decision: an HMAC-SHA256 that only a decision path of Kazma can make.

Whoever can write the store can set a row to ``approved`` and add a matching
``decided`` audit row naming a real approver; they cannot seal it, because the
key lives outside the store and out of every tool's reach
(:mod:`kazma.config.keyring`). The seal is made in Python before the
compare-and-set and written by that same statement; execution refuses an
approval whose seal is missing or does not verify.

What it binds: the request id, the tool, the hash of the arguments, the
outcome, who decided (the person, and the identity they used), where, and
when (to the microsecond), and the key's id. A seal moved to another request,
or kept while any of those is changed, does not verify.

Seals are versioned by their text: a seal made since people are recorded
reads ``v2:<hex>`` and binds the person; an older one is plain hex, binds no
person, and still verifies as it was made — on a row that names no person.

A remembered approval ("Approve for 1 h") is an approval too, and is sealed the
same way under its own domain (:func:`seal_rule`): a rule row written by hand,
or one made by Kazma and then stretched to another call, place, person or
time, does not verify, so a plain Approve can never be turned into a standing
one outside Kazma.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kazma.approvals.hashing import compact_json
from kazma.approvals.model import ApprovalRequest
from kazma.config.keyring import Keyring

# A seal of anything else made with the same key can never pass for one of these; nor a v1 seal for a v2 one.
_DOMAIN_V1 = "kazma-decision-v1"
_DOMAIN_V2 = "kazma-decision-v2"
_DOMAIN_RULE = "kazma-rule-v1"
V2 = "v2:"  # how a seal that binds the person begins
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

FORGED = "approval_forged"  # the counter of approvals refused because their seal is missing or wrong
KEY_UNKNOWN = "approval_key_unknown"  # ... because the key that sealed them is not held here (retired, or a
# replica given another keyring)


@dataclass(frozen=True)
class Seal:
    key_id: str
    mac: str  # hex


@dataclass(frozen=True)
class SealProblem:
    """Why a decided row's seal does not hold: what to tell people, and the counter it goes to."""

    detail: str
    site: str
    # Sealed with a key recorded as retired (see kazma.config.keyring.retired_ids): not checked, and it does not
    # run, but it is history kept on purpose, not a seal nobody can place.
    retired: bool = False


def micros(moment: datetime) -> int:
    """A decision's time as the store gives it back, in whole microseconds since the epoch."""
    return (moment - _EPOCH) // _MICROSECOND


def _fields(
    *,
    key_id: str,
    request_id: str,
    tool: str,
    args_hash: str,
    status: str,
    decided_by: str | None,
    decided_via: str | None,
    decided_at: int,
    person: str | None,
    version: int,
) -> list[object]:
    """What a seal of ``version`` binds, in its order (the one place that says so)."""
    fields: list[object] = [key_id, request_id, tool, args_hash, status, decided_by, decided_via, decided_at]
    if version == 1:
        fields.insert(0, _DOMAIN_V1)
    else:
        fields = [_DOMAIN_V2, *fields, person]
    return fields


def _as_json(fields: list[object]) -> bytes:
    """The bytes a seal is the HMAC of: :func:`_fields` as a JSON array, so each field is delimited unambiguously
    whatever characters it holds. Verification writes it so."""
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# :func:`_as_json`'s bytes without json's encoder built per call (most of a seal's cost). Sealing writes the message
# so; verification writes it with json and checks every seal against it.
_as_json_quickly = compact_json


# The current key's HMAC state after its key is mixed in, copied for each seal (one key at a time: the current one).
_keyed: tuple[bytes, hmac.HMAC] | None = None


def _mac(secret: bytes, message: bytes) -> str:
    global _keyed
    keyed = _keyed
    if keyed is None or keyed[0] is not secret:
        keyed = _keyed = (secret, hmac.new(secret, digestmod=hashlib.sha256))
    mac = keyed[1].copy()
    mac.update(message)
    return mac.hexdigest()


def seal(
    keyring: Keyring,
    *,
    request_id: str,
    tool: str,
    args_hash: str,
    status: str,
    decided_by: str | None,
    decided_via: str | None,
    decided_at: float,
    decided_person: str | None = None,
) -> Seal:
    """The seal of one decision, with the current key. ``decided_at`` is the very value the compare-and-set
    stores (epoch seconds); it is bound as the store gives it back, in microseconds. ``decided_person``: the
    person under ``people:`` who owns ``decided_by`` (None: an identity that is nobody's, or no person)."""
    key = keyring.current
    at = micros(datetime.fromtimestamp(decided_at, UTC))
    message = _as_json_quickly(
        _fields(
            key_id=key.id, request_id=request_id, tool=tool, args_hash=args_hash, status=status,
            decided_by=decided_by, decided_via=decided_via, decided_at=at, person=decided_person, version=2,
        )
    )  # fmt: skip
    return Seal(key.id, V2 + _mac(key.secret, message))


def seal_problem(keyring: Keyring | None, request: ApprovalRequest) -> SealProblem | None:
    """Why ``request``'s outcome is not one a decision path of Kazma sealed, or None when its seal verifies."""
    if keyring is None:
        return SealProblem("no decision key is loaded here, so no decision can be verified", KEY_UNKNOWN)
    if not request.status.final or request.decided_at is None:
        return SealProblem(f"it has no decision (status {request.status.value})", FORGED)
    if request.decision_mac is None or request.decision_key_id is None:
        return SealProblem(
            "it carries no decision seal (decided before Kazma sealed decisions, or written outside Kazma)", FORGED
        )
    key = keyring.find(request.decision_key_id)
    if key is None and request.decision_key_id in keyring.retired:
        return SealProblem(
            f"its seal was made with key {request.decision_key_id!r}, retired here ({keyring.source}): it is no "
            "longer checked, and an approval it sealed does not run",
            KEY_UNKNOWN,
            retired=True,
        )
    if key is None:
        return SealProblem(
            f"its seal was made with key {request.decision_key_id!r}, which is not in the decision keyring here "
            f"({keyring.source}: {', '.join(keyring.ids)}); was it retired, or is this replica given other keys?",
            KEY_UNKNOWN,
        )
    stored = request.decision_mac
    version = 2 if stored.startswith(V2) else 1
    if version == 1 and request.decided_person is not None:
        return SealProblem(
            f"it names the person {request.decided_person!r}, but its seal was made before seals bound people: "
            "the person was written outside Kazma",
            FORGED,
        )
    message = _as_json(
        _fields(
            key_id=key.id,
            request_id=request.id,
            tool=request.tool,
            args_hash=request.args_hash,
            status=request.status.value,
            decided_by=request.decided_by,
            decided_via=request.decided_via,
            decided_at=micros(request.decided_at),
            person=request.decided_person,
            version=version,
        )
    )
    expected = (V2 if version == 2 else "") + _mac(key.secret, message)
    # As bytes: compare_digest refuses a str with non-ASCII characters, and a forged value may hold some.
    if not hmac.compare_digest(expected.encode(), stored.encode("utf-8")):
        return SealProblem(
            f"its decision seal does not verify with key {key.id} (the row was changed outside Kazma, or a "
            f"process holding another key named {key.id} sealed it)",
            FORGED,
        )
    return None


# What a remembered approval's seal binds: everything its row says but its revocation (a revoked rule is refused by
# its row and by the audit's ``rule_revoked``): id, tool, args_hash, conversation, created_by, created_via,
# request_id, created_at, expires_at.
RuleFields = tuple[str, str, str, str, str, str, str, float, float]


def _rule_message(key_id: str, bound: RuleFields, definition_hash: str | None) -> bytes:
    """The bytes a rule's seal is the HMAC of, its times in whole microseconds. A rule bound to a tool definition
    binds its digest last: a list one longer, so a seal made without it (a rule made before definitions were
    recorded) still verifies as it was made, and neither can pass for the other."""
    *made, created_at, expires_at = bound
    fields: list[object] = [_DOMAIN_RULE, key_id, *made, round(created_at * 1_000_000), round(expires_at * 1_000_000)]
    if definition_hash is not None:
        fields.append(definition_hash)
    return _as_json(fields)


def seal_rule(keyring: Keyring, bound: RuleFields, definition_hash: str | None = None) -> Seal:
    """The seal of one remembered approval, with the current key, made where the person's press made the rule."""
    key = keyring.current
    return Seal(key.id, V2 + _mac(key.secret, _rule_message(key.id, bound, definition_hash)))


def rule_seal_problem(
    keyring: Keyring | None, seal_key_id: str | None, mac: str | None, bound: RuleFields,
    definition_hash: str | None = None,
) -> SealProblem | None:  # fmt: skip
    """Why a remembered approval's row is not one Kazma made and sealed as it stands, or None when it is."""
    if keyring is None:
        return SealProblem("no decision key is loaded here, so no remembered approval can be verified", KEY_UNKNOWN)
    if mac is None or seal_key_id is None:
        return SealProblem(
            "it carries no seal (made before Kazma sealed remembered approvals, or written outside Kazma)", FORGED
        )
    key = keyring.find(seal_key_id)
    if key is None:
        return SealProblem(
            f"its seal was made with key {seal_key_id!r}, which is not in the decision keyring here "
            f"({keyring.source}: {', '.join(keyring.ids)})",
            KEY_UNKNOWN,
        )
    expected = V2 + _mac(key.secret, _rule_message(key.id, bound, definition_hash))
    if not hmac.compare_digest(expected.encode(), mac.encode("utf-8")):
        return SealProblem(
            f"its seal does not verify with key {key.id} (the row was changed or written outside Kazma)", FORGED
        )
    return None
