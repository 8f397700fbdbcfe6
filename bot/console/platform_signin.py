"""Sign in with Slack (OpenID Connect) and with Discord (OAuth2) at the console, for people whose identity on
that platform Kazma knows.

Both are the authorization-code flow: the console sends the browser to the platform with a fresh ``state``
(and, for Slack, a ``nonce``), kept in the store behind an HttpOnly cookie (``SameSite=Lax``: the platform's
redirect back is a cross-site navigation, which a Strict cookie would not survive; over https ``__Host-``, so
no sibling host can plant its own state in a browser and sign it in as somebody else); the platform sends the
browser back with a one-time code; the console exchanges it, server to server, with the app's secret:

- **Slack** answers an *id token*: a JWT signed RS256 by one of the keys Slack publishes (its JWKS). It is
  believed only when the signature verifies with that key, the issuer is ``https://slack.com``, the audience
  is this app, it has not expired, its nonce is the one this browser was given, and it is for the configured
  workspace (``team_id``): then ``https://slack.com/user_id`` is the person's Slack identity.
- **Discord** answers an access token (scope ``identify``); Discord's own ``/users/@me``, asked with it, says
  whose it is: ``discord:<id>``.

The session opened is the person's as that identity, as a press on that platform's card would be: they
decide as ``slack:U…`` via Slack, ``discord:…`` via Discord. Somebody Kazma does not know (under ``people:``,
or an approver or admin there) is not signed in at all.
"""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlencode

import httpx
import structlog
from aiohttp import web

from kazma.adapters.web.render import e
from kazma.bot.console.accounts import CHALLENGE_SECONDS, AccountStore, Purpose, TooManyChallenges
from kazma.bot.console.auth import Proof, WebAuth, html_response, safe_next
from kazma.bot.console.challenge_share import too_many_challenges
from kazma.bot.console.login_throttle import LOGINS
from kazma.bot.console.pages import layout, message_page
from kazma.bot.console.passkeys import RelyingParty
from kazma.config.address import Actor
from kazma.config.models import KazmaConfig

log = structlog.get_logger("kazma.web.platform_signin")

STATE_COOKIE: Final = "kazma_platform_sign_in"
NEXT_COOKIE: Final = "kazma_sign_in_next"  # where the sign-in page was asked to lead, kept across the platform
SLACK_ISSUER: Final = "https://slack.com"
SLACK_USER_CLAIM: Final = "https://slack.com/user_id"
SLACK_TEAM_CLAIM: Final = "https://slack.com/team_id"
SESSION_SECONDS: Final = 3600.0  # the platform proved who this is now; ask it again within the hour
TIMEOUT: Final = 10.0


class SignInRefused(Exception):
    """The platform did not prove a person Kazma knows: the reason, for the person and the log."""


@dataclass(frozen=True)
class Provider:
    name: str  # "slack" | "discord": the identity's platform
    title: str
    proof: Proof


SLACK: Final = Provider("slack", "Slack", Proof.SLACK)
DISCORD: Final = Provider("discord", "Discord", Proof.DISCORD)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def slack_identity(
    id_token: str, jwks: dict[str, Any], *, client_id: str, team_id: str, nonce: str, leeway: float = 30.0
) -> str:
    """``slack:<user id>`` from a Slack id token, once its signature (RS256, a key of ``jwks``), issuer,
    audience, expiry, nonce and workspace all hold; raises :class:`SignInRefused`."""
    import jwt  # PyJWT (with its RSA) at the first Slack sign-in, not with every console

    try:
        kid = jwt.get_unverified_header(id_token).get("kid")
        keys = [k for k in jwt.PyJWKSet.from_dict(jwks).keys if k.key_id == kid]
        if len(keys) != 1:
            raise SignInRefused(f"the id token names a key ({kid!r}) Slack does not publish")
        claims: dict[str, Any] = jwt.decode(
            id_token,
            key=keys[0].key,
            algorithms=["RS256"],
            audience=client_id,
            issuer=SLACK_ISSUER,
            leeway=leeway,
            options={"require": ["exp", "iat", "iss", "aud", "sub", "nonce"]},
        )
    except jwt.PyJWTError as exc:
        raise SignInRefused(f"the id token is not Slack's for this app: {exc}") from None
    if not secrets.compare_digest(str(claims.get("nonce", "")).encode(), nonce.encode()):
        raise SignInRefused("the id token was made for another sign-in (its nonce)")
    if claims.get(SLACK_TEAM_CLAIM) != team_id:
        raise SignInRefused(f"the id token is for another workspace ({claims.get(SLACK_TEAM_CLAIM)!r})")
    user = claims.get(SLACK_USER_CLAIM)
    if not isinstance(user, str) or not user or user != claims.get("sub"):
        raise SignInRefused("the id token names no Slack user")
    return str(Actor("slack", user))


