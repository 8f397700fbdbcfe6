"""Telegram's failures as the bus's one error type: retryable or not, and how long Telegram asked us to wait."""

from __future__ import annotations

import re
import warnings
from datetime import timedelta
from typing import Final

from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)

from kazma.adapters.contract import PlatformError

PLATFORM: Final = "telegram"
# Telegram lets a bot write to a person only after they opened its private chat (and while they have not blocked
# it); its 403 says so in words an operator may not connect with "they have to press Start".
_NOT_STARTED: Final = re.compile(r"can't initiate conversation|bot was blocked by the user", re.IGNORECASE)
NOT_STARTED_HINT: Final = (
    "this person has not started a private chat with the bot, or blocked it: Telegram lets a bot write only to "
    "people who opened its chat and pressed Start"
)


def retry_after_seconds(exc: RetryAfter) -> float:
    # PTB 22 warns on every read of ``retry_after`` until PTB_TIMEDELTA is set; the value is what we need.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = exc.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


# A card's post and edits, which the bus keeps and tries again (the outbox, a card's unsettled row).
CARD_SITES = frozenset({"card_post", "card_update", "card_settle"})


def not_modified(exc: BaseException) -> bool:
    """Telegram refuses an edit that changes nothing; for an idempotent settle that is success."""
    return isinstance(exc, BadRequest) and "message is not modified" in str(exc).lower()


def classify(site: str, exc: BaseException, *, token: str = "") -> PlatformError:
    error = _classify(site, exc)
    # PTB puts the token into some messages ("The token `…` was rejected"); it must not reach logs.
    if token and token in str(error):
        text = str(error).removeprefix(f"{PLATFORM} {site}: ").replace(token, "<token>")
        error = PlatformError(PLATFORM, site, text, retryable=error.retryable, retry_after=error.retry_after,
                              operator_must_act=error.operator_must_act, nothing_done=error.nothing_done)  # fmt: skip
    return error


def _classify(site: str, exc: BaseException) -> PlatformError:
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, RetryAfter):
        seconds = retry_after_seconds(exc)
        return PlatformError(PLATFORM, site, f"flood control: {exc}", retryable=True, retry_after=seconds)
    if isinstance(exc, ChatMigrated):
        return PlatformError(
            PLATFORM,
            site,
            f"chat migrated to {exc.new_chat_id}: update the configuration",
            retryable=False,
            operator_must_act=True,
        )
    if isinstance(exc, Forbidden) and _NOT_STARTED.search(str(exc)):
        return PlatformError(PLATFORM, site, f"{NOT_STARTED_HINT} ({exc})", retryable=False)
    # BadRequest is a NetworkError subclass in PTB: the request was refused, sending it again changes nothing.
    if isinstance(exc, InvalidToken):  # the bot token refused (401): only the operator can give another
        # Refused before Telegram did anything. A card's post or edit waits for the token to be good again (fixed at
        # BotFather, or a passing 401: polling opens again by itself, no restart): given up, the card never came
        # to Telegram, or a card decided meanwhile kept its buttons there for good.
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=site in CARD_SITES,
                             operator_must_act=True, nothing_done=True)  # fmt: skip
    if isinstance(exc, BadRequest | Forbidden):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=False)
    if isinstance(exc, TimedOut) and str(exc) != "Timed out":  # Kazma's transport says which bound and how long
        return PlatformError(PLATFORM, site, str(exc), retryable=True)
    if isinstance(exc, TimedOut | NetworkError | Conflict | TimeoutError):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, TelegramError):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=False)
    # PTB raises RuntimeError when its HTTP client is closed under us (a stop racing a send).
    retryable = isinstance(exc, RuntimeError)
    return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=retryable)
