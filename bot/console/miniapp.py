"""The approval page as a Telegram Mini App: Telegram signs who opened it, so the page knows the person with
no console sign-in.

When a person presses a card's "Open the whole call" button in Telegram, Telegram opens
``<public_url>/telegram/app`` with *initData* in the URL's fragment: the person's user id, the time, and an
HMAC-SHA256 by a key derived from the bot's token (``HMAC_SHA256(key="WebAppData", msg=bot_token)``) over
every other field, sorted by name, as ``name=value`` lines. Only Telegram and Kazma hold the bot token, so a
valid hash means Telegram vouches for the user id; data older than :data:`MAX_AGE` is refused (a copied URL
cannot be replayed later), as is data signed for another bot (another token, another key). The session this
opens is the person's as ``telegram:<user id>``: they decide on the approval page exactly as they would
press the card's button, bound to the same identity.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl

import structlog
from aiohttp import web

from kazma.adapters.web.render import e
from kazma.bot.console.auth import Proof, WebAuth, client_bytes, html_response, read_body, same_token
from kazma.bot.console.login_throttle import LOGINS
from kazma.bot.console.pages import PEOPLE_SCRIPT, layout
from kazma.config.address import Actor
from kazma.config.models import KazmaConfig

log = structlog.get_logger("kazma.web.telegram_app")

MAX_AGE: Final = 300.0  # seconds from Telegram opening the page to Kazma checking what it signed
CLOCK_SKEW: Final = 60.0  # an auth_date this far ahead of our clock is still believed
SESSION_SECONDS: Final = 3600.0  # a Mini App's session: long enough to read and decide, no longer
MAX_INIT_DATA: Final = 8192
APP_CSRF_COOKIE: Final = "kazma_app_csrf"
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")


class InitDataRefused(ValueError):
    """Telegram did not vouch for this: the reason, for the person and the log."""


@dataclass(frozen=True)
class TelegramVisitor:
    user_id: int
    auth_date: int
    start_param: str | None  # what the card's link carried (t.me/<bot>/<app>?startapp=…): a request id

    @property
    def identity(self) -> str:
        return str(Actor("telegram", str(self.user_id)))


def _secret(bot_token: str) -> bytes:
    return hmac.new(b"WebAppData", bot_token.encode("utf-8"), hashlib.sha256).digest()


def sign_init_data(fields: dict[str, str], bot_token: str) -> str:
    """``fields`` with their hash, as Telegram signs them (the data-check string: sorted ``name=value`` lines)."""
    check = "\n".join(f"{key}={value}" for key, value in sorted(fields.items()))
    # the fields are the client's words (JSON may carry lone surrogates): hashed as bytes, never a 500
    return hmac.new(_secret(bot_token), client_bytes(check), hashlib.sha256).hexdigest()


def verify_init_data(init_data: str, bot_token: str, *, now: float | None = None) -> TelegramVisitor:
    """Who Telegram says opened the page; raises :class:`InitDataRefused` unless this bot's token signed it
    within :data:`MAX_AGE`."""
    if not bot_token:
        raise InitDataRefused("Telegram is not configured here")
    if not init_data or len(init_data) > MAX_INIT_DATA:
        raise InitDataRefused("no initData, or too much")
    try:
        pairs = parse_qsl(init_data, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise InitDataRefused("initData is not a query string") from None
    fields = dict(pairs)
    if len(fields) != len(pairs):
        raise InitDataRefused("a field of initData is given twice")
    supplied = fields.pop("hash", "")
    expected = sign_init_data(fields, bot_token)
    if not same_token(expected, supplied):
        raise InitDataRefused("its signature is not this bot's (changed, or made for another bot)")
    try:
        auth_date = int(fields["auth_date"])
        user: Any = json.loads(fields["user"])
        user_id = int(user["id"])
    except (KeyError, ValueError, TypeError):
        raise InitDataRefused("initData names no user or no time") from None
    clock = time.time() if now is None else now
    if auth_date > clock + CLOCK_SKEW:
        raise InitDataRefused("its time is in the future")
    if clock - auth_date > MAX_AGE:
        raise InitDataRefused(f"it is {int(clock - auth_date)} s old (at most {int(MAX_AGE)} s are accepted)")
    if user_id <= 0:
        raise InitDataRefused("its user id is not a person's")
    start = fields.get("start_param")
    return TelegramVisitor(user_id, auth_date, start if start and _REQUEST_ID.fullmatch(start) else None)


def _json_error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


class TelegramApp:
    def __init__(self, auth: WebAuth, config: KazmaConfig) -> None:
        self.auth = auth
        self.config = config

    @property
    def token(self) -> str:
        return self.config.platforms.telegram.token

    def _off(self) -> web.HTTPException:
        return web.HTTPNotFound(text="the Telegram Mini App is off: platforms.telegram.token is empty")

    async def page(self, request: web.Request) -> web.Response:
        if not self.token:
            raise self._off()
        value = secrets.token_urlsafe(24)
        approval = request.query.get("approval", "")
        response = html_response(telegram_app_page(value, approval if _REQUEST_ID.fullmatch(approval) else None))
        # __Host- over https, as every sign-in cookie: a sibling host could otherwise plant its own pair (a login
        # CSRF into the planter's Telegram identity, held off by the origin check alone)
        self.auth.set_sign_in_cookie(response, APP_CSRF_COOKIE, value, samesite="Strict", max_age=600)
        return response

    async def sign_in(self, request: web.Request) -> web.Response:
        if not self.token:
            raise self._off()
        self.auth.check_origin(request)
        raw = await read_body(request.content, MAX_INIT_DATA * 2)
        if raw is None:
            raise _json_error(web.HTTPRequestEntityTooLarge, "the request is too large")
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError):  # nested thousands deep: the parser's stack, not a 500
            raise _json_error(web.HTTPBadRequest, "expected JSON") from None
        if not isinstance(body, dict):
            raise _json_error(web.HTTPBadRequest, "expected a JSON object")
        cookie = request.cookies.get(self.auth.cookie(APP_CSRF_COOKIE), "")
        field = str(body.get("csrf") or "")
        if not cookie or not field or not same_token(cookie, field):
            raise _json_error(web.HTTPForbidden, "open this page from the card's button in Telegram")
        try:
            visitor = verify_init_data(str(body.get("init_data") or ""), self.token)
        except InitDataRefused as exc:
            LOGINS.labels(outcome="telegram_refused").inc()
            log.warning("web.telegram_app_refused", reason=str(exc), remote=self.auth.clients.of(request).address)
            raise _json_error(
                web.HTTPForbidden, f"Telegram did not vouch for this ({exc}): open the page again from the card."
            ) from None
        if not self.auth.knows(visitor.identity):
            # Telegram vouches for every one of its users, and anyone can open a bot's Mini App: only somebody
            # Kazma knows is let in (as Sign in with Slack and Discord do), never a stranger reading the console.
            LOGINS.labels(outcome="telegram_refused").inc()
            log.warning("web.telegram_app_refused", reason="nobody this Kazma knows", identity=visitor.identity,
                        remote=self.auth.clients.of(request).address)  # fmt: skip
            raise _json_error(
                web.HTTPForbidden,
                f"Telegram says you are {visitor.identity}, who is nobody this Kazma knows (under people:, or an "
                "approver): ask an operator to add you.",
            )
        await self.auth.end_previous(request)
        session = await self.auth.open_person_session(Proof.TELEGRAM, visitor.identity, lifetime=SESSION_SECONDS)
        LOGINS.labels(outcome="telegram").inc()
        log.info("web.telegram_app_sign_in", identity=visitor.identity, person=session.person)
        approval = visitor.start_param or request.query.get("approval", "")
        next_page = f"/swarm?approval={approval}" if _REQUEST_ID.fullmatch(approval) else "/swarm"
        response = web.json_response({"ok": True, "next": next_page, "who": session.who})
        self.auth.set_cookie(response, session)
        self.auth.drop_sign_in_cookie(response, APP_CSRF_COOKIE)
        return response


def telegram_app_page(csrf: str, approval: str | None) -> str:
    """Where a card's button in Telegram lands: the script hands Telegram's signed initData to Kazma, which
    opens a session for the person Telegram names and goes on to the approval page."""
    verify = "/telegram/app" + (f"?approval={approval}" if approval else "")
    body = (
        "<h1>Opening in Telegram…</h1>"
        f'<div id="telegram-app" data-verify="{e(verify)}" data-csrf="{e(csrf)}"></div>'
        "<p>Telegram says who opened this page; Kazma checks Telegram's signature before anything else.</p>"
        '<p class="error" id="passkey-error" role="alert" hidden></p>'
    )
    return layout("Opening in Telegram", body, script=PEOPLE_SCRIPT)
