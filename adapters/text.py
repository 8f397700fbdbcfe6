"""Wording shared by every platform's renderer (escaping is each platform's own)."""

from __future__ import annotations

from kazma.approvals.card import ApprovalCard, CardArgument
from kazma.approvals.model import Outcome

APPROVE_LABEL = "Approve"
DENY_LABEL = "Deny"


def cut_marker(arg: CardArgument) -> str:
    """Plain text marking a cut; renderers style it distinctly and escape around it."""
    return f"[cut: {arg.omitted:,} of {arg.original_length:,} characters not shown]"


def deadline_text(card: ApprovalCard) -> str:
    return card.deadline.strftime("%Y-%m-%d %H:%M:%S UTC")


def overflow_notice(card: ApprovalCard, shown: int) -> str:
    """Said on a card that could not fit every argument on the platform."""
    total = len(card.arguments)
    return (
        f"This call does not fit on this platform: {total - shown} of {total} arguments are listed by name only. "
        f"Review the full call before deciding: {card.link}"
    )


def outcome_line(outcome: Outcome) -> str:
    return outcome.summary()


def agent_prefix(agent: str | None) -> str:
    return f"[{agent}] " if agent else ""
