"""Pydantic models of ``kazma.yaml``.

Every model forbids unknown keys so that a typo is an error naming its path
rather than a setting silently ignored. Validators raise ``PydanticCustomError``
with a message written for a person; :mod:`kazma.config.loader` turns those
into one line per problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from ipaddress import ip_network
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kazma.config.address import Actor, ActorError
from kazma.config.audit_config import AuditConfig
from kazma.config.card_routes import CardTarget, RouteEntry, card_targets, parse_route_entry, route_problems
from kazma.config.identity import Roster
from kazma.config.keyring import KEY_VARIABLES, keys_folder
from kazma.config.limits import (
    DEFAULT_FILE_BYTES,
    DEFAULT_FILE_COUNT,
    MAX_REMEMBER_SECONDS,
    MAX_TOOL_OUTPUT_CHARS,
    MAX_WORKERS,
    MIB,
)
from kazma.config.people import PERSON_NAME, PeopleConfig, parse_people, person_key
from kazma.config.registry import ACTOR_PLATFORMS, CHAT_PLATFORMS, EVERY_CHAT, user_id_problem
from kazma.config.registry import matrix as matrix_ids
from kazma.config.registry.slack import app_token_problem as slack_app_token_problem
from kazma.config.registry.slack import bot_token_problem as slack_bot_token_problem
from kazma.config.strict_model import StrictModel

APPROVER_PLATFORMS = ACTOR_PLATFORMS
_WORKER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_SLACK_CHANNEL = re.compile(r"^[CGD][A-Z0-9]{2,}$")
_SLACK_USER = re.compile(r"^[UW][A-Z0-9]{2,}$")


class Strict(StrictModel):
    pass


def _strict_int(kind: str) -> Any:
    """A before-validator accepting ints and integer strings (env values are strings)."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise PydanticCustomError("kazma_int", "expected {kind}, got {got}", {"kind": kind, "got": repr(value)})
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            return int(value)
        raise PydanticCustomError("kazma_int", "expected {kind}, got {got}", {"kind": kind, "got": repr(value)})

    return BeforeValidator(check)


TelegramChatId = Annotated[int, _strict_int("an integer chat id")]
TelegramUserId = Annotated[int, _strict_int("an integer user id")]
DiscordSnowflake = Annotated[int, _strict_int("a numeric Discord id")]


def _optional_int(kind: str) -> Any:
    inner = _strict_int(kind).func

    def check(value: Any) -> Any:
        if value is None or value == "":
            return None
        return inner(value)

    return BeforeValidator(check)


def _or_every(kind: str) -> Any:
    """A chat id, or ``"*"``: serve every chat the bot is in (an explicit choice, never the default)."""
    inner = _strict_int(kind).func

    def check(value: Any) -> Any:
        if value == EVERY_CHAT:
            return value
        return inner(value)

    return BeforeValidator(check)


TelegramChat = Annotated[int | Literal["*"], _or_every("an integer chat id or '*' for every chat")]
DiscordChannel = Annotated[int | Literal["*"], _or_every("a numeric Discord id or '*' for every channel")]
OptionalTelegramChatId = Annotated[int | None, _optional_int("an integer chat id")]
OptionalDiscordSnowflake = Annotated[int | None, _optional_int("a numeric Discord id")]


_HTTP_URL = re.compile(r"^(https?)://[^\s/]+", re.IGNORECASE)
_WS_URL = re.compile(r"^(wss?)://[^\s/]+", re.IGNORECASE)


def lower_scheme(value: str) -> str:
    """``value`` with its scheme in lower case: schemes are case-insensitive (RFC 3986), and the URL is kept
    to be compared (``startswith("https://")``, an origin) and linked, which ``HTTPS://…`` failed."""
    scheme, sep, rest = value.partition("://")
    return f"{scheme.lower()}{sep}{rest}" if sep else value


def _http_url(value: Any) -> Any:
    if not isinstance(value, str) or not _HTTP_URL.match(value):
        raise PydanticCustomError("kazma_url", "expected an http(s) URL, got {got}", {"got": repr(value)})
    return lower_scheme(value)


HttpUrl = Annotated[str, BeforeValidator(_http_url)]


def _ws_url(value: Any) -> Any:
    if value in ("", None):
        return ""
    if not isinstance(value, str) or not _WS_URL.match(value):
        raise PydanticCustomError(
            "kazma_url", "expected a ws(s) URL or empty for the default, got {got}", {"got": repr(value)}
        )
    return lower_scheme(value)


class DangerLevel(StrEnum):
    """How much a tool can change. Unlisted tools are treated as ``dangerous``."""

    READ = "read"
    WRITE = "write"
    DANGEROUS = "dangerous"


_POSTGRES_SCHEMES = ("postgresql", "postgres")


def _postgres_url_problem(url: str) -> str:
    """Why libpq cannot read ``url`` as a connection URL (empty when it can), without any part of the URL.

    Unread, such a URL reached psycopg only when a command opened the store: `kazma approvals list` ended in a
    ProgrammingError traceback and `kazma doctor` printed libpq's words, which quote the password (a bad
    percent escape in it) or the whole URL (an unclosed IPv6 bracket)."""
    import psycopg.conninfo  # only for a PostgreSQL store, which needs psycopg anyway

    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # libpq ends its message with the token it could not read, in quotes: the password, or the whole URL
        said = re.sub(r':?\s*"[^"]*"\s*$', "", " ".join(str(exc).split()))
        return said or "unreadable"
    return ""


class StoreConfig(Strict):
    path: Path = Path(".kazma/kazma.db")
    # sqlite:///relative/path, sqlite:////absolute/path (stored as ``path``) or postgresql://user:pw@host/db.
    url: str | None = None
    busy_timeout_ms: int = Field(default=5000, ge=0, le=600_000)

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, data: Any) -> Any:
        # Messages name the scheme only: the rest of a URL may hold a password.
        if not isinstance(data, dict) or data.get("url") in (None, ""):
            return data
        url = str(data["url"])
        scheme, sep, rest = url.partition("://")
        scheme = scheme.lower()
        if sep and scheme == "sqlite":
            if "path" in data:
                raise PydanticCustomError(
                    "kazma_store", "give store.path or a sqlite:/// store.url, not both", {"subpath": "url"}
                )
            if not rest.startswith("/") or len(rest) < 2:
                raise PydanticCustomError(
                    "kazma_store",
                    "a SQLite store.url is sqlite:///relative/path or sqlite:////absolute/path",
                    {"subpath": "url"},
                )
            return {**data, "path": rest[1:]}
        if sep and scheme in _POSTGRES_SCHEMES:
            if "path" in data:
                raise PydanticCustomError(
                    "kazma_store",
                    "store.path is the SQLite file: leave it out with a postgresql:// store.url",
                    {"subpath": "path"},
                )
            problem = _postgres_url_problem(url)
            if problem:
                raise PydanticCustomError(
                    "kazma_store",
                    "not a PostgreSQL URL libpq can read: {problem}",
                    {"subpath": "url", "problem": problem},
                )
            return data
        raise PydanticCustomError(
            "kazma_store",
            "expected sqlite:///path or postgresql://…, got {what}",
            {"subpath": "url", "what": f"a {scheme}:// URL" if sep else "no scheme"},
        )

    @property
    def backend(self) -> Literal["sqlite", "postgresql"]:
        if self.url is not None and self.url.partition("://")[0].lower() in _POSTGRES_SCHEMES:
            return "postgresql"
        return "sqlite"

    @property
    def postgres_url(self) -> str | None:
        """The PostgreSQL connection URL, or None for a SQLite store."""
        return self.url if self.backend == "postgresql" else None

    @property
    def redacted_url(self) -> str:
        """Where the store is, for people to read: the path, or the URL with its password as ``***``."""
        url = self.postgres_url
        if url is None:
            return str(self.path)
        return url.replace(f":{self.secret}@", ":***@", 1) if self.secret else url

    @property
    def secret(self) -> str:
        """The password inside a PostgreSQL URL (for log redaction); empty when there is none."""
        url = self.postgres_url
        if url is None:
            return ""
        userinfo = url.partition("://")[2].rpartition("@")
        return userinfo[0].partition(":")[2] if userinfo[1] else ""


_LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
_HOST_PORT = re.compile(r":[0-9]{1,5}")


def _host_name(value: str) -> str | None:
    """A host name as ``web.allowed_hosts`` takes it (a port after it is dropped: ports are not compared),
    lower case; None when it is no host name."""
    name = value.strip().lower()
    port = _HOST_PORT.search(name)
    if port is not None and port.end() == len(name):
        name = name[: port.start()]
    name = name.rstrip(".")
    return name if len(name) <= 253 and _HOST_NAME.fullmatch(name) else None


class WebConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)  # 0: any free port
    public_url: HttpUrl = "http://localhost:8765"
    # Serve the console on a non-loopback address over plain HTTP (tokens and sessions in the clear).
    allow_insecure_http: bool = False
    # Reverse proxies whose X-Forwarded-For / Forwarded is believed (addresses or CIDRs); none: the socket's peer
    # is the client.
    trusted_proxies: list[str] = Field(default_factory=list)
    # Names the console also answers to, besides public_url's host, localhost and IP addresses (a request for
    # any other name is refused: DNS rebinding); a service name a scraper uses, a second name at the proxy.
    allowed_hosts: list[str] = Field(default_factory=list)
    # The console's transcript of every conversation: messages older than this go at the retention sweep (0 keeps
    # every message).
    transcript_retention_days: int = Field(default=90, ge=0, le=3650)

    @field_validator("public_url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, values: list[str]) -> list[str]:
        found: list[str] = []
        for value in values:
            try:
                found.append(str(ip_network(value.strip(), strict=False)))
            except ValueError:
                raise PydanticCustomError(
                    "kazma_web",
                    "{got} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/8, fd00::/8)",
                    {"got": repr(value)},
                ) from None
        return found

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, values: list[str]) -> list[str]:
        found: list[str] = []
        for value in values:
            name = _host_name(value)
            if name is None:
                raise PydanticCustomError(
                    "kazma_web",
                    "{got} is not a host name (e.g. kazma-a, kazma.internal; no scheme, path or spaces)",
                    {"got": repr(value)},
                )
            found.append(name)
        return found

    @model_validator(mode="after")
    def _tls_off_loopback(self) -> WebConfig:
        exposed = self.host not in _LOOPBACK_HOSTS and not self.host.startswith("127.")
        if exposed and self.public_url.startswith("http://") and not self.allow_insecure_http:
            raise PydanticCustomError(
                "kazma_web",
                "the console listens on {host} but public_url is http://: logins and sessions would cross the "
                "network in the clear. Put it behind HTTPS (public_url: https://…), listen on 127.0.0.1, or set "
                "web.allow_insecure_http: true",
                {"subpath": "public_url", "host": self.host},
            )
        return self


class ModelConfig(Strict):
    base_url: HttpUrl = "http://127.0.0.1:11434/v1"
    api_key: str = ""
    name: str = Field(default="llama3.1", min_length=1)
    timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    max_retries: int = Field(default=3, ge=0, le=10)
    embeddings: str | None = None  # an embeddings model at the same endpoint: semantic routing for auto
    stream: bool = True  # show a reply growing while the model writes it, where the platform can edit messages


_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADER = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def _variable_name(value: Any) -> Any:
    if not isinstance(value, str):
        raise PydanticCustomError(
            "kazma_variable", "expected the name of an environment variable, got {got}", {"got": type(value).__name__}
        )
    if not _VARIABLE.match(value):
        # Where a name belongs (a header's value, an env entry) the mistake is pasting the secret itself: the
        # error line reaches the terminal, CI logs and `kazma doctor`'s report, so the value is never repeated.
        raise PydanticCustomError(
            "kazma_variable",
            "expected the name of an environment variable that holds the value (A-Z, 0-9, _), got text that is "
            "not one (not shown: it may be the secret itself)",
            {},
        )
    if value in KEY_VARIABLES:  # handed to an MCP server, the key would let it seal approvals
        raise PydanticCustomError(
            "kazma_variable", "{got} holds Kazma's own keys and is never passed to a server", {"got": value}
        )
    return value


VariableName = Annotated[str, BeforeValidator(_variable_name)]


def _on_off(value: Any) -> Any:
    """YAML reads on/off as booleans; a quoted "on"/"off" means the same."""
    if isinstance(value, str) and value.strip().lower() in ("on", "off"):
        return value.strip().lower() == "on"
    return value


class MCPServerConfig(Strict):
    """One MCP tool source: a stdio command, or a streamable-HTTP URL. Secrets only by variable name."""

    command: str = ""
    args: list[str] = Field(default_factory=list)
    env: list[VariableName] = Field(default_factory=list)  # passed from Kazma's environment, by name only
    url: str = ""
    headers: dict[str, VariableName] = Field(default_factory=dict)  # header name -> variable holding its value
    call_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    start_timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    max_output_chars: int = Field(default=MAX_TOOL_OUTPUT_CHARS, ge=256, le=1_000_000)
    # The most Kazma reads of one message from the server; a longer answer is cut off unread.
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=256 * 1024 * 1024)
    # A stdio server runs in bubblewrap unless it says ``none``; there is no "auto": a server never
    # falls back to running unsandboxed because bubblewrap is missing.
    sandbox: Literal["bwrap", "none"] = "bwrap"
    network: Annotated[bool, BeforeValidator(_on_off)] = False
    read_only: list[Path] = Field(default_factory=list)  # more paths the sandboxed server may read
    writable: list[Path] = Field(default_factory=list)  # paths it may also change

    @field_validator("sandbox", mode="before")
    @classmethod
    def _no_auto(cls, value: Any) -> Any:
        if value == "auto":
            raise PydanticCustomError(
                "kazma_mcp",
                "expected bwrap or none, got 'auto': an MCP server never falls back to running unsandboxed; "
                "say none to choose that for this server",
                {},
            )
        return value

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, value: str) -> str:
        return lower_scheme(value) if _HTTP_URL.match(value) else value  # anything else: refused with its transport

    @field_validator("read_only", "writable")
    @classmethod
    def _absolute(cls, value: list[Path]) -> list[Path]:
        for path in value:
            if not path.is_absolute():
                raise PydanticCustomError("kazma_mcp", "expected an absolute path, got {got}", {"got": str(path)})
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if bool(self.command) == bool(self.url):
            raise PydanticCustomError("kazma_mcp", "give exactly one of command (stdio) or url (streamable HTTP)", {})
        if self.url and not _HTTP_URL.match(self.url):
            raise PydanticCustomError(
                "kazma_url", "expected an http(s) URL, got {got}", {"subpath": "url", "got": repr(self.url)}
            )
        for header in self.headers:
            if not _HEADER.match(header):
                raise PydanticCustomError(
                    "kazma_mcp", "not a header name: {got}", {"subpath": "headers", "got": repr(header)}
                )
        if self.url and (self.args or self.env):
            raise PydanticCustomError("kazma_mcp", "args and env are for stdio servers (command)", {})
        stdio_only = {"sandbox", "network", "read_only", "writable"} & self.model_fields_set
        if self.url and stdio_only:
            raise PydanticCustomError(
                "kazma_mcp",
                "only for stdio servers (command), which Kazma runs itself: {keys}",
                {"keys": ", ".join(sorted(stdio_only))},
            )
        shaping = {"network", "read_only", "writable"} & self.model_fields_set
        if self.sandbox == "none" and shaping:
            raise PydanticCustomError(
                "kazma_mcp",
                "with sandbox: none there is no sandbox for {keys} to shape: the server reaches everything "
                "Kazma's user can",
                {"keys": ", ".join(sorted(shaping))},
            )
        if self.command and self.headers:
            raise PydanticCustomError("kazma_mcp", "headers are for HTTP servers (url)", {"subpath": "headers"})
        return self


