"""``kazma approvals request``: ask a person for a yes from a script or CI job, through the approvals API.

Exit codes with ``--wait``: 0 approved, 1 denied, 2 timeout, 3 cancelled; 4 when Kazma could not be asked;
5 when the wait was interrupted (SIGINT, SIGTERM) — the request is withdrawn, never left for a press that
nobody would act on, and an interruption is never reported as a denial; 6 when the store says approved but no
decision path of Kazma sealed it (written into the store by something else: do not act on it). Interrupted
without ``--wait`` (while the request is being opened), it withdraws what it opened too, and exits 5.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import Any

import click

from kazma.bot.cli.context import Context

EXIT = {"approved": 0, "denied": 1, "timeout": 2, "cancelled": 3, "unverified": 6}
EXIT_UNASKED = 4
EXIT_INTERRUPTED = 5
# How long polls may fail in a row (Kazma restarting, a replica failing over) before giving up (exit 4): less
# than the 90 s after which Kazma withdraws a request whose waiting asker stopped asking.
POLL_RETRY_SECONDS = 45.0
WITHDRAW_TIMEOUT = 5.0


def _value(raw: str) -> Any:
    """``k=v``: v as JSON when it parses (numbers, true, lists), else as text."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except ValueError:
        return raw


def _not_json(word: str) -> Any:
    # json.loads reads NaN and Infinity, which no JSON body may carry: `--arg x=NaN` ended in a ValueError traceback
    # when the request was sent. They are the text they say.
    raise ValueError(word)


@click.command("request")
@click.option("--tool", required=True, help="What is about to run, as its card names it.")
@click.option("--arg", "args", multiple=True, metavar="K=V", help="An argument; repeat. V is JSON or text.")
@click.option("--reason", default=None)
@click.option(
    "--wait",
    is_flag=True,
    help="Wait for the outcome; exit 0 approved, 1 denied, 2 timeout, 3 cancelled, 5 interrupted (withdrawn).",
)
@click.option("--deadline", type=click.FloatRange(1, 7 * 24 * 3600), default=None, help="Seconds to decide.")
@click.option("--policy", default=None, help="The approvals policy it is decided under (approvals.policies).")
@click.option("--url", envvar="KAZMA_URL", default=None, help="Kazma's web address (default: web.public_url).")
@click.pass_obj
def request(
    obj: Context, tool: str, args: tuple[str, ...], reason: str | None, wait: bool, deadline: float | None,
    url: str | None, policy: str | None = None,
) -> None:  # fmt: skip
    """Open an approval request (token: $KAZMA_API_TOKEN); print its id and its card's link.

    \b
    Exit codes with --wait:
      0  approved      1  denied        2  timed out (not a denial)
      3  cancelled (withdrawn, or Kazma cancelled it; not a denial)
      4  Kazma could not be asked
      5  interrupted (SIGINT/Ctrl-C, SIGTERM): the request is withdrawn on every
         card; if Kazma cannot be told, it withdraws it once nobody asks (90 s)
      6  unverified: the store says approved, but Kazma did not seal it (or its arguments changed since)
    """
    # From the first line on: Ctrl-C while Kazma's configuration is read came out as click's "Aborted!", exit 1,
    # which is "denied" to a script.
    opening = _Opening()
    with _interruptible():
        try:
            _ask(obj, tool, args, reason, wait, deadline, url, policy, opening)
        except KeyboardInterrupt:  # outside the open and the wait, where _ask withdraws what it opened
            if opening.sent:  # as it ended (its connections closing, its last words): what stands, stands
                click.echo("interrupted as it ended; the request was not withdrawn", err=True)
            else:
                click.echo("interrupted before the request was sent; nothing was opened", err=True)
            sys.exit(EXIT_INTERRUPTED)


def _ask(
    obj: Context, tool: str, args: tuple[str, ...], reason: str | None, wait: bool, deadline: float | None,
    url: str | None, policy: str | None, opening: _Opening,
) -> None:  # fmt: skip
    import httpx

    token = os.environ.get("KAZMA_API_TOKEN", "")
    if not token:
        click.echo("set KAZMA_API_TOKEN to an API token with the approval_requester role", err=True)
        sys.exit(EXIT_UNASKED)
    arguments: dict[str, Any] = {}
    for item in args:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected K=V, got {item!r}", param_hint="--arg")
        arguments[key] = _value(raw)
    if deadline is not None and math.isnan(deadline):  # FloatRange lets NaN through: every comparison is false
        raise click.BadParameter("expected a number of seconds, got nan", param_hint="--deadline")
    body: dict[str, Any] = {"tool": tool, "arguments": arguments}
    if reason:
        body["reason"] = reason
    if deadline is not None:
        body["deadline_seconds"] = deadline
    if policy is not None:
        body["policy"] = policy
    base = (url or obj.load().config.web.public_url).rstrip("/")
    # One key for this invocation: a retried POST (a dropped connection) gets the same request, not a second card.
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": str(uuid.uuid4())}
    if wait:  # this process waits and keeps asking: Kazma withdraws the request when it stops
        headers["Kazma-Wait"] = "sync"
    found: dict[str, Any] | None = None
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=90, trust_env=False) as client:
            try:
                found = _post(client, body, opening)
                click.echo(f"request {found['id']}  {found['link']}")
                click.echo(f"sha256  {found['hash']}")
                if not wait:
                    return
                found = _poll(client, found)
            except KeyboardInterrupt:
                _interrupted(client, found, body, opening, wait)  # exits: never the outer "nothing was opened"
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL (`--url http://[::1`) is no HTTPError
        click.echo(f"could not reach Kazma at {base}: {exc}", err=True)
        sys.exit(EXIT_UNASKED)
    assert found is not None
    person, identity = found.get("decided_person"), found.get("decided_by")
    decider = f"{person} ({identity})" if person else identity
    who = f" by {decider}" if identity else ""
    click.echo(f"{found['status']}{who}")
    sys.exit(EXIT.get(found["status"], EXIT_UNASKED))


