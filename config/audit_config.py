"""``audit:`` in kazma.yaml: where the audit chain's events are streamed as they commit (``audit.sink``)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kazma.config.strict_model import StrictModel

_LOOPBACK = ("127.0.0.1", "::1", "localhost")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}$")
# What HTTP/1.1 sends as a header's value (RFC 9110 field-value, without obs-text, which httpx cannot encode): visible
# ASCII, with spaces and tabs only between visible characters (h11 refuses a value that starts or ends with one).
_HEADER_VALUE = re.compile(r"^(?:[\x21-\x7e](?:[\x21-\x7e \t]*[\x21-\x7e])?)?$")


def _port(parts: SplitResult, value: str) -> int | None:
    """The URL's port (None: none given), or an error naming it: `urlsplit` raises only when it is read, and it was
    read first as `kazma run` made the sink (`kazma config check` passed it)."""
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise PydanticCustomError(
            "kazma_audit", "the port must be a number from 1 to 65535, got {got}", {"got": repr(value)}
        )
    return port


class _Strict(StrictModel):
    pass


class AuditSinkConfig(_Strict):
    """Exactly one of ``file``, ``syslog`` and ``webhook``; every event (and every signed checkpoint) is delivered
    in sequence order, each carrying its sequence number (a receiver drops one it has): at least once to the file
    and the webhook, best effort to syslog (it has no acknowledgement)."""

    file: Path | None = None  # JSON lines appended (and fsynced); what `kazma audit verify --from-export` reads
    syslog: str = ""  # udp://host:port or tcp://host:port: one RFC 5424 message per record, facility log audit
    webhook: str = ""  # https://… (http:// only to a loopback address): POST {"records": [...]}, 2xx = delivered
    headers: dict[str, str] = Field(default_factory=dict)  # sent with every webhook POST (values may use ${VAR})
    batch: int = Field(default=100, ge=1, le=10_000)  # records per delivery at most
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)  # one delivery's limit
    retry_base_seconds: float = Field(default=1.0, gt=0, le=3600)  # the backoff after a failed delivery
    retry_cap_seconds: float = Field(default=300.0, gt=0, le=86_400)

    @field_validator("syslog")
    @classmethod
    def _syslog(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("udp", "tcp") or not parts.hostname or _port(parts, value) is None:
            raise PydanticCustomError(
                "kazma_audit", "expected udp://host:port or tcp://host:port, got {got}", {"got": repr(value)}
            )
        return value

    @field_validator("webhook")
    @classmethod
    def _webhook(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        loopback = parts.scheme == "http" and parts.hostname in _LOOPBACK
        if not loopback and (parts.scheme != "https" or not parts.hostname):
            raise PydanticCustomError(
                "kazma_audit",
                "the audit webhook must be an https:// URL (http:// only to 127.0.0.1 or localhost), got {got}",
                {"got": _shown(parts)},
            )
        _port(parts, _shown(parts))
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not _HEADER_NAME.match(name):
                raise PydanticCustomError(
                    "kazma_audit", "header {name} is not a valid HTTP header name", {"name": repr(name)}
                )
            if not _HEADER_VALUE.match(text):  # the value is not shown: it is often the secret
                raise PydanticCustomError(
                    "kazma_audit",
                    "header {name}: its value must be printable ASCII (no control characters, no line breaks, no"
                    " letters outside ASCII, no space or tab at either end)",
                    {"name": repr(name)},
                )
        return value

    @model_validator(mode="after")
    def _one_target(self) -> AuditSinkConfig:
        targets = [name for name, on in (("file", self.file), ("syslog", self.syslog), ("webhook", self.webhook)) if on]
        if len(targets) != 1:
            raise PydanticCustomError(
                "kazma_audit",
                "audit.sink needs exactly one of file, syslog and webhook (got {got})",
                {"got": ", ".join(targets) or "none"},
            )
        if self.headers and not self.webhook:
            raise PydanticCustomError("kazma_audit", "audit.sink.headers are only for a webhook", {})
        if self.retry_cap_seconds < self.retry_base_seconds:
            raise PydanticCustomError(
                "kazma_audit", "audit.sink.retry_cap_seconds must be at least retry_base_seconds", {}
            )
        return self

    @property
    def target(self) -> str:
        """The sink's name, which its delivered position is kept under (and which its log lines show): a new target
        starts from the beginning. A webhook's is its scheme, host and port and a short hash of the whole URL: the
        path and query are often the secret (Slack, Discord, Sumo Logic), and the name is logged and stored."""
        if self.file is not None:
            return f"file:{self.file}"
        if self.syslog:
            return f"syslog:{self.syslog}"
        digest = hashlib.sha256(self.webhook.encode("utf-8")).hexdigest()[:12]
        return f"webhook:{_shown(urlsplit(self.webhook))}#{digest}"

    @property
    def legacy_targets(self) -> tuple[str, ...]:
        """Names this target's position was kept under before (a webhook's held its path): carried over once."""
        if not self.webhook:
            return ()
        parts = urlsplit(self.webhook)
        port = f":{parts.port}" if parts.port else ""
        return (f"webhook:{parts.scheme}://{parts.hostname}{port}{parts.path}",)

    def secrets(self) -> tuple[str, ...]:
        """What must never reach a log line: the webhook's URL (whole, and its path and query, the part that is a
        Slack, Discord or Sumo Logic webhook's secret), its credentials, and every header's value."""
        if not self.webhook:
            return ()
        parts = urlsplit(self.webhook)
        rest = parts.path + (f"?{parts.query}" if parts.query else "")
        return (self.webhook, rest, parts.password or "", *self.headers.values())


def _shown(parts: SplitResult) -> str:
    """A URL's scheme, host and port: what may be shown of it (its path, query and credentials may be secrets)."""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a port (the model refuses such a URL; shown as written, after the last colon)
        port = parts.netloc[parts.netloc.rfind(":") :]
    return f"{parts.scheme}://{host}{port}"


class AuditConfig(_Strict):
    sink: AuditSinkConfig | None = None  # None: the audit stays in the store (and `kazma audit export`)