API_ROLES = ("approval_requester", "approval_viewer")
ApiRole = Literal["approval_requester", "approval_viewer"]


class ApiTokenConfig(Strict):
    """A machine's token for ``/api/v1`` and ``/mcp``: never a console login."""

    token: str
    roles: list[ApiRole] = Field(default_factory=lambda: list[ApiRole](["approval_requester"]))
    # Requests of this token pending at once; one more is refused (429) until a person decides one or one ends.
    max_pending: int = Field(default=10, ge=1, le=10_000)
    # The person (or identity) whose token this is: under a policy with forbid_requester they cannot approve
    # what the token asks. None: the token is nobody's, and forbid_requester forbids nobody for it.
    owner: Approver | None = None

    @field_validator("token")
    @classmethod
    def _long(cls, value: str) -> str:
        if len(value) < 32:
            raise PydanticCustomError(
                "kazma_token", "an API token needs at least 32 characters, got {got}", {"got": len(value)}
            )
        return value


class ApiConfig(Strict):
    tokens: dict[str, ApiTokenConfig] = Field(default_factory=dict)

    @field_validator("tokens")
    @classmethod
    def _names(cls, value: dict[str, ApiTokenConfig]) -> dict[str, ApiTokenConfig]:
        for name in value:
            _check_agent_name(name)
        seen: set[str] = set()
        for name, item in value.items():
            if item.token in seen:
                raise PydanticCustomError("kazma_token", "two API tokens are the same", {"subpath": name})
            seen.add(item.token)
        return value


class LeadAgentConfig(Strict):
    name: str = "kazma"
    system_prompt: str = (
        "You are the lead agent of a small team. Plan multi-step work as a plan and "
        "hand each step to the sub-agent best suited to it."
    )
    tools: list[str] = Field(default_factory=list)
    model: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_agent_name(value)


class WorkerConfig(Strict):
    system_prompt: str
    tools: list[str] = Field(default_factory=list)
    model: str | None = None
    expertise: list[str] = Field(default_factory=list)


def _check_agent_name(value: str) -> str:
    if not _WORKER_NAME.match(value):
        raise PydanticCustomError(
            "kazma_name",
            "expected a lowercase name of letters, digits, '-' or '_' (at most 32), got {got}",
            {"got": repr(value)},
        )
    return value


def _default_workers() -> dict[str, WorkerConfig]:
    return {
        "researcher": WorkerConfig(
            system_prompt="You research the task, gather facts and sources, and summarise them briefly.",
            tools=["http_get", "read_file"],
            expertise=["research", "search", "sources", "facts"],
        ),
        "refiner": WorkerConfig(
            system_prompt="You turn research into a precise, buildable specification.",
            tools=["read_file"],
            expertise=["specification", "requirements", "design"],
        ),
        "builder": WorkerConfig(
            system_prompt="You build what the specification asks for in the workspace.",
            tools=["shell", "write_file", "read_file"],
            expertise=["code", "build", "implement", "script"],
        ),
        "validator": WorkerConfig(
            system_prompt="You check the result against the request and report what is missing.",
            tools=["read_file", "shell"],
            expertise=["test", "review", "validate", "check"],
        ),
    }


class AgentsConfig(Strict):
    lead: LeadAgentConfig = Field(default_factory=LeadAgentConfig)
    workers: dict[str, WorkerConfig] = Field(default_factory=_default_workers)
    # Plans that finished or were aborted longer ago than this go at the retention sweep, with their steps, events
    # and questions (0 keeps every plan); an active plan is never pruned.
    plan_retention_days: int = Field(default=90, ge=0, le=3650)

    @field_validator("workers")
    @classmethod
    def _worker_names(cls, value: dict[str, WorkerConfig]) -> dict[str, WorkerConfig]:
        for name in value:
            _check_agent_name(name)
            if name == "auto":
                raise PydanticCustomError(
                    "kazma_name", "'auto' is reserved: /swarm dispatch auto picks a worker", {"subpath": name}
                )
        return value

    @model_validator(mode="after")
    def _lead_not_worker(self) -> AgentsConfig:
        if self.lead.name in self.workers:
            raise PydanticCustomError(
                "kazma_name",
                "the lead agent's name {name} is also a worker's name",
                {"name": repr(self.lead.name), "subpath": "lead.name"},
            )
        return self


def _approver(value: Any) -> Any:
    """A raw identity (``telegram:111``), or the name of a person or group under ``people:`` (checked there)."""
    if isinstance(value, str) and PERSON_NAME.fullmatch(value):
        return value
    if not isinstance(value, str) or ":" not in value:
        raise PydanticCustomError(
            "kazma_approver",
            "expected '<platform>:<user id>' (platform one of {platforms}) or a person or group under people:, "
            "got {got}",
            {"platforms": ", ".join(APPROVER_PLATFORMS), "got": repr(value)},
        )
    try:
        actor: Actor | None = Actor.parse(value)
    except ActorError:
        actor = None
    if actor is None or actor.platform not in APPROVER_PLATFORMS:
        raise PydanticCustomError(
            "kazma_approver",
            "expected '<platform>:<user id>' (platform one of {platforms}), got {got}",
            {"platforms": ", ".join(APPROVER_PLATFORMS), "got": repr(value)},
        )
    problem = user_id_problem(actor.platform, actor.user)
    if problem is not None:
        raise PydanticCustomError("kazma_approver", "{problem}, got {got}", {"problem": problem, "got": repr(value)})
    return value


Approver = Annotated[str, BeforeValidator(_approver)]


def _identity(value: Any) -> Any:
    """A raw identity only (``telegram:111``): where the name of a person would mean nothing to the reader."""
    if isinstance(value, str) and PERSON_NAME.fullmatch(value):
        raise PydanticCustomError(
            "kazma_approver", "expected '<platform>:<user id>' here, got the name {got}", {"got": repr(value)}
        )
    return _approver(value)


Identity = Annotated[str, BeforeValidator(_identity)]


class RememberConfig(Strict):
    """The "Approve for 1 h" button: a rule that lets the identical call run again in its conversation."""

    enabled: bool = False
    max_seconds: int = Field(default=3600, ge=60, le=MAX_REMEMBER_SECONDS)


DEFAULT_POLICY = "default"


class PolicyConfig(Strict):
    """``approvals.policies.<name>``: how many people decide a call, who they may be, and how they prove it."""

    approve: int = Field(default=1, ge=1, le=20)  # distinct people who must approve
    deny: int = Field(default=1, ge=1, le=20)  # distinct people whose denial ends it (reached first: denied)
    # Who may decide under this policy (people, groups, identities); empty: approvals.approvers and the admins.
    approvers: list[Approver] = Field(default_factory=list)
    # The person whose message started the work (or an API token's owner) cannot approve it.
    forbid_requester: bool = False
    # Approve only on the approval page, after a fresh passkey assertion with user verification.
    step_up: bool = False
    # Where its cards go: chats ("telegram:-100…") and direct messages ({dm: alice, via: telegram}); None: every
    # platform's home chat (see kazma.config.card_routes).
    to: list[Annotated[RouteEntry, PlainValidator(parse_route_entry)]] | None = None

    @property
    def single(self) -> bool:
        """One press decides (today's behaviour): remembered approvals may apply."""
        return self.approve == 1 and not self.step_up


