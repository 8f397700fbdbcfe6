"""Matrix's failures as the bus's one error type: retryable or not, and the homeserver's ``retry_after_ms``.

mautrix raises its own error classes but keeps neither the 429's ``retry_after_ms`` nor its ``Retry-After``
header; :class:`RateLimited` (raised by the transport, ``client.py``) carries the wait the homeserver asked for.
"""

from __future__ import annotations

from typing import Final

import aiohttp
from mautrix.errors import MatrixConnectionError, MatrixRequestError, MatrixResponseError
from mautrix.errors.request import MLimitExceeded

from kazma.adapters.contract import PlatformError

PLATFORM: Final = "matrix"
DEFAULT_WAIT: Final = 1.0  # a 429 that says nothing about how long: a second, as the spec's clients do
# Answers that mean the access token or the account is no good: trying again cannot help.
REFUSED_TOKEN: Final = frozenset({"M_UNKNOWN_TOKEN", "M_MISSING_TOKEN", "M_USER_DEACTIVATED", "M_USER_LOCKED"})


class RateLimited(MLimitExceeded):
    """A 429 with the wait the homeserver asked for (``retry_after_ms``, else ``Retry-After``), in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(429, message)
        self.retry_after = retry_after


def classify(site: str, exc: BaseException, *, timeout: float | None = None) -> PlatformError:
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, MatrixRequestError):
        status = getattr(exc, "http_status", 0) or 0
        code = getattr(exc, "errcode", None) or f"HTTP {status}"
        said = getattr(exc, "message", None)
        # The status first: "M_UNKNOWN: Internal server error" hid that the homeserver answered 500. Without the
        # spec's JSON (a proxy's 502 page) mautrix's own words are the whole page: the status alone says it.
        detail = f"HTTP {status}" + (f" {code}" if code != f"HTTP {status}" else "") + (f": {said}" if said else "")
        if status == 429 or code == "M_LIMIT_EXCEEDED":
            wait = exc.retry_after if isinstance(exc, RateLimited) else DEFAULT_WAIT
            message = f"rate limited: {detail} (retry after {wait:g} s)"
            return PlatformError(PLATFORM, site, message, retryable=True, retry_after=wait)
        if code in REFUSED_TOKEN:
            problem = f"the homeserver refused the access token ({code}): check platforms.matrix.access_token"
            return PlatformError(PLATFORM, site, problem, retryable=False, operator_must_act=True)
        return PlatformError(PLATFORM, site, detail, retryable=status >= 500)
    if isinstance(exc, TimeoutError):
        return PlatformError(PLATFORM, site, f"no answer within {timeout or 0:g} s", retryable=True)
    if isinstance(exc, MatrixConnectionError | aiohttp.ClientError | OSError):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, MatrixResponseError):
        return PlatformError(PLATFORM, site, f"unexpected answer: {exc}", retryable=True)
    return PlatformError(PLATFORM, site, f"unexpected {type(exc).__name__}: {exc}", retryable=False)


# Said once in an encrypted room (and by ``kazma doctor`` for an encrypted home room).
ENCRYPTED_NOTICE: Final = (
    "This room is end-to-end encrypted, and Kazma does not support encrypted rooms: it cannot read what is "
    "said here, and its cards would not be encrypted. Encryption cannot be turned off in a room once on. "
    'Make an unencrypted room (Element: New room → turn off "Enable end-to-end encryption"), invite the bot '
    "there and set platforms.matrix.home_room / rooms to its id."
)