class PlatformSignIn:
    def __init__(self, auth: WebAuth, accounts: AccountStore, config: KazmaConfig, rp: RelyingParty) -> None:
        self.auth = auth
        self.accounts = accounts
        self.config = config
        self.rp = rp

    def offered(self) -> tuple[tuple[str, str], ...]:
        """(label, where it starts) of each sign-in this configuration turns on, for the sign-in page."""
        platforms = self.config.platforms
        found = []
        if platforms.slack.sign_in.on:
            found.append(("Sign in with Slack", "/login/slack"))
        if platforms.discord.sign_in.on:
            found.append(("Sign in with Discord", "/login/discord"))
        return tuple(found)

    def _redirect_uri(self, request: web.Request, provider: Provider) -> str:
        base = self.rp.origins(str(request.url.origin()))[-1]  # the public URL's, or this machine's by name
        return f"{base}/login/{provider.name}/callback"

    def _off(self, provider: Provider) -> web.HTTPNotFound:
        return web.HTTPNotFound(
            text=message_page("Not found", f"Sign in with {provider.title} is off: platforms.{provider.name}.sign_in"),
            content_type="text/html",
        )

    # -- the way out -------------------------------------------------------------------------------

    async def slack_start(self, request: web.Request) -> web.Response:
        return await self._start(request, SLACK)

    async def discord_start(self, request: web.Request) -> web.Response:
        return await self._start(request, DISCORD)

    async def _start(self, request: web.Request, provider: Provider) -> web.Response:
        settings = getattr(self.config.platforms, provider.name).sign_in
        if not settings.on:
            raise self._off(provider)
        state = secrets.token_urlsafe(32)
        try:
            handle, nonce = await self.accounts.challenge(
                Purpose.PLATFORM, subject=f"{provider.name}:{state}", client=self.auth.challenge_client(request)
            )
        except TooManyChallenges as exc:  # one client starting without pause would push out everyone's sign-in
            wait = self.auth.challenge_refused(request, Purpose.PLATFORM.value, exc.wait)
            page = message_page("Too many sign-ins", too_many_challenges(wait), link=("/login", "Sign in"))
            raise web.HTTPTooManyRequests(
                text=page, content_type="text/html", headers={"Retry-After": str(wait)}
            ) from None
        query = {
            "response_type": "code",
            "client_id": settings.client_id,
            "redirect_uri": self._redirect_uri(request, provider),
            "state": state,
        }
        if provider is SLACK:
            query |= {"scope": "openid", "nonce": _b64(nonce), "team": settings.team_id}
        else:
            query |= {"scope": "identify", "prompt": "none"}
        response = web.HTTPFound(f"{settings.authorize_url}?{urlencode(query)}")
        self.auth.set_sign_in_cookie(response, STATE_COOKIE, handle, samesite="Lax", max_age=CHALLENGE_SECONDS)
        back = safe_next(request.query.get("next"), "/")
        if back != "/":
            self.auth.set_sign_in_cookie(response, NEXT_COOKIE, back, samesite="Lax", max_age=CHALLENGE_SECONDS)
        raise response

    # -- the way back ------------------------------------------------------------------------------

    async def slack_callback(self, request: web.Request) -> web.Response:
        return await self._callback(request, SLACK)

    async def discord_callback(self, request: web.Request) -> web.Response:
        return await self._callback(request, DISCORD)

    async def _callback(self, request: web.Request, provider: Provider) -> web.Response:
        settings = getattr(self.config.platforms, provider.name).sign_in
        if not settings.on:
            raise self._off(provider)
        try:
            identity = await self._prove(request, provider)
            if not self.auth.knows(identity):
                raise SignInRefused(f"{identity} is nobody this Kazma knows (under people:, or an approver there)")
        except SignInRefused as exc:
            LOGINS.labels(outcome=f"{provider.name}_refused").inc()
            log.warning("web.platform_sign_in_refused", platform=provider.name, reason=str(exc))
            page = message_page(
                "Not signed in",
                f"{provider.title} did not prove a person Kazma knows: {exc}.",
                link=("/login", "Sign in"),
            )
            response = html_response(page, status=403)
            self.auth.drop_sign_in_cookie(response, STATE_COOKIE)
            return response
        await self.auth.end_previous(request)
        session = await self.auth.open_person_session(provider.proof, identity, lifetime=SESSION_SECONDS)
        LOGINS.labels(outcome=provider.name).inc()
        log.info("web.platform_sign_in", platform=provider.name, identity=identity, person=session.person)
        # A page, not a redirect: the navigation back from the platform is cross-site, and the session cookie
        # (SameSite=Strict) is sent only on the same-site navigation this page makes.
        back = safe_next(request.cookies.get(self.auth.cookie(NEXT_COOKIE)), "/")
        where = "the console" if back == "/" else "where you were going"
        body = f'<h1>Signed in</h1><p>{e(session.who)}</p><p><a href="{e(back)}">Continue to {where}</a></p>'
        response = html_response(layout("Signed in", body, refresh_to=back))
        self.auth.set_cookie(response, session)
        self.auth.drop_sign_in_cookie(response, STATE_COOKIE)
        self.auth.drop_sign_in_cookie(response, NEXT_COOKIE)
        return response

    async def _prove(self, request: web.Request, provider: Provider) -> str:
        challenge = await self.accounts.take_challenge(
            request.cookies.get(self.auth.cookie(STATE_COOKIE), ""), Purpose.PLATFORM
        )
        state = request.query.get("state", "")
        if challenge is None or not state or challenge.subject != f"{provider.name}:{state}":
            raise SignInRefused("this sign-in was not begun in this browser, or took too long")
        if "error" in request.query:
            raise SignInRefused(f"{provider.title} said {request.query['error'][:100]!r}")
        code = request.query.get("code", "")
        if not code:
            raise SignInRefused(f"{provider.title} sent no code")
        redirect_uri = self._redirect_uri(request, provider)
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT, trust_env=False) as client:
                if provider is SLACK:
                    return await self._slack(client, code, redirect_uri, challenge.challenge)
                return await self._discord(client, code, redirect_uri)
        except httpx.HTTPError as exc:
            raise SignInRefused(f"{provider.title} could not be asked: {type(exc).__name__}") from None

    async def _slack(self, client: httpx.AsyncClient, code: str, redirect_uri: str, nonce: str) -> str:
        slack = self.config.platforms.slack
        settings = slack.sign_in
        answer = await client.post(
            f"{slack.api_base_url}openid.connect.token",
            data={
                "client_id": settings.client_id,
                "client_secret": settings.client_secret,
                "code": code,
                "redirect_uri": redirect_uri,
                "grant_type": "authorization_code",
            },
        )
        body = _json(answer)
        if not body.get("ok") or not isinstance(body.get("id_token"), str):
            raise SignInRefused(f"Slack refused the code ({body.get('error', answer.status_code)})")
        keys = _json(await client.get(settings.keys_url))
        return slack_identity(
            body["id_token"], keys, client_id=settings.client_id, team_id=settings.team_id, nonce=nonce
        )

    async def _discord(self, client: httpx.AsyncClient, code: str, redirect_uri: str) -> str:
        discord = self.config.platforms.discord
        settings = discord.sign_in
        answer = await client.post(
            f"{discord.api_base_url}/oauth2/token",
            data={"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri},
            auth=(settings.client_id, settings.client_secret),
        )
        body = _json(answer)
        token = body.get("access_token")
        if answer.status_code != 200 or not isinstance(token, str) or body.get("token_type", "").lower() != "bearer":
            raise SignInRefused(f"Discord refused the code ({body.get('error', answer.status_code)})")
        me = await client.get(f"{discord.api_base_url}/users/@me", headers={"Authorization": f"Bearer {token}"})
        user = _json(me)
        if me.status_code != 200 or not str(user.get("id", "")).isdigit():
            raise SignInRefused(f"Discord did not say whose the token is ({me.status_code})")
        return str(Actor("discord", user["id"]))


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        value = response.json()
    except (json.JSONDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