class ApprovalsConfig(Strict):
    deadline_seconds: int = Field(default=600, gt=0, le=7 * 24 * 3600)
    approvers: list[Approver] = Field(default_factory=list)
    value_limit: int = Field(default=500, ge=16, le=4000)
    # Approve in chat even when a card shows less than the whole call (a value cut, names only): off,
    # because what a person approves must be what they could see. Such calls are approved on their page.
    approve_cut_in_chat: bool = False
    remember: RememberConfig = Field(default_factory=RememberConfig)
    # Who is at the command line: "system": cli:<the system user running it> (--as may only confirm it);
    # "declared": --as LOGIN as typed (a shared system account, where the user proves nothing).
    cli_identity: Literal["system", "declared"] = "system"
    # Named policies, picked by tools.<name>: {policy: …} and API requests' "policy"; "default" (when given)
    # applies to every dangerous call that names none, else one press by an approver decides (today's rule).
    policies: dict[str, PolicyConfig] = Field(default_factory=dict)

    @field_validator("policies")
    @classmethod
    def _policy_names(cls, value: dict[str, PolicyConfig]) -> dict[str, PolicyConfig]:
        for name in value:
            if not _WORKER_NAME.match(name):
                raise PydanticCustomError(
                    "kazma_name",
                    "expected a lowercase name of letters, digits, '-' or '_' (at most 32), got {got}",
                    {"got": repr(name), "subpath": name},
                )
        return value


# Who may talk to the lead in a direct message: nobody ("off"), the platform's approvers ("approvers": the
# approvals.approvers written for it and its admins), or the listed actors ("telegram:111", …).
DmPolicy = Literal["off", "approvers"] | list[Identity]


class FilesConfig(Strict):
    """``files:``: what Kazma accepts as attachments (over either bound: a reply, nothing saved)."""

    max_bytes: int = Field(default=DEFAULT_FILE_BYTES, ge=1, le=2048 * MIB)
    max_count: int = Field(default=DEFAULT_FILE_COUNT, ge=0, le=100)


class TelegramWebhookConfig(Strict):
    url: str = ""
    secret_token: str = ""
    listen: str = "127.0.0.1"
    port: int = Field(default=8443, ge=1, le=65535)
    path: str = "/telegram"


class TelegramConfig(Strict):
    token: str = ""
    api_base_url: HttpUrl = "https://api.telegram.org"
    mode: Literal["polling", "webhook"] = "polling"
    webhook: TelegramWebhookConfig = Field(default_factory=TelegramWebhookConfig)
    chats: list[TelegramChat] = Field(default_factory=list)
    home_chat: OptionalTelegramChatId = None
    admins: list[TelegramUserId] = Field(default_factory=list)
    dm_policy: DmPolicy = "off"
    # The short name of the bot's Mini App at @BotFather (its URL: <web.public_url>/telegram/app): cards in
    # groups then open the approval page inside Telegram. Empty: only cards in a private chat do.
    mini_app: str = Field(default="", pattern=r"^([A-Za-z0-9_]{3,30})?$")

    @field_validator("api_base_url")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.rstrip("/")

    @model_validator(mode="after")
    def _webhook_needs_secret(self) -> TelegramConfig:
        if self.token and self.mode == "webhook":
            if not self.webhook.url:
                raise PydanticCustomError(
                    "kazma_webhook", "required when mode is 'webhook'", {"subpath": "webhook.url"}
                )
            if not self.webhook.secret_token:
                raise PydanticCustomError(
                    "kazma_webhook", "required when mode is 'webhook'", {"subpath": "webhook.secret_token"}
                )
        return self


class SlackHttpConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=3000, ge=0, le=65535)  # 0: any free port
    path: str = "/slack/events"


def _slack_channel(value: Any) -> Any:
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or not _SLACK_CHANNEL.match(value):
        raise PydanticCustomError(
            "kazma_slack_channel", "expected a Slack channel id like C0123456789, got {got}", {"got": repr(value)}
        )
    return value


def _slack_user(value: Any) -> Any:
    if not isinstance(value, str) or not _SLACK_USER.match(value):
        raise PydanticCustomError(
            "kazma_slack_user", "expected a Slack user id like U0123456789, got {got}", {"got": repr(value)}
        )
    return value


def _slack_channel_or_every(value: Any) -> Any:
    return value if value == EVERY_CHAT else _slack_channel(value)


SlackChannel = Annotated[str, BeforeValidator(_slack_channel)]
SlackChannelOrEvery = Annotated[str, BeforeValidator(_slack_channel_or_every)]
SlackUser = Annotated[str, BeforeValidator(_slack_user)]


class SlackSignInConfig(Strict):
    """``platforms.slack.sign_in``: Sign in with Slack (OpenID Connect) on the console, for people whose Slack
    identity is known. Off while ``client_id`` is empty."""

    client_id: str = ""
    client_secret: str = ""
    team_id: str = ""  # the workspace whose people may sign in: an id token for another is refused
    authorize_url: HttpUrl = "https://slack.com/openid/connect/authorize"
    keys_url: HttpUrl = "https://slack.com/openid/connect/keys"

    @model_validator(mode="after")
    def _complete(self) -> SlackSignInConfig:
        if self.client_id and not self.client_secret:
            raise PydanticCustomError("kazma_sign_in", "required with client_id", {"subpath": "client_secret"})
        if self.client_id and not re.fullmatch(r"[TE][A-Z0-9]{2,31}", self.team_id):
            raise PydanticCustomError(
                "kazma_sign_in",
                "required with client_id: the workspace's id, T followed by capital letters and digits, got {got}",
                {"subpath": "team_id", "got": repr(self.team_id)},
            )
        return self

    @property
    def on(self) -> bool:
        return bool(self.client_id)


class SlackConfig(Strict):
    bot_token: str = ""
    app_token: str = ""
    signing_secret: str = ""
    api_base_url: HttpUrl = "https://slack.com/api/"
    http: SlackHttpConfig = Field(default_factory=SlackHttpConfig)
    channels: list[SlackChannelOrEvery] = Field(default_factory=list)
    home_channel: SlackChannel = ""
    admins: list[SlackUser] = Field(default_factory=list)
    dm_policy: DmPolicy = "off"
    sign_in: SlackSignInConfig = Field(default_factory=SlackSignInConfig)

    @field_validator("api_base_url")
    @classmethod
    def _trailing_slash(cls, value: str) -> str:
        # slack-sdk joins method names with urljoin: without the slash the last
        # path segment would be replaced.
        return value if value.endswith("/") else value + "/"

    @model_validator(mode="after")
    def _http_needs_secret(self) -> SlackConfig:
        if self.bot_token.startswith("xapp-"):  # the one mix-up that can never work: say so before anything else
            raise PydanticCustomError(
                "kazma_slack_token",
                "{problem}",
                {"subpath": "bot_token", "problem": slack_bot_token_problem(self.bot_token)},
            )
        if self.bot_token and not self.app_token and not self.signing_secret:
            raise PydanticCustomError(
                "kazma_slack_mode",
                "required for HTTP events (or set app_token to use Socket Mode)",
                {"subpath": "signing_secret"},
            )
        if self.app_token and not self.app_token.startswith("xapp-"):
            raise PydanticCustomError(
                "kazma_slack_mode",
                "{problem}",
                {"subpath": "app_token", "problem": slack_app_token_problem(self.app_token)},
            )
        return self


