"""A real Matrix homeserver for the tests: Synapse on SQLite in a temporary folder, owned by the suite.

One server per test process (so one per xdist worker), started the first time a test asks for it
(``synapse`` fixture, or :func:`shared_synapse`) and stopped when the process exits. People are
registered through the shared-secret admin API (``/_synapse/admin/v1/register``, an HMAC-SHA1 over a
nonce), exactly as an operator registers a bot account on a homeserver of their own.

Rate limits stay Synapse's own mechanism: the server runs with small real limits on messages, and each
person registered here is exempt from them through the admin API unless a test asks for the limits
(``limited=True``), so the one test that meets a real 429 meets the server's, not a stand-in's.

:class:`FaultProxy` sits between an adapter and the server where a test needs a failure the real server
will not produce on demand (a 500 on the next post): everything else passes through to Synapse unchanged.

Tests skip with the reason only when Synapse is not installed (``pip install -e '.[dev]'`` installs it);
a server that is installed but fails to start fails the test, with the end of its log.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import hashlib
import hmac
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from aiohttp import web

SERVER_NAME = "localhost"
START_TIMEOUT = 90.0  # seconds: a cold start on a busy two-core machine takes 7 to 20
_SHARED_SECRET = "kazma-test-" + secrets.token_hex(8)
# Real limits, small enough for a test to meet: 3 messages at once, then 2 a second.
_MESSAGE_LIMIT = {"per_second": 2, "burst_count": 3}
_HIGH = {"per_second": 1000, "burst_count": 1000}


class SynapseError(RuntimeError):
    """Synapse could not be started or answered wrongly; the message carries the end of its log."""


def synapse_installed() -> bool:
    return importlib.util.find_spec("synapse") is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signing_key() -> str:
    """A Synapse signing key file's line: ``ed25519 <version> <unpadded base64 of a 32-byte seed>``."""
    seed = base64.b64encode(os.urandom(32)).decode().rstrip("=")
    return f"ed25519 a_{secrets.token_hex(2)} {seed}\n"


def _config(folder: Path, port: int) -> dict[str, Any]:
    return {
        "server_name": SERVER_NAME,
        "pid_file": str(folder / "homeserver.pid"),
        "listeners": [
            {
                "port": port,
                "bind_addresses": ["127.0.0.1"],
                "type": "http",
                "tls": False,
                "x_forwarded": False,
                "resources": [{"names": ["client"], "compress": False}],
            }
        ],
        "database": {"name": "sqlite3", "args": {"database": str(folder / "homeserver.db")}},
        "media_store_path": str(folder / "media"),
        "max_upload_size": "50M",
        "registration_shared_secret": _SHARED_SECRET,
        "report_stats": False,
        "macaroon_secret_key": secrets.token_hex(16),
        "form_secret": secrets.token_hex(16),
        "signing_key_path": str(folder / "signing.key"),
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "enable_metrics": False,
        "url_preview_enabled": False,
        "presence": {"enabled": False},
        "rc_message": _MESSAGE_LIMIT,
        "rc_joins": {"local": _HIGH, "remote": _HIGH},
        "rc_joins_per_room": _HIGH,
        "rc_invites": {"per_room": _HIGH, "per_user": _HIGH, "per_issuer": _HIGH},
        "rc_room_creation": _HIGH,
        "rc_registration": _HIGH,
        "rc_login": {"address": _HIGH, "account": _HIGH, "failed_attempts": _HIGH},
        "rc_admin_redaction": _HIGH,
        "rc_media_create": _HIGH,
        # A sync with the same token and filter within this long answers the same batch again; tests start a
        # new adapter (a first sync without a token) every few seconds, which must see where the room is now.
        "caches": {"sync_response_cache_duration": 0},
    }


