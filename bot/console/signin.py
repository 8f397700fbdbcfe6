"""Signing a person in at the console: passkey enrolment from a one-time link, passkey sign-in, the first
account's enrolment with the shared operator token, and ``kazma demo``'s local identity.

Every ceremony's JSON routes are anonymous doors (nobody is signed in yet), so each is held three ways:
the browser must not say the request is cross-site (:meth:`WebAuth.check_origin`), the challenge is found
through an HttpOnly ``SameSite=Strict`` cookie set when the options were given (a page elsewhere can neither
read it nor send it; over https it is ``__Host-``, so a sibling host cannot plant one either), and the
authenticator signed that challenge for this console's origin. A session is opened only when the library
verified the answer (:mod:`~kazma.bot.console.passkeys`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from kazma.bot.console.accounts import (
    CHALLENGE_SECONDS,
    FIRST_ACCOUNT,
    REVOKED_MEANWHILE,
    AccountStore,
    EnrolRefused,
    InviteState,
    Purpose,
    TooManyChallenges,
    digest,
)
from kazma.bot.console.auth import Proof, WebAuth, html_response, read_body, safe_next, same_token
from kazma.bot.console.challenge_share import too_many_challenges
from kazma.bot.console.login_throttle import LOGINS
from kazma.bot.console.passkeys import (
    PasskeyRefused,
    RelyingParty,
    assertion_options,
    credential_id_of,
    enrolment_options,
    verify_assertion,
    verify_enrolment,
)
from kazma.bot.console.signin_pages import enrol_page, gone_page
from kazma.bot.console.static import PEOPLE_JS
from kazma.config.address import Actor
from kazma.config.models import KazmaConfig

log = structlog.get_logger("kazma.web.signin")

CEREMONY_COOKIE = "kazma_ceremony"
MAX_ANSWER = 64 * 1024  # an authenticator's answer is a few kilobytes


def web_login_of(config: KazmaConfig, person: str) -> str | None:
    """The person's console login (the first ``web`` identity under ``people:``), or None."""
    found = config.people.person(person)
    if found is None:
        return None
    logins = found.on("web")
    return Actor.parse(logins[0]).user if logins else None


def _json_error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


async def read_answer(request: web.Request) -> Any:
    """An authenticator's answer (enrolment, sign-in, step-up): JSON of at most :data:`MAX_ANSWER` bytes, or a
    4xx JSON error saying what is wrong with it."""
    raw = await read_body(request.content, MAX_ANSWER)
    if raw is None:
        raise _json_error(web.HTTPRequestEntityTooLarge, "the answer is too large")
    try:
        return json.loads(raw or b"{}")
    except (ValueError, RecursionError):  # arrays nested thousands deep exhaust the parser's stack: a 500 before
        raise _json_error(web.HTTPBadRequest, "the answer is not JSON") from None


@dataclass
class LocalLogin:
    """``kazma demo``'s identity for the browser it opens: a person signed in by a one-time link the demo
    prints to its own terminal. Labelled as what it is wherever it shows; nothing in ``kazma.yaml`` turns it on."""

    person: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    used: bool = False

    @property
    def path(self) -> str:
        return f"/login/local/{self.token}"