class DiscordSignInConfig(Strict):
    """``platforms.discord.sign_in``: Discord OAuth2 (scope ``identify``) on the console, for people whose Discord
    identity is known. Off while ``client_id`` is empty."""

    client_id: str = ""
    client_secret: str = ""
    authorize_url: HttpUrl = "https://discord.com/oauth2/authorize"

    @model_validator(mode="after")
    def _complete(self) -> DiscordSignInConfig:
        if self.client_id and not self.client_secret:
            raise PydanticCustomError("kazma_sign_in", "required with client_id", {"subpath": "client_secret"})
        return self

    @property
    def on(self) -> bool:
        return bool(self.client_id)


class DiscordConfig(Strict):
    token: str = ""
    api_base_url: HttpUrl = "https://discord.com/api/v10"
    gateway_url: Annotated[str, BeforeValidator(_ws_url)] = ""
    channels: list[DiscordChannel] = Field(default_factory=list)
    guilds: list[DiscordSnowflake] = Field(default_factory=list)  # empty: the served channels' own servers
    home_channel: OptionalDiscordSnowflake = None
    admins: list[DiscordSnowflake] = Field(default_factory=list)
    dm_policy: DmPolicy = "off"
    sign_in: DiscordSignInConfig = Field(default_factory=DiscordSignInConfig)

    @field_validator("api_base_url")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.rstrip("/")


def _matrix_id(kind: str, valid: Any, example: str, *, every: bool = False, empty: bool = False) -> Any:
    def check(value: Any) -> Any:
        if (every and value == EVERY_CHAT) or (empty and value in (None, "")):
            return value or ""
        if isinstance(value, str) and valid(value.strip()):
            return value.strip()
        raise PydanticCustomError(
            "kazma_matrix_id", "expected a Matrix {kind} like {example}, got {got}",
            {"kind": kind, "example": example, "got": repr(value)},
        )  # fmt: skip

    return BeforeValidator(check)


MatrixRoom = Annotated[str, _matrix_id("room id", matrix_ids.is_chat_id, "!AbCdEf:example.org", empty=True)]
MatrixRoomOrEvery = Annotated[
    str, _matrix_id("room id or '*' for every room", matrix_ids.is_chat_id, "!AbCdEf:example.org", every=True)
]
MatrixUser = Annotated[str, _matrix_id("user id", matrix_ids.is_user_id, "@alice:example.org")]
OptionalMatrixUser = Annotated[str, _matrix_id("user id", matrix_ids.is_user_id, "@kazma:example.org", empty=True)]


class MatrixConfig(Strict):
    """``platforms.matrix``: a bot account on a homeserver (its access token), the rooms it serves."""

    homeserver: str = ""  # the client-server API's base URL, e.g. https://matrix.example.org
    user_id: OptionalMatrixUser = ""  # the bot's account; checked against what the homeserver says the token is
    access_token: str = ""
    rooms: list[MatrixRoomOrEvery] = Field(default_factory=list)
    home_room: MatrixRoom = ""
    admins: list[MatrixUser] = Field(default_factory=list)
    dm_policy: DmPolicy = "off"

    @field_validator("homeserver")
    @classmethod
    def _url(cls, value: str) -> str:
        if value and not _HTTP_URL.match(value):
            raise PydanticCustomError("kazma_url", "expected an http(s) URL, got {got}", {"got": repr(value)})
        return lower_scheme(value).rstrip("/")

    @model_validator(mode="after")
    def _complete(self) -> MatrixConfig:
        if self.access_token and not self.homeserver:
            raise PydanticCustomError(
                "kazma_matrix", "required with access_token: the homeserver's URL", {"subpath": "homeserver"}
            )
        return self


class PlatformsConfig(Strict):
    telegram: TelegramConfig = Field(default_factory=TelegramConfig)
    slack: SlackConfig = Field(default_factory=SlackConfig)
    discord: DiscordConfig = Field(default_factory=DiscordConfig)
    matrix: MatrixConfig = Field(default_factory=MatrixConfig)


class SwarmWorkerSettings(Strict):
    """``swarm.workers.<name>``: one worker's own reliability settings (unset: the swarm's)."""

    breaker_threshold: int | None = Field(default=None, ge=1, le=100)
    breaker_cooldown_seconds: float | None = Field(default=None, gt=0, le=86400)
    retries: int | None = Field(default=None, ge=0, le=10)  # retries after the first attempt
    timeout_seconds: int | None = Field(default=None, ge=1, le=3600)
    max_concurrent: int | None = Field(default=None, ge=1, le=1024)  # calls of this worker at once, every task


@dataclass(frozen=True)
class WorkerReliability:
    """What one worker really runs with: its own ``swarm.workers.<name>`` settings over the swarm's."""

    worker: str
    retries: int  # after the first attempt: ``retries + 1`` calls at most
    retry_base_seconds: float
    retry_cap_seconds: float
    retry_jitter: bool
    timeout_seconds: int
    breaker_threshold: int
    breaker_cooldown_seconds: float
    task_concurrency: int  # calls of one task at once
    max_concurrent: int | None  # calls of this worker at once across tasks (None: only the process cap)
    max_parallel_workers: int  # calls at once in the process, every task and worker together

    def line(self) -> str:
        jitter = ", jitter" if self.retry_jitter else ""
        own = "no limit of its own" if self.max_concurrent is None else f"at most {self.max_concurrent} at once"
        return (
            f"retries {self.retries} (backoff {self.retry_base_seconds:g} s doubling to {self.retry_cap_seconds:g} s"
            f"{jitter}), timeout {self.timeout_seconds} s, breaker {self.breaker_threshold} failures then "
            f"{self.breaker_cooldown_seconds:g} s rest, concurrency {own}, {self.task_concurrency} per task, "
            f"{self.max_parallel_workers} in the process"
        )


# Keys that were renamed: the old name is refused with the new one, never silently ignored.
_RENAMED_SWARM_KEYS = {
    "routing_floor": "replaced by swarm.routing_margin: semantic routing takes the best worker only when it leads "
    "the runner-up by the margin (default 0.045), and refuses ambiguous tasks",
}


