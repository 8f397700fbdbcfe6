"""``kazma keys …``: the decision keys that seal every approval outcome (ids only; a secret is never printed)."""

from __future__ import annotations

import sys

import click

from kazma.bot.cli.context import Context
from kazma.bot.keys import decision_key_file, decision_keys_folder
from kazma.config.keyring import DECISION_KEYS, KeyringError, read_keyring, retire_key, rotate_key_file


@click.group()
def keys() -> None:
    """The decision keys that seal approvals: list, rotate, retire."""


@keys.command("list")
@click.pass_obj
def list_keys(obj: Context) -> None:
    """Where the decision keys are and their ids, the current one first."""
    config = obj.load().config
    try:
        ring = read_keyring(DECISION_KEYS, decision_keys_folder(config))
    except KeyringError as exc:
        click.echo(f"no usable decision key: {exc}", err=True)
        sys.exit(1)
    click.echo(ring.describe())


@keys.command("rotate")
@click.pass_obj
def rotate(obj: Context) -> None:
    """Put a new current key first in the key file; older keys stay and still verify what they sealed.

    A running Kazma seals with the new key after a restart, and verifies it at once. With several replicas or
    KAZMA_DECISION_KEY, change the variable on every replica instead: add the new key after the current one
    everywhere first, then move it first.
    """
    config = obj.load().config
    try:
        ring = rotate_key_file(DECISION_KEYS, decision_keys_folder(config))
    except KeyringError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    click.echo(f"{decision_key_file(config)}: current key {ring.current.id}; kept: {', '.join(ring.ids[1:]) or '-'}")
    click.echo("restart kazma run to seal new decisions with it", err=True)


@keys.command("retire")
@click.argument("key_id")
@click.pass_obj
def retire(obj: Context, key_id: str) -> None:
    """Remove an older key: approvals it sealed no longer verify and will not run."""
    config = obj.load().config
    try:
        ring = retire_key(DECISION_KEYS, decision_keys_folder(config), key_id)
    except KeyringError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    click.echo(f"{decision_key_file(config)}: retired {key_id}; keys now: {', '.join(ring.ids)}")
    click.echo("restart kazma run: until then it still verifies with the retired key", err=True)
