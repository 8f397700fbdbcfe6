"""``kazma mcp serve``: Kazma's approval tool for any MCP client, over stdio."""

from __future__ import annotations

import os
import sys

import click

from kazma.bot.cli.context import Context


@click.group()
def mcp() -> None:
    """Kazma as an MCP server (request_approval)."""


@mcp.command("serve")
@click.option("--url", envvar="KAZMA_URL", default=None, help="Kazma's web address (default: web.public_url).")
@click.pass_obj
def serve(obj: Context, url: str | None) -> None:
    """Serve request_approval over stdio, asking the running Kazma through its API (token: $KAZMA_API_TOKEN)."""
    token = os.environ.get("KAZMA_API_TOKEN", "")
    if not token:
        click.echo("set KAZMA_API_TOKEN to an API token with the approval_requester role", err=True)
        sys.exit(2)
    base = url or obj.load().config.web.public_url
    from kazma.bot.cli.mcp_stdio import serve_stdio

    serve_stdio(base.rstrip("/"), token)
