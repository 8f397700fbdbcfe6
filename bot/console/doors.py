"""Who may open which door of the web server: every route's role, in one table, enforced in one place.

Each route is declared once below with the role it needs. The server registers its handlers from this table,
refuses to start with a route the table does not name (the approvals API and ``/mcp`` add theirs elsewhere,
and are checked too), and one middleware (:meth:`Doors.guard`) enforces the role before any handler runs: a
handler never has to remember to check, and a new route cannot be forgotten.

``reader`` needs a console session of any kind (a shared token's included), ``person`` a session a person
was proven into (a passkey, a platform's signed sign-in, ``kazma demo``'s local identity — never a shared
token), ``operator`` such a session whose identity is an operator, ``api-token`` an approvals-API token
sent as ``Authorization: Bearer``, ``anonymous`` nothing. A state-changing request with a session must also carry
the session's CSRF token; that is checked where the body is read (:meth:`WebAuth.form`, or the upload reader,
which streams), and the route walk in the tests proves it for every such route.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import structlog
from aiohttp import web

from kazma.bot.console.auth import OPERATORS_ONLY, Session, WebAuth, login_href
from kazma.bot.console.hosts import Hosts
from kazma.bot.console.pages import message_page

log = structlog.get_logger("kazma.web")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Access(StrEnum):
    ANONYMOUS = "anonymous"  # no login: the sign-in form, health, metrics, the page script, the API's schema
    READER = "reader"  # any console session (a shared token's reads only)
    PERSON = "person"  # a proven person's session: a passkey, a platform's signed sign-in; never a shared token
    OPERATOR = "operator"  # a proven person who is an operator
    API_TOKEN = "api-token"  # noqa: S105 - a role name: an approvals-API token (api.tokens) is needed


class Refusal(StrEnum):
    """How a request without a session is answered: what the client can act on."""

    PAGE = "page"  # an HTML page: off to the login form (302)
    JSON = "json"  # a machine route (the event stream): 401 with a JSON body
    FORM = "form"  # a form POST: 401 with a page that links to the login form


@dataclass(frozen=True)
class Door:
    method: str  # GET (HEAD follows it), POST, DELETE, or * for every method
    path: str  # the route's canonical path, as aiohttp names it
    access: Access
    what: str  # what is behind it, for the reader of this table

    @property
    def refusal(self) -> Refusal:
        if self.method != "GET":
            return Refusal.FORM
        return Refusal.JSON if self.path == "/events" else Refusal.PAGE


_A, _R, _P, _O, _T = Access.ANONYMOUS, Access.READER, Access.PERSON, Access.OPERATOR, Access.API_TOKEN

DOORS: tuple[Door, ...] = (
    # signing in and out
    Door("GET", "/login", _A, "the sign-in page (sets its own double-submit CSRF cookie for the token form)"),
    Door("POST", "/login", _A, "a read-only session with a name and a shared token (throttled per client)"),
    Door("POST", "/login/passkey/options", _A, "a sign-in challenge (kept by an HttpOnly cookie)"),
    Door("POST", "/login/passkey", _A, "sign in with a passkey: the answer to that challenge, verified"),
    Door("GET", "/login/local/{token}", _A, "kazma demo's one-time local sign-in (404 outside the demo)"),
    Door("GET", "/login/slack", _A, "Sign in with Slack: off to Slack with a fresh state and nonce"),
    Door("GET", "/login/slack/callback", _A, "back from Slack: its id token verified, a session for that person"),
    Door("GET", "/login/discord", _A, "Sign in with Discord: off to Discord with a fresh state"),
    Door("GET", "/login/discord/callback", _A, "back from Discord: the code exchanged, /users/@me asked who"),
    Door("GET", "/enrol/{token}", _A, "a one-time enrolment link's page (410 when used or expired)"),
    Door("POST", "/enrol/{token}/options", _A, "an enrolment challenge for that link's person"),
    Door("POST", "/enrol/{token}", _A, "a new passkey for that link's person, verified; the link is used up"),
    Door("POST", "/people/bootstrap", _R, "the first account's link: the shared operator token, while nobody has one"),
    Door("GET", "/telegram/app", _A, "a card's Telegram Mini App landing page (404 without Telegram)"),
    Door("POST", "/telegram/app", _A, "Telegram's signed initData: a session for the person it names"),
    Door("POST", "/logout", _R, "end this session"),
    # reading
    Door("GET", "/", _R, "the console conversation, with approval cards"),
    Door("GET", "/events", _R, "the live event stream (SSE) of the console, transcripts and dashboard"),
    Door("GET", "/conversations", _R, "every conversation Kazma serves"),
    Door("GET", "/conversations/{conversation}", _R, "one conversation's transcript"),
    Door("GET", "/console/files/{id}", _R, "a file an agent posted, as a download"),
    Door("GET", "/swarm", _R, "the dashboard; with ?approval=<id> the approval page of one request"),
    Door("GET", "/approvals", _R, "the requests waiting for the signed-in person (none for a shared token)"),
    # talking to the agents (a reader's /swarm reads, /plan and /approvals are answered to them, never to an agent)
    Door("POST", "/console/send", _R, "to the agents (operators); /swarm reads, /plan, /approvals (anyone)"),
    Door("POST", "/console/choose", _O, "a press of a question's choice: an answer that resumes an agent"),
    Door("POST", "/console/upload", _O, "files (and a message) to the agents"),
    # deciding and steering
    Door("POST", "/approvals/{id}/decide", _P, "Approve or Deny by a proven person (the service checks the approver)"),
    Door("POST", "/approvals/{id}/step-up/options", _P, "a step-up challenge: this person's passkeys, this request"),
    Door("POST", "/approvals/{id}/step-up", _P, "Approve under a step_up policy: a fresh passkey assertion, verified"),
    Door("POST", "/approvals/rules/{id}/revoke", _O, "revoke a remembered approval"),
    Door("POST", "/swarm/command", _O, "a /swarm command from the dashboard"),
    Door("POST", "/swarm/tasks/{id}/{action}", _O, "cancel, retry, approve or reject a swarm task"),
    # machines
    Door("GET", "/metrics", _A, "Prometheus counts (no arguments, ids or names of people)"),
    Door("GET", "/healthz", _A, "whether Kazma decides approvals, for monitors and load balancers"),
    Door("GET", "/static/console.js", _A, "the script every signed-in page loads"),
    Door("GET", "/static/people.js", _A, "the sign-in pages' script (passkeys, the Telegram Mini App)"),
    # the approvals API and MCP (bot/console/api.py, bot/console/mcp_door.py): API tokens, never console sessions
    Door("POST", "/api/v1/approvals", _T, "open an approval request (approval_requester)"),
    Door(
        "GET",
        "/api/v1/approvals/{id}",
        _T,
        "read or wait for a request this token opened (any request: approval_viewer)",
    ),
    Door("DELETE", "/api/v1/approvals/{id}", _T, "withdraw a request this token opened (approval_requester)"),
    Door("GET", "/api/v1/openapi.json", _A, "the approvals API's OpenAPI description (no data)"),
    Door("*", "/mcp", _T, "the MCP endpoint (streamable HTTP) for coding agents"),
)


def route_key(method: str, path: str) -> tuple[str, str]:
    """The table's key of a route: HEAD is GET's (aiohttp adds a HEAD route beside each GET)."""
    return ("GET" if method == "HEAD" else method, path)


TABLE: Mapping[tuple[str, str], Door] = {route_key(d.method, d.path): d for d in DOORS}
if len(TABLE) != len(DOORS):  # pragma: no cover - a mistake in the table above, caught at import
    raise RuntimeError("a route is declared twice in the doors table")


def routes_of(router: web.UrlDispatcher) -> set[tuple[str, str]]:
    """Every (method, canonical path) the application serves, HEAD folded into GET."""
    found: set[tuple[str, str]] = set()
    for route in router.routes():
        resource = route.resource
        if resource is not None:
            found.add(route_key(route.method, resource.canonical))
    return found


def undeclared(router: web.UrlDispatcher) -> list[str]:
    """Routes the application serves that the table does not name: each would have no role."""
    return sorted(f"{method} {path}" for method, path in routes_of(router) - set(TABLE))


def add_routes(application: web.Application, handlers: Mapping[tuple[str, str], Handler]) -> None:
    """Register the console's own handlers, each under its declared door; a handler without one is an error."""
    missing = sorted(f"{m} {p}" for m, p in set(handlers) - set(TABLE))
    if missing:
        raise RuntimeError(f"routes without a declared role in bot/console/doors.py: {', '.join(missing)}")
    for (method, path), handler in handlers.items():
        if method == "GET":
            application.router.add_get(path, handler)  # with its HEAD route, as aiohttp serves a GET
        else:
            application.router.add_route(method, path, handler)


