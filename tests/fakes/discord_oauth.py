"""Discord OAuth2 (authorization code, scope ``identify``), as the Discord fake serves it: ``/oauth2/authorize``
sends the browser back with a code; ``POST /api/v10/oauth2/token`` (the app's id and secret by HTTP Basic, a
form body) exchanges it once for a Bearer access token; ``GET /api/v10/users/@me`` with that token says whose
it is — as Discord documents them."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from aiohttp import web


@dataclass
class _Grant:
    redirect_uri: str
    user: dict[str, Any]


class DiscordSignIn:
    def __init__(self) -> None:
        self.client_id = "1100000000000000999"
        self.client_secret = "discord-oauth-client-secret-for-tests"
        self.user: dict[str, Any] | None = None  # who is signed in to Discord in the browser (a user payload)
        self._grants: dict[str, _Grant] = {}
        self._tokens: dict[str, dict[str, Any]] = {}  # access token -> the user it speaks for

    async def authorize(self, request: web.Request) -> web.Response:
        query = request.query
        redirect_uri = query.get("redirect_uri", "")
        if query.get("client_id") != self.client_id or query.get("response_type") != "code" or not redirect_uri:
            return web.Response(status=400, text="invalid_request")
        if "identify" not in query.get("scope", "").split():
            return web.Response(status=400, text="invalid_scope")
        back: dict[str, str] = {"state": query.get("state", "")}
        if self.user is None:
            back["error"] = "access_denied"
        else:
            code = secrets.token_urlsafe(24)
            self._grants[code] = _Grant(redirect_uri, self.user)
            back["code"] = code
        raise web.HTTPFound(f"{redirect_uri}?{urlencode(back)}")

    async def token(self, request: web.Request) -> web.Response:
        form = await request.post()
        header = request.headers.get("Authorization", "")
        client_id = client_secret = ""
        if header.startswith("Basic "):
            client_id, _, client_secret = base64.b64decode(header[6:]).decode().partition(":")
        else:
            client_id, client_secret = str(form.get("client_id", "")), str(form.get("client_secret", ""))
        if (client_id, client_secret) != (self.client_id, self.client_secret):
            return web.json_response({"error": "invalid_client"}, status=401)
        grant = self._grants.pop(str(form.get("code", "")), None)
        if form.get("grant_type") != "authorization_code" or grant is None:
            return web.json_response({"error": "invalid_grant", "error_description": 'Invalid "code"'}, status=400)
        if form.get("redirect_uri") != grant.redirect_uri:
            return web.json_response(
                {"error": "invalid_grant", "error_description": "Invalid redirect_uri"}, status=400
            )
        access = secrets.token_urlsafe(24)
        self._tokens[access] = grant.user
        return web.json_response(
            {"access_token": access, "token_type": "Bearer", "expires_in": 604800,
             "refresh_token": secrets.token_urlsafe(24), "scope": "identify"}
        )  # fmt: skip

    def user_of(self, authorization: str) -> dict[str, Any] | None:
        """The user a ``Bearer`` access token speaks for, or None."""
        if not authorization.startswith("Bearer "):
            return None
        return self._tokens.get(authorization[len("Bearer ") :])
