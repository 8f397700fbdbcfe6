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
is raised; an approval in Kazma's store that Kazma did not seal raises
:class:`ApprovalUnverified`. Async functions are supported (the HTTP calls run in a thread).

The call waits for its answer, so Kazma is told it does (``Kazma-Wait: sync``):
interrupted (Ctrl-C) or, for an async function, cancelled, the request is
withdrawn on every card before the exception goes on; and if the process dies
outright, Kazma withdraws it once nobody has asked about it for 90 s.

Only the standard library is used here (``urllib``, ``json``, ``hashlib``): no
platform library, no HTTP framework. The hash is computed as Kazma computes it
(canonical JSON: sorted keys, compact separators, UTF-8), re-implemented here so
that this module needs nothing of the rest of Kazma. Configuration comes from
the arguments or from ``KAZMA_URL`` and ``KAZMA_API_TOKEN``.
"""

from __future__ import annotations

import contextlib
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
    "ApprovalUnverified",
    "KazmaApprovals",
    "require_approval",
]

F = TypeVar("F", bound=Callable[..., Any])
# Polls failing in a row (Kazma restarting, a replica failing over) are tried again for this long; Kazma itself
# withdraws a request whose waiting asker has not asked for 90 s.
POLL_RETRY_SECONDS = 45.0
WITHDRAW_TIMEOUT = 5.0


class ApprovalError(Exception):
    """The call did not get an approval it may run on; it did not run."""

    def __init__(self, message: str, outcome: dict[str, Any] | None = None, *, http_status: int | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome or {}
        self.http_status = http_status  # Kazma answered with this HTTP error


class ApprovalDenied(ApprovalError):
    """A person denied the call."""


class ApprovalTimeout(ApprovalError):
    """Nobody decided before the deadline (not a denial)."""


class ApprovalCancelled(ApprovalError):
    """The request was withdrawn or Kazma cancelled it (not a denial)."""


class ApprovalUnverified(ApprovalError):
    """The store says approved, but no decision path of Kazma sealed it: it was written by something else."""


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

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        key: str | None = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
            headers["Kazma-Wait"] = "sync"  # this call waits for the answer: withdrawn if it goes away
        if key is not None:
            headers["Idempotency-Key"] = key
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)  # noqa: S310
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        try:
            with opener.open(request, timeout=timeout or self.poll_seconds + 30) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:500]
            message = f"Kazma refused the request (HTTP {exc.code}): {detail}"
            raise ApprovalError(message, http_status=exc.code) from None

    def open(
        self, tool: str, arguments: dict[str, Any], *, reason: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Open a request (its card appears on every platform); the request as the API describes it."""
        body: dict[str, Any] = {"tool": tool, "arguments": arguments}
        if reason:
            body["reason"] = reason
        if deadline is not None:
            body["deadline_seconds"] = deadline
        key = str(uuid.uuid4())  # a retried POST gets the same request, never a second card
        for attempt in range(3):
            try:
                found: dict[str, Any] = self._call("POST", "/api/v1/approvals", body, key)
                return found
            except (urllib.error.URLError, TimeoutError):
                if attempt == 2:
                    raise
                time.sleep(1 + attempt)
        raise AssertionError("unreachable")

    def wait(self, found: dict[str, Any]) -> dict[str, Any]:
        """Ask for ``found``'s outcome until there is one; polls failing for a while (Kazma restarting) are
        tried again for up to ``POLL_RETRY_SECONDS`` in a row."""
        failing_since: float | None = None
        while found["status"] == "pending":
            try:
                found = self._call("GET", f"/api/v1/approvals/{found['id']}?wait={self.poll_seconds:g}")
                failing_since = None
                continue
            except ApprovalError as exc:
                if exc.http_status not in (502, 503, 504):
                    raise
                problem: Exception = exc
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                problem = exc
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since > POLL_RETRY_SECONDS:
                raise ApprovalError(f"Kazma stopped answering ({problem}); the call did not run")
            time.sleep(1.0)
        return found

    def withdraw(self, request_id: str, why: str) -> dict[str, Any]:
        """Withdraw a pending request (``why``: interrupted, disconnected or cancelled); it ends cancelled."""
        found: dict[str, Any] = self._call(
            "DELETE", f"/api/v1/approvals/{request_id}?why={why}", timeout=WITHDRAW_TIMEOUT
        )
        return found

    def ask(
        self, tool: str, arguments: dict[str, Any], *, reason: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Open a request and wait for its outcome (the request as the API describes it). Interrupted
        (Ctrl-C) while waiting, it withdraws the request, then lets the interruption go on."""
        found = self.open(tool, arguments, reason=reason, deadline=deadline)
        try:
            return self.wait(found)
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                self.withdraw(found["id"], "interrupted")
            raise


def _bound(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    try:
        # through JSON and back: what is hashed is what JSON carries (tuples become lists, and so on)
        text = json.dumps(dict(bound.arguments), sort_keys=True, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ApprovalError(f"the arguments cannot be shown as JSON, so they cannot be approved: {exc}") from None
    return cast(dict[str, Any], json.loads(text))


def _decider(found: dict[str, Any]) -> str:
    """``alice (telegram:111)`` from an answer of the approvals API; the identity alone when it is nobody's."""
    person, identity = found.get("decided_person"), found.get("decided_by")
    return f"{person} ({identity})" if person else str(identity)


def _check(found: dict[str, Any], asked_hash: str) -> None:
    status = found.get("status")
    if status == "approved":
        if found.get("hash") != asked_hash:
            raise ApprovalMismatch("Kazma approved a different call than the one asked for", found)
        return
    error = {"denied": ApprovalDenied, "timeout": ApprovalTimeout, "unverified": ApprovalUnverified}.get(
        str(status), ApprovalCancelled
    )
    who = f" by {_decider(found)}" if found.get("decided_by") else ""
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

                arguments = _bound(signature, args, kwargs)
                asked = canonical_hash(arguments)
                client = KazmaApprovals(url, token)
                found = await asyncio.to_thread(client.open, name, arguments, reason=reason, deadline=deadline)
                try:
                    found = await asyncio.to_thread(client.wait, found)
                except asyncio.CancelledError:
                    # The awaiting task was cancelled: nobody will run it, so nobody may approve it.
                    with contextlib.suppress(Exception):
                        await asyncio.shield(asyncio.to_thread(client.withdraw, found["id"], "cancelled"))
                    raise
                _check(found, asked)
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
