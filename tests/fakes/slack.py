"""A wire-level fake of Slack for tests: the Web API and the signed posts Slack makes to an app.

The server side answers the Web API methods the adapter and Bolt call, the way
slack-sdk sends them (JSON or form bodies, bearer token), keeps every channel's
messages with their current text and blocks, records every call and enforces
the limits Slack enforces, so a payload that Slack would refuse fails here too.

The client side posts events, slash commands and block actions to an app's
HTTP endpoint exactly as Slack does, signed with the app's signing secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

from tests.fakes.slack_oidc import SlackSignIn

MAX_BLOCKS = 50
MAX_SECTION_TEXT = 3000
MAX_FIELD_TEXT = 2000
MAX_HEADER_TEXT = 150
MAX_BUTTON_TEXT = 75
MAX_BUTTON_VALUE = 2000
MAX_ID = 255
MAX_MESSAGE_TEXT = 40_000
_CHANNEL = re.compile(r"^[CGD][A-Z0-9]{2,}$")
_BLOCK_TYPES = frozenset({"section", "header", "context", "actions", "divider", "image", "rich_text", "input"})

FAKE_BOT_TOKEN = "xoxb-kazma-fake-token"
FAKE_SIGNING_SECRET = "kazma-fake-signing-secret"
FAKE_APP_TOKEN = "xapp-1-AKAZMAAPP1-kazma-fake"
# What a bot token of an app installed with the README's scopes is granted; Slack names them in the
# x-oauth-scopes header of every Web API answer.
DEFAULT_SCOPES = (
    "app_mentions:read",
    "channels:history",
    "channels:read",
    "groups:read",
    "chat:write",
    "chat:write.customize",
    "commands",
    "groups:history",
    "im:history",
    "im:write",
    "files:read",
    "files:write",
)


def direct_channel(user: str) -> str:
    """The id of the app's direct-message channel with ``user`` on this fake (Slack's start with D)."""
    return "D" + user[1:]


# The scope each method needs (Slack answers missing_scope, with needed and provided, without it).
METHOD_SCOPES = {
    "conversations.info": "channels:read",
    "conversations.open": "im:write",
    "chat.postMessage": "chat:write",
    "chat.update": "chat:write",
    "chat.postEphemeral": "chat:write",
    "files.getUploadURLExternal": "files:write",
    "files.completeUploadExternal": "files:write",
}

FaultKind = Literal["500", "429", "hang", "error", "lost", "401"]  # "401": file downloads only
# fail(FILE_DOWNLOAD, "500" | "429"): the next download of a url_private answers 503, or 429 with Retry-After.
FILE_DOWNLOAD: Final = "files-pri"


@dataclass(frozen=True)
class ApiCall:
    method: str
    params: dict[str, Any]
    token: str | None
    content_type: str
    status: int = 200
    error: str | None = None  # the Slack error code answered, if any
    at: float = field(default_factory=time.monotonic)  # when the request arrived (the pacing's clock)


@dataclass
class StoredMessage:
    channel: str
    ts: str
    text: str
    blocks: list[dict[str, Any]]
    user: str
    bot_id: str | None = None
    thread_ts: str | None = None
    username: str | None = None
    icon_emoji: str | None = None
    edits: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)  # files shared with the message

    def texts(self) -> list[str]:
        """Every piece of text Slack would render: the fallback text and each text object's text."""
        return [self.text, *_texts_in(self.blocks)]

    def block(self, block_id: str) -> dict[str, Any] | None:
        return next((b for b in self.blocks if b.get("block_id") == block_id), None)

    def block_types(self) -> list[str]:
        return [str(b.get("type")) for b in self.blocks]


@dataclass(frozen=True)
class Ephemeral:
    channel: str
    user: str
    text: str
    blocks: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Fault:
    kind: FaultKind
    times: int = 1
    retry_after: int = 1
    error: str = ""


@dataclass(frozen=True)
class SignedResponse:
    status: int
    body: str
    headers: dict[str, str]


