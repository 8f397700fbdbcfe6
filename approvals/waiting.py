"""What waits for *you*: the pending requests a person may decide and has not reviewed yet.

``/approvals`` in chat and the console's Approvals page both ask this. "You" is a person under ``people:``
(every identity of theirs counts, whichever door asks), or, for an identity nobody claimed, that identity
alone. A request waits for you when its policy lets one of your identities decide it, you have not reviewed it,
and ``forbid_requester`` does not bar you (you asked for it: someone else must approve). Requests past their
deadline are not listed: nothing can decide them any more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from kazma.approvals.honesty import reveal_line
from kazma.approvals.model import ApprovalRequest
from kazma.approvals.progress import progress_of, reviewed_by
from kazma.config.models import DEFAULT_POLICY
from kazma.config.people import requester_key

if TYPE_CHECKING:
    from kazma.approvals.service import ApprovalService

# At most this many pending requests are read for one answer (the newest first); a list longer than a chat
# message is cut and says so.
READ_LIMIT = 500
SHOWN = 20


@dataclass(frozen=True)
class Waiting:
    """One request that waits for the person who asked."""

    request: ApprovalRequest
    link: str  # its approval page
    progress: str  # "1 of 2 approvals: bob on Telegram; waiting for: alice" ("" when one press decides it)


@dataclass(frozen=True)
class WaitingList:
    who: str  # the person's name, or the identity when it is nobody's
    decides: bool  # the person may decide under some policy at all
    items: tuple[Waiting, ...]

    def text(self) -> str:
        """The answer in chat: one line per request, with its page."""
        if not self.decides:
            return f"You ({self.who}) may not decide approvals here, so nothing waits for you."
        if not self.items:
            return f"Nothing waits for you ({self.who}): no pending approval is yours to decide."
        count = len(self.items)
        lines = [f"Waiting for you ({self.who}): {count} approval request{'' if count == 1 else 's'}"]
        for item in self.items[:SHOWN]:
            until = item.request.deadline.astimezone(UTC).strftime("%H:%M UTC")
            said = f" — {item.progress}" if item.progress else ""
            lines.append(f"• {reveal_line(item.request.tool)}{said} — until {until}: {item.link}")
        if count > SHOWN:
            lines.append(f"… and {count - SHOWN} more on the console's Approvals page")
        return "\n".join(lines)


class WaitingForYou:
    """Answers "what waits for me" from the approvals store and the configured policies."""

    def __init__(self, service: ApprovalService) -> None:
        self.service = service

    async def for_actor(self, actor: str) -> WaitingList:
        """What waits for the person ``actor`` (an identity such as ``telegram:111``) belongs to."""
        config = self.service.config
        person = config.people.person_of(actor)
        who = person or actor
        mine = config.people.identities(person) if person is not None else frozenset({actor})
        decides = bool(mine & config.roster.deciders()) or any(
            mine & config.roster.deciders(p.approvers) for p in config.approvals.policies.values()
        )
        now = datetime.fromtimestamp(time.time(), UTC)
        found: list[Waiting] = []
        store = self.service.store
        for request in reversed(await store.requests(pending_only=True, limit=READ_LIMIT)):  # oldest first
            if request.deadline <= now:
                continue
            policy = config.policy(request.policy or DEFAULT_POLICY)
            if policy is None or not mine & config.roster.deciders(policy.approvers):
                continue
            started = request.started_by
            if policy.forbid_requester and started is not None and requester_key(config.people, started) == who:
                continue
            reviews = await store.reviews(request.id)
            if who in reviewed_by(config, reviews):
                continue
            progress = progress_of(config, request, reviews)
            found.append(Waiting(request, self.service.link(request.id), "" if progress is None else progress.line()))
        return WaitingList(who, decides, tuple(found))
