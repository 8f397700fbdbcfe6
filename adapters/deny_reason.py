"""Deny with a reason, on every chat platform: the card's "Deny with reason" button asks first (a Slack or
Discord modal, a Telegram or Matrix reply to a prompt bound to the presser), then the Deny goes through the one press
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
# Telegram and Matrix have no modal: the presser replies to a prompt, within this many seconds, and only they count.
REPLY_WINDOW_SECONDS: Final = 120.0
# The prompt after the presser's name. It is the prompt's own record of what it asks (Telegram hands the replied-to
# message with every reply): read back by :func:`prompt_request`, so it is written from this one template.
_PROMPT_WORDS: Final = (
    ": reply to this message with your reason for denying {id} within {minutes} minutes (only your reply counts)."
    " Or press Deny on the card."
)
_PROMPT_READ = re.compile(
    re.escape(_PROMPT_WORDS)
    .replace(re.escape("{id}"), "(?P<id>[A-Za-z0-9_-]{16,64})")
    .replace(re.escape("{minutes}"), "[0-9]+")
)
# Said to the presser whose reply comes after the window (or to a prompt that no longer says whose it is).
PROMPT_EXPIRED: Final = "that prompt has expired, so nothing was recorded: press Deny with reason on the card again"
PROMPT_NOT_YOURS: Final = "only the person who pressed Deny with reason can give its reason"
# Said to the presser whose reply has no words (a photo, a file): nothing is decided, the prompt still stands.
PROMPT_NO_WORDS: Final = (
    "a reason is words, so nothing was recorded: reply to the prompt again with them, or press Deny on the card"
)


def reason_request(data: str) -> str | None:
    """The request id of a "Deny with reason" button's data, or None for any other data."""
    match = _REASON_DATA.fullmatch(data or "")
    return None if match is None else match["id"]


def deny_data(request_id: str) -> str:
    """The plain Deny's data for ``request_id``: what the reason rides with through the press policy."""
    return f"{BUTTON_PREFIX}:{request_id}:d"


def reply_prompt(request_id: str, who: str) -> str:
    return who + _PROMPT_WORDS.format(id=request_id, minutes=int(REPLY_WINDOW_SECONDS // 60))


def prompt_request(after_who: str) -> str | None:
    """The request id a prompt's words (all after the presser's name) ask a reason for; None for other words."""
    match = _PROMPT_READ.fullmatch(after_who)
    return None if match is None else match["id"]
