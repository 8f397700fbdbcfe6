"""Who may use the web console: proven people, shared tokens, sessions, roles and CSRF.

A *person* signs in with a passkey (:mod:`~kazma.bot.console.signin`), or is proven by a platform that signs
who opened the page (a Telegram Mini App's ``initData``, :mod:`~kazma.bot.console.miniapp`); their session
names the person and the identity the proof established (``web:alice``, ``telegram:111``), and only such a
session can decide an approval or steer anything. What it may do follows ``people:`` and the roster, read
again at every request: an operator on the identity's own platform steers, anyone proven may press Approve
or Deny, which the approvals service still checks against ``approvals.approvers``.

Two shared secrets remain: the operator token and the reader token. Either opens a *read-only* session under
a name its holder types (a label, proving nothing): dashboards, and — with the operator token, while nobody
has a passkey yet — enrolling the first account. A shared token never decides.

Which role each route needs is declared and enforced in
:mod:`~kazma.bot.console.doors`; this module makes and finds the sessions it checks.
Wrong tokens are slowed by :mod:`~kazma.bot.console.login_throttle`, per client as
:mod:`~kazma.bot.console.forwarded` finds it behind ``web.trusted_proxies``.

Sessions live in the store (:mod:`~kazma.bot.console.sessions`), so a restart
logs nobody out and any replica serves a logged-in user: the cookie holds a
random session token and nothing else, the store only its SHA-256. Every POST
made with a session must carry that session's CSRF token (form field ``csrf``
or header ``X-CSRF-Token``), derived from the session token and never stored.

The login POST has no session yet, so it is protected twice: the session cookie
is ``SameSite=Strict`` (a cross-site page cannot ride on it anyway), and the
login form uses a double-submit pair — ``GET /login`` sets a random
``kazma_login_csrf`` cookie (``__Host-kazma_login_csrf`` over https) and puts
the same value in a hidden field, and the POST must present both, equal. A
cross-site form can send the field but cannot read or set our cookie (the
prefix keeps a sibling host from setting one for the whole domain), so it
cannot log a victim into the attacker's session (login CSRF).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlencode

import structlog
from aiohttp import StreamReader, web

from kazma.adapters.kit import read_up_to
from kazma.bot.console.challenge_share import REFUSED
from kazma.bot.console.forwarded import ClientAddresses
from kazma.bot.console.hosts import Hosts, logged_path
from kazma.bot.console.login_throttle import LOGINS, LoginThrottle
from kazma.bot.console.pages import SignInChoices, login_page, message_page
from kazma.bot.console.sessions import Opening, SessionStore, StoredSession
from kazma.config.address import Actor
from kazma.config.identity import Roster, platform_of
from kazma.config.metrics import count_failure
from kazma.config.models import DEFAULT_POLICY, KazmaConfig

log = structlog.get_logger("kazma.web.auth")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SESSION_COOKIE = "kazma_session"  # over plain http (localhost): browsers refuse a __Host- cookie there
# Over https: the __Host- prefix makes a browser take the cookie only Secure, for Path=/ and with no Domain,
# so a sibling host (or a plain-http page on this name) cannot plant or replace a session in its place.
SECURE_SESSION_COOKIE = "__Host-kazma_session"
LOGIN_CSRF_COOKIE = "kazma_login_csrf"
CSRF_HEADER = "X-CSRF-Token"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 1000  # per opener (one shared token, one proven identity): nobody pushes out another's
NAME = re.compile(r"[a-z0-9_.-]{1,32}")
CSRF_REFUSED = "missing or wrong CSRF token"
ORIGIN_REFUSED = "this form was sent from another site"
OPERATORS_ONLY = "operators only"
MIN_TOKEN_LENGTH = 32
TOKEN_RECHECK = 1.0  # seconds between looks at the token files, to end sessions of a rotated token
SEEN_EVERY = 60.0  # a session's last-seen time is written at most this often: not one write per request
_MAX_COOKIE = 128  # a session token is 43 characters; anything much longer is not one of ours


class Role(StrEnum):
    OPERATOR = "operator"
    READER = "reader"


class Proof(StrEnum):
    """How a session was opened: what proved who is behind it."""

    OPERATOR_TOKEN = "operator-token"  # noqa: S105 - a kind of proof: read only; may enrol the first account
    READER_TOKEN = "reader-token"  # noqa: S105 - a kind of proof: read only
    PASSKEY = "passkey"  # a person's passkey, user verified: web:<login>
    TELEGRAM = "telegram"  # a Telegram Mini App's initData, signed with the bot token: telegram:<user id>
    SLACK = "slack"  # Sign in with Slack (OpenID Connect): slack:<user id>
    DISCORD = "discord"  # Discord OAuth2: discord:<user id>
    LOCAL = "local"  # kazma demo's local-only identity: a one-time link printed to its own terminal

    @property
    def proves_a_person(self) -> bool:
        return self not in (Proof.OPERATOR_TOKEN, Proof.READER_TOKEN)

    @property
    def said(self) -> str:
        """How people read it next to a name."""
        return _PROOF_SAID[self]


_PROOF_SAID = {
    Proof.OPERATOR_TOKEN: "the shared operator token: reads only",
    Proof.READER_TOKEN: "the shared reader token: reads only",
    Proof.PASSKEY: "passkey",
    Proof.TELEGRAM: "proven by Telegram",
    Proof.SLACK: "signed in with Slack",
    Proof.DISCORD: "signed in with Discord",
    Proof.LOCAL: "kazma demo's local identity, not a proof",
}


@dataclass
class Session:
    id: str  # the cookie's session token: held for this request only, never stored
    login: str  # a console login (web:<login>); for a platform's proof, the identity; for a token, a label
    role: Role
    csrf: str
    expires: float  # epoch seconds
    flash: list[str]
    kept_flash: tuple[str, ...] = ()  # the lines the store holds: only a change is written back
    proof: Proof = Proof.READER_TOKEN
    person: str | None = None  # the person under people: (None: a token's session, or nobody's identity)
    identity: str | None = None  # what the proof established: web:alice, telegram:111 (None: a token)
    credential_id: str | None = None  # the passkey that opened it
    # The policies it may decide under, proven, on the identity's own platform (read per request).
    deciding: frozenset[str] = frozenset()

    @property
    def may_decide(self) -> bool:
        """An approver under some policy: Approve and Deny count somewhere."""
        return bool(self.deciding)

    def may_decide_under(self, policy: str | None) -> bool:
        """Whether this session's Approve and Deny count under ``policy`` (None: the default policy), as the
        service will judge them: a policy's own ``approvers`` replace approvals.approvers for its calls."""
        return (policy or DEFAULT_POLICY) in self.deciding

    @property
    def is_operator(self) -> bool:
        return self.role is Role.OPERATOR

    @property
    def proven(self) -> bool:
        """A person proved who they are (never a shared token)."""
        return self.proof.proves_a_person and self.identity is not None

    @property
    def actor(self) -> str:
        """The identity this session acts as: what its proof established; a token's label otherwise."""
        return self.identity if self.identity is not None else str(Actor("web", self.login))

    @property
    def platform(self) -> str:
        """Where the identity was proven: ``web`` for a passkey, ``telegram`` for a Mini App, …"""
        return platform_of(self.actor)

    @property
    def who(self) -> str:
        """For the page's header: ``alice (web:alice, passkey)``, or ``web:rita (the shared reader token…)``."""
        if self.person is not None:
            return f"{self.person} ({self.actor}, {self.proof.said})"
        return f"{self.actor} ({self.proof.said})"

    def take_flash(self) -> list[str]:
        lines, self.flash = self.flash, []
        return lines


