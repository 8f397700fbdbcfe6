"""``kazma keys …``: the decision keys that seal every approval outcome, and (``--audit``) the audit keys that sign
the audit chain's checkpoints (ids only; a secret is never printed)."""

from __future__ import annotations

import sys

import click

from kazma.bot.cli.context import Context
from kazma.bot.keys import decision_keys_folder
from kazma.config.keyring import (
    AUDIT_KEYS,
    DECISION_KEYS,
    KeyringError,
    KeySpec,
    read_keyring,
    retire_key,
    rotate_key_file,
)

_AUDIT = click.option("--audit", is_flag=True, help="The audit keys (Ed25519, signing checkpoints) instead.")


def _spec(audit: bool) -> KeySpec:
    return AUDIT_KEYS if audit else DECISION_KEYS


@click.group()
def keys() -> None:
    """Decision keys and audit keys (--audit): list, rotate, retire."""


@keys.command("list")
@_AUDIT
@click.pass_obj
def list_keys(obj: Context, audit: bool) -> None:
    """Where the decision keys are and their ids, the current one first."""
    config = obj.load().config
    spec = _spec(audit)
    try:
        ring = read_keyring(spec, decision_keys_folder(config))
    except KeyringError as exc:
        click.echo(f"no usable {spec.purpose} key: {exc}", err=True)
        sys.exit(1)
    click.echo(ring.describe())


@keys.command("rotate")
@_AUDIT
@click.pass_obj
def rotate(obj: Context, audit: bool) -> None:
    """Put a new current key first in the key file; older keys stay and still verify what they sealed.

    A running Kazma seals with the new key after a restart, and verifies it at once. With several replicas or
    KAZMA_DECISION_KEY, change the variable on every replica instead: add the new key after the current one
    everywhere first, then move it first.
    """
    config = obj.load().config
    spec = _spec(audit)
    try:
        ring = rotate_key_file(spec, decision_keys_folder(config))
    except KeyringError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    path = spec.file(decision_keys_folder(config))
    click.echo(f"{path}: current key {ring.current.id}; kept: {', '.join(ring.ids[1:]) or '-'}")
    if audit:
        click.echo(
            "restart kazma run to sign with it; give verifiers the new public key (kazma audit public-key)", err=True
        )
    else:
        click.echo("restart kazma run to seal new decisions with it", err=True)


@keys.command("retire")
@click.argument("key_id")
@_AUDIT
@click.pass_obj
def retire(obj: Context, key_id: str, audit: bool) -> None:
    """Remove an older key: approvals it sealed no longer verify and will not run."""
    config = obj.load().config
    if audit:
        click.echo(
            "an audit key is never retired here: the checkpoints it signed must verify for as long as the log is "
            "kept. Rotate (kazma keys rotate --audit); verifiers keep its public key (kazma audit public-key)",
            err=True,
        )
        sys.exit(1)
    try:
        ring = retire_key(DECISION_KEYS, decision_keys_folder(config), key_id)
    except KeyringError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    click.echo(f"{DECISION_KEYS.file(decision_keys_folder(config))}: retired {key_id}; keys now: {', '.join(ring.ids)}")
    click.echo("restart kazma run: until then it still verifies with the retired key", err=True)
