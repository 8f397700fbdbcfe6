"""Slack's failures as the bus's one error type: retryable or not, and Slack's ``Retry-After``."""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit

import aiohttp
from slack_sdk.errors import SlackApiError, SlackClientError

from kazma.adapters.contract import PlatformError

PLATFORM: Final = "slack"
RETRYABLE_CODES: Final = frozenset(
    {"ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"}
)
# What Slack answers when the token lacks chat:write.customize (username/icon_emoji).
NO_CUSTOM_IDENTITY: Final = frozenset({"missing_scope", "not_allowed_token_type"})
# Answers about the app's token or scopes: only the operator can change them (a new token, a reinstall).
SETUP_CODES: Final = frozenset(
    {
        "missing_scope",
        "not_allowed_token_type",
        "not_authed",
        "invalid_auth",
        "token_revoked",
        "token_expired",
        "account_inactive",
    }
)

# What Slack answers a call whose token it no longer takes (revoked, expired, the app uninstalled, the workspace or
# the bot deactivated, none sent): every later call with that token is answered the same. ``missing_scope`` and
# ``not_allowed_token_type`` are about what a good token may do; ``ratelimited``, ``fatal_error`` and a 5xx about
# Slack's moment; ``not_in_channel`` and ``channel_not_found`` about one channel.
TOKEN_REFUSALS: Final = frozenset({"invalid_auth", "not_authed", "token_revoked", "token_expired", "account_inactive"})
# What the operator does about a bot token Slack refused while Kazma ran (``kazma doctor`` says so at its check).
OPERATOR_FIX: Final = (
    "reinstall the app to the workspace (OAuth & Permissions → Reinstall to Workspace), put its Bot User OAuth "
    "Token (xoxb-) in platforms.slack.bot_token and restart Kazma"
)
# And about an app-level token Slack refused (Socket Mode's, ``connections:write``).
APP_OPERATOR_FIX: Final = (
    "create an app-level token with connections:write under Basic Information → App-Level Tokens, put it in "
    "platforms.slack.app_token and restart Kazma"
)


def response_status(exc: SlackApiError) -> int | None:
    response = exc.response
    for attr in ("status_code", "status"):
        value = getattr(response, attr, None)
        if isinstance(value, int):
            return value
    return None


def response_field(exc: SlackApiError, field: str) -> str:
    response = exc.response
    try:
        value = response.get(field) if response is not None else None
    except (AttributeError, ValueError):
        return ""
    return str(value) if value is not None else ""


def retry_after(exc: SlackApiError) -> float:
    headers = getattr(exc.response, "headers", None)
    raw = headers.get("Retry-After") if headers is not None else None
    if isinstance(raw, list):
        raw = raw[0] if raw else None
    try:
        return max(float(raw), 0.0) if raw is not None else 1.0
    except (TypeError, ValueError):
        return 1.0


def download_refused(status: int, retry_after_header: str | None, location: str | None = None) -> PlatformError:
    """A file download (``url_private``) Slack did not answer with the file: these are plain HTTP, not the Web
    API, so Slack's busy and rate-limit answers come as bare statuses."""
    site = "file_fetch"
    if status == 429:
        try:
            wait = max(float(retry_after_header), 0.0) if retry_after_header is not None else 1.0
        except ValueError:
            wait = 1.0
        return PlatformError(
            PLATFORM, site, f"rate limited: HTTP 429 (retry after {wait:g} s)", retryable=True, retry_after=wait
        )
    if status >= 500:
        return PlatformError(PLATFORM, site, f"HTTP {status}", retryable=True)
    if 300 <= status < 400:
        # Slack sends a token without files:read to its sign-in page instead of refusing it; sending the file
        # again cannot help, the app's scopes must change. Where it was sent is said too, should it be elsewhere.
        where = f" ({location[:200]})" if location else ""
        return PlatformError(
            PLATFORM,
            site,
            f"HTTP {status}: Slack sent the download elsewhere{where}, as it sends an app without the files:read "
            "scope to its sign-in page; add files:read under OAuth & Permissions → Bot Token Scopes and reinstall "
            "the app",
            retryable=False,
            operator_must_act=True,
        )
    if status == 401:
        # Not taken as Slack refusing the bot token (which would stop every call with it until a restart): Slack
        # answers a download with a token it does not take by sending it to its sign-in page, as above, so a 401
        # here is another's (a proxy's, a URL that is not Slack's file host). The Web API says when the token
        # itself is refused, and the adapter stops then.
        return PlatformError(
            PLATFORM,
            site,
            "HTTP 401: the file's download was refused, not by Slack refusing the bot token (Slack sends a token "
            "it does not take to its sign-in page instead); a proxy between Kazma and Slack's file host may have",
            retryable=False,
            operator_must_act=True,
        )
    # 404 and the like: the file was deleted (or its link is no longer valid) before Kazma fetched it.
    return PlatformError(PLATFORM, site, f"HTTP {status}", retryable=False)


def error_code(exc: BaseException) -> str:
    return response_field(exc, "error") if isinstance(exc, SlackApiError) else ""


def refuses_token(exc: BaseException) -> bool:
    """Whether Slack refused the token the call carried itself (see :data:`TOKEN_REFUSALS`)."""
    return error_code(exc) in TOKEN_REFUSALS


def refusal(exc: BaseException) -> str:
    """The refusal's code and the Web API method it answered: ``token_revoked on chat.postMessage``."""
    url = str(getattr(getattr(exc, "response", None), "api_url", "") or "")
    method = urlsplit(url).path.rsplit("/", 1)[-1]
    return f"{error_code(exc)} on {method}" if method else error_code(exc)


def classify(site: str, exc: BaseException, *, timeout: float | None = None) -> PlatformError:
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, SlackApiError):
        status = response_status(exc)
        code = response_field(exc, "error") or f"HTTP {status}"
        needed = response_field(exc, "needed")
        detail = f"{code} (needs {needed})" if needed else code
        if status == 429 or code == "ratelimited":
            wait = retry_after(exc)  # said in the words too: the card outbox keeps only the words
            return PlatformError(
                PLATFORM, site, f"rate limited: {detail} (retry after {wait:g} s)", retryable=True, retry_after=wait
            )
        if (status is not None and status >= 500) or code in RETRYABLE_CODES:
            return PlatformError(PLATFORM, site, detail, retryable=True)
        return PlatformError(PLATFORM, site, detail, retryable=False, operator_must_act=code in SETUP_CODES)
    if isinstance(exc, TimeoutError):
        return PlatformError(PLATFORM, site, f"no answer within {timeout or 0:g} s", retryable=True)
    if isinstance(exc, aiohttp.ClientError | OSError):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, SlackClientError):
        return PlatformError(PLATFORM, site, str(exc), retryable=False)
    return PlatformError(PLATFORM, site, f"unexpected {type(exc).__name__}: {exc}", retryable=False)