class Doors:
    """The one place roles are enforced: an aiohttp middleware over the table."""

    def __init__(self, auth: WebAuth, api_caller: Callable[[web.Request], object], hosts: Hosts | None = None) -> None:
        self.auth = auth
        self.api_caller = api_caller  # raises 401 unless the request carries a configured API token
        self.hosts = hosts  # the names the console answers to (DNS rebinding); None: any

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route
        resource = route.resource
        door = TABLE.get(route_key(route.method, resource.canonical)) if resource is not None else None
        if self.hosts is not None and (door is None or door.access is not Access.API_TOKEN):
            self.hosts.check(request)  # a rebound name's page reads nothing, not even a 404
        if resource is None:  # nothing matched: the handler is aiohttp's own 404 / 405
            return await handler(request)
        if door is None:
            # fail closed: a route nobody gave a role opens for nobody (the server refuses to start with one)
            log.error("web.undeclared_route", method=request.method, path=resource.canonical)
            raise web.HTTPForbidden(text="this route has no declared role", content_type="text/plain")
        if door.access is Access.API_TOKEN:
            self.api_caller(request)
        elif door.access is not Access.ANONYMOUS:
            await self._session(request, door)
        return await handler(request)

    async def _session(self, request: web.Request, door: Door) -> Session:
        if request.method not in ("GET", "HEAD"):
            self.auth.check_origin(request)
        session = await self.auth.session(request)
        if session is None:
            raise _login_required(door.refusal, request)
        if door.access is Access.PERSON and not session.proven:
            log.warning("web.token_refused", login=session.login, path=request.path)
            raise reader_refused(session)
        if door.access is Access.OPERATOR and not session.is_operator:
            log.warning("web.reader_refused", login=session.login, path=request.path)
            raise reader_refused(session)
        return session


# words, not a secret
SHARED_READS_ONLY = (
    "a shared token reads only: sign in with a passkey to decide or steer (kazma people invite <you> prints an "
    "enrolment link)"
)


def reader_refused(session: Session) -> web.HTTPForbidden:
    if not session.proven:
        said = f"{OPERATORS_ONLY}: {session.actor} is a reader ({SHARED_READS_ONLY})"
    else:
        said = f"{OPERATORS_ONLY}: {session.who} is a reader"
    return web.HTTPForbidden(text=message_page("Refused", said, viewer=session), content_type="text/html")


def _login_required(refusal: Refusal, request: web.Request) -> web.HTTPException:
    if refusal is Refusal.PAGE:
        # the page asked for comes back after signing in (a card's "Full call" link lands on its approval)
        return web.HTTPFound(login_href(request.path_qs))
    if refusal is Refusal.JSON:
        return web.HTTPUnauthorized(text=json.dumps({"error": "login required"}), content_type="application/json")
    return web.HTTPUnauthorized(
        text=message_page("Login required", "Your session has ended; log in again.", link=("/login", "Log in")),
        content_type="text/html",
    )
