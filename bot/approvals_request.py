"""``kazma approvals request``: ask a person for a yes from a script or CI job, through the approvals API.

Exit codes with ``--wait``: 0 approved, 1 denied, 2 timeout, 3 cancelled; 4 when Kazma could not be asked.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import click

from kazma.bot.context import Context

EXIT = {"approved": 0, "denied": 1, "timeout": 2, "cancelled": 3}
EXIT_UNASKED = 4


def _value(raw: str) -> Any:
    """``k=v``: v as JSON when it parses (numbers, true, lists), else as text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


@click.command("request")
@click.option("--tool", required=True, help="What is about to run, as its card names it.")
@click.option("--arg", "args", multiple=True, metavar="K=V", help="An argument; repeat. V is JSON or text.")
@click.option("--reason", default=None)
@click.option("--wait", is_flag=True, help="Wait for the outcome; exit 0 approved, 1 denied, 2 timeout, 3 cancelled.")
@click.option("--deadline", type=click.FloatRange(1, 7 * 24 * 3600), default=None, help="Seconds to decide.")
@click.option("--url", envvar="KAZMA_URL", default=None, help="Kazma's web address (default: web.public_url).")
@click.pass_obj
def request(
    obj: Context, tool: str, args: tuple[str, ...], reason: str | None, wait: bool, deadline: float | None,
    url: str | None,
) -> None:  # fmt: skip
    """Open an approval request (token: $KAZMA_API_TOKEN); print its id and its card's link."""
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
    body: dict[str, Any] = {"tool": tool, "arguments": arguments}
    if reason:
        body["reason"] = reason
    if deadline is not None:
        body["deadline_seconds"] = deadline
    base = (url or obj.load().config.web.public_url).rstrip("/")
    # One key for this invocation: a retried POST (a dropped connection) gets the same request, not a second card.
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": str(uuid.uuid4())}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=90, trust_env=False) as client:
            found = _post(client, body)
            click.echo(f"request {found['id']}  {found['link']}")
            click.echo(f"sha256  {found['hash']}")
            if not wait:
                return
            while found["status"] == "pending":
                polled = client.get(f"/api/v1/approvals/{found['id']}", params={"wait": "30"})
                if polled.status_code >= 400:
                    _unasked(polled)
                found = polled.json()
    except httpx.HTTPError as exc:
        click.echo(f"could not reach Kazma at {base}: {exc}", err=True)
        sys.exit(EXIT_UNASKED)
    who = f" by {found['decided_by']}" if found.get("decided_by") else ""
    click.echo(f"{found['status']}{who}")
    sys.exit(EXIT.get(found["status"], EXIT_UNASKED))


def _post(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    for attempt in range(3):
        try:
            response = client.post("/api/v1/approvals", json=body)
        except Exception:
            if attempt == 2:
                raise
            time.sleep(1 + attempt)
            continue
        if response.status_code >= 400:
            _unasked(response)
        found: dict[str, Any] = response.json()
        return found
    raise AssertionError("unreachable")


def _unasked(response: Any) -> None:
    click.echo(f"Kazma refused (HTTP {response.status_code}): {response.text[:500]}", err=True)
    sys.exit(EXIT_UNASKED)
