"""``kazma approvals …``: the operator's view of the approvals store."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click

from kazma.approvals import (
    ApprovalService,
    ApprovalStore,
    CardIntegrityError,
    Decision,
    PressVerdict,
    UnrenderableArguments,
    build_card,
)
from kazma.approvals.audit_verify import UnrecordedRequest
from kazma.approvals.card import INTEGRITY_WARNING
from kazma.approvals.chain import DECISION_EVENTS
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.honesty import reveal_line
from kazma.approvals.model import ApprovalRequest, Status, decider_text
from kazma.approvals.seal import seal_problem
from kazma.bot.cli.cli_identity import cli_login
from kazma.bot.cli.context import Context
from kazma.bot.keys import load_audit_signer, load_decision_keyring, read_audit_signer, read_decision_keyring
from kazma.bot.store import require_existing_store, store_for_command
from kazma.config import LoadedConfig
from kazma.config.address import Actor

T = TypeVar("T")


def _with_service(
    loaded: LoadedConfig, work: Callable[[ApprovalService], Awaitable[T]], *, deciding: bool = False
) -> T:
    """``work`` on the configured store. ``deciding``: with the decision keyring every outcome is sealed with
    (made on SQLite if there is none yet; without one, no decision is taken); otherwise with the keyring if
    there is a usable one, to say whether the stored seals verify."""
    # Before the keys: deciding makes them on a first use, beside a store that is not there (a mistyped path).
    require_existing_store(loaded.config)
    keyring = load_decision_keyring(loaded.config) if deciding else read_decision_keyring(loaded.config)
    # A decision here is an audit event like any other: chained, sealed, and signed before the command ends.
    signer = load_audit_signer(loaded.config) if deciding else read_audit_signer(loaded.config)

    async def run() -> T:
        # Only deciding writes: reading an older Kazma's store must not migrate it under that Kazma.
        async with store_for_command(loaded.config, read_only=not deciding) as store:
            approvals = ApprovalStore(store, keyring=keyring, audit=signer)
            try:
                return await work(ApprovalService(approvals, loaded.config))
            finally:
                if deciding and signer is not None:
                    await Checkpointer(approvals, signer).sign()

    return asyncio.run(run())


def _seal_line(service: ApprovalService, request: ApprovalRequest) -> str | None:
    """Whether the outcome's seal verifies here (None while pending): an approval whose seal does not never runs."""
    if not request.status.final:
        return None
    if service.store.keyring is None:
        return "cannot be checked here: no usable decision key (kazma doctor says why)"
    problem = seal_problem(service.store.keyring, request)
    if problem is None:
        return f"verified (key {request.decision_key_id})"
    cannot = " — it cannot run" if request.status is Status.APPROVED else ""
    return f"does not hold: {problem.detail}{cannot}"


def _when(request: ApprovalRequest) -> str:
    return request.created_at.strftime("%Y-%m-%d %H:%M:%S")


