"""Deny with a reason, on every chat platform: the card's "Deny with reason" button asks first (a Slack or
Discord modal, a Telegram reply to a prompt bound to the presser), then the Deny goes through the one press
policy with the words attached. A bare Deny stays one press. What is shared lives here: the button's data,
the wording, and the bound on what is kept (:data:`~kazma.approvals.model.MAX_REASON`)."""

from __future__ import annotations

import re
from typing import Final

from kazma.approvals.card import BUTTON_PREFIX
from kazma.approvals.model import MAX_REASON

REASON_CODE: Final = "n"
_REASON_DATA = re.compile(rf"^{BUTTON_PREFIX}:(?P<id>[A-Za-z0-9_-]{{16,64}}):{REASON_CODE}$")

REASON_TITLE: Final = "Deny with a reason"
REASON_LABEL: Final = "Why deny it? The agent reads this, and every card and the audit show it."
REASON_SUBMIT: Final = "Deny"
REASON_MAX: Final = MAX_REASON
# Telegram has no modal: the presser replies to a prompt, within this many seconds, and only they count.
REPLY_WINDOW_SECONDS: Final = 120.0


def reason_request(data: str) -> str | None:
    """The request id of a "Deny with reason" button's data, or None for any other data."""
    match = _REASON_DATA.fullmatch(data or "")
    return None if match is None else match["id"]


def deny_data(request_id: str) -> str:
    """The plain Deny's data for ``request_id``: what the reason rides with through the press policy."""
    return f"{BUTTON_PREFIX}:{request_id}:d"


def reply_prompt(request_id: str, who: str) -> str:
    return (
        f"{who}: reply to this message with your reason for denying {request_id} within "
        f"{int(REPLY_WINDOW_SECONDS // 60)} minutes (only your reply counts). Or press Deny on the card."
    )