class SignIn:
    def __init__(
        self, auth: WebAuth, accounts: AccountStore, config: KazmaConfig, *, local: LocalLogin | None = None
    ) -> None:
        self.auth = auth
        self.accounts = accounts
        self.config = config
        self.rp = RelyingParty.of(config.web.public_url)
        self.local = local

    # -- helpers -----------------------------------------------------------------------------------

    def _ceremony(self, response: web.StreamResponse, handle: str) -> None:
        self.auth.set_sign_in_cookie(response, CEREMONY_COOKIE, handle, samesite="Strict", max_age=CHALLENGE_SECONDS)

    def _origins(self, request: web.Request) -> list[str]:
        return self.rp.origins(str(request.url.origin()))

    def _refuse_without_passkeys(self) -> None:
        if self.rp.problem is not None:
            raise _json_error(web.HTTPConflict, f"passkeys cannot work here: {self.rp.problem}")

    async def _signed_in(self, request: web.Request, proof: Proof, identity: str, **kwargs: Any) -> web.Response:
        await self.auth.end_previous(request)
        session = await self.auth.open_person_session(proof, identity, **kwargs)
        # where the sign-in page was asked to lead (a card's approval page), checked here, not by the script
        back = safe_next(request.query.get("next"), "/")
        response = web.json_response({"ok": True, "next": back, "who": session.who})
        self.auth.set_cookie(response, session)
        self.auth.drop_sign_in_cookie(response, CEREMONY_COOKIE)
        return response

    # -- enrolment ---------------------------------------------------------------------------------

    async def _usable_invite(self, token: str) -> tuple[str, str]:
        """(person, their console login) of a usable invite; raises a clear page otherwise."""
        invite = await self.accounts.find_invite(token) if 20 <= len(token) <= 64 else None
        state = InviteState.UNKNOWN if invite is None else invite.state
        if invite is None or state is not InviteState.USABLE:
            raise web.HTTPGone(text=gone_page(state), content_type="text/html")
        login = web_login_of(self.config, invite.person)
        if login is None:
            raise web.HTTPConflict(
                text=gone_page(
                    InviteState.UNKNOWN,
                    f"{invite.person} has no web identity under people: (add people.{invite.person}.web): "
                    "nothing can be enrolled for them.",
                ),
                content_type="text/html",
            )
        return invite.person, login

    async def enrol_page(self, request: web.Request) -> web.Response:
        person, login = await self._usable_invite(request.match_info["token"])
        token = request.match_info["token"]
        return html_response(enrol_page(person, str(Actor("web", login)), token, problem=self.rp.problem))

    async def enrol_options(self, request: web.Request) -> web.Response:
        self.auth.check_origin(request)
        token = request.match_info["token"]
        try:
            person, login = await self._usable_invite(token)
        except web.HTTPException:
            raise _json_error(web.HTTPGone, _enrol_words("")) from None
        self._refuse_without_passkeys()
        handle, challenge = await self.accounts.challenge(Purpose.ENROL, person=person, subject=digest(token))
        held = [p.credential_id for p in await self.accounts.passkeys(person, revoked=False)]
        options = enrolment_options(
            self.rp,
            challenge=challenge,
            user_handle=await self.accounts.user_handle(person),
            person=person,
            display=f"{person} (web:{login}) at Kazma",
            exclude=held,
        )
        response = web.json_response({"publicKey": options})
        self._ceremony(response, handle)
        return response

    async def enrol(self, request: web.Request) -> web.Response:
        self.auth.check_origin(request)
        token = request.match_info["token"]
        answer = await read_answer(request)
        challenge = await self.accounts.take_challenge(
            request.cookies.get(self.auth.cookie(CEREMONY_COOKIE), ""), Purpose.ENROL
        )
        if challenge is None or challenge.subject != digest(token) or challenge.person is None:
            raise _json_error(web.HTTPForbidden, "this enrolment was not begun in this browser, or took too long")
        person = challenge.person
        login = web_login_of(self.config, person)
        if login is None:
            raise _json_error(web.HTTPConflict, f"{person} has no web identity under people:")
        count = len(await self.accounts.passkeys(person))
        try:
            made = verify_enrolment(
                self.rp, answer, challenge=challenge.challenge, origins=self._origins(request), person=person,
                label=f"passkey {count + 1}",
            )  # fmt: skip
            kept = await self.accounts.enrol(token, made)
        except PasskeyRefused as exc:
            log.warning("web.passkey_enrol_refused", person=person, reason=str(exc))
            raise _json_error(web.HTTPBadRequest, str(exc)) from None
        except EnrolRefused as exc:
            log.warning("web.passkey_enrol_refused", person=person, reason=str(exc))
            raise _json_error(web.HTTPGone, _enrol_words(str(exc))) from None
        log.info("web.passkey_enrolled", person=person, credential=kept.credential_id[:12], label=kept.label)
        return await self._signed_in(request, Proof.PASSKEY, str(Actor("web", login)), credential_id=kept.credential_id)

    # -- signing in --------------------------------------------------------------------------------

    async def sign_in_options(self, request: web.Request) -> web.Response:
        self.auth.check_origin(request)
        self._refuse_without_passkeys()
        try:
            handle, challenge = await self.accounts.challenge(
                Purpose.SIGN_IN, client=self.auth.challenge_client(request)
            )
        except TooManyChallenges as exc:  # one client asking without pause would push out everyone's sign-in
            wait = self.auth.challenge_refused(request, Purpose.SIGN_IN.value, exc.wait)
            raise web.HTTPTooManyRequests(
                text=json.dumps({"error": too_many_challenges(wait)}),
                content_type="application/json",
                headers={"Retry-After": str(wait)},
            ) from None
        response = web.json_response({"publicKey": assertion_options(self.rp, challenge=challenge)})
        self._ceremony(response, handle)
        return response

    async def sign_in(self, request: web.Request) -> web.Response:
        self.auth.check_origin(request)
        answer = await read_answer(request)
        challenge = await self.accounts.take_challenge(
            request.cookies.get(self.auth.cookie(CEREMONY_COOKIE), ""), Purpose.SIGN_IN
        )
        if challenge is None:
            raise _json_error(web.HTTPForbidden, "this sign-in was not begun in this browser, or took too long")
        try:
            passkey = await self.accounts.passkey(credential_id_of(answer))
            if passkey is None:
                raise PasskeyRefused("this passkey is not enrolled here: ask for an enrolment link")
            if passkey.revoked:
                raise PasskeyRefused(
                    "this passkey was revoked: sign in with another of yours, or ask for a new enrolment link"
                )
            login = web_login_of(self.config, passkey.person)
            if login is None:
                raise PasskeyRefused(f"{passkey.person} is no longer under people: with a web identity")
            count = verify_assertion(
                self.rp, answer, challenge=challenge.challenge, origins=self._origins(request), passkey=passkey
            )
            refused = await self.accounts.used(passkey.credential_id, count)
            if refused == REVOKED_MEANWHILE:
                raise PasskeyRefused("this passkey was revoked: sign in with another of yours")
            if refused is not None:
                raise PasskeyRefused(refused)
        except PasskeyRefused as exc:
            LOGINS.labels(outcome="passkey_refused").inc()
            log.warning("web.passkey_refused", reason=str(exc), remote=self.auth.clients.of(request).address)
            raise _json_error(web.HTTPUnauthorized, f"Not signed in: {exc}.") from None
        LOGINS.labels(outcome="passkey").inc()
        log.info("web.passkey_sign_in", person=passkey.person, credential=passkey.credential_id[:12])
        return await self._signed_in(
            request, Proof.PASSKEY, str(Actor("web", login)), credential_id=passkey.credential_id
        )

    # -- the first account, with the shared operator token -------------------------------------------

    async def bootstrap(self, request: web.Request) -> web.Response:
        """While nobody holds a passkey, a session of the shared operator token may make the first enrolment
        link — for a person whose console identity is an operator. Once anyone holds one, never again."""
        session, fields = await self.auth.form(request)
        person = fields.get("person", "")
        login = web_login_of(self.config, person)
        refusal = None
        if session.proof is not Proof.OPERATOR_TOKEN:
            refusal = "Only the shared operator token enrols the first account."
        elif await self.accounts.any_enrolled():
            refusal = "Somebody has enrolled a passkey: further enrolment links come from `kazma people invite`."
        elif login is None or not self.config.roster.is_operator(str(Actor("web", login)), "web"):
            refusal = f"{person!r} is no person whose console identity is an operator (approvals.approvers)."
        if refusal is not None:
            log.warning("web.bootstrap_refused", login=session.login, person=person, reason=refusal)
            session.flash.append(refusal)
            raise web.HTTPSeeOther("/")
        token, _ = await self.accounts.invite(person, created_by=f"web:{session.login} {FIRST_ACCOUNT}")
        log.warning("web.bootstrap_invite", login=session.login, person=person)
        raise web.HTTPSeeOther(f"/enrol/{token}")

    def bootstrap_people(self) -> list[str]:
        """Who the first account may be for: people whose console identity is an operator."""
        return [
            p.name
            for p in self.config.people.people()
            if (login := web_login_of(self.config, p.name))
            and self.config.roster.is_operator(str(Actor("web", login)), "web")
        ]

    # -- kazma demo ----------------------------------------------------------------------------------

    async def local_sign_in(self, request: web.Request) -> web.Response:
        local = self.local
        token = request.match_info["token"]
        if local is None or local.used or not same_token(token, local.token):
            raise web.HTTPGone(text=gone_page(InviteState.USED, "This sign-in link is used or unknown."),
                               content_type="text/html")  # fmt: skip
        if request.method == "HEAD":
            # aiohttp serves HEAD through this handler: a link checker's or a preview's HEAD used the link up
            # (and opened a session nobody holds), and the person's own GET then met 410. HEAD changes nothing.
            return web.Response(status=200, content_type="text/html")
        local.used = True
        await self.auth.end_previous(request)
        session = await self.auth.open_person_session(Proof.LOCAL, str(Actor("web", local.person)))
        log.info("web.local_sign_in", person=local.person)
        response = web.HTTPSeeOther("/")
        self.auth.set_cookie(response, session)
        raise response

    async def script(self, request: web.Request) -> web.Response:
        return web.Response(
            text=PEOPLE_JS,
            content_type="application/javascript",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )


def _enrol_words(reason: str) -> str:
    if reason == InviteState.USED.value:
        return "this enrolment link was used already: ask for a new one (kazma people invite <person>)"
    if reason == InviteState.EXPIRED.value:
        return "this enrolment link has expired: ask for a new one (kazma people invite <person>)"
    if reason == InviteState.UNKNOWN.value:
        return "this enrolment link is not known here"
    return reason or "this enrolment link is used, expired or unknown: ask for a new one (kazma people invite <person>)"