# The session the current request was served with, for the flash middleware: set per request (each runs
# in its own task, so its own context). aiohttp's typed request keys need a newer aiohttp than we require.
_SERVED: ContextVar[list[Session] | None] = ContextVar("kazma_served_session", default=None)


@dataclass(frozen=True)
class Tokens:
    operator: str
    reader: str
    generated: tuple[str, ...]  # which of them were made just now ("operator", "reader")


def reader_token_path(token_path: Path) -> Path:
    return token_path.with_name(token_path.name + ".reader")


def _read_or_create(path: Path) -> tuple[str, bool]:
    """The token stored at ``path``, or a new one written there (0600). True when new."""
    try:
        # tighten a file someone loosened: it is a password
        if path.stat().st_mode & 0o077:
            log.warning("web.token_file_permissions_tightened", path=str(path))
            path.chmod(0o600)
        value = path.read_text(encoding="utf-8").strip()
        if value:
            return value, False
        path.unlink()  # an empty file would be a login with an empty token: replace it
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(24)
    # O_EXCL with the mode at creation: the secret is never readable by others, not even briefly
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(value + "\n")
    return value, True


def load_tokens(token_path: Path, *, operator_token: str | None = None, reader_token: str | None = None) -> Tokens:
    """Tokens given by the caller win; otherwise they are read from, or created at, ``token_path`` (+ ``.reader``)."""
    generated: list[str] = []
    if operator_token:
        operator = operator_token
    else:
        operator, new = _read_or_create(token_path)
        if new:
            generated.append("operator")
    if reader_token:
        reader = reader_token
    else:
        reader, new = _read_or_create(reader_token_path(token_path))
        if new:
            generated.append("reader")
    for role, value in (("operator", operator), ("reader", reader)):
        if len(value) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"the {role} token is {len(value)} characters; at least {MIN_TOKEN_LENGTH} are required "
                "(a generated one has 32: delete the token file, or set a longer KAZMA_WEB_TOKEN)"
            )
    if hmac.compare_digest(operator.encode(), reader.encode()):
        raise ValueError("the operator and reader tokens must differ")
    return Tokens(operator, reader, tuple(generated))


