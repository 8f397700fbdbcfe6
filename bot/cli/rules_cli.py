"""``kazma approvals rules list|revoke``: the remembered approvals ("Approve for 1 h") in force."""

from __future__ import annotations

import asyncio
import sys
import time

import click

from kazma.approvals import ApprovalStore
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.honesty import reveal_line
from kazma.approvals.rules import RuleStore, definition_text, rule_states
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


# Rules a listing prints at most, newest first (``--all`` keeps every rule ever made: it grows without bound).
LISTED = 1000


@rules.command("list")
@click.option("--all", "everything", is_flag=True, help="Also expired and revoked rules.")
@click.pass_obj
def list_rules(obj: Context, everything: bool) -> None:
    """Each rule: id, state, tool, hash, definition, conversation, who made it, until when."""
    config = obj.load().config

    async def run() -> None:
        now = time.time()
        keyring = read_decision_keyring(config)
        async with store_for_command(config, read_only=True) as store:
            found = await RuleStore(store, clock=lambda: now).list(active_only=not everything, limit=LISTED + 1)
            # Judged as the service judges a rule before it lets a call run: a row in force that the
            # configuration now ends (max_seconds lowered, say) or whose seal does not hold lets nothing run, and
            # is said so rather than listed as active.
            states = await rule_states(ApprovalStore(store), found[:LISTED], config=config, keyring=keyring, now=now)
        if not found:
            click.echo("no remembered approvals in force" if not everything else "no remembered approvals")
        for rule, state in zip(found[:LISTED], states, strict=True):
            said = "" if state.why is None else f"  {state.name.upper()}: {state.why}"
            line = (
                f"{rule.id}  {state.name:<7} {rule.tool}  sha256 {rule.args_hash[:16]}…  {definition_text(rule)}  "
                f"in {rule.conversation}  by {rule.created_by}  until {_when(rule.expires_at)}  "
                f"(request {rule.request_id}){said}"
            )
            # A row's text is the store's: one written around Kazma could hold a line break that prints a line of
            # its own (a forged "active" rule) or a terminal escape. One rule, one line, as kazma approvals list.
            click.echo(reveal_line(line))
        if len(found) > LISTED:
            # Said, so that a rule left off is not taken for one that does not exist.
            click.echo(f"only the newest {LISTED} rules are listed; older ones are left off", err=True)

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
            # In force only, as the console's Revoke: an expired rule ended on its own.
            found = await rules_store.in_force(rule_id)
            if found is None:
                return False
            signer = load_audit_signer(config)
            approvals = ApprovalStore(store, audit=signer)
            # The row and its rule_revoked both or neither (see RuleStore.revoke_recorded).
            done = await rules_store.revoke_recorded(
                approvals, found, actor=actor, platform="cli", person=config.roster.person_of(actor)
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
