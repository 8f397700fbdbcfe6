"""The web console server: the conversation, approval pages, the swarm dashboard, live events and metrics.

It is a thin HTTP face over what the rest of Kazma already does. Messages go
in through :meth:`WebAdapter.say`, decisions through
:meth:`ApprovalService.decide` (the same compare-and-set every platform uses),
swarm work through the same ``/swarm`` grammar and rules as chat commands.

``/metrics`` and ``/healthz`` need no login: they carry counts and no secrets
(no arguments, ids or names), and a Prometheus scraper has no session. Put the
console behind a proxy that restricts ``/metrics`` if even counts are private.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest
from yarl import URL

from kazma.adapters.admission import FileBounds
from kazma.adapters.contract import Attachment, PlatformError
from kazma.adapters.web import CONSOLE, WebAdapter
from kazma.approvals.model import Decision
from kazma.approvals.store import UnreadableRequest
from kazma.approvals.waiting import WaitingForYou, WaitingList
from kazma.bot.console.accounts import AccountStore
from kazma.bot.console.api import ApprovalsApi, caller_of
from kazma.bot.console.api import register as register_api
from kazma.bot.console.auth import (
    OPERATORS_ONLY,
    Proof,
    Session,
    Tokens,
    WebAuth,
    deciding_policies,
    html_response,
    load_tokens,
    reader_token_path,
    safe_next,
)
from kazma.bot.console.dashboard_data import DashboardData, DashboardQueries, press_latencies
from kazma.bot.console.doors import Doors, add_routes, reader_refused, undeclared
from kazma.bot.console.feed import ChangeFeed
from kazma.bot.console.forwarded import ClientAddresses
from kazma.bot.console.hosts import Hosts
from kazma.bot.console.mcp_door import MCPDoor
from kazma.bot.console.miniapp import TelegramApp
from kazma.bot.console.pages import (
    MAX_TEXT,
    SignInChoices,
    approval_card_item,
    approval_href,
    approval_page,
    console_page,
    conversations_page,
    dashboard_html,
    dashboard_page,
    entry_html,
    message_html,
    message_page,
)
from kazma.bot.console.platform_signin import PlatformSignIn
from kazma.bot.console.services import ConsoleServices, SwarmCommand
from kazma.bot.console.sessions import SessionStore
from kazma.bot.console.signin import LocalLogin, SignIn
from kazma.bot.console.signin_pages import bootstrap_form
from kazma.bot.console.static import CONSOLE_JS
from kazma.bot.console.step_up import StepUp
from kazma.bot.console.upload import UploadRefused, read_upload
from kazma.bot.console.waiting_page import NOBODY, waiting_page
from kazma.config.address import Address
from kazma.config.metrics import PRESS_TO_DECISION, count_failure, with_label
from kazma.config.models import DEFAULT_POLICY
from kazma.config.store.errors import store_errors
from kazma.engine.swarm.limits import MAX_COMMAND_BYTES, MAX_PROMPT_BYTES
from kazma.engine.swarm.roles import Role as SwarmRole
from kazma.engine.swarm.roles import required_role
from kazma.engine.swarm.syntax import GrammarError
from kazma.engine.transcript import Working

log = structlog.get_logger("kazma.web")

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
SWARM_TASKS = Gauge("kazma_swarm_tasks", "Swarm tasks in the store, by status (refreshed at scrape).", ["status"])

_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
_TASK_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
TASK_ACTIONS = ("cancel", "retry", "approve", "reject")
_MAX_VERSION_DIGITS = 20  # a dashboard's version is a count of changes: anything longer is no version of ours


def _swarm_too_long(length: int) -> str:
    return (
        f"The command is {length:,} characters; a swarm task may be at most {MAX_PROMPT_BYTES:,} bytes "
        f"({MAX_PROMPT_BYTES // 1024} KiB) of UTF-8: shorten it or point to a file instead."
    )


def _for_readers(text: str) -> bool:
    """What a reader may type: commands answered to them (nothing, which is answered "Nothing to send")."""
    return text in ("", "/swarm", "/plan", "/approvals") or text.startswith("/swarm ")


def _not_found(text: str, session: Session | None = None) -> web.HTTPNotFound:
    return web.HTTPNotFound(text=message_page("Not found", text, viewer=session), content_type="text/html")


# Sent when web.public_url is https://: a browser that has seen the console once never again opens it over
# plain http, where a stripped copy of the sign-in form would take the shared token (the shipped nginx files
# answer no port 80, and say nothing of it). The console's own host only: its siblings are not ours to bind.
HSTS = "max-age=31536000"


def security_headers(*, secure: bool) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """The ``on_response_prepare`` hook that puts :data:`SECURITY_HEADERS` (and HSTS when ``secure``) on every
    response, errors and streams included, before its headers go out."""
    headers = {**SECURITY_HEADERS, **({"Strict-Transport-Security": HSTS} if secure else {})}

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(headers)  # one call: it runs for each of 500 long-polls woken at once
        if not request.path.startswith("/static/"):
            response.headers.setdefault("Cache-Control", "no-store")

    return add


class WebServer:
    BODY_LIMIT = 256 * 1024  # every request body but an upload's (read as a stream, within files:)

    def __init__(
        self,
        services: ConsoleServices,
        web_adapter: WebAdapter,
        *,
        host: str,
        port: int,
        token_path: Path,
        operator_token: str | None = None,
        reader_token: str | None = None,
        heartbeat: float = 15.0,
        shutdown_timeout: float = 2.0,
        dashboard_interval: float = 1.0,
        local_login: LocalLogin | None = None,
    ) -> None:
        self.services = services
        self.local_login = local_login  # kazma demo's one-time local sign-in; None everywhere else
        self.web = web_adapter
        self.host = host
        self.port = port
        self.token_path = token_path
        self.heartbeat = heartbeat
        self.shutdown_timeout = shutdown_timeout
        self._operator_token = operator_token
        self._reader_token = reader_token
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self._generated: Tokens | None = None
        self.auth: WebAuth | None = None
        self.signin: SignIn | None = None
        self.dashboard_interval = dashboard_interval
        self.feed: ChangeFeed[DashboardData] | None = None
        self._unwatch: Callable[[], None] | None = None
        self.application: web.Application | None = None  # the routes served, once started (the tests walk them)
        self.mcp: MCPDoor | None = None  # /mcp, once started
        self.api: ApprovalsApi | None = None  # /api/v1, once started

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The bound address, e.g. ``http://127.0.0.1:54321`` (the real port when 0 was asked for)."""
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("the web server is not started")
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    @property
    def console_url(self) -> str:
        """Where people open the console: the bound address, by name when the public URL names this machine
        (``localhost``), since passkeys are made for a name and never for an address."""
        public = URL(self.services.config.web.public_url)
        bound = URL(self.url)
        if public.host in ("localhost",) and bound.host in ("127.0.0.1", "::1", "localhost"):
            return str(bound.with_host("localhost")).rstrip("/")
        return self.url

    async def start(self) -> None:
        def read_tokens() -> Tokens:
            return load_tokens(self.token_path, operator_token=self._operator_token, reader_token=self._reader_token)

        tokens = read_tokens()
        config = self.services.config
        public_url = str(config.web.public_url)
        hosts = Hosts(public_url, bind=config.web.host, allowed=config.web.allowed_hosts)
        self.auth = WebAuth(
            tokens,
            store=SessionStore(self.services.store),
            secure=public_url.startswith("https://"),
            reload=read_tokens,
            origins=(str(URL(public_url).origin()),),
            hosts=hosts,
            clients=ClientAddresses(config.web.trusted_proxies),
            roster=config.roster,
            policies=deciding_policies(config),
        )
        auth = self.auth
        signin = SignIn(auth, AccountStore(self.services.store), config, local=self.local_login)
        self.signin = signin
        platforms = PlatformSignIn(auth, signin.accounts, config, signin.rp)
        auth.choices = SignInChoices(passkey_problem=signin.rp.problem, platforms=platforms.offered())
        telegram = TelegramApp(auth, config)
        step_up = StepUp(auth, signin.accounts, signin.rp, self.services.approvals)
        doors = Doors(auth, lambda request: caller_of(config, request), hosts)
        # keep_flash outside the door: it writes back the flash lines of the session the door found
        application = web.Application(client_max_size=self.BODY_LIMIT, middlewares=[auth.keep_flash, doors.guard])
        application.on_response_prepare.append(security_headers(secure=auth.secure))
        add_routes(
            application,
            {
                ("GET", "/login"): auth.login_form,
                ("POST", "/login"): auth.login,
                ("POST", "/login/passkey/options"): signin.sign_in_options,
                ("POST", "/login/passkey"): signin.sign_in,
                ("GET", "/login/local/{token}"): signin.local_sign_in,
                ("GET", "/login/slack"): platforms.slack_start,
                ("GET", "/login/slack/callback"): platforms.slack_callback,
                ("GET", "/login/discord"): platforms.discord_start,
                ("GET", "/login/discord/callback"): platforms.discord_callback,
                ("GET", "/enrol/{token}"): signin.enrol_page,
                ("POST", "/enrol/{token}/options"): signin.enrol_options,
                ("POST", "/enrol/{token}"): signin.enrol,
                ("POST", "/people/bootstrap"): signin.bootstrap,
                ("GET", "/telegram/app"): telegram.page,
                ("POST", "/telegram/app"): telegram.sign_in,
                ("POST", "/logout"): auth.logout,
                ("GET", "/"): self.console,
                ("POST", "/console/send"): self.send,
                ("POST", "/console/choose"): self.choose,
                ("POST", "/console/upload"): self.upload,
                ("GET", "/events"): self.events,
                ("GET", "/conversations"): self.conversations,
                ("GET", "/conversations/{conversation}"): self.conversations,
                ("GET", "/console/files/{id}"): self.file,
                ("POST", "/approvals/{id}/decide"): self.decide,
                ("POST", "/approvals/{id}/step-up/options"): step_up.options,
                ("POST", "/approvals/{id}/step-up"): step_up.approve,
                ("GET", "/swarm"): self.swarm,
                ("GET", "/approvals"): self.waiting,
                ("POST", "/swarm/tasks/{id}/{action}"): self.task_action,
                ("POST", "/swarm/command"): self.swarm_command,
                ("POST", "/approvals/rules/{id}/revoke"): self.revoke_rule,
                ("GET", "/metrics"): self.metrics,
                ("GET", "/healthz"): self.healthz,
                ("GET", "/static/console.js"): self.script,
                ("GET", "/static/people.js"): signin.script,
            },
        )
        api = self.api = register_api(application, self.services)  # /api/v1: API tokens, not console logins
        self.mcp = MCPDoor(api)  # /mcp: the same tokens, through the same API; the SDK only when configured
        self.mcp.register(application)
        missing = undeclared(application.router)
        if missing:  # a route with no role would be guarded by nobody: refuse to serve at all
            raise RuntimeError(f"routes without a declared role in bot/console/doors.py: {', '.join(missing)}")
        self.application = application
        self._closing.clear()
        runner = web.AppRunner(application, shutdown_timeout=self.shutdown_timeout, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._generated = tokens if tokens.generated else None
        self._follow_changes()
        log.info("web.started", url=self.url, tokens_generated=list(tokens.generated))

    def first_start_message(self, *, show_tokens: bool = True) -> str | None:
        """The URL and the tokens made at this start, for the caller to print; None afterwards or if none were made.

        ``show_tokens=False`` names the files instead: the caller's output is not a screen (a log file, the
        journal), and a token written there is a password at rest in a place nobody chose for it.
        """
        tokens, self._generated = self._generated, None
        if tokens is None:
            return None
        reader_path = reader_token_path(self.token_path)
        lines = [f"Kazma web console: {self.console_url}/"]
        if not show_tokens:
            made = [str(self.token_path) if role == "operator" else str(reader_path) for role in tokens.generated]
            lines.append(
                f"  new console tokens were saved to {' and '.join(made)} (mode 0600, this user only); they are not "
                "printed because this output is not a terminal. Read them there, or set KAZMA_WEB_TOKEN."
            )
            return "\n".join(lines)
        if "operator" in tokens.generated:
            lines.append(f"  operator token: {tokens.operator}  (saved to {self.token_path}, mode 0600)")
        if "reader" in tokens.generated:
            lines.append(f"  reader token:   {tokens.reader}  (read-only; saved to {reader_path})")
        lines.append(
            "  These are shown once. They open read-only sessions; a shared token never decides. Sign in with a "
            "passkey to decide: `kazma people invite <you>` prints your enrolment link (or, while nobody has a "
            "passkey, log in with the operator token and enrol the first account)."
        )
        return "\n".join(lines)

    def _follow_changes(self) -> None:
        """One feed for every open dashboard, woken by what this process does (see :mod:`~kazma.bot.console.feed`)."""
        feed = ChangeFeed(self._dashboard_data, min_interval=self.dashboard_interval)
        feed.watch(self.web.subscribe(), lambda event: isinstance(event, dict) and event.get("type") != "working")
        feed.watch(self.services.follow_transcript(), lambda item: not isinstance(item, Working))
        self._unwatch = self.services.watch(feed.touch)
        self.feed = feed

    async def _forget_changes(self) -> None:
        feed, self.feed = self.feed, None
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
        if feed is not None:
            await feed.close()

    async def stop(self) -> None:
        self._closing.set()  # event streams end now rather than waiting out the shutdown timeout
        await self._forget_changes()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            log.info("web.stopped")

    def _auth(self) -> WebAuth:
        if self.auth is None:
            raise RuntimeError("the web server is not started")
        return self.auth

    # -- the console -----------------------------------------------------------------------------

    async def console(self, request: web.Request) -> web.Response:
        session = self._auth().current()
        flash = [*self._cannot_decide(session), *session.take_flash()]
        first = ""
        signin = self.signin
        if session.proof is Proof.OPERATOR_TOKEN and signin is not None and not await signin.accounts.any_enrolled():
            first = bootstrap_form(session, signin.bootstrap_people())
        return html_response(
            console_page(session, self.web.messages(), flash=flash, files=self._file_bounds(), notice_html=first)
        )

    def _file_bounds(self) -> FileBounds:
        files = self.services.config.files
        return FileBounds(max_bytes=files.max_bytes, max_count=files.max_count)

    async def upload(self, request: web.Request) -> web.Response:
        """Files from the console (with an optional message): within ``files:``, then to the agents like any
        platform's attachments; over a bound, the sender is told and nothing is saved."""
        try:
            session, sent = await read_upload(request, self._auth(), self._file_bounds())
        except UploadRefused as exc:
            session = self._auth().current()
            log.info("web.upload_refused", login=session.login, reason=str(exc))
            session.flash.append(str(exc))
            raise web.HTTPSeeOther("/") from None
        if not sent.files:
            session.flash.append("No file was chosen; nothing was sent.")
        elif len(sent.text) > MAX_TEXT:
            session.flash.append(f"The message is {len(sent.text):,} characters; at most {MAX_TEXT:,} are accepted.")
        else:
            log.info("web.upload", login=session.login, files=len(sent.files), size=sum(len(d) for _, d in sent.files))
            await self._to_agents(session, sent.text, attachments=sent.attachments())
        raise web.HTTPSeeOther("/")

    def _cannot_decide(self, session: Session) -> list[str]:
        """A proven person whose presses would all be refused is told so before pressing, with the fix."""
        if not session.proven or session.may_decide:
            return []
        name = session.person or session.actor
        return [
            f"You are {session.who}, not an approver: this console shows you no Approve or Deny. To decide, add "
            f"'{name}' to approvals.approvers in kazma.yaml and restart Kazma."
        ]

    async def send(self, request: web.Request) -> web.Response:
        """The message box. Operators talk to the agents (and answer questions by replying); of what a reader
        types, only ``/swarm`` reads, ``/plan`` and ``/approvals`` are answered — to the reader, never through an
        agent."""
        session, fields = await self._auth().form(request)
        text = fields.get("text", "").strip()
        reply_to = fields.get("reply_to") or None
        if not session.is_operator and (reply_to is not None or not _for_readers(text)):
            log.warning("web.reader_refused", login=session.login, path=request.path, reply=reply_to is not None)
            raise reader_refused(session)
        swarm = text == "/swarm" or text.startswith("/swarm ")
        if not text:
            session.flash.append("Nothing to send.")
        elif swarm and len(text) > MAX_COMMAND_BYTES:
            session.flash.append(_swarm_too_long(len(text)))
        elif swarm:  # a task up to the swarm's own limit: the grammar refuses a longer one, naming the limit
            session.flash.append(await self._swarm_text(session, text.removeprefix("/swarm")))
        elif len(text) > MAX_TEXT:
            session.flash.append(f"The message is {len(text):,} characters; at most {MAX_TEXT:,} are accepted.")
        elif text == "/plan":
            session.flash.append(await self.services.describe_plans(Address("web", CONSOLE).conversation))
        elif text == "/approvals":
            listed = await self._waiting_for(session)
            session.flash.append(NOBODY if listed is None else listed.text())
        else:
            await self._to_agents(session, text, reply_to=reply_to)
        raise web.HTTPSeeOther("/")

    async def _to_agents(
        self, session: Session, text: str, *, reply_to: str | None = None, attachments: tuple[Attachment, ...] = ()
    ) -> None:
        """The one way words from the console reach an agent: an operator's, whatever the route or field."""
        if not session.is_operator:
            log.warning("web.reader_refused", login=session.login, path="agents")
            raise reader_refused(session)
        await self.web.say(
            session.login,
            text,
            chat=CONSOLE,
            reply_to=reply_to,
            # an operator may answer any question in the console, as a platform admin may in a chat
            is_admin=reply_to is not None,
            attachments=attachments,
        )

    async def choose(self, request: web.Request) -> web.Response:
        """A press of a question's choice in the console: the same path as every platform's buttons."""
        session, fields = await self._auth().form(request)
        try:
            choice = int(fields.get("choice", ""))
            result = await self.web.choose(
                fields.get("message", ""), choice, session.login, is_admin=session.is_operator
            )
        except (ValueError, PlatformError):
            raise _not_found("No such choice.", session) from None
        session.flash.append(result.message)
        raise web.HTTPSeeOther("/")

    @staticmethod
    async def _still_open(auth: WebAuth, session: Session) -> bool:
        """Whether the stream's session still holds; a store that cannot say now ends the stream quietly (the
        browser comes back in three seconds, through the door)."""
        try:
            return await auth.still_open(session)
        except store_errors() as exc:
            log.info("web.events_ended", login=session.login, reason=f"the session could not be read: {exc}")
            return False

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events: every console change and every conversation's new messages (from the transcript),
        as one JSON ``data:`` line each, working signs, and a heartbeat comment."""
        auth = self._auth()
        session = auth.current()
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        if request.method == "HEAD":  # the headers say it all; a stream body would be read as the next response
            return response
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=2000)

        async def pump_console() -> None:
            async for event in self.web.subscribe():
                await queue.put(event)
            await queue.put(None)  # the adapter stopped: the stream ends

        async def pump_transcript() -> None:
            async for item in self.services.follow_transcript():
                if isinstance(item, Working):
                    await queue.put({"type": "working", "conversation": item.conversation})
                else:
                    await queue.put({"type": "entry", "conversation": item.conversation, "seq": item.seq,
                                     "html": entry_html(item), "direct": item.direct, "platform": item.platform,
                                     "chat": item.chat})  # fmt: skip

        async def pump_dashboard(feed: ChangeFeed[DashboardData], since: int) -> None:
            async for data in feed.follow(since=since):
                await queue.put({"type": "dashboard", "version": data.version, "html": dashboard_html(session, data)})

        pumps = [asyncio.create_task(pump_console()), asyncio.create_task(pump_transcript())]
        since = request.query.get("dashboard")
        if since is not None and self.feed is not None:
            # a dashboard page: it says which version it shows, so a change it missed is sent at once
            # bounded first: int() of more than 4,300 digits raises, inside a stream already answered 200
            version = int(since) if since.isdecimal() and len(since) <= _MAX_VERSION_DIGITS else -1
            pumps.append(asyncio.create_task(pump_dashboard(self.feed, version)))
        closing = asyncio.create_task(self._closing.wait())
        try:
            # one loop turn lets the subscriptions register, so nothing said after "ready" can be missed
            await asyncio.sleep(0)
            await response.write(b"retry: 3000\n: ready\n\n")
            # What the page may have missed between rendering and connecting (or a reconnect):
            # the current state of every message. Duplicates are harmless, the script keys by id.
            for message in self.web.messages():
                item = {"type": "message", "message": self._event_message(message.id, session)}
                await response.write(f"data: {json.dumps(item, ensure_ascii=False)}\n\n".encode())
            while True:
                getting = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getting, closing}, timeout=self.heartbeat, return_when="FIRST_COMPLETED")
                if getting not in done:
                    getting.cancel()
                    if closing in done:
                        break
                    if not await self._still_open(auth, session):
                        break
                    await response.write(b": heartbeat\n\n")
                    continue
                event = getting.result()
                # The session was checked once, at the door: one ended since (signed out, its passkey revoked,
                # expired, its token rotated) must not go on reading every conversation and every call.
                if event is None or not await self._still_open(auth, session):
                    if event is not None:
                        log.info("web.events_ended", login=session.login, reason="the session ended")
                    break
                inline = None
                if event.get("type") in ("message", "settled"):
                    message_id = str((event.get("message") or {}).get("id", ""))
                    event = {**event, "message": self._event_message(message_id, session)}
                    inline = self._event_approval(message_id, session)
                await response.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
                if inline is not None:  # the same card, placed in the conversation it was asked in
                    await response.write(f"data: {json.dumps(inline, ensure_ascii=False)}\n\n".encode())
        except ConnectionResetError:
            pass  # the browser went away
        finally:
            for task in (*pumps, closing):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await task
        return response

    # -- every conversation ----------------------------------------------------------------------

    async def conversations(self, request: web.Request) -> web.Response:
        session = self._auth().current()
        current = request.match_info.get("conversation")
        summaries = await self.services.conversations()
        entries = await self.services.conversation(current) if current else []
        if current is not None and not entries:
            raise _not_found("No such conversation.", session)
        approvals = await self.services.conversation_approvals(current) if current else []
        return html_response(
            conversations_page(session, summaries, current, entries, approvals=approvals, flash=session.take_flash())
        )

    async def file(self, request: web.Request) -> web.Response:
        """A file an agent posted in the console, as a download (never shown inline)."""
        session = self._auth().current()
        kept = self.web.file(request.match_info["id"])
        if kept is None:
            raise _not_found("No such file (only the newest files are kept, until a restart).", session)
        name, data = kept
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "file"
        return web.Response(
            body=data,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{safe}"',
            },
        )

    def _event_approval(self, message_id: str, session: Session) -> dict[str, Any] | None:
        """An approval card as its conversation's page shows it, for a page open on that conversation."""
        message = self.web.message(message_id)
        if message is None or message.card is None:
            return None
        card = message.card
        html = approval_card_item(card, message.outcome, message.at, session)
        return {"type": "approval", "conversation": card.origin, "request": card.request_id, "html": html}

    def _event_message(self, message_id: str, session: Session) -> dict[str, Any]:
        """A console message as the live view needs it: its data and its HTML, rendered for this viewer."""
        message = self.web.message(message_id)
        if message is None:
            return {"id": message_id}
        return {**message.as_event(), "html": message_html(message, session)}

    # -- approvals -------------------------------------------------------------------------------

    async def decide(self, request: web.Request) -> web.Response:
        session, fields = await self._auth().form(request)
        request_id = request.match_info["id"]
        if not _REQUEST_ID.fullmatch(request_id):
            raise _not_found("No such approval request.", session)
        try:
            decision = Decision(fields.get("decision", ""))
        except ValueError:
            raise web.HTTPBadRequest(
                text=message_page("Bad request", "decision must be approve or deny", viewer=session),
                content_type="text/html",
            ) from None
        if not session.proven:  # the door refuses a token's session first; a decision never rests on a token
            raise web.HTTPForbidden(
                text=message_page("Refused", OPERATORS_ONLY, viewer=session), content_type="text/html"
            )
        with PRESS_TO_DECISION.time():  # a press in the console, timed like every platform's buttons
            # decided as the identity the proof established, on that identity's own platform: a passkey's
            # web:alice via web, a Telegram Mini App's telegram:111 via telegram
            result = await self.services.approvals.decide(
                request_id, decision, actor=session.actor, platform=session.platform,
                reason=fields.get("reason") if decision is Decision.DENY else None,
            )  # fmt: skip
        log.info(
            "web.decide", request_id=request_id, actor=session.actor, person=session.person,
            proof=session.proof.value, verdict=result.verdict.value,
        )  # fmt: skip
        session.flash.append(result.message)
        raise web.HTTPSeeOther(safe_next(fields.get("next"), approval_href(request_id)))

    async def swarm(self, request: web.Request) -> web.Response:
        session = self._auth().current()
        approval = request.query.get("approval")
        if approval is not None:
            return await self._approval(session, approval)
        # a page is always read fresh (after a form's redirect it must show what the form did)
        return html_response(dashboard_page(session, await self._dashboard_data(), flash=session.take_flash()))

    async def waiting(self, request: web.Request) -> web.Response:
        """What waits for the signed-in person; a shared token's session is nobody, so nothing is listed."""
        session = self._auth().current()
        return html_response(waiting_page(session, await self._waiting_for(session), flash=session.take_flash()))

    async def _waiting_for(self, session: Session) -> WaitingList | None:
        """What waits for the session's person (None: a shared token's session proves nobody)."""
        if not session.proven:
            return None
        return await WaitingForYou(self.services.approvals).for_actor(session.actor)

    async def _dashboard_data(self) -> DashboardData:
        version = self.feed.version if self.feed is not None else 0  # read first: a change during the load is newer
        reads = await self.services.dashboard_reads()
        hours, waits, steps = await DashboardQueries(self.services.store).charts()
        return DashboardData(
            reads.tasks,
            reads.worker_lines,
            reads.approvals,
            reads.counts,
            worker_days=reads.worker_days,
            rules=reads.rules,
            hours=hours,
            waits=waits,
            plan_steps=steps,
            calls=reads.calls,
            press=press_latencies(),
            taken_at=time.time(),
            version=version,
        )

    async def _approval(self, session: Session, request_id: str) -> web.Response:
        try:
            record = await self.services.approval_record(request_id) if _REQUEST_ID.fullmatch(request_id) else None
        except UnreadableRequest as exc:
            # Changed outside Kazma: a page that says which request and why, not aiohttp's bare 500
            log.warning("web.approval_unreadable", request_id=exc.request_id, columns=list(exc.columns))
            raise web.HTTPInternalServerError(
                text=message_page("Approval request cannot be read", str(exc), viewer=session),
                content_type="text/html",
            ) from None
        if record is None:
            raise _not_found("No such approval request.", session)
        return html_response(
            approval_page(
                session,
                record.request,
                record.events,
                record.cards,
                public_url=self.services.config.web.public_url,
                flash=session.take_flash(),
                policy_configured=self.services.config.policy(record.request.policy or DEFAULT_POLICY) is not None,
            )
        )

    # -- swarm work ------------------------------------------------------------------------------

    async def _swarm_text(self, session: Session, text: str) -> str:
        """Run a ``/swarm`` command for a console person: operators count as admins, readers may only read."""
        if not session.is_operator:
            from kazma.engine.swarm.grammar import parse  # the swarm's grammar: imported by the first command

            config = self.services.config
            try:
                command = parse(text, workers=config.agents.workers, pipelines=config.pipelines)
            except GrammarError as exc:
                return str(exc)
            # a reader may have named themselves after an approver: the role, not the name, decides here
            if required_role(command) is not SwarmRole.READER:
                return f"{OPERATORS_ONLY}: /swarm {command.verb} needs the operator token"
        answer = await self.services.run_swarm(
            SwarmCommand(text, actor=session.actor, platform="web", chat=CONSOLE, is_admin=session.is_operator)
        )
        if answer is None:
            return "The /swarm commands are not available: this process runs without the swarm engine."
        return answer

    async def task_action(self, request: web.Request) -> web.Response:
        session, _ = await self._auth().form(request)
        task_id, action = request.match_info["id"], request.match_info["action"]
        if action not in TASK_ACTIONS or not _TASK_ID.fullmatch(task_id):
            raise _not_found("No such task action.", session)
        session.flash.append(await self._swarm_text(session, f"{action} {task_id}"))
        raise web.HTTPSeeOther("/swarm")

    async def revoke_rule(self, request: web.Request) -> web.Response:
        session, _ = await self._auth().form(request)
        rule_id = request.match_info["id"]
        try:
            revoked = await self.services.approvals.revoke_rule(rule_id, actor=session.actor, platform=session.platform)
        except store_errors() as exc:
            log.warning("web.rule_revoke_failed", rule=rule_id, actor=session.actor, error=str(exc))
            session.flash.append(
                f"Remembered approval {rule_id} could not be revoked: the approvals store did not take the change"
                " (nothing changed, the rule is still in force). Try again."
            )
            raise web.HTTPSeeOther("/swarm") from None
        session.flash.append(
            f"Remembered approval {rule_id} revoked by {session.actor}: the next identical call gets a card."
            if revoked is not None
            else f"No remembered approval {rule_id} is in force; nothing changed."
        )
        raise web.HTTPSeeOther("/swarm")

    async def swarm_command(self, request: web.Request) -> web.Response:
        session, fields = await self._auth().form(request)
        text = fields.get("text", "").strip().removeprefix("/swarm").strip()
        if len(text) > MAX_COMMAND_BYTES:
            session.flash.append(_swarm_too_long(len(text)))
        else:
            session.flash.append(await self._swarm_text(session, text))
        raise web.HTTPSeeOther("/swarm")

    # -- machines --------------------------------------------------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            for status, count in (await self.services.task_counts()).items():
                SWARM_TASKS.labels(status=status.value).set(count)
        except Exception as exc:  # the rest of the metrics are still worth serving
            count_failure("metrics_swarm")
            log.warning("web.metrics_swarm_failed", error=str(exc))
        body = generate_latest(REGISTRY)
        if self.services.replicated:  # several replicas behind one scrape job: say whose series these are
            body = with_label(body, "replica", self.services.replica)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        """``ok`` (200) or why not (503), then a line per chat platform; among replicas also who leads and
        whether the store answers. A platform down is a line, not the status, while a press elsewhere (another
        platform, the console) still decides: a load balancer taking every replica out helps nobody then."""
        halted = self.services.approvals.halted
        if halted is not None:
            return web.Response(text=f"not deciding: {halted}", status=503)
        health = await self.services.replica_health()
        platforms = self.services.platform_health(health)
        # Each platform's state: one whose start is being retried, or whose inbound connection closed, showed its
        # cards with buttons nobody's press reached while this answered a bare "ok".
        lines = [p.line() for p in platforms]
        # /mcp's state, when it is served: a line, never the status, which says whether approvals are decided.
        if self.mcp is not None and (line := self.mcp.health()) is not None:
            lines.append(line)
        stranded = bool(platforms) and not any(p.takes_presses for p in platforms) and not self.services.console_decides
        head = "ok"
        if health is not None and not health.store_reachable:
            head = "not deciding: the store cannot be reached"
        elif health is not None and not health.ok:
            head = "not deciding: the store refuses writes (read-only: a hot standby, or default_transaction_read_only)"
        elif stranded:
            head = "not deciding: no chat platform takes presses and nobody may decide on the console"
        replica = health.lines() if health is not None else []
        if health is None and not lines:
            return web.Response(text=head, status=503 if stranded else 200)
        ok = not stranded and (health is None or health.ok)
        return web.Response(text="\n".join([head, *replica, *lines]) + "\n", status=200 if ok else 503)

    async def script(self, request: web.Request) -> web.Response:
        return web.Response(
            text=CONSOLE_JS,
            content_type="application/javascript",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )
