"""Whether a stored approval is one a decision path of Kazma made: read by the service before an approved call
runs, and by the one reading of a remembered approval (:func:`kazma.approvals.rules.rule_standing`), which the
console and ``kazma approvals rules list`` share with the service and so cannot live in the service."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kazma.approvals.model import ApprovalRequest, Status
from kazma.approvals.seal import FORGED, SealProblem, seal_problem
from kazma.config.keyring import Keyring
from kazma.config.models import DEFAULT_POLICY, KazmaConfig

if TYPE_CHECKING:
    from kazma.approvals.store import ApprovalStore, AuditEvent


def approval_problem(
    keyring: Keyring | None, config: KazmaConfig, request: ApprovalRequest, *, check_seal: bool = True
) -> SealProblem | None:
    """Why ``request`` is not an approval a decision path of Kazma made, or None when it is: approved, sealed by
    a key in ``keyring``, the seal matching every bound field, and decided by an approver under ``config``.
    ``check_seal`` False: everything but the seal (a listing without a usable decision key says it could not)."""
    if request.status is not Status.APPROVED:
        return SealProblem(f"it is {request.status.value}, not approved", FORGED)
    sealed = seal_problem(keyring, request) if check_seal else None
    if sealed is not None:
        return sealed
    policy = config.policy(request.policy or DEFAULT_POLICY)
    if policy is None:
        return SealProblem(f"its policy {request.policy} is no longer configured", FORGED)
    if not config.roster.may_decide(request.decided_by or "", request.decided_via or "", policy.approvers):
        return SealProblem(f"{request.decided_by} may not approve (not an approver now)", FORGED)
    return None


async def decided_on_record(store: ApprovalStore, request: ApprovalRequest) -> bool:
    """The ``decided`` audit row the compare-and-set wrote with ``request``'s approval: same identity and person,
    same hash, that outcome."""
    return decided_among(await store.events(request.id, event="decided"), request)


def decided_among(decided: Iterable[AuditEvent], request: ApprovalRequest) -> bool:
    """:func:`decided_on_record` over ``request``'s ``decided`` audit events already read (a listing reads those
    of many requests at once)."""
    return any(
        e.actor == request.decided_by
        and e.person == request.decided_person
        and e.args_hash == request.args_hash
        and (e.detail or "").split(":", 1)[0] == Status.APPROVED.value
        for e in decided
    )