def client_bytes(text: str) -> bytes:
    """What a client sent where a token is expected, as bytes to hash or compare. A header's bytes that are no
    UTF-8 (aiohttp keeps them as surrogates) and a JSON string's lone surrogates become bytes no token of ours
    holds: a refusal like any wrong token, not a 500 on every page for a cookie a sibling host planted."""
    return text.encode("utf-8", "surrogatepass")


async def read_body(stream: StreamReader, limit: int) -> bytes | None:
    """The whole of a request's body ``stream``, or None when it is longer than ``limit`` bytes. The stream's
    ``read(n)`` gives what has arrived so far (up to n), not n bytes: a body that came in two TCP segments was
    cut at the first, and a passkey's answer was refused as "not JSON"."""
    body = await read_up_to(stream, limit + 1)
    return None if len(body) > limit else body


def token_digest(token: str) -> str:
    return hashlib.sha256(client_bytes(token)).hexdigest()


def session_hash(session_token: str) -> str:
    """What the store keeps of a session token: its SHA-256 (the token is 256 random bits; no salt needed)."""
    return token_digest(session_token)


def session_csrf(session_token: str) -> str:
    """The session's CSRF token, derived from the session token, so that it need not be stored."""
    return hmac.new(session_token.encode("utf-8"), b"kazma csrf", hashlib.sha256).hexdigest()


def session_binding(session_token: str, console_token_digest: str) -> str:
    """Ties a session to the console token it was opened with (a rotated token ends it). Keyed by the
    session token, so the store holds nothing a stolen copy could test console-token guesses against."""
    return hmac.new(session_token.encode("utf-8"), console_token_digest.encode("ascii"), hashlib.sha256).hexdigest()


def _proof_digest(proof: Proof, identity: str) -> str:
    """What a proven session is bound to (in place of a console token's digest): its proof and identity."""
    return hashlib.sha256(f"{proof.value}\n{identity}".encode()).hexdigest()