class SwarmConfig(Strict):
    step_timeout_seconds: int = Field(default=300, ge=1, le=3600)
    task_deadline_seconds: int = Field(default=1800, ge=1, le=86400)  # a whole task, every step and retry
    max_parallel: int = Field(default=8, ge=1, le=1000)  # tasks running at once (resumed pipelines included)
    task_concurrency: int = Field(default=5, ge=1, le=64)  # worker calls of one task at once
    max_parallel_workers: int = Field(default=64, ge=1, le=1024)  # worker calls at once in the process
    max_workers: int = Field(default=MAX_WORKERS, ge=1, le=MAX_WORKERS)
    max_paused_pipelines: int = Field(default=100, ge=0, le=100)
    retention_days: int = Field(default=30, ge=0, le=3650)  # 0 keeps every task
    retention_sweep_seconds: int = Field(default=3600, ge=1, le=86400)
    breaker_threshold: int = Field(default=5, ge=1, le=100)
    breaker_cooldown_seconds: float = Field(default=60.0, gt=0, le=86400)
    retries: int = Field(default=3, ge=0, le=10)
    retry_base_seconds: float = Field(default=1.0, gt=0, le=3600)
    retry_cap_seconds: float = Field(default=60.0, gt=0, le=86400)
    retry_jitter: bool = True
    workers: dict[str, SwarmWorkerSettings] = Field(default_factory=dict)
    schemas: dict[str, dict[str, Any]] = Field(default_factory=dict)  # named output schemas for --expect
    routing_margin: float = Field(default=0.045, ge=0, le=2)  # how far the best worker must lead the runner-up
    routing_deadline_seconds: float = Field(default=5.0, gt=0, le=120)
    prompt_price_per_thousand: float = Field(default=0.0, ge=0)
    completion_price_per_thousand: float = Field(default=0.0, ge=0)
    allow_shared_operators: bool = False
    checkpoints: dict[str, list[int]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, message in _RENAMED_SWARM_KEYS.items():
                if key in value:
                    raise PydanticCustomError("kazma_renamed", message, {"subpath": key})
        return value

    @model_validator(mode="after")
    def _backoff(self) -> SwarmConfig:
        if self.retry_cap_seconds < self.retry_base_seconds:
            raise PydanticCustomError(
                "kazma_backoff",
                "the retry cap ({cap} s) is below the first delay, swarm.retry_base_seconds ({base} s)",
                {"subpath": "retry_cap_seconds", "cap": self.retry_cap_seconds, "base": self.retry_base_seconds},
            )
        return self

    def reliability(self, worker: str) -> WorkerReliability:
        """The settings ``worker`` runs with: each of its own ``swarm.workers.<worker>`` values over the swarm's."""
        own = self.workers.get(worker) or SwarmWorkerSettings()
        return WorkerReliability(
            worker=worker,
            retries=self.retries if own.retries is None else own.retries,
            retry_base_seconds=self.retry_base_seconds,
            retry_cap_seconds=self.retry_cap_seconds,
            retry_jitter=self.retry_jitter,
            timeout_seconds=self.step_timeout_seconds if own.timeout_seconds is None else own.timeout_seconds,
            breaker_threshold=self.breaker_threshold if own.breaker_threshold is None else own.breaker_threshold,
            breaker_cooldown_seconds=self.breaker_cooldown_seconds
            if own.breaker_cooldown_seconds is None
            else own.breaker_cooldown_seconds,
            task_concurrency=self.task_concurrency,
            max_concurrent=own.max_concurrent,
            max_parallel_workers=self.max_parallel_workers,
        )


# The built-in tools and the level each has unless ``tools:`` says otherwise. Tools that change or run
# things on this host are dangerous, and lowering them needs ``tools.allow_unapproved`` (see below).
BUILTIN_TOOLS: dict[str, DangerLevel] = {
    "read_file": DangerLevel.READ,
    "http_get": DangerLevel.READ,
    "write_file": DangerLevel.DANGEROUS,
    "shell": DangerLevel.DANGEROUS,
    "send_file": DangerLevel.WRITE,
}
# Tools Kazma adds to agents itself (never listed under agents.*.tools).
INTERNAL_TOOLS = ("write_plan", "dispatch_swarm", "check_swarm_task")
_TOOL_SETTINGS = ("sandbox", "shell_network", "workspace_root", "allow_unapproved")


class ToolsConfig(Strict):
    """``tools:``: danger levels by tool name, plus how the built-in tools run."""

    levels: dict[str, DangerLevel] = Field(default_factory=lambda: dict(BUILTIN_TOOLS))
    sandbox: Literal["auto", "bwrap", "none"] = "auto"
    shell_network: Annotated[bool, BeforeValidator(_on_off)] = False
    workspace_root: Path | None = None
    allow_unapproved: list[str] = Field(default_factory=list)
    # tool name (or an MCP server's "server/*") -> the approvals policy its calls are decided under
    policies: dict[str, str] = Field(default_factory=dict)

    def workspaces(self, store_path: Path) -> Path:
        """Where conversations' workspaces live: ``workspace_root``, or a sibling of the store's folder."""
        if self.workspace_root is not None:
            return self.workspace_root
        state = store_path.parent
        return state.parent / f"{state.name or 'kazma'}-workspaces"


def _admins(people: PeopleConfig, platform: str, admins: list[Any]) -> list[Any]:
    """A platform's ``admins`` with every person's or group's name replaced by their ids on that platform."""
    resolved: list[Any] = []
    for position, admin in enumerate(admins):
        if not (isinstance(admin, str) and PERSON_NAME.fullmatch(admin)):
            resolved.append(admin)
            continue
        where = f"platforms.{platform}.admins[{position}]"
        if not people.knows(admin):
            raise PydanticCustomError(
                "kazma_people",
                "unknown person or group {name} (people: {known})",
                {"subpath": where, "name": repr(admin), "known": ", ".join(people.persons) or "none configured"},
            )
        ids = sorted(people.identities_on(admin, platform))
        if not ids:
            raise PydanticCustomError(
                "kazma_people",
                "{name} has no {platform} identity under people: (add people.<name>.{platform})",
                {"subpath": where, "name": repr(admin), "platform": platform},
            )
        resolved += [Actor.parse(identity).user for identity in ids]
    return resolved


def _tool_entry(key: str, item: dict[str, Any]) -> tuple[DangerLevel | None, str]:
    """``tools.<name>: {level: dangerous, policy: two-people}``: the level (None: not given, for a pattern) and
    the policy. A policy decides approvals, so only a dangerous tool takes one."""
    unknown = sorted(set(item) - {"level", "policy"})
    if unknown:
        raise PydanticCustomError(
            "kazma_tool", "unknown key {key} (a tool takes level and policy)", {"subpath": f"{key}.{unknown[0]}",
                                                                                "key": repr(unknown[0])},
        )  # fmt: skip
    policy = item.get("policy")
    if not isinstance(policy, str) or not policy:
        raise PydanticCustomError(
            "kazma_tool", "expected the name of a policy under approvals.policies, got {got}",
            {"subpath": f"{key}.policy", "got": repr(policy)},
        )  # fmt: skip
    pattern = key.endswith("/*")
    if "*" in key and not pattern:
        raise PydanticCustomError(
            "kazma_tool", "a pattern is an MCP server's tools, written server/*, got {got}",
            {"subpath": key, "got": repr(key)},
        )  # fmt: skip
    written = item.get("level", None if pattern else DangerLevel.DANGEROUS.value)
    if written is None:
        return None, policy
    if written != DangerLevel.DANGEROUS.value:
        raise PydanticCustomError(
            "kazma_tool", "a policy decides approvals, and only a dangerous tool asks for one; got level {got}",
            {"subpath": f"{key}.level", "got": repr(written)},
        )  # fmt: skip
    if pattern:
        raise PydanticCustomError(
            "kazma_tool", "an MCP server's tools are dangerous unless classified one by one: give only policy",
            {"subpath": f"{key}.level"},
        )  # fmt: skip
    return DangerLevel.DANGEROUS, policy


def _default_pipelines() -> dict[str, list[str]]:
    return {
        "standard": ["researcher", "refiner", "builder", "validator"],
        "quick": ["researcher", "builder"],
    }


class KazmaConfig(Strict):
    store: StoreConfig = Field(default_factory=StoreConfig)
    web: WebConfig = Field(default_factory=WebConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    agents: AgentsConfig = Field(default_factory=AgentsConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    approvals: ApprovalsConfig = Field(default_factory=ApprovalsConfig)
    platforms: PlatformsConfig = Field(default_factory=PlatformsConfig)
    pipelines: dict[str, list[str]] = Field(default_factory=_default_pipelines)
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    mcp_servers: dict[str, MCPServerConfig] = Field(default_factory=dict)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    api: ApiConfig = Field(default_factory=ApiConfig)
    files: FilesConfig = Field(default_factory=FilesConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    people: PeopleConfig = Field(default_factory=PeopleConfig)
    # The file this was read from, set by the loader: a problem met later (a store that cannot be opened) names the
    # file really used (-c other.yaml, $KAZMA_CONFIG), not kazma.yaml. Not a setting: no key can write it.
    _source: str = PrivateAttr(default="kazma.yaml")

    @property
    def source(self) -> str:
        """The name of the file this configuration was read from (``kazma.yaml`` when read from text)."""
        return self._source

    @model_validator(mode="before")
    @classmethod
    def _people_first(cls, data: Any) -> Any:
        """``people:`` is read before the rest, so a platform's ``admins`` may name a person or a group: each
        name becomes that person's (or each member's) ids on that platform."""
        if not isinstance(data, dict):
            return data
        written = data.get("people")
        people = written if isinstance(written, PeopleConfig) else PeopleConfig(**parse_people(written))
        platforms = data.get("platforms")
        if isinstance(platforms, dict):
            platforms = dict(platforms)
            for name in CHAT_PLATFORMS:
                section = platforms.get(name)
                if isinstance(section, dict) and isinstance(section.get("admins"), list):
                    platforms[name] = {**section, "admins": _admins(people, name, section["admins"])}
            data = {**data, "platforms": platforms}
        return {**data, "people": people}

    @field_validator("mcp_servers")
    @classmethod
    def _server_names(cls, value: dict[str, MCPServerConfig]) -> dict[str, MCPServerConfig]:
        for name in value:
            _check_agent_name(name)
        return value

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in value:
            _check_agent_name(name)
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_levels(cls, value: Any) -> Any:
        """``tools:`` mixes two kinds of key: settings, and tool names with their level (over the defaults)."""
        if not isinstance(value, dict):
            return value
        names = [level.value for level in DangerLevel]
        levels = dict(BUILTIN_TOOLS)
        settings: dict[str, Any] = {}
        policies: dict[str, str] = {}
        for key, item in value.items():
            if key in _TOOL_SETTINGS:
                settings[key] = item
                continue
            if isinstance(item, dict):
                level, policy = _tool_entry(str(key), item)
                policies[str(key)] = policy
                if level is not None:
                    levels[str(key)] = level
                continue
            if item not in names:
                raise PydanticCustomError(
                    "kazma_tool_level",
                    "expected one of {levels}, got {got}",
                    {"subpath": str(key), "levels": ", ".join(names), "got": repr(item)},
                )
            levels[str(key)] = DangerLevel(item)
        return {**settings, "levels": levels, "policies": policies}

    @model_validator(mode="after")
    def _approvers_name_people(self) -> KazmaConfig:
        named = (
            [(f"approvals.approvers[{i}]", r) for i, r in enumerate(self.approvals.approvers)]
            + [
                (f"approvals.policies.{name}.approvers[{i}]", r)
                for name, policy in self.approvals.policies.items()
                for i, r in enumerate(policy.approvers)
            ]
            + [(f"api.tokens.{name}.owner", t.owner) for name, t in self.api.tokens.items() if t.owner is not None]
        )
        for where, reference in named:
            if ":" not in reference and not self.people.knows(reference):
                raise PydanticCustomError(
                    "kazma_people",
                    "unknown person or group {name} (people: {known})",
                    {
                        "subpath": where,
                        "name": repr(reference),
                        "known": ", ".join([*self.people.persons, *self.people.groups]) or "none configured",
                    },
                )
        for name, token in self.api.tokens.items():
            if token.owner is not None and token.owner in self.people.groups:
                # forbid_requester compares the person pressing with the owner: a group's name is no person's,
                # so it would forbid nobody, its members' own Approve included
                raise PydanticCustomError(
                    "kazma_people",
                    "{name} is a group: a token's owner is one person (or an identity), whom forbid_requester "
                    "refuses; give each person their own token",
                    {"subpath": f"api.tokens.{name}.owner", "name": repr(token.owner)},
                )
        return self

    @model_validator(mode="after")
    def _policies_can_be_met(self) -> KazmaConfig:
        for name, policy in self.approvals.policies.items():
            where = f"approvals.policies.{name}"
            for problem, key in [*policy_problems(self, name, policy), *route_problems(self, name, policy)]:
                raise PydanticCustomError(
                    "kazma_policy", "{problem}", {"subpath": f"{where}.{key}", "problem": problem}
                )
        for tool, name in self.tools.policies.items():
            if name not in self.approvals.policies:
                raise PydanticCustomError(
                    "kazma_policy",
                    "unknown policy {name} (approvals.policies: {known})",
                    {"subpath": f"tools.{tool}.policy", "name": repr(name),
                     "known": ", ".join(self.approvals.policies) or "none configured"},
                )  # fmt: skip
        return self

    @model_validator(mode="after")
    def _pipelines_name_workers(self) -> KazmaConfig:
        known = sorted(self.agents.workers)
        seen: dict[str, str] = {}
        for name in self.pipelines:
            # a preset is named in any case on every surface, as a worker is: two such names would be one
            earlier = seen.setdefault(name.lower(), name)
            if earlier != name:
                raise PydanticCustomError(
                    "kazma_pipeline",
                    "{earlier} and {name} differ only in case; a preset is named in any case, so rename one",
                    {"subpath": f"pipelines.{name}", "earlier": repr(earlier), "name": repr(name)},
                )
        for name, stages in self.pipelines.items():
            if not stages:
                raise PydanticCustomError(
                    "kazma_pipeline", "a pipeline needs at least one worker", {"subpath": f"pipelines.{name}"}
                )
            for position, worker in enumerate(stages):
                if worker not in self.agents.workers:
                    raise PydanticCustomError(
                        "kazma_pipeline",
                        "unknown worker {worker} (workers: {known})",
                        {
                            "subpath": f"pipelines.{name}[{position}]",
                            "worker": repr(worker),
                            "known": ", ".join(known) or "none configured",
                        },
                    )
        for name, after in self.swarm.checkpoints.items():
            if name not in self.pipelines:
                raise PydanticCustomError(
                    "kazma_checkpoint",
                    "unknown pipeline {name} (pipelines: {known})",
                    {"subpath": f"swarm.checkpoints.{name}", "name": repr(name), "known": ", ".join(self.pipelines)},
                )
            stages = self.pipelines[name]
            for position, stage in enumerate(after):
                if not 1 <= stage < len(stages):
                    raise PydanticCustomError(
                        "kazma_checkpoint",
                        "a checkpoint pauses after a stage that has a next one: expected 1..{last}, got {got}",
                        {"subpath": f"swarm.checkpoints.{name}[{position}]", "last": len(stages) - 1, "got": stage},
                    )
        self._check_tools()
        for name in self.swarm.workers:
            if name not in self.agents.workers:
                raise PydanticCustomError(
                    "kazma_reference",
                    "swarm.workers names {name}, which is not a worker",
                    {"subpath": f"swarm.workers.{name}", "name": repr(name)},
                )
        if len(self.agents.workers) > self.swarm.max_workers:
            raise PydanticCustomError(
                "kazma_workers",
                "{count} workers configured, swarm.max_workers allows {limit}",
                {"subpath": "agents.workers", "count": len(self.agents.workers), "limit": self.swarm.max_workers},
            )
        return self

    def _check_tools(self) -> None:
        known = sorted({*BUILTIN_TOOLS, *self.tools.levels} - set(INTERNAL_TOOLS)) + [
            f"{server}/*" for server in self.mcp_servers
        ]
        self._check_models()
        agents = [("agents.lead.tools", self.agents.lead.tools)] + [
            (f"agents.workers.{name}.tools", worker.tools) for name, worker in self.agents.workers.items()
        ]
        for where, tools in agents:
            for position, tool in enumerate(tools):
                if tool in INTERNAL_TOOLS:
                    raise PydanticCustomError(
                        "kazma_tool",
                        "{tool} is one of Kazma's own tools and is given to the lead by Kazma itself: remove it",
                        {"subpath": f"{where}[{position}]", "tool": repr(tool)},
                    )
                server, slash, _ = tool.partition("/")
                if slash and server in self.mcp_servers:
                    continue  # an MCP tool (or server/*): its tools are known only once the server answers
                if tool not in BUILTIN_TOOLS and tool not in self.tools.levels:
                    raise PydanticCustomError(
                        "kazma_tool",
                        "unknown tool {tool} (known tools: {known})",
                        {"subpath": f"{where}[{position}]", "tool": repr(tool), "known": ", ".join(known)},
                    )
        for position, tool in enumerate(self.tools.allow_unapproved):
            if tool not in BUILTIN_TOOLS:
                raise PydanticCustomError(
                    "kazma_tool",
                    "{tool} is not a built-in tool (allow_unapproved names built-in dangerous tools: {builtin})",
                    {
                        "subpath": f"tools.allow_unapproved[{position}]",
                        "tool": repr(tool),
                        "builtin": ", ".join(t for t, level in BUILTIN_TOOLS.items() if level is DangerLevel.DANGEROUS),
                    },
                )
        for tool, floor in BUILTIN_TOOLS.items():
            level = self.tools.levels.get(tool, floor)
            lowered = floor is DangerLevel.DANGEROUS and level is not DangerLevel.DANGEROUS
            if lowered and tool not in self.tools.allow_unapproved:
                raise PydanticCustomError(
                    "kazma_tool",
                    "{tool} runs on this host without anyone approving it at level {level}; to accept that, "
                    "also list it in tools.allow_unapproved",
                    {"subpath": f"tools.{tool}", "tool": tool, "level": level.value},
                )
        if self.tools.workspace_root is not None:
            state = self.store.path.parent.resolve()
            root = self.tools.workspace_root.resolve()
            if root == state or root.is_relative_to(state):
                raise PydanticCustomError(
                    "kazma_workspace",
                    "the workspaces must be outside the store's folder {state}: a tool could reach the store",
                    {"subpath": "tools.workspace_root", "state": str(self.store.path.parent)},
                )
            keys = keys_folder(self.store.path).resolve()
            if root == keys or root.is_relative_to(keys):
                raise PydanticCustomError(
                    "kazma_workspace",
                    "the workspaces must be outside the keys folder {keys}: a tool could read the decision key",
                    {"subpath": "tools.workspace_root", "keys": str(keys_folder(self.store.path))},
                )
        self._check_mcp_paths()

    def _check_mcp_paths(self) -> None:
        """A folder given to an MCP server never shows the store's folder (writable: not even around it), nor
        the keys folder (not even around it: reading the decision key is enough to seal approvals)."""
        state = self.store.path.parent.resolve()
        keys = keys_folder(self.store.path).resolve()
        for name, server in self.mcp_servers.items():
            for key in ("read_only", "writable"):
                for position, path in enumerate(getattr(server, key)):
                    real = path.resolve()
                    inside = real == state or real.is_relative_to(state)
                    if inside or (key == "writable" and state.is_relative_to(real)):
                        raise PydanticCustomError(
                            "kazma_mcp",
                            "{path} would let the server reach the store's folder {state}",
                            {
                                "subpath": f"mcp_servers.{name}.{key}[{position}]",
                                "path": str(path),
                                "state": str(self.store.path.parent),
                            },
                        )
                    if real == keys or real.is_relative_to(keys) or keys.is_relative_to(real):
                        raise PydanticCustomError(
                            "kazma_mcp",
                            "{path} would let the server read the decision keys in {keys}",
                            {
                                "subpath": f"mcp_servers.{name}.{key}[{position}]",
                                "path": str(path),
                                "keys": str(keys_folder(self.store.path)),
                            },
                        )

    def _check_models(self) -> None:
        if not self.models:
            return
        agents = [("agents.lead.model", self.agents.lead.model)] + [
            (f"agents.workers.{name}.model", worker.model) for name, worker in self.agents.workers.items()
        ]
        for where, model in agents:
            if model is not None and model not in self.models:
                raise PydanticCustomError(
                    "kazma_model",
                    "unknown model {model} (models: {known})",
                    {"subpath": where, "model": repr(model), "known": ", ".join(self.models)},
                )

    def warnings(self) -> list[str]:
        """Settings that are allowed but risky, for ``kazma config check`` and ``kazma doctor``."""
        found = [
            f"tools.{tool} is {self.tools.levels[tool].value}: it runs on this host without approval "
            "(tools.allow_unapproved)"
            for tool in self.tools.allow_unapproved
            if self.tools.levels.get(tool) is not DangerLevel.DANGEROUS
        ]
        for name, spec in CHAT_PLATFORMS.items():
            section = spec.section(self.platforms)
            if spec.token(self.platforms) and EVERY_CHAT in getattr(section, spec.chats_key):
                found.append(
                    f"platforms.{name}.{spec.chats_key} has '*': every chat the bot is added to is served, "
                    "by anyone in it"
                )
        return found

    @cached_property
    def roster(self) -> Roster:
        """Approvers and operators per platform (see :class:`kazma.config.identity.Roster`)."""
        return Roster(self)

    def policy_name_for(self, tool: str) -> str:
        """The policy ``tool``'s calls are decided under: its own, its MCP server's (``server/*``), or default."""
        named = self.tools.policies.get(tool)
        server, slash, _ = tool.partition("/")
        if named is None and slash:
            named = self.tools.policies.get(f"{server}/*")
        return named or DEFAULT_POLICY

    @property
    def policy_names(self) -> list[str]:
        """Every policy a request may be decided under, "default" among them, by name."""
        return sorted({DEFAULT_POLICY, *self.approvals.policies})

    def policy(self, name: str) -> PolicyConfig | None:
        """The policy called ``name``; "default" is today's rule unless approvals.policies.default says more."""
        found = self.approvals.policies.get(name)
        if found is None and name == DEFAULT_POLICY:
            return self._default_policy
        return found

    @cached_property
    def _default_policy(self) -> PolicyConfig:
        # Made once: every press asks for its policy, and validating a new model cost a press ~10 µs.
        return PolicyConfig()

    def card_targets(self, policy: str | None) -> tuple[CardTarget, ...] | None:
        """Where the cards of a request under ``policy`` (None: the default) are posted; None: in every
        platform's home chat (the console's included), as before policies could route."""
        return card_targets(self, self.policy(policy or DEFAULT_POLICY))

    def danger_level(self, tool: str) -> DangerLevel:
        """The configured level; anything unclassified is dangerous (the floor)."""
        return self.tools.levels.get(tool, DangerLevel.DANGEROUS)


def policy_problems(config: KazmaConfig, name: str, policy: PolicyConfig) -> list[tuple[str, str]]:
    """Why ``policy`` can never be met with the people configured, as (problem, key under the policy)."""
    roster = Roster(config)
    deciders = roster.deciders(policy.approvers)
    people = sorted({person_key(config.people, identity) for identity in deciders})
    said = ", ".join(people) or "nobody"
    found: list[tuple[str, str]] = []
    if policy.approve > len(people):
        found.append((f"policy {name} needs {policy.approve} approvals, but only {len(people)} people may "
                      f"approve under it ({said})", "approve"))  # fmt: skip
    if policy.deny > len(people):
        found.append((f"policy {name} needs {policy.deny} denials, but only {len(people)} people may decide "
                      f"under it ({said})", "deny"))  # fmt: skip
    if policy.step_up:
        web = sorted({person_key(config.people, i) for i in deciders if i.startswith("web:")})
        if policy.approve > len(web):
            found.append((
                f"policy {name} approves only on the approval page with a passkey (step_up), which needs a web "
                f"account: {len(web)} of the people who may approve have one ({', '.join(web) or 'nobody'}), "
                f"{policy.approve} are needed",
                "step_up",
            ))  # fmt: skip
    return found
