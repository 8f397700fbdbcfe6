"""Step-up: Approve under a ``step_up`` policy is a fresh passkey assertion, with user verification, on the
request's approval page, by the person deciding — not a button a session can press.

The page asks for options (a challenge made for this person and this request only, their enrolled passkeys
allowed), the browser's authenticator signs it after verifying the person, and the answer is checked by
:func:`~kazma.bot.console.passkeys.verify_assertion` (signature, relying party, origin, user verification, a
moving counter). Only then is the approval put to :meth:`ApprovalService.decide` with ``stepped_up=True``.
A challenge answers one request once: it is taken (deleted) when the answer comes, and one made for another
request, another person or another ceremony is refused. Both routes are a proven person's doors with the
session's CSRF token in ``X-CSRF-Token``; the challenge is found through the HttpOnly ``SameSite=Strict``
ceremony cookie, as at sign-in.
"""

from __future__ import annotations

import json

import structlog
from aiohttp import web

from kazma.approvals.model import Decision
from kazma.approvals.service import ApprovalService
from kazma.bot.console.accounts import CHALLENGE_SECONDS, AccountStore, Purpose
from kazma.bot.console.auth import CSRF_HEADER, CSRF_REFUSED, Session, WebAuth, same_token
from kazma.bot.console.pages import approval_href
from kazma.bot.console.passkeys import (
    PasskeyRefused,
    RelyingParty,
    assertion_options,
    credential_id_of,
    verify_assertion,
)
from kazma.bot.console.signin import CEREMONY_COOKIE, read_answer
from kazma.config.metrics import count_failure

log = structlog.get_logger("kazma.web.step_up")


def _json_error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


def step_up_subject(request_id: str, person: str) -> str:
    """What a step-up challenge is made for: this request, approved by this person."""
    return f"approve:{request_id}:{person}"


class StepUp:
    def __init__(self, auth: WebAuth, accounts: AccountStore, rp: RelyingParty, approvals: ApprovalService) -> None:
        self.auth = auth
        self.accounts = accounts
        self.rp = rp
        self.approvals = approvals

    async def _session(self, request: web.Request) -> tuple[Session, str]:
        """The proven person's session (its CSRF token checked: the page's script sends it in the header; a plain
        form may carry it as a field, and then carries no assertion) and the request id."""
        self.auth.check_origin(request)
        session = self.auth.current()
        supplied = request.headers.get(CSRF_HEADER, "")
        if not supplied and request.content_type == "application/x-www-form-urlencoded":
            field = (await request.post()).get("csrf")
            supplied = field if isinstance(field, str) else ""
        if not supplied or not same_token(supplied, session.csrf):
            log.warning("web.csrf_refused", login=session.login, path=request.path)
            raise _json_error(web.HTTPForbidden, CSRF_REFUSED)
        if session.person is None:
            raise _json_error(web.HTTPForbidden, f"{session.actor} is nobody's identity under people: no passkey")
        return session, request.match_info["id"]

    async def options(self, request: web.Request) -> web.Response:
        session, request_id = await self._session(request)
        assert session.person is not None
        if self.rp.problem is not None:
            raise _json_error(web.HTTPConflict, f"passkeys cannot work here: {self.rp.problem}")
        held = [p.credential_id for p in await self.accounts.passkeys(session.person, revoked=False)]
        if not held:
            raise _json_error(
                web.HTTPConflict,
                f"{session.person} has no passkey enrolled: ask for an enrolment link (kazma people invite "
                f"{session.person}), then approve here",
            )
        handle, challenge = await self.accounts.challenge(
            Purpose.ASSERT, person=session.person, subject=step_up_subject(request_id, session.person)
        )
        response = web.json_response({"publicKey": assertion_options(self.rp, challenge=challenge, allow=held)})
        self.auth.set_sign_in_cookie(response, CEREMONY_COOKIE, handle, samesite="Strict", max_age=CHALLENGE_SECONDS)
        return response

    async def approve(self, request: web.Request) -> web.Response:
        session, request_id = await self._session(request)
        person = session.person
        assert person is not None
        answer = await read_answer(request)
        challenge = await self.accounts.take_challenge(
            request.cookies.get(self.auth.cookie(CEREMONY_COOKIE), ""), Purpose.ASSERT
        )
        if challenge is None or challenge.person != person or challenge.subject != step_up_subject(request_id, person):
            # 409: the session may ask, but this answer is not to a challenge made for it (a replay, another
            # request's challenge, a stale page)
            raise _json_error(web.HTTPConflict, "this approval was not begun on this page, or took too long")
        try:
            passkey = await self.accounts.passkey(credential_id_of(answer))
            if passkey is None or passkey.person != person:
                raise PasskeyRefused(f"that passkey is not one of {person}'s")
            count = verify_assertion(
                self.rp, answer, challenge=challenge.challenge, origins=self.rp.origins(str(request.url.origin())),
                passkey=passkey,
            )  # fmt: skip
            refused = await self.accounts.used(passkey.credential_id, count)
            if refused is not None:
                raise PasskeyRefused(refused)
        except PasskeyRefused as exc:
            count_failure("step_up_refused")
            log.warning("web.step_up_refused", request_id=request_id, person=person, reason=str(exc))
            raise _json_error(web.HTTPUnauthorized, f"Not approved: {exc}.") from None
        result = await self.approvals.decide(
            request_id, Decision.APPROVE, actor=session.actor, platform=session.platform, stepped_up=True
        )
        log.info("web.step_up_decide", request_id=request_id, actor=session.actor, person=person,
                 credential=passkey.credential_id[:12], verdict=result.verdict.value)  # fmt: skip
        session.flash.append(result.message)
        response = web.json_response({"ok": True, "next": approval_href(request_id), "message": result.message})
        self.auth.drop_sign_in_cookie(response, CEREMONY_COOKIE)
        return response
