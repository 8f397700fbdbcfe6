"""Sign in with Slack (OpenID Connect), as the Slack fake serves it: ``/openid/connect/authorize``,
``openid.connect.token`` and ``/openid/connect/keys``.

The id token is made as Slack documents it: a JWT (``header.payload.signature``, each base64url without
padding) signed RS256 — RSASSA-PKCS1-v1_5 with SHA-256 — by an RSA key Slack publishes in its JWKS under the
``kid`` the header names; issuer ``https://slack.com``, audience the app's client id, ``sub`` and
``https://slack.com/user_id`` the user, ``https://slack.com/team_id`` the workspace, and the ``nonce`` the
app passed to ``authorize``. Signed here with ``cryptography`` directly, so Kazma's verifier (PyJWT) is checked
against an independent signer. ``forge`` makes one thing wrong, as an attacker or a mix-up would.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlencode

from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

Forgery = Literal["other-key", "other-audience", "other-team", "expired", "other-nonce", "other-issuer"] | None
ISSUER = "https://slack.com"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _uint(value: int) -> str:
    return _b64(value.to_bytes((value.bit_length() + 7) // 8, "big"))


@dataclass
class _Grant:
    client_id: str
    redirect_uri: str
    nonce: str
    user: str
    team: str


class SlackSignIn:
    def __init__(self, team_id: str) -> None:
        self.client_id = "1111111111.2222222222"
        self.client_secret = "slack-oidc-client-secret-for-tests"
        self.team_id = team_id
        self.user: str | None = None  # who is signed in to Slack in the browser (None: nobody; authorize fails)
        self.forge: Forgery = None
        self.kid = "kazma-fake-key-1"
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._grants: dict[str, _Grant] = {}
        self.exchanged: list[str] = []  # codes exchanged, in order

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/openid/connect/authorize", self.authorize)
        app.router.add_get("/openid/connect/keys", self.keys)

    async def authorize(self, request: web.Request) -> web.Response:
        """The browser at Slack: the person is signed in there and consents; back to the app with a code."""
        query = request.query
        redirect_uri = query.get("redirect_uri", "")
        if query.get("client_id") != self.client_id or query.get("response_type") != "code" or not redirect_uri:
            return web.Response(status=400, text="invalid_request")
        if "openid" not in query.get("scope", "").split():
            return web.Response(status=400, text="invalid_scope")
        back: dict[str, str] = {"state": query.get("state", "")}
        if self.user is None:
            back["error"] = "access_denied"
        else:
            code = secrets.token_urlsafe(24)
            self._grants[code] = _Grant(self.client_id, redirect_uri, query.get("nonce", ""), self.user, self.team_id)
            back["code"] = code
        raise web.HTTPFound(f"{redirect_uri}?{urlencode(back)}")

    async def keys(self, request: web.Request) -> web.Response:
        numbers = self._key.public_key().public_numbers()
        key = {
            "kty": "RSA",
            "kid": self.kid,
            "use": "sig",
            "alg": "RS256",
            "n": _uint(numbers.n),
            "e": _uint(numbers.e),
        }
        return web.json_response({"keys": [key]})

    def token(self, params: dict[str, Any]) -> dict[str, Any]:
        """``openid.connect.token``: the code (once) for an access token and the id token."""
        grant = self._grants.pop(str(params.get("code", "")), None)
        if params.get("client_id") != self.client_id or params.get("client_secret") != self.client_secret:
            return {"ok": False, "error": "invalid_client_id" if grant else "invalid_code"}
        if grant is None:
            return {"ok": False, "error": "invalid_code"}
        if params.get("redirect_uri") != grant.redirect_uri:
            return {"ok": False, "error": "bad_redirect_uri"}
        self.exchanged.append(str(params["code"]))
        return {
            "ok": True,
            "access_token": "xoxp-" + secrets.token_hex(16),
            "token_type": "Bearer",
            "id_token": self._id_token(grant),
        }

    def _id_token(self, grant: _Grant) -> str:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": "https://other.example" if self.forge == "other-issuer" else ISSUER,
            "sub": grant.user,
            "aud": "9999999999.8888888888" if self.forge == "other-audience" else grant.client_id,
            "exp": now - 600 if self.forge == "expired" else now + 3600,
            "iat": now - 1200 if self.forge == "expired" else now,
            "auth_time": now,
            "nonce": "a-nonce-from-another-sign-in" if self.forge == "other-nonce" else grant.nonce,
            "at_hash": _b64(secrets.token_bytes(16)),
            "https://slack.com/team_id": "TOTHERTEAM1" if self.forge == "other-team" else grant.team,
            "https://slack.com/user_id": grant.user,
            "name": "A Person",
        }
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}".encode()
        key = self._other if self.forge == "other-key" else self._key
        signature = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input.decode()}.{_b64(signature)}"
