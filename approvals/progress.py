"""How far a request decided by several people has come: who approved or denied it, on which door, and who
may still decide ("1 of 2 approvals: alice on Telegram; waiting for: bob, carol"). Every card shows it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kazma.approvals.model import ApprovalRequest, Decision, Review
from kazma.config.models import DEFAULT_POLICY, KazmaConfig
from kazma.config.people import person_key, requester_key
from kazma.config.registry import CHAT_PLATFORMS

_NAMED = 8  # names listed as "waiting for" on a card before "and N more"


def door_title(platform: str) -> str:
    """A platform as people say it: "Telegram", "the console", "the command line"."""
    spec = CHAT_PLATFORMS.get(platform)
    if spec is not None:
        return spec.title
    return {"web": "the web", "cli": "the command line"}.get(platform, platform)


@dataclass(frozen=True)
class Progress:
    approve_needed: int
    deny_needed: int
    approvals: tuple[str, ...]  # "alice on Telegram", in the order they came
    denials: tuple[str, ...]
    waiting_for: tuple[str, ...]  # people who may still review it, by name (identity when nobody's)
    step_up: bool = False

    def line(self) -> str:
        """One line for cards and answers."""
        parts = [_count(len(self.approvals), self.approve_needed, "approval", self.approvals)]
        if self.denials or self.deny_needed > 1:
            parts.append(_count(len(self.denials), self.deny_needed, "denial", self.denials))
        waiting = list(self.waiting_for[:_NAMED])
        if len(self.waiting_for) > _NAMED:
            waiting.append(f"and {len(self.waiting_for) - _NAMED} more")
        said = "; ".join(parts)
        if waiting:
            said += f"; waiting for: {', '.join(waiting)}"
        return said


def _count(done: int, needed: int, noun: str, who: Sequence[str]) -> str:
    plural = noun if needed == 1 else f"{noun}s"
    return f"{done} of {needed} {plural}" + (f": {', '.join(who)}" if who else "")


def approval_counts(
    config: KazmaConfig, policy_name: str | None, started_by: str | None, actor: str, platform: str
) -> bool:
    """Whether an approving review by ``actor`` on ``platform`` counts under the configuration running now: its
    identity may decide under the request's policy, and is not the requester's where the policy forbids that.

    A review made before the policy changed (its approvers, ``forbid_requester``, whose an identity is) counts
    only as a press made now would: the check before an approved call runs weighs reviews so, and a threshold
    reached on a review it would not count was an approval that then never ran, reported as forged."""
    policy = config.policy(policy_name or DEFAULT_POLICY)
    if policy is None or not config.roster.may_decide(actor, platform, policy.approvers):
        return False
    if policy.forbid_requester and started_by is not None:
        return person_key(config.people, actor) != requester_key(config.people, started_by)
    return True


def reviewed_by(config: KazmaConfig, reviews: Sequence[Review]) -> set[str]:
    """Who has reviewed, by name (identity when nobody's): as each review was recorded, and whose its identity is
    now (an identity linked to its person after it reviewed is that person's review)."""
    return {r.reviewer for r in reviews} | {person_key(config.people, r.actor) for r in reviews}


def _by_person(config: KazmaConfig, reviews: Sequence[Review], decision: Decision) -> tuple[str, ...]:
    """The reviews making ``decision``, one per person as the store counts them (whose each identity is now, else
    who it was recorded as): "alice on Telegram", "bob on Slack and the web", in the order they came."""
    doors: dict[str, list[str]] = {}
    for review in reviews:
        if review.decision is not decision:
            continue
        who = config.roster.person_of(review.actor) or review.reviewer
        seen = doors.setdefault(who, [])
        title = door_title(review.platform)
        if title not in seen:
            seen.append(title)
    return tuple(f"{who} on {' and '.join(titles)}" for who, titles in doors.items())


def progress_of(config: KazmaConfig, request: ApprovalRequest, reviews: Sequence[Review]) -> Progress | None:
    """``request``'s progress (None when one press decides it: its card says nothing new)."""
    if request.approve_needed == 1 and request.deny_needed == 1:
        return None
    policy = config.policy(request.policy or DEFAULT_POLICY)
    counting = [
        r
        for r in reviews
        if r.decision is Decision.DENY
        or approval_counts(config, request.policy, request.started_by, r.actor, r.platform)
    ]
    approvals = _by_person(config, counting, Decision.APPROVE)
    denials = _by_person(config, reviews, Decision.DENY)
    waiting: list[str] = []
    if policy is not None and request.status.value == "pending":
        reviewed = reviewed_by(config, reviews)
        asker = None
        if policy.forbid_requester and request.started_by is not None:
            asker = requester_key(config.people, request.started_by)
        people = {person_key(config.people, identity) for identity in config.roster.deciders(policy.approvers)}
        waiting = sorted(people - reviewed - {asker} if asker else people - reviewed)
    return Progress(
        request.approve_needed, request.deny_needed, approvals, denials, tuple(waiting), step_up=request.step_up
    )


def progress_line(config: KazmaConfig, request: ApprovalRequest, reviews: Sequence[Review]) -> str:
    """The card's progress line ("" when one press decides the request)."""
    progress = progress_of(config, request, reviews)
    return "" if progress is None else progress.line()