def _warnings(request: ApprovalRequest, public_url: str) -> tuple[str, ...]:
    """What the request's cards warn about (hidden or look-alike characters, how it would run), or that its
    stored call was changed outside Kazma. ``show`` is where a cut call is read whole before approving it from
    here, so it must warn exactly as the cards do."""
    try:
        card = build_card(request, value_limit=len(request.args_json) + 1000, public_url=public_url, cut_padding=False)
    except CardIntegrityError as exc:
        return (f"{INTEGRITY_WARNING} ({reveal_line(exc.reason)})",)
    except UnrenderableArguments as exc:
        return (f"These arguments cannot be shown faithfully: {reveal_line(str(exc))}",)
    return card.warnings  # already escaped where they quote the call


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
        decided = f" by {decider_text(r.decided_person, r.decided_by)}" if r.decided_by else ""
        # Everything shown escaped as on the cards: a terminal obeys control characters, and bidi controls
        # reorder what it shows. One request, one line: a newline in a field is escaped too.
        line = f"{r.id}  {r.status.value:<9} {_when(r)}  {r.tool:<12} from {r.requested_by}{decided}"
        click.echo(reveal_line(line))


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
        # Every stored text is shown escaped (⟨U+202E RLO⟩, ⟨U+001B ESC⟩), under the cards' warnings: this is
        # where a call too long for a chat card is read whole before `approve`.
        for warning in _warnings(request, service.config.web.public_url):
            click.echo(f"warning    {warning}")
        lines = [
            f"request    {request.id}",
            f"tool       {request.tool}",
            f"status     {request.status.value}",
            f"requested  by {request.requested_by} in {request.conversation} at {_when(request)} UTC",
            f"deadline   {request.deadline.strftime('%Y-%m-%d %H:%M:%S')} UTC",
        ]
        if request.task_id:
            lines.append(f"task       {request.task_id}")
        outcome = request.outcome()
        if outcome is not None:
            lines.append(f"outcome    {outcome.summary()}")
        sealed = _seal_line(service, request)
        if sealed is not None:
            lines.append(f"seal       {sealed}")
        lines += [f"sha256     {request.args_hash}", f"arguments  {request.args_json}", "audit"]
        events = await service.store.events(request.id)
        for event in events:
            who = f" {decider_text(event.person, event.actor)}" if event.actor else ""
            where = f" via {event.platform}" if event.platform else ""
            detail = f"  {event.detail}" if event.detail else ""
            lines.append(f"  {event.at.strftime('%Y-%m-%d %H:%M:%S')}  {event.event}{who}{where}{detail}")
        # The event written with the row's current state missing (a log cut at a checkpoint): the trail ended, or
        # was empty, without a word, and read as a request nobody decided (what audit verify names as truncated).
        recorded = ("opened",) if request.status is Status.PENDING else DECISION_EVENTS
        if not any(event.event in recorded for event in events):
            missing = UnrecordedRequest(request.id, request.status.value, request.decision_mac is not None)
            lines.append(f"  MISSING  {missing.detail(await service.store.last_event_seq())} (`kazma audit verify`)")
        for line in lines:  # each one line: a newline inside a stored text cannot start a line of its own
            click.echo(reveal_line(line))

    _with_service(loaded, work)


def _decide(obj: Context, request_id: str, login: str | None, decision: Decision, reason: str | None) -> None:
    loaded: LoadedConfig = obj.load()
    actor = str(Actor("cli", cli_login(loaded.config, login)))
    result = _with_service(
        loaded, lambda s: s.decide(request_id, decision, actor=actor, platform="cli", reason=reason), deciding=True
    )
    click.echo(result.message)
    if result.verdict is PressVerdict.REFUSED and "not an approver" in result.message:
        person = loaded.config.people.person_of(actor)
        who = f"'{person}'" if person else f"'{actor}' (or a person under people: with cli: {actor[4:]})"
        click.echo(f"add {who} to approvals.approvers in kazma.yaml to decide from the command line", err=True)
    if result.verdict is not PressVerdict.WON:
        sys.exit(1)


_AS_HELP = (
    "Who you are: recorded is cli:<the system user running this>; --as only confirms it (your login or your "
    "person), unless approvals.cli_identity is declared."
)


@approvals.command("approve")
@click.argument("request_id")
@click.option("--as", "login", default=None, help=_AS_HELP)
@click.option("--reason", default=None)
@click.pass_obj
def approve(obj: Context, request_id: str, login: str | None, reason: str | None) -> None:
    """Approve a pending request (the same compare-and-set as a button)."""
    _decide(obj, request_id, login, Decision.APPROVE, reason)


@approvals.command("deny")
@click.argument("request_id")
@click.option("--as", "login", default=None, help=_AS_HELP)
@click.option("--reason", default=None)
@click.pass_obj
def deny(obj: Context, request_id: str, login: str | None, reason: str | None) -> None:
    """Deny a pending request (the same compare-and-set as a button)."""
    _decide(obj, request_id, login, Decision.DENY, reason)