def same_token(a: str, b: str) -> bool:
    """Whether two tokens are equal, in constant time, whatever bytes the client sent."""
    return hmac.compare_digest(client_bytes(a), client_bytes(b))


def safe_next(value: str | None, default: str) -> str:
    """A local path to go back to after a POST; anything else (another site, a scheme) falls back to ``default``.

    The pages send ``Referrer-Policy: no-referrer``, so forms say where they came from in a field instead.
    """
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return default
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        return default
    return value


def login_href(next_path: str | None) -> str:
    """The sign-in page, saying where to go once signed in (nothing when that is the console itself)."""
    back = safe_next(next_path, "/")
    if back == "/" or back.startswith("/login"):
        return "/login"
    return f"/login?{urlencode({'next': back})}"


def html_response(body: str, *, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


def deciding_policies(config: KazmaConfig) -> dict[str, tuple[str, ...]]:
    """Every policy a request may be decided under ("default" among them) and its approvers: what a session's
    Approve and Deny are judged by, as the approvals service judges them."""
    return {name: tuple(found.approvers) for name in config.policy_names if (found := config.policy(name)) is not None}


def console_proves(config: KazmaConfig) -> frozenset[str]:
    """The platforms whose identities a person can prove at the console, and so press Approve or Deny there as
    (see :meth:`WebAuth._grant`): ``web`` by a passkey; ``slack`` and ``discord`` with their sign-in on
    (``platforms.<name>.sign_in``); ``telegram`` through the Mini App, which the bot's token verifies and
    Telegram opens only over https (a card's button, while its polling may be down)."""
    platforms = config.platforms
    proves = {"web"}
    if platforms.slack.sign_in.on:
        proves.add("slack")
    if platforms.discord.sign_in.on:
        proves.add("discord")
    if platforms.telegram.token and config.web.public_url.startswith("https://"):
        proves.add("telegram")
    return frozenset(proves)


class WebAuth:
    def __init__(
        self,
        tokens: Tokens,
        *,
        store: SessionStore,
        secure: bool,
        roster: Roster,
        clock: Callable[[], float] = time.monotonic,
        reload: Callable[[], Tokens] | None = None,
        origins: tuple[str, ...] = (),
        clients: ClientAddresses | None = None,
        policies: Mapping[str, Sequence[str]] | None = None,
        hosts: Hosts | None = None,
    ) -> None:
        self.tokens = tokens
        self.roster = roster  # what a proven person may do here, read at every request
        # policy name -> its approvers (empty: approvals.approvers), "default" among them
        self.policies: Mapping[str, Sequence[str]] = policies if policies is not None else {DEFAULT_POLICY: ()}
        self.choices = SignInChoices()  # how people can sign in here (the server says, once it knows)
        self.secure = secure
        self.clock = clock
        self.store = store
        self.throttle = LoginThrottle(clock=clock)
        self.clients = clients or ClientAddresses()  # who is asking, behind web.trusted_proxies
        self._reload = reload  # re-reads the token files, so a rotated token ends the sessions made with it
        self._checked = clock()
        self.origins = origins  # the console's own origins (its public URL); a POST from elsewhere is refused
        self.hosts = hosts  # the names the console answers to: only their origins count as the request's own
        # one name for signing in, out and every read of the cookie
        self.session_cookie = SECURE_SESSION_COOKIE if secure else SESSION_COOKIE

    def _current_digest(self, role: Role) -> str:
        if self._reload is not None and self.clock() - self._checked >= TOKEN_RECHECK:
            self._checked = self.clock()
            try:
                self.tokens = self._reload()
            except (OSError, ValueError) as exc:
                log.warning("web.token_reload_failed", error=str(exc))
        return token_digest(self.tokens.operator if role is Role.OPERATOR else self.tokens.reader)

    # -- tokens and sessions ---------------------------------------------------------------------

    def _check(self, token: object) -> Role | None:
        return self.role_for(token) if isinstance(token, str) and token else None

    def role_for(self, token: str) -> Role | None:
        # both compared every time, so the answer's timing says nothing about which one was close
        operator = same_token(token, self.tokens.operator)
        reader = same_token(token, self.tokens.reader)
        if operator:
            return Role.OPERATOR
        return Role.READER if reader else None

    async def open_session(self, login: str, role: Role) -> Session:
        """A shared token's session: read only, whichever token (the role says which token opened it)."""
        proof = Proof.OPERATOR_TOKEN if role is Role.OPERATOR else Proof.READER_TOKEN
        sid = secrets.token_urlsafe(32)
        expires = await self.store.open(
            session_hash(sid),
            Opening(login=login, role=role.value, proof=proof.value),
            binding=session_binding(sid, self._current_digest(role)),
            lifetime=SESSION_SECONDS,
            max_sessions=MAX_SESSIONS,
        )
        return Session(
            id=sid, login=login, role=Role.READER, csrf=session_csrf(sid), expires=expires, flash=[], proof=proof
        )

    async def open_person_session(
        self,
        proof: Proof,
        identity: str,
        *,
        lifetime: float = SESSION_SECONDS,
        credential_id: str | None = None,
    ) -> Session:
        """A session for a person proven by ``proof`` as ``identity`` (``web:alice``, ``telegram:111``)."""
        sid = secrets.token_urlsafe(32)
        person = self.roster.person_of(identity)
        login = Actor.parse(identity).user if platform_of(identity) == "web" else identity
        session = Session(
            id=sid, login=login, role=Role.READER, csrf=session_csrf(sid), expires=0.0, flash=[], proof=proof,
            person=person, identity=identity, credential_id=credential_id,
        )  # fmt: skip
        self._grant(session)
        session.expires = await self.store.open(
            session_hash(sid),
            Opening(
                login=login, role=session.role.value, proof=proof.value, person=person, identity=identity,
                credential_id=credential_id,
            ),
            binding=session_binding(sid, _proof_digest(proof, identity)),
            lifetime=lifetime,
            max_sessions=MAX_SESSIONS,
        )  # fmt: skip
        return session

    def knows(self, identity: str) -> bool:
        """Whether ``identity`` is somebody this Kazma knows: a person's under ``people:``, an operator on its
        platform, or an approver under some policy there. A platform's proof of anyone else (any Telegram user
        can open a Mini App, anyone can sign in with Slack) opens no session: it would read the whole console."""
        platform = platform_of(identity)
        return (
            self.roster.person_of(identity) is not None
            or self.roster.is_operator(identity, platform)
            or any(self.roster.may_decide(identity, platform, approvers) for approvers in self.policies.values())
        )

    def _grant(self, session: Session) -> None:
        """What a proven session may do, from the roster as it is now: steer (an operator on the identity's
        own platform, signed in at the console itself) and press Approve or Deny (an approver there)."""
        if not session.proven or session.identity is None:
            session.role, session.deciding = Role.READER, frozenset()
            return
        platform = platform_of(session.identity)
        steers = session.proof in (Proof.PASSKEY, Proof.LOCAL) and self.roster.is_operator(session.identity, platform)
        session.role = Role.OPERATOR if steers else Role.READER
        identity = session.identity
        session.deciding = frozenset(
            name for name, approvers in self.policies.items() if self.roster.may_decide(identity, platform, approvers)
        )

    def cookie(self, name: str) -> str:
        """The name a short-lived sign-in cookie (a ceremony's, a platform sign-in's, the login form's) has here:
        over https with the ``__Host-`` prefix, as the session's, so that a sibling host cannot plant its own in a
        browser (its ceremony's handle: the way back from Slack with the attacker's code would sign the victim in
        as the attacker); the plain name opens nothing then."""
        return f"__Host-{name}" if self.secure else name

    def set_sign_in_cookie(
        self, response: web.StreamResponse, name: str, value: str, *, samesite: str, max_age: int
    ) -> None:
        """Set :meth:`cookie` ``name``: HttpOnly, ``Path=/`` and no ``Domain`` (a ``__Host-`` cookie must be)."""
        response.set_cookie(
            self.cookie(name), value, httponly=True, samesite=samesite, path="/", secure=self.secure, max_age=max_age
        )

    def drop_sign_in_cookie(self, response: web.StreamResponse, name: str) -> None:
        # Secure and Path=/ as it was set: a browser ignores a __Host- cookie's deletion without them
        response.del_cookie(self.cookie(name), path="/", secure=self.secure)

    def set_cookie(self, response: web.StreamResponse, session: Session) -> None:
        response.set_cookie(
            self.session_cookie,
            session.id,
            httponly=True,
            samesite="Strict",
            path="/",
            secure=self.secure,
            max_age=max(int(session.expires - time.time()), 1),
        )

    async def end_previous(self, request: web.Request) -> None:
        """A fresh session token at every sign-in: the one the browser held (if any) ends (no session fixation)."""
        previous = request.cookies.get(self.session_cookie)
        if previous and len(previous) <= _MAX_COOKIE:
            await self.store.end(session_hash(previous))

    async def session(self, request: web.Request) -> Session | None:
        """The request's live session, or None: unknown, forged, expired (deleted now) or of a rotated token."""
        served = _SERVED.get()
        if served:
            return served[0]
        sid = request.cookies.get(self.session_cookie)
        if not sid or len(sid) > _MAX_COOKIE:
            return None
        key = session_hash(sid)
        stored = await self.store.find(key)
        if stored is None:
            return None
        try:
            role = Role(stored.role)
            proof = Proof(stored.proof or "")
        except ValueError:
            # made before people signed in (no proof): only a shared token made it, and it may have been an
            # operator's that decided; it ends rather than keep a power tokens no longer have
            await self.store.end(key)
            log.info("web.session_ended", login=stored.login, reason="made before people signed in")
            return None
        if not self._bound(sid, proof, role, stored):
            await self.store.end(key)
            log.info("web.session_ended", login=stored.login, reason="token rotated")
            return None
        gone = self._no_longer_known(proof, stored)
        if gone is not None:
            await self.store.end(key)
            log.info("web.session_ended", login=stored.login, reason=gone)
            return None
        if self.store.clock() - stored.last_seen >= SEEN_EVERY:
            await self.store.seen(key)
        session = Session(
            id=sid,
            login=stored.login,
            role=Role.READER,
            csrf=session_csrf(sid),
            expires=stored.expires_at,
            flash=list(stored.flash),
            kept_flash=stored.flash,
            proof=proof,
            person=stored.person,
            identity=stored.identity,
            credential_id=stored.credential_id,
        )
        if session.proven:
            # who the identity belongs to and what it may do follow the configuration the process runs with
            session.person = self.roster.person_of(session.actor)
            self._grant(session)
        if served is not None:
            served.append(session)
        return session

    async def still_open(self, session: Session) -> bool:
        """Whether ``session`` is still live: not ended (signed out, its passkey revoked, replaced), not expired,
        its token not rotated. A response that lasts (the event stream) asks again before it sends more."""
        stored = await self.store.find(session_hash(session.id))
        if stored is None:
            return False
        try:
            role = Role(stored.role)
        except ValueError:
            return False
        return (
            self._bound(session.id, session.proof, role, stored)
            and self._no_longer_known(session.proof, stored) is None
        )

    def _no_longer_known(self, proof: Proof, stored: StoredSession) -> str | None:
        """Why a person's session no longer stands under the configuration running now, or None: its identity
        is nobody Kazma knows any longer (taken out of people: and the approvers), or the person a passkey
        proved no longer holds that web identity. Sign-in refuses both; a session opened before stops too."""
        if not proof.proves_a_person or stored.identity is None:
            return None
        if not self.knows(stored.identity):
            return "nobody this Kazma knows any longer"
        if proof is Proof.PASSKEY and self.roster.person_of(stored.identity) != stored.person:
            return "the passkey's person no longer holds this identity"
        return None

    def _bound(self, sid: str, proof: Proof, role: Role, stored: StoredSession) -> bool:
        """Whether the stored session is still bound to what made it: the person's proof, or the shared token
        as it is now (a rotated token ends the sessions made with it)."""
        bound = _proof_digest(proof, stored.identity or "") if proof.proves_a_person else self._current_digest(role)
        return same_token(stored.binding, session_binding(sid, bound))

    @web.middleware
    async def keep_flash(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """After each request, write back the session's flash lines if the handler changed them, so the
        next page shows them whichever replica serves it."""
        served: list[Session] = []
        reset = _SERVED.set(served)
        try:
            return await handler(request)
        finally:
            _SERVED.reset(reset)
            session = served[0] if served else None
            if session is not None and tuple(session.flash) != session.kept_flash:
                try:
                    await self.store.keep_flash(session_hash(session.id), session.flash)
                except Exception as exc:  # the answer matters more than a message for the next page
                    count_failure("web_session")
                    log.warning("web.flash_not_kept", login=session.login, error=f"{type(exc).__name__}: {exc}")

    def challenge_client(self, request: web.Request) -> str:
        """Who asks for an anonymous sign-in challenge, for its share (see :mod:`.challenge_share`)."""
        return self.clients.of(request).throttle_key

    def challenge_refused(self, request: web.Request, purpose: str, wait: float) -> int:
        """The request's client holds its share of ``purpose`` challenges: counted and logged; the whole seconds
        it is told to wait."""
        client = self.clients.of(request)
        seconds = int(wait) + 1
        REFUSED.labels(purpose=purpose).inc()
        log.warning("web.challenge_refused", purpose=purpose, remote=client.address, peer=client.peer, wait=seconds)
        return seconds

    def check_origin(self, request: web.Request) -> None:
        """A state-changing request must come from the console itself, when the browser says where it comes from.

        Browsers say so in ``Sec-Fetch-Site`` whatever the referrer policy; with ``Referrer-Policy:
        no-referrer`` (ours) they send ``Origin: null`` even for the console's own forms.
        """
        site = request.headers.get("Sec-Fetch-Site")
        origin = request.headers.get("Origin")
        # the request's own origin is built from its Host: a rebound name's page would vouch for itself
        own = set(self.origins)
        if self.hosts is None or self.hosts.ours(request.headers.get("Host")):
            own.add(str(request.url.origin()))
        if site is not None and site not in ("same-origin", "none"):
            refused = f"{origin or ''} ({site})".strip()
        elif origin is None or origin == "null" or origin in own:
            return  # the browser vouches for it, or did not say: the CSRF token still has to match
        else:
            refused = origin
        log.warning("web.origin_refused", origin=refused[:200], expected=sorted(own), path=logged_path(request.path))
        raise web.HTTPForbidden(text=message_page("Refused", ORIGIN_REFUSED), content_type="text/html")

    # -- what the door let in ----------------------------------------------------------------------

    def current(self) -> Session:
        """The session the door (:mod:`~kazma.bot.console.doors`) found for this request.

        Raises RuntimeError when there is none: a handler that needs a session behind a door that does not
        ask for one is a programming error, answered 500, never served as somebody.
        """
        served = _SERVED.get()
        if not served:
            raise RuntimeError("no console session was checked at the door for this request")
        return served[0]

    async def form(self, request: web.Request) -> tuple[Session, dict[str, str]]:
        """The door's session and the form's fields, once the session's CSRF token matches.

        Raises before anything is read into the application, so a refused request changes nothing.
        """
        session = self.current()
        data = await request.post()
        fields: dict[str, str] = {}
        for key, value in data.items():
            if isinstance(value, str):  # uploads are never expected; they are ignored
                fields.setdefault(key, value)
        supplied = request.headers.get(CSRF_HEADER) or fields.get("csrf") or ""
        if not supplied or not same_token(supplied, session.csrf):
            log.warning("web.csrf_refused", login=session.login, path=request.path)
            raise web.HTTPForbidden(
                text=message_page("Refused", CSRF_REFUSED, viewer=session), content_type="text/html"
            )
        return session, fields

    # -- routes ----------------------------------------------------------------------------------

    async def login_form(self, request: web.Request) -> web.Response:
        value = secrets.token_urlsafe(24)
        back = safe_next(request.query.get("next"), "/")
        response = html_response(login_page(value, choices=self.choices, next_path=back))
        self.set_sign_in_cookie(response, LOGIN_CSRF_COOKIE, value, samesite="Strict", max_age=3600)
        return response

    async def login(self, request: web.Request) -> web.Response:
        """Sign in. Every attempt's token is checked; only wrong ones are slowed (see :mod:`.login_throttle`)."""
        self.check_origin(request)
        client = self.clients.of(request)
        data = await request.post()
        field = data.get("csrf")
        cookie = request.cookies.get(self.cookie(LOGIN_CSRF_COOKIE), "")
        if not isinstance(field, str) or not field or not cookie or not same_token(field, cookie):
            raise web.HTTPForbidden(
                text=message_page("Refused", CSRF_REFUSED, link=("/login", "Log in")), content_type="text/html"
            )
        raw_name = data.get("name")
        name = raw_name.strip().lower() if isinstance(raw_name, str) else ""
        raw_next = data.get("next")
        back = safe_next(raw_next if isinstance(raw_next, str) else None, "/")
        token = data.get("token")
        if not NAME.fullmatch(name):
            return html_response(
                login_page(
                    field,
                    error="The name must be 1–32 of a–z, 0–9, '_', '.', '-'.",
                    choices=self.choices,
                    next_path=back,
                ),
                status=400,
            )
        key = client.throttle_key
        if self.throttle.slowed(key):
            async with self.throttle.turn(key):
                role = self._check(token)
                if role is None:
                    hold = self.throttle.failed(key)
                    LOGINS.labels(outcome="held" if hold > 0 else "wrong").inc()
                    log.warning(
                        "web.login_refused", login=name, remote=client.address, peer=client.peer, held=hold, slowed=True
                    )
                    await self.throttle.pause(hold)  # this client's next attempt waits meanwhile
                    wait = int(self.throttle.retry_after(key)) + 1
                    raise web.HTTPTooManyRequests(
                        text=message_page(
                            "Too many attempts",
                            f"Too many wrong logins from here: each wrong token is now answered slowly, for {wait} s "
                            "more. The right token is still accepted.",
                            link=("/login", "Log in"),
                        ),
                        content_type="text/html",
                        headers={"Retry-After": str(wait)},
                    )
            log.info("web.login_while_slowed", login=name, remote=client.address)
        else:
            role = self._check(token)
            if role is None:
                self.throttle.failed(key)
                LOGINS.labels(outcome="wrong").inc()
                log.warning("web.login_refused", login=name, remote=client.address, peer=client.peer, slowed=False)
                return html_response(
                    login_page(field, error="wrong token", name=name, choices=self.choices, next_path=back),
                    status=401,
                )
        await self.end_previous(request)
        session = await self.open_session(name, role)
        LOGINS.labels(outcome="accepted").inc()
        log.info("web.login", login=name, token=role.value, proof=session.proof.value)
        response = web.HTTPSeeOther(back)
        self.set_cookie(response, session)
        self.drop_sign_in_cookie(response, LOGIN_CSRF_COOKIE)
        raise response

    async def logout(self, request: web.Request) -> web.Response:
        session, _ = await self.form(request)
        await self.store.end(session_hash(session.id))
        log.info("web.logout", login=session.login)
        response = web.HTTPSeeOther("/login")
        response.del_cookie(self.session_cookie, path="/", secure=self.secure)  # Secure, or __Host- is kept
        raise response
