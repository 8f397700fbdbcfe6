"""``kazma approvals …``: the operator's view of the approvals store."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click

from kazma.approvals import ApprovalService, ApprovalStore, Decision, PressVerdict
from kazma.approvals.model import ApprovalRequest
from kazma.bot.context import Context
from kazma.bot.store import store_for_command
from kazma.config import LoadedConfig

T = TypeVar("T")


def _with_service(loaded: LoadedConfig, work: Callable[[ApprovalService], Awaitable[T]]) -> T:
    async def run() -> T:
        async with store_for_command(loaded.config) as store:
            return await work(ApprovalService(ApprovalStore(store), loaded.config))

    return asyncio.run(run())


def _when(request: ApprovalRequest) -> str:
    return request.created_at.strftime("%Y-%m-%d %H:%M:%S")


@click.group()
def approvals() -> None:
    """List, inspect and decide approval requests."""


@approvals.command("list")
@click.option("--pending", is_flag=True, help="Only requests still waiting for a decision.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.pass_obj
def list_requests(obj: Context, pending: bool, limit: int) -> None:
    """Newest first: id, status, tool, requester, who decided."""
    loaded: LoadedConfig = obj.load()
    rows = _with_service(loaded, lambda s: s.store.requests(pending_only=pending, limit=limit))
    if not rows:
        click.echo("no pending approval requests" if pending else "no approval requests")
        return
    for r in rows:
        decided = f" by {r.decided_by}" if r.decided_by else ""
        click.echo(f"{r.id}  {r.status.value:<9} {_when(r)}  {r.tool:<12} from {r.requested_by}{decided}")


@approvals.command("show")
@click.argument("request_id")
@click.pass_obj
def show(obj: Context, request_id: str) -> None:
    """The full call as stored, its hash, outcome and audit trail."""
    loaded: LoadedConfig = obj.load()

    async def work(service: ApprovalService) -> None:
        request = await service.store.get(request_id)
        if request is None:
            click.echo(f"no approval request {request_id!r}", err=True)
            sys.exit(1)
        click.echo(f"request    {request.id}")
        click.echo(f"tool       {request.tool}")
        click.echo(f"status     {request.status.value}")
        click.echo(f"requested  by {request.requested_by} in {request.conversation} at {_when(request)} UTC")
        click.echo(f"deadline   {request.deadline.strftime('%Y-%m-%d %H:%M:%S')} UTC")
        if request.task_id:
            click.echo(f"task       {request.task_id}")
        outcome = request.outcome()
        if outcome is not None:
            click.echo(f"outcome    {outcome.summary()}")
        click.echo(f"sha256     {request.args_hash}")
        click.echo(f"arguments  {request.args_json}")
        click.echo("audit")
        for event in await service.store.events(request.id):
            who = f" {event.actor}" if event.actor else ""
            where = f" via {event.platform}" if event.platform else ""
            detail = f"  {event.detail}" if event.detail else ""
            click.echo(f"  {event.at.strftime('%Y-%m-%d %H:%M:%S')}  {event.event}{who}{where}{detail}")

    _with_service(loaded, work)


def _decide(obj: Context, request_id: str, login: str, decision: Decision, reason: str | None) -> None:
    loaded: LoadedConfig = obj.load()
    actor = f"cli:{login}"
    result = _with_service(loaded, lambda s: s.decide(request_id, decision, actor=actor, platform="cli", reason=reason))
    click.echo(result.message)
    if result.verdict is PressVerdict.REFUSED and "not an approver" in result.message:
        click.echo(f"add '{actor}' to approvals.approvers in kazma.yaml to decide from the command line", err=True)
    if result.verdict is not PressVerdict.WON:
        sys.exit(1)


@approvals.command("approve")
@click.argument("request_id")
@click.option("--as", "login", required=True, help="Your login; recorded as cli:<login>.")
@click.option("--reason", default=None)
@click.pass_obj
def approve(obj: Context, request_id: str, login: str, reason: str | None) -> None:
    """Approve a pending request (the same compare-and-set as a button)."""
    _decide(obj, request_id, login, Decision.APPROVE, reason)


@approvals.command("deny")
@click.argument("request_id")
@click.option("--as", "login", required=True, help="Your login; recorded as cli:<login>.")
@click.option("--reason", default=None)
@click.pass_obj
def deny(obj: Context, request_id: str, login: str, reason: str | None) -> None:
    """Deny a pending request (the same compare-and-set as a button)."""
    _decide(obj, request_id, login, Decision.DENY, reason)