class _Opening:
    """Whether the POST that opens the request may have reached Kazma: true once its headers began to leave."""

    def __init__(self) -> None:
        self.sent = False

    def trace(self, event: str, info: dict[str, Any]) -> None:
        # httpcore's trace extension: "http11.send_request_headers.started" (or http2's) is the first byte out.
        if event.endswith(".send_request_headers.started"):
            self.sent = True


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM interrupts like Ctrl-C does (a CI runner cancelling the job sends SIGTERM); the first of either
    interrupts, and any later one is let go, so that a second Ctrl-C cannot cut the withdrawal short — not even
    while the first is still unwinding, before any handler could set it aside."""
    interrupted = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted(
    client: Any, found: dict[str, Any] | None, body: dict[str, Any], opening: _Opening, wait: bool
) -> None:
    """Interrupted: withdraw the request (bounded), say so, exit 5.

    Interrupted while the POST was on its way, Kazma may have opened the request (its cards out) without the id
    coming back. The same POST is sent again with the same Idempotency-Key: Kazma answers with the request the
    first one opened, which is then withdrawn. If the first never arrived, that second POST opens it, and it is
    withdrawn at once (its cards say so): never a request left approvable for nobody. A POST that never left this
    process opened nothing, and nothing is sent again."""
    key = client.headers["Idempotency-Key"]
    if found is None:
        if not opening.sent:
            click.echo("interrupted before the request was sent; nothing was opened", err=True)
            sys.exit(EXIT_INTERRUPTED)
        again = _reopened(client, body)
        if again is None:
            click.echo(
                f"interrupted before Kazma answered, and Kazma could not be asked again: a request it opened "
                f"(Idempotency-Key {key}) is not withdrawn; {_left_pending(wait)}",
                err=True,
            )
            sys.exit(EXIT_INTERRUPTED)
        if not again:
            click.echo("interrupted before Kazma opened the request; nothing was opened", err=True)
            sys.exit(EXIT_INTERRUPTED)
        found = again
    after = _withdrawn(client, found["id"])
    if after is None:
        click.echo(
            f"interrupted; Kazma could not be told: request {found['id']} is not withdrawn; {_left_pending(wait)} "
            f"(DELETE /api/v1/approvals/{found['id']} withdraws it)",
            err=True,
        )
    elif after["status"] == "cancelled":
        click.echo(f"interrupted; request {found['id']} withdrawn", err=True)
    else:  # decided just before the withdrawal reached Kazma: nobody here acts on it
        said = f"interrupted; request {found['id']} was already {after['status']}, and nothing here acts on it"
        click.echo(said, err=True)
    sys.exit(EXIT_INTERRUPTED)


def _left_pending(wait: bool) -> str:
    """How long a request this invocation could not withdraw stays approvable: with ``--wait`` Kazma's grace for a
    waiting asker that stopped asking ends it; without, nothing does before its deadline."""
    return "Kazma withdraws it once nobody asks about it (90 s)" if wait else "it stays pending until its deadline"


def _reopened(client: Any, body: dict[str, Any]) -> dict[str, Any] | None:
    """The request this invocation's Idempotency-Key opened (or opens now); {} when Kazma refuses, so opened
    nothing for the key (a 429 is answered only for a key it does not know); None when Kazma cannot be asked."""
    answered = _again(
        client, lambda left: client.build_request("POST", "/api/v1/approvals", json=body, timeout=left), busy=(500,)
    )
    if answered is None:
        return None
    return (_request_of(answered) or None) if answered.status_code < 300 else {}


def _withdrawn(client: Any, request_id: str) -> dict[str, Any] | None:
    """Withdraw ``request_id``: the request as Kazma answers, or None when it could not be told."""
    url = f"/api/v1/approvals/{request_id}"
    asked = {"why": "interrupted"}
    answered = _again(
        client, lambda left: client.build_request("DELETE", url, params=asked, timeout=left), busy=(429, 500)
    )
    return None if answered is None or answered.status_code >= 400 else _request_of(answered)


def _again(client: Any, build: Any, *, busy: tuple[int, ...]) -> Any:
    """The request ``build(seconds left)`` makes, sent again while Kazma cannot answer (no connection, 502-504, or
    a status in ``busy``), for at most ``WITHDRAW_TIMEOUT`` in all; its answer otherwise, or None. A 429 to the
    POST sent again is no reason to ask again: Kazma answers it only for a key it does not know, so nothing was
    opened."""
    give_up = time.monotonic() + WITHDRAW_TIMEOUT
    pause = 0.2
    while (left := give_up - time.monotonic()) > 0:
        try:
            answered = _within(client, build(left), give_up)
        except Exception:  # an interrupted process says what it could not do: never a traceback here
            answered = None
        else:
            if answered.status_code not in (*busy, 502, 503, 504):
                return answered
        time.sleep(min(pause, max(0.0, give_up - time.monotonic())))
        pause *= 2
    return None


def _within(client: Any, request: Any, give_up: float) -> Any:
    """``request``'s answer, read by the monotonic time ``give_up`` (TimeoutError after it). httpx's timeout bounds
    each read, not the answer: one trickled a byte at a time held the withdrawal, with Ctrl-C let go, for ever."""
    import httpx

    streamed = client.send(request, stream=True)
    try:
        content = bytearray()
        for chunk in streamed.iter_bytes():
            content += chunk
            if time.monotonic() > give_up:
                raise TimeoutError("the answer did not come within the bound")
        return httpx.Response(streamed.status_code, content=bytes(content))
    finally:
        streamed.close()


def _poll(client: Any, found: dict[str, Any]) -> dict[str, Any]:
    """Ask for the answer until there is one; a Kazma that does not answer for a while (a restart, a replica
    failing over) is asked again, for up to ``POLL_RETRY_SECONDS`` in a row."""
    import httpx

    failing_since: float | None = None
    while found["status"] == "pending":
        try:
            polled = client.get(f"/api/v1/approvals/{found['id']}", params={"wait": "30"})
        except httpx.TransportError as exc:
            problem = str(exc) or type(exc).__name__
        else:
            read = _request_of(polled) if polled.status_code < 400 else None
            if read is not None:
                found = read
                failing_since = None
                continue
            if polled.status_code >= 400 and polled.status_code not in (502, 503, 504):
                _unasked(polled)
            # A 200 that is no request (a proxy's page between here and Kazma) is a Kazma not answering yet
            problem = f"HTTP {polled.status_code}" if polled.status_code >= 400 else _NOT_A_REQUEST
        now = time.monotonic()
        failing_since = now if failing_since is None else failing_since
        if now - failing_since > POLL_RETRY_SECONDS:
            click.echo(f"Kazma stopped answering ({problem}); it withdraws the request once nobody asks", err=True)
            sys.exit(EXIT_UNASKED)
        time.sleep(1.0)
    return found


def _post(client: Any, body: dict[str, Any], opening: _Opening) -> dict[str, Any]:
    """Open the request; a dropped connection or a 502-504 is asked again with the same Idempotency-Key: a 503
    can mean the request was opened (its cards up) and the store failed before the answer, and the key gets it."""
    for attempt in range(3):
        try:
            response = client.post("/api/v1/approvals", json=body, extensions={"trace": opening.trace})
        except Exception:
            if attempt == 2:
                raise
            time.sleep(1 + attempt)
            continue
        if response.status_code in (502, 503, 504) and attempt < 2:
            time.sleep(1 + attempt)
            continue
        if response.status_code >= 400:
            _unasked(response)
        found = _request_of(response, opened=True)
        if found is None:
            # Not Kazma's answer (another web server at --url, a login page of a proxy): a traceback before
            said = f"the answer at {client.base_url} is {_NOT_A_REQUEST} (HTTP {response.status_code})"
            click.echo(f"{said}: is it Kazma's address?", err=True)
            sys.exit(EXIT_UNASKED)
        return found
    raise AssertionError("unreachable")


_NOT_A_REQUEST = "no approval request"


def _request_of(response: Any, *, opened: bool = False) -> dict[str, Any] | None:
    """The approval request a JSON answer of Kazma's is; None for any other answer. ``opened``: it must carry
    what is printed of a request just opened too (its link and hash)."""
    try:
        found = response.json()
    except ValueError:
        return None
    needed = ("id", "status", "link", "hash") if opened else ("id", "status")
    if not isinstance(found, dict) or not all(isinstance(found.get(name), str) for name in needed):
        return None
    return found


def _unasked(response: Any) -> None:
    click.echo(f"Kazma refused (HTTP {response.status_code}): {response.text[:500]}", err=True)
    sys.exit(EXIT_UNASKED)
