"""``kazma approvals rules list|revoke``: the remembered approvals ("Approve for 1 h") in force."""

from __future__ import annotations

import asyncio
import sys
import time

import click

from kazma.approvals import ApprovalStore
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.rules import RuleStore
from kazma.bot.cli.cli_identity import cli_login
from kazma.bot.cli.context import Context
from kazma.bot.keys import load_audit_signer, read_decision_keyring
from kazma.bot.store import store_for_command
from kazma.config.address import Actor
from kazma.config.store.errors import store_errors


@click.group()
def rules() -> None:
    """List and revoke remembered approvals."""


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


@rules.command("list")
@click.option("--all", "everything", is_flag=True, help="Also expired and revoked rules.")
@click.pass_obj
def list_rules(obj: Context, everything: bool) -> None:
    """Each rule: id, tool, hash, conversation, who made it, until when."""
    config = obj.load().config

    async def run() -> None:
        async with store_for_command(config) as store:
            found = await RuleStore(store).list(active_only=not everything, limit=1000)
        if not found:
            click.echo("no remembered approvals in force" if not everything else "no remembered approvals")
        now = time.time()
        keyring = read_decision_keyring(config)
        for rule in found:
            state = "active" if rule.active(now) else ("revoked" if rule.revoked_at else "expired")
            # A row whose seal does not hold lets nothing run: said, so nobody takes it for one in force.
            problem = rule.seal_problem(keyring) if state == "active" and keyring is not None else None
            refused = "" if problem is None else f"  REFUSED: {problem.detail}"
            click.echo(
                f"{rule.id}  {state:<7} {rule.tool}  sha256 {rule.args_hash[:16]}…  in {rule.conversation}  "
                f"by {rule.created_by}  until {_when(rule.expires_at)}  (request {rule.request_id}){refused}"
            )

    asyncio.run(run())


@rules.command("revoke")
@click.argument("rule_id")
@click.option("--as", "login", default=None, help="Confirms who you are (see kazma approvals approve --help).")
@click.pass_obj
def revoke(obj: Context, rule_id: str, login: str | None) -> None:
    """End a rule now: the next identical call gets a card again."""
    config = obj.load().config
    actor = str(Actor("cli", cli_login(config, login)))

    async def run() -> bool:
        async with store_for_command(config) as store:
            rules_store = RuleStore(store)
            match = [r for r in await rules_store.list(active_only=False, limit=100_000) if r.id == rule_id]
            if not match:
                return False
            signer = load_audit_signer(config)
            approvals = ApprovalStore(store, audit=signer)
            # The row and its rule_revoked both or neither (see RuleStore.revoke_recorded).
            done = await rules_store.revoke_recorded(
                approvals, match[0], actor=actor, platform="cli", person=config.roster.person_of(actor)
            )
            if done:
                await Checkpointer(approvals, signer).sign()
            return done

    try:
        done = asyncio.run(run())
    except store_errors() as exc:
        click.echo(f"could not revoke {rule_id}: the store did not take the change ({exc}); nothing changed", err=True)
        sys.exit(1)
    if not done:
        click.echo(f"no rule {rule_id!r} in force", err=True)
        sys.exit(1)
    click.echo(f"revoked {rule_id}; recorded as {actor}")
