"""The platform-neutral approval card: the whole call, bounded, with cuts marked in the model.

A cut is a flag with the value's true length, not text inside the value, so a
renderer can show it distinctly and an argument cannot pretend to be cut (or
complete). A long value keeps its head *and* its tail: a harmless prefix must
not hide a destructive end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kazma.approvals.hashing import UnrenderableArguments, canonical_json
from kazma.approvals.model import ApprovalRequest, Decision

BUTTON_PREFIX = "kz1"
MAX_NAME_LENGTH = 100
_NAME_OK = re.compile(r"^[^\x00-\x1f\x7f]+$")


@dataclass(frozen=True)
class CardArgument:
    name: str
    head: str  # the whole value when not cut
    tail: str  # the last characters of a cut value; empty when not cut
    cut: bool
    original_length: int  # characters in the full rendered value

    @property
    def omitted(self) -> int:
        return self.original_length - len(self.head) - len(self.tail)

    @property
    def full(self) -> str | None:
        """The complete value, or None when it was cut."""
        return None if self.cut else self.head


@dataclass(frozen=True)
class ApprovalCard:
    request_id: str
    title: str
    tool: str
    requester: str
    origin: str
    arguments: tuple[CardArgument, ...]
    args_hash: str
    deadline: datetime
    link: str

    def button_data(self, decision: Decision) -> str:
        return button_data(self.request_id, decision)

    @property
    def any_cut(self) -> bool:
        return any(a.cut for a in self.arguments)


def button_data(request_id: str, decision: Decision) -> str:
    """``kz1:<id>:a|d``: fits Telegram's 64-byte ``callback_data``."""
    return f"{BUTTON_PREFIX}:{request_id}:{decision.code}"


def render_value(value: Any) -> str:
    """Text as itself; everything else as compact canonical JSON."""
    return value if isinstance(value, str) else canonical_json(value)


def bound_value(name: str, value: Any, limit: int) -> CardArgument:
    text = render_value(value)
    if len(text) <= limit:
        return CardArgument(name=name, head=text, tail="", cut=False, original_length=len(text))
    tail_len = max(limit // 4, 1)
    head_len = limit - tail_len
    return CardArgument(name=name, head=text[:head_len], tail=text[-tail_len:], cut=True, original_length=len(text))


def check_names(args: dict[str, Any]) -> None:
    for name in args:
        if len(name) > MAX_NAME_LENGTH:
            raise UnrenderableArguments(
                f"argument name of {len(name)} characters is longer than {MAX_NAME_LENGTH}: it cannot be shown whole"
            )
        if not _NAME_OK.match(name):
            raise UnrenderableArguments(f"argument name {name!r} is empty or has control characters")


def build_card(request: ApprovalRequest, *, value_limit: int, public_url: str) -> ApprovalCard:
    check_names(request.args)
    arguments = tuple(bound_value(name, request.args[name], value_limit) for name in sorted(request.args))
    return ApprovalCard(
        request_id=request.id,
        title=f"Approval needed: {request.tool}",
        tool=request.tool,
        requester=request.requested_by,
        origin=request.conversation,
        arguments=arguments,
        args_hash=request.args_hash,
        deadline=request.deadline,
        link=f"{public_url.rstrip('/')}/swarm?approval={request.id}",
    )
