"""``kazma store …``: the store itself (``kazma store copy --to postgresql://…``)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import click

from kazma.bot.cli.context import Context
from kazma.config import KazmaConfig


@click.group()
def store() -> None:
    """The store itself: upgrade it, copy a SQLite store into PostgreSQL."""


@store.command("migrate")
@click.pass_obj
def migrate(obj: Context) -> None:
    """Upgrade the store an older Kazma made to this Kazma's schema, as `kazma run` does at start.

    The commands that only read (approvals list, audit export, swarm status, …) refuse an older store rather than
    change it under the older Kazma that may be running on it; this is the one that changes it without starting."""
    config = obj.load().config
    applied = asyncio.run(_migrate(config))
    if not applied:
        click.echo("the store is already at this Kazma's schema: nothing changed")
        return
    click.echo(f"applied {len(applied)} migrations: {', '.join(applied)}")


async def _migrate(config: KazmaConfig) -> list[str]:
    """The migrations applied now (component and version), each recorded; the store must exist already."""
    from kazma.bot.store import (
        all_migrations,
        pg_migrations,
        pg_schema_recorded,
        require_store,
        sqlite_schema_recorded,
        store_for_command,
    )

    await require_store(config)  # a mistyped path or URL is refused, never made into an empty store here

    async def recorded() -> set[tuple[str, int]]:
        if config.store.backend == "postgresql":
            return await pg_schema_recorded(config) or set()
        return sqlite_schema_recorded(config.store.path) or set()

    before = await recorded()
    async with store_for_command(config):
        pass  # opening applies every migration not recorded yet, under the store's lock
    now = await recorded() - before
    ordered = pg_migrations() if config.store.backend == "postgresql" else all_migrations()
    return [f"{m.component} v{m.version}" for m in ordered if (m.component, m.version) in now]


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
