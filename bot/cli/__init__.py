"""The ``kazma`` command line: this package holds every command (``*_cli.py``), ``kazma doctor`` and its
checks, ``kazma init``'s configuration writer, ``kazma store copy`` and the scripted demo.

Only what ``kazma --version`` and ``kazma --help`` print is imported here;
each command's module (and the platform libraries, the store, the app behind
it) is imported when that command runs. Starting the whole application to
print a version took half a second.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import click

from kazma.bot import start_gc
from kazma.bot.cli.log_options import FORMATS, LEVELS, log_settings, set_log, with_log_options

# name: (module, attribute, the one line `kazma --help` shows). test_cli checks each line against the command's own.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "approvals": ("kazma.bot.cli.approvals_cli", "approvals", "List, inspect and decide approval requests."),
    "audit": ("kazma.bot.cli.audit_cli", "audit", "The audit chain: verify it, export it, print its public keys."),
    "config": ("kazma.bot.cli.core_cli", "config", "Inspect and validate kazma.yaml."),
    "demo": ("kazma.bot.cli.core_cli", "demo", "Play a scripted scenario end to end: no tokens, no model."),
    "doctor": (
        "kazma.bot.cli.core_cli",
        "doctor",
        "Check the configuration, each platform's tokens with the platform,...",
    ),
    "init": ("kazma.bot.cli.init_cli", "init", "Write a commented kazma.yaml in which you are an approver..."),
    "keys": (
        "kazma.bot.cli.keys_cli",
        "keys",
        "Decision keys and audit keys (--audit): list, rotate, retire.",
    ),
    "mcp": ("kazma.bot.cli.mcp_cli", "mcp", "Kazma as an MCP server (request_approval)."),
    "people": ("kazma.bot.cli.people_cli", "people", "People and their passkeys: list, invite, revoke."),
    "run": ("kazma.bot.cli.core_cli", "run", "Start every configured platform and serve until SIGINT or SIGTERM."),
    "setup": (
        "kazma.bot.cli.setup_cli",
        "setup",
        "Platform app settings, ready to paste: an app manifest, an invite URL.",
    ),
    "store": ("kazma.bot.cli.store_cli", "store", "The store itself: upgrade it, copy a SQLite store into PostgreSQL."),
    "swarm": ("kazma.bot.cli.swarm_cli", "swarm", "Drive the swarm with the same grammar as /swarm in chat."),
}


def load_command(name: str) -> click.Command:
    module, attribute, _ = COMMANDS[name]
    command: object = getattr(importlib.import_module(module), attribute)
    assert isinstance(command, click.Command)
    if name == "approvals" and isinstance(command, click.Group) and "request" not in command.commands:
        from kazma.bot.cli.approvals_request import request
        from kazma.bot.cli.rules_cli import rules

        command.add_command(request)
        command.add_command(rules)
    with_log_options(command)
    return command


class LazyGroup(click.Group):
    """Commands by name; a command's module is imported only when it runs (or its own help is asked)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return load_command(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] == "run":  # from before its module is imported: most of a start is imports
            start_gc.begin()  # until it serves (core_cli.run) or ends (invoke)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        """A configuration problem met inside any command (a store it cannot open yet, a bad value)
        ends the command with one line per problem and exit code 2, never a traceback."""
        from kazma.bot.cli.context import EXIT_CONFIG
        from kazma.config.errors import ConfigError

        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            for line in exc.lines:
                click.echo(line, err=True)
            ctx.exit(EXIT_CONFIG)
        finally:
            start_gc.end()  # a start that failed, or a command run in-process (tests): the collector as it was
            start_gc.thawed()

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "--version", "-V", package_name="kazma", prog_name="kazma")
@click.option(
    "--config",
    "-c",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="KAZMA_CONFIG",
    default=None,
    help="Path to kazma.yaml (default: ./kazma.yaml, or $KAZMA_CONFIG).",
)
@click.option(
    "--log-level",
    type=click.Choice(LEVELS),
    default=None,
    envvar="KAZMA_LOG_LEVEL",
    expose_value=False,
    callback=lambda ctx, _param, value: set_log(ctx, level=value),
    help="debug, info (the default), warning or error; `kazma demo` defaults to warning. Also after a subcommand.",
)
@click.option(
    "--log-format",
    type=click.Choice(FORMATS),
    default=None,
    expose_value=False,
    callback=lambda ctx, _param, value: set_log(ctx, fmt=value),
    help="auto (the default): readable on a terminal, JSON lines otherwise. Also after a subcommand.",
)
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """Kazma: a chat-platform bot bus for AI agent teams."""
    from kazma.bot.cli.context import Context

    log_settings(ctx).apply()
    ctx.obj = Context(config_path)
