"""``kazma people …``: who is who (``people:``), their passkeys, and the one-time links that enrol them."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click

from kazma.bot.cli.cli_identity import system_login
from kazma.bot.cli.context import Context
from kazma.bot.console.accounts import INVITE_SECONDS, AccountStore, Passkey
from kazma.bot.console.passkeys import RelyingParty
from kazma.bot.console.signin import web_login_of
from kazma.bot.store import store_for_command
from kazma.config import KazmaConfig
from kazma.config.address import Actor, platform_of

T = TypeVar("T")


def _with_accounts(
    config: KazmaConfig,
    work: Callable[[AccountStore], Awaitable[T]],
    *,
    create_store: bool = False,
    read_only: bool = False,
) -> T:
    async def run() -> T:
        async with store_for_command(config, create=create_store, read_only=read_only) as store:
            return await work(AccountStore(store))

    return asyncio.run(run())


def _when(epoch: float | None) -> str:
    return "never" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


def _passkey_line(passkey: Passkey) -> str:
    state = f"revoked {_when(passkey.revoked_at)} by {passkey.revoked_by}" if passkey.revoked else "active"
    return (
        f"    passkey {passkey.credential_id[:16]}…  {passkey.label}  {state}  enrolled {_when(passkey.created_at)}"
        f"  last used {_when(passkey.last_used_at)}"
    )


@click.group()
def people() -> None:
    """People and their passkeys: list, invite, revoke."""


@people.command("list")
@click.pass_obj
def list_people(obj: Context) -> None:
    """Every person under people:, their identities, passkeys and open enrolment links."""
    config = obj.load().config

    async def work(accounts: AccountStore) -> list[str]:
        keys = await accounts.passkeys()
        invites = await accounts.invites()
        now = time.time()
        lines: list[str] = []
        for person in config.people.people():
            approver = any(config.roster.is_approver(i, platform_of(i)) for i in person.identities)
            role = "approver" if approver else "not an approver"
            lines.append(f"{person.name}  ({role})  {', '.join(person.identities)}")
            lines += [_passkey_line(k) for k in keys if k.person == person.name]
            open_links = [i for i in invites if i[0] == person.name and i[3] is None and i[2] > now]
            if open_links:
                lines.append(f"    {len(open_links)} enrolment link(s) open, the last until {_when(open_links[0][2])}")
        gone = sorted({k.person for k in keys} - set(config.people.persons))
        for name in gone:
            lines.append(f"{name}  (no longer under people: its passkeys sign nobody in)")
            lines += [_passkey_line(k) for k in keys if k.person == name]
        for group, members in config.people.groups.items():
            lines.append(f"group {group}: {', '.join(members)}")
        return lines

    lines = _with_accounts(config, work, read_only=True)
    click.echo("\n".join(lines) if lines else "nobody is under people: in kazma.yaml")


@people.command("invite")
@click.argument("person")
@click.option(
    "--hours", type=click.IntRange(1, 24 * 7), default=INVITE_SECONDS // 3600, show_default=True,
    help="How long the link works (it works once).",
)  # fmt: skip
@click.pass_obj
def invite(obj: Context, person: str, hours: int) -> None:
    """Print a one-time link that enrols a passkey for PERSON (kept only as a hash; it works once)."""
    config = obj.load().config
    if config.people.person(person) is None:
        known = ", ".join(config.people.persons) or "nobody yet"
        click.echo(f"{person!r} is not under people: in kazma.yaml (people: {known})", err=True)
        sys.exit(1)
    login = web_login_of(config, person)
    if login is None:
        click.echo(f"{person} has no web identity: add people.{person}.web (their console login) first", err=True)
        sys.exit(1)
    problem = RelyingParty.of(config.web.public_url).problem
    if problem is not None:
        click.echo(f"passkeys cannot work here: {problem}", err=True)
        sys.exit(1)
    by = str(Actor("cli", system_login()))
    # The first steps invite before the first `kazma run`: the link is the store's first row.
    token, expires = _with_accounts(
        config, lambda a: a.invite(person, created_by=by, lifetime=hours * 3600), create_store=True
    )
    click.echo(f"{config.web.public_url}/enrol/{token}")
    click.echo(
        f"One passkey for {person} (web:{login}), once, until {_when(expires)}. Whoever opens it first enrols as "
        f"{person}: hand it to them yourself, over a channel you trust.",
        err=True,
    )


@people.command("revoke")
@click.argument("person")
@click.option("--passkey", "credential", default=None, help="Only this passkey (its id, or its first characters).")
@click.pass_obj
def revoke(obj: Context, person: str, credential: str | None) -> None:
    """Revoke PERSON's passkeys (or one): they sign nobody in again, and the sessions they opened end now.
    Revoking all of them closes PERSON's open enrolment links too."""
    config = obj.load().config
    by = str(Actor("cli", system_login()))
    try:
        revoked = _with_accounts(config, lambda a: a.revoke(person=person, credential_id=credential, by=by))
    except LookupError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    closed = " (any open enrolment link of theirs is closed)" if credential is None else ""
    if not revoked:
        which = f"passkey {credential!r}" if credential else "passkey"
        click.echo(f"{person} has no active {which}: nothing was revoked{closed}", err=True)
        sys.exit(1)
    for credential_id in revoked:
        click.echo(f"revoked {person}'s passkey {credential_id[:16]}…; its sessions ended")
    if credential is None:
        click.echo(f"{person}'s open enrolment links are closed too: `kazma people invite {person}` makes a new one")