@dataclass
class Person:
    """A Matrix account on the test server and a bare client-server API client acting as it.

    Calls are synchronous (urllib): a harness reads what a person sees from plain methods, and an async test
    runs the writing ones through :func:`asyncio.to_thread`.
    """

    server: Synapse
    user_id: str
    token: str
    device_id: str

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                content_type: str = "application/json", params: dict[str, str] | None = None) -> Any:  # fmt: skip
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": content_type}
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        url = f"{self.server.url}{path}" + (f"?{urlencode(params)}" if params else "")
        for _ in range(50):  # the server's own 429s (a person meeting the real limits): wait as told
            request = urllib.request.Request(url, data=data, method=method, headers=headers)  # noqa: S310
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
                    payload = answer.read()
                    if answer.headers.get_content_type() == "application/json":
                        return json.loads(payload)
                    return payload
            except urllib.error.HTTPError as exc:
                text = exc.read()
                if exc.code != 429:
                    raise SynapseError(f"{method} {path} as {self.user_id}: {exc.code} {text!r}") from exc
                time.sleep(json.loads(text).get("retry_after_ms", 500) / 1000)  # the wait the server asked for
        raise SynapseError(f"{method} {path} as {self.user_id}: still rate limited")

    def create_room(self, *, invite: Sequence[str] = (), encrypted: bool = False, direct: bool = False,
                    name: str = "", public: bool = False) -> str:  # fmt: skip
        preset = "public_chat" if public else "private_chat"
        body: dict[str, Any] = {"preset": preset, "invite": list(invite), "is_direct": direct}
        if name:
            body["name"] = name
        if encrypted:
            body["initial_state"] = [
                {"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}
            ]
        return str(self.request("POST", "/_matrix/client/v3/createRoom", body)["room_id"])

    def join(self, room: str) -> None:
        self.request("POST", f"/_matrix/client/v3/join/{quote(room)}", {})

    def send(self, room: str, content: dict[str, Any], event_type: str = "m.room.message") -> str:
        path = f"/_matrix/client/v3/rooms/{quote(room)}/send/{event_type}/{secrets.token_hex(8)}"
        return str(self.request("PUT", path, content)["event_id"])

    def say(self, room: str, text: str, **extra: Any) -> str:
        return self.send(room, {"msgtype": "m.text", "body": text, **extra})

    def react(self, room: str, event_id: str, key: str) -> str:
        relates = {"rel_type": "m.annotation", "event_id": event_id, "key": key}
        return self.send(room, {"m.relates_to": relates}, "m.reaction")

    def upload(self, name: str, data: bytes) -> str:
        answer = self.request("POST", "/_matrix/media/v3/upload", raw=data, content_type="application/octet-stream",
                              params={"filename": name})  # fmt: skip
        return str(answer["content_uri"])

    def download(self, mxc: str) -> bytes:
        server_name, media_id = mxc.removeprefix("mxc://").split("/", 1)
        return bytes(self.request("GET", f"/_matrix/client/v1/media/download/{server_name}/{media_id}"))

    def event(self, room: str, event_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/_matrix/client/v3/rooms/{quote(room)}/event/{quote(event_id)}"))

    def shown(self, room: str, event_id: str) -> dict[str, Any]:
        """What a client shows for ``event_id``: its newest edit's content, else its own."""
        path = f"/_matrix/client/v1/rooms/{quote(room)}/relations/{quote(event_id)}/m.replace"
        edits = self.request("GET", path, params={"dir": "b", "limit": "1"}).get("chunk", [])
        if edits:
            return dict(edits[0]["content"]["m.new_content"])
        return dict(self.event(room, event_id)["content"])

    def messages(self, room: str, since: str | None = None) -> list[dict[str, Any]]:
        """Every event of ``room`` after ``since`` (a sync token), oldest first."""
        found: list[dict[str, Any]] = []
        params = {"dir": "f", "limit": "100"}
        if since:
            params["from"] = since
        while True:
            answer = self.request("GET", f"/_matrix/client/v3/rooms/{quote(room)}/messages", params=params)
            found += answer.get("chunk", [])
            end = answer.get("end")
            if not answer.get("chunk") or not end:
                return found
            params["from"] = str(end)

    def now(self, room: str) -> str:
        """Where ``room``'s timeline is now: a token that :meth:`messages` reads on from."""
        path = f"/_matrix/client/v3/rooms/{quote(room)}/messages"
        return str(self.request("GET", path, params={"dir": "b", "limit": "1"})["start"])

    def set_account_data(self, kind: str, content: dict[str, Any]) -> None:
        self.request("PUT", f"/_matrix/client/v3/user/{quote(self.user_id)}/account_data/{kind}", content)

    def account_data(self, kind: str) -> dict[str, Any] | None:
        try:
            return dict(self.request("GET", f"/_matrix/client/v3/user/{quote(self.user_id)}/account_data/{kind}"))
        except SynapseError:
            return None


@dataclass
class Synapse:
    """One running Synapse: its URL, its folder, and how to register people on it."""

    folder: Path
    port: int
    process: subprocess.Popen[bytes] | None = None
    started_in: float = 0.0  # seconds from launch to the first answer
    people: dict[str, Person] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "synapse.log"

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def start(self) -> None:
        import yaml

        (self.folder / "signing.key").write_text(_signing_key())
        (self.folder / "homeserver.yaml").write_text(yaml.safe_dump(_config(self.folder, self.port)))
        began = time.monotonic()
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "synapse.app.homeserver", "-c", str(self.folder / "homeserver.yaml")],
                cwd=self.folder,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SYNAPSE_CACHE_FACTOR": "0.5"},
            )
        deadline = began + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SynapseError(f"Synapse exited with {self.process.returncode}:\n{self.log_tail()}")
            versions = f"{self.url}/_matrix/client/versions"
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(versions, timeout=2) as got,  # noqa: S310
            ):
                if got.status == 200:
                    self.started_in = time.monotonic() - began
                    return
            time.sleep(0.1)  # polling a server's start: nothing to wait on but its port
        self.stop()
        raise SynapseError(f"Synapse did not answer within {START_TIMEOUT:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def _admin(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise SynapseError(f"{method} {path}: {exc.code} {exc.read()!r}") from exc

    def session(self, person: Person) -> Person:
        """The same account with a new access token (the admin API's login as a user): a fresh client, whose
        transaction ids are its own (the homeserver folds a repeated id of one token into one event)."""
        operator = self.register("operator", admin=True)
        made = self._admin("POST", f"/_synapse/admin/v1/users/{quote(person.user_id)}/login", {}, token=operator.token)
        return Person(self, person.user_id, str(made["access_token"]), person.device_id)

    def register(self, localpart: str, *, admin: bool = False, limited: bool = False) -> Person:
        """A new account ``@localpart:localhost`` (the shared-secret admin API), exempt from the message limits
        unless ``limited``. Registered once per server: asked again, the same person."""
        if localpart in self.people:
            return self.people[localpart]
        nonce = self._admin("GET", "/_synapse/admin/v1/register")["nonce"]
        password = secrets.token_hex(12)
        mac = hmac.new(_SHARED_SECRET.encode(), digestmod=hashlib.sha1)
        mac.update(b"\x00".join([nonce.encode(), localpart.encode(), password.encode(),
                                 b"admin" if admin else b"notadmin"]))  # fmt: skip
        body = {"nonce": nonce, "username": localpart, "password": password, "admin": admin, "mac": mac.hexdigest()}
        made = self._admin("POST", "/_synapse/admin/v1/register", body)
        person = Person(self, str(made["user_id"]), str(made["access_token"]), str(made["device_id"]))
        if not limited:
            operator = self.register("operator", admin=True) if localpart != "operator" else person
            path = f"/_synapse/admin/v1/users/{quote(person.user_id)}/override_ratelimit"
            self._admin("POST", path, {"messages_per_second": 0, "burst_count": 0}, token=operator.token)
        self.people[localpart] = person
        return person


_SHARED: Synapse | None = None
_SHARED_ERROR: str | None = None


def _stop_shared() -> None:
    global _SHARED
    if _SHARED is not None:
        _SHARED.stop()
        shutil.rmtree(_SHARED.folder, ignore_errors=True)
        _SHARED = None


def shared_synapse() -> Synapse:
    """This test process's Synapse, started on first use. Skips (saying why) only when Synapse is not installed;
    one that is installed and does not start fails the asking test, with its log."""
    global _SHARED, _SHARED_ERROR
    if not synapse_installed():
        pytest.skip("matrix-synapse is not installed: pip install -e '.[dev]' installs it (the Matrix tests need it)")
    if _SHARED_ERROR is not None:
        pytest.fail(_SHARED_ERROR)
    if _SHARED is None:
        folder = Path(tempfile.mkdtemp(prefix="kazma-synapse-"))
        server = Synapse(folder, free_port())
        try:
            server.start()
        except SynapseError as exc:
            _SHARED_ERROR = str(exc)
            shutil.rmtree(folder, ignore_errors=True)
            pytest.fail(_SHARED_ERROR)
        _SHARED = server
        atexit.register(_stop_shared)
    return _SHARED


@pytest.fixture
def synapse() -> Synapse:
    return shared_synapse()


# --------------------------------------------------------------------------- a fault proxy


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern[str]
    status: int | None  # None: no answer at all (the request is held until the proxy stops)
    retry_after_ms: int
    times: int
    after: bool  # the request reaches Synapse first, then its answer is lost (replaced by the fault)


class FaultProxy:
    """Passes every request through to Synapse, except the next ``times`` matching ones, answered with a 429
    (``retry_after_ms``, as Synapse words it) or a 5xx, or not answered at all (``status=None``: a homeserver
    that took the connection and went quiet). Counts the requests that matched each pattern asked."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults: list[_Fault] = []
        # answers changed on their way back: (method, path pattern, change), the change saying whether it applied
        self.rewrites: list[tuple[str, re.Pattern[str], Callable[[Any], bool]]] = []
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self._runner: web.AppRunner | None = None
        self._client: httpx.AsyncClient | None = None
        self._stopping = asyncio.Event()  # releases the requests held unanswered
        self.url = ""

    def fail(self, method: str, pattern: str, status: int | None, *, times: int = 1, retry_after_ms: int = 1000,
             after: bool = False) -> None:  # fmt: skip
        """The next ``times`` matching requests are answered ``status`` (None: never answered); ``after``: each is
        forwarded first (it takes effect on the homeserver) and only its answer is lost."""
        self.faults.append(_Fault(method, re.compile(pattern), status, retry_after_ms, times, after))

    def rewrite(self, method: str, pattern: str, change: Callable[[Any], bool]) -> None:
        """Each matching JSON answer goes through ``change`` (which edits it in place) until one call returns True:
        what a homeserver passes on from elsewhere without checking it (a federated server's event), on demand."""
        self.rewrites.append((method, re.compile(pattern), change))

    def count(self, method: str, pattern: str) -> int:
        matcher = re.compile(pattern)
        return sum(1 for m, path in self.seen if m == method and matcher.search(path))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.rel_url.path
        self.seen.append((request.method, path))
        for fault in self.faults:
            if fault.times > 0 and fault.method == request.method and fault.pattern.search(path):
                fault.times -= 1
                if fault.after:
                    await self._forward(request)
                if fault.status is None:
                    await self._stopping.wait()
                    raise web.HTTPServiceUnavailable()
                if fault.status == 429:
                    body = {"errcode": "M_LIMIT_EXCEEDED", "error": "Too Many Requests",
                            "retry_after_ms": fault.retry_after_ms}  # fmt: skip
                else:
                    body = {"errcode": "M_UNKNOWN", "error": "Internal server error"}
                return web.json_response(body, status=fault.status)
        return await self._forward(request, rewrite=True)

    async def _forward(self, request: web.Request, *, rewrite: bool = False) -> web.Response:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}}
        answer = await self._client.request(
            request.method, f"{self.upstream}{request.rel_url}", content=await request.read(), headers=headers
        )
        drop = {"content-length", "transfer-encoding", "content-encoding", "connection"}
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in drop}
        body = answer.content
        for entry in list(self.rewrites) if rewrite and answer.status_code == 200 else ():
            method, pattern, change = entry
            if method == request.method and pattern.search(request.rel_url.path):
                payload = json.loads(body)
                if change(payload):
                    self.rewrites.remove(entry)
                    body = json.dumps(payload).encode()
        return web.Response(body=body, status=answer.status_code, headers=kept)

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=120.0)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.aclose()


@contextlib.asynccontextmanager
async def fault_proxy(upstream: str) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy(upstream)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
