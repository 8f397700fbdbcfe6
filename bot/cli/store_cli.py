"""``kazma store …``: the store itself (``kazma store copy --to postgresql://…``)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import click

from kazma.bot.cli.context import Context


@click.group()
def store() -> None:
    """The store itself: copy a SQLite store into PostgreSQL."""


@store.command("copy")
@click.option(
    "--to",
    "target",
    required=True,
    metavar="URL",
    help="postgresql://user:${PGPASSWORD}@host/db of an empty database; ${VAR} is taken from the environment.",
)
@click.option(
    "--from",
    "source",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The SQLite store to copy (default: the store kazma.yaml configures).",
)
@click.option("--connect-timeout", type=click.FloatRange(1, 600), default=10.0, show_default=True, help="Seconds.")
@click.pass_obj
def copy(obj: Context, target: str, source: Path | None, connect_timeout: float) -> None:
    """Copy every table of a SQLite store into an empty PostgreSQL database, then verify counts and hashes."""
    from kazma.bot.cli.store_copy import CopyError, copy_store, expand_url  # psycopg only when this command runs

    busy_timeout_ms = 5000
    if source is None:
        loaded = obj.load()
        if loaded.config.store.backend != "sqlite":
            click.echo("kazma store copy: the configured store is already PostgreSQL; give --from PATH", err=True)
            sys.exit(1)
        source = loaded.config.store.path
        busy_timeout_ms = loaded.config.store.busy_timeout_ms
    try:
        url = expand_url(target, os.environ)
        report = asyncio.run(copy_store(source, url, connect_timeout=connect_timeout, busy_timeout_ms=busy_timeout_ms))
    except CopyError as exc:
        click.echo(f"kazma store copy: {exc}", err=True)
        sys.exit(1)
    for line in report.lines():
        click.echo(line)
    if not report.ok:
        sys.exit(1)
