"""A small client of Kazma's approvals API for other agent frameworks: ``@require_approval``.

    from kazma.approvals.client import require_approval

    @require_approval(reason="touches production")
    def deploy(env: str, version: int) -> None: ...

Before the function runs, Kazma is asked (``POST /api/v1/approvals``) with the
function's name and its bound arguments; a card appears on every platform and
the call waits for a person. Approved: the arguments are hashed *again* as they
are about to run and must be exactly the approved ones, then the function runs
once. Denied, timed out or cancelled: it does not run and
:class:`ApprovalDenied`, :class:`ApprovalTimeout` or :class:`ApprovalCancelled`
is raised. Async functions are supported (the HTTP calls run in a thread).

Only the standard library is used here (``urllib``, ``json``, ``hashlib``): no
platform library, no HTTP framework. The hash is computed as Kazma computes it
(canonical JSON: sorted keys, compact separators, UTF-8), re-implemented here so
that this module needs nothing of the rest of Kazma. Configuration comes from
the arguments or from ``KAZMA_URL`` and ``KAZMA_API_TOKEN``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast, overload

__all__ = [
    "ApprovalCancelled",
    "ApprovalDenied",
    "ApprovalError",
    "ApprovalMismatch",
    "ApprovalTimeout",
    "KazmaApprovals",
    "require_approval",
]

F = TypeVar("F", bound=Callable[..., Any])


class ApprovalError(Exception):
    """The call did not get an approval it may run on; it did not run."""

    def __init__(self, message: str, outcome: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome or {}


class ApprovalDenied(ApprovalError):
    """A person denied the call."""


class ApprovalTimeout(ApprovalError):
    """Nobody decided before the deadline (not a denial)."""


class ApprovalCancelled(ApprovalError):
    """The request was withdrawn or Kazma cancelled it (not a denial)."""


class ApprovalMismatch(ApprovalError):
    """What is about to run is not what was approved (arguments changed meanwhile, or another hash came back)."""


def canonical_hash(arguments: dict[str, Any]) -> str:
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class KazmaApprovals:
    """Ask and wait, over HTTP, with the standard library only."""

    def __init__(self, url: str | None = None, token: str | None = None, *, poll_seconds: float = 30.0) -> None:
        self.url = (url or os.environ.get("KAZMA_URL", "http://127.0.0.1:8765")).rstrip("/")
        self.token = token or os.environ.get("KAZMA_API_TOKEN", "")
        if not self.token:
            raise ApprovalError("no API token: pass token= or set KAZMA_API_TOKEN")
        self.poll_seconds = poll_seconds

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, key: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if key is not None:
            headers["Idempotency-Key"] = key
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)  # noqa: S310
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        try:
            with opener.open(request, timeout=self.poll_seconds + 30) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:500]
            raise ApprovalError(f"Kazma refused the request (HTTP {exc.code}): {detail}") from None

    def ask(
        self, tool: str, arguments: dict[str, Any], *, reason: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Open a request and wait for its outcome (the request as the API describes it)."""
        body: dict[str, Any] = {"tool": tool, "arguments": arguments}
        if reason:
            body["reason"] = reason
        if deadline is not None:
            body["deadline_seconds"] = deadline
        key = str(uuid.uuid4())  # a retried POST gets the same request, never a second card
        found: dict[str, Any] | None = None
        for attempt in range(3):
            try:
                found = self._call("POST", "/api/v1/approvals", body, key)
                break
            except (urllib.error.URLError, TimeoutError):
                if attempt == 2:
                    raise
                time.sleep(1 + attempt)
        assert found is not None
        while found["status"] == "pending":
            found = self._call("GET", f"/api/v1/approvals/{found['id']}?wait={self.poll_seconds:g}")
        return found


def _bound(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    try:
        # through JSON and back: what is hashed is what JSON carries (tuples become lists, and so on)
        text = json.dumps(dict(bound.arguments), sort_keys=True, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ApprovalError(f"the arguments cannot be shown as JSON, so they cannot be approved: {exc}") from None
    return cast(dict[str, Any], json.loads(text))


def _check(found: dict[str, Any], asked_hash: str) -> None:
    status = found.get("status")
    if status == "approved":
        if found.get("hash") != asked_hash:
            raise ApprovalMismatch("Kazma approved a different call than the one asked for", found)
        return
    error = {"denied": ApprovalDenied, "timeout": ApprovalTimeout}.get(str(status), ApprovalCancelled)
    who = f" by {found.get('decided_by')}" if found.get("decided_by") else ""
    raise error(f"{found.get('tool')}: {status}{who}; it did not run", found)


@overload
def require_approval(
    func: F,
    *,
    tool: str | None = None,
    reason: str | None = None,
    deadline: float | None = None,
    url: str | None = None,
    token: str | None = None,
) -> F: ...


@overload
def require_approval(
    func: None = None,
    *,
    tool: str | None = None,
    reason: str | None = None,
    deadline: float | None = None,
    url: str | None = None,
    token: str | None = None,
) -> Callable[[F], F]: ...


def require_approval(
    func: F | None = None,
    *,
    tool: str | None = None,
    reason: str | None = None,
    deadline: float | None = None,
    url: str | None = None,
    token: str | None = None,
) -> Any:
    """Decorate a function (sync or async) so that it runs only after a person approved exactly this call."""

    def decorate(fn: F) -> F:
        name = tool or fn.__name__
        signature = inspect.signature(fn)

        def approve(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            arguments = _bound(signature, args, kwargs)
            asked = canonical_hash(arguments)
            _check(KazmaApprovals(url, token).ask(name, arguments, reason=reason, deadline=deadline), asked)
            return asked

        def recheck(asked: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # The arguments are objects the caller still holds: hash them again as they are about to run.
            now = canonical_hash(_bound(signature, args, kwargs))
            if now != asked:
                raise ApprovalMismatch(f"{name}: the arguments changed after they were approved; it did not run")

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                import asyncio

                asked = await asyncio.to_thread(approve, args, kwargs)
                recheck(asked, args, kwargs)
                return await fn(*args, **kwargs)

            return cast(F, run_async)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            asked = approve(args, kwargs)
            recheck(asked, args, kwargs)
            return fn(*args, **kwargs)

        return cast(F, run)

    return decorate(func) if func is not None else decorate