def _texts_in(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "text" and isinstance(value, str):
                yield value
            else:
                yield from _texts_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from _texts_in(item)


def sign(secret: str, timestamp: str, body: str) -> str:
    """Slack's v0 request signature: HMAC-SHA256 over ``v0:{timestamp}:{body}``."""
    digest = hmac.new(secret.encode(), f"v0:{timestamp}:{body}".encode(), hashlib.sha256).hexdigest()
    return f"v0={digest}"


class SlackApiRefusal(Exception):
    def __init__(self, error: str, **extra: Any) -> None:
        super().__init__(error)
        self.error = error
        self.extra = extra


def _text_object(obj: Any, where: str, *, limit: int, plain_only: bool = False) -> None:
    if not isinstance(obj, dict) or obj.get("type") not in ("plain_text", "mrkdwn"):
        raise SlackApiRefusal("invalid_blocks", errors=[f"{where}: must be a text object"])
    if plain_only and obj["type"] != "plain_text":
        raise SlackApiRefusal("invalid_blocks", errors=[f"{where}: must be plain_text"])
    text = obj.get("text")
    if not isinstance(text, str) or not text:
        raise SlackApiRefusal("invalid_blocks", errors=[f"{where}: text must be non-empty"])
    if len(text) > limit:
        raise SlackApiRefusal("invalid_blocks", errors=[f"{where}: must be less than {limit + 1} characters"])


def validate_blocks(blocks: Any) -> list[dict[str, Any]]:
    """Refuse what Slack refuses; return the blocks as stored."""
    if isinstance(blocks, str):
        try:
            blocks = json.loads(blocks)
        except json.JSONDecodeError:
            raise SlackApiRefusal("invalid_blocks_format") from None
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise SlackApiRefusal("invalid_blocks_format")
    if len(blocks) > MAX_BLOCKS:
        raise SlackApiRefusal("invalid_blocks", errors=[f"must provide an array with no more than {MAX_BLOCKS} items"])
    block_ids: set[str] = set()
    action_ids: set[str] = set()
    for index, block in enumerate(blocks):
        where = f"[json-pointer:/blocks/{index}]"
        kind = block.get("type")
        if kind not in _BLOCK_TYPES:
            raise SlackApiRefusal("invalid_blocks", errors=[f"{where}/type: unknown block type {kind!r}"])
        block_id = block.get("block_id")
        if block_id is not None:
            if not isinstance(block_id, str) or not block_id or len(block_id) > MAX_ID:
                raise SlackApiRefusal("invalid_blocks", errors=[f"{where}/block_id: invalid"])
            if block_id in block_ids:
                raise SlackApiRefusal("invalid_blocks", errors=[f"{where}/block_id: duplicate block_id {block_id}"])
            block_ids.add(block_id)
        if kind == "section":
            if "text" not in block and "fields" not in block:
                raise SlackApiRefusal("invalid_blocks", errors=[f"{where}: a section needs text or fields"])
            if "text" in block:
                _text_object(block["text"], f"{where}/text", limit=MAX_SECTION_TEXT)
            fields = block.get("fields", [])
            if not isinstance(fields, list) or len(fields) > 10:
                raise SlackApiRefusal("invalid_blocks", errors=[f"{where}/fields: at most 10"])
            for n, item in enumerate(fields):
                _text_object(item, f"{where}/fields/{n}", limit=MAX_FIELD_TEXT)
        elif kind == "header":
            _text_object(block.get("text"), f"{where}/text", limit=MAX_HEADER_TEXT, plain_only=True)
        elif kind == "context":
            elements = block.get("elements")
            if not isinstance(elements, list) or not 1 <= len(elements) <= 10:
                raise SlackApiRefusal("invalid_blocks", errors=[f"{where}/elements: 1 to 10 elements"])
            for n, item in enumerate(elements):
                if isinstance(item, dict) and item.get("type") == "image":
                    continue
                _text_object(item, f"{where}/elements/{n}", limit=MAX_SECTION_TEXT)
        elif kind == "actions":
            elements = block.get("elements")
            if not isinstance(elements, list) or not 1 <= len(elements) <= 25:
                raise SlackApiRefusal("invalid_blocks", errors=[f"{where}/elements: 1 to 25 elements"])
            for n, item in enumerate(elements):
                at = f"{where}/elements/{n}"
                if not isinstance(item, dict) or item.get("type") != "button":
                    raise SlackApiRefusal("invalid_blocks", errors=[f"{at}: only buttons are modelled"])
                _text_object(item.get("text"), f"{at}/text", limit=MAX_BUTTON_TEXT, plain_only=True)
                value = item.get("value", "")
                if not isinstance(value, str) or len(value) > MAX_BUTTON_VALUE:
                    raise SlackApiRefusal(
                        "invalid_blocks", errors=[f"{at}/value: must be less than {MAX_BUTTON_VALUE + 1} characters"]
                    )
                if item.get("style") not in (None, "primary", "danger"):
                    raise SlackApiRefusal("invalid_blocks", errors=[f"{at}/style: invalid"])
                action_id = item.get("action_id")
                if action_id is not None:
                    if not isinstance(action_id, str) or not action_id or len(action_id) > MAX_ID:
                        raise SlackApiRefusal("invalid_blocks", errors=[f"{at}/action_id: invalid"])
                    if action_id in action_ids:
                        raise SlackApiRefusal(
                            "invalid_blocks", errors=[f"{at}/action_id: duplicate action_id {action_id}"]
                        )
                    action_ids.add(action_id)
    return blocks


class FakeSlack:
    """``await start()``, point slack-sdk at :attr:`api_url`, drive the app through the post helpers."""

    def __init__(
        self,
        *,
        bot_token: str = FAKE_BOT_TOKEN,
        signing_secret: str = FAKE_SIGNING_SECRET,
        team_id: str = "TKAZMA0001",
        bot_user_id: str = "UKAZMABOT1",
        bot_id: str = "BKAZMABOT1",
        app_id: str = "AKAZMAAPP1",
        app_token: str = FAKE_APP_TOKEN,
        allow_customize: bool = True,
        scopes: tuple[str, ...] = DEFAULT_SCOPES,
    ) -> None:
        self.bot_token = bot_token
        self.signing_secret = signing_secret
        self.team_id = team_id
        self.bot_user_id = bot_user_id
        self.bot_id = bot_id
        self.app_id = app_id
        self.allow_customize = allow_customize
        self.scopes = scopes  # granted to the bot token
        self.latency = 0.0  # seconds added before every Web API answer (benchmarks)
        self.calls: list[ApiCall] = []
        self.messages: dict[str, dict[str, StoredMessage]] = {}
        self.ephemerals: list[Ephemeral] = []
        self.views: list[dict[str, Any]] = []  # modals opened by views.open, each with its trigger_id
        self.home_tabs: dict[str, dict[str, Any]] = {}  # user -> the Home tab views.publish last set for them
        self.responses: list[dict[str, Any]] = []  # bodies posted to response_urls
        self._faults: dict[str, list[Fault]] = {}
        self._ts = itertools.count(1)
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._closing = asyncio.Event()
        self._release = asyncio.Event()
        self.app_token = app_token
        self.revoked: dict[str, str] = {}  # a token Slack no longer takes -> the error it answers a call with it
        self._tickets: set[str] = set()
        self._sockets: list[web.WebSocketResponse] = []
        self._acks: dict[str, asyncio.Future[Any]] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._port = 0
        self.files: dict[str, dict[str, Any]] = {}  # file id -> {"name", "content", "length", "uploaded"}
        self.downloads: list[tuple[str, str | None]] = []  # (file id, bearer token) per download
        self.sign_in = SlackSignIn(team_id)  # Sign in with Slack (OpenID Connect)
        # conversations.info: every channel exists with the bot in it, except these.
        self.missing_channels: set[str] = set()  # channel_not_found (also a private channel the bot is not in)
        self.channels_without_bot: set[str] = set()  # public channels the bot was not invited to
        self.archived_channels: set[str] = set()

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/api/{method}", self._api)
        app.router.add_get("/api/{method}", self._api)
        app.router.add_post("/respond/{token}", self._respond)
        app.router.add_get("/socket", self._socket)
        app.router.add_post("/upload/v1/{file_id}", self._upload)
        app.router.add_get("/files-pri/{file_id}/{name}", self._download)
        self.sign_in.routes(app)
        # A hanging request is woken on stop, so a short grace is enough.
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        for address in self._runner.addresses:
            self._port = int(address[1])
            break
        self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        self._closing.set()
        for ws in list(self._sockets):
            await ws.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api/"

    # -- scripting and inspection ------------------------------------------

    def fail(self, method: str, kind: FaultKind, *, times: int = 1, retry_after: int = 1, error: str = "") -> None:
        """Answer the next ``times`` calls of ``method`` with a fault instead of the real result.

        ``500``: an HTTP 500 with a text body. ``429``: ``ratelimited`` with a ``Retry-After``
        header. ``hang``: no answer until :meth:`release_hangs` or :meth:`stop`. ``error``: HTTP
        200 with ``{"ok": false, "error": error}``. ``lost``: the call is carried out, then the connection
        drops before its answer is written (the client cannot know whether it happened).
        """
        self._faults.setdefault(method, []).append(Fault(kind, times, retry_after, error))

    def revoke(self, token: str, error: str = "token_revoked") -> None:
        """Slack no longer takes ``token`` (the bot's or the app-level one): revoked (``token_revoked``), the app
        uninstalled or the workspace deactivated (``account_inactive``). Every call with it is answered ``error``,
        as Slack answers it: HTTP 200 and ``ok: false``."""
        self.revoked[token] = error

    def heal(self, method: str) -> None:
        """Drop the faults still scripted for ``method``: Slack answers it again."""
        self._faults.pop(method, None)

    def release_hangs(self) -> None:
        self._release.set()

    def calls_to(self, method: str) -> list[ApiCall]:
        return [c for c in self.calls if c.method == method]

    def channel(self, channel: str) -> list[StoredMessage]:
        return list(self.messages.get(channel, {}).values())

    def message(self, channel: str, ts: str) -> StoredMessage:
        return self.messages[channel][ts]

    def add_user_message(self, channel: str, text: str, *, user: str = "UHUMAN0001") -> StoredMessage:
        """A message a person posted (the bot may not edit it)."""
        msg = StoredMessage(channel=channel, ts=self.next_ts(), text=text, blocks=[], user=user)
        self.messages.setdefault(channel, {})[msg.ts] = msg
        return msg

    def next_ts(self) -> str:
        n = next(self._ts)
        return f"{1_700_000_000 + n}.{n:06d}"

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every recorded call."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()

    # -- the Web API --------------------------------------------------------

    async def _params(self, request: web.Request) -> dict[str, Any]:
        params: dict[str, Any] = dict(request.query)
        if request.method == "POST" and request.can_read_body:
            if request.content_type == "application/json":
                body = await request.json()
                if isinstance(body, dict):
                    params.update(body)
            else:
                form = await request.post()
                params.update({k: v for k, v in form.items() if isinstance(v, str)})
        return params

    def _token(self, request: web.Request, params: dict[str, Any]) -> str | None:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return header[len("Bearer ") :]
        token = params.pop("token", None)
        return str(token) if token is not None else None

    def _take_fault(self, method: str) -> Fault | None:
        queue = self._faults.get(method)
        if not queue:
            return None
        fault = queue[0]
        fault.times -= 1
        if fault.times <= 0:
            queue.pop(0)
        return fault

    async def _api(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        if self.latency:
            await asyncio.sleep(self.latency)
        params = await self._params(request)
        token = self._token(request, params)

        def record(status: int = 200, error: str | None = None) -> None:
            self.calls.append(ApiCall(method, params, token, request.content_type, status, error))
            self._notify()

        if method == "openid.connect.token":  # the app's own credentials, not a token
            answer = self.sign_in.token(params)
            record(error=answer.get("error"))
            return web.json_response(answer)
        if token is None:
            record(error="not_authed")
            return web.json_response({"ok": False, "error": "not_authed"})
        if token in self.revoked:
            record(error=self.revoked[token])
            return web.json_response({"ok": False, "error": self.revoked[token]})
        expected = self.app_token if method == "apps.connections.open" else self.bot_token
        if token != expected:
            record(error="invalid_auth")
            return web.json_response({"ok": False, "error": "invalid_auth"})
        granted = {"x-oauth-scopes": ",".join(self.scopes)} if token == self.bot_token else {}
        fault = self._take_fault(method)
        if fault is not None and fault.kind != "lost":
            return await self._fault(fault, record)
        needed = METHOD_SCOPES.get(method)
        if token == self.bot_token and needed is not None and needed not in self.scopes:
            record(error="missing_scope")
            body = {"ok": False, "error": "missing_scope", "needed": needed, "provided": ",".join(self.scopes)}
            return web.json_response(body, headers=granted)
        handler = getattr(self, "_m_" + method.replace(".", "_"), None)
        if handler is None:
            record(error="unknown_method")
            return web.json_response({"ok": False, "error": "unknown_method"}, status=404)
        try:
            result: dict[str, Any] = handler(params)
        except SlackApiRefusal as refusal:
            record(error=refusal.error)
            return web.json_response({"ok": False, "error": refusal.error, **refusal.extra}, headers=granted)
        record()
        if fault is not None:  # "lost": done, and the connection drops before the answer is written
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=200)  # never reaches the client
        return web.json_response({"ok": True, **result}, headers=granted)

    async def _fault(self, fault: Fault, record: Callable[[int, str | None], None]) -> web.StreamResponse:
        if fault.kind == "500":
            record(500, "internal_error")
            return web.Response(status=500, text="Internal Server Error")
        if fault.kind == "429":
            record(429, "ratelimited")
            return web.json_response(
                {"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": str(fault.retry_after)}
            )
        if fault.kind == "error":
            record(200, fault.error)
            return web.json_response({"ok": False, "error": fault.error})
        record(0, "hang")
        closing = asyncio.ensure_future(self._closing.wait())
        released = asyncio.ensure_future(self._release.wait())
        _, pending = await asyncio.wait({closing, released}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return web.Response(status=503, text="released")

    def _m_auth_test(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            "url": "https://kazma-fake.slack.com/",
            "team": "Kazma Fake",
            "user": "kazma",
            "team_id": self.team_id,
            "user_id": self.bot_user_id,
            "bot_id": self.bot_id,
            "is_enterprise_install": False,
        }

    @staticmethod
    def _channel(params: dict[str, Any]) -> str:
        channel = str(params.get("channel") or "")
        if not _CHANNEL.match(channel):
            raise SlackApiRefusal("channel_not_found")
        return channel

    @staticmethod
    def _content(params: dict[str, Any], *, required: bool = True) -> tuple[str | None, list[dict[str, Any]] | None]:
        text = params.get("text")
        if text is not None and not isinstance(text, str):
            raise SlackApiRefusal("invalid_arguments")
        blocks = validate_blocks(params["blocks"]) if "blocks" in params else None
        if text is not None and len(text) > MAX_MESSAGE_TEXT:
            raise SlackApiRefusal("msg_too_long")
        if required and not text and not blocks:
            raise SlackApiRefusal("no_text")
        return text, blocks

    def _message_json(self, msg: StoredMessage) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "message", "ts": msg.ts, "text": msg.text, "user": msg.user}
        if msg.bot_id:
            out["bot_id"] = msg.bot_id
        if msg.blocks:
            out["blocks"] = msg.blocks
        if msg.thread_ts:
            out["thread_ts"] = msg.thread_ts
        if msg.username:
            out["username"] = msg.username
        return out

    def _m_conversations_open(self, params: dict[str, Any]) -> dict[str, Any]:
        """The app's direct-message channel with one user: the same D… id every time."""
        users = str(params.get("users") or "")
        if not users or "," in users:
            raise SlackApiRefusal("invalid_arguments")
        return {"channel": {"id": direct_channel(users)}}

    def _m_conversations_info(self, params: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(params)
        if channel in self.missing_channels:
            raise SlackApiRefusal("channel_not_found")
        return {
            "channel": {
                "id": channel,
                "name": f"channel-{channel.lower()}",
                "is_channel": channel.startswith("C"),
                "is_private": channel.startswith("G"),
                "is_archived": channel in self.archived_channels,
                "is_member": channel not in self.channels_without_bot,
            }
        }

    def _m_chat_postMessage(self, params: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(params)
        text, blocks = self._content(params)
        customised = [k for k in ("username", "icon_emoji", "icon_url") if params.get(k)]
        if customised and not self.allow_customize:
            raise SlackApiRefusal("missing_scope", needed="chat:write.customize", provided="chat:write")
        msg = StoredMessage(
            channel=channel,
            ts=self.next_ts(),
            text=text or "",
            blocks=blocks or [],
            user=self.bot_user_id,
            bot_id=self.bot_id,
            thread_ts=str(params["thread_ts"]) if params.get("thread_ts") else None,
            username=str(params["username"]) if params.get("username") else None,
            icon_emoji=str(params["icon_emoji"]) if params.get("icon_emoji") else None,
        )
        self.messages.setdefault(channel, {})[msg.ts] = msg
        return {"channel": channel, "ts": msg.ts, "message": self._message_json(msg)}

    def _m_chat_update(self, params: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(params)
        ts = str(params.get("ts") or "")
        msg = self.messages.get(channel, {}).get(ts)
        if msg is None:
            raise SlackApiRefusal("message_not_found")
        if msg.user != self.bot_user_id:
            raise SlackApiRefusal("cant_update_message")
        text, blocks = self._content(params, required=False)
        if text is not None:
            msg.text = text
        # As on Slack: omitting blocks keeps the old ones, an empty list clears them.
        if blocks is not None:
            msg.blocks = blocks
        msg.edits += 1
        return {"channel": channel, "ts": ts, "text": msg.text, "message": self._message_json(msg)}

    # -- files --------------------------------------------------------------

    def add_file(self, name: str, content: bytes, *, declared_size: int | None = None) -> dict[str, Any]:
        """A file a person uploaded; the file object as it appears in a ``file_share`` message event."""
        file_id = f"F{next(self._ids):09d}"
        self.files[file_id] = {"name": name, "content": content, "length": len(content), "uploaded": True}
        return {
            "id": file_id,
            "name": name,
            "title": name,
            "mimetype": "application/octet-stream",
            "size": len(content) if declared_size is None else declared_size,
            "url_private": f"{self.url}/files-pri/{file_id}/{name}",
            "url_private_download": f"{self.url}/files-pri/{file_id}/{name}",
        }

    def file_event(self, *, channel: str, user: str, text: str, files: list[dict[str, Any]]) -> dict[str, Any]:
        event = self.message_event(channel=channel, user=user, text=text, subtype="file_share")
        event["files"] = files
        event["upload"] = True
        if channel.startswith("D"):
            event["channel_type"] = "im"
        return event

    def shared_files(self, channel: str) -> list[tuple[StoredMessage, bytes]]:
        """Files the bot shared into ``channel``, with their content."""
        return [(m, self.files[f["id"]]["content"]) for m in self.channel(channel) if m.bot_id for f in m.files]

    def _m_files_getUploadURLExternal(self, params: dict[str, Any]) -> dict[str, Any]:
        name = str(params.get("filename") or "")
        try:
            length = int(params.get("length") or 0)
        except ValueError:
            raise SlackApiRefusal("invalid_arguments") from None
        if not name or length < 1:
            raise SlackApiRefusal("invalid_arguments")
        file_id = f"F{next(self._ids):09d}"
        self.files[file_id] = {"name": name, "content": b"", "length": length, "uploaded": False}
        return {"upload_url": f"{self.url}/upload/v1/{file_id}", "file_id": file_id}

    async def _upload(self, request: web.Request) -> web.Response:
        entry = self.files.get(request.match_info["file_id"])
        if entry is None:
            return web.Response(status=404, text="not found")
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            field_ = next((v for v in form.values() if not isinstance(v, str)), None)
            data = field_.file.read() if field_ is not None else b""  # type: ignore[union-attr]
        else:
            data = await request.read()
        if len(data) != entry["length"]:
            return web.Response(status=400, text=f"expected {entry['length']} bytes, got {len(data)}")
        entry["content"], entry["uploaded"] = data, True
        self._notify()
        return web.Response(status=200, text=f"OK - {len(data)}")

    def _m_files_completeUploadExternal(self, params: dict[str, Any]) -> dict[str, Any]:
        raw = params.get("files")
        items = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(items, list) or not items:
            raise SlackApiRefusal("invalid_arguments")
        shared = []
        for item in items:
            entry = self.files.get(str(item.get("id")))
            if entry is None or not entry["uploaded"]:
                raise SlackApiRefusal("file_not_found")
            shared.append({"id": str(item["id"]), "name": entry["name"], "title": item.get("title") or entry["name"]})
        channel = params.get("channel_id")
        if channel:
            channel = self._channel({"channel": channel})
            msg = StoredMessage(
                channel=channel,
                ts=self.next_ts(),
                text=str(params.get("initial_comment") or ""),
                blocks=[],
                user=self.bot_user_id,
                bot_id=self.bot_id,
                thread_ts=str(params["thread_ts"]) if params.get("thread_ts") else None,
                files=shared,
            )
            self.messages.setdefault(channel, {})[msg.ts] = msg
        return {"files": shared}

    async def _download(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        header = request.headers.get("Authorization", "")
        token = header[len("Bearer ") :] if header.startswith("Bearer ") else None
        self.downloads.append((file_id, token))
        fault = self._take_fault(FILE_DOWNLOAD)
        if fault is not None and fault.kind == "500":
            return web.Response(status=503, text="Service Unavailable")
        if fault is not None and fault.kind == "429":
            return web.Response(status=429, headers={"Retry-After": str(fault.retry_after)})
        if fault is not None and fault.kind == "401":  # not Slack's own answer (see below): a proxy's, say
            return web.Response(status=401, text="Unauthorized")
        entry = self.files.get(file_id)
        if token != self.bot_token or "files:read" not in self.scopes:
            # Slack answers an unauthorised download with its sign-in page, not an error status.
            return web.Response(status=302, headers={"Location": f"{self.url}/signin"})
        if entry is None:
            return web.Response(status=404)
        return web.Response(body=entry["content"], content_type="application/octet-stream")

    def _m_chat_postEphemeral(self, params: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(params)
        user = str(params.get("user") or "")
        if not user:
            raise SlackApiRefusal("user_not_in_channel")
        text, blocks = self._content(params)
        self.ephemerals.append(Ephemeral(channel=channel, user=user, text=text or "", blocks=blocks or []))
        return {"message_ts": self.next_ts()}

    async def _respond(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.responses.append({"token": request.match_info["token"], **body})
        self._notify()
        return web.Response(text="ok")

    # -- what Slack posts to an app ----------------------------------------

    async def post_signed(
        self,
        url: str,
        body: str,
        content_type: str,
        *,
        bad_signature: bool = False,
        timestamp: int | None = None,
    ) -> SignedResponse:
        """POST ``body`` with Slack's signature headers (a wrong one when ``bad_signature``)."""
        if self._session is None:
            raise RuntimeError("FakeSlack is not started")
        stamp = str(timestamp if timestamp is not None else int(time.time()))
        secret = "not-the-" + self.signing_secret if bad_signature else self.signing_secret
        headers = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": sign(secret, stamp, body),
        }
        async with self._session.post(url, data=body.encode(), headers=headers) as resp:
            return SignedResponse(status=resp.status, body=await resp.text(), headers=dict(resp.headers))

    def message_event(
        self,
        *,
        channel: str,
        user: str,
        text: str,
        ts: str | None = None,
        thread_ts: str | None = None,
        bot_id: str | None = None,
        subtype: str | None = None,
        kind: Literal["message", "app_mention"] = "message",
    ) -> dict[str, Any]:
        """An event as Slack sends it; ``text`` is raw Slack text (``<@U…>`` markup, ``&lt;`` escapes)."""
        stamp = ts or self.next_ts()
        event: dict[str, Any] = {
            "type": kind,
            "channel": channel,
            "user": user,
            "text": text,
            "ts": stamp,
            "event_ts": stamp,
            "team": self.team_id,
        }
        if kind == "message":
            event["channel_type"] = "channel"
        if thread_ts:
            event["thread_ts"] = thread_ts
        if bot_id:
            event["bot_id"] = bot_id
        if subtype:
            event["subtype"] = subtype
        return event

    def event_envelope(self, event: dict[str, Any]) -> dict[str, Any]:
        """The ``event_callback`` body Slack wraps every Events API event in."""
        n = next(self._ids)
        return {
            "token": "legacy-verification-token",
            "team_id": self.team_id,
            "api_app_id": self.app_id,
            "event": event,
            "type": "event_callback",
            "event_id": f"Ev{n:010d}",
            "event_time": int(time.time()),
            "authorizations": [
                {
                    "enterprise_id": None,
                    "team_id": self.team_id,
                    "user_id": self.bot_user_id,
                    "is_bot": True,
                    "is_enterprise_install": False,
                }
            ],
            "is_ext_shared_channel": False,
        }

    async def post_event(self, url: str, event: dict[str, Any], *, bad_signature: bool = False) -> SignedResponse:
        body = json.dumps(self.event_envelope(event))
        return await self.post_signed(url, body, "application/json", bad_signature=bad_signature)

    def response_url(self) -> str:
        return f"{self.url}/respond/{uuid.uuid4().hex}"

    def command_form(
        self, *, text: str, channel: str, user: str, user_name: str = "operator", command: str = "/swarm"
    ) -> dict[str, str]:
        n = next(self._ids)
        return {
            "token": "legacy-verification-token",
            "team_id": self.team_id,
            "team_domain": "kazma-fake",
            "channel_id": channel,
            "channel_name": "directmessage" if channel.startswith("D") else "general",  # as Slack names a DM
            "user_id": user,
            "user_name": user_name,
            "command": command,
            "text": text,
            "api_app_id": self.app_id,
            "is_enterprise_install": "false",
            "response_url": self.response_url(),
            "trigger_id": f"{n}.{n * 7}.trigger{n:04d}",
        }

    async def post_command(
        self,
        url: str,
        *,
        text: str,
        channel: str,
        user: str,
        user_name: str = "operator",
        command: str = "/swarm",
        bad_signature: bool = False,
    ) -> SignedResponse:
        form = self.command_form(text=text, channel=channel, user=user, user_name=user_name, command=command)
        return await self.post_signed(
            url, urlencode(form), "application/x-www-form-urlencoded", bad_signature=bad_signature
        )

    def block_action_payload(
        self,
        *,
        action_id: str,
        value: str,
        user: str,
        channel: str,
        message_ts: str,
        block_id: str = "kazma_actions",
    ) -> dict[str, Any]:
        n = next(self._ids)
        message = self.messages.get(channel, {}).get(message_ts)
        return {
            "type": "block_actions",
            "user": {"id": user, "username": "approver", "name": "approver", "team_id": self.team_id},
            "api_app_id": self.app_id,
            "token": "legacy-verification-token",
            "container": {
                "type": "message",
                "message_ts": message_ts,
                "channel_id": channel,
                "is_ephemeral": False,
            },
            "trigger_id": f"{n}.{n * 7}.trigger{n:04d}",
            "team": {"id": self.team_id, "domain": "kazma-fake"},
            "enterprise": None,
            "is_enterprise_install": False,
            "channel": {"id": channel, "name": "general"},
            "message": self._message_json(message) if message else {"type": "message", "ts": message_ts},
            "state": {"values": {}},
            "response_url": self.response_url(),
            "actions": [
                {
                    "action_id": action_id,
                    "block_id": block_id,
                    "text": {"type": "plain_text", "text": action_id, "emoji": True},
                    "value": value,
                    "type": "button",
                    "action_ts": f"{int(time.time())}.{n:06d}",
                }
            ],
        }

    async def post_block_action(
        self,
        url: str,
        *,
        action_id: str,
        value: str,
        user: str,
        channel: str,
        message_ts: str,
        block_id: str = "kazma_actions",
        bad_signature: bool = False,
    ) -> SignedResponse:
        payload = self.block_action_payload(
            action_id=action_id, value=value, user=user, channel=channel, message_ts=message_ts, block_id=block_id
        )
        body = urlencode({"payload": json.dumps(payload)})
        return await self.post_signed(url, body, "application/x-www-form-urlencoded", bad_signature=bad_signature)

    # -- modals --------------------------------------------------------------

    def _m_views_publish(self, params: dict[str, Any]) -> dict[str, Any]:
        """A user's App Home tab: ``type: home``, at most 100 valid blocks (Slack's limit for a view)."""
        user = str(params.get("user_id") or "")
        view = params.get("view")
        if isinstance(view, str):
            view = json.loads(view)
        if not user.startswith(("U", "W")) or not isinstance(view, dict) or view.get("type") != "home":
            raise SlackApiRefusal("invalid_arguments")
        blocks = validate_blocks(view.get("blocks", []))
        if len(blocks) > 100:
            raise SlackApiRefusal("invalid_blocks")
        published = {**view, "blocks": blocks, "id": f"V{next(self._ids):08d}"}
        self.home_tabs[user] = published
        self._notify()
        return {"view": published}

    def app_home_opened(self, user: str, *, tab: str = "home") -> dict[str, Any]:
        """The event Slack sends when ``user`` opens the app's Home (or Messages) tab."""
        return {"type": "app_home_opened", "user": user, "channel": f"D{user[1:]}", "tab": tab,
                "event_ts": self.next_ts()}  # fmt: skip

    def _m_views_open(self, params: dict[str, Any]) -> dict[str, Any]:
        trigger = str(params.get("trigger_id") or "")
        if not trigger:
            raise SlackApiRefusal("invalid_arguments")
        view = params.get("view")
        if isinstance(view, str):
            view = json.loads(view)
        if not isinstance(view, dict) or view.get("type") != "modal":
            raise SlackApiRefusal("invalid_arguments")
        opened = {**view, "id": f"V{next(self._ids):08d}", "trigger_id": trigger}
        self.views.append(opened)
        self._notify()
        return {"view": opened}

    async def post_view_submission(
        self, url: str, *, view: dict[str, Any], user: str, values: dict[str, dict[str, str]]
    ) -> SignedResponse:
        """The person submits modal ``view`` (as views.open kept it): ``values`` block_id -> action_id -> text."""
        state = {
            block: {action: {"type": "plain_text_input", "value": text} for action, text in actions.items()}
            for block, actions in values.items()
        }
        payload = {
            "type": "view_submission",
            "team": {"id": self.team_id, "domain": "kazma-fake"},
            "user": {"id": user, "username": "approver", "name": "approver", "team_id": self.team_id},
            "api_app_id": self.app_id,
            "token": "legacy-verification-token",
            "trigger_id": f"{next(self._ids)}.view.trigger",
            "view": {**view, "state": {"values": state}, "team_id": self.team_id, "app_id": self.app_id},
        }
        body = urlencode({"payload": json.dumps(payload)})
        return await self.post_signed(url, body, "application/x-www-form-urlencoded")

    # -- Socket Mode ---------------------------------------------------------

    def _m_apps_connections_open(self, params: dict[str, Any]) -> dict[str, Any]:
        ticket = uuid.uuid4().hex
        self._tickets.add(ticket)
        return {"url": f"ws://127.0.0.1:{self._port}/socket?ticket={ticket}"}

    @property
    def socket_connected(self) -> bool:
        return any(not ws.closed for ws in self._sockets)

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        ticket = request.query.get("ticket", "")
        if ticket not in self._tickets:
            return web.Response(status=401, text="invalid ticket")
        self._tickets.discard(ticket)  # like Slack's, a URL is good for one connection
        ws = web.WebSocketResponse(timeout=1.0)
        await ws.prepare(request)
        self._sockets.append(ws)
        self._notify()
        await ws.send_json(
            {
                "type": "hello",
                "num_connections": len(self._sockets),
                "debug_info": {"host": "kazma-fake", "approximate_connection_time": 18060},
                "connection_info": {"app_id": self.app_id},
            }
        )
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(message.data)
                waiter = self._acks.pop(str(data.get("envelope_id", "")), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(data.get("payload"))
        finally:
            self._sockets.remove(ws)
            self._notify()
        return ws

    async def drop_sockets(self) -> int:
        """Close every open Socket Mode connection, as Slack does when it moves an app's sockets or drops one;
        how many were open."""
        live = [ws for ws in self._sockets if not ws.closed]
        for ws in live:
            await ws.close()
        return len(live)

    async def socket_send(
        self,
        kind: Literal["events_api", "slash_commands", "interactive"],
        payload: dict[str, Any],
        *,
        timeout: float = 5.0,
    ) -> Any:
        """Send one envelope over the open socket; return the payload of the app's ack (None when empty)."""
        live = [ws for ws in self._sockets if not ws.closed]
        if not live:
            raise RuntimeError("no Socket Mode connection is open")
        envelope_id = str(uuid.uuid4())
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._acks[envelope_id] = waiter
        await live[-1].send_json(
            {
                "envelope_id": envelope_id,
                "payload": payload,
                "type": kind,
                "accepts_response_payload": kind != "events_api",
                "retry_attempt": 0,
                "retry_reason": "",
            }
        )
        async with asyncio.timeout(timeout):
            return await waiter
